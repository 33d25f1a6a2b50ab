"""Each family's first drafting step, on our side and as inputs for the reference's (parity gate).

A step function ``step(drafter, config, ids, feats_ours, feats_ref) -> Step`` runs OUR drafter's first
drafting step through its inference API (``start`` / ``propose``: what ``speculators eval`` runs) and
says how the reference (:mod:`.reference_worker`) must be driven to compute the same step:

* ``ids``: one sequence ``[T]`` of token ids; ``feats_ours`` / ``feats_ref``: the target's features of
  all ``T`` positions (``aux [1, T, n_aux*H]`` float32) tapped at our drafter's layers and at the
  layers the checkpoint's config names.
* ``Step.outputs``: our float32 outputs by name (``logits [rows, N]``, DSpark ``confidence_logits``);
  the worker returns the same names.

Conventions (checked by the gate itself, since the reference is driven with its own defaults):
EAGLE-3 index t pairs ``g[t]`` with token ``x_{t+1}`` at position ``t + 1`` (the reference's default
position ids); DFlash/DSpark context is strictly before the anchor, the block starts at the anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import SpeculatorsError


@dataclass
class Step:
    """One sequence's first drafting step: reference inputs (tensors + plain kwargs + pinned choices)
    and our outputs."""

    ref_tensors: dict[str, torch.Tensor]
    ref_kwargs: dict[str, Any] = field(default_factory=dict)
    pin: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


def config_aux_ids(config: dict[str, Any], family: str) -> list[int]:
    """The aux layer ids (vLLM convention) a checkpoint's ``config.json`` names for ``family``."""
    key = "eagle_aux_hidden_state_layer_ids" if family in ("eagle3", "peagle") else "aux_hidden_state_layer_ids"
    ids = config.get(key)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SpeculatorsError(f"config.json `{key}`: {ids!r} is not a list of layer ids")
    return list(ids)


def _slice(feats, end: int):
    return feats.slice(0, end)


def eagle3_step(drafter, config, ids, feats_ours, feats_ref) -> Step:
    """EAGLE-3 TTT step 0 at every position: the first draft's logits after each prefix.

    Ours: ``start(ids[:n+1], features[:n])`` for n = 1..T-1 (each is a request whose first draft is
    computed from ``last_logits``); rows ``[T-1, N]``. Reference: one forward with ``ttt_steps=1`` over
    ``hidden_states = aux[:T-1]``, ``input_ids = ids[1:]`` (its default position ids ``1..T-1``).
    """
    T = len(ids)
    if T < 2:
        raise SpeculatorsError("parity: an EAGLE-3 sequence needs at least 2 tokens")
    t = torch.tensor(ids, dtype=torch.long)
    rows = []
    for n in range(1, T):
        st = drafter.start(t[:n + 1], _slice(feats_ours, n))
        rows.append(st.last_logits.float().reshape(-1))
    H = feats_ref.top.shape[-1]
    ref = {"hidden_states": feats_ref.aux[:, :T - 1].contiguous(), "input_ids": t[1:].unsqueeze(0),
           "document_ids": torch.zeros(1, T - 1, dtype=torch.long),
           "loss_mask": torch.ones(1, T - 1, dtype=torch.long),
           "verifier_last_hidden_states": torch.zeros(1, T - 1, H)}
    return Step(ref, {"ttt_steps": 1}, {}, {"logits": torch.stack(rows)})


#: ``speculators_model_type`` -> step function.
FAMILIES = {"eagle3": eagle3_step}
