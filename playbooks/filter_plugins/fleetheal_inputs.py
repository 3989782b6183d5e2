"""Filters that check a remediation playbook's inputs against the taxonomy and write its drain reason
(playbooks/tasks/validate.yml).

The checks live in `fleetheal.contracts.playbook_input_problem`. The taxonomy is read here, for the task that
asks, and never becomes a host fact: every host of a run over many incidents would carry it into every
later task (it doubled the cost of each task of a 150-incident run).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import yaml

from fleetheal.contracts import PLAYBOOK_VARS, drain_reason, playbook_input_problem


@functools.lru_cache(maxsize=4)
def _taxonomy(path: str, mtime_ns: int) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (safe loaders only)


def fleetheal_taxonomy(path: str) -> dict[str, Any]:
    """`playbooks/vars/taxonomy.yml` (generated from policies/faults.yaml)."""
    return _taxonomy(str(path), os.stat(path).st_mtime_ns)


def fleetheal_input_problem(
    values: Mapping[str, Any], playbook_action: str, taxonomy_path: str, followups: Mapping[str, Any] | None = None
) -> str:
    """Why the playbook must not run on `values` (the play's variables), or "". The follow-up actions are the
    taxonomy's (`fleetheal_followup_actions` in the generated vars/taxonomy.yml) unless `followups` is given."""
    given = {name: values.get(name) for name in PLAYBOOK_VARS if name in values}
    taxonomy = fleetheal_taxonomy(taxonomy_path)
    followups = followups or taxonomy.get("fleetheal_followup_actions") or {}
    return playbook_input_problem(given, taxonomy, followups, str(playbook_action))


def fleetheal_drain_reason(fault_id: str, incident: str, gpu: Any = "") -> str:
    """The owned Slurm drain reason, as the agent writes it (`fleetheal.contracts.drain_reason`)."""
    return drain_reason(str(fault_id), str(incident), str(gpu) if gpu not in (None, "") else None)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "fleetheal_taxonomy": fleetheal_taxonomy,
            "fleetheal_input_problem": fleetheal_input_problem,
            "fleetheal_drain_reason": fleetheal_drain_reason,
        }
