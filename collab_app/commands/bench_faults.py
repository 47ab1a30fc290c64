"""`collab bench faults`: does learning survive what the machine does to it?

Starts a real `collab serve` (bench_online.start_server: a subprocess with its own COLLAB_HOME under
--out-dir; the TL;DR task, G=4, 64 new tokens, K=2), scripted raters (bench_online's preferences,
one gradio_client session each) that generate and rate through the API for --minutes, and the
faults of --faults in that order, --fault-every-min minutes apart (each fault gets the same time
to show whether learning resumed):

- `disk`: the adapters' (or the store's and the adapters') file system full during a step (a tmpfs
  the bench mounts and remounts; without root, RLIMIT_FSIZE on the trainer child instead);
- `kill`: the trainer child SIGKILLed mid-step (serve restarts it);
- `lock`: another process holds the SQLite store's write lock longer than its busy timeout;
- `wipe`: serve stopped, the adapters folder deleted, serve started again on the same store;
- `clock`: the wall clock of serve and all its children steps by --clock-step-s, live (an
  LD_PRELOAD shim, CLOCK_SHIM_C, compiled with the system's `cc`);
- `truncate`: serve stopped, the newest adapter's weights cut to half, serve started again.

Reported (JSON, and a table unless --json): ratings accepted, stored, lost, trained, late, not
trained with or without a reason, pending (target: 0 lost, 0 unexplained); every train step; per
fault whether a step after its end trained a group generated after it (`resumed`, target: within
RESUME_STEPS steps) and how long that took; groups set aside or expired (target: 0).

    collab bench faults [--minutes 30 --fault-every-min 4 --faults disk,kill,lock,wipe,clock,truncate --json]

Each fault's mechanism, each count's definition and the bench's limits: docs/BENCHES.md.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

FAULTS = ("disk", "kill", "lock", "wipe", "clock", "truncate")
RESUME_STEPS = 2            # the target: learning resumes within this many steps after a fault
MAX_CRASH_RESTARTS = 3      # serve exiting on its own this often in a row: the bench stops restarting it
BACKOFF_S = 2.0             # a rater after a failed call
RATE_TRIES = 3              # a rating the server refused ("nothing was saved") is tried again, as a person would
OFFSET_FILE = "clock-offset"
LATE_WORDS = re.compile(r"\blate\b|not (be )?train|never train|won't train|will not train", re.I)


@dataclass
class BenchFaultsConfig:
    minutes: float = 30.0
    """how long the raters rate at least (wall clock, after the server is up; longer where the faults need it)."""
    fault_every_min: float = 4.0
    """minutes from the raters' start to the first fault, from each fault's end to the next, and from the last one's end to the raters' stop."""
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    """the faults, in order, one per slot: disk kill lock wipe clock truncate (comma- or space-separated; module doc)."""
    raters: int = 2
    """scripted raters, each its own session, taking turns (one round each)."""
    preference: str = "short"
    """what every rater prefers (bench_online's forms: short | short:LO-HI | long | word:W | nodigits)."""
    think_s: float = 3.0
    """seconds a rater reads a round before rating it (a person's pace; 0 = rounds back to back, the trainer then gets only what the engine leaves)."""
    engine: str = "auto"
    """serving engine of the `collab serve` it starts (auto | vllm | transformers)."""
    num_generations: int = 4
    """G of the server: candidates per round."""
    max_new_tokens: int = 64
    """new tokens per agent answer."""
    min_groups: int = 2
    """K of the child trainer: a step per K rated groups."""
    trainer_args: str = "--max-wait-s 30 --human-timeout-s 120"
    """more `collab trainer` flags for the server's child trainer (one quoted string; a group whose rating was refused or unanswered trains on its automatic reward after the human timeout, within the drain)."""
    serve_args: str = ""
    """more `collab serve` flags (one quoted string)."""
    disk_full_s: float = 90.0
    """`disk`: seconds the full file system stays full."""
    full_disk_holds: Literal["adapters", "store_and_adapters"] = "adapters"
    """`disk`: what lives on the file system that fills: the adapters (a store elsewhere, as PostgreSQL by COLLAB_DB: the trainer's save fails, the store works) or the SQLite store too (every write of the app fails)."""
    lock_s: float = 40.0
    """`lock`: seconds another process holds the store's write lock."""
    clock_step_s: float = -600.0
    """`clock`: the step of the app's wall clock, in seconds (-600: ten minutes back)."""
    kill_wait_s: float = 120.0
    """`kill` and `disk`: wait at most this long for a step under way, then make the fault anyway (the report's mid_step says which)."""
    tmpfs_mb: int = 2048
    """`disk`: size of the tmpfs that holds the store and the adapters (used as filled; RAM)."""
    drain_minutes: float = 3.0
    """after the raters stop, wait at most this long for the groups they rated to train."""
    poll_s: float = 2.0
    """the bench reads the store's steps and trainer status this often."""
    round_timeout_s: float = 300.0
    """a call (generate or rate) waits at most this long for its answer (then: unanswered)."""
    startup_timeout_s: float = 900.0
    """a start of the server (model load, engine build) may take this long."""
    out_dir: str = "bench-faults"
    """where the server's home, its logs and bench_faults.json go (must not hold a home/ already)."""
    port: int = 0
    """server port (0 = a free one)."""

    def __post_init__(self):
        from collab_app.commands.bench_online import preference

        self.faults = [f.strip() for item in self.faults for f in item.split(",") if f.strip()]
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}: use {', '.join(FAULTS)}")
        preference(self.preference)   # raises with the valid forms
        if self.minutes <= 0 or self.fault_every_min <= 0:
            raise ValueError(f"--minutes and --fault-every-min must be > 0, got {self.minutes}, {self.fault_every_min}")
        if self.faults and len(self.faults) * self.fault_every_min >= self.minutes:
            raise ValueError(f"{len(self.faults)} faults every {self.fault_every_min} min need --minutes > "
                             f"{len(self.faults) * self.fault_every_min:g} (the last fault starts at that minute "
                             f"at the earliest and needs time after it to show whether learning resumed)")
        if self.raters < 1 or self.num_generations < 2 or self.min_groups < 1 or self.max_new_tokens < 1 or self.think_s < 0:
            raise ValueError("need raters >= 1, num_generations >= 2, min_groups >= 1, max_new_tokens >= 1, think_s >= 0")
        if self.disk_full_s <= 0 or self.lock_s <= 0 or self.kill_wait_s < 0 or self.clock_step_s == 0:
            raise ValueError("need disk_full_s > 0, lock_s > 0, kill_wait_s >= 0 and clock_step_s != 0")
        if self.tmpfs_mb < 64 or self.drain_minutes < 0 or self.poll_s <= 0 or self.round_timeout_s <= 0:
            raise ValueError("need tmpfs_mb >= 64, drain_minutes >= 0, poll_s > 0 and round_timeout_s > 0")


# --------------------------------------------------------------------------- the report's math

def rating_accounts(accepted: list[dict], refused: int, unanswered: int, ratings: list[dict],
                    groups: list[dict]) -> dict:
    """Accepted ratings ({id, value, answer}; id None where the answer named none) against the
    store's rows ({id, value, late, group_id}) and groups ({id, status, status_reason, unrated: how
    many of its candidates nobody rated}): lost, trained, late, not trained with or without a
    reason, pending (of which in a group with an unrated candidate: it waits for that rating or the
    trainer's human timeout) (module doc)."""
    rows = {r["id"]: r for r in ratings}
    group = {g["id"]: g for g in groups}
    out = {"accepted": len(accepted), "stored": 0, "lost": 0, "lost_ids": [], "refused": refused,
           "unanswered": unanswered, "trained": 0, "late": 0, "late_told": 0, "pending": 0, "pending_unrated_sibling": 0,
           "not_trained": {}, "with_reason": 0, "without_reason": 0}
    for a in accepted:
        row = rows.get(a.get("id"))
        if row is None or abs(float(row["value"]) - float(a["value"])) > 1e-9:
            out["lost"] += 1
            out["lost_ids"].append(a.get("id"))
            continue
        out["stored"] += 1
        if row.get("late"):
            out["late"] += 1
            out["late_told"] += bool(LATE_WORDS.search(a.get("answer") or ""))
            continue
        g = group.get(row["group_id"]) or {"status": "missing"}
        if g["status"] == "trained":
            out["trained"] += 1
        elif g["status"] in ("open", "ready"):
            out["pending"] += 1
            out["pending_unrated_sibling"] += bool(g.get("unrated"))
        else:
            out["not_trained"][g["status"]] = out["not_trained"].get(g["status"], 0) + 1
            out["with_reason" if g.get("status_reason") else "without_reason"] += 1
    out["lost_ids"] = out["lost_ids"][:20]
    out["unexplained"] = out["pending"] + out["without_reason"]
    return out


def fault_outcomes(faults: list[dict], steps: list[dict], generated: dict[int, float], t_stop: float) -> list[dict]:
    """Fill in, per fault ({fault, applied, start, end, ...}; times in seconds from the raters'
    start), what the steps seen after it say (module doc). `steps`: [{t, group_ids}] by the bench's
    clock; `generated`: {group id: when the raters got it}; `t_stop`: the end of the observation
    (the drain's end). A fault not applied gets None for every verdict."""
    out = []
    for i, f in enumerate(faults):
        f = dict(f)
        nxt = next((g for g in faults[i + 1:] if g.get("start") is not None or g.get("scheduled") is not None), None)
        window_end = t_stop if nxt is None else (nxt["start"] if nxt.get("start") is not None else nxt["scheduled"])
        f["window_end"] = window_end
        if not f.get("applied") or f.get("end") is None:   # applied, never ended (serve never came back): not resumed
            f.update(steps_during=None, steps_after=None, minutes_to_next_step=None,
                     resumed=False if f.get("applied") else None, steps_to_resume=None, minutes_to_resume=None)
            out.append(f)
            continue
        end = f["end"]
        after = sorted((s for s in steps if end < s["t"] <= window_end), key=lambda s: s["t"])
        f["steps_during"] = sum(1 for s in steps if f["start"] <= s["t"] <= end)
        f["steps_after"] = len(after)
        f["minutes_to_next_step"] = (after[0]["t"] - end) / 60 if after else None
        k = next((k for k, s in enumerate(after, 1)
                  if any(generated.get(g, -1.0) > end for g in s["group_ids"])), None)
        f["resumed"] = k is not None
        f["steps_to_resume"] = k
        f["minutes_to_resume"] = (after[k - 1]["t"] - end) / 60 if k else None
        out.append(f)
    return out


def targets(accounts: dict, faults: list[dict], closed: list[dict]) -> dict:
    """The issue's targets (module doc); `pass` None where the run gave nothing to judge."""
    judged = [f for f in faults if f.get("resumed") is not None]
    met = [f for f in judged if f["resumed"] and f["steps_to_resume"] <= RESUME_STEPS]
    return {"accepted_ratings_lost": {"value": accounts["lost"], "target": "0", "pass": accounts["lost"] == 0},
            "untrained_unexplained": {"value": accounts["unexplained"], "target": "0 (pending + no reason)",
                                      "pass": accounts["unexplained"] == 0},
            "learning_resumed": {"value": f"{len(met)} of {len(judged)}",
                                 "target": f"every fault, within {RESUME_STEPS} steps after its end",
                                 "pass": None if not judged else len(met) == len(judged)},
            "groups_closed": {"value": len(closed), "target": "0 set aside or expired", "pass": not closed}}


# --------------------------------------------------------------------------- the server and its processes

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def trainer_pid(serve_pid: int, status_pid: int | None = None) -> int | None:
    """The trainer child of serve: the status row's pid if it is serve's descendant, else the
    descendant running `collab_app.cli trainer` (the outermost one)."""
    below = descendants(serve_pid)
    if status_pid and status_pid in below:
        return status_pid
    for pid in below:   # parents come before their children
        argv = _cmdline(pid)
        if "collab_app.cli" in argv and "trainer" in argv:
            return pid
    return None


class Server:
    """The bench's `collab serve`: started, stopped and started again on the same home; each start
    is an incarnation (raters reconnect), each log kept (serve.log, serve.1.log, ...)."""

    def __init__(self, cfg: BenchFaultsConfig, home: str, port: int, extra: list[str], env: dict[str, str]):
        self.cfg, self.home, self.port, self.extra, self.env = cfg, home, port, extra, env
        self.url = f"http://127.0.0.1:{port}/"
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.up = threading.Event()
        self.lock = threading.RLock()
        self.starts: list[dict] = []
        self.exits: list[dict] = []

    def start(self, t0: float) -> float:
        """Start serve and wait until it answers; returns the seconds that took. A start that
        fails (serve exits, or does not answer in time) is listed in `exits` and raises."""
        from collab_app.commands.bench_abuse import wait_up
        from collab_app.commands.bench_online import start_server, stop_server

        with self.lock:
            logf = os.path.join(self.home, "serve.log")
            if os.path.exists(logf):
                os.rename(logf, os.path.join(self.home, f"serve.{len(self.starts) + len(self.exits)}.log"))
            t = time.time()
            self.proc = start_server(self.cfg, self.home, self.port, *self.extra, env=self.env)
            try:
                wait_up(self.url, self.proc, self.cfg.startup_timeout_s)
            except Exception:
                stop_server(self.proc)
                self.exits.append({"t": time.time() - t0, "rc": self.proc.returncode, "at_start": True,
                                   "log_tail": self.log_tail(600)})
                raise
            self.incarnation += 1
            self.starts.append({"t": t - t0, "ready_s": time.time() - t})
            self.up.set()
            return time.time() - t

    def bring_back(self, t0: float, crashes: list, stop_early: threading.Event) -> bool:
        """Start serve again after it exited on its own or failed to start (a supervisor's restart:
        module doc), at most MAX_CRASH_RESTARTS exits in a row; False (and `stop_early` set) after that."""
        while len(crashes) <= MAX_CRASH_RESTARTS:
            try:
                self.start(t0)
                return True
            except Exception as e:  # noqa: BLE001 - counted, tried again
                crashes.append(time.time())
                log.error("serve did not start again (%d in a row): %s", len(crashes), e)
                time.sleep(2.0)
        log.error("serve exited %d times in a row; the bench does not start it again", len(crashes))
        stop_early.set()
        return False

    def stop(self) -> None:
        from collab_app.commands.bench_online import stop_server

        with self.lock:
            self.up.clear()
            if self.proc is not None:
                stop_server(self.proc)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.home, "serve.log"), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


# --------------------------------------------------------------------------- the store, read while it runs

def _ro(db_path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)


def read_status(db_path: str) -> dict:
    """The trainer status row (app_state "trainer_status"), {} where there is none yet."""
    try:
        con = _ro(db_path)
        try:
            row = con.execute("SELECT value FROM app_state WHERE key = 'trainer_status'").fetchone()
        finally:
            con.close()
        return json.loads(row[0]) if row and row[0] else {}
    except (sqlite3.Error, ValueError):
        return {}


class Monitor(threading.Thread):
    """Polls the store: each new train_steps row (by the bench's clock when first seen) and each
    change of the trainer status (state, pid, message)."""

    def __init__(self, db_path: str, t0: float, poll_s: float):
        super().__init__(name="bench-faults-monitor", daemon=True)
        self.db_path, self.t0, self.poll_s = db_path, t0, poll_s
        self.stop = threading.Event()
        self.steps: list[dict] = []
        self.states: list[dict] = []
        self.read_errors = 0
        self._last_id = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(self.poll_s)

    def poll(self) -> None:
        try:
            con = _ro(self.db_path)
            try:
                rows = con.execute("SELECT id, step, group_ids FROM train_steps WHERE id > ? ORDER BY id",
                                   (self._last_id,)).fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            self.read_errors += 1
            return
        now = time.time() - self.t0
        for id_, step, gids in rows:
            self._last_id = id_
            self.steps.append({"t": now, "id": id_, "step": step, "group_ids": json.loads(gids or "[]")})
            log.info("step %s seen at %.1f min (%d groups)", step, now / 60, len(self.steps[-1]["group_ids"]))
        st = read_status(self.db_path)
        key = (st.get("state"), st.get("pid"), str(st.get("message") or "")[:200])
        if st and (not self.states or self.states[-1]["key"] != key):
            self.states.append({"t": now, "key": key, "state": key[0], "pid": key[1], "message": key[2]})


# --------------------------------------------------------------------------- the raters

@dataclass
class Tally:
    rounds: list[dict] = field(default_factory=list)
    accepted: list[dict] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)
    unanswered: list[dict] = field(default_factory=list)
    generate_failed: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _kind(exc: BaseException) -> str:
    from collab_app.commands.bench_abuse import refusal

    return refusal(exc)[0]


def _client(server: Server, stop: threading.Event):
    """A gradio_client of the server's current incarnation, once it is up (None when stopped first)."""
    from gradio_client import Client

    while not stop.is_set():
        if server.up.wait(1.0):
            try:
                return Client(server.url, verbose=False, analytics_enabled=False, download_files=False), server.incarnation
            except Exception as e:  # noqa: BLE001 - restarting: try again
                log.debug("no client yet: %s", e)
        stop.wait(1.0)
    return None, -1


def _call(client, timeout_s: float, **kw):
    """predict, with an answer gradio_client lost tried again (bench_online.api_call's rule)."""
    from concurrent.futures import CancelledError

    from collab_app.commands.bench_online import API_RETRIES, predict

    lost = 0
    while True:
        try:
            return predict(client, timeout_s=timeout_s, **kw)
        except CancelledError:
            lost += 1
            if lost > API_RETRIES:
                raise


def rater_loop(raters: list, server: Server, texts: list[str], tally: Tally, stop: threading.Event,
               cfg: BenchFaultsConfig, t0: float) -> None:
    """The raters take turns (one round each) until `stop`: generate, rate every candidate; every
    outcome counted. A failed call (a restart, a full disk, a lock) is waited out and the round
    given up; a rater reconnects when serve's incarnation changes or its connection failed."""
    from gradio_client.exceptions import AppError

    clients: list = [(None, -1)] * len(raters)
    k = 0
    while not stop.is_set():
        i = k % len(raters)
        client, inc = clients[i]
        if client is None or inc != server.incarnation:
            client, inc = clients[i] = _client(server, stop)
            if client is None:
                return
        try:
            out = _call(client, cfg.round_timeout_s, task="tldr", text=texts[k % len(texts)], api_name="/generate")
        except Exception as e:  # noqa: BLE001 - every failure is a counted outcome
            kind = "app_error" if isinstance(e, AppError) else _kind(e)
            tally.generate_failed[kind] += 1
            log.info("rater %d: generate failed (%s): %s", i, kind, str(e)[:160])
            if not isinstance(e, AppError):
                clients[i] = (None, -1)
            stop.wait(BACKOFF_S)
            k += 1
            continue
        k += 1
        t_gen = time.time() - t0
        with tally.lock:
            tally.rounds.append({"t": t_gen, "rater": i, "group_id": out["group_id"], "candidates": len(out["candidates"])})
        time.sleep(cfg.think_s)   # reading, even past the end: its ratings are still given
        for c in out["candidates"]:
            value = raters[i](c["combined"])
            msg = None
            for _ in range(RATE_TRIES):
                try:
                    msg = _call(client, cfg.round_timeout_s, joint_sample_id=c["joint_sample_id"], rating=value,
                                api_name="/rate")
                    break
                except AppError as e:   # the server said no: the person sees it was not saved, and tries again
                    with tally.lock:
                        tally.refused.append({"t": time.time() - t0, "message": str(e)[:300]})
                    stop.wait(BACKOFF_S)
                except Exception as e:  # noqa: BLE001 - no answer: the person sees an error (its page is gone)
                    with tally.lock:
                        tally.unanswered.append({"t": time.time() - t0, "kind": _kind(e), "message": str(e)[:200]})
                    clients[i] = (None, -1)
                    break
            if clients[i][0] is None:
                break
            if msg is None:
                continue
            ids = re.findall(r"#(\d+)", str(msg))
            with tally.lock:
                tally.accepted.append({"id": int(ids[0]) if ids else None, "value": float(value),
                                       "group_id": out["group_id"], "joint_sample_id": c["joint_sample_id"],
                                       "t": time.time() - t0, "answer": str(msg)[:300]})


# --------------------------------------------------------------------------- the faults

CLOCK_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_t)(clockid_t, struct timespec *);
static clock_gettime_t real_clock_gettime;
static volatile long long offset_ns, next_read_ns;

static long long offset(void) {   /* seconds in $COLLAB_CLOCK_OFFSET_FILE, re-read once a second */
    struct timespec m;
    real_clock_gettime(CLOCK_MONOTONIC_COARSE, &m);
    long long now = m.tv_sec * 1000000000LL + m.tv_nsec;
    if (now >= next_read_ns) {
        next_read_ns = now + 1000000000LL;
        const char *path = getenv("COLLAB_CLOCK_OFFSET_FILE");
        int fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        if (fd >= 0) {
            char buf[64];
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) { buf[n] = 0; offset_ns = (long long)(strtod(buf, NULL) * 1e9); }
        }
    }
    return offset_ns;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    if (!real_clock_gettime) real_clock_gettime = (clock_gettime_t)dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_clock_gettime(clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        long long t = ts->tv_sec * 1000000000LL + ts->tv_nsec + offset();
        ts->tv_sec = t / 1000000000LL;
        ts->tv_nsec = t % 1000000000LL;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""


def build_clock_shim(out_dir: str) -> tuple[str | None, str]:
    """(path of the compiled shim, "") or (None, why not)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) to build the clock shim"
    src, lib = os.path.join(out_dir, "clockshim.c"), os.path.join(out_dir, "clockshim.so")
    with open(src, "w") as f:
        f.write(CLOCK_SHIM_C)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], capture_output=True, text=True)
    if r.returncode:
        return None, f"cc failed: {r.stderr[-300:]}"
    return lib, ""


class Disk:
    """The store's and adapters' file system (module doc, `disk`): a tmpfs at `path` where mount
    works, else a plain folder (and `fill` limits the trainer's RLIMIT_FSIZE)."""

    def __init__(self, path: str, size_mb: int, want_tmpfs: bool):
        self.path, self.size_mb = path, size_mb
        os.makedirs(path, exist_ok=False)
        self.mechanism = "none"
        self.why = ""
        if want_tmpfs:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", path],
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.mechanism = "tmpfs"
            else:
                self.mechanism = "rlimit_fsize"
                self.why = f"mount refused ({(r.stderr or r.stdout).strip()[:200]}): the trainer's RLIMIT_FSIZE instead"
        self._limited: int | None = None
        self._soft = 0

    def fill(self, trainer: int | None) -> dict:
        """Make it full; returns the detail for the report. Raises if it could not."""
        if self.mechanism == "tmpfs":
            for _ in range(20):   # a write between the statvfs and the remount: take the new size
                st = os.statvfs(self.path)
                used = (st.f_blocks - st.f_bfree) * st.f_frsize
                r = subprocess.run(["mount", "-o", f"remount,size={max(used, 4096)}", self.path],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    st = os.statvfs(self.path)
                    return {"mechanism": "tmpfs", "used_mb": round(used / 2**20, 1),
                            "free_bytes": st.f_bavail * st.f_frsize}
                time.sleep(0.05)
            raise RuntimeError(f"remount to the used size failed: {r.stderr.strip()[:200]}")
        if trainer is None:
            raise RuntimeError("no trainer child to limit (RLIMIT_FSIZE)")
        import resource

        soft, hard = resource.prlimit(trainer, resource.RLIMIT_FSIZE)
        resource.prlimit(trainer, resource.RLIMIT_FSIZE, (1, hard))   # the soft limit: restore may raise it again
        self._limited, self._soft = trainer, soft
        return {"mechanism": "rlimit_fsize", "pid": trainer, "note": self.why}

    def restore(self) -> None:
        if self.mechanism == "tmpfs":
            subprocess.run(["mount", "-o", f"remount,size={self.size_mb}m", self.path], check=True,
                           capture_output=True)
        elif self._limited is not None:
            import resource

            try:
                hard = resource.prlimit(self._limited, resource.RLIMIT_FSIZE)[1]
                resource.prlimit(self._limited, resource.RLIMIT_FSIZE, (self._soft, hard))
            except ProcessLookupError:
                pass   # it died meanwhile; its successor starts without the limit
            self._limited = None

    def unmount(self) -> None:
        if self.mechanism == "tmpfs":
            r = subprocess.run(["umount", self.path], capture_output=True, text=True)
            if r.returncode:
                subprocess.run(["umount", "-l", self.path], capture_output=True)
            self.mechanism = "unmounted"


LOCK_SCRIPT = ("import sqlite3, sys, time\n"
               "c = sqlite3.connect(sys.argv[1], timeout=120, isolation_level=None)\n"
               "c.execute('BEGIN EXCLUSIVE')\n"
               "print('locked', flush=True)\n"
               "time.sleep(float(sys.argv[2]))\n"
               "c.execute('ROLLBACK')\n")


class Faults:
    """The injectors: each returns {"start", "end", "detail"} (seconds from t0) or raises (then
    the fault counts as not applied, with the error)."""

    def __init__(self, cfg: BenchFaultsConfig, server: Server, disk: Disk, db_path: str, adapters: str,
                 offset_file: str | None, t0: float, stop_early: threading.Event):
        self.cfg, self.server, self.disk, self.db_path, self.adapters = cfg, server, disk, db_path, adapters
        self.offset_file, self.t0, self.stop_early = offset_file, t0, stop_early
        self.clock_offset = 0.0

    def now(self) -> float:
        return time.time() - self.t0

    def _trainer(self) -> int | None:
        proc = self.server.proc
        return trainer_pid(proc.pid, read_status(self.db_path).get("pid")) if proc and proc.poll() is None else None

    def _wait_training(self) -> tuple[bool, dict]:
        """Wait (at most --kill-wait-s) until the trainer status says a step is under way."""
        deadline = time.monotonic() + self.cfg.kill_wait_s
        while True:
            st = read_status(self.db_path)
            if st.get("state") == "training" or time.monotonic() >= deadline:
                return st.get("state") == "training", st
            time.sleep(0.2)

    def disk_fault(self) -> dict:
        mid_step, st = self._wait_training()   # a step's save is what a full disk meets first
        start = self.now()
        detail = self.disk.fill(self._trainer())
        try:
            time.sleep(self.cfg.disk_full_s)
        finally:
            self.disk.restore()
        return {"start": start, "end": self.now(),
                "detail": {**detail, "mid_step": mid_step, "step": st.get("step") if mid_step else None}}

    def kill(self) -> dict:
        mid_step, _ = self._wait_training()
        pid = self._trainer()
        if pid is None:
            raise RuntimeError("no trainer child found under serve")
        st = read_status(self.db_path)
        os.kill(pid, signal.SIGKILL)
        t = self.now()
        return {"start": t, "end": t, "detail": {"pid": pid, "mid_step": mid_step and st.get("state") == "training",
                                                 "step": st.get("step"), "state_at_kill": st.get("state")}}

    def lock(self) -> dict:
        holder = subprocess.Popen([sys.executable, "-c", LOCK_SCRIPT, self.db_path, str(self.cfg.lock_s)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([holder.stdout], [], [], 150)
            if not ready or holder.stdout.readline().strip() != "locked":
                raise RuntimeError(f"the lock holder did not get the write lock: {holder.stderr.read()[-300:] if holder.poll() is not None else 'timed out'}")
            start = self.now()
            holder.wait(self.cfg.lock_s + 60)
            return {"start": start, "end": self.now(), "detail": {"held_s": self.cfg.lock_s, "kind": "BEGIN EXCLUSIVE"}}
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()

    def _restart(self, damage) -> dict:
        """Stop serve, do the damage, start serve again; the fault ends when it answers (end None
        when it never does: serve_down says why)."""
        start = self.now()
        self.server.stop()
        detail = damage()
        crashes: list = []
        if not self.server.bring_back(self.t0, crashes, self.stop_early):
            return {"start": start, "end": None, "detail": {**detail, "server_down": self.server.exits[-1:]}}
        return {"start": start, "end": self.now(),
                "detail": {**detail, "startup_s": round(self.server.starts[-1]["ready_s"], 1),
                           "failed_starts": len(crashes)}}

    def wipe(self) -> dict:
        def damage():
            n = sum(len(files) for _, _, files in os.walk(self.adapters))
            shutil.rmtree(self.adapters, ignore_errors=True)
            return {"files_removed": n}
        return self._restart(damage)

    def truncate(self) -> dict:
        def damage():
            from trainer.adapters import latest_version

            found = []
            for agent in sorted(os.listdir(self.adapters)) if os.path.isdir(self.adapters) else []:
                lv = latest_version(self.adapters, agent)
                if lv:
                    found.append((lv[0], os.path.getmtime(lv[1]), lv[1]))
            if not found:
                raise RuntimeError("no adapter version on disk to truncate")
            path = os.path.join(max(found)[2], "adapter_model.safetensors")
            size = os.path.getsize(path)
            os.truncate(path, size // 2)
            return {"file": os.path.relpath(path, self.adapters), "bytes_before": size, "bytes_after": size // 2}
        return self._restart(damage)

    def clock(self) -> dict:
        if not self.offset_file:
            raise RuntimeError("no clock shim (see mechanisms.clock)")
        self.clock_offset += self.cfg.clock_step_s
        start = self.now()
        with open(self.offset_file, "w") as f:
            f.write(f"{self.clock_offset}\n")
        time.sleep(1.5)   # the shim re-reads the file once a second
        return {"start": start, "end": self.now(), "detail": {"step_s": self.cfg.clock_step_s,
                                                              "offset_s": self.clock_offset}}

    def inject(self, name: str) -> dict:
        return {"disk": self.disk_fault, "kill": self.kill, "lock": self.lock, "wipe": self.wipe,
                "clock": self.clock, "truncate": self.truncate}[name]()


# --------------------------------------------------------------------------- the run

def _read_final(db_url: str) -> dict:
    """What the report needs from the store after the run: bench_abuse.read_store's ratings (late
    flag, group), groups (status) and steps, plus each group's status_reason where the store has
    the column (Store.closed_groups where it exists) and the trainer's status row."""
    import sqlalchemy as sa

    from collab_app.commands.bench_abuse import read_store

    data = read_store(db_url)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as c:
            cols = {col["name"] for col in sa.inspect(c).get_columns("groups")}
            if "status_reason" in cols:
                reasons = dict(c.execute(sa.text("SELECT id, status_reason FROM groups")).fetchall())
                for g in data["groups"]:
                    g["status_reason"] = reasons.get(g["id"])
            unrated = dict(c.execute(sa.text(
                "SELECT j.group_id, COUNT(*) FROM joint_samples j WHERE NOT EXISTS "
                "(SELECT 1 FROM ratings r WHERE r.joint_sample_id = j.id) GROUP BY j.group_id")).fetchall())
            for g in data["groups"]:
                g["unrated"] = int(unrated.get(g["id"], 0))
            row = c.execute(sa.text("SELECT value FROM app_state WHERE key = 'trainer_status'")).fetchone()
            status = row[0] if row else {}
            data["trainer_status"] = json.loads(status) if isinstance(status, str) else (status or {})
    finally:
        engine.dispose()
    data["closed"] = None
    try:
        from collab_app.online.store import Store

        if hasattr(Store, "closed_groups"):
            store = Store(db_url)
            try:
                data["closed"] = [{k: (str(v) if k == "created_at" else v) for k, v in g.items()}
                                  for g in store.closed_groups(limit=100_000)]
            finally:
                store.close()
    except Exception as e:  # noqa: BLE001 - a store mid-change elsewhere: the SQL above suffices
        log.warning("Store.closed_groups failed (%s); reasons from SQL", e)
    if data["closed"] is None:
        data["closed"] = [{"id": g["id"], "status": g["status"], "reason": g.get("status_reason")}
                          for g in data["groups"] if g["status"] in ("untrainable", "expired")]
    return data


def _copy_db(src: str, dst: str) -> None:
    a, b = sqlite3.connect(src, timeout=30), sqlite3.connect(dst)
    try:
        a.backup(b)
    finally:
        a.close()
        b.close()


def _wait_until(t_abs: float, server: Server, t0: float, crashes: list, stop_early: threading.Event) -> None:
    """Sleep until `t_abs` (unix), starting serve again where it exited on its own (module doc)."""
    while time.time() < t_abs and not stop_early.is_set():
        proc = server.proc
        if server.up.is_set() and proc is not None and proc.poll() is not None:
            server.up.clear()
            tail = server.log_tail(600)
            server.exits.append({"t": time.time() - t0, "rc": proc.returncode, "at_start": False, "log_tail": tail})
            log.error("serve exited on its own (code %s): %s", proc.returncode, tail[-300:])
            crashes.append(time.time())
            server.bring_back(t0, crashes, stop_early)
        elif crashes and server.up.is_set() and time.time() - t0 - server.starts[-1]["t"] > 120:
            crashes.clear()   # up for 2 minutes: a later exit starts a new count
        time.sleep(min(1.0, max(0.0, t_abs - time.time())))


def run(cfg: BenchFaultsConfig) -> dict:
    from collab_app.commands.bench_online import free_port, preference
    from tasks import load_task

    out_dir = os.path.abspath(cfg.out_dir)
    home = os.path.join(out_dir, "home")
    os.makedirs(home, exist_ok=False)   # a fresh store: the counts are this run's
    disk = Disk(os.path.join(home, "disk"), cfg.tmpfs_mb, want_tmpfs="disk" in cfg.faults)
    db_path = os.path.join(disk.path if cfg.full_disk_holds == "store_and_adapters" else home, "collab.db")
    adapters = os.path.join(disk.path, "adapters")
    env: dict[str, str] = {}
    mechanisms = {"disk": disk.mechanism if "disk" in cfg.faults else None, "disk_note": disk.why or None,
                  "full_disk_holds": cfg.full_disk_holds if "disk" in cfg.faults else None,
                  "clock": None, "lock": "BEGIN EXCLUSIVE in another process (WAL: readers go on)"}
    offset_file = None
    if "clock" in cfg.faults:
        lib, why = build_clock_shim(out_dir)
        if lib:
            offset_file = os.path.join(out_dir, OFFSET_FILE)
            with open(offset_file, "w") as f:
                f.write("0\n")
            env.update(LD_PRELOAD=lib, COLLAB_CLOCK_OFFSET_FILE=offset_file)
            mechanisms["clock"] = "LD_PRELOAD shim on serve and its children (clock_gettime REALTIME, gettimeofday, time)"
        else:
            mechanisms["clock"] = f"not available: {why}"
    port = cfg.port or free_port()
    # argparse keeps the last --db / --adapters-dir: the adapters (and the store) go on `disk`, the log stays in home
    server = Server(cfg, home, port, ["--db", f"sqlite:///{db_path}", "--adapters-dir", adapters], env)
    texts = [ex["text"] for ex in load_task("tldr").examples("train")]
    tally = Tally()
    stop, stop_early = threading.Event(), threading.Event()
    faults: list[dict] = []
    crashes: list[float] = []
    error = startup_s = None
    t0 = t_raters_end = t_stop = time.time()
    monitor = None
    rater = None
    try:
        t_up = time.time()
        server.start(t_up)
        startup_s = time.time() - t_up
        t0 = time.time()
        server.starts[0]["t"] = 0.0
        monitor = Monitor(db_path, t0, cfg.poll_s)
        monitor.start()
        rater = threading.Thread(target=rater_loop, args=([preference(cfg.preference)] * cfg.raters, server, texts,
                                                          tally, stop, cfg, t0), name="bench-faults-raters", daemon=True)
        rater.start()
        log.info("server up in %.0f s; raters for %.1f min, faults %s every %.1f min", startup_s, cfg.minutes,
                 cfg.faults, cfg.fault_every_min)
        injector = Faults(cfg, server, disk, db_path, adapters, offset_file, t0, stop_early)
        due = t0 + 60 * cfg.fault_every_min
        for i, name in enumerate(cfg.faults):
            _wait_until(due, server, t0, crashes, stop_early)
            rec: dict = {"fault": name, "scheduled": due - t0, "applied": False, "start": None, "end": None,
                         "error": None}
            if stop_early.is_set():
                rec["error"] = "serve is down (it kept exiting): not injected"
            else:
                log.info("fault %d: %s", i + 1, name)
                try:
                    rec.update(injector.inject(name), applied=True)
                except Exception as e:  # noqa: BLE001 - a fault that could not be made is reported, not fatal
                    rec["error"] = f"{type(e).__name__}: {e}"
                    log.error("fault %s not applied: %s", name, rec["error"])
            log.info("fault %s: %s", name, {k: rec.get(k) for k in ("applied", "start", "end", "detail", "error")})
            faults.append(rec)
            due = time.time() + 60 * cfg.fault_every_min   # every fault gets the same time after it
        _wait_until(max(t0 + 60 * cfg.minutes, due), server, t0, crashes, stop_early)
    except Exception as e:  # noqa: BLE001 - a dead server is a result too: report what came before
        error = f"{type(e).__name__}: {e}"
        log.error("bench stopped: %s", error)
    finally:
        t_raters_end = time.time() - t0
        stop.set()
        if rater is not None:
            rater.join(cfg.round_timeout_s + 30)
        try:
            if error is None and not stop_early.is_set():
                _drain(cfg, db_path, tally, server, t0, crashes, stop_early)
        finally:
            t_stop = time.time() - t0
            if monitor is not None:
                monitor.poll()
                monitor.stop.set()
                monitor.join(10)
            server.stop()
            if disk.mechanism == "tmpfs":
                disk.restore()
            final_db = os.path.join(home, "collab.db")
            try:
                if db_path != final_db and os.path.exists(db_path):
                    _copy_db(db_path, final_db)
            except sqlite3.Error as e:
                log.error("could not copy the store out of %s: %s", disk.path, e)
            finally:
                disk.unmount()
    result = report(cfg, tally, _read_final(f"sqlite:///{final_db}") if os.path.exists(final_db) else None,
                    monitor, faults, t_raters_end, t_stop)
    result.update(mechanisms=mechanisms, startup_s=startup_s, error=error,
                  server={"starts": server.starts, "exits": server.exits},
                  loadavg_end=open("/proc/loadavg").read().split()[:3], cpu=_cpu())
    with open(os.path.join(out_dir, "bench_faults.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def _drain(cfg: BenchFaultsConfig, db_path: str, tally: Tally, server: Server, t0: float, crashes: list,
           stop_early: threading.Event) -> None:
    """Wait (at most drain_minutes) until every group the raters rated is no longer open or ready."""
    rated = sorted({a["group_id"] for a in tally.accepted})
    end = time.time() + 60 * cfg.drain_minutes
    while rated and time.time() < end and not stop_early.is_set():
        try:
            con = _ro(db_path)
            try:
                left = con.execute(f"SELECT COUNT(*) FROM groups WHERE status IN ('open', 'ready') AND id IN "
                                   f"({','.join(str(int(g)) for g in rated)})").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:
            left = -1
        if left == 0:
            return
        log.info("drain: %s rated groups not trained yet", left)
        _wait_until(min(end, time.time() + 5), server, t0, crashes, stop_early)


def _cpu() -> str | None:
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        return None


def report(cfg: BenchFaultsConfig, tally: Tally, store: dict | None, monitor: Monitor | None, faults: list[dict],
           t_raters_end: float, t_stop: float) -> dict:
    """The bench's result (module doc) from what the raters saw, what the monitor saw and the store."""
    steps = monitor.steps if monitor else []
    generated = {r["group_id"]: r["t"] for r in tally.rounds}
    ratings = store["ratings"] if store else []
    groups = store["groups"] if store else []
    accounts = rating_accounts(tally.accepted, len(tally.refused), len(tally.unanswered), ratings, groups)
    ours = set(generated)
    closed = [g for g in (store["closed"] if store else []) if g["id"] in ours]
    outcomes = fault_outcomes(faults, steps, generated, t_stop)
    m = lambda t: None if t is None else round(t / 60, 2)   # noqa: E731
    for f in outcomes:
        for k in ("scheduled", "start", "end", "window_end"):
            f[k] = m(f.get(k))
        for k in ("minutes_to_next_step", "minutes_to_resume"):
            f[k] = None if f.get(k) is None else round(f[k], 2)
    refused_msgs = collections.Counter(re.sub(r"\d+", "N", r["message"])[:120] for r in tally.refused)
    return {"config": asdict(cfg),
            "rounds": {"answered": len(tally.rounds), "generate_failed": dict(tally.generate_failed),
                       "raters_end_min": m(t_raters_end), "observed_until_min": m(t_stop)},
            "ratings": accounts,
            "refusals": dict(refused_msgs.most_common(10)),
            "steps": {"total": len(steps), "store_rows": len(store["steps"]) if store else None,
                      "seen_min": [m(s["t"]) for s in steps]},
            "faults": outcomes,
            "closed_groups": closed,
            "trainer_states": [{k: s[k] for k in ("t", "state", "pid", "message")} | {"t": m(s["t"])}
                               for s in (monitor.states if monitor else [])][-200:],
            "trainer_status_end": (store or {}).get("trainer_status"),
            "targets": targets(accounts, outcomes, closed)}


# --------------------------------------------------------------------------- output

def _fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def table(res: dict) -> str:
    from collab_app.commands.bench_abuse import target_lines

    r = res["ratings"]
    lines = [f"ratings: accepted {r['accepted']}, stored {r['stored']}, lost {r['lost']}; refused {r['refused']}, "
             f"unanswered {r['unanswered']}",
             f"  of the stored: trained {r['trained']}, late {r['late']} (told {r['late_told']}), pending "
             f"{r['pending']} ({r['pending_unrated_sibling']} beside an unrated candidate), not trained {r['not_trained'] or 0} ({r['with_reason']} with a reason, "
             f"{r['without_reason']} without)",
             f"rounds {res['rounds']['answered']} (failed generates: {res['rounds']['generate_failed'] or 0}); "
             f"train steps {res['steps']['total']}",
             f"{'fault':<9}{'start':>7}{'end':>7}{'applied':>8}{'steps in':>9}{'next step':>10}{'resumed':>8}"
             f"{'after':>6}{'min':>7}  detail"]
    for f in res["faults"]:
        detail = f.get("error") or json.dumps(f.get("detail"), default=str)[:90]
        lines.append(f"{f['fault']:<9}{_fmt(f['start']):>7}{_fmt(f['end']):>7}{_fmt(f['applied']):>8}"
                     f"{_fmt(f['steps_during']):>9}{_fmt(f['minutes_to_next_step']):>10}{_fmt(f['resumed']):>8}"
                     f"{_fmt(f['steps_to_resume']):>6}{_fmt(f['minutes_to_resume']):>7}  {detail}")
    lines.append("  (minutes from the raters' start; next step / min: minutes from the fault's end to the next "
                 "step / to the step that trained a group generated after it; after: which step that was)")
    for g in res["closed_groups"]:
        lines.append(f"closed group {g['id']}: {g['status']}: {g.get('reason') or '(no reason stored)'}")
    lines += target_lines(res["targets"], _fmt, width=48, none="n/a")
    c = res["config"]
    lines.append(f"(G={c['num_generations']}, {c['max_new_tokens']} tokens, K={c['min_groups']}, trainer "
                 f"'{c['trainer_args']}', engine {c['engine']}; disk: {res['mechanisms'].get('disk')} holding "
                 f"{res['mechanisms'].get('full_disk_holds')}; clock: "
                 f"{'shim' if (res['mechanisms'].get('clock') or '').startswith('LD_PRELOAD') else res['mechanisms'].get('clock')}; "
                 f"serve starts {len(res['server']['starts'])}, exits on its own {len(res['server']['exits'])}; "
                 f"CPU {res.get('cpu')}; load avg {' '.join(res.get('loadavg_end') or [])}"
                 + (f"; error: {res['error']}" if res.get("error") else "") + ")")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, other = parse_config(
        BenchFaultsConfig, argv, prog="collab bench faults",
        description="Scripted raters against a real `collab serve` while faults are injected (a full disk, the "
                    "trainer SIGKILLed mid-step, the store locked, the adapters wiped, a clock step, a truncated "
                    "adapter): ratings accepted vs stored vs trained, steps, and per fault whether learning resumed.",
        extra=lambda p: p.add_argument("--json", action="store_true", help="print the result as JSON"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench-faults %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def interrupted(signum, frame):   # SIGTERM as Ctrl-C: `run` still stops serve, ends the lock, unmounts the tmpfs
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    res = run(cfg)
    print(json.dumps(res, indent=1, default=str) if other.json else table(res))
    print(f"wrote {os.path.join(os.path.abspath(cfg.out_dir), 'bench_faults.json')}", file=sys.stderr)
    return 0 if res.get("error") is None else 1


if __name__ == "__main__":
    sys.exit(cli_main())
