"""The engine eval in vLLM: our drafter, plain decoding and vLLM's own ``ngram`` measured inside vLLM itself.

``speculators eval RUN --engine vllm``. One worker process (:mod:`.vllm_runner`) serves the target and runs, each
as its own engine on the same prompts at temperature 0 (:func:`run_vllm_eval`):

1. one request at a time: plain decoding, the drafter at every K of ``ks`` (``num_speculative_tokens``), vLLM's
   ``ngram`` (prompt lookup) at every K;
2. at every ``concurrency`` > 1 (requests kept in flight by vLLM's continuous batching): plain, the drafter at the
   fastest K of step 1, ``ngram`` at its fastest K.

Rows follow the llama.cpp engine eval's (:mod:`.llamacpp_eval`: ``method``, ``k``, ``batch_size`` (= requests in
flight), ``tau``, ``tau_ci``, ``tokens_per_s``, ``speedup``, ``drafted``, ``accepted``) with ``engine: "vllm"``.
Counts are vLLM's own: its per-request record (``--per-request-spec-decode-metrics detailed``: accepted and drafted
per verify step that drafted) and its Prometheus counters (``vllm:spec_decode_num_accepted_tokens_per_pos``, ...),
reported beside. **tau is converted to our definition**: generated tokens after the first (the prefill's) over
ALL decode steps, those where ``ngram`` found no match and drafted nothing included; vLLM's "mean acceptance
length" (``1 + accepted / drafting steps``) counts drafting steps only, which flatters a proposer that drafts
rarely (it is reported as ``vllm_mean_acceptance_length``). ``tokens_per_s`` is generated tokens over the pass's
wall time (prompt processing included, as a client sees it); ``ms_per_step`` is vLLM's first-to-last-token time over
the decode steps (engine-core timestamps), which gives the break-even tau (a speculative step's ms over a plain
token's ms, :func:`timings`).

Greedy losslessness (:func:`greedy_check`): every other output (speculative passes, and plain decoding with
several requests in flight) must equal vLLM's plain one-request output token for token, or its first difference must sit on a near-tie of the target's logits AS vLLM COMPUTES THEM: the
engine's own top log-probabilities at that position from a one-token-at-a-time decode (plain decoding's shape) and
from one prefill forward over the prefix (a many-token forward, a verify step's shape); near-tie when the gap of
the two tokens in the decode shape is within :data:`NEAR_TIE_FACTOR` times how much the shapes move it (as
:func:`.llamacpp_eval.classify_engine_mismatch`). In float32 vLLM's outputs are expected equal; in bfloat16 a
verify forward rounds differently from a decode forward, and every difference is classified.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from ..errors import SpeculatorsError
from ..evaluation.acceptance import bootstrap_tau_ci
from . import vllm_runner
from ..evaluation.greedy_check import first_diff
from .llamacpp_eval import N_PROBS, NEAR_TIE_FACTOR, _fmt, loop_comparison_lines, row_cells

ENGINE = "vllm"
#: the K values measured when none are given (within the drafter's cap)
DEFAULT_KS = (1, 2, 3, 4)
#: vLLM's ngram proposer: the longest / shortest n-gram it matches in the context (vLLM's defaults)
NGRAM = {"prompt_lookup_max": 3, "prompt_lookup_min": 2}


@dataclasses.dataclass
class VllmEvalSettings:
    """What :func:`run_vllm_eval` sweeps. ``ks``: drafts per step (None: :data:`DEFAULT_KS` within the drafter's
    cap); ``concurrency``: requests in flight (must include 1); ``dtype``: vLLM's ``--dtype`` (None: the checkpoint's
    training dtype); ``ngram``: also measure vLLM's ``ngram`` proposer."""

    ks: tuple[int, ...] | None = None
    concurrency: tuple[int, ...] = (1, 4)
    max_new_tokens: int = 128
    dtype: str | None = None
    ngram: bool = True

    def __post_init__(self):
        if self.ks is not None and (not self.ks or any(int(k) < 1 for k in self.ks)):
            raise SpeculatorsError(f"vLLM eval: K values (-k) {list(self.ks)} must be >= 1")
        if 1 not in self.concurrency or any(int(c) < 1 for c in self.concurrency):
            raise SpeculatorsError(f"vLLM eval: requests in flight (--slots) {list(self.concurrency)} must include 1 "
                                   "and be >= 1")
        if int(self.max_new_tokens) < 1:
            raise SpeculatorsError(f"vLLM eval: max new tokens (--max-new-tokens) {self.max_new_tokens} must be >= 1")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise SpeculatorsError(f"vLLM eval: dtype {self.dtype!r}: allowed float32, bfloat16, float16")


def _steps(out: vllm_runner.Output) -> tuple[int, int, int, int]:
    """``(emitted tokens after the first, decode steps, drafted, accepted)`` of one request: the decode steps as the
    worker counted them (engine steps that appended tokens, drafting or not), drafted and accepted from vLLM's
    per-request record, a step cut at the end counting the drafts it emitted (as our loop's
    ``GenerationResult.accepted``: ``min(accepted, emitted)``).

    Raises:
        SpeculatorsError: the worker did not count the request's steps.
    """
    n = len(out.token_ids)
    if out.decode_steps is None:
        raise SpeculatorsError("vLLM eval: the worker did not count the decode steps of a request")
    acc = out.per_step_accepted or []
    if acc and len(acc) == out.decode_steps:  # every step drafted: the tokens each step emitted are known
        accepted, left = 0, max(0, n - 1)
        for a in acc:
            e = min(int(a) + 1, left)
            accepted, left = accepted + min(int(a), e), left - e
    else:  # steps without drafts are interleaved (ngram): vLLM's record, a last cut step's surplus included
        accepted = min(sum(acc), max(0, n - 1))
    return max(0, n - 1), out.decode_steps, sum(out.per_step_drafted or []), accepted


def pass_row(label: str, method: str, k: int | None, batch: int, job: vllm_runner.Job) -> dict[str, Any]:
    """A report row from one ``generate`` job (module docstring). Ratios whose denominator is zero are None."""
    per = [_steps(o) for o in job.outputs]
    tokens = sum(len(o.token_ids) for o in job.outputs)
    emitted, steps = [p[0] for p in per], [p[1] for p in per]
    drafted, accepted = sum(p[2] for p in per), sum(p[3] for p in per)
    n_steps = sum(steps)
    lo, hi = bootstrap_tau_ci(emitted, steps)
    decode = [o.decode_seconds for o in job.outputs if o.decode_seconds is not None]
    timed = len(decode) == len(job.outputs)
    c = job.counters or {}
    d_steps = int(c.get("num_drafts") or 0)
    return {"engine": ENGINE, "label": label, "method": method, "k": k, "batch_size": batch, "temperature": 0.0,
            "num_prompts": len(job.outputs), "tokens": tokens, "seconds": job.wall_seconds,
            "tokens_per_s": tokens / job.wall_seconds if job.wall_seconds > 0 else None,
            "tau": sum(emitted) / n_steps if n_steps else None, "tau_ci": [lo, hi] if n_steps else None,
            "drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "steps": n_steps, "decode_seconds": sum(decode) if timed else None,
            "ms_per_step": (1000.0 * sum(decode) / n_steps) if timed and n_steps and batch == 1 else None,
            "max_in_flight": job.max_in_flight, "vllm_counters": c, "vllm_mean_acceptance_length":
                (1.0 + int(c.get("num_accepted_tokens") or 0) / d_steps) if d_steps else None,
            "speedup": None}


def _fastest(rows: list[dict], method: str, batch: int = 1) -> dict | None:
    cand = [r for r in rows if r["method"] == method and r["batch_size"] == batch and r["tokens_per_s"]]
    return max(cand, key=lambda r: r["tokens_per_s"]) if cand else None


def run_vllm_eval(target_dir, checkpoint: Path, spec: dict, prompts: list[list[int]], stop_ids: list[int],
                  st: VllmEvalSettings, dtype: str, ks: tuple[int, ...], python=None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every pass of the module docstring's plan, the speedups, the greedy check and the best setting.

    Args:
        target_dir: the target as vLLM loads it (:func:`.vllm_runner.vllm_target_dir`). checkpoint: the drafter
            directory. spec: its ``--speculative-config`` (``ServingFormat.vllm_speculative_config``; ``model`` and
            ``num_speculative_tokens`` are set here). prompts: token ids per prompt. stop_ids: the
            target's stop tokens. st: what to sweep; ``ks`` resolved. dtype: vLLM's ``--dtype``.
    Returns:
        ``{"engine", "vllm_version", "dtype", "settings", "rows", "greedy_check", "best", "threads", "cpus"}``.
    Raises:
        SpeculatorsError: no prompts, vLLM refusing the target or the drafter.
    """
    if not prompts:
        raise SpeculatorsError("vLLM eval: no prompts")
    need = max(len(p) for p in prompts) + st.max_new_tokens + max(ks) + 8
    mml = vllm_runner.fit_context(target_dir, need)
    spec = {**spec, "model": str(Path(checkpoint).resolve())}
    job1 = vllm_runner.generate_job(prompts, st.max_new_tokens, stop_ids)
    engines = [vllm_runner.engine("plain", None, [job1], max_num_seqs=max(st.concurrency))]
    engines += [vllm_runner.engine(f"drafter k={k}", {**spec, "num_speculative_tokens": k}, [job1]) for k in ks]
    if st.ngram:
        engines += [vllm_runner.engine(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, **NGRAM}, [job1])
                    for k in ks]
    version, runs = vllm_runner.run_vllm(target_dir, engines, dtype=dtype, python=python, log=log, max_model_len=mml)
    failed = [r for r in runs if not r.ok]
    if failed:
        raise SpeculatorsError(f"vLLM refused {failed[0].label!r}: {failed[0].error}")
    rows, outputs = [], {}
    for r in runs:
        meth, _, kk = r.label.partition(" k=")
        rows.append(pass_row(r.label, meth, int(kk) if kk else None, 1, r.jobs[0]))
        outputs[r.label] = r.jobs[0].outputs
        log(f"vLLM eval: {r.label}: {_fmt(rows[-1]['tokens_per_s'], '.1f')} tok/s, tau {_fmt(rows[-1]['tau'], '.3f')}")
    best_d, best_n = _fastest(rows, "drafter"), _fastest(rows, "ngram")
    more = [c for c in st.concurrency if c > 1]
    if more:
        loaded = []
        for c in more:
            jc = vllm_runner.generate_job(prompts, st.max_new_tokens, stop_ids, concurrency=c)
            loaded.append(vllm_runner.engine(f"plain x{c}", None, [jc], max_num_seqs=c))
            loaded.append(vllm_runner.engine(f"drafter k={best_d['k']} x{c}",
                                             {**spec, "num_speculative_tokens": best_d["k"]}, [jc], max_num_seqs=c))
            if best_n is not None:
                loaded.append(vllm_runner.engine(f"ngram k={best_n['k']} x{c}", {
                    "method": "ngram", "num_speculative_tokens": best_n["k"], **NGRAM}, [jc], max_num_seqs=c))
        _, lruns = vllm_runner.run_vllm(target_dir, loaded, dtype=dtype, python=python, log=log, max_model_len=mml)
        for r in lruns:
            if not r.ok:
                raise SpeculatorsError(f"vLLM refused {r.label!r}: {r.error}")
            head, _, c = r.label.rpartition(" x")
            meth, _, kk = head.partition(" k=")
            rows.append(pass_row(r.label, meth, int(kk) if kk else None, int(c), r.jobs[0]))
            outputs[r.label] = r.jobs[0].outputs  # in the greedy check too: a batch's shape rounds differently
            log(f"vLLM eval: {r.label}: {_fmt(rows[-1]['tokens_per_s'], '.1f')} tok/s, tau {_fmt(rows[-1]['tau'], '.3f')}")
    for r in rows:
        base = next(b for b in rows if b["method"] == "plain" and b["batch_size"] == r["batch_size"])
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if r["tokens_per_s"] and base["tokens_per_s"] else None
    check = greedy_check(target_dir, prompts, outputs, dtype, python, mml, log)
    report = {"engine": ENGINE, "vllm_version": version, "dtype": dtype, "settings": dataclasses.asdict(st),
              "ks": list(ks), "num_prompts": len(prompts), "rows": rows, "greedy_check": check,
              "threads": runs[0].threads, "cpus": runs[0].cpus}
    failed_labels = {lab for lab, c in check["passes"].items() if c["failures"]}
    report["best"] = best_setting(rows, failed_labels)
    report["timings"] = timings(report)
    return report


def greedy_check(target_dir, prompts: list[list[int]], outputs: dict[str, list], dtype: str, python, mml: int,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every other pass's outputs against vLLM's plain one-request outputs (module docstring); mismatches
    classified through one more plain engine. Returns ``{"passes": {label: {"prompts", "mismatches", "near_tie",
    "failures"}}, "mismatches": [...], "near_tie", "failures", "passed"}``."""
    plain = [o.token_ids for o in outputs["plain"]]
    found = [(lab, i, o.token_ids) for lab, outs in outputs.items() if lab != "plain"
             for i, o in enumerate(outs) if o.token_ids != plain[i]]
    mism = [{"pass": lab, "prompt": i, **_classify_pending(plain[i], toks)} for lab, i, toks in found]
    if mism:
        _classify(target_dir, prompts, plain, mism, dtype, python, mml, log)
    by = {lab: {"prompts": len(prompts), "mismatches": 0, "near_tie": 0, "failures": 0} for lab in outputs if lab != "plain"}
    for m in mism:
        by[m["pass"]]["mismatches"] += 1
        by[m["pass"]]["near_tie" if m["near_tie"] else "failures"] += 1
    n_tie = sum(1 for m in mism if m["near_tie"])
    if mism:
        log(f"vLLM greedy check: {len(mism)} mismatch(es), {n_tie} on near-ties, {len(mism) - n_tie} failure(s)")
    return {"passes": by, "mismatches": mism, "near_tie": n_tie, "failures": len(mism) - n_tie,
            "passed": len(mism) == n_tie}


def _classify_pending(plain: list[int], out: list[int]) -> dict[str, Any]:
    j = first_diff(plain, out)
    return {"position": j, "plain_token": plain[j] if j < len(plain) else None,
            "output_token": out[j] if j < len(out) else None, "near_tie": False, "gap": None, "drift": None}


def _classify(target_dir, prompts, plain, mism: list[dict], dtype, python, mml, log) -> None:
    """Fill ``near_tie`` / ``gap`` / ``drift`` of each mismatch from vLLM's own log-probabilities: a decode of
    ``j + 1`` tokens with top log-probabilities (plain decoding's shape) and one prefill over ``prompt + plain[:j +
    1]`` (entry ``len(prompt) + j`` of its prompt log-probabilities: the next token after ``prompt + plain[:j]``)."""
    todo = [m for m in mism if m["plain_token"] is not None and m["output_token"] is not None]
    if not todo:
        return
    stops: list[int] = []
    jobs = []
    for m in todo:
        p, j = prompts[m["prompt"]], m["position"]
        jobs.append(vllm_runner.generate_job([p], j + 1, stops, logprobs=N_PROBS, warmup=False))
    jobs.append(vllm_runner.prompt_logprobs_job([prompts[m["prompt"]] + plain[m["prompt"]][:m["position"] + 1]
                                                 for m in todo], N_PROBS))
    _, runs = vllm_runner.run_vllm(target_dir, [vllm_runner.engine("plain-logprobs", None, jobs, max_num_seqs=1)],
                                   dtype=dtype, python=python, log=log, max_model_len=mml)
    if not runs[0].ok:
        raise SpeculatorsError(f"vLLM greedy check: the plain engine failed: {runs[0].error}")
    pre = runs[0].jobs[-1].outputs
    for idx, m in enumerate(todo):
        a, b, j, i = m["plain_token"], m["output_token"], m["position"], m["prompt"]
        seq_out = runs[0].jobs[idx].outputs[0]
        replayed = seq_out.token_ids[:j] == plain[i][:j]
        s = (seq_out.logprobs or [])[j] if seq_out.logprobs and len(seq_out.logprobs) > j else None
        f = pre[idx].prompt_logprobs[len(prompts[i]) + j] if pre[idx].prompt_logprobs else None
        m["replayed"] = replayed
        if not replayed or not s or not f or not all(t in d for t in (a, b) for d in (s, f)):
            continue
        gap, gap_f = s[a] - s[b], f[a] - f[b]
        drift = abs(gap - gap_f)
        m.update(gap=gap, prefill_gap=gap_f, drift=drift, near_tie=gap <= NEAR_TIE_FACTOR * drift)


def best_setting(rows: list[dict], failed: set[str] = frozenset()) -> dict[str, Any]:
    """The fastest drafter row at one request in flight against plain decoding and the fastest ``ngram`` there
    (passes whose greedy outputs failed the check are never chosen)."""
    at = [r for r in rows if r["batch_size"] == 1 and r["label"] not in failed]
    d, n = _fastest(at, "drafter"), _fastest(at, "ngram")
    plain = next(r for r in at if r["method"] == "plain")
    return {"row": d["label"] if d else None, "k": d["k"] if d else None,
            "tokens_per_s": d["tokens_per_s"] if d else None, "plain_tokens_per_s": plain["tokens_per_s"],
            "ngram_best": n["label"] if n else None, "ngram_tokens_per_s": n["tokens_per_s"] if n else None,
            "beats_plain": bool(d and d["tokens_per_s"] > plain["tokens_per_s"]),
            "beats_ngram": bool(d and (n is None or d["tokens_per_s"] > n["tokens_per_s"])),
            "fastest_overall": max(at, key=lambda r: r["tokens_per_s"] or 0)["label"]}


def timings(report: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's per-step costs behind the best drafter row: ms per plain decode step (one token), ms per speculative
    step, and the tau at which the drafter breaks even (their ratio). None when a count is missing."""
    rows = report["rows"]
    plain = next(r for r in rows if r["method"] == "plain" and r["batch_size"] == 1)
    best = next((r for r in rows if r["label"] == report["best"]["row"]), None)
    if best is None or not plain["ms_per_step"] or not best["ms_per_step"]:
        return None
    return {"target_ms_per_token": plain["ms_per_step"], "spec_ms_per_step": best["ms_per_step"], "tau": best["tau"],
            "break_even_tau": best["ms_per_step"] / plain["ms_per_step"]}


def render_markdown(report: dict[str, Any]) -> str:
    """The vLLM engine report as markdown."""
    lines = ["# speculators eval --engine vllm", "",
             f"vLLM {report['vllm_version']} ({report['dtype']}; its CPU worker ran {report.get('threads')} threads of "
             f"{report.get('cpus')} cores); {report['num_prompts']} prompts, {report['settings']['max_new_tokens']} new "
             f"tokens each, temperature 0; drafter `{report.get('checkpoint', '')}` (method `{report.get('method', '')}`).",
             "", "| pass | in flight | tok/s | x plain | tau [95% CI] | accepted / drafted | ms/step | vLLM mean AL |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        tau, acc = row_cells(r)
        lines.append(f"| {r['label']} | {r['batch_size']} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup'], '.2f')}"
                     f" | {tau} | {acc} | {_fmt(r['ms_per_step'], '.2f')} | {_fmt(r['vllm_mean_acceptance_length'], '.3f')} |")
    lines += loop_comparison_lines(report, "vLLM")
    g = report["greedy_check"]
    lines += ["", f"Greedy check (every speculative pass against vLLM's plain one-request output): "
                  f"{len(g['mismatches'])} mismatch(es), {g['near_tie']} on near-ties of vLLM's logits, "
                  f"{g['failures']} failure(s): {'PASS' if g['passed'] else 'FAIL'}."]
    b = report["best"]
    lines += ["", f"Best drafter setting: `{b['row']}` at {_fmt(b['tokens_per_s'], '.1f')} tok/s; plain "
                  f"{_fmt(b['plain_tokens_per_s'], '.1f')}; best ngram `{b['ngram_best']}` "
                  f"{_fmt(b['ngram_tokens_per_s'], '.1f')}; fastest overall `{b['fastest_overall']}`."]
    t = report.get("timings")
    if t:
        lines += ["", f"vLLM's step costs: a plain step {_fmt(t['target_ms_per_token'], '.2f')} ms per token; a "
                      f"speculative step at the best K {_fmt(t['spec_ms_per_step'], '.2f')} ms for tau "
                      f"{_fmt(t['tau'], '.2f')}; the drafter pays above tau {_fmt(t['break_even_tau'], '.2f')}"
                      f" ({'it does' if b['beats_plain'] else 'it does not'} here)."]
    if report.get("serve"):
        lines += ["", "Serve the best setting:", "", f"    {report['serve']}"]
    return "\n".join(lines) + "\n"


def serve_command(target_dir, checkpoint: Path, spec: dict, k: int, dtype: str, python: str = "python") -> str:
    """The command line that serves ``checkpoint`` for the target with K drafts per step: vLLM's OpenAI server as
    :class:`.vllm_server.VllmServer` starts it (``vllm serve`` with the GPU build takes the same arguments)."""
    import shlex

    from .vllm_server import SERVER_MODULE, server_args

    spec = {**spec, "model": str(checkpoint), "num_speculative_tokens": int(k)}
    return shlex.join([str(python), "-m", SERVER_MODULE, *server_args(target_dir, dtype=dtype, max_model_len=2048,
                                                                       speculative_config=spec)])


#: the vLLM engine eval's report directory under the run directory
REPORT_DIR = "eval-vllm"


def engine_eval(ckpt: Path, rec, settings: VllmEvalSettings, *, num_prompts: int, prompts: list[str] | None = None,
                target_model: str | None = None, output: str | Path | None = None, python=None,
                log: Callable[[str], None] = print) -> tuple[dict[str, Any], Path]:
    """``speculators eval RUN --engine vllm``: the drafter in ``ckpt`` measured inside vLLM (:func:`run_vllm_eval`) on
    the prompts ``speculators eval`` measures (the recipe's held-out prompts, at most ``num_prompts``, or the
    ``prompts`` sources), its tau set beside our loop's newest greedy report in the run directory; writes
    ``<run dir>/eval-vllm/`` (``report.json``, ``report.md``).

    Raises:
        SpeculatorsError: a family vLLM has no method for (the format's note says why), no vLLM venv, a K above the
            drafter's cap, no prompts, vLLM refusing the target or the drafter.
    """
    import json

    from ..decode.inputs import resolve_stop_ids
    from ..drafters import Drafter
    from ..evaluation.loading import eval_prompts
    from ..hardware import resolve_target_dtype
    from ..target import Target
    from .jobs import _loop_report
    from .llamacpp_eval import loop_comparison, write_engine_report
    from .vllm_env import ensure_vllm_python

    if rec is None and prompts is None:
        raise SpeculatorsError("no recipe in the checkpoint: pass --prompts SOURCE")
    cfg = json.loads((ckpt / "config.json").read_text())
    drafter = Drafter.from_pretrained(ckpt)
    method, note = drafter.serving.vllm_serving(cfg)
    if method is None:
        raise SpeculatorsError(f"--engine vllm: vLLM has no method for this checkpoint: {note}")
    python = ensure_vllm_python(python)
    cap = drafter.max_speculative_tokens
    declared = drafter.serving.speculative_tokens(cfg)
    if settings.ks is None:
        ks = tuple(k for k in sorted({*DEFAULT_KS, *([declared] if declared else [])}) if cap is None or k <= cap) or (1,)
    else:
        over = [k for k in settings.ks if cap is not None and k > cap]
        if over:
            raise SpeculatorsError(f"-k {over}: this drafter drafts at most K={cap} per step")
        ks = tuple(int(k) for k in settings.ks)
    dtype = settings.dtype or str(resolve_target_dtype(drafter.meta.dtype or "auto", "cpu", log)).removeprefix("torch.")
    ref = target_model or (rec.target.model if rec is not None else None)
    target = Target.load(ref, dtype="float32", aux_layer_ids=list(drafter.meta.aux_layer_ids), log=log) if ref else \
        drafter.meta.load_target("float32", log=log)
    if rec is not None and rec.data.chat_template is not None:
        target.chat_template = rec.data.chat_template
    plist, label = eval_prompts(prompts, rec, target, num_prompts, log)
    ids = [list(map(int, p["input_ids"])) for p in plist]
    stops = sorted(resolve_stop_ids(target))
    target_dir = vllm_runner.vllm_target_dir(target, log)
    del target
    log(f"vLLM eval: {len(ids)} prompts ({label}), {dtype}, K={list(ks)}, in flight {list(settings.concurrency)}")
    spec = drafter.serving.vllm_speculative_config(cfg, str(ckpt), ks[0])
    report = run_vllm_eval(target_dir, ckpt, spec, ids, stops, settings, dtype, ks, python=python, log=log)
    report.update(checkpoint=str(ckpt), method=method, prompts=label, target=str(target_dir))
    loop = _loop_report(ckpt, len(ids))
    report["loop_report"] = loop.get("path") if loop else None
    report["loop_comparison"] = loop_comparison(report, loop)
    if report["best"]["k"] is not None:
        report["serve"] = serve_command(target_dir, ckpt, spec, report["best"]["k"], dtype, python)
    out = Path(output) if output is not None else ckpt.parent / REPORT_DIR
    write_engine_report(report, out, render_markdown)
    log(render_markdown(report).rstrip())
    return report, out


__all__ = ["DEFAULT_KS", "REPORT_DIR", "engine_eval", "ENGINE", "NGRAM", "VllmEvalSettings", "best_setting", "greedy_check", "pass_row",
           "render_markdown", "run_vllm_eval", "serve_command", "timings"]
