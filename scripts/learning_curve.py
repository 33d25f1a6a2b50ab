"""Train one recipe on several fractions of its training data and print held-out tau per size: what more data buys.

Usage:
    python scripts/learning_curve.py recipes/smollm2-eagle3.yaml                       # fractions 0.25, 0.5, 1
    python scripts/learning_curve.py recipes/smollm2-eagle3.yaml --fractions 0.1,0.3,1 --set train.steps=90
    python scripts/learning_curve.py recipes/tiny-eagle3.yaml --set target.model=DIR --outputs /tmp/lc   # tiny

Each size is ``speculators train RECIPE data.train_fraction=F`` (a seeded subset of the training conversations;
the held-out split stays the same, so every row is measured on the same prompts; the subsets are nested) into
``OUTPUTS/<recipe>-lc-<F>``, then ``speculators eval`` of that run (batch 1, the recipe's K, temperature and
held-out prompts, drafter only). A run with a ``final/`` and an eval report is reused (``--retrain`` trains
again). The recipe's training length applies to every size: with ``train.epochs`` a smaller size trains fewer
steps (each example is seen as often); ``--set train.steps=N`` fixes the steps instead. The Markdown table
(fraction, training examples and assistant tokens from the run's data report, held-out sim_tau at the end of
training, eval tau with its 95% CI, acceptance rate, training minutes) is printed and written to
``OUTPUTS/<recipe>-learning-curve.md``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _terminate(signum, frame):  # noqa: ARG001 - signal handler signature
    raise SystemExit(128 + signum)


def run(cmd: list[str]) -> float:
    """Run ``cmd`` from the repository root; seconds taken. A SIGTERM or Ctrl-C of this script stops the child
    too (SIGTERM first, SIGKILL after 30 s), so no training is left running.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.time()
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)
    return time.time() - t0


def fractions(text: str) -> list[float]:
    out = sorted({float(x) for x in text.split(",") if x.strip()})
    if not out or any(not 0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"--fractions {text!r}: comma-separated values in (0, 1]")
    return out


def data_totals(run_dir: Path) -> tuple[int | None, int | None]:
    """Training examples and assistant (loss) tokens of a run, from its data report (``data_report.json``)."""
    f = run_dir / "data_report.json"
    if not f.is_file():
        return None, None
    rep = json.loads(f.read_text())
    return (sum(int(r.get("train_examples", 0)) for r in rep.values()),
            sum(int(r.get("train_loss_tokens", 0)) for r in rep.values()))


def last_held_out(run_dir: Path, key: str = "held_out/sim_tau") -> float | None:
    rows = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()] \
        if (run_dir / "train_log.jsonl").is_file() else []
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else None


def eval_cells(rep: dict) -> tuple[str, str]:
    """``("tau [lo, hi]", "acceptance rate")`` of an eval report's drafter (``n/a`` for a rate with no draft)."""
    d = rep["drafter"]
    lo, hi = d.get("tau_ci") or (None, None)
    rate = d.get("acceptance_rate")
    return (f"{d['tau']:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""),
            "n/a" if rate is None else f"{rate:.3f}")


def train_and_eval(train_args: list[str], run_dir: Path, report_dir: str, retrain: bool) -> tuple[dict, float | None]:
    """``speculators train <train_args> --output-dir RUN_DIR`` then ``speculators eval RUN_DIR`` (batch 1, drafter
    only) into ``RUN_DIR/REPORT_DIR``, unless the run has a ``final/`` and that report (``retrain`` forces both).
    Returns the eval report and the training seconds (None when the run was reused without a time on record)."""
    cli = [sys.executable, "-m", "speculators.cli"]
    report = run_dir / report_dir / "report.json"
    secs_file = run_dir / "train_seconds.json"
    if retrain or not (run_dir / "final").is_dir() or not report.is_file():
        secs = run([*cli, "train", *train_args, "--output-dir", str(run_dir), "--overwrite"])
        secs_file.write_text(json.dumps({"seconds": secs}))
        run([*cli, "eval", str(run_dir), "--batch-size", "1", "--methods", "drafter", "--output", str(report.parent)])
    secs = json.loads(secs_file.read_text())["seconds"] if secs_file.is_file() else None
    return json.loads(report.read_text()), secs


def fmt(x: float | None, spec: str = ".3f", unit: str = "") -> str:
    """A table cell: ``-`` for a value not on record."""
    return "-" if x is None else f"{x:{spec}}{unit}"


def write_table(lines: list[str], path: Path) -> None:
    """Print the Markdown table and write it to ``path``."""
    table = "\n".join(lines) + "\n"
    print(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--fractions", type=fractions, default=[0.25, 0.5, 1.0], help="comma-separated, in (0, 1]")
    ap.add_argument("--outputs", type=Path, default=ROOT / "outputs", help="where the runs and the table go")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for every train (repeatable), e.g. train.steps=90")
    ap.add_argument("--retrain", action="store_true", help="train and evaluate again even if a run exists")
    args = ap.parse_args()
    outputs = args.outputs.resolve()
    rows = []
    for f in args.fractions:
        run_dir = outputs / f"{args.recipe.stem}-lc-{f:g}"
        rep, secs = train_and_eval([str(args.recipe), f"data.train_fraction={f}", *args.overrides], run_dir,
                                   "eval-lc", args.retrain)
        rows.append((f, *data_totals(run_dir), last_held_out(run_dir), rep, secs))
    k = rows[0][4]["k"]
    lines = [f"| fraction | train examples | assistant tokens | held-out sim_tau | tau (K={k}) [95% CI] | "
             "acc. rate | train time |", "|---|---|---|---|---|---|---|"]
    for f, examples, tokens, sim, rep, secs in rows:
        tau, rate = eval_cells(rep)
        lines.append(f"| {f:g} | {fmt(examples, 'd')} | {fmt(tokens, 'd')} | {fmt(sim)} | {tau} | {rate} | "
                     f"{fmt(None if secs is None else secs / 60, '.1f', ' min')} |")
    write_table(lines, outputs / f"{args.recipe.stem}-learning-curve.md")
    return 0

if __name__ == "__main__":
    sys.exit(main())
