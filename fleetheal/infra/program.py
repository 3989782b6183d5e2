"""The whole fleetheal stack: `build(cfg)` registers every component (used by `pulumi/__main__.py`,
`fleetheal render` and the tests, so all three build exactly the same graph)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
from pulumi.runtime import rpc

from fleetheal import generate
from fleetheal.infra import common
from fleetheal.infra.accounting_db import AccountingDatabase
from fleetheal.infra.agent import HealthAgent
from fleetheal.infra.alerting import AlertRouting
from fleetheal.infra.dcgm import DcgmExporter
from fleetheal.infra.federation import FederationManager
from fleetheal.infra.fleet_file import FLEET_CONFIGMAP, FLEET_FILE_KEY, fleet_file_text
from fleetheal.infra.kueue import KueueQueues
from fleetheal.infra.nodepools import GpuNodePools, failure_domain, make_provider
from fleetheal.infra.policy import shared
from fleetheal.infra.remediator import Remediator, RemediatorArgs
from fleetheal.infra.remediator_store import RemediatorStore
from fleetheal.infra.slinky import SlinkyCluster
from fleetheal.infra.stack_model import StackConfig
from fleetheal.infra.storage import SharedStorage

OPERATOR_NAMESPACE = "slinky"
GPU_RUNTIME_CLASS = "nvidia"
#: The in-cluster remediator store's volume: incidents and audit events are small rows.
REMEDIATOR_DB_SIZE = "10Gi"
#: The Kubernetes provider's annotation that skips its await logic (readiness on create and update;
#: deletion too for Namespaces and workloads).
SKIP_AWAIT = "pulumi.com/skipAwait"


@dataclass(frozen=True)
class Fleet:
    slinky: SlinkyCluster
    storage: SharedStorage
    pools: GpuNodePools
    agent: HealthAgent
    alerting: AlertRouting
    remediator: Remediator
    dcgm: DcgmExporter | None
    kueue: KueueQueues | None
    accounting_db: AccountingDatabase | None
    #: The federation's sacctmgr script and Job (a federation manager's stack only).
    federation: FederationManager | None = None
    #: The ConfigMap with the fleet file (a federation member's stack only).
    fleet_file: k8s.core.v1.ConfigMap | None = None


def _secret(name: str, ns: str, key: str, value: Any, parent_opts: pulumi.ResourceOptions) -> k8s.core.v1.Secret:
    return k8s.core.v1.Secret(
        f"secret-{name}",
        metadata={"name": name, "namespace": ns, "labels": common.labels("secret", name)},
        string_data={key: pulumi.Output.secret(value)},
        opts=parent_opts,
    )


def fleet_file_config_map(cfg: StackConfig, opts: pulumi.ResourceOptions) -> k8s.core.v1.ConfigMap:
    """The ConfigMap `fleetheal-fleet` (key fleet.yaml) of a federation member: the fleet file every member
    renders alike (a worker from its manager's stack), which its remediator's failover reads."""
    return k8s.core.v1.ConfigMap(
        "federation-fleet-file",
        metadata={
            "name": FLEET_CONFIGMAP,
            "namespace": cfg.system_namespace,
            "labels": common.labels("fleet", FLEET_CONFIGMAP, {shared.LABEL_FEDERATION_ROLE: cfg.federation.role}),
        },
        data={FLEET_FILE_KEY: fleet_file_text(cfg.federation.fleet_file)},
        opts=opts,
    )


def node_domains(cfg: StackConfig) -> dict[str, str]:
    """Node -> failure domain for every node the remediator may act on (existing-nodes provider only;
    with a cloud provider the remediator reads the labels of the nodes it is told about)."""
    out: dict[str, str] = {}
    if cfg.node_provider != "existing":
        return out
    for pool in cfg.gpu_pools:
        for names in (pool.node_names, pool.standby_node_names):
            for i, node in enumerate(names):
                out[node] = failure_domain(pool, i, cfg.failure_domain_size)
    return out


def remediator_store(cfg: StackConfig) -> RemediatorStore:
    """The remediator's `store` argument from remediatorStore and its settings."""
    if cfg.remediator_store == "sqlite":
        return {"kind": "sqlite"}
    if cfg.remediator_store == "postgres":
        return {"kind": "postgres", "secret": cfg.remediator_store_secret}
    return {
        "kind": "postgres-in-cluster",
        "secret": cfg.remediator_store_secret,
        "image": cfg.remediator_db_image,
        "size": REMEDIATOR_DB_SIZE,
        "password": cfg.secret("remediatorDbPassword"),
    }


def skip_await(args: pulumi.ResourceTransformArgs) -> pulumi.ResourceTransformResult | None:
    """Stack-wide transform (awaitReadiness=false): annotate every Kubernetes object `pulumi.com/skipAwait: "true"`.

    Helm releases carry no object metadata of their own and are left alone, as are components and
    other providers' resources. The engine hands over the inputs in wire form (camelCase keys).
    """
    if not args.custom or not args.type_.startswith("kubernetes:") or args.type_.startswith("kubernetes:helm.sh/"):
        return None
    props = dict(args.props)
    metadata: Any = props.get("metadata")
    secret = rpc.is_rpc_secret(metadata)
    if secret:
        metadata = rpc.unwrap_rpc_secret(metadata)
    if metadata is None:
        metadata = {}
    annotations = (metadata.get("annotations") or {}) if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return None  # still unknown (a preview before its inputs resolve): `up` annotates it
    props["metadata"] = {**metadata, "annotations": {**annotations, SKIP_AWAIT: "true"}}
    if secret:
        props["metadata"] = rpc.wrap_rpc_secret(props["metadata"])
    return pulumi.ResourceTransformResult(props=props, opts=args.opts)


def build(cfg: StackConfig) -> Fleet:
    if not cfg.await_readiness:
        pulumi.runtime.register_resource_transform(skip_await)
    environment = {shared.LABEL_ENVIRONMENT: cfg.environment}
    ns_slurm = k8s.core.v1.Namespace(
        "ns-slurm",
        metadata={"name": cfg.slurm_namespace, "labels": common.labels("namespace", cfg.slurm_namespace, environment)},
    )
    ns_system = k8s.core.v1.Namespace(
        "ns-system",
        metadata={
            "name": cfg.system_namespace,
            "labels": common.labels("namespace", cfg.system_namespace, environment),
        },
    )
    in_slurm = pulumi.ResourceOptions(depends_on=[ns_slurm])
    in_system = pulumi.ResourceOptions(depends_on=[ns_system])

    for key, name, ns, item in (
        ("slurmKey", cfg.slurm_key_secret, cfg.slurm_namespace, "slurm.key"),
        ("slurmJwtKey", cfg.slurm_jwt_secret, cfg.slurm_namespace, "jwt.key"),
        ("remediatorToken", cfg.remediator_token_secret, cfg.system_namespace, "token"),
    ):
        if cfg.secret(key) is not None:
            _secret(name, ns, item, cfg.secret(key), in_slurm if ns == cfg.slurm_namespace else in_system)

    storage = SharedStorage(
        "shared",
        {
            "namespace": cfg.slurm_namespace,
            "storage_class": cfg.shared_storage_class,
            "size": cfg.shared_storage_size,
            "claim_name": f"{cfg.cluster_name}-shared",
        },
        opts=in_slurm,
    )
    provider = make_provider(
        cfg.node_provider,
        failure_domain_size=cfg.failure_domain_size,
        namespace=cfg.system_namespace,
        cluster_name=cfg.eks_cluster_name,
        node_role_arn=cfg.eks_node_role_arn,
        subnet_ids=cfg.eks_subnet_ids,
    )
    pools = GpuNodePools("gpu-pools", {"pools": cfg.gpu_pools, "provider": provider}, opts=in_system)

    accounting_db = None
    if cfg.accounting_database:
        accounting_db = AccountingDatabase(
            "accounting-db",
            {
                "namespace": cfg.slurm_namespace,
                "service_name": cfg.accounting_db_host,
                "image": cfg.accounting_db_image,
                "password_secret": cfg.accounting_db_password_secret,
                "size": "100Gi",
            },
            opts=in_slurm,
        )
    images = {c: cfg.image(c) for c in ("slurmctld", "slurmd", "slurmdbd", "slurmrestd", "login")}
    images["helper"] = cfg.helper_image
    slinky = SlinkyCluster(
        "slinky",
        {
            "mode": cfg.slinky_mode,
            "cluster_name": cfg.cluster_name,
            "namespace": cfg.slurm_namespace,
            "operator_namespace": OPERATOR_NAMESPACE,
            "version": cfg.slinky_version,
            "chart_repo": cfg.slinky_chart_repo,
            "operator_image": cfg.operator_image,
            "images": images,
            "pools": cfg.gpu_pools,
            "large_job_min_nodes": cfg.large_job_min_nodes,
            "requeue_grace_seconds": cfg.requeue_grace_seconds,
            "slurm_key_secret": cfg.slurm_key_secret,
            "jwt_key_secret": cfg.slurm_jwt_secret,
            "accounting_db_host": cfg.accounting_db_host,
            "accounting_db_password_secret": cfg.accounting_db_password_secret,
            "shared_claim": storage.claim_name,
            "shared_mount_path": cfg.shared_storage_mount_path,
            "federation_role": cfg.federation.role,
            "manager_address": (cfg.federation.manager_host, cfg.federation.manager_port),
            "accounting_service_type": cfg.federation.service_type,
        },
        opts=pulumi.ResourceOptions(depends_on=[ns_slurm, storage]),
    )
    manager = fleet_file = None
    if cfg.federation.role == "manager":
        after_slurm = pulumi.ResourceOptions(depends_on=[ns_slurm, ns_system, slinky])
        manager = FederationManager(
            "federation",
            {
                "spec": cfg.federation,
                "cluster_name": cfg.cluster_name,
                "namespace": cfg.slurm_namespace,
                "image": cfg.image("login"),
                "slurm_key_secret": cfg.slurm_key_secret,
            },
            opts=after_slurm,
        )
        fleet_file = fleet_file_config_map(cfg, after_slurm)
    elif cfg.federation.fleet_file:  # a worker: its manager's fleet file, for its remediator's failover
        fleet_file = fleet_file_config_map(cfg, in_system)
    agent = HealthAgent(
        "agent",
        {
            "namespace": cfg.system_namespace,
            "image": cfg.agent_image,
            "port": cfg.agent_port,
            "cluster_name": cfg.cluster_name,
            "monitoring_labels": dict(cfg.monitoring_labels),
            "runtime_class": GPU_RUNTIME_CLASS,
        },
        opts=in_system,
    )
    dcgm = None
    if cfg.dcgm_exporter:
        dcgm = DcgmExporter(
            "dcgm",
            {
                "namespace": cfg.system_namespace,
                "image": cfg.dcgm_exporter_image,
                "monitoring_labels": dict(cfg.monitoring_labels),
                "runtime_class": GPU_RUNTIME_CLASS,
            },
            opts=in_system,
        )
    remediator_args: RemediatorArgs = {
        "namespace": cfg.system_namespace,
        "image": cfg.remediator_image,
        "cluster_name": cfg.cluster_name,
        "slurm_namespace": cfg.slurm_namespace,
        "token_secret": cfg.remediator_token_secret,
        "nodes": node_domains(cfg),
        "dry_run": cfg.remediator_dry_run,
        "standby_target": sum(pool.standby_nodes for pool in cfg.gpu_pools),
        "replicas": cfg.remediator_replicas,
        "store": remediator_store(cfg),
        "membership": cfg.node_provider == "existing",
        "monitoring_labels": dict(cfg.monitoring_labels),
    }
    lending = {
        p.name: {"max_nodes": p.lendable_nodes, "min_lent_s": p.lend_min_s, "reclaim_grace_s": p.reclaim_grace_s}
        for p in cfg.gpu_pools
        if p.lendable_nodes
    }
    if lending and cfg.kueue and cfg.kueue_namespaces:
        # Idle nodes of these pools serve the pods Kueue admits in its namespaces (its flavours select lent nodes).
        remediator_args["lending"] = {"pools": lending, "namespaces": list(cfg.kueue_namespaces)}
    if cfg.federation.fleet_file:  # a federation member: cross-cluster failover by the fleet file
        remediator_args["fleet_configmap"] = FLEET_CONFIGMAP
    remediator = Remediator(
        "remediator", remediator_args, opts=pulumi.ResourceOptions(depends_on=[ns_system, ns_slurm])
    )
    alerting = AlertRouting(
        "alerting",
        {
            "namespace": cfg.system_namespace,
            "rule_groups": generate.alert_rule_groups(),
            "health_rule_groups": generate.health_rule_groups(),
            "webhook_url": remediator.webhook_url,
            "token_secret": cfg.remediator_token_secret,
            "monitoring_labels": dict(cfg.monitoring_labels),
        },
        opts=in_system,
    )
    kueue = None
    if cfg.kueue:
        kueue = KueueQueues(
            "kueue",
            {
                "cluster_name": cfg.cluster_name,
                "pools": cfg.gpu_pools,
                "namespaces": cfg.kueue_namespaces,
                "large_share_percent": cfg.kueue_large_share_percent,
                "borrowing_limit_percent": cfg.kueue_borrowing_limit_percent,
                "lending_limit_percent": cfg.kueue_lending_limit_percent,
            },
        )
    return Fleet(slinky, storage, pools, agent, alerting, remediator, dcgm, kueue, accounting_db, manager, fleet_file)
