"""End to end: an exporter's fault gauge -> real Prometheus (the generated alert rules) -> real Alertmanager
(bearer auth) -> the remediator -> the mapped playbook via ansible-runner; then the fault clears and the
resolved alert lands on the same incident.

A prometheus-client exporter in the test stands in for the agent (it exports the agent's gauge with the
agent's labels); Prometheus adds the `cluster` label as an external label.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from fleetheal.contracts import METRIC_FAULT_ACTIVE
from fleetheal.lab.monitoring import Monitoring, available, free_port
from fleetheal.remediator.store import Store
from fleetheal.wait import wait_until
from tests.remediator.conftest import TOKEN
from tests.remediator.test_app import start_server, stop_server, write_config

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "policies" / "alert-rules.yml"

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not available(), reason="prometheus and prometheus-alertmanager are not installed"),
]


def _wait(what, predicate, timeout):
    return wait_until(predicate, timeout, what)


def _exporter():
    """A prometheus-client exporter of the agent's fault gauge (the test's stand-in for the agent)."""
    registry = CollectorRegistry()
    gauge = Gauge(
        METRIC_FAULT_ACTIVE,
        "1 while a fault is active (test exporter standing in for the agent)",
        ["node", "gpu", "fault_id", "class", "action", "severity"],
        registry=registry,
    )
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return gauge, port, server, thread


def _monitoring(tmp_path, exporter_port, remediator_port):
    """Real Prometheus (the generated rules) and Alertmanager (bearer auth to the remediator), not started."""
    return Monitoring(
        tmp_path / "monitoring",
        scrape_targets=[f"127.0.0.1:{exporter_port}"],
        rules_files=[RULES],
        webhook_url=f"http://127.0.0.1:{remediator_port}/webhook",
        webhook_token=TOKEN,
        cluster="lab",
        scrape_interval="500ms",
        evaluation_interval="500ms",
    )


def test_a_fault_reaches_the_remediator_through_prometheus_and_alertmanager(tmp_path):
    gauge, exporter_port, server, thread = _exporter()

    port = free_port()
    config = write_config(tmp_path, port)
    proc, _, log = start_server(tmp_path, config, port)
    mon = _monitoring(tmp_path, exporter_port, port)
    try:
        mon.start()
        labels = {"node": "gpu-001", "gpu": "3", "fault_id": "xid-79", "class": "hardware",
                  "action": "ISOLATE_AND_RELOCATE", "severity": "critical"}  # fmt: skip
        t0 = time.time()
        gauge.labels(**labels).set(1)
        fired = mon.wait_for_alert("FleethealXid79", timeout=30)
        assert fired["labels"]["node"] == "gpu-001"
        # Prometheus adds its external label `cluster` when it sends the alert to Alertmanager.
        held = _wait("Alertmanager to hold the alert", mon.alertmanager_alerts, 30)
        assert held[0]["labels"]["cluster"] == "lab" and held[0]["labels"]["fault_id"] == "xid-79"

        store = Store(str(tmp_path / "remediator.sqlite"))
        _wait("the incident to finish", lambda: (i := store.get(1)) is not None and i.state in ("done", "failed"), 90)
        inc = store.get(1)
        assert inc.state == "done", inc
        assert (inc.node, inc.gpu, inc.fault_id, inc.fault_class, inc.action, inc.severity, inc.cluster) == (
            "gpu-001", "3", "xid-79", "hardware", "ISOLATE_AND_RELOCATE", "critical", "lab",
        )  # fmt: skip
        assert inc.alertname == "FleethealXid79"
        steps = store.steps(1)
        assert [(s.name, s.result) for s in steps] == [
            ("receive", "ok"),
            ("classify", "ok"),
            ("gate", "allow"),
            ("playbook", "successful"),
        ]
        for earlier, later in itertools.pairwise(steps):
            assert earlier.ended_at <= later.started_at + 1e-6
        assert steps[0].started_at >= t0 - 2  # the alert's startsAt: when Prometheus saw the fault
        kinds = [e.kind for e in store.events(1)]
        assert kinds[:2] == ["process", "playbook_start"] and "task_changed" in kinds and kinds[-1] == "stats"
        # The playbook was asked for exactly this, with the contract variables only.
        runs = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
        assert [r["phase"] for r in runs] == ["start", "finish"]
        assert runs[0]["node"] == "gpu-001" and runs[0]["gpu"] == "3" and runs[0]["action"] == "ISOLATE_AND_RELOCATE"
        assert runs[0]["cluster"] == "lab" and runs[0]["incident"] == "inc-000001"
        assert "gpu-001" in store.isolations()

        # The CLI shows the same timeline with the duration of each phase.
        shown = subprocess.run(
            [sys.executable, "-m", "fleetheal", "incidents", "show", "inc-000001", "--json", "--config", str(config)],
            capture_output=True, text=True, check=True, cwd=REPO,
        )  # fmt: skip
        doc = json.loads(shown.stdout)
        assert doc["state"] == "done" and set(doc["phases"]) == {"detect", "classify", "gate", "act", "total"}
        assert all(v is not None and v >= 0 for v in doc["phases"].values())
        assert doc["phases"]["total"] < 90
        text = subprocess.run(
            [sys.executable, "-m", "fleetheal", "incidents", "show", "1", "--config", str(config)],
            capture_output=True, text=True, check=True, cwd=REPO,
        ).stdout  # fmt: skip
        assert "phases:" in text and "playbook (attempt 1) successful" in text

        # The fault clears: Alertmanager sends the resolution, recorded on the same incident.
        gauge.labels(**labels).set(0)
        _wait("the resolution", lambda: store.get(1).resolved_at is not None, 60)
        assert [e.kind for e in store.events(1)][-1] == "resolved"
        _wait("the isolation to be released", lambda: "gpu-001" not in store.isolations(), 60)
        assert len(store.incidents()) == 1
        store.close()
    finally:
        mon.stop()
        stop_server(proc, log)
        server.shutdown()
        thread.join(timeout=5)
    assert not (tmp_path / "monitoring" / "prometheus.pid").exists()
    assert TOKEN not in (tmp_path / "serve.log").read_text()


def test_prometheus_and_alertmanager_restarted_lose_no_alert_and_repeat_none(tmp_path):
    """Chaos: both are restarted (same data directories) between two faults, and the second fault is raised
    while they are down. The second alert still arrives and is remediated; the first is not remediated again."""
    gauge, exporter_port, server, thread = _exporter()
    port = free_port()
    proc, _, log = start_server(tmp_path, write_config(tmp_path, port), port)
    mon = _monitoring(tmp_path, exporter_port, port)
    fault = {"fault_id": "xid-79", "class": "hardware", "action": "ISOLATE_AND_RELOCATE", "severity": "critical"}
    store = Store(str(tmp_path / "remediator.sqlite"))

    def finished(iid: int) -> bool:
        inc = store.get(iid)
        return inc is not None and inc.state in ("done", "failed")

    try:
        mon.start()
        gauge.labels(node="gpu-001", gpu="3", **fault).set(1)
        _wait("the first incident to finish", lambda: finished(1), 180)
        gauge.labels(node="gpu-001", gpu="3", **fault).set(0)  # repaired: its isolation is released
        _wait("the isolation to be released", lambda: "gpu-001" not in store.isolations(), 60)
        mon.stop()
        gauge.labels(node="gpu-005", gpu="1", **fault).set(1)  # raised while both are down
        time.sleep(2)
        mon.start()
        _wait("the second incident to finish", lambda: finished(2), 180)
        time.sleep(3)  # anything Alertmanager sends again after its restart has arrived by now
        incidents = sorted(store.incidents(), key=lambda i: i.id)
        assert [(i.node, i.state) for i in incidents] == [("gpu-001", "done"), ("gpu-005", "done")]
        runs = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
        assert sorted(r["node"] for r in runs if r["phase"] == "start") == ["gpu-001", "gpu-005"]  # each once
    finally:
        store.close()
        mon.stop()
        stop_server(proc, log)
        server.shutdown()
        thread.join(timeout=5)
