"""Remediator: the Deployment that receives Alertmanager webhooks and runs the playbooks, its Service,
its configuration and least-privilege RBAC (nodes get/list/watch/patch, pods get/list, pods/eviction
create, NodeSets get/list/patch, and only its own token Secret)."""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s
import yaml

from fleetheal.infra import common

COMPONENT = "Remediator"
NAME = "fleetheal-remediator"
PORT = 9105  # fleetheal.remediator.config.ListenConfig.port
WEBHOOK_PATH = "/webhook"  # fleetheal.remediator.app.WEBHOOK_PATH (a test keeps them equal)
TOKEN_MOUNT = "/var/run/secrets/fleetheal"  # noqa: S105 - a mount path
CONFIG_MOUNT = "/etc/fleetheal"
STATE_DIR = "/var/lib/fleetheal"


class RemediatorArgs(TypedDict):
    namespace: str
    """Namespace of the remediator (the fleetheal system namespace; must exist)."""
    image: str
    """Pinned remediator image."""
    cluster_name: str
    """Cluster name (alerts' `cluster` label)."""
    slurm_namespace: str
    """Namespace of the Slinky NodeSets the remediator may patch."""
    token_secret: str
    """Secret (key `token`) with the webhook bearer token; the only Secret it may read."""
    nodes: dict[str, str]
    """Node name -> failure domain of every node it may act on (empty: learnt from node labels)."""
    dry_run: bool
    """Start in dry-run mode (records "would drain")."""
    standby_target: int
    """Nodes the warm-standby pools hold together: the remediator refills them to this (lifecycle.standby_target)."""


def remediator_config(cluster: str, nodes: dict[str, str], dry_run: bool, standby_target: int = 0) -> dict[str, Any]:
    """The remediator's YAML config (fleetheal/remediator/config.py schema)."""
    return {
        "cluster": {"name": cluster, "nodes": dict(sorted(nodes.items()))},
        "listen": {"host": "0.0.0.0", "port": PORT},  # noqa: S104 - a Service fronts the pod
        "auth": {"token_file": f"{TOKEN_MOUNT}/token"},
        "store": {"path": f"{STATE_DIR}/remediator.sqlite"},
        "runner": {"run_dir": f"{STATE_DIR}/runs"},
        "gate": {"dry_run": dry_run},
        "lifecycle": {"standby_target": standby_target, "report_dir": f"{STATE_DIR}/lifecycle"},
    }


class Remediator(pulumi.ComponentResource):
    webhook_url: str

    def __init__(self, name: str, args: RemediatorArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(
            a,
            COMPONENT,
            (
                "namespace",
                "image",
                "cluster_name",
                "slurm_namespace",
                "token_secret",
                "nodes",
                "dry_run",
                "standby_target",
            ),
        )
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.dns_label(COMPONENT, "slurm_namespace", a["slurm_namespace"])
        common.dns_label(COMPONENT, "token_secret", a["token_secret"], 253)
        common.pinned_image(COMPONENT, "image", a["image"])
        if not isinstance(a["dry_run"], bool):
            raise common.ComponentArgError(f"{COMPONENT}.dry_run: {a['dry_run']!r} is not accepted; use true or false")
        super().__init__("fleetheal:remediator:Remediator", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = common.labels("remediator", NAME)
        sel = {"app.kubernetes.io/name": NAME}
        self.webhook_url = f"http://{common.cluster_dns(NAME, ns)}:{PORT}{WEBHOOK_PATH}"

        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata={"name": NAME, "namespace": ns, "labels": labels}, opts=child
        )
        self.cluster_role = k8s.rbac.v1.ClusterRole(
            f"{name}-clusterrole",
            metadata={"name": NAME, "labels": labels},
            rules=[
                # cordon, taint, relabel (promote a standby node), read failure domains
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
                # find the pods on a node to evict them
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                # drain through the Eviction API so PodDisruptionBudgets are honoured
                {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
            ],
            opts=child,
        )
        self.cluster_binding = k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-clusterbinding",
            metadata={"name": NAME, "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
            opts=child,
        )
        self.nodeset_role = k8s.rbac.v1.Role(
            f"{name}-nodesets",
            metadata={"name": NAME, "namespace": a["slurm_namespace"], "labels": labels},
            rules=[{"apiGroups": ["slinky.slurm.net"], "resources": ["nodesets"], "verbs": ["get", "list", "patch"]}],
            opts=child,
        )
        self.nodeset_binding = k8s.rbac.v1.RoleBinding(
            f"{name}-nodesets-binding",
            metadata={"name": NAME, "namespace": a["slurm_namespace"], "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
            opts=child,
        )
        self.secret_role = k8s.rbac.v1.Role(
            f"{name}-token",
            metadata={"name": f"{NAME}-token", "namespace": ns, "labels": labels},
            rules=[
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [a["token_secret"]], "verbs": ["get"]}
            ],
            opts=child,
        )
        self.secret_binding = k8s.rbac.v1.RoleBinding(
            f"{name}-token-binding",
            metadata={"name": f"{NAME}-token", "namespace": ns, "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{NAME}-token"},
            subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
            opts=child,
        )
        self.config_map = k8s.core.v1.ConfigMap(
            f"{name}-config",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            data={
                "remediator.yaml": yaml.safe_dump(
                    remediator_config(a["cluster_name"], a["nodes"], a["dry_run"], int(a["standby_target"])),
                    sort_keys=True,
                )
            },
            opts=child,
        )
        self.state = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-state",
            metadata={"name": f"{NAME}-state", "namespace": ns, "labels": labels},
            spec={"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
            # The incident store is the audit record: keep it when the stack is destroyed.
            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True),
        )
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deploy",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={
                "replicas": 1,
                # One writer for the SQLite incident store: never two pods at once, even during a rollout.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": {**labels, **sel}},
                    "spec": {
                        "serviceAccountName": NAME,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65532,
                            "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "remediator",
                                "image": a["image"],
                                "args": ["remediator", "serve", "--config", f"{CONFIG_MOUNT}/remediator.yaml"],
                                "ports": [{"name": "webhook", "containerPort": PORT}],
                                "readinessProbe": {"httpGet": {"path": "/healthz", "port": PORT}},
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "256Mi"},
                                    "limits": {"cpu": "2", "memory": "1Gi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                                    {"name": "token", "mountPath": TOKEN_MOUNT, "readOnly": True},
                                    {"name": "state", "mountPath": STATE_DIR},
                                    {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir, not the host's /tmp
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": NAME}},
                            {
                                "name": "token",
                                "secret": {
                                    "secretName": a["token_secret"],
                                    "items": [{"key": "token", "path": "token"}],
                                },
                            },
                            {"name": "state", "persistentVolumeClaim": {"claimName": f"{NAME}-state"}},
                            {"name": "tmp", "emptyDir": {}},
                        ],
                    },
                },
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.config_map, self.state]),
        )
        self.service = k8s.core.v1.Service(
            f"{name}-svc",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={"selector": sel, "ports": [{"name": "webhook", "port": PORT, "targetPort": PORT}]},
            opts=child,
        )
        self.register_outputs({"webhook_url": self.webhook_url})
