"""The episode store (collab_app/online/store.py) on SQLite and, where the binaries exist, PostgreSQL.

The PostgreSQL server is a throwaway one (initdb in a temp dir, a free local port), started once
per session; the tests parametrized with `url` skip PostgreSQL with the reason when `initdb` /
`pg_ctl` or the `psycopg` driver are missing.
"""
from __future__ import annotations

import random
from datetime import timedelta

import pytest
import sqlalchemy as sa

from collab_app.online.returns import ReturnRule, scale_rating
from collab_app import paths
from collab_app.online.store import (SCHEMA_VERSION, Base, NotFound, Store, StoreError, migrate,
                              utcnow)
from helpers.store import make_group, make_sample

# ----------------------------------------------------------------------------- round trip


def test_group_roundtrip_exact(store):
    gid, jids, samples, joint, autos = make_group(store, seed=1, G=3, joint_mode="cross", turn=1)
    g = store.group(gid)
    assert g.samples == samples                       # dataclass equality: text, ids, logprobs exact
    assert [j.joint for j in g.joints] == joint and [j.id for j in g.joints] == jids
    assert [j.auto_total for j in g.joints] == [r.total for r in autos]
    assert g.joints[2].auto_levels == {"structure": 1.0, "tests": 0.0}
    assert g.joints[1].auto_details == {"failed": "test 1", "nan": "nan"}
    assert g.joints[4].combined == "combined 4"
    assert (g.task, g.example["id"], g.example_id, g.turn, g.num_agents, g.num_generations) == \
        ("humaneval", "HumanEval/1", "HumanEval/1", 1, 2, 3)
    assert g.prompts == ["helper prompt", "main prompt"] and g.max_reward == 4.0
    assert g.status == "ready" and g.session_id == "sess-1" and g.created_at.tzinfo is not None
    assert abs((utcnow() - g.created_at).total_seconds()) < 60
    assert store.recent_groups(5)[0].id == gid
    assert store.recent_groups(5, session_id="other") == []


def test_group_not_found(sqlite_store):
    store = sqlite_store
    with pytest.raises(NotFound, match="no group"):
        store.group(12345)


@pytest.mark.parametrize("breakage, match", [
    (lambda s: s[0][0].logprobs.pop(), "logprobs for"),
    (lambda s: s[0][0].logprobs.__setitem__(0, float("-inf")), "finite"),
    (lambda s: s[1][0].token_ids.__setitem__(0, "x"), "list of ints"),
    (lambda s: s[1].pop(), "same number of generations"),
])
def test_add_group_validation_stores_nothing(sqlite_store, breakage, match):
    store = sqlite_store
    rng = random.Random(0)
    samples = [[make_sample(a, rng) for _ in range(2)] for a in ("helper", "main")]
    breakage(samples)
    with pytest.raises(StoreError, match=match):
        store.add_group("humaneval", {"id": "x"}, ["p", "q"], samples, [(0, 0), (1, 1)], [None, None],
                        max_reward=4.0)
    assert store.stats()["samples"] == 0 and sum(store.stats()["groups"].values()) == 0


def test_add_group_shape_errors(sqlite_store):
    store = sqlite_store
    rng = random.Random(0)
    samples = [[make_sample(a, rng) for _ in range(2)] for a in ("helper", "main")]
    with pytest.raises(StoreError, match="joint"):
        store.add_group("humaneval", {"id": "x"}, ["p", "q"], samples, [(0, 2)], [None], max_reward=4.0)
    with pytest.raises(StoreError, match="max_reward"):
        store.add_group("humaneval", {"id": "x"}, ["p", "q"], samples, [(0, 0), (1, 1)], [None, None])
    with pytest.raises(StoreError, match="one prompt per agent"):
        store.add_group("humaneval", {"id": "x"}, ["p"], samples, [(0, 0)], [None], max_reward=4.0)
    with pytest.raises(StoreError, match="Reward"):
        store.add_group("humaneval", {"id": "x"}, ["p", "q"], samples, [(0, 0)], [1.0], max_reward=4.0)


# ----------------------------------------------------------------------------- ratings


def test_rating_value_rejected(sqlite_store):
    store = sqlite_store
    _, jids, *_ = make_group(store)
    for value in (9, -1, 0, 5.5, float("nan"), float("inf"), "abc", "4", None, True):
        with pytest.raises(ValueError, match="rating value"):
            store.add_rating(jids[0], "ann", value)
    assert store.ratings_for() == [] and store.stats()["ratings"] == 0


def test_rating_other_errors(store):
    _, jids, *_ = make_group(store)
    with pytest.raises(NotFound, match="no joint sample with id 999"):
        store.add_rating(999, "ann", 3)
    with pytest.raises(LookupError):          # the UI catches LookupError too
        store.add_rating(999, "ann", 3)
    for rater in ("", "   ", None):
        with pytest.raises(StoreError, match="rater"):
            store.add_rating(jids[0], rater, 3)
    with pytest.raises(StoreError, match="comment"):
        store.add_rating(jids[0], "ann", 3, "x" * 5000)
    with pytest.raises(StoreError, match="joint_sample_id"):
        store.add_rating(str(jids[0]), "ann", 3)
    assert store.ratings_for() == [] and store.stats()["ratings"] == 0


def test_rerating_and_several_raters(store):
    gid, jids, *_ = make_group(store, rewards=None)
    assert store.group(gid).status == "open"
    r1 = store.add_rating(jids[0], "ann", 1, "meh")
    r2 = store.add_rating(jids[0], "bob", 5)
    r3 = store.add_rating(jids[0], "ann", 5, "changed my mind")      # re-rating: replaces ann's row
    assert r1 < r2 and r3 == r1
    rows = store.ratings_for(joint_sample_id=jids[0])
    assert [(r.rater, r.value, r.comment, r.revision) for r in rows] == [("ann", 5, "changed my mind", 1),
                                                                         ("bob", 5, "", 0)]
    assert [r.id for r in store.ratings_for(rater="ann")] == [r1]
    assert len(store.ratings_for(group_id=gid)) == 2
    assert store.group(gid).status == "open"                 # candidate 2 not rated yet
    store.add_rating(jids[1], "bob", 3.5)
    assert store.group(gid).status == "ready"
    (ready,) = store.ready_groups(ReturnRule(mode="human"))
    assert ready.returns == [4.0, scale_rating(3.5, 4.0)]     # ann's 1 was replaced by her 5
    assert store.stats()["raters"] == 2


def test_ratings_append_only(store, url):
    """Nothing deletes a rating, and the only update is a rater's re-rating replacing their own
    row (issue 21): not the API (every statement it sends is watched), not the ORM, and (schema
    v2, narrowed in v4) not even raw SQL; a raw update that keeps the revision, or moves a rating
    to another rater, is refused."""
    gid, jids, *_ = make_group(store)
    seen: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda c, cur, stmt, *a: seen.append(stmt))
    store.add_rating(jids[0], "ann", 2)
    store.add_rating(jids[0], "ann", 4)
    store.add_rating(jids[1], "bob", 1)
    store.ready_groups(ReturnRule(mode="auto"))
    store.mark_trained([gid], 1)
    store.record_train_step(2, {"loss": 0.1}, [gid])
    store.expire_groups(ReturnRule(human_timeout_s=0))
    writes = [s for s in seen if s.lstrip().upper().startswith(("UPDATE", "DELETE"))]
    on_ratings = [s for s in writes if "ratings" in s.split("WHERE")[0].lower()]
    assert len(on_ratings) == 1 and on_ratings[0].lstrip().upper().startswith("UPDATE")   # ann's re-rating
    assert "revision" in on_ratings[0]
    assert [(r.rater, r.value, r.revision) for r in store.ratings_for()] == [("ann", 4.0, 1), ("bob", 1.0, 0)]

    from collab_app.online.store import RatingRow
    from sqlalchemy.orm import Session
    with Session(store.engine) as s:
        row = s.scalars(sa.select(RatingRow)).first()
        row.value = 5.0
        with pytest.raises(StoreError, match="append-only"):
            s.commit()
        s.rollback()
        s.delete(s.scalars(sa.select(RatingRow)).first())
        with pytest.raises(StoreError, match="append-only"):
            s.commit()
    for stmt in ("UPDATE ratings SET value = 5", "DELETE FROM ratings",
                 "UPDATE ratings SET rater = 'eve', revision = revision + 1",
                 "UPDATE ratings SET late = true, revision = revision + 1"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            with store._writer.begin() as c:
                c.execute(sa.text(stmt))
    assert [r.value for r in store.ratings_for()] == [4.0, 1.0]


# ----------------------------------------------------------------------------- ready groups


def test_ready_groups_under_each_rule(store):
    auto_unrated, *_ = make_group(store, seed=1)
    auto_rated, jr, *_ = make_group(store, seed=2)
    human_unrated, *_ = make_group(store, seed=3, rewards=None)
    human_rated, jh, *_ = make_group(store, seed=4, rewards=None)
    auto_partial, jp, *_ = make_group(store, seed=5)
    for j, v in zip(jr, (5, 1)):
        store.add_rating(j, "ann", v)
    for j, v in zip(jh, (2, 4)):
        store.add_rating(j, "ann", v)
    store.add_rating(jp[0], "ann", 3)

    def ids(mode, wait_s, **kw):
        rule = ReturnRule(mode=mode, human_timeout_s=60, **kw)
        return {g.group_id: g for g in store.ready_groups(rule, now=utcnow() + timedelta(seconds=wait_s))}

    assert set(ids("auto", 0)) == {auto_unrated, auto_rated, auto_partial}
    assert ids("auto", 0)[auto_rated].returns == [0.0, 0.5] and ids("auto", 0)[auto_rated].sources == ["auto"] * 2
    assert set(ids("human", 0)) == set(ids("human", 3600)) == {auto_rated, human_rated}
    assert ids("human", 0)[human_rated].returns == [1.0, 3.0]
    # human_first waits for ratings, then falls back to the automatic reward for the unrated ones
    assert set(ids("human_first", 0)) == {auto_rated, human_rated}
    late = ids("human_first", 120)
    assert set(late) == {auto_unrated, auto_rated, human_rated, auto_partial}
    assert late[auto_partial].returns == [2.0, 0.5] and late[auto_partial].sources == ["human", "auto"]
    w = ids("weighted", 0, human_weight=0.5)
    assert set(w) == {auto_rated, human_rated}
    assert w[auto_rated].returns == [pytest.approx(0.5 * 4.0 + 0.5 * 0.0), pytest.approx(0.5 * 0 + 0.5 * 0.5)]

    g = ids("auto", 0)[auto_rated]   # the shape the trainer consumes
    assert len(g.samples) == 2 and len(g.samples[0]) == 2 and g.joint == [(0, 0), (1, 1)]
    assert g.levels[1] == {"structure": 0.5, "tests": 0.0} and g.prompts == ["helper prompt", "main prompt"]
    assert g.samples == store.group(auto_rated).samples

    assert [x.group_id for x in store.ready_groups(ReturnRule(mode="auto"), limit=2)] == [auto_unrated, auto_rated]
    assert store.ready_groups(ReturnRule(mode="auto"), task="tldr") == []


def test_mark_trained_train_steps_and_expiry(store):
    a, *_ = make_group(store, seed=1)
    b, *_ = make_group(store, seed=2)
    h, *_ = make_group(store, seed=3, rewards=None)
    rule = ReturnRule(mode="auto", human_timeout_s=60)
    store.record_train_step(7, {"loss": 0.25, "kl": float("nan")}, [a])
    assert [g.group_id for g in store.ready_groups(rule)] == [b]
    assert store.group(a).status == "trained" and store.group(a).trained_step == 7
    assert store.train_steps() == [dict(step=7, metrics={"loss": 0.25, "kl": "nan"},
                                        created_at=store.train_steps()[0]["created_at"], group_ids=[a])]
    with pytest.raises(StoreError, match="already recorded"):
        store.record_train_step(7, {}, [b])
    assert store.group(b).status == "ready"                # the refused step marked nothing
    assert store.mark_trained([a, b], 8) == 1              # a stays trained at step 7
    assert store.group(a).trained_step == 7 and store.group(b).trained_step == 8
    hf = ReturnRule(mode="human_first", human_timeout_s=60)
    assert store.expire_groups(hf) == []                   # too young
    assert store.expire_groups(hf, now=utcnow() + timedelta(seconds=61)) == [h]
    assert store.group(h).status == "expired"
    store.add_rating(store.group(h).joints[0].id, "late", 5)   # still stored, group stays expired
    assert store.group(h).status == "expired" and len(store.ratings_for(group_id=h)) == 1
    assert store.stats()["groups"] == {"open": 0, "ready": 0, "trained": 2, "expired": 1, "untrainable": 0}


def test_single_sample_groups_never_become_ready(store):
    """A group of one answer per agent (an API call with n=1) is stored but never ready: its
    advantage would raise "a group needs >= 2 returns" in every step that picked it."""
    single, (jid,), *_ = make_group(store, seed=1, G=1)
    human_single, (hjid,), *_ = make_group(store, seed=2, G=1, rewards=None)
    normal, *_ = make_group(store, seed=3)
    assert store.group(single).status == store.group(human_single).status == "untrainable"
    store.add_rating(hjid, "person", 5)                     # a rating does not make it ready either
    assert store.group(human_single).status == "untrainable"
    for rule in (ReturnRule(mode="auto"), ReturnRule(mode="human_first", human_timeout_s=0)):
        assert [g.group_id for g in store.ready_groups(rule)] == [normal]
    stats = store.stats()
    assert stats["single_sample_groups"] == 2 and stats["groups"]["untrainable"] == 2
    # a store written before such groups were refused may hold one as "ready": never picked, and
    # the service's expiry pass (every poll) marks it untrainable
    legacy, *_ = make_group(store, seed=4, G=1)
    with store.engine.begin() as c:
        c.execute(sa.text("UPDATE groups SET status = 'ready' WHERE id = :g"), {"g": legacy})
    assert [g.group_id for g in store.ready_groups(ReturnRule(mode="auto"))] == [normal]
    assert store.expire_groups(ReturnRule(mode="auto", human_timeout_s=float("inf"))) == []
    assert store.group(legacy).status == "untrainable"


def test_set_aside_leaves_trained_groups_alone(store):
    a, *_ = make_group(store, seed=1)
    b, *_ = make_group(store, seed=2)
    store.record_train_step(1, {}, [b])
    assert store.set_aside([a, b]) == 1
    assert store.group(a).status == "untrainable" and store.group(b).status == "trained"
    assert store.ready_groups(ReturnRule(mode="auto")) == []


def test_a_rating_during_a_step_keeps_the_group_ready(store):
    """The step read the groups, a rating arrived, then the step was recorded: the re-rated group
    went into the gradient with its old return, so it is not marked trained."""
    rule = ReturnRule(mode="human_first", human_timeout_s=0)
    a, (ja, _), *_ = make_group(store, seed=1)
    b, *_ = make_group(store, seed=2)
    read = store.ready_groups(rule)
    assert [(g.group_id, g.ratings_seen) for g in read] == [(a, 0), (b, 0)]
    store.add_rating(ja, "person", 5)
    kept = store.record_train_step(1, {"loss": 0.5}, [a, b], ratings_seen={g.group_id: g.ratings_seen for g in read})
    assert kept == [a]
    assert store.group(a).status == "ready" and store.group(b).status == "trained"
    assert store.train_steps()[0]["metrics"] == {"loss": 0.5, "groups_rerated": 1}
    assert store.train_steps()[0]["group_ids"] == [a, b]   # both went into the gradient
    (again,) = store.ready_groups(rule)
    assert again.group_id == a and again.ratings_seen == 1 and again.returns[0] == scale_rating(5, 4.0)
    assert store.record_train_step(2, {}, [a], ratings_seen={a: again.ratings_seen}) == []
    assert store.group(a).status == "trained"
    # under mode "auto" ratings do not change a return: nothing to wait for
    c, (jc, _), *_ = make_group(store, seed=3)
    (auto,) = store.ready_groups(ReturnRule(mode="auto"))
    assert auto.ratings_seen is None
    store.add_rating(jc, "person", 1)
    assert store.record_train_step(3, {}, [c], ratings_seen={c: auto.ratings_seen}) == []
    assert store.group(c).status == "trained"


# ----------------------------------------------------------------------------- adapters, state


def test_adapter_versions_and_pinning(store):
    assert store.latest_adapter_versions() == {} and store.current_adapter_versions() == {}
    for v in (0, 1, 2):
        store.record_adapter_version("helper", v, f"/a/helper/v{v}", step=v * 10, metrics={"loss": v})
    store.record_adapter_version("main", 0, "/a/main/v0")
    with pytest.raises(StoreError, match="never reused"):
        store.record_adapter_version("helper", 1, "/elsewhere")
    assert [a.version for a in store.adapter_versions("helper")] == [0, 1, 2]
    assert store.adapter_versions("helper")[1].metrics == {"loss": 1} and store.adapter_versions("helper")[1].step == 10
    latest = store.latest_adapter_versions()
    assert latest["helper"].version == 2 and latest["main"].path == "/a/main/v0"
    store.pin_adapter("helper", 1)
    assert store.current_adapter_versions() == {"helper": (1, "/a/helper/v1"), "main": (0, "/a/main/v0")}
    assert [a.pinned for a in store.adapter_versions("helper")] == [False, True, False]
    store.pin_adapter("helper", None)
    assert store.current_adapter_versions()["helper"] == (2, "/a/helper/v2")
    with pytest.raises(NotFound):
        store.pin_adapter("helper", 9)


def test_app_state(store):
    assert store.get_state("trainer") is None
    store.set_state("trainer", {"paused": True})
    store.set_state("trainer", {"paused": False, "step": 3})
    assert store.get_state("trainer") == {"paused": False, "step": 3}


# ----------------------------------------------------------------------------- schema


def _schema(engine) -> dict:
    insp = sa.inspect(engine)
    return {t: sorted((c["name"], c["nullable"]) for c in insp.get_columns(t))
            for t in insp.get_table_names() if t != "schema_version"}


def test_fresh_schema_matches_orm(store):
    want = {t.name: sorted((c.name, c.nullable) for c in t.columns) for t in Base.metadata.sorted_tables}
    assert _schema(store.engine) == want
    assert store.stats()["schema_version"] == SCHEMA_VERSION


def test_migration_from_v1(empty_url):
    """A database made by the v1 schema (with data) is migrated at start-up, data intact."""
    url = empty_url
    eng = sa.create_engine(url)
    with eng.begin() as c:
        assert migrate(c, target=1) == (0, 1)
        now = utcnow()
        c.execute(sa.text("INSERT INTO adapter_versions (agent, version, path, step, created_at, metrics) "
                          "VALUES ('helper', 0, '/v0', 0, :t, '{}')"), {"t": now.replace(tzinfo=None)})
        c.execute(sa.text("INSERT INTO groups (task, example_id, example, turn, prompts, num_agents, "
                          "num_generations, max_reward, created_at, status) VALUES "
                          "('tldr', 'e1', '{\"id\": \"e1\"}', 0, '[\"a\", \"b\"]', 2, 2, 3.0, :t, 'open')"),
                  {"t": now.replace(tzinfo=None)})
        gid = c.scalar(sa.text("SELECT id FROM groups"))
        c.execute(sa.text("INSERT INTO joint_samples (group_id, joint_index, sample_ids) VALUES (:g, 0, '[]')"),
                  {"g": gid})
        jid = c.scalar(sa.text("SELECT id FROM joint_samples"))
        c.execute(sa.text("INSERT INTO ratings (joint_sample_id, rater, value, comment, created_at) "
                          "VALUES (:j, 'ann', 4, 'old', :t)"), {"j": jid, "t": now.replace(tzinfo=None)})
    assert "pinned" not in [c["name"] for c in sa.inspect(eng).get_columns("adapter_versions")]
    eng.dispose()

    st = Store(url)
    assert st.migrated_from == 1 and st.stats()["schema_version"] == SCHEMA_VERSION
    assert st.adapter_versions("helper")[0].pinned is False
    assert [(r.rater, r.value, r.comment) for r in st.ratings_for()] == [("ann", 4.0, "old")]
    assert st.group(gid).example == {"id": "e1"}
    want = {t.name: sorted((c.name, c.nullable) for c in t.columns) for t in Base.metadata.sorted_tables}
    assert _schema(st.engine) == want
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        with st._writer.begin() as c:
            c.execute(sa.text("DELETE FROM ratings"))
    st.set_state("x", {"ok": 1})
    st.close()
    assert Store(url).migrated_from == SCHEMA_VERSION       # idempotent


def test_newer_schema_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Store(url).close()
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.execute(sa.text("UPDATE schema_version SET version = 99"))
    with pytest.raises(StoreError, match="schema version 99"):
        Store(url)


def test_sqlite_settings_and_default_url(tmp_path, monkeypatch):
    st = Store(f"sqlite:///{tmp_path / 'sub' / 'dir' / 'c.db'}")   # parent folders are created
    with st.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    st.close()
    monkeypatch.delenv("COLLAB_DB", raising=False)
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "home"))
    assert paths.store_url() == f"sqlite:///{tmp_path / 'home' / 'collab.db'}"
    monkeypatch.setenv("COLLAB_DB", "postgresql+psycopg://u@h/db")
    assert paths.store_url() == "postgresql+psycopg://u@h/db"
    monkeypatch.setenv("COLLAB_DB", f"sqlite:///{tmp_path / 'env.db'}")
    Store().close()
    assert (tmp_path / "env.db").exists()


def test_foreign_keys_enforced(store):
    with pytest.raises(sa.exc.IntegrityError):
        with store._writer.begin() as c:
            c.execute(sa.text("INSERT INTO ratings (joint_sample_id, rater, value, comment, created_at) "
                              "VALUES (424242, 'x', 3, '', :t)"), {"t": utcnow().replace(tzinfo=None)})


def test_in_memory_store_shared_by_threads():
    """sqlite:// (tests, demos): one database for every thread of the process."""
    import threading

    st = Store("sqlite://")
    gid, jids, *_ = make_group(st)
    t = threading.Thread(target=lambda: st.add_rating(jids[0], "thread", 4))
    t.start()
    t.join()
    assert [r.rater for r in st.ratings_for()] == ["thread"] and st.group(gid).id == gid
