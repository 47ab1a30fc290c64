"""Fixtures of tests/commands: `sqlite_store` (tests/helpers/store.py: an empty store at
tmp_path/collab.db, SQLite only) and `served_versions` (what `collab train`'s engine serves)."""
import pytest

from helpers.store import sqlite_store  # noqa: F401 - a fixture for tests/commands


@pytest.fixture
def served_versions(monkeypatch) -> dict:
    """{agent: the adapter version `collab train`'s engine serves after its latest load_adapter}:
    the run's sampler is wrapped to record it, so a test sees what the engine really took."""
    from collab_app.commands import train_cmd

    served: dict = {}
    real_sampler = train_cmd.EngineSampler

    class RecordingSampler(real_sampler):
        def load_adapter(self, agent, path, version):
            super().load_adapter(agent, path, version)
            served[agent] = self.engine.adapter_version(agent)

    monkeypatch.setattr(train_cmd, "EngineSampler", RecordingSampler)
    return served
