"""Hostile callers against the identity middleware (collab_app/web/identity.py; issue 82: H1's
cross-origin and cookie part, M1, M3's queue-join part, the binding LRU of the low findings).

Each test names the finding it covers; each failed on b360529 (the attack passed, or the
parameter that bounds it did not exist). Most run the middleware around a tiny ASGI app that
records what reached it (Starlette's TestClient: no server, no Gradio); the queue and the
media-type tests also run it in front of a real Gradio app, where the attack was measured.
Client networks are told apart as behind one trusted proxy: X-Forwarded-For names each."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest
from starlette.testclient import TestClient

from collab_app.web.identity import COOKIE, IdentityMiddleware, SessionIdentity

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

QUEUE_JOIN = "/gradio_api/queue/join"


class Recorder:
    """A tiny ASGI app: answers every request with what reached it (session, network, body);
    a queue join answers a fresh event id, as Gradio's does; a websocket is accepted."""

    def __init__(self):
        self.seen: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                self.seen.append({"lifespan": msg["type"]})
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 1000})
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        state = scope.get("state", {})
        self.seen.append({"path": scope["path"], "session": state.get("collab_session"),
                          "network": state.get("collab_network"), "body": len(body)})
        out = {"event_id": uuid.uuid4().hex} if scope["path"].endswith("/queue/join") else {"ok": True}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def make(identity_kw=None, **mw_kw):
    """(TestClient, identity, recorder): the middleware, one trusted proxy hop, no cookie jar."""
    kw = dict(proxy_hops=1, max_new_sessions_per_minute=0, origins=[], embedded=False)
    kw.update(identity_kw or {})
    idn = SessionIdentity(b"k" * 32, **kw)
    rec = Recorder()
    client = TestClient(IdentityMiddleware(rec, idn, **mw_kw))
    return client, idn, rec


def call(client, method, path, net="198.51.100.1", token=None, headers=None, **kw):
    h = {"x-forwarded-for": net, **(headers or {})}
    if token:
        h["cookie"] = f"{COOKIE}={token}"
    r = client.request(method, path, headers=h, **kw)
    client.cookies.clear()   # every identity is explicit here: nothing carried between calls
    return r


def join_body(session_hash, **extra):
    return json.dumps({"data": [], "fn_index": 0, "session_hash": session_hash, **extra})


# ------------------------------------------------------------------------------ M1: no bypass

@pytest.mark.parametrize("ctype", ["Application/JSON", "APPLICATION/JSON; charset=UTF-8",
                                   "application/json;charset=utf-8", "application/vnd.gradio+json"])
def test_m1_a_json_body_in_any_spelling_is_checked(ctype):
    """M1: b360529 read the body only when Content-Type held lowercase "json" ("Application/JSON"
    got a victim's hash past it: 200)."""
    client, idn, rec = make()
    _, victim = idn.issue()
    _, attacker = idn.issue()
    assert call(client, "POST", QUEUE_JOIN, token=victim, content=join_body("vh"),
                headers={"content-type": "application/json"}).status_code == 200
    rec.seen.clear()
    r = call(client, "POST", QUEUE_JOIN, token=attacker, content=join_body("vh"), headers={"content-type": ctype})
    assert r.status_code == 403 and rec.seen == []
    r = call(client, "POST", QUEUE_JOIN, content=join_body("vh"), headers={"content-type": ctype})   # no cookie
    assert r.status_code == 403 and rec.seen == []


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx",
                                   "json", "application/json, text/plain"])
def test_m1_a_body_neither_json_nor_multipart_is_415(ctype):
    """M1: no Content-Type or another one passed unread on b360529 (Gradio's FastAPI reads a body
    without Content-Type as JSON)."""
    client, idn, rec = make()
    _, victim = idn.issue()
    call(client, "POST", QUEUE_JOIN, token=victim, content=join_body("vh"), headers={"content-type": "application/json"})
    rec.seen.clear()
    headers = {} if ctype is None else {"content-type": ctype}
    r = call(client, "POST", QUEUE_JOIN, content=join_body("vh").encode(), headers=headers)
    assert r.status_code == 415 and rec.seen == []
    # ... and without a hash in it just the same: the route never sees a body it cannot read as we do
    r = call(client, "POST", "/gradio_api/anything", content=b"x=1", headers=headers)
    assert r.status_code == 415 and rec.seen == []


def test_m1_a_body_over_the_limit_is_413_never_skipped():
    """M1: on b360529 a body over 4 MB was let through unchecked (a 4.1 MB join under a victim's
    hash: 200). Now 413, whether the size is declared (Content-Length) or streamed (chunked)."""
    client, idn, rec = make()
    _, victim = idn.issue()
    _, attacker = idn.issue()
    call(client, "POST", QUEUE_JOIN, token=victim, content=join_body("vh"), headers={"content-type": "application/json"})
    rec.seen.clear()
    big = join_body("vh", pad="x" * 4_100_000).encode()
    r = call(client, "POST", QUEUE_JOIN, token=attacker, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and rec.seen == []

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = call(client, "POST", QUEUE_JOIN, token=attacker, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and rec.seen == []
    # a body under the limit still reaches the app whole
    ok = join_body("mine", pad="x" * 3_000_000).encode()
    r = call(client, "POST", QUEUE_JOIN, token=attacker, content=ok, headers={"content-type": "application/json"})
    assert r.status_code == 200 and rec.seen[-1]["body"] == len(ok)


def test_m1_malformed_json_and_non_string_hashes_are_400():
    """M1: what the middleware cannot read is not passed on for Gradio to read otherwise."""
    client, idn, rec = make()
    for body in (b"{not json", json.dumps({"data": [], "session_hash": 12}).encode(),
                 json.dumps({"data": [], "session_hash": ["vh"]}).encode()):
        r = call(client, "POST", QUEUE_JOIN, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, body
    assert rec.seen == []


def test_m1_a_multipart_form_session_hash_is_bound():
    """M1: Gradio's /component_server takes `session_hash` from a multipart form field too (the
    JS client sends one when a component's server function gets a file); b360529 read only JSON."""
    client, idn, rec = make()
    _, victim = idn.issue()
    _, attacker = idn.issue()
    call(client, "POST", QUEUE_JOIN, token=victim, content=join_body("vh"), headers={"content-type": "application/json"})
    rec.seen.clear()
    form = {"session_hash": "vh", "component_id": "1", "fn_name": "f"}
    files = {"blob": ("a.bin", b"\x00" * 100, "application/octet-stream")}
    r = call(client, "POST", "/gradio_api/component_server/", token=attacker, data=form, files=files)
    assert r.status_code == 403 and rec.seen == []
    r = call(client, "POST", "/gradio_api/component_server/", token=victim, data=form, files=files)
    assert r.status_code == 200
    # an upload (multipart, files only, as Gradio's JS and gradio_client send it) passes whole
    r = call(client, "POST", "/gradio_api/upload", token=attacker, files={"files": ("t.txt", b"hello", "text/plain")})
    assert r.status_code == 200 and rec.seen[-1]["path"] == "/gradio_api/upload" and rec.seen[-1]["body"] > 5
    r = call(client, "POST", "/gradio_api/upload", token=attacker, content=b"--x\r\nbroken",
             headers={"content-type": "multipart/form-data"})   # no boundary: does not parse
    assert r.status_code == 400


def test_m1_non_http_scopes_are_refused():
    """M1: b360529 passed every non-http scope (a websocket) to the app unchecked. Gradio 6 uses
    no websocket; lifespan still passes (the app starts)."""
    from starlette.websockets import WebSocketDisconnect

    client, idn, rec = make()
    with pytest.raises(WebSocketDisconnect) as e:
        with client.websocket_connect("/gradio_api/queue/data?session_hash=vh") as ws:
            ws.receive_text()
    assert e.value.code == 1008
    with client:   # lifespan startup / shutdown through the middleware
        assert call(client, "GET", "/").status_code == 200
    assert [e.get("lifespan") for e in rec.seen] == ["lifespan.startup", None, "lifespan.shutdown"]


def _flood_setup(**kw):
    client, idn, rec = make(dict(max_bindings=100, **kw))
    _, victim = idn.issue()
    assert call(client, "GET", "/gradio_api/heartbeat/victim-hash", net="192.0.2.10", token=victim).status_code == 200
    return client, idn, victim


def test_low_a_flood_from_one_network_never_evicts_a_victims_binding():
    """The low finding "the binding LRU of 200k can be flooded to evict a victim's binding": on
    b360529 binding more hashes than the table held (200k; 100 here) evicted the oldest, the
    victim's, which the flooder could then take. Now one session, or one network with many
    sessions, evicts only its own bindings."""
    client, idn, victim = _flood_setup()
    _, flooder = idn.issue()
    for i in range(300):                                      # one session, one network
        assert call(client, "GET", f"/gradio_api/heartbeat/f{i}", net="203.0.113.66", token=flooder).status_code == 200
    sessions = [idn.issue()[1] for _ in range(30)]
    for i in range(300):                                      # many sessions, one network
        call(client, "GET", f"/gradio_api/heartbeat/g{i}", net="203.0.113.66", token=sessions[i % 30])
    for tok in (flooder, *sessions[:3]):
        r = call(client, "GET", "/gradio_api/queue/data?session_hash=victim-hash", net="203.0.113.66", token=tok)
        assert r.status_code == 403
    assert call(client, "GET", "/gradio_api/heartbeat/victim-hash", net="192.0.2.10", token=victim).status_code == 200
    assert idn.owner("victim-hash") is not None
    # the flooder keeps working, within its own share: its newest hashes are its own
    assert idn.owner("g299") is not None and idn.owner("f0") is None


def test_low_a_flood_from_many_networks_never_evicts_a_smaller_networks_binding():
    """... and a flood from many networks (IPv6 /64s are cheap), each holding one binding, evicts
    no network that holds no more than the flooder's: when the table is full the flooder's next
    hash is refused (503) rather than a victim's binding dropped."""
    client, idn, victim = _flood_setup()
    codes = []
    for i in range(150):
        _, tok = idn.issue()
        codes.append(call(client, "GET", f"/gradio_api/heartbeat/n{i}", net=f"2001:db8:{i:x}::1", token=tok).status_code)
    assert codes.count(200) == 99 and set(codes[99:]) == {503}
    assert call(client, "GET", "/gradio_api/heartbeat/victim-hash", net="192.0.2.10", token=victim).status_code == 200
    _, thief = idn.issue()
    assert call(client, "GET", "/gradio_api/heartbeat/victim-hash", net="2001:db8:1::1", token=thief).status_code == 403


def test_low_binding_bounds_are_per_session_and_per_network():
    idn = SessionIdentity(b"k" * 32, max_hashes_per_session=3, max_bindings_per_network=5)
    for i in range(4):
        assert idn.bind(f"a{i}", "web:a", "n1")
    assert idn.owner("a0") is None and idn.owner("a3") == "web:a"     # its own oldest went
    for i in range(3):
        assert idn.bind(f"b{i}", "web:b", "n1")                         # the network's 6th: n1's oldest goes
    assert idn.owner("a1") is None and idn.owner("b2") == "web:b"
    assert idn.bind("c0", "web:c", "n2") and idn.owner("c0") == "web:c"


# ------------------------------------------------------------------- H1: cross-origin, cookie

def test_h1_credentialed_cross_origin_requests_are_refused():
    """H1: Gradio's CORS middleware echoes any Origin with credentials on a public host, so on
    b360529 a third-party page could use each visitor's browser (and cookie, SameSite=None on a
    Space) as a rater: every request below got 200, and a cookie-less one a fresh session."""
    client, idn, rec = make()
    _, tok = idn.issue()
    evil = {"origin": "https://evil.example", "content-type": "application/json"}
    for t in (tok, None):
        r = call(client, "POST", QUEUE_JOIN, token=t, content=join_body("h"), headers=evil)
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = call(client, "GET", "/gradio_api/queue/data?session_hash=h", token=t, headers={"origin": "null"})
        assert r.status_code == 403
    # no Origin, but the browser says another site sent it (an <img>, a no-cors fetch, a form GET)
    for site in ("cross-site", "same-site"):
        r = call(client, "GET", "/gradio_api/info", token=tok, headers={"sec-fetch-site": site, "sec-fetch-mode": "no-cors"})
        assert r.status_code == 403
    r = call(client, "POST", QUEUE_JOIN, headers={"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate",
                                                 "content-type": "application/json"}, content=join_body("h"))
    assert r.status_code == 403                      # a cross-site form POST is no harmless navigation
    assert rec.seen == []
    assert idn.new_sessions._events == {}            # refused before any session was spent on them
    # what stays: the app's own origin, a same-origin fetch, a link or an iframe to the page, non-browsers
    ok = [call(client, "POST", QUEUE_JOIN, token=tok, content=join_body("h"),
               headers={"origin": "http://testserver", "content-type": "application/json", "sec-fetch-site": "same-origin"}),
          call(client, "GET", "/", headers={"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "iframe"}),
          call(client, "GET", "/", headers={"sec-fetch-site": "none", "sec-fetch-mode": "navigate"}),
          call(client, "GET", "/gradio_api/info"),
          # /v1 (callers are API keys, never cookies) stays callable from any origin, by design
          call(client, "POST", "/v1/chat/completions", content=b"{}",
               headers={"origin": "https://evil.example", "content-type": "application/json"})]
    assert [r.status_code for r in ok] == [200] * 5


def test_h1_a_space_accepts_its_own_origin_and_huggingface_co(monkeypatch):
    """On a Space the page is https://huggingface.co/spaces/owner/name, an iframe of
    https://owner-name.hf.space: requests from inside the iframe carry Origin
    https://owner-name.hf.space, whatever Host the Space's proxy hands the app."""
    monkeypatch.setenv("SPACE_ID", "owner/name")
    monkeypatch.setenv("SPACE_HOST", "owner-name.hf.space")
    idn = SessionIdentity(b"k" * 32, proxy_hops=1)
    client = TestClient(IdentityMiddleware(Recorder(), idn))
    for origin, code in (("https://owner-name.hf.space", 200), ("https://huggingface.co", 200),
                         ("https://other-space.hf.space", 403), ("http://owner-name.hf.space", 403),
                         ("https://huggingface.co.evil.example", 403)):
        r = call(client, "GET", "/gradio_api/info", headers={"origin": origin, "host": "10.0.0.5:7860"})
        assert r.status_code == code, origin
    assert idn.origin_allowed("https://public.example", "10.0.0.5:7860", "public.example")   # X-Forwarded-Host, trusted hop
    assert not SessionIdentity(b"k" * 32, proxy_hops=0).origin_allowed("https://public.example", "10.0.0.5", "public.example")
    assert SessionIdentity(b"k" * 32, origins=["https://public.example"]).origin_allowed("https://public.example", "x")


def test_h1_cookie_samesite_is_the_strictest_that_works():
    """H1, the cookie: a Space's app runs in a cross-site iframe (hf.space is a public suffix),
    where only SameSite=None is sent, so None + Secure + Partitioned there; everywhere else Lax,
    https included (b360529 sent SameSite=None to any https client)."""
    space = SessionIdentity(b"k" * 32, embedded=True).cookie("t", secure=False)
    assert "SameSite=None" in space and "Secure" in space and "Partitioned" in space and "HttpOnly" in space
    for secure in (True, False):
        c = SessionIdentity(b"k" * 32, embedded=False).cookie("t", secure=secure)
        assert "SameSite=Lax" in c and "Partitioned" not in c and ("Secure" in c) == secure
    client, idn, _ = make()
    r = call(client, "GET", "/", headers={"x-forwarded-proto": "https"})
    assert "SameSite=Lax" in r.headers["set-cookie"] and "Secure" in r.headers["set-cookie"]


# --------------------------------------------------------------------- H1: idle sessions end

def test_h1_sessions_expire_after_idleness_and_after_30_days():
    """H1 ("sessions expire after idleness as well as after 30 days"): on b360529 a token stayed
    valid 30 days from issue however long unused. Now 7 days idle end it; each request seen more
    than an hour after the last refresh re-signs it (Set-Cookie), up to 30 days from issue."""
    now = [1_000_000.0]
    idn = SessionIdentity(b"k" * 32, clock=lambda: now[0], proxy_hops=0, max_new_sessions_per_minute=0,
                          origins=[], embedded=False)
    sid, token = idn.issue()
    now[0] += 7 * 24 * 3600 + 1
    assert idn.verify(token) is None                          # idle 7 days: over

    sid, token = idn.issue()
    client = TestClient(IdentityMiddleware(Recorder(), idn))
    for _ in range(14):                                       # a visit every 2 days
        now[0] += 2 * 24 * 3600
        r = client.get("/", headers={"cookie": f"{COOKIE}={token}"})
        client.cookies.clear()
        assert r.status_code == 200
        fresh = r.headers.get("set-cookie", "")
        assert fresh.startswith(f"{COOKIE}="), "a session seen again is re-signed"
        token = fresh.split(";")[0].split("=", 1)[1]
        assert idn.verify(token) == sid
    now[0] += 3 * 24 * 3600                                   # day 31 since issue: over however used
    assert idn.verify(token) is None
    r = client.get("/", headers={"cookie": f"{COOKIE}={token}"})
    assert idn.verify(r.cookies[COOKIE]) not in (None, sid)   # a fresh session instead


def test_tokens_are_signed_and_bounded():
    idn = SessionIdentity(b"k" * 32)
    sid, token = idn.issue()
    head, sig = token.rsplit(".", 1)
    parts = head.split(".")
    forged = ".".join(parts[:3] + [str(int(parts[3]) + 10**6)]) + "." + sig   # a later 'last seen', old signature
    assert idn.verify(forged) is None
    assert idn.verify(token) == sid and idn.refreshed(token) is None          # just issued: nothing to refresh


# -------------------------------------------------------------- M3: queue joins per network

def test_m3_queue_joins_per_network_are_rate_limited_before_gradio():
    """M3: cookie-less /queue/join posts were never throttled on b360529. Now a network's events
    per minute are capped (429 with Retry-After, before the app); another network is unaffected."""
    client, idn, rec = make(max_queue_joins_per_minute=5, max_queue_entries=0)
    codes = [call(client, "POST", QUEUE_JOIN, net="203.0.113.7", content=join_body(f"h{i}"),
                  headers={"content-type": "application/json"}).status_code for i in range(8)]
    assert codes == [200] * 5 + [429] * 3
    r = call(client, "POST", "/gradio_api/call/generate", net="203.0.113.7", content=b'{"data": []}',
             headers={"content-type": "application/json"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert call(client, "POST", QUEUE_JOIN, net="203.0.113.8", content=join_body("other"),
                headers={"content-type": "application/json"}).status_code == 200
    assert len(rec.seen) == 6
    # reading (GET) is no event: never counted
    assert call(client, "GET", "/gradio_api/queue/data?session_hash=unseen", net="203.0.113.7").status_code == 200


def test_m3_defaults_leave_an_honest_page_well_under_the_caps():
    """A page's minute at the most: ~10 rounds (the server's default per session) of a generate, a
    rating and a few `.change` events each, plus the Training tab's timer (every 10 s): ~60
    events, none refused; a quarter of the queue at once is 16 events."""
    client, idn, rec = make()
    _, tok = idn.issue()
    codes = {call(client, "POST", QUEUE_JOIN, token=tok, content=join_body("page"),
                  headers={"content-type": "application/json"}).status_code for _ in range(60)}
    assert codes == {200}


@pytest.fixture(scope="module")
def gradio_app():
    """A real Gradio app (the version this venv serves) behind the middleware: one event that
    waits for a gate, so events stay queued or running until the test opens it."""
    import gradio as gr
    from starlette.middleware import Middleware

    from collab_app.web.ui import wait_until_served
    from helpers.launch import free_port

    gate = threading.Event()

    def slow(x):
        gate.wait(60)
        return x

    with gr.Blocks(analytics_enabled=False) as demo:
        box = gr.Textbox()
        gr.Button().click(slow, box, box, api_name="slow", concurrency_limit=1)
    demo.queue(max_size=64)
    idn = SessionIdentity(b"k" * 32, proxy_hops=1, max_new_sessions_per_minute=0, origins=[], embedded=False)
    mw = Middleware(IdentityMiddleware, identity=idn, max_queue_joins_per_minute=0, max_queue_entries=4)
    demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                _frontend=False, app_kwargs={"middleware": [mw]})
    url = demo.local_url.rstrip("/")
    wait_until_served(url)
    yield url, idn, gate
    gate.set()
    demo.close()


def _join(url, session_hash, net, token=None, **kw):
    headers = {"x-forwarded-for": net, "content-type": kw.pop("ctype", "application/json")}
    if token:
        headers["cookie"] = f"{COOKIE}={token}"
    body = kw.pop("body", None) or json.dumps({"data": ["x"], "fn_index": 0, "session_hash": session_hash})
    return httpx.post(url + QUEUE_JOIN, content=body, headers=headers, timeout=30)


def test_m3_one_network_cannot_fill_gradios_queue(gradio_app):
    """M3: Gradio's queue (max_size 64) counts every waiting event; on b360529 one network's
    cookie-less joins could take all of it. Now a network has at most `max_queue_entries` (4 here)
    events queued or running; another network still gets in; once they finish (gone from
    Gradio's queue) the network gets its places back."""
    url, idn, gate = gradio_app
    gate.clear()
    codes = [_join(url, f"flood{i}", "203.0.113.99").status_code for i in range(6)]
    assert codes == [200] * 4 + [429] * 2
    assert _join(url, "honest", "198.51.100.23").status_code == 200
    gate.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = _join(url, "flood-again", "203.0.113.99")
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200


def test_m1_against_real_gradio(gradio_app):
    """M1 as measured on b360529 against Gradio: a hash bound to session A, joined by session B:
    `application/json` 403, `Application/JSON` 200, no Content-Type 422 (Gradio's own), 4.1 MB 200.
    Now 403, 403, 415, 413, all before Gradio."""
    url, idn, gate = gradio_app
    gate.set()
    _, a = idn.issue()
    _, b = idn.issue()
    assert _join(url, "page-of-a", "192.0.2.50", token=a).status_code == 200
    got = [_join(url, "page-of-a", "192.0.2.51", token=b).status_code,
           _join(url, "page-of-a", "192.0.2.51", token=b, ctype="Application/JSON").status_code,
           _join(url, "page-of-a", "192.0.2.51", token=b, ctype="").status_code,
           _join(url, "page-of-a", "192.0.2.51", token=b, body=json.dumps(
               {"data": ["x"], "fn_index": 0, "session_hash": "page-of-a", "pad": "x" * 4_100_000})).status_code]
    assert got == [403, 403, 415, 413]


@pytest.fixture(scope="module")
def rounds_app():
    """A real Gradio app behind the middleware, as the app wires it: a `generate` concurrency
    group (two events share it: a button's and an API's) whose per-network cap is a real
    `Limits.network_cap` (4 rounds in flight per network, 8 generate slots), and another event."""
    import gradio as gr
    from starlette.middleware import Middleware

    from collab_app.web.access import Caller, Limits, Quota
    from collab_app.web.ui import GENERATE, wait_until_served
    from helpers.launch import free_port

    gate = threading.Event()

    def slow(x: str) -> str:
        gate.wait(60)
        return x

    with gr.Blocks(analytics_enabled=False) as demo:
        box = gr.Textbox()
        gr.Button().click(slow, box, box, api_name="gen_page", concurrency_id=GENERATE, concurrency_limit=8)
        gr.Button().click(slow, box, box, api_name="other", concurrency_limit=8)
        gr.api(slow, api_name="gen_api", concurrency_id=GENERATE, concurrency_limit=8)
    demo.queue(max_size=64)
    limits = Limits(Quota(rounds_in_flight=1), rounds_in_flight_per_network=4, generate_slots=8)
    idn = SessionIdentity(b"k" * 32, proxy_hops=1, max_new_sessions_per_minute=0, origins=[], embedded=False)
    mw = Middleware(IdentityMiddleware, identity=idn, max_queue_joins_per_minute=0, max_queue_entries=16,
                    group_caps={GENERATE: limits.network_cap})
    demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                _frontend=False, app_kwargs={"middleware": [mw]})
    url = demo.local_url.rstrip("/")
    wait_until_served(url)
    fn_index = {f.api_name: i for i, f in demo.fns.items()}
    yield url, gate, limits, fn_index, Caller
    gate.set()
    demo.close()


def test_m3_a_networks_rounds_over_its_share_are_refused_before_gradio(rounds_app):
    """M3 (the honest rounds' latency): a network's rounds over its share were refused only by
    the handler, each refusal first taking a place in Gradio's queue and the serving core's time.
    Now its generate events queued or running are capped before Gradio at its fair share of the
    generate slots (`Limits.network_cap`: alone 4; beside another network generating 8 // 3 = 2),
    by the page's event and the API's alike; its other events and other networks are not."""
    url, gate, limits, fn_index, Caller = rounds_app
    gate.clear()
    attacker, honest, third = "203.0.113.77", "198.51.100.77", "192.0.2.77"

    def join(api, net, i):
        return _join(url, f"{net}-{api}-{i}", net, body=json.dumps(
            {"data": ["x"], "fn_index": fn_index[api], "session_hash": f"{net}-{api}-{i}"})).status_code

    alone = [join("gen_page", attacker, i) for i in range(6)]
    assert alone == [200] * 4 + [429] * 2          # alone: 4 rounds queued or running
    assert [join("other", attacker, i) for i in range(3)] == [200] * 3   # not a round: not capped
    r = httpx.post(f"{url}/gradio_api/call/gen_api", json={"data": ["x"]}, headers={"x-forwarded-for": attacker},
                   timeout=30)
    assert r.status_code == 429 and "share" in r.json()["error"]   # the API's door: the same group
    # another network generating: each network's share is 8 // (2 + 1) = 2
    limits.begin_round(Caller("web:s-honest", network=honest))
    assert join("gen_page", third, 0) == 200 and join("gen_page", third, 1) == 200
    assert join("gen_page", third, 2) == 429
    gate.set()
    deadline = time.monotonic() + 30   # once its events are done, the network gets its places back
    while time.monotonic() < deadline and join("gen_page", attacker, 99) != 200:
        time.sleep(0.2)
    assert time.monotonic() < deadline
