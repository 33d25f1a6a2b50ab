"""Vectorised torch implementation of the rejection sampler (no Python loop over requests).

The ragged layout (request ``i`` owns draft positions ``draft_start[i] .. draft_start[i] + n_i - 1`` and
target rows ``row_start[i] .. row_start[i] + n_i``) is padded to ``[B, K]`` index tensors; accept tests
are one gather, the first rejection is found with a cumulative product, and exactly one row per
request (the first rejected position or the bonus position) is sampled with ``argmax(r / Exp(1))``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, _Layout
from .target_side import CHUNK_BYTES


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


def sample_final(
    layout: _Layout,
    out: Tensor,
    num_accepted: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    p_final: Tensor,
    inv_exponential: Tensor,
) -> None:
    """Write each request's recovered or bonus token at ``out[b, num_accepted[b]]``.

    Recovered: ``argmax(max(p - q, 0) * inv_exp)`` (point-mass q: ``p`` with the draft zeroed); bonus:
    ``argmax(p * inv_exp)``; if the residual vanished numerically, fall back to the bonus rule. On CPU
    the rows are processed in cache-sized chunks through one scratch buffer.
    """
    batch, vocab = p_final.shape
    is_bonus = num_accepted == layout.n
    total = layout.total_drafts
    rej = torch.where(is_bonus, 0, layout.draft_start + num_accepted).clamp_max(max(total - 1, 0))
    rej_draft = draft_token_ids[rej] if total else rej
    step = max(1, CHUNK_BYTES // (4 * vocab)) if p_final.device.type == "cpu" else batch
    scratch = torch.empty(min(step, batch), vocab, dtype=torch.float32, device=p_final.device)
    best = torch.empty(batch, dtype=torch.int64, device=p_final.device)
    for s in range(0, batch, step):
        sl = slice(s, s + step)
        p, inv_e = p_final[sl], inv_exponential[sl]
        score = scratch[: p.shape[0]]
        bonus = is_bonus[sl]
        if total and draft_probs is not None:
            torch.index_select(draft_probs, 0, rej[sl], out=score)
            score.index_fill_(0, bonus.nonzero().squeeze(1), 0.0)  # bonus rows: r = p - 0 = p
            torch.sub(p, score, out=score).clamp_min_(0.0).mul_(inv_e)
        else:
            torch.mul(p, inv_e, out=score)
            if total:  # point-mass q: the rejected draft gets r = 0
                nb = (~bonus).nonzero().squeeze(1)
                score[nb, rej_draft[sl][nb]] = 0.0
        b = score.argmax(dim=-1)
        need = (score.gather(1, b.unsqueeze(1)).squeeze(1) <= 0).nonzero().squeeze(1)
        if need.numel():
            b[need] = (p[need] * inv_e[need]).argmax(dim=-1)
        best[sl] = b
    out.scatter_(1, num_accepted.unsqueeze(1), best.unsqueeze(1))
