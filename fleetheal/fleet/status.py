"""The fleet at a glance: `fleetheal fleet status` and `fleetheal fleet exporter`.

For every cluster of the fleet file: whether its controller answers, free and total GPUs by GPU type,
nodes by state, the queue (pending and running jobs, the GPUs pending jobs ask for; by QOS), and, from
the cluster's remediator, the standby pool and the open incidents. One table for people (`status`), one
JSON document for programs (`status --json`), and the same numbers as Prometheus metrics collected on
each scrape (`exporter`; docs/metrics.md, section "Fleet").

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

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetheal.errors import UsageError
from fleetheal.slurm import nodes as slurm_nodes
from fleetheal.slurm.fields import sections
from fleetheal.slurm.gres import parse_gres
from fleetheal.slurm.jobs import FLEET_SQUEUE_ARGS, QueuedJob, parse_queue
from fleetheal.slurm.nodes import FLEET_SINFO_ARGS, node_state
from fleetheal.slurm.runner import Read, Runner

if TYPE_CHECKING:
    from prometheus_client.core import Metric
    from prometheus_client.registry import CollectorRegistry

    from fleetheal.fleet.config import FleetConfig

#: Node states of the view, in table order.
NODE_STATES = ("idle", "mixed", "allocated", "drained", "down", "other")
#: GPU states: in use by jobs; usable now; idle on a node that takes no jobs (drained, down, UNKNOWN...).
GPU_STATES = ("allocated", "free", "unavailable")
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "standby_nodes": self.standby_nodes,
            "open_incidents": self.open_incidents,
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
    for node, gres, used in slurm_nodes.with_gres(text):
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
    except ValueError as exc:
        return Remediator(url, False, error=f"{metrics_url}: not Prometheus text ({exc})")
    return Remediator(url, True, standby, incidents)


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
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines + notes) + "\n"


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


# --- the command ---------------------------------------------------------------------------------------------


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"HOST:PORT, e.g. 127.0.0.1:9106, got {text!r}")
    return host.strip("[]"), int(port)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _config(args: argparse.Namespace) -> FleetConfig:
    from fleetheal.fleet.config import load
    from fleetheal.settings import ConfigError

    try:
        return load(args.fleet)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def cmd_status(args: argparse.Namespace) -> int:
    status = collect(_config(args), timeout=args.timeout)
    if args.json:
        json.dump(status.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(status))
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from fleetheal import logs

    logs.setup_logging("info")
    cfg = _config(args)
    host, port = args.listen
    try:
        server, thread = start_http_server(port, host, registry=registry(lambda: collect(cfg, timeout=args.timeout)))
    except OSError as exc:
        raise UsageError(f"--listen {host}:{port}: {exc.strerror or exc}") from exc
    log = logging.getLogger("fleetheal.fleet")
    log.info(
        "fleet exporter listening",
        extra={"url": f"http://{host}:{server.server_port}/metrics", "clusters": len(cfg.clusters)},
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    log.info("fleet exporter stopping")
    server.shutdown()
    server.server_close()
    thread.join(5.0)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse._SubParsersAction[Any]:
    """Add `fleetheal fleet` with `status` and `exporter`; return the fleet subparsers (fleetheal.cli mounts
    the other `fleet` subcommands there)."""
    p = sub.add_parser(
        "fleet",
        help="the clusters of a Slurm federation as one fleet",
        description="The fleet of clusters in the fleet file (docs/fleet.md).",
    )
    fsub = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--fleet", metavar="FILE", help="the fleet file (default: $FLEETHEAL_FLEET_CONFIG)")
    common.add_argument(
        "--timeout",
        type=_positive,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds one Slurm read may take (default {DEFAULT_TIMEOUT_S:g})",
    )
    s = fsub.add_parser(
        "status",
        parents=[common],
        help="clusters, GPUs, nodes, queues, standby pools and open incidents",
        description=(
            "Every cluster of the fleet file: reachable or not, free/total GPUs by type, nodes by state, "
            "pending and running jobs (by QOS), pending GPUs, the remediator's standby pool and open incidents."
        ),
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s.set_defaults(func=cmd_status)
    e = fsub.add_parser(
        "exporter",
        parents=[common],
        help="serve the fleet status as Prometheus metrics",
        description="Serve /metrics; every scrape reads the fleet (docs/metrics.md, section Fleet).",
    )
    e.add_argument(
        "--listen", type=_listen, default=("127.0.0.1", 9106), metavar="HOST:PORT", help="default 127.0.0.1:9106"
    )
    e.set_defaults(func=cmd_exporter)
    return fsub
