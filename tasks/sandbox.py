"""Run untrusted Python (model-written code, and tests a person typed) against unit tests.

DESIGN §7. `run_tests(code, tests)` never executes anything in the calling process. Per check:

- a fresh `python -I -B -u tasks/_sandbox_harness.py` (sys.executable) in a fresh temp dir
  (its cwd, removed afterwards), with a minimal environment built from scratch (PATH, HOME and
  TMPDIR = the temp dir, C.UTF-8 locale, one BLAS/OpenMP thread): nothing of os.environ, so no
  tokens or secrets; `-I` also ignores PYTHON* variables and the user site;
- the request (code, tests, limits, a random nonce) goes over stdin, which is then closed;
- rlimits set by the harness before any candidate code: CPU seconds, address space, processes
  (RLIMIT_NPROC), file size, open files, no core dumps; PR_SET_NO_NEW_PRIVS;
- its own session/process group (start_new_session); wall-clock timeout, output flood
  (> max_output_bytes on stdout or stderr) or the end of the run => SIGKILL to the whole group;
- results come back over a private pipe (not stdout): one line per verdict, keyed with a
  BLAKE2b MAC under the nonce. The harness captures exec/compile/os.write/the MAC object
  before candidate code runs, and catches BaseException around setup, code and each test
  separately, so printing fake results, `sys.exit(0)`/`os._exit(0)`, raising SystemExit in a
  test, redefining `__import__`/`AssertionError`/builtins, or writing to the result fd cannot
  turn a failing test into a pass. A run without the harness's final MAC'd "done" line (or with
  any line failing the MAC) has `harness_ok=False`, and every test it did not report fails.
- optionally (`probe=`), after the final verdict, the same process re-runs the passed tests to
  measure whether one function calls another and uses its result (the coding task's
  cooperation level; make_probe in the harness). Anything that goes wrong after the verdicts
  (a hang, a kill, a flood) costs only the probe's findings, never a verdict; the findings are
  as trustworthy as the verdicts (see below: code that introspects the interpreter can forge both).

Isolation levels, probed once per process (`isolation()` says which one is in use):

- "namespaces" (the app runs as root, as on this project's machines): the harness unshares
  new network (no interface is up: every connect fails, loopback included), PID, mount, IPC
  and UTS namespaces. The PID namespace's init is a harness process that runs no candidate
  code; when the run ends the kernel kills every process left in it, setsid() or not. Inside,
  every mount is made read-only and nosuid; the temp dir and /dev/shm get fresh size-capped
  tmpfs mounts, so nothing the code writes lands on the host, and /proc shows only the
  sandbox's processes. Directories the sandbox uid cannot traverse on the way to the Python
  install (e.g. /root for pyenv) are covered by a tmpfs with only the Python directories
  bound back in, which also hides the rest of /root (~/.cache tokens and the like). The code
  then runs as a random uid of its own (2_000_000_000 + up to 10^8, never a real account), so
  RLIMIT_NPROC (per uid, and not enforced for root at all) bounds a fork bomb for this run
  alone, file permissions apply, and root inside the namespaces cannot remount things
  writable again.
- "userns" (not root, or a root that may not unshare, e.g. in a container; user namespaces
  allowed): the same namespaces inside a new user namespace (`unshare --user
  --map-root-user`, util-linux); no separate uid, so file permissions are those of the app's
  user, but mounts are read-only as above. For a non-root app RLIMIT_NPROC is counted per
  user namespace (Linux 5.14+), so max_procs bounds this run; for root it is not enforced.
  (Only run by hand on this project's root machines.)
- "plain" (neither works): rlimits, process group kill, scrubbed env, private result channel
  only. NOT blocked: network; writes anywhere the app's user may write (if root, a separate
  uid is used when the Python install is reachable by it, so only world-writable places like
  /tmp); reading files the app's user can read, including /proc/<app pid>/environ when not
  root; a process that calls setsid() and sleeps outlives the run unless a separate uid was
  used (RLIMIT_CPU still applies). Without a separate uid RLIMIT_NPROC counts all of the
  user's processes, so it is set to the user's current count + max_procs (racy); as root
  without a separate uid there is no process limit at all (the kernel exempts root), only
  the kill at the end of the run.

RLIMIT_NPROC counts threads too: max_procs must leave room for libraries that start thread
pools (the environment pins OpenMP/BLAS to one thread).

What this does NOT protect against, at any level:
- Code that deliberately introspects the interpreter it runs in (gc.get_objects, frames,
  sys.settrace jumping over an assert line, ctypes reading memory) can find the MAC object and
  forge verdicts, or edit the test namespace: the tests run in the same process as the code
  they judge. Likewise values built to cheat comparisons (`__eq__` that always returns True)
  pass `assert f(x) == y`. Rewards built on this are only as strong as the tests.
- Kernel or CPU bugs (namespace escapes, Spectre-style side channels), timing attacks.
- Resource use below the limits: up to max_procs processes each with memory_mb of address
  space, and CPU time shared with the machine until the wall-clock timeout; tmpfs writes count
  against host memory (capped at 4 x max_file_mb per run).
- Denial of the run itself: code can always make its own check fail, time out or crash.
- No seccomp filter: every syscall the kernel allows an unprivileged process is available.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
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

log = logging.getLogger(__name__)

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
UID_BASE, UID_SPAN = 2_000_000_000, 100_000_000  # sandbox uids; never a real account


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
    #  "complete": bool, "error": str | None}. See make_probe in _sandbox_harness.py.
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
    max_procs: int = 32  # processes+threads the run may have (RLIMIT_NPROC, see module doc)
    max_file_mb: int = 16  # largest file it may write
    max_open_files: int = 64
    max_output_bytes: int = 64_000  # per stream (stdout, stderr); more => killed, "output"


# ---------------------------------------------------------------------------- isolation probe

@dataclass(frozen=True)
class _Mode:
    name: str  # "namespaces" | "userns" | "plain"
    prefix: tuple[str, ...]  # command prefix (unshare --user ...)
    namespaces: bool  # the harness unshares mount/net/pid/ipc/uts namespaces
    confine: bool  # the harness makes mounts read-only + tmpfs work dir
    separate_uid: bool  # harness drops to a fresh uid


def isolation() -> dict:
    """Which isolation this process's checks get (see the module docstring), for logs and UI."""
    m = _mode()
    return {"mode": m.name, "network_blocked": m.namespaces, "pid_namespace": m.namespaces,
            "read_only_filesystem": m.confine, "separate_uid": m.separate_uid,
            # the kernel never applies RLIMIT_NPROC to root
            "process_limit": m.separate_uid or os.geteuid() != 0}


@functools.cache
def _reach() -> tuple:
    """(parent, [dirs]) pairs: dirs the harness needs (Python install, sys.path, this package)
    behind a parent that other users cannot traverse (see confine_filesystem in the harness)."""
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
    # Only the shallowest closed ancestor counts: the needed dirs are bound back directly, so
    # deeper closed directories on the way no longer matter.
    return tuple((a, tuple(ps)) for a, ps in out.items())


_mode_lock = threading.Lock()
_mode_cache: _Mode | None = None


def _mode() -> _Mode:
    global _mode_cache
    with _mode_lock:
        if _mode_cache is None:
            _mode_cache = _probe()
            log.info("sandbox isolation: %s", _mode_cache.name)
        return _mode_cache


def _probe() -> _Mode:
    """Try the strongest mode first; a mode counts only if a real check runs in it and the
    network is really gone (connect to loopback fails with ENETUNREACH, not ECONNREFUSED)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    candidates = []
    if root:
        candidates.append(_Mode("namespaces", (), True, True, True))
    if unshare:  # also as root: a container may refuse unshare(2) but allow user namespaces
        candidates.append(_Mode("userns", (unshare, "--user", "--map-root-user"), True, True, False))
    probe = ("import errno, socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', 9))\n"
             "except OSError as e:\n    assert e.errno == errno.ENETUNREACH, e\nelse:\n"
             "    raise AssertionError('connected')")
    for m in candidates:
        r = _run(m, "", [probe], Limits(timeout_s=20), "")
        if r.harness_ok and r.all_passed:
            return m
        log.warning("sandbox: %s isolation unavailable (%s; stderr: %s)", m.name,
                    r.setup_error or (r.tests[0].error if r.tests else r.killed_by),
                    r.stderr[-500:])
    plain_uid = root and not _reach()  # a dropped uid must still be able to import Python
    log.warning("sandbox: no namespaces; network is NOT blocked and the filesystem is only "
                "protected by %s (see tasks/sandbox.py)",
                "a separate uid" if plain_uid else "the app user's permissions")
    return _Mode("plain", (), False, False, plain_uid)


# ------------------------------------------------------------------------------------ running

def run_tests(code: str, tests: list[str], limits: Limits = Limits(), setup: str = "",
              probe: dict | None = None) -> SandboxResult:
    """exec `setup` (e.g. imports the problem needs), then `code`, then each test snippet (e.g.
    "assert f(1) == 2", or a multi-line block) in one namespace, in a sandboxed subprocess. Each
    test runs separately: a failing test doesn't stop the rest.

    `probe` = {"entry": name, "aux": name, "budget_s": seconds}: after every verdict is
    reported, the same process checks at run time whether the function `entry` calls `aux`
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
    return _run(_mode(), code, list(tests), limits, setup, probe)


def run_many(jobs: list[tuple[str, list[str]]], limits: Limits = Limits(),
             max_workers: int | None = None, setup: str = "") -> list[SandboxResult]:
    """run_tests for each (code, tests) job, at most `max_workers` (default: CPU count) at a
    time so that many checks cannot exhaust the machine; results in job order."""
    workers = max(1, max_workers or os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits, setup), jobs))


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
         probe: dict | None = None) -> SandboxResult:
    t0 = time.monotonic()
    nonce = secrets.token_hex(32)
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if mode.separate_uid else None
    nproc = limits.max_procs
    if mode.name == "plain" and uid is None:
        nproc += _user_tasks(os.getuid())
    workdir = tempfile.mkdtemp(prefix="collab-sandbox-")
    rfd, wfd = os.pipe()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        request = json.dumps({
            "nonce": nonce, "results_fd": wfd, "code": code, "tests": tests, "setup": setup, "probe": probe,
            "uid": uid, "workdir": workdir, "namespaces": mode.namespaces, "confine": mode.confine,
            "reach": _reach() if mode.separate_uid else [], "tmpfs_mb": 4 * limits.max_file_mb,
            "nproc": nproc, "limits": {k: getattr(limits, k) for k in
                                       ("cpu_s", "memory_mb", "max_file_mb", "max_open_files")},
        }).encode()
        try:
            proc = subprocess.Popen(
                [*mode.prefix, sys.executable, "-I", "-B", "-u", HARNESS], cwd=workdir,
                env=_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(wfd,), start_new_session=True)
        finally:
            os.close(wfd)  # only the child may hold the write end: EOF means it is gone
            wfd = -1
        got = _pump(proc, request, rfd, limits, t0 + limits.timeout_s)
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
        if uid is not None and mode.name == "plain":
            _kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    return _assemble(tests, nonce, got, limits, time.monotonic() - t0, probe is not None)


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
              probed: bool = False) -> SandboxResult:
    """Turn the verified result lines and how the process ended into a SandboxResult. Only
    lines whose MAC checks out count; tests are accepted in order, once each. With a probe,
    whatever happens after "D" (a kill, a memory error) concerns the probe only."""
    key = bytes.fromhex(nonce)
    setup: tuple[bool, str] | None = None
    results: list[tuple[bool, str]] = []
    done = memory = False
    probe_tests: dict[int, dict] = {}
    probe_done = probe_memory = False
    ended: tuple[int, float] | None = None  # the runner's exit code and CPU s, from the supervisor
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
        elif kind == "C" and done and probed and len(f) == 5 and f[0].isdigit():
            sites = {} if f[4] == "-" else {_unhex(h): r == "1" for h, _, r in (x.partition("=") for x in f[4].split(","))}
            probe_tests[int(f[0])] = {"status": f[1], "aux_calls": int(f[2]), "wrapper": f[3] == "1", "sites": sites}
        elif kind == "P" and done and probed:
            probe_done = True
        elif kind == "X":
            ended = (os.waitstatus_to_exitcode(int(f[0])), float(f[1]))

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
    elif memory:
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
    elif setup is None and (ended is None or status == 70):  # 70: the harness's own failure
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
