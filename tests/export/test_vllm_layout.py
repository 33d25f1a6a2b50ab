"""The static vLLM layout check (speculators/export/vllm_layout.py) on every family's real export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.checkpoint import save_pretrained
from speculators.errors import SpeculatorsError
from speculators.export.vllm_layout import check_layout
from speculators.target import build_tiny_target

V = 96
FAMILIES = {  # family -> drafter config overrides (the variants whose names differ)
    "medusa": {}, "medusa-vllm": {"export": "vllm-medusa"}, "eagle": {},
    "eagle3": {"draft_vocab_size": 64}, "eagle3-nbf": {"norm_before_fc": True}, "peagle": {},
    "dflash": {"draft_vocab_size": 64}, "dspark": {"enable_confidence_head": True}, "mtp": {},
    "draft_model": {"num_layers": 2},
}


@pytest.fixture(scope="module")
def target():
    t = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    t.aux_layer_ids = [0, 1, 2]
    return t


def export(target, name, path, **over):
    family = name.split("-")[0]
    cls = registry.get(family)
    kw = {**FAMILIES[name], **over}
    cfg = cls.config_class(algorithm=family, **kw)
    torch.manual_seed(0)
    d = cls.from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, 0, -1), kw.get("draft_vocab_size")))
    return save_pretrained(d, path, frozen_copies=False, dtype="bfloat16")  # as final/ is written


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_export_is_placed_by_vllm(target, tmp_path, name):
    assert check_layout(export(target, name, tmp_path / name)) == []


@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark", "mtp", "medusa-vllm", "draft_model"])
def test_extra_and_misshapen_tensors_are_named(target, tmp_path, name):
    path = export(target, name, tmp_path / name)
    w = load_file(path / "model.safetensors")
    first = sorted(k for k in w if w[k].dim() == 2)[0]
    w[first] = torch.zeros(w[first].shape[0] + 1, w[first].shape[1], dtype=w[first].dtype)
    w["confidence_temperature"] = torch.ones(4)
    save_file(w, path / "model.safetensors")
    problems = check_layout(path)
    assert any("`confidence_temperature`" in p and "no module or parameter" in p for p in problems), problems
    assert any(f"`{first}`" in p and "shape" in p for p in problems), problems
    assert len(problems) == 2, problems


def test_missing_required_tensor_and_fc_norm_name(target, tmp_path):
    path = export(target, "eagle3-nbf", tmp_path / "e3")
    w = load_file(path / "model.safetensors")
    w["fc_norm.weight"] = w.pop("input_norm.weight")  # the name vLLM keeps for its per-tap norms
    save_file(w, path / "model.safetensors")
    problems = check_layout(path)
    assert any("`fc_norm.weight`" in p for p in problems) and any("`input_norm.weight` is missing" in p
                                                                   for p in problems), problems


@pytest.mark.parametrize("ids,why", [([3, 1, 2], "ascending"), ([1, 1, 2], "distinct"), ([1, 2], "exactly 3"),
                                     ([1, 2, 3, 4], "exactly 3")])
def test_eagle3_aux_id_rules(target, tmp_path, ids, why):
    path = export(target, "eagle3", tmp_path / "e3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    (path / "config.json").write_text(json.dumps(cfg))
    problems = check_layout(path)
    assert any(why in p and "eagle_aux_hidden_state_layer_ids" in p for p in problems), problems


def test_dflash_unsorted_aux_ids(target, tmp_path):
    path = export(target, "dflash", tmp_path / "df")
    cfg = json.loads((path / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [2, 1]
    (path / "config.json").write_text(json.dumps(cfg))
    assert any("ascending" in p for p in check_layout(path))


def test_unknown_family_and_missing_files_are_errors(target, tmp_path):
    with pytest.raises(SpeculatorsError, match="config.json does not exist"):
        check_layout(tmp_path)
    path = export(target, "eagle3", tmp_path / "e3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_model_type"] = "nope"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculatorsError, match="unknown family 'nope'"):
        check_layout(path)


def test_calibrated_dspark_keeps_the_calibration_out_of_the_weights(target, tmp_path):
    cls = registry.get("dspark")
    torch.manual_seed(0)
    d = cls.from_target(cls.config_class(algorithm="dspark", enable_confidence_head=True), target,
                        DraftVocab.from_counts(torch.arange(V, 0, -1), None))
    with torch.no_grad():  # a calibrated head (what `speculators calibrate` writes back)
        d.confidence_temperature.fill_(1.7)
        d.confidence_bias.fill_(-0.3)
    path = save_pretrained(d, tmp_path / "ds", frozen_copies=False, dtype="bfloat16")
    assert check_layout(path) == []
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_training"]["confidence_calibration"]["temperature"][0] == pytest.approx(1.7)


def test_reduced_vocab_dspark_needs_its_head_and_d2t(target, tmp_path):
    path = export(target, "dspark", tmp_path / "ds", draft_vocab_size=64)
    assert check_layout(path) == []
    w = load_file(path / "model.safetensors")
    del w["d2t"]
    w["mask_embedding"] = torch.zeros(1, 64)  # vLLM's DSpark loader drops it
    save_file(w, path / "model.safetensors")
    assert check_layout(path) == ["tensor `d2t` is missing: vLLM 0.33.0 requires it"]


def test_gate_says_how_vllm_serves_the_layout(target, tmp_path):
    from speculators.export.gate import check_checkpoint

    g = check_checkpoint(export(target, "eagle3", tmp_path / "e3"), parity=False)
    assert g.passed is None and "method `eagle3`" in g.serving and "loader places" in g.to_markdown()
    g = check_checkpoint(export(target, "medusa", tmp_path / "m"), parity=False)
    assert g.serving.startswith("vLLM cannot load this layout as written") and "vllm-medusa" in g.serving
    assert "no loader for it as written" in g.to_markdown()
    g = check_checkpoint(export(target, "medusa-vllm", tmp_path / "mv"), parity=False)
    assert "method `medusa`" in g.serving


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_moe_draft_model_is_written_per_expert(arch, tmp_path):
    """transformers holds MoE experts fused (``experts.gate_up_proj [E, 2I, H]``); the checkpoint vLLM's loader and
    llama.cpp's converter read names them per expert, as ``save_pretrained`` does. The fused in-memory names are
    flagged, each one by name."""
    from speculators.target.tiny import build_tiny_architecture

    moe = build_tiny_architecture(arch, V, 32, 2)
    cls = registry.get("draft_model")
    d = cls.from_target(cls.config_class(algorithm="draft_model", num_layers=1), moe, DraftVocab.full(V))
    path = save_pretrained(d, tmp_path / "final", frozen_copies=False, dtype="bfloat16")
    w = load_file(path / "model.safetensors")
    assert any(".experts.0." in k for k in w) and not any(k.endswith("gate_up_proj") for k in w), sorted(w)
    assert check_layout(path) == []
    fused = {k: v for k, v in d.lm.state_dict().items() if "experts" not in k or "gate_up_proj" in k
             or "down_proj" in k}  # the in-memory names, as an export that skipped transformers' conversion
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in fused.items() if k != "lm_head.weight"},
              path / "model.safetensors")
    problems = check_layout(path)
    assert any("gate_up_proj`" in p and "no module or parameter" in p for p in problems), problems
    assert any(".experts.0." in p and "missing" in p for p in problems), problems
