"""The target (verifier) model: the only package that knows Hugging Face model internals.

It resolves a model reference (hub id, local directory, GGUF file, or the built-in alias
``smollm2-135m-instruct``), loads it frozen, and exposes what drafters, the data pipeline and the
decoding loop need. One concern per module:

* ``loading``: dtypes, devices (:func:`resolve_device`: CUDA when present, else CPU), accelerate device
  maps (:func:`check_device_map`, :func:`process_device_map`: one whole target per ``accelerate launch``
  process), model references and the GGUF conversion cache; ``Target.load``'s body;
* ``model``: :class:`Target` (facts, fingerprint, frozen embedding / head / final norm, stop tokens,
  ``features``); over several devices every returned tensor lives on the input embedding's device;
* ``features``: :class:`TargetFeatures`, the aux layer taps and their id convention
  (:func:`default_aux_layer_ids`, :func:`distinct_layer_ids`);
* ``sessions`` (and ``cache``, the KV-cache API of the installed transformers): :class:`DecodeSession`
  (batch 1, croppable after rejected drafts), :class:`BatchDecodeSession` (continuous batching over one
  ragged cache; sliding-window and chunked targets too);
* ``generation``: ``Target.generate_batch`` (batched generation that drops finished rows);
* ``lora``: LoRA adaptation for joint training (peft): ``adapt_lora``, ``train_forward``, adapters saved,
  loaded and merged;
* ``architecture``: what differs between decoder-only architectures (decoder stack, layers, final norm,
  logit rules, attention kinds) and the refusal of unsupported ones; ``masks``: attention masks that keep
  each layer's sliding window in the ragged sessions;
* ``small_lm``: a small causal LM of the target's own architecture (fewer layers, layer-skip initialised from
  the target) decoded over its own croppable KV cache and draft trees: the draft model family's model;
* ``tiny``: :func:`build_tiny_target`, a random Llama from a config for tests, and one tiny random model
  per supported architecture (:data:`~speculators.target.tiny.TINY_ARCHITECTURES`).

Layer-id convention (ALGORITHMS.md, :mod:`speculators.target.features`): ``aux_layer_ids`` are 0-based
decoder layers whose OUTPUT is tapped (pre-norm); vLLM counts the layer whose input is tapped
(``vllm_id = our_id + 1``).
"""

import os

from .features import TargetFeatures, default_aux_layer_ids, distinct_layer_ids
from .generation import Generation
from .loading import (DEVICE_MAP_STRATEGIES, GEMMA3_ALIAS, GEMMA3_GGUF, GEMMA3_HUB_ID, SMOLLM2_ALIAS, SMOLLM2_GGUF, SMOLLM2_HUB_ID, check_device_map,
                      gguf_cache_dir, process_device_map, resolve_device, resolve_model_ref, torch_dtype)
from .lora import ADAPTER_WEIGHTS, LoraForward
from .model import Target
from .sessions import BatchDecodeSession, DecodeSession
from .tiny import build_tiny_target

__all__ = ["Target", "TargetFeatures", "Generation", "LoraForward", "DecodeSession", "BatchDecodeSession",
           "resolve_device", "default_aux_layer_ids", "distinct_layer_ids",
           "resolve_model_ref", "build_tiny_target", "torch_dtype", "check_device_map", "process_device_map",
           "gguf_cache_dir", "DEVICE_MAP_STRATEGIES", "GEMMA3_ALIAS", "GEMMA3_GGUF", "GEMMA3_HUB_ID", "SMOLLM2_ALIAS", "SMOLLM2_GGUF", "SMOLLM2_HUB_ID",
           "ADAPTER_WEIGHTS"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
