"""Generation: plain target decoding, speculative decoding with any proposer, and the n-gram proposer.

The speculative loop follows what a serving engine does for one request (vLLM's spec-decode step):

1. prefill the prompt with the target (KV cache), sample the first token;
2. the proposer drafts up to K tokens from its own state;
3. ONE target forward over ``[last token, d_1..d_K]`` gives K+1 distributions (and target features);
4. the rejection sampler (:func:`speculators.verify.rejection_sample`) accepts a prefix and emits a
   recovered or bonus token;
5. the target KV cache is cropped to the accepted prefix; the proposer is advanced with the accepted
   tokens and their target features.

Plain decoding runs the same sampler with zero drafts, so both paths share one sampling code path:
at temperature 0 the speculative output must equal plain greedy decoding token for token.

A proposer is any object with ``start(input_ids, features)``, ``propose(state, k, temperature,
top_k, top_p, generator) -> Proposal`` and ``advance(state, new_ids, features)`` (every
:class:`speculators.drafters.Drafter`, and :class:`NGramProposer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafters.base import Proposal
from .verify import SamplingParams, rejection_sample


@dataclass
class Sampling:
    """Per-request sampling settings (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def params(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams.uniform(1, self.temperature, self.top_k, self.top_p, seed=seed)


@dataclass
class GenerationResult:
    """One decoded request.

    Attributes:
        tokens: generated token ids (prompt excluded; EOS included when emitted).
        accepted: per verification step, number of accepted drafts (speculative only).
        drafted: per verification step, number of drafts proposed.
        seconds: wall time of prefill + decode.
        target_forwards: number of target forwards (prefill excluded).
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    target_forwards: int = 0


def _emit_until(out: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
    """Append ``new`` to ``out`` up to ``max_new`` tokens or the first EOS; True when finished."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= max_new:
            return True
    return False


@torch.no_grad()
def plain_decode(target, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos_ids: set[int] | None = None, seed: int | None = None) -> GenerationResult:
    """Decode with the target alone, one token per forward (the baseline speculative decoding must match).

    Args:
        target: :class:`speculators.target.Target`.
        prompt_ids: prompt token ids (rendered with the chat template).
        max_new_tokens: cap on generated tokens.
        eos_ids: stop tokens (default: the tokenizer's EOS).
    """
    eos = _eos(target, eos_ids)
    params = sampling.params(seed)
    t0 = time.perf_counter()
    sess = target.session()
    logits, _ = sess.forward(torch.tensor(prompt_ids))
    out: list[int] = []
    forwards = 0
    empty = torch.empty(0, dtype=torch.int64)
    while True:
        res = rejection_sample(empty, [0], None, logits[-1:], params, validate=False)
        tok = int(res.output_token_ids[0, 0])
        if _emit_until(out, [tok], max_new_tokens, eos):
            break
        logits, _ = sess.forward(torch.tensor([tok]))
        forwards += 1
    return GenerationResult(out, seconds=time.perf_counter() - t0, target_forwards=forwards)


@torch.no_grad()
def speculative_decode(target, proposer, prompt_ids: list[int], k: int, max_new_tokens: int,
                       sampling: Sampling = Sampling(), eos_ids: set[int] | None = None,
                       seed: int | None = None) -> GenerationResult:
    """Speculative decoding of one request with ``proposer`` drafting up to ``k`` tokens per step.

    Every step runs one target forward over the last token and the drafts, then
    :func:`speculators.verify.rejection_sample` (lossless: the output has the target's distribution;
    at temperature 0 it equals :func:`plain_decode` token for token).
    """
    eos = _eos(target, eos_ids)
    params = sampling.params(seed)
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
        prop: Proposal = proposer.propose(state, k_eff, sampling.temperature, sampling.top_k,
                                          sampling.top_p, gen) if k_eff > 0 else Proposal(empty)
        drafts = prop.token_ids.to(torch.int64)
        n = int(drafts.numel())
        L = sess.length
        logits, feats = sess.forward(torch.cat([torch.tensor([last]), drafts]))
        res = rejection_sample(drafts, [n], prop.probs, logits, params, validate=False)
        a = int(res.num_accepted[0])
        emitted = res.output_token_ids[0, :a + 1]
        sess.crop(L + a + 1)
        result.accepted.append(a)
        result.drafted.append(n)
        result.target_forwards += 1
        if _emit_until(out, emitted.tolist(), max_new_tokens, eos):
            break
        proposer.advance(state, emitted, feats.slice(0, a + 1))
        last = int(emitted[-1])
    result.seconds = time.perf_counter() - t0
    return result


def _eos(target, eos_ids):
    if eos_ids is not None:
        return set(eos_ids)
    tok = target.tokenizer
    ids = set()
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return ids


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
        self.max_n, self.min_n = max_n, min_n

    def start(self, input_ids: torch.Tensor, features=None) -> _NGramState:
        return _NGramState(input_ids.reshape(-1).tolist())

    def advance(self, state: _NGramState, new_ids: torch.Tensor, features=None) -> None:
        state.tokens.extend(new_ids.reshape(-1).tolist())

    def propose(self, state: _NGramState, k: int, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generator=None) -> Proposal:
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
