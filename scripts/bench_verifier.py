#!/usr/bin/env python
"""Benchmark the rejection-sampling verifier (speculators.verify.rejection_sample).

For each (batch, K, vocab), temperature and draft-probs mode it times one verification call of
  * torch  - the vectorised torch implementation (impl="torch"),
  * triton - the Triton kernels (CUDA only),
  * loop   - the per-request Python-loop reference (naive vLLM-style torch code, same algorithm and
             same sampling rule per request),
and prints the speedup of the vectorised implementation(s) over the loop and the effective bandwidth:
bytes of the inputs the verifier must read (target logits [T+B, V], plus draft probs [T, V] for sampled
rows with draft probs; float32) divided by the call time, as a fraction of the measured memory-copy
bandwidth (best of a large ``clone`` and a ``copy_`` into a preallocated buffer, counting read + write
bytes). The byte count is nominal: on CPU the verifier skips rows after each request's first rejection,
so the fraction can exceed 1 (greedy especially).

Rows: greedy (temperature 0; draft probs are irrelevant), and sampled with draft probs ("q") and with
point-mass drafts ("pm", draft_probs=None). All implementations consume the same random numbers
(``draw_randoms``: one float32 uniform per draft for the accept tests, one float64 uniform per request
for its recovered / bonus token, sampled by inverse CDF); drawing them is timed once ("rng ms") and
added to every call time.

Every request drafts K tokens sampled from a draft distribution close to the target's (the accepted
count per request is shown as ``acc``).

What bounds the speedup on CPU: both implementations must exponentiate every target row they read
(~14 us per 49152-wide row for ``exp2`` on one core here, more for softmax's ``exp``). The loop
normalises all K + 1 rows of a request; the vectorised path only the ``1 + acc`` rows some accept test
or sample reads. Greedy needs no exponent at all (block-wise argmax, memory-bound), and point-mass
drafts here are rejected at the first position, so those rows show the removed Python overhead;
with draft probs at ``acc ~ 1.8`` of K = 8 the arithmetic alone caps the ratio near
``(K + 1) / (1 + acc) ~ 3.2`` times the loop's per-row cost over ours.

Calls use validate=False (hot-loop mode) unless --validate.
Times are the best of --repeats calls (the loop: of --loop-repeats), which filters out most preemption
on a busy machine; ``--clock cpu`` times this process's CPU time instead of wall time (CPU, one thread).

    python scripts/bench_verifier.py                 # full grid (CPU: configs above --max-gb skipped)
    python scripts/bench_verifier.py --quick
    python scripts/bench_verifier.py --batch 64 --k 8 --vocab 49152      # the acceptance configuration
    python scripts/bench_verifier.py --batch 64 --k 8 --vocab 49152 --clock cpu   # on a shared machine
    python scripts/bench_verifier.py --device cuda --temperature 0.7 --top-p 0.9
    python scripts/bench_verifier.py --quick --order eager    # the target side's order (lazy: CPU only)
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


CLOCK = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time)


def _time(fn, device: torch.device, repeats: int, budget_s: float) -> float:
    """Best time of ``fn`` (``CLOCK``) over up to ``repeats`` runs (after one warm-up), in seconds."""
    _sync(device)
    t0 = CLOCK()
    fn()
    _sync(device)
    first = CLOCK() - t0
    best = first
    for _ in range(repeats):
        if first > budget_s:
            break
        t0 = CLOCK()
        fn()
        _sync(device)
        best = min(best, CLOCK() - t0)
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
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--draft-probs", choices=["both", "yes", "no"], default="both",
        help="sampled rows with draft probs (yes), with point-mass drafts / draft_probs=None (no), or both",
    )
    ap.add_argument("--no-draft-probs", action="store_true", help="same as --draft-probs no")
    ap.add_argument("--draft-noise", type=float, default=1.0, help="std of noise added to target logits for q")
    ap.add_argument("--validate", action="store_true", help="include input validation in the timed calls")
    ap.add_argument(
        "--order", choices=["auto", "lazy", "eager"], default="auto",
        help="rejection_sample(order=...): target-side evaluation order (lazy: CPU only; auto: lazy for large "
        "CPU inputs)",
    )
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per vectorised implementation (best)")
    ap.add_argument("--loop-repeats", type=int, default=8, help="timed calls of the loop (best, within ~1 s)")
    ap.add_argument(
        "--max-gb", type=float, default=None,
        help="skip configs whose inputs exceed this many GB (default: 1.5 on CPU, unlimited on CUDA)",
    )
    ap.add_argument("--no-loop", action="store_true", help="skip the per-request loop reference")
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall time, or this process's CPU time (CPU device only: on a busy machine it excludes the time "
        "other processes hold the core; use with one thread)",
    )
    ap.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads (CPU; default: torch's, or 1 when other processes keep the cores busy)",
    )
    args = ap.parse_args(argv)
    global CLOCK
    if args.clock == "cpu":
        if args.device != "cpu":
            ap.error("--clock cpu needs --device cpu")
        CLOCK = time.process_time
    if args.no_draft_probs:
        args.draft_probs = "no"
    if args.order == "lazy" and args.device != "cpu":
        ap.error("--order lazy needs --device cpu")
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
    modes = {"both": ["q", "pm"], "yes": ["q"], "no": ["pm"]}[args.draft_probs]

    bw = copy_bandwidth(device, (256 << 20) if device.type == "cpu" else (2 << 30))
    header = (
        f"device={device} threads={torch.get_num_threads()} top_k={args.top_k} top_p={args.top_p} "
        f"validate={args.validate} order={args.order} clock={args.clock} | "
        f"q: draft probs, pm: point-mass drafts (draft_probs=None) | "
        f"copy bandwidth {bw / 1e9:.1f} GB/s (read+write)" + note
    )
    rows = []
    for vocab in args.vocab:
        for k in args.k:
            for batch in args.batch:
                total = batch * k
                cases = [(t, "-" if t == 0 else m) for t in args.temperature for m in (["-"] if t == 0 else modes)]
                full_bytes = ((total + batch) * vocab + total * vocab) * 4
                if full_bytes / 1e9 > max_gb:
                    rows += [(t, m, batch, k, vocab, None, None) for t, m in cases]
                    continue
                ids, nums, q, logits = make_inputs(batch, k, vocab, device, args.draft_noise)
                for temp, mode in cases:
                    dp = q if mode == "q" else None
                    nbytes = ((total + batch) * vocab + (total * vocab if dp is not None else 0)) * 4
                    res = _bench_one(args, device, impls, ids, nums, dp, logits, temp)
                    rows.append((temp, mode, batch, k, vocab, nbytes, res))
                    print("  ".join(_cells(rows[-1], impls, bw, args.no_loop)), file=sys.stderr, flush=True)
                del ids, q, logits
    _print_table(header, rows, impls, bw, args.no_loop)
    for temp, mode, batch, k, vocab, nbytes, res in rows:
        if (batch, k, vocab) == (64, 8, 49152) and res is not None and "loop" in res:
            kind = "greedy" if temp == 0 else f"temperature {temp:g}, " + (
                "draft probs" if mode == "q" else "point-mass drafts"
            )
            print(f"batch 64, K 8, vocab 49152, {kind}: vectorised torch {res['torch'] * 1e3:.2f} ms vs loop "
                  f"{res['loop'] * 1e3:.2f} ms -> {res['loop'] / res['torch']:.1f}x faster; effective bandwidth "
                  f"{nbytes / res['torch'] / bw:.2f} x copy bandwidth (acc {res['acc']:.2f})")


def _bench_one(args, device, impls, ids, nums, q, logits, temp) -> dict:
    vocab = logits.shape[1]
    sp = SamplingParams.uniform(len(nums), temperature=temp, top_k=args.top_k, top_p=args.top_p, device=device)
    res = {"rng": _time(lambda: draw_randoms(nums, vocab, sp, device=device), device, args.repeats, 5.0)}
    # Fixed seed: every run (and every implementation) sees the same accept decisions and acceptance.
    randoms = draw_randoms(nums, vocab, sp, torch.Generator(device=device).manual_seed(1), device=device)
    for impl in impls:
        fn = lambda impl=impl: rejection_sample(  # noqa: E731
            ids, nums, q, logits, sp, impl=impl, order=args.order, validate=args.validate, randoms=randoms
        )
        res[impl] = _time(fn, device, args.repeats, 5.0) + res["rng"]
        if "acc" not in res:
            res["acc"] = float(fn().num_accepted.float().mean())
    if not args.no_loop:
        fn = lambda: rejection_sample_reference(  # noqa: E731
            ids, nums, q, logits, sp, validate=args.validate, randoms=randoms
        )
        res["loop"] = _time(fn, device, args.loop_repeats, 1.0) + res["rng"]
    return res


def _cells(row, impls, bw, no_loop):
    temp, mode, batch, k, vocab, nbytes, res = row
    head = [f"{temp:g}", mode, str(batch), str(k), str(vocab)]
    if res is None:
        return head + ["skipped (--max-gb)"] + [""] * (len(_columns(impls, no_loop)) - 6)
    cells = head + [f"{nbytes / 1e6:.0f}", f"{res['acc']:.2f}", f"{res['rng'] * 1e3:.2f}"]
    for impl in impls:
        cells.append(f"{res[impl] * 1e3:.2f}")
    if not no_loop:
        cells.append(f"{res['loop'] * 1e3:.2f}")
        for impl in impls:
            cells.append(f"{res['loop'] / res[impl]:.1f}x")
    for impl in impls:
        cells.append(f"{nbytes / res[impl] / bw:.2f}")
    return cells


def _columns(impls, no_loop):
    cols = ["temp", "draft", "batch", "K", "vocab", "MB in", "acc", "rng ms"] + [f"{i} ms" for i in impls]
    if not no_loop:
        cols += ["loop ms"] + [f"{i} speedup" for i in impls]
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
