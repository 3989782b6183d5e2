"""The fleet file of a Slurm federation (fleetheal.fleet.config format), as the stacks render it.

The manager stack builds it from its `federation` setting; every member carries it as the ConfigMap
`fleetheal-fleet` (key fleet.yaml), which its remediator's failover reads and `fleetheal fleet drift`
compares. The stacks are the fleet's one source of truth.
`fleet_document` builds it from the manager's `federation` setting and has fleetheal.fleet.config (the one
reader of fleet files) check it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from fleetheal.infra.config_checks import fields
from fleetheal.infra.project import PROJECT
from fleetheal.infra.stack_model import FederatedCluster
from fleetheal.settings import ConfigError

#: The ConfigMap every federation member carries, and its key.
FLEET_CONFIGMAP = "fleetheal-fleet"
FLEET_FILE_KEY = "fleet.yaml"


def fleet_document(
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
            given = fields(where, item, tuple(field_map), ())
            converted[item_name] = {field_map[k]: v for k, v in given.items()}
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


def fleet_file_text(fleet_file: Mapping[str, Any]) -> str:
    """The fleet file, as fleetheal.fleet.config.load reads it."""
    head = (
        "# The fleet file of the Slurm federation, rendered by the manager stack from fleetheal:federation.\n"
        "# Do not edit: change the manager's stack config (docs/fleet.md describes the fields).\n"
    )
    return head + yaml.safe_dump(_plain(fleet_file), sort_keys=False, width=110)


def _plain(value: Any) -> Any:
    """Mappings (MappingProxyType too) and tuples as the dicts and lists YAML can write."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
