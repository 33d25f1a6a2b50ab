"""Draft trees from the PARALLEL drafters (Medusa-style trees): slot_tree against a brute-force expansion,
each family's one-wide tree against its greedy chain, DSpark's parent-conditioned children against a hand
computation (and a parent-blind variant that must be caught), greedy tree decoding against plain greedy
decoding, and the states left as found."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.dflash import DFlashConfig, DFlashDrafter
from speculators.drafters.dspark import DSparkConfig, DSparkDrafter
from speculators.drafters.tree_drafting import slot_tree
from speculators.decode.loop import speculative_generate
from speculators.target import build_tiny_target
from speculators.decode.tree_spec import TreeSpec

STATIC = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]"


# ---------------------------------------------------------------- slot_tree against brute force
def brute_dynamic(cond_logp, depth: int, topk: int, total: int) -> set[tuple[int, ...]]:
    """The EAGLE-2 expansion written out over token paths: level d's candidates are every frontier path's
    top-k children under ``cond_logp(d, parent token or None) -> [N]`` log-probs; the next frontier is the
    top-k candidates of the level; the kept set is the ``total`` best candidates of all levels."""
    cands: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(0.0, ())]
    for d in range(1, depth + 1):
        level = []
        for score, path in frontier:
            lp = cond_logp(d, path[-1] if path else None)
            for t in torch.topk(lp, min(topk, lp.numel())).indices.tolist():
                level.append((score + float(lp[t]), path + (t,)))
        cands += level
        frontier = sorted(level, key=lambda c: -c[0])[:topk]
    return {p for _, p in sorted(cands, key=lambda c: -c[0])[:total]}


def tree_paths(tree) -> list[tuple[int, ...]]:
    tok, par = tree.token_ids.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(tok)):
        path, w = [], i
        while w >= 0:
            path.insert(0, tok[w])
            w = par[w]
        out.append(tuple(path))
    return out


@pytest.mark.parametrize("depth,topk,total", [(3, 3, 8), (4, 2, 9), (2, 4, 20), (3, 1, 3)])
def test_slot_tree_dynamic_equals_brute_force(depth, topk, total):
    g = torch.Generator().manual_seed(depth * 10 + topk)
    R, D, N = 3, 4, 9
    logits = torch.randn(R, D, N, generator=g) * 2
    spec = TreeSpec(depth=depth, topk=topk, total_tokens=total)
    trees = slot_tree(logits, spec, None, [depth] * R)
    for r, tree in enumerate(trees):
        lp = torch.log_softmax(logits[r], -1)
        want = brute_dynamic(lambda d, _prev: lp[d - 1], min(depth, D), topk, total)
        got = tree_paths(tree)
        assert len(got) == len(set(got)) == min(total, len(want))
        assert set(got) == want
        assert all(p < i for i, p in enumerate(tree.parents.tolist())) and tree.probs is None


def test_slot_tree_with_child_logits_equals_brute_force():
    """With a parent-dependent ``child_logits`` each node's children follow its own token."""
    g = torch.Generator().manual_seed(3)
    R, D, N = 2, 3, 8
    base = torch.randn(R, D, N, generator=g)
    markov = torch.randn(N, N, generator=g) * 2  # row = previous token

    def child(depth, parent_tokens):
        return base[:, depth - 1].unsqueeze(1) + markov[parent_tokens]

    spec = TreeSpec(depth=3, topk=3, total_tokens=10)
    trees = slot_tree(base, spec, None, [3, 3], child)
    for r, tree in enumerate(trees):
        def cond(d, prev, r=r):
            return torch.log_softmax(base[r, d - 1] + (0 if prev is None else markov[prev]), -1)
        assert set(tree_paths(tree)) == brute_dynamic(cond, 3, 3, 10)
        blind = slot_tree(base, spec, None, [3, 3])[r]  # ignoring the parent gives other trees here
        assert set(tree_paths(blind)) != set(tree_paths(tree))


def test_slot_tree_static_takes_each_slot_by_rank_and_maps_draft_ids():
    g = torch.Generator().manual_seed(7)
    R, D, N = 2, 3, 6
    logits = torch.randn(R, D, N, generator=g)
    d2t = torch.arange(N) * 3  # draft id i -> target id 4i
    spec = TreeSpec.static(STATIC)
    trees = slot_tree(logits, spec, d2t, [3, 2])
    for r, tree in enumerate(trees):
        order = torch.argsort(logits[r], dim=-1, descending=True)  # [D, N] draft ids by rank
        paths = [p for p in spec.paths if len(p) <= [3, 2][r]]
        assert tree_paths(tree) == [tuple(4 * int(order[d, rk]) for d, rk in enumerate(p)) for p in paths]


def test_slot_tree_caps_and_empty():
    logits = torch.randn(3, 2, 5)
    full, one, none = slot_tree(logits, TreeSpec(depth=4, topk=2, total_tokens=6), None, [4, 1, 0])
    assert int(full.depths().max()) == 2 and full.num_nodes == 6  # no slot beyond D
    assert int(one.depths().max()) == 1 and none.num_nodes == 0
    with pytest.raises(ValueError, match="slot_logits"):
        slot_tree(torch.randn(2, 5), TreeSpec(), None, [1, 1])


# ---------------------------------------------------------------- the families
V_SMALL, V_BLOCK = 96, 128


def _randomise(d, scale=0.3):
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
            elif p.requires_grad:
                p.normal_(0, scale)


def make_family(name: str):
    """(target, drafter) in eval mode with random non-zero weights; every family drafts >= 3 tokens per step."""
    torch.manual_seed(0)
    if name in ("dflash", "dspark"):
        target = build_tiny_target(vocab_size=V_BLOCK, hidden_size=32, num_layers=2, seed=1)
        if name == "dflash":
            d = DFlashDrafter.from_target(DFlashConfig(block_size=4, num_layers=2, num_anchors=64), target,
                                          DraftVocab.full(V_BLOCK))
        else:
            d = DSparkDrafter.from_target(DSparkConfig(block_size=4, num_layers=2, num_anchors=64, markov_rank=8,
                                                       draft_vocab_size=64), target,
                                          DraftVocab.from_counts(torch.arange(V_BLOCK, 0, -1), 64))
        _randomise(d)
        if name == "dspark":
            with torch.no_grad():  # a Markov term as large as the head's logits: it reorders the children
                for w in (d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight):
                    w.copy_(torch.randn(w.shape))
        return target, d.eval()
    target = build_tiny_target(vocab_size=V_SMALL, hidden_size=64, num_layers=4, seed=1)
    fam = registry.get(name)
    cfg = fam.config_class(algorithm=name, draft_vocab_size=48)
    counts = torch.randperm(V_SMALL, generator=torch.Generator().manual_seed(123))
    d = fam.from_target(cfg, target, DraftVocab.from_counts(counts, 48))
    _randomise(d, 0.2)
    return target, d.eval()


FAMILIES = ["medusa", "peagle", "dflash", "dspark"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return make_family(request.param)


def started(drafter, target, n, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = V_BLOCK if isinstance(drafter, DFlashDrafter) else V_SMALL
    prefix = torch.randint(0, vocab, (n + 1,), generator=g)
    return drafter.start(prefix, target.features(prefix[None]).slice(0, n))


def test_drafts_trees_declared(family):
    assert getattr(family[1], "drafts_trees", False) is True


def test_one_wide_tree_is_the_greedy_chain(family):
    """topk 1 (dynamic) and the one-branch static tree draft exactly the chain of the same depth, request by
    request (a block drafter's chain shrinks its block with the depth: so must the tree)."""
    target, d = family
    states = [started(d, target, n, s) for n, s in ((9, 0), (5, 1), (12, 2))]
    for depth, caps in ((3, [3, 3, 3]), (3, [3, 2, 1]), (2, [2, 2, 2])):
        ks = [min(depth, c) for c in caps]
        chains = d.propose(states, ks)
        dyn = d.propose_tree(states, TreeSpec(depth=depth, topk=1, total_tokens=depth), caps)
        stat = d.propose_tree(states, TreeSpec.static([(0,) * j for j in range(1, depth + 1)]), caps)
        for c, t1, t2, k in zip(chains, dyn, stat, ks):
            assert t1.token_ids.tolist() == c.token_ids.tolist() == t2.token_ids.tolist()
            assert t1.parents.tolist() == list(range(-1, k - 1)) == t2.parents.tolist()


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return ("T", x.detach().clone())
    if dataclasses.is_dataclass(x) or hasattr(x, "__dict__"):
        return {k: _snapshot(v) for k, v in vars(x).items()}
    if isinstance(x, (list, tuple)):
        return [_snapshot(v) for v in x]
    return copy.deepcopy(x)


def _same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "T":
        return isinstance(b, tuple) and a[1].shape == b[1].shape and torch.equal(a[1], b[1])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_propose_tree_leaves_states_unchanged_and_respects_caps(family):
    target, d = family
    states = [started(d, target, 9, 0), started(d, target, 6, 4), started(d, target, 7, 5)]
    before = [_snapshot(s) for s in states]
    spec = TreeSpec(depth=3, topk=3, total_tokens=10)
    full, cut, none = d.propose_tree(states, spec, [3, 1, 0])
    assert full.num_nodes == 10 and int(full.depths().max()) == 3
    assert int(cut.depths().max()) == 1 and cut.num_nodes == 3 and none.num_nodes == 0
    d.propose_tree(states, TreeSpec.static(STATIC), [3, 2, 3])
    assert all(_same(b, _snapshot(s)) for b, s in zip(before, states))
    assert _same(before[0], _snapshot(states[0])) and not _same(before[0], _snapshot(states[1]))  # can fail


def _prompts(n, vocab, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist() for L in torch.randint(4, 14, (n,), generator=g)]


@pytest.mark.parametrize("spec", [TreeSpec(depth=3, topk=3, total_tokens=8), TreeSpec.static(STATIC)])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_decoding_equals_plain(family, spec, batch):
    target, d = family
    prompts = _prompts(4, V_BLOCK if isinstance(d, DFlashDrafter) else V_SMALL)
    plain = speculative_generate(target, None, prompts, 0, 20, batch_size=batch, eos_ids=set())
    tree = speculative_generate(target, d, prompts, 0, 20, batch_size=batch, eos_ids=set(), tree=spec)
    for p, t in zip(plain.results, tree.results):
        assert t.tokens == p.tokens
        assert max(t.drafted) == spec.total_tokens and all(n <= spec.total_tokens for n in t.drafted)
        assert all(len(r) == a for r, a in zip(t.tree_ranks, t.verifier_accepted))


# ---------------------------------------------------------------- DSpark: children follow their parent's token
def _markov_mismatches(d: DSparkDrafter, state, tree, D: int) -> int:
    """Nodes whose children are NOT the top-k of ``head(h_depth) + W2(W1[node token])`` computed by hand
    (root: the anchor), in rank order."""
    h = d.block_hidden(state, D)  # [D, H]
    tok, par, dep = tree.token_ids.tolist(), tree.parents.tolist(), tree.depths().tolist()
    bad = 0
    for u in [-1] + list(range(len(tok))):
        kids = [c for c in range(len(tok)) if par[c] == u]
        if not kids:
            continue
        prev = state.last_id if u < 0 else tok[u]
        slot = 0 if u < 0 else dep[u]
        logits = d.head(h[slot]).float() + d.markov_head.markov_w2(d.markov_head.markov_w1(torch.tensor(prev))).float()
        ranked = d.to_target_ids(torch.topk(logits, len(kids)).indices).tolist()
        bad += [tok[c] for c in kids] != ranked
    return bad


def test_dspark_children_are_conditioned_on_their_parent(monkeypatch):
    target, d = make_family("dspark")
    states = [started(d, target, 9, 0), started(d, target, 11, 3)]
    spec = TreeSpec(depth=3, topk=4, total_tokens=20)
    for state, tree in zip(states, d.propose_tree(states, spec, [3, 3])):
        assert tree.num_nodes == 20 and _markov_mismatches(d, state, tree, 3) == 0
    # a parent-blind variant (every node's children from the CHAIN's token at its depth) is caught
    from speculators.drafters import dflash_tree

    chain = d.propose([states[0]], [3])[0].token_ids
    real = dflash_tree.slot_tree

    def blind(logits, spec_, d2t, caps, child=None):
        return real(logits, spec_, d2t, caps, lambda depth, toks: child(depth, chain[depth - 2].expand_as(toks)))

    monkeypatch.setattr(dflash_tree, "slot_tree", blind)
    wrong = d.propose_tree([states[0]], spec, [3])[0]
    assert _markov_mismatches(d, states[0], wrong, 3) > 0
