"""Pool membership on the real kube-apiserver (`make tools`): the stack's ConfigMaps, as
fleetheal.infra.nodepools declares them, applied to Node objects by the remediator's controller."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fleetheal import contracts, steps
from fleetheal.infra import common
from fleetheal.infra.nodepools import membership_data
from fleetheal.infra.stack_model import GpuPool
from fleetheal.remediator.leader import api_client
from fleetheal.remediator.membership import MembershipController, desired_members

pytestmark = pytest.mark.kube

FD_SIZE = 2
_seq = itertools.count()


def pool(name: str, active: list[str], standby: list[str], gpu_type: str = "h100") -> GpuPool:
    return GpuPool(name, gpu_type, 8, len(active), len(standby), tuple(active), tuple(standby))


def configmap(p: GpuPool, namespace: str) -> dict[str, Any]:
    """The ConfigMap ExistingNodesProvider declares for `p` (tests/infra checks the provider's own)."""
    name = contracts.membership_configmap(p.name)
    labels = {
        **common.labels("pool-membership", name),
        contracts.LABEL_MEMBERSHIP: p.name,
        contracts.LABEL_GPU_POOL: p.name,
        contracts.LABEL_GPU_TYPE: p.gpu_type,
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": membership_data(p, FD_SIZE),
    }


def expected(p: GpuPool) -> dict[str, tuple[dict[str, str], list[dict[str, str]]]]:
    """What today's per-node NodePatch declared, written out: labels by list position, the standby taint."""
    out = {}
    for role, names in (("active", p.node_names), ("standby", p.standby_node_names)):
        for i, node in enumerate(names):
            labels = {
                contracts.LABEL_POOL: role,
                contracts.LABEL_GPU_POOL: p.name,
                contracts.LABEL_GPU_TYPE: p.gpu_type,
                contracts.LABEL_FAILURE_DOMAIN: f"{p.name}-fd{i // FD_SIZE}",
            }
            taints = [{"key": contracts.TAINT_STANDBY, "value": p.name, "effect": "NoSchedule"}]
            out[node] = (labels, taints if role == "standby" else [])
    return out


class Cluster:
    def __init__(self, kube: Any) -> None:
        from kubernetes import client

        self.kube = kube
        self.core = client.CoreV1Api(api_client(str(kube.kubeconfig)))
        n = next(_seq)
        self.ns = f"membership-{n}"
        self.prefix = f"m{n}"
        self.core.create_namespace({"metadata": {"name": self.ns}})

    def pool(self, name: str, active: list[str], standby: list[str], gpu_type: str = "h100") -> GpuPool:
        """A pool named for this test only (the control plane is the session's)."""
        return pool(f"{self.prefix}-{name}", active, standby, gpu_type)

    def nodes(self, *names: str) -> list[str]:
        return [f"{self.prefix}-{name}" for name in names]

    def put(self, p: GpuPool) -> None:
        body = configmap(p, self.ns)
        name = body["metadata"]["name"]
        try:
            self.core.replace_namespaced_config_map(name, self.ns, body)
        except Exception:
            self.core.create_namespaced_config_map(self.ns, body)

    def delete(self, p: GpuPool) -> None:
        self.core.delete_namespaced_config_map(contracts.membership_configmap(p.name), self.ns)

    def node(self, name: str) -> tuple[dict[str, str], list[dict[str, str]], dict[str, str]]:
        n = self.core.read_node(name)
        fleet = {k: v for k, v in (n.metadata.labels or {}).items() if k.startswith(contracts.K8S_PREFIX)}
        taints = [
            {"key": t.key, "value": t.value, "effect": t.effect}
            for t in n.spec.taints or []
            if t.key.startswith(contracts.K8S_PREFIX)
        ]
        return fleet, taints, dict(n.metadata.annotations or {})

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        t0 = time.monotonic()
        while not check():
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    def has(self, p: GpuPool, node: str) -> bool:
        labels, taints, _ = self.node(node)
        return (labels, taints) == expected(p)[node]


@pytest.fixture
def cluster(kube: Any) -> Cluster:
    return Cluster(kube)


@contextlib.contextmanager
def in_thread(controller: MembershipController) -> Iterator[MembershipController]:
    """`controller.run` in a thread, as the acting remediator runs it; stopped (and checked) on exit."""
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield controller
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the controller did not stop"


@pytest.fixture
def running(cluster: Cluster) -> Iterator[MembershipController]:
    with in_thread(MembershipController(cluster.core, cluster.ns, resync_s=60)) as controller:
        yield controller


def test_labels_and_taints_are_todays_and_unrelated_fields_are_kept(cluster: Cluster) -> None:
    a = cluster.pool("a", cluster.nodes("a0", "a1", "a2"), cluster.nodes("a3", "a4"))
    b = cluster.pool("b", cluster.nodes("b0"), cluster.nodes("b1"), gpu_type="b200")
    other = {"example.com/rack": "r7"}
    cluster.kube.add_nodes([*a.node_names, *a.standby_node_names, *b.node_names, *b.standby_node_names], labels=other)
    cluster.put(a)
    cluster.put(b)
    controller = MembershipController(cluster.core, cluster.ns)
    stats = controller.sync()
    assert (stats.applied, stats.released, stats.failed) == (7, 0, 0)
    for p in (a, b):
        for node, want in expected(p).items():
            labels, taints, annotations = cluster.node(node)
            assert (labels, taints) == want, node
            assert annotations[contracts.ANNOTATION_MEMBERSHIP].startswith(f"{p.name} {p.gpu_type} ")
            assert cluster.core.read_node(node).metadata.labels["example.com/rack"] == "r7"  # not ours: kept
    # Nothing changed: nothing is applied again.
    assert controller.sync().applied == 0


def test_add_move_remove_and_register_converge_and_a_promotion_survives(
    cluster: Cluster, running: MembershipController
) -> None:
    a0, a1, s0, s1, b0, b1, late = cluster.nodes("a0", "a1", "s0", "s1", "b0", "b1", "late")
    a = cluster.pool("a", [a0, a1], [s0, s1])
    b = cluster.pool("b", [b0], [b1], gpu_type="a100")
    cluster.kube.add_nodes([a0, a1, s0, s1, b0, b1])
    cluster.put(a)
    cluster.put(b)
    cluster.wait("the declared labels on every node", lambda: all(cluster.has(a, n) for n in (a0, a1, s0, s1)))
    cluster.wait("pool b's labels", lambda: cluster.has(b, b0) and cluster.has(b, b1))

    # The remediator promotes s0 with its own step (its own field manager).
    kube = steps.Kube(steps.Settings(kubeconfig=str(cluster.kube.kubeconfig)))
    assert steps.k8s_promote(kube, s0).outcome == "done"
    promoted = cluster.node(s0)
    assert promoted[0][contracts.LABEL_POOL] == "active" and promoted[1] == []

    # A node added to a pool's list, and one that registers after it was listed.
    a = cluster.pool("a", [a0, a1, late], [s0, s1])
    cluster.put(a)
    cluster.kube.add_nodes([late])
    cluster.wait("the late node's labels", lambda: cluster.has(a, late))

    # Moved from pool b to pool a, as a standby node.
    a = cluster.pool("a", [a0, a1, late], [s0, s1, b1])
    b = cluster.pool("b", [b0], [])
    cluster.put(b)
    cluster.put(a)
    cluster.wait("b1 moved to pool a", lambda: cluster.has(a, b1))

    # Removed from every pool: the fields this controller owns go; the Node stays.
    a = cluster.pool("a", [a0, late], [s0, s1, b1])
    cluster.put(a)
    cluster.wait("a1 released", lambda: cluster.node(a1)[:2] == ({}, []))
    assert contracts.ANNOTATION_MEMBERSHIP not in cluster.node(a1)[2]

    # Through all of that (and a full resync) the promotion of s0 held: its entry never changed.
    assert running.sync().applied == 0
    assert cluster.node(s0)[:2] == promoted[:2]


def test_a_deleted_configmap_holds_its_pool_for_the_grace_then_releases_it(cluster: Cluster) -> None:
    # (The control plane is the session's: the counts include other tests' nodes; the labels are ours.)
    p = cluster.pool("p", cluster.nodes("p0", "p1"), cluster.nodes("p2"))
    nodes = [*p.node_names, *p.standby_node_names]
    cluster.kube.add_nodes(nodes)
    cluster.put(p)
    controller = MembershipController(cluster.core, cluster.ns, release_grace_s=2.0)
    controller.sync()
    assert all(cluster.has(p, n) for n in nodes)
    # Deleted by mistake: the labels stay (slurmd keeps running), and the ConfigMap comes back in time.
    cluster.delete(p)
    assert controller.sync().held >= 3
    assert all(cluster.has(p, n) for n in nodes)
    versions = {n: cluster.core.read_node(n).metadata.resource_version for n in nodes}
    cluster.put(p)
    controller.sync()
    assert {n: cluster.core.read_node(n).metadata.resource_version for n in nodes} == versions  # not touched
    # Gone for good: after the grace the nodes are released.
    cluster.delete(p)
    controller.sync()
    assert all(cluster.has(p, n) for n in nodes)
    time.sleep(2.1)
    assert controller.sync().released >= 3
    assert all(cluster.node(n)[:2] == ({}, []) for n in nodes)


def test_upgrading_from_per_node_patches_keeps_the_labels(cluster: Cluster) -> None:
    """docs/remediator.md, "Upgrading": the old NodePatch's field manager owned the labels; once the
    controller applied them too, deleting the patch (an empty apply by its manager) takes nothing away."""
    p = cluster.pool("u", cluster.nodes("u0"), cluster.nodes("u1"))
    nodes = [*p.node_names, *p.standby_node_names]
    cluster.kube.add_nodes(nodes)
    old_manager = "pulumi-kubernetes-0123abcd"  # what a Pulumi Patch resource applies with

    def old_patch(node: str, labels: dict[str, str] | None, taints: list[dict[str, str]] | None) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
        if labels is not None:
            body["metadata"]["labels"] = labels
        if taints:
            body["spec"] = {"taints": taints}
        cluster.core.patch_node(
            node, body, field_manager=old_manager, force=True, _content_type="application/apply-patch+yaml"
        )

    for node, (labels, taints) in expected(p).items():
        old_patch(node, labels, taints)
    cluster.put(p)
    assert MembershipController(cluster.core, cluster.ns).sync().applied >= 2
    for node in nodes:
        old_patch(node, None, None)  # the `up` deletes the old patches
    assert all(cluster.has(p, n) for n in nodes)


def test_a_node_in_two_pools_is_applied_to_neither(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    n0, n1, shared = cluster.nodes("n0", "n1", "shared")
    cluster.kube.add_nodes([n0, n1, shared])
    cluster.put(cluster.pool("x", [n0, shared], [n1]))
    cluster.put(cluster.pool("y", [shared], [n1 + "-spare"]))
    with caplog.at_level("ERROR"):
        stats = MembershipController(cluster.core, cluster.ns).sync()
    assert stats.applied == 2
    assert cluster.node(shared)[:2] == ({}, [])
    pools = f"{cluster.prefix}-x, {cluster.prefix}-y"
    assert f"node {shared} is listed in pools {pools}; applied to neither" in caplog.text


def test_entries_that_are_not_membership_are_refused() -> None:
    cm = {"metadata": {"name": "fleetheal-pool-p", "labels": {contracts.LABEL_MEMBERSHIP: "p"}}, "data": {"n": "x"}}
    assert desired_members([cm]).members == {} and "labels" in desired_members([cm]).problems[0]
    cm["metadata"]["labels"] |= {contracts.LABEL_GPU_POOL: "p", contracts.LABEL_GPU_TYPE: "h100"}
    cm["data"] = {"n1": "spare p-fd0", "n2": "active", "n3": "standby p-fd1"}
    got = desired_members([cm])
    assert list(got.members) == ["n3"] and len(got.problems) == 2
    assert "'spare p-fd0' is not '<active|standby> <failure domain>'" in got.problems[0]
    # A second ConfigMap labelled for pool p (anyone who may create ConfigMaps there) claims nothing.
    rogue = {"metadata": {**cm["metadata"], "name": "mine"}, "data": {"n9": "active p-fd0", "n3": "active p-fd0"}}
    got = desired_members([cm, rogue])
    assert got.members == desired_members([cm]).members and got.pools == {"p"}
    assert "membership is ConfigMap fleetheal-pool-p; ignored" in got.problems[-1]
