"""Progress of long phases (regeneration, feature extraction, training, eval) that also shows in logs.

On a terminal (``console.is_terminal``, or a Jupyter console) a rich progress bar is drawn, as before.
When stdout is a file or a pipe (``make demo > log``, ``nohup``, CI) a rich bar would only be written
when its phase ends, so instead plain lines are printed WHILE the phase runs, flushed at once::

    regenerating chatterbot: 96/400 (24%), rate 3.20 prompts/s, ETA 01:35, elapsed 00:30

one at the first update of a task (0% for the trainer, which starts its task explicitly), then at most
every ``SPECULATORS_PROGRESS_EVERY`` seconds (default 30; 0 = at every update), at 100%, and a last
one when the phase ends short of its total (e.g. ``train.max_minutes``). The rate is measured from the
task's start (resumed work is not counted) and the ETA is ``(total - done) / rate``.

``SPECULATORS_NO_PROGRESS=1`` turns ALL progress display off, bars and plain lines alike (the test
suite sets it to stay quiet); the phases' own start/end log lines are unaffected. Any other value, or
unset, leaves progress on.

The reporter keeps rich's ``Progress`` calling convention (``add_task`` / ``update(task, ...)``) so
the trainer's loop reads the same, and offers ``callback(description, unit)``: the ``(done, total)``
callable that ``prepare_data``, ``regenerate``, ``extract_features`` and ``run_eval`` accept.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import SpeculatorsError

ENV_EVERY = "SPECULATORS_PROGRESS_EVERY"
ENV_OFF = "SPECULATORS_NO_PROGRESS"
DEFAULT_EVERY_S = 30.0


def progress_every_s() -> float:
    """Seconds between plain progress lines: ``$SPECULATORS_PROGRESS_EVERY`` or 30.

    Raises:
        SpeculatorsError: the variable is set but is not a finite number of seconds >= 0.
    """
    raw = os.environ.get(ENV_EVERY, "").strip()
    if not raw:
        return DEFAULT_EVERY_S
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not (v >= 0.0 and v != float("inf")):
        raise SpeculatorsError(f"{ENV_EVERY}={raw!r}: expected a number of seconds >= 0 (0 = every update, "
                               f"default {DEFAULT_EVERY_S:g})")
    return v


def progress_disabled() -> bool:
    """True when ``$SPECULATORS_NO_PROGRESS`` is ``1``: no bars and no plain progress lines."""
    return os.environ.get(ENV_OFF, "").strip() == "1"


def format_duration(seconds: float) -> str:
    """``mm:ss`` (``h:mm:ss`` from one hour on); ``--:--`` for an unknown (inf/nan/negative) duration."""
    if not (seconds >= 0.0) or seconds == float("inf"):
        return "--:--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _format_rate(rate: float) -> str:
    if rate >= 100:
        return f"{rate:.0f}"
    if rate >= 10:
        return f"{rate:.1f}"
    return f"{rate:.2f}"


def format_progress_line(description: str, done: float, total: float | None, elapsed_s: float,
                         rate: float, unit: str = "it", info: str = "") -> str:
    """One plain progress line: ``<phase>: done/total (pct), rate <r> <unit>/s, ETA mm:ss, elapsed mm:ss``.

    ``rate`` is in ``unit`` per second; the ETA is ``(total - done) / rate`` (``--:--`` while the rate is
    0 or the total unknown). ``info`` (e.g. the trainer's loss) is appended after `` | ``.
    """
    d = int(done) if float(done).is_integer() else done
    if total:
        t = int(total) if float(total).is_integer() else total
        head = f"{description}: {d}/{t} ({100.0 * done / total:.0f}%)"
        eta = format_duration(max(total - done, 0) / rate) if rate > 0 else ("00:00" if done >= total else "--:--")
    else:
        head, eta = f"{description}: {d}", "--:--"
    line = f"{head}, rate {_format_rate(rate)} {unit}/s, ETA {eta}, elapsed {format_duration(elapsed_s)}"
    return f"{line} | {info}" if info else line


@dataclass
class _Task:
    description: str
    total: float | None
    unit: str
    start_done: float
    t0: float
    done: float
    info: str = ""
    last_print: float | None = None
    printed_done: float | None = None
    rich_id: Any = None


class ProgressReporter:
    """Progress display for one or more phases: a rich bar on a terminal, periodic plain lines otherwise.

    Use as a context manager (like ``rich.progress.Progress``)::

        with ProgressReporter(console, log=log) as prog:
            task = prog.add_task("train", total=steps, completed=step, unit="steps")
            prog.update(task, completed=step, info="loss 1.23")
        # or, for the pipeline's (done, total) callables:
            regenerate(..., progress=prog.callback("regenerating chatterbot", unit="prompts"))

    Args:
        console: the rich ``Console`` the bar draws on and whose ``is_terminal`` picks the mode
            (default: rich's global console, i.e. stdout).
        log: callable ``(str) -> None`` that prints a plain line (e.g. the CLI's timestamped ``log``);
            default ``console.print`` without markup. The output stream is flushed after each line.
        mode: ``"bar"``, ``"lines"`` or ``"off"``; default: ``"off"`` if ``SPECULATORS_NO_PROGRESS=1``,
            else ``"bar"`` on a terminal/Jupyter console and ``"lines"`` otherwise.
        every_s: seconds between plain lines (default ``$SPECULATORS_PROGRESS_EVERY`` or 30).
        clock: monotonic clock in seconds (tests pass a fake one).

    Raises:
        SpeculatorsError: a bad ``mode`` or ``SPECULATORS_PROGRESS_EVERY``.
    """

    def __init__(self, console=None, log: Callable[[str], None] | None = None, mode: str | None = None,
                 every_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        if console is None:
            from rich import get_console

            console = get_console()
        self.console = console
        if mode is None:
            if progress_disabled():
                mode = "off"
            else:
                mode = "bar" if (console.is_terminal or getattr(console, "is_jupyter", False)) else "lines"
        if mode not in ("bar", "lines", "off"):
            raise SpeculatorsError(f"progress mode {mode!r}: allowed: 'bar', 'lines', 'off'")
        self.mode = mode
        self.every_s = progress_every_s() if every_s is None else float(every_s)
        if not self.every_s >= 0:
            raise SpeculatorsError(f"progress every_s={every_s!r}: expected seconds >= 0")
        self.clock = clock
        self._log = log
        self._tasks: list[_Task] = []
        self._rich = None
        if mode == "bar":
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=console, transient=False)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "ProgressReporter":
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.mode == "lines":
            for t in self._tasks:  # a phase that ended short of its total (or between two lines)
                if t.printed_done != t.done:
                    self._emit(t, self.clock())

    # ------------------------------------------------------------------ rich-like API

    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 unit: str = "it", info: str = "") -> int:
        """Start a task now; returns its id for ``update``. In line mode prints its first (0%) line.

        ``completed`` is work done before this run (a resumed training): it counts towards
        done/total but not towards the rate.
        """
        t = _Task(description, total, unit, start_done=completed, t0=self.clock(), done=completed, info=info)
        self._tasks.append(t)
        if self._rich is not None:
            from rich.markup import escape  # a description like "hf:x[0]" is text, not markup

            t.rich_id = self._rich.add_task(escape(description), total=total, completed=completed, info=escape(info))
        elif self.mode == "lines":
            self._emit(t, t.t0)
        return len(self._tasks) - 1

    def update(self, task_id: int, completed: float | None = None, total: float | None = None,
               info: str | None = None) -> None:
        """Record progress of ``task_id`` (absolute ``completed`` count); may print a plain line."""
        t = self._tasks[task_id]
        if completed is not None:
            t.done = completed
        if total is not None:
            t.total = total
        if info is not None:
            t.info = info
        if self._rich is not None:
            from rich.markup import escape

            self._rich.update(t.rich_id, completed=t.done, total=t.total, info=escape(t.info))
            return
        if self.mode != "lines" or completed is None:
            return  # an info-only update waits for the next count
        now = self.clock()
        finished = t.total is not None and t.done >= t.total
        due = t.last_print is None or now - t.last_print >= self.every_s
        if (finished or due) and t.printed_done != t.done:
            self._emit(t, now)

    def callback(self, description: str, unit: str = "it") -> Callable[[int, int], None]:
        """A ``(done, total)`` callable for the pipeline; the task starts when the callable is made and
        is shown from its first call (a cache hit, which never calls it, shows nothing)."""
        t0 = self.clock()
        ids: list[int] = []

        def update(done: int, total: int) -> None:
            if not ids:
                ids.append(self.add_task(description, total=total, completed=0, unit=unit) if self.mode != "lines"
                           else self._add_silent(description, total, unit, t0))
            self.update(ids[0], completed=done, total=total)
        return update

    # ------------------------------------------------------------------ internals

    def _add_silent(self, description: str, total, unit: str, t0: float) -> int:
        self._tasks.append(_Task(description, total, unit, start_done=0, t0=t0, done=0))
        return len(self._tasks) - 1

    def _emit(self, t: _Task, now: float) -> None:
        elapsed = max(now - t.t0, 0.0)
        rate = (t.done - t.start_done) / elapsed if elapsed > 0 else 0.0
        line = format_progress_line(t.description, t.done, t.total, elapsed, rate, t.unit, t.info)
        if self._log is not None:
            self._log(line)
        else:
            self.console.print(line, markup=False, highlight=False)
        out = getattr(self.console, "file", None) or sys.stdout
        try:
            out.flush()
            if self._log is not None and out is not sys.stdout:
                sys.stdout.flush()  # a plain ``print`` log
        except (OSError, ValueError):
            pass
        t.last_print, t.printed_done = now, t.done


class NoProgress:
    """A progress reporter that draws nothing (ranks other than 0 of a multi-process run)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass
