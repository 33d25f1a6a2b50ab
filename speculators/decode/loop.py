"""The decoding loop: plain target decoding and batched speculative decoding with any proposer.

The loop follows what a serving engine does for a batch of requests (vLLM's spec-decode step with
continuous batching). :func:`speculative_generate` reads as its named steps (as gpt-fast's
``generate.py`` does):

1. ``_join``: requests join the batch: their prompts are prefilled in their own cache (one forward for
   all the requests joining at that step: :meth:`speculators.target.BatchDecodeSession.add_many`) and
   concatenated to the batch's; each first token is sampled from the prefill;
2. one STEP over the live requests: :func:`speculators.decode.chain.step` (draft chains: ONE batched
   ``propose``, ONE target forward over every request's ``[last token, drafts]``, ONE ragged rejection
   sampling, then the accepted prefix kept and ONE batched ``advance``) or, with ``tree=``,
   :func:`speculators.decode.tree.step` (draft trees, verified with a tree attention mask);
3. a finished request retires (:meth:`speculators.decode.state.RunState.retire`) and waiting ones join at
   the next ``_join`` (at most ``batch_size`` live requests), so a long answer never holds the others back.

Both steps share one :class:`speculators.decode.state.RunState`; its
:class:`speculators.decode.recorder.Recorder` keeps every clock reading and counter out of the steps.

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

A proposer implements the batched :class:`speculators.decode.proposal.Proposer` protocol:
``start(input_ids, features) -> state`` (one request), ``propose(states, ks, sampling, generators=None)
-> list[Proposal]`` and ``advance(states, new_ids, features)`` (every
:class:`speculators.drafters.Drafter`, and the proposers of :mod:`speculators.decode.proposers`). ``sampling``
is the verifier's own :class:`speculators.verify.SamplingParams` for the B requests (per-request
temperature / top-k / top-p), so drafts and the verifier apply the same transform.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import torch

from ..errors import SpeculatorsError
from ..verify import SamplingParams, rejection_sample
from . import chain
from .chain import NO_DRAFTS
from .gating import ConfidenceGate, resolve_gate
from .inputs import batch_params, check_prompts, per_request, request_params, resolve_stop_ids, select_rows
from .proposal import check_int, check_speculative_tokens
from .recorder import Recorder
from .state import BatchResult, GenerationResult, RunState
from .tree import step as tree_step
from .tree_spec import TreeSpec


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
        proposer: a :class:`speculators.decode.proposal.Proposer` (drafter,
            :class:`speculators.decode.proposers.NGramProposer`, ...), or ``None`` for plain
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
        confidence_threshold: confidence-gated verification (DSpark, :class:`speculators.decode.gating.ConfidenceGate`): after each
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
        tree: a :class:`speculators.decode.tree_spec.TreeSpec`: draft TREES instead of chains
            (:mod:`speculators.decode.tree`: EAGLE-2 dynamic or vLLM static trees, verified in one target forward
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
    run.session = target.batch_session(min(run.batch_size, len(run.results)))
    step = chain.step if run.tree is None else tree_step
    while run.waiting or run.live:
        _join(run)
        if run.live:
            step(run)
    rec = run.recorder
    return BatchResult(run.results, time.perf_counter() - t0, rec.forwards, rec.draft_seconds, rec.verify_seconds,
                       rec.prefill_seconds, rec.forward_seconds, rec.cache_width)


def _setup(target, proposer, prompts, k, max_new_tokens, sampling, batch_size, eos_ids, seeds, progress,
           confidence_threshold, gate, on_step, tree=None) -> RunState:
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
        if not isinstance(tree, TreeSpec):
            raise SpeculatorsError(f"tree: expected a speculators.decode.tree_spec.TreeSpec or None, got {type(tree).__name__}")
        if gate is not None:
            raise SpeculatorsError("tree: confidence gating cuts chains; it cannot be combined with draft trees")
        if proposer is not None:  # a path is as long as a chain: the same K cap, named as the tree's depth
            check_speculative_tokens(proposer, [tree.depth], "tree depth")
    results = [GenerationResult([]) for _ in range(B)]
    return RunState(target, proposer, prompts, ks, max_new, batch_size, eos, device, vocab, params, gens, greedy, gate,
                    tree, progress, on_step, results, deque(range(B)),
                    Recorder(device, results, charge_drafting=proposer is not None))


def _join(run: RunState) -> None:
    """Waiting requests join up to ``batch_size`` live ones: ONE prefill forward for all joiners (own
    cache, then concatenated to the batch's), their first tokens from ONE sampler call, and the
    proposer started on each (a request whose first token ends it retires at once)."""
    idx = []
    while run.waiting and len(run.live) + len(idx) < run.batch_size:
        idx.append(run.waiting.popleft())
    if not idx:
        return
    with run.recorder.prefill() as now:
        run.joined.update({i: now for i in idx})
        first_logits, first_feats = run.session.add_many(idx, [run.prompts[i] for i in idx])
        res = rejection_sample(NO_DRAFTS.to(run.device), [0] * len(idx), None, torch.stack(first_logits),
                               select_rows(run.sampling, run.generators, idx), validate=False)
        for i, feats_i, tok in zip(idx, first_feats, res.output_token_ids[:, 0].tolist()):
            if run.emit(i, [tok])[1]:
                run.retire(i)
                continue
            if run.proposer is not None:
                run.states[i] = run.proposer.start(torch.tensor(run.prompts[i] + [tok], dtype=torch.int64), feats_i)
            run.last[i] = tok
            run.live.append(i)


@torch.no_grad()
def plain_decode(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_ids: set[int] | None = None, seed: int | None = None) -> GenerationResult:
    """Decode one request with the target alone, one token per forward (the baseline speculative
    decoding must match): :func:`speculative_generate` with ``proposer=None`` at batch 1.

    Every forward after the prefill is recorded as a step with 0 drafts that emits 1 token (so the
    statistics of :class:`speculators.evaluation.acceptance.AcceptanceStats` give tau = 1 for it).

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
        proposer: a :class:`speculators.decode.proposal.Proposer` (a drafter or
            :class:`speculators.decode.proposers.NGramProposer`), or ``None`` for plain decoding; its ``propose`` gets the
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


