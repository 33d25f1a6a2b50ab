"""What a family's first drafting step hands the export gate (:mod:`speculators.export.parity`).

A family that the reference implementation (vllm-project/speculators) also implements in our export
layout overrides its serving format's
:meth:`speculators.drafters.serving_format.ServingFormat.reference_parity_step`: it runs OUR drafter's
first drafting step on one sequence and says how the reference must be driven to compute the same
step, as a :class:`ParityStep`. The helpers here build the inputs the reference's training-style
forward takes (its ``hidden_states`` / ``input_ids`` / ``loss_mask`` / ``document_ids`` /
``verifier_last_hidden_states`` batch) so that no family repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ParityStep:
    """One sequence's first drafting step.

    Attributes:
        ref_tensors: the reference forward's tensor inputs by name (``hidden_states [1, T, n_aux*H]``
            float32 tapped at the layers the CHECKPOINT's config names, ``input_ids [1, T]`` int64, ...).
        ref_kwargs: plain keyword arguments of that forward (e.g. ``ttt_steps``, ``max_anchors``).
        pin: choices the reference would draw at random, fixed to ours (anchor positions, depths, the
            logit rows to return).
        outputs: OUR float32 outputs by name (``logits [rows, N]``; DSpark ``confidence_logits [B]``);
            the reference worker returns the same names.
    """

    ref_tensors: dict[str, torch.Tensor]
    ref_kwargs: dict[str, Any] = field(default_factory=dict)
    pin: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_batch(aux: torch.Tensor, input_ids: torch.Tensor, hidden_size: int,
                    loss_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The reference's batch for one sequence of ``T`` positions: ``hidden_states = aux [1, T, n*H]``,
    ``input_ids [1, T]`` int64, ``loss_mask`` (ones unless given), ``document_ids`` (zeros: one document)
    and ``verifier_last_hidden_states`` (zeros ``[1, T, H]``: unused by a first drafting step)."""
    T = int(input_ids.shape[-1])
    return {"hidden_states": aux, "input_ids": input_ids.reshape(1, T).long(),
            "document_ids": torch.zeros(1, T, dtype=torch.long),
            "loss_mask": torch.ones(1, T, dtype=torch.long) if loss_mask is None else loss_mask,
            "verifier_last_hidden_states": torch.zeros(1, T, hidden_size)}


def block_reference_inputs(block_size: int, ids: list[int], feats_ref, block_tokens: list[int]) -> dict[str, torch.Tensor]:
    """Reference inputs of one anchored block (DFlash / DSpark) at ``a = len(ids) - 1``: context features
    ``aux[:a]`` (positions ``a..a+B-1`` zero: the block must not read them) and ``input_ids = ids +
    block_tokens`` (``B - 1`` tokens after the anchor). ``feats_ref``: the target's features of ``ids``
    (``aux [1, >= a, n*H]``, ``top [1, *, H]``)."""
    a = len(ids) - 1
    T = a + block_size
    aux = torch.zeros(1, T, feats_ref.aux.shape[-1])
    aux[:, :a] = feats_ref.aux[:, :a]
    full = torch.tensor(list(ids) + list(block_tokens), dtype=torch.long)
    return reference_batch(aux, full, feats_ref.top.shape[-1])


def reference_anchor_pin(a: int, metrics_module: str, confidence_arg: int | None = None) -> dict[str, Any]:
    """A block family's ``ParityStep.pin``: the reference's random anchor choice (``select_anchors`` of its
    DFlash core, which DSpark shares) pinned to the one anchor ``a``, and where its logits are captured
    (``metrics_module``; ``confidence_arg``: the positional index of confidence logits)."""
    choice = [{"values": [a], "dtype": "int64"}, {"values": [True], "dtype": "bool"}]
    return {"metrics_module": metrics_module, "confidence_arg": confidence_arg,
            "patches": [{"module": "speculators.models.dflash.core", "attr": "select_anchors", "returns": choice}]}
