"""Joint training (Medusa-2, joint MTP): the target is fine-tuned with LoRA inside the training step.

Checked: the live target's forward (``Target.train_forward``) equals the frozen features before any
update; the LM loss equals transformers' own shifted-label loss; the training unit's joint loss is
``lm_weight * L_LM + w * family loss``; gradients reach the LoRA adapters (not the frozen weights); the
optimizer gets separate learning rates; resume restores the adapter exactly; a joint drafter is never
saved without its adapter; the CLI writes the adapter and the perplexity card, and ``speculators eval``
verifies against the merged, fine-tuned target (greedy output == its plain output). Layering: the LoRA
code lives with the target, nothing outside the ``target`` package touches the target's model, and the trainer
names no joint-only metric.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import speculators.drafters.medusa  # noqa: F401  (registers the families)
import speculators.drafters.mtp  # noqa: F401
from speculators.cli import app
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import init_from_checkpoint
from speculators.errors import SpeculatorsError
from speculators.target import Target, build_tiny_target
from speculators.train.unit import TrainingUnit
from conftest import batch_for

V = 96
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"medusa": dict(num_heads=3), "mtp": dict(num_modules=2)}


def fresh_target(seed: int = 1) -> Target:
    # function scope on purpose: joint training injects LoRA layers into the target model in place
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=seed)


def joint_unit(target, algorithm: str, **kw) -> TrainingUnit:
    """A fresh joint drafter of ``algorithm`` and ``target`` adapted with LoRA (in place), as one unit."""
    torch.manual_seed(0)
    family = registry.get(algorithm)
    cfg = family.config_class(algorithm=algorithm, joint=True, **FAMILIES[algorithm], **kw)
    d = family.from_target(cfg, target, DraftVocab.full(V))
    target.adapt_lora(cfg.joint_target)
    return TrainingUnit(d, target)


def live(target, batch, norm=None):
    return target.train_forward(batch.input_ids, batch.attention_mask, batch.loss_mask, norm)


def sample_batch(target, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 14), generator=g)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 8:] = True
    return batch_for(target, ids, mask)[0]


def perturb_lora(target, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in target.lora_parameters():
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
        t.adapt_lora(cfg.joint_target)
    assert not t.adapted
    with pytest.raises(SpeculatorsError, match="adapt_lora"):  # the unit needs the adapted target
        TrainingUnit(d, t)
    with pytest.raises(SpeculatorsError, match="adapt_lora"):
        TrainingUnit(d)


def test_target_lora_api_guards():
    """adapt_lora once; merge_adapter only into an unadapted target; adapter-only methods need adapters;
    an adapted target with a frozen-target drafter is refused; the fingerprint stays the base model's."""
    t = fresh_target()
    fp = t.fingerprint
    with pytest.raises(SpeculatorsError, match="adapt_lora"):
        t.lora_parameters()
    cfg = registry.get("mtp").config_class(algorithm="mtp", joint=True, num_modules=1)
    t.adapt_lora(cfg.joint_target)
    assert t.adapted and t.lora_parameters() and t.fingerprint == fp
    with pytest.raises(SpeculatorsError, match="already has LoRA adapters"):
        t.adapt_lora(cfg.joint_target)
    with pytest.raises(SpeculatorsError, match="being trained with its own LoRA adapters"):
        t.merge_adapter("anywhere")
    frozen_cfg = registry.get("mtp").config_class(algorithm="mtp", num_modules=1)
    frozen = registry.get("mtp").from_target(frozen_cfg, t, DraftVocab.full(V))
    with pytest.raises(SpeculatorsError, match="drafter.joint is false"):
        TrainingUnit(frozen, t)
    assert TrainingUnit(frozen, fresh_target()).target is None  # a frozen target is not trained


# ----------------------------------------------------------------------------- the joint forward


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_live_target_equals_cached_features_before_any_update(algorithm):
    t = fresh_target()
    batch = sample_batch(t)
    unit = joint_unit(t, algorithm)
    with torch.no_grad():
        out = live(t, batch)
        _, metrics = unit.loss(batch)
    real = batch.attention_mask
    torch.testing.assert_close(out.top[real], batch.top[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.argmax[real], batch.argmax[real])
    n_labels = int((batch.loss_mask[:, 1:] & real[:, 1:]).sum())  # assistant tokens x_{t+1}, t >= 0
    assert out.n_labels == n_labels and metrics["lm_tokens"] == n_labels
    assert int(unit.loss_counts(batch)[-1]) == n_labels  # the label count needs no forward
    assert metrics["lm_loss"] == pytest.approx(metrics["lm_nll_sum"] / n_labels, rel=1e-6)
    assert float(out.lm_loss) == pytest.approx(out.nll_sum / n_labels, rel=1e-6)
    # once the adapters move, the live features do too
    perturb_lora(t)
    with torch.no_grad():
        moved = live(t, batch)
    assert not torch.allclose(moved.top[real], batch.top[real], atol=1e-3)


def test_lm_loss_equals_transformers_shifted_label_loss():
    t = fresh_target()
    batch = sample_batch(t, seed=3)
    joint_unit(t, "mtp")
    perturb_lora(t, seed=1)
    with torch.no_grad():
        lm_loss = live(t, batch).lm_loss
        labels = batch.input_ids.masked_fill(~batch.loss_mask, -100)  # HF shifts: logits[t] vs labels[t+1]
        ref = t.model(input_ids=batch.input_ids, labels=labels).loss  # the HF model, adapters injected
    torch.testing.assert_close(lm_loss, ref, atol=1e-5, rtol=1e-5)
    # an off-by-one label would not match
    with torch.no_grad():
        wrong = t.model(input_ids=batch.input_ids, labels=torch.roll(labels, 1, dims=1)).loss
    assert abs(float(wrong) - float(lm_loss)) > 1e-3


@pytest.mark.parametrize("algorithm, weight", [("medusa", 0.2), ("mtp", 1.0)])
def test_joint_loss_is_the_weighted_sum(algorithm, weight):
    t = fresh_target()
    batch = sample_batch(t)
    unit = joint_unit(t, algorithm, joint_target={"lm_weight": 0.7})
    d = unit.drafter
    perturb_lora(t)
    total, metrics = unit.loss(batch)
    out = live(t, batch)
    lm_loss = out.lm_loss
    own, m = d.loss(dataclasses.replace(batch, top=out.top.float(), argmax=out.argmax))
    assert d.joint_loss_weight == weight
    torch.testing.assert_close(total, 0.7 * lm_loss + weight * own)
    per = [m[f"loss_{j}"] for j in range(len([k for k in m if k.startswith("loss_")]))]
    own = own.detach()
    if algorithm == "medusa":  # Medusa-2: 0.2 * sum_k 0.8^(k-1) CE_k
        assert float(own) == pytest.approx(sum(0.8 ** j * x for j, x in enumerate(per)), rel=1e-5)
    else:  # joint MTP: lambda = 0.3 (DeepSeek-V3) times the mean over modules
        assert float(own) == pytest.approx(0.3 * sum(per) / len(per), rel=1e-5)
    assert metrics["drafter_loss"] == pytest.approx(float(own), rel=1e-5)
    assert metrics["lm_loss"] == pytest.approx(float(lm_loss.detach()), rel=1e-5)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_gradients_reach_the_adapters_and_the_drafter_not_the_frozen_weights(algorithm):
    t = fresh_target()
    batch = sample_batch(t)
    unit = joint_unit(t, algorithm, joint_target={"lr": 1e-5})
    groups = unit.param_groups(1e-3)
    assert [g["lr"] for g in groups] == [1e-3, 1e-5] and [g["name"] for g in groups] == ["drafter", "target"]
    lora = groups[1]["params"]
    assert lora and all("lora_" in n for n, p in t.model.named_parameters() if p.requires_grad)
    assert {id(p) for p in lora} == {id(p) for n, p in t.model.named_parameters() if "lora_" in n}
    assert {id(p) for p in groups[0]["params"]}.isdisjoint({id(p) for p in lora})
    # every trained weight is reachable from the unit (gradient clipping, finiteness checks, train/eval)
    assert {id(p) for g in groups for p in g["params"]} <= {id(p) for p in unit.parameters()}
    unit.train()
    assert t.model.training
    unit.eval()
    assert not t.model.training
    loss, _ = unit.loss(batch)
    loss.backward()
    # B starts at zero, so at step 0 only the B matrices get gradient; the drafter's own weights too
    b_grads = [p.grad for n, p in t.model.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in b_grads)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[0]["params"])
    frozen = [p for n, p in t.model.named_parameters() if "lora_" not in n]
    assert frozen and all(p.grad is None and not p.requires_grad for p in frozen)
    assert joint_unit(fresh_target(), algorithm).param_groups(1e-3)[1]["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
def test_the_drafter_loss_alone_trains_the_target(algorithm):
    # lm_weight 0: any adapter gradient comes through the live hidden states the drafter reads
    t = fresh_target()
    unit = joint_unit(t, algorithm, joint_target={"lm_weight": 0.0})
    loss, _ = unit.loss(sample_batch(t))
    loss.backward()
    b_grads = [p.grad for n, p in t.model.named_parameters() if "lora_B" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in b_grads)


def test_state_dict_excludes_the_target_and_resume_restores_the_adapter(tmp_path):
    t = fresh_target()
    unit = joint_unit(t, "mtp")
    d = unit.drafter
    perturb_lora(t, seed=5)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.01)
    sd = d.serving.state_dict(d)
    assert sd and not [k for k in sd if "joint_target" in k or "lora" in k]
    unit.save(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_training"]["target_adapter"] == "target_adapter"
    assert (tmp_path / "ck" / "target_adapter" / "adapter_model.safetensors").is_file()
    # a fresh joint unit on a fresh target gets the same drafter and adapters back (trainer resume path)
    t2 = fresh_target()
    unit2 = joint_unit(t2, "mtp")
    unit2.load(tmp_path / "ck")
    a = dict(t.model.named_parameters())
    b = dict(t2.model.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, sd[k]) for k, v in unit2.drafter.serving.state_dict(unit2.drafter).items())
    # a checkpoint without the adapter cannot resume a joint run
    shutil.rmtree(tmp_path / "ck" / "target_adapter")
    with pytest.raises(SpeculatorsError, match="no target adapter to resume from"):
        joint_unit(fresh_target(), "mtp").load(tmp_path / "ck")


def test_a_joint_drafter_is_never_saved_or_loaded_without_its_adapter(tmp_path):
    """The drafter of a joint run is only valid with the fine-tuned target: saving it without the
    adapted target is refused, a loaded one carries its adapter along when saved again, and a checkpoint
    that lost the adapter's weights (or its config's adapter entry) does not load."""
    t = fresh_target()
    unit = joint_unit(t, "medusa")
    perturb_lora(t, seed=4)
    with pytest.raises(SpeculatorsError, match="only valid with the target's LoRA adapter"):
        unit.drafter.save_pretrained(tmp_path / "bare")
    assert not (tmp_path / "bare").exists()
    unit.drafter.save_pretrained(tmp_path / "ck", target=t)  # same as unit.save
    loaded = Drafter.from_pretrained(tmp_path / "ck")
    loaded.save_pretrained(tmp_path / "again")  # the loaded adapter goes along
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "again" / "target_adapter" / name).read_bytes() == \
            (tmp_path / "ck" / "target_adapter" / name).read_bytes()
    assert Drafter.from_pretrained(tmp_path / "again").target_adapter_dir == tmp_path / "again" / "target_adapter"
    (tmp_path / "again" / "target_adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(SpeculatorsError, match="adapter_model.safetensors is missing"):
        Drafter.from_pretrained(tmp_path / "again")
    cfg_file = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["speculators_training"]["target_adapter"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(SpeculatorsError, match="without its target adapter"):
        Drafter.from_pretrained(tmp_path / "ck")


def test_merged_target_equals_the_adapted_target_and_missing_adapter_is_an_error(tmp_path):
    t = fresh_target()
    unit = joint_unit(t, "medusa")
    perturb_lora(t, seed=2)
    batch = sample_batch(t)
    with torch.no_grad():
        out = live(t, batch)
    unit.save(tmp_path / "ck")
    loaded = Drafter.from_pretrained(tmp_path / "ck")
    assert loaded.target_adapter_dir == tmp_path / "ck" / "target_adapter"
    base = fresh_target()
    fp = base.fingerprint
    base.merge_adapter(loaded.target_adapter_dir)
    assert base.fingerprint != fp  # the verifier is now the fine-tuned model
    f = base.features(batch.input_ids)
    real = batch.attention_mask
    torch.testing.assert_close(f.top[real], out.top[real], atol=1e-4, rtol=1e-4)
    assert not any(p.requires_grad for p in base.model.parameters()) and not base.adapted
    with pytest.raises(SpeculatorsError, match="cannot apply the target adapter"):
        fresh_target().merge_adapter(tmp_path / "nowhere")
    shutil.rmtree(tmp_path / "ck" / "target_adapter")
    with pytest.raises(SpeculatorsError, match="without its target adapter"):
        Drafter.from_pretrained(tmp_path / "ck")


def test_init_from_checks_the_family(tmp_path):
    t = fresh_target()
    joint_unit(t, "medusa").save(tmp_path / "medusa")
    t2 = fresh_target()
    d = joint_unit(t2, "mtp").drafter
    with pytest.raises(SpeculatorsError, match="'medusa' checkpoint; this recipe trains 'mtp'"):
        init_from_checkpoint(d, tmp_path / "medusa")
    with pytest.raises(SpeculatorsError, match="train.init_from"):
        init_from_checkpoint(d, tmp_path / "nowhere")
    joint_unit(fresh_target(seed=7), "mtp").save(tmp_path / "other")  # same shapes, another target
    with pytest.raises(SpeculatorsError, match="trained for another target"):
        init_from_checkpoint(d, tmp_path / "other")
    # a frozen-target MTP checkpoint initialises a joint one (the adapters stay fresh)
    frozen_cfg = registry.get("mtp").config_class(algorithm="mtp", num_modules=2)
    frozen = registry.get("mtp").from_target(frozen_cfg, fresh_target(), DraftVocab.full(V))
    with torch.no_grad():
        for p in frozen.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    frozen.save_pretrained(tmp_path / "frozen")
    init_from_checkpoint(d, tmp_path / "frozen")
    ref = frozen.serving.state_dict(frozen)
    assert all(torch.equal(v, ref[k]) for k, v in d.serving.state_dict(d).items())


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
    base.merge_adapter(Drafter.from_pretrained(final).target_adapter_dir)
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


# ----------------------------------------------------------------------------- layering


def _attribute_uses(path: Path, attrs: set[str], owners: set[str] | None) -> list[str]:
    """``owner.attr`` uses in ``path`` (``owners`` None: any owner), as ``file:line owner.attr``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in attrs:
            owner = ast.unparse(node.value)
            if owners is None or owner in owners or owner.endswith(".target"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.attr}")
    return found


def _code_without_docstrings(path: Path) -> str:
    """The module's code (identifiers and string literals) without docstrings and comments."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body[0] = ast.Pass()
    return ast.unparse(tree)


def test_only_target_py_touches_the_target_model_and_the_trainer_names_no_joint_metric():
    """LoRA adaptation, the adapted forward, adapter save/load and merge live in
    the target package; no other module reaches into a Target's model or private fields; the trainer steps a unit
    and names no joint-only metric nor writes joint-only text."""
    package = ROOT / "speculators"
    private = {"_fingerprint", "_lora", "_stop_override", "_marker_cache"}
    bad = []
    for f in sorted(package.rglob("*.py")):
        if f.relative_to(package).parts[0] == "target":  # the target package
            continue
        bad += _attribute_uses(f, private, None)  # Target's private fields, whatever the variable
        bad += [u for u in _attribute_uses(f, {"model"}, {"target", "base", "verifier", "t", "tgt"})
                if not u.split()[-1].startswith(("recipe.", "rec.", "spec."))]  # the recipe's target.model string
    assert not bad, bad
    code = _code_without_docstrings(package / "train" / "trainer.py")  # what the trainer does, not what it explains
    for name in ("lm_nll_sum", "lm_tokens", "ppl", "lr_target", "joint", "adapter", "perplexity", "LoRA"):
        assert name not in code, name
    from speculators.drafters.base import Drafter as Base

    for gone in ("training_loss", "training_loss_counts", "enable_joint_training", "param_groups",
                 "load_target_adapter", "prepare_target"):
        assert not hasattr(Base, gone), gone
