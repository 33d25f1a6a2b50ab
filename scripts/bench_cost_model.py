#!/usr/bin/env python
"""How well the eval's cost model predicts tokens/s: predicted vs measured per row, and where the time goes.

Runs :func:`speculators.evaluation.runner.run_eval` with the model-free proposers (n-gram, suffix: no trained
drafter needed) on a target and prints two tables:

1. the break-even table every eval report has (``report["cost_model"]``, :mod:`speculators.evaluation.cost_model`):
   per method, K and batch size the predicted and measured tokens/s, the relative error, the predicted
   speedup, the best K' and the break-even batch size;
2. the step's parts, predicted against measured in the same pass (ms per batched step): E[tokens per
   step] against tau, the target forward (measured apart by ``measure_verify_cost`` against the loop's
   own forwards), drafting, rejection sampling and the rest; where a row's error comes from.

A drafter checkpoint is measured the same way by ``speculators eval CHECKPOINT`` (its report has the same
table). Nothing else should run on the machine; timing only, nothing is written.

    python scripts/bench_cost_model.py                                    # SmolLM2-135M, bf16, K 2,4, batch 1 and 4
    python scripts/bench_cost_model.py --dtype float32 --k 1,2,4,8 --batch-size 8 --temperature 0.7
"""

from __future__ import annotations

import argparse
import time

import torch


def parts_table(report: dict) -> list[str]:
    """Markdown rows: per measured row, the predicted step parts beside the pass's own measurements."""
    cm = report["cost_model"]
    rows = {(r["method"], r["k"], r["batch_size"]): r for r in report["rows"]}
    lines = ["| method | batch | K | E[tokens/step] | tau | forward ms (pred / in loop) | draft ms | sampling ms | "
             "overhead ms | prefill s (pred / pass) | cache width charged | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(x):
        return "n/a" if x is None else f"{x:.2f}"

    def width(p):  # absent (or None) on a report from before widths were recorded
        return "n/a" if p.get("cache_width") is None else f"{p['cache_width']:.0f}"

    for p in cm["predictions"]:
        r = rows.get((p["method"], p["k"], p["batch_size"]))
        if r is None:
            continue
        loop_fwd = p["loop_forward_ms_per_step"]
        err = "n/a" if p["relative_error"] is None else f"{100 * p['relative_error']:+.1f}%"
        lines.append(f"| {p['method']} | {p['batch_size']} | {p['k']} | {ms(p['expected_tokens_per_step'])} | "
                     f"{r['tau']:.2f} | {ms(p['forward_ms_per_step'])} / {ms(loop_fwd)} | {ms(p['draft_ms_per_step'])} | "
                     f"{ms(p['sampling_ms_per_step'])} | {ms(p['overhead_ms_per_step'])} | "
                     f"{p['prefill_seconds']:.2f} / {r['prefill_seconds']:.2f} | {width(p)} | {err} |")
    for p, r in zip(cm["plain"], report["plain_rows"]):
        loop_fwd = p["loop_forward_ms_per_step"]
        err = "n/a" if p["relative_error"] is None else f"{100 * p['relative_error']:+.1f}%"
        lines.append(f"| plain | {p['batch_size']} | 0 | 1.00 | 1.00 | {ms(p['forward_ms_per_step'])} / {ms(loop_fwd)} | "
                     f"0.00 | {ms(p['sampling_ms_per_step'])} | {ms(p['overhead_ms_per_step'])} | - | {width(p)} | {err} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target (a name, path or Hub id)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", default="2,4", help="comma-separated K sweep")
    ap.add_argument("--batch-size", type=int, default=4, help="the loaded batch size (batch 1 always runs)")
    ap.add_argument("--prompts", default="humaneval", help="a data source (speculators eval --prompts)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from speculators.data.pipeline import unique_prompts
    from speculators.data.sources import load_source
    from speculators.evaluation.report import BREAK_EVEN_COLUMNS, break_even_rows
    from speculators.evaluation.runner import run_eval
    from speculators.evaluation.settings import EvalSettings
    from speculators.target import Target
    from speculators.verify import SamplingParams

    target = Target.load(args.model, dtype=args.dtype)
    prompts = unique_prompts(list(load_source(args.prompts)), target.tokenizer, None, limit=args.num_prompts)
    t0 = time.perf_counter()
    rep = run_eval(target, None, prompts, EvalSettings([int(k) for k in args.k.split(",")], args.max_new_tokens, sampling=SamplingParams.uniform(1, args.temperature), batch_size=args.batch_size, methods=("ngram", "suffix")), log=lambda m: None)
    cm = rep["cost_model"]
    dtype = str(target.dtype).removeprefix("torch.")  # ``auto`` resolved by Target.load
    print(f"\n{target.name_or_path}, {dtype} on {target.device}, {torch.get_num_threads()} thread(s), "
          f"{len(prompts)} prompts ({args.prompts}), max_new_tokens {args.max_new_tokens}, temperature "
          f"{args.temperature}; eval took {time.perf_counter() - t0:.0f} s\n")
    print("| " + " | ".join(BREAK_EVEN_COLUMNS) + " |")
    print("|---" * len(BREAK_EVEN_COLUMNS) + "|")
    for row in break_even_rows(rep):
        print("| " + " | ".join(row) + " |")
    worst = cm["max_abs_relative_error"]
    print(f"\nlargest |error|: {'n/a' if worst is None else f'{100 * worst:.1f}%'}; "
          + "; ".join(f"{m}: {be['note']}" for m, be in cm["break_even"].items()))
    print("\nstep parts, predicted (mean per batched step over the predicted schedule) against the pass\n")
    for line in parts_table(rep):
        print(line)


if __name__ == "__main__":
    main()
