"""Command line: ``speculators train RECIPE.yaml``, ``speculators eval CHECKPOINT``, ``speculators push``.

Thin: parses arguments, calls library functions, prints. A :class:`SpeculatorsError` is printed as
one ``error: ...`` line with exit status 2.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import SpeculatorsError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train speculative-decoding drafters and measure them with a lossless verifier.")
console = Console(highlight=False, soft_wrap=True)
_T0 = time.time()


def log(msg: str) -> None:
    """Print ``msg`` after the seconds since start, flushed at once (also when stdout is a file or a pipe).

    ``msg`` is plain text: brackets in it (``[humaneval]``, ``[/x]``) are printed as they are, not read
    as rich markup.
    """
    from rich.markup import escape

    console.print(f"[dim]{time.time() - _T0:7.1f}s[/dim] {escape(msg)}")


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpeculatorsError as e:
            from rich.markup import escape

            console.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2) from None
    return wrapper


# units of the phases' (done, total) counts, by description prefix (rate lines read "<n> <unit>/s")
_PROGRESS_UNITS = {"regenerating": "prompts", "target features": "tokens", "speculative vs plain": "prompts"}


@contextlib.contextmanager
def _progress():
    """Yield a factory ``make(description) -> callable(done, total)`` backed by one progress reporter.

    A rich bar on a terminal; plain timestamped lines while the phase runs when stdout is a file or a
    pipe; nothing with ``SPECULATORS_NO_PROGRESS=1`` (see ``speculators.progress``).
    """
    from .progress import ProgressReporter

    with ProgressReporter(console=console, log=log) as prog:
        def make(description: str):
            unit = next((u for k, u in _PROGRESS_UNITS.items() if description.startswith(k)), "it")
            return prog.callback(description, unit=unit)
        yield make


@app.command()
@_user_errors
def train(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides, e.g. train.lr=1e-4"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="run directory"),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint in the run directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="delete an existing run directory first"),
):
    """Train a drafter for a frozen target as described by RECIPE."""
    from .data.pipeline import check_run_identity, load_data, prepare_data, record_run_identity
    from .drafters import registry
    from .recipe import load_recipe
    from .target import Target
    from .train import Trainer, check_output_dir, prepare_output_dir

    rec = load_recipe(recipe, overrides or [])
    out = Path(output_dir or rec.output_dir or Path("outputs") / recipe.stem)
    check_output_dir(out, resume, overwrite)
    if resume and (out / "recipe.yaml").is_file():
        import yaml

        old = yaml.safe_load((out / "recipe.yaml").read_text()) or {}
        new = rec.model_dump(mode="json")
        changed = [k for k in ("target", "data", "drafter") if old.get(k) != new.get(k)]
        if changed:
            raise SpeculatorsError(f"--resume: the recipe's {', '.join(changed)} section(s) differ from the run's "
                                   f"{out / 'recipe.yaml'}; resume with the same recipe or use --overwrite")
    log(f"recipe {recipe} -> {out} (drafter {rec.drafter['algorithm']})")
    import torch

    torch.manual_seed(rec.train.seed)
    loaded = load_data(rec, log)  # the data's identity is its content (not the file names)
    identity = dict(loaded[1])
    if resume:
        check_run_identity(out, identity, prefix="data.")  # before the target loads: refuse changed data early
    target = Target.load(rec.target.model, rec.target.dtype, rec.target.aux_layer_ids, log=log)
    identity["target (weights, config, chat template)"] = target.fingerprint
    if resume and not check_run_identity(out, identity) and (out / "recipe.yaml").is_file():
        log(f"--resume: {out} records no data identity (older run): the data cannot be checked")
    with _progress() as make:
        data = prepare_data(rec, target, log=log, progress=make, loaded=loaded)
    family = registry.get(rec.drafter["algorithm"])
    torch.manual_seed(rec.train.seed)  # drafter init does not depend on what the data step consumed
    drafter = family.from_target(rec.drafter_config(), target, data.vocab)
    if rec.train.init_from:
        drafter.init_from_checkpoint(rec.train.init_from)
        log(f"drafter weights initialised from {rec.train.init_from}")
    if drafter.trains_target and (data.held_out is None or len(data.held_out) == 0):
        raise SpeculatorsError("drafter.joint: true trains the target, whose held-out perplexity must be "
                               "measured: set data.held_out.fraction > 0")
    drafter.enable_joint_training(target)
    prepare_output_dir(out, resume, overwrite)
    record_run_identity(out, identity)
    groups = drafter.param_groups(rec.train.lr)
    n_train = sum(p.numel() for p in groups[0]["params"])
    log(f"drafter {family.algorithm}: {n_train / 1e6:.2f}M trainable parameters, draft vocab {data.vocab.size}")
    if drafter.trains_target:
        log(f"joint: the target is trained too, {sum(p.numel() for p in groups[1]['params']) / 1e6:.2f}M LoRA "
            f"parameters at lr {groups[1]['lr']}")
    final = Trainer(rec, drafter, data, out, log=log, console=console).train(resume=resume)
    console.print(f"[bold green]done[/bold green]: {final}  (next: speculators eval {final})")


@app.command()
@_user_errors
def data(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
):
    """Run only the data pipeline of RECIPE (regeneration + feature extraction into the on-disk cache)."""
    from .data.pipeline import prepare_data
    from .recipe import load_recipe
    from .target import Target

    rec = load_recipe(recipe, overrides or [])
    target = Target.load(rec.target.model, rec.target.dtype, rec.target.aux_layer_ids, log=log)
    with _progress() as make:
        prepare_data(rec, target, log=log, progress=make)


def _resolve_checkpoint(path: Path, allow_hub: bool = True) -> Path:
    from .hub import looks_like_hub_id, pull_checkpoint
    from .train import checkpoints

    if allow_hub and looks_like_hub_id(str(path)):  # no such local path: a pushed drafter's namespace/name
        log(f"{path}: no such local directory; downloading it from the Hugging Face Hub")
        return pull_checkpoint(str(path))
    if (path / "config.json").is_file():
        return path
    if (path / "final" / "config.json").is_file():
        return path / "final"
    ck = checkpoints(path)
    if ck:
        return ck[-1]
    diverged = sorted(p.name for p in (path / "checkpoints").glob("diverged-step-*")) if path.is_dir() else []
    if diverged:  # set aside by the trainer: non-finite weights, or weights that gave a NaN/inf loss
        raise SpeculatorsError(f"{str(path)!r} has no good checkpoint: the run diverged and {', '.join(diverged)} "
                               "gave a NaN/inf loss or holds non-finite weights; retrain (e.g. lower train.lr)")
    raise SpeculatorsError(f"{str(path)!r} is neither a drafter checkpoint nor a run directory with one")


@app.command("eval")
@_user_errors
def eval_cmd(
    checkpoint: Path = typer.Argument(..., help="drafter checkpoint, a run directory (uses final/), or a "
                                      "pushed drafter's Hub id (namespace/name)"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="data source of prompts (default: the "
                                          "recipe's held-out prompts)"),
    k: Optional[int] = typer.Option(None, "-k", "--num-speculative-tokens", help="drafts per step (K)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    target_model: Optional[str] = typer.Option(None, "--target", help="override the target model"),
    output: Optional[Path] = typer.Option(None, "--output", help="report directory"),
):
    """Measure acceptance (tau, per-position acceptance, speedup) by real speculative generation."""
    import yaml

    from .data.chat import prompt_messages, render_prompt
    from .data.pipeline import load_conversations, split_conversations
    from .data.sources import load_source
    from .drafters import Drafter
    from .evaluate import run_eval, write_report
    from .generate import Sampling
    from .hub import looks_like_hub_id
    from .recipe import recipe_from_dict
    from .target import Target

    from_hub = looks_like_hub_id(str(checkpoint))
    ckpt = _resolve_checkpoint(checkpoint)
    drafter = Drafter.from_pretrained(ckpt)
    rec_file = ckpt / "recipe.yaml"
    rec = recipe_from_dict(yaml.safe_load(rec_file.read_text()), str(rec_file)) if rec_file.is_file() else None
    if rec is None and target_model is None:
        raise SpeculatorsError(f"{ckpt} has no recipe.yaml; pass --target")
    ev = rec.eval if rec is not None else None
    k = k if k is not None else (ev.k if ev else 4)
    for name, val, ok in (("-k", k, k is not None and k >= 1), ("--temperature", temperature, temperature is None or temperature >= 0),
                          ("--top-p", top_p, top_p is None or 0 < top_p <= 1), ("--top-k", top_k, top_k is None or top_k >= 0),
                          ("--max-new-tokens", max_new_tokens, max_new_tokens is None or max_new_tokens > 0),
                          ("--num-prompts", num_prompts, num_prompts is None or num_prompts > 0)):
        if not ok:
            raise SpeculatorsError(f"{name} {val} is out of range")
    sampling = Sampling(temperature if temperature is not None else (ev.temperature if ev else 0.0),
                        top_k if top_k is not None else (ev.top_k if ev else 0),
                        top_p if top_p is not None else (ev.top_p if ev else 1.0))
    max_new = max_new_tokens if max_new_tokens is not None else (ev.max_new_tokens if ev else 128)
    n_prompts = num_prompts if num_prompts is not None else (ev.num_prompts if ev else 16)
    target = Target.load(target_model or rec.target.model, rec.target.dtype if rec else "float32", log=log)
    drafter.check_target(target, warn=log)
    drafter.prepare_target(target, log=log)  # joint checkpoints: verify against the fine-tuned target
    drafter.attach_target(target)  # families that draft through the target's frozen head need it
    template = rec.data.chat_template if rec else None
    if template is not None:
        target.chat_template = template  # decoding stops at this template's end-of-turn too (stop_token_ids)
    if prompts is not None:
        convs = load_source(prompts)
        label = prompts
    else:
        if rec is None:
            raise SpeculatorsError("no recipe in the checkpoint: pass --prompts SOURCE")
        _, held = split_conversations(load_conversations(rec), rec)
        convs = [c for c, _ in held]
        label = "held-out split of the recipe's sources"
        if not convs:
            raise SpeculatorsError("the recipe has no held-out prompts (data.held_out.fraction = 0); pass --prompts")
    seen, plist = set(), []
    for c in convs:
        pm = prompt_messages(c.messages)
        if repr(pm) in seen:
            continue
        seen.add(repr(pm))
        plist.append({"id": c.id, "input_ids": render_prompt(target.tokenizer, pm, template)})
        if len(plist) >= n_prompts:
            break
    log(f"eval: {len(plist)} prompts ({label}), K={k}, temperature {sampling.temperature}, "
        f"top_p {sampling.top_p}, top_k {sampling.top_k}, max_new_tokens {max_new}")
    with _progress() as make:
        report = run_eval(target, drafter, plist, k, max_new, sampling,
                          ngram_max=ev.ngram_max if ev else 3, seed=ev.seed if ev else 0,
                          log=log, progress=make("speculative vs plain decoding"))
    report["checkpoint"] = str(ckpt)
    report["target"] = {"name_or_path": target.name_or_path, "fingerprint": target.fingerprint,
                        "adapter": None if drafter.target_adapter_dir is None else str(drafter.target_adapter_dir)}
    report["prompts"] = label
    # a pulled drafter lives in the Hub cache: its reports go under ./outputs/hub/ instead
    base = Path("outputs") / "hub" / str(checkpoint).replace("/", "--") if from_hub else ckpt.parent
    out = output or base / f"eval-k{k}-t{sampling.temperature:g}"
    write_report(report, out, title=f"speculators eval: {ckpt}")
    _print_report(report)
    log(f"report written to {out}/report.json and report.md")
    mm = report.get("greedy_mismatches")
    if mm:
        console.print(f"[bold red]error:[/bold red] speculative output differs from plain greedy decoding "
                      f"on {len(mm)} prompt(s): {mm}")
        raise typer.Exit(1)


@app.command()
@_user_errors
def push(
    checkpoint: Path = typer.Argument(..., help="drafter checkpoint (or a run directory: uses final/)"),
    repo_id: str = typer.Argument(..., help="Hub model repo, 'namespace/name' (created if missing)"),
    private: bool = typer.Option(False, "--private", help="create the repo as private"),
    revision: Optional[str] = typer.Option(None, "--revision", help="branch to commit to (default: main)"),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN / hf auth login)"),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="commit message"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be uploaded; contact nothing"),
):
    """Upload the drafter (config.json + model.safetensors, vLLM's format) with a model card to the Hub."""
    from .hub import push_checkpoint

    push_checkpoint(_resolve_checkpoint(checkpoint, allow_hub=False), repo_id, private=private, token=token,
                    revision=revision, commit_message=message, dry_run=dry_run, log=log)


def _print_report(report: dict) -> None:
    t = Table(title=f"acceptance (K={report['k']}, temperature {report['temperature']})")
    for col in ("method", "tau", "acc. rate", "tokens/s", "speedup"):
        t.add_column(col)
    d, n = report["drafter"], report["ngram"]
    t.add_row("drafter", f"{d['tau']:.3f}", f"{d['acceptance_rate']:.3f}", f"{d['tokens_per_s']:.1f}",
              f"{report['speedup']:.2f}x")
    t.add_row("n-gram", f"{n['tau']:.3f}", f"{n['acceptance_rate']:.3f}", f"{n['tokens_per_s']:.1f}",
              f"{report['ngram_speedup']:.2f}x")
    t.add_row("plain", "1.000", "-", f"{report['plain']['tokens_per_s']:.1f}", "1.00x")
    console.print(t)
    p = Table(title="per-position acceptance")
    p.add_column("")
    for i in range(report["k"]):
        p.add_column(str(i + 1))
    p.add_row("drafter acc_k", *[f"{x:.3f}" for x in d["per_position"]])
    p.add_row("drafter cond acc_k", *[f"{x:.3f}" for x in d["conditional"]])
    p.add_row("n-gram acc_k", *[f"{x:.3f}" for x in n["per_position"]])
    console.print(p)
    mm = report.get("greedy_mismatches")
    if mm is not None and not mm:
        console.print("greedy losslessness: speculative output == plain greedy output on every prompt")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
