"""The target-forward costs an eval's cost model reads: measured once per eval and next to every pass.

:func:`measure_costs` times ONE target forward over ``m = 1..k+1`` tokens per request at every batch size of
an eval and at two context lengths (:func:`eval_context` and twice it), through the loop's own batch session
(:func:`speculators.evaluation.forward_cost.measure_forward_cost`); :func:`measure_pass_costs` is the same at one pass's
batch size, right before that pass (a report row's ``pass_costs``), and :func:`drifted_costs` the table a
pass is predicted with from it (the rule and why: :mod:`speculators.evaluation.cost_model`, "Adjacent costs").
:func:`forward_seconds` / :func:`expected_forward_seconds` read a table at a number of tokens, live requests
and cache width (linear in the width through the two contexts, then in the live requests between the batch
sizes); :func:`gate_cost` is the cost-aware confidence gate's batch-1 list.
"""

from __future__ import annotations

from ..errors import SpeculatorsError


def _check_int(name: str, v, lo: int) -> int:
    """``v`` when it is an int (not a bool) >= ``lo``; else SpeculatorsError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpeculatorsError(f"cost model: {name} must be an integer >= {lo}, got {v!r}")
    return v


def measure_costs(target, k: int, batch_sizes: list[int], reps: int = 5, context: int = 32,
                  seed: int = 0, long_context: int | None = None) -> dict:
    """The target-forward costs of an eval: at every batch size ``b`` of ``batch_sizes``, the ``[k + 1]``
    seconds of one forward over ``m = 1..k+1`` tokens per request for ``b`` requests after ``context``
    tokens each, and again after ``long_context`` tokens each (:func:`speculators.evaluation.forward_cost.measure_forward_cost`,
    median of ``reps``), with the cache width (slots) each was timed at: two points of the forward's cost
    as a linear function of the width, which :func:`forward_seconds` charges at the width the loop ran at.
    The cost-aware confidence gate reads the batch-1 list at ``context`` (:func:`gate_cost`).

    Args:
        long_context: the second context length (tokens, > ``context``); None = ``2 * context``.
    Returns:
        ``{"k", "context", "reps", "batch_sizes": sorted, "seconds": {str(b): [k + 1] s}, "width": {str(b):
        [k + 1] slots}, "long_context", "long_seconds", "long_width"}`` (JSON-native; ``long_*`` as
        ``seconds`` / ``width`` at ``long_context``).
    Raises:
        SpeculatorsError: ``k`` < 0, ``reps`` / ``context`` < 1, ``long_context`` <= ``context``, or a batch
            size that is not an integer >= 1.
    """
    from .forward_cost import measure_forward_cost

    bs = sorted({_check_int("batch size", b, 1) for b in batch_sizes})
    if not bs:
        raise SpeculatorsError("cost model: measure_costs needs at least one batch size")
    context = _check_int("context", context, 1)
    long_context = 2 * context if long_context is None else _check_int("long_context", long_context, context + 1)
    short = {b: measure_forward_cost(target, k, reps, context, seed, batch_size=b) for b in bs}
    long = {b: measure_forward_cost(target, k, reps, long_context, seed, batch_size=b) for b in bs}
    return {"k": _check_int("k", k, 0), "context": context, "reps": reps, "batch_sizes": bs,
            "seconds": {str(b): short[b]["seconds"] for b in bs}, "width": {str(b): short[b]["width"] for b in bs},
            "long_context": long_context, "long_seconds": {str(b): long[b]["seconds"] for b in bs},
            "long_width": {str(b): long[b]["width"] for b in bs}}


def gate_cost(costs: dict) -> list[float]:
    """The batch-1 forward costs ``[k + 1]`` (s) of :func:`measure_costs`: the ``verify_cost`` of
    :class:`speculators.decode.gating.ConfidenceGate` (its smallest measured batch size when 1 was not measured)."""
    return list(costs["seconds"][str(min(costs["batch_sizes"]))])


def measure_pass_costs(target, k: int, batch_size: int, context: int, long_context: int | None = None,
                       reps: int = 3) -> dict:
    """The target-forward costs measured right before ONE decode pass (a report row's ``pass_costs``):
    :func:`measure_costs` at that pass's batch size alone, over ``1..k+1`` tokens at ``context`` and
    ``long_context`` (None = ``2 * context``) tokens, median of ``reps`` (3: a few seconds on a CPU).

    Returns:
        :func:`measure_costs`'s dict with ``batch_sizes == [batch_size]`` (seconds in s, widths in slots).
    Raises:
        SpeculatorsError: as :func:`measure_costs`.
    """
    return measure_costs(target, k, [batch_size], reps=reps, context=context, long_context=long_context)


_LINE_KEYS = ("width", "long_seconds", "long_width")  # the second context's point: all of them or none


def drifted_costs(costs: dict, adjacent: dict | None, batch_size: int, k: int) -> dict | None:
    """The forward costs a pass at ``batch_size`` is predicted with (module docstring, "Adjacent costs"):
    at ``batch_size`` its own ``adjacent`` measurement (:func:`measure_pass_costs`), at the eval's other
    batch sizes ``costs`` with every time scaled by the drift at ``batch_size`` (adjacent / eval, summed
    over the lengths and contexts both measured); widths as measured.

    Args:
        costs: the eval's :func:`measure_costs`. adjacent: the pass's ``pass_costs`` (None: none recorded).
        batch_size: the pass's batch size. k: its K (the forwards needed: ``1..k+1`` tokens).
    Returns:
        a :func:`measure_costs`-shaped dict, or None when ``adjacent`` is None or misses ``batch_size`` or
        one of the ``k + 1`` lengths (the caller then uses ``costs``).
    """
    key = str(batch_size)
    if not adjacent or len(adjacent.get("seconds", {}).get(key, [])) < k + 1:
        return None
    line = all(costs.get(x) and adjacent.get(x) for x in _LINE_KEYS)
    timed = ("seconds", "long_seconds") if line else ("seconds",)
    n = {t: min(len(adjacent[t][key]), len(costs[t].get(key, []))) for t in timed}  # lengths both measured
    own, ref = (sum(sum(c[t].get(key, [])[:n[t]]) for t in timed) for c in (adjacent, costs))
    drift = own / ref if ref > 0 and own > 0 else 1.0
    out = {"k": adjacent.get("k", k), "context": adjacent.get("context"), "reps": adjacent.get("reps"),
           "batch_sizes": sorted({*costs["batch_sizes"], batch_size})}
    for t in ("seconds", *(_LINE_KEYS if line else ())):
        scale = drift if t.endswith("seconds") else 1.0
        out[t] = {str(b): [scale * x for x in costs[t][str(b)]] for b in costs["batch_sizes"] if b != batch_size}
        out[t][key] = list(adjacent[t][key])
    if line:
        out["long_context"] = adjacent.get("long_context")
    return out


def eval_context(prompts: list[dict], max_new_tokens: int) -> int:
    """The context length the forward costs of an eval are measured at: the prompts' mean length plus
    half of ``max_new_tokens`` (a request's mean context over its decode), at least 1."""
    lens = [len(p["input_ids"]) for p in prompts]
    return max(1, int(round(sum(lens) / max(len(lens), 1) + max_new_tokens / 2)))


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` ``[(x, y)]`` (sorted here), constant outside them.

    Raises:
        SpeculatorsError: no points.
    """
    if not points:
        raise SpeculatorsError("interpolate: no points")
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def forward_seconds(costs: dict, m: int, live: float, width: float | None = None) -> float:
    """One target forward (s) over ``m`` tokens per request for ``live`` requests over a cache ``width``
    slots wide: at each measured batch size the :func:`measure_costs` seconds (its last length beyond the
    measured ones), linear in ``live`` between the batch sizes. With ``width`` and costs measured at two
    context lengths, each batch size's cost is first taken on the line through its two (width, seconds)
    points at ``width`` (the slope floored at 0: attending over more slots never costs less; the result
    floored at 0); without either (older reports), the cost at the measured ``context``."""
    pts = []
    for b in costs["batch_sizes"]:
        c = costs["seconds"][str(b)]
        i = min(m, len(c)) - 1
        s = c[i]
        if width is not None and costs.get("long_seconds") and costs.get("width"):
            w0, w1 = costs["width"][str(b)][i], costs["long_width"][str(b)][i]
            slope = max((costs["long_seconds"][str(b)][i] - s) / (w1 - w0), 0.0) if w1 > w0 else 0.0
            s = max(s + slope * (width - w0), 0.0)
        pts.append((float(b), s))
    return interpolate(pts, live)


def expected_forward_seconds(costs: dict, drafted_at_least: list[float], k: int, live: int,
                             width: float | None = None) -> float:
    """``E[forward(1 + max_i d_i, live, width)]`` (s) with ``d_i`` i.i.d. per live request, ``P(d >= j) =
    drafted_at_least[j - 1]`` for j <= k, 0 above k (the padded forward is as long as its longest row);
    ``width`` the cache width (slots) charged, as :func:`forward_seconds` takes it."""
    at_least = [1.0, *drafted_at_least[:k], 0.0]
    total, below = 0.0, 0.0
    for j in range(k + 1):  # max d = j
        cdf = (1.0 - at_least[j + 1]) ** live
        total += (cdf - below) * forward_seconds(costs, j + 1, live, width)
        below = cdf
    return total
