"""Alert storm: FAILED of NODES GPU nodes fail at once (Xid 79), against the real remediator and its safety gate.

Real parts: a private Slurm (slurmctld with NODES node entries; 2 have a slurmd, the rest are configured
nodes without one, so Slurm marks them DOWN, and they can still be drained); the Kubernetes API double
(`python -m fleetheal.lab.kube`, a test double) holding NODES Node objects; `fleetheal remediator serve`
with the production gate defaults (isolation budget 8 nodes / 5% of the pool / 2 per failure domain,
breaker at 10 nodes within 60 s) and the real playbooks through ansible-runner. The failure domains are
10 racks. The alerts are posted to the webhook as Alertmanager posts them: one per request, 10 in flight.

Figures: webhook ingest of the storm (all 202s); time until every incident has a gate decision (isolated
or held); time until the allowed isolations' playbooks finished; and, in the notes, how many nodes
Slurm shows drained by fleetheal at the end against the budget, and whether the breaker opened.
A benchmark, not a test: the safety properties are asserted in tests/remediator.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import random
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

from fleetheal import taxonomy
from fleetheal.contracts import LABEL_FAILURE_DOMAIN, LABEL_POOL, owns_reason
from fleetheal.lab.kube import node_object
from fleetheal.lab.lab import _http
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.procs import free_ports
from fleetheal.remediator.store import Store

REPO = Path(__file__).resolve().parents[1]
NODES = int(os.environ.get("FLEETHEAL_BENCH_STORM_NODES", "1500"))
FAILED = int(os.environ.get("FLEETHEAL_BENCH_STORM_FAILED", str(NODES // 10)))
RACKS = 10
TOKEN = "bench-storm-token"


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            v = check()
            if v:
                return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alert(node: str, rack: str, starts: str) -> dict[str, Any]:
    fault = taxonomy.load().fault("xid-79")
    labels = {
        "alertname": "FleethealXid79", "cluster": "storm", "node": node, "gpu": "3", "fault_id": "xid-79",
        "class": fault.fault_class, "action": fault.action, "severity": fault.severity, "failure_domain": rack,
    }  # fmt: skip
    return {
        "receiver": "fleetheal-remediator", "status": "firing", "groupLabels": {}, "commonLabels": {},
        "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093", "version": "4",
        "groupKey": f'{{}}:{{node="{node}"}}', "truncatedAlerts": 0,
        "alerts": [{"status": "firing", "labels": labels, "annotations": {"summary": f"{node}: Xid 79"},
                    "startsAt": starts, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                    "fingerprint": hashlib.sha256(node.encode()).hexdigest()[:16]}],
    }  # fmt: skip


def _post(url: str, doc: dict[str, Any]) -> tuple[int, float]:
    t0 = time.monotonic()
    req = urllib.request.Request(
        url, json.dumps(doc).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, time.monotonic() - t0


def run() -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="fleetheal-bench-storm-"))
    names = [f"g{i:04d}" for i in range(1, NODES + 1)]
    rack = {n: f"rack-{i % RACKS:02d}" for i, n in enumerate(names)}
    procs: list[subprocess.Popen[bytes]] = []
    cluster: SlurmCluster | None = None
    try:
        t_up = time.monotonic()
        cluster = SlurmCluster(
            tmp / "slurm", nodes=2, gpus_per_node=0,
            extra_conf=[f"NodeName=g[0001-{NODES:04d}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=9 "
                        "CPUs=8 RealMemory=1000 State=UNKNOWN"],
        ).start()  # fmt: skip
        kdir = tmp / "kube"
        kdir.mkdir()
        ktoken = "bench-storm-kube"
        logs = tmp / "logs"
        logs.mkdir()
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fleetheal.lab.kube", "--token", ktoken, "--kubeconfig",
                 str(kdir / "kubeconfig"), "--ready-file", str(kdir / "ready.json")],
                stdout=open(logs / "kube.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,  # noqa: SIM115
            )
        )  # fmt: skip
        kurl = _wait(lambda: json.loads((kdir / "ready.json").read_text())["url"], 30, "the Kubernetes double")
        for n in names:
            labels = {LABEL_POOL: "active", LABEL_FAILURE_DOMAIN: rack[n]}
            _http("POST", f"{kurl}/api/v1/nodes", node_object(n, labels, [], 8), ktoken)
        rdir = tmp / "remediator"
        (rdir / "reports").mkdir(parents=True)
        (rdir / "token").write_text(TOKEN)
        (rdir / "token").chmod(0o600)
        port = free_ports()[0]
        cfg = {
            "cluster": {"name": "storm", "nodes": rack},
            "listen": {"host": "127.0.0.1", "port": port},
            "auth": {"token_file": str(rdir / "token")},
            "store": {"path": str(rdir / "remediator.sqlite")},
            "runner": {
                "playbook_dir": str(REPO / "playbooks"), "run_dir": str(rdir / "runs"), "timeout_s": 300,
                "retries": 0,
                "envvars": {"K8S_AUTH_KUBECONFIG": str(kdir / "kubeconfig"), "SLURM_CONF": str(cluster.conf_path)},
                "site_vars": {"fleetheal_grace_seconds": 0, "fleetheal_slurm_retry_delay_s": 1,
                              "fleetheal_k8s_drain_timeout_s": 30, "fleetheal_kubeconfig": str(kdir / "kubeconfig"),
                              "fleetheal_report_dir": str(rdir / "reports")},
            },
        }  # fmt: skip
        (rdir / "remediator.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = dict(os.environ, SLURM_CONF=str(cluster.conf_path), KUBECONFIG=str(kdir / "kubeconfig"))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fleetheal", "remediator", "serve", "--config", str(rdir / "remediator.yaml")],
                stdout=open(logs / "remediator.log", "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                start_new_session=True, cwd=REPO,
            )
        )  # fmt: skip
        _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2), 30, "the remediator")
        up_s = time.monotonic() - t_up

        failed = sorted(random.Random(9).sample(names, FAILED))
        starts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{port}/webhook"
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda n: _post(url, _alert(n, rack[n], starts)), failed))
        ingest_s = time.monotonic() - t0
        codes = [c for c, _ in answers]

        def incidents() -> list[Any]:
            store = Store(str(rdir / "remediator.sqlite"), "NORMAL")
            try:
                return store.incidents(limit=NODES * 2)
            finally:
                store.close()

        def decided() -> list[Any] | None:
            incs = incidents()
            ok = len(incs) >= FAILED and all(i.decision or i.hold_reason for i in incs)
            return incs if ok else None

        incs = _wait(decided, 300, "every incident decided")
        decided_s = time.monotonic() - t0
        allowed = [i for i in incs if i.decision == "allow"]

        def acted() -> list[Any] | None:
            fresh = {i.id: i for i in incidents()}
            return list(fresh.values()) if all(fresh[i.id].state in ("done", "failed") for i in allowed) else None

        final = _wait(acted, 600, "the allowed playbooks")
        acted_s = time.monotonic() - t0
        held = [i for i in final if i.hold_reason]
        drained = [n for n, info in cluster.nodes().items() if info.drained and owns_reason(info.reason)]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        breaker = any(line.startswith("fleetheal_remediator_breaker_open 1") for line in metrics.splitlines())
        states: dict[str, int] = {}
        for i in final:
            states[i.state] = states.get(i.state, 0) + 1
        reasons: dict[str, int] = {}
        for i in held:
            key = str(i.hold_reason).split(":")[0][:40]
            reasons[key] = reasons.get(key, 0) + 1
    finally:
        for p in reversed(procs):
            _stop(p)
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lat = [s for _, s in answers]
    note = (f"{FAILED} of {NODES} Slurm nodes (DOWN, no slurmd, {RACKS} racks) + {NODES} Node objects; "
            f"set-up {up_s:.0f} s; codes {sorted(set(codes))}; allowed {len(allowed)}, held {len(held)} "
            f"({reasons}); breaker open {breaker}; Slurm nodes drained by fleetheal at the end: {len(drained)} "
            f"(budget 8, 2 per rack); incident states {states}")  # fmt: skip
    return [
        {"name": f"storm: webhook ingest of {FAILED} alerts (10 in flight)", "unit": "s", "median": ingest_s,
         "p99": ingest_s, "n": 1, "goal": "-", "peer": None, "ratio_to_peer": None,
         "notes": f"per request p50 {statistics.median(lat):.3f} s, max {max(lat):.3f} s"},
        {"name": "storm: every incident decided (isolate or hold)", "unit": "s", "median": decided_s,
         "p99": decided_s, "n": 1, "goal": "-", "peer": None, "ratio_to_peer": None, "notes": note},
        {"name": "storm: allowed isolations' playbooks finished", "unit": "s", "median": acted_s, "p99": acted_s,
         "n": 1, "goal": "<= budget of nodes isolated, rest held", "peer": None, "ratio_to_peer": None,
         "notes": f"{len(allowed)} playbooks, max 4 at once; grace period 0 s"},
    ]  # fmt: skip
