"""The one reader of Slurm's jobs.

- `squeue --json` (`document`, `slurm_job`, `slurm_jobs_on_node`, `target_jobs`, `slurm_max_priority`): the
  remediator's steps and the playbooks' filters. Debian's Slurm 22.05 (openapi v0.0.38) ignores the filter
  options of `squeue --json` and prints every job, so selection happens here, by exact job id and node name.
  The fields whose shape a data parser changes (22.05's v0.0.38 to 26.05's v0.0.45) are read by `job_state`,
  `job_nodes` and `fields.number`: the only places that know how a data parser shapes a job's field.
- The fleet's queue (`FLEET_SQUEUE_ARGS`, `parse_queue`): `squeue -M all` text, one `CLUSTER:` section each.
- Where a federated job's copies are (`COPIES_ARGS`, `copies`): `squeue -M all --local`.
- One cluster's jobs in given states, with their nodes and comment (`cluster_jobs_args`, `parse_cluster_jobs`):
  `squeue -M CLUSTER -o %i|%T|%N|%k`, what cross-cluster failover moves.
- One job's fields (`one_job`, `job_comment`, `job_allocation`): `squeue --jobs J --format`, text, since
  22.05's `squeue --json` ignores `--jobs` and would return every job of the cluster (measured). `fleetheal
  launch` reads its own job this way.
- `scontrol show job -o` lines are read by `fields.parse_kv_line`.
- A job's output file, opened as its owner could (`open_job_file`): the remediator appends its one line per
  action to it, the agent follows it for faults the job printed.

Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetheal.slurm.fields import SEP, number
from fleetheal.slurm.gres import tres_gpus
from fleetheal.slurm.runner import Runner

ACTIVE_STATES = ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")


#: A job's state flags that Slurm's own text shows instead of its base state, first match wins (the order of
#: `job_state_string` in Slurm's slurm_protocol_defs.c): a requeued job that is still completing is COMPLETING.
_JOB_FLAG_NAMES = (
    "COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING",
)  # fmt: skip


def job_state(value: Any) -> str:
    """A job's state as one upper-case word, as `squeue -o %T` prints it: v0.0.38 gives that word
    (`"RUNNING"`); from v0.0.39 a list of the base state and its flags (`["PENDING", "REQUEUED"]`)."""
    if isinstance(value, list):
        words = [str(w).upper() for w in value]
        return next((f for f in _JOB_FLAG_NAMES if f in words), words[0] if words else "")
    return str(value or "").upper()


def job_nodes(job: Mapping[str, Any]) -> list[str]:
    """The nodes a job of `squeue --json` holds: v0.0.38 `job_resources.allocated_nodes[].nodename`; from
    v0.0.40 `job_resources.nodes.allocation[].name`."""
    resources = job.get("job_resources") or {}
    if isinstance(resources.get("nodes"), Mapping):
        return [str(a["name"]) for a in resources["nodes"].get("allocation") or [] if a.get("name")]
    return [str(n["nodename"]) for n in resources.get("allocated_nodes") or [] if n.get("nodename")]


def document(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.strip():
        parsed = json.loads(value)
        if isinstance(parsed, dict):
            return parsed
    raise ValueError("expected the JSON document printed by `squeue --json`")


_MEMO = "_fleetheal_index"


def _memo(doc: dict[str, Any], key: str, build: Callable[[dict[str, Any]], Any]) -> Any:
    """What `build` derives from `doc`, built once per document: a storm's first responses share one read
    of the fleet, and scanning it whole for each of N incidents made the storm quadratic. Concurrent
    callers may both build; they build the same thing."""
    memo = doc.setdefault(_MEMO, {})
    if key not in memo:
        memo[key] = build(doc)
    return memo[key]


def _stdout_path(job: dict[str, Any]) -> str:
    """The job's output file with Slurm's filename patterns (%j %A %a %x %u %%) expanded. Slurm's default
    when the job named none (22.05 prints "", 26.05 the pattern itself) is `slurm-%j.out`, `slurm-%A_%a.out`
    for an array task; a relative path is relative to the job's working directory."""
    job_id = str(job.get("job_id", ""))
    task = number(job.get("array_task_id"), -1)
    path = str(job.get("standard_output") or "") or ("slurm-%A_%a.out" if task >= 0 else "slurm-%j.out")
    subst = {
        "j": job_id,
        "A": str(number(job.get("array_job_id")) or job_id),
        "a": "" if task < 0 else str(task),
        "x": str(job.get("name") or ""),
        "u": str(job.get("user_name") or ""),
        "%": "%",
    }
    path = re.sub(r"%([jAaxu%])", lambda m: subst[m.group(1)], path)
    if not path.startswith("/"):
        cwd = str(job.get("current_working_directory") or "")
        return f"{cwd.rstrip('/')}/{path}" if cwd else ""
    return path


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    uid = job.get("user_id")
    return {
        "job_id": str(job.get("job_id")),
        "name": str(job.get("name") or ""),
        "user": str(job.get("user_name") or ""),
        "state": job_state(job.get("job_state")),
        "state_reason": str(job.get("state_reason") or ""),
        "nodes": job_nodes(job),
        "batch_host": str(job.get("batch_host") or ""),
        "required_nodes": str(job.get("required_nodes") or ""),
        "excluded_nodes": str(job.get("excluded_nodes") or ""),
        "requeue": bool(job.get("requeue")),
        "priority": number(job.get("priority")),
        "restart_cnt": number(job.get("restart_cnt")),
        "comment": str(job.get("comment") or ""),
        "stdout": _stdout_path(job),
        "uid": -1 if uid is None else int(uid),
    }


def _jobs_by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for job in doc.get("jobs", []):
        by_id.setdefault(str(job.get("job_id")), _summary(job))
    return by_id


def _active_jobs_by_node(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    by_node: dict[str, list[dict[str, Any]]] = {}
    for job in sorted(_memo(doc, "jobs", _jobs_by_id).values(), key=lambda j: int(j["job_id"])):
        if job["state"] in ACTIVE_STATES:
            for node in dict.fromkeys(job["nodes"]):
                by_node.setdefault(node, []).append(job)
    return by_node


def _copy(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "nodes": list(job["nodes"])}  # the caller's own: the index is shared


def slurm_job(squeue: Any, job_id: Any) -> dict[str, Any]:
    """One job of `squeue --json` by id (summary fields), or {} when Slurm no longer lists it."""
    job = _memo(document(squeue), "jobs", _jobs_by_id).get(str(job_id))
    return _copy(job) if job else {}


def slurm_jobs_on_node(squeue: Any, node: str) -> list[dict[str, Any]]:
    """Active jobs (running, configuring, completing, suspended) that hold an allocation on `node`."""
    return [_copy(j) for j in _memo(document(squeue), "on_node", _active_jobs_by_node).get(node, [])]


def _max_priority(doc: dict[str, Any]) -> int:
    best = 0
    for job in doc.get("jobs", []):
        state = job_state(job.get("job_state"))
        if state != "PENDING" and state not in ACTIVE_STATES:
            continue
        best = max(best, number(job.get("priority")))
    return best


def slurm_max_priority(squeue: Any) -> int:
    """The highest priority among pending and active jobs."""
    return int(_memo(document(squeue), "max_priority", _max_priority))


def target_jobs(squeue: Any, node: str, job_id: str = "") -> list[dict[str, Any]]:
    """The jobs an action on `node` hits: job `job_id` alone when given (and still active there), else
    every active job on the node. A job-scoped fault never reaches the node's other jobs."""
    if job_id:
        job = slurm_job(squeue, job_id)
        return [job] if job and job["state"] in ACTIVE_STATES and node in job["nodes"] else []
    return slurm_jobs_on_node(squeue, node)


# --- the fleet's queue: `squeue -M all` -----------------------------------------------------------------------

#: `tres-alloc` is what a running job holds and what a pending one asks for (squeue(1)).
_QUEUE_FIELDS = ("JobID", "State", "QOS", "tres-alloc")
#: `-r`: one line per array task, so a pending array counts as the jobs it will become.
FLEET_SQUEUE_ARGS = ("-M", "all", "-r", "-t", "PENDING,RUNNING", "-O", ",".join(f"{f}:{SEP}" for f in _QUEUE_FIELDS))
QUEUE_STATES = ("pending", "running")


@dataclass(frozen=True)
class QueuedJob:
    """One job (or array task) of a cluster's queue."""

    id: str
    state: str  # pending, running
    qos: str
    gpus: int


def parse_queue(text: str) -> tuple[QueuedJob, ...]:
    """One cluster's section of `squeue FLEET_SQUEUE_ARGS`."""
    out: list[QueuedJob] = []
    for line in text.splitlines():
        fields = line.split(SEP)
        if len(fields) < len(_QUEUE_FIELDS):
            continue
        job_id, state, qos, tres = (f.strip() for f in fields[: len(_QUEUE_FIELDS)])
        state = state.lower()
        if not job_id or state not in QUEUE_STATES:
            continue
        out.append(QueuedJob(job_id, state, qos, tres_gpus(tres)))
    return tuple(out)


# --- a federated job's copies: `squeue -M all --local` -----------------------------------------------------------

#: With `-h` squeue drops the CLUSTER headers, so they are kept and the column header skipped.
COPIES_ARGS = ("-M", "all", "--local", "-t", "all", "-o", "%i|%T")


def copies(text: str, job_id: str) -> dict[str, str]:
    """{cluster: state} of every copy of `job_id` in what `squeue COPIES_ARGS` printed (each controller's own
    view). The origin keeps a REVOKED copy of a job that runs on a sibling."""
    found: dict[str, str] = {}
    cluster = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("CLUSTER:"):
            cluster = line.split(":", 1)[1].strip()
        elif "|" in line:
            jid, state = line.split("|", 1)
            if jid == job_id and cluster:  # the column header "JOBID|STATE" never matches
                found[cluster] = state
    return found


# --- one cluster's jobs: `squeue -M CLUSTER -o %i|%T|%N|%k` -----------------------------------------------------


@dataclass(frozen=True)
class ClusterJob:
    """A job of one cluster as `squeue cluster_jobs_args(...)` prints it."""

    job_id: str
    state: str
    nodes: str
    comment: str


def cluster_jobs_args(cluster: str, states: Sequence[str], node: str = "") -> list[str]:
    """squeue's arguments for `cluster`'s jobs in `states` (on `node` only, when given); the comment comes last:
    it is free text."""
    argv = ["-M", cluster, "-h", "-t", ",".join(states), "-o", "%i|%T|%N|%k"]
    return [*argv, "-w", node] if node else argv


def parse_cluster_jobs(text: str) -> list[ClusterJob]:
    """What `squeue cluster_jobs_args(...)` printed, one ClusterJob a line (a `|` in the comment is kept)."""
    jobs = []
    for line in text.splitlines():
        parts = line.split("|", 3)
        if len(parts) == 4 and parts[0].strip():
            jobs.append(ClusterJob(parts[0].strip(), parts[1], parts[2], parts[3].strip()))
    return jobs


# --- one job's fields: `squeue --jobs J --format` ----------------------------------------------------------------


def one_job(runner: Runner, job: str, fmt: str, *more: str) -> str | None:
    """One job's fields (`squeue --format`), or None when squeue fails."""
    out = runner.completed("squeue", "--noheader", "--jobs", job, "--format", fmt, *more)
    return out.stdout.strip() if out.returncode == 0 else None


def job_comment(runner: Runner, job: str) -> str | None:
    """A job's comment ("" when none), or None when squeue fails."""
    comment = one_job(runner, job, "%k")
    return "" if comment == "(null)" else comment


def job_allocation(runner: Runner, job: str) -> tuple[str, str] | None:
    """(node count, node list) of a job's allocation, or None when squeue fails or prints no such pair."""
    count, _, nodelist = (one_job(runner, job, "%D %N") or "").partition(" ")
    return (count, nodelist) if count.isdigit() and nodelist else None


class JobFileRefused(OSError):
    """A job's output file that is not what Slurm would have made for the job's user."""


def open_job_file(path: str, uid: int, *, write: bool = False) -> int:
    """A descriptor of job output file `path`, opened as the job's owner could reach it, or JobFileRefused /
    OSError saying why not. The file must be a regular file owned by the job's `uid` with one link, and it is
    opened without following a symlink, without blocking (a FIFO) and without becoming a terminal: a job
    cannot point its log at a file of someone else's (the remediator's database, a system file, a device),
    to have it written by the remediator or read by the agent. `write`: for appending (O_APPEND)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):  # not even opened: opening a device can act on it
        raise JobFileRefused(f"{path} is not a regular file")
    mode = (os.O_RDWR | os.O_APPEND) if write else os.O_RDONLY
    fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
        os.close(fd)
        raise JobFileRefused(f"{path} is not a regular file of the job's user (uid {uid}) with one link")
    return fd
