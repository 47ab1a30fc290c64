"""Ratings that train the shared team come from identities that cost something (issue 82, H1).

- every rating stores the sender's client network and whether it signed in (a login, an API key);
  a store from before (schema v5) is migrated, its ratings anonymous and of no known network;
- a step takes at most its per-rater share AND its per-network share AND, for raters who did not
  sign in, one anonymous share for all of them together (`take_capped`, the store's scan);
- `collab serve` gives its trainer child the network share when the app is public or behind a
  trusted proxy, and the anonymous share where Hugging Face sign-in is available;
- the page tells an anonymous rater on such an app what its rating will do.

At b360529 none of this existed: 50 sessions of one network filled every step (per-cookie cap only).
"""
from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from collab_app.online.returns import ReturnRule
from collab_app.online.service import ServiceConfig, TrainerService, rater_cap, scan_shares, take_capped
from collab_app.online.store import SCHEMA_VERSION, Store, migrate
from helpers.service import TASK, FakeTrainer, add_groups
from helpers.store import add_raw_group

HUMAN_FIRST = ReturnRule(mode="human_first", human_timeout_s=0)


def rate_all(store, gid: int, rater: str, network: str | None = None, signed_in: bool = False) -> None:
    jids = [j.id for j in store.group(gid).joints]
    store.add_ratings([(j, max(1.0, 5.0 - k)) for k, j in enumerate(jids)], rater, network=network,
                      signed_in=signed_in)


# ----------------------------------------------------------------------------- what a rating records

def test_a_rating_keeps_its_network_and_sign_in(store):
    gid, = add_groups(store, 1)
    j0, j1 = [j.id for j in store.group(gid).joints]
    store.add_rating(j0, "session:a", 4, network="192.0.2.7")
    store.add_rating(j1, "hf:ann", 5, network="2001:db8:1::/64", signed_in=True)
    rows = {r.rater: r for r in store.ratings_for(group_id=gid)}
    assert (rows["session:a"].network, rows["session:a"].signed_in) == ("192.0.2.7", False)
    assert (rows["hf:ann"].network, rows["hf:ann"].signed_in) == ("2001:db8:1::/64", True)
    store.add_rating(j0, "session:a", 2, network="198.51.100.1")      # re-rating replaces: its network too
    assert {r.rater: r.network for r in store.ratings_for(group_id=gid)}["session:a"] == "198.51.100.1"
    with pytest.raises(Exception, match="network must be text"):
        store.add_rating(j0, "session:a", 2, network="x" * 101)
    ready, = store.ready_groups(HUMAN_FIRST)
    assert ready.rater in ("session:a", "hf:ann")


def test_ratings_from_before_are_anonymous_after_the_migration(tmp_path):
    db = f"sqlite:///{tmp_path / 'v5.db'}"
    eng = sa.create_engine(db)
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    with eng.begin() as c:
        assert migrate(c, target=5) == (0, 5)
        gid, jid = add_raw_group(c, now)
        c.execute(sa.text("INSERT INTO ratings (joint_sample_id, rater, value, comment, created_at) "
                          "VALUES (:j, 'ann', 4, '', :t)"), {"j": jid, "t": now})
    eng.dispose()
    st = Store(db)
    assert st.migrated_from == 5 and st.stats()["schema_version"] == SCHEMA_VERSION >= 6
    (r,) = st.ratings_for()
    assert (r.rater, r.network, r.signed_in) == ("ann", None, False)
    st.close()


# ----------------------------------------------------------------------------- a step's shares

class G:
    def __init__(self, group_id, rater, network=None, signed_in=False):
        self.group_id, self.rater, self.network, self.signed_in = group_id, rater, network, signed_in


def test_fifty_sessions_of_one_network_get_one_networks_share():
    """The finding: per-cookie caps alone let 4 cookies (here 50) of one network fill a step."""
    attack = [G(i, f"session:{i}", "10.0.0.1") for i in range(50)]            # the oldest: all theirs
    honest = [G(50 + 4 * n + k, f"session:h{n}", f"10.0.{n + 1}.1") for n in range(3) for k in range(4)]
    step, held = take_capped(attack + honest, 0.25, 16)                      # per cookie only (b360529)
    assert len(step) == 16 and all(g.network == "10.0.0.1" for g in step)   # every group of the step
    step, held = take_capped(attack + honest, 0.25, 16, network_share=0.25)
    by_attacker = sum(g.network == "10.0.0.1" for g in step)
    assert len(step) == 16 and by_attacker == 4 == rater_cap(16, 0.25)     # a quarter: one network of four
    assert len(held) == 46                                                   # nothing dropped: the rest wait


def test_the_network_share_in_take_capped():
    groups = [G(i, f"s{i}", "net-a") for i in range(6)] + [G(6, "s6", "net-b"), G(7, None), G(8, "s8", None)]
    step, held = take_capped(groups, 1.0, 8, network_share=0.25)
    # K = 4: one of net-a, one of net-b, the automatic group, the rater of unknown network (never held by it)
    assert [g.group_id for g in step] == [0, 6, 7, 8] and [g.group_id for g in held] == [1, 2, 3, 4, 5]
    many = [G(i, f"s{i}", f"net{i % 4}") for i in range(16)]   # four networks, a quarter each: nobody waits
    assert take_capped(many, 0.25, 16, network_share=0.25) == (many, [])


def test_anonymous_raters_share_one_share():
    anon = [G(i, f"session:{i}", f"net{i}") for i in range(8)]              # 8 networks, nobody signed in
    signed = [G(10 + i, f"hf:p{i}", f"net{10 + i}", signed_in=True) for i in range(3)]
    step, held = take_capped(anon + signed, 0.25, 8, network_share=0.25, anonymous_share=0.25)
    assert sum(not g.signed_in for g in step) == 1 == rater_cap(len(step), 0.25)
    assert [g.group_id for g in step] == [0, 10, 11, 12] and len(held) == 7
    step, held = take_capped(anon, 0.25, 8, anonymous_share=1.0)             # no sign-in offered: off
    assert len(step) == 8 and held == []


def test_the_stores_scan_reads_past_one_networks_backlog(store):
    flood = add_groups(store, 10)
    for k, g in enumerate(flood):
        rate_all(store, g, f"session:m{k}", network="10.9.9.9")             # ten cookies, one network
    others = add_groups(store, 3)
    rate_all(store, others[0], "session:ann", network="192.0.2.1")
    held: list = []
    got = store.ready_groups(HUMAN_FIRST, limit=4, admit=scan_shares(per_rater=2, per_network=1, held=held))
    assert [g.group_id for g in got] == [flood[0], *others]
    assert got[0].network == "10.9.9.9" and got[1].network == "192.0.2.1" and got[2].network is None
    assert [g for g, _ in held] == flood[1:]
    held = []
    got = store.ready_groups(HUMAN_FIRST, limit=4, admit=scan_shares(per_anonymous=1, held=held))
    assert [g.group_id for g in got] == [flood[0], others[1], others[2]] and len(held) == 10


def test_a_service_step_holds_one_networks_groups(store, tmp_path):
    """Through the service's poll: with network share 0.25, no step of K takes more than
    max(1, floor(K/4)) groups rated from the attacker's network, however many cookies it used;
    nothing is dropped, and what waits is published for the page."""
    flood = add_groups(store, 12)
    for k, g in enumerate(flood):
        rate_all(store, g, f"session:m{k}", network="10.0.0.1")
    fair = add_groups(store, 9)
    for k, g in enumerate(fair):
        rate_all(store, g, f"session:h{k}", network=f"192.0.2.{k % 3}")
    cfg = ServiceConfig(adapters_dir=str(tmp_path / "adapters"), return_mode="human_first", human_timeout_s=0.0,
                        poll_s=0.05, heartbeat_s=0.5, max_wait_s=0.0, min_groups=4, max_groups_per_step=8,
                        max_rater_share=0.25, max_network_share=0.25)
    svc = TrainerService(cfg, store=store, tasks={TASK.name: TASK})
    svc.trainers[TASK.name] = fake = FakeTrainer()
    for _ in range(20):
        if svc.poll_once() != "trained":
            break
    flood_set = set(flood)
    assert fake.steps
    for ids in fake.steps:
        assert sum(g in flood_set for g in ids) <= max(1, math.floor(0.25 * len(ids))), fake.steps
    assert all(store.group(g).status == "trained" for g in fair)
    assert [len(ids) for ids in fake.steps] == [8, 4]                         # 2 of theirs + 6, then 1 + 3
    assert sum(store.group(g).status == "ready" for g in flood) == 12 - 3     # the rest wait, ready
    from collab_app.online.store import RATER_CAP_KEY
    assert store.get_state(RATER_CAP_KEY)["network_share"] == 0.25
    with pytest.raises(ValueError, match="max_network_share"):
        ServiceConfig(max_network_share=0.0)
    with pytest.raises(ValueError, match="max_anonymous_share"):
        ServiceConfig(max_anonymous_share=2.0)


# ----------------------------------------------------------------------------- who sets the shares

def test_serve_gives_the_trainer_its_shares(monkeypatch):
    from collab_app.web.serve import ANONYMOUS_SHARE, ServeConfig, trainer_argv

    for name in ("SPACE_ID", "OAUTH_CLIENT_ID", "COLLAB_TRUSTED_PROXY_HOPS"):
        monkeypatch.delenv(name, raising=False)

    def flags(**kw):
        argv = trainer_argv(ServeConfig(**kw), "/a", "/m")
        return {f: float(argv[argv.index(f) + 1]) for f in ("--max-network-share", "--max-anonymous-share",
                                                             "--max-rater-share") if f in argv}

    assert flags(host="127.0.0.1") == {}                                   # one person's laptop
    assert flags(host="0.0.0.0") == {"--max-network-share": 0.25, "--max-rater-share": 0.25}
    monkeypatch.setenv("COLLAB_TRUSTED_PROXY_HOPS", "1")                     # loopback behind a proxy
    assert flags(host="127.0.0.1")["--max-network-share"] == 0.25
    monkeypatch.setenv("SPACE_ID", "me/team")
    monkeypatch.setenv("OAUTH_CLIENT_ID", "x")                               # hf_oauth: true
    assert flags(host="0.0.0.0")["--max-anonymous-share"] == ANONYMOUS_SHARE
    assert flags(host="0.0.0.0", anonymous_share=0.5)["--max-anonymous-share"] == 0.5
    with pytest.raises(ValueError, match="anonymous_share"):
        ServeConfig(anonymous_share=0.0)


def test_the_readme_space_asks_for_sign_in():
    """On a Space, sign-in is the default: the README's front matter ships hf_oauth: true."""
    from pathlib import Path

    head = Path(__file__).resolve().parents[2].joinpath("README.md").read_text().split("---")[1]
    assert "hf_oauth: true" in head
