"""The Training tab's set-aside and expired groups: an admin sees them with why they will not
train (Store.closed_groups) and puts chosen ones back (Store.put_back), gated like pause and
resume (access.check_admin); nobody else can do either.

Scripted engine (no model), real store (SQLite), real tasks."""
from __future__ import annotations

import pytest

from collab_app.online.returns import ReturnRule
from collab_app.web import handlers as H
from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx

TOKEN = "Q7v-mR2x_Lp9sWz4Kc"          # passes context.admin_token_problem
A = H.Caller("session-A", host="203.0.113.7")


@pytest.fixture
def ctx(tmp_path):
    return make_ctx(tmp_path, ScriptedStreamEngine(), admin_token=TOKEN)


def group(ctx) -> int:
    return H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)["episode"]["group_id"]


def test_an_admin_sees_set_aside_and_expired_groups_with_why_and_puts_them_back(ctx):
    expired = group(ctx)
    ctx.store.expire_groups(ReturnRule(mode="human", human_timeout_s=0))
    aside, untouched = group(ctx), group(ctx)
    ctx.store.set_aside([aside], "SafetensorError: I/O error: No space left on device (os error 28)")
    H.rate_candidates(ctx, {"candidates": [{"joint_sample_id": j.id} for j in ctx.store.group(aside).joints]},
                      ["5", "1"], A)
    rows = H.closed_groups_table(ctx, TOKEN, caller=A)
    assert [r[0] for r in rows] == [aside, expired]                       # newest first; open groups not listed
    assert rows[0][2:] == ["tldr", "set aside", "SafetensorError: I/O error: No space left on device (os error 28)", 2]
    assert rows[1][3] == "expired" and rows[1][4].startswith("no return for 2 of 2 candidates")
    assert H.CLOSED_HEADERS == ["group", "created (UTC)", "task", "status", "why", "ratings"]

    msg = H.put_back_groups(ctx, TOKEN, f"#{aside}, {expired} {untouched}", caller=A)
    assert msg == ("2 of 3 groups put back: open again, they train once they have their returns; 1 not put back "
                   "(not set aside or expired, unknown, or of a single answer, which can never train)")
    assert ctx.store.group(aside).status in ("open", "ready") and ctx.store.group(expired).status in ("open", "ready")
    assert H.closed_groups_table(ctx, TOKEN, caller=A) == []
    assert "crashed" not in H.training_status(ctx)


def test_only_an_admin_sees_or_puts_back(ctx):
    gid = group(ctx)
    ctx.store.set_aside([gid], "why")
    for call in (lambda t: H.closed_groups_table(ctx, t, caller=A), lambda t: H.put_back_groups(ctx, t, str(gid), caller=A)):
        for token in ("", "a-wrong-guess"):
            with pytest.raises(H.UserError, match="admin token"):
                call(token)
    assert ctx.store.group(gid).status == "untrainable"


@pytest.mark.parametrize("ids, fragment", [("", "give the ids"), ("12, x", "'x' is not a group id"),
                                           ("0", "'0' is not a group id"), ([1.5], "is not a group id")])
def test_put_back_says_what_to_type(ctx, ids, fragment):
    with pytest.raises(H.UserError, match=fragment):
        H.put_back_groups(ctx, TOKEN, ids, caller=A)


def test_the_training_tab_wires_both_as_admin_events(ctx):
    from collab_app.web import ui

    demo = ui.build_app(ctx)
    named = {fn.api_name: fn for fn in demo.fns.values() if fn.api_name}
    for name in ("closed_groups", "put_back_groups", "pause_training"):
        assert name in named and named[name].queue is False               # ADMIN_DOOR, like pause / resume
