"""Calibration of a drafter's confidence head: per-position temperatures and shifts fitted left to right.

A drafter with a confidence head (DSpark, ALGORITHMS.md) reports per draft a raw confidence logit
``z_k`` (``Proposal.confidence_logits``); its calibrated conditional confidence is
``c_k = sigmoid(z_k / T_k + b_k)`` with the drafter's declared calibration ``confidence_calibration() =
(T [B], b [B])`` (temperatures, ones until calibrated, and shifts, zeros until calibrated), the probability
that draft k is accepted given drafts 1..k-1 were. Their running product ``S_k = prod_{i<=k} c_i``
(:func:`speculators.decode.gating.survival_probabilities`) is the probability that drafts 1..k are ALL
accepted: the quantity confidence-gated verification thresholds (:class:`speculators.decode.gating.ConfidenceGate`).

The calibration (``speculators calibrate RUN_DIR``, :func:`speculators.workflows.calibrate_run`), one module
per step:

1. :func:`collect_confidence_outcomes` (``record.py``): real speculative generation (the eval loop,
   :func:`speculators.decode.loop.speculative_generate`, no gating) on held-out prompts records per step, through
   the loop's outcome hook ``on_step``, the raw logits of the drafts and how many the verifier accepted. The
   last step of each request (the one that emitted its stop token or reached ``max_new_tokens``) is not
   recorded: the drafter is never advanced past it.
2. :func:`fit_calibration` (``fit.py``; left to right): for k = 1..K, ``(T_k, b_k)`` maximise the likelihood
   of the observed survival under ``S_k = S_{k-1} * sigmoid(z_k / T_k + b_k)``. A step that accepted ``a`` of
   its ``n`` drafts has likelihood ``prod_{k<=a} c_k * (1 - c_{a+1})`` (the last factor when ``a < n``), so
   the factor that depends on (T_k, b_k) is the Bernoulli likelihood of "draft k accepted" on the steps that
   drafted k and accepted drafts 1..k-1 (where survival to k-1 is already a fact): they minimise that negative
   log-likelihood, ``-[y log c_k + (1 - y) log(1 - c_k)]``, a logistic regression of the outcome on z_k (Platt
   scaling, one per position). (The pooled survival NLL over every step is minimised by the same values in
   expectation but is noisier: steps that already failed carry no information on c_k.) One-dimensional search
   on ``log T`` in ``[0.05, 20]``: a 41-point grid, then golden-section refinement around its best point, each
   candidate T with its best b (Newton; no scipy). A position judged on fewer than ``min_steps`` (20) steps
   keeps its temperature and shift (with a handful of outcomes the fit runs to a bound of the search). (A head
   whose raw logits are ``a`` times the true acceptance logits gets ``T ~ a``; one whose logits are shifted by
   ``d`` gets ``b ~ -d``.) Why the shift: a temperature only rescales the logit around 0, i.e. around a
   confidence of 0.5; a head whose confidences are spread too wide around a mean of 0.2 (it ranks acceptance
   poorly) needs them pulled towards 0.2, which takes a smaller slope AND a shift. ``fit_bias=False``
   (``speculators calibrate --temperature-only``) is the temperature-only STS as ALGORITHMS.md states it.
3. :func:`expected_calibration_error` (``ece.py``) of the survival probabilities (every (step, k) pair with k
   <= drafted, pooled over positions, and per position) before (the checkpoint's current calibration), after,
   and for the raw head (every T = 1, b = 0; differs from "before" when an earlier calibration was stored),
   with EQUAL-MASS bins (15 by default: each bin holds the same number of pairs, so sparse regions of
   probability do not make noisy bins; Nixon et al. 2019, "Measuring calibration in deep learning"). With
   enough prompts the fit and the ECE use disjoint halves of the prompts (``fit_fraction``), so the "after"
   ECE is measured on data the calibration was not fitted on.
4. :func:`store_temperatures` (``run.py``, with :func:`calibrate_drafter`, which runs steps 1-3): the fitted
   ``T`` and ``b`` become the drafter's calibration (``Drafter.set_confidence_calibration``), stored in the
   checkpoint's ``config.json`` as ``speculators_training.confidence_calibration`` (never in
   ``model.safetensors``, which holds only what vLLM places; written to a temporary file and renamed, so a
   failure leaves the old file), and :func:`write_calibration_report` (``report.py``) writes
   ``calibration.json``, ``calibration.md``, the reliability diagram ``reliability.png`` and the raw outcomes
   ``outcomes.safetensors``.
"""

from __future__ import annotations

from .ece import (
    BOOTSTRAP_RESAMPLES,
    DEFAULT_BINS,
    NOISE_DRAWS,
    bernoulli_nll,
    calibration_summary,
    ece_noise_floor,
    ece_prompt_bootstrap,
    expected_calibration_error,
    reliability_bins,
    survival_pairs,
)
from .fit import B_BOUND, METHOD_PLATT, METHOD_STS, T_BOUNDS, fit_calibration, fit_temperatures
from .record import OUTCOMES_FILE, ConfidenceRecord, collect_confidence_outcomes
from .report import (
    PLOT_FILE,
    calibration_markdown,
    holds_calibration,
    reliability_plot,
    write_calibration_report,
)
from .run import (
    TEMPERATURE_BUFFER,
    THRESHOLD_GRID,
    CalibrationResult,
    calibrate_drafter,
    choose_threshold,
    interleaved_split,
    store_temperatures,
    threshold_sweep,
    use_sweep,
)

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "B_BOUND",
    "CalibrationResult",
    "ConfidenceRecord",
    "DEFAULT_BINS",
    "METHOD_PLATT",
    "METHOD_STS",
    "NOISE_DRAWS",
    "OUTCOMES_FILE",
    "PLOT_FILE",
    "TEMPERATURE_BUFFER",
    "THRESHOLD_GRID",
    "T_BOUNDS",
    "bernoulli_nll",
    "calibrate_drafter",
    "calibration_markdown",
    "calibration_summary",
    "choose_threshold",
    "collect_confidence_outcomes",
    "ece_noise_floor",
    "ece_prompt_bootstrap",
    "expected_calibration_error",
    "fit_calibration",
    "fit_temperatures",
    "holds_calibration",
    "interleaved_split",
    "reliability_bins",
    "reliability_plot",
    "store_temperatures",
    "survival_pairs",
    "threshold_sweep",
    "use_sweep",
    "write_calibration_report",
]
