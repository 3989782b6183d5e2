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
#: The two queue sizes, in the order of `quotas`' pair.
SIZES = ("large", "small")


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


def manifests(args: KueueQueuesArgs) -> dict[str, list[dict[str, Any]]]:
    """The queues as Kubernetes objects: "flavors", "cluster_queues" and "local_queues" (after the namespaces they
    live in). One rendering for the stack (`KueueQueues`) and the lab, which applies them to its control plane
    with the real Kueue controller (`fleetheal.lab.kueue`)."""
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
    labels = common.labels("kueue", f"{cn}-gpu")
    q = quotas(a["pools"], a["large_share_percent"])
    names = queue_names(cn)

    def obj(kind: str, name: str, spec: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        meta = {"name": name, "labels": labels} | ({"namespace": namespace} if namespace else {})
        return {"apiVersion": API, "kind": kind, "metadata": meta, "spec": spec}

    def limits(nominal: int) -> dict[str, Any]:
        return {
            "name": GPU,
            "nominalQuota": nominal,
            "borrowingLimit": math.floor(nominal * a["borrowing_limit_percent"] / 100),
            "lendingLimit": math.floor(nominal * a["lending_limit_percent"] / 100),
        }

    flavors = [
        obj(
            "ResourceFlavor",
            f"{cn}-{t}",
            {
                "nodeLabels": {contracts.LABEL_GPU_TYPE: t, contracts.LABEL_POOL: contracts.POOL_LENT},
                "tolerations": [
                    {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                    {"key": contracts.TAINT_LENT, "operator": "Exists", "effect": "NoSchedule"},
                ],
            },
        )
        for t in q
    ]
    cluster_queues = [
        obj(
            "ClusterQueue",
            names[size],
            {
                "cohortName": f"{cn}-gpu",
                "namespaceSelector": {},
                "queueingStrategy": "BestEffortFIFO",
                "resourceGroups": [
                    {
                        "coveredResources": [GPU],
                        "flavors": [{"name": f"{cn}-{t}", "resources": [limits(quota[idx])]} for t, quota in q.items()],
                    }
                ],
                "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"},
            },
        )
        for idx, size in enumerate(SIZES)
    ]
    local_queues = [
        obj("LocalQueue", size, {"clusterQueue": names[size]}, ns) for ns in a["namespaces"] for size in SIZES
    ]
    return {"flavors": flavors, "cluster_queues": cluster_queues, "local_queues": local_queues}


def queue_names(cluster_name: str) -> dict[str, str]:
    """Queue size -> its ClusterQueue's name (each namespace's LocalQueue is named after the size)."""
    return {size: f"{cluster_name}-{size}" for size in SIZES}


class KueueQueues(pulumi.ComponentResource):
    queue_names: dict[str, str]

    def __init__(self, name: str, args: KueueQueuesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        rendered = manifests(args)
        super().__init__("fleetheal:kueue:KueueQueues", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.queue_names = queue_names(args["cluster_name"])

        def resource(res: str, doc: dict[str, Any], opts: pulumi.ResourceOptions) -> k8s.apiextensions.CustomResource:
            return k8s.apiextensions.CustomResource(
                res, api_version=doc["apiVersion"], kind=doc["kind"], metadata=doc["metadata"], spec=doc["spec"],
                opts=opts,
            )  # fmt: skip

        self.flavors = [
            resource(f"{name}-flavor-{doc['spec']['nodeLabels'][contracts.LABEL_GPU_TYPE]}", doc, child)
            for doc in rendered["flavors"]
        ]
        self.cluster_queues = [
            resource(f"{name}-cq-{size}", doc, pulumi.ResourceOptions(parent=self, depends_on=self.flavors))
            for size, doc in zip(SIZES, rendered["cluster_queues"], strict=True)
        ]
        labels = rendered["flavors"][0]["metadata"]["labels"]
        self.namespaces = []
        self.local_queues = []
        for ns in args["namespaces"]:
            nso = k8s.core.v1.Namespace(f"{name}-ns-{ns}", metadata={"name": ns, "labels": labels}, opts=child)
            self.namespaces.append(nso)
            for doc in rendered["local_queues"]:
                if doc["metadata"]["namespace"] == ns:
                    size = doc["metadata"]["name"]
                    after = pulumi.ResourceOptions(parent=self, depends_on=[nso, *self.cluster_queues])
                    self.local_queues.append(resource(f"{name}-lq-{ns}-{size}", doc, after))
        self.register_outputs({"cluster_queues": list(self.queue_names.values())})
