"""Stack configuration: the values of the keys `Pulumi.yaml` declares -> one checked, frozen `StackConfig`.

The values come from `pulumi.Config` under a real engine (`from_pulumi`) or from `Pulumi.<stack>.yaml`
for `fleetheal render` (`from_values` with fleetheal.infra.project.stack_values). This module coerces
them to the declared types and checks each key and the rules between keys; the GPU pools
(fleetheal.infra.pool_config) and the federation (fleetheal.infra.federation_config) have their own
modules. Every error is a ConfigError naming the key and the accepted values, raised before any
resource is registered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetheal.infra import federation_config
from fleetheal.infra.config_checks import QUANTITY, at_least, dns_label, one_of, percent, pinned
from fleetheal.infra.pool_config import pools
from fleetheal.infra.project import PROJECT, PROJECT_FILE, Declaration, declarations, stack_values
from fleetheal.infra.stack_model import ENVIRONMENTS, NODE_PROVIDERS, REMEDIATOR_STORES, SLINKY_MODES, StackConfig
from fleetheal.settings import ConfigError

__all__ = ["ConfigError", "from_pulumi", "from_values"]


# coercion: pulumi.Config hands every value over as a string (objects as JSON); stack files as YAML


def _coerce(decl: Declaration, value: Any) -> Any:
    key = f"{PROJECT}:{decl.key}"
    if decl.type == "string":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if decl.type == "integer":
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if decl.type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: expected {decl.type} (JSON when set as a string): {exc.msg}") from exc
    if decl.type == "array":
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        want = {"string": str, "object": dict, "integer": int}.get(decl.items or "", object)
        for i, item in enumerate(value):
            if not isinstance(item, want):
                raise ConfigError(f"{key}[{i}]: expected {decl.items}, got {item!r}")
        return value
    if decl.type == "object":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object (mapping), got {value!r}")
        return value
    raise ConfigError(f"{key}: Pulumi.yaml declares unsupported type {decl.type!r}")


#: Settings that were removed, and what replaces each.
REMOVED = {
    "kueueSharePercent": "Kueue's quota is the GPUs of the nodes the pools may lend: set gpuPools[].lendMaxPercent",
}


def from_values(values: Mapping[str, Any], project_file: Path = PROJECT_FILE) -> StackConfig:
    """Build and check the stack config from bare-name values (`clusterName`, not `fleetheal:clusterName`).

    Keys not declared in `Pulumi.yaml` are rejected (a typo must not silently fall back to a default).
    """
    decls = declarations(project_file)
    unknown = sorted(set(values) - set(decls))
    for key in unknown:
        if key in REMOVED:
            raise ConfigError(f"{PROJECT}:{key}: no longer a setting; {REMOVED[key]}")
    if unknown:
        raise ConfigError(
            f"{PROJECT}:{unknown[0]}: not a fleetheal setting; declared keys are: {', '.join(sorted(decls))}"
        )
    v: dict[str, Any] = {}
    secrets: dict[str, Any] = {}
    for key, decl in decls.items():
        if decl.secret:
            if values.get(key) not in (None, ""):  # "" is the declared default: not set
                secrets[key] = values[key]
            continue
        raw = values.get(key)
        if raw is None:
            if not decl.has_default:
                raise ConfigError(f"{PROJECT}:{key}: required; {decl.description}")
            raw = decl.default
        v[key] = _coerce(decl, raw)

    provider = one_of("nodeProvider", v["nodeProvider"], NODE_PROVIDERS)
    min_nodes = at_least("standbyMinNodes", v["standbyMinNodes"], 1)
    share = percent("standbySharePercent", v["standbySharePercent"])
    if provider == "eks":
        for k in ("eksClusterName", "eksNodeRoleArn"):
            if not v[k]:
                raise ConfigError(f"{PROJECT}:{k}: required when nodeProvider=eks")
        if not v["eksSubnetIds"]:
            raise ConfigError(f"{PROJECT}:eksSubnetIds: at least one subnet id is required when nodeProvider=eks")
    labels = v["monitoringLabels"]
    for lk, lv in labels.items():
        if not isinstance(lv, str):
            raise ConfigError(f"{PROJECT}:monitoringLabels.{lk}: expected a string label value, got {lv!r}")
    if not QUANTITY.match(v["sharedStorageSize"]):
        raise ConfigError(
            f"{PROJECT}:sharedStorageSize: {v['sharedStorageSize']!r} is not accepted; "
            "use a Kubernetes quantity such as 10Ti"
        )
    if not v["sharedStorageMountPath"].startswith("/"):
        raise ConfigError(f"{PROJECT}:sharedStorageMountPath: {v['sharedStorageMountPath']!r} must be an absolute path")
    if "latest" in v["slurmImageTag"].split("-") or not v["slurmImageTag"]:
        raise ConfigError(
            f"{PROJECT}:slurmImageTag: {v['slurmImageTag']!r} is not pinned; "
            "use a release tag such as 26.05-ubuntu26.04"
        )
    if not re.fullmatch(r"v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", v["slinkyVersion"]):
        raise ConfigError(f"{PROJECT}:slinkyVersion: {v['slinkyVersion']!r} is not pinned; use a release such as 1.2.1")
    replicas = at_least("remediatorReplicas", v["remediatorReplicas"], 1)
    store = one_of("remediatorStore", v["remediatorStore"], REMEDIATOR_STORES)
    if replicas > 1 and store == "sqlite":
        raise ConfigError(
            f"{PROJECT}:remediatorReplicas: {replicas} is not accepted with remediatorStore=sqlite (SQLite serves one "
            "replica); set remediatorStore to postgres or postgres-in-cluster, or remediatorReplicas to 1"
        )

    cluster_name = dns_label("clusterName", v["clusterName"], 40)
    federation = federation_config.federation(
        v["federation"],
        cluster_name,
        lambda stack: from_values(stack_values(stack, project_file.parent), project_file),
    )
    accounting_database = v["accountingDatabase"]
    if federation.member:
        if not federation_config.SLURM_CLUSTER.match(cluster_name):
            raise ConfigError(
                f"{PROJECT}:clusterName: {cluster_name!r} is not accepted in a federation; a Slurm cluster name "
                "starts with a lower-case letter (then letters, digits, '-'; at most 40)"
            )
        if v["slinkyMode"] != "manifests":
            raise ConfigError(
                f"{PROJECT}:slinkyMode: {v['slinkyMode']!r} is not accepted with federation.role "
                f"{federation.role}; a federation member needs slinkyMode manifests (the Accounting custom "
                "resource carries the shared slurmdbd)"
            )
    if federation.role == "worker":
        # A worker's accounting is the manager's slurmdbd and database. accountingDatabase does not apply (the
        # engine hands over its declared default, true, as if it were set, so it cannot be refused here).
        accounting_database = False

    return StackConfig(
        environment=one_of("environment", v["environment"], ENVIRONMENTS),
        cluster_name=cluster_name,
        slurm_namespace=dns_label("slurmNamespace", v["slurmNamespace"]),
        system_namespace=dns_label("systemNamespace", v["systemNamespace"]),
        slinky_mode=one_of("slinkyMode", v["slinkyMode"], SLINKY_MODES),
        slinky_version=v["slinkyVersion"],
        slinky_chart_repo=v["slinkyChartRepo"],
        image_registry=v["imageRegistry"].rstrip("/"),
        slurm_image_tag=v["slurmImageTag"],
        helper_image=pinned("helperImage", v["helperImage"]),
        gpu_pools=pools(v["gpuPools"], provider, min_nodes, share),
        node_provider=provider,
        eks_cluster_name=v["eksClusterName"],
        eks_node_role_arn=v["eksNodeRoleArn"],
        eks_subnet_ids=tuple(v["eksSubnetIds"]),
        standby_min_nodes=min_nodes,
        standby_share_percent=share,
        failure_domain_size=at_least("failureDomainSize", v["failureDomainSize"], 1),
        large_job_min_nodes=at_least("largeJobMinNodes", v["largeJobMinNodes"], 2),
        requeue_grace_seconds=at_least("requeueGraceSeconds", v["requeueGraceSeconds"], 1),
        slurm_key_secret=dns_label("slurmKeySecret", v["slurmKeySecret"], 253),
        slurm_jwt_secret=dns_label("slurmJwtSecret", v["slurmJwtSecret"], 253),
        accounting_database=accounting_database,
        accounting_db_image=pinned("accountingDbImage", v["accountingDbImage"]),
        accounting_db_host=dns_label("accountingDbHost", v["accountingDbHost"], 253)
        if accounting_database
        else v["accountingDbHost"],
        accounting_db_password_secret=dns_label("accountingDbPasswordSecret", v["accountingDbPasswordSecret"], 253),
        shared_storage_class=v["sharedStorageClass"],
        shared_storage_size=v["sharedStorageSize"],
        shared_storage_mount_path=v["sharedStorageMountPath"],
        agent_image=pinned("agentImage", v["agentImage"]),
        agent_port=at_least("agentPort", v["agentPort"], 1),
        remediator_image=pinned("remediatorImage", v["remediatorImage"]),
        remediator_token_secret=dns_label("remediatorTokenSecret", v["remediatorTokenSecret"], 253),
        remediator_dry_run=v["remediatorDryRun"],
        remediator_replicas=replicas,
        remediator_store=store,
        remediator_store_secret=dns_label("remediatorStoreSecret", v["remediatorStoreSecret"], 253),
        remediator_db_image=pinned("remediatorDbImage", v["remediatorDbImage"]),
        dcgm_exporter=v["dcgmExporter"],
        dcgm_exporter_image=pinned("dcgmExporterImage", v["dcgmExporterImage"]),
        monitoring_labels=dict(labels),
        kueue=v["kueue"],
        kueue_namespaces=tuple(dns_label("kueueNamespaces", n) for n in v["kueueNamespaces"]),
        kueue_large_share_percent=percent("kueueLargeSharePercent", v["kueueLargeSharePercent"]),
        kueue_borrowing_limit_percent=percent("kueueBorrowingLimitPercent", v["kueueBorrowingLimitPercent"]),
        kueue_lending_limit_percent=percent("kueueLendingLimitPercent", v["kueueLendingLimitPercent"]),
        await_readiness=v["awaitReadiness"],
        secrets=secrets,
        federation=federation,
    )


def from_pulumi(project_file: Path = PROJECT_FILE) -> StackConfig:
    """Read the running stack's config (the engine has applied the Pulumi.yaml defaults already)."""
    import pulumi

    cfg = pulumi.Config(PROJECT)
    values: dict[str, Any] = {}
    for key, decl in declarations(project_file).items():
        if decl.secret:
            # The declared default "" means not set (see SECRET_KEYS); only a set value becomes a secret Output.
            raw_secret = pulumi.runtime.get_config(f"{PROJECT}:{key}")
            if raw_secret:
                if not pulumi.runtime.is_config_secret(f"{PROJECT}:{key}"):
                    raise ConfigError(
                        f"{PROJECT}:{key}: stored in clear; set it with `pulumi config set --secret {key}`"
                    )
                values[key] = pulumi.Output.secret(raw_secret)
            continue
        raw = cfg.get(key)
        if raw is not None:
            values[key] = raw
    return from_values(values, project_file)
