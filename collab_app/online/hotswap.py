"""Hot-swap: a thread in the serving process that loads new adapter versions into the engine.

Where versions come from: the store's adapter-version rows, via `store.current_adapter_versions()`
(agent -> (version, path); an admin's pinned version wins over the newest, which is how a
rollback reaches the engine). The trainer service adds a row only after the version's directory
was renamed into place, so a row never names a half-written adapter; the watcher does not scan
the adapters directory itself (a directory without a row is recorded by the service's
reconcile on its next start, then served).

Requests in flight are not dropped: `engine.load_adapter` takes the engine's own lock, so a load
waits for the running batch, which finishes on the versions it started with (both backends
document this); the next batch runs on the new version. `lock` (the app's `engine_lock`)
additionally orders the watcher with the UI's own `sync_adapters` check before a generation.

The trainer on another machine (docs/ARCHITECTURE.md "Beyond one machine"): rows come through
the shared store, directories through shared storage; a row's path that does not exist here is
looked up under this process's own `adapters_dir` ({adapters_dir}/{agent}/v000007). A version
whose directory is not visible here yet (a network filesystem's attribute cache can hide a fresh
rename for a few seconds after the row arrived) is retried on the next polls, not given up: the row is the promise that the directory is complete. When neither path
exists here the row's path still goes to the engine, which may resolve it elsewhere (a remote
vLLM server that mounts the share itself); if that load fails too it is retried later.

A version whose directory is here but fails to load is logged once and retried on later polls
with a back-off (`retry_s` doubling up to `max_backoff_s`): the fault may be the engine's, not the
version's (a remote vLLM server down or restarting), and a version given up for good would stay
unserved until the app restarts, since only a newer version number would be tried. Corrupt files
cost one failed load per back-off period; the engine keeps serving what it had meanwhile. A newer
version is tried at once. Left out: unloading agents whose rows disappear (rows are never
deleted), and adapters published elsewhere than a filesystem (a Hub repo revision).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Swap:
    """One adapter load the watcher did (kept for the UI / the latency measurement)."""

    agent: str
    version: int | None
    previous: int | None
    at: float          # time.time() when the new version was being served
    load_s: float      # seconds load_adapter took (including waiting for a running batch)


class AdapterWatcher:
    def __init__(self, engine, store, agents: list[str], lock=None, interval_s: float = 1.0,
                 adapters_dir: str | None = None, retry_s: float | None = None, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        """`adapters_dir`: where this host sees the trainer's adapters (the shared storage's mount
        here); None = use the paths in the rows as they are (trainer on this machine).
        `retry_s`: first wait before a failed load is tried again (default interval_s), doubled
        after each failure up to `max_backoff_s`, on `clock` (seconds; tests move their own)."""
        self.engine = engine
        self.store = store
        self.agents = list(agents)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.interval_s = interval_s
        self.swaps: list[Swap] = []
        self.adapters_dir = adapters_dir
        self.retry_s = interval_s if retry_s is None else retry_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        # (agent, version) that failed to load -> [failures, wait, `clock` time of the next try]
        self._failed: dict[tuple[str, int | None], list] = {}
        self._unseen: set[tuple[str, int | None]] = set()   # not visible here yet: warned once, retried
        self._store_failures = 0          # store reads failed in a row (warned once per streak)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> list[Swap]:
        """Load every agent's current version if the engine serves another one. Returns the swaps.
        A failed store read (locked, unreachable) swaps nothing: the versions loaded keep serving,
        and the next poll reads again (the batcher polls before every batch: one failed read must
        not fail the rounds waiting in it). Logged once per run of failures, and when it reads again."""
        try:
            current = self.store.current_adapter_versions()   # agent -> (version, path), pinned first
        except Exception as e:  # noqa: BLE001 - serving goes on with what is loaded
            self._store_failures += 1
            if self._store_failures == 1:
                log.warning("hot-swap: cannot read the adapter versions from the store (%s: %s); serving the "
                            "versions loaded and reading again at each poll", type(e).__name__, str(e)[:300])
            else:
                log.debug("hot-swap: store read failed again (%s)", type(e).__name__)
            return []
        if self._store_failures:
            log.info("hot-swap: the store answers again after %d failed read(s)", self._store_failures)
            self._store_failures = 0
        done = []
        for agent in self.agents:
            if agent not in current:
                continue   # no version yet: the agent serves the base model
            version, path = current[agent]
            failed = self._failed.get((agent, version))
            if failed is not None and self.clock() < failed[2]:
                continue   # backing off
            path = self.resolve(agent, version, path)
            with self.lock:
                have = self.engine.adapter_version(agent)
                if have == version:
                    continue
                t0 = time.monotonic()
                try:
                    self.engine.load_adapter(agent, path, version)
                except Exception as e:  # noqa: BLE001 - a bad version must not stop serving
                    if not os.path.isdir(path):   # not visible on this host (yet): try again next poll
                        if (agent, version) not in self._unseen:
                            self._unseen.add((agent, version))
                            log.warning("hot-swap: %s v%s: %s is not visible here yet (%s: %s); retrying; "
                                        "still serving v%s", agent, version, path, type(e).__name__, e, have)
                        continue
                    self._backoff(agent, version, path, have, e)
                    continue
            if failed is not None:
                log.info("hot-swap: %s v%s loaded after %d failed attempt(s)", agent, version, failed[0])
            self._failed = {k: f for k, f in self._failed.items() if k[0] != agent}
            swap = Swap(agent, version, have, time.time(), time.monotonic() - t0)
            log.info("hot-swap: %s v%s -> v%s (%.2fs)", agent, have, version, swap.load_s)
            self.swaps.append(swap)
            done.append(swap)
        return done

    def _backoff(self, agent: str, version: int | None, path: str, have: int | None, e: Exception) -> None:
        """Schedule the next try of a failed load; log the first failure of each version only."""
        failed = self._failed.get((agent, version))
        if failed is None:
            failed = self._failed[agent, version] = [0, self.retry_s, 0.0]
            log.error("hot-swap: cannot load %s v%s from %s (%s: %s); still serving v%s; retrying with "
                      "back-off up to every %.0f s (fix the engine or the files; a newer version is tried at once)",
                      agent, version, path, type(e).__name__, e, have, self.max_backoff_s)
        else:
            log.debug("hot-swap: %s v%s failed again (%s: %s)", agent, version, type(e).__name__, e)
            failed[1] = min(2 * failed[1], self.max_backoff_s)
        failed[0] += 1
        failed[2] = self.clock() + failed[1]

    def resolve(self, agent: str, version: int | None, path: str) -> str:
        """The directory to load: the row's path if it exists here, else the same version under this
        host's adapters_dir if that exists, else the row's path (the engine may see it elsewhere)."""
        if os.path.isdir(path) or self.adapters_dir is None or version is None:
            return path
        from trainer.adapters import version_dir

        local = version_dir(self.adapters_dir, agent, version)
        return local if os.path.isdir(local) else path

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - e.g. the store briefly locked; try again next tick
                log.exception("hot-swap: poll failed; retrying in %.1fs", self.interval_s)
            self._stop.wait(self.interval_s)

    def start(self) -> "AdapterWatcher":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="collab-hotswap", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
