"""speculators.losses by hand: losses (sums over valid positions), the one chained-acceptance metric,
the draft-vocabulary maps and the draft sampling helper. Every expected value is worked out in the test."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.losses import (
    chained_acceptance,
    draft_to_target,
    hard_cross_entropy,
    sample_draft,
    sampling_values,
    smooth_l1_feature_loss,
    target_to_draft,
)
from speculators.verify import SamplingParams

LN2, LN3 = math.log(2), math.log(3)


# ----------------------------------------------------------------------------- losses


def test_hard_cross_entropy_reads_only_valid_labels():
    # row 0: q = [1/2, 1/4, 1/4], label 1 -> ln 4; row 1: uniform, label 2 -> ln 3; row 2 invalid, label -5
    logits = torch.tensor([[[LN2, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 9.0, 0.0]]])
    labels = torch.tensor([[1, 2, -5]])
    valid = torch.tensor([[True, True, False]])
    assert float(hard_cross_entropy(logits, labels, valid)) == pytest.approx(math.log(4) + LN3)
    with pytest.raises(SpeculatorsError, match=r"labels must lie in \[0, 3\)"):
        hard_cross_entropy(logits, labels)  # the -5 is read when every position is valid
    with pytest.raises(SpeculatorsError, match="without the last dim"):
        hard_cross_entropy(logits, labels[0])


def test_smooth_l1_feature_loss_is_the_per_position_mean_summed():
    # beta 1: |d| < 1 -> d^2 / 2, else |d| - 1/2. position 0: d = [0.5, 3] -> [0.125, 2.5], mean 1.3125
    # position 1: d = [-2, 0] -> [1.5, 0], mean 0.75; position 2 is invalid
    pred = torch.tensor([[0.5, 3.0], [-2.0, 0.0], [100.0, 100.0]])
    target = torch.zeros(3, 2)
    valid = torch.tensor([True, True, False])
    assert float(smooth_l1_feature_loss(pred, target, valid)) == pytest.approx(1.3125 + 0.75)
    assert float(smooth_l1_feature_loss(pred[:2], target[:2])) == pytest.approx(1.3125 + 0.75)
    with pytest.raises(SpeculatorsError, match="same shape"):
        smooth_l1_feature_loss(pred, target[:, :1])


# ----------------------------------------------------------------------------- chained acceptance


def _b(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_chained_acceptance_by_hand():
    # 5 chain starts, 3 steps
    correct = [_b([1, 1, 1, 0, 1]), _b([1, 0, 1, 1, 1]), _b([1, 1, 0, 1, 1])]
    labelled = [_b([1, 1, 1, 1, 0]), _b([1, 1, 1, 1, 1]), _b([1, 1, 1, 0, 1])]
    m = chained_acceptance(correct, labelled)
    # step 0: live = 11110 (4), full = 11101 -> hits at 0,1,2 -> 3/4; cond = 3/4
    # step 1: live = 11110 (start 4 drafted an unlabelled token at step 0), full = 10101 -> hits 0,2 -> 2/4;
    #         cond den = prev full & live = 11100 -> 3 -> 2/3
    # step 2: live = 11100 (3), full = 10001 -> hits 0 -> 1/3; cond den = prev full 10101 & live 11100 = 2 -> 1/2
    assert m == pytest.approx({"full_acc_0": 3 / 4, "cond_acc_0": 3 / 4, "full_acc_1": 2 / 4,
                               "cond_acc_1": 2 / 3, "full_acc_2": 1 / 3, "cond_acc_2": 1 / 2,
                               "sim_tau": 1 + 3 / 4 + 2 / 4 + 1 / 3})


def test_chained_acceptance_shrinking_widths_and_empty_denominators():
    # Medusa-style: step j has one chain start fewer; step 1 sees only the first 2 starts
    correct = [_b([[1, 0, 1]]), _b([[1, 1]])]
    labelled = [_b([[1, 1, 0]]), _b([[0, 1]])]
    m = chained_acceptance(correct, labelled)
    # step 0: live 110 (2), full 101 -> hit at 0 -> 1/2; step 1: live = 11 & 01 = 01, full = 10 & 11 = 10
    # -> no hit: 0/1; cond den = prev full[:2] 10 & live 01 = 0 -> 0.0 (no division by zero)
    assert m == pytest.approx({"full_acc_0": 0.5, "cond_acc_0": 0.5, "full_acc_1": 0.0, "cond_acc_1": 0.0,
                               "sim_tau": 1.5})
    none = chained_acceptance([_b([0, 0])], [_b([0, 0])])
    assert none == {"full_acc_0": 0.0, "cond_acc_0": 0.0, "sim_tau": 1.0}


def test_chained_acceptance_rejects_inconsistent_steps():
    with pytest.raises(SpeculatorsError, match="one of each per step"):
        chained_acceptance([_b([1])], [])
    with pytest.raises(SpeculatorsError, match="step 0"):
        chained_acceptance([_b([1, 1])], [_b([1])])
    with pytest.raises(SpeculatorsError, match="more than step 0"):
        chained_acceptance([_b([1]), _b([1, 1])], [_b([1]), _b([1, 1])])


# ----------------------------------------------------------------------------- draft vocabulary


def test_draft_to_target_and_back():
    # draft vocabulary = target ids [1, 4, 5] of V = 7: d2t = ids - arange = [1, 3, 3]
    d2t = torch.tensor([1, 3, 3])
    t2d = torch.tensor([0, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    assert draft_to_target(torch.tensor([[2, 0], [1, 1]]), d2t).tolist() == [[5, 1], [4, 4]]
    assert draft_to_target(torch.tensor([3, 0]), None).tolist() == [3, 0]  # full vocabulary: identity
    idx, ok = target_to_draft(torch.tensor([5, 1, 4, 2, 0]), t2d)
    assert ok.tolist() == [True, True, True, False, False]
    assert idx[ok].tolist() == [2, 0, 1]
    assert ((idx >= 0) & (idx < 3)).all()  # out-of-vocab ids still index the draft vocab safely


# ----------------------------------------------------------------------------- draft sampling


def test_sample_draft_greedy_maps_the_argmax_to_target_ids():
    d2t = torch.tensor([1, 3, 3])  # draft ids 0, 1, 2 -> target ids 1, 4, 5
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, 0.0]])  # argmax 1; tie -> lowest index 0
    for sampling in (None, SamplingParams.uniform(1, 0.0, top_k=2)):
        ids, probs = sample_draft(logits, sampling, d2t=d2t, vocab_size=7)
        assert ids.tolist() == [4, 1] and ids.dtype == torch.int64 and probs is None
    ids, _ = sample_draft(torch.tensor([0.0, 1.0, 0.5]), None)  # one row, full vocabulary
    assert ids.tolist() == [1]


def test_sample_draft_sampled_rows_follow_the_request_settings():
    d2t = torch.tensor([1, 3, 3])
    logits = torch.tensor([[0.0, LN2, LN3]])  # softmax = [1/6, 2/6, 3/6] at temperature 1
    sp = SamplingParams.uniform(1, 1.0)
    ids, probs = sample_draft(logits, sp, torch.Generator().manual_seed(0), d2t=d2t, vocab_size=7)
    assert probs.shape == (1, 7) and probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], torch.tensor([0, 1 / 6, 0, 0, 2 / 6, 3 / 6, 0]))
    assert int(ids[0]) in (1, 4, 5)
    # top_k = 2 keeps draft ids 1 and 2 (target 4, 5): q = [0, 2/5, 3/5]
    _, probs = sample_draft(logits, SamplingParams.uniform(1, 1.0, top_k=2), d2t=d2t, vocab_size=7)
    torch.testing.assert_close(probs[0], torch.tensor([0, 0, 0, 0, 2 / 5, 3 / 5, 0]))
    # temperature 0.5 squares the odds: [1, 4, 9] / 14
    _, probs = sample_draft(logits, SamplingParams.uniform(1, 0.5))
    torch.testing.assert_close(probs[0], torch.tensor([1 / 14, 4 / 14, 9 / 14]))


def test_sample_draft_draws_from_q_with_the_requests_generator():
    logits = torch.tensor([[0.0, LN2, LN3]])  # q = [1/6, 2/6, 3/6]
    # the request's own generator is used when none is passed: the same seed gives the same draws
    a = [int(sample_draft(logits, sp, None)[0][0]) for sp in [SamplingParams.uniform(1, 1.0, seed=3)]
         for _ in range(20)]
    sp = SamplingParams.uniform(1, 1.0, seed=3)
    b = [int(sample_draft(logits, sp, None)[0][0]) for _ in range(20)]
    sp2 = SamplingParams.uniform(1, 1.0, seed=3)
    c = [int(sample_draft(logits, sp2, None)[0][0]) for _ in range(20)]
    assert b == c and len(set(a)) > 1
    # empirical frequencies of 3000 draws (one call, 3000 rows) match q
    ids, _ = sample_draft(logits.expand(3000, 3), SamplingParams.uniform(1, 1.0), torch.Generator().manual_seed(1))
    freq = torch.bincount(ids, minlength=3).float() / 3000
    assert 0.5 * float((freq - torch.tensor([1 / 6, 2 / 6, 3 / 6])).abs().sum()) < 0.03


def test_sample_draft_and_sampling_values_refuse_bad_settings():
    logits = torch.zeros(1, 3)
    with pytest.raises(SpeculatorsError, match="SamplingParams"):
        sample_draft(logits, {"temperature": 1.0})
    with pytest.raises(SpeculatorsError, match="sampling.temperature"):
        sample_draft(logits, SamplingParams.uniform(2, 1.0))  # two requests: one is allowed
    with pytest.raises(SpeculatorsError, match="vocab_size"):
        sample_draft(logits, None, d2t=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(SpeculatorsError, match=r"\[R, N\]"):
        sample_draft(torch.zeros(1, 1, 3), None)
    assert sampling_values(None) == (0.0, 0, 1.0)
    assert sampling_values(SamplingParams.uniform(1, 0.7, top_k=5, top_p=0.95)) == (0.7, 5, 0.95)
    with pytest.raises(SpeculatorsError, match="sampling"):
        sampling_values(SamplingParams.uniform(3))
