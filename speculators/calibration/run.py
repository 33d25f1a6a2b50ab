"""Calibration of a drafter's confidence head: per-position temperatures and shifts fitted left to right.

A drafter with a confidence head (DSpark, ALGORITHMS.md) reports per draft a raw confidence logit
``z_k`` (``Proposal.confidence_logits``); its calibrated conditional confidence is
``c_k = sigmoid(z_k / T_k + b_k)`` with the drafter's declared calibration ``confidence_calibration() =
(T [B], b [B])`` (temperatures, ones until calibrated, and shifts, zeros until calibrated), the probability
that draft k is accepted given drafts 1..k-1 were. Their running product ``S_k = prod_{i<=k} c_i``
(:func:`speculators.generate.survival_probabilities`) is the probability that drafts 1..k are ALL
accepted: the quantity confidence-gated verification thresholds (:class:`speculators.generate.ConfidenceGate`).

The calibration (``speculators calibrate RUN_DIR``, :func:`speculators.workflows.calibrate_run`):

1. :func:`collect_confidence_outcomes`: real speculative generation (the eval loop,
   :func:`speculators.generate.speculative_generate`, no gating) on held-out prompts records per step the
   raw logits of the drafts and how many the verifier accepted. The last step of each request (the one
   that emitted its stop token or reached ``max_new_tokens``) is not recorded: the drafter is never
   advanced past it.
2. :func:`fit_calibration` (left to right): for k = 1..K, ``(T_k, b_k)`` maximise the likelihood of the
   observed survival under ``S_k = S_{k-1} * sigmoid(z_k / T_k + b_k)``. A step that accepted ``a`` of
   its ``n`` drafts has likelihood ``prod_{k<=a} c_k * (1 - c_{a+1})`` (the last factor when ``a < n``),
   so the factor that depends on (T_k, b_k) is the Bernoulli likelihood of "draft k accepted" on the
   steps that drafted k and accepted drafts 1..k-1 (where survival to k-1 is already a fact): they
   minimise that negative log-likelihood, ``-[y log c_k + (1 - y) log(1 - c_k)]``, a logistic regression
   of the outcome on z_k (Platt scaling, one per position). (The pooled survival NLL over every step is
   minimised by the same values in expectation but is noisier: steps that already failed carry no
   information on c_k.) One-dimensional search on ``log T`` in ``[0.05, 20]``: a 41-point grid, then
   golden-section refinement around its best point, each candidate T with its best b (Newton; no scipy).
   A position judged on fewer than ``min_steps`` (20) steps keeps its temperature and shift (with a
   handful of outcomes the fit runs to a bound of the search). (A head
   whose raw logits are ``a`` times the true acceptance logits gets ``T ~ a``; one whose logits are
   shifted by ``d`` gets ``b ~ -d``.) Why the shift: a temperature only rescales the logit around 0, i.e.
   around a confidence of 0.5; a head whose confidences are spread too wide around a mean of 0.2 (it
   ranks acceptance poorly) needs them pulled towards 0.2, which takes a smaller slope AND a shift.
   ``fit_bias=False`` (``speculators calibrate --temperature-only``) is the temperature-only STS as
   ALGORITHMS.md states it.
3. :func:`expected_calibration_error` of the survival probabilities (every (step, k) pair with k <=
   drafted, pooled over positions, and per position) before (the checkpoint's current calibration),
   after, and for the raw head (every T = 1, b = 0; differs from "before" when an earlier calibration was
   stored), with
   EQUAL-MASS bins (15 by default: each bin holds the same number of pairs, so sparse regions of
   probability do not make noisy bins; Nixon et al. 2019, "Measuring calibration in deep learning").
   With enough prompts the fit and the ECE use disjoint halves of the prompts (``fit_fraction``), so the
   "after" ECE is measured on data the calibration was not fitted on.
4. :func:`store_temperatures`: the fitted ``T`` and ``b`` become the drafter's calibration
   (``Drafter.set_confidence_calibration``), stored in the checkpoint's ``config.json`` as
   ``speculators_training.confidence_calibration`` (never in ``model.safetensors``, which holds only
   what vLLM places; written to a temporary file and renamed, so a failure leaves the old file), and
   :func:`write_calibration_report` writes ``calibration.json``, ``calibration.md``, the reliability
   diagram ``reliability.png`` and the raw outcomes ``outcomes.safetensors``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .errors import SpeculatorsError
from .generate import confidence_bias_of, confidence_temperature_of, speculative_generate, survival_probabilities
from .utils import atomic_dir

TEMPERATURE_BUFFER = "confidence_temperature"
BIAS_BUFFER = "confidence_bias"
DEFAULT_BINS = 15
T_BOUNDS = (0.05, 20.0)
B_BOUND = 20.0  # |b_k| limit: a position whose every outcome agrees runs to it (sigmoid(20) ~ 1 - 2e-9)
PLOT_FILE = "reliability.png"
OUTCOMES_FILE = "outcomes.safetensors"
METHOD_PLATT = "temperature and shift per position (Platt scaling, fitted left to right)"
METHOD_STS = "temperature per position (STS, fitted left to right)"


# ----------------------------------------------------------------------------- data
@dataclass
class ConfidenceRecord:
    """Raw confidence logits and accept outcomes of ``N`` verification steps.

    Attributes:
        logits: ``[N, K]`` float32 raw confidence logits; NaN beyond a step's ``drafted``.
        drafted: ``[N]`` int64 drafts verified in the step (1..K).
        accepted: ``[N]`` int64 drafts the verifier accepted (0..drafted).
        prompt: ``[N]`` int64 index of the prompt (request) each step decoded, in the order the record's
            prompts were given; None when unknown (records written before it existed). Steps of one prompt
            are correlated; :func:`ece_prompt_bootstrap` resamples whole prompts with it.
    """

    logits: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    prompt: torch.Tensor | None = None

    @classmethod
    def from_steps(cls, steps: list[tuple], k: int | None = None) -> "ConfidenceRecord":
        """From ``[(logits [n] float, accepted int)]`` or ``[(logits, accepted, prompt index int)]`` per
        step (all steps of one kind); ``k`` = width (default: the longest n).

        Raises:
            SpeculatorsError: an accepted count outside ``[0, n]``, a step without drafts, or prompt indices
                given for some steps only.
        """
        width = k if k is not None else max((int(st[0].numel()) for st in steps), default=0)
        logits = torch.full((len(steps), width), float("nan"))
        drafted = torch.zeros(len(steps), dtype=torch.int64)
        accepted = torch.zeros(len(steps), dtype=torch.int64)
        with_prompt = {len(st) == 3 for st in steps}
        if len(with_prompt) > 1:
            raise SpeculatorsError("confidence record: prompt indices given for some steps only")
        prompt = torch.zeros(len(steps), dtype=torch.int64) if with_prompt == {True} else None
        for i, st in enumerate(steps):
            z, a = st[0].detach().reshape(-1).float().cpu(), st[1]
            n = int(z.numel())
            if n == 0 or n > width or not 0 <= int(a) <= n:
                raise SpeculatorsError(f"confidence record step {i}: {n} drafts (1..{width} allowed) with {a} accepted")
            logits[i, :n] = z
            drafted[i], accepted[i] = n, int(a)
            if prompt is not None:
                prompt[i] = int(st[2])
        return cls(logits, drafted, accepted, prompt)

    def __len__(self) -> int:
        return int(self.drafted.numel())

    @property
    def k(self) -> int:
        """Width of :attr:`logits` (the most drafts one step recorded)."""
        return int(self.logits.shape[1])

    @staticmethod
    def save_many(records: dict[str, "ConfidenceRecord"], file: str | Path) -> Path:
        """Write records (name -> record; a name without dots) to one safetensors file: per record the
        tensors ``{name}.logits`` ``[N, K]`` float32 (NaN beyond a step's drafts), ``{name}.drafted``,
        ``{name}.accepted`` and, when known, ``{name}.prompt`` ``[N]`` int64 (:meth:`load_many` reads them
        back). Returns ``file``.

        Raises:
            SpeculatorsError: an empty record name or one containing a dot.
        """
        from safetensors.torch import save_file

        bad = [name for name in records if "." in name or not name]
        if bad:
            raise SpeculatorsError(f"confidence-outcome record names must be non-empty without dots, got {bad}")
        tensors = {f"{name}.{field}": getattr(r, field).contiguous() for name, r in records.items()
                   for field in ("logits", "drafted", "accepted", "prompt") if getattr(r, field) is not None}
        save_file(tensors, str(file), metadata={"format": "speculators-confidence-outcomes"})
        return Path(file)

    @staticmethod
    def load_many(file: str | Path) -> dict[str, "ConfidenceRecord"]:
        """Read :meth:`save_many`'s file back (name -> record).

        Raises:
            SpeculatorsError: a missing or unreadable file, or a record with a missing tensor or
                inconsistent shapes.
        """
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file))
        except Exception as e:  # OSError, or safetensors' own error for a corrupt file
            raise SpeculatorsError(f"{file}: not a confidence-outcomes file ({e})") from None
        out = {}
        for name in sorted({k.rsplit(".", 1)[0] for k in tensors}):
            try:
                z, n, a = (tensors[f"{name}.{f}"] for f in ("logits", "drafted", "accepted"))
            except KeyError as e:
                raise SpeculatorsError(f"{file}: record {name!r} lacks the tensor {e.args[0]}") from None
            p = tensors.get(f"{name}.prompt")  # absent in files written before prompt indices were kept
            if z.dim() != 2 or n.shape != (z.shape[0],) or a.shape != n.shape or (p is not None and p.shape != n.shape):
                raise SpeculatorsError(f"{file}: record {name!r} has logits {tuple(z.shape)}, drafted "
                                       f"{tuple(n.shape)}, accepted {tuple(a.shape)}"
                                       + ("" if p is None else f", prompt {tuple(p.shape)}")
                                       + "; expected [N, K], [N], [N] (and prompt [N])")
            out[name] = ConfidenceRecord(z, n, a, p)
        return out


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


class _ConfidenceRecorder:
    """A transparent :class:`speculators.generate.Proposer` around a drafter that records, per step and
    request, the proposal's raw confidence logits, (at ``advance``) how many drafts were accepted
    (``len(new_ids) - 1``) and which of ``prompts`` the request decodes (``start`` receives the prompt
    and the first generated token; identical prompts take their indices in order). Steps are matched by
    the identity of the request's state object; a step whose request finished (never advanced) is
    dropped when the next ``propose`` starts."""

    def __init__(self, proposer, prompts: list[list[int]]):
        self.proposer = proposer
        self.pending: dict[int, torch.Tensor] = {}
        self.steps: list[tuple[torch.Tensor, int, int]] = []
        self.without_confidence = 0
        self.unstarted: dict[tuple[int, ...], deque[int]] = {}
        for i, p in enumerate(prompts):
            self.unstarted.setdefault(tuple(int(t) for t in p), deque()).append(i)
        self.prompt_of: dict[int, int] = {}

    def start(self, input_ids, features):
        state = self.proposer.start(input_ids, features)
        queue = self.unstarted.get(tuple(input_ids.reshape(-1)[:-1].tolist()))
        if not queue:
            raise SpeculatorsError("calibrate: a request started whose prompt is not among the prompts given")
        self.prompt_of[id(state)] = queue.popleft()
        return state

    def propose(self, states, ks, sampling=None, generators=None):
        props = self.proposer.propose(states, ks, sampling, generators)
        self.pending = {}
        for s, p in zip(states, props):
            if p is None or p.token_ids.numel() == 0:
                continue
            if p.confidence_logits is None:
                self.without_confidence += 1
                continue
            self.pending[id(s)] = p.confidence_logits.detach().reshape(-1).float().cpu()
        return props

    def advance(self, states, new_ids, features):
        for s, ids in zip(states, new_ids):
            z = self.pending.pop(id(s), None)
            if z is not None:
                self.steps.append((z, int(ids.numel()) - 1, self.prompt_of[id(s)]))
        self.proposer.advance(states, new_ids, features)


@torch.no_grad()
def collect_confidence_outcomes(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int,
                                sampling=None, batch_size: int = 8, eos_ids: set[int] | None = None,
                                seed: int = 0) -> ConfidenceRecord:
    """Decode ``prompts`` speculatively (no gating) and record every step's raw confidence logits and
    accepted count (see the module docstring, step 1).

    Args:
        target: :class:`speculators.target.Target`. drafter: a batched proposer whose proposals carry
            ``confidence_logits``.
        prompts: token-id lists. k: drafts per step (>= 1). max_new_tokens: per prompt.
        sampling: one request's :class:`speculators.verify.SamplingParams` applied to every prompt (None =
            greedy); prompt i draws from a generator seeded with ``seed + i``.
        batch_size, eos_ids: as :func:`speculators.generate.speculative_generate`.
    Returns:
        :class:`ConfidenceRecord` of width ``k``, with each step's prompt index (into ``prompts``).
    Raises:
        SpeculatorsError: the drafter's proposals carry no confidence logits (no confidence head), no step
            was recorded, or a decoding argument is invalid.
    """
    from .losses import sampling_values
    from .verify import SamplingParams

    temperature, top_k, top_p = sampling_values(sampling)
    sp = SamplingParams.uniform(len(prompts), temperature, top_k, top_p)
    rec = _ConfidenceRecorder(drafter, prompts)
    speculative_generate(target, rec, prompts, k, max_new_tokens, sp, batch_size, eos_ids=eos_ids,
                         seeds=[seed + i for i in range(len(prompts))])
    if not rec.steps:
        if rec.without_confidence:
            raise SpeculatorsError(f"calibrate: the {getattr(drafter, 'algorithm', type(drafter).__name__)} drafter "
                                   "reports no confidence logits (no confidence head): nothing to calibrate")
        raise SpeculatorsError("calibrate: no verification step was recorded (prompts too few or max_new_tokens "
                               "too small); use more prompts or a larger max_new_tokens")
    return ConfidenceRecord.from_steps(rec.steps, k)


# ----------------------------------------------------------------------------- statistics
def survival_pairs(record: ConfidenceRecord, temperature: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (step, position) pair with position <= the step's drafts: ``(S [M] float64 predicted
    survival, y [M] float64 1 when drafts 1..k were all accepted, k [M] int64 1-based position)``.

    ``temperature``: ``[>= K]`` positive (None = all 1), ``bias``: ``[>= K]`` (None = all 0), see
    :func:`speculators.generate.survival_probabilities`.
    """
    probs, labels, pos = [], [], []
    for z, n, a in zip(record.logits, record.drafted.tolist(), record.accepted.tolist()):
        s = survival_probabilities(z[:n], temperature, bias).double()
        probs.append(s)
        labels.append((torch.arange(1, n + 1) <= a).double())
        pos.append(torch.arange(1, n + 1))
    if not probs:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(probs), torch.cat(labels), torch.cat(pos)


BOOTSTRAP_RESAMPLES = 1000  # prompt resamples of :func:`ece_prompt_bootstrap`


def ece_prompt_bootstrap(record: ConfidenceRecord, calibrations: dict[str, tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]],
                         reference: str, bins: int = DEFAULT_BINS, resamples: int = BOOTSTRAP_RESAMPLES,
                         seed: int = 0) -> dict | None:
    """Sampling uncertainty of the survival ECE over PROMPTS: whole prompts (all their steps) are
    resampled with replacement ``resamples`` times and every calibration's pooled ECE
    (:func:`expected_calibration_error`) and its ratio to ``reference``'s are recomputed on each resample
    (a cluster bootstrap: steps of one prompt are correlated, which :func:`ece_noise_floor`, redrawing
    each pair independently, does not see).

    Args:
        record: steps with prompt indices (``record.prompt``). calibrations: name -> ``(temperature,
            bias)`` as :func:`survival_pairs` takes them (None = 1 / 0). reference: the name every ratio
            divides by (e.g. the raw head). bins: equal-mass bins. resamples: >= 1. seed: the
            resampling generator's seed.
    Returns:
        None without prompt indices or with fewer than 2 prompts; else ``{"prompts", "resamples",
        "reference", "ece": {name: {"point", "lo", "hi"}}, "ratio": {name: {"point", "lo", "hi"}}}``
        with 2.5% / 97.5% percentile bounds (``ratio`` for every name but ``reference``; a resample
        whose reference ECE is 0 is left out of the ratios).
    Raises:
        SpeculatorsError: ``reference`` not among ``calibrations``, ``resamples`` < 1, ``bins`` < 1.
    """
    if reference not in calibrations:
        raise SpeculatorsError(f"ece_prompt_bootstrap: reference {reference!r} is not one of {sorted(calibrations)}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise SpeculatorsError(f"resamples must be an integer >= 1, got {resamples!r}")
    if record.prompt is None:
        return None
    prompts, step_prompt = torch.unique(record.prompt, return_inverse=True)
    n_prompts = prompts.numel()
    if n_prompts < 2:
        return None
    pair_prompt = torch.repeat_interleave(step_prompt, record.drafted)  # the pairs' prompt, pair order as survival_pairs
    members = torch.split(torch.argsort(pair_prompt, stable=True), torch.bincount(pair_prompt, minlength=n_prompts).tolist())
    pairs = {name: survival_pairs(record, t, b)[:2] for name, (t, b) in calibrations.items()}
    gen = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {name: [] for name in calibrations}
    for _ in range(resamples):
        pick = torch.randint(n_prompts, (n_prompts,), generator=gen).tolist()
        idx = torch.cat([members[j] for j in pick])
        for name, (s, y) in pairs.items():
            draws[name].append(expected_calibration_error(s[idx], y[idx], bins))

    def band(values: list[float], point: float) -> dict:
        v = torch.tensor(values, dtype=torch.float64)
        lo, hi = torch.quantile(v, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist() if v.numel() else (point, point)
        return {"point": point, "lo": lo, "hi": hi}

    point = {name: expected_calibration_error(s, y, bins) for name, (s, y) in pairs.items()}
    ref = draws[reference]
    out = {"prompts": int(n_prompts), "resamples": resamples, "reference": reference,
           "ece": {name: band(draws[name], point[name]) for name in calibrations}, "ratio": {}}
    for name in calibrations:
        if name != reference:
            ratios = [e / r for e, r in zip(draws[name], ref) if r > 0]
            out["ratio"][name] = band(ratios, point[name] / point[reference] if point[reference] > 0 else float("nan"))
    return out


def _equal_mass_bins(m: int, bins: int) -> list[torch.Tensor]:
    """The index ranges of ``min(bins, m)`` contiguous equal-mass bins over ``m`` sorted predictions
    (sizes differ by at most one; none empty; ``[]`` for ``m = 0``).

    Raises:
        SpeculatorsError: ``bins`` not an integer >= 1.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise SpeculatorsError(f"bins must be an integer >= 1, got {bins!r}")
    return [idx for idx in torch.tensor_split(torch.arange(m), min(bins, max(m, 1))) if idx.numel()]


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> list[dict]:
    """Equal-mass bins of predictions ``probs [M]`` in [0, 1] against 0/1 ``labels [M]``: sorted by
    prediction and split into ``min(bins, M)`` contiguous groups whose sizes differ by at most one.

    Returns:
        one dict per non-empty bin: ``lo`` / ``hi`` (smallest / largest prediction in it), ``mean_pred``,
        ``frac_pos`` (observed frequency), ``count``.
    Raises:
        SpeculatorsError: ``bins`` < 1 or shapes that differ.
    """
    p, y = probs.double().reshape(-1), labels.double().reshape(-1)
    if p.shape != y.shape:
        raise SpeculatorsError(f"reliability_bins: {p.numel()} predictions for {y.numel()} labels")
    order = torch.argsort(p, stable=True)
    p, y = p[order], y[order]
    out = []
    for idx in _equal_mass_bins(p.numel(), bins):
        out.append({"lo": float(p[idx[0]]), "hi": float(p[idx[-1]]), "mean_pred": float(p[idx].mean()),
                    "frac_pos": float(y[idx].mean()), "count": int(idx.numel())})
    return out


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """ECE with equal-mass bins (:func:`reliability_bins`): ``sum_b (n_b / M) |mean_pred_b - frac_pos_b|``
    (0 = perfectly calibrated; 0.0 without pairs)."""
    table = reliability_bins(probs, labels, bins)
    m = sum(b["count"] for b in table)
    return sum(b["count"] / m * abs(b["mean_pred"] - b["frac_pos"]) for b in table) if m else 0.0


NOISE_DRAWS = 200  # label redraws of :func:`ece_noise_floor`


def ece_noise_floor(probs: torch.Tensor, bins: int = DEFAULT_BINS, draws: int = NOISE_DRAWS,
                    seed: int = 0) -> dict:
    """The ECE that a PERFECTLY calibrated head making the same predictions would score on this many pairs:
    outcomes redrawn ``draws`` times as ``y ~ Bernoulli(probs)`` and binned like
    :func:`expected_calibration_error` (equal-mass bins, the same bin edges since the predictions do not
    change). The plug-in ECE is biased upwards by sampling noise; an ECE inside this band is what a
    perfectly calibrated head would score, so it is no evidence of miscalibration (the band is the
    resolution of one ECE, not a test of the difference between two on the same outcomes).

    Args:
        probs: ``[M]`` predictions in [0, 1] (any float dtype).
        bins: equal-mass bins (>= 1). draws: redraws (>= 1). seed: the redraws' generator seed.
    Returns:
        ``{"mean", "lo", "hi"}``: the mean and the 5% / 95% quantiles of the redrawn ECEs (all 0.0 without
        pairs).
    Raises:
        SpeculatorsError: ``bins`` or ``draws`` < 1.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise SpeculatorsError(f"draws must be an integer >= 1, got {draws!r}")
    p = torch.sort(probs.double().reshape(-1).clamp(0.0, 1.0), stable=True).values
    m = p.numel()
    sizes = torch.tensor([idx.numel() for idx in _equal_mass_bins(m, bins)], dtype=torch.int64)
    if m == 0:
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    bin_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    mean_pred = torch.zeros(sizes.numel(), dtype=torch.float64).index_add_(0, bin_of, p) / sizes
    gen = torch.Generator().manual_seed(seed)
    chunk = max(1, min(draws, (1 << 22) // m))  # at most ~4M redrawn outcomes (32 MB) at a time
    eces = []
    for d in range(0, draws, chunk):
        y = torch.bernoulli(p.expand(min(chunk, draws - d), m), generator=gen)
        frac = torch.zeros(y.shape[0], sizes.numel(), dtype=torch.float64).index_add_(1, bin_of, y) / sizes
        eces.append(((frac - mean_pred).abs() * sizes / m).sum(dim=1))
    eces = torch.cat(eces)
    lo, hi = torch.quantile(eces, torch.tensor([0.05, 0.95], dtype=torch.float64)).tolist()
    return {"mean": float(eces.mean()), "lo": lo, "hi": hi}


def _nll(s: torch.Tensor, y: torch.Tensor) -> float:
    s = s.clamp(1e-12, 1.0 - 1e-12)
    return float(-(y * s.log() + (1.0 - y) * torch.log1p(-s)).mean()) if s.numel() else 0.0


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    """Golden-section minimum of a unimodal ``f`` on ``[lo, hi]``."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2.0


def _best_shift(x: torch.Tensor, y: torch.Tensor, start: float = 0.0, bound: float = B_BOUND) -> float:
    """The shift ``b`` in ``[-bound, bound]`` that minimises the Bernoulli NLL of ``sigmoid(x + b)``
    against 0/1 ``y`` (one-dimensional and convex: safeguarded Newton steps on the score
    ``sum(sigmoid(x + b) - y)``; all-0 or all-1 ``y`` run to the bound)."""
    lo, hi, b = -bound, bound, min(max(start, -bound), bound)
    for _ in range(100):
        p = torch.sigmoid(x + b)
        g, h = float((p - y).sum()), float((p * (1.0 - p)).sum())
        if g > 0:  # the NLL rises with b here: the minimum is below b
            hi = b
        else:
            lo = b
        step = b - g / h if h > 1e-12 else None
        nb = step if step is not None and lo < step < hi else (lo + hi) / 2.0
        if abs(nb - b) < 1e-10 or hi - lo < 1e-10:
            return nb
        b = nb
    return b


def fit_calibration(record: ConfidenceRecord, initial: torch.Tensor | None = None,
                    initial_bias: torch.Tensor | None = None, bounds: tuple[float, float] = T_BOUNDS,
                    min_steps: int = 20, fit_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position temperatures and shifts, fitted left to right (module docstring, step 2).

    Position k's conditional confidence ``c_k = sigmoid(z_k / T_k + b_k)`` is fitted by maximum likelihood
    on the steps that drafted k and accepted drafts 1..k-1 (outcome: draft k accepted), with Platt's
    smoothed targets ``(n_pos + 1) / (n_pos + 2)`` for an accept and ``1 / (n_neg + 2)`` for a reject
    (Platt 1999: a position whose outcomes all agree gets a finite fit; negligible with many steps). With ``fit_bias``
    (Platt scaling per position) ``(T_k, b_k)`` minimise that NLL jointly: ``log T_k`` by a 41-point grid
    and golden-section refinement over ``bounds``, each candidate with its best ``b_k`` (a convex
    one-dimensional problem, :func:`_best_shift`); the pair is a logistic regression of the outcome on
    ``z_k`` whose slope ``1 / T_k`` is kept in ``[1 / high, 1 / low]`` (a head whose logit does not rank
    acceptance gets ``T_k = high``: a nearly constant confidence at the observed rate; ``|b_k| <= 20``
    applies to the shift added AFTER the division by ``T_k``). Without it
    (temperature-only STS, ALGORITHMS.md) ``b_k = 0`` and only ``T_k`` is fitted.

    Args:
        record: the steps to fit on.
        initial, initial_bias: ``[B]`` current temperatures / shifts (B >= record.k; positions beyond
            ``record.k`` and positions judged on fewer than ``min_steps`` steps keep these); None = ones /
            zeros of the other's length (or ``record.k``).
        bounds: the search interval of each T (> 0).
        min_steps: the fewest steps (that drafted k and accepted drafts 1..k-1) position k is fitted on.
        fit_bias: fit the shifts too (False: every fitted position gets ``b_k = 0``).
    Returns:
        ``(T [B], b [B])`` float32 (new tensors).
    Raises:
        SpeculatorsError: ``initial`` / ``initial_bias`` shorter than ``record.k``, of different lengths, a
            temperature not positive or a shift not finite; bad ``bounds``.
    """
    lo, hi = float(bounds[0]), float(bounds[1])
    if not 0.0 < lo < hi:
        raise SpeculatorsError(f"fit_calibration: bounds must satisfy 0 < low < high, got {bounds!r}")
    K = record.k
    T = None if initial is None else initial.detach().double().cpu().reshape(-1).clone()
    bias = None if initial_bias is None else initial_bias.detach().double().cpu().reshape(-1).clone()
    width = T.numel() if T is not None else (bias.numel() if bias is not None else K)
    T = torch.ones(width, dtype=torch.float64) if T is None else T
    bias = torch.zeros(width, dtype=torch.float64) if bias is None else bias
    if T.numel() < K or not bool((T > 0).all()):
        raise SpeculatorsError(f"fit_calibration: initial temperatures must be {K} or more positive values, "
                               f"got {T.tolist()}")
    if bias.numel() != T.numel() or not bool(torch.isfinite(bias).all()):
        raise SpeculatorsError(f"fit_calibration: initial shifts must be {T.numel()} finite values (one per "
                               f"temperature), got {bias.tolist()}")
    z, n, a = record.logits.double(), record.drafted, record.accepted
    grid = torch.linspace(math.log(lo), math.log(hi), 41).tolist()
    for k in range(1, K + 1):  # left to right: position k is judged only on steps that survived to k - 1
        rows = (n >= k) & (a >= k - 1)
        if int(rows.sum()) < max(int(min_steps), 1):
            continue
        hit = a[rows] >= k
        # Platt's smoothed targets: (n_pos + 1) / (n_pos + 2) and 1 / (n_neg + 2) instead of 1 and 0, so a
        # position whose few outcomes all agree (or that its logit separates) gets a finite fit, not
        # c_k -> 0 or 1 (which would make the gate cut it, and every later position, at any threshold)
        n_pos = int(hit.sum())
        n_neg = int(hit.numel()) - n_pos
        zk = z[rows, k - 1]
        y = torch.where(hit, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0)).double()

        last = [0.0]  # warm start: neighbouring candidates of log T have nearby best shifts

        def shift(u: float) -> float:
            if not fit_bias:
                return 0.0
            last[0] = _best_shift(zk / math.exp(u), y, last[0])
            return last[0]

        def loss(u: float) -> float:
            return _nll(torch.sigmoid(zk / math.exp(u) + shift(u)), y)

        best = min(range(len(grid)), key=lambda i: loss(grid[i]))
        u = _golden_min(loss, grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)])
        T[k - 1], bias[k - 1] = math.exp(u), shift(u)
    return T.float(), bias.float()


def fit_temperatures(record: ConfidenceRecord, initial: torch.Tensor | None = None,
                     bounds: tuple[float, float] = T_BOUNDS, min_steps: int = 20) -> torch.Tensor:
    """Per-position temperatures alone (STS as ALGORITHMS.md states it: :func:`fit_calibration` with
    ``fit_bias=False``), ``[B]`` float32; the arguments and errors are :func:`fit_calibration`'s."""
    return fit_calibration(record, initial, None, bounds, min_steps, fit_bias=False)[0]


def calibration_summary(record: ConfidenceRecord, temperature: torch.Tensor | None,
                        bins: int = DEFAULT_BINS, bias: torch.Tensor | None = None, floors: bool = True) -> dict:
    """ECE, NLL, Brier score and the reliability table of the survival probabilities of ``record`` under
    ``temperature`` and ``bias`` (None: all 1 / all 0), plus per position: pairs, mean predicted survival,
    observed survival rate and the ECE of that position's pairs alone (the pooled ECE is dominated by
    late positions whose survival and outcome are both near 0; slot 1 carries most of the signal).
    Beside each ECE (with ``floors``), ``ece_floor`` (:func:`ece_noise_floor`): what a perfectly
    calibrated head with the same predictions would score on as many pairs, the resolution of that ECE."""
    s, y, pos = survival_pairs(record, temperature, bias)
    per = []
    for k in range(1, record.k + 1):
        m = pos == k
        if bool(m.any()):
            per.append({"k": k, "pairs": int(m.sum()), "mean_survival_pred": float(s[m].mean()),
                        "survival_rate": float(y[m].mean()), "ece": expected_calibration_error(s[m], y[m], bins),
                        **({"ece_floor": ece_noise_floor(s[m], bins, seed=k)} if floors else {})})
    out = {"ece": expected_calibration_error(s, y, bins), "nll": _nll(s, y),
           "brier": float(((s - y) ** 2).mean()) if s.numel() else 0.0, "pairs": int(s.numel()),
           "reliability": reliability_bins(s, y, bins) if s.numel() else [], "per_position": per}
    if floors:
        out["ece_floor"] = ece_noise_floor(s, bins)
    return out


THRESHOLD_GRID = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def threshold_sweep(record: ConfidenceRecord, temperature: torch.Tensor | None,
                    thresholds=THRESHOLD_GRID, bias: torch.Tensor | None = None) -> list[dict]:
    """What confidence-gated verification (:class:`speculators.generate.ConfidenceGate`, threshold mode)
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
    from .generate import ConfidenceGate

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


# ----------------------------------------------------------------------------- checkpoint
def store_temperatures(checkpoint_dir: str | Path, temperature: torch.Tensor,
                       bias: torch.Tensor | None = None) -> Path:
    """Store a fitted calibration in checkpoint ``checkpoint_dir``: ``temperature`` and ``bias`` (None:
    zeros, a temperature-only calibration) become the drafter's ``confidence_calibration()``, written to
    ``config.json`` as ``speculators_training.confidence_calibration`` (the drafter's
    ``training_state()``; engines ignore it), never to ``model.safetensors`` (vLLM's loader cannot place
    it). A checkpoint of an earlier version that holds the calibration tensors in its weights file gets
    that file rewritten without them (every other tensor, its dtype and the metadata unchanged).

    The new calibration is checked first (the checkpoint's drafter must take it and give it back exactly),
    then each file is written to a temporary file in the same directory and renamed over the old one
    (``os.replace``; the config first, so that a failure in between leaves a checkpoint that loads with
    the new calibration): a failure at any point leaves each file whole.

    Returns:
        the checkpoint's ``config.json``.
    Raises:
        SpeculatorsError: not a checkpoint, a drafter without a confidence head (no calibration), a
            temperature or shift vector of another length, non-positive / non-finite temperatures or
            non-finite shifts (naming ``confidence_temperature`` / ``confidence_bias``).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .drafters import Drafter
    from .drafters.checkpoint import CONFIG_NAME, TRAINING_KEY, WEIGHTS_NAME, load_weights, read_checkpoint_config
    from .utils import atomic_write_text

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
    raw[TRAINING_KEY].update(drafter.training_state())
    atomic_write_text(path / CONFIG_NAME, json.dumps(raw, indent=2, default=str))
    file = path / WEIGHTS_NAME
    declared = set(drafter.training_state_tensors)
    weights = load_weights(file)
    if any(k in declared or k.rsplit(".", 1)[-1] in declared for k in weights):  # an earlier version's file
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
        kept = {k: v.contiguous() for k, v in weights.items()
                if k not in declared and k.rsplit(".", 1)[-1] not in declared}
        mode = os.stat(file).st_mode & 0o777
        fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_NAME}.", dir=path)
        os.close(fd)
        try:
            save_file(kept, tmp, metadata=metadata)
            os.chmod(tmp, mode)
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path / CONFIG_NAME


# ----------------------------------------------------------------------------- the whole calibration
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
    from .losses import sampling_values

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
    if _holds_calibration(report):
        calibrations["before"] = (before_t, before_b)
    report["bootstrap"] = ece_prompt_bootstrap(eval_rec, calibrations, "uncalibrated", bins, seed=seed)
    report["min_tau_ratio"] = min_tau_ratio
    # the gate reads whatever calibration the checkpoint keeps
    for key, temps, shifts in (("fitted", T, b), ("current", before_t, before_b)):
        rows = threshold_sweep(eval_rec, temps, bias=shifts)
        report[f"threshold_sweep_{key}"] = rows
        report[f"recommended_threshold_{key}"] = choose_threshold(rows, min_tau_ratio)
    use_sweep(report, "fitted")
    raw = ("" if not _holds_calibration(report) else
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


def _holds_calibration(report: dict) -> bool:
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
    if _holds_calibration(report) and report.get("uncalibrated"):
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
