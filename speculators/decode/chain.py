"""One step of the decoding loop for draft CHAINS: draft, verify, keep (vLLM's spec-decode step, as gpt-fast's
``speculative_decode``).

1. :func:`draft`: ONE batched ``propose`` for the live requests (request i asks for at most
   ``min(k_i, max_new_i - generated_i - 1)`` drafts, ragged, possibly 0); with a confidence gate
   (:class:`speculators.decode.gating.ConfidenceGate`, DSpark) a proposal that carries confidence logits is cut to
   its confident prefix here, before the target sees it (the rule reads only the drafter's outputs: lossless);
2. :func:`verify`: ONE target forward over every live request's ``[last token, d_1..d_{k_i}]`` (right-padded, one
   KV cache) gives ``k_i + 1`` distributions (and target features) per request, and ONE call of the ragged
   rejection sampler (:func:`speculators.verify.rejection_sample`) accepts a prefix per request and emits a
   recovered or bonus token;
3. :func:`keep`: per request the accepted drafts and the recovered/bonus token are emitted (up to a stop token or
   ``max_new_tokens``), the step is recorded and told to the ``on_step`` hook, the target's KV cache keeps only
   the accepted prefix, and the proposer is advanced with the accepted tokens and their target features (ONE
   batched ``advance``).

The run's :class:`speculators.decode.recorder.Recorder` times the phases (:func:`step`); the functions here
hold only the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SpeculatorsError
from ..verify import SamplingParams, rejection_sample
from .gating import truncate_proposal
from .inputs import select_rows
from .proposal import Proposal
from .state import Kept, RunState

NO_DRAFTS = torch.empty(0, dtype=torch.int64)


@dataclass
class ChainStep:
    """One chain step over the live requests (lists in ``RunState.live`` order).

    Attributes:
        sampling: the live requests' :class:`speculators.verify.SamplingParams`.
        proposals: per request its :class:`Proposal` after gating (None: nothing was drafted).
        drafts: per request its drafts after gating (int64 CPU, possibly empty).
        proposed: per request, drafts before gating.
        cache_lengths: (after :func:`verify`) per request, its cache length before the forward.
        features: (after :func:`verify`) per request, the target features of its forward rows.
        num_accepted: (after :func:`verify`) per request, drafts the rejection sampler accepted.
        output_ids: (after :func:`verify`) per request, the sampler's output ids (accepted drafts, then the
            recovered or bonus token, then padding).
    """

    sampling: SamplingParams
    proposals: list
    drafts: list[torch.Tensor]
    proposed: list[int]
    cache_lengths: list[int] = field(default_factory=list)
    features: list = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    output_ids: list[list[int]] = field(default_factory=list)


def step(run: RunState) -> None:
    """One chain step of :func:`speculators.decode.loop.speculative_generate` over ``run.live``: drafting (and
    the proposer's ``advance``) charged as drafting time, the forward and rejection sampling as verifying."""
    live = list(run.live)
    with run.recorder.drafting(live):
        s = draft(run)
    with run.recorder.verifying(live):
        verify(run, s)
    keep(run, s)


def propose_batch(proposer, states: list, ks: list[int], sampling: SamplingParams, gens: list) -> list[Proposal]:
    """The proposer's batched ``propose``, checked to give one Proposal per request.

    Raises:
        SpeculatorsError: not a list of one proposal per request, naming the proposer.
    """
    props = proposer.propose(states, ks, sampling, gens)
    if not isinstance(props, (list, tuple)) or len(props) != len(states):
        raise SpeculatorsError(f"proposer {type(proposer).__name__}: propose must return one Proposal per "
                               f"request ({len(states)}), got {type(props).__name__}"
                               + (f" of {len(props)}" if isinstance(props, (list, tuple)) else ""))
    return list(props)


def draft(run: RunState) -> ChainStep:
    """ONE batched ``propose`` for the live requests, checked, then cut by the gate if any.

    Raises:
        SpeculatorsError: a proposer that returned more drafts than asked for; a gate's bad ``keep``.
    """
    live, proposer = run.live, run.proposer
    caps = [min(run.max_drafts[i], run.room(i)) for i in live]
    sampling = select_rows(run.sampling, run.generators, live)
    if proposer is not None and any(caps):
        proposals = propose_batch(proposer, [run.states[i] for i in live], caps, sampling,
                                  [run.generators[i] for i in live])
    else:
        proposals = [None] * len(live)
    drafts = []
    for j, p in enumerate(proposals):
        d = NO_DRAFTS if p is None else p.token_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if d.numel() > caps[j]:
            raise SpeculatorsError(f"proposer {type(proposer).__name__} returned {d.numel()} drafts when "
                                   f"asked for at most {caps[j]}")
        drafts.append(d)
    proposed = [int(d.numel()) for d in drafts]
    if run.gate is not None and proposer is not None and any(proposed):
        apply_gate(run.gate, proposer, proposals, drafts, proposed)
    return ChainStep(sampling, proposals, drafts, proposed)


def apply_gate(gate, proposer, proposals: list, drafts: list[torch.Tensor], proposed: list[int]) -> None:
    """Cut ``proposals`` / ``drafts`` in place to the prefixes ``gate.keep(proposer, proposals)`` keeps.

    Raises:
        SpeculatorsError: ``keep`` gave something other than None or an integer in ``[0, drafts]``.
    """
    for j, m in enumerate(gate.keep(proposer, proposals)):
        if m is None or m == proposed[j]:
            continue
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= proposed[j]:
            raise SpeculatorsError(f"gate {type(gate).__name__}: keep() must give an integer in "
                                   f"[0, {proposed[j]}] (or None) per proposal, got {m!r}")
        proposals[j], drafts[j] = truncate_proposal(proposals[j], m), drafts[j][:m]


def draft_probs(proposals: list, drafts: list[torch.Tensor], vocab: int, device) -> torch.Tensor | None:
    """The ``[sum n_i, V]`` float32 draft distributions of a step (point masses as one-hot rows for
    proposals without probabilities: the verifier treats both alike), or None when no proposal has any.

    Raises:
        SpeculatorsError: a proposal's ``probs`` is not ``[n_i, V]``.
    """
    if not any(p is not None and p.probs is not None and d.numel() for p, d in zip(proposals, drafts)):
        return None
    rows = []
    for j, (p, d) in enumerate(zip(proposals, drafts)):
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


def verify(run: RunState, s: ChainStep) -> None:
    """ONE target forward over every live request's ``[last token, drafts]`` and ONE ragged
    :func:`speculators.verify.rejection_sample`; fills ``s``'s verification fields.

    Raises:
        SpeculatorsError: draft ids outside ``[0, vocab)``.
    """
    live = run.live
    all_drafts = torch.cat(s.drafts)
    vocab = run.vocab
    if all_drafts.numel() and vocab is not None and (int(all_drafts.min()) < 0 or int(all_drafts.max()) >= vocab):
        raise SpeculatorsError(f"proposer {type(run.proposer).__name__} returned draft ids outside [0, {vocab})")
    s.cache_lengths = [run.session.length(i) for i in live]
    with run.recorder.forward(run.session):
        logits, s.features = run.session.forward(live, [torch.cat([torch.tensor([run.last[i]]), d])
                                                        for i, d in zip(live, s.drafts)])
    logits = torch.cat(logits)
    # draft distributions only matter to sampled requests (greedy ones compare with the argmax)
    sampled = not all(run.greedy[i] for i in live)
    probs = draft_probs(s.proposals, s.drafts, logits.shape[-1], run.device) if sampled else None
    res = rejection_sample(all_drafts.to(run.device), [int(d.numel()) for d in s.drafts], probs, logits,
                           s.sampling, validate=False)
    s.num_accepted = res.num_accepted.tolist()
    s.output_ids = res.output_token_ids.tolist()


def keep(run: RunState, s: ChainStep) -> None:
    """Per live request: emit the accepted drafts and the recovered/bonus token, record the step (and tell
    ``on_step``), retire a finished request, else keep the accepted prefix in the target's cache; then ONE
    batched ``advance`` of the proposer."""
    kept = Kept()
    for j, i in enumerate(run.live):
        a = s.num_accepted[j]
        new = s.output_ids[j][:a + 1]
        emitted, done = run.emit(i, new)
        r = run.results[i]
        r.add_step(int(s.drafts[j].numel()), a, len(emitted))
        r.proposed.append(s.proposed[j])
        r.draft_ids.append([int(t) for t in s.drafts[j].tolist()])
        if run.on_step is not None:
            p = s.proposals[j]
            run.on_step(i, p if p is not None else Proposal(NO_DRAFTS.clone()), a, emitted)
        if done:
            run.retire(i)
            continue
        run.session.keep(i, s.cache_lengths[j] + a + 1)
        run.keep(kept, i, new, s.features[j].slice(0, a + 1) if run.proposer is not None else None)
    run.advance(kept)
