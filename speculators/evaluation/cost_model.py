"""Cost model of speculative decoding: predicted tokens/s, the best K and the break-even batch size.

Speculation pays when the tokens a step emits outweigh what the step costs over a plain decoding step.
This module predicts, for every method, every ``K' <= K`` (``num_speculative_tokens``) and batch size,
the tokens/s the decoding loop (:func:`speculators.decode.loop.speculative_generate`) reaches, from MEASURED
quantities only, and checks the prediction against every row the eval actually ran.

The model
---------
Acceptance (per method, K' and batch size, from the eval's pass at K' or, for a K' the eval did not run,
at the smallest measured K above it; :func:`acceptance_profile`):
``c_j`` = conditional acceptance of draft position j (P(draft j accepted | drafts 1..j-1 accepted and
draft j proposed): the report's ``conditional``), ``q_j`` = P(draft j proposed | drafts 1..j-1
accepted) (1 for a drafter; below 1 for the n-gram / suffix proposers, which draft only what they
match). The survival ``s_j = prod_{i<=j} q_i c_i`` is the probability that a step's verifier accepts at
least j drafts, and one step emits ``X`` tokens with ``P(X >= j + 1) = s_j`` (capped at ``K' + 1``):

    E[X | K'] = 1 + sum_{j<=K'} s_j                                          (:func:`expected_tokens`)

In the i.i.d. case (``q_j = 1``, ``c_j = a``) this is Leviathan et al. 2023's ``(1 - a^{K'+1}) / (1 - a)``;
the model uses the measured per-position values instead, which fall with j for a trained drafter.

Steps: request i generates ``n_i`` tokens (the plain pass's count: the prefill gives the first, the
steps the rest). Its expected number of steps is the first-passage expectation ``f(n_i - 1)`` with
``f(r) = 1 + sum_x P(X = x) f(r - x)``, ``f(r <= 0) = 0`` (:func:`expected_steps`: the last step of a
request is cut at its stop token or ``max_new_tokens``, as the loop cuts it). Requests join a batch of
``b`` slots in prompt order as slots free (continuous batching, :func:`batch_schedule`), which gives
the number of live requests ``n`` over the run. A batch lasts as long as its slowest request and
``E[max] > max E``, so the schedule is not built from the expectations: each request's steps are drawn
from the same distribution (:func:`sample_steps`, seeded, :data:`SCHEDULE_DRAWS` draws) and the
predicted time is the mean over the draws' schedules (plain decoding's steps are known exactly).

Step time with ``n`` live requests (summed over the schedule by :func:`predict_seconds`):

    step(K', n) = draft(K', n) + E[forward(1 + max_i d_i, n, W)] + sampling(K', n) + overhead(n)

* ``forward(m, n, W)``: one target forward over ``m`` tokens per request for ``n`` requests over a KV
  cache ``W`` slots wide, measured by :func:`measure_costs` (:func:`speculators.evaluation.forward_cost.measure_forward_cost`,
  through the loop's batched decode session) at every batch size of the eval and at TWO context lengths
  (the eval's :func:`eval_context` and twice it), each with the cache width it was timed at; linear in
  ``W`` through those two points (slope floored at 0), then linear in ``n`` between the batch sizes
  (:func:`forward_seconds`); a row the eval ran is charged the forwards measured right before its own
  pass when it carries them ("Adjacent costs" below). ``d_i`` the drafts of request i (``P(d >= j) = ``
  the measured share of steps that drafted >= j, capped at K'; the padded forward is as long as the
  longest row's, the rows taken as independent).
* ``W``: the width the loop's forwards actually ran at, not the context it was measured at. The batch
  session (:class:`speculators.target.BatchDecodeSession`) keeps ONE padded cache: its width is the
  longest live row plus the padding of rows that joined shorter, the rolled-back drafts of every row and
  the slack tolerated until its next automatic compaction, so at batch > 1 (ragged prompts, staggered
  requests) and with speculation (rejected drafts) it exceeds any one request's context. Every pass
  records its mean width per batched forward (``BatchResult.cache_width``, the row's ``cache_width``);
  a method at K' is charged at its passes' mean width, linear in K' between the measured Ks and in the
  batch size between the measured ones (:meth:`_Inputs.width`), plain decoding at its own pass's. The
  charged width is the prediction's ``cache_width``. A report from before widths were recorded (no
  ``cache_width`` in its rows, or costs measured at one context) is charged the forward at its measured
  context, as it was.
* ``draft(K', n)``: the method's measured drafting time per batched step (``propose`` + ``advance``,
  the eval's own ``draft_ms_per_step``), linear in K' between the measured Ks and constant outside them
  (one measured K: constant in K', exact for parallel drafters and the model-free proposers, an
  overestimate of a smaller K's drafting for autoregressive drafters), linear in ``n`` between the
  batch sizes (each taken at its pass's mean number of live requests).
* ``sampling(K', n)``: the rejection sampler's time per batched step (the pass's verify time outside the
  target forwards: ``(verify_seconds - forward_seconds) / batched steps``), measured per method and
  interpolated in K' and ``n`` as drafting is; plain decoding's from its own pass. At temperature > 0
  it grows with the verified tokens (a softmax / top-p over the vocabulary per position).
* ``overhead(n)``: what a PLAIN decoding step spends outside the forward and the sampler (emitting,
  stop checks, cache bookkeeping), measured in the plain pass: ``(seconds - prefill - verify seconds) /
  batched steps``, linear in ``n`` between batch sizes. It is charged unchanged to speculative steps.

Predicted seconds = prefill (the method's measured prompt prefills and proposer ``start``, mean over its
passes at that batch size) + the sum of ``step`` over the schedule; predicted tokens/s = the plain pass's
tokens / predicted seconds; plain decoding is the same model with ``K' = 0`` and no drafting (its
step: ``forward(1, n, W) + sampling + overhead(n)``, the forward the only part not read from its own pass).
Speedup = predicted tokens/s over predicted plain tokens/s.

Assumptions (each a source of error the report's per-row ``relative_error`` shows): for a K' the eval
did not run, acceptance at positions ``<= K'`` is that of the next larger measured K (a proposer that
drafts more tokens per step may match at other positions); a speculative step's bookkeeping is a
plain step's (the proposer's bookkeeping outside ``propose`` / ``advance``, e.g. slicing the target
features it is advanced with, is not charged); steps are i.i.d. per request (a proposer's acceptance
varies with the text: the draws' spread is a lower bound of the real one); the forward's cost is linear
in the cache width and charged at a pass's MEAN width (exact for a linear cost at a fixed number of live
requests; the width and the live requests vary together over a run); the machine's speed is taken as
constant over one pass and the forwards measured next to it (what drift remains shows up as the gap
between ``forward_ms_per_step`` and the pass's own ``loop_forward_ms_per_step``); at temperature > 0
outputs (and lengths) differ between passes.
Batch sizes between the measured ones are predicted with costs interpolated in ``n``; nothing is
extrapolated beyond the largest measured batch size.

Adjacent costs
--------------
A machine's speed drifts over the minutes an eval takes (load from other processes, clocks, a shared
VM): on a 2-core VM the same 1-token forward took 44.8 ms at the start of an eval and 27.0 ms nine
minutes later, and rows decoded late were mispredicted by 20-60% from costs measured once at the start,
while the pass's own forward time predicted them. What the model must get right is the RATIO of a pass's
time to its forwards, and a ratio of two times measured next to each other beats two absolute times
measured minutes apart. So :func:`speculators.evaluation.runner.run_eval` (``adjacent_costs=True``) measures the
forwards at a pass's batch size right before every decode pass (:func:`measure_pass_costs`, the row's
``pass_costs``), and a row the eval ran (method rows and plain rows) is predicted from them
(:func:`drifted_costs`: its own forwards at its batch size, the eval's costs at the other batch sizes
(live requests below it, in the schedule's tail) scaled by the drift at its batch size); its prediction
records ``costs_source: "adjacent"``. Everything else is predicted from the eval's costs (``costs``,
``costs_source: "eval"``): rows without ``pass_costs`` (older reports, ``adjacent_costs=False``), the K'
the eval did not run, and every COMPARISON: ``predicted_speedup``, ``best_k`` and ``break_even`` are
computed from the eval's costs alone, so that methods are compared at one machine speed, not at whatever
speed the machine had while each ran (``eval_costs_tokens_per_s`` is a measured row's prediction from them).

A ratio with a zero denominator is None (``n/a``), never 0.
"""

from __future__ import annotations

import heapq
import math

from ..errors import SpeculatorsError
from .costs import _check_int, expected_forward_seconds, interpolate
from .costs import drifted_costs
from .settings import PassKey


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# ----------------------------------------------------------------------------- a pass's time split


def step_times(out) -> dict:
    """The time split of a decode pass (:class:`speculators.decode.state.BatchResult`), the report row fields
    this model reads: ``draft_seconds`` / ``verify_seconds`` / ``prefill_seconds`` / ``forward_seconds``
    (s; the forward is part of verifying), ``batched_steps`` (batched target forwards),
    ``draft_ms_per_step`` / ``verify_ms_per_step`` (ms per batched step, a step being one batched target
    forward = one request's step at batch 1; drafting is 0 for plain decoding) and ``cache_width`` (the
    batch session's mean cache width per batched forward, slots; 0.0 when the loop read none)."""
    steps = max(int(out.target_forwards), 1)
    return {"draft_seconds": out.draft_seconds, "verify_seconds": out.verify_seconds,
            "prefill_seconds": out.prefill_seconds, "forward_seconds": out.forward_seconds,
            "batched_steps": int(out.target_forwards), "draft_ms_per_step": 1000.0 * out.draft_seconds / steps,
            "verify_ms_per_step": 1000.0 * out.verify_seconds / steps,
            "cache_width": getattr(out, "cache_width", None)}


# ----------------------------------------------------------------------------- acceptance


def acceptance_profile(steps: int, pos_drafted: list[int], pos_accepted: list[int],
                       pos_reached: list[int]) -> dict | None:
    """Per draft position j = 1..K, from the counts of :class:`speculators.evaluation.acceptance.AcceptanceStats`:
    ``conditional`` c_j = accepted_j / reached_j, ``continuation`` q_j = reached_j / accepted_{j-1}
    (accepted_0 = steps), ``survival`` s_j = prod_{i<=j} q_i c_i = accepted_j / steps (P(>= j drafts
    accepted)) and ``drafted_at_least`` = drafted_j / steps (P(a step drafts >= j)). A position no step
    reached has c_j (and q_j when nothing reached j - 1) None and survival 0.

    Returns:
        the four ``[K]`` lists, or None when there was no step (every ratio would divide by zero).
    Raises:
        SpeculatorsError: the three lists differ in length.
    """
    if not len(pos_drafted) == len(pos_accepted) == len(pos_reached):
        raise SpeculatorsError(f"acceptance_profile: per-position counts of different lengths "
                               f"({len(pos_drafted)}, {len(pos_accepted)}, {len(pos_reached)})")
    if not steps:
        return None
    prev = [steps, *pos_accepted[:-1]]
    return {"conditional": [_ratio(a, r) for a, r in zip(pos_accepted, pos_reached)],
            "continuation": [_ratio(r, p) for r, p in zip(pos_reached, prev)],
            "survival": [a / steps for a in pos_accepted],
            "drafted_at_least": [d / steps for d in pos_drafted]}


def survival(conditional: list[float | None], continuation: list[float | None] | None = None) -> list[float]:
    """``s_j = prod_{i<=j} q_i c_i`` (q = 1 without ``continuation``); a None factor (position never
    reached) makes s_j and every later one 0.

    Raises:
        SpeculatorsError: a probability outside [0, 1], or lists of different lengths.
    """
    q = [1.0] * len(conditional) if continuation is None else list(continuation)
    if len(q) != len(conditional):
        raise SpeculatorsError(f"survival: {len(conditional)} conditional values but {len(q)} continuation values")
    out, s = [], 1.0
    for c, qq in zip(conditional, q):
        for v in (c, qq):
            if v is not None and not 0.0 <= v <= 1.0:
                raise SpeculatorsError(f"survival: probabilities must lie in [0, 1], got {v!r}")
        s = 0.0 if c is None or qq is None else s * qq * c
        out.append(s)
    return out


def expected_tokens(surv: list[float], k: int) -> float:
    """``E[X | K'] = 1 + sum_{j<=k} s_j``: expected tokens one step emits (accepted drafts + the
    recovered/bonus token) when it drafts up to ``k`` tokens (Leviathan et al. 2023's
    ``(1 - a^{k+1}) / (1 - a)`` when every ``s_j = a^j``).

    Raises:
        SpeculatorsError: ``k`` < 0 or above the measured positions (``len(surv)``).
    """
    k = _check_int("k", k, 0)
    if k > len(surv):
        raise SpeculatorsError(f"expected_tokens: K'={k} is above the {len(surv)} measured draft positions")
    return 1.0 + sum(surv[:k])


def emitted_distribution(surv: list[float], k: int) -> list[float]:
    """``[P(X = 1), ..., P(X = k + 1)]`` of a step drafting up to ``k``: ``P(X = x) = s_{x-1} - s_x``
    (``s_0 = 1``, ``s_{k+1} = 0``). Raises as :func:`expected_tokens`."""
    expected_tokens(surv, k)
    s = [1.0, *surv[:k], 0.0]
    return [max(s[x] - s[x + 1], 0.0) for x in range(k + 1)]


def expected_steps(dist: list[float], n_max: int) -> list[float]:
    """``f[r]`` for r = 0..n_max: the expected steps to emit r more tokens when a step emits x tokens with
    probability ``dist[x - 1]`` and the last step is cut at r: ``f(0) = 0``, ``f(r) = 1 + sum_x P(X = x)
    f(max(r - x, 0))``.

    Raises:
        SpeculatorsError: an empty ``dist``, ``P(X = 1) = 1`` is fine, a ``dist`` that does not sum to 1
            (within 1e-6) or ``n_max`` < 0.
    """
    n_max = _check_int("n_max", n_max, 0)
    if not dist or abs(sum(dist) - 1.0) > 1e-6 or min(dist) < 0:
        raise SpeculatorsError(f"expected_steps: dist must be a probability distribution over 1..K+1 tokens, "
                               f"got {dist!r}")
    f = [0.0] * (n_max + 1)
    for r in range(1, n_max + 1):
        f[r] = 1.0 + sum(p * f[max(r - x, 0)] for x, p in enumerate(dist, start=1) if p)
    return f


def sample_steps(dist: list[float], remaining: list[int], reps: int, seed: int = 0):
    """``[reps, N]`` sampled step counts: request i emits ``remaining[i]`` tokens in steps that emit x
    tokens with probability ``dist[x - 1]`` (i.i.d., the last step cut), drawn ``reps`` times from
    ``numpy.random.default_rng(seed)``. Their mean is :func:`expected_steps`; the schedule of a batch
    needs the draws themselves (a batch lasts as long as its slowest request: ``E[max] > max E``).

    Raises:
        SpeculatorsError: as :func:`expected_steps`, or ``reps`` < 1.
    """
    import numpy as np

    expected_steps(dist, 0)
    reps = _check_int("reps", reps, 1)
    rng = np.random.default_rng(seed)
    p = np.asarray(dist, dtype=np.float64) / sum(dist)
    out = np.zeros((reps, len(remaining)), dtype=np.int64)
    for i, r in enumerate(remaining):
        if r > 0:
            cum = np.cumsum(rng.choice(len(p), size=(reps, r), p=p) + 1, axis=1)
            out[:, i] = np.argmax(cum >= r, axis=1) + 1
    return out


# ----------------------------------------------------------------------------- schedule


def batch_schedule(durations: list[float], batch_size: int) -> list[tuple[int, float]]:
    """Continuous batching of requests that take ``durations[i]`` steps each (>= 0): at most
    ``batch_size`` live, request i joins (in order) when the earliest slot frees. Returns the segments
    ``[(live requests, steps)]`` of the run, in time order, empty segments left out (their steps sum to
    the makespan).

    Raises:
        SpeculatorsError: ``batch_size`` < 1 or a negative duration.
    """
    b = _check_int("batch_size", batch_size, 1)
    if any(d < 0 for d in durations):
        raise SpeculatorsError(f"batch_schedule: durations must be >= 0, got {durations!r}")
    free: list[float] = []
    events: list[tuple[float, int]] = []
    for d in durations:
        start = heapq.heappop(free) if len(free) == b else 0.0
        heapq.heappush(free, start + d)
        events += [(start, 1), (start + d, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # a request leaves before the next one joins at the same time
    out, live, t = [], 0, 0.0
    for when, delta in events:
        if when > t and live:
            out.append((live, when - t))
        t, live = max(t, when), live + delta
    return out


def predict_seconds(durations: list[float], batch_size: int, prefill: float, step) -> tuple[float, float, list[float]]:
    """A run's predicted seconds over the schedule of :func:`batch_schedule`: ``prefill + sum over its
    segments of steps * sum(step(live))``, where ``step(live)`` gives one batched step's parts in seconds
    (drafting, forward, rejection sampling, overhead) with ``live`` requests.

    Returns:
        ``(seconds, batched steps, [seconds of each part summed over the run])``.
    """
    sums, steps, cache = None, 0.0, {}
    for live, n_steps in batch_schedule(durations, batch_size):
        if live not in cache:
            cache[live] = list(step(live))
        sums = [0.0] * len(cache[live]) if sums is None else sums
        steps += n_steps
        sums = [a + n_steps * v for a, v in zip(sums, cache[live])]
    sums = sums or []
    return prefill + sum(sums), steps, sums


def tokens_per_s(tokens: int, seconds: float) -> float | None:
    """``tokens / seconds``, None when no time was predicted."""
    return tokens / seconds if seconds > 0 and math.isfinite(seconds) else None


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``(predicted - measured) / measured``; None when either is missing or ``measured`` is 0."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


# ----------------------------------------------------------------------------- the report block


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _occupancy(row: dict) -> float:
    """Mean live requests per batched step of a pass (request steps / batched steps; 1 without steps)."""
    return row["steps"] / row["batched_steps"] if row.get("batched_steps") else 1.0


#: draws of the requests' step counts a prediction averages its schedule over (:func:`sample_steps`)
SCHEDULE_DRAWS = 16


class _Inputs:
    """What :func:`cost_model_block` reads from an eval, arranged per batch size: the forward costs, the
    plain passes' per-step sampling, overhead and prefills, the method passes' drafting and sampling time
    and prefills, the
    acceptance profiles (per measured K) and each batch size's per-request token counts."""

    def __init__(self, report: dict, stats: dict, plain_tokens: dict, costs: dict):
        self.costs, self.ks, self.kmax = costs, report["ks"], max(report["ks"])
        self.bs = list(report["batch_sizes"])
        self.rows = {(r["method"], r["k"], r["batch_size"]): r for r in report["rows"]}
        self.plain = {p["batch_size"]: p for p in report["plain_rows"]}
        self.tokens = {int(b): list(t) for b, t in plain_tokens.items()}
        self.overhead_by_b = {b: (p["seconds"] - p.get("prefill_seconds", 0.0) - p.get("verify_seconds", 0.0))
                              / p["batched_steps"] for b, p in self.plain.items() if p.get("batched_steps")}
        self.overhead = [(_occupancy(self.plain[b]), o) for b, o in self.overhead_by_b.items()]
        self.plain_sampling = [(_occupancy(p), _sampling_per_step(p)) for p in self.plain.values()
                               if p.get("batched_steps")]
        self.profiles = {PassKey(*key): acceptance_profile(st.steps, st.pos_drafted, st.pos_accepted, st.pos_reached)
                         for key, st in stats.items()}
        self._steps: dict = {}

    def profile(self, method: str, k: int, b: int) -> dict | None:
        """The acceptance profile of ``method`` at K' = ``k``: the pass at the smallest measured K >= k."""
        return self.profiles.get(PassKey(method, min(x for x in self.ks if x >= k), b))

    def nearest(self, b: int) -> int:
        """The measured batch size closest to ``b`` (the larger one on a tie)."""
        return min(self.bs, key=lambda x: (abs(x - b), -x))

    def prefill(self, method: str | None, b: int) -> float:
        if method is None:
            pts = [(float(x), self.plain[x].get("prefill_seconds", 0.0)) for x in self.bs]
        else:
            pts = [(float(x), _mean([self.rows[(method, k, x)].get("prefill_seconds", 0.0) for k in self.ks]))
                   for x in self.bs]
        return interpolate(pts, b)

    def per_step(self, method: str, part, k: int, live: float) -> float:
        """``part(row)`` (seconds per batched step of a pass) of ``method``'s passes, linear in K between
        the measured Ks (constant outside), then linear in ``live`` between the batch sizes (each at its
        passes' mean live requests)."""
        pts = []
        for x in self.bs:
            rs = [self.rows[(method, kk, x)] for kk in self.ks]
            pts.append((_mean([_occupancy(r) for r in rs]), interpolate([(float(r["k"]), part(r)) for r in rs], k)))
        return interpolate(pts, live)

    def width(self, method: str | None, k: int, b: int) -> float | None:
        """The cache width (slots) the forwards of ``method`` at K' = ``k`` (None: plain decoding) at batch
        size ``b`` are charged at: its passes' mean ``cache_width``, linear in K between the measured Ks
        (constant outside), then linear in the batch size between the measured ones; None when a pass
        recorded none (a report from before widths were recorded: the forward at the measured context)."""
        pts = []
        for x in self.bs:
            rs = [self.plain[x]] if method is None else [self.rows[(method, kk, x)] for kk in self.ks]
            if not all(r.get("cache_width") for r in rs):
                return None
            pts.append((float(x), interpolate([(float(r.get("k", 0)), r["cache_width"]) for r in rs], k)))
        return interpolate(pts, b)

    def step_counts(self, method: str, k: int, b_ref: int):
        """Sampled steps ``[SCHEDULE_DRAWS, N]`` of each request of batch size ``b_ref``'s plain pass under
        ``method`` at ``k`` (:func:`sample_steps`, seed 0), or None without an acceptance profile."""
        key = (method, k, b_ref)
        if key not in self._steps:
            prof = self.profile(method, k, b_ref)
            toks = self.tokens.get(b_ref, [])
            self._steps[key] = None if prof is None else sample_steps(
                emitted_distribution(prof["survival"], k), [max(t - 1, 0) for t in toks], SCHEDULE_DRAWS)
        return self._steps[key]


def _draft_per_step(row: dict) -> float:
    return row["draft_seconds"] / row["batched_steps"] if row.get("batched_steps") else 0.0


def _sampling_per_step(row: dict) -> float:
    """Rejection sampling per batched step: the pass's verify time outside the target forwards."""
    if not row.get("batched_steps"):
        return 0.0
    return max(row.get("verify_seconds", 0.0) - row.get("forward_seconds", 0.0), 0.0) / row["batched_steps"]


def _run_prediction(inp: _Inputs, method: str | None, k: int, b: int, costs: dict | None = None) -> dict | None:
    """Predicted seconds (and their parts) of ``method`` at ``k`` (None: plain decoding) and batch size ``b``,
    its forwards from ``costs`` (None: the eval's)."""
    costs = inp.costs if costs is None else costs
    b_ref = inp.nearest(b)
    toks = inp.tokens.get(b_ref, [])
    if method is None:
        draws, at_least = [[max(t - 1, 0) for t in toks]], []
    else:
        draws = inp.step_counts(method, k, b_ref)
        if draws is None:
            return None
        draws, at_least = draws.tolist(), inp.profile(method, k, b_ref)["drafted_at_least"]

    def step(live: int) -> tuple[float, float, float, float]:
        if method is None:
            sampling = interpolate(inp.plain_sampling, live) if inp.plain_sampling else 0.0
        else:
            sampling = inp.per_step(method, _sampling_per_step, k, live)
        return (0.0 if method is None else inp.per_step(method, _draft_per_step, k, live),
                expected_forward_seconds(costs, at_least, k if method else 0, live, width), sampling,
                interpolate(inp.overhead, live) if inp.overhead else 0.0)

    prefill, cache, width = inp.prefill(method, b), {}, inp.width(method, k, b)

    def cached(live: int):
        if live not in cache:
            cache[live] = step(live)
        return cache[live]

    runs = [predict_seconds(d, b, prefill, cached) for d in draws]  # the mean over the draws
    seconds, steps = _mean([r[0] for r in runs]), _mean([r[1] for r in runs])
    sums = [_mean([(r[2] or [0.0] * 4)[j] for r in runs]) for j in range(4)]
    ms = [None if not steps else 1000.0 * x / steps for x in sums]
    return {"tokens": sum(toks), "seconds": seconds, "batched_steps": steps, "prefill_seconds": prefill,
            "draft_ms_per_step": ms[0], "forward_ms_per_step": ms[1], "sampling_ms_per_step": ms[2],
            "overhead_ms_per_step": ms[3], "cache_width": width,
            "tokens_per_s": tokens_per_s(sum(toks), seconds)}


def _loop_forward_ms(row: dict) -> float | None:
    """The pass's own target forwards per batched step (ms), beside the predicted ``forward_ms_per_step``
    (what the separately measured forwards give over the predicted schedule): where they differ, the
    forward measurement (context length, machine load) is the error's source."""
    return 1000.0 * row.get("forward_seconds", 0.0) / row["batched_steps"] if row.get("batched_steps") else None


def _speedup(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _break_even(inp: _Inputs, method: str, plain_by_b: dict) -> dict:
    """The smallest batch size (1 .. the largest measured) at which no K' <= K has a predicted speedup >= 1."""
    best: dict[str, float | None] = {}
    for b in range(1, max(inp.bs) + 1):
        plain = plain_by_b.get(b) or _run_prediction(inp, None, 0, b)
        sp = [_speedup((_run_prediction(inp, method, k, b) or {}).get("tokens_per_s"), plain["tokens_per_s"])
              for k in range(1, inp.kmax + 1)]
        known = [s for s in sp if s is not None]
        best[str(b)] = max(known) if known else None
        if best[str(b)] is not None and best[str(b)] < 1.0:
            note = ("speculation does not pay at batch size 1" if b == 1 else
                    f"stops paying at batch size {b} (costs interpolated between the measured batch sizes)")
            return {"batch_size": b, "best_speedup_by_batch": best, "note": note}
    return {"batch_size": None, "best_speedup_by_batch": best,
            "note": f"pays at every batch size up to {max(inp.bs)}: not within the measured batch sizes "
                    f"{inp.bs} (not extrapolated)"}


def _own_prediction(inp: _Inputs, row: dict | None, method: str | None, k: int, b: int,
                    p_eval: dict | None) -> tuple[dict | None, str]:
    """A measured row's prediction from the forwards measured next to its pass (``row["pass_costs"]``,
    :func:`drifted_costs`) and ``"adjacent"``; ``(p_eval, "eval")`` without them."""
    own = drifted_costs(inp.costs, (row or {}).get("pass_costs"), b, k)
    if own is None:
        return p_eval, "eval"
    return _run_prediction(inp, method, k, b, own), "adjacent"


_PARTS = ("forward_ms_per_step", "sampling_ms_per_step", "overhead_ms_per_step", "cache_width")


def _plain_predictions(inp: _Inputs) -> tuple[dict, list[dict]]:
    """Plain decoding per batch size: ``({b: prediction from the eval's costs}, [the report's plain entries,
    each predicted from its pass's adjacent costs when recorded])``."""
    plain_by_b, out = {}, []
    for b in inp.bs:
        row = inp.plain[b]
        p_eval = plain_by_b[b] = _run_prediction(inp, None, 0, b)
        p, source = _own_prediction(inp, row, None, 0, b, p_eval)
        meas = row["tokens_per_s"]
        out.append({"batch_size": b, "predicted_tokens_per_s": p["tokens_per_s"], "measured_tokens_per_s": meas,
                    "relative_error": relative_error(p["tokens_per_s"], meas), "costs_source": source,
                    "eval_costs_tokens_per_s": p_eval["tokens_per_s"],
                    "loop_forward_ms_per_step": _loop_forward_ms(row), **{f: p[f] for f in _PARTS}})
    return plain_by_b, out


def cost_model_block(report: dict, stats: dict, plain_tokens: dict, costs: dict) -> dict:
    """The report's ``cost_model`` block (:class:`speculators.evaluation.report_types.CostModel`; the model is this
    module's docstring).

    Args:
        report: an eval report with ``methods``, ``ks``, ``batch_sizes``, ``rows`` and ``plain_rows`` (each
            row with ``seconds``, ``steps``, ``batched_steps``, ``draft_seconds``, ``prefill_seconds``, plain
            rows with ``forward_seconds``).
        stats: ``{PassKey: AcceptanceStats}`` (:class:`speculators.evaluation.settings.PassKey`) of the ungated passes (``steps``,
            ``pos_drafted``, ``pos_accepted``, ``pos_reached``).
        plain_tokens: ``{batch_size: [tokens of each request]}`` of the plain passes.
        costs: :func:`measure_costs` at (at least) the report's batch sizes and its largest K.
    Returns:
        ``{"costs", "overhead_ms_per_step", "plain", "predictions", "best_k", "break_even",
        "max_abs_relative_error", "within_15_percent"}``: ``predictions`` has one entry per method, K' = 1..K
        and measured batch size (``measured: True`` and ``measured_tokens_per_s`` / ``relative_error`` /
        ``loop_forward_ms_per_step`` (the pass's own forwards per batched step) on the rows the eval ran;
        ``cache_width`` the width (slots) its forwards were charged at, None on a report without widths;
        ``costs_source`` ``"adjacent"`` where a measured row was predicted from its ``pass_costs``
        (:func:`drifted_costs`), else ``"eval"`` (``costs``); ``eval_costs_tokens_per_s`` the prediction
        from ``costs``, which ``predicted_speedup``, ``best_k`` and ``break_even`` are computed from);
        ``plain`` the same per batch size;
        ``best_k`` ``{batch: {method: K'}}`` by predicted speedup (ties: the smaller K'); ``break_even``
        ``{method: {"batch_size" (None: never within the measured range), "best_speedup_by_batch", "note"}}``.
    Raises:
        SpeculatorsError: ``costs`` misses a batch size of the report or measured fewer than K + 1 lengths.
    """
    missing = [b for b in report["batch_sizes"] if str(b) not in costs.get("seconds", {})]
    if missing or any(len(c) < max(report["ks"]) + 1 for c in costs.get("seconds", {}).values()):
        raise SpeculatorsError(f"cost model: the measured forward costs must cover batch sizes "
                               f"{report['batch_sizes']} and 1..{max(report['ks']) + 1} tokens; got batch sizes "
                               f"{sorted(costs.get('seconds', {}))} (missing {missing}), k={costs.get('k')}")
    inp = _Inputs(report, stats, plain_tokens, costs)
    plain_by_b, plain_out = _plain_predictions(inp)
    preds: list[dict] = []
    best_k: dict[str, dict[str, int]] = {}
    for b in inp.bs:
        for method in report["methods"]:
            cands = []
            for k in range(1, inp.kmax + 1):
                prof, p_eval = inp.profile(method, k, b), _run_prediction(inp, method, k, b) or {}
                row = inp.rows.get((method, k, b))
                p, source = _own_prediction(inp, row, method, k, b, p_eval) if row else (p_eval, "eval")
                p, meas = p or {}, row["tokens_per_s"] if row else None
                sp = _speedup(p_eval.get("tokens_per_s"), plain_by_b[b]["tokens_per_s"])
                cands.append((sp if sp is not None else -math.inf, -k))
                preds.append({"method": method, "k": k, "batch_size": b, "measured": row is not None,
                              "expected_tokens_per_step": expected_tokens(prof["survival"], k) if prof else None,
                              **{f: p.get(f) for f in ("draft_ms_per_step", "prefill_seconds", *_PARTS)},
                              "predicted_tokens_per_s": p.get("tokens_per_s"), "predicted_speedup": sp,
                              "measured_tokens_per_s": meas, "costs_source": source,
                              "eval_costs_tokens_per_s": p_eval.get("tokens_per_s"),
                              "relative_error": relative_error(p.get("tokens_per_s"), meas),
                              "loop_forward_ms_per_step": _loop_forward_ms(row) if row else None})
            best_k.setdefault(str(b), {})[method] = -max(cands)[1]
    errs = [abs(e["relative_error"]) for e in preds + plain_out if e["relative_error"] is not None]
    return {"costs": costs,
            "overhead_ms_per_step": {str(b): 1000.0 * o for b, o in inp.overhead_by_b.items()},
            "plain": plain_out, "predictions": preds, "best_k": best_k,
            "break_even": {m: _break_even(inp, m, plain_by_b) for m in report["methods"]},
            "max_abs_relative_error": max(errs) if errs else None,
            "within_15_percent": all(e <= 0.15 for e in errs) if errs else None}
