#!/usr/bin/python
"""fleetheal.cluster.slurm_node: drain a Slurm node, or promote a warm standby in place of it."""

from __future__ import annotations

from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import run_module

DOCUMENTATION = r"""
module: slurm_node
short_description: Drain a Slurm node with an owned reason, or promote a warm standby in its place
description:
  - The step of C(fleetheal.steps) the remediator's first responder runs, as a module.
  - C(drained) drains O(name) with O(reason), never over a reason fleetheal does not own.
  - C(promoted) resumes one warm-standby node (drained with the standby reason) in place of O(name), once per
    O(incident), and labels its Kubernetes Node active and removes its standby taint when Kubernetes is configured.
extends_documentation_fragment: [fleetheal.cluster.common]
options:
  name: {description: The node (Slurm and Kubernetes node name)., type: str, required: true}
  state: {description: What to make true., type: str, required: true, choices: [drained, promoted]}
  incident: {description: The incident id (named in what is changed)., type: str, required: true}
  reason: {description: The owned drain reason (state C(drained))., type: str, default: ""}
"""

EXAMPLES = r"""
- name: Drain
  fleetheal.cluster.slurm_node:
    name: n2
    state: drained
    incident: inc-000001
    reason: "fleetheal:xid-79 incident=inc-000001 gpu=3"
"""

RETURN = r"""
steps:
  description: Report rows (step, outcome done|would|skipped|failed, detail).
  type: list
  returned: always
promoted:
  description: >-
    The standby node promoted for the incident (by this run or an earlier one), or the one a dry run would
    promote; empty when none.
  type: str
  returned: always
"""


#: The module's own options (run_module adds the common ones).
ARGUMENT_SPEC = {
    "name": {"type": "str", "required": True},
    "state": {"type": "str", "required": True, "choices": ["drained", "promoted"]},
    "incident": {"type": "str", "required": True},
    "reason": {"type": "str", "default": ""},
}


def main() -> None:
    run_module(ARGUMENT_SPEC, work)


def work(steps, settings, p, dry):
    slurm = steps.Slurm(settings)
    if p["state"] == "drained":
        return [steps.drain_node(slurm, p["name"], p["reason"], dry_run=dry)], {"promoted": ""}
    promoted = steps.promote_standby(slurm, p["name"], p["incident"], dry_run=dry)
    results = [promoted]
    if promoted.changed:
        results.append(steps.k8s_promote(steps.kube_for(settings), promoted.node, dry_run=dry))
    return results, {"promoted": promoted.node}


if __name__ == "__main__":
    main()
