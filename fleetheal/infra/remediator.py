"""Remediator: the Deployment that receives Alertmanager webhooks and runs the playbooks, its Service,
its configuration and least-privilege RBAC (nodes get/list/watch/patch, pods get/list, pods/eviction
create, NodeSets get/list/patch, and only its own token Secret).

Its incident store is either SQLite on a state PVC (one replica, the embedded default) or PostgreSQL:
the operator's database (a Secret holding the URI) or one this component deploys (a StatefulSet). With
PostgreSQL it runs `replicas` pods on different nodes that elect one leader through a coordination.k8s.io
Lease, so the remediator survives the loss of its own node; it may then also read its store Secret and
get, create and update its Lease.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, Required, TypedDict
from urllib.parse import quote

import pulumi
import pulumi_kubernetes as k8s
import yaml

from fleetheal.infra import common

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
#: How the incident store is kept: SQLite on a PVC; the operator's PostgreSQL; a PostgreSQL deployed here.
STORES = ("sqlite", "postgres", "postgres-in-cluster")
_STORE_FIELDS = {
    "sqlite": ("kind",),
    "postgres": ("kind", "secret"),
    "postgres-in-cluster": ("kind", "secret", "image", "size", "password"),
}
DB_NAME = f"{NAME}-db"
DB_PORT = 5432
DB_USER = "fleetheal"
DB_DATABASE = "fleetheal"
#: The postgres image's user and group (uid 999 in the Debian-based official image).
DB_UID = 999
DB_DATA = "/var/lib/postgresql/data"


class RemediatorStore(TypedDict, total=False):
    kind: Required[str]
    """One of STORES: sqlite (a state PVC, exactly one replica), postgres, postgres-in-cluster."""
    secret: str
    """postgres, postgres-in-cluster: Secret in the namespace whose key `url` holds the libpq URI
    (postgresql://user:password@host:5432/db?sslmode=...); postgres-in-cluster: and key `password`."""
    image: str
    """postgres-in-cluster: pinned PostgreSQL image."""
    size: str
    """postgres-in-cluster: size of the database volume (a Kubernetes quantity)."""
    password: Any
    """postgres-in-cluster: the database password (a secret Output); the `secret` Secret is built from it.
    None: that Secret must exist already."""


#: RemediatorArgs' NotRequired keys (with postponed annotations TypedDict counts every key as required).
_OPTIONAL = ("fleet_configmap",)


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
    membership: bool
    """Apply the GPU pools' membership ConfigMaps in `namespace` to the Nodes (existing-nodes provider):
    the remediator gets read access to ConfigMaps there and runs its membership controller."""


def remediator_config(
    cluster: str,
    nodes: dict[str, str],
    dry_run: bool,
    standby_target: int = 0,
    *,
    lease_namespace: str | None = None,
    membership_namespace: str | None = None,
    fleet_file: str | None = None,
) -> dict[str, Any]:
    """The remediator's YAML config (fleetheal/remediator/config.py schema).

    `lease_namespace` set: the store is PostgreSQL (the URI in the mounted store Secret) and the replicas
    elect a leader through the Lease LEASE_NAME there; None: SQLite in the state directory.
    `membership_namespace` set: the leader applies the pool membership ConfigMaps there to the Nodes.
    `fleet_file` set (its path in the pod): cross-cluster failover is on, for this cluster of the federation.
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
    if fleet_file is not None:
        cfg["failover"] = {"enabled": True, "fleet_file": fleet_file, "slurm_cluster": cluster}
    return cfg


def _store(value: Any, replicas: int) -> dict[str, Any]:
    """The checked `store` argument."""
    if not isinstance(value, Mapping) or "kind" not in value:
        raise common.ComponentArgError(
            f"{COMPONENT}.store: {value!r} is not accepted; use a mapping with `kind` (one of: {', '.join(STORES)})"
        )
    kind = common.one_of(COMPONENT, "store.kind", value["kind"], STORES)
    accepted = _STORE_FIELDS[kind]
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise common.ComponentArgError(
            f"{COMPONENT}.store: unknown field(s) {', '.join(unknown)} for kind {kind}; "
            f"accepted fields: {', '.join(accepted)}"
        )
    missing = [f for f in accepted if f != "password" and value.get(f) is None]
    if missing:
        raise common.ComponentArgError(f"{COMPONENT}.store: missing field(s) {', '.join(missing)} for kind {kind}")
    if kind == "sqlite" and replicas > 1:
        raise common.ComponentArgError(
            f"{COMPONENT}.replicas: {replicas} is not accepted with store kind sqlite: SQLite lives on one pod's "
            "volume and serves exactly 1 replica; use replicas 1, or store kind postgres or postgres-in-cluster"
        )
    if kind != "sqlite":
        common.dns_label(COMPONENT, "store.secret", value["secret"], 253)
    if kind == "postgres-in-cluster":
        common.pinned_image(COMPONENT, "store.image", value["image"])
        common.quantity(COMPONENT, "store.size", value["size"])
        password = value.get("password")
        if (
            password is not None
            and not isinstance(password, pulumi.Output)
            and not (isinstance(password, str) and password)
        ):
            raise common.ComponentArgError(
                f"{COMPONENT}.store.password: not accepted; use a non-empty string or a secret Output "
                "(or leave it unset when the store Secret exists already)"
            )
    return dict(value)


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
        store = _store(a["store"], replicas)
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
                depends_on += self._deploy_database(name, ns, store)
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

    def _deploy_database(self, name: str, ns: str, store: dict[str, Any]) -> list[pulumi.Resource]:
        """The PostgreSQL the replicas share (store kind postgres-in-cluster): a one-pod StatefulSet, its
        headless Service and, from the password, the Secret with the password and the remediator's URI.
        Returns what the remediator's pods need first."""
        child = pulumi.ResourceOptions(parent=self)
        labels = common.labels("remediator-db", DB_NAME)
        sel = {"app.kubernetes.io/name": DB_NAME}
        secret = store["secret"]
        if store.get("password") is not None:
            password = pulumi.Output.secret(store["password"])
            host = common.cluster_dns(DB_NAME, ns)
            # sslmode=disable: this server has no certificate and the traffic stays in the cluster network;
            # for TLS use store kind postgres with a database whose URI says sslmode=verify-full.
            url = password.apply(
                lambda pw: f"postgresql://{DB_USER}:{quote(pw, safe='')}@{host}:{DB_PORT}/{DB_DATABASE}?sslmode=disable"
            )
            self.store_secret = k8s.core.v1.Secret(
                f"{name}-store-secret",
                metadata={"name": secret, "namespace": ns, "labels": labels},
                string_data={"url": url, "password": password},
                opts=child,
            )
        self.database_service = k8s.core.v1.Service(
            f"{name}-db-svc",
            metadata={"name": DB_NAME, "namespace": ns, "labels": labels},
            spec={
                "clusterIP": "None",
                "selector": sel,
                "ports": [{"name": "postgres", "port": DB_PORT, "targetPort": DB_PORT}],
            },
            opts=child,
        )
        self.database = k8s.apps.v1.StatefulSet(
            f"{name}-db",
            metadata={"name": DB_NAME, "namespace": ns, "labels": labels},
            spec={
                "serviceName": DB_NAME,
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": {**labels, **sel}},
                    "spec": {
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": DB_UID,
                            "runAsGroup": DB_UID,
                            "fsGroup": DB_UID,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "postgres",
                                "image": store["image"],
                                "env": [
                                    {"name": "POSTGRES_USER", "value": DB_USER},
                                    {"name": "POSTGRES_DB", "value": DB_DATABASE},
                                    {
                                        "name": "POSTGRES_PASSWORD",
                                        "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}},
                                    },
                                    # initdb wants an empty directory; a fresh volume's root may hold lost+found
                                    # (the postgres image's documentation, "PGDATA").
                                    {"name": "PGDATA", "value": f"{DB_DATA}/pgdata"},
                                ],
                                "ports": [{"name": "postgres", "containerPort": DB_PORT}],
                                # Over TCP: the image's first-start server listens on its socket only, so the
                                # pod is ready once the real server is.
                                "readinessProbe": {
                                    "exec": {
                                        "command": ["pg_isready", "-h", "127.0.0.1", "-U", DB_USER, "-d", DB_DATABASE]
                                    }
                                },
                                "resources": {
                                    "requests": {"cpu": "250m", "memory": "256Mi"},
                                    "limits": {"memory": "1Gi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "data", "mountPath": DB_DATA},
                                    {"name": "run", "mountPath": "/var/run/postgresql"},
                                    {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir
                                ],
                            }
                        ],
                        "volumes": [{"name": "run", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                    },
                },
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "data"},
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": store["size"]}},
                        },
                    }
                ],
                # The incident store is the audit record: its claim outlives the StatefulSet.
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
            },
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=[r for r in (self.database_service, self.store_secret) if r is not None]
            ),
        )
        return [r for r in (self.store_secret, self.database) if r is not None]
