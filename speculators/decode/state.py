"""The state of one decoding run, and what it returns.

:class:`GenerationResult` (one request) and :class:`BatchResult` (the run) are what
:func:`speculators.decode.loop.speculative_generate` returns. :class:`RunState` is the run while it decodes: its
checked arguments, the batch session, the live and waiting requests and their proposer states; the chain step
(:mod:`speculators.decode.chain`) and the tree step (:mod:`speculators.decode.tree`) both read and update it,
through the methods below for what they share (emitting a step's tokens, retiring a request, advancing the
proposer). Its :class:`speculators.decode.recorder.Recorder` keeps the seconds and counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..verify import SamplingParams
from .recorder import Recorder

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
        draft_ids: chain decoding only, per step the draft token ids that went through the verifier (after any
            confidence gate); what an engine's drafts are compared with (:mod:`speculators.export.vllm_served`).
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
    draft_ids: list[list[int]] = field(default_factory=list)

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
            loop's per-step overhead (sampling, bookkeeping) that :mod:`speculators.evaluation.cost_model` measures.
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


def emit_until(out: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
    """Append ``new`` to ``out`` up to ``max_new`` tokens or the first stop token (included); True when
    finished. The caller measures what was appended as the change of ``len(out)``."""
    for t in new:
        if len(out) >= max_new:
            return True
        out.append(t)
        if t in eos or len(out) >= max_new:
            return True
    return False


@dataclass
class Kept:
    """What a step keeps of its live requests: the requests still live after it and, for the proposer's ONE
    batched ``advance``, their states, the ids each step emitted (int64 CPU) and the target features of
    those positions (:class:`speculators.target.TargetFeatures`)."""

    requests: list[int] = field(default_factory=list)
    states: list = field(default_factory=list)
    new_ids: list[torch.Tensor] = field(default_factory=list)
    features: list = field(default_factory=list)


@dataclass
class RunState:
    """One :func:`speculators.decode.loop.speculative_generate` run while it decodes.

    Attributes:
        target, proposer: the verifier (:class:`speculators.target.Target`) and the proposer (None: plain).
        prompts, max_drafts, max_new: per request, its prompt ids, its drafts per step (``k_i``) and its
            ``max_new_tokens``.
        batch_size: most live requests. stop_ids: the stop token ids. device: the target's.
        vocab: the target vocabulary size (None when the target does not say).
        sampling: every request's :class:`speculators.verify.SamplingParams`. generators: per request its
            ``torch.Generator`` or None. greedy: per request, temperature 0.
        gate: the confidence gate (None: none). tree: the :class:`speculators.decode.tree_spec.TreeSpec`
            (None: chains).
        progress: ``progress(done, total)`` when a request finishes. on_step: the outcome hook.
        results: per request its :class:`GenerationResult`. waiting: requests not yet joined (prompt indices).
        session: the target's batch session. live: the live requests, in batch order. states: proposer
            state per live request. last: per live request, its last emitted token (the next step's first
            input). joined: per request, when it joined (:func:`clock` seconds).
        finished: requests finished so far. recorder: the run's seconds and counts.
    """

    target: Any
    proposer: Any
    prompts: list[list[int]]
    max_drafts: list[int]
    max_new: list[int]
    batch_size: int
    stop_ids: set[int]
    device: Any
    vocab: int | None
    sampling: SamplingParams
    generators: list
    greedy: list[bool]
    gate: Any
    tree: Any
    progress: Callable[[int, int], Any] | None
    on_step: Callable[[int, Any, int, list[int]], Any] | None
    results: list[GenerationResult]
    waiting: deque
    recorder: Recorder
    session: Any = None
    live: list[int] = field(default_factory=list)
    states: dict[int, Any] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    joined: dict[int, float] = field(default_factory=dict)
    finished: int = 0

    def room(self, i: int) -> int:
        """Drafts request ``i`` may still have verified this step: ``max_new_i - generated_i - 1`` (the step's
        bonus or recovered token takes the last place), so no draft that could not be emitted is verified."""
        return self.max_new[i] - len(self.results[i].tokens) - 1

    def emit(self, i: int, new: list[int]) -> tuple[list[int], bool]:
        """Append a step's tokens to request ``i``'s output up to a stop token or ``max_new_tokens``: the
        tokens actually emitted, and whether the request is finished."""
        out = self.results[i].tokens
        before = len(out)
        done = emit_until(out, new, self.max_new[i], self.stop_ids)
        return out[before:], done

    def retire(self, i: int) -> None:
        """Request ``i`` is finished: its wall time, its rows of the batch cache and its proposer state go."""
        self.results[i].seconds = self.recorder.now() - self.joined[i]
        if i in self.session:
            self.session.remove(i)
        self.states.pop(i, None)
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, len(self.results))

    def keep(self, kept: Kept, i: int, new: list[int], features) -> None:
        """Request ``i`` stays live after emitting ``new`` (``features``: the target features of those
        positions): it joins ``kept`` and ``new[-1]`` is its next step's first input."""
        kept.requests.append(i)
        if self.proposer is not None:
            kept.states.append(self.states[i])
            kept.new_ids.append(torch.tensor(new, dtype=torch.int64))
            kept.features.append(features)
        self.last[i] = new[-1]

    def advance(self, kept: Kept) -> None:
        """The end of a step, chain or tree: ONE batched ``advance`` of the proposer with what ``kept`` holds
        (charged as drafting), and ``kept.requests`` become the live requests."""
        if kept.states:
            with self.recorder.drafting(kept.requests):
                self.proposer.advance(kept.states, kept.new_ids, kept.features)
        self.live = kept.requests
