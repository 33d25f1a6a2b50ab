"""Triton kernels for the rejection sampler (same contract and random numbers as ``torch_impl``).

Kernels (one program per request):

* ``_greedy_scan_kernel``: accept while ``d_i == argmax p_i``, then write the target argmax at the first
  mismatch or the bonus argmax (the whole greedy step in one kernel).
* ``_stochastic_scan_kernel``: accept ``d_i`` while ``u_i * q_i(d_i) < p_i(d_i)``; writes the accepted
  drafts and the number accepted.
* ``_sample_rows_kernel`` (one program per row to sample): the recovered / bonus token by the two-level
  inverse CDF of :mod:`speculators.verify.rejection` with the request's float64 uniform. The row
  ``r = max(p - q, 0)`` (point-mass q: ``p`` with the draft removed; bonus: ``r = p``) is walked in blocks
  of ``B = sample_block(V)`` tokens (masked tail, so any vocabulary size works): pass 1 sums the block
  weights ``floor(S_b * 2**52)`` (``S_b``: float32 pairwise-tree block sum, the same pairs as torch) into
  ``T`` (and the fallback total of ``p``, used when the residual vanished), pass 2 finds the block where
  the running weight passes ``x = min(floor(u * T), T - 1)``, pass 3 quantises that block to exact
  integer weights and counts the in-block prefix sums ``<= y``. Every float64 quantity is an integer
  below ``2**53`` or one IEEE operation on identical inputs, so the token equals torch's.

Compiled with ``triton.jit`` for CUDA tensors. With ``TRITON_INTERPRET=1`` set before triton is first
imported, the same kernels run in Triton's interpreter on CPU tensors (used by the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .layout import (
    PLACEHOLDER_TOKEN_ID,
    SAMPLE_SCALE,
    RejectionOutput,
    VerifyInputError,
    _Layout,
    sample_block,
)

# No a*b+c contraction into FMAs: every float operation stays the single IEEE operation torch performs,
# which the bit-identical tokens rely on (the kernels have no such pattern today; this keeps it so).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


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
def _tree_sum(x, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """float32 sum of ``x`` [BLOCK] by the fixed pairwise tree: first half + second half, repeatedly."""
    for i in tl.static_range(LOG2_BLOCK):
        x = tl.sum(tl.reshape(x, (2, BLOCK >> (i + 1))), axis=0)  # a size-2 reduction is one exact add
    return tl.sum(x, axis=0)


@triton.jit
def _load_block(p_row, q_row, offs, vocab_size, q_len, d, NO_DRAFT_PROBS: tl.constexpr):
    """``(p, r)`` on block ``offs``: target probs and residual ``max(p - q, 0)`` (point-mass q: ``p`` without ``d``)."""
    p = tl.load(p_row + offs, mask=offs < vocab_size, other=0.0)
    if NO_DRAFT_PROBS:
        res = tl.where(offs == d, 0.0, p)
    else:
        q = tl.load(q_row + offs, mask=offs < q_len, other=0.0)
        res = tl.maximum(p - q, 0.0)
    return p, res


@triton.jit
def _sample_rows_kernel(
    tok_ptr,  # [S] int64 out
    p_ptr,  # [R, V] float32 target distributions
    sel_ptr,  # [S] int64 row of p to sample (unused when not HAS_SEL: row = program id)
    draft_probs_ptr,  # [T, V] float32 (unused when NO_DRAFT_PROBS)
    pos_ptr,  # [S] int64, draft position of the rejected draft, -1 = bonus row
    draft_ids_ptr,  # [T] int64
    u_ptr,  # [S] float64 uniforms
    vocab_size,
    SCALE: tl.constexpr,
    HAS_SEL: tl.constexpr,
    NO_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if HAS_SEL:
        row = tl.load(sel_ptr + r)
    else:
        row = r.to(tl.int64)
    pos = tl.load(pos_ptr + r)
    is_recovered = pos >= 0
    safe_pos = tl.where(is_recovered, pos, 0)
    # Rejected draft (point-mass q) and the q row's length; both void at the bonus position.
    d = tl.where(is_recovered, tl.load(draft_ids_ptr + safe_pos), -1)
    q_len = tl.where(is_recovered, vocab_size, 0)
    p_row = p_ptr + row * vocab_size
    q_row = draft_probs_ptr + safe_pos.to(tl.int64) * vocab_size
    # Pass 1: total block weight of r (and of p, the fallback).
    total = tl.full((), 0.0, tl.float64)
    total_p = tl.full((), 0.0, tl.float64)
    for off in range(0, vocab_size, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        p, res = _load_block(p_row, q_row, offs, vocab_size, q_len, d, NO_DRAFT_PROBS)
        total += tl.floor(_tree_sum(res, BLOCK, LOG2_BLOCK).to(tl.float64) * SCALE)
        total_p += tl.floor(_tree_sum(p, BLOCK, LOG2_BLOCK).to(tl.float64) * SCALE)
    use_p = total <= 0.0  # the residual vanished numerically: sample p instead
    tot = tl.where(use_p, total_p, total)
    x = tl.minimum(tl.floor(tl.load(u_ptr + r) * tot), tot - 1.0)
    # Pass 2: the block where the running block weight passes x.
    run = tl.full((), 0.0, tl.float64)
    blk_off = tl.full((), 0, tl.int32)
    k = tl.full((), 0.0, tl.float64)
    q_b = tl.full((), 1.0, tl.float64)
    for off in range(0, vocab_size, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        p, res = _load_block(p_row, q_row, offs, vocab_size, q_len, d, NO_DRAFT_PROBS)
        weight = tl.floor(_tree_sum(tl.where(use_p, p, res), BLOCK, LOG2_BLOCK).to(tl.float64) * SCALE)
        hit = (run <= x) & (x < run + weight)
        blk_off = tl.where(hit, off, blk_off)
        k = tl.where(hit, x - run, k)
        q_b = tl.where(hit, weight, q_b)
        run += weight
    # Pass 3: exact integer weights inside the chosen block.
    offs = blk_off + tl.arange(0, BLOCK)
    p, res = _load_block(p_row, q_row, offs, vocab_size, q_len, d, NO_DRAFT_PROBS)
    res = tl.where(use_p, p, res)
    w = tl.floor(res.to(tl.float64) * SCALE)
    cum = tl.cumsum(w, axis=0)  # exact: integers below 2**53
    big_w = tl.sum(w, axis=0)
    y = tl.minimum(tl.floor(k / q_b * big_w), big_w - 1.0)
    count = tl.sum((cum <= y).to(tl.int32), axis=0)  # masked tail: w = 0, cum = big_w > y
    first_max = tl.argmax(res, axis=0, tie_break_left=True)  # every weight rounded to 0 (W == 0)
    tok = blk_off + tl.where(big_w > 0.0, count, first_max)
    tl.store(tok_ptr + r, tok.to(tl.int64))


def _variants(vocab: int) -> list[tuple[str, object, dict, dict]]:
    """``(name, kernel, signature, constexprs)`` of every constexpr specialisation the launchers request.

    Real launches also specialise on argument values (divisibility by 16, ==1); those variants are not built.
    """
    block = sample_block(vocab)
    scan_sig = {
        "out_ptr": "*i64", "num_acc_ptr": "*i64", "draft_ids_ptr": "*i64", "draft_probs_ptr": "*fp32",
        "p_draft_ptr": "*fp32", "uniform_ptr": "*fp32", "draft_start_ptr": "*i64", "n_ptr": "*i64",
        "out_stride": "i32", "vocab_size": "i32", "NO_DRAFT_PROBS": "constexpr",
    }
    sample_sig = {
        "tok_ptr": "*i64", "p_ptr": "*fp32", "sel_ptr": "*i64", "draft_probs_ptr": "*fp32", "pos_ptr": "*i64",
        "draft_ids_ptr": "*i64", "u_ptr": "*fp64", "vocab_size": "i32", "SCALE": "constexpr",
        "HAS_SEL": "constexpr", "NO_DRAFT_PROBS": "constexpr", "BLOCK": "constexpr", "LOG2_BLOCK": "constexpr",
    }
    greedy_sig = {
        "out_ptr": "*i64", "num_acc_ptr": "*i64", "draft_ids_ptr": "*i64", "target_argmax_ptr": "*i64",
        "draft_start_ptr": "*i64", "n_ptr": "*i64", "out_stride": "i32",
    }
    out = [("greedy_scan", _greedy_scan_kernel, greedy_sig, {})]
    for no_q in (False, True):
        out.append((f"stochastic_scan[no_q={no_q}]", _stochastic_scan_kernel, scan_sig, {"NO_DRAFT_PROBS": no_q}))
        for has_sel in (False, True):
            consts = {"SCALE": SAMPLE_SCALE, "HAS_SEL": has_sel, "NO_DRAFT_PROBS": no_q, "BLOCK": block,
                      "LOG2_BLOCK": block.bit_length() - 1}
            out.append((f"sample_rows[no_q={no_q},sel={has_sel},block={block}]", _sample_rows_kernel, sample_sig, consts))
    return out


def aot_compile(arch: int = 90, vocab: int = 49152) -> dict:
    """Compile every kernel's constexpr specialisations for NVIDIA compute capability ``arch`` without a GPU.

    Uses Triton's bundled LLVM and ``ptxas`` (``arch=90``: H100 / H200; 80: A100; 89: L4 / L40), with
    :data:`LAUNCH_OPTIONS`, so a kernel that only runs under the interpreter is caught on a CPU
    machine. ``vocab`` picks the sampling block width (:func:`~speculators.verify.layout.sample_block`).

    Returns:
        ``{variant name: CompiledKernel}``; ``kernel.asm`` holds ``ttir``, ``ttgir``, ``llir``, ``ptx``
        and ``cubin``.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1`` (the kernels are interpreted functions then).
        triton.CompilationError (or ptxas errors): a kernel does not compile for ``arch``.
    """
    if interpreter_active():
        raise RuntimeError("aot_compile needs triton imported without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    return {
        name: triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                             options=dict(LAUNCH_OPTIONS))
        for name, fn, sig, consts in _variants(vocab)
    }


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
        raise VerifyInputError(
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
        out.stride(0), **LAUNCH_OPTIONS,
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
        NO_DRAFT_PROBS=no_q, **LAUNCH_OPTIONS,
    )
    return out, num_acc


def sample_rows(
    p: Tensor,
    sel: Tensor | None,
    draft_probs: Tensor | None,
    pos: Tensor,
    draft_token_ids: Tensor,
    u: Tensor,
) -> Tensor:
    """Triton twin of :func:`speculators.verify.torch_impl.sample_rows` (same tokens, same uniforms)."""
    device = p.device
    _check_device(device)
    count, vocab = pos.numel(), p.shape[1]
    tokens = torch.empty(count, dtype=torch.int64, device=device)
    if count == 0:
        return tokens
    no_q = draft_probs is None or draft_token_ids.numel() == 0
    block = sample_block(vocab)  # the tree's block width is part of the sampling rule
    p = p.contiguous()
    _sample_rows_kernel[(count,)](
        tokens, p, tokens if sel is None else sel.contiguous(), p if no_q else draft_probs.contiguous(),
        pos.contiguous(), _ids(draft_token_ids, device), u.to(torch.float64).contiguous(), vocab,
        SCALE=SAMPLE_SCALE, HAS_SEL=sel is not None, NO_DRAFT_PROBS=no_q, BLOCK=block,
        LOG2_BLOCK=block.bit_length() - 1, **LAUNCH_OPTIONS,
    )
    return tokens
