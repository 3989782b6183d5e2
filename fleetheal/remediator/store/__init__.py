"""Durable state of the remediator: incidents, their steps and events, the gate's ledger, the audit log.

Two backends behind one interface and one schema: SQLite (WAL; the embedded default for the lab, the
tests and small sites) and PostgreSQL (production: shared by the replicas of a highly available
remediator, `store.url_file`). The SQL is written once, in the dialect both understand (`?` placeholders
are translated for psycopg; `RETURNING`, `ON CONFLICT`); the schema's SQLite types are mapped once.

One module per concern, all on one connection and one transaction discipline (db.py):

- db.py: opening either backend, migrations (the schema version), transactions, fencing, leadership;
- schema.py: the tables and the numbered migration steps;
- incidents.py: incidents, steps, events (the state machine's records);
- ledger.py: the gate's ledger (isolations, storm arrivals, job requeues) and its final decisions;
- nodes.py: node lifecycles and the follow-up incidents they start;
- audit.py, kv.py: the audit log; named values (the circuit breaker);
- space.py: room on SQLite's disk: no action starts whose outcome could not be recorded, and a reserve
  that makes room for the outcome of one that did.

A commit whose answer was lost is ambiguous: the engine then finds an attempt with no end and records it
as interrupted, so a playbook never starts twice for one step.
"""

from __future__ import annotations

from fleetheal.remediator.store.db import PG_CONNECT_ARGS, DiskFull, NotLeader, SchemaError, StoreError
from fleetheal.remediator.store.incidents import (
    STATES,
    TERMINAL,
    Event,
    Incident,
    IngestResult,
    Step,
    incident_ref,
    parse_ref,
)
from fleetheal.remediator.store.kv import KeyValue
from fleetheal.remediator.store.ledger import Isolation, Ledger
from fleetheal.remediator.store.nodes import ACTIVE, FollowUp, NodeLifecycles, NodeState

__all__ = [
    "ACTIVE",
    "PG_CONNECT_ARGS",
    "STATES",
    "TERMINAL",
    "DiskFull",
    "Event",
    "FollowUp",
    "Incident",
    "IngestResult",
    "Isolation",
    "NodeState",
    "NotLeader",
    "SchemaError",
    "Step",
    "Store",
    "StoreError",
    "incident_ref",
    "parse_ref",
]


class Store(Ledger, NodeLifecycles, KeyValue):
    """The remediator's database. Safe to share between the event loop and runner threads.

    `Store(path)` is SQLite; `Store.postgres(url)` PostgreSQL (`url=` picks it from the config).
    """
