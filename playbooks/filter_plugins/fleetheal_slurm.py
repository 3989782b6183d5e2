"""Filters that parse Slurm's JSON output for the remediation playbooks.

Measured on Debian's Slurm 22.05 (openapi v0.0.38): `squeue --json` and `sinfo --json` ignore their
filter options (`-j`, `-w`, `-t`, `--nodes`) and print everything, so the playbooks select here, by
exact node name and job id, instead of grepping text. Every filter takes the command's stdout (a
string) or the already-decoded document.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ACTIVE_JOB_STATES = ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")


def _doc(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.strip():
        parsed = json.loads(value)
        if isinstance(parsed, dict):
            return parsed
    raise ValueError("expected the JSON document printed by `squeue --json` or `sinfo --json`")


def slurm_node(sinfo: Any, name: str, owned_prefix: str = "fleetheal:") -> dict[str, Any]:
    """One node of `sinfo --json`: name, state (upper case), flags, drained, reason, reason_owned.

    Returns {"found": False, ...} when Slurm does not know the node.
    """
    for node in _doc(sinfo).get("nodes", []):
        if node.get("name") == name:
            flags = [str(f).upper() for f in node.get("state_flags") or []]
            reason = str(node.get("reason") or "")
            return {
                "found": True,
                "name": name,
                "state": str(node.get("state", "unknown")).upper(),
                "flags": flags,
                "drained": "DRAIN" in flags,
                "responding": "NOT_RESPONDING" not in flags and str(node.get("state", "")).upper() != "DOWN",
                "reason": reason,
                "reason_owned": reason.startswith(owned_prefix),
                "comment": str(node.get("comment") or ""),
            }
    return {
        "found": False,
        "name": name,
        "state": "",
        "flags": [],
        "drained": False,
        "responding": False,
        "reason": "",
        "reason_owned": False,
        "comment": "",
    }


def slurm_nodes_with_reason(sinfo: Any, prefix: str) -> list[str]:
    """Names of drained nodes whose reason starts with `prefix` (e.g. the standby pool), sorted."""
    out = []
    for node in _doc(sinfo).get("nodes", []):
        flags = [str(f).upper() for f in node.get("state_flags") or []]
        if "DRAIN" in flags and str(node.get("reason") or "").startswith(prefix):
            out.append(str(node["name"]))
    return sorted(out)


def slurm_nodes_with_comment(sinfo: Any, text: str) -> list[str]:
    """Names of nodes whose comment has the word `text` (how a promotion is tied to its incident), sorted."""
    return sorted(str(n["name"]) for n in _doc(sinfo).get("nodes", []) if text in str(n.get("comment") or "").split())


def _stdout_path(job: dict[str, Any]) -> str:
    """The job's output file with Slurm's filename patterns (%j %A %a %x %u %%) expanded."""
    path = str(job.get("standard_output") or "")
    job_id = str(job.get("job_id", ""))
    if not path:
        cwd = str(job.get("current_working_directory") or "")
        return f"{cwd}/slurm-{job_id}.out" if cwd else ""
    subst = {
        "j": job_id,
        "A": str(job.get("array_job_id") or job_id),
        "a": str(job.get("array_task_id") or ""),
        "x": str(job.get("name") or ""),
        "u": str(job.get("user_name") or ""),
        "%": "%",
    }
    return re.sub(r"%([jAaxu%])", lambda m: subst[m.group(1)], path)


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    allocated = (job.get("job_resources") or {}).get("allocated_nodes") or []
    return {
        "job_id": str(job.get("job_id")),
        "name": str(job.get("name") or ""),
        "user": str(job.get("user_name") or ""),
        "state": str(job.get("job_state") or "").upper(),
        "state_reason": str(job.get("state_reason") or ""),
        "nodes": [str(n.get("nodename")) for n in allocated if n.get("nodename")],
        "required_nodes": str(job.get("required_nodes") or ""),
        "requeue": bool(job.get("requeue")),
        "priority": int(job.get("priority") or 0),
        "restart_cnt": int(job.get("restart_cnt") or 0),
        "comment": str(job.get("comment") or ""),
        "stdout": _stdout_path(job),
    }


def slurm_job(squeue: Any, job_id: Any) -> dict[str, Any]:
    """One job of `squeue --json` by id (summary fields), or {} when Slurm no longer lists it."""
    wanted = str(job_id)
    for job in _doc(squeue).get("jobs", []):
        if str(job.get("job_id")) == wanted:
            return _summary(job)
    return {}


def slurm_job_from(job_id: Any, squeue: Any) -> dict[str, Any]:
    """`slurm_job` with the arguments swapped, for `map('slurm_job_from', squeue)`."""
    return slurm_job(squeue, job_id)


def slurm_jobs_on_node(squeue: Any, node: str) -> list[dict[str, Any]]:
    """Active jobs (running, configuring, completing, suspended) that hold an allocation on `node`."""
    out = []
    for job in _doc(squeue).get("jobs", []):
        summary = _summary(job)
        if summary["state"] in _ACTIVE_JOB_STATES and node in summary["nodes"]:
            out.append(summary)
    return sorted(out, key=lambda j: int(j["job_id"]))


def slurm_max_priority(squeue: Any, exclude: Any = None) -> int:
    """The highest priority among pending and active jobs, leaving out job `exclude`."""
    skip = str(exclude) if exclude is not None else None
    best = 0
    for job in _doc(squeue).get("jobs", []):
        state = str(job.get("job_state") or "").upper()
        if str(job.get("job_id")) == skip or (state != "PENDING" and state not in _ACTIVE_JOB_STATES):
            continue
        best = max(best, int(job.get("priority") or 0))
    return best


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "slurm_node": slurm_node,
            "slurm_nodes_with_reason": slurm_nodes_with_reason,
            "slurm_nodes_with_comment": slurm_nodes_with_comment,
            "slurm_job": slurm_job,
            "slurm_job_from": slurm_job_from,
            "slurm_jobs_on_node": slurm_jobs_on_node,
            "slurm_max_priority": slurm_max_priority,
        }
