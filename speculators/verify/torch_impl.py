"""Vectorised torch implementation of the rejection sampler (no Python loop over requests).

The ragged layout (request ``i`` owns draft positions ``draft_start[i] .. draft_start[i] + n_i - 1`` and
target rows ``row_start[i] .. row_start[i] + n_i``) is padded to ``[B, K]`` index tensors; accept tests
are one gather, the first rejection is found with a cumulative product, and exactly one row per
request (the first rejected position or the bonus position) is sampled by inverse CDF with the
request's float64 uniform (:func:`sample_rows`; the exact integer-weight scheme is described in
:mod:`speculators.verify.rejection`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rejection import PLACEHOLDER_TOKEN_ID, SAMPLE_SCALE, RejectionOutput, _Layout
from .target_side import CHUNK_BYTES, cpu_buffer

SAMPLE_BLOCK = 1024  # block width of the two-level search (any width gives the same token)


def _padded_indices(layout: _Layout) -> tuple[Tensor, Tensor, Tensor]:
    """(valid [B, K] bool, draft index [B, K], target row [B, K]); invalid slots point at index 0 / row_start."""
    device = layout.n.device
    pos = torch.arange(layout.max_drafts, device=device)
    valid = pos.unsqueeze(0) < layout.n.unsqueeze(1)
    didx = torch.where(valid, layout.draft_start.unsqueeze(1) + pos, 0)
    trow = torch.where(valid, layout.row_start.unsqueeze(1) + pos, layout.row_start.unsqueeze(1))
    return valid, didx, trow


def _new_output(layout: _Layout, device: torch.device) -> Tensor:
    return torch.full((layout.batch, layout.max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)


def greedy(layout: _Layout, draft_token_ids: Tensor, target_argmax: Tensor) -> RejectionOutput:
    """All-greedy batch: accept while ``d_i == argmax p_i``; emit the argmax at the first mismatch or the bonus.

    ``target_argmax``: ``[T + B]`` int64 (rows the scan never reads may hold -1).
    """
    valid, didx, trow = _padded_indices(layout)
    drafts = draft_token_ids[didx] if layout.total_drafts else didx
    accept = (drafts == target_argmax[trow]) & valid
    num_acc = accept.long().cumprod(dim=1).sum(dim=1)
    out = _new_output(layout, drafts.device)
    pos = torch.arange(layout.max_drafts, device=drafts.device)
    out[:, : layout.max_drafts] = torch.where(pos < num_acc.unsqueeze(1), drafts, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_acc.unsqueeze(1), target_argmax[layout.row_start + num_acc].unsqueeze(1))
    return RejectionOutput(out, num_acc)


def scan(
    layout: _Layout, draft_token_ids: Tensor, draft_probs: Tensor | None, p_draft: Tensor, uniform: Tensor
) -> tuple[Tensor, Tensor]:
    """Accept ``d_i`` while ``u_i * q_i(d_i) < p_i(d_i)`` (probability ``min(1, p/q)``; point-mass q: ``u_i < p_i(d_i)``).

    Returns ``(output_token_ids [B, K + 1]`` with the accepted drafts written, ``num_accepted [B])``.
    """
    valid, didx, _ = _padded_indices(layout)
    out = _new_output(layout, p_draft.device)
    if layout.total_drafts == 0:
        return out, torch.zeros(layout.batch, dtype=torch.int64, device=p_draft.device)
    drafts = draft_token_ids[didx]
    lhs = uniform[didx]
    if draft_probs is not None:
        lhs = lhs * draft_probs[didx, drafts]
    accept = (lhs < p_draft[didx]) & valid
    num_acc = accept.long().cumprod(dim=1).sum(dim=1)
    pos = torch.arange(layout.max_drafts, device=drafts.device)
    out[:, : layout.max_drafts] = torch.where(pos < num_acc.unsqueeze(1), drafts, PLACEHOLDER_TOKEN_ID)
    return out, num_acc


def _buffer(name: str, rows: int, cols: int, like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A ``[rows, cols]`` scratch buffer: reused between calls on CPU, fresh on other devices."""
    if like.device.type == "cpu":
        return cpu_buffer(name, rows, cols, dtype)
    return torch.empty(rows, cols, dtype=dtype, device=like.device)


def _search(w: Tensor, u: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Inverse-CDF search on non-negative float32 rows ``w`` ``[R, nb * block]`` (modified in place).

    ``w <- floor(w)`` (``w`` holds ``r * 2**52``: integers after the floor), then the token is the first ``t`` whose prefix sum exceeds
    ``x = min(floor(u * total), total - 1)``: exact float64 block sums pick the block, one block's
    cumsum the token. Returns ``(token [R] int64, total [R] float64)``.
    """
    rows, width = w.shape
    nb = width // block
    w.floor_()
    w64 = _buffer("sample.w64", rows, width, w, torch.float64).view(rows, nb, block)
    w64.view(rows, width).copy_(w)  # exact: integers below 2**53
    cum_blocks = w64.sum(dim=-1).cumsum_(dim=-1)
    total = cum_blocks[:, -1]
    x = torch.minimum((u * total).floor_(), total - 1).unsqueeze(1)
    blk = (cum_blocks <= x).sum(dim=-1)
    before = torch.where(blk > 0, cum_blocks.gather(1, (blk - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    inner = w64[torch.arange(rows, device=w.device), blk].cumsum_(dim=-1).add_(before.unsqueeze(1))
    return blk * block + (inner <= x).sum(dim=-1), total


def sample_rows(
    p: Tensor,
    sel: Tensor | None,
    draft_probs: Tensor | None,
    pos: Tensor,
    draft_token_ids: Tensor,
    u: Tensor,
) -> Tensor:
    """Sample one token for each row ``p[sel[i]]`` (``sel=None``: ``p[i]``) by inverse CDF with ``u[i]`` (float64).

    Row ``i`` samples ``r = max(p - draft_probs[pos_i], 0)`` when ``pos_i >= 0`` (recovered token;
    point-mass q, ``draft_probs is None``: ``p`` with ``draft_token_ids[pos_i]`` zeroed), else ``r = p``
    (bonus token); a residual that vanished numerically falls back to ``p``. Weights are
    ``floor(r * 2**52)`` and the search is exact (float64 block sums, then one block's cumsum), so the
    token equals the reference's ``searchsorted(cumsum(w), x)`` (see :mod:`speculators.verify.rejection`).
    On CPU the rows go through reused cache-sized buffers, a chunk at a time.
    """
    count, vocab = (p.shape[0] if sel is None else sel.numel()), p.shape[1]
    step = max(1, CHUNK_BYTES // (4 * vocab)) if p.device.type == "cpu" else max(count, 1)
    if count <= step:
        return _sample_chunk(p, sel, draft_probs, pos, draft_token_ids, u)
    if sel is None:
        sel = torch.arange(count, device=p.device)
    tokens = torch.empty(count, dtype=torch.int64, device=p.device)
    for s in range(0, count, step):
        sl = slice(s, s + step)
        tokens[sl] = _sample_chunk(p, sel[sl], draft_probs, pos[sl], draft_token_ids, u[sl])
    return tokens


def _sample_chunk(
    p: Tensor, sel: Tensor | None, draft_probs: Tensor | None, pos: Tensor, draft_token_ids: Tensor, u: Tensor
) -> Tensor:
    rows, vocab = pos.numel(), p.shape[1]
    block = min(SAMPLE_BLOCK, vocab)
    width = -(-vocab // block) * block
    w_full = _buffer("sample.w", rows, width, p)
    if width > vocab:
        w_full[:, vocab:] = 0.0
    w = w_full[:, :vocab]
    lo, hi = pos.aminmax() if rows else (pos.new_zeros(()), pos.new_zeros(()))
    lo, hi = int(lo), int(hi)
    p_rows = p if sel is None else None
    if draft_probs is not None and hi >= 0:
        # w = q - p = -(p - q) exactly; max(p - q, 0) * 2**52 = min(q - p, 0) * -2**52 (exact scaling).
        torch.index_select(draft_probs, 0, pos.clamp_min(0), out=w)
        if lo < 0:
            w.index_fill_(0, (pos < 0).nonzero().squeeze(1), 0.0)  # bonus rows: r = p - 0
        if p_rows is None:
            p_rows = torch.index_select(p, 0, sel, out=_buffer("sample.p", rows, vocab, p))
        w.sub_(p_rows).clamp_max_(0.0).mul_(-SAMPLE_SCALE)
    else:
        if p_rows is None:
            torch.index_select(p, 0, sel, out=w)
        else:
            w.copy_(p_rows)
        w.mul_(SAMPLE_SCALE)
        if hi >= 0:  # point-mass q: the rejected draft gets r = 0
            idx = (pos >= 0).nonzero().squeeze(1) if lo < 0 else torch.arange(rows, device=p.device)
            w[idx, draft_token_ids[pos[idx]]] = 0.0
    tokens, total = _search(w_full, u, block)
    empty = (total <= 0).nonzero().squeeze(1)
    if empty.numel():  # the residual vanished numerically: sample p instead
        src = p.index_select(0, empty if sel is None else sel[empty])
        wp = torch.zeros(empty.numel(), width, dtype=torch.float32, device=p.device)
        wp[:, :vocab] = src * SAMPLE_SCALE
        tokens[empty] = _search(wp, u.index_select(0, empty), block)[0]
    return tokens
