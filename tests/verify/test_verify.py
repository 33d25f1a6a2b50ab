"""Tests of the rejection-sampling verifier (torch + reference implementations).

Statistical checks use Pearson chi-square against the exact target distribution with a one-sided
tail of 1e-6 (Wilson-Hilferty threshold), fixed seeds and 1e5 samples (a batch of 1e5 identical
requests in one call), so a correct sampler essentially never fails and a broken rule (see
``test_statistic_catches_broken_recovery``) fails by a wide margin.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from speculators.verify import (
    RejectionOutput,
    SamplingParams,
    apply_sampling,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
)
from speculators.errors import SpeculatorsError
from speculators.verify import VerifyInputError, layout, target_side, torch_impl
from speculators.verify.rejection import _sample_row
from speculators.verify.sampling import ARGMAX_BLOCK, effective_temperature, first_argmax
from speculators.verify.testing import (
    assert_distribution,
    chi2_check,
    inverse_cdf_token,
    random_batch,
)

N_SAMPLES = 100_000
V_SMALL = 12


# --------------------------------------------------------------------------------------------------
# apply_sampling
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, ARGMAX_BLOCK, ARGMAX_BLOCK + 1, 3 * ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 17])
def test_first_argmax_equals_argmax_including_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    ties = torch.randint(0, 3, (6, vocab), generator=gen).float()  # many tied maxima per row and per block
    ties[1, -1] = 5.0  # the maximum alone in the tail (or last) block
    ties[2] = -float("inf")
    ties[3, vocab // 2] = -float("inf")
    ties[4, vocab - 2] = float("nan")  # argmax returns the first NaN, even after a larger block maximum
    ties[5, 1] = float("nan")
    ties[5, vocab - 1] = float("nan")
    for t in (x, ties, x[::2], torch.cat([x, x], 1)[:, vocab:]):  # strided and offset views read in place
        assert torch.equal(first_argmax(t), t.argmax(dim=-1))


def test_apply_sampling_temperature_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.5, -1.0, 2.0, 0.0]])
    probs = apply_sampling(logits, torch.tensor([0.0, 0.5]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # argmax, ties -> lowest id
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, -1))


def test_apply_sampling_top_k_keeps_ties_and_off_values():
    logits = torch.tensor([[1.0, 2.0, 4.0, 3.0, 4.0]] * 4)
    top_k = torch.tensor([2, 3, 0, 5])
    probs = apply_sampling(logits, torch.ones(4), top_k)
    assert (probs[0] > 0).tolist() == [False, False, True, False, True]
    assert (probs[1] > 0).tolist() == [False, False, True, True, True]
    torch.testing.assert_close(probs[2], torch.softmax(logits[2], -1))  # 0 = off
    torch.testing.assert_close(probs[3], torch.softmax(logits[3], -1))  # >= V = off
    torch.testing.assert_close(probs[0, [2, 4]], torch.tensor([0.5, 0.5]))


def test_apply_sampling_top_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    logits = base.repeat(3, 1)
    probs = apply_sampling(logits, torch.ones(3), None, torch.tensor([0.75, 0.9, 1.0]))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    torch.testing.assert_close(probs[2], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # top-k then top-p, and a tiny p keeps the most likely token only
    probs = apply_sampling(base.repeat(2, 1), torch.ones(2), torch.tensor([3, 0]), torch.tensor([0.8, 1e-6]))
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------------


def _greedy_chain(ids, nums, target_logits):
    """Expected greedy emission per request, written out directly."""
    res, start = [], 0
    for i, n in enumerate(nums):
        rows = target_logits[start + i : start + i + n + 1]
        emitted = []
        for j in range(n + 1):
            a = int(rows[j].argmax())
            emitted.append(a)
            if j == n or int(ids[start + j]) != a:
                break
        res.append(emitted)
        start += n
    return res


def _greedy_batch(gen, nums, vocab, match=0.7):
    batch, total = len(nums), sum(nums)
    target = torch.randn(total + batch, vocab, generator=gen)
    req_of_pos = torch.repeat_interleave(torch.arange(batch), torch.tensor(nums))
    argmax = target[torch.arange(total) + req_of_pos].argmax(-1)
    rand = torch.randint(0, vocab, (total,), generator=gen)
    ids = torch.where(torch.rand(total, generator=gen) < match, argmax, rand)
    return ids, target


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("vocab", [50, 2 * ARGMAX_BLOCK + 3])  # one block; several blocks and a tail
def test_greedy_equals_argmax_chain(impl, seed, vocab, evaluation_order):
    gen = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 7, (24,), generator=gen).tolist()
    nums[0], nums[5] = 0, 6
    ids, target = _greedy_batch(gen, nums, vocab)
    draft_probs = torch.softmax(torch.randn(sum(nums), vocab, generator=gen), -1)
    sp = SamplingParams.uniform(len(nums))
    out = rejection_sample(ids, nums, draft_probs, target, sp, impl=impl, order=evaluation_order)
    expected = _greedy_chain(ids, nums, target)
    assert out.tolist() == expected
    assert out.num_accepted.tolist() == [len(e) - 1 for e in expected]
    assert out.output_token_ids.shape == (len(nums), max(nums) + 1)
    for row, e in zip(out.output_token_ids.tolist(), expected):
        assert row[len(e) :] == [-1] * (len(row) - len(e))
    # Draft probs are irrelevant for greedy requests.
    out2 = rejection_sample(ids, nums, None, target, sp, impl=impl, order=evaluation_order)
    assert torch.equal(out.output_token_ids, out2.output_token_ids)


def test_greedy_requests_in_mixed_batch_follow_argmax_chain():
    gen = torch.Generator().manual_seed(3)
    nums = [3, 0, 5, 2, 4, 1, 5, 3]
    ids, target = _greedy_batch(gen, nums, 40)
    temps = [0.0, 1.0, 0.0, 0.8, 0.0, 1.0, 0.0, 1.3]
    q = torch.softmax(torch.randn(sum(nums), 40, generator=gen), -1)
    sp = SamplingParams(torch.tensor(temps))
    expected = _greedy_chain(ids, nums, target)
    for impl in ["torch", "reference"]:
        for dp in [q, None]:
            got = rejection_sample(ids, nums, dp, target, sp, torch.Generator().manual_seed(0), impl=impl).tolist()
            for i, t in enumerate(temps):
                if t == 0:
                    assert got[i] == expected[i]


# --------------------------------------------------------------------------------------------------
# Vectorised torch == per-request reference (same random numbers)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(params=["lazy", "eager"])
def evaluation_order(request):
    """The target-side order to pass as ``rejection_sample(..., order=...)``: lazy (CPU default for large
    inputs) and eager (the CUDA default)."""
    return request.param


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize(
    "params",
    [
        dict(),
        dict(top_k=[0, 3, 7, 100, 1, 5, 0, 2, 4, 0]),
        dict(top_p=[1.0, 0.5, 0.9, 0.3, 1.0, 0.99, 0.7, 0.8, 1.0, 0.6]),
        dict(top_k=[0, 3, 7, 100, 1, 5, 0, 2, 4, 0], top_p=[1.0, 0.5, 0.9, 0.3, 1.0, 0.99, 0.7, 0.8, 1.0, 0.6]),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("order", ["lazy", "eager", "lazy-3-row-chunks"])
def test_torch_matches_reference(with_q, params, seed, order, monkeypatch):
    if order == "lazy-3-row-chunks":  # many chunks per position; pending rejected rows flushed early
        monkeypatch.setattr(layout, "CHUNK_BYTES", 4 * 97 * 3)
        order = "lazy"
    gen = torch.Generator().manual_seed(seed)
    nums = [4, 0, 2, 6, 1, 3, 0, 5, 6, 2]
    temps = [1.0, 0.0, 0.7, 1.0, 0.0, 1.5, 1.0, 0.9, 1.0, 0.0]
    batch = random_batch(gen, nums, 97, temps, with_q=with_q, **params)
    randoms = draw_randoms(nums, 97, batch[-1], torch.Generator().manual_seed(seed + 100))
    ref = rejection_sample_reference(*batch, randoms=randoms)
    vec = rejection_sample(*batch, impl="torch", order=order, randoms=randoms)
    auto = rejection_sample(*batch, impl="auto", order=order, randoms=randoms)
    assert torch.equal(vec.output_token_ids, ref.output_token_ids)
    assert torch.equal(vec.num_accepted, ref.num_accepted)
    assert torch.equal(auto.output_token_ids, ref.output_token_ids)
    assert ref.num_accepted.sum() > 0  # the batch exercises acceptance


@pytest.mark.parametrize("temps", [[1.0, 0.7, 1.0, 1.5, 0.9, 1.0], [0.0] * 6], ids=["sampled", "greedy"])
@pytest.mark.parametrize("vocab", [97, 2 * 1024 + 5])
def test_lazy_order_gathers_rows_of_non_contiguous_logits(temps, vocab):
    """Logits whose rows are not contiguous are gathered into a buffer instead of read in place: same tokens."""
    assert target_side.use_lazy(torch.zeros(8, vocab), "lazy")  # the order this test exercises
    gen = torch.Generator().manual_seed(5)
    nums = [3, 0, 5, 2, 4, 1]
    ids, nums, q, logits, sp = random_batch(gen, nums, vocab, temps)
    column_major = logits.t().contiguous().t()
    assert not column_major.is_contiguous() and torch.equal(column_major, logits)
    randoms = draw_randoms(nums, vocab, sp, torch.Generator().manual_seed(6))
    want = rejection_sample(ids, nums, q, logits, sp, impl="torch", order="lazy", randoms=randoms)
    got = rejection_sample(ids, nums, q, column_major, sp, impl="torch", order="lazy", randoms=randoms)
    ref = rejection_sample_reference(ids, nums, q, logits, sp, randoms=randoms)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(want.output_token_ids, ref.output_token_ids)


def test_zero_drafts_everywhere_is_plain_sampling():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 30, generator=gen)
    sp = SamplingParams(torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 2.0]))
    empty = torch.zeros(0, dtype=torch.int64)
    out = rejection_sample(empty, [0] * 6, None, logits, sp, torch.Generator().manual_seed(1))
    ref = rejection_sample_reference(empty, [0] * 6, None, logits, sp, torch.Generator().manual_seed(1))
    assert out.output_token_ids.shape == (6, 1)
    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    assert out.num_accepted.tolist() == [0] * 6
    assert out.output_token_ids[1, 0] == logits[1].argmax() and out.output_token_ids[4, 0] == logits[4].argmax()


def test_empty_batch():
    out = rejection_sample(torch.zeros(0, dtype=torch.int64), [], None, torch.zeros(0, 8), SamplingParams.uniform(0))
    assert out.output_token_ids.shape == (0, 1) and out.num_accepted.shape == (0,)


def test_residual_vanishing_falls_back_to_target():
    """p <= q everywhere (rounding) but p(d) < q(d): the recovered token falls back to sampling p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, generator=gen)
    p = torch.softmax(logits, -1)
    q = p[:1] * (1 + 5e-4)  # sums to 1.0005: valid within 1e-3, and p - q < 0 everywhere
    d = torch.tensor([int(p[0].argmax())])
    sp = SamplingParams.uniform(1, temperature=1.0)
    randoms = draw_randoms([1], 16, sp, torch.Generator().manual_seed(1))
    randoms.uniform.fill_(0.9999)  # > p(d) / q(d) = 0.9995: reject
    for impl in ["torch", "reference"]:
        out = rejection_sample(d, [1], q, logits, sp, impl=impl, randoms=randoms)
        assert out.num_accepted.tolist() == [0]
        assert int(out.output_token_ids[0, 0]) == inverse_cdf_token(p[0], float(randoms.sample_uniform[0]))


# --------------------------------------------------------------------------------------------------
# The recovered / bonus sampling rule (two-level inverse CDF, one float64 uniform per request)
# --------------------------------------------------------------------------------------------------


def _rule_rows(vocab, seed):
    """Target rows (one with zeros inside blocks) and draft rows."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 3, -1)
    if vocab >= 3:
        p[1, ::3] = 0.0  # zeros inside blocks
        p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(6, vocab, generator=gen) * 3, -1)
    return p, q


U_EDGES = [0.0, 0.5, 1.0 - 2.0**-53, 2.0**-40]


@pytest.mark.parametrize("vocab", [1, 5, 97, 1024, 1500, 3000])
def test_sample_rows_matches_written_out_rule(vocab):
    """torch sample_rows == the rule written out per row (testing.inverse_cdf_token) == the reference."""
    p, q = _rule_rows(vocab, vocab)
    ids = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(1))
    u = torch.tensor(U_EDGES + torch.rand(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64).tolist(),
                     dtype=torch.float64)
    sel = torch.tensor([0, 1, 2, 3, 1, 0, 2, 3])
    pos = torch.tensor([0, 5, -1, 2, -1, 3, 4, 1])  # recovered rows and bonus rows (-1) mixed
    for draft_probs in (q, None):
        got = torch_impl.sample_rows(p, sel, draft_probs, pos, ids, u).tolist()
        for i in range(sel.numel()):
            row = p[sel[i]]
            if pos[i] < 0:
                r = row
            elif draft_probs is None:
                r = row.clone()
                r[ids[pos[i]]] = 0.0
            else:
                r = (row - q[pos[i]]).clamp_min(0.0)
            want = _sample_row(r, row, float(u[i]))
            if float(r.sum()) > 0:
                assert want == inverse_cdf_token(r, float(u[i]))
            assert got[i] == want, (i, draft_probs is None)
    # sel=None (rows in order) gives the same tokens as an explicit identity selection, with a bonus row
    # mixed in and with recovered rows only (the residual is then gathered in one op when V fills the blocks).
    for pos4 in (pos[:4], torch.tensor([0, 5, 3, 2])):
        u4 = u[:4]
        for draft_probs in (q, None):
            a = torch_impl.sample_rows(p, None, draft_probs, pos4, ids, u4)
            b = torch_impl.sample_rows(p, torch.arange(4), draft_probs, pos4, ids, u4)
            assert torch.equal(a, b)
    assert torch.equal(p, _rule_rows(vocab, vocab)[0])  # p is left unchanged


def test_sampling_rule_all_zero_block_and_exact_probabilities():
    """A block whose weights all round to 0 yields its first largest entry; the rule's exact token
    probabilities (Q_b / T) * (w_t / W_b) equal r / sum(r) to float32 precision."""
    r = torch.zeros(2048)
    r[:1024] = 1e-17  # block 0: sum ~1e-14 >= 2**-52 but every floor(r * 2**52) == 0
    r[5] = 2e-17
    r[1024:] = torch.rand(1024, generator=torch.Generator().manual_seed(0))
    r[1024:] /= r[1024:].sum()
    u = torch.tensor([0.0], dtype=torch.float64)
    tok = torch_impl.sample_rows(r.unsqueeze(0), None, None, torch.tensor([-1]), torch.zeros(1, dtype=torch.int64), u)
    assert int(tok) == 5 == inverse_cdf_token(r, 0.0) == _sample_row(r, r, 0.0)
    # Exact probabilities of the rule for a generic row.
    gen = torch.Generator().manual_seed(3)
    r = torch.softmax(torch.randn(3000, generator=gen) * 4, -1)
    block = 1024
    padded = torch.zeros(3 * block)
    padded[:3000] = r
    blocks = padded.view(3, block)
    s = blocks
    while s.shape[1] > 1:
        s = s[:, : s.shape[1] // 2] + s[:, s.shape[1] // 2 :]
    q_b = torch.floor(s.view(3).double() * 2.0**52)
    w = torch.floor(blocks.double() * 2.0**52)
    prob = (q_b / q_b.sum()).unsqueeze(1) * w / w.sum(dim=1, keepdim=True)
    target = padded.double().view(3, block) / padded.double().sum()
    big = target > 1e-9
    assert float(((prob - target).abs()[big] / target[big]).max()) < 1e-5
    assert float((prob - target).abs().sum()) < 1e-6


def test_sample_rows_statistics_multi_block():
    """Tokens sampled with fresh uniforms follow r / sum(r) across several blocks (chi-square)."""
    vocab, n = 2500, 60_000
    gen = torch.Generator().manual_seed(4)
    p = torch.zeros(vocab)
    support = torch.randperm(vocab, generator=gen)[:40]
    p[support] = torch.rand(40, generator=gen) + 0.2
    p[:5] += 1e-7  # tiny but nonzero entries
    p /= p.sum()
    q = torch.zeros(1, vocab)
    q[0, support[:10]] = p[support[:10]] * 1.5  # residual: max(p - q, 0) differs from p
    q[0, support[-1]] = 1.0
    q /= q.sum()
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    sel = torch.zeros(n, dtype=torch.int64)
    for draft_probs, pos in ((None, -1), (q, 0)):
        toks = torch_impl.sample_rows(
            p.unsqueeze(0), sel, draft_probs, torch.full((n,), pos), torch.zeros(1, dtype=torch.int64), u
        )
        r = p if draft_probs is None else (p - q[0]).clamp_min(0.0)
        assert_distribution(toks, (r / r.sum()).double(), f"two-level sampler, residual={draft_probs is not None}")


# --------------------------------------------------------------------------------------------------
# Statistical losslessness
# --------------------------------------------------------------------------------------------------


def _simulate(target_rows, draft_dist, use_q, sp_kwargs, seed, n=N_SAMPLES, impl="torch", order="auto"):
    """n identical requests with K = len(draft_dist) drafts d_j ~ draft_dist[j] (independent).

    Returns (output, x2_completed): x2_completed is the second token of the generated sequence, taken
    from this step when a draft was accepted, else from a following plain-sampling step (zero drafts).
    """
    k = draft_dist.shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.multinomial(draft_dist[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    target_logits = target_rows.repeat(n, 1)
    draft_probs = draft_dist.repeat(n, 1) if use_q else None
    sp = SamplingParams.uniform(n, **sp_kwargs)
    out = rejection_sample(ids.reshape(-1), [k] * n, draft_probs, target_logits, sp, gen, impl=impl, order=order)
    x2 = out.output_token_ids[:, 1].clone()
    rej = (out.num_accepted == 0).nonzero().squeeze(1)
    m = rej.numel()
    nxt = rejection_sample(
        torch.zeros(0, dtype=torch.int64), [0] * m, None, target_rows[1:2].repeat(m, 1),
        SamplingParams.uniform(m, **sp_kwargs), gen, impl=impl, order=order,
    )
    x2[rej] = nxt.output_token_ids[:, 0]
    return out, x2


def _check_lossless(target_rows, draft_dist, use_q, sp_kwargs, seed, label, order="auto"):
    k = draft_dist.shape[0]
    vocab = target_rows.shape[1]
    temp = torch.full((k + 1,), float(sp_kwargs.get("temperature", 1.0)))
    tk = torch.full((k + 1,), sp_kwargs["top_k"]) if sp_kwargs.get("top_k") else None
    tp = torch.full((k + 1,), sp_kwargs["top_p"]) if sp_kwargs.get("top_p", 1.0) < 1.0 else None
    p = apply_sampling(target_rows, temp, tk, tp).double()
    out, x2 = _simulate(target_rows, draft_dist, use_q, sp_kwargs, seed, order=order)
    toks, acc = out.output_token_ids, out.num_accepted
    assert_distribution(toks[:, 0], p[0], f"{label}: first token")
    assert_distribution(x2, p[1], f"{label}: second token (completed sequence)")
    assert_distribution(toks[:, 0] * vocab + x2, torch.outer(p[0], p[1]).flatten(), f"{label}: joint (x1, x2)")
    if int((acc >= 1).sum()) >= 2000:  # emitted at position 2 in this step
        assert_distribution(toks[acc >= 1, 1], p[1], f"{label}: position-2 token given emitted")
    if int((acc == k).sum()) >= 2000:
        assert_distribution(toks[acc == k, k], p[k], f"{label}: bonus token")
    return out


def _rand_rows(seed, rows, vocab=V_SMALL, scale=1.5):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _q_from(logits, **kw):
    k = logits.shape[0]
    temp = torch.full((k,), float(kw.get("temperature", 1.0)))
    tk = torch.full((k,), kw["top_k"]) if kw.get("top_k") else None
    tp = torch.full((k,), kw["top_p"]) if kw.get("top_p", 1.0) < 1.0 else None
    return apply_sampling(logits, temp, tk, tp)


@pytest.mark.parametrize("use_q", [True, False], ids=["draft_probs", "point_mass"])
def test_lossless_random_distributions(use_q, evaluation_order):
    target = _rand_rows(1, 3)
    q = _q_from(_rand_rows(2, 2))
    out = _check_lossless(target, q, use_q, dict(temperature=1.0), seed=10 + use_q, label=f"random use_q={use_q}",
                          order=evaluation_order)
    assert 0 < out.num_accepted.float().mean() < 2  # mixes accepted, recovered and bonus tokens


@pytest.mark.parametrize("use_q", [True, False], ids=["draft_probs", "point_mass"])
def test_lossless_disjoint_support(use_q):
    target = _rand_rows(3, 3)
    target[:, V_SMALL // 2 :] = float("-inf")  # p on the first half (masked logits are allowed)
    draft = _rand_rows(4, 2)
    draft[:, : V_SMALL // 2] = -1e4  # q on the second half
    out = _check_lossless(target, _q_from(draft), use_q, dict(temperature=1.0), seed=20, label="disjoint")
    assert out.num_accepted.sum() == 0


def test_lossless_q_equals_p():
    target = _rand_rows(5, 3)
    out = _check_lossless(target, _q_from(target[:2]), True, dict(temperature=1.0), seed=30, label="q == p")
    assert bool((out.num_accepted == 2).all())  # min(1, p/q) = 1: always accepted


@pytest.mark.parametrize("use_q", [True, False], ids=["draft_probs", "point_mass"])
def test_lossless_q_point_mass(use_q):
    target = _rand_rows(6, 3)
    q = torch.zeros(2, V_SMALL)
    q[0, 3] = q[1, 7] = 1.0
    _check_lossless(target, q, use_q, dict(temperature=1.0), seed=40, label="q point mass")


def test_lossless_p_point_mass():
    target = _rand_rows(7, 3)
    target[0, 5] = 1e4  # p_1 is a point mass on token 5
    q = _q_from(_rand_rows(8, 2))
    out = _check_lossless(target, q, True, dict(temperature=1.0), seed=50, label="p point mass")
    assert bool((out.output_token_ids[:, 0] == 5).all())


@pytest.mark.parametrize("use_q", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize(
    "sp_kwargs",
    [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.8),
     dict(temperature=1.0, top_k=7, top_p=0.7)],
    ids=["temp", "top_k", "top_p", "top_k_top_p"],
)
def test_lossless_with_sampling_params(use_q, sp_kwargs):
    target = _rand_rows(9, 3)
    q = _q_from(target[:2] + _rand_rows(10, 2, scale=1.0), **sp_kwargs)  # drafter uses the same processing
    _check_lossless(target, q, use_q, sp_kwargs, seed=60, label=f"{sp_kwargs} use_q={use_q}")


def test_statistic_catches_broken_recovery(monkeypatch, evaluation_order):
    """Recovered token drawn from p instead of max(p - q, 0): the first-token check must reject it."""
    target = _rand_rows(1, 3)
    q = _q_from(_rand_rows(2, 2))
    p1 = torch.softmax(target[0], -1)
    out, _ = _simulate(target, q, True, dict(temperature=1.0), seed=11, order=evaluation_order)
    stat_ok, thr, _, _ = chi2_check(out.output_token_ids[:, 0], p1)
    assert stat_ok <= thr

    orig = torch_impl.sample_rows

    def broken(p, sel, draft_probs, pos, ids, u):
        zeros = None if draft_probs is None else torch.zeros_like(draft_probs)  # max(p - 0, 0) = p
        return orig(p, sel, zeros, pos, ids, u)

    monkeypatch.setattr(torch_impl, "sample_rows", broken)
    out, _ = _simulate(target, q, True, dict(temperature=1.0), seed=11, order=evaluation_order)
    stat, thr, tv, _ = chi2_check(out.output_token_ids[:, 0], p1)
    assert stat > 10 * thr, f"broken rule not detected: chi2={stat:.1f}, threshold {thr:.1f}, TV={tv:.4f}"


def test_statistic_catches_always_accept(monkeypatch, evaluation_order):
    """Accepting every draft emits q, not p: the first-token check must reject it."""
    target = _rand_rows(1, 3)
    q = _q_from(_rand_rows(2, 2))
    p1 = torch.softmax(target[0], -1)
    orig = torch_impl.scan

    def broken(layout, ids, draft_probs, p_draft, uniform):
        return orig(layout, ids, draft_probs, torch.ones_like(p_draft), uniform)

    monkeypatch.setattr(torch_impl, "scan", broken)
    out, _ = _simulate(target, q, True, dict(temperature=1.0), seed=12, order=evaluation_order)
    stat, thr, _, _ = chi2_check(out.output_token_ids[:, 0], p1)
    assert stat > 10 * thr


# --------------------------------------------------------------------------------------------------
# Seeds / reproducibility
# --------------------------------------------------------------------------------------------------


def test_per_request_seeds_reproducible_and_batch_independent():
    gen = torch.Generator().manual_seed(0)
    nums = [3, 2, 4, 1]
    ids, nums, q, target, _ = random_batch(gen, nums, 64, [1.0] * 4)

    def run(seeds, global_seed):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        sp = SamplingParams(torch.ones(len(seeds)), generators=gens)
        return rejection_sample(ids, nums, q, target, sp, torch.Generator().manual_seed(global_seed))

    a = run([11, None, 13, None], 1)
    b = run([11, None, 13, None], 2)  # other requests use a different global stream
    assert a.tolist()[0] == b.tolist()[0] and a.tolist()[2] == b.tolist()[2]
    c = run([11, None, 13, None], 1)
    assert torch.equal(a.output_token_ids, c.output_token_ids)
    # Request 2 alone (same seed) gives the same tokens as inside the batch.
    s, e = sum(nums[:2]), sum(nums[:3])
    alone = rejection_sample(
        ids[s:e], [nums[2]], q[s:e], target[s + 2 : e + 3],
        SamplingParams(torch.ones(1), generators=[torch.Generator().manual_seed(13)]),
    )
    assert alone.tolist()[0] == a.tolist()[2]
    # Different seeds give different streams (over many requests).
    sp1 = SamplingParams.uniform(200, temperature=1.0, seed=0)
    sp2 = SamplingParams.uniform(200, temperature=1.0, seed=1000)
    logits = torch.randn(200, 64, generator=gen)
    empty = torch.zeros(0, dtype=torch.int64)
    t1 = rejection_sample(empty, [0] * 200, None, logits, sp1).output_token_ids
    t2 = rejection_sample(empty, [0] * 200, None, logits, sp2).output_token_ids
    t1b = rejection_sample(empty, [0] * 200, None, logits, SamplingParams.uniform(200, temperature=1.0, seed=0))
    assert torch.equal(t1, t1b.output_token_ids) and not torch.equal(t1, t2)


# --------------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------------


def _base():
    gen = torch.Generator().manual_seed(0)
    ids, nums, q, target, sp = random_batch(gen, [2, 0, 3], 10, [1.0, 0.0, 1.0])
    return dict(draft_token_ids=ids, num_draft_tokens=nums, draft_probs=q, target_logits=target, sampling=sp)


def _set(key, fn):
    def mutate(kw):
        kw[key] = fn(kw[key])
        return kw

    return mutate


def _nan(t):
    t = t.clone()
    t[1, 3] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[4, 0] = float("inf")
    return t


def _sp(**kw):
    def f(sp):
        return SamplingParams(**{**sp.__dict__, **kw})

    return f


BAD_INPUTS = {
    "ids_length": (_set("draft_token_ids", lambda t: t[:-1]), "draft_token_ids"),
    "ids_dtype": (_set("draft_token_ids", lambda t: t.float()), "draft_token_ids"),
    "ids_too_large": (_set("draft_token_ids", lambda t: t.clone().fill_(10)), r"draft_token_ids.*\[0, 10\)"),
    "ids_negative": (_set("draft_token_ids", lambda t: t.clone().fill_(-1)), "draft_token_ids"),
    "nums_sum": (_set("num_draft_tokens", lambda n: [2, 1, 3]), "draft_token_ids"),
    "nums_negative": (_set("num_draft_tokens", lambda n: [3, -1, 3]), "num_draft_tokens"),
    "logits_rows": (_set("target_logits", lambda t: t[:-1]), "target_logits"),
    "logits_1d": (_set("target_logits", lambda t: t[0]), "target_logits"),
    "logits_nan": (_set("target_logits", _nan), "target_logits.*NaN"),
    "logits_inf": (_set("target_logits", _inf), "target_logits.*inf"),
    "probs_shape": (_set("draft_probs", lambda t: t[:, :-1]), "draft_probs"),
    "probs_rows": (_set("draft_probs", lambda t: t[:-1]), "draft_probs"),
    "probs_sum": (_set("draft_probs", lambda t: t * 1.01), "draft_probs.*sum to 1"),
    "probs_nan": (_set("draft_probs", _nan), "draft_probs"),
    "temperature_negative": (_set("sampling", _sp(temperature=torch.tensor([1.0, -0.5, 1.0]))), "temperature"),
    "temperature_nan": (_set("sampling", _sp(temperature=torch.tensor([1.0, float("nan"), 1.0]))), "temperature"),
    "temperature_shape": (_set("sampling", _sp(temperature=torch.ones(2))), "temperature"),
    # finite in float64 but inf in float32, the compute dtype
    "temperature_f32_overflow": (
        _set("sampling", _sp(temperature=torch.tensor([1.0, 1e300, 1.0], dtype=torch.float64))), "temperature"
    ),
    "logits_f32_overflow": (_set("target_logits", lambda t: t.double().index_fill(1, torch.tensor([2]), 1e300)),
                            "target_logits.*float32"),
    "top_p_zero": (_set("sampling", _sp(top_p=torch.tensor([1.0, 0.0, 0.5]))), "top_p"),
    "top_p_above_one": (_set("sampling", _sp(top_p=torch.tensor([1.0, 1.5, 0.5]))), "top_p"),
    "top_k_negative": (_set("sampling", _sp(top_k=torch.tensor([1, -2, 0]))), "top_k"),
    "top_k_float": (_set("sampling", _sp(top_k=torch.tensor([1.0, 2.0, 0.0]))), "top_k"),
    "generators_len": (_set("sampling", _sp(generators=[None])), "generators"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise(name):
    mutate, match = BAD_INPUTS[name]
    kw = mutate(_base())
    with pytest.raises(ValueError, match=match) as err:
        rejection_sample(**kw)
    assert isinstance(err.value, SpeculatorsError)  # the CLI prints it as one line
    with pytest.raises(ValueError, match=match):
        rejection_sample_reference(**kw)


def test_bad_impl_and_apply_sampling_errors():
    with pytest.raises(ValueError, match="impl"):
        rejection_sample(**_base(), impl="cuda")
    with pytest.raises(VerifyInputError, match="order"):
        rejection_sample(**_base(), order="sideways")
    with pytest.raises(VerifyInputError, match="order.*CPU"):  # the lazy order is CPU only
        target_side.use_lazy(torch.empty(4, 8, device="meta"), "lazy")
    assert not target_side.use_lazy(torch.empty(4, 8, device="meta"), "auto")
    with pytest.raises(ValueError, match="temperature"):
        apply_sampling(torch.zeros(2, 4), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="top_p"):
        apply_sampling(torch.zeros(2, 4), torch.ones(2), None, torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="logits"):
        apply_sampling(torch.zeros(4), torch.ones(4))


def test_validate_false_skips_value_checks():
    kw = _base()
    kw["draft_probs"] = kw["draft_probs"] * 1.01  # bad sums, only caught by value checks
    out = rejection_sample(**kw, validate=False)
    assert isinstance(out, RejectionOutput)
    with pytest.raises(ValueError, match="draft_token_ids"):  # shape checks always run
        rejection_sample(**{**kw, "draft_token_ids": kw["draft_token_ids"][:-1]}, validate=False)


# --------------------------------------------------------------------------------------------------
# Robustness: tiny temperatures, float64 logits, logits that require grad
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiny", [1e-39, 1e-30])
@pytest.mark.parametrize("order", ["lazy", "eager"])
def test_tiny_temperature_is_raised_to_vllm_minimum(tiny, order):
    """0 < t < 1e-2 behaves exactly as t = 1e-2 (vLLM's _MAX_TEMP clamp) on every path, greedy rows untouched."""
    gen = torch.Generator().manual_seed(21)
    nums = [3, 2, 0, 4, 1, 2]
    temps = [tiny, 0.0, tiny, 1.0, 0.0, tiny]
    clamped = [0.01 if t == tiny else t for t in temps]
    ids, nums, q, logits, _ = random_batch(gen, nums, 50, clamped, scale=3.0)
    with pytest.warns(UserWarning, match="temperature.*0.01"):
        sp = SamplingParams(torch.tensor(temps))
    assert sp.temperature.tolist() == pytest.approx(clamped) and sp.temperature.dtype == torch.float32
    want_sp = SamplingParams(torch.tensor(clamped))
    randoms = draw_randoms(nums, 50, want_sp, torch.Generator().manual_seed(22))
    want = rejection_sample_reference(ids, nums, q, logits, want_sp, randoms=randoms)
    greedy = _greedy_chain(ids, nums, logits)
    # A temperature set after construction (no __post_init__) is clamped by the verifier itself.
    raw = SamplingParams(torch.tensor(clamped))
    raw.temperature = torch.tensor(temps)
    for params in (sp, raw):
        for dp in (q, None):
            w = rejection_sample_reference(ids, nums, dp, logits, want_sp, randoms=randoms)
            for impl in ("torch", "reference"):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = rejection_sample(ids, nums, dp, logits, params, impl=impl, order=order, randoms=randoms)
                assert len(caught) == (1 if params is raw else 0)  # clamped once: no second warning for sp
                assert torch.equal(got.output_token_ids, w.output_token_ids), (impl, dp is None)
                assert all(0 <= t < 50 for row in got.tolist() for t in row)
                assert [got.tolist()[i] for i in (1, 4)] == [greedy[i] for i in (1, 4)]
    assert torch.equal(
        rejection_sample(ids, nums, q, logits, sp, order=order, randoms=randoms).output_token_ids,
        want.output_token_ids,
    )
    # The drafter side: apply_sampling clamps the same way (q and p use the same temperature).
    rows = logits[:6]
    with pytest.warns(UserWarning, match="temperature"):
        p = apply_sampling(rows, torch.tensor(temps))
    assert torch.isfinite(p).all()
    assert torch.equal(p, apply_sampling(rows, torch.tensor(clamped)))
    # The clamp happens before the float32 rounding: float64 1e-50 and uniform(1e-46) are not greedy.
    with pytest.warns(UserWarning):
        assert SamplingParams(torch.tensor([1e-50], dtype=torch.float64)).temperature.tolist() == [
            pytest.approx(0.01)
        ]
    with pytest.warns(UserWarning):
        assert SamplingParams.uniform(2, temperature=1e-46).temperature.tolist() == [pytest.approx(0.01)] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 0.01 itself (float32 or float64) is not raised, and not warned about
        for dtype in (torch.float32, torch.float64):
            t = torch.tensor([0.0, 0.01, 0.5, -1.0], dtype=dtype)
            assert torch.equal(effective_temperature(t), t.float())


def _near_tie_logits(gen, rows, vocab):
    """float64 logits whose float64 argmax (id 7) and float32 argmax (id 3, an exact tie after rounding) differ."""
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    x[:, 3] = 10.0
    x[:, 7] = 10.0 + 1e-12
    assert bool((x.argmax(-1) == 7).all()) and bool((x.float().argmax(-1) == 3).all())
    return x


def test_float64_near_tie_greedy_tokens_do_not_depend_on_the_batch():
    """A greedy request's tokens are the float32 argmax chain alone (eager) and inside a large (lazy) batch."""
    gen = torch.Generator().manual_seed(31)
    vocab, n_big = 1024, 700  # 700 requests x 3 rows x 1024 x 4 bytes > 2 * CHUNK_BYTES: "auto" is lazy
    ids = torch.tensor([3, 3])  # the float32 argmax: accepted in float32, rejected in float64
    alone_logits = _near_tie_logits(gen, 3, vocab)
    want = [[3, 3, 3]]
    sp1 = SamplingParams.uniform(1)
    assert not target_side.use_lazy(alone_logits.float(), "auto")
    for impl in ("torch", "reference"):
        for order in ("auto", "eager", "lazy"):
            assert rejection_sample(ids, [2], None, alone_logits, sp1, impl=impl, order=order).tolist() == want
    big = _near_tie_logits(gen, 3 * n_big, vocab)
    big[:3] = alone_logits
    big_ids = ids.repeat(n_big)
    assert target_side.use_lazy(big.float(), "auto")
    for temps in ([0.0] * n_big, [0.0] + [1.0] * (n_big - 1)):  # all greedy, and greedy among sampled requests
        sp = SamplingParams(torch.tensor(temps), generators=None)
        for order in ("auto", "eager"):
            out = rejection_sample(big_ids, [2] * n_big, None, big, sp, torch.Generator().manual_seed(0), order=order)
            assert out.tolist()[0] == want[0], (order, temps[1])
    # Sampled requests: float64 logits give exactly what their float32 rounding gives, on every path.
    gen = torch.Generator().manual_seed(32)
    ids, nums, q, logits, sp = random_batch(gen, [3, 0, 2, 4], 97, [1.0, 0.0, 0.7, 1.3])
    logits64 = logits.double() + torch.randn(logits.shape, generator=gen, dtype=torch.float64) * 1e-9
    randoms = draw_randoms(nums, 97, sp, torch.Generator().manual_seed(33))
    for impl, order in (("torch", "lazy"), ("torch", "eager"), ("reference", "auto")):
        for dp in (q, None):
            a = rejection_sample(ids, nums, dp, logits64, sp, impl=impl, order=order, randoms=randoms)
            b = rejection_sample(ids, nums, dp, logits64.float(), sp, impl=impl, order=order, randoms=randoms)
            assert torch.equal(a.output_token_ids, b.output_token_ids), (impl, order)
    # apply_sampling (the drafter side) takes the float32 argmax for greedy rows too.
    assert apply_sampling(alone_logits, torch.zeros(3)).argmax(-1).tolist() == [3, 3, 3]


@pytest.mark.parametrize(
    "temps", [[1.0, 0.7, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.5]], ids=["sampled", "greedy", "mixed"]
)
@pytest.mark.parametrize("order", ["lazy", "eager"])
def test_inputs_that_require_grad_are_detached(temps, order):
    """Logits / draft probs from a model with autograd on: same tokens as detached inputs, no graph, no grad."""
    gen = torch.Generator().manual_seed(41)
    nums = [2, 3, 1]
    ids, nums, q, logits, sp = random_batch(gen, nums, 40, temps, top_k=[0, 5, 0], top_p=[1.0, 1.0, 0.9])
    weight = torch.ones(40, requires_grad=True)
    logits_g = logits * weight  # a non-leaf that requires grad, as a model's output
    q_g = (q * weight).detach().requires_grad_()  # a leaf that requires grad
    randoms = draw_randoms(nums, 40, sp, torch.Generator().manual_seed(42))
    for impl in ("torch", "reference"):
        for dp, dp_g in ((q, q_g), (None, None)):
            want = rejection_sample(ids, nums, dp, logits, sp, impl=impl, order=order, randoms=randoms)
            got = rejection_sample(ids, nums, dp_g, logits_g, sp, impl=impl, order=order, randoms=randoms)
            assert torch.equal(got.output_token_ids, want.output_token_ids)
            assert not got.output_token_ids.requires_grad and not got.num_accepted.requires_grad
    assert weight.grad is None and q_g.grad is None
    p = apply_sampling(logits_g, sp.temperature.repeat_interleave(torch.tensor(nums) + 1))
    assert not p.requires_grad and torch.isfinite(p).all()


def _verify_imports() -> dict[str, set[str]]:
    """Module -> modules of speculators.verify it imports (any scope, TYPE_CHECKING and function bodies too)."""
    import ast
    from pathlib import Path

    pkg = Path(layout.__file__).parent
    mods = {f.stem for f in pkg.glob("*.py")}
    graph = {}
    for name in mods:
        deps = set()
        for node in ast.walk(ast.parse((pkg / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from .x import ...
                    deps.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import x, y
                    deps.update(a.name for a in node.names if a.name in mods)
                elif node.level == 0 and (node.module or "").startswith("speculators.verify."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("speculators.verify."):
                        deps.add(a.name.split(".")[2])
        graph[name] = deps - {name}
    return graph


def test_verify_import_graph_is_a_dag():
    graph = _verify_imports()
    assert graph["layout"] == set()  # the leaf: shared layout types and constants
    assert {"layout", "sampling", "target_side", "torch_impl", "triton_impl"} <= graph["rejection"]
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError(f"import cycle in speculators.verify: {' -> '.join(path + [m])}")
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    # The lazy/eager switch is an argument, not a module global that callers patch.
    assert not hasattr(target_side, "LAZY_ON_CPU")
    import inspect

    assert inspect.signature(rejection_sample).parameters["order"].default == "auto"

