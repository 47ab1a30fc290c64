"""Where collab keeps its files, decided in one place.

COLLAB_HOME ($COLLAB_HOME, else ~/.cache/collab) holds everything a run writes by default: the
store (`collab.db`, unless $COLLAB_DB names another database), adapter versions (`adapters/`),
the embedded model and its wheel (`models/`, `wheels/`, engines/model.py), the CPU calibration
(`calibration.json`, engines/calibrate.py), the compiled engine's kernels (`compiled/`) and
training runs (`runs/`). Every command and the app
read these functions; a flag (`--db`, `--adapters-dir`, ...) overrides them where it exists.
"""
from __future__ import annotations

import os

HOME_ENV = "COLLAB_HOME"
DB_ENV = "COLLAB_DB"
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"   # torch's own variable: where torch.compile keeps its kernels


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
    """$COLLAB_HOME/compiled: torch.compile's cache (inductor's kernels and graphs) for a compiled
    vLLM engine. collab_app/__init__.py points $TORCHINDUCTOR_CACHE_DIR here unless it is set:
    torch's default, /tmp/torchinductor_<user>, is emptied by a reboot or a Space's restart, and a
    compiled CPU engine then spends ~100 s instead of ~35 s starting (docs/ENGINES.md)."""
    return os.path.join(home(), "compiled")
