"""The whole example stack under Pulumi mocks: every object validates against the real schemas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetheal import contracts, generate
from fleetheal.infra import config, mocks, program, stack_model
from fleetheal.infra.policy import shared
from fleetheal.infra.slinky import CRD_FILES, crd_documents
from fleetheal.remediator import config as config_mod
from tests.infra.graph import assert_all_valid, by_kind, objects
from tests.k8s_schemas import SCHEMAS, SchemaSet

Runner = Callable[[Callable[[], Any]], list[mocks.Recorded]]


def _build(run_mocked: Runner, cfg: stack_model.StackConfig) -> list[mocks.Recorded]:
    return run_mocked(lambda: program.build(cfg))


def test_example_stack_objects_all_validate(
    run_mocked: Runner, dev_config: stack_model.StackConfig, k8s_schemas: SchemaSet
) -> None:
    records = _build(run_mocked, dev_config)
    checked = assert_all_valid(k8s_schemas, records)
    kinds = Counter(o["kind"] for o in objects(records))
    # what the issue asks the program to build
    for kind in (
        "CustomResourceDefinition",
        "Controller",
        "LoginSet",
        "Accounting",
        "RestApi",
        "NodeSet",
        "PersistentVolumeClaim",
        "DaemonSet",
        "ServiceMonitor",
        "PrometheusRule",
        "AlertmanagerConfig",
        "Deployment",
        "Service",
        "ClusterRole",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Role",
        "ResourceFlavor",
        "ClusterQueue",
        "LocalQueue",
        "NetworkPolicy",
    ):
        assert kinds[kind] >= 1, kind
    assert kinds["NodeSet"] == 2 and kinds["CustomResourceDefinition"] == 6
    # Existing nodes are one membership ConfigMap per GPU pool, never an object per node.
    assert "Node" not in kinds
    assert checked == sum(kinds.values()) == 69


def test_object_names_are_unique_per_kind_and_namespace(
    run_mocked: Runner, dev_config: stack_model.StackConfig
) -> None:
    keys = [
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in objects(_build(run_mocked, dev_config))
    ]
    assert len(keys) == len(set(keys))


def test_nodesets_follow_pool_labels_and_skip_standby_nodes(
    run_mocked: Runner, dev_config: stack_model.StackConfig
) -> None:
    records = _build(run_mocked, dev_config)
    nodesets = {o["metadata"]["name"]: o["spec"] for o in by_kind(records, "NodeSet")}
    h100 = nodesets["lab-h100"]
    assert h100["scalingMode"] == "DaemonSet" and h100["controllerRef"] == {"name": "lab"}
    assert h100["template"]["spec"]["nodeSelector"][contracts.LABEL_POOL] == "active"
    assert h100["template"]["spec"]["nodeSelector"][contracts.LABEL_GPU_POOL] == "h100"
    tolerated = {t["key"] for t in h100["template"]["spec"]["tolerations"]}
    assert contracts.TAINT_STANDBY not in tolerated and contracts.TAINT_UNHEALTHY not in tolerated
    assert h100["slurmd"]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert h100["extraConf"] == "Gres=gpu:h100:8 Features=h100"
    # Membership: one ConfigMap per pool in the system namespace, each node's role and failure domain.
    cms = {o["metadata"]["name"]: o for o in by_kind(records, "ConfigMap")}
    h100_members = cms[contracts.membership_configmap("h100")]
    assert h100_members["metadata"]["namespace"] == dev_config.system_namespace
    labels = h100_members["metadata"]["labels"]
    assert labels[contracts.LABEL_MEMBERSHIP] == labels[contracts.LABEL_GPU_POOL] == "h100"
    assert labels[contracts.LABEL_GPU_TYPE] == "h100"
    data = h100_members["data"]
    assert data["gpu-h100-09"] == "standby h100-fd0" and data["gpu-h100-01"] == "active h100-fd0"
    assert data["gpu-h100-05"] == "active h100-fd1"
    h100_pool = next(p for p in dev_config.gpu_pools if p.name == "h100")
    assert sorted(data) == sorted((*h100_pool.node_names, *h100_pool.standby_node_names))


def test_controller_turns_requeue_on_and_wires_the_agent_hooks(
    run_mocked: Runner, dev_config: stack_model.StackConfig
) -> None:
    records = _build(run_mocked, dev_config)
    (ctl,) = by_kind(records, "Controller")
    conf = ctl["spec"]["extraConf"].splitlines()
    assert "JobRequeue=1" in conf and "KillWait=120" in conf
    assert "HealthCheckProgram=/etc/fleetheal/slurm/healthcheck.sh" in conf
    assert "PartitionName=large Nodes=lab-h100,lab-a100 MinNodes=4 MaxTime=UNLIMITED PriorityTier=2 State=UP" in conf
    assert "PartitionName=small Nodes=lab-h100,lab-a100 MaxNodes=3 MaxTime=UNLIMITED Default=YES State=UP" in conf
    cms = {o["metadata"]["name"]: o for o in by_kind(records, "ConfigMap")}
    assert ctl["spec"]["prologScriptRefs"] == [{"name": "lab-fleetheal-prolog"}]
    assert cms["lab-fleetheal-prolog"]["data"]["10-fleetheal-agent.sh"].startswith("#!/usr/bin/env bash")
    assert (
        f'state_dir="${{FLEETHEAL_STATE_DIR:-{contracts.AGENT_STATE_DIR}}}"'
        in (cms["lab-fleetheal-hooks"]["data"]["healthcheck.sh"])
    )


def test_prometheus_rules_are_the_taxonomy_and_the_healings_own_health(
    run_mocked: Runner, dev_config: stack_model.StackConfig
) -> None:
    records = _build(run_mocked, dev_config)
    rules = {o["metadata"]["name"]: o for o in by_kind(records, "PrometheusRule")}
    assert set(rules) == {"fleetheal-faults", "fleetheal-health"}
    assert rules["fleetheal-faults"]["spec"]["groups"] == generate.alert_rule_groups()
    exprs = [r["expr"] for g in rules["fleetheal-faults"]["spec"]["groups"] for r in g["rules"]]
    assert exprs and all(contracts.METRIC_FAULT_ACTIVE in e for e in exprs)
    # The blind spots (issue 46) alert; every health alert has no fault_id, so the route below never sends
    # it to the remediator.
    health = [r for g in rules["fleetheal-health"]["spec"]["groups"] for r in g["rules"]]
    names = {r["alert"] for r in health}
    assert {"FleethealAgentNotScraped", "FleethealAgentLogSourceDown", "FleethealRemediatorUnreachable"} <= names
    assert not [r for r in health if "fault_id" in r.get("labels", {})]
    # Their `job` labels are the Services the ServiceMonitors scrape (Prometheus operator: job = Service name).
    monitors = {o["metadata"]["name"]: o for o in by_kind(records, "ServiceMonitor")}
    services = {o["metadata"]["name"] for o in by_kind(records, "Service")}
    for job in ("fleetheal-agent", "fleetheal-remediator"):
        assert job in monitors and job in services and any(f'job="{job}"' in r["expr"] for r in health), job
    (endpoint,) = monitors["fleetheal-remediator"]["spec"]["endpoints"]
    assert endpoint["port"] == "webhook" and endpoint["path"] == "/metrics"
    labels = monitors["fleetheal-remediator"]["metadata"]["labels"]
    assert dev_config.monitoring_labels.items() <= labels.items()


def test_alertmanager_routes_to_the_remediator_with_the_secret_token(
    run_mocked: Runner, dev_config: stack_model.StackConfig
) -> None:
    records = _build(run_mocked, dev_config)
    (amc,) = by_kind(records, "AlertmanagerConfig")
    matchers = amc["spec"]["route"]["matchers"]
    assert {"name": "fault_id", "matchType": "=~", "value": ".+"} in matchers  # faults only, not health alerts
    hook = amc["spec"]["receivers"][0]["webhookConfigs"][0]
    assert hook["url"] == "http://fleetheal-remediator.fleetheal-system.svc.cluster.local:9105/webhook"
    assert hook["httpConfig"]["authorization"]["credentials"] == {"name": "fleetheal-remediator-token", "key": "token"}
    # no Secret is created from config when the token is not set: it must exist already
    assert not [o for o in by_kind(records, "Secret") if o["metadata"]["name"] == "fleetheal-remediator-token"]


def test_slinky_objects_take_the_shape_of_the_operator_release(run_mocked: Runner, dev_values: dict[str, Any]) -> None:
    """1.2 and later: references without a namespace, pruneSlurmNodeRecords. Before 1.2 (the release
    tests/infra/test_slinky_operator.py runs): references name their namespace, no pruneSlurmNodeRecords."""
    for version, ref, prune in (
        ("1.2.1", {"name": "lab"}, True),
        ("1.1.0", {"name": "lab", "namespace": "slurm"}, False),
    ):
        records = _build(run_mocked, config.from_values({**dev_values, "slinkyVersion": version}))
        nodeset = by_kind(records, "NodeSet")[0]["spec"]
        assert nodeset["controllerRef"] == ref and ("pruneSlurmNodeRecords" in nodeset) is prune
        accounting_ref = by_kind(records, "Controller")[0]["spec"]["accountingRef"]
        assert ("namespace" in accounting_ref) is not prune
        operator = next(o for o in by_kind(records, "Deployment") if o["metadata"]["name"] == "slurm-operator")
        args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
        # cmd/manager's flags (an unknown one stops the operator at start)
        assert args == [
            "--leader-elect",
            "--leader-elect-namespace=slinky",
            "--health-addr=:8081",
            "--metrics-addr=:8080",
        ]
    with pytest.raises(config.ConfigError, match="slinkyVersion: 'main' is not pinned"):
        config.from_values({**dev_values, "slinkyVersion": "main"})


def test_secrets_from_config_become_secrets(run_mocked: Runner, dev_values: dict[str, Any]) -> None:
    cfg = config.from_values({**dev_values, "remediatorToken": "t" * 32, "slurmKey": "k" * 40})
    records = _build(run_mocked, cfg)
    secrets = {r.inputs["metadata"]["name"]: r for r in records if r.inputs.get("kind") == "Secret"}
    assert secrets["fleetheal-remediator-token"].inputs["stringData"] == {"token": "t" * 32}
    # Pulumi marks the whole stringData map secret; render redacts by these paths
    assert secrets["fleetheal-remediator-token"].secret_paths == ("stringData",)
    assert secrets["slurm-auth-slurm"].inputs["metadata"]["namespace"] == "slurm"


def test_kueue_quotas_cohort_and_limits(
    run_mocked: Runner, dev_config: stack_model.StackConfig, k8s_schemas: SchemaSet
) -> None:
    records = _build(run_mocked, dev_config)
    cqs = {o["metadata"]["name"]: o["spec"] for o in by_kind(records, "ClusterQueue")}
    assert {s["cohortName"] for s in cqs.values()} == {"lab-gpu"}
    # h100 lends 25% of its 8 active nodes: 2 nodes x 8 GPUs = 16, 75% of that large = 12, small 4; a100 lends none
    large = {f["name"]: f["resources"][0] for f in cqs["lab-large"]["resourceGroups"][0]["flavors"]}
    assert large["lab-h100"] == {"name": "nvidia.com/gpu", "nominalQuota": 12, "borrowingLimit": 6, "lendingLimit": 6}
    small = {f["name"]: f["resources"][0] for f in cqs["lab-small"]["resourceGroups"][0]["flavors"]}
    assert small["lab-h100"]["nominalQuota"] == 4
    assert large["lab-a100"]["nominalQuota"] == small["lab-a100"]["nominalQuota"] == 0
    # Kueue's pods go to lent nodes only (an active node's GPUs are all slurmd's), through their taint.
    flavors = {o["metadata"]["name"]: o["spec"] for o in by_kind(records, "ResourceFlavor")}
    assert flavors["lab-h100"]["nodeLabels"] == {contracts.LABEL_GPU_TYPE: "h100", contracts.LABEL_POOL: "lent"}
    assert {t["key"] for t in flavors["lab-h100"]["tolerations"]} == {"nvidia.com/gpu", contracts.TAINT_LENT}
    # The remediator lends those nodes (the same two), and only the h100 pool's.
    cm = next(o for o in by_kind(records, "ConfigMap") if o["metadata"]["name"] == "fleetheal-remediator")
    lending = yaml.safe_load(cm["data"]["remediator.yaml"])["lending"]
    assert lending == {
        "enabled": True,
        "pools": {"h100": {"max_nodes": 2, "min_lent_s": 600, "reclaim_grace_s": 120}},
        "namespaces": ["inference", "ml"],  # only pods Kueue's LocalQueues admit get lent nodes
    }
    remediator_config = config_mod.from_mapping(yaml.safe_load(cm["data"]["remediator.yaml"]), env={})
    assert remediator_config.lending.pools["h100"].max_nodes == 2
    lqs = sorted((o["metadata"]["namespace"], o["spec"]["clusterQueue"]) for o in by_kind(records, "LocalQueue"))
    assert lqs == [("inference", "lab-large"), ("inference", "lab-small"), ("ml", "lab-large"), ("ml", "lab-small")]
    bad = dict(by_kind(records, "ClusterQueue")[0])
    bad["spec"] = {**bad["spec"], "cohort": "v1beta1-name"}
    assert any("cohort" in e for e in k8s_schemas.errors(bad))


def test_optional_parts_can_be_switched_off(
    run_mocked: Runner, dev_values: dict[str, Any], k8s_schemas: SchemaSet
) -> None:
    cfg = config.from_values(
        {
            **dev_values,
            "dcgmExporter": False,
            "kueue": False,
            "accountingDatabase": False,
            "accountingDbHost": "db.example.com",
        }
    )
    records = _build(run_mocked, cfg)
    assert_all_valid(k8s_schemas, records)
    assert [o["metadata"]["name"] for o in by_kind(records, "DaemonSet")] == ["fleetheal-agent"]
    assert not by_kind(records, "ClusterQueue") and not by_kind(records, "StatefulSet")
    (acct,) = by_kind(records, "Accounting")
    assert acct["spec"]["storageConfig"]["host"] == "db.example.com"


def test_eks_provider_declares_node_groups_for_pools_and_standby(run_mocked: Runner, k8s_schemas: SchemaSet) -> None:
    cfg = config.from_values(
        {
            "nodeProvider": "eks",
            "eksClusterName": "prod",
            "eksNodeRoleArn": "arn:aws:iam::1:role/nodes",
            "eksSubnetIds": ["subnet-a", "subnet-b"],
            "gpuPools": [
                {"name": "p5", "gpuType": "h100", "gpusPerNode": 8, "nodes": 32, "instanceType": "p5.48xlarge"}
            ],
        }
    )
    records = _build(run_mocked, cfg)
    assert_all_valid(k8s_schemas, records)
    groups = {r.inputs["nodeGroupName"]: r.inputs for r in records if r.type == "aws:eks/nodeGroup:NodeGroup"}
    assert set(groups) == {"p5-active", "p5-standby"}
    assert groups["p5-active"]["scalingConfig"]["desiredSize"] == 32
    assert groups["p5-standby"]["scalingConfig"]["desiredSize"] == 2  # 5% of 32, rounded up
    assert groups["p5-standby"]["taints"] == [{"key": contracts.TAINT_STANDBY, "value": "p5", "effect": "NO_SCHEDULE"}]
    assert groups["p5-standby"]["labels"][contracts.LABEL_POOL] == "standby"
    # the remediator config lists no nodes (it learns them from labels)
    cm = next(o for o in by_kind(records, "ConfigMap") if o["metadata"]["name"] == "fleetheal-remediator")
    assert yaml.safe_load(cm["data"]["remediator.yaml"])["cluster"]["nodes"] == {}


def test_helm_mode_registers_releases_with_chart_shaped_values(
    run_mocked: Runner, dev_values: dict[str, Any], k8s_schemas: SchemaSet
) -> None:
    cfg = config.from_values({**dev_values, "slinkyMode": "helm"})
    records = _build(run_mocked, cfg)
    assert_all_valid(k8s_schemas, records)
    assert not by_kind(records, "NodeSet") and not by_kind(records, "CustomResourceDefinition")
    releases = {r.inputs["name"]: r.inputs for r in records if r.type == mocks.HELM_RELEASE}
    assert set(releases) == {"slurm-operator-crds", "slurm-operator", "slurm"}
    assert releases["slurm"]["version"] == "1.2.1"
    values = releases["slurm"]["values"]
    chart_defaults = yaml.safe_load((SCHEMAS / "slinky/helm/slurm/values.yaml").read_text())
    # Every key fleetheal sets exists in the chart's values (map-typed sections are free-form).
    free_form = {
        "nodesets",
        "loginsets",
        "partitions",
        "prologScripts",
        "epilogScripts",
        "configFiles",
        "metadata",
        "labels",
        "annotations",
        "resources",
        "nodeSelector",
        "secretRef",
        "passwordKeyRef",
    }

    def walk(ours: dict[str, Any], theirs: dict[str, Any], path: str) -> None:
        for k, v in ours.items():
            assert k in theirs, f"{path}.{k} is not a slurm chart value"
            if k in free_form or not isinstance(v, dict) or not isinstance(theirs[k], dict):
                continue
            walk(v, theirs[k], f"{path}.{k}")

    walk(values, chart_defaults, "values")
    for nodeset in values["nodesets"].values():
        walk(nodeset, chart_defaults["nodesetDefaults"], "nodesetDefaults")
    assert values["controller"]["extraConf"].splitlines()[0] == "JobRequeue=1"
    operator_defaults = yaml.safe_load((SCHEMAS / "slinky/helm/slurm-operator/values.yaml").read_text())
    walk(releases["slurm-operator"]["values"], operator_defaults, "operator")


def test_vendored_crds_equal_the_released_ones() -> None:
    shipped = {d["metadata"]["name"]: d for d in crd_documents()}
    for name in CRD_FILES:
        upstream = yaml.safe_load((SCHEMAS / "slinky/crds" / name).read_text())
        assert shipped[upstream["metadata"]["name"]] == upstream, name
    assert len(shipped) == len(list(Path(SCHEMAS / "slinky/crds").glob("*.yaml")))


def test_prometheus_rule_groups_pass_promtool(
    run_mocked: Runner, dev_config: stack_model.StackConfig, tmp_path: Path
) -> None:
    import shutil
    import subprocess

    import pytest

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("SKIPPED LOUDLY: promtool (Debian package prometheus) is not installed")
    groups = [g for rule in by_kind(_build(run_mocked, dev_config), "PrometheusRule") for g in rule["spec"]["groups"]]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_namespaces_carry_the_stack_environment(run_mocked: Runner, dev_values: dict[str, Any]) -> None:
    records = _build(run_mocked, config.from_values({**dev_values, "environment": "production"}))
    labels = {o["metadata"]["name"]: o["metadata"]["labels"] for o in by_kind(records, "Namespace")}
    assert labels["fleetheal-system"][shared.LABEL_ENVIRONMENT] == "production"
    assert labels["slurm"][shared.LABEL_ENVIRONMENT] == "production"


def test_a_highly_available_remediator_on_the_in_cluster_postgres(
    run_mocked: Runner, dev_values: dict[str, Any], k8s_schemas: SchemaSet
) -> None:
    password = "in-cluster-db-password-0123456789"
    cfg = config.from_values(
        {
            **dev_values,
            "remediatorReplicas": 2,
            "remediatorStore": "postgres-in-cluster",
            "remediatorDbPassword": password,
        }
    )
    records = _build(run_mocked, cfg)
    assert_all_valid(k8s_schemas, records)
    kinds = Counter(o["kind"] for o in objects(records))
    # the state PVC goes; the database, its Service, the store Secret, the PDB and two Roles with bindings come
    assert sum(kinds.values()) == 69 - 1 + 8
    deploy = next(o for o in by_kind(records, "Deployment") if o["metadata"]["name"] == "fleetheal-remediator")
    assert deploy["spec"]["replicas"] == 2
    sts = next(o for o in by_kind(records, "StatefulSet") if o["metadata"]["name"] == "fleetheal-remediator-db")
    assert sts["metadata"]["namespace"] == "fleetheal-system"
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "docker.io/library/postgres:17.6"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    (store,) = [
        r
        for r in records
        if r.inputs.get("kind") == "Secret" and r.inputs["metadata"]["name"] == "fleetheal-remediator-store"
    ]
    assert store.secret_paths == ("stringData",)
    assert password in store.inputs["stringData"]["url"]
    assert not [p for p in by_kind(records, "PersistentVolumeClaim") if "remediator" in p["metadata"]["name"]]


def test_a_remediator_on_the_operators_postgres_creates_no_database(
    run_mocked: Runner, dev_values: dict[str, Any]
) -> None:
    cfg = config.from_values({**dev_values, "remediatorReplicas": 3, "remediatorStore": "postgres"})
    assert program.remediator_store(cfg) == {"kind": "postgres", "secret": "fleetheal-remediator-store"}
    records = _build(run_mocked, cfg)
    assert "fleetheal-remediator-store" not in [s["metadata"]["name"] for s in by_kind(records, "Secret")]
    assert [s["metadata"]["name"] for s in by_kind(records, "StatefulSet")] == ["mariadb"]
    deploy = next(o for o in by_kind(records, "Deployment") if o["metadata"]["name"] == "fleetheal-remediator")
    assert deploy["spec"]["replicas"] == 3
