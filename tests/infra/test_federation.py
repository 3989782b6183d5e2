"""A Slurm federation declared as code: the manager and worker stacks of the example federation
(Pulumi.fleet-manager.yaml, Pulumi.fleet-a.yaml, Pulumi.fleet-b.yaml) under Pulumi's mock engine, the
fleet file they render, the drift check over stacks and over renders, and bad federation configs.

One test (marked `slurm`) runs the manager's sacctmgr script twice against a real slurmdbd: the lab's
federation, started for it alone, so the session's federation is never changed.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s_client

from fleetheal import cli
from fleetheal.fleet import config as fleet_config
from fleetheal.infra import cli as infra_cli
from fleetheal.infra import (
    config,
    drift,
    engine,
    federation,
    fleet_file,
    mocks,
    program,
    project,
    render,
    stack_model,
)
from fleetheal.infra.drift import Finding
from fleetheal.infra.policy import shared, slurm_rules
from fleetheal.lab import controlplane
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.federation import Federation
from tests.infra.graph import assert_all_valid, by_kind
from tests.k8s_schemas import SchemaSet

REPO = Path(__file__).resolve().parents[2]
STACKS = ("fleet-manager", "fleet-a", "fleet-b")
MANAGER_ADDRESS = "slurmdbd.fleet.example.com:6819"


def _records(values: dict[str, Any]) -> list[mocks.Recorded]:
    cfg = config.from_values(values)
    return mocks.run(lambda: program.build(cfg))


@pytest.fixture(scope="module")
def stack_records() -> dict[str, list[mocks.Recorded]]:
    return {s: _records(project.stack_values(s)) for s in STACKS}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three example stacks rendered by `fleetheal render` into one directory (one sub-directory each)."""
    out = tmp_path_factory.mktemp("fleet") / "rendered"
    args = ["render", "--out", str(out)] + [a for s in STACKS for a in ("--stack", s)]
    assert cli.main(args) == 0
    return out


def _objects(records: list[mocks.Recorded]) -> list[dict[str, Any]]:
    return [r.inputs for r in records if r.custom and r.is_kubernetes_object]


def _one(records: list[mocks.Recorded], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in by_kind(records, kind) if name is None or o["metadata"]["name"] == name]
    assert len(hits) == 1, (kind, name, [o["metadata"]["name"] for o in hits])
    return hits[0]


def _manager_values(**federation_over: Any) -> dict[str, Any]:
    values = copy.deepcopy(project.stack_values("fleet-manager"))
    values["federation"].update(federation_over)
    return values


# -- the manager stack ----------------------------------------------------------------------------------


def test_manager_runs_slurmdbd_for_the_federation_and_applies_it_with_a_job(
    stack_records: dict[str, list[mocks.Recorded]], k8s_schemas: SchemaSet
) -> None:
    records = stack_records["fleet-manager"]
    assert_all_valid(k8s_schemas, records)
    acct = _one(records, "Accounting")
    assert acct["metadata"]["labels"][shared.LABEL_FEDERATION_ROLE] == "manager"
    # slurmdbd on its own database, reachable from the workers' Kubernetes clusters
    assert acct["spec"]["storageConfig"]["host"] == "mariadb" and "external" not in acct["spec"]
    assert acct["spec"]["service"] == {"spec": {"type": "LoadBalancer"}, "port": 6819}
    assert _one(records, "StatefulSet", "mariadb")["spec"]["volumeClaimTemplates"]
    controller = _one(records, "Controller")
    assert controller["spec"]["accountingRef"] == {"name": "core-accounting"}
    assert controller["spec"]["extraConf"].endswith("FederationParameters=fed_display\n")

    script_cm = _one(records, "ConfigMap", federation.SCRIPT_CONFIGMAP)
    script = script_cm["data"][shared.FEDERATION_SCRIPT_KEY]
    assert slurm_rules.federation_statements(script) == [
        ("cluster", "core", "data-imagenet,h100"),
        ("cluster", "a", "data-imagenet,h100,ib-ndr"),
        ("cluster", "b", "a100,data-c4"),
        ("qos", "large", "100"),
        ("qos", "small", "10"),
        *[("grant", "research", c, "large,small", "small", "alice", "bob") for c in ("core", "a", "b")],
        *[("grant", "platform", c, "large,small", "small", "root") for c in ("core", "a", "b")],
        ("federation", "fleet", "core", "a", "b"),
    ]
    assert script_cm["data"]["address"] == MANAGER_ADDRESS
    conf = script_cm["data"]["slurm.conf"]
    assert "AccountingStorageHost=core-accounting-accounting.slurm.svc.cluster.local\n" in conf
    assert "AccountingStoragePort=6819\n" in conf and "AuthType=auth/slurm\n" in conf

    job = _one(records, "Job")
    assert job["metadata"]["name"].startswith(federation.JOB_PREFIX)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bash", f"{federation.SCRIPT_MOUNT}/apply.sh"]
    assert container["image"] == "ghcr.io/slinkyproject/login:26.05-ubuntu26.04"
    assert {"name": "SLURM_CONF", "value": "/etc/slurm/slurm.conf"} in container["env"]
    sources = pod["volumes"][1]["projected"]["sources"]
    assert sources[1]["secret"]["name"] == "slurm-auth-slurm"  # the key every member shares


def test_the_job_is_named_after_what_it_applies() -> None:
    first = config.from_values(project.stack_values("fleet-manager"))
    changed = config.from_values(_manager_values(qos=[{"name": "large", "priority": 5}, {"name": "small"}]))
    names = []
    for cfg in (first, first, changed):
        records = mocks.run(lambda cfg=cfg: program.build(cfg))
        names.append(_one(records, "Job")["metadata"]["name"])
    # the same declaration: the same Job (nothing re-runs); a changed one: a new Job that applies it
    assert names[0] == names[1] != names[2]


def test_manager_renders_the_fleet_file_that_fleet_config_reads(
    stack_records: dict[str, list[mocks.Recorded]], tmp_path: Path
) -> None:
    cm = _one(stack_records["fleet-manager"], "ConfigMap", fleet_file.FLEET_CONFIGMAP)
    assert cm["metadata"]["namespace"] == "fleetheal-system"
    path = tmp_path / "fleet.yaml"
    path.write_text(cm["data"][fleet_file.FLEET_FILE_KEY])
    fleet = fleet_config.load(path, env={})
    assert fleet.federation == "fleet"
    assert {n: (c.gpu_type, c.gpus_per_node, c.checkpoint_stores) for n, c in fleet.clusters.items()} == {
        "core": ("h100", 8, ("shared",)),
        "a": ("h100", 8, ("shared",)),
        "b": ("a100", 8, ("shared",)),
    }
    assert fleet.datasets["imagenet"].clusters == ("core", "a") and fleet.datasets["c4"].size_gb == 800
    assert fleet.checkpoint_stores["shared"].path == "/shared/checkpoints"
    assert fleet.readers("shared") == ("core", "a", "b")


def test_placement_and_queue_settings_pass_through_to_the_fleet_file() -> None:
    cfg = config.from_values(
        _manager_values(
            placement={"small_job_max_gpus": 4, "data_feature_prefix": "ds-"},
            queues={"large_qos": "large", "small_qos": "small", "small_guaranteed_gpus": 16},
        )
    )
    fleet = yaml.safe_load(fleet_file.fleet_file_text(cfg.federation.fleet_file))
    assert fleet["placement"] == {"small_job_max_gpus": 4, "data_feature_prefix": "ds-"}
    assert fleet["queues"]["small_guaranteed_gpus"] == 16
    # the data features the Job sets follow the placement section's prefix
    assert "cluster b a100,ds-c4" in federation.statements(cfg.federation)


# -- the workers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("stack", "cluster"), [("fleet-a", "a"), ("fleet-b", "b")])
def test_worker_controller_points_at_the_managers_slurmdbd(
    stack_records: dict[str, list[mocks.Recorded]], k8s_schemas: SchemaSet, stack: str, cluster: str
) -> None:
    records = stack_records[stack]
    assert_all_valid(k8s_schemas, records)
    controller = _one(records, "Controller")
    assert controller["spec"]["clusterName"] == cluster
    assert controller["metadata"]["labels"][shared.LABEL_FEDERATION_ROLE] == "worker"
    assert "FederationParameters=fed_display" in controller["spec"]["extraConf"].splitlines()
    acct = _one(records, "Accounting", controller["spec"]["accountingRef"]["name"])
    assert acct["spec"] == {"external": True, "externalConfig": {"host": "slurmdbd.fleet.example.com", "port": 6819}}
    # no slurmdbd, database or federation Job of its own
    assert not by_kind(records, "StatefulSet") and not by_kind(records, "Job")
    names = {o["metadata"]["name"] for o in by_kind(records, "ConfigMap")}
    assert federation.SCRIPT_CONFIGMAP not in names
    # the manager's fleet file, read from the manager's stack file (managerStack), not a copy
    fleet_cm = _one(records, "ConfigMap", fleet_file.FLEET_CONFIGMAP)
    manager_cm = _one(stack_records["fleet-manager"], "ConfigMap", fleet_file.FLEET_CONFIGMAP)
    assert fleet_cm["data"] == manager_cm["data"]
    # and its remediator fails over by it, as this cluster of the federation
    rem_cfg = yaml.safe_load(_one(records, "ConfigMap", "fleetheal-remediator")["data"]["remediator.yaml"])
    assert rem_cfg["failover"] == {
        "enabled": True,
        "fleet_file": "/etc/fleetheal/fleet/fleet.yaml",
        "slurm_cluster": cluster,
    }
    pod = _one(records, "Deployment", "fleetheal-remediator")["spec"]["template"]["spec"]
    assert {"name": "fleet", "configMap": {"name": fleet_file.FLEET_CONFIGMAP}} in pod["volumes"]
    assert {"name": "fleet", "mountPath": "/etc/fleetheal/fleet", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]


def test_the_failover_config_the_stacks_render_is_one_the_remediator_accepts(
    stack_records: dict[str, list[mocks.Recorded]], tmp_path: Path
) -> None:
    from fleetheal.remediator import config as rcfg

    for stack in STACKS:
        records = stack_records[stack]
        fleet = tmp_path / f"{stack}-fleet.yaml"
        fleet.write_text(_one(records, "ConfigMap", fleet_file.FLEET_CONFIGMAP)["data"][fleet_file.FLEET_FILE_KEY])
        doc = yaml.safe_load(_one(records, "ConfigMap", "fleetheal-remediator")["data"]["remediator.yaml"])
        doc["failover"]["fleet_file"] = str(fleet)  # the mount, here
        cfg = rcfg.from_mapping(doc, env={"FLEETHEAL_REMEDIATOR_TOKEN": "t" * 20})
        assert cfg.failover.enabled and cfg.failover.cluster_name(cfg.cluster) == cfg.cluster.name


def test_every_cluster_renders_what_a_job_needs(stack_records: dict[str, list[mocks.Recorded]]) -> None:
    needs = {}
    for stack in STACKS:
        member, _ = drift.read_stack(stack, _objects(stack_records[stack]))
        assert member is not None
        needs[member.cluster] = member.needs
    for cluster, mine in needs.items():
        assert set(mine["namespace"]) == {"slurm", "fleetheal-system", "slinky", "ml"}, cluster
        assert {"slurm/slurm-auth-slurm", "slurm/slurm-auth-jwt", "fleetheal-system/fleetheal-remediator-token"} <= set(
            mine["secret"]
        ), cluster
        assert set(mine["agent"]) == {"fleetheal-agent/agent"}, cluster
        assert len(mine["alert rule"]) > 100 and set(mine["partition"]) == {"large", "small"}, cluster
        assert mine["slurm.conf"]["FederationParameters"] == "fed_display", cluster
    assert needs["core"] == needs["a"] == needs["b"]


# -- the drift check ------------------------------------------------------------------------------------


def _drift(paths: list[Path], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="fleetheal fleet")
    infra_cli.register_drift(parser.add_subparsers())
    args = parser.parse_args(["drift", "--json", *map(str, paths)])
    code = args.func(args)
    return code, json.loads(capsys.readouterr().out)


def _copy_render(rendered: Path, tmp_path: Path) -> Path:
    out = tmp_path / "rendered"
    shutil.copytree(rendered, out)
    return out


def test_drift_finds_nothing_in_the_example_federation(rendered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in rendered.iterdir()) == sorted([render.MARKER, *STACKS])
    code, report = _drift([rendered], capsys)
    assert (code, report["drift"], report["findings"]) == (0, False, [])
    assert report["federation"] == "fleet"
    assert [(c["cluster"], Path(c["stack"]).name) for c in report["clusters"]] == [
        ("core", "fleet-manager"),
        ("a", "fleet-a"),
        ("b", "fleet-b"),
    ]


def test_drift_finds_a_qos_removed_on_one_cluster(
    rendered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy_render(rendered, tmp_path)
    path = out / "fleet-manager" / "slurm" / f"ConfigMap-{federation.SCRIPT_CONFIGMAP}.yaml"
    text = path.read_text()
    edited = text.replace("grant research b large,small small", "grant research b small small")
    assert edited != text
    path.write_text(edited)
    code, report = _drift([out], capsys)
    assert code == 1
    assert report["findings"] == [
        {
            "cluster": "b",
            "category": "qos",
            "item": "large",
            "problem": "missing for account research (granted on core, a)",
        }
    ]


def test_drift_finds_an_alert_rule_that_differs(
    rendered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy_render(rendered, tmp_path)
    path = out / "fleet-b" / "fleetheal-system" / "PrometheusRule-fleetheal-faults.yaml"
    doc = yaml.safe_load(path.read_text().split("---\n", 1)[1])
    rule = doc["spec"]["groups"][0]["rules"][0]
    rule["expr"] = rule["expr"].replace("== 1", "> 5")
    path.write_text("---\n" + yaml.safe_dump(doc))
    code, report = _drift([out], capsys)
    assert code == 1
    (finding,) = report["findings"]
    assert (finding["cluster"], finding["category"], finding["item"]) == ("b", "alert rule", rule["alert"])
    assert finding["problem"].startswith("differs from core, a: ")


def test_drift_finds_a_worker_whose_fleet_file_differs(
    rendered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy_render(rendered, tmp_path)
    path = out / "fleet-a" / "fleetheal-system" / f"ConfigMap-{fleet_file.FLEET_CONFIGMAP}.yaml"
    header, body = path.read_text().split("---\n", 1)
    doc = yaml.safe_load(body)
    fleet = yaml.safe_load(doc["data"][fleet_file.FLEET_FILE_KEY])
    fleet["datasets"]["c4"]["clusters"] = ["a", "b"]  # an older or hand-edited copy on a
    doc["data"][fleet_file.FLEET_FILE_KEY] = yaml.safe_dump(fleet)
    path.write_text(header + "---\n" + yaml.safe_dump(doc))
    code, report = _drift([out], capsys)
    assert code == 1
    (finding,) = report["findings"]
    assert (finding["cluster"], finding["category"], finding["item"]) == (
        "a",
        "fleet file",
        fleet_file.FLEET_FILE_KEY,
    )
    assert finding["problem"].startswith("differs from core, b: ")


def _project(tmp_path: Path, edits: dict[str, Callable[[dict[str, Any]], None]]) -> Path:
    """A copy of the project's Pulumi.yaml and the example federation's stack files, each edited."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", root)
    for stack in STACKS:
        doc = yaml.safe_load((REPO / f"Pulumi.{stack}.yaml").read_text())
        if stack in edits:
            edits[stack](doc["config"])
        (root / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(doc))
    return root


def test_drift_over_stack_files_finds_config_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def worker_b(c: dict[str, Any]) -> None:
        c["fleetheal:kueueNamespaces"] = ["ml", "inference"]  # a namespace only b has
        c["fleetheal:agentImage"] = "ghcr.io/fleetheal/agent:0.0.9"  # an older agent
        c["fleetheal:federation"]["manager"] = "10.0.0.7:6819"  # another slurmdbd

    root = _project(tmp_path, {"fleet-b": worker_b})
    code, report = _drift([root / f"Pulumi.{s}.yaml" for s in STACKS], capsys)
    assert code == 1
    found = {(f["cluster"], f["category"], f["item"]): f["problem"] for f in report["findings"]}
    assert found[("b", "agent", "fleetheal-agent/agent")] == (
        "differs from core, a: image=ghcr.io/fleetheal/agent:0.0.9 ports=[9479] vs "
        "image=ghcr.io/fleetheal/agent:0.1.0 ports=[9479]"
    )
    assert found[("core", "namespace", "inference")] == "missing (present on b)"
    assert found[("a", "namespace", "inference")] == "missing (present on b)"
    assert found[("b", "accounting", "slurmdbd")] == "writes to 10.0.0.7:6819; the manager declares " + MANAGER_ADDRESS
    assert len(found) == 4, found


def test_drift_finds_clusters_outside_the_declaration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def manager(c: dict[str, Any]) -> None:
        fed = c["fleetheal:federation"]
        fed["clusters"] = [x for x in fed["clusters"] if x["name"] != "b"] + [
            {"name": "c", "gpuType": "h100", "gpusPerNode": 8}
        ]
        fed["datasets"]["c4"]["clusters"] = ["c"]

    root = _project(tmp_path, {"fleet-manager": manager})
    code, report = _drift([root], capsys)  # the project directory: its federation stacks
    assert code == 1
    found = [(f["cluster"], f["category"], f["problem"]) for f in report["findings"]]
    assert ("c", "stack", "declared in the federation, but no stack renders it") in found
    assert ("b", "federation", "not a member (the manager declares core, a, c): no accounts, QOS or siblings") in found


def test_drift_reports_a_gpu_type_the_pools_do_not_have(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def manager(c: dict[str, Any]) -> None:
        c["fleetheal:federation"]["clusters"][2]["gpuType"] = "h200"

    root = _project(tmp_path, {"fleet-manager": manager})
    code, report = _drift([root], capsys)
    assert code == 1
    assert report["findings"] == [
        {
            "cluster": "b",
            "category": "fleet",
            "item": "gpu_type",
            "problem": "declared h200 in the fleet, its pools have a100",
        }
    ]


def test_drift_needs_exactly_one_manager(rendered: Path) -> None:
    with pytest.raises(cli.UsageError, match="exactly one manager stack"):
        drift.compare(render.load_inputs([rendered / "fleet-a", rendered / "fleet-b"]))
    with pytest.raises(cli.UsageError, match="neither a Pulumi project"):
        render.load_inputs([rendered / "fleet-a" / "slurm"])


def test_drift_report_text_names_each_cluster() -> None:
    report = drift.Report(
        "fleet", "m", {"core": "m", "b": "w"}, [Finding("b", "qos", "large", "missing (granted on core)")]
    )
    assert report.text().splitlines() == [
        "federation fleet: 2 cluster(s); manager stack m",
        "cluster core (stack m): in step",
        "cluster b (stack w): 1 difference(s)",
        "  qos large: missing (granted on core)",
        "1 difference(s) on 1 cluster(s)",
    ]


# -- bad configs ----------------------------------------------------------------------------------------


def _worker(**fed: Any) -> dict[str, Any]:
    values = copy.deepcopy(project.stack_values("fleet-a"))
    values["federation"] = fed
    return values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            _worker(role="hub"),
            "fleetheal:federation.role: 'hub' is not accepted; use one of: none, manager, worker",
        ),
        (
            _worker(role="worker"),
            "fleetheal:federation.manager: required for a worker: the manager's slurmdbd as HOST or HOST:PORT",
        ),
        (
            _worker(role="worker", manager="dbd:99999"),
            "fleetheal:federation.manager: 'dbd:99999' is not accepted; use HOST or HOST:PORT (a DNS name or IPv4 "
            "address, port 1-65535)",
        ),
        (
            _worker(role="worker", manager="dbd", clusters=[]),
            "fleetheal:federation: field(s) clusters not accepted for role worker (accepted: role, manager, "
            "managerStack); "
            "clusters belongs to role manager. The federation (clusters, QOS, accounts, data) is declared once, in "
            "the manager's stack",
        ),
        (
            _worker(manager="dbd"),
            "fleetheal:federation.role: required; use one of: none, manager, worker",
        ),
        (
            {**_worker(role="worker", manager="dbd"), "slinkyMode": "helm"},
            "fleetheal:slinkyMode: 'helm' is not accepted with federation.role worker; a federation member needs "
            "slinkyMode manifests (the Accounting custom resource carries the shared slurmdbd)",
        ),
        (
            {**_worker(role="worker", manager="dbd"), "clusterName": "1a"},
            "fleetheal:clusterName: '1a' is not accepted in a federation; a Slurm cluster name starts with a "
            "lower-case letter (then letters, digits, '-'; at most 40)",
        ),
        (
            _manager_values(
                clusters=[
                    {"name": "core", "gpuType": "h100", "gpusPerNode": 8},
                    {"name": "a", "gpuType": "h100", "gpusPerNode": 8},
                    {"name": "a", "gpuType": "a100", "gpusPerNode": 8},
                ]
            ),
            "fleetheal:federation.clusters[2].name: Slurm cluster name 'a' is declared twice; names must be unique",
        ),
        (
            _manager_values(clusters=[{"name": "core", "gpuType": "h100", "gpusPerNode": 8}, {"name": "B_2"}]),
            "fleetheal:federation.clusters[1].name: 'B_2' is not a valid Slurm cluster name; use lower-case letters, "
            "digits and '-', starting with a letter (pattern ^[a-z][a-z0-9-]{0,39}$)",
        ),
        (
            _manager_values(clusters=[{"name": "a", "gpuType": "h100", "gpusPerNode": 8}]),
            "fleetheal:federation.clusters: the manager's own cluster 'core' (clusterName) is not listed; the "
            "manager runs slurmdbd beside its own Slurm cluster, which is a member of the federation like the others",
        ),
        (
            _manager_values(clusters=[]),
            "fleetheal:federation.clusters: a manager declares the federation's clusters (at least its own, 'core'); "
            "each needs name, gpuType, gpusPerNode",
        ),
        (
            _manager_values(accounts=[{"name": "research", "qos": ["gold"]}]),
            "fleetheal:federation.accounts[0].qos: 'gold' is not declared in fleetheal:federation.qos (declared: "
            "large, normal, small)",
        ),
        (
            _manager_values(qos=[{"name": "large"}], accounts=[]),
            "fleetheal:federation.qos: the fleet's queues.small_qos 'small' is not declared; the queue controller "
            "changes its limits at run time, so every cluster needs it (declared: large, normal)",
        ),
        (
            _manager_values(datasets={"c4": {"sizeGb": 800, "clusters": ["z"]}}),
            "fleetheal:federation: the fleet file it makes is not valid: datasets.c4.clusters: 'z' is not one of "
            "the clusters",
        ),
        (
            _manager_values(datasets={"c4": {"size": 800}}),
            "fleetheal:federation.datasets.c4: unknown field(s) size; accepted fields: sizeGb, clusters",
        ),
        (
            _worker(role="worker", manager="dbd", managerStack="nope"),
            "fleetheal:federation.managerStack: stack 'nope' cannot be read: stack 'nope': "
            f"{REPO}/Pulumi.nope.yaml does not exist; stacks here: {', '.join(project.list_stacks(REPO))}",
        ),
        (
            _worker(role="worker", manager="dbd", managerStack="fleet-a"),
            "fleetheal:federation.managerStack: stack 'fleet-a' is not a federation manager (role worker)",
        ),
        (
            _manager_values(manager="dbd"),
            "fleetheal:federation: field(s) manager not accepted for role manager (accepted: role, name, address, "
            "serviceType, clusters, qos, accounts, datasets, checkpointStores, placement, queues); manager belongs "
            "to role worker. The federation (clusters, QOS, accounts, data) is declared once, in the manager's stack",
        ),
    ],
)
def test_bad_federation_config_names_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(config.ConfigError) as exc:
        config.from_values(values)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    "values",
    [
        _worker(role="worker", manager="dbd"),  # no managerStack
        {**_worker(role="worker", manager="dbd", managerStack="fleet-manager"), "clusterName": "z"},  # not declared
    ],
)
def test_a_worker_outside_the_declared_federation_has_no_fleet_file_and_no_failover(values: dict[str, Any]) -> None:
    records = _records(values)
    names = {o["metadata"]["name"] for o in by_kind(records, "ConfigMap")}
    assert fleet_file.FLEET_CONFIGMAP not in names
    rem_cfg = yaml.safe_load(_one(records, "ConfigMap", "fleetheal-remediator")["data"]["remediator.yaml"])
    assert "failover" not in rem_cfg


def test_a_stand_alone_stack_is_unchanged(dev_config: stack_model.StackConfig) -> None:
    assert dev_config.federation == stack_model.FederationSpec()
    records = mocks.run(lambda: program.build(dev_config))
    controller = _one(records, "Controller")
    assert shared.LABEL_FEDERATION_ROLE not in controller["metadata"]["labels"]
    assert "Federation" not in controller["spec"]["extraConf"]
    assert not by_kind(records, "Job")


# -- against a real slurmdbd ----------------------------------------------------------------------------


@pytest.mark.slurm
def test_the_federation_script_is_idempotent_on_a_real_slurmdbd(tmp_path: Path) -> None:
    """The generated sacctmgr script against Debian's slurmdbd (the lab's federation `fed` of a and b, its
    own instance): the first run applies the declaration, a second changes nothing, and a cluster dropped
    from the declaration leaves the federation."""

    def values(clusters: list[str]) -> dict[str, Any]:
        return {
            "clusterName": "a",
            "gpuPools": [
                {"name": "h100", "gpuType": "h100", "gpusPerNode": 8, "nodeNames": ["n1"], "standbyNodeNames": ["n2"]}
            ],
            "federation": {
                "role": "manager",
                "name": "fed",
                "clusters": [{"name": c, "gpuType": "h100", "gpusPerNode": 8} for c in clusters],
                "qos": [{"name": "large", "priority": 100}, {"name": "small", "priority": 10}],
                "accounts": [{"name": "research", "users": ["root"], "qos": ["large", "small"], "defaultQos": "small"}],
                "datasets": {"imagenet": {"sizeGb": 150, "clusters": ["a"]}},
            },
        }

    fed = Federation(tmp_path / "fed", clusters=("a", "b"), nodes_per_cluster=1)
    script = tmp_path / "apply.sh"

    def apply(clusters: list[str]) -> str:
        script.write_text(federation.script(config.from_values(values(clusters)).federation))
        proc = subprocess.run(["bash", str(script)], env=fed.env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip().splitlines()[-1]

    def show(*what: str) -> set[str]:
        return set(fed.run("sacctmgr", "-n", "-P", "show", *what).stdout.replace("|\n", "\n").split())

    fed.start()
    try:
        first = apply(["a", "b", "c-1"])
        assert first.startswith("fleetheal-federation: federation fed applied (") and "(0 change" not in first
        assert apply(["a", "b", "c-1"]) == "fleetheal-federation: federation fed applied (0 change(s))"
        assert show("federation", "format=cluster") == {"a", "b", "c-1"}
        assert show("cluster", "format=cluster,features") >= {"a|data-imagenet,h100", "b|h100", "c-1|h100"}
        assert show("qos", "format=name,priority") >= {"large|100", "small|10"}
        assocs = show("assoc", "where", "account=research", "format=cluster,user,qos,defaultqos")
        assert assocs == {f"{c}|{u}|large,small|small" for c in ("a", "b", "c-1") for u in ("", "root")}
        assert apply(["a", "b"]) == "fleetheal-federation: federation fed applied (1 change(s))"
        assert show("federation", "format=cluster") == {"a", "b"}
    finally:
        fed.stop()


# -- under the real Pulumi engine and a real kube-apiserver ---------------------------------------------


@pytest.mark.kube
@pytest.mark.pulumi
def test_manager_stack_previews_with_the_pack_and_deploys(tmp_path: Path, shared: Path) -> None:
    """`preview --policy-pack policies` (the new rules in the real analyzer) and `up` of the manager stack
    into a kube-apiserver (no workload controllers: awaitReadiness=false), which accepts the federation's Job and
    ConfigMaps as rendered, and a worker's external Accounting and its Controller."""
    bin_dir = controlplane.tools_dir()
    missing = [b for b in controlplane.BINARIES if not os.access(bin_dir / b, os.X_OK)]
    missing += engine.missing_tools(bin_dir)
    if missing:
        pytest.fail(f"{', '.join(missing)} not found in {bin_dir}: run `make tools` (scripts/build-tools.sh) first")
    with KubeControlPlane(tmp_path / "kube") as cp:
        cp.install_crds(p for p in controlplane.default_crds(shared) if "slinky" not in p.parts)

        def target(stack: str) -> engine.Target:
            return engine.Target(
                stack=stack,
                kubeconfig=cp.kubeconfig,
                backend=tmp_path / f"backend-{stack}",
                bin_dir=bin_dir,
                passphrase="fleetheal-test-passphrase",
                settings={"awaitReadiness": "false"},
                secrets={
                    "slurmKey": base64.b64encode(secrets.token_bytes(1024)).decode(),
                    "slurmJwtKey": base64.b64encode(secrets.token_bytes(32)).decode(),
                    "remediatorToken": secrets.token_hex(16),
                },
            )

        pack = [REPO / "policies"]
        engine.preview(target("fleet-manager"), pack)
        engine.up(target("fleet-manager"), pack)
        api = cp.client()
        batch = k8s_client.BatchV1Api(api)
        core = k8s_client.CoreV1Api(api)
        (job,) = batch.list_namespaced_job("slurm").items
        assert job.metadata.name.startswith(federation.JOB_PREFIX)
        script = core.read_namespaced_config_map(federation.SCRIPT_CONFIGMAP, "slurm").data["apply.sh"]
        assert ("federation", "fleet", "core", "a", "b") in slurm_rules.federation_statements(script)
        fleet_text = core.read_namespaced_config_map(fleet_file.FLEET_CONFIGMAP, "fleetheal-system").data["fleet.yaml"]
        assert yaml.safe_load(fleet_text)["clusters"]["b"]["gpu_type"] == "a100"
        # A worker's Accounting (external) and Controller, as its stack renders them, pass the API server's
        # own validation of the Slinky CRDs (their CEL rules too), server-side and not persisted.
        custom = k8s_client.CustomObjectsApi(api)
        worker = render.render_objects("fleet-a", REPO)
        for kind, plural in (("Accounting", "accountings"), ("Controller", "controllers")):
            (obj,) = [o for o in worker if o["kind"] == kind]
            created = custom.create_namespaced_custom_object(
                "slinky.slurm.net", "v1beta1", "slurm", plural, obj, dry_run="All"
            )
            assert created["spec"]["external" if kind == "Accounting" else "accountingRef"]
        # (the same check refuses an external Accounting that names no slurmdbd)
        (acct,) = [o for o in worker if o["kind"] == "Accounting"]
        bad = {**acct, "spec": {"external": True}}
        with pytest.raises(k8s_client.ApiException) as refused:
            custom.create_namespaced_custom_object(
                "slinky.slurm.net", "v1beta1", "slurm", "accountings", bad, dry_run="All"
            )
        assert refused.value.status == 422 and "externalConfig must be set when external is true" in str(
            refused.value.body
        )
