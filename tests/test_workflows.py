"""The orchestration layer and the layering rules.

* The data layer's imports, read from the source with ``ast`` (the reader of ``tests/test_layering.py``,
  which also holds the package-wide rules: only ``cli.py`` imports the workflows, no cycle, layer order):
  nothing under ``speculators/data/`` imports ``speculators.drafters`` (nor the recipe's ``Recipe``),
  also checked at run time in a fresh interpreter.
* ``DraftVocab`` lives in the data layer and is re-exported by ``speculators.drafters``.
* The held-out prompt list has ONE definition (``held_out_prompts``), used by ``prepare_data``; the data
  functions take the data spec, not the recipe.
* The workflows' own rules (default run directory, ``--resume`` recipe check).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speculators.errors import SpeculatorsError
from speculators.recipe import recipe_from_dict

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "speculators"
TINY = ROOT / "recipes" / "tiny-eagle3.yaml"


# ----------------------------------------------------------------------------- import layering


# The import reader, the CLI/workflows rule, the cycle check and the layer order are in
# tests/test_layering.py; the data layer's own rules (item 6) stay here and reuse its reader.
from test_layering import imports_of, module_name, sources  # noqa: E402


def test_data_layer_imports_no_drafters_and_no_recipe():
    data_files = sources(PKG / "data")
    assert len(data_files) >= 7, data_files
    bad = []
    for p in data_files:
        for imp in imports_of(p):
            mod, names, type_only = imp.module, imp.names, imp.scope == "type"
            if mod == "speculators.drafters" or mod.startswith("speculators.drafters."):
                bad.append(f"{p.relative_to(ROOT)}: {mod}")
            if mod == "speculators.recipe" and (not type_only or "Recipe" in names):
                bad.append(f"{p.relative_to(ROOT)}: {mod} {names} (only DataSpec types, for type checking)")
    assert not bad, bad


def test_data_layer_loads_without_drafters_or_recipe():
    """At run time too: importing every data module pulls in neither the drafters nor the recipe."""
    mods = [module_name(p) for p in sources(PKG / "data")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "print(sorted(m for m in sys.modules if m.startswith(('speculators.drafters', 'speculators.recipe',"
              " 'speculators.cli', 'speculators.workflows'))))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_draft_vocab_lives_in_the_data_layer_only():
    import speculators.drafters as drafters
    from speculators.data import DraftVocab as from_data_pkg
    from speculators.data.vocab import DraftVocab

    assert DraftVocab.__module__ == "speculators.data.vocab"
    assert DraftVocab is from_data_pkg and not hasattr(drafters, "DraftVocab")  # the data package curates it
    v = DraftVocab.from_counts(torch.tensor([5, 0, 9, 9, 1]), 3)
    assert v.target_ids.tolist() == [0, 2, 3] and v.t2d.tolist() == [True, False, True, True, False]
    with pytest.raises(SpeculatorsError, match="drafter.draft_vocab_size 6 exceeds the target vocab 5"):
        DraftVocab.from_counts(torch.ones(5), 6)


# ----------------------------------------------------------------------------- data functions take the data spec


def _recipe(tmp_path: Path, **data):
    raw = yaml.safe_load(TINY.read_text())
    raw["target"]["model"] = "unused"
    raw["data"].update(data)
    return recipe_from_dict(raw, "test")


def _chat_file(tmp_path: Path) -> Path:
    rows = []
    for i in range(20):
        q = f"Question {i % 8}?"  # 8 distinct prompts, most listed more than once
        rows.append({"id": i, "messages": [{"role": "user", "content": q},
                                           {"role": "assistant", "content": f"Answer number {i}, fine."}]})
    f = tmp_path / "chat.jsonl"
    import json

    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_unique_prompts_dedups_by_prompt_and_limits(tmp_path, smol_tokenizer):
    from speculators.data.chat import render_prompt
    from speculators.data.pipeline import load_data, unique_prompts

    rec = _recipe(tmp_path, sources=[{"source": str(_chat_file(tmp_path)), "regenerate": False}])
    pairs, _ = load_data(rec.data)
    convs = [c for c, _ in pairs]
    all_p = unique_prompts(convs, smol_tokenizer)
    assert [p["id"] for p in all_p] == [f"chat/{i}#orig" for i in range(8)]  # first occurrence, input order
    assert all_p[3]["messages"] == [{"role": "user", "content": "Question 3?"}]
    assert all_p[3]["input_ids"] == render_prompt(smol_tokenizer, all_p[3]["messages"])
    assert unique_prompts(convs, smol_tokenizer, limit=3) == all_p[:3]


def test_prepare_data_takes_the_data_spec_and_its_eval_prompts_are_held_out_prompts(
        tmp_path, smol_tokenizer, isolated_cache):
    from speculators.data.pipeline import PreparedData, held_out_prompts, load_data, prepare_data, split_conversations
    from speculators.target import build_tiny_target

    rec = _recipe(tmp_path, sources=[{"source": str(_chat_file(tmp_path)), "regenerate": False}],
                  held_out={"fraction": 0.3, "seed": 1})
    target = build_tiny_target(vocab_size=len(smol_tokenizer), hidden_size=32, num_layers=2, seed=0)
    target.tokenizer = smol_tokenizer
    logs = []
    data = prepare_data(rec.data, target, draft_vocab_size=40, log=logs.append)
    assert isinstance(data, PreparedData) and data.vocab.size == 40
    pairs, _ = load_data(rec.data)
    expected = held_out_prompts(rec.data, smol_tokenizer, pairs)
    assert data.eval_prompts == expected and len(expected) >= 2  # one definition, used by training and eval
    _, held = split_conversations(pairs, rec.data.held_out)
    held_prompts = {repr(c.messages[:-1]) for c, _ in held}
    assert {repr(p["messages"]) for p in expected} == held_prompts and len(expected) == len(held_prompts)
    assert held_out_prompts(rec.data, smol_tokenizer, pairs, limit=1) == expected[:1]
    assert f"{len(expected)} held-out prompts" in logs[-1]
    full = prepare_data(rec.data, target, draft_vocab_size=None, log=logs.append)
    assert full.vocab.size == target.vocab_size


# ----------------------------------------------------------------------------- workflow rules


def test_default_output_dir(tmp_path):
    from speculators.train.run_dir import default_output_dir

    rec = _recipe(tmp_path)
    assert default_output_dir(rec, "recipes/tiny-eagle3.yaml") == Path("outputs/tiny-eagle3")
    rec.output_dir = str(tmp_path / "mine")
    assert default_output_dir(rec, "recipes/tiny-eagle3.yaml") == tmp_path / "mine"
    rec.output_dir = None
    with pytest.raises(SpeculatorsError, match="output_dir"):
        default_output_dir(rec)


def test_resume_recipe_check_names_the_changed_sections(tmp_path):
    from speculators.recipe import dump_recipe
    from speculators.train.run_dir import check_resume_recipe

    rec = _recipe(tmp_path)
    check_resume_recipe(tmp_path, rec)  # no recorded recipe: nothing to compare
    (tmp_path / "recipe.yaml").write_text(dump_recipe(rec))
    check_resume_recipe(tmp_path, rec)
    rec.train.lr = 1e-5  # the train section may change on --resume
    check_resume_recipe(tmp_path, rec)
    rec.target.device_map = "auto"  # so may where the target sits (other hardware)
    check_resume_recipe(tmp_path, rec)
    rec.target.dtype = "bfloat16"  # but not the rest of the target section
    with pytest.raises(SpeculatorsError, match=r"target section\(s\) differ"):
        check_resume_recipe(tmp_path, rec)
    rec.target.dtype = "float32"
    rec.drafter = {**rec.model_dump()["drafter"], "ttt_steps": 3}
    rec.data.max_length = 128
    with pytest.raises(SpeculatorsError, match=r"data, drafter section\(s\) differ") as e:
        check_resume_recipe(tmp_path, rec)
    assert "--overwrite" in str(e.value) and "target" not in str(e.value).split("differ")[0]


def test_eval_taps_the_layers_the_checkpoint_was_trained_on(tmp_path, tiny_target_dir, isolated_cache):
    """A drafter trained with non-default ``target.aux_layer_ids`` is evaluated with the target loaded at
    those taps (``check_target`` only checks, it no longer rewrites the target)."""
    from conftest import cli_train_then_eval

    cfg, _, report = cli_train_then_eval(TINY, tiny_target_dir, tmp_path / "run", "target.aux_layer_ids=[0, 2, 3]",
                                         "train.steps=2")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert report["greedy_mismatches"] == []


def test_checkpoint_records_the_target_dtype_and_eval_warns_when_it_serves_another(tmp_path, tiny_target_dir,
                                                                                  isolated_cache):
    """The resolved target dtype is recorded in config.json (``speculators_training.target.dtype``) and the
    run card; eval serves that dtype by default, warns (log and ``report["dtype_warning"]``) when told to
    serve another, and a checkpoint that records none (an older version) loads without a warning."""
    import json

    from conftest import cli_train_then_eval

    from speculators.evaluation.loading import dtype_warning
    from speculators.workflows import eval_run

    out = tmp_path / "run"
    cfg, _, report = cli_train_then_eval(TINY, tiny_target_dir, out, "train.steps=2")
    assert cfg["speculators_training"]["target"]["dtype"] == "float32"  # the tiny recipe's
    assert "Target dtype: float32" in (out / "final" / "README.md").read_text()
    assert report["target"]["dtype"] == report["target"]["trained_dtype"] == "float32"
    assert "dtype_warning" not in report
    logs: list[str] = []
    small = {"num_prompts": 2, "max_new_tokens": 6, "k": 2, "batch_size": 1}
    rep, _ = eval_run(out, eval_overrides=small, dtype="bfloat16", log=logs.append, output=tmp_path / "bf16")
    assert rep["target"]["dtype"] == "bfloat16" and rep["target"]["trained_dtype"] == "float32"
    assert rep["dtype_warning"] == dtype_warning("float32", "bfloat16") and "--dtype float32" in rep["dtype_warning"]
    assert any(line.startswith("warning: ") and "bfloat16" in line for line in logs)
    assert "**Warning:**" in (tmp_path / "bf16" / "report.md").read_text()
    assert rep["greedy_check"]["dtype"] == "bfloat16"  # the greedy check runs in the served dtype
    # on a CPU a bfloat16 eval also times plain decoding in float32; batch-1 rows are put against the faster
    pb = rep["precision_baseline"]
    assert set(pb["plain_tokens_per_s"]) == {"bfloat16", "float32"} and "precision_baseline" not in report
    assert pb["fastest"] == max(pb["plain_tokens_per_s"], key=pb["plain_tokens_per_s"].get)
    best = pb["plain_tokens_per_s"][pb["fastest"]]
    assert {(r["method"], r["k"]) for r in pb["rows"]} == {(r["method"], r["k"]) for r in rep["rows"]
                                                            if r["batch_size"] == 1}
    assert all(abs(r["speedup_vs_fastest_plain"] - r["tokens_per_s"] / best) < 1e-9 for r in pb["rows"])
    assert "## Against the fastest plain decoding (batch 1)" in (tmp_path / "bf16" / "report.md").read_text()
    f = out / "final" / "config.json"
    raw = json.loads(f.read_text())
    del raw["speculators_training"]["target"]["dtype"]
    f.write_text(json.dumps(raw))
    rep, _ = eval_run(out, eval_overrides=small, dtype="bfloat16", log=logs.append, output=tmp_path / "old")
    assert rep["target"]["trained_dtype"] is None and "dtype_warning" not in rep
    assert dtype_warning(None, "bfloat16") is None and dtype_warning("bfloat16", "bfloat16") is None


def test_resume_refuses_a_run_whose_auto_dtype_resolves_otherwise(monkeypatch, tmp_path):
    """``target.dtype: auto`` trains in what this machine resolves; ``--resume`` on a machine that resolves
    another dtype is refused (a float32 run records no dtype entry, as before; a bfloat16 run does)."""
    import speculators.data.pipeline as pipeline
    from speculators import hardware, workflows
    from speculators.data.pipeline import record_run_identity
    from speculators.target import Target, build_tiny_target

    base = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=4, seed=0)
    with torch.no_grad():  # bf16-exact weights: one fingerprint in either dtype, so only the dtype differs
        for p in base.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())

    class Stop(Exception):
        pass

    def load(cls, ref, dtype="float32", *a, **k):
        base.model.to(getattr(torch, dtype))
        base._fingerprint = None
        return base

    monkeypatch.setattr(Target, "load", classmethod(load))
    monkeypatch.setattr(pipeline, "load_data", lambda spec, log: (None, {}))
    monkeypatch.setattr(pipeline, "prepare_data", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    rec = recipe_from_dict(yaml.safe_load(TINY.read_text()) | {"target": {"model": "x"}})
    assert rec.target.dtype == "auto"
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(rec.model_dump(mode="json")))
    record_run_identity(run, {"target (weights, config, chat template)": load(None, None).fingerprint})  # fp32
    monkeypatch.setattr(hardware, "fast_bf16", lambda device=None: False)
    with pytest.raises(Stop):  # float32 again: the identity matches, the run goes on to the data step
        workflows.train_run(rec, run, resume=True, log=lambda *_: None)
    monkeypatch.setattr(hardware, "fast_bf16", lambda device=None: True)
    with pytest.raises(SpeculatorsError, match="target dtype: content added"):
        workflows.train_run(rec, run, resume=True, log=lambda *_: None)
