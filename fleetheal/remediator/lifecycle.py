"""The node lifecycle: what happens to a node after its action, until it is back in the standby pool.

    active -> isolated -> awaiting_repair | resetting -> revalidating -> standby | quarantined
    standby -> active (promoted, or rejoined when the pool is full)

The transitions are data: each action's `lifecycle` in the taxonomy (policies/faults.yaml) names the
node's state while it acts (`acting`), after it succeeded (`done`, and `rejected` for a validation that
failed), and the follow-up action (`next`) with what starts it (`trigger`):

- `done`: at once (a GPU reset that succeeded is revalidated at once);
- `repaired`: when the repair is reported (`fleetheal nodes repaired NODE`, through the operators' node
  API, or the `fleetheal.io/repaired` annotation on the Node); a repair request goes out when the node
  starts waiting for it (a JSON file in `lifecycle.report_dir`, and a POST to `lifecycle.repair_webhook_url`);
- `pool_full`: when the standby pool already holds `lifecycle.standby_target` nodes.

A follow-up is an incident like any other (`parent_id` names the one it follows): it is persisted in the
same transaction as the transition that starts it, goes through the gate and the playbook runner, and is
resumed after a crash like any other. The gate lets a follow-up act only while the node is in its
action's `acting` state, so nothing can revalidate a node that was not repaired, or rejoin one that did
not pass revalidation (the playbooks check the same in Slurm).

A lemon (`gate.lemon.threshold` destructive incidents within `gate.lemon.window_s`) and a node that
fails revalidation are quarantined with an RMA report naming the faults; nothing runs on them until a
human releases them (`fleetheal remediator release NODE`, which sends them back to awaiting repair).

Slurm is the truth about the pool: `reconcile()` (every `lifecycle.reconcile_interval_s`) finds standby
nodes promoted by an isolation (resumed in Slurm -> active) and drained standby nodes the store did not
know (the initial pool); it also takes a lifecycle step an incident's end missed (the two are separate
transactions: a remediator stopped between them leaves the node in its action's state).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fleetheal import contracts, httpjson, steps
from fleetheal.remediator.config import Config
from fleetheal.remediator.store import ACTIVE, FollowUp, Incident, NodeState, Store
from fleetheal.slurm import nodes as slurm_nodes
from fleetheal.taxonomy import Taxonomy

log = logging.getLogger("fleetheal.remediator.lifecycle")

#: The playbook attempt step's name (stages.PLAYBOOK_STEP; stages imports this module).
_PLAYBOOK_STEP = "playbook"
#: Alerts on one GPU within this many seconds of each other are one failure (for the lemon count).
FAILURE_CORRELATION_S = 60.0
#: An incident finished this long ago whose lifecycle step is missing is taken up by the reconcile.
CATCH_UP_AFTER_S = 5.0
QUARANTINED = "quarantined"
STANDBY = "standby"
AWAITING_REPAIR = "awaiting_repair"


class LifecycleError(ValueError):
    """A lifecycle request that cannot be honoured (the message says why)."""


class Lifecycle:
    def __init__(
        self,
        cfg: Config,
        store: Store,
        taxonomy: Taxonomy,
        *,
        submit: Callable[[Iterable[int]], None],
        slurm: steps.Slurm | None = None,
        kube: Callable[[], steps.Kube | None] | None = None,
        settings: steps.Settings | None = None,
        on_transition: Callable[[str, str, float | None], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.taxonomy = taxonomy
        self.submit = submit
        self.slurm = slurm
        self.kube = kube
        self.settings = settings or steps.Settings()
        self.on_transition = on_transition
        self.clock = clock
        self._lock = threading.RLock()  # repairs and quarantines, one at a time
        self._destructive = tuple(n for n, a in taxonomy.actions.items() if a.destructive)
        #: States in which a destructive action runs on the node.
        self._busy = frozenset(
            a.lifecycle.acting for a in taxonomy.actions.values() if a.destructive and a.lifecycle.acting
        )

    # --- transitions -------------------------------------------------------------------------------------

    def _move(
        self,
        node: str,
        to_state: str,
        cause: str,
        incident_id: int | None,
        *,
        expect: tuple[str, ...] | None = None,
        follow_up: FollowUp | None = None,
    ) -> int | bool | None:
        """Record a transition (and start its follow-up); False when `expect` did not hold."""
        moved = self.store.transition(node, to_state, cause, incident_id, expect=expect, follow_up=follow_up)
        if moved is None:
            return False
        before, new_id = moved
        log.info("node lifecycle", extra={"node": node, "from": before.state, "to": to_state, "cause": cause})
        if self.on_transition is not None:
            spent = max(0.0, self.clock() - before.since) if before.since else None
            self.on_transition(before.state, to_state, spent)
        if new_id is not None:
            self.submit([new_id])
        return new_id

    def state(self, node: str) -> NodeState:
        return self.store.node_state(node)

    # --- hooks from the engine -------------------------------------------------------------------------

    def allowed(self, inc: Incident) -> None:
        """The gate let `inc` act (not in dry run): the node takes its action's `acting` state."""
        lc = self.taxonomy.actions[inc.action].lifecycle
        if inc.parent_id is not None or not lc.acting:
            return
        current = self.state(inc.node)
        if current.state == QUARANTINED or (current.state == lc.acting and current.incident_id == inc.id):
            return  # out for good, or moved already (a resumed incident)
        self._move(inc.node, lc.acting, f"{inc.ref}: {inc.action} for {inc.fault_id}", inc.id)

    def finished(self, inc: Incident) -> None:
        """`inc` reached done or failed: move the node on and start what follows."""
        if inc.dry_run:
            return
        action = self.taxonomy.actions[inc.action]
        lc = action.lifecycle
        node = inc.node
        root = self._root(inc)
        current = self.state(node)
        if inc.state == "failed":
            if lc.acting and current.state == lc.acting and current.incident_id == root.id:
                self._move(node, current.state, f"{inc.ref}: {inc.action} failed ({(inc.outcome or '')[:200]}); "
                           "the node stays out for a human", root.id)  # fmt: skip
            return
        if action.destructive and self._lemon(node, inc):
            return
        ran = any(s.name == _PLAYBOOK_STEP and s.result == "successful" for s in self.store.steps(inc.id))
        if not ran or not lc.done:
            return
        if current.state != lc.acting or current.incident_id != root.id:
            # Another incident took the node over meanwhile (a GPU reset escalated to an isolation): its
            # own end moves the node on.
            log.info("node lifecycle: taken over", extra={"node": node, "incident": inc.ref, "state": current.state})
            return
        if lc.rejected:  # a validation: the playbook left the node in the standby pool or in quarantine
            verdict = self._validation_verdict(inc)
            if verdict is None:
                self._move(node, self.state(node).state, f"{inc.ref}: {inc.action} ran but Slurm shows neither "
                           "the standby nor the quarantine reason; left for a human", root.id)  # fmt: skip
                return
            passed, detail = verdict
            if not passed:
                self.quarantine(node, inc, f"failed revalidation: {detail}")
                return
            cause = f"{inc.ref}: {inc.action} passed ({detail})"
            if lc.next and lc.trigger == "pool_full" and self._pool_full(joining=node):
                self._move(node, lc.done, cause + "; the standby pool is full: it rejoins service", root.id,
                           follow_up=FollowUp(root, lc.next))  # fmt: skip
            else:
                self._move(node, lc.done, cause, root.id)
            return
        cause = f"{inc.ref}: {inc.action} done"
        if lc.next and lc.trigger == "done":
            self._move(node, lc.done, cause + f"; {lc.next} at once", root.id, follow_up=FollowUp(root, lc.next))
            return
        if lc.next and lc.trigger == "repaired":  # the request is out before anyone sees the node waiting
            self._report("repair", node, self._repair_request(node, root))
        self._move(node, lc.done, cause, root.id)

    # --- repairs ---------------------------------------------------------------------------------------

    def repaired(self, node: str, by: str) -> str:
        """The repair of `node` is reported done: revalidate it. LifecycleError when it awaits none."""
        if node not in self.cfg.cluster.nodes:
            raise LifecycleError(f"{node} is not a node of cluster {self.cfg.cluster.name}")
        with self._lock:
            current = self.state(node)
            if current.state != AWAITING_REPAIR:
                raise LifecycleError(f"{node} is {current.state}, not awaiting repair: nothing to revalidate")
            root = self.store.get(current.incident_id) if current.incident_id is not None else None
            if root is None:
                raise LifecycleError(f"{node} awaits repair but its incident is unknown; ask a human")
            lc = self.taxonomy.actions[root.action].lifecycle
            if not lc.next or lc.trigger != "repaired":
                raise LifecycleError(f"{root.action} has no follow-up on a repair")
            if self._lemon(node, root):
                return f"{node} is a lemon: quarantined instead of revalidated"
            nxt = self.taxonomy.actions[lc.next].lifecycle
            new_id = self._move(
                node,
                nxt.acting or current.state,
                f"repair reported by {by}",
                root.id,
                expect=(AWAITING_REPAIR,),
                follow_up=FollowUp(root, lc.next),
            )
        if new_id is False:
            raise LifecycleError(f"{node} is no longer awaiting repair")
        return f"{node}: repair recorded ({by}); {lc.next} started"

    def _repair_request(self, node: str, root: Incident) -> dict[str, Any]:
        return {
            "kind": "repair_request",
            "cluster": self.cfg.cluster.name,
            "node": node,
            "incident": root.ref,
            "fault_id": root.fault_id,
            "fault": self.taxonomy.get(root.fault_id).name,
            "gpu": root.gpu,
            "requested_at": self.clock(),
            "report_done": f"fleetheal nodes repaired {node}  (or annotate Node {node} with "
            f"{contracts.ANNOTATION_REPAIRED}=<who>)",
            "faults": self._faults(node),
        }

    # --- quarantine and lemons -------------------------------------------------------------------------

    def _lemon(self, node: str, inc: Incident) -> bool:
        """Quarantine `node` when it is out of service and a lemon: `gate.lemon.threshold` destructive incidents
        within the window (or the gate's own lemon rule, on isolations). True when it is quarantined.

        While another incident's action still runs on the node, that action's end decides (a quarantine in
        the middle of its playbook would change the node under it)."""
        current = self.state(node)
        if current.state == QUARANTINED:
            return True
        if current.state == ACTIVE:  # in service, or already out for good
            return False
        if current.state in self._busy and current.incident_id != self._root(inc).id:
            return False
        lemon = self.cfg.gate.lemon
        failures = self._failures(node)
        isolation = self.store.isolation(node)
        if isolation is not None and isolation.quarantined:
            why = "lemon: the gate quarantined its isolation (gate.lemon)"
        elif len(failures) >= lemon.threshold:
            why = f"lemon: {len(failures)} GPU failures within {lemon.window_s:g} s (threshold {lemon.threshold})"
        else:
            return False
        self.quarantine(node, inc, why)
        return True

    def quarantine(self, node: str, inc: Incident, why: str) -> None:
        """Quarantine `node`: the gate runs nothing on it, Slurm shows it, and its RMA report is out before
        the node is seen quarantined."""
        root = self._root(inc)
        with self._lock:
            if self.state(node).state == QUARANTINED:
                return
            self.store.set_quarantined(node, self.cfg.cluster.domain_of(node), root.id)
            self._set_slurm_reason(node, f"{self.settings.quarantine_reason} incident={root.ref}")
            self._report("rma", node, {
                "kind": "rma",
                "cluster": self.cfg.cluster.name,
                "node": node,
                "reason": why,
                "incident": root.ref,
                "quarantined_at": self.clock(),
                "faults": self._faults(node),
                "validation": self._validation_steps(inc),
                "history": self.store.node_history(node),
                "release": f"fleetheal remediator release {node}  (after the RMA; it then awaits repair again)",
            })  # fmt: skip
            self._move(node, QUARANTINED, why, root.id)

    def _failures(self, node: str) -> list[Incident]:
        """The node's hardware failures in the lemon window: its destructive incidents, those on one GPU
        within FAILURE_CORRELATION_S of each other counted once (one failure raises several alerts: Xid 79
        and the lost GPU; Xid 48 and the ECC counters)."""
        since = self.clock() - self.cfg.gate.lemon.window_s
        counted: list[Incident] = []
        for inc in self.store.destructive_incidents_since(node, since, self._destructive):
            if not any(c.gpu == inc.gpu and inc.starts_at_ts - c.starts_at_ts < FAILURE_CORRELATION_S for c in counted):
                counted.append(inc)
        return counted

    def _faults(self, node: str) -> dict[str, Any]:
        """The node's hardware incidents in the lemon window: each, the failures they make, counts per fault
        and per GPU."""
        since = self.clock() - self.cfg.gate.lemon.window_s
        incs = self.store.destructive_incidents_since(node, since, self._destructive)
        per_fault: dict[str, int] = {}
        per_gpu: dict[str, int] = {}
        for i in incs:
            per_fault[i.fault_id] = per_fault.get(i.fault_id, 0) + 1
            per_gpu[i.gpu or "node"] = per_gpu.get(i.gpu or "node", 0) + 1
        return {
            "window_s": self.cfg.gate.lemon.window_s,
            "failures": len(self._failures(node)),
            "count": len(incs),
            "per_fault": per_fault,
            "per_gpu": per_gpu,
            "incidents": [
                {"incident": i.ref, "fault_id": i.fault_id, "name": self.taxonomy.get(i.fault_id).name, "gpu": i.gpu,
                 "action": i.action, "starts_at": i.starts_at}
                for i in incs
            ],
        }  # fmt: skip

    # --- the standby pool ------------------------------------------------------------------------------

    def _pool_full(self, joining: str) -> bool:
        """True when the pool holds its target without `joining` (then `joining` rejoins service)."""
        others = [s for s in self.store.node_states(STANDBY) if s.node != joining]
        return len(others) >= self.cfg.lifecycle.standby_target

    def reconcile(self) -> None:
        """Read Slurm (promotions, the initial pool) and the Nodes' repair annotations, and catch up with
        incidents whose end the lifecycle missed. Runs in a thread."""
        self._catch_up()
        if self.slurm is not None:
            try:
                self._reconcile_slurm(self.slurm.sinfo())
            except steps.StepError as exc:
                log.warning("lifecycle: cannot read Slurm", extra={"error": str(exc)[:300]})
        if self.kube is not None:
            try:
                self._reconcile_annotations()
            except Exception as exc:
                log.warning("lifecycle: cannot read the Nodes' annotations", extra={"error": str(exc)[:300]})

    def _catch_up(self) -> None:
        """A node still in a destructive action's state with nothing unfinished on it: the remediator stopped
        between an incident's end and its lifecycle step (they are two transactions). Take that step now
        (`finished` does nothing for an incident whose step was taken)."""
        busy = self.store.nodes_acted_on()
        for st in self.store.node_states():
            if st.state not in self._busy or st.incident_id is None or st.node in busy:
                continue
            mine = [i for i in self.store.incidents(node=st.node, limit=20) if st.incident_id in (i.id, i.parent_id)]
            last = mine[0] if mine else None
            if (
                last is None
                or last.state != "done"
                or self.taxonomy.actions[last.action].lifecycle.acting != st.state
                or self.clock() - last.updated_at < CATCH_UP_AFTER_S
                or self._noted(st.node)  # its step was taken: a note that the node stays
            ):
                continue
            log.info("node lifecycle: catching up", extra={"node": st.node, "incident": last.ref})
            self.finished(last)

    def _noted(self, node: str) -> bool:
        history = self.store.node_history(node)
        return bool(history) and history[-1]["from"] == history[-1]["to"]

    def _reconcile_slurm(self, sinfo: slurm_nodes.Nodes) -> None:
        # One read of the store per reconcile, not per node (25,000 nodes every few seconds).
        standby_reason = self.settings.standby_reason
        known = {n.node: n for n in self.store.node_states()}
        busy = self.store.nodes_acted_on()  # an action is changing these (a REJOIN resumes one): its end decides
        for node in self.cfg.cluster.nodes:
            if node in busy:
                continue
            info = slurm_nodes.slurm_node(sinfo, node)
            if not info.get("found"):
                continue
            in_pool = bool(info["drained"]) and str(info["reason"]).startswith(standby_reason)
            state = known.get(node) or NodeState(node, ACTIVE, 0.0, None, "")
            if state.state == STANDBY and not info["drained"]:
                self._move(node, ACTIVE, "promoted: resumed in Slurm", state.incident_id, expect=(STANDBY,))
            elif state.state == ACTIVE and in_pool:
                self._move(node, STANDBY, f"in the standby pool (Slurm reason '{info['reason']}')", None,
                           expect=(ACTIVE,))  # fmt: skip

    def _reconcile_annotations(self) -> None:
        kube = self.kube() if self.kube is not None else None
        if kube is None:
            return
        raw = kube.core.list_node(_preload_content=False, _request_timeout=kube.TIMEOUT_S)
        for item in json.loads(raw.data).get("items") or []:  # type: ignore[attr-defined]
            meta = item.get("metadata") or {}
            node = str(meta.get("name") or "")
            who = (meta.get("annotations") or {}).get(contracts.ANNOTATION_REPAIRED)
            if who is None or node not in self.cfg.cluster.nodes:
                continue
            try:
                said = self.repaired(node, f"Kubernetes annotation {contracts.ANNOTATION_REPAIRED}={who[:100]!r}")
            except LifecycleError as exc:
                said = f"ignored: {exc}"
            self.store.audit("repaired", said, node=node, facts={"source": "kubernetes", "value": who[:100]})

            def drop(doc: dict[str, Any]) -> dict[str, Any] | None:
                annotations = (doc.get("metadata") or {}).get("annotations") or {}
                if contracts.ANNOTATION_REPAIRED not in annotations:
                    return None
                return {"metadata": {"annotations": {contracts.ANNOTATION_REPAIRED: None}}}

            kube.update_node(node, drop)

    # --- helpers ---------------------------------------------------------------------------------------

    def _root(self, inc: Incident) -> Incident:
        """The incident that took the node out (a follow-up's parent chain ends there)."""
        seen = 0
        while inc.parent_id is not None and seen < 100:
            parent = self.store.get(inc.parent_id)
            if parent is None:
                break
            inc, seen = parent, seen + 1
        return inc

    def _validation_verdict(self, inc: Incident) -> tuple[bool, str] | None:
        """(passed, what the checks said) from Slurm's reason and the playbook's report; None if unclear."""
        reason = self._slurm_reason(inc.node)
        detail = "; ".join(s.get("detail", "") for s in self._validation_steps(inc)) or "no report"
        if reason is None:
            return None
        if reason.startswith(self.settings.standby_reason):
            return True, detail
        if reason.startswith(self.settings.quarantine_reason):
            return False, detail
        return None

    def _validation_steps(self, inc: Incident) -> list[dict[str, Any]]:
        path = Path(self.settings.report_dir) / f"{inc.ref}-{inc.action.lower()}.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            return []
        return [s for s in report.get("steps") or [] if s.get("step") == "revalidate" and s.get("outcome") == "done"]

    def _slurm_reason(self, node: str) -> str | None:
        if self.slurm is None:
            return None
        try:
            info = slurm_nodes.slurm_node(self.slurm.sinfo(), node)
        except steps.StepError:
            return None
        return str(info["reason"]) if info.get("found") and info.get("drained") else None

    def _set_slurm_reason(self, node: str, reason: str) -> None:
        """Show the quarantine in Slurm, when the node is drained with a reason fleetheal owns."""
        if self.slurm is None:
            return
        try:
            info = slurm_nodes.slurm_node(self.slurm.sinfo(), node)
            if info.get("found") and info.get("drained") and contracts.owns_reason(str(info["reason"])):
                self.slurm.scontrol("update", f"nodename={node}", f"reason={reason}")
        except steps.StepError as exc:
            log.warning("lifecycle: cannot set the quarantine reason", extra={"node": node, "error": str(exc)[:300]})

    def _report(self, kind: str, node: str, doc: dict[str, Any]) -> str:
        """Write a repair request or RMA report (JSON) and send it to the ticketing webhook, if any."""
        directory = Path(self.cfg.lifecycle.report_dir)
        name = f"{kind}-{node}-{int(self.clock() * 1000)}.json"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, directory / name)
        except OSError as exc:
            log.error("lifecycle: cannot write the report", extra={"node": node, "kind": kind, "error": str(exc)})
        self.store.audit(kind, f"{kind.replace('_', ' ')} for {node} written to {directory / name}", node=node,
                         facts={"reason": doc.get("reason", ""), "incident": doc.get("incident")})  # fmt: skip
        if self.cfg.lifecycle.repair_webhook_url:
            threading.Thread(target=self._post, args=(kind, node, doc), daemon=True, name="repair-webhook").start()
        return str(directory / name)

    def _post(self, kind: str, node: str, doc: dict[str, Any]) -> None:
        lc = self.cfg.lifecycle
        token = None
        if lc.repair_webhook_token_file:
            with contextlib.suppress(OSError), open(lc.repair_webhook_token_file, encoding="utf-8") as f:
                token = f.readline().strip()

        def not_sent(attempt: int, exc: OSError) -> None:
            log.warning("lifecycle: report not sent", extra={"node": node, "kind": kind, "attempt": attempt,
                                                             "error": str(exc)[:200]})  # fmt: skip

        try:
            status = httpjson.send_json("POST", lc.repair_webhook_url, doc, token=token, attempts=3, on_error=not_sent)
        except OSError:
            return  # logged by not_sent
        log.info("lifecycle: report sent", extra={"node": node, "kind": kind, "status": status})
