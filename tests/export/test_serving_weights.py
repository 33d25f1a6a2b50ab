"""What a checkpoint's ``model.safetensors`` holds (FORMATS.md, "Rules every export follows"):

* only tensors a serving engine places: a family's declared training-side state
  (``ServingFormat.training_state_tensors``, DSpark's calibration) is refused by the writer, for every family;
* ``norm_before_fc`` (EAGLE-3, P-EAGLE) is written as ``input_norm.weight`` (vLLM's and
  vllm-project/speculators' name), and checkpoints of earlier versions holding ``fc_norm.weight`` load;
* EAGLE-3's ``final/`` keeps ``embed_tokens.weight`` (the reference library would keep zeros without it),
  and an earlier version's ``final/`` that omitted it still loads (the target's embedding is restored).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import speculators.drafters  # noqa: F401  (registers the families)
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import save_pretrained
from speculators.errors import SpeculatorsError
from speculators.target import build_tiny_target

ROOT = Path(__file__).resolve().parents[2]
V, H = 96, 64


def tiny_target():
    return build_tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=0)


def fresh(algorithm: str, target, **over):
    """A drafter of ``algorithm`` from its tiny recipe (``over`` replaces drafter keys), weights perturbed."""
    recipes = {yaml.safe_load(p.read_text())["drafter"]["algorithm"]: p for p in ROOT.glob("recipes/tiny-*.yaml")}
    raw = {**yaml.safe_load(recipes[algorithm].read_text())["drafter"], **over}
    if raw.get("draft_vocab_size"):
        raw["draft_vocab_size"] = 64
    family = registry.get(algorithm)
    cfg = family.config_class.model_validate(raw)
    target.aux_layer_ids = family.serving.default_aux_layer_ids(target.num_layers, cfg)
    torch.manual_seed(0)
    d = family.from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, dtype=torch.float), cfg.draft_vocab_size))
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return d


@pytest.mark.parametrize("algorithm", registry.names())
def test_the_writer_refuses_declared_training_side_state_for_every_family(algorithm, tmp_path, monkeypatch):
    """A family that declares a tensor as training-side state cannot have it written to model.safetensors
    (vLLM's loader raises on a name it cannot place); nothing is left on disk."""
    d = fresh(algorithm, tiny_target())
    names = sorted(d.serving.state_dict(d))
    written = load_file(str(d.save_pretrained(tmp_path / "ok") / "model.safetensors"))
    assert not set(written) & set(d.serving.training_state_tensors)
    monkeypatch.setattr(type(d.serving), "training_state_tensors", (names[0],))
    with pytest.raises(SpeculatorsError, match=rf"{names[0]}.*training-side state of the {algorithm}"):
        d.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_norm_before_fc_is_exported_as_input_norm(algorithm, tmp_path):
    target = tiny_target()
    d = fresh(algorithm, target, norm_before_fc=True)
    with torch.no_grad():
        d.input_norm.weight.copy_(1.0 + 0.3 * torch.randn(d.input_norm.weight.shape))
    path = save_pretrained(d, tmp_path / "final", frozen_copies=False)
    w = load_file(str(path / "model.safetensors"))
    assert w["input_norm.weight"].shape == (3 * H,) and "fc_norm.weight" not in w
    assert json.loads((path / "config.json").read_text())["norm_before_fc"] is True
    loaded = Drafter.from_pretrained(path)
    assert torch.equal(loaded.input_norm.weight, d.input_norm.weight)
    aux = torch.randn(2, 5, 3 * H)
    torch.testing.assert_close(loaded.fuse(aux), d.fuse(aux))
    # the fused input really goes through the norm (a wrong name would leave it at 1.0)
    with torch.no_grad():
        loaded.input_norm.weight.fill_(1.0)
    assert (loaded.fuse(aux) - d.fuse(aux)).abs().max() > 1e-3


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_an_old_checkpoint_with_fc_norm_loads_and_is_rewritten_with_vllms_name(algorithm, tmp_path):
    target = tiny_target()
    d = fresh(algorithm, target, norm_before_fc=True)
    with torch.no_grad():
        d.input_norm.weight.copy_(1.0 + 0.3 * torch.randn(d.input_norm.weight.shape))
    path = d.save_pretrained(tmp_path / "old")
    sd = load_file(str(path / "model.safetensors"))
    sd["fc_norm.weight"] = sd.pop("input_norm.weight")  # what earlier versions wrote
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    loaded = Drafter.from_pretrained(path)
    assert torch.equal(loaded.input_norm.weight, d.input_norm.weight)
    again = load_file(str(loaded.save_pretrained(tmp_path / "new") / "model.safetensors"))
    assert "input_norm.weight" in again and "fc_norm.weight" not in again


def test_eagle3_final_keeps_the_embedding_and_an_old_final_without_it_loads(tmp_path):
    target = tiny_target()
    d = fresh("eagle3", target)
    path = save_pretrained(d, tmp_path / "final", dtype="bfloat16", frozen_copies=False)
    w = load_file(str(path / "model.safetensors"))
    assert torch.equal(w["embed_tokens.weight"], target.embed_tokens.weight.to(torch.bfloat16))
    block = json.loads((path / "config.json").read_text())["speculators_training"]
    assert "omitted_target_weights" not in block
    loaded = Drafter.from_pretrained(path)  # complete without the target (the reference library's case)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight.to(torch.bfloat16).float())
    # a final/ of an earlier version: embedding left out and listed; it loads and takes the target's
    del w["embed_tokens.weight"]
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_training"]["omitted_target_weights"] = ["embed_tokens.weight"]
    (path / "config.json").write_text(json.dumps(cfg))
    old = Drafter.from_pretrained(path)
    assert bool(torch.isnan(old.embed_tokens.weight).all())
    old.attach_target(target)
    assert torch.equal(old.embed_tokens.weight, target.embed_tokens.weight.float())
