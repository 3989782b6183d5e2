"""The `gpuPools` setting checked into GpuPool values: fields per node provider, names, GPU counts, the share of
active nodes a pool may lend to Kubernetes workloads, and for existing nodes the node names (each in one pool) and
enough warm-standby nodes."""

from __future__ import annotations

from typing import Any

from fleetheal import contracts
from fleetheal.infra import schema
from fleetheal.infra.config_checks import RFC1123_LABEL
from fleetheal.infra.project import PROJECT
from fleetheal.infra.stack_model import GpuPool, standby_size
from fleetheal.settings import ConfigError

_POOL_KEYS_COMMON = ("name", "gpuType", "gpusPerNode")
_POOL_KEYS = {
    "existing": (*_POOL_KEYS_COMMON, "nodeNames", "standbyNodeNames"),
    "eks": (*_POOL_KEYS_COMMON, "nodes", "instanceType"),
}
#: What a JSON Schema can say about a pool's fields (fleetheal.infra.schema); the node lists are code.
_POOL_PROPERTIES: dict[str, dict[str, Any]] = {
    "name": {
        "type": "string",
        "pattern": RFC1123_LABEL.pattern,
        "maxLength": 40,
        "x-hint": "use lower-case letters, digits and '-', at most 40 characters",
    },
    "gpuType": {"type": "string", "pattern": RFC1123_LABEL.pattern, "x-hint": "use a lower-case name such as h100"},
    "gpusPerNode": {"type": "integer", "minimum": 1, "maximum": 16, "x-hint": "use an integer from 1 to 16"},
    "nodes": {"type": "integer", "minimum": 1, "x-hint": "use an integer >= 1"},
    "instanceType": {"type": "string", "minLength": 1, "x-hint": "use an EC2 type such as p5.48xlarge"},
    "lendMaxPercent": {"type": "integer", "minimum": 0, "maximum": 100, "x-hint": "use an integer from 0 to 100"},
    "lendMinSeconds": {"type": "integer", "minimum": 0, "x-hint": "use a number of seconds >= 0"},
    "reclaimGraceSeconds": {"type": "integer", "minimum": 0, "x-hint": "use a number of seconds >= 0"},
}
#: Optional fields of every pool, with the value an absent one means (lendMaxPercent 0: the pool lends no node).
_POOL_OPTIONAL = {"lendMaxPercent": 0, "lendMinSeconds": 600, "reclaimGraceSeconds": 120}


def _pool_schema(provider: str) -> dict[str, Any]:
    """A pool's fields for `provider` (its node lists are checked by _node_names: names across pools)."""
    properties = {k: _POOL_PROPERTIES.get(k, {}) for k in (*_POOL_KEYS[provider], *_POOL_OPTIONAL)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(_POOL_KEYS[provider]),
        "additionalProperties": False,
    }


def pools(raw: list[dict[str, Any]], provider: str, min_nodes: int, share: int) -> tuple[GpuPool, ...]:
    key = f"{PROJECT}:gpuPools"
    if not raw:
        raise ConfigError(
            f"{key}: at least one GPU pool is required; each pool needs {', '.join(_POOL_KEYS[provider])}"
        )
    out: list[GpuPool] = []
    seen_names: set[str] = set()
    seen_nodes: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{key}[{i}]"
        problems = schema.errors(_pool_schema(provider), item, where, f"for nodeProvider={provider}")
        # The object's shape and its name first, then the name's uniqueness, then the other fields.
        if problems and problems[0][0] in ("", "name"):
            raise ConfigError(problems[0][1])
        name = item["name"]
        if name in seen_names:
            raise ConfigError(f"{where}.name: pool {name!r} is declared twice; pool names must be unique")
        seen_names.add(name)
        if problems:
            raise ConfigError(problems[0][1])
        gpu_type = item["gpuType"]
        gpn = item["gpusPerNode"]
        lend = {k: int(item.get(k, default)) for k, default in _POOL_OPTIONAL.items()}
        max_percent, min_s, grace_s = lend["lendMaxPercent"], lend["lendMinSeconds"], lend["reclaimGraceSeconds"]
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
            out.append(
                GpuPool(
                    name,
                    gpu_type,
                    int(gpn),
                    len(names),
                    len(standby_names),
                    names,
                    standby_names,
                    lend_max_percent=max_percent,
                    lend_min_s=min_s,
                    reclaim_grace_s=grace_s,
                )
            )
        else:
            nodes = item["nodes"]
            itype = item["instanceType"]
            out.append(
                GpuPool(
                    name,
                    gpu_type,
                    int(gpn),
                    int(nodes),
                    standby_size(int(nodes), min_nodes, share),
                    instance_type=itype,
                    lend_max_percent=max_percent,
                    lend_min_s=min_s,
                    reclaim_grace_s=grace_s,
                )
            )
    return tuple(out)


def _node_names(where: str, value: Any, seen: set[str], allow_empty: bool = True) -> tuple[str, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ConfigError(f"{where}: expected a {'' if allow_empty else 'non-empty '}list of Kubernetes node names")
    for n in value:
        if not contracts.is_node_name(n):
            raise ConfigError(f"{where}: {n!r} is not a Kubernetes node name (RFC 1123 subdomain)")
        if n in seen:
            raise ConfigError(f"{where}: node {n!r} appears twice; a node belongs to one pool, active or standby")
        seen.add(n)
    return tuple(value)
