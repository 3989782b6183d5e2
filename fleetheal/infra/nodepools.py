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
from fleetheal.infra.config import GpuPool

COMPONENT = "GpuNodePools"
ACTIVE = "active"
STANDBY = "standby"


def node_labels(pool: GpuPool, role: str, failure_domain: str | None = None) -> dict[str, str]:
    out = {
        contracts.LABEL_POOL: role,
        contracts.LABEL_GPU_POOL: pool.name,
        contracts.LABEL_GPU_TYPE: pool.gpu_type,
    }
    if failure_domain is not None:
        out[contracts.LABEL_FAILURE_DOMAIN] = failure_domain
    return out


def failure_domain(pool: GpuPool, index: int, size: int) -> str:
    """Nodes are listed in rack order: every `size` consecutive nodes share a failure domain."""
    return f"{pool.name}-fd{index // size}"


class NodePoolProvider(Protocol):
    """Declares the nodes of one pool (active or standby) as Pulumi resources."""

    name: str

    def declare(self, pool: GpuPool, role: str, parent: pulumi.Resource) -> list[pulumi.Resource]: ...


class ExistingNodesProvider:
    """Nodes that already exist (bare metal, a pre-built cluster): only labels and taints are applied,
    with server-side-apply Node patches, so nothing else on the Node object is owned by Pulumi."""

    name = "existing"

    def __init__(self, failure_domain_size: int) -> None:
        self.failure_domain_size = common.positive("ExistingNodesProvider", "failure_domain_size", failure_domain_size)

    def declare(self, pool: GpuPool, role: str, parent: pulumi.Resource) -> list[pulumi.Resource]:
        names = pool.node_names if role == ACTIVE else pool.standby_node_names
        out: list[pulumi.Resource] = []
        for i, node in enumerate(names):
            metadata = {
                "name": node,
                "labels": node_labels(pool, role, failure_domain(pool, i, self.failure_domain_size)),
            }
            spec: dict[str, Any] = {}
            if role == STANDBY:
                spec["taints"] = [{"key": contracts.TAINT_STANDBY, "value": pool.name, "effect": "NoSchedule"}]
            out.append(
                k8s.core.v1.NodePatch(
                    f"{pool.name}-{role}-{node}",
                    metadata=metadata,
                    spec=spec or None,
                    # Pulumi sets the initial membership only; at promotion the remediator takes the
                    # labels and the taint over with its own field manager, and an unchanged stack
                    # does not re-apply these inputs.
                    opts=pulumi.ResourceOptions(parent=parent),
                )
            )
        return out


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

    def declare(self, pool: GpuPool, role: str, parent: pulumi.Resource) -> list[pulumi.Resource]:
        size = pool.nodes if role == ACTIVE else pool.standby_nodes
        props: dict[str, Any] = {
            "clusterName": self.cluster_name,
            "nodeGroupName": f"{pool.name}-{role}",
            "nodeRoleArn": self.node_role_arn,
            "subnetIds": list(self.subnet_ids),
            "instanceTypes": [pool.instance_type],
            "amiType": "AL2023_x86_64_NVIDIA",
            "scalingConfig": {"desiredSize": size, "minSize": size if role == ACTIVE else 0, "maxSize": size * 2},
            "labels": node_labels(pool, role, f"{pool.name}-{role}"),
            "tags": {"fleetheal.io/gpu-pool": pool.name, "fleetheal.io/pool": role},
        }
        if role == STANDBY:
            props["taints"] = [{"key": contracts.TAINT_STANDBY, "value": pool.name, "effect": "NO_SCHEDULE"}]
        resource = pulumi.CustomResource(
            self.TYPE,
            f"{pool.name}-{role}",
            props,
            # The remediator (refills) and the cluster autoscaler move the desired size; Pulumi must
            # not shrink a pool back to the declared size on the next `up`.
            opts=pulumi.ResourceOptions(parent=parent, ignore_changes=["scalingConfig.desiredSize"]),
        )
        return [resource]


def make_provider(kind: str, **kwargs: Any) -> NodePoolProvider:
    if kind == "existing":
        return ExistingNodesProvider(kwargs["failure_domain_size"])
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
        self.resources: dict[tuple[str, str], list[pulumi.Resource]] = {}
        for pool in pools:
            for role in (ACTIVE, STANDBY):
                self.resources[(pool.name, role)] = provider.declare(pool, role, self)
        self.register_outputs(
            {"pools": [p.name for p in pools], "standby_nodes": {p.name: p.standby_nodes for p in pools}}
        )
