"""The options every fleetheal.cluster module takes (module_utils/steps.py COMMON_ARGS)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  dry_run:
    description: Report what would be done and change nothing (check mode does the same).
    type: bool
    default: false
  settings:
    description: The playbook variables C(fleetheal_*) of vars/remediation.yml that C(fleetheal.steps.Settings) reads.
    type: dict
    default: {}
"""
