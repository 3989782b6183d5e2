"""Filters that parse Slurm's output for the remediation playbooks.

The parsing lives in `fleetheal.steps` (the first responder and the fleetheal.cluster modules use it):
`squeue --json` and `sinfo --json` of Slurm 22.05 ignore their filter options, so the playbooks select
here, by exact node name and job id. Every filter takes the command's stdout or the decoded document.
"""

from __future__ import annotations

from typing import Any

from fleetheal import contracts, steps
from fleetheal.steps import slurm_job, slurm_jobs_on_node


def sinfo_argv(sbin: str) -> list[str]:
    """The node read: `sinfo` with `steps.SINFO_NODES_ARGS` (the first responder's; 1,500 nodes print 44 kB,
    `sinfo --json` 1.8 MB, which every incident of a batch run would carry and parse)."""
    return [f"{sbin}sinfo", *steps.SINFO_NODES_ARGS]


def slurm_node(sinfo: Any, name: str, owned_prefix: str = contracts.DRAIN_REASON_PREFIX) -> dict[str, Any]:
    """`steps.slurm_node` of the text `sinfo_argv` prints (or of `sinfo --json`)."""
    if isinstance(sinfo, str) and not sinfo.lstrip().startswith("{"):
        sinfo = steps.parse_sinfo_nodes(sinfo)
    return steps.slurm_node(sinfo, name, owned_prefix)


def slurm_job_from(job_id: Any, squeue: Any) -> dict[str, Any]:
    """`slurm_job` with the arguments swapped, for `map('slurm_job_from', squeue)`."""
    return slurm_job(squeue, job_id)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "fleetheal_sinfo_argv": sinfo_argv,
            "slurm_node": slurm_node,
            "slurm_job": slurm_job,
            "slurm_job_from": slurm_job_from,
            "slurm_jobs_on_node": slurm_jobs_on_node,
        }
