"""What draft tree a decode asks for: EAGLE-2's dynamic tree or a static tree in vLLM's syntax.

:class:`TreeSpec` is the one description the decoding loop, the eval and the drafters share:

* **dynamic** (EAGLE-2, Li et al. arXiv 2406.16858): ``depth`` levels; at each level the ``topk`` frontier
  nodes with the highest cumulative draft log-probability each get their ``topk`` best children from one
  batched drafter forward; then the ``total_tokens`` best nodes of all levels are kept (a child never
  scores above its parent, so the kept set is a tree). The reference code's GPU defaults are depth 7,
  top-k 10, 60 tokens; a CPU verifies far fewer nodes per forward at the same cost, so the defaults here
  are small.
* **static**: vLLM's ``speculative_token_tree``, a list of paths of child ranks
  (:func:`speculators.verify.tree.parse_token_tree`): node ``(0, 1)`` is the second-best child of the best
  child of the root. Every request gets the same shape.

``TreeSpec.parse`` reads the command-line form: ``depth=4,topk=4,total_tokens=16`` (any subset, the rest
default), or a vLLM literal such as ``[(0,), (1,), (0, 0)]``, or the path of a file holding one (JSON
list of lists, or the literal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculatorsError

_DYNAMIC_KEYS = ("depth", "topk", "total_tokens")


@dataclass(frozen=True)
class TreeSpec:
    """A draft tree request.

    Attributes:
        depth: most draft tokens on one root-to-leaf path (>= 1); for a static tree the longest path.
        topk: dynamic trees: frontier width and children per expanded node (>= 1).
        total_tokens: dynamic trees: nodes kept after the final rerank (>= 1); static: the number of paths.
        paths: the static tree's paths of child ranks (vLLM's ``speculative_token_tree``), or None
            for a dynamic tree.
    """

    depth: int = 4
    topk: int = 4
    total_tokens: int = 16
    paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in _DYNAMIC_KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpeculatorsError(f"tree {name}: expected an integer >= 1, got {v!r}")
        if self.paths is not None:
            if len(self.paths) != self.total_tokens or max(len(p) for p in self.paths) != self.depth:
                raise SpeculatorsError("tree: a static tree's depth and total_tokens must be its longest path "
                                       "and its number of paths (use TreeSpec.static)")

    @classmethod
    def static(cls, spec) -> "TreeSpec":
        """A static tree from vLLM's ``speculative_token_tree`` (a literal string or a list of paths).

        Raises:
            SpeculatorsError: naming ``speculative_token_tree`` (see :func:`parse_token_tree`).
        """
        from ..verify.tree import parse_token_tree

        paths = parse_token_tree(spec)
        return cls(depth=max(len(p) for p in paths), topk=max(max(p) for p in paths) + 1,
                   total_tokens=len(paths), paths=paths)

    @property
    def is_static(self) -> bool:
        return self.paths is not None

    @property
    def label(self) -> str:
        """Short, unique name for reports: ``dynamic d4 k4 n16``, or ``static d3 n7`` followed by the tree's
        paths (``[(0,), (1,), (0, 0)]``) so that two static trees of the same size never share a label."""
        if self.is_static:
            return f"static d{self.depth} n{self.total_tokens} {str(list(self.paths))}"
        return f"dynamic d{self.depth} k{self.topk} n{self.total_tokens}"

    def as_dict(self) -> dict:
        """JSON-native form (``paths`` as lists, vLLM's ``speculative_token_tree`` order)."""
        return {"kind": "static" if self.is_static else "dynamic", "depth": self.depth, "topk": self.topk,
                "total_tokens": self.total_tokens,
                "paths": None if self.paths is None else [list(p) for p in self.paths]}

    @classmethod
    def parse(cls, text: str, what: str = "--tree") -> "TreeSpec":
        """The command-line form: ``depth=D,topk=K,total_tokens=N`` (a dynamic tree; keys may be omitted),
        a vLLM ``speculative_token_tree`` literal (``[(0,), (1,), (0, 0)]``), or the path of a file
        holding one (a JSON list of lists or the literal).

        Raises:
            SpeculatorsError: naming ``what``: an unknown key, a value that is not an integer >= 1, an
                unreadable file, or a static tree that :func:`parse_token_tree` refuses.
        """
        text = str(text).strip()
        if not text:
            raise SpeculatorsError(f"{what}: empty; give depth=D,topk=K,total_tokens=N or a static tree such as "
                                   f"[(0,), (1,), (0, 0)]")
        if text[0] in "[(":
            return cls.static(text)
        path = Path(text)
        if path.suffix in (".json", ".txt", ".tree") or (path.exists() and path.is_file()):
            try:
                body = path.read_text()
            except OSError as e:
                raise SpeculatorsError(f"{what}: cannot read the tree file {path}: {e}") from None
            try:
                return cls.static(json.loads(body))
            except json.JSONDecodeError:
                return cls.static(body.strip())
        kw = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in _DYNAMIC_KEYS:
                raise SpeculatorsError(f"{what}: {part.strip()!r} is not one of {', '.join(k + '=N' for k in _DYNAMIC_KEYS)} "
                                       f"(or give a static tree such as [(0,), (1,), (0, 0)] or a file holding one)")
            try:
                kw[key] = int(value)
            except ValueError:
                raise SpeculatorsError(f"{what}: {key} must be an integer >= 1, got {value.strip()!r}") from None
        return cls(**kw)
