#!/usr/bin/env python
"""Compare confidence calibrators on the outcomes a ``speculators calibrate`` run recorded, without
decoding again.

``speculators calibrate`` writes ``outcomes.safetensors`` next to its report: per verification step
the drafter's raw confidence logits, how many drafts were verified and how many accepted, for the
prompts that fitted the calibration (``fit``) and those that measured it (``eval``). This script fits
on ``fit`` and measures on ``eval`` (or in-sample when the run had one side only):

* raw: the head as trained (every T = 1, b = 0);
* STS: a temperature per position (``--temperature-only``; ALGORITHMS.md);
* Platt: a temperature and a shift per position (the default of ``speculators calibrate``);

and prints one table: the survival ECE pooled over positions and per position (equal-mass bins), the
ECE a perfectly calibrated head with the same predictions would score (mean [5%, 95%] over outcomes
redrawn from the predictions: the resolution of the ECE on this many steps), the NLL, the mean predicted and observed survival per position, and each calibrator's ECE as a ratio to
the raw head's; with the prompt indices that newer outcome files keep, also each ECE and ratio with a
95% interval from resampling whole prompts (steps of one prompt are correlated).

    python scripts/refit_calibration.py outputs/smollm2-dspark/calibration/outcomes.safetensors
    python scripts/refit_calibration.py OUTCOMES --positions 4 --bins 10

Reads only; nothing is written.
"""

from __future__ import annotations

import argparse

from speculators.calibration import (DEFAULT_BINS, ConfidenceRecord, calibration_summary, ece_prompt_bootstrap,
                                     fit_calibration)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outcomes", help="outcomes.safetensors written by `speculators calibrate`")
    ap.add_argument("--positions", type=int, default=3, help="per-position columns to show (default 3)")
    ap.add_argument("--bins", type=int, default=DEFAULT_BINS, help="equal-mass bins of the ECE")
    args = ap.parse_args()

    records = ConfidenceRecord.load_many(args.outcomes)
    if "fit" not in records:
        raise SystemExit(f"{args.outcomes}: no 'fit' record (records: {sorted(records)}); expected the "
                         "outcomes.safetensors that `speculators calibrate` writes")
    fit = records["fit"]
    ev = records.get("eval", fit)
    where = "held-out prompts (fitted on the others)" if "eval" in records else "in-sample (one side only)"
    print(f"{len(fit)} fitting steps, {len(ev)} measuring steps, K = {fit.k}; ECE on {where}, "
          f"{args.bins} equal-mass bins\n")
    t_sts, _ = fit_calibration(fit, fit_bias=False)
    t_platt, b_platt = fit_calibration(fit)
    rows = [("raw (T = 1, b = 0)", None, None), ("STS (T per position)", t_sts, None),
            ("Platt (T and b per position)", t_platt, b_platt)]
    P = min(args.positions, ev.k)
    head = ["calibrator", "ECE pooled", "x raw", "perfect head's ECE", "NLL"] + [f"ECE_{k}" for k in range(1, P + 1)] \
        + [f"S_{k} pred/obs" for k in range(1, P + 1)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    raw_ece = None
    for name, T, b in rows:
        s = calibration_summary(ev, T, args.bins, bias=b)
        raw_ece = s["ece"] if raw_ece is None else raw_ece
        per = {p["k"]: p for p in s["per_position"]}
        fl = s["ece_floor"]
        cells = [name, f"{s['ece']:.4f}", f"{s['ece'] / raw_ece:.2f}" if raw_ece else "-",
                 f"{fl['mean']:.4f} [{fl['lo']:.4f}, {fl['hi']:.4f}]", f"{s['nll']:.4f}"]
        cells += [f"{per[k]['ece']:.4f}" if k in per else "-" for k in range(1, P + 1)]
        cells += [f"{per[k]['mean_survival_pred']:.3f}/{per[k]['survival_rate']:.3f}" if k in per else "-"
                  for k in range(1, P + 1)]
        print("| " + " | ".join(cells) + " |")
    fmt = lambda v: ", ".join(f"{x:.3f}" for x in v[:P].tolist())  # noqa: E731
    print(f"\nSTS T = [{fmt(t_sts)}]; Platt T = [{fmt(t_platt)}], b = [{fmt(b_platt)}] (first {P} positions)")
    boot = ece_prompt_bootstrap(ev, {name: (T, b) for name, T, b in rows}, rows[0][0], args.bins)
    if boot is None:
        print("\nNo prompt indices in these outcomes (written before they were kept): no prompt bootstrap.")
        return
    print(f"\nPrompt bootstrap ({boot['prompts']} prompts resampled whole, {boot['resamples']} times, 95%):")
    for name, _, _ in rows:
        e, r = boot["ece"][name], boot["ratio"].get(name)
        print(f"- {name}: ECE {e['point']:.4f} [{e['lo']:.4f}, {e['hi']:.4f}]"
              + (f", x raw {r['point']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]" if r else ""))


if __name__ == "__main__":
    main()
