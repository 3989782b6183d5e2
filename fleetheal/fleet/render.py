"""The fleet view shown: the table of `fleetheal fleet status` for people, and the same numbers as Prometheus
metrics collected on each scrape for `fleetheal fleet exporter` (docs/metrics.md, section "Fleet").
The view itself is fleetheal.fleet.view's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from fleetheal.contracts import POOL_USES
from fleetheal.fleet.view import NODE_STATES, FleetStatus, Gpus, Queue, Remediator, by_qos, queue_of

if TYPE_CHECKING:
    from prometheus_client.core import Metric
    from prometheus_client.registry import CollectorRegistry

#: GPU states: in use by jobs; usable now; idle on a node that takes no jobs (drained, down, UNKNOWN...).
GPU_STATES = ("allocated", "free", "unavailable")


# --- the table -----------------------------------------------------------------------------------------------


def _gpu_cell(gpus: Mapping[str, Gpus]) -> str:
    return " ".join(f"{t} {g.free}/{g.total}" for t, g in sorted(gpus.items())) or "0/0"


def _nodes_cell(nodes: Mapping[str, int]) -> str:
    cell = "/".join(str(nodes.get(s, 0)) for s in NODE_STATES[:5])
    return cell + (f" +{nodes['other']} other" if nodes.get("other") else "")


def _qos_cell(queues: Mapping[str, Queue]) -> str:
    return " ".join(f"{q} {c.pending}/{c.running}" for q, c in queues.items()) or "-"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _remediator_cells(rem: Remediator | None) -> tuple[str, str]:
    if rem is None:
        return "-", "-"
    if not rem.up:
        return "?", "?"
    return _opt(rem.standby_nodes), _opt(rem.open_incidents)


HEADER = (
    "CLUSTER",
    "STATE",
    "GPUS FREE/TOTAL",
    "NODES IDLE/MIX/ALLOC/DRAIN/DOWN",
    "JOBS PEND/RUN",
    "PEND GPUS",
    "BY QOS PEND/RUN",
    "STANDBY",
    "INCIDENTS",
)


def table(status: FleetStatus) -> str:
    """The human view: one line per cluster and a fleet total; `?` where a remediator did not answer, `-`
    where there is none. Errors follow the table, one line per cluster."""
    rows: list[tuple[str, ...]] = [HEADER]
    notes: list[str] = []
    for c in status.clusters:
        standby, incidents = _remediator_cells(c.remediator)
        if c.up:
            q = c.queue
            rows.append(
                (
                    c.name,
                    "up",
                    _gpu_cell(c.gpus),
                    _nodes_cell(c.nodes),
                    f"{q.pending}/{q.running}",
                    str(q.pending_gpus),
                    _qos_cell(c.queue_by_qos),
                    standby,
                    incidents,
                )
            )
        else:
            rows.append((c.name, "unreachable", "-", "-", "-", "-", "-", standby, incidents))
            notes.append(f"{c.name}: {c.error}")
        if c.remediator is not None and not c.remediator.up:
            notes.append(f"{c.name}: remediator: {c.remediator.error}")
    jobs = status.jobs
    q = queue_of(jobs)
    rows.append(
        (
            "fleet",
            f"{len(status.up)}/{len(status.clusters)} up",
            _gpu_cell(status.gpus),
            _nodes_cell(status.nodes),
            f"{q.pending}/{q.running}",
            str(q.pending_gpus),
            _qos_cell(by_qos(jobs, status.qos_names)),
            _opt(status.remediator_total("standby_nodes")),
            _opt(status.remediator_total("open_incidents")),
        )
    )
    return "\n".join(_aligned(rows) + notes + _pools_table(status)) + "\n"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _pools_table(status: FleetStatus) -> list[str]:
    """Per GPU pool, nodes/GPUs by what they do (from the remediators that lend); nothing when none reports."""
    rows: list[tuple[str, ...]] = [("CLUSTER", "GPU POOL", *(u.upper() for u in POOL_USES))]
    for c in status.clusters:
        for pool, uses in sorted((c.remediator.gpu_pools if c.remediator else {}).items()):
            rows.append((c.name, pool, *(f"{uses.get(u, (0, 0))[0]}/{uses.get(u, (0, 0))[1]}" for u in POOL_USES)))
    if len(rows) == 1:
        return []
    return ["", "GPU pools, nodes/GPUs by use:", *_aligned(rows)]


# --- the exporter ----------------------------------------------------------------------------------------------


class FleetCollector:
    """A prometheus_client collector that reads the fleet on every scrape (no cache: the numbers are the
    cluster's now). Overlapping scrapes take turns: never two reads at once."""

    def __init__(self, read: Callable[[], FleetStatus]) -> None:
        self._read = read
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # collected on scrape; registering must not read the fleet

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            status = self._read()
        yield from metrics(status)


def metrics(status: FleetStatus) -> Iterator[Metric]:
    """The fleet's metrics (docs/metrics.md, section "Fleet")."""
    from prometheus_client.core import GaugeMetricFamily

    up = GaugeMetricFamily(
        "fleetheal_fleet_cluster_up", "1 when the cluster's controller answered.", labels=["cluster"]
    )
    gpus = GaugeMetricFamily(
        "fleetheal_fleet_gpus",
        "GPUs by cluster, GPU type and state (allocated, free, unavailable: idle on a node that takes no jobs).",
        labels=["cluster", "gpu_type", "state"],
    )
    nodes = GaugeMetricFamily("fleetheal_fleet_nodes", "Nodes by cluster and state.", labels=["cluster", "state"])
    jobs = GaugeMetricFamily(
        "fleetheal_fleet_jobs", "Jobs by cluster, state (pending, running) and QOS.", labels=["cluster", "state", "qos"]
    )
    job_gpus = GaugeMetricFamily(
        "fleetheal_fleet_job_gpus",
        "GPUs that pending jobs ask for and running jobs hold, by cluster, state and QOS.",
        labels=["cluster", "state", "qos"],
    )
    rem_up = GaugeMetricFamily(
        "fleetheal_fleet_remediator_up", "1 when the cluster's remediator answered.", labels=["cluster"]
    )
    standby = GaugeMetricFamily(
        "fleetheal_fleet_standby_nodes", "Nodes in the cluster's warm-standby pool.", labels=["cluster"]
    )
    incidents = GaugeMetricFamily(
        "fleetheal_fleet_open_incidents", "The cluster's incidents not yet done or failed.", labels=["cluster"]
    )
    for c in status.clusters:
        up.add_metric([c.name], int(c.up))
        if c.up:
            for kind, g in c.gpus.items():
                for state in GPU_STATES:
                    gpus.add_metric([c.name, kind, state], getattr(g, state))
            for state in NODE_STATES:
                nodes.add_metric([c.name, state], c.nodes.get(state, 0))
            for qos, q in c.queue_by_qos.items():
                jobs.add_metric([c.name, "pending", qos], q.pending)
                jobs.add_metric([c.name, "running", qos], q.running)
                job_gpus.add_metric([c.name, "pending", qos], q.pending_gpus)
                job_gpus.add_metric([c.name, "running", qos], q.running_gpus)
        if c.remediator is not None:
            rem_up.add_metric([c.name], int(c.remediator.up))
            if c.remediator.standby_nodes is not None:
                standby.add_metric([c.name], c.remediator.standby_nodes)
            if c.remediator.open_incidents is not None:
                incidents.add_metric([c.name], c.remediator.open_incidents)
    yield from (up, gpus, nodes, jobs, job_gpus, rem_up, standby, incidents)
    yield GaugeMetricFamily(
        "fleetheal_fleet_read_duration_seconds", "Time the last read of the fleet took.", status.duration_s
    )


def registry(read: Callable[[], FleetStatus]) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(read))
    return reg
