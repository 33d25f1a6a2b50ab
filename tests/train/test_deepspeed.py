"""DeepSpeed ZeRO-2 and ZeRO-3 across CPU processes (``DS_ACCELERATOR=cpu``, gloo), when deepspeed is installed.

``recipes/accelerate/deepspeed_zero{2,3}.yaml`` launched on a machine without CUDA: the trainer starts
accelerate's DeepSpeed integration on DeepSpeed's CPU accelerator (``speculators.train.fsdp.deepspeed_on_cpu_requested``).
Checked, 20 steps, global batch of 2 micro-batches (1 process x ``grad_accum 2`` against 2 processes x
``grad_accum 1``): each stage logs the 1-process run's loss at every step (1e-4 relative) and writes the
same ``final/`` (full weights: ZeRO-3 gathers them); a 2-process run killed after its step-10 checkpoint and
``--resume``d (DeepSpeed's own checkpoint in ``engine_state/``, same number of processes) reproduces the
uninterrupted run.

deepspeed is an optional extra (``pip install 'speculators[deepspeed]'``; on a CPU-only machine see
docs/DISTRIBUTED.md for an install that keeps the installed torch): without it this module is skipped,
and the launcher config's error is checked instead (:func:`test_deepspeed_config_without_deepspeed_is_a_clear_error`).
"""

from __future__ import annotations

import importlib.util

import pytest

from test_fsdp import (CRASH_AT, EAGLE3, ROOT, STEPS, _assert_losses_match, _assert_same_checkpoint, _finish,
                       _start)

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CONFIGS = {z: ROOT / "recipes" / "accelerate" / f"deepspeed_zero{z}.yaml" for z in (2, 3)}


def test_deepspeed_config_without_deepspeed_is_a_clear_error(monkeypatch):
    from speculators.errors import SpeculatorsError
    from speculators.train.fsdp import deepspeed_on_cpu_requested

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch exports for these configs
    monkeypatch.setenv("LOCAL_RANK", "0")
    if HAVE_DEEPSPEED:
        assert deepspeed_on_cpu_requested()
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else
                            importlib.machinery.PathFinder.find_spec(name))
    with pytest.raises(SpeculatorsError, match=r"deepspeed package is not installed: pip install "
                                                r"'speculators\[deepspeed\]'"):
        deepspeed_on_cpu_requested()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert not deepspeed_on_cpu_requested()


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory, tiny_target_dir):
    """one: 1 process; z2 / z3: 2 processes under ZeRO-2 / ZeRO-3; z2c / z3c: killed after step 10, then
    resumed with 2 processes. Two launches at a time."""
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install 'speculators[deepspeed]')")
    root = tmp_path_factory.mktemp("ds-runs")
    cache = tmp_path_factory.mktemp("ds-cache")
    from typer.testing import CliRunner

    from speculators.cli import app

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULATORS_CACHE", str(cache))
    try:
        r = CliRunner().invoke(app, ["data", str(EAGLE3), f"target.model={tiny_target_dir}"])
    finally:
        mp.undo()
    assert r.exit_code == 0, r.output
    d = {n: root / n for n in ("one", "z2", "z3", "z2c", "z3c")}
    t, outputs = tiny_target_dir, {}

    def phase(**procs):
        for name, p in procs.items():
            rc, out = _finish(p)
            crashed = name.endswith("c") and not outputs.get(name)
            assert (rc != 0 and "done:" not in out) if crashed else rc == 0, f"{name}:\n{out[-5000:]}"
            outputs[name] = outputs.get(name, "") + out

    phase(z2c=_start(d["z2c"], EAGLE3, t, cache, 2, crash_at=CRASH_AT, config=CONFIGS[2]),
          one=_start(d["one"], EAGLE3, t, cache, 1))
    phase(z3c=_start(d["z3c"], EAGLE3, t, cache, 2, crash_at=CRASH_AT, config=CONFIGS[3]),
          z2=_start(d["z2"], EAGLE3, t, cache, 2, config=CONFIGS[2]))
    phase(z3=_start(d["z3"], EAGLE3, t, cache, 2, config=CONFIGS[3]),
          z2c=_start(d["z2c"], EAGLE3, t, cache, 2, "--resume", config=CONFIGS[2]))
    phase(z3c=_start(d["z3c"], EAGLE3, t, cache, 2, "--resume", config=CONFIGS[3]))
    return {**d, "_output": outputs}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_processes_equal_one_process(ds_runs, stage):
    run = ds_runs[f"z{stage}"]
    assert "x 2 processes (DEEPSPEED)" in ds_runs["_output"][f"z{stage}"]
    _assert_losses_match(run, ds_runs["one"])
    _assert_same_checkpoint(run / "final", ds_runs["one"] / "final")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_killed_deepspeed_run_resumes(ds_runs, stage):
    run = ds_runs[f"z{stage}c"]
    assert "resume: continuing from" in ds_runs["_output"][f"z{stage}c"]
    assert (run / "checkpoints" / f"step-{STEPS:06d}" / "engine_state").is_dir()
    _assert_losses_match(run, ds_runs[f"z{stage}"], steps=range(CRASH_AT + 1, STEPS + 1))
    _assert_same_checkpoint(run / "final", ds_runs[f"z{stage}"] / "final")
