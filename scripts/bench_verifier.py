#!/usr/bin/env python
"""Benchmark the rejection-sampling verifier (speculators.verify.rejection_sample).

For each (batch, K, vocab) it times one verification call of
  * torch  - the vectorised torch implementation (impl="torch"),
  * triton - the Triton kernels (CUDA only),
  * loop   - the per-request Python-loop reference (naive vLLM-style torch code),
and prints the speedup of the vectorised implementation(s) over the loop and the effective bandwidth:
bytes of the inputs the verifier must read (target logits [T+B, V] + draft probs [T, V], float32)
divided by the call time, as a fraction of the measured memory-copy bandwidth (best of a large
``clone`` and a ``copy_`` into a preallocated buffer, counting read + write bytes). The byte count is
nominal: on CPU the verifier skips rows after each request's first rejection, so the fraction can
exceed 1 (greedy especially).

All implementations consume the same random numbers (``draw_randoms``: B x V exponential noise plus one
uniform per draft), so their generation is timed once ("rng ms") and added to every call time;
"speedup ex-rng" compares the implementations without that shared part.

Every request drafts K tokens sampled from a draft distribution close to the target's (the accepted
count per request is shown as ``acc``). Calls use validate=False (hot-loop mode) unless --validate.

    python scripts/bench_verifier.py                 # full grid (CPU: configs above --max-gb skipped)
    python scripts/bench_verifier.py --quick
    python scripts/bench_verifier.py --device cuda --temperature 0.7 --top-p 0.9
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators.verify import (  # noqa: E402
    SamplingParams,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, budget_s: float) -> float:
    """Best wall time of ``fn`` over up to ``repeats`` runs (after one warm-up), in seconds."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    best = first
    for _ in range(repeats):
        if first > budget_s:
            break
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Memory-copy bandwidth in bytes/s (read + write), best of clone and copy_ into a buffer."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    y = torch.empty_like(x)
    t_clone = _time(lambda: x.clone(), device, 3, 10.0)
    t_copy = _time(lambda: y.copy_(x), device, 3, 10.0)
    return 2 * x.numel() * 4 / min(t_clone, t_copy)


def make_inputs(batch: int, k: int, vocab: int, device: torch.device, draft_noise: float, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = batch * k
    target = torch.randn(batch, k + 1, vocab, device=device, generator=gen).mul_(3.0)
    draft_logits = target[:, :k].reshape(total, vocab) + draft_noise * torch.randn(
        total, vocab, device=device, generator=gen
    )
    q = torch.softmax(draft_logits, dim=-1)
    del draft_logits
    # Drafts ~ q (exponential race, chunked to bound memory).
    ids = torch.empty(total, dtype=torch.int64, device=device)
    step = max(1, (64 << 20) // (4 * vocab))
    for s in range(0, total, step):
        e = torch.empty(min(step, total - s), vocab, device=device).exponential_(generator=gen)
        ids[s : s + step] = (q[s : s + step] / e).argmax(dim=-1)
    return ids, [k] * batch, q, target.reshape(batch * (k + 1), vocab)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 152064])
    ap.add_argument("--quick", action="store_true", help="batch {1, 64}, K {1, 8}, vocab {32000, 49152}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.0], help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-draft-probs", action="store_true", help="point-mass drafts (draft_probs=None)")
    ap.add_argument("--draft-noise", type=float, default=1.0, help="std of noise added to target logits for q")
    ap.add_argument("--validate", action="store_true", help="include input validation in the timed calls")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--max-gb", type=float, default=None,
        help="skip configs whose inputs exceed this many GB (default: 1.5 on CPU, unlimited on CUDA)",
    )
    ap.add_argument("--no-loop", action="store_true", help="skip the per-request loop reference")
    ap.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads (CPU; default: torch's, or 1 when other processes keep the cores busy)",
    )
    args = ap.parse_args(argv)
    note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" and hasattr(os, "getloadavg"):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if cores > 1 and load > 0.5 * cores:
            # OpenMP thread teams stall when other processes hold the cores: time single-threaded.
            torch.set_num_threads(1)
            note = f" | busy machine (load {load:.1f} on {cores} cores): 1 thread, --threads N to override"
    if args.quick:
        args.batch, args.k, args.vocab = [1, 64], [1, 8], [32000, 49152]
    device = torch.device(args.device)
    max_gb = args.max_gb if args.max_gb is not None else (1.5 if device.type == "cpu" else float("inf"))
    impls = ["torch"] + (["triton"] if device.type == "cuda" else [])

    bw = copy_bandwidth(device, (256 << 20) if device.type == "cpu" else (2 << 30))
    header = (
        f"device={device} threads={torch.get_num_threads()} top_k={args.top_k} top_p={args.top_p} "
        f"draft_probs={'no' if args.no_draft_probs else 'yes'} validate={args.validate} | "
        f"copy bandwidth {bw / 1e9:.1f} GB/s (read+write)" + note
    )
    rows = []
    for vocab in args.vocab:
        for k in args.k:
            for batch in args.batch:
                total = batch * k
                nbytes = ((total + batch) * vocab + (0 if args.no_draft_probs else total * vocab)) * 4
                if nbytes / 1e9 > max_gb:
                    rows += [(t, batch, k, vocab, nbytes, None) for t in args.temperature]
                    continue
                ids, nums, q, logits = make_inputs(batch, k, vocab, device, args.draft_noise)
                if args.no_draft_probs:
                    q = None
                for temp in args.temperature:
                    res = _bench_one(args, device, impls, ids, nums, q, logits, temp)
                    rows.append((temp, batch, k, vocab, nbytes, res))
                    print("  ".join(_cells(rows[-1], impls, bw, args.no_loop)), file=sys.stderr, flush=True)
                del ids, q, logits
    _print_table(header, rows, impls, bw, args.no_loop)
    for temp, batch, k, vocab, _, res in rows:
        if (batch, k, vocab) == (64, 8, 49152) and res is not None and "loop" in res:
            s = res["loop"] / res["torch"]
            ex = (res["loop"] - res["rng"]) / (res["torch"] - res["rng"])
            print(f"batch 64, K 8, vocab 49152, temperature {temp}: vectorised torch {res['torch'] * 1e3:.1f} ms "
                  f"vs loop {res['loop'] * 1e3:.1f} ms -> {s:.1f}x faster ({ex:.1f}x without the shared "
                  f"{res['rng'] * 1e3:.1f} ms of random-number generation)")


def _bench_one(args, device, impls, ids, nums, q, logits, temp) -> dict:
    vocab = logits.shape[1]
    sp = SamplingParams.uniform(len(nums), temperature=temp, top_k=args.top_k, top_p=args.top_p, device=device)
    res = {"rng": _time(lambda: draw_randoms(nums, vocab, sp, device=device), device, args.repeats, 5.0)}
    randoms = draw_randoms(nums, vocab, sp, device=device)
    for impl in impls:
        fn = lambda impl=impl: rejection_sample(  # noqa: E731
            ids, nums, q, logits, sp, impl=impl, validate=args.validate, randoms=randoms
        )
        res[impl] = _time(fn, device, args.repeats, 5.0) + res["rng"]
        if "acc" not in res:
            res["acc"] = float(fn().num_accepted.float().mean())
    if not args.no_loop:
        fn = lambda: rejection_sample_reference(  # noqa: E731
            ids, nums, q, logits, sp, validate=args.validate, randoms=randoms
        )
        res["loop"] = _time(fn, device, min(args.repeats, 2), 1.0) + res["rng"]
    return res


def _cells(row, impls, bw, no_loop):
    temp, batch, k, vocab, nbytes, res = row
    head = [f"{temp:g}", str(batch), str(k), str(vocab), f"{nbytes / 1e6:.0f}"]
    if res is None:
        return head + ["skipped (--max-gb)"] + [""] * (len(_columns(impls, no_loop)) - 6)
    cells = head + [f"{res['acc']:.2f}", f"{res['rng'] * 1e3:.2f}"]
    for impl in impls:
        cells.append(f"{res[impl] * 1e3:.2f}")
    if not no_loop:
        cells.append(f"{res['loop'] * 1e3:.2f}")
        for impl in impls:
            cells.append(f"{res['loop'] / res[impl]:.1f}x")
            ex = (res["loop"] - res["rng"]) / max(res[impl] - res["rng"], 1e-9)
            cells.append(f"{ex:.1f}x")
    for impl in impls:
        cells.append(f"{nbytes / res[impl] / bw:.2f}")
    return cells


def _columns(impls, no_loop):
    cols = ["temp", "batch", "K", "vocab", "MB in", "acc", "rng ms"] + [f"{i} ms" for i in impls]
    if not no_loop:
        cols += ["loop ms"]
        for i in impls:
            cols += [f"{i} speedup", f"{i} speedup ex-rng"]
    cols += [f"{i} bw/copy" for i in impls]
    return cols


def _print_table(header, rows, impls, bw, no_loop):
    cols = _columns(impls, no_loop)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(header)
        print("  ".join(cols))
        for r in rows:
            print("  ".join(_cells(r, impls, bw, no_loop)))
        return
    table = Table(title="rejection_sample: time per call", caption=header)
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*_cells(r, impls, bw, no_loop))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
