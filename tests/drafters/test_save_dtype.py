"""Checkpoints in the dtype people publish (``train.save_dtype``).

* Every family: a checkpoint saved in bfloat16 / float16 holds its floating-point weights in that dtype
  (integer/bool buffers unchanged, ``torch_dtype`` says so) and loads back into float32 parameters equal
  to the rounded weights; ``dtype=None`` stays exact.
* A training run writes ``final/`` in ``train.save_dtype`` (bf16 by default) and the resumable
  ``checkpoints/step-N`` in float32; the bf16 ``final/`` evaluates (``speculators eval``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import speculators.drafters  # noqa: F401  (registers the families)
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import cast_weights, omittable_target_weights, save_pretrained
from speculators.errors import SpeculatorsError
from speculators.recipe import load_recipe
from speculators.target import build_tiny_target

ROOT = Path(__file__).resolve().parents[2]
V = 96


def fresh(algorithm: str):
    recipes = {yaml.safe_load(p.read_text())["drafter"]["algorithm"]: p for p in ROOT.glob("recipes/tiny-*.yaml")}
    raw = yaml.safe_load(recipes[algorithm].read_text())["drafter"]
    if raw.get("draft_vocab_size"):
        raw["draft_vocab_size"] = 64
    family = registry.get(algorithm)
    cfg = family.config_class.model_validate(raw)
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    target.aux_layer_ids = family.serving.default_aux_layer_ids(target.num_layers, cfg)
    torch.manual_seed(0)
    d = family.from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, dtype=torch.float), cfg.draft_vocab_size))
    with torch.no_grad():  # trained-looking weights: not exactly representable in 16 bits
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 1e-3)
    return d


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", None])
@pytest.mark.parametrize("algorithm", registry.names())
def test_save_in_dtype_and_load_back(algorithm, dtype, tmp_path):
    d = fresh(algorithm)
    ref = d.serving.state_dict(d)
    path = save_pretrained(d, tmp_path / "ck", dtype=dtype)
    written = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    assert written.keys() == ref.keys()
    want = getattr(torch, dtype) if dtype else torch.float32
    exact = set(d.serving.full_precision_weights)  # e.g. DSpark's confidence_temperature: float32 always
    for k, t in written.items():
        if ref[k].is_floating_point():
            assert t.dtype == (torch.float32 if k in exact else want), k
        else:
            assert t.dtype == ref[k].dtype and torch.equal(t, ref[k]), k  # d2t / t2d / token_map untouched
    if "torch_dtype" in cfg:
        assert cfg["torch_dtype"] == (dtype or "float32")
    loaded = Drafter.from_pretrained(path)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())  # upcast into the eval module
    back = loaded.serving.state_dict(loaded)
    for k, t in ref.items():
        expect = t.to(want).to(t.dtype) if t.is_floating_point() and k not in exact else t
        assert torch.equal(back[k], expect), k
    if dtype is not None:
        floats = [k for k, t in ref.items() if t.is_floating_point() and t.numel() > 1]
        assert any(not torch.equal(back[k], ref[k]) for k in floats)  # really rounded (the test can fail)


def test_cast_refuses_values_float16_cannot_hold():
    with pytest.raises(SpeculatorsError, match=r"train.save_dtype: 'w' holds values beyond"):
        cast_weights({"w": torch.tensor([1.0, 1e6])}, torch.float16)
    assert cast_weights({"w": torch.tensor([1.0, 1e6])}, torch.bfloat16)["w"].dtype == torch.bfloat16
    with pytest.raises(SpeculatorsError, match=r"train.save_dtype: 'fp8'.*allowed"):
        save_pretrained(fresh("eagle3"), "/nonexistent/x", dtype="fp8")


def test_run_writes_final_in_save_dtype_and_resumable_checkpoints_in_float32(tmp_path, isolated_cache,
                                                                              tiny_target_dir):
    from speculators.workflows import eval_run, train_run

    rec = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml",
                      [f"target.model={tiny_target_dir}", "train.steps=2", "train.checkpoint_every=1"])
    assert rec.train.save_dtype == "bfloat16"
    final = train_run(rec, tmp_path / "run", log=lambda *_: None)
    fw = load_file(str(final / "model.safetensors"))
    step = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    sw = load_file(str(step / "model.safetensors"))
    # EAGLE-3's frozen embedding is in final/ too (the reference library would keep zeros without it)
    assert set(sw) == set(fw) and "embed_tokens.weight" in fw
    for k in fw:
        if sw[k].is_floating_point():
            assert sw[k].dtype == torch.float32 and fw[k].dtype == torch.bfloat16, k
            assert torch.equal(fw[k], sw[k].to(torch.bfloat16)), k  # the same weights, rounded
    size = lambda p: (p / "model.safetensors").stat().st_size  # noqa: E731
    assert size(final) < 0.55 * size(step)
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    assert "omitted_target_weights" not in cfg["speculators_training"]
    report, _ = eval_run(tmp_path / "run", eval_overrides={"num_prompts": 1, "max_new_tokens": 4, "k": 2,
                                                           "methods": ["drafter"]}, log=lambda *_: None)
    assert report  # the bf16 checkpoint loads and decodes


@pytest.mark.parametrize("algorithm", registry.names())
def test_published_checkpoint_omits_only_unneeded_frozen_copies(algorithm, tmp_path):
    """``frozen_copies=False``: the family's frozen target copies (EAGLE-1 / MTP ``embed_tokens``) are left
    out and listed; P-EAGLE keeps its (trained mask row) embedding, EAGLE-3 its frozen one (the reference
    library needs it). Loaded, they are NaN until
    ``attach_target`` copies the target's tensor; then the drafter equals the one that was saved."""
    d = fresh(algorithm)
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=0)
    ref = d.serving.state_dict(d)
    frozen = set(omittable_target_weights(d))
    if algorithm in ("eagle", "mtp"):
        assert frozen == {"embed_tokens.weight"}
    if algorithm in ("peagle", "eagle3"):
        assert "embed_tokens.weight" in ref and not frozen
    path = save_pretrained(d, tmp_path / "ck", frozen_copies=False)
    written = load_file(str(path / "model.safetensors"))
    assert set(ref) - set(written) == frozen & set(ref)
    block = json.loads((path / "config.json").read_text())["speculators_training"]
    assert block.get("omitted_target_weights", []) == sorted(frozen & set(ref))
    loaded = Drafter.from_pretrained(path)
    for name in frozen:
        assert bool(torch.isnan(loaded.serving.state_dict(loaded)[name]).all())
    loaded.attach_target(target)
    back = loaded.serving.state_dict(loaded)
    for k, t in ref.items():
        assert torch.equal(back[k], t), k
    if frozen:  # a damaged checkpoint that lost a weight it did NOT list is still refused
        cfg_file = path / "config.json"
        cfg = json.loads(cfg_file.read_text())
        del cfg["speculators_training"]["omitted_target_weights"]
        cfg_file.write_text(json.dumps(cfg))
        with pytest.raises(SpeculatorsError, match="embed_tokens"):
            Drafter.from_pretrained(path)
