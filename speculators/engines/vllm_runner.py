"""Our side of the vLLM worker: the target directory vLLM loads, the request, and the typed answer.

:func:`run_vllm` writes a request (:mod:`.vllm_worker`'s docstring has its shape), runs the worker with the vLLM
venv's python (:func:`.vllm_env.ensure_vllm_python`) and reads back one :class:`EngineRun` per engine. vLLM loads a
Hugging Face directory (:func:`vllm_target_dir`): a local model directory as it is, the cached float32 conversion
of a GGUF target (:func:`speculators.target.loading.gguf_cache_dir`, written when the target was first loaded), a
hub id as given (vLLM reads it from the local Hugging Face cache), anything else (a target built in memory) saved
once under ``<cache>/vllm/targets/<fingerprint>/``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import SpeculatorsError
from ..utils import atomic_dir, cache_root
from .vllm_env import VllmUnavailable, clean_env, ensure_vllm_python

#: the worker script, run by path with the vLLM venv's python
WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class Output:
    """One request as vLLM finished it. ``per_step_accepted`` / ``per_step_drafted``: vLLM's own per-request record,
    one entry per verify step that drafted (``--per-request-spec-decode-metrics detailed``), None without
    speculative decoding. ``seconds``: submission to end (wall); ``decode_seconds``: vLLM's first to last token.
    ``logprobs``: per generated token, the engine's top log-probabilities ``{token id: logprob}`` (when asked).
    ``decode_steps``: engine steps that appended tokens after the first token's (None when not counted).
    ``drafts``: per step, the token ids vLLM drafted for the request (the worker's record; None without one)."""

    token_ids: list[int]
    finish_reason: str | None = None
    seconds: float = 0.0
    decode_seconds: float | None = None
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    decode_steps: int | None = None
    drafts: list[list[int]] | None = None


@dataclass
class Job:
    """One job's answer: ``outputs`` in prompt order, ``wall_seconds`` of the timed requests, ``counters`` the
    differences of vLLM's Prometheus spec-decode counters over them (``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens``, ``accepted_per_pos``), ``max_in_flight`` the most requests the worker had submitted
    and not yet finished at once (a ``generate`` job's concurrency, as it ran)."""

    kind: str
    outputs: list[Output]
    wall_seconds: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int | None = None


@dataclass
class EngineRun:
    """One engine: ``ok`` False with vLLM's ``error`` when it refused the configuration; ``threads`` the torch
    threads vLLM's CPU worker ran with, ``cpus`` the cores the process could use."""

    label: str
    ok: bool
    error: str | None = None
    init_seconds: float | None = None
    threads: int | None = None
    cpus: int | None = None
    jobs: list[Job] = field(default_factory=list)


def _lp(d: dict | None) -> dict[int, float] | None:
    return None if d is None else {int(k): float(v) for k, v in d.items()}


def _parse_engine(e: dict[str, Any]) -> EngineRun:
    jobs = []
    for j in e.get("jobs", []):
        outs = []
        for o in j["outputs"]:
            if j["kind"] == "prompt_logprobs":
                outs.append(Output([], prompt_logprobs=[_lp(d) for d in o["prompt_logprobs"]]))
                continue
            spec = o.get("spec")
            outs.append(Output(list(o["token_ids"]), o.get("finish_reason"), float(o.get("seconds") or 0.0),
                               o.get("decode_seconds"), spec["per_step_accepted"] if spec else None,
                               spec["per_step_drafted"] if spec else None,
                               [_lp(d) for d in o["logprobs"]] if o.get("logprobs") else None,
                               decode_steps=o.get("decode_steps"), drafts=o.get("drafts")))
        jobs.append(Job(j["kind"], outs, float(j.get("wall_seconds") or 0.0), j.get("counters") or {},
                        j.get("max_in_flight")))
    return EngineRun(e["label"], bool(e["ok"]), e.get("error"), e.get("init_seconds"), e.get("threads"),
                     e.get("cpus"), jobs)


def generate_job(prompts: list[list[int]], max_tokens: int, stop_ids: list[int], *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, concurrency: int = 1, logprobs: int = 0,
                 warmup: bool = True) -> dict[str, Any]:
    """A ``generate`` job: every prompt (token ids) decoded to at most ``max_tokens`` tokens, stopping on
    ``stop_ids`` (vLLM's own EOS handling is off: the stops are ours), at most ``concurrency`` in flight; request i
    sampled with seed ``seed + i``; ``logprobs`` top log-probabilities per token (0: none)."""
    if not prompts or any(not p for p in prompts):
        raise SpeculatorsError("vLLM job: every prompt needs at least one token id")
    return {"kind": "generate", "prompts": [[int(t) for t in p] for p in prompts], "max_tokens": int(max_tokens),
            "stop_token_ids": [int(t) for t in stop_ids], "temperature": float(temperature), "top_p": float(top_p),
            "seed": int(seed), "concurrency": int(concurrency), "logprobs": int(logprobs), "warmup": bool(warmup)}


def prompt_logprobs_job(prompts: list[list[int]], logprobs: int = 20) -> dict[str, Any]:
    """A ``prompt_logprobs`` job: per prompt, the engine's top ``logprobs`` next-token log-probabilities after every
    prefix, from ONE prefill forward (entry j: the next token after ``prompt[:j]``)."""
    return {"kind": "prompt_logprobs", "prompts": [[int(t) for t in p] for p in prompts], "logprobs": int(logprobs)}


def engine(label: str, speculative_config: dict[str, Any] | None = None, jobs: list[dict] | None = None,
           max_num_seqs: int = 4) -> dict[str, Any]:
    """One engine of a request: ``speculative_config`` as vLLM's ``--speculative-config`` (None: plain)."""
    return {"label": label, "speculative_config": speculative_config, "jobs": list(jobs or []),
            "max_num_seqs": int(max_num_seqs)}


#: speculative methods whose engine runs in a worker process of its own: after vLLM 0.32's ``ngram`` proposer has
#: loaded (numba), the next engine started in the same process fails in its Triton-kernel rebinding
#: (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``, vllm/triton_utils/dispatcher.py)
ISOLATED_METHODS = ("ngram",)


def run_vllm(target_dir: str | Path, engines: list[dict[str, Any]], *, dtype: str = "float32",
             max_model_len: int | None = None, seed: int = 0, python: str | Path | None = None, timeout: float = 3600,
             kv_cache_gib: int = 1, log: Callable[[str], None] = print) -> tuple[str, list[EngineRun]]:
    """Run ``engines`` on the target at ``target_dir``: one vLLM worker process for all of them, except that each
    engine of a method in :data:`ISOLATED_METHODS` gets a process of its own (results keep the order of ``engines``).

    Args:
        target_dir: a Hugging Face directory or hub id (:func:`vllm_target_dir`).
        engines: :func:`engine` dicts.
        dtype: vLLM's ``--dtype`` (``float32``, ``bfloat16``). max_model_len: vLLM's context (default: 1024 tokens
            within the target's ``max_position_embeddings``, :func:`fit_context`). kv_cache_gib:
            ``VLLM_CPU_KVCACHE_SPACE``.
        python: the vLLM venv's interpreter (default :func:`.vllm_env.ensure_vllm_python`).
    Returns:
        ``(vLLM version, one EngineRun per engine)``.
    Raises:
        VllmUnavailable: no vLLM venv. SpeculatorsError: a worker died (its last lines of output are quoted) or ran
            past ``timeout`` seconds.
    """
    if max_model_len is None:
        max_model_len = fit_context(target_dir, 1024)
    alone = [i for i, e in enumerate(engines) if (e.get("speculative_config") or {}).get("method") in ISOLATED_METHODS]
    groups = [[i for i in range(len(engines)) if i not in alone]] + [[i] for i in alone]
    out: list[EngineRun | None] = [None] * len(engines)
    version = ""
    for g in (g for g in groups if g):
        version, runs = _run_worker(target_dir, [engines[i] for i in g], dtype=dtype, max_model_len=max_model_len,
                                    seed=seed, python=python, timeout=timeout, kv_cache_gib=kv_cache_gib, log=log)
        for i, r in zip(g, runs):
            out[i] = r
    return version, [r for r in out if r is not None]


def _run_worker(target_dir: str | Path, engines: list[dict[str, Any]], *, dtype: str = "float32",
             max_model_len: int = 1024, seed: int = 0, python: str | Path | None = None, timeout: float = 3600,
             kv_cache_gib: int = 1, log: Callable[[str], None] = print) -> tuple[str, list[EngineRun]]:
    """:func:`run_vllm` in ONE worker process, engines in order."""
    py = ensure_vllm_python(python)
    req = {"target": str(target_dir), "dtype": dtype, "max_model_len": int(max_model_len), "seed": int(seed),
           "kv_cache_gib": int(kv_cache_gib), "engines": engines}
    with tempfile.TemporaryDirectory(prefix="speculators-vllm-") as tmp:
        rq, rs = Path(tmp) / "request.json", Path(tmp) / "response.json"
        rq.write_text(json.dumps(req))
        env = clean_env()
        log(f"vLLM: {len(engines)} engine(s) on {target_dir} ({dtype}): {', '.join(e['label'] for e in engines)}")
        try:
            r = subprocess.run([str(py), str(WORKER), str(rq), str(rs)], capture_output=True, text=True,
                               timeout=timeout, cwd=tmp, env=env)
        except subprocess.TimeoutExpired as e:
            raise SpeculatorsError(f"vLLM worker ran past {timeout:.0f} s") from e
        except OSError as e:
            raise VllmUnavailable(f"{py} could not run: {e}") from e
        resp = json.loads(rs.read_text()) if rs.is_file() else None
        if r.returncode != 0 or resp is None or len(resp["engines"]) != len(engines):
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
            raise SpeculatorsError(f"vLLM worker failed (exit {r.returncode}) after "
                                   f"{len(resp['engines']) if resp else 0} of {len(engines)} engines:\n{tail}")
    return resp["vllm_version"], [_parse_engine(e) for e in resp["engines"]]


def vllm_target_dir(target, log: Callable[[str], None] = print) -> Path | str:
    """The Hugging Face directory (or hub id) vLLM loads for ``target`` (a :class:`speculators.target.Target`; module
    docstring). The weights are what our loader reads (a GGUF dequantized to float32), so vLLM and our loop decode the
    same model.

    Raises:
        SpeculatorsError: the directory cannot be written.
    """
    from ..target.loading import gguf_cache_dir, resolve_model_ref
    from ..utils import stable_hash

    ref = getattr(target, "name_or_path", None) or ""
    try:
        directory, gguf = resolve_model_ref(ref) if ref else (None, None)
    except SpeculatorsError:
        directory, gguf = None, None
    if directory is not None and not getattr(target, "adapted", False):
        if gguf is not None:
            cached = gguf_cache_dir(Path(directory) / gguf)
            if (cached / "config.json").is_file():
                return cached
        elif Path(directory).is_dir() and (Path(directory) / "config.json").is_file():
            return Path(directory)
        elif not Path(directory).exists():
            return directory  # a hub id: vLLM reads the local Hugging Face cache
    out = cache_root() / "vllm" / "targets" / stable_hash(target.fingerprint)
    if not (out / "config.json").is_file():
        log(f"vLLM: writing the target as a Hugging Face directory for vLLM: {out}")
        try:
            # only an incomplete entry is replaced; one another process completes meanwhile is kept (and used)
            with atomic_dir(out, overwrite=out.exists()) as tmp:
                target.save_pretrained(tmp)
        except FileExistsError:
            pass
    return out


def fit_context(target_dir: str | Path, needed: int) -> int:
    """``needed`` tokens of context, within the target's ``max_position_embeddings`` (vLLM refuses more)."""
    cfg_path = Path(target_dir) / "config.json"
    if not cfg_path.is_file():
        return int(needed)
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    mpe = cfg.get("max_position_embeddings")
    return int(min(needed, mpe)) if mpe else int(needed)


__all__ = ["EngineRun", "Job", "Output", "engine", "generate_job", "fit_context", "prompt_logprobs_job",
           "run_vllm", "vllm_target_dir"]
