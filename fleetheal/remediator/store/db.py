"""The store's connection: opening either backend, schema migrations, transactions, fencing, leadership.

One connection guarded by a lock serves the event loop and the playbook threads; every change is one
transaction (`Database.tx`), so a SIGKILL leaves either the old or the new state. A `tx` inside another
one on the same thread joins it: the outer one commits both or neither (the engine asks the gate and
records its decision in one). Write transactions are serialized, as SQLite's `BEGIN IMMEDIATE` does, by a
transaction-scoped advisory lock in PostgreSQL. Rows are read by column name (`Row`) from either backend.

Fencing: with leader election, the replica that takes the lease bumps `leadership.epoch` (`take_leadership`)
and every later fenced write checks, inside its transaction, that the epoch is still its own. A replica
that lost the lease while cut off (from the API server or the database) can therefore never write a step
again, whatever its clocks say: its transaction fails with `NotLeader`.

Every database error leaves as `StoreError` (retry later); a broken PostgreSQL connection is opened again
at the next call. A full disk is `DiskFull`; with SQLite, `room` (space.py) keeps a reserve so that the outcome
of an action that started is still written (`write(..., reserve=True)`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self, TypeVar

from fleetheal.remediator.store.schema import MIGRATIONS, VERSION
from fleetheal.remediator.store.space import Room

log = logging.getLogger("fleetheal.remediator.store")
T = TypeVar("T")

#: A row: column name -> value (the same Python types from either backend).
Row = dict[str, Any]

#: PostgreSQL's advisory lock that serializes write transactions (and migrations).
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
#: What the server does about a client that went silent, set on each session. Every write holds the one
#: write lock (_PG_WRITE_LOCK) for its transaction: a leader cut off in the middle of one left the server
#: holding that lock, for TCP's two hours, and no other replica could take over (CI saw "no leader within
#: 60 s"). A transaction waits for its own client only between statements, for milliseconds; after
#: IDLE_IN_TRANSACTION_S the server ends the session and its locks go with it. It stays below the leader's
#: renew deadline (4 s by default): the next leader's first write waits at most that long for the lock.
#: The server's own TCP timeout covers a query whose answer cannot reach the client.
IDLE_IN_TRANSACTION_S = 2
PG_SESSION_SETTINGS: dict[str, str] = {
    "idle_in_transaction_session_timeout": f"{IDLE_IN_TRANSACTION_S * 1000}",
    "tcp_user_timeout": "9000",
}


class StoreError(Exception):
    """The database did not answer or refused a change; nothing was written. Retry later."""


class NotLeader(StoreError):
    """A write of the state machine from a replica that is not (or no longer) the leader."""


class SchemaError(StoreError):
    """The database's schema is newer than this code knows; it was left unchanged. Retrying will not help."""


class DiskFull(StoreError):
    """The database's disk is full (or too full for an action to start, space.py); nothing was written.
    Retry once space was freed."""


#: PostgreSQL's SQLSTATE disk_full.
_PG_DISK_FULL = "53100"


def store_error(exc: BaseException) -> StoreError:
    """The StoreError of a database error: DiskFull when the disk is full (SQLite's SQLITE_FULL, also when its
    shared-memory file cannot grow; PostgreSQL's disk_full)."""
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "sqlite_errorcode", None)
    full = isinstance(code, int) and (code & 0xFF == sqlite3.SQLITE_FULL or code == sqlite3.SQLITE_IOERR_SHMSIZE)
    if full or getattr(exc, "sqlstate", None) == _PG_DISK_FULL:
        return DiskFull(text)
    return StoreError(text)


class _Postgres:
    """A psycopg connection that speaks sqlite3's `execute(sql, args)` with `?` placeholders and dict rows;
    connects on first use and again after the connection broke (a restarted or unreachable server)."""

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
            conn = self._psycopg.connect(self.url, autocommit=True, **PG_CONNECT_ARGS)
            try:
                for name, value in PG_SESSION_SETTINGS.items():  # SET, not a startup option: poolers accept it
                    with contextlib.suppress(self._psycopg.errors.UndefinedObject):  # a server < 12 lacks one
                        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
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


def _rows(cursor: Any) -> list[Row]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]


class Tx:
    """The connection inside a transaction: statements, and rows by column name."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        self._conn.execute(sql, args)

    def all(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return _rows(self._conn.execute(sql, args))

    def one(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        """The first row (a statement that returns one: SELECT ... WHERE key, INSERT ... RETURNING)."""
        rows = self.all(sql, args)
        return rows[0] if rows else None


def read_version(db: Tx, backend: str) -> int:
    """The schema version of the database (0: never versioned). SQLite keeps it in `PRAGMA user_version`,
    PostgreSQL in the one-row table `schema_version`."""
    if backend == "postgresql":
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_version (id BIGINT PRIMARY KEY CHECK (id = 1), version BIGINT NOT NULL)"
        )
        row = db.one("SELECT version FROM schema_version WHERE id = 1")
        return 0 if row is None else int(row["version"])
    row = db.one("PRAGMA user_version")
    return int(row["user_version"]) if row else 0


def migrate(db: Tx, backend: str, where: str) -> int:
    """Apply the missing steps of schema.MIGRATIONS inside the caller's write transaction (replicas opening
    one database at once apply each once); the version found. SchemaError when the database is newer."""
    found = read_version(db, backend)
    if found > VERSION:
        raise SchemaError(
            f"the database {where} has schema version {found}, newer than this remediator's {VERSION}: "
            "a newer fleetheal wrote it; run that version (the database was left unchanged)"
        )
    for step in MIGRATIONS[found:]:
        step(db, backend)
    if found < VERSION:
        if backend == "postgresql":
            db.execute(
                "INSERT INTO schema_version (id, version) VALUES (1, ?) "
                "ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                (VERSION,),
            )
        else:
            db.execute(f"PRAGMA user_version = {VERSION:d}")
    return found


class Database:
    """The connection every part of the store shares. `Database(path)` is SQLite; with `url`, PostgreSQL."""

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
        self._depth = 0  # transactions open on this connection (a nested one joins the outer)
        #: None: no leader election (one instance, the flock); 0: a follower (state writes refused);
        #: n > 0: the leader of epoch n (take_leadership).
        self.epoch: int | None = None
        self._ingest_sync = synchronous.upper()
        #: SQLite: the free space of its disk and the reserve for outcomes (space.py); None for PostgreSQL.
        self.room: Room | None = None
        self._writing_outcome = False  # a write(reserve=True) is in progress (it holds the lock)
        self._pg: _Postgres | None = None
        self._errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
        if url is not None:
            self._pg = _Postgres(url)
            self._errors = (sqlite3.Error, *self._pg.errors)
            self._db: Any = self._pg
            self._migrate("in PostgreSQL")
            return
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            self._open_sqlite(path)
        except sqlite3.Error as exc:
            raise store_error(exc) from exc
        self.room = Room(path)

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
        self._migrate(path)

    def _migrate(self, where: str) -> None:
        try:
            with self.tx(fenced=False) as db:  # one writer migrates; the others then find it done
                migrate(db, self.backend, where)
        except StoreError:
            self._db.close()
            raise

    @classmethod
    def postgres(cls, url: str, clock: Callable[[], float] = time.time) -> Self:
        """The store in PostgreSQL at `url` (a libpq URI); the schema is created or migrated as needed."""
        return cls("", clock=clock, url=url)

    @property
    def backend(self) -> str:
        return "postgresql" if self._pg is not None else "sqlite"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def tx(self, *, fenced: bool = True) -> Iterator[Tx]:
        """One write transaction, serialized with every other writer's, rolled back on error; inside
        another on this thread, part of that one.

        `fenced` (every write but ingesting alerts): refused with NotLeader, changing nothing, unless this
        store is the leader's of the current epoch (or there is no leader election).
        """
        with self._lock:
            db, tx = self._db, Tx(self._db)
            if self._depth:
                self._depth += 1
                try:
                    yield tx
                finally:
                    self._depth -= 1
                return
            if self.room is not None and not self._writing_outcome and self.room.exhausted():
                raise DiskFull(
                    "disk full: the reserve was used to record the outcome of an action; until space is freed "
                    "only outcomes are written"
                )
            try:
                if self._pg is not None:
                    db.execute("BEGIN")
                    db.execute("SELECT pg_advisory_xact_lock(?)", (_PG_WRITE_LOCK,))
                else:
                    db.execute("BEGIN IMMEDIATE")
            except self._errors as exc:
                with contextlib.suppress(*self._errors):  # a live connection must not stay in the transaction
                    db.execute("ROLLBACK")
                raise store_error(exc) from exc
            self._depth = 1
            try:
                if fenced and self.epoch is not None:
                    row = tx.one("SELECT epoch FROM leadership WHERE id = 1")
                    if not self.epoch or row is None or int(row["epoch"]) != self.epoch:
                        raise NotLeader(
                            f"not the leader: this replica's epoch is {self.epoch}, the database's "
                            f"{None if row is None else row['epoch']}"
                        )
                yield tx
                db.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(*self._errors):
                    db.execute("ROLLBACK")
                if isinstance(exc, self._errors):
                    raise store_error(exc) from exc
                raise
            finally:
                self._depth = 0

    def write(self, work: Callable[[Tx], T], *, reserve: bool = False) -> T:
        """`work` in a write transaction (`tx`). `reserve`: it records the outcome of an action that started;
        when the disk is full, the reserve is given up to make room for it and it is tried once more
        (space.py), so that the action is never taken for an interrupted one and run again."""
        with self._lock:
            if not reserve or self._depth:  # inside another transaction: that one commits it, or fails
                with self.tx() as db:
                    return work(db)
            self._writing_outcome = True
            try:
                try:
                    with self.tx() as db:
                        return work(db)
                except DiskFull as exc:
                    if self.room is None or not self.room.release():
                        raise
                    log.warning(
                        "disk full: the reserve was given up to record an outcome; no action starts until space "
                        "is freed",
                        extra={"error": str(exc)[:200], "reserve": self.room.reserve_path},
                    )
                with self.tx() as db:
                    return work(db)
            finally:
                self._writing_outcome = False

    def room_problem(self) -> str | None:
        """Why no action may start for lack of disk space (None: it may; always None for PostgreSQL)."""
        return None if self.room is None else self.room.problem()

    def ensure_room(self) -> None:
        """Before an action starts: DiskFull unless its outcome can be recorded (space.py)."""
        problem = self.room_problem()
        if problem is not None:
            raise DiskFull(problem)

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            try:
                return _rows(self._db.execute(sql, args))
            except self._errors as exc:
                raise store_error(exc) from exc

    def _one(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        rows = self._query(sql, args)
        return rows[0] if rows else None

    def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        """The number in column `n` of a one-row answer (SELECT count(*) AS n ...)."""
        (row,) = self._query(sql, args)
        return int(row["n"])

    def ping(self) -> None:
        """StoreError unless the database answers now."""
        self._query("SELECT 1 AS ok")

    def prober(self) -> Callable[[], None]:
        """A check that the database answers, on a connection of its own (never waits for this store's lock,
        which a stuck query may hold). Raises StoreError when it does not."""
        if self._pg is None:
            return self.ping
        probe = _Postgres(self._pg.url)

        def check() -> None:
            try:
                probe.execute("SELECT 1 AS ok").fetchall()
            except probe.errors as exc:
                raise store_error(exc) from exc

        return check

    # --- leadership (leader.py) ------------------------------------------------------------------------

    def take_leadership(self, holder: str) -> int:
        """Become the writer: bump the fencing epoch (every older leader's writes fail from now on). Each
        epoch is also an audit record (decision "lead"): who led from when, through every change of hands."""
        with self.tx(fenced=False) as db:
            row = db.one("SELECT epoch FROM leadership WHERE id = 1")
            epoch = (int(row["epoch"]) if row else 0) + 1
            now = self.clock()
            db.execute(
                "INSERT INTO leadership (id, epoch, holder, since) VALUES (1, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch, holder = excluded.holder, "
                "since = excluded.since",
                (epoch, holder, now),
            )
            db.execute(
                "INSERT INTO audit (ts, decision, reason, facts) VALUES (?, 'lead', ?, ?)",
                (now, f"{holder} took the lead", json.dumps({"epoch": epoch, "holder": holder}, sort_keys=True)),
            )
        self.epoch = epoch
        return epoch

    def follow(self) -> None:
        """Stop writing the state machine (a follower, or a leader that lost its lease)."""
        self.epoch = 0

    def leadership(self) -> tuple[int, str, float] | None:
        """(epoch, holder, since) of the last replica that took the lead; None before any."""
        row = self._one("SELECT epoch, holder, since FROM leadership WHERE id = 1")
        return None if row is None else (int(row["epoch"]), str(row["holder"]), float(row["since"]))
