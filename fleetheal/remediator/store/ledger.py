"""The gate's ledger: isolated nodes and their history, the storm detector's arrivals, job requeues; and
the final gate decision, which changes the ledger and the incident together (`record_decision`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetheal.remediator.store.audit import AuditLog
from fleetheal.remediator.store.db import Row
from fleetheal.remediator.store.incidents import Incident, Incidents


@dataclass(frozen=True, slots=True)
class Isolation:
    node: str
    domain: str
    incident_id: int
    since: float
    dry_run: bool
    quarantined: bool


_ISOLATION = "SELECT node, domain, incident_id, since, dry_run, quarantined FROM isolations"


def _isolation(row: Row) -> Isolation:
    row["dry_run"], row["quarantined"] = bool(row["dry_run"]), bool(row["quarantined"])  # INTEGER columns
    return Isolation(**row)


class Ledger(Incidents, AuditLog):
    def isolations(self) -> dict[str, Isolation]:
        return {r["node"]: _isolation(r) for r in self._query(_ISOLATION)}

    # The gate asks these for every decision: in a storm of N incidents, loading every isolation each time
    # made the decisions quadratic (600 incidents: about a second of the remediator's CPU).

    def isolation(self, node: str) -> Isolation | None:
        row = self._one(f"{_ISOLATION} WHERE node = ?", (node,))
        return None if row is None else _isolation(row)

    def isolation_counts(self) -> dict[str, int]:
        """Isolated nodes per failure domain."""
        rows = self._query("SELECT domain, count(*) AS n FROM isolations GROUP BY domain")
        return {r["domain"]: int(r["n"]) for r in rows}

    def quarantined_count(self) -> int:
        return self._count("SELECT count(*) AS n FROM isolations WHERE quarantined <> 0")

    def isolations_since(self, node: str, since: float) -> int:
        return self._count("SELECT count(*) AS n FROM isolation_history WHERE node = ? AND ts >= ?", (node, since))

    def storm_nodes(self, since: float, arriving: str | None = None) -> int:
        """Distinct nodes that asked for an isolation since `since`; with `arriving`, counting that node's
        request as one more (the gate decides before `record_arrival` writes it)."""
        row = self._query(
            "SELECT count(DISTINCT node) AS n, count(CASE WHEN node = ? THEN 1 END) AS mine FROM storm WHERE ts >= ?",
            (arriving or "", since),
        )[0]
        return int(row["n"]) + (1 if arriving is not None and not row["mine"] else 0)

    def last_storm_arrival(self) -> float | None:
        (row,) = self._query("SELECT max(ts) AS ts FROM storm")
        return None if row["ts"] is None else float(row["ts"])

    def record_arrival(self, node: str, incident_id: int, prune_before: float) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO storm (ts, node, incident_id) VALUES (?, ?, ?)", (self.clock(), node, incident_id))
            db.execute("DELETE FROM storm WHERE ts < ?", (prune_before,))

    def job_requeues(self, job_id: str) -> int:
        return self._count("SELECT count(*) AS n FROM job_requeues WHERE job_id = ?", (job_id,))

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
            self.audit(decision, reason, incident.id, node=incident.node, action=incident.action, facts=facts)

    def release(self, node: str, reason: str, only_if_not_quarantined: bool = False) -> bool:
        """Drop a node's isolation (it no longer counts against the budget); audited. False if none."""
        with self.tx() as db:
            row = db.one("SELECT incident_id, quarantined FROM isolations WHERE node = ?", (node,))
            if row is None or (only_if_not_quarantined and row["quarantined"]):
                return False
            db.execute("DELETE FROM isolations WHERE node = ?", (node,))
            self.audit(
                "release", reason, row["incident_id"], node=node, facts={"quarantined": bool(row["quarantined"])}
            )
            return True

    def set_quarantined(self, node: str, domain: str, incident_id: int) -> None:
        """The node counts as quarantined at the gate (nothing runs on it until `release`)."""
        with self.tx() as db:
            db.execute(
                "INSERT INTO isolations (node, domain, incident_id, since) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (node, domain, incident_id, self.clock()),
            )
            db.execute("UPDATE isolations SET quarantined = 1 WHERE node = ?", (node,))
