"""Node lifecycles (lifecycle.py): where each node is, how it got there, and the follow-up incidents a
transition starts (REVALIDATE after a repair...)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetheal.remediator.alerts import AlertFacts
from fleetheal.remediator.store.db import StoreError, Tx
from fleetheal.remediator.store.incidents import Incident, Incidents, incident_ref

ACTIVE = "active"


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


_NODE = "SELECT node, state, since, incident_id, cause FROM nodes"


class NodeLifecycles(Incidents):
    def node_state(self, node: str) -> NodeState:
        row = self._one(f"{_NODE} WHERE node = ?", (node,))
        return NodeState(node, ACTIVE, 0.0, None, "") if row is None else NodeState(**row)

    def node_states(self, state: str | None = None) -> list[NodeState]:
        """Nodes that ever left `active` (the others are active), optionally only those in `state`."""
        clause, args = ("WHERE state = ?", (state,)) if state else ("", ())
        return [NodeState(**r) for r in self._query(f"{_NODE} {clause} ORDER BY node", args)]

    def node_history(self, node: str) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT ts, from_state, to_state, incident_id, cause FROM node_history WHERE node = ? ORDER BY id", (node,)
        )
        return [
            {"ts": r["ts"], "from": r["from_state"], "to": r["to_state"],
             "incident": None if r["incident_id"] is None else incident_ref(r["incident_id"]), "cause": r["cause"]}
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
            row = db.one(f"{_NODE} WHERE node = ?", (node,))
            before = NodeState(node, ACTIVE, 0.0, None, "") if row is None else NodeState(**row)
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
                new_id = self._follow_up(db, node, follow_up, cause, now)
            return before, new_id

    def _follow_up(self, db: Tx, node: str, follow_up: FollowUp, cause: str, now: float) -> int:
        """The follow-up incident: the parent's fault, the follow-up's action. No alert fires for it: it is
        "resolved" from the start."""
        p = follow_up.parent
        starts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1e6) % 1_000_000:06d}Z"
        facts = AlertFacts(
            **{f.name: getattr(p, f.name) for f in dataclasses.fields(AlertFacts)}
            | {
                "fingerprint": f"lifecycle:{node}:{follow_up.action}:{incident_ref(p.id)}",
                "starts_at": starts,
                "starts_at_ts": now,
                "ends_at_ts": None,
                "node": node,
                "action": follow_up.action,
                "job_id": "",
                "alertname": "fleetheal:lifecycle",
            }
        )
        detail = f"{follow_up.action} follows {incident_ref(p.id)}: {cause}"
        new_id = self._create(db, facts, now, detail, resolved_at=now, parent_id=p.id)
        if new_id is None:  # the same follow-up of the same parent at the same microsecond
            raise StoreError(f"{follow_up.action} for {node} following {incident_ref(p.id)} exists already")
        return new_id
