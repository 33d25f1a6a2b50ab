"""Batch planning and collation (``speculators.data.dataset``): every example exactly once per epoch,
the padded-token budget (single over-long examples excepted), determinism in (seed, epoch), other plans
for other epochs/seeds, and right-padding."""

from __future__ import annotations

import random

import pytest
import torch

from speculators.data.dataset import collate, make_batch, plan_batches
from speculators.data.features import FeatureStore

H, NAUX = 4, 3


def store_of(lengths: list[int]) -> FeatureStore:
    """A FeatureStore whose example i has ``lengths[i]`` tokens, all with value i (to trace rows)."""
    n = sum(lengths)
    offsets = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    return FeatureStore([f"e{i}" for i in range(len(lengths))], offsets, owner.clone(),
                        owner % 2 == 0, owner + 1000, owner[:, None].expand(n, NAUX * H).half(),
                        owner[:, None].expand(n, H).half())


def random_lengths(n: int, seed: int, lo: int = 1, hi: int = 60) -> list[int]:
    r = random.Random(seed)
    return [r.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("budget", [64, 200, 1000])
@pytest.mark.parametrize("seed", [0, 3])
def test_every_example_once_and_the_budget_respected(budget, seed):
    lens = random_lengths(80, seed) + [150, 90]  # two examples longer than the smallest budget
    store = store_of(lens)
    for epoch in range(3):
        plan = plan_batches(store, budget, seed, epoch)
        flat = [i for b in plan for i in b]
        assert sorted(flat) == list(range(len(lens)))  # each example exactly once
        assert all(b for b in plan)
        for b in plan:
            padded = len(b) * max(lens[i] for i in b)
            assert padded <= budget or len(b) == 1, (b, padded)
        # over-long examples form a batch of their own
        for i, n in enumerate(lens):
            if n > budget:
                assert [i] in plan


def test_plan_is_a_function_of_seed_and_epoch():
    store = store_of(random_lengths(60, 1))
    a = plan_batches(store, 128, seed=7, epoch=2)
    assert plan_batches(store, 128, seed=7, epoch=2) == a  # resume reproduces the data position
    assert plan_batches(store_of(store.lengths().tolist()), 128, seed=7, epoch=2) == a
    others = [plan_batches(store, 128, seed=7, epoch=e) for e in (0, 1, 3)]
    assert all(p != a for p in others)  # another epoch, another order
    assert plan_batches(store, 128, seed=8, epoch=2) != a
    # the order of batches is shuffled, not sorted by length
    firsts = [min(store.lengths()[b].tolist()) for b in a]
    assert firsts != sorted(firsts)


def test_batches_group_similar_lengths():
    """Length bucketing: total padding stays far below that of random batches of the same sizes."""
    lens = random_lengths(120, 2)
    store = store_of(lens)
    plan = plan_batches(store, 256, 0, 0)
    pad = sum(len(b) * max(lens[i] for i in b) - sum(lens[i] for i in b) for b in plan)
    r = random.Random(0)
    order = list(range(len(lens)))
    r.shuffle(order)
    shuffled, k = [], 0
    for b in plan:
        shuffled.append(order[k:k + len(b)])
        k += len(b)
    pad_random = sum(len(b) * max(lens[i] for i in b) - sum(lens[i] for i in b) for b in shuffled)
    assert pad < 0.5 * pad_random


def test_empty_store_and_single_example():
    assert plan_batches(store_of([]), 64, 0, 0) == []
    assert plan_batches(store_of([500]), 64, 0, 0) == [[0]]


def test_make_batch_right_pads_the_planned_examples():
    lens = [3, 5, 2]
    store = store_of(lens)
    b = make_batch(store, [2, 0, 1])
    assert b.input_ids.shape == (3, 5) and b.aux.shape == (3, 5, NAUX * H) and b.top.shape == (3, 5, H)
    assert b.attention_mask.sum(1).tolist() == [2, 3, 5] and b.num_tokens == 10
    for row, ex in enumerate([2, 0, 1]):
        n = lens[ex]
        assert b.input_ids[row, :n].tolist() == [ex] * n and not b.input_ids[row, n:].any()
        assert b.loss_mask[row, :n].tolist() == [ex % 2 == 0] * n and not b.loss_mask[row, n:].any()
        assert b.argmax[row, :n].tolist() == [ex + 1000] * n
        assert (b.top[row, :n] == ex).all() and not b.top[row, n:].any() and not b.aux[row, n:].any()
    f = b.to("cpu", torch.float32)
    assert f.top.dtype == torch.float32 and f.input_ids.dtype == torch.int64 and f.loss_mask.dtype == torch.bool
    assert torch.equal(collate([store.example(i) for i in [2, 0, 1]]).input_ids, b.input_ids)
