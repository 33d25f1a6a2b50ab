"""The verify-cost curve of a target inside llama.cpp: what a forward of n tokens costs against one token.

A speculative step verifies K drafts in one target forward of K + 1 tokens. Whether a drafter can pay in an
engine is bounded by how that forward's cost grows with n: with free drafts, a drafter breaks even only at tau
= T(K + 1) / T(1) (tau: tokens per target forward, our definition), and every draft forward adds to that. On a
GPU T(n) is flat for small n; on a CPU it depends on the weight type's kernels (llama.cpp's repacked Q4_0 / Q4_K /
IQ4_NL, its tinyBLAS sgemm for F16 / BF16 / Q8_0 / Q4_0, the generic quantized dot products for the rest) and on
whether a one-token forward is bound by memory or by compute: measure it, do not infer it from the kernel list
(on a 2-core AVX512 machine the shipped Q4_1 SmolLM2 batched best of Q4_1, Q4_0, Q8_0 and F16).

:func:`verify_cost_curve` measures T(n) with llama.cpp's own ``llama-bench`` (built by ``make llama-cpp``), the
way upstream advises for speculative decoding (``llama-bench -p 1,2,3,5,8 -n 0``): a prompt-processing test of n
tokens on top of ``depth`` cached tokens (``-d``: the cached context of a decode step), ``repetitions`` timed runs
after a warm-up, the same threads and repack setting as our ``llama-server`` (:mod:`.llamacpp_server`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

from ..errors import SpeculatorsError
from .llamacpp_build import LlamaCpp, build_options, repack_broken

#: forward lengths n timed by default: K + 1 for K = 1..4, and 8 (K = 7)
CURVE_TOKENS = (1, 2, 3, 4, 5, 8)


def verify_cost_curve(lc: LlamaCpp, gguf: str | Path, *, tokens: tuple[int, ...] = CURVE_TOKENS, depth: int = 128,
                      threads: int | None = None, repetitions: int = 5, timeout_s: float = 600.0,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """T(n) of the target GGUF ``gguf`` for every n in ``tokens`` (module docstring), through ``llama-bench``.

    Args:
        lc: the llama.cpp build (with ``llama-bench``). gguf: the target GGUF as served.
        tokens: forward lengths (each >= 1; 1 is added when absent: the ratios' denominator).
        depth: tokens already in the KV cache before each timed forward (``-d``).
        threads: ``-t`` (None: all cores, as :class:`.llamacpp_server.LlamaServer`).
        repetitions: timed runs per length (``-r``); the warm-up run is llama-bench's own.
    Returns:
        ``{"tokens": [n], "ms": [mean ms of a forward of n tokens], "ms_std": [...], "ratio": [T(n) / T(1)],
        "depth", "threads", "repetitions", "gguf", "model_type", "cpu_info", "build_commit", "openmp" (the build's
        ``GGML_OPENMP``), "command"}``.
    Raises:
        SpeculatorsError: a length below 1, or llama-bench failed or printed no result (its last lines quoted).
        LlamaCppUnavailable: the build has no ``llama-bench``.
    """
    ns = sorted({1, *(int(n) for n in tokens)})
    if ns[0] < 1:
        raise SpeculatorsError(f"verify-cost curve: forward lengths {list(tokens)} must be >= 1")
    threads = int(threads or os.cpu_count() or 1)
    cmd = [str(lc.tool("llama-bench")), "-m", str(gguf), "-p", ",".join(map(str, ns)), "-n", "0", "-d", str(int(depth)),
           "-r", str(int(repetitions)), "-t", str(threads), "-o", "json"]
    if repack_broken():
        cmd += ["--repack", "0"]  # as llama-server here (llamacpp_server)
    log(f"verify-cost curve: llama-bench on {Path(gguf).name}, n = {ns}, depth {depth}, {threads} threads")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SpeculatorsError(f"llama-bench on {gguf} did not finish in {timeout_s:.0f} s") from None
    if r.returncode != 0:
        tail = " | ".join((r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-4:])
        raise SpeculatorsError(f"llama-bench on {gguf} failed (exit {r.returncode}): {tail}")
    try:
        results = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise SpeculatorsError(f"llama-bench on {gguf} printed no JSON: {r.stdout.strip()[-300:]!r}") from None
    by_n = {int(e["n_prompt"]): e for e in results if int(e.get("n_gen", 0)) == 0}
    missing = [n for n in ns if n not in by_n]
    if missing:
        raise SpeculatorsError(f"llama-bench on {gguf} reported no result for n = {missing}")
    ms = [by_n[n]["avg_ns"] / 1e6 for n in ns]
    first = results[0]
    return {"tokens": ns, "ms": ms, "ms_std": [by_n[n]["stddev_ns"] / 1e6 for n in ns],
            "ratio": [m / ms[0] for m in ms], "depth": int(depth), "threads": threads,
            "repetitions": int(repetitions), "gguf": str(gguf), "model_type": first.get("model_type"),
            "cpu_info": first.get("cpu_info"), "build_commit": first.get("build_commit"),
            "openmp": build_options(lc).get("GGML_OPENMP"), "command": " ".join(cmd)}


def break_even_taus(curve: dict[str, Any], ks: tuple[int, ...] | list[int]) -> dict[int, float | None]:
    """The target-only break-even tau at each K: T(K + 1) / T(1) from ``curve`` (:func:`verify_cost_curve`), the
    tau a drafter whose draft forwards cost nothing must exceed to pay; None where K + 1 was not timed."""
    ratio = dict(zip(curve["tokens"], curve["ratio"]))
    return {int(k): ratio.get(int(k) + 1) for k in ks}


def curve_lines(curve: dict[str, Any] | None, ks: tuple[int, ...] | list[int] = ()) -> list[str]:
    """The curve as markdown (a table of n, ms and T(n)/T(1), then the break-even tau per K), or nothing."""
    if not curve:
        return []
    omp = {"ON": "; OpenMP build", "OFF": "; ggml threadpool build"}.get(str(curve.get("openmp")), "")
    lines = ["", f"Verify-cost curve of the target (`llama-bench -p {','.join(map(str, curve['tokens']))} -n 0 -d "
                 f"{curve['depth']}`, {curve['threads']} threads, {curve['repetitions']} runs; "
                 f"{curve.get('model_type') or ''}{omp}):",
             "", "| forward of n tokens | ms | T(n) / T(1) |", "|---|---|---|"]
    for n, m, s, q in zip(curve["tokens"], curve["ms"], curve["ms_std"], curve["ratio"]):
        lines.append(f"| {n} | {m:.2f} ± {s:.2f} | {q:.2f} |")
    be = {k: v for k, v in break_even_taus(curve, ks).items() if v is not None}
    if be:
        lines += ["", "Break-even tau with free drafts, T(K+1) / T(1): " + ", ".join(f"K={k} {v:.2f}" for k, v in be.items())
                  + " (each draft forward adds to it)."]
    return lines


def plain_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The engine eval's plain-decoding row at temperature 0 and one slot (the baseline of every ratio), or None."""
    return next((r for r in rows if r["method"] == "plain" and r["temperature"] == 0 and r["batch_size"] == 1), None)


def k_sweep_row(r: dict[str, Any]) -> bool:
    """Whether an engine eval row is one of the drafter's K sweep: temperature 0, one slot, no p_min, the
    server's draft threads (its draft type is the caller's to check)."""
    return (r["method"], r["temperature"], r["batch_size"], r.get("p_min"), r.get("draft_threads")) == (
        "drafter", 0.0, 1, None, None)


def step_costs(rows: list[dict[str, Any]], curve: dict[str, Any] | None, draft_outtype: str | None = None,
               ) -> list[dict[str, Any]]:
    """Where a speculative step's time goes, per K of the drafter's K sweep (temperature 0, one slot, no p_min, the
    main draft type ``draft_outtype``), from the engine eval's ``rows`` (:mod:`.llamacpp_eval`) and ``curve``.

    ``plain_ms``: the server's ms per plain decode step; ``step_ms``: its ms per speculative step (generation time
    over target forwards); ``target_ms``: the verify forward's share, ``plain_ms * T(K+1) / T(1)`` (None without
    that length in the curve); ``rest_ms = step_ms - target_ms``: the draft forwards, sampling and the server's
    bookkeeping; ``break_even_tau = step_ms / plain_ms`` (the tau this step needs to pay); ``free_draft_tau`` =
    T(K+1) / T(1). Units: milliseconds. Empty without a plain row or steps.
    """
    plain = plain_row(rows)
    if plain is None or not plain.get("steps") or not plain.get("decode_seconds"):
        return []
    plain_ms = 1000.0 * plain["decode_seconds"] / plain["steps"]
    ratio = dict(zip(curve["tokens"], curve["ratio"])) if curve else {}
    out = []
    for r in rows:
        if not k_sweep_row(r) or (draft_outtype and r.get("draft_outtype") != draft_outtype):
            continue
        if not r.get("steps"):
            continue
        step_ms = 1000.0 * r["decode_seconds"] / r["steps"]
        q = ratio.get(int(r["k"]) + 1)
        target_ms = plain_ms * q if q is not None else None
        out.append({"k": r["k"], "tau": r["tau"], "plain_ms": plain_ms, "step_ms": step_ms, "target_ms": target_ms,
                    "rest_ms": step_ms - target_ms if target_ms is not None else None,
                    "break_even_tau": step_ms / plain_ms, "free_draft_tau": q})
    return out


def step_cost_lines(costs: list[dict[str, Any]]) -> list[str]:
    """:func:`step_costs` as a markdown table (nothing when empty)."""
    if not costs:
        return []

    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    lines = ["", f"Where a speculative step's time goes (plain decode step {costs[0]['plain_ms']:.2f} ms; target "
                 "forward of K+1 tokens = plain step x T(K+1)/T(1)):", "",
             "| K | tau | ms per step | target forward | the rest: drafts, sampling, server | break-even tau | "
             "with free drafts |", "|---|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c['k']} | {f(c['tau'], '.3f')} | {f(c['step_ms'])} | {f(c['target_ms'])} | {f(c['rest_ms'])} | "
                     f"{f(c['break_even_tau'])} | {f(c['free_draft_tau'])} |")
    return lines


__all__ = ["CURVE_TOKENS", "break_even_taus", "curve_lines", "k_sweep_row", "plain_row", "step_cost_lines",
           "step_costs", "verify_cost_curve"]
