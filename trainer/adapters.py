"""Adapter versions on disk (docs/ARCHITECTURE.md "Contracts"): one directory per agent per version.

    {adapters_dir}/{agent}/v000003/
        adapter_config.json, adapter_model.safetensors   peft LoRA format (engines load this)
        optimizer.pt                                      AdamW state, latest version only (for resume)
        collab.json                                       step, parent version, metrics, config, time

A version is written into a temp dir in the same parent (`.tmp-v000003-XXXX`, a name that never
parses as a version), every file in it fsynced, and `os.rename`d into place, which is atomic on
one filesystem: readers see either no `v000003` or a complete one. `collab.json` is written last
and is the completeness marker. Version 0 is the freshly initialised adapter (LoRA B = 0, i.e.
the base model), saved before training so engines can load every agent from the start.

Versions are immutable: saving an existing version is an error. One writer per agent (the
trainer; under torchrun, rank 0) is assumed. The same guarantees hold on a POSIX network
filesystem (a rename inside one directory is atomic on the server; no file locks, no pids);
object-store mounts are no target (they rename by copying). Version numbers are never reused,
also across a lost folder (`set_floor`, a `.next-version` file), and a version that cannot be
read is moved aside (`quarantine`) and raises the floor past itself. Each rule and its reason:
docs/ARCHITECTURE.md "Adapter versions on disk".
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from typing import Callable

MARKER = "collab.json"
OPTIMIZER = "optimizer.pt"
_VERSION_RE = re.compile(r"^v(\d{6,})$")


def version_dir(adapters_dir: str, agent: str, version: int) -> str:
    return os.path.join(adapters_dir, agent, f"v{version:06d}")


def save_version(adapters_dir: str, agent: str, version: int, write: Callable[[str], None], meta: dict) -> str:
    """Write one version atomically: `write(tmp_dir)` puts the files in, then the marker, then rename."""
    final = version_dir(adapters_dir, agent, version)
    if os.path.exists(final):
        raise FileExistsError(f"adapter version {final} already exists; versions are immutable "
                              f"(resume from it, or use a fresh --adapters-dir)")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-v{version:06d}-", dir=parent)
    try:
        write(tmp)
        for name in sorted(os.listdir(tmp)):   # the weights and optimizer state on disk before the marker
            _fsync(os.path.join(tmp, name))
        meta = {"agent": agent, "version": version, "created_at": time.time(), **meta}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(meta, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)                            # its directory entries
        os.rename(tmp, final)
        _fsync(parent)                         # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fsync(path: str) -> None:
    """Flush a file's (or a directory's entries') data to the disk: after a power loss a renamed
    version must not hold empty or torn weights (rename is atomic, the data behind it is not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_versions(adapters_dir: str, agent: str) -> list[tuple[int, str]]:
    """Complete versions of `agent`, oldest first (temp dirs and dirs without the marker skipped)."""
    parent = os.path.join(adapters_dir, agent)
    if not os.path.isdir(parent):
        return []
    found = []
    for name in os.listdir(parent):
        m = _VERSION_RE.match(name)
        path = os.path.join(parent, name)
        if m and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_version(adapters_dir: str, agent: str) -> tuple[int, str] | None:
    """(version, path) of the newest complete version of `agent`, or None if it has none."""
    versions = list_versions(adapters_dir, agent)
    return versions[-1] if versions else None


FLOOR = ".next-version"


def set_floor(adapters_dir: str, agent: str, version: int) -> None:
    """The lowest number `agent`'s next version may take (kept if a higher floor is set already)."""
    parent = os.path.join(adapters_dir, agent)
    os.makedirs(parent, exist_ok=True)
    version = max(int(version), floor(adapters_dir, agent) or 0)
    tmp = os.path.join(parent, f".tmp-floor-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{version}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(parent, FLOOR))


def floor(adapters_dir: str, agent: str) -> int | None:
    """`set_floor`'s number, or None."""
    try:
        with open(os.path.join(adapters_dir, agent, FLOOR)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def clear_floor(adapters_dir: str, agent: str) -> None:
    try:
        os.remove(os.path.join(adapters_dir, agent, FLOOR))
    except FileNotFoundError:
        pass


def quarantine(path: str) -> str:
    """Move a version dir that cannot be read out of the versions (a name that never parses as one)
    and raise its agent's floor past it. Returns the new path."""
    parent, name = os.path.split(path.rstrip("/"))
    m = _VERSION_RE.match(name)
    aside = os.path.join(parent, f".corrupt-{name}-{int(time.time())}")
    os.rename(path, aside)
    if m:
        set_floor(os.path.dirname(parent), os.path.basename(parent), int(m.group(1)) + 1)
    return aside


def read_meta(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def remove_partial(adapters_dir: str, agent: str) -> list[str]:
    """Delete temp dirs a crashed save left behind (call only while no save is running)."""
    parent = os.path.join(adapters_dir, agent)
    if not os.path.isdir(parent):
        return []
    gone = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(".tmp-")]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def prune_versions(adapters_dir: str, agent: str, keep: int) -> list[str]:
    """Keep version 0 and the newest `keep` versions (0 = keep all); drop optimizer state from all
    but the newest (resume only needs the latest). Returns the removed version dirs."""
    versions = list_versions(adapters_dir, agent)
    for _, path in versions[:-1]:
        opt = os.path.join(path, OPTIMIZER)
        if os.path.exists(opt):
            os.remove(opt)
    if not keep:
        return []
    old = [path for v, path in versions[:-keep] if v != 0]
    for path in old:
        # rename first: a reader never sees a version dir that is half deleted
        doomed = os.path.join(os.path.dirname(path), f".tmp-del-{os.path.basename(path)}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old
