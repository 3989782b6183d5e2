"""What the agent publishes besides its log: the Prometheus exporter and the health file.

`Exporter` serves the metrics endpoint and keeps the per-GPU and per-rank series in step with what the
service sees (only changed values are written; series of forgotten ranks are removed). `HealthFile` holds
"ok" or the id of the fault that makes the node unhealthy, for whoever cannot scrape (a prolog, a probe).
The service (fleetheal.agent.service) calls both under its lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetheal.agent.backends import GpuSample
from fleetheal.agent.health import ActiveFault
from fleetheal.agent.training import Report
from fleetheal.contracts import JOB_OUTPUT_SOURCE

if TYPE_CHECKING:
    from fleetheal.agent.metrics import AgentMetrics

log = logging.getLogger("fleetheal.agent")


class Exporter:
    """The agent's Prometheus series of GPUs and training ranks on `node`, and the endpoint serving them."""

    def __init__(self, metrics: AgentMetrics, node: str) -> None:
        self.metrics = metrics
        self.node = node
        #: GPU labels seen so far ("0".."N"), whose health gauges follow every change.
        self.gpu_labels: set[str] = set()
        self._children: dict[int, dict[str, Any]] = {}
        self._exported: dict[int, dict[str, float]] = {}
        self._training_series: set[tuple[str, str]] = set()
        self._suspects: set[tuple[str, str]] = set()
        self._http: Any = None

    def serve(self, listen: str, port: int) -> None:
        """Start the metrics endpoint (port 0: none)."""
        if port:
            from prometheus_client import start_http_server

            self._http, _ = start_http_server(port, listen, registry=self.metrics.registry)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def sample(self, s: GpuSample, health: Callable[[str], int]) -> None:
        """Raw counters to their gauges; only values that changed are written (most never do)."""
        gpu = str(s.index)
        children = self._children.get(s.index)
        if children is None:
            children = self._children[s.index] = self.metrics.gpu_children(self.node, gpu)
            self.gpu_labels.add(gpu)
            self.metrics.health.labels(self.node, gpu).set(health(gpu))
        last = self._exported.setdefault(s.index, {})
        for key, value in s.values.items():
            if last.get(key) != value:
                child = children.get(key)
                if child is not None:
                    child.set(value)
                last[key] = value

    def report(self, report: Report, last_progress: float | None) -> None:
        """One training report's step, step time, loss and last progress (an end removes the rank)."""
        job, rank = report.job, str(report.rank)
        m = self.metrics
        if report.end:
            self.drop_rank(job, rank)
            return
        self._training_series.add((job, rank))
        m.training_step.labels(self.node, job, rank).set(report.step)
        if report.step_time is not None:
            m.training_step_time.labels(self.node, job, rank).set(report.step_time)
        if report.loss is not None:
            m.training_loss.labels(self.node, job, rank).set(report.loss)
        if last_progress is not None:
            m.training_progress.labels(self.node, job, rank).set(last_progress)

    def drop_rank(self, job: str, rank: str) -> None:
        m = self.metrics
        for g in (m.training_step, m.training_step_time, m.training_loss, m.training_progress, m.hang_suspect):
            with contextlib.suppress(KeyError):
                g.remove(self.node, job, rank)
        self._training_series.discard((job, rank))
        self._suspects.discard((job, rank))

    def suspects(self, current: set[tuple[str, str]], tracked: Collection[tuple[str, str]]) -> None:
        """Hang suspects now (job, rank); ranks no longer `tracked` lose their series."""
        for job, rank in self._suspects - current:
            with contextlib.suppress(KeyError):
                self.metrics.hang_suspect.remove(self.node, job, rank)
        for job, rank in current - self._suspects:
            self.metrics.hang_suspect.labels(self.node, job, rank).set(1)
            log.warning("training hang: suspect named", extra={"job": job, "rank": rank, "node": self.node})
        self._suspects = current
        for job, rank in self._training_series - set(tracked):
            self.drop_rank(job, rank)


class HealthFile:
    """`path` holds "ok", or the id of an active fault whose action is one of `drain_actions`."""

    def __init__(self, path: str, drain_actions: Collection[str]) -> None:
        self.path = path
        self.drain_actions = drain_actions
        self._written: str | None = None

    def write(self, active: Iterable[ActiveFault]) -> None:
        """Replace the file atomically when its text changes ("" path: nothing to do)."""
        if not self.path:
            return
        # A fault only a job's output claims never drains the node (Slurm's health check reads this file).
        bad = [a for a in active if a.fault.action in self.drain_actions and a.source != JOB_OUTPUT_SOURCE]
        text = bad[0].fault.id if bad else "ok"
        if text == self._written:
            return
        p = Path(self.path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, p)
            self._written = text
        except OSError as exc:
            log.error("cannot write the health file", extra={"path": self.path, "error": str(exc)})
