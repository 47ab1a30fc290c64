"""The trainer child `collab serve` supervises (serve.ChildTrainer): restarted whenever it dies,
with a back-off that grows with crashes in a row, is capped, and starts afresh after a healthy
run; never given up for good; and the Training tab says why nothing trains.

The back-off's waits are recorded, not slept: the supervisor waits on its stop event, which
these tests replace with one that returns at once (the wait asked for is what is checked)."""
from __future__ import annotations

import sys
import textwrap
import threading
import time

from collab_app.web import handlers as H
from collab_app.web.serve import ChildTrainer, exit_text, telling_line
from helpers.scripted import ScriptedStreamEngine, make_ctx

CRASHER = textwrap.dedent('''
    import os, sys, time
    path = sys.argv[1]
    n = int(open(path).read()) if os.path.exists(path) else 0
    open(path + ".new", "w").write(str(n + 1))
    os.replace(path + ".new", path)
    if n < int(sys.argv[2]):
        print("trainer INFO loading the adapters", file=sys.stderr)
        print("Traceback (most recent call last):", file=sys.stderr)
        print(f"RuntimeError: boom {n + 1}", file=sys.stderr)
        sys.exit(1)
    time.sleep(120)   # a healthy run: until stopped
''')


def _no_sleep(child: ChildTrainer, seen: list) -> None:
    """Record each back-off wait (and what describe() says meanwhile) instead of sleeping it."""
    stop = child._stopping

    class Waits:
        def __getattr__(self, name):
            return getattr(stop, name)

        def wait(self, timeout=None):
            seen.append((timeout, getattr(child, "describe", str)()))
            return stop.is_set()
    child._stopping = Waits()


def test_a_child_that_crashes_six_times_then_works_is_running_again(tmp_path):
    script, counter = tmp_path / "crasher.py", tmp_path / "runs"
    script.write_text(CRASHER)
    child = ChildTrainer([])
    child.cmd = [sys.executable, str(script), str(counter), "6"]
    waits: list = []
    _no_sleep(child, waits)
    child.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = int(counter.read_text()) if counter.exists() else 0
            if runs >= 7 and child.proc.poll() is None:
                break
            time.sleep(0.1)
        assert int(counter.read_text()) == 7, "the child was not started again after its 5th restart"
        assert child.proc.poll() is None                      # the 7th run is running
        assert [w for w, _ in waits] == [2, 4, 8, 16, 32, 64]   # doubling, from 2 s
        said = waits[-1][1]
        assert said == "trainer crashed 6 times in a row (exit code 1), restarting in 64 s; last error: RuntimeError: boom 6"
        assert child.running() and child.restarts == 6
        assert "restarted" in child.describe() and "after it crashed 6 times" in child.describe()
    finally:
        child.stop(timeout=10)
    assert child.proc.poll() is not None


class FakeProc:
    """A run that lasts `run_s` on the test's clock and exits with `rc`; None: runs until killed."""

    def __init__(self, clock: dict, run_s: float | None, rc: int = 1):
        self.clock, self.run_s, self.rc, self.done = clock, run_s, rc, threading.Event()

    def wait(self, timeout=None):
        if self.run_s is None:
            self.done.wait()
            return -15
        self.clock["t"] += self.run_s
        self.done.set()
        return self.rc

    def poll(self):
        return self.rc if self.done.is_set() else None

    def terminate(self):
        self.done.set()

    kill = terminate


def _wait_until(done, timeout_s: float) -> None:
    """Poll `done()` until true or `timeout_s` passed (the assertions after it say what was missing)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_back_off_is_capped_and_starts_afresh_after_a_healthy_run():
    clock = {"t": 0.0}
    # 11 crashes at start, one healthy run of 400 s that then crashes, a crash at start, then a run that lasts
    runs = [0.0] * 11 + [400.0, 1.0, None]
    procs = iter([FakeProc(clock, r) for r in runs])
    child = ChildTrainer([], max_delay_s=600, healthy_s=300, clock=lambda: clock["t"])
    child._popen = lambda: next(procs)
    waits: list = []
    _no_sleep(child, waits)
    child.start()
    _wait_until(lambda: len(waits) >= 13, 30)
    try:
        assert [w for w, _ in waits] == [2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 600,   # capped at 10 min
                                         2, 4]                                            # afresh after 400 s
        assert child.restarts == 13 and child.crashes == 2
    finally:
        child.stop()


def test_a_start_that_fails_is_retried_too():
    child = ChildTrainer([], clock=lambda: 0.0)
    calls = []

    def popen():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("[Errno 12] Cannot allocate memory")
        return FakeProc({"t": 0.0}, None)
    child._popen = popen
    waits: list = []
    _no_sleep(child, waits)
    child.start()
    _wait_until(lambda: len(calls) >= 3, 10)
    try:
        assert len(calls) == 3 and [w for w, _ in waits] == [2, 4]
        assert waits[0][1].startswith("trainer crashed 1 time in a row (did not start), restarting in 2 s; "
                                      "last error: could not start")
    finally:
        child.stop()


def test_the_training_tab_says_why_the_trainer_is_not_training(tmp_path):
    ctx = make_ctx(tmp_path, ScriptedStreamEngine())
    assert "crashed" not in H.training_status(ctx)
    clock = {"t": 0.0}
    child = ChildTrainer([], clock=lambda: clock["t"])
    child.crashes, child.last_exit, child.next_start_at = 3, 1, 8.0
    child.last_error = "OSError: [Errno 28] No space left on device"
    ctx.trainer_child = child
    said = ("trainer crashed 3 times in a row (exit code 1), restarting in 8 s; last error: OSError: [Errno 28] "
            "No space left on device")
    assert H.trainer_process_line(ctx) == said
    assert f"**{H.md_literal(said)}**" in H.training_status(ctx)        # as the page's Markdown shows it
    child.next_start_at, child.started_at, clock["t"] = None, 8.0, 20.0   # restarted 12 s ago
    assert H.trainer_process_line(ctx).startswith("trainer restarted 12 s ago after it crashed 3 times")
    clock["t"] = 8.0 + child.healthy_s                                   # healthy for long enough
    assert H.trainer_process_line(ctx) == "" and "crashed" not in H.training_status(ctx)


def test_the_telling_line_and_the_exit_text():
    assert telling_line(["a", "Traceback (most recent call last):", '  File "x.py"', "ValueError: bad", ""]) == "ValueError: bad"
    assert telling_line(["2024 trainer ERROR step failed: disk full", "2024 trainer INFO bye"]) == \
        "2024 trainer ERROR step failed: disk full"
    assert telling_line(["just a line"]) == "just a line" and telling_line([]) is None
    assert exit_text(1) == "exit code 1" and exit_text(-9) == "killed by SIGKILL" and exit_text(None) == "did not start"
