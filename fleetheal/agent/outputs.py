"""What the agent publishes besides its log: the Prometheus exporter and the health file.

`Exporter` serves the metrics endpoint (`MetricsServer`) and keeps the per-GPU and per-rank series in step with what the
service sees (only changed values are written; series of forgotten ranks are removed). `HealthFile` holds
"ok" or the id of the fault that makes the node unhealthy, for whoever cannot scrape (a prolog, a probe).
The service (fleetheal.agent.service) calls both under its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import choose_encoder

from fleetheal.agent.backends import GpuSample
from fleetheal.agent.health import ActiveFault
from fleetheal.agent.training import Report
from fleetheal.connguard import ConnectionGuard
from fleetheal.contracts import AGENT_READY_PATH, JOB_OUTPUT_SOURCE

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

    def serve(self, listen: str, port: int, max_connections: int, header_timeout_s: float) -> None:
        """Start the metrics endpoint (port 0: none); OSError when it cannot listen."""
        if port:
            self._http = MetricsServer(self.metrics, max_connections, header_timeout_s)
            self._http.start(listen, port)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
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


#: The longest request head the metrics endpoint reads (a scrape's is a few hundred bytes).
MAX_REQUEST_HEAD = 16 << 10


class MetricsServer:
    """The agent's Prometheus endpoint: one thread with an asyncio loop, every connection behind the shared
    ConnectionGuard (fleetheal/connguard.py): at most `max_connections`, each with `header_timeout_s` to send
    its request head and as long again to take the answer; one answer per connection. prometheus_client's own
    server (a thread per connection, no read timeout, a listen backlog of 5) let a flood of idle connections
    from any peer of the node cut accepts to a few a second and time the scrapes out (issue 46)."""

    def __init__(self, metrics: AgentMetrics, max_connections: int, header_timeout_s: float) -> None:
        self.metrics = metrics
        self.guard = ConnectionGuard(max_connections, header_timeout_s, metrics)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, listen: str, port: int) -> None:
        loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(
                loop.create_server(self.guard.wrap(lambda: _MetricsProtocol(self)), listen or None, port, backlog=1024)
            )
        except OSError:
            loop.close()
            raise
        self.port = server.sockets[0].getsockname()[1]
        self._loop = loop
        self._thread = threading.Thread(target=self._run, args=(server,), name="metrics-http", daemon=True)
        self._thread.start()

    def _run(self, server: asyncio.Server) -> None:
        assert self._loop is not None
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self.guard.abort_all()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def close(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = self._thread = None

    def answer(self, head: bytes) -> bytes:
        """The whole HTTP response to one request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _response(405, b"GET /metrics\n")
        if target == AGENT_READY_PATH:  # the DaemonSet's readiness probe: the endpoint answers
            return _response(200, b"" if method == "HEAD" else b"ok\n", length=3)
        if target not in ("/", "/metrics"):
            return _response(404, b"GET /metrics\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.metrics.registry)
        extra = {}
        if "gzip" in headers.get("accept-encoding", ""):
            body, extra = gzip.compress(body, compresslevel=1), {"Content-Encoding": "gzip"}
        return _response(200, b"" if method == "HEAD" else body, content_type, len(body), extra)


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    length: int | None = None,
    extra: dict[str, str] | None = None,
) -> bytes:
    reason = {
        200: "OK",
        400: "Bad Request",
        404: "Not Found",
        405: "Method Not Allowed",
        431: "Request Header Fields Too Large",
        500: "Internal Server Error",
    }[status]
    head = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body) if length is None else length}",
        "Connection: close",
    ]
    head += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _MetricsProtocol(asyncio.Protocol):
    """One connection to the metrics endpoint: its request head, then one answer, then close."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP stream transport

    def data_received(self, data: bytes) -> None:
        if self.answered or self.transport is None:
            return
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0 and len(self.head) <= MAX_REQUEST_HEAD:
            return
        self.answered = True
        with self.server.guard.serving(self.transport):  # its head is in: no deadline while it is answered
            if end < 0:
                response = _response(431, b"request head too large\n")
            else:
                try:
                    response = self.server.answer(bytes(self.head[:end]))
                except Exception:  # a bug must not kill the endpoint's loop
                    log.exception("metrics endpoint: cannot answer")
                    response = _response(500, b"cannot answer\n")
            self.transport.write(response)
        # Closed once it is sent; a client that does not read it is aborted by the guard's deadline.
        self.transport.close()
