"""The eval report's two PNG plots (:func:`write_plots`), drawn from an :class:`speculators.evaluation.report.EvalReport`
with matplotlib's Agg canvas. Like :mod:`speculators.evaluation.report`, it reads the report as data and imports nothing
else of the package.
"""

from __future__ import annotations

from pathlib import Path

from .report import METHOD_LABELS, PLOT_FILES, EvalReport, _rows


def _nan(xs: list) -> list[float]:
    """Plotted values: ``n/a`` (None) as NaN, which matplotlib leaves out."""
    return [float("nan") if x is None else x for x in xs]


def write_plots(report: EvalReport, directory: str | Path) -> dict[str, str]:
    """Draw the report's plots as PNGs into ``directory`` (matplotlib's Agg canvas; pyplot's global
    state is not touched).

    * ``per_position_acceptance.png``: acc_k per position, one bar group per position and one bar per
      method (batch size 1, the largest K);
    * ``tau_vs_k.png``: tau (with its 95% CI as error bars, batch size 1) and speedup (every batch size)
      against K, one line per method.

    Returns:
        ``{"per_position": file name, "tau_vs_k": file name}`` relative to ``directory``.
    """
    from matplotlib.figure import Figure

    directory = Path(directory)
    methods, ks = report["methods"], report["ks"]
    kmax, b1 = max(ks), report["batch_sizes"][0]
    fig = Figure(figsize=(max(5.0, 1.1 * kmax + 2), 3.6), dpi=110)
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        r = _rows(report, m, b1, kmax)[0]
        ax.bar([i + 1 + (j - (len(methods) - 1) / 2) * width for i in range(kmax)], _nan(r["per_position"]), width,
               label=METHOD_LABELS[m])
    ax.set_xticks(range(1, kmax + 1))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acc_k = P(draft k accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"per-position acceptance (K={kmax}, batch {b1}, T={report['temperature']:g})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(directory / PLOT_FILES["per_position"])

    fig = Figure(figsize=(9.0, 3.6), dpi=110)
    ax_tau, ax_sp = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    styles = ["-", "--", ":", "-."]
    for j, m in enumerate(methods):
        rows = sorted(_rows(report, m, b1), key=lambda r: r["k"])
        taus = [r["tau"] for r in rows]
        err = [[r["tau"] - r["tau_ci"][0] for r in rows], [r["tau_ci"][1] - r["tau"] for r in rows]]
        ax_tau.errorbar([r["k"] for r in rows], taus, yerr=err, marker="o", capsize=3, label=METHOD_LABELS[m])
        for bi, b in enumerate(report["batch_sizes"]):
            rb = sorted(_rows(report, m, b), key=lambda r: r["k"])
            ax_sp.plot([r["k"] for r in rb], _nan([r["speedup"] for r in rb]), marker="o", color=f"C{j}",
                       linestyle=styles[bi % len(styles)], label=f"{m}, batch {b}")
    ax_tau.set_xlabel("K (drafts per step)")
    ax_tau.set_ylabel("tau (tokens per step, 95% CI)")
    ax_tau.set_title(f"tau vs K (batch {b1})")
    ax_tau.legend(fontsize="small")
    ax_sp.axhline(1.0, color="grey", linewidth=0.8)
    ax_sp.set_xlabel("K (drafts per step)")
    ax_sp.set_ylabel("speedup vs plain (same batch)")
    ax_sp.set_title("speedup vs K")
    ax_sp.legend(fontsize="x-small")
    for a in (ax_tau, ax_sp):
        a.set_xticks(ks)
    fig.tight_layout()
    fig.savefig(directory / PLOT_FILES["tau_vs_k"])
    return dict(PLOT_FILES)
