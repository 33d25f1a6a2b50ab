"""The end step of `speculators train` (workflows.export_gate, recipe switch train.parity_check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import make, reference_python, sequences, target  # noqa: F401 - fixtures
from typer.testing import CliRunner

from speculators.cli import app
from speculators.errors import SpeculatorsError
from speculators.export import reference_env
from speculators.hub import hub_card
from speculators.recipe import recipe_from_dict
from speculators.workflows import export_gate


def _card(path):
    (path / "README.md").write_text("# run card\n")


def test_unavailable_reference_does_not_fail_the_run(target, tmp_path, monkeypatch):
    path = tmp_path / "final"
    d = make(target, "dflash", path)
    _card(path)
    monkeypatch.setenv(reference_env.ENV_VAR, str(tmp_path / "nowhere" / "python"))
    lines = []
    res = export_gate(path, target, d, None, log=lines.append)
    assert res.passed is None and res.layout_problems == []
    g = json.loads((path / "parity.json").read_text())
    assert g["parity"]["skipped"].startswith("reference implementation unavailable:")
    assert any("not checked (reference implementation unavailable" in x for x in lines), lines
    card = hub_card(path, "me/x")
    assert "## Checked" in card and "parity with vllm-project/speculators 0.9.0: not checked" in card


def test_a_joint_run_checks_the_layout_and_says_why_parity_did_not_run(target, tmp_path, monkeypatch):
    from speculators.workflows import JOINT_PARITY_NOTE

    path = tmp_path / "final"
    d = make(target, "eagle3", path)
    _card(path)
    monkeypatch.setenv(reference_env.ENV_VAR, str(tmp_path / "nowhere" / "python"))  # must not be needed
    lines = []
    res = export_gate(path, target, d, None, log=lines.append, parity_skip=JOINT_PARITY_NOTE)
    assert res.parity is None and res.layout_checked and res.layout_problems == [] and res.passed is None
    g = json.loads((path / "parity.json").read_text())
    assert g["notes"] == [JOINT_PARITY_NOTE] and g["parity"] is None
    assert JOINT_PARITY_NOTE in (path / "README.md").read_text() and any(JOINT_PARITY_NOTE in x for x in lines)


def test_a_family_without_a_known_vllm_loader_is_not_checked_nor_failed(target, tmp_path):
    """A new family (its ``speculators_model_type`` unknown to the vLLM layout table) passes through the gate
    with its layout marked unchecked: adding a family does not break the end of training."""
    from speculators.export.gate import check_checkpoint

    path = tmp_path / "final"
    make(target, "dflash", path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_model_type"] = "brandnew"
    (path / "config.json").write_text(json.dumps(cfg))
    res = check_checkpoint(path, parity=False)
    assert not res.layout_checked and res.layout_problems == [] and res.passed is None
    assert "No vLLM 0.33.0 loader is known for this layout" in res.to_markdown()


def test_layout_failure_fails_the_run_and_marks_the_card(target, tmp_path, monkeypatch):
    path = tmp_path / "final"
    d = make(target, "dspark", path)
    _card(path)
    w = load_file(path / "model.safetensors")
    w["confidence_temperature"] = torch.ones(d.block_size)
    save_file(w, path / "model.safetensors")
    monkeypatch.setenv(reference_env.ENV_VAR, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(SpeculatorsError, match="export gate failed.*`confidence_temperature`"):
        export_gate(path, target, d, None, log=lambda _: None)
    assert "`confidence_temperature`" in (path / "README.md").read_text()
    assert json.loads((path / "parity.json").read_text())["passed"] is False


@pytest.mark.slow
def test_parity_failure_fails_the_run(reference_python, target, tmp_path):  # noqa: F811
    path = tmp_path / "final"
    d = make(target, "eagle3", path)
    _card(path)
    with torch.no_grad():  # the trained drafter differs from what was written: an export bug
        d.fc.weight.add_(0.5)
    with pytest.raises(SpeculatorsError, match="export gate failed.*`fc.weight`.*differs"):
        export_gate(path, target, d, None, log=lambda _: None)
    card = hub_card(path, "me/x")
    assert "FAIL" in card and "first divergence: weight `fc.weight`" in card


def test_recipe_switch_defaults_on_and_is_documented():
    base = {"target": {"model": "x"}, "data": {"sources": [{"source": "humaneval"}]},
            "drafter": {"algorithm": "eagle3"}}
    assert recipe_from_dict(base).train.parity_check is True
    off = recipe_from_dict({**base, "train": {"parity_check": False}})
    assert off.train.parity_check is False
    from speculators.recipe import TrainSpec

    assert "reference implementation" in TrainSpec.model_fields["parity_check"].description


def test_train_with_the_switch_off_writes_no_gate(tiny_target_dir, tmp_path, isolated_cache):
    out = tmp_path / "run"
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-dflash.yaml"
    r = CliRunner().invoke(app, ["train", str(recipe), f"target.model={tiny_target_dir}",
                                 "train.parity_check=false", "train.steps=2", "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert not (out / "final" / "parity.json").exists()
    assert "parity vs" not in r.output
    assert "Not checked against vLLM's loader" in hub_card(out / "final", "me/x")
