"""Draft-tree reports: measured acceptance per depth and rank, and the static tree those rates predict best.

Pure functions over measured numbers (no model code):

* :func:`rank_acceptance`: from the :class:`~speculators.decode.state.GenerationResult` s of a tree pass
  (``tree_ranks``: per step, the sibling rank of every accepted node, root to leaf), the acceptance
  ``a[d][r]`` = P(the accepted path takes the rank-``r`` child at depth ``d`` | it reached depth ``d - 1``).
* :func:`expected_accepted`: the expected accepted drafts per step of a static tree (vLLM's
  ``speculative_token_tree``) under the *independence model*: the accepted path picks the rank-``r``
  child at depth ``d`` with probability ``a[d][r]`` whatever happened above it, so node
  ``(r_1, .., r_d)`` is accepted with probability ``a[1][r_1] * .. * a[d][r_d]``.
* :func:`best_static_tree`: the static tree of at most ``max_nodes`` nodes that maximises predicted
  tokens per millisecond, given the rates, the measured target forward time per verified width and the
  drafter's time per level. Per node budget the tree is built greedily, as Sequoia (Chen et al., arXiv
  2402.12374) and Medusa (Cai et al., arXiv 2401.10774, its sparse tree from measured top-k accuracies)
  do under the same independence model.
* :func:`tree_table`: Markdown lines of the eval report's tree rows.

Rate tables (the ``rate`` argument) are accepted in three forms: the dict :func:`rank_acceptance`
returns (its ``depths`` and ``rate``, JSON-loaded or not); a mapping ``{depth: [rate of rank 0, rank 1,
..]}`` with depth keys ``1, 2, ..`` (ints or their strings); or a list whose element ``i`` is the row of
depth ``i + 1`` (the layout of :func:`rank_acceptance`'s ``rate``). A missing depth or rank and a
``None`` ("n/a") rate count as 0.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from ..errors import SpeculatorsError
from ..verify.tree import parse_token_tree

__all__ = ["best_static_tree", "expected_accepted", "rank_acceptance", "tree_table"]

Path = tuple[int, ...]


# --------------------------------------------------------------------------------------------------
# Measured acceptance per depth and rank
# --------------------------------------------------------------------------------------------------


def rank_acceptance(results: list, max_depth: int, max_rank: int) -> dict:
    """Measured acceptance per depth and sibling rank of a tree decoding pass.

    Every verification step of every result counts once. With ``path`` = the step's ``tree_ranks``
    entry (the accepted nodes' ranks among their siblings, root to leaf; 0 = the drafter's best child):

    * ``reached[d]`` = steps with ``len(path) >= d - 1`` (every step reaches depth 0, the root);
    * ``hits[d][r]`` = steps with ``len(path) >= d`` and ``path[d - 1] == r``;
    * ``rate[d][r] = hits[d][r] / reached[d]``, ``depth_rate[d] = sum_r hits[d][r] / reached[d]``
      (ranks ``0 .. max_rank - 1``); both ``None`` ("n/a") when ``reached[d] == 0``, never 0.

    Bias: a rank-``r`` child can only be a hit where the tree OFFERED one. Dynamic trees (EAGLE-2) keep
    only the best nodes, so low-probability ranks are often absent and ``rate[d][r]`` underestimates
    the acceptance of an offered rank-``r`` child, more so for large ``r`` and deep ``d``; a static
    tree without a rank-``r`` child at some node never scores it there either. Ranks are sibling
    positions in the tree's node order (:class:`~speculators.verify.tree.TreeVerifyOutput`), which
    equal the drafter's ranks for trees without rank gaps. Accepted nodes deeper than ``max_depth``
    or of rank ``>= max_rank`` are not in ``hits`` (their counts are in ``deeper`` / ``beyond_rank``).
    ``reached[d]`` also counts steps whose path stopped at a node with no children offered (a leaf of a
    shallow branch, a tree cut near ``max_new_tokens``), which lowers every rate at depth d further; and
    the verifier's view is counted, so a node accepted after a stop token (not emitted) is a hit.

    Args:
        results: ``GenerationResult`` s of a ``speculative_generate(tree=...)`` pass (any object with
            ``tree_ranks`` and ``verifier_accepted``); results with no steps are allowed.
        max_depth: depths ``1 .. max_depth`` are reported (>= 1).
        max_rank: ranks ``0 .. max_rank - 1`` are reported (>= 1).

    Returns:
        JSON-native dict: ``depths`` ``[D]`` (1..max_depth), ``hits`` ``[D][R]`` int, ``reached`` ``[D]``
        int, ``rate`` ``[D][R]`` float or None, ``depth_rate`` ``[D]`` float or None, ``beyond_rank``
        ``[D]`` int (accepted nodes of rank ``>= max_rank``), ``deeper`` int (accepted nodes below
        ``max_depth``), ``steps`` int.

    Raises:
        SpeculatorsError: naming ``max_depth`` / ``max_rank`` (not an int >= 1) or ``results`` (not a
            list; a result with steps but no ``tree_ranks``, i.e. a chain pass; ``tree_ranks`` and
            ``verifier_accepted`` disagreeing on the number of steps or a step's path length; a
            negative rank).
    """
    _check_int(max_depth, "max_depth")
    _check_int(max_rank, "max_rank")
    if not isinstance(results, (list, tuple)):
        raise SpeculatorsError(f"results: expected a list of GenerationResult, got {type(results).__name__}")
    hits = [[0] * max_rank for _ in range(max_depth)]
    reached = [0] * max_depth
    beyond = [0] * max_depth
    deeper = steps = 0
    for i, res in enumerate(results):
        for path in _step_paths(res, i):
            steps += 1
            for d in range(1, max_depth + 1):
                if len(path) >= d - 1:
                    reached[d - 1] += 1
                if len(path) >= d:
                    r = path[d - 1]
                    if r < max_rank:
                        hits[d - 1][r] += 1
                    else:
                        beyond[d - 1] += 1
            deeper += max(0, len(path) - max_depth)
    rate = [[None if n == 0 else h / n for h in row] for row, n in zip(hits, reached)]
    depth_rate = [None if n == 0 else sum(row) / n for row, n in zip(hits, reached)]
    return {"depths": list(range(1, max_depth + 1)), "hits": hits, "reached": reached, "rate": rate,
            "depth_rate": depth_rate, "beyond_rank": beyond, "deeper": deeper, "steps": steps}


def _step_paths(res: object, i: int) -> list[list[int]]:
    """The checked ``tree_ranks`` of result ``i`` (one list of ranks per step)."""
    ranks = list(getattr(res, "tree_ranks", None) or [])
    acc = list(getattr(res, "verifier_accepted", None) or [])
    if acc and not ranks:
        raise SpeculatorsError(f"results[{i}]: {len(acc)} steps but no tree_ranks; rank_acceptance needs "
                               "the results of a tree pass (speculative_generate(tree=...))")
    if acc and len(acc) != len(ranks):
        raise SpeculatorsError(f"results[{i}]: {len(ranks)} tree_ranks entries for {len(acc)} steps")
    out = []
    for s, path in enumerate(ranks):
        path = [int(r) for r in path]
        if any(r < 0 for r in path):
            raise SpeculatorsError(f"results[{i}].tree_ranks[{s}]: negative rank in {path}")
        if acc and len(path) != int(acc[s]):
            raise SpeculatorsError(f"results[{i}].tree_ranks[{s}]: path of length {len(path)} but "
                                   f"verifier_accepted = {acc[s]}")
        out.append(path)
    return out


def _check_int(v: object, name: str, low: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise SpeculatorsError(f"{name}: expected an integer >= {low}, got {v!r}")


# --------------------------------------------------------------------------------------------------
# Independence model
# --------------------------------------------------------------------------------------------------


def _rate_rows(rate: object) -> dict[int, list[float]]:
    """``{depth: [rate per rank]}`` from any accepted form (module docstring); None -> 0.0.

    Raises:
        SpeculatorsError naming ``rate``: an unknown form, a depth < 1, a rate outside [0, 1] or not finite.
    """
    if isinstance(rate, Mapping) and "rate" in rate:
        depths = rate.get("depths") or list(range(1, len(rate["rate"]) + 1))
        items = list(zip(depths, rate["rate"]))
    elif isinstance(rate, Mapping):
        items = list(rate.items())
    elif isinstance(rate, Sequence) and not isinstance(rate, (str, bytes)):
        items = list(enumerate(rate, start=1))
    else:
        raise SpeculatorsError(f"rate: expected rank_acceptance's dict, {{depth: [rates]}} or a list of rows, "
                               f"got {type(rate).__name__}")
    rows: dict[int, list[float]] = {}
    for d, row in items:
        try:
            d = int(d)
        except (TypeError, ValueError):
            raise SpeculatorsError(f"rate: depth keys must be integers >= 1, got {d!r}") from None
        if d < 1:
            raise SpeculatorsError(f"rate: depth keys must be integers >= 1, got {d}")
        if row is None:
            row = []
        if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
            raise SpeculatorsError(f"rate: depth {d}: expected a list of per-rank rates, got {row!r}")
        vals = []
        for r, x in enumerate(row):
            x = 0.0 if x is None else x
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 0 <= x <= 1:
                raise SpeculatorsError(f"rate: depth {d} rank {r}: expected a probability in [0, 1] or None, "
                                       f"got {x!r}")
            vals.append(float(x))
        rows[d] = vals
    return rows


def _value(rows: dict[int, list[float]], path: Sequence[int]) -> float:
    """Independence-model probability that node ``path`` is accepted: product of its rates."""
    v = 1.0
    for d, r in enumerate(path, start=1):
        row = rows.get(d, [])
        v *= row[r] if r < len(row) else 0.0
    return v


def expected_accepted(paths, rate) -> float:
    """Expected accepted drafts per step of a static tree under the independence model.

    ``E[accepted] = sum over nodes (r_1, .., r_d) of rate[1][r_1] * .. * rate[d][r_d]``: node ``u`` is on
    the accepted path iff every node of its path is, and the model takes the rank accepted at each depth
    to be drawn independently with probabilities ``rate[d][.]`` (Sequoia, arXiv 2402.12374, positional
    acceptance vector; Medusa, arXiv 2401.10774). Expected tokens emitted per step = ``1 + E``
    (the recovered / bonus token), ignoring stop tokens and ``max_new_tokens``.

    Args:
        paths: vLLM ``speculative_token_tree`` (a literal string or a sequence of rank paths, see
            :func:`~speculators.verify.tree.parse_token_tree`).
        rate: a rate table (module docstring); missing depths / ranks and None rates count as 0.

    Returns:
        expected accepted drafts per step (float, tokens).

    Raises:
        SpeculatorsError: naming ``speculative_token_tree`` (an invalid tree) or ``rate``.
    """
    tree = parse_token_tree(paths)
    rows = _rate_rows(rate)
    return float(sum(_value(rows, p) for p in tree))


# --------------------------------------------------------------------------------------------------
# Best static tree
# --------------------------------------------------------------------------------------------------


def _greedy_order(rows: dict[int, list[float]], max_depth: int, limit: int) -> list[tuple[Path, float]]:
    """Up to ``limit`` nodes of positive value, best first, every parent before its children."""
    heap: list[tuple[float, int, Path]] = []

    def push_children(parent: Path, pv: float) -> None:
        d = len(parent) + 1
        if d > max_depth:
            return
        for r, x in enumerate(rows.get(d, [])):
            if pv * x > 0:
                heapq.heappush(heap, (-pv * x, d, parent + (r,)))

    push_children((), 1.0)
    order: list[tuple[Path, float]] = []
    while heap and len(order) < limit:
        neg, _, path = heapq.heappop(heap)
        order.append((path, -neg))
        push_children(path, -neg)
    return order


def _check_costs(forward_ms: object, draft_ms_per_level: object, max_nodes: object, max_depth: object) -> None:
    if not isinstance(forward_ms, Sequence) or isinstance(forward_ms, (str, bytes)) or len(forward_ms) == 0:
        raise SpeculatorsError(f"forward_ms: expected a non-empty list of milliseconds, got {forward_ms!r}")
    if len(forward_ms) < 3:
        raise SpeculatorsError(f"forward_ms: needs entries up to index 2 (the root + 1 node), got "
                               f"{len(forward_ms)} entries")
    for m, t in enumerate(forward_ms[1:], start=1):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise SpeculatorsError(f"forward_ms[{m}]: expected a positive time in ms, got {t!r}")
    t = draft_ms_per_level
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise SpeculatorsError(f"draft_ms_per_level: expected a time in ms >= 0, got {t!r}")
    _check_int(max_nodes, "max_nodes")
    _check_int(max_depth, "max_depth")


def best_static_tree(rate, forward_ms: list[float], draft_ms_per_level: float, max_nodes: int,
                     max_depth: int, draft_ms_fixed: float = 0.0) -> dict:
    """The static draft tree with the most predicted tokens per ms (Sequoia / Medusa construction).

    For each node budget ``n = 1 .. min(max_nodes, len(forward_ms) - 2)``:

    * tree: the ``n`` nodes of highest value ``v(path) = rate[1][r_1] * .. * rate[d][r_d]`` among all
      paths of depth ``<= max_depth`` (ties: shallower, then lexicographically smaller, first), found
      greedily: the candidates start as the root's children ``(r,)``; the best candidate is taken and
      its children ``path + (r,)`` become candidates. Since a rate is ``<= 1`` a child's value never
      exceeds its parent's, so the ``n`` best paths always include their parents and form a tree, and
      as ``E[accepted]`` is the sum of the node values (:func:`expected_accepted`) no tree of ``n``
      nodes has a larger one: the greedy is optimal (Sequoia, Chen et al. arXiv 2402.12374, Sec. 3.1;
      Medusa, Cai et al. arXiv 2401.10774, sparse tree from top-k accuracies). Only paths of positive
      value are candidates, so sizes past their number are not built.
    * cost (ms per step) = ``forward_ms[n + 1]`` (the target forward over the root + ``n`` nodes) +
      ``draft_ms_fixed + draft_ms_per_level * (depth - 1)``: the drafter's per-step work whatever the tree
      (``advance`` over the accepted tokens, which produces the root's logits) plus one batched forward per
      level whose nodes get children; the deepest level gets no children, so a tree of depth ``D`` costs
      ``D - 1`` levels.
    * predicted tokens/s = ``1000 * (1 + E[accepted]) / cost``.

    The best size is the one with the most tokens/s (the smallest on ties). vLLM's EAGLE drafter only
    drafts trees with one child count per level as written (see
    :func:`~speculators.verify.tree.parse_token_tree`); ``level_uniform`` says whether this one is.

    Args:
        rate: a rate table (module docstring), e.g. :func:`rank_acceptance`'s output.
        forward_ms: ``forward_ms[m]`` = measured target forward time (ms) over ``m`` tokens
            (``m = n + 1``); index 0 is unused; at least 3 entries.
        draft_ms_per_level: drafter time (ms) of one tree level (one batched forward), >= 0.
        draft_ms_fixed: drafter time (ms) every step pays whatever the tree (its ``advance``), >= 0.
        max_nodes: largest tree (nodes, root excluded) to consider, >= 1.
        max_depth: longest path to consider, >= 1.

    Returns:
        JSON-native dict: ``paths`` (lists, vLLM order: by depth then lexicographic), ``speculative_token_tree``
        (the string vLLM takes, e.g. ``"[(0,), (1,), (0, 0)]"``), ``num_nodes``, ``depth``,
        ``expected_tokens_per_step``, ``predicted_ms_per_step``, ``predicted_tokens_per_s``,
        ``level_uniform`` and ``by_size``: per built size ``{num_nodes, depth, expected_tokens_per_step,
        predicted_ms_per_step, predicted_tokens_per_s}``.

    Raises:
        SpeculatorsError: naming ``forward_ms`` (empty, under 3 entries, a time <= 0 or not finite past
            index 0), ``draft_ms_per_level`` (negative), ``max_nodes`` / ``max_depth`` (< 1) or ``rate``
            (bad table; no positive rate at depth 1).
    """
    _check_costs(forward_ms, draft_ms_per_level, max_nodes, max_depth)
    if not draft_ms_fixed >= 0.0:
        raise SpeculatorsError(f"draft_ms_fixed: expected a time >= 0 (ms), got {draft_ms_fixed!r}")
    rows = _rate_rows(rate)
    limit = min(max_nodes, len(forward_ms) - 2)
    order = _greedy_order(rows, max_depth, limit)
    if not order:
        raise SpeculatorsError("rate: no positive acceptance rate at depth 1; no tree is worth drafting")
    by_size, best = [], None
    expected, depth = 0.0, 0
    for n, (path, value) in enumerate(order, start=1):
        expected += value
        depth = max(depth, len(path))
        ms = float(forward_ms[n + 1]) + draft_ms_fixed + draft_ms_per_level * (depth - 1)
        row = {"num_nodes": n, "depth": depth, "expected_tokens_per_step": 1.0 + expected,
               "predicted_ms_per_step": ms, "predicted_tokens_per_s": 1000.0 * (1.0 + expected) / ms}
        by_size.append(row)
        if best is None or row["predicted_tokens_per_s"] > best["predicted_tokens_per_s"]:
            best = row
    paths = sorted((p for p, _ in order[:best["num_nodes"]]), key=lambda t: (len(t), t))
    return {"paths": [list(p) for p in paths], "speculative_token_tree": str(paths),
            "num_nodes": best["num_nodes"], "depth": best["depth"],
            "expected_tokens_per_step": best["expected_tokens_per_step"],
            "predicted_ms_per_step": best["predicted_ms_per_step"],
            "predicted_tokens_per_s": best["predicted_tokens_per_s"],
            "level_uniform": _level_uniform(paths), "by_size": by_size}


def _level_uniform(paths: list[Path]) -> bool:
    """True iff at every level each node has children of ranks ``0 .. k - 1`` with the same ``k``."""
    kids: dict[Path, list[int]] = {(): []}
    for p in paths:
        kids.setdefault(p, [])
        kids[p[:-1]].append(p[-1])
    depth = max(len(p) for p in paths)
    for d in range(depth):
        counts = {tuple(sorted(c)) for p, c in kids.items() if len(p) == d}
        if len(counts) != 1 or list(next(iter(counts))) != list(range(len(next(iter(counts))))):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# Markdown table
# --------------------------------------------------------------------------------------------------


def _fmt(x: object, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x:{spec}}{suffix}"


def _tree_name(row: Mapping) -> str:
    label = row.get("tree_label")
    if not label:
        tree = row.get("tree")
        if isinstance(tree, Mapping):
            label = f"{tree.get('kind', 'tree')} d{tree.get('depth', '?')} n{tree.get('total_tokens', '?')}"
        else:
            label = "n/a"
    return str(label).replace("|", "\\|")


def _tau(row: Mapping) -> str:
    tau = _fmt(row.get("tau"))
    ci = row.get("tau_ci")
    if tau == "n/a" or not isinstance(ci, (list, tuple)) or len(ci) != 2:
        return tau
    return f"{tau} [{_fmt(ci[0])}, {_fmt(ci[1])}]"


def tree_table(report_rows: list[dict]) -> list[str]:
    """Markdown table lines (header, separator, one line per row) of the eval report's tree rows.

    Columns: tree, batch, tau [95% CI] (mean tokens per step), nodes verified/step, acceptance per depth
    ``acc d1 .. acc dD`` (``P(accepted >= d)``, ``D`` = the longest ``per_position`` among the rows),
    draft ms/step, verify ms/step, tokens/s, speedup. A missing or None value (a chain row has no
    ``tree``; a shorter ``per_position``; no baseline for the speedup) prints as ``n/a``.

    Args:
        report_rows: dicts with keys ``tree`` (``TreeSpec.as_dict()``; optional), ``tree_label``,
            ``batch_size``, ``tau``, ``tau_ci`` (``[lo, hi]``), ``nodes_per_step``, ``per_position``,
            ``draft_ms_per_step``, ``verify_ms_per_step``, ``tokens_per_s``, ``speedup`` (float or None).

    Returns:
        list of strings, ``len(report_rows) + 2`` lines.

    Raises:
        SpeculatorsError: naming ``report_rows`` when it is not a list of dicts.
    """
    if not isinstance(report_rows, (list, tuple)) or not all(isinstance(r, Mapping) for r in report_rows):
        raise SpeculatorsError("report_rows: expected a list of dicts")
    depth = max((len(r.get("per_position") or []) for r in report_rows), default=0)
    head = (["tree", "batch", "tau [95% CI]", "nodes verified/step"] + [f"acc d{d}" for d in range(1, depth + 1)]
            + ["draft ms/step", "verify ms/step", "tokens/s", "speedup"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report_rows:
        pos = list(r.get("per_position") or [])
        acc = [_fmt(pos[d], ".3f") if d < len(pos) else "n/a" for d in range(depth)]
        batch = r.get("batch_size")
        cells = ([_tree_name(r), str(batch) if isinstance(batch, int) else "n/a", _tau(r),
                  _fmt(r.get("nodes_per_step"))] + acc
                 + [_fmt(r.get("draft_ms_per_step")), _fmt(r.get("verify_ms_per_step")),
                    _fmt(r.get("tokens_per_s"), ".1f"), _fmt(r.get("speedup"), ".2f", "x")])
        lines.append("| " + " | ".join(cells) + " |")
    return lines
