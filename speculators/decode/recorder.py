"""The decoding loop's wall-clock accounting, kept out of its steps.

The loop owns one :class:`Recorder`; a step marks its phases with it (``with rec.drafting(live):``,
``with rec.verifying(live):``, ``with rec.forward(session):``, ``with rec.prefill():``) and nothing else of a
step reads a clock. What it sums becomes :class:`speculators.decode.state.BatchResult`'s ``draft_seconds``,
``verify_seconds``, ``forward_seconds``, ``prefill_seconds``, ``target_forwards`` and ``cache_width``, and each
request's :class:`speculators.decode.state.GenerationResult` ``draft_seconds`` / ``verify_seconds``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@torch.no_grad()
def clock(device) -> float:
    """``time.perf_counter()`` in seconds, after the device's queued kernels finished (a CUDA synchronize only
    when ``device`` is a CUDA device: elsewhere the work is already done when the call returns), so
    asynchronous kernels are charged to the phase that launched them."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Recorder:
    """Seconds and counts of one :func:`speculators.decode.loop.speculative_generate` run.

    Attributes:
        device: the target's device (what :func:`clock` synchronises).
        results: the run's per-request results (objects with ``draft_seconds`` / ``verify_seconds``), indexed
            by request; a phase charges its whole wall time to each request it names (in a batch, every live
            request waited for the whole batched call).
        charge_drafting: False for plain decoding (no proposer): :meth:`drafting` then charges nothing, so a
            plain run reports 0.0 drafting seconds.
        forwards: batched target forwards of the decode steps (prefills excluded).
        draft_seconds / verify_seconds / prefill_seconds / forward_seconds: summed wall time (s) of the
            phases (``forward_seconds`` is the part of ``verify_seconds`` spent in the target forward alone).
        width_sum / widths_read: the batch session's cache width (slots) read after each forward, summed.
    """

    device: Any
    results: list
    charge_drafting: bool = True
    forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0
    width_sum: int = 0
    widths_read: int = 0

    def now(self) -> float:
        """:func:`clock` on the run's device."""
        return clock(self.device)

    @contextmanager
    def drafting(self, requests: list[int]) -> Iterator[None]:
        """The proposer's work (``propose``, gating, ``advance``) for ``requests``."""
        if not self.charge_drafting:
            yield
            return
        t0 = self.now()
        yield
        dt = self.now() - t0
        self.draft_seconds += dt
        for i in requests:
            self.results[i].draft_seconds += dt

    @contextmanager
    def verifying(self, requests: list[int]) -> Iterator[None]:
        """A step's target forward and rejection sampling for ``requests``."""
        t0 = self.now()
        yield
        dt = self.now() - t0
        self.verify_seconds += dt
        for i in requests:
            self.results[i].verify_seconds += dt

    @contextmanager
    def forward(self, session) -> Iterator[None]:
        """One batched target forward of a decode step; ``session.width`` (cache slots) is read after it."""
        t0 = self.now()
        yield
        self.forward_seconds += self.now() - t0
        self.forwards += 1
        self.width_sum += int(session.width)
        self.widths_read += 1

    @contextmanager
    def prefill(self) -> Iterator[float]:
        """Requests joining: their prefills, first tokens and proposer starts. Yields the start time."""
        t0 = self.now()
        yield t0
        self.prefill_seconds += self.now() - t0

    @property
    def cache_width(self) -> float | None:
        """Mean cache width over the decode steps' forwards (slots), None when none was read."""
        return self.width_sum / self.widths_read if self.widths_read else None
