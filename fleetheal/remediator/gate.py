"""The one safety gate every remediation passes before a playbook runs.

A decision is one of
- **allow**: run the playbook (in dry-run mode the audit says "would isolate" and the playbook gets
  fleetheal_dry_run=true);
- **hold**: keep the incident queued and look again later (pause switch, open circuit breaker, isolation
  budget used up) -- a held incident is never dropped;
- **deny**: finish the incident without running anything (observe-only mode, quarantined node, job over
  its retry limit, alert resolved before anything ran).

Rules, in order:
1. observe-only mode: record what would run, run nothing;
2. pause switch: hold everything;
3. a follow-up of the node's lifecycle (lifecycle.py) runs only while the node is in the state its
   action expects, and needs no budget; otherwise, an alert already resolved: nothing to do;
4. quarantined node (a lemon): nothing runs on it until a human releases it;
5. non-destructive actions: allowed, but a job is requeued at most `max_requeues_per_job` times;
6. destructive actions (taxonomy `destructive: true`) on a node not yet isolated:
   the request counts towards the storm detector; while the circuit breaker is open they are held;
   the isolation budget (absolute and as a share of the pool, cluster-wide and per failure domain) holds
   what does not fit; the node's N-th isolation within the lemon window quarantines it for good.
   A node that is already isolated costs no further budget.

`evaluate` decides and writes nothing; `record` writes what the decision changes (the storm detector's
arrival, the breaker, the ledger, the incident, the audit record). The engine calls both inside one store
transaction, so no other writer's change falls between a decision and its record.

Every final decision, every change of hold reason and every breaker transition is written to the audit
table together with the numbers it was based on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleetheal.contracts import budget_limit
from fleetheal.remediator.config import Config
from fleetheal.remediator.store import Incident, Store, incident_ref
from fleetheal.taxonomy import Taxonomy

_BREAKER_KEY = "breaker_open_since"
_BREAKER_HOLD = "circuit breaker open (isolation storm); queued until quiet"

#: Low-cardinality reasons (metric label values).
REASONS = (
    "ok",
    "already_isolated",
    "duplicate",
    "budget",
    "breaker",
    "paused",
    "observe_only",
    "quarantined",
    "lemon",
    "retry_limit",
    "resolved",
    "lifecycle",
)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  # allow | hold | deny
    decision: str  # what the audit records: allow, would_isolate, would_run, hold, observe, deny
    reason_kind: str  # one of REASONS
    reason: str  # for humans
    run_job_id: str = ""  # the job id the playbook may requeue ("" = none)
    dry_run: bool = False
    isolate: bool = False
    take_over: bool = False  # a stronger action escalates an isolation another incident owns
    quarantine: bool = False
    budget_remaining: int = 0  # isolations the budget allows, this node's included (a fact for the playbook)
    arrival: bool = False  # a destructive request for a node not yet isolated: the storm detector counts it
    opens_breaker: int = 0  # > 0: this arrival makes a storm of that many nodes and opens the breaker


@dataclass(frozen=True, slots=True)
class BudgetState:
    pool: int
    isolated: int
    limit: int
    domains: dict[str, tuple[int, int, int]]  # domain -> (pool, isolated, limit)


class Gate:
    def __init__(
        self,
        cfg: Config,
        store: Store,
        taxonomy: Taxonomy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.taxonomy = taxonomy
        self.clock = clock
        self._pool = cfg.cluster.domains()

    # --- state ------------------------------------------------------------------------------------------

    def breaker_open(self) -> bool:
        return self.store.kv_get(_BREAKER_KEY) is not None

    def budget(self) -> BudgetState:
        b = self.cfg.gate.budget
        per_domain: dict[str, int] = dict.fromkeys(self._pool, 0) | self.store.isolation_counts()
        pool = len(self.cfg.cluster.nodes)
        domains = {
            d: (
                size,
                per_domain.get(d, 0),
                budget_limit(b.max_isolated_per_domain, b.max_isolated_fraction_per_domain, size),
            )
            for d, size in self._pool.items()
        }
        isolated = sum(per_domain.values())
        return BudgetState(pool, isolated, budget_limit(b.max_isolated, b.max_isolated_fraction, pool), domains)

    def remaining(self, node: str) -> int:
        """Isolations the budget allows now with `node`'s own slot counted free (cluster and domain)."""
        budget = self.budget()
        domain = self.cfg.cluster.domain_of(node)
        _, dused, dlimit = budget.domains[domain]
        mine = 1 if self.store.isolation(node) is not None else 0
        return max(0, min(budget.limit - (budget.isolated - mine), dlimit - (dused - mine)))

    def quarantined(self) -> int:
        return self.store.quarantined_count()

    # --- the breaker ------------------------------------------------------------------------------------

    def _opens_breaker(self, incident: Incident) -> int:
        """The nodes in the storm window, this request counted, when it makes a storm that opens the breaker;
        0 when it does not."""
        br = self.cfg.gate.breaker
        nodes = self.store.storm_nodes(self.clock() - br.window_s, arriving=incident.node)
        return nodes if nodes > br.storm_nodes and not self.breaker_open() else 0

    def _record_arrival(self, incident: Incident, verdict: Verdict) -> None:
        """Count the request in the storm detector; open the breaker when the verdict says it makes a storm."""
        br = self.cfg.gate.breaker
        now = self.clock()
        self.store.record_arrival(incident.node, incident.id, prune_before=now - max(br.window_s, br.quiet_s) - 1)
        if verdict.opens_breaker:
            nodes = verdict.opens_breaker
            self.store.kv_set(_BREAKER_KEY, repr(now))
            self.store.audit(
                "breaker_open",
                f"storm: {nodes} nodes asked for isolation within {br.window_s:g} s (more than {br.storm_nodes}); "
                "new isolations are held until it is quiet",
                incident.id,
                node=incident.node,
                action=incident.action,
                facts={"nodes_in_window": nodes, "storm_nodes": br.storm_nodes, "window_s": br.window_s},
            )

    def tick(self) -> bool:
        """Close the breaker after its quiet window; True when it closed."""
        if not self.breaker_open():
            return False
        last = self.store.last_storm_arrival()
        now = self.clock()
        quiet = self.cfg.gate.breaker.quiet_s
        if last is None or now - last >= quiet:
            with self.store.tx():
                self.store.kv_set(_BREAKER_KEY, None)
                self.store.audit(
                    "breaker_closed",
                    f"no new isolation request for {quiet:g} s; held incidents are examined again",
                    facts={"quiet_s": quiet},
                )
            return True
        return False

    # --- decisions --------------------------------------------------------------------------------------

    def evaluate(self, incident: Incident, first: bool) -> Verdict:
        """The decision for a classified incident; `first` is its first look (counts as a storm arrival).
        Writes nothing: `record` does, in the same store transaction (the engine's `_gate`)."""
        verdict = self._evaluate(incident, first)
        if verdict.kind == "allow":
            verdict = dataclasses.replace(verdict, budget_remaining=self.remaining(incident.node))
        return verdict

    def record(self, incident: Incident, verdict: Verdict, step_id: int) -> None:
        """Write what `verdict` (from `evaluate`, in the caller's transaction) changes: the storm detector and
        the breaker, then a held incident's hold reason (audited when it changed) or the final decision with
        its ledger changes. Each audit record carries the numbers the decision was based on (`facts`)."""
        if verdict.arrival:
            self._record_arrival(incident, verdict)
        facts = self.facts(incident)
        if verdict.kind == "hold":
            if hold_changed(incident, verdict):
                self.store.audit(
                    "hold", verdict.reason, incident.id, node=incident.node, action=incident.action, facts=facts
                )
                self.store.add_event(incident.id, "held", verdict.reason, step_id)
            self.store.set_hold(incident.id, f"{verdict.reason_kind}: {verdict.reason}")
        elif verdict.kind == "deny":
            self.store.record_decision(
                incident, "done", verdict.decision, verdict.reason, facts, outcome=verdict.reason, step_id=step_id
            )
        else:
            self.store.record_decision(
                incident,
                "gated",
                verdict.decision,
                verdict.reason,
                facts,
                isolate_domain=self.cfg.cluster.domain_of(incident.node) if verdict.isolate else None,
                count_isolation=verdict.isolate,
                take_over_isolation=verdict.take_over,
                quarantine=verdict.quarantine,
                requeue_job=verdict.run_job_id or None,
                run_job_id=verdict.run_job_id,
                dry_run=verdict.dry_run,
                budget_remaining=verdict.budget_remaining,
                step_id=step_id,
            )

    def _evaluate(self, incident: Incident, first: bool) -> Verdict:
        g = self.cfg.gate
        action = self.taxonomy.actions[incident.action]
        node, verb = incident.node, incident.action
        if g.observe_only:
            return Verdict("deny", "observe", "observe_only", f"observe-only mode: would run {verb} on {node}")
        if self.cfg.paused():
            return Verdict("hold", "hold", "paused", "pause switch is on")
        if incident.parent_id is not None:
            return self._follow_up(incident)
        if incident.resolved_at is not None:
            return Verdict("deny", "deny", "resolved", "the alert resolved before anything ran; nothing to do")
        current = self.store.isolation(node)
        if current is not None and current.quarantined:
            return Verdict(
                "deny",
                "deny",
                "quarantined",
                f"{node} is quarantined (lemon node); it needs a human (`fleetheal remediator release {node}`)",
            )

        job, job_note = incident.job_id, ""
        if job and action.requeues_job:
            done = self.store.job_requeues(job)
            if done >= g.max_requeues_per_job:
                if not action.destructive:
                    return Verdict(
                        "deny",
                        "deny",
                        "retry_limit",
                        f"job {job} was requeued {done} times (limit {g.max_requeues_per_job}); not requeued again",
                    )
                job_note = f"; job {job} reached its retry limit ({g.max_requeues_per_job}) and is not requeued"
                job = ""
        dry = g.dry_run

        if not action.destructive:
            word = "would run" if dry else "run"
            return Verdict(
                "allow", "would_run" if dry else "allow", "ok", f"{word} {verb} on {node}{job_note}", job, dry
            )
        if current is not None:
            owner = self.store.get(current.incident_id)
            # One failure raises several alerts (Xid 79 and the GPU-lost counter; Xid 48 and the ECC
            # counters): acting on each would requeue the job and promote a standby twice. A stronger action
            # than the one under way (RESET_GPU, then ISOLATE_AND_RELOCATE) still runs.
            if (
                owner is not None
                and owner.id != incident.id
                and (owner.action == verb or verb in self.taxonomy.actions[owner.action].supersedes)
            ):
                return Verdict(
                    "deny",
                    "deny",
                    "duplicate",
                    f"{node} is already isolated by {incident_ref(owner.id)} ({owner.action} for "
                    f"{owner.fault_id}); {incident.fault_id} is recorded here and nothing more is done",
                )
            return Verdict(
                "allow",
                "would_isolate" if dry else "allow",
                "already_isolated",
                f"{node} is already isolated by {incident_ref(current.incident_id)}; no further budget{job_note}",
                job,
                dry,
                take_over=owner is not None and owner.id != incident.id,
            )
        opens = self._opens_breaker(incident) if first else 0
        verdict = (
            Verdict("hold", "hold", "breaker", _BREAKER_HOLD)
            if opens
            else self._isolation(incident, job, job_note, dry)
        )
        return dataclasses.replace(verdict, arrival=first, opens_breaker=opens)

    def _isolation(self, incident: Incident, job: str, job_note: str, dry: bool) -> Verdict:
        """A destructive action on a node not yet isolated: the breaker, the budget, the lemon rule."""
        node = incident.node
        if self.breaker_open():
            return Verdict("hold", "hold", "breaker", _BREAKER_HOLD)
        budget = self.budget()
        domain = self.cfg.cluster.domain_of(node)
        dpool, dused, dlimit = budget.domains[domain]
        if budget.isolated >= budget.limit:
            return Verdict(
                "hold",
                "hold",
                "budget",
                f"{budget.isolated}/{budget.limit} nodes of the pool of {budget.pool} isolated",
            )
        if dused >= dlimit:
            return Verdict(
                "hold",
                "hold",
                "budget",
                f"{dused}/{dlimit} nodes of failure domain {domain} ({dpool} nodes) isolated",
            )
        lemon = self.cfg.gate.lemon
        count = self.store.isolations_since(node, self.clock() - lemon.window_s) + 1
        quarantine = count >= lemon.threshold
        word = "would isolate" if dry else "isolate"
        reason = (
            f"{word} {node}: {budget.isolated + 1}/{budget.limit} in the pool, {dused + 1}/{dlimit} in {domain}"
            f"{job_note}"
        )
        if quarantine:
            reason += f"; isolation {count} within {lemon.window_s:g} s makes it a lemon: quarantined for good"
        return Verdict(
            "allow",
            "would_isolate" if dry else "allow",
            "lemon" if quarantine else "ok",
            reason,
            job,
            dry,
            isolate=True,
            quarantine=quarantine,
        )

    def _follow_up(self, incident: Incident) -> Verdict:
        """A step of the node's lifecycle (lifecycle.py): it acts only while the node is in its action's
        `acting` state, which the transition that started it set. It needs no budget (the node is out of
        service already) and is never a storm arrival."""
        node, verb = incident.node, incident.action
        current = self.store.isolation(node)
        if current is not None and current.quarantined:
            return Verdict("deny", "deny", "quarantined", f"{node} is quarantined; {verb} does not run on it")
        expected = self.taxonomy.actions[verb].lifecycle.acting
        state = self.store.node_state(node).state
        if state != expected:
            return Verdict("deny", "deny", "lifecycle", f"{verb} runs on a node that is {expected}; {node} is {state}")
        dry = self.cfg.gate.dry_run
        word = "would run" if dry else "run"
        return Verdict("allow", "would_run" if dry else "allow", "ok", f"{word} {verb} on {node} ({state})", "", dry)

    def facts(self, incident: Incident) -> dict[str, object]:
        """The numbers a decision was based on (stored with the audit record)."""
        budget = self.budget()
        domain = self.cfg.cluster.domain_of(incident.node)
        dpool, dused, dlimit = budget.domains[domain]
        g = self.cfg.gate
        return {
            "pool": budget.pool,
            "isolated": budget.isolated,
            "limit": budget.limit,
            "domain": domain,
            "domain_pool": dpool,
            "domain_isolated": dused,
            "domain_limit": dlimit,
            "breaker_open": self.breaker_open(),
            "dry_run": g.dry_run,
            "observe_only": g.observe_only,
            "paused": self.cfg.paused(),
        }

    def maybe_release(self, node: str) -> bool:
        """Release `node`'s isolation once no destructive incident on it is unresolved or unfinished."""
        destructive = [name for name, a in self.taxonomy.actions.items() if a.destructive]
        if self.store.node_busy(node, destructive):
            return False
        return self.store.release(
            node, "every destructive incident on the node is finished and resolved", only_if_not_quarantined=True
        )


def hold_changed(incident: Incident, verdict: Verdict) -> bool:
    """A hold for another reason than the one the incident waits for (audited, and counted once)."""
    return (incident.hold_reason or "").split(":", 1)[0] != verdict.reason_kind
