"""`AppContext`: the objects every session of the Gradio app shares, passed explicitly.

The UI (`ui.build_app`) and its handlers (`handlers.py`) take one `AppContext` instead of reaching
for module globals, so a test can build two apps on two stores side by side and `collab serve` /
`app.py` decide what goes in. Per-user state lives in `gr.State`, never here.

Thread safety: Gradio runs handlers in a thread pool. The engine is guarded by `engine_lock`
(generation, adapter loads); the store does its own sessions; `team_settings_lock` guards the
editable team settings (role prompts, num_generations, sampling) that the Team tab changes.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from collab_app.engines.engine_types import Sampling

log = logging.getLogger(__name__)

# Coding tasks take a HumanEval problem or the person's own; every other task is a writing
# task on pasted text.
CODING_TASKS = ("humaneval",)


def default_home() -> str:
    """$COLLAB_HOME, else ~/.cache/collab (the same default as the CLI commands)."""
    return os.environ.get("COLLAB_HOME") or os.path.expanduser("~/.cache/collab")


def is_public(server_name: str | None, share: bool) -> bool:
    """True when people other than this machine's user can reach the app: a share link, or a
    host that is not a loopback address (0.0.0.0, a LAN address, a Space)."""
    if share or os.environ.get("SPACE_ID"):
        return True
    host = (server_name or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1").strip()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name other than localhost: assume reachable from outside


def storage_warning(home: str) -> str | None:
    """On a Hugging Face Space the disk is wiped at every restart unless persistent storage is
    mounted at /data and COLLAB_HOME points into it. Returns the warning to show, or None."""
    if not os.environ.get("SPACE_ID"):
        return None
    home_abs = os.path.abspath(home)
    if os.path.isdir("/data") and (home_abs == "/data" or home_abs.startswith("/data/")):
        return None
    return ("**Data is ephemeral on this Space**: groups, ratings and adapters are lost when it "
            "restarts. Add persistent storage (mounted at /data) and set `COLLAB_HOME=/data` "
            "(see docs/SPACES.md).")


class RateLimiter:
    """At most `limit` events per `window_s` seconds per key (a session or a login), over a
    sliding window; `limit` 0 = no limit. Thread-safe. In memory: a restart forgets it, and a
    person who opens many sessions gets a limit each (per-IP limits were left out: Spaces and
    proxies put many people behind one address)."""

    def __init__(self, limit: int, window_s: float = 60.0):
        self.limit, self.window_s = limit, window_s
        self._events: dict[str, collections.deque] = {}
        self._lock = threading.Lock()

    def take(self, key: str, n: int = 1) -> float | None:
        """Record `n` events for `key` and return None, or (over the limit: nothing recorded)
        the seconds until `n` more fit."""
        if not self.limit:
            return None
        now = time.monotonic()
        with self._lock:
            if len(self._events) > 10_000:   # forget idle keys
                self._events = {k: q for k, q in self._events.items() if q and q[-1] > now - self.window_s}
            q = self._events.setdefault(key, collections.deque())
            while q and q[0] <= now - self.window_s:
                q.popleft()
            if n > self.limit:
                return math.inf
            if len(q) + n > self.limit:
                return q[len(q) + n - self.limit - 1] + self.window_s - now
            q.extend([now] * n)
            return None


class GenerationTicket:
    """One submitted request's stream, filled by the batcher's thread. `events` receives, in order:
    ("progress", texts[i][g], done[i][g]) for every engine snapshot (this request's slice: agent i,
    sample g; done entries are Samples or None), then ("done", samples[i][g]) or ("error", exc).
    The consumer may put its own events into the same queue (handlers.generate puts ("checked",
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
    worker thread takes the first waiting request, collects whatever else arrives within
    `window_s` (up to `max_examples`), and runs one `Team.generate_stream` per (team, G,
    sampling) for all of them, under `ctx.engine_lock`, after loading the current adapter
    versions; every snapshot is cut into each request's slice and put into its ticket, so each
    session sees its own candidates grow. Batched decoding is where an engine's throughput comes
    from (NOTES-vllm-cpu.md: one prompt ~20-40 tok/s, a batch of 16 ~100-350), so with several
    people waiting the last one waits about one batch, not N. A request that arrives while a
    batch runs waits for the next one (continuous batching would need the engine's own
    scheduler). If a batch fails with EngineError (one bad prompt), its requests are retried one
    by one so that only the bad one fails (the others' streams start again from empty text)."""

    def __init__(self, ctx: "AppContext", max_examples: int = 16, window_s: float = 0.25):
        self.ctx, self.max_examples, self.window_s = ctx, max_examples, window_s
        self._q: queue.Queue = queue.Queue()
        self.batches: list[int] = []          # examples per engine call (last 1000; for tests / logs)
        self._thread = threading.Thread(target=self._run, name="collab-generate-batcher", daemon=True)
        self._thread.start()

    def submit(self, team, prompts: list[str], G: int, sampling) -> GenerationTicket:
        ticket = GenerationTicket()
        self._q.put((team, list(prompts), G, sampling, ticket))
        return ticket

    def _run(self) -> None:
        while True:
            items = [self._q.get()]
            deadline = time.monotonic() + self.window_s
            while len(items) < self.max_examples:
                try:
                    items.append(self._q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            groups: dict = {}
            for it in items:
                groups.setdefault((id(it[0]), it[2], it[3]), []).append(it)
            for batch in groups.values():
                self._generate(batch)

    def _generate(self, batch) -> None:
        from collab_app.engines.engine_types import EngineError

        team, _, G, sampling, _ = batch[0]
        live = [it for it in batch if not it[4].cancelled]
        if not live:
            return
        try:
            last = None
            with self.ctx.engine_lock:
                self.ctx.adapter_watcher().poll_once()
                stream = team.generate_stream(self.ctx.engine, [it[1] for it in live], G, sampling)
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
            for e, it in enumerate(live):
                it[4].events.put(("done", last.done[e]))
        except EngineError as e:
            if len(live) == 1:
                live[0][4].events.put(("error", e))
                return
            for it in live:   # find the bad request(s): one call each
                self._generate([it])
        except Exception as e:  # noqa: BLE001 - every waiting session gets the error, the thread lives
            log.exception("generation batch failed")
            for it in live:
                it[4].events.put(("error", e))


@dataclass
class AppContext:
    engine: Any
    """the inference engine (`collab_app.engines.engine_types.Engine`): vllm or transformers."""
    store: Any
    """`collab_app.online.store.Store`: groups, samples, rewards, ratings, adapter versions, train steps."""
    tasks: dict[str, Any]
    """task choices by name (`humaneval`, `tldr`, `expansion`): `tasks.base.Task` objects."""
    teams: dict[str, Any]
    """task name -> `collab_app.engines.team.Team` working on it (its agents, one adapter each)."""
    num_generations: int = 2
    """G: joint answers per prompt (>= 2: MAGRPO compares siblings)."""
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=256, temperature=0.8))
    """sampling settings for the team's answers."""
    admin_token: str | None = None
    """COLLAB_ADMIN_TOKEN: needed for admin actions (edit team, pin/roll back, pause training)."""
    public: bool = False
    """reachable by others (share link / non-loopback host): admin actions then need the token."""
    home: str = field(default_factory=default_home)
    """COLLAB_HOME: store, adapters and exports live under it."""
    max_prompt_chars: int = 20_000
    """longest prompt / pasted text / tests accepted from a person (characters)."""
    max_generations: int = 4
    """most candidates the UI lays out (num_generations can be raised up to this in the Team tab)."""
    generate_concurrency: int = 8
    """generation events running at once; their engine calls are merged (GenerationBatcher)."""
    max_rounds_per_minute: int = 10
    """rounds (Generate / Another round) one session or login may start per minute (0 = no limit)."""
    max_ratings_per_minute: int = 60
    """ratings one session or login may store per minute; a ranking or pick of G counts G (0 = no limit)."""
    engine_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    team_settings_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watcher: Any = field(default=None, repr=False)
    _batcher: Any = field(default=None, repr=False)
    round_limiter: RateLimiter = field(init=False, repr=False)
    rating_limiter: RateLimiter = field(init=False, repr=False)

    def __post_init__(self):
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: MAGRPO needs a group of siblings")
        for name in ("max_rounds_per_minute", "max_ratings_per_minute"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 = no limit), got {v!r}")
        self.round_limiter = RateLimiter(self.max_rounds_per_minute)
        self.rating_limiter = RateLimiter(self.max_ratings_per_minute)
        self.max_generations = max(self.max_generations, self.num_generations)
        if self.admin_token == "":
            self.admin_token = None

    def team_for(self, task_name: str):
        """The team for a task; a person's own coding problem uses the coding team."""
        if task_name in self.teams:
            return self.teams[task_name]
        if task_name == "custom-coding":
            for name in CODING_TASKS:
                if name in self.teams:
                    return self.teams[name]
        raise KeyError(f"no team for task {task_name!r}; teams: {sorted(self.teams)}")

    def agent_names(self) -> list[str]:
        """Every agent of every team, once (teams of different tasks may share agents)."""
        return list(dict.fromkeys(a.name for t in self.teams.values() for a in t.agents))

    def adapter_watcher(self):
        """The hot-swap watcher (collab_app.online.hotswap) over every agent, sharing `engine_lock`."""
        if self._watcher is None:
            from collab_app.online.hotswap import AdapterWatcher
            self._watcher = AdapterWatcher(self.engine, self.store, self.agent_names(), lock=self.engine_lock)
        return self._watcher

    def batcher(self) -> GenerationBatcher:
        with self.team_settings_lock:
            if self._batcher is None:
                self._batcher = GenerationBatcher(self, max_examples=max(self.generate_concurrency, 1))
            return self._batcher

    @property
    def storage_warning(self) -> str | None:
        return storage_warning(self.home)


def build_context(model: str | None = None, engine: str = "auto", store_url: str | None = None,
                  task_names: tuple[str, ...] = ("humaneval", "tldr", "expansion"),
                  num_generations: int = 2, max_new_tokens: int = 256, temperature: float = 0.8,
                  public: bool = False, home: str | None = None, limits: dict | None = None,
                  **engine_kw) -> AppContext:
    """Everything the app needs, from settings: provision the model, start the engine, open the
    store, load tasks and their teams, load each agent's current adapter. Heavy imports happen
    here, not at module import."""
    from collab_app.engines import make_engine
    from collab_app.engines.model import ensure_model
    from collab_app.online.store import Store
    from collab_app.engines.team import Agent, Team
    from tasks import load_task

    limits = dict(limits or {})   # AppContext's per-session limits, e.g. {"max_rounds_per_minute": 0}
    home = home or default_home()
    os.makedirs(home, exist_ok=True)
    store = Store(store_url or os.environ.get("COLLAB_DB") or f"sqlite:///{os.path.join(home, 'collab.db')}")
    tasks = {name: load_task(name) for name in task_names}
    # one agent per task role; the agent name is the role (the engine's adapter key), so tasks
    # with the same roles share agents and adapters.
    teams = {name: Team([Agent(role) for role in task.roles]) for name, task in tasks.items()}
    num_agents = len({a.name for t in teams.values() for a in t.agents})   # vLLM sizes its agent slots by it
    eng = make_engine(engine, model=ensure_model(model), **({"num_agents": num_agents} | engine_kw))
    ctx = AppContext(engine=eng, store=store, tasks=tasks, teams=teams,
                     num_generations=num_generations,
                     sampling=Sampling(max_new_tokens=max_new_tokens, temperature=temperature),
                     admin_token=os.environ.get("COLLAB_ADMIN_TOKEN") or None,
                     public=public, home=home, **limits)
    for team in teams.values():
        for agent in team.agents:
            eng.register_agent(agent.name)
    from collab_app.web.handlers import sync_adapters
    sync_adapters(ctx)
    return ctx
