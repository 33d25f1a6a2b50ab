"""Distillation divergences between a drafter's distribution q and the target's p, and their weighted mix
(``train.loss``).

Per position, with ``q = softmax(drafter logits)`` and ``p`` the target's probabilities over the same (draft)
vocabulary (a reduced draft vocabulary renormalises the target's distribution on it, as every family's teacher
does: ``FrozenTarget.teacher_logits(h, rows)``; the mass outside it is not trained, as in vllm-project/speculators):

* ``forward_kl``: ``-sum_v p log q``, the soft cross-entropy (KL(p || q) plus the teacher's entropy, which has no
  gradient), today's default (EAGLE-1/-3, Medusa / MTP / MLP speculator self-distillation);
* ``ce``: ``-log q[argmax p]``, hard cross-entropy to the target's top token (vllm-project/speculators' ``ce``;
  DFlash's default there);
* ``reverse_kl``: ``KL(q || p) = sum_v q (log q - log p)`` (mode-seeking);
* ``jsd``: the generalised Jensen-Shannon divergence ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p +
  (1 - beta) q`` (``train.jsd_beta``, default 0.5: the symmetric JSD of vllm-project/speculators, bounded by log 2;
  beta -> 0 approaches forward KL scaled, beta -> 1 reverse KL scaled, as in GKD, Agarwal et al. arXiv 2306.13649);
* ``tv``: ``0.5 sum_v |p - q| = 1 - alpha`` with ``alpha = sum_v min(p, q)``, the acceptance probability of one
  draft sampled from q against p at temperature 1 (Leviathan et al. arXiv 2211.17192; DistillSpec arXiv 2310.08461);
* ``nla``: ``-log max(alpha, 1e-5)``, the negative log-acceptance (LK losses, Samarin et al. arXiv 2602.23881; with a
  one-hot p it is hard cross-entropy);
* ``lk_hybrid``: ``lambda KL(p || q) + (1 - lambda) TV``, ``lambda = exp(-eta * alpha)`` with alpha not
  differentiated (``train.lk_eta``, default 3.0): KL's strong gradient while acceptance is low, TV's direct one when
  it is high (the same paper; vllm-project/speculators' ``lk_hybrid``).

All are computed in float32 from logits (``log_softmax``); ``log p`` is taken of ``p`` clamped at the smallest
normal float32 (a target probability that underflowed to 0 costs at most ~87 nats per unit of q there). A padded
position's teacher row may hold NaN: it is zeroed before use, so it enters neither the sum nor the gradient.

:class:`LossMix` is ``train.loss``: one name, or ``{name: weight}``; :meth:`LossMix.sum` returns the SUM over the
valid positions of ``sum_i w_i * divergence_i``, so every family's per-term normalisation (window counts,
TTT-step weights) stays as it is.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .errors import SpeculatorsError

TINY = torch.finfo(torch.float32).tiny
NLA_EPS = 1e-5


def _prep(logits: Tensor, teacher_probs: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if logits.shape != teacher_probs.shape:
        raise SpeculatorsError(f"divergence: logits {tuple(logits.shape)} and teacher_probs "
                               f"{tuple(teacher_probs.shape)} must have the same shape")
    p = teacher_probs.float()
    if valid is not None and valid.shape == p.shape[:-1]:  # a padded teacher row (NaN) stays out of the grad
        p = torch.where(valid.unsqueeze(-1), p, p.new_zeros(()))
    logq = torch.log_softmax(logits.float(), dim=-1)
    return p, logq, logq.exp()


def forward_kl(p: Tensor, logq: Tensor, q: Tensor, **_) -> Tensor:
    """``-sum_v p log q`` per position (soft cross-entropy; KL(p || q) + H(p))."""
    return -(p * logq).sum(-1)


def ce(p: Tensor, logq: Tensor, q: Tensor, **_) -> Tensor:
    """``-log q[argmax p]`` per position (ties: the lowest index)."""
    return -logq.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)


def reverse_kl(p: Tensor, logq: Tensor, q: Tensor, **_) -> Tensor:
    """``sum_v q (log q - log p)`` per position."""
    return (q * (logq - torch.log(p.clamp_min(TINY)))).sum(-1)


def jsd(p: Tensor, logq: Tensor, q: Tensor, beta: float = 0.5, **_) -> Tensor:
    """``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``, per position (0 where p = q)."""
    logp = torch.log(p.clamp_min(TINY))
    if beta <= 0.0 or beta >= 1.0:
        raise SpeculatorsError(f"train.jsd_beta: {beta} must lie strictly between 0 and 1")
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1.0 - beta))
    kl_pm = (p * (logp - logm)).sum(-1)
    kl_qm = (q * (logq - logm)).sum(-1)
    return beta * kl_pm + (1.0 - beta) * kl_qm


def acceptance(p: Tensor, q: Tensor) -> Tensor:
    """``alpha = sum_v min(p, q)`` per position: P(a draft sampled from q is accepted against p)."""
    return torch.minimum(p, q).sum(-1)


def tv(p: Tensor, logq: Tensor, q: Tensor, **_) -> Tensor:
    """Total variation ``0.5 sum_v |p - q|`` per position (= 1 - alpha)."""
    return 0.5 * (p - q).abs().sum(-1)


def nla(p: Tensor, logq: Tensor, q: Tensor, **_) -> Tensor:
    """Negative log-acceptance ``-log max(alpha, 1e-5)`` per position."""
    return -torch.log(acceptance(p, q).clamp_min(NLA_EPS))


def lk_hybrid(p: Tensor, logq: Tensor, q: Tensor, eta: float = 3.0, **_) -> Tensor:
    """``lambda KL(p || q) + (1 - lambda) TV`` with ``lambda = exp(-eta alpha)``, alpha not differentiated."""
    lam = torch.exp(-eta * acceptance(p, q).detach())
    kl = (p * (torch.log(p.clamp_min(TINY)) - logq)).sum(-1)
    return lam * kl + (1.0 - lam) * tv(p, logq, q)


DIVERGENCES: dict[str, Callable[..., Tensor]] = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd,
                                                 "tv": tv, "nla": nla, "lk_hybrid": lk_hybrid, "ce": ce}


def per_position(name: str, logits: Tensor, teacher_probs: Tensor, valid: Tensor | None = None, *,
                 jsd_beta: float = 0.5, lk_eta: float = 3.0) -> Tensor:
    """Divergence ``name`` of :data:`DIVERGENCES` at every position: ``[...]`` float32 (invalid positions hold
    values of a zeroed teacher row; mask them).

    Args:
        logits: ``[..., N]`` drafter logits. teacher_probs: ``[..., N]`` target probabilities (rows sum to 1).
        valid: ``[...]`` bool; rows outside it have their teacher zeroed first (a padded NaN row is harmless).
    Raises:
        SpeculatorsError: an unknown name, shapes that differ, or a ``jsd_beta`` outside (0, 1).
    """
    fn = DIVERGENCES.get(name)
    if fn is None:
        raise SpeculatorsError(f"train.loss: unknown divergence {name!r}; choose from {', '.join(DIVERGENCES)}")
    p, logq, q = _prep(logits, teacher_probs, valid)
    return fn(p, logq, q, beta=jsd_beta, eta=lk_eta)


def masked_sum(values: Tensor, valid: Tensor | None) -> Tensor:
    """``values [...]`` summed over ``valid [...]`` (all when None), NaN-safe."""
    if valid is None:
        return values.sum()
    if valid.shape != values.shape:
        raise SpeculatorsError(f"valid mask: shape {tuple(valid.shape)} does not match the positions "
                               f"{tuple(values.shape)}")
    return torch.where(valid, values, values.new_zeros(())).sum()


def dpace_weights(nll: Tensor, valid: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE per-position weights of a block's slots (vllm-project/speculators' ``dpace_loss_decay``, DFlash's
    default there): with the slot's confidence ``c_k = exp(-nll_k)`` (the draft's probability of its label),
    ``s_k = (1 - alpha) c_k + alpha`` on valid slots and 1 elsewhere, the prefix products ``P_j = prod_{i<=j} s_i``
    (how likely the chain still stands at slot j) and ``w_k = valid_k * sum_{j>=k} valid_j P_j``: a slot weighs
    as much as the expected acceptances it can still enable. Not differentiated; not normalised.

    Args:
        nll: ``[..., K]`` per-slot negative log-likelihood (any value on invalid slots). valid: ``[..., K]`` bool.
        alpha: smoothing in (0, 1] (``dpace_alpha``; 1 makes every weight the count of valid slots from k on).
    Returns:
        ``[..., K]`` float32 weights (0 on invalid slots).
    Raises:
        SpeculatorsError: ``alpha`` outside (0, 1] or shapes that differ.
    """
    if not 0.0 < alpha <= 1.0:
        raise SpeculatorsError(f"dpace_alpha: {alpha} must lie in (0, 1]")
    if nll.shape != valid.shape:
        raise SpeculatorsError(f"dpace_weights: nll {tuple(nll.shape)} and valid {tuple(valid.shape)} differ")
    with torch.no_grad():
        v = valid.float()
        c = torch.exp(-torch.where(valid, nll.float(), nll.new_zeros(()).float()))
        s = torch.where(valid, (1.0 - alpha) * c + alpha, torch.ones_like(c))
        reach = v * torch.cumprod(s, dim=-1)
        return v * torch.flip(torch.cumsum(torch.flip(reach, [-1]), -1), [-1])


class LossMix:
    """``train.loss``: weighted divergences to the target's distribution (module docstring).

    Args:
        terms: ``{name: weight}`` (weights > 0, not normalised: ``{"forward_kl": 0.1, "tv": 0.9}``).
        jsd_beta: ``jsd``'s beta in (0, 1). lk_eta: ``lk_hybrid``'s eta > 0.
    Raises:
        SpeculatorsError: no term, an unknown name, a weight <= 0, or a parameter out of range.
    """

    def __init__(self, terms: dict[str, float] | None = None, jsd_beta: float = 0.5, lk_eta: float = 3.0):
        terms = {"forward_kl": 1.0} if terms is None else dict(terms)
        unknown = [n for n in terms if n not in DIVERGENCES]
        if not terms or unknown or any(not (float(w) > 0) for w in terms.values()):
            raise SpeculatorsError(f"train.loss: {terms} must name one or more of {', '.join(DIVERGENCES)} with "
                                   f"weights > 0")
        if not 0.0 < jsd_beta < 1.0 or not lk_eta > 0:
            raise SpeculatorsError(f"train.jsd_beta {jsd_beta} must lie in (0, 1) and train.lk_eta {lk_eta} be > 0")
        self.terms = {n: float(w) for n, w in terms.items()}
        self.jsd_beta, self.lk_eta = float(jsd_beta), float(lk_eta)

    @property
    def is_default(self) -> bool:
        """True for plain forward KL (weight 1): what every family computed before ``train.loss`` existed."""
        return self.terms == {"forward_kl": 1.0}

    def __repr__(self) -> str:
        return f"LossMix({self.terms}, jsd_beta={self.jsd_beta}, lk_eta={self.lk_eta})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LossMix) and (self.terms, self.jsd_beta, self.lk_eta) == (
            other.terms, other.jsd_beta, other.lk_eta)

    def per_position(self, logits: Tensor, teacher_probs: Tensor, valid: Tensor | None = None) -> Tensor:
        """``sum_i w_i * divergence_i`` at every position, ``[...]`` float32."""
        p, logq, q = _prep(logits, teacher_probs, valid)
        out = None
        for name, w in self.terms.items():
            v = w * DIVERGENCES[name](p, logq, q, beta=self.jsd_beta, eta=self.lk_eta)
            out = v if out is None else out + v
        return out

    def sum(self, logits: Tensor, teacher_probs: Tensor, valid: Tensor | None = None) -> Tensor:
        """The mix summed over the valid positions: a scalar float32 SUM (divide by the term's count yourself).

        Raises:
            SpeculatorsError: shapes that do not match.
        """
        return masked_sum(self.per_position(logits, teacher_probs, valid), valid)


__all__ = ["DIVERGENCES", "LossMix", "acceptance", "ce", "dpace_weights", "forward_kl", "jsd", "lk_hybrid", "masked_sum", "nla",
           "per_position", "reverse_kl", "tv"]
