"""Each component on its own under Pulumi mocks: valid objects, and bad arguments rejected first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pulumi
import pytest

from fleetheal import contracts
from fleetheal.infra import mocks
from fleetheal.infra.accounting_db import AccountingDatabase
from fleetheal.infra.agent import HealthAgent
from fleetheal.infra.alerting import AlertRouting
from fleetheal.infra.common import ComponentArgError
from fleetheal.infra.config import GpuPool
from fleetheal.infra.dcgm import DcgmExporter
from fleetheal.infra.kueue import KueueQueues
from fleetheal.infra.nodepools import EksNodeGroupProvider, ExistingNodesProvider, GpuNodePools
from fleetheal.infra.remediator import Remediator
from fleetheal.infra.slinky import SlinkyCluster
from fleetheal.infra.storage import SharedStorage
from tests.k8s_schemas import SchemaSet
from tests.pulumi.graph import assert_all_valid, by_kind

Runner = Callable[[Callable[[], Any]], list[mocks.Recorded]]
POOL = GpuPool("h100", "h100", 8, 2, 1, ("n1", "n2"), ("n3",))
RULES = [{"name": "g", "rules": [{"alert": "FleethealX", "expr": "fleetheal_agent_fault_active == 1"}]}]


def slinky_args(**over: Any) -> dict[str, Any]:
    img = "ghcr.io/slinkyproject/{}:26.05-ubuntu26.04"
    return {
        "mode": "manifests",
        "cluster_name": "c1",
        "namespace": "slurm",
        "operator_namespace": "slinky",
        "version": "1.2.1",
        "chart_repo": "oci://ghcr.io/slinkyproject/charts",
        "operator_image": "ghcr.io/slinkyproject/slurm-operator:1.2.1",
        "images": {c: img.format(c) for c in ("slurmctld", "slurmd", "slurmdbd", "slurmrestd", "login")}
        | {"helper": "docker.io/library/alpine:3.22.2"},
        "pools": (POOL,),
        "large_job_min_nodes": 4,
        "requeue_grace_seconds": 60,
        "slurm_key_secret": "sk",
        "jwt_key_secret": "jk",
        "accounting_db_host": "mariadb",
        "accounting_db_password_secret": "dbpw",
        "shared_claim": "shared",
        "shared_mount_path": "/shared",
        **over,
    }


COMPONENTS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "SlinkyCluster": (SlinkyCluster, slinky_args()),
    "SharedStorage": (
        SharedStorage,
        {"namespace": "slurm", "storage_class": "nfs", "size": "1Ti", "claim_name": "shared"},
    ),
    "GpuNodePools": (GpuNodePools, {"pools": (POOL,), "provider": ExistingNodesProvider(2)}),
    "HealthAgent": (
        HealthAgent,
        {
            "namespace": "sys",
            "image": "r/agent:1",
            "port": 9402,
            "cluster_name": "c1",
            "monitoring_labels": {"release": "kps"},
            "runtime_class": "nvidia",
        },
    ),
    "DcgmExporter": (
        DcgmExporter,
        {"namespace": "sys", "image": "r/dcgm:4", "monitoring_labels": {}, "runtime_class": ""},
    ),
    "AlertRouting": (
        AlertRouting,
        {
            "namespace": "sys",
            "rule_groups": RULES,
            "webhook_url": "http://r:9105/webhook",
            "token_secret": "tok",
            "monitoring_labels": {},
        },
    ),
    "Remediator": (
        Remediator,
        {
            "namespace": "sys",
            "image": "r/rem:1",
            "cluster_name": "c1",
            "slurm_namespace": "slurm",
            "token_secret": "tok",
            "nodes": {"n1": "fd0"},
            "dry_run": True,
            "standby_target": 2,
        },
    ),
    "KueueQueues": (
        KueueQueues,
        {
            "cluster_name": "c1",
            "pools": (POOL,),
            "namespaces": ("ml",),
            "share_percent": 50,
            "large_share_percent": 50,
            "borrowing_limit_percent": 10,
            "lending_limit_percent": 10,
        },
    ),
    "AccountingDatabase": (
        AccountingDatabase,
        {
            "namespace": "slurm",
            "service_name": "mariadb",
            "image": "docker.io/library/mariadb:11.4.5",
            "password_secret": "pw",
            "size": "10Gi",
        },
    ),
}


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_component_builds_valid_objects_alone(component: str, run_mocked: Runner, k8s_schemas: SchemaSet) -> None:
    cls, args = COMPONENTS[component]
    records = run_mocked(lambda: cls("x", args))
    types = [r.type for r in records]
    assert any(t.startswith("fleetheal:") and t.endswith(f":{component}") for t in types), types
    children = [r for r in records if r.custom]
    assert children, f"{component} registered no resources"
    assert_all_valid(k8s_schemas, records)


@pytest.mark.parametrize(
    ("component", "over", "message"),
    [
        (
            "SlinkyCluster",
            {"mode": "kustomize"},
            "SlinkyCluster.mode: 'kustomize' is not accepted; use one of: manifests, helm",
        ),
        (
            "SlinkyCluster",
            {"operator_image": "ghcr.io/slinkyproject/slurm-operator"},
            "SlinkyCluster.operator_image: 'ghcr.io/slinkyproject/slurm-operator' is not pinned; use REPOSITORY:TAG "
            "(not 'latest') or REPOSITORY@sha256:DIGEST",
        ),
        ("SlinkyCluster", {"pools": ()}, "SlinkyCluster.pools: at least one GPU pool is required"),
        (
            "SharedStorage",
            {"storage_class": ""},
            "SharedStorage.storage_class: required; name a ReadWriteMany StorageClass",
        ),
        (
            "GpuNodePools",
            {"pools": (GpuPool("p", "h100", 8, 2, 0, ("a", "b"), ()),)},
            "GpuNodePools.pools: pool 'p' has no warm-standby node; at least 1 is required",
        ),
        ("HealthAgent", {"port": 70000}, "HealthAgent.port: 70000 is not accepted; use 1-65535"),
        (
            "HealthAgent",
            {"image": "r/agent:latest"},
            "HealthAgent.image: 'r/agent:latest' is not pinned; use REPOSITORY:TAG (not 'latest') or REPOSITORY@sha256:DIGEST",
        ),
        (
            "DcgmExporter",
            {"namespace": "Sys"},
            "DcgmExporter.namespace: 'Sys' is not accepted; use lower-case letters, digits and '-' (at most 63 characters)",
        ),
        (
            "AlertRouting",
            {"webhook_url": "remediator:9105"},
            "AlertRouting.webhook_url: 'remediator:9105' is not accepted; use an http(s) URL",
        ),
        ("AlertRouting", {"rule_groups": []}, "AlertRouting.rule_groups: need at least one group, each with rules"),
        ("Remediator", {"dry_run": "yes"}, "Remediator.dry_run: 'yes' is not accepted; use true or false"),
        (
            "KueueQueues",
            {"lending_limit_percent": 101},
            "KueueQueues.lending_limit_percent: 101 is not accepted; use an integer from 0 to 100",
        ),
        ("AccountingDatabase", {"service_name": None}, "AccountingDatabase: missing required field(s) service_name"),
    ],
)
def test_bad_component_args_fail_before_any_child(component: str, over: dict[str, Any], message: str) -> None:
    cls, args = COMPONENTS[component]
    recorder = mocks.RecordingMocks()
    with pytest.raises(ComponentArgError) as exc:
        mocks.run(lambda: cls("x", {**args, **over}), recorder=recorder)
    assert str(exc.value) == message
    assert [r for r in recorder.records if r.type != "pulumi:pulumi:Stack"] == []


def test_agent_privileges_are_only_kmsg_and_gpus(run_mocked: Runner) -> None:
    cls, args = COMPONENTS["HealthAgent"]
    (ds,) = by_kind(run_mocked(lambda: cls("x", args)), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/dev/kmsg", contracts.AGENT_STATE_DIR}
    assert {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True} in c["volumeMounts"]
    assert pod["runtimeClassName"] == "nvidia"
    assert {t["key"] for t in pod["tolerations"]} >= {contracts.TAINT_STANDBY, contracts.TAINT_UNHEALTHY}
    assert set(c["resources"]) == {"requests", "limits"}


def test_agent_may_patch_nodes_only_under_its_own_node_policy(run_mocked: Runner) -> None:
    from fleetheal.infra.agent import AGENT_RBAC_RULES, own_node_policy

    cls, args = COMPONENTS["HealthAgent"]
    records = run_mocked(lambda: cls("x", args))
    (cr,) = by_kind(records, "ClusterRole")
    assert cr["rules"] == AGENT_RBAC_RULES  # every Node: RBAC cannot name "its own"
    # ... so the stack declares the admission policy the lab installs, for the agent's own ServiceAccount.
    policy, binding = own_node_policy(args["namespace"])
    (vap,) = by_kind(records, "ValidatingAdmissionPolicy")
    (vapb,) = by_kind(records, "ValidatingAdmissionPolicyBinding")
    assert vap["spec"] == policy["spec"] and vapb["spec"] == binding["spec"]
    assert vapb["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    (match,) = vap["spec"]["matchConditions"]
    assert (
        match["expression"]
        == f"request.userInfo.username == 'system:serviceaccount:{args['namespace']}:fleetheal-agent'"
    )
    # the pod's projected token, bound to the pod and so to its node, is what the policy reads
    (ds,) = by_kind(records, "DaemonSet")
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


def test_remediator_rbac_is_least_privilege(run_mocked: Runner) -> None:
    cls, args = COMPONENTS["Remediator"]
    records = run_mocked(lambda: cls("x", args))
    (cr,) = by_kind(records, "ClusterRole")
    grants = {
        (g, r, v) for rule in cr["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert ("", "nodes", "patch") in grants and ("", "pods/eviction", "create") in grants
    assert not [g for g in grants if "*" in g or g[1] == "secrets"]
    roles = {r["metadata"]["name"]: r for r in by_kind(records, "Role")}
    assert roles["fleetheal-remediator"]["rules"] == [
        {"apiGroups": ["slinky.slurm.net"], "resources": ["nodesets"], "verbs": ["get", "list", "patch"]}
    ]
    assert roles["fleetheal-remediator-token"]["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tok"], "verbs": ["get"]}
    ]


def test_eks_provider_under_gpu_node_pools(run_mocked: Runner) -> None:
    provider = EksNodeGroupProvider("prod", "arn:aws:iam::1:role/n", ("subnet-1",))
    pool = GpuPool("p5", "h100", 8, 16, 1, instance_type="p5.48xlarge")
    records = run_mocked(lambda: GpuNodePools("x", {"pools": (pool,), "provider": provider}))
    groups = [r for r in records if r.type == EksNodeGroupProvider.TYPE]
    assert [g.inputs["scalingConfig"]["desiredSize"] for g in groups] == [16, 1]
    with pytest.raises(ComponentArgError, match="cluster_name, node_role_arn and subnet_ids are required"):
        EksNodeGroupProvider("", "arn", ("s",))


def test_component_outputs_resolve_under_the_test_decorator() -> None:
    mocks_ = mocks.RecordingMocks()
    pulumi.runtime.set_mocks(mocks_, project="fleetheal", stack="t", preview=False)
    cls, args = COMPONENTS["SharedStorage"]

    @pulumi.runtime.test
    def body() -> Any:
        storage = cls("x", args)

        def check(values: list[Any]) -> None:
            urn, spec = values
            assert urn.endswith("fleetheal:storage:SharedStorage::x")
            assert spec["access_modes"] == ["ReadWriteMany"]

        return pulumi.Output.all(storage.urn, storage.claim.spec).apply(check)

    body()


def test_agent_config_map_is_a_valid_agent_config(run_mocked: Runner, tmp_path: Any) -> None:
    from fleetheal.agent.config import load_config

    cls, args = COMPONENTS["HealthAgent"]
    records = run_mocked(lambda: cls("x", args))
    (cm,) = by_kind(records, "ConfigMap")
    (ds,) = by_kind(records, "DaemonSet")
    path = tmp_path / "agent.yaml"
    path.write_text(cm["data"]["agent.yaml"])
    env = {e["name"]: "gpu-node-7" for e in ds["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e}
    cfg = load_config(path, env=env)
    assert cfg.node == "gpu-node-7"
    assert cfg.health_file == contracts.AGENT_HEALTH_FILE
    assert cfg.metrics.port == args["port"]
    assert cfg.fastpath.kubernetes.enabled and not cfg.fastpath.slurm.enabled
    assert ds["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "agent",
        "run",
        "--config",
        "/etc/fleetheal/agent.yaml",
    ]


def test_remediator_config_map_is_a_valid_remediator_config(run_mocked: Runner) -> None:
    import yaml

    from fleetheal.remediator.config import from_mapping

    cls, args = COMPONENTS["Remediator"]
    records = run_mocked(lambda: cls("x", args))
    (cm,) = by_kind(records, "ConfigMap")
    cfg = from_mapping(yaml.safe_load(cm["data"]["remediator.yaml"]), env={"FLEETHEAL_REMEDIATOR_TOKEN": "t" * 32})
    assert cfg.cluster.name == "c1" and dict(cfg.cluster.nodes) == {"n1": "fd0"}
    assert cfg.listen.port == 9105 and cfg.gate.dry_run is True
    assert cfg.auth.token_file == "/var/run/secrets/fleetheal/token"
    assert cfg.lifecycle.standby_target == 2  # the stack's standby pools: the remediator refills them to this


def test_container_commands_parse_with_the_real_fleetheal_cli(run_mocked: Runner) -> None:
    """The agent and remediator images run `fleetheal ARGS`: the args the program sets must parse."""
    from fleetheal import cli
    from fleetheal.remediator import app

    parser = cli.build_parser()
    for component, kind in (("HealthAgent", "DaemonSet"), ("Remediator", "Deployment")):
        cls, args = COMPONENTS[component]
        (workload,) = by_kind(run_mocked(lambda cls=cls, args=args: cls("x", args)), kind)
        argv = workload["spec"]["template"]["spec"]["containers"][0]["args"]
        parsed = parser.parse_args(argv)
        assert callable(parsed.func), argv
    assert Remediator.__module__ == "fleetheal.infra.remediator"
    from fleetheal.infra import remediator as infra_remediator

    assert infra_remediator.WEBHOOK_PATH == app.WEBHOOK_PATH


def test_agent_metrics_carry_node_and_cluster_labels(run_mocked: Runner, k8s_schemas: SchemaSet) -> None:
    cls, args = COMPONENTS["HealthAgent"]
    records = run_mocked(lambda: cls("x", args))
    (sm,) = by_kind(records, "ServiceMonitor")
    relabel = sm["spec"]["endpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in relabel
    assert {"action": "replace", "targetLabel": "cluster", "replacement": "c1"} in relabel
    assert sm["metadata"]["labels"]["release"] == "kps"
    bad = {
        **sm,
        "spec": {**sm["spec"], "endpoints": [{**sm["spec"]["endpoints"][0], "relabelings": [{"action": "rename"}]}]},
    }
    assert k8s_schemas.errors(bad)
