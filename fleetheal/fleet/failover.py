"""Cross-cluster failover, the third recovery stage: move a job off a cluster that cannot heal it.

Slurm federation does the moving; fleetheal only decides where and checks that it is safe. Measured on
the lab federation (Debian 22.05.8): `scontrol hold`, `scontrol requeue`, `scontrol update jobid=N
Clusters=<target>` and `scontrol release` on the origin revoke the origin's copy and leave one pending copy
on the target, which starts there. The job must be submitted with `--requeue --open-mode=append` and an
output file on storage both clusters read, so its log continues as one stream, and it must resume from its
own checkpoint.

A job is moved only to a cluster that reads its checkpoint store (the fleet file's
`clusters.<name>.checkpoint_stores`); anything else is refused with the reason, because a job restarted
without its checkpoint silently loses its progress.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from fleetheal.contracts import CHECKPOINT_WORD, DRAIN_REASON_PREFIX
from fleetheal.fleet.config import FleetConfig
from fleetheal.slurm import nodes
from fleetheal.slurm.fields import number, parse_kv_line
from fleetheal.slurm.jobs import COPIES_ARGS, ClusterJob, cluster_jobs_args, copies, parse_cluster_jobs
from fleetheal.slurm.runner import Runner
from fleetheal.wait import WaitTimeout, wait_until

log = logging.getLogger(__name__)

#: States of a copy that is still the job (a held federated requeue waits in REQUEUE_FED).
LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD")


class FailoverError(RuntimeError):
    """Slurm refused a step of the move, or the job did not start on the target in time."""


@dataclass(frozen=True)
class Decision:
    """What `move` decided and why (the audit record)."""

    job_id: str
    action: str  # "moved", "would-move", "noop", "refused", "failed"
    source: str
    target: str
    reason: str


def _run(env: Mapping[str, str] | None, *argv: str, check: bool = True) -> str:
    """A Slurm client's output; with `check`, FailoverError when it fails (fleetheal.slurm.runner)."""
    slurm = Runner(env=env, timeout_s=30, error=FailoverError)
    return slurm.checked(*argv) if check else slurm.read(*argv).out


def where(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{cluster: state} of every copy of `job_id`, from each controller's own view (`fleetheal.slurm.jobs.copies`)."""
    return copies(_run(env, "squeue", *COPIES_ARGS, check=False), job_id)


def choose_target(fleet: FleetConfig, store: str, source: str, target: str | None = None) -> tuple[str, str]:
    """(target, "") or ("", why not): a cluster other than `source` that reads checkpoint store `store`."""
    if store not in fleet.checkpoint_stores:
        return "", f"checkpoint store {store!r} is not declared in the fleet file"
    readers = [c for c in fleet.readers(store) if c != source]
    if target is not None:
        if target == source:
            return "", f"target {target!r} is the failing cluster"
        if target not in readers:
            return "", f"cluster {target!r} cannot read checkpoint store {store!r} (readers: {readers or 'none'})"
        return target, ""
    if not readers:
        return "", f"no cluster other than {source!r} reads checkpoint store {store!r}"
    return readers[0], ""


def move(
    job_id: str,
    source: str,
    store: str,
    fleet: FleetConfig,
    env: Mapping[str, str] | None = None,
    *,
    target: str | None = None,
    dry_run: bool = False,
    timeout: float = 60.0,
) -> Decision:
    """Move federated job `job_id` from `source` to a sibling that reads `store`; wait until it is RUNNING there.

    Idempotent: a job whose live copy is already on another cluster is left alone (a second call, or a
    call after a crash mid-move, finishes by waiting for it instead of moving it again).
    """
    tgt, why = choose_target(fleet, store, source, target)
    if not tgt:
        d = Decision(job_id, "refused", source, target or "", why)
        log.warning("failover refused: %s", d)
        return d
    copies = where(job_id, env)
    live = {c: s for c, s in copies.items() if s in LIVE}
    if not live:
        d = Decision(job_id, "refused", source, tgt, f"job {job_id} has no live copy (seen: {copies or 'none'})")
        log.warning("failover refused: %s", d)
        return d
    elsewhere = [c for c in live if c != source]
    if elsewhere:
        d = Decision(job_id, "noop", source, elsewhere[0], f"job already on {elsewhere[0]} ({live[elsewhere[0]]})")
        log.info("failover: %s", d)
        if not dry_run:
            _wait_state(job_id, elsewhere[0], ("RUNNING",), env, timeout)
        return d
    if dry_run:
        d = Decision(job_id, "would-move", source, tgt, f"dry run: would move from {source} to {tgt} (reads {store})")
        log.info("failover: %s", d)
        return d
    sc = ("scontrol", "-M", source)
    deadline = time.monotonic() + timeout
    _run(env, *sc, "hold", job_id)
    try:
        if live.get(source) != "PENDING":
            _run(env, *sc, "requeue", job_id, check=False)  # a running job is stopped; its checkpoint remains
        # Only a pending job changes clusters: one still completing on a node that does not answer stays so
        # until Slurm declares the node down (SlurmdTimeout, 120 s deployed), unless fleetheal sets it DOWN
        # first, once Slurm itself says the node does not respond (`_wait_released`). Slurm 22.05 keeps a
        # held federated job it requeued in REQUEUE_FED; released, it turns PENDING, and held again it may
        # change clusters (26.05 leaves it PENDING at once).
        requeued = _wait_released(job_id, source, env, deadline - time.monotonic())
        if requeued != "PENDING":
            _run(env, *sc, "release", job_id)
            _wait_state(job_id, source, ("PENDING",), env, deadline - time.monotonic())
            _run(env, *sc, "hold", job_id)
        # Node names belong to one cluster: nodes the job was kept off here (a failed node) would make every
        # sibling refuse it.
        _run(env, *sc, "update", f"jobid={job_id}", "ExcNodeList=")
        _run(env, *sc, "update", f"jobid={job_id}", f"Clusters={tgt}")
    except FailoverError:
        _run(env, *sc, "release", job_id, check=False)  # not moved: it stays here, free to run when it can
        raise
    _run(env, *sc, "release", job_id)
    _start_now(job_id, tgt, env, deadline)
    _wait_state(job_id, tgt, ("RUNNING",), env, max(1.0, deadline - time.monotonic()))
    d = Decision(job_id, "moved", source, tgt, f"{source} cannot heal it; {tgt} reads checkpoint store {store}")
    log.warning("failover: %s", d)
    return d


def _wait_state(
    job_id: str, cluster: str, states: tuple[str, ...], env: Mapping[str, str] | None, timeout: float
) -> str:
    """Wait until the copy of `job_id` on `cluster` is in one of `states`; that state."""

    def reached() -> str | None:
        state = where(job_id, env).get(cluster)
        return state if state in states else None

    try:
        return wait_until(
            reached,
            max(0.0, timeout),
            f"job {job_id} to be {' or '.join(states)} on {cluster}",
            interval=0.2,
        )
    except WaitTimeout as e:
        raise FailoverError(f"{e}: copies {where(job_id, env)}") from e


def _wait_released(job_id: str, source: str, env: Mapping[str, str] | None, timeout: float) -> str:
    """Wait until the requeued job's copy on `source` is PENDING or REQUEUE_FED; that state. While it is still
    completing, its nodes that Slurm reports not responding (they missed its health check or its ping: the
    alert is corroborated)
    are set DOWN with an owned reason, which releases the job at once instead of after SlurmdTimeout. A node
    whose reason fleetheal does not own (an administrator's) is left alone."""

    def released() -> str | None:
        state = where(job_id, env).get(source)
        if state in ("PENDING", "REQUEUE_FED"):
            return state
        if state == "COMPLETING":
            _down_lost(job_id, source, env)
        return None

    try:
        return wait_until(released, max(0.0, timeout), f"job {job_id} to leave its nodes on {source}", interval=0.5)
    except WaitTimeout as e:
        raise FailoverError(f"{e}: copies {where(job_id, env)}") from e


def _start_now(job_id: str, target: str, env: Mapping[str, str] | None, deadline: float) -> None:
    """Lift the begin-time hold a requeue put on the job, on `target`. Slurm holds a requeued job for
    cred_expire + 1 s (61 s deployed) so that it never starts where its previous run's credential is revoked;
    the hold travels with the job (measured on 26.05: PENDING `Reason=BeginTime` on the target until 60 s
    after the move), but the target's nodes never ran it. Only a job that ran before (`Restarts` > 0: the
    requeue was this move's own, or Slurm's when the job's node went DOWN) is started: a begin time that a
    job which never ran was submitted with (`sbatch --begin`) is its owner's, and kept."""
    while time.monotonic() < deadline:
        state = where(job_id, env).get(target)
        if state == "RUNNING":
            return
        if state == "PENDING":
            shown = _run(env, "scontrol", "-M", target, "show", "job", "-o", job_id, check=False).strip()
            fields = parse_kv_line(shown.splitlines()[-1]) if shown else {}
            eligible = _local_time(fields.get("EligibleTime", ""))
            if eligible is not None:  # the target has looked at the job (before: "Unknown")
                if eligible <= time.time() or number(fields.get("Restarts")) < 1:
                    return  # no hold, or its owner's
                _run(env, "scontrol", "-M", target, "update", f"jobid={job_id}", "StartTime=now", check=False)
        time.sleep(0.2)


def _local_time(value: str) -> float | None:
    """Seconds since the epoch of a time Slurm prints (local time, to the second), or None ("Unknown")."""
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _down_lost(job_id: str, cluster: str, env: Mapping[str, str] | None) -> list[str]:
    """Set DOWN the nodes of `job_id` on `cluster` that Slurm says do not respond; the nodes set."""
    listed = _run(env, "squeue", "-M", cluster, "-h", "-j", job_id, "-o", "%N", check=False).split()
    hostlist = [w for w in listed if w not in ("CLUSTER:", cluster)]
    if not hostlist:
        return []
    found = nodes.read(_run(env, "sinfo", "-M", cluster, *nodes.NODES_ARGS, "-n", hostlist[-1], check=False))
    lost = [
        n.name
        for n in found.values()
        if "NOT_RESPONDING" in n.flags and n.state != "DOWN" and (not n.reason or n.reason_owned())
    ]
    if lost:
        reason = f"{DRAIN_REASON_PREFIX}lost: not responding, job {job_id} moves to a sibling cluster"
        _run(env, "scontrol", "-M", cluster, "update", f"nodename={','.join(lost)}", "state=down", f"reason={reason}")
        log.warning("failover: set %s DOWN (not responding) so that job %s leaves them", ",".join(lost), job_id)
    return lost


def checkpoint_store(comment: str, default: str = "") -> str:
    """The checkpoint store a job's comment names (`fleetheal-checkpoint=NAME`), else `default`."""
    for word in comment.split():
        if word.startswith(CHECKPOINT_WORD):
            return word[len(CHECKPOINT_WORD) :]
    return default


class Stage:
    """The remediator's third recovery stage: it decides when a job cannot heal on this cluster and moves it.

    Two moments, both corroborated by Slurm itself (a wrong alert alone never moves a job):

    - `after_isolation`: the node was isolated and its jobs requeued here, but no standby node was left to
      promote; a job the first response requeued that is still pending after `wait_s` moves.
    - `while_held`: the gate holds an isolation (budget spent, breaker open: many nodes at once, a leaf
      switch) and Slurm says the node does not respond: the node's jobs move.

    Moves of one job are serialised (`move` is idempotent: the second finds it gone and waits for it); moves
    of different jobs run side by side.
    """

    def __init__(
        self,
        fleet: FleetConfig,
        cluster: str,
        *,
        default_store: str = "",
        env: Mapping[str, str] | None = None,
        wait_s: float = 10.0,
        timeout_s: float = 120.0,
    ) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.default_store = default_store
        self.env = env
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def jobs(self, *, node: str = "") -> list[ClusterJob]:
        """This cluster's live jobs (on `node` only, when given)."""
        return parse_cluster_jobs(_run(self.env, "squeue", *cluster_jobs_args(self.cluster, LIVE, node)))

    def node_lost(self, node: str) -> bool:
        """Slurm says `node` does not respond (or is down): what corroborates an alert before a move."""
        out = _run(self.env, "sinfo", "-M", self.cluster, *nodes.NODES_ARGS, "-n", node)
        found = nodes.read(out).get(node)
        return found is not None and not found.responding

    def after_isolation(self, incident: str, job_ids: Collection[str], *, dry_run: bool = False) -> list[Decision]:
        """Move the jobs the first response of `incident` requeued (`job_ids`, from the remediator's own record:
        a job comment is the user's to write) that did not start here within `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        while True:
            # Not RUNNING: pending, or still completing on a node that does not answer.
            waiting = [j for j in self.jobs() if j.job_id in job_ids and j.state != "RUNNING"]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return [self._move(j, dry_run, f"still pending {self.wait_s:g} s after {incident}") for j in waiting]

    def while_held(self, node: str, *, dry_run: bool = False) -> list[Decision]:
        """Move the jobs of `node`, whose isolation the gate holds; only once `node_lost(node)` is true."""
        return [self._move(j, dry_run, f"{node} does not respond") for j in self.jobs(node=node)]

    def _move(self, job: ClusterJob, dry_run: bool, why: str) -> Decision:
        store = checkpoint_store(job.comment, self.default_store)
        if not store:
            d = Decision(job.job_id, "refused", self.cluster, "", f"{why}; the job names no checkpoint store")
            log.warning("failover refused: %s", d)
            return d
        with self._locks_lock:
            lock = self._locks.setdefault(job.job_id, threading.Lock())
        with lock:
            try:
                d = move(job.job_id, self.cluster, store, self.fleet, self.env, dry_run=dry_run, timeout=self.timeout_s)
            except FailoverError as exc:
                return Decision(job.job_id, "failed", self.cluster, "", f"{why}; {exc}")
        return Decision(d.job_id, d.action, d.source, d.target, f"{why}; {d.reason}")
