"""Remediator: start-up time, webhook ingest (alerts/s, time to 202, SQLite and PostgreSQL), alert -> playbook
start latency, and leader failover.

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
3. Start-up: STARTS fresh processes, exec -> listening socket in wall and CPU time, as the service logs it.
4. Replicated (PostgreSQL on loopback, the real kube-apiserver of `make tools`): the ingest rounds of 1.
   against a follower of two replicas, beside SQLite's; and leader failover: SIGKILL of the leader (the
   process and its playbooks) while five incidents act, to the new leader's first step, FAILOVER_ROUNDS
   times with the default lease timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
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

from fleetheal.httpjson import request_json
from fleetheal.procs import free_ports
from fleetheal.wait import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[1]
ALERTS = 2000
ROUNDS = 3
CONCURRENCY = 32
SAMPLES = 10
STARTS = 7
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
    """`store_url` and `kube`: PostgreSQL and leader election (`lease`, this replica's `name`)."""

    def __init__(
        self,
        workdir: Path,
        *,
        store_url: str | None = None,
        kube: Any = None,
        lease: str = "fleetheal-bench",
        playbook: str = PLAYBOOK,
        wait_for: str = "any",
        **gate: Any,
    ) -> None:
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports()[0]
        self.run_dir = workdir / "runs"
        playbooks = workdir / "playbooks"
        playbooks.mkdir()
        from fleetheal import taxonomy

        for action in taxonomy.load().actions.values():
            (playbooks / action.playbook).write_text(playbook)
        store: dict[str, Any] = {"path": str(workdir / "remediator.sqlite")}
        cfg: dict[str, Any] = {
            "cluster": {"name": "bench", "nodes": NODES},
            "listen": {"host": "127.0.0.1", "port": self.port},
            "store": store,
            # No Slurm here: the first response (in-process Slurm steps) is off; the figure is the playbook path.
            "runner": {
                "playbook_dir": str(playbooks),
                "run_dir": str(self.run_dir),
                "retries": 0,
                "first_response": False,
            },
            "gate": gate,
            "lifecycle": {"enabled": False},
        }
        if store_url is not None:
            (workdir / "store-url").write_text(store_url + "\n")
            store["url_file"] = str(workdir / "store-url")
            # The default lease timings: the failover figure is what a site gets out of the box.
            cfg["leader_election"] = {
                "enabled": True,
                "namespace": "default",
                "lease_name": lease,
                "identity": workdir.name,
                "kubeconfig": str(kube.kubeconfig),
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
        try:
            wait_until(lambda: (role := self.role()) is not None and wait_for in ("any", role), 30,
                       f"the remediator to serve as {wait_for}", interval=0.02)  # fmt: skip
        except WaitTimeout:
            raise RuntimeError("remediator did not start: " + (workdir / "serve.log").read_text()[-2000:]) from None

    def role(self) -> str | None:
        try:
            return str(request_json("GET", f"http://127.0.0.1:{self.port}/healthz", timeout=1).get("role") or "leader")
        except OSError:
            return None

    def kill(self) -> None:
        """A pod's death: the process and its playbooks at once."""
        from fleetheal.remediator.rundirs import kill_leftovers

        if self.proc.poll() is None:
            self.proc.kill()
        kill_leftovers(str(self.run_dir))
        self.proc.wait()
        self.log.close()

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


def _ingest_rounds(svc: Service, offset: int) -> tuple[list[float], list[float], list[float]]:
    single_rates, grouped_rates, latencies = [], [], []
    for r in range(ROUNDS):
        alerts = [_alert(i, "xid-79", offset + r) for i in range(ALERTS)]
        elapsed, lat = asyncio.run(_ingest(svc.port, [_body([a]) for a in alerts]))
        single_rates.append(ALERTS / elapsed)
        latencies += lat
        alerts = [_alert(i, "xid-79", offset + r + 12) for i in range(ALERTS)]
        elapsed, _ = asyncio.run(_ingest(svc.port, [_body(alerts[i : i + 50]) for i in range(0, ALERTS, 50)]))
        grouped_rates.append(ALERTS / elapsed)
    return single_rates, grouped_rates, latencies


def bench_ingest(env: HAEnv | None) -> list[dict[str, Any]]:
    """SQLite (the embedded default); with `env`, the same rounds on PostgreSQL (a follower of two
    replicas: what Alertmanager reaches during a storm), measured after it in the same run."""
    with tempfile.TemporaryDirectory(prefix="bench-remediator-") as tmp:
        svc = Service(Path(tmp) / "sqlite", observe_only=True)
        try:
            single_rates, grouped_rates, latencies = _ingest_rounds(svc, 0)
        finally:
            svc.stop()
        pg: tuple[list[float], list[float], list[float]] | None = None
        if env is not None:
            url = env.database()
            leader = Service(Path(tmp) / "pg-a", store_url=url, kube=env.cp, lease="bench-ingest",
                             wait_for="leader", observe_only=True)  # fmt: skip
            follower = Service(Path(tmp) / "pg-b", store_url=url, kube=env.cp, lease="bench-ingest",
                               observe_only=True)  # fmt: skip
            try:
                pg = _ingest_rounds(follower, 100)
            finally:
                follower.stop()
                leader.stop()
    out = [
        {
            "name": "webhook ingest, 1 alert/request",
            "unit": "alerts/s",
            "median": statistics.median(single_rates),
            "p99": min(single_rates),
            "n": ROUNDS,
            "notes": f"{ALERTS} alerts per round, {CONCURRENCY} in flight, SQLite synchronous=FULL; "
            "p99 column: worst round",
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
    if pg is not None:
        single, grouped, lat = pg
        out += [
            {
                "name": "webhook ingest, 1 alert/request, PostgreSQL follower",
                "unit": "alerts/s",
                "median": statistics.median(single),
                "p99": min(single),
                "n": ROUNDS,
                "peer": statistics.median(single_rates),
                "ratio_to_peer": statistics.median(single) / statistics.median(single_rates),
                "notes": "a follower of 2 replicas, loopback PostgreSQL (synchronous_commit on); peer: SQLite above",
            },
            {
                "name": "webhook time to 202, 1 alert/request, PostgreSQL follower",
                "unit": "ms",
                "median": statistics.median(lat) * 1000,
                "p99": _pct(lat, 0.99) * 1000,
                "n": len(lat),
                "peer": statistics.median(latencies) * 1000,
                "ratio_to_peer": statistics.median(lat) / statistics.median(latencies),
                "notes": "peer: SQLite above",
            },
            {
                "name": "webhook ingest, 50 alerts/request, PostgreSQL follower",
                "unit": "alerts/s",
                "median": statistics.median(grouped),
                "p99": min(grouped),
                "n": ROUNDS,
                "peer": statistics.median(grouped_rates),
                "ratio_to_peer": statistics.median(grouped) / statistics.median(grouped_rates),
                "notes": "peer: SQLite above",
            },
        ]
    return out


#: A playbook that holds (a remediation in progress when the leader dies).
HOLDING_PLAYBOOK = """\
- name: Benchmark playbook (holds)
  hosts: fleetheal_incidents
  gather_facts: false
  tasks:
    - name: Hold like a long remediation
      ansible.builtin.command: sleep 60
      changed_when: false
"""
FAILOVER_ROUNDS = 5


def bench_failover(env: HAEnv) -> list[dict[str, Any]]:
    """SIGKILL of the leader (process and playbooks, as a pod dies) while its incidents act; the figure
    is the time to the first action of the new leader (its first step of one of them), default lease
    timings (lease 8 s, renew deadline 4 s, retry 1 s, fence 2 s)."""

    times, takes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        for r in range(FAILOVER_ROUNDS):
            first, took = _failover_round(env, Path(tmp), r)
            times.append(first)
            takes.append(took)
    return [
        {
            "name": "leader failover: SIGKILL -> first action of the new leader",
            "unit": "s",
            "median": statistics.median(times),
            "p99": max(times),
            "n": len(times),
            "goal": 10.0,
            "notes": f"2 replicas, default lease timings; of which taking the lease: median "
            f"{statistics.median(takes):.2f} s; p99 column: worst round",
        }
    ]


def _failover_round(env: HAEnv, tmp: Path, r: int) -> tuple[float, float]:
    """(kill -> first step of the new leader, kill -> its taking the lead), in seconds."""
    import psycopg

    from fleetheal.remediator.store import Store

    url = env.database()
    lease = f"bench-failover-{r}-{os.getpid()}"
    a = Service(tmp / f"r{r}-a", store_url=url, kube=env.cp, lease=lease, playbook=HOLDING_PLAYBOOK, wait_for="leader")
    b = Service(tmp / f"r{r}-b", store_url=url, kube=env.cp, lease=lease, playbook=HOLDING_PLAYBOOK)
    store = Store.postgres(url)
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{a.port}/webhook",
            data=_body([_alert(i * 20, "xid-79", 50 + r) for i in range(5)]),  # one per rack: within budget
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).close()
        _until(lambda: len(store.incidents(state="acting")) == 5, 60)
        time.sleep(1.0)
        killed = time.time()
        a.kill()
        with psycopg.connect(url, autocommit=True) as conn:
            first = _until(
                lambda: conn.execute("SELECT min(started_at) FROM steps WHERE started_at > %s", (killed,)).fetchone()[
                    0
                ],
                60,
            )
        lead = store.leadership()
        assert lead is not None
        return first - killed, lead[2] - killed
    finally:
        store.close()
        a.kill()  # a round that failed before the kill leaves no remediator behind
        b.kill()


def _until(predicate: Any, timeout: float) -> Any:
    return wait_until(predicate, timeout, "a condition", interval=0.02)


class HAEnv:
    """A loopback PostgreSQL and a real kube-apiserver (`make tools`) for the replicated figures."""

    def __init__(self, base: Path) -> None:
        from fleetheal.lab.controlplane import KubeControlPlane
        from fleetheal.lab.postgres import Postgres

        self.pg = Postgres(base / "pg").start()
        self.cp = KubeControlPlane(base / "kube", controller_manager=False).start()
        self._n = 0

    def database(self) -> str:
        import psycopg

        self._n += 1
        name = f"bench_{self._n}"
        with psycopg.connect(self.pg.url(database="postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.pg.url(database=name)

    def close(self) -> None:
        self.cp.stop()
        self.pg.drop()


def bench_startup() -> list[dict[str, Any]]:
    """From exec to a listening socket, as the service itself reports it in its first log line (wall and
    CPU time); STARTS starts of a fresh process each."""
    walls, cpus = [], []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for i in range(STARTS):
            svc = Service(Path(tmp) / str(i))
            svc.stop()
            first = json.loads((Path(tmp) / str(i) / "serve.log").read_text().splitlines()[0])
            assert first["msg"] == "remediator listening", first
            walls.append(first["startup_s"])
            cpus.append(first["startup_cpu_s"])
    notes = "exec -> listening socket, from the service's first log line"
    return [
        {"name": "remediator start-up, wall", "unit": "s", "median": statistics.median(walls), "p99": max(walls),
         "n": STARTS, "goal": 1.0, "notes": notes + "; p99 column: worst start"},
        {"name": "remediator start-up, CPU", "unit": "s", "median": statistics.median(cpus), "p99": max(cpus),
         "n": STARTS, "goal": 1.0, "notes": notes + "; user + system time"},
    ]  # fmt: skip


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
                with contextlib.suppress(WaitTimeout):  # the assertion below says what it was
                    wait_until(lambda iid=iid: getattr(store.get(iid), "state", None) in ("done", "failed"), 120,
                               f"incident {iid} to end", interval=0.05)  # fmt: skip
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
    from fleetheal.lab.controlplane import tools_built

    if not tools_built():  # the replicated figures need the API server; the others run anyway
        return bench_startup() + bench_ingest(None) + bench_playbook_start()
    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-ha-"))
    base.chmod(0o711)  # PostgreSQL runs as `postgres` when we are root: it must reach its directory
    env = HAEnv(base)
    try:
        return bench_startup() + bench_ingest(env) + bench_playbook_start() + bench_failover(env)
    finally:
        env.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
