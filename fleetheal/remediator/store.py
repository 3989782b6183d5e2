"""Durable state of the remediator: incidents, their steps and events, and the gate's ledger.

Two backends behind one interface and one schema: SQLite (WAL; the embedded default for the lab, the
tests and small sites) and PostgreSQL (production: shared by the replicas of a highly available
remediator, `store.url_file`). The SQL is written once, in the dialect both understand (`?` placeholders
are translated for psycopg; `RETURNING`, `ON CONFLICT`); the schema's SQLite types are mapped once.

One connection guarded by a lock serves the event loop and the playbook threads; every change is one
transaction, so a SIGKILL leaves either the old or the new state. Write transactions are serialized, as
SQLite's `BEGIN IMMEDIATE` does, by a transaction-scoped advisory lock in PostgreSQL. The same alert twice
(fingerprint and start time) is one incident (a UNIQUE constraint, not a check in Python).

Fencing: with leader election, the replica that takes the lease bumps `leadership.epoch` (`take_leadership`)
and every later write of the state machine checks, inside its transaction, that the epoch is still its
own. A replica that lost the lease while cut off (from the API server or the database) can therefore never
write a step again, whatever its clocks say: its transaction fails with `NotLeader`. Ingesting alerts is
the one write any replica makes (followers persist webhooks and answer 202).

Every database error leaves as `StoreError` (retry later); a broken PostgreSQL connection is opened again
at the next call. A commit whose answer was lost is ambiguous: the engine then finds an attempt with no end
and records it as interrupted, so a playbook never starts twice for one step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetheal.remediator.alerts import Alert

#: Incident states, in order (the state machine of engine.py).
STATES = ("received", "classified", "gated", "acting", "done", "failed")
TERMINAL = ("done", "failed")

SCHEMA = """
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

#: PostgreSQL's advisory lock that serializes write transactions (and schema creation).
_PG_WRITE_LOCK = 0x666C6865  # "flhe"
#: libpq settings that turn a dead peer into an error within seconds instead of a hang: a cut network
#: otherwise leaves a query waiting for TCP's own timeouts (minutes), with the remediator's lock held.
PG_CONNECT_ARGS: dict[str, Any] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 9000,
    "application_name": "fleetheal-remediator",
}


def pg_schema(schema: str = SCHEMA) -> list[str]:
    """SCHEMA's statements with PostgreSQL's types: 64-bit integers, identity keys, double precision."""
    s = schema.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    s = re.sub(r"\bINTEGER\b", "BIGINT", s)
    s = re.sub(r"\bREAL\b", "DOUBLE PRECISION", s)
    return [stmt.strip() for stmt in s.split(";") if stmt.strip()]


class StoreError(Exception):
    """The database did not answer or refused a change; nothing was written. Retry later."""


class NotLeader(StoreError):
    """A write of the state machine from a replica that is not (or no longer) the leader."""


def incident_ref(incident_id: int) -> str:
    """The incident's public name, e.g. inc-000042 (also fleetheal_incident_id in playbooks)."""
    return f"inc-{incident_id:06d}"


def parse_ref(ref: str) -> int:
    """The numeric id of `inc-000042` or `42`; ValueError otherwise."""
    text = ref.removeprefix("inc-")
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"{ref!r} is not an incident id (inc-NNNNNN)")
    return int(text)


@dataclass(frozen=True, slots=True)
class Incident:
    id: int
    fingerprint: str
    starts_at: str
    starts_at_ts: float
    cluster: str
    node: str
    gpu: str
    fault_id: str
    fault_class: str
    action: str
    severity: str
    job_id: str
    alertname: str
    state: str
    decision: str | None
    hold_reason: str | None
    outcome: str | None
    run_job_id: str | None
    dry_run: bool
    budget_remaining: int
    received_at: float
    updated_at: float
    resolved_at: float | None
    ends_at_ts: float | None
    #: A follow-up of the node's lifecycle (REVALIDATE after a repair...): the incident it follows.
    parent_id: int | None = None

    @property
    def ref(self) -> str:
        return incident_ref(self.id)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.ref,
            "state": self.state,
            "node": self.node,
            "gpu": self.gpu,
            "fault_id": self.fault_id,
            "class": self.fault_class,
            "action": self.action,
            "severity": self.severity,
            "job_id": self.job_id,
            "decision": self.decision,
            "hold_reason": self.hold_reason,
            "outcome": self.outcome,
            "dry_run": self.dry_run,
            "starts_at": self.starts_at,
            "received_at": self.received_at,
            "resolved_at": self.resolved_at,
            "fingerprint": self.fingerprint,
            "follows": None if self.parent_id is None else incident_ref(self.parent_id),
        }


@dataclass(frozen=True, slots=True)
class Step:
    id: int
    incident_id: int
    name: str
    attempt: int
    started_at: float
    ended_at: float | None
    result: str | None
    detail: str
    pid: int | None
    pid_start: int | None
    run_dir: str | None


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    incident_id: int
    step_id: int | None
    ts: float
    kind: str
    detail: str


@dataclass(slots=True)
class IngestResult:
    created: list[int] = field(default_factory=list)
    duplicates: int = 0
    resolved: list[int] = field(default_factory=list)
    resolved_unknown: int = 0


@dataclass(frozen=True, slots=True)
class Isolation:
    node: str
    domain: str
    incident_id: int
    since: float
    dry_run: bool
    quarantined: bool


@dataclass(frozen=True, slots=True)
class NodeState:
    """Where a node is in its lifecycle (a node never seen is `active`)."""

    node: str
    state: str
    since: float
    incident_id: int | None
    cause: str


@dataclass(frozen=True, slots=True)
class FollowUp:
    """An incident the lifecycle starts for a node: `action` after `parent`'s (REVALIDATE after a repair)."""

    parent: Incident
    action: str


ACTIVE = "active"

_INCIDENT_COLS = (
    "id, fingerprint, starts_at, starts_at_ts, cluster, node, gpu, fault_id, class, action, severity, job_id, "
    "alertname, state, decision, hold_reason, outcome, run_job_id, dry_run, budget_remaining, received_at, updated_at, "
    "resolved_at, ends_at_ts, parent_id"
)
_STEP_COLS = "id, incident_id, name, attempt, started_at, ended_at, result, detail, pid, pid_start, run_dir"


def _incident(row: Sequence[Any]) -> Incident:
    values = list(row)
    values[18] = bool(values[18])
    return Incident(*values)


class _Postgres:
    """A psycopg connection that speaks sqlite3's `execute(sql, args)` with `?` placeholders; connects on
    first use and again after the connection broke (a restarted or unreachable server)."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error,)
        self._psycopg = psycopg
        self._conn: Any = None
        self._sql: dict[str, str] = {}

    def connect(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            with contextlib.suppress(Exception):
                if self._conn is not None:
                    self._conn.close()
            self._conn = None
            self._conn = self._psycopg.connect(self.url, autocommit=True, **PG_CONNECT_ARGS)
        return self._conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        text = self._sql.get(sql)
        if text is None:
            text = self._sql[sql] = sql.replace("%", "%%").replace("?", "%s")
        # sqlite3 binds a bool as 1 or 0; psycopg as a boolean, which no INTEGER column takes.
        return self.connect().execute(text, tuple(int(a) if isinstance(a, bool) else a for a in args))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class Store:
    """The remediator's database. Safe to share between the event loop and runner threads.

    `Store(path)` is SQLite; `Store.postgres(url)` PostgreSQL (`open_store` picks from the config).
    """

    def __init__(
        self,
        path: str,
        synchronous: str = "FULL",
        clock: Callable[[], float] = time.time,
        *,
        url: str | None = None,
    ) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.RLock()
        #: None: no leader election (one instance, the flock); 0: a follower (state writes refused);
        #: n > 0: the leader of epoch n (take_leadership).
        self.epoch: int | None = None
        self._ingest_sync = synchronous.upper()
        self._pg: _Postgres | None = None
        self._errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
        if url is not None:
            self._pg = _Postgres(url)
            self._errors = (sqlite3.Error, *self._pg.errors)
            self._db: Any = self._pg
            with self.tx(fenced=False) as db:
                for stmt in pg_schema():
                    db.execute(stmt)
            return
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            self._open_sqlite(path)
        except sqlite3.Error as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def _open_sqlite(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        # Switching a new database to WAL takes a lock that SQLite's busy handler does not wait for: a
        # second replica opening the same file at that moment gets "database is locked" at once.
        deadline = time.monotonic() + 30
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # Alerts are committed at the configured durability before their 202 (ingest_many); the state
        # machine's own writes use NORMAL: in WAL mode they survive a process crash, and what a power loss
        # could take (the last state changes) is redone on resume from the durable prefix.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self.tx(fenced=False) as db:  # one writer creates the schema; the others then find it
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            columns = {r[1] for r in db.execute("PRAGMA table_info(incidents)")}
            if "parent_id" not in columns:  # a database from before node lifecycles
                db.execute("ALTER TABLE incidents ADD COLUMN parent_id INTEGER")

    @classmethod
    def postgres(cls, url: str, clock: Callable[[], float] = time.time) -> Store:
        """The store in PostgreSQL at `url` (a libpq URI); the schema is created when missing."""
        return cls("", clock=clock, url=url)

    @property
    def backend(self) -> str:
        return "postgresql" if self._pg is not None else "sqlite"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def tx(self, *, fenced: bool = True) -> Iterator[Any]:
        """One write transaction, serialized with every other writer's, rolled back on error.

        `fenced` (every write but ingesting alerts): refused with NotLeader, changing nothing, unless this
        store is the leader's of the current epoch (or there is no leader election).
        """
        with self._lock:
            db = self._db
            try:
                if self._pg is not None:
                    db.execute("BEGIN")
                    db.execute("SELECT pg_advisory_xact_lock(?)", (_PG_WRITE_LOCK,))
                else:
                    db.execute("BEGIN IMMEDIATE")
            except self._errors as exc:
                with contextlib.suppress(*self._errors):  # a live connection must not stay in the transaction
                    db.execute("ROLLBACK")
                raise StoreError(f"{type(exc).__name__}: {exc}") from exc
            try:
                if fenced and self.epoch is not None:
                    row = db.execute("SELECT epoch FROM leadership WHERE id = 1").fetchone()
                    if not self.epoch or row is None or int(row[0]) != self.epoch:
                        raise NotLeader(
                            f"not the leader: this replica's epoch is {self.epoch}, the database's "
                            f"{None if row is None else row[0]}"
                        )
                yield db
                db.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(*self._errors):
                    db.execute("ROLLBACK")
                if isinstance(exc, self._errors):
                    raise StoreError(f"{type(exc).__name__}: {exc}") from exc
                raise

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return list(self._db.execute(sql, args).fetchall())
            except self._errors as exc:
                raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def ping(self) -> None:
        """StoreError unless the database answers now."""
        self._query("SELECT 1")

    # --- leadership (leader.py) ------------------------------------------------------------------------

    def take_leadership(self, holder: str) -> int:
        """Become the writer: bump the fencing epoch (every older leader's writes fail from now on)."""
        with self.tx(fenced=False) as db:
            row = db.execute("SELECT epoch FROM leadership WHERE id = 1").fetchone()
            epoch = (int(row[0]) if row else 0) + 1
            db.execute(
                "INSERT INTO leadership (id, epoch, holder, since) VALUES (1, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch, holder = excluded.holder, "
                "since = excluded.since",
                (epoch, holder, self.clock()),
            )
        self.epoch = epoch
        return epoch

    def prober(self) -> Callable[[], None]:
        """A check that the database answers, on a connection of its own (never waits for this store's lock,
        which a stuck query may hold). Raises StoreError when it does not."""
        if self._pg is None:
            return self.ping
        probe = _Postgres(self._pg.url)

        def check() -> None:
            try:
                probe.execute("SELECT 1").fetchall()
            except probe.errors as exc:
                raise StoreError(f"{type(exc).__name__}: {exc}") from exc

        return check

    def watermarks(self) -> tuple[int, int]:
        """The newest incident and event ids (where `since` starts)."""
        rows = self._query(
            "SELECT (SELECT coalesce(max(id), 0) FROM incidents), (SELECT coalesce(max(id), 0) FROM events)"
        )
        return int(rows[0][0]), int(rows[0][1])

    def since(self, incident_id: int, event_id: int) -> tuple[list[int], list[int], int, int]:
        """What other replicas persisted after the watermarks: (new incidents, incidents whose alert resolved,
        new incident watermark, new event watermark). Write transactions are serialized, so ids grow in
        commit order and a watermark never skips one."""
        new = [int(r[0]) for r in self._query("SELECT id FROM incidents WHERE id > ? ORDER BY id", (incident_id,))]
        events = self._query(
            "SELECT id, incident_id FROM events WHERE id > ? AND kind = 'resolved' ORDER BY id", (event_id,)
        )
        return (
            new,
            [int(r[1]) for r in events],
            new[-1] if new else incident_id,
            int(events[-1][0]) if events else event_id,
        )

    def follow(self) -> None:
        """Stop writing the state machine (a follower, or a leader that lost its lease)."""
        self.epoch = 0

    def leadership(self) -> tuple[int, str, float] | None:
        """(epoch, holder, since) of the last replica that took the lead; None before any."""
        rows = self._query("SELECT epoch, holder, since FROM leadership WHERE id = 1")
        return (int(rows[0][0]), str(rows[0][1]), float(rows[0][2])) if rows else None

    # --- incidents -------------------------------------------------------------------------------------

    def ingest(self, alerts: Sequence[Alert]) -> IngestResult:
        """Persist validated alerts in one transaction: new firing alerts become incidents."""
        return self.ingest_many([alerts])[0]

    def ingest_many(self, batches: Sequence[Sequence[Alert]]) -> list[IngestResult]:
        """Persist several requests' alerts in one durable transaction (group commit); one result each."""
        now = self.clock()
        results = []
        durable = self._pg is None and self._ingest_sync != "NORMAL"  # PostgreSQL: synchronous_commit
        with self._lock:
            try:
                if durable:
                    self._db.execute(f"PRAGMA synchronous={self._ingest_sync}")
                try:
                    with self.tx(fenced=False) as db:
                        for alerts in batches:
                            results.append(self._ingest(db, alerts, now))
                finally:
                    if durable:
                        self._db.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        return results

    def _ingest(self, db: Any, alerts: Sequence[Alert], now: float) -> IngestResult:
        result = IngestResult()
        for a in alerts:
            if a.status == "firing":
                cur = db.execute(
                    "INSERT INTO incidents (fingerprint, starts_at, starts_at_ts, cluster, node, gpu, "
                    "fault_id, class, action, severity, job_id, alertname, state, received_at, updated_at) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,'received',?,?) ON CONFLICT DO NOTHING RETURNING id",
                    (
                        a.fingerprint,
                        a.starts_at,
                        a.starts_at_ts,
                        a.cluster,
                        a.node,
                        a.gpu,
                        a.fault_id,
                        a.fault_class,
                        a.action,
                        a.severity,
                        a.job_id,
                        a.alertname,
                        now,
                        now,
                    ),
                )
                row = cur.fetchone()
                if row is not None:
                    iid = int(row[0])
                    result.created.append(iid)
                    db.execute(
                        "INSERT INTO steps (incident_id, name, started_at, ended_at, result, detail) "
                        "VALUES (?, 'receive', ?, ?, 'ok', ?)",
                        (iid, a.starts_at_ts, now, f"alert {a.alertname or a.fault_id} firing since {a.starts_at}"),
                    )
                else:
                    result.duplicates += 1
                continue
            row = db.execute(
                "SELECT id, resolved_at FROM incidents WHERE fingerprint = ? AND starts_at = ?",
                (a.fingerprint, a.starts_at),
            ).fetchone()
            if row is None:
                result.resolved_unknown += 1
            elif row[1] is None:
                db.execute(
                    "UPDATE incidents SET resolved_at = ?, ends_at_ts = ?, updated_at = ? WHERE id = ?",
                    (now, a.ends_at_ts, now, row[0]),
                )
                db.execute(
                    "INSERT INTO events (incident_id, ts, kind, detail) VALUES (?, ?, 'resolved', ?)",
                    (row[0], now, "alert resolved in Alertmanager"),
                )
                result.resolved.append(row[0])
            else:
                result.duplicates += 1
        return result

    def get(self, incident_id: int) -> Incident | None:
        rows = self._query(f"SELECT {_INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,))  # noqa: S608 - constant columns, bound values
        return _incident(rows[0]) if rows else None

    def incidents(self, state: str | None = None, limit: int = 100, node: str | None = None) -> list[Incident]:
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(state)
        if node:
            where.append("node = ?")
            args.append(node)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(f"SELECT {_INCIDENT_COLS} FROM incidents {clause} ORDER BY id DESC LIMIT ?", (*args, limit))  # noqa: S608 - constant columns, bound values
        return [_incident(r) for r in rows]

    def unfinished(self) -> list[Incident]:
        rows = self._query(f"SELECT {_INCIDENT_COLS} FROM incidents WHERE state NOT IN ('done', 'failed') ORDER BY id")  # noqa: S608 - constant columns, bound values
        return [_incident(r) for r in rows]

    def held(self) -> list[Incident]:
        """Incidents waiting at the gate, oldest first (the queue)."""
        rows = self._query(
            f"SELECT {_INCIDENT_COLS} FROM incidents WHERE state = 'classified' AND hold_reason IS NOT NULL ORDER BY id"  # noqa: S608 - constant columns, bound values
        )
        return [_incident(r) for r in rows]

    def set_state(self, incident_id: int, state: str, **fields: Any) -> None:
        """Move an incident to `state`, updating the named columns in the same transaction."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        allowed = {"decision", "hold_reason", "outcome", "run_job_id", "dry_run"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot set {sorted(bad)}")
        cols = ["state = ?", "updated_at = ?"] + [f"{k} = ?" for k in fields]
        with self.tx() as db:
            db.execute(
                f"UPDATE incidents SET {', '.join(cols)} WHERE id = ?",  # noqa: S608 - constant columns, bound values
                (state, self.clock(), *fields.values(), incident_id),
            )

    def set_hold(self, incident_id: int, reason: str | None) -> None:
        with self.tx() as db:
            db.execute(
                "UPDATE incidents SET hold_reason = ?, updated_at = ? WHERE id = ?", (reason, self.clock(), incident_id)
            )

    def counts(self) -> list[tuple[str, str, int]]:
        """(state, class, number of incidents)."""
        return [
            (r[0], r[1], int(r[2]))
            for r in self._query("SELECT state, class, count(*) FROM incidents GROUP BY state, class")
        ]

    def held_count(self) -> int:
        rows = self._query("SELECT count(*) FROM incidents WHERE state = 'classified' AND hold_reason IS NOT NULL")
        return int(rows[0][0])

    # --- steps and events ------------------------------------------------------------------------------

    def start_step(self, incident_id: int, name: str, attempt: int = 1, detail: str = "") -> int:
        with self.tx() as db:
            cur = db.execute(
                "INSERT INTO steps (incident_id, name, attempt, started_at, detail) "
                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                (incident_id, name, attempt, self.clock(), detail),
            )
            return int(cur.fetchone()[0])

    def end_step(
        self,
        step_id: int,
        result: str,
        detail: str | None = None,
        incident_state: tuple[int, str, dict[str, Any]] | None = None,
    ) -> None:
        """End a step; with `incident_state` (id, state, fields) the incident moves in the same transaction."""
        now = self.clock()
        with self.tx() as db:
            if detail is None:
                db.execute("UPDATE steps SET ended_at = ?, result = ? WHERE id = ?", (now, result, step_id))
            else:
                db.execute(
                    "UPDATE steps SET ended_at = ?, result = ?, detail = ? WHERE id = ?", (now, result, detail, step_id)
                )
            if incident_state is not None:
                iid, state, fields = incident_state
                cols = ["state = ?", "updated_at = ?"] + [f"{k} = ?" for k in fields]
                db.execute(f"UPDATE incidents SET {', '.join(cols)} WHERE id = ?", (state, now, *fields.values(), iid))  # noqa: S608 - constant columns, bound values

    def set_step_process(self, step_id: int, pid: int, pid_start: int | None, run_dir: str | None = None) -> None:
        with self.tx() as db:
            db.execute(
                "UPDATE steps SET pid = ?, pid_start = ?, run_dir = coalesce(?, run_dir) WHERE id = ?",
                (pid, pid_start, run_dir, step_id),
            )

    def set_step_run_dir(self, step_id: int, run_dir: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE steps SET run_dir = ? WHERE id = ?", (run_dir, step_id))

    def step(self, step_id: int) -> Step | None:
        rows = self._query(f"SELECT {_STEP_COLS} FROM steps WHERE id = ?", (step_id,))  # noqa: S608 - constant columns, bound values
        return Step(*rows[0]) if rows else None

    def steps(self, incident_id: int) -> list[Step]:
        rows = self._query(f"SELECT {_STEP_COLS} FROM steps WHERE incident_id = ? ORDER BY id", (incident_id,))  # noqa: S608 - constant columns, bound values
        return [Step(*r) for r in rows]

    def add_event(self, incident_id: int, kind: str, detail: str = "", step_id: int | None = None) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO events (incident_id, step_id, ts, kind, detail) VALUES (?, ?, ?, ?, ?)",
                (incident_id, step_id, self.clock(), kind, detail),
            )

    def events(self, incident_id: int) -> list[Event]:
        rows = self._query(
            "SELECT id, incident_id, step_id, ts, kind, detail FROM events WHERE incident_id = ? ORDER BY id",
            (incident_id,),
        )
        return [Event(*r) for r in rows]

    # --- the gate's ledger -----------------------------------------------------------------------------

    def isolations(self) -> dict[str, Isolation]:
        rows = self._query("SELECT node, domain, incident_id, since, dry_run, quarantined FROM isolations")
        return {r[0]: Isolation(r[0], r[1], r[2], r[3], bool(r[4]), bool(r[5])) for r in rows}

    # The gate asks these for every decision: in a storm of N incidents, loading every isolation each time
    # made the decisions quadratic (600 incidents: about a second of the remediator's CPU).

    def isolation(self, node: str) -> Isolation | None:
        rows = self._query(
            "SELECT node, domain, incident_id, since, dry_run, quarantined FROM isolations WHERE node = ?", (node,)
        )
        if not rows:
            return None
        r = rows[0]
        return Isolation(r[0], r[1], r[2], r[3], bool(r[4]), bool(r[5]))

    def isolation_counts(self) -> dict[str, int]:
        """Isolated nodes per failure domain."""
        return {d: int(n) for d, n in self._query("SELECT domain, count(*) FROM isolations GROUP BY domain")}

    def quarantined_count(self) -> int:
        return int(self._query("SELECT count(*) FROM isolations WHERE quarantined <> 0")[0][0])

    def isolations_since(self, node: str, since: float) -> int:
        rows = self._query("SELECT count(*) FROM isolation_history WHERE node = ? AND ts >= ?", (node, since))
        return int(rows[0][0])

    def storm_nodes(self, since: float) -> int:
        rows = self._query("SELECT count(DISTINCT node) FROM storm WHERE ts >= ?", (since,))
        return int(rows[0][0])

    def last_storm_arrival(self) -> float | None:
        rows = self._query("SELECT max(ts) FROM storm")
        return None if rows[0][0] is None else float(rows[0][0])

    def record_arrival(self, node: str, incident_id: int, prune_before: float) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO storm (ts, node, incident_id) VALUES (?, ?, ?)", (self.clock(), node, incident_id))
            db.execute("DELETE FROM storm WHERE ts < ?", (prune_before,))

    def job_requeues(self, job_id: str) -> int:
        rows = self._query("SELECT count(*) FROM job_requeues WHERE job_id = ?", (job_id,))
        return int(rows[0][0])

    def kv_get(self, key: str) -> str | None:
        rows = self._query("SELECT value FROM kv WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def kv_set(self, key: str, value: str | None) -> None:
        with self.tx() as db:
            if value is None:
                db.execute("DELETE FROM kv WHERE key = ?", (key,))
            else:
                db.execute(
                    "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )

    def audit(
        self,
        decision: str,
        reason: str,
        incident_id: int | None = None,
        *,
        node: str | None = None,
        action: str | None = None,
        facts: dict[str, Any] | None = None,
        db: Any = None,
    ) -> None:
        args = (self.clock(), incident_id, node, action, decision, reason, json.dumps(facts or {}, sort_keys=True))
        sql = "INSERT INTO audit (ts, incident_id, node, action, decision, reason, facts) VALUES (?,?,?,?,?,?,?)"
        if db is not None:
            db.execute(sql, args)
            return
        with self.tx() as conn:
            conn.execute(sql, args)

    def audit_log(self, incident_id: int | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        clause, args = ("WHERE incident_id = ?", (incident_id,)) if incident_id is not None else ("", ())
        rows = self._query(
            f"SELECT ts, incident_id, node, action, decision, reason, facts FROM audit {clause} ORDER BY id LIMIT ?",  # noqa: S608 - constant columns, bound values
            (*args, limit),
        )
        return [
            {
                "ts": r[0],
                "incident": None if r[1] is None else incident_ref(r[1]),
                "node": r[2],
                "action": r[3],
                "decision": r[4],
                "reason": r[5],
                "facts": json.loads(r[6]),
            }
            for r in rows
        ]

    def record_decision(
        self,
        incident: Incident,
        state: str,
        decision: str,
        reason: str,
        facts: dict[str, Any],
        *,
        isolate_domain: str | None = None,
        count_isolation: bool = False,
        take_over_isolation: bool = False,
        quarantine: bool = False,
        requeue_job: str | None = None,
        run_job_id: str = "",
        dry_run: bool = False,
        budget_remaining: int = 0,
        outcome: str | None = None,
        step_id: int | None = None,
    ) -> None:
        """A final gate decision, its audit record and the ledger changes, in one transaction."""
        now = self.clock()
        with self.tx() as db:
            if isolate_domain is not None:
                db.execute(
                    "INSERT INTO isolations (node, domain, incident_id, since, dry_run) VALUES (?,?,?,?,?) "
                    "ON CONFLICT DO NOTHING",
                    (incident.node, isolate_domain, incident.id, now, int(dry_run)),
                )
            if take_over_isolation:  # a stronger action now owns the node's isolation
                db.execute("UPDATE isolations SET incident_id = ? WHERE node = ?", (incident.id, incident.node))
            if count_isolation:
                db.execute(
                    "INSERT INTO isolation_history (node, ts, incident_id) VALUES (?, ?, ?)",
                    (incident.node, now, incident.id),
                )
            if quarantine:
                db.execute("UPDATE isolations SET quarantined = 1 WHERE node = ?", (incident.node,))
            if requeue_job:
                db.execute(
                    "INSERT INTO job_requeues (job_id, incident_id, ts) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                    (requeue_job, incident.id, now),
                )
            db.execute(
                "UPDATE incidents SET state = ?, decision = ?, hold_reason = NULL, run_job_id = ?, dry_run = ?, "
                "budget_remaining = ?, outcome = coalesce(?, outcome), updated_at = ? WHERE id = ?",
                (state, decision, run_job_id, int(dry_run), budget_remaining, outcome, now, incident.id),
            )
            if step_id is not None:
                db.execute(
                    "UPDATE steps SET ended_at = ?, result = ?, detail = ? WHERE id = ?",
                    (now, decision, reason, step_id),
                )
            self.audit(decision, reason, incident.id, node=incident.node, action=incident.action, facts=facts, db=db)

    def node_busy(self, node: str, actions: Sequence[str]) -> bool:
        """True while an incident on `node` with one of `actions` is unfinished or its alert still fires."""
        if not actions:
            return False
        marks = ",".join("?" * len(actions))
        rows = self._query(
            f"SELECT count(*) FROM incidents WHERE node = ? AND action IN ({marks}) "  # noqa: S608 - constant columns, bound values
            "AND (resolved_at IS NULL OR state NOT IN ('done', 'failed'))",
            (node, *actions),
        )
        return int(rows[0][0]) > 0

    def release(self, node: str, reason: str, only_if_not_quarantined: bool = False) -> bool:
        """Drop a node's isolation (it no longer counts against the budget); audited. False if none."""
        with self.tx() as db:
            row = db.execute("SELECT incident_id, quarantined FROM isolations WHERE node = ?", (node,)).fetchone()
            if row is None or (only_if_not_quarantined and row[1]):
                return False
            db.execute("DELETE FROM isolations WHERE node = ?", (node,))
            self.audit("release", reason, row[0], node=node, facts={"quarantined": bool(row[1])}, db=db)
            return True

    # --- node lifecycles (lifecycle.py) ----------------------------------------------------------------

    def node_state(self, node: str) -> NodeState:
        rows = self._query("SELECT node, state, since, incident_id, cause FROM nodes WHERE node = ?", (node,))
        return NodeState(*rows[0]) if rows else NodeState(node, ACTIVE, 0.0, None, "")

    def node_states(self, state: str | None = None) -> list[NodeState]:
        """Nodes that ever left `active` (the others are active), optionally only those in `state`."""
        clause, args = ("WHERE state = ?", (state,)) if state else ("", ())
        rows = self._query(f"SELECT node, state, since, incident_id, cause FROM nodes {clause} ORDER BY node", args)  # noqa: S608 - constant columns, bound values
        return [NodeState(*r) for r in rows]

    def node_history(self, node: str) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT ts, from_state, to_state, incident_id, cause FROM node_history WHERE node = ? ORDER BY id", (node,)
        )
        return [
            {"ts": r[0], "from": r[1], "to": r[2], "incident": None if r[3] is None else incident_ref(r[3]),
             "cause": r[4]}
            for r in rows
        ]  # fmt: skip

    def transition(
        self,
        node: str,
        to_state: str,
        cause: str,
        incident_id: int | None = None,
        *,
        expect: Sequence[str] | None = None,
        follow_up: FollowUp | None = None,
    ) -> tuple[NodeState, int | None] | None:
        """Move `node` to `to_state` (recorded with its cause) and start `follow_up`, in one transaction.

        None, changing nothing, when `expect` is given and the node is in none of those states: two
        triggers racing for one node (a repair reported twice) start one follow-up. Returns the state
        left and the follow-up incident's id.
        """
        now = self.clock()
        with self.tx() as db:
            row = db.execute(
                "SELECT node, state, since, incident_id, cause FROM nodes WHERE node = ?", (node,)
            ).fetchone()
            before = NodeState(*row) if row else NodeState(node, ACTIVE, 0.0, None, "")
            if expect is not None and before.state not in expect:
                return None
            db.execute(
                "INSERT INTO nodes (node, state, since, incident_id, cause) VALUES (?, ?, ?, ?, ?) ON CONFLICT (node) "
                "DO UPDATE SET state = excluded.state, since = excluded.since, incident_id = excluded.incident_id, "
                "cause = excluded.cause",
                (node, to_state, now, incident_id, cause),
            )
            db.execute(
                "INSERT INTO node_history (node, ts, from_state, to_state, incident_id, cause) VALUES (?,?,?,?,?,?)",
                (node, now, before.state, to_state, incident_id, cause),
            )
            new_id = None
            if follow_up is not None:
                p = follow_up.parent
                starts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1e6) % 1_000_000:06d}Z"
                cur = db.execute(
                    "INSERT INTO incidents (fingerprint, starts_at, starts_at_ts, cluster, node, gpu, fault_id, class, "
                    "action, severity, job_id, alertname, state, received_at, updated_at, resolved_at, parent_id) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,'','fleetheal:lifecycle','received',?,?,?,?) RETURNING id",
                    (
                        f"lifecycle:{node}:{follow_up.action}:{incident_ref(p.id)}",
                        starts,
                        now,
                        p.cluster,
                        node,
                        p.gpu,
                        p.fault_id,
                        p.fault_class,
                        follow_up.action,
                        p.severity,
                        now,
                        now,
                        now,  # no alert fires for a follow-up: "resolved" from the start
                        p.id,
                    ),
                )
                new_id = int(cur.fetchone()[0])
                db.execute(
                    "INSERT INTO steps (incident_id, name, started_at, ended_at, result, detail) "
                    "VALUES (?, 'receive', ?, ?, 'ok', ?)",
                    (new_id, now, now, f"{follow_up.action} follows {incident_ref(p.id)}: {cause}"),
                )
            return before, new_id

    def destructive_incidents_since(self, node: str, since: float, actions: Sequence[str]) -> list[Incident]:
        """Incidents raised by alerts (not follow-ups) on `node` since `since` whose action is one of `actions`."""
        if not actions:
            return []
        marks = ",".join("?" * len(actions))
        rows = self._query(
            f"SELECT {_INCIDENT_COLS} FROM incidents WHERE node = ? AND received_at >= ? AND parent_id IS NULL "  # noqa: S608 - constant columns, bound values
            f"AND action IN ({marks}) ORDER BY id",
            (node, since, *actions),
        )
        return [_incident(r) for r in rows]

    def nodes_acted_on(self) -> set[str]:
        """Nodes with an unfinished incident (its action may be changing the node)."""
        return {r[0] for r in self._query("SELECT DISTINCT node FROM incidents WHERE state NOT IN ('done', 'failed')")}

    def set_quarantined(self, node: str, domain: str, incident_id: int) -> None:
        """The node counts as quarantined at the gate (nothing runs on it until `release`)."""
        with self.tx() as db:
            db.execute(
                "INSERT INTO isolations (node, domain, incident_id, since) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (node, domain, incident_id, self.clock()),
            )
            db.execute("UPDATE isolations SET quarantined = 1 WHERE node = ?", (node,))
