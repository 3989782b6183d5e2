"""`ClusterRemediator`: the remediator of one cluster of the federation lab (`fleetheal.lab.federation`),
run as `fleetheal remediator serve` with the third recovery stage on, and fed alerts as Alertmanager sends them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import yaml

from fleetheal import httpjson, procs
from fleetheal import taxonomy as taxmod
from fleetheal.lab.federation import Federation
from fleetheal.lab.slurm import (
    SlurmError,
)
from fleetheal.lab.supervisor import Supervisor, spawn
from fleetheal.procs import free_ports
from fleetheal.tools import CHECKOUT


class ClusterRemediator(Supervisor):
    """`fleetheal remediator serve` for one cluster of a federation, with the third recovery stage on.

    The cluster has no standby node and an isolation budget of `budget` nodes, so a loss of more nodes than
    that (a leaf switch) is one it cannot heal: the remediator moves the job to a sibling that reads its
    checkpoint store (`fleet_file`). Kubernetes and the node lifecycle are off: the federation lab has
    Slurm only. The playbooks run for real, on the control machine (the lab's nodes are local).
    """

    def __init__(
        self,
        fed: Federation,
        cluster: str,
        state_dir: str | os.PathLike[str],
        fleet_file: str | os.PathLike[str],
        *,
        budget: int = 1,
        wait_s: float = 3.0,
        grace_s: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(20)
        token_file = self.dir / "token"
        token_file.write_text(self.token)
        os.chmod(token_file, 0o600)
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        slurm = fed.clusters[cluster]
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inventory = self.dir / "inventory.yml"
        inventory.write_text(yaml.safe_dump({"all": {"children": {
            "fleetheal_control": {"hosts": {"localhost": local}},
            "fleetheal_gpu_nodes": {"hosts": dict.fromkeys(slurm.node_names, local)},
        }}}))  # fmt: skip
        repo = CHECKOUT
        cfg = {
            "cluster": {"name": cluster, "nodes": dict.fromkeys(slurm.node_names, f"{cluster}-leaf-1")},
            "listen": {"host": "127.0.0.1", "port": self.port},
            "auth": {"token_file": str(token_file)},
            "store": {"path": str(self.dir / "remediator.sqlite"), "synchronous": "NORMAL"},
            "runner": {
                "playbook_dir": str(repo / "playbooks"),
                "run_dir": str(self.dir / "runs"),
                "inventory": str(inventory),
                "timeout_s": 120,
                "retries": 0,
                "site_vars": {
                    "fleetheal_slurm_env": {"SLURM_CONF": str(slurm.conf_path)},
                    "fleetheal_grace_seconds": grace_s,
                    "fleetheal_slurm_retry_delay_s": 1,
                    "fleetheal_report_dir": str(self.dir / "reports"),
                },
            },
            "gate": {"budget": {"max_isolated": budget, "max_isolated_fraction": 1.0,
                                "max_isolated_per_domain": budget, "max_isolated_fraction_per_domain": 1.0}},
            "lifecycle": {"enabled": False},
            "failover": {"enabled": True, "fleet_file": str(fleet_file), "wait_s": wait_s, "timeout_s": 120},
        }  # fmt: skip
        self.config = self.dir / "remediator.yaml"
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.log = self.dir / "remediator.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Self:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
        self._proc = spawn(
            [sys.executable, "-m", "fleetheal", "remediator", "serve", "--config", str(self.config)],
            self.log,
            env=env,
            cwd=self.dir,
        )

        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise SlurmError(f"the remediator of {self.cluster} exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError):
                httpjson.request_json("GET", f"{self.url}/healthz", timeout=2)
                return True
            return False

        Federation._wait(f"the remediator of {self.cluster} on {self.url}", ready, timeout, 0.2)
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        procs.stop_pid(self._proc.pid, timeout=15.0)  # its process group: the playbooks it started too
        self._proc.wait(5)
        self._proc = None

    def alert(self, nodes: Sequence[str], fault_id: str) -> None:
        """POST the alerts of `fault_id` on `nodes` to the webhook, in Alertmanager's format (version 4),
        as the cluster's Alertmanager sends them when its rules fire."""
        fault = taxmod.load().fault(fault_id)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        alerts = []
        for node in nodes:
            labels = {"alertname": "FleethealNodeFault", "cluster": self.cluster, "node": node, "gpu": "node",
                      "fault_id": fault_id, "class": fault.fault_class, "action": fault.action,
                      "severity": fault.severity}  # fmt: skip
            alerts.append({
                "status": "firing", "labels": labels, "annotations": {"summary": f"{node}: {fault.name}"},
                "startsAt": now, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                "fingerprint": hashlib.sha256(f"{self.cluster}|{node}|{fault_id}".encode()).hexdigest()[:16],
            })  # fmt: skip
        body = {"receiver": "fleetheal-remediator", "status": "firing", "alerts": alerts, "groupLabels": {},
                "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "version": "4",
                "groupKey": "{}:{}", "truncatedAlerts": 0}  # fmt: skip
        httpjson.request_json("POST", f"{self.url}/webhook", body, token=self.token, timeout=30)

    def incidents(self) -> list[dict[str, Any]]:
        """The remediator's incidents with their steps and events, from its own store."""
        from fleetheal.remediator.store import Store

        path = self.dir / "remediator.sqlite"
        if not path.exists():
            return []
        store = Store(str(path), "NORMAL")
        try:
            out = []
            for inc in store.incidents(limit=100):
                doc = inc.as_dict()
                doc["steps"] = [
                    {"name": st.name, "result": st.result, "detail": st.detail, "ended_at": st.ended_at}
                    for st in store.steps(inc.id)
                ]
                doc["events"] = [{"kind": e.kind, "detail": e.detail, "ts": e.ts} for e in store.events(inc.id)]
                out.append(doc)
            return out
        finally:
            store.close()
