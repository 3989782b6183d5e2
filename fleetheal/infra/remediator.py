"""Remediator: the Deployment that receives Alertmanager webhooks and runs the playbooks, its Service,
its configuration and least-privilege RBAC (nodes get/list/watch/patch, pods get/list, pods/eviction
create, NodeSets get/list/patch, and only its own token Secret).

Its incident store is either SQLite on a state PVC (one replica, the embedded default) or PostgreSQL:
the operator's database (a Secret holding the URI) or one this component deploys (a StatefulSet). With
PostgreSQL it runs `replicas` pods on different nodes that elect one leader through a coordination.k8s.io
Lease, so the remediator survives the loss of its own node; it may then also read its store Secret and
get, create and update its Lease.

Its names, mount paths and YAML config are in fleetheal.infra.remediator_config; the store's kinds, the
check of the `store` argument and the in-cluster PostgreSQL in fleetheal.infra.remediator_store.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import pulumi
import pulumi_kubernetes as k8s
import yaml

from fleetheal.infra import common, remediator_store
from fleetheal.infra.remediator_config import (
    COMPONENT,
    CONFIG_MOUNT,
    FLEET_MOUNT,
    LEASE_NAME,
    NAME,
    PORT,
    STATE_DIR,
    STORE_MOUNT,
    TOKEN_MOUNT,
    WEBHOOK_PATH,
    remediator_config,
)
from fleetheal.infra.remediator_store import RemediatorStore

#: RemediatorArgs' NotRequired keys (with postponed annotations TypedDict counts every key as required).
_OPTIONAL = ("fleet_configmap", "lending")


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
    """Secret (key `token`) with the webhook bearer token; the only Secret it may read besides its store's."""
    nodes: dict[str, str]
    """Node name -> failure domain of every node it may act on (empty: learnt from node labels)."""
    dry_run: bool
    """Start in dry-run mode (records "would drain")."""
    standby_target: int
    """Nodes the warm-standby pools hold together: the remediator refills them to this (lifecycle.standby_target)."""
    replicas: int
    """Remediator pods (>= 1); more than one needs a PostgreSQL store (they elect a leader)."""
    store: RemediatorStore
    """Where the incident store lives (see RemediatorStore)."""
    fleet_configmap: NotRequired[str]
    """A federation member: the ConfigMap holding the fleet file (key fleet.yaml). The remediator mounts it and
    runs its cross-cluster failover stage (failover.enabled, slurm_cluster = cluster_name)."""
    monitoring_labels: dict[str, str]
    """Labels that make the Prometheus operator select the remediator's ServiceMonitor (its /metrics: the
    health alerts FleethealRemediatorUnreachable, ...Degraded, NoRemediatorActs read it)."""
    lending: NotRequired[dict[str, Any]]
    """{"pools": GPU pool -> {max_nodes, min_lent_s, reclaim_grace_s}, "namespaces": Kueue's}: the leader lends
    those pools' idle Slurm nodes to the pods those namespaces' queues admit, and takes them back
    (fleetheal.remediator.lending)."""
    membership: bool
    """Apply the GPU pools' membership ConfigMaps in `namespace` to the Nodes (existing-nodes provider):
    the remediator gets read access to ConfigMaps there and runs its membership controller."""


class Remediator(pulumi.ComponentResource):
    webhook_url: str

    def __init__(self, name: str, args: RemediatorArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, [k for k in RemediatorArgs.__annotations__ if k not in _OPTIONAL])
        fleet_cm = a.get("fleet_configmap")
        if fleet_cm is not None:
            common.dns_label(COMPONENT, "fleet_configmap", fleet_cm, 253)
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.dns_label(COMPONENT, "slurm_namespace", a["slurm_namespace"])
        common.dns_label(COMPONENT, "token_secret", a["token_secret"], 253)
        common.pinned_image(COMPONENT, "image", a["image"])
        if not isinstance(a["dry_run"], bool):
            raise common.ComponentArgError(f"{COMPONENT}.dry_run: {a['dry_run']!r} is not accepted; use true or false")
        if not isinstance(a["membership"], bool):
            raise common.ComponentArgError(
                f"{COMPONENT}.membership: {a['membership']!r} is not accepted; use true or false"
            )
        replicas = common.positive(COMPONENT, "replicas", a["replicas"])
        store = remediator_store.check_store(a["store"], replicas)
        shared = store["kind"] != "sqlite"
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
        self.secret_role, self.secret_binding = self._role(
            f"{name}-token",
            f"{NAME}-token",
            ns,
            labels,
            [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [a["token_secret"]], "verbs": ["get"]}],
        )
        if a["membership"]:  # the pools' membership ConfigMaps (fleetheal.infra.nodepools); Nodes: ClusterRole
            self.membership_role, self.membership_binding = self._role(
                f"{name}-membership",
                f"{NAME}-membership",
                ns,
                labels,
                [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}],
            )
        self.config_map = k8s.core.v1.ConfigMap(
            f"{name}-config",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            data={
                "remediator.yaml": yaml.safe_dump(
                    remediator_config(
                        a["cluster_name"],
                        a["nodes"],
                        a["dry_run"],
                        int(a["standby_target"]),
                        lease_namespace=ns if shared else None,
                        membership_namespace=ns if a["membership"] else None,
                        fleet_file=f"{FLEET_MOUNT}/fleet.yaml" if fleet_cm is not None else None,
                        lending=a.get("lending"),
                    ),
                    sort_keys=True,
                )
            },
            opts=child,
        )

        self.state: k8s.core.v1.PersistentVolumeClaim | None = None
        self.store_secret: k8s.core.v1.Secret | None = None
        self.database: k8s.apps.v1.StatefulSet | None = None
        self.disruption_budget: k8s.policy.v1.PodDisruptionBudget | None = None
        depends_on: list[pulumi.Resource] = [self.config_map]
        mounts: list[dict[str, Any]] = [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "token", "mountPath": TOKEN_MOUNT, "readOnly": True},
        ]
        volumes: list[dict[str, Any]] = [
            {"name": "config", "configMap": {"name": NAME}},
            {
                "name": "token",
                "secret": {"secretName": a["token_secret"], "items": [{"key": "token", "path": "token"}]},
            },
        ]
        if fleet_cm is not None:
            mounts.append({"name": "fleet", "mountPath": FLEET_MOUNT, "readOnly": True})
            volumes.append({"name": "fleet", "configMap": {"name": fleet_cm}})
        pod_extra: dict[str, Any] = {}
        container_extra: dict[str, Any] = {}
        if not shared:
            self.state = k8s.core.v1.PersistentVolumeClaim(
                f"{name}-state",
                metadata={"name": f"{NAME}-state", "namespace": ns, "labels": labels},
                spec={"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                # The incident store is the audit record: keep it when the stack is destroyed.
                opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True),
            )
            depends_on.append(self.state)
            # One writer for the SQLite incident store: never two pods at once, even during a rollout.
            strategy: dict[str, Any] = {"type": "Recreate"}
            state_volume: dict[str, Any] = {"persistentVolumeClaim": {"claimName": f"{NAME}-state"}}
        else:
            self.store_role, self.store_binding = self._role(
                f"{name}-store",
                f"{NAME}-store",
                ns,
                labels,
                [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [store["secret"]], "verbs": ["get"]}],
            )
            self.lease_role, self.lease_binding = self._role(
                f"{name}-lease",
                f"{NAME}-lease",
                ns,
                labels,
                [
                    {
                        "apiGroups": ["coordination.k8s.io"],
                        "resources": ["leases"],
                        "resourceNames": [LEASE_NAME],
                        "verbs": ["get", "update"],
                    },
                    # RBAC cannot limit create by name: the object does not exist when it is authorized.
                    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                ],
            )
            if store["kind"] == "postgres-in-cluster":
                self.store_secret, self.database_service, self.database = remediator_store.deploy_database(
                    self, name, ns, store
                )
                depends_on += [r for r in (self.store_secret, self.database) if r is not None]
            # maxUnavailable 0: a rollout adds the new pod (maxSurge 1) before it removes an old one, so the
            # replicas that can take over the Lease never drop below `replicas`; with one node short for the
            # surge pod the rollout waits, and the old pods keep serving.
            strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
            # Nothing durable on the pod: the incidents are in PostgreSQL; playbook runs are per attempt.
            state_volume = {"emptyDir": {}}
            mounts.append({"name": "store", "mountPath": STORE_MOUNT, "readOnly": True})
            volumes.append(
                {"name": "store", "secret": {"secretName": store["secret"], "items": [{"key": "url", "path": "url"}]}}
            )
            # The Lease holder's identity (leader_election.identity "").
            container_extra["env"] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
            # Never two replicas on one node (losing it would take both); across zones where there are any.
            pod_extra["affinity"] = {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": sel}, "topologyKey": "kubernetes.io/hostname"}
                    ],
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "labelSelector": {"matchLabels": sel},
                                "topologyKey": "topology.kubernetes.io/zone",
                            },
                        }
                    ],
                }
            }
            if replicas > 1:
                # A node drain may take one replica at a time; with one replica it would block every drain.
                self.disruption_budget = k8s.policy.v1.PodDisruptionBudget(
                    f"{name}-pdb",
                    metadata={"name": NAME, "namespace": ns, "labels": labels},
                    spec={"minAvailable": 1, "selector": {"matchLabels": sel}},
                    opts=child,
                )
        mounts += [
            {"name": "state", "mountPath": STATE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir, not the host's /tmp
        ]
        volumes += [{"name": "state", **state_volume}, {"name": "tmp", "emptyDir": {}}]

        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deploy",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={
                "replicas": replicas,
                "strategy": strategy,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": {**labels, **sel}},
                    "spec": {
                        "serviceAccountName": NAME,
                        **pod_extra,
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
                                **container_extra,
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
                                "volumeMounts": mounts,
                            }
                        ],
                        "volumes": volumes,
                    },
                },
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=depends_on),
        )
        self.service = k8s.core.v1.Service(
            f"{name}-svc",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={"selector": sel, "ports": [{"name": "webhook", "port": PORT, "targetPort": PORT}]},
            opts=child,
        )
        self.service_monitor = common.service_monitor(
            name,
            self,
            name=NAME,
            namespace=ns,
            labels={**labels, **a["monitoring_labels"]},
            selector=sel,
            port="webhook",  # /metrics is served beside the webhook
            relabelings=[{"action": "replace", "targetLabel": "cluster", "replacement": a["cluster_name"]}],
            depends_on=[self.service],
        )
        # The webhook from Alertmanager, /metrics from Prometheus, /healthz and the API from operators' namespaces.
        self.network_policy = common.network_policy(
            name,
            self,
            name=NAME,
            namespace=ns,
            labels=labels,
            selector=sel,
            port=PORT,
            sources=[common.ALERTMANAGER_PODS, common.PROMETHEUS_PODS, common.OPERATOR_NAMESPACES],
        )
        self.register_outputs({"webhook_url": self.webhook_url})

    def _role(
        self, resource_name: str, name: str, ns: str, labels: dict[str, str], rules: list[dict[str, Any]]
    ) -> tuple[k8s.rbac.v1.Role, k8s.rbac.v1.RoleBinding]:
        """A Role in the remediator's namespace and its binding to the remediator's ServiceAccount."""
        child = pulumi.ResourceOptions(parent=self)
        role = k8s.rbac.v1.Role(
            resource_name, metadata={"name": name, "namespace": ns, "labels": labels}, rules=rules, opts=child
        )
        binding = k8s.rbac.v1.RoleBinding(
            f"{resource_name}-binding",
            metadata={"name": name, "namespace": ns, "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
            opts=child,
        )
        return role, binding
