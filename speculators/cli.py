"""Command line: ``speculators train RECIPE.yaml``, ``speculators eval CHECKPOINT``, ``speculators calibrate
RUN_DIR``, ``speculators push``, ``speculators check DIR``.

Thin: parses arguments, calls one workflow of :mod:`speculators.workflows` (or ``hub.push_checkpoint``)
and prints (log lines, progress, the eval report's tables, the final messages). A
:class:`SpeculatorsError` is printed as one ``error: ...`` line with exit status 2.
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
    from .recipe import load_recipe
    from .workflows import train_run

    rec = load_recipe(recipe, overrides or [])
    final = train_run(rec, output_dir, resume=resume, overwrite=overwrite, log=log, progress=_progress,
                      console=console, recipe_file=recipe)
    from accelerate import PartialState

    if PartialState().is_main_process:  # `accelerate launch`: one line, from rank 0
        console.print(f"[bold green]done[/bold green]: {final}  (next: speculators eval {final})")


@app.command()
@_user_errors
def data(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
):
    """Run only the data pipeline of RECIPE (regeneration + feature extraction into the on-disk cache)."""
    from .recipe import load_recipe
    from .workflows import data_run

    data_run(load_recipe(recipe, overrides or []), log=log, progress=_progress)


def _resolve_checkpoint(path: Path, allow_hub: bool = True) -> Path:
    """:func:`speculators.workflows.resolve_checkpoint`, logging to the console."""
    from .workflows import resolve_checkpoint

    return resolve_checkpoint(path, allow_hub=allow_hub, log=log)


# eval options that override the recipe's eval section: EvalSpec field -> option name (named in errors)
_EVAL_OPTIONS = {"k": "-k", "k_sweep": "-k", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                 "max_new_tokens": "--max-new-tokens", "num_prompts": "--num-prompts", "batch_size": "--batch-size",
                 "methods": "--methods", "confidence_threshold": "--confidence-threshold",
                 "confidence_cost_aware": "--cost-aware", "hybrid_drafter_k": "--hybrid-drafter-k", "trees": "--tree"}


def _parse_k(value: str | None) -> dict:
    """``-k 4`` -> ``{"k": 4}``; ``-k 1,2,4`` -> ``{"k_sweep": [1, 2, 4]}`` (validated by EvalSpec).

    Raises:
        SpeculatorsError: not comma-separated integers.
    """
    if value is None:
        return {}
    parts = [p.strip() for p in str(value).split(",")]
    try:
        ks = [int(p) for p in parts]
    except ValueError:
        raise SpeculatorsError(f"-k {value}: expected an integer or comma-separated integers, e.g. -k 4 or "
                               f"-k 1,2,4,6,8") from None
    return {"k": ks[0]} if len(ks) == 1 else {"k_sweep": ks}


@app.command("eval")
@_user_errors
def eval_cmd(
    checkpoint: Path = typer.Argument(..., help="drafter checkpoint, a run directory (uses final/), or a "
                                      "pushed drafter's Hub id (namespace/name)"),
    prompts: Optional[list[str]] = typer.Option(None, "--prompts", help="data source of prompts, repeatable: "
                                                "JSONL/JSON (OpenAI messages or ShareGPT), hf:NAME[:SPLIT], "
                                                "humaneval, chatterbot (default: the recipe's held-out prompts)"),
    k: Optional[str] = typer.Option(None, "-k", "--k", "--num-speculative-tokens",
                                    help="drafts per step (K), or a sweep: -k 1,2,4,6,8 (one row per K)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="loaded batch size reported beside "
                                             "batch 1 (default: 16 on CUDA, 8 on CPU)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N (default: CUDA when present)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="target dtype: auto, float32, bfloat16, float16 "
                                        "(default: the dtype the checkpoint was trained against; auto = bfloat16 "
                                        "on a GPU or an AVX512-BF16/AMX CPU, else float32)"),
    methods: Optional[str] = typer.Option(None, "--methods", help="proposers to measure beside plain decoding, "
                                          "comma-separated: drafter,drafter_argmax,ngram,suffix,hybrid (default: all but "
                                          "drafter_argmax, which is added beside drafter at temperature > 0: the "
                                          "drafter under vLLM's default draft_sample_method greedy)"),
    compare: Optional[list[str]] = typer.Option(None, "--compare", help="another checkpoint / run directory / "
                                                "Hub id to compare on the same prompts (repeatable)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    target_model: Optional[str] = typer.Option(None, "--target", help="override the target model"),
    output: Optional[Path] = typer.Option(None, "--output", help="report directory"),
    confidence_threshold: Optional[float] = typer.Option(
        None, "--confidence-threshold", help="also measure the drafter confidence-gated: verify only the drafts "
        "before the first whose survival prod c_i falls below this value in (0, 1) (lossless)"),
    cost_aware: Optional[bool] = typer.Option(
        None, "--cost-aware/--no-cost-aware", help="gated rows pick the prefix maximising expected tokens per "
        "unit of verify cost (cost of K+1-token target forwards measured once on this machine)"),
    hybrid_drafter_k: Optional[int] = typer.Option(
        None, "--hybrid-drafter-k", help="hybrid proposer: most drafts the neural drafter proposes per step "
        "(default: K; suffix matches still draft K)"),
    tree: Optional[list[str]] = typer.Option(
        None, "--tree", help="also measure the drafter drafting a TREE per step, repeatable (one row each): "
        "depth=D,topk=K,total_tokens=N (a dynamic tree: expand the top-k, keep the N best) or a vLLM speculative_token_tree such as "
        "'[(0,), (1,), (0, 0)]' (or a file holding one); the report adds the best static tree for this machine"),
    engine: Optional[str] = typer.Option(
        None, "--engine", help="measure inside a serving engine instead of our loop: llama.cpp (llama-server, "
        "built by `make llama-cpp`; plain, the drafter at each K, ngram-simple and ngram-mod, quantized draft, "
        "p_min, several slots; report in RUN_DIR/eval-llamacpp) or vllm (vLLM's CPU build, `make vllm`; plain, the "
        "drafter at each K, vLLM's ngram, 1 and 4 requests in flight; report in RUN_DIR/eval-vllm)"),
    slots: Optional[str] = typer.Option(None, "--slots", help="--engine: server slots (parallel requests; vllm: "
                                        "requests in flight), comma-separated, e.g. 1,4 (default 1,4)"),
    p_min: Optional[str] = typer.Option(None, "--p-min", help="--engine: --spec-draft-p-min values measured at the "
                                        "best K and the largest, comma-separated (default 0.2,0.5,0.8)"),
    draft_outtypes: Optional[str] = typer.Option(None, "--draft-outtypes", help="--engine: draft GGUF types, the "
                                                 "first measured at every K, the others at the best (default f16,q8_0)"),
    draft_threads: Optional[str] = typer.Option(None, "--draft-threads", help="--engine: --spec-draft-threads values "
                                                "measured at the best K, comma-separated (default 1)"),
    target_type: Optional[str] = typer.Option(None, "--target-type", help="--engine llama.cpp: serve the target in "
                                              "this weight type, made by llama.cpp's converter or llama-quantize: "
                                              "f32, f16, bf16, q8_0, q4_0, q4_1, q4_k_s, q4_k_m, iq4_nl, q5_0, "
                                              "q5_k_m, q6_k (default: the target GGUF as shipped)"),
):
    """Measure acceptance (tau with a 95% CI, per-position acceptance, speedup at batch 1 and under load) by
    real speculative generation: the drafter, n-gram, suffix decoding and hybrid proposers, every K."""
    loop_only = {"--batch-size": batch_size, "--device": device, "--dtype": dtype, "--methods": methods,
                 "--compare": compare, "--top-p": top_p, "--top-k": top_k, "--tree": tree,
                 "--confidence-threshold": confidence_threshold, "--cost-aware": cost_aware,
                 "--hybrid-drafter-k": hybrid_drafter_k}
    engine_only = {"--slots": slots, "--p-min": p_min, "--draft-outtypes": draft_outtypes,
                   "--draft-threads": draft_threads, "--target-type": target_type}
    unused = [o for o, v in (loop_only if engine is not None else engine_only).items() if v]
    if unused:
        raise SpeculatorsError(f"{', '.join(unused)}: " + ("not used by --engine (our loop's options)" if engine
                               is not None else "only with --engine llama.cpp"))
    if engine is not None:
        _engine_eval(engine, checkpoint, k=k, temperature=temperature, slots=slots, p_min=p_min,
                     draft_outtypes=draft_outtypes, draft_threads=draft_threads, target_type=target_type,
                     max_new_tokens=max_new_tokens, num_prompts=num_prompts,
                     prompts=prompts, target_model=target_model, output=output)
        return
    from .workflows import eval_run

    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new_tokens,
             "num_prompts": num_prompts, "batch_size": batch_size, **_parse_k(k),
             "methods": None if methods is None else [m.strip() for m in methods.split(",") if m.strip()],
             "confidence_threshold": confidence_threshold, "confidence_cost_aware": cost_aware,
             "hybrid_drafter_k": hybrid_drafter_k, "trees": tree or None}
    report, out = eval_run(checkpoint, eval_overrides={f: v for f, v in given.items() if v is not None},
                           prompts=prompts or None, target_model=target_model, output=output, log=log,
                           progress=_progress, override_names=_EVAL_OPTIONS, device=device, compare=compare or (),
                           dtype=dtype)
    from .evaluation.report import render_terminal

    render_terminal(report, console)
    log(f"report written to {out}/report.json, report.md and the plots")
    # only a mismatch that is not a near-tie of the target's logits (speculators.evaluation.greedy_check) fails: in
    # float32 that is every mismatch
    failures = [m for m in report.get("greedy_mismatches") or [] if not m.get("near_tie")]
    if failures:
        console.print(f"[bold red]error:[/bold red] speculative output differs from plain greedy decoding "
                      f"on {len(failures)} prompt(s) beyond the rounding of the target's logits: {failures}")
        raise typer.Exit(1)


def _csv(value: str | None, cast, option: str) -> tuple | None:
    """``"1,4"`` -> ``(1, 4)`` through ``cast``; None stays None.

    Raises:
        SpeculatorsError: naming ``option``, a value ``cast`` refuses.
    """
    if value is None:
        return None
    try:
        return tuple(cast(p.strip()) for p in str(value).split(",") if p.strip())
    except ValueError:
        raise SpeculatorsError(f"{option} {value}: expected comma-separated values, e.g. {option} 1,4") from None


def _engine_eval(engine: str, checkpoint: Path, *, k, temperature, slots, p_min, draft_outtypes, draft_threads,
                 target_type, max_new_tokens,
                 num_prompts, prompts, target_model, output) -> None:
    """``speculators eval RUN --engine llama.cpp`` (:func:`speculators.workflows.engine_eval_run`) or ``--engine vllm``
    (:func:`speculators.workflows.vllm_eval_run`)."""
    from .workflows import engine_eval_run

    if engine.lower() == "vllm":
        _vllm_eval(checkpoint, k=k, temperature=temperature, slots=slots, unused={
            "--p-min": p_min, "--draft-outtypes": draft_outtypes, "--draft-threads": draft_threads,
            "--target-type": target_type},
            max_new_tokens=max_new_tokens, num_prompts=num_prompts, prompts=prompts, target_model=target_model,
            output=output)
        return
    if engine.lower() not in ("llama.cpp", "llamacpp", "llama-cpp"):
        raise SpeculatorsError(f"--engine {engine}: not a supported engine; allowed: llama.cpp, vllm")
    ks = _parse_k(k)
    given = {"ks": tuple(ks.get("k_sweep", [ks["k"]] if "k" in ks else [])) or None,
             "temperatures": None if temperature is None else (0.0,) if temperature == 0 else (0.0, temperature),
             "parallel": _csv(slots, int, "--slots"), "p_mins": _csv(p_min, float, "--p-min"),
             "draft_outtypes": _csv(draft_outtypes, str, "--draft-outtypes"),
             "draft_threads": _csv(draft_threads, int, "--draft-threads"), "max_new_tokens": max_new_tokens,
             "target_type": target_type}
    report, out = engine_eval_run(checkpoint, {f: v for f, v in given.items() if v is not None},
                                  num_prompts=num_prompts, prompts=prompts or None, target_model=target_model,
                                  output=output, log=log)
    best, fastest = report["best"], report.get("fastest")
    if best.get("serve"):
        console.print(f"best drafter setting in llama.cpp here: {best['row']} ({best['tokens_per_s']:.1f} tok/s; plain "
                      f"{best['plain_tokens_per_s']:.1f}; {best['ngram_best']} {best['ngram_tokens_per_s']:.1f}):\n"
                      f"  {best['serve']}")
    if fastest and fastest.get("serve"):
        console.print(f"fastest setting overall: {fastest['row']} ({fastest['tokens_per_s']:.1f} tok/s):\n"
                      f"  {fastest['serve']}")
    log(f"report written to {out}/report.json and report.md")
    nc = report.get("negative_control")
    if nc and not nc["separated"]:
        console.print(f"[bold yellow]warning:[/bold yellow] the negative control (aux taps {nc['tap_shift']} layers deeper) "
                      f"accepted about as much as the drafter (tau {nc['tau']} against {nc['drafter_tau']}): this run "
                      "cannot show that the engine reads the layers the drafter was trained on (an untrained drafter?)")
    if not report["greedy_check"]["passed"]:
        console.print("[bold red]error:[/bold red] an engine output with the drafter differs from the engine's plain "
                      f"greedy output beyond a near-tie: {[m for m in report['greedy_check']['mismatches'] if not m['near_tie']]}")
        raise typer.Exit(1)


def _vllm_eval(checkpoint: Path, *, k, temperature, slots, unused: dict, max_new_tokens, num_prompts, prompts,
               target_model, output) -> None:
    """``speculators eval RUN --engine vllm`` (:func:`speculators.workflows.vllm_eval_run`)."""
    from .workflows import vllm_eval_run

    given_unused = [o for o, v in unused.items() if v]
    if given_unused:
        raise SpeculatorsError(f"{', '.join(given_unused)}: only with --engine llama.cpp")
    if temperature not in (None, 0, 0.0):
        raise SpeculatorsError(f"--temperature {temperature}: --engine vllm measures temperature 0 (its greedy check "
                               "and per-step acceptance); sampled acceptance is measured by our loop")
    ks = _parse_k(k)
    given = {"ks": tuple(ks.get("k_sweep", [ks["k"]] if "k" in ks else [])) or None,
             "concurrency": _csv(slots, int, "--slots"), "max_new_tokens": max_new_tokens}
    report, out = vllm_eval_run(checkpoint, {f: v for f, v in given.items() if v is not None}, num_prompts=num_prompts,
                                prompts=prompts or None, target_model=target_model, output=output, log=log)
    best = report["best"]
    if report.get("serve"):
        console.print(f"best drafter setting in vLLM here: {best['row']} ({best['tokens_per_s']:.1f} tok/s; plain "
                      f"{best['plain_tokens_per_s']:.1f}; {best['ngram_best']} {best['ngram_tokens_per_s'] or 0:.1f}):\n"
                      f"  {report['serve']}")
    log(f"report written to {out}/report.json and report.md")
    if not report["greedy_check"]["passed"]:
        console.print("[bold red]error:[/bold red] a vLLM output with a speculative method differs from vLLM's plain "
                      f"greedy output beyond a near-tie: {[m for m in report['greedy_check']['mismatches'] if not m['near_tie']]}")
        raise typer.Exit(1)


export_app = typer.Typer(no_args_is_help=True, help="Write a checkpoint in a serving engine's own format.")
app.add_typer(export_app, name="export")


@export_app.command("gguf")
@_user_errors
def export_gguf_cmd(
    checkpoint: Path = typer.Argument(..., help="run directory (uses final/) or drafter checkpoint"),
    outtype: str = typer.Option("f16", "--outtype", help="draft GGUF types, comma-separated: f32, f16, bf16, q8_0"),
    target_model: Optional[str] = typer.Option(None, "--target", help="override the target model"),
):
    """Convert the drafter (and a target that is not a GGUF yet) to GGUF with llama.cpp's converter, into
    RUN_DIR/gguf/, and print the llama-server command that serves them."""
    from .workflows import gguf_export_run

    res = gguf_export_run(checkpoint, target_model=target_model, outtypes=_csv(outtype, str, "--outtype") or ("f16",),
                          log=log)
    for o, path in res["drafts"].items():
        console.print(f"draft ({o}): {path}")
    console.print(f"target: {res['target']}\nserve it with:\n  {res['serve']}")


@app.command()
@_user_errors
def calibrate(
    checkpoint: Path = typer.Argument(..., help="run directory (uses final/) or drafter checkpoint"),
    k: Optional[int] = typer.Option(None, "-k", "--k", help="positions to calibrate (default: all the drafter has)"),
    prompts: Optional[list[str]] = typer.Option(None, "--prompts", help="data source of prompts, repeatable "
                                                "(default: the recipe's held-out prompts)"),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t"),
    fit_fraction: float = typer.Option(0.5, "--fit-fraction", help="share of the prompts that fit the "
                                       "calibration; the others measure ECE"),
    store: bool = typer.Option(True, "--store/--no-store", help="write the calibration into the checkpoint"),
    min_tau_ratio: float = typer.Option(0.97, "--min-tau-ratio", min=0.0, max=1.0, help="the recommended gate "
                                        "threshold cuts the most verified drafts with a simulated tau ratio >= this"),
    temperature_only: bool = typer.Option(False, "--temperature-only", help="fit a temperature per position only "
                                          "(STS); default: a temperature and a shift per position (Platt scaling)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N (default: CUDA when present)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="target dtype: auto, float32, bfloat16, float16 "
                                        "(default: the dtype the checkpoint was trained against)"),
    target_model: Optional[str] = typer.Option(None, "--target", help="override the target model"),
    output: Optional[Path] = typer.Option(None, "--output", help="report directory (default: RUN_DIR/calibration)"),
    skip_prompts: Optional[int] = typer.Option(None, "--skip-prompts", min=0, help="leading prompts not used (default: "
                                               "the recipe's eval.num_prompts held-out prompts that `speculators eval` "
                                               "scores; 0 with --prompts)"),
):
    """Calibrate the drafter's confidence head (per-position temperature and shift, fitted left to right) on
    held-out prompts; report the survival ECE before and after with a reliability diagram; store the
    calibration in the checkpoint."""
    from .workflows import calibrate_run

    given = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "temperature": temperature}
    report, out = calibrate_run(checkpoint, eval_overrides={f: v for f, v in given.items() if v is not None}, k=k,
                                prompts=prompts or None, target_model=target_model, output=output, store=store,
                                fit_fraction=fit_fraction, device=device, dtype=dtype, log=log,
                                override_names=_EVAL_OPTIONS, skip_prompts=skip_prompts,
                                fit_bias=not temperature_only, min_tau_ratio=min_tau_ratio)
    console.print(f"survival ECE {report['before']['ece']:.4f} -> {report['after']['ece']:.4f} "
                  f"({report['split']}); T = {[round(x, 3) for x in report['temperatures_after'][:report['k']]]}"
                  + ("" if temperature_only else f", b = {[round(x, 3) for x in report['biases_after'][:report['k']]]}"))
    chosen = report.get("recommended_threshold")
    if chosen:
        temps = ("the fitted calibration, now stored" if report["stored"]
                 else "the checkpoint's own calibration (the fitted one was not stored)")
        console.print(f"gate threshold chosen on these prompts: {chosen['threshold']:g} (verified drafts "
                      f"-{100 * chosen['verified_cut']:.0f}%, tau x{chosen['tau_ratio']:.3f} estimated; with {temps}): "
                      f"speculators eval {checkpoint} --confidence-threshold {chosen['threshold']:g}")
    log(f"report written to {out}/calibration.md (reliability diagram {out}/reliability.png)")


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


@app.command()
@_user_errors
def check(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory (config.json + model.safetensors), or a run "
                                      "directory (uses final/)"),
    num_sequences: int = typer.Option(3, "--num-sequences", "-n", help="sequences compared with the reference"),
    target_model: Optional[str] = typer.Option(None, "--target", help="target model whose hidden states feed both "
                                               "sides (default: the one the checkpoint records)"),
    reference_python: Optional[Path] = typer.Option(
        None, "--reference-python", help="python of a venv with vllm-project/speculators 0.9.0 (default: "
        "$SPECULATORS_REFERENCE_PYTHON, ./.venv-reference, else one is built in the cache)"),
    no_parity: bool = typer.Option(False, "--no-parity", help="only the static vLLM layout check"),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="also serve the directory in vLLM itself (`make vllm`) "
                              "and compare its outputs and accepted drafts with our loop's; skipped, saying why, "
                              "without a vLLM venv or a vLLM method for the family"),
    vllm_python: Optional[Path] = typer.Option(
        None, "--vllm-python", help="python of a venv with vLLM 0.32.0 (default: $SPECULATORS_VLLM_PYTHON, "
        "./.venv-vllm, else the cache)"),
    write: bool = typer.Option(True, "--write/--no-write", help="record the result as DIR/parity.json (what "
                               "`speculators push` puts on the model card)"),
):
    """Check an exported checkpoint: every tensor's name and shape against vLLM 0.33.0's loader, then load it
    with the reference implementation (vllm-project/speculators 0.9.0) and compare the first drafting step with
    ours (pass: max |delta logit| <= 1e-4 in float32 and equal argmax), then serve it in vLLM 0.32.0 itself on
    3 held-out prompts (the run's recipe) or built-in chat prompts: vLLM's speculative output must equal its plain
    output, vLLM's accepted drafts per step must equal our loop's, and a copy with its head perturbed must be told
    apart. The result is written to DIR/parity.json (the model card of `speculators push` shows it). Exit status
    1 on a failure, 0 when everything checked passed (a check that could not run is reported, not failed)."""
    from .export.gate import check_checkpoint

    if (checkpoint / "final" / "config.json").is_file():
        checkpoint = checkpoint / "final"
    target = None
    if target_model is not None and not no_parity:
        from .drafters.checkpoint import read_checkpoint_config, read_target_meta
        from .target import Target

        meta = read_target_meta(read_checkpoint_config(checkpoint), checkpoint / "config.json")
        target = Target.load(target_model, aux_layer_ids=list(meta.aux_layer_ids), log=log)
    from .workflows import held_out_prompt_ids

    prompts = held_out_prompt_ids(checkpoint, target, num_sequences, log) if vllm and not no_parity else None
    res = check_checkpoint(checkpoint, target=target, num_sequences=num_sequences,
                           reference_python=reference_python, parity=not no_parity, log=log,
                           serve=vllm and not no_parity, prompts=prompts, vllm_python=vllm_python)
    console.print(res.to_markdown(), markup=False)
    if write:
        import json

        from .utils import atomic_write_text

        try:
            atomic_write_text(checkpoint / "parity.json", json.dumps(res.to_json(), indent=2) + "\n")
        except OSError as e:  # e.g. a read-only Hub cache: the check stands, only the record is not kept
            log(f"check: could not write {checkpoint / 'parity.json'} ({e}); use --no-write to silence this")
    if res.passed is False:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
