"""The store's tables: one numbered migration step per change of schema (db.migrate applies them).

A database that has never been versioned (version 0) is either new or was made by the remediator before
versioning; the first step brings either to version 1 without losing a row.

The SQL is SQLite's; `statements` maps its types for PostgreSQL. To change the schema, append a step to
MIGRATIONS (never edit one that has shipped) and a test that opens a database of the previous version.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Tx(Protocol):
    """What a migration step needs of the connection in its transaction (`fleetheal.remediator.store.db.Tx`)."""

    def execute(self, sql: str, args: Sequence[Any] = ...) -> None: ...

    def all(self, sql: str, args: Sequence[Any] = ...) -> list[dict[str, Any]]: ...


#: The tables as the remediator made them before versioning (version 0 is this, or this without
#: incidents.parent_id when the database is older than node lifecycles). Frozen: later changes are steps.
SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS incidents (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint   TEXT NOT NULL,
    starts_at     TEXT NOT NULL,
    starts_at_ts  REAL NOT NULL,
    cluster       TEXT NOT NULL,
    node          TEXT NOT NULL,
    gpu           TEXT NOT NULL,
    fault_id      TEXT NOT NULL,
    class         TEXT NOT NULL,
    action        TEXT NOT NULL,
    severity      TEXT NOT NULL,
    job_id        TEXT NOT NULL DEFAULT '',
    alertname     TEXT NOT NULL DEFAULT '',
    state         TEXT NOT NULL,
    decision      TEXT,
    hold_reason   TEXT,
    outcome       TEXT,
    run_job_id    TEXT,
    dry_run       INTEGER NOT NULL DEFAULT 0,
    budget_remaining INTEGER NOT NULL DEFAULT 0,
    received_at   REAL NOT NULL,
    updated_at    REAL NOT NULL,
    resolved_at   REAL,
    ends_at_ts    REAL,
    parent_id     INTEGER,
    UNIQUE (fingerprint, starts_at)
);
CREATE INDEX IF NOT EXISTS incidents_state ON incidents(state);
CREATE INDEX IF NOT EXISTS incidents_node ON incidents(node);
CREATE TABLE IF NOT EXISTS steps (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    incident_id  INTEGER NOT NULL REFERENCES incidents(id),
    name         TEXT NOT NULL,
    attempt      INTEGER NOT NULL DEFAULT 1,
    started_at   REAL NOT NULL,
    ended_at     REAL,
    result       TEXT,
    detail       TEXT NOT NULL DEFAULT '',
    pid          INTEGER,
    pid_start    INTEGER,
    run_dir      TEXT
);
CREATE INDEX IF NOT EXISTS steps_incident ON steps(incident_id);
CREATE TABLE IF NOT EXISTS events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    incident_id  INTEGER NOT NULL REFERENCES incidents(id),
    step_id      INTEGER,
    ts           REAL NOT NULL,
    kind         TEXT NOT NULL,
    detail       TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_incident ON events(incident_id);
CREATE TABLE IF NOT EXISTS audit (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    ts           REAL NOT NULL,
    incident_id  INTEGER,
    node         TEXT,
    action       TEXT,
    decision     TEXT NOT NULL,
    reason       TEXT NOT NULL,
    facts        TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS isolations (
    node         TEXT PRIMARY KEY,
    domain       TEXT NOT NULL,
    incident_id  INTEGER NOT NULL,
    since        REAL NOT NULL,
    dry_run      INTEGER NOT NULL DEFAULT 0,
    quarantined  INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS isolation_history (
    node         TEXT NOT NULL,
    ts           REAL NOT NULL,
    incident_id  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS isolation_history_node ON isolation_history(node, ts);
CREATE TABLE IF NOT EXISTS storm (
    ts           REAL NOT NULL,
    node         TEXT NOT NULL,
    incident_id  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS storm_ts ON storm(ts);
CREATE TABLE IF NOT EXISTS job_requeues (
    job_id       TEXT NOT NULL,
    incident_id  INTEGER NOT NULL,
    ts           REAL NOT NULL,
    PRIMARY KEY (job_id, incident_id)
);
CREATE TABLE IF NOT EXISTS nodes (
    node         TEXT PRIMARY KEY,
    state        TEXT NOT NULL,
    since        REAL NOT NULL,
    incident_id  INTEGER,
    cause        TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS node_history (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    node         TEXT NOT NULL,
    ts           REAL NOT NULL,
    from_state   TEXT NOT NULL,
    to_state     TEXT NOT NULL,
    incident_id  INTEGER,
    cause        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS node_history_node ON node_history(node, id);
CREATE TABLE IF NOT EXISTS kv (
    key          TEXT PRIMARY KEY,
    value        TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS leadership (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    epoch        INTEGER NOT NULL,
    holder       TEXT NOT NULL,
    since        REAL NOT NULL
);
"""


def statements(schema: str, backend: str) -> list[str]:
    """The statements of `schema` (SQLite's SQL) for `backend`; PostgreSQL gets 64-bit integers, identity
    keys and double precision."""
    s = schema
    if backend == "postgresql":
        s = s.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
        s = re.sub(r"\bINTEGER\b", "BIGINT", s)
        s = re.sub(r"\bREAL\b", "DOUBLE PRECISION", s)
    return [stmt.strip() for stmt in s.split(";") if stmt.strip()]


def _v1_baseline(db: Tx, backend: str) -> None:
    """Version 1: the tables of SCHEMA_V1; an unversioned database made before node lifecycles gets
    incidents.parent_id (its other tables are already there, CREATE ... IF NOT EXISTS keeps them)."""
    for stmt in statements(SCHEMA_V1, backend):
        db.execute(stmt)
    if backend == "postgresql":
        db.execute("ALTER TABLE incidents ADD COLUMN IF NOT EXISTS parent_id BIGINT")
    elif "parent_id" not in {r["name"] for r in db.all("PRAGMA table_info(incidents)")}:
        db.execute("ALTER TABLE incidents ADD COLUMN parent_id INTEGER")


def _v2_early_resolutions(db: Tx, backend: str) -> None:
    """Version 2: resolutions of alerts not known yet, remembered for the firing alert they came before
    (incidents.py; issue 46)."""
    for stmt in statements(
        """
CREATE TABLE IF NOT EXISTS early_resolutions (
    fingerprint  TEXT NOT NULL,
    starts_at    TEXT NOT NULL,
    ends_at_ts   REAL NOT NULL,
    received_at  REAL NOT NULL,
    PRIMARY KEY (fingerprint, starts_at)
);
CREATE INDEX IF NOT EXISTS early_resolutions_received ON early_resolutions(received_at);
""",
        backend,
    ):
        db.execute(stmt)


#: Step n brings a database from version n - 1 to n. Append only.
MIGRATIONS: tuple[Callable[[Tx, str], None], ...] = (_v1_baseline, _v2_early_resolutions)
VERSION = len(MIGRATIONS)
