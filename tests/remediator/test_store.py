"""The store on both backends, SQLite (WAL, one file) and PostgreSQL (shared by the replicas): one incident
per alert (fingerprint + start), resolutions recorded, the same Python types from either; and what the
shared store promises its replicas: fencing, one incident for an alert two replicas take at once,
reconnection after a restart, ids in commit order."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sqlite3
import threading
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from fleetheal import taxonomy
from fleetheal.remediator.alerts import validate_alert
from fleetheal.remediator.store import FollowUp, NotLeader, SchemaError, Store, StoreError, incident_ref, parse_ref
from fleetheal.remediator.store.schema import VERSION
from tests.remediator.conftest import alert

TAX = taxonomy.load()

#: Opens another Store object on the test's database: another replica, for PostgreSQL.
OpenStore = Callable[..., Store]


def v(cfg, **kw):
    return validate_alert(alert(**kw), cfg, TAX)


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request: pytest.FixtureRequest, cfg) -> Iterator[OpenStore]:
    """Store objects on one database of the backend under test (closed after the test)."""
    opened: list[Store] = []
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None

    def make(clock: Callable[[], float] | None = None) -> Store:
        kw: dict[str, Any] = {} if clock is None else {"clock": clock}
        store = Store.postgres(url, **kw) if url is not None else Store(cfg.store.path, **kw)
        assert store.backend == request.param
        opened.append(store)
        return store

    yield make
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()


class Clock:
    """A clock that moves a little at every reading (deterministic timestamps on both backends)."""

    def __init__(self, start: float = 1_795_000_000.25) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


# --- one instance ------------------------------------------------------------------------------------


def test_wal_mode_and_schema(cfg):
    store = Store(cfg.store.path)
    store.close()
    db = sqlite3.connect(cfg.store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"incidents", "steps", "events", "audit", "isolations", "leadership"} <= tables


def test_replicas_opening_a_new_sqlite_file_at_once_all_succeed(tmp_path):
    # Switching a new file to WAL takes a lock SQLite's busy handler does not wait for: without the
    # retry, about one round in ten failed with "database is locked" (seen in CI).
    errors: list[tuple[int, BaseException]] = []

    def replica(r: int, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=30)
            Store(str(tmp_path / f"race-{r}.db")).close()
        except BaseException as exc:
            errors.append((r, exc))

    for r in range(20):
        barrier = threading.Barrier(6)
        threads = [threading.Thread(target=replica, args=(r, barrier)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors


def test_postgresql_schema_has_64_bit_ids_and_double_precision(pg_url):
    Store.postgres(pg_url).close()
    Store.postgres(pg_url).close()  # again: the schema exists, nothing fails
    with psycopg.connect(pg_url) as conn:
        columns = {
            (table, column): (kind, identity)
            for table, column, kind, identity in conn.execute(
                "SELECT table_name, column_name, data_type, is_identity FROM information_schema.columns "
                "WHERE table_schema = 'public'"
            )
        }
    assert {"incidents", "steps", "events", "audit", "isolations", "leadership"} <= {t for t, _ in columns}
    assert columns["incidents", "id"] == ("bigint", "YES")
    assert columns["steps", "pid_start"] == ("bigint", "NO")
    assert columns["incidents", "starts_at_ts"] == ("double precision", "NO")
    assert {kind for kind, _ in columns.values()} == {"bigint", "double precision", "text"}


def test_the_same_alert_twice_is_one_incident(open_store, cfg):
    store = open_store()
    first = store.ingest([v(cfg), v(cfg)])
    again = store.ingest([v(cfg)])
    assert len(first.created) == 1 and first.duplicates == 1
    assert again.created == [] and again.duplicates == 1
    # Same fingerprint, new start: the fault came back, a new incident.
    later = store.ingest([v(cfg, starts_at="2026-11-29T18:00:00Z")])
    assert len(later.created) == 1
    assert len(store.incidents()) == 2
    assert [len(store.steps(i.id)) for i in store.incidents()] == [1, 1]


def test_a_resolved_alert_is_recorded_on_its_incident(open_store, cfg):
    store = open_store()
    (iid,) = store.ingest([v(cfg)]).created
    result = store.ingest([v(cfg, status="resolved")])
    assert result.resolved == [iid]
    inc = store.get(iid)
    assert inc is not None and inc.resolved_at is not None and inc.ends_at_ts is not None
    assert [e.kind for e in store.events(iid)] == ["resolved"]
    # Resolved again: counted as a duplicate, nothing changes.
    assert store.ingest([v(cfg, status="resolved")]).duplicates == 1
    # Resolved for an alert never seen firing: counted, no incident.
    assert store.ingest([v(cfg, status="resolved", node="gpu-004")]).resolved_unknown == 1


def test_receive_step_and_refs(open_store, cfg):
    store = open_store()
    (iid,) = store.ingest([v(cfg)]).created
    (step,) = store.steps(iid)
    assert step.name == "receive" and step.result == "ok" and step.ended_at is not None
    assert incident_ref(iid) == "inc-000001" and parse_ref("inc-000001") == 1 and parse_ref("7") == 7


def test_state_survives_reopening(open_store, cfg):
    store = open_store()
    (iid,) = store.ingest([v(cfg)]).created
    store.set_state(iid, "classified")
    store.close()
    again = open_store()
    inc = again.get(iid)
    assert inc is not None and inc.state == "classified"
    assert [i.id for i in again.unfinished()] == [iid]


# --- the same Python types from both backends --------------------------------------------------------


def _everything(store: Store, cfg) -> dict[str, Any]:
    """Every kind of row filled (no optional column left NULL where it can hold a value), read back
    through every reader."""
    (iid,) = store.ingest([v(cfg, job_id="4242")]).created
    (other,) = store.ingest([v(cfg, node="gpu-001", fault_id="xid-79")]).created
    store.ingest([v(cfg, status="resolved")])
    step = store.start_step(iid, "drain", attempt=2, detail="draining")
    store.set_step_process(step, 31337, 123_456_789_012, "/run/fleetheal/x")
    store.add_event(iid, "phase", "drain started", step_id=step)
    inc = store.get(iid)
    assert inc is not None
    store.record_decision(
        inc, "acting", "isolate", "within budget", {"budget": 3, "ok": True}, isolate_domain="rack-0",
        count_isolation=True, quarantine=True, requeue_job="4242", run_job_id="99", dry_run=True,
        budget_remaining=2, outcome="pending", step_id=step,
    )  # fmt: skip
    store.set_state(iid, "acting", dry_run=True, hold_reason="waiting for the budget")
    store.end_step(step, "ok", "drained", incident_state=(iid, "done", {"outcome": "drained", "dry_run": True}))
    store.set_step_run_dir(step, "/run/fleetheal/y")
    store.set_hold(other, "storm")
    store.record_arrival("gpu-000", iid, prune_before=0.0)
    store.set_quarantined("gpu-001", "rack-0", other)
    store.kv_set("reconcile", "3")
    done = store.get(iid)
    assert done is not None
    _, follow_up = store.transition("gpu-000", "repairing", "repair ticket", iid, follow_up=FollowUp(done, "REBOOT"))
    assert follow_up is not None
    store.audit("hold", "a storm", other, node="gpu-001", action="drain", facts={"nodes": 5})
    store.take_leadership("replica-a")
    return {
        "incidents": store.incidents(limit=1000),
        "get": [store.get(i) for i in (iid, other, follow_up)],
        "unfinished": store.unfinished(),
        "held": store.held(),
        "counts": sorted(store.counts()),
        "held_count": store.held_count(),
        "steps": [store.steps(i) for i in (iid, other, follow_up)],
        "step": store.step(step),
        "events": store.events(iid),
        "isolations": store.isolations(),
        "isolation": store.isolation("gpu-000"),
        "isolation_counts": store.isolation_counts(),
        "quarantined_count": store.quarantined_count(),
        "isolations_since": store.isolations_since("gpu-000", 0.0),
        "storm_nodes": store.storm_nodes(0.0),
        "last_storm_arrival": store.last_storm_arrival(),
        "job_requeues": store.job_requeues("4242"),
        "kv": store.kv_get("reconcile"),
        "audit": store.audit_log(),
        "node_busy": store.node_busy("gpu-001", ["drain", "reboot", done.action]),
        "node_state": store.node_state("gpu-000"),
        "node_state_unknown": store.node_state("gpu-007"),
        "node_states": store.node_states(),
        "node_history": store.node_history("gpu-000"),
        "destructive": store.destructive_incidents_since("gpu-000", 0.0, [done.action]),
        "acted_on": store.nodes_acted_on(),
        "leadership": store.leadership(),
        "watermarks": store.watermarks(),
        "since": store.since(0, 0),
    }


def _check_field_types(obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        value = getattr(obj, f.name)
        assert type(value) in allowed, f"{type(obj).__name__}.{f.name} = {value!r} is not {hint}"


def test_rows_come_back_with_their_dataclass_types(open_store, cfg):
    got = _everything(open_store(clock=Clock()), cfg)
    rows = [*got["incidents"], *got["get"], *(s for steps in got["steps"] for s in steps), got["step"], *got["events"]]
    rows += [*got["isolations"].values(), got["node_state"], got["node_state_unknown"], *got["node_states"]]
    for row in rows:
        _check_field_types(row)
    inc = got["get"][0]
    assert inc.dry_run is True and inc.outcome == "drained" and inc.resolved_at is not None
    assert all(v is not None for v in (inc.decision, inc.hold_reason, inc.run_job_id, inc.ends_at_ts))
    assert got["get"][2].parent_id == inc.id and got["get"][1].hold_reason == "storm"
    assert got["step"].pid_start == 123_456_789_012 and got["events"][-1].step_id == got["step"].id
    isolation = got["isolations"]["gpu-000"]
    assert isolation.dry_run is True and isolation.quarantined is True
    assert got["isolations"]["gpu-001"].dry_run is False


def test_postgresql_reads_back_what_sqlite_does(cfg, pg_url):
    """The same changes at the same clock readings: equal results, and equal reprs (1 is not 1.0 or True)."""
    sqlite_store, pg_store = Store(cfg.store.path, clock=Clock()), Store.postgres(pg_url, clock=Clock())
    try:
        lite, pg = _everything(sqlite_store, cfg), _everything(pg_store, cfg)
    finally:
        sqlite_store.close()
        pg_store.close()
    for key in lite:
        assert pg[key] == lite[key], key
        # A set's repr follows its insertion history, not its contents: compare sets sorted.
        canon = (lambda x: sorted(x)) if isinstance(lite[key], (set, frozenset)) else (lambda x: x)
        assert repr(canon(pg[key])) == repr(canon(lite[key])), key


# --- the shared store: replicas ----------------------------------------------------------------------


def _fenced_writes(store: Store, iid: int, cfg) -> dict[str, Callable[[], object]]:
    inc = store.get(iid)
    assert inc is not None
    step = store.steps(iid)[0].id
    return {
        "set_state": lambda: store.set_state(iid, "classified"),
        "set_hold": lambda: store.set_hold(iid, "budget"),
        "start_step": lambda: store.start_step(iid, "drain"),
        "end_step": lambda: store.end_step(step, "failed", incident_state=(iid, "failed", {})),
        "set_step_process": lambda: store.set_step_process(step, 1, 2),
        "set_step_run_dir": lambda: store.set_step_run_dir(step, "/x"),
        "add_event": lambda: store.add_event(iid, "phase"),
        "record_decision": lambda: store.record_decision(
            inc, "acting", "isolate", "ok", {}, isolate_domain="rack-0", count_isolation=True, requeue_job="1"
        ),
        "record_arrival": lambda: store.record_arrival(inc.node, iid, 0.0),
        "set_quarantined": lambda: store.set_quarantined(inc.node, "rack-0", iid),
        "release": lambda: store.release("gpu-005", "test"),
        "transition": lambda: store.transition(inc.node, "repairing", "x", iid, follow_up=FollowUp(inc, "REBOOT")),
        "audit": lambda: store.audit("hold", "x", iid),
        "kv_set": lambda: store.kv_set("k", "v"),
    }


def _snapshot(store: Store) -> tuple[object, ...]:
    incidents = store.incidents(limit=1000)
    return (
        incidents,
        [store.steps(i.id) for i in incidents],
        [store.events(i.id) for i in incidents],
        store.audit_log(),
        store.isolations(),
        store.node_states(),
        store.node_history("gpu-000"),
        store.storm_nodes(0.0),
        store.kv_get("k"),
        store.watermarks(),
    )


def test_a_new_leader_fences_the_old_one(open_store, cfg):
    old, new = open_store(), open_store()
    (iid,) = old.ingest([v(cfg)]).created
    assert old.take_leadership("replica-a") == 1
    old.set_hold(iid, "waiting")  # the leader writes
    old.set_quarantined("gpu-005", "rack-1", iid)
    assert new.take_leadership("replica-b") == 2
    before = _snapshot(new)
    for name, write in _fenced_writes(old, iid, cfg).items():
        with pytest.raises(NotLeader):
            write()
        assert _snapshot(new) == before, f"{name} changed the database"
    assert isinstance(NotLeader("x"), StoreError)
    # Ingesting is the one write every replica makes (a follower persists webhooks and answers 202).
    (other,) = old.ingest([v(cfg, node="gpu-002")]).created
    assert new.get(other) is not None and new.leadership()[:2] == (2, "replica-b")
    new.set_state(iid, "classified")  # the new leader writes
    assert old.get(iid).state == "classified"
    assert old.take_leadership("replica-a") == 3  # and the old one can take it back
    with pytest.raises(NotLeader):
        new.set_state(iid, "gated")
    # Who led from when stays in the audit log, every change of hands.
    leads = [(a["reason"], a["facts"]) for a in new.audit_log() if a["decision"] == "lead"]
    assert leads == [
        (f"{h} took the lead", {"epoch": e, "holder": h})
        for e, h in ((1, "replica-a"), (2, "replica-b"), (3, "replica-a"))
    ]


def test_a_follower_cannot_write_state(open_store, cfg):
    follower = open_store()
    (iid,) = follower.ingest([v(cfg)]).created
    follower.follow()  # before any replica took the lead
    with pytest.raises(NotLeader):
        follower.set_state(iid, "classified")
    leader = open_store()
    leader.take_leadership("replica-a")
    before = _snapshot(leader)
    for name, write in _fenced_writes(follower, iid, cfg).items():
        with pytest.raises(NotLeader):
            write()
        assert _snapshot(leader) == before, f"{name} changed the database"
    assert len(follower.ingest([v(cfg, node="gpu-003")]).created) == 1
    # A leader that lost its lease follows: it stops writing at once, though the epoch is still its own.
    leader.follow()
    with pytest.raises(NotLeader):
        leader.set_state(iid, "classified")
    assert leader.get(iid).state == "received"


def test_the_same_alert_from_replicas_at_once_is_one_incident(open_store, cfg):
    replicas, rounds = 4, 30
    stores: dict[int, Store] = {}
    barrier = threading.Barrier(replicas)
    results: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    errors: list[BaseException] = []

    def replica(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            stores[n] = open_store()  # all at once, on an empty database: the schema is created once
            for r in range(rounds):
                alerts = [v(cfg, starts_at=f"2026-11-29T17:{r:02d}:00Z", node=f"gpu-00{k}") for k in range(3)]
                barrier.wait(timeout=30)
                res = stores[n].ingest(alerts)
                results[n].append((len(res.created), res.duplicates))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=replica, args=(n,)) for n in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for r in range(rounds):
        created = sum(results[n][r][0] for n in range(replicas))
        duplicates = sum(results[n][r][1] for n in range(replicas))
        assert (created, duplicates) == (3, 3 * (replicas - 1)), f"round {r}"
    incidents = stores[0].incidents(limit=10_000)
    assert len(incidents) == 3 * rounds
    assert all(len(stores[0].steps(i.id)) == 1 for i in incidents)  # one receive step each


def test_ids_are_assigned_in_commit_order(open_store, cfg):
    """Many replicas ingest at once while another one follows with `since` from its watermarks: every id
    is created once and seen once, in order, none skipped (ids grow in commit order)."""
    writers, batches, per_batch = 8, 15, 5
    stores = [open_store() for _ in range(writers)]
    poller = open_store()
    created: list[list[int]] = [[] for _ in stores]
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[int] = []

    def write(n: int) -> None:
        try:
            for b in range(batches):
                alerts = [v(cfg, fingerprint=f"{n:04x}{b:04x}{a:04x}0000", node=f"gpu-00{a}") for a in range(per_batch)]
                created[n] += stores[n].ingest(alerts).created
        except BaseException as exc:
            errors.append(exc)

    def poll() -> None:
        marks = poller.watermarks()
        try:
            while True:
                finished = done.is_set()
                new, _, incident_mark, event_mark = poller.since(*marks)
                assert new == sorted(new) and (not new or new[0] > marks[0])
                seen.extend(new)
                marks = (incident_mark, event_mark)
                if finished:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    watcher = threading.Thread(target=poll)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    watcher.join(timeout=60)
    assert not errors, errors
    all_created = sorted(i for ids in created for i in ids)
    assert len(all_created) == len(set(all_created)) == writers * batches * per_batch  # each reported once
    assert all_created == sorted(i.id for i in poller.incidents(limit=10_000))
    assert seen == all_created  # the watermark never skipped one, nor saw one twice
    for ids in created:  # one replica's ids grow too
        assert ids == sorted(ids)


def test_a_restarted_postgresql_fails_one_call_then_reconnects(postgres_server, pg_url, cfg):
    store = Store.postgres(pg_url)
    try:
        (iid,) = store.ingest([v(cfg)]).created
        postgres_server.restart()  # same port, same data
        with pytest.raises(StoreError):
            store.get(iid)  # the old connection is gone: one error...
        inc = store.get(iid)  # ...and the next call connects again
        assert inc is not None and inc.state == "received"
        postgres_server.restart()
        with pytest.raises(StoreError):
            store.set_state(iid, "classified")
        assert store.get(iid).state == "received"  # nothing was written
        store.set_state(iid, "classified")
        assert len(store.ingest([v(cfg, node="gpu-001")]).created) == 1
        assert store.get(iid).state == "classified"
    finally:
        store.close()


def test_a_writer_gone_silent_in_its_transaction_does_not_hold_the_others_off(pg_url):
    """CI saw it: a leader cut off from PostgreSQL in the middle of a write kept the write lock on the
    server (nothing ever told the server that its client was gone), so the next leader's
    `take_leadership` waited for it, past every deadline. The server now ends a session idle in a
    transaction after IDLE_IN_TRANSACTION_S, and its locks with it."""
    from fleetheal.remediator.store.db import IDLE_IN_TRANSACTION_S

    old, new = Store.postgres(pg_url), Store.postgres(pg_url)
    took = threading.Event()
    try:
        old.take_leadership("replica-a")
        with pytest.raises(StoreError):
            with old.tx(fenced=False) as tx:
                tx.execute("UPDATE leadership SET holder = 'replica-a' WHERE id = 1")
                # From here the old leader says nothing more (a cut network, a stopped process).
                thread = threading.Thread(target=lambda: (new.take_leadership("replica-b"), took.set()), daemon=True)
                thread.start()
                took.wait(IDLE_IN_TRANSACTION_S * 12)
                assert took.is_set(), "the new leader still waits for the silent one's write lock"
        # The silent writer's transaction was ended by the server: its COMMIT fails, nothing of it stays.
        assert new.leadership()[:2] == (2, "replica-b")
    finally:
        old.close()
        new.close()


def test_a_failed_begin_leaves_no_transaction_open(pg_url):
    """The write lock's wait canceled on a live connection (statement_timeout): the next call still works."""
    a, b = Store.postgres(pg_url), Store.postgres(pg_url)
    try:
        b._db.execute("SET statement_timeout = 200")
        with a.tx(fenced=False):
            with pytest.raises(StoreError, match="statement timeout"):
                with b.tx(fenced=False):
                    pass
        b.kv_set("after", "works")
        assert b.kv_get("after") == "works"
    finally:
        a.close()
        b.close()


# --- schema versions ---------------------------------------------------------------------------------

#: The schema as the remediator created it before schema versions (user_version 0), copied here as a
#: fixture of the past: a database made by that code must open without losing a row.
UNVERSIONED_SCHEMA = """
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

_INCIDENT_ROW = (
    "INSERT INTO incidents (fingerprint, starts_at, starts_at_ts, cluster, node, gpu, fault_id, class, action, "
    "severity, job_id, alertname, state, decision, hold_reason, outcome, run_job_id, dry_run, budget_remaining, "
    "received_at, updated_at, resolved_at, ends_at_ts{parent}) VALUES ({marks})"
)
#: The rows the old code wrote, one or more per table.
UNVERSIONED_ROWS: list[tuple[str, tuple[object, ...]]] = [
    ("INCIDENT", ("a1b2", "2026-11-29T17:37:02.139000Z", 1796060222.139, "lab", "gpu-000", "0", "xid-79", "gpu_lost",
                  "ISOLATE_AND_RELOCATE", "critical", "4242", "FleethealXid79", "done", "allow", None,
                  "ran isolate_and_relocate.yml", "4242", 1, 2, 1796060223.5, 1796060290.25, 1796060300.0,
                  1796060299.0)),
    ("INCIDENT", ("c3d4", "2026-11-29T18:00:00.000000Z", 1796061600.0, "lab", "gpu-001", "node", "xid-79", "gpu_lost",
                  "ISOLATE_AND_RELOCATE", "critical", "", "", "classified", None, "budget: 2/2", None, None, 0, 0,
                  1796061601.0, 1796061602.0, None, None)),
    ("INSERT INTO steps (incident_id, name, attempt, started_at, ended_at, result, detail, pid, pid_start, run_dir) "
     "VALUES (?,?,?,?,?,?,?,?,?,?)", (1, "playbook", 2, 1796060230.0, 1796060290.0, "successful", "ok", 31337,
                                      123_456_789_012, "/run/fleetheal/inc-000001")),
    ("INSERT INTO events (incident_id, step_id, ts, kind, detail) VALUES (?,?,?,?,?)",
     (1, 1, 1796060231.0, "playbook_start", "isolate_and_relocate.yml")),
    ("INSERT INTO audit (ts, incident_id, node, action, decision, reason, facts) VALUES (?,?,?,?,?,?,?)",
     (1796060225.0, 1, "gpu-000", "ISOLATE_AND_RELOCATE", "allow", "isolate gpu-000", '{"limit": 2}')),
    ("INSERT INTO isolations (node, domain, incident_id, since, dry_run, quarantined) VALUES (?,?,?,?,?,?)",
     ("gpu-000", "rack-0", 1, 1796060225.0, 0, 1)),
    ("INSERT INTO isolation_history (node, ts, incident_id) VALUES (?,?,?)", ("gpu-000", 1796060225.0, 1)),
    ("INSERT INTO storm (ts, node, incident_id) VALUES (?,?,?)", (1796060224.0, "gpu-000", 1)),
    ("INSERT INTO job_requeues (job_id, incident_id, ts) VALUES (?,?,?)", ("4242", 1, 1796060225.0)),
    ("INSERT INTO nodes (node, state, since, incident_id, cause) VALUES (?,?,?,?,?)",
     ("gpu-000", "awaiting_repair", 1796060291.0, 1, "isolated")),
    ("INSERT INTO node_history (node, ts, from_state, to_state, incident_id, cause) VALUES (?,?,?,?,?,?)",
     ("gpu-000", 1796060291.0, "active", "awaiting_repair", 1, "isolated")),
    ("INSERT INTO kv (key, value) VALUES (?,?)", ("breaker_open_since", "1796060224.0")),
    ("INSERT INTO leadership (id, epoch, holder, since) VALUES (?,?,?,?)", (1, 7, "replica-a", 1796060000.0)),
]  # fmt: skip


def _old_pg_types(schema: str) -> list[str]:
    """The old code's mapping of the schema to PostgreSQL's types (a fixture of the past too)."""
    s = schema.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    s = re.sub(r"\bINTEGER\b", "BIGINT", s)
    s = re.sub(r"\bREAL\b", "DOUBLE PRECISION", s)
    return [stmt.strip() for stmt in s.split(";") if stmt.strip()]


def _unversioned_database(backend: str, where: str, *, lifecycles: bool = True) -> None:
    """A database as the code before schema versions left it; `lifecycles=False`: older still, before
    incidents.parent_id."""
    schema = UNVERSIONED_SCHEMA if lifecycles else UNVERSIONED_SCHEMA.replace("    parent_id     INTEGER,\n", "")
    incident = _INCIDENT_ROW.format(parent="", marks=",".join("?" * 23))
    rows = [(incident if sql == "INCIDENT" else sql, args) for sql, args in UNVERSIONED_ROWS]
    if backend == "sqlite":
        db = sqlite3.connect(where)
        with db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(schema)
            for sql, args in rows:
                db.execute(sql, args)
        db.close()
        return
    with psycopg.connect(where, autocommit=True) as conn:
        for stmt in _old_pg_types(schema):
            conn.execute(stmt)
        for sql, args in rows:
            conn.execute(sql.replace("?", "%s"), args)


def _version(backend: str, where: str) -> int:
    if backend == "sqlite":
        db = sqlite3.connect(where)
        try:
            return int(db.execute("PRAGMA user_version").fetchone()[0])
        finally:
            db.close()
    with psycopg.connect(where) as conn:
        if conn.execute("SELECT to_regclass('schema_version')").fetchone()[0] is None:
            return 0
        row = conn.execute("SELECT version FROM schema_version WHERE id = 1").fetchone()
        return 0 if row is None else int(row[0])


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, cfg) -> tuple[str, str]:
    """(backend, where): a path or a URL to an empty database."""
    if request.param == "postgresql":
        return request.param, request.getfixturevalue("pg_url")
    return request.param, cfg.store.path


def _open(backend: str, where: str) -> Store:
    return Store.postgres(where) if backend == "postgresql" else Store(where)


@pytest.mark.parametrize("lifecycles", [True, False], ids=["unversioned", "before-lifecycles"])
def test_an_unversioned_database_is_upgraded_in_place_without_losing_a_row(backend, lifecycles, cfg):
    kind, where = backend
    _unversioned_database(kind, where, lifecycles=lifecycles)
    assert _version(kind, where) == 0
    store = _open(kind, where)
    try:
        assert _version(kind, where) == VERSION
        first, second = store.get(1), store.get(2)
        assert first is not None and second is not None
        assert dataclasses.asdict(first) == {
            "id": 1, "fingerprint": "a1b2", "starts_at": "2026-11-29T17:37:02.139000Z", "starts_at_ts": 1796060222.139,
            "ends_at_ts": 1796060299.0, "cluster": "lab", "node": "gpu-000", "gpu": "0", "fault_id": "xid-79",
            "fault_class": "gpu_lost", "action": "ISOLATE_AND_RELOCATE", "severity": "critical", "job_id": "4242",
            "alertname": "FleethealXid79", "state": "done", "decision": "allow", "hold_reason": None,
            "outcome": "ran isolate_and_relocate.yml", "run_job_id": "4242", "dry_run": True, "budget_remaining": 2,
            "received_at": 1796060223.5, "updated_at": 1796060290.25, "resolved_at": 1796060300.0, "parent_id": None,
        }  # fmt: skip
        assert (second.state, second.hold_reason, second.gpu, second.dry_run) == (
            "classified",
            "budget: 2/2",
            "node",
            False,
        )
        assert [i.id for i in store.held()] == [2] and [i.id for i in store.unfinished()] == [2]
        (step,) = store.steps(1)
        assert (step.name, step.attempt, step.result, step.pid, step.pid_start, step.run_dir) == (
            "playbook", 2, "successful", 31337, 123_456_789_012, "/run/fleetheal/inc-000001"
        )  # fmt: skip
        (event,) = store.events(1)
        assert (event.step_id, event.kind, event.detail) == (step.id, "playbook_start", "isolate_and_relocate.yml")
        (audit,) = store.audit_log()
        assert audit == {"ts": 1796060225.0, "incident": "inc-000001", "node": "gpu-000",
                         "action": "ISOLATE_AND_RELOCATE", "decision": "allow", "reason": "isolate gpu-000",
                         "facts": {"limit": 2}}  # fmt: skip
        iso = store.isolation("gpu-000")
        assert iso is not None and (iso.domain, iso.incident_id, iso.dry_run, iso.quarantined) == (
            "rack-0",
            1,
            False,
            True,
        )
        assert store.quarantined_count() == 1 and store.isolation_counts() == {"rack-0": 1}
        assert store.isolations_since("gpu-000", 0.0) == 1 and store.job_requeues("4242") == 1
        assert store.storm_nodes(0.0) == 1 and store.last_storm_arrival() == 1796060224.0
        assert store.kv_get("breaker_open_since") == "1796060224.0"
        assert store.node_state("gpu-000").state == "awaiting_repair"
        assert [h["to"] for h in store.node_history("gpu-000")] == ["awaiting_repair"]
        assert store.leadership() == (7, "replica-a", 1796060000.0)
        # The old rows live on with the new ones: ids go on where they stopped, a follow-up can follow.
        (new,) = store.ingest([v(cfg, node="gpu-002")]).created
        assert new == 3 and store.steps(new)[0].id == step.id + 1
        _, follow_up = store.transition("gpu-000", "repairing", "ticket", 1, follow_up=FollowUp(first, "REBOOT"))
        assert follow_up is not None and store.get(follow_up).parent_id == 1
    finally:
        store.close()
    again = _open(kind, where)  # opening a current database changes nothing
    try:
        assert _version(kind, where) == VERSION and len(again.incidents()) == 4
    finally:
        again.close()


def test_a_database_from_a_newer_version_is_refused_and_left_unchanged(backend, cfg):
    kind, where = backend
    store = _open(kind, where)
    (iid,) = store.ingest([v(cfg)]).created
    store.close()
    if kind == "sqlite":
        db = sqlite3.connect(where)
        db.execute(f"PRAGMA user_version = {VERSION + 1}")
        db.close()
    else:
        with psycopg.connect(where, autocommit=True) as conn:
            conn.execute("UPDATE schema_version SET version = %s", (VERSION + 1,))
    with pytest.raises(SchemaError, match=f"has schema version {VERSION + 1}, newer than this remediator's {VERSION}"):
        _open(kind, where)
    assert _version(kind, where) == VERSION + 1
    if kind == "sqlite":
        db = sqlite3.connect(where)
        assert db.execute("SELECT id, state FROM incidents").fetchall() == [(iid, "received")]
        db.close()


# --- resolutions that arrive before their firing alert (issue 46) ------------------------------------


def test_early_resolutions_are_remembered_a_day_and_at_most_early_resolution_max(open_store, cfg, monkeypatch):
    from fleetheal.remediator.store import incidents as incmod

    monkeypatch.setattr(incmod, "EARLY_RESOLUTION_MAX", 3)
    clock = Clock(start=1_797_000_000.0)  # after the fixtures' endsAt: every resolution's end is past
    store = open_store(clock)
    assert store.ingest([v(cfg, status="resolved", node="gpu-000")]).resolved_unknown == 1
    assert store.early_resolutions() == 1
    clock.now += incmod.EARLY_RESOLUTION_KEEP_S + 1
    store.ingest([v(cfg, status="resolved", node="gpu-001")])
    assert store.early_resolutions() == 1  # gpu-000's is forgotten after a day...
    assert len(store.ingest([v(cfg, node="gpu-000")]).created) == 1  # ...and its firing alert then acts
    for node in ("gpu-002", "gpu-003", "gpu-004", "gpu-005"):
        store.ingest([v(cfg, status="resolved", node=node)])
    assert store.early_resolutions() == 3  # the oldest go first
    assert len(store.ingest([v(cfg, node="gpu-001")]).created) == 1
    result = store.ingest([v(cfg, node="gpu-005"), v(cfg, node="gpu-003")])
    assert (result.created, result.already_resolved, result.duplicates) == ([], 2, 0)
    assert [a.node for a, _ in result.not_acted] == ["gpu-005", "gpu-003"]


def test_a_version_1_database_is_upgraded_with_the_table_of_early_resolutions(backend, cfg):
    from fleetheal.remediator.store.db import Tx, _Postgres
    from fleetheal.remediator.store.schema import MIGRATIONS

    kind, where = backend
    if kind == "sqlite":  # as the code of version 1 left it
        conn = sqlite3.connect(where, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN")
        MIGRATIONS[0](Tx(conn), kind)
        conn.execute("PRAGMA user_version = 1")
        conn.execute("COMMIT")
        conn.close()
    else:
        pg = _Postgres(where)
        MIGRATIONS[0](Tx(pg), kind)
        pg.execute("CREATE TABLE schema_version (id BIGINT PRIMARY KEY CHECK (id = 1), version BIGINT NOT NULL)")
        pg.execute("INSERT INTO schema_version (id, version) VALUES (1, 1)")
        pg.close()
    assert _version(kind, where) == 1
    store = _open(kind, where)
    try:
        assert _version(kind, where) == VERSION == 2
        assert store.ingest([v(cfg, status="resolved")]).resolved_unknown == 1
        assert store.ingest([v(cfg)]).already_resolved == 1 and store.incidents() == []
    finally:
        store.close()
