"""The hot-swap watcher retries a version that failed to load (the engine's server was down), with
back-off and one log line, instead of giving it up until the app restarts."""
from __future__ import annotations

import logging
import time

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


def test_a_failed_load_is_retried_with_backoff_and_logged_once(tmp_path, caplog):
    engine, rows = FlakyEngine(), Rows()
    rows.current["a1"] = (1, str(tmp_path))       # the directory is here: the engine is at fault
    watcher = AdapterWatcher(engine, rows, ["a1"], retry_s=0.1, max_backoff_s=0.4)
    engine.down = True
    with caplog.at_level(logging.INFO, logger="collab_app.online.hotswap"):
        assert watcher.poll_once() == [] and len(engine.loads) == 1
        assert watcher.poll_once() == [] and len(engine.loads) == 1, "retried before its back-off"
        deadline = time.monotonic() + 3
        while len(engine.loads) < 4 and time.monotonic() < deadline:
            watcher.poll_once()
            time.sleep(0.01)
        assert len(engine.loads) == 4, "a failed version must be tried again on later polls"
        engine.down = False
        deadline = time.monotonic() + 3
        swaps = []
        while not swaps and time.monotonic() < deadline:
            swaps = watcher.poll_once()
            time.sleep(0.01)
    assert [(s.agent, s.previous, s.version) for s in swaps] == [("a1", None, 1)]
    assert engine.versions == {"a1": 1}
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "cannot load a1 v1" in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert any("loaded after 4 failed attempt(s)" in r.getMessage() for r in caplog.records)


def test_backoff_grows_to_its_cap_and_a_newer_version_is_tried_at_once(tmp_path):
    engine, rows = FlakyEngine(), Rows()
    rows.current["a1"] = (1, str(tmp_path))
    watcher = AdapterWatcher(engine, rows, ["a1"], retry_s=0.05, max_backoff_s=0.2)
    engine.down = True
    t0, times = time.monotonic(), []
    while time.monotonic() - t0 < 2.0:
        n = len(engine.loads)
        watcher.poll_once()
        if len(engine.loads) > n:
            times.append(time.monotonic())
        time.sleep(0.005)
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 0.05, 0.1, 0.2, 0.2, ... (lower bounds are exact; the cap leaves room for a busy machine)
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and min(gaps[2:]) >= 0.2 and max(gaps) < 0.6 and len(gaps) >= 6, gaps
    rows.current["a1"] = (2, str(tmp_path))          # a new version does not wait for v1's back-off
    n = len(engine.loads)
    watcher.poll_once()
    assert engine.loads[n:] == [("a1", 2)]
