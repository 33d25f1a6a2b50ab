"""Suffix decoding against a brute force over the token list, and the hybrid proposer's switching rule."""

from __future__ import annotations

import random

import pytest
import torch

from speculators.decode.proposal import Proposal
from speculators.errors import SpeculatorsError
from speculators.decode.proposers import HybridProposer, SuffixProposer


def brute_force(tokens: list[int], k: int, min_match: int, max_match: int, max_depth: int) -> tuple[list[int], int]:
    """The documented rule, by scanning the text: longest suffix w (min_match..max_match) with an earlier
    occurrence followed by a token; then repeatedly the most frequent next token of w + drafts (ties: the
    most recent occurrence), while |w| + drafts < max_depth."""
    n = len(tokens)

    def followers(s: list[int]) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        L = len(s)
        for i in range(n - L):  # occurrence at i..i+L-1 followed by tokens[i+L]
            if tokens[i:i + L] == s:
                c = tokens[i + L]
                cnt, last = out.get(c, (0, -1))
                out[c] = (cnt + 1, max(last, i + L))
        return out

    for m in range(min(max_match, n), min_match - 1, -1):
        w = tokens[n - m:]
        if not followers(w):
            continue
        drafts: list[int] = []
        while len(drafts) < k and m + len(drafts) < max_depth:
            f = followers(w + drafts)
            if not f:
                break
            drafts.append(max(f.items(), key=lambda kv: kv[1])[0])
        return drafts, m
    return [], 0


def texts():
    rng = random.Random(0)
    out = [[1, 2, 3, 1, 2, 3, 1, 2], [5] * 12, [1, 2, 1, 3, 1, 2, 1, 3, 1], [7, 8, 9]]
    for _ in range(40):  # small alphabets: many repeats, ties and long matches
        n, v = rng.randint(2, 40), rng.randint(2, 5)
        out.append([rng.randrange(v) for _ in range(n)])
    return out


@pytest.mark.parametrize("min_match, max_match, max_depth", [(1, 32, 64), (2, 4, 6), (1, 3, 4)])
def test_suffix_tree_matches_brute_force(min_match, max_match, max_depth):
    sp = SuffixProposer(max_depth=max_depth, max_match=max_match, min_match=min_match)
    for toks in texts():
        for k in (1, 3, 8):
            got = sp.match(sp.start(torch.tensor(toks)), k)
            assert got == brute_force(toks, k, min_match, max_match, max_depth), (toks, k)


def test_suffix_tree_is_updated_incrementally():
    """start on a prefix + advance in ragged chunks == start on the whole text, at every step."""
    sp = SuffixProposer(max_depth=8, max_match=5)
    for toks in texts():
        s = sp.start(torch.tensor(toks[:2]))
        i = 2
        rng = random.Random(len(toks))
        while i < len(toks):
            m = rng.randint(1, 4)
            sp.advance([s], [torch.tensor(toks[i:i + m])], [None])
            i += m
            assert sp.match(s, 6) == brute_force(toks[:i], 6, 1, 5, 8)
        assert s.tokens == toks


def test_suffix_propose_batched_and_pure():
    sp = SuffixProposer()
    a, b = sp.start(torch.tensor([4, 5, 6, 4, 5])), sp.start(torch.tensor([1, 2, 3]))
    before = (list(a.tokens), len(a.active))
    props = sp.propose([a, b, a], [2, 3, 0])
    assert [p.token_ids.tolist() for p in props] == [[6, 4], [], []]
    assert all(p.probs is None and p.token_ids.dtype == torch.int64 for p in props)
    assert (list(a.tokens), len(a.active)) == before  # propose leaves the state as it found it
    assert sp.propose([a], [2])[0].token_ids.tolist() == [6, 4]
    with pytest.raises(SpeculatorsError, match="ks"):
        sp.propose([a, b], [1])
    with pytest.raises(SpeculatorsError, match=r"ks\[0\]"):
        sp.propose([a], [-1])


@pytest.mark.parametrize("kw, match", [({"min_match": 0}, "min_match"), ({"max_match": 70}, "max_depth"),
                                       ({"min_match": 4, "max_match": 3}, "max_match")])
def test_suffix_bad_arguments(kw, match):
    with pytest.raises(SpeculatorsError, match=match):
        SuffixProposer(**kw)


class FakeDrafter:
    """A batched drafter that records what it was asked; drafts token 99 with a uniform q."""

    def __init__(self):
        self.calls, self.advanced = [], []

    def start(self, input_ids, features):
        return {"n": int(input_ids.numel())}

    def propose(self, states, ks, sampling=None, generators=None):
        self.calls.append((list(ks), generators))
        return [Proposal(torch.full((k,), 99, dtype=torch.int64), torch.full((k, 100), 0.01)) for k in ks]

    def advance(self, states, new_ids, features):
        self.advanced.append([int(x.numel()) for x in new_ids])
        for s, x in zip(states, new_ids):
            s["n"] += int(x.numel())


def test_hybrid_switches_on_the_match_length():
    fake = FakeDrafter()
    hy = HybridProposer(fake, min_match=3)
    long_match = hy.start(torch.tensor([1, 2, 3, 9, 1, 2, 3]), None)  # suffix [1, 2, 3] seen before -> [9, ...]
    short_match = hy.start(torch.tensor([1, 2, 3, 9, 4, 2, 3]), None)  # longest earlier suffix: [2, 3] (2 < 3)
    no_match = hy.start(torch.tensor([1, 2, 3, 4]), None)
    zero_k = hy.start(torch.tensor([1, 2, 3, 9, 1, 2, 3]), None)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    props = hy.propose([long_match, short_match, no_match, zero_k], [3, 3, 2, 0], None, gens)
    assert props[0].token_ids.tolist() == [9, 1, 2] and props[0].probs is None
    assert props[1].token_ids.tolist() == [99] * 3 and props[1].probs.shape == (3, 100)
    assert props[2].token_ids.tolist() == [99] * 2
    assert props[3].token_ids.numel() == 0
    # ONE drafter call for the batch; suffix-covered and k=0 requests get k=0 (draw nothing); generators kept
    assert fake.calls == [([0, 3, 2, 0], gens)]
    assert [s.source for s in (long_match, short_match, no_match)] == ["suffix", "drafter", "drafter"]
    assert hy.counts == {"suffix": 1, "drafter": 2}
    # with min_match 2 the short match wins too
    hy2 = HybridProposer(FakeDrafter(), min_match=2)
    s = hy2.start(torch.tensor([1, 2, 3, 9, 4, 2, 3]), None)
    assert hy2.propose([s], [2])[0].token_ids.tolist() == [9, 4]
    # all covered by the suffix: the drafter is not called at all
    hy3 = HybridProposer(fake2 := FakeDrafter(), min_match=1)
    s = hy3.start(torch.tensor([5, 6, 5]), None)
    assert hy3.propose([s], [1])[0].token_ids.tolist() == [6] and fake2.calls == []


def test_hybrid_advances_both_parts_every_step():
    fake = FakeDrafter()
    hy = HybridProposer(fake, min_match=2)
    s = hy.start(torch.tensor([1, 2, 3, 1]), None)
    hy.propose([s], [2])
    hy.advance([s], [torch.tensor([2, 3])], [None])  # the suffix drafted this step; the drafter still sees it
    assert s.neural["n"] == 6 and s.lookup.tokens == [1, 2, 3, 1, 2, 3]
    assert fake.advanced == [[2]]
    # now [1, 2, 3] matches (length 3): the suffix proposes the continuation [1, 2, 3]
    assert hy.propose([s], [3])[0].token_ids.tolist() == [1, 2, 3]


def test_hybrid_drafter_k_caps_only_the_drafter():
    """``drafter_k``: the neural drafter proposes at most drafter_k drafts; a suffix match still drafts K."""
    fake = FakeDrafter()
    hy = HybridProposer(fake, min_match=3, drafter_k=1)
    long_match = hy.start(torch.tensor([1, 2, 3, 9, 1, 2, 3]), None)
    no_match = hy.start(torch.tensor([1, 2, 3, 4]), None)
    props = hy.propose([long_match, no_match], [3, 3])
    assert props[0].token_ids.tolist() == [9, 1, 2]  # the suffix draft keeps K = 3
    assert props[1].token_ids.tolist() == [99]  # the drafter is capped at 1
    assert fake.calls == [([0, 1], None)]
    with pytest.raises(SpeculatorsError, match="drafter_k"):
        HybridProposer(FakeDrafter(), drafter_k=0)


def test_hybrid_k_bound_follows_drafter_k():
    """Review finding: the K check read the drafter's cap even when drafter_k keeps the drafter under it,
    so a hybrid whose lookup may draft K = 6 beside a 3-draft drafter capped at 2 was refused."""
    from speculators.decode.proposal import check_speculative_tokens

    capped = FakeDrafter()
    capped.max_speculative_tokens = 3
    check_speculative_tokens(HybridProposer(capped, drafter_k=2), [6])  # the lookup drafts 6, the drafter 2
    assert HybridProposer(capped, drafter_k=2).max_speculative_tokens is None
    assert HybridProposer(capped).max_speculative_tokens == 3
    with pytest.raises(SpeculatorsError, match="k=6"):
        check_speculative_tokens(HybridProposer(capped), [6])  # the drafter would be asked for 6
    with pytest.raises(SpeculatorsError, match=r"drafter_k \(4\) is more than the drafter drafts in one step \(3\)"):
        HybridProposer(capped, drafter_k=4)


def test_hybrid_bad_min_match():
    with pytest.raises(SpeculatorsError, match="min_match"):
        HybridProposer(FakeDrafter(), min_match=0)
    with pytest.raises(SpeculatorsError, match="max_match"):
        HybridProposer(FakeDrafter(), SuffixProposer(max_match=4), min_match=5)
