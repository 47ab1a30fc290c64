"""Where collab keeps its files, decided in one place.

COLLAB_HOME ($COLLAB_HOME, else ~/.cache/collab) holds everything a run writes by default: the
store (`collab.db`, unless $COLLAB_DB names another database), adapter versions (`adapters/`),
the embedded model and its wheel (`models/`, `wheels/`, engines/model.py), the CPU calibration
(`calibration.json`, engines/calibrate.py), the compiled engine's kernels and traced model
(`compiled/<machine>/`, vLLM's part in `compiled/<machine>/vllm/`) and
training runs (`runs/`). Every command and the app
read these functions; a flag (`--db`, `--adapters-dir`, ...) overrides them where it exists.
"""
from __future__ import annotations

import os

HOME_ENV = "COLLAB_HOME"
DB_ENV = "COLLAB_DB"
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"   # torch's own variable: where torch.compile keeps its kernels
VLLM_CACHE_ENV = "VLLM_CACHE_ROOT"               # vLLM's own variable: where vLLM keeps a compiled model


def home() -> str:
    """$COLLAB_HOME, else ~/.cache/collab (an empty value counts as unset)."""
    return os.environ.get(HOME_ENV) or os.path.expanduser("~/.cache/collab")


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
    cached on this Xeon under AVX-512, loaded with ATEN_CPU_CAPABILITY=avx2, counted half of what
    it should (docs/results "A compiled engine's kernels kept across reboots")."""
    from collab_app.machine import machine_tag

    return os.path.join(home(), "compiled", machine_tag())


def vllm_cache_dir(compiled: str | None = None) -> str:
    """compile_cache_dir()/vllm (`compiled`: that folder, when the caller already has it): vLLM's
    cache (collab_app/__init__.py points $VLLM_CACHE_ROOT here unless it is set). A compiled CPU
    engine keeps its traced model there (vLLM's AOT artifact, under
    torch_compile_cache/torch_aot_compile/<key>/, with the kernels compiled for it), so a later
    start loads it instead of tracing the model again (engines/vllm_team.py
    compiled_model_kept_on_disk); per machine tag for the same reasons as the kernels."""
    return os.path.join(compiled or compile_cache_dir(), "vllm")
