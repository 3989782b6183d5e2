#!/usr/bin/python
"""fleetheal.cluster.k8s_node: cordon and taint a Kubernetes Node fleetheal isolates, and drain it."""

from __future__ import annotations

from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import run_module

DOCUMENTATION = r"""
module: k8s_node
short_description: Cordon a Kubernetes Node, taint it fleetheal.io/unhealthy and drain it
description:
  - Cordon and taint, the step of C(fleetheal.steps) the remediator's first responder runs (one patch, guarded by
    the Node's resourceVersion).
  - With O(drain), then evict its pods through the Eviction API as C(kubectl drain --ignore-daemonsets
    --delete-emptydir-data) would (PodDisruptionBudgets apply; DaemonSet and mirror pods stay; pods no controller
    manages are refused), wait up to O(drain_timeout_s) for them to be gone and label the Node
    C(fleetheal.io/pool=quarantine). An eviction a budget refuses fails the task with the server's message, which
    names the disruption budget; the playbook retries that.
extends_documentation_fragment: [fleetheal.cluster.common]
options:
  name: {description: The Node., type: str, required: true}
  state: {description: What to make true., type: str, required: true, choices: [isolated]}
  fault_id: {description: The taxonomy fault id (the taint's value)., type: str, required: true}
  drain: {description: Also evict the pods and move the Node to the quarantine pool., type: bool, default: false}
  drain_timeout_s: {description: How long to wait for the evicted pods to be gone., type: int, default: 300}
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


#: The module's own options (run_module adds the common ones).
ARGUMENT_SPEC = {
    "name": {"type": "str", "required": True},
    "state": {"type": "str", "required": True, "choices": ["isolated"]},
    "fault_id": {"type": "str", "required": True},
    "drain": {"type": "bool", "default": False},
    "drain_timeout_s": {"type": "int", "default": 300},
}


def main() -> None:
    run_module(ARGUMENT_SPEC, work)


def work(steps, settings, p, dry):
    kube = steps.kube_for(settings)
    results = [steps.k8s_isolate(kube, p["name"], p["fault_id"], dry_run=dry)]
    if p["drain"]:
        results.append(steps.k8s_drain(kube, p["name"], timeout_s=p["drain_timeout_s"], dry_run=dry))
    return results, {}


if __name__ == "__main__":
    main()
