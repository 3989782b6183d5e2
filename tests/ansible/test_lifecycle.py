"""The node lifecycle end to end: the remediator's engine and its node lifecycle, the real playbooks through
ansible-runner, a real private Slurm (fixture `slurm`, nodes n1..n3) and the real kube-apiserver (fixture
`kube`, Node objects n1..n3). Revalidation runs the node_validation role against each node's simulated GPUs
(fleetheal.lab.simtools, the same tools the lab uses); a node's "repair" is clearing its injected faults.

n1 and n2 start active, n3 in the warm-standby pool (drained with the owned standby reason, Node pool
label standby). Each test says what it checks; together they walk every transition of the lifecycle.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetheal import contracts, steps
from fleetheal.agent import simulated
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.simtools import validation_vars, write_sim_tools
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator import config as cfgmod
from fleetheal.remediator.alerts import Alert
from fleetheal.remediator.engine import Engine
from fleetheal.remediator.lifecycle import LifecycleError
from fleetheal.remediator.metrics import Metrics
from fleetheal.remediator.runner import AnsibleRunner
from fleetheal.remediator.store import FollowUp, Store

from .conftest import PLAYBOOKS

pytestmark = [pytest.mark.slurm, pytest.mark.kube]

NODES = ("n1", "n2", "n3")
GPUS = 2  # the fixture's Slurm gives each node 2 GPUs
POOL = contracts.LABEL_POOL


class Remediator:
    """The remediator's engine on its own event loop (a thread), as `fleetheal remediator serve` runs it,
    without the HTTP front: alerts go straight into the store."""

    def __init__(self, slurm: SlurmCluster, kube: KubeControlPlane, work: Path, **lifecycle: Any) -> None:
        self.slurm = slurm
        self.work = work
        self.nodes_dir = work / "nodes"
        burn_in_s = lifecycle.pop("burn_in_s", 0.2)
        for node in NODES:
            write_sim_tools(self.nodes_dir / node / "bin", self.nodes_dir / node / "sim-gpus.json", GPUS,
                            burnin_seconds=burn_in_s)  # fmt: skip
        inventory = work / "inventory.yml"
        local = {"ansible_connection": "local", "ansible_python_interpreter": __import__("sys").executable}
        inventory.write_text(yaml.safe_dump({"all": {
            "vars": validation_vars(self.nodes_dir, GPUS),
            "children": {"fleetheal_control": {"hosts": {"localhost": local}},
                         "fleetheal_gpu_nodes": {"hosts": dict.fromkeys(NODES, local)}},
        }}))  # fmt: skip
        self.cfg = cfgmod.from_mapping(
            {
                "cluster": {"name": "lab", "nodes": {"n1": "rack-a", "n2": "rack-a", "n3": "rack-b"}},
                "store": {"path": str(work / "remediator.sqlite"), "synchronous": "NORMAL"},
                "runner": {
                    "playbook_dir": str(PLAYBOOKS),
                    "run_dir": str(work / "runs"),
                    "inventory": str(inventory),
                    "timeout_s": 300,
                    "retries": 0,
                    "max_concurrent": 2,
                    "site_vars": {
                        "fleetheal_slurm_env": {"SLURM_CONF": str(slurm.conf_path)},
                        "fleetheal_kubeconfig": str(kube.kubeconfig),
                        "fleetheal_report_dir": str(work / "reports"),
                        "fleetheal_grace_seconds": 0,
                        "fleetheal_slurm_retry_delay_s": 1,
                        "fleetheal_k8s_drain_timeout_s": 10,
                        "fleetheal_nvidia_smi": str(self.nodes_dir) + "/{{ fleetheal_node }}/bin/nvidia-smi",
                    },
                },
                "gate": {"budget": {"max_isolated": 3, "max_isolated_fraction": 1.0, "max_isolated_per_domain": 3,
                                    "max_isolated_fraction_per_domain": 1.0}},
                "lifecycle": {"report_dir": str(work / "lifecycle"), "reconcile_interval_s": 0.5, **lifecycle},
            },
            env={},
        )  # fmt: skip
        self.settings = steps.Settings.load(PLAYBOOKS, self.cfg.runner.site_vars)
        self.store = Store(self.cfg.store.path, "NORMAL")
        self.metrics = Metrics(self.store)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="remediator-loop", daemon=True)
        self._thread.start()
        self.engine = self.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Engine:
        async def make() -> Engine:
            engine = Engine(self.cfg, self.store, AnsibleRunner(self.cfg.runner), metrics=self.metrics,
                            settings=self.settings)  # fmt: skip
            await engine.start(workers=4)
            return engine

        engine: Engine = self.call(make())
        self.metrics.attach_gate(engine.gate)
        return engine

    def stop(self) -> None:
        self.call(self.engine.stop(grace_s=0.0))

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.store.close()

    @property
    def lifecycle(self) -> Any:
        assert self.engine.lifecycle is not None
        return self.engine.lifecycle

    def alert(self, node: str, fault_id: str, gpu: str = "0") -> int:
        from fleetheal import taxonomy

        fault = taxonomy.load().fault(fault_id)
        now = time.time()
        starts = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        alert = Alert(status="firing", fingerprint=uuid.uuid4().hex[:16], starts_at=starts, starts_at_ts=now,
                      ends_at_ts=None, cluster="lab", node=node, gpu=gpu, fault_id=fault_id,
                      fault_class=fault.fault_class, action=fault.action, severity=fault.severity, job_id="",
                      alertname="test")  # fmt: skip
        result = self.store.ingest([alert])
        self.loop.call_soon_threadsafe(self.engine.submit, result.created)
        return result.created[0]

    def state(self, node: str) -> str:
        return str(self.store.node_state(node).state)

    def wait_state(self, node: str, state: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.state(node) != state:
            if time.monotonic() > deadline:
                pytest.fail(f"{node} is {self.state(node)}, not {state}, after {timeout:g} s\n{self.explain(node)}")
            time.sleep(0.2)

    def explain(self, node: str) -> str:
        lines = [f"history: {json.dumps(self.store.node_history(node), indent=1)}"]
        for inc in self.store.incidents(node=node, limit=10):
            lines.append(f"{inc.ref} {inc.action} {inc.state} {inc.decision} {inc.outcome}")
            lines += [f"   {e.kind}: {e.detail}" for e in self.store.events(inc.id) if e.kind == "task_failed"]
        return "\n".join(lines)

    def transitions(self, node: str) -> list[tuple[str, str]]:
        return [(h["from"], h["to"]) for h in self.store.node_history(node)]

    def metric(self, name: str, **labels: str) -> float:
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        raise KeyError(name)

    def reports(self, kind: str, node: str) -> list[dict[str, Any]]:
        found = sorted((self.work / "lifecycle").glob(f"{kind}-{node}-*.json"))
        return [json.loads(p.read_text()) for p in found]

    def inject(self, node: str, fault_id: str, gpu: int) -> None:
        simulated.inject(self.nodes_dir / node / "sim-gpus.json", fault_id, gpu)

    def repair(self, node: str) -> None:
        simulated.clear(self.nodes_dir / node / "sim-gpus.json")


@pytest.fixture
def nodes(kube: KubeControlPlane, slurm: SlurmCluster) -> Iterator[Any]:
    """Node objects n1, n2 (pool active) and n3 (pool standby, tainted); n3 drained as a standby in Slurm."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube.client())
    for name in NODES:
        try:
            core.delete_node(name)
        except ApiException as e:
            if e.status != 404:
                raise
    deadline = time.monotonic() + 30
    while {n.metadata.name for n in core.list_node().items} & set(NODES):
        assert time.monotonic() < deadline, "old Node objects are not gone"
        time.sleep(0.2)
    kube.add_nodes(["n1", "n2"], labels={POOL: "active"})
    kube.add_nodes(["n3"], labels={POOL: "standby"}, taints=[{"key": contracts.TAINT_STANDBY, "effect": "NoSchedule"}])
    slurm.scontrol("update", "nodename=n3", "state=drain", f"reason={contracts.DRAIN_REASON_PREFIX}standby")
    yield core


@pytest.fixture
def remediator(
    slurm: SlurmCluster, kube: KubeControlPlane, nodes: Any, tmp_path: Path
) -> Iterator[Callable[..., Remediator]]:
    made: list[Remediator] = []

    def make(**lifecycle: Any) -> Remediator:
        r = Remediator(slurm, kube, tmp_path / f"r{len(made)}", **lifecycle)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _pool_label(core: Any, node: str) -> str:
    return str(core.read_node(node).metadata.labels.get(POOL))


def test_an_isolated_node_is_repaired_revalidated_and_refills_the_standby_pool(
    slurm: SlurmCluster, nodes: Any, remediator: Callable[..., Remediator]
) -> None:
    """active -> isolated -> awaiting_repair -(Node annotation)-> revalidating -> standby, the promoted standby
    standby -> active, and the pool refilled to its target by the revalidated node."""
    r = remediator(standby_target=1)
    r.wait_state("n3", "standby", 30)  # the initial pool, read from Slurm
    assert r.metric("fleetheal_remediator_standby_shortfall_nodes") == 0

    r.inject("n1", "xid-79", 1)
    r.alert("n1", "xid-79", "1")
    r.wait_state("n1", "awaiting_repair")
    assert slurm.node("n1").drained and slurm.node("n1").reason.startswith("fleetheal:xid-79")
    # The isolation promoted the standby: Slurm resumed n3, and the lifecycle saw it.
    r.wait_state("n3", "active", 30)
    assert r.metric("fleetheal_remediator_standby_shortfall_nodes") == 1
    (request,) = r.reports("repair", "n1")
    assert request["fault_id"] == "xid-79" and request["gpu"] == "1" and request["faults"]["count"] == 1

    # A repair reported for a node that awaits none changes nothing.
    with pytest.raises(LifecycleError, match="n2 is active, not awaiting repair"):
        r.lifecycle.repaired("n2", "test")

    # The technician replaces the GPU and annotates the Node; the remediator revalidates n1.
    r.repair("n1")
    nodes.patch_node("n1", {"metadata": {"annotations": {contracts.ANNOTATION_REPAIRED: "tech-7"}}})
    r.wait_state("n1", "standby")
    assert slurm.node("n1").drained and slurm.node("n1").reason.startswith("fleetheal:standby")
    assert _pool_label(nodes, "n1") == "standby"
    assert contracts.ANNOTATION_REPAIRED not in (nodes.read_node("n1").metadata.annotations or {})
    assert r.transitions("n1") == [
        ("active", "isolated"),
        ("isolated", "awaiting_repair"),
        ("awaiting_repair", "revalidating"),
        ("revalidating", "standby"),
    ]
    assert "tech-7" in r.store.node_history("n1")[2]["cause"]
    assert r.transitions("n3") == [("active", "standby"), ("standby", "active")]
    # The pool is back at its target; each state's time was measured.
    assert r.metric("fleetheal_remediator_standby_shortfall_nodes") == 0
    assert r.metric("fleetheal_remediator_nodes", state="standby") == 1
    assert r.metric("fleetheal_remediator_node_state_seconds_count", state="awaiting_repair") == 1


def test_a_reset_gpu_is_revalidated_at_once_and_rejoins_service_when_the_pool_is_full(
    slurm: SlurmCluster, nodes: Any, remediator: Callable[..., Remediator]
) -> None:
    """active -> resetting -> revalidating -> standby -> active (REJOIN: the pool already holds its target)."""
    r = remediator(standby_target=1)
    r.wait_state("n3", "standby", 30)
    inc = r.alert("n2", "xid-119", "0")
    deadline = time.monotonic() + 240
    while not any(i.action == "REJOIN" and i.state in ("done", "failed") for i in r.store.incidents(node="n2")):
        assert time.monotonic() < deadline, r.explain("n2")
        time.sleep(0.2)
    assert r.transitions("n2") == [
        ("active", "resetting"),
        ("resetting", "revalidating"),
        ("revalidating", "standby"),
        ("standby", "active"),
    ]
    assert not slurm.node("n2").drained
    assert _pool_label(nodes, "n2") == "active"
    follow_ups = [i for i in r.store.incidents(node="n2") if i.parent_id == inc]
    assert sorted((i.action, i.state) for i in follow_ups) == [("REJOIN", "done"), ("REVALIDATE", "done")]
    assert r.state("n3") == "standby"  # the pool was full: nothing drew on it


def test_a_failed_revalidation_quarantines_the_node_and_nothing_returns_it(
    slurm: SlurmCluster, nodes: Any, remediator: Callable[..., Remediator]
) -> None:
    """revalidating -> quarantined with an RMA report; then no repair report, no forged follow-up and no
    annotation puts it back; only a human's release does, to awaiting repair."""
    r = remediator(standby_target=1)
    parent = r.alert("n1", "xid-48", "1")
    r.wait_state("n1", "awaiting_repair")
    r.inject("n1", "xid-48", 1)  # the "repair" did not fix the memory
    r.lifecycle.repaired("n1", "test")
    r.wait_state("n1", "quarantined")
    info = slurm.node("n1")
    assert info.drained and info.reason.startswith("fleetheal:quarantine"), info.reason
    assert _pool_label(nodes, "n1") == "quarantine"
    (rma,) = r.reports("rma", "n1")
    assert rma["reason"].startswith("failed revalidation"), rma["reason"]
    assert "dcgm_diag" in rma["reason"] and rma["faults"]["per_fault"] == {"xid-48": 1}

    # Nothing the loop does returns it: a repair report is refused...
    with pytest.raises(LifecycleError, match="quarantined, not awaiting repair"):
        r.lifecycle.repaired("n1", "test")
    # ...and a REJOIN forged into the store (a bug, or someone with write access to it) is denied by the gate.
    root = r.store.get(parent)
    assert root is not None
    moved = r.store.transition("n1", "quarantined", "forged", parent, follow_up=FollowUp(root, "REJOIN"))
    assert moved is not None and moved[1] is not None
    forged = moved[1]
    r.loop.call_soon_threadsafe(r.engine.submit, [forged])
    deadline = time.monotonic() + 30
    while (got := r.store.get(forged)) is not None and got.state not in ("done", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert got is not None and got.decision == "deny", got
    assert slurm.node("n1").drained
    # A human releases it after the RMA: it awaits repair again (and revalidates before anything else).
    assert r.store.release("n1", "RMA done")
    assert r.store.transition("n1", "awaiting_repair", "released", parent, expect=("quarantined",))
    assert r.state("n1") == "awaiting_repair"


def test_an_annotation_on_a_node_that_awaits_no_repair_is_ignored_and_removed(
    nodes: Any, remediator: Callable[..., Remediator]
) -> None:
    """Whoever may annotate Nodes (a node's own kubelet credentials, say) cannot start a revalidation."""
    r = remediator(standby_target=1)
    nodes.patch_node("n2", {"metadata": {"annotations": {contracts.ANNOTATION_REPAIRED: "me"}}})
    deadline = time.monotonic() + 30
    while contracts.ANNOTATION_REPAIRED in (nodes.read_node("n2").metadata.annotations or {}):
        assert time.monotonic() < deadline, "the annotation was not removed"
        time.sleep(0.2)
    assert r.state("n2") == "active" and r.transitions("n2") == []
    audit = [a for a in r.store.audit_log() if a["decision"] == "repaired"]
    assert audit and audit[-1]["reason"].startswith("ignored: n2 is active"), audit


def test_a_restart_of_the_remediator_mid_revalidation_resumes_it(
    slurm: SlurmCluster, nodes: Any, remediator: Callable[..., Remediator]
) -> None:
    r = remediator(standby_target=1, burn_in_s=20.0)
    r.alert("n1", "xid-79", "0")
    r.wait_state("n1", "awaiting_repair")
    r.lifecycle.repaired("n1", "test")
    r.wait_state("n1", "revalidating")
    (revalidation,) = [i for i in r.store.incidents(node="n1") if i.action == "REVALIDATE"]

    def running() -> bool:
        return any(s.name == "playbook" and s.pid and s.ended_at is None for s in r.store.steps(revalidation.id))

    deadline = time.monotonic() + 120
    while not running():
        assert time.monotonic() < deadline, r.explain("n1")
        time.sleep(0.2)
    time.sleep(3)  # well inside the 20 s burn-in
    r.stop()
    assert r.state("n1") == "revalidating"
    r.engine = r.start()
    r.wait_state("n1", "standby", 240)
    attempts = [s.result for s in r.store.steps(revalidation.id) if s.name == "playbook"]
    assert attempts == ["interrupted", "successful"], attempts
    assert slurm.node("n1").reason.startswith("fleetheal:standby")
