"""Every metric the remediator exports (docs/metrics.md, section "Remediator").

Counters and histograms live in a private registry; gauges that describe durable state (incidents by
state and class, the queue, isolations) are read from the database at scrape time, so they are right
after a restart too. Labels are low-cardinality: no node names, no incident ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetheal.remediator.phases import PhaseMetrics
from fleetheal.remediator.store import ACTIVE, STATES, Incident, Store

if TYPE_CHECKING:
    from fleetheal.remediator.gate import Gate

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NS = "fleetheal_remediator"

#: Why the service closed a client connection itself (connections.ConnectionGuard).
CONNECTION_CLOSE_REASONS = ("limit", "evicted", "header_timeout")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_RECOVERY_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)


class _StateCollector(Collector):
    def __init__(self, store: Store, gate: Gate | None) -> None:
        self.store = store
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        incidents = GaugeMetricFamily(
            f"{NS}_incidents", "Incidents by state and fault class.", labels=["state", "class"]
        )
        counts = {(s, c): n for s, c, n in self.store.counts()}
        classes = sorted({c for _, c in counts})
        for state in STATES:
            for cls in classes:
                incidents.add_metric([state, cls], counts.get((state, cls), 0))
        yield incidents
        yield GaugeMetricFamily(
            f"{NS}_queue_depth", "Incidents held at the safety gate (queued, not dropped).", self.store.held_count()
        )
        if self.gate is None:
            return
        budget = self.gate.budget()
        pool = GaugeMetricFamily(f"{NS}_pool_nodes", "Configured nodes per failure domain.", labels=["failure_domain"])
        isolated = GaugeMetricFamily(
            f"{NS}_nodes_isolated",
            "Nodes isolated by fleetheal that still count against the budget, per failure domain.",
            labels=["failure_domain"],
        )
        limit = GaugeMetricFamily(
            f"{NS}_isolation_budget_nodes",
            "Nodes that may be isolated at once, per failure domain.",
            labels=["failure_domain"],
        )
        for domain, (size, used, cap) in sorted(budget.domains.items()):
            pool.add_metric([domain], size)
            isolated.add_metric([domain], used)
            limit.add_metric([domain], cap)
        yield pool
        yield isolated
        yield limit
        yield GaugeMetricFamily(
            f"{NS}_isolation_budget_cluster_nodes", "Nodes that may be isolated at once in the cluster.", budget.limit
        )
        yield GaugeMetricFamily(
            f"{NS}_nodes_quarantined", "Lemon nodes quarantined until a human releases them.", self.gate.quarantined()
        )
        yield GaugeMetricFamily(
            f"{NS}_breaker_open", "1 while the circuit breaker holds new isolations.", int(self.gate.breaker_open())
        )
        g = self.gate.cfg.gate
        yield GaugeMetricFamily(f"{NS}_dry_run", "1 in dry-run mode.", int(g.dry_run))
        yield GaugeMetricFamily(f"{NS}_observe_only", "1 in observe-only mode.", int(g.observe_only))
        yield GaugeMetricFamily(f"{NS}_paused", "1 while the pause switch is on.", int(self.gate.cfg.paused()))
        yield from self._lifecycle()

    def _lifecycle(self) -> Iterator[Metric]:
        assert self.gate is not None
        cfg = self.gate.cfg
        nodes = GaugeMetricFamily(f"{NS}_nodes", "Nodes by lifecycle state (docs/taxonomy.md).", labels=["state"])
        counts: dict[str, int] = {}
        for n in self.store.node_states():
            if n.node in cfg.cluster.nodes:
                counts[n.state] = counts.get(n.state, 0) + 1
        counts[ACTIVE] = len(cfg.cluster.nodes) - sum(c for s, c in counts.items() if s != ACTIVE)
        for state in self.gate.taxonomy.node_states:
            nodes.add_metric([state], counts.get(state, 0))
        yield nodes
        target = cfg.lifecycle.standby_target
        yield GaugeMetricFamily(f"{NS}_standby_target_nodes", "Nodes the warm-standby pool should hold.", target)
        yield GaugeMetricFamily(
            f"{NS}_standby_shortfall_nodes",
            "Nodes the standby pool lacks against its target (alert FleethealStandbyShortfall).",
            max(0, target - counts.get("standby", 0)),
        )


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        self.store = store
        self._state = _StateCollector(store, None)
        self.registry.register(self._state)
        r = self.registry
        self.leader = Gauge(
            f"{NS}_leader",
            "1 while this replica acts (the leader, or the only instance), 0 while it follows.",
            registry=r,
        )
        self.degraded = Gauge(
            f"{NS}_degraded",
            "1 while incidents are not moving (the engine's workers stopped, database errors, a queue nobody "
            "takes): /healthz says degraded and the pod is unready (alert FleethealRemediatorDegraded).",
            registry=r,
        )
        self.webhook_requests = Counter(
            f"{NS}_webhook_requests_total", "Webhook requests by HTTP status code.", ["code"], registry=r
        )
        self.webhook_seconds = Histogram(
            f"{NS}_webhook_duration_seconds",
            "Time from request to response (202 means persisted).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.alerts_total = Counter(
            f"{NS}_alerts_total",
            "Alerts in webhook payloads by result: accepted, duplicate, rejected, resolved, resolved_unknown, "
            "already_resolved (firing after its own resolution), stale (firing with an endsAt past).",
            ["result"],
            registry=r,
        )
        self.gate_decisions = Counter(
            f"{NS}_gate_decisions_total",
            "Safety gate decisions (holds counted when their reason changes).",
            ["decision", "reason"],
            registry=r,
        )
        self.step_seconds = Histogram(
            f"{NS}_step_duration_seconds",
            "Duration of incident steps (classify, gate incl. time held, playbook attempts).",
            ["step", "action", "result"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.time_to_playbook = Histogram(
            f"{NS}_time_to_playbook_seconds",
            "From the alert's start (startsAt) to the start of its playbook: detection-to-action time.",
            ["class"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.receive_to_playbook = Histogram(
            f"{NS}_receive_to_playbook_seconds",
            "From receiving the alert to the start of its playbook (the remediator's own latency).",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.time_to_recovery = Histogram(
            f"{NS}_time_to_recovery_seconds",
            "From the alert's start to the successful end of its playbook (an ETTR input).",
            ["class", "action"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.downtime = Counter(
            f"{NS}_recovery_seconds_total",
            "Sum of time_to_recovery: training time lost to faults until remediation (an ETTR input).",
            ["class"],
            registry=r,
        )
        self.incidents_finished = Counter(
            f"{NS}_incidents_finished_total",
            "Incidents that reached done or failed.",
            ["class", "action", "state"],
            registry=r,
        )
        self.engine_errors = Counter(
            f"{NS}_engine_errors_total",
            "Database errors while processing incidents (each incident is taken up again after a backoff).",
            registry=r,
        )
        self.incidents_waiting = Gauge(
            f"{NS}_incidents_waiting",
            "Incidents waiting, before a retry, for a dependency that does not answer (slurm, kubernetes).",
            ["dependency"],
            registry=r,
        )
        for dependency in ("slurm", "kubernetes"):
            self.incidents_waiting.labels(dependency)
        self.connections_open = Gauge(
            f"{NS}_connections_open", "Client connections open now (at most listen.max_connections).", registry=r
        )
        self.connections_closed = Counter(
            f"{NS}_connections_closed_total",
            "Client connections the service closed to protect itself: limit (every connection busy, 503), "
            "evicted (waited longest for a request head when a new one came), header_timeout.",
            ["reason"],
            registry=r,
        )
        for reason in CONNECTION_CLOSE_REASONS:
            self.connections_closed.labels(reason)
        self.node_state_seconds = Histogram(
            f"{NS}_node_state_seconds",
            "Time nodes spent in a lifecycle state, observed when they leave it.",
            ["state"],
            buckets=(*_RECOVERY_BUCKETS, 14400, 86400, 604800),
            registry=r,
        )
        self.node_transitions = Counter(
            f"{NS}_node_transitions_total", "Node lifecycle transitions.", ["from_state", "to_state"], registry=r
        )
        self.membership_changes = Counter(
            f"{NS}_membership_changes_total",
            "Pool memberships applied to Nodes (applied), released from them (released), or refused by the "
            "API server (failed).",
            ["result"],
            registry=r,
        )
        for result in ("applied", "released", "failed"):
            self.membership_changes.labels(result)
        self.failovers = Counter(
            f"{NS}_failovers_total",
            "Jobs the third recovery stage looked at, by decision: moved to another cluster (moved, would-move in"
            " dry run), already there (noop), refused (no cluster reads its checkpoint store), failed.",
            ["result"],
            registry=r,
        )
        for result in ("moved", "would-move", "noop", "refused", "failed"):
            self.failovers.labels(result)
        self.phases = PhaseMetrics(r)  # fleetheal_remediator_phase_seconds (fleetheal/remediator/phases.py)
        use_help = (
            "by what they do: training (a Slurm job), inference (lent, a pod holds GPUs), lent (lent, no pod yet),"
            " idle, standby, repair, unavailable; set by each round of the lending controller."
        )
        self.gpu_pool_nodes = Gauge(
            f"{NS}_gpu_pool_nodes", f"Nodes of each GPU pool {use_help}", ["gpu_pool", "use"], registry=r
        )
        self.gpu_pool_gpus = Gauge(
            f"{NS}_gpu_pool_gpus", f"GPUs of each GPU pool {use_help}", ["gpu_pool", "use"], registry=r
        )
        self.lending = Counter(
            f"{NS}_lending_total", "Nodes lent to Kubernetes workloads (lent) and taken back by Slurm (reclaimed).",
            ["result"], registry=r,
        )  # fmt: skip
        for result in ("lent", "reclaimed"):
            self.lending.labels(result)

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def attach_gate(self, gate: Gate) -> None:
        self._state.gate = gate

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- hooks -----------------------------------------------------------------------------------------

    def webhook(self, code: int, seconds: float) -> None:
        self.webhook_requests.labels(str(code)).inc()
        self.webhook_seconds.observe(seconds)

    def lending_round(self, uses: Mapping[tuple[str, str], Sequence[int]], lent: int, reclaimed: int) -> None:
        """One lending round's view of the GPU pools ((pool, use) -> (nodes, GPUs)) and what it lent and took back."""
        self.gpu_pool_nodes.clear()
        self.gpu_pool_gpus.clear()
        for (pool, use), (nodes, gpus) in sorted(uses.items()):
            self.gpu_pool_nodes.labels(pool, use).set(nodes)
            self.gpu_pool_gpus.labels(pool, use).set(gpus)
        self.lending.labels("lent").inc(lent)
        self.lending.labels("reclaimed").inc(reclaimed)

    def membership_applied(self, result: str) -> None:
        self.membership_changes.labels(result).inc()

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def alerts(self, result: str, n: int = 1) -> None:
        if n:
            self.alerts_total.labels(result).inc(n)

    def decision(self, decision: str, reason: str) -> None:
        self.gate_decisions.labels(decision, reason).inc()

    def step(self, step: str, action: str, result: str, seconds: float) -> None:
        self.step_seconds.labels(step, action, result).observe(seconds)

    def playbook_started(self, inc: Incident, when: float) -> None:
        self.time_to_playbook.labels(inc.fault_class).observe(max(0.0, when - inc.starts_at_ts))
        self.receive_to_playbook.observe(max(0.0, when - inc.received_at))

    def node_left_state(self, state: str, to_state: str, seconds: float | None) -> None:
        if seconds is not None:  # None: the node was active since before the remediator knew it
            self.node_state_seconds.labels(state).observe(seconds)
        self.node_transitions.labels(state, to_state).inc()

    def incident_finished(self, inc: Incident, when: float) -> None:
        self.incidents_finished.labels(inc.fault_class, inc.action, inc.state).inc()
        self.phases.observe(inc, self.store.events(inc.id), when)
        recovered = inc.state == "done" and inc.decision in ("allow", "would_isolate", "would_run")
        if recovered and not inc.dry_run and inc.parent_id is None:  # a follow-up is not a recovery from a fault
            seconds = max(0.0, when - inc.starts_at_ts)
            self.time_to_recovery.labels(inc.fault_class, inc.action).observe(seconds)
            self.downtime.labels(inc.fault_class).inc(seconds)
