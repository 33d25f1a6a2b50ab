"""Lossless speculative-decoding verification (rejection sampling), a pure function of tensors.

Algorithm: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192)
and Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (arXiv 2302.01318).
Engine semantics (ragged batch layout, greedy rule, point-mass drafts when no draft probs, -1 padding):
vLLM ``vllm/v1/sample/rejection_sampler.py``.

For one request with drafts ``d_1..d_n`` (drawn from ``q_1..q_n``) and target distributions
``p_1..p_{n+1}`` (both through :func:`~speculators.verify.sampling.apply_sampling`):

* greedy (temperature 0): accept while ``d_i == argmax p_i``; at the first mismatch emit ``argmax p_i``;
  if all are accepted emit the bonus ``argmax p_{n+1}``.
* stochastic: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
  emit a *recovered* token ``~ normalise(max(p_i - q_i, 0))`` and stop; if all are accepted emit a
  *bonus* token ``~ p_{n+1}``. Without draft probs ``q_i`` is a point mass on ``d_i``: accept with
  probability ``p_i(d_i)``, recover from ``p_i`` with ``d_i`` removed.

Sampling the recovered / bonus token: two-level inverse CDF with ONE float64 uniform ``u`` per request.
The row to sample, ``r = max(p - q, 0)`` (point-mass q: ``p`` with ``d`` zeroed; bonus: ``p``), float32,
is cut into blocks of ``B = min(1024, next_power_of_2(V))`` tokens (zero padded):

1. block sums ``S_b`` by a fixed pairwise tree in float32 (element ``i`` of a block's first half plus
   element ``i`` of its second half, repeated ``log2(B)`` times), so every implementation rounds alike;
2. block weights ``Q_b = floor(S_b * 2**52)`` and ``T = sum(Q_b)`` (float64 integers below ``2**53``:
   exact in any order); ``x = min(floor(u * T), T - 1)`` picks the first block whose cumulative weight
   exceeds ``x``, with offset ``k = x - (cumulative weight before it)``;
3. in that block only, token weights ``w_t = floor(r_t * 2**52)`` (exact integers), ``W = sum(w_t)``,
   ``y = min(floor(k / Q_b * W), W - 1)`` and the token is the first whose in-block prefix sum of
   ``w`` exceeds ``y`` (the first maximum of ``r`` in the block if ``W == 0``).

Token ``t`` in block ``b`` thus has probability ``(Q_b / T) * (w_t / W_b)``, i.e. ``r_t / sum(r)`` up to
the float32 rounding of the block sums (relative ``~1e-6``, the precision of ``p`` itself) and a
``2**-52`` grid. All float64 operations are single IEEE operations on identical inputs, so the
per-request reference, the vectorised torch code and the Triton kernel pick the same token for the
same ``r`` and ``u``; only a row's ``B`` block sums and one block are touched beyond the float32 pass
over the row. If the residual vanished numerically (``T == 0``) the token is sampled the same way from
``p``.

Random numbers are drawn once, in torch (:func:`draw_randoms`), and shared by every implementation:
one float32 uniform per draft (accept test) and one float64 uniform per request (its single recovered
or bonus token). The target side (logits -> probabilities, :mod:`speculators.verify.target_side`) is
shared torch code too, so the torch and Triton backends return identical tokens; the per-request
reference recomputes the probabilities itself (softmax per request; the vectorised CPU path normalises
with exp2 instead, so values can differ in the last bits) and agrees with them up to floating-point ties.

One compute dtype, float32 (:data:`~speculators.verify.layout.COMPUTE_DTYPE`), for every path: float64
target logits are rounded to float32 once, at the entry of :func:`rejection_sample`, so a request's
tokens (greedy and sampled) do not depend on which order (lazy / eager), backend or batch computed them.
Verification is not differentiable: ``target_logits`` and ``draft_probs`` are detached at the entry.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import target_side
from .layout import (  # the layout names' home is the leaf module .layout; re-exported here
    COMPUTE_DTYPE,
    PLACEHOLDER_TOKEN_ID,
    RejectionOutput,
    SAMPLE_SCALE,
    VerifyInputError,
    _Layout,
    sample_block,
)
from .sampling import SamplingParams, _shape, apply_sampling, effective_temperature

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "RejectionRandoms",
    "VerifyInputError",
    "draw_randoms",
    "rejection_sample",
    "rejection_sample_reference",
]


@dataclass
class RejectionRandoms:
    """The random numbers one verification consumes (shared by all implementations).

    Attributes:
        uniform: ``[num_draft_tokens_total]`` float32 in ``[0, 1)``, one accept-test uniform per draft
            position (``0`` for greedy requests, which makes the stochastic rule reduce to greedy).
        sample_uniform: ``[B]`` float64 in ``[0, 1)``, one per request, for its single recovered *or*
            bonus token by inverse CDF (see the module docstring). ``0`` for greedy requests (their rows
            are one-hot, so any uniform gives the argmax). ``None`` when every request is greedy.
    """

    uniform: Tensor
    sample_uniform: Tensor | None


# --------------------------------------------------------------------------------------------------
# Layout + validation
# --------------------------------------------------------------------------------------------------


def _as_num_drafts(num_draft_tokens: Tensor | Sequence[int]) -> list[int]:
    if isinstance(num_draft_tokens, Tensor):
        if num_draft_tokens.dim() != 1 or num_draft_tokens.is_floating_point():
            raise VerifyInputError(
                f"num_draft_tokens: expected a 1-D integer tensor [B], got {num_draft_tokens.dtype} "
                f"{list(num_draft_tokens.shape)}"
            )
        return [int(v) for v in num_draft_tokens.tolist()]
    try:
        return [int(v) for v in num_draft_tokens]
    except (TypeError, ValueError):
        raise VerifyInputError(f"num_draft_tokens: expected a list of ints or a 1-D tensor, got {num_draft_tokens!r}")


def _prepare(
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor | Sequence[int],
    draft_probs: Tensor | None,
    target_logits: Tensor,
    sampling: SamplingParams,
    validate: bool,
) -> _Layout:
    """Check the inputs of :func:`rejection_sample` (shapes, dtypes and devices always; values when
    ``validate``) and lay the batch out (:class:`_Layout`). Raises :class:`VerifyInputError`."""
    nums = _check_structure(draft_token_ids, num_draft_tokens, draft_probs, target_logits, sampling)
    batch, total, device = len(nums), sum(nums), target_logits.device
    sampling.validate(batch, values=validate)
    if validate:
        _check_values(draft_token_ids, draft_probs, target_logits, total)
    n = torch.tensor(nums, dtype=torch.int64, device=device)
    draft_start = torch.cumsum(n, 0) - n
    row_start = draft_start + torch.arange(batch, device=device)
    is_greedy = sampling.temperature == 0
    n_greedy = int(is_greedy.sum()) if batch else 0
    return _Layout(
        batch=batch,
        vocab=int(target_logits.shape[1]),
        num_drafts=nums,
        max_drafts=max(nums, default=0),
        total_drafts=total,
        n=n,
        draft_start=draft_start,
        row_start=row_start,
        is_greedy=is_greedy,
        all_greedy=n_greedy == batch,
        any_greedy=n_greedy > 0,
    )


def _check_structure(
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor | Sequence[int],
    draft_probs: Tensor | None,
    target_logits: Tensor,
    sampling: SamplingParams,
) -> list[int]:
    """The shape, dtype and device checks of :func:`_prepare` (no host sync); returns the per-request
    draft counts as ints."""
    if not isinstance(sampling, SamplingParams):
        raise VerifyInputError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
    if not isinstance(target_logits, Tensor) or target_logits.dim() != 2 or not target_logits.is_floating_point():
        raise VerifyInputError(
            f"target_logits: expected a 2-D float tensor [num_draft_tokens_total + batch_size, vocab], "
            f"got {_shape(target_logits)}"
        )
    if not isinstance(draft_token_ids, Tensor) or draft_token_ids.dim() != 1:
        raise VerifyInputError(
            f"draft_token_ids: expected a 1-D int64 tensor [num_draft_tokens_total], got {_shape(draft_token_ids)}"
        )
    if draft_token_ids.is_floating_point() or draft_token_ids.dtype == torch.bool:
        raise VerifyInputError(f"draft_token_ids: expected an integer tensor, got {draft_token_ids.dtype}")
    nums = _as_num_drafts(num_draft_tokens)
    batch = len(nums)
    device = target_logits.device
    vocab = int(target_logits.shape[1])
    if vocab == 0:
        raise VerifyInputError("target_logits: vocabulary dimension is empty")
    if any(v < 0 for v in nums):
        raise VerifyInputError(f"num_draft_tokens: every entry must be >= 0, got {nums}")
    total = sum(nums)
    if draft_token_ids.shape[0] != total:
        raise VerifyInputError(
            f"draft_token_ids: length {draft_token_ids.shape[0]} != sum(num_draft_tokens) = {total}"
        )
    if target_logits.shape[0] != total + batch:
        raise VerifyInputError(
            f"target_logits: expected {total + batch} rows (sum(num_draft_tokens)={total} draft positions "
            f"+ {batch} bonus positions), got {target_logits.shape[0]}"
        )
    if draft_probs is not None:
        if not isinstance(draft_probs, Tensor) or draft_probs.dim() != 2 or not draft_probs.is_floating_point():
            raise VerifyInputError(
                f"draft_probs: expected a 2-D float tensor [{total}, {vocab}] or None, got {_shape(draft_probs)}"
            )
        if tuple(draft_probs.shape) != (total, vocab):
            raise VerifyInputError(f"draft_probs: expected shape [{total}, {vocab}], got {list(draft_probs.shape)}")
        if draft_probs.device != device:
            raise VerifyInputError(f"draft_probs: on {draft_probs.device}, expected target_logits' device {device}")
    if draft_token_ids.device != device:
        raise VerifyInputError(f"draft_token_ids: on {draft_token_ids.device}, expected target_logits' device {device}")
    for name in ("temperature", "top_k", "top_p"):
        t = getattr(sampling, name)
        if isinstance(t, Tensor) and t.device != device:
            raise VerifyInputError(f"sampling.{name}: on {t.device}, expected target_logits' device {device}")
    return nums


def _check_values(draft_token_ids: Tensor, draft_probs: Tensor | None, target_logits: Tensor, total: int) -> None:
    """The value checks of :func:`_prepare` (``validate=True``): cheap vectorised checks, one host sync.
    The per-row max catches NaN (it propagates), +inf and all -inf rows; -inf entries (masked tokens)
    are allowed."""
    vocab = int(target_logits.shape[1])
    row_max = target_logits.amax(dim=-1) if target_logits.shape[0] else target_logits.new_zeros(1)
    flags = [~torch.isfinite(row_max).all()]
    if total:
        flags += [(draft_token_ids < 0).any() | (draft_token_ids >= vocab).any()]
    if draft_probs is not None and total:
        sums = draft_probs.sum(dim=-1, dtype=torch.float32)
        flags += [((sums - 1).abs() > 1e-3).any() | ~torch.isfinite(sums).all(), (draft_probs.amin() < 0)]
    bad = torch.stack(flags).tolist()
    if bad[0]:
        r = int((~torch.isfinite(row_max)).nonzero()[0, 0])
        raise VerifyInputError(
            f"target_logits: row {r} contains NaN or +inf (or is entirely -inf); logits must be finite "
            f"in float32, the verifier's compute dtype (|x| < 3.4e38; -inf entries are allowed for masked "
            f"tokens)"
        )
    if total and bad[1]:
        raise VerifyInputError(
            f"draft_token_ids: ids must lie in [0, {vocab}), got min {int(draft_token_ids.min())} "
            f"max {int(draft_token_ids.max())}"
        )
    if draft_probs is not None and total:
        if bad[2]:
            r = int(((sums - 1).abs() > 1e-3).logical_or(~torch.isfinite(sums)).nonzero()[0, 0])
            raise VerifyInputError(
                f"draft_probs: every row must sum to 1 within 1e-3 (the distribution the draft was sampled "
                f"from, after apply_sampling); row {r} sums to {float(sums[r])}"
            )
        if bad[3]:
            raise VerifyInputError("draft_probs: entries must be >= 0")


# --------------------------------------------------------------------------------------------------
# Random numbers
# --------------------------------------------------------------------------------------------------


def draw_randoms(
    num_draft_tokens: Tensor | Sequence[int],
    vocab_size: int,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    device: str | torch.device | None = None,
) -> RejectionRandoms:
    """Draw the random numbers of one verification step: ``sum(n_i)`` float32 + ``B`` float64 uniforms.

    Requests without their own generator draw from ``generator`` (or torch's global RNG) in one bulk
    call each for the accept-test uniforms and the per-request sampling uniforms; a request with
    ``sampling.generators[i]`` draws its ``n_i`` accept uniforms and then its sampling uniform from
    that generator only (so its result does not depend on the rest of the batch). Greedy requests
    consume no random numbers. ``vocab_size`` is accepted for API stability (no per-token noise is drawn).

    Returns:
        :class:`RejectionRandoms` on ``device`` (default: ``sampling.temperature.device``).
    """
    del vocab_size  # inverse-CDF sampling needs one uniform per request, not per token
    nums = _as_num_drafts(num_draft_tokens)
    device = torch.device(device) if device is not None else sampling.temperature.device
    batch, total = len(nums), sum(nums)
    greedy = (sampling.temperature == 0).to(device)
    gens = sampling.generators or [None] * batch
    greedy_list = greedy.tolist()
    if all(greedy_list):
        return RejectionRandoms(torch.zeros(total, dtype=torch.float32, device=device), None)
    seeded = [i for i, g in enumerate(gens) if g is not None and not greedy_list[i]]
    uniform = torch.rand(total, generator=generator, device=device)
    sample_u = torch.rand(batch, generator=generator, device=device, dtype=torch.float64)
    if seeded:
        starts = [0] * batch
        acc = 0
        for i, v in enumerate(nums):
            starts[i] = acc
            acc += v
        for i in seeded:
            g = gens[i]
            if nums[i]:
                uniform[starts[i] : starts[i] + nums[i]] = torch.rand(nums[i], generator=g, device=device)
            sample_u[i] = torch.rand(1, generator=g, device=device, dtype=torch.float64)[0]
    if any(greedy_list):
        n = torch.tensor(nums, device=device)
        uniform.masked_fill_(torch.repeat_interleave(greedy, n, output_size=total), 0.0)
        sample_u.masked_fill_(greedy, 0.0)
    return RejectionRandoms(uniform, sample_u)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except (ImportError, RuntimeError, OSError):  # absent or broken install (no driver / compiler)
        return False
    return True


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in ("auto", "torch", "triton", "reference"):
        raise VerifyInputError(f"impl: expected 'auto', 'torch', 'triton' or 'reference', got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if impl == "triton" and not _triton_available():
        raise VerifyInputError("impl='triton' requested but triton is not importable (pip install triton)")
    return impl


def _entry_logits(target_logits: Tensor) -> Tensor:
    """``target_logits`` detached and in a dtype whose float32 conversion is exact.

    float32 / float16 / bfloat16 are returned as they are (converting the latter two later gives the
    same float32 values on every path); any other float dtype (float64) is rounded to float32 here,
    once, so no path computes in float64 and another in float32. Non-tensors pass through (``_prepare``
    names the argument).
    """
    if not isinstance(target_logits, Tensor):
        return target_logits
    target_logits = target_logits.detach()
    if target_logits.is_floating_point() and target_logits.dtype not in _EXACT_IN_COMPUTE_DTYPE:
        target_logits = target_logits.to(COMPUTE_DTYPE)
    return target_logits


_EXACT_IN_COMPUTE_DTYPE = (torch.float32, torch.float16, torch.bfloat16)


def rejection_sample(
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor | Sequence[int],
    draft_probs: Tensor | None,
    target_logits: Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    impl: str = "auto",
    order: str = "auto",
    validate: bool = True,
    randoms: RejectionRandoms | None = None,
) -> RejectionOutput:
    """Verify a batch of drafts against the target model's logits (lossless rejection sampling).

    Follows Leviathan et al. (arXiv 2211.17192) / Chen et al. (arXiv 2302.01318) with vLLM's
    ``RejectionSampler`` semantics. The emitted tokens have exactly the distribution of sampling the
    target token by token with the same ``sampling`` parameters.

    Args:
        draft_token_ids: ``[T]`` int64, ``T = sum(num_draft_tokens)``: request 0's drafts, then request 1's, ...
        num_draft_tokens: ``[B]`` ints (list or tensor), each ``>= 0``; 0 drafts = plain sampling.
        draft_probs: ``[T, V]`` float32 draft distributions the drafts were sampled from (already
            through :func:`apply_sampling`), or ``None`` = point-mass draft (model-free / argmax drafters).
            Detached (may require grad; no gradient flows).
        target_logits: ``[T + B, V]`` float raw target logits: per request its ``n_i`` draft positions
            then one bonus position, requests in order. Computed in float32 on every path (float64 is
            rounded to float32 here, once; float16 / bfloat16 convert exactly), so the tokens do not
            depend on the batch, the order or the backend. Detached (may require grad; verification is
            not differentiable).
        sampling: :class:`SamplingParams` with ``B`` requests (temperature 0 = greedy per request;
            temperatures in ``(0, 1e-2)`` are raised to ``1e-2`` as vLLM does, see
            :func:`~speculators.verify.sampling.effective_temperature`).
        generator: RNG for requests without their own generator (default: torch's global RNG).
        impl: ``"auto"`` (Triton for CUDA tensors when triton imports, else torch), ``"torch"``
            (vectorised), ``"triton"`` (compiled on CUDA; interpreted on CPU tensors, e.g. under
            ``TRITON_INTERPRET=1``), or ``"reference"`` (per-request Python loop).
        order: evaluation order of the target side (logits -> probabilities), see
            :mod:`speculators.verify.target_side`: ``"eager"`` (all ``T + B`` rows at once, vLLM's order),
            ``"lazy"`` (CPU tensors only: only the rows some accept test or sample reads, a cache-sized
            chunk at a time), or ``"auto"`` (lazy for CPU logits above ``2 * CHUNK_BYTES``, else eager).
            Same tokens up to floating-point ties; ignored by ``impl="reference"`` (but still checked).
        validate: run the value checks below (a few vectorised reductions and one host sync);
            shape checks always run. Pass ``False`` in hot loops with trusted inputs.
        randoms: pre-drawn random numbers (see :func:`draw_randoms`); drawn here when ``None``.

    Returns:
        :class:`RejectionOutput` (``output_token_ids [B, max(num_draft_tokens) + 1]`` int64 padded with
        ``-1``; ``num_accepted [B]`` int64).

    Raises:
        VerifyInputError (a ``ValueError`` and a ``SpeculatorsError``), naming the argument: mismatched
            shapes or ragged sums, negative ``num_draft_tokens``, draft ids outside ``[0, V)``, NaN / +inf
            (or all -inf rows) in ``target_logits`` (after the float32 rounding), ``draft_probs`` rows not
            summing to 1 within 1e-3 or negative, ``temperature < 0`` or non-finite, ``top_k < 0``,
            ``top_p`` outside ``(0, 1]``, unknown ``impl`` or ``order``, ``order="lazy"`` off CPU.
    """
    target_logits = _entry_logits(target_logits)
    if isinstance(draft_probs, Tensor):
        draft_probs = draft_probs.detach()
    layout = _prepare(draft_token_ids, num_draft_tokens, draft_probs, target_logits, sampling, validate)
    impl = _resolve_impl(impl, target_logits.device)
    lazy = target_side.use_lazy(target_logits, order)
    # The clamped float32 temperature every path below reads (the drafter's apply_sampling applies the same).
    sampling = copy.copy(sampling)
    sampling.temperature = effective_temperature(sampling.temperature, warn=validate, stacklevel=2)
    draft_token_ids = draft_token_ids.long()
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    if layout.batch == 0:
        empty = torch.empty(0, 1, dtype=torch.int64, device=target_logits.device)
        return RejectionOutput(empty, torch.empty(0, dtype=torch.int64, device=target_logits.device))
    if randoms is None:
        randoms = draw_randoms(layout.num_drafts, layout.vocab, sampling, generator, target_logits.device)
    elif randoms.uniform.shape != (layout.total_drafts,) or (
        not layout.all_greedy
        and (randoms.sample_uniform is None or randoms.sample_uniform.shape != (layout.batch,))
    ):
        raise VerifyInputError("randoms: shapes do not match this batch (use draw_randoms with the same arguments)")
    if impl == "reference":
        return _reference(layout, draft_token_ids, draft_probs, target_logits, sampling, randoms)
    if impl == "torch":
        from . import torch_impl as backend
    else:
        from . import triton_impl as backend
    # The target side (logits -> probabilities) is shared torch code, so every backend sees bit-identical
    # inputs; on CPU (large inputs, or order="lazy") it is evaluated lazily (see speculators.verify.target_side).
    if layout.all_greedy:
        target_argmax = target_side.target_argmax(layout, target_logits, draft_token_ids, lazy=lazy)
        return backend.greedy(layout, draft_token_ids, target_argmax)
    cache: dict = {}
    sampler = target_side.Sampler(backend, draft_token_ids, draft_probs, randoms.sample_uniform)
    p_draft = target_side.probs_at_drafts(
        layout, target_logits, sampling, draft_token_ids, draft_probs, randoms.uniform,
        lazy=lazy, cache=cache, sampler=sampler,
    )
    out, num_acc = backend.scan(layout, draft_token_ids, draft_probs, p_draft, randoms.uniform)
    tokens = target_side.final_tokens(layout, target_logits, sampling, num_acc, sampler, lazy=lazy, cache=cache)
    del cache
    out.scatter_(1, num_acc.unsqueeze(1), tokens.unsqueeze(1))
    return RejectionOutput(out, num_acc)


# --------------------------------------------------------------------------------------------------
# Reference: per-request Python loop (obviously correct, slow)
# --------------------------------------------------------------------------------------------------


def rejection_sample_reference(
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor | Sequence[int],
    draft_probs: Tensor | None,
    target_logits: Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    validate: bool = True,
    randoms: RejectionRandoms | None = None,
) -> RejectionOutput:
    """Same contract as :func:`rejection_sample`, written as a plain per-request, per-position loop.

    This is the "naive" engine code the vectorised implementations are tested and benchmarked against;
    it consumes the same :class:`RejectionRandoms`, so its output is identical to theirs.
    """
    return rejection_sample(
        draft_token_ids, num_draft_tokens, draft_probs, target_logits, sampling, generator,
        impl="reference", validate=validate, randoms=randoms,
    )


def _reference(
    layout: _Layout,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    target_logits: Tensor,
    sampling: SamplingParams,
    randoms: RejectionRandoms,
) -> RejectionOutput:
    device = target_logits.device
    out = torch.full((layout.batch, layout.max_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_acc = torch.zeros(layout.batch, dtype=torch.int64, device=device)
    temps = sampling.temperature.tolist()
    start = 0
    for i, n in enumerate(layout.num_drafts):
        rows = target_logits[start + i : start + i + n + 1]
        drafts = draft_token_ids[start : start + n].tolist()
        if temps[i] == 0.0:  # greedy
            target = rows.argmax(dim=-1).tolist()
            j = 0
            while j < n and drafts[j] == target[j]:
                out[i, j] = drafts[j]
                j += 1
            out[i, j] = target[j]
            num_acc[i] = j
            start += n
            continue
        top_k = None if sampling.top_k is None else sampling.top_k[i : i + 1].expand(n + 1)
        top_p = None if sampling.top_p is None else sampling.top_p[i : i + 1].expand(n + 1)
        p = apply_sampling(rows, sampling.temperature[i : i + 1].expand(n + 1), top_k, top_p, validate=False)
        token = None
        j = 0
        for j in range(n):
            d = drafts[j]
            q_d = 1.0 if draft_probs is None else draft_probs[start + j, d]
            u = randoms.uniform[start + j]
            if bool(u * q_d < p[j, d]):  # accept with probability min(1, p(d) / q(d))
                out[i, j] = d
                continue
            if draft_probs is None:  # point-mass q: p with d removed
                r = p[j].clone()
                r[d] = 0.0
            else:
                r = (p[j] - draft_probs[start + j]).clamp_min(0.0)
            token = _sample_row(r, p[j], float(randoms.sample_uniform[i]))
            break
        else:
            j = n
            token = _sample_row(p[n], p[n], float(randoms.sample_uniform[i]))
        out[i, j] = token
        num_acc[i] = j
        start += n
    return RejectionOutput(out, num_acc)


def _sample_row(r: Tensor, p: Tensor, u: float) -> int:
    """Two-level inverse-CDF sample from ``r / sum(r)`` with one uniform ``u``; ``p`` if ``r`` vanished."""
    token = _two_level(r, u)
    return _two_level(p, u) if token is None else token


def _two_level(r: Tensor, u: float) -> int | None:
    vocab = r.numel()
    block = sample_block(vocab)
    nb = -(-vocab // block)
    w = r.contiguous()
    if nb * block != vocab:
        w = torch.zeros(nb * block, dtype=torch.float32, device=r.device)
        w[:vocab] = r
    s = w.view(nb, block)
    while s.shape[1] > 1:  # fixed pairwise tree: first half + second half
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    q_cum = s.view(nb).double().mul_(SAMPLE_SCALE).floor_().cumsum_(0).tolist()
    total = q_cum[-1]
    if total <= 0:
        return None
    x = min(math.floor(u * total), total - 1.0)
    b = bisect.bisect_right(q_cum, x)  # first block whose cumulative weight exceeds x
    before = q_cum[b - 1] if b else 0.0
    blk = w[b * block : (b + 1) * block]
    cum = blk.double().mul_(SAMPLE_SCALE).floor_().cumsum_(0)
    big_w = float(cum[-1])
    if big_w <= 0:
        return b * block + int(blk.argmax())
    y = min(math.floor((x - before) / (q_cum[b] - before) * big_w), big_w - 1.0)
    return b * block + int(torch.searchsorted(cum, y, right=True))
