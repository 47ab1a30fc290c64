"""Where collab keeps its files, decided in one place.

COLLAB_HOME ($COLLAB_HOME, else ~/.cache/collab) holds everything a run writes by default: the
store (`collab.db`, unless $COLLAB_DB names another database), adapter versions (`adapters/`),
the embedded model and its wheel (`models/`, `wheels/`, engines/model.py), the CPU calibration
(`calibration.json`, engines/calibrate.py) and training runs (`runs/`). Every command and the app
read these functions; a flag (`--db`, `--adapters-dir`, ...) overrides them where it exists.
"""
from __future__ import annotations

import os

HOME_ENV = "COLLAB_HOME"
DB_ENV = "COLLAB_DB"


def home() -> str:
    """$COLLAB_HOME, else ~/.cache/collab (an empty value counts as unset)."""
    return os.environ.get(HOME_ENV) or os.path.expanduser("~/.cache/collab")


def store_url() -> str:
    """$COLLAB_DB (SQLAlchemy URL, e.g. postgresql+psycopg://...), else sqlite:///$COLLAB_HOME/collab.db."""
    return os.environ.get(DB_ENV) or f"sqlite:///{os.path.join(home(), 'collab.db')}"


def adapters_dir() -> str:
    """$COLLAB_HOME/adapters: where the trainer writes adapter versions and the engine reads them."""
    return os.path.join(home(), "adapters")
