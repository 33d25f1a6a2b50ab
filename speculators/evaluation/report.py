"""The eval report: its typed shape and its renderers, in one place.

:func:`speculators.evaluation.runner.run_eval` returns an :class:`EvalReport`: a JSON-native ``TypedDict`` (so
``report.json`` is the report itself) whose every key is
declared here with its meaning. Three renderers read it, and nothing else formats a report:

* :func:`render_markdown`: ``report.md`` (tables per batch size, counts, serving conventions, prompt
  sources, confidence gating, per-position acceptance, plots, compare table, losslessness line);
* :func:`render_terminal`: the same tables on a ``rich`` console (``speculators eval``);
* :func:`render_json`: ``report.json``;
* :func:`speculators.evaluation.plots.write_plots`: the two PNG plots (matplotlib's Agg canvas).

A ratio whose denominator is zero (an acceptance rate with nothing drafted, tokens/s without time, a
speedup over a baseline that took no time) is ``None`` in the report and ``n/a`` in every rendering.

This module imports nothing from the rest of the package but the typed ``cost_model`` block
(:mod:`speculators.evaluation.report_types`): the report is data.
"""

from __future__ import annotations

import json
from typing import Any, Optional, TypedDict

from .report_types import CostModel, ForwardCosts


class MethodRow(TypedDict, total=False):
    """One method at one K and batch size (``EvalReport.rows``; the counts of
    :meth:`speculators.evaluation.acceptance.AcceptanceStats.as_dict`).

    ``tau`` = emitted / steps (bonus included); ``tau_ci`` its 95% bootstrap interval over prompts;
    ``acceptance_rate`` = accepted / drafted (None when nothing was drafted); ``per_position[k-1]`` =
    P(draft k accepted | proposed), ``conditional[k-1]`` = P(draft k accepted | drafts 1..k-1 accepted)
    (None where no step reached k); ``steps``, ``emitted``, ``drafted``, ``accepted``,
    ``accepted_emitted``, ``proposed``, ``tokens`` counts; ``seconds`` the pass's wall time (s),
    ``tokens_per_s``, ``speedup`` (over plain decoding at the SAME batch size; None without a baseline
    time), ``best_k`` (the K with the best speedup of this method and batch size),
    ``drafted_per_step`` / ``verified_per_step``, ``draft_seconds`` / ``verify_seconds`` /
    ``batched_steps`` / ``draft_ms_per_step`` / ``verify_ms_per_step`` (the pass's time split),
    ``draft_sample_method`` (vLLM's setting the row holds under; None where it makes no difference),
    ``proposals`` (hybrid: drafts per part), ``gated`` (a confidence-gated row).
    """

    method: str
    k: int
    batch_size: int
    draft_sample_method: Optional[str]
    tau: float
    tau_ci: list[float]
    acceptance_rate: Optional[float]
    per_position: list[Optional[float]]
    conditional: list[Optional[float]]
    steps: int
    emitted: int
    drafted: int
    accepted: int
    accepted_emitted: int
    proposed: int
    tokens: int
    seconds: float
    tokens_per_s: Optional[float]
    speedup: Optional[float]
    best_k: bool
    drafted_per_step: Optional[float]
    verified_per_step: Optional[float]
    draft_seconds: float
    verify_seconds: float
    prefill_seconds: float
    forward_seconds: float
    batched_steps: int
    draft_ms_per_step: float
    verify_ms_per_step: float
    cache_width: float  # mean KV-cache width (slots) per batched forward; absent from older reports
    pass_costs: ForwardCosts  # the forwards measured right before this pass, at its batch size; absent from older reports
    proposals: dict[str, int]
    gated: bool


class PlainRow(TypedDict):
    """Plain decoding at one batch size (``EvalReport.plain_rows``): the baseline every speedup divides by."""

    batch_size: int
    tau: float
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: Optional[float]
    draft_seconds: float
    verify_seconds: float
    prefill_seconds: float
    forward_seconds: float
    batched_steps: int
    draft_ms_per_step: float
    verify_ms_per_step: float
    cache_width: float  # mean KV-cache width (slots) per batched forward; absent from older reports
    pass_costs: ForwardCosts  # the forwards measured right before this pass, at its batch size; absent from older reports


class ServingConventions(TypedDict):
    """The drafter under vLLM's two ``draft_sample_method`` settings at temperature > 0
    (:func:`speculators.evaluation.runner.serving_conventions`): ``rows`` = vLLM's default (argmax drafts) first,
    each a :class:`MethodRow` subset with ``engine_setting`` (the ``--speculative-config`` text)."""

    temperature: float
    batch_size: int
    k: int
    rows: list[dict[str, Any]]


class Gating(TypedDict):
    """Confidence-gated verification (DSpark): the threshold and/or cost model, whether the drafter
    reported confidences, and the ungated / gated drafter rows at the headline."""

    threshold: Optional[float]
    cost_aware: bool
    verify_cost: Optional[list[float]]
    confidences: bool
    headline: dict[str, MethodRow]


class PrecisionBaseline(TypedDict):
    """Batch-1 rows against the faster plain decoding of the eval's dtype and float32
    (:func:`speculators.evaluation.runner.precision_block`; on a CPU, where bfloat16 is not always the faster)."""

    plain_tokens_per_s: dict[str, Optional[float]]  # {dtype: plain tokens/s at batch 1}
    fastest: str  # the dtype of the faster plain decoding
    rows: list[dict[str, Any]]  # method, k, tokens_per_s, speedup_vs_fastest_plain


class EvalReport(TypedDict, total=False):
    """What :func:`speculators.evaluation.runner.run_eval` returns and ``report.json`` holds.

    Settings: ``num_prompts``, ``ks`` (the K sweep), ``batch_size`` / ``batch_sizes`` (the loaded one and
    ``[1, batch_size]``), ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ``stop_token_ids``, ``methods`` (in report order), ``hybrid_min_match``, ``hybrid_drafter_k``,
    ``bootstrap`` (``{resamples, level, seed, over}``).
    Results: ``rows`` (:class:`MethodRow` per method, K and batch size), ``plain_rows``, ``best_k``
    (``{batch: {method: K}}``, string keys), ``headline`` (``{batch_size, k}``: the largest batch size and
    the first method's best K there), ``plain`` (the headline's plain row), one :class:`MethodRow` per
    method at the headline under the method's name (``report["drafter"]``...), ``speedup`` (the
    drafter's) and ``<method>_speedup``, ``greedy_mismatches`` (temperature 0: every output that differs
    from plain greedy decoding, each with its near-tie classification,
    :func:`speculators.evaluation.greedy_check.classify_mismatch`; None when sampling), ``greedy_check`` (their counts
    per proposer and whether the check passed: :func:`speculators.evaluation.greedy_check.greedy_summary`), ``by_source`` (``{source: {method: block}}`` at the
    headline), ``serving_conventions`` (temperature > 0), ``gated_rows`` / ``gating`` (with a confidence
    gate), ``cost_model`` (predicted vs measured tokens/s, best K', break-even batch size), ``tau_definition``
    (:data:`TAU_DEFINITION`: what tau counts, so that a report read alone says it). Added by :func:`speculators.workflows.eval_run`: ``checkpoint``, ``target`` (with ``dtype``, the
    served target's, and ``trained_dtype``, the checkpoint's; None when it records none), ``dtype_warning``
    (only when the two differ), ``prompts``, ``device``, ``compare``; by :func:`speculators.evaluation.runner.write_report`: ``plots``.
    """

    num_prompts: int
    tau_definition: str
    k: int
    ks: list[int]
    batch_size: int
    batch_sizes: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: list[int]
    methods: list[str]
    hybrid_min_match: int
    hybrid_drafter_k: Optional[int]
    bootstrap: dict[str, Any]
    rows: list[MethodRow]
    plain_rows: list[PlainRow]
    best_k: dict[str, dict[str, int]]
    headline: dict[str, int]
    plain: PlainRow
    precision_baseline: PrecisionBaseline  # eval_run adds it when the target is not float32 on a CPU
    greedy_mismatches: Optional[list[dict[str, Any]]]
    greedy_check: Optional[dict[str, Any]]
    dtype_warning: str
    by_source: dict[str, dict[str, dict[str, Any]]]
    serving_conventions: ServingConventions
    gated_rows: list[MethodRow]
    gating: Gating
    cost_model: CostModel
    checkpoint: str
    target: dict[str, Any]
    prompts: Optional[str]
    device: str
    compare: dict[str, Any]
    plots: dict[str, str]
    # the headline row of each method under its name, and its speedup (``speedup`` is the drafter's)
    drafter: MethodRow
    drafter_argmax: MethodRow
    ngram: MethodRow
    suffix: MethodRow
    hybrid: MethodRow
    speedup: Optional[float]
    drafter_argmax_speedup: Optional[float]
    ngram_speedup: Optional[float]
    suffix_speedup: Optional[float]
    hybrid_speedup: Optional[float]


# table labels of the methods (report keys), and the vLLM --speculative-config setting under which each
# drafter method's row holds at temperature > 0
METHOD_LABELS = {"drafter": "drafter", "drafter_argmax": "drafter, argmax drafts",
                 "ngram": "n-gram (prompt lookup)", "suffix": "suffix decoding",
                 "hybrid": "hybrid (suffix, else drafter)", "plain": "plain target"}

#: The vLLM ``--speculative-config`` setting under which each method's row holds at temperature > 0
#: (``draft_sample_method``: vLLM's default ``greedy`` drafts by argmax and verifies each draft as a
#: point mass; ``probabilistic`` samples drafts from the drafter and verifies them with its
#: probabilities). Model-free proposers draft ids only (point masses) under either setting.
ENGINE_SETTINGS = {"drafter": 'draft_sample_method: "probabilistic"',
                   "drafter_argmax": 'draft_sample_method: "greedy" (vLLM\'s default)',
                   "hybrid": 'draft_sample_method: "probabilistic" (drafter part)'}


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` (and ``suffix``), or ``n/a`` for a ratio whose denominator was zero."""
    return "n/a" if x is None else f"{x:{spec}}{suffix}"

def _serving_markdown(report: dict) -> list[str]:
    sc = report.get("serving_conventions")
    if not sc:
        return []
    lines = ["", f"## Serving conventions (temperature {sc['temperature']}, batch size {sc['batch_size']}, "
                 f"K={sc['k']})", "",
             "At temperature > 0 the tau a user gets from vLLM depends on its `draft_sample_method`: by default "
             "vLLM drafts by argmax and verifies each draft as a point mass; with `probabilistic` it samples the "
             "drafts and verifies them against the drafter's distribution. Both are lossless.", "",
             "| vLLM --speculative-config | tau [95% CI] | acceptance rate | tokens/s | speedup |",
             "|---|---|---|---|---|"]
    for r in sc["rows"]:
        lines.append(f"| `{r['engine_setting']}` | {_fmt_tau(r)} | {fmt(r['acceptance_rate'], '.3f')} | "
                     f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['speedup'], '.2f', 'x')} |")
    return lines


#: what tau counts, printed wherever tau is (terminal, report.md) and stored in report.json (``tau_definition``)
TAU_DEFINITION = ("tau = tokens emitted per verification step: the accepted drafts plus the bonus or recovered token "
                  "the step adds (so >= 1); a step where the proposer drafted nothing counts as a step (it emits 1); "
                  "tokens after a stop token or max_new_tokens are not emitted and not counted")

PLOT_FILES = {"per_position": "per_position_acceptance.png", "tau_vs_k": "tau_vs_k.png"}


def _rows(report: dict, method: str | None = None, batch: int | None = None, k: int | None = None) -> list[dict]:
    return [r for r in report["rows"] if (method is None or r["method"] == method)
            and (batch is None or r["batch_size"] == batch) and (k is None or r["k"] == k)]


def _fmt_tau(r: dict) -> str:
    lo, hi = r.get("tau_ci") or (r["tau"], r["tau"])
    return f"{r['tau']:.3f} [{lo:.3f}, {hi:.3f}]"


def _fmt_ms(r: dict, what: str) -> str:
    v = r.get(f"{what}_ms_per_step")
    return "-" if v is None else f"{v:.2f}"


def _by_source_markdown(report: dict) -> list[str]:
    """The ``by_source`` table (a row per source and method), or nothing for fewer than two sources."""
    by = report.get("by_source") or {}
    if len(by) < 2:
        return []
    head = report["headline"]
    lines = ["", f"## By prompt source (batch size {head['batch_size']}, K={head['k']})", "",
             "| source | prompts | method | tau [95% CI] | acceptance rate | steps | tokens |",
             "|---|---|---|---|---|---|---|"]
    for name, per in by.items():
        for m in report["methods"]:
            r = per.get(m)
            if r is not None:
                lines.append(f"| {name} | {r['num_prompts']} | {METHOD_LABELS[m]} | {_fmt_tau(r)} | "
                             f"{fmt(r['acceptance_rate'], '.3f')} | {r['steps']} | {r['tokens']} |")
    return lines


def _gating_markdown(report: dict) -> list[str]:
    """The confidence-gating section (``report["gating"]``): ungated and gated drafter rows side by side
    (tau, drafted and verified drafts per step, acceptance rate, tokens/s, speedup), then per-position
    acceptance of both at the headline; nothing without gating."""
    g = report.get("gating")
    if not g:
        return []
    how = (f"survival threshold {g['threshold']}" if g["threshold"] is not None else "") + \
        (" + " if g["threshold"] is not None and g["cost_aware"] else "") + \
        ("cost-aware prefix (measured verify cost)" if g["cost_aware"] else "")
    lines = ["", f"## Confidence-gated verification ({how})", "",
             "The drafts after the first whose survival prod_{i<=k} c_i (calibrated confidences) falls below the "
             "threshold are not verified; the rule reads only the drafter's outputs, so the output distribution "
             "is unchanged. drafted/step = drafts proposed per step, verified/step = drafts the target verified.",
             "", "| drafter | batch | K | tau [95% CI] | drafted/step | verified/step | acceptance rate | tokens/s | "
             "speedup |", "|---|---|---|---|---|---|---|---|---|"]
    gated = {(r["batch_size"], r["k"]): r for r in report.get("gated_rows", [])}
    for b in report["batch_sizes"]:
        for r in sorted(_rows(report, "drafter", b), key=lambda r: r["k"]):
            for label, row in (("ungated", r), ("gated", gated.get((b, r["k"])))):
                if row is None:
                    continue
                lines.append(f"| {label} | {b} | {r['k']} | {_fmt_tau(row)} | {fmt(row.get('drafted_per_step'), '.2f')} | "
                             f"{fmt(row.get('verified_per_step'), '.2f')} | {fmt(row['acceptance_rate'], '.3f')} | "
                             f"{fmt(row['tokens_per_s'], '.1f')} | {fmt(row['speedup'], '.2f', 'x')} |")
    if not g.get("confidences"):
        lines += ["", "The drafter reported no confidence logits (or every draft cleared the gate): nothing was cut."]
    h = g["headline"]
    k = len(h["ungated"]["per_position"])
    lines += ["", f"acc_k at batch size {h['gated']['batch_size']}, K={h['gated']['k']} (P(draft k accepted | "
              "draft k verified)):", "", "| | " + " | ".join(str(i + 1) for i in range(k)) + " |", "|---|" + "---|" * k]
    for label in ("ungated", "gated"):
        lines.append(f"| {label} | " + " | ".join(fmt(x, '.3f') for x in h[label]["per_position"]) + " |")
    return lines


def greedy_lines(report: dict) -> list[str]:
    """The greedy losslessness lines of a report (Markdown and terminal alike; none when sampling): one
    line when every output equals plain greedy decoding; else the mismatch and near-tie counts in the eval
    dtype, one line per proposer, and ``ERROR`` naming every non-near-tie mismatch (a verifier failure).
    A report without ``greedy_check`` (an older one) counts every mismatch as a failure."""
    mm = report.get("greedy_mismatches")
    if mm is None:
        return []
    if not mm:
        return ["greedy losslessness: every proposer's output == plain greedy output on every prompt, at every K "
                "and batch size."]
    gc = report.get("greedy_check") or {"dtype": "?", "near_tie": 0, "failures": len(mm), "by_proposer": {}}
    lines = [f"greedy losslessness ({gc['dtype']}): {len(mm)} mismatches, {gc['near_tie']} on near-ties of the "
             f"target's logits (within the dtype's rounding; speculators.evaluation.greedy_check), {gc['failures']} "
             "verifier failures."]
    lines += [f"- {label}: {c['mismatches']} mismatches, {c['near_tie']} near-tie, {c['failures']} failures"
              for label, c in gc["by_proposer"].items()]
    bad = [m for m in mm if not m.get("near_tie")]
    if bad:
        lines.append(f"ERROR: {len(bad)} mismatches are not near-ties (verifier failures): "
                     + "; ".join(f"{m['prompt']} {m['proposer']} K={m['k']} batch {m['batch_size']} at token "
                                 f"{m['first_diff']} (logit gap {fmt(m.get('logit_gap'), '.4g')} > bound "
                                 f"{fmt(m.get('rounding_bound'), '.4g')})" for m in bad))
    return lines


BREAK_EVEN_COLUMNS = ("method", "batch", "K", "predicted tok/s", "measured tok/s", "error", "predicted speedup",
                      "best K", "break-even batch")


def break_even_rows(report: dict) -> list[list[str]]:
    """The cells of the break-even table (``report["cost_model"]``, :data:`BREAK_EVEN_COLUMNS`): per batch
    size the plain row, then every method's rows the eval ran (predicted and measured tokens/s, relative
    error, predicted speedup, the method's best K' at that batch size by predicted speedup with that
    speedup, and its break-even batch size, ``-`` when it pays at every measured batch size); empty
    without a cost model."""
    cm = report.get("cost_model")
    if not cm:
        return []
    out = []
    for p in cm["plain"]:
        b = p["batch_size"]
        out.append(["plain", str(b), "-", fmt(p["predicted_tokens_per_s"], ".1f"), fmt(p["measured_tokens_per_s"], ".1f"),
                    _fmt_pct(p["relative_error"]), "1.00x", "-", "-"])
        for m in report["methods"]:
            best = cm["best_k"].get(str(b), {}).get(m)
            bsp = next((q["predicted_speedup"] for q in cm["predictions"]
                        if q["method"] == m and q["batch_size"] == b and q["k"] == best), None)
            be = cm["break_even"].get(m, {}).get("batch_size")
            for q in cm["predictions"]:
                if q["method"] == m and q["batch_size"] == b and q["measured"]:
                    out.append([METHOD_LABELS[m], str(b), str(q["k"]), fmt(q["predicted_tokens_per_s"], ".1f"),
                                fmt(q["measured_tokens_per_s"], ".1f"), _fmt_pct(q["relative_error"]),
                                fmt(q["predicted_speedup"], ".2f", "x"),
                                "-" if best is None else f"{best} ({fmt(bsp, '.2f', 'x')})", "-" if be is None else str(be)])
    return out


def _fmt_pct(x: float | None) -> str:
    return fmt(None if x is None else 100 * x, "+.1f", "%")


def _break_even_markdown(report: dict) -> list[str]:
    """The cost-model section: how the prediction is made, the break-even table, the measured forward
    costs and each method's break-even sentence; nothing without ``report["cost_model"]``."""
    cm = report.get("cost_model")
    if not cm:
        return []
    c = cm["costs"]
    lines = ["", "## Cost model and break-even", "",
             "Predicted tokens/s = tokens / (prefill + sum over steps of draft(K') + forward(K'+1 tokens, live "
             "requests) + sampling(K') + overhead), with E[tokens per step | K'] = 1 + sum_{j<=K'} prod_{i<=j} "
             "q_i c_i from the measured conditional acceptance c_j (Leviathan et al. 2023's (1 - a^{K'+1}) / "
             "(1 - a) when every c_j = a), the measured drafting and rejection-sampling time, the measured target "
             "forwards (for a row the eval ran, measured right before its pass when recorded: the machine's speed "
             "drifts; comparisons from the forwards below) and plain decoding's measured per-step overhead "
             "(speculators.evaluation.cost_model). error = "
             "(predicted - measured) / measured; best K = the K' <= K with the best predicted speedup (its "
             "speedup); break-even batch = the smallest batch size at which no K' pays (- : it pays at every "
             "measured batch size).", "",
             "| " + " | ".join(BREAK_EVEN_COLUMNS) + " |", "|---" * len(BREAK_EVEN_COLUMNS) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in break_even_rows(report)]
    worst = cm.get("max_abs_relative_error")
    lines += ["", "No measured row to check the prediction against." if worst is None else
              f"Largest |error|: {100 * worst:.1f}% ({'within' if cm.get('within_15_percent') else 'not within'} "
              "15% on every measured row).", "",
              f"Measured target forward (ms) over m tokens per request, after {c['context']} tokens of context "
              f"(median of {c['reps']}):", "", "| batch | " + " | ".join(f"m={m + 1}" for m in range(c["k"] + 1)) + " |",
              "|---" * (c["k"] + 2) + "|"]
    for b in c["batch_sizes"]:
        lines.append(f"| {b} | " + " | ".join(f"{1000 * x:.2f}" for x in c["seconds"][str(b)]) + " |")
    lines += _long_context_lines(cm)
    lines += [""] + [f"- {METHOD_LABELS[m]}: {be['note']}" for m, be in cm["break_even"].items()]
    return lines


def _long_context_lines(cm: dict) -> list[str]:
    """The forwards measured at the second context length and the cache widths charged (nothing on an
    older report that measured one context and recorded no widths)."""
    c = cm["costs"]
    if not c.get("long_seconds"):
        return []
    lines = ["", f"The same after {c['long_context']} tokens of context (the forward is charged linear in the "
                 "KV-cache width, at each pass's mean width):", "",
             "| batch | " + " | ".join(f"m={m + 1}" for m in range(c["k"] + 1)) + " | cache width (slots), both contexts |",
             "|---" * (c["k"] + 3) + "|"]
    for b in c["batch_sizes"]:
        w = c.get("width", {}).get(str(b)), c.get("long_width", {}).get(str(b))
        widths = "n/a" if not all(w) else " / ".join(f"{sum(x) / len(x):.0f}" for x in w)
        lines.append(f"| {b} | " + " | ".join(f"{1000 * x:.2f}" for x in c["long_seconds"][str(b)]) + f" | {widths} |")
    charged = [f"{p['batch_size']}: {p['cache_width']:.0f}" for p in cm["plain"] if p.get("cache_width")]
    if charged:
        lines += ["", "Plain decoding's charged cache width (slots) per batch size: " + ", ".join(charged) + "."]
    return lines


def _precision_markdown(report: dict) -> list[str]:
    """The batch-1 rows against the faster plain decoding of two precisions (absent: nothing)."""
    pb = report.get("precision_baseline")
    if not pb:
        return []
    plain = ", ".join(f"{d} {fmt(t, '.1f')} tok/s" for d, t in pb["plain_tokens_per_s"].items())
    lines = ["## Against the fastest plain decoding (batch 1)", "",
             f"Plain decoding: {plain}; the faster is {pb['fastest']}.", "",
             "| method | K | tok/s | x fastest plain |", "|---|---|---|---|"]
    lines += [f"| {METHOD_LABELS.get(r['method'], r['method'])} | {r['k']} | {fmt(r['tokens_per_s'], '.1f')} | "
              f"{fmt(r['speedup_vs_fastest_plain'], '.2f', 'x')} |" for r in pb["rows"]]
    return lines + [""]


def render_markdown(report: EvalReport, title: str = "speculators eval", plots: dict[str, str] | None = None) -> str:
    """The report of :func:`speculators.evaluation.runner.run_eval` as Markdown (``report.md``).

    Sections: one table per batch size (a row per method and K: tau with its 95% bootstrap CI,
    acceptance rate, tokens/s, speedup over plain decoding at that batch size, drafting and verifying
    ms per step; ★ marks each method's best K), the counts table of the headline rows (steps, drafted,
    accepted, accepted & emitted, emitted), the by-source table (``report["by_source"]``, when the
    prompts come from two sources or more), the confidence-gating section (``report["gating"]``: ungated
    and gated drafter rows, drafted / verified drafts per step, acc_k of both), the cost model's break-even table
    (``report["cost_model"]``: predicted vs measured tokens/s, best K', break-even batch size), per-position and conditional acceptance at batch 1 and the largest K, the plots
    (``plots``, default ``report["plots"]``: ``{"per_position" | "tau_vs_k": relative PNG path}``,
    embedded as images), the compare table (``report["compare"]``) and the greedy losslessness line.
    """
    plots = plots if plots is not None else report.get("plots")
    methods = report["methods"]
    ks = report["ks"]
    head = report["headline"]
    lines = [f"# {title}", ""] + ([f"**Warning:** {report['dtype_warning']}", ""] if report.get("dtype_warning") else [])
    lines += [f"{report['num_prompts']} prompts" + (f" ({report['prompts']})" if report.get("prompts") else "")
              + f", temperature {report['temperature']}, top_p {report['top_p']}, top_k {report['top_k']}, "
              f"max_new_tokens {report['max_new_tokens']}; K in {ks}; batch sizes {report['batch_sizes']}.", "",
              f"{TAU_DEFINITION}; its 95% bootstrap confidence "
              f"interval is over prompts ({report['bootstrap']['resamples']} resamples); acceptance rate = accepted / "
              "drafted (the verifier's view); speedup = tokens/s over plain decoding at the SAME batch size; "
              "★ = the K with the best speedup of that method and batch size; draft / verify ms/step = wall time "
              "of the proposer (propose + advance) / of the target forward and rejection sampling per batched "
              "decoding step.", ""]
    for b in report["batch_sizes"]:
        plain = next(p for p in report["plain_rows"] if p["batch_size"] == b)
        lines += [f"## Batch size {b}", "", "| method | K | tau [95% CI] | acceptance rate | tokens/s | speedup | "
                  "draft ms/step | verify ms/step |", "|---|---|---|---|---|---|---|---|"]
        for m in methods:
            for r in sorted(_rows(report, m, b), key=lambda r: r["k"]):
                lines.append(f"| {METHOD_LABELS[m]} | {r['k']}{' ★' if r.get('best_k') else ''} | {_fmt_tau(r)} | "
                             f"{fmt(r['acceptance_rate'], '.3f')} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['speedup'], '.2f', 'x')} | "
                             f"{_fmt_ms(r, 'draft')} | {_fmt_ms(r, 'verify')} |")
        lines += [f"| plain target | - | {plain.get('tau', 1.0):.3f} | - | {fmt(plain['tokens_per_s'], '.1f')} | 1.00x | "
                  f"- | {_fmt_ms(plain, 'verify')} |", ""]
    lines += [f"## Counts (batch size {head['batch_size']}, K={head['k']})", "",
              "accepted & emitted <= accepted (accepted drafts after a stop token or max_new_tokens are not emitted).",
              "", "| method | steps | drafted | accepted | accepted & emitted | emitted |", "|---|---|---|---|---|---|"]
    for m in methods:
        s = report[m]
        lines.append(f"| {m} | {s.get('steps', '-')} | {s.get('drafted', '-')} | {s.get('accepted', '-')} | "
                     f"{s.get('accepted_emitted', '-')} | {s.get('emitted', '-')} |")
    hy = report.get("hybrid")
    if hy is not None and hy.get("proposals"):
        c = hy["proposals"]
        lines += ["", f"hybrid: {c.get('suffix', 0)} drafts from the suffix tree (match >= "
                      f"{report.get('hybrid_min_match')} tokens), {c.get('drafter', 0)} from the drafter"
                      + (f" (at most {report['hybrid_drafter_k']} drafts per step)." if report.get("hybrid_drafter_k")
                         else ".")]
    lines += _serving_markdown(report)
    lines += _by_source_markdown(report)
    lines += _gating_markdown(report)
    lines += _break_even_markdown(report)
    lines += _precision_markdown(report)
    kmax, b1 = max(ks), report["batch_sizes"][0]
    lines += ["", f"## Per-position acceptance (batch size {b1}, K={kmax})", "",
              "acc_k = P(draft k accepted | draft k proposed); cond acc_k = P(draft k accepted | drafts 1..k-1 "
              "accepted).", "", "| position | " + " | ".join(str(i + 1) for i in range(kmax)) + " |",
              "|---|" + "---|" * kmax]
    for m in methods:
        r = _rows(report, m, b1, kmax)[0]
        lines.append(f"| {m} acc_k | " + " | ".join(fmt(x, '.3f') for x in r["per_position"]) + " |")
        lines.append(f"| {m} cond acc_k | " + " | ".join(fmt(x, '.3f') for x in r["conditional"]) + " |")
    lines.append("")
    for key, alt in (("per_position", "per-position acceptance"), ("tau_vs_k", "tau and speedup vs K")):
        if plots and plots.get(key):
            lines += [f"![{alt}]({plots[key]})", ""]
    lines += (report.get("trees") or {}).get("markdown", [])  # rendered by speculators.evaluation.trees (a data block)
    if report.get("compare"):
        lines += ["## Compare (same prompts and settings)", "", compare_markdown(report["compare"]["rows"])]
    greedy = greedy_lines(report)
    lines += greedy[:1] + ([""] if len(greedy) > 1 else []) + greedy[1:]
    return "\n".join(lines) + "\n"


def compare_markdown(rows: list[dict]) -> str:
    """The rows of :func:`compare_rows` as one Markdown table."""
    def ms(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["| checkpoint | method | batch | K | tau [95% CI] | acceptance rate | tokens/s | speedup | draft ms/step "
             "| verify ms/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {METHOD_LABELS[r['method']]} | {r['batch_size']} | "
                     f"{r['k']}{' ★' if r['best_k'] else ''} | {_fmt_tau(r)} | {fmt(r['acceptance_rate'], '.3f')} | "
                     f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['speedup'], '.2f', 'x')} | {ms(r.get('draft_ms_per_step'))} | "
                     f"{ms(r.get('verify_ms_per_step'))} |")
    return "\n".join(lines) + "\n"


def render_terminal(report: EvalReport, console) -> None:
    """Print the report on a ``rich`` console: one table per batch size (a row per method and K, ★ on
    each method's best K), per-position acceptance at batch 1 and the largest K, the serving-conventions
    table (temperature > 0), the compare table, the confidence-gating table, the cost model's break-even
    table, the batch-1 rows against the fastest plain decoding of two precisions and the losslessness line."""
    from rich.table import Table

    if report.get("dtype_warning"):
        console.print(f"warning: {report['dtype_warning']}", style="bold yellow", markup=False, highlight=False)
    for b in report["batch_sizes"]:
        plain = next(p for p in report["plain_rows"] if p["batch_size"] == b)
        t = Table(title=f"batch size {b} (temperature {report['temperature']}, {report['num_prompts']} prompts; "
                        f"speedup vs plain at batch {b})")
        for col in ("method", "K", "tau [95% CI]", "acc. rate", "tokens/s", "speedup"):
            t.add_column(col)
        for m in report["methods"]:
            for r in sorted(_rows(report, m, b), key=lambda r: r["k"]):
                t.add_row(METHOD_LABELS[m], f"{r['k']}{' ★' if r['best_k'] else ''}", _fmt_tau(r),
                          fmt(r["acceptance_rate"], ".3f"), fmt(r["tokens_per_s"], ".1f"), fmt(r["speedup"], ".2f", "x"))
        t.add_row("plain", "-", "1.000", "-", fmt(plain["tokens_per_s"], ".1f"), "1.00x")
        console.print(t)
    console.print(TAU_DEFINITION, markup=False, highlight=False)
    kmax, b1 = max(report["ks"]), report["batch_sizes"][0]
    p = Table(title=f"per-position acceptance (batch {b1}, K={kmax})")
    p.add_column("")
    for i in range(kmax):
        p.add_column(str(i + 1))
    for m in report["methods"]:
        r = _rows(report, m, b1, kmax)[0]
        p.add_row(f"{m} acc_k", *[fmt(x, ".3f") for x in r["per_position"]])
        p.add_row(f"{m} cond acc_k", *[fmt(x, ".3f") for x in r["conditional"]])
    console.print(p)
    sc = report.get("serving_conventions")
    if sc:
        t = Table(title=f"tau under vLLM's draft_sample_method (temperature {sc['temperature']}, batch "
                        f"{sc['batch_size']}, K={sc['k']}; both lossless)")
        for col in ("vLLM --speculative-config", "tau [95% CI]", "acc. rate", "tokens/s", "speedup"):
            t.add_column(col)
        for r in sc["rows"]:
            t.add_row(r["engine_setting"], _fmt_tau(r), fmt(r["acceptance_rate"], ".3f"), fmt(r["tokens_per_s"], ".1f"),
                      fmt(r["speedup"], ".2f", "x"))
        console.print(t)
    if report.get("compare"):
        c = Table(title="compare (same prompts and settings)")
        for col in ("checkpoint", "method", "batch", "K", "tau [95% CI]", "acc. rate", "tokens/s", "speedup"):
            c.add_column(col)
        for r in report["compare"]["rows"]:
            c.add_row(r["checkpoint"], METHOD_LABELS[r["method"]], str(r["batch_size"]),
                      f"{r['k']}{' ★' if r['best_k'] else ''}", _fmt_tau(r), fmt(r["acceptance_rate"], ".3f"),
                      fmt(r["tokens_per_s"], ".1f"), fmt(r["speedup"], ".2f", "x"))
        console.print(c)
    g = report.get("gating")
    if g:
        t = Table(title=f"confidence-gated verification (threshold {g['threshold']}"
                        f"{', cost-aware' if g['cost_aware'] else ''}; drafts per step proposed / verified)")
        for col in ("drafter", "batch", "K", "tau [95% CI]", "drafted/step", "verified/step", "acc. rate",
                    "tokens/s", "speedup"):
            t.add_column(col)
        gated = {(r["batch_size"], r["k"]): r for r in report.get("gated_rows", [])}
        for r in sorted(_rows(report, "drafter"), key=lambda r: (r["batch_size"], r["k"])):
            for label, row in (("ungated", r), ("gated", gated.get((r["batch_size"], r["k"])))):
                if row is not None:
                    t.add_row(label, str(r["batch_size"]), str(r["k"]), _fmt_tau(row),
                              fmt(row["drafted_per_step"], ".2f"), fmt(row["verified_per_step"], ".2f"),
                              fmt(row["acceptance_rate"], ".3f"), fmt(row["tokens_per_s"], ".1f"),
                              fmt(row["speedup"], ".2f", "x"))
        console.print(t)
    if report.get("cost_model"):
        t = Table(title="cost model: predicted vs measured tokens/s, best K' and break-even batch size "
                        f"(largest |error| {fmt(report['cost_model']['max_abs_relative_error'], '.1%')})")
        for col in BREAK_EVEN_COLUMNS:
            t.add_column(col)
        for row in break_even_rows(report):
            t.add_row(*row)
        console.print(t)
    pb = report.get("precision_baseline")
    if pb:
        plain = ", ".join(f"{d} {fmt(v, '.1f')}" for d, v in pb["plain_tokens_per_s"].items())
        t = Table(title=f"batch 1 against the fastest plain decoding (plain tok/s: {plain}; fastest {pb['fastest']})")
        for col in ("method", "K", "tokens/s", "x fastest plain"):
            t.add_column(col)
        for r in pb["rows"]:
            t.add_row(METHOD_LABELS.get(r["method"], r["method"]), str(r["k"]), fmt(r["tokens_per_s"], ".1f"),
                      fmt(r["speedup_vs_fastest_plain"], ".2f", "x"))
        console.print(t)
    for line in greedy_lines(report):
        console.print(line, markup=False, highlight=False)


def render_json(report: EvalReport) -> str:
    """``report.json``: the report as indented JSON (``None`` as ``null``)."""
    return json.dumps(report, indent=2)
