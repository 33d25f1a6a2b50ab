"""Triton kernels vs the vectorised torch implementation: identical outputs on identical random numbers.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors, which needs
``TRITON_INTERPRET=1`` in the environment before triton is first imported. This module sets it at import
(pytest imports test modules before running any test). If triton was already imported without it by
something else in this process, the tests here are skipped and one test reruns this file in a fresh
Python process with the variable set.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton")

from speculators.verify import (  # noqa: E402
    SamplingParams,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
    torch_impl,
    triton_impl,
)
from speculators.verify.testing import inverse_cdf_token, random_batch  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
READY = ON_CUDA or triton_impl.interpreter_active()
needs_ready = pytest.mark.skipif(not READY, reason="triton imported without TRITON_INTERPRET=1; see subprocess test")


@pytest.mark.skipif(READY, reason="kernels run in this process")
def test_triton_suite_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]


@pytest.fixture(params=["lazy", "eager"])
def evaluation_order(request):
    """``rejection_sample(..., order=...)``: the lazy order is CPU only (the interpreter's tensors)."""
    if request.param == "lazy" and DEVICE != "cpu":
        pytest.skip("order='lazy' is implemented for CPU tensors only")
    return request.param


def _compare(batch, seed, order="auto"):
    ids, nums, q, target, sp = batch
    vocab = target.shape[1]
    randoms = draw_randoms(nums, vocab, sp, torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE)
    ref = rejection_sample(ids, nums, q, target, sp, impl="torch", order=order, randoms=randoms)
    tri = rejection_sample(ids, nums, q, target, sp, impl="triton", order=order, randoms=randoms)
    assert torch.equal(tri.output_token_ids, ref.output_token_ids), (tri.tolist(), ref.tolist())
    assert torch.equal(tri.num_accepted, ref.num_accepted)
    return ref


@needs_ready
@pytest.mark.parametrize("vocab", [37, 256, 1000, 1500])  # sampling blocks: min(1024, next pow2): 1 block / 2 with a tail
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_matches_torch_mixed(vocab, with_q, seed, evaluation_order):
    gen = torch.Generator().manual_seed(seed)
    nums = [3, 0, 5, 1, 4, 2, 0, 6]
    temps = [1.0, 0.0, 0.8, 0.0, 1.0, 1.5, 1.0, 0.0]
    top_k = [0, 0, 10, 0, 3, 0, 0, 0] if seed else None
    top_p = [1.0, 1.0, 0.9, 1.0, 1.0, 0.7, 1.0, 1.0] if seed else None
    batch = random_batch(gen, nums, vocab, temps, with_q=with_q, top_k=top_k, top_p=top_p, device=DEVICE)
    out = _compare(batch, seed, evaluation_order)
    assert out.num_accepted.sum() > 0


@needs_ready
@pytest.mark.parametrize("vocab", [37, 256, 1000])
def test_triton_matches_torch_greedy(vocab, evaluation_order):
    gen = torch.Generator().manual_seed(7)
    nums = [2, 0, 4, 3, 1]
    ids, nums, q, target, sp = random_batch(gen, nums, vocab, [0.0] * 5, device=DEVICE)
    ids = ids.clone()
    ids[:2] = target[:2].argmax(-1)  # request 0 accepts everything -> bonus
    _compare((ids, nums, q, target, sp), 0, evaluation_order)
    _compare((ids, nums, None, target, sp), 0, evaluation_order)


@needs_ready
def test_triton_zero_drafts_and_reference():
    gen = torch.Generator().manual_seed(3)
    batch = random_batch(gen, [0, 0, 0, 0], 300, [1.0, 0.0, 0.5, 1.0], device=DEVICE)
    _compare(batch, 5)
    batch = random_batch(gen, [4, 4, 4], 300, [1.0, 1.0, 1.0], device=DEVICE)
    _, nums, _, _, sp = batch
    randoms = draw_randoms(nums, 300, sp, torch.Generator(device=DEVICE).manual_seed(9), device=DEVICE)
    tri = rejection_sample(*batch, impl="triton", randoms=randoms)
    ref = rejection_sample_reference(*batch, randoms=randoms)
    assert torch.equal(tri.output_token_ids, ref.output_token_ids)


@needs_ready
def test_triton_residual_fallback():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    p = torch.softmax(logits, -1)
    q = p[:1] * (1 + 5e-4)  # p - q < 0 everywhere: the residual vanishes
    d = p[0].argmax().view(1)
    sp = SamplingParams.uniform(1, temperature=1.0, device=DEVICE)
    randoms = draw_randoms([1], 300, sp, torch.Generator(device=DEVICE).manual_seed(1), device=DEVICE)
    randoms.uniform.fill_(0.9999)
    for impl in ["torch", "triton"]:
        out = rejection_sample(d, [1], q, logits, sp, impl=impl, randoms=randoms)
        assert out.num_accepted.tolist() == [0]
        assert int(out.output_token_ids[0, 0]) == inverse_cdf_token(p[0], float(randoms.sample_uniform[0]))


@needs_ready
@pytest.mark.parametrize("vocab", [1, 97, 1024, 2500])
def test_triton_sample_rows_matches_torch(vocab):
    """The sampling kernel alone: recovered (draft probs / point mass), bonus, row selection, edge uniforms."""
    gen = torch.Generator().manual_seed(vocab)
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 3, -1)
    if vocab >= 3:
        p[1, ::3] = 0.0
        p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(6, vocab, generator=gen) * 3, -1)
    q[5] = p[3] * (1 + 5e-4)  # residual of row 3 against q[5] vanishes: falls back to p
    ids = torch.randint(0, vocab, (6,), generator=gen)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53, 2.0**-40, 0.25, 0.75, 0.9, 0.1, 0.3], dtype=torch.float64)
    sel = torch.tensor([0, 1, 2, 3, 1, 0, 2, 3, 3])
    pos = torch.tensor([0, 5, -1, 2, -1, 3, 4, 1, 5])
    args = [t.to(DEVICE) for t in (p, sel, q, pos, ids, u)]
    for with_q in (True, False):
        a = list(args)
        if not with_q:
            a[2] = None
        ref = torch_impl.sample_rows(*a)
        tri = triton_impl.sample_rows(*a)
        assert torch.equal(tri, ref), (with_q, tri.tolist(), ref.tolist())
        a[1] = None  # rows in order
        a[3], a[5] = a[3][:4], a[5][:4]
        assert torch.equal(triton_impl.sample_rows(*a), torch_impl.sample_rows(*a))


@needs_ready
def test_triton_sample_rows_all_zero_block():
    r = torch.zeros(2048)
    r[:1024] = 1e-17  # every weight of block 0 rounds to 0: its first largest entry (token 5)
    r[5] = 2e-17
    r[1024:] = 1.0 / 1024
    args = (r.unsqueeze(0).to(DEVICE), None, None, torch.tensor([-1], device=DEVICE),
            torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.float64, device=DEVICE))
    assert int(triton_impl.sample_rows(*args)) == int(torch_impl.sample_rows(*args)) == 5


@needs_ready
def test_triton_robust_inputs_match_torch():
    """Tiny temperatures (clamped to 1e-2), float64 logits (computed in float32) and inputs that require grad
    (detached) give the torch backend's tokens, greedy and sampled requests mixed."""
    gen = torch.Generator().manual_seed(11)
    nums = [3, 0, 2, 4, 1]
    ids, nums, q, target, _ = random_batch(gen, nums, 300, [0.01, 0.0, 1.0, 0.01, 0.0], device=DEVICE)
    with pytest.warns(UserWarning, match="temperature"):
        sp = SamplingParams(torch.tensor([1e-39, 0.0, 1.0, 1e-30, 0.0], device=DEVICE))
    target64 = target.double().requires_grad_()
    q_g = q.clone().requires_grad_()
    for dp in (q_g, None):
        randoms = draw_randoms(nums, 300, sp, torch.Generator(device=DEVICE).manual_seed(12), device=DEVICE)
        want = rejection_sample(ids, nums, dp, target64.detach().float(), sp, impl="torch", randoms=randoms)
        tri = rejection_sample(ids, nums, dp, target64, sp, impl="triton", randoms=randoms)
        assert torch.equal(tri.output_token_ids, want.output_token_ids), (tri.tolist(), want.tolist())

