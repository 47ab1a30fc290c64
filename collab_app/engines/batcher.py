"""`GenerationBatcher`: concurrent callers' team rounds merged into one streaming engine call.

Used by the web app's core (collab_app/web/core.py `play_round`) for both of its doors; it knows
only an engine, its lock and a team (engines/team.py), nothing of sessions or stores.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class GenerationTicket:
    """One submitted request's stream, filled by the batcher's thread. `events` receives, in order:
    ("progress", texts[i][g], done[i][g]) for every engine snapshot (this request's slice: agent i,
    sample g; done entries are Samples or None), then ("done", samples[i][g]) or ("error", exc).
    The consumer may put its own events into the same queue (core.play_round puts ("checked",
    g) when a candidate's automatic check finishes) so that one queue wakes it. `cancel()` when
    the consumer stops listening (a closed page): the batcher stops feeding it, and stops the
    engine call when nobody in the batch listens any more."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class GenerationBatcher:
    """Merges the generation requests of concurrent sessions into one streaming engine call.

    Each Generate press submits (team, prompts, G, sampling) and gets a `GenerationTicket`. A
    worker thread takes the first waiting request, collects whatever else is waiting, and whatever
    arrives within `window_s` while there is company (up to `max_examples`), and runs one
    `Team.generate_stream` per (team, G,
    sampling) for all of them, under `lock` (the engine's), after `before_batch()` (the app:
    load the current adapter versions); every snapshot is cut into each request's slice and put into its ticket, so each
    session sees its own candidates grow. Batched decoding is where an engine's throughput comes
    from (docs/ENGINES.md "Batching": one prompt ~20-40 tok/s, a batch of 16 ~100-350), so with
    several people waiting the last one waits about one batch, not N. A request that arrives while
    a batch runs waits for the next one (continuous batching would need the engine's own
    scheduler). If a batch fails with EngineError (one bad prompt), its requests are retried one
    by one so that only the bad one fails (the others' streams start again from empty text).

    Company: a request submitted while another is open (waiting or generating) marks it; for
    `company_s` after that, the first request of a batch waits `window_s` for others to join.
    Without company it starts at once: one person's rounds never overlap, and a window would be a
    fixed wait before their first words (0.25 s of the page's ~0.8-1.1 s). The cost: the first burst after a quiet spell (people
    pressing Generate within the same quarter second) starts its first request alone, and the
    others, queued meanwhile, share the next call; from then on, company is known."""

    def __init__(self, engine, lock, before_batch: Callable[[], Any] | None = None, max_examples: int = 16,
                 window_s: float = 0.25, company_s: float | None = 120.0):
        self.engine, self.lock, self.before_batch = engine, lock, before_batch
        self.max_examples, self.window_s, self.company_s = max_examples, window_s, company_s
        self._q: queue.Queue = queue.Queue()
        self._mu = threading.Lock()
        self._open: set = set()               # tickets submitted and not yet ended (done, error, or left)
        self._company_at = float("-inf")      # monotonic time a request last arrived while another was open
        self.batches: list[int] = []          # examples per engine call (last 1000; for tests / logs)
        self._thread = threading.Thread(target=self._run, name="collab-generate-batcher", daemon=True)
        self._thread.start()

    def submit(self, team, prompts: list[str], G: int, sampling) -> GenerationTicket:
        ticket = GenerationTicket()
        with self._mu:
            if self._open:
                self._company_at = time.monotonic()
            self._open.add(ticket)
        self._q.put((team, list(prompts), G, sampling, ticket))
        return ticket

    def in_company(self) -> bool:
        """Whether a request arrived while another was open within the last `company_s` seconds
        (company_s None: always, every batch waits its window)."""
        return self.company_s is None or time.monotonic() - self._company_at < self.company_s

    def _run(self) -> None:
        while True:
            items = [self._q.get()]
            deadline = time.monotonic() + (self.window_s if self.in_company() else 0.0)
            while len(items) < self.max_examples:   # timeout 0: only what is already waiting
                try:
                    items.append(self._q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            groups: dict = {}
            for it in items:
                groups.setdefault((id(it[0]), it[2], it[3]), []).append(it)
            for batch in groups.values():
                try:
                    self._generate(batch)
                finally:   # tickets whose listeners left, and any path that did not end them
                    self._end(*(it[4] for it in batch))

    def _end(self, *tickets: GenerationTicket) -> None:
        """The tickets are no longer open: called before their last event is put, so a caller who
        submits the moment it reads "done" is not taken for company."""
        with self._mu:
            self._open.difference_update(tickets)

    def _generate(self, batch) -> None:
        from collab_app.engines.engine_types import EngineError

        team, _, G, sampling, _ = batch[0]
        live = [it for it in batch if not it[4].cancelled]
        if not live:
            return
        try:
            last = None
            with self.lock:
                if self.before_batch is not None:
                    self.before_batch()
                stream = team.generate_stream(self.engine, [it[1] for it in live], G, sampling)
                try:
                    for last in stream:
                        if all(it[4].cancelled for it in live):
                            break   # nobody listens: stop the engine call (closing the stream)
                        for e, it in enumerate(live):
                            if not it[4].cancelled:
                                it[4].events.put(("progress", last.texts[e], last.done[e]))
                finally:
                    stream.close()
            if last is None or not last.finished:
                return   # every listener left
            self.batches = (self.batches + [len(live)])[-1000:]
            self._end(*(it[4] for it in live))
            for e, it in enumerate(live):
                it[4].events.put(("done", last.done[e]))
        except EngineError as e:
            if len(live) == 1:
                self._end(live[0][4])
                live[0][4].events.put(("error", e))
                return
            for it in live:   # find the bad request(s): one call each
                self._generate([it])
        except Exception as e:  # noqa: BLE001 - every waiting session gets the error, the thread lives
            log.exception("generation batch failed")
            self._end(*(it[4] for it in live))
            for it in live:
                it[4].events.put(("error", e))
