"""The demo's scenarios (listed in `fleetheal.lab.demo`): each injects one fault into the lab, follows
the self-healing loop through its milestones and returns its `Outcome`.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from fleetheal.agent.joboutput import OOM_REPEATED
from fleetheal.contracts import (
    CHECKPOINT_WORD,
    LABEL_FAILURE_DOMAIN,
    LABEL_POOL,
    LENT_REASON,
    POOL_LENT,
    TAINT_UNHEALTHY,
    owns_reason,
)
from fleetheal.fleet import failover as failmod
from fleetheal.lab import LabError
from fleetheal.lab.federation import Federation, SlurmError
from fleetheal.lab.fedremediator import ClusterRemediator
from fleetheal.lab.lab import Lab
from fleetheal.lab.labkube import INFERENCE_NAMESPACE, LEND_NODES, PLACEHOLDER_IMAGE
from fleetheal.lab.train import MISBEHAVE, ettr, read_checkpoint, read_events
from fleetheal.lab.watcher import (
    Outcome,
    Watcher,
    continuity,
    expand_nodelist,
    follow,
    last_progress_step,
    run_starts,
)
from fleetheal.tools import CHECKOUT
from fleetheal.wait import WaitTimeout, wait_until

#: Seconds between checkpoints of the demo's training job, and its step time.
CHECKPOINT_EVERY = 3.0
STEP_TIME = 0.1

#: What a GPU that falls off the bus raises: the Xid from the kernel log and, from NVML, the lost GPU. Which
#: alert reaches the remediator first is a race (each is its own Alertmanager group); the first one acts.
LOST_GPU = ("xid-79", "gpu-lost")


def incident_for(
    lab: Lab, node: str, fault: str | tuple[str, ...], after: float, *, acted: bool = False
) -> dict[str, Any] | None:
    """The first incident for `fault` (or one of them) on `node` since `after`; with `acted`, the first one
    the gate let act."""
    faults = (fault,) if isinstance(fault, str) else fault
    found = [
        inc
        for inc in lab.incidents()
        if inc.get("node") == node
        and inc.get("fault_id") in faults
        and float(inc.get("received_at") or after) >= after - 1
        and (not acted or inc.get("decision") in ("allow", "would_run"))
    ]
    return min(found, key=lambda inc: str(inc["id"])) if found else None


def scenario_xid79(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
    nodes = w.job_nodes()
    # A node the training runs on: not the batch host (the launcher's, nodes[0]) nor the hot spare (the last);
    # `srun --relative=1` puts the worker on the second node of the allocation.
    node = nodes[1]
    before = w.job_info()
    restarts0 = int(before.get("Restarts", "0"))
    starts0 = len(run_starts(w.run_dir))
    standby = [n for n in lab.standby_nodes if owns_reason(lab.slurm().node(n).reason)]
    o = Outcome("GPU fell off the bus", "xid-79", node, 3, "ISOLATE_AND_RELOCATE")
    t_inject = time.time()

    def detected() -> str | None:
        h = (lab.node_dir(node) / "health").read_text().strip()
        return f"agent on {node} reports {h}" if h not in ("ok", "") else None

    def drained() -> str | None:
        n = lab.slurm().node(node)
        return f"Slurm {node} {n.state}+DRAIN, reason '{n.reason}'" if n.drained and owns_reason(n.reason) else None

    def tainted() -> str | None:
        spec = lab.k8s_nodes()[node].get("spec") or {}
        t = [x for x in spec.get("taints") or [] if x["key"] == TAINT_UNHEALTHY]
        return f"Node {node} tainted {t[0]['key']}={t[0].get('value')}:NoSchedule" if t else None

    def incident() -> str | None:
        inc = incident_for(lab, node, LOST_GPU, t_inject, acted=True)
        if inc is None:
            return None
        o.details["incident"] = inc["id"]
        return f"{inc['id']} opened by the alert, gate {inc.get('decision') or 'pending'}"

    def grace() -> str | None:
        sig = [e for e in read_events(w.run_dir) if e.get("event") == "signal" and float(e["time"]) > t_inject]
        return f"job {w.job} got {sig[0]['signal']}, checkpointed at step {sig[0]['step']}" if sig else None

    def relocated() -> str | None:
        info = w.job_info()
        if int(info.get("Restarts", "0")) > restarts0:
            o.details["relocation"] = "requeue"
            return f"job {w.job} requeued (restart count {info['Restarts']}), {info.get('JobState')}"
        if info.get("JobState") == "RUNNING" and node not in expand_nodelist(info.get("NodeList", "")):
            # `fleetheal launch --nodes 2`: the spare takes over inside the allocation, no requeue.
            o.details["relocation"] = "in-allocation"
            return f"job {w.job} shrunk off {node} inside its allocation, now {info['NodeList']} (no requeue)"
        return None

    def cordoned() -> str | None:
        k = lab.k8s_nodes()[node]
        pool = (k["metadata"].get("labels") or {}).get(LABEL_POOL)
        return (
            f"Node {node} unschedulable, pods evicted, pool={pool}"
            if (k.get("spec") or {}).get("unschedulable")
            else None
        )

    def promoted() -> str | None:
        for s in standby:
            n = lab.slurm().node(s)
            k = lab.k8s_nodes()[s]
            if not n.drained and (k["metadata"].get("labels") or {}).get(LABEL_POOL) == "active":
                o.details["promoted"] = s
                return f"standby {s} resumed in Slurm, Node {s} pool=active"
        return None

    def running_again() -> str | None:
        info = w.job_info()
        if info.get("JobState") != "RUNNING" or "relocated" not in o.milestones:
            return None
        if int(info.get("Restarts", "0")) > restarts0 or len(run_starts(w.run_dir)) > starts0:
            o.details["new_nodes"] = expand_nodelist(info["NodeList"])
            return f"job {w.job} RUNNING on {info['NodeList']}, training started again"
        return None

    def resumed() -> str | None:
        st = run_starts(w.run_dir)
        if len(st) > starts0:
            o.details["resumed_from"] = int(st[-1]["resumed_from"])
            o.details["log_incident"] = st[-1].get("incident")
            return f"resumed from checkpoint step {st[-1]['resumed_from']} (incident {st[-1].get('incident')})"
        return None

    def finished() -> bool:
        inc = incident_for(lab, node, LOST_GPU, t_inject, acted=True)
        return (
            bool(inc and inc.get("state") in ("done", "failed"))
            and "resumed" in o.milestones
            and "promoted" in o.milestones
        )

    checks = [
        ("detected", "detected", detected),
        ("drained", "drained (agent fast path)", drained),
        # the agent taints after its fleet-budget check (1.2 s); the first responder may taint it first
        ("tainted", "Kubernetes node tainted", tainted),
        ("incident", "incident", incident),
        ("grace", "grace signal", grace),
        ("relocated", "relocated", relocated),
        ("cordoned", "Kubernetes node cordoned and drained", cordoned),
        ("promoted", "standby promoted", promoted),
        ("running", "job running again", running_again),
        ("resumed", "resumed", resumed),
    ]
    w.run(o, checks, finished, timeout=300)
    o.incidents = [lab.incident(o.details["incident"])] if "incident" in o.details else []
    o.ok = o.incidents[0].get("state") == "done" if o.incidents else False
    return o


def scenario_xid31(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
    node = w.job_nodes()[0]
    restarts0 = int(w.job_info().get("Restarts", "0"))
    o = Outcome("user error (MMU fault)", "xid-31", node, 0, "REFUSE_AND_REPORT")
    t_inject = time.time()
    log = w.run_dir / "train.log"

    def detected() -> str | None:
        inc = incident_for(lab, node, "xid-31", t_inject)
        if inc is None:
            return None
        o.details["incident"] = inc["id"]
        return f"{inc['id']} opened by the alert ({inc.get('fault_class', 'user')})"

    def told() -> str | None:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "xid-31" in ln and "not requeued" in ln]
        if lines:
            o.details["cause"] = lines[-1]
            return f"cause written to the job log: {lines[-1]}"
        return None

    def finished() -> bool:
        inc = incident_for(lab, node, "xid-31", t_inject)
        return bool(inc and inc.get("state") in ("done", "failed")) and "told" in o.milestones

    w.run(o, [("incident", "incident", detected), ("told", "user told", told)], finished, timeout=240)
    n = lab.slurm().node(node)
    info = w.job_info()
    o.details["node_drained"] = n.drained
    o.details["restarts"] = int(info.get("Restarts", "0")) - restarts0
    o.details["job_state"] = info.get("JobState")
    shown = lab.slurm().scontrol("show", "job", "-o", w.job)
    m = re.search(r"\bComment=(.*?)(?= [A-Z][A-Za-z]+=|$)", shown.strip())
    o.details["comment"] = m.group(1) if m else ""
    out(f"  result: {node} {n.state}{'+DRAIN' if n.drained else ''} (not drained), job {w.job} {info.get('JobState')} "
        f"with {o.details['restarts']} new restarts")  # fmt: skip
    o.incidents = [lab.incident(o.details["incident"])] if "incident" in o.details else []
    o.ok = not n.drained and o.details["restarts"] == 0 and bool(o.incidents) and o.incidents[0].get("state") == "done"
    return o


def scenario_nccl(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
    nodes = w.job_nodes()
    node = nodes[0]
    info0 = w.job_info()
    restarts0 = int(info0.get("Restarts", "0"))
    starts0 = len(run_starts(w.run_dir))
    o = Outcome("NCCL timeout (transient)", "nccl-timeout", node, None, "RESTART_IN_PLACE")
    t_inject = time.time()

    def cause() -> str:
        # Nothing is injected on the node: the job itself prints PyTorch's watchdog line and hangs;
        # `fleetheal launch` (on the batch host, `node`) passes the line to the node's agent.
        (w.run_dir / MISBEHAVE).write_text("nccl-timeout\n")
        o.details["cause"] = "printed by the job"
        return f"the job's rank 0 on {node} prints PyTorch's NCCL watchdog timeout line and hangs in the collective"

    def incident() -> str | None:
        inc = incident_for(lab, node, "nccl-timeout", t_inject)
        if inc is None:
            return None
        o.details["incident"] = inc["id"]
        return f"{inc['id']} opened by the alert"

    def grace() -> str | None:
        sig = [e for e in read_events(w.run_dir) if e.get("event") == "signal" and float(e["time"]) > t_inject]
        return f"job {w.job} got {sig[0]['signal']}, checkpointed at step {sig[0]['step']}" if sig else None

    def running_again() -> str | None:
        info = w.job_info()
        if info.get("JobState") != "RUNNING":
            return None
        if int(info.get("Restarts", "0")) > restarts0:
            o.details["new_nodes"] = expand_nodelist(info["NodeList"])
            return f"job {w.job} RUNNING again on {info['NodeList']} (restart count {info['Restarts']})"
        st = run_starts(w.run_dir)
        if len(st) > starts0 and int(st[-1].get("in_job", 0)) > 0:
            # `fleetheal launch` restarted it inside its allocation: the same job, no requeue.
            o.details["new_nodes"] = expand_nodelist(info["NodeList"])
            return f"job {w.job} restarted inside its allocation on {info['NodeList']} (fleetheal launch)"
        return None

    def resumed() -> str | None:
        st = run_starts(w.run_dir)
        if len(st) > starts0 and "running" in o.milestones:
            o.details["resumed_from"] = int(st[-1]["resumed_from"])
            return f"resumed from checkpoint step {st[-1]['resumed_from']} (incident {st[-1].get('incident')})"
        return None

    def finished() -> bool:
        inc = incident_for(lab, node, "nccl-timeout", t_inject)
        return bool(inc and inc.get("state") in ("done", "failed")) and "resumed" in o.milestones

    checks = [
        ("incident", "incident", incident),
        ("grace", "grace signal", grace),
        ("running", "restarted in place", running_again),
        ("resumed", "resumed", resumed),
    ]
    w.run(o, checks, finished, timeout=240, cause=cause)
    o.details["same_nodes"] = sorted(o.details.get("new_nodes", [])) == sorted(nodes)
    o.details["node_drained"] = lab.slurm().node(node).drained
    o.incidents = [lab.incident(o.details["incident"])] if "incident" in o.details else []
    o.ok = bool(o.incidents) and o.incidents[0].get("state") == "done" and o.details["same_nodes"]
    return o


def scenario_oom(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
    """The job is configured too big: every run that reaches one step prints PyTorch's out-of-memory error and
    exits. The first is restarted in place (it may be a one-off spike); the second, at the same step, is the
    job's own fault: refused, the user told in the job's log, the node untouched. Nothing is injected on a
    node: both faults come from the lines the job printed, through `fleetheal launch` and the node's agent."""
    nodes = w.job_nodes()
    node = nodes[0]  # the batch host, where `fleetheal launch` runs
    starts0 = len(run_starts(w.run_dir))
    at = last_progress_step(w.run_dir) + 30
    o = Outcome("CUDA out of memory twice at one step", "cuda-oom-repeated", node, None, "REFUSE_AND_REPORT")
    t_inject = time.time()
    # What the platform's recoveries cost the run, before the job's own fault ends it.
    o.details["ettr_before"] = ettr(read_events(w.run_dir), t_inject)
    log = w.run_dir / "train.log"

    def cause() -> str:
        (w.run_dir / MISBEHAVE).write_text(f"cuda-oom {at}\n")
        return f"the job is configured too big: every run that reaches step {at} prints PyTorch's OutOfMemoryError"

    def first() -> str | None:
        inc = incident_for(lab, node, "cuda-oom", t_inject)
        if inc is None:
            return None
        o.details["first_incident"] = inc["id"]
        return f"{inc['id']} cuda-oom, raised from the line the job printed -> {inc.get('action')}"

    def restarted() -> str | None:
        st = run_starts(w.run_dir)
        if len(st) > starts0:
            o.details["resumed_from"] = int(st[-1]["resumed_from"])
            return (
                f"restarted in place from checkpoint step {st[-1]['resumed_from']} (incident {st[-1].get('incident')})"
            )
        return None

    def second() -> str | None:
        inc = incident_for(lab, node, OOM_REPEATED, t_inject)
        if inc is None:
            return None
        o.details["incident"] = inc["id"]
        return f"{inc['id']} {OOM_REPEATED}: the same step ran out of memory again -> {inc.get('action')}"

    def told() -> str | None:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if OOM_REPEATED in ln and "fleetheal" in ln]
        if lines:
            o.details["cause"] = lines[-1]
            return f"cause written to the job log: {lines[-1]}"
        return None

    def ended() -> str | None:
        info = w.job_info()
        state = info.get("JobState")
        if state in (None, "RUNNING", "PENDING", "CONFIGURING", "COMPLETING"):  # COMPLETING: still ending
            return None
        o.details["job_state"] = state
        return f"job {w.job} {state}, not restarted again"

    def finished() -> bool:
        inc = incident_for(lab, node, OOM_REPEATED, t_inject)
        return bool(inc and inc.get("state") in ("done", "failed")) and "ended" in o.milestones

    checks = [
        ("first", "first out-of-memory", first),
        ("running", "restarted in place", restarted),
        ("incident", "second out-of-memory at the same step", second),
        ("told", "user told", told),
        ("ended", "job ended", ended),
    ]
    w.run(o, checks, finished, timeout=240, cause=cause)
    o.details["node_drained"] = lab.slurm().node(node).drained
    ids = [o.details[k] for k in ("first_incident", "incident") if k in o.details]
    o.incidents = [lab.incident(i) for i in ids]
    o.ok = (
        len(o.incidents) == 2
        and all(i.get("state") == "done" for i in o.incidents)
        and not o.details["node_drained"]
        and "told" in o.milestones
    )
    return o


def _wait_state(w: Watcher, o: Outcome, t0: float, states: tuple[str, ...], timeout: float) -> str:
    """Wait until `o.node` is in one of `states`, printing each lifecycle state it passes on the way."""
    seen: list[str] = []
    node = o.node

    def check() -> str | None:
        state = w.lab.node_states()[node]
        if not seen or seen[-1] != state:
            seen.append(state)
            o.milestones.setdefault(state, time.time() - t0)
            w.out(f"  + {time.time() - t0:5.1f}s  {node} is {state}")
        return state if state in states else None

    w.progress_wait(f"{node} to be {' or '.join(states)}", check, timeout)
    return seen[-1]


def scenario_repair(lab: Lab, w: Watcher, out: Callable[[str], None], isolated: Outcome) -> Outcome:
    """The Xid 79 node after its isolation: repair reported -> revalidated -> back in the standby pool.
    Times are from the Xid 79's injection."""
    node = isolated.node
    o = Outcome("repaired, revalidated, back in the standby pool", "repair", node, None, "REVALIDATE")
    t0 = float(isolated.details.get("injected_at") or time.time())
    _wait_state(w, o, t0, ("awaiting_repair",), 120)
    requests = sorted((lab.dir / "remediator" / "lifecycle").glob(f"repair-{node}-*.json"))
    if requests:
        o.details["repair_request"] = str(requests[-1])
        out(f"  + {time.time() - t0:5.1f}s  repair request for the ticketing system: {requests[-1]}")
    cleared = lab.clear(node)
    out(f"  + {time.time() - t0:5.1f}s  the GPU is replaced (the lab clears {cleared} injected fault(s) on {node})")
    said = lab.fleetheal("nodes", "repaired", node, "--by", "lab-demo").stdout.strip()
    out(f"  + {time.time() - t0:5.1f}s  $ fleetheal nodes repaired {node}: {said}")
    o.milestones["repaired"] = time.time() - t0
    final = _wait_state(w, o, t0, ("standby", "quarantined", "active"), 180)
    info = lab.slurm().node(node)
    pool = (lab.k8s_nodes()[node]["metadata"].get("labels") or {}).get(LABEL_POOL)
    o.details.update(state=final, slurm_reason=info.reason, k8s_pool=pool)
    out(f"  result: {node} {final}; Slurm reason '{info.reason}', Node pool={pool}")
    shown = lab.fleetheal("nodes", "show", node).stdout.rstrip()
    out("  " + shown.replace("\n", "\n  "))
    o.details["loop_s"] = o.milestones.get(final)
    o.details["revalidation_s"] = (o.milestones.get(final) or 0.0) - o.milestones["repaired"]
    o.ok = final == "standby" and info.drained and pool == "standby"
    return o


def scenario_lemon(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
    """Three GPU faults on one node within the lemon window: quarantined, with an RMA report."""
    busy = set(w.job_nodes())
    states = lab.node_states()
    free = [n for n in lab.nodes if n not in busy and states[n] == "active"]
    # In a failure domain the demo has not isolated a node in yet: an isolation counts against its domain's
    # budget until its alert resolves (the agent holds an Xid for health.event_hold_s, 10 minutes).
    domain = {n: (k["metadata"].get("labels") or {}).get(LABEL_FAILURE_DOMAIN) for n, k in lab.k8s_nodes().items()}
    spent = {domain.get(str(i.get("node"))) for i in lab.incidents() if i.get("action") == "ISOLATE_AND_RELOCATE"}
    node = next((n for n in free if domain.get(n) not in spent), free[0])
    o = Outcome("a lemon node: three faults", "lemon", node, None, "quarantine")
    t0 = time.time()
    for fault, gpu in (("xid-79", 0), ("xid-48", 1), ("xid-95", 2)):
        ident = lab.inject(node, fault, gpu)
        out(f"  + {time.time() - t0:5.1f}s  injected {fault} on {node} GPU {gpu} ({ident})")
        time.sleep(1.0)
    final = _wait_state(w, o, t0, ("quarantined",), 180)
    reports = sorted((lab.dir / "remediator" / "lifecycle").glob(f"rma-{node}-*.json"))
    if reports:
        import json

        rma = json.loads(reports[-1].read_text())
        o.details["rma"] = rma
        out(f"  RMA report {reports[-1]}:")
        out(f"    reason: {rma['reason']}")
        out(f"    faults: {rma['faults']['per_fault']}, per GPU {rma['faults']['per_gpu']}")
    info = lab.slurm().node(node)
    o.details.update(state=final, slurm_reason=info.reason)
    out(f"  result: {node} {final}; Slurm reason '{info.reason}'")
    o.ok = final == "quarantined" and bool(reports) and info.drained and "quarantine" in (info.reason or "")
    return o


def scenario_leaf_switch(lab: Lab, out: Callable[[str], None]) -> Outcome:
    """Cluster a of a two-cluster Slurm federation loses the leaf switch of both its nodes; its remediator
    (no standby, budget one node) cannot heal the job there and moves it to b, which reads its checkpoint
    store; the job resumes on b from its checkpoint, in the same log."""
    o = Outcome("leaf switch", "leaf-switch", "a1,a2", None, "FAILOVER (3rd stage)")
    t_up = time.monotonic()
    fed = Federation(lab.dir / "federation", ("a", "b"), 2, 8, {"a": "h100", "b": "h100"}, fast_timers=False)
    rem: ClusterRemediator | None = None
    frozen: list[int] = []
    job = ""
    try:
        fed.start()
        store = lab.dir / "federation-run"
        store.mkdir(exist_ok=True)
        fleet_file = fed.write_fleet_file(lab.dir / "fleet.yaml", store, readers=("a", "b"))
        rem = ClusterRemediator(fed, "a", lab.dir / "remediator-a", fleet_file, budget=1, wait_s=2.0).start()
        out(f"  federation a+b (slurmdbd, MariaDB, two slurmctld) and a's remediator up in "
            f"{time.monotonic() - t_up:.1f}s; a and b read checkpoint store 'shared' ({store})")  # fmt: skip
        script = (
            f"#!/bin/bash\nexport PYTHONPATH={CHECKOUT}\nexec {sys.executable} -m fleetheal.lab.train coordinator "
            f"--run-dir {store} --step-time {STEP_TIME} --checkpoint-every 1\n"
        )
        a = fed.clusters["a"]
        job = a.sbatch(script, "-M", "a", "-N1", "--requeue", "--open-mode=append", "-o", str(store / "train.log"),
                       f"--comment={CHECKPOINT_WORD}shared")  # fmt: skip
        wait_until(lambda: (read_checkpoint(store) or {}).get("step", 0) >= 30, 60, "the job's checkpoint of step 30")
        nodes = a.squeue("-h", "-j", job, "-o", "%N").strip()
        out(f"  job {job} runs on a ({nodes}), checkpoints every second; its comment {CHECKPOINT_WORD}shared "
            "is what `fleetheal submit --checkpoint-store shared` writes")  # fmt: skip
        t0 = time.time()
        frozen = a.freeze_nodes(["a1", "a2"])
        out("  +   0.0s  a's leaf switch is lost: a1 and a2 stop answering (their slurmd and the job's processes"
            " are stopped), the job hangs")  # fmt: skip
        rem.alert(["a1", "a2"], "nic-down")
        out("  +   0.0s  the alerts nic-down on a1 and a2 reach a's remediator (posted as Alertmanager does)")

        def event(prefix: str) -> str | None:
            for inc in rem.incidents() if rem else []:
                for e in inc["events"]:
                    if e["detail"].startswith(prefix):
                        return f"{inc['id']} ({inc['node']}): {e['detail'][:110]}"
            return None

        def held() -> str | None:
            got = [i for i in (rem.incidents() if rem else []) if i.get("hold_reason")]
            return f"{got[0]['id']} ({got[0]['node']}): {got[0]['hold_reason']}" if got else None

        def down() -> str | None:
            # Not waiting for SlurmdTimeout (120 s): once Slurm finds the job's node silent (its health check), the
            # failover sets it DOWN, which releases the job.
            lost = {n: x for n, x in a.nodes().items() if x.state == "DOWN" and x.reason.startswith("fleetheal:lost")}
            if not lost:
                return None
            o.details["down"] = {n: x.reason for n, x in lost.items()}
            return f"{', '.join(sorted(lost))} set DOWN by the remediator: '{next(iter(lost.values())).reason}'"

        def moved() -> str | None:
            return event(f"job {job} moved")

        def on_b() -> str | None:
            return f"job {job} RUNNING on b" if failmod.where(job, fed.env).get("b") == "RUNNING" else None

        def resumed() -> str | None:
            st = [e for e in read_events(store) if e.get("event") == "start" and str(e.get("host", "")).startswith("b")]
            return f"resumed from checkpoint step {st[-1]['resumed_from']} on {st[-1]['host']}" if st else None

        checks: list[tuple[str, str, Callable[[], str | None]]] = [
            ("isolated", "isolated (the budget allows one node)", lambda: event("slurm_drain done")),
            ("held", "the other node held (budget spent)", held),
            ("no_standby", "no standby node in a", lambda: event("standby_promote skipped")),
            ("requeued", "job requeued", lambda: event("slurm_requeue done")),
            ("down", "Slurm finds them silent: DOWN", down),
            ("moved", "moved to cluster b", moved),
            ("running", "running again", on_b),
            ("resumed", "resumed on b", resumed),
        ]
        follow(o, t0, checks, done=lambda: all(key in o.milestones for key, _, _ in checks), timeout=300, out=out)
        o.details["incident"] = (moved() or "-").split()[0]
        lines = (store / "train.log").read_text(errors="replace").splitlines()
        o.details["log"] = [line for line in lines if "starts on" in line or "resumed from" in line]
        o.details["continuity"] = continuity(store)
        o.ok = True
    except (LabError, SlurmError, WaitTimeout) as exc:
        o.error = str(exc)
        out(f"  FAILED: {exc}")
    finally:
        with contextlib.suppress(Exception):
            fed.clusters["a"].thaw_nodes(frozen)
        with contextlib.suppress(Exception):
            if job:
                fed.cancel([job])
        if rem is not None:
            rem.stop()
        fed.stop()
    for line in o.details.get("log", []):
        out(f"  log: {line}")
    for c in o.details.get("continuity", []):
        out(f"  restart {c['restart']}: last step {c['last_step']}, resumed from {c['resumed_from']} "
            f"({c['lost']} steps lost)")  # fmt: skip
    return o


def scenario_sharing(lab: Lab, out: Callable[[str], None]) -> Outcome:
    """One pool for training and inference: a training job ends and an inference Deployment, admitted by Kueue,
    scales into its nodes (the remediator's lending controller lends them); a new training job takes them back;
    once lent again, a GPU fault on a lent node is healed like any other, and the inference moves to another node."""
    o = Outcome("one pool for training and inference", "sharing", "-", None, "LEND, RECLAIM, HEAL")
    if not lab.meta.get("kube", {}).get("kueue"):
        o.details["skipped"] = "needs the real control plane, kube-scheduler and Kueue (`make tools` builds them)"
        o.details["lent_nodes"] = []
        out(f"  skipped: {o.details['skipped']}")
        o.ok = True
        return o
    slurm = lab.slurm()
    states = lab.node_states()
    k8s = lab.k8s_nodes()
    idle = [
        n
        for n in lab.nodes
        if states.get(n) == "active"
        and (k8s[n]["metadata"].get("labels") or {}).get(LABEL_POOL) == "active"
        and not (k8s[n].get("spec") or {}).get("unschedulable")
        and (info := slurm.node(n)).state == "IDLE"
        and not info.drained
    ]
    if len(idle) < 2:
        raise LabError(f"the sharing scenario needs 2 idle active nodes; idle: {idle}")
    gpus = int(lab.meta["gpus"])
    ns = INFERENCE_NAMESPACE
    deployment = f"/apis/apps/v1/namespaces/{ns}/deployments/serve"
    lab.kube_request("POST", f"/apis/apps/v1/namespaces/{ns}/deployments", {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        # The queue's name on the Deployment: Kueue's webhook gives it to each pod, which waits gated until admitted.
        "metadata": {"name": "serve", "labels": {"kueue.x-k8s.io/queue-name": "small"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "serve"}},
            "template": {
                "metadata": {"labels": {"app": "serve"}},
                "spec": {"containers": [{"name": "serve", "image": PLACEHOLDER_IMAGE,
                                         "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            },
        },
    })  # fmt: skip
    job = slurm.sbatch("#!/bin/sh\nsleep 3600\n", "-N", str(len(idle)), "-o", "/dev/null")
    wait_until(lambda: slurm.job_state(job) == "RUNNING", 60, f"training job {job} to run")
    out(f"  training job {job} runs on the {len(idle)} idle active nodes {','.join(idle)}")
    lab.kube_request("PATCH", deployment, {"spec": {"replicas": LEND_NODES}}, "application/merge-patch+json")

    def pods() -> list[dict[str, Any]]:
        found = lab.kube_request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3Dserve")["items"]
        return [p for p in found if not p["metadata"].get("deletionTimestamp")]

    def admitted() -> list[dict[str, Any]]:
        return [p for p in pods() if not p["spec"].get("schedulingGates")]

    def lent() -> list[str]:
        return sorted(n for n, k in lab.k8s_nodes().items()
                      if (k["metadata"].get("labels") or {}).get(LABEL_POOL) == POOL_LENT)  # fmt: skip

    def serving() -> list[str]:
        on = sorted(p["spec"].get("nodeName") or "" for p in pods() if p.get("status", {}).get("phase") == "Running")
        return on if len(on) == LEND_NODES else []

    wait_until(lambda: len(admitted()) == LEND_NODES, 60, "Kueue to admit the inference pods")
    out(f"  inference Deployment {ns}/serve scaled to {LEND_NODES} pods of {gpus} GPUs: admitted by Kueue, "
        "waiting for GPUs (Slurm's job holds them)")  # fmt: skip

    def phase(title: str, act: Callable[[], str], checks: list[tuple[str, str, Callable[[], str | None]]],
              done: Callable[[], bool], timeout: float = 120) -> None:  # fmt: skip
        t0 = time.time()
        out(f"  {title}\n  +  0.0s  {act()}")
        follow(o, t0, checks, done=done, timeout=timeout, out=out)

    def show(what: Callable[[], list[str]], text: str) -> Callable[[], str | None]:
        return lambda: text.format(", ".join(found)) if (found := what()) else None

    # 1. The training job ends: its idle nodes are lent, and the waiting pods run there.
    phase(
        "a. the training job ends",
        lambda: (slurm.run("scancel", job), f"job {job} cancelled")[1],
        [("lent", "nodes lent to Kueue's flavour (pool=lent, drained in Slurm fleetheal:lent)", show(lent, "{}")),
         ("serving", "inference pods Running", show(serving, "on {}"))],
        lambda: {"lent", "serving"} <= o.milestones.keys(),
    )  # fmt: skip
    first = lent()

    # 2. A new training job needs every node: the lent ones are taken back, their pods evicted within their grace.
    state: dict[str, str] = {}

    def back() -> str | None:
        # As many as the job lacks: a standby node promoted meanwhile (the lifecycle refills the pool) may cover one.
        nodes, now_lent = slurm.nodes(), lent()
        ok = [n for n in first if not nodes[n].drained and n not in now_lent]
        return ", ".join(ok) if ok else None

    def training() -> str | None:
        return f"job {state['job']} RUNNING" if slurm.job_state(state["job"]) == "RUNNING" else None

    def submit() -> str:
        state["job"] = slurm.sbatch("#!/bin/sh\nsleep 3600\n", "-N", str(len(idle)), "-o", "/dev/null")
        return f"training job {state['job']} submitted for {len(idle)} nodes"

    phase(
        "b. a new training job needs the nodes back",
        submit,
        [("reclaimed", "lent nodes taken back (pods evicted, pool=active, resumed in Slurm)", back),
         ("training", "training running", training)],
        lambda: {"reclaimed", "training"} <= o.milestones.keys(),
    )  # fmt: skip

    # 3. That job ends; the Deployment's pods, made again and admitted, get nodes again.
    phase(
        "c. that job ends too",
        lambda: (slurm.run("scancel", state["job"]), f"job {state['job']} cancelled")[1],
        [("lent-again", "nodes lent again", show(lent, "{}")),
         ("serving-again", "inference pods Running again", show(serving, "on {}"))],
        lambda: {"lent-again", "serving-again"} <= o.milestones.keys(),
    )  # fmt: skip

    # 4. A GPU falls off the bus on a lent node: healing takes it over (never reclaimed meanwhile), as on any node.
    # In the failure domain with the fewest nodes out of service (the isolation budget counts them per domain).
    domain = {n: (k["metadata"].get("labels") or {}).get(LABEL_FAILURE_DOMAIN) for n, k in lab.k8s_nodes().items()}
    out_of_service = [domain.get(n) for n, s in lab.node_states().items() if s not in ("active", "standby")]
    node = min(lent(), key=lambda n: (out_of_service.count(domain.get(n)), n))
    now_lent = lent()
    o.node, o.gpu = node, 0
    t_fault = time.time()

    def incident() -> str | None:
        inc = incident_for(lab, node, LOST_GPU, t_fault, acted=True)
        if inc is None:
            return None
        o.details["incident"] = inc["id"]
        return f"{inc['id']} opened by the alert, gate {inc.get('decision') or 'pending'}"

    def isolated() -> str | None:
        info = slurm.node(node)
        labels = lab.k8s_nodes()[node]["metadata"].get("labels") or {}
        on = [p for p in pods() if p["spec"].get("nodeName") == node]
        if info.reason == LENT_REASON or labels.get(LABEL_POOL) == POOL_LENT or on:
            return None
        return f"Slurm reason '{info.reason}', Node pool={labels.get(LABEL_POOL)}, its pods evicted"

    def moved() -> str | None:
        on = serving()
        return f"on {', '.join(on)}" if on and node not in on else None

    def healed() -> bool:
        inc = incident_for(lab, node, LOST_GPU, t_fault, acted=True)
        return bool(inc and inc.get("state") in ("done", "failed")) and "moved" in o.milestones

    phase(
        f"d. a GPU of lent node {node} falls off the bus",
        lambda: f"injected xid-79 on {node} GPU 0 ({lab.inject(node, 'xid-79', 0)})",
        [("incident", "incident", incident), ("isolated", "isolated like any node", isolated),
         ("moved", "inference Running on another lent node", moved)],
        healed,
        timeout=180,
    )  # fmt: skip
    o.incidents = [lab.incident(o.details["incident"])] if "incident" in o.details else []
    o.details["lent_first"] = first
    o.details["lent_nodes"] = sorted({*first, *now_lent, *lent()})
    o.ok = bool(o.incidents) and o.incidents[0].get("state") == "done"
    lab.kube_request("PATCH", deployment, {"spec": {"replicas": 0}}, "application/merge-patch+json")
    return o
