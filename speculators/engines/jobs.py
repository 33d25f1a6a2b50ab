"""The llama.cpp jobs of ``speculators export gguf`` and ``speculators eval --engine llama.cpp``.

:func:`export_run` converts a checkpoint's drafter (and the target when it is not a GGUF already) into
``<run dir>/gguf/`` and returns the ``llama-server`` command line that serves them. :func:`engine_eval` does the
same, then measures the drafter inside the engine (:func:`speculators.engines.llamacpp_eval.run_engine_eval`) on
the recipe's held-out prompts (the prompts ``speculators eval`` measures with our loop), sets the engine's tau
beside our loop's newest greedy report in the run directory, and writes ``<run dir>/eval-llamacpp/``
(``report.json``, ``report.md``: the Hub card of a push includes it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..errors import SpeculatorsError
from .gguf_export import export_gguf, serving_of, spec_type_of, target_files
from .llamacpp_build import LlamaCpp, require_llama_cpp
from .llamacpp_targets import engine_gguf
from .llamacpp_eval import (EngineModels, EngineSettings, loop_comparison, render_markdown,
                            run_engine_eval, tap_shift, timings, write_engine_report)

#: the engine eval's report directory under the run directory
REPORT_DIR = "eval-llamacpp"


def _gguf_dir(ckpt: Path) -> Path:
    return ckpt.parent / "gguf"


def _target_ref(ckpt: Path, rec, target_model: str | None) -> str:
    if target_model:
        return target_model
    if rec is None:
        raise SpeculatorsError(f"{ckpt} has no recipe.yaml; pass --target")
    return rec.target.model


def _stale(out: Path, ckpt: Path) -> bool:
    """Whether the GGUF ``out`` must be (re)converted: missing, or older than the checkpoint's weights or config."""
    if not out.exists():
        return True
    src = [f for f in (ckpt / "model.safetensors", ckpt / "config.json") if f.exists()]
    return any(out.stat().st_mtime < f.stat().st_mtime for f in src)


def draft_gguf(lc: LlamaCpp, ckpt: Path, target_hf: Path, outtype: str, log) -> Path:
    """``<run>/gguf/draft-<outtype>.gguf`` of the drafter in ``ckpt``, converted once (kept while newer than the
    checkpoint's weights)."""
    out = _gguf_dir(ckpt) / f"draft-{outtype}.gguf"
    if _stale(out, ckpt):
        export_gguf(ckpt, out, target_hf, lc, outtype, log=log)
    return out


def shifted_taps_gguf(lc: LlamaCpp, ckpt: Path, target_hf: Path, outtype: str, log) -> tuple[Path, int] | None:
    """The negative control's draft GGUF and its shift: the drafter converted with every aux layer tap
    :func:`speculators.engines.llamacpp_eval.tap_shift` layers deeper (clipped to the target's last layer), or
    None when the format has no aux taps."""
    cfg = json.loads((ckpt / "config.json").read_text())
    key = serving_of(cfg, ckpt).serving_aux_ids_key
    if key is None or not cfg.get(key):
        return None
    layers = json.loads((target_hf / "config.json").read_text())
    layers = layers.get("text_config", layers)["num_hidden_layers"]
    shift = tap_shift(layers)
    shifted = [min(int(i) + shift, layers - 1) for i in cfg[key]]
    out = _gguf_dir(ckpt) / f"draft-{outtype}-taps-shifted-{shift}.gguf"
    if _stale(out, ckpt):
        export_gguf(ckpt, out, target_hf, lc, outtype, config_patch={key: shifted}, log=log)
    return out, shift


def serve_command(lc: LlamaCpp, target: Path, draft: Path, spec_type: str, k: int, p_min: float | None = None,
                  draft_threads: int | None = None) -> str:
    """The ``llama-server`` command line that serves ``draft`` for ``target`` with K drafts per step: the one
    :class:`.llamacpp_server.LlamaServer` runs for that setting (threads, context, ``--no-repack`` on AMX CPUs),
    at port 8080."""
    from .llamacpp_server import LlamaServer

    extra = ["--spec-draft-threads", str(draft_threads)] if draft_threads is not None else []
    return LlamaServer(lc, target, draft=draft, spec_type=spec_type, draft_n_max=k, p_min=p_min,
                       extra=extra).command_line()


def export_run(ckpt: Path, rec, target_model: str | None = None, outtypes: tuple[str, ...] = ("f16",),
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Convert the drafter in ``ckpt`` (one GGUF per outtype) and find or convert its target.

    Returns:
        ``{"target": path, "drafts": {outtype: path}, "spec_type", "serve": command line}``.
    Raises:
        SpeculatorsError: llama.cpp not built, a family llama.cpp does not serve, a failed conversion.
    """
    spec = spec_type_of(ckpt)  # before any work: a family llama.cpp cannot serve fails here
    lc = require_llama_cpp()
    target, hf = target_files(_target_ref(ckpt, rec, target_model), lc, _gguf_dir(ckpt), log=log)
    drafts = {o: draft_gguf(lc, ckpt, hf, o, log) for o in outtypes}
    cfg = json.loads((ckpt / "config.json").read_text())
    k = serving_of(cfg, ckpt).speculative_tokens(cfg) or 3
    return {"target": target, "drafts": drafts, "spec_type": spec,
            "serve": serve_command(lc, target, drafts[outtypes[0]], spec, k)}


def _loop_report(ckpt: Path, num_prompts: int) -> dict | None:
    """The newest greedy report of our loop beside ``ckpt`` measured on as many prompts (None without)."""
    found = []
    for f in ckpt.parent.glob("eval-k*/report.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if float(r.get("temperature", 0.0) or 0.0) == 0.0 and r.get("num_prompts") == num_prompts:
            found.append((f.stat().st_mtime, f, r))
    if not found:
        return None
    _, f, r = max(found, key=lambda x: x[0])
    r["path"] = str(f)
    return r


def engine_eval(ckpt: Path, rec, settings: EngineSettings, *, num_prompts: int, prompts: list[str] | None = None,
                target_model: str | None = None, output: str | Path | None = None,
                log: Callable[[str], None] = print) -> tuple[dict[str, Any], Path]:
    """``speculators eval RUN --engine llama.cpp`` (module docstring).

    Args:
        ckpt: the checkpoint directory. rec: its recipe (None: ``target_model`` and ``prompts`` are required).
        settings: what to sweep. num_prompts: prompts measured (the recipe's ``eval.num_prompts``).
        prompts: data sources instead of the held-out prompts (as ``speculators eval --prompts``).
        output: report directory (default ``<run dir>/eval-llamacpp``).
    Returns:
        ``(report, report_dir)``.
    Raises:
        SpeculatorsError: llama.cpp not built, a family llama.cpp does not serve, a K above what it serves (-k),
            no prompts, a server failure.
    """
    from ..evaluation.loading import eval_prompts
    from ..target import Target

    if rec is None and prompts is None:
        raise SpeculatorsError("no recipe in the checkpoint: pass --prompts SOURCE")
    spec = spec_type_of(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    serving = serving_of(cfg, ckpt)
    p_min_note = serving.llamacpp_p_min_note(cfg)
    if p_min_note and settings.p_mins:
        log(f"engine eval: no --spec-draft-p-min pass: {p_min_note}")
    settings = settings.for_drafter(serving.speculative_tokens(cfg), serving.llamacpp_max_draft(cfg), p_min_note)
    lc = require_llama_cpp()
    ref = _target_ref(ckpt, rec, target_model)
    target_path, hf = target_files(ref, lc, _gguf_dir(ckpt), log=log)
    outtypes = tuple(settings.draft_outtypes)
    drafts = {o: draft_gguf(lc, ckpt, hf, o, log) for o in outtypes}
    shifted = shifted_taps_gguf(lc, ckpt, hf, outtypes[0], log) if settings.negative_control else None
    target = Target.load(ref, dtype="float32", log=log)  # the tokenizer and the data pipeline's prompts
    if settings.target_type is not None:
        target_path = engine_gguf(target, lc, settings.target_type, log, field="--target-type")
    plist, label = eval_prompts(prompts, rec, target, num_prompts, log)
    del target
    ids = [list(map(int, p["input_ids"])) for p in plist]
    log(f"engine eval: {len(ids)} prompts ({label}) through llama-server ({lc.server}) on {target_path.name}, "
        f"K={list(settings.ks)}, "
        f"temperatures {list(settings.temperatures)}, slots {list(settings.parallel)}")
    models = EngineModels(target=target_path, drafts=drafts, spec_type=spec, shifted=shifted[0] if shifted else None,
                          shifted_by=shifted[1] if shifted else None)
    report = run_engine_eval(lc, models, ids, settings, log=log)
    report.update(checkpoint=str(ckpt), prompts=label, target_gguf=str(target_path), draft_spec_type=spec,
                  draft_ggufs={o: str(p) for o, p in drafts.items()})
    loop = _loop_report(ckpt, len(ids))
    report["loop_report"] = loop.get("path") if loop else None
    report["loop_comparison"] = loop_comparison(report, loop)
    report["timings"] = timings(report)
    best = next((r for r in report["rows"] if r["label"] == report["best"]["row"]), None)
    if best is not None:
        report["best"]["serve"] = serve_command(lc, target_path, drafts[best["draft_outtype"]], spec, best["k"],
                                                best["p_min"], best["draft_threads"])
    out = Path(output) if output is not None else ckpt.parent / REPORT_DIR
    write_engine_report(report, out)
    log(render_markdown(report).rstrip())
    return report, out


__all__ = ["REPORT_DIR", "draft_gguf", "engine_eval", "export_run", "serve_command", "shifted_taps_gguf"]
