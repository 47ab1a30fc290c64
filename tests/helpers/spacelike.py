"""Run Python the way a Hugging Face Space runs the app, on this project's root machines.

A Space is a container: the app runs as a non-root user, in its own PID and mount namespaces,
and may not create user namespaces (so tasks.sandbox can only reach "plain"). `run_space_like`
builds that from root without changing anything machine-wide:

1. a child process unshares a user + mount + PID namespace; the parent (real root) maps the
   whole uid/gid range onto itself ("0 0 4294967295"), so uids mean what they mean on the host
   (65534 inside is kernel uid 65534: the host's permissions apply);
2. inside, /proc/sys/user/max_user_namespaces is set to 0: that limit is per user namespace,
   so only this container loses user namespaces (the host's sysctl is never written);
3. a private mount namespace: a tmpfs over unreachable parents of the Python install (e.g.
   /root, 0700) with the needed dirs bound back (tasks.sandbox._reach), and a fresh /proc of
   the container's PID namespace;
4. pid 1 of the container reaps; the app runs as uid/gid 65534 with no capabilities at all
   (`setpriv --bounding-set=-all`), cwd and HOME a fresh dir it owns. The network namespace is
   the host's (a Space has network), so loopback servers of the test are reachable.

When the container's pid 1 ends, the kernel kills everything left in it: nothing the app (or
the code it sandboxes) starts can outlive the call. Needs root, util-linux `setpriv`, and a
kernel that allows user namespaces for root; `available()` says whether it can run here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
SPACE_UID = 65534

# Runs as real root in its own process (never forks the caller, which may have threads).
_LAUNCHER = r'''
import ctypes, json, os, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1

def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")

def mount(src, target, fstype, flags, data=None):
    check(libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                     data and data.encode()), f"mount {target}")

def wait_exit(pid):
    _, st = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(st)

go_r, go_w = os.pipe()
up_r, up_w = os.pipe()
child = os.fork()
if child == 0:
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID), "unshare")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # (new credentials)
    os.write(up_w, b"u")
    assert os.read(go_r, 1) == b"m"
    # per user namespace: only this container (and what it creates) loses user namespaces
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for parent, paths in cfg["reach"]:
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in paths]
        mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p, fd in zip(paths, fds):
            os.makedirs(p, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            os.close(fd)
    init = os.fork()  # pid 1 of the container
    if init == 0:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        app = os.fork()
        if app == 0:
            os.chdir(cfg["cwd"])
            os.execve(cfg["setpriv"], [cfg["setpriv"], f"--reuid={cfg['uid']}", f"--regid={cfg['uid']}",
                                       "--clear-groups", "--bounding-set=-all", "--inh-caps=-all", "--",
                                       cfg["python"], "-c", cfg["script"]], cfg["env"])
        while True:  # reap orphans until the app ends; then the kernel kills the rest
            pid, st = os.wait()
            if pid == app:
                os._exit(os.waitstatus_to_exitcode(st) & 0xFF if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
    os._exit(wait_exit(init) & 0xFF)
assert os.read(up_r, 1) == b"u"
for name in ("uid_map", "gid_map"):  # identity over the whole range: host permissions apply
    with open(f"/proc/{child}/{name}", "w") as f:
        f.write("0 0 4294967295")
os.write(go_w, b"m")
sys.exit(wait_exit(child) & 0xFF)
'''


def available() -> str | None:
    """None if run_space_like works here, else why not (for a pytest skip reason)."""
    if os.geteuid() != 0:
        return "needs root (it builds a container with a full uid map)"
    if not shutil.which("setpriv"):
        return "util-linux setpriv not found"
    try:
        r = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a user namespace: {e}"
    return None if r.returncode == 0 else f"cannot create a user namespace: {r.stderr.decode()[-200:]}"


def run_space_like(script: str, env: dict[str, str] | None = None, timeout: float = 120,
                   uid: int = SPACE_UID) -> subprocess.CompletedProcess:
    """Run `python -c script` (this interpreter, the repo and tests/ importable) as `uid` in a
    Space-like container (module doc). `env` is added to a minimal environment (PATH, HOME,
    TMPDIR, LANG, PYTHONPATH, COLLAB_HOME = HOME/collab-home); the script's cwd, HOME and TMPDIR
    are a fresh dir it owns, removed afterwards (with whatever a killed app left in it). Returns the CompletedProcess (text stdout/stderr; returncode
    128+N when the app was killed by signal N). Raises subprocess.TimeoutExpired after `timeout`."""
    from tasks.sandbox import _reach

    home = tempfile.mkdtemp(prefix="collab-space-")
    os.chown(home, uid, uid)
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
                "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "COLLAB_HOME": os.path.join(home, "collab-home"),
                **(env or {})}
    cfg = {"reach": [list(x) for x in _reach()], "cwd": home, "uid": uid, "setpriv": shutil.which("setpriv"),
           "python": sys.executable, "script": script, "env": full_env}
    try:
        # its own session: on a timeout the launcher's group dies, and PDEATHSIG takes the container
        return subprocess.run([sys.executable, "-I", "-c", _LAUNCHER, json.dumps(cfg)], capture_output=True,
                              text=True, timeout=timeout, start_new_session=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
