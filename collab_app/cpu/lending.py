"""The trainer child's cores lent to the serving engine while the trainer is not working (and to a
person's round that waits for them, within a budget), and the engine's cores lent to a training
step between rounds: `CoreLease` (the trainer's side: a lock file per side, pause points, the
pause credit), `SpareCores` (the engine's side: widen its decoding thread, narrow it back) and
`lend_trainer_cores` (`collab serve` wires them). docs/CPU.md explains why and what it measured."""
from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import time

from collab_app.cpu.cores import CpuSplit, fmt_cores, set_thread_cores, thread_ids

log = logging.getLogger(__name__)

YIELD_SHARE = 0.5   # ServiceConfig.yield_share's default: a step pauses for rounds at most as long as it works
# The trainer widens onto the engine's cores only once no generate call has run for this long: an
# engine's OpenMP workers spin on after its last region (GOMP_SPINCOUNT, cpu/process.py),
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
            set_thread_cores(wide, threads)
        except OSError as e:   # e.g. a cpuset without the engine's cores: train on our own
            log.warning("cannot widen the trainer onto the engine's cores %s (%s): it keeps its own",
                        fmt_cores(self.engine_cores), e)
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
        set_thread_cores(cores, threads)
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
    they spin on after the last region (GOMP_SPINCOUNT, cpu/process.py), ~1.2 s, and on the
    trainer's core that halved the trainer's work (measured: 100 matmuls 256 x 256 on the trainer's
    core 18 ms, 38 ms in the second after the engine narrowed, 19-20 ms with SCHED_IDLE). A step decoded narrow says so (the lease's wait file), so a trainer
    in a step may pause for it. `widened` counts the steps decoded wide (for tests and the bench)."""

    def __init__(self, lease: CoreLease, split: CpuSplit):
        self.lease, self.split = lease, split
        self.wide = False
        self.in_call = False   # between a call's first before_step and its end
        self.widened = 0
        self.idled: set[int] = set()   # thread ids set to SCHED_IDLE at the last narrowing
        self._older = thread_ids()     # threads that predate the lending: never touched
        self._can_wake = True          # False once the OS refused SCHED_IDLE -> SCHED_OTHER (unprivileged)

    def before_step(self) -> None:
        if not self.in_call:   # a trainer working on the engine's cores gives them back first
            self.lease.begin_call()
            self.in_call = True
        if self.wide and self.lease.wanted():
            self._narrow()
        elif not self.wide and self.lease.try_borrow():
            set_thread_cores(self.split.engine + self.split.trainer)
            self._wake_threads()
            self.wide = True
        if self.wide:
            self.widened += 1
        self.lease.waiting(not self.wide)

    def _narrow(self) -> None:
        if self.wide:
            set_thread_cores(self.split.engine)
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
        for tid in thread_ids() - self._older:
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
