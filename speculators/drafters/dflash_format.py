"""DFlash's serving format (vllm-project/speculators' ``dflash`` layout; vLLM ``method: dflash``; llama.cpp
``draft-dflash``) and its default target taps, beside the model in ``dflash.py`` (DSpark's format extends it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import export
from .serving_format import ServingFormat

if TYPE_CHECKING:
    from .dflash import DFlashConfig, DFlashDrafter


def dflash_aux_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default target taps (0-based OUTPUT-of-layer ids, ours = DFlash's convention).

    One draft layer: ``[L // 2]``; otherwise ``num_draft_layers`` ids spaced evenly (rounded) from 1 to
    ``L - 3``. On shallow targets where those repeat a layer or leave ``[0, L - 1]``, the nearest distinct
    ascending ids (:func:`speculators.target.distinct_layer_ids`: ``[1, 2]`` for L = 4 and 2 draft layers).

    Args:
        num_layers: L, the target's decoder layers (>= 1).
        num_draft_layers: the drafter's layers (>= 1): one tap per draft layer.
    Raises:
        SpeculatorsError: ``L < num_draft_layers`` (too shallow for one distinct tap per draft layer).
    """
    from ..target import distinct_layer_ids

    if num_draft_layers == 1:
        ids = [num_layers // 2]
    else:
        start, end = 1, num_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return distinct_layer_ids(ids, num_layers)



class DFlashFormat(ServingFormat):
    """DFlash's serving format: vllm-project/speculators' ``dflash`` config and weight names (vLLM:
    ``method: dflash``, ``DFlashQwen3ForCausalLM``); one aux layer per tap, any number of taps."""

    algorithm = "dflash"
    aux_layer_count = (1, None)  # vLLM's DFlash/DSpark fc takes len(aux layers) x hidden
    aux_layer_count_reason = "vLLM's fc takes one hidden state per tap"
    vllm_method = "dflash"  # vLLM's speculators loader maps `dflash` to DFlashQwen3ForCausalLM
    llamacpp_spec_type = "draft-dflash"  # llama.cpp's dflash architecture (src/models/dflash.cpp)
    serving_aux_ids_key = "aux_hidden_state_layer_ids"

    def llamacpp_converter_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's ``DSparkSpeculator`` converter class reads this (speculators) layout and writes the ``dflash``
        GGUF; ``sample_from_anchor: false`` and no Markov tensors make it plain DFlash (FORMATS.md, "llama.cpp")."""
        return {"architectures": ["DSparkSpeculator"]}

    def llamacpp_max_draft(self, config: dict[str, Any]) -> int | None:
        """``block_size - 1`` (llama.cpp's DFlash block ``[x_n, MASK x K]``)."""
        return int(config["block_size"]) - 1 if isinstance(config.get("block_size"), int) else None

    def default_aux_layer_ids(self, num_layers: int, cfg: DFlashConfig) -> list[int]:
        """DFlash's default taps (:func:`dflash_aux_layer_ids` with one tap per draft layer).

        Raises:
            SpeculatorsError: a target too shallow for one distinct tap per draft layer.
        """
        return self.check_aux_layer_ids(dflash_aux_layer_ids(num_layers, cfg.num_layers), num_layers)

    def config(self, drafter: DFlashDrafter) -> dict[str, Any]:
        """vllm-project/speculators ``dflash`` config (FORMATS.md); vLLM serves it as method ``dflash``."""
        m, cfg = drafter.meta, drafter.cfg
        layer = export.transformer_layer_config(drafter.layer_cfg)
        layer["model_type"] = "qwen3"  # Qwen3 layers: per-head q/k norms (vLLM's DFlashQwen3 layout)
        layer["architectures"] = ["Qwen3ForCausalLM"]
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.block_size - 1,
                                                            m.name_or_path, m.architectures),
            "transformer_layer_config": layer,
            "draft_vocab_size": int(drafter.d2t.numel()) if drafter.reduced_vocab else m.vocab_size,
            "block_size": cfg.block_size,
            "aux_hidden_state_layer_ids": m.vllm_aux_layer_ids,
            "mask_token_id": cfg.mask_token_id,
            "sample_from_anchor": False,
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """``block_size - 1`` (the speculators block), else ``config["block_size"] - 1``."""
        k = export.speculative_tokens(config)
        if k is None and isinstance(config.get("block_size"), int):
            k = config["block_size"] - 1
        return k

    def reference_parity_step(self, drafter: DFlashDrafter, config: dict[str, Any], ids: list[int], feats_ours,
                              feats_ref):
        """Every slot of one block anchored at the last token ``x_a`` (``a = T - 1``), context the features
        of positions ``0..a-1`` (the export gate, :meth:`ServingFormat.reference_parity_step`). Ours: ``start``
        then ``head(block_hidden(state))`` (the trained block, ``[B, N]``, slot 0 included); the
        reference: one anchor pinned at ``a``, mask tokens after it."""
        from .parity_inputs import ParityStep, block_reference_inputs, reference_anchor_pin

        t = torch.tensor(ids, dtype=torch.long)
        a = len(ids) - 1
        logits = drafter.head(drafter.block_hidden(drafter.start(t, feats_ours.slice(0, a)))).float()
        pad = [int(config.get("mask_token_id") or 0)] * (drafter.block_size - 1)
        return ParityStep(block_reference_inputs(drafter.block_size, ids, feats_ref, pad), {"max_anchors": 1},
                          reference_anchor_pin(a, "speculators.models.dflash.core"), {"logits": logits})


__all__ = ["DFlashFormat", "dflash_aux_layer_ids"]
