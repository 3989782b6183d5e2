"""The lab's scenarios end to end, on real Slurm, agents, Prometheus, Alertmanager, remediator and
playbooks (Kubernetes: the real control plane of `make tools`): what `fleetheal lab demo` shows, asserted.

One lab for the module (bringing it up takes ~7 s, the three scenarios ~3 minutes on 2 cores); it is
taken down by PID in the fixture's finalizer even when a test fails, and the last test checks that
nothing it started is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from fleetheal.contracts import (
    ANNOTATION_LENT,
    LABEL_POOL,
    LENT_REASON,
    POOL_LENT,
    TAINT_LENT,
    TAINT_STANDBY,
    owns_reason,
)
from fleetheal.lab.controlplane import tools_built
from fleetheal.lab.demo import run_demo, run_scenarios
from fleetheal.lab.lab import Lab
from fleetheal.lab.scenarios import CHECKPOINT_EVERY, LOST_GPU, STEP_TIME
from fleetheal.lab.train import read_events
from fleetheal.lab.watcher import continuity
from fleetheal.procs import alive, cmdline, pids_mentioning
from fleetheal.wait import wait_until
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.prometheus]

#: Steps one checkpoint interval holds: the most a restart may lose.
STEPS_PER_CHECKPOINT = round(CHECKPOINT_EVERY / STEP_TIME)


def _missing() -> str | None:
    for tool in ("slurmctld", "slurmd", "munged", "prometheus", "unshare"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return tool
    if shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None:
        return "prometheus-alertmanager"
    return None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the lab's Slurm daemons and PID namespace need root")
    if (tool := _missing()) is not None:
        pytest.skip(f"{tool} is not installed (scripts/bootstrap.sh installs it)")
    if not tools_built():
        pytest.fail("the lab's real control plane is not built: run `make tools`")
    the_lab = Lab(tmp_path_factory.mktemp("lab"), log=lambda _: None)
    try:
        the_lab.up(nodes=4, standby=2, gpus=8)
        yield the_lab
    finally:
        the_lab.down(quiet=True)


@pytest.fixture(scope="module")
def scenarios(lab):
    lines: list[str] = []
    outcomes, watcher = run_scenarios(lab, lines.append)
    by_fault = {o.fault: o for o in outcomes}
    faults = ["xid-79", "repair", "xid-31", "nccl-timeout", "lemon", "cuda-oom-repeated", "sharing", "leaf-switch"]
    assert [o.fault for o in outcomes] == faults, "\n".join(lines)
    return by_fault, watcher, "\n".join(lines)


def _pods_on(lab: Lab, node: str) -> list[str]:
    pods = lab.kube_request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")["items"]
    return sorted(p["metadata"]["name"] for p in pods)


def test_lab_is_up_with_pools(lab):
    status = {n.name: n for n in lab.status()}
    assert sorted(status) == ["n1", "n2", "n3", "n4", "n5", "n6"]
    for name in lab.meta["active"]:
        assert status[name].pool == "active"
    for name in lab.standby_nodes:
        node = lab.slurm().node(name)
        assert node.drained and node.reason == "fleetheal:standby"
        assert status[name].pool == "standby"
        assert f"{TAINT_STANDBY}=:NoSchedule" in status[name].k8s_taints


def test_xid79_isolates_relocates_and_replaces(lab, scenarios):
    by_fault, watcher, log = scenarios
    o = by_fault["xid-79"]
    assert o.ok, log
    node = o.node
    # (the node was isolated, then repaired and revalidated: test_the_loop_closes_for_the_isolated_node)
    # the job moved off it and resumed from its checkpoint, losing at most one checkpoint interval
    assert node not in o.details["new_nodes"]
    restart = continuity(watcher.run_dir)[0]
    assert restart["incident"] == o.details["incident"]
    assert 0 <= restart["lost"] <= STEPS_PER_CHECKPOINT, restart
    # Kubernetes: cordoned and drained; the slurmd pod was evicted, the DaemonSet pod stays
    k = lab.k8s_nodes()[node]
    assert k["spec"]["unschedulable"] is True
    assert _pods_on(lab, node) == [f"fleetheal-agent-{node}"]
    # a warm-standby node was promoted in both Slurm and Kubernetes
    promoted = o.details["promoted"]
    assert promoted in lab.standby_nodes and "promoted" in o.milestones  # resumed and labelled active then
    # (the lemon may have been that node since: then it is quarantined; or the sharing scenario lent it since)
    if promoted != by_fault["lemon"].node and promoted not in by_fault["sharing"].details.get("lent_nodes", []):
        assert not lab.slurm().node(promoted).drained
        kp = lab.k8s_nodes()[promoted]
        assert kp["metadata"]["labels"][LABEL_POOL] == "active"
        assert not any(t["key"] == TAINT_STANDBY for t in kp["spec"].get("taints") or [])
    # the milestones came in the loop's order
    m = o.milestones
    assert m["detected"] <= m["drained"] <= m["grace"] <= m["relocated"] <= m["running"] <= m["resumed"] + 1
    # relocated inside its allocation (its hot spare took over), not requeued: no credential hold
    assert o.details["relocation"] == "in-allocation", o.details
    # the incident's timeline: alert in, classified, allowed, playbook steps that changed the cluster
    inc = o.incidents[0]
    assert (inc["state"], inc["action"], inc["class"]) == ("done", "ISOLATE_AND_RELOCATE", "hardware")
    steps = [(e["what"], e.get("result")) for e in inc["timeline"] if e["kind"] == "step"]
    assert steps[:3] == [("receive", "ok"), ("classify", "ok"), ("gate", "allow")]
    # the first responder's steps, in-process, then the follow-up playbook's
    first = [e["detail"].split(":")[0] for e in inc["timeline"] if e.get("what") == "first_step"]
    for step in ("slurm_signal done", "slurm_requeue done", "standby_promote done", "k8s_cordon done"):
        assert step in first, first
    changed = " ".join(e["detail"] for e in inc["timeline"] if e.get("what") == "task_changed")
    assert "cordon and drain" in changed, changed


def test_the_loop_closes_for_the_isolated_node(lab, scenarios):
    """isolated -> awaiting repair (a repair request) -> repaired -> revalidated -> the standby pool, which
    the isolation had drawn on: refilled to its target by the revalidated node."""
    by_fault, _, log = scenarios
    o = by_fault["repair"]
    assert o.ok, log
    node = o.node
    assert node == by_fault["xid-79"].node
    # As the scenario left it (the lemon's isolation may since have promoted it: then it is active again).
    assert o.details["slurm_reason"].startswith("fleetheal:standby"), o.details
    assert o.details["k8s_pool"] == "standby"
    history = [h for h in lab.node_lifecycle(node)["history"] if h["from"] != h["to"]]
    assert [(h["from"], h["to"]) for h in history][:4] == [
        ("active", "isolated"),
        ("isolated", "awaiting_repair"),
        ("awaiting_repair", "revalidating"),
        ("revalidating", "standby"),
    ]
    assert [(h["from"], h["to"]) for h in history][4:] in ([], [("standby", "active")])
    assert "lab-demo" in history[2]["cause"]
    assert "burn_in" in history[3]["cause"] and "dcgm_diag" in history[3]["cause"]
    request = json.loads(open(o.details["repair_request"]).read())
    # the lost GPU's first alert acted: its Xid 79 or NVML's gpu-lost (a race between two alerts)
    assert request["node"] == node and request["fault_id"] in LOST_GPU
    assert o.milestones["awaiting_repair"] < o.milestones["repaired"] < o.milestones["standby"]


def test_a_lemon_is_quarantined_with_an_rma_report(lab, scenarios):
    by_fault, _, log = scenarios
    o = by_fault["lemon"]
    assert o.ok, log
    rma = o.details["rma"]
    assert rma["node"] == o.node and rma["reason"].startswith("lemon: 3 GPU failures")
    assert set(rma["faults"]["per_gpu"]) == {"0", "1", "2"}
    info = lab.slurm().node(o.node)
    assert info.drained and info.reason.startswith("fleetheal:quarantine"), info.reason
    assert lab.node_states()[o.node] == "quarantined"


def test_xid31_is_refused_and_explained(lab, scenarios):
    by_fault, watcher, log = scenarios
    o = by_fault["xid-31"]
    assert o.ok, log
    assert o.details["node_drained"] is False
    assert o.details["restarts"] == 0
    inc = o.incidents[0]
    assert (inc["state"], inc["action"], inc["class"]) == ("done", "REFUSE_AND_REPORT", "user")
    comment = o.details["comment"]  # as it was then: the NCCL scenario's requeue rewrites it
    assert f"not requeued: xid-31 (user) is attributed to the job, not to node {o.node}" in comment
    assert o.details["cause"] in (watcher.run_dir / "train.log").read_text()
    if o.node != by_fault["sharing"].node:  # (the sharing scenario may have lent that node since, and isolated it)
        assert not lab.slurm().node(o.node).drained
        assert not lab.k8s_nodes()[o.node]["spec"].get("unschedulable")


def test_nccl_timeout_restarts_in_place(lab, scenarios):
    by_fault, watcher, log = scenarios
    o = by_fault["nccl-timeout"]
    assert o.ok, log
    assert o.details["same_nodes"]
    assert o.details["node_drained"] is False
    restarts = continuity(watcher.run_dir)
    assert [r["restart"] for r in restarts] == [1, 2, 3]
    assert restarts[1]["incident"] == o.details["incident"]
    assert 0 <= restarts[1]["lost"] <= STEPS_PER_CHECKPOINT, restarts[1]
    # The lab's job runs under `fleetheal launch`: restarted inside its allocation, never requeued.
    starts = [e for e in read_events(watcher.run_dir) if e.get("event") == "start"]
    assert (starts[2]["requeues"], starts[2]["in_job"]) == (0, 2)
    # The fault came from the job's own output, through `fleetheal launch` and the node's agent.
    assert any(e.get("event") == "misbehave" and e.get("what") == "nccl-timeout" for e in read_events(watcher.run_dir))
    inc = o.incidents[0]
    assert (inc["state"], inc["action"], inc["class"]) == ("done", "RESTART_IN_PLACE", "transient")
    first = [e["detail"] for e in inc["timeline"] if e.get("what") == "first_step"]
    assert any("in its allocation" in d for d in first), first


def test_a_repeated_out_of_memory_is_restarted_once_then_refused(lab, scenarios):
    """Both faults come from the lines the job printed: the first OOM restarts it in place, the second at the
    same step is the job's own (cuda-oom-repeated): refused, the user told in the log, the node untouched."""
    by_fault, watcher, log = scenarios
    o = by_fault["cuda-oom-repeated"]
    assert o.ok, log
    first, second = o.incidents
    assert (first["fault_id"], first["action"]) == ("cuda-oom", "RESTART_IN_PLACE")
    assert (second["fault_id"], second["action"], second["class"]) == ("cuda-oom-repeated", "REFUSE_AND_REPORT", "user")
    assert o.details["node_drained"] is False
    if o.node != by_fault["sharing"].node:  # (as above)
        assert not lab.slurm().node(o.node).drained
    assert o.details["cause"] in (watcher.run_dir / "train.log").read_text()
    assert o.details["job_state"] in ("FAILED", "COMPLETED"), o.details


def test_one_pool_serves_training_and_inference_and_a_fault_on_a_lent_node_is_healed(lab, scenarios):
    """Scenario 7, on the real Kueue and kube-scheduler and the remediator's lending controller: the nodes a job
    leaves are lent to the inference pods Kueue admitted, taken back for the next job, lent again; a GPU lost on a
    lent node is isolated like any node (the fault's reason in Slurm, pods evicted, quarantined in Kubernetes, never
    lent while it heals), and its inference runs on another lent node."""
    by_fault, _, log = scenarios
    o = by_fault["sharing"]
    assert o.ok and not o.details.get("skipped"), log
    m = o.milestones
    assert {"lent", "serving", "reclaimed", "training", "lent-again", "serving-again", "incident", "isolated",
            "moved"} <= set(m), m  # fmt: skip
    inc = o.incidents[0]
    assert (inc["state"], inc["action"], inc["class"]) == ("done", "ISOLATE_AND_RELOCATE", "hardware")
    info = lab.slurm().node(o.node)
    assert info.drained and owns_reason(info.reason) and info.reason != LENT_REASON, info.reason
    k = lab.k8s_nodes()[o.node]
    assert k["spec"]["unschedulable"] is True and k["metadata"]["labels"][LABEL_POOL] != POOL_LENT
    assert TAINT_LENT not in [t["key"] for t in k["spec"].get("taints") or []]
    assert ANNOTATION_LENT not in (k["metadata"].get("annotations") or {})
    assert lab.node_states()[o.node] != "active"


def test_a_lost_leaf_switch_moves_the_job_to_the_sibling_cluster(scenarios):
    """Scenario 8: cluster a cannot heal the job (no standby, budget one node): its remediator moves it to b,
    where it resumes from its checkpoint, losing at most the steps since that checkpoint, in the same log."""
    by_fault, _, text = scenarios
    o = by_fault["leaf-switch"]
    assert o.ok, text
    m = o.milestones
    assert m["isolated"] <= m["requeued"] <= m["moved"] and m["running"] <= m["resumed"], m
    assert "held" in m and "no_standby" in m
    # The job's silent node was set DOWN by the failover, not by Slurm after SlurmdTimeout.
    assert m["down"] <= m["moved"] and "a1" in o.details["down"], o.details
    (c,) = o.details["continuity"]
    assert c["resumed_from"] > 0 and c["lost"] <= 15  # one checkpoint a second, 0.1 s a step
    assert any("starts on a" in line for line in o.details["log"])
    assert any("on b" in line and "resumed from checkpoint" in line for line in o.details["log"])


def test_one_log_across_restarts(scenarios):
    by_fault, watcher, _ = scenarios
    text = (watcher.run_dir / "train.log").read_text()
    restart_lines = [ln for ln in text.splitlines() if "=== restart" in ln]
    assert len(restart_lines) == 3
    for line, (fault, key) in zip(
        restart_lines,
        (("xid-79", "incident"), ("nccl-timeout", "incident"), ("cuda-oom-repeated", "first_incident")),
        strict=True,
    ):
        incident = by_fault[fault].details[key]
        resumed = by_fault[fault].details["resumed_from"]
        assert f"incident={incident}" in line
        assert f"resumed from checkpoint step {resumed}" in line
    # Each restart inside the job's allocation (the spare, then twice in place): Slurm never requeued it.
    for n, line in enumerate(restart_lines, 1):
        assert f"SLURM_RESTART_COUNT=0, in-job restarts {n}" in line


def test_a_second_demo_leaves_the_running_lab_alone(lab, scenarios, capsys):
    """`make demo` while a lab runs in the same directory refuses, and takes nothing of that lab down."""
    pids = [p["pid"] for p in lab.meta["processes"].values()]
    assert run_demo(str(lab.dir)) == 1
    out = capsys.readouterr().out
    assert "a lab is already running" in out and "taking the lab down" not in out, out
    assert all(alive(pid) for pid in pids) and lab.running()


def test_a_demo_stopped_by_sigterm_takes_its_lab_down(tmp_path):
    """`kill` of a demo (or a closed terminal) leaves no orphaned lab to block the next `make demo`."""
    lab_dir = tmp_path / "lab"
    env = {k: v for k, v in os.environ.items() if k != "FLEETHEAL_LAB_DIR"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "fleetheal", "lab", "demo", "--dir", str(lab_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        meta = lab_dir / "lab.json"
        wait_until(
            lambda: demo.poll() is not None or (meta.exists() and "ready" in meta.read_text()),
            120,
            "the demo's lab to be up",
            interval=0.2,
        )
        assert demo.poll() is None, "the demo ended before its lab was up"
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            Lab(lab_dir, log=lambda _: None).down(quiet=True)
    assert demo.returncode == 1, out
    assert "stopped by SIGTERM" in out and "taking the lab down" in out, out
    left = pids_mentioning(str(lab_dir))
    assert left == {}, left


def test_a_sigterm_handled_during_an_import_does_not_kill_the_demo_at_exit(tmp_path):
    """The cause of the -2 above, found with the kernel's signal trace (the demo sent itself SIGINT): the
    SIGTERM landed while a module built a dataclass (`exec` of a string). The demo's own handler runs
    there; the process, run with -m like `fleetheal lab demo`, must still end with the demo's code."""
    (tmp_path / "stopped_in_exec.py").write_text(
        "import os, signal, threading\n"
        "from fleetheal.lab.demo import _interrupt\n"
        "signal.signal(signal.SIGTERM, _interrupt)\n"
        "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "try:\n"
        "    exec('import time\\nfor _ in range(200): time.sleep(0.05)')\n"
        "except KeyboardInterrupt as exc:\n"
        "    print(exc)\n"
        "raise SystemExit(1)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "stopped_in_exec"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert (done.returncode, done.stdout) == (1, "stopped by SIGTERM\n"), done


def test_down_leaves_nothing_behind(lab, scenarios):
    pids = [p["pid"] for p in lab.meta["processes"].values()]
    stopped = lab.down(quiet=True)
    assert {"remediator", "kubernetes", "prometheus", "alertmanager", "slurm"} <= set(stopped)
    left = pids_mentioning(str(lab.dir))
    assert left == {}, left
    assert all(str(lab.dir) not in cmdline(p) for p in pids)


def test_the_lost_gpu_scenario_follows_whichever_of_its_alerts_acted():
    """Xid 79 and NVML's gpu-lost race to the remediator (CI saw gpu-lost first): the scenario's incident is
    the one the gate let act, not the Xid's by name."""
    from fleetheal.lab.scenarios import incident_for

    class Incidents:
        def incidents(self):
            return [
                {"id": "inc-000003", "node": "n1", "fault_id": "xid-79", "received_at": 101.0, "decision": "allow"},
                {"id": "inc-000002", "node": "n2", "fault_id": "xid-79", "received_at": 101.0, "decision": "deny"},
                {"id": "inc-000001", "node": "n2", "fault_id": "gpu-lost", "received_at": 101.0, "decision": "allow"},
            ]

    assert incident_for(Incidents(), "n2", LOST_GPU, 100.0, acted=True)["id"] == "inc-000001"
    assert incident_for(Incidents(), "n2", "xid-79", 100.0)["id"] == "inc-000002"
    assert incident_for(Incidents(), "n3", LOST_GPU, 100.0, acted=True) is None
