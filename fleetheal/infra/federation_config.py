"""The `federation` setting checked into a FederationSpec: the role's fields, a worker's manager (and the
fleet file of its manager stack), a manager's clusters, QOS, accounts and the fleet file they make."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from fleetheal import contracts
from fleetheal.infra.config_checks import RFC1123_LABEL, fields, int_range, names, one_of, unique_named
from fleetheal.infra.fleet_file import fleet_document
from fleetheal.infra.project import PROJECT
from fleetheal.infra.stack_model import (
    ACCOUNTING_SERVICE_TYPES,
    BUILTIN_QOS,
    FEDERATION_ROLES,
    SLURMDBD_PORT,
    FederatedAccount,
    FederatedCluster,
    FederatedQos,
    FederationSpec,
    StackConfig,
)
from fleetheal.settings import ConfigError

#: Reads another stack of the project by name (fleetheal.infra.config passes its own reader).
StackReader = Callable[[str], StackConfig]

#: Slurm ClusterNames of a federation (contracts.CLUSTER_NAME_PATTERN), which slurmdbd also uses as the prefix
#: of its per-cluster tables.
SLURM_CLUSTER = re.compile(rf"^{contracts.CLUSTER_NAME_PATTERN}$")
_SLURM_ENTITY = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")  # accounts and QOS (sacctmgr lower-cases them anyway)
_POSIX_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
#: Cluster features: no character that `--cluster-constraint` expressions give a meaning (,&|!()[]*).
_FEATURE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HOST = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$")
_FED_KEYS = {
    "none": ("role",),
    "worker": ("role", "manager", "managerStack"),
    "manager": (
        "role",
        "name",
        "address",
        "serviceType",
        "clusters",
        "qos",
        "accounts",
        "datasets",
        "checkpointStores",
        "placement",
        "queues",
    ),
}
_FED_CLUSTER_KEYS = ("name", "gpuType", "gpusPerNode", "features", "remediatorUrl", "checkpointStores")
_FED_QOS_KEYS = ("name", "priority")
_FED_ACCOUNT_KEYS = ("name", "users", "qos", "defaultQos")


def parse_manager_address(where: str, value: Any) -> tuple[str, int]:
    """HOST or HOST:PORT of a slurmdbd (port SLURMDBD_PORT when left out)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: required for a worker: the manager's slurmdbd as HOST or HOST:PORT")
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = value, str(SLURMDBD_PORT)
    if not _HOST.match(host) or len(host) > 253 or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"{where}: {value!r} is not accepted; use HOST or HOST:PORT (a DNS name or IPv4 address, port 1-65535)"
        )
    return host, int(port)


def _manager_fleet_file(
    key: str, manager_stack: Any, cluster_name: str, read_stack: StackReader
) -> tuple[str, dict[str, Any]]:
    """A worker's (federation name, fleet file): the manager stack's, built from that stack's own file beside
    this one (the federation is declared once, in the manager's stack). ("", {}) without `managerStack`, or
    when the manager does not list this cluster."""
    if manager_stack is None:
        return "", {}
    if not isinstance(manager_stack, str) or not manager_stack:
        raise ConfigError(f"{key}.managerStack: {manager_stack!r} is not accepted; name the manager's stack")
    try:
        manager = read_stack(manager_stack)
    except ConfigError as exc:
        raise ConfigError(f"{key}.managerStack: stack {manager_stack!r} cannot be read: {exc}") from None
    spec = manager.federation
    if spec.role != "manager":
        raise ConfigError(f"{key}.managerStack: stack {manager_stack!r} is not a federation manager (role {spec.role})")
    if cluster_name not in {c.name for c in spec.clusters}:
        # Not (yet) declared by the manager: no fleet file, so no failover to or from it; `fleetheal fleet
        # drift` reports the cluster as outside the federation.
        return "", {}
    return spec.name, dict(spec.fleet_file)


def federation(raw: Mapping[str, Any], cluster_name: str, read_stack: StackReader) -> FederationSpec:
    """The checked `federation` setting of the stack whose Slurm cluster is `cluster_name`; `read_stack` reads
    another stack of the project (a worker's manager stack)."""
    key = f"{PROJECT}:federation"
    role = raw.get("role", "none" if not raw else None)
    if role is None:
        raise ConfigError(f"{key}.role: required; use one of: {', '.join(FEDERATION_ROLES)}")
    one_of("federation.role", role, FEDERATION_ROLES)
    accepted = _FED_KEYS[role]
    unknown = sorted(set(raw) - set(accepted))
    if unknown:
        owner = next((r for r, keys in _FED_KEYS.items() if unknown[0] in keys), None)
        hint = f"; {unknown[0]} belongs to role {owner}" if owner else ""
        raise ConfigError(
            f"{key}: field(s) {', '.join(unknown)} not accepted for role {role} "
            f"(accepted: {', '.join(accepted)}){hint}. The federation (clusters, QOS, accounts, data) is declared "
            "once, in the manager's stack"
        )
    if role == "none":
        return FederationSpec()
    if role == "worker":
        host, port = parse_manager_address(f"{key}.manager", raw.get("manager"))
        name, fleet = _manager_fleet_file(key, raw.get("managerStack"), cluster_name, read_stack)
        return FederationSpec(
            role="worker", name=name, manager_host=host, manager_port=port, fleet_file=MappingProxyType(fleet)
        )

    name = raw.get("name", "fleet")
    if not isinstance(name, str) or not SLURM_CLUSTER.match(name):
        raise ConfigError(f"{key}.name: {name!r} is not accepted; use lower-case letters, digits and '-' (at most 40)")
    address = raw.get("address", "")
    if address:
        parse_manager_address(f"{key}.address", address)
    service_type = raw.get("serviceType", "LoadBalancer")
    if service_type not in ACCOUNTING_SERVICE_TYPES:
        raise ConfigError(
            f"{key}.serviceType: {service_type!r} is not accepted; use one of: {', '.join(ACCOUNTING_SERVICE_TYPES)}"
        )

    clusters: list[FederatedCluster] = []
    raw_clusters = raw.get("clusters")
    if not raw_clusters:
        raise ConfigError(
            f"{key}.clusters: a manager declares the federation's clusters (at least its own, {cluster_name!r}); "
            f"each needs {', '.join(_FED_CLUSTER_KEYS[:3])}"
        )
    for i, (cname, item) in enumerate(
        unique_named(f"{key}.clusters", raw_clusters, SLURM_CLUSTER, "Slurm cluster name")
    ):
        where = f"{key}.clusters[{i}]"
        c = fields(where, item, _FED_CLUSTER_KEYS, _FED_CLUSTER_KEYS[:3])
        gpu_type = c["gpuType"]
        if not isinstance(gpu_type, str) or not RFC1123_LABEL.match(gpu_type):
            raise ConfigError(f"{where}.gpuType: {gpu_type!r} is not accepted; use a lower-case name such as h100")
        url = c.get("remediatorUrl", "")
        if not isinstance(url, str) or (url and not re.match(r"^https?://", url)):
            raise ConfigError(f"{where}.remediatorUrl: {url!r} is not accepted; use an http(s) URL or leave it out")
        clusters.append(
            FederatedCluster(
                name=cname,
                gpu_type=gpu_type,
                gpus_per_node=int_range(f"{where}.gpusPerNode", c["gpusPerNode"], 1, 16),
                features=names(f"{where}.features", c.get("features", []), _FEATURE, "cluster features"),
                remediator_url=url,
                checkpoint_stores=names(
                    f"{where}.checkpointStores", c.get("checkpointStores", []), SLURM_CLUSTER, "checkpoint store names"
                ),
            )
        )
    if cluster_name not in {c.name for c in clusters}:
        raise ConfigError(
            f"{key}.clusters: the manager's own cluster {cluster_name!r} (clusterName) is not listed; the manager "
            "runs slurmdbd beside its own Slurm cluster, which is a member of the federation like the others"
        )

    qos: list[FederatedQos] = []
    for i, (qname, item) in enumerate(unique_named(f"{key}.qos", raw.get("qos", []), _SLURM_ENTITY, "QOS name")):
        q = fields(f"{key}.qos[{i}]", item, _FED_QOS_KEYS, ("name",))
        qos.append(FederatedQos(qname, int_range(f"{key}.qos[{i}].priority", q.get("priority", 0), 0, 2**31 - 1)))
    known_qos = {q.name for q in qos} | set(BUILTIN_QOS)

    accounts: list[FederatedAccount] = []
    raw_accounts = raw.get("accounts", [])
    for i, (aname, item) in enumerate(unique_named(f"{key}.accounts", raw_accounts, _SLURM_ENTITY, "account name")):
        where = f"{key}.accounts[{i}]"
        a = fields(where, item, _FED_ACCOUNT_KEYS, ("name",))
        users = names(f"{where}.users", a.get("users", []), _POSIX_USER, "user names")
        a_qos = names(f"{where}.qos", a.get("qos", []), _SLURM_ENTITY, "QOS names")
        for q_name in a_qos:
            if q_name not in known_qos:
                raise ConfigError(
                    f"{where}.qos: {q_name!r} is not declared in {key}.qos (declared: {', '.join(sorted(known_qos))})"
                )
        default_qos = a.get("defaultQos", a_qos[0] if a_qos else "")
        if a_qos and default_qos not in a_qos:
            raise ConfigError(f"{where}.defaultQos: {default_qos!r} is not one of the account's qos {list(a_qos)}")
        accounts.append(FederatedAccount(aname, users, a_qos, str(default_qos)))

    fleet_doc, prefix = fleet_document(name, tuple(clusters), raw)
    queues = fleet_doc.get("queues") or {}
    for qkey, qdefault in (("large_qos", "large"), ("small_qos", "small")):
        wanted = queues.get(qkey, qdefault)
        if wanted not in known_qos:
            raise ConfigError(
                f"{key}.qos: the fleet's queues.{qkey} {wanted!r} is not declared; the queue controller changes "
                f"its limits at run time, so every cluster needs it (declared: {', '.join(sorted(known_qos))})"
            )
    for fc in clusters:
        for f in fc.features:
            if f.startswith(prefix):
                raise ConfigError(
                    f"{key}.clusters: feature {f!r} of cluster {fc.name!r} starts with the data prefix {prefix!r}; "
                    "data features come from federation.datasets (placement keeps them in step)"
                )
    return FederationSpec(
        role="manager",
        name=name,
        address=address,
        service_type=service_type,
        clusters=tuple(clusters),
        qos=tuple(qos),
        accounts=tuple(accounts),
        fleet_file=MappingProxyType(fleet_doc),
        data_feature_prefix=prefix,
    )
