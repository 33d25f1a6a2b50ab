"""EAGLE-1 drafter: label shift, feature + token loss, noise, metrics, export format.

Greedy == plain, seeded sampling, save/load round trip, ``propose`` purity and CLI train -> eval are
checked for every family in tests/drafters/test_contracts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from safetensors.torch import load_file

import speculators.drafters.eagle  # noqa: F401  (registers "eagle")
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.errors import SpeculatorsError
from speculators.target import build_tiny_target
from conftest import batch_for

V = 96
TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle1.yaml"


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, seed=0, **kw):
    torch.manual_seed(seed)
    cls = registry.get("eagle")
    d = cls.from_target(cls.config_class(algorithm="eagle", **kw), target, DraftVocab.full(target.vocab_size))
    with torch.no_grad():  # random (non-zero) weights everywhere so that every input matters
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    return d



def inference_features(d, target, seq: torch.Tensor) -> torch.Tensor:
    """Predicted features at every index through the INFERENCE path (start over the whole sequence):
    ``out[t]`` = f from input ``(h_top[t], x_{t+1})``, t = 0..T-2."""
    seen = []
    orig = d._run_layers

    def spy(*a, **kw):
        h = orig(*a, **kw)
        seen.append(h.detach())
        return h

    d._run_layers = spy
    try:
        feats = target.features(seq[None])
        d.start(seq, feats.slice(0, seq.numel() - 1))
    finally:
        del d._run_layers
    return seen[0][0]


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_full_vocab_only(target):
    cls = registry.get("eagle").config_class
    c = cls()
    assert (c.w_feat, c.w_tok, c.noise, c.num_layers, c.fc_bias, c.draft_vocab_size) == (1.0, 0.1, 0.2, 1, True, None)
    with pytest.raises(ValidationError, match="draft_vocab_size"):
        cls(draft_vocab_size=512)
    with pytest.raises(ValidationError):
        cls(noise=-0.1)
    import yaml

    from speculators.recipe import recipe_from_dict
    raw = yaml.safe_load(TINY.read_text())
    raw["drafter"]["draft_vocab_size"] = 512
    with pytest.raises(SpeculatorsError, match=r"drafter\.draft_vocab_size.*must be null"):
        recipe_from_dict(raw)
    with pytest.raises(SpeculatorsError, match="full target vocabulary"):
        registry.get("eagle").from_target(c, target, DraftVocab.from_counts(torch.arange(V, 0, -1), 40))


# ----------------------------------------------------------------------------- shapes and the shift


def test_shapes(target):
    d = make_drafter(target).eval()
    seq = torch.randint(0, V, (11,), generator=torch.Generator().manual_seed(0))
    feats = target.features(seq[None])
    state = d.start(seq, feats.slice(0, 10))
    assert state.num_positions == 10 and state.cache.length == 10
    assert state.last_feature.shape == (1, 1, 64) and state.last_logits.shape == (V,)
    assert d._propose_one(state, 3).probs is None  # greedy: point-mass drafts
    batch, _ = batch_for(target, seq[None])
    steps = d._unroll(batch.input_ids, batch.top, batch.attention_mask, 3,
                      lambda j, r, p: torch.ones(1, 11, dtype=torch.bool))
    assert [s[0].shape for s in steps] == [(1, 11, 64)] * 3 and [s[2].shape for s in steps] == [(11, V)] * 3


def test_training_steps_match_inference_chain(target):
    """Step 0 at index t must compute what inference computes from input (h_top[t], x_{t+1}) at position
    t+1, and chain step j what inference computes for draft j+1 (own feature and argmax fed back).

    Fails if the token shift, the position ids, the fed-back feature or the chain attention differ
    from the drafter's autoregressive inference with its KV cache.
    """
    d = make_drafter(target).eval()
    g = torch.Generator().manual_seed(0)
    n = 9  # prompt x_0..x_{n-1}, first target token x_n
    seq = torch.randint(0, V, (n + 5,), generator=g)
    feats = target.features(seq[None])
    state = d.start(seq[:n + 1], feats.slice(0, n))
    logits = [state.last_logits]
    orig = d.frozen_target.lm_head

    def spy(h):
        out = orig(h)
        logits.append(out.detach().float()[0, 0])
        return out

    d.frozen_target.lm_head = spy
    try:
        prop = d._propose_one(state, 3)
    finally:
        del d.frozen_target.lm_head
    batch, _ = batch_for(target, seq[None])
    T = seq.numel()
    steps = d._unroll(torch.cat([seq[1:], torch.zeros(1, dtype=torch.int64)])[None], batch.top,
                      batch.attention_mask, 3, lambda j, r, p: torch.ones(1, T, dtype=torch.bool))
    t = n - 1  # index whose input is (h_top[n-1], x_n)
    for j in range(3):
        torch.testing.assert_close(steps[j][2][t], logits[j], atol=1e-4, rtol=1e-4)
        assert int(steps[j][2][t].argmax()) == int(prop.token_ids[j])
    # advance() with m real tokens == step 0 at the last of them
    state2 = d.start(seq[:n + 1], feats.slice(0, n))
    d._propose_one(state2, 2)
    d._advance_one(state2, seq[n + 1:n + 4], feats.slice(n, n + 3))
    torch.testing.assert_close(state2.last_logits, steps[0][2][n + 2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state2.last_feature[0, 0], steps[0][0][0, n + 2], atol=1e-4, rtol=1e-4)


def test_loss_by_hand_with_documented_shift(target):
    """Index t: input (h_top[t], x_{t+1}); targets h_top[t+1] and softmax(lm_head(h_top[t+1])); valid iff
    x_{t+2} is an assistant token. Features are recomputed through the inference path."""
    d = make_drafter(target, w_feat=0.7, w_tok=0.3).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 14), generator=g)
    mask = torch.rand(2, 14, generator=g) > 0.3
    lengths = [14, 11]
    batch, _ = batch_for(target, ids, mask, lengths)
    loss, m = d.loss(batch)
    head = target.lm_head_weight
    feat_sum, tok_sum, n = 0.0, 0.0, 0
    for b in range(2):
        L = lengths[b]
        fb = inference_features(d, target, ids[b, :L])  # [L-1, H]
        top = target.features(ids[b:b + 1, :L]).top[0]
        for t in range(L - 2):
            if not mask[b, t + 2]:
                continue
            feat_sum += float(F.smooth_l1_loss(fb[t], top[t + 1], reduction="none").mean())
            p = torch.softmax(top[t + 1] @ head.T, -1)
            tok_sum += float(-(p * torch.log_softmax(fb[t] @ head.T, -1)).sum())
            n += 1
    assert m["loss_feat"] == pytest.approx(feat_sum / n, rel=1e-4, abs=1e-6)
    assert m["loss_tok"] == pytest.approx(tok_sum / n, rel=1e-4)
    assert float(loss.detach()) == pytest.approx(0.7 * feat_sum / n + 0.3 * tok_sum / n, rel=1e-4)


def test_noise_follows_eagle_and_only_touches_inputs(target):
    d = make_drafter(target, noise=0.2)
    # amplitude: (U - 0.5) * 0.2 * 512 / L_b, per example length
    zeros = torch.zeros(2, 16, 64)
    am = torch.zeros(2, 16, dtype=torch.bool)
    am[0, :8] = True
    am[1, :16] = True
    torch.manual_seed(0)
    nz = d.add_noise(zeros, am)
    for b, L in ((0, 8), (1, 16)):
        half = 0.2 * 512 / L / 2
        assert nz[b].abs().max() <= half and nz[b].abs().max() > 0.95 * half
        assert nz[b].std() == pytest.approx(2 * half / 12 ** 0.5, rel=0.1)
    torch.manual_seed(0)
    assert torch.equal(nz, d.add_noise(zeros, am))  # deterministic under torch.manual_seed
    # in training mode the loss sees noised inputs but clean targets; eval mode sees no noise
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    batch, _ = batch_for(target, ids)
    d.eval()
    with torch.no_grad():
        clean, _ = d.loss(batch)
        d.train()
        torch.manual_seed(5)
        noisy, _ = d.loss(batch)
        torch.manual_seed(5)
        again, _ = d.loss(batch)
    assert float(noisy) == float(again) and float(noisy) != pytest.approx(float(clean))
    torch.manual_seed(5)
    x = d.add_noise(batch.top, batch.attention_mask)
    steps = d._unroll(torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.int64)], 1), x,
                      batch.attention_mask, 1, lambda j, r, p: torch.ones(2, 12, dtype=torch.bool))
    f0 = steps[0][0]
    tgt = torch.cat([batch.top[:, 1:], torch.zeros(2, 1, 64)], 1)
    valid = torch.zeros(2, 12, dtype=torch.bool)
    valid[:, :10] = True
    feat = F.smooth_l1_loss(f0[valid], tgt[valid], reduction="none").mean(-1).mean()
    p = torch.softmax(d.frozen_target.lm_head(tgt[valid]), -1)
    tok = -(p * torch.log_softmax(d.frozen_target.lm_head(f0[valid]), -1)).sum(-1).mean()
    assert float(noisy) == pytest.approx(float((feat + 0.1 * tok).detach()), rel=1e-5)
    off = make_drafter(target, noise=0.0).train()
    torch.manual_seed(5)
    with torch.no_grad():
        assert float(off.loss(batch)[0]) == pytest.approx(float(make_drafter(target, noise=0.0).eval().loss(batch)[0]))


def test_metrics_full_and_conditional_accuracy():
    """full_acc_j / cond_acc_j / sim_tau recomputed from the unrestricted greedy chain."""
    small = build_tiny_target(vocab_size=5, hidden_size=64, num_layers=4, seed=2)  # chance agreement is high
    d = make_drafter(small, sim_steps=3).eval()
    g = torch.Generator().manual_seed(5)
    B, T = 3, 16
    ids = torch.randint(0, 5, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    batch, f = batch_for(small, ids, mask)
    _, m = d.loss(batch)
    steps = d._unroll(torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.int64)], 1), batch.top,
                      batch.attention_mask, 3, lambda j, r, p: torch.ones(B, T, dtype=torch.bool))
    argmax = f.logits.argmax(-1)
    full, live, tau = None, None, 1.0
    for j in range(3):
        pred = steps[j][2].argmax(-1).view(B, T)
        correct = torch.zeros(B, T, dtype=torch.bool)
        correct[:, :T - 1 - j] = pred[:, :T - 1 - j] == argmax[:, 1 + j:]
        valid = torch.zeros(B, T, dtype=torch.bool)
        valid[:, :T - 2 - j] = mask[:, 2 + j:]
        # the one definition (speculators.losses.chained_acceptance): chains whose drafts 0..j are all labelled
        live = valid if live is None else live & valid
        new_full = correct & live if full is None else full & correct & live
        acc = float(new_full.sum() / live.sum())
        assert m[f"full_acc_{j}"] == pytest.approx(acc)
        den = live.sum() if full is None else (full & live).sum()
        assert m[f"cond_acc_{j}"] == pytest.approx(float(new_full.sum() / den.clamp(min=1)))
        full = new_full
        tau += acc
    assert m["full_acc_1"] > 0  # the chain steps are exercised
    assert m["sim_tau"] == pytest.approx(tau)


def test_training_reduces_loss_and_improves_acceptance(target):
    d = make_drafter(target, noise=0.0)
    ids = torch.randint(0, V, (4, 24), generator=torch.Generator().manual_seed(7))
    batch, _ = batch_for(target, ids)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first, m0 = d.loss(batch)
    for _ in range(60):
        loss, m = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * float(first.detach())
    assert m["loss_feat"] < m0["loss_feat"] and m["loss_tok"] < m0["loss_tok"]
    assert m["full_acc_0"] > m0["full_acc_0"] + 0.2
    assert d.embed_tokens.weight.grad is None  # frozen


# ----------------------------------------------------------------------------- formats


def test_export_format_is_vllm_eagle(target, tmp_path):
    d = make_drafter(target)
    path = d.save_pretrained(tmp_path / "ckpt", recipe_yaml="x: 1\n")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle"
    assert cfg["architectures"][0] == "EagleSpeculator"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle" and sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"]["name_or_path"] == target.name_or_path
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V and layer["hidden_size"] == 64
    assert layer.get("rope_theta", layer.get("rope_parameters")) is not None
    assert cfg["fusion_bias"] is True and cfg["layernorms"] is False
    w = load_file(str(path / "model.safetensors"))
    H = target.hidden_size
    assert w["fc.weight"].shape == (H, 2 * H) and w["fc.bias"].shape == (H,)
    assert w["embed_tokens.weight"].shape == (V, H)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.0.self_attn.{name}.weight" in w
    for name in ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"):
        assert f"layers.0.{name}" in w
    assert "layers.0.input_layernorm.weight" not in w  # EAGLE-1 / vLLM: identity on layer 0
    assert not any(k.startswith(("lm_head", "norm", "d2t", "t2d")) for k in w)
    # identical weights/config/proposals after loading: tests/drafters/test_contracts.py; the target's head is
    # not in the checkpoint, so a loaded drafter needs attach_target
    loaded = Drafter.from_pretrained(path)
    with pytest.raises(RuntimeError, match="attach_target"):
        loaded.start(torch.arange(5), target.features(torch.arange(5)[None]).slice(0, 4))
    # variants: no fc bias (vLLM V1 layout), two layers (layer 1 has its input norm)
    d2 = make_drafter(target, fc_bias=False, num_layers=2)
    p2 = d2.save_pretrained(tmp_path / "ckpt2")
    w2 = load_file(str(p2 / "model.safetensors"))
    assert "fc.bias" not in w2 and "layers.1.input_layernorm.weight" in w2
    assert json.loads((p2 / "config.json").read_text())["fusion_bias"] is False
    assert Drafter.from_pretrained(p2).cfg.num_layers == 2


def test_exported_weights_reproduce_vllm_eagle_forward(target, tmp_path):
    """Rebuild vLLM's EagleLlamaForCausalLM forward from the exported weights with transformers' own
    LlamaDecoderLayer: ``fc(cat(embed(x_{t+1}), h[t]))``, layer 0 with an identity input norm, no final
    norm, target lm_head. Fails if the concat order, a weight name or the layer-0 norm differ."""
    import copy

    from torch import nn
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    d = make_drafter(target).eval()
    w = load_file(str(d.save_pretrained(tmp_path / "ckpt") / "model.safetensors"))
    cfg = copy.deepcopy(d.layer_cfg)
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=True)
    seq = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(6))
    T = seq.numel() - 1
    top = target.features(seq[None]).top[:, :T]
    x = F.linear(torch.cat([F.embedding(seq[1:][None], w["embed_tokens.weight"]), top], -1),
                 w["fc.weight"], w["fc.bias"])
    pos = torch.arange(1, T + 1)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
    ours = inference_features(d, target, seq)
    torch.testing.assert_close(ours, ref[0], atol=1e-5, rtol=1e-4)
