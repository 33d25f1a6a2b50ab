"""The calibration report (:mod:`speculators.calibration`): ``calibration.md`` / ``calibration.json``,
the reliability diagram ``reliability.png`` and the raw outcomes, written as one directory
(:func:`speculators.utils.atomic_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..utils import atomic_dir
from .fit import METHOD_PLATT, METHOD_STS
from .record import OUTCOMES_FILE, ConfidenceRecord

PLOT_FILE = "reliability.png"


def holds_calibration(report: dict) -> bool:
    """Whether the checkpoint held a calibration at the measured positions before this one: its first
    ``k`` temperatures differ from 1 or its shifts from 0 (the raw head)."""
    k = report["k"]
    ts, bs = report.get("temperatures_before") or [], report.get("biases_before") or []
    return any(abs(float(t) - 1.0) > 1e-6 for t in ts[:k]) or any(abs(float(b)) > 1e-6 for b in bs[:k])


def _summaries(report: dict) -> list[tuple[str, dict]]:
    """``[(label, calibration_summary)]`` of a :func:`calibrate_drafter` report, in the order the Markdown
    table and the reliability diagram show them: before / after, with the raw head (every T = 1, b = 0)
    first when the checkpoint already held a calibration at the measured positions."""
    rows = [("before", report["before"]), ("after", report["after"])]
    if holds_calibration(report) and report.get("uncalibrated"):
        rows = [("uncalibrated (every T = 1, b = 0)", report["uncalibrated"]),
                ("before (the checkpoint's calibration)", report["before"]), ("after", report["after"])]
    return rows


def reliability_plot(report: dict, file: str | Path) -> Path:
    """Draw the reliability diagram of a :func:`calibrate_drafter` report: per equal-mass bin, observed
    survival frequency against mean predicted survival, before and after calibration (and of the raw head,
    every T = 1 and b = 0, when the checkpoint already held a calibration), with the diagonal (matplotlib's Agg
    canvas; pyplot's global state is not touched)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.8, 4.4), dpi=110)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--", label="perfect calibration")
    rows = _summaries(report)
    for (key, r), marker in zip(rows, ("^", "o", "s")[3 - len(rows):]):
        ax.plot([b["mean_pred"] for b in r["reliability"]], [b["frac_pos"] for b in r["reliability"]],
                marker=marker, label=f"{key} (ECE {r['ece']:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted survival prod c_i (bin mean)")
    ax.set_ylabel("observed: drafts 1..k all accepted")
    ax.set_title(f"reliability ({report['binning'].split(',')[0]} bins, K={report['k']})", fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(file))
    return Path(file)


def _fmt_ece(position: dict) -> str:
    """A per-position ECE cell ("-" for reports written before per-position ECE existed)."""
    return f"{position['ece']:.4f}" if "ece" in position else "-"


def _fmt_floor(summary: dict) -> str:
    """An ECE noise-floor cell, ``mean [5%, 95%]`` ("-" for reports written before the floor existed)."""
    f = summary.get("ece_floor")
    return f"{f['mean']:.4f} [{f['lo']:.4f}, {f['hi']:.4f}]" if f else "-"


def _bootstrap_lines(boot: dict | None) -> list[str]:
    """The report's prompt-bootstrap paragraph (:func:`ece_prompt_bootstrap`); none without one."""
    if not boot:
        return []
    e, r = boot["ece"], boot["ratio"]
    names = {"uncalibrated": "raw", "before": "checkpoint's calibration", "after": "fitted"}
    cells = [f"{names.get(n, n)} {v['point']:.4f} [{v['lo']:.4f}, {v['hi']:.4f}]" for n, v in e.items()]
    ref = names.get(boot["reference"], boot["reference"])
    ratios = [f"{names.get(n, n)} / {ref} {v['point']:.2f}x [{v['lo']:.2f}, {v['hi']:.2f}]" for n, v in r.items()]
    return [f"Sampling uncertainty over prompts (the {boot['prompts']} measuring prompts resampled whole, "
            f"{boot['resamples']} times; 95% intervals): ECE {'; '.join(cells)}; ratio {'; '.join(ratios)}.", ""]


def calibration_markdown(report: dict, plot: str | None = PLOT_FILE) -> str:
    """The report of :func:`calibrate_drafter` as Markdown (temperatures and shifts, ECE / NLL / Brier before
    and after, and of the raw head (every T = 1, b = 0) when the checkpoint already held a calibration;
    per-position survival and ECE; the reliability diagram linked as ``plot``)."""
    k = report["k"]
    before, after = report["before"], report["after"]
    tb = report["temperatures_before"] or [1.0] * k
    bb = report.get("biases_before") or [0.0] * len(tb)
    ba = report.get("biases_after") or [0.0] * len(report["temperatures_after"])
    platt = report.get("method", METHOD_STS) == METHOD_PLATT
    ece_rows = _summaries(report)  # "before" is the checkpoint's calibration: the raw head too when they differ
    recalibration = len(ece_rows) == 3
    lines = [f"# Confidence calibration{': ' + report['checkpoint'] if report.get('checkpoint') else ''}", "",
             f"{report['num_prompts']} prompts ({report['fit_prompts']} fit the calibration, {report['ece_prompts']} "
             f"measure ECE: {report['split']}), K={k}, max_new_tokens {report['max_new_tokens']}, sampling "
             f"{report['sampling']}; {report['steps_fit']} / {report['steps_eval']} verification steps.", "",
             ("Survival S_k = prod_{i<=k} sigmoid(z_i / T_i + b_i) predicts that drafts 1..k are all accepted. "
              "T and b are fitted left to right (Platt scaling per position), each (T_k, b_k) "
              if platt else
              "Survival S_k = prod_{i<=k} sigmoid(z_i / T_i) predicts that drafts 1..k are all accepted. T is fitted "
              "left to right (STS), each T_k ")
             + "by maximum likelihood on the steps that accepted drafts 1..k-1; ECE uses " + report["binning"] + ".", "",
             "| | ECE | ECE of a perfectly calibrated head with these predictions | NLL | Brier |",
             "|---|---|---|---|---|",
             *(f"| {name} | {r['ece']:.4f} | {_fmt_floor(r)} | {r['nll']:.4f} | {r['brier']:.4f} |"
               for name, r in ece_rows), "",
             "The third column is each ECE's resolution: the ECE of outcomes redrawn from the predictions "
             "themselves (200 draws, mean [5%, 95%]). An ECE inside it is what a perfectly calibrated head "
             "would score: no evidence of miscalibration. Steps of one prompt are correlated, so the true "
             "noise is larger still.", "",
             *_bootstrap_lines(report.get("bootstrap")),
             f"In-sample (fit prompts) ECE: {report['in_sample']['before']:.4f} -> {report['in_sample']['after']:.4f}"
             + (f" (uncalibrated: {report['in_sample']['uncalibrated']:.4f})."
                if recalibration and "uncalibrated" in report["in_sample"] else "."),
             "", "| position k | T before | T after | b before | b after | pairs | mean S_k before | mean S_k after "
             "| observed | ECE_k before | ECE_k after | ECE_k perfectly calibrated (after) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pb = {p["k"]: p for p in before["per_position"]}
    for p in after["per_position"]:
        i = p["k"]
        lines.append(f"| {i} | {tb[i - 1]:.3f} | {report['temperatures_after'][i - 1]:.3f} | {bb[i - 1]:+.3f} | "
                     f"{ba[i - 1]:+.3f} | {p['pairs']} | {pb[i]['mean_survival_pred']:.3f} | "
                     f"{p['mean_survival_pred']:.3f} | {p['survival_rate']:.3f} | {_fmt_ece(pb[i])} | {_fmt_ece(p)} | {_fmt_floor(p)} |")
    if report.get("threshold_sweep"):
        rec_t = report.get("recommended_threshold")
        which = ("fitted calibration" if report.get("sweep_temperatures", "fitted") == "fitted"
                 else "the checkpoint's calibration (not replaced)")
        lines += ["", f"Confidence gating simulated on the ECE prompts' ungated steps ({which}; tokens per step "
                  "1 + min(accepted, kept) per recorded step, an estimate of the gated run's tau):", "",
                  "| threshold | verified drafts / step | cut | tau (est.) | tau ratio |", "|---|---|---|---|---|"]
        for r in report["threshold_sweep"]:
            mark = " (chosen)" if rec_t and r["threshold"] == rec_t["threshold"] else ""
            lines.append(f"| {r['threshold']:g}{mark} | {r['verified_per_step']:.2f} | {100 * r['verified_cut']:.0f}% | "
                         f"{r['tau_est']:.3f} | {r['tau_ratio']:.3f} |")
        lines += ["", (f"Chosen threshold (most verified drafts cut with tau ratio >= {report.get('min_tau_ratio', 0.97)}): "
                       f"{rec_t['threshold']:g}" if rec_t else "No threshold keeps the tau ratio; gating not recommended.")]
    if plot:
        lines += ["", f"![reliability diagram]({plot})"]
    if report.get("stored") is not None:
        lines += ["", f"Calibration stored in the checkpoint: {'yes' if report['stored'] else 'no'}"
                  + (f" ({report['not_stored']})." if report.get("not_stored") else ".")]
    return "\n".join(lines) + "\n"


def write_calibration_report(report: dict, output: str | Path,
                             records: dict[str, ConfidenceRecord] | None = None) -> Path:
    """Write ``calibration.json``, ``calibration.md`` and ``reliability.png`` into ``output`` (atomically
    replaced, :func:`speculators.utils.atomic_dir`), and with ``records`` (name -> record, e.g. ``{"fit":
    ..., "eval": ...}`` of a :class:`CalibrationResult`) the raw outcomes ``outcomes.safetensors``
    (:meth:`ConfidenceRecord.save_many`: a calibration can be refitted or re-measured without decoding again).
    Sets ``report["plot"]``."""
    with atomic_dir(output, overwrite=True) as tmp:
        reliability_plot(report, tmp / PLOT_FILE)
        report["plot"] = PLOT_FILE
        if records:
            ConfidenceRecord.save_many(records, tmp / OUTCOMES_FILE)
            report["outcomes"] = OUTCOMES_FILE
        (tmp / "calibration.json").write_text(json.dumps(report, indent=2))
        (tmp / "calibration.md").write_text(calibration_markdown(report, PLOT_FILE))
    return Path(output)
