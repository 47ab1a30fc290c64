"""Who a web caller is, as the server says: a signed session cookie, the
client's network, and the Gradio session hashes bound to that cookie.

Gradio takes `session_hash` from the request as the client sends it and keys its per-session
state (`gr.State`) and message stream on it, so a session hash is no identity: whoever learns one
could act as, and read, that session. Here:

- `SessionIdentity.issue()`: a server-issued session, a random id HMAC-signed under
  `COLLAB_SESSION_SECRET` (else random bytes made at start), carried by the HttpOnly cookie
  `collab_session` (`SameSite=None; Secure; Partitioned` on a Space, whose page frames the app
  cross-site; `Lax` elsewhere), ending after `MAX_AGE_S`, or `IDLE_S` without a request.
- `IdentityMiddleware` (ASGI, added by `ui.launch`), before Gradio on every request: refuses
  cross-origin browser requests (403; `/v1` stays callable from anywhere), issues sessions (at
  most `max_new_sessions_per_minute` per network), checks bodies (JSON or multipart, at most
  `MAX_BODY`), binds every Gradio session hash a request names to the cookie's session (a hash
  replayed under another session gets 403; the binding table is bounded per session, per network
  and in all, and a flood from one network only evicts its own bindings), and counts the
  requests that start an event per network, in all and per concurrency group (a network's
  Generate events over its share of the generate slots: 429 with Retry-After). The session id and network go
  into the request's ASGI state, where `ui._caller` reads them.
- `client_network`: the socket address, or behind a trusted proxy only
  (`COLLAB_TRUSTED_PROXY_HOPS`) the n-th address from the right of X-Forwarded-For; an IPv6
  client counts as its /64.

In memory, per process: a restart forgets bindings and counts (and, without
COLLAB_SESSION_SECRET, every session). Each rule and its reason: docs/ARCHITECTURE.md "Who a web
caller is".
"""
from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import threading
import time
from typing import Callable, Iterable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

COOKIE = "collab_session"
SECRET_ENV = "COLLAB_SESSION_SECRET"
PROXY_HOPS_ENV = "COLLAB_TRUSTED_PROXY_HOPS"
ORIGINS_ENV = "COLLAB_ALLOWED_ORIGINS"
"""comma-separated origins (scheme://host[:port]) that may call the app besides its own (a public
URL in front of a proxy that rewrites Host)."""
STATE_SESSION, STATE_NETWORK = "collab_session", "collab_network"
SESSION_PREFIX = "web:"
"""session ids of the web app start with it (the API's are `api:...`): they never collide."""
MAX_AGE_S = 30 * 24 * 3600
"""a session ends this long after it was issued, whatever its use."""
IDLE_S = 7 * 24 * 3600
"""a session ends after this long without a request."""
REFRESH_S = 3600
"""a token last seen longer ago than this is re-signed with the time of the request (Set-Cookie)."""
_HASH_PATHS = ("heartbeat", "stream", "deep_link")
"""Gradio routes with a session hash as the path segment after them."""
API_PREFIX = "/v1/"
"""paths of the OpenAI-compatible API (openai_api.py): callers are API keys there, never sessions."""
MAX_BODY = 4_000_000
"""largest request body taken (bytes; Gradio's own events are far smaller, uploads are at most
ui.MAX_FILE_SIZE): a larger one is 413."""
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
HF_ORIGIN = "https://huggingface.co"
"""the page that shows a Space in an iframe."""


def session_secret(environ=None) -> bytes:
    """The signing secret: $COLLAB_SESSION_SECRET (at least 32 characters; removed from the
    environment so that child processes do not inherit it), else 32 random bytes."""
    environ = os.environ if environ is None else environ
    raw = environ.pop(SECRET_ENV, "") or ""
    if raw:
        if len(raw) < 32:
            raise ValueError(f"{SECRET_ENV} must have at least 32 characters; make one with "
                             "python -c \"import secrets; print(secrets.token_urlsafe(32))\"")
        return raw.encode()
    return secrets.token_bytes(32)


def trusted_proxy_hops(environ=None) -> int:
    """Proxies in front of the app that append to X-Forwarded-For: $COLLAB_TRUSTED_PROXY_HOPS, else
    1 on a Hugging Face Space (SPACE_ID set), else 0 (X-Forwarded-For is ignored)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(PROXY_HOPS_ENV, "").strip()
    if raw:
        if not raw.isdigit():
            raise ValueError(f"{PROXY_HOPS_ENV} must be a whole number >= 0, got {raw!r}")
        return int(raw)
    return 1 if environ.get("SPACE_ID") else 0


def allowed_origins(environ=None) -> list[str]:
    """Origins besides the app's own that may call it: on a Space (SPACE_HOST, e.g.
    'owner-name.hf.space') its https origin and https://huggingface.co, which embeds it; and
    $COLLAB_ALLOWED_ORIGINS (comma-separated)."""
    environ = os.environ if environ is None else environ
    out = []
    host = (environ.get("SPACE_HOST") or "").strip()
    if host:
        out.append(f"https://{host}")
    if host or environ.get("SPACE_ID"):
        out.append(HF_ORIGIN)
    out += [o.strip() for o in (environ.get(ORIGINS_ENV) or "").split(",") if o.strip()]
    return out


def network_of(host: str | None) -> str:
    """An address as the network it stands for: IPv4 as is, IPv6 as its /64, else the text."""
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return str(host)[:100]
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def client_network(peer: str | None, forwarded_for: str | None, hops: int) -> str:
    """The client's network: `peer` (the socket address), or, with `hops` trusted proxies, the
    `hops`-th entry from the right of X-Forwarded-For (fewer entries: the leftmost)."""
    if hops > 0 and forwarded_for:
        entries = [e.strip() for e in forwarded_for.split(",") if e.strip()]
        if entries:
            return network_of(entries[-hops] if len(entries) >= hops else entries[0])
    return network_of(peer)


def media_type(content_type: str | None) -> str:
    """'type/subtype' of a Content-Type header, lower-cased, parameters dropped ('' for none)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json(mtype: str) -> bool:
    """JSON as FastAPI reads it: application/json or application/<anything>+json."""
    main, _, sub = mtype.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _default_port(scheme: str) -> int:
    return 443 if scheme in ("https", "wss") else 80


def _origin_tuple(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an Origin / URL, None for 'null' or anything unparsable."""
    try:
        u = urlsplit(origin.strip())
        host, port = u.hostname, u.port
    except ValueError:
        return None
    scheme = (u.scheme or "").lower()
    if not host or scheme not in ("http", "https"):
        return None
    return scheme, host.lower(), port or _default_port(scheme)


def _host_port(host_header: str | None) -> tuple[str, int | None] | None:
    if not host_header:
        return None
    try:
        u = urlsplit("//" + host_header.strip())
        host, port = u.hostname, u.port
    except ValueError:
        return None
    return (host.lower(), port) if host else None


class _Bindings:
    """Gradio session hash -> (session, network), bounded per session, per network and in all,
    evicting (module doc) so that one network's flood evicts only its own bindings. Not
    thread-safe by itself (SessionIdentity holds the lock)."""

    def __init__(self, max_total: int, per_network: int, per_session: int, stale_s: float,
                 clock: Callable[[], float]):
        self.max_total, self.per_network, self.per_session = max_total, per_network, per_session
        self.stale_s, self.clock = stale_s, clock
        self.owner: dict[str, tuple[str, str]] = {}
        self.lru: collections.OrderedDict[str, float] = collections.OrderedDict()   # every hash, last use
        self.by_session: dict[str, collections.OrderedDict[str, None]] = {}
        self.by_net: dict[str, collections.OrderedDict[str, None]] = {}
        self._nets_by_count: dict[int, set[str]] = {}
        self._max_count = 0

    def __len__(self) -> int:
        return len(self.owner)

    def count(self, net: str) -> int:
        return len(self.by_net.get(net, ()))

    def _move(self, net: str, old: int, new: int) -> None:
        if old:
            bucket = self._nets_by_count[old]
            bucket.discard(net)
            if not bucket:
                del self._nets_by_count[old]
        if new:
            self._nets_by_count.setdefault(new, set()).add(net)
        if new > self._max_count:
            self._max_count = new
        while self._max_count and self._max_count not in self._nets_by_count:
            self._max_count -= 1

    def touch(self, h: str) -> None:
        sid, net = self.owner[h]
        self.lru[h] = self.clock()
        self.lru.move_to_end(h)
        self.by_session[sid].move_to_end(h)
        self.by_net[net].move_to_end(h)

    def add(self, h: str, sid: str, net: str) -> None:
        self.owner[h] = (sid, net)
        self.lru[h] = self.clock()
        self.by_session.setdefault(sid, collections.OrderedDict())[h] = None
        mine = self.by_net.setdefault(net, collections.OrderedDict())
        mine[h] = None
        self._move(net, len(mine) - 1, len(mine))

    def evict(self, h: str) -> None:
        sid, net = self.owner.pop(h)
        self.lru.pop(h, None)
        for table, key in ((self.by_session, sid), (self.by_net, net)):
            d = table[key]
            d.pop(h, None)
            if not d:
                del table[key]
        n = self.count(net)
        self._move(net, n + 1, n)

    def make_room(self, sid: str, net: str) -> bool:
        """Evict what must go before `sid` of `net` binds one more hash; False: nothing may go."""
        mine = self.by_session.get(sid)
        if self.per_session and mine is not None and len(mine) >= self.per_session:
            self.evict(next(iter(mine)))
        theirs = self.by_net.get(net)
        if self.per_network and theirs is not None and len(theirs) >= self.per_network:
            self.evict(next(iter(theirs)))
        if not self.max_total or len(self.owner) < self.max_total or not self.lru:
            return True
        oldest = next(iter(self.lru))
        if self.clock() - self.lru[oldest] > self.stale_s:
            self.evict(oldest)
            return True
        own = self.count(net)
        if self._max_count > own + 1:        # a network holding more than the binder's would
            largest = next(iter(self._nets_by_count[self._max_count]))
            self.evict(next(iter(self.by_net[largest])))
            return True
        if own:
            self.evict(next(iter(self.by_net[net])))
            return True
        return False


class SessionIdentity:
    """Issues and checks signed session tokens, counts new sessions per network, binds Gradio
    session hashes to sessions, knows the app's own origins. Thread-safe."""

    def __init__(self, secret: bytes | None = None, max_new_sessions_per_minute: int = 20,
                 proxy_hops: int | None = None, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.time, max_bindings: int = 200_000, *,
                 idle_s: float = IDLE_S, refresh_s: float = REFRESH_S,
                 max_hashes_per_session: int = 32, max_bindings_per_network: int = 2_000,
                 stale_binding_s: float = 24 * 3600, origins: Iterable[str] | None = None,
                 embedded: bool | None = None):
        """`origins`: those besides the request's own Host that may call (None: `allowed_origins()`
        from the environment); `embedded`: the app is shown in a third-party iframe (None: a
        Space, SPACE_ID set), which decides the cookie's SameSite."""
        from collab_app.web.access import RateLimiter

        self._secret = secret or secrets.token_bytes(32)
        self.proxy_hops = trusted_proxy_hops() if proxy_hops is None else proxy_hops
        self.max_age_s, self.clock, self.max_bindings = max_age_s, clock, max_bindings
        self.idle_s, self.refresh_s = idle_s, refresh_s
        self.new_sessions = RateLimiter(max_new_sessions_per_minute)
        self._bound = _Bindings(max_bindings, max_bindings_per_network, max_hashes_per_session,
                                stale_binding_s, clock)
        self._lock = threading.Lock()
        self.embedded = bool(os.environ.get("SPACE_ID")) if embedded is None else embedded
        self.origins = {t for t in map(_origin_tuple, allowed_origins() if origins is None else origins) if t}

    def __repr__(self) -> str:   # never the secret
        return f"SessionIdentity(proxy_hops={self.proxy_hops}, bindings={len(self._bound)})"

    def _sig(self, payload: str) -> str:
        mac = hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def _token(self, sid: str, issued: int, seen: int) -> str:
        payload = f"s2.{sid}.{issued}.{seen}"
        return f"{payload}.{self._sig(payload)}"

    def issue(self) -> tuple[str, str]:
        """(session id, token): a fresh session and the cookie value that proves it."""
        sid = SESSION_PREFIX + secrets.token_urlsafe(18)
        now = int(self.clock())
        return sid, self._token(sid, now, now)

    def check(self, token: str | None) -> tuple[str, int, int] | None:
        """(session id, issued, last seen) of a valid token that has neither expired (`max_age_s`
        after issue) nor idled out (`idle_s` after last seen); None for anything else. Tokens
        without a last-seen time (`s1.<sid>.<issued>.<sig>`) count as last seen when issued."""
        if not token or len(token) > 200:
            return None
        parts = token.split(".")
        if len(parts) == 5 and parts[0] == "s2":
            head, times = parts[:4], parts[2:4]
        elif len(parts) == 4 and parts[0] == "s1":
            head, times = parts[:3], [parts[2], parts[2]]
        else:
            return None
        if not parts[1].startswith(SESSION_PREFIX) or not all(t.isdigit() and len(t) < 16 for t in times):
            return None
        if not hmac.compare_digest(parts[-1].encode(), self._sig(".".join(head)).encode()):
            return None
        issued, seen = int(times[0]), int(times[1])
        now = self.clock()
        if now - issued > self.max_age_s or now - seen > self.idle_s or seen < issued:
            return None
        return parts[1], issued, seen

    def verify(self, token: str | None) -> str | None:
        """The session id of a valid, unexpired token; None for anything else."""
        got = self.check(token)
        return got[0] if got else None

    def refreshed(self, token: str | None) -> str | None:
        """A re-signed token with 'last seen' now, when `token` is valid and was last seen more
        than `refresh_s` ago; else None (keep the cookie as it is)."""
        got = self.check(token)
        if got is None:
            return None
        sid, issued, seen = got
        now = int(self.clock())
        if now - seen <= self.refresh_s:
            return None
        return self._token(sid, issued, now)

    def network(self, peer: str | None, forwarded_for: str | None) -> str:
        return client_network(peer, forwarded_for, self.proxy_hops)

    def new_session(self, network: str) -> tuple[str, str] | None:
        """A fresh session for a client of `network`, or None when that network started
        `max_new_sessions_per_minute` already."""
        if self.new_sessions.take(f"net:{network}") is not None:
            return None
        return self.issue()

    def bind_status(self, session_hash: str, sid: str | None, network: str = "unknown") -> str:
        """"ok": `sid` may use Gradio session `session_hash` (the first session to use a hash
        owns it; a hash used without a session stays free: its events cannot generate or rate);
        "taken": another session owns it (or none asks for an owned one); "full": the table is
        full of other networks' bindings and none of them may go (module doc)."""
        with self._lock:
            owner = self._bound.owner.get(session_hash)
            if owner is not None:
                if owner[0] != sid:
                    return "taken"
                self._bound.touch(session_hash)
                return "ok"
            if sid is None:
                return "ok"
            if not self._bound.make_room(sid, network):
                return "full"
            self._bound.add(session_hash, sid, network)
            return "ok"

    def bind(self, session_hash: str, sid: str | None, network: str = "unknown") -> bool:
        """May `sid` (of `network`) use Gradio session `session_hash`? (`bind_status` == "ok")"""
        return self.bind_status(session_hash, sid, network) == "ok"

    def owner(self, session_hash: str) -> str | None:
        """The session a hash is bound to, None if free."""
        with self._lock:
            got = self._bound.owner.get(session_hash)
            return got[0] if got else None

    def cookie(self, token: str, secure: bool, max_age_s: float | None = None) -> str:
        """The Set-Cookie value: `Secure; SameSite=None; Partitioned` where the app is embedded in
        a third-party iframe (a Space: the strictest that still works there, module doc), else
        `SameSite=Lax` (`Secure` too over https)."""
        if self.embedded:
            attrs = "Secure; SameSite=None; Partitioned"
        else:
            attrs = "Secure; SameSite=Lax" if secure else "SameSite=Lax"
        age = int(self.max_age_s if max_age_s is None else max(0, max_age_s))
        return f"{COOKIE}={token}; Path=/; Max-Age={age}; HttpOnly; {attrs}"

    def origin_allowed(self, origin: str, host: str | None, forwarded_host: str | None = None) -> bool:
        """Is `origin` the app's own: the Host the request was sent to (or, behind a trusted proxy,
        the X-Forwarded-Host it names), same host and port, or one of `origins`?"""
        o = _origin_tuple(origin)
        if o is None:
            return False
        if o in self.origins:
            return True
        hosts = [host]
        if self.proxy_hops > 0 and forwarded_host:
            hosts.append(forwarded_host.split(",")[-1])
        for h in hosts:
            hp = _host_port(h)
            if hp is not None and hp[0] == o[1] and (hp[1] or _default_port(o[0])) == o[2]:
                return True
        return False


def _cookie_value(raw: str, name: str = COOKIE) -> str | None:
    for part in raw.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v.strip().strip('"')
    return None


def _hashes_in(scope) -> list[str]:
    from urllib.parse import parse_qs

    out = [h for h in parse_qs(scope.get("query_string", b"").decode("latin-1"),
                                   keep_blank_values=True).get("session_hash", [])]
    segs = [s for s in scope.get("path", "").split("/") if s]
    for i, s in enumerate(segs[:-1]):
        if s in _HASH_PATHS:
            out.append(segs[i + 1])
    return out


def _event_route(method: str, path: str) -> str | None:
    """"queue" for a request that puts an event in Gradio's queue (POST .../queue/join,
    .../call/<api>, .../call/v2/<api>), "run" for one that runs an event at once (POST
    .../run/<api>, .../api/<api>), None for anything else."""
    if method != "POST":
        return None
    segs = [s for s in path.split("/") if s]
    if segs[-2:] == ["queue", "join"] or (len(segs) >= 2 and segs[-2] == "call") or segs[-3:-1] == ["call", "v2"]:
        return "queue"
    if len(segs) >= 2 and segs[-2] in ("run", "api"):
        return "run"
    return None


def _gradio_events(scope):
    """Gradio's live events (event id -> Event) of the app serving `scope`, or None (not Gradio)."""
    try:
        return scope["app"].get_blocks()._queue.event_ids_to_events
    except Exception:   # noqa: BLE001 - no Gradio app (a test's) or another Gradio: fall back to the TTL
        return None


def _event_concurrency(scope, path: str, body) -> str | None:
    """The concurrency id of the Gradio function an event request starts: by the body's
    `fn_index` (POST .../queue/join) or the API name in the path (.../call[/v2]/<api>,
    .../run/<api>); None where it names none or the app is not Gradio's."""
    try:
        fns = scope["app"].get_blocks().fns
    except Exception:   # noqa: BLE001 - no Gradio app (a test's)
        return None
    segs = [s for s in path.split("/") if s]
    if segs[-2:] == ["queue", "join"]:
        idx = body.get("fn_index") if isinstance(body, dict) else None
        fn = fns.get(idx) if isinstance(idx, int) and not isinstance(idx, bool) else None
    else:
        fn = _by_api_name(fns).get(segs[-1] if segs else "")
    return getattr(fn, "concurrency_id", None) if fn is not None else None


_API_NAMES: dict[int, tuple[dict, int, dict]] = {}   # id(fns) -> (fns, len(fns), api_name -> fn); a few apps


def _by_api_name(fns: dict) -> dict:
    """api_name -> function of a Blocks' `fns`, built once per Blocks (again if its functions
    change): a /call request finds its event without scanning every function."""
    got = _API_NAMES.get(id(fns))
    if got is None or got[0] is not fns or got[1] != len(fns):
        if len(_API_NAMES) >= 8:          # apps built and dropped (tests): keep the newest few
            _API_NAMES.pop(next(iter(_API_NAMES)))
        got = _API_NAMES[id(fns)] = (fns, len(fns), {getattr(f, "api_name", None): f for f in fns.values()})
    return got[2]


class QueueGate:
    """Events started per client network (module doc, "queue"): at most `per_minute` a minute
    and `at_once` unfinished at once (0 = no limit), and of one concurrency group (a kind of event,
    e.g. "generate") at most the cap the caller of `admit` gives. Thread-safe."""

    def __init__(self, per_minute: int, at_once: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        from collab_app.web.access import RateLimiter

        self.rate, self.at_once, self.ttl_s, self.clock = RateLimiter(per_minute), at_once, ttl_s, clock
        self._open: dict[str, dict[object, list]] = {}   # network -> token -> [started, event id, group]
        self._lock = threading.Lock()

    def _prune(self, net: str, events) -> int:
        mine = self._open.get(net)
        if not mine:
            self._open.pop(net, None)
            return 0
        now = self.clock()
        for tok, (t0, eid, _) in list(mine.items()):
            if now - t0 > self.ttl_s or (eid is not None and events is not None and eid not in events):
                del mine[tok]
        if not mine:
            del self._open[net]
        return len(mine)

    def admit(self, net: str, events, group: str | None = None,
              group_cap: Callable[[], int] | None = None) -> tuple[object | None, str, float]:
        """(token, "", 0) for an event that may start (its place held until `done` or `started`);
        else (None, why, seconds to wait). `group`: the event's concurrency group; `group_cap()`:
        how many events of that group the network may have queued or running now (0 = no cap)."""
        with self._lock:
            if len(self._open) > 10_000:   # networks that never came back: forget their finished events
                for other in list(self._open):
                    self._prune(other, events)
            held = self._prune(net, events)
            if self.at_once and held >= self.at_once:
                return None, f"this network already has {self.at_once} events queued or running", 5.0
            cap = group_cap() if group is not None and group_cap is not None else 0
            if cap and sum(e[2] == group for e in self._open.get(net, {}).values()) >= cap:
                return None, (f"this network already has {cap} {group} events queued or running, its share of "
                              f"the server now"), 5.0
            wait = self.rate.take(f"net:{net}")
            if wait is not None:
                return None, f"this network started {self.rate.limit} events in the last minute", wait
            tok = object()
            self._open.setdefault(net, {})[tok] = [self.clock(), None, group]
            return tok, "", 0.0

    def started(self, net: str, tok, event_id: str, events) -> None:
        """The event of `tok` is in Gradio's queue as `event_id`: it counts until gone from there
        (`events`, Gradio's live events; None = not observable: it counts until `done`)."""
        if events is None:
            return
        with self._lock:
            entry = self._open.get(net, {}).get(tok)
            if entry is not None:
                entry[1] = event_id

    def done(self, net: str, tok) -> None:
        """Forget `tok` unless it became a queued event (`started`)."""
        with self._lock:
            mine = self._open.get(net)
            if mine is not None and tok in mine and mine[tok][1] is None:
                del mine[tok]
                if not mine:
                    del self._open[net]

    def open_count(self, net: str, events=None) -> int:
        with self._lock:
            return self._prune(net, events)


class _Refusal(Exception):
    def __init__(self, status: int, message: str, headers: list | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or []


class IdentityMiddleware:
    """ASGI middleware (module doc): cross-origin refusal, the caller's session from its signed
    cookie (a fresh one when it has none), its network, the body's checks, session-hash binding
    (403 for a hash of another session) and the per-network queue gate."""

    def __init__(self, app, identity: SessionIdentity, max_queue_joins_per_minute: int = 300,
                 max_queue_entries: int = 16, queue_entry_ttl_s: float = 900.0, max_body: int = MAX_BODY,
                 group_caps: dict[str, Callable[[str], int]] | None = None):
        """`max_queue_joins_per_minute`: events (queue joins, /call, /run) one client network may
        start per minute; `max_queue_entries`: its events queued or running at once (Gradio's
        queue holds 64 by default: a network takes at most a quarter); 0 = no limit.
        `group_caps`: {Gradio concurrency id: f(network) -> how many events of it the network may
        have queued or running now (0 = no cap)}; the app passes its rounds' fair share per
        network (access.Limits.network_cap), so a network's rounds over its share are refused
        here, before they take a place in Gradio's queue or a handler's time."""
        self.app, self.identity, self.max_body = app, identity, max_body
        self.queue = QueueGate(max_queue_joins_per_minute, max_queue_entries, queue_entry_ttl_s)
        self.group_caps = dict(group_caps or {})

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            return await self.app(scope, receive, send)
        if kind == "websocket":   # Gradio 6 serves no websocket; nothing here speaks one
            await receive()
            return await send({"type": "websocket.close", "code": 1008})
        if kind != "http":
            return None
        try:
            return await self._http(scope, receive, send)
        except _Refusal as r:
            return await _refuse(send, r.status, r.message, r.headers)

    async def _http(self, scope, receive, send):
        idn = self.identity
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            k, v = k.decode("latin-1").lower(), v.decode("latin-1")
            sep = "; " if k == "cookie" else ", "   # repeated headers join as HTTP says
            headers[k] = f"{headers[k]}{sep}{v}" if k in headers else v
        path, method = scope.get("path", ""), scope.get("method", "GET").upper()
        api = path.startswith(API_PREFIX)
        if not api:
            self._check_origin(method, headers)
        peer = (scope.get("client") or (None, None))[0]
        net = idn.network(peer, headers.get("x-forwarded-for"))
        token = _cookie_value(headers.get("cookie", ""))
        checked = idn.check(token)
        sid = checked[0] if checked else None
        proto = scope.get("scheme", "http")
        if idn.proxy_hops > 0:
            proto = headers.get("x-forwarded-proto", proto).split(",")[-1].strip()
        set_cookie = None
        if checked is not None:
            fresh_token = idn.refreshed(token)
            if fresh_token is not None:   # seen again: the idle clock restarts
                left = checked[1] + idn.max_age_s - idn.clock()
                set_cookie = idn.cookie(fresh_token, secure=proto == "https", max_age_s=left)
        # the OpenAI-compatible API (/v1) identifies callers by API key: no session issued there,
        # so API traffic never spends its network's budget of new browser sessions
        elif not api:
            fresh = idn.new_session(net)
            if fresh is not None:
                sid, new_token = fresh
                set_cookie = idn.cookie(new_token, secure=proto == "https")
        try:
            hashes = _hashes_in(scope)
            buffered, body = None, None
            if method not in _SAFE_METHODS and not api:
                buffered, more_hashes, body = await self._read_body(scope, receive, headers)
                hashes += more_hashes
            for h in hashes:
                status = idn.bind_status(h, sid, net)
                if status == "taken":
                    raise _Refusal(403, "this Gradio session belongs to another browser session: reload the page "
                                        "(a session hash alone does not identify you here)")
                if status == "full":
                    raise _Refusal(503, "the server holds as many page sessions as it can: try again later",
                                   [(b"retry-after", b"60")])
            route = None if api else _event_route(method, path)
            tok = None
            events = _gradio_events(scope) if route else None
            if route:
                group = _event_concurrency(scope, path, body) if self.group_caps else None
                cap = self.group_caps.get(group) if group is not None else None
                tok, why, wait = self.queue.admit(net, events, group, (lambda: cap(net)) if cap else None)
                if tok is None:
                    secs = max(1, round(wait))
                    raise _Refusal(429, f"too many events from your network: {why}; try again in {secs} s",
                                   [(b"retry-after", str(secs).encode())])
        except _Refusal as r:
            return await _refuse(send, r.status, r.message, r.headers, set_cookie)
        state = scope.setdefault("state", {})
        state[STATE_SESSION], state[STATE_NETWORK] = sid, net

        async def replay():
            if buffered:
                return buffered.pop(0)
            return await receive()

        answer = {"status": 0, "body": b""}

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                answer["status"] = message.get("status", 0)
                if set_cookie:
                    message = dict(message, headers=list(message.get("headers", [])) +
                                   [(b"set-cookie", set_cookie.encode("latin-1"))])
            elif route == "queue" and message["type"] == "http.response.body" and answer["status"] == 200:
                if len(answer["body"]) < 4096:
                    answer["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    try:
                        eid = json.loads(answer["body"]).get("event_id")
                    except (ValueError, AttributeError):
                        eid = None
                    if isinstance(eid, str):
                        self.queue.started(net, tok, eid, events)
            await send(message)

        try:
            return await self.app(scope, replay if buffered is not None else receive, send_wrapped)
        finally:
            if tok is not None:
                self.queue.done(net, tok)

    def _check_origin(self, method: str, headers: dict[str, str]) -> None:
        """403 for a browser's request from another site (module doc, "cross-origin")."""
        origin = headers.get("origin")
        site = headers.get("sec-fetch-site", "").strip().lower()
        navigation = method in ("GET", "HEAD") and headers.get("sec-fetch-mode", "").strip().lower() == "navigate"
        if origin is not None:
            if self.identity.origin_allowed(origin, headers.get("host"), headers.get("x-forwarded-host")):
                return
            raise _Refusal(403, f"requests from {origin[:100]} are not accepted here: open the app itself")
        if site in ("cross-site", "same-site") and not navigation:
            raise _Refusal(403, "requests from another site are not accepted here: open the app itself")

    async def _read_body(self, scope, receive, headers) -> tuple[list, list[str], object]:
        """The request's body messages, read whole (so that Gradio reads the same), the session
        hashes it names and its parsed JSON (None if not JSON); _Refusal 415 / 413 / 400 (module
        doc, "bodies")."""
        mtype = media_type(headers.get("content-type"))
        json_body, multipart = is_json(mtype), mtype == "multipart/form-data"
        if not (json_body or multipart):
            raise _Refusal(415, f"this server takes JSON or multipart/form-data bodies, not {mtype or 'none'!r}")
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > self.max_body:
            raise _Refusal(413, f"request body over {self.max_body} bytes")
        buffered, chunks, size, more = [], [], 0, True
        while more:
            msg = await receive()
            buffered.append(msg)
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _Refusal(413, f"request body over {self.max_body} bytes")
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if not body.strip():
            return buffered, [], None
        found, obj = [], None
        if json_body:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                raise _Refusal(400, "the request body is not valid JSON") from None
            values = [obj.get("session_hash")] if isinstance(obj, dict) and "session_hash" in obj else []
        else:
            values = await _multipart_values(scope, body, "session_hash")
        for v in values:
            if v is None:
                continue
            if not isinstance(v, str):
                raise _Refusal(400, "session_hash must be a string")
            found.append(v)
        return buffered, found, obj


async def _multipart_values(scope, body: bytes, name: str) -> list:
    """The text values of form field `name` in a multipart body (files named so are no text)."""
    from starlette.datastructures import Headers, UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream():
        yield body
        yield b""

    try:
        form = await MultiPartParser(Headers(scope=scope), stream(), max_files=1000, max_fields=1000).parse()
    except (MultiPartException, ValueError, KeyError) as e:
        raise _Refusal(400, f"the multipart body does not parse: {e}") from None
    try:
        return [v for v in form.getlist(name) if not isinstance(v, UploadFile)]
    finally:
        await form.close()


async def _refuse(send, status: int, message: str, extra: list | None = None, set_cookie: str | None = None) -> None:
    body = json.dumps({"error": message, "detail": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    if set_cookie:
        headers.append((b"set-cookie", set_cookie.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
