"""Tracking: ``train.report_to: [tensorboard, wandb]``.

* With ``WANDB_MODE=offline`` the run directory holds the W&B run (``wandb/offline-run-*/run-<id>.wandb``)
  with the logged training and held-out scalars (their values), the resolved recipe and the target
  fingerprint in its config; ``speculators eval RUN`` logs its report as a ``wandb.Table`` into the SAME
  W&B run (the id recorded in ``tracking.json``) and as text into TensorBoard.
* A recipe asking for wandb where wandb cannot be imported gets one clear error naming
  ``train.report_to`` before anything runs (nothing is written).
* ``train.report_to: []``: only ``train_log.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speculators.cli import app

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-eagle3.yaml"
SHORT = ["train.steps=3", "train.eval_every=3", "train.checkpoint_every=3"]


def _train(target_dir, out, *overrides):
    return CliRunner().invoke(app, ["train", str(TINY), f"target.model={target_dir}", *SHORT, *overrides,
                                    "-o", str(out)])


def _wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.fixture()
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                 "WANDB_CACHE_DIR": tmp_path / "wandb-cache", "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def test_wandb_offline_run_holds_the_metrics_recipe_fingerprint_and_eval_table(
        tmp_path, isolated_cache, tiny_target_dir, offline_wandb):
    out = tmp_path / "run"
    r = _train(tiny_target_dir, out, "train.report_to=[tensorboard,wandb]")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    ids = json.loads((out / "tracking.json").read_text())
    run_id = ids["wandb"]["id"]
    files = _wandb_files(out)
    assert [f.name for f in files] == [f"run-{run_id}.wandb"]
    data = files[0].read_bytes()
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if "train/loss" in x]
    held = [x for x in rows if "held_out/loss" in x]
    assert [x["step"] for x in train_rows] == [1, 2, 3] and held
    for key in (b"train/loss", b"train/grad_norm", b"held_out/loss", b"held_out/sim_tau"):
        assert key in data, key
    for x in train_rows + held:  # the logged values themselves (history items hold their JSON text)
        for k in ("train/loss", "held_out/loss"):
            if k in x:
                assert json.dumps(x[k]).encode() in data, (k, x[k])
    fingerprint = json.loads((out / "data_identity.json").read_text())["target (weights, config, chat template)"]
    assert fingerprint.encode() in data  # the target fingerprint is in the run's config
    assert b"eagle3" in data and b"batch_tokens" in data  # and the resolved recipe
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    r = CliRunner().invoke(app, ["eval", str(out), "--temperature", "0", "--num-prompts", "2",
                                 "--max-new-tokens", "8", "--methods", "drafter"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert "report logged to the run's wandb, tensorboard" in " ".join(r.output.split())
    files = _wandb_files(out)
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # the same run, resumed
    eval_data = [f.read_bytes() for f in files if b"eval/report" in f.read_bytes()]
    assert len(eval_data) == 1 and b"table-file" in eval_data[0] and b"eval/drafter_tau" in eval_data[0]
    tables = list(out.glob("wandb/offline-run-*/files/media/table/eval/report_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    report = json.loads(next(out.glob("eval-*/report.json")).read_text())
    assert "tau" in table["columns"] and len(table["data"]) == len(report["rows"])
    tau = table["data"][0][table["columns"].index("tau")]
    assert tau == pytest.approx(report["rows"][0]["tau"])


def test_wandb_missing_is_one_clear_error_before_anything_runs(tmp_path, isolated_cache, tiny_target_dir,
                                                                monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError: as if not installed
    out = tmp_path / "run"
    r = _train(tiny_target_dir, out, "train.report_to=[tensorboard,wandb]")
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert text.count("error:") == 1 and "train.report_to" in text and "speculators[wandb]" in text
    assert "Traceback" not in r.output and "regeneration" not in text  # before the data step
    assert not out.exists() and not isolated_cache.exists()


def test_report_to_empty_writes_only_the_jsonl_log(tmp_path, isolated_cache, tiny_target_dir):
    out = tmp_path / "run"
    r = _train(tiny_target_dir, out, "train.report_to=[]")
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()][:3] == [1, 2, 3]
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()
    assert not (out / "tracking.json").exists()
