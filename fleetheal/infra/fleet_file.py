"""The fleet file of a Slurm federation (fleetheal.fleet.config format), as the stacks render it.

The manager stack builds it from its `federation` setting; every member carries it as the ConfigMap
`fleetheal-fleet` (key fleet.yaml), which its remediator's failover reads and `fleetheal fleet drift`
compares. The stacks are the fleet's one source of truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

#: The ConfigMap every federation member carries, and its key.
FLEET_CONFIGMAP = "fleetheal-fleet"
FLEET_FILE_KEY = "fleet.yaml"


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
