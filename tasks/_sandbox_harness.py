"""The child side of tasks/sandbox.py: runs in a fresh `python -I -B -u` process, never imported
by the app. Read sandbox.py's docstring first; this file only does what it describes.

Three processes; only the last one runs candidate code.
- The supervisor (this process): reads the request (JSON on stdin, incl. the nonce that keys
  the result MAC); in "namespaces" mode unshares mount, network, PID, IPC and UTS namespaces
  (the new PID namespace applies to its children); forks the init and waits for it.
- The init (pid 1 of the new PID namespace when there is one; when it exits the kernel kills
  every process left in it, setsid() or not): still (namespace) root, mounts its /proc, hides
  unreachable parents of the Python install, makes every mount read-only and gives the work
  dir and /dev/shm fresh size-capped tmpfs mounts; forks the runner, reaps orphans, and when
  the runner ends reports how ("X" line: exact wait status and CPU seconds), then exits.
  The candidate is not pid 1 itself so that signals (SIGXCPU, SIGABRT, kill) behave normally.
- The runner: rlimits, no_new_privs, drops to the sandbox uid, asks for SIGKILL when the init
  dies; captures every object the verdicts depend on (exec, compile, os.write, the keyed MAC,
  BaseException, ...) BEFORE any candidate code runs, so monkeypatching builtins or modules
  afterwards cannot change how a verdict is computed or reported; execs setup + code, then
  each test, each in its own try; reports each verdict on the private result fd as one MAC'd
  line; os._exit (no atexit hooks, no threads joined).

Result lines: "<mac hex> <message>" with messages
  "S <ok 0|1> <error hex>"   setup + candidate code ran (or failed)
  "T <index> <ok 0|1> <error hex>"
  "F memory"                  a MemoryError: the interpreter is no longer trustworthy, stop
  "D"                         the runner reported every test
  "X <wait status> <cpu s>"   the init: how the runner ended (last line)
"""
import builtins
import ctypes
import hashlib
import json
import os
import resource
import signal
import sys

_ERR_CHARS = 300  # per-test error text kept; a line must stay below PIPE_BUF (4096) to be atomic

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_MOUNT_SETATTR = 442  # same number on every architecture (generic syscall table, Linux 5.12+)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    _check(_libc.mount(src and os.fsencode(src), os.fsencode(target), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def unshare_namespaces():
    """Supervisor. The PID namespace applies to the children forked after this."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare")
    # Our mount changes must never propagate back to the host's mounts.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def confine_filesystem(cfg):
    """Init (pid 1 of the new PID namespace, still root there)."""
    # A /proc that shows only this namespace's processes (not the app's environ, say).
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # A dropped uid cannot traverse e.g. /root (0700) where pyenv put Python: mount a tmpfs over
    # such a parent (which also hides the rest of it, e.g. ~/.cache tokens) and bind the needed
    # directories back in. Fds are opened first because the tmpfs shadows their paths.
    for parent, paths in cfg["reach"]:
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in paths]
        _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p, fd in zip(paths, fds):
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            os.close(fd)
    # Everything read-only (and nosuid) in one recursive call: this only changes our private
    # copies of the mounts, never the host's.
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                         ctypes.sizeof(attr)), "mount_setattr / read-only")
    # Writable places, mounted after the read-only pass so they stay writable, size-capped, and
    # gone when the namespace dies: nothing the candidate writes ever lands on the host.
    owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
    _mount("tmpfs", cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['tmpfs_mb']}m,nr_inodes=4096,mode=0700{owner}")
    if os.path.isdir("/dev/shm"):  # multiprocessing's semaphores live there
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size=16m,mode=1777")


def apply_limits(cfg):
    """Runner. rlimits are per process and inherited by everything the candidate forks."""
    lim = cfg["limits"]
    mb = 1024 * 1024
    for res, soft, hard in [
        (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),  # SIGXCPU, then SIGKILL
        (resource.RLIMIT_AS, lim["memory_mb"] * mb, lim["memory_mb"] * mb),
        (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
        (resource.RLIMIT_FSIZE, lim["max_file_mb"] * mb, lim["max_file_mb"] * mb),
        (resource.RLIMIT_NOFILE, lim["max_open_files"], lim["max_open_files"]),
        (resource.RLIMIT_CORE, 0, 0),  # SIGXCPU would otherwise dump core into the work dir
    ]:
        resource.setrlimit(res, (soft, hard))
    # A too-big file should fail the write (OSError: EFBIG), not kill the whole run.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # No setuid binary can give privileges back (sudo, su, ping ...).
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # last: after this nothing above can be undone
    # After the uid change, which clears it. If the init is killed (timeout), so are we;
    # the sandbox's process-group kill covers the instant before this.
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def main():
    chunks = []
    while True:
        b = os.read(0, 1 << 20)
        if not b:
            break
        chunks.append(b)
    cfg = json.loads(b"".join(chunks))
    del chunks
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # input() gets EOF, never the request
    os.close(devnull)
    if cfg["namespaces"]:
        unshare_namespaces()
    _, status, _ = os.wait4(_fork(init, cfg), 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _fork(fn, cfg) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn(cfg)  # ends in os._exit
        except BaseException:  # setting up the sandbox itself failed: say why on stderr
            import traceback
            traceback.print_exc()
        os._exit(70)
    return pid


def init(cfg):
    if cfg["confine"]:
        confine_filesystem(cfg)
    pid = _fork(runner, cfg)
    while True:  # reap orphans (we are their init) until the runner itself ends
        reaped, status, ru = os.wait4(-1, 0)
        if reaped == pid:
            break
    mac = hashlib.blake2b(key=bytes.fromhex(cfg["nonce"]), digest_size=16)
    msg = f"X {status} {ru.ru_utime + ru.ru_stime:.3f}"
    mac.update(msg.encode())
    os.write(cfg["results_fd"], f"{mac.hexdigest()} {msg}\n".encode())
    os._exit(0)


def runner(cfg):
    os.chdir(cfg["workdir"])  # again: a tmpfs may now cover the directory we started in
    apply_limits(cfg)

    # Capture. Locals of this frame, not module attributes or builtins, so that
    # `builtins.exec = ...`, `os.write = ...`, `hashlib.blake2b = ...`, redefining __import__ or
    # AssertionError afterwards change nothing below. blake2b/str/bytes are C types: their
    # methods cannot be monkeypatched.
    mac = hashlib.blake2b(key=bytes.fromhex(cfg.pop("nonce")), digest_size=16)
    new_mac, write, exit_, fd = mac.copy, os.write, os._exit, cfg["results_fd"]
    exec_, compile_, type_, str_, range_ = exec, compile, type, str, range
    Base, MemErr, bytes_hex, err_chars = BaseException, MemoryError, bytes.hex, _ERR_CHARS
    flush_targets = (sys.stdout, sys.stderr)

    def report(msg):
        m = new_mac()
        m.update(msg.encode())
        try:
            write(fd, (m.hexdigest() + " " + msg + "\n").encode())
        except Base:  # fd closed or replaced by the candidate: the parent sees no "D" and
            exit_(3)  # marks the run untrusted

    def describe(e):
        try:
            detail = str_(e)
            text = type_(e).__name__ + (": " + detail if detail else "")
        except Base:
            text = "<exception that cannot be printed>"
        return bytes_hex(text[:err_chars].encode("utf-8", "replace"))

    def run(source, filename, ns):
        """'' if `source` ran without raising, else the hex error; memory errors end the run."""
        try:
            exec_(compile_(source, filename, "exec", dont_inherit=True), ns)
            return ""
        except MemErr:
            report("F memory")
            exit_(4)
        except Base as e:  # SystemExit and KeyboardInterrupt included: not a pass
            return describe(e)

    # Not "__main__": the `if __name__ == "__main__":` demo blocks models like to add (input(),
    # prints) are not part of the answer and must not run.
    ns = {"__name__": "__candidate__", "__builtins__": builtins}
    tests = tuple(cfg.pop("tests"))  # immutable: nothing the candidate holds can edit it
    indices = range_(len(tests))  # computed now: `len`/`range` may be patched by then
    err = run(cfg["setup"] + "\n", "<setup>", ns) if cfg["setup"] else ""
    if not err:
        err = run(cfg["code"], "<candidate>", ns)
    report("S 0 " + err if err else "S 1 ")
    if not err:
        for i in indices:
            err = run(tests[i], f"<test {i}>", ns)
            report(f"T {i} 0 {err}" if err else f"T {i} 1 ")
    for f in flush_targets:  # -u makes these unbuffered already; belt and braces
        try:
            f.flush()
        except Base:
            pass
    report("D")
    exit_(0)


if __name__ == "__main__":
    main()
