"""Where collab keeps its files, decided in one place.

COLLAB_HOME ($COLLAB_HOME, else ~/.cache/collab) holds everything a run writes by default: the
store (`collab.db`, unless $COLLAB_DB names another database), adapter versions (`adapters/`),
the embedded model and its wheel (`models/`, `wheels/`, engines/model.py), the compiled engine's kernels and traced model
(`compiled/<machine>/`, vLLM's part in `compiled/<machine>/vllm/`) and
training runs (`runs/`). Every command and the app
read these functions; a flag (`--db`, `--adapters-dir`, ...) overrides them where it exists.
"""
from __future__ import annotations

import os

HOME_ENV = "COLLAB_HOME"
MACHINE_ENV = "COLLAB_MACHINE_DIR"
DB_ENV = "COLLAB_DB"


def home() -> str:
    """$COLLAB_HOME, else ~/.cache/collab (an empty value counts as unset)."""
    return os.environ.get(HOME_ENV) or os.path.expanduser("~/.cache/collab")


def machine_dir() -> str:
    """$COLLAB_MACHINE_DIR, else ~/.cache/collab/machine: what this machine measured about itself
    (the CPU calibration and the engine race, `calibration.json`: engines/calibrate.py), shared by
    every COLLAB_HOME on the machine, so a fresh home (a bench's server, a second project) measures
    nothing again. Its entries are keyed by the machine: a folder shared between hosts is safe."""
    return os.environ.get(MACHINE_ENV) or os.path.expanduser("~/.cache/collab/machine")


def store_url() -> str:
    """$COLLAB_DB (SQLAlchemy URL, e.g. postgresql+psycopg://...), else sqlite:///$COLLAB_HOME/collab.db."""
    return os.environ.get(DB_ENV) or f"sqlite:///{os.path.join(home(), 'collab.db')}"


def adapters_dir() -> str:
    """$COLLAB_HOME/adapters: where the trainer writes adapter versions and the engine reads them."""
    return os.path.join(home(), "adapters")


def compile_cache_dir() -> str:
    """$COLLAB_HOME/compiled/<machine_tag()>: torch.compile's cache (inductor's kernels and graphs)
    for a compiled vLLM engine and the small functions vLLM compiles in an eager one.
    collab_app/__init__.py points $TORCHINDUCTOR_CACHE_DIR here unless it is set: torch's default,
    /tmp/torchinductor_<user>, is emptied by a reboot or a Space's restart, and a compiled CPU
    engine then spends ~100 s instead of ~30 s starting (docs/ENGINES.md). One folder per machine
    tag because a COLLAB_HOME outlives its CPU (a Space's /data on another host, a home folder
    shared between machines) and torch 2.13's graph cache does not tell vector ISAs apart: a kernel
    cached under AVX-512, loaded with ATEN_CPU_CAPABILITY=avx2, counted half of what it should."""
    from collab_app.cpu.machine import machine_tag

    return os.path.join(home(), "compiled", machine_tag())


def vllm_cache_dir(compiled: str | None = None) -> str:
    """compile_cache_dir()/vllm (`compiled`: that folder, when the caller already has it): vLLM's
    cache (collab_app/__init__.py points $VLLM_CACHE_ROOT here unless it is set). A compiled CPU
    engine keeps its traced model there (vLLM's AOT artifact, under
    torch_compile_cache/torch_aot_compile/<key>/, with the kernels compiled for it), so a later
    start loads it instead of tracing the model again (engines/vllm_team.py
    compiled_model_kept_on_disk); per machine tag for the same reasons as the kernels."""
    return os.path.join(compiled or compile_cache_dir(), "vllm")


KEEP_COMPILED_NEWEST = 3   # compiled models kept whatever their age: the ones used last
KEEP_COMPILED_DAYS = 14    # ... and any other used this recently


def prune_compiled_models(in_use: str, now: float | None = None) -> list[tuple[str, int]]:
    """Mark `in_use` (the folder of the compiled model a vLLM engine just loaded or saved: vLLM's
    AOT artifact, vllm_cache_dir()/torch_compile_cache/torch_aot_compile/<key>) as used now, and
    remove its siblings that are neither among the KEEP_COMPILED_NEWEST used last nor used within
    KEEP_COMPILED_DAYS. Returns [(removed folder, bytes)].

    Why: every change of the key (our traced code or vLLM's, the lanes, the GEMM kernel, the dtype)
    compiles a new ~10-18 MB model beside the old ones, which nothing reads again; two days of
    development left 11 of them (123 MB) in one machine's folder, and a Space's /data keeps growing
    across its updates. "Used" is the folder's modification time, which this function sets at each
    start (vLLM itself never touches a loaded artifact). The newest few stay whatever their age, so
    a person switching between teams of different sizes (another key each) compiles nothing again.
    Left out: inductor's own small-kernel cache beside it (~5 MB, shared by every key) and other
    machines' folders (compiled/<other tag>: a shared home's other host prunes its own). A start
    that loads a key older than KEEP_COMPILED_DAYS while another process prunes could lose it and
    compile again (never an error: vLLM compiles when its artifact is missing)."""
    import shutil
    import time

    now = time.time() if now is None else now
    os.utime(in_use, (now, now))
    parent = os.path.dirname(os.path.abspath(in_use))
    found = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                found.append((os.stat(path).st_mtime, path))
        except OSError:   # removed by another process meanwhile
            continue
    found.sort(reverse=True)
    removed = []
    for mtime, path in found[KEEP_COMPILED_NEWEST:]:
        if now - mtime <= KEEP_COMPILED_DAYS * 86400 or os.path.samefile(path, in_use):
            continue
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, size))
    return removed
