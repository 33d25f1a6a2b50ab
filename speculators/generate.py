"""Generation: plain target decoding, speculative decoding with any proposer, and the n-gram proposer.

The speculative loop follows what a serving engine does for one request (vLLM's spec-decode step):

1. prefill the prompt with the target (KV cache), sample the first token;
2. the proposer drafts up to K tokens from its own state;
3. ONE target forward over ``[last token, d_1..d_K]`` gives K+1 distributions (and target features);
4. the rejection sampler (:func:`speculators.verify.rejection_sample`) accepts a prefix and emits a
   recovered or bonus token;
5. the target KV cache is cropped to the accepted prefix; the proposer is advanced with the accepted
   tokens and their target features.

The step's tokens are emitted up to the first stop token (:func:`resolve_stop_ids`: the target's
tokenizer EOS, ``generation_config`` EOS ids and chat-template end-of-turn, or explicit ``eos_ids``)
and ``max_new_tokens``; the request ends there, and :class:`GenerationResult` records per step what
was verified and what was emitted, so that the statistics count only emitted tokens.

Plain decoding runs the same sampler with zero drafts, so both paths share one sampling code path:
at temperature 0 the speculative output must equal plain greedy decoding token for token.

A proposer is anything that implements :class:`Proposer`: ``start(input_ids, features) -> state``,
``propose(state, k, sampling, generator=None) -> Proposal`` and ``advance(state, new_ids, features)``
(every :class:`speculators.drafters.Drafter`, and :class:`NGramProposer`). ``sampling`` is the
verifier's own :class:`speculators.verify.SamplingParams` for the one request being decoded (the ONE
sampling-settings type: eval and the CLI build it with ``SamplingParams.uniform(1, temperature, top_k,
top_p, seed=...)``), so drafts and the verifier apply the same temperature / top-k / top-p.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .drafters.base import Proposal
from .errors import SpeculatorsError
from .verify import SamplingParams, rejection_sample


@runtime_checkable
class Proposer(Protocol):
    """What the speculative loop needs from a proposer (a drafter family or a model-free proposer).

    Inference protocol (features lag tokens by one): after ``start``/``advance`` the proposer has seen
    tokens ``x_0..x_n`` and target features of positions ``0..n-1``; ``x_n`` is the newest (bonus or
    recovered) token, not yet run through the target.
    """

    def start(self, input_ids: torch.Tensor, features: Any) -> Any:
        """Begin a request: ``input_ids [n+1]`` int64 (prompt + first target token), ``features`` the
        target's :class:`speculators.target.TargetFeatures` of positions ``0..n-1``. Returns the
        proposer's per-request state."""
        ...

    def propose(self, state: Any, k: int, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """Up to ``k`` drafts for the next positions, as a :class:`Proposal` (target-vocabulary ids
        ``[k']``, ``k' <= k``, and the ``[k', V]`` float32 draft distributions or None for point
        masses). ``sampling``: the request's :class:`speculators.verify.SamplingParams` (batch of one;
        ``None`` = greedy); ``generator``: the torch generator to draw drafts from (default: the
        request's own ``sampling.generators[0]``, else torch's global RNG). Must leave ``state`` as
        it found it (what ``advance`` sees is the same with or without a ``propose`` before it)."""
        ...

    def advance(self, state: Any, new_ids: torch.Tensor, features: Any) -> None:
        """Append the ``m`` verified tokens ``new_ids [m]`` (accepted drafts + the recovered/bonus
        token) and the target features of positions ``n..n+m-1``; updates ``state`` in place."""
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
        seconds: wall time of prefill + decode.
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


@torch.no_grad()
def plain_decode(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_ids: set[int] | None = None, seed: int | None = None) -> GenerationResult:
    """Decode with the target alone, one token per forward (the baseline speculative decoding must match).

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
        SpeculatorsError: ``max_new_tokens`` < 1, ``eos_ids`` not token ids, a non-integer ``seed``, or
            ``sampling`` not one request's valid ``SamplingParams``.
    """
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    eos = resolve_stop_ids(target, eos_ids)
    params = _request_params(sampling, seed)
    t0 = time.perf_counter()
    sess = target.session()
    logits, _ = sess.forward(torch.tensor(prompt_ids))
    out: list[int] = []
    result = GenerationResult(out)
    empty = torch.empty(0, dtype=torch.int64)
    first = True
    while True:
        res = rejection_sample(empty, [0], None, logits[-1:], params, validate=False)
        tok = int(res.output_token_ids[0, 0])
        before = len(out)
        done = _emit_until(out, [tok], max_new_tokens, eos)
        if not first:  # the prefill's token belongs to no step
            result.add_step(0, 0, len(out) - before)
        first = False
        if done:
            break
        logits, _ = sess.forward(torch.tensor([tok]))
    result.seconds = time.perf_counter() - t0
    return result


@torch.no_grad()
def speculative_decode(target, proposer, prompt_ids: list[int], k: int, max_new_tokens: int,
                       sampling: SamplingParams | None = None, eos_ids: set[int] | None = None,
                       seed: int | None = None) -> GenerationResult:
    """Speculative decoding of one request with ``proposer`` drafting up to ``k`` tokens per step.

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
        proposer: a :class:`Proposer` (a drafter or :class:`NGramProposer`); its ``propose`` gets the
            request's ``SamplingParams`` and the request's generator (the verifier draws from the same
            generator, after the drafts).
        prompt_ids: prompt token ids.
        k: max drafts per step (``num_speculative_tokens``, >= 0).
        max_new_tokens: cap on generated tokens (>= 1).
        sampling, eos_ids, seed: as :func:`plain_decode`.
    Raises:
        SpeculatorsError: bad ``k`` / ``max_new_tokens`` / ``eos_ids`` / ``seed`` / ``sampling``, or a
            proposer that returned more drafts than asked for.
    """
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    k = _check_int("k (drafts per step)", k, 0)
    eos = resolve_stop_ids(target, eos_ids)
    params = _request_params(sampling, seed)
    gen = params.generators[0] if params.generators else None
    t0 = time.perf_counter()
    sess = target.session()
    prompt = torch.tensor(prompt_ids)
    logits, feats = sess.forward(prompt)
    empty = torch.empty(0, dtype=torch.int64)
    first = int(rejection_sample(empty, [0], None, logits[-1:], params, validate=False).output_token_ids[0, 0])
    out: list[int] = []
    result = GenerationResult(out)
    if _emit_until(out, [first], max_new_tokens, eos):
        result.seconds = time.perf_counter() - t0
        return result
    state = proposer.start(torch.cat([prompt, torch.tensor([first])]), feats)
    last = first
    while True:
        k_eff = min(k, max_new_tokens - len(out) - 1)
        prop: Proposal = proposer.propose(state, k_eff, params, gen) if k_eff > 0 else Proposal(empty)
        drafts = prop.token_ids.reshape(-1).to(torch.int64)
        n = int(drafts.numel())
        if n > max(k_eff, 0):
            raise SpeculatorsError(f"proposer {type(proposer).__name__} returned {n} drafts when asked for "
                                   f"at most {max(k_eff, 0)}")
        L = sess.length
        logits, feats = sess.forward(torch.cat([torch.tensor([last]), drafts]))
        res = rejection_sample(drafts, [n], prop.probs, logits, params, validate=False)
        a = int(res.num_accepted[0])
        step_tokens = res.output_token_ids[0, :a + 1]
        sess.crop(L + a + 1)
        before = len(out)
        done = _emit_until(out, step_tokens.tolist(), max_new_tokens, eos)
        result.add_step(n, a, len(out) - before)
        if done:
            break
        proposer.advance(state, step_tokens, feats.slice(0, a + 1))
        last = int(step_tokens[-1])
    result.seconds = time.perf_counter() - t0
    return result


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
    ids only (``probs=None``): the verifier treats them as point masses.
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

    def advance(self, state: _NGramState, new_ids: torch.Tensor, features: Any = None) -> None:
        """Append the verified tokens ``new_ids [m]``; ``features`` are not used."""
        state.tokens.extend(new_ids.reshape(-1).tolist())

    def propose(self, state: _NGramState, k: int, sampling: SamplingParams | None = None,
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
