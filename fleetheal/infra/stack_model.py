"""The stack config as typed, frozen values: `StackConfig` and its parts (GPU pools, the federation).

fleetheal.infra.config builds them from the declared keys and checks them; the components and the
program read them. Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SLINKY_MODES = ("manifests", "helm")
NODE_PROVIDERS = ("existing", "eks")
ENVIRONMENTS = ("development", "staging", "production")
#: How the remediator's incident store is kept: SQLite on a PVC; the operator's PostgreSQL; a PostgreSQL deployed
#: in the cluster (fleetheal.infra.remediator_store).
REMEDIATOR_STORES = ("sqlite", "postgres", "postgres-in-cluster")
#: `none`: a cluster on its own (its own slurmdbd); `manager`: a cluster that also runs the federation's
#: slurmdbd and declares the federation; `worker`: a cluster whose accounting is the manager's slurmdbd.
FEDERATION_ROLES = ("none", "manager", "worker")
#: slurmdbd's default DbdPort; a worker's `federation.manager` without a port means this one.
SLURMDBD_PORT = 6819
ACCOUNTING_SERVICE_TYPES = ("LoadBalancer", "NodePort", "ClusterIP")
#: QOS every slurmdbd has from the start.
BUILTIN_QOS = ("normal",)


def standby_size(active_nodes: int, min_nodes: int, share_percent: int) -> int:
    """Warm-standby nodes a pool needs: the larger of the floor and the share, and never below 1."""
    return max(1, min_nodes, math.ceil(active_nodes * share_percent / 100))


@dataclass(frozen=True, slots=True)
class GpuPool:
    """One GPU pool: a Slinky NodeSet, its nodes and its warm-standby nodes."""

    name: str
    gpu_type: str
    gpus_per_node: int
    nodes: int
    standby_nodes: int
    node_names: tuple[str, ...] = ()
    standby_node_names: tuple[str, ...] = ()
    instance_type: str = ""
    #: The most of the pool's active nodes lent to Kubernetes workloads at once, in percent (0: none).
    lend_max_percent: int = 0
    #: A lent node stays lent at least this long; a pod on a node Slurm takes back gets this grace to stop.
    lend_min_s: int = 600
    reclaim_grace_s: int = 120

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def lendable_nodes(self) -> int:
        """Active nodes the pool may lend at once (whole nodes: a lent node leaves Slurm whole)."""
        return math.floor(self.nodes * self.lend_max_percent / 100)


@dataclass(frozen=True, slots=True)
class FederatedCluster:
    """One cluster of the federation as the manager declares it (its Slurm ClusterName is `name`)."""

    name: str
    gpu_type: str
    gpus_per_node: int
    #: Slurm cluster features besides the GPU type and the data features (`sbatch --cluster-constraint`).
    features: tuple[str, ...] = ()
    remediator_url: str = ""
    checkpoint_stores: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FederatedQos:
    name: str
    priority: int = 0


@dataclass(frozen=True, slots=True)
class FederatedAccount:
    """A Slurm account with an association on every cluster of the federation."""

    name: str
    users: tuple[str, ...]
    qos: tuple[str, ...]
    default_qos: str


@dataclass(frozen=True, slots=True)
class FederationSpec:
    """The stack's place in a Slurm federation (the `federation` setting), checked."""

    role: str = "none"
    #: The federation's name (`sacctmgr show federation`); the manager's.
    name: str = ""
    #: worker: where the manager's slurmdbd listens.
    manager_host: str = ""
    manager_port: int = SLURMDBD_PORT
    #: manager: the HOST:PORT its workers are told to use ("" when not declared); the drift check compares.
    address: str = ""
    #: manager: how its slurmdbd is reachable from the workers' Kubernetes clusters.
    service_type: str = "LoadBalancer"
    clusters: tuple[FederatedCluster, ...] = ()
    qos: tuple[FederatedQos, ...] = ()
    accounts: tuple[FederatedAccount, ...] = ()
    #: The fleet file (fleetheal.fleet.config format), validated; rendered as a ConfigMap. A worker's is its
    #: manager stack's (`managerStack`); empty for a worker that names none.
    fleet_file: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: manager: prefix of the cluster features that say a cluster holds a dataset (the fleet's placement section).
    data_feature_prefix: str = "data-"

    @property
    def member(self) -> bool:
        return self.role != "none"


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Every stack setting, checked. Secret values stay opaque (`Any`: a str or a pulumi Output)."""

    environment: str
    cluster_name: str
    slurm_namespace: str
    system_namespace: str
    slinky_mode: str
    slinky_version: str
    slinky_chart_repo: str
    image_registry: str
    slurm_image_tag: str
    helper_image: str
    gpu_pools: tuple[GpuPool, ...]
    node_provider: str
    eks_cluster_name: str
    eks_node_role_arn: str
    eks_subnet_ids: tuple[str, ...]
    standby_min_nodes: int
    standby_share_percent: int
    failure_domain_size: int
    large_job_min_nodes: int
    requeue_grace_seconds: int
    slurm_key_secret: str
    slurm_jwt_secret: str
    accounting_database: bool
    accounting_db_image: str
    accounting_db_host: str
    accounting_db_password_secret: str
    shared_storage_class: str
    shared_storage_size: str
    shared_storage_mount_path: str
    agent_image: str
    agent_port: int
    remediator_image: str
    remediator_token_secret: str
    remediator_dry_run: bool
    remediator_replicas: int
    remediator_store: str
    remediator_store_secret: str
    remediator_db_image: str
    dcgm_exporter: bool
    dcgm_exporter_image: str
    monitoring_labels: Mapping[str, str]
    kueue: bool
    kueue_namespaces: tuple[str, ...]
    kueue_large_share_percent: int
    kueue_borrowing_limit_percent: int
    kueue_lending_limit_percent: int
    await_readiness: bool
    secrets: Mapping[str, Any] = field(default_factory=dict)
    federation: FederationSpec = field(default_factory=FederationSpec)

    def image(self, component: str) -> str:
        """A Slinky image (slurmctld, slurmd, slurmdbd, slurmrestd, login) at the pinned Slurm tag."""
        return f"{self.image_registry}/{component}:{self.slurm_image_tag}"

    @property
    def operator_image(self) -> str:
        return f"{self.image_registry}/slurm-operator:{self.slinky_version}"

    def secret(self, key: str) -> Any:
        return self.secrets.get(key)
