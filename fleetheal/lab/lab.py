"""The local lab: every fleetheal part running for real on loopback, under one state directory.

`Lab(lab_dir).up(nodes=4, standby=2, gpus=8)` starts, each as its own process recorded by PID in
`lab.json`:

- a private Slurm cluster (`SlurmCluster`: munged, slurmctld, one slurmd per node, fake GPUs as GRES);
  the standby nodes are drained with the owned reason `fleetheal:standby`, as the playbooks expect;
- the Kubernetes side: a real etcd + kube-apiserver + kube-controller-manager (`KubeControlPlane`, built
  by `make tools`; without them, the in-process test double `FakeKubeApiServer`, and the lab says so)
  with a Node per Slurm node, labelled `fleetheal.io/pool=active|standby` (standby nodes also carry the
  standby taint), a Slinky-like slurmd pod per node (owned by a StatefulSet) under a PodDisruptionBudget
  and an agent pod per node (owned by a DaemonSet); an admin kubeconfig; each agent's bearer token is
  bound to its own Node, and the stack's admission policy (`fleetheal.contracts.own_node_policy`)
  keeps it to that Node (the test double checks only that a token is present);
- one agent per node (`fleetheal agent run`) on the simulated GPU backend, with its own metrics port,
  training socket and fault-injection file, draining its own Slurm node and tainting its own Node;
- real Prometheus and Alertmanager (`fleetheal.lab.monitoring.Monitoring`) with the generated alert
  rules, scraping every agent and routing to the remediator's webhook with a bearer token;
- the remediator (`fleetheal remediator serve`) running the real playbooks through ansible-runner, with
  the kubeconfig pointed at that API server.

`Lab(lab_dir).up_federation(clusters=3)` starts instead a Slurm federation alone
(`fleetheal.lab.federation.Federation`: clusters a, b, c... sharing one slurmdbd and MariaDB) under
`lab_dir/federation`, for trying multi-cluster placement by hand; `down()` stops it too.

`down()` stops all of it by PID (and checks each PID is still the process it started). State lives
under the lab dir (default `$FLEETHEAL_LAB_DIR` or /tmp/fleetheal-lab); `up()` starts from an empty one.

Each part `up` starts is a supervisor in its own module (`slurm`, `controlplane`, `kube`, `monitoring`,
`federation`), the Kubernetes side is set up by `labkube`; this module is over 500 lines because `Lab` is the
one object that wires them together, writes the agents' and the remediator's configurations, and records
every process it started in `lab.json`, so `down()` and the read side (`status`, `incidents`, `node_states`)
can find them again from another process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetheal import procs
from fleetheal.contracts import LABEL_POOL, STANDBY_REASON
from fleetheal.lab import LabError, wait
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.federation import DEFAULT_GPU_TYPES, Federation
from fleetheal.lab.kubeapi import api_request
from fleetheal.lab.labkube import (
    GPU_POOL,
    INFERENCE_NAMESPACE,
    LEND_NODES,
    LabKube,
    admin_client,
    agent_token_file,
    write_secret,
)
from fleetheal.lab.monitoring import Monitoring
from fleetheal.lab.slurm import SlurmCluster, SlurmError
from fleetheal.lab.supervisor import spawn
from fleetheal.procs import free_ports
from fleetheal.tools import CHECKOUT

DEFAULT_LAB_DIR = "/tmp/fleetheal-lab"  # noqa: S108 - a throwaway lab, overridable with $FLEETHEAL_LAB_DIR
CLUSTER = "lab"
#: Site settings the lab gives every remediation run through the remediator's `runner.site_vars`
#: (lab-speed timers); its kubeconfig and report dir are added where the lab knows them.
LAB_SITE_VARS = {
    "fleetheal_grace_seconds": 3,
    "fleetheal_slurm_retry_delay_s": 1,
    "fleetheal_k8s_drain_timeout_s": 30,
}


#: `fleetheal remediator ...` / `fleetheal incidents ...` with this interpreter.
REMEDIATOR_CLI = (sys.executable, "-m", "fleetheal")


def lab_dir_default() -> Path:
    return Path(os.environ.get("FLEETHEAL_LAB_DIR", DEFAULT_LAB_DIR))


def stop_process(pid: int, marker: str, timeout: float = 10.0) -> bool:
    """Stop the process `pid` (if its command line still contains `marker`) and everything below it.

    SIGTERM to its process group, SIGKILL after `timeout`; then SIGKILL for any descendant that had
    moved to a session of its own (ansible-runner starts ansible-playbook on a pseudo-terminal).
    """
    if not procs.alive(pid) or marker not in procs.cmdline(pid):
        return False
    below = procs.descendants(pid)
    procs.stop_pid(pid, timeout)
    for kid, cmd in below.items():
        if procs.alive(kid) and procs.cmdline(kid) == cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
    return True


@dataclass(frozen=True)
class NodeStatus:
    name: str
    pool: str
    slurm_state: str
    reason: str | None
    k8s_unschedulable: bool
    k8s_taints: tuple[str, ...]
    health: str


class Lab:
    """One lab under `lab_dir`. `up()` / `down()` / `status()` / `inject()` / `submit_training()`."""

    def __init__(self, lab_dir: str | os.PathLike[str] | None = None, log: Callable[[str], None] | None = None) -> None:
        self.dir = Path(lab_dir or lab_dir_default()).resolve()
        self.meta_path = self.dir / "lab.json"
        self.log = log or (lambda text: print(text, flush=True))
        self.meta: dict[str, Any] = {}
        #: True once this object's `up` has brought a lab up (so it is this process's to take down).
        self.started = False
        self._kube_api: Any = None  # a `kubernetes.client.ApiClient`, made at the first kube_request
        if self.meta_path.exists():
            self.meta = json.loads(self.meta_path.read_text())

    # ---- paths --------------------------------------------------------------------------------

    def node_dir(self, node: str) -> Path:
        return self.dir / "nodes" / node

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kube" / "kubeconfig"

    @property
    def remediator_config(self) -> Path:
        return self.dir / "remediator" / "remediator.yaml"

    @property
    def nodes(self) -> list[str]:
        return list(self.meta.get("nodes", []))

    @property
    def standby_nodes(self) -> list[str]:
        return list(self.meta.get("standby", []))

    @property
    def kube_url(self) -> str:
        return str(self.meta["kube"]["url"])

    def agent_token_file(self, node: str) -> Path:
        """The bearer token of `node`'s agent: on the real API server, a token bound to that Node."""
        return agent_token_file(self.dir / "kube", node, bool(self.meta["kube"].get("real")))

    def slurm(self) -> SlurmCluster:
        return SlurmCluster.attach(self.dir / "slurm")

    @property
    def federation_dir(self) -> Path:
        return self.dir / "federation"

    def federation(self) -> Federation:
        """The running federation of `up_federation` (SlurmError when none runs)."""
        return Federation.attach(self.federation_dir)

    def _save(self) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
        os.replace(tmp, self.meta_path)

    def _done(self, part: str, t0: float, what: str) -> None:
        """Log one part of `up` as started, with the seconds it took since `t0`."""
        self.log(f"  {part:<11} {what}  [{time.monotonic() - t0:.1f}s]")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = self.dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = spawn(argv, log, env=env or dict(os.environ), cwd=self.dir)  # `down` stops its process group
        self.meta.setdefault("processes", {})[name] = {"pid": proc.pid, "log": str(log)}
        self._save()
        return proc.pid

    def running(self) -> bool:
        started = self.meta.get("processes", {}).values()
        return (
            any(procs.alive(p["pid"]) and str(self.dir) in procs.cmdline(p["pid"]) for p in started)
            or ((self.dir / "slurm" / "cluster.json").exists())
            or (self.federation_dir / "base" / "federation.json").exists()
        )

    # ---- up -----------------------------------------------------------------------------------

    def up(self, nodes: int = 4, standby: int = 2, gpus: int = 8) -> None:
        if nodes < 2:
            raise LabError(f"--nodes must be at least 2 (the training job uses 2), got {nodes}")
        if standby < 0 or gpus < 1:
            raise LabError("--standby must be >= 0 and --gpus >= 1")
        # Two `up`s at once on one directory: the second waits for none and touches nothing of the first's.
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.dir.parent / f".{self.dir.name}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LabError(f"another `fleetheal lab up` is starting a lab in {self.dir}") from None
            self._up_locked(nodes, standby, gpus)

    def _fresh_dir(self) -> None:
        """Every lab starts from an empty directory; refuse one that runs a lab or holds something else."""
        if self.dir.exists() and self.running():
            raise LabError(f"a lab is already running in {self.dir}; run `fleetheal lab down` first")
        if self.dir.exists() and any(self.dir.iterdir()):
            if not self.meta_path.exists():
                raise LabError(f"{self.dir} is not empty and holds no lab (no lab.json): choose another --dir")
            shutil.rmtree(self.dir)  # a stopped lab
        self.dir.mkdir(parents=True, exist_ok=True)

    def up_federation(self, clusters: int = 3, nodes: int = 2, gpus: int = 8) -> Federation:
        """Start a Slurm federation of `clusters` clusters (named a, b, c...; `nodes` slurmd each) alone,
        without the single-cluster lab's agents, remediator and monitoring."""
        if not 2 <= clusters <= 26:
            raise LabError(f"--clusters must be between 2 and 26, got {clusters}")
        if nodes < 1 or gpus < 1:
            raise LabError("--nodes and --gpus must be at least 1")
        names = [chr(ord("a") + i) for i in range(clusters)]
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.dir.parent / f".{self.dir.name}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LabError(f"another `fleetheal lab up` is starting a lab in {self.dir}") from None
            self._fresh_dir()
            self.meta = {"federation": {"clusters": names, "nodes": nodes}, "gpus": gpus, "started": time.time()}
            self._save()
            types = {n: DEFAULT_GPU_TYPES.get(n, "h100") for n in names}
            fed = Federation(self.federation_dir, names, nodes, gpus, types)
            try:
                fed.start()
            except SlurmError as exc:
                raise LabError(f"the federation did not start: {exc}") from exc
            self.started = True
            self.meta["federation"]["slurm_conf"] = str(fed.conf_path)
            self.meta["ready"] = time.time()
            self._save()
            return fed

    def _up_locked(self, nodes: int, standby: int, gpus: int) -> None:
        self._fresh_dir()
        names = [f"n{i}" for i in range(1, nodes + standby + 1)]
        self.meta = {
            "nodes": names,
            "active": names[:nodes],
            "standby": names[nodes:],
            "gpus": gpus,
            "started": time.time(),
            "processes": {},
        }
        self._save()
        try:
            self._up_slurm(names, gpus)
            self._up_kube()
            self._up_agents(gpus)
            self._up_remediator()
            self._up_monitoring()
        except BaseException:
            self.log("lab up failed; stopping what was started")
            self.down(quiet=True)
            raise
        self.started = True
        self.meta["ready"] = time.time()
        self._save()

    def _up_slurm(self, names: list[str], gpus: int) -> None:
        t0 = time.monotonic()
        cluster = SlurmCluster(self.dir / "slurm", nodes=len(names), gpus_per_node=gpus, fast_timers=False).start()
        if self.standby_nodes:
            cluster.scontrol(
                "update", f"nodename={','.join(self.standby_nodes)}", "state=drain", f"reason={STANDBY_REASON}"
            )
        self._done(
            "slurm",
            t0,
            f"Slurm {cluster.release.name}: slurmctld + {len(names)} slurmd ({gpus} fake GPUs each), "
            f"{len(self.standby_nodes)} standby drained '{STANDBY_REASON}'",
        )

    def _up_kube(self) -> None:
        t0 = time.monotonic()
        gpus = int(self.meta["gpus"])
        kube = LabKube(self.dir, self.nodes, self.standby_nodes, gpus, spawn=self._spawn, record=self._record_kube)
        what = kube.up()
        self.meta["kube"]["kueue"] = kube.kueue is not None
        self._save()
        self._done("kubernetes", t0, f"{what}: {len(self.nodes)} Nodes, slurmd pods under a PodDisruptionBudget")

    def _record_kube(self, kube: dict[str, Any]) -> None:
        self.meta["kube"] = kube
        self._save()

    def kube_request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        """An admin request to the lab's Kubernetes API (the real one, or the double) through the `kubernetes`
        client; the decoded JSON answer. Raises KubeApiError on a 4xx/5xx."""
        if self._kube_api is None:
            self._kube_api = admin_client(self.dir / "kube", bool(self.meta["kube"].get("real")), self.kube_url)
        return api_request(self._kube_api, method, path, body, ctype)

    def _agent_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.dir / "slurm" / "etc" / "slurm.conf")
        env["PYTHONPATH"] = str(CHECKOUT) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def _up_agents(self, gpus: int) -> None:
        from fleetheal.lab.simtools import write_sim_tools

        t0 = time.monotonic()
        ports = {}
        for name in self.nodes:
            nd = self.node_dir(name)
            nd.mkdir(parents=True)
            (nd / "kmsg").touch()
            write_sim_tools(nd / "bin", nd / "sim-gpus.json", gpus)
            port = free_ports()[0]
            ports[name] = port
            cfg = {
                "node": name,
                "mode": "act",
                "poll_interval_s": 0.5,
                "health_file": str(nd / "health"),
                "log_level": "info",
                "backend": {
                    "kind": "simulated",
                    "expected_gpus": gpus,
                    "simulated": {"gpus": gpus, "state_file": str(nd / "sim-gpus.json")},
                },
                "metrics": {"listen": "127.0.0.1", "port": port},
                "kernel_log": {
                    "enabled": True,
                    "path": str(nd / "kmsg"),
                    "from_start": False,
                    "position_file": str(nd / "kernel-log.position"),
                },
                # No prolog in the lab (slurmconf.py): the owners of jobs come from squeue.
                "training": {"enabled": True, "socket": str(nd / "training.sock"), "job_owners_dir": ""},
                "fastpath": {
                    "slurm": {"enabled": True, "slurm_conf": str(self.dir / "slurm" / "etc" / "slurm.conf")},
                    "kubernetes": {
                        "enabled": True,
                        "api_url": self.kube_url,
                        "token_file": str(self.agent_token_file(name)),
                        "ca_file": self.meta["kube"]["ca_file"],
                    },
                },
            }
            (nd / "agent.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
            argv = [sys.executable, "-m", "fleetheal", "agent", "run", "--config", str(nd / "agent.yaml")]
            self._spawn(f"agent-{name}", argv, self._agent_env())
        self.meta["agents"] = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
        self._save()
        for name, port in ports.items():
            wait(
                f"agent {name} metrics on 127.0.0.1:{port}",
                functools.partial(_port_open, port),
                30,
                self.dir / "logs" / f"agent-{name}.log",
            )
        self._done(
            "agents",
            t0,
            f"{len(ports)} x `fleetheal agent run` (simulated GPUs), metrics on 127.0.0.1",
        )

    def _up_remediator(self) -> None:
        from fleetheal.lab.simtools import validation_vars

        t0 = time.monotonic()
        rdir = self.dir / "remediator"
        (rdir / "reports").mkdir(parents=True)
        write_secret(rdir / "token", secrets.token_hex(20))
        write_secret(rdir / "operator-token", secrets.token_hex(20))
        port = free_ports()[0]
        # The lab's nodes are hosts of the control machine (revalidation runs its checks "on the node"), and
        # their checks are the simulated GPUs' tools (fleetheal.lab.simtools), each node its own.
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inventory = rdir / "inventory.yml"
        inventory.write_text(yaml.safe_dump({"all": {
            "vars": validation_vars(self.dir / "nodes", int(self.meta["gpus"])),
            "children": {
                "fleetheal_control": {"hosts": {"localhost": local}},
                "fleetheal_gpu_nodes": {"hosts": dict.fromkeys(self.nodes, local)},
            },
        }}, sort_keys=False))  # fmt: skip
        cfg = {
            "cluster": {
                "name": CLUSTER,
                "nodes": {n: f"rack-{'ab'[i % 2]}" for i, n in enumerate(self.nodes)},
            },
            "listen": {"host": "127.0.0.1", "port": port},
            "auth": {"token_file": str(rdir / "token"), "operator_token_file": str(rdir / "operator-token")},
            "store": {"path": str(rdir / "remediator.sqlite"), "synchronous": "NORMAL"},
            "runner": {
                "playbook_dir": str(CHECKOUT / "playbooks"),
                "run_dir": str(rdir / "runs"),
                "inventory": str(inventory),
                "timeout_s": 300,
                "retries": 1,
                "backoff_s": 2.0,
                "max_concurrent": 2,
                "envvars": {"K8S_AUTH_KUBECONFIG": str(self.kubeconfig)},
                "site_vars": {
                    **LAB_SITE_VARS,
                    "fleetheal_kubeconfig": str(self.kubeconfig),
                    "fleetheal_report_dir": str(rdir / "reports"),
                    # RESET_GPU resets a simulated GPU too.
                    "fleetheal_nvidia_smi": str(self.dir / "nodes") + "/{{ fleetheal_node }}/bin/nvidia-smi",
                },
            },
            "gate": {
                "pause_file": str(rdir / "PAUSE"),
                # Three isolations over the demo's life, two in one rack of three nodes: the Xid 79's (it counts
                # until its alert resolves: the agent holds an Xid 10 minutes), the lemon's and a lent node's.
                "budget": {"max_isolated": 3, "max_isolated_fraction": 0.5, "max_isolated_per_domain": 2,
                           "max_isolated_fraction_per_domain": 0.67},
            },
            "lifecycle": {
                "standby_target": len(self.standby_nodes),
                "report_dir": str(rdir / "lifecycle"),
                "reconcile_interval_s": 2.0,
            },
        }  # fmt: skip
        if self.meta["kube"].get("kueue"):
            # The pool lends idle nodes to Kueue's inference workloads. Lab speed: a round a second, nodes lent
            # may be taken back at once (the stack's default holds them 600 s), 5 s for a pod to stop.
            cfg["lending"] = {
                "enabled": True,
                "interval_s": 1.0,
                "pools": {GPU_POOL: {"max_nodes": LEND_NODES, "min_lent_s": 0, "reclaim_grace_s": 5}},
                "namespaces": [INFERENCE_NAMESPACE],
            }
        self.remediator_config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = self._agent_env()
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
        env["KUBECONFIG"] = str(self.kubeconfig)
        self._spawn(
            "remediator",
            [*REMEDIATOR_CLI, "remediator", "serve", "--config", str(self.remediator_config)],
            env,
        )
        url = f"http://127.0.0.1:{port}"
        self.meta["remediator"] = {"url": url, "webhook": f"{url}/webhook"}
        self._save()
        wait(
            f"the remediator on {url}",
            lambda: _port_open(port),
            30,
            self.dir / "logs" / "remediator.log",
        )
        self._done(
            "remediator",
            t0,
            f"`fleetheal remediator serve` at {url}, playbooks from {CHECKOUT / 'playbooks'}",
        )

    def _up_monitoring(self) -> None:
        t0 = time.monotonic()
        mon = Monitoring(
            self.dir / "monitoring",
            scrape_targets=list(self.meta["agents"].values()),
            rules_files=[CHECKOUT / "policies" / "alert-rules.yml"],
            webhook_url=self.meta["remediator"]["webhook"],
            webhook_token=(self.dir / "remediator" / "token").read_text().strip(),
            cluster=CLUSTER,
        )
        mon.start()
        self.meta["monitoring"] = {"prometheus": mon.prometheus_url, "alertmanager": mon.alertmanager_url}
        self._save()
        self._done(
            "monitoring",
            t0,
            f"Prometheus {mon.prometheus_url} (generated alert rules), "
            f"Alertmanager {mon.alertmanager_url} -> remediator",
        )

    # ---- down ---------------------------------------------------------------------------------

    def down(self, quiet: bool = False) -> list[str]:
        """Stop everything this lab started, by PID. Returns what was stopped."""
        stopped: list[str] = []
        started = self.meta.get("processes", {})
        # The remediator first (no new playbooks), Prometheus/Alertmanager, agents, the API double.
        order = sorted(started, key=lambda n: (n != "remediator", n.startswith("kube")))
        for name in order:
            if stop_process(int(started[name]["pid"]), str(self.dir)):
                stopped.append(name)
        mon_dir = self.dir / "monitoring"
        if mon_dir.exists():
            from fleetheal.lab.monitoring import stop_recorded

            pids = list(mon_dir.glob("*.pid"))
            stop_recorded(mon_dir)
            stopped += [p.stem for p in pids]
        if (self.dir / "kube" / "controlplane.json").exists():
            KubeControlPlane.attach(self.dir / "kube").stop()
            stopped.append("kubernetes")
        slurm_dir = self.dir / "slurm"
        with contextlib.suppress(SlurmError):
            SlurmCluster.attach(slurm_dir).stop()
            stopped.append("slurm")
        with contextlib.suppress(SlurmError):
            self.federation().stop()
            stopped.append("federation")
        if not quiet:
            self.log(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        return stopped

    # ---- operations ---------------------------------------------------------------------------

    def inject(self, node: str, fault: str, gpu: int | None = None) -> str:
        from fleetheal.agent.simulated import inject

        if node not in self.nodes:
            raise LabError(f"unknown node {node}; the lab's nodes are {', '.join(self.nodes)}")
        inj = inject(self.node_dir(node) / "sim-gpus.json", fault, gpu)
        return inj.id

    def clear(self, node: str) -> int:
        """The lab's repair: clear every fault injected on `node`; the number cleared."""
        from fleetheal.agent.simulated import clear

        if node not in self.nodes:
            raise LabError(f"unknown node {node}; the lab's nodes are {', '.join(self.nodes)}")
        return clear(self.node_dir(node) / "sim-gpus.json")

    def fleetheal(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`fleetheal ARGS --config <the lab's remediator configuration>`, as an operator runs it."""
        out = subprocess.run(
            [*REMEDIATOR_CLI, *args, "--config", str(self.remediator_config)],
            capture_output=True, text=True, timeout=120, check=False, env=self._agent_env(),
        )  # fmt: skip
        if check and out.returncode != 0:
            raise LabError(f"fleetheal {' '.join(args)} failed: {(out.stderr or out.stdout).strip()}")
        return out

    def node_lifecycle(self, node: str) -> dict[str, Any]:
        """`fleetheal nodes show NODE --json`: the node's state and its timeline."""
        doc: dict[str, Any] = json.loads(self.fleetheal("nodes", "show", node, "--json").stdout)
        return doc

    def submit_training(
        self,
        *,
        name: str = "train",
        nodes: int = 2,
        steps: int = 100_000,
        step_time: float = 0.1,
        checkpoint_every: float = 3.0,
        spares: int = 0,
    ) -> tuple[str, Path]:
        """Submit the lab's training job on `nodes` nodes, with `spares` hot spares in its allocation (a node
        lost is replaced by one of them without a requeue); returns (job id, run dir). Its log is
        `<run dir>/train.log`."""
        from fleetheal.lab.train import batch_script

        run_dir = self.dir / "jobs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        script = batch_script(
            sys.executable,
            run_dir,
            steps=steps,
            step_time=step_time,
            checkpoint_every=checkpoint_every,
            socket_template=str(self.dir / "nodes" / "{node}" / "training.sock"),
            pythonpath=str(CHECKOUT),
            nodes=nodes if spares else None,
        )
        gpus = self.meta["gpus"]
        job = self.slurm().sbatch(
            script, f"--nodes={nodes + spares}", f"--gres=gpu:{gpus}", "--requeue", "--open-mode=append",
            f"--output={run_dir / 'train.log'}", f"--job-name={name}", "--exclusive",
        )  # fmt: skip
        return job, run_dir

    def k8s_nodes(self) -> dict[str, dict[str, Any]]:
        items = self.kube_request("GET", "/api/v1/nodes")["items"]
        return {n["metadata"]["name"]: n for n in items}

    def status(self) -> list[NodeStatus]:
        cluster = self.slurm()
        snodes = cluster.nodes()
        knodes = self.k8s_nodes()
        out = []
        for name in self.nodes:
            s = snodes.get(name)
            k = knodes.get(name, {})
            health_file = self.node_dir(name) / "health"
            out.append(
                NodeStatus(
                    name=name,
                    pool=(k.get("metadata", {}).get("labels") or {}).get(LABEL_POOL, "?"),
                    slurm_state="+".join([s.state, *sorted(s.flags)]) if s else "?",
                    reason=s.reason if s else None,
                    k8s_unschedulable=bool((k.get("spec") or {}).get("unschedulable")),
                    k8s_taints=tuple(
                        f"{t['key']}={t.get('value', '')}:{t['effect']}"
                        for t in (k.get("spec") or {}).get("taints") or []
                    ),
                    health=health_file.read_text().strip() if health_file.exists() else "?",
                )
            )
        return out

    def incidents(self, limit: int = 100) -> list[dict[str, Any]]:
        """Recent incidents, newest first, read from the remediator's store (what `fleetheal incidents list
        --json` prints), in this process: the demo polls it several times a second."""
        from fleetheal.remediator.config import load
        from fleetheal.remediator.store import Store

        cfg = load(self.remediator_config)
        if not Path(cfg.store.path).exists():
            return []
        for attempt in range(5):
            try:
                store = Store(cfg.store.path, cfg.store.synchronous)
                try:
                    return [inc.as_dict() for inc in store.incidents(limit=limit)]
                finally:
                    store.close()
            except sqlite3.OperationalError as exc:  # the remediator is creating or writing the database
                if attempt == 4:
                    raise LabError(f"cannot read the remediator's incidents from {cfg.store.path}: {exc}") from exc
                time.sleep(0.2 * (attempt + 1))
        return []

    def node_states(self) -> dict[str, str]:
        """Every lab node's lifecycle state, from the remediator's store (in this process: the demo polls)."""
        from fleetheal.remediator.config import load
        from fleetheal.remediator.store import Store

        cfg = load(self.remediator_config)
        states = dict.fromkeys(self.nodes, "active")
        if not Path(cfg.store.path).exists():
            return states
        store = Store(cfg.store.path, cfg.store.synchronous)
        try:
            states.update({n.node: n.state for n in store.node_states()})
        finally:
            store.close()
        return states

    def incident(self, ref: str) -> dict[str, Any]:
        out = subprocess.run(
            [*REMEDIATOR_CLI, "incidents", "show", ref, "--config", str(self.remediator_config), "--json"],
            capture_output=True, text=True, timeout=120, check=False, env=self._agent_env(),
        )  # fmt: skip
        if out.returncode != 0:
            raise LabError(f"fleetheal incidents show {ref} failed: {out.stderr.strip()}")
        doc: dict[str, Any] = json.loads(out.stdout)
        return doc


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
