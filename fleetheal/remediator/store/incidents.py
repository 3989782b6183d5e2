"""Incidents, their steps and events: what the state machine (stages.py) persists.

The same alert twice (fingerprint and start time) is one incident (a UNIQUE constraint, not a check in
Python). Ingesting alerts is the one write any replica makes (followers persist webhooks and answer 202);
every other write here is fenced (db.py).

A firing alert does not become an incident (issue 46) when it is already over:

- its own resolution came first: Alertmanager retries and reorders deliveries (two replicas send each
  their own), so the resolution of an alert this store does not know yet is remembered (table
  `early_resolutions`: fingerprint, start, end; kept EARLY_RESOLUTION_KEEP_S, at most EARLY_RESOLUTION_MAX
  rows), and the firing alert that arrives after it (same fingerprint and start, the resolution's end
  past) is `already_resolved`;
- its endsAt is past (`stale`): Alertmanager sends a firing alert with the zero time (it hides an end not
  reached yet); one whose end is past is a replayed or delayed delivery of an alert that ended.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import operator
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetheal.remediator.alerts import Alert, AlertFacts
from fleetheal.remediator.store.db import Database, Row, Tx, store_error

#: Incident states, in order (the state machine of stages.py).
STATES = ("received", "classified", "gated", "acting", "done", "failed")
TERMINAL = ("done", "failed")
#: How long the resolution of an alert not known yet is remembered, waiting for a firing alert it came
#: before: far longer than Alertmanager retries a notification or than its replicas' deliveries differ.
EARLY_RESOLUTION_KEEP_S = 24 * 3600.0
#: At most this many are remembered (the oldest go first).
EARLY_RESOLUTION_MAX = 10_000


def incident_ref(incident_id: int) -> str:
    """The incident's public name, e.g. inc-000042 (also fleetheal_incident_id in playbooks)."""
    return f"inc-{incident_id:06d}"


def parse_ref(ref: str) -> int:
    """The numeric id of `inc-000042` or `42`; ValueError otherwise."""
    text = ref.removeprefix("inc-")
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"{ref!r} is not an incident id (inc-NNNNNN)")
    return int(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident(AlertFacts):
    """An alert's incident: its alert's facts (ends_at_ts is set when the alert resolves) and its progress."""

    id: int
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
    #: A follow-up of the node's lifecycle (REVALIDATE after a repair...): the incident it follows.
    parent_id: int | None = None

    @property
    def ref(self) -> str:
        return incident_ref(self.id)

    def as_dict(self) -> dict[str, Any]:
        """The incident as the CLI and the lab show it: its alert's labels under their own names."""
        return {
            "id": self.ref,
            "state": self.state,
            **self.labels(),
            **{name: getattr(self, name) for name in _SHOWN},
            "follows": None if self.parent_id is None else incident_ref(self.parent_id),
        }


#: The fields of an incident that `as_dict` shows after its labels.
_SHOWN = ("decision", "hold_reason", "outcome", "dry_run", "starts_at", "received_at", "resolved_at", "fingerprint")


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
    #: Firing alerts whose resolution arrived first (their end is past): no incident, no action.
    already_resolved: int = 0
    #: Firing alerts whose endsAt is past (a replayed or delayed delivery): no incident, no action.
    stale: int = 0
    #: The alerts counted in already_resolved and stale, each with why it does not act (for the log).
    not_acted: list[tuple[Alert, str]] = field(default_factory=list)


def _columns(cls: type[Any], renamed: dict[str, str] | None = None) -> str:
    """The SELECT list of `cls`'s fields (`renamed`: field -> column where they differ)."""
    names = [f.name for f in dataclasses.fields(cls)]
    return ", ".join(f"{renamed[n]} AS {n}" if renamed and n in renamed else n for n in names)


#: An incident's creation from its alert's facts (ends_at_ts waits for the alert to resolve).
_CREATE_FIELDS = tuple(f.name for f in dataclasses.fields(AlertFacts) if f.name != "ends_at_ts")
_CREATE_COLUMNS = (
    *("class" if n == "fault_class" else n for n in _CREATE_FIELDS),
    *("state", "received_at", "updated_at", "resolved_at", "parent_id"),
)
_CREATE = (
    f"INSERT INTO incidents ({', '.join(_CREATE_COLUMNS)}) VALUES ({', '.join('?' * len(_CREATE_COLUMNS))}) "  # noqa: S608 - constant columns, bound values
    "ON CONFLICT DO NOTHING RETURNING id"
)
_facts = operator.attrgetter(*_CREATE_FIELDS)
_INCIDENT = _columns(Incident, {"fault_class": "class"})
_STEP = _columns(Step)
_EVENT = _columns(Event)


def _incident(row: Row) -> Incident:
    row["dry_run"] = bool(row["dry_run"])  # an INTEGER column
    return Incident(**row)


class Incidents(Database):
    """Reading and writing incidents, steps and events."""

    # --- ingesting alerts ------------------------------------------------------------------------------

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
                raise store_error(exc) from exc
        return results

    def _ingest(self, db: Tx, alerts: Sequence[Alert], now: float) -> IngestResult:
        result = IngestResult()
        remembered = False
        for a in alerts:
            if a.status == "firing":
                self._ingest_firing(db, a, now, result)
                continue
            row = db.one(
                "SELECT id, resolved_at FROM incidents WHERE fingerprint = ? AND starts_at = ?",
                (a.fingerprint, a.starts_at),
            )
            if row is None:
                result.resolved_unknown += 1
                if a.ends_at_ts is not None:  # its firing alert may still be on its way: remember the end
                    db.execute(
                        "INSERT INTO early_resolutions (fingerprint, starts_at, ends_at_ts, received_at) "
                        "VALUES (?, ?, ?, ?) ON CONFLICT (fingerprint, starts_at) DO UPDATE SET "
                        "ends_at_ts = excluded.ends_at_ts, received_at = excluded.received_at",
                        (a.fingerprint, a.starts_at, a.ends_at_ts, now),
                    )
                    remembered = True
            elif row["resolved_at"] is None:
                self._resolve(db, int(row["id"]), a.ends_at_ts, now, "alert resolved in Alertmanager")
                result.resolved.append(row["id"])
            else:
                result.duplicates += 1
        if remembered:
            self._prune_early_resolutions(db, now)
        return result

    def _ingest_firing(self, db: Tx, a: Alert, now: float, result: IngestResult) -> None:
        if a.ends_at_ts is not None and a.ends_at_ts <= now:
            result.stale += 1
            result.not_acted.append((a, f"stale: its endsAt {_utc(a.ends_at_ts)} is past"))
            return
        early = db.one(
            "SELECT ends_at_ts FROM early_resolutions WHERE fingerprint = ? AND starts_at = ?",
            (a.fingerprint, a.starts_at),
        )
        if early is not None and early["ends_at_ts"] <= now:
            result.already_resolved += 1
            ended = _utc(early["ends_at_ts"])
            result.not_acted.append((a, f"already resolved: its resolution (ended {ended}) arrived first"))
            return
        iid = self._create(db, a, now, f"alert {a.alertname or a.fault_id} firing since {a.starts_at}")
        if iid is None:
            result.duplicates += 1
            return
        result.created.append(iid)
        if early is not None:  # resolved with an end still ahead of this clock: as if it came second
            self._resolve(db, iid, early["ends_at_ts"], now, "alert resolved in Alertmanager (before it was received)")
            result.resolved.append(iid)
            db.execute(
                "DELETE FROM early_resolutions WHERE fingerprint = ? AND starts_at = ?", (a.fingerprint, a.starts_at)
            )

    @staticmethod
    def _resolve(db: Tx, iid: int, ends_at_ts: float | None, now: float, detail: str) -> None:
        db.execute(
            "UPDATE incidents SET resolved_at = ?, ends_at_ts = ?, updated_at = ? WHERE id = ?",
            (now, ends_at_ts, now, iid),
        )
        db.execute(
            "INSERT INTO events (incident_id, ts, kind, detail) VALUES (?, ?, 'resolved', ?)", (iid, now, detail)
        )

    @staticmethod
    def _prune_early_resolutions(db: Tx, now: float) -> None:
        """Forget resolutions older than EARLY_RESOLUTION_KEEP_S, and all but the EARLY_RESOLUTION_MAX newest."""
        db.execute("DELETE FROM early_resolutions WHERE received_at < ?", (now - EARLY_RESOLUTION_KEEP_S,))
        db.execute(
            "DELETE FROM early_resolutions WHERE received_at < (SELECT received_at FROM early_resolutions "
            "ORDER BY received_at DESC LIMIT 1 OFFSET ?)",  # older than the EARLY_RESOLUTION_MAX-th newest
            (EARLY_RESOLUTION_MAX - 1,),
        )

    def early_resolutions(self) -> int:
        """How many resolutions of alerts not known yet are remembered."""
        return self._count("SELECT count(*) AS n FROM early_resolutions")

    def _create(
        self,
        db: Tx,
        facts: AlertFacts,
        now: float,
        detail: str,
        *,
        resolved_at: float | None = None,
        parent_id: int | None = None,
    ) -> int | None:
        """A new incident in `received` with its (ended) receive step; None when its alert has one already."""
        row = db.one(_CREATE, (*_facts(facts), "received", now, now, resolved_at, parent_id))
        if row is None:
            return None
        iid = int(row["id"])
        db.execute(
            "INSERT INTO steps (incident_id, name, started_at, ended_at, result, detail) "
            "VALUES (?, 'receive', ?, ?, 'ok', ?)",
            (iid, facts.starts_at_ts, now, detail),
        )
        return iid

    # --- incidents -------------------------------------------------------------------------------------

    def get(self, incident_id: int) -> Incident | None:
        row = self._one(f"SELECT {_INCIDENT} FROM incidents WHERE id = ?", (incident_id,))  # noqa: S608 - constant columns, bound values
        return None if row is None else _incident(row)

    def incidents(self, state: str | None = None, limit: int = 100, node: str | None = None) -> list[Incident]:
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(state)
        if node:
            where.append("node = ?")
            args.append(node)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(f"SELECT {_INCIDENT} FROM incidents {clause} ORDER BY id DESC LIMIT ?", (*args, limit))  # noqa: S608 - constant columns, bound values
        return [_incident(r) for r in rows]

    def unfinished(self) -> list[Incident]:
        rows = self._query(f"SELECT {_INCIDENT} FROM incidents WHERE state NOT IN ('done', 'failed') ORDER BY id")  # noqa: S608 - constant columns, bound values
        return [_incident(r) for r in rows]

    def held(self) -> list[Incident]:
        """Incidents waiting at the gate, oldest first (the queue)."""
        rows = self._query(
            f"SELECT {_INCIDENT} FROM incidents WHERE state = 'classified' AND hold_reason IS NOT NULL ORDER BY id"  # noqa: S608 - constant columns, bound values
        )
        return [_incident(r) for r in rows]

    def set_state(self, incident_id: int, state: str, *, reserve: bool = False, **fields: Any) -> None:
        """Move an incident to `state`, updating the named columns in the same transaction. `reserve`: this
        records the outcome of an action; a full disk gives up the reserve for it (db.Database.write)."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        allowed = {"decision", "hold_reason", "outcome", "run_job_id", "dry_run"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot set {sorted(bad)}")
        now = self.clock()
        self.write(lambda db: self._move(db, incident_id, state, fields, now), reserve=reserve)

    @staticmethod
    def _move(db: Tx, incident_id: int, state: str, fields: dict[str, Any], now: float) -> None:
        cols = ["state = ?", "updated_at = ?"] + [f"{k} = ?" for k in fields]
        db.execute(
            f"UPDATE incidents SET {', '.join(cols)} WHERE id = ?",  # noqa: S608 - constant columns, bound values
            (state, now, *fields.values(), incident_id),
        )

    def set_hold(self, incident_id: int, reason: str | None) -> None:
        with self.tx() as db:
            db.execute(
                "UPDATE incidents SET hold_reason = ?, updated_at = ? WHERE id = ?", (reason, self.clock(), incident_id)
            )

    def counts(self) -> list[tuple[str, str, int]]:
        """(state, class, number of incidents)."""
        rows = self._query("SELECT state, class, count(*) AS n FROM incidents GROUP BY state, class")
        return [(r["state"], r["class"], int(r["n"])) for r in rows]

    def unfinished_count(self) -> int:
        return self._count("SELECT count(*) AS n FROM incidents WHERE state NOT IN ('done', 'failed')")

    def held_count(self) -> int:
        return self._count("SELECT count(*) AS n FROM incidents WHERE state = 'classified' AND hold_reason IS NOT NULL")

    def node_busy(self, node: str, actions: Sequence[str]) -> bool:
        """True while an incident on `node` with one of `actions` is unfinished or its alert still fires."""
        if not actions:
            return False
        marks = ",".join("?" * len(actions))
        busy = self._count(
            f"SELECT count(*) AS n FROM incidents WHERE node = ? AND action IN ({marks}) "  # noqa: S608 - constant columns, bound values
            "AND (resolved_at IS NULL OR state NOT IN ('done', 'failed'))",
            (node, *actions),
        )
        return busy > 0

    def destructive_incidents_since(self, node: str, since: float, actions: Sequence[str]) -> list[Incident]:
        """Incidents raised by alerts (not follow-ups) on `node` since `since` whose action is one of `actions`."""
        if not actions:
            return []
        marks = ",".join("?" * len(actions))
        rows = self._query(
            f"SELECT {_INCIDENT} FROM incidents WHERE node = ? AND received_at >= ? AND parent_id IS NULL "  # noqa: S608 - constant columns, bound values
            f"AND action IN ({marks}) ORDER BY id",
            (node, since, *actions),
        )
        return [_incident(r) for r in rows]

    def nodes_acted_on(self) -> set[str]:
        """Nodes with an unfinished incident (its action may be changing the node)."""
        rows = self._query("SELECT DISTINCT node FROM incidents WHERE state NOT IN ('done', 'failed')")
        return {r["node"] for r in rows}

    # --- what other replicas persisted (engine.poll) ---------------------------------------------------

    def watermarks(self) -> tuple[int, int]:
        """The newest incident and event ids (where `since` starts)."""
        (row,) = self._query(
            "SELECT (SELECT coalesce(max(id), 0) FROM incidents) AS incident, "
            "(SELECT coalesce(max(id), 0) FROM events) AS event"
        )
        return int(row["incident"]), int(row["event"])

    def since(self, incident_id: int, event_id: int) -> tuple[list[int], list[int], int, int]:
        """What other replicas persisted after the watermarks: (new incidents, incidents whose alert resolved,
        new incident watermark, new event watermark). Write transactions are serialized, so ids grow in
        commit order and a watermark never skips one."""
        new = [int(r["id"]) for r in self._query("SELECT id FROM incidents WHERE id > ? ORDER BY id", (incident_id,))]
        events = self._query(
            "SELECT id, incident_id FROM events WHERE id > ? AND kind = 'resolved' ORDER BY id", (event_id,)
        )
        return (
            new,
            [int(r["incident_id"]) for r in events],
            new[-1] if new else incident_id,
            int(events[-1]["id"]) if events else event_id,
        )

    # --- steps and events ------------------------------------------------------------------------------

    def start_step(self, incident_id: int, name: str, attempt: int = 1, detail: str = "") -> int:
        with self.tx() as db:
            row = db.one(
                "INSERT INTO steps (incident_id, name, attempt, started_at, detail) "
                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                (incident_id, name, attempt, self.clock(), detail),
            )
            assert row is not None  # RETURNING
            return int(row["id"])

    def end_step(
        self,
        step_id: int,
        result: str,
        detail: str | None = None,
        incident_state: tuple[int, str, dict[str, Any]] | None = None,
        *,
        reserve: bool = False,
    ) -> None:
        """End a step; with `incident_state` (id, state, fields) the incident moves in the same transaction.
        `reserve`: the step is an action (a playbook attempt, a first response, a failover) and this its
        outcome; a full disk gives up the reserve for it (db.Database.write)."""
        now = self.clock()

        def work(db: Tx) -> None:
            if detail is None:
                db.execute("UPDATE steps SET ended_at = ?, result = ? WHERE id = ?", (now, result, step_id))
            else:
                db.execute(
                    "UPDATE steps SET ended_at = ?, result = ?, detail = ? WHERE id = ?", (now, result, detail, step_id)
                )
            if incident_state is not None:
                iid, state, fields = incident_state
                self._move(db, iid, state, fields, now)

        self.write(work, reserve=reserve)

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
        row = self._one(f"SELECT {_STEP} FROM steps WHERE id = ?", (step_id,))  # noqa: S608 - constant columns, bound values
        return None if row is None else Step(**row)

    def steps(self, incident_id: int) -> list[Step]:
        rows = self._query(f"SELECT {_STEP} FROM steps WHERE incident_id = ? ORDER BY id", (incident_id,))  # noqa: S608 - constant columns, bound values
        return [Step(**r) for r in rows]

    def add_event(self, incident_id: int, kind: str, detail: str = "", step_id: int | None = None) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO events (incident_id, step_id, ts, kind, detail) VALUES (?, ?, ?, ?, ?)",
                (incident_id, step_id, self.clock(), kind, detail),
            )

    def events(self, incident_id: int) -> list[Event]:
        rows = self._query(f"SELECT {_EVENT} FROM events WHERE incident_id = ? ORDER BY id", (incident_id,))  # noqa: S608 - constant columns, bound values
        return [Event(**r) for r in rows]


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
