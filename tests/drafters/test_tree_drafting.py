"""Draft trees from the EAGLE-3 drafter (EAGLE-2 dynamic trees, vLLM static trees) and tree decoding in the loop.

The tree mask of the drafter's own attention is checked against the drafter run alone along each node's
path; the loop's tree decoding against plain greedy decoding (batch 1 and batched) for a tree-drafting
family and for proposers that draft chains (verified as one-branch trees)."""

from __future__ import annotations

import copy

import pytest
import torch

from speculators.evaluation.settings import EvalSettings
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import speculative_generate
from speculators.decode.proposers import NGramProposer
from speculators.target import build_tiny_target
from speculators.decode.tree_spec import TreeSpec
from speculators.verify import SamplingParams

V = 96


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, draft_vocab=48, seed=0):
    torch.manual_seed(seed)
    cfg = registry.get("eagle3").config_class(algorithm="eagle3", ttt_steps=2, draft_vocab_size=draft_vocab)
    d = registry.get("eagle3").from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, 0, -1), draft_vocab))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.3)
    return d.eval()


def started(drafter, target, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, V, (n + 1,), generator=g)
    return drafter.start(prefix, target.features(prefix[None]).slice(0, n))


@torch.no_grad()
def path_logits(drafter, state, tokens):
    """The drafter's logits after each token of ``tokens`` (a root-to-node path), run alone as a chain
    over a copy of the request's cache: what the tree forward must give at every node of that path."""
    cache = copy.deepcopy(state.cache)
    cache.crop(state.num_positions)
    hidden, out = state.last_hidden, []
    for j, t in enumerate(tokens):
        emb = drafter.embed_tokens(torch.tensor([[t]]))
        hidden, logits = drafter._forward_cached(cache, emb, hidden, start_pos=state.num_positions + 1 + j)
        out.append(logits)
    return out


def draft_to_target(drafter, idx):
    return (idx + drafter.d2t[idx]).tolist()


@pytest.mark.parametrize("spec", [TreeSpec(depth=3, topk=3, total_tokens=10), TreeSpec(depth=4, topk=2, total_tokens=9),
                                  TreeSpec.static("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]")])
def test_tree_nodes_are_the_drafter_top_k_along_their_own_path(target, spec):
    """Every node's children are a prefix of the top-k of the drafter's logits computed along that node's
    path ALONE (the drafter's tree mask shows it its ancestors, never a sibling), in rank order."""
    d = make_drafter(target)
    states = [started(d, target, n=9, seed=0), started(d, target, n=5, seed=3)]
    trees = d.propose_tree(states, spec, [spec.depth, spec.depth])
    for state, tree in zip(states, trees):
        assert tree.num_nodes == spec.total_tokens
        tok, par = tree.token_ids.tolist(), tree.parents.tolist()
        assert all(p < i for i, p in enumerate(par))
        checked = 0
        for u in [-1] + list(range(tree.num_nodes)):
            kids = [c for c in range(tree.num_nodes) if par[c] == u]
            if not kids:
                continue
            path = []
            w = u
            while w >= 0:
                path.insert(0, tok[w])
                w = par[w]
            logits = state.last_logits if u < 0 else path_logits(d, state, path)[-1]
            ranked = draft_to_target(d, torch.topk(logits.float(), len(kids) + 2).indices)
            if spec.is_static:
                assert [tok[c] for c in kids] == [ranked[p[-1]] for p in (spec.paths[c] for c in kids)]
            else:
                assert [tok[c] for c in kids] == ranked[:len(kids)]
            checked += 1
        assert checked >= 3


def run_nodes_against_paths(d, state, spec, monkeypatch) -> list[float]:
    """Spy on the drafter's level forwards: per node run through the drafter, the largest difference
    between its logits in the tree forward and the drafter run alone along the node's path."""
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
    toks, pars, errs = [], [], []
    for tokens, parents, logits in seen:
        for f in range(tokens.shape[1]):
            toks.append(int(tokens[0, f]))
            pars.append(int(parents[0, f]))
            path, w = [], len(toks) - 1
            while w >= 0:
                path.insert(0, toks[w])
                w = pars[w]
            ref = path_logits(d, state, path)[-1]
            errs.append(float((logits[0, f].float() - ref.float()).abs().max()))
    return errs


def test_tree_forward_logits_equal_each_path_run_alone(target, monkeypatch):
    d = make_drafter(target)
    errs = run_nodes_against_paths(d, started(d, target), TreeSpec(depth=4, topk=3, total_tokens=12), monkeypatch)
    assert len(errs) == 9 and max(errs) < 1e-4


def test_sibling_leak_in_the_drafter_tree_mask_is_caught(target, monkeypatch):
    """The comparison above fails when the drafter's tree forward lets a node see its siblings' keys."""
    from speculators.drafters import tree_drafting

    real = tree_drafting._Run.visible

    def leaky(self, parents):
        vis = real(self, parents)
        vis[:, :, self.n:] = True  # every node of a level sees the whole level
        return vis

    monkeypatch.setattr(tree_drafting._Run, "visible", leaky)
    d = make_drafter(target)
    errs = run_nodes_against_paths(d, started(d, target), TreeSpec(depth=3, topk=3, total_tokens=12), monkeypatch)
    assert max(errs) > 1e-3


def test_one_wide_tree_is_the_chain(target):
    """topk 1 (dynamic) and the one-branch static tree draft exactly the greedy chain."""
    d = make_drafter(target)
    states = [started(d, target, seed=s) for s in (0, 1, 2)]
    chains = d.propose(states, [4, 4, 4])
    dyn = d.propose_tree(states, TreeSpec(depth=4, topk=1, total_tokens=4), [4, 4, 4])
    stat = d.propose_tree(states, TreeSpec.static([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), [4, 4, 4])
    for c, t1, t2 in zip(chains, dyn, stat):
        assert t1.token_ids.tolist() == c.token_ids.tolist() == t2.token_ids.tolist()
        assert t1.parents.tolist() == [-1, 0, 1, 2]


def test_depth_caps_and_state_unchanged(target):
    d = make_drafter(target)
    s = started(d, target)
    before = (s.num_positions, s.cache.length, s.last_logits.clone())
    spec = TreeSpec(depth=3, topk=3, total_tokens=10)
    full, cut, none = d.propose_tree([s, s, s], spec, [3, 1, 0])
    assert int(cut.depths().max()) == 1 and cut.num_nodes == 3 and none.num_nodes == 0
    assert full.num_nodes == 10
    assert (s.num_positions, s.cache.length) == before[:2] and torch.equal(s.last_logits, before[2])


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(L),), generator=g).tolist() for L in torch.randint(4, 14, (n,), generator=g)]


@pytest.mark.parametrize("spec", [TreeSpec(depth=3, topk=3, total_tokens=8), TreeSpec.static("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_decoding_equals_plain(target, spec, batch):
    d = make_drafter(target)
    prompts = _prompts(4)
    plain = speculative_generate(target, None, prompts, 0, 20, batch_size=batch, eos_ids=set())
    tree = speculative_generate(target, d, prompts, 0, 20, batch_size=batch, eos_ids=set(), tree=spec)
    for p, t in zip(plain.results, tree.results):
        assert t.tokens == p.tokens
        assert sum(t.emitted) == len(t.tokens) - 1
        assert all(n <= spec.total_tokens for n in t.drafted) and max(t.drafted) == spec.total_tokens
        assert len(t.tree_ranks) == len(t.emitted)
        assert all(len(r) == a for r, a in zip(t.tree_ranks, t.verifier_accepted))


@pytest.mark.parametrize("batch", [1, 2])
def test_chain_proposers_decode_through_the_tree_loop(target, batch):
    """A proposer without trees (prompt lookup) drafts its chain, verified as a one-branch tree: same output."""
    prompts = [p * 3 for p in _prompts(3)]  # repeats for the n-gram proposer to find
    plain = speculative_generate(target, None, prompts, 0, 24, batch_size=batch, eos_ids=set())
    tree = speculative_generate(target, NGramProposer(3), prompts, 0, 24, batch_size=batch, eos_ids=set(),
                                tree=TreeSpec(depth=3, topk=2, total_tokens=6))
    assert [r.tokens for r in tree.results] == [r.tokens for r in plain.results]
    assert any(a > 0 for r in tree.results for a in r.verifier_accepted)


def test_sampled_tree_decoding_is_reproducible_per_request(target):
    d = make_drafter(target)
    prompts = _prompts(3)
    sp = SamplingParams.uniform(3, temperature=0.8)
    spec = TreeSpec(depth=3, topk=2, total_tokens=6)
    a = speculative_generate(target, d, prompts, 0, 16, sp, batch_size=3, eos_ids=set(), seeds=[1, 2, 3], tree=spec)
    b = speculative_generate(target, d, prompts, 0, 16, sp, batch_size=1, eos_ids=set(), seeds=[1, 2, 3], tree=spec)
    assert [r.tokens for r in a.results] == [r.tokens for r in b.results]
    assert all(len(r.tokens) == 16 for r in a.results)


def test_tree_labels_are_unique_and_equal_specs_are_one_tree():
    a, b = TreeSpec.static("[(0,), (1,), (0, 0)]"), TreeSpec.static("[(0,), (1,), (1, 0)]")
    assert a.label != b.label
    assert TreeSpec.parse("depth=4") == TreeSpec.parse("depth=4,topk=4,total_tokens=16")
    assert list(dict.fromkeys([TreeSpec.parse("depth=4"), TreeSpec.parse("total_tokens=16"), a])) == [
        TreeSpec.parse("depth=4"), a]


def test_tree_spec_parsing(tmp_path):
    assert TreeSpec.parse("depth=5,topk=3") == TreeSpec(depth=5, topk=3, total_tokens=16)
    st = TreeSpec.parse("[(0,), (1,), (0, 0)]")
    assert st.is_static and st.depth == 2 and st.total_tokens == 3
    f = tmp_path / "tree.json"
    f.write_text("[[0], [1], [0, 0], [0, 1]]")
    assert TreeSpec.parse(str(f)).paths == ((0,), (1,), (0, 0), (0, 1))
    from speculators.errors import SpeculatorsError
    for bad in ("depth=0", "width=3", "depth=x", "[(0, 0)]", ""):
        with pytest.raises(SpeculatorsError, match="tree"):
            TreeSpec.parse(bad)


def test_eval_reports_trees_beside_chains_and_a_static_tree(target):
    """run_eval with trees: a row per tree and batch size beside the drafter's chains (greedy outputs checked
    against plain decoding), acceptance per depth and rank, and a best static tree in vLLM's syntax that parses."""
    from speculators.evaluation.report import render_markdown
    from speculators.evaluation.runner import run_eval
    from speculators.verify.tree import parse_token_tree

    d = make_drafter(target)
    prompts = [{"id": str(i), "input_ids": p} for i, p in enumerate(_prompts(3))]
    trees = [TreeSpec(depth=2, topk=2, total_tokens=4), TreeSpec.static("[(0,), (1,), (0, 0)]")]
    rep = run_eval(target, d, prompts, EvalSettings([2], 12, eos_ids=set(), batch_size=2, methods=("drafter",), bootstrap_resamples=50, trees=trees), log=lambda *_: None)
    block = rep["trees"]
    assert [(r["tree_label"], r["batch_size"]) for r in block["rows"]] == [
        (t.label, b) for b in (1, 2) for t in trees]
    for r in block["rows"]:
        assert r["chain_tau"] == next(c["tau"] for c in rep["rows"] if c["k"] == 2 and c["batch_size"] == r["batch_size"])
        assert 1.0 <= r["tau"] <= 3.0 and 0 < r["nodes_per_step"] <= r["tree"]["total_tokens"]
        assert len(r["per_position"]) == r["tree"]["depth"]
    assert rep["greedy_check"]["passed"] and not rep["greedy_mismatches"]
    assert rep["greedy_check"]["mismatches"] == 0
    st = block["best_static_tree"]
    if "speculative_token_tree" in st:
        assert parse_token_tree(st["speculative_token_tree"]) == tuple(tuple(p) for p in st["paths"])
    assert len(block["forward_ms"]) == 4 + 2
    assert "## Draft trees" in render_markdown(rep)


def test_cli_eval_takes_trees_and_refuses_bad_ones(tiny_target_dir, isolated_cache, tmp_path):
    """``speculators eval RUN --tree ... --tree '[...]'``: tree rows and a static tree in report.json and
    report.md; a malformed --tree is one clear error naming it."""
    from pathlib import Path

    from typer.testing import CliRunner

    from conftest import cli_train_then_eval
    from speculators.cli import app

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
    _, _, rep = cli_train_then_eval(recipe, tiny_target_dir, tmp_path / "run", "train.steps=2",
                                    eval_args=("--temperature", "0", "-k", "2", "--batch-size", "1",
                                               "--methods", "drafter", "--tree", "depth=2,topk=2,total_tokens=4",
                                               "--tree", "[(0,), (1,), (0, 0)]"))
    labels = [r["tree_label"] for r in rep["trees"]["rows"]]
    assert labels == ["dynamic d2 k2 n4", "static d2 n3 [(0,), (1,), (0, 0)]"]
    assert rep["greedy_mismatches"] == []
    md = next((tmp_path / "run").glob("eval-*/report.md")).read_text()
    assert "## Draft trees" in md and "static d2 n3 [(0,), (1,), (0, 0)]" in md
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--tree", "depth=2,width=3"])
    assert r.exit_code != 0 and "width" in r.output and "tree" in r.output


def test_tree_outputs_join_the_greedy_check_and_its_classification(target, monkeypatch):
    """A tree pass whose output differs from plain greedy decoding is in the report's greedy check, classified
    like a chain's (in float32: a failure), with the tree's forward size as the verify shape it replays."""
    from speculators.evaluation import runner as evaluate

    real = evaluate._generate

    def corrupt(*args, tree=None, **kw):
        out = real(*args, tree=tree, **kw)
        if tree is not None:
            out.results[0].tokens[3] = (out.results[0].tokens[3] + 1) % V
        return out

    monkeypatch.setattr(evaluate, "_generate", corrupt)
    seen = []
    real_classify = evaluate.classify_mismatches
    monkeypatch.setattr(evaluate, "classify_mismatches",
                        lambda t, p, ref, ms, div: seen.extend(div) or real_classify(t, p, ref, ms, div))
    d = make_drafter(target)
    prompts = [{"id": str(i), "input_ids": p} for i, p in enumerate(_prompts(2))]
    spec = TreeSpec(depth=2, topk=2, total_tokens=5)
    rep = evaluate.run_eval(target, d, prompts, EvalSettings([2], 8, eos_ids=set(), methods=("drafter",), bootstrap_resamples=20, trees=[spec]), log=lambda *_: None)
    check = rep["greedy_check"]
    assert check["by_proposer"][f"drafter tree {spec.label}"] == {"mismatches": 1, "near_tie": 0, "failures": 1}
    m = next(x for x in rep["greedy_mismatches"] if x["proposer"].endswith(spec.label))
    assert m["first_diff"] == 3 and "logit_gap" in m and m["near_tie"] is False
    assert seen and seen[-1][2] == spec.total_tokens  # the verify shape replayed: root + 5 nodes = 6 tokens
