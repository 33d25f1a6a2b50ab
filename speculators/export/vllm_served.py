"""The export served by vLLM itself: the export gate's third step, after the layout check and reference parity.

vLLM (its CPU build here, :mod:`speculators.engines.vllm_env`) is started on the target with the checkpoint
directory exactly as written as its speculative model (``--speculative-config`` method from the family's
``ServingFormat.vllm_serving``), and decodes the same prompt token ids at temperature 0 as:

1. **plain** (no speculative config) and **spec** (the export at K drafts per step): (a) *lossless in the real
   engine*: every spec output equals vLLM's plain output token for token. The engine runs in float32, where a
   multi-token verify forward and a one-token decode forward compute the same argmax unless two logits tie
   within float32 rounding; each difference is recomputed with our float32 target at its first position and is
   a failure unless the two tokens' log-probabilities there lie within :data:`NEAR_TIE_LOGPROB`.
2. (b) *acceptance as our loop's*: our decoding loop (:func:`speculators.decode.loop.speculative_generate`,
   float32 target, the drafter as our loader reads the file) runs on the same ids with the same K, and vLLM's
   own per-request record (``--per-request-spec-decode-metrics detailed``: accepted drafts per verify step) is
   compared with ours STEP BY STEP. How close: equal. Both engines propose the argmax of the same float32
   drafter and verify against the argmax of the same float32 target, so each step's accepted count is a
   function of the context; it can only differ where a float32 rounding difference flips an argmax, i.e. on a
   near-tie. Each count is compared as emitted (a step cut by a stop token or ``max_tokens`` counts the drafts
   it emitted; vLLM drafts K even when fewer can be emitted, our loop does not). A prompt whose outputs part
   (a near-tie of (a)) is compared up to the step where they part. vLLM's aggregate Prometheus counters
   (``vllm:spec_decode_num_accepted_tokens_per_pos``) are reported beside ours. Stronger still, where the worker
   recorded them (its hook on the model runner's ``take_draft_token_ids``): vLLM's drafted token ids at each step
   against our loop's (``acceptance["drafts"]``), reported beside the verdict: equal counts alone can hide
   different drafts that are rarely accepted (P-EAGLE served without ``parallel_drafting`` drafted a chain and
   matched most steps' counts), but a draft may also flip on a float32 near-tie of the drafter's own logits,
   which this comparison does not classify yet, so it does not decide the verdict.
3. (c) *a negative control*: the same export with one weight perturbed (every vocabulary head's rows rolled by
   one: each draft token becomes its neighbour id, :func:`perturbed_copy`) is served too; its per-step counts
   must NOT equal our loop's on the unperturbed drafter, or the comparison in (b) could not tell a misread
   export from a correct one. Informative only when our loop accepted something.

A family with no vLLM method (the format's ``vllm_serving`` says why), a vLLM build that refuses the method
(vLLM's words: e.g. its CPU model runner lacks a drafter type), a target vLLM cannot serve here (e.g. its CPU
attention needs a head size of at least 32), no vLLM venv, or a joint run's fine-tuned verifier: the check is
skipped and says so by name; vLLM failing to LOAD the export is a failure.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import SpeculatorsError

#: a greedy mismatch is a float32 near-tie when the two tokens' log-probabilities at its first position (our float32
#: target, one forward over the prefix) are this close; float32 kernels that sum in another order move a logit by
#: ~1e-5 of its size (logits of a 135M model are O(10)), so a tie within 1e-3 can flip
NEAR_TIE_LOGPROB = 1e-3
#: chat prompts decoded when the caller gives none (rendered with the target's chat template)
DEFAULT_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
                   "What is speculative decoding, in two sentences?",
                   "Give three tips for staying focused while studying.")
#: vLLM's words when it cannot run a speculative method for this target at all (a capability of the build or of
#: its model for the target, not a fault of the export): a method its CPU model runner lacks (DSpark), a target
#: model without the EAGLE-3 interface (Mixtral, Gemma), drafting layers that would need KV-cache groups of
#: different attention kinds (a draft for a target mixing sliding and full layers), a target whose embedding is not
#: where its drafter loader looks (GPT-NeoX's ``embed_in``)
REFUSAL_MARKERS = ("does not support", "not supported on", "is not supported for",
                   "should belong to the same kv cache group", "Target model does not have")


@dataclass
class ServedResult:
    """What vLLM did with the export (module docstring). ``passed``: None when skipped (``skipped`` says why);
    False when vLLM could not load the export (``error``), an output was not lossless, the acceptance differed, or
    the negative control did not break the comparison."""

    checkpoint: str
    method: str | None = None
    k: int | None = None
    vllm_version: str | None = None
    skipped: str | None = None
    error: str | None = None
    inputs: str = ""
    num_prompts: int = 0
    max_tokens: int = 0
    lossless: dict[str, Any] = field(default_factory=dict)
    acceptance: dict[str, Any] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)
    passed: bool | None = None

    def summary(self) -> str:
        """One line for the log."""
        if self.skipped:
            return f"vLLM serving check skipped: {self.skipped}"
        if self.error:
            return f"vLLM serving check FAILED: vLLM could not serve the export: {self.error}"
        a = self.acceptance
        c = self.control
        ctl = ("breaks it" if c.get("breaks") else f"could not run ({c.get('error')})" if c.get("ok") is False else
               "does NOT break it" if c.get("informative") else "not informative")
        return (f"vLLM {self.vllm_version} served the export (method {self.method}, K={self.k}) on {self.num_prompts} "
                f"prompts: lossless {self.lossless.get('equal')}/{self.num_prompts} equal to vLLM's plain output "
                f"({self.lossless.get('near_tie', 0)} near-tie, {self.lossless.get('failures', 0)} failures); accepted "
                f"per position vLLM {a.get('vllm_per_pos')} / our loop {a.get('loop_per_pos')}, steps equal "
                f"{a.get('steps_equal')}/{a.get('steps_compared')}, drafts equal {_drafts_cell(a.get('drafts'))}; "
                f"negative control {ctl}: "
                f"{'PASS' if self.passed else 'FAIL'}")

    def to_markdown(self) -> str:
        """Markdown for the run card, the model card and ``speculators check``."""
        lines = ["## Served by vLLM", ""]
        if self.skipped:
            return "\n".join(lines + [f"Not run: {self.skipped}.", ""])
        if self.error:
            return "\n".join(lines + [f"**FAILED**: vLLM {self.vllm_version or ''} could not serve `final/` "
                                      f"(method `{self.method}`): {self.error}", ""])
        a, c, g = self.acceptance, self.control, self.lossless
        lines += [f"vLLM {self.vllm_version} (float32) served this directory as its speculative model (method "
                  f"`{self.method}`, K={self.k}) on {self.num_prompts} prompts ({self.inputs}), {self.max_tokens} "
                  "new tokens each, temperature 0:", "",
                  f"- lossless: {g.get('equal')} of {self.num_prompts} outputs equal vLLM's plain output token for "
                  f"token; {g.get('near_tie', 0)} differ on a float32 near-tie, {g.get('failures', 0)} otherwise;",
                  f"- acceptance per draft position, vLLM's own counters {a.get('vllm_per_pos')} over "
                  f"{a.get('vllm_steps')} steps, our loop {a.get('loop_per_pos')} over {a.get('loop_steps')} steps; "
                  f"per step equal in {a.get('steps_equal')} of {a.get('steps_compared')} steps compared;",
                  f"- drafts: vLLM's drafted token ids equal our loop's at {_drafts_cell(a.get('drafts'))} steps;",
                  f"- negative control ({c.get('what', 'n/a')}): "
                  + (f"could not run: {c.get('error')}" if c.get("ok") is False else
                     "not informative (our loop accepted no draft)" if not c.get("informative") else
                     f"vLLM accepted {c.get('vllm_per_pos')} over {c.get('vllm_steps')} steps; the step sequences "
                     f"of {c.get('prompts_equal')} of {self.num_prompts} prompts equal our loop's: "
                     f"{'the comparison tells them apart' if c.get('breaks') else 'NOT told apart'}") + ";",
                  f"- verdict: **{'PASS' if self.passed else 'FAIL'}**.", ""]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("checkpoint", "method", "k", "vllm_version", "skipped", "error",
                                                "inputs", "num_prompts", "max_tokens", "lossless", "acceptance",
                                                "control", "passed")}


def perturbed_copy(checkpoint: Path, dest: Path) -> tuple[Path, str]:
    """A copy of ``checkpoint`` in ``dest`` with its OUTPUT head perturbed (the negative control): the rows of every
    vocabulary head (a 2-D tensor named ``*head*``) rolled by one, so each draft becomes its neighbour's id. A draft
    whose head is tied to its input embedding gets an untied ``lm_head.weight``, the embedding's rows rolled
    (rolling the tied matrix would relabel input and output alike: the same function); a format without a head of
    its own (it borrows the target's) gets its largest matrix rolled instead. Returns ``(dest, what was perturbed)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest)
    sd = load_file(str(checkpoint / "model.safetensors"))
    mats = [n for n, t in sd.items() if t.dim() == 2 and t.is_floating_point()]
    heads = [n for n in mats if "head" in n.rsplit(".", 1)[0]]
    cfg = json.loads((checkpoint / "config.json").read_text())
    embeds = [n for n in mats if n.endswith("embed_tokens.weight")]
    if heads:
        for n in heads:
            sd[n] = torch.roll(sd[n], 1, dims=0).contiguous()
        what = f"rows of {', '.join(heads)} rolled by one"
    elif cfg.get("tie_word_embeddings") and embeds:
        sd["lm_head.weight"] = torch.roll(sd[embeds[0]], 1, dims=0).contiguous()
        cfg["tie_word_embeddings"] = False
        (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        what = f"an untied lm_head.weight: the rows of {embeds[0]} rolled by one"
    else:
        big = max(mats, key=lambda n: sd[n].numel())
        sd[big] = torch.roll(sd[big], 1, dims=0).contiguous()
        what = f"rows of {big} rolled by one (no head of its own)"
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest, what


def emitted_accepted(accepted: list[int], num_tokens: int) -> list[int]:
    """Per verify step, the accepted drafts among the tokens it EMITTED before its last one: the steps run in order
    from the first generated token (the prefill's), each appends ``accepted + 1`` tokens until ``num_tokens`` are out
    (a stop token or max_tokens cuts the last step, which then counts ``min(accepted, emitted - 1)``); a step whose
    tokens start past the end is dropped. Used on both sides, so vLLM's K drafts at a step where one token remains
    (it drafts K anyway, our loop drafts none and emits the bonus token) count 0 like ours."""
    out, n = [], 1
    for a in accepted:
        if n >= num_tokens:
            break
        e = min(int(a) + 1, num_tokens - n)
        out.append(min(int(a), e - 1))
        n += e
    return out


def _per_pos(steps: list[list[int]], k: int) -> list[int]:
    return [sum(1 for s in steps for a in s if a > p) for p in range(k)]


def _compare(loop_steps: list[list[int]], vllm_steps: list[list[int]], stop_at: list[int | None]
             ) -> tuple[int, int, list[dict]]:
    """Steps compared, steps equal, and each prompt's first differing step ``{"prompt", "step", "loop", "vllm"}``;
    ``stop_at[i]`` ends prompt i's comparison before the step holding that token index (outputs parted there)."""
    compared = equal = 0
    diffs = []
    for i, (ours, theirs) in enumerate(zip(loop_steps, vllm_steps)):
        n, first = 1, None
        for s in range(max(len(ours), len(theirs))):
            a = ours[s] if s < len(ours) else None
            b = theirs[s] if s < len(theirs) else None
            if stop_at[i] is not None and n + (a or 0) >= stop_at[i]:
                break
            compared += 1
            if a == b:
                equal += 1
            elif first is None:
                first = {"prompt": i, "step": s, "loop": a, "vllm": b}
            n += (a if a is not None else b or 0) + 1
        if first is not None:
            diffs.append(first)
    return compared, equal, diffs


def _drafts_cell(d: dict[str, Any] | None) -> str:
    """``equal/compared`` steps of :func:`_compare_drafts`, or ``not recorded``."""
    return "not recorded" if d is None else f"{d['equal']}/{d['compared']}"


def _compare_drafts(loop_drafts: list[list[list[int]]], loop_steps: list[list[int]],
                    vllm_drafts: list[list[list[int]] | None], stop_at: list[int | None], k: int
                    ) -> dict[str, Any] | None:
    """Our loop's drafts against vLLM's, step by step: ``{"compared", "equal", "differences": [{"prompt", "step",
    "loop", "vllm"}]}`` (each prompt's first differing step), or None when vLLM's worker recorded none. Only steps
    where our loop drafted all ``k`` count (near ``max_tokens`` our loop drafts fewer and vLLM schedules its own
    way); the comparison of a prompt stops where :func:`_compare` stops it (the outputs parted). Reported beside
    the verdict, not in it: a draft can flip on a float32 near-tie of the DRAFTER's logits (deep slots of a weakly
    trained block drafter), which the accepted counts of (b) absorb and this comparison does not classify."""
    if all(d is None for d in vllm_drafts):
        return None
    compared = equal = 0
    diffs = []
    for i, (ours, acc, theirs) in enumerate(zip(loop_drafts, loop_steps, vllm_drafts)):
        if theirs is None:
            continue
        n = 1
        for s, d in enumerate(ours):
            if (stop_at[i] is not None and n + (acc[s] if s < len(acc) else 0) >= stop_at[i]) or s >= len(theirs):
                break
            if len(d) == k:
                compared += 1
                equal += theirs[s][:k] == d
                if theirs[s][:k] != d and not any(x["prompt"] == i for x in diffs):
                    diffs.append({"prompt": i, "step": s, "loop": d, "vllm": theirs[s]})
            n += (acc[s] if s < len(acc) else 0) + 1
    return {"compared": compared, "equal": equal, "differences": diffs}


def _near_tie(target, prompt: list[int], out_a: list[int], out_b: list[int]) -> dict[str, Any]:
    """The first differing position of two greedy outputs and our float32 target's log-probabilities there."""
    from ..evaluation.greedy_check import first_diff

    j = first_diff(out_a, out_b)
    res: dict[str, Any] = {"position": j, "near_tie": False, "gap": None}
    if j >= len(out_a) or j >= len(out_b):
        return res  # one is a prefix of the other: a length difference is no tie
    with torch.no_grad():
        ids = torch.tensor([prompt + out_a[:j]], device=target.device)
        logits = target.features(ids, with_logits=True).logits[0, -1].float()
    lp = torch.log_softmax(logits, -1)
    gap = float(lp[out_a[j]] - lp[out_b[j]])
    res.update(plain_token=out_a[j], spec_token=out_b[j], gap=gap, near_tie=abs(gap) <= NEAR_TIE_LOGPROB)
    return res


def default_prompt_ids(target, n: int) -> tuple[list[list[int]], str]:
    """:data:`DEFAULT_PROMPTS` rendered with the target's chat template (plain text without one)."""
    from ..data.chat import ChatError, render_prompt

    tok = target.tokenizer
    out = []
    for text in DEFAULT_PROMPTS[:n]:
        try:
            out.append(render_prompt(tok, [{"role": "user", "content": text}]))
        except (ChatError, ValueError):
            out.append(tok(text, add_special_tokens=True)["input_ids"])
    return out, f"{len(out)} built-in chat prompts"


@dataclass
class _Plan:
    """One checkpoint ready to be served: its result so far, drafter, float32 target, prompt ids, K, stop ids, the
    directory vLLM loads the target from, its negative-control copy."""

    res: ServedResult
    checkpoint: Path
    drafter: Any
    target: Any
    ids: list[list[int]]
    k: int
    stops: list[int]
    target_dir: Any
    control_dir: Path
    what: str
    spec: dict  # the --speculative-config that serves the checkpoint as trained (ServingFormat.vllm_speculative_config)


def check_served(checkpoint: str | Path, target=None, prompts: list[list[int]] | None = None,
                 num_prompts: int = 3, max_tokens: int = 48, k: int | None = None, python=None,
                 inputs_label: str | None = None, log: Callable[[str], None] = print) -> ServedResult:
    """Serve ``checkpoint`` in vLLM and judge (a), (b), (c) of the module docstring.

    Args:
        checkpoint: the exported directory (``config.json`` + ``model.safetensors``).
        target: the :class:`speculators.target.Target` (any dtype: a float32 copy is loaded when it is not float32);
            None loads the checkpoint's recorded target.
        prompts: prompt token ids (the run's held-out prompts); None: :func:`default_prompt_ids`.
        num_prompts: how many prompts at most. max_tokens: new tokens per prompt. k: drafts per step (default:
            the checkpoint's ``num_speculative_tokens``, within the drafter's cap).
        python: the vLLM venv's interpreter (default: :func:`speculators.engines.vllm_env.find_vllm_python`).
    Returns:
        A :class:`ServedResult`.
    Raises:
        SpeculatorsError: our own loader refuses the checkpoint. The target not loading (a recorded target this
            machine lacks), vLLM unable to serve the TARGET (e.g. a head size its CPU attention lacks) or no vLLM
            venv is a skip that says why; a worker that dies is a failed check (``error``).
        VllmUnavailable: an explicit ``python`` that is not a vLLM interpreter.
    """
    return check_served_many([checkpoint], target=target, prompts=prompts, num_prompts=num_prompts,
                             max_tokens=max_tokens, k=k, python=python, inputs_label=inputs_label, log=log)[0]


def check_served_many(checkpoints: list[str | Path], target=None, prompts: list[list[int]] | None = None,
                      num_prompts: int = 3, max_tokens: int = 48, k: int | None = None, python=None,
                      inputs_label: str | None = None, log: Callable[[str], None] = print) -> list[ServedResult]:
    """:func:`check_served` for several checkpoints, the engines of those that share a target served by ONE vLLM
    worker process (its import and its plain engine paid once per target). Arguments, results and errors as
    :func:`check_served`, one result per checkpoint in order."""
    from ..engines import vllm_runner

    out: list[ServedResult | None] = [None] * len(checkpoints)
    with tempfile.TemporaryDirectory(prefix="speculators-served-") as tmp:
        plans: dict[int, _Plan] = {}
        for i, ckpt in enumerate(checkpoints):
            p = _plan(Path(ckpt), target, prompts, num_prompts, max_tokens, k, python, inputs_label,
                      Path(tmp) / f"control-{i}", log)
            if isinstance(p, ServedResult):
                out[i] = p
            else:
                plans[i] = p
        by_target: dict[str, list[int]] = {}
        for i, p in plans.items():
            by_target.setdefault(str(p.target_dir), []).append(i)
        for tdir, idx in by_target.items():
            jobs = [vllm_runner.generate_job(plans[i].ids, max_tokens, plans[i].stops, warmup=False) for i in idx]
            engines = [vllm_runner.engine("plain", None, jobs, max_num_seqs=1)]
            for n, i in enumerate(idx):
                p = plans[i]
                spec = p.spec
                engines += [vllm_runner.engine(f"spec-{n}", spec, [jobs[n]], max_num_seqs=1),
                            vllm_runner.engine(f"control-{n}", {**spec, "model": str(p.control_dir)}, [jobs[n]],
                                               max_num_seqs=1)]
            need = max(len(q) + max_tokens + plans[i].k + 8 for i in idx for q in plans[i].ids)
            try:
                version, runs = vllm_runner.run_vllm(tdir, engines, dtype="float32", python=python, log=log,
                                                     max_model_len=vllm_runner.fit_context(tdir, need))
            except SpeculatorsError as e:  # the worker died or ran out of time: a failed check, recorded
                for i in idx:
                    plans[i].res.error, plans[i].res.passed = f"the vLLM worker failed: {e}", False
                    out[i] = plans[i].res
                continue
            if not runs[0].ok:  # the target, not the export: e.g. a head_dim vLLM's CPU attention lacks
                said = _vllm_said(runs[0].error)
                for i in idx:
                    plans[i].res.vllm_version = version
                    plans[i].res.skipped = f"vLLM {version} cannot serve the target {tdir} here: {said}"
                    out[i] = plans[i].res
                continue
            for n, i in enumerate(idx):
                plans[i].res.vllm_version = version
                out[i] = _judge(plans[i], runs[0].jobs[n].outputs, runs[1 + 2 * n], runs[2 + 2 * n], max_tokens, log)
    return [r for r in out if r is not None]


def _vllm_said(error: str | None) -> str:
    """The line of vLLM's error that says what it refused (its last non-empty line otherwise)."""
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    pick = [ln for ln in lines if any(m in ln for m in ("Unsupported", "not supported", "does not support"))]
    return (pick or lines or ["(no message)"])[0 if pick else -1]


def _plan(checkpoint: Path, target, prompts, num_prompts: int, max_tokens: int, k: int | None, python,
          inputs_label: str | None, control_dest: Path, log) -> ServedResult | _Plan:
    """A :class:`_Plan` for ``checkpoint``, or its :class:`ServedResult` when it is skipped (module docstring)."""
    from ..decode.inputs import resolve_stop_ids
    from ..drafters import Drafter, registry
    from ..drafters.checkpoint import read_checkpoint_config
    from ..engines import vllm_runner
    from ..engines.vllm_env import VllmUnavailable, ensure_vllm_python

    cfg = read_checkpoint_config(checkpoint)
    algo = ((cfg.get("speculators_training") or {}).get("drafter") or {}).get("algorithm")
    res = ServedResult(str(checkpoint))
    if algo not in registry.names():
        res.skipped = "the checkpoint records no family of ours (speculators_training.drafter.algorithm)"
        return res
    serving = registry.get(algo).serving
    res.method, note = serving.vllm_serving(cfg)
    if res.method is None:
        res.skipped = f"vLLM has no method for this layout ({note})"
        return res
    try:
        ensure_vllm_python(python)
    except VllmUnavailable as e:
        if python is not None:  # asked for by name (--vllm-python): not a skip
            raise
        res.skipped = str(e)
        return res
    drafter = Drafter.from_pretrained(checkpoint).float()
    if drafter.target_adapter_dir is not None:
        res.skipped = "a joint checkpoint's verifier is the base model with its LoRA adapter, which vLLM is not given"
        return res
    try:
        tgt = _float32_target(target, drafter, log)
    except SpeculatorsError as e:
        res.skipped = f"the target cannot be loaded here ({e})"
        return res
    drafter.attach_target(tgt)
    drafter.eval()
    if prompts:
        ids, res.inputs = [list(map(int, p)) for p in prompts[:num_prompts]], inputs_label or "held-out prompts of the run"
    else:
        ids, res.inputs = default_prompt_ids(tgt, num_prompts)
    cap = getattr(drafter, "max_speculative_tokens", None)
    kk = int(k or serving.speculative_tokens(cfg) or 3)
    kk = min(kk, cap) if cap else kk
    res.k, res.num_prompts, res.max_tokens = kk, len(ids), int(max_tokens)
    control_dir, what = perturbed_copy(checkpoint, control_dest)
    return _Plan(res, checkpoint, drafter, tgt, ids, kk, sorted(resolve_stop_ids(tgt)),
                 vllm_runner.vllm_target_dir(tgt, log), control_dir, what,
                 serving.vllm_speculative_config(cfg, str(checkpoint.resolve()), kk))


def _judge(plan: _Plan, plain_outputs, spec_run, control, max_tokens: int, log) -> ServedResult:
    """(a), (b), (c) of the module docstring for one plan, from vLLM's plain outputs and its spec / control engines."""
    from ..decode.loop import speculative_generate
    from ..evaluation.greedy_check import first_diff

    res, target, ids, k = plan.res, plan.target, plan.ids, plan.k
    if not spec_run.ok:
        said = next((ln.strip() for ln in (spec_run.error or "").splitlines() if any(m in ln for m in REFUSAL_MARKERS)),
                    None)
        if said is not None:
            res.skipped = f"this vLLM build refuses method `{res.method}`: {said}"
        else:
            res.error, res.passed = spec_run.error, False
        return res
    plain_out = [o.token_ids for o in plain_outputs]
    spec_out = spec_run.jobs[0].outputs
    # (a) lossless in the engine
    mism = [{"prompt": i, **_near_tie(target, ids[i], plain_out[i], o.token_ids)}
            for i, o in enumerate(spec_out) if o.token_ids != plain_out[i]]
    n_tie = sum(1 for m in mism if m["near_tie"])
    res.lossless = {"equal": len(ids) - len(mism), "near_tie": n_tie, "failures": len(mism) - n_tie,
                    "mismatches": mism}
    # (b) our loop on the same ids
    ours = speculative_generate(target, plan.drafter, ids, k, max_tokens, batch_size=1, eos_ids=set(plan.stops))
    loop_steps, vllm_steps, stop_at = [], [], []
    for i, (r, o) in enumerate(zip(ours.results, spec_out)):
        loop_steps.append(emitted_accepted(r.verifier_accepted, len(r.tokens)))
        vllm_steps.append(emitted_accepted(o.per_step_accepted or [], len(o.token_ids)))
        stop_at.append(None if r.tokens == o.token_ids else first_diff(r.tokens, o.token_ids))
    parts = [{"prompt": i, **_near_tie(target, ids[i], r.tokens, o.token_ids)}
             for i, (r, o) in enumerate(zip(ours.results, spec_out)) if stop_at[i] is not None]
    compared, equal, diffs = _compare(loop_steps, vllm_steps, stop_at)
    drafts = _compare_drafts([r.draft_ids for r in ours.results], loop_steps, [o.drafts for o in spec_out], stop_at, k)
    counters = spec_run.jobs[0].counters
    raw = _per_pos([o.per_step_accepted or [] for o in spec_out], k)  # as vLLM recorded them, nothing cut
    res.acceptance = {"vllm_per_pos": _per_pos(vllm_steps, k), "loop_per_pos": _per_pos(loop_steps, k),
                      "counters_agree": list(counters.get("accepted_per_pos") or [])[:k] == raw,
                      "vllm_steps": sum(map(len, vllm_steps)), "loop_steps": sum(map(len, loop_steps)),
                      "vllm_counters": counters, "steps_compared": compared, "steps_equal": equal,
                      "differences": diffs, "outputs_part": parts, "drafts": drafts}
    # (c) the negative control
    informative = sum(map(sum, loop_steps)) > 0
    res.control = {"what": plan.what, "informative": informative, "ok": control.ok, "error": control.error,
                   "breaks": None}
    if control.ok:
        c_steps = [emitted_accepted(o.per_step_accepted or [], len(o.token_ids)) for o in control.jobs[0].outputs]
        same = sum(1 for a, b in zip(loop_steps, c_steps) if a == b)
        res.control.update(prompts_equal=same, breaks=same < len(c_steps), vllm_per_pos=_per_pos(c_steps, k),
                           vllm_steps=sum(map(len, c_steps)),
                           outputs_differ=sum(1 for o, r in zip(control.jobs[0].outputs, ours.results)
                                              if o.token_ids != r.tokens))
    ok_a = res.lossless["failures"] == 0
    # our loop's output parting from vLLM's is allowed only on a float32 near-tie of the target (else the two
    # engines decode different targets, and the steps compared before the part prove little)
    ok_b = equal == compared and compared > 0 and all(p["near_tie"] for p in parts)
    ok_c = (not informative) or bool(res.control.get("breaks"))
    res.passed = ok_a and ok_b and ok_c
    log(res.summary())
    return res


def _float32_target(target, drafter, log):
    """``target`` when it is float32; else the same reference loaded in float32 with the drafter's taps (vLLM runs
    float32 here, and our loop must decode the same function)."""
    from ..target import Target

    if target is not None and target.dtype == torch.float32:
        return target
    if target is not None:
        return Target.load(target.name_or_path, dtype="float32", aux_layer_ids=list(target.aux_layer_ids), log=log)
    return drafter.meta.load_target("float32", log=log)


__all__ = ["DEFAULT_PROMPTS", "NEAR_TIE_LOGPROB", "ServedResult", "check_served", "check_served_many", "default_prompt_ids",
           "emitted_accepted", "perturbed_copy"]
