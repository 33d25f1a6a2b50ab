"""Tiny random targets for tests: a Llama built from a transformers config, no download."""

from __future__ import annotations

import torch

from .model import Target


def build_tiny_target(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                      seed: int = 0, tokenizer=None, model_type: str = "llama") -> Target:
    """A tiny random Llama target built from a transformers config (no download): for tests.

    Shapes follow SmolLM2's ratios (GQA with 4 query / 2 kv heads, SwiGLU, tied embeddings).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so that the random model has peaked (non-uniform) distributions.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
    return Target(model, tokenizer, name_or_path=f"tiny-random-{model_type}-{seed}")
