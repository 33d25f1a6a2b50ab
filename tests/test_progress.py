"""Progress that shows in logs: when stdout is a file or a pipe, long phases print plain lines
(done/total, rate, ETA) WHILE they run -- every N seconds, at the first update and at 100% -- instead of
a rich bar that only appears when the phase ends. A terminal keeps the bar;
SPECULATORS_NO_PROGRESS=1 shows neither."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from speculators.errors import SpeculatorsError
from speculators.progress import ProgressReporter, format_duration, format_progress_line, progress_every_s

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-eagle3.yaml"


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def file_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, highlight=False), buf


@pytest.fixture
def progress_on(monkeypatch):
    monkeypatch.delenv("SPECULATORS_NO_PROGRESS", raising=False)
    monkeypatch.delenv("SPECULATORS_PROGRESS_EVERY", raising=False)


def lines(buf: io.StringIO) -> list[str]:
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def test_plain_lines_appear_while_the_phase_runs(progress_on):
    console, buf = file_console()
    clock = FakeClock()
    prog = ProgressReporter(console=console, clock=clock)
    assert prog.mode == "lines" and prog.every_s == 30.0  # a file is not a terminal; default period
    with prog:
        task = prog.add_task("train", total=100, unit="steps")
        assert lines(buf) == ["train: 0/100 (0%), rate 0.00 steps/s, ETA --:--, elapsed 00:00"]
        seen_during = []
        for step in range(1, 101):
            clock.t += 1.0  # one step per second
            prog.update(task, completed=step, info=f"loss {1 / step:.3f}" if step % 10 == 0 else None)
            seen_during.append(len(lines(buf)))
        during = lines(buf)
    # 0%, every 30 s (steps 30, 60, 90) and 100%: printed during the phase, not at its end
    assert seen_during[29] == 2 and seen_during[59] == 3 and seen_during[89] == 4
    assert len(during) == 5 and lines(buf) == during  # leaving the block adds nothing: 100% was printed
    assert during[1] == "train: 30/100 (30%), rate 1.00 steps/s, ETA 01:10, elapsed 00:30 | loss 0.033"
    assert during[3].startswith("train: 90/100 (90%), rate 1.00 steps/s, ETA 00:10, elapsed 01:30")
    assert during[4].startswith("train: 100/100 (100%), rate 1.00 steps/s, ETA 00:00, elapsed 01:40")


def test_rate_and_eta_count_only_this_runs_work(progress_on):
    """A resumed training starts its task at step 50: the rate is measured from there."""
    console, buf = file_console()
    clock = FakeClock()
    with ProgressReporter(console=console, clock=clock, every_s=10) as prog:
        task = prog.add_task("train", total=100, completed=50, unit="steps")
        clock.t += 10.0
        prog.update(task, completed=70)
    out = lines(buf)
    assert out[0].startswith("train: 50/100 (50%)")
    assert out[1] == "train: 70/100 (70%), rate 2.00 steps/s, ETA 00:15, elapsed 00:10"


def test_phase_ending_short_prints_a_last_line(progress_on):
    console, buf = file_console()
    clock = FakeClock()
    with ProgressReporter(console=console, clock=clock) as prog:
        task = prog.add_task("train", total=100, unit="steps")
        clock.t += 5
        prog.update(task, completed=7)  # not due yet (every 30 s)
        assert len(lines(buf)) == 1
    assert lines(buf)[-1].startswith("train: 7/100 (7%), rate 1.40 steps/s")


def test_callback_for_the_pipeline(progress_on):
    console, buf = file_console()
    clock = FakeClock()
    with ProgressReporter(console=console, clock=clock, every_s=60) as prog:
        hit = prog.callback("regenerating cached")  # a cache hit never calls it: nothing shown
        cb = prog.callback("target features", unit="tokens")
        clock.t += 2
        cb(1000, 10000)  # first call: shown at once, rate measured from when the callback was made
        assert lines(buf) == ["target features: 1000/10000 (10%), rate 500 tokens/s, ETA 00:18, elapsed 00:02"]
        clock.t += 20
        cb(5000, 10000)  # not due
        assert len(lines(buf)) == 1
        clock.t += 40
        cb(9000, 10000)  # 60 s since the last line
        assert lines(buf)[-1].startswith("target features: 9000/10000 (90%), rate 145 tokens/s, ETA 00:07")
        cb(10000, 10000)
        assert lines(buf)[-1].startswith("target features: 10000/10000 (100%)")
    assert len(lines(buf)) == 3 and not any("cached" in ln for ln in lines(buf))
    del hit


def test_lines_are_flushed_to_the_stream(progress_on, tmp_path):
    """The redirected-to-a-file case: each line is on disk before the next update."""
    with open(tmp_path / "log.txt", "w") as f:
        console = Console(file=f, width=200)
        clock = FakeClock()
        with ProgressReporter(console=console, clock=clock, every_s=0) as prog:
            task = prog.add_task("eval", total=3, unit="prompts")
            clock.t += 3
            prog.update(task, completed=1)
            on_disk = (tmp_path / "log.txt").read_text()
            assert "eval: 1/3 (33%), rate 0.33 prompts/s, ETA 00:06" in on_disk


def test_log_callable_receives_the_lines(progress_on):
    console, buf = file_console()
    got = []
    with ProgressReporter(console=console, log=got.append, clock=FakeClock()) as prog:
        prog.add_task("eval", total=2, unit="prompts")
    assert got == ["eval: 0/2 (0%), rate 0.00 prompts/s, ETA --:--, elapsed 00:00"] and buf.getvalue() == ""


def test_terminal_keeps_the_rich_bar(progress_on):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    prog = ProgressReporter(console=console, clock=FakeClock())
    assert prog.mode == "bar"
    with prog:
        task = prog.add_task("train", total=4, unit="steps")
        prog.update(task, completed=4, info="loss 0.5")
        prog.callback("regenerating data[/x] [bold]")(1, 2)  # brackets are text, not rich markup
    assert "4/4" in buf.getvalue() and "rate" not in buf.getvalue()
    assert "data[/x] [bold]" in buf.getvalue()


def test_no_progress_env_turns_everything_off(monkeypatch):
    monkeypatch.setenv("SPECULATORS_NO_PROGRESS", "1")
    for console, buf in [file_console(), (lambda b: (Console(file=b, force_terminal=True), b))(io.StringIO())]:
        prog = ProgressReporter(console=console, clock=FakeClock())
        assert prog.mode == "off"
        with prog:
            task = prog.add_task("train", total=2)
            prog.update(task, completed=2)
            prog.callback("target features")(5, 5)
        assert buf.getvalue() == ""


def test_progress_every_env(monkeypatch):
    monkeypatch.setenv("SPECULATORS_PROGRESS_EVERY", "5")
    assert progress_every_s() == 5.0
    monkeypatch.setenv("SPECULATORS_PROGRESS_EVERY", "0")
    assert progress_every_s() == 0.0
    for bad in ["-1", "soon", "inf", "nan"]:
        monkeypatch.setenv("SPECULATORS_PROGRESS_EVERY", bad)
        with pytest.raises(SpeculatorsError, match="SPECULATORS_PROGRESS_EVERY"):
            progress_every_s()
    with pytest.raises(SpeculatorsError, match="mode"):
        ProgressReporter(console=file_console()[0], mode="fancy")


def test_formatting():
    assert format_duration(0) == "00:00" and format_duration(75.4) == "01:15"
    assert format_duration(3 * 3600 + 61) == "3:01:01" and format_duration(float("inf")) == "--:--"
    assert format_progress_line("x", 5, None, 10, 0.5) == "x: 5, rate 0.50 it/s, ETA --:--, elapsed 00:10"


def test_cli_progress_and_log_write_plain_lines(progress_on, monkeypatch):
    from speculators import cli

    console, buf = file_console()
    monkeypatch.setattr(cli, "console", console)
    monkeypatch.setenv("SPECULATORS_PROGRESS_EVERY", "0")
    with cli._progress() as make:
        update = make("regenerating chatterbot")
        update(4, 8)
        assert re.search(r"s regenerating chatterbot: 4/8 \(50%\), rate [\d.]+ prompts/s, ETA \d\d:\d\d",
                         buf.getvalue()), buf.getvalue()
    cli.log("sources [humaneval] and [/x] stay as written")
    assert "sources [humaneval] and [/x] stay as written" in buf.getvalue()


def test_cli_train_prints_progress_lines_in_a_log(progress_on, monkeypatch, tmp_path, isolated_cache,
                                                  tiny_target_dir):
    """End to end: `speculators train` with output captured (not a terminal) shows the phases' lines."""
    from typer.testing import CliRunner

    from speculators.cli import app

    monkeypatch.setenv("SPECULATORS_PROGRESS_EVERY", "0")
    r = CliRunner().invoke(app, ["train", str(TINY), f"target.model={tiny_target_dir}", "-o", str(tmp_path / "run"),
                                 "data.sources.0.max_examples=4", "data.sources.1.max_examples=2",
                                 "train.steps=2", "train.checkpoint_every=2", "train.eval_every=2"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    out = r.output
    assert re.search(r"regenerating chatterbot: \d+/\d+ \(100%\), rate [\d.]+ prompts/s, ETA", out), out
    assert re.search(r"target features: \d+/\d+ \(100%\), rate [\d.]+ tokens/s, ETA", out), out
    assert "train: 0/2 (0%)" in out and re.search(r"train: 2/2 \(100%\), rate [\d.]+ steps/s, ETA 00:00", out), out
    assert out.index("train: 0/2 (0%)") < out.index("train: 2/2 (100%)") < out.index("final drafter written")
