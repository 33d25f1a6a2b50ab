"""Vectorised torch implementation of the rejection sampler (no Python loop over requests).

The ragged layout (request ``i`` owns draft positions ``draft_start[i] .. draft_start[i] + n_i - 1`` and
target rows ``row_start[i] .. row_start[i] + n_i``) is padded to ``[B, K]`` index tensors; accept tests
are one gather, the first rejection is found with a cumulative product, and exactly one row per
request (the first rejected position or the bonus position) is sampled with the request's float64
uniform by the two-level inverse CDF of :mod:`speculators.verify.rejection` (:func:`sample_rows`).
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import Tensor

from . import layout as _layout_mod
from .layout import (
    PLACEHOLDER_TOKEN_ID,
    SAMPLE_SCALE,
    RejectionOutput,
    _Layout,
    sample_block,
)
from .target_side import cpu_buffer


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


def _tree_block_sums(w: Tensor, block: int) -> Tensor:
    """``[S, nb]`` float32 block sums of ``w`` ``[S, nb * block]`` by the fixed pairwise tree.

    Level by level, element ``i`` of the first half plus element ``i`` of the second half (the Triton
    kernel and the reference add the same pairs, so the float32 sums are identical).
    """
    rows = w.shape[0]
    v = w.view(rows, -1, block)
    h = block // 2
    if h == 0:
        return v[..., 0]
    buf = _buffer("sample.tree", rows, v.shape[1] * h, w).view(rows, -1, h)
    torch.add(v[..., :h], v[..., h:], out=buf)
    while h > 1:
        h //= 2
        buf[..., :h].add_(buf[..., h : 2 * h])
    return buf[..., 0]


def _search(w: Tensor, scale: float, u: list[float], block: int) -> list[int | None]:
    """Two-level inverse CDF (module docstring of :mod:`speculators.verify.rejection`) on ``r = w * scale / 2**52``.

    ``w`` ``[S, nb * block]`` float32 holds ``r`` (``scale = 2**52``) or ``-r`` (``scale = -2**52``; the
    tree sums of ``-r`` are exactly the negated sums of ``r``). The block choice runs on the host
    (``S * nb`` numbers); only the chosen blocks are quantised to float64. ``None`` where ``T == 0``.
    """
    rows = w.shape[0]
    q_cum = _tree_block_sums(w, block).double().mul_(scale).floor_().cumsum_(dim=-1).tolist()
    blk, ks, qbs = [], [], []
    for cum, ui in zip(q_cum, u):
        total = cum[-1]
        if total <= 0:
            blk.append(0), ks.append(0.0), qbs.append(1.0)
            continue
        x = min(math.floor(ui * total), total - 1.0)  # IEEE float64, as in every implementation
        b = bisect.bisect_right(cum, x)  # first block whose cumulative weight exceeds x
        before = cum[b - 1] if b else 0.0
        blk.append(b), ks.append(x - before), qbs.append(cum[b] - before)
    idx = torch.tensor(blk, dtype=torch.int64, device=w.device)
    nb = w.shape[1] // block
    flat = torch.arange(rows, device=w.device).mul_(nb).add_(idx)
    chosen = torch.index_select(w.view(rows * nb, block), 0, flat,
                                out=_buffer("sample.chosen", rows, block, w))  # [S, block] float32
    cum_in = _buffer("sample.cum", rows, block, w, torch.float64)
    cum_in.copy_(chosen)
    cum_in.mul_(scale).floor_().cumsum_(dim=-1)  # exact integers
    big_w = cum_in[:, -1].tolist()
    ys = [min(math.floor(k / qb * wb), wb - 1.0) if wb > 0 else -1.0 for k, qb, wb in zip(ks, qbs, big_w)]
    t_in = torch.searchsorted(cum_in, torch.tensor(ys, dtype=torch.float64, device=w.device).unsqueeze(1), right=True)
    t_in = t_in.view(rows).tolist()
    tokens: list[int | None] = []
    for i, (cum, b, wb) in enumerate(zip(q_cum, blk, big_w)):
        if cum[-1] <= 0:
            tokens.append(None)
        elif wb > 0:
            tokens.append(b * block + t_in[i])
        else:  # every weight of the chosen block rounded to 0: its first largest entry
            r = chosen[i] if scale > 0 else -chosen[i]
            tokens.append(b * block + int(r.argmax()))
    return tokens


def sample_rows(
    p: Tensor,
    sel: Tensor | None,
    draft_probs: Tensor | None,
    pos: Tensor,
    draft_token_ids: Tensor,
    u: Tensor,
) -> Tensor:
    """Sample one token for each row ``p[sel[i]]`` (``sel=None``: ``p[i]``) with the float64 uniform ``u[i]``.

    Row ``i`` samples ``r = max(p - draft_probs[pos_i], 0)`` when ``pos_i >= 0`` (recovered token;
    point-mass q, ``draft_probs is None``: ``p`` with ``draft_token_ids[pos_i]`` zeroed), else ``r = p``
    (bonus token); a residual that vanished numerically falls back to ``p``. The two-level inverse CDF
    of :mod:`speculators.verify.rejection` (pairwise-tree float32 block sums, exact integer weights in the
    chosen block) gives the reference's token. Passes over the rows: the residual (gather q, subtract,
    clamp) and the tree; on CPU a cache-sized chunk of rows at a time through reused buffers. With
    ``sel=None`` and no draft probs, ``p``'s draft entries are zeroed in place (and restored).
    """
    count, vocab = pos.numel(), p.shape[1]
    step = max(1, _layout_mod.CHUNK_BYTES // (4 * vocab)) if p.device.type == "cpu" else max(count, 1)
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
    if sel is None:
        p = p[:rows]
    block = sample_block(vocab)
    width = -(-vocab // block) * block
    pos_l = pos.tolist()
    lo, hi = min(pos_l), max(pos_l)
    restore = None
    if draft_probs is not None and hi >= 0:
        # w = q - p = -(p - q) exactly; clamped at 0 it is -r.
        w_full = _buffer("sample.w", rows, width, p)
        if width > vocab:
            w_full[:, vocab:] = 0.0
        w = w_full[:, :vocab]
        torch.index_select(draft_probs, 0, pos.clamp_min(0) if lo < 0 else pos, out=w)
        if lo < 0:
            w.index_fill_(0, (pos < 0).nonzero().squeeze(1), 0.0)  # bonus rows: r = p - 0
        p_rows = p if sel is None else torch.index_select(p, 0, sel, out=_buffer("sample.p", rows, vocab, p))
        w.sub_(p_rows).clamp_max_(0.0)
        scale = -SAMPLE_SCALE
    else:
        scale = SAMPLE_SCALE
        if sel is None and width == vocab and p.is_contiguous():
            w_full = w = p  # zero the drafts in place below, restored afterwards
        else:
            w_full = _buffer("sample.w", rows, width, p)
            if width > vocab:
                w_full[:, vocab:] = 0.0
            w = w_full[:, :vocab]
            torch.index_select(p, 0, sel, out=w) if sel is not None else w.copy_(p)
        if hi >= 0:  # point-mass q: the rejected draft gets r = 0
            idx = (pos >= 0).nonzero().squeeze(1) if lo < 0 else torch.arange(rows, device=p.device)
            d = draft_token_ids[pos[idx]]
            if w is p:
                restore = (idx, d, p[idx, d].clone())
            w[idx, d] = 0.0
    u_l = u.tolist()
    tokens = _search(w_full, scale, u_l, block)
    if restore is not None:
        p[restore[0], restore[1]] = restore[2]
    empty = [i for i, t in enumerate(tokens) if t is None]
    if empty:  # the residual vanished numerically: sample p instead
        e_idx = torch.tensor(empty, dtype=torch.int64, device=p.device)
        wp = torch.zeros(len(empty), width, dtype=torch.float32, device=p.device)
        wp[:, :vocab] = p.index_select(0, e_idx if sel is None else sel[e_idx])
        for i, t in zip(empty, _search(wp, SAMPLE_SCALE, [u_l[i] for i in empty], block)):
            tokens[i] = t
    return torch.tensor(tokens, dtype=torch.int64, device=p.device)
