"""Kill + resume: a run killed right after its step-4 checkpoint leaves only complete checkpoints, and
``--resume`` finishes it with exactly the weights of an uninterrupted run (CPU fp32 is deterministic), with
AdamW and the forward-KL loss, and with Muon and another divergence (``train.optimizer: muon``, ``train.loss``).

The kill is simulated by the trainer's test hook ``SPECULATORS_TEST_CRASH_AT_STEP=4`` (``os._exit(3)``
right after the step-4 checkpoint is written). Training runs in subprocesses with one torch thread; the
data caches are warmed first so that every run starts from the same cache state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from speculators.cli import app

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
STEP_RE = re.compile(r"^step-\d+$")
CKPT_FILES = ("config.json", "model.safetensors", "trainer_state.pt")


@dataclass
class Proc:
    dir: Path
    returncode: int
    output: str


def _env(cache: Path, crash_at: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("SPECULATORS_TEST_CRASH_AT_STEP", None)
    env.update(SPECULATORS_CACHE=str(cache), SPECULATORS_NO_PROGRESS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="250")
    if crash_at is not None:
        env["SPECULATORS_TEST_CRASH_AT_STEP"] = str(crash_at)
    return env


def _start(out: Path, target_dir: Path, cache: Path, *extra: str, crash_at: int | None = None):
    cmd = [sys.executable, "-m", "speculators.cli", "train", str(TINY), f"target.model={target_dir}",
           "train.steps=6", "train.checkpoint_every=2", "-o", str(out), *extra]
    return subprocess.Popen(cmd, env=_env(cache, crash_at), cwd=out.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, out: Path) -> Proc:
    try:
        output, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        pytest.fail(f"training subprocess timed out:\n{output}")
    return Proc(out, p.returncode, output)


def _train_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, tiny_target_dir) -> Path:
    """Regenerations and features of the tiny recipe, computed once (in-process) for all runs."""
    cache = tmp_path_factory.mktemp("resume-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(cache))
    mp.setenv("SPECULATORS_NO_PROGRESS", "1")
    try:
        r = CliRunner().invoke(app, ["data", str(TINY), f"target.model={tiny_target_dir}"])
    finally:
        mp.undo()
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    return cache


VARIANTS = {"adamw": (), "muon+jsd": ("train.optimizer=muon", "train.loss=jsd")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> tuple[str, ...]:
    """The recipe overrides of the optimizer / loss under test."""
    return VARIANTS[request.param]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, warm_cache, variant):
    """A run killed after step 4 and an uninterrupted run of the same recipe (run in parallel)."""
    root = tmp_path_factory.mktemp("resume-runs")
    crashed, full = root / "crashed", root / "uninterrupted"
    pc = _start(crashed, tiny_target_dir, warm_cache, *variant, crash_at=4)
    pf = _start(full, tiny_target_dir, warm_cache, *variant)
    return _finish(pc, crashed), _finish(pf, full)


@pytest.fixture(scope="module")
def resumed(runs, tiny_target_dir, warm_cache, variant) -> Proc:
    """``--resume`` of a copy of the killed run (the killed run itself stays as it was for inspection)."""
    crashed, _ = runs
    assert crashed.returncode == 3, crashed.output
    out = crashed.dir.parent / "resumed"
    shutil.copytree(crashed.dir, out)
    return _finish(_start(out, tiny_target_dir, warm_cache, *variant, "--resume"), out)


# ----------------------------------------------------------------------------- the killed run


def test_killed_run_exits_with_the_hook_status(runs):
    crashed, full = runs
    assert crashed.returncode == 3, crashed.output
    assert "done" not in crashed.output
    assert full.returncode == 0, full.output


def test_killed_run_leaves_only_complete_checkpoints(runs):
    crashed, _ = runs
    d = crashed.dir
    ckpts = sorted((d / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"], [p.name for p in ckpts]
    for p in ckpts:
        assert p.is_dir() and STEP_RE.match(p.name)
        for f in CKPT_FILES:
            assert (p / f).is_file(), f"{p.name}/{f} missing"
    leftovers = [str(p.relative_to(d)) for p in d.rglob(".*")]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    assert not (d / "final").exists()
    state = torch.load(ckpts[-1] / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and state["total_steps"] == 6
    assert sorted(_train_losses(d)) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- resume


def test_resume_continues_from_step_4(resumed):
    assert resumed.returncode == 0, resumed.output
    assert re.search(r"resume: continuing from \S*step-000004 \(step 4/6\b", resumed.output), resumed.output
    assert "no checkpoint found" not in resumed.output
    d = resumed.dir
    assert (d / "final" / "model.safetensors").is_file()
    assert [p.name for p in sorted((d / "checkpoints").iterdir())] == ["step-000004", "step-000006"]
    assert not [p for p in d.rglob(".*")]
    # the resumed run did only the 2 remaining optimizer steps
    assert sorted(_train_losses(d)) == [1, 2, 3, 4, 5, 6]
    assert torch.load(d / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=False)["step"] == 6


def test_resumed_run_equals_uninterrupted_run(runs, resumed):
    _, full = runs
    assert full.returncode == 0 and resumed.returncode == 0, resumed.output
    # the same loss at every step (JSON floats round-trip exactly)...
    assert _train_losses(resumed.dir) == _train_losses(full.dir)
    # ...and bit-identical final weights
    a, b = _weights(resumed.dir / "final"), _weights(full.dir / "final")
    assert a.keys() == b.keys()
    diff = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, f"max abs differences: {diff}"


def test_resumed_optimizer_state_equals_uninterrupted(runs, resumed, variant):
    _, full = runs
    sa = torch.load(resumed.dir / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=False)
    sb = torch.load(full.dir / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=False)
    assert (sa["step"], sa["epoch"], sa["batch_idx"]) == (sb["step"], sb["epoch"], sb["batch_idx"])
    assert sa["scheduler"] == sb["scheduler"]
    # AdamW's state dict, or Muon + AdamW's (speculators.train.optimizers.MuonAdamW: one state per part)
    parts_a = sa["optimizer"].get("states", [sa["optimizer"]])
    parts_b = sb["optimizer"].get("states", [sb["optimizer"]])
    assert len(parts_a) == len(parts_b) == len(sa["optimizer"].get("parts", ["AdamW"]))
    assert sa["optimizer"].get("parts") == (["Muon", "AdamW"] if "train.optimizer=muon" in variant else None)
    for pa, pb in zip(parts_a, parts_b):
        oa, ob = pa["state"], pb["state"]
        assert oa.keys() == ob.keys() and oa
        for i in oa:
            for k in oa[i]:
                assert torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])), (i, k)
    assert torch.equal(sa["torch_rng"], sb["torch_rng"])
