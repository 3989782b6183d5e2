"""The whole loop on the lab (real Slurm, Prometheus, Alertmanager, agents, remediator, ansible-runner):
Xid 79 injections and NCCL timeouts the job prints, alternating, on a running 2-node training job; and, in
the same run, stock Slurm's own recovery from a failed node as the peer of the Xid 79 figure.

Xid 79 rounds (timed from writing the fault into the node's simulated-GPU file):
1. fault -> Slurm node DRAIN by the agent's fast path (`scontrol show node`, polled every 50 ms). Goal p99 < 2 s.
2. fault -> the alert at the remediator (the incident's `received_at`: agent poll, Prometheus scrape and
   rule evaluation, Alertmanager).
3. fault -> the training running again on healthy nodes: the job runs as `make demo`'s does, on 2 nodes
   with a hot spare in its allocation (`fleetheal launch --nodes 2`), so the remediator shrinks the failed
   node away and the launcher starts the training again on the rest (no requeue, no credential hold; a
   fresh job when its spare is spent); the lab has 3 active and 3 warm-standby nodes, one promoted per
   round. Goal p50 < 5 s, p99 < 10 s. Every Slurm timer is the deployed stack's (fleetheal.slurm.conf).
   Reported next to it: the platform overhead (the same less the lab's grace period, 3 s, in which the
   job checkpoints) and the application restart (RUNNING -> the training process's own start event).
   Notes carry the per-phase medians: first response / playbook, grace signal, requeue, promotion, from
   the incident's timeline and the job's events.

NCCL-timeout rounds (`nccl-timeout`, transient, RESTART_IN_PLACE; raised as `make demo` raises it: the job's
rank 0 prints PyTorch's watchdog line and hangs, `fleetheal launch` on the batch host passes the line to that
node's agent; nothing is injected on a node): fault -> training running again on the same nodes, seen through
the lab's public behaviour only, so the figure keeps its meaning when the job's restart mechanism changes:
either Slurm's restart count goes up and the job is RUNNING (a requeue in place), or the job's
`events.jsonl` has a new `start` event after the fault while the job stays RUNNING (a restart inside the
allocation, `fleetheal launch`). The notes say which path each round took. The platform overhead is the
same less the lab's grace period (goal p50 < 3 s).

The peer of "Xid 79 -> job RUNNING again" (measured in the same run, in a private 4-node SlurmCluster,
before the lab starts): stock Slurm's documented pattern for node health, NHC-style. A HealthCheckProgram
(a shell script this module writes) runs on every node each HealthCheckInterval and sets its own node
DOWN (`scontrol update state=down`) when a per-node fault file exists; the 2-node job was submitted with
`--requeue` (JobRequeue=1), and Slurm requeues it off the DOWN node onto the idle ones by itself. Timed
from writing the fault file to the job RUNNING again with its restart count up. Both clusters run the
deployed stack's timers: the peer's requeue waits cred_expire + 1 s (61 s) as Slurm requires, and its
HealthCheckInterval is the stack's 30 s (Slurm's documentation and NHC use 300 s; then detection alone
adds a median of ~150 s).

After each Xid round a "repair technician" returns the failed node: the fault file is cleared, the
remediator releases it (`fleetheal remediator release`), Slurm gets the standby reason back and its
Kubernetes Node the standby label and taint. A fresh job is submitted after 3 remediations of one job
(the remediator's per-job retry limit counts requeues and restarts in place alike). The agent holds an event
fault for 10 minutes (`health.event_hold_s`) per (GPU, fault), and one alert is one incident, so each Xid
injection uses a GPU the agent holds no Xid 79 for: the rounds rotate the GPU index, and when the worker's
node has none left (a real node goes to repair for longer; the lab's takes seconds), the pool is rebalanced
as an operator would: the job ends, that node goes to standby and a standby node with free GPUs comes into
service (`rotate`). A job-printed fault names the job's run (`job_run`), so NCCL rounds need no rotation:
each restart is a new run.

Rounds run until ROUNDS of each kind are done or FLEETHEAL_BENCH_LAB_S seconds (default 900) have passed;
the peer runs PEER_ROUNDS rounds (FLEETHEAL_BENCH_LAB_PEER_ROUNDS, default 20) within PEER_BUDGET_S. The
whole module takes about 17 minutes. Needs root and the lab's Debian packages.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetheal.agent.client import TrainingReporter
from fleetheal.agent.simulated import clear
from fleetheal.contracts import LABEL_POOL, TAINT_STANDBY, owns_reason
from fleetheal.lab.kubeapi import KubeApiError
from fleetheal.lab.lab import LAB_SITE_VARS, STANDBY_REASON, Lab
from fleetheal.lab.labkube import PLACEHOLDER_IMAGE
from fleetheal.lab.measure import measure
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.lab.train import MISBEHAVE, read_events
from fleetheal.lab.watcher import expand_nodelist
from fleetheal.slurm import conf
from fleetheal.wait import WaitTimeout, wait_until

BUDGET_S = float(os.environ.get("FLEETHEAL_BENCH_LAB_S", "900"))
ROUNDS = int(os.environ.get("FLEETHEAL_BENCH_LAB_ROUNDS", "20"))
PEER_ROUNDS = int(os.environ.get("FLEETHEAL_BENCH_LAB_PEER_ROUNDS", "20"))
PEER_BUDGET_S = float(os.environ.get("FLEETHEAL_BENCH_LAB_PEER_S", "840"))
XID = "xid-79"
NCCL = "nccl-timeout"
GRACE_S = float(LAB_SITE_VARS["fleetheal_grace_seconds"])
#: The remediator's per-job retry limit (gate.max_requeues_per_job): a fresh job after this many actions.
MAX_REQUEUES = 3
#: The agent's `health.event_hold_s` (default) plus a margin: a label used longer ago than this is free.
EVENT_HOLD_S = 600.0 + 30.0
#: The peer: a 4-node stock Slurm with an NHC-style HealthCheckProgram.
PEER_NODES = 4
PEER_HC_INTERVAL_S = conf.HEALTH_CHECK_INTERVAL_S
PEER_HC_PRODUCTION_S = 300


def _poll(check: Callable[[], Any], timeout: float, interval: float) -> Any:
    """`check()`'s first true value within `timeout` (an error counts as "not yet"); None after it."""
    with contextlib.suppress(WaitTimeout):
        return wait_until(check, timeout, "a condition", interval=interval, ignore=(Exception,))
    return None


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _label(ev: dict[str, Any]) -> str:
    return str(ev.get("detail", "")).split("|")[-1].replace("(localhost)", "").strip()


def _timeline_firsts(full: dict[str, Any], t0: float) -> dict[str, float]:
    """First time (s after the fault) of each playbook start, changed playbook task and first-response step
    (the remediator's in-process steps: `first_step` events, e.g. `slurm_requeue done: ...`)."""
    firsts: dict[str, float] = {}
    for ev in full.get("timeline") or []:
        key = ""
        if ev.get("kind") == "step" and str(ev.get("what", "")).startswith("playbook"):
            key = "playbook"
        elif ev.get("kind") == "step" and ev.get("what") == "first_response":
            key = "first_response"
        elif ev.get("kind") == "event" and ev.get("what") == "task_changed":
            key = _label(ev)
        elif ev.get("kind") == "event" and ev.get("what") == "first_step":
            step, _, rest = str(ev.get("detail", "")).partition(" ")
            if rest.startswith("done"):
                key = step
        if key:
            firsts.setdefault(key, float(ev["ts"]) - t0)
    return firsts


class Bench:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.cluster = lab.slurm()
        self.job: str | None = None
        self.run_dir: Path | None = None
        self.runs: list[Path] = []
        self.acted = 0  # remediations of the current job
        self.labels: dict[tuple[str, str, int | None], float] = {}  # (node, fault, gpu) -> last used
        self.rounds: dict[str, list[dict[str, Any]]] = {XID: [], NCCL: []}
        self.gpus: list[int | None] = list(range(int(lab.meta["gpus"])))
        self.failures: dict[str, list[str]] = {XID: [], NCCL: []}

    def new_job(self, *, submit: bool = True) -> None:
        """End the current job, then (`submit`) start a fresh one."""
        if self.job is not None:
            self.cluster.run("scancel", self.job, check=False)
            # What an epilog would do: tell every agent the old job's ranks ended, so their silence is
            # not taken for a hang (job-hang, 300 s later, would open incidents for a job that is gone).
            for node in self.lab.nodes:
                for rank in (0, 1):
                    rep = TrainingReporter(self.job, rank, socket_path=str(self.lab.node_dir(node) / "training.sock"))
                    rep.end()
                    rep.close()
            self.job = None
        if not submit:
            return
        # 2 nodes and a hot spare, as `make demo` runs it: an Xid 79 relocates inside the allocation.
        self.job, self.run_dir = self.lab.submit_training(name=f"bench{len(self.runs)}", spares=1)
        self.runs.append(self.run_dir)
        self.acted = 0

    def job_info(self) -> dict[str, str]:
        assert self.job is not None
        return self.cluster.job(self.job)

    def starts(self) -> list[dict[str, Any]]:
        assert self.run_dir is not None
        return [e for e in read_events(self.run_dir) if e.get("event") == "start"]

    def ready(self) -> bool:
        """The job runs and has trained a little since its last start."""
        assert self.run_dir is not None
        info = self.job_info()
        if info.get("JobState") != "RUNNING":
            return False
        ev = read_events(self.run_dir)
        starts = [e for e in ev if e.get("event") == "start"]
        prog = [e for e in ev if e.get("event") == "progress"]
        return bool(starts and prog and float(prog[-1]["time"]) > float(starts[-1]["time"]) + 2)

    def prepare(self, *, spare: bool = False) -> dict[str, str]:
        """A running job with retries left (and, with `spare`, its hot spare still unused); its `scontrol show
        job` fields."""
        if (
            self.job is None
            or self.acted >= MAX_REQUEUES
            or int(self.job_info().get("Restarts", "0")) >= MAX_REQUEUES
            or (spare and len(expand_nodelist(self.job_info().get("NodeList", ""))) < 3)
        ):
            self.new_job()
        if not _poll(self.ready, 90, 0.25):
            i = self.job_info()
            nodes = "; ".join(
                f"{n.name} {'+'.join([n.state, *sorted(n.flags)])} {n.reason or ''}".strip()
                for n in self.cluster.nodes().values()
            )
            raise RuntimeError(f"job {self.job} is not running: {i.get('JobState')} {i.get('Reason')}; nodes: {nodes}")
        return self.job_info()

    def free_label(self, node: str, fault: str, gpus: list[int | None]) -> tuple[bool, int | None]:
        """(True, a GPU label on `node` the agent does not hold `fault` active for), or (False, None)."""
        now = time.monotonic()
        for gpu in gpus:
            if now - self.labels.get((node, fault, gpu), -1e9) > EVENT_HOLD_S:
                return True, gpu
        return False, None

    def finished(self, node: str, fault: str, t0: float, timeout: float) -> dict[str, Any] | None:
        def done() -> dict[str, Any] | None:
            for inc in self.lab.incidents(limit=20):
                if (
                    inc.get("node") == node
                    and inc.get("fault_id") == fault
                    and float(inc.get("received_at") or 0) >= t0 - 1
                    and inc.get("state") in ("done", "failed")
                ):
                    return inc
            return None

        found: dict[str, Any] | None = _poll(done, timeout, 0.5)
        return found

    def last_incident(self, node: str) -> str:
        incs = [x for x in self.lab.incidents(limit=10) if x.get("node") == node]
        last = incs[0] if incs else {}
        return (
            f"incident {last.get('id')} {last.get('fault_id')} {last.get('state')}: "
            f"{str(last.get('outcome') or last.get('hold_reason') or '')[:160]}"
        )

    # ---- Xid 79: isolate and relocate --------------------------------------------------------------

    def rotate(self, worn: str) -> bool:
        """The worker's node `worn` has no GPU the agent holds no Xid 79 for (the lab's repair takes seconds, a
        real one far longer than the hold): an operator's rebalance of the pool. The job ends, `worn` goes to
        standby and a standby node with a free GPU comes into service in its place; False when there is none."""
        fresh = [
            n
            for n in self.lab.nodes
            if n != worn and self.cluster.node(n).reason == STANDBY_REASON and self.free_label(n, XID, self.gpus)[0]
        ]
        if not fresh:
            return False
        self.new_job(submit=False)
        self.to_pool(worn, "standby")
        self.to_pool(fresh[0], "active")
        return True

    def xid_round(self) -> None:
        gpus = self.gpus
        info = self.prepare(spare=True)
        assert self.run_dir is not None
        # The worker's node (`srun --relative=1`): not the batch host, not the spare.
        node = expand_nodelist(info["NodeList"])[1]
        free, gpu = self.free_label(node, XID, gpus)
        if not free and self.rotate(node):
            info = self.prepare(spare=True)
            node = expand_nodelist(info["NodeList"])[1]
            free, gpu = self.free_label(node, XID, gpus)
        if not free:
            raise RuntimeError(f"every GPU label of {node} was used for {XID} in the last {EVENT_HOLD_S:.0f} s")
        self.labels[(node, XID, gpu)] = time.monotonic()
        restarts0 = int(info.get("Restarts", "0"))
        starts0 = len(self.starts())
        self.acted += 1
        t0 = time.time()
        self.lab.inject(node, XID, gpu)

        def drained() -> float | None:
            n = self.cluster.node(node)
            return time.time() - t0 if n.drained and owns_reason(n.reason) else None

        def running() -> float | None:
            i = self.job_info()
            if i.get("JobState") != "RUNNING":
                return None
            if int(i.get("Restarts", "0")) > restarts0:
                r["path"] = "requeue"
                return time.time() - t0
            if node not in expand_nodelist(i.get("NodeList", "")) and len(self.starts()) > starts0:
                r["path"] = "in-allocation"  # the spare took over: the training started again without it
                return time.time() - t0
            return None

        r: dict[str, Any] = {}
        d = _poll(drained, 30, 0.05)
        if d is None:
            self.failures[XID].append(f"{node} gpu {gpu}: not drained within 30 s")
            self.repair(node)
            return
        r["drain"] = d
        again = _poll(running, 240, 0.2)
        if again is None:
            i = self.job_info()
            self.failures[XID].append(
                f"{node} gpu {gpu}: job {self.job} not running again within 240 s ({i.get('JobState')} "
                f"{i.get('Reason')}; {self.last_incident(node)})"
            )
            self.repair(node)
            return
        r["running"] = again

        full = self.after_running(r, XID, node=node, t0=t0, starts0=starts0, timeout=180, where=f"{node} gpu {gpu}")
        if full is not None:
            firsts = _timeline_firsts(full, t0)
            r["playbook_start"] = firsts.get("playbook", float("nan"))
            for key, value in firsts.items():
                if "equeue" in key:
                    r.setdefault("requeue", value)
                if "standby" in key.lower() or "romote" in key:
                    r.setdefault("promote", value)
            r["incident_done"] = float(full.get("phases", {}).get("total") or float("nan"))
        self.rounds[XID].append(r)
        self.repair(node)

    def after_running(
        self, r: dict[str, Any], fault: str, *, node: str, t0: float, starts0: int, timeout: float, where: str
    ) -> dict[str, Any] | None:
        """Once the job runs again: when its training started again (the first start after the fault), when
        it got the grace signal, when the alert reached the remediator; the finished incident, or None."""
        assert self.run_dir is not None

        def resumed() -> float | None:
            st = self.starts()
            return float(st[starts0]["time"]) - t0 if len(st) > starts0 else None

        res = _poll(resumed, 60, 0.1)
        if res is not None:
            r["resumed"] = res
        sig = [e for e in read_events(self.run_dir) if e.get("event") == "signal" and float(e["time"]) > t0]
        if sig:
            r["grace_signal"] = float(sig[0]["time"]) - t0
        inc = self.finished(node, fault, t0, timeout)
        if inc is None:
            self.failures[fault].append(f"{where}: incident not finished within {timeout:.0f} s")
            return None
        r["alert"] = float(inc["received_at"]) - t0
        r["state"] = inc.get("state")
        full: dict[str, Any] = self.lab.incident(inc["id"])
        return full

    def repair(self, node: str) -> None:
        """A technician returns the node to the warm-standby pool."""
        clear(self.lab.node_dir(node) / "sim-gpus.json")
        subprocess.run(
            [sys.executable, "-m", "fleetheal", "remediator", "release", node, "--config",
             str(self.lab.remediator_config), "--reason", "bench_lab: repaired"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        self.to_pool(node, "standby")

    def to_pool(self, node: str, pool: str) -> None:
        """Put `node` in the warm-standby pool (drained with the standby reason, labelled and tainted) or in
        service ("active": resumed, labelled, untainted), as the remediator's promotion does."""
        if pool == "standby":
            self.cluster.scontrol("update", f"nodename={node}", "state=drain", f"reason={STANDBY_REASON}")
        else:
            self.cluster.scontrol("update", f"nodename={node}", "state=resume")
        patch = {
            "metadata": {"labels": {LABEL_POOL: pool}},
            "spec": {
                "unschedulable": False,
                "taints": [{"key": TAINT_STANDBY, "effect": "NoSchedule"}] if pool == "standby" else [],
            },
        }
        with contextlib.suppress(Exception):  # as the admin: the agents' tokens may not touch the pool
            self.lab.kube_request("PATCH", f"/api/v1/nodes/{node}", patch, "application/merge-patch+json")
        self.replace_pods(node)

    def replace_pods(self, node: str) -> None:
        """What the StatefulSet controller would do, which the lab does not run: the node's slurmd pod, evicted
        by the drain, is created again on it (the lab's kubelet stand-in marks it Running). Without it the
        PodDisruptionBudget (maxUnavailable 1) counts the missing pod, and the next Xid round's eviction is
        refused: its playbook fails after two attempts of a minute each."""
        name = f"slurm-worker-{node}"
        with contextlib.suppress(KubeApiError):
            self.lab.kube_request("GET", f"/api/v1/namespaces/slurm/pods/{name}")
            return
        try:
            owner = self.lab.kube_request("GET", "/apis/apps/v1/namespaces/slurm/statefulsets/slurm-worker")
            uid = owner["metadata"]["uid"]
        except KubeApiError:  # the API double holds no workloads: an owner in name only
            uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, "slurm-worker"))
        pod = {
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/name": "slurmd"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "slurm-worker",
                                     "uid": uid, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": PLACEHOLDER_IMAGE}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        }  # fmt: skip
        try:
            self.lab.kube_request("POST", "/api/v1/namespaces/slurm/pods", pod)
        except KubeApiError as exc:
            if exc.status != 409:  # 409: still terminating; the next repair of this node tries again
                raise

    # ---- NCCL timeout: restart in place ------------------------------------------------------------

    def nccl_round(self) -> None:
        info = self.prepare()
        assert self.run_dir is not None
        nodes = expand_nodelist(info["NodeList"])
        node = nodes[0]  # the batch host, where `fleetheal launch` reads rank 0's output
        restarts0 = int(info.get("Restarts", "0"))
        starts0 = len(self.starts())
        self.acted += 1
        t0 = time.time()
        # As `make demo` raises it: rank 0 prints PyTorch's watchdog line and hangs; nothing is injected on
        # the node. Each run of the job that prints it raises its own fault (the alert names the run).
        (self.run_dir / MISBEHAVE).write_text(f"{NCCL}\n")
        r: dict[str, Any] = {}

        def running() -> tuple[float, str] | None:
            i = self.job_info()
            if i.get("JobState") != "RUNNING":
                return None
            if int(i.get("Restarts", "0")) > restarts0:
                return time.time() - t0, "requeue"
            st = self.starts()
            if len(st) > starts0 and float(st[-1]["time"]) > t0:
                return float(st[starts0]["time"]) - t0, "in-job"
            return None

        again = _poll(running, 120, 0.1)
        where = f"{node} job {self.job}"
        if again is None:
            i = self.job_info()
            self.failures[NCCL].append(
                f"{where}: job {self.job} not running again within 120 s ({i.get('JobState')} {i.get('Reason')}; "
                f"{self.last_incident(node)})"
            )
            return
        r["running"], r["path"] = again
        r["same_nodes"] = sorted(expand_nodelist(self.job_info()["NodeList"])) == sorted(nodes)

        full = self.after_running(r, NCCL, node=node, t0=t0, starts0=starts0, timeout=120, where=where)
        if full is not None:
            firsts = _timeline_firsts(full, t0)
            for key, value in firsts.items():
                if "equeue" in key:  # slurm_requeue: a requeue in place, or the in-job restart order
                    r.setdefault("restart_order", value)
            r["incident_done"] = float(full.get("phases", {}).get("total") or float("nan"))
        self.rounds[NCCL].append(r)


# ---- the peer: stock Slurm's own recovery ---------------------------------------------------------

HEALTHCHECK = """\
#!/bin/sh
# bench_lab's stock-Slurm peer: an NHC-style HealthCheckProgram. slurmd runs it on every node each
# HealthCheckInterval with SLURMD_NODENAME set (not SLURM_CONF); a non-zero exit only logs, so a check
# that finds its node bad marks it DOWN itself, and Slurm requeues the node's --requeue jobs.
export SLURM_CONF={conf}
f={faults}/"$SLURMD_NODENAME"
if [ -e "$f" ]; then
    {scontrol} update nodename="$SLURMD_NODENAME" state=down reason="healthcheck: $(cat "$f")"
fi
exit 0
"""


class Peer:
    """A private 4-node Slurm whose HealthCheckProgram sets a node DOWN when its fault file exists."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults = root / "faults"
        self.faults.mkdir(parents=True, exist_ok=True)
        hc = root / "healthcheck.sh"
        self.cluster = SlurmCluster(
            root / "slurm",
            nodes=PEER_NODES,
            gpus_per_node=8,
            node_prefix="p",
            cluster_name="peer",
            fast_timers=False,  # the deployed timers, as the lab's
            extra_conf=[f"HealthCheckProgram={hc}", f"HealthCheckInterval={PEER_HC_INTERVAL_S}",
                        "HealthCheckNodeState=ANY"],
        )  # fmt: skip
        scontrol = shutil.which("scontrol") or "/usr/bin/scontrol"
        hc.write_text(
            HEALTHCHECK.format(
                conf=shlex.quote(str(self.cluster.conf_path)),
                faults=shlex.quote(str(self.faults)),
                scontrol=shlex.quote(scontrol),
            )
        )
        hc.chmod(0o755)
        self.job: str | None = None
        self.rng = random.Random(0)  # the phase of each fault against the health check (seeded)
        self.running: list[float] = []
        self.down: list[float] = []
        self.failures: list[str] = []

    def new_job(self) -> None:
        if self.job is not None:
            self.cluster.run("scancel", self.job, check=False)
        self.job = self.cluster.sbatch(
            "#!/bin/sh\nexec sleep 1000000\n", "--nodes=2", "--gres=gpu:8", "--requeue", "--exclusive",
            "--job-name=peer", "--output=/dev/null",
        )  # fmt: skip

    def job_info(self) -> dict[str, str]:
        assert self.job is not None
        return self.cluster.job(self.job)

    def one_round(self) -> None:
        if self.job is None or int(self.job_info().get("Restarts", "0")) >= MAX_REQUEUES:
            self.new_job()
        if not _poll(lambda: self.job_info().get("JobState") == "RUNNING", 60, 0.2):
            raise RuntimeError(f"peer job {self.job} is not running: {self.job_info()}")
        info = self.job_info()
        node = expand_nodelist(info["NodeList"])[-1]
        restarts0 = int(info.get("Restarts", "0"))
        fault = self.faults / node
        # A fault does not know when the next health check runs: start each round at a random phase of it.
        time.sleep(self.rng.uniform(0, PEER_HC_INTERVAL_S))
        t0 = time.time()
        fault.write_text("xid-79 (bench_lab peer)\n")
        down: float | None = None

        def running() -> float | None:
            nonlocal down
            if down is None and self.cluster.node(node).state == "DOWN":
                down = time.time() - t0
            i = self.job_info()
            ok = i.get("JobState") == "RUNNING" and int(i.get("Restarts", "0")) > restarts0
            return time.time() - t0 if ok else None

        # Detection (the health check), the requeue's credential hold, a scheduler pass, and a margin.
        again = _poll(running, PEER_HC_INTERVAL_S + conf.CRED_EXPIRE_S + conf.SCHED_INTERVAL_S + 60, 0.2)
        if again is None:
            i = self.job_info()
            self.failures.append(f"{node}: job {self.job} not running again ({i.get('JobState')} {i.get('Reason')})")
        else:
            self.running.append(again)
            if down is not None:
                self.down.append(down)
        self.repair(node)

    def repair(self, node: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.faults / node).unlink()

        def back() -> bool:
            n = self.cluster.node(node)
            if n.state == "DOWN" or n.drained:
                self.cluster.scontrol("update", f"nodename={node}", "state=resume", check=False)
                return False
            return n.state == "IDLE" and not n.flags - {"DYNAMIC_NORM"}

        if not _poll(back, 30, 0.2):
            raise RuntimeError(f"peer node {node} did not come back: {self.cluster.node(node)}")


@dataclass
class PeerResult:
    running: list[float] = field(default_factory=list)  # fault -> job RUNNING again, per round
    down: list[float] = field(default_factory=list)  # fault -> node DOWN (the health check ran)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def stock_slurm_peer(stop: threading.Event) -> PeerResult:
    """PEER_ROUNDS rounds of stock Slurm's health-check-and-requeue recovery (fewer when `stop` is set or
    PEER_BUDGET_S has passed); the cluster and its files are gone after."""
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="fleetheal-bench-peer-"))
    peer = Peer(root)
    try:
        peer.cluster.start()
        t_end = time.monotonic() + PEER_BUDGET_S
        while len(peer.running) + len(peer.failures) < PEER_ROUNDS and time.monotonic() < t_end and not stop.is_set():
            peer.one_round()
    except Exception as exc:  # reported in the notes; the lab still runs
        peer.failures.append(f"stopped: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            peer.cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return PeerResult(peer.running, peer.down, peer.failures, time.monotonic() - started)


# ---- figures ------------------------------------------------------------------------------------


def _figure(name: str, values: list[float], goal: str, notes: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "unit": "s",
        "median": statistics.median(values) if values else None,
        "p99": _pct(values, 99),
        "n": len(values),
        "goal": goal,
        "peer": None,
        "ratio_to_peer": None,
        "notes": notes,
        **extra,
    }


def _col(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rounds if isinstance(r.get(key), (int, float)) and r[key] == r[key]]


def _med(rounds: list[dict[str, Any]], key: str) -> float | None:
    v = _col(rounds, key)
    return statistics.median(v) if v else None


def _fmt(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _failed(failures: list[str]) -> str:
    return f"; {len(failures)} rounds failed: {'; '.join(failures[:3])}" if failures else ""


def run() -> list[dict[str, Any]]:
    started = time.monotonic()
    # The peer runs side by side with the lab, in a thread: its timings are Slurm's timers (health-check
    # interval, credential expiry, scheduler passes), its load is small, and it costs no extra wall time.
    stop = threading.Event()
    peers: list[PeerResult] = []
    thread = threading.Thread(target=lambda: peers.append(stock_slurm_peer(stop)), name="bench-lab-peer", daemon=True)
    thread.start()
    lab_dir = tempfile.mkdtemp(prefix="fleetheal-bench-lab-")
    lab = Lab(lab_dir, log=lambda text: None)
    errors: list[str] = []
    bench: Bench | None = None
    measured: list[Any] = []
    try:
        lab.up(nodes=3, standby=3, gpus=8)
        bench = Bench(lab)
        t_end = time.monotonic() + BUDGET_S
        kinds = (XID, NCCL)
        i = 0
        while time.monotonic() < t_end - 45:
            done = {k: len(bench.rounds[k]) + len(bench.failures[k]) for k in kinds}
            if all(done[k] >= ROUNDS for k in kinds):
                break
            if done[XID] >= ROUNDS:
                kind = NCCL
            elif done[NCCL] >= ROUNDS:
                kind = XID
            else:  # alternate
                kind = kinds[i % 2]
                i += 1
            try:
                (bench.xid_round if kind == XID else bench.nccl_round)()
            except Exception as exc:  # one broken round is reported; the lab still goes down
                errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                break
        now = time.time()  # the last run is still going; earlier ones ended at their last event (scancel)
        runs = [measure(read_events(d), now if d == bench.runs[-1] else None) for d in bench.runs]
        measured = [m for m in runs if m is not None]
    except BaseException:
        stop.set()  # the lab failed: the peer's figure alone is of no use
        raise
    finally:
        lab.down(quiet=True)
        if os.environ.get("FLEETHEAL_BENCH_LAB_KEEP"):  # logs and state for a post-mortem (daemons are down)
            print(f"bench_lab: kept {lab_dir}", file=sys.stderr)
        else:
            shutil.rmtree(lab_dir, ignore_errors=True)
        thread.join(PEER_BUDGET_S + 180)
    lab_s = time.monotonic() - started
    assert bench is not None
    peer = peers[0] if peers else PeerResult(failures=["the peer did not finish"])
    xid, nccl = bench.rounds[XID], bench.rounds[NCCL]
    if not xid and not nccl:
        raise RuntimeError(f"no round completed: {bench.failures[XID] + bench.failures[NCCL] + errors}")
    err = f"; stopped: {errors[0]}" if errors else ""
    took = f"; wall time: peer {peer.wall_s:.0f} s alongside the lab's {lab_s:.0f} s"
    return [
        *_xid_figures(xid, bench.failures[XID], peer, err, took),
        *_nccl_figures(nccl, bench.failures[NCCL], err),
        *_ettr_figure(measured, len(xid) + len(nccl), lab_s),
    ]


def _xid_figures(
    rounds: list[dict[str, Any]], failures: list[str], peer: PeerResult, err: str, took: str
) -> list[dict[str, Any]]:
    m = {k: _med(rounds, k) for k in ("drain", "alert", "playbook_start", "grace_signal", "requeue", "promote",
                                      "running", "resumed", "incident_done")}  # fmt: skip
    phases = (
        f"median s after the fault: drained {_fmt(m['drain'])}, alert at remediator {_fmt(m['alert'])}, playbook "
        f"start {_fmt(m['playbook_start'])}, grace signal/checkpoint {_fmt(m['grace_signal'])}, requeue "
        f"{_fmt(m['requeue'])}, standby promoted {_fmt(m['promote'])}, RUNNING {_fmt(m['running'])}, app started "
        f"{_fmt(m['resumed'])}, incident done {_fmt(m['incident_done'])}; paths: "
        f"{sum(1 for r in rounds if r.get('path') == 'in-allocation')} inside the allocation (the spare), "
        f"{sum(1 for r in rounds if r.get('path') == 'requeue')} requeued"
    )
    running = _col(rounds, "running")
    peer_med = statistics.median(peer.running) if peer.running else None
    ours = statistics.median(running) if running else None
    peer_note = (
        f"; peer: stock Slurm, HealthCheckProgram every {PEER_HC_INTERVAL_S} s (the stack's; NHC's usual "
        f"{PEER_HC_PRODUCTION_S} s) sets the node DOWN, Slurm requeues the --requeue job, median {_fmt(peer_med)} s "
        f"(n {len(peer.running)})"
    )
    platform = [v - GRACE_S for v in running]
    # Only a requeued job has a moment between RUNNING and its training's start: inside the allocation the
    # training's start is what says it runs again.
    app = [
        r["resumed"] - r["running"] for r in rounds if "resumed" in r and "running" in r and r.get("path") == "requeue"
    ]
    peer_fail = _failed(peer.failures)
    down = statistics.median(peer.down) if peer.down else None
    main = _figure(
        "Xid 79 -> training running again on healthy nodes (hot spare)", running, "p50 < 5 s, p99 < 10 s",
        phases + peer_note,
        key="xid79_running_again", phases={k: v for k, v in m.items() if v is not None},
    )  # fmt: skip
    if peer_med and ours is not None:
        main["peer"] = peer_med
        main["ratio_to_peer"] = ours / peer_med
    return [
        _figure("Xid 79 -> Slurm node drained (agent fast path)", _col(rounds, "drain"), "p99 < 2 s",
                f"scontrol polled every 50 ms{_failed(failures)}{err}", key="xid79_drained"),
        _figure("Xid 79 -> alert at the remediator", _col(rounds, "alert"), "-",
                "agent poll 1 s + Prometheus scrape/eval 1 s + Alertmanager group_wait 0 s (lab intervals)",
                key="xid79_alert"),
        main,
        _figure("  of which platform overhead (less the 3 s grace period)", platform, "-",
                "RUNNING again minus the lab's fleetheal_grace_seconds", key="xid79_platform"),
        _figure("  then application restart (RUNNING -> training started)", app, "-",
                "requeued rounds only (inside the allocation, the training's start is the figure above); the lab's "
                "toy job; a large job's launch + NCCL init + checkpoint load is far longer",
                key="xid79_app_restart"),
        _figure(
            f"  peer: stock Slurm HealthCheckProgram ({PEER_HC_INTERVAL_S} s) + --requeue, fault -> RUNNING again",
            peer.running, "-",
            f"private {PEER_NODES}-node SlurmCluster with the deployed timers, as the lab's (cred_expire="
            f"{conf.CRED_EXPIRE_S}, sched_interval={conf.SCHED_INTERVAL_S}, HealthCheckInterval={PEER_HC_INTERVAL_S}); "
            f"an NHC-style script sets its node DOWN when a fault file exists, Slurm requeues the 2-node job onto "
            f"the idle nodes by itself; median fault -> node DOWN {_fmt(down)} s "
            f"(uniform in the {PEER_HC_INTERVAL_S} s interval); with the production {PEER_HC_PRODUCTION_S} s "
            f"interval detection alone adds a median ~{PEER_HC_PRODUCTION_S / 2:.0f} s{peer_fail}{took}",
            key="xid79_peer_stock_slurm",
        ),
    ]  # fmt: skip


def _nccl_figures(rounds: list[dict[str, Any]], failures: list[str], err: str) -> list[dict[str, Any]]:
    m = {k: _med(rounds, k) for k in ("alert", "grace_signal", "restart_order", "running", "resumed", "incident_done")}
    paths = {p: sum(1 for r in rounds if r.get("path") == p) for p in ("in-job", "requeue")}
    moved = sum(1 for r in rounds if not r.get("same_nodes", True))
    how = (
        f"path: {paths['in-job']} in-job restarts (fleetheal launch: new start event, same Slurm job, restart "
        f"count unchanged), {paths['requeue']} requeues in place (restart count up); {moved} moved to other nodes"
    )
    phases = (
        f"median s after the fault: alert at remediator {_fmt(m['alert'])}, grace signal/checkpoint "
        f"{_fmt(m['grace_signal'])}, restart order/requeue {_fmt(m['restart_order'])}, running again "
        f"{_fmt(m['running'])}, training started {_fmt(m['resumed'])}, incident done {_fmt(m['incident_done'])}"
    )
    running = _col(rounds, "running")
    platform = [v - GRACE_S for v in running]
    restart = []
    for r in rounds:
        if r.get("path") == "in-job" and "restart_order" in r and "resumed" in r:
            restart.append(r["resumed"] - r["restart_order"])
        elif r.get("path") == "requeue" and "resumed" in r and "running" in r:
            restart.append(r["resumed"] - r["running"])
    return [
        _figure("NCCL timeout -> training running again in place", running, "-",
                f"printed by the job's rank 0 (nothing injected); {how}; {phases}{_failed(failures)}{err}",
                key="nccl_running_again",
                phases={k: v for k, v in m.items() if v is not None}, paths=paths),
        _figure("  of which platform overhead (less the 3 s grace period)", platform, "p50 < 3 s",
                "running again (requeue: RUNNING with restart count up; in-job: the new start event) minus the lab's "
                "fleetheal_grace_seconds", key="nccl_platform"),
        _figure("  then the restart itself (in-job: restart order -> start; requeue: RUNNING -> start)", restart, "-",
                "restart order = the first response's slurm_requeue step in the incident timeline",
                key="nccl_restart"),
    ]  # fmt: skip


def _ettr_figure(measured: list[Any], rounds: int, lab_s: float) -> list[dict[str, Any]]:
    if not measured:
        return []
    values = [m.ettr for m in measured]
    return [
        {
            "name": "ETTR of the benchmark's training runs (measured)",
            "unit": "ratio",
            "median": statistics.median(values),
            "p99": min(values),
            "n": len(values),
            "goal": "-",
            "peer": None,
            "ratio_to_peer": None,
            "notes": "fleetheal.lab.measure per job: a fault (Xid 79 or NCCL timeout) every ~"
            f"{lab_s / max(1, rounds):.0f} s on a 0.1 s-step job; lost work "
            f"{sum(m.lost_work_s for m in measured):.1f} s of {sum(m.allocated_s for m in measured):.0f} s; "
            "p99 column = worst run",
            "key": "lab_ettr_measured",
        }
    ]
