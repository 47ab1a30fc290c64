"""`sqlite_store` (tests/helpers/store.py): an empty store at tmp_path/collab.db, SQLite only."""
from helpers.store import sqlite_store  # noqa: F401 - a fixture for tests/commands
