"""Model-free and combined proposers: n-gram, suffix decoding, the hybrid (suffix match, else the neural
drafter) and argmax drafts.

All implement the batched proposer protocol of :class:`speculators.decode.proposal.Proposer`::

    start(input_ids [n+1], features) -> state                      # one request
    propose(states, ks, sampling, generators=None) -> list[Proposal]   # B = len(states), ks[i] may be 0
    advance(states, new_ids: list[Tensor[m_i]], features: list) -> None

so they run in :func:`speculators.decode.loop.speculative_generate` like every drafter family, and are
lossless like any proposer (the rejection sampler decides what is emitted).

* :class:`NGramProposer`: prompt lookup (vLLM ``method: ngram``), the model-free baseline.
* :class:`SuffixProposer` follows arctic-inference's suffix decoding (Oliaro et al., "SuffixDecoding:
  Extreme Speculative Decoding for Emerging AI Applications", 2024; ``arctic_inference.suffix_decoding``):
  a suffix tree of depth at most ``max_depth`` over the request's prompt and generated text, updated
  incrementally as tokens are accepted; the draft is the most frequent continuation of the longest
  suffix of the text that occurred before. Ids only (``probs=None``: point masses for the verifier).
  Unlike arctic-inference it keeps no global tree over earlier requests' outputs (each request is
  independent, so an eval's order of prompts cannot change its numbers) and drafts one path, not a tree.
* :class:`HybridProposer`: per request and per step, the suffix draft where the longest matching suffix
  has at least ``min_match`` tokens, the neural drafter's draft elsewhere. The neural drafter is
  advanced with every verified token whichever proposer drafted, so it can take over at any step.
* :class:`ArgmaxDrafts`: a drafter served the way vLLM serves it by default at temperature > 0
  (``draft_sample_method: greedy``): argmax drafts, verified as point masses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import SpeculatorsError
from .proposal import Proposal, advance_each, check_batch, check_int, propose_each
from ..verify import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)


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
        self.min_n = check_int("NGramProposer min_n", min_n, 1)
        self.max_n = check_int("NGramProposer max_n", max_n, self.min_n)

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


class _Node:
    """One node of the suffix tree: the string spelled by the path from the root.

    ``count``: occurrences of that string in the text; ``last``: end position (index of its last
    token) of its most recent occurrence; ``children``: next token id -> node.
    """

    __slots__ = ("count", "last", "children")

    def __init__(self):
        self.count = 0
        self.last = -1
        self.children: dict[int, _Node] = {}


@dataclass
class SuffixState:
    """One request's suffix tree (depth-capped suffix trie with occurrence counts).

    Attributes:
        tokens: the text so far (prompt + generated, int ids).
        root: the tree's root (the empty string).
        active: ``active[m]`` = the node of the text's last ``m`` tokens, ``m = 0..min(len, max_depth - 1)``
            (the nodes the next token extends: O(max_depth) work per appended token).
    """

    tokens: list[int]
    root: _Node
    active: list[_Node] = field(default_factory=list)


class SuffixProposer:
    """Suffix decoding (arctic-inference): draft the most frequent continuation of the longest matching suffix.

    The request's text ``x_0..x_n`` (prompt + generated) is held in a suffix tree whose node for a
    string ``w`` (``|w| <= max_depth``) counts the occurrences of ``w`` in the text. A step:

    1. match: the longest suffix ``w`` of the text, ``min_match <= |w| <= max_match``, that occurred
       before followed by some token (its node has children; the occurrence at the very end has no
       continuation yet);
    2. continue: from ``w``'s node follow the child with the highest count (ties: the most recent
       occurrence) again and again, up to ``k`` tokens (and while the tree is deep enough:
       ``|w| + drafts <= max_depth``).

    No match gives an empty draft (the step verifies the last token only). Drafts are target ids
    with ``probs=None``; no randomness is used (``sampling`` / ``generators`` are ignored).
    """

    def __init__(self, max_depth: int = 64, max_match: int = 32, min_match: int = 1):
        """``1 <= min_match <= max_match < max_depth``: matched suffix lengths; ``max_depth``: the tree's depth.

        Raises:
            SpeculatorsError: other values (naming the argument).
        """
        self.min_match = check_int("SuffixProposer min_match", min_match, 1)
        self.max_match = check_int("SuffixProposer max_match", max_match, self.min_match)
        self.max_depth = check_int("SuffixProposer max_depth", max_depth, self.max_match + 1)

    # ------------------------------------------------------------------ the suffix tree
    def _extend(self, state: SuffixState, tok: int) -> None:
        pos = len(state.tokens)
        state.tokens.append(tok)
        new = [state.root]
        for node in state.active:  # suffixes of lengths 0..max_depth-1 ending before tok
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node()
            child.count += 1
            child.last = pos
            new.append(child)
        state.active = new[:self.max_depth]  # lengths 0..max_depth-1 can still be extended

    def start(self, input_ids: torch.Tensor, features: Any = None) -> SuffixState:
        """The tree of ``input_ids [n+1]`` (prompt + first token, int64); ``features`` are not used."""
        state = SuffixState([], _Node())
        state.active = [state.root]
        for t in input_ids.reshape(-1).tolist():
            self._extend(state, int(t))
        return state

    def _advance_one(self, state: SuffixState, new_ids: torch.Tensor, features: Any = None) -> None:
        for t in new_ids.reshape(-1).tolist():
            self._extend(state, int(t))

    def advance(self, states: list[SuffixState], new_ids: list[torch.Tensor], features: list | None = None) -> None:
        """Append each request's verified tokens ``new_ids[i] [m_i]`` to its tree (O(max_depth) per token)."""
        if len(new_ids) != len(states):
            raise SpeculatorsError(f"SuffixProposer.advance: {len(new_ids)} new_ids for {len(states)} states")
        for s, ids in zip(states, new_ids):
            self._advance_one(s, ids)

    def match(self, state: SuffixState, k: int) -> tuple[list[int], int]:
        """``(drafts, match_len)``: up to ``k`` draft ids and the length of the matched suffix (0 and no
        drafts without a match of at least ``min_match`` tokens). The state is not modified."""
        hi = min(self.max_match, len(state.active) - 1)
        for m in range(hi, self.min_match - 1, -1):
            node = state.active[m]
            if not node.children:
                continue  # only shorter suffixes can have occurred earlier with a continuation
            out: list[int] = []
            depth = m
            while len(out) < k and node.children and depth < self.max_depth:
                tok, node = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
                out.append(tok)
                depth += 1
            return out, m
        return [], 0

    def _propose_one(self, state: SuffixState, k: int, sampling=None, generator=None) -> Proposal:
        drafts, _ = self.match(state, k) if k > 0 else ([], 0)
        return Proposal(torch.tensor(drafts, dtype=torch.int64) if drafts else _EMPTY.clone())

    def propose(self, states: list[SuffixState], ks: list[int], sampling=None,
                generators: list | None = None) -> list[Proposal]:
        """One :class:`Proposal` per request: up to ``ks[i]`` draft ids (``[k'_i]`` int64, ``probs=None``).

        Raises:
            SpeculatorsError: ``ks`` not one non-negative integer per state.
        """
        ks = check_batch(states, ks, who="SuffixProposer.propose")
        return [self._propose_one(s, k) for s, k in zip(states, ks)]


@dataclass
class HybridState:
    """One request's state: the neural drafter's and the suffix proposer's. ``source``: who drafted the
    last proposal (``"suffix"``, ``"drafter"`` or None before the first)."""

    neural: Any
    lookup: SuffixState
    source: str | None = None


class HybridProposer:
    """The suffix draft where its match is long enough, the neural drafter's draft elsewhere.

    Per request and step: when :meth:`SuffixProposer.match` finds a suffix of at least ``min_match``
    tokens with a continuation, the step's draft is the suffix draft (ids only, ``probs=None``);
    otherwise the neural drafter drafts (with its distributions). Requests the suffix draft covers
    are passed to the drafter with ``k = 0``, so they draw nothing from their generators; request
    ``i``'s neural draft draws only from ``generators[i]``. Both parts see every verified token.

    Lossless like any proposer: the verifier accepts each draft against its own ``q`` (a point mass
    for suffix drafts). ``counts`` records how many (non-empty) proposals each part made.

    ``propose`` leaves both parts' drafting states unchanged (the protocol's rule); the one thing it
    writes is bookkeeping for the report: ``state.source`` (which part drafted this step) and ``counts``.
    """

    def __init__(self, drafter, lookup: SuffixProposer | None = None, min_match: int = 3,
                 drafter_k: int | None = None):
        """``drafter``: any batched proposer (a drafter family); ``lookup``: the suffix proposer (default
        ``SuffixProposer()``); ``min_match`` >= 1: shortest suffix match that wins over the drafter;
        ``drafter_k`` >= 1: the most drafts the neural drafter proposes in a step (None: the step's K, as
        the suffix draft). A suffix match is free to draft and often long; the drafter's later drafts cost
        a drafter forward and a verified token each and are rarely accepted, so a hybrid may draft K
        tokens by lookup and only ``drafter_k`` by the drafter.

        Raises:
            SpeculatorsError: ``min_match`` < 1 or above the lookup's ``max_match`` (it could never win);
                ``drafter_k`` < 1 or above what the drafter drafts in one step (its
                ``max_speculative_tokens``).
        """
        self.drafter = drafter
        self.lookup = lookup if lookup is not None else SuffixProposer()
        self.min_match = check_int("HybridProposer min_match", min_match, 1)
        if self.min_match > self.lookup.max_match:
            raise SpeculatorsError(f"HybridProposer min_match ({min_match}) must be <= the suffix proposer's "
                                   f"max_match ({self.lookup.max_match})")
        self.drafter_k = None if drafter_k is None else check_int("HybridProposer drafter_k", drafter_k, 1)
        cap = getattr(drafter, "max_speculative_tokens", None)
        if self.drafter_k is not None and cap is not None and self.drafter_k > int(cap):
            raise SpeculatorsError(f"HybridProposer drafter_k ({self.drafter_k}) is more than the drafter drafts "
                                   f"in one step ({int(cap)})")
        self.counts = {"suffix": 0, "drafter": 0}

    @property
    def max_speculative_tokens(self) -> int | None:
        """The K bound of the hybrid: the drafter's when it may be asked for the step's whole K
        (``drafter_k`` None); None (unbounded, like the suffix proposer) when ``drafter_k`` caps the
        drafter's share, since only the lookup then drafts more than ``drafter_k`` tokens."""
        if self.drafter_k is not None:
            return None
        cap = getattr(self.drafter, "max_speculative_tokens", None)
        return None if cap is None else int(cap)

    @property
    def max_speculative_tokens_source(self) -> str:
        """What sets :attr:`max_speculative_tokens`: the drafter's declaration (e.g. ``drafter.num_depths``)."""
        return getattr(self.drafter, "max_speculative_tokens_source", "")

    @property
    def algorithm(self) -> str:
        """The drafter family whose drafts (and K cap) this hybrid uses where the suffix draft does not win."""
        return getattr(self.drafter, "algorithm", "") or type(self.drafter).__name__

    def confidence_calibration(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafter's declared confidence calibration (temperatures ``[B]``, shifts ``[B]``), or None:
        the suffix drafts carry no confidences, the drafter's are calibrated as its own
        (:mod:`speculators.decode.gating`)."""
        get = getattr(self.drafter, "confidence_calibration", None)
        return get() if callable(get) else None

    def start(self, input_ids: torch.Tensor, features: Any) -> HybridState:
        """Start both parts on ``input_ids [n+1]`` and the prompt's target ``features``."""
        return HybridState(self.drafter.start(input_ids, features), self.lookup.start(input_ids, features))

    def propose(self, states: list[HybridState], ks: list[int], sampling=None,
                generators: list | None = None) -> list[Proposal]:
        """One :class:`Proposal` per request (see the class docstring for the switching rule).

        Raises:
            SpeculatorsError: ``ks`` not one non-negative integer per state; the drafter returned another
                number of proposals than requests.
        """
        ks = check_batch(states, ks, who="HybridProposer.propose")
        out: list[Proposal | None] = [None] * len(states)
        neural_ks = [0] * len(states)
        for i, (s, k) in enumerate(zip(states, ks)):
            if k == 0:
                out[i] = Proposal(_EMPTY.clone())
                continue
            drafts, m = self.lookup.match(s.lookup, k)
            if drafts and m >= self.min_match:
                out[i] = Proposal(torch.tensor(drafts, dtype=torch.int64))
                s.source = "suffix"
                self.counts["suffix"] += 1
            else:
                neural_ks[i] = k if self.drafter_k is None else min(k, self.drafter_k)
        if any(neural_ks):
            props = self.drafter.propose([s.neural for s in states], neural_ks, sampling, generators)
            if len(props) != len(states):
                raise SpeculatorsError(f"HybridProposer: the drafter returned {len(props)} proposals for "
                                       f"{len(states)} requests")
            for i, k in enumerate(neural_ks):
                if k:
                    out[i] = props[i]
                    states[i].source = "drafter"
                    self.counts["drafter"] += 1
        return out  # type: ignore[return-value]

    def advance(self, states: list[HybridState], new_ids: list[torch.Tensor], features: list) -> None:
        """Advance both parts of every request with its verified tokens and their target features."""
        self.drafter.advance([s.neural for s in states], new_ids, features)
        self.lookup.advance([s.lookup for s in states], new_ids, features)


class ArgmaxDrafts:
    """A proposer whose drafts are its argmax tokens, verified as point masses: vLLM's default serving
    convention at temperature > 0.

    vLLM's ``--speculative-config`` field ``draft_sample_method`` (vLLM ``config/speculative.py``;
    ``v1/sample/rejection_sampler.py``) is ``"greedy"`` by default: the drafter's tokens are the argmax of
    its logits whatever the request's temperature, no draft probabilities are kept, and the rejection
    sampler treats each draft as a one-hot ``q`` (accept ``d_i`` with probability ``p_i(d_i)``; on
    rejection recover from ``p_i`` with ``d_i`` removed). ``draft_sample_method: "probabilistic"`` samples
    the drafts from the drafter's distribution and verifies them against it (``min(1, p/q)``): that is
    what the wrapped proposer does by itself. Both are lossless; their acceptance differs, so an eval at
    temperature > 0 reports the drafter under both (:func:`speculators.evaluation.runner.run_eval`).

    Wraps any batched proposer (:class:`speculators.decode.proposal.Proposer`): ``propose`` asks it for greedy
    drafts (``sampling=None``, no generators: nothing is drawn from the request's random stream) and
    drops their distributions (``probs=None``); confidence logits are kept. ``start`` / ``advance`` and
    the K cap are the wrapped proposer's. At temperature 0 the wrapper changes nothing.
    """

    def __init__(self, proposer):
        """``proposer``: a batched proposer, e.g. a drafter family."""
        self.inner = proposer

    @property
    def max_speculative_tokens(self) -> int | None:
        """The wrapped proposer's K bound (None: unbounded)."""
        cap = getattr(self.inner, "max_speculative_tokens", None)
        return None if cap is None else int(cap)

    @property
    def max_speculative_tokens_source(self) -> str:
        """What sets the wrapped proposer's K cap (its declaration, e.g. ``drafter.block_size - 1``)."""
        return getattr(self.inner, "max_speculative_tokens_source", "")

    @property
    def algorithm(self) -> str:
        """The wrapped proposer's family name (its class name when it has none)."""
        return getattr(self.inner, "algorithm", "") or type(self.inner).__name__

    def confidence_calibration(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The wrapped proposer's declared confidence calibration (temperatures ``[B]``, shifts ``[B]``),
        or None: the confidence logits are kept, so they are calibrated as the wrapped proposer's
        (:mod:`speculators.decode.gating`)."""
        get = getattr(self.inner, "confidence_calibration", None)
        return get() if callable(get) else None

    def start(self, input_ids: torch.Tensor, features: Any) -> Any:
        """The wrapped proposer's state for ``input_ids [n+1]`` and the prompt's target ``features``."""
        return self.inner.start(input_ids, features)

    def propose(self, states: list, ks: list[int], sampling=None, generators: list | None = None) -> list[Proposal]:
        """One :class:`Proposal` per request: the wrapped proposer's greedy drafts ``[k_i]`` (target ids)
        with ``probs=None``. ``sampling`` and ``generators`` are not used (argmax drafts draw nothing).

        Raises:
            SpeculatorsError: ``ks`` not one non-negative integer per state; the wrapped proposer returned
                another number of proposals than requests.
        """
        ks = check_batch(states, ks, who="ArgmaxDrafts.propose")
        props = self.inner.propose(states, ks, None, None)
        if len(props) != len(states):
            raise SpeculatorsError(f"ArgmaxDrafts: the wrapped proposer returned {len(props)} proposals for "
                                   f"{len(states)} requests")
        return [Proposal(p.token_ids, None, p.confidence_logits) for p in props]

    def advance(self, states: list, new_ids: list[torch.Tensor], features: list) -> None:
        """The wrapped proposer's ``advance``."""
        self.inner.advance(states, new_ids, features)
