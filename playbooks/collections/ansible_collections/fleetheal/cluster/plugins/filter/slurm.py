"""Filters that read Slurm's output for the remediation playbooks (`fleetheal.cluster.slurm_node`...).

Nodes are read by `fleetheal.slurm.nodes` and jobs by `fleetheal.steps`, the code the remediator's first
responder runs: filters run in the controller, on the remediator host, whose Python has fleetheal installed
(the collection's modules import it too). `squeue --json` of Slurm 22.05 ignores its filter options, so the
playbooks select here, by exact node name and job id. Every filter takes the command's stdout or the
decoded document.
"""

from __future__ import annotations

from typing import Any

from fleetheal import contracts
from fleetheal.slurm import nodes as slurm_nodes
from fleetheal.slurm.jobs import slurm_job, slurm_jobs_on_node


def sinfo_argv(sbin: str) -> list[str]:
    """The node read (`fleetheal.slurm.nodes.NODES_ARGS`, the first responder's; 1,500 nodes print 44 kB,
    `sinfo --json` 1.8 MB, which every incident of a batch run would carry and parse); `sbin`: "" or the
    Slurm bin directory with its trailing slash."""
    return slurm_nodes.sinfo_argv(f"{sbin}sinfo")


def slurm_node(nodes: Any, name: str, owned_prefix: str = contracts.DRAIN_REASON_PREFIX) -> dict[str, Any]:
    """`fleetheal.slurm.nodes.slurm_node`: found, name, state, flags, drained, responding, reason,
    reason_owned (by `owned_prefix`), comment."""
    return slurm_nodes.slurm_node(nodes, name, owned_prefix)


def slurm_job_from(job_id: Any, squeue: Any) -> dict[str, Any]:
    """`slurm_job` with the arguments swapped, for `map('fleetheal.cluster.slurm_job_from', squeue)`."""
    return slurm_job(squeue, job_id)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "sinfo_argv": sinfo_argv,
            "slurm_node": slurm_node,
            "slurm_job": slurm_job,
            "slurm_job_from": slurm_job_from,
            "slurm_jobs_on_node": slurm_jobs_on_node,
        }
