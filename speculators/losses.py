"""Training losses, the one chained-acceptance metric, and draft sampling, shared by every family.

Losses (each returns the SUM over its valid positions; the caller divides by its term's count, so the
trainer can normalise every term by its count over a whole gradient-accumulation window, see
:meth:`speculators.drafters.base.Drafter.loss` and :func:`combine_terms`):

* divergences to the target's distribution (forward KL = soft cross-entropy, TV, JSD, ...) live in
  :mod:`speculators.divergences` (``train.loss``);
* :func:`hard_cross_entropy`: CE to one label id (Medusa-1, MTP);
* :func:`smooth_l1_feature_loss`: EAGLE-1's feature regression (smooth L1, beta 1, averaged over the
  hidden dimension of a position, as SafeAILab/EAGLE ``eagle/train/main.py`` does).

Acceptance metrics (:func:`chained_acceptance`), ONE definition for every family. A training row
simulates, at every chain start ``t``, a chain of greedy drafts: step ``j`` (0-based) drafts the
``(j+1)``-th token after the chain's context. Per step the family gives

* ``correct_j[t]``: the step's top-1 draft, in TARGET-vocabulary ids, equals the target's greedy token
  at that position (``Batch.argmax``). A target token outside a reduced draft vocabulary can never be
  drafted, so it counts as a miss (greedy verification would reject the draft there too);
* ``labelled_j[t]``: the token the step drafts is a real assistant token inside the sequence
  (``loss_mask & attention_mask`` at that index).

Then, with ``full_j = correct_0 & ... & correct_j`` (greedy acceptance of drafts 0..j) and
``live_j = labelled_0 & ... & labelled_j`` (every token the chain drafted up to step j is assistant text:
the only chains that exist at inference, where drafting starts after the prompt):

* ``full_acc_j = |full_j & live_j| / |live_j|``: P(drafts 0..j all accepted);
* ``cond_acc_j = |full_j & live_j| / |full_{j-1} & live_j|``: P(draft j accepted | drafts 0..j-1 were),
  ``cond_acc_0 = full_acc_0``;
* ``sim_tau = 1 + sum_j full_acc_j``: the simulated greedy acceptance length (bonus token included).

The DENOMINATOR of ``full_acc_j`` is therefore the number of chain starts whose drafted tokens 0..j
are all labelled, whatever the draft vocabulary: the same column means the same thing for every
family. A LOSS may still skip positions whose label lies outside the draft vocabulary (it cannot be
learned), which is why losses and metrics take different masks.

Draft sampling (:func:`sample_draft`): drafter logits -> draft token(s) under the request's
:class:`speculators.verify.SamplingParams` (greedy argmax at temperature 0; otherwise
:func:`speculators.verify.apply_sampling`, the same transform the verifier applies to the target's
logits, then ``torch.multinomial`` with the request's generator), returning target-vocabulary ids and
full-vocabulary ``q`` rows for the verifier. :func:`draft_to_target` / :func:`target_to_draft` map
between draft-vocabulary indices and target ids (vLLM's ``d2t`` / ``t2d`` convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import SpeculatorsError
from .verify import SamplingParams, apply_sampling

__all__ = [
    "chained_acceptance",
    "draft_to_target",
    "hard_cross_entropy",
    "sample_draft",
    "sampling_values",
    "smooth_l1_feature_loss",
    "target_to_draft",
]


# ----------------------------------------------------------------------------- losses


def _masked_sum(per_position: Tensor, valid: Tensor | None) -> Tensor:
    """Sum of ``per_position [...]`` over ``valid [...]`` (all when None), with ``torch.where`` so that a
    NaN/inf value at an invalid position does not enter the sum."""
    if valid is None:
        return per_position.sum()
    if valid.shape != per_position.shape:
        raise SpeculatorsError(f"valid mask: shape {tuple(valid.shape)} does not match the positions "
                               f"{tuple(per_position.shape)}")
    return torch.where(valid, per_position, per_position.new_zeros(())).sum()


def combine_terms(sums: list[Tensor], weights: list[float], counts: Tensor, norm: Tensor | None,
                  scale: float = 1.0, where: str = "loss") -> tuple[Tensor, float]:
    """A family's training loss from its per-term sums: ``scale * sum_i weights[i] * sums[i] / max(den[i], 1)``
    with ``den = norm`` (the counts of a whole gradient-accumulation window, all micro-batches and processes)
    or ``counts`` (this batch's own, the default), so that summed micro-batch gradients equal the window's.

    Args:
        sums: ``n_terms`` scalar tensors, each a SUM over its term's valid positions (the losses above).
        weights: ``n_terms`` floats (e.g. EAGLE-3's ``ttt_decay ** j``).
        counts: ``[n_terms]`` int64, this batch's valid positions per term (``Drafter.loss_counts``).
        norm: ``[n_terms]`` window counts, or None.
        scale: a factor on the whole loss (MTP's ``lambda / D``).
        where: who asks, for the error (the family's name).
    Returns:
        ``(loss, own)``: the scalar loss (differentiable) and the same value with every term divided by this
        batch's OWN counts (a float; what a training unit reports as ``drafter_loss``).
    Raises:
        SpeculatorsError: ``norm`` does not have one entry per term.
    """
    own_den = counts.clamp(min=1)
    if norm is None:
        den = own_den
    else:
        norm = torch.as_tensor(norm).to(counts.device)
        if norm.shape != counts.shape:
            raise SpeculatorsError(f"{where} loss: norm has shape {tuple(norm.shape)}, expected "
                                   f"{tuple(counts.shape)} (one count per loss term, see loss_counts)")
        den = norm.clamp(min=1)
    total = sums[0].new_zeros(())
    own = 0.0
    for i, (s, w) in enumerate(zip(sums, weights)):
        total = total + w * (s / den[i])
        own += w * float(s.detach()) / float(own_den[i])
    return scale * total, scale * own


def hard_cross_entropy(logits: Tensor, labels: Tensor, valid: Tensor | None = None) -> Tensor:
    """Cross entropy to one label index per position, summed over the valid positions.

    Args:
        logits: ``[..., N]`` float logits (computed in float32).
        labels: ``[...]`` int64 indices into the last dim of ``logits``; only valid positions are read
            (others may hold anything, e.g. a token outside the draft vocabulary).
        valid: ``[...]`` bool positions to sum over; ``None`` = all.
    Returns:
        scalar float32 SUM.
    Raises:
        SpeculatorsError: shapes that do not match, or a valid label outside ``[0, N)``.
    """
    if labels.shape != logits.shape[:-1]:
        raise SpeculatorsError(f"hard_cross_entropy: labels {tuple(labels.shape)} must be logits' "
                               f"{tuple(logits.shape)} without the last dim")
    N = logits.shape[-1]
    lbl = labels if valid is None else torch.where(valid, labels, torch.zeros_like(labels))
    if lbl.numel() and (int(lbl.min()) < 0 or int(lbl.max()) >= N):
        raise SpeculatorsError(f"hard_cross_entropy: labels must lie in [0, {N}) at valid positions, "
                               f"got {int(lbl.min())}..{int(lbl.max())}")
    nll = -torch.log_softmax(logits.float(), dim=-1).gather(-1, lbl.unsqueeze(-1)).squeeze(-1)
    return _masked_sum(nll, valid)


def smooth_l1_feature_loss(pred: Tensor, target: Tensor, valid: Tensor | None = None,
                           beta: float = 1.0) -> Tensor:
    """EAGLE-1's feature loss: smooth L1 (``beta``) averaged over the hidden dim, summed over positions.

    Follows SafeAILab/EAGLE ``eagle/train/main.py`` (``SmoothL1Loss(reduction="none")`` then the mean
    over the hidden dimension of each position).

    Args:
        pred, target: ``[..., H]`` float features (computed in float32).
        valid: ``[...]`` bool positions to sum over; ``None`` = all.
        beta: transition point of the smooth L1 (> 0).
    Returns:
        scalar float32 SUM over positions of the per-position mean.
    Raises:
        SpeculatorsError: shapes that do not match.
    """
    if pred.shape != target.shape:
        raise SpeculatorsError(f"smooth_l1_feature_loss: pred {tuple(pred.shape)} and target "
                               f"{tuple(target.shape)} must have the same shape")
    err = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta).mean(-1)
    return _masked_sum(err, valid)


# ----------------------------------------------------------------------------- acceptance metrics


def chained_acceptance(correct: list[Tensor], labelled: list[Tensor]) -> dict[str, float]:
    """``full_acc_j``, ``cond_acc_j`` and ``sim_tau`` of simulated greedy draft chains (module docstring).

    Index ``t`` of every step is the same chain start. Step ``j``'s tensors may be SHORTER along the
    last dim than step ``j-1``'s (a family that only computes chain starts with a token ``j`` steps
    ahead inside the sequence, e.g. Medusa): the common prefix is aligned, and ``full_{j-1}`` /
    ``live_{j-1}`` are cut to step ``j``'s width.

    Args:
        correct: per step j, ``[B, T_j]`` bool: the top-1 draft (target-vocabulary id) equals the
            target's greedy token. A greedy token outside the draft vocabulary must be False (a miss).
        labelled: per step j, ``[B, T_j]`` bool: the token step j drafts is a real assistant token.
    Returns:
        ``{"full_acc_j", "cond_acc_j"}`` for every step and ``"sim_tau"`` (floats; a ratio with a zero
        denominator is 0.0).
    Raises:
        SpeculatorsError: lists of different lengths, a step whose two masks differ in shape, or a
            step wider than the one before.
    """
    if len(correct) != len(labelled):
        raise SpeculatorsError(f"chained_acceptance: {len(correct)} correctness masks but "
                               f"{len(labelled)} label masks (one of each per step)")
    metrics: dict[str, float] = {}
    sim_tau = 1.0
    full = live = None
    for j, (c, lab) in enumerate(zip(correct, labelled)):
        if c.shape != lab.shape:
            raise SpeculatorsError(f"chained_acceptance: step {j}: correct {tuple(c.shape)} and labelled "
                                   f"{tuple(lab.shape)} differ")
        c, lab = c.bool(), lab.bool()
        if full is None:
            prev_full = torch.ones_like(c)
            new_full, new_live = c, lab
        else:
            w = c.shape[-1]
            if w > full.shape[-1]:
                raise SpeculatorsError(f"chained_acceptance: step {j} has {w} chain starts, more than step "
                                       f"{j - 1}'s {full.shape[-1]}")
            prev_full = full[..., :w]
            new_full, new_live = prev_full & c, live[..., :w] & lab
        hits = (new_full & new_live).sum()
        den_full = new_live.sum()
        den_cond = (prev_full & new_live).sum()
        full_acc = float(hits / den_full) if int(den_full) else 0.0
        metrics[f"full_acc_{j}"] = full_acc
        metrics[f"cond_acc_{j}"] = float(hits / den_cond) if int(den_cond) else 0.0
        sim_tau += full_acc
        full, live = new_full, new_live
    metrics["sim_tau"] = sim_tau
    return metrics


# ----------------------------------------------------------------------------- draft vocabulary


def draft_to_target(draft_idx: Tensor, d2t: Tensor | None) -> Tensor:
    """Draft-vocabulary indices -> target-vocabulary ids: ``target = i + d2t[i]`` (vLLM's ``d2t``).

    Args:
        draft_idx: int64 indices into the draft vocabulary, any shape.
        d2t: ``[N]`` int64 offsets, or ``None`` for a full-vocabulary drafter (identity).
    Returns:
        int64 target ids, same shape and device as ``draft_idx``.
    """
    if d2t is None:
        return draft_idx.to(torch.int64)
    idx = draft_idx.to(device=d2t.device, dtype=torch.int64)
    return (idx + d2t[idx]).to(draft_idx.device)


def target_to_draft(target_ids: Tensor, t2d: Tensor) -> tuple[Tensor, Tensor]:
    """Target-vocabulary ids -> draft-vocabulary indices (vLLM's ``t2d`` mask).

    Args:
        target_ids: int64 target ids, any shape.
        t2d: ``[V]`` bool, True for the target ids in the draft vocabulary (sorted by id, as
            :class:`speculators.data.vocab.DraftVocab` builds it).
    Returns:
        ``(draft_idx, in_vocab)``, both shaped like ``target_ids`` on its device: ``draft_idx`` int64 is
        the draft index of the id where ``in_vocab`` (bool) is True, and an arbitrary valid index in
        ``[0, N)`` elsewhere (mask those positions out).
    """
    ids = target_ids.to(device=t2d.device, dtype=torch.int64)
    rank = torch.cumsum(t2d.to(torch.int64), 0) - 1  # [V]: draft index of each in-vocab target id
    return rank[ids].clamp(min=0).to(target_ids.device), t2d[ids].to(target_ids.device)


# ----------------------------------------------------------------------------- draft sampling


def _check_request(sampling: SamplingParams | None) -> None:
    if sampling is None:
        return
    if not isinstance(sampling, SamplingParams):
        raise SpeculatorsError(f"sampling: expected speculators.verify.SamplingParams (one request) or None, "
                               f"got {type(sampling).__name__}")
    sampling.validate(1)  # VerifyInputError (a SpeculatorsError) naming the field


def sampling_values(sampling: SamplingParams | None) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` of ONE request as Python numbers (for reports and logs).

    ``None`` = greedy ``(0.0, 0, 1.0)``; an unset ``top_k`` / ``top_p`` reads as ``0`` / ``1.0`` (off).
    The temperature is the effective one (:func:`speculators.verify.effective_temperature`).

    Raises:
        SpeculatorsError: not a batch-of-one ``SamplingParams``, or invalid values (naming the field).
    """
    _check_request(sampling)
    if sampling is None:
        return 0.0, 0, 1.0

    def as_float(t: Tensor) -> float:  # the shortest decimal that reads back as this float32 (0.7, not 0.69999999)
        return float(str(t.reshape(-1)[0].detach().cpu().to(torch.float32).numpy()))

    tk = 0 if sampling.top_k is None else int(sampling.top_k.reshape(-1)[0])
    tp = 1.0 if sampling.top_p is None else as_float(sampling.top_p)
    return as_float(sampling.temperature), tk, tp


def sample_draft(logits: Tensor, sampling: SamplingParams | None, generator: torch.Generator | None = None,
                 *, d2t: Tensor | None = None, vocab_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Draft token(s) from drafter logits under the request's sampling settings.

    Greedy (``sampling`` None or temperature 0): the argmax of each row (float32, ties -> lowest index),
    no probabilities (the verifier treats the drafts as point masses). Otherwise each row is turned
    into ``q = apply_sampling(logits, temperature, top_k, top_p)`` (the same temperature / top-k /
    top-p transform the verifier applies to the target's logits, vLLM semantics) and one token per row
    is drawn with ``torch.multinomial(q, 1, generator=...)`` (one call for all rows).

    The generator is ``generator`` when given, else the request's own ``sampling.generators[0]``, else
    torch's global RNG. Sampling runs on the generator's device.

    Args:
        logits: ``[R, N]`` (or ``[N]``, one row) float logits over the draft vocabulary (N = V for a
            full-vocabulary drafter).
        sampling: :class:`speculators.verify.SamplingParams` of ONE request, or ``None`` (greedy).
        generator: ``torch.Generator`` for the draw (see above).
        d2t: ``[N]`` int64 draft->target offsets; ``None`` = full vocabulary (ids unchanged).
        vocab_size: V, the width of the returned ``q`` rows; required with ``d2t`` (default N).
    Returns:
        ``(ids, probs)``: ``ids [R]`` int64 TARGET-vocabulary ids on the CPU; ``probs [R, V]`` float32 on
        the CPU (zero outside the draft vocabulary, rows sum to 1), or ``None`` when greedy.
    Raises:
        SpeculatorsError: ``sampling`` not a batch-of-one ``SamplingParams`` or with invalid values,
            logits not 1-D/2-D, or ``d2t`` without ``vocab_size``.
    """
    _check_request(sampling)
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if logits.dim() != 2:
        raise SpeculatorsError(f"sample_draft: logits must be [R, N] or [N], got shape {tuple(logits.shape)}")
    R, N = logits.shape
    if d2t is not None and vocab_size is None:
        raise SpeculatorsError("sample_draft: vocab_size (the target vocabulary V) is required with d2t")
    V = N if vocab_size is None else int(vocab_size)
    greedy = sampling is None or float(sampling.temperature.reshape(-1)[0]) == 0.0
    if greedy:
        idx = logits.float().argmax(-1)
        return draft_to_target(idx, d2t).cpu(), None
    dev = logits.device
    temp = sampling.temperature.to(dev).reshape(1).expand(R)
    top_k = None if sampling.top_k is None else sampling.top_k.to(dev).reshape(1).expand(R)
    top_p = None if sampling.top_p is None else sampling.top_p.to(dev).reshape(1).expand(R)
    q = apply_sampling(logits, temp, top_k, top_p, validate=False)  # [R, N] float32
    if generator is None and sampling.generators:
        generator = sampling.generators[0]
    if generator is not None:
        q = q.to(generator.device)
    idx = torch.multinomial(q, 1, generator=generator).reshape(-1)
    q = q.cpu()
    if d2t is None:
        probs = q
    else:
        probs = torch.zeros(R, V, dtype=torch.float32)
        probs[:, draft_to_target(torch.arange(N), d2t.cpu())] = q
    return draft_to_target(idx, d2t).cpu(), probs
