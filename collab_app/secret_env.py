"""Secrets apart: `collab serve` and `collab trainer` read their secrets once,
drop them from the environment and make themselves non-dumpable.

Why: the app runs code it does not trust (model-written HumanEval answers; on a host where the
sandbox is weak, tests a visitor typed) and, on a Space, that code runs with the app's own uid
("plain" mode, tasks/sandbox.py). A same-uid process may read another one's
/proc/<pid>/environ, /proc/<pid>/mem and /proc/<pid>/cmdline unless the kernel's ptrace check
says no. So:

- `take()` pops the secrets below from os.environ and keeps them in this module (`held`), so
  nothing started later (the vLLM engine core, the trainer child, a sandbox run, a shell a
  library opens) inherits them. Popping does NOT erase the process's original environment block
  (what /proc/<pid>/environ shows: the strings on the initial stack), hence
- `set_non_dumpable()`: prctl(PR_SET_DUMPABLE, 0). The kernel then owns /proc/<pid>/* by root
  and lets only a process with CAP_SYS_PTRACE (over this process's user namespace) ptrace it or
  open its environ, mem, maps-by-ptrace, root, fd...: a same-uid process without capabilities
  (a sandboxed check, another login of the same user) gets EACCES. It also turns off core dumps
  (they would hold the secrets). Children are dumpable again after their execve, so each of our
  own processes that holds secrets calls this itself (serve, the trainer child). No-op where
  there is no prctl (not Linux). `COLLAB_KEEP_DUMPABLE=1` skips it (a debugger or py-spy of the
  same non-root user must attach; root with CAP_SYS_PTRACE can attach anyway).
- /proc/<pid>/cmdline stays readable by everyone, dumpable or not: secrets never go on a command
  line (the trainer child gets the store URL in its environment, COLLAB_DB, and drops it).
- `mask_url()`: a store URL for a log line, its password replaced by ***.

COLLAB_SESSION_SECRET is popped by collab_app/web/identity.session_secret (the cookie signer
keeps it), not here.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import sys

log = logging.getLogger(__name__)

SECRET_ENVS = ("COLLAB_ADMIN_TOKEN", "COLLAB_API_KEYS", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "COLLAB_DB")
"""what `take()` pops: the admin token, the /v1 API keys, Hugging Face tokens, the store URL (it
may hold a database password; popped whether it does or not, it is read once either way)."""
KEEP_DUMPABLE_ENV = "COLLAB_KEEP_DUMPABLE"
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4

_held: dict[str, str] = {}


def take(names: tuple[str, ...] = SECRET_ENVS) -> dict[str, str]:
    """Pop `names` from os.environ (those that are set); returns and keeps them (`held`). A name
    set again later is popped again by the next call, its new value kept."""
    for name in names:
        value = os.environ.pop(name, None)
        if value is not None:
            _held[name] = value
    return {n: _held[n] for n in names if n in _held}


def held(name: str) -> str | None:
    """A secret `take()` popped (None if it was not set)."""
    return _held.get(name)


def hf_token() -> str | None:
    """The Hugging Face token popped by `take()` (HF_TOKEN, else HUGGING_FACE_HUB_TOKEN), for
    huggingface_hub calls that would otherwise look in os.environ; None = huggingface_hub's own
    default (its token file)."""
    return _held.get("HF_TOKEN") or _held.get("HUGGING_FACE_HUB_TOKEN") or None


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.prctl(option, arg, 0, 0, 0)
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")
    return rc


def set_non_dumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0) on Linux (module doc). True if this process is non-dumpable now;
    False where there is no prctl or COLLAB_KEEP_DUMPABLE=1. OSError if the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get(KEEP_DUMPABLE_ENV) == "1":
        log.warning("%s=1: this process stays dumpable, so any process of the same user can read its "
                    "environment and memory (/proc/%d/environ, /mem)", KEEP_DUMPABLE_ENV, os.getpid())
        return False
    _prctl(PR_SET_DUMPABLE, 0)
    return True


def dumpable() -> bool | None:
    """Whether this process is dumpable (None where that cannot be asked: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return _prctl(PR_GET_DUMPABLE) != 0


def seal(names: tuple[str, ...] = SECRET_ENVS) -> dict[str, str]:
    """`take(names)` then `set_non_dumpable()`: call it once at start, after reading what is
    still read from os.environ and before starting any child process or thread pool."""
    got = take(names)
    set_non_dumpable()
    return got


_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):[^@\s]*@")


def mask_url(url: str) -> str:
    """`url` for a log line: the password replaced by *** (sqlalchemy's rendering; a string it
    cannot parse gets the same done by pattern)."""
    try:
        import sqlalchemy as sa

        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - never let a log line fail, never print the password
        return _USERINFO.sub(r"\g<head>:***@", url)
