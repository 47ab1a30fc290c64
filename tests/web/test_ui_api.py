"""End to end through Gradio's own client: a launched app on 127.0.0.1 (random port), real engine
(transformers, embedded model), real SQLite store. Generate, rate (stars, rank, pick the best),
see the ratings counted; another client (another session) is refused; bad input gets a clear
error and the app stays up."""
from __future__ import annotations

import os

import pytest

from collab_app.commands.bench_online import predict
from helpers.launch import start_app

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no network from tests


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    demo, url, ctx = start_app(tmp_path_factory.mktemp("ui_api"))
    yield url, ctx
    demo.close()
    ctx.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(app):
    from gradio_client import Client

    return Client(app[0], verbose=False, analytics_enabled=False, download_files=False)


def test_endpoints_are_named(client):
    named = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/generate", "/rate", "/rank", "/pick_best", "/stats", "/export"} <= set(named)
    assert "rater" not in {p["parameter_name"] for p in named["/rate"]["parameters"]}   # no typed rater id


def test_generate_rate_and_count(app, client):
    from collab_app.web import handlers as H

    url, ctx = app
    task = ctx.tasks["humaneval"]
    pid = task.examples("eval")[3]["id"]
    out = predict(client, task="humaneval", problem=pid, api_name="/generate")
    assert len(out["candidates"]) == 2 and out["group_id"] >= 1
    cand = out["candidates"][0]
    assert [p["role"] for p in cand["parts"]] == ["helper", "main"]
    assert set(cand["reward"]["levels"]) == set(task.level_names)
    grp = ctx.store.group(out["group_id"])
    assert grp.example_id == pid and grp.session_id    # the client's session hash is recorded

    before = predict(client, api_name="/stats")["ratings"]
    msg = predict(client, joint_sample_id=cand["joint_sample_id"], rating=4, comment="ok", api_name="/rate")
    assert msg.startswith("rating saved: #")
    rid = int(msg.split("#")[1])
    assert predict(client, api_name="/stats")["ratings"] == before + 1
    stored = ctx.store.ratings_for(cand["joint_sample_id"])
    assert [(r.id, r.rater, r.value, r.comment) for r in stored] == [(rid, f"session:{grp.session_id}", 4, "ok")]
    assert f"**ratings** {before + 1} " in H.data_stats(ctx)   # what the Data tab shows

    # the other forms, from the same client (session); then a second client is refused
    msg = predict(client, group_id=out["group_id"], ranks=[2, 1], api_name="/rank")
    assert "best first: candidate 2 > candidate 1" in msg
    assert "candidate 1 is the best of 2" in predict(client, group_id=out["group_id"], best=1, api_name="/pick_best")
    kinds = [(r.kind, r.value, r.revision) for r in ctx.store.ratings_for(group_id=out["group_id"])]
    assert kinds == [("pick_best", 5, 2), ("pick_best", 1, 1)]   # each form replaced the session's rows


def test_other_session_cannot_rate(app, client):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, ctx = app
    out = predict(client, task="humaneval", problem=ctx.tasks["humaneval"].examples("eval")[1]["id"],
                  api_name="/generate")
    other = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    n = ctx.store.stats()["ratings"]
    for kwargs, api in ((dict(joint_sample_id=out["candidates"][0]["joint_sample_id"], rating=5), "/rate"),
                        (dict(group_id=out["group_id"], ranks=[1, 2]), "/rank"),
                        (dict(group_id=out["group_id"], best=2), "/pick_best")):
        with pytest.raises(AppError, match="another session"):
            predict(other, **kwargs, api_name=api)
    assert ctx.store.stats()["ratings"] == n


def test_writing_over_api(client):
    text = ("Researchers trained a small model to summarise news. It learned faster when two copies "
            "worked together, one writing a short summary and one a longer one, and people rated them.")
    out = predict(client, task="tldr", text=text, api_name="/generate")
    assert len(out["candidates"]) == 2 and len(out["candidates"][0]["parts"]) == 2


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(task="custom-coding", text="", tests="assert True"), "empty"),
    (dict(task="custom-coding", text="x" * 1_000_000, tests="assert True"), "limit"),
    (dict(task="custom-coding", text="def f():\x00\n", tests="assert True"), "NUL"),
    (dict(task="custom-coding", text="def f(a):\n    pass\n", tests="assert f(1) =="), "not accepted"),
    (dict(task="tldr", text=""), "empty"),
    (dict(task="humaneval", problem="HumanEval/nope"), "no example"),
    (dict(task="nope", text="hello"), "unknown writing task"),
])
def test_bad_generate_input(app, client, kwargs, fragment):
    from gradio_client.exceptions import AppError

    groups = app[1].store.stats()["groups"]
    with pytest.raises(AppError, match=fragment):
        predict(client, **kwargs, api_name="/generate")
    assert app[1].store.stats()["groups"] == groups         # nothing stored
    assert "ratings" in predict(client, api_name="/stats")   # and the app is still up


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(joint_sample_id=1, rating=9), "1 to 5"),
    (dict(joint_sample_id=1, rating=0), "1 to 5"),
    (dict(joint_sample_id=10**9, rating=3), "no joint sample"),
    (dict(joint_sample_id=1, rating=3, comment="c" * 5000), "limit"),
    (dict(joint_sample_id=1, rating=3, comment="bad\x00comment"), "NUL"),
])
def test_bad_rating(app, client, kwargs, fragment):
    from gradio_client.exceptions import AppError

    n = app[1].store.stats()["ratings"]
    with pytest.raises(AppError, match=fragment):
        predict(client, **kwargs, api_name="/rate")
    assert app[1].store.stats()["ratings"] == n


@pytest.fixture(scope="module")
def own_group(client) -> int:
    """A group this test client generated (so only the ranking itself can be wrong)."""
    return predict(client, task="tldr", text="A short note about bicycles, parking and a council vote.",
                   api_name="/generate")["group_id"]


@pytest.mark.parametrize("ranks, fragment", [
    ([1, 1], "several candidates"), ([1], "each of the 2"), ([1, 3], "ranks go from 1"), ([0, 1], "ranks go from 1"),
])
def test_bad_ranking(app, client, own_group, ranks, fragment):
    from gradio_client.exceptions import AppError

    n = app[1].store.stats()["ratings"]
    with pytest.raises(AppError, match=fragment):
        predict(client, group_id=own_group, ranks=ranks, api_name="/rank")
    with pytest.raises(AppError, match="no group"):
        predict(client, group_id=10**9, ranks=[1, 2], api_name="/rank")
    assert app[1].store.stats()["ratings"] == n


def _call_raw(url: str, body: bytes) -> tuple[int, str]:
    """Gradio's plain HTTP API (POST /gradio_api/call/<name>, then read its SSE stream), for input
    that gradio_client cannot even send."""
    import httpx

    r = httpx.post(f"{url.rstrip('/')}/gradio_api/call/generate", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    if r.status_code != 200:
        return r.status_code, r.text
    return 200, httpx.get(f"{url.rstrip('/')}/gradio_api/call/generate/{r.json()['event_id']}", timeout=120).text


def test_binary_junk_over_http(app, client):
    import json

    url, ctx = app
    groups = ctx.store.stats()["groups"]
    # a lone surrogate (valid JSON escape, invalid Unicode text): a clear message
    status, sse = _call_raw(url, json.dumps({"data": ["tldr", "", "eval", "broken \ud800 text", "", ""]}).encode())
    assert status == 200 and "event: error" in sse and "not valid Unicode" in sse
    # bytes that are not UTF-8 at all: refused by the server before any handler
    status, text = _call_raw(url, b'{"data": ["tldr", "", "eval", "\xff\xfe\x00junk", "", ""]}')
    assert status >= 400 or "event: error" in text
    assert ctx.store.stats()["groups"] == groups
    assert "ratings" in predict(client, api_name="/stats")   # still up
