"""Hostile candidates and hostile tests for tasks/sandbox.py, each with the outcome every
isolation mode must give. tests/tasks/test_sandbox_adversarial.py runs them for the host's modes in
its own process and, for "space", inside a Space-like container (tests/helpers/spacelike.py) through
the public API (run_tests(untrusted=True) with COLLAB_SANDBOX_ALLOW_WEAK=1).

Modes: "namespaces" and "userns" (strong), "plain" (this machine's root without namespaces:
the candidate is uid 0 without capabilities), "space" (plain as uid 65534, no user
namespaces). Outcomes: "contained" (the attack failed), "exposed" (it worked: for "plain" and
"space" that is the documented weakness), "n/a" (not run: see the attack's note).

Every attack is real, except where running it for real would hurt this shared host; those have
a harmless `proxy` per mode that shows the same capability (e.g. kill(pytest pid, 0) instead of
kill(-1, SIGKILL) as root), marked in the results. Nothing here reads the machine's own
processes or credentials: host pid 1 is never touched outside a PID namespace, /etc/shadow is
only measured (its length), never printed.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from tasks.sandbox import Limits, SandboxResult, _cgroups, _landlock_abi, _modes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C, X, NA = "contained", "exposed", "n/a"
FAST = Limits(timeout_s=20, cpu_s=5, memory_mb=512, max_procs=16, max_output_bytes=10_000)
ENV_VAR = "COLLAB_ADV_ENV_SECRET"  # set in the caller's os.environ while the attacks run


@dataclass
class Ctx:
    """What the attacks aim at, set up by `targets` in the process that calls the sandbox."""
    mode: str
    secret: str  # appears in every secret target below
    secret_file: str  # world-readable, under /tmp (the leak)
    store_file: str  # a COLLAB_HOME/collab.db stand-in, 0644, in a dir the caller owns
    root_file: str  # under /root, 0600 (host modes only)
    project_file: str  # a file of the project tree, and its first line
    project_line: str
    write_tmp: str  # host paths an escape would create
    write_project: str
    write_shm: str
    env_pid: int  # a process started with the secret in its environment
    caller_pid: int  # the process that calls the sandbox (pytest, or the Space's app)
    marker: str  # process name (comm) of leftovers
    extra: dict = field(default_factory=dict)

    def vars(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "extra"}


@contextlib.contextmanager
def targets(mode: str):
    """Create the targets (files, a process with the secret in its environment, the secret in
    os.environ) and remove them afterwards, with any leftover process of the attacks."""
    secret = "collab-secret-" + secrets.token_hex(8)
    tag = secrets.token_hex(6)
    made: list[str] = []
    secret_file = f"/tmp/collab-adv-secret-{tag}"
    home = tempfile.mkdtemp(prefix="collab-adv-home-")
    os.chmod(home, 0o755)
    store_file = os.path.join(home, "collab.db")
    root_file = f"/root/.collab-adv-{tag}" if mode in ("namespaces", "userns", "plain") else ""
    for path, mode_bits in ((secret_file, 0o644), (store_file, 0o644), (root_file, 0o600)):
        if path:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode_bits)
            os.write(fd, f"{secret}\n".encode())
            os.close(fd)
            made.append(path)
    project_file = os.path.join(REPO, "tasks", "sandbox.py")
    with open(project_file) as f:
        project_line = f.readline().strip()
    env_proc = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", "COLLAB_ADV_SECRET": secret})
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = secret
    ctx = Ctx(mode, secret, secret_file, store_file, root_file, project_file, project_line,
              write_tmp=f"/tmp/collab-adv-pwned-{tag}", write_project=os.path.join(REPO, f".collab-adv-pwned-{tag}"),
              write_shm=f"/dev/shm/collab-adv-pwned-{tag}", env_pid=env_proc.pid, caller_pid=os.getpid(),
              marker="cadv" + tag[:8])
    try:
        yield ctx
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old
        env_proc.kill()
        env_proc.wait()
        kill_marked(ctx.marker)
        for path in [*made, ctx.write_tmp, ctx.write_project, ctx.write_shm]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(home, ignore_errors=True)


def bare(mode: str) -> Ctx:
    """A Ctx with no targets behind it, for attacks that only aim at the caller (kill(-1)): no
    files or processes to clean up if the attack takes the caller down."""
    return Ctx(mode, "-", "/nonexistent", "/nonexistent", "/nonexistent", "/nonexistent", "-", "/nonexistent",
               "/nonexistent", "/nonexistent", env_pid=os.getpid(), caller_pid=os.getpid(), marker="cadv-none")


def marked(marker: str) -> list[int]:
    """Live processes (visible here) named `marker`: leftovers of a setsid attack. Zombies do
    not count: they are dead, waiting for whoever reaps orphans."""
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                name, _, rest = f.read().rpartition(")")
            if name.partition("(")[2] == marker and rest.split()[0] != "Z":
                out.append(int(p))
        except (OSError, ValueError):
            pass
    return out


def kill_marked(marker: str) -> None:
    for p in marked(marker):
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def text(r: SandboxResult) -> str:
    """Everything a run sends back to the caller (where a leak would show)."""
    return "\n".join([r.stdout, r.stderr, r.setup_error or "", *(t.error for t in r.tests)])


# --------------------------------------------------------------------------------- judges

def leak(ctx, r, state):
    return (X, "secret came back") if ctx.secret in text(r) else (C, _why(r))


def printed(word):
    def judge(ctx, r, state):
        return (X, next(ln for ln in r.stdout.splitlines() if ln.startswith(word))) if word in r.stdout \
            else (C, _why(r))
    return judge


def created(attr):
    def judge(ctx, r, state):
        if os.path.exists(getattr(ctx, attr)):
            return X, f"{getattr(ctx, attr)} written on the host"
        return C, "landed in the sandbox's own tmpfs" if r.all_passed else _why(r)
    return judge


def store_changed(ctx, r, state):
    with open(ctx.store_file) as f:
        return (X, "store file modified") if "pwned" in f.read() else (C, _why(r))


def run_intact(ctx, r, state):
    """Contained if the run itself survived (the harness reported everything)."""
    return (C, "run intact") if r.harness_ok and r.all_passed else (X, f"run broken: {r.killed_by or r.setup_error}")


def killed_with(*how):
    def judge(ctx, r, state):
        return (C, f"killed: {r.killed_by}") if r.killed_by in how or (r.passed < r.total and "MemoryError" in text(r)) \
            else (X, f"not stopped: {r.killed_by} {r.stdout[-200:]}")
    return judge


def count_below(word, bound):
    def judge(ctx, r, state):
        n = next((int(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith(word)), None)
        if n is None:
            return C, _why(r)
        return (C, f"{word.lower()} {n}") if n < bound else (X, f"{word.lower()} {n} (>= {bound})")
    return judge


def leftovers(ctx, r, state):
    end = time.monotonic() + 5  # a PID namespace's processes die with its init, asynchronously
    while (left := marked(ctx.marker)) and time.monotonic() < end:
        time.sleep(0.05)
    kill_marked(ctx.marker)
    return (X, f"{len(left)} process(es) outlived the run") if left else (C, "none outlived the run")


def tcp_judge(ctx, r, state):
    srv = state["srv"]
    srv.setblocking(False)
    try:
        conn, _ = srv.accept()  # a connect that got through waits in the backlog
        conn.close()
        return X, "loopback server reached"
    except BlockingIOError:
        return C, _why(r)


def udp_judge(ctx, r, state):
    s = state["udp"]
    s.setblocking(False)
    try:
        s.recvfrom(512)  # loopback delivery is synchronous: a datagram sent is queued already
        return X, "datagram delivered"
    except BlockingIOError:
        return C, _why(r)


def _why(r: SandboxResult) -> str:
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("ERR"):
            return line[:120]
    err = r.setup_error or next((t.error for t in r.tests if not t.passed), "") or r.killed_by or "blocked"
    return err[:120]


def tcp_setup(ctx):
    srv = socket.create_server(("127.0.0.1", 0))
    return {"srv": srv, "port": srv.getsockname()[1]}


def udp_setup(ctx):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return {"udp": s, "port": s.getsockname()[1]}


# ------------------------------------------------------------------------------- attacks

LIBC = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def err():\n    return os.strerror(ctypes.get_errno())\n")


@dataclass
class Attack:
    name: str
    group: str  # for the table: read, env, write, network, resources, processes, escape
    where: str  # "code" (a hostile candidate) or "test" (a hostile test snippet)
    snippet: str  # string.Template over Ctx.vars() (+ the setup's state)
    judge: Callable
    expect: dict  # mode -> C | X | NA
    limits: Limits = FAST
    setup: Callable | None = None  # host-side state (a server...), closed afterwards
    proxy: dict = field(default_factory=dict)  # mode -> harmless snippet standing in (module doc)
    note: str = ""

    def source(self, ctx: Ctx, state: dict) -> str:
        snippet = self.proxy.get(ctx.mode, self.snippet)
        return string.Template(snippet).substitute(ctx.vars(), **{k: v for k, v in state.items() if isinstance(v, (int, str))})


def both(c, u, p, s):
    return {"namespaces": c, "userns": u, "plain": p, "space": s}


LANDLOCK = _landlock_abi()
"""this kernel's Landlock ABI: "plain" and "space" runs are confined by it (tasks/sandbox.py), so
their file, TCP and signal exposures are contained where the kernel has the needed version."""


def confined(expect: dict, abi: int) -> dict:
    """`expect`, with what Landlock ABI `abi` contains in the weak modes turned to contained."""
    return {m: C if m in ("plain", "space") and v == X and LANDLOCK >= abi else v for m, v in expect.items()}


STRONG_ONLY = both(C, C, X, X)
CAPS_GUARD = both(C, C, C, X)  # ptrace-checked /proc files of processes that hold capabilities
ALL_C = both(C, C, C, C)
# with a cgroup memory controller (memory.max = total_memory_mb) the run's total is capped; without
# one, max_procs x memory_mb are lowered to fit total_memory_mb (tasks/sandbox.py _bounded), which
# holds wherever RLIMIT_NPROC does: not for kernel uid 0 without a separate uid (a root app's
# "userns" and "plain")
_NPROC = os.geteuid() != 0
MEMORY_TOTAL = ALL_C if "memory" in _cgroups().controllers else both(
    C, C if _NPROC else X, C if _NPROC or _modes()["plain"].separate_uid else X, C)

ATTACKS = [
    # ---- reading host files
    Attack("read /tmp secret (error text)", "read", "test", "assert False, open('$secret_file').read()",
           leak, confined(STRONG_ONLY, 1)),
    Attack("read /tmp secret (stdout)", "read", "code", "print(open('$secret_file').read())", leak, confined(STRONG_ONLY, 1)),
    Attack("read the store (collab.db)", "read", "test", "assert False, open('$store_file').read()", leak, confined(STRONG_ONLY, 1)),
    Attack("read /etc/shadow", "read", "code", "d = open('/etc/shadow', 'rb').read()\nprint('READ', len(d), 'bytes')",
           printed("READ"), confined(both(C, C, X, C), 1), note="space: uid 65534 may not read it"),
    Attack("read a root-only file under /root", "read", "code", "print(open('$root_file').read())", leak,
           confined(both(C, C, X, NA), 1), note="space: the container has no such file"),
    Attack("read the project tree", "read", "test", "assert False, open('$project_file').readline()",
           lambda ctx, r, s: (X, "project file read") if ctx.project_line in text(r) else (C, _why(r)), confined(STRONG_ONLY, 1)),
    Attack("list / (host root)", "read", "code",
           "import os\nnames = set(os.listdir('/'))\nprint('HOSTROOT' if names & {'etc', 'home', 'var', 'srv', 'opt'} else 'ERR',"
           " sorted(names))", printed("HOSTROOT"), confined(STRONG_ONLY, 1)),
    # ---- environment and other processes' memory
    Attack("os.environ secret of the caller", "env", "test", "import os\nassert False, repr(dict(os.environ))", leak, ALL_C),
    Attack("/proc/<pid>/environ of a process holding a secret", "env", "code",
           "print(open('/proc/$env_pid/environ', 'rb').read())", leak, confined(CAPS_GUARD, 1),
           note="plain (root): the code has no capabilities, the target has: ptrace checks refuse"),
    Attack("/proc/1/environ", "env", "code", "print('READ', open('/proc/1/environ', 'rb').read()[:80])",
           lambda ctx, r, s: (X, "read") if "READ" in r.stdout and "collab-sandbox-" not in r.stdout else (C, _why(r)),
           both(C, C, NA, C), note="plain: host pid 1 is the machine's own agent; not touched"),
    Attack("/proc/<caller>/mem read", "env", "code",
           "pid = $caller_pid\nline = next(ln for ln in open(f'/proc/{pid}/maps') if ln.split()[1].startswith('r'))\n"
           "m = open(f'/proc/{pid}/mem', 'rb')\nm.seek(int(line.split('-')[0], 16))\nprint('READMEM', len(m.read(16)))",
           printed("READMEM"), confined(CAPS_GUARD, 1)),
    Attack("/proc/<caller>/root walk", "escape", "code", "print(open('/proc/$caller_pid/root$secret_file').read())",
           leak, confined(CAPS_GUARD, 1)),
    Attack("/proc/1/root and /proc/1/mem of the sandbox init", "escape", "code",
           "import os\nfor p in ('/proc/1/root/', '/proc/1/mem'):\n    try:\n"
           "        print('GOT', p, os.listdir(p) if p.endswith('/') else open(p, 'rb').read(1))\n"
           "    except OSError as e:\n        print('ERR', p, e)",
           printed("GOT"), both(C, C, NA, C), note="plain: that would be host pid 1; not touched"),
    # ---- writing outside
    Attack("write host /tmp", "write", "test", "open('$write_tmp', 'w').write('pwned')", created("write_tmp"), confined(STRONG_ONLY, 1)),
    Attack("write the project tree", "write", "code", "open('$write_project', 'w').write('pwned')",
           created("write_project"), confined(both(C, C, X, C), 1), note="space: 65534 does not own the tree here (a Space's app does)"),
    Attack("append to the store", "write", "test", "open('$store_file', 'a').write('pwned')", store_changed, confined(STRONG_ONLY, 1)),
    Attack("write host /dev/shm", "write", "code", "open('$write_shm', 'w').write('pwned')", created("write_shm"), confined(STRONG_ONLY, 1)),
    # ---- network
    Attack("TCP to a loopback server", "network", "code",
           "import socket\ns = socket.create_connection(('127.0.0.1', $port), timeout=3)\ns.sendall(b'pwned')\nprint('CONNECTED')",
           tcp_judge, confined(STRONG_ONLY, 4), setup=tcp_setup),
    Attack("UDP (DNS query) to a loopback server", "network", "test",
           "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           "s.sendto(b'\\x12\\x34\\x01\\x00\\x00\\x01', ('127.0.0.1', $port))", udp_judge, STRONG_ONLY, setup=udp_setup),
    Attack("name resolution (getaddrinfo localhost)", "network", "code",
           "import socket\nprint('RESOLVED', socket.getaddrinfo('localhost', 80)[0][4])", printed("RESOLVED"),
           confined(STRONG_ONLY, 1), note="Landlock: /etc/hosts and resolv.conf are unreadable; a DNS server "
                                          "answering over UDP on 127.0.0.1:53 would still resolve"),
    # ---- resources
    Attack("fork 64 sleepers (max_procs=8)", "resources", "code",
           "import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
           "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint('FORKED', n)",
           count_below("FORKED", 32), both(C, C if os.geteuid() else X, X, C), limits=Limits(timeout_s=20, max_procs=8),
           note="plain, and userns for a root app: the kernel exempts kernel uid 0 from RLIMIT_NPROC"),
    Attack("one process allocates 2 GB (memory_mb=256)", "resources", "test", "x = b'x' * (2 * 1024**3)",
           killed_with("memory"), ALL_C, limits=Limits(timeout_s=20, memory_mb=256)),
    Attack("4 processes hold 100 MB each (memory_mb=160)", "resources", "code",
           "import os\nr, w = os.pipe()\nr2, w2 = os.pipe()\nfor _ in range(4):\n    if os.fork() == 0:\n"
           "        try:\n            data = b'x' * (100 * 1024**2)\n            os.write(w, b'1')\n"
           "        except MemoryError:\n            os.write(w, b'0')\n        os.read(r2, 1)\n        os._exit(0)\n"
           "got = b''.join(os.read(r, 1) for _ in range(4))\nprint('HELD', got.count(b'1'))\nos.close(w2)",
           count_below("HELD", 4), MEMORY_TOTAL, limits=Limits(timeout_s=20, memory_mb=160, total_memory_mb=256),
           note="without a cgroup: processes x address space within total_memory_mb, except for kernel uid 0"),
    Attack("disk flood: 12 files of 1 MB (max_file_mb=1)", "resources", "code",
           "n = 0\nfor i in range(12):\n    try:\n        with open(f'f{i}', 'wb') as f:\n"
           "            f.write(b'x' * (1 << 20))\n        n += 1\n    except OSError:\n        break\nprint('FILES', n)",
           count_below("FILES", 12), STRONG_ONLY, limits=Limits(timeout_s=20, max_file_mb=1),
           note="plain: the work dir is on the host disk; only the per-file limit applies"),
    Attack("stdout flood", "resources", "code", "while True:\n    print('x' * 1000)", killed_with("output"), ALL_C),
    Attack("stderr flood", "resources", "test", "import sys\nwhile True:\n    sys.stderr.write('y' * 1000)",
           killed_with("output"), ALL_C),
    # ---- processes and signals
    Attack("kill the parent (os.kill(getppid(), SIGKILL))", "processes", "test",
           "import os, signal, time\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError as e:\n"
           "    print('ERR', e)\ntime.sleep(0.5)",
           run_intact, confined(STRONG_ONLY, 6), note="plain: the parent is the harness: the run breaks, the caller lives"),
    Attack("signal the caller (kill(caller, 0))", "processes", "code", "import os\nos.kill($caller_pid, 0)\nprint('CAN_SIGNAL')",
           printed("CAN_SIGNAL"), confined(STRONG_ONLY, 6)),
    Attack("kill(-1, SIGKILL)", "processes", "code",
           "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print('ERR', e)\nprint('SURVIVED')",
           lambda ctx, r, s: (X, "could signal the caller") if "CAN_SIGNAL" in r.stdout else run_intact(ctx, r, s),
           confined(STRONG_ONLY, 6), proxy={"plain": "import os\ntry:\n    os.kill($caller_pid, 0)\n    print('CAN_SIGNAL')\n"
                                                         "except OSError as e:\n    print('ERR', e)"},
           note="plain: not run (as root it would kill the whole machine): kill(pytest, 0) succeeds; "
                "space: run for real, it kills the app"),
    Attack("setsid + sleep leftover", "processes", "code",
           "import ctypes, os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
           "        ctypes.CDLL(None).prctl(15, b'$marker', 0, 0, 0)\n        os.write(w, b'1')\n        time.sleep(60)\n"
           "    os._exit(0)\nos.read(r, 1)\nprint('SPAWNED')", leftovers, STRONG_ONLY),
    # ---- mounts and escapes
    Attack("mount a tmpfs", "escape", "code",
           LIBC + "os.mkdir('m')\nif libc.mount(b'tmpfs', b'm', b'tmpfs', 0, None) == 0:\n    print('MOUNTED')\n"
           "    libc.umount2(b'm', 2)\nelse:\n    print('ERR', err())", printed("MOUNTED"), ALL_C),
    Attack("remount / and /usr read-write", "escape", "code",
           LIBC + "for t in (b'/', b'/usr'):\n    if libc.mount(None, t, None, 0x20 | 0x1000, None) == 0:\n"
           "        print('REMOUNTED', t)\n    else:\n        print('ERR', t, err())", printed("REMOUNTED"), ALL_C),
    Attack("umount /proc", "escape", "code",
           LIBC + "if libc.umount2(b'/proc', 2) == 0:\n    print('UNMOUNTED')\nelse:\n    print('ERR', err())",
           printed("UNMOUNTED"), ALL_C,
           proxy={"plain": "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
                           "print('UNMOUNTED (could: capabilities left)' if int(caps, 16) else 'ERR no capabilities')"},
           note="plain: not tried on the host's /proc; shown by CapEff = 0"),
    Attack("nested userns: umount, remount rw, chroot escape", "escape", "code",
           LIBC + "out = []\nif libc.unshare(0x10000000 | 0x20000) != 0:\n    print('ERR unshare', err())\nelse:\n"
           "    if libc.umount2(b'/proc', 2) == 0:\n        out.append('umount /proc')\n"
           "    if libc.mount(None, b'/usr', None, 0x20 | 0x1000, None) == 0:\n        out.append('remount /usr rw')\n"
           "    os.mkdir('jail')\n    os.chroot('jail')\n    for _ in range(20):\n        os.chdir('..')\n    os.chroot('.')\n"
           "try:\n    out.append('read ' + open('$secret_file').read())\nexcept OSError as e:\n    print('ERR', e)\n"
           "print('ESCAPED' if out else 'ERR', out)", leak, confined(STRONG_ONLY, 1),
           note="plain/space: no escape needed, the host's files are there (space: user namespaces refused)"),
]
BY_NAME = {a.name: a for a in ATTACKS}
assert len(BY_NAME) == len(ATTACKS)


def run_attack(attack: Attack, ctx: Ctx, run: Callable) -> dict:
    """Run one attack with `run(code, tests, limits) -> SandboxResult`; judge it on this side."""
    row = {"attack": attack.name, "group": attack.group, "where": attack.where, "mode": ctx.mode,
           "expected": attack.expect[ctx.mode], "proxy": ctx.mode in attack.proxy, "note": attack.note}
    if row["expected"] == NA:
        return {**row, "outcome": NA, "detail": "not run"}
    state = attack.setup(ctx) if attack.setup else {}
    try:
        src = attack.source(ctx, state)
        code, tests = (src, ["assert True"]) if attack.where == "code" else ("", [src, "assert True"])
        r = run(code, tests, attack.limits)
        if (r.setup_error or "").startswith("the sandbox failed to start"):  # never "contained" by accident
            outcome, detail = "error", f"{r.setup_error}: {r.stderr[-300:]}"
        else:
            outcome, detail = attack.judge(ctx, r, state)
    finally:
        for v in state.values():
            if isinstance(v, socket.socket):
                v.close()
    return {**row, "outcome": outcome, "detail": detail}


def run_all(ctx: Ctx, run: Callable, names: list[str] | None = None, workers: int = 4) -> list[dict]:
    """Every attack (or those named), `workers` at a time (the sandbox's own cap applies too)."""
    attacks = [BY_NAME[n] for n in names] if names is not None else ATTACKS
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda a: run_attack(a, ctx, run), attacks))


def table(rows: list[dict]) -> str:
    """A markdown table: one line per attack, one column per mode."""
    modes = [m for m in ("namespaces", "userns", "plain", "space") if any(r["mode"] == m for r in rows)]
    by = {(r["attack"], r["mode"]): r for r in rows}
    lines = ["| attack | hostile | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for a in ATTACKS:
        cells = []
        for m in modes:
            r = by.get((a.name, m))
            cells.append("" if r is None else r["outcome"] + (" (proxy)" if r["proxy"] else ""))
        lines.append(f"| {a.name} | {a.where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

