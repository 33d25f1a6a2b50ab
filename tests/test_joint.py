"""Joint training (Medusa-2, joint MTP): the target is fine-tuned with LoRA inside the training step.

Checked: the live target's forward equals the frozen features before any update; the LM loss equals
transformers' own shifted-label loss; the joint loss is ``lm_weight * L_LM + w * family loss``;
gradients reach the LoRA adapters (not the frozen weights); the optimizer gets separate learning
rates; resume restores the adapter exactly; the CLI writes the adapter and the perplexity card, and
``speculators eval`` verifies against the merged, fine-tuned target (greedy output == its plain output).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import speculators.drafters.medusa  # noqa: F401  (registers the families)
import speculators.drafters.mtp  # noqa: F401
from speculators.cli import app
from speculators.drafters import Drafter, DraftVocab, registry
from speculators.errors import SpeculatorsError
from speculators.target import Target, build_tiny_target
from conftest import batch_for

V = 96
ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {"medusa": dict(num_heads=3), "mtp": dict(num_modules=2)}


def fresh_target(seed: int = 1) -> Target:
    # function scope on purpose: joint training injects LoRA layers into the target model in place
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=seed)


def joint_drafter(target, algorithm: str, **kw):
    torch.manual_seed(0)
    family = registry.get(algorithm)
    cfg = family.config_class(algorithm=algorithm, joint=True, **FAMILIES[algorithm], **kw)
    d = family.from_target(cfg, target, DraftVocab.full(V))
    d.enable_joint_training(target)
    return d



def sample_batch(target, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 14), generator=g)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 8:] = True
    return batch_for(target, ids, mask)[0]


def perturb_lora(d, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.joint_target.lora_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


# ----------------------------------------------------------------------------- config


def test_configs_accept_joint_and_validate_the_target_section():
    for algo in FAMILIES:
        cls = registry.get(algo).config_class
        c = cls(algorithm=algo, joint=True, joint_target={"lora_r": 4, "lr": 1e-4})
        assert c.joint and c.joint_target.lora_r == 4 and c.joint_target.lr == 1e-4
        with pytest.raises(ValueError, match="lora_rank"):
            cls(algorithm=algo, joint=True, joint_target={"lora_rank": 4})
        with pytest.raises(ValueError, match="lora_dropout"):
            cls(algorithm=algo, joint=True, joint_target={"lora_dropout": 1.5})
        with pytest.raises(ValueError, match=r"\['lm_head'\] cannot be adapted"):
            cls(algorithm=algo, joint=True, joint_target={"lora_modules": ["q_proj", "lm_head"]})
        with pytest.raises(ValueError, match="joint_target is only read with drafter.joint: true"):
            cls(algorithm=algo, joint_target={"lora_r": 4})
        # a frozen config's dump (what a checkpoint and a resolved recipe store) validates again
        frozen = cls(algorithm=algo)
        assert cls.model_validate(frozen.model_dump()) == frozen
    mtp = registry.get("mtp").config_class
    assert mtp(algorithm="mtp").loss_lambda == 1.0  # frozen: the MTP loss is the only loss
    assert mtp(algorithm="mtp", joint=True).loss_lambda == 0.3  # DeepSeek-V3's lambda
    assert mtp(algorithm="mtp", joint=True, loss_lambda=0.1).loss_lambda == 0.1
    assert registry.get("medusa").config_class(algorithm="medusa").joint_head_weight == 0.2


def test_unknown_lora_module_is_a_clear_error():
    t = fresh_target()
    family = registry.get("mtp")
    cfg = family.config_class(algorithm="mtp", joint=True, num_modules=1, joint_target={"lora_modules": ["qkv"]})
    d = family.from_target(cfg, t, DraftVocab.full(V))
    with pytest.raises(SpeculatorsError, match=r"joint_target.lora_modules: \['qkv'\]"):
        d.enable_joint_training(t)


# ----------------------------------------------------------------------------- the joint forward


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_live_target_equals_cached_features_before_any_update(algorithm):
    t = fresh_target()
    batch = sample_batch(t)
    d = joint_drafter(t, algorithm)
    with torch.no_grad():
        live, lm_loss, metrics = d.joint_target(batch)
    real = batch.attention_mask
    torch.testing.assert_close(live.top[real], batch.top[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(live.argmax[real], batch.argmax[real])
    n_labels = int((batch.loss_mask[:, 1:] & real[:, 1:]).sum())  # assistant tokens x_{t+1}, t >= 0
    assert metrics["lm_tokens"] == n_labels
    assert metrics["lm_loss"] == pytest.approx(metrics["lm_nll_sum"] / n_labels, rel=1e-6)
    # once the adapters move, the live features do too
    perturb_lora(d)
    with torch.no_grad():
        moved, _, _ = d.joint_target(batch)
    assert not torch.allclose(moved.top[real], batch.top[real], atol=1e-3)


def test_lm_loss_equals_transformers_shifted_label_loss():
    t = fresh_target()
    batch = sample_batch(t, seed=3)
    d = joint_drafter(t, "mtp")
    perturb_lora(d, seed=1)
    with torch.no_grad():
        _, lm_loss, _ = d.joint_target(batch)
        labels = batch.input_ids.masked_fill(~batch.loss_mask, -100)  # HF shifts: logits[t] vs labels[t+1]
        ref = d.joint_target.peft.get_base_model()(input_ids=batch.input_ids, labels=labels).loss
    torch.testing.assert_close(lm_loss, ref, atol=1e-5, rtol=1e-5)
    # an off-by-one label would not match
    with torch.no_grad():
        wrong = d.joint_target.peft.get_base_model()(input_ids=batch.input_ids,
                                                     labels=torch.roll(labels, 1, dims=1)).loss
    assert abs(float(wrong) - float(lm_loss)) > 1e-3


@pytest.mark.parametrize("algorithm, weight", [("medusa", 0.2), ("mtp", 1.0)])
def test_joint_loss_is_the_weighted_sum(algorithm, weight):
    t = fresh_target()
    batch = sample_batch(t)
    d = joint_drafter(t, algorithm, joint_target={"lm_weight": 0.7})
    perturb_lora(d)
    total, metrics = d.training_loss(batch)
    live, lm_loss, _ = d.joint_target(batch)
    own, m = d.loss(live)
    assert d.joint_loss_weight == weight
    torch.testing.assert_close(total, 0.7 * lm_loss + weight * own)
    per = [m[f"loss_{j}"] for j in range(len([k for k in m if k.startswith("loss_")]))]
    own = own.detach()
    if algorithm == "medusa":  # Medusa-2: 0.2 * sum_k 0.8^(k-1) CE_k
        assert float(own) == pytest.approx(sum(0.8 ** j * x for j, x in enumerate(per)), rel=1e-5)
    else:  # joint MTP: lambda = 0.3 (DeepSeek-V3) times the mean over modules
        assert float(own) == pytest.approx(0.3 * sum(per) / len(per), rel=1e-5)
    assert metrics["drafter_loss"] == pytest.approx(float(own), rel=1e-5)
    assert metrics["lm_loss"] == pytest.approx(float(lm_loss), rel=1e-5)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_gradients_reach_the_adapters_and_the_drafter_not_the_frozen_weights(algorithm):
    t = fresh_target()
    batch = sample_batch(t)
    d = joint_drafter(t, algorithm, joint_target={"lr": 1e-5})
    groups = d.param_groups(1e-3)
    assert [g["lr"] for g in groups] == [1e-3, 1e-5]
    lora = groups[1]["params"]
    assert lora and all("lora_" in n for n, p in d.joint_target.peft.named_parameters() if p.requires_grad)
    assert {id(p) for p in groups[0]["params"]}.isdisjoint({id(p) for p in lora})
    loss, _ = d.training_loss(batch)
    loss.backward()
    # B starts at zero, so at step 0 only the B matrices get gradient; the drafter's own weights too
    b_grads = [p.grad for n, p in d.joint_target.peft.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in b_grads)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[0]["params"])
    frozen = [p for n, p in d.joint_target.peft.named_parameters() if "lora_" not in n]
    assert frozen and all(p.grad is None and not p.requires_grad for p in frozen)
    assert joint_drafter(fresh_target(), algorithm).param_groups(1e-3)[1]["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_the_drafter_loss_alone_trains_the_target(algorithm):
    # lm_weight 0: any adapter gradient comes through the live hidden states the drafter reads
    t = fresh_target()
    d = joint_drafter(t, algorithm, joint_target={"lm_weight": 0.0})
    loss, _ = d.training_loss(sample_batch(t))
    loss.backward()
    b_grads = [p.grad for n, p in d.joint_target.peft.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in b_grads)


def test_state_dict_excludes_the_target_and_resume_restores_the_adapter(tmp_path):
    t = fresh_target()
    d = joint_drafter(t, "mtp")
    perturb_lora(d, seed=5)
    sd = d.export_state_dict()
    assert sd and not [k for k in sd if "joint_target" in k or "lora" in k]
    d.save_pretrained(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_training"]["target_adapter"] == "target_adapter"
    assert (tmp_path / "ck" / "target_adapter" / "adapter_model.safetensors").is_file()
    # a fresh joint drafter on a fresh target gets the same adapters back (trainer resume path)
    t2 = fresh_target()
    d2 = joint_drafter(t2, "mtp")
    d2.load_export_state_dict(load := Drafter.from_pretrained(tmp_path / "ck").export_state_dict())
    d2.load_target_adapter(tmp_path / "ck")
    a = dict(d.joint_target.peft.named_parameters())
    b = dict(d2.joint_target.peft.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, d.export_state_dict()[k]) for k, v in load.items())


def test_merged_target_equals_the_adapted_target_and_missing_adapter_is_an_error(tmp_path):
    t = fresh_target()
    d = joint_drafter(t, "medusa")
    perturb_lora(d, seed=2)
    batch = sample_batch(t)
    with torch.no_grad():
        live, _, _ = d.joint_target(batch)
    d.save_pretrained(tmp_path / "ck")
    loaded = Drafter.from_pretrained(tmp_path / "ck")
    assert loaded.target_adapter_dir == tmp_path / "ck" / "target_adapter"
    base = fresh_target()
    fp = base.fingerprint
    loaded.prepare_target(base, log=lambda *_: None)
    assert base.fingerprint != fp  # the verifier is now the fine-tuned model
    f = base.features(batch.input_ids)
    real = batch.attention_mask
    torch.testing.assert_close(f.top[real], live.top[real], atol=1e-4, rtol=1e-4)
    assert not any(p.requires_grad for p in base.model.parameters())
    import shutil

    shutil.rmtree(tmp_path / "ck" / "target_adapter")
    with pytest.raises(SpeculatorsError, match="without its target adapter"):
        Drafter.from_pretrained(tmp_path / "ck")


def test_init_from_checks_the_family(tmp_path):
    t = fresh_target()
    med = joint_drafter(t, "medusa")
    med.save_pretrained(tmp_path / "medusa")
    t2 = fresh_target()
    d = joint_drafter(t2, "mtp")
    with pytest.raises(SpeculatorsError, match="'medusa' checkpoint; this recipe trains 'mtp'"):
        d.init_from_checkpoint(tmp_path / "medusa")
    with pytest.raises(SpeculatorsError, match="train.init_from"):
        d.init_from_checkpoint(tmp_path / "nowhere")
    other = joint_drafter(fresh_target(seed=7), "mtp")  # same shapes, another target
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SpeculatorsError, match="trained for another target"):
        d.init_from_checkpoint(tmp_path / "other")
    # a frozen-target MTP checkpoint initialises a joint one (the adapters stay fresh)
    frozen_cfg = registry.get("mtp").config_class(algorithm="mtp", num_modules=2)
    frozen = registry.get("mtp").from_target(frozen_cfg, fresh_target(), DraftVocab.full(V))
    with torch.no_grad():
        for p in frozen.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    frozen.save_pretrained(tmp_path / "frozen")
    d.init_from_checkpoint(tmp_path / "frozen")
    ref = frozen.export_state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in d.export_state_dict().items())


# ----------------------------------------------------------------------------- CLI end to end


@pytest.mark.parametrize("recipe", ["tiny-mtp.yaml", "tiny-medusa.yaml"])
def test_cli_joint_train_then_eval_against_the_fine_tuned_target(recipe, tmp_path, isolated_cache,
                                                                 tiny_target_dir):
    runner = CliRunner()
    out = tmp_path / "run"
    r = runner.invoke(app, ["train", str(ROOT / "recipes" / recipe), f"target.model={tiny_target_dir}",
                            "drafter.joint=true", "drafter.joint_target.lr=0.02", "train.steps=2",
                            "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert "joint: the target is trained too" in r.output and "step 0: held-out" in r.output
    final = out / "final"
    assert (final / "target_adapter" / "adapter_config.json").is_file()
    card = (final / "README.md").read_text()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    before = [x["held_out_before/ppl"] for x in log if "held_out_before/ppl" in x]
    after = [x["held_out/ppl"] for x in log if "held_out/ppl" in x]
    assert len(before) == 1 and after and before[0] > 1.0
    assert f"Target held-out perplexity: {before[0]:.4f} -> {after[-1]:.4f}" in card and "target_adapter/" in card
    assert any("train/lm_loss" in x for x in log) and any("train/lr_target" in x for x in log)
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["lora_adapter"] == "target_adapter"
    # the adapter moved the target: eval must verify against the merged model, and stay lossless
    base = Target.load(str(tiny_target_dir), log=lambda *_: None)
    base_fp = base.fingerprint
    Drafter.from_pretrained(final).prepare_target(base, log=lambda *_: None)
    merged_fp = base.fingerprint
    assert merged_fp != base_fp
    r = runner.invoke(app, ["eval", str(out), "--temperature", "0", "-k", "2", "--num-prompts", "2",
                            "--max-new-tokens", "10"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert "merged the jointly trained LoRA adapter" in r.output
    rep = json.loads((out / "eval-k2-t0" / "report.json").read_text())
    assert rep["greedy_mismatches"] == []
    assert rep["target"]["fingerprint"] == merged_fp  # eval verified against the fine-tuned target
    # resume from the step-2 checkpoint of a copy: the card keeps the perplexity measured before step 1
    import shutil

    res = tmp_path / "resumed"
    shutil.copytree(out, res)
    shutil.rmtree(res / "final")
    r = runner.invoke(app, ["train", str(ROOT / "recipes" / recipe), f"target.model={tiny_target_dir}",
                            "drafter.joint=true", "drafter.joint_target.lr=0.02", "train.steps=2",
                            "-o", str(res), "--resume"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert "step 0: held-out" not in r.output
    assert f"Target held-out perplexity: {before[0]:.4f} ->" in (res / "final" / "README.md").read_text()


def test_cli_joint_needs_held_out_prompts(tmp_path, isolated_cache, tiny_target_dir):
    r = CliRunner().invoke(app, ["train", str(ROOT / "recipes" / "tiny-mtp.yaml"), f"target.model={tiny_target_dir}",
                                 "drafter.joint=true", "data.held_out.fraction=0", "-o", str(tmp_path / "run")])
    assert r.exit_code == 2 and "data.held_out.fraction" in r.output, r.output
    assert not (tmp_path / "run").exists()
