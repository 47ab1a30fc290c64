"""`AppContext`: the objects every session and API key of the app shares, passed explicitly.

The core (core.py) and both doors (handlers.py + ui.py, openai_api.py) take one `AppContext`
instead of reaching for module globals, so a test can build two apps on two stores side by side
and `collab serve` / `app.py` decide what goes in. Per-user state lives in `gr.State`, never here.

Thread safety: Gradio runs handlers in a thread pool. The engine is guarded by `engine_lock`
(generation, adapter loads); the store does its own sessions; `team_settings_lock` guards the
editable team settings (role prompts, num_generations, sampling) that the Team tab changes.

Hosting in public, what lives here:
- `isolation`: the sandbox's isolation (tasks.sandbox.isolation()), asked per request (the sandbox
  keeps a strong result and re-probes a weak one at most every 30 s, so a transient failure at
  start-up does not switch the feature off until a restart); a person's own coding problem (their
  tests are code) runs only where it allows untrusted code (`untrusted_allowed`), or on an app
  that trusts its person (`trusts_its_person`: loopback only, no proxy in front), at the best
  isolation this machine has, which the page says (`isolation_summary`).
- `admin_token` (must pass access.admin_token_problem, checked here), `admin_guard` (wrong
  guesses), `loopback_admin` (serve `--loopback-admin`): read by access.check_admin.
- `limits`: access.Limits built from the `max_*` fields (the page's quota; /v1 sets its own);
  prompts are counted in tokens with a private copy of the engine's tokenizer
  (`prompt_token_counts`) before they reach the batcher (engines/batcher.py).
- `SharedViews`: what every visitor sees alike (the Training tab) computed once per TTL.
- `prepare_home` / `open_store`: COLLAB_HOME 0700 and the SQLite file 0600.
"""
from __future__ import annotations

import copy
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from collab_app import paths
from collab_app.engines.batcher import GenerationBatcher
from collab_app.engines.engine_types import Sampling
from collab_app.web.access import AdminGuard, Limits, Quota, check_admin_token
from tasks import SERVED_BY_DEFAULT, team_of

log = logging.getLogger(__name__)



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


def storage_warning(home: str, store_on_server: bool = False) -> str | None:
    """On a Hugging Face Space the disk is wiped at every restart unless persistent storage is
    mounted at /data and COLLAB_HOME points into it. Returns the warning to show, or None.
    `store_on_server`: the store is a database server (COLLAB_DB), which keeps groups and ratings;
    only the adapters under COLLAB_HOME go (the trainer then starts a fresh adapter, numbered past
    the store's newest version: collab_app/online/service.py check_lineage)."""
    if not os.environ.get("SPACE_ID"):
        return None
    home_abs = os.path.abspath(home)
    if os.path.isdir("/data") and (home_abs == "/data" or home_abs.startswith("/data/")):
        return None
    if store_on_server:
        return ("**Adapters are ephemeral on this Space**: groups and ratings are kept in the database "
                "(COLLAB_DB), but the team's trained adapters are lost when the Space restarts, and training "
                "starts again from the base model. Add persistent storage (mounted at /data) and set "
                "`COLLAB_HOME=/data` to keep them (see docs/SPACES.md).")
    return ("**Data is ephemeral on this Space**: groups, ratings and adapters are lost when it "
            "restarts. Add persistent storage (mounted at /data) and set `COLLAB_HOME=/data` "
            "(see docs/SPACES.md).")


def prepare_home(home: str) -> str:
    """Create COLLAB_HOME as 0700 (or make an existing one 0700 where we own it): the store,
    adapters and exports under it are then unreadable for other users of the machine, and for
    a sandbox that runs checks under another uid. Returns the absolute path. A home we cannot
    chmod (a mount owned by someone else) is logged, not fatal."""
    home = os.path.abspath(home)
    os.makedirs(home, mode=0o700, exist_ok=True)
    try:
        if os.stat(home).st_mode & 0o077:
            os.chmod(home, 0o700)
    except PermissionError as e:
        log.warning("could not make COLLAB_HOME %s private (0700): %s; other users may read the store", home, e)
    return home


def _private_files(paths) -> None:
    for p in paths:
        try:
            if os.path.exists(p) and os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)
        except PermissionError as e:
            log.warning("could not make %s private (0600): %s", p, e)


def open_store(home: str, store_url: str | None = None):
    """The store at `store_url` (else $COLLAB_DB, else sqlite:///<home>/collab.db) in a private
    home: a SQLite file (and its -wal/-shm, which SQLite creates with the database's mode) is
    made 0600, also when an older version created it 0644."""
    import sqlalchemy as sa

    from collab_app.online.store import Store

    home = prepare_home(home)
    store = Store(store_url or os.environ.get("COLLAB_DB") or f"sqlite:///{os.path.join(home, 'collab.db')}")
    url = sa.engine.make_url(store.url)
    if store.is_sqlite and url.database not in (None, "", ":memory:"):
        db = os.path.abspath(url.database)
        _private_files([db, db + "-wal", db + "-shm", db + "-journal"])
    return store


class SharedViews:
    """Values every visitor sees alike (the Training tab's status and figures), computed at most
    once per `ttl_s` for all of them: N pages polling cost one store query and one set of
    figures per TTL, not N. Concurrent misses of one key wait for the first one's result
    (cachetools' `condition`: no stampede). `clear()` after a change a person should see at once
    (pause, allow own problems). In memory, per process."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        import cachetools

        self._cache = cachetools.TTLCache(maxsize=64, ttl=ttl_s, timer=clock)
        self._cond = threading.Condition()
        self._fns: dict = {}
        self._fns_lock = threading.Lock()

    def get(self, key, compute: Callable[[], Any]):
        """`compute()`'s value for `key`, reused for `ttl_s`. One wrapper per key: cachetools keeps
        the in-progress keys per wrapper, so a key's first `compute` is the one used."""
        import cachetools

        with self._fns_lock:
            fn = self._fns.get(key)
            if fn is None:
                fn = self._fns[key] = cachetools.cached(self._cache, key=lambda: key, condition=self._cond)(compute)
        return fn()

    def clear(self) -> None:
        with self._cond:
            self._cache.clear()


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
    """COLLAB_ADMIN_TOKEN: needed for admin actions (edit team, pin/roll back, pause training,
    export, rate any group). Must pass `admin_token_problem` (ValueError otherwise). None = admin
    actions are off (except for loopback clients with `loopback_admin`)."""
    public: bool = False
    """reachable by others (share link / non-loopback host): only for what the page shows."""
    loopback_admin: bool = False
    """clients on this machine (127.0.0.1, ::1) are admin without a token (serve --loopback-admin).
    Off by default: behind a reverse proxy on the same machine every visitor looks like loopback."""
    home: str = field(default_factory=paths.home)
    """COLLAB_HOME: store and adapters live under it (0700; exports go to a temp dir, never here)."""
    adapters_dir: str | None = None
    """this host's mount of the trainer's adapters dir, for version rows written on another machine (None = the rows' paths as they are)."""
    max_prompt_chars: int = 20_000
    """longest prompt / pasted text / tests accepted from a person (characters; tokens are checked too)."""
    max_generations: int = 4
    """most candidates the UI lays out (num_generations can be raised up to this in the Team tab)."""
    generate_concurrency: int = 8
    """generation events running at once; their engine calls are merged (GenerationBatcher)."""
    max_rounds_per_minute: int = 10
    """rounds (Generate / Another round) one session or login may start per minute (0 = no limit)."""
    max_ratings_per_minute: int = 60
    """ratings one session or login may store per minute; a ranking or pick of G counts G (0 = no limit)."""
    max_rounds_in_flight: int = 1
    """rounds one session or login may have generating at once (0 = no limit): one client cannot
    hold every generate slot."""
    max_rounds_in_flight_per_network: int = 4
    """most rounds one client network may have generating at once over all its sessions (0 = no
    limit); fewer while other networks generate: a fair share of the generate_concurrency slots,
    max(1, slots // (networks generating + 1)) (access.Limits.network_slots)."""
    max_new_sessions_per_minute: int = 20
    """server-issued sessions (identity.IdentityMiddleware) one client network may start per minute (0 = no limit)."""
    max_rounds_per_minute_per_network: int = 30
    """rounds one client network may start per minute over all its sessions (0 = no limit)."""
    max_ratings_per_minute_per_network: int = 240
    """ratings one client network may store per minute over all its sessions (0 = no limit)."""
    max_ratings_per_minute_global: int = 600
    """ratings every caller together (page and /v1) may store per minute: no crowd of identities outvotes it (0 = no limit)."""
    anonymous_share: float = 1.0
    """the trainer's max_anonymous_share, told to raters who did not sign in (serve sets it where Hugging Face sign-in is available; 1 = no cap)."""
    require_login_to_rate: bool = False
    """ratings from the page need a Hugging Face login (a Space with `hf_oauth: true`); API keys and the admin token still rate."""
    session_secret: bytes | None = field(default=None, repr=False)
    """the key that signs session cookies (identity.session_secret: $COLLAB_SESSION_SECRET, else random at start)."""
    trusted_proxy_hops: int | None = None
    """proxies in front that append to X-Forwarded-For (None: identity.trusted_proxy_hops: $COLLAB_TRUSTED_PROXY_HOPS, else 1 on a Space, else 0)."""
    isolation: dict | None = None
    """the sandbox's isolation; None = ask tasks.sandbox.isolation() each time (cached there), a dict pins it (tests)."""
    shared_ttl_s: float = 10.0
    """how long the Training tab's status and figures are reused for every visitor (seconds)."""
    training_refresh_s: float = 10.0
    """how often an open Training tab refreshes (seconds; only while it is the selected tab)."""
    page_update_s: float = 0.25
    """least seconds between two updates of a round streaming into the page. Each update costs
    Gradio 6.31 ~20-30 ms of Python per page (every output the update leaves alone, gr.skip(), is
    rebuilt as a component: ui._Panel has ~35), under the GIL the in-process engine's decode loop
    needs: at 0.1 s a round in the page took 2-3x the API's."""
    trainer_child: Any = field(default=None, repr=False)
    """the trainer child `collab serve` supervises (serve.ChildTrainer: its `describe()` says why it
    is not training, for the Training tab), or None (an external trainer, none, tests)."""
    engine_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    team_settings_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watcher: Any = field(default=None, repr=False)
    _batcher: Any = field(default=None, repr=False)
    _arena_slots: Any = field(default=None, repr=False)
    arena_ahead: dict = field(default_factory=dict, repr=False)
    """caller key -> the arena pair written ahead for them (web/arena.py `write_ahead`)."""
    _tokenizer: Any = field(default=None, repr=False)
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    limits: Limits = field(init=False, repr=False)
    """access.Limits over the fields above: every round and rating of both doors counts there."""
    admin_guard: AdminGuard = field(init=False, repr=False)
    shared_views: SharedViews = field(init=False, repr=False)
    identity: Any = field(init=False, repr=False)
    """identity.SessionIdentity: signs session cookies, counts new sessions per network, binds session hashes."""

    def __post_init__(self):
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: MAGRPO needs a group of siblings")
        for name in ("max_rounds_per_minute", "max_ratings_per_minute", "max_rounds_in_flight",
                     "max_rounds_in_flight_per_network", "max_new_sessions_per_minute",
                     "max_rounds_per_minute_per_network", "max_ratings_per_minute_per_network", "max_ratings_per_minute_global"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 = no limit), got {v!r}")
        for name in ("shared_ttl_s", "training_refresh_s", "page_update_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.admin_token == "":
            self.admin_token = None
        check_admin_token(self.admin_token)
        self.limits = Limits(Quota(self.max_rounds_per_minute, self.max_ratings_per_minute, self.max_rounds_in_flight),
                             rounds_per_minute_per_network=self.max_rounds_per_minute_per_network,
                             ratings_per_minute_per_network=self.max_ratings_per_minute_per_network,
                             ratings_per_minute=self.max_ratings_per_minute_global,
                             rounds_in_flight_per_network=self.max_rounds_in_flight_per_network,
                             generate_slots=self.generate_concurrency)
        from collab_app.web.identity import SessionIdentity
        self.identity = SessionIdentity(self.session_secret, self.max_new_sessions_per_minute,
                                        self.trusted_proxy_hops)
        self.session_secret = None   # kept only inside the signer
        self.admin_guard = AdminGuard()
        self.shared_views = SharedViews(self.shared_ttl_s)
        self.max_generations = max(self.max_generations, self.num_generations)

    def _isolation(self) -> dict:
        if self.isolation is not None:
            return self.isolation
        from tasks.sandbox import isolation   # cached by the sandbox; a weak result is re-probed
        return isolation()

    @property
    def trusts_its_person(self) -> bool:
        """A local app trusts its person: reachable from this machine only (not
        `public`) and no proxy in front (identity.trusted_proxy_hops 0: a proxy on this machine
        would bring others in from loopback), so the only person is the one who started it, and
        their own coding problem runs at the best isolation this machine has instead of being
        refused (tasks.sandbox.on_behalf_of(local_person=True), core._score)."""
        return not self.public and not self.identity.proxy_hops

    @property
    def untrusted_allowed(self) -> bool:
        """May code and tests a person typed run here? The sandbox says ("untrusted_allowed");
        a sandbox that does not say yet: anything but the "plain" mode. An app that trusts its
        person (`trusts_its_person`) runs them at whatever level the sandbox has."""
        if self.trusts_its_person:
            return True
        iso = self._isolation()
        return bool(iso.get("untrusted_allowed", iso.get("mode", "plain") != "plain"))

    @property
    def isolation_summary(self) -> str:
        """One line for the page: the sandbox's own summary (on an app that trusts its person, the
        one saying the person's own problem runs at that level anyway), else one made from its fields."""
        iso = self._isolation()
        if self.trusts_its_person and iso.get("summary_local"):
            return str(iso["summary_local"])
        if iso.get("summary"):
            return str(iso["summary"])
        parts = [label for key, label in (("network_blocked", "network blocked"),
                                          ("read_only_filesystem", "read-only filesystem"),
                                          ("separate_uid", "separate uid")) if iso.get(key)]
        return f"{iso.get('mode', 'unknown')}" + (f" ({', '.join(parts)})" if parts else " (no isolation beyond rlimits)")

    def prompt_token_counts(self, requests) -> list[int] | None:
        """Tokens of each engine Request (chat template and role prompt included, as the engine
        counts them), or None when the engine has no local tokenizer (a scripted test engine, a
        remote one). Uses a private copy of the engine's tokenizer under its own lock: a Rust
        tokenizer used from two threads at once can fail ("Already borrowed"), and the engine's
        own is busy in the batcher's thread."""
        if not isinstance(getattr(self.engine, "max_model_len", None), int):
            return None
        if hasattr(self.engine, "prompt_token_counts"):   # a heterogeneous team: each agent's own tokenizer
            return self.engine.prompt_token_counts(requests)
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            return None
        from collab_app.engines.requests import chat_prompt_ids
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = copy.deepcopy(tok)
            return [len(chat_prompt_ids(self._tokenizer, r)) for r in requests]

    def team_for(self, task_name: str):
        """The team for a task: the task says whose (a person's own coding problem: the coding team's)."""
        if task_name in self.teams:
            return self.teams[task_name]
        if team_of(task_name) in self.teams:
            return self.teams[team_of(task_name)]
        raise KeyError(f"no team for task {task_name!r}; teams: {sorted(self.teams)}")

    def agent_names(self) -> list[str]:
        """Every agent of every team, once (teams of different tasks may share agents)."""
        return list(dict.fromkeys(a.name for t in self.teams.values() for a in t.agents))

    def adapter_watcher(self):
        """The hot-swap watcher (collab_app.online.hotswap) over every agent, sharing `engine_lock`."""
        if self._watcher is None:
            from collab_app.online.hotswap import AdapterWatcher
            self._watcher = AdapterWatcher(self.engine, self.store, self.agent_names(), lock=self.engine_lock,
                                           adapters_dir=self.adapters_dir)
        return self._watcher

    def batcher(self) -> GenerationBatcher:
        """The one batcher of this app: rounds of every session and API key merged into engine calls,
        each after loading the agents' current adapter versions."""
        with self.team_settings_lock:
            if self._batcher is None:
                self._batcher = GenerationBatcher(self.engine, self.engine_lock, self._poll_before_batch,
                                                  max_examples=max(self.generate_concurrency, 1))
            return self._batcher

    def arena_slots(self):
        """The engine agents that serve the arena's team states (engines/version_slots.py), sharing `engine_lock`."""
        with self.team_settings_lock:
            if self._arena_slots is None:
                from collab_app.engines.version_slots import VersionSlots
                self._arena_slots = VersionSlots(self.engine, self.engine_lock, resolve=self.adapter_watcher().resolve)
            return self._arena_slots

    def wait_for_arena_ahead(self, key: str, timeout_s: float = 120.0) -> None:
        """Wait until the arena pair written ahead for `key` (web/arena.py `write_ahead`) is done: it
        holds that person's round in flight, and their own round should follow it, not be refused."""
        ahead = self.arena_ahead.get(key)
        if ahead is not None:
            ahead.finished.wait(timeout_s)

    def _poll_before_batch(self) -> None:
        """Load the agents' current adapters before a batch; if that fails, serve the versions
        loaded and say so in the log: the poll is an update, and its failure (a store read that
        failed, a bug) must not fail every round waiting in the batch. The watcher already rides
        out a failed store read on its own (hotswap.AdapterWatcher.poll_once)."""
        try:
            self.adapter_watcher().poll_once()
        except Exception:  # noqa: BLE001
            log.exception("hot-swap poll before a batch failed; the batch runs on the adapter versions loaded")

    @property
    def storage_warning(self) -> str | None:
        return storage_warning(self.home, store_on_server=not self.store.is_sqlite)


def build_context(model: str | None = None, engine: str = "auto", store_url: str | None = None,
                  task_names: tuple[str, ...] = SERVED_BY_DEFAULT,
                  num_generations: int = 2, max_new_tokens: int = 256, temperature: float = 0.8,
                  public: bool = False, home: str | None = None, limits: dict | None = None,
                  adapters_dir: str | None = None, admin_token: str | None = None,
                  agent_models: dict[str, str] | None = None, **engine_kw) -> AppContext:
    """Everything the app needs, from settings: provision the model, start the engine, open the
    store, load tasks and their teams, load each agent's current adapter. Heavy imports happen
    here, not at module import. `agent_models`: role -> its own base (a heterogeneous team:
    one engine per distinct base, engines/team.py TeamEngine); other roles run on `model`."""
    from collab_app.engines.model import ensure_model
    from collab_app.engines.team import Agent, Team, make_team_engine
    from tasks import largest_team, load_task, roles_of

    limits = dict(limits or {})   # more AppContext fields, e.g. {"max_rounds_per_minute": 0, "loopback_admin": True}
    # the admin token comes from the caller (collab serve reads COLLAB_ADMIN_TOKEN once and drops
    # it from the environment): checked here before the slow part, so a weak one stops at once
    check_admin_token(admin_token or None)
    from tasks.sandbox import isolation
    log.info("sandbox isolation: %s", isolation())   # probe now, not in the first visitor's request
    home = prepare_home(home or paths.home())
    store = open_store(home, store_url)
    tasks = {name: load_task(name) for name in task_names}
    # one agent per task role; the agent name is the role (the engine's adapter key), so tasks
    # with the same roles share agents and adapters.
    agent_models = dict(agent_models or {})
    teams = {name: Team([Agent(role, model=agent_models.get(role)) for role in task.roles]) for name, task in tasks.items()}
    # vLLM sizes its agent table by it (the engine race too): every role, and the arena's slots
    # (engines/version_slots.py: DEFAULT_SLOTS team states served beside the shared team)
    from collab_app.engines.version_slots import DEFAULT_SLOTS
    num_agents = len(roles_of(tasks.values())) + DEFAULT_SLOTS * largest_team(tasks.values())
    # a compiled CPU engine computes `lora_lanes` adapter versions in every forward: one call
    # (GenerationBatcher: one team) holds one team's
    lanes = largest_team(tasks.values())
    eng = make_team_engine(engine, ensure_model(model), {a.name: a.model or "" for t in teams.values() for a in t.agents},
                           **({"num_agents": num_agents, "lora_lanes": lanes} | engine_kw))
    ctx = AppContext(engine=eng, store=store, tasks=tasks, teams=teams,
                     num_generations=num_generations,
                     sampling=Sampling(max_new_tokens=max_new_tokens, temperature=temperature),
                     admin_token=admin_token or None, public=public, home=home, adapters_dir=adapters_dir, **limits)
    for team in teams.values():
        for agent in team.agents:
            eng.register_agent(agent.name)
    ctx.adapter_watcher().poll_once()   # each agent's current adapter, before the first visitor
    return ctx
