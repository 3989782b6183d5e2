"""The SQLite store: WAL, one incident per alert (fingerprint + start), resolutions recorded."""

from __future__ import annotations

import sqlite3

from fleetheal import taxonomy
from fleetheal.remediator.alerts import validate_alert
from fleetheal.remediator.store import Store, incident_ref, parse_ref
from tests.remediator.conftest import alert

TAX = taxonomy.load()


def v(cfg, **kw):
    return validate_alert(alert(**kw), cfg, TAX)


def test_wal_mode_and_schema(cfg):
    store = Store(cfg.store.path)
    store.close()
    db = sqlite3.connect(cfg.store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"incidents", "steps", "events", "audit", "isolations"} <= tables


def test_the_same_alert_twice_is_one_incident(cfg):
    store = Store(cfg.store.path)
    first = store.ingest([v(cfg), v(cfg)])
    again = store.ingest([v(cfg)])
    assert len(first.created) == 1 and first.duplicates == 1
    assert again.created == [] and again.duplicates == 1
    # Same fingerprint, new start: the fault came back, a new incident.
    later = store.ingest([v(cfg, starts_at="2026-11-29T18:00:00Z")])
    assert len(later.created) == 1
    assert len(store.incidents()) == 2


def test_a_resolved_alert_is_recorded_on_its_incident(cfg):
    store = Store(cfg.store.path)
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


def test_receive_step_and_refs(cfg):
    store = Store(cfg.store.path)
    (iid,) = store.ingest([v(cfg)]).created
    (step,) = store.steps(iid)
    assert step.name == "receive" and step.result == "ok" and step.ended_at is not None
    assert incident_ref(iid) == "inc-000001" and parse_ref("inc-000001") == 1 and parse_ref("7") == 7


def test_state_survives_reopening(cfg):
    store = Store(cfg.store.path)
    (iid,) = store.ingest([v(cfg)]).created
    store.set_state(iid, "classified")
    store.close()
    again = Store(cfg.store.path)
    inc = again.get(iid)
    assert inc is not None and inc.state == "classified"
    assert [i.id for i in again.unfinished()] == [iid]
