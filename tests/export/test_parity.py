"""The parity gate (speculators/export/parity.py) against the reference implementation, on tiny random targets.

Needs the reference venv (``make reference`` builds ``.venv-reference``; or ``$SPECULATORS_REFERENCE_PYTHON``).
Without one the reference tests skip, saying why; under ``CI=true`` that is an error.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.checkpoint import save_pretrained
from speculators.export import reference_env
from speculators.export.parity import (OutputDelta, ParityResult, check_parity, compare,
                                       first_hook_divergence)
from speculators.target import Target, build_tiny_target

V = 96
AUX = [0, 1, 2]
FAMILIES = {"eagle3": {"draft_vocab_size": 64}, "peagle": {}, "dflash": {"draft_vocab_size": 64},
            "dspark": {"enable_confidence_head": True, "draft_vocab_size": 64}}


@pytest.fixture(scope="module")
def reference_python():
    python = reference_env.find_reference_python()
    why = None
    if python is None:
        why = (f"no reference venv: run `make reference` (builds {reference_env.LOCAL_VENV}) or set "
               f"${reference_env.ENV_VAR}")
    else:
        try:
            reference_env.probe(python)
        except reference_env.ReferenceUnavailable as e:
            why = str(e)
    if why is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: the parity gate must run: {why}")
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama saved as a model directory (the reference reads the verifier from it)."""
    t = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    path = tmp_path_factory.mktemp("tiny-target")
    t.model.save_pretrained(path)
    return Target(t.model, None, name_or_path=str(path), aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (18,), generator=g).tolist() for _ in range(2)]


def make(target, family, path, **over):
    """A drafter with random (non-trivial) weights, written as ``final/`` is (bfloat16, frozen copies out)."""
    cls = registry.get(family)
    kw = {**FAMILIES[family], **over}
    torch.manual_seed(0)
    d = cls.from_target(cls.config_class(algorithm=family, **kw), target,
                        DraftVocab.from_counts(torch.arange(V, 0, -1), kw.get("draft_vocab_size")))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    save_pretrained(d, path, frozen_copies=False, dtype="bfloat16")
    return d


def edit(path, fn):
    w = load_file(path / "model.safetensors")
    fn(w)
    save_file(w, path / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_final_matches_the_reference(reference_python, target, sequences, tmp_path, family):
    path = tmp_path / family
    make(target, family, path)
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python)
    assert r.passed, r.to_markdown()
    assert r.load_problems == [] and r.first_divergence is None
    assert r.max_abs_delta <= 1e-4 and r.argmax_agreement == 1.0
    names = {o.name for o in r.outputs}
    assert {"seq0.logits", "seq1.logits"} <= names
    if family == "dspark":
        assert "seq0.confidence_logits" in names
    assert r.reference_version == reference_env.REFERENCE_VERSION


@pytest.mark.slow
@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_shifted_aux_ids_fail(reference_python, target, sequences, tmp_path, family):
    path = tmp_path / family
    make(target, family, path)
    cfg = json.loads((path / "config.json").read_text())
    key = "eagle_aux_hidden_state_layer_ids" if family == "eagle3" else "aux_hidden_state_layer_ids"
    cfg[key] = [i + 1 for i in cfg[key]]
    (path / "config.json").write_text(json.dumps(cfg))
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python)
    assert r.passed is False
    assert "aux layer ids" in r.first_divergence and str(cfg[key]) in r.first_divergence
    assert r.max_abs_delta > 1e-4  # the reference really read other layers


@pytest.mark.slow
def test_perturbed_weight_is_named(reference_python, target, sequences, tmp_path):
    path = tmp_path / "e3"
    d = make(target, "eagle3", path)

    def bump(w):
        w["layers.0.mlp.down_proj.weight"][0, 0] += 1.0
    edit(path, bump)
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python, drafter=d)
    assert r.passed is False
    assert "`layers.0.mlp.down_proj.weight`" in r.first_divergence and "differs" in r.first_divergence


@pytest.mark.slow
def test_a_divergent_forward_is_named_at_its_first_module(reference_python, target, sequences, tmp_path,
                                                          monkeypatch):
    """Without the trained drafter in memory (a checkpoint trained elsewhere) a divergence shows only in the
    comparison with the reference: our side's ``down_proj`` is perturbed after loading (the file is not), and
    the gate names the first hooked module, in the reference's forward order, whose outputs differ."""
    from speculators.drafters import Drafter

    path = tmp_path / "e3"
    make(target, "eagle3", path)
    real = Drafter.from_pretrained

    def perturbed(p):
        d = real(p)
        name = next(n for n, _ in d.named_modules() if n.endswith("down_proj"))
        with torch.no_grad():
            d.get_submodule(name).weight[0, 0] += 1.0
        return d

    monkeypatch.setattr(Drafter, "from_pretrained", staticmethod(perturbed))
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python)
    assert r.passed is False and r.load_problems == [], r.load_problems
    assert r.first_divergence.startswith("module `") and "down_proj" in r.first_divergence, r.first_divergence
    assert r.max_abs_delta > 1e-4


@pytest.mark.slow
def test_calibration_tensor_in_weights_fails(reference_python, target, sequences, tmp_path):
    path = tmp_path / "ds"
    d = make(target, "dspark", path)
    edit(path, lambda w: w.__setitem__("confidence_temperature", torch.ones(d.block_size)))
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python, drafter=d)
    assert r.passed is False
    assert any("`confidence_temperature`" in p for p in r.load_problems), r.load_problems


@pytest.mark.slow
def test_fc_norm_misnamed_fails(reference_python, target, sequences, tmp_path):
    path = tmp_path / "e3"
    d = make(target, "eagle3", path, norm_before_fc=True)
    with torch.no_grad():  # a norm weight far from 1.0, so a reference that keeps its init drafts otherwise
        d.get_parameter(next(n for n, _ in d.named_parameters() if n.endswith("norm.weight")
                             and d.get_parameter(n).numel() == 3 * 64)).uniform_(0.2, 3.0)
    save_pretrained(d, path, frozen_copies=False, dtype="bfloat16")
    edit(path, lambda w: w.__setitem__("fc_norm.weight", w.pop("input_norm.weight")))
    r = check_parity(path, target=target, sequences=sequences, reference_python=reference_python, drafter=d)
    assert r.passed is False
    joined = " ".join(r.load_problems)
    assert "`fc_norm.weight`" in joined and "`input_norm.weight`" in joined, r.load_problems


def test_first_hook_divergence_follows_the_reference_order():
    ref = {"fc": torch.zeros(2, 3), "layers.0.mlp.down_proj": torch.zeros(2, 3), "norm": torch.zeros(2, 3)}
    ours = {"fc": torch.zeros(2, 3), "layers.0.mlp.down_proj": torch.full((2, 3), 1e-3), "norm": torch.ones(2, 3)}
    order = ["fc", "layers.0.mlp.down_proj", "norm"]
    assert first_hook_divergence(ours, ref, order, {}).startswith("module `layers.0.mlp.down_proj`")
    assert first_hook_divergence(ours, ref, ["fc", "norm"], {}).startswith("module `norm`")
    # our module names are mapped onto the reference's
    ours2 = {"fc_norm": torch.ones(2, 3)}
    assert "input_norm" in first_hook_divergence(ours2, {"input_norm": torch.zeros(2, 3)}, ["input_norm"],
                                                 {"fc_norm": "input_norm"})
    assert first_hook_divergence(ours, ours, order, {}) is None


def test_compare_and_verdict():
    a = torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]])
    b = a.clone()
    b[1, 1] = 2.5  # argmax flips on row 1
    [d] = compare({"seq0.logits": a}, {"seq0.logits": b})
    assert d.argmax_agreement == 0.5 and d.max_abs_delta == pytest.approx(2.5) and d.rows == 2
    r = ParityResult("x", "eagle3", outputs=[d], passed=False, first_divergence="module `fc` output")
    assert "FAIL" in r.summary() and "first divergence: module `fc`" in r.summary()
    assert "| seq0.logits |" in r.to_markdown()
    ok = ParityResult("x", "eagle3", outputs=[OutputDelta("seq0.logits", 3e-6, 1.0, 4)], passed=True)
    assert ok.summary().startswith("parity vs vllm-project/speculators 0.9.0: PASS")
    assert ParityResult("x", "mtp", skipped="why").summary().endswith("not checked (why)")


def test_family_without_reference_model_is_reported_not_failed(tmp_path):
    t = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    cls = registry.get("medusa")
    d = cls.from_target(cls.config_class(algorithm="medusa"), t, DraftVocab.from_counts(torch.arange(V, 0, -1), None))
    save_pretrained(d, tmp_path / "m", frozen_copies=False)
    r = check_parity(tmp_path / "m", target=t, reference_python="/nonexistent/python")
    assert r.passed is None and "no `medusa` model" in r.skipped


def test_unavailable_reference_is_reported(tmp_path, monkeypatch, target):
    make(target, "dflash", tmp_path / "df")
    monkeypatch.delenv(reference_env.ENV_VAR, raising=False)
    r = check_parity(tmp_path / "df", target=target, reference_python=tmp_path / "missing" / "python")
    assert r.passed is None
    assert r.skipped.startswith("reference implementation unavailable:") and "does not exist" in r.skipped


def test_config_fields_the_reference_parsed_differently_are_named():
    from speculators.export.parity import _config_problems

    file = {"block_size": 8, "mask_token_id": 5, "speculators_training": {"a": 1},
            "transformer_layer_config": {"rope_theta": 10000.0, "hidden_size": 64}}
    ref = {"block_size": 8, "mask_token_id": 7, "speculators_training": {"b": 2},
           "transformer_layer_config": {"rope_theta": 500000.0, "hidden_size": 64}}
    problems = _config_problems(file, ref)
    assert problems == ["config mask_token_id: file 5, reference parsed 7",
                        "config transformer_layer_config.rope_theta: file 10000.0, reference 500000.0"]
    assert _config_problems(file, file) == []


def test_synthetic_target_follows_the_recorded_config(target, tmp_path):
    from speculators.drafters import Drafter
    from speculators.export.parity import synthetic_target

    make(target, "dflash", tmp_path / "df")
    meta = Drafter.from_pretrained(tmp_path / "df").meta
    t = synthetic_target(meta)
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (4, 64, V)
    assert t.aux_layer_ids == list(meta.aux_layer_ids)
    assert not torch.equal(t.embed_tokens.weight, target.embed_tokens.weight)  # random, not the real target


def test_config_key_that_disagrees_with_the_training_block_is_named(target, tmp_path):
    from speculators.drafters import Drafter
    from speculators.export.parity import export_config_problems

    make(target, "eagle3", tmp_path / "e3")
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    d = Drafter.from_pretrained(tmp_path / "e3")
    assert export_config_problems(cfg, d) == []
    cfg["norm_before_residual"] = not cfg["norm_before_residual"]
    [p] = export_config_problems(cfg, d)
    assert "`norm_before_residual`" in p and "speculators_training" in p


def test_short_held_out_rows_are_passed_over(target):
    from speculators.export.parity import MIN_TOKENS, _sequences

    seqs, label = _sequences(target, [[1, 2], list(range(10)), [3] * MIN_TOKENS], 3)
    assert seqs == [list(range(10)), [3] * MIN_TOKENS] and label.startswith("2 held-out sequences")
    seqs, label = _sequences(target, [[1]], 2)  # none usable: built-in inputs, labelled as such
    assert all(len(s) >= MIN_TOKENS for s in seqs) and "SYNTHETIC" in label


def test_worker_refuses_our_own_package_as_the_reference(target, sequences, tmp_path):
    """Run with OUR venv's python, the worker finds our package under the name `speculators`: it must say the
    reference is unavailable, not compare against ourselves."""
    import sys

    make(target, "dflash", tmp_path / "df")
    r = check_parity(tmp_path / "df", target=target, sequences=sequences, reference_python=sys.executable)
    assert r.passed is None and r.outputs == []
    assert r.skipped.startswith("reference implementation unavailable:")
    assert "not the reference implementation" in r.skipped or "cannot import" in r.skipped
