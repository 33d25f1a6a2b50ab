"""utils: atomic writers leave the modes a plain mkdir/open would give under the user's umask (not
mkdtemp/mkstemp's private 0700/0600), so another user (a serving process, a teammate) can read a
trained drafter, an eval report or a cache; the umask is read without being changed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from speculators import utils
from speculators.utils import atomic_dir, atomic_write_text, current_umask


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["umask022", "umask077", "umask002"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def plain_modes(tmp_path: Path) -> tuple[int, int]:
    """(dir, file) modes a plain mkdir / open('w') gives right now."""
    (tmp_path / "plain-dir").mkdir()
    (tmp_path / "plain-file").write_text("x")
    return mode(tmp_path / "plain-dir"), mode(tmp_path / "plain-file")


def test_current_umask_reads_without_changing(umask):
    assert current_umask() == umask
    assert current_umask() == umask  # still the same: reading did not reset it


def test_current_umask_fallback_without_proc(umask, monkeypatch):
    def no_proc(*a, **k):
        raise OSError("no /proc here")
    monkeypatch.setattr(utils, "open", no_proc, raising=False)
    assert current_umask() == umask
    monkeypatch.undo()
    assert current_umask() == umask  # the fallback restored the umask


def test_atomic_dir_gets_plain_mkdir_mode(umask, tmp_path):
    dir_mode, file_mode = plain_modes(tmp_path)
    assert dir_mode == 0o777 & ~umask
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
    assert mode(tmp_path / "ckpt") == dir_mode
    assert mode(tmp_path / "ckpt" / "sub") == dir_mode
    assert mode(tmp_path / "ckpt" / "config.json") == file_mode
    # replacing an existing directory gives the same mode
    with atomic_dir(tmp_path / "ckpt", overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert mode(tmp_path / "ckpt") == dir_mode
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_atomic_write_text_new_file_gets_plain_open_mode(umask, tmp_path):
    _, file_mode = plain_modes(tmp_path)
    atomic_write_text(tmp_path / "a" / "recipe.yaml", "x: 1\n")
    assert (tmp_path / "a" / "recipe.yaml").read_text() == "x: 1\n"
    assert mode(tmp_path / "a" / "recipe.yaml") == file_mode == 0o666 & ~umask


def test_atomic_write_text_keeps_an_existing_files_mode(tmp_path):
    p = tmp_path / "index.json"
    p.write_text("{}")
    os.chmod(p, 0o640)
    atomic_write_text(p, "[]")
    assert p.read_text() == "[]" and mode(p) == 0o640


def test_atomic_write_text_error_leaves_no_temp_and_old_content(tmp_path):
    p = tmp_path / "index.json"
    p.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_text(p, 123)  # not a str: the write fails
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["index.json"]


def test_checkpoint_and_report_are_readable_by_others(umask, tmp_path, monkeypatch):
    """The real writers that go through atomic_dir: Drafter.save_pretrained (safetensors >= 0.8 writes
    its file 0o600 through a temp file) and evaluate.write_report."""
    from speculators.evaluation import runner as evaluate
    from speculators.data.vocab import DraftVocab
    from speculators.drafters import registry
    from speculators.target import build_tiny_target

    monkeypatch.setattr(evaluate, "render_markdown", lambda report, title: "# report\n")

    dir_mode, file_mode = plain_modes(tmp_path)
    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=3, seed=0)  # EAGLE-3: three distinct taps
    fam = registry.get("eagle3")
    d = fam.from_target(fam.config_class(algorithm="eagle3"), target, DraftVocab.full(64))
    ckpt = d.save_pretrained(tmp_path / "final", recipe_yaml="x: 1\n")
    assert mode(ckpt) == dir_mode
    for f in ckpt.iterdir():
        assert mode(f) == (dir_mode if f.is_dir() else file_mode), f
    rep = evaluate.write_report({"k": 1}, tmp_path / "report")
    assert mode(rep) == dir_mode and mode(rep / "report.json") == file_mode


def test_feature_shards_and_index_get_plain_modes(umask, tmp_path, monkeypatch):
    """features.py writes shards through a tmp name + rename and the index via atomic_write_text."""
    from speculators.data.features import TokenizedExample, extract_features
    from speculators.target import build_tiny_target

    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    dir_mode, file_mode = plain_modes(tmp_path)
    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=4, seed=0)
    g = torch.Generator().manual_seed(0)
    exs = [TokenizedExample(f"e{i}", torch.randint(0, 64, (10,), generator=g).tolist(), [0] * 4 + [1] * 6)
           for i in range(3)]
    extract_features(target, exs, batch_tokens=64, log=lambda *_: None)
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files) and any(p.name == "index.json" for p in files)
    for p in files:
        assert mode(p) == file_mode, p
    json.loads(next(p for p in files if p.name == "index.json").read_text())


def test_converted_target_cache_layout_is_readable(umask, tmp_path):
    """target/loading.py caches a converted GGUF with transformers' save_pretrained inside atomic_dir."""
    from speculators.target import build_tiny_target

    dir_mode, file_mode = plain_modes(tmp_path)
    t = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=0)
    with atomic_dir(tmp_path / "targets" / "x", overwrite=True) as tmp:
        t.model.save_pretrained(tmp)
    out = tmp_path / "targets" / "x"
    assert mode(out) == dir_mode and (out / "model.safetensors").is_file()
    for f in out.iterdir():
        assert mode(f) == file_mode, f


def test_restore_plain_modes_only_touches_private_temp_modes(tmp_path):
    old = os.umask(0o022)
    try:
        d = tmp_path / "d"
        (d / "sub").mkdir(parents=True)
        os.chmod(d / "sub", 0o700)
        for name, m in [("tmpfile", 0o600), ("chosen", 0o640), ("script", 0o750)]:
            (d / name).write_text("x")
            os.chmod(d / name, m)
        (d / "link").symlink_to(tmp_path / "outside")
        (tmp_path / "outside").write_text("x")
        os.chmod(tmp_path / "outside", 0o600)
        utils.restore_plain_modes(d)
        assert mode(d / "sub") == 0o755 and mode(d / "tmpfile") == 0o644
        assert mode(d / "chosen") == 0o640 and mode(d / "script") == 0o750  # set on purpose: kept
        assert mode(tmp_path / "outside") == 0o600  # symlinks are not followed
    finally:
        os.umask(old)


def test_atomic_dir_overwrite_keeps_the_replaced_directorys_mode(tmp_path):
    final = tmp_path / "final"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
    os.chmod(final, 0o750)
    with atomic_dir(final, overwrite=True) as tmp:
        (tmp / "a").write_text("2")
    assert (final / "a").read_text() == "2" and mode(final) == 0o750



def test_atomic_dir_overwrite_survives_a_concurrent_writer(tmp_path, monkeypatch):
    """Two processes filling one cache entry: when another writer puts ``final`` in place between our check and our
    rename (ENOTEMPTY), an overwriting writer moves it aside and renames its own in; a non-overwriting one fails
    and leaves no temporary directory."""
    import errno
    import os

    from speculators import utils

    final = tmp_path / "entry"
    real = os.replace
    raced = []

    def racing(src, dst):
        if Path(dst) == final and not raced:  # the other writer wins the first rename
            raced.append(1)
            final.mkdir()
            (final / "who").write_text("other")
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        return real(src, dst)

    monkeypatch.setattr(utils.os, "replace", racing)
    with utils.atomic_dir(final, overwrite=True) as tmp:
        (tmp / "who").write_text("us")
    assert (final / "who").read_text() == "us" and raced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    raced.clear()
    other = tmp_path / "second"
    final = other
    with pytest.raises(OSError):
        with utils.atomic_dir(other) as tmp:
            (tmp / "who").write_text("us")
    assert (other / "who").read_text() == "other"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "second"]


def test_atomic_dir_never_loses_the_previous_directory(tmp_path, monkeypatch):
    """When our rename into place fails for good, what stood at ``final`` is still there: put back after a failure
    that is not a race (EACCES), or another writer's complete directory after five lost races (FileExistsError);
    no temporary or moved-aside directory is left either way."""
    import errno
    import os

    from speculators import utils

    final = tmp_path / "entry"
    final.mkdir()
    (final / "who").write_text("previous")
    real = os.replace

    def denied(src, dst):
        if Path(dst) == final and ".tmp-" in Path(src).name:
            raise OSError(errno.EACCES, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(utils.os, "replace", denied)
    with pytest.raises(PermissionError):
        with utils.atomic_dir(final, overwrite=True) as tmp:
            (tmp / "who").write_text("us")
    assert (final / "who").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]

    def always_beaten(src, dst):
        if Path(dst) == final and ".tmp-" in Path(src).name:
            final.mkdir(exist_ok=True)
            (final / "who").write_text("other")
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        return real(src, dst)

    monkeypatch.setattr(utils.os, "replace", always_beaten)
    with pytest.raises(FileExistsError, match="another process"):
        with utils.atomic_dir(final, overwrite=True) as tmp:
            (tmp / "who").write_text("us")
    assert (final / "who").read_text() == "other"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
