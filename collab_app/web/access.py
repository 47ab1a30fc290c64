"""Who may do what, for both doors of the app (the Gradio page and the OpenAI-compatible /v1).

- `Caller`: who acts, as the server knows it (a server-issued web session or a Hugging Face
  login, an API key, the client's network), never a value the client picks.
- `UserError`: a refusal with a message saying what to fix and a `code` the doors map (the page
  shows the message; /v1 maps the code to an HTTP status and OpenAI's error shape).
- The admin token: its strength rule (`admin_token_problem`, checked at start-up) and the check
  of every admin action (`check_admin`), with wrong guesses slowed by `AdminGuard`.
- `Limits`: the one limits policy of both doors (rounds and ratings per minute per identity and
  per client network, rounds generating at once per identity and per door, and a global rating
  budget over everybody). The core (core.py) takes it for every round and every rating; a door
  only says which door the caller came through (`Caller.door`).

Nothing here imports the rest of the web package: core.py, handlers.py, openai_api.py and
context.py import it, never the other way round.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable


class UserError(ValueError):
    """Bad input or a refusal; the message says what to fix. Shown in the UI, never a crash.

    `code` says what kind of refusal it is, so a door can answer without reading the message or
    the exception chain: "invalid_value" (the default: fix the input), "not_found",
    "not_entitled" (another session's group), "rate_limit_exceeded" (with `retry_after` seconds,
    None when the request can never fit), "rounds_in_flight", "server_busy", "no_session",
    "admin" (admin actions off, token missing, wrong or locked out), "not_served" (a task this
    app does not serve), "store_busy" (the store was locked or did not answer: nothing stored,
    try again after `retry_after`)."""

    def __init__(self, message: str, code: str = "invalid_value", retry_after: float | None = None):
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


# --------------------------------------------------------------------------- callers

WEB, API = "web", "api"
"""the two doors a caller can come through (`Caller.door`)."""


@dataclass(frozen=True)
class Caller:
    """Who acts, as the server knows it (ui.py fills it from gr.Request, openai_api.py from the
    API key; never typed by a person)."""

    session_id: str | None
    """the server-issued session (identity.py: a signed cookie, `web:...`; the API's key id
    `api:...`): groups are stored under it. Never Gradio's session hash, which the client picks."""
    username: str | None = None
    """the Hugging Face login on a Space with OAuth (gr.Request.username), else None."""
    host: str | None = None
    """the client's address as uvicorn reports it (gr.Request.client.host), else None."""
    network: str | None = None
    """the client's network (identity.client_network: X-Forwarded-For only behind a trusted
    proxy); rounds and ratings are also counted per network and ratings keep it. None: not counted (tests)."""
    door: str = WEB
    """WEB (the page, gradio_client) or API (/v1 with a key): which quota of `Limits` applies."""

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def guard_keys(self) -> tuple[str, ...]:
        """Whose wrong admin guesses count together: the caller's identity (server-issued session
        or login) and its client network (a new session does not reset that); the address only
        when neither is known. Never a shared proxy address alone: behind a Space's proxy every
        visitor has the same one, and a guesser would lock out the admin."""
        keys = tuple(k for k in (self.rater, f"net:{self.network}" if self.network else None) if k)
        return keys or ((f"host:{self.host}",) if self.host else ("anonymous",))

    @property
    def rater(self) -> str | None:
        """The rater id stored with a rating: an API key's id (`api:...`); else hf:<login>, else
        session:<id>, else None."""
        if self.door == API:
            return self.session_id
        if self.username:
            return f"hf:{self.username}"[:200]
        return f"session:{self.session_id}"[:200] if self.session_id else None

    @property
    def signed_in(self) -> bool:
        """Whether an identity that costs something stands behind this caller: a Hugging Face
        login or an API key (stored with its ratings: the trainer's anonymous share reads it)."""
        return self.door == API or bool(self.username)

    @property
    def key(self) -> str:
        """Whose limits (rounds / ratings per minute, rounds at once) an action counts against."""
        return self.rater or "anonymous"


def api_caller(key_id: str, network: str | None = None) -> Caller:
    """An API key as the core sees it: its id is both the session its groups are stored under
    and the rater of its ratings; `network` the request's client network (identity.client_network)."""
    return Caller(key_id, network=network, door=API)


def hf_login_available(environ=None) -> bool:
    """Whether visitors can sign in with Hugging Face here: a Space (SPACE_ID) with `hf_oauth: true`
    in its README front matter, which makes the Space set OAUTH_CLIENT_ID (Gradio's LoginButton)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SPACE_ID") and env.get("OAUTH_CLIENT_ID"))


def is_loopback(host: str | None) -> bool:
    """True for a client address on this machine (127.0.0.0/8, ::1). Unknown or a name: False."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- the admin token

GOOD_TOKEN_HINT = ('make a good one with  python -c "import secrets; print(secrets.token_urlsafe(32))"  '
                   'and put it in COLLAB_ADMIN_TOKEN (a Space: a secret named COLLAB_ADMIN_TOKEN)')
MIN_TOKEN_CHARS = 16
MIN_TOKEN_DISTINCT = 8
# Straight runs a person types when asked for "something long": a token containing 6 characters
# in a row of one of these (or reversed) is refused.
_RUNS = ("abcdefghijklmnopqrstuvwxyz", "0123456789", "qwertyuiop", "asdfghjkl", "zxcvbnm")
_COMMON = ("password", "passwort", "changeme", "letmein", "secret", "admin", "token", "collab", "welcome",
           "default", "example")


def admin_token_problem(token: str | None) -> str | None:
    """Why `token` is too weak to guard admin actions, or None when it is good enough. The rule,
    plainly: at least 16 characters; at least 8 different characters; no common word (password,
    changeme, admin, secret, token, collab, ...) and no straight run of 6 (abcdef, 123456, qwerty,
    or reversed) inside it, case ignored. `secrets.token_urlsafe(32)` (43 random characters)
    passes, but for about 5 in a million by chance ("admin" or "token", case ignored, or a run of
    6: 4.7e-6 by the union bound); the error says what to change. None/"" = no token."""
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        return f"it has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed"
    if len(set(token)) < MIN_TOKEN_DISTINCT:
        return f"it has only {len(set(token))} different characters; at least {MIN_TOKEN_DISTINCT} are needed"
    low = token.lower()
    for word in _COMMON:
        if word in low:
            return f"it contains the common word {word!r}"
    for run in _RUNS:
        for seq in (run, run[::-1]):
            for i in range(len(seq) - 5):
                if seq[i:i + 6] in low:
                    return f"it contains the straight run {seq[i:i + 6]!r}"
    return None


def check_admin_token(token: str | None) -> None:
    """Start-up check of COLLAB_ADMIN_TOKEN: ValueError saying why and how to make a good one."""
    problem = admin_token_problem(token)
    if problem:
        raise ValueError(f"COLLAB_ADMIN_TOKEN is too weak to guard admin actions: {problem}; {GOOD_TOKEN_HINT}")


ADMIN_OFF = ("admin actions are off: this app has no admin token. Set COLLAB_ADMIN_TOKEN in the server's "
             "environment and restart (make one with  python -c \"import secrets; print(secrets.token_urlsafe(32))\""
             "); on your own machine you may instead start `collab serve --loopback-admin`")


def check_admin(ctx, token: str | None, caller: Caller | None = None) -> None:
    """Admin actions (edit team, pin / roll back adapters, pause training, export, rate any
    group). Allowed for a loopback caller when the app runs with `ctx.loopback_admin`; else the
    token must equal `ctx.admin_token` (constant-time compare). Without an admin token they are
    off. Wrong guesses lock out (`AdminGuard`, a doubling time) the caller's identity and client
    network (`Caller.guard_keys`: its server-issued session, never a shared proxy address) and
    the wrong token itself (the same guess from many sessions); the right token's own count never
    grows, so guesses from other sessions and networks never lock the admin out. An empty token
    is not a guess (a person pressed an admin button) and counts nothing."""
    if getattr(ctx, "loopback_admin", False) and caller is not None and caller.is_loopback:
        return
    if not ctx.admin_token:
        raise UserError(ADMIN_OFF, "admin")
    if not token:
        raise UserError("admin token missing: enter COLLAB_ADMIN_TOKEN's value in the 'admin token' box", "admin")
    keys = list(caller.guard_keys) if caller is not None else ["anonymous"]
    attempt = "try:" + hashlib.sha256(str(token).encode()).hexdigest()[:24]
    wait = max(ctx.admin_guard.locked(k) for k in (*keys, attempt))
    if wait > 0:
        raise UserError(f"too many wrong admin tokens from your session or network: try again in {math.ceil(wait)} s",
                        "admin", wait)
    if not hmac.compare_digest(str(token).encode(), ctx.admin_token.encode()):
        lock = max(ctx.admin_guard.failed(k) for k in (*keys, attempt))
        more = f"; further tries refused for {math.ceil(lock)} s" if lock else ""
        raise UserError(f"admin token wrong: enter COLLAB_ADMIN_TOKEN's value in the 'admin token' box{more}", "admin")
    for k in keys:
        ctx.admin_guard.succeeded(k)


# --------------------------------------------------------------------------- limits

class AdminGuard:
    """Slows wrong admin-token guesses per caller, without sleeping on a worker thread: after
    `free` wrong guesses, the caller is locked out for 2, 4, 8 ... s (doubling per further wrong
    guess, at most `max_lock_s`); during a lockout every token from that caller is refused at
    once, the right one too (else a lockout would not slow guessing). The count is forgotten
    `forget_s` after the last wrong guess, and on a right token.

    Chosen over sleeping because a sleep holds one of Gradio's worker threads per guess (a
    guesser could fill the pool); over a fixed lockout because doubling keeps an honest typo
    cheap and a guesser at a few guesses per hour. Keys (`check_admin`): the caller's
    server-issued session or login, its client network (identity.client_network: a new session
    does not reset it), and the wrong token itself; never a shared proxy address alone, so
    guesses from other visitors behind a Space's proxy do not lock the admin out. In memory."""

    def __init__(self, free: int = 5, max_lock_s: float = 900.0, forget_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.free, self.max_lock_s, self.forget_s, self.clock = free, max_lock_s, forget_s, clock
        self._fails: dict[str, tuple[int, float, float]] = {}   # key -> (wrong guesses, last, locked until)
        self._lock = threading.Lock()

    def locked(self, key: str) -> float:
        """Seconds `key` must still wait (0 = may try now)."""
        now = self.clock()
        with self._lock:
            n, last, until = self._fails.get(key, (0, -math.inf, -math.inf))
            if now - last > self.forget_s:
                self._fails.pop(key, None)
                return 0.0
            return max(0.0, until - now)

    def failed(self, key: str) -> float:
        """Record a wrong guess; returns the lockout it starts (0 = none yet)."""
        now = self.clock()
        with self._lock:
            if len(self._fails) > 10_000:   # forget idle callers
                self._fails = {k: v for k, v in self._fails.items() if now - v[1] <= self.forget_s}
            n, last, _ = self._fails.get(key, (0, -math.inf, -math.inf))
            n = 1 if now - last > self.forget_s else n + 1
            lock = 0.0 if n < self.free else min(self.max_lock_s, 2.0 ** (n - self.free + 1))
            self._fails[key] = (n, now, now + lock)
            return lock

    def succeeded(self, key: str) -> None:
        with self._lock:
            self._fails.pop(key, None)


class SessionSlots:
    """At most `limit` rounds generating at once per key (a session or a login; 0 = no limit), so
    that one client cannot hold every generate slot. Thread-safe; `acquire` never waits."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            if self.limit and self._held[key] >= self.limit:
                return False
            self._held[key] += 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    def held(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)

    def active(self) -> int:
        """Keys holding at least one slot now."""
        with self._lock:
            return len(self._held)


@dataclass(frozen=True)
class Quota:
    """What one identity coming through one door may do. 0 = no limit, everywhere."""

    rounds_per_minute: int = 10
    """rounds one identity may start per minute."""
    ratings_per_minute: int = 60
    """ratings one identity may store per minute; a ranking or pick of G counts G."""
    rounds_in_flight: int = 1
    """rounds one identity may have generating at once (one client cannot hold every slot)."""
    rounds_at_once: int = 0
    """rounds of this door generating at once over all its callers (/v1: each holds a worker thread)."""
    scope: str = "session"
    """what messages call one identity of this door ("session", "API key")."""

    def __post_init__(self):
        for name in ("rounds_per_minute", "ratings_per_minute", "rounds_in_flight", "rounds_at_once"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 = no limit), got {v!r}")


class Limits:
    """The one limits policy of both doors. A round: `begin_round(caller)` takes, in this order,
    a place among the door's rounds at once, one of the caller's rounds in flight, one of its
    client network's rounds in flight (`network_slots`: a fair share of the generate slots, so a
    network with many sessions cannot hold them all), and one round from the network's and identity's per-minute budgets — or
    raises `UserError` (code "server_busy", "rounds_in_flight" or "rate_limit_exceeded", with
    `retry_after`) having taken nothing; `end_round(caller)` gives the places back. Ratings:
    `take_ratings(caller, n)` counts n against the network, the identity and the global budget
    (every caller of every door), all or nothing, and `give_back_ratings` undoes it when the store
    did not take them; the global budget is shared fairly
    (`FairBudget`: a network takes at most global / (active networks + 1) of it, so networks at
    their own limit cannot use it all up and a newcomer finds room). Identities are `Caller.key` (a server-issued session, a login, an API
    key id), never a value the client picks. Thread-safe; in memory (a restart forgets counts)."""

    def __init__(self, web: Quota, api: Quota | None = None, rounds_per_minute_per_network: int = 0,
                 ratings_per_minute_per_network: int = 0, ratings_per_minute: int = 0,
                 rounds_in_flight_per_network: int = 0, generate_slots: int = 0):
        self._lock = threading.Condition()
        self.quotas: dict[str, Quota] = {}
        self._rounds: dict[str, RateLimiter] = {}
        self._ratings: dict[str, RateLimiter] = {}
        self._slots: dict[str, SessionSlots] = {}
        self._running: collections.Counter = collections.Counter()   # door -> rounds generating
        for door, quota in ((WEB, web), (API, api or Quota(scope="API key"))):
            self.set_quota(door, quota)
        self._net_rounds = RateLimiter(rounds_per_minute_per_network)
        self._net_ratings = RateLimiter(ratings_per_minute_per_network)
        self._all_ratings = FairBudget(ratings_per_minute)
        self._net_slots = SessionSlots(0)   # counts only: the cap is `network_slots`
        self.rounds_in_flight_per_network, self.generate_slots = rounds_in_flight_per_network, generate_slots

    def set_quota(self, door: str, quota: Quota) -> None:
        """Set a door's quota (at start-up: /v1's comes from its own config); counts start afresh."""
        with self._lock:
            self.quotas[door] = quota
            self._rounds[door] = RateLimiter(quota.rounds_per_minute)
            self._ratings[door] = RateLimiter(quota.ratings_per_minute)
            self._slots[door] = SessionSlots(quota.rounds_in_flight)

    def begin_round(self, caller: Caller) -> None:
        door, q = caller.door, self.quotas[caller.door]
        with self._lock:
            if q.rounds_at_once and self._running[door] >= q.rounds_at_once:
                raise UserError(f"the server is running as many rounds as it takes at once ({q.rounds_at_once}); "
                                "try again shortly", "server_busy", 5)
            slots = self._slots[door]
            if not slots.acquire(caller.key):
                raise UserError(f"you already have a round generating: wait for your round to finish (at most "
                                f"{q.rounds_in_flight} at once per {q.scope})", "rounds_in_flight", 5)
            net = f"net:{caller.network}" if caller.network else None
            cap = self.network_slots(net) if net else 0
            if net and cap and self._net_slots.held(net) >= cap:
                slots.release(caller.key)
                raise UserError(f"your network already has {cap} rounds generating, its share of the server while "
                                f"{self._net_slots.active()} networks generate: try again when one of them ends",
                                "rounds_in_flight", 5)
            if net:
                self._net_slots.acquire(net)
            try:
                self._take(caller, "rounds", 1, self._net_rounds, self._rounds[door], None)
            except UserError:
                slots.release(caller.key)
                if net:
                    self._net_slots.release(net)
                raise
            self._running[door] += 1

    def network_slots(self, net: str) -> int:
        """Rounds the network `net` ("net:<network>") may have generating now (0 = no limit): at
        most `rounds_in_flight_per_network`, and, with `generate_slots` (the generate events that
        run at once), a fair share of them: max(1, slots // (networks generating now + 1)), that
        network counted. So a network alone may use several slots (a classroom behind one NAT),
        and as other networks arrive each one's share shrinks, leaving room for the next; with
        one network pressing beside three others it holds one round, not two.
        `rounds_in_flight_per_network` 0 turns both off. Caller holds the lock."""
        cap = self.rounds_in_flight_per_network
        if cap and self.generate_slots:
            active = self._net_slots.active() + (self._net_slots.held(net) == 0)
            cap = min(cap, max(1, self.generate_slots // (active + 1)))
        return cap

    def network_cap(self, network: str) -> int:
        """`network_slots` of a client network by its name (the middleware's cap on the network's
        generate events queued or running: identity.IdentityMiddleware's `group_caps`)."""
        with self._lock:
            return self.network_slots(f"net:{network}")

    def end_round(self, caller: Caller) -> None:
        with self._lock:
            self._running[caller.door] -= 1
            self._slots[caller.door].release(caller.key)
            if caller.network:
                self._net_slots.release(f"net:{caller.network}")
            self._lock.notify_all()

    def take_ratings(self, caller: Caller, n: int) -> None:
        self._take(caller, "ratings", n, self._net_ratings, self._ratings[caller.door], self._all_ratings)

    def give_back_ratings(self, caller: Caller, n: int) -> None:
        """Undo `take_ratings(caller, n)`: the ratings were counted but never stored (the store
        was busy or failed), so the caller's budget is as it was before the attempt."""
        if caller.network:
            self._net_ratings.give_back(f"net:{caller.network}", n)
        self._ratings[caller.door].give_back(caller.key, n)
        self._all_ratings.give_back(f"net:{caller.network}" if caller.network else caller.key, n)

    def _take(self, caller: Caller, what: str, n: int, net: RateLimiter, own: RateLimiter,
              everyone: RateLimiter | None) -> None:
        """Count `n` against the caller's network (when known), its identity, and everyone; on a
        refusal the counts already taken are given back."""
        checks = [(net, f"net:{caller.network}" if caller.network else None, "client network"),
                  (own, caller.key, self.quotas[caller.door].scope)]
        if everyone is not None:   # fair between networks: an identity without one is its own unit
            checks.append((everyone, f"net:{caller.network}" if caller.network else caller.key,
                           "server (every visitor together; one network at most a fair share of it)"))
        taken = []
        for lim, key, scope in checks:
            most = lim.limit
            if key is None:
                continue
            wait = lim.take(key, n)
            if wait is None:
                taken.append((lim, key))
                continue
            for l, k in taken:
                l.give_back(k, n)
            if math.isinf(wait):
                raise UserError(f"too many {what}: this request counts {n} and at most {most} per minute per {scope} "
                                "are allowed, so it can never fit; ask the server's admin for a higher limit",
                                "rate_limit_exceeded", None)
            secs = max(1, math.ceil(wait))
            if isinstance(lim, FairBudget):
                raise UserError(f"too many {what}: every visitor together may store {most} per minute, shared fairly "
                                f"between the networks rating now (yours may use {lim.share(key)} of them); try "
                                f"again in {secs} s", "rate_limit_exceeded", secs)
            raise UserError(f"too many {what}: at most {most} per minute per {scope}; try again in {secs} s",
                            "rate_limit_exceeded", secs)

    def running(self, door: str) -> int:
        """Rounds of `door` generating now."""
        with self._lock:
            return self._running[door]

    def held(self, caller: Caller) -> int:
        """Rounds the caller has generating now."""
        return self._slots[caller.door].held(caller.key)

    def wait_idle(self, door: str, timeout: float | None = None) -> bool:
        """Wait until no round of `door` runs (shutdown, tests); False if `timeout` s passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._running[door] == 0, timeout)


class RateLimiter:
    """At most `limit` events per `window_s` seconds per key, over a sliding window; `limit`
    0 = no limit. Thread-safe. In memory: a restart forgets it."""

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

    def give_back(self, key: str, n: int = 1) -> None:
        """Forget the last `n` events of `key` (a request refused by a later limit counts nothing)."""
        with self._lock:
            q = self._events.get(key)
            for _ in range(min(n, len(q or ()))):
                q.pop()


class FairBudget(RateLimiter):
    """A budget of `limit` events per `window_s` seconds over every key together, shared fairly:
    one key (a client network) may hold at most limit / (active keys + 1) of the window, where
    the active keys are those with events in the window, itself included. So k networks rating
    as fast as they may settle, within one window, at limit / (k + 1) each, and leave that much
    to a newcomer (their share shrinks as it arrives); without it three networks at 240 a minute
    fill a global 600. `limit` 0 = no limit. RateLimiter's `give_back`. Thread-safe, in memory."""

    def __init__(self, limit: int, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(limit, window_s)
        self.clock = clock

    def share(self, key: str) -> int:
        """The most `key` may hold in the window now (at least 1)."""
        with self._lock:
            self._expire(self.clock())
            active = len(self._events) + (key not in self._events)
        return max(1, self.limit // (active + 1))

    def _expire(self, now: float) -> None:
        for k in list(self._events):
            q = self._events[k]
            while q and q[0] <= now - self.window_s:
                q.popleft()
            if not q:
                del self._events[k]

    def take(self, key: str, n: int = 1) -> float | None:
        """Record `n` events for `key` and return None, or (nothing recorded) the seconds until
        they may fit: inf when n is over the whole limit."""
        if not self.limit:
            return None
        now = self.clock()
        with self._lock:
            self._expire(now)
            if n > self.limit:
                return math.inf
            everyone = sorted(t for q in self._events.values() for t in q)
            own = self._events.get(key, collections.deque())
            active = len(self._events) + (key not in self._events)
            share = max(1, self.limit // (active + 1))
            if len(everyone) + n > self.limit:
                return everyone[len(everyone) + n - self.limit - 1] + self.window_s - now
            if len(own) + n > share:   # its oldest events must leave the window (n over its share: others go idle)
                return own[len(own) + n - share - 1] + self.window_s - now if n <= share else self.window_s
            self._events.setdefault(key, collections.deque()).extend([now] * n)
            return None
