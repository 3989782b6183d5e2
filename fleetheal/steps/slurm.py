"""The Slurm steps: drain a node, signal and tell jobs, plan and carry out a requeue (or a restart or a shrink
inside the allocation of a job run by `fleetheal launch`), promote a standby node. Slurm is driven through
`fleetheal.slurm` (`Slurm` is its `Client` with the playbooks' retries, delay and timeout).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetheal import contracts, launch
from fleetheal.slurm import nodes
from fleetheal.slurm.client import Client
from fleetheal.slurm.jobs import JobFileRefused, open_job_file, slurm_max_priority, target_jobs
from fleetheal.slurm.runner import Runner
from fleetheal.steps.result import StepError, StepResult
from fleetheal.steps.settings import Settings

#: Slurm's highest settable priority minus the values it reserves.
MAX_PRIORITY = 4294967293


class Slurm(Client):
    """Slurm's commands (`fleetheal.slurm.client.Client`) with the playbooks' bin dir, environment, retries,
    delay and timeout; its errors are StepErrors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__(
            Runner(
                bin_dir=settings.slurm_bin_dir,
                env={**os.environ, **settings.slurm_env},
                timeout_s=settings.slurm_timeout_s,
                retries=settings.slurm_retries,
                retry_delay_s=settings.slurm_retry_delay_s,
                error=StepError,
                said_chars=300,
            )
        )


def drain_node(slurm: Slurm, node: str, reason: str, *, dry_run: bool = False, sinfo: Any = None) -> StepResult:
    """Drain `node` with an owned reason; never over a reason fleetheal does not own. `sinfo`: a node read
    taken after the caller was asked to act (default: a new one)."""
    info = nodes.read(slurm.sinfo() if sinfo is None else sinfo).get(node)
    if info is None:
        raise StepError(f"Slurm does not know node {node}")
    lent = info.drained and info.reason == contracts.LENT_REASON  # a pool's drain: the fault's reason replaces it
    if info.drained and not info.reason_owned():
        return StepResult(
            "slurm_drain",
            "skipped",
            f"{node} is already drained with reason '{info.reason}', which fleetheal does not own: left as it is",
        )
    if info.drained and not lent:
        return StepResult("slurm_drain", "done", f"{node} is already drained by fleetheal: '{info.reason}'")
    if dry_run:
        return StepResult("slurm_drain", "would", f"would drain {node} with reason '{reason}'")
    slurm.scontrol("update", f"nodename={node}", "state=DRAIN", f"reason={reason}")
    return StepResult("slurm_drain", "done", f"drained {node} with reason '{reason}'", changed=True)


def signal_jobs(slurm: Slurm, job_ids: Sequence[str], signal: str, *, dry_run: bool = False) -> StepResult:
    """One `scancel --batch --signal` for every job at once (it reaches each batch script in ~0.03 s)."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return StepResult("slurm_signal", "skipped", "no active job to signal")
    if dry_run:
        return StepResult("slurm_signal", "would", f"would send {signal} to jobs [{', '.join(ids)}]")
    slurm.scancel_signal(signal, ids)
    return StepResult("slurm_signal", "done", f"sent {signal} to jobs [{', '.join(ids)}]", changed=True)


def append_job_log(path: str, line: str, uid: int) -> str:
    """Append `line` to a job's output file once (O_APPEND: the running job keeps writing to the same file),
    as its owner could (`fleetheal.slurm.jobs.open_job_file`: a regular file of the job's `uid`, no link
    followed). Returns what was done, or raises StepError saying why not."""
    try:
        fd = open_job_file(path, uid, write=True)
    except JobFileRefused as exc:
        raise StepError(f"not writing to the job log: {exc}") from None
    except OSError as exc:
        raise StepError(f"cannot open the job log {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r+b") as fh:
        data = line.encode() + b"\n"
        if os.fstat(fd).st_size <= 4 << 20 and data in (b"\n" + fh.read()):
            return f"{path} already tells it"
        fh.write(data)
    return f"appended to {path}"


def log_action(job: Mapping[str, Any], did: str, incident: str) -> str:
    """Tell a job's owner, in the job's own log, what fleetheal did to the job and why: one line,
    `fleetheal: <did> (incident <id>)`, appended once (`append_job_log`). Returns what was done; a log that
    cannot be written is said, never an error (the action on the job is done already)."""
    if not job.get("stdout"):
        return "no job log to tell"
    try:
        return append_job_log(
            job["stdout"], f"{contracts.DRAIN_REASON_PREFIX} {did} (incident {incident})", int(job["uid"])
        )
    except StepError as exc:
        return f"log not written: {exc}"


def tell_jobs(
    slurm: Slurm, node: str, incident: str, cause: str, *, job_id: str = "", dry_run: bool = False
) -> list[StepResult]:
    """REFUSE_AND_REPORT: put `cause` in the job's comment and its log, and change nothing else.

    The job is `job_id` when the alert names it. Without one, only a node running a single job tells it
    (the fault can only be that job's); with several, none is told: a guess would rewrite other users'
    jobs. A comment already naming the incident is left as it is."""
    jobs = target_jobs(slurm.squeue(), node, job_id)
    if not jobs:
        why = f"job {job_id} is not active on {node}" if job_id else f"no active job on {node}"
        return [StepResult("job_comment", "skipped", why)]
    if not job_id and len(jobs) > 1:
        ids = ", ".join(j["job_id"] for j in jobs)
        return [
            StepResult(
                "job_comment",
                "skipped",
                f"{len(jobs)} jobs run on {node} ({ids}) and the alert names none: none is told",
            )
        ]
    out = []
    for job in jobs:
        jid = job["job_id"]
        if dry_run:
            would = f"would tell job {jid}: '{cause}' (comment and {job['stdout']})"
            out.append(StepResult("job_comment", "would", would))
            continue
        changed = f"incident={incident}" not in job["comment"].split()
        if changed:
            slurm.scontrol("update", f"jobid={jid}", f"comment={cause}{_launch_words(job)}")
        told = "comment" if changed else "comment already names the incident"
        if job["stdout"]:
            try:
                appended = append_job_log(job["stdout"], cause, int(job["uid"]))
                changed = changed or appended.startswith("appended")
                told += "; " + appended
            except StepError as exc:
                told += f"; log not written: {exc}"
        out.append(StepResult("job_comment", "done", f"told job {jid}: '{cause}' ({told})", changed=changed))
    return out


@dataclass(frozen=True)
class RequeuePlan:
    """What `requeue_plan` decided: results for the jobs left alone, the jobs to requeue, their priority."""

    results: list[StepResult]
    jobs: list[dict[str, Any]]
    priority: int
    node: str = ""


def requeue_plan(slurm: Slurm, node: str, incident: str, *, job_id: str = "", squeue: Any = None) -> RequeuePlan:
    """The jobs an action on `node` hits, less those already requeued for `incident` (their comment names
    it), submitted with --no-requeue, or at their restart limit (each of those gets a result saying why)."""
    s = slurm.settings
    doc = squeue if squeue is not None else slurm.squeue()
    jobs = target_jobs(doc, node, job_id)
    if not jobs:
        what = f"job {job_id} is not active on {node}" if job_id else f"no active job on {node}"
        return RequeuePlan([StepResult("slurm_requeue", "skipped", what)], [], 0, node)
    results: list[StepResult] = []
    act: list[dict[str, Any]] = []
    for job in jobs:
        jid = job["job_id"]
        if f"incident={incident}" in job["comment"].split() and not _shrink_pending(job, node):
            results.append(
                StepResult("slurm_requeue", "done", f"job {jid} was already requeued for incident {incident}")
            )
        elif not job["requeue"]:
            results.append(
                StepResult("slurm_requeue", "skipped", f"job {jid} not requeued: submitted with --no-requeue")
            )
        elif restarts(job) >= s.max_restarts:
            why = f"restart limit reached ({restarts(job)} of {s.max_restarts}) counting restarts in the job"
            results.append(StepResult("slurm_requeue", "skipped", f"job {jid} not requeued: {why}"))
        else:
            act.append(job)
    return RequeuePlan(results, act, min(slurm_max_priority(doc) + s.priority_boost, MAX_PRIORITY), node)


def restarts(job: Mapping[str, Any]) -> int:
    """Every restart the retry limit counts: Slurm's requeues and the launcher's restarts in the job."""
    return int(job["restart_cnt"]) + _in_job_restarts(job["comment"])


def _in_job_restarts(comment: str) -> int:
    return launch.word_count(comment, launch.RESTARTS_WORD) or 0


def _launch_words(job: Mapping[str, Any], *, restarted: bool = False) -> str:
    """The comment words a new comment keeps: the job's checkpoint store, and `fleetheal launch`'s (with one
    more restart in the job)."""
    comment = job["comment"]
    store = [w for w in comment.split() if w.startswith(contracts.CHECKPOINT_WORD)][:1]
    if launch.TAG not in comment.split():
        return " " + store[0] if store else ""
    words = [*store, launch.TAG]
    needed = launch.needed_nodes(comment)
    if needed is not None:
        words.append(f"{launch.NODES_WORD}{needed}")
    in_job = _in_job_restarts(comment) + (1 if restarted else 0)
    if in_job:
        words.append(f"{launch.RESTARTS_WORD}{in_job}")
    return " " + " ".join(words)


def can_shrink(job: Mapping[str, Any], node: str) -> bool:
    """A job run by `fleetheal launch --nodes N` that still has N nodes without `node`, and whose batch
    script (the launcher) does not run on `node`, is relocated inside its allocation instead of requeued."""
    words = job["comment"].split()
    needed = launch.needed_nodes(job["comment"])
    rest = [n for n in job["nodes"] if n != node]
    return (
        launch.TAG in words
        and needed is not None
        and node in job["nodes"]
        and bool(job["batch_host"])
        and job["batch_host"] != node
        and len(rest) >= needed
    )


def _shrink_pending(job: Mapping[str, Any], node: str) -> bool:
    """The order to shrink `node` away is in the job's comment, but the node is still allocated to it
    (the step stopped between the order and the shrink): the shrink is done again."""
    return launch.word_value(job["comment"], launch.SHRINK_WORD) == node and node in job["nodes"]


def shrink_in_job(slurm: Slurm, job: Mapping[str, Any], node: str, incident: str, fault_id: str) -> StepResult:
    """Relocate a job inside its allocation: the incident and the node to drop go into its comment, the
    restart order to its launcher, then `node` leaves the allocation. The launcher restarts the command on
    the nodes that remain (it waits for the shrink); no requeue, no scheduler, no credential wait."""
    jid = job["job_id"]
    rest = [n for n in job["nodes"] if n != node]
    needed = launch.needed_nodes(job["comment"])
    comment = (
        f"{contracts.DRAIN_REASON_PREFIX} shrunk away from {node} after {fault_id}"
        f"{_launch_words(job, restarted=True)} {launch.SHRINK_WORD}{node} incident={incident} "
        f"{launch.ORDER_WORD}{incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    slurm.scontrol("update", f"jobid={jid}", "nodelist=" + ",".join(rest))
    did = f"relocated job {jid} inside its allocation: {node} shrunk away, restarted on {','.join(rest)}"
    told = log_action(job, f"{did}, after {fault_id} on {node}", incident)
    return StepResult("slurm_requeue", "done", f"{did} ({needed} needed; fleetheal launch); {told}", changed=True)


def requeue_now(
    slurm: Slurm, plan: RequeuePlan, node: str, incident: str, fault_id: str, *, same_nodes: bool = False
) -> list[StepResult]:
    """Requeue the planned jobs with one command, then boost each one's priority and name the incident in
    its comment. A job relocated away from `node` has it excluded; a job restarted in place keeps its
    nodes, and its start waits for Slurm's own begin time after a requeue (the credentials of its previous
    run must have expired on those nodes: starting sooner is refused with "Job credential revoked")."""
    s = slurm.settings
    results: list[StepResult] = []
    jobs = plan.jobs
    if same_nodes:
        in_job = [j for j in jobs if launch.TAG in j["comment"].split()]
        jobs = [j for j in jobs if j not in in_job]
        results = [restart_in_job(slurm, j, node, incident, fault_id) for j in in_job]
    else:
        shrunk = [j for j in jobs if can_shrink(j, node)]
        jobs = [j for j in jobs if j not in shrunk]
        results = [shrink_in_job(slurm, j, node, incident, fault_id) for j in shrunk]
    if not jobs:
        return results
    comment = f"{contracts.DRAIN_REASON_PREFIX} requeued after {fault_id} on {node} incident={incident}"
    commands: list[tuple[str, ...]] = [("requeue", ",".join(j["job_id"] for j in jobs))]
    for job in jobs:
        # The boost and the comment (a job run by `fleetheal launch` keeps the words that say so) go to
        # the job once it is pending again, in the same batch as its requeue.
        args = [
            "update",
            f"jobid={job['job_id']}",
            f"priority={plan.priority}",
            f"comment={comment}{_launch_words(job)}",
        ]
        args.append("reqnodelist=" + ",".join(job["nodes"]) if same_nodes else f"excnodelist={node}")
        commands.append(tuple(args))
    slurm.scontrol_seq(commands)
    for job in jobs:
        where = " on " + ",".join(job["nodes"]) if same_nodes else ""
        # fleetheal.remediator.engine.REQUEUED reads the job id back from this text: keep them in step.
        detail = f"sent {s.grace_signal} to job {job['job_id']}, requeued it{where} with priority {plan.priority}"
        moved = "restarts on the same nodes" if same_nodes else f"restarts on other nodes than {node}"
        told = log_action(job, f"requeued job {job['job_id']} after {fault_id} on {node}: it {moved}", incident)
        results.append(StepResult("slurm_requeue", "done", f"{detail}; {told}", changed=True))
    return results


def restart_in_job(slurm: Slurm, job: dict[str, Any], node: str, incident: str, fault_id: str) -> StepResult:
    """Restart a job run by `fleetheal launch` inside its allocation: no requeue, no credential wait.

    The incident goes into the job's comment first, then the restart order (SIGUSR2 to the batch step,
    which is the launcher); the launcher restarts once per incident, so sending it twice is harmless.
    """
    jid = job["job_id"]
    comment = (
        f"{contracts.DRAIN_REASON_PREFIX} restarted in job after {fault_id} on {node}"
        f"{_launch_words(job, restarted=True)} incident={incident} {launch.ORDER_WORD}{incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    did = f"restarted job {jid} in its allocation on {','.join(job['nodes'])}"
    told = log_action(job, f"{did}, after {fault_id} on {node}", incident)
    return StepResult("slurm_requeue", "done", f"{did} (fleetheal launch); {told}", changed=True)


def requeue_would(slurm: Slurm, plan: RequeuePlan, *, same_nodes: bool = False) -> list[StepResult]:
    """What a dry run reports for the planned jobs."""
    s = slurm.settings

    def would(j: dict[str, Any]) -> str:
        then = f"wait {s.grace_seconds:g} s"
        if same_nodes and launch.TAG in j["comment"].split():
            return f"would send {s.grace_signal} to job {j['job_id']}, {then}, restart it in its allocation"
        if not same_nodes and can_shrink(j, plan.node):
            return (
                f"would send {s.grace_signal} to job {j['job_id']}, {then}, shrink {plan.node} away from its "
                "allocation and restart it on the rest"
            )
        where = " on " + ",".join(j["nodes"]) if same_nodes else ""
        return (
            f"would send {s.grace_signal} to job {j['job_id']}, {then}, requeue it{where} with priority {plan.priority}"
        )

    return [StepResult("slurm_requeue", "would", would(j)) for j in plan.jobs]


def requeue_jobs(
    slurm: Slurm,
    node: str,
    incident: str,
    fault_id: str,
    *,
    job_id: str = "",
    same_nodes: bool = False,
    dry_run: bool = False,
) -> list[StepResult]:
    """Grace signal (every job at once), grace period, requeue and priority boost: `requeue_plan`,
    `signal_jobs`, the grace period, `requeue_now`. (The first responder runs the same sequence with an
    asynchronous grace period, so that waiting holds no thread.)"""
    s = slurm.settings
    plan = requeue_plan(slurm, node, incident, job_id=job_id)
    if dry_run:
        return plan.results + requeue_would(slurm, plan, same_nodes=same_nodes)
    if not plan.jobs:
        return plan.results
    signalled = signal_jobs(slurm, [j["job_id"] for j in plan.jobs], s.grace_signal)
    if s.grace_seconds > 0:
        time.sleep(s.grace_seconds)
    return [*plan.results, signalled, *requeue_now(slurm, plan, node, incident, fault_id, same_nodes=same_nodes)]


_PROMOTE_LOCK = threading.Lock()
#: Standby nodes this process promoted -> when their resume ended (infinity while it runs), guarded by
#: _PROMOTE_LOCK. A `sinfo` read that started before then may still show the node as standby, so in that
#: read it is not free: concurrent promotions (the first responder's, across incidents) never pick the
#: same node, and they share their reads.
_CLAIMED: dict[str, float] = {}


def promote_standby(
    slurm: Slurm, node: str, incident: str, *, dry_run: bool = False, read: tuple[float, Any] | None = None
) -> StepResult:
    """Resume one warm-standby node (drained with the owned standby reason) in place of `node`, once per
    incident (the promoted node's Extra field names it). `read`: `Slurm.sinfo_at()` taken after the caller was
    asked to act (default: a new one); promotions claimed since it was taken are not picked again."""
    s = slurm.settings
    taken, read_nodes = slurm.sinfo_at() if read is None else read
    pool = nodes.read(read_nodes)
    with _PROMOTE_LOCK:
        done = pool.with_extra(f"incident={incident}")
        if done:
            detail = f"{', '.join(done)} already promoted for incident {incident}"
            return StepResult("standby_promote", "done", detail, node=done[0])
        for name in [n for n, ended in _CLAIMED.items() if ended < taken]:
            del _CLAIMED[name]  # this read shows what its resume did
        free = [n for n in pool.with_reason(s.standby_reason) if n != node and n not in _CLAIMED]
        if not free:
            return StepResult(
                "standby_promote", "skipped", f"no standby node (drained with reason '{s.standby_reason}') to promote"
            )
        pick = free[0]
        if dry_run:
            k8s = (
                f", label it {contracts.LABEL_POOL}=active and remove its {contracts.TAINT_STANDBY} taint"
                if s.kubernetes
                else ""
            )
            detail = f"would promote standby node {pick} (resume it{k8s}) in place of {node}"
            return StepResult("standby_promote", "would", detail, node=pick)
        _CLAIMED[pick] = float("inf")
    # In the node's Extra field, not its comment: Slinky's operator rewrites the comment with its pod's identity.
    record = f"{contracts.DRAIN_REASON_PREFIX} promoted for {node} incident={incident}"
    try:
        slurm.scontrol("update", f"nodename={pick}", "state=RESUME", f"extra={record}")
    except BaseException:
        with _PROMOTE_LOCK:  # not resumed: free again
            _CLAIMED.pop(pick, None)
        raise
    with _PROMOTE_LOCK:
        _CLAIMED[pick] = time.monotonic()
    detail = f"promoted standby node {pick} in place of {node}"
    return StepResult("standby_promote", "done", detail, changed=True, node=pick)
