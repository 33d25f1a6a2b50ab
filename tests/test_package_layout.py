"""The package's shape, read from the source: few flat modules, none over 700 lines, no pass-through imports.

* At most 15 modules lie flat in ``speculators/``; every other module belongs to a package named for its concern
  (``decode/``, ``evaluation/``, ``train/``, ``drafters/``, ...), and no module passes 700 lines.
* No compatibility re-export: wherever the repository (package, tests, scripts) imports a NAME from a module of
  the package, that module defines it (a ``def``, ``class`` or assignment at module level) or it is a submodule.
  A package's ``__init__`` may curate its public API (it is exempt), a plain module may not pass a name on.
* The module paths retired when the flat modules became packages do not import any more.
"""

from __future__ import annotations

import ast
import re
import importlib.util
from pathlib import Path

import pytest
from test_layering import MODULES, ROOT, imports_of, module_name

PKG = ROOT / "speculators"
MAX_FLAT = 15
MAX_LINES = 700

#: the flat modules that became package modules (the issue "decoding loop and evaluation as packages")
RETIRED = ("generate", "tree_steps", "tree_spec", "decode_args", "gating", "proposal", "proposers", "evaluate",
           "acceptance", "greedy_check", "tree_eval", "tree_report", "eval_costs", "cost_model", "forward_cost",
           "eval_report", "eval_report_costs", "eval_plots", "training_unit", "fsdp", "tracking", "run_dir")


def test_at_most_15_flat_modules():
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert 0 < len(flat) <= MAX_FLAT, f"{len(flat)} modules flat in speculators/ (at most {MAX_FLAT}): {flat}"


def test_no_module_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("old", RETIRED)
def test_retired_module_paths_do_not_import(old):
    assert importlib.util.find_spec(f"speculators.{old}") is None, f"speculators.{old} still imports"


def defined_names(path: Path) -> set[str]:
    """Names a module binds at module level by ``def`` / ``class`` / assignment (under ``if`` / ``try`` too),
    not by import."""
    out: set[str] = set()

    def targets(t: ast.AST) -> None:
        if isinstance(t, ast.Name):
            out.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return out


def pass_through_imports(files: list[Path], modules: dict[str, Path] = MODULES, root: Path = ROOT) -> list[str]:
    """``"file:line: from M import N"`` for every name imported from a plain (non-package) module ``M`` of the
    package (``modules``: name -> path, under ``root``) that ``M`` does not define itself."""
    plain = {m: p for m, p in modules.items() if p.name != "__init__.py"}
    defined: dict[str, set[str]] = {}
    bad = []
    for f in files:
        for imp in imports_of(f, modules, root=root):
            if imp.module not in plain or not imp.names:
                continue
            names = defined.setdefault(imp.module, defined_names(plain[imp.module]))
            for n in imp.names:
                if n != "*" and n not in names:
                    bad.append(f"{f.relative_to(root)}:{imp.line}: from {imp.module} import {n}")
    return bad


def test_the_pass_through_check_can_fail(tmp_path):
    pkg = tmp_path / "speculators"
    pkg.mkdir()
    (pkg / "home.py").write_text("def f():\n    return 1\nX: int = 2\nif True:\n    Y = 3\n")
    (pkg / "shim.py").write_text("from .home import f  # re-exported\nZ = f()\n")
    (pkg / "user.py").write_text("from .shim import f, Z\nfrom .home import X, Y\n")
    mods = {module_name(p, tmp_path): p for p in pkg.glob("*.py")}
    assert pass_through_imports([pkg / "user.py"], mods, tmp_path) == ["speculators/user.py:1: from speculators.shim import f"]


def test_nothing_imports_a_name_from_a_module_that_only_passes_it_on():
    files = sorted(p for d in ("speculators", "tests", "scripts") for p in (ROOT / d).rglob("*.py")
                   if "__pycache__" not in p.parts)
    assert len(files) > 100
    bad = pass_through_imports(files)
    assert not bad, ("names imported from a module that only re-exports them; import them from the module that "
                     "defines them:\n" + "\n".join(bad))


#: dotted names of the reference implementation (vllm-project/speculators, its own venv), which our docstrings
#: cite and which this package does not have
REFERENCE_NAMES = ("speculators.models", "speculators.model", "speculators.config", "speculators.version",
                   "speculators.utils.loading")
_DOTTED = re.compile(r"(?<![\w/.-])speculators(?:\.[A-Za-z_]\w*)+")


def resolves(ref: str) -> bool:
    """Whether ``speculators.a.b.c`` names a module of the package or an attribute of one; a class or function
    named through a plain module must be that module's own (not a name it imports: the doc would point a reader
    to the wrong file), while a package may name what its ``__init__`` curates."""
    import inspect

    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for n, a in enumerate(parts[i:]):
            if not hasattr(obj, a):
                return False
            obj = getattr(obj, a)
            if n == 0 and (inspect.isclass(obj) or inspect.isfunction(obj)) and not hasattr(module, "__path__") \
                    and obj.__module__ != module.__name__ and obj.__module__.startswith("speculators."):
                return False
        return True
    return False


def unresolved_references(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """``{dotted name: [files]}`` for every ``speculators.x.y`` a file names that does not exist."""
    bad: dict[str, set[str]] = {}
    for f in files:
        for m in _DOTTED.finditer(f.read_text()):
            ref = m.group(0)
            if ref.startswith(REFERENCE_NAMES) or resolves(ref):
                continue
            bad.setdefault(ref, set()).add(str(f.relative_to(root)))
    return {k: sorted(v) for k, v in bad.items()}


def test_the_reference_check_can_fail(tmp_path):
    f = tmp_path / "doc.md"
    f.write_text("see `speculators.decode.loop.speculative_generate` and :func:`speculators.decode.loop.nothing`, "
                 "the class `speculators.decode.loop.GenerationResult` (defined in decode/state.py, only imported by "
                 "the loop), the package's `speculators.verify.SamplingParams`, and the reference's "
                 "speculators.models.eagle3")
    assert unresolved_references([f], tmp_path) == {"speculators.decode.loop.nothing": ["doc.md"],
                                                    "speculators.decode.loop.GenerationResult": ["doc.md"]}


def test_docs_and_docstrings_name_only_what_exists():
    """Every dotted ``speculators.…`` name in the package's docstrings, the scripts and the docs resolves to a
    module or an attribute of one: a moved function cannot leave its old path behind in the docs."""
    files = (sorted((ROOT / "speculators").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
             + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])
    bad = unresolved_references(files)
    assert not bad, "names that do not exist (moved or renamed?):\n" + "\n".join(f"{k}: {v}" for k, v in bad.items())
