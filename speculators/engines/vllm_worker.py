"""The vLLM worker: a script run BY PATH with the vLLM venv's python (:mod:`.vllm_env`); it imports nothing of ours.

vLLM pins its own torch / transformers companions, so it lives in its own virtual environment and this project
talks to it across that boundary, as it does with the reference implementation (:mod:`speculators.export.reference_worker`).
One worker process serves one target and runs several engines on it in turn, each with its own
``speculative_config`` (``None``: plain decoding), so vLLM's import (~10 s) is paid once; an engine costs a few
seconds to start (``enforce_eager``, the engine core in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

``python vllm_worker.py REQUEST.json RESPONSE.json``. The request::

    {"target": DIR, "dtype": "float32", "max_model_len": 1024, "seed": 0, "kv_cache_gib": 1,
     "engines": [{"label": "plain", "speculative_config": null | {...}, "max_num_seqs": 4,
                  "jobs": [{"kind": "generate", "prompts": [[ids]], "max_tokens": 64, "temperature": 0.0,
                            "top_p": 1.0, "seed": 0, "stop_token_ids": [2], "concurrency": 1, "logprobs": 0,
                            "warmup": true},
                           {"kind": "prompt_logprobs", "prompts": [[ids]], "logprobs": 20}]}]}

A ``generate`` job keeps at most ``concurrency`` requests in flight (continuous batching through
``LLMEngine.add_request`` / ``step``; 1: one request at a time); request i samples with seed ``seed + i``. A
``prompt_logprobs`` job returns, per prompt, the engine's top log-probabilities of the NEXT token after every
prefix of the prompt, all from one prefill forward (a many-token forward, a verify step's shape).

The response (rewritten after each engine, so a crash keeps what finished)::

    {"vllm_version", "engines": [{"label", "ok", "error", "init_seconds", "threads", "cpus",
        "jobs": [{"kind", "wall_seconds", "max_in_flight", "counters": {num_drafts, num_draft_tokens, num_accepted_tokens,
                  accepted_per_pos}, "outputs": [{"token_ids", "finish_reason", "stop_reason", "seconds",
                  "decode_seconds", "spec": {histogram, per_step_accepted, per_step_drafted, num_draft_tokens}
                  | null, "drafts": [[ids of one step]] | null, "logprobs": [{token id: logprob}] | null}]}]}]}

``counters`` are the differences of vLLM's own Prometheus counters (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) over the timed
requests; ``spec`` is vLLM's per-request record (``--per-request-spec-decode-metrics detailed``: one entry per
verify step that drafted); ``drafts`` the token ids vLLM drafted for the request at each step, as its model runner
handed them to the scheduler (the first after the prefill; the last ones may never be verified: the request ended).
``seconds`` is the request's wall time from submission to its end; ``decode_seconds``
vLLM's first-token to last-token time of the request (engine-core timestamps); ``decode_steps`` the engine steps
that appended tokens to the request after the one that gave its first token (every decode step, those in which
nothing was drafted included: counted as the engine steps, not inferred from the draft record). An engine that vLLM refuses
(``ok`` false) carries vLLM's error and the next engine still runs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

#: per request (vLLM's internal id ``r<i>-<uuid>``), the drafts vLLM's model runner handed its scheduler, one list a
#: step (:func:`_record_drafts`)
_DRAFTS: dict[str, list[list[int]]] = {}


def _record_drafts() -> bool:
    """Record every step's drafts as vLLM's model runner hands them to the scheduler (``take_draft_token_ids``, the
    engine core's synchronous path; in this process since ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Returns whether the
    hook is in place (idempotent)."""
    try:
        from vllm.v1.worker import gpu_model_runner
    except ImportError:
        return False
    runner = gpu_model_runner.GPUModelRunner
    if getattr(runner.take_draft_token_ids, "_speculators_hook", False):
        return True
    orig = runner.take_draft_token_ids

    def take_draft_token_ids(self):
        out = orig(self)
        if out is not None:
            for rid, ids in zip(out.req_ids, out.draft_token_ids):
                _DRAFTS.setdefault(str(rid), []).append([int(t) for t in ids])
        return out

    take_draft_token_ids._speculators_hook = True
    runner.take_draft_token_ids = take_draft_token_ids
    return True


COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _counters(llm) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            key = m.name.split("spec_decode_")[1]
            out[key] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [(acc[i] if i < len(acc) else 0) + (vals[i] if i < len(vals) else 0)
                                       for i in range(max(len(acc), len(vals)))]
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    out["accepted_per_pos"] = [a[i] - (b[i] if i < len(b) else 0) for i in range(len(a))]
    return out


def _logprob_dicts(lps) -> list | None:
    if lps is None:
        return None
    return [None if d is None else {str(t): float(lp.logprob) for t, lp in d.items()} for d in lps]


def _record(o, submitted: float, finished: float) -> dict:
    c = o.outputs[0]
    spec = c.spec_decode_metrics
    m = o.metrics
    decode = None
    if m is not None and getattr(m, "last_token_ts", 0) and getattr(m, "first_token_ts", 0):
        decode = float(m.last_token_ts - m.first_token_ts)
    return {"token_ids": [int(t) for t in c.token_ids], "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if isinstance(c.stop_reason, (int, type(None))) else str(c.stop_reason),
            "seconds": finished - submitted, "decode_seconds": decode,
            "spec": None if spec is None else {
                "histogram": list(spec.histogram), "per_step_accepted": list(spec.per_step_accepted),
                "per_step_drafted": list(spec.per_step_drafted), "num_draft_tokens": int(spec.num_draft_tokens)},
            "logprobs": _logprob_dicts(c.logprobs)}


def _generate(llm, job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = job["prompts"]
    engine = llm.llm_engine

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=float(job.get("temperature", 0.0)), top_p=float(job.get("top_p", 1.0)),
                              max_tokens=int(job["max_tokens"]), seed=int(job.get("seed", 0)) + i,
                              stop_token_ids=list(job.get("stop_token_ids") or []), ignore_eos=True,
                              logprobs=int(job["logprobs"]) if job.get("logprobs") else None,
                              skip_special_tokens=False, detokenize=False)

    if job.get("warmup", True) and prompts:  # the first request of a fresh engine pays allocation, not decoding
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params(0), use_tqdm=False)
    before = _counters(llm)
    concurrency = max(1, int(job.get("concurrency", 1)))
    results: list = [None] * len(prompts)
    submitted: dict[str, float] = {}
    seen: dict[str, int] = {}  # tokens of each request so far
    steps: dict[str, int] = {}  # engine steps that appended tokens to it, after the one giving its first token
    nxt, live, most = 0, 0, 0
    _DRAFTS.clear()
    t0 = time.perf_counter()
    while nxt < len(prompts) or live:
        while live < concurrency and nxt < len(prompts):
            rid = f"r{nxt}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[nxt]), params(nxt))
            submitted[rid] = time.perf_counter()
            nxt, live = nxt + 1, live + 1
        most = max(most, live)
        for o in engine.step():
            got = len(o.outputs[0].token_ids)
            if got > seen.get(o.request_id, 0):
                steps[o.request_id] = steps.get(o.request_id, -1) + 1
                seen[o.request_id] = got
            if o.finished:
                rec = _record(o, submitted[o.request_id], time.perf_counter())
                rec["decode_steps"] = max(0, steps.get(o.request_id, 0))
                mine = [k for k in _DRAFTS if k.rsplit("-", 1)[0] == o.request_id]
                rec["drafts"] = _DRAFTS.pop(mine[0]) if len(mine) == 1 else None
                results[int(o.request_id[1:])] = rec
                live -= 1
    wall = time.perf_counter() - t0
    return {"kind": "generate", "wall_seconds": wall, "counters": _delta(_counters(llm), before), "outputs": results,
            "max_in_flight": most}


def _prompt_logprobs(llm, job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=int(job.get("logprobs", 20)),
                        detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    rows = []
    for o in outs:
        # prompt_logprobs[j] scores prompt token j given tokens < j; the generated token's own top list comes
        # from outputs[0].logprobs, which needs logprobs > 0: the next-token list after prefix[:j] is entry j
        pl = _logprob_dicts(o.prompt_logprobs) or []
        rows.append({"prompt_logprobs": pl})
    return {"kind": "prompt_logprobs", "outputs": rows}


def _engine(req: dict, eng: dict) -> dict:
    from vllm import LLM

    rec: dict = {"label": eng["label"], "ok": False, "error": None, "jobs": []}
    spec = eng.get("speculative_config")
    kw = dict(model=req["target"], dtype=req.get("dtype", "float32"), enforce_eager=True,
              max_model_len=int(req.get("max_model_len", 1024)), seed=int(req.get("seed", 0)),
              max_num_seqs=int(eng.get("max_num_seqs", 4)), disable_log_stats=False,
              skip_tokenizer_init=True)  # token ids in and out; the stops are the request's own
    if spec:
        kw["speculative_config"] = spec
        kw["per_request_spec_decode_metrics"] = "detailed"
        _record_drafts()
    llm = None
    try:
        t0 = time.perf_counter()
        llm = LLM(**kw)
        rec["init_seconds"] = time.perf_counter() - t0
        import torch

        rec["threads"] = torch.get_num_threads()
        rec["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        for job in eng.get("jobs", []):
            if job["kind"] == "generate":
                rec["jobs"].append(_generate(llm, job))
            elif job["kind"] == "prompt_logprobs":
                rec["jobs"].append(_prompt_logprobs(llm, job))
            else:
                raise ValueError(f"unknown job kind {job['kind']!r}")
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer for this engine
        rec["error"] = f"{type(e).__name__}: {e}".strip()
        rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        del llm
        gc.collect()
    return rec


def main(argv: list[str]) -> int:
    req_path, resp_path = argv[1], argv[2]
    req = json.loads(open(req_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gib", 1)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    resp = {"vllm_version": vllm.__version__, "engines": []}
    for eng in req["engines"]:
        resp["engines"].append(_engine(req, eng))
        tmp = resp_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(resp, f)
        os.replace(tmp, resp_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
