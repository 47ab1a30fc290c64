"""The child side of tasks/sandbox.py: runs in a fresh `python -I -B -u` process, never imported
by the app. Read sandbox.py's docstring first; this file only does what it describes.

Three processes; only the last one runs candidate code. All run at nice 19 (set first thing,
inherited by everything the candidate starts).
- The supervisor (this process): reads the request (JSON on stdin, incl. the nonce that keys
  the result MAC); in "namespaces"/"userns" mode unshares mount, network, PID, IPC, UTS and
  cgroup namespaces (the new PID namespace applies to its children); forks the init and waits.
- The init (pid 1 of the new PID namespace when there is one; when it exits the kernel kills
  every process left in it, setsid() or not): makes itself non-dumpable (no ptrace, no
  /proc/1/mem or /proc/1/root for the candidate), still (namespace) root; with `confine` it
  builds the minimal filesystem view (build_root: a fresh tmpfs with only the dirs in
  cfg["view"] bound read-only, a minimal /dev, a /proc of this PID namespace, the work dir)
  and pivot_roots into it, detaching the host's root; forks the runner, reaps orphans, and
  when the runner ends reports how ("X" line: exact wait status and CPU seconds), then exits.
  The candidate is not pid 1 itself so that signals (SIGXCPU, SIGABRT, kill) behave normally.
- The runner: rlimits, no_new_privs, then drop_privileges, then (where sandbox.py asks for it,
  the "plain" mode on a kernel with Landlock) restrict_with_landlock: "userns" enters a nested user +
  mount namespace (every mount becomes MNT_LOCKED: it cannot be unmounted or made writable
  again), maps a non-root uid there, makes /proc read-only; every mode drops all capabilities
  (bounding, ambient, effective, permitted, inheritable) and, with a separate uid, switches to
  it; the result is checked in /proc/self/status before anything else runs. It asks for
  SIGKILL when the init dies; captures every object the verdicts depend on (exec, compile,
  os.write, the keyed MAC, BaseException, ...) BEFORE any candidate code runs, so
  monkeypatching builtins or modules afterwards cannot change how a verdict is computed or
  reported; execs setup + code, then each test, each in its own try; reports each verdict on
  the private result fd as one MAC'd line; os._exit (no atexit hooks, no threads joined).

Result lines: "<mac hex> <message>" with messages
  "S <ok 0|1> <error hex>"   setup + candidate code ran (or failed)
  "T <index> <ok 0|1> <error hex>"
  "F memory"                  a MemoryError: the interpreter is no longer trustworthy, stop
  "D"                         the runner reported every test
  "C <index> <status> <aux calls> <wrapper 0|1> <site hex>=<0|1>,...|-"
                              cooperation probe of one passed test (only when asked; see
                              make_probe), after "D"
  "P"                         the probe finished
  "X <wait status> <cpu s>"   the init: how the runner ended (last line)
"""
import builtins
import ctypes
import errno
import hashlib
import json
import os
import resource
import signal
import sys

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
    cfg["view"] (read-only binds of the system and Python dirs, symlinks like /lib -> usr/lib),
    a minimal /dev, this namespace's /proc and the work dir; then pivot_root into it and detach
    the host's root, so that no other host path exists for anything started later."""
    os.umask(0o022)
    new = cfg["workdir"]  # any directory works as the mount point; this one exists already

    def at(path):
        return new + path

    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for kind, path, target in cfg["view"]:
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


def main():
    os.setpriority(os.PRIO_PROCESS, 0, NICE)  # visitor code never competes with serving
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
    # Not dumpable: the candidate (same kernel uid in "userns" and "plain") cannot ptrace us,
    # read /proc/1/mem or walk /proc/1/root (our mount namespace, where /proc is writable).
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    if cfg["confine"]:
        build_root(cfg)
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
    os.chdir(cfg["workdir"])  # again: in the new root this is the fresh work tmpfs
    apply_limits(cfg)
    drop_privileges(cfg)
    if cfg.get("landlock"):
        restrict_with_landlock(cfg["landlock"])

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
    probe = (make_probe(cfg["probe"], tests, cfg["setup"], cfg["code"], exec_, compile_, report, Base)
             if cfg.get("probe") else None)  # built now, before candidate code, like the rest
    passed = []
    err = run(cfg["setup"] + "\n", "<setup>", ns) if cfg["setup"] else ""
    if not err:
        err = run(cfg["code"], "<candidate>", ns)
    report("S 0 " + err if err else "S 1 ")
    code_ok = not err
    if code_ok:
        for i in indices:
            err = run(tests[i], f"<test {i}>", ns)
            report(f"T {i} 0 {err}" if err else f"T {i} 1 ")
            if not err:
                passed.append(i)
    for f in flush_targets:  # -u makes these unbuffered already; belt and braces
        try:
            f.flush()
        except Base:
            pass
    report("D")
    if probe is not None:  # every verdict is out: the probe can only lose itself
        probe(passed)  # (none passed when the code failed: it just says "P")
    exit_(0)


# ------------------------------------------------------------------------ cooperation probe
# Run-time evidence for the coding task's cooperation level (tasks/coding.py explains the
# levels): does the entry function really CALL the helper's `aux` while a test passes, which
# call sites' results it USES (they reach its return value), and whether it only passes one
# result on (a thin wrapper)? Asked for with cfg["probe"] = {"entry", "aux", "budget_s"}; runs
# after every test verdict was reported ("D"), so nothing here can change a verdict, and a
# probe that hangs or crashes loses only the probe.
#
# Per test that passed, each trial in a FRESH namespace (setup + code exec'd again, so state a
# previous test left, e.g. a memo cache, cannot hide calls), with the helper's aux and the
# entry function replaced by recording wrappers:
#   baseline  the test as is: which call sites of aux ran and returned while the entry function
#             ran (outermost calls: aux's own recursion does not count), the entry function's
#             outcome per outermost call, and a copy of each aux result taken as it was returned
#             (builtin containers copied all the way down, so that main changing the result in
#             place afterwards shows).
#   control   the baseline again: a different outcome means the code is nondeterministic and
#             the test proves nothing (no credit from it).
#   (every trial starts with random.seed(0), so tests that draw random inputs draw the same)
#   perturbed some of aux's results replaced by different values ("shift": ~n, -x-1.5, s+"\0",
#             elementwise for containers; then "flip": falsy <-> truthy; then "grow": numbers
#             up to 2|x|+7 / 2|x|+1.5, the other side of a threshold); None and other types
#             become a poison object that raises on any use. A replacement depends on the value
#             alone: equal results get equal replacements. The replaced results change the
#             outcome if the entry function's outcomes change (floats within a relative 1e-9
#             count as equal: `s + p - p` differs from s by rounding only), or if it no longer
#             returns within max(0.25 s, 5 x the baseline's time).
# Per call site two sets are replaced: ALONE, the results of that site; TOGETHER, those and the
# result of every call, at any site, that returned a value equal to one returned at this site
# (as a different aux would: it cannot answer two equal results differently). TOGETHER is the
# same set as ALONE, and is not run again, when no other site returned such a value. A site is
# USED when both sets change the outcome. Why both: alone, each site of `s + aux(x) - aux(x)`
# changes the sum, together they cancel out (no use); together, the bare call in
# `r = aux(x); aux(x); return r + 1` changes the outcome through r, alone it changes nothing
# (its result is dropped). Replacing every site at once instead would let a cancelling pair
# hide beside a real use (`aux(x) + aux(y) - aux(y)`).
#   thin wrapper  each outermost call of the entry function that got results from used sites
#             returned a value equal to every one of those results (copies as returned), up
#             to a conversion: an equal int/float/complex, or int/float/complex/str/list/tuple/
#             set/frozenset of a builtin result (never bool: `aux(x) > 5` is a predicate). So
#             `return aux(x)`, `return float(aux(x))` and `max(aux(x), aux(x))` are thin
#             wrappers; `max(aux(a), aux(b))` (two different used results) and
#             `r = aux(xs); r.append(0); return r` (not the value aux returned) are not. A
#             result whose site is not used never counts, so an extra ignored call cannot turn
#             a wrapper into real work.
# Counterfactual dependence, not syntax: `_ = aux(x)`, `r = aux(x); r = r*0 + g(x)`,
# `if False: aux(x)` show no dependence whatever the code looks like.

def make_probe(pcfg, tests, setup, code, exec_, compile_, report, Base):
    """Built BEFORE any candidate code runs: every builtin it uses is captured here, so that
    patching builtins later cannot change how the probe judges."""
    type_, len_, str_, repr_, callable_, builtins_ = type, len, str, repr, callable, builtins
    sum_, zip_, any_, all_, abs_ = sum, zip, any, all, abs
    bool_, int_, float_, complex_, bytes_ = bool, int, float, complex, bytes
    list_, tuple_, dict_, set_, frozenset_, getframe = list, tuple, dict, set, frozenset, sys._getframe
    none_, getattr_ = type(None), getattr
    setitimer, set_signal = signal.setitimer, signal.signal
    import math
    import random  # tests that draw random inputs (HumanEval/38) must draw the same ones per trial
    import time
    seed, monotonic, isclose = random.seed, time.monotonic, math.isclose
    ITIMER_REAL, SIGALRM, open_, devnull, sys_ = signal.ITIMER_REAL, signal.SIGALRM, open, os.devnull, sys
    bytes_hex = bytes.hex
    entry, aux_name, budget = pcfg["entry"], pcfg["aux"], float(pcfg["budget_s"])
    max_sites, max_items = 8, 10_000  # call sites probed per test; container items perturbed or copied
    max_group = 64  # distinct container values per site a TOGETHER set matches (numbers, strings: all)
    trial_floor_s, trial_factor = 0.25, 5.0  # a perturbed run may take max(0.25 s, 5 x the baseline's)
    # types are compared with `is`, never `==` (a candidate's metaclass could define __eq__)
    atoms = (bool_, int_, float_, complex_, str_, bytes_, none_)  # hashable without candidate code
    numbers = (bool_, int_, float_, complex_)
    conversions = (int_, float_, complex_, str_, list_, tuple_, set_, frozenset_)
    builtin_values = atoms + (list_, tuple_, set_, frozenset_, dict_)

    def is_one(t, types):
        for x in types:
            if t is x:
                return True
        return False

    class Stop(BaseException):
        """A trial's deadline passed (raised into candidate code by SIGALRM)."""

    class Poisoned(BaseException):  # not an Exception: `except Exception` in the code cannot eat it
        pass

    class TooBig(Exception):
        pass

    class Poison:
        __slots__ = ()

    def _raise(*a, **k):
        raise Poisoned("aux's result was replaced by the cooperation probe")

    for _n in ("__bool__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
               "__iter__", "__len__", "__getitem__", "__setitem__", "__contains__", "__getattr__",
               "__call__", "__index__", "__int__", "__float__", "__complex__", "__str__", "__repr__",
               "__format__", "__bytes__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
               "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
               "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__and__",
               "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__",
               "__invert__", "__round__", "__enter__", "__reversed__"):
        setattr(Poison, _n, _raise)
    poison = Poison()
    # in: candidate code is running (only then may Stop be raised); deadline: of this trial;
    # end: of the whole probe phase; expired: the phase is over
    st = {"in": False, "expired": False, "deadline": 0.0, "end": 0.0}
    compiled = {}

    def on_alarm(signum, frame):  # every 50 ms: a swallowed Stop comes back
        now = monotonic()
        if now >= st["end"]:
            st["expired"] = True
        if st["in"] and now >= st["deadline"]:
            raise Stop()

    def perturb(v, mode, depth=0):
        """A different value of the same builtin type (never runs candidate code); else poison."""
        t = type_(v)
        if depth > 3:
            return v
        if t is bool_:
            return not v
        if t is int_:
            return (0 if v else 1) if mode == "flip" else abs_(v) * 2 + 7 if mode == "grow" else ~v
        if t is float_:
            if mode == "flip":
                return 0.0 if v else 1.0
            p = abs_(v) * 2 + 1.5 if mode == "grow" else -v - 1.5
            return p if p != v else v + 1.0  # (-0.75 is its own -v-1.5; nan becomes poison)
        if t is complex_:
            return (0j if v else 1 + 0j) if mode == "flip" else -v - (1.5 + 1j)
        if mode == "grow":  # numbers only (the other side of a threshold); nothing else changes
            return v
        if t is str_ or t is bytes_:
            if mode == "flip":
                return v[:0] if v else (v + ("a" if t is str_ else b"a"))
            return v + ("\x00" if t is str_ else b"\x00")
        if t is list_ or t is tuple_ or t is set_ or t is frozenset_:
            if mode == "flip" or not v:
                return t(()) if v else t((0,))
            items = list_(v)
            return t([perturb(x, mode, depth + 1) for x in items[:max_items]] + items[max_items:])
        if t is dict_:
            if mode == "flip" or not v:
                return {} if v else {0: 0}
            return {k: perturb(x, mode, depth + 1) for k, x in v.items()}
        return poison

    def safe_perturb(v, mode):
        try:
            p = perturb(v, mode)
        except Base:
            return poison
        return poison if (type_(p) is float_ and p != p) else p  # nan compares unequal anyway

    def copy_of(v):
        """v as it is now, for comparing with what main returns later: builtin containers copied
        all the way down (at most max_items items in all); anything else, or a result too big to
        copy, kept as the object itself."""
        left = [max_items]

        def cp(x, depth):
            t = type_(x)
            if t is list_ or t is tuple_ or t is dict_ or t is set_:
                left[0] -= len_(x) + 1
                if left[0] < 0 or depth > 20:
                    raise TooBig()
                if t is set_:  # members are hashable, so immutable or compared by identity
                    return set_(x)
                if t is dict_:
                    return {k: cp(y, depth + 1) for k, y in x.items()}
                return t([cp(y, depth + 1) for y in x])
            return x
        try:
            return cp(v, 0)
        except TooBig:
            return v

    def same(a, b, strict_type=True):
        """a and b are the same result (the same object, or equal values of the same type; repr
        equality catches nan). Anything that raises counts as different."""
        if a is b:
            return True
        if type_(a) is Poison or type_(b) is Poison or (strict_type and type_(a) is not type_(b)):
            return False
        try:
            if (a == b) is True:
                return True
            return type_(a) is type_(b) and repr_(a) == repr_(b)
        except Base:
            return False

    def close(a, b, depth=0):
        """Outcomes a and b agree: `same`, with floats (also inside lists and tuples) equal
        within a relative 1e-9 (absolute 1e-12 near zero)."""
        if same(a, b):
            return True
        t = type_(a)
        if type_(b) is not t:
            return False
        if t is float_:
            return isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        if (t is list_ or t is tuple_) and depth < 4 and len_(a) == len_(b) <= max_items:
            return all_(close(x, y, depth + 1) for x, y in zip_(a, b))
        return False

    def passes_on(ret, r):
        """ret is the result r passed on: the same result, an equal number of another type (not a
        bool), or r converted by one of `conversions` (only builtin values are converted: no
        candidate code runs)."""
        if same(ret, r):
            return True
        tr, tv = type_(ret), type_(r)
        if not is_one(tv, builtin_values):
            return False
        try:
            # a bool main returns is a predicate on a number (`aux(x) > 5`), not the number
            if is_one(tr, numbers) and tr is not bool_ and is_one(tv, numbers) and (ret == r) is True:
                return True
            return is_one(tr, conversions) and same(ret, tr(r))
        except Base:  # int("x"), set([[]]), ...: not a conversion of r
            return False

    def value_set(values):
        """Values to match results against (see `member`): numbers and strings hashed by type
        and value, at most max_group other distinct values kept."""
        hashed, others = set_(), []
        for v in values:
            t = type_(v)
            if is_one(t, atoms):
                hashed.add((t, v))
            elif len_(others) < max_group and not any_(same(v, o) for o in others):
                others.append(v)
        return hashed, others

    def member(vs, r):
        t = type_(r)
        if is_one(t, atoms):
            return (t, r) in vs[0]
        return any_(same(r, o) for o in vs[1])

    def site_label(f):
        """Function name, line within that function (its def line = 1), offset, and (3.11+) the
        call's line.column in the program: two identical generator expressions in one function
        have the same name, relative line and offset, and must still be two sites."""
        code = f.f_code
        label = f"{code.co_name}:{f.f_lineno - code.co_firstlineno + 1}:{f.f_lasti}"
        positions = getattr_(code, "co_positions", None)
        if positions is not None:
            pos = list_(positions())  # one entry per 2-byte code unit
            if f.f_lasti // 2 < len_(pos):
                label += f":{pos[f.f_lasti // 2][0]}.{pos[f.f_lasti // 2][2]}"
        return label

    def compiled_src(key, src, name):
        if key not in compiled:
            compiled[key] = compile_(src, name, "exec", dont_inherit=True)
        return compiled[key]

    def trial(i, site, together, mode, limit_s, keep=False):
        """One run of test i in a fresh namespace, at most limit_s seconds, replacing (mode) the
        results of call site `site` and, with `together` (a value_set), every result equal to
        one of those values: a dict of findings; "timeout" if it ran past limit_s; None if
        setup/code failed or the phase is over. keep: record a copy of every aux result."""
        rec = {"sites": {}, "order": [], "calls": [], "cur": None, "main_depth": 0, "aux_depth": 0}
        ns = {"__name__": "__candidate__", "__builtins__": builtins_}
        t0 = monotonic()
        st["deadline"] = min(t0 + limit_s, st["end"])
        seed(0)
        st["in"] = True
        try:
            if setup:
                exec_(compiled_src("setup", setup + "\n", "<setup>"), ns)
            exec_(compiled_src("code", code, "<candidate>"), ns)
        except Stop:
            st["in"] = False
            return None
        except Base:
            st["in"] = False
            return None
        st["in"] = False
        set_signal(SIGALRM, on_alarm)  # again: the code's top level may have taken the alarm
        setitimer(ITIMER_REAL, 0.05, 0.05)
        orig_main, orig_aux = ns.get(entry), ns.get(aux_name)
        if not (callable_(orig_main) and callable_(orig_aux)):
            return None

        def aux_w(*a, **k):
            if rec["main_depth"] == 0 or rec["aux_depth"]:  # not from main, or aux's recursion
                rec["aux_depth"] += 1
                try:
                    return orig_aux(*a, **k)
                finally:
                    rec["aux_depth"] -= 1
            f = getframe(1)
            key = (f.f_code, f.f_lasti)
            rec["aux_depth"] += 1
            try:
                r = orig_aux(*a, **k)
            finally:
                rec["aux_depth"] -= 1
            if key not in rec["sites"]:
                rec["sites"][key] = site_label(f)
                rec["order"].append(key)
            if rec["cur"] is not None:
                rec["cur"].append((key, copy_of(r) if keep else None))
            if site is not None and (key == site or (together is not None and member(together, r))):
                return safe_perturb(r, mode)
            return r

        def main_w(*a, **k):
            if rec["main_depth"]:  # main's own recursion: part of the outer call
                rec["main_depth"] += 1
                try:
                    return orig_main(*a, **k)
                finally:
                    rec["main_depth"] -= 1
            rec["main_depth"], rec["cur"] = 1, []
            try:
                r = orig_main(*a, **k)
            except Base as e:
                rec["calls"].append((("exc", type_(e).__name__), rec["cur"]))
                raise
            finally:
                rec["main_depth"] = 0
            rec["calls"].append((("ret", r), rec["cur"]))
            rec["cur"] = None
            return r

        ns[entry], ns[aux_name] = main_w, aux_w
        st["in"] = True
        try:
            exec_(compiled_src(i, tests[i], f"<test {i}>"), ns)
            passed = True
        except Stop:
            st["in"] = False
            return None if st["expired"] else "timeout"
        except Base:
            passed = False
        st["in"] = False
        if st["expired"]:
            return None
        return {"passed": passed, "sites": rec["sites"], "order": rec["order"], "calls": rec["calls"],
                "seconds": monotonic() - t0}

    def same_outcomes(x, y):
        cx, cy = x["calls"], y["calls"]
        if len_(cx) != len_(cy):
            return False
        for (ox, _), (oy, _) in zip_(cx, cy):
            if ox[0] != oy[0] or not close(ox[1], oy[1]):
                return False
        return True

    def changes(base, i, site, together, limit):
        """Replacing these results changes the outcome in some mode; None: the budget ran out."""
        for mode in ("shift", "flip", "grow"):
            t = trial(i, site, together, mode, limit)
            if t is None and st["expired"]:
                return None
            # None: the code itself failed to load this time; "timeout": main no longer
            # returns in time (e.g. a loop bound by aux's result): both are a change
            if t is None or t == "timeout" or not same_outcomes(base, t):
                return True
        return False

    def together_with(base, key):
        """The value_set of the results at `key`, or None when no call at another site returned
        one of those values (TOGETHER would be ALONE)."""
        vs = value_set([v for _, rs in base["calls"] for k, v in rs if k == key])
        for _, rs in base["calls"]:
            for k, v in rs:
                if k != key and member(vs, v):
                    return vs
        return None

    def thin_wrapper(base, used):
        calls = [(o, [v for k, v in rs if k in used]) for o, rs in base["calls"]]
        calls = [(o, vs) for o, vs in calls if vs]
        return bool_(calls) and all_(o[0] == "ret" and all_(passes_on(o[1], v) for v in vs) for o, vs in calls)

    def probe_test(i):
        """(status, aux calls, thin wrapper, [(site label, used)])"""
        base = trial(i, None, None, None, st["end"], keep=True)
        if base is None or base == "timeout":
            return ("budget" if st["expired"] else "error"), 0, False, []
        n_calls = sum_(len_(rs) for _, rs in base["calls"])
        if not base["passed"]:
            return "baseline_failed", n_calls, False, []
        if not base["order"]:
            return "ok", n_calls, False, []
        limit = max(trial_floor_s, trial_factor * base["seconds"])
        ctrl = trial(i, None, None, None, limit)
        if ctrl is None or ctrl == "timeout":
            return ("budget" if st["expired"] else "nondeterministic"), n_calls, False, []
        if not same_outcomes(base, ctrl):
            return "nondeterministic", n_calls, False, []
        sites, used = [], []
        for key in base["order"][:max_sites]:
            together = together_with(base, key)
            hit = changes(base, i, key, None, limit)
            if hit and together is not None:
                hit = changes(base, i, key, together, limit)
            if hit is None:
                return "budget", n_calls, False, sites
            sites.append((base["sites"][key], hit))
            if hit:
                used.append(key)
        return "ok", n_calls, thin_wrapper(base, used), sites

    def run(passed):
        """Probe each passed test; one "C" line each, then "P"."""
        null = open_(devnull, "w")
        sys_.stdout = sys_.stderr = null  # prints repeated by the trials must not flood the pipes
        st["end"] = monotonic() + budget
        set_signal(SIGALRM, on_alarm)
        setitimer(ITIMER_REAL, 0.05, 0.05)
        try:
            for i in passed:
                if st["expired"]:
                    break
                try:
                    status, n, wrapper, sites = probe_test(i)
                except Base:  # a Stop outside the guarded spots, or the probe itself failed
                    status, n, wrapper, sites = ("budget" if st["expired"] else "error"), 0, False, []
                items = ",".join(bytes_hex(label.encode()) + "=" + ("1" if r else "0") for label, r in sites)
                report(f"C {i} {status} {n} {1 if wrapper else 0} {items or '-'}")
        finally:
            setitimer(ITIMER_REAL, 0, 0)
        report("P")

    return run


if __name__ == "__main__":
    main()
