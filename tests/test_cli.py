"""The command line: bad inputs give exit status 2 and ONE ``error:`` line (nothing half-written left
behind); ``train`` then ``eval`` of the tiny recipe works end to end; ``--resume`` / ``--overwrite``;
a second ``train`` of the same recipe hits the regeneration and feature caches.

The happy-path run (the tiny recipe as written, 6 steps) is trained once per module, in-process through
typer's CliRunner, on the tiny random target, with torch limited to one thread (on a busy 2-core machine
two OpenMP threads make these tiny ops many times slower).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import save_tiny_target
from safetensors.torch import load_file
from typer.testing import CliRunner

from speculators.cli import app
from speculators.recipe import recipe_from_dict

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-eagle3.yaml"
STEP_RE = re.compile(r"^step-\d+$")

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.lstrip().startswith("error:")]


def assert_user_error(result, *needles: str) -> str:
    """Exit status 2, exactly one ``error:`` line containing every needle, no traceback."""
    assert result.exit_code == 2, f"exit {result.exit_code}, exception {result.exception!r}\n{result.output}"
    errs = error_lines(result)
    assert len(errs) == 1, f"expected one error line, got {errs}\n{result.output}"
    for n in needles:
        assert n in errs[0], f"{n!r} not in {errs[0]!r}"
    assert "Traceback" not in result.output
    return errs[0]


def assert_nothing_written(out: Path) -> None:
    # the run directory may have been created (empty) but must hold nothing half-written
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.rglob("*"))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff}"


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@dataclass
class Run:
    dir: Path
    output: str


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory):
    """One fresh cache for the module (the first train is cold, later ones warm)."""
    d = tmp_path_factory.mktemp("cli-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(d))
    mp.setenv("SPECULATORS_NO_PROGRESS", "1")
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def trained(module_cache, tiny_target_dir, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("cli-run") / "run"
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "train.parity_check=true", "-o", out)  # + the end gate
    # (vLLM's step of the gate: tests/export/test_vllm_served.py; it reports this head_dim-16 target as not served)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return Run(out, r.output)


@pytest.fixture(scope="module")
def warm_run(trained, tiny_target_dir, tmp_path_factory) -> Run:
    """The same recipe trained again into a new directory (caches now warm)."""
    out = tmp_path_factory.mktemp("cli-run2") / "run"
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "-o", out)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return Run(out, r.output)


@pytest.fixture(scope="module")
def other_target_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target-h32"), smol_tokenizer, hidden=32)


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("override, needles", [
    ("drafter.algorithm=medusa9", ["drafter.algorithm", "medusa9", "eagle3"]),  # lists the allowed ones
    ("train.lrr=1e-3", ["train.lrr", "unknown key"]),
    ("trian.lr=1e-3", ["trian", "unknown key"]),
    ("train.lr=-1e-3", ["train.lr"]),
    ("drafter.ttt_steps=0", ["drafter.ttt_steps"]),
])
def test_bad_recipe_values(override, needles, tmp_path, isolated_cache, tiny_target_dir):
    out = tmp_path / "out"
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", override, "-o", out)
    assert_user_error(r, *needles)
    assert not out.exists()


def test_missing_recipe_file(tmp_path, isolated_cache):
    r = invoke("train", tmp_path / "nope.yaml", "-o", tmp_path / "out")
    assert_user_error(r, "nope.yaml", "does not exist")
    assert not (tmp_path / "out").exists()


def test_missing_model_path(tmp_path, isolated_cache):
    out = tmp_path / "out"
    r = invoke("train", TINY, "target.model=/nonexistent/model-dir", "-o", out)
    assert_user_error(r, "target.model", "/nonexistent/model-dir")
    assert_nothing_written(out)


def test_target_without_chat_template(tmp_path, isolated_cache, tiny_target_dir):
    from transformers import AutoTokenizer

    tdir = tmp_path / "no-template"
    shutil.copytree(tiny_target_dir, tdir)
    (tdir / "chat_template.jinja").unlink(missing_ok=True)  # where transformers 5 saves it
    cfg_file = tdir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)  # where older transformers saved it
    cfg_file.write_text(json.dumps(cfg))
    assert not AutoTokenizer.from_pretrained(tdir).chat_template  # precondition of this test
    out = tmp_path / "out"
    r = invoke("train", TINY, f"target.model={tdir}", "-o", out)
    assert_user_error(r, "chat template", "data.chat_template")
    assert_nothing_written(out)


def test_source_with_zero_examples(tmp_path, isolated_cache, tiny_target_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", f"data.sources=[{empty}]", "-o", out)
    assert_user_error(r, "empty.jsonl")
    assert "zero" in error_lines(r)[0]
    assert_nothing_written(out)
    assert not any(isolated_cache.rglob("*.safetensors"))  # no features extracted either


def test_existing_output_dir_needs_resume_or_overwrite(trained, tiny_target_dir):
    before = tree(trained.dir)
    w = weights(trained.dir / "final")
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "-o", trained.dir)
    assert_user_error(r, str(trained.dir), "--resume", "--overwrite")
    assert tree(trained.dir) == before
    assert_same_weights(weights(trained.dir / "final"), w)


@pytest.mark.parametrize("flag", [[], ["--overwrite"]])
def test_output_dir_that_is_a_file(tmp_path, isolated_cache, tiny_target_dir, flag):
    out = tmp_path / "out"
    out.write_text("not a directory")
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "-o", out, *flag)
    assert_user_error(r, str(out))
    assert out.read_text() == "not a directory"


def test_resume_and_overwrite_are_exclusive(tmp_path, isolated_cache, tiny_target_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "-o", out, "--resume", "--overwrite")
    assert_user_error(r, "--resume", "--overwrite")
    assert (out / "keep.txt").read_text() == "x"


def test_eval_rejects_bad_sampling_args(trained):
    r = invoke("eval", trained.dir, "--top-p", "1.5")
    assert_user_error(r, "--top-p", "1.5")
    r = invoke("eval", trained.dir, "-k", "0")
    assert_user_error(r, "-k")


@pytest.mark.parametrize("args, needles", [
    (["-k", "0"], ["-k 0", "eval.k", "greater than 0"]),
    (["-k", "65"], ["-k 65", "eval.k", "less than or equal to 64"]),  # the recipe schema's own bound
    (["--top-p", "2"], ["--top-p 2.0", "eval.top_p", "less than or equal to 1"]),
    (["--top-p", "0"], ["--top-p 0.0", "eval.top_p", "greater than 0"]),
    (["--temperature", "-0.5"], ["--temperature -0.5", "eval.temperature"]),
    (["--top-k", "-1"], ["--top-k -1", "eval.top_k"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0", "eval.max_new_tokens"]),
])
def test_eval_options_are_validated_by_the_recipes_eval_schema(trained, tmp_path, args, needles):
    """The eval spec is built THROUGH ``EvalSpec`` (no hand-written range checks): one error line naming
    the option, its value and the schema field; no target is loaded and nothing is written."""
    out = tmp_path / "report"
    r = invoke("eval", trained.dir, *args, "--output", out)
    assert_user_error(r, *needles)
    assert "eval: " not in r.output and "target " not in r.output  # stopped before the target loaded
    assert not out.exists()


def test_eval_default_prompts_are_the_data_layers_held_out_prompts(trained, tmp_path, monkeypatch):
    """eval decodes ``held_out_prompts`` of the recipe's data (the list ``prepare_data`` gives training),
    cut to ``--num-prompts``."""
    import speculators.data.pipeline as pipeline
    import speculators.evaluation.runner as evaluate

    calls, seen = [], []
    real_held, real_eval = pipeline.held_out_prompts, evaluate.run_eval

    def spy_held(*a, **kw):
        out = real_held(*a, **kw)
        calls.append((a, kw, out))
        return out

    def spy_eval(target, drafter, prompts, *a, **kw):
        seen.append(prompts)
        return real_eval(target, drafter, prompts, *a, **kw)

    monkeypatch.setattr(pipeline, "held_out_prompts", spy_held)
    monkeypatch.setattr(evaluate, "run_eval", spy_eval)
    r = invoke("eval", trained.dir, "--num-prompts", "2", "-k", "2", "--max-new-tokens", "4", "--output",
               tmp_path / "rep")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert len(calls) == 1 and len(seen) == 1
    (args, kw, got), = calls
    rec = recipe_from_dict(yaml.safe_load((trained.dir / "recipe.yaml").read_text()))
    assert args[0] == rec.data and kw.get("limit") == 2
    every = real_held(rec.data, args[1], pipeline.load_data(rec.data)[0])
    assert len(every) >= 2 and seen[0] == got == every[:2]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["num_prompts"] == 2 and rep["prompts"] == "held-out split of the recipe's sources"


def test_eval_prompts_from_a_source_are_deduplicated(trained, tmp_path, monkeypatch):
    import speculators.evaluation.runner as evaluate

    rows = [{"id": i, "messages": [{"role": "user", "content": f"Say {i % 3}."},
                                   {"role": "assistant", "content": "ok"}]} for i in range(7)]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in rows))
    seen = []
    real_eval = evaluate.run_eval
    monkeypatch.setattr(evaluate, "run_eval", lambda t, d, prompts, *a, **kw: seen.append(prompts)
                        or real_eval(t, d, prompts, *a, **kw))
    out = tmp_path / "rep"
    r = invoke("eval", trained.dir, "--prompts", src, "--num-prompts", "5", "-k", "2", "--max-new-tokens", "3",
               "--output", out)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert [p["id"] for p in seen[0]] == ["prompts/0", "prompts/1", "prompts/2"]  # 3 distinct prompts of 7 rows
    assert json.loads((out / "report.json").read_text())["prompts"] == str(src)
    r = invoke("eval", trained.dir, "--prompts", src, "--num-prompts", "2", "-k", "2", "--max-new-tokens", "3",
               "--output", tmp_path / "rep2")
    assert r.exit_code == 0 and [p["id"] for p in seen[1]] == ["prompts/0", "prompts/1"]
    r = invoke("eval", trained.dir, "--prompts", tmp_path / "missing.jsonl", "--output", tmp_path / "rep3")
    assert_user_error(r, "missing.jsonl")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_eval_rejects_non_positive_num_prompts(trained, tmp_path, n):
    out = tmp_path / "report"
    r = invoke("eval", trained.dir, "--num-prompts", n, "--output", out)
    assert_user_error(r, "--num-prompts")
    assert not out.exists()


def test_eval_not_a_checkpoint(tmp_path):
    r = invoke("eval", tmp_path)
    assert_user_error(r, str(tmp_path))


def test_eval_checkpoint_of_another_target(trained, other_target_dir, tmp_path):
    before = tree(trained.dir)
    out = tmp_path / "report"
    r = invoke("eval", trained.dir / "final", "--target", other_target_dir, "--output", out)
    line = assert_user_error(r, "hidden size", "64", "32")
    assert str(other_target_dir) in line
    assert not out.exists()
    assert tree(trained.dir) == before


# ----------------------------------------------------------------------------- happy path


def test_train_writes_a_complete_run_dir(trained, tiny_target_dir):
    d = trained.dir
    for f in ("config.json", "model.safetensors", "recipe.yaml"):
        assert (d / "final" / f).is_file(), f
    ckpts = sorted((d / "checkpoints").iterdir())
    assert ckpts and all(STEP_RE.match(p.name) for p in ckpts), [p.name for p in ckpts]
    assert [p.name for p in ckpts] == ["step-000004", "step-000006"]  # the two newest are kept
    assert not [p for p in d.rglob(".*")], "temporary files left behind"
    rec = recipe_from_dict(yaml.safe_load((d / "recipe.yaml").read_text()))
    assert rec.target.model == str(tiny_target_dir) and rec.train.steps == 6
    assert (d / "final" / "recipe.yaml").read_text() == (d / "recipe.yaml").read_text()
    steps = [json.loads(x)["step"] for x in (d / "train_log.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and max(steps) == 6
    cfg = json.loads((d / "final" / "config.json").read_text())
    assert cfg["speculators_training"]["drafter"]["algorithm"] == "eagle3"
    assert "done" in trained.output
    assert "regeneration: cache hit" not in trained.output  # the module cache started cold


def test_eval_greedy_is_lossless(trained):
    r = invoke("eval", trained.dir, "--temperature", "0")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep_file = trained.dir / "eval-k3-t0" / "report.json"
    assert rep_file.is_file() and (rep_file.parent / "report.md").is_file()
    rep = json.loads(rep_file.read_text())
    k = rep["k"]
    assert k == 3  # the recipe's eval.k
    assert rep["num_prompts"] == 3 and rep["max_new_tokens"] == 16 and rep["temperature"] == 0.0  # recipe's
    assert rep["greedy_mismatches"] == []
    d = rep["drafter"]
    assert 1.0 <= d["tau"] <= k + 1
    assert len(d["per_position"]) == k and len(d["conditional"]) == k
    assert d["steps"] > 0 and 0 <= d["accepted"] <= d["drafted"]
    # identical outputs -> identical token counts for every method
    assert d["tokens"] == rep["plain"]["tokens"] == rep["ngram"]["tokens"]
    assert 0 < rep["plain"]["tokens"] <= rep["num_prompts"] * rep["max_new_tokens"]
    assert rep["checkpoint"] == str(trained.dir / "final")
    assert "greedy losslessness" in r.output
    assert not error_lines(r)


def test_eval_sampled(trained, tmp_path):
    out = tmp_path / "sampled"
    r = invoke("eval", trained.dir, "--temperature", "0.7", "--top-p", "0.9", "-k", "2", "--output", out)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((out / "report.json").read_text())
    assert rep["k"] == 2 and rep["temperature"] == 0.7 and rep["top_p"] == 0.9
    assert rep["greedy_mismatches"] is None
    d = rep["drafter"]
    assert len(d["per_position"]) == 2 and len(d["conditional"]) == 2
    assert all(x is None or 0.0 <= x <= 1.0 for x in d["per_position"] + d["conditional"])  # None: n/a
    assert d["per_position"][0] is not None  # every step drafted a first token
    assert 1.0 <= d["tau"] <= 3.0
    assert rep["ngram"]["steps"] > 0 and rep["plain"]["tokens"] > 0


def test_resume_of_a_finished_run_does_not_retrain(trained, tiny_target_dir):
    d = trained.dir
    log_before = (d / "train_log.jsonl").read_text()
    w = weights(d / "final")
    ckpts = sorted(p.name for p in (d / "checkpoints").iterdir())
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "train.parity_check=true", "-o", d, "--resume")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert re.search(r"resume: continuing from .*step-000006.*step 6/6", r.output), r.output
    assert (d / "train_log.jsonl").read_text() == log_before  # no optimizer step was logged
    assert_same_weights(weights(d / "final"), w)
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ckpts


def test_overwrite_replaces_the_run_dir(tmp_path, tiny_target_dir):
    out = tmp_path / "out"
    (out / "checkpoints" / "step-000099").mkdir(parents=True)
    (out / "checkpoints" / "step-000099" / "trainer_state.pt").write_text("stale")
    (out / "stale.txt").write_text("stale")
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "train.steps=1", "-o", out, "--overwrite")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert not (out / "stale.txt").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert (out / "final" / "model.safetensors").is_file()
    assert "resume:" not in r.output


def test_second_train_hits_the_caches(trained, warm_run):
    cold, warm = trained.output, warm_run.output
    m = re.search(r"regeneration: (\d+) of \d+ prompts", cold)
    assert m, cold  # the first run regenerated...
    assert re.search(rf"regeneration: cache hit .*\({m.group(1)} responses\)", warm), warm  # ...the second did not
    assert not re.search(r"regeneration: \d+ of \d+ prompts", warm), warm
    n_extracted = len(re.findall(r"features: extracting", cold))
    assert n_extracted >= 1, cold
    assert len(re.findall(r"features: cache hit", warm)) == n_extracted, warm  # train (+ held-out) features
    assert "features: extracting" not in warm
    assert (warm_run.dir / "final" / "model.safetensors").is_file()


def test_cold_and_warm_cache_train_the_same_drafter(trained, warm_run):
    """Regression: the drafter's initialisation must not depend on whether the data caches were warm
    (regeneration used to reseed the global torch RNG on a cache miss, between the seed and
    ``Drafter.from_target``)."""
    assert_same_weights(weights(trained.dir / "final"), weights(warm_run.dir / "final"))


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(
        tmp_path, isolated_cache, tiny_target_dir, monkeypatch):
    from speculators.drafters import registry

    family = registry.get("eagle3")
    original = family.loss
    calls = {"n": 0}

    def poisoned(self, batch, norm=None):
        loss, metrics = original(self, batch, norm)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] >= 4 else loss), metrics

    monkeypatch.setattr(family, "loss", poisoned)
    out = tmp_path / "run"
    # NaN at step 4 (weights of update 3, never checkpointed): step-2 gave a finite loss at step 3, so it is good
    r = invoke("train", TINY, f"target.model={tiny_target_dir}", "train.eval_every=100", "-o", out)
    line = assert_user_error(r, "nan", "step 4", "step-000002")
    assert "train.lr" in line
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-000002"]
    assert not (out / "final").exists()
    assert (out / "checkpoints" / "step-000002" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- eval sweep / batch / compare


@pytest.mark.parametrize("args, needles", [
    (["-k", "1,x"], ["-k 1,x", "comma-separated integers"]),
    (["-k", "2,0"], ["-k 2,0", "eval.k_sweep.1", "greater than 0"]),
    (["-k", "1,65"], ["-k 1,65", "eval.k_sweep.1", "less than or equal to 64"]),
    (["--batch-size", "0"], ["--batch-size 0", "eval.batch_size", "greater than 0"]),
    (["--methods", "drafter,lookahead"], ["--methods", "eval.methods.1", "drafter"]),
    (["--dtype", "float8"], ["float8", "allowed"]),
])
def test_eval_sweep_and_batch_options_are_validated(trained, tmp_path, args, needles):
    out = tmp_path / "report"
    r = invoke("eval", trained.dir, *args, "--output", out)
    assert_user_error(r, *needles)
    assert "eval: " not in r.output and not out.exists()  # stopped before the target loaded


def test_eval_sweep_batches_compare_and_sources(trained, tmp_path):
    """-k 1,2 (one row per K, best K marked), --batch-size 2 (batch 1 and 2), two --prompts sources (OpenAI
    messages and ShareGPT), --compare (one table, same prompts), --device cpu; PNG plots beside report.md."""
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                         for i in range(2)))
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"conversations": [{"from": "human", "value": "Name a color."},
                                               {"from": "gpt", "value": "Red."}]}) + "\n")
    out = tmp_path / "rep"
    r = invoke("eval", trained.dir, "-k", "2,1", "--batch-size", "2", "--prompts", a, "--prompts", b,
               "--compare", trained.dir / "final", "--device", "cpu", "--max-new-tokens", "5", "--output", out)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((out / "report.json").read_text())
    assert rep["ks"] == [1, 2] and rep["batch_sizes"] == [1, 2] and rep["num_prompts"] == 3
    assert rep["device"] == "cpu" and rep["greedy_mismatches"] == []
    assert {r_["method"] for r_ in rep["rows"]} == {"drafter", "ngram", "suffix", "hybrid"}
    assert len(rep["rows"]) == 4 * 2 * 2
    assert rep["compare"]["checkpoints"] == [str(trained.dir), str(trained.dir / "final")]
    same = [row for row in rep["compare"]["rows"] if row["method"] == "drafter"]
    assert len(same) == 2 * 2 * 2  # two checkpoints x two batch sizes x two K
    for name in rep["plots"].values():
        assert (out / name).is_file() and f"]({name})" in (out / "report.md").read_text()
    assert "★" in r.output and "compare" in r.output and "suffix decoding" in r.output


def test_eval_methods_option_measures_only_the_named_proposers(trained, tmp_path):
    """--methods drafter: one row per K and batch size for the drafter only (plain decoding always runs)."""
    out = tmp_path / "rep"
    r = invoke("eval", trained.dir, "--methods", "drafter", "--batch-size", "2", "--max-new-tokens", "5",
               "--output", out)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((out / "report.json").read_text())
    assert {r_["method"] for r_ in rep["rows"]} == {"drafter"} and len(rep["plain_rows"]) == 2
    assert rep["greedy_mismatches"] == []


# ----------------------------------------------------------------------------- speculators check
def _reference_or_skip():
    """The reference venv's python, else skip saying why (an error under CI=true: the gate must run there)."""
    import os

    from speculators.export import reference_env

    python = reference_env.find_reference_python()
    why = "no reference venv (run `make reference`)" if python is None else None
    if python is not None:
        try:
            reference_env.probe(python)
        except reference_env.ReferenceUnavailable as e:
            why = str(e)
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: the parity gate must run: {why}")
        pytest.skip(why)
    return python


def test_check_static_layout_exit_codes(trained, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(trained.dir / "final", good)
    (good / "parity.json").unlink(missing_ok=True)
    r = CliRunner().invoke(app, ["check", str(good), "--no-parity", "--no-write"])
    assert r.exit_code == 0 and not (good / "parity.json").exists(), r.output
    r = CliRunner().invoke(app, ["check", str(good), "--no-parity"])
    assert r.exit_code == 0, r.output
    assert "vLLM 0.33.0 weight layout" in r.output and "Every tensor" in r.output
    # the result is recorded where `speculators push` reads it for the model card
    assert json.loads((good / "parity.json").read_text())["layout_problems"] == []
    bad = tmp_path / "bad"
    shutil.copytree(trained.dir / "final", bad)
    from safetensors.torch import save_file

    w = load_file(bad / "model.safetensors")
    w["confidence_bias"] = torch.zeros(3)
    save_file(w, bad / "model.safetensors")
    r = CliRunner().invoke(app, ["check", str(bad), "--no-parity"])
    assert r.exit_code == 1, r.output
    assert "`confidence_bias`" in r.output and "no module or parameter" in r.output


@pytest.mark.slow
def test_train_end_gate_and_check_command(trained, tmp_path):
    """`speculators train` ran the gate on final/ (parity.json, run card); `speculators check RUN_DIR` reruns it."""
    python = _reference_or_skip()
    g = json.loads((trained.dir / "final" / "parity.json").read_text())
    assert g["passed"] is True and g["parity"]["passed"] is True, g
    assert g["parity"]["max_abs_delta"] <= 1e-4 and g["parity"]["argmax_agreement"] == 1.0
    assert "held-out sequences of the run" in g["parity"]["inputs"]
    card = (trained.dir / "final" / "README.md").read_text()
    assert "## Parity with the reference implementation" in card and "PASS" in card
    from speculators.hub import checkpoint_files, hub_card

    hub = hub_card(trained.dir / "final", "me/drafter")
    assert "parity with vllm-project/speculators 0.9.0" in hub and ": PASS, max |delta logit|" in hub
    # vLLM's CPU attention has no head_dim 16: vLLM's step of the gate says so (when vLLM is installed) and passes
    served = g.get("served") or {}
    assert served.get("passed") is None and ("cannot serve the target" in (served.get("skipped") or "")
                                              or "vLLM unavailable" in (served.get("skipped") or "")), served
    assert "- served by vLLM: not run (" in hub
    assert "parity.json" in checkpoint_files(trained.dir / "final")
    r = CliRunner().invoke(app, ["check", str(trained.dir), "-n", "2", "--reference-python", str(python)])
    assert r.exit_code == 0, r.output
    assert "parity vs vllm-project/speculators 0.9.0: PASS (eagle3" in r.output
    assert "built-in texts" in r.output
