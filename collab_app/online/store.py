"""The episode store (docs/ARCHITECTURE.md "Contracts"): groups, samples, rewards, ratings, adapter
versions and training steps, over any SQLAlchemy URL (SQLite by default, PostgreSQL at scale).

Every public method is one transaction and returns plain dataclasses (never live ORM objects),
so callers in other threads / processes cannot trigger lazy loads or stale writes. A method
returns only after its commit: an id it hands back is on disk.

SQLite: WAL (readers never block the writer), `busy_timeout` (writers queue instead of failing),
foreign keys on, `synchronous=FULL` (a returned commit survives a crash of the process or the
machine). Write transactions start with `BEGIN IMMEDIATE`: taking the write lock up front means
a read-then-write transaction (add_rating checks its joint sample first) can never hit
SQLITE_BUSY on lock upgrade, which busy_timeout cannot retry. Reads use a plain `BEGIN`.

Ratings: one row per joint sample and rater. Re-rating replaces the rater's row in place
(value, comment, form, time) and bumps its `revision`; nothing else changes a rating and nothing
deletes one (the ORM and database triggers refuse to). A rating of a
group that is already trained, expired or set aside is stored as a `late` row (one per rater and
joint sample, which that rater's further re-ratings replace): the export sees it, the rating in
force when the group closed stays as it was, and the group is never made ready again by it.
Stores older than schema v4 may hold several rows per rater; the latest counts.

Arena matches (schema v8): a pair of two team states' answers is stored when it is made; its one
vote is written once (`add_arena_vote`, by the session it was made for) and never changed.

Schema: `schema_version` + `MIGRATIONS`, an ordered list of functions, each taking the schema
one version up with frozen DDL (never the current ORM classes, which describe the latest
version only); they run in one transaction at start-up. tests/online/test_store.py checks that a
migrated database matches the ORM classes below.

Left out: deleting or editing groups (nothing a person rated is lost), multi-trainer claims on
ready groups (one trainer service per store: the service's lease, checked by
`record_train_step(lease=)`), and online schema downgrades.
"""
from __future__ import annotations

import math
import numbers
import os
import contextlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Mapping, Sequence

import sqlalchemy as sa
from sqlalchemy import JSON, ForeignKey, String, Text, UniqueConstraint, event, func, select
from sqlalchemy.orm import (DeclarativeBase, Mapped, Session, mapped_column, relationship,
                            selectinload)

from collab_app import paths
from collab_app.engines.engine_types import Sample
from collab_app.online.returns import (RATING_KINDS, ReturnRule, check_rating_value, deciding_rater,
                                       group_returns, group_state, human_score, joint_return)
from tasks.base import Reward

MAX_RATER_CHARS = 200
MAX_COMMENT_CHARS = 2_000
BUSY_TIMEOUT_MS = 30_000
STATUSES = ("open", "ready", "trained", "expired", "untrainable")
"""open: collecting ratings; ready: every joint sample has an automatic reward or a rating (a
hint for the UI; which groups train is decided by `ready_groups(rule)`); trained; expired;
untrainable: the trainer can never use it, kept with its ratings: fewer than MIN_GENERATIONS
answers per agent (`stats()["single_sample_groups"]` counts those), or set aside by the trainer
service after its update raised on the group alone (`set_aside`; the service's status says why)."""
RATER_CAP_KEY = "trainer_rater_cap"
"""app_state key the trainer service writes after each look at the ready groups:
{"share": its max_rater_share, "held": ready groups waiting because their rater reached the cap,
"raters": how many raters have groups waiting so, "at": unix time}; `stats()` shows it."""
MIN_GENERATIONS = 2
"""answers per agent a group needs to train: MAGRPO's advantage compares a sample with its siblings
(trainer/magrpo.py `advantages`). A group of one (an API call with n=1) is stored but never ready."""


class StoreError(ValueError):
    """Bad input to the store; the message says what to fix. Nothing was written."""


class NotFound(StoreError, LookupError):
    """An id that is not in the store."""


class LeaseLost(StoreError):
    """A write that needs the trainer lease (`record_train_step(lease=...)`) by a process that no
    longer holds it. Nothing was written."""


class NotEntitled(StoreError, PermissionError):
    """A rating of a group by a session that did not generate it (add_ratings' session_id)."""


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(sa.types.TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite keeps no zone: stored as UTC, read
    back as UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None:
            if value.tzinfo is None:
                raise StoreError("naive datetime given to the store; use timezone-aware UTC")
            value = value.astimezone(timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def jsonable(x: Any) -> Any:
    """Plain JSON (no NaN/inf, which PostgreSQL's JSON refuses): non-finite floats become
    strings ("nan", "inf"), tuples lists, numpy scalars numbers, anything else its str()."""
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):   # numpy / torch scalar
        try:
            return jsonable(x.item())
        except (TypeError, ValueError):
            pass
    return str(x)


# ----------------------------------------------------------------------------- ORM (latest schema)

class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict: JSON, list: JSON}


class GroupRow(Base):
    __tablename__ = "groups"
    id: Mapped[int] = mapped_column(primary_key=True)
    task: Mapped[str] = mapped_column(String(100), index=True)
    example_id: Mapped[str] = mapped_column(String(200))
    example: Mapped[dict]
    turn: Mapped[int]
    prompts: Mapped[list]                      # one per agent
    num_agents: Mapped[int]
    num_generations: Mapped[int]
    max_reward: Mapped[float]                  # task's best total: scale for human ratings
    created_at: Mapped[datetime] = mapped_column(index=True)
    session_id: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), index=True)
    trained_step: Mapped[int | None]
    status_reason: Mapped[str | None] = mapped_column(Text)   # why expired / set aside (v7; None: not recorded)
    versions_at: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))   # agent -> newest version at arrival (v7)
    samples: Mapped[list[SampleRow]] = relationship(
        order_by="(SampleRow.agent_index, SampleRow.gen_index)")
    joints: Mapped[list[JointRow]] = relationship(order_by="JointRow.joint_index")


class SampleRow(Base):
    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("group_id", "agent_index", "gen_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("groups.id"), index=True)
    agent_index: Mapped[int]
    gen_index: Mapped[int]
    agent: Mapped[str] = mapped_column(String(100))
    adapter_version: Mapped[int | None]
    text: Mapped[str] = mapped_column(Text)
    prompt_token_ids: Mapped[list]
    token_ids: Mapped[list]
    logprobs: Mapped[list]                     # behaviour log-probs (engine_types convention)
    finish_reason: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict]


class JointRow(Base):
    __tablename__ = "joint_samples"
    __table_args__ = (UniqueConstraint("group_id", "joint_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("groups.id"), index=True)
    joint_index: Mapped[int]
    sample_ids: Mapped[list]                   # samples.id, one per agent
    combined: Mapped[str | None] = mapped_column(Text)
    auto_total: Mapped[float | None]
    auto_max: Mapped[float | None]
    auto_levels: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))
    auto_details: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))
    auto_error: Mapped[str | None] = mapped_column(Text)
    ratings: Mapped[list[RatingRow]] = relationship(order_by="RatingRow.id")


class RatingRow(Base):
    __tablename__ = "ratings"
    id: Mapped[int] = mapped_column(primary_key=True)
    joint_sample_id: Mapped[int] = mapped_column(ForeignKey("joint_samples.id"), index=True)
    rater: Mapped[str] = mapped_column(String(MAX_RATER_CHARS))
    value: Mapped[float]
    comment: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(16), server_default="stars")   # returns.RATING_KINDS
    detail: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))   # the form's answer (rank, pick)
    session_id: Mapped[str | None] = mapped_column(String(200))            # the session that sent it
    revision: Mapped[int] = mapped_column(server_default="0")   # times its rater replaced it (schema v4)
    late: Mapped[bool] = mapped_column(server_default=sa.false())   # written after its group closed (v4)
    network: Mapped[str | None] = mapped_column(String(100))   # the sender's client network (v6; None: unknown)
    signed_in: Mapped[bool] = mapped_column(server_default=sa.false())   # sent by a login or an API key (v6)


class AdapterVersionRow(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("agent", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    agent: Mapped[str] = mapped_column(String(100), index=True)
    version: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    step: Mapped[int | None]
    created_at: Mapped[datetime]
    metrics: Mapped[dict]
    pinned: Mapped[bool] = mapped_column(server_default=sa.false())
    base_model: Mapped[str | None] = mapped_column(Text)   # the base the adapter is on (schema v5; None: not recorded)


class TrainStepRow(Base):
    __tablename__ = "train_steps"
    id: Mapped[int] = mapped_column(primary_key=True)
    step: Mapped[int] = mapped_column(unique=True)
    metrics: Mapped[dict]
    created_at: Mapped[datetime]
    group_ids: Mapped[list]


class ArenaMatchRow(Base):
    """One blind comparison (schema v8): two team states' answers to one prompt, shown unlabelled as
    `a` and `b`; the vote (`winner` "a" | "b" | "tie") is written once and never changed."""
    __tablename__ = "arena_matches"
    id: Mapped[int] = mapped_column(primary_key=True)
    task: Mapped[str] = mapped_column(String(100), index=True)
    example_id: Mapped[str] = mapped_column(String(200))
    example: Mapped[dict]
    prompts: Mapped[list]                      # one per agent (the same for both sides)
    state_a: Mapped[str] = mapped_column(String(400))   # team state keys (online/arena.py state_key)
    state_b: Mapped[str] = mapped_column(String(400))
    versions_a: Mapped[dict]                   # agent -> adapter version that wrote side a (None: base)
    versions_b: Mapped[dict]
    outputs_a: Mapped[list]                    # one text per agent
    outputs_b: Mapped[list]
    combined_a: Mapped[str | None] = mapped_column(Text)
    combined_b: Mapped[str | None] = mapped_column(Text)
    sampling: Mapped[dict]
    created_at: Mapped[datetime] = mapped_column(index=True)
    session_id: Mapped[str | None] = mapped_column(String(200))   # the session the pair was made for
    winner: Mapped[str | None] = mapped_column(String(4))         # None until voted
    voter: Mapped[str | None] = mapped_column(String(MAX_RATER_CHARS))
    voted_at: Mapped[datetime | None]
    network: Mapped[str | None] = mapped_column(String(100))      # the voter's client network
    signed_in: Mapped[bool] = mapped_column(server_default=sa.false())


class AppStateRow(Base):
    """Small shared settings between the app and the trainer service (e.g. a pause flag)."""
    __tablename__ = "app_state"
    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[dict]
    updated_at: Mapped[datetime]


@event.listens_for(RatingRow, "before_update")
@event.listens_for(RatingRow, "before_delete")
def _ratings_append_only(mapper, connection, target):
    raise StoreError("ratings are append-only: only Store.add_ratings replaces a rater's own rating "
                     "(revision + 1); add a rating instead of changing one")


@event.listens_for(ArenaMatchRow, "before_update")
def _vote_once(mapper, connection, target):
    before = sa.inspect(target).attrs.winner.history.deleted
    if (before and before[0] is not None) or target.winner is None:
        raise StoreError("arena votes are written once (Store.add_arena_vote) and never changed")


@event.listens_for(ArenaMatchRow, "before_delete")
def _matches_kept(mapper, connection, target):
    raise StoreError("arena matches are never deleted: a vote once accepted is kept")


# ----------------------------------------------------------------------------- migrations

schema_version = sa.Table("schema_version", sa.MetaData(),
                          sa.Column("id", sa.Integer, primary_key=True),
                          sa.Column("version", sa.Integer, nullable=False))


def _migration_1(conn: sa.Connection) -> None:
    """Initial schema (frozen: edit only with a new migration)."""
    md = sa.MetaData()
    ts = lambda name, **kw: sa.Column(name, UTCDateTime, nullable=False, **kw)   # noqa: E731
    sa.Table("groups", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("task", sa.String(100), nullable=False, index=True),
             sa.Column("example_id", sa.String(200), nullable=False),
             sa.Column("example", JSON, nullable=False),
             sa.Column("turn", sa.Integer, nullable=False),
             sa.Column("prompts", JSON, nullable=False),
             sa.Column("num_agents", sa.Integer, nullable=False),
             sa.Column("num_generations", sa.Integer, nullable=False),
             sa.Column("max_reward", sa.Float, nullable=False),
             ts("created_at", index=True),
             sa.Column("session_id", sa.String(200)),
             sa.Column("status", sa.String(16), nullable=False, index=True),
             sa.Column("trained_step", sa.Integer))
    sa.Table("samples", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("group_id", sa.ForeignKey("groups.id"), nullable=False, index=True),
             sa.Column("agent_index", sa.Integer, nullable=False),
             sa.Column("gen_index", sa.Integer, nullable=False),
             sa.Column("agent", sa.String(100), nullable=False),
             sa.Column("adapter_version", sa.Integer),
             sa.Column("text", sa.Text, nullable=False),
             sa.Column("prompt_token_ids", JSON, nullable=False),
             sa.Column("token_ids", JSON, nullable=False),
             sa.Column("logprobs", JSON, nullable=False),
             sa.Column("finish_reason", sa.String(16), nullable=False),
             sa.Column("meta", JSON, nullable=False),
             sa.UniqueConstraint("group_id", "agent_index", "gen_index"))
    sa.Table("joint_samples", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("group_id", sa.ForeignKey("groups.id"), nullable=False, index=True),
             sa.Column("joint_index", sa.Integer, nullable=False),
             sa.Column("sample_ids", JSON, nullable=False),
             sa.Column("combined", sa.Text),
             sa.Column("auto_total", sa.Float),
             sa.Column("auto_max", sa.Float),
             sa.Column("auto_levels", JSON(none_as_null=True)),
             sa.Column("auto_details", JSON(none_as_null=True)),
             sa.Column("auto_error", sa.Text),
             sa.UniqueConstraint("group_id", "joint_index"))
    sa.Table("ratings", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("joint_sample_id", sa.ForeignKey("joint_samples.id"), nullable=False, index=True),
             sa.Column("rater", sa.String(MAX_RATER_CHARS), nullable=False),
             sa.Column("value", sa.Float, nullable=False),
             sa.Column("comment", sa.Text, nullable=False),
             ts("created_at"))
    sa.Table("adapter_versions", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("agent", sa.String(100), nullable=False, index=True),
             sa.Column("version", sa.Integer, nullable=False),
             sa.Column("path", sa.Text, nullable=False),
             sa.Column("step", sa.Integer),
             ts("created_at"),
             sa.Column("metrics", JSON, nullable=False),
             sa.UniqueConstraint("agent", "version"))
    sa.Table("train_steps", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("step", sa.Integer, nullable=False, unique=True),
             sa.Column("metrics", JSON, nullable=False),
             ts("created_at"),
             sa.Column("group_ids", JSON, nullable=False))
    md.create_all(conn)


def _migration_2(conn: sa.Connection) -> None:
    """Pinned adapter versions (admin roll-back), app_state (pause flag etc.), and append-only
    ratings enforced by the database itself, not only by this module."""
    conn.execute(sa.text("ALTER TABLE adapter_versions ADD COLUMN pinned BOOLEAN NOT NULL DEFAULT false"))
    md = sa.MetaData()
    sa.Table("app_state", md,
             sa.Column("key", sa.String(100), primary_key=True),
             sa.Column("value", JSON, nullable=False),
             sa.Column("updated_at", UTCDateTime, nullable=False))
    md.create_all(conn)
    msg = "ratings are append-only"
    if conn.dialect.name == "sqlite":
        for op in ("UPDATE", "DELETE"):
            conn.execute(sa.text(f"CREATE TRIGGER ratings_no_{op.lower()} BEFORE {op} ON ratings "
                                 f"BEGIN SELECT RAISE(ABORT, '{msg}'); END"))
    elif conn.dialect.name == "postgresql":
        conn.execute(sa.text("CREATE FUNCTION ratings_append_only() RETURNS trigger AS $$ BEGIN "
                             f"RAISE EXCEPTION '{msg}'; END $$ LANGUAGE plpgsql"))
        conn.execute(sa.text("CREATE TRIGGER ratings_append_only BEFORE UPDATE OR DELETE ON ratings "
                             "FOR EACH ROW EXECUTE FUNCTION ratings_append_only()"))
    # other databases: the ORM guard (_ratings_append_only) and the API are the enforcement


def _migration_3(conn: sa.Connection) -> None:
    """Feedback forms and who sent a rating: ratings.kind ("stars" for every older row),
    ratings.detail (the form's own answer, e.g. {"rank": 2, "of": 4}), ratings.session_id."""
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN kind VARCHAR(16) NOT NULL DEFAULT 'stars'"))
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN detail JSON"))
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN session_id VARCHAR(200)"))


RATINGS_V4_MSG = "ratings are append-only except a re-rating by the same rater (revision + 1)"


def _migration_4(conn: sa.Connection) -> None:
    """Re-rating replaces: ratings.revision (how often its rater replaced it) and
    ratings.late (written after its group was trained / expired / set aside). The UPDATE trigger
    now lets exactly one kind of update through: the same row, joint sample, rater and lateness
    with a higher revision (Store.add_ratings' replacement); DELETE stays refused."""
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN revision INTEGER NOT NULL DEFAULT 0"))
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN late BOOLEAN NOT NULL DEFAULT false"))
    same = ("NEW.id = OLD.id AND NEW.joint_sample_id = OLD.joint_sample_id AND NEW.rater = OLD.rater "
            "AND NEW.late = OLD.late AND NEW.revision > OLD.revision")
    if conn.dialect.name == "sqlite":
        conn.execute(sa.text("DROP TRIGGER IF EXISTS ratings_no_update"))
        conn.execute(sa.text(f"CREATE TRIGGER ratings_replace_only BEFORE UPDATE ON ratings WHEN NOT ({same}) "
                             f"BEGIN SELECT RAISE(ABORT, '{RATINGS_V4_MSG}'); END"))
    elif conn.dialect.name == "postgresql":
        conn.execute(sa.text("CREATE OR REPLACE FUNCTION ratings_append_only() RETURNS trigger AS $$ BEGIN "
                             f"IF TG_OP = 'UPDATE' AND {same} THEN RETURN NEW; END IF; "
                             f"RAISE EXCEPTION '{RATINGS_V4_MSG}'; END $$ "
                             "LANGUAGE plpgsql"))


def _migration_5(conn: sa.Connection) -> None:
    """Heterogeneous teams: adapter_versions.base_model, the base model (folder / HF id) the
    version's adapter is on; NULL for older rows (written when every agent was on the app's model)."""
    conn.execute(sa.text("ALTER TABLE adapter_versions ADD COLUMN base_model TEXT"))


def _migration_6(conn: sa.Connection) -> None:
    """Who stands behind a rating (the trainer's per-network and anonymous shares of a step):
    ratings.network, the client network that sent it (identity.client_network; NULL for older
    rows and trusted callers), and ratings.signed_in (a Hugging Face login or an API key; older
    rows false: they count as anonymous)."""
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN network VARCHAR(100)"))
    conn.execute(sa.text("ALTER TABLE ratings ADD COLUMN signed_in BOOLEAN NOT NULL DEFAULT false"))


def _migration_7(conn: sa.Connection) -> None:
    """Faults that must not look like the group's: groups.status_reason (why a group was expired
    or set aside, shown to admins, who can put it back) and groups.versions_at (agent -> the
    newest adapter version recorded when the group arrived: lateness counts versions written
    since, not wall-clock times of two processes). NULL for older rows."""
    conn.execute(sa.text("ALTER TABLE groups ADD COLUMN status_reason TEXT"))
    conn.execute(sa.text("ALTER TABLE groups ADD COLUMN versions_at JSON"))


def _migration_8(conn: sa.Connection) -> None:
    """The blind arena: arena_matches, two team states' answers to one prompt and the one vote on them."""
    md = sa.MetaData()
    ts = lambda name, **kw: sa.Column(name, UTCDateTime, **kw)   # noqa: E731
    sa.Table("arena_matches", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("task", sa.String(100), nullable=False, index=True),
             sa.Column("example_id", sa.String(200), nullable=False),
             sa.Column("example", JSON, nullable=False),
             sa.Column("prompts", JSON, nullable=False),
             sa.Column("state_a", sa.String(400), nullable=False),
             sa.Column("state_b", sa.String(400), nullable=False),
             sa.Column("versions_a", JSON, nullable=False),
             sa.Column("versions_b", JSON, nullable=False),
             sa.Column("outputs_a", JSON, nullable=False),
             sa.Column("outputs_b", JSON, nullable=False),
             sa.Column("combined_a", Text),
             sa.Column("combined_b", Text),
             sa.Column("sampling", JSON, nullable=False),
             ts("created_at", nullable=False, index=True),
             sa.Column("session_id", sa.String(200)),
             sa.Column("winner", sa.String(4)),
             sa.Column("voter", sa.String(MAX_RATER_CHARS)),
             ts("voted_at"),
             sa.Column("network", sa.String(100)),
             sa.Column("signed_in", sa.Boolean, nullable=False, server_default=sa.false()))
    md.create_all(conn)


MIGRATIONS = [_migration_1, _migration_2, _migration_3, _migration_4, _migration_5, _migration_6, _migration_7,
              _migration_8]
"""MIGRATIONS[i] takes the schema from version i to i + 1."""
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sa.Connection, target: int = SCHEMA_VERSION) -> tuple[int, int]:
    """Apply the missing migrations inside the caller's transaction. Returns (from, to)."""
    if conn.dialect.name == "postgresql":   # several app replicas starting at once
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7312026)"))
    schema_version.create(conn, checkfirst=True)
    current = conn.scalar(select(schema_version.c.version).where(schema_version.c.id == 1))
    if current is None:
        current = 0
        conn.execute(schema_version.insert().values(id=1, version=0))
    if current > len(MIGRATIONS):
        raise StoreError(f"the database is at schema version {current} but this code knows only up "
                         f"to {len(MIGRATIONS)}: upgrade collab (or point COLLAB_DB at another database)")
    for v in range(current, target):
        MIGRATIONS[v](conn)
    if target > current:
        conn.execute(schema_version.update().where(schema_version.c.id == 1).values(version=target))
    return current, max(current, target)


# ----------------------------------------------------------------------------- plain records

@dataclass(frozen=True)
class RatingRecord:
    id: int
    joint_sample_id: int
    rater: str
    value: float
    comment: str
    created_at: datetime
    kind: str = "stars"               # feedback form (collab_app.online.returns.RATING_KINDS)
    detail: dict | None = None        # the form's own answer: {"rank": r, "of": G}, {"best": bool, "of": G}
    session_id: str | None = None     # the session that sent it (None: trusted caller / older rows)
    revision: int = 0                 # how often its rater replaced it (re-rating; schema v4)
    late: bool = False                # written after its group was trained / expired / set aside
    network: str | None = None        # the sender's client network (None: unknown / trusted caller)
    signed_in: bool = False           # sent by a Hugging Face login or an API key (else anonymous)


@dataclass(frozen=True)
class JointRecord:
    id: int
    group_id: int
    joint_index: int
    joint: tuple[int, ...]            # generation index per agent (into GroupRecord.samples[agent])
    sample_ids: list[int]
    combined: str | None
    auto_total: float | None
    auto_max: float | None
    auto_levels: dict | None
    auto_details: dict | None
    auto_error: str | None
    ratings: list[RatingRecord]       # oldest first


@dataclass(frozen=True)
class GroupRecord:
    id: int
    task: str
    example_id: str
    example: dict
    turn: int
    prompts: list[str]
    num_agents: int
    num_generations: int
    max_reward: float
    created_at: datetime
    session_id: str | None
    status: str
    trained_step: int | None
    samples: list[list[Sample]]       # [agent][g]
    joints: list[JointRecord]
    status_reason: str | None = None  # why it was expired / set aside (None: not closed so, or not recorded)
    versions_at: dict | None = None   # agent -> newest adapter version when it arrived (None: older rows)


@dataclass(frozen=True)
class ReadyGroup:
    """A group with a return for every joint action: what the trainer turns into its `Group`."""
    group_id: int
    task: str
    example_id: str
    example: dict
    turn: int
    prompts: list[str]                # per agent
    samples: list[list[Sample]]       # [agent][g]
    joint: list[tuple[int, ...]]      # joint action k -> sample index per agent
    returns: list[float]              # per joint action
    levels: list[dict]                # automatic levels per joint action ({} when none)
    sources: list[str]                # "auto" | "human" | "weighted" per joint action
    joint_sample_ids: list[int]
    max_reward: float
    created_at: datetime
    ratings_seen: int | None = None   # rating writes of the group when read; None: the rule ignores ratings
    rater: str | None = None          # the rater whose ratings decide most of its returns (`returns.deciding_rater`)
    network: str | None = None        # that rater's client network, as its latest rating here says
    signed_in: bool = False           # that rater signed in (a login or an API key) when it rated
    arrived_versions: dict | None = None   # agent -> newest adapter version when it arrived (lateness)


@dataclass(frozen=True)
class AdapterVersionRecord:
    agent: str
    version: int
    path: str
    step: int | None
    created_at: datetime
    metrics: dict = field(default_factory=dict)
    pinned: bool = False
    base_model: str | None = None     # the base the adapter is on (None: not recorded, older rows)


@dataclass(frozen=True)
class ArenaMatchRecord:
    id: int
    task: str
    example_id: str
    example: dict
    prompts: list
    state_a: str
    state_b: str
    versions_a: dict
    versions_b: dict
    outputs_a: list
    outputs_b: list
    combined_a: str | None
    combined_b: str | None
    sampling: dict
    created_at: datetime
    session_id: str | None
    winner: str | None = None         # "a" | "b" | "tie"; None until voted
    voter: str | None = None
    voted_at: datetime | None = None
    network: str | None = None
    signed_in: bool = False


def _match(m: ArenaMatchRow) -> ArenaMatchRecord:
    return ArenaMatchRecord(**{f: getattr(m, f) for f in ArenaMatchRecord.__dataclass_fields__})


def _rating(r: RatingRow) -> RatingRecord:
    return RatingRecord(r.id, r.joint_sample_id, r.rater, r.value, r.comment, r.created_at, r.kind,
                        None if r.detail is None else dict(r.detail), r.session_id, r.revision or 0, bool(r.late),
                        r.network, bool(r.signed_in))


def _rated_by(grp: GroupRow, rater: str | None) -> tuple[str | None, bool]:
    """(network, signed_in) of `rater`'s latest rating in force in the group; (None, False) for none."""
    latest = max((r for j in grp.joints for r in j.ratings if r.rater == rater and not r.late),
                 key=lambda r: (r.created_at, r.id), default=None)
    return (None, False) if latest is None else (latest.network, bool(latest.signed_in))


def _writes(grp: GroupRow) -> int:
    """Rating writes a group has had: each row once, plus once per replacement (its revision)."""
    return sum(1 + (r.revision or 0) for j in grp.joints for r in j.ratings)


def _enough_kept(grp: GroupRow, returns: Sequence[float | None]) -> bool:
    """Whether the joint samples with a return still give every agent MIN_GENERATIONS answers
    (a group trained on part of its joints: returns.group_returns)."""
    kept = [j for j, r in zip(grp.joints, returns) if r is not None]
    if len(kept) == len(grp.joints):
        return True   # the whole group: the trainer checks its shape
    return all(len({j.sample_ids[i] for j in kept}) >= MIN_GENERATIONS for i in range(grp.num_agents))


def _returned_only(rec: GroupRecord, returns: Sequence[float | None]) -> tuple[list[list[Sample]], list[tuple]]:
    """The group's samples [agent][g] and joint actions, keeping only the joint samples that have
    a return and the answers those use, renumbered (every joint when all have one)."""
    kept = [j.joint for j, r in zip(rec.joints, returns) if r is not None]
    if len(kept) == len(rec.joints):
        return rec.samples, kept
    used = [sorted({j[i] for j in kept}) for i in range(rec.num_agents)]     # per agent: old indices kept
    new = [{g: n for n, g in enumerate(u)} for u in used]
    return ([[rec.samples[i][g] for g in used[i]] for i in range(rec.num_agents)],
            [tuple(new[i][j[i]] for i in range(rec.num_agents)) for j in kept])


def _sample(s: SampleRow) -> Sample:
    return Sample(agent=s.agent, adapter_version=s.adapter_version, prompt_token_ids=list(s.prompt_token_ids),
                  text=s.text, token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                  finish_reason=s.finish_reason, meta=dict(s.meta))


def _adapter(a: AdapterVersionRow) -> AdapterVersionRecord:
    return AdapterVersionRecord(a.agent, a.version, a.path, a.step, a.created_at, dict(a.metrics), a.pinned,
                                a.base_model)


def _check_sample(s: Sample, where: str) -> None:
    """Token ids ints, one finite behaviour log-prob per generated token: what the trainer needs."""
    if not isinstance(s, Sample):
        raise StoreError(f"{where} must be a collab_app.engines.engine_types.Sample, got {type(s).__name__}")
    for name in ("prompt_token_ids", "token_ids"):
        ids = getattr(s, name)
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in ids):
            raise StoreError(f"{where}.{name} must be a list of ints")
    lp = s.logprobs
    if not isinstance(lp, (list, tuple)) or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) for x in lp):
        raise StoreError(f"{where}.logprobs must be a list of finite floats (the engine produced -inf/nan?)")
    if len(lp) != len(s.token_ids):
        raise StoreError(f"{where}: {len(lp)} logprobs for {len(s.token_ids)} token_ids (need one per token)")


# ----------------------------------------------------------------------------- the store

class Store:
    def __init__(self, url: str | None = None, echo: bool = False):
        self.url = url or paths.store_url()
        u = sa.engine.make_url(self.url)
        self.is_sqlite = u.get_backend_name() == "sqlite"
        memory = self.is_sqlite and u.database in (None, "", ":memory:")
        kw: dict[str, Any] = {"pool_pre_ping": not self.is_sqlite}
        if memory:   # one shared connection (else each thread sees its own empty database)
            kw.update(poolclass=sa.pool.StaticPool, connect_args={"check_same_thread": False})
        elif self.is_sqlite:
            os.makedirs(os.path.dirname(os.path.abspath(u.database)), exist_ok=True)
        self.engine = sa.create_engine(u, echo=echo, **kw)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_on_connect)
            event.listen(self.engine, "begin", _sqlite_on_begin)
        # same pool; on SQLite its transactions start with BEGIN IMMEDIATE (module docstring)
        self._writer = self.engine.execution_options(collab_write=True)
        self._write_lock = threading.RLock() if self.is_sqlite else contextlib.nullcontext()
        self._read_lock = self._write_lock if memory else contextlib.nullcontext()
        with self._writer.begin() as conn:
            self.migrated_from, _ = migrate(conn)

    def close(self) -> None:
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def _write(self) -> Iterator[Session]:
        # SQLite has one writer at a time anyway; queueing this process's threads on a Python
        # lock keeps them out of SQLite's busy handler, whose sleep-and-retry is not fair.
        with self._write_lock, Session(self._writer, expire_on_commit=False) as s, s.begin():
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_lock, Session(self.engine) as s, s.begin():
            yield s

    # -- groups ----------------------------------------------------------------------------

    def add_group(self, task: str, example: dict, prompts: Sequence[str],
                  samples: Sequence[Sequence[Sample]], joint: Sequence[Sequence[int]],
                  auto_rewards: Sequence[Reward | None], session_id: str | None = None, *,
                  combined: Sequence[str] | None = None, auto_errors: Sequence[str | None] | None = None,
                  turn: int = 0, max_reward: float | None = None) -> tuple[int, list[int]]:
        """Store one group atomically: its samples ([agent][g]), its joint actions (joint[k][i] =
        index of agent i's sample in joint action k) and their automatic rewards (a
        `tasks.base.Reward`, or None for human-only tasks / failed checks, then say why in
        `auto_errors[k]`). `max_reward` (the task's best total) is taken from the rewards when
        not given; human-only groups must pass it. Returns (group_id, joint_sample_ids)."""
        n_agents = len(samples)
        if not isinstance(task, str) or not task:
            raise StoreError("task must be the task's name (a non-empty string)")
        if not isinstance(example, dict):
            raise StoreError("example must be a dict with an 'id'")
        if n_agents < 1 or len(prompts) != n_agents:
            raise StoreError(f"need one prompt per agent: {len(prompts)} prompts for {n_agents} agents")
        G = len(samples[0])
        if G < 1 or any(len(row) != G for row in samples):
            raise StoreError("samples must be [agent][g] with the same number of generations per agent")
        for i, row in enumerate(samples):
            for g, smp in enumerate(row):
                _check_sample(smp, f"samples[{i}][{g}]")
        joint = [tuple(j) for j in joint]
        if not joint or any(len(j) != n_agents or not all(
                isinstance(x, int) and 0 <= x < G for x in j) for j in joint):
            raise StoreError(f"joint must list, per joint action, one sample index in [0, {G}) per agent")
        K = len(joint)
        if len(auto_rewards) != K:
            raise StoreError(f"{len(auto_rewards)} auto_rewards for {K} joint actions")
        for extra, name in ((combined, "combined"), (auto_errors, "auto_errors")):
            if extra is not None and len(extra) != K:
                raise StoreError(f"{name} needs one entry per joint action ({K})")
        if max_reward is None:
            maxes = {r.max_total for r in auto_rewards if r is not None}
            if not maxes:
                raise StoreError("a group without automatic rewards needs max_reward= (the task's max_reward)")
            max_reward = max(maxes)
        if not (isinstance(max_reward, (int, float)) and math.isfinite(max_reward) and max_reward > 0):
            raise StoreError(f"max_reward must be a positive number, got {max_reward!r}")
        for k, r in enumerate(auto_rewards):
            if r is not None and not (isinstance(r, Reward) and math.isfinite(r.total)):
                raise StoreError(f"auto_rewards[{k}] must be a tasks.base.Reward with a finite total, or None")

        example_id = str(example.get("id", ""))
        with self._write() as s:
            newest = dict(s.execute(select(AdapterVersionRow.agent, func.max(AdapterVersionRow.version))
                                    .group_by(AdapterVersionRow.agent)).all())
            grp = GroupRow(task=task, example_id=example_id, example=jsonable(example), turn=int(turn),
                           prompts=list(prompts), num_agents=n_agents, num_generations=G,
                           max_reward=float(max_reward), created_at=utcnow(), session_id=session_id,
                           status="open", trained_step=None, versions_at={str(a): int(v) for a, v in newest.items()})
            s.add(grp)
            rows = [[SampleRow(agent_index=i, gen_index=g, agent=smp.agent, adapter_version=smp.adapter_version,
                               text=smp.text, prompt_token_ids=[int(x) for x in smp.prompt_token_ids],
                               token_ids=[int(x) for x in smp.token_ids], logprobs=[float(x) for x in smp.logprobs],
                               finish_reason=smp.finish_reason, meta=jsonable(smp.meta))
                     for g, smp in enumerate(row)] for i, row in enumerate(samples)]
            grp.samples = [r for row in rows for r in row]
            s.flush()   # sample ids for the joint rows
            joints = []
            for k, (j, r) in enumerate(zip(joint, auto_rewards)):
                joints.append(JointRow(
                    joint_index=k, sample_ids=[rows[i][g].id for i, g in enumerate(j)],
                    combined=None if combined is None else combined[k],
                    auto_total=None if r is None else float(r.total),
                    auto_max=None if r is None else float(r.max_total),
                    auto_levels=None if r is None else jsonable(dict(r.levels)),
                    auto_details=None if r is None else jsonable(dict(r.details)),
                    auto_error=None if auto_errors is None else auto_errors[k]))
            grp.joints = joints
            if G < MIN_GENERATIONS:
                grp.status = "untrainable"
                grp.status_reason = f"{G} answer per agent: a group-relative advantage needs at least {MIN_GENERATIONS}"
            elif all(r is not None for r in auto_rewards):
                grp.status = "ready"
            s.flush()
            return grp.id, [j.id for j in joints]

    def group(self, group_id: int) -> GroupRecord:
        """One group with its samples, joint samples and their ratings (NotFound if absent)."""
        with self._read() as s:
            grp = s.get(GroupRow, group_id, options=[selectinload(GroupRow.samples),
                                                     selectinload(GroupRow.joints).selectinload(JointRow.ratings)])
            if grp is None:
                raise NotFound(f"no group with id {group_id}")
            return self._group_record(grp)

    @staticmethod
    def _group_record(grp: GroupRow) -> GroupRecord:
        samples: list[list[Sample]] = [[] for _ in range(grp.num_agents)]
        where: dict[int, int] = {}
        for r in grp.samples:
            samples[r.agent_index].append(_sample(r))
            where[r.id] = r.gen_index
        joints = [JointRecord(j.id, grp.id, j.joint_index, tuple(where[sid] for sid in j.sample_ids),
                              list(j.sample_ids), j.combined, j.auto_total, j.auto_max, j.auto_levels,
                              j.auto_details, j.auto_error, [_rating(r) for r in j.ratings])
                  for j in grp.joints]
        return GroupRecord(grp.id, grp.task, grp.example_id, grp.example, grp.turn, list(grp.prompts),
                           grp.num_agents, grp.num_generations, grp.max_reward, grp.created_at,
                           grp.session_id, grp.status, grp.trained_step, samples, joints, grp.status_reason,
                           None if grp.versions_at is None else dict(grp.versions_at))

    def groups_of(self, joint_sample_ids: Sequence[int]) -> list[int]:
        """The ids of the groups these joint samples belong to, sorted (one indexed read)."""
        with self._read() as s:
            return sorted(set(s.scalars(select(JointRow.group_id).where(JointRow.id.in_(
                [int(j) for j in joint_sample_ids])))))

    def recent_groups(self, n: int = 20, session_id: str | None = None) -> list[GroupRecord]:
        """The newest `n` groups (optionally of one session), newest first, with samples and ratings."""
        with self._read() as s:
            q = select(GroupRow).order_by(GroupRow.id.desc()).limit(n).options(
                selectinload(GroupRow.samples), selectinload(GroupRow.joints).selectinload(JointRow.ratings))
            if session_id is not None:
                q = q.where(GroupRow.session_id == session_id)
            return [self._group_record(g) for g in s.scalars(q)]

    def rated_joints(self, n_groups: int = 200) -> list[tuple[float | None, float, list[tuple[str, float]]]]:
        """(auto_total, the group's max_reward, [(rater, value)] oldest first) of every rated joint
        sample of the newest `n_groups` groups: the Training tab's human-vs-auto plot, without the
        texts, token ids and log-probs that recent_groups loads."""
        with self._read() as s:
            newest = select(GroupRow.id).order_by(GroupRow.id.desc()).limit(n_groups).scalar_subquery()
            q = (select(JointRow.id, JointRow.auto_total, GroupRow.max_reward, RatingRow.rater, RatingRow.value)
                 .join(GroupRow, GroupRow.id == JointRow.group_id)
                 .join(RatingRow, RatingRow.joint_sample_id == JointRow.id)
                 .where(JointRow.group_id.in_(newest))
                 .order_by(JointRow.group_id.desc(), JointRow.joint_index, RatingRow.id))
            out: dict[int, tuple] = {}
            for jid, auto, max_reward, rater, value in s.execute(q):
                out.setdefault(jid, (auto, max_reward, []))[2].append((rater, value))
            return list(out.values())

    def iter_groups(self, batch_size: int = 100) -> Iterator[GroupRecord]:
        """Every group, oldest first, loaded `batch_size` at a time (one read transaction per
        batch, so a long export never holds a snapshot open)."""
        last_id = 0
        while True:
            with self._read() as s:
                q = (select(GroupRow).where(GroupRow.id > last_id).order_by(GroupRow.id).limit(batch_size)
                     .options(selectinload(GroupRow.samples),
                              selectinload(GroupRow.joints).selectinload(JointRow.ratings)))
                page = [self._group_record(g) for g in s.scalars(q)]
            if not page:
                return
            yield from page
            last_id = page[-1].id

    # -- ratings (one row per joint sample and rater; re-rating replaces) ------------------

    def add_rating(self, joint_sample_id: int, rater: str, value: float, comment: str = "", *,
                   kind: str = "stars", detail: dict | None = None, session_id: str | None = None,
                   network: str | None = None, signed_in: bool = False) -> int:
        """Store one rating (1..5) of a joint sample by `rater`; returns its id after commit.
        Re-rating replaces the rater's row (same id, revision + 1). See `add_ratings` for kind,
        detail, session_id, network, signed_in and late ratings. Bad input -> StoreError, nothing stored."""
        return self.add_ratings([(joint_sample_id, value)], rater, comment, kind=kind,
                                details=None if detail is None else [detail], session_id=session_id,
                                network=network, signed_in=signed_in)[0]

    def add_ratings(self, items: Sequence[tuple[int, float]], rater: str, comment: str = "", *,
                    kind: str = "stars", details: Sequence[dict | None] | None = None,
                    session_id: str | None = None, network: str | None = None,
                    signed_in: bool = False) -> list[int]:
        """Store several ratings by one rater in one transaction (all or nothing): `items` are
        (joint_sample_id, value 1..5); `kind` the feedback form (returns.RATING_KINDS), `details`
        one JSON dict per item with the form's own answer. With `session_id` given, every joint
        sample must belong to a group that session generated (else NotEntitled) and the id is
        kept on the rows; None = no check (admins, scripts on the store). `network` (the sender's
        client network, the key the web limits count by) and `signed_in` (a login or an API key)
        are kept on the rows: the trainer's per-network and anonymous shares of a step read them.
        Returns the ids.

        A rater who already rated a joint sample replaces that row (value, comment, kind, detail,
        session_id, created_at; revision + 1; the same id comes back), so re-rating never adds
        rows without bound. On a group already trained, expired or set aside the rating is a
        `late` row instead: the rating in force when the group closed is kept as it was, the late
        row is stored for the export (and replaced by that rater's further re-ratings), and the
        group never becomes ready again (only open groups are made ready)."""
        if not isinstance(rater, str) or not rater.strip():
            raise StoreError("rater must be a non-empty name (or a session id)")
        if len(rater) > MAX_RATER_CHARS:
            raise StoreError(f"rater is {len(rater)} characters; the limit is {MAX_RATER_CHARS}")
        if not isinstance(comment, str):
            raise StoreError(f"comment must be text, got {type(comment).__name__}")
        if len(comment) > MAX_COMMENT_CHARS:
            raise StoreError(f"comment is {len(comment):,} characters; the limit is {MAX_COMMENT_CHARS:,}")
        if kind not in RATING_KINDS:
            raise StoreError(f"rating kind must be one of {RATING_KINDS}, got {kind!r:.40}")
        if session_id is not None and (not isinstance(session_id, str) or len(session_id) > 200):
            raise StoreError("session_id must be text of at most 200 characters")
        if network is not None and (not isinstance(network, str) or len(network) > 100):
            raise StoreError("network must be text of at most 100 characters")
        if not items:
            raise StoreError("no ratings given")
        if details is not None and len(details) != len(items):
            raise StoreError(f"details needs one entry per rating ({len(items)}), got {len(details)}")
        checked = []
        for jid, value in items:
            v = check_rating_value(value)
            if isinstance(jid, bool) or not isinstance(jid, numbers.Integral):
                raise StoreError(f"joint_sample_id must be an integer id, got {jid!r:.40}")
            checked.append((int(jid), v))
        ids = [jid for jid, _ in checked]
        if len(set(ids)) != len(ids):
            raise StoreError("the same joint sample appears twice in one submission")
        rater = rater.strip()
        with self._write() as s:
            ids_out, rows, groups = [], [], {}
            for k, (jid, v) in enumerate(checked):
                # FOR UPDATE (PostgreSQL): two submissions by one rater on one joint sample queue here,
                # so the second finds the first's row and replaces it (SQLite: BEGIN IMMEDIATE already)
                joint = s.get(JointRow, jid, with_for_update=True)
                if joint is None:
                    raise NotFound(f"no joint sample with id {jid}: rate a candidate that was stored")
                # the group's row lock (PostgreSQL; SQLite: BEGIN IMMEDIATE) orders this rating with a
                # step's record_train_step: before it (counted, the group stays ready) or after (late)
                grp = groups.get(joint.group_id) or s.get(GroupRow, joint.group_id, with_for_update=True)
                groups[grp.id] = grp
                if session_id is not None and grp.session_id != session_id:
                    raise NotEntitled(f"joint sample {jid} belongs to group #{grp.id}, which another "
                                      "session generated: only that session (or an admin) may rate it")
                detail = None if details is None else details[k]
                fields = dict(value=v, comment=comment, created_at=utcnow(), kind=kind,
                              detail=None if detail is None else jsonable(dict(detail)), session_id=session_id,
                              network=network, signed_in=bool(signed_in))
                closed = grp.status in ("trained", "expired", "untrainable")
                mine = s.execute(select(RatingRow.id, RatingRow.revision, RatingRow.late)
                                 .where(RatingRow.joint_sample_id == jid, RatingRow.rater == rater)
                                 .order_by(RatingRow.id.desc()).limit(1)).first()
                if mine is not None and (mine.late or not closed):   # replace it (ORM events bypassed: Core)
                    s.execute(sa.update(RatingRow).where(RatingRow.id == mine.id)
                              .values(revision=(mine.revision or 0) + 1, **fields)
                              .execution_options(synchronize_session=False))
                    ids_out.append(mine.id)
                else:                                                 # first rating, or first late one
                    row = RatingRow(joint_sample_id=jid, rater=rater, revision=0, late=closed, **fields)
                    rows.append(row)
                    ids_out.append(row)
            s.add_all(rows)
            s.flush()
            for grp in groups.values():
                if grp.status == "open":
                    self._maybe_ready(s, grp)
            return [x if isinstance(x, int) else x.id for x in ids_out]

    @staticmethod
    def _maybe_ready(s: Session, grp: GroupRow) -> None:
        """open -> ready once every joint sample has an automatic reward or a rating (never for a
        group of fewer than MIN_GENERATIONS answers: add_group makes those untrainable)."""
        if grp.num_generations < MIN_GENERATIONS:
            return
        pending = s.scalar(select(func.count()).select_from(JointRow).where(
            JointRow.group_id == grp.id, JointRow.auto_total.is_(None),
            ~sa.exists().where(RatingRow.joint_sample_id == JointRow.id)))
        if not pending:
            grp.status = "ready"

    def ratings_for(self, joint_sample_id: int | None = None, group_id: int | None = None,
                    rater: str | None = None, kind: str | None = None) -> list[RatingRecord]:
        """Every stored rating (oldest first), filtered by joint sample, group, rater and/or kind."""
        with self._read() as s:
            q = select(RatingRow).order_by(RatingRow.id)
            if kind is not None:
                q = q.where(RatingRow.kind == kind)
            if joint_sample_id is not None:
                q = q.where(RatingRow.joint_sample_id == joint_sample_id)
            if group_id is not None:
                q = q.join(JointRow).where(JointRow.group_id == group_id)
            if rater is not None:
                q = q.where(RatingRow.rater == rater)
            return [_rating(r) for r in s.scalars(q)]

    # -- training --------------------------------------------------------------------------

    def ready_groups(self, rule: ReturnRule, limit: int = 64, now: datetime | None = None,
                     task: str | None = None, exclude_tasks: Sequence[str] = (),
                     admit: Callable[..., bool] | None = None) -> list[ReadyGroup]:
        """Up to `limit` untrained groups whose every joint sample has a return under `rule`,
        oldest first (so nothing waits forever behind newer data); groups of `exclude_tasks` are
        left out of the scan (they stay in the store, untouched). Cost: it reads open groups
        (with their ratings) in id order until it has `limit`, so call `expire_groups` first to
        keep groups that can never become ready out of the scan.

        Groups of fewer than MIN_GENERATIONS answers are never returned (their advantage would
        raise and stop every step). Each group carries `ratings_seen`, the number of rating writes
        (first ratings and replacements) it has had at this read (None under mode "auto", where
        ratings do not change the return), for `record_train_step` to see whether a rating
        arrived while the step ran, and `rater`, the rater whose ratings decide most of its
        returns (`returns.deciding_rater`; None when no rating decides any), with that rater's
        `network` and `signed_in` as its latest rating in the group recorded them.

        `admit(group_id=, task=, rater=, network=, signed_in=)`, when given, is asked about each
        ready group in scan order before its samples are read; one it refuses is left out of this
        read (it stays ready, untouched) and does not count against `limit`. The store decides
        nothing about raters: the trainer service's shares of a step are its `admit`
        (service.scan_shares), so one backlog cannot fill `limit` and hide other raters' groups."""
        now = now or utcnow()
        out: list[ReadyGroup] = []
        last_id = 0
        with self._read() as s:
            while len(out) < limit:
                q = (select(GroupRow).where(GroupRow.status.in_(("open", "ready")), GroupRow.id > last_id,
                                            GroupRow.num_generations >= MIN_GENERATIONS)
                     .order_by(GroupRow.id).limit(200)
                     .options(selectinload(GroupRow.joints).selectinload(JointRow.ratings)))
                if task is not None:
                    q = q.where(GroupRow.task == task)
                if exclude_tasks:
                    q = q.where(GroupRow.task.not_in(list(exclude_tasks)))
                page = list(s.scalars(q))
                if not page:
                    break
                last_id = page[-1].id
                for grp in page:
                    inputs = self._inputs(grp, now)
                    got = group_returns(rule, *inputs)
                    if got is None or not _enough_kept(grp, got[0]):
                        continue
                    rater = None if rule.mode == "auto" else deciding_rater(inputs[1], got[1])
                    network, signed_in = _rated_by(grp, rater)
                    if admit is not None and not admit(group_id=grp.id, task=grp.task, rater=rater,
                                                       network=network, signed_in=signed_in):
                        continue
                    rec = self._group_record(grp)   # loads its samples
                    samples, joints = _returned_only(rec, got[0])
                    keep = [k for k, r in enumerate(got[0]) if r is not None]
                    out.append(ReadyGroup(grp.id, grp.task, grp.example_id, grp.example, grp.turn,
                                          list(grp.prompts), samples, joints,
                                          [got[0][k] for k in keep], [rec.joints[k].auto_levels or {} for k in keep],
                                          [got[1][k] for k in keep], [rec.joints[k].id for k in keep],
                                          grp.max_reward, grp.created_at,
                                          None if rule.mode == "auto" else _writes(grp), rater,
                                          network, signed_in, rec.versions_at))
                    if len(out) >= limit:
                        break
        return out

    @staticmethod
    def _inputs(grp: GroupRow, now: datetime):
        autos = [j.auto_total for j in grp.joints]
        ratings = [[(r.rater, r.value) for r in j.ratings if not r.late] for j in grp.joints]
        return autos, ratings, grp.max_reward, (now - grp.created_at).total_seconds()

    def mark_trained(self, group_ids: Sequence[int], step: int) -> int:
        """Mark groups trained at `step`; returns how many changed (already trained ones stay)."""
        with self._write() as s:
            return self._mark(s, group_ids, step)

    @staticmethod
    def _mark(s: Session, group_ids: Sequence[int], step: int) -> int:
        if not group_ids:
            return 0
        res = s.execute(sa.update(GroupRow).where(GroupRow.id.in_(list(group_ids)), GroupRow.status != "trained")
                        .values(status="trained", trained_step=int(step)))
        return res.rowcount

    def record_train_step(self, step: int, metrics: dict, group_ids: Sequence[int],
                          stale_group_ids: Sequence[int] = (),
                          ratings_seen: Mapping[int, int | None] | None = None, *,
                          versions: Sequence[Mapping[str, Any]] = (), stale_reason: str = "",
                          lease: tuple[str, str] | None = None) -> list[int]:
        """One trainer step in one transaction: the adapter `versions` it wrote (dicts of
        `record_adapter_version`'s arguments: agent, version, path, base_model), its metrics, the
        groups that went into its gradient (`group_ids`) marked trained, and the groups the
        trainer dropped as too late (`stale_group_ids`) marked expired with `stale_reason`, so they
        are not retried forever (their ratings stay). All or nothing: a store error leaves no
        version row without its step (the trainer reconciles the folder at its next start).

        `lease` (app_state key, owner): the step is recorded only while `owner` holds that lease
        (the trainer service's one-trainer-per-store lease), checked inside this transaction;
        else LeaseLost and nothing is written: a trainer that lost its lease (it hung, another
        took over) cannot publish beside the one that holds it.

        `ratings_seen` (group id -> `ReadyGroup.ratings_seen` of the read the step trained on): a
        group that has more ratings now was re-rated while the step ran, so its gradient used an
        old return; it stays ready (trained again, on the new return, by a later step) and the
        step's metrics get "groups_rerated". The count is of rating writes (rows plus their
        revisions: a re-rating replaces a row and bumps its revision, which the triggers only let
        grow), taken after the groups' rows are locked (FOR UPDATE: a rating being written waits
        for this transaction, and one written before it is counted). Returns the ids kept ready."""
        used = [int(g) for g in group_ids]
        stale = [int(g) for g in stale_group_ids]
        with self._write() as s:
            if lease is not None:
                row = s.get(AppStateRow, lease[0], with_for_update=True)
                holder = (row.value or {}).get("owner") if row is not None else None
                if holder != lease[1]:
                    raise LeaseLost(f"this trainer ({lease[1]}) no longer holds the store's trainer lease "
                                    f"(held by {holder}): step {step} not recorded")
            if s.scalar(select(TrainStepRow.id).where(TrainStepRow.step == int(step))):
                raise StoreError(f"train step {step} is already recorded: steps are numbered once")
            if used or stale:   # lock in id order (no deadlock with expire_groups / set_aside)
                s.execute(select(GroupRow.id).where(GroupRow.id.in_(used + stale)).order_by(GroupRow.id)
                          .with_for_update())
            for v in versions:
                self._add_version(s, **{"metrics": metrics, **v}, step=step)
            seen = {int(g): n for g, n in (ratings_seen or {}).items() if n is not None and int(g) in used}
            rerated = []
            if seen:
                now = {g: int(n) for g, n in s.execute(
                    select(JointRow.group_id, func.sum(RatingRow.revision + 1))
                    .join(RatingRow, RatingRow.joint_sample_id == JointRow.id)
                    .where(JointRow.group_id.in_(list(seen))).group_by(JointRow.group_id)).all()}
                rerated = [g for g in used if g in seen and now.get(g, 0) != seen[g]]
            if rerated:
                metrics = {**metrics, "groups_rerated": len(rerated)}
            s.add(TrainStepRow(step=int(step), metrics=jsonable(metrics), created_at=utcnow(), group_ids=used))
            self._mark(s, [g for g in used if g not in rerated], step)
            if stale:
                s.execute(sa.update(GroupRow).where(GroupRow.id.in_(stale), GroupRow.status.in_(("open", "ready")))
                          .values(status="expired", status_reason=stale_reason or "too late for the trainer"))
            return rerated

    def train_steps(self, last: int | None = None) -> list[dict]:
        """Recorded steps, oldest first (the `last` n when given): {step, metrics, created_at, group_ids}."""
        with self._read() as s:
            q = select(TrainStepRow).order_by(TrainStepRow.step.desc())
            if last is not None:
                q = q.limit(last)
            rows = list(s.scalars(q))[::-1]
            return [dict(step=r.step, metrics=r.metrics, created_at=r.created_at, group_ids=r.group_ids)
                    for r in rows]

    def expire_groups(self, rule: ReturnRule, now: datetime | None = None) -> list[int]:
        """Mark `expired` the untrained groups older than `rule.human_timeout_s` that are still not
        ready under `rule` (e.g. human-only groups nobody rated), with the reason. Their ratings
        stay; a late rating is still stored but does not revive the group. Returns the expired ids.
        Also marks "untrainable" the open/ready groups of fewer than MIN_GENERATIONS answers that a
        store written before such groups were refused may still hold (not in the returned ids).

        The scan of old groups is a read; only the groups it finds are locked (FOR UPDATE on
        PostgreSQL, so a rating landing at the same time either comes first and counts, or comes
        after and is stored late) and checked again in the write."""
        now = now or utcnow()
        with self._write() as s:
            s.execute(sa.update(GroupRow).where(GroupRow.status.in_(("open", "ready")),
                                                GroupRow.num_generations < MIN_GENERATIONS)
                      .values(status="untrainable", status_reason=f"fewer than {MIN_GENERATIONS} answers per agent"))
        if math.isinf(rule.human_timeout_s):
            return []
        cutoff = now - timedelta(seconds=rule.human_timeout_s)
        q = (select(GroupRow).where(GroupRow.status.in_(("open", "ready")), GroupRow.created_at <= cutoff)
             .order_by(GroupRow.id).options(selectinload(GroupRow.joints).selectinload(JointRow.ratings)))
        with self._read() as s:
            found = [g.id for g in s.scalars(q) if group_state(rule, *self._inputs(g, now)) == "expired"]
        if not found:
            return []
        with self._write() as s:
            rows = list(s.scalars(q.where(GroupRow.id.in_(found)).with_for_update(of=GroupRow)))
            expired = []
            for g in rows:
                inputs = self._inputs(g, now)
                if group_state(rule, *inputs) == "expired":
                    missing = sum(1 for a, r in zip(inputs[0], inputs[1]) if joint_return(rule, a, human_score(
                        r, g.max_reward), True) is None)
                    g.status = "expired"
                    g.status_reason = (f"no return for {missing} of {len(g.joints)} candidates "
                                       f"{rule.human_timeout_s:.0f} s after it was generated (return mode "
                                       f"{rule.mode}: not rated, and no automatic reward to fall back on)")
                    expired.append(g.id)
            return expired

    def set_aside(self, group_ids: Sequence[int], reason: str = "") -> int:
        """Mark untrained groups "untrainable" with the reason (the trainer service does it to a
        group that its trainer cannot use, so it cannot stop every later step). Ratings stay; an
        admin can `put_back` a group. Returns how many changed."""
        if not group_ids:
            return 0
        with self._write() as s:
            res = s.execute(sa.update(GroupRow).where(GroupRow.id.in_([int(g) for g in group_ids]),
                                                      GroupRow.status.in_(("open", "ready")))
                            .values(status="untrainable", status_reason=str(reason)[:2000] or None))
            return res.rowcount

    def closed_groups(self, limit: int = 50) -> list[dict]:
        """The newest `limit` groups that were set aside or expired, for admins (Training tab,
        `collab doctor`): {"id", "task", "status", "reason", "created_at", "ratings"}."""
        with self._read() as s:
            q = (select(GroupRow.id, GroupRow.task, GroupRow.status, GroupRow.status_reason, GroupRow.created_at,
                        select(func.count(RatingRow.id)).join(JointRow, RatingRow.joint_sample_id == JointRow.id)
                        .where(JointRow.group_id == GroupRow.id).scalar_subquery())
                 .where(GroupRow.status.in_(("untrainable", "expired"))).order_by(GroupRow.id.desc()).limit(limit))
            return [dict(id=i, task=t, status=st, reason=r, created_at=c, ratings=int(n or 0))
                    for i, t, st, r, c, n in s.execute(q)]

    def put_back(self, group_ids: Sequence[int]) -> int:
        """Put set-aside or expired groups back: status "open" (or "ready"), reason cleared, and their arrival
        versions reset to the newest (an admin's call to train them as if they arrived now; the
        importance ratio still weighs their old samples). Groups of fewer than MIN_GENERATIONS
        answers stay untrainable; a group still without returns expires again. Returns how many."""
        if not group_ids:
            return 0
        with self._write() as s:
            newest = {str(a): int(v) for a, v in s.execute(
                select(AdapterVersionRow.agent, func.max(AdapterVersionRow.version)).group_by(AdapterVersionRow.agent))}
            rows = list(s.scalars(select(GroupRow).where(GroupRow.id.in_([int(g) for g in group_ids]),
                                                         GroupRow.status.in_(("untrainable", "expired")),
                                                         GroupRow.num_generations >= MIN_GENERATIONS)
                                  .order_by(GroupRow.id).with_for_update()))
            for grp in rows:
                grp.status, grp.status_reason, grp.versions_at = "open", None, newest
                self._maybe_ready(s, grp)
            return len(rows)

    # -- adapter versions ------------------------------------------------------------------

    def record_adapter_version(self, agent: str, version: int, path: str, step: int | None = None,
                               metrics: dict | None = None, base_model: str | None = None) -> None:
        """Add a version row. Call only after the adapter directory was renamed into place
        (docs/ARCHITECTURE.md "Contracts"): a row always names a complete adapter. `base_model`:
        the base it is on (its collab.json's "base_model"; each agent's own in a heterogeneous team).
        A step's versions go in with the step instead (`record_train_step(versions=...)`)."""
        with self._write() as s:
            self._add_version(s, agent, version, path, step, metrics, base_model)

    @staticmethod
    def _add_version(s: Session, agent: str, version: int, path: str, step: int | None = None,
                     metrics: dict | None = None, base_model: str | None = None) -> None:
        if not agent or not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise StoreError("record_adapter_version needs an agent name and an integer version >= 0")
        if s.scalar(select(AdapterVersionRow.id).where(AdapterVersionRow.agent == agent,
                                                       AdapterVersionRow.version == version)):
            raise StoreError(f"agent {agent!r} already has version {version}: versions are never reused")
        s.add(AdapterVersionRow(agent=agent, version=version, path=str(path), step=step, created_at=utcnow(),
                                metrics=jsonable(metrics or {}), pinned=False, base_model=base_model))

    def adapter_versions(self, agent: str) -> list[AdapterVersionRecord]:
        with self._read() as s:
            q = select(AdapterVersionRow).where(AdapterVersionRow.agent == agent).order_by(AdapterVersionRow.version)
            return [_adapter(a) for a in s.scalars(q)]

    def latest_adapter_versions(self) -> dict[str, AdapterVersionRecord]:
        """agent -> its newest version."""
        with self._read() as s:
            newest = (select(AdapterVersionRow.agent, func.max(AdapterVersionRow.version).label("v"))
                      .group_by(AdapterVersionRow.agent).subquery())
            q = select(AdapterVersionRow).join(newest, sa.and_(AdapterVersionRow.agent == newest.c.agent,
                                                               AdapterVersionRow.version == newest.c.v))
            return {a.agent: _adapter(a) for a in s.scalars(q)}

    def pin_adapter(self, agent: str, version: int | None) -> None:
        """Serve `version` for `agent` regardless of newer ones (roll back); None = follow the newest."""
        with self._write() as s:
            if version is not None and not s.scalar(select(AdapterVersionRow.id).where(
                    AdapterVersionRow.agent == agent, AdapterVersionRow.version == version)):
                raise NotFound(f"agent {agent!r} has no adapter version {version}")
            s.execute(sa.update(AdapterVersionRow).where(AdapterVersionRow.agent == agent)
                      .values(pinned=AdapterVersionRow.version == version if version is not None else False))

    def current_adapter_versions(self) -> dict[str, tuple[int, str]]:
        """agent -> (version, path) to serve: the pinned version if any, else the newest."""
        latest = self.latest_adapter_versions()
        with self._read() as s:
            for a in s.scalars(select(AdapterVersionRow).where(AdapterVersionRow.pinned.is_(True))):
                latest[a.agent] = _adapter(a)
        return {agent: (a.version, a.path) for agent, a in latest.items()}

    # -- the arena -------------------------------------------------------------------------

    def add_arena_match(self, task: str, example: dict, prompts: Sequence[str], state_a: str, state_b: str,
                        versions_a: Mapping[str, int | None], versions_b: Mapping[str, int | None],
                        outputs_a: Sequence[str], outputs_b: Sequence[str], *, combined_a: str | None = None,
                        combined_b: str | None = None, sampling: Mapping | None = None,
                        session_id: str | None = None) -> int:
        """Store a pair before anyone votes on it (what was shown is the server's, never the voter's
        word). Returns its id."""
        if not task or not state_a or not state_b or state_a == state_b:
            raise StoreError("an arena match needs a task and two different team states")
        if len(outputs_a) != len(prompts) or len(outputs_b) != len(prompts):
            raise StoreError(f"an arena match needs one output per agent on each side ({len(prompts)} prompts, "
                             f"{len(outputs_a)} and {len(outputs_b)} outputs)")
        with self._write() as s:
            row = ArenaMatchRow(task=task, example_id=str(example.get("id", ""))[:200], example=jsonable(example),
                                prompts=list(prompts), state_a=state_a, state_b=state_b,
                                versions_a=jsonable(dict(versions_a)), versions_b=jsonable(dict(versions_b)),
                                outputs_a=list(outputs_a), outputs_b=list(outputs_b), combined_a=combined_a,
                                combined_b=combined_b, sampling=jsonable(dict(sampling or {})), created_at=utcnow(),
                                session_id=session_id)
            s.add(row)
            s.flush()
            return row.id

    def arena_match(self, match_id: int) -> ArenaMatchRecord:
        with self._read() as s:
            m = s.get(ArenaMatchRow, match_id)
            if m is None:
                raise NotFound(f"no arena match {match_id}")
            return _match(m)

    def add_arena_vote(self, match_id: int, winner: str, voter: str, *, session_id: str | None = None,
                       network: str | None = None, signed_in: bool = False) -> ArenaMatchRecord:
        """The one vote on a match: `winner` "a", "b" or "tie". Only the session the pair was made for
        may vote (`session_id`; None = an admin), once: a second vote raises StoreError and changes
        nothing. Returns the voted match."""
        if winner not in ("a", "b", "tie"):
            raise StoreError(f"a vote is 'a', 'b' or 'tie', got {winner!r:.20}")
        if not voter or len(voter) > MAX_RATER_CHARS:
            raise StoreError(f"a vote needs a voter id of 1..{MAX_RATER_CHARS} characters")
        with self._write() as s:
            m = s.get(ArenaMatchRow, match_id)
            if m is None:
                raise NotFound(f"no arena match {match_id}")
            if session_id is not None and m.session_id != session_id:
                raise NotEntitled(f"arena match {match_id} was shown to another session: vote on your own pairs")
            if m.winner is not None:
                raise StoreError(f"arena match {match_id} already has its vote ({m.winner}); votes are never changed")
            m.winner, m.voter, m.voted_at = winner, voter, utcnow()
            m.network, m.signed_in = network, bool(signed_in)
            s.flush()
            return _match(m)

    def arena_matches(self, task: str | None = None, voted: bool | None = True, last: int | None = None) -> list[ArenaMatchRecord]:
        """Matches oldest first (`last`: only the newest n), of `task` (None: every task); `voted`
        True: only voted ones, False: only unvoted, None: all."""
        with self._read() as s:
            q = select(ArenaMatchRow)
            if task is not None:
                q = q.where(ArenaMatchRow.task == task)
            if voted is not None:
                q = q.where(ArenaMatchRow.winner.is_not(None) if voted else ArenaMatchRow.winner.is_(None))
            q = q.order_by(ArenaMatchRow.id.desc() if last else ArenaMatchRow.id)
            if last:
                q = q.limit(last)
            rows = [_match(m) for m in s.scalars(q)]
            return rows[::-1] if last else rows

    # -- shared app state ------------------------------------------------------------------

    def set_state(self, key: str, value: dict) -> None:
        with self._write() as s:
            s.merge(AppStateRow(key=key, value=jsonable(value), updated_at=utcnow()))

    def swap_state(self, key: str, change: Callable[[dict | None], dict | None]) -> dict | None:
        """Read-modify-write of one app_state key in one write transaction (its row locked on
        PostgreSQL): `change(current value or None)` returns the new value, or None to leave it.
        Returns what the key holds afterwards. For leases and counters two processes share."""
        with self._write() as s:
            row = s.get(AppStateRow, key, with_for_update=True)
            old = None if row is None else dict(row.value)
            new = change(old)
            if new is None:
                return old
            s.merge(AppStateRow(key=key, value=jsonable(new), updated_at=utcnow()))
            return new

    def get_state(self, key: str, default: dict | None = None) -> dict | None:
        with self._read() as s:
            row = s.get(AppStateRow, key)
            return default if row is None else row.value

    # -- overview --------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counts for the UI / logs: groups per status, single-sample groups (fewer than
        MIN_GENERATIONS answers: stored, never trainable), joint samples, samples, ratings, raters,
        adapter versions, train steps, schema version; and for the rater cap:
        "rating_replacements" (re-ratings that replaced a rating in place), "late_ratings"
        (ratings stored after their group was trained / expired / set aside: exported, never
        trained on), "rater_share" (the trainer's max share of a step per rater, None before the
        service looked), "groups_held_by_rater_cap" and "raters_held" (ready groups waiting
        because their rater reached the cap, and how many raters those are; the service's last
        look, RATER_CAP_KEY)."""
        with self._read() as s:
            by_status = dict(s.execute(select(GroupRow.status, func.count()).group_by(GroupRow.status)).all())
            row = s.get(AppStateRow, RATER_CAP_KEY)
            cap = dict(row.value) if row is not None and isinstance(row.value, dict) else {}
            count = lambda model: s.scalar(select(func.count()).select_from(model))   # noqa: E731
            return {
                "groups": {st: by_status.get(st, 0) for st in STATUSES},
                "single_sample_groups": s.scalar(select(func.count()).select_from(GroupRow).where(
                    GroupRow.num_generations < MIN_GENERATIONS)),
                "joint_samples": count(JointRow), "samples": count(SampleRow), "ratings": count(RatingRow),
                "raters": s.scalar(select(func.count(sa.distinct(RatingRow.rater)))),
                "adapter_versions": count(AdapterVersionRow), "train_steps": count(TrainStepRow),
                "schema_version": s.scalar(select(schema_version.c.version)),
                "rating_replacements": int(s.scalar(select(func.coalesce(func.sum(RatingRow.revision), 0)))),
                "late_ratings": s.scalar(select(func.count()).select_from(RatingRow).where(RatingRow.late.is_(True))),
                "rater_share": cap.get("share"),
                "groups_held_by_rater_cap": int(cap.get("held") or 0),
                "raters_held": int(cap.get("raters") or 0),
                "arena_votes": s.scalar(select(func.count()).select_from(ArenaMatchRow).where(
                    ArenaMatchRow.winner.is_not(None))),
            }

    counts = stats


def _sqlite_on_connect(dbapi_conn, _record) -> None:
    dbapi_conn.isolation_level = None   # SQLAlchemy emits BEGIN itself (_sqlite_on_begin)
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys = ON")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = FULL")
    cur.close()


def _sqlite_on_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("collab_write") else "BEGIN")
