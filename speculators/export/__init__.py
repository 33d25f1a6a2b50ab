"""Serving formats, written once: what vLLM and the vllm-project/speculators format expect.

Every family's serving format (``ServingFormat.config``) builds its ``config.json`` from these helpers (FORMATS.md), so the
common blocks, the layer-id offset and the serving facts are defined in one place:

* :func:`speculators_config`: the ``speculators_config`` block (algorithm, greedy proposal method with
  ``speculative_tokens`` = vLLM's ``num_speculative_tokens``, verifier name and architectures);
* :func:`transformer_layer_config`: a drafter's decoder config as the plain HF Llama dict vLLM reads;
* :func:`vllm_aux_layer_ids`: the aux-layer-id +1 rule (our ids tap the OUTPUT of decoder layer ``i``;
  vLLM's ids name the layer whose INPUT is tapped, ``i + 1``), used by EAGLE-3's
  ``eagle_aux_hidden_state_layer_ids``, the target's ``vllm_aux_layer_ids`` and every later family
  that exports aux layer ids (DFlash/DSpark ``aux_hidden_state_layer_ids``, P-EAGLE);
* :func:`vllm_serving`, :func:`speculative_tokens`: how vLLM serves a written ``config.json`` (the
  ``--speculative-config`` ``method``, or why it cannot) and the K it declares;
* :func:`with_lora_verifier`: a joint run's config, whose verifier is the base model plus a LoRA adapter;
* :func:`model_config_fields`: a ``config.json`` without the keys that describe the file (:data:`CONFIG_FILE_KEYS`),
  what a model (the draft model, the layout check's meta-device model) is rebuilt from.

This module is a leaf: it imports nothing from speculators but the error type. The package's other
modules check exported directories (imported by name, never from here): ``vllm_layout`` (every tensor's
name and shape against vLLM's loaders), ``parity`` (the first drafting step, each family's own ``ServingFormat.reference_parity_step``, against
the reference implementation), ``reference_env`` and ``reference_worker`` (its own venv and the script run
there), ``gate`` (both, for ``speculators check`` and the end of ``speculators train``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import SpeculatorsError

#: The aux-layer-id convention recorded beside the ids in a checkpoint (ALGORITHMS.md).
AUX_LAYER_IDS_CONVENTION = ("0-based index of the decoder layer whose OUTPUT is tapped (pre-norm residual, also "
                            "for L-1; HF hidden_states[i+1] for i < L-1); vLLM ids = these + 1")

#: keys of a Hugging Face ``config.json`` that describe the file (its writer, dtype, class names, quantization, remote
#: code, this project's training block), not the model: left out when a model config is rebuilt from one
CONFIG_FILE_KEYS = ("_name_or_path", "_model_name_or_path", "transformers_version", "quantization_config",
                    "architectures", "dtype", "torch_dtype", "auto_map", "speculators_training")

#: dropped from ``transformer_layer_config``: the file keys, and the tie of a whole model's head (a layer has none)
_BOOKKEEPING_KEYS = CONFIG_FILE_KEYS + ("tie_word_embeddings",)


def model_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict; not modified) without :data:`CONFIG_FILE_KEYS`: the fields
    ``AutoConfig.for_model`` builds the model from. Returns a new dict (values shared, not copied)."""
    return {k: v for k, v in dict(config).items() if k not in CONFIG_FILE_KEYS}


def vllm_aux_layer_ids(ids: Iterable[int]) -> list[int]:
    """Our aux layer ids in vLLM's convention: ``[i + 1 for i in ids]``.

    Ours (ALGORITHMS.md): 0-based index of the decoder layer whose output is tapped. vLLM's
    (``eagle_aux_hidden_state_layer_ids``, DFlash ``aux_hidden_state_layer_ids``): index of the layer
    whose input is tapped, i.e. HF ``hidden_states[i + 1]``.

    Args:
        ids: 0-based decoder layer ids (ints >= 0), in tap order.
    Returns:
        A new list of ints, same order and length.
    Raises:
        SpeculatorsError: an id that is not a non-negative int (e.g. already a vLLM id list of strings).
    """
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise SpeculatorsError(f"aux_layer_ids: {i!r} is not a 0-based decoder layer id (an int >= 0)")
        out.append(i + 1)
    return out


def speculators_config(algorithm: str, num_speculative_tokens: int, verifier_name_or_path: str,
                       verifier_architectures: Sequence[str]) -> dict[str, Any]:
    """The ``speculators_config`` block of the vllm-project/speculators format (FORMATS.md).

    vLLM reads ``proposal_methods[0].speculative_tokens`` as ``num_speculative_tokens`` and
    ``verifier.name_or_path``; the proposal method is greedy with ``verifier_accept_k = 1``.

    Args:
        algorithm: the family name (``speculators_model_type``).
        num_speculative_tokens: K, an int >= 1.
        verifier_name_or_path: the target's hub id or local path.
        verifier_architectures: the target's HF architectures (e.g. ``["LlamaForCausalLM"]``).
    Raises:
        SpeculatorsError: K is not a positive int.
    """
    k = int(num_speculative_tokens)
    if k < 1:
        raise SpeculatorsError(f"num_speculative_tokens {num_speculative_tokens!r}: must be >= 1")
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)}}


def transformer_layer_config(layer_cfg: Any) -> dict[str, Any]:
    """A drafter's decoder config as the plain HF Llama dict vLLM expects in ``transformer_layer_config``.

    RoPE is written explicitly as ``rope_theta`` / ``rope_scaling`` (older readers ignore transformers 5's
    ``rope_parameters`` and would silently fall back to the default theta: FORMATS.md, "a mismatch
    silently destroys acceptance"); bookkeeping keys are dropped; ``model_type: llama`` and
    ``architectures: ["LlamaForCausalLM"]``.

    Args:
        layer_cfg: a transformers ``PretrainedConfig`` (anything with ``to_dict()``) or a mapping;
            not modified.
    Returns:
        A new dict.
    """
    d = layer_cfg.to_dict() if hasattr(layer_cfg, "to_dict") else copy.deepcopy(dict(layer_cfg))
    for key in _BOOKKEEPING_KEYS:
        d.pop(key, None)
    rp = d.get("rope_parameters") or {}
    if "rope_theta" not in d and "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    if "rope_scaling" not in d:
        d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else \
            {k: v for k, v in rp.items() if k != "rope_theta"}
    d["model_type"] = "llama"
    d["architectures"] = ["LlamaForCausalLM"]
    return d


def speculative_tokens(config: Mapping[str, Any]) -> int | None:
    """K (``num_speculative_tokens``) a ``config.json`` declares in its speculators block
    (``speculators_config.proposal_methods[0].speculative_tokens``); ``None`` when it does not say
    (e.g. vLLM's native Medusa layout, which a family reads itself)."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


def vllm_serving(algorithm: str, method: str | None, note: str = "") -> tuple[str | None, str]:
    """How vLLM serves a checkpoint of family ``algorithm``: ``(method, note)``.

    ``method`` is the ``--speculative-config`` ``"method"`` vLLM accepts, or ``None`` when vLLM cannot
    load the checkpoint as written; ``note`` then says why and what to do (a default sentence when the
    family gives none). With a method the note is empty.
    """
    if method is not None:
        return method, ""
    return None, note or f"vLLM has no loader for speculators `{algorithm}` checkpoints"


def with_lora_verifier(config: dict[str, Any], adapter_dir: str) -> dict[str, Any]:
    """Mark a joint run's config: its verifier is the base model with the LoRA adapter in ``adapter_dir``
    (relative to the checkpoint) merged. Adds ``speculators_config.verifier.lora_adapter`` when the layout
    has a speculators block (vLLM's native layouts have none); returns ``config`` (modified in place)."""
    if "speculators_config" in config:
        config["speculators_config"]["verifier"]["lora_adapter"] = adapter_dir
    return config


__all__ = ["AUX_LAYER_IDS_CONVENTION", "CONFIG_FILE_KEYS", "model_config_fields", "speculative_tokens",
           "speculators_config", "transformer_layer_config", "vllm_aux_layer_ids", "vllm_serving",
           "with_lora_verifier"]
