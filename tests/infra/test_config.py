"""Stack config: Pulumi.yaml declares every key once; bad values fail before any resource, naming the key."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from fleetheal.infra import config, config_docs, mocks, project, stack_model

REPO = Path(__file__).resolve().parents[2]


def _pool(name: str = "h100", nodes: int = 4, standby: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "gpuType": name,
        "gpusPerNode": 8,
        "nodeNames": [f"{name}-{i}" for i in range(nodes)],
        "standbyNodeNames": [f"{name}-sb-{i}" for i in range(standby)],
    }


def _values(**over: Any) -> dict[str, Any]:
    return {"gpuPools": [_pool()], **over}


def test_every_key_is_declared_once_with_type_default_and_description() -> None:
    doc = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert doc["runtime"]["options"]["virtualenv"] == ".venv"
    assert doc["main"] == "pulumi/"
    assert not (REPO / "pulumi" / "__init__.py").exists()
    provider = {k: v for k, v in doc["config"].items() if ":" in k}
    # The one provider setting: ConfigMaps (the pools' membership) are updated in place, never replaced.
    assert provider == {"kubernetes:enableConfigMapMutable": {"value": True}}
    for key, spec in doc["config"].items():
        if key in provider:
            continue
        assert spec.get("type") in ("string", "integer", "boolean", "array", "object"), key
        assert spec.get("description"), key
        if spec["type"] == "array":
            assert "items" in spec, key
        # Secrets have no default by design; every other key has one.
        assert spec.get("secret") or "default" in spec, key
    decl = project.declarations()
    assert set(decl) == set(doc["config"]) - set(provider)


def test_defaults_match_their_declared_types() -> None:
    for decl in project.declarations().values():
        if decl.has_default:
            assert config._coerce(decl, decl.default) == decl.default


def test_dev_stack_only_overrides_declared_keys(dev_values: dict[str, Any]) -> None:
    assert set(dev_values) <= set(project.declarations())
    cfg = config.from_values(dev_values)
    assert cfg.cluster_name == "lab"
    assert [p.name for p in cfg.gpu_pools] == ["h100", "a100"]
    assert cfg.gpu_pools[0].nodes == 8 and cfg.gpu_pools[0].standby_nodes == 1
    # defaults from Pulumi.yaml fill the rest
    assert cfg.slinky_mode == "manifests" and cfg.requeue_grace_seconds == 120
    # ... and keep an existing stack's remediator as it was: one replica on SQLite, not production
    assert (cfg.remediator_replicas, cfg.remediator_store, cfg.environment) == (1, "sqlite", "development")


def test_string_values_from_pulumi_config_are_coerced() -> None:
    cfg = config.from_values(
        {"gpuPools": json.dumps([_pool()]), "agentPort": "9500", "kueue": "false", "kueueNamespaces": '["a", "b"]'}
    )
    assert cfg.agent_port == 9500 and cfg.kueue is False and cfg.kueue_namespaces == ("a", "b")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            _values(slinkyMode="kustomize"),
            "fleetheal:slinkyMode: 'kustomize' is not accepted; use one of: manifests, helm",
        ),
        (_values(nodeProvider="gke"), "fleetheal:nodeProvider: 'gke' is not accepted; use one of: existing, eks"),
        (_values(agentPort="many"), "fleetheal:agentPort: expected an integer, got 'many'"),
        (
            _values(standbySharePercent=120),
            "fleetheal:standbySharePercent: 120 is not accepted; use an integer from 0 to 100",
        ),
        (
            _values(agentImage="ghcr.io/fleetheal/agent:latest"),
            "fleetheal:agentImage: 'ghcr.io/fleetheal/agent:latest' is not pinned; use REPOSITORY:TAG with a tag other "
            "than 'latest', or REPOSITORY@sha256:DIGEST",
        ),
        (
            _values(clusterName="Lab_1"),
            "fleetheal:clusterName: 'Lab_1' is not accepted; use lower-case letters, digits and '-', starting and "
            "ending with a letter or digit, at most 40 characters",
        ),
        (
            {"gpuPools": []},
            "fleetheal:gpuPools: at least one GPU pool is required; each pool needs name, gpuType, gpusPerNode, "
            "nodeNames, standbyNodeNames",
        ),
        (
            {"gpuPools": [{**_pool(), "gpus": 8}]},
            "fleetheal:gpuPools[0]: unknown field(s) gpus for nodeProvider=existing; accepted fields: name, gpuType, "
            "gpusPerNode, nodeNames, standbyNodeNames",
        ),
        (
            {"gpuPools": [_pool(nodes=40, standby=1)], "standbySharePercent": 5},
            "fleetheal:gpuPools[0].standbyNodeNames: pool 'h100' needs at least 2 warm-standby node(s) "
            "(standbyMinNodes=1, standbySharePercent=5 of 40 nodes, never below 1); got 1",
        ),
        (
            {"gpuPools": [_pool(), {**_pool(), "nodeNames": ["x"], "standbyNodeNames": ["y"]}]},
            "fleetheal:gpuPools[1].name: pool 'h100' is declared twice; pool names must be unique",
        ),
        (
            {"gpuPools": [_pool("a"), {**_pool("b"), "nodeNames": ["a-0"]}]},
            "fleetheal:gpuPools[1].nodeNames: node 'a-0' appears twice; a node belongs to one pool, active or standby",
        ),
        (_values(nodeProvider="eks"), "fleetheal:eksClusterName: required when nodeProvider=eks"),
        (
            _values(sharedStorageSize="lots"),
            "fleetheal:sharedStorageSize: 'lots' is not accepted; use a Kubernetes quantity such as 10Ti",
        ),
        (_values(gpuPool=[]), "fleetheal:gpuPool: not a fleetheal setting; declared keys are: "),
        (
            _values(environment="prod"),
            "fleetheal:environment: 'prod' is not accepted; use one of: development, staging, production",
        ),
        (_values(remediatorReplicas=0), "fleetheal:remediatorReplicas: 0 is not accepted; use an integer >= 1"),
        (
            _values(remediatorReplicas=2),
            "fleetheal:remediatorReplicas: 2 is not accepted with remediatorStore=sqlite (SQLite serves one replica); "
            "set remediatorStore to postgres or postgres-in-cluster, or remediatorReplicas to 1",
        ),
        (
            _values(remediatorStore="mysql"),
            "fleetheal:remediatorStore: 'mysql' is not accepted; use one of: sqlite, postgres, postgres-in-cluster",
        ),
        (
            _values(remediatorStoreSecret="Store"),
            "fleetheal:remediatorStoreSecret: 'Store' is not accepted; use lower-case letters, digits and '-'",
        ),
        (
            _values(remediatorDbImage="postgres"),
            "fleetheal:remediatorDbImage: 'postgres' is not pinned; use REPOSITORY:TAG",
        ),
    ],
)
def test_bad_config_names_the_key_and_accepted_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(config.ConfigError) as exc:
        config.from_values(values)
    assert str(exc.value).startswith(message)


def test_standby_size_is_the_larger_of_floor_and_share_and_at_least_one() -> None:
    assert stack_model.standby_size(100, 1, 5) == 5
    assert stack_model.standby_size(10, 3, 5) == 3
    assert stack_model.standby_size(10, 1, 0) == 1
    assert stack_model.standby_size(41, 1, 5) == 3


def test_eks_pools_get_their_standby_size_from_config() -> None:
    cfg = config.from_values(
        {
            "nodeProvider": "eks",
            "eksClusterName": "c",
            "eksNodeRoleArn": "arn:aws:iam::1:role/n",
            "eksSubnetIds": ["subnet-1"],
            "standbySharePercent": 10,
            "gpuPools": [
                {"name": "p5", "gpuType": "h100", "gpusPerNode": 8, "nodes": 64, "instanceType": "p5.48xlarge"}
            ],
        }
    )
    assert cfg.gpu_pools[0].standby_nodes == 7


def test_a_pool_lends_whole_nodes_up_to_its_lend_max_percent_and_none_by_default() -> None:
    cfg = config.from_values({"gpuPools": [{**_pool(nodes=10), "lendMaxPercent": 25}, _pool("a100")]})
    lending, other = cfg.gpu_pools
    assert (lending.lend_max_percent, lending.lendable_nodes) == (25, 2)  # 2.5 nodes: a node is lent whole
    assert (other.lend_max_percent, other.lendable_nodes) == (0, 0)
    with pytest.raises(config.ConfigError, match=r"kueueSharePercent: no longer a setting; .*lendMaxPercent"):
        config.from_values({"gpuPools": [_pool()], "kueueSharePercent": 10})
    for bad, hint in ((101, "use an integer from 0 to 100"), ("10", "use an integer from 0 to 100")):
        with pytest.raises(config.ConfigError) as err:
            config.from_values({"gpuPools": [{**_pool(), "lendMaxPercent": bad}]})
        assert str(err.value) == f"fleetheal:gpuPools[0].lendMaxPercent: {bad!r} is not accepted; {hint}"


def test_bad_config_fails_before_any_resource_is_registered() -> None:
    from fleetheal.infra import program

    def body() -> None:
        program.build(config.from_values(_values(slinkyMode="nope")))

    recorder = mocks.RecordingMocks()
    with pytest.raises(config.ConfigError, match="fleetheal:slinkyMode"):
        mocks.run(body, recorder=recorder)
    assert [r.type for r in recorder.records if r.type != "pulumi:pulumi:Stack"] == []


def test_pulumi_main_reads_the_engine_config_and_builds_the_stack(dev_values: dict[str, Any]) -> None:
    """Run pulumi/__main__.py as the engine would, with the stack config set through the runtime."""
    mocks_ = mocks.RecordingMocks()
    pulumi.runtime.set_mocks(mocks_, project="fleetheal", stack="dev", preview=False)
    pulumi.runtime.set_all_config(
        {f"fleetheal:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in dev_values.items()}
    )
    try:

        @pulumi.runtime.test
        def body() -> None:
            runpy.run_path(str(REPO / "pulumi" / "__main__.py"), run_name="__main__")

        body()
    finally:
        pulumi.runtime.set_all_config({})
    kinds = {r.inputs.get("kind") for r in mocks_.records if r.is_kubernetes_object}
    assert {"Controller", "NodeSet", "DaemonSet", "PrometheusRule", "AlertmanagerConfig"} <= kinds
    nodesets = [r.inputs["metadata"]["name"] for r in mocks_.records if r.inputs.get("kind") == "NodeSet"]
    assert sorted(nodesets) == ["lab-a100", "lab-h100"]


def test_config_reference_doc_is_current() -> None:
    doc = REPO / "docs" / "pulumi-config.md"
    assert doc.read_text() == config_docs.reference_markdown(), (
        "docs/pulumi-config.md is stale: run .venv/bin/python -c 'from fleetheal.infra import config_docs; "
        'open("docs/pulumi-config.md", "w").write(config_docs.reference_markdown())\''
    )


def test_a_secret_key_stored_in_clear_is_refused(dev_values: dict[str, Any]) -> None:
    base = {f"fleetheal:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in dev_values.items()}
    key = "fleetheal:slurmKey"
    try:
        pulumi.runtime.set_all_config({**base, key: "c2VjcmV0"}, secret_keys=[])
        with pytest.raises(config.ConfigError, match="fleetheal:slurmKey: stored in clear; set it with"):
            config.from_pulumi()
        pulumi.runtime.set_all_config({**base, key: "c2VjcmV0"}, secret_keys=[key])
        assert "slurmKey" in config.from_pulumi().secrets
        pulumi.runtime.set_all_config({**base, key: ""}, secret_keys=[])
        assert "slurmKey" not in config.from_pulumi().secrets  # "" is the declared default: not set
        db = "fleetheal:remediatorDbPassword"
        pulumi.runtime.set_all_config({**base, db: "pw-in-clear"}, secret_keys=[])
        with pytest.raises(config.ConfigError, match="fleetheal:remediatorDbPassword: stored in clear; set it with"):
            config.from_pulumi()
    finally:
        pulumi.runtime.set_all_config({})


def test_a_replicated_remediator_on_postgres() -> None:
    cfg = config.from_values(
        _values(
            environment="production",
            remediatorReplicas="3",
            remediatorStore="postgres-in-cluster",
            remediatorDbPassword="pw",
        )
    )
    assert (cfg.environment, cfg.remediator_replicas, cfg.remediator_store) == ("production", 3, "postgres-in-cluster")
    assert cfg.remediator_store_secret == "fleetheal-remediator-store"
    assert cfg.secret("remediatorDbPassword") == "pw"
    assert project.declarations()["remediatorDbPassword"].secret
