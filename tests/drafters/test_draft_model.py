"""Draft model: layer-skip initialisation, the distillation losses by hand, the cached decoder against a full
forward, the export as a plain transformers checkpoint (``AutoModelForCausalLM`` loads it and gives our logits;
the target's tokenizer beside it), and the config's refusals. The family contracts (lossless chains and trees,
batching, sampling, save/load) are in test_contracts.py; the llama.cpp conversion and ``draft-simple`` serving
are in tests/engines/test_llamacpp.py."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.divergences import LossMix
from speculators.drafters import Drafter, registry
from speculators.errors import SpeculatorsError
from speculators.target import build_tiny_target
from conftest import batch_for, cli_train_then_eval

V, H, L = 96, 32, 4
FAMILY = registry.get("draft_model")


@pytest.fixture(scope="module")
def target():
    t = build_tiny_target(vocab_size=V, hidden_size=H, num_layers=L, seed=5)
    with torch.no_grad():  # layers that matter: larger random weights than the default init
        for layer in t.model.model.layers:
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.3)
    return t


def make(target, loss=None, **kw):
    torch.manual_seed(0)
    d = FAMILY.from_target(FAMILY.config_class(algorithm="draft_model", **kw), target, DraftVocab.full(V))
    if loss is not None:
        d.distill_loss = LossMix(loss)  # train.loss, as the trainer sets it
    return d


def test_layer_skip_init_copies_the_named_target_layers(target):
    d = make(target, num_layers=2, init_layers=[0, 2])
    src, own = target.model.state_dict(), d.lm.state_dict()
    assert int(d.lm.config.num_hidden_layers) == 2
    for name, t in own.items():
        sname = name.replace("layers.1.", "layers.2.")
        assert torch.equal(t, src[sname].float()), name
    # the default: the first ceil(L / 8) layers, here one
    d1 = make(target)
    assert int(d1.lm.config.num_hidden_layers) == 1
    assert torch.equal(d1.lm.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       src["model.layers.0.mlp.up_proj.weight"])
    # a draft model of ALL the target's layers is the target itself
    full = make(target, num_layers=L)
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full.lm(input_ids=ids).logits, target.model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_random_init_and_frozen_embeddings(target):
    d = make(target, num_layers=1, init="random")
    assert not torch.equal(d.lm.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           target.model.state_dict()["model.layers.0.mlp.up_proj.weight"])
    frozen = {n for n, p in d.named_parameters() if not p.requires_grad}
    assert frozen == {"lm.model.embed_tokens.weight"}  # tied head: the same parameter
    trained = make(target, num_layers=1, train_embeddings=True)
    assert all(p.requires_grad for p in trained.parameters())


def test_the_cached_decoder_equals_a_full_forward_and_crops_back(target):
    d = make(target, num_layers=2).eval()
    ids = torch.randint(0, V, (15,), generator=torch.Generator().manual_seed(1))
    full = d.lm(input_ids=ids[None]).logits[0].float()
    state = d.start(ids[:6], None)
    torch.testing.assert_close(state.logits, full[5], atol=1e-5, rtol=0)
    d.advance([state], [ids[6:11]], [None])
    torch.testing.assert_close(state.logits, full[10], atol=1e-5, rtol=0)
    assert state.length == 11 and d.decoder.slots(state.cache) == 11
    prop = d.propose([state], [4])[0]  # greedy chain: each draft is the argmax after the previous ones
    seq = torch.cat([ids[:11], prop.token_ids])
    ref = d.lm(input_ids=seq[None]).logits[0].float()
    assert prop.token_ids.tolist() == ref[10:14].argmax(-1).tolist()
    assert d.decoder.slots(state.cache) == 11  # the drafts were cropped back off


def _batch(target):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (3, 14), generator=g)
    mask = torch.zeros(3, 14, dtype=torch.bool)
    mask[:, 5:] = True
    mask[1, 11:] = False
    batch, _ = batch_for(target, ids, mask, [14, 12, 9])
    return batch


def test_the_distillation_losses_by_hand(target):
    d = make(target, num_layers=2, loss={"forward_kl": 1.0, "tv": 0.5, "ce": 0.25})
    batch = _batch(target)
    loss, metrics = d.loss(batch)
    with torch.no_grad():
        logits = d.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.double()
    p = torch.softmax(target.model(input_ids=batch.input_ids).logits.double(), -1)
    q = torch.softmax(logits, -1)
    assistant = batch.loss_mask & batch.attention_mask
    kl = tv = ce = 0.0
    n = 0
    for b in range(3):
        for t in range(13):
            if not assistant[b, t + 1]:
                continue
            n += 1
            kl += float(-(p[b, t] * torch.log(q[b, t])).sum())
            tv += float(1 - torch.minimum(p[b, t], q[b, t]).sum())
            ce += float(-torch.log(q[b, t, p[b, t].argmax()]))  # ce: the target's top token
    assert d.loss_counts(batch).tolist() == [n]
    assert metrics["loss_forward_kl"] == pytest.approx(kl / n, rel=1e-4)
    assert metrics["loss_tv"] == pytest.approx(tv / n, rel=1e-4)
    assert metrics["loss_ce"] == pytest.approx(ce / n, rel=1e-4)
    assert metrics["accept_t1"] == pytest.approx(1 - tv / n, rel=1e-4)
    assert float(loss.detach()) == pytest.approx((kl + 0.5 * tv + 0.25 * ce) / n, rel=1e-4)
    # a window's norm divides every term by the window's count
    loss2, _ = d.loss(batch, norm=torch.tensor([2 * n]))
    assert float(loss2.detach()) == pytest.approx(float(loss.detach()) / 2, rel=1e-5)


def test_training_lowers_tv_and_raises_simulated_acceptance(target):
    d = make(target, num_layers=1, loss={"tv": 1.0})
    batch = _batch(target)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    _, before = d.loss(batch)
    for _ in range(40):
        loss, _ = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, after = d.loss(batch)
    assert after["loss_tv"] < 0.8 * before["loss_tv"]
    assert after["sim_tau"] >= before["sim_tau"]


def test_the_export_is_a_plain_transformers_checkpoint(target, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = make(target, num_layers=2)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = d.save_pretrained(tmp_path / "final")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == V  # vLLM: the target's vocab size
    assert cfg["speculators_training"]["drafter"]["algorithm"] == "draft_model"
    loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert AutoConfig.from_pretrained(str(path)).num_hidden_layers == 2
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    ours = d.eval().lm(input_ids=ids).logits
    assert (loaded(input_ids=ids).logits - ours).abs().max() <= 1e-4
    # and our own loader reads it back: the same drafts
    back = Drafter.from_pretrained(path)
    back.attach_target(target)
    s1, s2 = d.start(ids[0], None), back.start(ids[0], None)
    assert d.propose([s1], [5])[0].token_ids.tolist() == back.propose([s2], [5])[0].token_ids.tolist()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_moe_draft_model_round_trips_through_the_checkpoint_layout(arch, tmp_path):
    """Fused in-memory experts are written per expert and read back exactly, by transformers and by us."""
    from transformers import AutoModelForCausalLM

    from speculators.target.tiny import build_tiny_architecture

    moe = build_tiny_architecture(arch, V, H, 2)
    torch.manual_seed(0)
    d = FAMILY.from_target(FAMILY.config_class(algorithm="draft_model", num_layers=1, init="random"), moe,
                           DraftVocab.full(V))
    path = d.save_pretrained(tmp_path / "final")
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
    ours = d.eval().lm(input_ids=ids).logits
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(input_ids=ids).logits
    assert (theirs - ours).abs().max() <= 1e-5
    back = Drafter.from_pretrained(path)
    for (n, a), (_, b) in zip(d.lm.state_dict().items(), back.lm.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_recipe_run_exports_the_tokenizer(tiny_target_dir, tmp_path, isolated_cache):
    """Through ``speculators train``: ``final/`` holds the target's tokenizer, which transformers loads."""
    from pathlib import Path

    from transformers import AutoTokenizer

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-draft_model.yaml"
    cfg, log, rep = cli_train_then_eval(recipe, tiny_target_dir, tmp_path / "run", "train.steps=2")
    final = tmp_path / "run" / "final"
    tok, ref = AutoTokenizer.from_pretrained(str(final)), AutoTokenizer.from_pretrained(str(tiny_target_dir))
    assert tok("def f(x): return x")["input_ids"] == ref("def f(x): return x")["input_ids"]
    assert {"loss_forward_kl", "loss_tv", "accept_t1", "sim_tau"} <= {k.split("/", 1)[1] for r in log for k in r
                                                                        if k.startswith("train/")}
    assert rep["greedy_mismatches"] == []
    from speculators.hub import hub_card

    card = hub_card(final, "me/draft")  # both serving commands
    assert '"num_speculative_tokens": 3, "method": "draft_model"' in card
    assert "-md draft-f16.gguf --spec-type draft-simple" in card


@pytest.mark.parametrize("kw, field", [
    ({"draft_vocab_size": 32}, "draft_vocab_size"),
    ({"init": "random", "init_layers": [0]}, "init_layers"),
    ({"num_layers": 2, "init_layers": [0]}, "init_layers"),
])
def test_config_refusals(kw, field):
    with pytest.raises(ValueError, match=field):
        FAMILY.config_class(algorithm="draft_model", **kw)


def test_layers_beyond_the_target_are_refused(target):
    with pytest.raises(SpeculatorsError, match="init_layers"):
        make(target, num_layers=2, init_layers=[0, L])
    with pytest.raises(SpeculatorsError, match="init_layers"):
        make(target, num_layers=L + 1)
    with pytest.raises(SpeculatorsError, match="full vocabulary"):
        FAMILY.from_target(FAMILY.config_class(algorithm="draft_model"), target,
                           DraftVocab.from_counts(torch.ones(V), 32))
