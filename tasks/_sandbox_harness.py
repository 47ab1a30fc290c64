"""The child side of tasks/sandbox.py: runs in a fresh `python -I -B -u` process, never imported
by the app. Read sandbox.py's docstring first; this file only does what it describes.

No process that runs candidate code can produce a verdict: the verdicts are decided by a judge
that never runs candidate code and holds the result fd and the MAC key; the candidate's code runs
in workers that hold neither, and never saw a test (tasks/_sandbox_rpc.py: the wire between them).

Processes (all at nice 19, inherited by everything the candidate starts):
- the supervisor (this process, its code compiled on stdin ahead of the request): reads the
  request (code, setup, limits, view; the tests and the MAC key wait in a sealed memfd for the
  judge alone), unshares the namespaces in the strong modes, forks the init and waits;
- the init (pid 1 of the new PID namespace where there is one): builds and enters the minimal
  filesystem view (build_root), forks the judge and then the workers before it reads the key,
  reaps orphans, and reports how the main worker ("W") and the judge ("X") ended;
- the judge: confined (rlimits, no_new_privs, drop_privileges, Landlock where asked, not
  dumpable); reads the tests and the key, runs setup and each test itself with the candidate's
  names bound to `Remote` handles, reports each verdict as one MAC'd line, then the probe;
- a worker: confined like the judge (and scoped for signals where Landlock has ABI 6), holding
  only its pipes; serves the judge's calls (_sandbox_rpc.Worker).

Result lines: "<mac hex> <message>", messages "S" (setup + code ran), "T <index> ..." (a test),
"F memory", "E" (the main worker ended while needed), "D" (every test reported), "C ..." (the
cooperation probe of a passed test), "P" (probe finished), "W" and "X" (how the main worker and
the judge ended; "X" is last). Each process's steps and each line's fields: docs/SANDBOX.md
"The harness's processes, result lines and wire".
"""
import binascii
import builtins
import contextlib
import ctypes
import errno
import hashlib
import json
import marshal
import os
import resource
import signal
import sys
import types

_ERR_CHARS = 300  # per-test error text kept; a line must stay below PIPE_BUF (4096) to be atomic
NICE = 19  # the lowest normal priority (why not SCHED_IDLE: docs/SANDBOX.md)
NS_UID = 1000  # "userns": the code's uid inside its own nested user namespace (not root there)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
RO = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
SYS_MOUNT_SETATTR = 442  # same number on every architecture (generic syscall table, Linux 5.12+)
# glibc has no pivot_root wrapper; the number differs per architecture
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41, "ppc64le": 203,
                  "ppc64": 203, "s390x": 217}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAPABILITY_VERSION_3 = 0x20080522
# Landlock (Linux 5.13+): the generic syscall table, the same numbers on every architecture
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

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


def _setattr(path, attrs, recursive):
    """mount_setattr(2): add `attrs` to the mount at `path` (and every mount below it)."""
    attr = _MountAttr(attrs, 0, 0, 0)
    _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), os.fsencode(path),
                         ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr {path}")


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def unshare_namespaces():
    """Supervisor. The PID namespace applies to the children forked after this."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
                         | CLONE_NEWCGROUP), "unshare")
    # Our mount changes must never propagate back to the host's mounts.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def build_root(cfg):
    """Init (pid 1 of the new PID namespace, root there). A fresh tmpfs becomes "/", holding only
    cfg["view"] (read-only binds of the system and Python dirs, symlinks like /lib -> usr/lib,
    empty folders over answer keys),
    a minimal /dev, this namespace's /proc and the work dir; then pivot_root into it and detach
    the host's root, so that no other host path exists for anything started later."""
    os.umask(0o022)
    new = cfg["workdir"]  # any directory works as the mount point; this one exists already

    def at(path):
        return new + path

    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for kind, path, target in cfg["view"]:
        if kind == "hide":   # an empty read-only folder over one inside a bind (sandbox.ANSWER_KEYS)
            _mount("tmpfs", at(path), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=4,mode=0555")
            _setattr(at(path), RO, False)
            continue
        os.makedirs(at(os.path.dirname(path)), exist_ok=True)
        if kind == "link":
            os.symlink(target, at(path))
        else:
            os.makedirs(at(path), exist_ok=True)
            _mount(path, at(path), None, MS_BIND | MS_REC)
            _setattr(at(path), RO, True)
    # /dev: the five harmless character devices bound from the host (a userns cannot mknod),
    # the usual links, a fresh /dev/shm for multiprocessing's semaphores.
    os.mkdir(at("/dev"))
    _mount("tmpfs", at("/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for dev in DEVICES:
        os.close(os.open(at(dev), os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(dev, at(dev), None, MS_BIND)
        # read-only mounts still let device nodes be written (/dev/null); nodev must stay off
        _setattr(at(dev), MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, at("/dev/" + name))
    os.mkdir(at("/dev/shm"))
    _setattr(at("/dev"), RO | MOUNT_ATTR_NOEXEC, False)  # the tmpfs itself; the binds keep theirs
    _mount("tmpfs", at("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
    # A /proc that shows only this namespace's processes, and with subset=pid (Linux 5.8+) none
    # of the host's /proc/sys, /proc/meminfo, /proc/kallsyms... Mounted while the host's full
    # /proc is still visible (a user namespace may only mount proc then). Read-only, except in
    # "userns" where the runner writes its uid_map first and then makes it read-only.
    os.mkdir(at("/proc"))
    try:
        _mount("proc", at("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "subset=pid")
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _mount("proc", at("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # older kernel
    if not cfg["nest_userns"]:
        _setattr(at("/proc"), RO | MOUNT_ATTR_NOEXEC, False)
    # The work dir, at its host path (cwd, HOME and TMPDIR point there): size-capped, gone
    # when the namespace dies, so nothing the candidate writes ever lands on the host.
    work = at(cfg["workdir"])
    os.makedirs(work)
    owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['tmpfs_mb']}m,nr_inodes=4096,mode=0700{owner}")
    _setattr(new, RO, False)  # the skeleton itself (its parents of the binds, /tmp, ...)
    os.chdir(new)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: syscall number unknown for {os.uname().machine}; "
                                    "add it to SYS_PIVOT_ROOT in tasks/_sandbox_harness.py")
    _check(_libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    # The host's root now sits on top of ".": detach it (and every mount below it) for good.
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")


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
        (resource.RLIMIT_NICE, 0, 0),  # nice 19 cannot be lowered again
    ]:
        resource.setrlimit(res, (soft, hard))
    # A too-big file should fail the write (OSError: EFBIG), not kill the whole run.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # No setuid binary can give privileges back (sudo, su, ping ...).
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_privileges(cfg):
    """Runner, after apply_limits. Leaves no capability in any set and, where asked, another uid;
    verified in /proc/self/status (an unexpected state aborts the run: exit 70)."""
    uid = cfg["uid"]
    if cfg["nest_userns"]:
        # A user namespace of our own below the app's: the mount namespace that comes with it
        # copies every mount as MNT_LOCKED (cannot be unmounted to reveal what is below, and
        # the read-only ones cannot be made writable), whatever capabilities remain.
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(nested user + mount namespace)")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{NS_UID} {outer_uid} 1")
        _write("/proc/self/gid_map", f"{NS_UID} {outer_gid} 1")
        _setattr("/proc", RO | MOUNT_ATTR_NOEXEC, False)  # writable only for the maps above
        uid = None  # already NS_UID: the map made the app's uid appear as it
    privileged = cfg["nest_userns"] or os.geteuid() == 0
    if privileged:
        for cap in range(64):  # the bounding set: no exec can ever grant these again
            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # past the kernel's last capability
                    break
                _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # after this nothing above can be undone
    # Giving capabilities up is always allowed (a non-root app may hold ambient/file caps too).
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    _check(_libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)()), "capset")
    with open("/proc/self/status") as f:
        caps = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f if line.startswith("Cap"))}
    empty = ("CapInh", "CapPrm", "CapEff", "CapAmb") + (("CapBnd",) if privileged else ())
    if any(caps.get(k) for k in empty):
        raise OSError(errno.EPERM, f"capabilities left after dropping them: {caps}")
    # After the uid change, which clears it. If the init is killed (timeout), so are we;
    # the sandbox's process-group kill covers the instant before this.
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in linux/landlock.h
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_fs_rights(abi):
    """Every filesystem right the kernel's Landlock ABI knows (all of them are handled: denied
    unless a rule allows them)."""
    rights = (1 << 13) - 1  # ABI 1: execute .. make_sym
    for version, bit in ((2, 13), (3, 14), (5, 15)):  # refer, truncate, ioctl_dev
        if abi >= version:
            rights |= 1 << bit
    return rights


def restrict_with_landlock(ll):
    """Runner, after drop_privileges (no_new_privs is set, so no privilege is needed): a Landlock
    domain for this process and everything it starts. Files: read and execute beneath
    ll["read"] (the Python install and system libraries: what the strong modes' view shows),
    read and write the few devices, everything inside the work dir; nothing else (the store,
    COLLAB_HOME, the project, /tmp, served files, /proc of other processes). With ABI 4+ every
    TCP bind and connect is refused; with ABI 6+ signals and abstract unix sockets cannot reach
    any process outside the domain (the app, the trainer). Any failure aborts the run (exit 70):
    sandbox.py asked for it because the kernel offers it."""
    abi, handled = ll["abi"], landlock_fs_rights(ll["abi"])
    attr = _RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as the kernel's ABI knows it
    fd = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    _check(0 if fd >= 0 else -1, "landlock_create_ruleset")

    def allow(path, rights):
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = _PathBeneath(rights & handled, target)
            _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, fd, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0),
                   f"landlock_add_rule({path})")
        finally:
            os.close(target)

    for path in ll["read"]:
        allow(path, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)
    for path in ll["devices"]:
        allow(path, FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV)
    allow(ll["workdir"], handled)
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0), "landlock_restrict_self")
    os.close(fd)


def scope_signals(abi):
    """A worker, after _confine: a Landlock domain of its own that handles no file or network access
    but is scoped (ABI 6+): no signal and no abstract unix socket reaches a process outside it. So
    the candidate cannot signal the judge, which shares its uid (kill(-1), SIGSTOP), in any mode;
    without ABI 6 it can, which only ends its own check (so a failure here is not fatal either)."""
    if abi < 6:
        return
    attr = _RulesetAttr(0, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    fd = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24), 0)
    if fd >= 0:
        _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0)
        os.close(fd)


def load_module(name, compiled=None):
    """Supervisor: a module from the file beside this one (read now: later the view hides it), or
    from its code as sandbox.py compiled it (marshal, base64): compiling each time costs more
    than a check's tests."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    if compiled:
        code = marshal.loads(binascii.a2b_base64(compiled))
    else:
        with open(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    module.__file__ = path
    exec(code, module.__dict__)
    return module


def main():
    os.setpriority(os.PRIO_PROCESS, 0, NICE)  # visitor code never competes with serving
    # Not dumpable: in "plain" mode (no PID namespace) a worker of the same uid could otherwise
    # read this process's fds (the result pipe, the secrets memfd) through /proc.
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    chunks = []
    while True:
        b = os.read(0, 1 << 20)
        if not b:
            break
        chunks.append(b)
    cfg = json.loads(b"".join(chunks))
    del chunks
    # Loaded now: the judge (new root, Landlock domain, another uid) may no longer read the files.
    compiled = cfg.pop("compiled", None) or {}
    cfg["rpc"] = load_module("_sandbox_rpc", compiled.get("_sandbox_rpc"))
    cfg["make_probe"] = None
    if cfg.get("probe"):
        cfg["make_probe"] = load_module("_cooperation_probe", compiled.get("_cooperation_probe")).make_probe
        with open(cfg["rpc"].__file__) as f:  # what a restarted worker execs
            cfg["rpc"].SOURCE = f.read()
    cfg["python"] = os.path.realpath(sys.executable)  # what a restarted worker execs (in the view)
    cfg["sys_path"] = list(sys.path)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # input() gets EOF, never the request
    os.close(devnull)
    if cfg["namespaces"]:
        unshare_namespaces()
    pid = _fork(init, cfg)
    os.close(cfg["results_fd"])
    os.close(cfg["secrets_fd"])
    _, status, _ = os.wait4(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)  # ends in os._exit
        except BaseException:  # setting up the sandbox itself failed: say why on stderr
            import traceback
            traceback.print_exc()
        os._exit(70)
    return pid


def _close_all_but(keep):
    """Close every fd of this process except `keep` (close_range(2) where the kernel has it)."""
    low = 0
    for fd in sorted(keep) + [1 << 30]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1


def _confine(cfg):
    """Judge and workers alike: rlimits, no_new_privs, no capabilities (another uid or a nested user
    namespace), Landlock where sandbox.py asked for it; SIGKILL when the init dies."""
    os.chdir(cfg["workdir"])  # again: in the new root this is the fresh work tmpfs
    apply_limits(cfg)
    drop_privileges(cfg)
    if cfg.get("landlock"):
        restrict_with_landlock(cfg["landlock"])


def _read_secrets(fd):
    chunks, off = [], 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        off += len(b)


def init(cfg):
    # Not dumpable: the candidate (same kernel uid in "userns" and "plain") cannot ptrace us,
    # read /proc/1/mem or walk /proc/1/root (our mount namespace, where /proc is writable).
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    if cfg["confine"]:
        build_root(cfg)
    # per worker: (judge reads, worker writes), (worker reads, judge writes)
    pipes = [(os.pipe(), os.pipe()) for _ in range(2 if cfg.get("probe") else 1)]
    every = [fd for (a, b) in pipes for fd in (*a, *b)]
    judge_pid = _fork(judge, cfg, [(up[0], down[1]) for up, down in pipes])
    workers = [_fork(worker, cfg, down[0], up[1]) for up, down in pipes]
    for fd in every:
        os.close(fd)
    ended = {}
    while judge_pid not in ended:  # reap orphans (we are their init) until the judge ends
        reaped, status, ru = os.wait4(-1, 0)
        if reaped in (judge_pid, workers[0]):
            ended[reaped] = (status, ru.ru_utime + ru.ru_stime)
    if workers[0] not in ended:  # still there: how it ends now is ours, and never read (no "E")
        with contextlib.suppress(OSError):
            os.kill(workers[0], signal.SIGKILL)
        _, status, ru = os.wait4(workers[0], 0)
        ended[workers[0]] = (status, ru.ru_utime + ru.ru_stime)
    # The key only now: every process that runs candidate code was forked before this.
    key = bytes.fromhex(json.loads(_read_secrets(cfg["secrets_fd"]))["key"])
    for kind, pid in (("W", workers[0]), ("X", judge_pid)):
        mac = hashlib.blake2b(key=key, digest_size=16)
        msg = f"{kind} {ended[pid][0]} {ended[pid][1]:.3f}"
        mac.update(msg.encode())
        os.write(cfg["results_fd"], f"{mac.hexdigest()} {msg}\n".encode())
    os._exit(0)


def worker(cfg, rfd, wfd):
    """Forked by the init before it read anything secret: no key, no test in this memory."""
    _close_all_but({0, 1, 2, rfd, wfd})  # the result fd and the secrets memfd above all
    _confine(cfg)
    scope_signals(cfg.get("kernel_landlock", 0))
    cfg["rpc"].Worker(rfd, wfd, seeded=bool(cfg.get("probe"))).serve()  # ends in os._exit


def spawn_exec(cfg):
    """Judge: a replacement worker, exec'd as a fresh interpreter (this memory holds the key and the
    tests) on fds 3 and 4, confined like the judge by inheritance; its Conn, once ready."""
    import fcntl
    rpc = cfg["rpc"]
    (req_r, req_w), (rep_r, rep_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            a, b = fcntl.fcntl(req_r, fcntl.F_DUPFD, 10), fcntl.fcntl(rep_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)
            _close_all_but({0, 1, 2, 3, 4})
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
            scope_signals(cfg.get("kernel_landlock", 0))  # a domain below the judge's: cannot signal it
            os.execv(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-u", "-c",
                                     rpc.SOURCE + "\nexec_main()\n", json.dumps(cfg["sys_path"])])
        except BaseException:
            import traceback
            traceback.print_exc()
        os._exit(70)
    os.close(req_r)
    os.close(rep_w)
    conn = rpc.Conn(rep_r, req_w, pid, "restarted")
    conn.child_pid = pid  # ours to reap once it is killed
    conn.ready()
    return conn


class _Session:
    """The judge's workers for the cooperation probe: "main" (the verdicts' worker) and "aux",
    each replaced by a fresh exec'd one once it is dead (ended, or killed mid-request)."""

    def __init__(self, cfg, conns, names):
        self.cfg, self.rpc = cfg, cfg["rpc"]
        self.conns = {"main": conns[0], "aux": conns[1]}
        self.names = names  # what the code defined, as it loaded: ("R", type name) or ("V", value)

    def live(self, role):
        c = self.conns[role]
        if c.dead is None:
            return c
        if getattr(c, "child_pid", None):  # (killed by now: Conn.kill)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(c.child_pid, 0)
        c = self.conns[role] = spawn_exec(self.cfg)
        return c


def judge(cfg, chans):
    _close_all_but({0, 1, 2, cfg["results_fd"], cfg["secrets_fd"], *(fd for c in chans for fd in c)})
    _confine(cfg)
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    secrets = json.loads(_read_secrets(cfg["secrets_fd"]))
    os.close(cfg["secrets_fd"])
    mac = hashlib.blake2b(key=bytes.fromhex(secrets.pop("key")), digest_size=16)
    tests = tuple(secrets.pop("tests"))
    new_mac, write, exit_, fd = mac.copy, os.write, os._exit, cfg["results_fd"]
    exec_, compile_, type_, str_ = exec, compile, type, str
    Base, MemErr, bytes_hex, err_chars = BaseException, MemoryError, bytes.hex, _ERR_CHARS
    rpc = cfg["rpc"]
    WorkerGone = rpc.WorkerGone

    def report(msg):
        m = new_mac()
        m.update(msg.encode())
        try:
            write(fd, (m.hexdigest() + " " + msg + "\n").encode())
        except Base:  # cannot happen short of a broken pipe: the parent sees no "D"
            exit_(3)

    conns = [rpc.Conn(r, w, name="main" if i == 0 else "aux") for i, (r, w) in enumerate(chans)]
    for c in conns:
        try:
            c.ready()
        except WorkerGone as e:
            sys.stderr.write(f"the sandbox's {c.name} worker did not start: {e}\n")
            exit_(70)
    main_w = conns[0]

    def describe(e):
        try:
            detail = str_(e)
            text = type_(e).__name__ + (": " + detail if detail else "")
        except Base:
            text = "<exception that cannot be printed>"
        return bytes_hex(text[:err_chars].encode("utf-8", "replace"))

    def stop_if_gone():
        """The main worker died or broke the protocol: nothing after this counts (a test that
        swallowed the WorkerGone is not a pass)."""
        if main_w.dead is None:
            return
        if main_w.memory:
            report("F memory")
            exit_(4)
        report("E")
        exit_(0)

    def run(source, filename, ns, quiet=False):
        """'' if `source` ran without raising, else the hex error; memory errors end the run.
        quiet: without output (setup: its output comes from the worker's run of it)."""
        saved = sys.stdout, sys.stderr
        try:
            if quiet:
                sys.stdout = sys.stderr = open(os.devnull, "w")
            exec_(compile_(source, filename, "exec", dont_inherit=True), ns)
            return ""
        except MemErr:
            report("F memory")
            exit_(4)
        except Base as e:  # SystemExit and KeyboardInterrupt included: not a pass
            return describe(e)
        finally:
            if quiet:
                sys.stdout, sys.stderr = saved

    ns = {"__name__": "__candidate__", "__builtins__": builtins}
    setup, code = cfg["setup"], cfg["code"]
    passed, first = [], {}
    err = run(setup + "\n", "<setup>", ns, quiet=True) if setup else ""
    if not err:
        try:
            names = main_w.init(setup, code)
            if cfg["make_probe"] is not None:  # as the code left them, before a test changes a value
                first = {k: ("R", v._tname) if type_(v) is rpc.Remote else ("V", rpc.plain_copy(v))
                         for k, v in names.items()}
            ns.update(names)
        except MemErr:
            report("F memory")
            exit_(4)
        except WorkerGone:
            stop_if_gone()
        except Base as e:
            err = describe(e)
    stop_if_gone()
    report("S 0 " + err if err else "S 1 ")
    if not err:
        for i in range(len(tests)):
            err = run(tests[i], f"<test {i}>", ns)
            stop_if_gone()
            report(f"T {i} 0 {err}" if err else f"T {i} 1 ")
            if not err:
                passed.append(i)
    for f in (sys.stdout, sys.stderr):  # -u makes these unbuffered already; belt and braces
        try:
            f.flush()
        except Base:
            pass
    report("D")
    if cfg["make_probe"] is not None:  # every verdict is out: the probe can only lose itself
        probe = cfg["make_probe"](cfg["probe"], tests, setup, code, _Session(cfg, conns, first), report, Base)
        probe(passed)  # (none passed when the code failed: it just says "P")
    exit_(0)


if __name__ == "__main__":
    main()
