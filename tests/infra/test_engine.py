"""The example stack (Pulumi.yaml + Pulumi.dev.yaml) under the real Pulumi engine, the real Kubernetes
provider and a real kube-apiserver: `preview --policy-pack policies`, `up`, a second `up` and `destroy`.

The engine, the provider, etcd, kube-apiserver and kube-controller-manager come from `make tools`
(.tools/bin); without them these tests fail, naming it. State lives in a file backend under tmp_path.
The control plane runs no workload controllers (nothing makes the pods of a Deployment, StatefulSet or
DaemonSet), so the stack runs with awaitReadiness=false.
The tests run in file order against one control plane and one stack.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pulumi import automation as auto

from fleetheal import contracts, steps
from fleetheal.infra import config, engine, project
from fleetheal.infra.remediator_config import NAME as REMEDIATOR
from fleetheal.lab import controlplane
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.remediator.leader import api_client
from fleetheal.remediator.membership import MembershipController
from tests.remediator.test_membership import in_thread

pytestmark = [pytest.mark.kube, pytest.mark.pulumi]

STACK = "dev"
DEV = config.from_values(project.stack_values(STACK))
NODES = [n for p in DEV.gpu_pools for n in (*p.node_names, *p.standby_node_names)]
SLINKY = ("slinky.slurm.net", "v1beta1")
MONITORING = ("monitoring.coreos.com", "v1")
PROVIDER_MODULE = "github.com/pulumi/pulumi-kubernetes/provider/v4"
PROVIDER_GO_MOD = project.REPO_ROOT / "tools" / "pulumi-resource-kubernetes" / "go.mod"
durations: dict[str, float] = {}


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Iterator[KubeControlPlane]:
    bin_dir = controlplane.tools_dir()
    missing = [b for b in controlplane.BINARIES if not os.access(bin_dir / b, os.X_OK)]
    missing += engine.missing_tools(bin_dir)
    if missing:
        pytest.fail(f"{', '.join(missing)} not found in {bin_dir}: run `make tools` (scripts/build-tools.sh) first")
    with KubeControlPlane(tmp_path_factory.mktemp("kube")) as cp:
        # Kueue and the Prometheus operator are prerequisites of the stack; the Slinky CRDs are the
        # stack's own (slinkyMode=manifests applies them).
        cp.install_crds(p for p in controlplane.default_crds(shared) if "slinky" not in p.parts)
        cp.add_nodes(NODES)
        yield cp


@pytest.fixture(scope="module")
def target(kube: KubeControlPlane, tmp_path_factory: pytest.TempPathFactory) -> engine.Target:
    def key(size: int) -> str:
        return base64.b64encode(secrets.token_bytes(size)).decode()

    return engine.Target(
        stack=STACK,
        kubeconfig=kube.kubeconfig,
        backend=tmp_path_factory.mktemp("backend"),
        bin_dir=controlplane.tools_dir(),
        passphrase="fleetheal-test-passphrase",
        settings={"awaitReadiness": "false"},
        secrets={"slurmKey": key(1024), "slurmJwtKey": key(32), "remediatorToken": secrets.token_hex(16)},
    )


@pytest.fixture(scope="module")
def api(kube: KubeControlPlane) -> Any:
    return kube.client()


@pytest.fixture(scope="module")
def membership(kube: KubeControlPlane) -> Iterator[MembershipController]:
    """The remediator's membership controller, as its leader runs it (its Deployment makes no pod here)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client(str(kube.kubeconfig)))
    # A short grace: `destroy` deletes the ConfigMaps, and the last test waits for the releases.
    with in_thread(MembershipController(core, DEV.system_namespace, release_grace_s=3)) as controller:
        yield controller


def _wait(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def _fleet_labels(api: Any, name: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    node = _node(api, name)
    labels = {k: v for k, v in (node.metadata.labels or {}).items() if k.startswith(contracts.K8S_PREFIX)}
    return labels, [(t.key, t.value, t.effect) for t in node.spec.taints or []]


def _pools(change: Callable[[dict[str, list[str]]], None]) -> dict[str, str]:
    """The stack's settings with the example stack's gpuPools changed by `change` (pool -> node names)."""
    pools = [dict(p) for p in project.stack_values(STACK)["gpuPools"]]
    names = {p["name"]: list(p["nodeNames"]) for p in pools}
    change(names)
    for p in pools:
        p["nodeNames"] = names[p["name"]]
    return {"gpuPools": json.dumps(pools)}


def timed(name: str, capsys: pytest.CaptureFixture[str], run: Callable[[], Any]) -> Any:
    started = time.monotonic()
    try:
        return run()
    finally:
        durations[name] = time.monotonic() - started
        with capsys.disabled():
            print(f"\n[engine] {name}: {durations[name]:.1f} s")


def _node(api: Any, name: str) -> Any:
    from kubernetes import client

    return client.CoreV1Api(api).read_node(name)


def _custom(api: Any, group_version: tuple[str, str], ns: str, plural: str) -> list[dict[str, Any]]:
    from kubernetes import client

    items = client.CustomObjectsApi(api).list_namespaced_custom_object(*group_version, ns, plural)["items"]
    return list(items)


def test_preview_with_the_policy_pack_passes(target: engine.Target, capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    result = timed(
        "preview --policy-pack policies",
        capsys,
        lambda: engine.preview(target, [engine.POLICY_PACK], on_output=lines.append),
    )
    creates = result.change_summary.get(auto.OpType.CREATE, 0)
    assert creates > 50, result.change_summary
    assert engine.changes(result.change_summary) == creates
    # the engine lists the pack it ran, with the version from policies/PulumiPolicy.yaml
    version = yaml.safe_load((engine.POLICY_PACK / "PulumiPolicy.yaml").read_text())["version"]
    assert any(f"fleetheal@v{version}" in line for line in lines), "\n".join(lines)


def test_the_secrets_are_optional(target: engine.Target, capsys: pytest.CaptureFixture[str]) -> None:
    # Declared with the default "" (the engine requires a declared key without a default): unset, the
    # program creates none of the three Secrets and expects them to exist.
    with_secrets = timed("preview (secrets set)", capsys, lambda: engine.preview(target))
    bare = dataclasses.replace(target, secrets={})
    without = timed("preview (no secrets)", capsys, lambda: engine.preview(bare))
    created = with_secrets.change_summary[auto.OpType.CREATE] - without.change_summary[auto.OpType.CREATE]
    assert created == 3, (with_secrets.change_summary, without.change_summary)


def test_preview_rejects_a_stack_the_policy_pack_forbids(
    target: engine.Target, capsys: pytest.CaptureFixture[str]
) -> None:
    # A remediator token Secret other than the one the pack allows: the remediator's Role would read
    # a Secret that the remediator-rbac-least-privilege policy (mandatory) does not allow.
    bad = dataclasses.replace(target, settings={**target.settings, "remediatorTokenSecret": "other-token"})
    with pytest.raises(auto.CommandError) as err:
        timed("preview (violating)", capsys, lambda: engine.preview(bad, [engine.POLICY_PACK]))
    message = str(err.value)
    assert "remediator-rbac-least-privilege" in message, message
    assert "lets the remediator read Secrets beyond its own" in message, message


def test_preview_holds_a_production_stack_to_a_highly_available_remediator(
    target: engine.Target, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example stack marked production: one remediator on SQLite is refused by both production rules.
    prod = {**target.settings, "environment": "production"}
    with pytest.raises(auto.CommandError) as err:
        timed(
            "preview (production, sqlite)",
            capsys,
            lambda: engine.preview(dataclasses.replace(target, settings=prod), [engine.POLICY_PACK]),
        )
    message = str(err.value)
    assert "production-remediator-shared-store" in message and "production-remediator-replicas" in message, message
    # Two replicas on the in-cluster PostgreSQL (its password a secret) pass the pack.
    ha = dataclasses.replace(
        target,
        settings={**prod, "remediatorReplicas": "2", "remediatorStore": "postgres-in-cluster"},
        secrets={**target.secrets, "remediatorDbPassword": secrets.token_hex(16)},
    )
    result = timed("preview (production, postgres)", capsys, lambda: engine.preview(ha, [engine.POLICY_PACK]))
    assert result.change_summary.get(auto.OpType.CREATE, 0) > 50, result.change_summary


def test_up_creates_the_stack(
    target: engine.Target, api: Any, membership: MembershipController, capsys: pytest.CaptureFixture[str]
) -> None:
    from kubernetes import client

    lines: list[str] = []
    result = timed("up", capsys, lambda: engine.up(target, on_output=lines.append))
    assert result.summary.result == "succeeded"
    # The engine ran the provider `make tools` built, although the SDK asks for its own version: it
    # warns about the skew and goes on (the project's plugins entry carries no version).
    built = PROVIDER_GO_MOD.read_text().split(f"{PROVIDER_MODULE} v", 1)[1].split()[0]
    skew = [line for line in lines if f"but has {built}" in line]
    assert skew, "\n".join(lines)
    with capsys.disabled():
        print(f"\n[engine] {skew[0].strip()}")
    assert engine.changes(result.summary.resource_changes) > 50, result.summary.resource_changes
    nodesets = [f"{DEV.cluster_name}-{p.name}" for p in DEV.gpu_pools]
    assert result.outputs["nodeSets"].value == nodesets

    names = {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}
    assert {DEV.slurm_namespace, DEV.system_namespace, *DEV.kueue_namespaces} <= names

    found = {o["metadata"]["name"]: o for o in _custom(api, SLINKY, DEV.slurm_namespace, "nodesets")}
    assert sorted(found) == sorted(nodesets)
    h100 = found[f"{DEV.cluster_name}-h100"]
    assert h100["spec"]["template"]["spec"]["nodeSelector"][contracts.LABEL_GPU_POOL] == "h100"

    # The stack declares the pools' membership; the controller puts the labels and taints on the Nodes.
    _wait("the membership on every node", lambda: all(_fleet_labels(api, n)[0] for n in NODES))
    assert _fleet_labels(api, "gpu-h100-01") == (
        {
            contracts.LABEL_POOL: "active",
            contracts.LABEL_GPU_POOL: "h100",
            contracts.LABEL_GPU_TYPE: "h100",
            contracts.LABEL_FAILURE_DOMAIN: "h100-fd0",
        },
        [],
    )
    labels, taints = _fleet_labels(api, "gpu-h100-09")
    assert labels[contracts.LABEL_POOL] == "standby"
    assert taints == [(contracts.TAINT_STANDBY, "h100", "NoSchedule")]

    deployment = client.AppsV1Api(api).read_namespaced_deployment(REMEDIATOR, DEV.system_namespace)
    assert deployment.spec.replicas == 1
    # awaitReadiness=false: the stack-wide transform annotated every object
    assert deployment.metadata.annotations["pulumi.com/skipAwait"] == "true"

    monitors = _custom(api, MONITORING, DEV.system_namespace, "servicemonitors")
    assert monitors, "no ServiceMonitor in the system namespace"
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)


def test_second_up_changes_nothing_and_a_promotion_survives_it(
    target: engine.Target,
    api: Any,
    kube: KubeControlPlane,
    membership: MembershipController,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The remediator promotes the a100 pool's standby node with its own step and field manager.
    promoted = "gpu-a100-05"
    assert steps.k8s_promote(steps.Kube(steps.Settings(kubeconfig=str(kube.kubeconfig))), promoted).outcome == "done"
    result = timed("up (again)", capsys, lambda: engine.up(target))
    assert result.summary.result == "succeeded"
    assert engine.changes(result.summary.resource_changes) == 0, result.summary.resource_changes
    assert result.summary.resource_changes.get("same", 0) > 50
    assert membership.sync().applied == 0  # a full resync: nothing differs from what was applied
    labels, taints = _fleet_labels(api, promoted)
    assert labels[contracts.LABEL_POOL] == "active" and taints == []


def test_a_node_added_moved_and_removed_is_one_changed_pool_and_converges(
    target: engine.Target, api: Any, kube: KubeControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    new, moved = "gpu-a100-06", "gpu-h100-08"
    kube.add_nodes([new])

    def add(p: dict[str, list[str]]) -> None:
        p["a100"].append(new)

    def move(p: dict[str, list[str]]) -> None:
        add(p)
        p["h100"].remove(moved)
        p["a100"].append(moved)

    def remove(p: dict[str, list[str]]) -> None:
        p["h100"].remove(moved)
        p["a100"].append(moved)

    def step(what: str, change: Callable[[dict[str, list[str]]], None], pools: set[str], node: str, pool: str) -> None:
        """Change the pools, preview (one ConfigMap per pool touched, the diff naming `node`), up, converge."""
        changed = dataclasses.replace(target, settings={**target.settings, **_pools(change)})
        lines: list[str] = []
        result = timed(
            f"preview (node {what})", capsys, lambda: engine.preview(changed, on_output=lines.append, diff=True)
        )
        # Updates in place only: each touched pool's membership ConfigMap, and what follows from the pools'
        # sizes (the Kueue quotas, the remediator's node list); never an object per node.
        updated = [
            lines[i + 1].split("[id=", 1)[1].rstrip("]").split("/")[-1]
            for i, x in enumerate(lines)
            if x.endswith(": (update)") and "[id=" in lines[i + 1]
        ]
        assert engine.changes(result.change_summary) == len(updated), (result.change_summary, updated)
        prefix = contracts.membership_configmap("")
        assert {u.removeprefix(prefix) for u in updated if u.startswith(prefix)} == pools, updated
        queues = {f"{DEV.cluster_name}-large", f"{DEV.cluster_name}-small"}
        assert {u for u in updated if not u.startswith(prefix)} <= {REMEDIATOR, *queues}, updated
        assert any(node in line for line in lines), "\n".join(lines)
        assert timed(f"up (node {what})", capsys, lambda: engine.up(changed)).summary.result == "succeeded"
        want = {contracts.LABEL_GPU_POOL: pool, contracts.LABEL_POOL: "active"} if pool else {}
        _wait(
            f"{node}'s membership after it was {what}",
            lambda: {k: v for k, v in _fleet_labels(api, node)[0].items() if k in want or not want} == want,
        )

    step("added", add, {"a100"}, new, "a100")
    step("moved", move, {"a100", "h100"}, moved, "a100")
    step("removed", remove, {"a100"}, new, "")
    assert _fleet_labels(api, new) == ({}, [])  # released: no label, no taint of ours


def test_destroy_removes_the_stack(
    target: engine.Target, api: Any, membership: MembershipController, capsys: pytest.CaptureFixture[str]
) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    result = timed("destroy", capsys, lambda: engine.destroy(target))
    assert result.summary.result == "succeeded"
    assert result.summary.resource_changes.get("delete", 0) > 50, result.summary.resource_changes

    # The membership ConfigMaps went with the stack: the controller releases what it applied.
    for name in ("gpu-h100-01", "gpu-h100-09"):
        _wait(f"{name} released", lambda name=name: _fleet_labels(api, name) == ({}, []))
    with pytest.raises(ApiException) as gone:
        client.AppsV1Api(api).read_namespaced_deployment(REMEDIATOR, DEV.system_namespace)
    assert gone.value.status == 404
    # The namespaces are deleted (the namespace controller may still be emptying them).
    for ns in client.CoreV1Api(api).list_namespace().items:
        if ns.metadata.name in (DEV.slurm_namespace, DEV.system_namespace):
            assert ns.metadata.deletion_timestamp is not None, ns.metadata.name
    with capsys.disabled():
        print("\n[engine] " + ", ".join(f"{k}: {v:.1f} s" for k, v in durations.items()))
