"""Filters that parse Slurm's JSON output for the remediation playbooks.

The parsing lives in `fleetheal.steps` (the first responder and the fleetheal.cluster modules use it):
`squeue --json` and `sinfo --json` of Slurm 22.05 ignore their filter options, so the playbooks select
here, by exact node name and job id. Every filter takes the command's stdout or the decoded document.
"""

from __future__ import annotations

from typing import Any

from fleetheal.steps import slurm_job, slurm_jobs_on_node, slurm_node


def slurm_job_from(job_id: Any, squeue: Any) -> dict[str, Any]:
    """`slurm_job` with the arguments swapped, for `map('slurm_job_from', squeue)`."""
    return slurm_job(squeue, job_id)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "slurm_node": slurm_node,
            "slurm_job": slurm_job,
            "slurm_job_from": slurm_job_from,
            "slurm_jobs_on_node": slurm_jobs_on_node,
        }
