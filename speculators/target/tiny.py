"""Tiny random targets for tests, built from transformers' own config classes (no download).

:func:`build_tiny_target` is the tiny Llama most tests use. :data:`TINY_ARCHITECTURES` holds one small
config per decoder-only architecture the project trains drafters for (the verifiers vllm-project/speculators
and SpecForge list: Llama, Llama 4 (text), Qwen2 / 2.5, Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 2,
Gemma 3, Phi-3, gpt-oss, DeepSeek-V3, Granite, OLMo-2, GPT-NeoX), each with what makes that architecture differ from
Llama switched on at a size that a few-token test exercises: sliding windows SHORTER than the test
contexts (Mistral, Qwen2, Gemma 2 / 3, gpt-oss), mixed full / sliding layers, logit soft-capping
(Gemma 2), embedding / logit multipliers (Granite), MLA and MoE (DeepSeek-V3), attention sinks (gpt-oss),
chunked attention with NoPE layers (Llama 4),
partial rotary and a LayerNorm stack without ``.model`` (GPT-NeoX). :func:`build_tiny_architecture`
builds one as a :class:`Target`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SpeculatorsError
from .model import Target

TINY_WINDOW = 5  # sliding window of the tiny windowed targets: shorter than every test context


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


def _common(vocab_size: int, hidden_size: int, num_layers: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)


def _mixed(num_layers: int) -> list[str]:
    """Sliding layers with a full-attention layer every third (Gemma 3's pattern, shortened)."""
    return ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]


def _llama(v, h, n):
    from transformers import LlamaConfig
    return LlamaConfig(**_common(v, h, n))


def _qwen2(v, h, n):
    from transformers import Qwen2Config
    c = _common(v, h, n)
    return Qwen2Config(**c, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1,
                       layer_types=["full_attention"] + ["sliding_attention"] * (n - 1))


def _qwen3(v, h, n):
    from transformers import Qwen3Config
    return Qwen3Config(**_common(v, h, n), head_dim=16)


def _qwen3_moe(v, h, n):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**_common(v, h, n), head_dim=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=h, decoder_sparse_step=1, mlp_only_layers=[])


def _mistral(v, h, n):
    from transformers import MistralConfig
    return MistralConfig(**_common(v, h, n), sliding_window=TINY_WINDOW)


def _mixtral(v, h, n):
    from transformers import MixtralConfig
    return MixtralConfig(**_common(v, h, n), num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


def _gemma2(v, h, n):
    from transformers import Gemma2Config
    return Gemma2Config(**_common(v, h, n), head_dim=16, sliding_window=TINY_WINDOW, layer_types=_mixed(n),
                        query_pre_attn_scalar=16, final_logit_softcapping=3.0, attn_logit_softcapping=50.0)


def _gemma3(v, h, n):
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(**_common(v, h, n), head_dim=16, sliding_window=TINY_WINDOW, layer_types=_mixed(n),
                            query_pre_attn_scalar=16)


def _phi3(v, h, n):
    from transformers import Phi3Config
    c = _common(v, h, n)
    c["num_key_value_heads"] = 4
    return Phi3Config(**c, partial_rotary_factor=0.5)


def _gpt_oss(v, h, n):
    from transformers import GptOssConfig
    c = _common(v, h, n)
    c["max_position_embeddings"] = 131072  # its YaRN factor (32) over the original 4096 positions
    return GptOssConfig(**c, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=TINY_WINDOW, layer_types=_mixed(n))


def _llama4(v, h, n):
    from transformers import Llama4TextConfig
    # chunked attention (chunks of 4 positions) on RoPE layers, a NoPE full-attention layer last
    return Llama4TextConfig(**_common(v, h, n), head_dim=8, num_local_experts=2, intermediate_size_mlp=2 * h,
                            attention_chunk_size=4, no_rope_layers=[1] * (n - 1) + [0])


def _deepseek_v3(v, h, n):
    from transformers import DeepseekV3Config
    c = _common(v, h, n)
    c["num_key_value_heads"] = 4
    return DeepseekV3Config(**c, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=1, moe_intermediate_size=h, n_shared_experts=1)


def _granite(v, h, n):
    from transformers import GraniteConfig
    return GraniteConfig(**_common(v, h, n), embedding_multiplier=4.0, logits_scaling=2.0,
                         residual_multiplier=0.5, attention_multiplier=0.25)


def _olmo2(v, h, n):
    from transformers import Olmo2Config
    return Olmo2Config(**_common(v, h, n))


def _gpt_neox(v, h, n):
    from transformers import GPTNeoXConfig
    c = _common(v, h, n)
    c.pop("num_key_value_heads")
    return GPTNeoXConfig(**c, rotary_pct=0.25, use_parallel_residual=True)


TINY_ARCHITECTURES: dict[str, Callable] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mistral": _mistral,
    "mixtral": _mixtral, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "gpt_oss": _gpt_oss,
    "llama4_text": _llama4, "deepseek_v3": _deepseek_v3, "granite": _granite, "olmo2": _olmo2, "gpt_neox": _gpt_neox,
}


def tiny_architecture_model(name: str, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 3,
                            seed: int = 0, config_overrides: dict | None = None):
    """A random transformers ``*ForCausalLM`` of architecture ``name`` (a key of :data:`TINY_ARCHITECTURES`)
    with an untied output head (unless ``config_overrides`` ties it) and an embedding drawn from N(0, 1), so that
    its greedy continuations vary. ``config_overrides``: config attributes set before the model is built (e.g.
    ``head_dim``).

    Raises:
        SpeculatorsError: an unknown ``name``.
    """
    from transformers import AutoModelForCausalLM

    if name not in TINY_ARCHITECTURES:
        raise SpeculatorsError(f"tiny architecture {name!r}: known are {sorted(TINY_ARCHITECTURES)}")
    cfg = TINY_ARCHITECTURES[name](vocab_size, hidden_size, num_layers)
    for key, value in (config_overrides or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.randn(vocab_size, hidden_size, generator=g))
        model.get_output_embeddings().weight.copy_(torch.randn(vocab_size, hidden_size, generator=g))
    return model.eval()


def build_tiny_architecture(name: str, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 3,
                            seed: int = 0, tokenizer=None) -> Target:
    """:func:`tiny_architecture_model` wrapped as a :class:`Target` (named ``tiny-random-<name>-<seed>``)."""
    model = tiny_architecture_model(name, vocab_size, hidden_size, num_layers, seed)
    return Target(model, tokenizer, name_or_path=f"tiny-random-{name}-{seed}")


#: sizes :func:`tiny_config_of` gives any config class that has the field (its own name or an ``attribute_map``
#: alias such as GPT-2's ``n_embd``): a few-thousand-parameter decoder, MoE and MLA fields included
TINY_FIELDS = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                   num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
                   q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, rotary_dim=4,
                   pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_config_of(config_class, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 3,
                   overrides: dict | None = None):
    """Any transformers config class at tiny size: :data:`TINY_FIELDS` for the fields it has, ``vocab_size``,
    ``hidden_size``, and at least ``num_layers`` decoder layers keeping one layer of each kind its default
    per-layer lists hold (``layer_types`` and the like: a hybrid model stays hybrid). A field the class refuses
    (a read-only property, a validator) is dropped and the class's default kept. ``overrides`` last.

    Raises:
        whatever the config class raises for the remaining fields (the caller reports it: not every class can be
        built small by field names alone).
    """
    default = config_class()

    def has(name: str) -> bool:  # a per-layer field of a heterogeneous config raises on a global read: it is there
        try:
            getattr(default, name)
            return True
        except AttributeError:
            return False
        except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
            return True

    kw = {k: v for k, v in {**TINY_FIELDS, "vocab_size": vocab_size, "hidden_size": hidden_size}.items() if has(k)}
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # MLA: the rotary part is the head size rope sees
        kw["head_dim"] = kw["qk_rope_head_dim"]
    n = getattr(default, "num_hidden_layers", None)
    if isinstance(n, int) and n > 0:
        per_layer = {k: v for k, v in vars(default).items() if isinstance(v, list) and len(v) == n}
        keep: list[int] = []
        for values in per_layer.values():  # the first layer of each kind
            seen = {repr(values[i]) for i in keep}
            for i, v in enumerate(values):
                if repr(v) not in seen:
                    keep.append(i)
                    seen.add(repr(v))
        keep = sorted(set(keep) | set(range(min(num_layers, n))))[:max(num_layers, 4)]
        kw["num_hidden_layers"] = len(keep)
        kw.update({k: [v[i] for i in keep] for k, v in per_layer.items()})
    kw.update(overrides or {})
    for _ in range(len(kw)):
        try:
            return config_class(**kw)
        except (AttributeError, ValueError, TypeError, RuntimeError) as e:
            named = [k for k in kw if k not in (overrides or {}) and (f"'{k}'" in str(e) or f"`{k}`" in str(e)
                                                                      or f" {k} " in str(e))]
            if not named:
                raise
            del kw[named[0]]
    return config_class(**kw)
