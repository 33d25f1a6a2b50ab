"""The documentation site (mkdocs.yml, docs/) and the README as its front page.

Every page of mkdocs.yml's nav exists and every Markdown file under docs/ is in the nav; no hand-written page is
over ~10 KB (the generated references are named below); the README is under 12 KB, opens with its two commands
and every relative link in it resolves; the generated CLI reference is current; the plots the results page shows
exist. The strict build itself (never with -q: quiet mode does not count the warnings) (``mkdocs build --strict``: broken links and anchors, griffe references) runs in
``make test`` and ``make docs``, and here when mkdocs is installed (about 3 s).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_PAGE = 10_500  # "no page over ~10 KB"
#: generated references, allowed to be longer (each is rewritten by its generator, checked by a staleness test)
GENERATED = {"USAGE.md": "the recipe reference (scripts/recipe_reference.py)",
             "reference/cli.md": "every command's --help (scripts/cli_reference.py)"}
#: Markdown files under docs/ that are not nav pages, with the reason
NOT_IN_NAV: dict[str, str] = {}


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)  # material's !!python tags


def nav_pages() -> list[str]:
    conf = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    out: list[str] = []

    def walk(item):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for v in item.values():
                walk(v)
        elif isinstance(item, list):
            for v in item:
                walk(v)

    walk(conf["nav"])
    return [p for p in out if p.endswith(".md")]


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = nav_pages()
    assert len(nav) == len(set(nav)), "a page appears twice in mkdocs.yml's nav"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"nav pages that do not exist: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    orphans = sorted(pages - set(nav) - set(NOT_IN_NAV))
    assert not orphans, f"pages under docs/ missing from mkdocs.yml's nav (add them, or to NOT_IN_NAV with a reason): {orphans}"


def test_no_hand_written_page_over_10_kb():
    big = {p.relative_to(DOCS).as_posix(): p.stat().st_size for p in DOCS.rglob("*.md")}
    over = {p: n for p, n in big.items() if n > MAX_PAGE and p not in GENERATED}
    assert not over, f"pages over {MAX_PAGE} bytes (split them by task): {over}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.encode()) < 12_000, f"README.md is {len(text.encode())} bytes; the details belong on the site"
    block = re.search(r"\A# [^\n]*\n\n```bash\n(.*?)\n```", text, re.S)
    assert block, "README.md must open with its title and the two-command code block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["make demo", "make test"], commands


def test_every_relative_link_in_the_readme_resolves():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README.md links nowhere"
    bad = [t for t in links if not re.match(r"^[a-z]+:", t) and not t.startswith("#")
           and not (ROOT / t.split("#")[0]).exists()]
    assert not bad, f"README.md links to files that do not exist: {bad}"


def test_the_cli_reference_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_results_page_shows_its_plots():
    text = (DOCS / "results" / "index.md").read_text()
    for name in ("tau_per_family.png", "learning_curve.png", "engine_speedups.png"):
        assert f"(../img/{name})" in text, name
        assert (DOCS / "img" / name).is_file(), f"docs/img/{name} missing: run python scripts/results_plots.py"


def test_the_strict_build_passes(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists() and not shutil.which("mkdocs"):
        pytest.skip("mkdocs is not installed (make install installs it with the dev extra)")
    r = subprocess.run([str(mkdocs if mkdocs.exists() else "mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
