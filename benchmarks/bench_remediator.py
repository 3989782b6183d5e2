"""Remediator: webhook ingest (alerts/s, time to 202) and alert -> playbook start latency.

Both run the real service as its own process (`python -m fleetheal remediator serve`) on loopback.

1. Ingest: ROUNDS rounds of ALERTS distinct alerts, one alert per request (Alertmanager with
   `group_by: ['...']`), CONCURRENCY requests in flight, default durability (SQLite WAL, synchronous=FULL:
   every 202 is on disk). The gate is in observe-only mode, so each alert still becomes an incident that
   is classified, gated and audited while the ingest runs, but no playbook competes for the CPU.
   Figures: alerts/s per round, and the time from sending a request to its 202 (p50/p99 over all).
   A second figure posts the same alerts 50 per request (grouped notifications).
2. Alert -> playbook start: SAMPLES alerts one after the other, each for a non-destructive fault, with
   real ansible-runner and a one-task playbook; latency from sending the POST to ansible-runner's
   `playbook_on_start` event as recorded on the incident's timeline (same clock), plus the remediator's
   own share (alert received -> playbook start).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from fleetheal.procs import free_ports

REPO = Path(__file__).resolve().parents[1]
ALERTS = 2000
ROUNDS = 3
CONCURRENCY = 32
SAMPLES = 10
TOKEN = "bench-token-0123456789abcdef"
NODES = {f"gpu-{i:03d}": f"rack-{i // 20}" for i in range(200)}
PLAYBOOK = """\
- name: Benchmark playbook (one task)
  hosts: fleetheal_incidents  # the remediator's inventory: one host per incident, its variables as host vars
  gather_facts: false
  tasks:
    - name: Say where we are
      ansible.builtin.debug:
        msg: "{{ fleetheal_action }} on {{ fleetheal_node }}"
"""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _alert(i: int, fault_id: str, run: int) -> dict[str, Any]:
    from fleetheal import taxonomy

    fault = taxonomy.load().fault(fault_id)
    node = f"gpu-{i % 200:03d}"
    return {
        "status": "firing",
        "labels": {
            "alertname": "Bench",
            "cluster": "bench",
            "node": node,
            "gpu": str(i % 8),
            "fault_id": fault.id,
            "class": fault.fault_class,
            "action": fault.action,
            "severity": fault.severity,
        },
        "annotations": {"summary": "benchmark"},
        "startsAt": f"2026-11-29T{run % 24:02d}:{(i // 60) % 60:02d}:{i % 60:02d}.{i:06d}Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://127.0.0.1:9090/graph",
        "fingerprint": f"{i:016x}",
    }


def _body(alerts: list[dict[str, Any]]) -> bytes:
    return json.dumps(
        {
            "receiver": "fleetheal-remediator",
            "status": "firing",
            "alerts": alerts,
            "groupLabels": {},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://127.0.0.1:9093",
            "version": "4",
            "groupKey": "{}:{}",
            "truncatedAlerts": 0,
        }
    ).encode()


class Service:
    def __init__(self, workdir: Path, **gate: Any) -> None:
        self.dir = workdir
        self.port = free_ports()[0]
        playbooks = workdir / "playbooks"
        playbooks.mkdir()
        from fleetheal import taxonomy

        for action in taxonomy.load().actions.values():
            (playbooks / action.playbook).write_text(PLAYBOOK)
        cfg = {
            "cluster": {"name": "bench", "nodes": NODES},
            "listen": {"host": "127.0.0.1", "port": self.port},
            "store": {"path": str(workdir / "remediator.sqlite")},
            # No Slurm here: the first response (in-process Slurm steps) is off; the figure is the playbook path.
            "runner": {
                "playbook_dir": str(playbooks),
                "run_dir": str(workdir / "runs"),
                "retries": 0,
                "first_response": False,
            },
            "gate": gate,
        }
        self.config = workdir / "remediator.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = open(workdir / "serve.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetheal", "remediator", "serve", "--config", str(self.config)],
            stdout=self.log,
            stderr=self.log,
            env={**os.environ, "FLEETHEAL_REMEDIATOR_TOKEN": TOKEN},
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("remediator did not start: " + (workdir / "serve.log").read_text()[-2000:])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _ingest(port: int, bodies: list[bytes]) -> tuple[float, list[float]]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/webhook"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    latencies: list[float] = []
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while not queue.empty():
                data = queue.get_nowait()
                t0 = time.perf_counter()
                async with session.post(url, data=data, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 202:
                        raise RuntimeError(f"HTTP {resp.status}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return time.perf_counter() - t0, latencies


def bench_ingest() -> list[dict[str, Any]]:
    single_rates, grouped_rates, latencies = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-remediator-") as tmp:
        svc = Service(Path(tmp), observe_only=True)
        try:
            for r in range(ROUNDS):
                alerts = [_alert(i, "xid-79", r) for i in range(ALERTS)]
                elapsed, lat = asyncio.run(_ingest(svc.port, [_body([a]) for a in alerts]))
                single_rates.append(ALERTS / elapsed)
                latencies += lat
                alerts = [_alert(i, "xid-79", r + 12) for i in range(ALERTS)]
                elapsed, _ = asyncio.run(_ingest(svc.port, [_body(alerts[i : i + 50]) for i in range(0, ALERTS, 50)]))
                grouped_rates.append(ALERTS / elapsed)
        finally:
            svc.stop()
    return [
        {
            "name": "webhook ingest, 1 alert/request",
            "unit": "alerts/s",
            "median": statistics.median(single_rates),
            "p99": min(single_rates),
            "n": ROUNDS,
            "notes": f"{ALERTS} alerts per round, {CONCURRENCY} in flight, synchronous=FULL; p99 column: worst round",
        },
        {
            "name": "webhook time to 202, 1 alert/request",
            "unit": "ms",
            "median": statistics.median(latencies) * 1000,
            "p99": _pct(latencies, 0.99) * 1000,
            "n": len(latencies),
            "notes": f"{CONCURRENCY} requests in flight (includes queueing behind them)",
        },
        {
            "name": "webhook ingest, 50 alerts/request",
            "unit": "alerts/s",
            "median": statistics.median(grouped_rates),
            "p99": min(grouped_rates),
            "n": ROUNDS,
            "notes": "grouped notifications; p99 column: worst round",
        },
    ]


def bench_playbook_start() -> list[dict[str, Any]]:
    from fleetheal.remediator.store import Store

    total, own = [], []
    with tempfile.TemporaryDirectory(prefix="bench-remediator-") as tmp:
        svc = Service(Path(tmp))
        try:
            time.sleep(2)  # let the service import ansible_runner in the background, as it does after start
            store = Store(str(Path(tmp) / "remediator.sqlite"), synchronous="NORMAL")
            for i in range(SAMPLES):
                body = _body([_alert(5000 + i, "nccl-timeout", 1)])
                req = urllib.request.Request(
                    f"http://127.0.0.1:{svc.port}/webhook",
                    data=body,
                    headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                    method="POST",
                )
                sent = time.time()
                with urllib.request.urlopen(req, timeout=10) as resp:
                    ref = json.loads(resp.read())["created"][0]
                iid = int(ref.removeprefix("inc-"))
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    inc = store.get(iid)
                    if inc is not None and inc.state in ("done", "failed"):
                        break
                    time.sleep(0.05)
                start = next(e.ts for e in store.events(iid) if e.kind == "playbook_start")
                inc = store.get(iid)
                assert inc is not None and inc.state == "done", inc
                total.append(start - sent)
                own.append(start - inc.received_at)
            store.close()
        finally:
            svc.stop()
    return [
        {
            "name": "alert POST -> playbook start",
            "unit": "s",
            "median": statistics.median(total),
            "p99": _pct(total, 0.99),
            "n": SAMPLES,
            "notes": "real ansible-runner; to its playbook_on_start event (ansible-playbook startup included)",
        },
        {
            "name": "alert received -> playbook start",
            "unit": "s",
            "median": statistics.median(own),
            "p99": _pct(own, 0.99),
            "n": SAMPLES,
            "notes": "from the incident's received time",
        },
    ]


def run() -> list[dict[str, Any]]:
    return bench_ingest() + bench_playbook_start()


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
