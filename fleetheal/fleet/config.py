"""The fleet file: every cluster of a Slurm federation and what fleetheal's placement, queues and
cross-cluster failover need to know about them, read once (fleetheal.settings rules: YAML file plus
`FLEETHEAL_FLEET_<SECTION>__<KEY>` overrides; an unknown key is an error).

Example::

    federation: fed
    clusters:
      a: {gpu_type: h100, gpus_per_node: 8, checkpoint_stores: [shared]}
      b: {gpu_type: h100, gpus_per_node: 8, checkpoint_stores: [shared]}
      c: {gpu_type: a100, gpus_per_node: 8}
    datasets:
      imagenet: {size_gb: 150, clusters: [a]}
    checkpoint_stores:
      shared: {path: /shared/checkpoints}
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from fleetheal import contracts, settings
from fleetheal.settings import ConfigError

ENV_PREFIX = "FLEETHEAL_FLEET_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: Slurm cluster names and fleetheal's names for datasets and stores: short, lower case, no dots.
NAME = re.compile(contracts.CLUSTER_NAME_PATTERN)


@dataclass(frozen=True)
class Cluster:
    """One Slurm cluster of the federation, by its ClusterName."""

    #: GPU model of the cluster's GPU nodes as its GRES type names it (`gpu:h100:8`); "" when untyped.
    gpu_type: str = ""
    #: GPUs in each of the cluster's GPU nodes.
    gpus_per_node: int = 8
    #: Base URL of the cluster's remediator (standby pools, open incidents); "" when it is not reported.
    remediator_url: str = ""
    #: Names of the checkpoint stores (`checkpoint_stores`) this cluster's nodes can read.
    checkpoint_stores: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dataset:
    """A dataset or checkpoint that jobs name (`fleetheal submit --data NAME`), and where copies are."""

    #: Size, for the cost of copying it to a cluster that lacks it.
    size_gb: float = 0.0
    #: Clusters whose storage holds a copy.
    clusters: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointStore:
    """Storage that jobs checkpoint to; a job can fail over only to a cluster that reads its store."""

    #: Where the store is mounted on every cluster that reads it.
    path: str = ""


@dataclass(frozen=True)
class Placement:
    """Which cluster a job goes to (fleetheal.fleet.placement)."""

    #: A job asking for at most this many GPUs is small: it is packed onto busy clusters; a larger one
    #: goes where whole nodes are free.
    small_job_max_gpus: int = 8
    #: Copy bandwidth between clusters, for the cost of moving a dataset (GB/s).
    copy_gb_per_s: float = 1.0
    #: Prefix of the Slurm cluster features that say a cluster holds a dataset (`data-imagenet`).
    data_feature_prefix: str = "data-"


@dataclass(frozen=True)
class Queues:
    """The large-job and small-job queues of each cluster and the lending between them (fleetheal.fleet.queues).
    Which jobs are small is `placement.small_job_max_gpus`, one threshold for placement and queues."""

    #: QOS of the large-job queue.
    large_qos: str = "large"
    #: QOS of the small-job queue; its GrpTRES gres/gpu limit is what lending moves.
    small_qos: str = "small"
    #: GPUs the small queue may always use, lent or not.
    small_guaranteed_gpus: int = 8
    #: Seconds between two lending decisions.
    interval_s: float = 5.0
    #: Take lent GPUs back through the small QOS too: once a large job has waited `reclaim_after_s`, lending
    #: shrinks by its size (no small job is stopped; those that end give their GPUs to it). Off by default:
    #: Slurm's backfill reservation for the highest-priority waiting job already keeps small jobs from
    #: delaying it, and shrinking the QOS as well leaves GPUs idle (docs/queues.md, measured). For a
    #: scheduler without backfill reservations (SchedulerType=sched/builtin).
    reclaim: bool = False
    reclaim_after_s: float = 3600.0
    #: Idle large-queue GPUs kept unlent (so a large job that arrives need not wait for small ones).
    lend_reserve_gpus: int = 0
    #: Aging: priority points per hour a job has waited.
    age_weight_per_hour: float = 1.0
    #: Size: priority points per requested GPU.
    size_weight_per_gpu: float = 0.1


@dataclass(frozen=True)
class FleetConfig:
    #: The Slurm federation's name (`sacctmgr show federation`).
    federation: str = "fleet"
    #: The federation's clusters by ClusterName.
    clusters: Mapping[str, Cluster] = field(default_factory=lambda: MappingProxyType({}))
    #: The data catalogue: datasets and checkpoints by name.
    datasets: Mapping[str, Dataset] = field(default_factory=lambda: MappingProxyType({}))
    #: Checkpoint stores by name.
    checkpoint_stores: Mapping[str, CheckpointStore] = field(default_factory=lambda: MappingProxyType({}))
    placement: Placement = field(default_factory=Placement)
    queues: Queues = field(default_factory=Queues)
    #: Where the settings came from (for messages).
    source: str = field(default="", metadata=settings.NOT_A_SETTING)

    def __post_init__(self) -> None:
        for kind, names in (
            ("cluster", self.clusters),
            ("dataset", self.datasets),
            ("checkpoint store", self.checkpoint_stores),
        ):
            for name in names:
                if not NAME.fullmatch(name):
                    raise ConfigError(f"{kind} name {name!r}: use lower-case letters, digits and '-' (at most 40)")
        for name, ds in self.datasets.items():
            for c in ds.clusters:
                if c not in self.clusters:
                    raise ConfigError(f"datasets.{name}.clusters: {c!r} is not one of the clusters")
        for name, cl in self.clusters.items():
            if cl.gpus_per_node < 1:
                raise ConfigError(f"clusters.{name}.gpus_per_node: must be at least 1")
            for s in cl.checkpoint_stores:
                if s not in self.checkpoint_stores:
                    raise ConfigError(f"clusters.{name}.checkpoint_stores: {s!r} is not one of the checkpoint_stores")

    def readers(self, store: str) -> tuple[str, ...]:
        """The clusters that can read checkpoint store `store`."""
        return tuple(n for n, c in self.clusters.items() if store in c.checkpoint_stores)


def load(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> FleetConfig:
    """The fleet file at `path` (or $FLEETHEAL_FLEET_CONFIG) with environment overrides; ConfigError names
    the file, the key and what is wrong."""
    env = os.environ if env is None else env
    where = path if path is not None else env.get(CONFIG_ENV)
    if not where:
        raise ConfigError(f"no fleet file: pass --fleet FILE or set {CONFIG_ENV}")
    doc = settings.read_yaml(where)
    try:
        cfg = settings.build(FleetConfig, doc, env, ENV_PREFIX, reserved=(CONFIG_ENV,))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return FleetConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "source": str(Path(where))})
