"""`collab bench faults`: the report's arithmetic without a server (ratings lost / trained /
explained, whether and when learning resumed after each fault, the targets), the config's checks,
the pieces that make the faults (the clock shim, the lock holder, the trainer's pid in serve's
process tree), the store read back; and one short end-to-end run against a real `collab serve`
(slow)."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from collab_app.commands import bench_faults as B


# --------------------------------------------------------------------------- config

def test_config_splits_commas_and_checks_names():
    assert B.BenchFaultsConfig(faults=["kill,lock", "wipe"], minutes=10, fault_every_min=2).faults == ["kill", "lock", "wipe"]
    assert B.BenchFaultsConfig().faults == list(B.FAULTS)
    with pytest.raises(ValueError, match="unknown fault"):
        B.BenchFaultsConfig(faults=["kill,flood"])
    with pytest.raises(ValueError, match="unknown rater preference"):
        B.BenchFaultsConfig(preference="loud")


@pytest.mark.parametrize("kw, match", [
    ({"minutes": 12, "fault_every_min": 2}, "need --minutes > 12"),          # 6 faults x 2 min: no time after the last
    ({"minutes": 4, "fault_every_min": 2, "faults": ["kill", "lock"]}, "need --minutes > 4"),
    ({"minutes": 0}, "must be > 0"),
    ({"fault_every_min": 0}, "must be > 0"),
    ({"raters": 0}, "raters >= 1"),
    ({"think_s": -1}, "think_s >= 0"),
    ({"num_generations": 1}, "num_generations >= 2"),
    ({"lock_s": 0}, "lock_s > 0"),
    ({"clock_step_s": 0}, "clock_step_s != 0"),
    ({"tmpfs_mb": 8}, "tmpfs_mb >= 64"),
    ({"drain_minutes": -1}, "drain_minutes >= 0"),
])
def test_config_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        B.BenchFaultsConfig(**kw)


def test_config_allows_no_faults_and_the_cli_reads_it():
    assert B.BenchFaultsConfig(faults=[], minutes=1).faults == []
    from trainer.configcli import parse_config

    cfg, _ = parse_config(B.BenchFaultsConfig, ["--faults", "kill,lock", "--minutes", "4", "--fault-every-min", "1"],
                          description="x")
    assert cfg.faults == ["kill", "lock"] and cfg.minutes == 4.0


# --------------------------------------------------------------------------- the report's arithmetic

def _acc(id_, value, answer="rating saved: #1"):
    return {"id": id_, "value": float(value), "answer": answer}


def test_rating_accounts_lost_trained_late_pending_and_reasons():
    ratings = [{"id": 1, "value": 5.0, "late": False, "group_id": 10},
               {"id": 2, "value": 1.0, "late": False, "group_id": 10},
               {"id": 3, "value": 3.0, "late": True, "group_id": 10},    # stored late
               {"id": 4, "value": 2.0, "late": True, "group_id": 11},
               {"id": 5, "value": 4.0, "late": False, "group_id": 12},   # open group: pending
               {"id": 6, "value": 4.0, "late": False, "group_id": 13},   # set aside with a reason
               {"id": 7, "value": 4.0, "late": False, "group_id": 14},   # expired, no reason stored
               {"id": 8, "value": 2.0, "late": False, "group_id": 10}]   # stored with another value than accepted
    groups = [{"id": 10, "status": "trained"}, {"id": 11, "status": "trained"}, {"id": 12, "status": "open", "unrated": 1},
              {"id": 13, "status": "untrainable", "status_reason": "SafetensorError: os error 28"},
              {"id": 14, "status": "expired", "status_reason": None}]
    accepted = [_acc(1, 5), _acc(2, 1), _acc(3, 3, "rating saved: #3 (late: this group already trained)"),
                _acc(4, 2, "rating saved: #4"), _acc(5, 4), _acc(6, 4), _acc(7, 4), _acc(8, 5),
                _acc(99, 3),          # the store never got it
                _acc(None, 4)]        # the answer named no id: cannot be found, so it counts as lost
    a = B.rating_accounts(accepted, refused=3, unanswered=1, ratings=ratings, groups=groups)
    assert (a["accepted"], a["stored"], a["lost"]) == (10, 7, 3)
    assert a["lost_ids"] == [8, 99, None]
    assert (a["refused"], a["unanswered"]) == (3, 1)
    assert (a["trained"], a["late"], a["late_told"], a["pending"], a["pending_unrated_sibling"]) == (2, 2, 1, 1, 1)
    assert a["not_trained"] == {"untrainable": 1, "expired": 1}
    assert (a["with_reason"], a["without_reason"], a["unexplained"]) == (1, 1, 2)
    assert a["stored"] == a["trained"] + a["late"] + a["pending"] + sum(a["not_trained"].values())


def test_rating_accounts_nothing_accepted():
    a = B.rating_accounts([], 0, 0, [], [])
    assert a["lost"] == 0 and a["unexplained"] == 0 and a["accepted"] == 0


def _fault(name, start, end, applied=True, scheduled=None):
    return {"fault": name, "scheduled": start if scheduled is None else scheduled, "start": start, "end": end,
            "applied": applied}


def test_fault_outcomes_resumed_counts_steps_that_train_fresh_groups():
    generated = {1: 10.0, 2: 50.0, 3: 145.0, 4: 155.0, 5: 260.0}     # group id: when the raters got it
    steps = [{"t": 60.0, "group_ids": [1, 2]},       # before any fault
             {"t": 125.0, "group_ids": [2]},         # inside the first fault
             {"t": 150.0, "group_ids": [2]},         # after it: backlog only (group 2 came before its end)
             {"t": 170.0, "group_ids": [3, 4]},      # the second step after it: fresh groups -> resumed
             {"t": 290.0, "group_ids": [1]}]         # after the second fault: an old group only
    faults = [_fault("lock", 100.0, 140.0), _fault("kill", 240.0, 240.0), _fault("clock", None, None, applied=False,
                                                                                 scheduled=360.0)]
    out = B.fault_outcomes(faults, steps, generated, t_stop=400.0)
    lock, kill, clock = out
    assert lock["window_end"] == 240.0 and lock["steps_during"] == 1 and lock["steps_after"] == 2
    assert lock["minutes_to_next_step"] == pytest.approx(10 / 60)
    assert lock["resumed"] is True and lock["steps_to_resume"] == 2
    assert lock["minutes_to_resume"] == pytest.approx(30 / 60)
    assert kill["window_end"] == 360.0            # the next fault's scheduled minute: it was never applied
    assert kill["steps_after"] == 1 and kill["minutes_to_next_step"] == pytest.approx(50 / 60)
    assert kill["resumed"] is False and kill["steps_to_resume"] is None and kill["minutes_to_resume"] is None
    assert clock["resumed"] is None and clock["steps_after"] is None
    assert faults[0].get("resumed") is None        # the input is not changed


def test_fault_outcomes_serve_that_never_came_back_is_not_resumed():
    out = B.fault_outcomes([_fault("truncate", 100.0, None)], [{"t": 50.0, "group_ids": [1]}], {1: 1.0}, 400.0)
    assert out[0]["resumed"] is False and out[0]["minutes_to_next_step"] is None


def test_targets():
    good = {"lost": 0, "unexplained": 0}
    resumed = [{"resumed": True, "steps_to_resume": 1}, {"resumed": True, "steps_to_resume": 2},
               {"resumed": None, "steps_to_resume": None}]
    t = B.targets(good, resumed, [])
    assert all(x["pass"] for x in t.values()) and t["learning_resumed"]["value"] == "2 of 2"
    t = B.targets({"lost": 1, "unexplained": 3}, [*resumed, {"resumed": True, "steps_to_resume": 3},
                                                  {"resumed": False, "steps_to_resume": None}],
                  [{"id": 5, "status": "untrainable", "reason": "disk"}])
    assert not any(x["pass"] for x in t.values())
    assert t["learning_resumed"]["value"] == "2 of 4" and t["groups_closed"]["value"] == 1
    assert B.targets(good, [], [])["learning_resumed"]["pass"] is None


# --------------------------------------------------------------------------- the fault machinery

def test_clock_shim_steps_the_wall_clock_live_and_leaves_sleep_alone(tmp_path):
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the bench reports the clock fault as not applied")
    lib, why = B.build_clock_shim(str(tmp_path))
    assert lib, why
    offset = tmp_path / "offset"
    offset.write_text("0\n")
    code = ("import datetime, sqlite3, sys, time\n"
            "t0 = time.time(); m = time.monotonic()\n"
            "open(sys.argv[1], 'w').write('-600\\n'); time.sleep(1.3)\n"
            "print(round(time.time() - t0), round(time.monotonic() - m),"
            " round(datetime.datetime.now().timestamp() - t0),"
            " sqlite3.connect(':memory:').execute(\"select strftime('%s','now')\").fetchone()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(offset)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LD_PRELOAD": lib, "COLLAB_CLOCK_OFFSET_FILE": str(offset)})
    assert out.returncode == 0, out.stderr
    wall, mono, dt, sql = out.stdout.split()
    assert int(wall) in range(-600, -597) and int(dt) in range(-600, -597) and mono == "1"
    assert abs(int(sql) - (time.time() - 600)) < 30   # SQLite's own `now` is stepped too


def test_lock_holder_blocks_writers_not_readers(tmp_path):
    db = str(tmp_path / "x.db")
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    holder = subprocess.Popen([sys.executable, "-c", B.LOCK_SCRIPT, db, "5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        other = sqlite3.connect(db, timeout=0.2)
        assert other.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)   # WAL: readers go on
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("INSERT INTO t VALUES (1)")
        other.close()
    finally:
        holder.kill()
        holder.wait()


WRITER = ("import sys\n"
          "sys.stdin.readline()\n"
          "try:\n"
          "    open(sys.argv[1], 'wb').write(b'x' * 100000)\n"
          "    print('ok', flush=True)\n"
          "except OSError as e:\n"
          "    print(e.errno, flush=True)\n")


def _write_after_fill(disk, path):
    """A process that writes 100 kB to `path` once the disk was filled for it; its errno or 'ok'."""
    import errno

    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        detail = disk.fill(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        got = proc.stdout.readline().strip()
        disk.restore()
        return detail, {str(errno.ENOSPC): "ENOSPC", str(errno.EFBIG): "EFBIG"}.get(got, got)
    finally:
        proc.kill()
        proc.wait()


def test_full_disk_by_rlimit_fsize(tmp_path):
    """Where mount is refused: the trainer's RLIMIT_FSIZE, its writes fail with EFBIG (Python
    ignores SIGXFSZ), and restore lifts it."""
    disk = B.Disk(str(tmp_path / "disk"), 64, want_tmpfs=False)
    disk.mechanism = "rlimit_fsize"
    detail, got = _write_after_fill(disk, str(tmp_path / "disk" / "f"))
    assert got == "EFBIG" and detail["mechanism"] == "rlimit_fsize"
    with pytest.raises(RuntimeError, match="no trainer"):
        disk.fill(None)


def test_full_disk_by_tmpfs(tmp_path):
    disk = B.Disk(str(tmp_path / "disk"), 64, want_tmpfs=True)
    try:
        if disk.mechanism != "tmpfs":
            pytest.skip(f"no tmpfs here: {disk.why}")
        (tmp_path / "disk" / "before").write_bytes(b"y" * 50000)
        detail, got = _write_after_fill(disk, str(tmp_path / "disk" / "f"))
        assert got == "ENOSPC" and detail["free_bytes"] == 0, detail
        (tmp_path / "disk" / "after").write_bytes(b"y" * 200000)   # room again
    finally:
        disk.unmount()
    assert not os.path.ismount(tmp_path / "disk")


def test_trainer_pid_found_in_the_process_tree():
    tree = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time\n"
                             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', "
                             "'collab_app.cli', 'trainer'])\n"
                             "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(tree.stdout.readline())
        assert child in B.descendants(tree.pid)
        assert B.trainer_pid(tree.pid) == child
        assert B.trainer_pid(tree.pid, status_pid=child) == child
        assert B.trainer_pid(tree.pid, status_pid=os.getpid()) == child   # a pid outside serve's tree is ignored
    finally:
        for pid in B.descendants(tree.pid):
            os.kill(pid, 9)
        tree.kill()
        tree.wait()


def test_report_from_a_real_store(tmp_path):
    """Groups trained, set aside with a reason and left ready, ratings (one late) written through
    the Store, read back, and counted."""
    from collab_app.online.store import Store
    from helpers.store import make_group

    url = f"sqlite:///{tmp_path / 'collab.db'}"
    store = Store(url)
    gids, jids, rids = [], [], []
    for seed in range(3):
        gid, js, *_ = make_group(store, seed=seed, rewards=None)
        gids.append(gid)
        jids.append(js)
        rids.append(store.add_ratings([(j, 5.0 - k) for k, j in enumerate(js)], "session:sess-1",
                                      session_id="sess-1"))
    g4, js4, *_ = make_group(store, seed=4, rewards=None)   # one candidate rated, the other's rating refused
    gids.append(g4)
    rids.append(store.add_ratings([(js4[0], 4.0)], "session:sess-1", session_id="sess-1"))
    store.record_train_step(1, {}, [gids[0]])
    late = store.add_ratings([(jids[0][0], 2.0)], "session:sess-1", session_id="sess-1")   # after its step
    store.set_aside([gids[1]], "SafetensorError: I/O error: No space left on device (os error 28)")
    store.close()
    data = B._read_final(url)
    closed = {g["id"]: g for g in data["closed"]}
    assert set(closed) == {gids[1]} and "os error 28" in closed[gids[1]]["reason"]
    tally = B.Tally()
    tally.rounds = [{"t": 10.0 * k, "group_id": g} for k, g in enumerate(gids)]
    values = {r["id"]: r["value"] for r in data["ratings"]}
    tally.accepted = [{"id": i, "value": values[i], "answer": f"rating saved: #{i}"}
                      for ids in rids for i in ids] + [{"id": i, "value": 2.0, "answer": "x"} for i in late]
    res = B.report(B.BenchFaultsConfig(faults=["kill"], minutes=2, fault_every_min=1), tally, data, None,
                   [_fault("kill", 30.0, 30.0)], 120.0, 150.0)
    r = res["ratings"]
    assert r["lost"] == 0 and r["stored"] == r["accepted"]
    assert r["trained"] == len(rids[0]) and r["late"] == len(late)
    assert r["pending"] == len(rids[2]) + 1 and r["pending_unrated_sibling"] == 1
    assert r["not_trained"] == {"untrainable": len(rids[1])} and r["with_reason"] == len(rids[1])
    assert [g["id"] for g in res["closed_groups"]] == [gids[1]]
    assert res["faults"][0]["resumed"] is False and res["targets"]["groups_closed"]["pass"] is False
    res.update(mechanisms={"disk": None, "clock": None}, server={"starts": [], "exits": []}, loadavg_end=["1", "1", "1"],
               cpu="AVX2", error=None)
    text = B.table(res)
    assert "accepted" in text and "FAIL" in text and "os error 28" in text
    json.dumps(res, default=str)


# --------------------------------------------------------------------------- end to end

EXPECTED_KEYS = {"config", "rounds", "ratings", "refusals", "steps", "faults", "closed_groups", "trainer_states",
                 "trainer_status_end", "targets", "mechanisms", "startup_s", "error", "server", "loadavg_end", "cpu"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_faults_end_to_end(tmp_path, tiny_model_path, monkeypatch, capsys):
    """`collab bench faults --json` for a few minutes on the tiny base: the trainer child killed,
    then the store locked, against a real `collab serve`. What the app makes of the faults is the
    bench's finding, not under test here: the harness is (both faults made, every count adds up,
    a verdict per fault, the report's shape)."""
    from collab_app.commands.bench import cli_main

    monkeypatch.setenv("COLLAB_MODEL", tiny_model_path)
    out = tmp_path / "out"
    rc = cli_main(["faults", "--json", "--minutes", "1.5", "--fault-every-min", "0.6", "--faults", "kill,lock",
                   "--lock-s", "15", "--kill-wait-s", "20", "--engine", "transformers", "--max-new-tokens", "16",
                   "--num-generations", "2", "--raters", "1", "--think-s", "0.5", "--trainer-args", "--max-wait-s 5 --human-timeout-s 30",
                   "--drain-minutes", "0.5", "--round-timeout-s", "120", "--out-dir", str(out)])
    res = json.loads(capsys.readouterr().out)
    log = (out / "home" / "serve.log").read_text()[-3000:]
    assert rc == 0 and res["error"] is None, log
    assert EXPECTED_KEYS <= set(res) and (out / "bench_faults.json").exists()
    kill, lock = res["faults"]
    assert kill["fault"] == "kill" and kill["applied"] and kill["detail"]["pid"] > 0, kill
    assert lock["fault"] == "lock" and lock["applied"] and lock["end"] - lock["start"] >= 0.2, lock
    for f in (kill, lock):
        assert isinstance(f["resumed"], bool) and f["steps_after"] >= 0
    r = res["ratings"]
    assert r["accepted"] >= 1 and r["stored"] + r["lost"] == r["accepted"]
    assert r["stored"] == r["trained"] + r["late"] + r["pending"] + sum(r["not_trained"].values())
    assert res["rounds"]["answered"] >= 2 and res["steps"]["total"] >= 1, (res["rounds"], log)
    assert res["server"]["starts"] and all(t["pass"] in (True, False, None) for t in res["targets"].values())
