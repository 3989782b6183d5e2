"""What the remediator is called and configured with in a stack: its names, port and mount paths, and
the YAML config its pods read (fleetheal/remediator/config.py's schema). Plain data: the component
(fleetheal.infra.remediator) mounts it; the policy pack's tests build stacks from it.
"""

from __future__ import annotations

from typing import Any

COMPONENT = "Remediator"
NAME = "fleetheal-remediator"
PORT = 9105  # fleetheal.remediator.config.ListenConfig.port
WEBHOOK_PATH = "/webhook"  # fleetheal.remediator.app.WEBHOOK_PATH (a test keeps them equal)
TOKEN_MOUNT = "/var/run/secrets/fleetheal"  # noqa: S105 - a mount path
STORE_MOUNT = "/var/run/secrets/fleetheal-store"
CONFIG_MOUNT = "/etc/fleetheal"
#: Where a federation member's fleet file (the ConfigMap fleetheal-fleet) is mounted: cross-cluster failover.
FLEET_MOUNT = "/etc/fleetheal/fleet"
STATE_DIR = "/var/lib/fleetheal"
LEASE_NAME = NAME


def remediator_config(
    cluster: str,
    nodes: dict[str, str],
    dry_run: bool,
    standby_target: int = 0,
    *,
    lease_namespace: str | None = None,
    membership_namespace: str | None = None,
    fleet_file: str | None = None,
    lending: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The remediator's YAML config (fleetheal/remediator/config.py schema).

    `lease_namespace` set: the store is PostgreSQL (the URI in the mounted store Secret) and the replicas
    elect a leader through the Lease LEASE_NAME there; None: SQLite in the state directory.
    `membership_namespace` set: the leader applies the pool membership ConfigMaps there to the Nodes.
    `fleet_file` set (its path in the pod): cross-cluster failover is on, for this cluster of the federation.
    `lending` set ({"pools": GPU pool -> max_nodes, min_lent_s, reclaim_grace_s; "namespaces": Kueue's}): the
    leader lends those pools' idle nodes to the pods those namespaces' queues admit.
    """
    cfg: dict[str, Any] = {
        "cluster": {"name": cluster, "nodes": dict(sorted(nodes.items()))},
        "listen": {"host": "0.0.0.0", "port": PORT},  # noqa: S104 - a Service fronts the pod
        "auth": {"token_file": f"{TOKEN_MOUNT}/token"},
        "store": {"path": f"{STATE_DIR}/remediator.sqlite"},
        "runner": {"run_dir": f"{STATE_DIR}/runs"},
        "gate": {"dry_run": dry_run},
        "lifecycle": {"standby_target": standby_target, "report_dir": f"{STATE_DIR}/lifecycle"},
    }
    if lease_namespace is not None:
        cfg["store"] = {"url_file": f"{STORE_MOUNT}/url"}
        # identity "" is $POD_NAME (the Deployment sets it); the timings are the remediator's defaults.
        cfg["leader_election"] = {"enabled": True, "namespace": lease_namespace, "lease_name": LEASE_NAME}
    if membership_namespace is not None:
        cfg["membership"] = {"enabled": True, "namespace": membership_namespace}
    if lending:
        cfg["lending"] = {
            "enabled": True,
            "pools": {k: dict(v) for k, v in sorted(lending["pools"].items())},
            "namespaces": sorted(lending["namespaces"]),
        }
    if fleet_file is not None:
        cfg["failover"] = {"enabled": True, "fleet_file": fleet_file, "slurm_cluster": cluster}
    return cfg
