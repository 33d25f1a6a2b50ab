"""Triton kernels for the rejection sampler (same contract and random numbers as ``torch_impl``).

Kernels (one program per request):

* ``_greedy_scan_kernel``: accept while ``d_i == argmax p_i``, then write the target argmax at the first
  mismatch or the bonus argmax (the whole greedy step in one kernel).
* ``_stochastic_scan_kernel``: accept ``d_i`` while ``u_i * q_i(d_i) < p_i(d_i)``; writes the accepted
  drafts and the number accepted.
* ``_recovered_bonus_kernel``: for the one row each request still needs (first rejected position or bonus
  position) computes ``argmax(r * inv_exp)`` with ``r = max(p - q, 0)`` (point-mass q: ``p`` with the
  draft removed; bonus: ``r = p``), looping over the vocabulary in ``BLOCK_SIZE`` blocks (masked tail, so
  any vocabulary size works), and places the token after the accepted drafts.

Compiled with ``triton.jit`` for CUDA tensors. With ``TRITON_INTERPRET=1`` set before triton is first
imported, the same kernels run in Triton's interpreter on CPU tensors (used by the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, _Layout

BLOCK_SIZE = 1024
_INTERPRET_BLOCK_SIZE = 256


@triton.jit
def _greedy_scan_kernel(
    out_ptr,  # [B, K + 1] int64, pre-filled with -1
    num_acc_ptr,  # [B] int64
    draft_ids_ptr,  # [T] int64
    target_argmax_ptr,  # [T + B] int64
    draft_start_ptr,  # [B] int64
    n_ptr,  # [B] int64
    out_stride,
):
    b = tl.program_id(0)
    start = tl.load(draft_start_ptr + b)
    n = tl.load(n_ptr + b)
    row0 = start + b
    out_row = out_ptr + b.to(tl.int64) * out_stride
    rejected = False
    num_acc = n * 0
    for j in range(n):
        if not rejected:
            d = tl.load(draft_ids_ptr + start + j)
            t = tl.load(target_argmax_ptr + row0 + j)
            # Writing the target argmax is right both when accepted (d == t) and at the first mismatch.
            tl.store(out_row + j, t)
            if d != t:
                rejected = True
            else:
                num_acc += 1
    if not rejected:
        tl.store(out_row + n, tl.load(target_argmax_ptr + row0 + n))
    tl.store(num_acc_ptr + b, num_acc)


@triton.jit
def _stochastic_scan_kernel(
    out_ptr,  # [B, K + 1] int64, pre-filled with -1
    num_acc_ptr,  # [B] int64
    draft_ids_ptr,  # [T] int64
    draft_probs_ptr,  # [T, V] float32 (unused when NO_DRAFT_PROBS)
    p_draft_ptr,  # [T] float32, p_i(d_i)
    uniform_ptr,  # [T] float32
    draft_start_ptr,  # [B] int64
    n_ptr,  # [B] int64
    out_stride,
    vocab_size,
    NO_DRAFT_PROBS: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(draft_start_ptr + b)
    n = tl.load(n_ptr + b)
    out_row = out_ptr + b.to(tl.int64) * out_stride
    rejected = False
    num_acc = n * 0
    for j in range(n):
        if not rejected:
            d = tl.load(draft_ids_ptr + start + j)
            p_d = tl.load(p_draft_ptr + start + j)
            u = tl.load(uniform_ptr + start + j)
            if NO_DRAFT_PROBS:
                lhs = u
            else:
                lhs = u * tl.load(draft_probs_ptr + (start + j) * vocab_size + d)
            if lhs < p_d:  # accept with probability min(1, p(d) / q(d))
                tl.store(out_row + j, d)
                num_acc += 1
            else:
                rejected = True
    tl.store(num_acc_ptr + b, num_acc)


@triton.jit
def _recovered_bonus_kernel(
    out_ptr,  # [B, K + 1] int64
    num_acc_ptr,  # [B] int64
    draft_ids_ptr,  # [T] int64
    draft_probs_ptr,  # [T, V] float32 (unused when NO_DRAFT_PROBS)
    p_final_ptr,  # [B, V] float32, target distribution at the first rejected / bonus position
    inv_exp_ptr,  # [B, V] float32, 1 / Exp(1)
    draft_start_ptr,  # [B] int64
    n_ptr,  # [B] int64
    out_stride,
    vocab_size,
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(draft_start_ptr + b)
    n = tl.load(n_ptr + b)
    acc = tl.load(num_acc_ptr + b)
    is_recovered = acc < n  # else: bonus position
    p_row = p_final_ptr + b.to(tl.int64) * vocab_size
    e_row = inv_exp_ptr + b.to(tl.int64) * vocab_size
    q_row = draft_probs_ptr + (start + acc) * vocab_size
    # Rejected draft (point-mass q) and the q row's length; both void at the bonus position.
    d = tl.where(is_recovered, tl.load(draft_ids_ptr + tl.where(is_recovered, start + acc, 0)), -1)
    q_len = tl.where(is_recovered, vocab_size, 0)
    best_val = tl.full((), -1.0, tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    fb_val = tl.full((), -1.0, tl.float32)
    fb_idx = tl.full((), 0, tl.int32)
    for off in range(0, vocab_size, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        p = tl.load(p_row + offs, mask=mask, other=0.0)
        ie = tl.load(e_row + offs, mask=mask, other=0.0)
        if NO_DRAFT_PROBS:
            r = tl.where(offs == d, 0.0, p)
        else:
            q = tl.load(q_row + offs, mask=offs < q_len, other=0.0)
            r = tl.maximum(p - q, 0.0)
        score = tl.where(mask, r * ie, -1.0)
        m, i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        upd = m > best_val
        best_idx = tl.where(upd, i + off, best_idx)
        best_val = tl.where(upd, m, best_val)
        fscore = tl.where(mask, p * ie, -1.0)
        fm, fi = tl.max(fscore, axis=0, return_indices=True, return_indices_tie_break_left=True)
        fupd = fm > fb_val
        fb_idx = tl.where(fupd, fi + off, fb_idx)
        fb_val = tl.where(fupd, fm, fb_val)
    tok = tl.where(best_val > 0.0, best_idx, fb_idx)
    tl.store(out_ptr + b.to(tl.int64) * out_stride + acc, tok.to(tl.int64))


def interpreter_active() -> bool:
    """True when triton was imported with ``TRITON_INTERPRET=1`` (kernels run on CPU tensors)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_greedy_scan_kernel, InterpretedFunction) and isinstance(tl.max, InterpretedFunction)


def _ids(draft_token_ids: Tensor, device: torch.device) -> Tensor:
    if draft_token_ids.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=device)  # never read; avoids an empty pointer
    return draft_token_ids.contiguous()


def _check_device(device: torch.device) -> None:
    if device.type != "cuda" and not interpreter_active():
        raise ValueError(
            f"impl='triton' on {device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (or use CUDA tensors, or impl='torch')"
        )


def greedy(layout: _Layout, draft_token_ids: Tensor, target_argmax: Tensor) -> RejectionOutput:
    """Triton twin of :func:`speculators.verify.torch_impl.greedy`."""
    device = target_argmax.device
    _check_device(device)
    out = torch.full((layout.batch, layout.max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_acc = torch.zeros(layout.batch, dtype=torch.int64, device=device)
    _greedy_scan_kernel[(layout.batch,)](
        out, num_acc, _ids(draft_token_ids, device), target_argmax.contiguous(), layout.draft_start, layout.n,
        out.stride(0),
    )
    return RejectionOutput(out, num_acc)


def scan(
    layout: _Layout, draft_token_ids: Tensor, draft_probs: Tensor | None, p_draft: Tensor, uniform: Tensor
) -> tuple[Tensor, Tensor]:
    """Triton twin of :func:`speculators.verify.torch_impl.scan`."""
    device = p_draft.device
    _check_device(device)
    out = torch.full((layout.batch, layout.max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_acc = torch.zeros(layout.batch, dtype=torch.int64, device=device)
    if layout.total_drafts == 0:
        return out, num_acc
    no_q = draft_probs is None
    _stochastic_scan_kernel[(layout.batch,)](
        out, num_acc, _ids(draft_token_ids, device), p_draft if no_q else draft_probs.contiguous(),
        p_draft.contiguous(), uniform.contiguous(), layout.draft_start, layout.n, out.stride(0), layout.vocab,
        NO_DRAFT_PROBS=no_q,
    )
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
    """Triton twin of :func:`speculators.verify.torch_impl.sample_final` (writes into ``out``)."""
    device = p_final.device
    _check_device(device)
    no_q = draft_probs is None or layout.total_drafts == 0
    block = _INTERPRET_BLOCK_SIZE if interpreter_active() else BLOCK_SIZE
    block = min(block, triton.next_power_of_2(layout.vocab))
    p_final = p_final.contiguous()
    _recovered_bonus_kernel[(layout.batch,)](
        out, num_accepted, _ids(draft_token_ids, device), p_final if no_q else draft_probs.contiguous(), p_final,
        inv_exponential.contiguous(), layout.draft_start, layout.n, out.stride(0), layout.vocab,
        NO_DRAFT_PROBS=no_q, BLOCK=block,
    )
