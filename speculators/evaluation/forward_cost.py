"""Timing the target's verification forward through the decoding loop's own batch session.

:func:`measure_forward_cost` times ONE target forward over ``m = 1..k+1`` new tokens per request, for a
batch of requests that each hold a prompt of a given length, through
:meth:`speculators.target.Target.batch_session` (the padded forward, attention mask and output head of a
step of :func:`speculators.decode.loop.speculative_generate`), and records the session's cache width (slots)
each timed forward attended over, so that the cost model (:mod:`speculators.evaluation.cost_model`) can charge a
forward at the width the loop actually runs at. :func:`measure_verify_cost` is its seconds alone (the
cost-aware confidence gate's cost model, :class:`speculators.decode.gating.ConfidenceGate`).
"""

from __future__ import annotations

import statistics

import torch

from ..decode.proposal import check_int
from ..decode.recorder import clock


def measure_forward_cost(target, k: int, reps: int = 5, prompt_len: int = 32, seed: int = 0,
                         batch_size: int = 1) -> dict:
    """The measured cost of a verification forward and the cache width it ran at.

    ``batch_size`` requests each get their own random ``prompt_len``-token prompt (one prefill); then, for
    m = 0..k, ONE forward over ``m + 1`` new tokens per request is timed ``reps`` times (one warm-up
    forward first; a ``torch.cuda.synchronize`` around each timing on CUDA), every request's cache rolled
    back after every forward, so every length is timed at the same context length. Only the forward (and
    its output head) is timed, not the rejection sampling. The session's ``width`` is read after each
    timed forward: the cache slots that forward attended over (the context, the new tokens, and the
    rolled-back slots the session keeps until its next automatic compaction).

    Returns:
        ``{"seconds": [k + 1] medians (s), "width": [k + 1] mean cache widths (slots) of those timings}``.
    Raises:
        SpeculatorsError: ``k`` < 0, ``reps`` < 1, ``prompt_len`` < 1, ``batch_size`` < 1.
    """
    k = check_int("k", k, 0)
    reps = check_int("reps", reps, 1)
    prompt_len = check_int("prompt_len", prompt_len, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    device = getattr(target, "device", torch.device("cpu"))
    vocab = int(getattr(target, "vocab_size", 2))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, prompt_len + k + 1), generator=g)
    rows = list(range(batch_size))
    sess = target.batch_session(batch_size)
    sess.add_many(rows, [ids[i, :prompt_len].tolist() for i in rows])
    base = sess.length(0)

    def once(m: int) -> tuple[float, int]:
        t0 = clock(device)
        sess.forward(rows, [ids[i, prompt_len:prompt_len + m + 1] for i in rows])
        dt = clock(device) - t0
        width = int(sess.width)
        for i in rows:
            sess.keep(i, base)
        return dt, width

    once(k)  # warm-up
    seconds, widths = [], []
    for m in range(k + 1):
        runs = [once(m) for _ in range(reps)]
        seconds.append(statistics.median(dt for dt, _ in runs))
        widths.append(sum(w for _, w in runs) / reps)
    return {"seconds": seconds, "width": widths}


def measure_verify_cost(target, k: int, reps: int = 5, prompt_len: int = 32, seed: int = 0,
                        batch_size: int = 1) -> list[float]:
    """The measured cost of a verification forward, on the machine at hand: ``[k + 1]`` seconds of ONE
    target forward over ``m + 1`` new tokens per request (m = 0..k) for ``batch_size`` requests, each after
    its own random ``prompt_len``-token prompt, through the decode session the loop uses, the median of
    ``reps`` timings each (:func:`measure_forward_cost`'s ``seconds``). At ``batch_size`` 1 it is the cost
    model of :class:`ConfidenceGate`'s cost-aware mode; :mod:`speculators.evaluation.cost_model` reads
    :func:`measure_forward_cost` at every batch size of an eval.

    Raises:
        SpeculatorsError: ``k`` < 0, ``reps`` < 1, ``prompt_len`` < 1, ``batch_size`` < 1.
    """
    return measure_forward_cost(target, k, reps, prompt_len, seed, batch_size)["seconds"]
