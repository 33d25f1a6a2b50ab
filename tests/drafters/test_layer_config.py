"""the exported ``transformer_layer_config`` describes exactly the layer that was trained.

A loader that honours EVERY RoPE field of the exported config (``head_dim``, ``rope_theta`` /
``rope_parameters`` / ``rope_scaling``, ``partial_rotary_factor`` wherever it is written), with vLLM's
semantics (``get_rope(head_size, rotary_dim=int(head_dim * partial_rotary_factor), base=rope_theta,
is_neox_style=True)``: the first ``rotary_dim`` dims of each head are rotated, half-split, the rest pass
through), must rotate queries and keys exactly as the drafter's own attention does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.layers import Attention, layer_config
from speculators.target import Target

V = 64


def _partial(d: dict) -> float:
    for where in (d, d.get("rope_parameters") or {}, d.get("rope_scaling") or {}):
        if where.get("partial_rotary_factor") is not None:
            return float(where["partial_rotary_factor"])
    return 1.0


def reference_rotate(exported: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, n, T, head_dim]`` at ``positions [T]`` as a loader honouring every field would."""
    hd = exported.get("head_dim") or exported["hidden_size"] // exported["num_attention_heads"]
    assert x.shape[-1] == hd, (x.shape, hd)
    rot = int(hd * _partial(exported))
    cfg = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    rp = dict(cfg.rope_parameters)
    theta = float(exported.get("rope_theta") or rp["rope_theta"])
    assert theta == float(rp["rope_theta"])  # both spellings agree
    kind = rp.get("rope_type", "default")
    if kind == "default":
        inv, scale = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot)), 1.0
    else:
        cfg.rope_parameters = {**rp, "partial_rotary_factor": rot / hd}
        inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        assert inv.numel() == rot // 2
    freqs = positions.float()[:, None] * inv[None]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    xr, xp = x[..., :rot], x[..., rot:]
    a, b = xr[..., : rot // 2], xr[..., rot // 2:]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, xp], dim=-1)


def make_target(**rope) -> Target:
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, **rope)
    torch.manual_seed(0)
    return Target(LlamaForCausalLM(cfg), name_or_path="partial-rotary")


TARGETS = {
    "partial_0.25": dict(partial_rotary_factor=0.25, rope_theta=500000.0),
    "partial_0.5_linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}),
    "head_dim_32": dict(head_dim=32, rope_theta=20000.0),
}


@pytest.mark.parametrize("family", ["eagle3", "eagle", "mtp"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_exported_rope_matches_the_trained_layer(family, name):
    target = make_target(**TARGETS[name])
    fam = registry.get(family)
    cfg = fam.config_class(algorithm=family)
    vocab = DraftVocab.from_counts(torch.arange(V, 0, -1), V)
    torch.manual_seed(0)
    d = fam.from_target(cfg, target, vocab)
    exported = d.serving.config(d)["transformer_layer_config"]
    assert _partial(exported) == 1.0, {k: v for k, v in exported.items() if "rot" in k or "rope" in k}
    attn = next(m for m in d.modules() if isinstance(m, Attention))
    hd = attn.head_dim
    assert hd == (exported.get("head_dim") or exported["hidden_size"] // exported["num_attention_heads"])
    in_dim = attn.q_proj.in_features
    T = 7
    x = torch.randn(1, T, in_dim)
    pos = torch.arange(3, 3 + T)
    with torch.no_grad():
        cos, sin = d.rotary(x, pos[None])
        q, k, _ = attn.qkv(x, cos, sin)
        q0 = attn.q_proj(x).view(1, T, attn.num_heads, hd).transpose(1, 2)
        k0 = attn.k_proj(x).view(1, T, attn.num_kv, hd).transpose(1, 2)
    torch.testing.assert_close(q, reference_rotate(exported, q0, pos), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, reference_rotate(exported, k0, pos), atol=1e-5, rtol=1e-5)


def test_layer_config_keeps_theta_scaling_and_head_dim():
    tcfg = make_target(**TARGETS["partial_0.5_linear"]).layer_config_dict()
    c = layer_config(tcfg)
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["factor"] == 2.0
    assert "partial_rotary_factor" not in c.rope_parameters and "partial_rotary_factor" not in c.to_dict()
    c = layer_config(make_target(**TARGETS["head_dim_32"]).layer_config_dict())
    assert c.head_dim == 32 and c.rope_parameters["rope_theta"] == 20000.0


@pytest.mark.parametrize("fields, theta", [({"rotary_emb_base": 50000}, 50000.0), ({"rope_ratio": 4}, 40000.0)])
def test_other_architectures_theta_names_become_rope_theta(fields, theta):
    """GPT-NeoX's ``rotary_emb_base`` and ChatGLM's ``rope_ratio`` set the draft layer's theta (never Llama's
    default 10000 by omission)."""
    tcfg = {k: v for k, v in make_target().layer_config_dict().items() if k not in ("rope_theta", "rope_parameters")}
    c = layer_config({**tcfg, **fields})
    assert c.rope_parameters["rope_theta"] == theta
    assert not set(fields) & set(c.to_dict())
