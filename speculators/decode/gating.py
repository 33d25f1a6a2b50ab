"""Confidence-gated verification (DSpark): which prefix of each proposal the target verifies.

A proposal whose drafts carry raw confidence logits (``Proposal.confidence_logits``, DSpark's
confidence head) is cut, before the target sees it, to the drafts whose calibrated survival
``S_k = prod_{i<=k} sigmoid(z_i / T_i + b_i)`` (:func:`survival_probabilities`) passes the gate
(:class:`ConfidenceGate`: a threshold, a verify-cost model, or both). The calibration ``(T, b)`` is
read through the proposer's DECLARED interface ``confidence_calibration()``
(:meth:`speculators.drafters.base.Drafter.confidence_calibration`; a wrapper proposer declares it by
delegating), never through buffer names. The rule reads only the drafter's outputs, so it stays
lossless (Leviathan et al. 2023). The decoding loop (:func:`speculators.decode.loop.speculative_generate`)
applies it; :mod:`speculators.calibration` fits ``(T, b)``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import SpeculatorsError
from .proposal import Proposal, calibrated_confidence_logits


def check_confidence_threshold(value, name: str = "confidence_threshold") -> float | None:
    """``value`` as a float in the open interval (0, 1), or None (no gating).

    Raises:
        SpeculatorsError: naming ``name``: not a number, or outside (0, 1) (0 would never cut a draft
            and 1 would cut every one: neither is a gate).
    """
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise SpeculatorsError(f"{name}: expected a number in (0, 1) (the survival probability below which drafts "
                               f"are not verified), got {value!r}") from None
    if not 0.0 < v < 1.0:
        raise SpeculatorsError(f"{name}: must lie in the open interval (0, 1) (the survival probability below "
                               f"which drafts are not verified), got {value!r}")
    return v


def _confidence_calibration(proposer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The proposer's declared ``confidence_calibration()`` (:meth:`speculators.drafters.base.Drafter.confidence_calibration`;
    a wrapper proposer declares it by delegating to what it wraps), or None for a proposer that declares
    none (n-gram, suffix) or has no calibration."""
    get = getattr(proposer, "confidence_calibration", None) if proposer is not None else None
    return get() if callable(get) else None


def confidence_temperature_of(proposer) -> torch.Tensor | None:
    """The per-position calibration temperatures ``[B]`` float32 of a proposer with a confidence head: the
    first half of its declared ``confidence_calibration()``, else None (then the raw confidences are
    used, i.e. every T_k = 1)."""
    cal = _confidence_calibration(proposer)
    return None if cal is None else cal[0]


def confidence_bias_of(proposer) -> torch.Tensor | None:
    """The per-position calibration shifts ``[B]`` float32 (the second half of ``confidence_calibration()``,
    found as :func:`confidence_temperature_of` finds the temperatures), or None (every b_k = 0)."""
    cal = _confidence_calibration(proposer)
    return None if cal is None else cal[1]


def survival_probabilities(confidence_logits: torch.Tensor, temperature: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Survival ``S_k = prod_{i<=k} sigmoid(z_i / T_i + b_i)`` of drafts 1..n (DSpark, ALGORITHMS.md: the
    calibrated conditional confidence of slot i is ``sigmoid(z_i / T_i + b_i)``, the probability that draft
    i is accepted given drafts 1..i-1 were; their running product is the probability that drafts 1..k all
    are). ``T`` is the per-position temperature of STS, ``b`` the per-position shift of Platt scaling
    (:mod:`speculators.calibration`).

    Args:
        confidence_logits: ``[n]`` raw (pre-sigmoid) confidence logits ``z`` of a proposal's drafts.
        temperature: ``[>= n]`` per-position temperatures ``T`` (> 0), or None (all 1).
        bias: ``[>= n]`` per-position shifts ``b`` (finite), or None (all 0).
    Returns:
        ``[n]`` float32 on the CPU, non-increasing, in [0, 1].
    Raises:
        SpeculatorsError: ``temperature`` / ``bias`` shorter than ``n``, a temperature not positive or a
            shift not finite.
    """
    z = confidence_logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    return torch.cumprod(torch.sigmoid(calibrated_confidence_logits(z, temperature, bias)), 0)


class ConfidenceGate:
    """Which prefix of each proposal the target verifies (DSpark's confidence-gated verification).

    The rule reads only the proposal (its drafts' confidence logits) and the proposer's calibration
    (temperatures and shifts), never the target or the verifier's randomness, and whether draft k is kept
    depends only on ``S_1..S_k``, which (by the contract of ``Proposal.confidence_logits``) read only
    drafts ``< k``. Dropping draft k is then the proposer stopping before drafting it, and speculative sampling stays lossless
    (Leviathan et al. 2023). A draft kept or dropped because of its OWN sampled value, or a rule that looks at
    the verifier's outcome, can bias the output (tests/decode/test_gating.py shows the latter). Proposals
    without ``confidence_logits`` (n-gram, suffix, families without a confidence head) are untouched.

    * threshold mode: keep drafts 1..m, where m is the number of leading drafts whose survival
      ``S_k = prod_{i<=k} c_i`` (:func:`survival_probabilities`) is ``>= threshold``; the first draft
      whose survival falls below it, and everything after it, is dropped (m may be 0);
    * cost-aware mode (``verify_cost`` given): with ``value(m) = (1 + sum_{k<=m} S_k) / verify_cost[m]``
      (expected emitted tokens per unit of verify cost), keep extending the prefix while it raises the
      value: m is the first ``m <= m_thr`` with ``value(m + 1) <= value(m)`` (``m_thr`` = the threshold's
      m, or every draft without a threshold), where ``verify_cost[m]`` is the measured time of a target
      forward over ``m + 1`` tokens (:func:`speculators.evaluation.forward_cost.measure_verify_cost` at batch 1; an eval
      passes the batch-1 list of the forward costs it measures once for its report's cost model,
      :func:`speculators.evaluation.costs.gate_cost`; the last entry is used beyond the measured lengths). The rule is a stopping time: whether draft k is kept depends only on
      ``S_1..S_k``, i.e. on drafts ``< k`` (``S_k`` reads draft k-1, never draft k). A global argmax over
      all m would not be: keeping draft k would then depend on ``S_{k+1}``, which reads draft k itself,
      and keeping a sampled draft because of its own value biases the output at temperature > 0
      (tests/decode/test_gating.py). With the usual non-increasing survival and convex costs the two agree. Drafting cost
      is spent before the choice and does not enter it; in a batch each request chooses alone (the
      padded forward's cost depends on the longest request, which this per-request model ignores).

    Args:
        threshold: survival threshold in (0, 1), or None (cost-aware mode only).
        verify_cost: ``[K+1]`` positive seconds (or any unit) of target forwards over 1..K+1 tokens, or None.
    Raises:
        SpeculatorsError: neither given, a threshold outside (0, 1), or a non-positive / empty cost list.
    """

    def __init__(self, threshold: float | None = None, verify_cost: list[float] | None = None):
        self.threshold = check_confidence_threshold(threshold)
        if verify_cost is not None:
            cost = [float(c) for c in verify_cost]
            if not cost or not all(c > 0 and c == c and c != float("inf") for c in cost):
                raise SpeculatorsError(f"verify_cost: expected one positive finite time per verified length "
                                       f"(1..K+1 tokens), got {verify_cost!r}")
            verify_cost = cost
        if self.threshold is None and verify_cost is None:
            raise SpeculatorsError("ConfidenceGate: give a confidence threshold, a verify_cost model, or both")
        self.verify_cost = verify_cost

    def keep_length(self, survival: torch.Tensor) -> int:
        """How many leading drafts to verify, from their survival probabilities ``[n]`` (see the class)."""
        s = survival.reshape(-1).tolist()
        m = len(s)
        if self.threshold is not None:
            m = next((k for k, v in enumerate(s) if v < self.threshold), len(s))
        if self.verify_cost is None:
            return m
        cost = self.verify_cost
        # a stopping time (see the class): draft j is kept only if value(j) > value(j - 1), which reads
        # S_1..S_j, i.e. drafts < j; a global argmax would let draft j's own value decide whether it is kept
        expected = 1.0
        value = expected / cost[0]
        for j in range(1, m + 1):
            expected += s[j - 1]
            nxt = expected / cost[min(j, len(cost) - 1)]
            if nxt <= value:
                return j - 1
            value = nxt
        return m

    def keep(self, proposer, proposals: list) -> list[int | None]:
        """Per proposal, the number of leading drafts to verify, or None to leave it as it is (no
        proposal, no drafts, or no ``confidence_logits``).

        Raises:
            SpeculatorsError: ``confidence_logits`` whose length differs from the drafts'.
        """
        temperature, bias = confidence_temperature_of(proposer), confidence_bias_of(proposer)
        out: list[int | None] = []
        for j, p in enumerate(proposals):
            z = None if p is None else p.confidence_logits
            n = 0 if p is None else int(p.token_ids.numel())
            if z is None or n == 0:
                out.append(None)
                continue
            if int(z.numel()) != n:
                raise SpeculatorsError(f"proposal {j}: confidence_logits has {int(z.numel())} entries for {n} drafts "
                                       "(one raw confidence logit per draft)")
            out.append(self.keep_length(survival_probabilities(z, temperature, bias)))
        return out


def truncate_proposal(p: Proposal, m: int) -> Proposal:
    """The first ``m`` drafts of ``p`` (ids, probabilities and confidence logits alike)."""
    return dataclasses.replace(p, token_ids=p.token_ids.reshape(-1)[:m],
                               probs=None if p.probs is None else p.probs[:m],
                               confidence_logits=None if p.confidence_logits is None else p.confidence_logits[:m])


def resolve_gate(gate, confidence_threshold):
    """The run's gate: ``gate`` (any object with ``keep(proposer, proposals)``), or a threshold
    :class:`ConfidenceGate`, or None.

    Raises:
        SpeculatorsError: both given, a threshold outside (0, 1), or a ``gate`` without ``keep``.
    """
    threshold = check_confidence_threshold(confidence_threshold)
    if gate is not None and threshold is not None:
        raise SpeculatorsError("confidence_threshold and gate: give one of them (a ConfidenceGate carries its "
                               "own threshold)")
    if gate is not None and not callable(getattr(gate, "keep", None)):
        raise SpeculatorsError(f"gate: expected a ConfidenceGate (an object with keep(proposer, proposals)), got "
                               f"{type(gate).__name__}")
    return ConfidenceGate(threshold) if threshold is not None else gate
