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


def _block_inputs(drafter, ids, feats_ref, block_tokens: list[int]) -> dict[str, torch.Tensor]:
    """Reference inputs for one anchored block at ``a = len(ids) - 1``: context features ``aux[:a]`` (positions
    ``a..a+B-1`` zero: the block must not read them), ``input_ids = ids + block_tokens`` (``B - 1`` tokens
    after the anchor)."""
    a, B = len(ids) - 1, drafter.block_size
    T = a + B
    aux = torch.zeros(1, T, feats_ref.aux.shape[-1])
    aux[:, :a] = feats_ref.aux[:, :a]
    full = list(ids) + list(block_tokens)
    return {"hidden_states": aux, "input_ids": torch.tensor([full], dtype=torch.long),
            "loss_mask": torch.ones(1, T, dtype=torch.long), "document_ids": torch.zeros(1, T, dtype=torch.long),
            "verifier_last_hidden_states": torch.zeros(1, T, feats_ref.top.shape[-1])}


def dflash_step(drafter, config, ids, feats_ours, feats_ref) -> Step:
    """DFlash: every slot of one block anchored at the last token ``x_a`` (``a = T - 1``), context the
    features of positions ``0..a-1``. Ours: ``start`` then ``head(block_hidden(state))`` (the trained
    block, ``[B, N]``, slot 0 included); reference: one anchor pinned at ``a``."""
    t = torch.tensor(ids, dtype=torch.long)
    a = len(ids) - 1
    st = drafter.start(t, _slice(feats_ours, a))
    logits = drafter.head(drafter.block_hidden(st)).float()
    pad = [int(config.get("mask_token_id") or 0)] * (drafter.block_size - 1)
    return Step(_block_inputs(drafter, ids, feats_ref, pad), {"max_anchors": 1}, {"anchor_positions": [a]},
                {"logits": logits})


def dspark_step(drafter, config, ids, feats_ours, feats_ref) -> Step:
    """DSpark: one block anchored at ``x_a``; the Markov-corrected logits of every slot along OUR greedy chain
    (slot j conditions on the anchor, then on draft j-1: vLLM's ``sample_from_anchor`` chain) and the raw
    confidence logits. The reference reads the chain from ``input_ids`` after the anchor."""
    t = torch.tensor(ids, dtype=torch.long)
    a, B = len(ids) - 1, drafter.block_size
    st = drafter.start(t, _slice(feats_ours, a))
    h = drafter.block_hidden(st)
    base = drafter.head(h).float()
    prev = torch.tensor([st.last_id], dtype=torch.long)
    rows, confs, chain = [], [], []
    for j in range(B):
        corr, e = drafter.markov_head(prev)
        c = drafter._confidence(h[j:j + 1], e)
        if c is not None:
            confs.append(c.reshape(1).float())
        row = (base[j:j + 1] + corr.float())[0]
        rows.append(row)
        tok = int(row.argmax())
        tok = tok + int(drafter.d2t[tok]) if drafter.reduced_vocab else tok
        chain.append(tok)
        prev = torch.tensor([tok], dtype=torch.long)
    out = {"logits": torch.stack(rows)}
    if confs:
        out["confidence_logits"] = torch.cat(confs)
    return Step(_block_inputs(drafter, ids, feats_ref, chain[:B - 1]), {"max_anchors": 1},
                {"anchor_positions": [a]}, out)


FAMILIES.update({"dflash": dflash_step, "dspark": dspark_step})


def peagle_step(drafter, config, ids, feats_ours, feats_ref) -> Step:
    """P-EAGLE: every depth of one parallel step after the prefix ``ids`` (``n = T - 1`` real inputs).
    Ours: ``start`` (whose forward drafts all depths, :meth:`PEagleDrafter._advance_one`), ``[D, N]``.
    Reference: every real input at depth 0 plus depths ``1..D-1`` at the last one, as vLLM's parallel
    drafting runs them; its logits rows ``n-1 .. n+D-2`` are compared."""
    t = torch.tensor(ids, dtype=torch.long)
    n = len(ids) - 1
    st = drafter.start(t, _slice(feats_ours, n))
    logits = st.draft_logits.float()
    D = logits.shape[0]
    T = n + D - 1
    aux = torch.zeros(1, T, feats_ref.aux.shape[-1])
    aux[:, :n] = feats_ref.aux[:, :n]
    inp = torch.zeros(1, T, dtype=torch.long)
    inp[0, :n] = t[1:]
    ref = {"hidden_states": aux, "input_ids": inp, "document_ids": torch.zeros(1, T, dtype=torch.long),
           "loss_mask": torch.ones(1, T), "verifier_last_hidden_states": torch.zeros(1, T, feats_ref.top.shape[-1])}
    pin = {"anchor_pos": list(range(n)) + [n - 1] * (D - 1), "depth": [0] * n + list(range(1, D)),
           "logits_rows": [n - 1, n - 1 + D]}
    return Step(ref, {"num_depths": D}, pin, {"logits": logits})


FAMILIES["peagle"] = peagle_step
