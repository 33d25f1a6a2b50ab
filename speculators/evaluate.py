"""Acceptance statistics and reports from real speculative generation.

The prompts are decoded through the batched loop (:func:`speculators.generate.speculative_generate`)
at batch size 1 and at the chosen batch size: plainly (once per batch size), then for every K of the
sweep with the drafter, the n-gram (prompt lookup) proposer, suffix decoding and the hybrid proposer
(:mod:`speculators.proposers`). Reported (ALGORITHMS.md, "Acceptance metrics"): tau (mean
acceptance length, bonus included), acceptance rate (verifier-accepted / drafted, with ``accepted`` and
``accepted_emitted`` counts beside it), per-position acceptance
``acc_k = P(draft k accepted)``, conditional per-position acceptance, tokens/s of each method and the
speedup over plain decoding at the same batch size, tau's 95% bootstrap confidence interval over
prompts, drafting and verifying time per decoding step (ms), tau per prompt source (``by_source``),
with a confidence threshold the drafter's confidence-gated rows beside its ungated ones (drafted and
verified drafts per step), and at temperature 0 every prompt whose output differs from plain greedy
decoding (must be none: lossless). :func:`write_report` writes ``report.json``, ``report.md`` and two PNG plots.

Every decode stops at the first stop token (the target's stop ids: tokenizer EOS, ``generation_config``
EOS ids, chat-template end-of-turn) and at ``max_new_tokens``; tau, tokens and tokens/s count only the
tokens that were emitted, never tokens a step verified after the stop (see :class:`AcceptanceStats`
for every definition).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpeculatorsError
from .utils import atomic_dir


@dataclass
class AcceptanceStats:
    """Accumulates the verification steps of one proposer over many prompts.

    Definitions (per step, from :class:`speculators.generate.GenerationResult`): ``drafted`` = drafts
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
        """Add the steps and tokens of one :class:`speculators.generate.GenerationResult`.

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
    def acceptance_rate(self) -> float:
        """``accepted / drafted`` (the verifier's view; 0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        """``acc_k``: fraction of steps that drafted >= k tokens in which the verifier accepted draft k."""
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    @property
    def conditional(self) -> list[float]:
        """P(draft k accepted | draft k proposed and drafts 1..k-1 accepted), the verifier's view."""
        return [a / r if r else 0.0 for a, r in zip(self.pos_accepted, self.pos_reached)]

    @property
    def tokens_per_s(self) -> float:
        """Generated (emitted) tokens per second of wall time, prefill included (0.0 without time)."""
        return self.tokens / self.seconds if self.seconds else 0.0

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
                "proposed": self.proposed, "drafted_per_step": self.proposed / self.steps if self.steps else 0.0,
                "verified_per_step": self.drafted / self.steps if self.steps else 0.0}


# the proposers a report can compare (report keys and table labels, in report order), and the default set
# (drafter_argmax joins drafter by itself at temperature > 0: run_eval)
METHODS = ("drafter", "drafter_argmax", "ngram", "suffix", "hybrid")
DEFAULT_METHODS = ("drafter", "ngram", "suffix", "hybrid")
METHOD_LABELS = {"drafter": "drafter", "drafter_argmax": "drafter, argmax drafts",
                 "ngram": "n-gram (prompt lookup)", "suffix": "suffix decoding",
                 "hybrid": "hybrid (suffix, else drafter)", "plain": "plain target"}

#: The vLLM ``--speculative-config`` setting under which each method's row holds at temperature > 0
#: (``draft_sample_method``: vLLM's default ``greedy`` drafts by argmax and verifies each draft as a
#: point mass; ``probabilistic`` samples drafts from the drafter and verifies them with its
#: probabilities). Model-free proposers draft ids only (point masses) under either setting.
ENGINE_SETTINGS = {"drafter": 'draft_sample_method: "probabilistic"',
                   "drafter_argmax": 'draft_sample_method: "greedy" (vLLM\'s default)',
                   "hybrid": 'draft_sample_method: "probabilistic" (drafter part)'}


def draft_sample_method(method: str, temperature: float) -> str | None:
    """vLLM's ``draft_sample_method`` that reproduces ``method``'s drafts at ``temperature``:
    ``"probabilistic"`` (drafts sampled from the drafter and verified against its distribution:
    ``drafter`` and the hybrid's drafter part), ``"greedy"`` (argmax drafts verified as point masses:
    ``drafter_argmax``), or None where the setting makes no difference (temperature 0, where every
    verification is greedy, and the model-free ``ngram`` / ``suffix``)."""
    if temperature == 0.0 or method not in ENGINE_SETTINGS:
        return None
    return "greedy" if method == "drafter_argmax" else "probabilistic"


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


def default_batch_size(device: str | None) -> int:
    """The eval's default ``--batch-size``: 16 on CUDA, 8 elsewhere (``device`` None = CUDA when present)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return 16 if str(device).startswith("cuda") else 8


def _as_k_list(k) -> list[int]:
    ks = [k] if isinstance(k, int) and not isinstance(k, bool) else list(k)
    if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
        raise SpeculatorsError(f"k: expected an integer >= 1 or a non-empty list of them, got {k!r}")
    return sorted(dict.fromkeys(ks))


def _generate(target, proposer, prompt_ids: list[list[int]], k: int, max_new_tokens: int, temperature: float,
              top_k: int, top_p: float, batch_size: int, stop: set[int], seed: int, progress=None, gate=None):
    """One decode pass of every prompt through the batched loop: the
    :class:`speculators.generate.BatchResult` (results in prompt order, wall seconds, drafting and
    verifying seconds, batched steps).

    Prompt ``i`` draws from its own generator seeded with ``seed + i`` (so its output does not depend
    on the batch it ran in); ``proposer=None`` is plain decoding through the same loop; ``gate``: a
    :class:`speculators.generate.ConfidenceGate` (confidence-gated verification) or None.
    """
    from .generate import speculative_generate
    from .verify import SamplingParams

    sampling = SamplingParams.uniform(len(prompt_ids), temperature, top_k, top_p)
    return speculative_generate(target, proposer, prompt_ids, k, max_new_tokens, sampling, batch_size,
                                eos_ids=stop, seeds=[seed + i for i in range(len(prompt_ids))], progress=progress,
                                gate=gate)


def _step_times(out) -> dict:
    """The drafting / verifying time of a pass (:class:`speculators.generate.BatchResult`): total seconds and
    milliseconds per decoding step, a step being one batched target forward (= one request's step at
    batch 1). ``draft_*`` is 0 for plain decoding."""
    steps = max(int(out.target_forwards), 1)
    return {"draft_seconds": out.draft_seconds, "verify_seconds": out.verify_seconds,
            "batched_steps": int(out.target_forwards), "draft_ms_per_step": 1000.0 * out.draft_seconds / steps,
            "verify_ms_per_step": 1000.0 * out.verify_seconds / steps}


def _source_blocks(prompts: list[dict], results: list, k: int, resamples: int, seed: int) -> dict[str, dict]:
    """Per prompt source (``prompt["source"]``; ``"prompts"`` when unlabelled), in order of first
    appearance: the :meth:`AcceptanceStats.as_dict` block of that source's prompts (``seconds`` and
    ``tokens_per_s`` left out: requests of a batch share their wall time) with ``tau_ci`` (bootstrap
    over that source's prompts) and ``num_prompts``."""
    groups: dict[str, list] = {}
    for p, r in zip(prompts, results):
        groups.setdefault(str(p.get("source") or "prompts"), []).append(r)
    out = {}
    for name, rs in groups.items():
        st = AcceptanceStats(k)
        for r in rs:
            st.add(r)
        block = {key: v for key, v in st.as_dict().items() if key not in ("seconds", "tokens_per_s")}
        block["tau_ci"] = list(bootstrap_tau_ci([sum(r.emitted) for r in rs], [len(r.emitted) for r in rs],
                                                resamples, seed))
        out[name] = {"num_prompts": len(rs), **block}
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_eval(target, drafter, prompts: list[dict], k, max_new_tokens: int, sampling=None, ngram_max: int = 3,
             seed: int = 0, log=print, progress=None, eos_ids: set[int] | None = None, *, batch_size: int = 1,
             methods=DEFAULT_METHODS, hybrid_min_match: int = 3, bootstrap_resamples: int = 1000,
             hybrid_drafter_k: int | None = None,
             confidence_threshold: float | None = None, verify_cost: list[float] | None = None) -> dict:
    """Decode every prompt plainly and with every proposer, for every K and batch size; return the report.

    For each batch size ``b`` in ``[1, batch_size]`` (continuous batching:
    :func:`speculators.generate.speculative_generate`), plain decoding runs ONCE (the baseline at that
    batch size), then every method of ``methods`` runs for every K of ``k``: ``drafter`` (the neural
    drafter), ``drafter_argmax`` (the same drafter under vLLM's default ``draft_sample_method: greedy``:
    argmax drafts verified as point masses, :class:`speculators.proposers.ArgmaxDrafts`; added
    automatically beside ``drafter`` at temperature > 0, where ``drafter``'s rows are vLLM's
    ``draft_sample_method: probabilistic``), ``ngram`` (:class:`speculators.generate.NGramProposer`, prompt lookup), ``suffix``
    (:class:`speculators.proposers.SuffixProposer`, suffix decoding) and ``hybrid``
    (:class:`speculators.proposers.HybridProposer`: the suffix draft where its match has at least
    ``hybrid_min_match`` tokens, the drafter elsewhere). Every decode of a prompt stops on the same stop
    ids (``eos_ids``, default the target's :func:`speculators.generate.resolve_stop_ids`) and at
    ``max_new_tokens``; every count is of emitted tokens (see :class:`AcceptanceStats`).

    Per row (method, K, batch size): :meth:`AcceptanceStats.as_dict` with ``seconds`` the wall time of
    the whole pass (so ``tokens_per_s`` is the throughput at that batch size), ``tau_ci`` (95%
    bootstrap CI over prompts, :func:`bootstrap_tau_ci` with ``seed``), ``speedup`` (tokens/s over
    plain decoding's at the SAME batch size), ``best_k`` (True on the K with the best speedup of
    that method and batch size), and the pass's time split (:class:`speculators.generate.BatchResult`):
    ``draft_seconds`` / ``verify_seconds`` (proposer ``propose`` + ``advance``; target forwards +
    rejection sampling), ``batched_steps`` (batched target forwards) and ``draft_ms_per_step`` /
    ``verify_ms_per_step`` (milliseconds per batched decoding step; plain rows have both, with
    drafting 0). Prompts may carry a ``"source"`` name (``speculators eval --prompts A --prompts B``,
    or the recipe's sources for the held-out split): ``by_source`` breaks the headline rows down by it.
    At temperature 0 every output is compared with plain greedy decoding at batch 1 (plain at
    ``batch_size`` included): ``greedy_mismatches`` lists each difference. Every row names the vLLM
    ``draft_sample_method`` it holds under (``draft_sample_method``: None where it makes no difference);
    at temperature > 0 ``serving_conventions`` (:func:`serving_conventions`) puts the drafter's two
    conventions side by side.

    Args:
        target: :class:`speculators.target.Target`. drafter: a batched proposer (a drafter family);
            None only when ``methods`` has neither ``drafter`` nor ``hybrid``.
        prompts: ``[{"id", "input_ids"}]`` rendered prompts, optionally with ``"source"`` (a name).
        k: max drafts per step, an int or a list of them (the K sweep; each >= 1).
        max_new_tokens: cap on generated tokens per prompt.
        sampling: :class:`speculators.verify.SamplingParams` of one request (``None`` = greedy); its
            temperature / top-k / top-p apply to every prompt; prompt ``i`` draws from a fresh
            generator seeded with ``seed + i`` in every pass.
        ngram_max: the n-gram proposer's longest n-gram. eos_ids: explicit stop ids.
        batch_size: the loaded batch size (>= 1; 1 = batch 1 only).
        methods: the subset of :data:`METHODS` to run, in that order.
        progress: ``progress(done, total)`` in prompts decoded over all passes.
    Returns:
        A JSON-serialisable report: ``num_prompts``, ``ks``, ``batch_size``, ``batch_sizes``,
        ``methods``, ``rows`` (one dict per method, K and batch size, with ``method``, ``k``,
        ``batch_size``), ``plain_rows`` (one per batch size), ``best_k`` (``{batch: {method: K}}``,
        string keys), sampling values, ``stop_token_ids``, ``greedy_mismatches`` (None when sampling)
        and the HEADLINE (the largest batch size and the drafter's best K there; the first method's
        when there is no drafter): ``k``, one block per method (``report["drafter"]`` ...),
        ``plain``, ``speedup`` (the drafter's) and ``<method>_speedup``; ``by_source``:
        ``{source: {method: {k, batch_size, num_prompts, tau, tau_ci, acceptance_rate, per_position,
        conditional, steps, emitted, drafted, accepted, accepted_emitted, tokens}}}`` at the headline
        batch size and K, sources in order of first appearance (one entry ``"prompts"`` when the
        prompts carry no ``source``).
    Raises:
        SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``; bad ``k``,
            ``batch_size``, ``methods``; no prompts; a drafter method without a drafter; a
            ``confidence_threshold`` outside (0, 1) or a bad ``verify_cost``.

    Confidence-gated verification (DSpark; ``confidence_threshold`` and/or ``verify_cost``, see
    :class:`speculators.generate.ConfidenceGate`): the drafter is decoded a second time for every K and
    batch size with the gate; those rows (same keys as ``rows``, plus ``gated: True``) go to
    ``report["gated_rows"]`` and ``report["gating"]`` holds ``{"threshold", "cost_aware", "verify_cost",
    "confidences" (whether the drafter reported any), "headline": {"ungated": row, "gated": row}}`` at the
    headline batch size and K. Gated outputs join the greedy losslessness check (``proposer:
    "drafter (gated)"``). Without them both keys are absent.
    """
    from .generate import NGramProposer, resolve_stop_ids
    from .losses import sampling_values
    from .proposers import ArgmaxDrafts, HybridProposer, SuffixProposer

    temperature, top_k, top_p = sampling_values(sampling)
    ks = _as_k_list(k)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SpeculatorsError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SpeculatorsError(f"methods: {bad or 'none given'}; allowed: {list(METHODS)}")
    if temperature > 0.0 and "drafter" in methods:  # both vLLM draft_sample_method conventions
        methods = (*methods, "drafter_argmax")
    methods = tuple(m for m in METHODS if m in methods)
    if drafter is None and ({"drafter", "drafter_argmax", "hybrid"} & set(methods)):
        raise SpeculatorsError("run_eval: the drafter and hybrid rows need a drafter")
    if not prompts:
        raise SpeculatorsError("run_eval: no prompts to decode")
    stop = resolve_stop_ids(target, eos_ids)
    ids = [list(p["input_ids"]) for p in prompts]
    n = len(ids)
    greedy = temperature == 0.0
    batch_sizes = sorted({1, batch_size})
    gate = None
    if (confidence_threshold is not None or verify_cost is not None) and "drafter" in methods:
        from .generate import ConfidenceGate

        gate = ConfidenceGate(confidence_threshold, verify_cost)
    elif confidence_threshold is not None:  # still refuse a bad value without a drafter row
        from .generate import check_confidence_threshold

        check_confidence_threshold(confidence_threshold)
    total = n * len(batch_sizes) * (1 + len(ks) * (len(methods) + (gate is not None)))
    done = [0]

    def pass_progress():
        base = done[0]
        return (lambda d, t: progress(base + d, total)) if progress else None

    def run(proposer, kk, b, gate=None):
        out = _generate(target, proposer, ids, kk, max_new_tokens, temperature, top_k, top_p, b, stop, seed,
                        progress=pass_progress(), gate=gate)
        done[0] += n
        if progress:
            progress(done[0], total)
        return out

    def make(method):
        if method == "drafter":
            return drafter
        if method == "drafter_argmax":
            return ArgmaxDrafts(drafter)
        if method == "ngram":
            return NGramProposer(max_n=ngram_max)
        if method == "suffix":
            return SuffixProposer()
        return HybridProposer(drafter, SuffixProposer(), min_match=hybrid_min_match, drafter_k=hybrid_drafter_k)

    # warm-up (discarded): the first decode of each kind pays one-off costs (allocator, kernel
    # compilation: the Triton sampling and verifier kernels at temperature > 0 on CUDA, the drafter's
    # first forward) that would otherwise be charged to the first measured pass (batch 1's plain
    # baseline, which every speedup divides by) or to a method's first row. Same sampling settings
    # as the measured passes, a few tokens of one prompt, plain and every method.
    for method in (None, *methods):
        _generate(target, None if method is None else make(method), ids[:1], 0 if method is None else max(ks),
                  min(4, max_new_tokens), temperature, top_k, top_p, 1, stop, seed)
    rows, plain_rows, mismatches, reference = [], [], [], None
    results_of: dict[tuple, list] = {}  # (method, K, batch) -> the pass's results (for the per-source table)
    for b in batch_sizes:
        out = run(None, 0, b)
        res, secs = out.results, out.seconds
        plain = AcceptanceStats(1)
        for r in res:
            plain.add(r)
        plain.seconds = secs
        plain_rows.append({"batch_size": b, "tau": plain.tau, "steps": plain.steps, "tokens": plain.tokens,
                           "seconds": secs, "tokens_per_s": plain.tokens_per_s, **_step_times(out)})
        if reference is None:
            reference = [r.tokens for r in res]  # plain greedy at batch 1: what every output must equal
        elif greedy:
            mismatches += [{"prompt": p["id"], "proposer": "plain", "k": 0, "batch_size": b,
                            "first_diff": _first_diff(r.tokens, ref)}
                           for p, r, ref in zip(prompts, res, reference) if r.tokens != ref]
        log(f"eval: batch {b}, plain decoding: {plain.tokens_per_s:.1f} tokens/s")
        for method in methods:
            for kk in ks:
                proposer = make(method)
                out = run(proposer, kk, b)
                res, secs = out.results, out.seconds
                st = AcceptanceStats(kk)
                for r in res:
                    st.add(r)
                st.seconds = secs
                row = {"method": method, "k": kk, "batch_size": b,
                       "draft_sample_method": draft_sample_method(method, temperature), **st.as_dict()}
                row["tau_ci"] = list(bootstrap_tau_ci([sum(r.emitted) for r in res], [len(r.emitted) for r in res],
                                                      bootstrap_resamples, seed))
                row["speedup"] = st.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
                row["best_k"] = False
                row.update(_step_times(out))
                results_of[(method, kk, b)] = res
                if method == "hybrid":
                    row["proposals"] = dict(proposer.counts)  # how many steps each part drafted
                rows.append(row)
                if greedy:
                    mismatches += [{"prompt": p["id"], "proposer": method, "k": kk, "batch_size": b,
                                    "first_diff": _first_diff(r.tokens, ref)}
                                   for p, r, ref in zip(prompts, res, reference) if r.tokens != ref]
                log(f"eval: batch {b}, {method} K={kk}: tau {st.tau:.3f}, {st.tokens_per_s:.1f} tokens/s "
                    f"({row['speedup']:.2f}x), drafting {row['draft_ms_per_step']:.2f} ms/step")
    best_k: dict[str, dict[str, int]] = {}
    for b in batch_sizes:
        for method in methods:
            cand = [r for r in rows if r["batch_size"] == b and r["method"] == method]
            best = max(cand, key=lambda r: (r["speedup"], -r["k"]))
            best["best_k"] = True
            best_k.setdefault(str(b), {})[method] = best["k"]
    head_b = batch_sizes[-1]
    head_k = best_k[str(head_b)][methods[0]]
    gated_rows, any_confidence = [], False
    for b in (batch_sizes if gate is not None else []):  # the drafter again, confidence-gated
        plain_tps = next(p for p in plain_rows if p["batch_size"] == b)["tokens_per_s"]
        for kk in ks:
            out = run(drafter, kk, b, gate)
            res = out.results
            st = AcceptanceStats(kk)
            for r in res:
                st.add(r)
            st.seconds = out.seconds
            any_confidence = any_confidence or st.proposed != st.drafted
            row = {"method": "drafter", "gated": True, "k": kk, "batch_size": b, **st.as_dict(),
                   "tau_ci": list(bootstrap_tau_ci([sum(r.emitted) for r in res], [len(r.emitted) for r in res],
                                                   bootstrap_resamples, seed)),
                   "speedup": st.tokens_per_s / plain_tps if plain_tps else 0.0, **_step_times(out)}
            gated_rows.append(row)
            if greedy:
                mismatches += [{"prompt": p["id"], "proposer": "drafter (gated)", "k": kk, "batch_size": b,
                                "first_diff": _first_diff(r.tokens, ref)}
                               for p, r, ref in zip(prompts, res, reference) if r.tokens != ref]
            log(f"eval: batch {b}, drafter K={kk} gated: tau {st.tau:.3f}, verified {row['verified_per_step']:.2f} "
                f"of {row['drafted_per_step']:.2f} drafts/step, {st.tokens_per_s:.1f} tokens/s ({row['speedup']:.2f}x)")
    report = {
        "num_prompts": n, "k": head_k, "ks": ks, "batch_size": batch_size, "batch_sizes": batch_sizes,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "seed": seed, "stop_token_ids": sorted(stop), "methods": list(methods), "hybrid_min_match": hybrid_min_match,
        "hybrid_drafter_k": hybrid_drafter_k,
        "bootstrap": {"resamples": bootstrap_resamples, "level": 0.95, "seed": seed, "over": "prompts"},
        "rows": rows, "plain_rows": plain_rows, "best_k": best_k,
        "headline": {"batch_size": head_b, "k": head_k},
        "plain": next(p for p in plain_rows if p["batch_size"] == head_b),
        "greedy_mismatches": mismatches if greedy else None,
    }
    for method in methods:
        row = next(r for r in rows if r["batch_size"] == head_b and r["k"] == head_k and r["method"] == method)
        report[method] = row
        report["speedup" if method == "drafter" else f"{method}_speedup"] = row["speedup"]
    if gate is not None:
        report["gated_rows"] = gated_rows
        report["gating"] = {
            "threshold": gate.threshold, "cost_aware": gate.verify_cost is not None, "verify_cost": gate.verify_cost,
            "confidences": any_confidence,
            "headline": {"ungated": next(r for r in rows if r["method"] == "drafter" and r["batch_size"] == head_b
                                         and r["k"] == head_k),
                         "gated": next(r for r in gated_rows if r["batch_size"] == head_b and r["k"] == head_k)}}
        if not report["gating"]["confidences"]:
            log("eval: the drafter's proposals carry no confidence logits (or every draft was confident): "
                "gating left every proposal as it was")
    if not greedy and {"drafter", "drafter_argmax"} <= set(methods):
        report["serving_conventions"] = serving_conventions(report)
    # tau per prompt source (the headline batch size and K), e.g. one entry per --prompts source
    report["by_source"] = {}
    for method in methods:
        blocks = _source_blocks(prompts, results_of[(method, head_k, head_b)], head_k, bootstrap_resamples, seed)
        for name, block in blocks.items():
            report["by_source"].setdefault(name, {})[method] = {"k": head_k, "batch_size": head_b, **block}
    return report


def serving_conventions(report: dict) -> dict:
    """The drafter under vLLM's two ``draft_sample_method`` settings at the report's temperature (> 0),
    at the headline batch size and K: ``{"temperature", "batch_size", "k", "rows": [{"method",
    "draft_sample_method", "engine_setting", "tau", "tau_ci", "acceptance_rate", "per_position",
    "tokens_per_s", "speedup"}]}``, vLLM's default (argmax drafts) first.

    Users read tau as what they will get when they serve the drafter; which of the two it is depends
    on this engine setting (:data:`ENGINE_SETTINGS`, :class:`speculators.proposers.ArgmaxDrafts`).

    Raises:
        SpeculatorsError: the report has no ``drafter`` and ``drafter_argmax`` rows at its headline.
    """
    head = report["headline"]
    rows = []
    for method in ("drafter_argmax", "drafter"):
        r = next((r for r in report["rows"] if r["method"] == method and r["batch_size"] == head["batch_size"]
                  and r["k"] == head["k"]), None)
        if r is None:
            raise SpeculatorsError(f"serving_conventions: the report has no {method} row at batch size "
                                   f"{head['batch_size']}, K={head['k']}")
        rows.append({"method": method, "draft_sample_method": draft_sample_method(method, report["temperature"]),
                     "engine_setting": ENGINE_SETTINGS[method],
                     **{f: r[f] for f in ("tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s",
                                          "speedup")}})
    return {"temperature": report["temperature"], "batch_size": head["batch_size"], "k": head["k"], "rows": rows}


def _serving_markdown(report: dict) -> list[str]:
    sc = report.get("serving_conventions")
    if not sc:
        return []
    lines = ["", f"## Serving conventions (temperature {sc['temperature']}, batch size {sc['batch_size']}, "
                 f"K={sc['k']})", "",
             "At temperature > 0 the tau a user gets from vLLM depends on its `draft_sample_method`: by default "
             "vLLM drafts by argmax and verifies each draft as a point mass; with `probabilistic` it samples the "
             "drafts and verifies them against the drafter's distribution. Both are lossless.", "",
             "| vLLM --speculative-config | tau [95% CI] | acceptance rate | tokens/s | speedup |",
             "|---|---|---|---|---|"]
    for r in sc["rows"]:
        lines.append(f"| `{r['engine_setting']}` | {_fmt_tau(r)} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return lines


PLOT_FILES = {"per_position": "per_position_acceptance.png", "tau_vs_k": "tau_vs_k.png"}


def _rows(report: dict, method: str | None = None, batch: int | None = None, k: int | None = None) -> list[dict]:
    return [r for r in report["rows"] if (method is None or r["method"] == method)
            and (batch is None or r["batch_size"] == batch) and (k is None or r["k"] == k)]


def _fmt_tau(r: dict) -> str:
    lo, hi = r.get("tau_ci") or (r["tau"], r["tau"])
    return f"{r['tau']:.3f} [{lo:.3f}, {hi:.3f}]"


def _fmt_ms(r: dict, what: str) -> str:
    v = r.get(f"{what}_ms_per_step")
    return "-" if v is None else f"{v:.2f}"


def _by_source_markdown(report: dict) -> list[str]:
    """The ``by_source`` table (a row per source and method), or nothing for fewer than two sources."""
    by = report.get("by_source") or {}
    if len(by) < 2:
        return []
    head = report["headline"]
    lines = ["", f"## By prompt source (batch size {head['batch_size']}, K={head['k']})", "",
             "| source | prompts | method | tau [95% CI] | acceptance rate | steps | tokens |",
             "|---|---|---|---|---|---|---|"]
    for name, per in by.items():
        for m in report["methods"]:
            r = per.get(m)
            if r is not None:
                lines.append(f"| {name} | {r['num_prompts']} | {METHOD_LABELS[m]} | {_fmt_tau(r)} | "
                             f"{r['acceptance_rate']:.3f} | {r['steps']} | {r['tokens']} |")
    return lines


def _gating_markdown(report: dict) -> list[str]:
    """The confidence-gating section (``report["gating"]``): ungated and gated drafter rows side by side
    (tau, drafted and verified drafts per step, acceptance rate, tokens/s, speedup), then per-position
    acceptance of both at the headline; nothing without gating."""
    g = report.get("gating")
    if not g:
        return []
    how = (f"survival threshold {g['threshold']}" if g["threshold"] is not None else "") + \
        (" + " if g["threshold"] is not None and g["cost_aware"] else "") + \
        ("cost-aware prefix (measured verify cost)" if g["cost_aware"] else "")
    lines = ["", f"## Confidence-gated verification ({how})", "",
             "The drafts after the first whose survival prod_{i<=k} c_i (calibrated confidences) falls below the "
             "threshold are not verified; the rule reads only the drafter's outputs, so the output distribution "
             "is unchanged. drafted/step = drafts proposed per step, verified/step = drafts the target verified.",
             "", "| drafter | batch | K | tau [95% CI] | drafted/step | verified/step | acceptance rate | tokens/s | "
             "speedup |", "|---|---|---|---|---|---|---|---|---|"]
    gated = {(r["batch_size"], r["k"]): r for r in report.get("gated_rows", [])}
    for b in report["batch_sizes"]:
        for r in sorted(_rows(report, "drafter", b), key=lambda r: r["k"]):
            for label, row in (("ungated", r), ("gated", gated.get((b, r["k"])))):
                if row is None:
                    continue
                lines.append(f"| {label} | {b} | {r['k']} | {_fmt_tau(row)} | {row.get('drafted_per_step', 0.0):.2f} | "
                             f"{row.get('verified_per_step', 0.0):.2f} | {row['acceptance_rate']:.3f} | "
                             f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |")
    if not g.get("confidences"):
        lines += ["", "The drafter reported no confidence logits (or every draft cleared the gate): nothing was cut."]
    h = g["headline"]
    k = len(h["ungated"]["per_position"])
    lines += ["", f"acc_k at batch size {h['gated']['batch_size']}, K={h['gated']['k']} (P(draft k accepted | "
              "draft k verified)):", "", "| | " + " | ".join(str(i + 1) for i in range(k)) + " |", "|---|" + "---|" * k]
    for label in ("ungated", "gated"):
        lines.append(f"| {label} | " + " | ".join(f"{x:.3f}" for x in h[label]["per_position"]) + " |")
    return lines


def report_markdown(report: dict, title: str = "speculators eval", plots: dict[str, str] | None = None) -> str:
    """The report of :func:`run_eval` as Markdown.

    Sections: one table per batch size (a row per method and K: tau with its 95% bootstrap CI,
    acceptance rate, tokens/s, speedup over plain decoding at that batch size, drafting and verifying
    ms per step; ★ marks each method's best K), the counts table of the headline rows (steps, drafted,
    accepted, accepted & emitted, emitted), the by-source table (``report["by_source"]``, when the
    prompts come from two sources or more), the confidence-gating section (``report["gating"]``: ungated
    and gated drafter rows, drafted / verified drafts per step, acc_k of both), per-position and conditional acceptance at batch 1 and the largest K, the plots
    (``plots``, default ``report["plots"]``: ``{"per_position" | "tau_vs_k": relative PNG path}``,
    embedded as images), the compare table (``report["compare"]``) and the greedy losslessness line.
    """
    plots = plots if plots is not None else report.get("plots")
    methods = report["methods"]
    ks = report["ks"]
    head = report["headline"]
    lines = [f"# {title}", "",
             f"{report['num_prompts']} prompts" + (f" ({report['prompts']})" if report.get("prompts") else "")
             + f", temperature {report['temperature']}, top_p {report['top_p']}, top_k {report['top_k']}, "
             f"max_new_tokens {report['max_new_tokens']}; K in {ks}; batch sizes {report['batch_sizes']}.", "",
             "tau = emitted tokens / verification steps (bonus included), with its 95% bootstrap confidence "
             f"interval over prompts ({report['bootstrap']['resamples']} resamples); acceptance rate = accepted / "
             "drafted (the verifier's view); speedup = tokens/s over plain decoding at the SAME batch size; "
             "★ = the K with the best speedup of that method and batch size; draft / verify ms/step = wall time "
             "of the proposer (propose + advance) / of the target forward and rejection sampling per batched "
             "decoding step.", ""]
    for b in report["batch_sizes"]:
        plain = next(p for p in report["plain_rows"] if p["batch_size"] == b)
        lines += [f"## Batch size {b}", "", "| method | K | tau [95% CI] | acceptance rate | tokens/s | speedup | "
                  "draft ms/step | verify ms/step |", "|---|---|---|---|---|---|---|---|"]
        for m in methods:
            for r in sorted(_rows(report, m, b), key=lambda r: r["k"]):
                lines.append(f"| {METHOD_LABELS[m]} | {r['k']}{' ★' if r.get('best_k') else ''} | {_fmt_tau(r)} | "
                             f"{r['acceptance_rate']:.3f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                             f"{_fmt_ms(r, 'draft')} | {_fmt_ms(r, 'verify')} |")
        lines += [f"| plain target | - | {plain.get('tau', 1.0):.3f} | - | {plain['tokens_per_s']:.1f} | 1.00x | "
                  f"- | {_fmt_ms(plain, 'verify')} |", ""]
    lines += [f"## Counts (batch size {head['batch_size']}, K={head['k']})", "",
              "accepted & emitted <= accepted (accepted drafts after a stop token or max_new_tokens are not emitted).",
              "", "| method | steps | drafted | accepted | accepted & emitted | emitted |", "|---|---|---|---|---|---|"]
    for m in methods:
        s = report[m]
        lines.append(f"| {m} | {s.get('steps', '-')} | {s.get('drafted', '-')} | {s.get('accepted', '-')} | "
                     f"{s.get('accepted_emitted', '-')} | {s.get('emitted', '-')} |")
    hy = report.get("hybrid")
    if hy is not None and hy.get("proposals"):
        c = hy["proposals"]
        lines += ["", f"hybrid: {c.get('suffix', 0)} drafts from the suffix tree (match >= "
                      f"{report.get('hybrid_min_match')} tokens), {c.get('drafter', 0)} from the drafter"
                      + (f" (at most {report['hybrid_drafter_k']} drafts per step)." if report.get("hybrid_drafter_k")
                         else ".")]
    lines += _serving_markdown(report)
    lines += _by_source_markdown(report)
    lines += _gating_markdown(report)
    kmax, b1 = max(ks), report["batch_sizes"][0]
    lines += ["", f"## Per-position acceptance (batch size {b1}, K={kmax})", "",
              "acc_k = P(draft k accepted | draft k proposed); cond acc_k = P(draft k accepted | drafts 1..k-1 "
              "accepted).", "", "| position | " + " | ".join(str(i + 1) for i in range(kmax)) + " |",
              "|---|" + "---|" * kmax]
    for m in methods:
        r = _rows(report, m, b1, kmax)[0]
        lines.append(f"| {m} acc_k | " + " | ".join(f"{x:.3f}" for x in r["per_position"]) + " |")
        lines.append(f"| {m} cond acc_k | " + " | ".join(f"{x:.3f}" for x in r["conditional"]) + " |")
    lines.append("")
    for key, alt in (("per_position", "per-position acceptance"), ("tau_vs_k", "tau and speedup vs K")):
        if plots and plots.get(key):
            lines += [f"![{alt}]({plots[key]})", ""]
    if report.get("compare"):
        lines += ["## Compare (same prompts and settings)", "", compare_markdown(report["compare"]["rows"])]
    mm = report.get("greedy_mismatches")
    if mm is not None:
        lines.append("Greedy losslessness: " + (
            "every proposer's output == plain greedy output on every prompt, at every K and batch size."
            if not mm else f"ERROR: {len(mm)} mismatches: {mm}"))
    return "\n".join(lines) + "\n"


def write_plots(report: dict, directory: str | Path) -> dict[str, str]:
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
        ax.bar([i + 1 + (j - (len(methods) - 1) / 2) * width for i in range(kmax)], r["per_position"], width,
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
            ax_sp.plot([r["k"] for r in rb], [r["speedup"] for r in rb], marker="o", color=f"C{j}",
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


def write_report(report: dict, output: str | Path, title: str = "speculators eval") -> Path:
    """Write ``report.json``, the two PNG plots (:func:`write_plots`) and ``report.md`` (embedding them
    with relative links) into ``output``, atomically replaced. Sets ``report["plots"]``."""
    with atomic_dir(output, overwrite=True) as tmp:
        if report.get("rows"):  # a report of run_eval (anything else has nothing to plot)
            report["plots"] = write_plots(report, tmp)
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
        (tmp / "report.md").write_text(report_markdown(report, title))
    return Path(output)


_DRAFTER_METHODS = ("drafter", "drafter_argmax", "hybrid")  # the rows that depend on the checkpoint


def compare_rows(reports: list[tuple[str, dict]]) -> list[dict]:
    """One row per checkpoint, batch size and K of the drafter (drafter_argmax, hybrid) rows of several reports on the
    same prompts, then the model-free baselines of the first report: ``{"checkpoint", "method", "batch_size",
    "k", "tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s", "speedup", "best_k",
    "draft_ms_per_step", "verify_ms_per_step"}`` (the last two None in reports written before they existed).

    Raises:
        SpeculatorsError: the reports were not made on the same prompts / settings (``num_prompts``,
            ``max_new_tokens``, sampling values differ).
    """
    keys = ("num_prompts", "max_new_tokens", "temperature", "top_p", "top_k", "prompts")
    first = reports[0][1]
    for label, rep in reports[1:]:
        diff = [k for k in keys if rep.get(k) != first.get(k)]
        if diff:
            raise SpeculatorsError(f"--compare: {label} was evaluated with other {', '.join(diff)} than "
                                   f"{reports[0][0]}; compare checkpoints on the same prompts and settings")
    out = []
    fields = ("method", "batch_size", "k", "tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s",
              "speedup", "best_k")
    for i, (label, rep) in enumerate(reports):
        for r in rep["rows"]:
            if r["method"] in _DRAFTER_METHODS or i == 0:
                out.append({"checkpoint": label if r["method"] in _DRAFTER_METHODS else "-",
                            **{f: r[f] for f in fields},
                            **{f: r.get(f) for f in ("draft_ms_per_step", "verify_ms_per_step")}})
    return out


def compare_markdown(rows: list[dict]) -> str:
    """The rows of :func:`compare_rows` as one Markdown table."""
    def ms(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["| checkpoint | method | batch | K | tau [95% CI] | acceptance rate | tokens/s | speedup | draft ms/step "
             "| verify ms/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {METHOD_LABELS[r['method']]} | {r['batch_size']} | "
                     f"{r['k']}{' ★' if r['best_k'] else ''} | {_fmt_tau(r)} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {ms(r.get('draft_ms_per_step'))} | "
                     f"{ms(r.get('verify_ms_per_step'))} |")
    return "\n".join(lines) + "\n"
