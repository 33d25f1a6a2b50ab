#!/usr/bin/env python
"""Drafting time per decoding step of trained drafters, side by side, without the target.

One decoding step's drafter work is ``advance`` (append the ``--accepted`` + 1 verified tokens and their
target features) followed by ``propose`` (K drafts). Each checkpoint starts from the same random context
of ``--context`` positions (random token ids and random aux features of the checkpoint's shape: only the
shapes matter for the time), then the step is timed ``--repeats`` times on copies of that state; the
table gives the median milliseconds of advance, propose and both, and the ratio of each row's total to
the first row's. Batch 1 (one request), greedy, in one process, rows interleaved per repeat so that a
busy machine slows every row alike.

This is what ``speculators eval`` reports as ``draft ms/step`` (there it is averaged over real steps
with the real accepted counts), isolated from the verify forwards.

    python scripts/bench_step_drafting.py outputs/smollm2-eagle3 outputs/smollm2-peagle -k 4
    python scripts/bench_step_drafting.py RUN_A RUN_B --threads 1 --context 400 --accepted 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators.drafters import Drafter  # noqa: E402
from speculators.workflows import resolve_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", help="run directories (final/) or checkpoints")
    ap.add_argument("-k", type=int, default=4, help="drafts per step (K)")
    ap.add_argument("--context", type=int, default=300, help="positions already in the drafter's cache")
    ap.add_argument("--accepted", type=int, default=1, help="accepted drafts per step (advance appends this + 1)")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (CUDA timings synchronize the device)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for c in args.checkpoints:
        d = Drafter.from_pretrained(resolve_checkpoint(c, log=lambda m: None)).eval().to(dev)
        width = d.meta.hidden_size * len(d.meta.aux_layer_ids)
        V = d.meta.vocab_size
        ctx_ids = torch.randint(0, V, (args.context + 1,), generator=gen).to(dev)
        new_ids = torch.randint(0, V, (args.accepted + 1,), generator=gen).to(dev)
        with torch.no_grad():
            state = d.start(ctx_ids, SimpleNamespace(aux=torch.randn(1, args.context, width, generator=gen).to(dev)))
        feats = SimpleNamespace(aux=torch.randn(1, args.accepted + 1, width, generator=gen).to(dev))
        rows.append({"name": c, "drafter": d, "state": state, "ids": new_ids, "feats": feats, "adv": [], "prop": []})
    for _ in range(args.repeats):
        for r in rows:
            s = copy.deepcopy(r["state"])
            with torch.no_grad():
                sync()
                t0 = time.perf_counter()
                r["drafter"].advance([s], [r["ids"]], [r["feats"]])
                sync()
                t1 = time.perf_counter()
                r["drafter"].propose([s], [args.k])
                sync()
                t2 = time.perf_counter()
            r["adv"].append(t1 - t0)
            r["prop"].append(t2 - t1)
    print(f"K={args.k}, context {args.context}, {args.accepted + 1} tokens appended per step, batch 1, "
          f"{args.device}, {args.threads} CPU thread(s), median of {args.repeats}")
    print("| checkpoint | family | layers | advance ms | propose ms | step ms | vs first |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for r in rows:
        a, p = 1000 * statistics.median(r["adv"]), 1000 * statistics.median(r["prop"])
        tot = 1000 * statistics.median([x + y for x, y in zip(r["adv"], r["prop"])])
        base = tot if base is None else base
        layers = len(getattr(r["drafter"], "layers", [])) or "-"
        print(f"| {r['name']} | {r['drafter'].algorithm} | {layers} | {a:.2f} | {p:.2f} | {tot:.2f} | {tot / base:.2f}x |")


if __name__ == "__main__":
    main()
