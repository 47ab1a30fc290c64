"""The app's handlers without a browser: real transformers engine on the embedded model, real
SQLite store in tmp_path, real tasks (HumanEval, a person's own problem, TL;DR), G=2 and 24 new
tokens so that a generation takes seconds."""
from __future__ import annotations

import pytest

from collab_app.web import core
from collab_app.web import handlers as H
from collab_app.web.context import AppContext, is_public, storage_warning
from helpers.model_app import MAX_NEW, TEXT, make_ctx

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")

TOKEN = "Q7v-mR2x_Lp9sWz4Kc"          # passes context.admin_token_problem
A, B = H.Caller("session-A"), H.Caller("session-B")


# --------------------------------------------------------------------------- no engine needed

@pytest.mark.parametrize("value, fragment", [
    ("", "empty"), ("   \n", "empty"), (None, "empty"), ("a\x00b", "NUL"), ("bad \ud800 text", "Unicode"),
    ("x" * 1_000_000, "limit is 20,000"), (b"bytes", "must be text"), (123, "must be text"),
])
def test_clean_text_rejects_junk(value, fragment):
    with pytest.raises(H.UserError, match=fragment):
        H.clean_text(value, "prompt", 20_000)


def test_clean_text_keeps_code_indentation():
    code = "    def f():\n        return 1\n"
    assert H.clean_text(code, "prompt", 100) == code


@pytest.mark.parametrize("value", [9, 0, -1, 4.5, "abc", None, True, float("nan"), "", [3]])
def test_parse_rating_rejects(value):
    with pytest.raises(H.UserError, match="1 to 5"):
        core.parse_rating(value)


@pytest.mark.parametrize("value, want", [(1, 1), ("5", 5), (3.0, 3), ("2", 2)])
def test_parse_rating_accepts(value, want):
    assert core.parse_rating(value) == want


def _ctx(**kw) -> AppContext:   # check_admin needs no engine, store or tasks
    return AppContext(engine=None, store=None, tasks={}, teams={}, **kw)


def test_admin_rules():
    local, remote = H.Caller("s1", host="127.0.0.1"), H.Caller("s2", host="203.0.113.7")
    for ctx, token in ((_ctx(), "anything"), (_ctx(), ""), (_ctx(public=True), "x" * 40)):
        with pytest.raises(H.UserError, match="admin actions are off.*COLLAB_ADMIN_TOKEN.*--loopback-admin"):
            H.check_admin(ctx, token, local)   # no token set: no token and no address makes anyone admin
    ctx = _ctx(admin_token=TOKEN)
    with pytest.raises(H.UserError, match="wrong"):
        H.check_admin(ctx, "guess", remote)
    with pytest.raises(H.UserError, match="missing"):
        H.check_admin(ctx, "", local)          # a set token is required from this machine too
    H.check_admin(ctx, TOKEN, remote)
    # --loopback-admin: loopback clients need no token; others still do
    ctx = _ctx(loopback_admin=True)
    H.check_admin(ctx, "", local)
    H.check_admin(ctx, "", H.Caller("s3", host="::1"))
    for caller in (remote, H.Caller("s4"), None):
        with pytest.raises(H.UserError, match="admin actions are off"):
            H.check_admin(ctx, "", caller)


@pytest.mark.parametrize("token, fragment", [
    ("short-Tok3n", "11 characters"), ("aaaaaaaaaaaaaaaaaaaa", "different characters"),
    ("MyPassword-2024-xyz", "common word 'password'"), ("xy-abcdefgh-Z91-Q7", "straight run 'abcdef'"),
    ("Q7v-987654-mR2x_Lp", "straight run '987654'"), ("zz-QWERTY-uiop-77", "straight run 'qwerty'"),
])
def test_weak_admin_tokens_are_refused_at_start(token, fragment):
    from collab_app.web.access import admin_token_problem
    assert fragment in admin_token_problem(token)
    with pytest.raises(ValueError, match=f"too weak.*{fragment}.*secrets.token_urlsafe"):
        _ctx(admin_token=token)


def test_good_admin_tokens_pass():
    """Tokens made as `secrets.token_urlsafe(32)` makes them (32 random bytes, urlsafe base64, 43
    characters), from a seeded generator: a random one fails the rule by chance (about 5 in a
    million, access.py), so 200 unseeded draws made this test fail about once in 1,000 runs (it did,
    2026-11-26)."""
    import base64
    import random

    from collab_app.web.access import admin_token_problem
    assert admin_token_problem(TOKEN) is None and admin_token_problem(None) is None
    rng = random.Random(0)
    tokens = [base64.urlsafe_b64encode(rng.randbytes(32)).rstrip(b"=").decode() for _ in range(200)]
    assert {len(t) for t in tokens} == {43}
    assert [t for t in tokens if admin_token_problem(t) is not None] == []


def test_serve_refuses_a_weak_token_before_loading_anything(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLLAB_ADMIN_TOKEN": "hunter2", "COLLAB_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "collab_app.web.serve"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "too weak" in r.stderr and "token_urlsafe(32)" in r.stderr
    assert not (tmp_path / "home").exists()         # stopped before it created anything


def test_wrong_guesses_are_slowed_per_caller():
    from collab_app.web.access import AdminGuard

    now = [0.0]
    ctx = _ctx(admin_token=TOKEN)
    ctx.admin_guard = AdminGuard(free=3, max_lock_s=60, forget_s=600, clock=lambda: now[0])
    # behind one proxy (a Space): the same host for everyone, the network from X-Forwarded-For
    guesser = H.Caller("g1", host="10.0.0.1", network="198.51.100.9")
    admin = H.Caller("a", host="10.0.0.1", network="203.0.113.7")
    for _ in range(2):
        with pytest.raises(H.UserError, match="admin token wrong: enter"):
            H.check_admin(ctx, "guess", guesser)
    with pytest.raises(H.UserError, match="further tries refused for 2 s"):
        H.check_admin(ctx, "guess", guesser)
    # locked: refused at once, the right token too; a fresh session from the same network too
    for caller, token in ((guesser, TOKEN), (H.Caller("g2", host="10.0.0.1", network="198.51.100.9"), TOKEN)):
        with pytest.raises(H.UserError, match="too many wrong admin tokens from your session or network: try "
                                              "again in 2 s"):
            H.check_admin(ctx, token, caller)
    H.check_admin(ctx, TOKEN, admin)                 # another network behind the same proxy is not affected
    # the same wrong guess from many sessions and networks locks that guess, never the right token
    for i in range(3):
        with pytest.raises(H.UserError, match="admin token wrong"):
            H.check_admin(ctx, "common-guess", H.Caller(f"s{i}", host="10.0.0.1", network=f"192.0.2.{i}"))
    with pytest.raises(H.UserError, match="too many wrong admin tokens"):
        H.check_admin(ctx, "common-guess", H.Caller("s9", host="10.0.0.1", network="192.0.2.9"))
    H.check_admin(ctx, TOKEN, H.Caller("s9", host="10.0.0.1", network="192.0.2.9"))
    now[0] += 2.5
    with pytest.raises(H.UserError, match="refused for 4 s"):   # doubling
        H.check_admin(ctx, "guess", guesser)
    now[0] += 4.5
    with pytest.raises(H.UserError, match="refused for 8 s"):
        H.check_admin(ctx, "again", guesser)
    with pytest.raises(H.UserError, match="missing"):            # an empty token is not a guess
        H.check_admin(ctx, "", admin)
    now[0] += 8.5
    H.check_admin(ctx, TOKEN, guesser)               # the right token after the wait resets the caller
    with pytest.raises(H.UserError, match="admin token wrong: enter[^;]*$"):
        H.check_admin(ctx, "a new guess", guesser)   # (a wrong token's own count is not reset)


def test_is_public(monkeypatch):
    monkeypatch.delenv("SPACE_ID", raising=False)
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    assert not is_public("127.0.0.1", False) and not is_public("localhost", False) and not is_public(None, False)
    assert is_public("0.0.0.0", False) and is_public("192.168.1.5", False) and is_public("127.0.0.1", True)
    monkeypatch.setenv("SPACE_ID", "someone/collab")
    assert is_public("127.0.0.1", False)


def test_storage_warning_on_space(monkeypatch, tmp_path):
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert storage_warning(str(tmp_path)) is None               # not a Space: nothing to say
    monkeypatch.setenv("SPACE_ID", "someone/collab")
    assert "ephemeral" in storage_warning(str(tmp_path))       # a Space, home not on /data
    on_server = storage_warning(str(tmp_path), store_on_server=True)   # COLLAB_DB: the database keeps the ratings
    assert "groups and ratings are kept" in on_server and "adapters are lost" in on_server


def test_rater_id_is_the_servers():
    assert H.Caller("abcdef0123456789").rater == "session:abcdef0123456789"
    assert H.Caller("abcdef0123456789", username="ana").rater == "hf:ana"   # a Space login wins
    assert H.Caller(None).rater is None and H.Caller(None).key == "anonymous"


# --------------------------------------------------------------------------- real engine + store

@pytest.fixture(scope="module")
def ctx(engine, tmp_path_factory):
    return make_ctx(engine, tmp_path_factory.mktemp("app") / "store.db", admin_token=TOKEN, public=True)


@pytest.fixture(scope="module")
def first_round(ctx):
    """One HumanEval round in session A, with its progress events."""
    ep = H.start_coding(ctx, H.SOURCES[0], "eval", ctx.tasks["humaneval"].examples("eval")[0]["id"], "", "", "")
    events = list(H.generate(ctx, ep, A))
    return events


def test_generate_humaneval(ctx, first_round):
    kinds = [e["kind"] for e in first_round]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and "progress" in kinds
    assert any("running tests" in e.get("message", "") for e in first_round)
    progress = [e for e in first_round if e["kind"] == "progress"]
    assert all(len(e["candidates"]) == 2 for e in progress)
    assert progress[-1]["candidates"][0]["parts"][0]["text"]      # texts reach the events
    ep = first_round[-1]["episode"]
    task = ctx.tasks["humaneval"]
    assert len(ep["candidates"]) == 2 and ep["turn"] == 1
    for i, c in enumerate(ep["candidates"]):
        assert [p["role"] for p in c["parts"]] == list(task.roles) == ["helper", "main"]
        assert all(p["adapter_version"] is None for p in c["parts"])     # base model
        assert set(c["reward"]["levels"]) == set(task.level_names)
        md = H.render_candidate(c, i, coding=True)
        assert "**helper** · agent `helper` · base model" in md and "Automatic checks" in md
    grp = ctx.store.group(ep["group_id"])
    assert grp.session_id == "session-A" and grp.task == "humaneval" and grp.num_generations == 2
    assert [j.id for j in grp.joints] == [c["joint_sample_id"] for c in ep["candidates"]]
    assert [j.auto_total for j in grp.joints] == [c["reward"]["total"] for c in ep["candidates"]]


def test_rating_flow(ctx, first_round):
    ep = first_round[-1]["episode"]
    before = ctx.store.stats()["ratings"]
    msg = H.rate_candidates(ctx, ep, ["5", None], A, "nice helper")
    assert msg.startswith("rating saved: #") and "candidate 1: 5/5" in msg and "as session:session-A" in msg
    assert ctx.store.stats()["ratings"] == before + 1
    # re-rating replaces the rater's row (issue 21); the same person logged in on a Space is another rater id
    H.rate_candidates(ctx, ep, ["2", "4"], A)
    H.rate_candidates(ctx, ep, [None, "3"], H.Caller("session-A", username="bo"))
    jid0, jid1 = (c["joint_sample_id"] for c in ep["candidates"])
    assert [(r.value, r.revision) for r in ctx.store.ratings_for(jid0)] == [(2, 1)]
    assert [(r.rater, r.value) for r in ctx.store.ratings_for(jid1)] == [("session:session-A", 4), ("hf:bo", 3)]
    n = ctx.store.stats()["ratings"]
    for values, fragment in ((["9", None], "1 to 5"), ([None, None], "at least one"), (["3", "0"], "1 to 5")):
        with pytest.raises(H.UserError, match=fragment):
            H.rate_candidates(ctx, ep, values, A)
    with pytest.raises(H.UserError, match="another session"):
        H.rate_candidates(ctx, ep, ["3", "3"], B)
    with pytest.raises(H.UserError, match="no joint sample"):
        H.rate(ctx, 10**9, 3, A)
    with pytest.raises(H.UserError, match="generate first"):
        H.rate_candidates(ctx, H.new_episode(), ["3"], A)
    assert ctx.store.stats()["ratings"] == n     # nothing stored by the bad ones (not even "3")


def test_another_round_feeds_feedback(ctx, first_round):
    ep = first_round[-1]["episode"]
    task = ctx.tasks["humaneval"]
    nxt = H.another_round(ctx, ep, 1)
    outs = ep["candidates"][1]["outputs"]
    assert nxt["history"] == [[outs, task.feedback(ep["example"], outs)]] and nxt["candidates"] == []
    done = H.run_generate(ctx, nxt, A)
    ep2 = done["episode"]
    assert ep2["turn"] == 2 and len(ep2["history"]) == 1
    grp = ctx.store.group(ep2["group_id"])
    assert grp.turn == 1                                      # 0-based turn in the store
    assert "Score" in grp.prompts[0] or "Score" in grp.prompts[1]   # the feedback reached the prompts
    with pytest.raises(H.UserError, match="does not exist"):
        H.another_round(ctx, ep, 5)


def test_custom_coding_problem(ctx):
    with pytest.raises(H.UserError, match="not accepted"):
        H.start_coding(ctx, H.SOURCES[1], "eval", "", "def add(a, b):\n    pass\n", "assert add(1, 2) ==", "")
    ep = H.start_coding(ctx, H.SOURCES[1], "eval", "", 'def add(a, b):\n    """Sum."""\n',
                        "assert add(1, 2) == 3\nassert add(0, 0) == 0\n", "")
    assert ep["task"] == "custom-coding" and ep["example"]["entry_point"] == "add"
    done = H.run_generate(ctx, ep, B)
    grp = ctx.store.group(done["episode"]["group_id"])
    assert grp.task == "custom-coding" and grp.session_id == "session-B"


@pytest.mark.parametrize("prompt, tests, fragment", [
    ("", "assert True", "empty"), ("x" * 1_000_000, "assert True", "limit"),
    ("def f():\x00", "assert True", "NUL"), ("def f(): pass", "", "empty"),
])
def test_bad_coding_input_is_refused_before_generating(ctx, prompt, tests, fragment):
    groups = ctx.store.stats()["groups"]
    with pytest.raises(H.UserError, match=fragment):
        H.start_coding(ctx, H.SOURCES[1], "eval", "", prompt, tests, "")
    assert ctx.store.stats()["groups"] == groups


def test_writing_round(ctx):
    for text, fragment in (("", "empty"), ("é" * 30_000, "limit"), ("ok\ud800", "Unicode")):
        with pytest.raises(H.UserError, match=fragment):
            H.start_writing(ctx, "tldr", text)
    with pytest.raises(H.UserError, match="unknown writing task"):
        H.start_writing(ctx, "humaneval", TEXT)
    ep = H.start_writing(ctx, "tldr", TEXT)
    ep = H.run_generate(ctx, ep, A)["episode"]
    task = ctx.tasks["tldr"]
    assert [p["role"] for p in ep["candidates"][0]["parts"]] == list(task.roles)
    assert set(ep["candidates"][0]["reward"]["levels"]) == set(task.level_names)
    md = H.render_candidate(ep["candidates"][0], 0, coding=False)
    assert f"**{task.roles[0]}**" in md and "```" not in md


def test_sessions_see_only_their_groups(ctx, first_round):
    mine = {row[0] for row in H.recent_groups_table(ctx, "session-A")}
    theirs = {row[0] for row in H.recent_groups_table(ctx, "session-B")}
    assert first_round[-1]["episode"]["group_id"] in mine and mine and theirs and not mine & theirs
    assert H.recent_groups_table(ctx, None) == []
    with pytest.raises(H.UserError, match="admin token"):
        H.recent_groups_table(ctx, "session-A", all_sessions=True, token="")
    everyone = {row[0] for row in H.recent_groups_table(ctx, "session-A", all_sessions=True, token=TOKEN)}
    assert mine | theirs <= everyone


def test_team_settings_need_admin(ctx):
    with pytest.raises(H.UserError, match="admin token"):
        H.set_role_prompt(ctx, "", "helper", "Be brief.")
    assert "saved" in H.set_role_prompt(ctx, TOKEN, "helper", "Be brief.")
    assert H.role_prompt(ctx, "helper") == "Be brief."
    assert "Be brief." in H.team_overview(ctx)
    with pytest.raises(H.UserError, match="unknown agent"):
        H.set_role_prompt(ctx, TOKEN, "nobody", "x")
    with pytest.raises(H.UserError, match="2..4"):
        H.set_generation_settings(ctx, TOKEN, 9, 0.8, 1.0, MAX_NEW)
    with pytest.raises(H.UserError, match="temperature"):
        H.set_generation_settings(ctx, TOKEN, 2, -1, 1.0, MAX_NEW)
    try:
        assert "G = 3" in H.set_generation_settings(ctx, TOKEN, 3, 0.7, 0.95, MAX_NEW)
        ep = H.start_writing(ctx, "tldr", TEXT)
        assert len(H.run_generate(ctx, ep, H.Caller("session-C"))["episode"]["candidates"]) == 3
    finally:
        H.set_generation_settings(ctx, TOKEN, 2, 0.8, 1.0, MAX_NEW)
        H.set_role_prompt(ctx, TOKEN, "helper", "")


def test_pin_and_roll_back_adapters(engine, tmp_path, lora_adapter):
    ctx = make_ctx(engine, tmp_path / "store.db", loopback_admin=True)   # serve --loopback-admin
    me = H.Caller("local", host="127.0.0.1")
    ctx.store.record_adapter_version("helper", 1, lora_adapter(1))
    ctx.store.record_adapter_version("helper", 2, lora_adapter(2))
    H.sync_adapters(ctx)
    assert engine.adapter_version("helper") == 2 and engine.adapter_version("main") is None
    with pytest.raises(H.UserError, match="admin actions are off"):
        H.roll_back(ctx, "", "helper", caller=H.Caller("remote", host="192.0.2.1"))
    assert "rolled back to adapter v1" in H.roll_back(ctx, "", "helper", caller=me)
    assert engine.adapter_version("helper") == 1
    rows = H.adapter_table(ctx, "helper")
    assert [r[0] for r in rows] == [2, 1] and rows[1][3] == "yes" and rows[1][4] == "yes"
    ep = H.start_coding(ctx, H.SOURCES[0], "eval", ctx.tasks["humaneval"].examples("eval")[0]["id"], "", "", "")
    cands = H.run_generate(ctx, ep, H.Caller("s"))["episode"]["candidates"]
    assert all(c["parts"][0]["adapter_version"] == 1 and c["parts"][1]["adapter_version"] is None for c in cands)
    assert "adapter v1" in H.render_candidate(cands[0], 0, coding=True)
    with pytest.raises(H.UserError, match="no older version"):
        H.roll_back(ctx, "", "helper", caller=me)
    with pytest.raises(H.UserError, match="no adapter version 7"):
        H.pin_adapter(ctx, "", "helper", 7, caller=me)
    assert "follows the trainer's newest" in H.unpin_adapter(ctx, "", "helper", caller=me)
    assert engine.adapter_version("helper") == 2
    assert H.pin_adapter(ctx, "", "helper", "1", caller=me).startswith("`helper` pinned to adapter v1")
    engine.load_adapter("helper", None, None)


def test_training_tab(engine, tmp_path):
    from collab_app.online.service import STATUS_KEY, is_paused

    ctx = make_ctx(engine, tmp_path / "store.db", admin_token=TOKEN)
    assert "no trainer service" in H.training_status(ctx)
    assert H.training_figures(ctx) == (None, None)
    import time
    ctx.store.set_state(STATUS_KEY, {"state": "training", "step": 3, "heartbeat": time.time(), "heartbeat_s": 5})
    ctx.store.record_train_step(1, {"return_mean": 1.0, "zero_variance_frac": 0.5, "level/tests": 0.2,
                                    "level/syntax": 0.5, "groups": 4}, [])
    ctx.store.record_train_step(2, {"return_mean": 1.5, "zero_variance_frac": 0.25, "level/tests": 0.4,
                                    "level/syntax": 0.5, "groups": 4}, [])
    status = H.training_status(ctx)
    assert "training · step 3" in status and "last step** 2" in status
    levels, signal = H.training_figures(ctx)
    assert [ax.get_title() for ax in levels.axes if ax.get_visible()] == ["return", "tests", "syntax"]
    assert list(levels.axes[0].lines[0].get_ydata()) == [1.0, 1.5]
    assert list(signal.axes[0].lines[0].get_ydata()) == [0.5, 0.25]
    with pytest.raises(H.UserError):
        H.set_training_paused(ctx, "nope", True)
    assert not is_paused(ctx.store)
    H.set_training_paused(ctx, TOKEN, True)
    assert is_paused(ctx.store) and "pause requested" in H.training_status(ctx)
    H.set_training_paused(ctx, TOKEN, False)
    assert not is_paused(ctx.store)
    ctx.store.set_state(STATUS_KEY, {"state": "idle", "heartbeat": time.time() - 3600, "heartbeat_s": 5})
    assert "not running" in H.training_status(ctx)
    assert "never train" not in H.training_status(ctx)
    # groups that can never train are shown, and why: one of a single answer, one set aside
    from helpers.store import make_group
    make_group(ctx.store, seed=1, G=1)                       # n=1: untrainable from the start
    gid, *_ = make_group(ctx.store, seed=2)
    ctx.store.set_aside([gid])
    assert "2 never train (1 with a single answer: no sibling to compare; 1 set aside after their step failed)" \
        in H.training_status(ctx)


def test_data_tab_and_export(ctx, first_round):
    H.rate_candidates(ctx, first_round[-1]["episode"], ["4", "2"], A)
    stats = H.stats_dict(ctx)
    assert stats["ratings"] >= 2 and stats["joint_samples"] >= 2
    assert f"**ratings** {stats['ratings']} by {stats['raters']} raters" in H.data_stats(ctx)
    with pytest.raises(H.UserError, match="admin token"):
        with H.exported(ctx, "", ["jsonl"]):
            pass
    import os
    with H.exported(ctx, TOKEN, ["jsonl", "datasets"]) as files:
        assert files and all(os.path.getsize(f) > 0 for f in files if "arena_votes" not in f)   # no pairs: empty
        assert sorted(os.path.basename(f) for f in files if "arena_votes" in f) == ["arena_votes.jsonl", "arena_votes.zip"]
        assert not any(os.path.realpath(f).startswith(os.path.realpath(ctx.home)) for f in files)
        where = {os.path.dirname(os.path.dirname(f)) for f in files}
    assert len(where) == 1 and not os.path.exists(where.pop())   # the temp dir is gone afterwards
    assert not os.path.exists(os.path.join(ctx.home, "exports"))


def test_check_lines_are_shown_as_text_not_markdown():
    """A failing test's code and error reach the page verbatim (a test's `__index__` was bold
    "index" in the page); floats read to 3 significant digits."""
    from collab_app.web.handlers import check_summary, md_literal, render_checks

    error = "TypeError: slice indices must be integers or None or have an __index__ method"
    test = "assert candidate([1.0, 2.8], 0.3) == True  # *a* [x](y) `c` <b>bold</b> & more"
    details = {"tests_passed": 0, "tests_total": 7, "first_failure": {"test": test, "error": error},
               "length_ratio": 1.3064516129032258, "tokens": [41, 56], "big": 123456.7}
    lines = check_summary(details)
    assert lines[:2] == ["tests passed: 0/7", f"first failing test: {test} -> {error}"]
    assert "length_ratio: 1.31" in lines and "tokens: [41, 56]" in lines and "big: 123457" in lines
    md = render_checks({"reward": {"levels": {"tests": 0.0}, "details": details}})
    assert r"\_\_index\_\_" in md and r"\*a\*" in md and r"\[x\]\(y\)" in md and r"\`c\`" in md
    assert "<b>" not in md and "&lt;b&gt;bold&lt;/b&gt; &amp; more" in md
    assert md_literal("a_b") == r"a\_b" and md_literal("plain words") == "plain words"
    failed = render_checks({"reward": None, "check_error": "sandbox: __main__ *died*"})
    assert r"\_\_main\_\_ \*died\*" in failed


def test_a_persons_input_mistake_is_a_message_without_a_server_traceback():
    """ui._err turns UserError into gr.Error for the page and API clients; Gradio prints a
    traceback for every gr.Error unless told not to, which filled the server log with a person's
    empty prompts."""
    import gradio as gr

    from collab_app.web import ui

    @ui._err
    def call():
        raise H.UserError("text is empty: type or paste something first")

    @ui._err
    def stream():
        yield "first"
        raise H.UserError("text is empty")

    with pytest.raises(gr.Error) as e:
        call()
    assert e.value.message.startswith("text is empty") and e.value.print_exception is False
    gen = stream()
    assert next(gen) == "first"
    with pytest.raises(gr.Error) as e:
        next(gen)
    assert e.value.print_exception is False
