"""Acceptance statistics of real speculative generation: the counts of every verification step of one
proposer over many prompts (:class:`AcceptanceStats`: tau, acceptance rate, per-position and conditional
acceptance, tokens/s) and tau's bootstrap confidence interval over prompts (:func:`bootstrap_tau_ci`).
ALGORITHMS.md, "Acceptance metrics", defines each; :mod:`speculators.evaluation.runner` builds the report from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpeculatorsError


@dataclass
class AcceptanceStats:
    """Accumulates the verification steps of one proposer over many prompts.

    Definitions (per step, from :class:`speculators.decode.state.GenerationResult`): ``drafted`` = drafts
    the target verified; ``accepted`` = drafts the rejection sampler accepted (the step's
    ``GenerationResult.verifier_accepted``); ``emitted`` = tokens the step appended to the output, cut
    at the first stop token and at ``max_new_tokens`` (accepted drafts and the recovered/bonus token up
    to the cut); ``accepted_emitted`` = accepted drafts that were also emitted =
    ``min(accepted, emitted)`` (the step's ``GenerationResult.accepted``).

    The counts are self-consistent: ``acceptance_rate == accepted / drafted`` and
    ``tau == emitted / steps``. Two views, chosen per metric:

    * what the VERIFIER SAW (the drafter's agreement with the target): ``accepted``,
      ``acceptance_rate = accepted / drafted``, per-position ``acc_k`` and conditional ``acc_k``.
      Drafts verified after a stop token ended the request are counted as drafted, and as accepted
      when the verifier accepted them: they were verified, so counting them in the denominator only
      (as misses) would make the rate depend on where requests happen to end. In this view
      ``acceptance_rate == sum(pos_accepted) / sum(pos_drafted)``.
    * what was EMITTED (what a user gets): ``tau = emitted / steps`` (mean acceptance length, bonus
      included), ``accepted_emitted``, ``tokens`` and ``tokens_per_s``. Tokens after a stop token
      accepted inside a draft block are never counted here.

    ``steps`` are target forwards after the prefill; the prefill's first token is in ``tokens`` but in
    no step (``tokens == steps' emitted + 1`` per request that generated anything).

    Attributes:
        k: max drafts per step (num_speculative_tokens); no step may draft more.
        steps: number of verification steps.
        emitted: tokens emitted by those steps.
        drafted: drafts verified.
        accepted: drafts the verifier accepted (emitted or not); ``accepted / drafted`` is the
            acceptance rate. (``verifier_accepted`` is a read-only alias.)
        accepted_emitted: accepted drafts that were emitted (``<= accepted``; smaller only when a
            stop token or ``max_new_tokens`` cut a step inside its accepted drafts).
        tokens: generated tokens (prefill token and stop tokens included), seconds: wall time.
        pos_drafted[i]: steps that drafted >= i+1 tokens.
        pos_accepted[i]: steps whose verifier accepted >= i+1 drafts.
        pos_reached[i]: steps that drafted >= i+1 tokens and accepted drafts 1..i (draft i+1 was judged).
        proposed: drafts the proposer returned before confidence gating (``GenerationResult.proposed``;
            ``== drafted`` without a gate). ``proposed / steps`` is the report's ``drafted_per_step``,
            ``drafted / steps`` its ``verified_per_step``.
    """

    k: int
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_emitted: int = 0
    tokens: int = 0
    seconds: float = 0.0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    pos_reached: list[int] = field(default_factory=list)
    proposed: int = 0

    def __post_init__(self):
        self.pos_drafted = self.pos_drafted or [0] * self.k
        self.pos_accepted = self.pos_accepted or [0] * self.k
        self.pos_reached = self.pos_reached or [0] * self.k

    def add(self, result) -> None:
        """Add the steps and tokens of one :class:`speculators.decode.state.GenerationResult`.

        The result's ``verifier_accepted`` list is added to :attr:`accepted`, its ``accepted`` list
        (accepted and emitted) to :attr:`accepted_emitted`.

        Raises:
            SpeculatorsError: the result's per-step lists differ in length, or a step is inconsistent
                (``0 <= verifier_accepted <= drafted <= k``, ``1 <= emitted <= verifier_accepted + 1``,
                ``accepted == min(verifier_accepted, emitted)``).
        """
        lists = {"accepted": result.accepted, "drafted": result.drafted, "emitted": result.emitted,
                 "verifier_accepted": result.verifier_accepted}
        if len({len(v) for v in lists.values()}) != 1:
            raise SpeculatorsError("GenerationResult: the per-step lists must have one entry per step, got "
                                   + ", ".join(f"{n}: {len(v)}" for n, v in lists.items()))
        steps = list(zip(result.accepted, result.drafted, result.emitted, result.verifier_accepted))
        for i, (a, n, e, va) in enumerate(steps):
            if not (0 <= va <= n <= self.k and 1 <= e <= va + 1 and a == min(va, e)):
                raise SpeculatorsError(
                    f"GenerationResult step {i}: accepted={a}, drafted={n}, emitted={e}, verifier_accepted={va} "
                    f"is not a verification step with k={self.k} (allowed: 0 <= verifier_accepted <= drafted "
                    f"<= k, 1 <= emitted <= verifier_accepted + 1, accepted == min(verifier_accepted, emitted))")
        self.tokens += len(result.tokens)
        self.seconds += result.seconds
        proposed = list(getattr(result, "proposed", None) or [])
        self.proposed += sum(proposed) if len(proposed) == len(steps) else sum(result.drafted)
        for a, n, e, va in steps:
            self.steps += 1
            self.emitted += e
            self.drafted += n
            self.accepted += va
            self.accepted_emitted += a
            for i in range(n):
                self.pos_drafted[i] += 1
                if va >= i:  # drafts 1..i all accepted and draft i+1 proposed: it was judged
                    self.pos_reached[i] += 1
            for i in range(va):
                self.pos_accepted[i] += 1

    @property
    def verifier_accepted(self) -> int:
        """Alias of :attr:`accepted` (drafts the verifier accepted, emitted or not)."""
        return self.accepted

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (bonus included; 1.0 when there is no step)."""
        return self.emitted / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float | None:
        """``accepted / drafted`` (the verifier's view; None (n/a) when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def per_position(self) -> list[float | None]:
        """``acc_k``: fraction of steps that drafted >= k tokens in which the verifier accepted draft k
        (None where no step drafted k tokens)."""
        return [a / d if d else None for a, d in zip(self.pos_accepted, self.pos_drafted)]

    @property
    def conditional(self) -> list[float | None]:
        """P(draft k accepted | draft k proposed and drafts 1..k-1 accepted), the verifier's view (None
        where no step reached draft k)."""
        return [a / r if r else None for a, r in zip(self.pos_accepted, self.pos_reached)]

    @property
    def tokens_per_s(self) -> float | None:
        """Generated (emitted) tokens per second of wall time, prefill included (None without time)."""
        return self.tokens / self.seconds if self.seconds else None

    def as_dict(self) -> dict:
        """The report block of this proposer (JSON-serialisable).

        Keys: ``tau`` (= ``emitted / steps``), ``acceptance_rate`` (= ``accepted / drafted``),
        ``per_position``, ``conditional`` (lists of ``k`` floats), ``steps``, ``emitted``, ``drafted``,
        ``accepted`` (verifier-accepted drafts), ``accepted_emitted`` (accepted drafts that were emitted),
        ``tokens``, ``seconds`` (wall time, s), ``tokens_per_s``, ``proposed`` (drafts before confidence
        gating), ``drafted_per_step`` (= ``proposed / steps``) and ``verified_per_step`` (= ``drafted /
        steps``: drafts the target verified; smaller than ``drafted_per_step`` only under a gate). (Reports written before
        ``accepted_emitted`` existed used ``accepted`` for accepted-and-emitted drafts and
        ``verifier_accepted`` for the verifier's count.)
        """
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position,
                "conditional": self.conditional, "steps": self.steps, "emitted": self.emitted,
                "drafted": self.drafted, "accepted": self.accepted, "accepted_emitted": self.accepted_emitted,
                "tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "proposed": self.proposed, "drafted_per_step": self.proposed / self.steps if self.steps else None,
                "verified_per_step": self.drafted / self.steps if self.steps else None}


def bootstrap_tau_ci(emitted: list[int], steps: list[int], resamples: int = 1000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of tau over prompts (Efron & Tibshirani, 1993, ch. 13).

    Resample the prompts with replacement ``resamples`` times (``numpy.random.default_rng(seed)
    .integers(0, n, size=(resamples, n))``); the tau of a resample is its emitted tokens / its steps
    (1.0 for a resample without steps, as :attr:`AcceptanceStats.tau`); the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's linear interpolation).

    Args:
        emitted, steps: per prompt, tokens emitted by its verification steps and its number of steps.
        resamples: >= 1. seed: the resampling RNG's seed (fixed: the same report gives the same CI).
        level: in (0, 1).
    Returns:
        ``(low, high)`` floats; ``(1.0, 1.0)`` without prompts.
    Raises:
        SpeculatorsError: lists of different lengths, ``resamples`` < 1 or ``level`` outside (0, 1).
    """
    import numpy as np

    if len(emitted) != len(steps):
        raise SpeculatorsError(f"bootstrap_tau_ci: {len(emitted)} emitted counts for {len(steps)} step counts")
    if int(resamples) < 1 or not 0.0 < float(level) < 1.0:
        raise SpeculatorsError(f"bootstrap_tau_ci: resamples must be >= 1 and level in (0, 1), got "
                               f"{resamples}, {level}")
    n = len(emitted)
    if n == 0:
        return 1.0, 1.0
    e, s = np.asarray(emitted, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, n, size=(int(resamples), n))
    se, ss = e[idx].sum(axis=1), s[idx].sum(axis=1)
    taus = np.where(ss > 0, se / np.maximum(ss, 1.0), 1.0)
    lo, hi = np.quantile(taus, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)
