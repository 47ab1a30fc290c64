"""No single rater steers the team (issue 21, item 3).

- a step of K groups takes at most max(1, floor(share * K)) groups whose returns one rater decides
  (`returns.deciding_rater`); that rater's other groups wait, ready and untouched, and train in
  later steps beside other raters' groups (collab_app/online/service.py `take_capped`, `due`);
- re-rating replaces the rater's row (60 re-ratings leave one row), and still counts as a new
  rating for a step that read the group before it (`ratings_seen` counts writes, not rows);
- a rating of a group already trained (or expired) is stored as one `late` row per rater, which
  the export sees and which never makes the group ready again;
- `Store.stats()` shows the counts (rating_replacements, late_ratings, rater_share,
  groups_held_by_rater_cap, raters_held).

Service tests use a fake trainer (no model): the cap is about which groups a step takes.
"""
from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from collab_app.online.returns import ReturnRule, deciding_rater, scale_rating
from collab_app.online.service import (PUBLIC_RATER_SHARE, ServiceConfig, TrainerService, rater_cap,
                                       scan_shares, take_capped)
from collab_app.online.store import RATER_CAP_KEY, Store, migrate, utcnow
from helpers.service import TASK, FakeTrainer, add_groups
from helpers.store import add_raw_group

HUMAN_FIRST = ReturnRule(mode="human_first", human_timeout_s=0)   # unrated groups: automatic returns at once


def rate_all(store, gid: int, rater: str, base: float = 5.0) -> None:
    """`rater` rates every joint sample of the group (5, 4, ...: a signal, as a person gives it)."""
    jids = [j.id for j in store.group(gid).joints]
    store.add_ratings([(j, max(1.0, base - k)) for k, j in enumerate(jids)], rater)


# ----------------------------------------------------------------------------- re-rating replaces

def test_sixty_rerates_leave_one_row_per_rater(store):
    gid, *_ = add_groups(store, 1)
    jid = store.group(gid).joints[0].id
    first = store.add_rating(jid, "mallory", 1, "x" * 2000)
    for k in range(60):
        assert store.add_rating(jid, "mallory", 1 + k % 5, "x" * 2000) == first   # the same row, replaced
    store.add_rating(jid, "ann", 4)
    rows = store.ratings_for(joint_sample_id=jid)
    assert [(r.rater, r.revision) for r in rows] == [("mallory", 60), ("ann", 0)]
    assert rows[0].value == 1 + 59 % 5 and store.stats()["ratings"] == 2
    assert store.stats()["rating_replacements"] == 60
    (ready,) = store.ready_groups(HUMAN_FIRST)
    assert ready.ratings_seen == 62                           # writes: 61 by mallory, 1 by ann
    assert ready.returns[0] == scale_rating((rows[0].value + 4) / 2, 2.0)


def test_a_replacing_rerate_during_a_step_keeps_the_group_ready(store):
    """The row count does not change when a rating is replaced: a step that read the group before
    the re-rating must still see that its return is old (ratings_seen counts writes)."""
    a, b = add_groups(store, 2)
    ja = store.group(a).joints[0].id
    store.add_rating(ja, "ann", 1)
    read = store.ready_groups(HUMAN_FIRST)
    assert [g.ratings_seen for g in read] == [1, 0]
    store.add_rating(ja, "ann", 5)                            # replaces: still one row
    assert len(store.ratings_for(group_id=a)) == 1
    kept = store.record_train_step(1, {}, [a, b], ratings_seen={g.group_id: g.ratings_seen for g in read})
    assert kept == [a] and store.group(a).status == "ready" and store.group(b).status == "trained"
    (again,) = store.ready_groups(HUMAN_FIRST)
    assert again.returns[0] == scale_rating(5, 2.0)


def test_ratings_on_a_trained_group_are_kept_late_and_never_retrain_it(store):
    gid, other = add_groups(store, 2)
    j0 = store.group(gid).joints[0].id
    trained_on = store.add_rating(j0, "ann", 5, "good")
    (ready, _) = store.ready_groups(HUMAN_FIRST)
    assert store.record_train_step(1, {}, [gid, other], ratings_seen={gid: ready.ratings_seen}) == []
    assert store.group(gid).status == "trained"

    late = store.add_rating(j0, "ann", 1, "changed my mind")  # after training: a late row
    assert late != trained_on
    store.add_rating(j0, "bob", 2)
    for k in range(60):                                       # further re-ratings replace the late row
        assert store.add_rating(j0, "ann", 1 + k % 5) == late
    rows = store.ratings_for(joint_sample_id=j0)
    assert [(r.rater, r.value, r.late) for r in rows] == [("ann", 5.0, False), ("ann", 1 + 59 % 5, True),
                                                          ("bob", 2.0, True)]
    assert store.group(gid).status == "trained" and store.ready_groups(HUMAN_FIRST) == []
    assert store.stats()["late_ratings"] == 2

    from collab_app.online.export import group_rows
    exported = group_rows(store.group(gid), HUMAN_FIRST, utcnow())[0]["ratings"]
    assert [(r["rater"], r["value"]) for r in exported] == [("ann", 5.0), ("ann", 1 + 59 % 5), ("bob", 2.0)]

    expired, = add_groups(store, 1)                           # same for a group that expired unrated
    assert store.record_train_step(2, {}, [], stale_group_ids=[expired]) == []
    store.add_rating(store.group(expired).joints[0].id, "ann", 5)
    assert store.group(expired).status == "expired" and store.ready_groups(HUMAN_FIRST) == []


def test_old_append_only_rows_stay_and_the_latest_is_replaced(tmp_path):
    """A store from before schema v4 may hold several rows per rater: they stay, the latest
    counts, and a new re-rating replaces that latest one instead of adding a row."""
    db = f"sqlite:///{tmp_path / 'old.db'}"
    eng = sa.create_engine(db)
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    with eng.begin() as c:
        assert migrate(c, target=3) == (0, 3)
        gid, jid = add_raw_group(c, now)
        for v in (1, 2):                                      # v3 appended every re-rating
            c.execute(sa.text("INSERT INTO ratings (joint_sample_id, rater, value, comment, created_at) "
                              "VALUES (:j, 'ann', :v, '', :t)"), {"j": jid, "v": v, "t": now})
    eng.dispose()
    st = Store(db)
    assert st.migrated_from == 3
    st.add_rating(jid, "ann", 5)
    assert [(r.value, r.revision) for r in st.ratings_for()] == [(1.0, 0), (5.0, 1)]
    assert st.group(gid).status == "ready"
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        with st._writer.begin() as c:
            c.execute(sa.text("UPDATE ratings SET value = 3"))
    st.close()


# ----------------------------------------------------------------------------- a group's rater

def test_deciding_rater_is_who_decides_most_returns():
    assert deciding_rater([[("ann", 5)], [("bob", 1), ("ann", 2)], [("bob", 3)]], ["human"] * 3) == "ann"   # 2-2
    assert deciding_rater([[("ann", 5)], [("ann", 2)], [("bob", 3)]], ["human"] * 3) == "ann"
    assert deciding_rater([[("bob", 5)], [("ann", 2)]], ["human", "human"]) == "bob"          # tie: met first
    assert deciding_rater([[("ann", 5)], [("bob", 2)], [("bob", 1)]], ["auto", "human", "human"]) == "bob"
    assert deciding_rater([[("ann", 5)], [("ann", 2)], [("bob", 1)]], ["auto", "auto", "human"]) == "bob"
    assert deciding_rater([[("ann", 5)], []], ["auto", "auto"]) is None                       # ratings ignored
    assert deciding_rater([[], []], ["human_never", "auto"]) is None
    # several ratings by one rater on one joint sample count once
    assert deciding_rater([[("ann", 1), ("ann", 5)], [("bob", 3)], [("bob", 2)]], ["human"] * 3) == "bob"


def test_ready_groups_carry_their_rater(store):
    a, b, c = add_groups(store, 3)
    rate_all(store, a, "ann")
    store.add_rating(store.group(b).joints[0].id, "bob", 3)
    by_id = {g.group_id: g for g in store.ready_groups(HUMAN_FIRST)}
    assert (by_id[a].rater, by_id[b].rater, by_id[c].rater) == ("ann", "bob", None)
    assert {g.rater for g in store.ready_groups(ReturnRule(mode="auto"))} == {None}


def test_ready_groups_read_past_one_raters_backlog(store):
    """A flood of one rater's groups cannot fill the read and hide other raters' newer groups."""
    flood = add_groups(store, 10)
    for g in flood:
        rate_all(store, g, "mallory")
    others = add_groups(store, 3)
    rate_all(store, others[0], "ann")
    held: list = []
    got = [g.group_id for g in store.ready_groups(HUMAN_FIRST, limit=4, admit=scan_shares(per_rater=1, held=held))]
    assert got == [flood[0], *others]
    assert held == [(g, "mallory") for g in flood[1:]]
    assert [g.group_id for g in store.ready_groups(HUMAN_FIRST, limit=4)] == flood[:4]   # without: all hers


# ----------------------------------------------------------------------------- the cap of a step

class G:
    def __init__(self, group_id, rater):
        self.group_id, self.rater = group_id, rater


def test_take_capped_rule():
    assert [rater_cap(k, 0.25) for k in (1, 3, 4, 5, 7, 8, 32)] == [1, 1, 1, 1, 1, 2, 8]
    assert rater_cap(100, 0.29) == 29 and rater_cap(7, 1.0) == 7
    flood = [G(i, "m") for i in range(10)] + [G(10, "a"), G(11, None), G(12, "b")]
    step, held = take_capped(flood, 0.25, 32)
    assert [g.group_id for g in step] == [0, 10, 11, 12]      # 1 of 4 from m; ceil would give 2 of 5
    assert [g.group_id for g in held] == list(range(1, 10))
    step, held = take_capped(flood, 1.0, 8)                   # off: the oldest, whoever rated them
    assert [g.group_id for g in step] == list(range(8)) and held == []
    step, held = take_capped(flood[:10], 0.25, 32)            # a rater alone: one group per step
    assert [g.group_id for g in step] == [0] and len(held) == 9
    many = [G(i, "abcd"[i % 4]) for i in range(16)]           # four raters, a quarter each: nobody waits
    step, held = take_capped(many, 0.25, 16)
    assert len(step) == 16 and held == []
    auto = [G(i, None) for i in range(5)]
    assert take_capped(auto, 0.25, 4)[0] == auto[:4]


def make_service(store, tmp_path, **kw):
    base = dict(adapters_dir=str(tmp_path / "adapters"), return_mode="human_first", human_timeout_s=0.0,
                poll_s=0.05, heartbeat_s=0.5, max_wait_s=0.0, min_groups=4, max_groups_per_step=8)
    svc = TrainerService(ServiceConfig(**{**base, **kw}), store=store, tasks={TASK.name: TASK})
    svc.trainers[TASK.name] = fake = FakeTrainer()
    return svc, fake


def poll_until_idle(svc, most: int = 50) -> None:
    for _ in range(most):
        if svc.poll_once() != "trained":
            return
    raise AssertionError("the service kept training")


def test_one_rater_cannot_supply_more_than_the_cap_of_a_step(store, tmp_path):
    flood = add_groups(store, 12)                             # the oldest groups: all one rater's
    for g in flood:
        rate_all(store, g, "mallory")
    fair = add_groups(store, 9)
    for k, g in enumerate(fair):
        if k % 3:
            rate_all(store, g, f"person{k}")                  # the others: other raters, or automatic returns
    svc, fake = make_service(store, tmp_path, max_rater_share=0.25)
    assert svc.poll_once() == "trained"
    st = store.stats()
    assert st["rater_share"] == 0.25 and st["raters_held"] == 1
    assert st["groups_held_by_rater_cap"] == 10               # all her groups but the 2 in the step wait
    poll_until_idle(svc)
    flood_set = set(flood)
    for ids in fake.steps:
        assert sum(g in flood_set for g in ids) <= max(1, math.floor(0.25 * len(ids))), fake.steps
    assert [len(s) for s in fake.steps] == [8, 4]             # 2 + 6 others, then 1 + 3
    assert sum(g in flood_set for s in fake.steps for g in s) == 3
    left = [g for g in flood if store.group(g).status == "ready"]
    assert len(left) == 9                                     # nothing dropped: ready, waiting
    # 8 held by the cap; the oldest of hers is the one group of the next step (waiting for K there)
    assert store.stats()["groups_held_by_rater_cap"] == 8 and store.stats()["groups"]["expired"] == 0

    more = add_groups(store, 3)                               # other people arrive: she gets her share again
    assert svc.poll_once() == "trained" and fake.steps[-1] == [left[0], *more]

    svc, fake = make_service(store, tmp_path, max_rater_share=1.0)   # the cap off: her backlog goes first
    assert svc.poll_once() == "trained" and fake.steps[-1] == left[1:]


def test_a_rater_alone_still_trains(store, tmp_path):
    """One person on a local app (the default: no cap) trains in full steps; with the cap on, a
    rater alone trains one group per step once it waited max_wait_s, and none with max_wait_s 0."""
    mine = add_groups(store, 8)
    for g in mine:
        rate_all(store, g, "me")
    svc, fake = make_service(store, tmp_path)
    assert svc.cfg.max_rater_share == 1.0
    assert svc.poll_once() == "trained" and fake.steps == [mine]

    mine = add_groups(store, 3)
    for g in mine:
        rate_all(store, g, "me")
    svc, fake = make_service(store, tmp_path, max_rater_share=0.25, min_groups=2)
    assert svc.poll_once() == "idle" and fake.steps == []     # one group of hers per step < K, T off
    assert store.stats()["groups_held_by_rater_cap"] == 2
    svc, fake = make_service(store, tmp_path, max_rater_share=0.25, min_groups=2, max_wait_s=0.001)
    poll_until_idle(svc)
    assert fake.steps == [[g] for g in mine]
    assert store.stats()["groups_held_by_rater_cap"] == 0
    assert store.get_state(RATER_CAP_KEY)["held"] == 0


def test_config_and_serve_set_the_share(monkeypatch):
    monkeypatch.delenv("SPACE_ID", raising=False)
    with pytest.raises(ValueError, match="max_rater_share"):
        ServiceConfig(max_rater_share=0.0)
    with pytest.raises(ValueError, match="max_rater_share"):
        ServiceConfig(max_rater_share=1.5)
    from trainer.configcli import parse_config
    cfg, _ = parse_config(ServiceConfig, ["--max-rater-share", "0.25"], description="test")
    assert cfg.max_rater_share == 0.25

    from collab_app.web.serve import ServeConfig, trainer_argv

    def share(**kw):
        argv = trainer_argv(ServeConfig(**kw), "/a", "/m")
        return float(argv[argv.index("--max-rater-share") + 1]) if "--max-rater-share" in argv else None

    assert share(host="127.0.0.1") is None                    # one person's app: no cap
    assert share(host="0.0.0.0") == PUBLIC_RATER_SHARE
    assert share(host="127.0.0.1", share=True) == PUBLIC_RATER_SHARE
    argv = trainer_argv(ServeConfig(host="0.0.0.0", trainer_args="--max-rater-share 0.5"), "/a", "/m")
    assert argv[-2:] == ["--max-rater-share", "0.5"]          # and the operator's, last, wins (argparse)
