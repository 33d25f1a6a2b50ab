"""The engine eval: our drafter, plain decoding and llama.cpp's model-free types measured inside ``llama-server``.

One :class:`EnginePass` is one server (:class:`.llamacpp_server.LlamaServer`: this llama.cpp reads K and
``p_min`` per server) and the held-out prompts sent through it, one at a time (``parallel`` 1) or from
``parallel`` client threads into as many slots. :func:`run_engine_eval` first times the target's verify-cost
curve (:func:`.llamacpp_bench.verify_cost_curve`, ``curve_tokens``), then plans the passes:

1. temperature 0, one slot: plain, the drafter at every K of ``ks`` (``--spec-draft-n-max``), every model-free
   type of ``ngram_types``;
2. at the fastest K of step 1: the drafter quantized (each extra ``draft_outtypes``, e.g. ``q8_0``), with every
   ``draft_threads`` (``--spec-draft-threads``: a one-layer draft forward is dominated by thread synchronisation,
   not by its weights), and the negative control: the same drafter converted with every aux layer tap a third
   of the target's layers deeper (:func:`tap_shift`), which must accept clearly less; at that K and at the
   largest K, every ``p_min`` (``--spec-draft-p-min``: a round stops drafting at a token below it, so a larger K
   costs only where the draft is confident);
3. every temperature > 0 of ``temperatures``: plain, the drafter at that K, the model-free types (sampled
   with the same seed per prompt; the server verifies by its own rule);
4. every ``parallel`` > 1 at temperature 0: plain, the drafter at that K, the fastest model-free type.

The report names the fastest drafter setting (:func:`best_setting`) and the fastest setting of any method
(:func:`fastest_setting`, plain decoding and the model-free types included) with its ``llama-server`` command.

Rows follow our loop's report rows (:mod:`speculators.evaluation.runner`: ``method``, ``k``, ``batch_size`` (=
``parallel``), ``tau``, ``tau_ci``, ``tokens_per_s``, ``speedup``, ``drafted``, ``accepted``) with ``engine:
"llama.cpp"`` and the engine's settings. Counts are the server's own (``timings.draft_n`` /
``draft_n_accepted``); tau is generated tokens per target forward (:mod:`.llamacpp_server`), its CI the same
bootstrap over prompts as our loop's (:func:`speculators.evaluation.acceptance.bootstrap_tau_ci`).
``tokens_per_s`` is generated tokens over the pass's wall time (prompt processing included, as a client sees
it); ``decode_tokens_per_s`` counts only the server's generation time.

Greedy losslessness (:func:`greedy_check`): at temperature 0 every speculative output (the negative control's
too: a wrong draft must cost speed, never tokens) and every output of plain decoding with several slots must
equal the engine's one-slot plain output token for token, or its first difference must sit on a near-tie of the target's logits as the
engine computes them: the engine's own top log-probabilities at that position from a one-token-at-a-time
decode (plain decoding's shape) and from one batched forward over the prefix (many tokens at once, as a verify
step) (:func:`classify_engine_mismatch`). Anything else is a failure.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import SpeculatorsError
from ..evaluation.acceptance import bootstrap_tau_ci
from ..evaluation.greedy_check import first_diff
from .llamacpp_bench import (CURVE_TOKENS, break_even_taus, curve_lines, k_sweep_row, plain_row, step_cost_lines,
                             step_costs, verify_cost_curve)
from .llamacpp_build import LlamaCpp, LlamaCppUnavailable
from .llamacpp_server import Completion, LlamaServer
from .llamacpp_targets import check_target_type

ENGINE = "llama.cpp"


def tap_shift(num_layers: int) -> int:
    """How many layers deeper the negative control moves every aux layer tap: a third of the target's layers
    (at least 1; the shifted ids are clipped to the last layer). Neighbouring layers' states are close in the
    residual stream, so a shift of a few layers barely moves acceptance (measured: 4 of 30 layers took tau
    from 1.48 to 1.40); a third of the depth reads clearly different states."""
    return max(1, int(num_layers) // 3)

#: a mismatch is a near-tie when the two tokens' log-probability gap is within this factor of how much the engine's
#: batch-shaped forward moved that gap against its decode-shaped one (the verify shape differs from both)
NEAR_TIE_FACTOR = 2.0
#: top log-probabilities asked for when a mismatch is classified
N_PROBS = 20
#: forwards over the last c tokens of a cached prefix that a mismatch is recomputed with: verify steps of K = 1..4
VERIFY_CHUNKS = (2, 3, 4, 5)


@dataclasses.dataclass(frozen=True)
class EnginePass:
    """One server and one sweep of the prompts through it.

    Attributes:
        method: ``"plain"``, ``"drafter"``, ``"drafter-shifted-taps"`` (the negative control) or a llama.cpp
            model-free ``--spec-type`` (``"ngram-simple"``, ``"ngram-mod"``, ...).
        temperature: sampling temperature (0: greedy). parallel: server slots = concurrent requests.
        k: ``--spec-draft-n-max`` (None for plain; the model-free types draft up to their own maximum).
        p_min: ``--spec-draft-p-min`` (None: the server's default, 0). draft_outtype: the draft GGUF's
            ``--outtype`` (drafter methods only). draft_threads: ``--spec-draft-threads`` (None: the target's).
    """

    method: str
    temperature: float = 0.0
    parallel: int = 1
    k: int | None = None
    p_min: float | None = None
    draft_outtype: str | None = None
    draft_threads: int | None = None

    @property
    def label(self) -> str:
        """A short unique name, e.g. ``drafter k=3 q8_0 p_min=0.5 t=0 x4``."""
        parts = [self.method] + ([f"k={self.k}"] if self.k is not None else [])
        parts += [self.draft_outtype] if self.draft_outtype not in (None, "f16") else []
        parts += [f"p_min={self.p_min:g}"] if self.p_min is not None else []
        parts += [f"draft_threads={self.draft_threads}"] if self.draft_threads is not None else []
        parts += [f"t={self.temperature:g}"] + ([f"x{self.parallel}"] if self.parallel > 1 else [])
        return " ".join(parts)


@dataclasses.dataclass
class EngineSettings:
    """What :func:`run_engine_eval` sweeps (module docstring). ``max_new_tokens`` per prompt; ``seed`` the
    sampling seed of prompt i is ``seed + i``; ``threads`` the server's ``--threads`` (None: all cores);
    ``ctx_size`` per slot; ``target_type`` the target GGUF's weight type (:mod:`.llamacpp_targets`; None: as
    shipped); ``curve_tokens`` the forward lengths of the target's verify-cost curve (:mod:`.llamacpp_bench`)."""

    ks: tuple[int, ...] | None = None  # None: DEFAULT_KS and the drafter's own K, within its bound (for_drafter)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    parallel: tuple[int, ...] = (1, 4)
    ngram_types: tuple[str, ...] = ("ngram-simple", "ngram-mod")
    p_mins: tuple[float, ...] = (0.2, 0.5, 0.8)
    draft_threads: tuple[int, ...] = (1,)
    draft_outtypes: tuple[str, ...] = ("f16", "q8_0")
    max_new_tokens: int = 128
    seed: int = 0
    threads: int | None = None
    ctx_size: int = 2048
    negative_control: bool = True
    target_type: str | None = None  # None: the target GGUF as shipped; else llamacpp_targets.TARGET_TYPES
    curve_tokens: tuple[int, ...] = CURVE_TOKENS  # the verify-cost curve's forward lengths (empty: not measured)

    def __post_init__(self):
        if self.ks is not None and (not self.ks or any(int(k) < 1 for k in self.ks)):
            raise SpeculatorsError(f"engine eval: K values (-k) {list(self.ks)} must be >= 1")
        if 0.0 not in [float(t) for t in self.temperatures]:
            raise SpeculatorsError("engine eval: temperatures (-t) must include 0 (the greedy check and K choice)")
        if any(float(t) < 0 for t in self.temperatures):
            raise SpeculatorsError(f"engine eval: temperatures (-t) {list(self.temperatures)} must be >= 0")
        if 1 not in self.parallel or any(int(p) < 1 for p in self.parallel):
            raise SpeculatorsError(f"engine eval: slots (--slots) {list(self.parallel)} must include 1 and be >= 1")
        if any(not 0.0 <= float(p) <= 1.0 for p in self.p_mins):
            raise SpeculatorsError(f"engine eval: p_min values (--p-min) {list(self.p_mins)} must be in [0, 1]")
        if any(int(n) < 1 for n in self.draft_threads):
            raise SpeculatorsError(f"engine eval: draft threads (--draft-threads) {list(self.draft_threads)} must be >= 1")
        if not self.draft_outtypes:
            raise SpeculatorsError("engine eval: draft GGUF types (--draft-outtypes) are empty (the first is the drafter's main GGUF)")
        if int(self.max_new_tokens) < 1:
            raise SpeculatorsError(f"engine eval: max new tokens (--max-new-tokens) {self.max_new_tokens} must be >= 1")
        self.target_type = check_target_type(self.target_type, "engine eval: target type (--target-type)")
        if any(int(n) < 1 for n in self.curve_tokens):
            raise SpeculatorsError(f"engine eval: curve forward lengths {list(self.curve_tokens)} must be >= 1")


    def for_drafter(self, declared_k: int | None, max_draft: int | None, p_min_note: str | None) -> EngineSettings:
        """These settings resolved for one drafter: ``ks`` None becomes :data:`DEFAULT_KS` plus the K the checkpoint
        declares (``declared_k``), all within ``max_draft``; with a ``p_min_note`` (the format cannot threshold
        drafts in llama.cpp) no p_min pass is run.

        Raises:
            SpeculatorsError: a K given above ``max_draft`` (llama.cpp would clamp it silently), naming the bound.
        """
        if self.ks is None:
            ks = sorted({*DEFAULT_KS, *([declared_k] if declared_k else [])})
            ks = tuple(k for k in ks if max_draft is None or k <= max_draft) or (1,)
        else:
            over = [int(k) for k in self.ks if max_draft is not None and int(k) > max_draft]
            if over:
                raise SpeculatorsError(f"-k {over}: this drafter serves at most K={max_draft} drafts per step in "
                                       "llama.cpp (which would clamp a larger --spec-draft-n-max silently)")
            ks = tuple(int(k) for k in self.ks)
        return dataclasses.replace(self, ks=ks, p_mins=() if p_min_note else self.p_mins)


#: the K values measured when none are given (plus the drafter's own K)
DEFAULT_KS = (1, 2, 3, 4)


@dataclasses.dataclass
class EngineModels:
    """The files a pass serves: ``target`` GGUF, the drafter's GGUF per outtype (``drafts``), the negative
    control's GGUF (``shifted``, or None) with its taps ``shifted_by`` layers deeper, the drafter's ``spec_type``
    (``draft-eagle3``, ...)."""

    target: Path
    drafts: dict[str, Path]
    spec_type: str
    shifted: Path | None = None
    shifted_by: int | None = None


def _server(lc: LlamaCpp, models: EngineModels, p: EnginePass, st: EngineSettings) -> LlamaServer:
    kw: dict[str, Any] = dict(parallel=p.parallel, ctx_size=st.ctx_size * p.parallel, threads=st.threads)
    if p.method == "drafter":
        kw.update(draft=models.drafts[p.draft_outtype], spec_type=models.spec_type, draft_n_max=p.k, p_min=p.p_min)
        if p.draft_threads is not None:
            kw["extra"] = ["--spec-draft-threads", str(p.draft_threads)]
    elif p.method == "drafter-shifted-taps":
        kw.update(draft=models.shifted, spec_type=models.spec_type, draft_n_max=p.k, p_min=p.p_min)
    elif p.method != "plain":
        kw.update(spec_type=p.method, draft_n_max=p.k)
    return LlamaServer(lc, models.target, **kw)


def run_pass(lc: LlamaCpp, models: EngineModels, p: EnginePass, prompts: list[list[int]], st: EngineSettings,
             ) -> tuple[dict[str, Any], list[Completion]]:
    """Serve ``p`` and send every prompt through it; the row (module docstring) and the completions in prompt
    order.

    Raises:
        SpeculatorsError: the server failed to start or a request failed.
    """
    with _server(lc, models, p, st) as srv:
        def one(i: int) -> Completion:
            return srv.complete(prompts[i], st.max_new_tokens, temperature=p.temperature, seed=st.seed + i)

        one(0)  # warm the slot's buffers: the first request of a fresh server pays allocation, not decoding
        t0 = time.perf_counter()
        if p.parallel == 1:
            outs = [one(i) for i in range(len(prompts))]
        else:
            with concurrent.futures.ThreadPoolExecutor(p.parallel) as pool:
                outs = list(pool.map(one, range(len(prompts))))
        wall = time.perf_counter() - t0
    return engine_row(p, outs, wall), outs


def engine_row(p: EnginePass, outs: list[Completion], wall: float) -> dict[str, Any]:
    """A report row of pass ``p`` from its completions and its wall time (seconds). Ratios whose denominator is
    zero are None (shown as n/a)."""
    tokens = sum(len(o.tokens) for o in outs)
    drafted, accepted = sum(o.draft_n for o in outs), sum(o.draft_accepted for o in outs)
    steps, step_tokens = sum(o.steps for o in outs), sum(o.step_tokens for o in outs)
    gen = sum(o.seconds for o in outs)
    lo, hi = bootstrap_tau_ci([o.step_tokens for o in outs], [o.steps for o in outs])
    return {"engine": ENGINE, "label": p.label, "method": p.method, "k": p.k, "batch_size": p.parallel,
            "temperature": p.temperature, "p_min": p.p_min, "draft_outtype": p.draft_outtype, "draft_threads": p.draft_threads,
            "num_prompts": len(outs), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "decode_tokens_per_s": tokens / gen if gen > 0 and p.parallel == 1 else None,
            "tau": step_tokens / steps if steps else None, "tau_ci": [lo, hi] if steps else None,
            "drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "steps": steps, "decode_seconds": gen, "speedup": None}


def _fastest(rows: list[dict], method: str) -> dict | None:
    cand = [r for r in rows if r["method"] == method and r["tokens_per_s"] is not None]
    return max(cand, key=lambda r: r["tokens_per_s"]) if cand else None


def run_engine_eval(lc: LlamaCpp, models: EngineModels, prompts: list[list[int]], st: EngineSettings,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every pass of the module docstring's plan, the speedups, the greedy check and the best setting.

    Args:
        lc: the llama.cpp build. models: the GGUF files. prompts: token ids per prompt (BOS included when the
            target adds one). st: what to sweep.
    Returns:
        ``{"engine", "llama_cpp_version", "settings", "num_prompts", "rows", "plain", "greedy_check",
        "negative_control", "verify_cost" (:func:`.llamacpp_bench.verify_cost_curve` with ``"break_even"`` per K;
        None when not measured: no ``curve_tokens`` or no ``llama-bench`` in the build), "step_costs"
        (:func:`.llamacpp_bench.step_costs`), "best" (:func:`best_setting`), "fastest" (:func:`fastest_setting`
        with its ``"serve"`` command)}``.
    Raises:
        SpeculatorsError: no prompts, or a server / request failure.
    """
    if not prompts:
        raise SpeculatorsError("engine eval: no prompts")
    rows: list[dict] = []
    outputs: dict[str, list[Completion]] = {}
    passes: dict[str, EnginePass] = {}
    main = st.draft_outtypes[0]

    def do(p: EnginePass) -> dict:
        row, outs = run_pass(lc, models, p, prompts, st)
        rows.append(row)
        outputs[p.label] = outs
        passes[p.label] = p
        log(f"engine eval: {p.label}: {_fmt(row['tokens_per_s'], '.1f')} tok/s, tau {_fmt(row['tau'], '.3f')}, "
            f"accepted {row['accepted']}/{row['drafted']}")
        if p.method.startswith("drafter") and p.p_min is None and row["drafted"] == 0:
            # llama-server logs a draft it cannot use (draft-simple: a vocabulary it finds incompatible) and serves
            # on without speculation: a row of plain decoding must not be reported as the drafter's
            raise SpeculatorsError(f"engine eval: llama-server drafted no token in pass {p.label!r} over "
                                   f"{len(prompts)} prompts: it did not use the draft GGUF (--spec-type "
                                   f"{models.spec_type}; for draft-simple, llama.cpp requires the target's vocabulary "
                                   f"type, BOS/EOS, a size within 128 tokens and equal token texts from id 5)")
        return row

    curve = None
    if st.curve_tokens:
        try:
            curve = verify_cost_curve(lc, models.target, tokens=st.curve_tokens, threads=st.threads, log=log)
            curve["break_even"] = break_even_taus(curve, st.ks or DEFAULT_KS)
        except LlamaCppUnavailable as e:  # a build from elsewhere ($SPECULATORS_LLAMA_CPP) without llama-bench
            log(f"engine eval: no verify-cost curve: {e}")
    plain0 = do(EnginePass("plain"))
    for k in st.ks or DEFAULT_KS:
        do(EnginePass("drafter", k=k, draft_outtype=main))
    for t in st.ngram_types:
        do(EnginePass(t))
    best = _fastest([r for r in rows if r["draft_outtype"] == main], "drafter")
    k_best = best["k"]
    for o in st.draft_outtypes[1:]:
        do(EnginePass("drafter", k=k_best, draft_outtype=o))
    # p_min lets a round stop drafting at an unlikely token, so it can pay at a larger K than the best without it
    for k in sorted({k_best, max(st.ks or DEFAULT_KS)}) if st.p_mins else ():
        for pm in st.p_mins:
            do(EnginePass("drafter", k=k, draft_outtype=main, p_min=pm))
    for n in st.draft_threads:
        do(EnginePass("drafter", k=k_best, draft_outtype=main, draft_threads=n))
    control = None
    if st.negative_control and models.shifted is not None:
        shifted = do(EnginePass("drafter-shifted-taps", k=k_best, draft_outtype=main))
        control = {"k": k_best, "tap_shift": models.shifted_by, "tau": shifted["tau"], "tau_ci": shifted["tau_ci"],
                   "drafter_tau": best["tau"], "drafter_tau_ci": best["tau_ci"],
                   "separated": bool(shifted["tau_ci"] and best["tau_ci"] and shifted["tau_ci"][1] < best["tau_ci"][0])}
    ngram_best = max((r for r in rows if r["method"] in st.ngram_types), key=lambda r: r["tokens_per_s"] or 0,
                     default=None)
    for t in [t for t in st.temperatures if t > 0]:
        do(EnginePass("plain", temperature=t))
        do(EnginePass("drafter", k=k_best, draft_outtype=main, temperature=t))
        for nt in st.ngram_types:
            do(EnginePass(nt, temperature=t))
    for n in [n for n in st.parallel if n > 1]:
        do(EnginePass("plain", parallel=n))
        do(EnginePass("drafter", k=k_best, draft_outtype=main, parallel=n))
        if ngram_best is not None:
            do(EnginePass(ngram_best["method"], parallel=n))
    for r in rows:
        base = next(b for b in rows if b["method"] == "plain" and b["temperature"] == r["temperature"]
                    and b["batch_size"] == r["batch_size"])
        r["speedup"] = (r["tokens_per_s"] / base["tokens_per_s"]) if r["tokens_per_s"] and base["tokens_per_s"] else None
    check = greedy_check(lc, models, prompts, st, outputs, passes, log)
    failed = {lab for lab, c in check["passes"].items() if c["failures"]}
    costs = step_costs(rows, curve, main)
    best = best_setting(rows, st.ngram_types, failed)
    fastest = fastest_setting(rows, failed)
    fastest["serve"] = pass_command(lc, models, passes[fastest["row"]], st) if fastest["row"] else None
    return {"engine": ENGINE, "llama_cpp_version": lc.version, "settings": dataclasses.asdict(st),
            "num_prompts": len(prompts), "rows": rows, "plain": plain0, "greedy_check": check,
            "negative_control": control, "verify_cost": curve, "step_costs": costs, "best": best, "fastest": fastest}


def pass_command(lc: LlamaCpp, models: EngineModels, p: EnginePass, st: EngineSettings) -> str:
    """The ``llama-server`` command line (port 8080) of pass ``p``: what a user runs to serve that setting."""
    return _server(lc, models, p, st).command_line()


def fastest_setting(rows: list[dict], failed: set[str] = frozenset()) -> dict[str, Any]:
    """The fastest pass at temperature 0 and one slot whatever its method (plain decoding, a model-free type or
    the drafter), passes in ``failed`` (greedy check failures) excluded: ``{"row", "method", "tokens_per_s",
    "speedup"}`` (all None when no pass qualifies)."""
    at = [r for r in rows if r["temperature"] == 0 and r["batch_size"] == 1 and r["label"] not in failed
          and r["tokens_per_s"] is not None and r["method"] != "drafter-shifted-taps"]
    if not at:  # every pass failed the check or emitted nothing
        return {"row": None, "method": None, "tokens_per_s": None, "speedup": None}
    r = max(at, key=lambda r: r["tokens_per_s"])
    return {"row": r["label"], "method": r["method"], "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"]}


def best_setting(rows: list[dict], ngram_types=("ngram-simple", "ngram-mod"), failed: set[str] = frozenset(),
                 ) -> dict[str, Any]:
    """The fastest drafter row at temperature 0 and one slot, against plain decoding and the fastest model-free
    type there: ``{"row", "plain_tokens_per_s", "ngram_best", "beats_plain", "beats_ngram"}``. Passes in
    ``failed`` (labels whose greedy outputs failed the check) are never chosen."""
    at = [r for r in rows if r["temperature"] == 0 and r["batch_size"] == 1 and r["label"] not in failed]
    drafter = _fastest(at, "drafter")
    plain = next(r for r in at if r["method"] == "plain")
    ngram = max((r for r in at if r["method"] in ngram_types), key=lambda r: r["tokens_per_s"] or 0, default=None)
    return {"row": drafter["label"] if drafter else None, "tokens_per_s": drafter["tokens_per_s"] if drafter else None,
            "plain_tokens_per_s": plain["tokens_per_s"], "ngram_best": ngram["label"] if ngram else None,
            "ngram_tokens_per_s": ngram["tokens_per_s"] if ngram else None,
            "beats_plain": bool(drafter and drafter["tokens_per_s"] > plain["tokens_per_s"]),
            "beats_ngram": bool(drafter and (ngram is None or drafter["tokens_per_s"] > ngram["tokens_per_s"]))}


def classify_engine_mismatch(srv: LlamaServer, prompt: list[int], plain: list[int], output: list[int]) -> dict:
    """Whether one greedy mismatch sits on a near-tie of the target's logits as the engine computes them.

    At the first differing position ``j`` (plain token ``a``, the other pass's token ``b``), through the plain
    server ``srv``, the engine's top log-probabilities at ``j`` in several shapes: ``seq``, a one-token-at-a-time
    decode of ``j + 1`` tokens (plain decoding's shape; its first ``j`` tokens must replay ``plain``); ``prefill``,
    one forward over ``prompt + plain[:j]``; and ``chunk<c>`` for c in :data:`VERIFY_CHUNKS`, a forward over the
    last c tokens of that prefix on top of its cached KV (a verify step's shape for K = c - 1 drafts). ``gap =
    lp_seq[a] - lp_seq[b]``; ``drift`` = the largest ``|gap - (lp[a] - lp[b])|`` over the other shapes, how much a
    forward's shape moves this pair. ``near_tie`` when both tokens are in every top list and ``gap <=
    NEAR_TIE_FACTOR * drift`` (in particular whenever some shape ranks ``b`` above ``a``). A length difference
    with no differing token, a token outside the top lists or a replay that differs is not a near-tie: it is a
    failure. The server's real steps are not replayed exactly (several slots share a batch; a verify step's
    chunk ends anywhere in it), so a failure here is a difference these shapes do not explain.

    Returns:
        ``{"position", "plain_token", "output_token", "near_tie", "gap", "shape_gaps", "drift", "replayed"}``.
    """
    j = first_diff(plain, output)
    out: dict[str, Any] = {"position": j, "plain_token": plain[j] if j < len(plain) else None,
                           "output_token": output[j] if j < len(output) else None, "near_tie": False,
                           "gap": None, "shape_gaps": None, "drift": None, "replayed": None}
    if out["plain_token"] is None or out["output_token"] is None:
        return out
    a, b = out["plain_token"], out["output_token"]
    seq = srv.complete(prompt, j + 1, n_probs=N_PROBS)
    out["replayed"] = seq.tokens[:j] == plain[:j]
    if not out["replayed"] or len(seq.top_logprobs) <= j:
        return out
    prefix = prompt + plain[:j]
    shapes = {"prefill": (srv.complete(prefix, 1, n_probs=N_PROBS).top_logprobs or [{}])[0]}
    for c in VERIFY_CHUNKS:
        if c < len(prefix):
            shapes[f"chunk{c}"] = srv.last_logprobs(prefix, c, N_PROBS)
    s = seq.top_logprobs[j]
    if not all(t in d for t in (a, b) for d in (s, *shapes.values())):
        return out
    gap = s[a] - s[b]
    gaps = {name: d[a] - d[b] for name, d in shapes.items()}
    drift = max(abs(gap - g) for g in gaps.values())
    out.update(gap=gap, shape_gaps=gaps, drift=drift, near_tie=gap <= NEAR_TIE_FACTOR * drift)
    return out


def greedy_check(lc: LlamaCpp, models: EngineModels, prompts: list[list[int]], st: EngineSettings,
                 outputs: dict[str, list[Completion]], passes: dict[str, EnginePass],
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every other temperature-0 pass (speculative ones, the negative control, plain decoding with several
    slots) against the engine's one-slot plain greedy output, prompt by prompt (module docstring); mismatches
    classified by :func:`classify_engine_mismatch` through one plain server. ``passes``: label -> pass.

    Returns:
        ``{"passes": {label: {"prompts", "mismatches", "near_tie", "failures"}}, "mismatches": [...],
        "near_tie", "failures", "passed"}`` (``passed``: no failure).
    """
    plain_label = EnginePass("plain").label
    plain = outputs[plain_label]
    spec = [lab for lab, p in passes.items() if p.temperature == 0 and lab != plain_label]
    found = []
    for lab in spec:
        for i, o in enumerate(outputs[lab]):
            if o.tokens != plain[i].tokens:
                found.append((lab, i, o.tokens))
    mism = []
    if found:
        with _server(lc, models, EnginePass("plain"), st) as srv:
            for lab, i, toks in found:
                m = classify_engine_mismatch(srv, prompts[i], plain[i].tokens, toks)
                mism.append({"pass": lab, "prompt": i, **m})
    by = {lab: {"prompts": len(prompts), "mismatches": 0, "near_tie": 0, "failures": 0} for lab in spec}
    for m in mism:
        by[m["pass"]]["mismatches"] += 1
        by[m["pass"]]["near_tie" if m["near_tie"] else "failures"] += 1
    n_tie = sum(1 for m in mism if m["near_tie"])
    if mism:
        log(f"engine greedy check: {len(mism)} mismatch(es), {n_tie} on near-ties, {len(mism) - n_tie} failure(s)")
    return {"passes": by, "mismatches": mism, "near_tie": n_tie, "failures": len(mism) - n_tie,
            "passed": len(mism) == n_tie}


def loop_comparison(engine: dict[str, Any], loop_report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The engine's tau beside our loop's for the drafter at each K both measured at temperature 0, batch 1:
    ``[{"k", "engine_tau", "engine_tau_ci", "loop_tau", "loop_tau_ci", "within_loop_ci", "cis_overlap"}]``
    (empty without a loop report or when it was not greedy)."""
    if not loop_report or float(loop_report.get("temperature", 0.0) or 0.0) != 0.0:
        return []
    out = []
    main = (engine.get("settings") or {}).get("draft_outtypes", [None])[0]
    for r in engine["rows"]:
        if not k_sweep_row(r) or r.get("draft_outtype") != main:
            continue
        lr = next((x for x in loop_report.get("rows", []) if x.get("method") == "drafter" and x.get("k") == r["k"]
                   and x.get("batch_size") == 1), None)
        if lr is None or r["tau"] is None:
            continue
        lo, hi = lr["tau_ci"]
        out.append({"k": r["k"], "engine_tau": r["tau"], "engine_tau_ci": r["tau_ci"], "loop_tau": lr["tau"],
                    "loop_tau_ci": lr["tau_ci"], "within_loop_ci": lo <= r["tau"] <= hi,
                    "cis_overlap": r["tau_ci"][0] <= hi and lo <= r["tau_ci"][1]})
    return out


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def row_cells(r: dict[str, Any]) -> tuple[str, str]:
    """An engine report row's ``tau [95% CI]`` and ``accepted / drafted`` cells (``n/a`` / ``-`` without them)."""
    tau = "n/a" if r["tau"] is None else f"{r['tau']:.3f} [{r['tau_ci'][0]:.3f}, {r['tau_ci'][1]:.3f}]"
    return tau, (f"{r['accepted']} / {r['drafted']}" if r["drafted"] else "-")


def loop_comparison_lines(report: dict[str, Any], engine: str) -> list[str]:
    """The markdown table of :func:`loop_comparison`'s rows (the engine's tau beside our loop's), or nothing."""
    rows = report.get("loop_comparison") or []
    if not rows:
        return []
    lines = ["", f"{engine} vs our loop (drafter, temperature 0, batch 1):", "",
             f"| K | {engine} tau [CI] | loop tau [CI] | {engine} tau within loop CI |", "|---|---|---|---|"]
    for c in rows:
        lines.append(f"| {c['k']} | {c['engine_tau']:.3f} [{c['engine_tau_ci'][0]:.3f}, {c['engine_tau_ci'][1]:.3f}]"
                     f" | {c['loop_tau']:.3f} [{c['loop_tau_ci'][0]:.3f}, {c['loop_tau_ci'][1]:.3f}] | "
                     f"{'yes' if c['within_loop_ci'] else 'no'} |")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The engine report as markdown: the rows, the loop comparison, the negative control, the greedy check,
    the best setting (with the engine's timings when no drafter setting wins)."""
    lines = ["# speculators eval --engine llama.cpp", "",
             f"llama.cpp of llama-cpp-python {report['llama_cpp_version']}; {report['num_prompts']} prompts, "
             f"{report['settings']['max_new_tokens']} new tokens each; target `{report.get('target_gguf', '')}`; "
             f"drafter `{report.get('draft_spec_type', '')}`.", "",
             "| pass | slots | tok/s | x plain | tau [95% CI] | accepted / drafted |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        tau, acc = row_cells(r)
        lines.append(f"| {r['label']} | {r['batch_size']} | {_fmt(r['tokens_per_s'], '.1f')} | "
                     f"{_fmt(r['speedup'], '.2f')} | {tau} | {acc} |")
    lines += loop_comparison_lines(report, "Engine")
    nc = report.get("negative_control")
    if nc:
        lines += ["", f"Negative control (aux taps shifted {nc['tap_shift']} layers, K={nc['k']}): tau "
                      f"{_fmt(nc['tau'], '.3f')} against {_fmt(nc['drafter_tau'], '.3f')}; CIs "
                      f"{'separated' if nc['separated'] else 'NOT separated'}."]
    g = report["greedy_check"]
    lines += ["", f"Greedy check (every other temperature-0 pass against the engine's one-slot plain output): "
                  f"{len(g['mismatches'])} mismatch(es), {g['near_tie']} on near-ties of the engine's logits, "
                  f"{g['failures']} failure(s): {'PASS' if g['passed'] else 'FAIL'}."]
    b = report["best"]
    lines += ["", f"Best drafter setting: `{b['row']}` at {_fmt(b['tokens_per_s'], '.1f')} tok/s; plain "
                  f"{_fmt(b['plain_tokens_per_s'], '.1f')}; best model-free `{b['ngram_best']}` "
                  f"{_fmt(b['ngram_tokens_per_s'], '.1f')}."]
    f = report.get("fastest")
    if f and f.get("row"):
        lines += ["", f"Fastest setting overall (temperature 0, one slot): `{f['row']}` at {_fmt(f['tokens_per_s'], '.1f')} "
                      f"tok/s ({_fmt(f['speedup'], '.2f')}x plain):", "", "```bash", f["serve"], "```"]
    lines += curve_lines(report.get("verify_cost"), report["settings"].get("ks") or DEFAULT_KS)
    lines += step_cost_lines(report.get("step_costs") or [])
    if not (b["beats_plain"] and b["beats_ngram"]) and report.get("timings"):
        t = report["timings"]
        lines += ["", f"The drafter does not win here: the engine's target step costs {_fmt(t['target_ms_per_token'], '.2f')}"
                      f" ms per token (plain), a speculative step at the best K costs {_fmt(t['spec_ms_per_step'], '.2f')}"
                      f" ms for tau {_fmt(t['tau'], '.2f')}; break-even needs tau above "
                      f"{_fmt(t['break_even_tau'], '.2f')}."]
    return "\n".join(lines) + "\n"


def timings(report: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's costs behind the best drafter row: ms per plain decode step (one token), ms per speculative
    step (the server's generation time over its decode steps), and the tau at which the drafter would break
    even (step ms / token ms). None when a count is zero."""
    rows = report["rows"]
    plain = plain_row(rows)
    best = next((r for r in rows if r["label"] == report["best"]["row"]), None)
    if plain is None or best is None or not plain["steps"] or not best["steps"] or not plain["decode_seconds"]:
        return None
    token_ms = 1000.0 * plain["decode_seconds"] / plain["steps"]
    step_ms = 1000.0 * best["decode_seconds"] / best["steps"]
    return {"target_ms_per_token": token_ms, "spec_ms_per_step": step_ms, "tau": best["tau"],
            "break_even_tau": step_ms / token_ms}


def write_engine_report(report: dict[str, Any], out: str | Path, render: Callable[[dict], str] | None = None) -> Path:
    """``report.json`` and ``report.md`` of an engine eval in ``out`` (written atomically); ``render``: the markdown
    renderer (default: :func:`render_markdown`, llama.cpp's). Returns ``out``."""
    import json

    from ..utils import atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "report.md", (render or render_markdown)(report))
    return out


__all__ = ["ENGINE", "EngineModels", "EnginePass", "EngineSettings", "NEAR_TIE_FACTOR", "best_setting",
           "classify_engine_mismatch", "engine_row", "fastest_setting", "greedy_check", "loop_comparison", "pass_command",
           "render_markdown", "run_engine_eval", "run_pass", "tap_shift", "timings", "write_engine_report"]
