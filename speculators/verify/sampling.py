"""Per-request sampling parameters and the logits -> probabilities transform.

The same :func:`apply_sampling` turns *target* logits into the target distribution ``p`` inside the
verifier and *draft* logits into the draft distribution ``q`` a drafter samples from, so both sides
apply temperature / top-k / top-p identically (a requirement for losslessness, Leviathan et al.
arXiv 2211.17192, section 2.3).

Semantics follow vLLM's sampler (``vllm/v1/sample/ops/topk_topp_sampler.py``):

* temperature ``t == 0`` selects greedy decoding for that row (the result is a one-hot on the argmax of
  the float32 logits, ties -> lowest id); ``t > 0`` divides the logits by ``max(t, 1e-2)``: a positive
  temperature below ``MIN_TEMPERATURE = 1e-2`` is raised to it, with a warning, exactly as vLLM's
  ``SamplingParams.__post_init__`` does (``vllm/sampling_params.py``: ``if 0 < temperature < _MAX_TEMP:
  logger.warning(...); temperature = max(temperature, _MAX_TEMP)`` with ``_MAX_TEMP = 1e-2``); smaller
  ones overflow float32 (``logits / 1e-39`` is inf) and give NaN probabilities. The rule lives in
  :func:`effective_temperature`, applied when a :class:`SamplingParams` is built and again by
  :func:`apply_sampling` and the verifier, so the drafter's ``q`` and the target's ``p`` always use the
  same temperature.
* top-k keeps every token whose (scaled) logit is >= the k-th largest one (ties at the boundary are
  kept); ``k == 0`` or ``k >= V`` disables it.
* top-p is applied after top-k: tokens are sorted by probability and the least likely ones are dropped
  while the cumulative mass of the dropped ones stays ``<= 1 - p``; the most likely token is always
  kept. ``p == 1`` disables it.

Compute dtype: float32 (:data:`~speculators.verify.layout.COMPUTE_DTYPE`), whatever the logits' dtype
(vLLM's sampler works in float32 too). Not differentiable: the logits are detached (verification and
drafting are inference; the result never requires grad).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import COMPUTE_DTYPE, VerifyInputError

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "apply_sampling", "effective_temperature"]

# vLLM's ``_MAX_TEMP`` (vllm/sampling_params.py): positive temperatures below it are raised to it.
MIN_TEMPERATURE = 1e-2


def effective_temperature(temperature: Tensor, *, warn: bool = True, stacklevel: int = 1) -> Tensor:
    """The temperature actually applied: ``0`` stays ``0`` (greedy); ``0 < t < 1e-2`` becomes ``1e-2``.

    vLLM's rule (``vllm/sampling_params.py``, ``SamplingParams.__post_init__``: temperatures in
    ``(0, _MAX_TEMP)`` are raised to ``_MAX_TEMP = 1e-2`` with a warning), applied in the input's own
    dtype *before* the cast to float32, so a float64 ``1e-50`` is raised too instead of rounding to a
    greedy ``0``. Idempotent. Negative / NaN / inf values pass through unchanged (validation rejects them).

    Args:
        temperature: float tensor of any shape and device (e.g. ``[B]``).
        warn: emit a ``UserWarning`` (Python's default filter shows it once per call site) when a value
            is raised; costs one host sync. ``False``: no sync, no warning.
        stacklevel: frames above the caller the warning is attributed to (1: the caller).

    Returns:
        float32 tensor of the same shape and device, detached (never requires grad).
    """
    t = temperature.detach()
    # Compared in t's dtype: float32(0.01) is just below the Python float 0.01 and must count as 0.01.
    small = (t > 0) & (t < torch.tensor(MIN_TEMPERATURE, dtype=t.dtype, device=t.device))
    if warn and bool(small.any()):
        warnings.warn(
            f"temperature: positive values below {MIN_TEMPERATURE} overflow float32 when they divide the "
            f"logits; they are raised to {MIN_TEMPERATURE} (vLLM's _MAX_TEMP rule). Use 0 for greedy.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return torch.where(small, MIN_TEMPERATURE, t).to(torch.float32)


@dataclass
class SamplingParams:
    """Batched per-request sampling parameters.

    Attributes:
        temperature: ``[B]`` float32. ``0`` means greedy for that request; must be finite and ``>= 0``.
            Stored as :func:`effective_temperature` (float32; values in ``(0, 1e-2)`` raised to ``1e-2``
            with a warning, as vLLM's ``SamplingParams`` does).
        top_k: ``[B]`` int64 or ``None``. ``0`` or ``>= V`` means off; must be ``>= 0``.
        top_p: ``[B]`` float32 or ``None``. Must lie in ``(0, 1]``; ``1`` means off.
        generators: one ``torch.Generator`` (or ``None``) per request, or ``None``. A request with its
            own generator draws all its random numbers from it, so its result does not depend on the
            rest of the batch (reproducible per-request seeds, as vLLM's ``SamplingParams.seed``).
            Requests without one use the ``generator`` argument of the verifier (or torch's global RNG).
    """

    temperature: Tensor
    top_k: Tensor | None = None
    top_p: Tensor | None = None
    generators: list[torch.Generator | None] | None = None

    def __post_init__(self) -> None:
        # The one place a request's temperature is fixed (vLLM clamps in SamplingParams.__post_init__ too).
        # Anything that is not a float tensor is left for validate() to reject with a named error.
        if isinstance(self.temperature, Tensor) and self.temperature.is_floating_point():
            self.temperature = effective_temperature(self.temperature, stacklevel=3)  # the caller of __init__

    @classmethod
    def uniform(
        cls,
        batch: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        device: str | torch.device = "cpu",
    ) -> SamplingParams:
        """The same parameters for all ``batch`` requests.

        ``seed`` gives request ``i`` its own generator seeded with ``seed + i``; ``top_k == 0`` and
        ``top_p == 1`` leave the corresponding tensor as ``None`` (off).
        """
        # float64 first: the clamp of tiny temperatures happens before the float32 rounding (1e-46 -> 1e-2).
        temp = torch.full((batch,), float(temperature), dtype=torch.float64, device=device)
        tk = None if not top_k else torch.full((batch,), int(top_k), dtype=torch.int64, device=device)
        tp = None if float(top_p) == 1.0 else torch.full((batch,), float(top_p), dtype=torch.float32, device=device)
        gens = None
        if seed is not None:
            gens = [torch.Generator(device=device).manual_seed(int(seed) + i) for i in range(batch)]
        return cls(temperature=temp, top_k=tk, top_p=tp, generators=gens)

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0]) if self.temperature.dim() == 1 else -1

    def validate(self, batch: int | None = None, *, values: bool = True) -> None:
        """Check shapes (always) and values (``values=True``; one host sync).

        Raises:
            VerifyInputError (a ``ValueError``): naming the field (``sampling.temperature``, ...).
        """
        _validate_params(self.temperature, self.top_k, self.top_p, batch, values=values, prefix="sampling.")
        if self.generators is not None:
            if batch is None:
                batch = self.batch_size
            if len(self.generators) != batch:
                raise VerifyInputError(
                    f"sampling.generators: expected one entry (Generator or None) per request "
                    f"({batch}), got {len(self.generators)}"
                )
            for i, g in enumerate(self.generators):
                if g is not None and not isinstance(g, torch.Generator):
                    raise VerifyInputError(f"sampling.generators[{i}]: expected torch.Generator or None, got {type(g)}")


ARGMAX_BLOCK = 1024


def first_argmax(x: Tensor) -> Tensor:
    """``[R]`` int64 index of the first maximum of each row of ``x`` ``[R, V]``; equals ``x.argmax(dim=-1)``.

    On CPU ``argmax`` is a scalar reduction (~40 us per 49152-wide row here) while ``amax`` is vectorised
    and memory-bound, so: block maxima of ``ARGMAX_BLOCK``-wide blocks with ``amax`` (one pass), the
    first block holding the row maximum (or a NaN: like ``argmax``, the first NaN wins), then ``argmax``
    inside that one block. ``x``: any float dtype, any strides (strided views are read in place). Other
    devices use ``argmax`` directly.

    Raises:
        IndexError / RuntimeError (torch's): ``x`` is not 2-D, or has no columns.
    """
    vocab = x.shape[1]
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    nb, tail = divmod(vocab, ARGMAX_BLOCK)
    if nb <= 1:
        return x.argmax(dim=-1)
    bmax = x[:, : nb * ARGMAX_BLOCK].unflatten(1, (nb, ARGMAX_BLOCK)).amax(dim=-1)  # [R, nb]
    if tail:
        bmax = torch.cat([bmax, x[:, nb * ARGMAX_BLOCK :].amax(dim=-1, keepdim=True)], dim=1)
    hit = (bmax == bmax.amax(dim=-1, keepdim=True)) | bmax.isnan()
    first = torch.where(hit, torch.arange(hit.shape[1], device=x.device), hit.shape[1]).amin(dim=-1)  # [R]
    start = first * ARGMAX_BLOCK
    cols = (start.unsqueeze(1) + torch.arange(ARGMAX_BLOCK, device=x.device)).clamp_max_(vocab - 1)
    return start + x.gather(1, cols).argmax(dim=-1)


def _validate_params(
    temperature: Tensor,
    top_k: Tensor | None,
    top_p: Tensor | None,
    n: int | None,
    *,
    values: bool,
    prefix: str = "",
) -> None:
    if not isinstance(temperature, Tensor) or temperature.dim() != 1:
        raise VerifyInputError(f"{prefix}temperature: expected a 1-D tensor [{n if n is not None else 'B'}]")
    if n is None:
        n = temperature.shape[0]
    if temperature.shape[0] != n:
        raise VerifyInputError(f"{prefix}temperature: expected shape [{n}], got {list(temperature.shape)}")
    if not temperature.is_floating_point():
        raise VerifyInputError(f"{prefix}temperature: expected a floating tensor, got {temperature.dtype}")
    if top_k is not None:
        if not isinstance(top_k, Tensor) or top_k.shape != (n,):
            raise VerifyInputError(f"{prefix}top_k: expected shape [{n}] or None, got {_shape(top_k)}")
        if top_k.is_floating_point() or top_k.dtype == torch.bool:
            raise VerifyInputError(f"{prefix}top_k: expected an integer tensor, got {top_k.dtype}")
    if top_p is not None:
        if not isinstance(top_p, Tensor) or top_p.shape != (n,):
            raise VerifyInputError(f"{prefix}top_p: expected shape [{n}] or None, got {_shape(top_p)}")
        if not top_p.is_floating_point():
            raise VerifyInputError(f"{prefix}top_p: expected a floating tensor, got {top_p.dtype}")
    if not values or n == 0:
        return
    # One host sync for all value checks.
    # Finite in the compute dtype: a float64 temperature of 1e300 would be inf once cast to float32.
    checks = [~torch.isfinite(temperature.to(torch.float32)).all(), (temperature < 0).any()]
    if top_k is not None:
        checks.append((top_k < 0).any())
    if top_p is not None:
        checks.append(((top_p <= 0) | (top_p > 1) | torch.isnan(top_p)).any())
    bad = torch.stack(checks).tolist()
    if bad[0]:
        raise VerifyInputError(
            f"{prefix}temperature: must be finite (and below 3.4e38, the float32 range), got {temperature.tolist()}"
        )
    if bad[1]:
        raise VerifyInputError(f"{prefix}temperature: must be >= 0 (0 = greedy), got min {temperature.min().item()}")
    i = 2
    if top_k is not None:
        if bad[i]:
            raise VerifyInputError(f"{prefix}top_k: must be >= 0 (0 = off), got min {top_k.min().item()}")
        i += 1
    if top_p is not None and bad[i]:
        raise VerifyInputError(f"{prefix}top_p: must lie in (0, 1] (1 = off), got {top_p.tolist()}")


def _shape(x: object) -> object:
    return list(x.shape) if isinstance(x, Tensor) else type(x).__name__


def _apply_top_k_top_p(x: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> None:
    """Mask (in place, with -inf) the scaled logits ``x`` [N, V] outside top-k / top-p (vLLM rules)."""
    vocab = x.shape[1]
    k_on = None
    if top_k is not None:
        k_on = (top_k > 0) & (top_k < vocab)
    p_on = None
    if top_p is not None:
        p_on = top_p < 1.0
    need_sort = p_on is not None and bool(p_on.any())
    if need_sort:
        rows = p_on if k_on is None else (p_on | k_on)
        idx = rows.nonzero().squeeze(1)
        xs = x.index_select(0, idx)
        sorted_x, order = xs.sort(dim=-1, descending=False)
        if k_on is not None:
            k = torch.where(k_on, top_k, vocab)[idx].long()
            thr = sorted_x.gather(1, (vocab - k).unsqueeze(1))
            sorted_x.masked_fill_(sorted_x < thr, float("-inf"))
        cum = sorted_x.softmax(dim=-1).cumsum_(dim=-1)
        drop = cum <= (1.0 - top_p[idx].float()).unsqueeze(1)
        drop[:, -1] = False
        sorted_x.masked_fill_(drop, float("-inf"))
        xs = torch.empty_like(xs).scatter_(1, order, sorted_x)
        x.index_copy_(0, idx, xs)
    elif k_on is not None and bool(k_on.any()):
        idx = k_on.nonzero().squeeze(1)
        k = top_k[idx].long()
        xs = x.index_select(0, idx)
        kmax = int(k.max())
        vals = xs.topk(kmax, dim=-1, sorted=True).values
        thr = vals.gather(1, (k - 1).unsqueeze(1))
        xs.masked_fill_(xs < thr, float("-inf"))
        x.index_copy_(0, idx, xs)


def apply_sampling(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    *,
    validate: bool = True,
) -> Tensor:
    """Temperature + top-k + top-p, then softmax: logits -> sampling distribution (vLLM semantics).

    Used for the drafter's ``q`` and (inside the verifier) the target's ``p``, so both sides process
    logits identically. Not differentiable: ``logits`` is detached (the result never requires grad).

    Args:
        logits: ``[N, V]`` float, any float dtype (computed in float32: float64 is rounded to float32
            first, so a greedy row's argmax is the float32 argmax, as in the verifier). Not modified; may
            require grad.
        temperature: ``[N]`` float, ``>= 0``; rows with ``0`` become a one-hot on ``argmax(logits)``;
            values in ``(0, 1e-2)`` are raised to ``1e-2`` with a warning (vLLM's rule, see
            :func:`effective_temperature`).
        top_k: ``[N]`` integer or ``None``; ``0`` / ``>= V`` = off.
        top_p: ``[N]`` float in ``(0, 1]`` or ``None``; ``1`` = off.
        validate: check parameter values (one host sync); shapes are always checked.

    Returns:
        ``[N, V]`` float32 probabilities; each row sums to 1.

    Raises:
        VerifyInputError (a ``ValueError``): bad shapes, ``temperature < 0`` or non-finite,
            ``top_k < 0``, ``top_p`` outside (0, 1], naming the argument.
    """
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise VerifyInputError(f"logits: expected a 2-D float tensor [N, V], got {_shape(logits)}")
    _validate_params(temperature, top_k, top_p, logits.shape[0], values=validate)
    temperature = effective_temperature(temperature, warn=validate, stacklevel=2)
    return _sampling_probs(logits.detach().to(COMPUTE_DTYPE), temperature, top_k, top_p, owned=False)


def _sampling_probs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor | None,
    top_p: Tensor | None,
    *,
    owned: bool,
    out: Tensor | None = None,
) -> Tensor:
    """:func:`apply_sampling` on float32 ``logits`` that do not require grad.

    ``owned=True`` lets it scale / mask ``logits`` in place; ``out`` (``[N, V]`` float32, not aliasing
    ``logits``) receives the probabilities. ``temperature`` goes through :func:`effective_temperature`
    here too (no warning, no sync), so every path applies the same clamped temperature.
    """
    n_rows, vocab = logits.shape
    temperature = effective_temperature(temperature.to(logits.device), warn=False)
    greedy = temperature == 0
    n_greedy = int(greedy.sum()) if n_rows else 0
    if n_greedy == n_rows:
        out = torch.zeros_like(logits) if out is None else out.zero_()
        if n_rows:
            out.scatter_(1, first_argmax(logits).unsqueeze(1), 1.0)
        return out
    greedy_rows = greedy_argmax = None
    if n_greedy:
        greedy_rows = greedy.nonzero().squeeze(1)
        greedy_argmax = first_argmax(logits.index_select(0, greedy_rows)).unsqueeze(1)
    scale = torch.where(greedy, 1.0, temperature)
    has_filter = top_k is not None or top_p is not None
    if bool((scale == 1.0).all()):  # x / 1 == x exactly: skip the pass
        x = logits if owned or not has_filter else logits.clone()
    elif owned:
        x = logits.div_(scale.unsqueeze(1))
    else:
        x = logits / scale.unsqueeze(1)
    if has_filter:
        tk = None if top_k is None else torch.where(greedy, 0, top_k.to(x.device))
        tp = None if top_p is None else torch.where(greedy, 1.0, top_p.to(x.device, torch.float32))
        _apply_top_k_top_p(x, tk, tp)
    probs = torch.softmax(x, dim=-1) if out is None else torch.softmax(x, dim=-1, out=out)
    del x
    if n_greedy:
        one_hot = torch.zeros(greedy_rows.numel(), vocab, dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(1, greedy_argmax, 1.0)
        probs.index_copy_(0, greedy_rows, one_hot)
    return probs
