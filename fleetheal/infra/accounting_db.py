"""AccountingDatabase: the MariaDB that slurmdbd (the Slinky Accounting) writes job records to."""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal.infra import common

COMPONENT = "AccountingDatabase"
PORT = 3306


class AccountingDatabaseArgs(TypedDict):
    namespace: str
    """Namespace (the Slurm namespace; must exist)."""
    service_name: str
    """Service name slurmdbd connects to (its storageConfig.host)."""
    image: str
    """Pinned MariaDB image."""
    password_secret: str
    """Secret (key `password`) with the password of the database user `slurm` (must exist)."""
    size: str
    """Size of the data volume."""


class AccountingDatabase(pulumi.ComponentResource):
    def __init__(self, name: str, args: AccountingDatabaseArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, AccountingDatabaseArgs.__annotations__)
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        svc = common.dns_label(COMPONENT, "service_name", a["service_name"])
        common.dns_label(COMPONENT, "password_secret", a["password_secret"], 253)
        common.pinned_image(COMPONENT, "image", a["image"])
        super().__init__("fleetheal:accounting:AccountingDatabase", name, None, opts)
        labels = common.labels("accounting-db", svc)
        sel = {"app.kubernetes.io/name": svc}
        password = {"secretKeyRef": {"name": a["password_secret"], "key": "password"}}
        self.service = k8s.core.v1.Service(
            f"{name}-svc",
            metadata={"name": svc, "namespace": ns, "labels": labels},
            spec={"clusterIP": "None", "selector": sel, "ports": [{"name": "mysql", "port": PORT, "targetPort": PORT}]},
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.statefulset = k8s.apps.v1.StatefulSet(
            f"{name}-sts",
            metadata={"name": svc, "namespace": ns, "labels": labels},
            spec={
                "serviceName": svc,
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": {**labels, **sel}},
                    "spec": {
                        "securityContext": {"fsGroup": 999},
                        "containers": [
                            {
                                "name": "mariadb",
                                "image": a["image"],
                                "env": [
                                    {"name": "MARIADB_DATABASE", "value": "slurm_acct_db"},
                                    {"name": "MARIADB_USER", "value": "slurm"},
                                    {"name": "MARIADB_PASSWORD", "valueFrom": password},
                                    {"name": "MARIADB_RANDOM_ROOT_PASSWORD", "value": "yes"},
                                ],
                                # slurmdbd's documented InnoDB minimums (slurm.schedmd.com/accounting.html).
                                "args": [
                                    "--innodb-buffer-pool-size=4G",
                                    "--innodb-lock-wait-timeout=900",
                                    "--innodb-log-file-size=256M",
                                ],
                                "ports": [{"name": "mysql", "containerPort": PORT}],
                                "readinessProbe": {
                                    "exec": {"command": ["healthcheck.sh", "--connect", "--innodb_initialized"]}
                                },
                                "resources": {"requests": {"cpu": "1", "memory": "6Gi"}, "limits": {"memory": "8Gi"}},
                                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/mysql"}],
                            }
                        ],
                    },
                },
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "data"},
                        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": a["size"]}}},
                    }
                ],
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.service]),
        )
        self.register_outputs({"host": svc})
