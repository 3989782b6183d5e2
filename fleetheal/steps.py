"""Remediation steps, written once: the remediator's first responder calls them in-process, and the
playbooks reach them as modules of the repository's collection (`fleetheal.cluster.slurm_node`,
`fleetheal.cluster.slurm_job`, `fleetheal.cluster.k8s_node`), so a human running a runbook does exactly
what the remediator does.

Every step is idempotent per incident (the incident id is written into the Slurm comment of what it
changed, and a step that finds it there reports `done` without acting again), returns `StepResult`s in
the shape of the playbooks' report (`{"step", "outcome", "detail"}`, outcome done | would | skipped |
failed), and honours a dry run ("would ...", nothing changed).

Slurm is driven through its own commands (`fleetheal.slurm`: `scontrol`, `scancel`, `squeue --json` and `sinfo`
read by its job and node readers), with the retries, delay and timeout of `playbooks/vars/remediation.yml`.
Kubernetes through the official client.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetheal import contracts, kubeclient, launch
from fleetheal.slurm import nodes as slurm_nodes
from fleetheal.slurm.client import Client
from fleetheal.slurm.jobs import slurm_max_priority, target_jobs
from fleetheal.slurm.runner import Runner

#: Slurm's highest settable priority minus the values it reserves.
MAX_PRIORITY = 4294967293


class StepError(RuntimeError):
    """A Slurm or Kubernetes command failed after its retries."""


@dataclass(frozen=True, slots=True)
class StepResult:
    step: str  # slurm_drain, slurm_signal, slurm_requeue, standby_promote, k8s_cordon, k8s_promote
    outcome: str  # done | would | skipped | failed
    detail: str
    changed: bool = False
    #: for a promotion: the standby node promoted for the incident (now or by an earlier run)
    node: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"step": self.step, "outcome": self.outcome, "detail": self.detail}


# --- settings: one source, the playbooks' own defaults ------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The playbook variables the steps need, defaults from `playbooks/vars/remediation.yml`."""

    slurm_env: Mapping[str, str] = field(default_factory=dict)
    slurm_bin_dir: str = ""
    slurm_retries: int = 3
    slurm_retry_delay_s: float = 2.0
    slurm_timeout_s: float = 30.0
    grace_signal: str = "USR1"
    grace_seconds: float = 120.0
    priority_boost: int = 1000
    max_restarts: int = 3
    restart_mode: str = "requeue"
    standby_reason: str = contracts.DRAIN_REASON_PREFIX + "standby"
    quarantine_reason: str = contracts.DRAIN_REASON_PREFIX + "quarantine"
    promote_standby: bool = True
    kubeconfig: str = ""
    k8s_in_cluster: bool = False
    report_dir: str = "/var/lib/fleetheal/reports"

    @classmethod
    def from_vars(cls, values: Mapping[str, Any]) -> Settings:
        """From playbook variables (`fleetheal_<name>`); names it does not use are ignored."""
        kwargs: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            key = f"fleetheal_{f.name}"
            if key not in values:
                continue
            raw = values[key]
            if isinstance(raw, str):
                # vars/remediation.yml writes the owned pool reasons with the one template Ansible would
                # render from the contract; any other template cannot be rendered outside Ansible.
                raw = raw.replace("{{ fleetheal_drain_reason_prefix }}", contracts.DRAIN_REASON_PREFIX)
                if "{{" in raw or "{%" in raw:
                    raise ValueError(f"{key}: {raw!r} is a Jinja template; give the remediator a plain value")
            default = getattr(cls, f.name, None)
            if f.name == "slurm_env":
                kwargs[f.name] = {str(k): str(v) for k, v in dict(raw or {}).items()}
            elif isinstance(default, bool):
                kwargs[f.name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                kwargs[f.name] = int(raw)
            elif isinstance(default, float):
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = str(raw)
        return cls(**kwargs)

    @classmethod
    def load(cls, playbook_dir: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Settings:
        """`vars/remediation.yml` under `playbook_dir` (when there is one), then `overrides` (the remediator's
        site vars). The field defaults above are that file's values (tests/test_steps.py keeps them equal)."""
        path = Path(playbook_dir) / "vars" / "remediation.yml"
        values = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
        values.update(dict(overrides or {}))
        return cls.from_vars(values)

    @property
    def kubernetes(self) -> bool:
        return bool(self.kubeconfig) or self.k8s_in_cluster


# --- Slurm commands ---------------------------------------------------------------------------------------


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
    info = slurm_nodes.read(slurm.sinfo() if sinfo is None else sinfo).get(node)
    if info is None:
        raise StepError(f"Slurm does not know node {node}")
    if info.drained and not info.reason_owned():
        return StepResult(
            "slurm_drain",
            "skipped",
            f"{node} is already drained with reason '{info.reason}', which fleetheal does not own: left as it is",
        )
    if info.drained:
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
    as its owner could: the file must be a regular file owned by the job's `uid`, opened without following
    a symlink, so a job cannot point its log at a file of someone else's (the remediator's database, a
    system file). Returns what was done, or raises StepError saying why not."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # not even opened: opening a device can act on it
            raise StepError(f"not writing to {path}: it is not a regular file")
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StepError(f"cannot open the job log {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r+b") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            raise StepError(
                f"not writing to {path}: it is not a regular file of the job's user (uid {uid}) with one link"
            )
        data = line.encode() + b"\n"
        if st.st_size <= 4 << 20 and data in (b"\n" + fh.read()):
            return f"{path} already tells it"
        fh.write(data)
    return f"appended to {path}"


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
        f"{_launch_words(job, restarted=True)} {launch.SHRINK_WORD}{node} incident={incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    slurm.scontrol("update", f"jobid={jid}", "nodelist=" + ",".join(rest))
    return StepResult(
        "slurm_requeue",
        "done",
        f"relocated job {jid} inside its allocation: {node} shrunk away, restarted on {','.join(rest)} "
        f"({needed} needed; fleetheal launch)",
        changed=True,
    )


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
        results.append(StepResult("slurm_requeue", "done", detail, changed=True))
    return results


def restart_in_job(slurm: Slurm, job: dict[str, Any], node: str, incident: str, fault_id: str) -> StepResult:
    """Restart a job run by `fleetheal launch` inside its allocation: no requeue, no credential wait.

    The incident goes into the job's comment first, then the restart order (SIGUSR2 to the batch step,
    which is the launcher); the launcher restarts once per incident, so sending it twice is harmless.
    """
    jid = job["job_id"]
    comment = (
        f"{contracts.DRAIN_REASON_PREFIX} restarted in job after {fault_id} on {node}"
        f"{_launch_words(job, restarted=True)} incident={incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    where = ",".join(job["nodes"])
    return StepResult(
        "slurm_requeue", "done", f"restarted job {jid} in its allocation on {where} (fleetheal launch)", changed=True
    )


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
    nodes = slurm_nodes.read(read_nodes)
    with _PROMOTE_LOCK:
        done = nodes.with_extra(f"incident={incident}")
        if done:
            detail = f"{', '.join(done)} already promoted for incident {incident}"
            return StepResult("standby_promote", "done", detail, node=done[0])
        for name in [n for n, ended in _CLAIMED.items() if ended < taken]:
            del _CLAIMED[name]  # this read shows what its resume did
        free = [n for n in nodes.with_reason(s.standby_reason) if n != node and n not in _CLAIMED]
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


# --- Kubernetes ---------------------------------------------------------------------------------------------


class Kube:
    """The Node changes the steps make, through the official client, guarded by resourceVersion."""

    #: Connections kept to the API server: a storm's first responses patch Nodes concurrently, and every
    #: connection the pool cannot keep costs the next request a TLS handshake.
    CONNECTIONS = 64
    #: Seconds for one request (the client has no default: a stopped API server would hold a step, and
    #: the thread running it, for good).
    TIMEOUT_S = 10.0

    @staticmethod
    def preload() -> None:
        """Import the parts of the client a Kube uses. `kubernetes.client` imports its APIs lazily, on first
        use, and building CoreV1Api's validated methods costs about a second of CPU: a process that forks
        workers (Ansible's controller) preloads, so that each worker does not pay it again."""
        from kubernetes import client, config  # noqa: F401

        _ = (client.Configuration, client.ApiClient, client.CoreV1Api, client.VersionApi, client.exceptions)

    def __init__(self, settings: Settings) -> None:
        from kubernetes import client

        # No silent retries inside the client (urllib3's default is 3, so a stopped API server held each
        # call for 4 timeouts): a step fails in TIMEOUT_S, and the remediator waits for the API server to
        # answer before it retries the attempt.
        api = kubeclient.api_client(settings.kubeconfig, retries=0, connections=self.CONNECTIONS)
        self.core = client.CoreV1Api(api)
        self._exc = client.exceptions.ApiException

    def unavailable(self) -> str | None:
        """None when the API server answers (`GET /version`), else why not."""
        import urllib3
        from kubernetes import client

        try:
            client.VersionApi(self.core.api_client).get_code(_request_timeout=5)
        except (urllib3.exceptions.HTTPError, OSError, self._exc) as exc:
            return f"kubernetes API server: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return None

    def update_node(self, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Read Node `name`, let `change` return a merge patch (or None: nothing to do), apply it with the
        read resourceVersion; a conflict reads again. True when a patch was applied."""
        for _ in range(5):
            try:
                # The raw JSON: the client's models cost milliseconds per Node, and a storm reads hundreds.
                raw = self.core.read_node(name, _preload_content=False, _request_timeout=self.TIMEOUT_S)
                doc = json.loads(raw.data)  # type: ignore[attr-defined]
            except self._exc as exc:
                raise StepError(f"kubernetes: read Node {name}: {exc.status} {exc.reason}") from exc
            patch = change(doc)
            if patch is None:
                return False
            patch.setdefault("metadata", {})["resourceVersion"] = doc["metadata"]["resourceVersion"]
            try:
                self.core.patch_node(name, patch, _preload_content=False, _request_timeout=self.TIMEOUT_S)
            except self._exc as exc:
                if exc.status == 409:
                    continue
                raise StepError(f"kubernetes: patch Node {name}: {exc.status} {exc.reason}") from exc
            return True
        raise StepError(f"kubernetes: Node {name} kept changing (5 conflicts)")


def _taints_without(doc: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    return [t for t in (doc.get("spec", {}).get("taints") or []) if t.get("key") != key]


def k8s_isolate(kube: Kube | None, node: str, fault_id: str, *, dry_run: bool = False) -> StepResult:
    """Cordon `node` and taint it `fleetheal.io/unhealthy=<fault>:NoSchedule` (one patch). The pods'
    eviction under their PodDisruptionBudgets is the follow-up playbook's (it may take minutes)."""
    if kube is None:
        return StepResult("k8s_cordon", "skipped", f"no Kubernetes API configured: cordon of {node} skipped")
    taint = {"key": contracts.TAINT_UNHEALTHY, "value": fault_id, "effect": "NoSchedule"}
    if dry_run:
        return StepResult(
            "k8s_cordon", "would", f"would cordon {node} and taint it {contracts.TAINT_UNHEALTHY}={fault_id}"
        )

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        spec = doc.get("spec", {})
        mine = [t for t in spec.get("taints") or [] if t.get("key") == contracts.TAINT_UNHEALTHY]
        if spec.get("unschedulable") and mine:
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_FAULT: fault_id}},
            "spec": {
                "unschedulable": True,
                "taints": _taints_without(doc, contracts.TAINT_UNHEALTHY) + (mine or [taint]),
            },
        }

    changed = kube.update_node(node, change)
    what = "cordoned and tainted" if changed else "already cordoned and tainted"
    return StepResult("k8s_cordon", "done", f"{node} {what} {contracts.TAINT_UNHEALTHY}", changed=changed)


def _pods_to_evict(pods: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[str]]:
    """What `kubectl drain --ignore-daemonsets --delete-emptydir-data` evicts: (namespace, name) of every
    pod but mirror pods and DaemonSet pods; and the pods no controller manages, which it refuses to
    evict (nothing would recreate them)."""
    evict: list[tuple[str, str]] = []
    unmanaged: list[str] = []
    for pod in pods:
        meta = pod.get("metadata", {})
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
            continue
        owners = meta.get("ownerReferences") or []
        finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if not owners and not finished:
            unmanaged.append(f"{ns}/{name}")
        elif finished or not any(o.get("kind") == "DaemonSet" for o in owners):
            evict.append((ns, name))
    return evict, unmanaged


def k8s_drain(
    kube: Kube | None, node: str, *, timeout_s: float, poll_s: float = 1.0, dry_run: bool = False
) -> StepResult:
    """Evict the pods on `node` through the Eviction API, so that their PodDisruptionBudgets apply, wait up
    to `timeout_s` for them to be gone, then label the node `fleetheal.io/pool=quarantine`. An eviction a
    budget refuses (HTTP 429) fails the step with the server's message, naming the budget (the playbook
    retries exactly that); the node then stays in its pool. Run after `k8s_isolate` (cordoned: nothing
    lands there meanwhile)."""
    if kube is None:
        return StepResult("k8s_drain", "skipped", f"no Kubernetes API configured: drain of {node} skipped")
    if dry_run:
        return StepResult(
            "k8s_drain", "would", f"would evict the pods on {node} and label it {contracts.LABEL_POOL}=quarantine"
        )

    def on_node() -> list[dict[str, Any]]:
        try:
            raw = kube.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _preload_content=False, _request_timeout=kube.TIMEOUT_S
            )
        except kube._exc as exc:
            raise StepError(f"kubernetes: list the pods on {node}: {exc.status} {exc.reason}") from exc
        return list(json.loads(raw.data).get("items") or [])  # type: ignore[attr-defined]

    evict, unmanaged = _pods_to_evict(on_node())
    if unmanaged:
        raise StepError(
            f"kubernetes: {node} runs pods no controller manages, which a drain would lose: {', '.join(unmanaged)}; "
            "move or delete them, then run the playbook again"
        )
    for ns, name in evict:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
        try:
            kube.core.create_namespaced_pod_eviction(
                name,
                ns,
                body,  # type: ignore[arg-type]
                _preload_content=False,
                _request_timeout=kube.TIMEOUT_S,
            )
        except kube._exc as exc:
            if exc.status == 404:
                continue
            try:
                message = json.loads(exc.body or "{}").get("message", "")
            except ValueError:
                message = ""
            raise StepError(f"Failed to delete pod {ns}/{name}: {exc.status} {exc.reason}: {message}") from exc
    deadline = time.monotonic() + timeout_s
    evicted = set(evict)
    left = evicted
    while left:
        left = {(p["metadata"].get("namespace", ""), p["metadata"].get("name", "")) for p in on_node()} & evicted
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    labelled = kube.update_node(
        node,
        lambda doc: (
            None
            if (doc.get("metadata", {}).get("labels") or {}).get(contracts.LABEL_POOL) == "quarantine"
            else {"metadata": {"labels": {contracts.LABEL_POOL: "quarantine"}}}
        ),
    )
    detail = f"{len(evict)} pod(s) evicted from {node}"
    if left:
        names = ", ".join(sorted(f"{ns}/{name}" for ns, name in left))
        detail += f", {len(left)} still terminating after {timeout_s:.0f} s ({names})"
    detail += f"; {contracts.LABEL_POOL}=quarantine"
    return StepResult("k8s_drain", "done", detail, changed=bool(evict) or labelled)


def k8s_promote(kube: Kube | None, node: str, *, dry_run: bool = False) -> StepResult:
    """Label a promoted standby Node `fleetheal.io/pool=active` and remove its standby taint."""
    if kube is None or not node:
        return StepResult("k8s_promote", "skipped", f"no Kubernetes API configured: promotion of {node} skipped")
    if dry_run:
        return StepResult("k8s_promote", "would", f"would label {node} {contracts.LABEL_POOL}=active")

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        labels = doc.get("metadata", {}).get("labels") or {}
        taints = doc.get("spec", {}).get("taints") or []
        if labels.get(contracts.LABEL_POOL) == "active" and not any(
            t.get("key") == contracts.TAINT_STANDBY for t in taints
        ):
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_POOL: "active"}},
            "spec": {"taints": _taints_without(doc, contracts.TAINT_STANDBY)},
        }

    changed = kube.update_node(node, change)
    return StepResult(
        "k8s_promote", "done", f"{node} labelled {contracts.LABEL_POOL}=active, standby taint removed", changed=changed
    )


def kube_for(settings: Settings) -> Kube | None:
    return Kube(settings) if settings.kubernetes else None


_SLURM_OUTAGE = (" is DOWN", "timed out", "Unable to contact", "Connection refused", "TimeoutExpired")


class Dependencies:
    """Whether what the steps act through answers now: slurmctld (`scontrol ping`) and, when configured, the
    Kubernetes API server (`/version`). The remediator asks before it retries a failed playbook attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.slurm = Slurm(settings)
        self._kube: Kube | None = None

    def unavailable(self) -> dict[str, str]:
        """{dependency: why} for each one that does not answer (empty: all answer)."""
        down = {}
        try:
            self.slurm.run("scontrol", "ping", retries=0)
        except StepError as exc:
            # An outage is a controller that is DOWN or does not answer. A client with no configuration at
            # all (no Slurm here: tests with stand-in playbooks) is not waited for.
            if any(word in str(exc) for word in _SLURM_OUTAGE):
                down["slurm"] = " ".join(str(exc).split())[:200]
        if self.settings.kubernetes:
            self._kube = self._kube or Kube(self.settings)
            why = self._kube.unavailable()
            if why:
                down["kubernetes"] = why
        return down
