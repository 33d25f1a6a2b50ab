"""Target side of verification: raw target logits -> what the accept/reject scan and the sampler read.

Shared torch code used in front of every backend (torch and Triton), so both see bit-identical
probabilities and return identical tokens.

* ``probs_at_drafts`` -> ``[T]`` ``p_i(d_i)`` at every draft position the scan will read.
* ``final_probs`` -> ``[B, V]`` the full target distribution of the one row each request still samples
  (first rejected position, or the bonus position).
* ``target_argmax`` -> ``[T + B]`` argmax rows for all-greedy batches.

Two evaluation orders (same values up to floating-point rounding; within one call every backend sees
the same tensors):

* eager (CUDA, and small CPU inputs): one :func:`apply_sampling` over all ``T + B`` rows (vLLM's order).
* lazy (CPU inputs above ``2 * CHUNK_BYTES``): position by position, only for requests whose earlier
  drafts were all accepted (a position after a rejection is never read by any scan), in row chunks of
  about ``CHUNK_BYTES`` so intermediates stay in cache. Positions never evaluated hold 0 (``-1`` for
  argmax) and are not read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .sampling import SamplingParams, _sampling_probs

if TYPE_CHECKING:
    from .rejection import _Layout

CHUNK_BYTES = 4 << 20
LAZY_ON_CPU: bool | str = True  # False: always eager; "always": lazy even for small inputs (tests)


def use_lazy(target_logits: Tensor) -> bool:
    """Lazy order on CPU when the logits exceed a few chunks (small inputs: eager has less overhead)."""
    if target_logits.device.type != "cpu" or not LAZY_ON_CPU:
        return False
    return target_logits.numel() * 4 > 2 * CHUNK_BYTES or LAZY_ON_CPU == "always"


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _Scratch:
    """Two ``[chunk, V]`` float32 buffers reused by every chunk of one call (no allocator churn on CPU)."""

    def __init__(self, target_logits: Tensor):
        self.rows = _chunk_rows(target_logits.shape[1])
        shape = (self.rows, target_logits.shape[1])
        self.direct = target_logits.dtype == torch.float32
        self.logits = torch.empty(shape, dtype=torch.float32, device=target_logits.device)
        self.probs = torch.empty(shape, dtype=torch.float32, device=target_logits.device)

    def gather_rows(self, target_logits: Tensor, rows: Tensor) -> Tensor:
        if not self.direct:
            return target_logits.index_select(0, rows).float()
        return torch.index_select(target_logits, 0, rows, out=self.logits[: rows.numel()])


def _row_probs(
    target_logits: Tensor,
    rows: Tensor,
    reqs: Tensor,
    sampling: SamplingParams,
    tokens: Tensor | None,
    scratch: _Scratch,
) -> Tensor:
    """``apply_sampling(target_logits[rows])`` with request ``reqs[i]``'s parameters for row ``i``.

    Returns ``[R]`` probabilities at ``tokens`` when given, else the ``[R, V]`` distributions; rows are
    processed in cache-sized chunks through ``scratch``.
    """
    temp = sampling.temperature.index_select(0, reqs).float()
    top_k = None if sampling.top_k is None else sampling.top_k.index_select(0, reqs)
    top_p = None if sampling.top_p is None else sampling.top_p.index_select(0, reqs)
    n_rows, vocab = rows.numel(), target_logits.shape[1]
    if tokens is None:
        res = torch.empty(n_rows, vocab, dtype=torch.float32, device=target_logits.device)
    else:
        res = torch.empty(n_rows, dtype=torch.float32, device=target_logits.device)
    step = scratch.rows
    for s in range(0, n_rows, step):
        sl = slice(s, s + step)
        x = scratch.gather_rows(target_logits, rows[sl])
        out = res[sl] if tokens is None else scratch.probs[: x.shape[0]]
        p = _sampling_probs(
            x,
            temp[sl],
            None if top_k is None else top_k[sl],
            None if top_p is None else top_p[sl],
            owned=True,
            out=out,
        )
        if tokens is not None:
            res[sl] = p.gather(1, tokens[sl].unsqueeze(1)).squeeze(1)
    return res


def probs_at_drafts(
    layout: _Layout,
    target_logits: Tensor,
    sampling: SamplingParams,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    uniform: Tensor,
    *,
    lazy: bool,
    cache: dict | None = None,
) -> Tensor:
    """``[T]`` float32 ``p_i(d_i)`` (processed target probability of each draft token).

    With ``lazy=True`` the accept test ``u * q(d) < p(d)`` (the scan's exact rule) decides which
    requests need their next position; positions after a rejection are left at 0. With
    ``lazy=False`` all ``T + B`` rows go through one :func:`apply_sampling`, kept in ``cache`` for
    :func:`final_probs`.
    """
    total, batch = layout.total_drafts, layout.batch
    device = target_logits.device
    if not lazy:
        probs = _all_probs(layout, target_logits, sampling, cache)
        if total == 0:
            return torch.zeros(0, dtype=torch.float32, device=device)
        req_of_pos = torch.repeat_interleave(torch.arange(batch, device=device), layout.n, output_size=total)
        return probs[torch.arange(total, device=device) + req_of_pos, draft_token_ids]
    if total == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    scratch = _Scratch(target_logits)
    p_draft = torch.zeros(total, dtype=torch.float32, device=device)
    alive = layout.n > 0
    for j in range(layout.max_drafts):
        req = alive.nonzero().squeeze(1)
        if req.numel() == 0:
            break
        pos = layout.draft_start.index_select(0, req) + j
        d = draft_token_ids.index_select(0, pos)
        p_d = _row_probs(target_logits, pos + req, req, sampling, d, scratch)
        p_draft[pos] = p_d
        lhs = uniform.index_select(0, pos)
        if draft_probs is not None:
            lhs = lhs * draft_probs[pos, d]
        alive[req] = (lhs < p_d) & (layout.n.index_select(0, req) > j + 1)
    return p_draft


def _all_probs(layout: _Layout, target_logits: Tensor, sampling: SamplingParams, cache: dict | None) -> Tensor:
    if cache is not None and "probs" in cache:
        return cache["probs"]
    rows = layout.total_drafts + layout.batch
    req_of_row = torch.repeat_interleave(
        torch.arange(layout.batch, device=target_logits.device), layout.n + 1, output_size=rows
    )
    temp = sampling.temperature.float().index_select(0, req_of_row)
    top_k = None if sampling.top_k is None else sampling.top_k.index_select(0, req_of_row)
    top_p = None if sampling.top_p is None else sampling.top_p.index_select(0, req_of_row)
    probs = _sampling_probs(target_logits.float(), temp, top_k, top_p, owned=False)
    if cache is not None:
        cache["probs"] = probs
    return probs


def final_probs(
    layout: _Layout,
    target_logits: Tensor,
    sampling: SamplingParams,
    num_accepted: Tensor,
    *,
    lazy: bool,
    cache: dict | None = None,
) -> Tensor:
    """``[B, V]`` float32 target distribution at each request's first rejected (or bonus) position."""
    rows = layout.row_start + num_accepted
    if not lazy:
        return _all_probs(layout, target_logits, sampling, cache).index_select(0, rows)
    reqs = torch.arange(layout.batch, device=target_logits.device)
    return _row_probs(target_logits, rows, reqs, sampling, None, _Scratch(target_logits))


def _argmax_rows(target_logits: Tensor, rows: Tensor, scratch: _Scratch) -> Tensor:
    step = scratch.rows
    return torch.cat(
        [scratch.gather_rows(target_logits, rows[s : s + step]).argmax(dim=-1) for s in range(0, rows.numel(), step)]
    )


def target_argmax(layout: _Layout, target_logits: Tensor, draft_token_ids: Tensor, *, lazy: bool) -> Tensor:
    """``[T + B]`` int64 argmax of the raw target logits (greedy); lazily only rows the scan reads."""
    if not lazy:
        return target_logits.argmax(dim=-1)
    device = target_logits.device
    am = torch.full((target_logits.shape[0],), -1, dtype=torch.int64, device=device)
    scratch = _Scratch(target_logits)
    alive = torch.ones(layout.batch, dtype=torch.bool, device=device)
    for j in range(layout.max_drafts + 1):
        req = alive.nonzero().squeeze(1)
        if req.numel() == 0:
            break
        rows = layout.row_start.index_select(0, req) + j  # draft position j, or the bonus row when j == n
        a = _argmax_rows(target_logits, rows, scratch)
        am[rows] = a
        is_draft = layout.n.index_select(0, req) > j
        if layout.total_drafts:
            pos = (layout.draft_start.index_select(0, req) + j).clamp_max(layout.total_drafts - 1)
            alive[req] = is_draft & (draft_token_ids.index_select(0, pos) == a)
        else:
            alive[req] = False
    return am
