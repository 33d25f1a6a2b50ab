"""The calibration of a checkpoint end to end (:mod:`speculators.calibration`, steps 1-4):
:func:`calibrate_drafter` (record, fit and measure on interleaved halves of the prompts), the gate
threshold it recommends (:func:`threshold_sweep`, :func:`choose_threshold`, :func:`use_sweep`) and
:func:`store_temperatures` (the fitted calibration into the checkpoint's ``config.json``).
:func:`speculators.workflows.calibrate_run` calls them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import SpeculatorsError
from ..decode.gating import confidence_bias_of, confidence_temperature_of, survival_probabilities
from .ece import DEFAULT_BINS, calibration_summary, ece_prompt_bootstrap
from .fit import METHOD_PLATT, METHOD_STS, fit_calibration
from .record import ConfidenceRecord, collect_confidence_outcomes
from .report import holds_calibration

TEMPERATURE_BUFFER = "confidence_temperature"


@dataclass
class CalibrationResult:
    """What :func:`calibrate_drafter` fitted and measured.

    Attributes:
        temperature, bias: ``[B]`` float32 per-position temperatures / shifts (``c_k = sigmoid(z_k / T_k +
            b_k)``; the shifts are 0 for a temperature-only fit).
        report: the report dict (see :func:`calibrate_drafter`).
        fit_record, eval_record: the outcomes the calibration was fitted / measured on (the same object
            for an in-sample calibration).
    """

    temperature: torch.Tensor
    bias: torch.Tensor
    report: dict
    fit_record: ConfidenceRecord
    eval_record: ConfidenceRecord

    @property
    def records(self) -> dict[str, ConfidenceRecord]:
        """``{"fit": ..., "eval": ...}`` (only ``"fit"`` in-sample), for :func:`write_calibration_report`."""
        return {"fit": self.fit_record} if self.eval_record is self.fit_record else {
            "fit": self.fit_record, "eval": self.eval_record}


THRESHOLD_GRID = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def threshold_sweep(record: ConfidenceRecord, temperature: torch.Tensor | None,
                    thresholds=THRESHOLD_GRID, bias: torch.Tensor | None = None) -> list[dict]:
    """What confidence-gated verification (:class:`speculators.decode.gating.ConfidenceGate`, threshold mode)
    would have done on the recorded UNGATED steps: per threshold, the drafts it keeps ``m`` (the leading
    drafts whose survival under ``temperature`` and ``bias`` is ``>= threshold``), the drafts it would have
    verified per step (``mean m`` against the recorded ``mean n``) and the tokens per step it would have emitted
    (``1 + min(accepted, m)``: the gate is a stopping time, so with the same draws the verifier accepts
    the same prefix cut at ``m`` and adds one recovered/bonus token; right per recorded step at any
    temperature). It is an estimate of the gated run's tau, not a replay: after a cut the gated run
    continues from contexts the ungated record never visited, so the real gated tau comes from
    ``speculators eval --confidence-threshold``.

    Returns:
        One dict per threshold: ``threshold``, ``verified_per_step``, ``verified_cut`` (1 - gated / ungated
        verified drafts), ``tau_est`` (tokens per step), ``tau_ratio`` (against the ungated steps' tau).
    """
    from ..decode.gating import ConfidenceGate

    ungated_v = float(record.drafted.double().mean()) if len(record) else 0.0
    ungated_tau = 1.0 + float(record.accepted.double().mean()) if len(record) else 1.0
    rows = []
    for thr in thresholds:
        gate = ConfidenceGate(float(thr))
        kept, emitted = [], []
        for z, n, a in zip(record.logits, record.drafted.tolist(), record.accepted.tolist()):
            m = gate.keep_length(survival_probabilities(z[:n], temperature, bias))
            kept.append(m)
            emitted.append(1 + min(a, m))
        v = sum(kept) / max(len(kept), 1)
        tau = sum(emitted) / max(len(emitted), 1)
        rows.append({"threshold": float(thr), "verified_per_step": v,
                     "verified_cut": 1.0 - v / ungated_v if ungated_v else 0.0,
                     "tau_est": tau, "tau_ratio": tau / ungated_tau})
    return rows


def choose_threshold(rows: list[dict], min_tau_ratio: float = 0.97) -> dict | None:
    """The :func:`threshold_sweep` row that cuts the most verified drafts while keeping ``tau_ratio >=
    min_tau_ratio`` (ties: the lower threshold), or None when no threshold keeps it with a cut > 0."""
    ok = [r for r in rows if r["tau_ratio"] >= min_tau_ratio and r["verified_cut"] > 0]
    return max(ok, key=lambda r: (round(r["verified_cut"], 12), -r["threshold"])) if ok else None


def store_temperatures(checkpoint_dir: str | Path, temperature: torch.Tensor,
                       bias: torch.Tensor | None = None) -> Path:
    """Store a fitted calibration in checkpoint ``checkpoint_dir``: ``temperature`` and ``bias`` (None:
    zeros, a temperature-only calibration) become the drafter's ``confidence_calibration()``, written to
    ``config.json`` as ``speculators_training.confidence_calibration``
    (:func:`speculators.drafters.training_state.training_state`; engines ignore it), never to
    ``model.safetensors`` (vLLM's loader cannot place it). A checkpoint of an earlier version that holds the calibration tensors in its weights file gets
    that file rewritten without them (every other tensor, its dtype and the metadata unchanged).

    The new calibration is checked first (the checkpoint's drafter must take it and give it back exactly),
    then each file is written atomically (:func:`speculators.utils.atomic_write_text` /
    :func:`speculators.utils.atomic_write_bytes`: a temporary file renamed over the old one; the config first, so that a failure in between leaves a checkpoint that loads with
    the new calibration): a failure at any point leaves each file whole.

    Returns:
        the checkpoint's ``config.json``.
    Raises:
        SpeculatorsError: not a checkpoint, a drafter without a confidence head (no calibration), a
            temperature or shift vector of another length, non-positive / non-finite temperatures or
            non-finite shifts (naming ``confidence_temperature`` / ``confidence_bias``).
    """
    from safetensors import safe_open
    from safetensors.torch import save

    from ..drafters import Drafter
    from ..drafters.checkpoint import CONFIG_NAME, TRAINING_KEY, WEIGHTS_NAME, load_weights, read_checkpoint_config
    from ..drafters.training_state import training_state
    from ..utils import atomic_write_bytes, atomic_write_text

    path = Path(checkpoint_dir)
    drafter = Drafter.from_pretrained(path)  # refuses a broken checkpoint before anything is written
    if drafter.confidence_calibration() is None:
        raise SpeculatorsError(f"{path}: the {drafter.algorithm} drafter has no confidence head (no "
                               f"{TEMPERATURE_BUFFER}): nothing to calibrate")
    t = temperature.detach().float().cpu().reshape(-1)
    b = torch.zeros_like(t) if bias is None else bias.detach().float().cpu().reshape(-1)
    try:
        drafter.set_confidence_calibration(t, b)
    except SpeculatorsError as e:
        raise SpeculatorsError(f"{path}: {e}") from None
    got_t, got_b = drafter.confidence_calibration()
    if not (torch.equal(got_t, t) and torch.equal(got_b, b)):
        raise SpeculatorsError(f"{path}: the drafter does not give the calibration back as it was set")
    raw = read_checkpoint_config(path)
    raw[TRAINING_KEY].update(training_state(drafter))
    atomic_write_text(path / CONFIG_NAME, json.dumps(raw, indent=2, default=str))
    file = path / WEIGHTS_NAME
    declared = set(drafter.serving.training_state_tensors)
    weights = load_weights(file)
    if any(k in declared or k.rsplit(".", 1)[-1] in declared for k in weights):  # an earlier version's file
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
        kept = {k: v.contiguous() for k, v in weights.items()
                if k not in declared and k.rsplit(".", 1)[-1] not in declared}
        atomic_write_bytes(file, save(kept, metadata=metadata))
    return path / CONFIG_NAME


def interleaved_split(n: int, n_fit: int) -> list[int]:
    """The indices (sorted) of ``n_fit`` of ``n`` items spread evenly over ``range(n)``: item ``i`` is
    taken when ``floor((i + 1) * n_fit / n) > floor(i * n_fit / n)`` (n_fit = n/2 takes every second one).
    The calibration's fit side: a first-half/second-half split of prompts listed source by source (or by
    id) would fit on one kind of prompt and measure on another.

    Raises:
        SpeculatorsError: not ``0 <= n_fit <= n``.
    """
    if not 0 <= n_fit <= n:
        raise SpeculatorsError(f"interleaved_split: need 0 <= n_fit <= n, got n_fit={n_fit}, n={n}")
    return [i for i in range(n) if ((i + 1) * n_fit) // n > (i * n_fit) // n]


def calibrate_drafter(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int, sampling=None,
                      batch_size: int = 8, eos_ids: set[int] | None = None, seed: int = 0,
                      fit_fraction: float = 0.5, bins: int = DEFAULT_BINS, min_tau_ratio: float = 0.97,
                      log: Callable[[str], None] = print, fit_bias: bool = True) -> "CalibrationResult":
    """Collect outcomes, fit the temperatures and shifts (``fit_bias``; :func:`fit_calibration`) and measure
    ECE before/after (steps 1-3 of the module docstring), on a live target and drafter. Nothing is written
    (see :func:`store_temperatures`, :func:`write_calibration_report`).

    With at least 2 prompts and ``0 < fit_fraction < 1``, ``round(fit_fraction * n)`` prompts (at least one,
    at most n - 1), spread evenly over the list (:func:`interleaved_split`: prompts listed source by source
    give both sides every source), fit the calibration and the others measure ECE; otherwise every prompt
    does both (``report["split"] == "in-sample"``).

    Returns:
        :class:`CalibrationResult`: the fitted ``temperature`` / ``bias`` ``[B]`` float32, the two
        :class:`ConfidenceRecord` s and the report dict, which holds ``method``, ``temperatures_before`` /
        ``temperatures_after``, ``biases_before`` / ``biases_after``, ``before`` / ``after``
        (:func:`calibration_summary` on the ECE prompts, under the checkpoint's current / the fitted T and
        b), ``uncalibrated`` (the same under every T = 1, b = 0: the raw head, the reference when the
        checkpoint already held a calibration), ``in_sample`` (the
        three ECEs on the fit prompts), ``steps_fit``, ``steps_eval``, prompt counts,
        ``binning``, the decoding settings, ``threshold_sweep_fitted`` / ``threshold_sweep_current``
        (:func:`threshold_sweep` of the ECE prompts' steps under the fitted / the drafter's current
        calibration),
        ``recommended_threshold_fitted`` / ``_current`` (:func:`choose_threshold` with ``min_tau_ratio``:
        the gate threshold for ``speculators eval --confidence-threshold``, chosen on these held-out
        prompts, or None) and ``threshold_sweep`` / ``recommended_threshold`` = the fitted ones
        (:func:`use_sweep` switches them when the fitted calibration is not stored).
    Raises:
        SpeculatorsError: see :func:`collect_confidence_outcomes`; no prompts; ``fit_fraction`` outside
            [0, 1].
    """
    from ..losses import sampling_values

    if not prompts:
        raise SpeculatorsError("calibrate: no prompts")
    if not 0.0 <= float(fit_fraction) <= 1.0:
        raise SpeculatorsError(f"fit_fraction must lie in [0, 1], got {fit_fraction!r}")
    n = len(prompts)
    n_fit = min(max(round(fit_fraction * n), 1), n - 1) if n >= 2 and 0.0 < fit_fraction < 1.0 else n
    fit_idx = set(interleaved_split(n, n_fit))
    fit_p = [p for i, p in enumerate(prompts) if i in fit_idx]
    eval_p = [p for i, p in enumerate(prompts) if i not in fit_idx] if n_fit < n else prompts
    current, current_b = confidence_temperature_of(drafter), confidence_bias_of(drafter)
    before_t = current.detach().float().cpu().clone() if isinstance(current, torch.Tensor) else None
    before_b = current_b.detach().float().cpu().clone() if isinstance(current_b, torch.Tensor) else None
    collect = dict(k=k, max_new_tokens=max_new_tokens, sampling=sampling, batch_size=batch_size, eos_ids=eos_ids)
    fit_rec = collect_confidence_outcomes(target, drafter, fit_p, seed=seed, **collect)
    eval_rec = fit_rec if n_fit == n else collect_confidence_outcomes(target, drafter, eval_p, seed=seed + n_fit,
                                                                      **collect)
    T, b = fit_calibration(fit_rec, before_t, before_b, fit_bias=fit_bias)
    report = {
        "method": METHOD_PLATT if fit_bias else METHOD_STS,
        "k": k, "max_new_tokens": max_new_tokens, "sampling": dict(zip(("temperature", "top_k", "top_p"),
                                                                       sampling_values(sampling))),
        "num_prompts": n, "fit_prompts": len(fit_p), "ece_prompts": len(eval_p),
        "split": "held-out halves" if n_fit < n else "in-sample",
        "steps_fit": len(fit_rec), "steps_eval": len(eval_rec),
        "binning": f"equal-mass, {bins} bins, survival pairs of every position pooled",
        "temperatures_before": None if before_t is None else before_t.tolist(), "temperatures_after": T.tolist(),
        "biases_before": None if before_b is None else before_b.tolist(), "biases_after": b.tolist(),
        "before": calibration_summary(eval_rec, before_t, bins, before_b),
        "after": calibration_summary(eval_rec, T, bins, b),
        # the raw head (every T = 1, b = 0): the reference when the checkpoint already holds a calibration
        "uncalibrated": calibration_summary(eval_rec, None, bins),
        "in_sample": {"before": calibration_summary(fit_rec, before_t, bins, before_b, floors=False)["ece"],
                      "after": calibration_summary(fit_rec, T, bins, b, floors=False)["ece"],
                      "uncalibrated": calibration_summary(fit_rec, None, bins, floors=False)["ece"]},
    }
    calibrations = {"uncalibrated": (None, None), "after": (T, b)}
    if holds_calibration(report):
        calibrations["before"] = (before_t, before_b)
    report["bootstrap"] = ece_prompt_bootstrap(eval_rec, calibrations, "uncalibrated", bins, seed=seed)
    report["min_tau_ratio"] = min_tau_ratio
    # the gate reads whatever calibration the checkpoint keeps
    for key, temps, shifts in (("fitted", T, b), ("current", before_t, before_b)):
        rows = threshold_sweep(eval_rec, temps, bias=shifts)
        report[f"threshold_sweep_{key}"] = rows
        report[f"recommended_threshold_{key}"] = choose_threshold(rows, min_tau_ratio)
    use_sweep(report, "fitted")
    raw = ("" if not holds_calibration(report) else
           f" (uncalibrated, T = 1, b = 0: {report['uncalibrated']['ece']:.4f})")
    shifts = f", b = [{', '.join(f'{x:.3f}' for x in b[:k].tolist())}]" if fit_bias else ""
    log(f"calibrate: {len(fit_rec)} steps fit T = [{', '.join(f'{x:.3f}' for x in T[:k].tolist())}]{shifts}; "
        f"survival ECE {report['before']['ece']:.4f} -> {report['after']['ece']:.4f} on {len(eval_rec)} steps "
        f"({report['split']})" + raw)
    return CalibrationResult(T, b, report, fit_rec, eval_rec)


def use_sweep(report: dict, which: str) -> dict:
    """Point ``report["threshold_sweep"]`` / ``["recommended_threshold"]`` at the sweep under the ``"fitted"``
    or the ``"current"`` (checkpoint's, before calibration) temperatures and shifts: the threshold must be
    read with the calibration the checkpoint ends up holding. Returns ``report``."""
    report["sweep_temperatures"] = which
    report["threshold_sweep"] = report[f"threshold_sweep_{which}"]
    report["recommended_threshold"] = report[f"recommended_threshold_{which}"]
    return report
