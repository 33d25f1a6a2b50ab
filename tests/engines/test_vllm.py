"""vLLM across its venv boundary: the install step, the worker's answers, and ``speculators eval --engine vllm`` on
the real engine (vLLM's CPU build, ``make vllm``) with a tiny target whose head_dim (32) vLLM's CPU attention takes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from speculators.engines import vllm_env
from speculators.engines.vllm_eval import best_setting, pass_row
from speculators.engines.vllm_runner import Job, Output
from speculators.errors import SpeculatorsError

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the install, no vLLM needed


def test_a_failed_install_leaves_nothing_that_looks_ready(tmp_path, monkeypatch):
    """pip cannot install the package: VllmUnavailable with pip's words, and no venv (complete or temporary) left."""
    monkeypatch.setattr(vllm_env, "package_spec", lambda gpu=None: "speculators-no-such-package==0.0.1")
    with pytest.raises(vllm_env.VllmUnavailable, match="speculators-no-such-package"):
        vllm_env.build_vllm_venv(tmp_path / "venv", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_a_venv_counts_only_with_its_marker_for_this_package(tmp_path, monkeypatch):
    venv = tmp_path / vllm_env.LOCAL_VENV
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(vllm_env.ENV_VAR, raising=False)
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    assert vllm_env.find_vllm_python() is None  # no marker: an interrupted install
    (venv / ".complete").write_text("vllm==0.1.0 0.1.0\n")
    assert vllm_env.find_vllm_python() is None  # another package / version
    (venv / ".complete").write_text(f"{vllm_env.package_spec()} {vllm_env.VLLM_VERSION}\n")
    assert vllm_env.find_vllm_python() == venv / "bin" / "python"
    monkeypatch.setenv(vllm_env.ENV_VAR, "/somewhere/python")
    assert vllm_env.find_vllm_python() == Path("/somewhere/python")


def test_offline_install_step_exits_0_except_under_ci(monkeypatch, tmp_path, capsys):
    def fail(dest, log=print):
        raise vllm_env.VllmUnavailable("no network")

    monkeypatch.setattr(vllm_env, "build_vllm_venv", fail)
    monkeypatch.setenv("CI", "false")
    assert vllm_env.main([str(tmp_path / "v")]) == 0
    assert "vLLM unavailable: no network" in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    assert vllm_env.main([str(tmp_path / "v")]) == 1


# ----------------------------------------------------------------------------- rows from vLLM's records


def test_tau_counts_every_decode_step_where_vllms_mean_acceptance_length_counts_drafting_steps():
    """ngram drafted in 2 of 5 decode steps: vLLM's mean acceptance length is 1 + 3/2, our tau 8 tokens / 5 steps."""
    # 9 tokens: 1 from the prefill, then steps emitting 3 (2 accepted), 1, 1, 2 (1 accepted), 1 = 8
    out = Output(list(range(9)), seconds=1.0, decode_seconds=0.5, per_step_accepted=[2, 1], per_step_drafted=[3, 3],
                 decode_steps=5)
    job = Job("generate", [out], wall_seconds=1.0, counters={"num_drafts": 2, "num_draft_tokens": 6,
                                                              "num_accepted_tokens": 3, "accepted_per_pos": [2, 1, 0]})
    row = pass_row("ngram k=3", "ngram", 3, 1, job)
    assert row["steps"] == 5 and row["tau"] == pytest.approx(8 / 5)
    assert row["vllm_mean_acceptance_length"] == pytest.approx(2.5)
    assert (row["accepted"], row["drafted"]) == (3, 6) and row["ms_per_step"] == pytest.approx(100.0)
    assert row["tokens_per_s"] == pytest.approx(9.0)


def test_a_step_cut_at_the_end_counts_only_what_it_emitted():
    # 5 tokens: prefill 1, one step of 3 accepted drafts + its bonus
    out = Output([1, 2, 3, 4, 5], per_step_accepted=[3], per_step_drafted=[3], decode_steps=1)
    row = pass_row("drafter k=3", "drafter", 3, 1, Job("generate", [out], wall_seconds=1.0))
    assert row["steps"] == 1 and row["tau"] == 4.0 and row["accepted"] == 3
    out = Output([1, 2, 3], per_step_accepted=[3], per_step_drafted=[3], decode_steps=1)  # cut to 2 drafts
    row = pass_row("drafter k=3", "drafter", 3, 1, Job("generate", [out], wall_seconds=1.0))
    assert row["steps"] == 1 and row["tau"] == 2.0 and row["accepted"] == 2
    # ngram: 9 tokens; steps counted by the worker (5), the record has its 2 drafting steps, the last one cut
    out = Output(list(range(9)), per_step_accepted=[2, 3], per_step_drafted=[3, 3], decode_steps=5)
    row = pass_row("ngram k=3", "ngram", 3, 1, Job("generate", [out], wall_seconds=1.0))
    assert row["steps"] == 5 and row["tau"] == pytest.approx(8 / 5)
    with pytest.raises(SpeculatorsError, match="did not count the decode steps"):
        pass_row("plain", "plain", None, 1, Job("generate", [Output([1, 2])], wall_seconds=1.0))


def test_best_setting_never_picks_a_failed_pass():
    def row(label, method, tps):
        return {"label": label, "method": method, "batch_size": 1, "tokens_per_s": tps, "k": 2}

    rows = [row("plain", "plain", 10.0), row("drafter k=2", "drafter", 12.0), row("drafter k=1", "drafter", 11.0),
            row("ngram k=2", "ngram", 10.5)]
    b = best_setting(rows)
    assert b["row"] == "drafter k=2" and b["beats_plain"] and b["beats_ngram"] and b["fastest_overall"] == "drafter k=2"
    b = best_setting(rows, {"drafter k=2"})
    assert b["row"] == "drafter k=1"


# ----------------------------------------------------------------------------- the real engine


@pytest.mark.slow
def test_eval_engine_vllm_measures_plain_the_drafter_and_ngram(vllm_python, tmp_path, isolated_cache, vllm_target_dir):
    from typer.testing import CliRunner

    from conftest import cli_train
    from speculators.cli import app

    run = cli_train(ROOT / "recipes/tiny-eagle3.yaml", vllm_target_dir, tmp_path / "run", "train.steps=20")
    r = CliRunner().invoke(app, ["eval", str(run), "--engine", "vllm", "-k", "2", "--slots", "1,2",
                                 "--num-prompts", "2", "--max-new-tokens", "12"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((run / "eval-vllm" / "report.json").read_text())
    labels = [x["label"] for x in rep["rows"]]
    assert labels == ["plain", "drafter k=2", "ngram k=2", "plain x2", "drafter k=2 x2", "ngram k=2 x2"]
    by = {x["label"]: x for x in rep["rows"]}
    assert all(x["max_in_flight"] == (2 if x["label"].endswith(" x2") else 1) for x in rep["rows"]), \
        [(x["label"], x["max_in_flight"]) for x in rep["rows"]]  # "1 request in flight" is what ran
    assert by["plain"]["tau"] == 1.0 and by["plain"]["drafted"] == 0 and by["plain"]["speedup"] == 1.0
    d = by["drafter k=2"]
    assert d["drafted"] > 0 and 1.0 <= d["tau"] <= 3.0 and d["vllm_counters"]["num_draft_tokens"] == d["drafted"]
    assert rep["greedy_check"]["passed"] and rep["greedy_check"]["failures"] == 0
    assert rep["dtype"] == "float32" and rep["threads"] >= 1
    assert "-m vllm.entrypoints.openai.api_server --model" in rep["serve"] and '"num_speculative_tokens": 2' in rep["serve"]
    assert (run / "eval-vllm" / "report.md").read_text().startswith("# speculators eval --engine vllm")


def test_eval_engine_vllm_refuses_what_it_cannot_measure(tmp_path):
    from typer.testing import CliRunner

    from speculators.cli import app

    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "vllm", "--temperature", "0.7"])
    assert r.exit_code == 2 and "--engine vllm measures temperature 0" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "vllm", "--p-min", "0.5"])
    assert r.exit_code == 2 and "--p-min: only with --engine llama.cpp" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "sglang"])
    assert r.exit_code == 2 and "allowed: llama.cpp, vllm" in r.output
