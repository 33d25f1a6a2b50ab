"""The typed shape of an eval report's ``cost_model`` block (:func:`speculators.evaluation.cost_model.cost_model_block`)
and of the forward costs it reads (:func:`speculators.evaluation.costs.measure_costs`, a row's ``pass_costs``).

Part of the report's data (:mod:`speculators.evaluation.report` re-exports every name): JSON-native ``TypedDict`` s,
a ratio with a zero denominator ``None``. This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from typing import Optional, TypedDict


class ForwardCosts(TypedDict, total=False):
    """Measured target forwards (:func:`speculators.evaluation.costs.measure_costs`; a row's ``pass_costs``: the same
    at its batch size alone, measured right before its pass): ``seconds[str(b)][m - 1]`` =
    one forward over m = 1..k+1 tokens per request for b requests after ``context`` tokens each (median of
    ``reps``), ``width[str(b)][m - 1]`` the cache width (slots) it was timed at; ``long_seconds`` /
    ``long_width`` the same after ``long_context`` tokens (the second point of the forward's cost, linear in
    the width). ``width`` and the ``long_*`` keys are absent from older reports."""

    k: int
    context: int
    reps: int
    batch_sizes: list[int]
    seconds: dict[str, list[float]]
    width: dict[str, list[float]]
    long_context: int
    long_seconds: dict[str, list[float]]
    long_width: dict[str, list[float]]


class CostPrediction(TypedDict):
    """One method at one K' <= K and batch size under the cost model: ``expected_tokens_per_step`` =
    E[1 + accepted | K'] from the measured per-position acceptance, the predicted step's parts
    (``draft_ms_per_step``, ``forward_ms_per_step``, ``sampling_ms_per_step``, ``overhead_ms_per_step``: means
    per batched step) and
    ``prefill_seconds``, ``predicted_tokens_per_s``, ``predicted_speedup`` (over predicted plain decoding at
    that batch size), and on the rows the eval ran (``measured``) ``measured_tokens_per_s`` and
    ``relative_error`` = (predicted - measured) / measured and ``loop_forward_ms_per_step`` (the pass's own
    target forwards per batched step, to set beside ``forward_ms_per_step``) (None otherwise). A measured row
    with ``pass_costs`` is predicted from them (``costs_source: "adjacent"``), anything else from the eval's
    ``costs`` (``"eval"``); ``predicted_speedup`` always from the eval's costs (module
    :mod:`speculators.evaluation.cost_model`, "Adjacent costs")."""

    method: str
    k: int
    batch_size: int
    measured: bool
    expected_tokens_per_step: Optional[float]
    draft_ms_per_step: Optional[float]
    forward_ms_per_step: Optional[float]
    sampling_ms_per_step: Optional[float]
    overhead_ms_per_step: Optional[float]
    prefill_seconds: Optional[float]
    predicted_tokens_per_s: Optional[float]
    predicted_speedup: Optional[float]
    measured_tokens_per_s: Optional[float]
    relative_error: Optional[float]
    loop_forward_ms_per_step: Optional[float]
    cache_width: Optional[float]  # the width (slots) the forward was charged at; absent from older reports
    costs_source: str  # "adjacent" (the forwards measured next to its pass) or "eval"; absent from older reports
    eval_costs_tokens_per_s: Optional[float]  # the prediction from the eval's costs; absent from older reports


class PlainPrediction(TypedDict):
    """Plain decoding at one batch size under the cost model (1-token forwards + measured sampling and overhead)."""

    batch_size: int
    predicted_tokens_per_s: Optional[float]
    measured_tokens_per_s: Optional[float]
    relative_error: Optional[float]
    forward_ms_per_step: Optional[float]
    sampling_ms_per_step: Optional[float]
    overhead_ms_per_step: Optional[float]
    loop_forward_ms_per_step: Optional[float]
    cache_width: Optional[float]  # the width (slots) the forward was charged at; absent from older reports
    costs_source: str  # "adjacent" (the forwards measured next to its pass) or "eval"; absent from older reports
    eval_costs_tokens_per_s: Optional[float]  # the prediction from the eval's costs; absent from older reports


class BreakEven(TypedDict):
    """Per method: the smallest batch size (1 .. the largest measured) at which no K' <= K has a predicted
    speedup >= 1 (None: it pays at every one), the best predicted speedup at each, and a sentence."""

    batch_size: Optional[int]
    best_speedup_by_batch: dict[str, Optional[float]]
    note: str


class CostModel(TypedDict):
    """The cost model of an eval (:func:`speculators.evaluation.cost_model.cost_model_block`; its module docstring
    gives the formula and the assumptions): the measured ``costs``, plain decoding's measured per-step
    overhead outside the forward and the sampler (``overhead_ms_per_step[str(b)]``, ms), ``plain`` and ``predictions`` checked against the
    measured rows, ``best_k`` (``{batch: {method: K'}}`` by predicted speedup), ``break_even`` per method,
    ``max_abs_relative_error`` over the measured rows and ``within_15_percent`` (None without any)."""

    costs: ForwardCosts
    overhead_ms_per_step: dict[str, float]
    plain: list[PlainPrediction]
    predictions: list[CostPrediction]
    best_k: dict[str, dict[str, int]]
    break_even: dict[str, BreakEven]
    max_abs_relative_error: Optional[float]
    within_15_percent: Optional[bool]
