"""Lending idle Slurm nodes to Kubernetes workloads and taking them back (fleetheal.remediator.lending), on a real
control plane (kube-apiserver, kube-controller-manager for the PodDisruptionBudgets, kube-scheduler, kwok nodes),
the real Kueue controller with the stack's queues, and a real Slurm whose nodes have the same names
(fleetheal.lab.sharedpool).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetheal import contracts, steps, taxonomy
from fleetheal.lab.controlplane import KubeControlPlane, default_crds, tools_built
from fleetheal.lab.kueue import KueueController, kueue_built
from fleetheal.lab.sharedpool import POOL, SLEEP, SharedPool
from fleetheal.remediator.alerts import validate_alert
from fleetheal.remediator.config import LendingConfig, LendingPool
from fleetheal.remediator.lending import WAITING_REASONS, Round
from tests.remediator.conftest import alert, make_config

pytestmark = [pytest.mark.kube, pytest.mark.slurm]


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Iterator[KubeControlPlane]:
    if not (tools_built() and kueue_built()):
        pytest.fail("the control plane or Kueue is not built: run `make tools`")
    with KubeControlPlane(tmp_path_factory.mktemp("kube"), scheduler=True) as plane:
        plane.install_crds(default_crds(shared))
        yield plane


@pytest.fixture(scope="module")
def kueue(cp: KubeControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueController]:
    with KueueController(cp, tmp_path_factory.mktemp("kueue"), ("ml",)) as controller:
        yield controller


@pytest.fixture
def pool(cp: KubeControlPlane, kueue: KueueController, tmp_path: Path) -> Iterator[SharedPool]:
    with SharedPool(cp, tmp_path, kueue=kueue) as p:
        yield p


def _wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def _rounds(pool: SharedPool, what: str, check: Callable[[Round], bool], timeout: float = 60.0) -> Round:
    """Run rounds until `check(round)`; the round that satisfied it."""
    deadline = time.monotonic() + timeout
    while not check(r := pool.ctl.step()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last round: {r}")
        time.sleep(0.2)
    return r


def _waits_for_nodes(pool: SharedPool, job: str) -> None:
    _wait(f"job {job} to wait for nodes", lambda: pool.job_reason(job).startswith(WAITING_REASONS))


def test_an_idle_node_is_lent_to_a_waiting_pod_and_slurm_takes_it_back_when_a_job_waits(pool: SharedPool) -> None:
    pod = pool.inference_pod()
    r = pool.ctl.step()
    assert r.waiting_gpus == {"h100": 2} and len(r.lent) == 1, r
    (lent,) = r.lent
    # Slurm starts nothing there; the slurmd NodeSet (pool=active) lets it go; Kueue's flavour (pool=lent) takes it.
    node = pool.slurm.node(lent)
    assert (node.state, node.drained, node.reason) == ("IDLE", True, contracts.LENT_REASON)
    doc = pool.node(lent)
    assert doc["metadata"]["labels"][contracts.LABEL_POOL] == contracts.POOL_LENT
    assert {"key": contracts.TAINT_LENT, "value": POOL, "effect": "NoSchedule"} in doc["spec"]["taints"]
    assert _wait("the pod to run", lambda: pool.running_on(pod)) == lent
    r = pool.ctl.step()
    assert r.lent == [] and r.uses[(POOL, "inference")] == [1, 2] and r.uses[(POOL, "idle")] == [2, 4], r

    # A training job needs all three nodes: the lent one is taken back, its pod evicted.
    job = pool.slurm.sbatch(SLEEP, "-N", "3")
    _waits_for_nodes(pool, job)
    r = _rounds(pool, "the node back in Slurm", lambda r: lent in r.reclaimed)
    assert r.slurm_short == 1
    assert pool.pool_of(lent) == "active" and contracts.TAINT_LENT not in str(pool.node(lent)["spec"].get("taints"))
    assert pool.pod(pod) is None
    _wait("the job to run", lambda: pool.slurm.job_state(job) == "RUNNING")
    assert [a["decision"] for a in pool.store.audit_log() if a["node"] == lent] == ["lend", "reclaim"]
    # The workload comes back, admitted again (its evicted pod left the quota): nothing is lent while the job holds
    # every node.
    pool.inference_pod()
    r = pool.ctl.step()
    assert r.lent == [] and r.uses[(POOL, "training")] == [3, 6], r


def test_kueue_admits_within_what_the_pool_may_lend_and_a_pod_past_it_gets_no_node(pool: SharedPool) -> None:
    """The stack's queues on the real Kueue: its quota is the GPUs the pool may lend (three nodes of two), so a
    fourth pod stays gated, and only the admitted pods, with the flavour's selector and tolerations, are lent for."""
    admitted = [pool.inference_pod() for _ in range(3)]
    past = pool.inference_pod(admit=False)
    r = pool.ctl.step()
    assert r.waiting_gpus == {"h100": 6} and len(r.lent) == 3, r
    _wait("the pods to run", lambda: all(pool.running_on(p) for p in admitted))
    assert sorted(pool.running_on(p) for p in admitted) == sorted(r.lent)
    pod = pool.pod(past)
    assert pod is not None and "kueue.x-k8s.io/admission" in [g["name"] for g in pod["spec"]["schedulingGates"]]
    assert pool.ctl.step().waiting_gpus == {}


def test_a_node_taken_back_is_not_lent_again_before_its_job_starts(
    cp: KubeControlPlane, kueue: KueueController, tmp_path: Path
) -> None:
    """Once the lent node is back, the waiting job has the idle nodes it needs and starts at Slurm's next scheduling
    pass (the deployed timers); the pod evicted meanwhile is made again and waits. A round in between lent the node
    again: the demo's Deployment had a node lent and taken back every 3 s."""
    with SharedPool(cp, tmp_path, kueue=kueue, fast_timers=False) as pool:
        pod = pool.inference_pod()
        (lent,) = pool.ctl.step().lent
        _wait("the pod to run", lambda: pool.running_on(pod))
        job = pool.slurm.sbatch(SLEEP, "-N", "3")
        _waits_for_nodes(pool, job)
        _rounds(pool, "the node back in Slurm", lambda r: lent in r.reclaimed)
        pool.inference_pod()  # the evicted pod, made again by its ReplicaSet and admitted again
        deadline = time.monotonic() + 60
        while pool.slurm.job_state(job) != "RUNNING":
            assert time.monotonic() < deadline, "the job did not start"
            r = pool.ctl.step()
            assert r.lent == [], r
            time.sleep(0.3)


def test_lending_keeps_its_rules(cp: KubeControlPlane, kueue: KueueController, tmp_path: Path) -> None:
    """Never a busy, cordoned or non-active node; never more than max_nodes, even when Kueue's quota is larger (a
    stack the policy pack refuses); nothing more while a job waits."""
    with SharedPool(cp, tmp_path, nodes=4, max_nodes=2, kueue=kueue, quota_nodes=4) as pool:
        a, b, c, d = pool.names
        pool.slurm.sbatch(SLEEP, "-w", a)  # a runs a job
        _wait("a's job", lambda: pool.slurm.node(a).state in ("ALLOCATED", "MIXED"))
        cordon = {"spec": {"unschedulable": True}}
        pool.cp.request("PATCH", f"/api/v1/nodes/{b}", cordon, "application/merge-patch+json")
        pool.store.transition(c, "isolated", "a test's fault", None)  # c left the lifecycle's active state
        for _ in range(4):
            pool.inference_pod()  # admitted: the quota is all four nodes
        r = pool.ctl.step()
        assert r.lent == [d], r  # the only idle, schedulable, active node
        assert r.uses[(POOL, "repair")] == [1, 2] and r.uses[(POOL, "training")] == [1, 2], r
        pool.cp.request(
            "PATCH", f"/api/v1/nodes/{b}", {"spec": {"unschedulable": None}}, "application/merge-patch+json"
        )
        assert pool.ctl.step().lent == [b]
        assert pool.ctl.step().lent == []  # max_nodes: 2
        # A job waits for nodes: nothing more is lent, and nodes lent less than min_lent_s ago stay lent.
        pool.ctl.cfg = LendingConfig(True, 0.2, {POOL: LendingPool(max_nodes=3, min_lent_s=3600.0)}, ("ml",))
        _waits_for_nodes(pool, pool.slurm.sbatch(SLEEP, "-N", "4"))
        r = pool.ctl.step()
        assert r.slurm_short >= 1 and r.lent == [] and r.reclaimed == [] and r.reclaiming == {}, r
        assert pool.pool_of(d) == pool.pool_of(b) == contracts.POOL_LENT


def test_a_pod_outside_kueues_namespaces_never_gets_a_node_lent(pool: SharedPool) -> None:
    """The attack: anyone who may create a pod writes the lent pool's selector and toleration into it. Only pods
    of the namespaces whose queues Kueue runs (its quota bounds them) count."""
    body = pool.cp.request("GET", f"/api/v1/namespaces/ml/pods/{pool.inference_pod()}")
    pool.cp.request("DELETE", f"/api/v1/namespaces/ml/pods/{body['metadata']['name']}?gracePeriodSeconds=0")
    intruder = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{pool.prefix}-intruder", "namespace": "default"},
                "spec": body["spec"]}  # fmt: skip
    pool.cp.request("POST", "/api/v1/namespaces/default/pods", intruder)
    try:
        r = pool.ctl.step()
        assert r.waiting_gpus == {} and r.lent == [], r
    finally:
        pool.cp.request("DELETE", f"/api/v1/namespaces/default/pods/{pool.prefix}-intruder?gracePeriodSeconds=0")


def test_a_pod_being_deleted_gets_no_node_lent(pool: SharedPool) -> None:
    """A deleted pod waits for nothing. Kueue holds it a moment by its finalizer and may even admit it meanwhile: a
    test's deleted pod past the quota was admitted as the quota freed, and the next test's round lent a node for it."""
    pod = pool.inference_pod()
    path = f"/api/v1/namespaces/ml/pods/{pod}"
    hold = [{"op": "add", "path": "/metadata/finalizers/-", "value": "fleetheal.io/test-hold"}]
    pool.cp.request("PATCH", path, hold, "application/json-patch+json")
    pool.cp.request("DELETE", path)
    try:
        assert (pool.pod(pod) or {}).get("metadata", {}).get("deletionTimestamp")
        r = pool.ctl.step()
        assert r.waiting_gpus == {} and r.lent == [], r
    finally:
        pool.cp.request("PATCH", path, {"metadata": {"finalizers": None}}, "application/merge-patch+json")


def test_a_node_drained_for_a_loan_it_is_not_on_goes_back_to_slurm(pool: SharedPool) -> None:
    """A lend stopped between Slurm and the Node (a crash, an API server that did not answer) leaves an active
    node drained with the loan's reason: the next round resumes it, and leaves every other drain alone."""
    a, b, _ = pool.names
    pool.slurm.scontrol("update", f"nodename={a}", "state=DRAIN", f"reason={contracts.LENT_REASON}")
    pool.slurm.scontrol("update", f"nodename={b}", "state=DRAIN", "reason=admin: bad DIMM")
    r = pool.ctl.step()
    assert r.resumed == [a] and not pool.slurm.node(a).drained and pool.slurm.node(b).drained, r
    assert pool.ctl.step().resumed == []


def test_a_pool_that_no_longer_lends_gets_its_nodes_back(pool: SharedPool) -> None:
    pod = pool.inference_pod()
    (lent,) = pool.ctl.step().lent
    _wait("the pod to run", lambda: pool.running_on(pod))
    pool.ctl.cfg = LendingConfig(True, 0.2, {"a100": LendingPool(max_nodes=1)}, ("ml",))  # h100 lends no more
    _rounds(pool, "the node back in Slurm", lambda r: lent in r.reclaimed)
    assert pool.pool_of(lent) == "active" and not pool.slurm.node(lent).drained and pool.pod(pod) is None


def test_a_reclaim_never_evicts_a_pod_nothing_would_recreate(pool: SharedPool) -> None:
    """As a drain does (steps.pods_to_evict): a bare pod on a lent node would be lost, so it holds the reclaim."""
    pod = pool.inference_pod()
    (lent,) = pool.ctl.step().lent
    _wait("the pod to run", lambda: pool.running_on(pod))
    bare = pool.cp.request("GET", f"/api/v1/namespaces/ml/pods/{pod}")
    spec = {**bare["spec"], "nodeName": lent}
    meta = {"name": f"{pool.prefix}-bare", "namespace": "ml", "labels": {"workload": pool.prefix}}
    pool.cp.request(
        "POST", "/api/v1/namespaces/ml/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    )
    _waits_for_nodes(pool, pool.slurm.sbatch(SLEEP, "-N", "3"))
    r = _rounds(pool, "the owned pod gone", lambda r: pool.pod(pod) is None)
    assert f"no controller manages ml/{pool.prefix}-bare" in r.reclaiming[lent], r
    assert pool.running_on(f"{pool.prefix}-bare") == lent and pool.pool_of(lent) == contracts.POOL_LENT


def test_a_reclaim_evicts_what_the_loan_brought_and_leaves_other_pods(pool: SharedPool) -> None:
    """Kueue's pods and any pod holding GPUs go; a pod of another namespace without GPUs (a node service that is no
    DaemonSet's) stays, as on an active node. It once held the reclaim: the demo's lent node kept its slurmd pod,
    whose disruption budget refused the eviction."""
    pod = pool.inference_pod()
    (lent,) = pool.ctl.step().lent
    _wait("the pod to run", lambda: pool.running_on(pod))
    other = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{pool.prefix}-svc", "namespace": "default"},
             "spec": {"nodeName": lent, "containers": [{"name": "svc", "image": "registry.k8s.io/pause:3.10"}]}}  # fmt: skip
    path = f"/api/v1/namespaces/default/pods/{pool.prefix}-svc"
    pool.cp.request("POST", "/api/v1/namespaces/default/pods", other)
    try:
        _waits_for_nodes(pool, pool.slurm.sbatch(SLEEP, "-N", "3"))
        _rounds(pool, "the node back in Slurm", lambda r: lent in r.reclaimed)
        assert pool.pod(pod) is None and pool.cp.request("GET", path)["spec"]["nodeName"] == lent
    finally:
        pool.cp.request("DELETE", f"{path}?gracePeriodSeconds=0")


def test_a_reclaim_honours_the_pods_disruption_budget(pool: SharedPool) -> None:
    pod = pool.inference_pod(labels={"app": "guarded"})
    (lent,) = pool.ctl.step().lent
    _wait("the pod to run", lambda: pool.running_on(pod))
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": "ml"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    }
    path = "/apis/policy/v1/namespaces/ml/poddisruptionbudgets"
    pool.cp.request("POST", path, pdb)
    _wait(
        "the budget's status", lambda: pool.cp.request("GET", f"{path}/guarded").get("status", {}).get("expectedPods")
    )
    job = pool.slurm.sbatch(SLEEP, "-N", "3")
    _waits_for_nodes(pool, job)
    r = pool.ctl.step()
    assert "eviction refused" in r.reclaiming[lent] and "429" in r.reclaiming[lent], r
    assert pool.running_on(pod) == lent and pool.pool_of(lent) == contracts.POOL_LENT  # never forced
    # Closed to new pods meanwhile: a pod made again (a ReplicaSet's, admitted again) never lands on it. Without the
    # taint the demo's Deployment put its evicted pod straight back and the reclaim never ended.
    newcomer = pool.inference_pod()
    time.sleep(1.0)
    assert not (pool.pod(newcomer) or {}).get("spec", {}).get("nodeName")
    # The reclaim is on the Node: the next round (or a new leader) goes on with it first.
    assert "reclaim" in json.loads(pool.node(lent)["metadata"]["annotations"][contracts.ANNOTATION_LENT])
    pool.cp.request("DELETE", f"{path}/guarded")
    _rounds(pool, "the node back in Slurm", lambda r: lent in r.reclaimed)
    _wait("the job to run", lambda: pool.slurm.job_state(job) == "RUNNING")


def test_a_fault_on_a_lent_node_is_healed_like_any_other_and_the_node_leaves_the_lent_state(
    pool: SharedPool, tmp_path: Path
) -> None:
    """An incident on a lent node is healing's: never reclaimed meanwhile; the isolation's own steps drain it in
    Slurm with the fault's reason, cordon it, evict its pods and quarantine it without the lent taint, so that once
    revalidated it rejoins Slurm (k8s_promote) like any other node."""
    pod = pool.inference_pod()
    (lent,) = pool.ctl.step().lent
    _wait("the pod to run", lambda: pool.running_on(pod))
    assert pool.store is not None
    cfg = make_config(tmp_path, cluster={"name": "lab", "nodes": dict.fromkeys(pool.names, "rack-0")})
    (iid,) = pool.store.ingest([validate_alert(alert(node=lent), cfg, taxonomy.load())]).created
    _waits_for_nodes(pool, pool.slurm.sbatch(SLEEP, "-N", "3"))
    r = pool.ctl.step()
    assert r.reclaimed == [] and r.reclaiming == {} and pool.pool_of(lent) == contracts.POOL_LENT, r

    kube, slurm = pool.ctl.kube, pool.ctl.slurm
    reason = contracts.drain_reason("xid-79", f"inc-{iid}")
    assert steps.drain_node(slurm, lent, reason).changed
    assert steps.k8s_isolate(kube, lent, "xid-79").changed
    drained = steps.k8s_drain(kube, lent, timeout_s=30, poll_s=0.2)
    assert drained.detail.endswith("quarantine, no longer lent"), drained.detail
    assert pool.pod(pod) is None and pool.slurm.node(lent).reason == reason
    doc = pool.node(lent)
    assert doc["metadata"]["labels"][contracts.LABEL_POOL] == "quarantine"
    assert contracts.ANNOTATION_LENT not in (doc["metadata"].get("annotations") or {})
    assert [t["key"] for t in doc["spec"]["taints"]] == [contracts.TAINT_UNHEALTHY]
    assert pool.ctl.step().uses[(POOL, "repair")] == [1, 2]
    assert steps.k8s_promote(kube, lent).outcome == "done"  # revalidated and back: nothing of the loan is left
    doc = pool.node(lent)
    assert doc["metadata"]["labels"][contracts.LABEL_POOL] == "active"
    assert contracts.TAINT_LENT not in [t["key"] for t in doc["spec"].get("taints") or []]
