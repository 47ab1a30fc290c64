"""The SQLite store under concurrent writers and under SIGKILL.

1. Several writer *processes* (spawn) with several threads each rate the same joint samples for a
   few seconds while another process adds groups and a thread reads; each records what the store
   acknowledged. Afterwards the store holds exactly the acknowledged ratings: none lost, none
   extra (rejected ratings included in the stream are not stored), and no "database is locked".
2. Writers streaming add_rating / add_group are killed with SIGKILL mid-stream: every
   acknowledged rating and group is there, the file passes PRAGMA integrity_check and
   foreign_key_check, and every group has all its samples and joint samples (add_group is one
   transaction). Acknowledgements go to a file with one os.write per ack, so a kill after the
   write cannot lose it.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import threading
import time
import traceback

from collab_app.engines.engine_types import Sample
from collab_app.online.returns import ReturnRule
from collab_app.online.store import Store
from tasks.base import Reward

SECONDS = 2.0
N_PROCS, N_THREADS = 3, 2


def _sample(agent: str, rng: random.Random, n: int) -> Sample:
    return Sample(agent=agent, adapter_version=1, prompt_token_ids=[rng.randrange(50_000) for _ in range(32)],
                  text="x" * n, token_ids=[rng.randrange(50_000) for _ in range(n)],
                  logprobs=[-rng.random() for _ in range(n)], finish_reason="stop")


def _add_group(store: Store, rng: random.Random, G: int = 2, n_tokens: int = 16):
    samples = [[_sample(a, rng, n_tokens) for _ in range(G)] for a in ("helper", "main")]
    rewards = [Reward(total=float(g), levels={"tests": float(g)}, max_total=4.0) for g in range(G)]
    return store.add_group("humaneval", {"id": f"e{rng.random()}"}, ["p", "q"], samples,
                           [(g, g) for g in range(G)], rewards, session_id="s")


# ----------------------------------------------------------------------------- workers (spawned)

def _rater_proc(url: str, jids: list[int], p: int, out_path: str) -> None:
    store = Store(url)
    acked: list = []
    problems: list[str] = []

    def work(t: int) -> None:
        rng, rater, i = random.Random(p * 100 + t), f"p{p}t{t}", 0
        deadline = time.monotonic() + SECONDS
        try:
            while time.monotonic() < deadline:
                i += 1
                jid, comment = rng.choice(jids), f"p{p}t{t}#{i}"
                if i % 7 == 0:   # a rejected rating inside the stream must leave no trace
                    try:
                        store.add_rating(jid, rater, 9, comment)
                        problems.append("a rating of 9 was accepted")
                    except ValueError:
                        pass
                    continue
                value = rng.randint(1, 5)
                rid = store.add_rating(jid, rater, value, comment)
                acked.append([rid, jid, rater, value, comment])
        except Exception:
            problems.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with open(out_path, "w") as f:
        json.dump({"acked": acked, "problems": problems}, f)


def _group_proc(url: str, out_path: str) -> None:
    store, rng, gids, problems = Store(url), random.Random(7), [], []
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline:
            gids.append(_add_group(store, rng)[0])
            store.ready_groups(ReturnRule(mode="human_first", human_timeout_s=0), limit=8)
            store.stats()
    except Exception:
        problems.append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump({"gids": gids, "problems": problems}, f)


def _stream_ratings(url: str, jids: list[int], ack_path: str) -> None:
    store = Store(url)
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    i = 0
    while True:
        i += 1
        # a rater per write: every acknowledgement names its own row (a rater's re-rating would
        # replace its row, issue 21; the replacement under concurrency is the test above)
        rid = store.add_rating(jids[i % len(jids)], f"killed-{os.getpid()}-{i}", 1 + i % 5, f"k#{i}")
        os.write(fd, f"{rid} k#{i}\n".encode())


def _stream_groups(url: str, ack_path: str) -> None:
    store, rng = Store(url), random.Random(os.getpid())
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while True:   # big groups: most of the time is spent inside add_group's transaction
        gid, _ = _add_group(store, rng, G=4, n_tokens=400)
        os.write(fd, f"{gid}\n".encode())


# ----------------------------------------------------------------------------- tests

def _check_file(path: str) -> None:
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        con.execute("PRAGMA foreign_keys = ON")
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        con.close()


def test_concurrent_processes_and_threads_lose_nothing(tmp_path):
    path = tmp_path / "c.db"
    url = f"sqlite:///{path}"
    store = Store(url)
    rng = random.Random(0)
    jids = [j for _ in range(3) for j in _add_group(store, rng)[1]]
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"r{p}.json") for p in range(N_PROCS)]
    procs = [ctx.Process(target=_rater_proc, args=(url, jids, p, outs[p])) for p in range(N_PROCS)]
    procs.append(ctx.Process(target=_group_proc, args=(url, str(tmp_path / "g.json"))))
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(timeout=120)
        assert pr.exitcode == 0, f"writer process exit code {pr.exitcode}"

    acked, problems = [], []
    for out in outs:
        with open(out) as f:
            d = json.load(f)
        acked += d["acked"]
        problems += d["problems"]
    with open(tmp_path / "g.json") as f:
        g = json.load(f)
    assert not problems + g["problems"], "\n".join(problems + g["problems"])
    assert len(acked) > 20 and g["gids"], "writers made too little progress to test anything"

    stored = {(r.id, r.joint_sample_id, r.rater, r.value, r.comment) for r in store.ratings_for()}
    # a re-rating replaces its rater's row (issue 21): each row holds the last write acknowledged
    # for it (one rater = one thread, so its writes to a row are acknowledged in order: #n grows)
    last: dict[int, tuple] = {}
    for rid, jid, rater, v, c in acked:
        if rid not in last or int(c.split("#")[1]) > int(last[rid][4].split("#")[1]):
            last[rid] = (rid, jid, rater, float(v), c)
    assert len({(a[1], a[2]) for a in last.values()}) == len(last)   # one row per (joint sample, rater)
    assert stored == set(last.values())                # exactly the acknowledged ratings, latest per row
    assert set(g["gids"]) <= {gr.id for gr in store.recent_groups(10_000)}
    store.close()
    _check_file(str(path))
    print(f"{len(acked)} ratings from {N_PROCS * N_THREADS} threads in {N_PROCS} processes, "
          f"{len(g['gids'])} groups, in {SECONDS}s")


def _wait_lines(path: str, n: int, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if os.path.exists(path) and open(path).read().count("\n") >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"writer wrote fewer than {n} acknowledgements in {timeout}s")


def test_sigkill_mid_stream_keeps_acknowledged_and_no_partial_group(tmp_path):
    path = tmp_path / "k.db"
    url = f"sqlite:///{path}"
    store = Store(url)
    jids = _add_group(store, random.Random(1))[1]
    store.close()
    ctx = mp.get_context("spawn")
    r_ack, g_ack = str(tmp_path / "ratings.ack"), str(tmp_path / "groups.ack")
    rng = random.Random(3)
    for round_ in range(2):   # two kills each, at random points of the streams
        procs = [ctx.Process(target=_stream_ratings, args=(url, jids, r_ack)),
                 ctx.Process(target=_stream_groups, args=(url, g_ack))]
        for pr in procs:
            pr.start()
        _wait_lines(r_ack, 15 * (round_ + 1))
        _wait_lines(g_ack, 3 * (round_ + 1))
        time.sleep(rng.random() * 0.3)
        for pr in procs:
            os.kill(pr.pid, signal.SIGKILL)
        for pr in procs:
            pr.join(timeout=30)
            assert pr.exitcode == -signal.SIGKILL

    _check_file(str(path))     # before our own code opens it: recovery is SQLite's WAL replay
    store = Store(url)
    stored = {(r.id, r.comment) for r in store.ratings_for() if r.rater.startswith("killed-")}
    acked = {(int(a), b) for a, b in (line.split() for line in open(r_ack).read().splitlines())}
    assert acked <= stored                               # every acknowledged rating survived
    assert len(stored - acked) <= 2                      # at most the one in flight per kill
    groups = store.recent_groups(10_000)
    acked_g = {int(x) for x in open(g_ack).read().split()}
    assert acked_g <= {g.id for g in groups}
    for g in groups:                                     # no partial group
        assert len(g.samples) == g.num_agents and all(len(row) == g.num_generations for row in g.samples)
        assert len(g.joints) == g.num_generations and all(len(j.sample_ids) == g.num_agents for j in g.joints)
        assert all(len(s.token_ids) == len(s.logprobs) for row in g.samples for s in row)
    store.close()
    print(f"after 2 SIGKILLs: {len(acked)} acknowledged ratings, {len(acked_g)} acknowledged groups, "
          f"{len(stored - acked)} committed-but-unacknowledged ratings")


def test_store_object_shared_by_threads(tmp_path):
    """One Store in one process, many threads (the Gradio case): no errors, all ratings kept."""
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    gid, jids = _add_group(store, random.Random(2))
    ids, errors = [], []

    def work(t):
        try:
            for i in range(15):
                ids.append(store.add_rating(jids[i % 2], f"t{t}-{i}", 3, f"{t}-{i}"))   # a row each
                assert store.group(gid).joints[i % 2].ratings   # reads interleaved with writes
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert sorted(ids) == sorted(r.id for r in store.ratings_for()) and len(ids) == 90
