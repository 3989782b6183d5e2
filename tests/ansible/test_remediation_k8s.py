"""The Kubernetes steps of the remediation playbooks against a real kube-apiserver.

One control plane per test session (fixture `kube` in conftest.py: etcd + kube-apiserver + kube-controller-manager built by `make tools`,
`fleetheal.lab.controlplane`) with the Slinky, Kueue and prometheus-operator CRDs; every test also starts
its own private Slurm (fixture `slurm`, nodes n1..n3). Each test gets fresh Node objects named like the
Slurm nodes and its own namespace (the playbooks' `fleetheal_slurm_namespace`) holding:

- the NodeSet `lab-h100` of pool h100 (`<fleetheal_cluster>-<pool>`, fleetheal.infra.slinky_specs nodeset_name);
- a slurmd pod owned by that NodeSet on n1 and on n2, under a PodDisruptionBudget;
- a DaemonSet `fleetheal-agent` whose controller made its pod on n1 (a drain leaves it alone).

n1 and n2 are pool=active, n3 is a warm standby (pool=standby, standby taint; drained in Slurm with the
owned standby reason). There is no scheduler and no workload controller: the pods are made here as
their controllers would make them, bound to their node. kwok plays the nodes' kubelets: it marks the pods
Running and Ready (`wait_pods_running` waits for that, so the disruption controller counts them) and ends
a pod the API server has marked terminating (an evicted pod), as the node's kubelet would.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fleetheal import contracts, steps
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator.responder import FirstResponder

from .conftest import PLAYBOOKS, Playbooks, respond, responder_incident, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.kube]

CLUSTER = "lab"  # Playbooks.base_vars: fleetheal_cluster, the Slurm ClusterName
POOL = "h100"
NODESET = f"{CLUSTER}-{POOL}"  # fleetheal.infra.slinky_specs.SlinkySpecs.nodeset_name
FAILED, ACTIVE, STANDBY = "n1", "n2", "n3"
GROUP, VERSION = "slinky.slurm.net", "v1beta1"
POOL_LABEL = contracts.LABEL_POOL
GPU_POOL_LABEL = contracts.LABEL_GPU_POOL
UNHEALTHY = contracts.TAINT_UNHEALTHY
STANDBY_TAINT = contracts.TAINT_STANDBY
REPLACEMENT = contracts.K8S_PREFIX + "last-replacement"
SLURMD = {"app.kubernetes.io/name": "slurmd", "app.kubernetes.io/instance": NODESET}
AGENT = {"app.kubernetes.io/name": "fleetheal-agent"}


class PodWatch:
    """Every event on the pods of one namespace from now on (a watch on the real API server), so a test
    sees what happened to a pod that is gone: an eviction marks it DisruptionTarget=EvictionByEvictionAPI
    before the deletion."""

    def __init__(self, kube: KubeControlPlane, ns: str) -> None:
        from kubernetes import client, watch

        self.events: list[tuple[str, str, dict[str, str]]] = []
        self._watch = watch.Watch()
        core = client.CoreV1Api(kube.client())
        since = core.list_namespaced_pod(ns).metadata.resource_version
        stream = self._watch.stream(core.list_namespaced_pod, ns, resource_version=since, timeout_seconds=900)
        self._thread = threading.Thread(target=self._record, args=(stream,), name=f"watch-{ns}", daemon=True)
        self._thread.start()

    def _record(self, stream: Iterator[dict[str, Any]]) -> None:
        try:
            for event in stream:
                pod = event["object"]
                conditions = {c.type: c.reason or "" for c in pod.status.conditions or []}
                self.events.append((event["type"], pod.metadata.name, conditions))
        except Exception as e:  # the watch ends with the test (or the control plane)
            self.events.append(("ERROR", repr(e), {}))

    def evicted(self, name: str) -> bool:
        return any(n == name and c.get("DisruptionTarget") == "EvictionByEvictionAPI" for _, n, c in self.events)

    def touched(self) -> list[str]:
        return sorted({n for _, n, _ in self.events})

    def stop(self) -> None:
        self._watch.stop()


@dataclass
class Scene:
    """The objects of one test on the real API server, and readers for them."""

    kube: KubeControlPlane
    ns: str
    workload: dict[str, str]  # node -> slurmd pod on it
    agent_pod: str
    pods: PodWatch
    api: Any = None

    def __post_init__(self) -> None:
        from kubernetes import client

        c = self.kube.client()
        self.api = {
            "core": client.CoreV1Api(c),
            "custom": client.CustomObjectsApi(c),
            "policy": client.PolicyV1Api(c),
        }

    @property
    def core(self) -> Any:
        return self.api["core"]

    def node(self, name: str) -> Any:
        return self.core.read_node(name)

    def labels(self, name: str) -> dict[str, str]:
        return dict(self.node(name).metadata.labels or {})

    def taints(self, name: str) -> set[tuple[str, str, str]]:
        return {(t.key, t.value or "", t.effect) for t in self.node(name).spec.taints or []}

    def cordoned(self, name: str) -> bool:
        return bool(self.node(name).spec.unschedulable)

    def pod(self, name: str) -> Any | None:
        from kubernetes.client.rest import ApiException

        try:
            return self.core.read_namespaced_pod(name, self.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def nodeset(self) -> dict[str, Any]:
        return dict(self.api["custom"].get_namespaced_custom_object(GROUP, VERSION, self.ns, "nodesets", NODESET))

    def pdb_status(self) -> Any:
        return self.api["policy"].read_namespaced_pod_disruption_budget("slurmd", self.ns).status

    def versions(self) -> dict[str, str]:
        """resourceVersion of every Node, pod of the scene and the NodeSet: any write changes one."""
        out = {f"node/{n.metadata.name}": n.metadata.resource_version for n in self.core.list_node().items}
        out |= {
            f"pod/{p.metadata.name}": p.metadata.resource_version for p in self.core.list_namespaced_pod(self.ns).items
        }
        out["nodeset"] = self.nodeset()["metadata"]["resourceVersion"]
        return out

    def vars(self, pb: Playbooks, **kw: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "fleetheal_node": FAILED,
            "fleetheal_fault_id": "xid-79",
            "fleetheal_fault_class": "hardware",
            "fleetheal_action": "ISOLATE_AND_RELOCATE",
            "fleetheal_gpu": "1",
            "fleetheal_kubeconfig": str(self.kube.kubeconfig),
            "fleetheal_slurm_namespace": self.ns,
            "fleetheal_k8s_drain_timeout_s": 30,
        }
        fields.update(kw)
        return pb.base_vars(**fields)


def _wait(what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    if not wait_until(predicate, timeout=timeout):
        raise AssertionError(f"{what}: not within {timeout:.0f} s")


def _build_scene(kube: KubeControlPlane, min_available: int) -> Scene:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    c = kube.client()
    core, apps = client.CoreV1Api(c), client.AppsV1Api(c)
    custom, policy = client.CustomObjectsApi(c), client.PolicyV1Api(c)
    ns = f"slurm-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": ns}})

    for name in (FAILED, ACTIVE, STANDBY):
        try:
            core.delete_node(name)
        except ApiException as e:
            if e.status != 404:
                raise
    _wait(
        "old Node objects gone",
        lambda: not {n.metadata.name for n in core.list_node().items} & {FAILED, ACTIVE, STANDBY},
    )
    kube.add_nodes([FAILED, ACTIVE], labels={POOL_LABEL: "active", GPU_POOL_LABEL: POOL})
    kube.add_nodes(
        [STANDBY],
        labels={POOL_LABEL: "standby", GPU_POOL_LABEL: POOL},
        taints=[{"key": STANDBY_TAINT, "effect": "NoSchedule"}],
    )

    # A DaemonSet-mode NodeSet as fleetheal.infra.slinky builds it (the fields its schema checks).
    nodeset = custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        ns,
        "nodesets",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "NodeSet",
            "metadata": {"name": NODESET, "labels": {"app.kubernetes.io/instance": CLUSTER}},
            "spec": {
                "controllerRef": {"name": CLUSTER},
                "scalingMode": "DaemonSet",
                "slurmd": {"name": "slurmd", "image": "ghcr.io/slinkyproject/slurmd:25.05-ubuntu24.04"},
                "partition": {"enabled": True, "config": "State=UP MaxTime=UNLIMITED"},
                "template": {
                    "metadata": {"labels": {GPU_POOL_LABEL: POOL}},
                    "spec": {"nodeSelector": {POOL_LABEL: "active", GPU_POOL_LABEL: POOL}},
                },
                "workloadDisruptionProtection": True,
            },
        },
    )
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodeSet",
        "name": NODESET,
        "uid": nodeset["metadata"]["uid"],
        "controller": True,
    }
    workload = {}
    for node in (FAILED, ACTIVE):
        name = f"{NODESET}-{node}"
        core.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": name, "labels": SLURMD, "ownerReferences": [owner]},
                "spec": {
                    "nodeName": node,
                    "containers": [{"name": "slurmd", "image": "ghcr.io/slinkyproject/slurmd:25.05"}],
                },
            },
        )
        kube.wait_pods_running(ns, [name])
        workload[node] = name
    policy.create_namespaced_pod_disruption_budget(
        ns,
        {"metadata": {"name": "slurmd"}, "spec": {"minAvailable": min_available, "selector": {"matchLabels": SLURMD}}},
    )

    # The agent DaemonSet; no daemonset controller runs here, so its pod on n1 is made as the
    # controller would make it: controlled by the DaemonSet, bound to the node.
    daemonset = apps.create_namespaced_daemon_set(
        ns,
        {
            "metadata": {"name": "fleetheal-agent"},
            "spec": {
                "selector": {"matchLabels": AGENT},
                "template": {
                    "metadata": {"labels": AGENT},
                    "spec": {
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{"name": "agent", "image": "ghcr.io/fleetheal/agent:0.1.0"}],
                    },
                },
            },
        },
    )
    agent = f"fleetheal-agent-{FAILED}"
    ds_owner = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "name": "fleetheal-agent",
        "uid": daemonset.metadata.uid,
        "controller": True,
    }
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": agent, "labels": AGENT, "ownerReferences": [ds_owner]},
            "spec": {
                "nodeName": FAILED,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "agent", "image": "ghcr.io/fleetheal/agent:0.1.0"}],
            },
        },
    )
    kube.wait_pods_running(ns, [agent])

    def pdb_settled() -> bool:
        pdb = policy.read_namespaced_pod_disruption_budget("slurmd", ns)
        st = pdb.status
        return bool(
            st is not None
            and st.observed_generation == pdb.metadata.generation
            and st.current_healthy == 2
            and st.disruptions_allowed == 2 - min_available
        )

    if not wait_until(pdb_settled, timeout=120):
        status = policy.read_namespaced_pod_disruption_budget("slurmd", ns).status
        raise AssertionError(f"the disruption controller did not compute the PodDisruptionBudget in 120 s: {status}")
    return Scene(kube, ns, workload, agent, PodWatch(kube, ns))


@pytest.fixture
def scene(kube: KubeControlPlane) -> Iterator[Callable[..., Scene]]:
    made: list[Scene] = []

    def make(min_available: int = 1) -> Scene:
        s = _build_scene(kube, min_available)
        made.append(s)
        return s

    yield make
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube.client())
    for s in made:
        s.pods.stop()
        # The namespace controller deletes its pods; kwok ends them, as their kubelets would.
        core.delete_namespace(s.ns)

        def gone(ns: str = s.ns) -> bool:
            try:
                core.read_namespace(ns)
            except ApiException as e:
                return e.status == 404
            return False

        _wait(f"namespace {s.ns} deleted", gone, timeout=120)


def _standby(slurm: SlurmCluster) -> None:
    slurm.scontrol("update", f"nodename={STANDBY}", "state=drain", "reason=fleetheal:standby incident=inc-0")


def test_isolate_cordons_taints_evicts_under_the_pdb_and_promotes_the_standby(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    s = scene(min_available=1)
    _standby(slurm)
    generation = s.nodeset()["metadata"]["generation"]

    run = playbooks.run("isolate_and_relocate.yml", s.vars(playbooks))
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["status"] == "done", run.report

    # The isolated node: cordoned, tainted with the fault, in quarantine.
    assert s.cordoned(FAILED)
    assert (UNHEALTHY, "xid-79", "NoSchedule") in s.taints(FAILED)
    assert s.labels(FAILED)[POOL_LABEL] == "quarantine"
    # Its slurmd pod went through the Eviction API (DisruptionTarget) and is gone; the other pool
    # member and the DaemonSet pod on the drained node stay.
    assert s.pod(s.workload[FAILED]) is None
    assert s.pods.evicted(s.workload[FAILED]), s.pods.events
    assert s.pod(s.workload[ACTIVE]).status.phase == "Running"
    agent = s.pod(s.agent_pod)
    assert agent is not None and agent.metadata.deletion_timestamp is None and agent.spec.node_name == FAILED
    _wait("the PodDisruptionBudget counts one healthy pod", lambda: s.pdb_status().current_healthy == 1)

    # The standby node: active, untainted, resumed in Slurm; its pool's NodeSet records the replacement
    # in metadata only (no new generation: the operator does not roll the pool's slurmd pods).
    assert s.labels(STANDBY)[POOL_LABEL] == "active"
    assert not {t for t in s.taints(STANDBY) if t[0] == STANDBY_TAINT}
    assert not slurm.node(STANDBY).drained
    nodeset = s.nodeset()
    assert nodeset["metadata"]["annotations"][REPLACEMENT] == f"{FAILED} -> {STANDBY} incident=inc-1"
    assert nodeset["metadata"]["generation"] == generation

    isolate = run.steps("k8s_isolate")
    assert [st["outcome"] for st in isolate] == ["done"]
    # fleetheal.cluster.k8s_node: the cordon and taint (the first responder's step), then the evictions
    assert f"{FAILED} cordoned and tainted {UNHEALTHY}; 1 pod(s) evicted from {FAILED}" in isolate[0]["detail"]
    assert [st["outcome"] for st in run.steps("standby_promote")] == ["done"]
    assert [st["outcome"] for st in run.steps("k8s_nodeset")] == ["done"]
    assert f"NodeSet {s.ns}/{NODESET}" in run.steps("k8s_nodeset")[0]["detail"]

    # Idempotent: a second run for the same incident writes nothing to the API server.
    before = s.versions()
    again = playbooks.run("isolate_and_relocate.yml", s.vars(playbooks))
    assert again.rc == 0, again.stdout[-4000:]
    assert s.versions() == before
    assert again.stats.get("changed", {}) == {}


def _isolation(s: Scene, slurm: SlurmCluster, incident: str) -> dict[str, Any]:
    """What an isolation of FAILED left in the API server and in Slurm, with the incident written generically."""

    def generic(text: str | None) -> str:
        return (text or "").replace(incident, "INC")

    pods = (*s.workload.values(), s.agent_pod)
    return {
        node: {
            "cordoned": s.cordoned(node),
            "taints": sorted(s.taints(node)),
            "labels": s.labels(node),
            "slurm": (sorted(slurm.node(node).flags), generic(slurm.node(node).reason)),
        }
        for node in (FAILED, ACTIVE, STANDBY)
    } | {
        "pods": {name: (s.pod(name) is not None, s.pods.evicted(name)) for name in pods},
        "nodeset": generic(s.nodeset()["metadata"].get("annotations", {}).get(REPLACEMENT)),
    }


def test_the_remediator_and_a_hand_run_playbook_leave_the_same_state(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    """The remediator's path (the first responder in-process, then the follow-up playbook for the same
    incident, which finds its steps done and goes on) and a human running the playbook alone end in the same
    Kubernetes and Slurm state, on the same real API server and Slurm."""
    found: dict[str, dict[str, Any]] = {}
    for path, incident in (("remediator", "inc-r"), ("by hand", "inc-h")):
        s = scene(min_available=1)
        if found:  # undo the first isolation in Slurm; the scene made the Node objects anew
            slurm.scontrol("update", f"nodename={FAILED}", "state=resume")
        _standby(slurm)
        variables = s.vars(playbooks, fleetheal_incident_id=incident, fleetheal_grace_seconds=0)
        if path == "remediator":
            responder = FirstResponder(steps.Settings.load(PLAYBOOKS, variables))
            first = respond(responder, responder_incident(incident, FAILED))
            assert {(r.step, r.outcome) for r in first} >= {
                ("slurm_drain", "done"),
                ("k8s_cordon", "done"),
                ("standby_promote", "done"),
            }, first
            assert s.cordoned(FAILED) and s.labels(STANDBY)[POOL_LABEL] == "active"
        run = playbooks.run("isolate_and_relocate.yml", variables)
        assert run.rc == 0, run.stdout[-4000:]
        assert run.report is not None and run.report["status"] == "done", run.report
        found[path] = _isolation(s, slurm, incident)
    assert found["remediator"] == found["by hand"]
    assert found["by hand"][FAILED]["labels"][POOL_LABEL] == "quarantine"
    assert found["by hand"]["nodeset"] == f"{FAILED} -> {STANDBY} incident=INC"


def test_a_pdb_that_allows_no_disruption_stops_the_drain_and_the_promotion(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    s = scene(min_available=2)  # both slurmd pods must stay: disruptionsAllowed 0
    _standby(slurm)
    timeout = 6
    t0 = time.monotonic()
    run = playbooks.run("isolate_and_relocate.yml", s.vars(playbooks, fleetheal_k8s_drain_timeout_s=timeout))
    elapsed = time.monotonic() - t0
    assert run.rc != 0
    assert run.report is not None and run.report["status"] == "failed"
    error = run.report["error"]
    assert f"Failed to delete pod {s.ns}/{s.workload[FAILED]}" in error, error
    assert "Cannot evict pod as it would violate the pod's disruption budget" in error, error
    assert "(task: Kubernetes | cordon and drain)" in error, error
    # A refused eviction is retried (every 5 s for the drain timeout), then the run fails.
    assert "FAILED - RETRYING: [localhost]: Kubernetes | cordon and drain" in run.stdout, run.stdout[-4000:]
    assert elapsed < timeout + 240, elapsed

    # The pod is untouched: the real server refused the eviction with 429.
    pod = s.pod(s.workload[FAILED])
    assert pod is not None and pod.metadata.deletion_timestamp is None and pod.status.phase == "Running"
    assert s.pods.touched() == [], s.pods.events
    # What is left: the node tainted and cordoned (nothing new lands there) but still in its pool, as
    # a human finds it to decide; no standby promoted, no NodeSet annotation.
    assert s.cordoned(FAILED)
    assert (UNHEALTHY, "xid-79", "NoSchedule") in s.taints(FAILED)
    assert s.labels(FAILED)[POOL_LABEL] == "active"
    assert s.labels(STANDBY)[POOL_LABEL] == "standby"
    assert (STANDBY_TAINT, "", "NoSchedule") in s.taints(STANDBY)
    info = slurm.node(STANDBY)
    assert info.drained and info.reason == "fleetheal:standby incident=inc-0"
    assert REPLACEMENT not in (s.nodeset()["metadata"].get("annotations") or {})
    assert not [st for st in run.report["steps"] if st["step"] in ("k8s_isolate", "standby_promote", "k8s_nodeset")]
    # The Slurm side ran before the Kubernetes steps: the node is drained with fleetheal's reason.
    assert slurm.node(FAILED).reason == contracts.drain_reason("xid-79", "inc-1", gpu="1")


def test_rejoin_removes_the_taint_uncordons_and_returns_the_node_to_the_pool(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    s = scene()
    # n1 as isolation and a passed revalidation leave it; plus a taint fleetheal does not own.
    s.core.patch_node(
        FAILED,
        {
            "metadata": {"labels": {POOL_LABEL: "quarantine"}},
            "spec": {
                "unschedulable": True,
                "taints": [
                    {"key": UNHEALTHY, "value": "xid-79", "effect": "NoSchedule"},
                    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                ],
            },
        },
    )
    slurm.scontrol("update", f"nodename={FAILED}", "state=drain", "reason=fleetheal:standby incident=inc-7")

    run = playbooks.run(
        "rejoin.yml",
        s.vars(playbooks, fleetheal_incident_id="inc-7", fleetheal_action="REJOIN", fleetheal_gpu=""),
    )
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["status"] == "done"
    assert not s.cordoned(FAILED)
    assert s.taints(FAILED) == {("nvidia.com/gpu", "present", "NoSchedule")}
    assert s.labels(FAILED)[POOL_LABEL] == "active"
    assert wait_until(lambda: not slurm.node(FAILED).drained)
    assert [st["outcome"] for st in run.steps("k8s_rejoin")] == ["done"]


def test_dry_run_reports_would_and_writes_nothing_to_the_api_server(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    s = scene()
    _standby(slurm)
    before = s.versions()

    run = playbooks.run("isolate_and_relocate.yml", s.vars(playbooks, fleetheal_dry_run=True))
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["status"] == "dry_run"
    assert s.versions() == before
    assert s.pods.touched() == [], s.pods.events
    assert not slurm.node(FAILED).drained and slurm.node(STANDBY).drained

    isolate = run.steps("k8s_isolate")
    assert [st["outcome"] for st in isolate] == ["would"]
    assert isolate[0]["detail"] == f"would cordon {FAILED}, taint it {UNHEALTHY}=xid-79:NoSchedule and drain it"
    promote = run.steps("standby_promote")
    assert [st["outcome"] for st in promote] == ["would"]
    assert f"label it {POOL_LABEL}=active and remove its {STANDBY_TAINT} taint" in promote[0]["detail"]
    nodeset = run.steps("k8s_nodeset")
    assert [st["outcome"] for st in nodeset] == ["would"]
    assert nodeset[0]["detail"] == (
        f'would annotate NodeSet {s.ns}/{NODESET} {REPLACEMENT}="{FAILED} -> {STANDBY} incident=inc-1"'
    )


def test_promotion_without_the_nodeset_is_done_and_the_annotation_skipped(
    slurm: SlurmCluster, playbooks: Playbooks, scene: Callable[..., Scene]
) -> None:
    s = scene()
    _standby(slurm)
    s.api["custom"].delete_namespaced_custom_object(GROUP, VERSION, s.ns, "nodesets", NODESET)
    run = playbooks.run("isolate_and_relocate.yml", s.vars(playbooks))
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["status"] == "done"
    assert s.labels(STANDBY)[POOL_LABEL] == "active"
    step = run.steps("k8s_nodeset")
    assert [st["outcome"] for st in step] == ["skipped"]
    assert step[0]["detail"] == (
        f"no NodeSet {s.ns}/{NODESET} for pool {POOL}: the promotion of {STANDBY} is not recorded there"
    )
