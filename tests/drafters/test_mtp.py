"""MTP drafter: label shift, train/inference consistency, metrics, export format, joint-section validation.

Greedy == plain, seeded sampling, save/load round trip, ``propose`` purity and CLI train -> eval are
checked for every family in tests/drafters/test_contracts.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import speculators.drafters.mtp  # noqa: F401  (registers "mtp")
from speculators.cli import app
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import plain_decode
from speculators.target import build_tiny_target
from speculators.verify import SamplingParams
from conftest import batch_for

V = 96
TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-mtp.yaml"


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, num_modules=3, seed=0, **kw):
    torch.manual_seed(seed)
    family = registry.get("mtp")
    cfg = family.config_class(algorithm="mtp", num_modules=num_modules, **kw)
    d = family.from_target(cfg, target, DraftVocab.full(V))
    with torch.no_grad():  # random (non-zero) weights everywhere so that every input matters
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    return d



def module_logits(d, batch):
    with torch.no_grad():
        return [d.head(h).float() for h in d.module_hiddens(batch.input_ids, batch.top)]


# ----------------------------------------------------------------------------- config


def test_config_validation():
    cls = registry.get("mtp").config_class
    c = cls(algorithm="mtp")
    assert (c.num_modules, c.loss_lambda, c.module_weights, c.distill, c.joint) == (3, 1.0, None, False, False)
    assert cls(algorithm="mtp", joint=True).loss_lambda == 0.3  # joint mode: tests/drafters/test_joint.py
    with pytest.raises(ValueError, match="module_weights"):
        cls(algorithm="mtp", num_modules=2, module_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        cls(algorithm="mtp", draft_vocab_size=32)
    with pytest.raises(ValueError, match="unk"):
        cls(algorithm="mtp", unk=1)


def test_shapes(target):
    d = make_drafter(target, num_modules=2)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    batch, _ = batch_for(target, ids)
    hs = d.module_hiddens(batch.input_ids, batch.top)
    assert len(hs) == 2 and all(h.shape == (2, 11, 64) for h in hs)
    loss, m = d.loss(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(m) == {"loss_0", "loss_1", "full_acc_0", "full_acc_1", "cond_acc_0", "cond_acc_1", "sim_tau"}
    d.eval()
    state = d.start(ids[0, :6], target.features(ids[:1, :5]))
    assert d._propose_one(state, 4).token_ids.shape == (4,)  # k > num_modules: the chain goes on
    assert d._propose_one(state, 3).probs is None  # greedy: point-mass drafts


def test_eh_proj_input_is_enorm_embedding_then_hnorm_hidden(target):
    """DeepSeek/vLLM order: eh_proj(cat([enorm(embed(x_{t+k})), hnorm(h_{k-1}[t])]))."""
    d = make_drafter(target, num_modules=1)
    g = torch.Generator().manual_seed(8)
    ids_a, ids_b = torch.randint(0, V, (2, 1, 9), generator=g)
    top_a, top_b = torch.randn(2, 1, 9, 64, generator=g)

    def out(ids, top):
        with torch.no_grad():
            return d.module_hiddens(ids, top)[0]

    assert not torch.allclose(out(ids_a, top_a), out(ids_b, top_a))
    assert not torch.allclose(out(ids_a, top_a), out(ids_a, top_b))
    with torch.no_grad():
        d.layers[0].enorm.weight.zero_()  # kills the token input only if enorm normalises the embedding
    torch.testing.assert_close(out(ids_a, top_a), out(ids_b, top_a))
    assert not torch.allclose(out(ids_a, top_a), out(ids_a, top_b))  # ...and hnorm the hidden state
    with torch.no_grad():
        d.layers[0].enorm.weight.fill_(1.0)
        d.layers[0].eh_proj.weight[:, :64] = 0  # the first half of eh_proj's input is the embedding
    torch.testing.assert_close(out(ids_a, top_a), out(ids_b, top_a))
    assert not torch.allclose(out(ids_a, top_a), out(ids_a, top_b))


# ----------------------------------------------------------------------------- training vs inference


@pytest.mark.parametrize("num_modules", [1, 3])
def test_modules_match_inference_chain(target, num_modules):
    """Module j's teacher-forced training logits at index n-1 equal the distribution of draft j at
    inference after start + advance (fails on an off-by-one token shift, position id, fed-back hidden
    state, a wrong gap fill of modules j > 1, or a broken cache roll-back)."""
    d = make_drafter(target, num_modules=num_modules).eval()
    g = torch.Generator().manual_seed(1)
    n0, m = 6, 4
    seq0 = torch.randint(0, V, (n0 + m + 1,), generator=g)
    feats = target.features(seq0[None])
    state = d.start(seq0[:n0 + 1], feats.slice(0, n0))
    d._propose_one(state, num_modules + 2, SamplingParams.uniform(1, 1.0), g)  # speculative entries must be dropped
    d._advance_one(state, seq0[n0 + 1:], feats.slice(n0, n0 + m))
    n = n0 + m
    lengths = [c.length for c in state.caches]
    assert lengths == [max(0, n - k + 1) for k in range(1, num_modules + 1)]
    prop = d._propose_one(state, num_modules + 2, SamplingParams.uniform(1, 1.0), g)
    assert [c.length for c in state.caches] == lengths
    seq = torch.cat([seq0, prop.token_ids, torch.randint(0, V, (2,), generator=g)])
    batch, _ = batch_for(target, seq[None])
    logits = module_logits(d, batch)
    for j in range(num_modules):
        torch.testing.assert_close(torch.softmax(logits[j][0, n - 1], -1), prop.probs[j], atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- loss and metrics


@pytest.mark.parametrize("distill", [False, True])
def test_loss_recomputed_by_hand_with_documented_shift(target, distill):
    """Module k at index t is trained on x_{t+k+1} (hard) or the target distribution at t+k (distill),
    only where t+k+1 < T is an assistant token; loss = lambda * mean_k w_k CE_k."""
    w = [1.0, 0.5, 2.0]
    d = make_drafter(target, num_modules=3, module_weights=w, loss_lambda=0.7, distill=distill)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 13), generator=g)
    mask = torch.rand(2, 13, generator=g) > 0.3
    batch, f = batch_for(target, ids, mask)
    loss, metrics = d.loss(batch)
    logits = module_logits(d, batch)
    T = ids.shape[1]
    total = 0.0
    for i in range(3):
        k = i + 1
        num, den = 0.0, 0
        for b in range(2):
            for t in range(T - k - 1):
                if not mask[b, t + k + 1]:
                    continue
                lp = torch.log_softmax(logits[i][b, t], -1)
                if distill:
                    num += float(-(torch.softmax(f.logits[b, t + k], -1) * lp).sum())
                else:
                    num += float(-lp[ids[b, t + k + 1]])
                den += 1
        manual = num / max(den, 1)
        assert metrics[f"loss_{i}"] == pytest.approx(manual, rel=1e-4, abs=1e-5)
        total += w[i] * manual
    assert float(loss.detach()) == pytest.approx(0.7 * total / 3, rel=1e-4)


def test_loss_of_zeroed_modules_is_log_vocab(target):
    """Hand-computed example: zero eh_proj -> every module outputs 0 -> uniform logits -> CE = log V at
    every valid index; loss = lambda * (1/D) * sum_k w_k log V."""
    d = make_drafter(target, num_modules=2, module_weights=[1.0, 3.0], loss_lambda=0.5)
    with torch.no_grad():
        for layer in d.layers:
            layer.eh_proj.weight.zero_()
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(4))
    batch, _ = batch_for(target, ids)
    loss, m = d.loss(batch)
    assert m["loss_0"] == pytest.approx(math.log(V), rel=1e-5)
    assert m["loss_1"] == pytest.approx(math.log(V), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(0.5 * (1 + 3) * math.log(V) / 2, rel=1e-5)


def test_metrics_chained_accuracy_and_sim_tau(target):
    d = make_drafter(target, num_modules=3)
    g = torch.Generator().manual_seed(5)
    T = 16
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[:, :4] = False  # a prompt: a chain that drafts a prompt token at any step is not counted
    batch, _ = batch_for(target, ids, mask)
    logits = module_logits(d, batch)
    preds = [lg.argmax(-1) for lg in logits]
    # a "target" whose greedy token at p is the draft of a random module k at p-k: non-trivial chains
    argmax = torch.randint(0, V, (2, T), generator=g)
    pick = torch.randint(0, 4, (2, T), generator=g)
    for k in (1, 2, 3):
        sel = pick[:, k:] == k
        argmax[:, k:][sel] = preds[k - 1][:, :T - k][sel]
    batch.argmax = argmax
    _, m = d.loss(batch)
    full = live = None
    tau = 1.0
    for i in range(3):
        k = i + 1
        correct = torch.zeros(2, T, dtype=torch.bool)
        correct[:, :T - k] = preds[i][:, :T - k] == argmax[:, k:]
        valid = torch.zeros(2, T, dtype=torch.bool)
        valid[:, :T - k - 1] = mask[:, k + 1:]
        # the one definition (speculators.losses.chained_acceptance): chains whose drafts 1..k are all labelled
        live = valid if live is None else live & valid
        new_full = correct if full is None else full & correct
        acc = float((new_full & live).sum() / live.sum())
        assert m[f"full_acc_{i}"] == pytest.approx(acc)
        den = (live if full is None else full & live).sum()
        assert m[f"cond_acc_{i}"] == pytest.approx(float((new_full & live).sum() / den) if den else 0.0)
        full = new_full
        tau += acc
    assert m["sim_tau"] == pytest.approx(tau)
    assert m["full_acc_0"] > m["full_acc_1"] > 0  # the check above is not trivially 0 == 0


def test_training_reduces_loss_and_improves_acceptance(target):
    """Hard CE on target-regenerated (greedy) responses also raises the chained greedy accuracy."""
    d = make_drafter(target, num_modules=2)
    prompts = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(7))
    ids = torch.stack([torch.cat([p, torch.tensor(plain_decode(target, p.tolist(), 20, eos_ids=set()).tokens)])
                       for p in prompts])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False
    batch, _ = batch_for(target, ids, mask)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first, m0 = d.loss(batch)
    for _ in range(60):
        loss, m = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * float(first.detach())
    assert m["sim_tau"] > m0["sim_tau"] + 0.2
    assert not d.embed_tokens.weight.requires_grad


# ----------------------------------------------------------------------------- formats


def test_export_format(target, tmp_path):
    d = make_drafter(target, num_modules=2)
    path = d.save_pretrained(tmp_path / "ckpt", recipe_yaml="x: 1\n")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "mtp" and sc["proposal_methods"][0]["speculative_tokens"] == 2
    assert sc["verifier"]["name_or_path"] == target.name_or_path
    assert cfg["num_nextn_predict_layers"] == 2
    tl = cfg["transformer_layer_config"]
    assert tl["hidden_size"] == 64 and tl["num_hidden_layers"] == 4 and tl["model_type"] == "llama"
    assert tl.get("rope_theta", (tl.get("rope_parameters") or {}).get("rope_theta")) == 10000.0
    w = load_file(str(path / "model.safetensors"))
    H = 64
    expected = {"embed_tokens.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.{n}.weight" for n in (
            "enorm", "hnorm", "eh_proj", "input_layernorm", "post_attention_layernorm",
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(w) == expected
    assert w["layers.1.eh_proj.weight"].shape == (H, 2 * H)
    assert w["embed_tokens.weight"].shape == (V, H)
    # identical weights/config/proposals after from_pretrained: tests/drafters/test_contracts.py


# ----------------------------------------------------------------------------- CLI


def test_cli_rejects_an_invalid_joint_target_section(tmp_path, isolated_cache, tiny_target_dir):
    r = CliRunner().invoke(app, ["train", str(TINY), f"target.model={tiny_target_dir}", "drafter.joint=true",
                                 "drafter.joint_target.lora_r=0", "-o", str(tmp_path / "joint")])
    assert r.exit_code == 2 and "drafter.joint_target.lora_r" in r.output and "Traceback" not in r.output
