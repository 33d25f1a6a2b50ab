"""Generation: plain target decoding, batched speculative decoding with any proposer, the n-gram proposer.

The loop follows what a serving engine does for a batch of requests (vLLM's spec-decode step with
continuous batching), in :func:`speculative_generate`:

1. requests join the batch: their prompts are prefilled in their own cache (one forward for all the
   requests joining at that step: :meth:`speculators.target.BatchDecodeSession.add_many`) and
   concatenated to the batch's; each first token is sampled from the prefill;
2. every step, each live request's proposer state drafts up to ``k_i`` tokens (ONE batched
   ``propose`` call, ragged: ``k_i`` may differ per request and may be 0);
3. ONE target forward over every live request's ``[last token, d_1..d_{k_i}]`` (right-padded, one KV
   cache) gives ``k_i + 1`` distributions (and target features) per request;
4. ONE call of the ragged rejection sampler (:func:`speculators.verify.rejection_sample`) accepts a
   prefix per request and emits a recovered or bonus token;
5. per request, the target KV cache keeps only the accepted prefix (``keep``) and the proposer is
   advanced with the accepted tokens and their target features (ONE batched ``advance`` call);
6. finished requests leave the batch and waiting ones join (at most ``batch_size`` live requests), so
   a long answer never holds the others back.

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

A proposer implements the batched :class:`Proposer` protocol: ``start(input_ids, features) -> state``
(one request), ``propose(states, ks, sampling, generators=None) -> list[Proposal]`` and
``advance(states, new_ids, features)`` (every :class:`speculators.drafters.Drafter`, and
:class:`NGramProposer`). ``sampling`` is the verifier's own :class:`speculators.verify.SamplingParams`
for the B requests (per-request temperature / top-k / top-p), so drafts and the verifier apply the same
transform. A proposer whose ``propose`` / ``advance`` still take ONE request (first parameter named
``state``: the protocol before issue 11) is called once per request by the loop.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .drafters.base import Proposal, advance_each, propose_each
from .errors import SpeculatorsError
from .verify import SamplingParams, rejection_sample


@runtime_checkable
class Proposer(Protocol):
    """What the speculative loop needs from a proposer (a drafter family or a model-free proposer).

    Batched and ragged: ``propose`` / ``advance`` take the states of ``B`` requests (``B = 1`` is just
    a batch of one). Inference protocol (features lag tokens by one): after ``start``/``advance`` the
    proposer has seen tokens ``x_0..x_n`` of a request and target features of positions ``0..n-1``;
    ``x_n`` is the newest (bonus or recovered) token, not yet run through the target.
    """

    def start(self, input_ids: torch.Tensor, features: Any) -> Any:
        """Begin ONE request: ``input_ids [n+1]`` int64 (prompt + first target token), ``features`` the
        target's :class:`speculators.target.TargetFeatures` of positions ``0..n-1`` (batch dim 1).
        Returns the proposer's per-request state."""
        ...

    def propose(self, states: list, ks: list[int], sampling: SamplingParams | None = None,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Drafts for ``B = len(states)`` requests: request i gets a :class:`Proposal` of at most
        ``ks[i]`` drafts (target-vocabulary ids ``[k_i']`` and the ``[k_i', V]`` float32 draft
        distributions or None for point masses); ``ks[i] == 0`` gives an empty Proposal.
        ``sampling``: the B requests' :class:`speculators.verify.SamplingParams` (per-request
        temperature / top-k / top-p; ``None`` = all greedy); ``generators``: one torch generator (or
        None) per request, winning over ``sampling.generators``; request i draws ONLY from its own
        generator (else torch's global RNG). Must leave every state as it found it."""
        ...

    def advance(self, states: list, new_ids: list[torch.Tensor], features: list) -> None:
        """Append to request i the ``m_i`` verified tokens ``new_ids[i] [m_i]`` (accepted drafts + the
        recovered/bonus token) and the target features ``features[i]`` of positions
        ``n_i..n_i+m_i-1``; updates the states in place."""
        ...


def _request_params(sampling: SamplingParams | None, seed: int | None) -> SamplingParams:
    """The one request's sampling parameters a decode uses: ``sampling`` (greedy when None), with a
    fresh generator seeded with ``seed`` when one is given (so every decode of a prompt starts from
    the same random stream).

    Raises:
        SpeculatorsError: ``sampling`` is not a batch-of-one ``SamplingParams`` or holds invalid values.
    """
    if sampling is None:
        sampling = SamplingParams.uniform(1)
    elif not isinstance(sampling, SamplingParams):
        raise SpeculatorsError(f"sampling: expected speculators.verify.SamplingParams (one request) or None, "
                               f"got {type(sampling).__name__}")
    sampling.validate(1)  # VerifyInputError (a SpeculatorsError) naming the field
    if seed is not None:
        seed = _check_int("seed", seed, -(2 ** 63))  # any integer torch.Generator.manual_seed takes
        dev = sampling.temperature.device
        sampling = dataclasses.replace(sampling, generators=[torch.Generator(device=dev).manual_seed(seed)])
    return sampling


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
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    target_forwards: int = 0
    emitted: list[int] = field(default_factory=list)
    verifier_accepted: list[int] = field(default_factory=list)

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
    """

    results: list[GenerationResult]
    seconds: float = 0.0
    target_forwards: int = 0

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


def _check_int(name: str, value, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise SpeculatorsError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return n


def _per_request(name: str, value, batch: int, minimum: int) -> list[int]:
    """``value`` (one int for every request, or a list of ``batch`` ints) as a list of ``batch`` ints."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise SpeculatorsError(f"{name}: expected one integer or a list of {batch} (one per prompt), "
                                   f"got a list of {len(value)}")
        return [_check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]
    return [_check_int(name, value, minimum)] * batch


def _check_prompts(prompts, vocab_size: int | None) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise SpeculatorsError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = [operator.index(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
            if any(isinstance(t, bool) for t in p):
                raise TypeError
        except TypeError:
            raise SpeculatorsError(f"prompts[{i}]: expected a list of integer token ids, got {p!r:.80}") from None
        if not ids:
            raise SpeculatorsError(f"prompts[{i}]: empty prompt (every prompt needs at least one token)")
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            raise SpeculatorsError(f"prompts[{i}]: token ids must lie in [0, {vocab_size}), got "
                                   f"min {min(ids)} max {max(ids)}")
        out.append(ids)
    return out


def _batch_params(sampling: SamplingParams | None, seeds, batch: int,
                  device: torch.device) -> tuple[SamplingParams, list[torch.Generator | None]]:
    """The run's per-request sampling parameters on ``device`` and each request's generator
    (``seeds[i]`` -> a fresh generator on ``device``; else ``sampling.generators[i]``; else None)."""
    if sampling is None:
        sampling = SamplingParams.uniform(batch, device=device)
    elif not isinstance(sampling, SamplingParams):
        raise SpeculatorsError(f"sampling: expected speculators.verify.SamplingParams for the {batch} prompts "
                               f"or None (greedy), got {type(sampling).__name__}")
    sampling.validate(batch)  # VerifyInputError (a SpeculatorsError) naming the field
    if seeds is not None:
        if not isinstance(seeds, (list, tuple)) or len(seeds) != batch:
            raise SpeculatorsError(f"seeds: expected a list of {batch} seeds (int or None, one per prompt) or "
                                   f"None, got {seeds!r:.80}")
        seeds = [None if s is None else _check_int(f"seeds[{i}]", s, -(2 ** 63)) for i, s in enumerate(seeds)]
    gens: list[torch.Generator | None] = []
    for i in range(batch):
        if seeds is not None and seeds[i] is not None:
            gens.append(torch.Generator(device=device).manual_seed(seeds[i]))
        else:
            gens.append(sampling.generators[i] if sampling.generators is not None else None)

    def to(x):
        return None if x is None else x.to(device)

    params = SamplingParams(temperature=sampling.temperature.to(device), top_k=to(sampling.top_k),
                            top_p=to(sampling.top_p))
    return params, gens


def _select(params: SamplingParams, gens: list, idx: list[int]) -> SamplingParams:
    """Rows ``idx`` of the run's parameters, with those requests' generators."""
    rows = torch.tensor(idx, device=params.temperature.device)

    def pick(x):
        return None if x is None else x.index_select(0, rows)

    g = [gens[i] for i in idx]
    return SamplingParams(temperature=pick(params.temperature), top_k=pick(params.top_k), top_p=pick(params.top_p),
                          generators=g if any(x is not None for x in g) else None)


def _takes_one_request(method) -> bool:
    """True for a per-request ``propose(state, k, ...)`` / ``advance(state, ...)`` (first parameter named
    ``state``): the protocol before batching, still accepted by the loop (called once per request)."""
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "state"


def _propose_batch(proposer, states: list, ks: list[int], sampling: SamplingParams,
                   gens: list) -> list[Proposal]:
    if _takes_one_request(proposer.propose):
        return propose_each(proposer.propose, states, ks, sampling, gens)
    props = proposer.propose(states, ks, sampling, gens)
    if not isinstance(props, (list, tuple)) or len(props) != len(states):
        raise SpeculatorsError(f"proposer {type(proposer).__name__}: propose must return one Proposal per "
                               f"request ({len(states)}), got {type(props).__name__}"
                               + (f" of {len(props)}" if isinstance(props, (list, tuple)) else ""))
    return list(props)


def _advance_batch(proposer, states: list, new_ids: list, features: list) -> None:
    if _takes_one_request(proposer.advance):
        advance_each(proposer.advance, states, new_ids, features)
    else:
        proposer.advance(states, new_ids, features)


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
                         progress: Callable[[int, int], Any] | None = None) -> BatchResult:
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
        proposer: a :class:`Proposer` (drafter, :class:`NGramProposer`, ...), or ``None`` for plain
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
    Returns:
        :class:`BatchResult` (results in prompt order, the run's wall time and batched forwards).
    Raises:
        SpeculatorsError: bad ``prompts`` / ``k`` / ``max_new_tokens`` / ``batch_size`` / ``eos_ids`` /
            ``seeds`` / ``sampling`` (naming the argument), or a proposer that returned more drafts than
            asked for, draft ids outside the vocabulary, or ``probs`` of the wrong shape.
    """
    vocab = getattr(target, "vocab_size", None)
    prompts = _check_prompts(prompts, vocab)
    B = len(prompts)
    ks = _per_request("k (drafts per step)", k, B, 0)
    max_new = _per_request("max_new_tokens", max_new_tokens, B, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    eos = resolve_stop_ids(target, eos_ids)
    device = getattr(target, "device", torch.device("cpu"))
    params, gens = _batch_params(sampling, seeds, B, device)
    greedy = (params.temperature == 0).tolist()
    if proposer is None:
        ks = [0] * B
    t0 = time.perf_counter()
    results = [GenerationResult([]) for _ in range(B)]
    if B == 0:
        return BatchResult(results, 0.0, 0)
    sess = target.batch_session(min(batch_size, B))
    empty = torch.empty(0, dtype=torch.int64)
    waiting = deque(range(B))
    live: list[int] = []
    states: dict[int, Any] = {}
    last: dict[int, int] = {}
    joined: dict[int, float] = {}
    forwards = done_count = 0

    def finish(i: int) -> None:
        nonlocal done_count
        results[i].seconds = time.perf_counter() - joined[i]
        if i in sess:
            sess.remove(i)
        states.pop(i, None)
        done_count += 1
        if progress is not None:
            progress(done_count, B)

    while waiting or live:
        # ---- joins: ONE prefill forward for all joiners (own cache, then concatenated to the batch's),
        # first tokens from the prefill (one sampler call for all joiners)
        idx = []
        while waiting and len(live) + len(idx) < batch_size:
            idx.append(waiting.popleft())
        if idx:
            now = time.perf_counter()
            joined.update({i: now for i in idx})
            first_logits, first_feats = sess.add_many(idx, [prompts[i] for i in idx])
            res = rejection_sample(empty.to(device), [0] * len(idx), None, torch.stack(first_logits),
                                   _select(params, gens, idx), validate=False)
            for i, feats_i, tok in zip(idx, first_feats, res.output_token_ids[:, 0].tolist()):
                if _emit_until(results[i].tokens, [tok], max_new[i], eos):
                    finish(i)
                    continue
                if proposer is not None:
                    states[i] = proposer.start(torch.tensor(prompts[i] + [tok], dtype=torch.int64), feats_i)
                last[i] = tok
                live.append(i)
        if not live:
            continue
        # ---- one step for every live request
        k_eff = [min(ks[i], max_new[i] - len(results[i].tokens) - 1) for i in live]
        sp = _select(params, gens, live)
        if proposer is not None and any(k_eff):
            props = _propose_batch(proposer, [states[i] for i in live], k_eff, sp, [gens[i] for i in live])
        else:
            props = [None] * len(live)
        drafts = []
        for j, p in enumerate(props):
            d = empty if p is None else p.token_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
            if d.numel() > k_eff[j]:
                raise SpeculatorsError(f"proposer {type(proposer).__name__} returned {d.numel()} drafts when "
                                       f"asked for at most {k_eff[j]}")
            drafts.append(d)
        ns = [int(d.numel()) for d in drafts]
        all_drafts = torch.cat(drafts)
        if all_drafts.numel() and vocab is not None and (int(all_drafts.min()) < 0 or int(all_drafts.max()) >= vocab):
            raise SpeculatorsError(f"proposer {type(proposer).__name__} returned draft ids outside [0, {vocab})")
        lengths = [sess.length(i) for i in live]
        logits, feats = sess.forward(live, [torch.cat([torch.tensor([last[i]]), d]) for i, d in zip(live, drafts)])
        forwards += 1
        logits = torch.cat(logits)
        # draft distributions only matter to sampled requests (greedy ones compare with the argmax)
        sampled = not all(greedy[i] for i in live)
        probs = _draft_probs(props, drafts, logits.shape[-1], device) if sampled else None
        res = rejection_sample(all_drafts.to(device), ns, probs, logits, sp, validate=False)
        num_acc = res.num_accepted.tolist()
        out_ids = res.output_token_ids.tolist()
        still, adv = [], ([], [], [])
        for j, i in enumerate(live):
            a = num_acc[j]
            step = out_ids[j][:a + 1]
            r = results[i]
            before = len(r.tokens)
            done = _emit_until(r.tokens, step, max_new[i], eos)
            r.add_step(ns[j], a, len(r.tokens) - before)
            if done:
                finish(i)
                continue
            sess.keep(i, lengths[j] + a + 1)
            if proposer is not None:
                adv[0].append(states[i])
                adv[1].append(torch.tensor(step, dtype=torch.int64))
                adv[2].append(feats[j].slice(0, a + 1))
            last[i] = step[-1]
            still.append(i)
        if adv[0]:
            _advance_batch(proposer, *adv)
        live = still
    return BatchResult(results, time.perf_counter() - t0, forwards)


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
        proposer: a :class:`Proposer` (a drafter or :class:`NGramProposer`; a per-request proposer of the
            old protocol is accepted too), or ``None`` for plain decoding; its ``propose`` gets the
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
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    k = _check_int("k (drafts per step)", k, 0)
    params = _request_params(sampling, None)
    if seed is not None:
        seed = _check_int("seed", seed, -(2 ** 63))
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


@dataclass
class _NGramState:
    tokens: list[int]


class NGramProposer:
    """Prompt-lookup (n-gram) proposer, the model-free baseline (vLLM ``method: ngram``).

    Finds the most recent earlier occurrence of the last ``n`` tokens (``n`` from ``max_n`` down to
    ``min_n``) in the prompt + generated text and proposes the tokens that followed it. Drafts are
    ids only (``probs=None``): the verifier treats them as point masses. Batched :class:`Proposer`:
    ``propose`` / ``advance`` loop over the requests (:meth:`_propose_one` / :meth:`_advance_one`).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        """``max_n`` >= ``min_n`` >= 1: the n-gram lengths tried, longest first.

        Raises:
            SpeculatorsError: other values.
        """
        self.min_n = _check_int("NGramProposer min_n", min_n, 1)
        self.max_n = _check_int("NGramProposer max_n", max_n, self.min_n)

    def start(self, input_ids: torch.Tensor, features: Any = None) -> _NGramState:
        """``input_ids [n+1]``: prompt + first token; ``features`` are not used."""
        return _NGramState(input_ids.reshape(-1).tolist())

    def propose(self, states: list[_NGramState], ks: list[int], sampling: SamplingParams | None = None,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Per request, up to ``ks[i]`` drafts (:meth:`_propose_one`); ids only, no randomness.

        Raises:
            SpeculatorsError: list lengths that differ, a negative ``k``, or ``sampling`` not ``B``
                requests' ``SamplingParams``.
        """
        return propose_each(self._propose_one, states, ks, sampling, generators)

    def advance(self, states: list[_NGramState], new_ids: list[torch.Tensor], features: list | None = None) -> None:
        """Append each request's verified tokens ``new_ids[i] [m_i]``; ``features`` are not used.

        Raises:
            SpeculatorsError: list lengths that differ.
        """
        advance_each(self._advance_one, states, new_ids, features)

    def _advance_one(self, state: _NGramState, new_ids: torch.Tensor, features: Any = None) -> None:
        state.tokens.extend(new_ids.reshape(-1).tolist())

    def _propose_one(self, state: _NGramState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Up to ``k`` drafts: the tokens that followed the most recent earlier match of the longest
        suffix n-gram (``max_n`` down to ``min_n``); none without a match. Ids only (``probs=None``,
        point masses) whatever ``sampling`` says, and no randomness (``generator`` unused). The state
        is not modified."""
        toks = state.tokens
        L = len(toks)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = toks[L - n:]
            for start in range(L - n - 1, -1, -1):  # most recent match first
                if toks[start:start + n] == pattern:
                    follow = toks[start + n:start + n + k]
                    if follow:
                        return Proposal(torch.tensor(follow, dtype=torch.int64))
        return Proposal(torch.empty(0, dtype=torch.int64))
