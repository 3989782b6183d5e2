"""The agent's metrics endpoint against the clients a node's network can send it (issue 46): a flood of idle
connections, a slow client, malformed requests. Real sockets on loopback, the real server, a real HTTP client."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetheal.agent.metrics import AgentMetrics
from fleetheal.agent.outputs import Exporter
from fleetheal.contracts import AGENT_READY_PATH


@pytest.fixture
def endpoint():
    metrics = AgentMetrics(process=False)
    metrics.gpu_count.labels("n1").set(8)
    exporter = Exporter(metrics, "n1")
    exporter.serve("127.0.0.1", _free_port(), max_connections=32, header_timeout_s=1.0)
    yield exporter._http.port, metrics
    exporter.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, timeout: float = 5.0, **headers: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_scrape_reads_every_series_in_either_format(endpoint):
    port, _ = endpoint
    status, headers, body = _scrape(port)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["fleetheal_agent_gpu_count"].samples[0].value == 8
    status, headers, body = _scrape(port, Accept="application/openmetrics-text; version=1.0.0")
    assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    status, headers, body = _scrape(port, **{"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and b"fleetheal_agent_gpu_count" in gzip.decompress(body)


def test_the_readiness_probe_path_answers(endpoint):
    """The DaemonSet's readiness probe asks this path of the metrics port (fleetheal/infra/agent.py)."""
    port, _ = endpoint
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{AGENT_READY_PATH}", timeout=5) as r:
        assert (r.status, r.read()) == (200, b"ok\n")


def test_a_flood_of_idle_connections_does_not_stop_the_scrapes(endpoint):
    """The attack: any peer on the node's network opens connections and sends nothing. prometheus_client's
    server gave each a thread with no read timeout and listened with a backlog of 5; after such a flood a scrape
    timed out at 30 s. Now the endpoint holds at most `max_connections`, evicting the one that has waited longest,
    and its threads do not grow."""
    port, metrics = endpoint
    threads = threading.active_count()
    idle = []
    try:
        for _ in range(1500):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        started = time.monotonic()
        status, _, body = _scrape(port, timeout=10)
        took = time.monotonic() - started
        assert status == 200 and b"fleetheal_agent_gpu_count" in body, took
        assert threading.active_count() <= threads
        assert _value(metrics, "fleetheal_agent_metrics_connections_open") <= 32
        assert _value(metrics, "fleetheal_agent_metrics_connections_closed_total", reason="evicted") > 1000
    finally:
        for s in idle:
            s.close()


def test_a_client_that_sends_its_request_slowly_is_closed_at_the_deadline(endpoint):
    port, metrics = endpoint
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 8:
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            s.settimeout(0.3)
            try:
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:
                closed = True
                break
        assert closed, "a slow client kept its connection past the deadline"
        assert time.monotonic() - started < 5
    assert _value(metrics, "fleetheal_agent_metrics_connections_closed_total", reason="header_timeout") == 1


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"GET /admin HTTP/1.1\r\n\r\n", 404),
        (b"nonsense\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (20 << 10), 431),
    ],
)
def test_a_malformed_request_gets_an_error_and_the_endpoint_goes_on(endpoint, request_bytes, status):
    port, _ = endpoint
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request_bytes)
        answer = s.recv(1024)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert _scrape(port)[0] == 200
