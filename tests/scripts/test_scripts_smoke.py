"""Every script under scripts/ runs once in CI, small (a smoke test), so that none rots unnoticed.

Each test runs a script as a subprocess of this interpreter (``[sys.executable, scripts/NAME, ...]``, cwd = the
checkout's root, ``PYTHONPATH`` = that root so the checkout's ``speculators`` is the one imported, CPU only, one
OpenMP thread, a module-private ``SPECULATORS_CACHE``) on the cheapest invocation that still goes through the
script's real code path: a tiny random target (conftest's ``tiny_target_dir``: 4 layers, hidden 64, the SmolLM2
tokenizer), a few prompts and tokens, one or two repetitions. The scripts that need a trained drafter share
one tiny EAGLE-3 run (``recipes/tiny-eagle3.yaml``, 6 steps) trained once per module. Every test checks exit
status 0 and something the script is for (its table's header and rows, the files it writes and their keys),
not only that it ran.

What does not run here, and what runs instead:

* ``gpu_check.sh`` needs CUDA: its ``--dry-run`` (every step at toy sizes on CPU) is run by
  tests/scripts/test_gpu_check.py; here ``bash -n`` and every script, option and test file its GPU steps name
  are checked to exist (:func:`test_gpu_check_sh`).
* ``bench_decode_step.py`` runs ``--no-compile``: the ``torch.compile`` columns cost ~25-90 s of inductor
  compilation on 2 cores even for the tiny target.
* ``dist_check.py`` runs one real (not dry) 1-process ``accelerate launch`` config (ddp): full run, killed run,
  ``--resume``, loss comparison. Its ``--dry-run`` is part of gpu_check.sh's dry run; the 2-process CPU
  launches of every engine are tests/train/test_distributed.py, test_fsdp.py and test_deepspeed.py.

:func:`test_every_script_has_a_smoke_test` fails when a script appears in scripts/ without one here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
RECIPES = ROOT / "recipes"

#: script file name -> the tests of this module that run it (filled by :func:`covers`)
COVERED: dict[str, list[str]] = {}


def covers(*names: str):
    """Record that the decorated test is the smoke test of ``names`` (file names under scripts/)."""
    def deco(fn):
        for n in names:
            COVERED.setdefault(n, []).append(fn.__name__)
        return fn
    return deco


def script_env(cache: Path) -> dict[str, str]:
    py_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": py_path, "SPECULATORS_CACHE": str(cache), "SPECULATORS_NO_PROGRESS": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def run_script(cache: Path, name: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python scripts/NAME ARGS`` from the repository root; asserts exit status 0 (the output on failure)."""
    r = subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], cwd=ROOT, env=script_env(cache),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, \
        f"{name} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    return r


def table_rows(text: str, first_cell: str | None = None) -> list[list[str]]:
    """The cells of every Markdown table row of ``text`` (``| a | b |``; separator rows left out), optionally
    only those whose first cell is ``first_cell``."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")) or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line[1:-1].split("|")]
        if first_cell is None or cells[0] == first_cell:
            rows.append(cells)
    return rows


def resolved_auto() -> str:
    from speculators.hardware import resolve_target_dtype

    return resolve_target_dtype("auto", "cpu")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One speculators cache for the module: the in-process training below and every script subprocess."""
    d = tmp_path_factory.mktemp("scripts-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(d))
    mp.setenv("SPECULATORS_NO_PROGRESS", "1")
    yield d
    mp.undo()


def cli_train(recipe: Path, target_dir: Path, out: Path, *overrides: str) -> Path:
    """``speculators train RECIPE target.model=TARGET_DIR OVERRIDES -o OUT`` in-process (typer's CliRunner)."""
    from typer.testing import CliRunner

    from speculators.cli import app

    r = CliRunner().invoke(app, ["train", str(recipe), f"target.model={target_dir}", *overrides, "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return out


@pytest.fixture(scope="module")
def eagle3_run(cache, tiny_target_dir, tmp_path_factory) -> Path:
    """The tiny EAGLE-3 recipe as written (float32 target, 6 steps), trained once for the module."""
    return cli_train(RECIPES / "tiny-eagle3.yaml", tiny_target_dir, tmp_path_factory.mktemp("eagle3") / "run")


# ----------------------------------------------------------------------------- benchmarks


@covers("bench_batched.py")
@pytest.mark.parametrize("dtype, args", [
    ("float32", ["--prompts", "4", "--batch", "1", "4", "--max-new", "6"]),
    # auto: resolved by the one rule (bf16 where this CPU is fast in it); one batch size, one proposer, so the
    # greedy comparison is with itself (bf16 outputs may legitimately differ between batch sizes)
    ("auto", ["--prompts", "2", "--batch", "1", "--max-new", "4", "--proposer", "none"]),
])
def test_bench_batched(cache, dtype, args):
    r = run_script(cache, "bench_batched.py", "--target", "tiny", "--device", "cpu", "--warmup", "0",
                   "--dtype", dtype, *args)
    want = dtype if dtype != "auto" else resolved_auto()
    assert f"(torch.{want})" in r.stdout, r.stdout
    proposers = ["none", "ngram"] if dtype == "float32" else ["none"]
    for name in proposers:
        assert f"{name}: | batch | seconds | tokens/s | batched forwards |" in r.stdout, r.stdout
        rows = [line for line in r.stdout.splitlines() if re.match(rf"{name}: \| \d+ \|", line)]
        assert len(rows) == len(args[args.index("--batch") + 1:args.index("--max-new")]), rows
        assert all(line.rstrip().endswith("| yes |") for line in rows), rows  # greedy equal at every batch size


@covers("bench_cost_model.py")
def test_bench_cost_model(cache, tiny_target_dir):
    from speculators.evaluation.report import BREAK_EVEN_COLUMNS

    r = run_script(cache, "bench_cost_model.py", "--model", tiny_target_dir, "--dtype", "auto", "--k", "2",
                   "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1")
    assert f", {resolved_auto()} on cpu" in r.stdout, r.stdout  # auto resolved, and said so
    assert "| " + " | ".join(BREAK_EVEN_COLUMNS) + " |" in r.stdout, r.stdout
    assert "largest |error|" in r.stdout
    parts = [row for row in table_rows(r.stdout.split("step parts", 1)[1]) if row[0] != "method"]
    assert {(row[0], row[1]) for row in parts} == {(m, b) for m in ("ngram", "suffix", "plain") for b in ("1", "2")}


@covers("bench_decode_step.py")
@pytest.mark.parametrize("drafter", [False, True], ids=["fresh-eagle3", "trained-drafter"])
def test_bench_decode_step(cache, tiny_target_dir, request, drafter):
    """Eager columns only (``--no-compile``: inductor compiles for minutes on 2 cores); every table with a
    freshly initialised EAGLE-3, the drafting table alone with a trained checkpoint (``--drafter``)."""
    common = ["--model", tiny_target_dir, "--dtype", "float32", "--batch", "1", "--k", "2", "--context", "16",
              "--reps", "2", "--threads", "1", "--no-compile"]
    extra = ["--drafter", request.getfixturevalue("eagle3_run"), "--no-target"] if drafter else \
        ["--draft-vocab", "256", "--bandwidth-mb", "16"]
    r = run_script(cache, "bench_decode_step.py", *common, *extra)
    assert "float32, 4 layers, hidden 64" in r.stdout, r.stdout
    assert "EAGLE-3 drafting per step" in r.stdout
    eager = table_rows(r.stdout, "eager")
    assert len(eager) == 1 and float(eager[0][1].split()[0]) > 0, eager
    target_rows = [row for row in table_rows(r.stdout) if row[0] == "1" and len(row) == 9]
    if drafter:
        assert not target_rows and "weights read per 1-token step" not in r.stdout
    else:
        assert [row[1] for row in target_rows] == ["1", "3"], target_rows  # m = 1 and m = K + 1
        assert "weights read per 1-token step" in r.stdout and table_rows(r.stdout, "eager step")


@covers("bench_drafting.py")
def test_bench_drafting(cache):
    r = run_script(cache, "bench_drafting.py", "--models", "tiny", "--batch", "1,2", "--k", "2", "--context", "16",
                   "--repeats", "1")
    assert "propose batched" in r.stdout and "advance batched" in r.stdout, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("tiny ")]
    assert [row[1] for row in rows] == ["1", "2"], r.stdout
    assert "drafts differ" not in r.stdout  # the batched and the per-request paths draft the same tokens


@covers("bench_regenerate.py")
def test_bench_regenerate(cache, tiny_target_dir):
    r = run_script(cache, "bench_regenerate.py", "--target", tiny_target_dir, "--n", "4", "--max-new-tokens", "4",
                   "--old-batch", "2", "--feature-batch-tokens", "512", "--check-alone", "1")
    assert "| setting | dtype | order | batches |" in r.stdout, r.stdout
    (old,), (new,) = table_rows(r.stdout, "old"), table_rows(r.stdout, "new")
    assert old[1:4] == ["float32", "arrival", "2"], old
    assert new[1:3] == [resolved_auto(), "length-bucketed"], new
    assert 0 < int(old[6]) <= 16 and 0 < int(new[6]) <= 16  # 4 prompts x at most 4 new tokens
    assert re.search(r"check-alone \(\w+\): \d of 2 prompts identical alone and batched", r.stdout), r.stdout
    assert re.search(r"responses identical old vs new: \d of 4", r.stdout), r.stdout


@covers("bench_step_drafting.py")
def test_bench_step_drafting(cache, eagle3_run):
    r = run_script(cache, "bench_step_drafting.py", eagle3_run, eagle3_run / "final", "-k", "2", "--context", "16",
                   "--repeats", "2")
    assert "| checkpoint | family | layers | advance ms | propose ms | step ms | vs first |" in r.stdout, r.stdout
    rows = [row for row in table_rows(r.stdout) if row[0] != "checkpoint"]
    assert [(row[0], row[1]) for row in rows] == [(str(eagle3_run), "eagle3"), (str(eagle3_run / "final"), "eagle3")]
    assert rows[0][-1] == "1.00x" and all(float(row[5]) > 0 for row in rows)


@covers("bench_verifier.py")
def test_bench_verifier(cache):
    r = run_script(cache, "bench_verifier.py", "--device", "cpu", "--batch", "2", "--k", "2", "--vocab", "256",
                   "--temperature", "0", "1", "--repeats", "1", "--loop-repeats", "1", "--threads", "1")
    assert "rejection_sample: time per call" in r.stdout, r.stdout
    for col in ("torch ms", "loop ms", "torch speedup", "torch bw/copy"):
        assert col in r.stdout, col
    # one progress line per row on stderr: greedy, sampled with draft probs, sampled with point-mass drafts
    progress = [line.split() for line in r.stderr.splitlines() if re.match(r"^\d", line)]
    assert [row[:5] for row in progress] == [["0", "-", "2", "2", "256"], ["1", "q", "2", "2", "256"],
                                             ["1", "pm", "2", "2", "256"]], r.stderr


@covers("bench_verify_cost.py")
def test_bench_verify_cost(cache, tiny_target_dir):
    r = run_script(cache, "bench_verify_cost.py", "--model", tiny_target_dir, "--dtype", "auto", "--k", "2",
                   "--context", "16", "--reps", "2", "--bandwidth-mb", "8")
    assert f"thread(s), {resolved_auto()}, batch 1" in r.stdout, r.stdout
    assert "| tokens in the forward | drafts verified | ms | x 1-token (= break-even tau) |" in r.stdout
    forwards = [row for row in table_rows(r.stdout) if len(row) == 4 and row[0].isdigit()]
    assert [row[:2] for row in forwards] == [["1", "0"], ["2", "1"], ["3", "2"]] and forwards[0][3] == "1.00"
    matrices = [row[0].split(" (")[0] for row in table_rows(r.stdout) if re.search(r"\(\d+ x \d+\)", row[0])]
    assert matrices == ["q/o proj", "MLP up/gate", "MLP down", "lm_head"], r.stdout
    assert "| weights (MB) | read bandwidth (GB/s) |" in r.stdout


# ----------------------------------------------------------------------------- checks


def greedy_summary(stdout: str) -> list[list[str]]:
    """The rows of check_greedy_precision's first table (dtype, method..., K, batch, outputs, mismatch,
    near-tie, failures); a method name may hold spaces."""
    part = stdout.split("Greedy check per dtype", 1)[1].split("\nMismatches", 1)[0]
    rows = []
    for line in part.splitlines()[2:]:
        cells = line.split()
        if cells:
            rows.append([cells[0], " ".join(cells[1:-6]), *cells[-6:]])
    return rows


@covers("check_greedy_precision.py")
@pytest.mark.parametrize("mode", ["model-free", "checkpoint-tree"])
def test_check_greedy_precision(cache, tiny_target_dir, request, mode):
    common = ["--k", "2", "--num-prompts", "2", "--max-new-tokens", "8"]
    if mode == "model-free":  # n-gram and suffix, batch 1 and 2, float32 and auto
        args = ["--target", tiny_target_dir, "--dtype", "float32,auto", "--batch-size", "2"]
        want = {(d, m, "2" if m != "plain" else "0", b) for d in ("float32", resolved_auto())
                for m, b in (("ngram", "1"), ("suffix", "1"), ("plain", "2"), ("ngram", "2"), ("suffix", "2"))}
    else:  # the trained drafter as a chain and drafting a dynamic tree (the recipe's float32 target)
        args = ["--checkpoint", request.getfixturevalue("eagle3_run"), "--dtype", "float32", "--methods", "",
                "--tree", "depth=2,topk=2,total_tokens=4"]
        want = {("float32", "drafter", "2", "1"), ("float32", "tree dynamic d2 k2 n4", "2", "1")}
    r = run_script(cache, "check_greedy_precision.py", *args, *common)
    rows = greedy_summary(r.stdout)
    assert {tuple(row[:4]) for row in rows} == want, r.stdout
    assert all(row[4] == "2" for row in rows), rows  # both prompts compared
    # a correct verifier gives no failure in float32 (every mismatch there would count as one)
    assert all(row[7] == "0" for row in rows if row[0] == "float32"), r.stdout


@covers("placement_check.py")
def test_placement_check(cache):
    r = run_script(cache, "placement_check.py", "--target", "tiny", "--device-map", "auto", "--dtype", "auto",
                   "--tokens", "64", "--hidden", "64")
    assert f"| {resolved_auto()} | devices ['cpu'] |" in r.stdout, r.stdout
    rows = [row for row in table_rows(r.stdout) if row[0] in ("aux", "top", "logits")]
    assert [row[0] for row in rows] == ["aux", "top", "logits"], r.stdout
    assert all(row[3] == "True" for row in rows), rows  # one device: bit-identical to a plain load
    assert "FAILED" not in r.stdout


@pytest.mark.slow
@covers("dist_check.py")
def test_dist_check(cache, tmp_path):
    """The real (not dry) path with one config and one process (``accelerate launch`` on the CPU): the
    1-process reference, the full run, a copy killed after its step-2 checkpoint and ``--resume``d, the loss
    comparison and the table. ~40 s on 2 cores."""
    r = run_script(cache, "dist_check.py", "--configs", "ddp", "--processes", "1", "--work", tmp_path / "work",
                   timeout=500)
    assert "config ddp: distributed_type" in r.stdout and "reference (1 process, grad_accum 2): losses {1:" in r.stdout
    (row,) = table_rows(r.stdout, "ddp")
    assert row[1:3] == ["1", "ok"], r.stdout
    assert float(row[3]) <= 1e-4 and float(row[4]) <= 1e-4, row
    resumed = [json.loads(x) for x in (tmp_path / "work" / "ddp-crashed" / "train_log.jsonl").read_text().splitlines()]
    assert max(x["step"] for x in resumed if "train/loss" in x) == 4


@covers("gpu_check.sh")
def test_gpu_check_sh():
    """gpu_check.sh needs CUDA, so here only what runs without it: ``bash -n`` parses it, and every
    ``scripts/X.py`` its steps run (GPU and dry-run branches) exists and declares every ``--option`` passed to
    it, and every test file it names exists. Its ``--dry-run`` (each step at toy sizes on CPU, a failing step
    failing the script) is tests/scripts/test_gpu_check.py."""
    sh = SCRIPTS / "gpu_check.sh"
    r = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = sh.read_text().replace("\\\n", " ")  # one command per line
    calls = 0
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        for i, w in enumerate(words):
            if re.fullmatch(r"scripts/\w+\.py", w):
                calls += 1
                declared = {a.value for node in ast.walk(ast.parse((ROOT / w).read_text()))
                            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                            for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
                passed = {x for x in words[i + 1:] if x.startswith("--")}
                assert passed <= declared, f"{w}: gpu_check.sh passes {sorted(passed - declared)}, not declared"
            elif re.fullmatch(r"tests/\S+\.py", w):
                assert (ROOT / w).is_file(), w
    assert calls >= 6, calls  # bench_verifier, bench_batched, dist_check, placement_check in both branches


# ----------------------------------------------------------------------------- runs and reports


@covers("compare_families.py")
def test_compare_families(cache, tiny_target_dir, tmp_path):
    """Trains and evaluates the tiny EAGLE-3 recipe through the script (``--set`` passes the target,
    ``--outputs`` keeps it out of the repository's outputs/), then a ``--no-train`` rerun reuses both."""
    out = tmp_path / "cmp"
    args = [RECIPES / "tiny-eagle3.yaml", "-k", "2", "--outputs", out]
    r = run_script(cache, "compare_families.py", *args, "--set", f"target.model={tiny_target_dir}",
                   "--set", "train.steps=2")
    assert re.search(r"^\+ .* train .*tiny-eagle3\.yaml", r.stdout, re.M) and "+ " in r.stdout, r.stdout
    table = (out / "families.md").read_text()
    header, row = table_rows(table)
    assert header[:3] == ["recipe", "tau", "acc. rate"] and header[-2:] == ["train time", "target ppl"], header
    assert row[0] == "tiny-eagle3" and len(row) == len(header) and float(row[1]) >= 1.0, row
    assert row[-2].endswith(" min") and row[-1] == "-", row  # train time recorded; not a joint run
    rep = json.loads((out / "tiny-eagle3" / "compare-k2" / "report.json").read_text())
    assert "draft_ms_per_step" in rep["drafter"] and (out / "tiny-eagle3" / "train_seconds.json").is_file()
    again = run_script(cache, "compare_families.py", *args, "--no-train")
    assert "+ " not in again.stdout and table_rows(again.stdout) == [header, row], again.stdout  # nothing rerun


@covers("stage_costs.py")
def test_stage_costs(tiny_target_dir, tmp_path):
    """The tiny EAGLE-3 recipe's stages from cold caches (a fresh cache of its own): a row for regeneration,
    features and training (no ``source: self`` here: no synthesis row), each with its tokens, a rate and the
    CPU-hours extrapolated to a million assistant tokens; ``--also-every-row`` adds the same training with the loss
    on every row and the ratio."""
    r = run_script(tmp_path, "stage_costs.py", RECIPES / "tiny-eagle3.yaml", "--prompts", 8, "--train-steps", 3,
                   "--set", f"target.model={tiny_target_dir}", "--set", "train.epochs=2", "--set", "train.steps=null",
                   "--also-every-row")
    header, *body = table_rows(r.stdout)
    assert header[:5] == ["stage", "tokens", "wall s", "CPU s", "tokens/CPU-s"], r.stdout
    assert header[5] == "CPU-h per 1,000,000 assistant tokens", header
    rows = {row[0]: row for row in body}
    assert list(rows) == ["regeneration", "features", "training", "training, every row"], rows
    # tokens, rate and extrapolation > 0 (the CPU s column is rounded to 0.1 s: a tiny step may print 0.0)
    assert all(int(row[1]) > 0 and float(row[3]) >= 0 and float(row[4]) > 0 and float(row[5]) > 0
               for row in rows.values()), rows
    assert int(rows["features"][1]) > int(rows["regeneration"][1])  # features cover prompts and answers
    assert rows["training, every row"][1] == rows["training"][1]  # the same steps over the same data
    assert "epochs 2" in r.stdout and re.search(r"every row / labelled rows only: \d+\.\d\dx", r.stdout), r.stdout


def test_stage_costs_extrapolation():
    """CPU-hours per N assistant tokens: a data stage's CPU seconds per training assistant token times N; training's
    per timed token, times an epoch's tokens and the epochs; a stage that did not run has no row; no assistant token
    or no epochs gives n/a, never 0."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from stage_costs import StageClock, cost_rows
    finally:
        sys.path.remove(str(SCRIPTS))
    clock = StageClock()
    clock.tokens.update({"regeneration": 1000, "features": 3000, "training": 8000})
    clock.cpu.update({"regeneration": 10.0, "features": 2.0, "training": 4.0})
    info = {"assistant": 2000, "epoch_tokens": 16000}
    rows = {r[0]: r for r in cost_rows(clock, info, epochs=3, per=1e6)}
    assert list(rows) == ["regeneration", "features", "training"]
    assert rows["regeneration"][4] == "100.0" and float(rows["regeneration"][5]) == pytest.approx(10 * 500 / 3600, 1e-3)
    assert float(rows["features"][5]) == pytest.approx(2 * 500 / 3600, rel=1e-3)
    assert float(rows["training"][5]) == pytest.approx(4 / 8000 * 16000 * 3 * 500 / 3600, rel=1e-3)
    assert cost_rows(clock, {"assistant": 0, "epoch_tokens": 16000}, 3, 1e6)[0][5] == "n/a"
    assert cost_rows(clock, info, None, 1e6)[2][5] == "n/a"  # a recipe with train.steps: no epochs to scale by


@covers("learning_curve.py")
def test_learning_curve(cache, tiny_target_dir, tmp_path):
    """Two data sizes of the tiny EAGLE-3 recipe: a row per fraction, the smaller one on fewer training examples
    (a nested seeded subset) and the same held-out prompts; a rerun reuses both runs."""
    out = tmp_path / "lc"
    args = [RECIPES / "tiny-eagle3.yaml", "--fractions", "0.5,1", "--outputs", out, "--set",
            f"target.model={tiny_target_dir}", "--set", "train.steps=2"]
    r = run_script(cache, "learning_curve.py", *args)
    assert r.stdout.count("data.train_fraction=") == 2, r.stdout
    header, half, full = table_rows((out / "tiny-eagle3-learning-curve.md").read_text())
    assert header[:3] == ["fraction", "train examples", "assistant tokens"] and header[4].startswith("tau (K="), header
    assert half[0] == "0.5" and full[0] == "1" and 0 < int(half[1]) < int(full[1]), (half, full)
    assert float(half[4].split()[0]) >= 1.0 and "[" in half[4] and full[-1].endswith(" min"), (half, full)
    a = json.loads((out / "tiny-eagle3-lc-0.5" / "eval-lc" / "report.json").read_text())
    b = json.loads((out / "tiny-eagle3-lc-1" / "eval-lc" / "report.json").read_text())
    assert a["prompts"] == b["prompts"] and a["num_prompts"] == b["num_prompts"]  # the same held-out prompts
    again = run_script(cache, "learning_curve.py", *args)
    assert "+ " not in again.stdout and table_rows(again.stdout)[1:] == [half, full], again.stdout


def test_a_terminated_learning_curve_leaves_no_training_running(tmp_path):
    """learning_curve.py / compare_losses.py run `speculators train` as a child: a SIGTERM to the script stops the
    child too (without the handler the child outlives it and keeps both cores busy)."""
    marker = tmp_path / "child.pid"
    child_py = tmp_path / "child.py"
    child_py.write_text(f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    code = f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); from learning_curve import run; " \
           f"run([sys.executable, {str(child_py)!r}])"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    for _ in range(200):
        if marker.is_file() and marker.read_text():
            break
        parent.poll()
        assert parent.returncode is None, parent.returncode
        time.sleep(0.05)
    child = int(marker.read_text())
    parent.terminate()
    assert parent.wait(timeout=10) == 128 + 15
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, 9)
    raise AssertionError(f"the child {child} outlived its terminated parent")


@covers("compare_losses.py")
def test_compare_losses(cache, tiny_target_dir, tmp_path):
    """Two variants of the tiny EAGLE-3 recipe (the recipe, and train.loss=tv with Muon): a row each, trained with
    what the variant says (recorded in the run's recipe), measured on the same held-out prompts."""
    out = tmp_path / "cl"
    r = run_script(cache, "compare_losses.py", RECIPES / "tiny-eagle3.yaml", "--variant", "forward_kl=",
                   "--variant", "tv_muon=train.loss=tv,train.optimizer=muon", "--outputs", out,
                   "--set", f"target.model={tiny_target_dir}", "--set", "train.steps=2")
    assert r.stdout.count(" train ") >= 2, r.stdout
    header, base, tv = table_rows((out / "tiny-eagle3-losses.md").read_text())
    assert header[:3] == ["variant", "overrides", "held-out sim_tau"] and header[4].startswith("tau (K="), header
    assert base[:2] == ["forward_kl", "`(recipe)`"] and tv[:2] == ["tv_muon", "`train.loss=tv train.optimizer=muon`"]
    assert float(tv[4].split()[0]) >= 1.0 and "[" in tv[4], tv
    rec = yaml.safe_load((out / "tiny-eagle3-tv_muon" / "recipe.yaml").read_text())
    assert rec["train"]["loss"] == "tv" and rec["train"]["optimizer"] == "muon", rec["train"]
    a = json.loads((out / "tiny-eagle3-forward_kl" / "eval-losses" / "report.json").read_text())
    b = json.loads((out / "tiny-eagle3-tv_muon" / "eval-losses" / "report.json").read_text())
    assert a["prompts"] == b["prompts"]


@covers("export_held_out.py")
def test_export_held_out(cache, eagle3_run, tmp_path):
    """The demo's run directories record ``target.dtype: auto`` (the recipe default): the script resolves it
    by the one rule (it once failed with ``unknown dtype 'auto'``)."""
    run = tmp_path / "run"
    run.mkdir()
    rec = yaml.safe_load((eagle3_run / "recipe.yaml").read_text())
    rec["target"]["dtype"] = "auto"
    (run / "recipe.yaml").write_text(yaml.safe_dump(rec))
    out = tmp_path / "held-out"
    r = run_script(cache, "export_held_out.py", run, "--output", out)
    assert "target dtype: auto -> " in r.stdout, r.stdout
    rows = [row for row in table_rows(r.stdout) if row[0] != "source"]
    assert sorted(row[0] for row in rows) == ["chatterbot", "humaneval"], r.stdout  # the recipe's two sources
    for source, n, path in rows:
        assert Path(path) == out / f"{source}.jsonl"
        lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
        assert len(lines) == int(n) > 0
        for x in lines:
            assert set(x) == {"id", "messages"} and x["id"].startswith(f"{source}/"), x
            assert x["messages"] and x["messages"][-1]["role"] == "user", x  # the prompt, not the answer


@covers("recipe_reference.py")
def test_recipe_reference(cache, tmp_path):
    """Writes the block into a stale copy of docs/USAGE.md (``--file``): the copy then equals the committed file
    (tests/test_recipe_reference.py checks the committed block and ``--check``)."""
    rewrites_a_stale_copy(cache, tmp_path, "recipe_reference.py", ROOT / "docs" / "USAGE.md",
                          "<!-- recipe-reference:begin", "\n| `train.", "recipe reference rewritten")


def rewrites_a_stale_copy(cache, tmp_path, script: str, page: Path, begin: str, line_start: str, said: str) -> None:
    """``script --file COPY`` on a copy of ``page`` with one generated line dropped (the first after ``begin``
    starting with ``line_start``): it says ``said`` and the copy then equals the committed page."""
    text = page.read_text()
    stale_at = text.index(line_start, text.index(begin))
    copy = tmp_path / page.name
    copy.write_text(text[:stale_at] + text[text.index("\n", stale_at + 1):])  # one line dropped
    r = run_script(cache, script, "--file", copy)
    assert f"{copy}: {said}" in r.stdout, r.stdout
    assert copy.read_text() == text


@covers("refit_calibration.py")
def test_refit_calibration(cache, tiny_target_dir, tmp_path):
    """On the outcomes ``speculators calibrate`` writes for a tiny DSpark run (2 training steps): the three
    calibrators' table, the fitted parameters and the prompt bootstrap (~15 s with the training)."""
    from typer.testing import CliRunner

    from speculators.cli import app

    run = cli_train(RECIPES / "tiny-dspark.yaml", tiny_target_dir, tmp_path / "run", "train.steps=2")
    cal = tmp_path / "cal"
    c = CliRunner().invoke(app, ["calibrate", str(run), "--prompts", "chatterbot", "--num-prompts", "8",
                                 "--max-new-tokens", "12", "--skip-prompts", "0", "--no-store", "--output", str(cal)])
    assert c.exit_code == 0, f"{c.exception!r}\n{c.output}"
    r = run_script(cache, "refit_calibration.py", cal / "outcomes.safetensors", "--positions", "2", "--bins", "5")
    first = r"^\d+ fitting steps, \d+ measuring steps, K = 4; ECE on held-out prompts"
    assert re.search(first, r.stdout, re.M), r.stdout
    header = ["calibrator", "ECE pooled", "x raw", "perfect head's ECE", "NLL", "ECE_1", "ECE_2", "S_1 pred/obs",
              "S_2 pred/obs"]
    assert table_rows(r.stdout)[0] == header, r.stdout
    rows = table_rows(r.stdout)[1:]
    assert [row[0] for row in rows] == ["raw (T = 1, b = 0)", "STS (T per position)", "Platt (T and b per position)"]
    assert rows[0][2] == "1.00" and all(len(row) == len(header) for row in rows)
    assert "STS T = [" in r.stdout and "Platt T = [" in r.stdout
    boot = r.stdout.split("Prompt bootstrap (", 1)[1]
    assert [line.split(":")[0] for line in boot.splitlines() if line.startswith("- ")] == \
        [f"- {row[0]}" for row in rows], r.stdout


def _llama_cpp_at_collection():
    """The llama.cpp build as the real cache holds it (found at import, before this module's private cache is set),
    or why there is none."""
    from speculators.engines.llamacpp_build import LlamaCppUnavailable, build_dir, find_llama_cpp

    try:
        found = find_llama_cpp()
    except LlamaCppUnavailable as e:
        return None, str(e)
    return found, None if found else f"llama.cpp is not built (make llama-cpp; expected {build_dir()})"


LLAMA_CPP = _llama_cpp_at_collection()


def use_llama_cpp(monkeypatch) -> None:
    """Point the scripts at the llama.cpp build (:data:`LLAMA_CPP`); skip saying why without one (fail under CI)."""
    lc, why = LLAMA_CPP
    if lc is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)
    monkeypatch.setenv("SPECULATORS_LLAMA_CPP", str(lc.server.parent.parent))
    monkeypatch.setenv("SPECULATORS_LLAMA_CPP_SOURCE", str(lc.source))


@covers("bench_llamacpp_step_cost.py")
@pytest.mark.slow
def test_bench_llamacpp_step_cost(cache, tiny_target_dir, monkeypatch):
    """An untrained EAGLE-3 drafter for the tiny target, served at K = 1 and 2: a row per K whose steps drafted
    about K tokens each, and a break-even tau above 1 (a speculative step costs more than a plain token)."""
    use_llama_cpp(monkeypatch)
    r = run_script(cache, "bench_llamacpp_step_cost.py", "--target", tiny_target_dir, "--draft-vocab", "512",
                   "--ks", "1,2", "--prompts", "2", "--max-new-tokens", "16", "--threads", "1")
    assert "plain:" in r.stdout and "ms per token" in r.stdout
    rows = {row[0]: row for row in table_rows(r.stdout) if row[0].isdigit()}
    assert set(rows) == {"1", "2"}, r.stdout
    for k, row in rows.items():
        assert 0 < float(row[2]) <= int(k) and float(row[4]) > 1.0, row


@covers("llamacpp_types_table.py")
def test_llamacpp_types_table(cache, tmp_path):
    """Two engine reports (the target in two types): a row each with plain tok/s, the curve's ratios, the fastest
    drafter setting's speedup and the fastest setting overall; the step-cost rows recomputed for a report without
    them. An unreadable report is one clear error."""
    def report(gguf, plain_tps, drafter_tps, with_costs):
        plain = {"label": "plain t=0", "method": "plain", "k": None, "temperature": 0.0, "batch_size": 1,
                 "tokens_per_s": plain_tps, "speedup": 1.0, "tau": 1.0, "steps": 100, "decode_seconds": 1.0}
        drafter = {"label": "drafter k=1 t=0", "method": "drafter", "k": 1, "temperature": 0.0, "batch_size": 1,
                   "p_min": None, "draft_threads": None, "draft_outtype": "f16", "tokens_per_s": drafter_tps,
                   "speedup": drafter_tps / plain_tps, "tau": 1.5, "steps": 60, "decode_seconds": 0.9}
        ngram = dict(plain, label="ngram-mod t=0", method="ngram-mod", speedup=0.9)
        fastest = max((plain, drafter), key=lambda r: r["tokens_per_s"])["label"]
        rep = {"target_gguf": f"/x/{gguf}", "rows": [plain, drafter, ngram], "plain": plain,
               "verify_cost": {"tokens": [1, 2, 3, 5], "ratio": [1.0, 1.2, 1.6, 2.1]},
               "best": {"row": "drafter k=1 t=0", "ngram_best": "ngram-mod t=0"}, "fastest": {"row": fastest},
               "greedy_check": {"passed": True}, "settings": {"draft_outtypes": ["f16"]}}
        if with_costs:
            from speculators.engines.llamacpp_bench import step_costs
            rep["step_costs"] = step_costs(rep["rows"], rep["verify_cost"], "f16")
        d = tmp_path / gguf
        d.mkdir()
        (d / "report.json").write_text(json.dumps(rep))
        return d

    a, b = report("t-q4_1.gguf", 50.0, 40.0, True), report("t-q4_0.gguf", 80.0, 88.0, False)
    r = run_script(cache, "llamacpp_types_table.py", a, b / "report.json")
    (qa,), (qb,) = table_rows(r.stdout, "t-q4_1.gguf")[:1], table_rows(r.stdout, "t-q4_0.gguf")[:1]
    assert qa[1:5] == ["50.0", "1.20", "1.60", "2.10"] and qa[6] == "0.80" and qa[10] == "`plain t=0`", r.stdout
    assert qb[6] == "1.10" and qb[10] == "`drafter k=1 t=0`" and qb[11] == "PASS", r.stdout
    costs = {row[0]: row for row in table_rows(r.stdout) if len(row) == 9 and row[1] == "1"}
    assert costs["t-q4_0.gguf"][3:6] == ["10.00", "15.00", "12.00"], costs  # 0.9 s / 60 steps; 10 ms x 1.2
    bad = subprocess.run([sys.executable, str(SCRIPTS / "llamacpp_types_table.py"), str(tmp_path / "none")],
                         cwd=ROOT, env=script_env(cache), capture_output=True, text=True)
    assert bad.returncode != 0 and "not a readable engine report" in bad.stderr


@covers("bench_regenerate_server.py")
@pytest.mark.slow
def test_bench_regenerate_server(cache, vllm_target_dir, vllm_python, monkeypatch):
    """A tiny target vLLM's CPU attention takes (head_dim 32) regenerated by our loop, by llama-server (its f16
    conversion, 2 slots) and by vLLM's server (2 requests in flight): a row each with tokens per CPU-second and the
    ratio to our loop, and a parity row per server counting the prompts."""
    use_llama_cpp(monkeypatch)
    r = run_script(cache, "bench_regenerate_server.py", "--target", vllm_target_dir, "--n", "4", "--max-new-tokens",
                   "6", "--slots", "2", "--outtypes", "as-is", "--threads", "1", "--vllm-inflight", "2")
    (ours,), (srv,), (vl,) = ([row for row in table_rows(r.stdout, name) if len(row) == 9]  # the throughput table
                              for name in ("pytorch", "llama-server x2", "vllm x2"))
    assert ours[1] == resolved_auto() and srv[1].endswith(".gguf") and srv[2] == "2" and vl[2] == "2", r.stdout
    for row in (ours, srv, vl):
        assert 0 < int(row[3]) <= 4 * 6 and float(row[7]) > 0, row
    assert float(ours[8]) == 1.0 and float(srv[8]) > 0 and float(vl[8]) > 0, r.stdout
    parity = {row[0]: row for row in table_rows(r.stdout) if "of 4" in row[1]}
    assert set(parity) == {"target-f16.gguf x2", "vllm x2"}, r.stdout
    assert all(re.fullmatch(r"\d of 4", row[1]) for row in parity.values()), parity


@covers("vllm_served_table.py")
@pytest.mark.slow
def test_vllm_served_table(cache, vllm_target_dir, vllm_python, tmp_path):
    """A tiny draft-model run served by vLLM itself: one row naming the run and ``draft_model``, lossless on both
    held-out prompts, vLLM's and our loop's accepted counts side by side, PASS; --json writes the result."""
    run = cli_train(RECIPES / "tiny-draft_model.yaml", vllm_target_dir, tmp_path / "dm", "train.steps=1")
    r = run_script(cache, "vllm_served_table.py", run, "--prompts", "2", "--max-tokens", "8", "--json",
                   tmp_path / "served.json", timeout=600)
    (row,) = table_rows(r.stdout, "dm")
    assert row[1] == "`draft_model`" and row[3].startswith("2 of 2") and row[9] == "PASS", row
    assert re.fullmatch(r"(\d+) of \1", row[7]), row  # vLLM drafted what our loop drafted, at every step
    (res,) = json.loads((tmp_path / "served.json").read_text())
    assert res["method"] == "draft_model" and res["lossless"]["equal"] == 2, res


@covers("vllm_architectures.py")
@pytest.mark.slow
def test_vllm_architectures(cache, vllm_python):
    """One architecture, one family: Llama's draft model trained by the tiny recipe and served by vLLM, a table row
    whose cell says PASS with vLLM's accepted counts."""
    r = run_script(cache, "vllm_architectures.py", "--arch", "llama", "--families", "draft_model", "--layers", "2",
                   timeout=600)
    (row,) = table_rows(r.stdout, "llama")
    assert row[1].startswith("PASS"), row


# ----------------------------------------------------------------------------- completeness


@covers("cli_reference.py")
def test_cli_reference(cache, tmp_path):
    """Writes the block into a stale copy of docs/reference/cli.md (``--file``): the copy then equals the committed
    page (tests/test_docs_site.py checks the committed block with ``--check``)."""
    rewrites_a_stale_copy(cache, tmp_path, "cli_reference.py", ROOT / "docs" / "reference" / "cli.md",
                          "<!-- cli-reference:begin", "\n### `speculators push`", "CLI reference rewritten")


@covers("results_plots.py")
def test_results_plots(cache, tmp_path):
    """Draws the three plots of docs/results/index.md from the committed JSON into a temporary folder: three PNGs,
    each named on stdout, each a real image under 100 KB."""
    r = run_script(cache, "results_plots.py", "--out", tmp_path)
    for name in ("tau_per_family.png", "learning_curve.png", "engine_speedups.png"):
        png = tmp_path / name
        assert f"wrote {png}" in r.stdout, r.stdout
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 100_000, (name, len(data))


def test_every_script_has_a_smoke_test():
    scripts = {p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}
    missing = sorted(scripts - set(COVERED))
    assert not missing, f"scripts without a smoke test in {Path(__file__).name}: {missing} (add one, @covers(NAME))"
    stale = sorted(set(COVERED) - scripts)
    assert not stale, f"smoke tests of scripts that no longer exist: {stale}"
    tests = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert all(set(fns) <= tests for fns in COVERED.values()), COVERED
