"""Draft trees from the other autoregressive families (EAGLE-1 and MTP) through the generic EAGLE-2 expansion.

Per family: every node run through the drafter's tree forward has the logits the family's own CHAIN
(``_propose_one``) computes after drafting that node's path (the reference is the chain itself, its draws
forced to the path's tokens), a sibling leak in the tree mask is caught, a one-wide tree is the greedy
chain, depth caps hold and the states are left unchanged, and greedy tree decoding equals plain greedy
decoding at batch 1 and batched for a dynamic and a static tree."""

from __future__ import annotations

import copy

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import speculative_generate
from speculators.target import build_tiny_target
from speculators.decode.tree_spec import TreeSpec

V = 96
DYNAMIC = TreeSpec(depth=4, topk=3, total_tokens=12)
STATIC = TreeSpec.static("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0)]")


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, name, seed=0, **kw):
    """A tiny drafter of family ``name`` with random non-zero weights (every input matters); EAGLE-1's
    weights are smaller: its features feed the target's head unnormalised, and logits in the hundreds
    would round beyond the 1e-4 comparisons in float32."""
    std = 0.1 if name == "eagle" else 0.2
    torch.manual_seed(seed)
    family = registry.get(name)
    d = family.from_target(family.config_class(algorithm=name, **kw), target, DraftVocab.full(V))
    with torch.no_grad():
        for pname, p in d.named_parameters():
            if p.requires_grad and "norm" not in pname:
                p.normal_(0, std)
    return d.eval()


# (family, config): EAGLE-1 with two layers; MTP with 2 modules (depths 3-4 reuse the last module over its
# tree-masked cache) and with 1 module (every level past the root is the last module's)
FAMILIES = [("eagle", {"num_layers": 2}), ("mtp", {"num_modules": 2}), ("mtp", {"num_modules": 1}),
            ("mtp", {"num_modules": 4})]
IDS = ["eagle", "mtp2", "mtp1", "mtp4"]


def started(d, target, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, V, (n + 1,), generator=g)
    return d.start(prefix, target.features(prefix[None]).slice(0, n))


@torch.no_grad()
def chain_logits(d, state, path, monkeypatch):
    """The logits the family's chain (``_propose_one``) computes for draft ``len(path) + 1`` when its first
    ``len(path)`` drafts are forced to ``path``: what the tree forward must give at the node of that path."""
    module = __import__(type(d).__module__, fromlist=["sample_draft"])
    real, seen = module.sample_draft, []

    def forced(logits, *args, **kw):
        seen.append(logits.detach().reshape(-1).clone())
        j = len(seen) - 1
        if j < len(path):
            return torch.tensor([path[j]]), None
        return real(logits, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(module, "sample_draft", forced)
        d._propose_one(copy.deepcopy(state), len(path) + 1)
    return seen[-1]


def run_nodes_against_paths(d, state, spec, monkeypatch) -> list[float]:
    """Spy on the drafter's level forwards: per node run, the largest difference between its logits in the
    tree forward and the chain's along the node's path."""
    from speculators.drafters import tree_drafting

    real, seen = tree_drafting.expand_tree, []

    def spy(root_logits, forward, *args):
        def fwd(tokens, parents, visible, depth):
            out = forward(tokens, parents, visible, depth)
            seen.append((tokens.clone(), parents.clone(), out.detach().clone()))
            return out
        return real(root_logits, fwd, *args)

    monkeypatch.setattr(tree_drafting, "expand_tree", spy)
    d.propose_tree([state], spec, [spec.depth])
    monkeypatch.setattr(tree_drafting, "expand_tree", real)
    toks, pars, errs = [], [], []
    for tokens, parents, logits in seen:
        for f in range(tokens.shape[1]):
            toks.append(int(tokens[0, f]))
            pars.append(int(parents[0, f]))
            path, w = [], len(toks) - 1
            while w >= 0:
                path.insert(0, toks[w])
                w = pars[w]
            ref = chain_logits(d, state, path, monkeypatch)
            errs.append(float((logits[0, f].float() - ref.float()).abs().max()))
    return errs


@pytest.mark.parametrize("family,kw", FAMILIES, ids=IDS)
@pytest.mark.parametrize("spec", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_tree_forward_logits_equal_the_chain_along_each_path(target, family, kw, spec, monkeypatch):
    d = make_drafter(target, family, **kw)
    for n, seed in ((9, 0), (2, 3)):  # a short context: MTP's modules hold few committed entries
        errs = run_nodes_against_paths(d, started(d, target, n, seed), spec, monkeypatch)
        assert len(errs) == (9 if not spec.is_static else 5) and max(errs) < 1e-4


@pytest.mark.parametrize("family,kw", FAMILIES[:2], ids=IDS[:2])
def test_sibling_leak_in_the_tree_mask_is_caught(target, family, kw, monkeypatch):
    """The comparison above fails when a level's nodes see their siblings' keys."""
    from speculators.drafters import tree_drafting

    real = tree_drafting._Run.visible

    def leaky(self, parents):
        vis = real(self, parents)
        vis[:, :, self.n:] = True
        return vis

    d = make_drafter(target, family, **kw)
    state = started(d, target)
    with monkeypatch.context() as m:
        m.setattr(tree_drafting._Run, "visible", leaky)
        errs = run_nodes_against_paths(d, state, DYNAMIC, monkeypatch)
    assert max(errs) > 1e-3


@pytest.mark.parametrize("family,kw", FAMILIES, ids=IDS)
def test_one_wide_tree_is_the_greedy_chain(target, family, kw):
    d = make_drafter(target, family, **kw)
    states = [started(d, target, n, s) for n, s in ((9, 0), (5, 1), (2, 2))]
    chains = d.propose(states, [4, 4, 4])
    dyn = d.propose_tree(states, TreeSpec(depth=4, topk=1, total_tokens=4), [4, 4, 4])
    stat = d.propose_tree(states, TreeSpec.static([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), [4, 4, 4])
    for c, t1, t2 in zip(chains, dyn, stat):
        assert t1.token_ids.tolist() == c.token_ids.tolist() == t2.token_ids.tolist()
        assert t1.parents.tolist() == t2.parents.tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("family,kw", FAMILIES[:2], ids=IDS[:2])
def test_depth_caps_and_states_unchanged(target, family, kw):
    d = make_drafter(target, family, **kw)
    s = started(d, target)
    before = copy.deepcopy(s)
    full, cut, none = d.propose_tree([s, s, s], DYNAMIC, [4, 1, 0])
    assert full.num_nodes == DYNAMIC.total_tokens and int(full.depths().max()) == 4
    assert int(cut.depths().max()) == 1 and cut.num_nodes == 3 and none.num_nodes == 0
    assert d.propose_tree([], DYNAMIC, []) == []
    assert_same(s, before)


def assert_same(a, b, where="state"):
    """``a`` equals ``b`` field by field: tensors exactly, caches key and value tensors, lists elementwise."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(b, "__dict__"):
        for name, value in vars(b).items():
            assert_same(getattr(a, name), value, f"{where}.{name}")
    else:
        assert a == b, where


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(L),), generator=g).tolist() for L in torch.randint(4, 14, (n,), generator=g)]


@pytest.mark.parametrize("family,kw", FAMILIES[:2], ids=IDS[:2])
@pytest.mark.parametrize("spec", [TreeSpec(depth=3, topk=3, total_tokens=8),
                                  TreeSpec.static("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")],
                         ids=["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_decoding_equals_plain(target, family, kw, spec, batch):
    d = make_drafter(target, family, **kw)
    prompts = _prompts(4)
    plain = speculative_generate(target, None, prompts, 0, 20, batch_size=batch, eos_ids=set())
    tree = speculative_generate(target, d, prompts, 0, 20, batch_size=batch, eos_ids=set(), tree=spec)
    for p, t in zip(plain.results, tree.results):
        assert t.tokens == p.tokens
        assert sum(t.emitted) == len(t.tokens) - 1
        assert all(n <= spec.total_tokens for n in t.drafted) and max(t.drafted) == spec.total_tokens
        assert [len(r) for r in t.tree_ranks] == t.verifier_accepted
