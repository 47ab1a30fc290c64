"""A scripted streaming engine (no model) and an app context around it: real store (SQLite),
real tasks, the real batcher; every intermediate state of a round can be observed, never timed."""
from __future__ import annotations

import threading
import time

from collab_app.engines.engine_types import EngineError, Progress, Sample, Sampling
from collab_app.engines.team import Agent, Team
from collab_app.online.store import Store
from collab_app.web.context import AppContext
from tasks import load_task

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes. Residents said the lanes "
        "made the streets safer, but shop owners worried about parking. The council agreed to test "
        "the lanes for six months and then decide.")

class ScriptedStreamEngine:
    """Request i, sample j: "<agent> <j>: w0 w1 ..." (words from its prompt), one word per
    snapshot; sample j is done after 3 + 2 j words. With `gated`, each snapshot waits for
    `release()`; with `delay_s`, each comes that long after the last. A prompt containing BAD is
    refused with EngineError before any snapshot."""

    name, model_path, max_model_len = "scripted", "scripted", 4096

    def __init__(self, gated: bool = False, delay_s: float = 0.0):
        self.gate = threading.Semaphore(0) if gated else None
        self.delay_s = delay_s
        self.versions: dict = {}
        self.calls: list[int] = []            # requests per generate_stream call
        self.closed = threading.Event()       # a stream was closed before its end

    def register_agent(self, agent):
        self.versions.setdefault(agent, None)

    def load_adapter(self, agent, path, version):
        self.versions[agent] = version

    def adapter_version(self, agent):
        return self.versions.get(agent)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def final_text(self, req, j: int) -> str:
        words = req.prompt.split()[:3 + 2 * j]
        return f"{req.agent} {j}: " + " ".join(words)

    def generate_stream(self, requests, n, sampling):
        if any("BAD" in r.prompt for r in requests):
            raise EngineError("scripted refusal: the prompt says BAD")
        self.calls.append(len(requests))
        finals = [[self.final_text(r, j).split(" ") for j in range(n)] for r in requests]
        steps = max(len(w) for row in finals for w in row)
        try:
            for k in range(1, steps + 1):
                if self.gate is not None:
                    self.gate.acquire()
                if self.delay_s:
                    time.sleep(self.delay_s)
                texts = [[" ".join(w[:k]) for w in row] for row in finals]
                done = [[self._sample(r, " ".join(w)) if k >= len(w) else None for w in row]
                        for r, row in zip(requests, finals)]
                yield Progress(texts, done)
        except GeneratorExit:
            self.closed.set()
            raise

    def _sample(self, req, text):
        toks = list(range(len(text.split())))
        return Sample(req.agent, self.versions.get(req.agent), [1, 2, 3], text, toks, [-1.0] * len(toks), "stop")

    def generate(self, requests, n, sampling):
        last = None
        for last in self.generate_stream(requests, n, sampling):
            pass
        return last.result()

    def close(self):
        pass


def make_ctx(tmp_path, engine, G=2, **kw) -> AppContext:
    tasks = {name: load_task(name) for name in ("humaneval", "tldr")}
    teams = {name: Team([Agent(role) for role in t.roles]) for name, t in tasks.items()}
    for team in teams.values():
        for a in team.agents:
            engine.register_agent(a.name)
    return AppContext(engine=engine, store=Store(f"sqlite:///{tmp_path}/store.db"), tasks=tasks, teams=teams,
                      num_generations=G, sampling=Sampling(max_new_tokens=16), home=str(tmp_path), **kw)
