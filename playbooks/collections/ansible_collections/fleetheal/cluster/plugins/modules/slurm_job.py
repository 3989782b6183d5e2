#!/usr/bin/python
"""fleetheal.cluster.slurm_job: requeue, signal or tell the jobs a fault on a node hits."""

from __future__ import annotations

from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import run_module

DOCUMENTATION = r"""
module: slurm_job
short_description: Grace-signal and requeue (or only signal) the jobs a fault on a node hits
description:
  - The step of C(fleetheal.steps) the remediator's first responder runs, as a module.
  - The jobs are O(job_id) alone when given (a fault raised by that job's own reports), else every active job on
    O(node).
  - C(requeued) sends every job its grace signal with one command, waits the grace period, requeues them with one
    command, boosts their priority and names the incident in their comment; jobs already requeued for O(incident),
    submitted with --no-requeue or at their restart limit are left alone, with the reason.
  - A job run by C(fleetheal launch) is restarted inside its allocation instead of requeued, on the same nodes
    (O(same_nodes)) or, when it holds spare nodes (C(fleetheal launch --nodes N)), on its other nodes after O(node)
    is shrunk away from it.
  - C(signalled) only sends the grace signal.
  - C(told) (REFUSE_AND_REPORT) puts O(cause) in the job's comment and appends it once to the job's output file,
    and changes nothing else. Without O(job_id), only a node running a single job tells it. The file must be a
    regular file of the job's user, opened without following a symlink.
extends_documentation_fragment: [fleetheal.cluster.common]
options:
  node: {description: The node the fault is on., type: str, required: true}
  state: {description: What to do., type: str, required: true, choices: [requeued, signalled, told]}
  incident: {description: The incident id., type: str, required: true}
  fault_id: {description: The taxonomy fault id (named in the comment)., type: str, required: true}
  job_id: {description: Only this job (empty for every job on the node)., type: str, default: ""}
  same_nodes: {description: Keep the job on its nodes instead of relocating it., type: bool, default: false}
  cause: {description: For C(told), the words for the job's owner., type: str, default: ""}
"""

EXAMPLES = r"""
- name: Requeue every job on n2 elsewhere
  fleetheal.cluster.slurm_job:
    node: n2
    state: requeued
    incident: inc-000001
    fault_id: xid-79
"""

RETURN = r"""
steps:
  description: Report rows (step, outcome done|would|skipped|failed, detail).
  type: list
  returned: always
"""


#: The module's own options (run_module adds the common ones).
ARGUMENT_SPEC = {
    "node": {"type": "str", "required": True},
    "state": {"type": "str", "required": True, "choices": ["requeued", "signalled", "told"]},
    "incident": {"type": "str", "required": True},
    "fault_id": {"type": "str", "required": True},
    "job_id": {"type": "str", "default": ""},
    "same_nodes": {"type": "bool", "default": False},
    "cause": {"type": "str", "default": ""},
}


def main() -> None:
    run_module(ARGUMENT_SPEC, work)


def work(steps, settings, p, dry):
    slurm = steps.Slurm(settings)
    if p["state"] == "requeued":
        args = (slurm, p["node"], p["incident"], p["fault_id"])
        return steps.requeue_jobs(*args, job_id=p["job_id"], same_nodes=p["same_nodes"], dry_run=dry), {}
    if p["state"] == "told":
        return steps.tell_jobs(slurm, p["node"], p["incident"], p["cause"], job_id=p["job_id"], dry_run=dry), {}
    from fleetheal.slurm.jobs import target_jobs

    jobs = target_jobs(slurm.squeue(), p["node"], p["job_id"])
    return [steps.signal_jobs(slurm, [j["job_id"] for j in jobs], settings.grace_signal, dry_run=dry)], {}


if __name__ == "__main__":
    main()
