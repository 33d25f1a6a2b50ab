"""Online target features (``data.features: online``).

* For every registered family, a batch of a tokens-only store gives the same loss counts and the same
  loss (atol 1e-5) through an online training unit (the frozen target runs in the step) as the same
  batch of the offline cache through an offline unit, in float32 and bfloat16 feature storage.
* The frozen target is not part of the unit: not trained, not in the optimizer, not saved; one target
  forward per batch (the counts' forward is reused by the loss).
* End to end: ``train_run`` of the tiny EAGLE-3 recipe logs the same first-step loss in both modes and
  writes the same weight names; online + joint is one clear recipe error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import speculators.drafters  # noqa: F401  (registers the families)
from speculators.data.dataset import make_batch
from speculators.data.features import FeatureStore, TokenizedExample, extract_features
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.errors import SpeculatorsError
from speculators.recipe import load_recipe
from speculators.target import build_tiny_target
from speculators.train.unit import TrainingUnit

ROOT = Path(__file__).resolve().parents[2]
V = 96


def tiny_drafter_cfg(algorithm: str):
    recipes = {yaml.safe_load(p.read_text())["drafter"]["algorithm"]: p for p in ROOT.glob("recipes/tiny-*.yaml")}
    raw = yaml.safe_load(recipes[algorithm].read_text())["drafter"]
    fields = set(registry.get(algorithm).config_class.model_fields)
    if raw.get("draft_vocab_size"):
        raw["draft_vocab_size"] = 64
    if "noise" in fields:
        raw["noise"] = 0.0
    if "r_min" in fields:  # sampled training elements: keep all, so that the loss is deterministic
        raw.update(r=1.0, r_min=1.0)
    if "num_anchors" in fields:
        raw["num_anchors"] = 100_000
    return registry.get(algorithm).config_class.model_validate(raw)


def tokenized(n: int = 5, seed: int = 0) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(10, 30, (1,), generator=g))
        ids = torch.randint(0, V, (L,), generator=g).tolist()
        mask = [0] * (L // 3) + [1] * (L - L // 3)
        out.append(TokenizedExample(f"e{i}", ids, mask))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm", registry.names())
def test_online_loss_equals_offline_loss(algorithm, dtype, isolated_cache):
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    cfg = tiny_drafter_cfg(algorithm)
    family = registry.get(algorithm)
    target.aux_layer_ids = family.serving.default_aux_layer_ids(target.num_layers, cfg)
    exs = tokenized()
    offline = extract_features(target, exs, batch_tokens=64, log=lambda *_: None, dtype=dtype)
    online = FeatureStore.tokens_only(exs, dtype)
    counts = torch.bincount(online.input_ids[online.loss_mask], minlength=V)
    torch.manual_seed(0)
    drafter = family.from_target(cfg, target, DraftVocab.from_counts(counts, cfg.draft_vocab_size))
    off_unit = TrainingUnit(drafter)
    on_unit = TrainingUnit(drafter, target, features="online", feature_dtype=dtype)
    assert on_unit.online and not off_unit.online
    calls = []
    orig = target.features
    target.features = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    idx = list(range(len(exs)))
    b_off, b_on = make_batch(offline, idx), make_batch(online, idx)
    assert b_on.aux.shape[-1] == 0 and b_off.aux.shape[-1] > 0
    c_off = off_unit.loss_counts(b_off.to("cpu"))
    c_on = on_unit.loss_counts(b_on.to("cpu"))
    assert c_on.tolist() == c_off.tolist()
    torch.manual_seed(1)
    l_off, m_off = off_unit.loss(b_off.to("cpu"), c_off)
    torch.manual_seed(1)
    l_on, m_on = on_unit.loss(b_on.to("cpu"), c_on)
    assert torch.isfinite(l_on)
    torch.testing.assert_close(l_on, l_off, atol=1e-5, rtol=0)
    assert m_on.keys() == m_off.keys()
    assert len(calls) == 1  # the counts' forward is reused by the loss
    assert not on_unit._online_cache  # consumed


def test_the_frozen_target_is_not_trained_nor_saved(tmp_path, isolated_cache):
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    cfg = tiny_drafter_cfg("eagle3")
    exs = tokenized()
    store = FeatureStore.tokens_only(exs)
    counts = torch.bincount(store.input_ids[store.loss_mask], minlength=V)
    drafter = registry.get("eagle3").from_target(cfg, target, DraftVocab.from_counts(counts, cfg.draft_vocab_size))
    unit = TrainingUnit(drafter, target, features="online")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    target_params = {id(p) for p in target.model.parameters()}
    assert not target_params & {id(p) for p in unit.parameters()}
    assert all(not target_params & {id(p) for p in g["params"]} for g in unit.param_groups(1e-3))
    assert set(unit.state_dict()) == {f"drafter.{k}" for k in drafter.state_dict()}
    opt = torch.optim.AdamW(unit.param_groups(1e-2))
    unit.train()
    batch = make_batch(store, list(range(len(exs))))
    loss, _ = unit.loss(batch, unit.loss_counts(batch))
    loss.backward()
    opt.step()
    assert not target.model.training  # eval mode inside the step
    assert all(p.grad is None for p in target.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in target.model.state_dict().items())
    path = unit.save(tmp_path / "ck")
    from safetensors.torch import load_file

    assert set(load_file(str(path / "model.safetensors"))) == set(drafter.serving.state_dict(drafter))


def test_online_needs_a_frozen_target():
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    cfg = tiny_drafter_cfg("eagle3")
    drafter = registry.get("eagle3").from_target(cfg, target, DraftVocab.from_counts(torch.ones(V), 64))
    with pytest.raises(SpeculatorsError, match="data.features: online"):
        TrainingUnit(drafter, None, features="online")
    with pytest.raises(SpeculatorsError, match="data.features: 'cached'"):
        TrainingUnit(drafter, target, features="cached")
    with pytest.raises(SpeculatorsError, match="data.features: online needs a frozen target"):
        load_recipe(ROOT / "recipes" / "tiny-mtp.yaml", ["target.model=x", "data.features=online",
                                                         "drafter.joint=true"])


def _first_loss(run: Path) -> float:
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return next(r["train/loss"] for r in rows if r.get("step") == 1 and "train/loss" in r)


def test_train_run_first_step_loss_is_the_same_online(tmp_path, isolated_cache, tiny_target_dir):
    from safetensors import safe_open

    from speculators.workflows import train_run

    over = [f"target.model={tiny_target_dir}", "train.steps=1", "train.checkpoint_every=1", "train.eval_every=1"]
    runs = {}
    for mode in ("offline", "online"):
        rec = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml", over + [f"data.features={mode}"])
        logs = []
        runs[mode] = train_run(rec, tmp_path / mode, log=logs.append).parent
        if mode == "offline":
            assert any((isolated_cache / "features").iterdir())  # the offline run cached its features
        else:
            assert any("data.features: online" in m for m in logs), logs
    assert abs(_first_loss(runs["online"]) - _first_loss(runs["offline"])) <= 1e-5
    names = {}
    for mode, run in runs.items():
        with safe_open(str(run / "final" / "model.safetensors"), "pt") as f:
            names[mode] = set(f.keys())
    assert names["online"] == names["offline"]


def test_online_writes_no_feature_cache(tmp_path, isolated_cache, tiny_target_dir):
    from speculators.workflows import data_run

    rec = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml", [f"target.model={tiny_target_dir}",
                                                               "data.features=online"])
    data = data_run(rec, log=lambda *_: None)
    assert not data.train.has_features
    feats = isolated_cache / "features"
    assert not feats.exists() or not any(feats.iterdir())


def test_a_run_recorded_before_the_feature_fields_resumes(tmp_path):
    """``--resume`` of a run whose ``recipe.yaml`` predates ``data.features`` / ``data.feature_dtype``: the
    missing fields read as their defaults (the same data); choosing online is a change of the data section."""
    from speculators.recipe import dump_recipe
    from speculators.train.run_dir import check_resume_recipe

    rec = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml", ["target.model=x"])
    raw = yaml.safe_load(dump_recipe(rec))
    del raw["data"]["features"], raw["data"]["feature_dtype"], raw["train"]["save_dtype"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    check_resume_recipe(tmp_path, rec)
    online = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml", ["target.model=x", "data.features=online"])
    with pytest.raises(SpeculatorsError, match=r"data section"):
        check_resume_recipe(tmp_path, online)
