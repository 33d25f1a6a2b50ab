"""The package's layering, read from the source with ``ast`` (docs/ARCHITECTURE.md).

* Nothing below the CLI imports ``speculators.cli`` or ``speculators.workflows`` (any scope, type-only
  imports included): only ``cli.py`` imports the workflows.
* No import cycle among the package's modules at MODULE level (what runs at import time), and none
  either when function-level imports count too: a deferred import cannot make an import-time cycle,
  but a pair of modules that need each other is one concern split in two (e.g. the family registry
  lives in the leaf ``drafters/registry.py`` so that ``drafters/checkpoint.py`` can find a family
  without importing ``drafters/base.py``, which imports it). Imports under ``if TYPE_CHECKING:``
  never run: they are left out of the cycle checks and the layer order (the CLI/workflows rule still
  counts them).
* Every runtime import (module or function level) goes DOWN or sideways in the layer table of
  docs/ARCHITECTURE.md (section "Import rules", between the ``layering`` markers), and every module of
  the package is in that table: the doc and the code cannot drift apart.
* No drafter family name (``eagle``, ``eagle3``, ``medusa``, ``mtp``, ``peagle``, ``dflash``,
  ``dspark``) as an identifier or a string in ``speculators/`` outside ``speculators/drafters/``.
  Docstrings and comments may name families (they document); code may not branch on them.

Imports are resolved by name: ``from . import x`` depends on the submodule ``x`` only (it does not need
the package's ``__init__`` to have finished), ``from .pkg import name`` depends on ``pkg`` (its
``__init__``), or on ``pkg.name`` when that is a submodule. ``tests/test_workflows.py`` reuses the
reader below for the data layer's own rules; ``tests/verify/test_verify.py`` keeps the stricter rule of the
verifier package (no cycle inside ``verify/`` even through function-level imports).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "speculators"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

def _family_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The registered families' names (the registry, not a list kept here): names of 4 letters or more match
    as substrings (``eagle`` also catches ``peagle``, ``eagle3``, ``Eagle3Config``), shorter ones as whole
    words only (``mtp``; ``attempt`` is not a family)."""
    from speculators.drafters import registry

    names = sorted(registry.names())
    return tuple(n for n in names if len(n) >= 4), tuple(n for n in names if len(n) < 4)


#: none of these may appear outside drafters/ (read from the registry)
FAMILY_WORDS, FAMILY_TOKENS = _family_names()

# ----------------------------------------------------------------------------- the import reader


def module_name(path: Path, root: Path = ROOT) -> str:
    """``speculators/drafters/base.py`` -> ``speculators.drafters.base`` (a package's ``__init__`` -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(under: Path = PKG) -> list[Path]:
    """Every ``.py`` file of the package (or of a subfolder), sorted."""
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


MODULES = {module_name(p): p for p in sources()}


@dataclass(frozen=True)
class Import:
    """One imported module. ``module``: absolute dotted name (resolved by name, see the module docstring);
    ``names``: the names a ``from`` import takes; ``scope``: ``"module"`` (runs at import time),
    ``"function"`` (inside a def/lambda: deferred) or ``"type"`` (under ``if TYPE_CHECKING``: never runs);
    ``line``: where."""

    module: str
    names: tuple[str, ...]
    scope: str
    line: int


def imports_of(path: Path, modules: Iterable[str] | None = None, root: Path = ROOT) -> list[Import]:
    """Every import statement of ``path`` (all scopes), relative imports made absolute.

    ``modules``: the known module names used to tell a submodule from a name (default: this package's);
    ``root``: the folder that holds the top-level package. ``from pkg import a, b`` yields ``pkg.a``
    when that is a module, else ``pkg`` (with the names).
    """
    known = set(MODULES if modules is None else modules)
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: list[Import] = []

    def record(node: ast.AST, scope: str) -> None:
        if isinstance(node, ast.Import):
            out.extend(Import(a.name, (), scope, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            plain = []
            for a in node.names:
                if f"{mod}.{a.name}" in known:  # from pkg import submodule
                    out.append(Import(f"{mod}.{a.name}", (), scope, node.lineno))
                else:
                    plain.append(a.name)
            if plain or not node.names:
                out.append(Import(mod, tuple(plain), scope, node.lineno))

    def walk(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    record(stmt, "type")
                    walk(stmt, "type")
                for stmt in child.orelse:
                    record(stmt, scope)
                    walk(stmt, scope)
                continue
            inner = "function" if scope == "module" and isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope
            record(child, inner)
            walk(child, inner)

    walk(tree, "module")
    return out


def package_imports(path: Path) -> list[Import]:
    """:func:`imports_of` restricted to modules of this package, each mapped to the module it loads
    (``speculators.verify.SamplingParams``-style dotted names fall back to their longest known prefix)."""
    out = []
    for imp in imports_of(path):
        mod = imp.module
        if mod != "speculators" and not mod.startswith("speculators."):
            continue
        while mod not in MODULES and "." in mod:
            mod = mod.rsplit(".", 1)[0]
        out.append(Import(mod, imp.names, imp.scope, imp.line))
    return out


def import_graph(scopes: set[str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports in ``scopes`` (self-imports dropped)."""
    return {m: {i.module for i in package_imports(p) if i.scope in scopes} - {m} for m, p in MODULES.items()}


def importers_of(module: str) -> list[str]:
    """Files that import ``module`` or anything below it, in any scope."""
    return sorted(str(p.relative_to(ROOT)) for p in sources()
                  if any(i.module == module or i.module.startswith(module + ".") for i in imports_of(p)))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it is a DAG (iterative DFS, sorted order)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


# ----------------------------------------------------------------------------- the checker itself


def test_the_reader_resolves_relative_names_scopes_and_submodules(tmp_path):
    """The reader sees what the rules below rely on (or they could pass vacuously)."""
    cli = {i.module: i for i in imports_of(PKG / "cli.py")}
    assert "speculators.errors" in cli and cli["speculators.errors"].scope == "module"
    assert cli["speculators.workflows"].scope == "function"  # `from .workflows import train_run` in a command
    assert importers_of("speculators.errors"), "no importer of speculators.errors found"
    assert "speculators/drafters/base.py" in importers_of("speculators.data.vocab")
    # a synthetic module: submodule vs name, parent-relative, TYPE_CHECKING, nested function
    pkg = tmp_path / "speculators" / "sub"
    pkg.mkdir(parents=True)
    f = pkg / "mod.py"
    f.write_text("from typing import TYPE_CHECKING\nfrom . import sibling, NAME\nfrom ..errors import E\n"
                 "if TYPE_CHECKING:\n    from ..recipe import Recipe\n"
                 "def f():\n    def g():\n        import speculators.target\n    from .sibling import x\n")
    got = {(i.module, i.names, i.scope) for i in imports_of(f, {"speculators.sub.sibling"}, root=tmp_path)}
    assert got == {("typing", ("TYPE_CHECKING",), "module"), ("speculators.sub.sibling", (), "module"),
                   ("speculators.sub", ("NAME",), "module"), ("speculators.errors", ("E",), "module"),
                   ("speculators.recipe", ("Recipe",), "type"), ("speculators.target", (), "function"),
                   ("speculators.sub.sibling", ("x",), "function")}


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


# ----------------------------------------------------------------------------- the rules


def test_nothing_below_the_cli_imports_the_cli_or_the_workflows():
    assert (PKG / "workflows.py").is_file()
    assert importers_of("speculators.cli") == []
    assert importers_of("speculators.workflows") == ["speculators/cli.py"]


def test_no_import_cycle_at_module_level():
    graph = import_graph({"module"})
    assert sum(map(len, graph.values())) > 50, "the module-level import graph looks empty"
    cycle = find_cycle(graph)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_even_through_function_level_imports():
    """Module- and function-level imports together form a DAG among the package's modules."""
    graph = import_graph({"module", "function"})
    assert sum(map(len, graph.values())) > sum(map(len, import_graph({"module"}).values())), \
        "no function-level import found: the reader missed them"
    cycle = find_cycle(graph)
    assert cycle is None, (f"import cycle (module- and function-level imports): {' -> '.join(cycle)}; move what "
                           "the modules share to a leaf module both import")


def test_the_family_registry_is_a_leaf():
    """``drafters/registry.py`` imports nothing of the package at run time but the errors module, so every
    module (the checkpoint reader included) can look a family up without importing the drafter interface."""
    runtime = {i.module for i in package_imports(PKG / "drafters" / "registry.py") if i.scope != "type"}
    assert runtime == {"speculators.errors"}
    checkpoint = {i.module for i in package_imports(PKG / "drafters" / "checkpoint.py") if i.scope != "type"}
    assert "speculators.drafters.registry" in checkpoint and "speculators.drafters.base" not in checkpoint


def _layer_table() -> list[tuple[int, list[str]]]:
    """``[(level, [module patterns])]`` from docs/ARCHITECTURE.md, between ``<!-- layering:begin -->`` and
    ``<!-- layering:end -->``: markdown rows ``| level | `mod`, `pkg/*` | ... |``."""
    text = ARCHITECTURE.read_text()
    m = re.search(r"<!-- layering:begin -->(.*?)<!-- layering:end -->", text, re.S)
    assert m, f"{ARCHITECTURE}: no <!-- layering:begin --> ... <!-- layering:end --> table"
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    assert rows, f"{ARCHITECTURE}: the layering table has no rows"
    return rows


def _level_of(module: str, table: list[tuple[int, list[str]]]) -> list[int]:
    """Levels of the table rows whose patterns match ``module`` (``x`` -> ``speculators.x``; ``x/*`` ->
    the package ``speculators.x`` and everything in it; ``__init__`` -> ``speculators``)."""
    hits = []
    for level, patterns in table:
        for pat in patterns:
            if pat == "__init__":
                ok = module == "speculators"
            elif pat.endswith("/*"):
                pkg = "speculators." + pat[:-2].replace("/", ".")
                ok = module == pkg or module.startswith(pkg + ".")
            else:
                ok = module == "speculators." + pat.removesuffix(".py").replace("/", ".")
            if ok:
                hits.append(level)
    return hits


def test_every_module_has_one_level_in_the_architecture_doc():
    table = _layer_table()
    problems = [f"{m}: levels {lv}" for m in sorted(MODULES) if len(lv := _level_of(m, table)) != 1]
    assert not problems, (f"every module needs exactly one row in the layering table of {ARCHITECTURE} "
                          f"(add new modules there): {problems}")


def test_imports_go_down_the_layers():
    """Module- and function-level imports never go to a higher level (type-only imports never run)."""
    table = _layer_table()
    level = {m: _level_of(m, table)[0] for m in MODULES if len(_level_of(m, table)) == 1}
    bad = []
    for m, p in MODULES.items():
        for imp in package_imports(p):
            if imp.scope != "type" and imp.module in level and m in level and level[imp.module] > level[m]:
                bad.append(f"{p.relative_to(ROOT)}:{imp.line} ({imp.scope} level) imports {imp.module}: "
                           f"level {level[m]} -> {level[imp.module]}")
    assert not bad, "upward imports (see docs/ARCHITECTURE.md, Import rules):\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- family names


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _names_a_family(text: str) -> bool:
    low = text.lower()
    if any(w in low for w in FAMILY_WORDS):
        return True
    words = re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", text)
    return any(w.lower() in FAMILY_TOKENS for w in words)


def family_name_uses(source: str, filename: str = "<source>") -> list[str]:
    """``"line: what"`` for every identifier or string constant (docstrings excepted) naming a family."""
    tree = ast.parse(source, filename)
    docs = _docstring_nodes(tree)
    hits = []
    for node in ast.walk(tree):
        found: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found.append(node.value)
        elif isinstance(node, ast.Name):
            found.append(node.id)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node.name)
        elif isinstance(node, ast.arg):
            found.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.append(node.arg)
        elif isinstance(node, ast.alias):
            found += [node.name, node.asname or ""]
        elif isinstance(node, (ast.ImportFrom,)) and node.module:
            found.append(node.module)
        hits += [f"{getattr(node, 'lineno', '?')}: {s!r}" for s in found if s and _names_a_family(s)]
    return hits


def test_the_family_name_check_can_fail():
    src = ('"""Docstrings may say EAGLE-3 and MTP."""\n'
           "import torch  # comments may say medusa\n"
           "def f(x):\n    '''nor here: dflash'''\n    return x\n"
           "ok = 'attempt'\n")
    assert family_name_uses(src) == []
    for bad in ("if algo == 'eagle3':\n    pass\n", "x = Eagle3Config\n", "def peagle_step(): pass\n",
                "f(mtp_layers=1)\n", "msg = f'{n} MTPModule'\n", "from .drafters.medusa import X\n",
                "y = cfg.dspark_rank\n", "class DFlashThing: pass\n", "z = 'smollm2-mtp'\n"):
        assert family_name_uses(bad), bad


#: files outside drafters/ that may name families, and why: vLLM's weight loaders as a table keyed by vLLM's
#: own ``speculators_model_type`` names (written from vLLM's source, to check our exports independently of
#: the families' export code; a family vLLM has no loader for simply has no row)
FAMILY_NAME_EXEMPT = {"speculators/export/vllm_layout.py"}


def test_no_family_name_outside_the_drafters_package():
    files = [p for p in sources() if (PKG / "drafters") not in p.parents
             and str(p.relative_to(ROOT)) not in FAMILY_NAME_EXEMPT]
    assert len(files) > 20 and not any("drafters" in p.parts for p in files)
    bad = [f"{p.relative_to(ROOT)}:{hit}" for p in files for hit in family_name_uses(p.read_text(), str(p))]
    assert not bad, ("family names outside speculators/drafters/ (the trainer, generation, eval, CLI and data "
                     "never name a family; use the registry and the Drafter interface):\n" + "\n".join(bad))


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("tiny-*.yaml")), ids=lambda p: p.name)
def test_every_tiny_recipe_names_a_registered_family(recipe):
    """The registry is how the rest of the code finds a family: each tiny recipe's family is registered."""
    import yaml

    from speculators.drafters import registry

    algo = (yaml.safe_load(recipe.read_text()).get("drafter") or {}).get("algorithm")
    assert algo in registry.names(), f"{recipe.name}: drafter.algorithm {algo!r} not in {registry.names()}"


def test_every_family_file_is_registered_without_a_list_to_edit():
    """Adding a family is adding its file: every module of speculators/drafters/ other than the shared
    infrastructure registers exactly one family, found by the package import (no import list to edit)."""
    from speculators import drafters
    from speculators.drafters import registry

    files = sorted(p.stem for p in Path(drafters.__file__).parent.glob("*.py")
                   if p.stem not in drafters.INFRASTRUCTURE and not p.stem.startswith("_"))
    modules = sorted({registry.get(n).__module__.rsplit(".", 1)[-1] for n in registry.names()})
    assert modules == files and len(registry.names()) == len(files)


# the model a family specialises, and nothing else (docs/ARCHITECTURE.md, "The Drafter interface"); what is not the
# model lives beside it: the serving format (drafters/serving_format.py), checkpoint and training-state functions
DRAFTER_METHODS = {"__init__", "from_target", "_build", "attach_target", "loss", "loss_counts", "start", "propose",
                   "advance", "output_heads", "confidence_calibration", "set_confidence_calibration",
                   "save_pretrained", "from_pretrained"}


def test_the_drafter_base_class_stays_the_model_interface():
    """``Drafter`` declares exactly the documented methods (functions, properties, class- and static methods
    defined in its body); a new one is a design change that docs/ARCHITECTURE.md must describe first."""
    import inspect

    from speculators.drafters.base import Drafter

    got = {name for name, v in vars(Drafter).items()
           if inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod))}
    assert got == DRAFTER_METHODS, (f"added: {sorted(got - DRAFTER_METHODS)}, "
                                    f"removed: {sorted(DRAFTER_METHODS - got)}")
    assert len(got) <= 14
