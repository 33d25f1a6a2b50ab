"""Generation: plain target decoding and batched speculative decoding with any proposer.

The loop follows what a serving engine does for a batch of requests (vLLM's spec-decode step with
continuous batching). :func:`speculative_generate` reads as its named steps (as gpt-fast's
``generate.py`` does):

1. ``_join``: requests join the batch: their prompts are prefilled in their own cache (one forward for
   all the requests joining at that step: :meth:`speculators.target.BatchDecodeSession.add_many`) and
   concatenated to the batch's; each first token is sampled from the prefill;
2. ``_draft``: each live request's proposer state drafts up to ``k_i`` tokens (ONE batched
   ``propose`` call, ragged: ``k_i`` may differ per request and may be 0); with a confidence gate
   (:class:`speculators.gating.ConfidenceGate`, DSpark) a proposal that carries confidence logits is
   cut to its confident prefix here, before the target sees it (the rule reads only the drafter's
   outputs: lossless);
3. ``_verify``: ONE target forward over every live request's ``[last token, d_1..d_{k_i}]``
   (right-padded, one KV cache) gives ``k_i + 1`` distributions (and target features) per request, and
   ONE call of the ragged rejection sampler (:func:`speculators.verify.rejection_sample`) accepts a
   prefix per request and emits a recovered or bonus token;
4. ``_keep``: per request, the step's tokens are emitted, the step is recorded (and told to the
   ``on_step`` outcome hook, as transformers' ``CandidateGenerator.update_candidate_strategy``), the
   target KV cache keeps only the accepted prefix, and the proposer is advanced with the accepted tokens
   and their target features (ONE batched ``advance`` call);
5. ``_retire``: finished requests leave the batch and waiting ones join at the next ``_join`` (at most
   ``batch_size`` live requests), so a long answer never holds the others back.

The step's tokens are emitted up to the first stop token (:func:`resolve_stop_ids`: the target's
tokenizer EOS, ``generation_config`` EOS ids and chat-template end-of-turn, or explicit ``eos_ids``)
and the request's ``max_new_tokens``; the request ends there, and :class:`GenerationResult` records per
step what was verified and what was emitted, so that the statistics count only emitted tokens.

Plain decoding is the same loop with zero drafts (``proposer=None``), so both paths share one sampling
code path: at temperature 0 the speculative output equals plain greedy decoding token for token.
Request ``i``'s randomness comes only from its own generator (``seeds[i]``), in the same order as a
batch-1 decode draws it (first token, then per step: its drafts, its accept tests, its recovered/bonus
token), so its output does not depend on the other requests in the batch. :func:`plain_decode` and
:func:`speculative_decode` are the batch-1 wrappers.

A proposer implements the batched :class:`speculators.proposal.Proposer` protocol:
``start(input_ids, features) -> state`` (one request), ``propose(states, ks, sampling, generators=None)
-> list[Proposal]`` and ``advance(states, new_ids, features)`` (every
:class:`speculators.drafters.Drafter`, and the proposers of :mod:`speculators.proposers`). ``sampling``
is the verifier's own :class:`speculators.verify.SamplingParams` for the B requests (per-request
temperature / top-k / top-p), so drafts and the verifier apply the same transform.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .decode_args import batch_params, check_prompts, per_request, request_params, select_rows
from .errors import SpeculatorsError
from .forward_cost import clock as _clock
from .forward_cost import measure_forward_cost, measure_verify_cost  # noqa: F401  (re-exported)
from .gating import (  # noqa: F401  (re-exported: their import paths from generate keep working)
    ConfidenceGate,
    check_confidence_threshold,
    confidence_bias_of,
    confidence_temperature_of,
    resolve_gate,
    survival_probabilities,
    truncate_proposal,
)
from .proposal import Proposal, Proposer, check_int, check_speculative_tokens  # noqa: F401  (Proposer re-exported)
from .tree_steps import advance_timed, tree_step
from .verify import SamplingParams, rejection_sample

_NO_DRAFTS = torch.empty(0, dtype=torch.int64)


@dataclass
class GenerationResult:
    """One decoded request, with what every verification step verified and what it emitted.

    A *step* is one target forward after the prefill (speculative: over the last token and the
    drafts; plain: over the last token). The first generated token comes from the prefill and belongs
    to no step, so ``len(tokens) == 1 + sum(emitted)`` whenever a token was generated.

    Attributes:
        tokens: generated token ids (prompt excluded; the stop token included when emitted). Generation
            ends at the first stop token or after ``max_new_tokens`` tokens, whichever comes first.
        accepted: per step, accepted drafts that were EMITTED: ``min(verifier_accepted, emitted)``.
        drafted: per step, drafts the proposer returned; all of them went through the target forward
            and the verifier (0 for plain decoding).
        emitted: per step, tokens the step appended to ``tokens``: ``verifier_accepted + 1`` (the
            accepted drafts and the recovered/bonus token), or fewer when a stop token or
            ``max_new_tokens`` cut the step (then nothing after the cut is emitted, neither drafts nor
            the recovered/bonus token). Always >= 1.
        verifier_accepted: per step, drafts the rejection sampler accepted (the verifier's view; it
            also counts accepted drafts after a stop token inside the step, which were not emitted).
        seconds: wall time of prefill + decode (in a batch: from the request's join to its end).
        target_forwards: number of target forwards (prefill excluded) == number of steps.
        tree_ranks: tree decoding only (``speculative_generate(tree=...)``), per step the rank of each
            accepted node among its siblings (0 = the drafter's best child), root to leaf; empty for chains.
        proposed: per step, drafts the proposer returned BEFORE confidence gating (``speculative_generate``'s
            ``confidence_threshold`` / ``gate``); equal to ``drafted`` without a gate (an empty list for a
            result built by hand).
        draft_seconds: wall time (s) of the proposer's ``propose`` and ``advance`` calls of the steps this
            request was live in (in a batch: the whole batched call, which this request waited for);
            0.0 for plain decoding. ``start`` (the drafter's prompt prefill) is not in it, as the
            target's prefill is not in ``verify_seconds``.
        verify_seconds: wall time (s) of those steps' target forwards over ``[last token, drafts]`` and
            their rejection sampling. ``draft_seconds + verify_seconds <= seconds``; the rest is the
            prefills and the loop's bookkeeping.
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    target_forwards: int = 0
    emitted: list[int] = field(default_factory=list)
    verifier_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposed: list[int] = field(default_factory=list)
    tree_ranks: list[list[int]] = field(default_factory=list)

    def add_step(self, drafted: int, verifier_accepted: int, emitted: int) -> None:
        """Record one verification step (see the attributes for the definitions)."""
        self.drafted.append(int(drafted))
        self.verifier_accepted.append(int(verifier_accepted))
        self.emitted.append(int(emitted))
        self.accepted.append(min(int(verifier_accepted), int(emitted)))
        self.target_forwards += 1


@dataclass
class BatchResult:
    """The outcome of :func:`speculative_generate`.

    Attributes:
        results: one :class:`GenerationResult` per prompt, in prompt order.
        seconds: wall time of the whole run (all prefills and steps), in seconds.
        target_forwards: batched target forwards of the decode steps (prefills excluded); each covers
            every request live at that step.
        draft_seconds: wall time (s) of all batched ``propose`` / ``advance`` calls (drafter work; 0.0
            for plain decoding). ``draft_seconds / target_forwards`` is the drafting time per step.
        verify_seconds: wall time (s) of all decode steps' target forwards and rejection sampling.
            ``draft_seconds + verify_seconds <= seconds``. Measured with ``time.perf_counter``, after a
            ``torch.cuda.synchronize`` when the target is on CUDA (asynchronous kernels are charged to
            the phase that launched them).
        prefill_seconds: wall time (s) of the joins: the target's prompt prefills, the first tokens' sampling
            and the proposer's ``start`` (neither drafting nor verifying).
        forward_seconds: the part of ``verify_seconds`` spent in the target forwards alone (the rest is
            rejection sampling): ``seconds - prefill_seconds - forward_seconds - draft_seconds`` is the
            loop's per-step overhead (sampling, bookkeeping) that :mod:`speculators.cost_model` measures.
        cache_width: the mean over the decode steps' batched forwards of the batch session's cache width
            (slots, read after each forward: the slots it attended over, padding of shorter rows and
            rolled-back drafts included); None when none was read. The cost model charges the forward at it.
    """

    results: list[GenerationResult]
    seconds: float = 0.0
    target_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0
    cache_width: float | None = None

    @property
    def tokens(self) -> int:
        """Generated tokens over all requests."""
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        """Throughput: generated tokens over all requests / wall time (0.0 when no time was measured)."""
        return self.tokens / self.seconds if self.seconds else 0.0


def _emit_until(out: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
    """Append ``new`` to ``out`` up to ``max_new`` tokens or the first stop token (included); True when
    finished. The caller measures what was appended as the change of ``len(out)``."""
    for t in new:
        if len(out) >= max_new:
            return True
        out.append(t)
        if t in eos or len(out) >= max_new:
            return True
    return False


def _propose_batch(proposer, states: list, ks: list[int], sampling: SamplingParams,
                   gens: list) -> list[Proposal]:
    """The proposer's batched ``propose``, checked to give one Proposal per request."""
    props = proposer.propose(states, ks, sampling, gens)
    if not isinstance(props, (list, tuple)) or len(props) != len(states):
        raise SpeculatorsError(f"proposer {type(proposer).__name__}: propose must return one Proposal per "
                               f"request ({len(states)}), got {type(props).__name__}"
                               + (f" of {len(props)}" if isinstance(props, (list, tuple)) else ""))
    return list(props)


def _draft_probs(props: list, drafts: list[torch.Tensor], vocab: int, device) -> torch.Tensor | None:
    """The ``[sum n_i, V]`` float32 draft distributions of a step (point masses as one-hot rows for
    proposals without probabilities: the verifier treats both alike), or None when no proposal has any."""
    if not any(p is not None and p.probs is not None and d.numel() for p, d in zip(props, drafts)):
        return None
    rows = []
    for j, (p, d) in enumerate(zip(props, drafts)):
        n = int(d.numel())
        if n == 0:
            continue
        if p.probs is None:
            rows.append(torch.nn.functional.one_hot(d, vocab).to(device=device, dtype=torch.float32))
        else:
            if tuple(p.probs.shape) != (n, vocab):
                raise SpeculatorsError(f"proposal {j}: probs has shape {tuple(p.probs.shape)}, expected "
                                       f"({n}, {vocab}) (one target-vocabulary distribution per draft)")
            rows.append(p.probs.to(device=device, dtype=torch.float32))
    return torch.cat(rows)


@torch.no_grad()
def speculative_generate(target, proposer, prompts: list[list[int]], k: int | list[int],
                         max_new_tokens: int | list[int], sampling: SamplingParams | None = None,
                         batch_size: int = 8, eos_ids: set[int] | None = None,
                         seeds: list[int | None] | None = None,
                         progress: Callable[[int, int], Any] | None = None,
                         confidence_threshold: float | None = None, gate: ConfidenceGate | None = None,
                         on_step: Callable[[int, Any, int, list[int]], Any] | None = None,
                         tree=None) -> BatchResult:
    """Batched speculative (or plain) decoding of many prompts with continuous batching.

    At most ``batch_size`` requests are live; a finished request leaves the batch and the next waiting
    prompts join (prefilled in their own cache, in one forward for all joining at that step, then added
    to the batch's KV cache: :meth:`speculators.target.Target.batch_session`). Every step runs ONE
    batched ``propose`` (request i drafts up to ``min(k_i, max_new_i - generated_i - 1)`` tokens, so the
    cap never verifies drafts that could not be emitted), ONE target forward over every live request's
    ``[last token, drafts]``, ONE :func:`speculators.verify.rejection_sample` over the ragged batch
    (lossless: each request's output has the target's distribution under its own sampling settings; at
    temperature 0 it equals plain greedy decoding token for token), then per request keeps the accepted
    prefix in the target's KV cache and advances the proposer (ONE batched ``advance``). Each request's
    :class:`GenerationResult` records ``drafted`` / ``verifier_accepted`` / ``emitted`` per step exactly
    as :func:`speculative_decode` does.

    Request i's randomness (its first token, drafts, accept tests and recovered/bonus tokens) comes
    only from its own generator, drawn in the batch-1 order, so with ``seeds`` its tokens do not
    depend on the batch size or on the other requests (up to floating-point ties of the batched
    forward). Device: the target's (``target.device``); the drafter must already live there; the
    verifier picks Triton on CUDA (``impl="auto"``).

    Args:
        target: :class:`speculators.target.Target` (needs ``batch_session``).
        proposer: a :class:`speculators.proposal.Proposer` (drafter,
            :class:`speculators.proposers.NGramProposer`, ...), or ``None`` for plain
            decoding through the same loop (0 drafts every step: the baseline at the same batch size).
        prompts: ``B`` prompts, each a non-empty list of token ids in ``[0, V)``.
        k: max drafts per step (``num_speculative_tokens``, >= 0), one for all or one per prompt.
        max_new_tokens: cap on generated tokens (>= 1), one for all or one per prompt.
        sampling: :class:`speculators.verify.SamplingParams` for the ``B`` prompts (per-request
            temperature / top-k / top-p; temperature 0 = greedy); ``None`` = all greedy.
        batch_size: most live requests at a time (>= 1).
        eos_ids: stop token ids for every request; ``None`` = :func:`resolve_stop_ids` of the target.
        seeds: per prompt, a seed for its own fresh ``torch.Generator`` (on the target's device) or
            None (then ``sampling.generators[i]``, else torch's global RNG).
        progress: called as ``progress(done, B)`` each time a request finishes.
        confidence_threshold: confidence-gated verification (DSpark, :class:`speculators.gating.ConfidenceGate`): after each
            ``propose``, a proposal with ``confidence_logits`` keeps only the drafts before the first one
            whose survival ``prod_{i<=k} c_i`` is below this value in (0, 1); the dropped drafts are never
            verified and the proposer is advanced only with what was accepted of the kept ones. None = no
            gating. Lossless (the rule never sees the target).
        gate: instead of ``confidence_threshold``, a :class:`ConfidenceGate` (e.g. its cost-aware mode) or any
            object with ``keep(proposer, proposals) -> list[int | None]`` (drafts to keep per proposal).
        on_step: the outcome hook (transformers' ``CandidateGenerator.update_candidate_strategy``), called
            once per request per verification step, in the step's request order, as
            ``on_step(request, proposal, num_accepted, emitted)``: ``request`` the prompt's index in
            ``prompts``; ``proposal`` the :class:`Proposal` the target verified (after gating; an empty one
            when nothing was drafted); ``num_accepted`` the drafts the rejection sampler accepted
            (``GenerationResult.verifier_accepted`` of the step); ``emitted`` the token ids the step
            appended to the request's output (a stop token or ``max_new_tokens`` may cut it). Its return
            value is ignored. None = no hook. With ``tree`` the proposal is the verified
            :class:`speculators.verify.tree.DraftTree`.
        tree: a :class:`speculators.tree_spec.TreeSpec`: draft TREES instead of chains
            (:mod:`speculators.tree_steps`: EAGLE-2 dynamic or vLLM static trees, verified in one target forward
            with a tree attention mask and multi-candidate rejection sampling); ``k`` is then unused (the
            tree's ``depth`` bounds a step). None = chains.
    Returns:
        :class:`BatchResult` (results in prompt order, the run's wall time, batched forwards, and the
        wall time spent drafting and verifying).
    Raises:
        SpeculatorsError: bad ``prompts`` / ``k`` / ``max_new_tokens`` / ``batch_size`` / ``eos_ids`` /
            ``seeds`` / ``sampling`` / ``confidence_threshold`` (outside (0, 1)) / ``gate`` / ``on_step`` (naming the
            argument), a gate whose ``keep`` gives a count outside ``[0, drafts]``, a ``k`` above what the proposer's drafter can
            draft per step (its ``max_speculative_tokens``: P-EAGLE's ``num_depths``, DFlash's
            ``block_size - 1``; checked before decoding), or a proposer that returned more drafts than
            asked for, draft ids outside the vocabulary, or ``probs`` of the wrong shape.
    """
    run = _setup(target, proposer, prompts, k, max_new_tokens, sampling, batch_size, eos_ids, seeds, progress,
                 confidence_threshold, gate, on_step, tree)
    t0 = time.perf_counter()
    if not run.results:
        return BatchResult(run.results, 0.0, 0)
    run.sess = target.batch_session(min(run.batch_size, len(run.results)))
    while run.waiting or run.live:
        _join(run)
        if not run.live:
            continue
        if run.tree is not None:
            tree_step(run, _clock, _emit_until, _retire)
            continue
        step = _draft(run)
        _verify(run, step)
        _keep(run, step)
    return BatchResult(run.results, time.perf_counter() - t0, run.forwards, run.draft_s, run.verify_s, run.prefill_s,
                       run.forward_s, run.width_sum / run.widths_read if run.widths_read else None)


@dataclass
class _Run:
    """The state of one :func:`speculative_generate` run: its checked arguments, the batch session, the
    per-request results, proposer states and last tokens, the waiting and live requests (prompt indices)
    and the run's counters (batched forwards, finished requests, drafting and verifying seconds)."""

    target: Any
    proposer: Any
    prompts: list[list[int]]
    ks: list[int]
    max_new: list[int]
    batch_size: int
    eos: set[int]
    device: Any
    vocab: int | None
    params: SamplingParams
    gens: list
    greedy: list[bool]
    gate: Any
    progress: Callable[[int, int], Any] | None
    on_step: Callable[[int, Proposal, int, list[int]], Any] | None
    results: list[GenerationResult]
    waiting: deque
    sess: Any = None
    live: list[int] = field(default_factory=list)
    states: dict[int, Any] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    joined: dict[int, float] = field(default_factory=dict)
    forwards: int = 0
    done_count: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    forward_s: float = 0.0
    width_sum: int = 0  # the session's cache width after each step's forward (chain or tree), summed
    widths_read: int = 0
    tree: Any = None


@dataclass
class _Step:
    """One verification step over the live requests (lists in ``_Run.live`` order): the requests'
    sampling parameters, their proposals (None: nothing drafted) and CPU int64 drafts after gating, the
    drafts proposed before gating, the clock readings around drafting, and (after :func:`_verify`) the
    cache lengths before the forward, the target features, the accepted counts and output ids."""

    sp: SamplingParams
    props: list
    drafts: list[torch.Tensor]
    proposed: list[int]
    tp: float
    tv: float
    lengths: list[int] = field(default_factory=list)
    feats: list = field(default_factory=list)
    num_acc: list[int] = field(default_factory=list)
    out_ids: list[list[int]] = field(default_factory=list)


def _setup(target, proposer, prompts, k, max_new_tokens, sampling, batch_size, eos_ids, seeds, progress,
           confidence_threshold, gate, on_step, tree=None) -> _Run:
    """Check :func:`speculative_generate`'s arguments (see its Raises) and build the run's state."""
    vocab = getattr(target, "vocab_size", None)
    prompts = check_prompts(prompts, vocab)
    B = len(prompts)
    ks = per_request("k (drafts per step)", k, B, 0)
    max_new = per_request("max_new_tokens", max_new_tokens, B, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    eos = resolve_stop_ids(target, eos_ids)
    device = getattr(target, "device", torch.device("cpu"))
    params, gens = batch_params(sampling, seeds, B, device)
    greedy = (params.temperature == 0).tolist()
    gate = resolve_gate(gate, confidence_threshold)
    if on_step is not None and not callable(on_step):
        raise SpeculatorsError(f"on_step: expected a callable on_step(request, proposal, num_accepted, emitted) or "
                               f"None, got {type(on_step).__name__}")
    if proposer is None:
        ks = [0] * B
    else:  # one clear error before decoding: K above what a parallel drafter was trained for
        check_speculative_tokens(proposer, sorted(set(ks)), "k")
    if tree is not None:
        from .tree_spec import TreeSpec

        if not isinstance(tree, TreeSpec):
            raise SpeculatorsError(f"tree: expected a speculators.tree_spec.TreeSpec or None, got {type(tree).__name__}")
        if gate is not None:
            raise SpeculatorsError("tree: confidence gating cuts chains; it cannot be combined with draft trees")
        if proposer is not None:  # a path is as long as a chain: the same K cap, named as the tree's depth
            check_speculative_tokens(proposer, [tree.depth], "tree depth")
    return _Run(target, proposer, prompts, ks, max_new, batch_size, eos, device, vocab, params, gens, greedy, gate,
                progress, on_step, [GenerationResult([]) for _ in range(B)], deque(range(B)), tree=tree)


def _retire(run: _Run, i: int) -> None:
    """Request ``i`` is finished: its wall time, its rows of the batch cache and its proposer state go."""
    run.results[i].seconds = time.perf_counter() - run.joined[i]
    if i in run.sess:
        run.sess.remove(i)
    run.states.pop(i, None)
    run.done_count += 1
    if run.progress is not None:
        run.progress(run.done_count, len(run.results))


def _join(run: _Run) -> None:
    """Waiting requests join up to ``batch_size`` live ones: ONE prefill forward for all joiners (own
    cache, then concatenated to the batch's), their first tokens from ONE sampler call, and the
    proposer started on each (a request whose first token ends it retires at once)."""
    idx = []
    while run.waiting and len(run.live) + len(idx) < run.batch_size:
        idx.append(run.waiting.popleft())
    if not idx:
        return
    now = _clock(run.device)
    run.joined.update({i: now for i in idx})
    first_logits, first_feats = run.sess.add_many(idx, [run.prompts[i] for i in idx])
    res = rejection_sample(_NO_DRAFTS.to(run.device), [0] * len(idx), None, torch.stack(first_logits),
                           select_rows(run.params, run.gens, idx), validate=False)
    for i, feats_i, tok in zip(idx, first_feats, res.output_token_ids[:, 0].tolist()):
        if _emit_until(run.results[i].tokens, [tok], run.max_new[i], run.eos):
            _retire(run, i)
            continue
        if run.proposer is not None:
            run.states[i] = run.proposer.start(torch.tensor(run.prompts[i] + [tok], dtype=torch.int64), feats_i)
        run.last[i] = tok
        run.live.append(i)
    run.prefill_s += _clock(run.device) - now


def _draft(run: _Run) -> _Step:
    """ONE batched ``propose`` for the live requests (request i asks for at most
    ``min(k_i, max_new_i - generated_i - 1)`` drafts), checked, then cut by the gate if any."""
    live, proposer = run.live, run.proposer
    k_eff = [min(run.ks[i], run.max_new[i] - len(run.results[i].tokens) - 1) for i in live]
    sp = select_rows(run.params, run.gens, live)
    tp = _clock(run.device)
    if proposer is not None and any(k_eff):
        props = _propose_batch(proposer, [run.states[i] for i in live], k_eff, sp, [run.gens[i] for i in live])
    else:
        props = [None] * len(live)
    drafts = []
    for j, p in enumerate(props):
        d = _NO_DRAFTS if p is None else p.token_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if d.numel() > k_eff[j]:
            raise SpeculatorsError(f"proposer {type(proposer).__name__} returned {d.numel()} drafts when "
                                   f"asked for at most {k_eff[j]}")
        drafts.append(d)
    proposed = [int(d.numel()) for d in drafts]  # before gating
    if run.gate is not None and proposer is not None and any(proposed):
        _gate(run.gate, proposer, props, drafts, proposed)
    tv = _clock(run.device) if proposer is not None else tp
    return _Step(sp, props, drafts, proposed, tp, tv)


def _gate(gate, proposer, props: list, drafts: list[torch.Tensor], proposed: list[int]) -> None:
    """Cut ``props`` / ``drafts`` in place to the prefixes ``gate.keep(proposer, props)`` keeps."""
    for j, m in enumerate(gate.keep(proposer, props)):
        if m is None or m == proposed[j]:
            continue
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= proposed[j]:
            raise SpeculatorsError(f"gate {type(gate).__name__}: keep() must give an integer in "
                                   f"[0, {proposed[j]}] (or None) per proposal, got {m!r}")
        props[j], drafts[j] = truncate_proposal(props[j], m), drafts[j][:m]


def _verify(run: _Run, step: _Step) -> None:
    """ONE target forward over every live request's ``[last token, drafts]`` and ONE ragged
    :func:`speculators.verify.rejection_sample`; charges the step's drafting and verifying time."""
    live = run.live
    ns = [int(d.numel()) for d in step.drafts]
    all_drafts = torch.cat(step.drafts)
    vocab = run.vocab
    if all_drafts.numel() and vocab is not None and (int(all_drafts.min()) < 0 or int(all_drafts.max()) >= vocab):
        raise SpeculatorsError(f"proposer {type(run.proposer).__name__} returned draft ids outside [0, {vocab})")
    step.lengths = [run.sess.length(i) for i in live]
    tf = _clock(run.device)
    logits, step.feats = run.sess.forward(live, [torch.cat([torch.tensor([run.last[i]]), d])
                                                 for i, d in zip(live, step.drafts)])
    run.forward_s += _clock(run.device) - tf
    run.forwards += 1
    run.width_sum, run.widths_read = run.width_sum + int(run.sess.width), run.widths_read + 1
    logits = torch.cat(logits)
    # draft distributions only matter to sampled requests (greedy ones compare with the argmax)
    sampled = not all(run.greedy[i] for i in live)
    probs = _draft_probs(step.props, step.drafts, logits.shape[-1], run.device) if sampled else None
    res = rejection_sample(all_drafts.to(run.device), ns, probs, logits, step.sp, validate=False)
    step.num_acc = res.num_accepted.tolist()
    step.out_ids = res.output_token_ids.tolist()
    te = _clock(run.device)
    run.draft_s, run.verify_s = run.draft_s + (step.tv - step.tp), run.verify_s + (te - step.tv)
    for i in live:
        run.results[i].draft_seconds += step.tv - step.tp
        run.results[i].verify_seconds += te - step.tv


def _keep(run: _Run, step: _Step) -> None:
    """Per live request: emit the step's accepted drafts and recovered/bonus token up to a stop token or
    ``max_new_tokens``, record the step (and tell ``on_step``), retire a finished request, else keep the
    accepted prefix in the target's cache; then ONE batched ``advance`` of the proposer."""
    still, adv = [], ([], [], [])
    for j, i in enumerate(run.live):
        a = step.num_acc[j]
        new = step.out_ids[j][:a + 1]
        r = run.results[i]
        before = len(r.tokens)
        done = _emit_until(r.tokens, new, run.max_new[i], run.eos)
        r.add_step(int(step.drafts[j].numel()), a, len(r.tokens) - before)
        r.proposed.append(step.proposed[j])
        if run.on_step is not None:
            p = step.props[j]
            run.on_step(i, p if p is not None else Proposal(_NO_DRAFTS.clone()), a, r.tokens[before:])
        if done:
            _retire(run, i)
            continue
        run.sess.keep(i, step.lengths[j] + a + 1)
        if run.proposer is not None:
            adv[0].append(run.states[i])
            adv[1].append(torch.tensor(new, dtype=torch.int64))
            adv[2].append(step.feats[j].slice(0, a + 1))
        run.last[i] = new[-1]
        still.append(i)
    advance_timed(run, adv, still, _clock)


@torch.no_grad()
def plain_decode(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_ids: set[int] | None = None, seed: int | None = None) -> GenerationResult:
    """Decode one request with the target alone, one token per forward (the baseline speculative
    decoding must match): :func:`speculative_generate` with ``proposer=None`` at batch 1.

    Every forward after the prefill is recorded as a step with 0 drafts that emits 1 token (so the
    statistics of :class:`speculators.evaluate.AcceptanceStats` give tau = 1 for it).

    Args:
        target: :class:`speculators.target.Target`.
        prompt_ids: prompt token ids (rendered with the chat template).
        max_new_tokens: cap on generated tokens (>= 1).
        sampling: the request's :class:`speculators.verify.SamplingParams` (batch of one: temperature /
            top-k / top-p, temperature 0 = greedy, and optionally its generator); ``None`` = greedy.
        eos_ids: stop token ids; ``None`` = :func:`resolve_stop_ids` of the target (tokenizer EOS,
            ``generation_config`` EOS ids and the chat template's end-of-turn marker). An empty set
            never stops early.
        seed: when given, the request draws from a fresh ``torch.Generator`` seeded with it (instead of
            ``sampling.generators``), so decodes with the same seed are reproducible.
    Returns:
        :class:`GenerationResult` (``tokens`` ends with the stop token when one was emitted).
    Raises:
        SpeculatorsError: ``max_new_tokens`` < 1, ``eos_ids`` not token ids, a non-integer ``seed``, an
            empty prompt, or ``sampling`` not one request's valid ``SamplingParams``.
    """
    return speculative_decode(target, None, prompt_ids, 0, max_new_tokens, sampling, eos_ids, seed)


@torch.no_grad()
def speculative_decode(target, proposer, prompt_ids: list[int], k: int, max_new_tokens: int,
                       sampling: SamplingParams | None = None, eos_ids: set[int] | None = None,
                       seed: int | None = None) -> GenerationResult:
    """Speculative decoding of one request with ``proposer`` drafting up to ``k`` tokens per step:
    :func:`speculative_generate` at batch 1.

    Every step runs one target forward over the last token and the drafts, then
    :func:`speculators.verify.rejection_sample` (lossless: the output has the target's distribution;
    at temperature 0 it equals :func:`plain_decode` token for token). The step's tokens (accepted
    drafts, then the recovered/bonus token) are emitted up to the first stop token or
    ``max_new_tokens``; nothing after the cut is emitted or counted as emitted (the step records
    ``drafted``, ``verifier_accepted`` and ``emitted`` separately, see :class:`GenerationResult`).
    The proposer is asked for at most ``min(k, max_new_tokens - generated - 1)`` drafts, so the
    ``max_new_tokens`` cap never verifies drafts that could not be emitted.

    Args:
        target: :class:`speculators.target.Target`.
        proposer: a :class:`speculators.proposal.Proposer` (a drafter or
            :class:`speculators.proposers.NGramProposer`), or ``None`` for plain decoding; its ``propose`` gets the
            request's ``SamplingParams`` and the request's generator (the verifier draws from the same
            generator, after the drafts).
        prompt_ids: prompt token ids.
        k: max drafts per step (``num_speculative_tokens``, >= 0).
        max_new_tokens: cap on generated tokens (>= 1).
        sampling, eos_ids, seed: as :func:`plain_decode`.
    Raises:
        SpeculatorsError: bad ``k`` / ``max_new_tokens`` / ``eos_ids`` / ``seed`` / ``sampling`` / prompt,
            or a proposer that returned more drafts than asked for.
    """
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    k = check_int("k (drafts per step)", k, 0)
    params = request_params(sampling, None)
    if seed is not None:
        seed = check_int("seed", seed, -(2 ** 63))
    return speculative_generate(target, proposer, [prompt_ids], k, max_new_tokens, params, batch_size=1,
                                eos_ids=eos_ids, seeds=[seed]).results[0]


def _as_token_ids(ids, what: str) -> set[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        ids = [ids]
    out = set()
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            v = operator.index(t.item() if isinstance(t, torch.Tensor) else t)
        except (TypeError, ValueError, RuntimeError):
            v = None
        if v is None or v < 0:
            raise SpeculatorsError(f"{what} must be non-negative integer token ids, got {t!r} in {ids!r}")
        out.add(v)
    return out


def resolve_stop_ids(target, eos_ids=None) -> set[int]:
    """The stop token ids of a decode: ``eos_ids`` when given, else the target's stop ids.

    The target's stop ids are ``target.stop_token_ids`` (tokenizer EOS ∪ ``generation_config`` EOS ids
    ∪ the chat template's end-of-turn marker; a list property, or a method called without
    arguments); for an object without it, the tokenizer's ``eos_token_id`` (none without a
    tokenizer). Plain decoding, speculative decoding and eval all stop on this set.

    Args:
        target: :class:`speculators.target.Target` (or any object with ``stop_token_ids`` or
            ``tokenizer``).
        eos_ids: explicit stop ids (an int or an iterable of ints; an empty set = never stop early);
            it wins over the target's.
    Returns:
        set of int token ids.
    Raises:
        SpeculatorsError: ``eos_ids`` (or the target's stop ids) are not non-negative integers.
    """
    if eos_ids is not None:
        return _as_token_ids(eos_ids, "eos_ids")
    stop = getattr(target, "stop_token_ids", None)
    if callable(stop):
        stop = stop()
    if stop is not None:
        return _as_token_ids(stop, "target.stop_token_ids")
    tok = getattr(target, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    return set() if eos is None else _as_token_ids(eos, "tokenizer.eos_token_id")
