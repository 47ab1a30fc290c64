"""One place decides where collab keeps its files (collab_app/paths.py)."""
from __future__ import annotations

import os
from pathlib import Path

from collab_app import paths

ROOT = Path(__file__).resolve().parents[2]


def test_home_store_and_adapters_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("COLLAB_DB", raising=False)
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    assert paths.home() == str(tmp_path)
    assert paths.adapters_dir() == str(tmp_path / "adapters")
    assert paths.store_url() == f"sqlite:///{tmp_path / 'collab.db'}"
    monkeypatch.setenv("COLLAB_HOME", "")                      # empty = unset, everywhere
    assert paths.home() == os.path.expanduser("~/.cache/collab")
    monkeypatch.setenv("COLLAB_DB", "postgresql+psycopg://u@h/db")
    assert paths.store_url() == "postgresql+psycopg://u@h/db"


def test_the_default_home_is_written_once():
    """No module but paths.py spells the default home or reads COLLAB_HOME itself."""
    offenders = []
    for sub in ("collab_app", "trainer", "tasks"):
        for f in (ROOT / sub).rglob("*.py"):
            if f.name == "paths.py" and f.parent.name == "collab_app":
                continue
            text = f.read_text()
            if ".cache/collab\")" in text or "environ.get(\"COLLAB_HOME\"" in text or ".cache\" / \"collab\"" in text:
                offenders.append(str(f.relative_to(ROOT)))
    assert offenders == [], offenders
