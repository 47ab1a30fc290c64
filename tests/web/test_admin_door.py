"""The admin's own door (issue 21, item 5): admin events run outside Gradio's queue
(ui.ADMIN_DOOR), so an admin can roll back while the generate queue is full.

Over the real app (Gradio, uvicorn, gradio_client) with the scripted engine of tests/helpers/scripted.py,
gated so that rounds hold their slot until released. Before the fix the roll-back was a queued
event: with the queue full it was refused ("Queue is full"), and it shared the generate
concurrency group, so it could not run before the round in front of it ended; and it waited
for the engine lock that a generating batch holds (handlers._pin now records the pin and leaves
the load to the next batch)."""
from __future__ import annotations

import os
import time

import httpx
import pytest

from collab_app.web.context import open_store, prepare_home
from helpers.launch import free_port
from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
TOKEN = "kQ7-vX2pLm9Rt4Zs8Wd1Nf6Hc3Jb5Yg0"


@pytest.fixture
def full_app(tmp_path):
    from collab_app.web.ui import launch

    home = prepare_home(str(tmp_path / "home"))
    eng = ScriptedStreamEngine(gated=True)
    ctx = make_ctx(tmp_path, eng, admin_token=TOKEN, generate_concurrency=1, max_rounds_per_minute=0,
                   max_rounds_in_flight=0)
    ctx.store, ctx.home = open_store(home), home
    agent = ctx.teams["tldr"].agents[0].name
    for v in (1, 2):
        d = tmp_path / f"{agent}-v{v}"
        d.mkdir()
        ctx.store.record_adapter_version(agent, v, str(d))
    demo = launch(ctx, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                  max_size=2)
    try:
        yield demo, ctx, eng, agent
    finally:
        eng.release(10_000)   # let every held round finish before closing
        demo.close()


def _generate(url):
    from gradio_client import Client

    c = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    return c, c.submit("tldr", "", "eval", TEXT, "", "", api_name="/generate")


def test_the_admin_rolls_back_while_the_generate_queue_is_full(full_app):
    demo, ctx, eng, agent = full_app
    url = demo.local_url.rstrip("/")
    ctx.adapter_watcher().poll_once()
    assert eng.adapter_version(agent) == 2
    jobs = [_generate(url) for _ in range(3)]          # one generating (held by the gate), two waiting
    # a submit only queues the join on the client's thread: wait until the server holds the two
    # waiting ones (Gradio counts waiting events against max_size), else the extra round below
    # could join before a late one and wait instead of being refused
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (eng.calls and len(demo._queue) == 2):
        time.sleep(0.1)
    assert eng.calls, "the first round never started"
    assert len(demo._queue) == 2, f"{len(demo._queue)} rounds waiting, not 2"
    # the queue is full now: one more round is refused by Gradio
    _, extra = _generate(url)
    with pytest.raises(Exception, match="(?i)queue is full"):
        extra.result(timeout=60)

    with httpx.Client(base_url=url, timeout=30) as admin:
        admin.get("/gradio_api/info")                   # the server-issued session cookie
        t0 = time.monotonic()
        r = admin.post("/gradio_api/run/roll_back", json={"data": [TOKEN, agent, None], "session_hash": "admin-1"})
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        said = str(r.json()["data"][0])
        assert "rolled back to adapter v1" in said and "the next round is served by the new choice" in said, said
        assert took < 10, took
        # a wrong token through the same door is still refused
        r = admin.post("/gradio_api/run/unpin_adapter", json={"data": ["wrong" * 8, agent, None],
                                                               "session_hash": "admin-1"})
        assert "admin token wrong" in r.text
    assert ctx.store.current_adapter_versions()[agent][0] == 1     # the pin is stored at once
    assert eng.adapter_version(agent) == 2             # the running round keeps its versions
    assert all(not job.done() for _, job in jobs)      # the rounds were still waiting all along
    eng.release(10_000)
    for _, job in jobs:
        assert job.result(timeout=120)["group_id"]
    assert eng.adapter_version(agent) == 1             # the next round loaded the rolled-back version
