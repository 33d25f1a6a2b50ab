"""Draw the plots of docs/results/index.md from the numbers transcribed in docs/results/headline.json.

Three PNGs (matplotlib, Agg): ``tau_per_family.png`` (tau per family with its 95% CI where the table has one),
``learning_curve.png`` (EAGLE-3 tau against assistant tokens of training data) and ``engine_speedups.png`` (the
demo drafter's speedup over plain decoding per K inside vLLM and llama.cpp). Every number comes from the JSON,
whose entries name the results table they were copied from; nothing is measured here.

    python scripts/results_plots.py                      # writes docs/img/{tau_per_family,learning_curve,engine_speedups}.png
    python scripts/results_plots.py --out DIR --data FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "headline.json"
OUT = ROOT / "docs" / "img"
NAMES = ("tau_per_family.png", "learning_curve.png", "engine_speedups.png")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})  # no version stamp: the PNG changes only with its numbers


def plot_all(data: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in NAMES]

    rows = data["tau_per_family"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        colour = "grey" if "prompt lookup" in r["family"] else "tab:blue"
        if r["ci"]:
            ax.errorbar(r["tau"], y, xerr=[[r["tau"] - r["ci"][0]], [r["ci"][1] - r["tau"]]], fmt="o", color=colour,
                        capsize=3)
        else:
            ax.plot(r["tau"], y, "o", color=colour, mfc="white")
    ax.set_yticks(ys, [f"{r['family']} (K={r['k']})" for r in rows])
    ax.axvline(1.0, color="black", lw=0.5)
    ax.set_xlabel("tau, 95% CI (open circle: no CI recorded)")
    ax.set_title("tau per family, demo's held-out prompts")
    _save(fig, paths[0])
    plt.close(fig)

    lc = data["learning_curve"]["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [r["assistant_tokens"] / 1000 for r in lc]
    ax.errorbar(x, [r["tau"] for r in lc], yerr=[[r["tau"] - r["ci"][0] for r in lc], [r["ci"][1] - r["tau"] for r in lc]],
                fmt="o-", capsize=3)
    ax.set_xlabel("assistant tokens of training data (thousands)")
    ax.set_ylabel("tau at K = 4, 95% CI")
    ax.set_title("EAGLE-3 learning curve (demo recipe)")
    _save(fig, paths[1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for s in data["engine_speedups"]["series"]:
        ax.plot(s["k"], s["speedup"], "o-", label=s["name"])
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("num_speculative_tokens (K)")
    ax.set_ylabel("tokens/s over plain decoding")
    ax.set_xticks([1, 2, 3, 4])
    ax.legend(fontsize=8)
    ax.set_title("the demo drafter inside the engines (1 request)")
    _save(fig, paths[2])
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA, help="the JSON of transcribed numbers")
    ap.add_argument("--out", type=Path, default=OUT, help="where the PNGs go (default: docs/img)")
    args = ap.parse_args(argv)
    for p in plot_all(json.loads(args.data.read_text()), args.out):
        print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
