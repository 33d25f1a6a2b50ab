"""Train (if needed) and evaluate several drafter recipes on the same held-out prompts; print a table.

Usage:
    python scripts/compare_families.py                      # every recipes/smollm2-*.yaml except -large
    python scripts/compare_families.py recipes/smollm2-eagle3.yaml recipes/smollm2-medusa.yaml
    python scripts/compare_families.py --no-train           # only evaluate runs that exist
    python scripts/compare_families.py recipes/tiny-eagle3.yaml --set target.model=DIR --outputs /tmp/cmp  # tiny

For each recipe the run directory is ``outputs/<recipe name>`` (``--outputs DIR``: ``DIR/<recipe name>``;
``--set KEY=VALUE`` overrides are passed to every ``speculators train``); an existing ``final/`` is reused
(delete it or pass ``--retrain`` to train again), and so is an existing evaluation
``outputs/<recipe name>/compare-k<K>/report.json`` of that checkpoint (``--reeval`` measures again). A recipe whose ``train.init_from`` is another
recipe's run (``outputs/<name>/final``, e.g. joint MTP after frozen MTP) runs after it. Every recipe of
one target shares the held-out split (same sources, fraction and seed), so the rows are comparable.
The Markdown table (tau, per-position acceptance, drafting time per decoding step in ms: the
drafter's ``propose`` + ``advance`` wall time, measured by the eval at batch 1; tokens/s and speedup
over plain decoding, n-gram tau and tokens/s, training time, and for joint runs the target's held-out
perplexity before -> after) is printed and written to ``outputs/families.md`` (``--outputs``' ``families.md``). Joint runs verify
against their own fine-tuned target. A report from before the eval measured drafting time is measured
again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from speculators.evaluation.report import fmt

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> float:
    t0 = time.time()
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.time() - t0


def train_seconds(run_dir: Path) -> float | None:
    """Wall time of `speculators train` (data pipeline included) recorded by this script, if any."""
    meta = run_dir / "train_seconds.json"
    return json.loads(meta.read_text())["seconds"] if meta.is_file() else None


def ordered(recipes: list[Path]) -> list[Path]:
    """Stage-2 recipes (``train.init_from: outputs/<other>/final``) after the recipe they start from."""
    import yaml

    def parent(r: Path) -> str | None:
        init = ((yaml.safe_load(r.read_text()) or {}).get("train") or {}).get("init_from")
        return Path(init).parent.name if init else None

    names = {r.stem for r in recipes}
    return sorted(recipes, key=lambda r: (parent(r) in names, r.name))


def target_ppl(run_dir: Path) -> str:
    """``before -> after`` held-out perplexity of the target for joint runs (from train_log.jsonl), else -."""
    log = run_dir / "train_log.jsonl"
    if not log.is_file():
        return "-"
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    before = [r["held_out_before/ppl"] for r in rows if "held_out_before/ppl" in r]
    after = [r["held_out/ppl"] for r in rows if "held_out/ppl" in r]
    if not before or not after:
        return "-"
    return f"{before[0]:.3f} -> {after[-1]:.3f} ({100 * (after[-1] / before[0] - 1):+.1f}%)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", type=Path)
    ap.add_argument("--no-train", action="store_true", help="only evaluate existing runs")
    ap.add_argument("--retrain", action="store_true", help="train again even if final/ exists")
    ap.add_argument("--reeval", action="store_true", help="evaluate again even if a report exists")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--outputs", type=Path, default=ROOT / "outputs", help="where the runs and families.md go")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for every train (repeatable), e.g. target.model=DIR")
    args = ap.parse_args()
    recipes = ordered(args.recipes or [p for p in (ROOT / "recipes").glob("smollm2-*.yaml") if "large" not in p.name])
    outputs = args.outputs.resolve()
    cli = [sys.executable, "-m", "speculators.cli"]  # this interpreter's speculators (no console script needed)
    rows = []
    for recipe in recipes:
        run_dir = outputs / recipe.stem
        if args.retrain or not (run_dir / "final").is_dir():
            if args.no_train:
                print(f"skip {recipe}: no trained run in {run_dir}")
                continue
            secs = run([*cli, "train", str(recipe), *args.overrides, "--output-dir", str(run_dir), "--overwrite"])
            (run_dir / "train_seconds.json").write_text(json.dumps({"seconds": secs}))
        out = run_dir / f"compare-k{args.k}"
        fresh = (out / "report.json").is_file() and \
            (out / "report.json").stat().st_mtime > (run_dir / "final" / "model.safetensors").stat().st_mtime
        # a report from before the eval measured drafting time is measured again
        fresh = fresh and "draft_ms_per_step" in json.loads((out / "report.json").read_text()).get("drafter", {})
        if args.reeval or args.retrain or not fresh:
            # the table's columns are batch-1 numbers of the drafter and prompt lookup at this K
            run([*cli, "eval", str(run_dir), "-k", str(args.k), "--batch-size", "1", "--methods", "drafter,ngram",
                 "--output", str(out)])
        rep = json.loads((out / "report.json").read_text())
        rows.append((recipe.stem, rep, train_seconds(run_dir)))
    if not rows:
        print("nothing to compare")
        return 1
    k = args.k
    lines = ["| recipe | tau | acc. rate | " + " | ".join(f"acc_{i + 1}" for i in range(k)) +
             " | draft ms/step | tokens/s | speedup | n-gram tau | n-gram tokens/s | train time | target ppl |",
             "|---" * (k + 10) + "|"]
    for name, rep, secs in rows:
        d = rep["drafter"]
        ms = f"{d['draft_ms_per_step']:.2f}" if "draft_ms_per_step" in d else "-"  # defensive: older report format
        lines.append(f"| {name} | {d['tau']:.3f} | {fmt(d['acceptance_rate'], '.3f')} | " +
                     " | ".join(fmt(x, ".3f") for x in d["per_position"]) +
                     f" | {ms} | {fmt(d['tokens_per_s'], '.1f')} | {fmt(rep['speedup'], '.2f', 'x')} | "
                     f"{rep['ngram']['tau']:.3f} | {fmt(rep['ngram']['tokens_per_s'], '.1f')} | "
                     f"{'-' if secs is None else f'{secs / 60:.1f} min'} | {target_ppl(outputs / name)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / "families.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
