"""The app in public (issue 12, items 1 and 4): a person's own coding problem only under strong
isolation; the Training tab polls only while it is selected and every page shares one
computation per TTL; prompts counted in tokens before the batcher; one round at a time per
session; export through a temp dir, fetched over Gradio's real file route while the store is
refused there; COLLAB_HOME 0700 and its database 0600.

Mostly the scripted streaming engine of tests/helpers/scripted.py (no model); the token check uses the
embedded model's real tokenizer; the Gradio tests launch the real app on 127.0.0.1."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from collab_app.commands.bench_online import predict
from collab_app.engines.engine_types import Sampling
from collab_app.web import core
from collab_app.web import handlers as H
from collab_app.web.context import AppContext, SharedViews, open_store, prepare_home
from helpers.launch import free_port
from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no network from tests

TOKEN = "Q7v-mR2x_Lp9sWz4Kc"
A, B = H.Caller("session-A"), H.Caller("session-B")
OWN = ('def add(a, b):\n    """Sum."""\n', "assert add(1, 2) == 3\n")
PLAIN = {"mode": "plain", "network_blocked": False, "read_only_filesystem": False, "separate_uid": False}


def drain(events):
    """Run a round to its end; returns the "done" event."""
    last = None
    for last in events:
        pass
    assert last["kind"] == "done"
    return last


# --------------------------------------------------------------------------- 1: fail closed

@pytest.mark.parametrize("iso, allowed", [
    (PLAIN, False),                                                   # today's sandbox, no namespaces
    ({**PLAIN, "strong": False, "untrusted_allowed": False, "summary": "plain: weak"}, False),
    ({**PLAIN, "strong": False, "untrusted_allowed": True, "summary": "plain (ALLOW_WEAK)"}, True),
    ({"mode": "namespaces", "network_blocked": True}, True),          # a strong mode, old keys only
    ({"mode": "userns", "strong": True, "untrusted_allowed": False}, False),   # the sandbox's word wins
])
def test_own_problem_only_where_the_sandbox_allows_it(tmp_path, iso, allowed):
    eng = ScriptedStreamEngine()
    ctx = make_ctx(tmp_path, eng, isolation=iso, public=True)   # (a loopback app trusts its person: test_own_problem_local)
    assert ctx.untrusted_allowed is allowed
    if allowed:
        H.start_coding(ctx, H.SOURCES[1], "eval", "", *OWN, "")
        assert H.own_problem_off_message(ctx) is None
        return
    with pytest.raises(H.UserError, match="off on this server.*user namespaces.*COLLAB_SANDBOX_ALLOW_WEAK=1"):
        H.start_coding(ctx, H.SOURCES[1], "eval", "", *OWN, "")
    # the handler refuses it too, not only the page: an episode made elsewhere never reaches the engine
    ep = dict(H.new_episode(), task="custom-coding", custom={"prompt": OWN[0], "tests": OWN[1], "entry_point": ""})
    ep["example"] = core._custom_coding_task(ep["custom"]).examples("eval")[0]
    with pytest.raises(H.UserError, match="COLLAB_SANDBOX_ALLOW_WEAK=1"):
        drain(H.generate(ctx, ep, A))
    assert eng.calls == [] and sum(ctx.store.stats()["groups"].values()) == 0
    H.start_coding(ctx, H.SOURCES[0], "eval", ctx.tasks["humaneval"].examples("eval")[0]["id"], "", "", "")


def test_page_shows_isolation_and_hides_own_problem(tmp_path):
    from collab_app.web.ui import build_app

    def by_id(demo, elem_id):
        return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)

    weak = make_ctx(tmp_path, ScriptedStreamEngine(), isolation={**PLAIN, "summary": "plain: no namespaces"}, public=True)
    demo = build_app(weak)
    assert "plain: no namespaces" in by_id(demo, "code-isolation").value
    assert "COLLAB_SANDBOX_ALLOW_WEAK=1" in by_id(demo, "code-own-off").value
    assert [c[1] for c in by_id(demo, "code-source").choices] == [H.SOURCES[0]]
    strong = make_ctx(tmp_path, ScriptedStreamEngine(), isolation={"mode": "namespaces", "network_blocked": True,
                                                                   "read_only_filesystem": True})
    demo = build_app(strong)
    assert "namespaces (network blocked, read-only filesystem)" in by_id(demo, "code-isolation").value
    assert [c[1] for c in by_id(demo, "code-source").choices] == list(H.SOURCES)
    assert not by_id(demo, "code-own-off").visible


def test_own_problem_offered_again_when_the_sandbox_recovers(tmp_path, monkeypatch):
    """A weak probe is not a verdict for the life of the app: the sandbox re-probes it, and each
    new page (and each request) asks again."""
    import tasks.sandbox as sandbox

    now = {"iso": {**PLAIN, "strong": False, "untrusted_allowed": False, "summary": "plain: probe failed"}}
    monkeypatch.setattr(sandbox, "isolation", lambda: now["iso"])
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(), public=True)   # isolation=None: asked live
    refresh, _ = _built_code_tab(ctx)
    assert not ctx.untrusted_allowed
    assert list(refresh()[2]["choices"]) == [H.SOURCES[0]]
    now["iso"] = {"mode": "namespaces", "strong": True, "untrusted_allowed": True, "summary": "namespaces: strong"}
    text, off, source = refresh()
    assert ctx.untrusted_allowed and "namespaces: strong" in text and off["visible"] is False
    assert list(source["choices"]) == list(H.SOURCES)
    H.start_coding(ctx, H.SOURCES[1], "eval", "", *OWN, "")


def _built_code_tab(ctx):
    import gradio as gr
    from collab_app.web import ui

    with gr.Blocks():
        return ui._code_tab(ctx)


# --------------------------------------------------------------------------- 4: training tab

class CountingStore:
    """The real store; counts the calls of each method (and which threads read groups)."""

    def __init__(self, store):
        self._store, self.calls, self._lock = store, {}, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*a, **k):
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)
        return counted


def rated_ctx(tmp_path):
    """Two rated TL;DR rounds and two train steps in a scripted-engine context."""
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(), admin_token=TOKEN, max_rounds_per_minute=0)
    for caller in (A, B):
        ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), caller)["episode"]
        H.rate_candidates(ctx, ep, ["5", "2"], caller)
    for step, ret in ((1, 1.0), (2, 1.5)):
        ctx.store.record_train_step(step, {"return_mean": ret, "zero_variance_frac": 0.5, "groups": 2}, [])
    return ctx


def test_training_view_is_computed_once_per_ttl_for_every_page(tmp_path, monkeypatch):
    ctx = rated_ctx(tmp_path)
    now = [0.0]
    ctx.shared_views = SharedViews(ttl_s=10, clock=lambda: now[0])
    ctx.store = store = CountingStore(ctx.store)
    builds = []
    real = H.training_figures

    def figures(c):
        builds.append(threading.current_thread().name)
        return real(c)
    monkeypatch.setattr(H, "training_figures", figures)
    rendered = []

    def render(fig):
        rendered.append(fig)
        return f"png of {fig.axes[0].get_title()}"

    pages, start = 8, threading.Barrier(8)
    got = [None] * pages

    def page(i):
        start.wait()                          # eight pages poll at the same moment
        got[i] = H.training_view(ctx, render)
    threads = [threading.Thread(target=page, args=(i,)) for i in range(pages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(builds) == 1 and len(rendered) == 2        # one set of figures, encoded once
    assert all(g is got[0] for g in got) and got[0][1] == "png of return"
    assert "**trainer**" in got[0][0] and store.calls["train_steps"] == 2   # status (last=1) + figures
    now[0] = 9.0
    H.training_view(ctx, render)
    assert len(builds) == 1 and store.calls["train_steps"] == 2   # still fresh
    now[0] = 10.5
    H.training_view(ctx, render)
    assert len(builds) == 2 and store.calls["train_steps"] == 4   # one recompute after the TTL
    H.set_training_paused(ctx, TOKEN, True)                       # an admin's change shows at once
    assert "pause requested" in H.training_view(ctx, render)[0] and len(builds) == 3


def test_training_view_reads_no_token_ids(tmp_path):
    ctx = rated_ctx(tmp_path)
    pairs = sorted(H.human_vs_auto(ctx))
    assert len(pairs) == 4 and {round(h, 3) for _, h in pairs} == {3.0, 0.75}   # ratings 5 and 2 of max 3.0
    ctx.store = store = CountingStore(ctx.store)
    assert sorted(H.human_vs_auto(ctx)) == pairs
    H.training_view(ctx)
    assert not {"recent_groups", "iter_groups", "group", "ready_groups"} & set(store.calls)


# --------------------------------------------------------------------------- 4: prompt tokens

@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_long_prompt_refused_in_the_handler_while_another_round_runs(tmp_path, tokenizer):
    eng = ScriptedStreamEngine(gated=True)
    eng.tokenizer, eng.max_model_len = tokenizer, 2048   # the real tokenizer, a real engine's default length
    ctx = make_ctx(tmp_path, eng)
    a = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A, tick_s=0.05)
    eng.release()
    first = next(a)                                       # A's round is in the engine
    assert first["kind"] == "progress"
    long_text = (TEXT + " ") * (20_000 // (len(TEXT) + 1))
    assert len(long_text) <= ctx.max_prompt_chars        # passes the character limit ...
    ep = H.start_writing(ctx, "tldr", long_text)
    with pytest.raises(H.UserError, match=r"too long for this engine: the prompt for `\w+` is [\d,]+ tokens, "
                                          r"and it takes at most 2,032 \(2,048 in all, minus 16 for the answer\); "
                                          r"shorten your text"):
        next(H.generate(ctx, ep, B))                       # ... not the token limit
    assert ctx.limits.held(B) == 0
    eng.release(1000)
    done = drain(a)                                        # A's round is untouched
    assert len(done["episode"]["candidates"]) == 2 and done["episode"]["group_id"]
    assert eng.calls == [2]                                # the engine only ever saw A's two prompts
    # a prompt that fits goes through
    assert drain(H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), B))["episode"]["group_id"]


# --------------------------------------------------------------------------- 4: one round per session

def test_one_round_at_a_time_per_session(tmp_path):
    eng = ScriptedStreamEngine(gated=True)
    ctx = make_ctx(tmp_path, eng, max_rounds_per_minute=0)
    a = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A, tick_s=0.05)
    assert next(a)["kind"] == "progress"
    with pytest.raises(H.UserError, match="you already have a round generating: wait for your round to finish"):
        next(H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A))
    b = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), B, tick_s=0.05)
    assert next(b)["kind"] == "progress"                   # another session has its own slot
    eng.release(1000)
    drain(a), drain(b)
    assert ctx.limits.held(A) == 0
    a2 = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A, tick_s=0.05)   # A's round ended: A may again
    assert next(a2)["kind"] == "progress"
    a2.close()                                             # a closed page frees the slot too
    assert ctx.limits.held(A) == 0
    drain(H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A))
    two = make_ctx(tmp_path / "two", ScriptedStreamEngine(gated=True), max_rounds_in_flight=2)
    rounds = [H.generate(two, H.start_writing(two, "tldr", TEXT), A, tick_s=0.05) for _ in range(3)]
    next(rounds[0]), next(rounds[1])
    with pytest.raises(H.UserError, match="at most 2 at once per session"):
        next(rounds[2])
    with pytest.raises(ValueError, match="max_rounds_in_flight must be a whole number >= 0"):
        AppContext(engine=None, store=None, tasks={}, teams={}, max_rounds_in_flight=-1)
    two.engine.release(1000)
    for r in rounds[:2]:
        r.close()


# --------------------------------------------------------------------------- 4: export, file route

@pytest.fixture
def app(tmp_path):
    from collab_app.web.ui import launch

    home = prepare_home(str(tmp_path / "home"))
    eng = ScriptedStreamEngine()
    ctx = make_ctx(tmp_path, eng, admin_token=TOKEN)
    ctx.store, ctx.home = open_store(home), home           # the store as build_context opens it
    ctx.training_refresh_s = 0.5                           # the browser test sees ticks quickly
    ctx.shared_views = SharedViews(ttl_s=600)              # ... and one computation for all of them
    for team in ctx.teams.values():
        for a in team.agents:
            eng.register_agent(a.name)
    H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)
    demo = launch(ctx, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo.local_url.rstrip("/"), ctx
    demo.close()


def test_export_over_gradios_file_route_and_the_store_is_refused(app, monkeypatch):
    import httpx
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, ctx = app
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*a, **k):
        d = real_mkdtemp(*a, **k)
        if k.get("prefix") == "collab-export-":
            made.append(d)
        return d
    monkeypatch.setattr(H.tempfile, "mkdtemp", mkdtemp)
    client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    with pytest.raises(AppError, match="admin token wrong"):
        predict(client, "not-the-token", ["jsonl"], api_name="/export")
    out = predict(client, TOKEN, ["jsonl"], api_name="/export")
    files = {os.path.basename(f["path"]): f for f in out}
    assert set(files) == {"joint_samples.jsonl", "arena_votes.jsonl", "meta.json"}
    r = httpx.get(files["joint_samples.jsonl"]["url"], timeout=60)   # the URL Gradio gives: its file route
    assert r.status_code == 200
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert len(rows) == 2 and {row["session_id"] for row in rows} == {"session-A"} and rows[0]["task"] == "tldr"
    assert len(made) == 1 and not os.path.exists(made[0])           # the temp dir is gone ...
    assert not os.path.realpath(made[0]).startswith(ctx.home)       # ... and was never in COLLAB_HOME
    assert not os.path.exists(os.path.join(ctx.home, "exports"))
    db = os.path.join(ctx.home, "collab.db")
    assert os.path.exists(db)
    for path in (db, os.path.join(made[0], "export", "meta.json"), "/etc/passwd"):
        r = httpx.get(f"{url}/gradio_api/file={path}", timeout=60)
        assert r.status_code in (403, 404), (path, r.status_code)


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing: `make browser-deps`")
def test_training_tab_polls_only_while_selected(app, monkeypatch):
    """Two real pages (headless Chromium). Closed Training tab: no refresh at all. Both open:
    each ticks every 0.5 s, and all their ticks share one computation (TTL 600 s here). Another
    tab selected: the ticks stop. Waits are for events (counts reached, the server's "timer
    off" handled, no view for 4 intervals); only the "nothing more happens" checks wait a fixed 6
    timer intervals."""
    import time

    sync_api = pytest.importorskip("playwright.sync_api")
    from collab_app.web import ui

    url, ctx = app
    views, builds, switches = [], [], []
    real_view, real_figures, real_timer = H.training_view, H.training_figures, ui._timer
    monkeypatch.setattr(H, "training_view", lambda c, render=None: (views.append(1), real_view(c, render))[1])
    monkeypatch.setattr(H, "training_figures", lambda c: (builds.append(1), real_figures(c))[1])
    monkeypatch.setattr(ui, "_timer", lambda active: (switches.append(active), real_timer(active))[1])

    def until(pred, what, timeout=120):
        end = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < end, f"timed out waiting for {what} (switches {switches}, {len(views)} views)"
            time.sleep(0.05)

    quiet = 6 * ctx.training_refresh_s
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        pages = [browser.new_page() for _ in range(2)]
        for pg in pages:
            pg.goto(url)
            pg.wait_for_selector("#code-generate", timeout=60_000)
        time.sleep(quiet)
        assert views == []                                 # pages open on Co-code: no training query
        for pg in pages:
            pg.get_by_role("tab", name="Training").click()
        until(lambda: len(views) >= 10, "ticks of both open Training tabs")
        assert switches.count(True) == 2 and builds == [1]  # many ticks, one computation
        off = switches.count(False)                        # Gradio also selects the first tab on load
        for pg in pages:
            pg.get_by_role("tab", name="Co-code").click()
        until(lambda: switches.count(False) == off + 2, "both timers switched off")
        # a tick the page fired before it applied "timer off", or one waiting in Gradio's queue,
        # may still land, later on a loaded machine: wait until no view came for 4 intervals
        # (ticks that go on every 0.5 s never get there), then nothing more for 6
        n, since, end = len(views), time.monotonic(), time.monotonic() + 60
        while time.monotonic() - since < 4 * ctx.training_refresh_s:
            assert time.monotonic() < end, f"the ticks never stopped ({len(views)} views)"
            time.sleep(0.05)
            if len(views) != n:
                n, since = len(views), time.monotonic()
        time.sleep(quiet)
        assert len(views) == n                             # no more ticks
        browser.close()


# --------------------------------------------------------------------------- 7: private home

def test_fresh_home_and_its_database_are_private(tmp_path):
    old = os.umask(0o022)                                  # a usual umask: the modes come from the app
    try:
        home = str(tmp_path / "home")
        store = open_store(home)
        store.set_state("probe", {"x": 1})                 # a write: SQLite makes its -wal / -shm now
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)   # noqa: E731
        assert mode(home) == 0o700
        files = [f for f in os.listdir(home) if f.startswith("collab.db")]
        assert "collab.db" in files and all(mode(os.path.join(home, f)) == 0o600 for f in files), files
        store.close()
        # an older home (0755) with a 0644 database is made private when the app opens it
        os.chmod(home, 0o755)
        os.chmod(os.path.join(home, "collab.db"), 0o644)
        open_store(home).close()
        assert mode(home) == 0o700 and mode(os.path.join(home, "collab.db")) == 0o600
    finally:
        os.umask(old)


def test_serve_runs_with_a_private_umask(tmp_path, model_path):
    """`collab serve` sets umask 077 before it builds anything (the trainer child inherits it):
    here build_context is replaced by one that writes a file and stops."""
    script = (
        "import os, sys\n"
        "import collab_app.web.context as C\n"
        "def stop(**kw):\n"
        "    open(os.path.join(sys.argv[1], 'made-by-serve'), 'w').close()\n"
        "    raise SystemExit(0)\n"
        "C.build_context = stop\n"
        "from collab_app.web.serve import ServeConfig, serve\n"
        "serve(ServeConfig(trainer='off', model=sys.argv[2], db='sqlite:///' + sys.argv[1] + '/c.db'))\n")
    env = {**os.environ, "COLLAB_HOME": str(tmp_path)}
    env.pop("COLLAB_ADMIN_TOKEN", None)
    old = os.umask(0o022)
    try:
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path), model_path], env=env, capture_output=True,
                           text=True, timeout=300)
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-2000:]
    assert stat.S_IMODE(os.stat(tmp_path / "made-by-serve").st_mode) == 0o600
