"""EAGLE-3's serving format (vllm-project/speculators' ``eagle3`` layout; vLLM ``method: eagle3``; llama.cpp
``draft-eagle3``), beside the model in ``eagle3.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import export
from ..errors import SpeculatorsError
from .serving_format import ServingFormat

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter


class Eagle3Format(ServingFormat):
    """EAGLE-3's serving format: vllm-project/speculators' ``eagle3`` config and weight names, which vLLM
    loads as ``method: eagle3`` (FORMATS.md)."""

    algorithm = "eagle3"
    vllm_method = "eagle3"  # vLLM loads speculators eagle3 checkpoints
    vllm_tree = True  # vLLM's EAGLE proposer drafts static speculative_token_tree trees for it
    serving_aux_ids_key = "eagle_aux_hidden_state_layer_ids"
    legacy_weight_names = {"fc_norm.weight": "input_norm.weight"}  # norm_before_fc, before vLLM's name
    aux_layer_count = (3, 3)
    aux_layer_count_reason = "vLLM sizes fc as 3 x hidden for a speculators-format eagle3 config"
    # embed_tokens is the target's (frozen): restored from the target when a checkpoint written by an earlier
    # version omitted it, but written in every checkpoint, final/ included: vLLM's EAGLE-3 loader places it
    # (``model.embed_tokens``) and vllm-project/speculators' from_pretrained would leave it at zeros
    frozen_target_weights = {"embed_tokens.weight": "embed_tokens"}
    publish_frozen_copies = True
    # llama.cpp's converter reads this layout (Eagle3DraftModel -> its eagle3 architecture, with the aux taps,
    # norm_before_residual and norm_before_fc) and llama-server drafts it as an EAGLE-3 chain
    llamacpp_spec_type = "draft-eagle3"

    def check_llamacpp(self, config: dict[str, Any], where: str) -> None:
        """Refuse Eagle 3.1's ``norm_output``: llama.cpp's EAGLE-3 graph feeds back the pre-norm hidden state
        and its converter has no such key, so the served drafter would differ from the trained one.

        Raises:
            SpeculatorsError: ``norm_output`` is set.
        """
        if config.get("norm_output"):
            raise SpeculatorsError(f"{where}: drafter.norm_output is set, which llama.cpp's EAGLE-3 graph does not "
                                   "run (it feeds back the pre-norm hidden state); train with norm_output: false "
                                   "to serve with llama.cpp")

    def config(self, drafter: Eagle3Drafter) -> dict[str, Any]:
        """vllm-project/speculators ``eagle3`` config (FORMATS.md)."""
        m, cfg = drafter.meta, drafter.cfg
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.num_speculative_tokens,
                                                            m.name_or_path, m.architectures),
            "transformer_layer_config": export.transformer_layer_config(drafter.layer_cfg),
            "draft_vocab_size": int(drafter.d2t.numel()),
            "eagle_aux_hidden_state_layer_ids": m.vllm_aux_layer_ids,
            "target_hidden_size": None,
            "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": cfg.norm_before_fc,
            # Eagle 3.1's feedback of the post-norm hidden state; written only when set (vLLM reads it with a
            # False default), so a default export keeps FORMATS.md's key set
            **({"norm_output": True} if cfg.norm_output else {}),
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def reference_parity_step(self, drafter: Eagle3Drafter, config: dict[str, Any], ids: list[int], feats_ours,
                              feats_ref):
        """TTT step 0 at every position (the export gate, :meth:`ServingFormat.reference_parity_step`): the
        first draft's logits after each prefix. Ours: ``start(ids[:n+1], features[:n])`` for n = 1..T-1
        (each a request whose first draft comes from ``last_logits``), rows ``[T-1, N]``. The reference:
        one forward with ``ttt_steps=1`` over ``hidden_states = aux[:T-1]``, ``input_ids = ids[1:]`` (its
        default position ids ``1..T-1``: index t pairs ``g[t]`` with ``x_{t+1}`` at position t + 1).

        Raises:
            SpeculatorsError: fewer than 2 tokens.
        """
        from .parity_inputs import ParityStep, reference_batch

        T = len(ids)
        if T < 2:
            raise SpeculatorsError("parity: an EAGLE-3 sequence needs at least 2 tokens")
        t = torch.tensor(ids, dtype=torch.long)
        rows = [drafter.start(t[:n + 1], feats_ours.slice(0, n)).last_logits.float().reshape(-1) for n in range(1, T)]
        ref = reference_batch(feats_ref.aux[:, :T - 1].contiguous(), t[1:], feats_ref.top.shape[-1])
        pin = {"metrics_module": "speculators.models.eagle3.core"}
        return ParityStep(ref, {"ttt_steps": 1}, pin, {"logits": torch.stack(rows)})
