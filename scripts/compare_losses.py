"""Train one recipe under several losses / optimizers (same data, steps and seed) and print held-out tau per variant.

Usage:
    python scripts/compare_losses.py recipes/smollm2-eagle3.yaml            # the default variants below
    python scripts/compare_losses.py recipes/smollm2-eagle3.yaml --variant tv=train.loss=tv \\
        --variant muon=train.optimizer=muon
    python scripts/compare_losses.py recipes/smollm2-dflash.yaml --variant dpace= \\
        --variant exp_decay=drafter.position_weights=exp_decay
    python scripts/compare_losses.py recipes/tiny-eagle3.yaml --set target.model=DIR --outputs /tmp/cl   # tiny

A variant is ``NAME=OVERRIDE[,OVERRIDE...]`` (recipe overrides by dotted path; ``NAME=`` is the recipe as written).
Default variants: ``forward_kl`` (the recipe), ``reverse_kl``, ``jsd``, ``tv``, ``nla``, ``lk_hybrid``, ``ce`` (as
``train.loss``) and ``muon`` (``train.optimizer=muon``). Each is ``speculators train`` into
``OUTPUTS/<recipe>-<NAME>`` then ``speculators eval`` of it (batch 1, drafter only, the recipe's K, temperature and
held-out prompts); a run with a ``final/`` and an eval report is reused (``--retrain`` trains again). The
Markdown table (variant, held-out loss-free metrics at the end of training: sim_tau and full_acc_0, eval tau with
its 95% CI, acceptance rate, training minutes) is printed and written to ``OUTPUTS/<recipe>-losses.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from learning_curve import ROOT, eval_cells, fmt, last_held_out, train_and_eval, write_table

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tv", "nla", "lk_hybrid", "ce")
DEFAULT_VARIANTS = [f"{n}=" if n == "forward_kl" else f"{n}=train.loss={n}" for n in LOSSES] + \
    ["muon=train.optimizer=muon"]


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME=OVERRIDE[,OVERRIDE...] (NAME= for the recipe)")
    return name, [o for o in rest.split(",") if o]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--variant", dest="variants", action="append", type=variant, default=None)
    ap.add_argument("--outputs", type=Path, default=ROOT / "outputs", help="where the runs and the table go")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for every variant (repeatable)")
    ap.add_argument("--retrain", action="store_true", help="train and evaluate again even if a run exists")
    args = ap.parse_args()
    variants = args.variants or [variant(v) for v in DEFAULT_VARIANTS]
    outputs = args.outputs.resolve()
    rows = []
    for name, overrides in variants:
        run_dir = outputs / f"{args.recipe.stem}-{name}"
        rep, secs = train_and_eval([str(args.recipe), *overrides, *args.overrides], run_dir, "eval-losses",
                                   args.retrain)
        rows.append((name, " ".join(overrides) or "(recipe)", last_held_out(run_dir),
                     last_held_out(run_dir, "held_out/full_acc_0"), rep, secs))
    lines = [f"| variant | overrides | held-out sim_tau | held-out full_acc_0 | tau (K={rows[0][4]['k']}) [95% CI] | "
             "acc. rate | train time |", "|---|---|---|---|---|---|---|"]
    for name, over, sim, acc0, rep, secs in rows:
        tau, rate = eval_cells(rep)
        lines.append(f"| {name} | `{over}` | {fmt(sim)} | {fmt(acc0)} | {tau} | {rate} | "
                     f"{fmt(None if secs is None else secs / 60, '.1f', ' min')} |")
    write_table(lines, outputs / f"{args.recipe.stem}-losses.md")
    return 0

if __name__ == "__main__":
    sys.exit(main())
