"""docs/USAGE.md's recipe reference is generated from the pydantic schema (scripts/recipe_reference.py).

(a) the committed block is the script's output; (b) every key of every recipe section and family config,
found by walking the models here (independently of the script), has its row; (c) a field without a
description makes the generator raise (and the script exit 2); (d) ``--check`` on an edited copy exits 1.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "recipe_reference.py"
USAGE = ROOT / "docs" / "USAGE.md"
FIX = "run `python scripts/recipe_reference.py` and commit docs/USAGE.md"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("recipe_reference", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def block(gen) -> str:
    return gen.render_reference()


def test_committed_block_is_generated(gen, block):
    text = USAGE.read_text(encoding="utf-8")
    assert text.count(gen.BEGIN) == 1 and text.count(gen.END) == 1, f"docs/USAGE.md lost its markers; {FIX}"
    wanted = gen.replace_block(text, block)
    if wanted != text:
        diff = "\n".join(list(difflib.unified_diff(text.splitlines(), wanted.splitlines(), "committed",
                                                   "generated", n=0, lineterm=""))[:40])
        pytest.fail(f"docs/USAGE.md's recipe reference is stale: {FIX}\n{diff}")
    assert gen.render_reference() == block  # deterministic


def _models_in(ann) -> list[tuple[type[BaseModel], bool]]:
    """Models nested in an annotation, with whether they sit in a list (walked here, not by the script)."""
    out, todo = [], [(ann, False)]
    while todo:
        a, in_list = todo.pop()
        origin = typing.get_origin(a)
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append((a, in_list))
        elif origin is not None:
            todo += [(x, in_list or origin is list) for x in typing.get_args(a) if not isinstance(x, str)]
    return out


def _keys(model: type[BaseModel], prefix: str, stop: type) -> list[str]:
    keys = []
    for name, f in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        for sub, in_list in _models_in(f.annotation):
            if not issubclass(sub, stop):
                keys += _keys(sub, f"{key}[i]" if in_list else key, stop)
    return keys


def _row_keys(block: str) -> set[str]:
    return {line.split("|")[1].strip().strip("`") for line in block.splitlines() if line.startswith("| `")}


def test_every_field_has_a_row(block):
    from speculators.drafters import registry
    from speculators.drafters.base import DrafterConfig
    from speculators.recipe import Recipe

    rows = _row_keys(block)
    recipe_keys = _keys(Recipe, "", DrafterConfig)
    for section in ("target", "data", "data.sources[i]", "data.sources[i].synth", "data.regeneration",
                    "data.held_out", "train", "eval"):  # the walk reached every section
        assert any(k.startswith(section + ".") for k in recipe_keys), section
    missing = [k for k in recipe_keys if k not in rows]
    assert not missing, f"recipe keys without a row in the reference: {missing}"
    assert "train.parity_check" in rows

    assert registry.names(), "no drafter family registered"
    for name in registry.names():
        cfg = registry.get(name).config_class
        keys = [k for k in _keys(cfg, "drafter", DrafterConfig) if k != "drafter.algorithm"]
        missing = [k for k in keys if k not in rows]
        assert not missing, f"{name} ({cfg.__name__}) keys without a row: {missing}"
        assert f"\n### `{name}`\n" in block, f"{name} has no section"
        assert name in rows, f"{name} has no row in the family (algorithm) table"
    assert "drafter.joint_target.lora_r" in rows  # a section nested in a family config


def test_rows_are_well_formed(block):
    """Five cells per key row (a ``|`` inside a cell is escaped), none of key, type, default, meaning empty;
    three per row of the family table."""
    for line in block.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) in (3, 5), line
        if len(cells) == 5:
            key, typ, default, _allowed, meaning = cells
            assert key and typ and default and meaning, line


def test_field_without_description_is_refused(gen, monkeypatch, capsys):
    class Made(BaseModel):
        ok: int = Field(default=1, gt=0, description="described")
        undocumented: int = 2

    with pytest.raises(gen.MissingDescription, match=r"Made\.undocumented"):
        gen.model_rows(Made, "made")
    rows, _ = gen.model_rows(Made, "made", skip=("undocumented",))  # the control: the rest renders
    assert rows == ["| `made.ok` | int | 1 | > 0 | described |"]

    monkeypatch.setattr(gen, "render_reference", lambda: "\n\n".join(gen.section_markdown(Made, "made")))
    assert gen.main(["--check"]) == 2
    assert "Made.undocumented" in capsys.readouterr().err


def test_cells_escape_pipes(gen):
    class Lit(BaseModel):
        mode: typing.Literal["a", "b"] | None = Field(default=None, description="x | y")

    (row,), _ = gen.model_rows(Lit, "s")
    assert row == "| `s.mode` | a \\| b \\| null | null |  | x \\| y |"


def test_check_fails_on_an_edited_copy(gen, tmp_path):
    text = USAGE.read_text(encoding="utf-8")
    start, end = text.index(gen.BEGIN), text.index(gen.END)
    row = "| `train.lr` |"
    assert start < text.index(row) < end
    edited = text.replace(row, "| `train.learning_rate` |", 1)
    copy = tmp_path / "USAGE.md"
    copy.write_text(edited, encoding="utf-8")
    r = subprocess.run([sys.executable, str(SCRIPT), "--check", "--file", str(copy)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "python scripts/recipe_reference.py" in r.stderr and "train.learning_rate" in r.stderr
    assert copy.read_text(encoding="utf-8") == edited  # --check writes nothing
