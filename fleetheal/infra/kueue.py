"""KueueQueues: Kueue (v1beta2) queues for Kubernetes-native GPU work (inference, small experiments).

Kubernetes workloads run on the nodes GPU pools lend (`fleetheal.io/pool: lent`): a lent node is out of the
slurmd NodeSet's selection, so its GPUs are free; an active node's are every one slurmd's. One ResourceFlavor per
GPU type selects that type's lent nodes and tolerates their taint; the quota of each type is what its pools may
lend at most (`lendMaxPercent`), split between a large-job and a small-job ClusterQueue in one cohort with
borrowing and lending limits; a LocalQueue for each per namespace.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal import contracts
from fleetheal.infra import common
from fleetheal.infra.stack_model import GpuPool

COMPONENT = "KueueQueues"
API = "kueue.x-k8s.io/v1beta2"
GPU = "nvidia.com/gpu"


class KueueQueuesArgs(TypedDict):
    cluster_name: str
    """Prefix of the ClusterQueue and cohort names."""
    pools: tuple[GpuPool, ...]
    """GPU pools; the GPUs they may lend are summed per GPU type."""
    namespaces: tuple[str, ...]
    """Namespaces that get LocalQueues (created here)."""
    large_share_percent: int
    """Share of Kueue's GPUs that is the large-job queue's nominal quota."""
    borrowing_limit_percent: int
    """Share of its nominal quota a ClusterQueue may borrow from the cohort."""
    lending_limit_percent: int
    """Share of its nominal quota a ClusterQueue may lend to the cohort."""


def quotas(pools: tuple[GpuPool, ...], large_share: int) -> dict[str, tuple[int, int]]:
    """GPU type -> (large nominal quota, small nominal quota): the GPUs of the nodes its pools may lend at once."""
    per_type: dict[str, int] = {}
    for p in pools:
        per_type[p.gpu_type] = per_type.get(p.gpu_type, 0) + p.lendable_nodes * p.gpus_per_node
    out: dict[str, tuple[int, int]] = {}
    for t, lendable in sorted(per_type.items()):
        large = math.floor(lendable * large_share / 100)
        out[t] = (large, lendable - large)
    return out


class KueueQueues(pulumi.ComponentResource):
    queue_names: dict[str, str]

    def __init__(self, name: str, args: KueueQueuesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, KueueQueuesArgs.__annotations__)
        cn = common.dns_label(COMPONENT, "cluster_name", a["cluster_name"], 40)
        if not a["pools"]:
            raise common.ComponentArgError(f"{COMPONENT}.pools: at least one GPU pool is required")
        for f in ("large_share_percent", "borrowing_limit_percent", "lending_limit_percent"):
            v = a[f]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 100:
                raise common.ComponentArgError(f"{COMPONENT}.{f}: {v!r} is not accepted; use an integer from 0 to 100")
        for n in a["namespaces"]:
            common.dns_label(COMPONENT, "namespaces", n)
        super().__init__("fleetheal:kueue:KueueQueues", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = common.labels("kueue", f"{cn}-gpu")
        cohort = f"{cn}-gpu"
        q = quotas(a["pools"], a["large_share_percent"])
        self.queue_names = {"large": f"{cn}-large", "small": f"{cn}-small"}

        self.flavors = [
            k8s.apiextensions.CustomResource(
                f"{name}-flavor-{t}",
                api_version=API,
                kind="ResourceFlavor",
                metadata={"name": f"{cn}-{t}", "labels": labels},
                spec={
                    "nodeLabels": {contracts.LABEL_GPU_TYPE: t, contracts.LABEL_POOL: contracts.POOL_LENT},
                    "tolerations": [
                        {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                        {"key": contracts.TAINT_LENT, "operator": "Exists", "effect": "NoSchedule"},
                    ],
                },
                opts=child,
            )
            for t in q
        ]

        def limits(nominal: int) -> dict[str, Any]:
            return {
                "name": GPU,
                "nominalQuota": nominal,
                "borrowingLimit": math.floor(nominal * a["borrowing_limit_percent"] / 100),
                "lendingLimit": math.floor(nominal * a["lending_limit_percent"] / 100),
            }

        self.cluster_queues = []
        for idx, size in enumerate(("large", "small")):
            self.cluster_queues.append(
                k8s.apiextensions.CustomResource(
                    f"{name}-cq-{size}",
                    api_version=API,
                    kind="ClusterQueue",
                    metadata={"name": self.queue_names[size], "labels": labels},
                    spec={
                        "cohortName": cohort,
                        "namespaceSelector": {},
                        "queueingStrategy": "BestEffortFIFO",
                        "resourceGroups": [
                            {
                                "coveredResources": [GPU],
                                "flavors": [
                                    {"name": f"{cn}-{t}", "resources": [limits(quota[idx])]} for t, quota in q.items()
                                ],
                            }
                        ],
                        "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"},
                    },
                    opts=pulumi.ResourceOptions(parent=self, depends_on=self.flavors),
                )
            )
        self.namespaces = []
        self.local_queues = []
        for ns in a["namespaces"]:
            nso = k8s.core.v1.Namespace(f"{name}-ns-{ns}", metadata={"name": ns, "labels": labels}, opts=child)
            self.namespaces.append(nso)
            for size in ("large", "small"):
                self.local_queues.append(
                    k8s.apiextensions.CustomResource(
                        f"{name}-lq-{ns}-{size}",
                        api_version=API,
                        kind="LocalQueue",
                        metadata={"name": size, "namespace": ns, "labels": labels},
                        spec={"clusterQueue": self.queue_names[size]},
                        opts=pulumi.ResourceOptions(parent=self, depends_on=[nso, *self.cluster_queues]),
                    )
                )
        self.register_outputs({"cluster_queues": list(self.queue_names.values())})
