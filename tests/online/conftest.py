"""The store on every backend: `url` / `store` are an empty store on SQLite and, where the
binaries exist, on a throwaway PostgreSQL server started once per session (skipped saying what
is missing otherwise); `empty_url` is a database without any schema; `sqlite_store` (from
tests/helpers/store.py) an empty store on SQLite only."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import sqlalchemy as sa

from collab_app.online.store import Base, Store
from helpers.store import pg_bin, pg_database, sqlite_store  # noqa: F401 - sqlite_store: a fixture for tests/online


@pytest.fixture(scope="session")
def pg_server():
    """(host, port, user) of a throwaway PostgreSQL server, or skip saying what is missing."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not installed: apt-get install postgresql")
    pytest.importorskip("psycopg", reason="PostgreSQL driver missing: pip install 'psycopg[binary]'")
    root = tempfile.mkdtemp(prefix="collab-pg-")
    run_as: list[str] = []
    if os.geteuid() == 0:   # initdb refuses to run as root
        import pwd
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    from helpers.launch import free_port

    port = free_port()
    data = os.path.join(root, "data")
    subprocess.run(run_as + [initdb, "-D", data, "-U", "collab", "-A", "trust", "--no-sync", "-E", "UTF8"],
                   check=True, capture_output=True)
    subprocess.run(run_as + [pg_ctl, "-D", data, "-l", os.path.join(root, "log"), "-w", "-t", "30",
                             "-o", f"-p {port} -k {root} -h 127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True)
    try:
        yield "127.0.0.1", port, "collab"
    finally:
        subprocess.run(run_as + [pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_shared(pg_server):
    """One migrated PostgreSQL database reused by the tests (emptied before each): creating a
    database per test costs ~1 s each."""
    url = pg_database(pg_server)
    Store(url).close()
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """An empty store URL on each backend. Tests needing a database without any schema call
    `pg_database` themselves."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'collab.db'}"
    url = request.getfixturevalue("pg_shared")
    eng = sa.create_engine(url)
    with eng.begin() as c:
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        c.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    eng.dispose()
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    """A database without any schema (for the migration test)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return pg_database(request.getfixturevalue("pg_server"))


@pytest.fixture
def store(url):
    st = Store(url)
    yield st
    st.close()
