"""`speculators push`: what leaves the machine, the Hub card, and errors; the Hub itself is faked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import huggingface_hub
import json

import pytest
import torch
from typer.testing import CliRunner

from speculators.cli import app
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.errors import SpeculatorsError
from speculators.hub import checkpoint_files, hub_card, push_checkpoint
from speculators.target import build_tiny_target

runner = CliRunner()
V = 96


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory: final/ (checkpoint + run card), a step checkpoint with trainer state, an eval report."""
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    torch.manual_seed(0)
    cls = registry.get("eagle3")
    drafter = cls.from_target(cls.config_class(algorithm="eagle3", ttt_steps=2), target,
                              DraftVocab.from_counts(torch.arange(V, 0, -1), None))
    run = tmp_path_factory.mktemp("run")
    drafter.save_pretrained(run / "final", recipe_yaml="target:\n  model: tiny\n",
                            extra_files={"README.md": "# eagle3 drafter for tiny\n\nTrained for 3 steps.\n"})
    drafter.save_pretrained(run / "checkpoints" / "step-000003",
                            extra=lambda tmp: (tmp / "trainer_state.pt").write_bytes(b"optimizer"))
    (run / "final" / "notes.txt").write_text("scratch file a push must not upload")
    (run / "eval-k4-t0").mkdir()
    (run / "eval-k4-t0" / "report.md").write_text("# speculators eval: final\n\n| method | tau |\n|---|---|\n"
                                                  "| drafter | 1.234 |\n")
    return run


def _digest(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class FakeApi:
    """An in-memory Hub: repos with visibility, branches and files; records every call."""

    calls: list = []
    repos: dict = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}}

    def __init__(self, token=None):
        FakeApi.calls.append(("init", token))

    def create_repo(self, repo_id, *, private=False, exist_ok=False, repo_type=None):
        FakeApi.calls.append(("create_repo", repo_id, {"private": private, "exist_ok": exist_ok}))
        FakeApi.repos.setdefault(repo_id, {"private": private, "branches": {"main": {".gitattributes": b"*"}}})

    def repo_info(self, repo_id, repo_type=None):
        class Info:
            private = FakeApi.repos[repo_id]["private"]
        return Info()

    def create_branch(self, repo_id, *, branch, exist_ok=False, repo_type=None):
        FakeApi.calls.append(("create_branch", repo_id, branch))
        branches = FakeApi.repos[repo_id]["branches"]
        branches.setdefault(branch, dict(branches["main"]))

    def list_repo_files(self, repo_id, *, revision=None, repo_type=None):
        return sorted(FakeApi.repos[repo_id]["branches"][revision or "main"])

    def create_commit(self, repo_id, operations, *, commit_message, repo_type=None, revision=None):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files = FakeApi.repos[repo_id]["branches"][revision or "main"]
        for op in operations:
            if isinstance(op, CommitOperationAdd):
                src = op.path_or_fileobj
                files[op.path_in_repo] = src if isinstance(src, bytes) else Path(src).read_bytes()
            else:
                assert isinstance(op, CommitOperationDelete)
                del files[op.path_in_repo]
        FakeApi.calls.append(("create_commit", repo_id, revision, commit_message))

        class Info:
            commit_url = f"https://huggingface.co/{repo_id}/commit/abc123"
        return Info()


@pytest.fixture()
def fake_hub(monkeypatch):
    FakeApi.calls, FakeApi.repos = [], {}
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return FakeApi


def test_only_serving_files_are_uploaded(run_dir):
    assert checkpoint_files(run_dir / "final") == ["config.json", "model.safetensors", "recipe.yaml"]
    # a step checkpoint's trainer state stays on the machine
    assert checkpoint_files(run_dir / "checkpoints" / "step-000003") == ["config.json", "model.safetensors"]
    with pytest.raises(SpeculatorsError, match="is not a drafter checkpoint: config.json is missing"):
        checkpoint_files(run_dir / "eval-k4-t0")


def test_card_header_serving_command_run_card_and_reports(run_dir):
    card = hub_card(run_dir / "final", "me/tiny-eagle3")
    header = card.split("---")[1]
    assert "library_name: speculators" in header and "- eagle3" in header
    assert "base_model" not in header  # the tiny target is no Hub id
    assert ('--speculative-config \'{"model": "me/tiny-eagle3", "num_speculative_tokens": 4, '
            '"method": "eagle3"}\'') in card
    assert "### eagle3 drafter for tiny" in card  # the run card, nested under the card's sections
    assert "## Acceptance: `eval-k4-t0`" in card and "| drafter | 1.234 |" in card


def test_card_carries_the_static_tree_an_eval_found_best(run_dir):
    """An eval run with --tree leaves its best static tree in report.json: the card gives the serving command
    with that speculative_token_tree (node count as num_speculative_tokens); without one, no tree line."""
    assert "speculative_token_tree" not in hub_card(run_dir / "final", "me/tiny-eagle3")
    rep_dir = run_dir / "eval-k4-t0-trees"
    rep_dir.mkdir()
    best = {"speculative_token_tree": "[(0,), (1,), (0, 0)]", "num_nodes": 3, "expected_tokens_per_step": 1.9,
            "level_uniform": False}
    (rep_dir / "report.json").write_text(json.dumps({"trees": {"best_static_tree": best}}))
    card = hub_card(run_dir / "final", "me/tiny-eagle3")
    assert ('"num_speculative_tokens": 3, "method": "eagle3", "speculative_token_tree": "[(0,), (1,), (0, 0)]"'
            in card)
    assert "`eval-k4-t0-trees` measured best" in card and "different numbers of children" in card
    # an eval of another checkpoint (a step checkpoint of the run) does not speak for this one
    (rep_dir / "report.json").write_text(json.dumps({"checkpoint": str(run_dir / "checkpoints" / "step-000003"),
                                                     "trees": {"best_static_tree": best}}))
    assert "speculative_token_tree" not in hub_card(run_dir / "final", "me/tiny-eagle3")


def test_card_carries_the_llamacpp_setting_the_engine_eval_found(run_dir):
    """An EAGLE-3 card says how llama.cpp serves it; after `speculators eval --engine llama.cpp` it gives the
    fastest setting measured there and whether it beat plain decoding and the model-free types."""
    import shutil

    card = hub_card(run_dir / "final", "me/tiny-eagle3")
    assert "--spec-type draft-eagle3" in card and "Measured in llama-server" not in card
    rep_dir = run_dir / "eval-llamacpp"
    rep_dir.mkdir()
    try:
        best = {"row": "drafter k=2 t=0", "tokens_per_s": 50.0, "plain_tokens_per_s": 90.0, "beats_plain": False,
                "beats_ngram": False, "ngram_best": "ngram-simple t=0", "serve": "llama-server -m t.gguf -md d.gguf"}
        (rep_dir / "report.json").write_text(json.dumps({"best": best}))
        card = hub_card(run_dir / "final", "me/tiny-eagle3")
        assert "`drafter k=2 t=0`, ran 50.0 tokens/s against 90.0 plain: NOT faster than plain decoding" in card
        assert "llama-server -m t.gguf -md d.gguf" in card
        best.update(tokens_per_s=120.0, beats_plain=True, beats_ngram=True)
        (rep_dir / "report.json").write_text(json.dumps({"best": best}))
        assert "faster than plain decoding and than llama.cpp's best model-free type" in hub_card(run_dir / "final",
                                                                                                 "me/tiny-eagle3")
    finally:
        shutil.rmtree(rep_dir)


def test_push_uploads_files_and_card_in_one_commit(run_dir, fake_hub):
    before = _digest(run_dir)
    res = push_checkpoint(run_dir / "final", "me/tiny-eagle3", private=True, token="hf_x", log=lambda m: None)
    assert res["url"] == "https://huggingface.co/me/tiny-eagle3/commit/abc123"
    assert [c[0] for c in fake_hub.calls] == ["init", "create_repo", "create_commit"]
    assert fake_hub.calls[0][1] == "hf_x"
    assert fake_hub.calls[1][2] == {"private": True, "exist_ok": True}
    assert fake_hub.calls[2][3] == "Upload eagle3 drafter (speculators)"
    files = fake_hub.repos["me/tiny-eagle3"]["branches"]["main"]
    assert sorted(files) == [".gitattributes", "README.md", "config.json", "model.safetensors", "recipe.yaml"]
    assert res["files"] == sorted(set(files) - {".gitattributes"})
    final = run_dir / "final"
    for name in ("config.json", "model.safetensors", "recipe.yaml"):
        assert files[name] == (final / name).read_bytes()
    assert files["README.md"].decode() == hub_card(final, "me/tiny-eagle3")
    assert _digest(run_dir) == before  # the checkpoint is untouched


def test_repush_replaces_stale_files_and_branches_are_created(run_dir, fake_hub, tmp_path):
    import shutil

    joint = tmp_path / "joint"
    shutil.copytree(run_dir / "final", joint)
    (joint / "target_adapter").mkdir()
    (joint / "target_adapter" / "adapter_config.json").write_text("{}")
    push_checkpoint(joint, "me/d", log=lambda m: None)
    assert "target_adapter/adapter_config.json" in fake_hub.repos["me/d"]["branches"]["main"]
    res = push_checkpoint(run_dir / "final", "me/d", log=lambda m: None)  # the adapter is gone now
    assert res["deleted"] == ["target_adapter/adapter_config.json"]
    assert sorted(fake_hub.repos["me/d"]["branches"]["main"]) == [".gitattributes"] + res["files"]
    res = push_checkpoint(run_dir / "final", "me/d", revision="k8", commit_message="K=8", log=lambda m: None)
    assert ("create_branch", "me/d", "k8") in fake_hub.calls
    assert fake_hub.calls[-1] == ("create_commit", "me/d", "k8", "K=8")
    # an existing public repo is not silently kept public under --private
    with pytest.raises(SpeculatorsError, match="already exists and is public"):
        push_checkpoint(run_dir / "final", "me/d", private=True, log=lambda m: None)


def test_cli_push_dry_run_contacts_nothing(run_dir, fake_hub):
    res = runner.invoke(app, ["push", str(run_dir), "me/tiny-eagle3", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "final -> me/tiny-eagle3" in res.output and "dry run" in res.output
    assert "model.safetensors" in res.output and "notes.txt" not in res.output
    assert fake_hub.calls == []


def test_cli_push_errors_are_one_line(run_dir, monkeypatch):
    class Offline(FakeApi):
        def create_repo(self, repo_id, **kw):
            raise OSError("Cannot reach https://huggingface.co: offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    res = runner.invoke(app, ["push", str(run_dir), "me/tiny-eagle3"])
    assert res.exit_code == 2
    assert "error: push to me/tiny-eagle3 failed: OSError: Cannot reach" in res.output
    for bad in ("no-namespace", "me/bad name"):
        res = runner.invoke(app, ["push", str(run_dir), bad, "--dry-run"])
        assert res.exit_code == 2 and "error: repo id" in res.output, res.output


def test_joint_checkpoint_ships_its_target_adapter(run_dir, tmp_path):
    import json
    import shutil

    ckpt = tmp_path / "joint"
    shutil.copytree(run_dir / "final", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["speculators_training"]["target_adapter"] = "target_adapter"  # as save_pretrained writes it
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "target_adapter" / "sub").mkdir(parents=True)
    (ckpt / "target_adapter" / "adapter_config.json").write_text("{}")
    (ckpt / "target_adapter" / "sub" / "adapter_model.safetensors").write_bytes(b"w")
    assert checkpoint_files(ckpt) == ["config.json", "model.safetensors", "recipe.yaml",
                                      "target_adapter/adapter_config.json",
                                      "target_adapter/sub/adapter_model.safetensors"]
    assert "merge it into the base model" in hub_card(ckpt, "me/joint")
    assert "merge it into the base model" not in hub_card(run_dir / "final", "me/plain")


def test_eval_accepts_a_pushed_drafters_hub_id(run_dir, monkeypatch, tmp_path):
    from speculators import cli

    asked = []

    def fake_file(repo_id, filename, **kw):
        asked.append(("file", repo_id, filename))
        return str(run_dir / "final" / filename)

    def fake_snapshot(repo_id, **kw):
        asked.append(("snapshot", repo_id, sorted(kw["allow_patterns"])))
        return str(run_dir / "final")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.chdir(tmp_path)  # no local "me/tiny-eagle3"
    assert cli._resolve_checkpoint(Path("me/tiny-eagle3")) == run_dir / "final"
    assert asked == [("file", "me/tiny-eagle3", "config.json"),  # checked before any weights are fetched
                     ("snapshot", "me/tiny-eagle3",
                      ["README.md", "config.json", "model.safetensors", "recipe.yaml", "target_adapter/*"])]
    assert cli._resolve_checkpoint(run_dir) == run_dir / "final" and len(asked) == 2  # local paths stay local
    with pytest.raises(SpeculatorsError, match="neither a drafter checkpoint"):
        cli._resolve_checkpoint(Path("me/tiny-eagle3"), allow_hub=False)  # push never downloads
    (tmp_path / "outputs").mkdir()
    with pytest.raises(SpeculatorsError, match="neither a drafter checkpoint"):
        cli._resolve_checkpoint(Path("outputs/rnu"))  # a typo under an existing local folder stays local

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SpeculatorsError, match="me/llama on the Hub: .*not written by speculators"):
        cli._resolve_checkpoint(Path("me/llama"))
    assert len(asked) == 2  # no snapshot of a repo that is not a drafter

    def offline(repo_id, filename, **kw):
        raise OSError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    res = runner.invoke(app, ["eval", "me/other"])
    assert res.exit_code == 2 and "error: download of me/other failed: OSError: offline mode" in res.output


@pytest.mark.parametrize("algo", ["eagle3", "eagle", "medusa", "medusa-speculators-export", "mtp", "peagle"])
def test_card_serving_line_per_family(algo, run_dir, tmp_path):
    """The card's `vllm serve` line per family, exactly as vLLM takes it: P-EAGLE's carries `parallel_drafting`
    (with an explicit `method: eagle3` vLLM would otherwise draft its depths as a chain)."""
    import json
    import shutil

    ckpt = tmp_path / algo
    shutil.copytree(run_dir / "final", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["speculators_training"]["drafter"]["algorithm"] = algo.split("-")[0]
    cfg["speculators_training"]["target"]["name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    if algo == "medusa":  # export: vllm-medusa, vLLM's own config: no speculators block, K = num_heads
        del cfg["speculators_config"]
        cfg["model_type"], cfg["num_heads"] = "medusa", 3
    else:
        cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 3
        del cfg["speculators_config"]["verifier"]  # the verifier then comes from the training block
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "eval-trees").mkdir()  # a tree eval beside it: only a format vLLM drafts trees for gets the line
    (tmp_path / "eval-trees" / "report.json").write_text(json.dumps({"trees": {"best_static_tree": {
        "speculative_token_tree": "[(0,), (1,)]", "num_nodes": 2, "expected_tokens_per_step": 1.5}}}))
    card = hub_card(ckpt, "me/x")
    assert ("speculative_token_tree" in card) == (algo == "eagle3")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card.split("---")[1]
    if algo in ("eagle3", "medusa"):
        assert ("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config "
                f'\'{{"model": "me/x", "num_speculative_tokens": 3, "method": "{algo}"}}\'') in card
    elif algo == "peagle":
        assert ("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config "
                '\'{"model": "me/x", "num_speculative_tokens": 3, "method": "eagle3", "parallel_drafting": true}\'') in card
    else:
        assert "vllm serve" not in card and "Not loadable by vLLM as written" in card


@pytest.mark.parametrize("target_block", ["llama", ["x"], {"name_or_path": "me/base"}])
def test_card_of_a_foreign_training_block(target_block, run_dir, tmp_path):
    """A config from a newer or foreign writer (target facts that do not validate as TargetMeta, no
    verifier in the speculators block) still gets a card: the verifier is then unknown ("?")."""
    import json
    import shutil

    ckpt = tmp_path / "foreign"
    shutil.copytree(run_dir / "final", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["speculators_training"]["target"] = target_block
    del cfg["speculators_config"]["verifier"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    card = hub_card(ckpt, "me/x")
    assert "(`eagle3`) for `?`" in card and "vllm serve ? --speculative-config" in card
    # with a verifier in the speculators block, that one is named whatever the training block holds
    cfg["speculators_config"]["verifier"] = {"name_or_path": "me/base", "architectures": ["LlamaForCausalLM"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert "(`eagle3`) for `me/base`" in hub_card(ckpt, "me/x")


def test_checked_lines_say_when_no_vllm_loader_checked_the_layout(tmp_path):
    """A layout no vLLM loader is known for (a draft model, a new family) was not checked: the card must not say
    every tensor was placed."""
    import json

    from speculators.hub import checked_lines

    gate = {"vllm_version": "0.33.0", "layout_problems": [], "layout_checked": False,
            "parity": {"passed": None, "skipped": "no model", "reference_version": "0.9.0"}}
    (tmp_path / "parity.json").write_text(json.dumps(gate))
    lines = checked_lines(tmp_path)
    assert lines[0] == "- vLLM 0.33.0 weight layout: not checked (no vLLM loader is known for it)."
    gate["layout_checked"] = True
    (tmp_path / "parity.json").write_text(json.dumps(gate))
    assert "every tensor is one its loader places" in checked_lines(tmp_path)[0]
