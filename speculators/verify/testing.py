"""Helpers for testing samplers statistically: chi-square / TV checks and random ragged verifier batches.

Used by tests/test_verify*.py; also usable by generation-loop tests that check losslessness end to end.
"""

from __future__ import annotations

import math

import torch

from .layout import sample_block
from .sampling import SamplingParams, apply_sampling

# One-sided tail probability of the chi-square / TV checks: a correct sampler fails with ~1e-6.
CHI2_Z = 4.753  # standard-normal quantile for 1 - 1e-6


def chi2_threshold(df: int, z: float = CHI2_Z) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_check(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, float, int]:
    """Pearson chi-square of ``samples`` (token ids) against ``probs`` [V].

    Cells with expected count < 5 are pooled; tokens with probability exactly 0 must never appear
    (returned as an infinite statistic). Returns (statistic, threshold, total-variation distance, n).
    """
    vocab = probs.numel()
    counts = torch.bincount(samples.long().flatten(), minlength=vocab).double()
    n = int(counts.sum())
    expected = probs.double().flatten() * n
    tv = 0.5 * float((counts / n - probs.double().flatten()).abs().sum())
    zero = expected == 0
    if counts[zero].sum() > 0:
        return float("inf"), 0.0, tv, n
    big = expected >= 5
    small = ~big & ~zero
    obs, exp = counts[big], expected[big]
    if small.any():
        obs = torch.cat([obs, counts[small].sum().view(1)])
        exp = torch.cat([exp, expected[small].sum().view(1)])
    df = obs.numel() - 1
    if df < 1:  # point mass: only the zero-probability check applies
        return 0.0, float("inf"), tv, n
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, chi2_threshold(df), tv, n


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    stat, thr, tv, n = chi2_check(samples, probs)
    assert stat <= thr, f"{label}: chi2={stat:.1f} > {thr:.1f} (p<1e-6), TV={tv:.4f}, n={n}"


def inverse_cdf_token(r: torch.Tensor, u: float, block: int | None = None) -> int:
    """The verifier's two-level inverse-CDF rule written out for one row ``r`` [V] (>= 0) and uniform ``u``.

    See :mod:`speculators.verify.rejection`: pairwise-tree float32 block sums, block weights
    ``floor(S_b * 2**52)``, then exact integer weights inside the chosen block.
    """
    r = r.float().flatten()
    vocab = r.numel()
    if block is None:
        block = sample_block(vocab)
    nb = -(-vocab // block)
    padded = torch.zeros(nb * block)
    padded[:vocab] = r
    sums = []
    for b in range(nb):
        level = padded[b * block : (b + 1) * block]
        while level.numel() > 1:
            half = level.numel() // 2
            level = level[:half] + level[half:]
        sums.append(math.floor(float(level) * 2.0**52))
    total = float(sum(sums))
    assert total > 0, "empty row"
    x = min(math.floor(u * total), total - 1.0)
    acc = 0.0
    for b, q_b in enumerate(sums):
        if acc + q_b > x:
            break
        acc += q_b
    weights = [math.floor(v * 2.0**52) for v in padded[b * block : (b + 1) * block].tolist()]
    big_w = float(sum(weights))
    if big_w == 0:
        return b * block + int(padded[b * block : (b + 1) * block].argmax())
    y = min(math.floor((x - acc) / q_b * big_w), big_w - 1.0)
    run = 0.0
    for t, w in enumerate(weights):
        run += w
        if run > y:
            return b * block + t
    raise AssertionError("unreachable")


def random_batch(
    gen: torch.Generator,
    nums: list[int],
    vocab: int,
    temperatures: list[float],
    *,
    with_q: bool = True,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    scale: float = 2.0,
    device: str = "cpu",
):
    """A ragged batch: target logits, drafts sampled from a nearby draft distribution q.

    Returns (draft_token_ids, nums, draft_probs or None, target_logits, SamplingParams).
    """
    batch, total = len(nums), sum(nums)
    target = torch.randn(total + batch, vocab, generator=gen) * scale
    n = torch.tensor(nums)
    req_of_pos = torch.repeat_interleave(torch.arange(batch), n)
    rows = torch.arange(total) + req_of_pos
    draft_logits = target[rows] + torch.randn(total, vocab, generator=gen) * (scale / 2)
    temp = torch.tensor(temperatures, dtype=torch.float32)
    tk = None if top_k is None else torch.tensor(top_k, dtype=torch.int64)
    tp = None if top_p is None else torch.tensor(top_p, dtype=torch.float32)
    q = apply_sampling(
        draft_logits,
        temp[req_of_pos],
        None if tk is None else tk[req_of_pos],
        None if tp is None else tp[req_of_pos],
    )
    ids = torch.multinomial(q, 1, generator=gen).squeeze(1) if total else torch.zeros(0, dtype=torch.int64)
    sp = SamplingParams(
        temperature=temp.to(device),
        top_k=None if tk is None else tk.to(device),
        top_p=None if tp is None else tp.to(device),
    )
    return ids.to(device), nums, (q.to(device) if with_q else None), target.to(device), sp
