"""Acceptance statistics and reports from real speculative generation.

The prompts are decoded through the batched loop (:func:`speculators.decode.loop.speculative_generate`)
at batch size 1 and at the chosen batch size: plainly (once per batch size), then for every K of the
sweep with the drafter, the n-gram (prompt lookup) proposer, suffix decoding and the hybrid proposer
(:mod:`speculators.decode.proposers`). Reported (ALGORITHMS.md, "Acceptance metrics"): tau (mean
acceptance length, bonus included), acceptance rate (verifier-accepted / drafted, with ``accepted`` and
``accepted_emitted`` counts beside it), per-position acceptance
``acc_k = P(draft k accepted)``, conditional per-position acceptance, tokens/s of each method and the
speedup over plain decoding at the same batch size, tau's 95% bootstrap confidence interval over
prompts, drafting and verifying time per decoding step (ms), tau per prompt source (``by_source``),
with a confidence threshold the drafter's confidence-gated rows beside its ungated ones (drafted and
verified drafts per step), and at temperature 0 every prompt whose output differs from plain greedy
decoding (must be none: lossless). :func:`write_report` writes ``report.json``, ``report.md`` and two PNG plots.
The report's typed shape (:class:`speculators.evaluation.report.EvalReport`) and every rendering of it (terminal,
Markdown, JSON, plots) live in :mod:`speculators.evaluation.report`.

Every decode stops at the first stop token (the target's stop ids: tokenizer EOS, ``generation_config``
EOS ids, chat-template end-of-turn) and at ``max_new_tokens``; tau, tokens and tokens/s count only the
tokens that were emitted, never tokens a step verified after the stop (see :class:`AcceptanceStats`
for every definition).
"""

from __future__ import annotations

from pathlib import Path

from .acceptance import AcceptanceStats, bootstrap_tau_ci
from .cost_model import cost_model_block, step_times
from .costs import eval_context, measure_costs
from ..errors import SpeculatorsError
from .costs import measure_pass_costs
from .plots import write_plots
from .report import ENGINE_SETTINGS, TAU_DEFINITION, EvalReport, render_json, render_markdown
from .settings import DRAFTER_METHODS, EvalSettings, PassKey
from .greedy_check import classify_mismatches, first_diff, greedy_summary
from ..utils import atomic_dir




def draft_sample_method(method: str, temperature: float) -> str | None:
    """vLLM's ``draft_sample_method`` that reproduces ``method``'s drafts at ``temperature``:
    ``"probabilistic"`` (drafts sampled from the drafter and verified against its distribution:
    ``drafter`` and the hybrid's drafter part), ``"greedy"`` (argmax drafts verified as point masses:
    ``drafter_argmax``), or None where the setting makes no difference (temperature 0, where every
    verification is greedy, and the model-free ``ngram`` / ``suffix``)."""
    if temperature == 0.0 or method not in ENGINE_SETTINGS:
        return None
    return "greedy" if method == "drafter_argmax" else "probabilistic"


def default_batch_size(device: str | None) -> int:
    """The eval's default ``--batch-size``: 16 on CUDA, 8 elsewhere (``device`` None = CUDA when present)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return 16 if str(device).startswith("cuda") else 8


def _generate(target, proposer, prompt_ids: list[list[int]], k: int, max_new_tokens: int, st: EvalSettings,
              batch_size: int, stop: set[int], progress=None, gate=None, tree=None):
    """One decode pass of every prompt through the batched loop: the
    :class:`speculators.decode.state.BatchResult` (results in prompt order, wall seconds, drafting and
    verifying seconds, batched steps).

    Prompt ``i`` draws from its own generator seeded with ``seed + i`` (so its output does not depend
    on the batch it ran in); ``proposer=None`` is plain decoding through the same loop; ``gate``: a
    :class:`speculators.decode.gating.ConfidenceGate` (confidence-gated verification) or None; ``tree``: a
    :class:`speculators.decode.tree_spec.TreeSpec` (draft trees instead of chains) or None.
    """
    from ..decode.loop import speculative_generate
    from ..verify import SamplingParams

    sampling = SamplingParams.uniform(len(prompt_ids), st.temperature, st.top_k, st.top_p)
    return speculative_generate(target, proposer, prompt_ids, k, max_new_tokens, sampling,
                                batch_size, eos_ids=stop, seeds=[st.seed + i for i in range(len(prompt_ids))],
                                progress=progress,
                                gate=gate, tree=tree)


def _source_blocks(prompts: list[dict], results: list, k: int, resamples: int, seed: int) -> dict[str, dict]:
    """Per prompt source (``prompt["source"]``; ``"prompts"`` when unlabelled), in order of first
    appearance: the :meth:`AcceptanceStats.as_dict` block of that source's prompts (``seconds`` and
    ``tokens_per_s`` left out: requests of a batch share their wall time) with ``tau_ci`` (bootstrap
    over that source's prompts) and ``num_prompts``."""
    groups: dict[str, list] = {}
    for p, r in zip(prompts, results):
        groups.setdefault(str(p.get("source") or "prompts"), []).append(r)
    out = {}
    for name, rs in groups.items():
        st = AcceptanceStats(k)
        for r in rs:
            st.add(r)
        block = {key: v for key, v in st.as_dict().items() if key not in ("seconds", "tokens_per_s")}
        block["tau_ci"] = list(bootstrap_tau_ci([sum(r.emitted) for r in rs], [len(r.emitted) for r in rs],
                                                resamples, seed))
        out[name] = {"num_prompts": len(rs), **block}
    return out


def run_eval(target, drafter, prompts: list[dict], settings: EvalSettings, *, forward_costs: dict | None = None,
             log=print, progress=None) -> dict:
    """Decode every prompt plainly and with every proposer, for every K and batch size; return the report.

    For each batch size ``b`` in ``[1, batch_size]`` (continuous batching:
    :func:`speculators.decode.loop.speculative_generate`), plain decoding runs ONCE (the baseline at that
    batch size), then every method of ``methods`` runs for every K of ``k``: ``drafter`` (the neural
    drafter), ``drafter_argmax`` (the same drafter under vLLM's default ``draft_sample_method: greedy``:
    argmax drafts verified as point masses, :class:`speculators.decode.proposers.ArgmaxDrafts`; added
    automatically beside ``drafter`` at temperature > 0, where ``drafter``'s rows are vLLM's
    ``draft_sample_method: probabilistic``), ``ngram`` (:class:`speculators.decode.proposers.NGramProposer`, prompt lookup), ``suffix``
    (:class:`speculators.decode.proposers.SuffixProposer`, suffix decoding) and ``hybrid``
    (:class:`speculators.decode.proposers.HybridProposer`: the suffix draft where its match has at least
    ``hybrid_min_match`` tokens, the drafter elsewhere). Every decode of a prompt stops on the same stop
    ids (``eos_ids``, default the target's :func:`speculators.decode.inputs.resolve_stop_ids`) and at
    ``max_new_tokens``; every count is of emitted tokens (see :class:`AcceptanceStats`).

    Per row (method, K, batch size): :meth:`AcceptanceStats.as_dict` with ``seconds`` the wall time of
    the whole pass (so ``tokens_per_s`` is the throughput at that batch size), ``tau_ci`` (95%
    bootstrap CI over prompts, :func:`bootstrap_tau_ci` with ``seed``), ``speedup`` (tokens/s over
    plain decoding's at the SAME batch size), ``best_k`` (True on the K with the best speedup of
    that method and batch size), and the pass's time split (:class:`speculators.decode.state.BatchResult`):
    ``draft_seconds`` / ``verify_seconds`` (proposer ``propose`` + ``advance``; target forwards +
    rejection sampling), ``batched_steps`` (batched target forwards) and ``draft_ms_per_step`` /
    ``verify_ms_per_step`` (milliseconds per batched decoding step; plain rows have both, with
    drafting 0). Prompts may carry a ``"source"`` name (``speculators eval --prompts A --prompts B``,
    or the recipe's sources for the held-out split): ``by_source`` breaks the headline rows down by it.
    At temperature 0 every output is compared with plain greedy decoding at batch 1 (plain at
    ``batch_size`` included): ``greedy_mismatches`` lists each difference, classified after the passes
    (:func:`speculators.evaluation.greedy_check.classify_mismatch`: ``near_tie`` where, in a low-precision dtype, the
    two tokens' logits at the first diverging position are within rounding; else a verifier failure), and
    ``greedy_check`` counts them per proposer (:func:`speculators.evaluation.greedy_check.greedy_summary`; ``passed``
    when no mismatch is a failure; every mismatch is a failure in float32). Every row names the vLLM
    ``draft_sample_method`` it holds under (``draft_sample_method``: None where it makes no difference);
    at temperature > 0 ``serving_conventions`` (:func:`serving_conventions`) puts the drafter's two
    conventions side by side.

    Args:
        target: :class:`speculators.target.Target`. drafter: a batched proposer (a drafter family);
            None only when ``settings.methods`` has neither ``drafter`` nor ``hybrid``.
        prompts: ``[{"id", "input_ids"}]`` rendered prompts, optionally with ``"source"`` (a name).
        settings: :class:`speculators.evaluation.settings.EvalSettings` (K sweep, sampling, batch size,
            methods, stop ids, gate, trees, ...).
        forward_costs: the target's forward costs measured once for the eval
            (:func:`speculators.evaluation.costs.measure_costs`); None = measured here after the passes.
        log: called with each progress line. progress: ``progress(done, total)`` in prompts decoded over all
            passes.
    Returns:
        A JSON-serialisable report: ``num_prompts``, ``ks``, ``batch_size``, ``batch_sizes``,
        ``methods``, ``rows`` (one dict per method, K and batch size, with ``method``, ``k``,
        ``batch_size``), ``plain_rows`` (one per batch size), ``best_k`` (``{batch: {method: K}}``,
        string keys), sampling values, ``stop_token_ids``, ``greedy_mismatches`` and ``greedy_check`` (None when sampling)
        and the HEADLINE (the largest batch size and the drafter's best K there; the first method's
        when there is no drafter): ``k``, one block per method (``report["drafter"]`` ...),
        ``plain``, ``speedup`` (the drafter's) and ``<method>_speedup``; ``by_source``:
        ``{source: {method: {k, batch_size, num_prompts, tau, tau_ci, acceptance_rate, per_position,
        conditional, steps, emitted, drafted, accepted, accepted_emitted, tokens}}}`` at the headline
        batch size and K, sources in order of first appearance (one entry ``"prompts"`` when the
        prompts carry no ``source``).
    Raises:
        SpeculatorsError: no prompts; a drafter method without a drafter; a bad ``verify_cost``.

    Confidence-gated verification (DSpark; ``confidence_threshold`` and/or ``verify_cost``, see
    :class:`speculators.decode.gating.ConfidenceGate`): the drafter is decoded a second time for every K and
    batch size with the gate; those rows (same keys as ``rows``, plus ``gated: True``) go to
    ``report["gated_rows"]`` and ``report["gating"]`` holds ``{"threshold", "cost_aware", "verify_cost",
    "confidences" (whether the drafter reported any), "headline": {"ungated": row, "gated": row}}`` at the
    headline batch size and K. Gated outputs join the greedy losslessness check (``proposer:
    "drafter (gated)"``). Without them both keys are absent.

    ``cost_model`` (:func:`speculators.evaluation.cost_model.cost_model_block`): predicted vs measured tokens/s, best K'
    and break-even batch size from ``forward_costs`` (:func:`speculators.evaluation.costs.measure_costs`; measured
    after the passes when None); rows carry ``prefill_seconds`` and ``forward_seconds`` for it. With
    ``adjacent_costs`` (default) the target forwards are also measured right before EVERY decode pass (plain,
    each method, K and batch size, gated and tree passes too) at that pass's batch size, over 1..max(K)+1
    tokens at ``forward_costs``' contexts (the eval's :func:`speculators.evaluation.costs.eval_context` when None),
    median of 3 (:func:`speculators.evaluation.costs.measure_pass_costs`; a few seconds a pass on a CPU): the row's
    ``pass_costs``, from which the cost model predicts that row (the machine's speed drifts over an eval; see
    :mod:`speculators.evaluation.cost_model`, "Adjacent costs"). False measures nothing per pass (the rows are then
    predicted from ``forward_costs``).

    Draft trees (``trees``: :class:`speculators.decode.tree_spec.TreeSpec` s; the drafter drafts a tree per step,
    :mod:`speculators.decode.tree`): ``report["trees"]`` (:func:`speculators.evaluation.trees.tree_block`) holds one row
    per tree and batch size beside the drafter's chain rows, the measured acceptance per depth and sibling rank,
    and the static tree (vLLM's ``speculative_token_tree``) with the best predicted tokens/s.
    """
    st = settings
    if drafter is None and set(DRAFTER_METHODS) & set(st.methods):
        raise SpeculatorsError("run_eval: the drafter and hybrid rows need a drafter")
    if not prompts:
        raise SpeculatorsError("run_eval: no prompts to decode")
    gate = st.gate()
    ev = _EvalPasses(target, prompts, st, total_passes=len(st.batch_sizes) * (
        1 + len(st.ks) * (len(st.methods) + (gate is not None)) + len(st.trees)), progress=progress)
    if st.adjacent_costs:
        ctx = forward_costs["context"] if forward_costs else eval_context(prompts, st.max_new_tokens)
        ev.cost_at = (max(st.ks), ctx, (forward_costs or {}).get("long_context"))
    proposers = _proposer_factory(drafter, st)
    ev.warm_up([proposers(m) for m in st.methods], max(st.ks))
    rows, plain_rows = [], []
    for b in st.batch_sizes:
        plain = ev.plain_row(b)
        plain_rows.append(plain)
        log(f"eval: batch {b}, plain decoding: {_num(plain['tokens_per_s'], '.1f')} tokens/s")
        for method in st.methods:
            for kk in st.ks:
                row = ev.method_row(PassKey(method, kk, b), proposers(method), plain["tokens_per_s"])
                rows.append(row)
                log(f"eval: batch {b}, {method} K={kk}: tau {row['tau']:.3f}, {_num(row['tokens_per_s'], '.1f')} "
                    f"tokens/s ({_num(row['speedup'], '.2f')}x), drafting {row['draft_ms_per_step']:.2f} ms/step")
    best_k = _mark_best_k(rows, st.batch_sizes, st.methods)
    head = {"batch_size": st.batch_sizes[-1], "k": best_k[str(st.batch_sizes[-1])][st.methods[0]]}
    report: EvalReport = {
        "num_prompts": len(prompts), "k": head["k"], "ks": st.ks, "batch_size": st.batch_size,
        "batch_sizes": st.batch_sizes, "max_new_tokens": st.max_new_tokens, "temperature": st.temperature,
        "top_p": st.top_p, "top_k": st.top_k, "seed": st.seed, "stop_token_ids": sorted(ev.stop),
        "methods": list(st.methods), "hybrid_min_match": st.hybrid_min_match, "hybrid_drafter_k": st.hybrid_drafter_k,
        "bootstrap": {"resamples": st.bootstrap_resamples, "level": 0.95, "seed": st.seed, "over": "prompts"},
        "rows": rows, "plain_rows": plain_rows, "best_k": best_k, "headline": head,
        "plain": next(p for p in plain_rows if p["batch_size"] == head["batch_size"]),
    }
    for method in st.methods:
        report[method] = row = _rows_of(rows, method, head["batch_size"], head["k"])[0]
        report["speedup" if method == "drafter" else f"{method}_speedup"] = row["speedup"]
    if gate is not None:
        _add_gating(report, ev, drafter, gate, log)
    if st.trees:  # before the greedy check: tree outputs are checked and classified with the chains'
        from .trees import tree_block

        report["trees"] = tree_block(ev, proposers("drafter"), st.trees, st.batch_sizes, report, log)
    report["greedy_mismatches"] = ev.classified() if st.temperature == 0.0 else None
    report["greedy_check"] = greedy_summary(report["greedy_mismatches"], str(target.dtype).removeprefix("torch."))
    if st.temperature > 0.0 and {"drafter", "drafter_argmax"} <= set(st.methods):
        report["serving_conventions"] = serving_conventions(report)
    costs = forward_costs or measure_costs(target, max(st.ks), st.batch_sizes,
                                           context=eval_context(prompts, st.max_new_tokens))
    report["cost_model"] = cost_model_block(report, ev.stats_of, ev.plain_tokens, costs)
    report["by_source"] = ev.by_source(st.methods, head)
    report["tau_definition"] = TAU_DEFINITION
    return report


def plain_baseline(target, prompts: list[dict], max_new_tokens: int, sampling=None, seed: int = 0,
                   eos_ids: set[int] | None = None) -> dict:
    """Plain decoding of ``prompts`` at batch 1 on ``target`` alone: the baseline of another precision beside
    an eval (the same target in float32 next to a bfloat16 eval, :func:`speculators.workflows.eval_run`), timed
    as :func:`run_eval` times its own plain rows (a discarded warm-up decode first).

    Args:
        target: a :class:`speculators.target.Target`. prompts, max_new_tokens, sampling, seed, eos_ids: as
            :func:`run_eval`.
    Returns:
        A plain row (:class:`speculators.evaluation.report.PlainRow` keys: ``tokens``, ``seconds``,
        ``tokens_per_s``, step times) with ``dtype``, the target's dtype name.
    Raises:
        SpeculatorsError: no prompts; ``sampling`` is not one request's valid ``SamplingParams``.
    """
    if not prompts:
        raise SpeculatorsError("plain_baseline: no prompts to decode")
    settings = EvalSettings(1, max_new_tokens, sampling, methods=("ngram",), seed=seed, eos_ids=eos_ids,
                            bootstrap_resamples=1)
    ev = _EvalPasses(target, prompts, settings, total_passes=1)
    ev.warm_up([], 0)
    return {**ev.plain_row(1), "dtype": str(target.dtype).removeprefix("torch.")}


def precision_block(report: dict, other: dict) -> dict:
    """The eval's batch-1 rows against the FASTER plain decoding of two precisions: the eval's own plain row
    (its dtype) and ``other`` (:func:`plain_baseline` in another dtype, e.g. float32 beside a bfloat16 eval on a
    CPU, where either may be faster). A speedup over a baseline that took no time is None (n/a).

    Args:
        report: a :func:`run_eval` report with ``target.dtype`` set (:func:`speculators.workflows.eval_run`).
        other: a :func:`plain_baseline` row.
    Returns:
        :class:`speculators.evaluation.report.PrecisionBaseline`: ``plain_tokens_per_s`` ``{dtype: tokens/s}``,
        ``fastest`` (the dtype of the faster plain decoding), ``rows`` (every batch-1 row: ``method``, ``k``,
        ``tokens_per_s``, ``speedup_vs_fastest_plain``).
    """
    own = next(p for p in report["plain_rows"] if p["batch_size"] == 1)
    plain = {report["target"]["dtype"]: own["tokens_per_s"], other["dtype"]: other["tokens_per_s"]}
    fastest = max(plain, key=lambda d: plain[d] or 0.0)
    best = plain[fastest]
    rows = [{"method": r["method"], "k": r["k"], "tokens_per_s": r["tokens_per_s"],
             "speedup_vs_fastest_plain": r["tokens_per_s"] / best if best and r["tokens_per_s"] is not None
             else None} for r in report["rows"] if r["batch_size"] == 1]
    return {"plain_tokens_per_s": plain, "fastest": fastest, "rows": rows}


def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else f"{x:{spec}}"


def _proposer_factory(drafter, st: EvalSettings):
    """``make(method)``: a fresh proposer of ``method`` for one pass (the drafter itself for ``drafter``)."""
    from ..decode.proposers import ArgmaxDrafts, HybridProposer, NGramProposer, SuffixProposer

    def make(method: str):
        if method == "drafter":
            return drafter
        if method == "drafter_argmax":
            return ArgmaxDrafts(drafter)
        if method == "ngram":
            return NGramProposer(max_n=st.ngram_max)
        if method == "suffix":
            return SuffixProposer()
        return HybridProposer(drafter, SuffixProposer(), min_match=st.hybrid_min_match, drafter_k=st.hybrid_drafter_k)

    return make


def _rows_of(rows: list, method: str, batch: int, k: int | None = None) -> list:
    return [r for r in rows if r["method"] == method and r["batch_size"] == batch and (k is None or r["k"] == k)]


def _mark_best_k(rows: list, batch_sizes: list[int], methods) -> dict[str, dict[str, int]]:
    """Set ``best_k`` on each method's row with the best speedup per batch size (ties and n/a speedups:
    the smaller K); ``{batch: {method: K}}`` with string keys."""
    best_k: dict[str, dict[str, int]] = {}
    for b in batch_sizes:
        for method in methods:
            best = max(_rows_of(rows, method, b),
                       key=lambda r: (r["speedup"] if r["speedup"] is not None else float("-inf"), -r["k"]))
            best["best_k"] = True
            best_k.setdefault(str(b), {})[method] = best["k"]
    return best_k


def _add_gating(report: dict, ev: "_EvalPasses", drafter, gate, log) -> None:
    """Decode with the drafter again under ``gate`` for every K and batch size: ``report["gated_rows"]``
    and ``report["gating"]`` (see :func:`run_eval`)."""
    gated_rows = []
    for b in report["batch_sizes"]:
        plain_tps = next(p for p in report["plain_rows"] if p["batch_size"] == b)["tokens_per_s"]
        for kk in report["ks"]:
            row = ev.method_row(PassKey("drafter", kk, b, gated=True), drafter, plain_tps, gate=gate)
            gated_rows.append(row)
            log(f"eval: batch {b}, drafter K={kk} gated: tau {row['tau']:.3f}, verified "
                f"{_num(row['verified_per_step'], '.2f')} of {_num(row['drafted_per_step'], '.2f')} drafts/step, "
                f"{_num(row['tokens_per_s'], '.1f')} tokens/s ({_num(row['speedup'], '.2f')}x)")
    head = report["headline"]
    confidences = any(r["proposed"] != r["drafted"] for r in gated_rows)
    report["gated_rows"] = gated_rows
    report["gating"] = {
        "threshold": gate.threshold, "cost_aware": gate.verify_cost is not None, "verify_cost": gate.verify_cost,
        "confidences": confidences,
        "headline": {"ungated": _rows_of(report["rows"], "drafter", head["batch_size"], head["k"])[0],
                     "gated": _rows_of(gated_rows, "drafter", head["batch_size"], head["k"])[0]}}
    if not confidences:
        log("eval: the drafter's proposals carry no confidence logits (or every draft was confident): "
            "gating left every proposal as it was")


class _EvalPasses:
    """The decode passes of one :func:`run_eval`: every pass decodes all prompts under the same sampling
    settings and stop ids; the first plain pass (batch 1) is the greedy reference every later output is
    compared with at temperature 0 (``mismatches``); the passes' results are kept per :class:`PassKey` for the
    per-source table and the cost model; ``progress(done, total)`` counts prompts over all passes. With
    ``cost_at`` = ``(k, context, long_context)`` set, the target forwards are measured right before every
    pass (:meth:`adjacent_costs`, the row's ``pass_costs``); None (default) measures nothing."""

    def __init__(self, target, prompts: list[dict], settings: EvalSettings, total_passes: int, progress=None):
        from ..decode.inputs import resolve_stop_ids

        self.target, self.prompts, self.settings = target, prompts, settings
        self.stop = resolve_stop_ids(target, settings.eos_ids)
        self.ids = [list(p["input_ids"]) for p in prompts]
        self.progress = progress
        self.total, self.done = len(self.ids) * total_passes, 0
        self.reference: list | None = None
        self.mismatches: list[dict] = []
        self._diverged: list[tuple[int, list[int], int]] = []  # per mismatch: (prompt index, output, K)
        self.results_of: dict[PassKey, list] = {}
        self.stats_of: dict[PassKey, AcceptanceStats] = {}  # the cost model's inputs (ungated chain passes)
        self.plain_tokens: dict[int, list[int]] = {}  # batch size -> tokens per prompt of its plain pass
        self.cost_at: tuple[int, int, int | None] | None = None

    def adjacent_costs(self, b: int) -> dict:
        """``{"pass_costs": the forward costs at batch size b}`` measured now, right before a pass
        (:func:`speculators.evaluation.costs.measure_pass_costs` at ``cost_at``); ``{}`` when ``cost_at`` is None."""
        if self.cost_at is None:
            return {}
        k, context, long_context = self.cost_at
        return {"pass_costs": measure_pass_costs(self.target, k, b, context, long_context)}

    def decode(self, proposer, k: int, b: int, gate=None, tree=None):
        """One pass of every prompt (:func:`_generate`), counted in ``progress``."""
        base = self.done
        prog = (lambda d, t: self.progress(base + d, self.total)) if self.progress else None
        out = _generate(self.target, proposer, self.ids, k, self.settings.max_new_tokens, self.settings, b, self.stop,
                        progress=prog, gate=gate, tree=tree)
        self.done += len(self.ids)
        if self.progress:
            self.progress(self.done, self.total)
        return out

    def warm_up(self, proposers: list, k: int) -> None:
        """Discarded decodes: the first decode of each kind pays one-off costs (allocator, kernel
        compilation: the Triton sampling and verifier kernels at temperature > 0 on CUDA, the drafter's
        first forward) that would otherwise be charged to the first measured pass (batch 1's plain
        baseline, which every speedup divides by) or to a method's first row. Same sampling settings as
        the measured passes, a few tokens of one prompt, plain and every method."""
        for proposer in (None, *proposers):
            _generate(self.target, proposer, self.ids[:1], 0 if proposer is None else k,
                      min(4, self.settings.max_new_tokens), self.settings, 1, self.stop)

    def _check(self, key: PassKey, results: list, forward_tokens: int | None = None) -> None:
        """Compare a pass's outputs with plain greedy's (temperature 0); ``forward_tokens - 1`` (default
        ``key.k``) is the draft count whose verify-forward shape the near-tie classification replays (a tree's
        node count: its forwards hold them all)."""
        if self.reference is None:
            self.reference = [r.tokens for r in results]  # plain greedy at batch 1: what every output must equal
        elif self.settings.temperature == 0.0:
            for i, (p, r, ref) in enumerate(zip(self.prompts, results, self.reference)):
                if r.tokens != ref:
                    self.mismatches.append({"prompt": p["id"], "proposer": key.label, "k": key.k,
                                            "batch_size": key.batch_size, "first_diff": first_diff(r.tokens, ref)})
                    self._diverged.append((i, list(r.tokens), key.k if forward_tokens is None else forward_tokens - 1))

    def classified(self) -> list[dict]:
        """``mismatches``, each with its near-tie classification (run after every timed pass)."""
        return classify_mismatches(self.target, self.ids, self.reference or [], self.mismatches, self._diverged)

    def plain_row(self, b: int) -> dict:
        """Plain decoding at batch size ``b`` (the baseline of that batch size's speedups)."""
        adjacent = self.adjacent_costs(b)
        out = self.decode(None, 0, b)
        plain = AcceptanceStats(1)
        for r in out.results:
            plain.add(r)
        plain.seconds = out.seconds
        self.plain_tokens[b] = [len(r.tokens) for r in out.results]
        self._check(PassKey("plain", 0, b), out.results)
        return {"batch_size": b, "tau": plain.tau, "steps": plain.steps, "tokens": plain.tokens,
                "seconds": out.seconds, "tokens_per_s": plain.tokens_per_s, **step_times(out), **adjacent}

    def method_row(self, key: PassKey, proposer, plain_tps: float | None, gate=None, tree=None) -> dict:
        """One pass of ``key.method`` at K ``key.k`` and batch size ``key.batch_size``: its report row (speedup
        over ``plain_tps``; ``gated: True`` under a gate; with ``tree`` (a TreeSpec) draft trees of depth
        ``key.k``: the row also has ``tree``, ``tree_label``, ``nodes_per_step`` and per-depth acceptance)."""
        k, b = key.k, key.batch_size
        adjacent = self.adjacent_costs(b) if tree is None else {}  # the cost model predicts chain rows only
        out = self.decode(proposer, k, b, gate, tree)
        res = out.results
        st = AcceptanceStats(k if tree is None else max(k, tree.total_tokens))
        for r in res:
            st.add(r)
        st.seconds = out.seconds
        temperature, resamples, seed = self.settings.temperature, self.settings.bootstrap_resamples, self.settings.seed
        row = {"method": key.method, "k": k, "batch_size": b, **({"gated": True} if key.gated else {}),
               "draft_sample_method": draft_sample_method(key.method, temperature), **st.as_dict(),
               "tau_ci": list(bootstrap_tau_ci([sum(r.emitted) for r in res], [len(r.emitted) for r in res],
                                               resamples, seed)),
               "speedup": st.tokens_per_s / plain_tps if plain_tps and st.tokens_per_s is not None else None,
               "best_k": False, **step_times(out), **adjacent}
        if hasattr(proposer, "counts"):
            row["proposals"] = dict(proposer.counts)  # hybrid: how many steps each part drafted
        self.results_of[key] = res
        if tree is not None:
            row.update(tree=tree.as_dict(), tree_label=tree.label, per_position=row["per_position"][:k],
                       conditional=row["conditional"][:k],
                       nodes_per_step=st.drafted / st.steps if st.steps else None)
            self._check(key, res, forward_tokens=tree.total_tokens + 1)
            return row
        if not key.gated:
            self.stats_of[key] = st
        self._check(key, res)
        return row

    def by_source(self, methods, head: dict) -> dict:
        """tau per prompt source at the headline batch size and K (one entry per ``--prompts`` source)."""
        out: dict[str, dict] = {}
        for method in methods:
            blocks = _source_blocks(self.prompts, self.results_of[PassKey(method, head["k"], head["batch_size"])],
                                    head["k"], self.settings.bootstrap_resamples, self.settings.seed)
            for name, block in blocks.items():
                out.setdefault(name, {})[method] = {"k": head["k"], "batch_size": head["batch_size"], **block}
        return out


def serving_conventions(report: dict) -> dict:
    """The drafter under vLLM's two ``draft_sample_method`` settings at the report's temperature (> 0),
    at the headline batch size and K: ``{"temperature", "batch_size", "k", "rows": [{"method",
    "draft_sample_method", "engine_setting", "tau", "tau_ci", "acceptance_rate", "per_position",
    "tokens_per_s", "speedup"}]}``, vLLM's default (argmax drafts) first.

    Users read tau as what they will get when they serve the drafter; which of the two it is depends
    on this engine setting (:data:`ENGINE_SETTINGS`, :class:`speculators.decode.proposers.ArgmaxDrafts`).

    Raises:
        SpeculatorsError: the report has no ``drafter`` and ``drafter_argmax`` rows at its headline.
    """
    head = report["headline"]
    rows = []
    for method in ("drafter_argmax", "drafter"):
        r = next((r for r in report["rows"] if r["method"] == method and r["batch_size"] == head["batch_size"]
                  and r["k"] == head["k"]), None)
        if r is None:
            raise SpeculatorsError(f"serving_conventions: the report has no {method} row at batch size "
                                   f"{head['batch_size']}, K={head['k']}")
        rows.append({"method": method, "draft_sample_method": draft_sample_method(method, report["temperature"]),
                     "engine_setting": ENGINE_SETTINGS[method],
                     **{f: r[f] for f in ("tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s",
                                          "speedup")}})
    return {"temperature": report["temperature"], "batch_size": head["batch_size"], "k": head["k"], "rows": rows}



def write_report(report: dict, output: str | Path, title: str = "speculators eval") -> Path:
    """Write ``report.json``, the two PNG plots (:func:`write_plots`) and ``report.md`` (embedding them
    with relative links) into ``output``, atomically replaced. Sets ``report["plots"]``."""
    with atomic_dir(output, overwrite=True) as tmp:
        if report.get("rows"):  # a report of run_eval (anything else has nothing to plot)
            report["plots"] = write_plots(report, tmp)
        (tmp / "report.json").write_text(render_json(report))
        (tmp / "report.md").write_text(render_markdown(report, title))
    return Path(output)


def compare_rows(reports: list[tuple[str, dict]]) -> list[dict]:
    """One row per checkpoint, batch size and K of the drafter (drafter_argmax, hybrid) rows of several reports on the
    same prompts, then the model-free baselines of the first report: ``{"checkpoint", "method", "batch_size",
    "k", "tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s", "speedup", "best_k",
    "draft_ms_per_step", "verify_ms_per_step"}`` (the last two None in reports written before they existed).

    Raises:
        SpeculatorsError: the reports were not made on the same prompts / settings (``num_prompts``,
            ``max_new_tokens``, sampling values differ).
    """
    keys = ("num_prompts", "max_new_tokens", "temperature", "top_p", "top_k", "prompts")
    first = reports[0][1]
    for label, rep in reports[1:]:
        diff = [k for k in keys if rep.get(k) != first.get(k)]
        if diff:
            raise SpeculatorsError(f"--compare: {label} was evaluated with other {', '.join(diff)} than "
                                   f"{reports[0][0]}; compare checkpoints on the same prompts and settings")
    out = []
    fields = ("method", "batch_size", "k", "tau", "tau_ci", "acceptance_rate", "per_position", "tokens_per_s",
              "speedup", "best_k")
    for i, (label, rep) in enumerate(reports):
        for r in rep["rows"]:
            if r["method"] in DRAFTER_METHODS or i == 0:
                out.append({"checkpoint": label if r["method"] in DRAFTER_METHODS else "-",
                            **{f: r[f] for f in fields},
                            **{f: r.get(f) for f in ("draft_ms_per_step", "verify_ms_per_step")}})
    return out


