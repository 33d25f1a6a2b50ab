"""train.loss: every divergence against a direct computation on small tensors (float64, written here from the
definitions), the draft-vocabulary renormalisation, the mix, NaN-safe masking, and the recipe's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.divergences import DIVERGENCES, LossMix, dpace_weights, per_position
from speculators.errors import SpeculatorsError
from speculators.recipe import TrainSpec


def _direct(name: str, p: torch.Tensor, q: torch.Tensor, beta: float = 0.5, eta: float = 3.0) -> float:
    """One position's divergence, by its definition, in float64."""
    p, q = p.double(), q.double()
    kl = lambda a, b: float(sum(x * math.log(x / y) for x, y in zip(a.tolist(), b.tolist()) if x > 0))  # noqa: E731
    alpha = float(torch.minimum(p, q).sum())
    if name == "forward_kl":
        return float(-(p * q.log()).sum())
    if name == "reverse_kl":
        return kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if name == "tv":
        return 0.5 * float((p - q).abs().sum())
    if name == "nla":
        return -math.log(max(alpha, 1e-5))
    if name == "lk_hybrid":
        lam = math.exp(-eta * alpha)
        return lam * kl(p, q) + (1 - lam) * 0.5 * float((p - q).abs().sum())
    if name == "ce":
        return float(-q[int(p.argmax())].log())
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_each_divergence_equals_its_definition(name):
    g = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(3, 5, 11, generator=g)
    p = torch.softmax(2 * torch.randn(3, 5, 11, generator=g), -1)
    q = torch.softmax(logits.double(), -1)
    got = per_position(name, logits, p, jsd_beta=0.3, lk_eta=2.0)
    for b in range(3):
        for t in range(5):
            assert float(got[b, t]) == pytest.approx(_direct(name, p[b, t], q[b, t], 0.3, 2.0), rel=2e-4, abs=1e-6)
    # identical distributions: every divergence but the cross-entropies is 0
    same = per_position(name, logits, torch.softmax(logits, -1))
    if name not in ("forward_kl", "ce"):
        assert same.abs().max() < 1e-5


def test_tv_is_one_minus_the_acceptance_and_jsd_is_bounded():
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(200, 30, generator=g)
    p = torch.softmax(3 * torch.randn(200, 30, generator=g), -1)
    alpha = torch.minimum(p, torch.softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(per_position("tv", logits, p), 1 - alpha, atol=1e-5, rtol=0)
    torch.testing.assert_close(per_position("nla", logits, p), -torch.log(alpha.clamp_min(1e-5)), atol=1e-4, rtol=1e-4)
    assert float(per_position("jsd", logits, p).max()) <= math.log(2) + 1e-6


def test_a_reduced_draft_vocabulary_renormalises_the_target_on_it():
    """The teacher of a draft-vocabulary drafter is the target's distribution renormalised on the draft rows
    (what ``teacher_logits(h, rows)`` + softmax gives): the divergence is computed against that, so mass outside
    the draft vocabulary is neither trained nor counted."""
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(4, 20, generator=g)
    rows = torch.tensor([0, 3, 4, 7, 11, 19])
    teacher = torch.softmax(target_logits[:, rows], -1)  # renormalised on the draft vocabulary
    draft_logits = torch.randn(4, 6, generator=g)
    full = torch.softmax(target_logits, -1)
    renorm = full[:, rows] / full[:, rows].sum(-1, keepdim=True)
    torch.testing.assert_close(teacher, renorm)
    for name in DIVERGENCES:
        got = per_position(name, draft_logits, teacher)
        q = torch.softmax(draft_logits.double(), -1)
        for r in range(4):
            assert float(got[r]) == pytest.approx(_direct(name, renorm[r], q[r]), rel=2e-4, abs=1e-6)


def test_the_mix_is_the_weighted_sum_over_valid_positions_and_nan_safe():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 9, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(2, 6, 9, generator=g), -1)
    p[1, 5] = float("nan")  # a padded position
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 5] = False
    mix = LossMix({"forward_kl": 0.1, "tv": 0.9, "jsd": 2.0}, jsd_beta=0.2)
    s = mix.sum(logits, p, valid)
    want = sum(w * per_position(n, logits.detach(), p, valid, jsd_beta=0.2)[valid].sum()
               for n, w in {"forward_kl": 0.1, "tv": 0.9, "jsd": 2.0}.items())
    assert float(s.detach()) == pytest.approx(float(want), rel=1e-5)
    s.backward()
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[1, 5], torch.zeros(9))
    assert LossMix().is_default and not mix.is_default
    # forward_kl is the soft cross-entropy -sum p log softmax(z), every family's loss before train.loss existed
    q_log = torch.log_softmax(logits.detach().double(), -1)
    soft_ce = float(torch.where(valid, -(torch.nan_to_num(p.double()) * q_log).sum(-1), 0.0).sum())
    assert float(LossMix().sum(logits.detach(), p, valid)) == pytest.approx(soft_ce, rel=1e-6)


@pytest.mark.parametrize("loss, match", [("kl", "unknown|one or more"), ({"tv": 0.0}, "weights > 0"),
                                         ({}, "one or more"), ({"reverse_kl": 1.0, "x": 1.0}, "one or more")])
def test_the_recipe_refuses_unknown_losses_and_bad_weights(loss, match):
    with pytest.raises(ValueError, match="train.loss"):
        TrainSpec(loss=loss)
    with pytest.raises(SpeculatorsError, match=match):
        LossMix(loss if isinstance(loss, dict) else {loss: 1.0})
    with pytest.raises(ValueError):
        TrainSpec(jsd_beta=1.0)
    assert TrainSpec(loss={"ce": 0.1, "tv": 0.9}).loss_mix().terms == {"ce": 0.1, "tv": 0.9}


def test_dpace_weights_by_hand():
    """w_k = valid_k * sum_{j >= k} valid_j * prod_{i <= j} s_i, s_i = (1 - a) exp(-nll_i) + a on valid slots, 1 else."""
    g = torch.Generator().manual_seed(5)
    nll = 3 * torch.rand(4, 6, generator=g)
    valid = torch.rand(4, 6, generator=g) > 0.25
    nll[~valid] = float("nan")  # never read
    for alpha in (0.5, 1.0, 0.1):
        w = dpace_weights(nll, valid, alpha)
        for r in range(4):
            s = [((1 - alpha) * math.exp(-float(nll[r, i])) + alpha) if valid[r, i] else 1.0 for i in range(6)]
            reach = [math.prod(s[:j + 1]) for j in range(6)]
            for k in range(6):
                want = sum(reach[j] for j in range(k, 6) if valid[r, j]) if valid[r, k] else 0.0
                assert float(w[r, k]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert torch.equal(dpace_weights(nll, valid, 1.0)[0], torch.where(  # alpha 1: valid slots left from k on
        valid[0], valid[0].flip(0).float().cumsum(0).flip(0), torch.zeros(6)))
    with pytest.raises(SpeculatorsError, match="dpace_alpha"):
        dpace_weights(nll, valid, 0.0)


def test_forward_kl_by_hand_and_its_gradient():
    """row 0: logits [ln2, 0, 0] -> q = [1/2, 1/4, 1/4], teacher [1, 0, 0] -> ln 2; row 1: uniform q, teacher
    [1/2, 1/2, 0] -> ln 3; row 2: padded, a NaN teacher that must not leak into the sum or the gradient."""
    ln2, ln3 = math.log(2), math.log(3)
    logits = torch.tensor([[ln2, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, 1.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [float("nan"), 0.0, 0.0]])
    valid = torch.tensor([True, True, False])
    s = LossMix().sum(logits, teacher, valid)
    assert float(s.detach()) == pytest.approx(ln2 + ln3)
    s.backward()
    # d/dz of -sum p log softmax(z) = softmax(z) - p: row 0 -> [-1/2, 1/4, 1/4]; row 2 -> 0
    torch.testing.assert_close(logits.grad[0], torch.tensor([-0.5, 0.25, 0.25]))
    assert torch.equal(logits.grad[2], torch.zeros(3))
    assert float(LossMix().sum(logits[:2].detach(), teacher[:2])) == pytest.approx(ln2 + ln3)  # valid=None: all
    with pytest.raises(SpeculatorsError, match="same shape"):
        LossMix().sum(logits, teacher[:, :2])


def test_tv_on_random_distributions_with_padding():
    """TV summed over the valid positions = sum of 1 - sum min(p, q) there; a NaN teacher row stays out."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = (3 * torch.randn(4, 7, 50, generator=g)).requires_grad_()
        p = torch.softmax(3 * torch.randn(4, 7, 50, generator=g), -1)
        p[0, 0] = float("nan")
        valid = torch.rand(4, 7, generator=g) > 0.3
        valid[0, 0] = False
        q = torch.softmax(logits.detach().double(), -1)
        overlap = 1 - torch.minimum(torch.nan_to_num(p.double()), q).sum(-1)
        s = LossMix({"tv": 1.0}).sum(logits, p, valid)
        assert float(s.detach()) == pytest.approx(float(overlap[valid].sum()), rel=1e-5)
        s.backward()
        assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[0, 0], torch.zeros(50))
