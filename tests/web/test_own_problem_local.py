"""A local app trusts its person; a public one neither runs people's code weakly nor model code
unconfined (issue 82, item 7 and M5), and a round's checks count against its caller's network (M3):

- item 7: on an app reachable from this machine only (not public, no proxy in front:
  context.AppContext.trusts_its_person) whose sandbox is weak ("plain", forced here), "My own
  coding problem" runs at the best isolation there is and the page says which; a public app, or
  a loopback one behind a proxy, still refuses it;
- M5: a public `collab serve` whose sandbox is "plain" without Landlock stops with exit 2 and the
  reason, unless COLLAB_SANDBOX_ALLOW_UNCONFINED=1 accepts it; the page's isolation line says which;
- M3: `core.play_round` runs its checks on behalf of the caller's client network
  (tasks.sandbox.on_behalf_of), the key of that network's share of the sandbox's slots.
"""
from __future__ import annotations

import pytest

from collab_app.web import handlers as H
from helpers.scripted import ScriptedStreamEngine, make_ctx
from tasks import sandbox

OWN = ('def add(a, b):\n    """Sum."""\n', "assert add(1, 2) == 3\nassert add(0, 0) == 0\n")
ANSWERS = {"helper": "def aux(a, b):\n    return a + b\n", "main": "def add(a, b):\n    return aux(a, b)\n"}


class CodeEngine(ScriptedStreamEngine):
    """Writes a working answer to OWN (the helper's aux, main's add) instead of prompt words."""

    def final_text(self, req, j: int) -> str:
        return ANSWERS[req.agent]


@pytest.fixture
def weak(monkeypatch):
    """This process's sandbox forced to "plain" (the weak level of a machine without root or user
    namespaces), COLLAB_SANDBOX_ALLOW_WEAK unset."""
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    monkeypatch.delenv("COLLAB_SANDBOX_ALLOW_UNCONFINED", raising=False)
    with sandbox._force_mode("plain"):
        yield


def _round(ctx, caller=H.Caller("session-local")):
    ep = H.start_coding(ctx, H.SOURCES[1], "eval", "", *OWN, "")
    return H.run_generate(ctx, ep, caller)


# --------------------------------------------------------------------------- item 7

def test_a_loopback_app_runs_its_persons_own_problem_in_the_weak_sandbox(tmp_path, weak):
    ctx = make_ctx(tmp_path, CodeEngine())                       # public=False, no proxy hops
    assert not sandbox.isolation()["untrusted_allowed"]          # the sandbox alone would refuse it
    done = _round(ctx)
    for cand in done["episode"]["candidates"]:
        assert cand["check_error"] is None, cand["check_error"]
        assert cand["reward"]["details"]["tests_passed"] == 2 and cand["reward"]["details"]["harness_ok"]
    assert ctx.trusts_its_person and ctx.untrusted_allowed and H.own_problem_off_message(ctx) is None
    summary = ctx.isolation_summary
    assert summary.startswith("WEAK sandbox (plain") and "trusts its person" in summary


@pytest.mark.parametrize("kw", [{"public": True}, {"trusted_proxy_hops": 1}])
def test_a_public_app_or_one_behind_a_proxy_still_refuses_it(tmp_path, weak, kw):
    ctx = make_ctx(tmp_path, CodeEngine(), **kw)
    assert not ctx.trusts_its_person and not ctx.untrusted_allowed
    assert "off on this server" in H.own_problem_off_message(ctx)
    assert "trusts its person" not in ctx.isolation_summary and "refused" in ctx.isolation_summary
    with pytest.raises(H.UserError, match="off on this server"):
        H.start_coding(ctx, H.SOURCES[1], "eval", "", *OWN, "")


def test_the_sandbox_runs_a_persons_code_weakly_only_for_a_local_person(weak):
    code, tests = "def f(x):\n    return x + 1\n", ["assert f(1) == 2"]
    with pytest.raises(sandbox.WeakSandboxError):
        sandbox.run_tests(code, tests, untrusted=True)
    with sandbox.on_behalf_of("net:127.0.0.1", local_person=True):
        assert sandbox.run_tests(code, tests, untrusted=True).all_passed
    with sandbox.on_behalf_of("net:203.0.113.0/24"), pytest.raises(sandbox.WeakSandboxError):
        sandbox.run_tests(code, tests, untrusted=True)


def test_the_page_says_which_isolation_the_own_problem_gets(tmp_path, weak):
    from collab_app.web.ui import build_app

    def by_id(demo, elem_id):
        return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)

    demo = build_app(make_ctx(tmp_path, CodeEngine()))
    assert "WEAK sandbox (plain" in by_id(demo, "code-isolation").value
    assert "trusts its person" in by_id(demo, "code-isolation").value
    assert [c[1] for c in by_id(demo, "code-source").choices] == list(H.SOURCES)
    assert not by_id(demo, "code-own-off").visible


# --------------------------------------------------------------------------- M5

@pytest.fixture
def unconfined(weak, monkeypatch):
    """"plain" without Landlock: a Space whose kernel has none, or filters it."""
    monkeypatch.setattr(sandbox, "_landlock_cache", 0)
    monkeypatch.delenv("SPACE_ID", raising=False)
    for k in ("COLLAB_ADMIN_TOKEN", "COLLAB_API_KEYS", "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC"):
        monkeypatch.delenv(k, raising=False)


def test_a_public_serve_stops_where_model_code_would_run_unconfined(tmp_path, unconfined, monkeypatch, capsys):
    from collab_app.web.serve import ServeConfig, check_unconfined_sandbox, cli_main

    check_unconfined_sandbox(ServeConfig(host="127.0.0.1"))          # one person's machine: allowed
    with pytest.raises(ValueError, match="unconfined.*COLLAB_SANDBOX_ALLOW_UNCONFINED=1"):
        check_unconfined_sandbox(ServeConfig(host="0.0.0.0"))
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "home"))
    assert cli_main(["--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "model-written code" in err and "--host 0.0.0.0" in err and "COLLAB_SANDBOX_ALLOW_UNCONFINED=1" in err
    assert "Traceback" not in err and not (tmp_path / "home").exists()
    monkeypatch.setenv("SPACE_ID", "someone/collab")
    with pytest.raises(ValueError, match="SPACE_ID"):
        check_unconfined_sandbox(ServeConfig(host="127.0.0.1"))
    monkeypatch.setenv(sandbox.ALLOW_UNCONFINED_ENV, "yes")           # only "1" counts
    with pytest.raises(ValueError, match="only '1' counts"):
        check_unconfined_sandbox(ServeConfig(host="0.0.0.0"))


def test_the_operator_may_accept_it_and_the_page_says_which_holds(tmp_path, unconfined, monkeypatch, caplog):
    from collab_app.web.serve import ServeConfig, check_unconfined_sandbox

    ctx = make_ctx(tmp_path, CodeEngine(), public=True)
    assert sandbox.isolation()["unconfined"] and not sandbox.isolation()["unconfined_accepted"]
    assert "COLLAB_SANDBOX_ALLOW_UNCONFINED=1." in ctx.isolation_summary      # refused at start
    monkeypatch.setenv(sandbox.ALLOW_UNCONFINED_ENV, "1")
    with caplog.at_level("WARNING", logger="tasks.sandbox"):
        check_unconfined_sandbox(ServeConfig(host="0.0.0.0"))
    assert "accepts that" in caplog.text
    assert sandbox.isolation()["unconfined_accepted"]
    assert "COLLAB_SANDBOX_ALLOW_UNCONFINED=1 (set: the operator accepts it)" in ctx.isolation_summary


def test_landlock_or_a_strong_sandbox_needs_no_acceptance(unconfined, monkeypatch):
    from collab_app.web.serve import ServeConfig, check_unconfined_sandbox

    monkeypatch.setattr(sandbox, "_landlock_cache", 4)               # "plain" confined by Landlock
    check_unconfined_sandbox(ServeConfig(host="0.0.0.0"))
    assert not sandbox.isolation()["unconfined"]
    monkeypatch.setattr(sandbox, "_forced", sandbox._Mode("namespaces", (), True, True, True))
    monkeypatch.setattr(sandbox, "_landlock_cache", 0)
    check_unconfined_sandbox(ServeConfig(host="0.0.0.0"))


# --------------------------------------------------------------------------- M3: a round's network

def test_a_rounds_checks_count_against_the_callers_network(tmp_path, monkeypatch):
    seen = []
    real = sandbox._Gate.acquire

    def acquire(self, key=None):
        seen.append(key)
        return real(self, key)

    monkeypatch.setattr(sandbox._Gate, "acquire", acquire)
    ctx = make_ctx(tmp_path, CodeEngine())                            # (a local app: runs at any level)
    done = _round(ctx, H.Caller("session-n", network="203.0.113.0/24"))
    assert all(c["reward"]["details"]["tests_passed"] == 2 for c in done["episode"]["candidates"])
    assert len(seen) == 2 and set(seen) == {"net:203.0.113.0/24"}, seen   # one check per candidate
    seen.clear()
    _round(ctx, H.Caller("session-m"))                                # no network known: its identity
    assert len(seen) == 2 and set(seen) == {"session:session-m"}, seen
