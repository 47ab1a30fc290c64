"""The store's side of the machine's faults, on SQLite and a real PostgreSQL server:

- a rating that lands while a step records itself is either counted (the group stays ready) or
  stored late, never stored as in force on a group the step marks trained (PostgreSQL under READ
  COMMITTED needs the group's row lock for that; SQLite's BEGIN IMMEDIATE already orders them);
- lateness is counted in versions: a group records the newest version of every agent when it
  arrives;
- a group whose automatic check failed for one candidate trains on the others after the timeout;
- expired and set-aside groups carry their reason, admins list them and can put them back.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

from collab_app.online.returns import ReturnRule
from collab_app.online.store import Store, utcnow
from helpers.service import AGENTS, TASK, fake_sample
from tasks.base import Reward


def add_group(store, autos, G: int = 3) -> tuple[int, list[int]]:
    ex = TASK.examples("train")[0]
    return store.add_group(task=TASK.name, example=ex, prompts=TASK.agent_prompts(ex, []),
                           samples=[[fake_sample(a, g) for g in range(G)] for a in AGENTS],
                           joint=[(g, g) for g in range(G)], session_id="s",
                           auto_rewards=[None if a is None else Reward(a, {"score": a}, 2.0) for a in autos],
                           auto_errors=[None if a is not None else "the check crashed" for a in autos],
                           max_reward=2.0)


@pytest.fixture
def pg_url(pg_server):
    from helpers.store import pg_database

    return pg_database(pg_server)


def _locker(url: str, gid: int):
    """A second connection that holds group `gid`'s row lock, as a step's record does."""
    eng = sa.create_engine(url)
    conn = eng.connect()
    tx = conn.begin()
    conn.execute(sa.text("SELECT id FROM groups WHERE id = :g FOR UPDATE"), {"g": gid})
    return eng, conn, tx


def test_postgresql_a_rating_during_the_steps_record_is_stored_late(pg_url):
    store = Store(pg_url)
    gid, jids = add_group(store, [0.0, 1.0, 2.0])
    eng, conn, tx = _locker(pg_url, gid)
    done = threading.Thread(target=store.add_rating, args=(jids[0], "ann", 5))
    done.start()
    time.sleep(1.0)
    assert done.is_alive()                                   # waits for the step's transaction
    conn.execute(sa.text("UPDATE groups SET status = 'trained', trained_step = 1 WHERE id = :g"), {"g": gid})
    tx.commit()
    done.join(30)
    conn.close(), eng.dispose()
    (rating,) = store.ratings_for(group_id=gid)
    assert rating.late                                       # kept for the export, not as in force on a trained group
    store.close()


def test_postgresql_a_rating_before_the_steps_record_keeps_the_group_ready(pg_url):
    store = Store(pg_url)
    gid, jids = add_group(store, [0.0, 1.0, 2.0])
    seen = store.ready_groups(ReturnRule("weighted", 0.5, 0.0))[0].ratings_seen
    eng, conn, tx = _locker(pg_url, gid)                     # a rating's transaction holds the group ...
    conn.execute(sa.text("INSERT INTO ratings (joint_sample_id, rater, value, comment, created_at, kind, revision, "
                         "late, signed_in) VALUES (:j, 'ann', 5, '', now(), 'stars', 0, false, false)"), {"j": jids[0]})
    rerated: list = []
    step = threading.Thread(target=lambda: rerated.extend(store.record_train_step(1, {}, [gid], ratings_seen={gid: seen})))
    step.start()
    time.sleep(1.0)
    assert step.is_alive()                                   # ... so the step's record waits for it
    tx.commit()
    step.join(30)
    conn.close(), eng.dispose()
    assert rerated == [gid] and store.group(gid).status == "ready"   # trained again on the new return
    store.close()


def test_a_group_records_the_versions_it_arrived_at(url):
    store = Store(url)
    first, _ = add_group(store, [0.0, 1.0, 2.0])
    for a in AGENTS:
        store.record_adapter_version(a, 0, f"/x/{a}/v0")
        store.record_adapter_version(a, 1, f"/x/{a}/v1")
    later, _ = add_group(store, [0.0, 1.0, 2.0])
    assert store.group(first).versions_at == {}
    assert store.group(later).versions_at == {a: 1 for a in AGENTS}
    rule = ReturnRule("auto")
    assert {g.group_id: g.arrived_versions for g in store.ready_groups(rule)} == {first: {}, later: {a: 1 for a in AGENTS}}
    store.close()


def test_a_failed_check_trains_the_other_candidates_after_the_timeout(url):
    store = Store(url)
    gid, jids = add_group(store, [0.0, None, 2.0])           # candidate 2's check crashed, nobody rated it
    rule = ReturnRule("weighted", 0.5, human_timeout_s=60)
    store.add_rating(jids[0], "ann", 5)
    assert store.ready_groups(rule) == []                    # before the timeout: wait for a rating of it
    later = utcnow() + timedelta(seconds=61)
    (g,) = store.ready_groups(rule, now=later)
    assert g.joint == [(0, 0), (1, 1)] and len(g.returns) == 2 and g.joint_sample_ids == [jids[0], jids[2]]
    assert [s.text for s in g.samples[0]] == ["answer 0", "answer 2"]   # the answers of the kept candidates
    assert store.expire_groups(rule, now=later) == []        # not expired with the person's rating
    lone, _ = add_group(store, [None, None, 2.0])            # one return left: nothing to compare it with
    assert store.expire_groups(rule, now=utcnow() + timedelta(seconds=61)) == [lone]
    assert "no return for 2 of 3 candidates" in store.group(lone).status_reason
    store.close()


def test_closed_groups_have_reasons_and_can_be_put_back(url):
    store = Store(url)
    gid, jids = add_group(store, [0.0, 1.0, 2.0])
    store.add_rating(jids[1], "ann", 4)
    assert store.set_aside([gid], "RuntimeError: boom") == 1
    (row,) = store.closed_groups()
    assert (row["id"], row["status"], row["reason"], row["ratings"]) == (gid, "untrainable", "RuntimeError: boom", 1)
    for a in AGENTS:
        store.record_adapter_version(a, 0, f"/x/{a}/v0")
    assert store.put_back([gid]) == 1
    grp = store.group(gid)
    assert (grp.status, grp.status_reason, grp.versions_at) == ("ready", None, {a: 0 for a in AGENTS})
    assert store.closed_groups() == [] and [g.group_id for g in store.ready_groups(ReturnRule("auto"))] == [gid]
    store.close()
