"""Store test data: a 2-agent group with exact full-precision values, throwaway PostgreSQL
databases (tests/online/conftest.py has the fixtures that use them), and the SQLite-only store
fixture that tests/online and tests/commands share (their conftest.py files make it visible)."""
from __future__ import annotations

import itertools
import os
import random
import shutil

import pytest
import sqlalchemy as sa

from collab_app.engines.engine_types import Sample
from collab_app.online.store import Store
from tasks.base import Reward


def pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(os.listdir("/usr/lib/postgresql"), reverse=True) if os.path.isdir("/usr/lib/postgresql") else []:
        p = f"/usr/lib/postgresql/{d}/bin/{name}"
        if os.path.exists(p):
            return p
    return None


@pytest.fixture
def sqlite_store(tmp_path):
    """An empty store at tmp_path/collab.db, SQLite only: for what sits on the store (the trainer
    service, doctor) and checks that happen before any SQL. tests/online's `store` is the same on
    every backend."""
    st = Store(f"sqlite:///{tmp_path / 'collab.db'}")
    yield st
    st.close()


_db_counter = itertools.count()


def pg_database(pg_server) -> str:
    """A fresh empty database on the throwaway server; its SQLAlchemy URL."""
    host, port, user = pg_server
    name = f"t{os.getpid()}_{next(_db_counter)}"
    admin = sa.create_engine(f"postgresql+psycopg://{user}@{host}:{port}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return f"postgresql+psycopg://{user}@{host}:{port}/{name}"


def add_raw_group(conn, now) -> tuple[int, int]:
    """One open group with one joint sample, written by SQL into a database at an older schema
    version (the Store API writes only the current one). Returns (group id, joint sample id)."""
    conn.execute(sa.text("INSERT INTO groups (task, example_id, example, turn, prompts, num_agents, "
                         "num_generations, max_reward, created_at, status) VALUES "
                         "('tldr', 'e1', '{\"id\": \"e1\"}', 0, '[\"a\"]', 1, 2, 3.0, :t, 'open')"), {"t": now})
    gid = conn.scalar(sa.text("SELECT id FROM groups"))
    conn.execute(sa.text("INSERT INTO joint_samples (group_id, joint_index, sample_ids) VALUES (:g, 0, '[]')"),
                 {"g": gid})
    return gid, conn.scalar(sa.text("SELECT id FROM joint_samples"))


def make_sample(agent: str, rng: random.Random, n: int = 12, version: int | None = 3) -> Sample:
    tokens = [rng.randrange(0, 200_000) for _ in range(n)]
    # full-precision doubles, including extremes: the trainer's importance ratio needs them exact
    lps = [-rng.random() * 10 ** rng.randint(-300, 2) for _ in range(n)]
    return Sample(agent=agent, adapter_version=version, prompt_token_ids=[rng.randrange(50_000) for _ in range(7)],
                  text=f"def f():\n    return {rng.random()!r}  # é ✓\n", token_ids=tokens, logprobs=lps,
                  finish_reason=rng.choice(["stop", "length"]), meta={"seed": rng.randrange(99)})


def make_group(store: Store, seed: int = 0, G: int = 2, rewards="auto", joint_mode="aligned", **kw):
    """Add a 2-agent group. rewards: "auto" (Reward per joint action) or None (human-only)."""
    rng = random.Random(seed)
    agents = ["helper", "main"]
    samples = [[make_sample(a, rng) for _ in range(G)] for a in agents]
    joint = ([(g, g) for g in range(G)] if joint_mode == "aligned"
             else list(itertools.product(range(G), repeat=2)))
    autos = [Reward(total=0.5 * k, levels={"structure": 0.5 * k, "tests": 0.0}, max_total=4.0,
                    details={"failed": f"test {k}", "nan": float("nan")}) if rewards == "auto" else None
             for k in range(len(joint))]
    if rewards is None:
        kw.setdefault("max_reward", 4.0)
    gid, jids = store.add_group(task="humaneval", example={"id": f"HumanEval/{seed}", "prompt": "def f():"},
                                prompts=["helper prompt", "main prompt"], samples=samples, joint=joint,
                                auto_rewards=autos, session_id="sess-1",
                                combined=[f"combined {k}" for k in range(len(joint))], **kw)
    return gid, jids, samples, joint, autos
