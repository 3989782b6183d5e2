"""The audit log: every decision of the gate and of the node lifecycle, with the numbers it was based on."""

from __future__ import annotations

import json
from typing import Any

from fleetheal.remediator.store.db import Database
from fleetheal.remediator.store.incidents import incident_ref


class AuditLog(Database):
    def audit(
        self,
        decision: str,
        reason: str,
        incident_id: int | None = None,
        *,
        node: str | None = None,
        action: str | None = None,
        facts: dict[str, Any] | None = None,
    ) -> None:
        """One audit record (part of the caller's transaction when there is one)."""
        with self.tx() as db:
            db.execute(
                "INSERT INTO audit (ts, incident_id, node, action, decision, reason, facts) VALUES (?,?,?,?,?,?,?)",
                (self.clock(), incident_id, node, action, decision, reason, json.dumps(facts or {}, sort_keys=True)),
            )

    def audit_log(self, incident_id: int | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        clause, args = ("WHERE incident_id = ?", (incident_id,)) if incident_id is not None else ("", ())
        rows = self._query(
            f"SELECT ts, incident_id, node, action, decision, reason, facts FROM audit {clause} ORDER BY id LIMIT ?",  # noqa: S608 - constant columns, bound values
            (*args, limit),
        )
        return [
            {
                "ts": r["ts"],
                "incident": None if r["incident_id"] is None else incident_ref(r["incident_id"]),
                "node": r["node"],
                "action": r["action"],
                "decision": r["decision"],
                "reason": r["reason"],
                "facts": json.loads(r["facts"]),
            }
            for r in rows
        ]
