#!/usr/bin/python
"""fleetheal.cluster.k8s_node: cordon and taint a Kubernetes Node fleetheal isolates."""

from __future__ import annotations

from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import run_module

DOCUMENTATION = r"""
module: k8s_node
short_description: Cordon a Kubernetes Node and taint it fleetheal.io/unhealthy
description:
  - The step of C(fleetheal.steps) the remediator's first responder runs, as a module (one patch, guarded by the
    Node's resourceVersion). Evicting its pods is C(kubernetes.core.k8s_drain)'s, in the playbook.
extends_documentation_fragment: [fleetheal.cluster.common]
options:
  name: {description: The Node., type: str, required: true}
  state: {description: What to make true., type: str, required: true, choices: [isolated]}
  fault_id: {description: The taxonomy fault id (the taint's value)., type: str, required: true}
"""

EXAMPLES = r"""
- name: Cordon and taint
  fleetheal.cluster.k8s_node:
    name: n2
    state: isolated
    fault_id: xid-79
    settings: {fleetheal_kubeconfig: /etc/fleetheal/kubeconfig}
"""

RETURN = r"""
steps:
  description: Report rows (step, outcome done|would|skipped|failed, detail).
  type: list
  returned: always
"""


def main() -> None:
    run_module(
        {
            "name": {"type": "str", "required": True},
            "state": {"type": "str", "required": True, "choices": ["isolated"]},
            "fault_id": {"type": "str", "required": True},
        },
        work,
    )


def work(steps, settings, p, dry):
    return [steps.k8s_isolate(steps.kube_for(settings), p["name"], p["fault_id"], dry_run=dry)], {}


if __name__ == "__main__":
    main()
