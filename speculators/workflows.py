"""The train, data and eval workflows: the one orchestration layer between the command line and the library.

``speculators.cli`` parses arguments, calls one function here and prints; everything a command DOES
(output-directory rules, ``--resume`` identity checks, loading the target and the data, building the
drafter, training, evaluating) happens here, so it can be driven from Python as well::

    from speculators.recipe import load_recipe
    from speculators.workflows import eval_run, train_run

    final = train_run(load_recipe("recipes/tiny-eagle3.yaml", ["target.model=DIR"]), "outputs/tiny")
    report, report_dir = eval_run(final, eval_overrides={"k": 3})

Nothing below this module imports it (nor the CLI).

Callbacks shared by the workflows:
    log: ``log(msg: str)`` for one plain log line (default :func:`print`).
    progress: a zero-argument callable returning a context manager that yields
        ``make(description) -> callable(done, total)`` (e.g. ``speculators.cli._progress``, backed by a
        :class:`speculators.progress.ProgressReporter`), or None for no progress display. It is
        entered only around the data pipeline and the eval decoding; the trainer draws its own.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from .errors import SpeculatorsError
from .utils import atomic_write_text
from .recipe import EvalSpec, Recipe, eval_spec_with, load_recipe
from .evaluation.loading import check_eval_k, dtype_warning, eval_batch_size, eval_prompts, load_for_eval, load_target
from .hardware import resolve_target_dtype
from .train.run_dir import RUN_RECIPE, check_resume_recipe, default_output_dir

# the recipe sections that define what a run trains: --resume refuses a recipe that changed them


def _progress_scope(progress):
    return progress() if progress is not None else contextlib.nullcontext(None)


def train_run(recipe: Recipe, output_dir: str | Path | None = None, *, resume: bool = False,
              overwrite: bool = False, log: Callable[[str], None] = print, progress=None, console=None,
              recipe_file: str | Path | None = None) -> Path:
    """Train the drafter of ``recipe`` for its frozen target (``speculators train``).

    Steps: output-directory rules (:func:`speculators.train.run_dir.check_output_dir`), ``--resume`` checks
    (recipe sections, then the data's content before the target loads, then the target's fingerprint),
    target load, data pipeline (:func:`speculators.data.pipeline.prepare_data`), drafter build
    (seeded by ``train.seed``, independent of what the data step consumed), ``train.init_from``; with
    ``drafter.joint: true`` the target is adapted with LoRA (``Target.adapt_lora(drafter.joint_target)``,
    after its features were cached); then the :class:`speculators.train.unit.TrainingUnit` (drafter
    plus adapted target; with ``data.features: online`` the frozen target that computes the features in
    every step) is trained by :class:`speculators.train.trainer.Trainer`.

    Args:
        recipe: the validated recipe (``recipe.drafter`` is the family's typed config).
        output_dir: the run directory; None = :func:`default_output_dir`.
        resume: continue from the run directory's last checkpoint. overwrite: delete it first.
        log, progress: see the module docstring. console: the rich console the trainer draws on.
        recipe_file: where the recipe came from (for the log line and the default run directory).
    Returns:
        The final checkpoint directory (``<run dir>/final``).
    Raises:
        SpeculatorsError: bad output directory / flags, a ``--resume`` whose recipe, data or target
            changed, a target or data fault, a joint drafter without held-out data, a diverged run.
    """
    import torch

    from .data.pipeline import check_run_identity, load_data, prepare_data, record_run_identity
    from .engines import regeneration_engine
    from .drafters import registry
    from .drafters.checkpoint import init_from_checkpoint
    from .target import Target, process_device_map
    from accelerate import PartialState

    from .train.run_dir import check_output_dir, prepare_output_dir
    from .train.tracking import check_report_to
    from .train.trainer import Trainer
    from .train.unit import TrainingUnit

    # under `accelerate launch` every rank runs this: rank 0 logs, builds the caches first and owns the run dir
    state = PartialState(cpu=not torch.cuda.is_available())  # no GPU: gloo processes (as the Trainer's Accelerator)
    if not state.is_main_process:
        log, progress, console = (lambda *_: None), None, None
    out = Path(output_dir) if output_dir is not None else default_output_dir(recipe, recipe_file)
    check_output_dir(out, resume, overwrite)
    check_report_to(recipe.train.report_to)  # a missing tracker package: one error before any work
    if resume:
        check_resume_recipe(out, recipe)
    log(f"recipe {recipe_file if recipe_file is not None else '(in memory)'} -> {out} "
        f"(drafter {recipe.drafter.algorithm})")
    device_map = process_device_map(recipe.target.device_map, state.num_processes, state.device)  # refuse early
    if getattr(recipe.drafter, "joint", False) and recipe.target.device_map is not None:
        raise SpeculatorsError("target.device_map: a joint run (drafter.joint: true) trains the target inside the "
                               "drafter's module, which accelerate does not place across devices; unset "
                               "target.device_map (the target on one device) for joint training")
    torch.manual_seed(recipe.train.seed)
    loaded = load_data(recipe.data, log)  # the data's identity is its content (not the file names)
    identity = dict(loaded[1])
    if resume:
        check_run_identity(out, identity, prefix="data.")  # before the target loads: refuse changed data early
    dtype = resolve_target_dtype(recipe.target.dtype, state.device, log)  # regeneration, features and labels in it
    with state.main_process_first():  # rank 0 converts/caches a GGUF target before the others read the cache
        target = Target.load(recipe.target.model, dtype, recipe.target.aux_layer_ids, log=log,
                             device_map=device_map)
    family = registry.get(recipe.drafter.algorithm)
    if recipe.target.aux_layer_ids is None:  # unset: the family's default taps (before features are cached)
        target.aux_layer_ids = family.serving.default_aux_layer_ids(target.num_layers, recipe.drafter)
    identity["target (weights, config, chat template)"] = target.fingerprint
    if dtype != "float32":  # --resume on hardware where auto resolves otherwise is refused (float32 runs: as before)
        identity["target dtype"] = dtype
    if resume and not check_run_identity(out, identity) and (out / RUN_RECIPE).is_file():
        log(f"--resume: {out} records no data identity (older run): the data cannot be checked")
    with state.main_process_first(), _progress_scope(progress) as make:  # the other ranks read rank 0's cache
        data = prepare_data(recipe.data, target, draft_vocab_size=recipe.drafter.draft_vocab_size, log=log,
                            progress=make, loaded=loaded,
                            regen_server=regeneration_engine(recipe.data.regeneration.server))
    torch.manual_seed(recipe.train.seed)  # drafter init does not depend on what the data step consumed
    drafter = family.from_target(recipe.drafter, target, data.vocab)
    if recipe.train.init_from:
        init_from_checkpoint(drafter, recipe.train.init_from)
        log(f"drafter weights initialised from {recipe.train.init_from}")
    joint = bool(getattr(recipe.drafter, "joint", False))  # drafter.joint: the target is fine-tuned too
    if joint and (data.held_out is None or len(data.held_out) == 0):
        raise SpeculatorsError("drafter.joint: true trains the target, whose held-out perplexity must be "
                               "measured: set data.held_out.fraction > 0")
    if joint:  # the run's target becomes a LoRA model (after its features were cached, before the optimizer)
        target.adapt_lora(recipe.drafter.joint_target)
    online = recipe.data.features == "online"  # the frozen target computes the features in the step
    unit = TrainingUnit(drafter, target if (joint or online) else None, features=recipe.data.features,
                        feature_dtype=recipe.data.feature_dtype)
    if state.is_main_process:
        prepare_output_dir(out, resume, overwrite)
        record_run_identity(out, identity)
        # per source: conversations, held-out and train rows, examples, tokens (scripts/learning_curve.py reads it)
        atomic_write_text(out / "data_report.json", json.dumps(data.report, indent=1, default=str) + "\n")
    state.wait_for_everyone()
    groups = unit.param_groups(recipe.train.lr)
    n_train = sum(p.numel() for p in groups[0]["params"])
    log(f"drafter {family.algorithm}: {n_train / 1e6:.2f}M trainable parameters, draft vocab {data.vocab.size}")
    if joint:
        log(f"joint: the target is trained too, {sum(p.numel() for p in groups[1]['params']) / 1e6:.2f}M LoRA "
            f"parameters at lr {groups[1]['lr']}")
    final = Trainer(recipe, unit, data, out, log=log, console=console, run_info=identity).train(resume=resume)
    if recipe.train.parity_check and state.is_main_process:
        # several processes (DDP, FSDP, DeepSpeed ZeRO) may leave this rank's drafter sharded: the gate then
        # compares the published file alone (our loader reads final/), not the file against the drafter in memory
        export_gate(final, target, drafter if state.num_processes == 1 else None, data.held_out, log=log,
                    parity_skip=JOINT_PARITY_NOTE if joint else None,
                    prompts=[p["input_ids"] for p in data.eval_prompts] if recipe.train.vllm_check else None)
    return final


#: why a joint run's export gate checks the layout only
JOINT_PARITY_NOTE = ("parity with the reference implementation not run: a joint run's verifier is the base model "
                     "with this run's LoRA adapter (final/target_adapter), which the reference does not load; merge "
                     "the adapter and run `speculators check DIR --target MERGED_MODEL`")


def export_gate(final: Path, target, drafter, held_out, log: Callable[[str], None] = print,
                num_sequences: int = 3, max_tokens: int = 64, parity_skip: str | None = None,
                prompts: list[list[int]] | None = None):
    """The end step of ``speculators train`` (``train.parity_check``): :func:`speculators.export.gate.check_checkpoint`
    on ``final`` with the run's target and trained drafter on its first held-out sequences (at most
    ``max_tokens`` tokens each; built-in texts when the run has none) and, with ``prompts`` (the run's held-out
    prompt ids; ``train.vllm_check``), ``final/`` served by vLLM on the first ``num_sequences`` of them. Writes
    ``final/parity.json`` and appends the result to ``final/README.md`` (the run card, which ``speculators push``
    publishes). ``parity_skip``: run the layout check only, and say why (a joint run).

    Returns:
        The :class:`speculators.export.gate.GateResult`.
    Raises:
        SpeculatorsError: a tensor vLLM's loader cannot place, or a parity failure (naming the first
            divergence): the run fails loudly, ``final/`` stays with the failure written in its card. An
            unavailable reference implementation (offline) is logged and does not fail the run.
    """
    import json

    from .export.gate import check_checkpoint
    from .utils import atomic_write_text

    seqs = None
    if held_out is not None and len(held_out):
        seqs = [held_out.example(i)["input_ids"][:max_tokens].tolist() for i in range(min(num_sequences, len(held_out)))]
    res = check_checkpoint(final, target=target, sequences=seqs, num_sequences=num_sequences, drafter=drafter,
                           log=log, parity=parity_skip is None, serve=prompts is not None and parity_skip is None,
                           prompts=prompts or None)
    if parity_skip is not None:
        res.notes.append(parity_skip)
        log(f"export gate: {parity_skip}")
    atomic_write_text(final / "parity.json", json.dumps(res.to_json(), indent=2) + "\n")
    card = final / "README.md"
    if card.is_file():
        atomic_write_text(card, card.read_text().rstrip("\n") + "\n\n" + res.to_markdown() + "\n")
    if res.parity is not None:
        log(res.parity.summary())
    if res.passed is False:
        why = res.layout_problems[:3] or ([res.parity.first_divergence or "parity"]
                                          if res.parity is not None and res.parity.passed is False else
                                          [res.served.summary() if res.served is not None else "?"])
        raise SpeculatorsError(f"export gate failed on {final}: " + "; ".join(why))
    return res


def held_out_prompt_ids(checkpoint: Path, target, n: int, log: Callable[[str], None] = print) -> list[list[int]] | None:
    """The first ``n`` held-out prompts (token ids, chat template applied) of the recipe beside ``checkpoint`` (a
    run's ``final/``), as ``speculators eval`` measures them; None (the caller then uses built-in chat prompts)
    when there is no recipe or it cannot give them (its data is not on this machine: logged)."""
    from .evaluation.loading import eval_prompts
    from .recipe import load_recipe
    from .target import Target

    rec_file = Path(checkpoint) / "recipe.yaml"
    if not rec_file.is_file():
        return None
    try:
        rec = load_recipe(rec_file)
        tok_target = target or Target.load(rec.target.model, dtype="float32", log=log)
        plist, _ = eval_prompts(None, rec, tok_target, n, log)
    except SpeculatorsError as e:
        log(f"check: the recipe's held-out prompts are not available ({e}); using built-in chat prompts")
        return None
    return [list(map(int, p["input_ids"])) for p in plist]


def _engine_eval_inputs(checkpoint, num_prompts, settings_class, settings, log):
    """An engine eval's ``(checkpoint dir, run recipe or None, number of prompts, settings)``: the prompts and
    ``max_new_tokens`` default to the recipe's ``eval`` section; ``settings`` override ``settings_class``'s fields."""
    ckpt = resolve_checkpoint(checkpoint, allow_hub=False, log=log)
    rec = load_recipe(ckpt / RUN_RECIPE) if (ckpt / RUN_RECIPE).is_file() else None
    ev: EvalSpec = eval_spec_with(rec.eval if rec is not None else None, {}, None)
    n = num_prompts if num_prompts is not None else ev.num_prompts
    return ckpt, rec, n, settings_class(**{"max_new_tokens": ev.max_new_tokens, **(settings or {})})


def vllm_eval_run(checkpoint: str | Path, settings: Mapping[str, Any] | None = None, *, num_prompts: int | None = None,
                  prompts: list[str] | None = None, target_model: str | None = None,
                  output: str | Path | None = None, log: Callable[[str], None] = print) -> tuple[dict, Path]:
    """``speculators eval RUN --engine vllm``: the drafter measured inside vLLM
    (:func:`speculators.engines.vllm_eval.engine_eval`) on the recipe's held-out prompts (at most ``num_prompts``,
    default the recipe's ``eval.num_prompts``) or ``prompts``.

    Args:
        settings: fields of :class:`speculators.engines.vllm_eval.VllmEvalSettings` that differ from its defaults;
            ``max_new_tokens`` defaults to the recipe's ``eval.max_new_tokens``.
    Raises:
        SpeculatorsError: as :func:`speculators.engines.vllm_eval.engine_eval`, a bad setting, a bad checkpoint path.
    """
    from .engines.vllm_eval import VllmEvalSettings, engine_eval

    ckpt, rec, n, st = _engine_eval_inputs(checkpoint, num_prompts, VllmEvalSettings, settings, log)
    return engine_eval(ckpt, rec, st, num_prompts=n, prompts=prompts, target_model=target_model, output=output, log=log)


def data_run(recipe: Recipe, *, log: Callable[[str], None] = print, progress=None):
    """Run only the data pipeline of ``recipe`` (``speculators data``): load the target, regenerate and
    extract features into the on-disk cache.

    Returns:
        The :class:`speculators.data.pipeline.PreparedData`.
    Raises:
        SpeculatorsError: a target or data fault (see :func:`speculators.data.pipeline.prepare_data`).
    """
    from .data.pipeline import prepare_data
    from .drafters import registry
    from .engines import regeneration_engine
    from .target import Target

    target = Target.load(recipe.target.model, resolve_target_dtype(recipe.target.dtype, log=log), recipe.target.aux_layer_ids,
                         log=log, device_map=recipe.target.device_map)
    if recipe.target.aux_layer_ids is None:  # unset: the family's default taps (as train_run extracts them)
        target.aux_layer_ids = registry.get(recipe.drafter.algorithm).serving.default_aux_layer_ids(
            target.num_layers, recipe.drafter)
    with _progress_scope(progress) as make:
        return prepare_data(recipe.data, target, draft_vocab_size=recipe.drafter.draft_vocab_size, log=log,
                            progress=make, regen_server=regeneration_engine(recipe.data.regeneration.server))


def resolve_checkpoint(path: str | Path, *, allow_hub: bool = True,
                       log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint directory that ``path`` names.

    ``path`` is a checkpoint (``config.json`` in it), a run directory (its ``final/``, else its newest
    good ``checkpoints/step-*``), or, with ``allow_hub`` and no such local path, a pushed drafter's Hub
    id ``namespace/name`` (downloaded into the Hub cache).

    Raises:
        SpeculatorsError: none of these; a run that only left diverged checkpoints; a failed download.
    """
    from .hub import looks_like_hub_id, pull_checkpoint
    from .train.run_dir import checkpoints

    path = Path(path)
    if allow_hub and looks_like_hub_id(str(path)):  # no such local path: a pushed drafter's namespace/name
        if log is not None:
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


@dataclass
class _EvalJob:
    """What every checkpoint measured by one :func:`eval_run` shares: the prompts (and their label), the eval
    section, the target's forward costs measured once, and how to load and report."""

    spec: EvalSpec
    prompts: list[dict]
    label: str
    costs: dict
    batch_size: int
    rec: Recipe | None
    target_model: str | None
    compare_target: str | None  # what compared checkpoints verify against: --target, else the first one's
    device: str | None
    dtype: str | None
    log: Callable[[str], None]
    progress: Any


def _measure(job: _EvalJob, target, drafter, settings, what: str) -> dict:
    """One :func:`speculators.evaluation.runner.run_eval` of ``drafter`` on the job's prompts, with a progress
    bar named ``what``."""
    from .evaluation.runner import run_eval

    with _progress_scope(job.progress) as make:
        return run_eval(target, drafter, job.prompts, settings, forward_costs=job.costs, log=job.log,
                        progress=make(f"speculative vs plain decoding{what}") if make else None)


def _describe(report: dict, path: Path, drafter, target, label: str) -> dict:
    """``report`` with what was measured: ``checkpoint``, ``target`` (name, fingerprint, adapter, dtype and the
    dtype the drafter was trained against), ``dtype_warning`` when they differ, ``prompts`` and ``device``."""
    report["checkpoint"] = str(path)
    report["target"] = {"name_or_path": target.name_or_path, "fingerprint": target.fingerprint,
                        "adapter": None if drafter.target_adapter_dir is None else str(drafter.target_adapter_dir),
                        "dtype": str(target.dtype).removeprefix("torch."), "trained_dtype": drafter.meta.dtype}
    warning = dtype_warning(drafter.meta.dtype, report["target"]["dtype"])
    if warning:
        report["dtype_warning"] = warning
    report["prompts"] = label
    report["device"] = str(target.device)
    return report


def _add_compare(report: dict, job: _EvalJob, label: str, others: list[tuple[str, Path, Any]],
                 fingerprint: str) -> None:
    """``report["compare"]`` over ``label``'s report and each other checkpoint's (``(given, path, drafter)``),
    measured one at a time so that only one target is loaded, ungated, on the drafter methods of the eval; their
    greedy mismatches join the report's (every checkpoint's outputs must equal plain greedy decoding;
    ``greedy_check`` counts them all).

    Raises:
        SpeculatorsError: a compared checkpoint whose target is not the first one's.
    """
    from .evaluation.greedy_check import greedy_summary
    from .evaluation.runner import compare_rows
    from .evaluation.settings import DRAFTER_METHODS, EvalSettings

    methods = tuple(m for m in DRAFTER_METHODS if m in job.spec.methods) or ("drafter",)
    settings = EvalSettings.from_spec(job.spec, job.batch_size, methods=methods, gated=False)
    reports = [(label, report)]
    for given, path, drafter in others:
        rec = load_recipe(path / RUN_RECIPE) if (path / RUN_RECIPE).is_file() else job.rec
        drafter, target, fp = load_for_eval(path, rec, job.compare_target, job.device, job.log, job.dtype,
                                            drafter=drafter)
        if fp != fingerprint:
            raise SpeculatorsError(f"{given}: its target ({target.name_or_path}) is not {label}'s; "
                                   "compare checkpoints of the same target (or pass --target)")
        other = _describe(_measure(job, target, drafter, settings, f" ({given.removeprefix('--compare ')})"), path,
                          drafter, target, job.label)
        del target
        reports.append((given.removeprefix("--compare "), other))
        if report["greedy_mismatches"] is not None:
            report["greedy_mismatches"] += [{**m, "checkpoint": reports[-1][0]} for m in other["greedy_mismatches"]]
            report["greedy_check"] = greedy_summary(report["greedy_mismatches"], report["greedy_check"]["dtype"])
    report["compare"] = {"checkpoints": [c for c, _ in reports], "rows": compare_rows(reports)}


def _add_float32_baseline(report: dict, job: _EvalJob, drafter) -> None:
    """On a CPU, low precision is not always the faster plain decoding (a CPU without bf16 units, small products
    at one row): time plain decoding of the same prompts with the target in float32 too, and put the batch-1 rows
    against the faster of the two (``report["precision_baseline"]``,
    :func:`speculators.evaluation.runner.precision_block`). Only the target is loaded again."""
    from .evaluation.runner import plain_baseline, precision_block
    from .verify import SamplingParams

    ev = job.spec
    job.log(f"eval: plain decoding in float32 as well (the eval runs the target in {report['target']['dtype']})")
    t32, _ = load_target(drafter, job.rec, job.target_model, job.device, lambda m: None, "float32")
    base = plain_baseline(t32, job.prompts, ev.max_new_tokens, SamplingParams.uniform(1, ev.temperature, ev.top_k,
                                                                                        ev.top_p), seed=ev.seed)
    report["precision_baseline"] = pb = precision_block(report, base)
    job.log("eval: plain tokens/s at batch 1: " + ", ".join(f"{d} {v:.1f}" if v else f"{d} n/a"
                                                           for d, v in pb["plain_tokens_per_s"].items())
            + f"; the faster is {pb['fastest']}")


def eval_run(checkpoint: str | Path, *, eval_overrides: Mapping[str, Any] | None = None,
             prompts: str | list[str] | None = None, target_model: str | None = None,
             output: str | Path | None = None, log: Callable[[str], None] = print, progress=None,
             override_names: Mapping[str, str] | None = None, device: str | None = None,
             compare: list[str | Path] | tuple = (), dtype: str | None = None) -> tuple[dict, Path]:
    """Measure acceptance by real speculative generation against plain decoding (``speculators eval``).

    The eval settings are the checkpoint recipe's ``eval`` section (:class:`speculators.recipe.EvalSpec`
    defaults without a recipe) with ``eval_overrides`` applied THROUGH that schema
    (:func:`speculators.recipe.eval_spec_with`): a value out of range is a one-line error.
    The prompts are the recipe's held-out prompts (:func:`speculators.data.pipeline.held_out_prompts`,
    the same list training computed) or, with ``prompts``, the distinct prompts of those data sources
    (JSONL / JSON files with OpenAI ``messages`` or ShareGPT ``conversations``, ``hf:NAME[:SPLIT]``
    datasets, ``humaneval``, ``chatterbot``); at most ``num_prompts`` of them (of EACH source when
    several are given). Every prompt keeps the name of its source (the ``prompts`` value as given, or
    the recipe source of a held-out prompt): the report's ``by_source`` gives tau per source.
    :func:`speculators.evaluation.runner.run_eval` decodes them through the batched loop at batch size 1 and at
    ``batch_size`` (EvalSpec; None = 16 on CUDA, 8 elsewhere), for every K of ``ks`` (``k_sweep`` or
    ``[k]``), with the drafter, n-gram, suffix and hybrid proposers. With ``confidence_threshold`` (and/or
    ``confidence_cost_aware``: the gate reads the batch-1 costs of the target forwards measured once here,
    :func:`speculators.evaluation.costs.measure_costs`, which the report's ``cost_model`` reads too) the drafter
    is also decoded confidence-gated (``report["gated_rows"]``, ``report["gating"]``; compared checkpoints
    are measured ungated).

    With ``compare``, every listed checkpoint's drafter (and its hybrid) is measured on the SAME prompts
    and settings; ``report["compare"]`` holds one table (:func:`speculators.evaluation.runner.compare_rows`).

    Args:
        checkpoint: a checkpoint, a run directory, or a Hub id (:func:`resolve_checkpoint`).
        eval_overrides: ``{EvalSpec field: value}`` (``k``, ``k_sweep``, ``batch_size``, ``temperature``,
            ``top_p``, ``top_k``, ``max_new_tokens``, ``num_prompts``, ...); None values are ignored.
        prompts: one data source or a list of them, instead of the held-out prompts.
        target_model: verify against this target instead of the recipe's (every compared checkpoint too).
        output: the report directory; default ``<run dir>/eval-k<K[-K...]>-t<temperature>`` (a Hub
            drafter's under ``outputs/hub/<namespace>--<name>/``).
        log, progress: see the module docstring.
        override_names: how errors name an override, e.g. ``{"top_p": "--top-p"}``.
        device: where the target and the drafter run (``"cpu"``, ``"cuda"``, ``"cuda:1"``; None = CUDA
            when present, else CPU).
        compare: further checkpoints / run directories / Hub ids to compare with ``checkpoint``.
        dtype: the target's dtype (``auto`` | ``float32`` | ``bfloat16`` | ``float16``; None = the dtype the
            checkpoint was trained against, else the recipe's ``target.dtype``; ``auto``:
            :func:`speculators.hardware.resolve_target_dtype`). A dtype other than the checkpoint's is
            logged and recorded as ``report["dtype_warning"]``. Greedy equality with plain decoding is
            checked in that dtype: in bf16 a verify forward can round a near-tie differently from a 1-token
            forward; each mismatch is classified (``near_tie``, :mod:`speculators.evaluation.greedy_check`) and only
            the others fail the check (``report["greedy_check"]["passed"]``).
    Returns:
        ``(report, report_dir)``: the report dict of :func:`speculators.evaluation.runner.run_eval` with
        ``checkpoint``, ``target``, ``prompts``, ``device`` (and ``compare``) added, and the directory it
        was written to (``report.json``, ``report.md`` and the PNG plots).
    Raises:
        SpeculatorsError: a bad override, a checkpoint without a recipe and without ``target_model`` (or
            ``prompts``), a checkpoint of another target, a K (any of the sweep) above what the drafter
            can draft per step (P-EAGLE: ``num_depths``; DFlash: ``block_size - 1``; also every
            ``compare`` checkpoint's), no held-out prompts, a bad prompt source, a compared checkpoint
            whose target differs.
    """
    from .drafters import Drafter
    from .evaluation.costs import eval_context, gate_cost, measure_costs
    from .evaluation.runner import write_report
    from .evaluation.settings import EvalSettings
    from .hub import looks_like_hub_id

    if isinstance(prompts, (str, Path)):
        prompts = [str(prompts)]
    prompts = [str(p) for p in prompts] if prompts else None
    from_hub = looks_like_hub_id(str(checkpoint))
    ckpt = resolve_checkpoint(checkpoint, log=log)
    rec_file = ckpt / RUN_RECIPE
    rec = load_recipe(rec_file) if rec_file.is_file() else None
    ev: EvalSpec = eval_spec_with(rec.eval if rec is not None else None, eval_overrides or {}, override_names)
    if rec is None and target_model is None:
        raise SpeculatorsError(f"{ckpt} has no recipe.yaml; pass --target")
    if rec is None and prompts is None:
        raise SpeculatorsError("no recipe in the checkpoint: pass --prompts SOURCE")
    others = [(f"--compare {c}", resolve_checkpoint(c, log=log)) for c in compare]  # fail early on a bad path
    drafters = []
    for given, path in [(str(checkpoint), ckpt), *others]:
        # each drafter loads once; before any target loads or decoding: K above what it can draft per step
        drafters.append(Drafter.from_pretrained(path))
        check_eval_k(drafters[-1], ev, eval_overrides or {}, override_names or {}, given)
    drafter, target, fingerprint = load_for_eval(ckpt, rec, target_model, device, log, dtype, drafter=drafters[0])
    plist, label = eval_prompts(prompts, rec, target, ev.num_prompts, log)
    batch = eval_batch_size(ev, target, log)
    log(f"eval: {len(plist)} prompts ({label}), K={ev.ks}, batch sizes {sorted({1, batch})} on {target.device}, "
        f"temperature {ev.temperature}, top_p {ev.top_p}, top_k {ev.top_k}, max_new_tokens {ev.max_new_tokens}")
    # the target's forward costs, ONCE per eval: the cost model's comparisons and the cost-aware gate read them
    # (run_eval also times the forwards right before each pass, for the predictions of its rows)
    costs = measure_costs(target, max(ev.ks), sorted({1, batch}), context=eval_context(plist, ev.max_new_tokens))
    log("eval: target forward (ms) over 1..K+1 tokens per request: " + "; ".join(
        f"batch {b}: " + ", ".join(f"{1000 * c:.2f}" for c in costs["seconds"][str(b)]) for b in costs["batch_sizes"]))
    verify_cost = gate_cost(costs) if ev.confidence_cost_aware and "drafter" in ev.methods else None
    job = _EvalJob(ev, plist, label, costs, batch, rec, target_model,
                   target_model or (rec.target.model if rec else None), device, dtype, log, progress)
    report = _describe(_measure(job, target, drafter, EvalSettings.from_spec(ev, batch, verify_cost=verify_cost), ""),
                       ckpt, drafter, target, label)
    if report["target"]["dtype"] != "float32" and target.device.type == "cpu":
        _add_float32_baseline(report, job, drafter)
    if others:
        del drafter, target, drafters[0]
        _add_compare(report, job, str(checkpoint), [(g, p, d) for (g, p), d in zip(others, drafters)], fingerprint)
    # a pulled drafter lives in the Hub cache: its reports go under ./outputs/hub/ instead
    base = Path("outputs") / "hub" / str(checkpoint).replace("/", "--") if from_hub else ckpt.parent
    out = Path(output) if output is not None else base / f"eval-k{'-'.join(map(str, ev.ks))}-t{ev.temperature:g}"
    write_report(report, out, title=f"speculators eval: {ckpt}")
    if not from_hub:  # the training run's trackers (train.report_to) get the report as a table
        from .train.tracking import log_eval_report

        logged = log_eval_report(ckpt, rec, report, log=log)
        if logged:
            log(f"eval: report logged to the run's {', '.join(logged)}")
    return report, out


def calibrate_run(checkpoint: str | Path, *, eval_overrides: Mapping[str, Any] | None = None,
                  k: int | None = None, prompts: str | list[str] | None = None, target_model: str | None = None,
                  output: str | Path | None = None, store: bool = True, fit_fraction: float = 0.5,
                  device: str | None = None, dtype: str | None = None, log: Callable[[str], None] = print,
                  override_names: Mapping[str, str] | None = None, skip_prompts: int | None = None,
                  fit_bias: bool = True, min_tau_ratio: float = 0.97) -> tuple[dict, Path]:
    """Calibrate a drafter's confidence head on held-out prompts (``speculators calibrate RUN_DIR``; also
    callable at the end of training on ``train_run``'s final checkpoint).

    Loads the checkpoint and its target as :func:`eval_run` does, decodes the recipe's held-out prompts
    (:func:`speculators.data.pipeline.held_out_prompts`, or the ``prompts`` sources; at most
    ``eval.num_prompts``) with the eval's sampling settings and ``max_new_tokens``, fits the per-position
    temperatures and shifts and measures the survival ECE before and after
    (:func:`speculators.calibration.calibrate_drafter`), stores them in the checkpoint's ``config.json``
    (``store``; ``speculators_training.confidence_calibration``, never ``model.safetensors``:
    :func:`speculators.calibration.store_temperatures`, an atomic rewrite) and writes the report
    (``calibration.json``, ``calibration.md``, ``reliability.png``, the raw outcomes ``outcomes.safetensors``).

    Args:
        checkpoint: a checkpoint or a run directory (its ``final/``; Hub ids are refused: the weights are
            rewritten in place).
        eval_overrides: ``{EvalSpec field: value}`` (``temperature``, ``num_prompts``, ``max_new_tokens``, ...).
        k: drafts per step whose calibration is fitted (default: every position of the drafter's
            ``confidence_calibration()``, capped by what one step can draft).
        prompts, target_model, device, dtype, log, override_names: as :func:`eval_run`.
        output: report directory (default ``<run dir>/calibration``).
        store: write the calibration into the checkpoint (False: report only). It is not written when
            it raises the survival ECE on the held-out half (``report["not_stored"]`` says so); the
            recommended gate threshold is then the one under the checkpoint's own calibration.
        fit_fraction: share of the prompts that fit the calibration; the rest measure ECE (see ``calibrate_drafter``).
        skip_prompts: leading prompts not used (None: with the recipe's held-out prompts, the checkpoint
            recipe's ``eval.num_prompts``, i.e. exactly the prompts ``speculators eval`` measures by
            default, so that the calibration and the recommended gate threshold are chosen on held-out
            prompts that the eval does not score; with ``prompts`` sources, 0).
        fit_bias: fit a shift per position besides the temperature (Platt scaling; False: temperature-only
            STS, :func:`speculators.calibration.fit_calibration`).
        min_tau_ratio: the recommended gate threshold is the one that cuts the most verified drafts while
            the simulated tau stays >= this ratio of the ungated tau
            (:func:`speculators.calibration.choose_threshold`).
    Returns:
        ``(report, report_dir)``.
    Raises:
        SpeculatorsError: a checkpoint without a confidence head, a bad override or ``k``, no prompts, and
            the errors of :func:`eval_run`'s loading.
    """
    from .calibration import calibrate_drafter, store_temperatures, use_sweep, write_calibration_report
    from .verify import SamplingParams

    if isinstance(prompts, (str, Path)):
        prompts = [str(prompts)]
    prompts = [str(p) for p in prompts] if prompts else None
    ckpt = resolve_checkpoint(checkpoint, allow_hub=False, log=log)
    rec_file = ckpt / RUN_RECIPE
    rec = load_recipe(rec_file) if rec_file.is_file() else None
    ev: EvalSpec = eval_spec_with(rec.eval if rec is not None else None, eval_overrides or {}, override_names)
    if rec is None and (target_model is None or prompts is None):
        raise SpeculatorsError(f"{ckpt} has no recipe.yaml; pass --target and --prompts")
    drafter, target, _ = load_for_eval(ckpt, rec, target_model, device, log, dtype)
    calibration = drafter.confidence_calibration()  # (temperature [B], bias [B]) or None
    if calibration is None:
        raise SpeculatorsError(f"{ckpt}: the {drafter.algorithm} drafter has no confidence head "
                               "(no confidence_calibration): nothing to calibrate")
    temps = calibration[0]
    cap = getattr(drafter, "max_speculative_tokens", None)
    default_k = min(int(temps.numel()), int(cap) if cap else int(temps.numel()))
    if k is None:
        k = default_k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= default_k:
        raise SpeculatorsError(f"--k {k}: calibrate fits 1..{default_k} positions for this drafter")
    if skip_prompts is None:
        skip_prompts = rec.eval.num_prompts if (rec is not None and not prompts) else 0
    if isinstance(skip_prompts, bool) or not isinstance(skip_prompts, int) or skip_prompts < 0:
        raise SpeculatorsError(f"--skip-prompts {skip_prompts!r}: expected an integer >= 0")
    plist, label = eval_prompts(prompts, rec, target, ev.num_prompts + skip_prompts, log)
    # per source (each --prompts source, or the held-out split as one): skip its first skip_prompts, keep
    # at most num_prompts, as the eval takes at most num_prompts of EACH source
    groups: dict[str, list[dict]] = {}
    for p in plist:
        groups.setdefault(str(p.get("source")) if prompts else "", []).append(p)
    plist = [p for g in groups.values() for p in g[skip_prompts:skip_prompts + ev.num_prompts]]
    if not plist:
        raise SpeculatorsError(f"calibrate: no prompts left after skipping the first {skip_prompts} of each source "
                               f"({label}); pass --skip-prompts 0 (the eval's own prompts) or more prompts")
    if skip_prompts:
        label += f", after the first {skip_prompts}" + (" (the eval's)" if not prompts else " of each source")
    sampling = SamplingParams.uniform(1, ev.temperature, ev.top_k, ev.top_p)
    log(f"calibrate: {len(plist)} prompts ({label}), K={k}, temperature {ev.temperature}, "
        f"max_new_tokens {ev.max_new_tokens} on {target.device}")
    result = calibrate_drafter(target, drafter, [list(p["input_ids"]) for p in plist], k, ev.max_new_tokens,
                               sampling, batch_size=ev.batch_size or 8, seed=ev.seed, fit_fraction=fit_fraction,
                               log=log, fit_bias=fit_bias, min_tau_ratio=min_tau_ratio)
    report = result.report
    report.update(checkpoint=str(ckpt), prompts=label, device=str(target.device), stored=False)
    worse = report["split"] != "in-sample" and report["after"]["ece"] > report["before"]["ece"]
    if store and worse:
        report["not_stored"] = (f"the fitted calibration raises the held-out survival ECE ({report['before']['ece']:.4f} "
                                f"-> {report['after']['ece']:.4f}); the checkpoint keeps its own")
        log(f"calibrate: not stored: {report['not_stored']}")
    elif store:
        store_temperatures(ckpt, result.temperature, result.bias)
        report["stored"] = True
        log(f"calibrate: {'temperatures and shifts' if fit_bias else 'temperatures (shifts 0 where fitted)'} "
            f"stored in {ckpt}")
    use_sweep(report, "fitted" if report["stored"] else "current")
    out = Path(output) if output is not None else ckpt.parent / "calibration"
    write_calibration_report(report, out, result.records)
    return report, out


def gguf_export_run(checkpoint: str | Path, *, target_model: str | None = None, outtypes: tuple[str, ...] = ("f16",),
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """``speculators export gguf RUN_DIR``: the drafter (one GGUF per ``outtypes`` entry) and, when it is not a
    GGUF already, the target, through llama.cpp's converter into ``<run dir>/gguf/``
    (:func:`speculators.engines.jobs.export_run`, which returns the files and the ``llama-server`` command).

    Raises:
        SpeculatorsError: as :func:`speculators.engines.jobs.export_run`, and a bad checkpoint path.
    """
    from .engines.jobs import export_run

    ckpt = resolve_checkpoint(checkpoint, log=log)
    rec = load_recipe(ckpt / RUN_RECIPE) if (ckpt / RUN_RECIPE).is_file() else None
    return export_run(ckpt, rec, target_model, outtypes, log=log)


def engine_eval_run(checkpoint: str | Path, settings: Mapping[str, Any] | None = None, *, num_prompts: int | None = None,
                    prompts: list[str] | None = None, target_model: str | None = None,
                    output: str | Path | None = None, log: Callable[[str], None] = print) -> tuple[dict, Path]:
    """``speculators eval RUN --engine llama.cpp``: the drafter measured inside ``llama-server``
    (:func:`speculators.engines.jobs.engine_eval`) on the prompts ``speculators eval`` measures: the recipe's
    held-out prompts, at most ``num_prompts`` (default: the recipe's ``eval.num_prompts``), or ``prompts``.

    Args:
        settings: fields of :class:`speculators.engines.llamacpp_eval.EngineSettings` that differ from its
            defaults (``ks``, ``temperatures``, ``parallel``, ``p_mins``, ``draft_outtypes``, ...);
            ``max_new_tokens`` defaults to the recipe's ``eval.max_new_tokens``.
    Raises:
        SpeculatorsError: as :func:`speculators.engines.jobs.engine_eval`, a bad setting, a bad checkpoint path.
    """
    from .engines.jobs import engine_eval
    from .engines.llamacpp_eval import EngineSettings

    ckpt, rec, n, st = _engine_eval_inputs(checkpoint, num_prompts, EngineSettings, settings, log)
    return engine_eval(ckpt, rec, st, num_prompts=n, prompts=prompts, target_model=target_model,
                       output=output, log=log)
