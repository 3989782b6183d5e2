"""The fleet at a glance, read: the model of `fleetheal fleet status`, built from two Slurm reads and the
remediators' numbers (fleetheal.fleet.render shows it, fleetheal.fleet.status is the command).

For every cluster of the fleet file: whether its controller answers, free and total GPUs by GPU type,
nodes by state, the queue (pending and running jobs, the GPUs pending jobs ask for; by QOS), and, from
the cluster's remediator, the standby pool and the open incidents. `as_dict` is the JSON document for
programs (`status --json`).

Two Slurm reads for the whole fleet, whatever its size: `sinfo -M all` (fleetheal.slurm.nodes's node
read, plus the `Gres` and `GresUsed` fields) and `squeue -M all`, run side by side. With `-M` each client
prints one `CLUSTER: <name>` section per cluster it reached and only that cluster's own jobs (the origin's
REVOKED copy of a job that runs elsewhere is not PENDING or RUNNING, so it is not counted). A cluster of
the fleet file that has no section, or an empty node section, is unreachable: the view shows it as such
and goes on. A federated job pending on several siblings counts once in each sibling's queue (it *is* in
each) and once in the fleet total (deduplicated by job id, which the federation keeps across siblings).

The remediator's numbers come from its `GET /metrics` (no authentication, like `/healthz`; docs/remediator.md):
`fleetheal_remediator_nodes{state="standby"}` and `fleetheal_remediator_incidents` in the states that are not
done or failed. A cluster without `remediator_url` shows `-`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetheal.slurm.fields import sections
from fleetheal.slurm.gres import parse_gres
from fleetheal.slurm.jobs import FLEET_SQUEUE_ARGS, QueuedJob, parse_queue
from fleetheal.slurm.nodes import FLEET_SINFO_ARGS, node_state, with_gres
from fleetheal.slurm.runner import Read, Runner

if TYPE_CHECKING:
    from fleetheal.fleet.config import FleetConfig

#: Node states of the view, in table order.
NODE_STATES = ("idle", "mixed", "allocated", "drained", "down", "other")
#: Incident states that are finished (fleetheal.remediator.store.TERMINAL); the others are open.
_FINISHED_INCIDENTS = frozenset({"done", "failed"})
DEFAULT_TIMEOUT_S = 20.0


# --- the view --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpus:
    allocated: int = 0
    free: int = 0
    unavailable: int = 0

    @property
    def total(self) -> int:
        return self.allocated + self.free + self.unavailable

    def __add__(self, other: Gpus) -> Gpus:
        return Gpus(self.allocated + other.allocated, self.free + other.free, self.unavailable + other.unavailable)

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "free": self.free, "allocated": self.allocated, "unavailable": self.unavailable}


@dataclass(frozen=True)
class Queue:
    pending: int = 0
    running: int = 0
    pending_gpus: int = 0
    running_gpus: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "pending": self.pending,
            "running": self.running,
            "pending_gpus": self.pending_gpus,
            "running_gpus": self.running_gpus,
        }


def queue_of(jobs: Iterable[QueuedJob]) -> Queue:
    pending = running = pending_gpus = running_gpus = 0
    for j in jobs:
        if j.state == "pending":
            pending, pending_gpus = pending + 1, pending_gpus + j.gpus
        else:
            running, running_gpus = running + 1, running_gpus + j.gpus
    return Queue(pending, running, pending_gpus, running_gpus)


def by_qos(jobs: Iterable[QueuedJob], always: Sequence[str] = ()) -> dict[str, Queue]:
    """The queue of each QOS: those in `always` (the large and small queues) even when empty, then any other."""
    groups: dict[str, list[QueuedJob]] = {q: [] for q in always}
    for j in jobs:
        groups.setdefault(j.qos, []).append(j)
    return {q: queue_of(js) for q, js in groups.items()}


@dataclass(frozen=True)
class Remediator:
    """What a cluster's remediator reports; `up` False with the `error` when it did not answer."""

    url: str
    up: bool
    standby_nodes: int | None = None
    open_incidents: int | None = None
    error: str = ""
    #: GPU pool -> use -> (nodes, GPUs), from its lending controller (`remediator_pools`); empty without one.
    gpu_pools: Mapping[str, Mapping[str, tuple[int, int]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "standby_nodes": self.standby_nodes,
            "open_incidents": self.open_incidents,
            "gpu_pools": {
                pool: {use: {"nodes": n, "gpus": g} for use, (n, g) in uses.items()}
                for pool, uses in self.gpu_pools.items()
            },
            "error": self.error,
        }


@dataclass(frozen=True)
class ClusterStatus:
    name: str
    up: bool
    error: str = ""
    #: GPUs by GPU type.
    gpus: Mapping[str, Gpus] = field(default_factory=dict)
    #: Nodes by NODE_STATES.
    nodes: Mapping[str, int] = field(default_factory=dict)
    jobs: tuple[QueuedJob, ...] = ()
    #: QOS names shown even without jobs (the fleet file's large and small queues).
    qos_names: tuple[str, ...] = ()
    #: None when the fleet file names no remediator for the cluster.
    remediator: Remediator | None = None

    @property
    def queue(self) -> Queue:
        return queue_of(self.jobs)

    @property
    def queue_by_qos(self) -> dict[str, Queue]:
        return by_qos(self.jobs, self.qos_names)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "up": self.up,
            "error": self.error,
            "gpus": {t: g.as_dict() for t, g in sorted(self.gpus.items())} if self.up else None,
            "nodes": dict(self.nodes) if self.up else None,
            "queue": self.queue.as_dict() if self.up else None,
            "queue_by_qos": {q: c.as_dict() for q, c in self.queue_by_qos.items()} if self.up else None,
            "remediator": self.remediator.as_dict() if self.remediator is not None else None,
        }


@dataclass(frozen=True)
class FleetStatus:
    federation: str
    clusters: tuple[ClusterStatus, ...]
    qos_names: tuple[str, ...] = ()
    #: Seconds the reads took.
    duration_s: float = 0.0

    @property
    def up(self) -> tuple[ClusterStatus, ...]:
        return tuple(c for c in self.clusters if c.up)

    @property
    def gpus(self) -> dict[str, Gpus]:
        total: dict[str, Gpus] = {}
        for c in self.up:
            for t, g in c.gpus.items():
                total[t] = total.get(t, Gpus()) + g
        return dict(sorted(total.items()))

    @property
    def nodes(self) -> dict[str, int]:
        return {s: sum(c.nodes.get(s, 0) for c in self.up) for s in NODE_STATES}

    @property
    def jobs(self) -> tuple[QueuedJob, ...]:
        """Every job once: a federated job pending on several siblings, or running on one of them, counts once."""
        seen: dict[str, QueuedJob] = {}
        for c in self.up:
            for j in c.jobs:
                if j.id not in seen or j.state == "running":
                    seen[j.id] = j
        return tuple(seen.values())

    def remediator_total(self, what: str) -> int | None:
        values = [getattr(c.remediator, what) for c in self.clusters if c.remediator is not None]
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    def as_dict(self) -> dict[str, Any]:
        jobs = self.jobs
        return {
            "federation": self.federation,
            "clusters": [c.as_dict() for c in self.clusters],
            "total": {
                "clusters": len(self.clusters),
                "clusters_up": len(self.up),
                "gpus": {t: g.as_dict() for t, g in self.gpus.items()},
                "nodes": self.nodes,
                "queue": queue_of(jobs).as_dict(),
                "queue_by_qos": {q: c.as_dict() for q, c in by_qos(jobs, self.qos_names).items()},
                "standby_nodes": self.remediator_total("standby_nodes"),
                "open_incidents": self.remediator_total("open_incidents"),
            },
            "duration_s": round(self.duration_s, 3),
        }


# --- parsing what Slurm printed -----------------------------------------------------------------------------


def parse_nodes(text: str, default_type: str = "") -> tuple[dict[str, int], dict[str, Gpus]]:
    """One cluster's section of `sinfo FLEET_SINFO_ARGS` (fleetheal.slurm.nodes): nodes by state, GPUs by type
    and state."""
    nodes: dict[str, int] = dict.fromkeys(NODE_STATES, 0)
    gpus: dict[str, Gpus] = {}
    for node, gres, used in with_gres(text):
        state = node_state(node)
        nodes[state] += 1
        in_use = parse_gres(used, default_type)
        usable = state in ("idle", "mixed", "allocated")  # not drained, down, FUTURE or not yet registered
        for kind, total in parse_gres(gres, default_type).items():
            busy = min(in_use.get(kind, 0), total)
            rest = total - busy
            gpus[kind] = gpus.get(kind, Gpus()) + Gpus(busy, rest if usable else 0, 0 if usable else rest)
    return nodes, dict(sorted(gpus.items()))


# --- the remediator ----------------------------------------------------------------------------------------


def remediator_numbers(metrics_text: str) -> tuple[int | None, int | None]:
    """(standby nodes, open incidents) from a remediator's `/metrics`; None for a number it does not export."""
    from prometheus_client.parser import text_string_to_metric_families

    standby: int | None = None
    incidents: int | None = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "fleetheal_remediator_nodes":
            for s in family.samples:
                if s.labels.get("state") == "standby":
                    standby = (standby or 0) + int(s.value)
        elif family.name == "fleetheal_remediator_incidents":
            incidents = incidents or 0
            for s in family.samples:
                if s.labels.get("state") not in _FINISHED_INCIDENTS:
                    incidents += int(s.value)
    return standby, incidents


def remediator_pools(metrics_text: str) -> dict[str, dict[str, tuple[int, int]]]:
    """GPU pool -> use -> (nodes, GPUs) from a remediator's `/metrics` (fleetheal_remediator_gpu_pool_nodes and
    _gpus, which its lending controller sets each round); empty when it exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    cells: dict[tuple[str, str], list[int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        column = {"fleetheal_remediator_gpu_pool_nodes": 0, "fleetheal_remediator_gpu_pool_gpus": 1}.get(family.name)
        if column is None:
            continue
        for s in family.samples:
            cells.setdefault((s.labels.get("gpu_pool", ""), s.labels.get("use", "")), [0, 0])[column] = int(s.value)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for (pool, use), (nodes, gpus) in sorted(cells.items()):
        out.setdefault(pool, {})[use] = (nodes, gpus)
    return out


def read_remediator(url: str, timeout: float = 5.0) -> Remediator:
    """The standby pool and open incidents of the remediator at `url`; `up` False, with why, when it fails."""
    import urllib.error
    import urllib.request

    metrics_url = url.rstrip("/") + "/metrics"
    if not metrics_url.startswith(("http://", "https://")):
        return Remediator(url, False, error=f"not an HTTP URL: {url}")
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:  # noqa: S310 - the scheme is checked above
            text = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return Remediator(url, False, error=f"HTTP {exc.code} from {metrics_url}")
    except (OSError, ValueError) as exc:
        return Remediator(url, False, error=f"{metrics_url}: {getattr(exc, 'reason', exc)}")
    try:
        standby, incidents = remediator_numbers(text)
        pools = remediator_pools(text)
    except ValueError as exc:
        return Remediator(url, False, error=f"{metrics_url}: not Prometheus text ({exc})")
    return Remediator(url, True, standby, incidents, gpu_pools=pools)


# --- collecting ------------------------------------------------------------------------------------------


def _one_cluster(args: Sequence[str], name: str) -> list[str]:
    """FLEET_SINFO_ARGS/FLEET_SQUEUE_ARGS for cluster `name` only (`-M name`, the CLUSTER line kept)."""
    out = list(args)
    out[out.index("-M") + 1] = name
    return out


def read_cluster(
    cfg: FleetConfig,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> ClusterStatus:
    """One cluster of the fleet, read as `collect` reads every cluster (no remediator)."""
    slurm = Runner(env=env, timeout_s=timeout)
    nodes_read = slurm.read("sinfo", *_one_cluster(FLEET_SINFO_ARGS, name))
    jobs_read = slurm.read("squeue", *_one_cluster(FLEET_SQUEUE_ARGS, name))
    view = build(cfg, nodes_read, jobs_read)
    return next(c for c in view.clusters if c.name == name)


def build(
    cfg: FleetConfig,
    nodes_read: Read,
    jobs_read: Read,
    remediators: Mapping[str, Remediator] | None = None,
    duration_s: float = 0.0,
) -> FleetStatus:
    """The view from what `sinfo FLEET_SINFO_ARGS` and `squeue FLEET_SQUEUE_ARGS` printed and what the
    remediators said."""
    remediators = remediators or {}
    node_sections = sections(nodes_read.out)
    job_sections = sections(jobs_read.out)
    qos_names = tuple(dict.fromkeys((cfg.queues.large_qos, cfg.queues.small_qos)))
    clusters = []
    for name, ccfg in cfg.clusters.items():
        rem = remediators.get(name)
        if ccfg.remediator_url and rem is None:
            rem = Remediator(ccfg.remediator_url, False, error="not read")
        text = node_sections.get(name, "")
        nodes, gpus = parse_nodes(text, ccfg.gpu_type or "gpu")
        if not sum(nodes.values()):
            why = nodes_read.error or ("no nodes" if name in node_sections else "not in the answer of sinfo -M all")
            clusters.append(ClusterStatus(name, False, error=why, qos_names=qos_names, remediator=rem))
            continue
        if name not in job_sections:  # a cluster that answers has a section, if only its column titles
            why = jobs_read.error or "not in the answer of squeue -M all"
            clusters.append(ClusterStatus(name, False, error=why, qos_names=qos_names, remediator=rem))
            continue
        jobs = parse_queue(job_sections.get(name, ""))
        clusters.append(ClusterStatus(name, True, "", gpus, nodes, jobs, qos_names, rem))
    return FleetStatus(cfg.federation, tuple(clusters), qos_names, duration_s)


def collect(
    cfg: FleetConfig,
    *,
    env: Mapping[str, str] | None = None,
    sinfo: str = "sinfo",
    squeue: str = "squeue",
    timeout: float = DEFAULT_TIMEOUT_S,
) -> FleetStatus:
    """Read the fleet now: both Slurm reads and every remediator at once."""
    t0 = time.monotonic()
    urls = {n: c.remediator_url for n, c in cfg.clusters.items() if c.remediator_url}
    with ThreadPoolExecutor(max_workers=2 + len(urls), thread_name_prefix="fleet-status") as pool:
        slurm = Runner(env=env, timeout_s=timeout)
        nodes_f = pool.submit(slurm.read, sinfo, *FLEET_SINFO_ARGS)
        jobs_f = pool.submit(slurm.read, squeue, *FLEET_SQUEUE_ARGS)
        rem_f: dict[str, Future[Remediator]] = {
            n: pool.submit(read_remediator, u, min(timeout, 5.0)) for n, u in urls.items()
        }
        nodes_read, jobs_read = nodes_f.result(), jobs_f.result()
        remediators = {n: f.result() for n, f in rem_f.items()}
    return build(cfg, nodes_read, jobs_read, remediators, time.monotonic() - t0)
