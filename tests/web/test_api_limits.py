"""The /v1 door's small limits (issue 21, item 6; collab_app/web/openai_api.py):

- malformed or deeply nested JSON answers 400 in OpenAI's error shape, never 500
  ("[" * 100000 used to reach json.loads' RecursionError, which the route turned into a 500);
- a streaming client that stops reading (connection open, nothing read) or that leaves frees
  its round's slot within a bounded time (`OpenAIConfig.stream_stall_s`): before, a client
  that stopped reading held the slot and the key's round in flight for as long as it kept the
  connection open, since the server's send waited for the socket to drain.

No model here: the context has no engine, and the streaming tests replace core._round (a round
after its checks and limits) with one that sends large progress events (what fills the socket
buffers of a client that does not read) and never finishes on its own. The server is uvicorn,
as under `collab serve`.
"""
from __future__ import annotations

import os
import socket
import threading
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from collab_app.web import core  # noqa: E402
from collab_app.web.context import AppContext  # noqa: E402
from collab_app.web.openai_api import OpenAIConfig, mount_openai  # noqa: E402

KEY = "kA7-xQ2m_Rt9pLz4Vn8w"          # passes context.admin_token_problem
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes. Residents said the lanes "
        "made the street safer, but shop owners worried about losing parking spaces in front.")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from collab_app.engines.team import Agent, Team
    from collab_app.online.store import Store
    from tasks import load_task

    home = tmp_path_factory.mktemp("limits")
    tasks = {"tldr": load_task("tldr")}
    teams = {n: Team([Agent(r) for r in t.roles]) for n, t in tasks.items()}
    return AppContext(engine=None, store=Store(f"sqlite:///{home / 'store.db'}"), tasks=tasks, teams=teams,
                      num_generations=2, home=str(home))


def make_client(ctx, **cfg):
    app = FastAPI()
    api = mount_openai(app, ctx, OpenAIConfig(**{"api_keys": (KEY,), "max_rounds_per_minute": 0, **cfg}))
    return app, TestClient(app, raise_server_exceptions=False), api


def check_400(r, fragment: str):
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json" and fragment in err["message"], err


# --------------------------------------------------------------------------- malformed / deep JSON

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/ratings", "/v1/feedback"])
def test_deeply_nested_json_is_a_400_not_a_500(ctx, path):
    _, client, api = make_client(ctx)
    for body in (b"[" * 100_000,                                    # unterminated: the parser recursed out
                 b"[" * 50_000 + b"]" * 50_000,                     # well-formed, as deep
                 b'{"model": "tldr", "x": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
                 b'{"a":' * 20_000 + b"1" + b"}" * 20_000):
        check_400(client.post(path, content=body, headers=AUTH), "deeper than 32 levels")
    # parsed fine by json.loads (under its recursion limit) but deeper than any request needs
    check_400(client.post(path, content=b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", headers=AUTH),
              "deeper than 32")
    assert api.running_rounds == 0


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "tldr",', "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),                               # not UTF-8
    (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),             # an int past Python's digit limit
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b"null", "JSON object"),
])
def test_malformed_json_is_a_400(ctx, body, fragment):
    _, client, _ = make_client(ctx)
    for path in ("/v1/chat/completions", "/v1/ratings"):
        check_400(client.post(path, content=body, headers=AUTH), fragment)


def test_a_request_of_normal_depth_still_passes_the_body_check(ctx, monkeypatch):
    """Content parts ({messages: [{content: [{type, text}]}]}) are 4 levels: well within the limit."""
    _, client, _ = make_client(ctx)
    def refuse(*a, **k):   # the round itself is not under test: it stops at once
        raise core.UserError("stopped by the test")
        yield

    monkeypatch.setattr(core, "play_round", refuse)
    body = {"model": "tldr", "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
            "collab": {}, "stream_options": {"include_usage": False}}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["message"] == "stopped by the test", r.text   # past the body
    with pytest.raises(ValueError, match="max_json_depth"):
        OpenAIConfig(max_json_depth=0)
    with pytest.raises(ValueError, match="stream_stall_s"):
        OpenAIConfig(stream_stall_s=0)


# --------------------------------------------------------------------------- streaming slots

def endless_round(ctx, episode, caller, *args):
    """core._round (a round once play_round has checked it and taken its limits) that keeps
    sending large progress events and never finishes by itself (until the response closes it:
    play_round's generator is closed by the route's finish(), which gives its limits back)."""
    big = "x" * 64_000
    for i in range(100_000):
        time.sleep(0.002)
        yield {"kind": "progress", "message": f"step {i}",
               "candidates": [{"state": "generating", "reward": None,
                               "parts": [{"role": "main", "agent": "main", "text": big, "done": False}]}]}


class Server:
    """The app under uvicorn in a thread (the server `collab serve` runs, via Gradio)."""

    def __init__(self, app):
        import uvicorn

        from helpers.launch import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def open_stream(port: int) -> socket.socket:
    """A raw client: small receive buffer, the streamed request sent, the headers and first bytes read."""
    import json

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tldr", "messages": [{"role": "user", "content": TEXT}], "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    sock.settimeout(20)
    got = sock.recv(2048)
    assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got, got[:300]
    return sock


def wait_rounds(api, n: int, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if api.running_rounds == n:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@pytest.mark.timeout(120)
def test_a_stalled_streaming_client_frees_its_slot(ctx, monkeypatch):
    """The client reads the first bytes, then stops reading with its connection open: the round
    ends once one chunk has waited stream_stall_s to be accepted, and the server closes the
    connection. Before, running_rounds stayed 1 for as long as the client held the connection."""
    monkeypatch.setattr(core, "_round", endless_round)
    app, _, api = make_client(ctx, stream_stall_s=2.0, max_rounds_in_flight=1)
    with Server(app) as srv:
        sock = open_stream(srv.port)
        try:
            assert wait_rounds(api, 1, 5) is not None
            took = wait_rounds(api, 0, 30)                  # buffers fill in well under a second, + 2 s stall
            assert took is not None, f"a stalled client still holds its slot: running_rounds={api.running_rounds}"
            # the key's round in flight is back too: a new stream is accepted (max_rounds_in_flight=1)
            second = open_stream(srv.port)
            second.close()
            assert wait_rounds(api, 0, 10) is not None
            # and the stalled connection was closed by the server: reading on drains it to EOF
            sock.settimeout(10)
            while sock.recv(1 << 20):
                pass
        finally:
            sock.close()


@pytest.mark.timeout(120)
def test_a_client_that_leaves_mid_stream_frees_its_slot(ctx, monkeypatch):
    """Read one chunk, close the connection: the slot is free within a few seconds."""
    monkeypatch.setattr(core, "_round", endless_round)
    app, _, api = make_client(ctx, stream_stall_s=30.0)
    with Server(app) as srv:
        sock = open_stream(srv.port)
        assert wait_rounds(api, 1, 5) is not None
        sock.close()
        took = wait_rounds(api, 0, 5)
        assert took is not None, f"running_rounds={api.running_rounds} 5 s after the client left"
