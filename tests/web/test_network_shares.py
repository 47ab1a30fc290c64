"""A fair share for every network, and the low findings of issue 82 (M3, H1's rating records, Low).

- rounds in flight per client network: one network with many sessions cannot hold every
  generate slot (at b360529 the cap was per cookie: 8 cookies held all 8);
- the global rating budget is shared fairly: three networks at their own limit no longer use it
  all up (`FairBudget`);
- a rating from the page or /v1 records the caller's network and whether it signed in, and an
  anonymous rater on an app with sign-in is told what its rating will do;
- /v1 slows wrong API keys per network (429 after a few), a right key from elsewhere is unaffected;
- `--loopback-admin` on a public app is refused, not warned about;
- the adapter table shows folder names, not the server's paths;
- `collab trainer` is non-dumpable with its secrets gone from its environment before it imports torch.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.middleware import Middleware

from collab_app.web import core
from collab_app.web import handlers as H
from collab_app.web.access import API, WEB, Caller, FairBudget, Limits, Quota, UserError, api_caller
from helpers.scripted import ScriptedStreamEngine, make_ctx
from helpers.store import make_group


# --------------------------------------------------------------------------- rounds in flight per network

def test_one_network_cannot_hold_every_generate_slot():
    lim = Limits(Quota(rounds_in_flight=1), rounds_in_flight_per_network=2)
    cookies = [Caller(f"web:{k}", network="10.0.0.1") for k in range(8)]
    lim.begin_round(cookies[0])
    lim.begin_round(cookies[1])
    with pytest.raises(UserError, match="your network already has 2 rounds generating") as e:
        lim.begin_round(cookies[2])                           # a third cookie of the same network
    assert e.value.code == "rounds_in_flight" and e.value.retry_after
    assert lim.held(cookies[2]) == 0 and lim.running(WEB) == 2   # the refusal took nothing
    honest = Caller("web:h", network="192.0.2.9")
    lim.begin_round(honest)                                  # another network still gets a slot
    lim.end_round(cookies[0])
    lim.begin_round(cookies[2])                              # a slot of its own network came back
    assert lim.running(WEB) == 3


def test_a_networks_slots_are_a_fair_share_of_the_generate_slots():
    """Alone, a network (a classroom behind one NAT) may use several of the 8 slots; beside three
    other networks generating, one pressing network holds one round, not two."""
    lim = Limits(Quota(rounds_in_flight=1), rounds_in_flight_per_network=4, generate_slots=8)
    crowd = [Caller(f"web:c{k}", network="10.0.0.1") for k in range(6)]
    for c in crowd[:4]:
        lim.begin_round(c)                                   # alone: min(4, 8 // 2)
    with pytest.raises(UserError, match="4 rounds generating"):
        lim.begin_round(crowd[4])
    for c in crowd[:4]:
        lim.end_round(c)
    honest = [Caller(f"web:h{k}", network=f"192.0.2.{k}") for k in range(3)]
    for h in honest:
        lim.begin_round(h)
    lim.begin_round(crowd[0])                                # four networks: 8 // 5 = 1 each
    with pytest.raises(UserError, match="1 rounds generating, its share of the server while 4 networks"):
        lim.begin_round(crowd[1])
    lim.end_round(honest[0])
    lim.begin_round(crowd[1])                                # three generating: 8 // 4 = 2
    off = Limits(Quota(rounds_in_flight=0), rounds_in_flight_per_network=0, generate_slots=8)
    for c in crowd:
        off.begin_round(c)                                   # 0 = no limit, the fair share too


def test_a_round_refused_by_the_minute_gives_the_network_slot_back():
    lim = Limits(Quota(rounds_per_minute=1, rounds_in_flight=0), rounds_in_flight_per_network=1)
    a = Caller("web:a", network="10.0.0.2")
    lim.begin_round(a)
    lim.end_round(a)
    with pytest.raises(UserError, match="per minute"):
        lim.begin_round(a)
    lim.begin_round(Caller("web:b", network="10.0.0.2"))     # not blocked by a leaked network slot


def test_the_context_default_shares_the_generate_slots(tmp_path):
    ctx = make_ctx(tmp_path, ScriptedStreamEngine())
    assert 0 < ctx.max_rounds_in_flight_per_network < ctx.generate_concurrency
    with pytest.raises(ValueError, match="max_rounds_in_flight_per_network"):
        make_ctx(tmp_path, ScriptedStreamEngine(), max_rounds_in_flight_per_network=-1)


# --------------------------------------------------------------------------- the global rating budget

def test_three_networks_at_their_limit_leave_room_for_others():
    """The finding: at 240 ratings/min per network, three networks used the whole global 600."""
    now = [0.0]
    budget = FairBudget(600, clock=lambda: now[0])
    per_network = {f"net:{k}": 0 for k in range(3)}
    for second in range(180):                                 # three minutes of each trying 4 a second
        now[0] = float(second)
        for net in per_network:
            if budget.take(net, 4) is None:
                per_network[net] += 4
    held = {net: len(budget._events.get(net, ())) for net in per_network}   # the last minute's
    assert sum(held.values()) <= 600 * 3 // 4 + 12           # settled near a quarter each, not 3 x 200
    newcomer = sum(budget.take("net:fresh", 1) is None for _ in range(200))
    assert newcomer >= 600 // 5                              # and a newcomer finds its fifth at once


def test_fair_budget_rules():
    b = FairBudget(10, clock=lambda: 0.0)
    assert b.take("a", 5) is None                             # alone: 10 / 2
    assert b.take("a", 1) is not None and b.share("a") == 5
    assert b.take("b", 4) is not None                        # two rating: 10 / 3 = 3 each at most
    assert b.take("b", 3) is None and b.take("b", 1) is not None
    assert b.take("c", 11) == float("inf")
    b.give_back("b", 3)
    assert b.share("c") == 3
    assert FairBudget(0).take("x", 10**6) is None             # 0 = no limit


# --------------------------------------------------------------------------- what a rating records

@pytest.fixture
def ctx(tmp_path):
    return make_ctx(tmp_path, ScriptedStreamEngine(), max_rounds_per_minute=0, max_ratings_per_minute=0)


def test_ratings_record_network_and_sign_in(ctx):
    gid, jids, *_ = make_group(ctx.store)                    # generated by session "sess-1"
    core.store_feedback(ctx, Caller("sess-1", network="192.0.2.1"), "stars", jids[0], 4)
    core.store_feedback(ctx, Caller("sess-1", username="ann", network="198.51.100.0"), "stars", jids[1], 5)
    rows = {r.rater: r for r in ctx.store.ratings_for(group_id=gid)}
    assert (rows["session:sess-1"].network, rows["session:sess-1"].signed_in) == ("192.0.2.1", False)
    assert (rows["hf:ann"].network, rows["hf:ann"].signed_in) == ("198.51.100.0", True)
    assert api_caller("api:k", "10.1.1.1").signed_in and api_caller("api:k", "10.1.1.1").network == "10.1.1.1"


def test_an_anonymous_rater_is_told_what_its_rating_does(ctx):
    gid, jids, *_ = make_group(ctx.store)
    ep = {"candidates": [{"joint_sample_id": j} for j in jids]}
    msg = H.rate_candidates(ctx, ep, [4, 2], Caller("sess-1", network="192.0.2.1"))
    assert msg.startswith("rating saved") and "not signed in" not in msg     # no sign-in offered: no cap
    ctx.anonymous_share = 0.25                                               # a Space with hf_oauth: true
    msg = H.rate_candidates(ctx, ep, [4, 2], Caller("sess-1", network="192.0.2.1"))
    assert "not signed in" in msg and "25%" in msg and "sign in with Hugging Face" in msg
    assert len(ctx.store.ratings_for(group_id=gid)) == 2                     # kept (re-rating replaced)
    msg = H.rate_candidates(ctx, ep, [3, 3], Caller("sess-1", username="ann"))
    assert "not signed in" not in msg


# --------------------------------------------------------------------------- /v1: wrong keys per network

KEY = "kA7-xQ2m_Rt9pLz4Vn8w"


def test_wrong_api_keys_are_slowed_per_network(ctx):
    from collab_app.web.identity import IdentityMiddleware, SessionIdentity
    from collab_app.web.openai_api import OpenAIConfig, mount_openai

    app = FastAPI(middleware=[Middleware(IdentityMiddleware, identity=SessionIdentity(proxy_hops=1))])
    mount_openai(app, ctx, OpenAIConfig(api_keys=(KEY,)))
    client = TestClient(app)

    def models(key, net):
        return client.get("/v1/models", headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": net})

    codes = [models(f"kZ9-guess_{k:04d}-Lm7", "203.0.113.9").status_code for k in range(8)]
    assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}           # b360529: 401 forever, no slowing
    r = models(KEY, "203.0.113.9")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1   # locked: the right key too
    assert r.json()["error"]["code"] == "too_many_invalid_keys"
    assert models(KEY, "192.0.2.50").status_code == 200                # another network is not locked out


# --------------------------------------------------------------------------- low findings

def test_loopback_admin_on_a_public_app_is_refused(monkeypatch):
    from collab_app.web.serve import ServeConfig, check_loopback_admin, cli_main

    monkeypatch.delenv("SPACE_ID", raising=False)
    check_loopback_admin(ServeConfig(host="127.0.0.1", loopback_admin=True))   # a laptop: fine
    check_loopback_admin(ServeConfig(host="0.0.0.0"))                           # no flag: fine
    with pytest.raises(ValueError, match="loopback-admin on a public app"):
        check_loopback_admin(ServeConfig(host="0.0.0.0", loopback_admin=True))
    with pytest.raises(ValueError, match="loopback-admin on a public app"):
        check_loopback_admin(ServeConfig(host="127.0.0.1", share=True, loopback_admin=True))
    assert cli_main(["--host", "0.0.0.0", "--loopback-admin"]) == 2             # before anything loads


def test_adapter_table_shows_no_server_paths(tmp_path):
    ctx = make_ctx(tmp_path, ScriptedStreamEngine())
    path = tmp_path / "home" / "secret-user" / "adapters" / "helper" / "v3"
    path.mkdir(parents=True)
    ctx.store.record_adapter_version("helper", 3, str(path))
    (row,) = H.adapter_table(ctx, "helper")
    assert row[-1] == "v3" and not any("secret-user" in str(c) for c in row)
    assert H.ADAPTER_HEADERS[-1] == "folder"


def test_the_trainer_is_sealed_before_it_imports_torch(tmp_path):
    """`collab trainer` seals (secrets out of os.environ, non-dumpable) before its module imports
    torch: at b360529 the child stayed dumpable with COLLAB_DB in its environment for the seconds
    `import torch` takes."""
    probe = ("import sys, os\n"
             "from collab_app import cli, secret_env\n"
             "seen = {}\n"
             "class Finder:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torch' and not seen:\n"
             "            seen['db'] = os.environ.get('COLLAB_DB')\n"
             "            seen['dumpable'] = secret_env.dumpable()\n"
             "        return None\n"
             "sys.meta_path.insert(0, Finder())\n"
             "cli.COMMANDS['trainer'] = ('builtins:len', '')\n"   # stands in for the service module
             "cli.main(['trainer'])\n"
             "import torch\n"
             "print(seen, secret_env.held('COLLAB_DB'))\n")
    env = {**os.environ, "COLLAB_DB": "postgresql://u:pw@db/x"}
    env.pop("COLLAB_KEEP_DUMPABLE", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "{'db': None, 'dumpable': False} postgresql://u:pw@db/x" in out.stdout, out.stdout


def test_the_generate_cap_before_gradio_is_for_public_apps_only(tmp_path):
    """A public app (or one behind a trusted proxy) caps a network's generate events before
    Gradio's queue (`Limits.network_cap`); a local app's one person may queue rounds past the
    slots that run at once (test_admin_door queues two behind a running one)."""
    from collab_app.web.ui import GENERATE, identity_middleware

    local = identity_middleware(make_ctx(tmp_path / "local", ScriptedStreamEngine()))
    public_ctx = make_ctx(tmp_path / "public", ScriptedStreamEngine(), public=True)
    public = identity_middleware(public_ctx)
    assert local.kwargs["group_caps"] == {}
    assert public.kwargs["group_caps"] == {GENERATE: public_ctx.limits.network_cap}
