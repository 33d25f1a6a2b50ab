"""Fitting a calibration (step 2 of :mod:`speculators.calibration`): per-position temperatures (STS)
and shifts (Platt scaling), fitted left to right by maximum likelihood on the steps that survived to
the position; one-dimensional searches only (no scipy).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import SpeculatorsError
from .ece import bernoulli_nll
from .record import ConfidenceRecord

T_BOUNDS = (0.05, 20.0)
B_BOUND = 20.0  # |b_k| limit: a position whose every outcome agrees runs to it (sigmoid(20) ~ 1 - 2e-9)
METHOD_PLATT = "temperature and shift per position (Platt scaling, fitted left to right)"
METHOD_STS = "temperature per position (STS, fitted left to right)"


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    """Golden-section minimum of a unimodal ``f`` on ``[lo, hi]``."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2.0


def _best_shift(x: torch.Tensor, y: torch.Tensor, start: float = 0.0, bound: float = B_BOUND) -> float:
    """The shift ``b`` in ``[-bound, bound]`` that minimises the Bernoulli NLL of ``sigmoid(x + b)``
    against 0/1 ``y`` (one-dimensional and convex: safeguarded Newton steps on the score
    ``sum(sigmoid(x + b) - y)``; all-0 or all-1 ``y`` run to the bound)."""
    lo, hi, b = -bound, bound, min(max(start, -bound), bound)
    for _ in range(100):
        p = torch.sigmoid(x + b)
        g, h = float((p - y).sum()), float((p * (1.0 - p)).sum())
        if g > 0:  # the NLL rises with b here: the minimum is below b
            hi = b
        else:
            lo = b
        step = b - g / h if h > 1e-12 else None
        nb = step if step is not None and lo < step < hi else (lo + hi) / 2.0
        if abs(nb - b) < 1e-10 or hi - lo < 1e-10:
            return nb
        b = nb
    return b


def fit_calibration(record: ConfidenceRecord, initial: torch.Tensor | None = None,
                    initial_bias: torch.Tensor | None = None, bounds: tuple[float, float] = T_BOUNDS,
                    min_steps: int = 20, fit_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position temperatures and shifts, fitted left to right (module docstring, step 2).

    Position k's conditional confidence ``c_k = sigmoid(z_k / T_k + b_k)`` is fitted by maximum likelihood
    on the steps that drafted k and accepted drafts 1..k-1 (outcome: draft k accepted), with Platt's
    smoothed targets ``(n_pos + 1) / (n_pos + 2)`` for an accept and ``1 / (n_neg + 2)`` for a reject
    (Platt 1999: a position whose outcomes all agree gets a finite fit; negligible with many steps). With ``fit_bias``
    (Platt scaling per position) ``(T_k, b_k)`` minimise that NLL jointly: ``log T_k`` by a 41-point grid
    and golden-section refinement over ``bounds``, each candidate with its best ``b_k`` (a convex
    one-dimensional problem, :func:`_best_shift`); the pair is a logistic regression of the outcome on
    ``z_k`` whose slope ``1 / T_k`` is kept in ``[1 / high, 1 / low]`` (a head whose logit does not rank
    acceptance gets ``T_k = high``: a nearly constant confidence at the observed rate; ``|b_k| <= 20``
    applies to the shift added AFTER the division by ``T_k``). Without it
    (temperature-only STS, ALGORITHMS.md) ``b_k = 0`` and only ``T_k`` is fitted.

    Args:
        record: the steps to fit on.
        initial, initial_bias: ``[B]`` current temperatures / shifts (B >= record.k; positions beyond
            ``record.k`` and positions judged on fewer than ``min_steps`` steps keep these); None = ones /
            zeros of the other's length (or ``record.k``).
        bounds: the search interval of each T (> 0).
        min_steps: the fewest steps (that drafted k and accepted drafts 1..k-1) position k is fitted on.
        fit_bias: fit the shifts too (False: every fitted position gets ``b_k = 0``).
    Returns:
        ``(T [B], b [B])`` float32 (new tensors).
    Raises:
        SpeculatorsError: ``initial`` / ``initial_bias`` shorter than ``record.k``, of different lengths, a
            temperature not positive or a shift not finite; bad ``bounds``.
    """
    lo, hi = float(bounds[0]), float(bounds[1])
    if not 0.0 < lo < hi:
        raise SpeculatorsError(f"fit_calibration: bounds must satisfy 0 < low < high, got {bounds!r}")
    K = record.k
    T = None if initial is None else initial.detach().double().cpu().reshape(-1).clone()
    bias = None if initial_bias is None else initial_bias.detach().double().cpu().reshape(-1).clone()
    width = T.numel() if T is not None else (bias.numel() if bias is not None else K)
    T = torch.ones(width, dtype=torch.float64) if T is None else T
    bias = torch.zeros(width, dtype=torch.float64) if bias is None else bias
    if T.numel() < K or not bool((T > 0).all()):
        raise SpeculatorsError(f"fit_calibration: initial temperatures must be {K} or more positive values, "
                               f"got {T.tolist()}")
    if bias.numel() != T.numel() or not bool(torch.isfinite(bias).all()):
        raise SpeculatorsError(f"fit_calibration: initial shifts must be {T.numel()} finite values (one per "
                               f"temperature), got {bias.tolist()}")
    z, n, a = record.logits.double(), record.drafted, record.accepted
    grid = torch.linspace(math.log(lo), math.log(hi), 41).tolist()
    for k in range(1, K + 1):  # left to right: position k is judged only on steps that survived to k - 1
        rows = (n >= k) & (a >= k - 1)
        if int(rows.sum()) < max(int(min_steps), 1):
            continue
        hit = a[rows] >= k
        # Platt's smoothed targets: (n_pos + 1) / (n_pos + 2) and 1 / (n_neg + 2) instead of 1 and 0, so a
        # position whose few outcomes all agree (or that its logit separates) gets a finite fit, not
        # c_k -> 0 or 1 (which would make the gate cut it, and every later position, at any threshold)
        n_pos = int(hit.sum())
        n_neg = int(hit.numel()) - n_pos
        zk = z[rows, k - 1]
        y = torch.where(hit, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0)).double()

        last = [0.0]  # warm start: neighbouring candidates of log T have nearby best shifts

        def shift(u: float) -> float:
            if not fit_bias:
                return 0.0
            last[0] = _best_shift(zk / math.exp(u), y, last[0])
            return last[0]

        def loss(u: float) -> float:
            return bernoulli_nll(torch.sigmoid(zk / math.exp(u) + shift(u)), y)

        best = min(range(len(grid)), key=lambda i: loss(grid[i]))
        u = _golden_min(loss, grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)])
        T[k - 1], bias[k - 1] = math.exp(u), shift(u)
    return T.float(), bias.float()


def fit_temperatures(record: ConfidenceRecord, initial: torch.Tensor | None = None,
                     bounds: tuple[float, float] = T_BOUNDS, min_steps: int = 20) -> torch.Tensor:
    """Per-position temperatures alone (STS as ALGORITHMS.md states it: :func:`fit_calibration` with
    ``fit_bias=False``), ``[B]`` float32; the arguments and errors are :func:`fit_calibration`'s."""
    return fit_calibration(record, initial, None, bounds, min_steps, fit_bias=False)[0]
