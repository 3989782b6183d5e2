"""SharedStorage: the ReadWriteMany volume for home directories and checkpoints."""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal.infra import common

COMPONENT = "SharedStorage"


class SharedStorageArgs(TypedDict):
    namespace: str
    """Namespace of the claim (the Slurm namespace: slurmd and login pods mount it)."""
    storage_class: str
    """StorageClass that provisions ReadWriteMany volumes (NFS, Lustre CSI, a cloud file store)."""
    size: str
    """Requested size, a Kubernetes quantity such as 10Ti."""
    claim_name: str
    """Name of the PersistentVolumeClaim."""


class SharedStorage(pulumi.ComponentResource):
    """A ReadWriteMany PersistentVolumeClaim: checkpoints must be readable from whichever node a
    requeued job lands on, so a single-node (ReadWriteOnce) volume would defeat relocation."""

    claim_name: str

    def __init__(self, name: str, args: SharedStorageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, ("namespace", "storage_class", "size", "claim_name"))
        common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.dns_label(COMPONENT, "claim_name", a["claim_name"], 253)
        if not a["storage_class"]:
            raise common.ComponentArgError(f"{COMPONENT}.storage_class: required; name a ReadWriteMany StorageClass")
        super().__init__("fleetheal:storage:SharedStorage", name, None, opts)
        self.claim_name = a["claim_name"]
        size: str = a["size"]
        self.claim = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-claim",
            metadata={
                "name": str(a["claim_name"]),
                "namespace": str(a["namespace"]),
                "labels": common.labels("storage", a["claim_name"]),
            },
            spec={
                "accessModes": ["ReadWriteMany"],  # checkpoints must be readable from any node
                "storageClassName": str(a["storage_class"]),
                "resources": {"requests": {"storage": size}},
            },
            # Checkpoints and home directories outlive the stack: `pulumi destroy` leaves the claim.
            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True),
        )
        self.register_outputs({"claim_name": self.claim_name})
