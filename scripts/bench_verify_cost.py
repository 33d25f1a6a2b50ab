#!/usr/bin/env python
"""What one verification step costs against a plain decoding step, and why (batch 1 by default).

Speculative decoding at batch 1 pays only when a target forward over the K+1 tokens of a verify
(the last accepted token plus K drafts) costs little more than the 1-token forward of plain
decoding: tau must exceed ``cost(K+1) / cost(1)`` plus the drafting time. On a GPU the forward is
memory-bound and the ratio is near 1; on a CPU core it is not, and this script measures it.

Three tables, one thread (``--threads``), nothing else should run on the machine:

1. Target forward over m = 1..K+1 new tokens after a ``--context``-token prompt, batch 1, through
   the same decode session speculative decoding uses (:func:`speculators.evaluation.forward_cost.measure_verify_cost`:
   median of ``--reps`` timings, the cache rolled back after each), in ms and as a ratio to m = 1;
   with the break-even tau ``cost(m) / cost(1)`` for verifying m - 1 drafts (drafting time excluded).
2. The target's own matrix shapes (attention q/o, MLP up/down, lm_head) as ``F.linear`` over an
   ``[m, in]`` input, microseconds and ratio to m = 1: a 1-row product runs the BLAS matrix-vector
   path, 2+ rows a small-M GEMM whose per-call cost grows with m on a CPU core (on this machine, MKL
   on an AVX2 AMD EPYC, 2-3 rows cost ~2-3.5x one row; 5-8 rows ~3.5-4x), which is where the
   verify's extra cost comes from.
3. The memory-bandwidth bound of plain decoding: every decoding step reads all the target's weights
   once, so ``weights bytes / read bandwidth`` is the least time a 1-token forward can take. The read
   bandwidth is measured on the same thread count as the median of ``--reps`` sums of a tensor of
   ``--bandwidth-mb`` MB (larger than the caches) in the target's dtype; printed beside the measured
   1-token forward and their ratio (near 1: memory-bound, as on a GPU at batch 1; well above 1: compute
   or overhead-bound, where a verify of K+1 tokens costs more than one token).

    python scripts/bench_verify_cost.py                          # SmolLM2-135M (GGUF), K = 4
    python scripts/bench_verify_cost.py --k 8 --context 512
    python scripts/bench_verify_cost.py --model path/or/hub-id --dtype bfloat16
    python scripts/bench_verify_cost.py --batch-size 8            # forwards of 8 requests at a time

Timing only; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def linear_table(shapes: dict[str, tuple[int, int]], ms: list[int], reps: int, dtype: torch.dtype) -> list[str]:
    """Median microseconds of ``F.linear`` over ``[m, in] x [out, in]^T`` per shape and m."""
    g = torch.Generator().manual_seed(0)
    lines = ["| matrix (out x in) | " + " | ".join(f"m={m}" for m in ms) + " |",
             "|---|" + "---|" * len(ms)]
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f, generator=g).to(dtype)
        cells = []
        base = None
        for m in ms:
            x = torch.randn(m, in_f, generator=g).to(dtype)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - t0)
            us = 1e6 * statistics.median(times)
            base = us if base is None else base
            cells.append(f"{us:.0f} us ({us / base:.1f}x)")
        lines.append(f"| {name} ({out_f} x {in_f}) | " + " | ".join(cells) + " |")
    return lines


def read_bandwidth(mbytes: int, reps: int, dtype: torch.dtype) -> float:
    """Bytes per second of reading a ``mbytes``-MB tensor of ``dtype`` once (``x.sum()``; median of ``reps``
    after one warm-up)."""
    x = torch.ones(mbytes * 2 ** 20 // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * x.element_size() / statistics.median(times)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (a tied embedding / output head counted once: one decoding step reads
    the output head whole and one embedding row)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target (a name, path or Hub id)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="most drafts per verify (forwards of 1..K+1 tokens)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed forwards")
    ap.add_argument("--reps", type=int, default=15, help="timings per length (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1, help="requests per forward (the loop's batch session)")
    ap.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the tensor the read bandwidth sums")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from speculators.evaluation.forward_cost import measure_verify_cost
    from speculators.target import Target

    target = Target.load(args.model, dtype=args.dtype)
    dtype_name = str(target.dtype).removeprefix("torch.")  # ``auto`` resolved by Target.load
    cost = measure_verify_cost(target, args.k, reps=args.reps, prompt_len=args.context, batch_size=args.batch_size)
    print(f"\n{target.name_or_path} on {target.device}, {args.threads} thread(s), {dtype_name}, batch {args.batch_size}, "
          f"after a {args.context}-token prompt (median of {args.reps})\n")
    print("| tokens in the forward | drafts verified | ms | x 1-token (= break-even tau) |")
    print("|---|---|---|---|")
    for m, c in enumerate(cost):
        print(f"| {m + 1} | {m} | {1000 * c:.1f} | {c / cost[0]:.2f} |")
    cfg = target.model.config
    H, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    shapes = {"q/o proj": (cfg.num_attention_heads * hd, H), "MLP up/gate": (inter, H), "MLP down": (H, inter),
              "lm_head": (cfg.vocab_size, H)}
    print("\nF.linear over [m, in] (the same thread count; ratio to one row)\n")
    for line in linear_table(shapes, list(range(1, args.k + 2)), args.reps, target.dtype):
        print(line)
    nbytes = weights_bytes(target.model)
    bw = read_bandwidth(args.bandwidth_mb, args.reps, target.dtype)
    bound_ms = 1000 * nbytes / bw
    print(f"\nmemory-bandwidth bound of plain decoding ({args.threads} thread(s); read bandwidth = median of "
          f"{args.reps} sums of a {args.bandwidth_mb} MB {dtype_name} tensor)\n")
    print("| weights (MB) | read bandwidth (GB/s) | bound: ms per token | measured 1-token forward (ms) | measured / bound |")
    print("|---|---|---|---|---|")
    print(f"| {nbytes / 2 ** 20:.1f} | {bw / 1e9:.2f} | {bound_ms:.2f} | {1000 * cost[0]:.2f} | "
          f"{1000 * cost[0] / bound_ms:.2f} |")


if __name__ == "__main__":
    main()
