"""Stack configuration: `Pulumi.yaml` declarations + stack values -> one frozen `StackConfig`.

`Pulumi.yaml` is the single place that declares every key (type, default, description). This module
reads those declarations, overlays the stack's values (from `pulumi.Config` under a real engine, or
from `Pulumi.<stack>.yaml` for `fleetheal render`), coerces and checks them, and raises
`ConfigError` naming the key and the accepted values before any resource is registered.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

PROJECT = "fleetheal"


def _project_root() -> Path:
    """The Pulumi project: the checkout this package sits in, or for an installed wheel the nearest
    directory holding Pulumi.yaml from the working directory up (as the Pulumi CLI looks), else the
    working directory (`fleetheal render --root` names another)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "Pulumi.yaml").is_file():
        return checkout
    cwd = Path.cwd()
    return next((d for d in (cwd, *cwd.parents) if (d / "Pulumi.yaml").is_file()), cwd)


REPO_ROOT = _project_root()
PROJECT_FILE = REPO_ROOT / "Pulumi.yaml"

SLINKY_MODES = ("manifests", "helm")
NODE_PROVIDERS = ("existing", "eks")
ENVIRONMENTS = ("development", "staging", "production")
REMEDIATOR_STORES = ("sqlite", "postgres", "postgres-in-cluster")
#: `none`: a cluster on its own (its own slurmdbd); `manager`: a cluster that also runs the federation's
#: slurmdbd and declares the federation; `worker`: a cluster whose accounting is the manager's slurmdbd.
FEDERATION_ROLES = ("none", "manager", "worker")
#: slurmdbd's default DbdPort; a worker's `federation.manager` without a port means this one.
SLURMDBD_PORT = 6819
ACCOUNTING_SERVICE_TYPES = ("LoadBalancer", "NodePort", "ClusterIP")
_RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RFC1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_POOL_KEYS_COMMON = ("name", "gpuType", "gpusPerNode")
_POOL_KEYS = {
    "existing": (*_POOL_KEYS_COMMON, "nodeNames", "standbyNodeNames"),
    "eks": (*_POOL_KEYS_COMMON, "nodes", "instanceType"),
}


class ConfigError(ValueError):
    """A stack setting is missing or invalid; the message names the key and what is accepted."""


#: Optional secrets. Pulumi.yaml declares them with the default "" (not set) and without `secret: true`:
#: the engine requires a declared key that has no default, and refuses a default for a secret key. A
#: value set without `--secret` is refused when the program runs (it would sit in the stack file in clear).
SECRET_KEYS = frozenset({"slurmKey", "slurmJwtKey", "remediatorToken", "remediatorDbPassword"})


@dataclass(frozen=True, slots=True)
class Declaration:
    key: str
    type: str
    description: str
    default: Any = None
    has_default: bool = False
    secret: bool = False
    items: str | None = None


def declarations(project_file: Path = PROJECT_FILE) -> dict[str, Declaration]:
    """Every config key declared in `Pulumi.yaml`, by bare name."""
    doc = yaml.safe_load(project_file.read_text(encoding="utf-8"))
    out: dict[str, Declaration] = {}
    for key, spec in (doc.get("config") or {}).items():
        if ":" in key:  # a provider's setting (kubernetes:...), given a value there, not a fleetheal key
            continue
        out[key] = Declaration(
            key=key,
            type=spec["type"],
            description=spec.get("description", ""),
            default=spec.get("default"),
            has_default="default" in spec,
            secret=bool(spec.get("secret", False)) or key in SECRET_KEYS,
            items=(spec.get("items") or {}).get("type"),
        )
    return out


def standby_size(active_nodes: int, min_nodes: int, share_percent: int) -> int:
    """Warm-standby nodes a pool needs: the larger of the floor and the share, and never below 1."""
    return max(1, min_nodes, math.ceil(active_nodes * share_percent / 100))


@dataclass(frozen=True, slots=True)
class GpuPool:
    """One GPU pool: a Slinky NodeSet, its nodes and its warm-standby nodes."""

    name: str
    gpu_type: str
    gpus_per_node: int
    nodes: int
    standby_nodes: int
    node_names: tuple[str, ...] = ()
    standby_node_names: tuple[str, ...] = ()
    instance_type: str = ""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class FederatedCluster:
    """One cluster of the federation as the manager declares it (its Slurm ClusterName is `name`)."""

    name: str
    gpu_type: str
    gpus_per_node: int
    #: Slurm cluster features besides the GPU type and the data features (`sbatch --cluster-constraint`).
    features: tuple[str, ...] = ()
    remediator_url: str = ""
    checkpoint_stores: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FederatedQos:
    name: str
    priority: int = 0


@dataclass(frozen=True, slots=True)
class FederatedAccount:
    """A Slurm account with an association on every cluster of the federation."""

    name: str
    users: tuple[str, ...]
    qos: tuple[str, ...]
    default_qos: str


@dataclass(frozen=True, slots=True)
class FederationSpec:
    """The stack's place in a Slurm federation (the `federation` setting), checked."""

    role: str = "none"
    #: The federation's name (`sacctmgr show federation`); the manager's.
    name: str = ""
    #: worker: where the manager's slurmdbd listens.
    manager_host: str = ""
    manager_port: int = SLURMDBD_PORT
    #: manager: the HOST:PORT its workers are told to use ("" when not declared); the drift check compares.
    address: str = ""
    #: manager: how its slurmdbd is reachable from the workers' Kubernetes clusters.
    service_type: str = "LoadBalancer"
    clusters: tuple[FederatedCluster, ...] = ()
    qos: tuple[FederatedQos, ...] = ()
    accounts: tuple[FederatedAccount, ...] = ()
    #: The fleet file (fleetheal.fleet.config format), validated; rendered as a ConfigMap. A worker's is its
    #: manager stack's (`managerStack`); empty for a worker that names none.
    fleet_file: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: manager: prefix of the cluster features that say a cluster holds a dataset (the fleet's placement section).
    data_feature_prefix: str = "data-"

    @property
    def member(self) -> bool:
        return self.role != "none"


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Every stack setting, checked. Secret values stay opaque (`Any`: a str or a pulumi Output)."""

    environment: str
    cluster_name: str
    slurm_namespace: str
    system_namespace: str
    slinky_mode: str
    slinky_version: str
    slinky_chart_repo: str
    image_registry: str
    slurm_image_tag: str
    helper_image: str
    gpu_pools: tuple[GpuPool, ...]
    node_provider: str
    eks_cluster_name: str
    eks_node_role_arn: str
    eks_subnet_ids: tuple[str, ...]
    standby_min_nodes: int
    standby_share_percent: int
    failure_domain_size: int
    large_job_min_nodes: int
    requeue_grace_seconds: int
    slurm_key_secret: str
    slurm_jwt_secret: str
    accounting_database: bool
    accounting_db_image: str
    accounting_db_host: str
    accounting_db_password_secret: str
    shared_storage_class: str
    shared_storage_size: str
    shared_storage_mount_path: str
    agent_image: str
    agent_port: int
    remediator_image: str
    remediator_token_secret: str
    remediator_dry_run: bool
    remediator_replicas: int
    remediator_store: str
    remediator_store_secret: str
    remediator_db_image: str
    dcgm_exporter: bool
    dcgm_exporter_image: str
    monitoring_labels: Mapping[str, str]
    kueue: bool
    kueue_namespaces: tuple[str, ...]
    kueue_share_percent: int
    kueue_large_share_percent: int
    kueue_borrowing_limit_percent: int
    kueue_lending_limit_percent: int
    await_readiness: bool
    secrets: Mapping[str, Any] = field(default_factory=dict)
    federation: FederationSpec = field(default_factory=FederationSpec)

    def image(self, component: str) -> str:
        """A Slinky image (slurmctld, slurmd, slurmdbd, slurmrestd, login) at the pinned Slurm tag."""
        return f"{self.image_registry}/{component}:{self.slurm_image_tag}"

    @property
    def operator_image(self) -> str:
        return f"{self.image_registry}/slurm-operator:{self.slinky_version}"

    def secret(self, key: str) -> Any:
        return self.secrets.get(key)


# ---------------------------------------------------------------------------------------------
# coercion: pulumi.Config hands every value over as a string (objects as JSON); stack files as YAML


def _coerce(decl: Declaration, value: Any) -> Any:
    key = f"{PROJECT}:{decl.key}"
    if decl.type == "string":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if decl.type == "integer":
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if decl.type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: expected {decl.type} (JSON when set as a string): {exc.msg}") from exc
    if decl.type == "array":
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        want = {"string": str, "object": dict, "integer": int}.get(decl.items or "", object)
        for i, item in enumerate(value):
            if not isinstance(item, want):
                raise ConfigError(f"{key}[{i}]: expected {decl.items}, got {item!r}")
        return value
    if decl.type == "object":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object (mapping), got {value!r}")
        return value
    raise ConfigError(f"{key}: Pulumi.yaml declares unsupported type {decl.type!r}")


def _one_of(key: str, value: str, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ConfigError(f"{PROJECT}:{key}: {value!r} is not accepted; use one of: {', '.join(accepted)}")
    return value


def _dns_label(key: str, value: str, max_len: int = 63) -> str:
    if not _RFC1123_LABEL.match(value) or len(value) > max_len:
        raise ConfigError(
            f"{PROJECT}:{key}: {value!r} is not accepted; use lower-case letters, digits and '-', "
            f"starting and ending with a letter or digit, at most {max_len} characters"
        )
    return value


def _percent(key: str, value: int) -> int:
    if not 0 <= value <= 100:
        raise ConfigError(f"{PROJECT}:{key}: {value} is not accepted; use an integer from 0 to 100")
    return value


def _at_least(key: str, value: int, low: int) -> int:
    if value < low:
        raise ConfigError(f"{PROJECT}:{key}: {value} is not accepted; use an integer >= {low}")
    return value


def _pinned(key: str, image: str) -> str:
    """An image reference with an explicit tag other than `latest`, or a digest."""
    if "@sha256:" in image:
        return image
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag or not tag or tag == "latest":
        raise ConfigError(
            f"{PROJECT}:{key}: {image!r} is not pinned; use REPOSITORY:TAG with a tag other than 'latest', "
            "or REPOSITORY@sha256:DIGEST"
        )
    return image


def _pools(raw: list[dict[str, Any]], provider: str, min_nodes: int, share: int) -> tuple[GpuPool, ...]:
    key = f"{PROJECT}:gpuPools"
    if not raw:
        raise ConfigError(
            f"{key}: at least one GPU pool is required; each pool needs {', '.join(_POOL_KEYS[provider])}"
        )
    pools: list[GpuPool] = []
    seen_names: set[str] = set()
    seen_nodes: set[str] = set()
    accepted = _POOL_KEYS[provider]
    for i, item in enumerate(raw):
        where = f"{key}[{i}]"
        unknown = sorted(set(item) - set(accepted))
        if unknown:
            raise ConfigError(
                f"{where}: unknown field(s) {', '.join(unknown)} for nodeProvider={provider}; "
                f"accepted fields: {', '.join(accepted)}"
            )
        missing = [k for k in accepted if k not in item]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}; accepted fields: {', '.join(accepted)}")
        name = item["name"]
        if not isinstance(name, str) or not _RFC1123_LABEL.match(name) or len(name) > 40:
            raise ConfigError(
                f"{where}.name: {name!r} is not accepted; use lower-case letters, digits and '-', at most 40 characters"
            )
        if name in seen_names:
            raise ConfigError(f"{where}.name: pool {name!r} is declared twice; pool names must be unique")
        seen_names.add(name)
        gpu_type = item["gpuType"]
        if not isinstance(gpu_type, str) or not _RFC1123_LABEL.match(gpu_type):
            raise ConfigError(f"{where}.gpuType: {gpu_type!r} is not accepted; use a lower-case name such as h100")
        gpn = item["gpusPerNode"]
        if isinstance(gpn, bool) or not isinstance(gpn, int | float) or int(gpn) != gpn or not 1 <= gpn <= 16:
            raise ConfigError(f"{where}.gpusPerNode: {gpn!r} is not accepted; use an integer from 1 to 16")
        if provider == "existing":
            names = _node_names(f"{where}.nodeNames", item["nodeNames"], seen_nodes, allow_empty=False)
            standby_names = _node_names(f"{where}.standbyNodeNames", item["standbyNodeNames"], seen_nodes)
            need = standby_size(len(names), min_nodes, share)
            if len(standby_names) < need:
                raise ConfigError(
                    f"{where}.standbyNodeNames: pool {name!r} needs at least {need} warm-standby node(s) "
                    f"(standbyMinNodes={min_nodes}, standbySharePercent={share} of {len(names)} nodes, never below 1); "
                    f"got {len(standby_names)}"
                )
            pools.append(GpuPool(name, gpu_type, int(gpn), len(names), len(standby_names), names, standby_names))
        else:
            nodes = item["nodes"]
            if isinstance(nodes, bool) or not isinstance(nodes, int | float) or int(nodes) != nodes or nodes < 1:
                raise ConfigError(f"{where}.nodes: {nodes!r} is not accepted; use an integer >= 1")
            itype = item["instanceType"]
            if not isinstance(itype, str) or not itype:
                raise ConfigError(
                    f"{where}.instanceType: {itype!r} is not accepted; use an EC2 type such as p5.48xlarge"
                )
            pools.append(
                GpuPool(
                    name,
                    gpu_type,
                    int(gpn),
                    int(nodes),
                    standby_size(int(nodes), min_nodes, share),
                    instance_type=itype,
                )
            )
    return tuple(pools)


def _node_names(where: str, value: Any, seen: set[str], allow_empty: bool = True) -> tuple[str, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ConfigError(f"{where}: expected a {'' if allow_empty else 'non-empty '}list of Kubernetes node names")
    for n in value:
        if not isinstance(n, str) or not _RFC1123_SUBDOMAIN.match(n) or len(n) > 253:
            raise ConfigError(f"{where}: {n!r} is not a Kubernetes node name (RFC 1123 subdomain)")
        if n in seen:
            raise ConfigError(f"{where}: node {n!r} appears twice; a node belongs to one pool, active or standby")
        seen.add(n)
    return tuple(value)


# ---------------------------------------------------------------------------------------------
# the federation setting

#: Slurm ClusterNames of a federation: the fleet file's names (fleetheal.fleet.config.NAME), which slurmdbd
#: also uses as the prefix of its per-cluster tables.
_SLURM_CLUSTER = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
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
#: QOS every slurmdbd has from the start.
BUILTIN_QOS = ("normal",)


def _fields(where: str, item: Any, accepted: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with {', '.join(accepted)}, got {item!r}")
    unknown = sorted(set(item) - set(accepted))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted fields: {', '.join(accepted)}")
    missing = [k for k in required if k not in item]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}; accepted fields: {', '.join(accepted)}")
    return item


def _names(where: str, value: Any, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {what}, got {value!r}")
    for v in value:
        if not isinstance(v, str) or not pattern.match(v):
            raise ConfigError(f"{where}: {v!r} is not accepted as {what} (pattern {pattern.pattern})")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: {what} repeat in {value!r}")
    return tuple(value)


def _int(where: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ConfigError(f"{where}: {value!r} is not accepted; use an integer from {low} to {high}")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {value!r} is not accepted; use an integer from {low} to {high}")
    return int(value)


def _unique_named(where: str, raw: Any, pattern: re.Pattern[str], what: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, item) of a list of objects with a `name`, each name valid and given once."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of objects, got {raw!r}")
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not pattern.match(name):
            raise ConfigError(
                f"{where}[{i}].name: {name!r} is not a valid {what}; use lower-case letters, digits and '-', "
                f"starting with a letter (pattern {pattern.pattern})"
            )
        if name in seen:
            raise ConfigError(f"{where}[{i}].name: {what} {name!r} is declared twice; names must be unique")
        seen.add(name)
        out.append((name, item))
    return out


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


def _fleet_file(
    name: str,
    clusters: tuple[FederatedCluster, ...],
    raw: Mapping[str, Any],
) -> tuple[dict[str, Any], str]:
    """The fleet file the manager renders, checked by fleetheal.fleet.config (the one reader of fleet files),
    and the data-feature prefix of its placement section."""
    from fleetheal import settings
    from fleetheal.fleet import config as fleet_config

    doc: dict[str, Any] = {
        "federation": name,
        "clusters": {
            c.name: {
                "gpu_type": c.gpu_type,
                "gpus_per_node": c.gpus_per_node,
                "remediator_url": c.remediator_url,
                "checkpoint_stores": list(c.checkpoint_stores),
            }
            for c in clusters
        },
    }
    for key, out_key, field_map in (
        ("datasets", "datasets", {"sizeGb": "size_gb", "clusters": "clusters"}),
        ("checkpointStores", "checkpoint_stores", {"path": "path"}),
    ):
        section = raw.get(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{PROJECT}:federation.{key}: expected an object (name -> fields), got {section!r}")
        converted: dict[str, Any] = {}
        for item_name, item in section.items():
            where = f"{PROJECT}:federation.{key}.{item_name}"
            fields = _fields(where, item, tuple(field_map), ())
            converted[item_name] = {field_map[k]: v for k, v in fields.items()}
        if converted:
            doc[out_key] = converted
    for key in ("placement", "queues"):
        if key in raw:
            if not isinstance(raw[key], dict):
                raise ConfigError(f"{PROJECT}:federation.{key}: expected an object, got {raw[key]!r}")
            doc[key] = dict(raw[key])
    try:
        # No environment overrides: the stack is the fleet file's source; overrides belong to its readers.
        fleet = settings.build(fleet_config.FleetConfig, doc, {}, fleet_config.ENV_PREFIX)
    except settings.ConfigError as exc:
        raise ConfigError(f"{PROJECT}:federation: the fleet file it makes is not valid: {exc}") from None
    return doc, fleet.placement.data_feature_prefix


def _manager_fleet_file(
    key: str, manager_stack: Any, cluster_name: str, project_file: Path
) -> tuple[str, dict[str, Any]]:
    """A worker's (federation name, fleet file): the manager stack's, built from that stack's own file beside
    this one (the federation is declared once, in the manager's stack). ("", {}) without `managerStack`, or
    when the manager does not list this cluster."""
    if manager_stack is None:
        return "", {}
    if not isinstance(manager_stack, str) or not manager_stack:
        raise ConfigError(f"{key}.managerStack: {manager_stack!r} is not accepted; name the manager's stack")
    try:
        manager = from_values(stack_values(manager_stack, project_file.parent), project_file)
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


def _federation(raw: Mapping[str, Any], cluster_name: str, project_file: Path = PROJECT_FILE) -> FederationSpec:
    key = f"{PROJECT}:federation"
    role = raw.get("role", "none" if not raw else None)
    if role is None:
        raise ConfigError(f"{key}.role: required; use one of: {', '.join(FEDERATION_ROLES)}")
    _one_of("federation.role", role, FEDERATION_ROLES)
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
        name, fleet = _manager_fleet_file(key, raw.get("managerStack"), cluster_name, project_file)
        return FederationSpec(
            role="worker", name=name, manager_host=host, manager_port=port, fleet_file=MappingProxyType(fleet)
        )

    name = raw.get("name", "fleet")
    if not isinstance(name, str) or not _SLURM_CLUSTER.match(name):
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
        _unique_named(f"{key}.clusters", raw_clusters, _SLURM_CLUSTER, "Slurm cluster name")
    ):
        where = f"{key}.clusters[{i}]"
        c = _fields(where, item, _FED_CLUSTER_KEYS, _FED_CLUSTER_KEYS[:3])
        gpu_type = c["gpuType"]
        if not isinstance(gpu_type, str) or not _RFC1123_LABEL.match(gpu_type):
            raise ConfigError(f"{where}.gpuType: {gpu_type!r} is not accepted; use a lower-case name such as h100")
        url = c.get("remediatorUrl", "")
        if not isinstance(url, str) or (url and not re.match(r"^https?://", url)):
            raise ConfigError(f"{where}.remediatorUrl: {url!r} is not accepted; use an http(s) URL or leave it out")
        clusters.append(
            FederatedCluster(
                name=cname,
                gpu_type=gpu_type,
                gpus_per_node=_int(f"{where}.gpusPerNode", c["gpusPerNode"], 1, 16),
                features=_names(f"{where}.features", c.get("features", []), _FEATURE, "cluster features"),
                remediator_url=url,
                checkpoint_stores=_names(
                    f"{where}.checkpointStores", c.get("checkpointStores", []), _SLURM_CLUSTER, "checkpoint store names"
                ),
            )
        )
    if cluster_name not in {c.name for c in clusters}:
        raise ConfigError(
            f"{key}.clusters: the manager's own cluster {cluster_name!r} (clusterName) is not listed; the manager "
            "runs slurmdbd beside its own Slurm cluster, which is a member of the federation like the others"
        )

    qos: list[FederatedQos] = []
    for i, (qname, item) in enumerate(_unique_named(f"{key}.qos", raw.get("qos", []), _SLURM_ENTITY, "QOS name")):
        q = _fields(f"{key}.qos[{i}]", item, _FED_QOS_KEYS, ("name",))
        qos.append(FederatedQos(qname, _int(f"{key}.qos[{i}].priority", q.get("priority", 0), 0, 2**31 - 1)))
    known_qos = {q.name for q in qos} | set(BUILTIN_QOS)

    accounts: list[FederatedAccount] = []
    raw_accounts = raw.get("accounts", [])
    for i, (aname, item) in enumerate(_unique_named(f"{key}.accounts", raw_accounts, _SLURM_ENTITY, "account name")):
        where = f"{key}.accounts[{i}]"
        a = _fields(where, item, _FED_ACCOUNT_KEYS, ("name",))
        users = _names(f"{where}.users", a.get("users", []), _POSIX_USER, "user names")
        a_qos = _names(f"{where}.qos", a.get("qos", []), _SLURM_ENTITY, "QOS names")
        for q_name in a_qos:
            if q_name not in known_qos:
                raise ConfigError(
                    f"{where}.qos: {q_name!r} is not declared in {key}.qos (declared: {', '.join(sorted(known_qos))})"
                )
        default_qos = a.get("defaultQos", a_qos[0] if a_qos else "")
        if a_qos and default_qos not in a_qos:
            raise ConfigError(f"{where}.defaultQos: {default_qos!r} is not one of the account's qos {list(a_qos)}")
        accounts.append(FederatedAccount(aname, users, a_qos, str(default_qos)))

    fleet_doc, prefix = _fleet_file(name, tuple(clusters), raw)
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


def from_values(values: Mapping[str, Any], project_file: Path = PROJECT_FILE) -> StackConfig:
    """Build and check the stack config from bare-name values (`clusterName`, not `fleetheal:clusterName`).

    Keys not declared in `Pulumi.yaml` are rejected (a typo must not silently fall back to a default).
    """
    decls = declarations(project_file)
    unknown = sorted(set(values) - set(decls))
    if unknown:
        raise ConfigError(
            f"{PROJECT}:{unknown[0]}: not a fleetheal setting; declared keys are: {', '.join(sorted(decls))}"
        )
    v: dict[str, Any] = {}
    secrets: dict[str, Any] = {}
    for key, decl in decls.items():
        if decl.secret:
            if values.get(key) not in (None, ""):  # "" is the declared default: not set
                secrets[key] = values[key]
            continue
        raw = values.get(key)
        if raw is None:
            if not decl.has_default:
                raise ConfigError(f"{PROJECT}:{key}: required; {decl.description}")
            raw = decl.default
        v[key] = _coerce(decl, raw)

    provider = _one_of("nodeProvider", v["nodeProvider"], NODE_PROVIDERS)
    min_nodes = _at_least("standbyMinNodes", v["standbyMinNodes"], 1)
    share = _percent("standbySharePercent", v["standbySharePercent"])
    if provider == "eks":
        for k in ("eksClusterName", "eksNodeRoleArn"):
            if not v[k]:
                raise ConfigError(f"{PROJECT}:{k}: required when nodeProvider=eks")
        if not v["eksSubnetIds"]:
            raise ConfigError(f"{PROJECT}:eksSubnetIds: at least one subnet id is required when nodeProvider=eks")
    labels = v["monitoringLabels"]
    for lk, lv in labels.items():
        if not isinstance(lv, str):
            raise ConfigError(f"{PROJECT}:monitoringLabels.{lk}: expected a string label value, got {lv!r}")
    if not _QUANTITY.match(v["sharedStorageSize"]):
        raise ConfigError(
            f"{PROJECT}:sharedStorageSize: {v['sharedStorageSize']!r} is not accepted; "
            "use a Kubernetes quantity such as 10Ti"
        )
    if not v["sharedStorageMountPath"].startswith("/"):
        raise ConfigError(f"{PROJECT}:sharedStorageMountPath: {v['sharedStorageMountPath']!r} must be an absolute path")
    if "latest" in v["slurmImageTag"].split("-") or not v["slurmImageTag"]:
        raise ConfigError(
            f"{PROJECT}:slurmImageTag: {v['slurmImageTag']!r} is not pinned; "
            "use a release tag such as 26.05-ubuntu26.04"
        )
    if not re.fullmatch(r"v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", v["slinkyVersion"]):
        raise ConfigError(f"{PROJECT}:slinkyVersion: {v['slinkyVersion']!r} is not pinned; use a release such as 1.2.1")
    replicas = _at_least("remediatorReplicas", v["remediatorReplicas"], 1)
    store = _one_of("remediatorStore", v["remediatorStore"], REMEDIATOR_STORES)
    if replicas > 1 and store == "sqlite":
        raise ConfigError(
            f"{PROJECT}:remediatorReplicas: {replicas} is not accepted with remediatorStore=sqlite (SQLite serves one "
            "replica); set remediatorStore to postgres or postgres-in-cluster, or remediatorReplicas to 1"
        )

    cluster_name = _dns_label("clusterName", v["clusterName"], 40)
    federation = _federation(v["federation"], cluster_name, project_file)
    accounting_database = v["accountingDatabase"]
    if federation.member:
        if not _SLURM_CLUSTER.match(cluster_name):
            raise ConfigError(
                f"{PROJECT}:clusterName: {cluster_name!r} is not accepted in a federation; a Slurm cluster name "
                "starts with a lower-case letter (then letters, digits, '-'; at most 40)"
            )
        if v["slinkyMode"] != "manifests":
            raise ConfigError(
                f"{PROJECT}:slinkyMode: {v['slinkyMode']!r} is not accepted with federation.role "
                f"{federation.role}; a federation member needs slinkyMode manifests (the Accounting custom "
                "resource carries the shared slurmdbd)"
            )
    if federation.role == "worker":
        # A worker's accounting is the manager's slurmdbd and database. accountingDatabase does not apply (the
        # engine hands over its declared default, true, as if it were set, so it cannot be refused here).
        accounting_database = False

    return StackConfig(
        environment=_one_of("environment", v["environment"], ENVIRONMENTS),
        cluster_name=cluster_name,
        slurm_namespace=_dns_label("slurmNamespace", v["slurmNamespace"]),
        system_namespace=_dns_label("systemNamespace", v["systemNamespace"]),
        slinky_mode=_one_of("slinkyMode", v["slinkyMode"], SLINKY_MODES),
        slinky_version=v["slinkyVersion"],
        slinky_chart_repo=v["slinkyChartRepo"],
        image_registry=v["imageRegistry"].rstrip("/"),
        slurm_image_tag=v["slurmImageTag"],
        helper_image=_pinned("helperImage", v["helperImage"]),
        gpu_pools=_pools(v["gpuPools"], provider, min_nodes, share),
        node_provider=provider,
        eks_cluster_name=v["eksClusterName"],
        eks_node_role_arn=v["eksNodeRoleArn"],
        eks_subnet_ids=tuple(v["eksSubnetIds"]),
        standby_min_nodes=min_nodes,
        standby_share_percent=share,
        failure_domain_size=_at_least("failureDomainSize", v["failureDomainSize"], 1),
        large_job_min_nodes=_at_least("largeJobMinNodes", v["largeJobMinNodes"], 2),
        requeue_grace_seconds=_at_least("requeueGraceSeconds", v["requeueGraceSeconds"], 1),
        slurm_key_secret=_dns_label("slurmKeySecret", v["slurmKeySecret"], 253),
        slurm_jwt_secret=_dns_label("slurmJwtSecret", v["slurmJwtSecret"], 253),
        accounting_database=accounting_database,
        accounting_db_image=_pinned("accountingDbImage", v["accountingDbImage"]),
        accounting_db_host=_dns_label("accountingDbHost", v["accountingDbHost"], 253)
        if accounting_database
        else v["accountingDbHost"],
        accounting_db_password_secret=_dns_label("accountingDbPasswordSecret", v["accountingDbPasswordSecret"], 253),
        shared_storage_class=v["sharedStorageClass"],
        shared_storage_size=v["sharedStorageSize"],
        shared_storage_mount_path=v["sharedStorageMountPath"],
        agent_image=_pinned("agentImage", v["agentImage"]),
        agent_port=_at_least("agentPort", v["agentPort"], 1),
        remediator_image=_pinned("remediatorImage", v["remediatorImage"]),
        remediator_token_secret=_dns_label("remediatorTokenSecret", v["remediatorTokenSecret"], 253),
        remediator_dry_run=v["remediatorDryRun"],
        remediator_replicas=replicas,
        remediator_store=store,
        remediator_store_secret=_dns_label("remediatorStoreSecret", v["remediatorStoreSecret"], 253),
        remediator_db_image=_pinned("remediatorDbImage", v["remediatorDbImage"]),
        dcgm_exporter=v["dcgmExporter"],
        dcgm_exporter_image=_pinned("dcgmExporterImage", v["dcgmExporterImage"]),
        monitoring_labels=dict(labels),
        kueue=v["kueue"],
        kueue_namespaces=tuple(_dns_label("kueueNamespaces", n) for n in v["kueueNamespaces"]),
        kueue_share_percent=_percent("kueueSharePercent", v["kueueSharePercent"]),
        kueue_large_share_percent=_percent("kueueLargeSharePercent", v["kueueLargeSharePercent"]),
        kueue_borrowing_limit_percent=_percent("kueueBorrowingLimitPercent", v["kueueBorrowingLimitPercent"]),
        kueue_lending_limit_percent=_percent("kueueLendingLimitPercent", v["kueueLendingLimitPercent"]),
        await_readiness=v["awaitReadiness"],
        secrets=secrets,
        federation=federation,
    )


def from_pulumi(project_file: Path = PROJECT_FILE) -> StackConfig:
    """Read the running stack's config (the engine has applied the Pulumi.yaml defaults already)."""
    import pulumi

    cfg = pulumi.Config(PROJECT)
    values: dict[str, Any] = {}
    for key, decl in declarations(project_file).items():
        if decl.secret:
            # The declared default "" means not set (see SECRET_KEYS); only a set value becomes a secret Output.
            raw_secret = pulumi.runtime.get_config(f"{PROJECT}:{key}")
            if raw_secret:
                if not pulumi.runtime.is_config_secret(f"{PROJECT}:{key}"):
                    raise ConfigError(
                        f"{PROJECT}:{key}: stored in clear; set it with `pulumi config set --secret {key}`"
                    )
                values[key] = pulumi.Output.secret(raw_secret)
            continue
        raw = cfg.get(key)
        if raw is not None:
            values[key] = raw
    return from_values(values, project_file)


def stack_values(stack: str, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Values of `Pulumi.<stack>.yaml` by bare name; encrypted (`secure:`) values become None (not decryptable here)."""
    path = root / f"Pulumi.{stack}.yaml"
    if not path.exists():
        raise ConfigError(
            f"stack {stack!r}: {path} does not exist; stacks here: {', '.join(list_stacks(root)) or 'none'}"
        )
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    out: dict[str, Any] = {}
    for key, value in (doc.get("config") or {}).items():
        ns, _, bare = key.partition(":")
        if ns != PROJECT or not bare:
            continue  # provider settings (kubernetes:context ...) belong to the provider
        out[bare] = None if isinstance(value, dict) and set(value) == {"secure"} else value
    return out


def list_stacks(root: Path = REPO_ROOT) -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in root.glob("Pulumi.*.yaml"))


def reference_markdown(project_file: Path = PROJECT_FILE) -> str:
    """docs/pulumi-config.md, generated from the declarations in Pulumi.yaml (a test checks it is current)."""

    def show(value: Any) -> str:
        if value is None:
            return ""
        return "`" + json.dumps(value, separators=(", ", ": ")) + "`"

    lines = [
        "# Stack configuration reference",
        "",
        "<!-- GENERATED from Pulumi.yaml by fleetheal.infra.config.reference_markdown(); do not edit. -->",
        "",
        "Every setting of the fleetheal Pulumi program, declared once in `Pulumi.yaml`. A stack file",
        "(`Pulumi.<stack>.yaml`) only overrides: `pulumi config set fleetheal:KEY VALUE` (`--path` for",
        "objects and lists, `--secret` for secrets). A bad value stops `pulumi up` before any resource is",
        "registered, with a message naming `fleetheal:KEY` and what it accepts.",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for d in declarations(project_file).values():
        typ = f"{d.type}<{d.items}>" if d.items else d.type
        if d.secret:
            typ += " (secret)"
        default = show(d.default) if d.has_default else "(none)"
        desc = d.description.replace("|", "\\|")
        lines.append(f"| `{d.key}` | {typ} | {default} | {desc} |")
    return "\n".join(lines) + "\n"
