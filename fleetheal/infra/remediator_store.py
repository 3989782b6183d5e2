"""The remediator's incident store: its kinds (SQLite on a state volume, the operator's PostgreSQL, a
PostgreSQL deployed in the cluster), the check of the Remediator component's `store` argument, and the
objects of the in-cluster PostgreSQL the replicas share. fleetheal.infra.remediator builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Required, TypedDict
from urllib.parse import quote

import pulumi
import pulumi_kubernetes as k8s

from fleetheal.infra import common
from fleetheal.infra.remediator_config import COMPONENT, NAME
from fleetheal.infra.stack_model import REMEDIATOR_STORES

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
    """One of REMEDIATOR_STORES: sqlite (a state PVC, exactly one replica), postgres, postgres-in-cluster."""
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


def check_store(value: Any, replicas: int) -> dict[str, Any]:
    """The checked `store` argument."""
    if not isinstance(value, Mapping) or "kind" not in value:
        raise common.ComponentArgError(
            f"{COMPONENT}.store: {value!r} is not accepted; use a mapping with `kind` "
            f"(one of: {', '.join(REMEDIATOR_STORES)})"
        )
    kind = common.one_of(COMPONENT, "store.kind", value["kind"], REMEDIATOR_STORES)
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


def deploy_database(
    parent: pulumi.ComponentResource, name: str, ns: str, store: dict[str, Any]
) -> tuple[k8s.core.v1.Secret | None, k8s.core.v1.Service, k8s.apps.v1.StatefulSet]:
    """The PostgreSQL the replicas share (store kind postgres-in-cluster): a one-pod StatefulSet, its
    headless Service and, from the password, the Secret with the password and the remediator's URI.
    Returns the Secret (None when it exists already), the Service and the StatefulSet."""
    child = pulumi.ResourceOptions(parent=parent)
    labels = common.labels("remediator-db", DB_NAME)
    sel = {"app.kubernetes.io/name": DB_NAME}
    secret = store["secret"]
    store_secret: k8s.core.v1.Secret | None = None
    if store.get("password") is not None:
        password = pulumi.Output.secret(store["password"])
        host = common.cluster_dns(DB_NAME, ns)
        # sslmode=disable: this server has no certificate and the traffic stays in the cluster network;
        # for TLS use store kind postgres with a database whose URI says sslmode=verify-full.
        url = password.apply(
            lambda pw: f"postgresql://{DB_USER}:{quote(pw, safe='')}@{host}:{DB_PORT}/{DB_DATABASE}?sslmode=disable"
        )
        store_secret = k8s.core.v1.Secret(
            f"{name}-store-secret",
            metadata={"name": secret, "namespace": ns, "labels": labels},
            string_data={"url": url, "password": password},
            opts=child,
        )
    database_service = k8s.core.v1.Service(
        f"{name}-db-svc",
        metadata={"name": DB_NAME, "namespace": ns, "labels": labels},
        spec={
            "clusterIP": "None",
            "selector": sel,
            "ports": [{"name": "postgres", "port": DB_PORT, "targetPort": DB_PORT}],
        },
        opts=child,
    )
    database = k8s.apps.v1.StatefulSet(
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
                                "exec": {"command": ["pg_isready", "-h", "127.0.0.1", "-U", DB_USER, "-d", DB_DATABASE]}
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
            parent=parent, depends_on=[r for r in (database_service, store_secret) if r is not None]
        ),
    )
    return store_secret, database_service, database
