"""The draft-tree part of an eval: tree rows beside the drafter's chains, acceptance per depth and sibling rank,
and the static tree (vLLM's ``speculative_token_tree``) this machine should serve, from what was measured.

:func:`tree_block` runs after the chain passes of :func:`speculators.evaluation.runner.run_eval` (same prompts, seeds,
stop ids and greedy check: every tree output at temperature 0 is compared with plain greedy decoding), one
pass per tree and batch size. Then, from the batch-1 tree pass with the highest tau:

* :func:`speculators.evaluation.static_tree.rank_acceptance`: ``rate[d][r]``, the share of steps reaching depth
  ``d - 1`` whose accepted path took the rank-r child at depth d;
* the target's forward cost over ``m = 1 .. max_nodes + 1`` tokens at batch 1, measured here
  (:func:`speculators.evaluation.forward_cost.measure_verify_cost`, median of 3, at the eval's context length; a
  tree forward reads the same weights and computes the same products as a chain forward of as many tokens,
  only its attention mask differs);
* :func:`speculators.evaluation.static_tree.best_static_tree`: the static tree maximising expected emitted tokens per
  millisecond of target forward (the least-squares non-decreasing fit of the measured times, :func:`_monotone_fit`)
  plus drafting (:func:`_draft_costs`: the drafter's fixed per-step time,
  the intercept of its chain rows' drafting ms against K, plus the rest of that tree pass's drafting time
  per level), printed in vLLM's syntax. The forward cost is timed on chain-shaped forwards: on this CPU the
  tree's 4-D mask changes little, on a GPU it can keep SDPA off its causal kernel (not measured here).
"""

from __future__ import annotations

from .costs import eval_context
from ..errors import SpeculatorsError
from .forward_cost import measure_verify_cost
from .settings import PassKey
from .static_tree import best_static_tree, rank_acceptance, tree_table


def _chain_rows(report: dict) -> dict:
    return {(r["k"], r["batch_size"]): r for r in report["rows"] if r["method"] == "drafter"}


def tree_block(ev, proposer, trees: list, batch_sizes: list[int], report: dict, log=print) -> dict:
    """Decode every prompt with the drafter drafting each tree of ``trees`` at every batch size and summarise.

    Args:
        ev: the eval's passes (``speculators.evaluation.runner._EvalPasses``). proposer: the drafter.
        trees: :class:`speculators.decode.tree_spec.TreeSpec` s. batch_sizes: the eval's batch sizes.
        report: the chain report so far (its ``plain_rows`` give each batch size's baseline, its drafter
            rows the chain tau at the same depth).
    Returns:
        ``{"rows": [tree row per tree and batch size, each with chain_tau / tau_over_chain at K = depth],
        "rank_acceptance": {...}, "forward_ms": [ms per m tokens, index m], "draft_ms_per_level",
        "best_static_tree": {...}, "markdown": [report.md lines]}``.
    """
    plain = {p["batch_size"]: p["tokens_per_s"] for p in report["plain_rows"]}
    chain = _chain_rows(report)
    rows = []
    for b in batch_sizes:
        for spec in trees:
            row = ev.method_row(PassKey("drafter", spec.depth, b, tree=spec.label), proposer, plain[b], tree=spec)
            c = chain.get((spec.depth, b))
            row["chain_tau"] = None if c is None else c["tau"]
            row["tau_over_chain"] = row["tau"] / c["tau"] if c is not None and c["tau"] else None
            rows.append(row)
            log(f"eval: batch {b}, drafter tree {spec.label}: tau {row['tau']:.3f}"
                + (f" ({row['tau_over_chain']:.2f}x the chain's at K={spec.depth})" if row["tau_over_chain"] else "")
                + f", {row['nodes_per_step']:.1f} nodes verified/step, {row['tokens_per_s']:.1f} tokens/s"
                + (f" ({row['speedup']:.2f}x)" if row["speedup"] is not None else ""))
    block = {"rows": rows}
    best = max((r for r in rows if r["batch_size"] == 1), key=lambda r: r["tau"])
    spec = next(t for t in trees if t.label == best["tree_label"])
    results = ev.results_of[PassKey("drafter", spec.depth, 1, tree=spec.label)]
    acc = rank_acceptance(results, spec.depth, spec.topk)
    max_nodes = max(t.total_tokens for t in trees)
    secs = measure_verify_cost(ev.target, max_nodes, reps=3, prompt_len=eval_context(ev.prompts, ev.settings.max_new_tokens))
    forward_ms = [0.0] + [1000.0 * s for s in secs]
    fitted = _monotone_fit(forward_ms)
    fixed, per_level = _draft_costs(report, best, spec.depth)
    block.update(rank_acceptance={"tree": spec.label, "batch_size": 1, **acc}, forward_ms=forward_ms,
                 forward_ms_fitted=fitted, draft_ms_fixed=fixed, draft_ms_per_level=per_level)
    try:
        static = best_static_tree(acc, fitted, per_level, max_nodes, spec.depth, draft_ms_fixed=fixed)
    except SpeculatorsError as e:  # no measured acceptance to build from (e.g. nothing ever accepted)
        static = {"error": str(e)}
    block["best_static_tree"] = static
    if "speculative_token_tree" in static:
        log(f"eval: best static tree for this machine (measured acceptance of {spec.label}): "
            f"{static['speculative_token_tree']} ({static['num_nodes']} nodes, expected "
            f"{static['expected_tokens_per_step']:.2f} tokens/step, predicted {static['predicted_tokens_per_s']:.1f} "
            f"tokens/s from forward + drafting time alone)")
    block["markdown"] = _markdown(block, report)
    return block


def _monotone_fit(forward_ms: list[float]) -> list[float]:
    """The least-squares NON-DECREASING fit of the measured forward times ``forward_ms[m]`` (m >= 1; index 0
    stays 0.0; pool-adjacent-violators): a forward over more tokens never costs less, while one timing per
    size on a shared CPU is noisy (sizes 7 and 8 measured 47.5 and 39.7 ms in one run), and the static-tree
    choice must not follow the noise of one size."""
    blocks: list[list[float]] = []  # [mean, count] per pooled block
    for t in forward_ms[1:]:
        blocks.append([float(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    out = [0.0]
    for mean, n in blocks:
        out += [mean] * int(n)
    return out


def _draft_costs(report: dict, tree_row: dict, depth: int) -> tuple[float, float]:
    """``(fixed, per_level)`` drafting ms of a tree step: ``fixed`` is what a step pays whatever it drafts
    (the drafter's ``advance``), read as the intercept at K = 1 of the drafter's batch-1 chain rows (drafting
    ms per step against K, least squares; one row: that row's time); ``per_level`` is the rest of the tree
    row's drafting time over its ``depth - 1`` levels (all of it over one level for a depth-1 tree)."""
    pts = [(r["k"], r["draft_ms_per_step"]) for r in report["rows"]
           if r["method"] == "drafter" and r["batch_size"] == 1 and r.get("draft_ms_per_step") is not None]
    total = float(tree_row["draft_ms_per_step"])
    if len(pts) >= 2:
        mk = sum(k for k, _ in pts) / len(pts)
        mm = sum(m for _, m in pts) / len(pts)
        den = sum((k - mk) ** 2 for k, _ in pts)
        slope = sum((k - mk) * (m - mm) for k, m in pts) / den if den else 0.0
        fixed = mm + slope * (1 - mk)
    else:
        fixed = pts[0][1] if pts else 0.0
    fixed = min(max(fixed, 0.0), total)
    return fixed, (total - fixed) / max(1, depth - 1)


def _markdown(block: dict, report: dict) -> list[str]:
    chain = [dict(r, tree_label=f"chain K={r['k']}", nodes_per_step=r["drafted"] / r["steps"] if r["steps"] else None)
             for r in report["rows"] if r["method"] == "drafter"]
    lines = ["## Draft trees", "",
             "The drafter drafting a tree per step (dynamic: depth d, top-k k, the n best nodes kept; or a static "
             "vLLM `speculative_token_tree`), verified in one target forward; its chains at the same batch sizes "
             "for comparison. acc dj = P(the accepted path reaches depth j).", ""]
    lines += tree_table(chain + block["rows"]) + [""]
    st = block.get("best_static_tree") or {}
    if "speculative_token_tree" in st:
        lines += [f"Best static tree for this machine, from the acceptance per depth and rank measured with "
                  f"{block['rank_acceptance']['tree']} at batch 1 and the target's forward cost over 1..n+1 tokens "
                  f"measured here: `{st['speculative_token_tree']}` ({st['num_nodes']} nodes, expected "
                  f"{st['expected_tokens_per_step']:.2f} tokens per step).", ""]
    return lines
