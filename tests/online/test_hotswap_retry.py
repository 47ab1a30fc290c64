"""The hot-swap watcher retries a version that failed to load (the engine's server was down), with
back-off and one log line, instead of giving it up until the app restarts."""
from __future__ import annotations

import logging

from collab_app.engines.engine_types import EngineError
from collab_app.online.hotswap import AdapterWatcher


class FlakyEngine:
    """load_adapter fails while `down` (a remote server that cannot be reached)."""

    def __init__(self):
        self.down = False
        self.loads: list[tuple[str, int]] = []      # every attempt
        self.versions: dict[str, int | None] = {}

    def adapter_version(self, agent):
        return self.versions.get(agent)

    def load_adapter(self, agent, path, version):
        self.loads.append((agent, version))
        if self.down:
            raise EngineError("cannot reach the vLLM server at http://127.0.0.1:9 (ConnectError)")
        self.versions[agent] = version


class Rows:
    def __init__(self):
        self.current: dict[str, tuple[int, str]] = {}

    def current_adapter_versions(self):
        return dict(self.current)


class Clock:
    """A monotonic clock the test moves (AdapterWatcher's `clock`): the back-off is checked
    exactly, not against a busy machine's scheduling (a 0.1 s stall used to fail these tests)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_load_is_retried_with_backoff_and_logged_once(tmp_path, caplog):
    clock = Clock()
    engine, rows = FlakyEngine(), Rows()
    rows.current["a1"] = (1, str(tmp_path))       # the directory is here: the engine is at fault
    watcher = AdapterWatcher(engine, rows, ["a1"], retry_s=0.1, max_backoff_s=0.4, clock=clock)
    engine.down = True
    with caplog.at_level(logging.INFO, logger="collab_app.online.hotswap"):
        assert watcher.poll_once() == [] and len(engine.loads) == 1
        clock.now += 0.09
        assert watcher.poll_once() == [] and len(engine.loads) == 1, "retried before its back-off"
        for wait in (0.1, 0.2, 0.4):              # measured from each failure: 0.1, then doubled
            clock.now += wait - 0.09 if wait == 0.1 else wait
            watcher.poll_once()
        assert len(engine.loads) == 4, "a failed version must be tried again on later polls"
        engine.down = False
        clock.now += 0.39
        assert watcher.poll_once() == [] and len(engine.loads) == 4, "the cap (0.4 s) is the wait now"
        clock.now += 0.01
        swaps = watcher.poll_once()
    assert [(s.agent, s.previous, s.version) for s in swaps] == [("a1", None, 1)]
    assert engine.versions == {"a1": 1}
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "cannot load a1 v1" in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert any("loaded after 4 failed attempt(s)" in r.getMessage() for r in caplog.records)


def test_backoff_grows_to_its_cap_and_a_newer_version_is_tried_at_once(tmp_path):
    clock = Clock()
    engine, rows = FlakyEngine(), Rows()
    rows.current["a1"] = (1, str(tmp_path))
    watcher = AdapterWatcher(engine, rows, ["a1"], retry_s=0.05, max_backoff_s=0.2, clock=clock)
    engine.down = True
    times = []
    for tick in range(400):                       # polls every 5 ms for 2 s of the clock
        clock.now = 1000.0 + tick * 0.005
        n = len(engine.loads)
        watcher.poll_once()
        if len(engine.loads) > n:
            times.append(clock.now)
    gaps = [b - a for a, b in zip(times, times[1:])]
    waits = [0.05, 0.1] + [0.2] * (len(gaps) - 2)            # 0.05, doubled, capped at 0.2
    # each retry at the first poll (every 5 ms) at or after its time
    assert len(gaps) >= 8 and all(w - 1e-9 <= g <= w + 0.005 + 1e-9 for w, g in zip(waits, gaps)), gaps
    rows.current["a1"] = (2, str(tmp_path))          # a new version does not wait for v1's back-off
    n = len(engine.loads)
    watcher.poll_once()
    assert engine.loads[n:] == [("a1", 2)]
