"""scripts/gpu_check.sh runs in CI in its dry mode (CPU, tiny sizes, no CUDA), so the prepared GPU run cannot rot:
every step it would run on a lent GPU runs here in small, and a failing step fails the script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(tmp_path, *args, python=sys.executable):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": python, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    r = run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    assert "dry run" in (out / "gpu.txt").read_text()
    assert " collected" in (out / "verifier-tests.log").read_text()  # the GPU run's verifier tests still collect
    assert " passed" in (out / "batched-tests.log").read_text()  # the batched session tests ran
    for bench in ("bench-verifier", "bench-batched"):  # both benchmarks ran a config and printed a table
        log = (out / f"{bench}.log").read_text()
        assert "FAILED" not in log and "|" in log, log[-2000:]


def test_gpu_check_dry_run_fails_when_a_step_fails(tmp_path):
    r = run(tmp_path, "--dry-run", python="false")  # every python step fails
    assert r.returncode != 0


def test_gpu_check_rejects_unknown_arguments(tmp_path):
    r = run(tmp_path, "--dryrun")
    assert r.returncode == 2 and "--dry-run" in r.stderr
