"""Multi-process training through ``accelerate launch``: two CPU processes joined over gloo.

* A 2-process run with ``train.grad_accum=1`` consumes the same global batches as a 1-process run with
  ``train.grad_accum=2`` (the global batch plan is the same on every rank; rank r takes micro-batches
  r, r + 2, ...), the loss is normalised by the token counts of all ranks and the gradient is reduced by
  DDP through the wrapped unit: the logged loss of every step and the final weights equal the 1-process
  run's (1e-4 relative).
* A 2-process run killed after its step-4 checkpoint and ``--resume``d with 2 processes reproduces the
  uninterrupted 2-process run; resumed with ONE process (``grad_accum=2``, the same global batch) too:
  the checkpoint holds the global step and data position, not per-rank state.
* Only rank 0 writes: one ``train_log.jsonl`` row per logged step, one ``done`` line.

Every run is a subprocess (one torch thread each) launched by ``python -m accelerate.commands.launch
--config_file recipes/accelerate/cpu.yaml`` (the shipped CPU config); the data caches are warmed first.
Slow (a few minutes on 2 cores: each launch starts two interpreters).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from speculators.cli import app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-eagle3.yaml"
CPU_CONFIG = ROOT / "recipes" / "accelerate" / "cpu.yaml"
STEPS, CRASH_AT = 6, 4
RTOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: Path, crash_at: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("SPECULATORS_TEST_CRASH_AT_STEP", None)
    env.update(SPECULATORS_CACHE=str(cache), SPECULATORS_NO_PROGRESS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="250",
               CUDA_VISIBLE_DEVICES="")
    if crash_at is not None:
        env["SPECULATORS_TEST_CRASH_AT_STEP"] = str(crash_at)
    return env


def _start(out: Path, target_dir: Path, cache: Path, processes: int, *extra: str, crash_at: int | None = None):
    """``speculators train`` of the tiny recipe with a global batch of 2 micro-batches: 1 process x
    grad_accum 2, or 2 processes (``accelerate launch``) x grad_accum 1."""
    train = ["-m", "speculators.cli", "train", str(TINY), f"target.model={target_dir}", f"train.steps={STEPS}",
             "train.checkpoint_every=2", "train.eval_every=3", f"train.grad_accum={2 // processes}",
             "-o", str(out), *extra]
    if processes == 1:
        cmd = [sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
               "--num_processes", str(processes), "--main_process_port", str(_free_port()), *train]
    return subprocess.Popen(cmd, env=_env(cache, crash_at), cwd=out.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        output, _ = p.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        pytest.fail(f"training subprocess timed out:\n{output[-5000:]}")
    return p.returncode, output


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        if wa[k].is_floating_point():
            torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=RTOL, atol=1e-6, msg=k)
        else:
            assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, tiny_target_dir) -> Path:
    cache = tmp_path_factory.mktemp("dist-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(cache))
    try:
        r = CliRunner().invoke(app, ["data", str(TINY), f"target.model={tiny_target_dir}"])
    finally:
        mp.undo()
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return cache


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, warm_cache) -> dict[str, Path]:
    """one: 1 process; two: 2 processes; crashed: 2 processes killed after step 4; resumed2 / resumed1: the
    crashed run resumed with 2 processes / with 1 process."""
    root = tmp_path_factory.mktemp("dist-runs")
    dirs = {name: root / name for name in ("one", "two", "crashed", "resumed2", "resumed1")}
    p1 = _start(dirs["one"], tiny_target_dir, warm_cache, 1)
    pc = _start(dirs["crashed"], tiny_target_dir, warm_cache, 2, crash_at=CRASH_AT)
    results = {"one": _finish(p1), "crashed": _finish(pc)}
    shutil.copytree(dirs["crashed"], dirs["resumed2"])
    shutil.copytree(dirs["crashed"], dirs["resumed1"])
    p2 = _start(dirs["two"], tiny_target_dir, warm_cache, 2)
    pr1 = _start(dirs["resumed1"], tiny_target_dir, warm_cache, 1, "--resume")
    results.update(two=_finish(p2), resumed1=_finish(pr1))
    results["resumed2"] = _finish(_start(dirs["resumed2"], tiny_target_dir, warm_cache, 2, "--resume"))
    for name, (rc, out) in results.items():
        if name == "crashed":
            assert rc != 0 and "done" not in out, out[-5000:]
        else:
            assert rc == 0, f"{name}:\n{out[-5000:]}"
    return {**dirs, "_output": {k: v[1] for k, v in results.items()}}


def test_two_processes_equal_one_process_with_the_same_global_batch(runs):
    out = runs["_output"]["two"]
    assert "x 2 processes (MULTI_CPU)" in out  # really two ranks joined over gloo, not one process
    one, two = _losses(runs["one"]), _losses(runs["two"])
    assert sorted(two) == list(range(1, STEPS + 1)) == sorted(one)
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=RTOL), (s, one, two)
    assert len(set(one.values())) == STEPS  # the losses change: the comparison can fail
    held = [r for r in _rows(runs["two"]) if "held_out/loss" in r]
    held_one = [r for r in _rows(runs["one"]) if "held_out/loss" in r]
    assert [r["step"] for r in held] == [r["step"] for r in held_one] == [3, 6]
    for a, b in zip(held, held_one):
        assert a["held_out/loss"] == pytest.approx(b["held_out/loss"], rel=RTOL)
    _assert_same_weights(runs["one"] / "final", runs["two"] / "final")


def test_only_rank_zero_writes_logs_and_reports(runs):
    out = runs["_output"]["two"]
    assert out.count("done:") == 1 and out.count("train: final drafter written") == 1
    steps = [r["step"] for r in _rows(runs["two"]) if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))  # one row per step, not one per rank
    assert len(list((runs["two"] / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # the tokens of the global batch: both ranks' (= the 1-process run's)
    assert (runs["two"] / "final" / "README.md").read_text().split(" tokens,")[0].split()[-1] == \
        (runs["one"] / "final" / "README.md").read_text().split(" tokens,")[0].split()[-1]


def test_killed_two_process_run_resumes_with_two_or_one_processes(runs):
    crashed = runs["crashed"]
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-000002", "step-000004"]
    assert not (crashed / "final").exists()
    state = torch.load(crashed / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert state["step"] == CRASH_AT and state["num_processes"] == 2 and len(state["torch_rng_ranks"]) == 2
    two = _losses(runs["two"])
    for name in ("resumed2", "resumed1"):
        assert "resume: continuing from" in runs["_output"][name]
        resumed = _losses(runs[name])
        assert sorted(resumed) == list(range(1, STEPS + 1))
        for s in range(CRASH_AT + 1, STEPS + 1):  # the steps run after the resume
            assert resumed[s] == pytest.approx(two[s], rel=RTOL), (name, s, resumed, two)
        _assert_same_weights(runs["two"] / "final", runs[name] / "final")
