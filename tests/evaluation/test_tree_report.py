"""Tests of speculators.evaluation.static_tree: rank acceptance counts, the independence model, the best static tree."""

from __future__ import annotations

import itertools
import random

import pytest

from speculators.errors import SpeculatorsError
from speculators.decode.state import GenerationResult
from speculators.evaluation.static_tree import best_static_tree, expected_accepted, rank_acceptance, tree_table
from speculators.verify.tree import parse_token_tree


def _result(paths: list[list[int]]) -> GenerationResult:
    r = GenerationResult(tokens=[0])
    r.tree_ranks = [list(p) for p in paths]
    r.verifier_accepted = [len(p) for p in paths]
    r.emitted = [len(p) + 1 for p in paths]
    r.drafted = [7 for _ in paths]
    r.tokens = [0] * (1 + sum(r.emitted))
    return r


def _count(paths, max_depth, max_rank):
    """Independent count: loop over (depth, rank) cells, scanning all steps for each."""
    hits = [[sum(1 for p in paths if len(p) >= d and p[d - 1] == r) for r in range(max_rank)]
            for d in range(1, max_depth + 1)]
    reached = [sum(1 for p in paths if len(p) + 1 >= d) for d in range(1, max_depth + 1)]
    return hits, reached


def test_rank_acceptance_counts_hand_example():
    a = [[0, 1], [], [1], [0, 0, 2], [0]]
    b = [[2, 0, 0, 0], [0, 1]]
    out = rank_acceptance([_result(a), _result(b), GenerationResult(tokens=[])], max_depth=3, max_rank=2)
    steps = a + b
    hits, reached = _count(steps, 3, 2)
    assert out["depths"] == [1, 2, 3]
    assert out["hits"] == hits
    assert out["reached"] == reached
    assert out["steps"] == len(steps)
    assert out["reached"][0] == len(steps)
    for d in range(3):
        for r in range(2):
            assert out["rate"][d][r] == pytest.approx(hits[d][r] / reached[d])
        assert out["depth_rate"][d] == pytest.approx(sum(hits[d]) / reached[d])
    # rank 2 at depth 1 (one step) and depth 3 (one step) are beyond max_rank=2; one node below depth 3
    assert out["beyond_rank"] == [1, 0, 1]
    assert out["deeper"] == 1
    # spot values, by hand: depth 1 rank 0 accepted in 4 of 7 steps
    assert out["hits"][0][0] == 4 and out["rate"][0][0] == pytest.approx(4 / 7)


def test_rank_acceptance_none_for_zero_denominator():
    out = rank_acceptance([_result([[0], [], [1]])], max_depth=4, max_rank=3)
    assert out["reached"][2] == 0 and out["reached"][3] == 0
    assert out["rate"][2] == [None, None, None] and out["rate"][3] == [None, None, None]
    assert out["depth_rate"][2] is None and out["depth_rate"][3] is None
    # depth 2 has a denominator (two steps reached depth 1) but no hits: 0.0, not None
    assert out["reached"][1] == 2 and out["rate"][1] == [0.0, 0.0, 0.0]
    empty = rank_acceptance([], max_depth=2, max_rank=2)
    assert empty["rate"] == [[None, None], [None, None]] and empty["depth_rate"] == [None, None]


def test_rank_acceptance_refuses_bad_input():
    chain = GenerationResult(tokens=[0, 1, 2])
    chain.add_step(drafted=3, verifier_accepted=1, emitted=2)
    with pytest.raises(SpeculatorsError, match="tree_ranks"):
        rank_acceptance([chain], 2, 2)
    bad = _result([[0, 1]])
    bad.verifier_accepted = [1]
    with pytest.raises(SpeculatorsError, match="verifier_accepted"):
        rank_acceptance([bad], 2, 2)
    with pytest.raises(SpeculatorsError, match="max_depth"):
        rank_acceptance([], 0, 2)
    with pytest.raises(SpeculatorsError, match="max_rank"):
        rank_acceptance([], 2, 0)


RATE = {1: [0.5, 0.3, 0.1], 2: [0.4, 0.2], 3: [0.35, 0.15]}


def _simulate(paths, rate, steps, seed):
    """Monte-Carlo of the independence model: per depth draw the accepted rank (or stop) independently."""
    rng = random.Random(seed)
    tree = {tuple(p) for p in paths}
    total = 0
    for _ in range(steps):
        path: tuple[int, ...] = ()
        d = 1
        while True:
            row = rate.get(d, [])
            u, acc, pick = rng.random(), 0.0, None
            for r, x in enumerate(row):
                acc += x or 0.0
                if u < acc:
                    pick = r
                    break
            if pick is None or path + (pick,) not in tree:
                break
            path += (pick,)
            d += 1
        total += len(path)
    return total / steps


@pytest.mark.parametrize("spec", ["[(0,), (1,), (0, 0), (0, 1), (1, 0)]", "[(0,), (0, 0), (0, 0, 0), (2,)]",
                                  "[(0,), (1,), (2,), (0, 0), (0, 0, 1), (3,)]"])
def test_expected_accepted_matches_monte_carlo(spec):
    exact = expected_accepted(spec, RATE)
    sim = _simulate(parse_token_tree(spec), RATE, steps=40000, seed=1234)
    assert exact == pytest.approx(sim, abs=0.015)


def test_expected_accepted_rate_forms_and_missing():
    spec = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    e = expected_accepted(spec, RATE)
    assert e == pytest.approx(0.5 + 0.3 + 0.5 * 0.4 + 0.5 * 0.2 + 0.3 * 0.4)
    as_list = [RATE[1], RATE[2], RATE[3]]
    assert expected_accepted(spec, as_list) == pytest.approx(e)
    report = {"depths": [1, 2, 3], "rate": as_list}
    assert expected_accepted(spec, report) == pytest.approx(e)
    assert expected_accepted(spec, {"1": RATE[1], "2": RATE[2]}) == pytest.approx(e)
    # None rates and ranks past the row count as 0
    assert expected_accepted("[(0,), (5,), (0, 0)]", {1: [0.5], 2: [None]}) == pytest.approx(0.5)
    with pytest.raises(SpeculatorsError, match="rate"):
        expected_accepted(spec, {1: [1.5]})
    with pytest.raises(SpeculatorsError, match="speculative_token_tree"):
        expected_accepted("[(0, 0)]", RATE)


def _valid_trees(candidates, n):
    """All sets of n candidate paths that are trees (every parent present)."""
    for combo in itertools.combinations(candidates, n):
        s = set(combo)
        if all(len(p) == 1 or p[:-1] in s for p in combo):
            yield combo


def _candidates(rate, max_depth):
    out = []
    for d in range(1, max_depth + 1):
        out += list(itertools.product(*[range(len(rate[k])) for k in range(1, d + 1)]))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_best_static_tree_equals_brute_force_with_flat_cost(n):
    cands = _candidates(RATE, 3)
    brute = max(sum(_prod(p) for p in t)
                for t in _valid_trees(cands, n))
    out = best_static_tree(RATE, [0.0] + [10.0] * (n + 1), 0.0, max_nodes=n, max_depth=3)
    size = {row["num_nodes"]: row for row in out["by_size"]}
    assert size[n]["expected_tokens_per_step"] == pytest.approx(1.0 + brute)
    # flat cost: more nodes never hurt, so the chosen tree is the largest
    assert out["num_nodes"] == n
    assert expected_accepted(out["speculative_token_tree"], RATE) == pytest.approx(brute)


def _prod(path):
    v = 1.0
    for d, r in enumerate(path, start=1):
        v *= RATE[d][r]
    return v


def test_best_static_tree_steep_cost_is_smaller_and_round_trips():
    flat = best_static_tree(RATE, [0.0] + [10.0] * 12, 1.0, max_nodes=10, max_depth=3)
    steep = best_static_tree(RATE, [0.0] + [10.0 * 1.5 ** m for m in range(1, 12)], 1.0, max_nodes=10, max_depth=3)
    assert steep["num_nodes"] < flat["num_nodes"]
    for out in (flat, steep):
        parsed = parse_token_tree(out["speculative_token_tree"])
        assert [list(p) for p in parsed] == out["paths"]
        assert str(list(parsed)) == out["speculative_token_tree"]
        assert len(parsed) == out["num_nodes"] and max(len(p) for p in parsed) == out["depth"]
        best = max(row["predicted_tokens_per_s"] for row in out["by_size"])
        assert out["predicted_tokens_per_s"] == pytest.approx(best)
        e = expected_accepted(out["speculative_token_tree"], RATE)
        assert out["expected_tokens_per_step"] == pytest.approx(1.0 + e)
        assert out["predicted_ms_per_step"] > 0
    # the cost model: forward over n + 1 tokens plus (depth - 1) drafter levels
    row = flat["by_size"][3]
    assert row["predicted_ms_per_step"] == pytest.approx(10.0 + 1.0 * (row["depth"] - 1))
    assert row["predicted_tokens_per_s"] == pytest.approx(1000 * row["expected_tokens_per_step"]
                                                          / row["predicted_ms_per_step"])
    assert best_static_tree(RATE, [0, 5, 5, 5], 0.0, 3, 3)["speculative_token_tree"] == "[(0,), (1,)]"


def test_best_static_tree_from_measured_report():
    steps = [[0, 0], [0], [1], [], [0, 1], [2, 0], [0, 0]]
    report = rank_acceptance([_result(steps)], max_depth=3, max_rank=3)
    out = best_static_tree(report, [0.0] + [4.0] * 8, 0.5, max_nodes=6, max_depth=3)
    assert out["paths"][0] == [0]
    assert out["expected_tokens_per_step"] == pytest.approx(1.0 + expected_accepted(out["paths"], report))


@pytest.mark.parametrize("kwargs,name", [
    (dict(forward_ms=[]), "forward_ms"),
    (dict(forward_ms=[0, 1.0]), "forward_ms"),
    (dict(forward_ms=[0, 1.0, -2.0]), "forward_ms"),
    (dict(draft_ms_per_level=-1.0), "draft_ms_per_level"),
    (dict(max_nodes=0), "max_nodes"),
    (dict(max_depth=0), "max_depth"),
    (dict(rate={1: [0.0]}), "rate"),
])
def test_best_static_tree_refuses_bad_inputs(kwargs, name):
    args = dict(rate=RATE, forward_ms=[0, 1.0, 1.0, 1.0], draft_ms_per_level=0.1, max_nodes=2, max_depth=2)
    args.update(kwargs)
    with pytest.raises(SpeculatorsError, match=name):
        best_static_tree(**args)


def test_tree_table_rows_and_na():
    tree = {"kind": "dynamic", "depth": 3, "topk": 2, "total_tokens": 6, "paths": None}
    rows = [
        {"tree": tree, "tree_label": "dynamic d3 k2 n6", "batch_size": 1, "tau": 2.5, "tau_ci": [2.25, 2.75],
         "nodes_per_step": 6.0, "per_position": [0.8, 0.5, 0.25], "draft_ms_per_step": 3.0,
         "verify_ms_per_step": 12.0, "tokens_per_s": 150.0, "speedup": None},
        {"tree_label": "chain K=2", "batch_size": 4, "tau": None, "tau_ci": None, "nodes_per_step": 2.0,
         "per_position": [0.7, 0.4], "draft_ms_per_step": None, "verify_ms_per_step": 9.5,
         "tokens_per_s": 120.0, "speedup": 1.25},
    ]
    lines = tree_table(rows)
    assert len(lines) == len(rows) + 2
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:4] == ["tree", "batch", "tau [95% CI]", "nodes verified/step"]
    assert head[4:7] == ["acc d1", "acc d2", "acc d3"] and head[-1] == "speedup"
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
    assert all(len(c) == len(head) for c in cells)
    assert cells[0][0] == "dynamic d3 k2 n6" and cells[0][2] == "2.50 [2.25, 2.75]"
    assert cells[0][-1] == "n/a" and cells[0][6] == "0.250"
    assert cells[1][0] == "chain K=2" and cells[1][2] == "n/a" and cells[1][6] == "n/a"
    assert cells[1][head.index("draft ms/step")] == "n/a" and cells[1][-1] == "1.25x"
    assert tree_table([])[2:] == []


def test_the_fixed_drafting_time_is_charged_to_every_size():
    """``draft_ms_fixed`` (the drafter's advance, paid whatever the tree) adds to every size's cost, so a
    larger fixed time can only favour bigger trees (more tokens per paid step), never smaller ones."""
    rate = {1: [0.5, 0.3, 0.1], 2: [0.4, 0.2]}
    fwd = [0.0] + [10.0 + 2.0 * m for m in range(1, 12)]
    a = best_static_tree(rate, fwd, 1.0, 8, 3)
    b = best_static_tree(rate, fwd, 1.0, 8, 3, draft_ms_fixed=5.0)
    for x, y in zip(a["by_size"], b["by_size"]):
        assert y["predicted_ms_per_step"] == pytest.approx(x["predicted_ms_per_step"] + 5.0)
    assert b["num_nodes"] >= a["num_nodes"]
    with pytest.raises(SpeculatorsError, match="draft_ms_fixed"):
        best_static_tree(rate, fwd, 1.0, 8, 3, draft_ms_fixed=-1.0)


def test_the_static_tree_reads_a_non_decreasing_fit_of_the_forward_times():
    """One timing per size is noisy; the eval fits the smallest-squares non-decreasing curve through them
    (pool-adjacent-violators) before choosing the static tree: already monotone times are kept, a dip is
    pooled with its neighbours, and the result never decreases."""
    from speculators.evaluation.trees import _monotone_fit

    assert _monotone_fit([0.0, 1.0, 2.0, 3.0]) == [0.0, 1.0, 2.0, 3.0]
    assert _monotone_fit([0.0, 5.0, 3.0, 4.0, 10.0]) == [0.0, 4.0, 4.0, 4.0, 10.0]
    noisy = [0.0] + [30.0 + m + (7.0 if m % 5 == 0 else 0.0) for m in range(1, 30)]
    fit = _monotone_fit(noisy)
    assert len(fit) == len(noisy) and all(a <= b for a, b in zip(fit[1:], fit[2:]))
    assert abs(sum(fit[1:]) - sum(noisy[1:])) < 1e-9  # pooling keeps each block's mean
