"""Who a web caller is, as the server says: a signed session cookie, the
client's network, and the Gradio session hashes bound to that cookie.

Gradio takes `session_hash` from the request as the client sends it (each gradio_client picks
its own; a page's is in every request it makes), and keys its per-session state (`gr.State`)
and message stream (`/queue/data?session_hash=...`) on it. So a session hash is no identity:
whoever learns one could act as, and read, that session. Here:

- `SessionIdentity.issue()` makes a server-issued session: a random id and an HMAC-SHA256 of it
  under a secret (`COLLAB_SESSION_SECRET`, read once by `collab serve` and dropped from the
  environment, else 32 random bytes made at start: sessions then end with a restart). The
  token travels as the HttpOnly cookie `collab_session` (JavaScript on the page cannot read it;
  `Secure; SameSite=None; Partitioned` on a Space, whose page is an iframe on huggingface.co,
  else `SameSite=Lax`). Nothing a visitor can read holds the secret.
- `IdentityMiddleware` (ASGI, added by `ui.launch`) runs before Gradio on every HTTP request:
  a valid cookie names the session; a request without one gets a fresh session (Set-Cookie on
  its response), at most `max_new_sessions_per_minute` per client network; beyond, none (its
  events then may not generate or rate: handlers refuse callers without a session). Every
  Gradio session hash the request names (query `session_hash`, the `/heartbeat/<hash>`-style
  path segments, a JSON body's `session_hash`) is bound to the cookie's session on first use;
  a later request naming that hash under another session, or under none, gets 403 before
  Gradio sees it: a replayed hash reaches neither that page's `gr.State` nor its stream.
  The session id and network go into the request's ASGI state, where `ui._caller` reads them.
- The client network (`client_network`): the socket address uvicorn reports, or, behind a
  trusted proxy only (`COLLAB_TRUSTED_PROXY_HOPS=n`, default 1 where `SPACE_ID` is set, else 0),
  the n-th address from the right of X-Forwarded-For (each trusted proxy appends one; what a
  client wrote in front of them is ignored). An IPv6 client counts as its /64.

In memory, per process: a restart forgets bindings and counts (and, without
COLLAB_SESSION_SECRET, every session).
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
from typing import Callable

log = logging.getLogger(__name__)

COOKIE = "collab_session"
SECRET_ENV = "COLLAB_SESSION_SECRET"
PROXY_HOPS_ENV = "COLLAB_TRUSTED_PROXY_HOPS"
STATE_SESSION, STATE_NETWORK = "collab_session", "collab_network"
SESSION_PREFIX = "web:"
"""session ids of the web app start with it (the API's are `api:...`): they never collide."""
MAX_AGE_S = 30 * 24 * 3600
_HASH_PATHS = ("heartbeat", "stream", "deep_link")
"""Gradio routes with a session hash as the path segment after them."""
API_PREFIX = "/v1/"
"""paths of the OpenAI-compatible API (openai_api.py): callers are API keys there, never sessions."""
MAX_BODY_PEEK = 4_000_000
"""largest JSON body read for its session_hash (Gradio's own events are far smaller)."""


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


class SessionIdentity:
    """Issues and checks signed session tokens, counts new sessions per network, binds Gradio
    session hashes to sessions. Thread-safe."""

    def __init__(self, secret: bytes | None = None, max_new_sessions_per_minute: int = 20,
                 proxy_hops: int | None = None, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.time, max_bindings: int = 200_000):
        from collab_app.web.access import RateLimiter

        self._secret = secret or secrets.token_bytes(32)
        self.proxy_hops = trusted_proxy_hops() if proxy_hops is None else proxy_hops
        self.max_age_s, self.clock, self.max_bindings = max_age_s, clock, max_bindings
        self.new_sessions = RateLimiter(max_new_sessions_per_minute)
        self._bound: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:   # never the secret
        return f"SessionIdentity(proxy_hops={self.proxy_hops}, bindings={len(self._bound)})"

    def _sig(self, payload: str) -> str:
        mac = hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def issue(self) -> tuple[str, str]:
        """(session id, token): a fresh session and the cookie value that proves it."""
        sid = SESSION_PREFIX + secrets.token_urlsafe(18)
        payload = f"s1.{sid}.{int(self.clock())}"
        return sid, f"{payload}.{self._sig(payload)}"

    def verify(self, token: str | None) -> str | None:
        """The session id of a valid, unexpired token; None for anything else."""
        if not token or len(token) > 200:
            return None
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "s1" or not parts[1].startswith(SESSION_PREFIX) or not parts[2].isdigit():
            return None
        payload = ".".join(parts[:3])
        if not hmac.compare_digest(parts[3].encode(), self._sig(payload).encode()):
            return None
        if self.clock() - int(parts[2]) > self.max_age_s:
            return None
        return parts[1]

    def network(self, peer: str | None, forwarded_for: str | None) -> str:
        return client_network(peer, forwarded_for, self.proxy_hops)

    def new_session(self, network: str) -> tuple[str, str] | None:
        """A fresh session for a client of `network`, or None when that network started
        `max_new_sessions_per_minute` already."""
        if self.new_sessions.take(f"net:{network}") is not None:
            return None
        return self.issue()

    def bind(self, session_hash: str, sid: str | None) -> bool:
        """May `sid` use Gradio session `session_hash`? The first session to use a hash owns it;
        a hash used without a session stays free (its events cannot generate or rate)."""
        with self._lock:
            owner = self._bound.get(session_hash)
            if owner is not None:
                self._bound.move_to_end(session_hash)
                return owner == sid
            if sid is not None:
                self._bound[session_hash] = sid
                while len(self._bound) > self.max_bindings:
                    self._bound.popitem(last=False)
            return True

    def cookie(self, token: str, secure: bool) -> str:
        attrs = "Secure; SameSite=None; Partitioned" if secure else "SameSite=Lax"
        return f"{COOKIE}={token}; Path=/; Max-Age={int(self.max_age_s)}; HttpOnly; {attrs}"


def _cookie_value(raw: str, name: str = COOKIE) -> str | None:
    for part in raw.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v.strip().strip('"')
    return None


def _hashes_in(scope) -> list[str]:
    from urllib.parse import parse_qs

    out = [h for h in parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", []) if h]
    segs = [s for s in scope.get("path", "").split("/") if s]
    for i, s in enumerate(segs[:-1]):
        if s in _HASH_PATHS:
            out.append(segs[i + 1])
    return out


class IdentityMiddleware:
    """ASGI middleware (module doc): the caller's session from its signed cookie (a fresh one
    when it has none), its network, and session-hash binding; 403 for a hash of another session."""

    def __init__(self, app, identity: SessionIdentity):
        self.app, self.identity = app, identity

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        idn = self.identity
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            k, v = k.decode("latin-1").lower(), v.decode("latin-1")
            sep = "; " if k == "cookie" else ", "   # repeated headers join as HTTP says
            headers[k] = f"{headers[k]}{sep}{v}" if k in headers else v
        peer = (scope.get("client") or (None, None))[0]
        net = idn.network(peer, headers.get("x-forwarded-for"))
        sid = idn.verify(_cookie_value(headers.get("cookie", "")))
        set_cookie = None
        # the OpenAI-compatible API (/v1) identifies callers by API key: no session issued there,
        # so API traffic never spends its network's budget of new browser sessions
        if sid is None and not scope.get("path", "").startswith(API_PREFIX):
            fresh = idn.new_session(net)
            if fresh is not None:
                sid, token = fresh
                proto = scope.get("scheme", "http")
                if idn.proxy_hops > 0:
                    proto = headers.get("x-forwarded-proto", proto).split(",")[-1].strip()
                set_cookie = idn.cookie(token, secure=proto == "https" or bool(os.environ.get("SPACE_ID")))
        hashes = _hashes_in(scope)
        buffered: list | None = None
        if scope.get("method") == "POST" and "json" in headers.get("content-type", ""):
            buffered, body, more = [], b"", True
            while more:
                msg = await receive()
                buffered.append(msg)
                if msg["type"] != "http.request":
                    break
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > MAX_BODY_PEEK:
                    body = b""
                    break
            if body:
                try:
                    obj = json.loads(body)
                    if isinstance(obj, dict) and isinstance(obj.get("session_hash"), str):
                        hashes.append(obj["session_hash"])
                except (ValueError, RecursionError):
                    pass   # not ours to judge: the route answers malformed JSON itself
        for h in hashes:
            if not idn.bind(h, sid):
                return await _forbidden(send, set_cookie)
        state = scope.setdefault("state", {})
        state[STATE_SESSION], state[STATE_NETWORK] = sid, net

        async def replay():
            if buffered:
                return buffered.pop(0)
            return await receive()

        async def send_with_cookie(message):
            if set_cookie and message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) +
                               [(b"set-cookie", set_cookie.encode("latin-1"))])
            await send(message)

        return await self.app(scope, replay if buffered is not None else receive, send_with_cookie)


async def _forbidden(send, set_cookie: str | None) -> None:
    body = json.dumps({"error": "this Gradio session belongs to another browser session: reload the page "
                                "(a session hash alone does not identify you here)"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if set_cookie:
        headers.append((b"set-cookie", set_cookie.encode("latin-1")))
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})
