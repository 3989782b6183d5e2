"""GpuNodePools: GPU pools and their warm-standby pools, behind a node-pool provider interface.

Every node carries `fleetheal.io/pool` (active | standby), `fleetheal.io/gpu-pool`,
`fleetheal.io/gpu-type` and, where the provider knows it, `fleetheal.io/failure-domain`. Standby
nodes also carry the `fleetheal.io/standby` NoSchedule taint, so nothing but the node agents runs
on them until the remediator promotes one (relabels it active, removes the taint) and the pool's
NodeSet (a DaemonSet-mode NodeSet selecting active nodes of the pool) starts slurmd there.
"""

from __future__ import annotations

from typing import Any, Protocol, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal import contracts
from fleetheal.infra import common
from fleetheal.infra.stack_model import GpuPool

COMPONENT = "GpuNodePools"
ACTIVE = "active"
STANDBY = "standby"


def failure_domain(pool: GpuPool, index: int, size: int) -> str:
    """Nodes are listed in rack order: every `size` consecutive nodes share a failure domain."""
    return f"{pool.name}-fd{index // size}"


class NodePoolProvider(Protocol):
    """Declares the nodes of one GPU pool (its active and its standby nodes) as Pulumi resources."""

    name: str

    def declare(self, pool: GpuPool, parent: pulumi.Resource) -> list[pulumi.Resource]: ...


def membership_data(pool: GpuPool, failure_domain_size: int) -> dict[str, str]:
    """Node name -> "<role> <failure domain>" for every node of `pool` (contracts.membership_entry)."""
    data: dict[str, str] = {}
    for role, names in ((ACTIVE, pool.node_names), (STANDBY, pool.standby_node_names)):
        for i, node in enumerate(names):
            data[node] = contracts.membership_entry(role, failure_domain(pool, i, failure_domain_size))
    return data


class ExistingNodesProvider:
    """Nodes that already exist (bare metal, a pre-built cluster): one membership ConfigMap per pool.

    The stack grows with the number of pools, not of nodes. The remediator's membership controller
    (fleetheal.remediator.membership) applies each member's labels and standby taint to its Node, with
    its own field manager, at registration and whenever the node's entry changes; Pulumi owns no field
    of any Node, so it never fights the remediator's promotions.
    """

    name = "existing"

    def __init__(self, failure_domain_size: int, namespace: str) -> None:
        self.failure_domain_size = common.positive("ExistingNodesProvider", "failure_domain_size", failure_domain_size)
        if not namespace:
            raise common.ComponentArgError("ExistingNodesProvider: namespace (the system namespace) is required")
        self.namespace = namespace

    def declare(self, pool: GpuPool, parent: pulumi.Resource) -> list[pulumi.Resource]:
        data = membership_data(pool, self.failure_domain_size)
        size = sum(len(k) + len(v) for k, v in data.items())
        if size > contracts.MEMBERSHIP_MAX_BYTES:
            raise common.ComponentArgError(
                f"{COMPONENT}.pools: pool {pool.name!r} lists {len(data)} nodes ({size:,} bytes of membership); "
                f"a pool's membership must stay under {contracts.MEMBERSHIP_MAX_BYTES:,} bytes (one ConfigMap). "
                "Split the pool."
            )
        name = contracts.membership_configmap(pool.name)
        labels = {
            **common.labels("pool-membership", name),
            contracts.LABEL_MEMBERSHIP: pool.name,
            contracts.LABEL_GPU_POOL: pool.name,
            contracts.LABEL_GPU_TYPE: pool.gpu_type,
        }
        configmap = k8s.core.v1.ConfigMap(
            f"{pool.name}-membership",
            metadata={"name": name, "namespace": self.namespace, "labels": labels},
            data=data,
            opts=pulumi.ResourceOptions(parent=parent),
        )
        return [configmap]


class EksNodeGroupProvider:
    """AWS EKS managed node groups: one per GPU pool and one per standby pool. The standby group's
    desired size is the refill knob: the remediator raises it after a promotion."""

    name = "eks"
    TYPE = "aws:eks/nodeGroup:NodeGroup"

    def __init__(self, cluster_name: str, node_role_arn: str, subnet_ids: tuple[str, ...]) -> None:
        if not cluster_name or not node_role_arn or not subnet_ids:
            raise common.ComponentArgError(
                "EksNodeGroupProvider: cluster_name, node_role_arn and subnet_ids are required"
            )
        self.cluster_name = cluster_name
        self.node_role_arn = node_role_arn
        self.subnet_ids = subnet_ids

    def declare(self, pool: GpuPool, parent: pulumi.Resource) -> list[pulumi.Resource]:
        return [self._group(pool, role, parent) for role in (ACTIVE, STANDBY)]

    def _group(self, pool: GpuPool, role: str, parent: pulumi.Resource) -> pulumi.Resource:
        size = pool.nodes if role == ACTIVE else pool.standby_nodes
        props: dict[str, Any] = {
            "clusterName": self.cluster_name,
            "nodeGroupName": f"{pool.name}-{role}",
            "nodeRoleArn": self.node_role_arn,
            "subnetIds": list(self.subnet_ids),
            "instanceTypes": [pool.instance_type],
            "amiType": "AL2023_x86_64_NVIDIA",
            "scalingConfig": {"desiredSize": size, "minSize": size if role == ACTIVE else 0, "maxSize": size * 2},
            "labels": contracts.member_node(pool.name, pool.gpu_type, role, f"{pool.name}-{role}")[0],
            "tags": {"fleetheal.io/gpu-pool": pool.name, "fleetheal.io/pool": role},
        }
        if role == STANDBY:
            props["taints"] = [{"key": contracts.TAINT_STANDBY, "value": pool.name, "effect": "NO_SCHEDULE"}]
        return pulumi.CustomResource(
            self.TYPE,
            f"{pool.name}-{role}",
            props,
            # The remediator (refills) and the cluster autoscaler move the desired size; Pulumi must
            # not shrink a pool back to the declared size on the next `up`.
            opts=pulumi.ResourceOptions(parent=parent, ignore_changes=["scalingConfig.desiredSize"]),
        )


def make_provider(kind: str, **kwargs: Any) -> NodePoolProvider:
    if kind == "existing":
        return ExistingNodesProvider(kwargs["failure_domain_size"], kwargs["namespace"])
    if kind == "eks":
        return EksNodeGroupProvider(kwargs["cluster_name"], kwargs["node_role_arn"], tuple(kwargs["subnet_ids"]))
    raise common.ComponentArgError(f"{COMPONENT}.provider: {kind!r} is not accepted; use one of: existing, eks")


class GpuNodePoolsArgs(TypedDict):
    pools: tuple[GpuPool, ...]
    """GPU pools from the stack config (each with its active and standby node counts)."""
    provider: NodePoolProvider
    """Where the nodes come from (ExistingNodesProvider, EksNodeGroupProvider)."""


class GpuNodePools(pulumi.ComponentResource):
    """Declares every GPU pool's active and warm-standby nodes through one provider."""

    def __init__(self, name: str, args: GpuNodePoolsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        pools = args.get("pools")
        provider = args.get("provider")
        if not pools:
            raise common.ComponentArgError(f"{COMPONENT}.pools: at least one GPU pool is required")
        if provider is None or not hasattr(provider, "declare"):
            raise common.ComponentArgError(
                f"{COMPONENT}.provider: required; use ExistingNodesProvider or EksNodeGroupProvider"
            )
        for pool in pools:
            if pool.standby_nodes < 1:
                raise common.ComponentArgError(
                    f"{COMPONENT}.pools: pool {pool.name!r} has no warm-standby node; at least 1 is required"
                )
        super().__init__("fleetheal:nodepools:GpuNodePools", name, None, opts)
        self.resources: dict[str, list[pulumi.Resource]] = {pool.name: provider.declare(pool, self) for pool in pools}
        self.register_outputs(
            {"pools": [p.name for p in pools], "standby_nodes": {p.name: p.standby_nodes for p in pools}}
        )
