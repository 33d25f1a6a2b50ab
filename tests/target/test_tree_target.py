"""Draft-tree verification forwards on the target: one forward over a tree equals every root-to-node
path run alone (ragged batch, sdpa and eager attention, the batch-1 sessions), a mask that lets a node
see its sibling is caught, the accepted path's cache stays exact through keep_tree and compaction, and
misuse is refused.

Tiny random fp32 Llama targets with scaled attention (``untied_target``: a KV-cache or mask bug changes
the logits visibly); references are plain batch-1 ``DecodeSession`` forwards over prompt + path.
"""

from __future__ import annotations

import pytest
import torch

from test_batched import rand_prompt, untied_target
from speculators.errors import SpeculatorsError
from speculators.target import tree_session

ATOL = 1e-4
# parents of the test trees: 2+ children per node, depth 3, a chain, a single node
TREES = {
    "wide": [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6],
    "deep": [-1, 0, 1, 1, 2, 3, 0, 6],
    "chain": [-1, 0, 1],
    "root": [-1],
}


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def target(request):
    t = untied_target()
    t.model.set_attn_implementation(request.param)
    assert t.model.config._attn_implementation == request.param
    return t


def path_to(parents: list[int], j: int) -> list[int]:
    """Node indices from the root down to node ``j``."""
    out = []
    while j >= 0:
        out.insert(0, j)
        j = parents[j]
    return out


def reference(target, context: list[int], tokens: list[int]):
    """Logits, aux and top of the LAST token of ``context + tokens`` from a fresh batch-1 session."""
    logits, feats = target.session().forward(torch.tensor(context + tokens))
    return logits[-1], feats.aux[0, -1], feats.top[0, -1]


def node_errors(target, context: list[int], ids: list[int], parents: list[int], logits, feats) -> list[float]:
    """Per node: the largest absolute difference of its logits / aux / top against its path run alone."""
    errs = []
    for j in range(len(ids)):
        lg, aux, top = reference(target, context, [ids[k] for k in path_to(parents, j)])
        errs.append(max(float((logits[j] - lg).abs().max()), float((feats.aux[0, j] - aux).abs().max()),
                        float((feats.top[0, j] - top).abs().max())))
    return errs


def tree_ids(parents: list[int], seed: int, root: int) -> list[int]:
    """Random tokens for a tree whose node 0 is the request's last emitted token ``root``."""
    return [root] + rand_prompt(len(parents) - 1, seed)


def ragged_batch(target):
    """Four requests of different prompt lengths; ``b`` has rolled back drafts (holes in its row).

    Returns ``(session, contexts)``: per request the visible tokens; the last one is emitted, not cached."""
    sess = target.batch_session(4)
    ctx = {"a": rand_prompt(5, 1), "b": rand_prompt(9, 2), "c": rand_prompt(3, 3), "d": rand_prompt(7, 4)}
    sess.add_many(["a", "b"], [ctx["a"][:-1], ctx["b"][:-1]])
    sess.add("c", ctx["c"][:-1])
    sess.add("d", ctx["d"][:-1])
    sess.forward(["b", "d"], [[ctx["b"][-1], 7, 8], [ctx["d"][-1]]])
    sess.keep("b", len(ctx["b"]))  # the two drafts rejected: invisible slots inside b's row
    ctx["b"].append(11)
    ctx["d"].append(12)
    return sess, ctx


def test_tree_forward_equals_every_path_alone_in_a_ragged_batch(target):
    """ONE forward_tree over three requests' trees of different sizes (a fourth request not listed):
    every node's logits, aux and top equal its root-to-node path run alone after the request's
    context (atol 1e-4, fp32); the unlisted request's next forward is untouched (no NaN leaks)."""
    sess, ctx = ragged_batch(target)
    listed = {"b": "wide", "a": "deep", "d": "chain"}
    ids = {r: tree_ids(TREES[s], i, ctx[r][-1]) for i, (r, s) in enumerate(listed.items())}
    lengths = {r: sess.length(r) for r in ctx}
    logits, feats = sess.forward_tree(list(listed), [ids[r] for r in listed], [TREES[s] for s in listed.values()])
    assert {r: sess.length(r) for r in ctx} == lengths  # the tree stays invisible
    for (r, s), lg, f in zip(listed.items(), logits, feats):
        M = len(TREES[s])
        assert lg.shape == (M, target.vocab_size) and lg.dtype == torch.float32
        assert f.aux.shape == (1, M, target.hidden_size * len(target.aux_layer_ids))
        assert f.top.shape == (1, M, target.hidden_size)
        errs = node_errors(target, ctx[r][:-1], ids[r], TREES[s], lg, f)
        assert max(errs) < ATOL, (r, errs)
    lg, _ = sess.forward(["c"], [[ctx["c"][-1], 5]])
    assert torch.isfinite(lg[0]).all()
    torch.testing.assert_close(lg[0][-1], reference(target, ctx["c"], [5])[0], atol=ATOL, rtol=0)


def test_a_node_that_sees_its_sibling_is_caught(target, monkeypatch):
    """The dense comparison must fail for a node whose mask also shows it a sibling (and only there
    and below it): the comparison above can catch a mask bug."""
    sess, ctx = ragged_batch(target)
    parents = TREES["wide"]  # node 2 and node 1 are siblings (children of 0)
    ids = tree_ids(parents, 0, ctx["b"][-1])
    build = sess._tree_mask
    row, S = sess.request_ids.index("b"), sess.width

    def leaky(M, ancestors):
        mask = build(M, ancestors)
        assert not mask[row, 0, 2, S + 1]
        mask[row, 0, 2, S + 1] = True
        return mask

    monkeypatch.setattr(sess, "_tree_mask", leaky)
    logits, feats = sess.forward_tree(["b"], [ids], [parents])
    errs = node_errors(target, ctx["b"][:-1], ids, parents, logits[0], feats[0])
    assert errs[2] > 1e-2, errs  # node 2 saw node 1
    assert errs[6] > 10 * ATOL, errs  # node 6 (a child of 2) inherits the error through node 2's K/V
    assert max(errs[j] for j in (0, 1, 3, 4, 5, 7, 8)) < ATOL, errs  # off node 2's subtree: exact


def test_eager_needs_the_additive_mask(target, monkeypatch):
    """Under eager attention a boolean mask would be ADDED to the scores (True = +1): the conversion
    to an additive mask is what makes eager exact (under sdpa the boolean mask is the native form)."""
    if target.model.config._attn_implementation != "eager":
        pytest.skip("eager only")
    monkeypatch.setattr(tree_session, "as_attention_mask", lambda model, mask, dtype: mask)
    sess, ctx = ragged_batch(target)
    ids = tree_ids(TREES["deep"], 5, ctx["a"][-1])
    logits, feats = sess.forward_tree(["a"], [ids], [TREES["deep"]])
    assert max(node_errors(target, ctx["a"][:-1], ids, TREES["deep"], logits[0], feats[0])) > 1e-2


@pytest.mark.parametrize("compact", [False, True])
def test_keep_tree_then_decode_equals_a_fresh_run(target, compact):
    """After keep_tree(path) the next forward equals a fresh run on context + path + next token, with
    and without an explicit compact (slot order = position order), and across two tree steps."""
    sess, ctx = ragged_batch(target)
    seqs = {r: list(c) for r, c in ctx.items()}  # visible tokens + the emitted, uncached last one
    kept = {"b": [0, 1, 4, 7], "a": [0, 6, 7], "d": [0]}  # nodes of TREES wide / deep / chain
    for step, shapes in enumerate(({"b": "wide", "a": "deep", "d": "chain"}, {"b": "deep", "a": "root", "d": "wide"})):
        ids = {r: tree_ids(TREES[s], 10 * step + i, seqs[r][-1]) for i, (r, s) in enumerate(shapes.items())}
        logits, feats = sess.forward_tree(list(shapes), [ids[r] for r in shapes], [TREES[s] for s in shapes.values()])
        for (r, s), lg, f in zip(shapes.items(), logits, feats):
            assert max(node_errors(target, seqs[r][:-1], ids[r], TREES[s], lg, f)) < ATOL, (step, r)
            path = kept[r] if step == 0 else path_to(TREES[s], len(TREES[s]) - 1)
            before = sess.length(r)
            sess.keep_tree(r, path)
            assert sess.length(r) == before + len(path)
            seqs[r] = seqs[r][:-1] + [ids[r][k] for k in path] + [40 + step]  # + the bonus token
        if compact:
            sess.compact()
            assert sess.width == max(sess.length(r) for r in sess.request_ids)
        for r in shapes:  # every row's valid slots, re-packed or not, read in position order
            assert int(sess.valid[sess.request_ids.index(r)].sum()) == sess.length(r) == len(seqs[r]) - 1
    lg, feats = sess.forward(["a", "b", "d"], [[seqs[r][-1]] for r in ("a", "b", "d")])
    for r, x, f in zip(("a", "b", "d"), lg, feats):
        want, aux, _ = reference(target, seqs[r][:-1], [seqs[r][-1]])
        torch.testing.assert_close(x[0], want, atol=ATOL, rtol=0)
        torch.testing.assert_close(f.aux[0, 0], aux, atol=ATOL, rtol=0)


def test_batch1_session_verifies_trees(target):
    """DecodeSession: the same dense comparison, then keep_tree crops the cache to context + path and
    decoding continues exactly."""
    ctx = rand_prompt(6, 7)
    parents = TREES["wide"]
    ids = tree_ids(parents, 8, ctx[-1])
    sess = target.session()
    sess.forward(torch.tensor(ctx[:-1]))
    logits, feats = sess.forward_tree(torch.tensor(ids), torch.tensor(parents))
    assert max(node_errors(target, ctx[:-1], ids, parents, logits, feats)) < ATOL
    path = [0, 2, 6, 9]
    sess.keep_tree(path)
    assert sess.length == len(ctx) - 1 + len(path)
    lg = sess.forward(torch.tensor([3]))[0]
    want = reference(target, ctx[:-1], [ids[k] for k in path] + [3])[0]
    torch.testing.assert_close(lg[-1], want, atol=ATOL, rtol=0)


def test_tree_misuse_is_refused(target):
    """Bad parents, a keep_tree that is not a root-to-node path or has no pending tree, and forward /
    keep / compact while a tree is pending raise SpeculatorsError naming the argument; remove drops
    a pending tree; a refused keep_tree leaves the tree pending."""
    sess, ctx = ragged_batch(target)
    for bad in ([-1, 1, 0], [-1, -2, 0], [-1, 0], [0, 0, 0], [-1.0, 0.0, 0.0]):
        with pytest.raises(SpeculatorsError, match="parents"):
            sess.forward_tree(["a"], [[1, 2, 3]], [bad])
    with pytest.raises(SpeculatorsError, match="empty"):
        sess.forward_tree(["a"], [[]], [[]])
    with pytest.raises(SpeculatorsError, match="no tree forward pending"):
        sess.keep_tree("a", [0])
    parents = [-1, 0, 0, 1]
    sess.forward_tree(["a", "c"], [[1, 2, 3, 4], [5, 6]], [parents, [-1, 0]])
    for nodes in ([1], [0, 2, 3], [0, 4], [0, True], [0, 1, 1]):
        with pytest.raises(SpeculatorsError, match="nodes"):
            sess.keep_tree("a", nodes)
    with pytest.raises(SpeculatorsError, match="tree forward pending"):
        sess.forward(["a"], [[1]])
    with pytest.raises(SpeculatorsError, match="tree forward pending"):
        sess.keep("a", 2)
    with pytest.raises(SpeculatorsError, match="tree forward pending"):
        sess.forward_tree(["a"], [[1]], [[-1]])
    with pytest.raises(SpeculatorsError, match="tree forward pending"):
        sess.compact()
    sess.forward(["b"], [[ctx["b"][-1]]])  # other requests keep decoding
    sess.keep_tree("a", [0, 1, 3])
    assert sess.length("a") == len(ctx["a"]) - 1 + 3
    sess.remove("c")  # drops c's pending tree
    sess.compact()
    s1 = target.session()
    s1.forward(torch.tensor([1, 2]))
    with pytest.raises(SpeculatorsError, match="no tree forward is pending"):
        s1.keep_tree([0])
    s1.forward_tree(torch.tensor([3, 4]), torch.tensor([-1, 0]))
    with pytest.raises(SpeculatorsError, match="tree forward is pending"):
        s1.crop(1)
    with pytest.raises(SpeculatorsError, match="nodes"):
        s1.keep_tree([1])
    s1.keep_tree([])  # drops the tree
    assert s1.length == 2 and s1.cache.get_seq_length() == 2
