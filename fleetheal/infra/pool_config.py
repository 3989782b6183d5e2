"""The `gpuPools` setting checked into GpuPool values: fields per node provider, names, GPU counts, and for
existing nodes the node names (each in one pool) and enough warm-standby nodes."""

from __future__ import annotations

from typing import Any

from fleetheal.infra.config_checks import RFC1123_LABEL, RFC1123_SUBDOMAIN
from fleetheal.infra.project import PROJECT
from fleetheal.infra.stack_model import GpuPool, standby_size
from fleetheal.settings import ConfigError

_POOL_KEYS_COMMON = ("name", "gpuType", "gpusPerNode")
_POOL_KEYS = {
    "existing": (*_POOL_KEYS_COMMON, "nodeNames", "standbyNodeNames"),
    "eks": (*_POOL_KEYS_COMMON, "nodes", "instanceType"),
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
        if not isinstance(name, str) or not RFC1123_LABEL.match(name) or len(name) > 40:
            raise ConfigError(
                f"{where}.name: {name!r} is not accepted; use lower-case letters, digits and '-', at most 40 characters"
            )
        if name in seen_names:
            raise ConfigError(f"{where}.name: pool {name!r} is declared twice; pool names must be unique")
        seen_names.add(name)
        gpu_type = item["gpuType"]
        if not isinstance(gpu_type, str) or not RFC1123_LABEL.match(gpu_type):
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
            out.append(GpuPool(name, gpu_type, int(gpn), len(names), len(standby_names), names, standby_names))
        else:
            nodes = item["nodes"]
            if isinstance(nodes, bool) or not isinstance(nodes, int | float) or int(nodes) != nodes or nodes < 1:
                raise ConfigError(f"{where}.nodes: {nodes!r} is not accepted; use an integer >= 1")
            itype = item["instanceType"]
            if not isinstance(itype, str) or not itype:
                raise ConfigError(
                    f"{where}.instanceType: {itype!r} is not accepted; use an EC2 type such as p5.48xlarge"
                )
            out.append(
                GpuPool(
                    name,
                    gpu_type,
                    int(gpn),
                    int(nodes),
                    standby_size(int(nodes), min_nodes, share),
                    instance_type=itype,
                )
            )
    return tuple(out)


def _node_names(where: str, value: Any, seen: set[str], allow_empty: bool = True) -> tuple[str, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ConfigError(f"{where}: expected a {'' if allow_empty else 'non-empty '}list of Kubernetes node names")
    for n in value:
        if not isinstance(n, str) or not RFC1123_SUBDOMAIN.match(n) or len(n) > 253:
            raise ConfigError(f"{where}: {n!r} is not a Kubernetes node name (RFC 1123 subdomain)")
        if n in seen:
            raise ConfigError(f"{where}: node {n!r} appears twice; a node belongs to one pool, active or standby")
        seen.add(n)
    return tuple(value)
