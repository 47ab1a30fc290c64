"""Split a CPU box's cores between the serving engine and the trainer child, and lend them back.

Why: the app and its trainer child both run torch; given every core each, their OpenMP barriers
spin against each other and a MAGRPO step takes many times longer beside round generation. So
cores are given out, never shared:

    cores 0 .. E-1   the serving process: its engine (torch threads or vLLM-cpu's thread binding),
                     Gradio, the reward checks and their sandboxes
    cores E .. n-1   the trainer child (affinity set before it execs, OMP/MKL/torch threads = n-E)

E = `engine_cores` (ServeConfig.engine_cores; 0 = auto = half the usable cores, at least 1). No
split with a CUDA GPU, with one usable core, without a trainer child, or with engine_cores = -1.

Main pieces:
- `cpu_budget()`: the cores this process may use (affinity cut down to its cgroup's CPU quota);
- `plan`, `apply_to_serving`, `pinned_command`, `confine_after_torch`: the split and the child's
  pinning (libgomp counts its cores once, at load: the child loads it on both sides' cores first);
- `CoreLease`, `SpareCores`: the trainer lends its cores to the engine between steps and pauses
  for a person's round within a budget and a pause credit; the engine lends its cores to a step
  between a person's rounds;
- `training_load()`: a real MAGRPO update loop in a child, for benches that time a round beside
  a training step (`collab bench generate --beside-training`).

What each rule buys, and the numbers: docs/CPU.md.

    python -m collab_app.online.cpushare pin 1,3 -- CMD ...   # run CMD on cores 1 and 3 (exec)
    python -m collab_app.online.cpushare pin 1 --load-on 0,1 -- CMD ...   # on 0,1 until CMD calls confine_after_torch
    python -m collab_app.online.cpushare load --status F ...  # the update loop of training_load()
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import collab_app

log = logging.getLogger(__name__)

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
YIELD_SHARE = 0.5   # ServiceConfig.yield_share's default: a step pauses for rounds at most as long as it works
CONFINE_VAR = "COLLAB_CONFINE_AFTER_TORCH"   # `pin --load-on`: the cores the child confines itself to once torch is loaded
# The trainer widens onto the engine's cores only once no generate call has run for this long: an
# engine's OpenMP workers spin on after its last region (GOMP_SPINCOUNT, collab_app/__init__.py),
# ~1.2 s, and a trainer thread beside a spinning one halves both.
ENGINE_SETTLE_S = 1.5
# How long a generate call waits for a widened trainer to give the engine's cores back (it narrows
# at its next pause point, one layer: ~10-60 ms); past it the call decodes anyway (a trainer stuck
# between pause points, e.g. saving a version, runs no OpenMP region to spin against).
ENGINE_WAIT_S = 0.5
# A trainer banks the time it spends idle between units of work, at most this much, and a step
# pauses for rounds only while it has some (module docstring: "Why the credit"). 10 s: a round or
# two (2-3 s on a bf16 CPU, 6-12 s on an AVX2 one). Nothing is banked before the first unit: the
# wait for the first work says nothing about keeping up, and a scripted rater's first step that
# paused 10 s for it (30 s bank: 10 and 20 s in its first two steps) left the trainer behind for
# good: the groups that arrived meanwhile made every later step larger and slower (4 and 3
# versions in 3 min against 7 never pausing).
PAUSE_CREDIT_CAP_S = 10.0


@dataclass(frozen=True)
class CpuSplit:
    """Which cores the serving process and the trainer child may use."""

    engine: tuple[int, ...]
    trainer: tuple[int, ...]

    def describe(self) -> str:
        return f"engine on cores {_fmt(self.engine)}, trainer child on cores {_fmt(self.trainer)}"


def _fmt(cores) -> str:
    return ",".join(str(c) for c in cores)


CGROUP_ROOT = "/sys/fs/cgroup"          # where the cgroup hierarchies are mounted
PROC_CGROUP = "/proc/self/cgroup"       # this process's cgroup path in each hierarchy
_BEFORE_SPLIT: set[int] | None = None   # this process's cores before apply_to_serving narrowed them


def affinity_cores() -> list[int] | None:
    """The cores this process's affinity mask allows; None where the OS has no affinity API
    (macOS) or the mask cannot be read (logged)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return sorted(os.sched_getaffinity(0))
    except OSError as e:
        log.warning("cannot read this process's CPU affinity (%s): counting os.cpu_count() = %s cores instead",
                     e, os.cpu_count())
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_v2(d: str) -> float | None:
    """CPUs allowed by `d`/cpu.max ("max 100000" = none, "200000 100000" = 2.0)."""
    raw = _read(os.path.join(d, "cpu.max"))
    parts = raw.split() if raw else []
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _limit_v1(d: str) -> float | None:
    """CPUs allowed by `d`/cpu.cfs_quota_us over cpu.cfs_period_us (quota -1 = none)."""
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    try:
        q, p = int(quota), int(period)   # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: str | None = None, proc_cgroup: str | None = None) -> tuple[float, str] | None:
    """The tightest CPU quota on this process, in CPUs, and the file that sets it; None = no quota.

    Reads `proc_cgroup` (default PROC_CGROUP; "0::/path" for cgroup v2, "N:cpu,cpuacct:/path"
    for v1), then the quota files of that cgroup and of every ancestor up to the hierarchy's
    root: a parent's quota binds all of its children. Under `root` (default CGROUP_ROOT) v2 is
    looked for at the root itself or at unified/ (hybrid layout), v1's cpu controller at
    <its controller list>/ or cpu/. A cgroup dir that is not there is skipped, not an error: in
    a container without a cgroup namespace the path names the host's hierarchy, while the
    container's own cgroup is what is mounted at the root."""
    root = root or CGROUP_ROOT
    text = _read(proc_cgroup or PROC_CGROUP)
    if not text:
        return None
    found: list[tuple[float, str]] = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            bases, reader, name = [root, os.path.join(root, "unified")], _limit_v2, "cpu.max"
        elif "cpu" in controllers.split(","):
            bases = [os.path.join(root, controllers), os.path.join(root, "cpu")]
            reader, name = _limit_v1, "cpu.cfs_quota_us"
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for base in dict.fromkeys(bases):
            if not os.path.isdir(base):
                continue
            for k in range(len(parts), -1, -1):
                d = os.path.join(base, *parts[:k])
                cpus = reader(d)
                if cpus is not None:
                    found.append((cpus, os.path.join(d, name)))
    return min(found) if found else None


def _within_quota(n: int) -> int:
    """min(n, ceil(this process's cgroup CPU quota)), at least 1."""
    limit = cgroup_cpu_limit()
    return max(1, min(n, math.ceil(limit[0])) if limit is not None else n)


def cpu_budget() -> int:
    """How many CPUs this process can keep busy: its affinity cores (os.cpu_count() where the OS
    has no affinity API) within its cgroup's CPU quota (rounded up), at least 1."""
    cores = affinity_cores()
    return _within_quota(len(cores) if cores is not None else (os.cpu_count() or 1))


def usable_cores() -> list[int]:
    """The cores the split gives out: this process's affinity mask as it was before
    `apply_to_serving` confined it (so a second plan() sees the same box), cut to the first
    ceil(cgroup CPU quota) of them. Without an affinity API (macOS) they are 0..n-1: labels
    that set thread counts; nothing is pinned there.

    Why cut: under a quota of k CPUs all the cgroup's runnable threads share k CPUs' time,
    whatever cores they run on. Spread over every core of the node, the engine and the trainer
    child would run far more threads than k (OpenMP barriers then wait on throttled threads)
    and compete for the same quota; on k distinct cores, with thread counts to match, each side
    gets the share the split gives it. Which k cores does not matter (a quota is time, not
    cores); the first ones keep plan() repeatable."""
    cores = sorted(_BEFORE_SPLIT) if _BEFORE_SPLIT else affinity_cores()
    if cores is None:
        cores = list(range(os.cpu_count() or 1))
    return cores[:_within_quota(len(cores))]


def _on_gpu() -> bool:
    from collab_app.engines import cuda_available

    return cuda_available()


def plan(engine_cores: int = 0, cores: list[int] | None = None, on_gpu: bool | None = None) -> CpuSplit | None:
    """The split for `engine_cores` (0 = auto: half, at least 1; -1 = none) over `cores` (default:
    this process's usable cores). None = no split (GPU, one core, or -1)."""
    if engine_cores < -1:
        raise ValueError(f"engine_cores must be -1 (no split), 0 (auto) or a core count, got {engine_cores}")
    cores = usable_cores() if cores is None else sorted(cores)
    if engine_cores == -1 or len(cores) < 2:
        return None
    if (_on_gpu() if on_gpu is None else on_gpu):
        return None
    e = engine_cores or max(1, len(cores) // 2)
    if e >= len(cores):
        raise ValueError(f"engine_cores={e} leaves no core for the trainer child ({len(cores)} usable, affinity "
                         f"within the CPU quota: "
                         f"{_fmt(cores)}): use at most {len(cores) - 1}, 0 for auto, or -1 for no split")
    return CpuSplit(engine=tuple(cores[:e]), trainer=tuple(cores[e:]))


def _confine(cores) -> bool:
    """Set this process's affinity to `cores`; False (logged) where that cannot be done."""
    if not hasattr(os, "sched_setaffinity"):
        log.info("no CPU affinity on this OS: the split sets thread counts (%d here) but pins nothing", len(cores))
        return False
    try:
        os.sched_setaffinity(0, cores)
        return True
    except OSError as e:
        log.warning("could not pin this process to cores %s (%s): it and its neighbour may share cores; thread "
                    "counts still follow the split (use --engine-cores -1 to turn the split off)", _fmt(cores), e)
        return False


def apply_to_serving(split: CpuSplit) -> None:
    """Confine this (serving) process to split.engine, before the engine starts: affinity for
    this thread and every thread or process started after (torch's OpenMP pool, Gradio, vLLM's
    spawned engine core, sandboxes), torch threads = its core count, and vLLM-cpu's OpenMP threads
    bound to those cores (its own default binding would take every core)."""
    global _BEFORE_SPLIT
    if _BEFORE_SPLIT is None:
        before = affinity_cores()
        _BEFORE_SPLIT = set(before) if before is not None else None
    n = str(len(split.engine))
    for var in THREAD_VARS:
        os.environ[var] = n
    # torch (and its libgomp) loads BEFORE the process is confined: libgomp counts the CPUs of the
    # affinity it finds when it loads, once, and a team larger than that count waits with a
    # 100-spin limit whatever GOMP_SPINCOUNT says. Confined first, every OpenMP region of the
    # engine's decoding thread, widened onto the trainer's lent cores (SpareCores), would wake a
    # parked worker: 62-80 µs a region against ~12 µs.
    try:
        import torch
    except ImportError:
        torch = None
    pinned = _confine(split.engine)
    # unpinned, vLLM's binding to these cores would fail the same way (or, on "auto", take every core)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _fmt(split.engine) if pinned else "nobind"
    if torch is not None:
        torch.set_num_threads(len(split.engine))


_LEASES = itertools.count()   # CoreLease: a distinct wait file per engine of this process


class CoreLease:
    """The trainer child's cores, lent to the serving engine while the trainer is not working, and
    while a person's round waits for them (within a budget).

    Why: with the split, the trainer child's cores idle between its steps (it waits for rated
    groups most of the time), while a person waits for a round decoded on the engine's cores
    alone. Measured on a 2-core AVX2 CPU: a vLLM round on one core 19.7 s, on both 14.4 s.
    So the engine borrows those cores for its decode steps whenever the trainer
    does not need them, and gives them back within one decode step when it does.

    Protocol, over three files (the trainer is a separate process; an flock dies with its holder,
    so a killed trainer or engine never leaves the cores locked):
      - `path`: an flock. The trainer holds it (exclusive, blocking) for each unit of work (a
        step, a self-play round, loading); the engine holds it (exclusive, non-blocking try)
        while it decodes on the borrowed cores.
      - `path + ".want"`: exists while the trainer waits for or holds the lock. The engine checks it
        before every decode step and releases at once; it never tries to borrow while it exists.
      - `path + ".wait.<engine>"`: exists while that engine's generate call decodes on its own
        cores only (it could not borrow); one file per engine (a team on two bases has two
        engines, whose calls may overlap: with one shared file, the call that ended first took
        away the other's "waiting"). The trainer checks for any between the pieces of a step
        (`pause`): it then takes its want file away and unlocks, waits until no engine waits any
        more (the waiting one has borrowed) and the borrower's call has ended (or its budget is
        spent), and takes the lock back.
    So the trainer waits at most one decode step (~0.1-0.2 s here), the engine never blocks, and
    two torch processes never spin on the same cores (the module's rule) -- the lock is exclusive.

    The other way (`engine_cores`: the trainer's side was given the engine's cores), two more:
      - `path + ".engine"`: an flock, and its existence says the serving engine takes part
        (`lend_trainer_cores` creates it when every engine part decodes in the serving process; a
        part decoding elsewhere, e.g. vLLM's spawned engine core, would not announce its calls).
        Each engine holds it shared for a whole generate call (`begin_call` .. `end_call`, which
        also sets its mtime: when the last call ended); the trainer holds it exclusive while it
        works on the engine's cores too.
      - `path + ".call.<engine>"`: exists from the start of that engine's call to its end.
    At each pause point of a unit (`pause`), the trainer narrows back to its own cores if a call
    file exists, and widens (this thread's affinity and torch threads) if none exists, the last
    call ended ENGINE_SETTLE_S ago and the exclusive lock is free. A call first makes its call
    file, then waits for the shared lock (the trainer's next pause point), at most ENGINE_WAIT_S.
    The trainer is wide only inside a unit of work and narrows when the unit ends.
    """

    def __init__(self, path: str, yield_share: float = 0.0, engine_cores: tuple[int, ...] = (),
                 pause_credit: bool = True):
        self.path = path
        self.want = path + ".want"
        n = next(_LEASES)
        self.wait = f"{path}.wait.{os.getpid()}-{n}"   # this engine's wait file (docstring)
        self.engine = path + ".engine"
        self.call = f"{path}.call.{os.getpid()}-{n}"   # this engine's call file
        self.yield_share = yield_share   # the trainer's pause budget (module docstring); 0 = never pause
        self.engine_cores = tuple(engine_cores)   # the trainer's side: cores it may widen onto ((): never)
        self.pause_credit = pause_credit   # pauses only as long as the trainer idled before (module docstring)
        self.credit_s = 0.0                  # idle seconds banked for pauses (PAUSE_CREDIT_CAP_S at most)
        self._idle_t0: float | None = None   # when the last unit of work ended (None: none yet)
        self._own: tuple[tuple[int, ...] | None, int] | None = None   # the trainer's cores and threads before widening
        self._wide: int | None = None    # the trainer's exclusive engine lock, while wide
        self._wide_t0 = 0.0
        self.wide_s = 0.0                # seconds the trainer worked wide (the service reports it per step)
        self._call_fd: int | None = None   # the engine's shared lock, during a call
        self.call_wait_s = 0.0           # how long the engine's last call waited for a wide trainer
        self._fd: int | None = None      # the engine's borrowed lock
        self._unit: int | None = None    # the trainer's lock, while a unit of work holds it
        self._unit_t0 = 0.0              # when that unit got its cores
        self._paused = 0.0               # seconds that unit has paused so far
        self._last_work = 0.0            # working seconds (pauses not counted) of the last unit

    # -- the trainer's side --------------------------------------------------------------------
    @contextlib.contextmanager
    def held(self, wait_s: float = 5.0):
        """Hold the trainer's cores for one unit of work. Waits for the engine's next decode step
        (~0.1-0.2 s), at most `wait_s`: an engine that holds the lock longer is not decoding (a
        stream whose reader stalled between two steps), so its threads do not spin on these cores;
        the work then goes ahead without the lock, and the engine gives the cores back at its next
        step (the want file is there). A want file left by a killed trainer is removed by the
        next one's first unit of work (or `clear_stale`)."""
        with open(self.want, "w"):
            pass
        if self._idle_t0 is not None:   # the time since the last unit ended: idle, banked for pauses
            self.credit_s = min(PAUSE_CREDIT_CAP_S, self.credit_s + time.monotonic() - self._idle_t0)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._lock(fd, wait_s)
            self._unit, self._unit_t0, self._paused = fd, time.monotonic(), 0.0
            yield
        finally:
            self.narrow()
            if self._unit is not None:
                self._last_work = time.monotonic() - self._unit_t0 - self._paused
            self._unit = None
            self._idle_t0 = time.monotonic()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.want)
            os.close(fd)   # releases the flock

    @staticmethod
    def _lock(fd: int, wait_s: float) -> bool:
        """Take the flock on `fd`, trying every 10 ms for `wait_s`; False (logged) if it stayed taken."""
        import fcntl

        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= end:
                    log.info("the engine kept the trainer's cores %.0f s without a decode step: working anyway", wait_s)
                    return False
                time.sleep(0.01)

    def pause(self) -> float:
        """Between two pieces of a unit of work (inside `held`): if a person's round waits for these
        cores (the wait file), let the engine have them until its generate call ends, within the
        budget: this unit pauses at most worked * yield_share / (1 - yield_share) seconds in all,
        worked = the larger of its working time so far and the last unit's (so a step that starts
        beside a round may pause for it too), and, with `pause_credit`, at most the idle time
        banked (`credit_s`: spent by pausing). Returns the seconds paused (0 = none waited, or no
        budget left)."""
        import fcntl

        fd = self._unit
        if fd is not None and self.engine_cores:
            self._widen_or_narrow()
        if fd is None or self.yield_share <= 0 or not self.round_waits():
            return 0.0
        t0 = time.monotonic()
        worked = max(t0 - self._unit_t0 - self._paused, self._last_work)
        end = t0 + worked * self.yield_share / (1.0 - self.yield_share) - self._paused
        if self.pause_credit:
            end = min(end, t0 + self.credit_s)
        if end - t0 < 0.05:
            return 0.0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.want)
        fcntl.flock(fd, fcntl.LOCK_UN)
        # the engine borrows at its next decode step (its wait file goes), and unlocks when its
        # call ends; a call that ends before it borrows takes its wait file away too
        while time.monotonic() < end and self.round_waits():
            time.sleep(0.01)
        got = False
        while not got and time.monotonic() < end:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
            except OSError:
                time.sleep(0.01)
        with open(self.want, "w"):   # budget spent with the engine still wide: it narrows at its next step
            pass
        if not got:
            self._lock(fd, 5.0)
        paused = time.monotonic() - t0
        self._paused += paused
        self.credit_s = max(0.0, self.credit_s - paused)
        return paused

    def _widen_or_narrow(self) -> None:
        """The trainer's side, at a pause point: give the engine's cores back if a call started,
        take them if the engine has been idle ENGINE_SETTLE_S (class docstring)."""
        import fcntl

        if self._wide is not None:
            if self._calls():
                self.narrow()
            return
        if self._calls():
            return
        try:
            if time.time() - os.stat(self.engine).st_mtime < ENGINE_SETTLE_S:
                return
            fd = os.open(self.engine, os.O_RDWR)   # no O_CREAT: the file says the engine takes part
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        if self._calls():   # a call began between the check and the lock: it waits on the lock
            os.close(fd)
            return
        import torch

        own_cores = tuple(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._own = (own_cores, torch.get_num_threads())
        if own_cores is None:   # no affinity API (macOS): the split is thread counts only
            wide, threads = None, self._own[1] + len(self.engine_cores)
        else:
            wide = tuple(sorted({*own_cores, *self.engine_cores}))
            threads = len(wide)
        try:
            _set_thread_cores(wide, threads)
        except OSError as e:   # e.g. a cpuset without the engine's cores: train on our own
            log.warning("cannot widen the trainer onto the engine's cores %s (%s): it keeps its own",
                        _fmt(self.engine_cores), e)
            self.engine_cores = ()
            torch.set_num_threads(self._own[1])   # the mask was not changed
            os.close(fd)
            return
        self._wide, self._wide_t0 = fd, time.monotonic()

    def narrow(self) -> None:
        """The trainer's side: back to its own cores and threads, the engine's lock released."""
        if self._wide is None:
            return
        cores, threads = self._own
        _set_thread_cores(cores, threads)
        os.close(self._wide)
        self._wide = None
        self.wide_s += time.monotonic() - self._wide_t0

    def _calls(self) -> bool:
        return bool(glob.glob(glob.escape(self.path) + ".call.*"))

    def clear_stale(self) -> None:
        """At the trainer's start: a want file from a predecessor killed mid-step would keep the
        engine from borrowing until the next step, and a wait file from a killed engine would
        make steps pause for nobody; nobody wants or waits for the cores yet. (A call file left by
        a killed engine only keeps the trainer narrow; serve and its engines end together.)"""
        for f in (self.want, *self._wait_files()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)

    def _wait_files(self) -> list[str]:
        return glob.glob(glob.escape(self.path) + ".wait.*")

    def round_waits(self) -> bool:
        """Whether some engine's generate call decodes without the trainer's cores (any wait file)."""
        return bool(self._wait_files())

    # -- the engine's side ---------------------------------------------------------------------
    def wanted(self) -> bool:
        return os.path.exists(self.want)

    def try_borrow(self) -> bool:
        """Take the lock without waiting; False if the trainer holds (or wants) it."""
        import fcntl

        if self._fd is not None:
            return True
        if self.wanted():
            return False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def give_back(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def waiting(self, on: bool) -> None:
        """Say (on) or unsay that a generate call decodes without the trainer's cores."""
        if on and not os.path.exists(self.wait):
            with open(self.wait, "w"):
                pass
        elif not on:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.wait)

    def begin_call(self) -> None:
        """The engine's side, before a generate call's first step: announce it (call file) and
        wait, at most ENGINE_WAIT_S, for a trainer working on the engine's cores to give them
        back (the shared lock). Nothing to do where the engine does not take part (no lock file)."""
        import fcntl

        if self._call_fd is not None or not os.path.exists(self.engine):
            return
        with open(self.call, "w"):
            pass
        fd = os.open(self.engine, os.O_RDWR)
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() - t0 >= ENGINE_WAIT_S:
                    log.info("the trainer kept the engine's cores %.1f s into a generate call: decoding anyway",
                             ENGINE_WAIT_S)
                    break
                time.sleep(0.002)
        self.call_wait_s = time.monotonic() - t0
        self._call_fd = fd

    def end_call(self) -> None:
        """The call is over: the shared lock released, the lock file's mtime = now (the trainer's
        settle clock), the call file removed."""
        if self._call_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.engine)
        os.close(self._call_fd)
        self._call_fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.call)


class SpareCores:
    """The engine's side of a CoreLease: called on the thread that decodes, before each decode
    step (`before_step`) and when a generate call ends (`end`). Widening = this thread's affinity
    to its own cores plus the trainer's, torch/OpenMP threads to match (OpenMP keeps its thread
    count per calling thread, so only the decoding thread changes; the pool thread OpenMP starts
    for the second core inherits the wide mask). Narrowing = back to the engine's own cores, and
    the threads that kept the wide mask (that pool thread) to SCHED_IDLE until the next widening:
    they spin on after the last region (GOMP_SPINCOUNT, collab_app/__init__.py), ~1.2 s, and on the
    trainer's core that halved the trainer's work (measured: 100 matmuls 256 x 256 on the trainer's
    core 18 ms, 38 ms in the second after the engine narrowed, 19-20 ms with SCHED_IDLE). A step decoded narrow says so (the lease's wait file), so a trainer
    in a step may pause for it. `widened` counts the steps decoded wide (for tests and the bench)."""

    def __init__(self, lease: CoreLease, split: CpuSplit):
        self.lease, self.split = lease, split
        self.wide = False
        self.in_call = False   # between a call's first before_step and its end
        self.widened = 0
        self.idled: set[int] = set()   # thread ids set to SCHED_IDLE at the last narrowing
        self._older = _thread_ids()     # threads that predate the lending: never touched
        self._can_wake = True          # False once the OS refused SCHED_IDLE -> SCHED_OTHER (unprivileged)

    def before_step(self) -> None:
        if not self.in_call:   # a trainer working on the engine's cores gives them back first
            self.lease.begin_call()
            self.in_call = True
        if self.wide and self.lease.wanted():
            self._narrow()
        elif not self.wide and self.lease.try_borrow():
            _set_thread_cores(self.split.engine + self.split.trainer)
            self._wake_threads()
            self.wide = True
        if self.wide:
            self.widened += 1
        self.lease.waiting(not self.wide)

    def _narrow(self) -> None:
        if self.wide:
            _set_thread_cores(self.split.engine)
            self._idle_threads()
            self.wide = False
        self.lease.give_back()

    def _idle_threads(self) -> None:
        """SCHED_IDLE for every other thread started since the lending whose mask holds a trainer
        core: the ones started while wide, in a process confined to the engine's cores (serve's
        split, the bench's); in a process that is not (a test's), nothing is touched."""
        if not hasattr(os, "sched_setscheduler"):
            return
        import threading

        me, trainer = threading.get_native_id(), set(self.split.trainer)
        if trainer & os.sched_getaffinity(os.getpid()):   # the main thread's mask: not confined
            return
        for tid in _thread_ids() - self._older:
            if tid == me or tid in self.idled:
                continue
            try:
                if trainer & os.sched_getaffinity(tid):
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                    self.idled.add(tid)
            except OSError:   # gone meanwhile
                continue

    def _wake_threads(self) -> None:
        """Back to SCHED_OTHER while the trainer's cores are lent. Unprivileged, Linux refuses that
        (RLIMIT_NICE 0): they stay SCHED_IDLE, which costs little here (the trainer is idle, its
        cores free), so it is logged once and not retried."""
        if not self._can_wake:
            return
        for tid in list(self.idled):
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except PermissionError as e:
                log.info("cannot give the engine's OpenMP threads their priority back (%s): they stay "
                         "SCHED_IDLE, running on the lent cores only while nothing else wants them", e)
                self._can_wake = False
                return
            except OSError:   # gone
                pass
            self.idled.discard(tid)

    def end(self) -> None:
        """The generate call is over: back to the engine's cores; the trainer may take its own
        (and, ENGINE_SETTLE_S later, the engine's)."""
        self._narrow()
        self.lease.waiting(False)
        self.lease.end_call()
        self.in_call = False


def _set_thread_cores(cores: tuple[int, ...] | None, threads: int | None = None) -> None:
    """The calling thread's affinity (where the OS has one; None = leave it) and torch threads
    (default: one per core). OpenMP keeps its thread count per calling thread, and a worker started
    now inherits the mask; one left from a wider time sleeps once its spin ends. Both sides of a
    CoreLease widen and narrow this way: the engine's decoding thread, the trainer's step thread."""
    import torch

    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)   # 0 = the calling thread
    torch.set_num_threads(len(cores) if threads is None else threads)


def _thread_ids() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def lend_trainer_cores(engine, split: CpuSplit, lease_path: str, lend_engine_cores: bool = False) -> int:
    """Let `engine` (or each engine of a TeamEngine) decode on split.trainer's cores while the
    trainer child does not hold `lease_path` (CoreLease; the child gets the same path). Each
    engine part gets its own SpareCores (its own decoding thread and lock handle). Parts whose
    decoding runs in another process (vLLM's spawned engine core, a remote server) are skipped.
    `lend_engine_cores`: also let a trainer given `engine_cores` work on the engine's cores
    between calls, where every part announces its calls. Returns how many engine parts borrow."""
    parts = list(getattr(engine, "engines", {}).values()) or [engine]
    lent = 0
    for part in parts:
        if not hasattr(part, "spare_cores") or getattr(part, "in_process", True) is False:
            continue
        part.spare_cores = SpareCores(CoreLease(lease_path), split)
        lent += 1
    if lend_engine_cores and lent == len(parts):   # every call announced: the trainer may widen (CoreLease)
        with open(lease_path + ".engine", "a"):
            pass
        os.utime(lease_path + ".engine", (0, 0))   # no call has run: nothing to settle
    return lent


def pinned_command(cores, argv: list[str], load_on=None) -> list[str]:
    """`argv` run on `cores` only (through `pin`: affinity + thread counts, then exec, so the pid
    and signals are argv's own). `load_on` (a superset of `cores`): argv starts on those cores and
    confines itself to `cores` once torch is loaded (it must call `confine_after_torch`), so that
    libgomp counts them all and a later widening onto them runs at full speed (module doc)."""
    wide = ["--load-on", _fmt(load_on)] if load_on and set(load_on) > set(cores) else []
    return [sys.executable, "-m", "collab_app.online.cpushare", "pin", _fmt(cores), *wide, "--", *argv]


def confine_after_torch() -> None:
    """In a process started by `pin --load-on`: load torch (and its libgomp) now, on the wide
    mask, then confine this process to its own cores. Elsewhere nothing."""
    cores = os.environ.pop(CONFINE_VAR, "")
    if not cores:
        return
    import torch

    own = [int(c) for c in cores.split(",")]
    _confine(own)
    torch.set_num_threads(len(own))


def _pin_and_exec(cores: list[int], argv: list[str], load_on: list[int] | None = None) -> None:
    if load_on:
        _confine(load_on)
        os.environ[CONFINE_VAR] = _fmt(cores)
    else:
        _confine(cores)
    for var in THREAD_VARS:
        os.environ[var] = str(len(cores))   # torch reads OMP_NUM_THREADS when it starts
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)   # the serving process's cores, not ours
    if os.environ.get("GOMP_SPINCOUNT") == collab_app.GOMP_SPINCOUNT:   # ours, not the user's:
        os.environ["GOMP_SPINCOUNT"] = collab_app.LIBGOMP_DEFAULT_SPINCOUNT   # no long spin on lent cores
    # a trainer's steps allocate and free their activations every step: in huge pages they ran
    # slower (engines/huge_pages.py), so the pinned child keeps torch's 4 KiB pages
    os.environ[collab_app.THP_VAR] = "0"
    os.execvp(argv[0], argv)


# ----------------------------------------------------------------------------- training_load

def _load_loop(args) -> None:
    """A real MAGRPO update loop on fake groups (random completions of real prompts; behaviour
    log-probs = the trainer's own, so the ratio starts at 1), until SIGTERM. Writes
    {"ready": true} once the model is loaded, then {"steps": n, "last_s": s} after each step."""
    import random
    import signal
    import torch
    from collab_app.engines.engine_types import Sample
    from collab_app.engines.model import ensure_model
    from tasks import load_task
    from trainer.config import MAGRPOConfig
    from trainer.magrpo import Group, MAGRPOTrainer, sequence_logprobs

    confine_after_torch()   # started on both sides' cores (training_load's engine_cores): now its own
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    task = load_task("tldr")
    cfg = MAGRPOConfig(model=ensure_model(None), task="tldr", num_agents=task.num_agents,
                       num_generations=args.num_generations, dtype=args.dtype)
    trainer = MAGRPOTrainer(cfg, task, args.adapters_dir)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(cfg.model)
    rng = random.Random(0)
    vocab = [i for i in range(100, tok.vocab_size) if i not in trainer.eos_token_ids]
    examples = task.examples("train")
    groups = []
    for k in range(args.groups):
        ex = examples[k % len(examples)]
        prompts = task.agent_prompts(ex, [])
        samples = []
        for i, p in enumerate(prompts):
            pids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
            comps = [[rng.choice(vocab) for _ in range(args.new_tokens)] for _ in range(args.num_generations)]
            model = trainer.model_of[trainer.agents[i]]
            model.set_adapter(trainer.agents[i])
            with torch.no_grad():
                lp, _ = sequence_logprobs(model, [pids] * len(comps), comps, trainer.eos_of[trainer.agents[i]])
            samples.append([Sample(agent=trainer.agents[i], adapter_version=0, prompt_token_ids=pids, text="",
                                   token_ids=c, logprobs=lp[j].tolist()) for j, c in enumerate(comps)])
        G = args.num_generations
        groups.append(Group(task="tldr", example_id=str(ex["id"]), turn=0, prompts=prompts, samples=samples,
                            joint=[(g,) * task.num_agents for g in range(G)],
                            returns=[float(g % 2) + 0.1 * g for g in range(G)]))   # distinct: a signal

    def write(obj):
        with open(args.status + ".tmp", "w") as f:
            json.dump(obj, f)
        os.replace(args.status + ".tmp", args.status)

    write({"ready": True, "steps": 0, "pid": os.getpid(), "threads": torch.get_num_threads(),
           "cores": affinity_cores()})
    steps, paused = 0, 0.0
    engine_cores = tuple(int(c) for c in args.engine_cores.split(",") if c)
    lease = CoreLease(args.core_lease, args.yield_share, engine_cores, args.pause_credit) if args.core_lease else None
    trainer.pause = lease.pause if lease else None   # as `collab trainer --core-lease` does
    trainer.pieces_done = lease.narrow if lease else None
    while not stop:
        for g in groups:   # keep them within max_staleness: the load is about compute, not data
            for i, a in enumerate(trainer.agents):
                for s in g.samples[i]:
                    s.adapter_version = trainer.versions[a]
        t0 = time.perf_counter()
        with (lease.held() if lease else contextlib.nullcontext()):
            m = trainer.update(groups)
        steps += 1
        paused += m["time/paused_s"]
        write({"ready": True, "steps": steps, "last_s": time.perf_counter() - t0, "last_paused_s": m["time/paused_s"],
               "paused_s": paused, "wide_s": lease.wide_s if lease else 0.0, "pid": os.getpid(),
               "threads": torch.get_num_threads(), "cores": affinity_cores()})


class TrainingLoad:
    """Handle of a running `training_load()`: `.status()` = the loop's last report."""

    def __init__(self, proc: subprocess.Popen, status_path: str, split: CpuSplit | None):
        self.proc, self.status_path, self.split = proc, status_path, split

    def status(self) -> dict:
        try:
            with open(self.status_path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_steps(self, n: int, timeout: float) -> dict:
        """Block until the loop reports `n` steps (or raise TimeoutError)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st.get("steps", 0) >= n:
                return st
            if self.proc.poll() is not None:
                raise RuntimeError(f"training load exited with code {self.proc.returncode}")
            time.sleep(0.5)
        raise TimeoutError(f"training load did not reach {n} steps in {timeout:.0f}s: {self.status()}")


@contextlib.contextmanager
def training_load(engine_cores: int = 0, groups: int = 2, num_generations: int = 4, new_tokens: int = 128,
                  dtype: str = "auto", ready_timeout: float = 600.0, core_lease: str | None = None,
                  yield_share: float = YIELD_SHARE, lend_engine_cores: bool = False, pause_credit: bool = True):
    """A MAGRPO update loop (2 tldr groups x G=4 x 128 tokens by default: the interactive
    workload's step) in a child process, on the trainer child's cores of `plan(engine_cores)`
    (-1 = no split: every core, as before this module); this process is confined to the engine's
    cores like `collab serve` does, and restored on exit. Yields a TrainingLoad once the
    model is loaded and updates are running; stops the child on exit. `core_lease`: the loop
    holds this CoreLease for each step, as `collab trainer --core-lease` does (an engine given
    `lend_trainer_cores` borrows the cores between steps, and within a step while its round waits
    for them, up to `yield_share`: 0 = the old behaviour, a step never pauses).
    `pause_credit` False: the steps pause on `yield_share` alone, as serve's trainer does when it
    was idle before a step (a person's pace); the loop itself never idles (steps back to back), so
    with the credit rule it pauses as a trainer behind on its ratings does: hardly at all.
    `lend_engine_cores` (with core_lease and a split): the loop's steps also work on the engine's
    cores between its calls, as serve's trainer child does (`CoreLease(engine_cores=...)`; the
    engine must announce its calls: `lend_trainer_cores(..., lend_engine_cores=True)`).

        with training_load() as load:
            ... time a round ...
        print(load.status())   # {"steps": n, "last_s": seconds of the last step}
    """
    split = plan(engine_cores)
    tmp = tempfile.mkdtemp(prefix="collab-load-")
    status = os.path.join(tmp, "status.json")
    argv = [sys.executable, "-m", "collab_app.online.cpushare", "load", "--status", status,
            "--adapters-dir", os.path.join(tmp, "adapters"), "--groups", str(groups),
            "--num-generations", str(num_generations), "--new-tokens", str(new_tokens), "--dtype", dtype]
    if core_lease:
        argv += ["--core-lease", core_lease, "--yield-share", str(yield_share)]
        if not pause_credit:
            argv.append("--no-pause-credit")
        if lend_engine_cores and split is not None:
            argv += ["--engine-cores", _fmt(split.engine)]
    old_aff = affinity_cores()
    old_env = {v: os.environ.get(v) for v in (*THREAD_VARS, "VLLM_CPU_OMP_THREADS_BIND")}
    import torch
    old_threads = torch.get_num_threads()
    if split is not None:
        argv = pinned_command(split.trainer, argv, split.engine + split.trainer)
        apply_to_serving(split)
    proc = subprocess.Popen(argv)
    load = TrainingLoad(proc, status, split)
    try:
        end = time.monotonic() + ready_timeout
        while not load.status().get("ready"):
            if proc.poll() is not None:
                raise RuntimeError(f"training load exited with code {proc.returncode} before it was ready")
            if time.monotonic() > end:
                raise TimeoutError(f"training load not ready after {ready_timeout:.0f}s")
            time.sleep(0.5)
        yield load
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if old_aff is not None:
            _confine(old_aff)
        for v, val in old_env.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val
        torch.set_num_threads(old_threads)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "pin":
        load_on = None
        if len(argv) > 3 and argv[2] == "--load-on":
            load_on = [int(c) for c in argv[3].split(",")]
            argv = argv[:2] + argv[4:]
        if len(argv) < 4 or argv[2] != "--":
            raise SystemExit("usage: python -m collab_app.online.cpushare pin CORES [--load-on CORES] -- CMD ...")
        _pin_and_exec([int(c) for c in argv[1].split(",")], argv[3:], load_on)
        return 0   # not reached
    p = argparse.ArgumentParser(prog="python -m collab_app.online.cpushare load")
    p.add_argument("cmd", choices=["load"])
    p.add_argument("--status", required=True)
    p.add_argument("--adapters-dir", required=True)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--core-lease", default="", help="hold this CoreLease for each step")
    p.add_argument("--yield-share", type=float, default=YIELD_SHARE,
                   help="with --core-lease: pause budget for a waiting round (ServiceConfig.yield_share)")
    p.add_argument("--engine-cores", default="",
                   help="with --core-lease: the engine's cores, worked on between its calls (ServiceConfig.borrow_engine_cores)")
    p.add_argument("--no-pause-credit", dest="pause_credit", action="store_false",
                   help="with --core-lease: pause on --yield-share alone, not only as long as the loop idled "
                        "(it never idles: steps back to back; ServiceConfig.pause_credit)")
    _load_loop(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
