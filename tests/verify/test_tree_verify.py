"""Tests of the draft-tree verifier (speculators.verify.tree): tree shapes, greedy walk, losslessness.

The statistical tests simulate a toy target language model over a 5-token vocabulary (next-token
logits = a seeded random table indexed by the last two tokens) and check, by Pearson chi-square with a
one-sided tail of 1e-6 (speculators.verify.testing), that the first two tokens emitted after a fixed
context have exactly the toy model's joint distribution p(t1) p(t2 | t1) under the same sampling
parameters. A deliberately leaky walk (the residual update on rejection removed) must fail the same
check, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.verify import (
    DraftTree,
    SamplingParams,
    VerifyInputError,
    ancestor_mask,
    apply_sampling,
    parse_token_tree,
    rejection_sample,
    tree_depths,
    tree_from_paths,
    tree_rejection_sample,
)
from speculators.verify import tree as tree_mod
from speculators.verify.testing import chi2_check

EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


# --------------------------------------------------------------------------------------------------
# Tree shapes
# --------------------------------------------------------------------------------------------------


def test_parse_token_tree_forms_agree_and_sort_like_vllm():
    as_list = parse_token_tree(EXAMPLE)
    as_str = parse_token_tree(str(EXAMPLE))
    assert as_list == as_str == tuple(EXAMPLE)
    assert parse_token_tree("[[0], [0, 0]]") == ((0,), (0, 0))
    # vLLM sorts breadth-first, lexicographic within a depth; sort=False keeps the given order.
    shuffled = [(1, 0), (0,), (0, 1), (1,), (0, 0)]
    assert parse_token_tree(shuffled) == tuple(EXAMPLE)
    assert parse_token_tree(str(shuffled)) == tuple(sorted(shuffled, key=lambda t: (len(t), t)))
    assert parse_token_tree([(0,), (0, 0), (1,)], sort=False) == ((0,), (0, 0), (1,))
    assert parse_token_tree([(0,), (2,)]) == ((0,), (2,))  # rank gaps are allowed


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("[(0,), ()]", "()"),  # empty path
        ([(0,), (-1,)], "(-1,)"),  # negative rank
        ([(0,), (0, 1.5)], "1.5"),  # not an int
        ([(0,), (True,)], "True"),  # bool is not a rank
        ([(0,), (0,)], "duplicate path (0,)"),
        ([(0,), (1, 0)], "(1,) of path (1, 0) is missing"),  # parent missing
        ("__import__('os')", "__import__"),  # not a literal: never evaluated
        ("[(0,), (1,)", "SyntaxError"),
        ("(0,)", "0"),  # a single path, not a list of paths
        ([], "non-empty"),
        ("[]", "non-empty"),
    ],
)
def test_parse_token_tree_rejects_bad_input(spec, needle):
    with pytest.raises(SpeculatorsError, match="speculative_token_tree") as err:
        parse_token_tree(spec)
    assert needle in str(err.value)


def test_parse_token_tree_child_before_parent():
    msg = r"speculative_token_tree.*\(0,\) of path \(0, 0\) must be listed before"
    with pytest.raises(SpeculatorsError, match=msg):
        parse_token_tree([(0, 0), (0,)], sort=False)
    assert parse_token_tree([(0, 0), (0,)]) == ((0,), (0, 0))  # vLLM's rule reorders it


def test_tree_from_paths_example():
    parents, ranks = tree_from_paths(parse_token_tree(EXAMPLE))
    assert parents.dtype == ranks.dtype == torch.int64
    assert parents.tolist() == [-1, -1, 0, 0, 1]
    assert ranks.tolist() == [0, 1, 0, 1, 0]
    assert tree_depths(parents).tolist() == [1, 1, 2, 2, 2]
    tree = DraftTree(torch.tensor([4, 2, 1, 3, 0]), parents)
    assert [tree.children(u) for u in (-1, 0, 1, 2)] == [[0, 1], [2, 3], [4], []]
    with pytest.raises(SpeculatorsError, match="must be listed before"):
        tree_from_paths([(0, 0), (0,)])


def _random_parents(gen: torch.Generator, n: int, shape: str) -> torch.Tensor:
    if shape == "chain":
        return torch.arange(-1, n - 1)
    if shape == "star":
        return torch.full((n,), -1)
    if shape == "shallow":  # parents among the first few nodes: wide trees
        values = [int(torch.randint(-1, min(i, 3), (1,), generator=gen)) for i in range(n)]
    else:
        values = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("shape", ["chain", "star", "shallow", "random"])
def test_depths_and_ancestor_mask_match_brute_force(shape):
    gen = torch.Generator().manual_seed(len(shape))
    for n in (1, 2, 7, 16):
        parents = _random_parents(gen, n, shape)
        values = parents.tolist()
        depth = torch.zeros(n, dtype=torch.int64)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:  # walk up to the root
                mask[i, j] = True
                depth[i] += 1
                j = values[j]
        assert torch.equal(tree_depths(parents), depth)
        assert torch.equal(ancestor_mask(parents), mask)


@pytest.mark.parametrize(
    "parents, needle",
    [
        (torch.tensor([-1, 1]), "node 1 has parent 1"),  # itself
        (torch.tensor([-1, 2, 0]), "node 1 has parent 2"),  # after the child
        (torch.tensor([-2]), "node 0 has parent -2"),
        (torch.tensor([-1.0, 0.0]), "1-D integer"),
        (torch.tensor([[-1]]), "1-D integer"),
    ],
)
def test_parents_validation(parents, needle):
    for fn in (tree_depths, ancestor_mask):
        with pytest.raises(SpeculatorsError, match="parents") as err:
            fn(parents)
        assert needle in str(err.value)


# --------------------------------------------------------------------------------------------------
# Input validation of the verifier
# --------------------------------------------------------------------------------------------------


def _good_tree(vocab=6):
    q = torch.full((3, vocab), 1.0 / vocab)
    return DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]), q)


def _move_mass(q, src, dst):
    q[:, dst] += q[:, src]
    q[:, src] = 0.0


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t: setattr(t, "token_ids", torch.tensor([1, 2, 6])), r"trees\[0\].token_ids"),
        (lambda t: setattr(t, "token_ids", torch.tensor([1.0, 2.0, 3.0])), r"trees\[0\].token_ids"),
        (lambda t: setattr(t, "parents", torch.tensor([-1, 2, 0])), r"trees\[0\].parents"),
        (lambda t: setattr(t, "probs", torch.full((3, 6), 0.2)), r"trees\[0\].probs.*sum to 1"),
        (lambda t: setattr(t, "probs", torch.full((3, 5), 0.2)), r"trees\[0\].probs"),
        (lambda t: _move_mass(t.probs, 1, 0), r"trees\[0\].probs.*node 0.*token 1"),  # q(own token) = 0
    ],
)
def test_tree_rejection_sample_validates_trees(mutate, field):
    tree = _good_tree()
    mutate(tree)
    with pytest.raises(VerifyInputError, match=field):
        tree_rejection_sample([tree], [torch.randn(4, 6)], SamplingParams.uniform(1, 1.0))


def test_tree_rejection_sample_validates_logits_and_batch():
    sp = SamplingParams.uniform(2, 1.0)
    trees = [_good_tree(), _good_tree()]
    with pytest.raises(VerifyInputError, match=r"target_logits\[1\]: expected a float tensor \[4, V\]"):
        tree_rejection_sample(trees, [torch.randn(4, 6), torch.randn(3, 6)], sp)
    with pytest.raises(VerifyInputError, match=r"target_logits\[1\]: vocabulary 7"):
        tree_rejection_sample(trees, [torch.randn(4, 6), torch.randn(4, 7)], sp)
    bad = torch.randn(4, 6)
    bad[2, 3] = float("nan")
    with pytest.raises(VerifyInputError, match=r"target_logits\[1\]: a row contains NaN"):
        tree_rejection_sample(trees, [torch.randn(4, 6), bad], sp)
    with pytest.raises(VerifyInputError, match="target_logits: expected 2 tensors"):
        tree_rejection_sample(trees, [torch.randn(4, 6)], sp)
    with pytest.raises(VerifyInputError, match="sampling"):
        tree_rejection_sample(trees[:1], [torch.randn(4, 6)], sp)


# --------------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------------


def _random_greedy_tree(gen, n, shape, vocab, match=0.6):
    """A tree with distinct sibling tokens; a node takes its parent row's argmax with probability ``match``."""
    parents = _random_parents(gen, n, shape)
    logits = torch.randn(n + 1, vocab, generator=gen)
    tokens = [0] * n
    used: dict[int, set[int]] = {}
    for i, v in enumerate(parents.tolist()):
        sib = used.setdefault(v, set())
        a = int(logits[v + 1].argmax())
        if a not in sib and float(torch.rand(1, generator=gen)) < match:
            tokens[i] = a
        else:
            free = [t for t in range(vocab) if t not in sib]
            tokens[i] = free[int(torch.randint(0, len(free), (1,), generator=gen))]
        sib.add(tokens[i])
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), parents), logits


def _greedy_brute_force(tree, logits):
    """The longest root path whose every token is the argmax of its parent's row, then that row's argmax."""
    parents, tokens = tree.parents.tolist(), tree.token_ids.tolist()
    argmax = logits.argmax(dim=-1).tolist()
    best: list[int] = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path.reverse()
        ok = all(tokens[c] == argmax[(parents[c] + 1)] for c in path)
        if ok and len(path) > len(best):
            best = path
    last = best[-1] + 1 if best else 0
    return best, [tokens[c] for c in best] + [argmax[last]]


@pytest.mark.parametrize("shape", ["chain", "star", "shallow", "random"])
def test_greedy_matches_brute_force(shape):
    gen = torch.Generator().manual_seed(10 + len(shape))
    trees, logits = [], []
    for n in [0, 1, 3, 6, 12] * 8:
        t, x = _random_greedy_tree(gen, n, shape, vocab=16)
        trees.append(t)
        logits.append(x)
    out = tree_rejection_sample(trees, logits, SamplingParams.uniform(len(trees), 0.0))
    accepted_some = 0
    for i, (t, x) in enumerate(zip(trees, logits)):
        path, emitted = _greedy_brute_force(t, x)
        assert out.accepted_nodes[i] == path
        assert out.output_token_ids[i].tolist() == emitted
        assert int(out.num_accepted[i]) == len(path)
        sibs = [t.children(t.parents.tolist()[c]) for c in path]
        assert out.accepted_ranks[i] == [s.index(c) for s, c in zip(sibs, path)]
        accepted_some += len(path) > 0
    assert accepted_some >= len(trees) // 4  # the test exercises acceptance, not only the first row


def test_greedy_chain_equals_chain_verifier():
    gen = torch.Generator().manual_seed(3)
    vocab, nums = 7, [0, 1, 3, 5, 5, 2]
    trees, rows, ids = [], [], []
    for k in nums:
        x = torch.randn(k + 1, vocab, generator=gen, dtype=torch.float64)
        rand = torch.randint(0, vocab, (k,), generator=gen)
        d = torch.where(torch.rand(k, generator=gen) < 0.7, x[:k].argmax(-1), rand)
        trees.append(DraftTree(d, torch.arange(-1, k - 1)))
        rows.append(x)
        ids.append(d)
    out = tree_rejection_sample(trees, rows, SamplingParams.uniform(len(nums), 0.0))
    chain = rejection_sample(torch.cat(ids), nums, None, torch.cat(rows), SamplingParams.uniform(len(nums), 0.0))
    assert out.tolist() == chain.tolist()
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert out.num_accepted.sum() > 0


# --------------------------------------------------------------------------------------------------
# Statistical losslessness on a toy language model
# --------------------------------------------------------------------------------------------------

V = 5
N_STEPS = 20_000
CONTEXT = (1, 2)
# Two depth-1 children, two children under the first (a node whose children are two tokens), one under
# the second and a depth-3 node.
TREE = parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
PARENTS, RANKS = tree_from_paths(TREE)
_gen = torch.Generator().manual_seed(1234)
TARGET_TABLE = torch.randn(V, V, V, generator=_gen) * 1.5  # logits of the next token given the last two
DRAFT_TABLE = TARGET_TABLE + torch.randn(V, V, V, generator=_gen)  # a drafter close to the target


def _probs(table, temperature, top_p):
    flat = table.reshape(-1, V)
    n = flat.shape[0]
    tp = None if top_p == 1.0 else torch.full((n,), top_p)
    return apply_sampling(flat, torch.full((n,), temperature), None, tp).reshape(table.shape)


def _draft_children(q_table, prev2, prev1, earlier, gen):
    """The next sibling (batched [B]): drawn from q without the earlier siblings' tokens, renormalised
    (uniform over the remaining tokens if q has no mass left). Returns (token [B], its q [B, V])."""
    q = q_table[prev2, prev1].clone()
    for tok in earlier:
        q.scatter_(1, tok.unsqueeze(1), 0.0)
    mass = q.sum(-1, keepdim=True)
    left = torch.ones_like(q)
    for tok in earlier:
        left.scatter_(1, tok.unsqueeze(1), 0.0)
    q = torch.where(mass > 0, q / mass.clamp_min(1e-30), left / left.sum(-1, keepdim=True))
    return torch.multinomial(q, 1, generator=gen).squeeze(1), q


def _simulate(temperature, top_p, sampled_drafts, seed):
    """Run N_STEPS independent verification steps after CONTEXT; return (t1 * V + t2 samples [N], expected [V*V])."""
    gen = torch.Generator().manual_seed(seed)
    n_nodes = len(TREE)
    steps = N_STEPS
    q_table = _probs(DRAFT_TABLE, temperature, top_p)
    c0 = torch.full((steps,), CONTEXT[0])
    c1 = torch.full((steps,), CONTEXT[1])
    tokens = torch.zeros(steps, n_nodes, dtype=torch.int64)
    qs = torch.zeros(steps, n_nodes, V)
    last2 = {-1: (c0, c1)}
    parents = PARENTS.tolist()
    for i in range(n_nodes):
        prev2, prev1 = last2[parents[i]]
        sibs = [c for c in range(i) if parents[c] == parents[i]]
        if sampled_drafts:
            earlier = [tokens[:, c] for c in sibs]
            tokens[:, i], qs[:, i] = _draft_children(q_table, prev2, prev1, earlier, gen)
        else:  # deterministic top-k children: the drafter's rank-r token (point masses)
            tokens[:, i] = DRAFT_TABLE[prev2, prev1].argsort(dim=-1, descending=True)[:, int(RANKS[i])]
        last2[i] = (prev1, tokens[:, i])
    rows = [TARGET_TABLE[c0, c1]] + [TARGET_TABLE[last2[i][0], last2[i][1]] for i in range(n_nodes)]
    logits = torch.stack(rows, dim=1)  # [steps, N + 1, V]
    trees = [DraftTree(tokens[s], PARENTS, qs[s] if sampled_drafts else None) for s in range(steps)]
    out = tree_rejection_sample(
        trees, list(logits.unbind(0)), SamplingParams.uniform(steps, temperature, top_p=top_p), generator=gen,
        validate=False,
    )
    p_table = _probs(TARGET_TABLE, temperature, top_p)
    t1 = torch.tensor([int(t[0]) for t in out.output_token_ids])
    t2 = torch.tensor([int(t[1]) if t.numel() > 1 else -1 for t in out.output_token_ids])
    one = t2 < 0  # a one-token step: the next step's root gives t2, i.e. the toy model itself
    t2[one] = torch.multinomial(p_table[CONTEXT[1], t1[one]], 1, generator=gen).squeeze(1)
    expected = p_table[CONTEXT[0], CONTEXT[1]].unsqueeze(1) * p_table[CONTEXT[1]]  # [t1, t2]
    assert (out.num_accepted >= 2).any() and one.any()  # deep acceptances and first-level rejections happen
    return t1 * V + t2, expected.flatten()


SETTINGS = [(1.0, 1.0), (0.7, 0.9)]


@pytest.mark.parametrize("sampled_drafts", [False, True], ids=["point_mass", "drawn_without_replacement"])
@pytest.mark.parametrize("temperature, top_p", SETTINGS)
def test_tree_sampling_is_lossless(temperature, top_p, sampled_drafts):
    samples, expected = _simulate(temperature, top_p, sampled_drafts, seed=7)
    stat, thr, tv, n = chi2_check(samples, expected)
    assert stat <= thr, f"chi2={stat:.1f} > {thr:.1f} (p<1e-6), TV={tv:.4f}, n={n}"


@pytest.mark.parametrize("sampled_drafts", [False, True], ids=["point_mass", "drawn_without_replacement"])
def test_leaky_walk_fails_the_check(monkeypatch, sampled_drafts):
    """The same walk with the residual update removed (a rejected candidate leaves p unchanged) is biased."""
    monkeypatch.setattr(tree_mod, "_residual", lambda p, q, token: p)
    samples, expected = _simulate(1.0, 1.0, sampled_drafts, seed=7)
    stat, thr, _, _ = chi2_check(samples, expected)
    assert stat > 3 * thr, f"the leaky walk passed the check: chi2={stat:.1f}, threshold {thr:.1f}"


# --------------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------------


def _batch(gen, n_req, vocab=6):
    trees, logits = [], []
    for _ in range(n_req):
        q = torch.softmax(torch.randn(len(TREE), vocab, generator=gen), -1)
        toks = torch.multinomial(q, 1, generator=gen).squeeze(1)
        trees.append(DraftTree(toks, PARENTS, q))
        logits.append(torch.randn(len(TREE) + 1, vocab, generator=gen))
    return trees, logits


def test_seeded_generators_are_reproducible_and_batch_independent():
    trees, logits = _batch(torch.Generator().manual_seed(5), 6)
    temps = torch.tensor([1.0, 0.0, 0.8, 1.0, 1.0, 0.5])

    def sp(idx, seeded):
        gens = [torch.Generator().manual_seed(100 + i) if i in seeded else None for i in idx]
        return SamplingParams(temperature=temps[idx], generators=gens)

    full = list(range(6))
    seeded = {0, 2, 5}
    ref = tree_rejection_sample(trees, logits, sp(full, seeded), generator=torch.Generator().manual_seed(1))
    again = tree_rejection_sample(trees, logits, sp(full, seeded), generator=torch.Generator().manual_seed(2))
    for i in seeded:
        assert again.tolist()[i] == ref.tolist()[i]
        alone = tree_rejection_sample([trees[i]], [logits[i]], sp([i], seeded))
        assert alone.tolist()[0] == ref.tolist()[i]
        assert alone.accepted_nodes[0] == ref.accepted_nodes[i]
    rev = full[::-1]
    reordered = tree_rejection_sample([trees[i] for i in rev], [logits[i] for i in rev], sp(rev, seeded))
    for k, i in enumerate(rev):
        if i in seeded:
            assert reordered.tolist()[k] == ref.tolist()[i]
    # Different seeds do change the sampled output somewhere (the generator is actually used).
    outs = {
        tuple(map(tuple, tree_rejection_sample(trees, logits, SamplingParams(temps, generators=[
            torch.Generator().manual_seed(s * 10 + i) for i in full
        ])).tolist()))
        for s in range(8)
    }
    assert len(outs) > 1
