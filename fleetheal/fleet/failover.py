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
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from fleetheal.fleet.config import FleetConfig
from fleetheal.wait import WaitTimeout, wait_until

log = logging.getLogger(__name__)

LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")


class FailoverError(RuntimeError):
    """Slurm refused a step of the move, or the job did not start on the target in time."""


@dataclass(frozen=True)
class Decision:
    """What `move` decided and why (the audit record)."""

    job_id: str
    action: str  # "moved", "would-move", "noop", "refused"
    source: str
    target: str
    reason: str


def _run(env: Mapping[str, str] | None, *argv: str, check: bool = True) -> str:
    exe = shutil.which(argv[0]) or argv[0]
    proc = subprocess.run(
        [exe, *argv[1:]], env=dict(env) if env else None, capture_output=True, text=True, timeout=30, check=False
    )
    if check and proc.returncode != 0:
        raise FailoverError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def where(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{cluster: state} of every copy of `job_id`, from each controller's own view (`squeue -M all --local`;
    with `-h` squeue drops the CLUSTER headers, so they are kept and the column header skipped). The origin
    keeps a REVOKED copy of a job that runs on a sibling."""
    out = _run(env, "squeue", "-M", "all", "--local", "-t", "all", "-o", "%i|%T", check=False)
    found: dict[str, str] = {}
    cluster = ""
    for raw in out.splitlines():
        line = raw.strip()
        if line.startswith("CLUSTER:"):
            cluster = line.split(":", 1)[1].strip()
        elif "|" in line:
            jid, state = line.split("|", 1)
            if jid == job_id and cluster:  # the column header "JOBID|STATE" never matches
                found[cluster] = state
    return found


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
            _wait_running(job_id, elsewhere[0], env, timeout)
        return d
    if dry_run:
        d = Decision(job_id, "would-move", source, tgt, f"dry run: would move from {source} to {tgt} (reads {store})")
        log.info("failover: %s", d)
        return d
    sc = ("scontrol", "-M", source)
    _run(env, *sc, "hold", job_id)
    if live.get(source) != "PENDING":
        _run(env, *sc, "requeue", job_id, check=False)  # a running job is stopped; its checkpoint remains
    _run(env, *sc, "update", f"jobid={job_id}", f"Clusters={tgt}")
    _run(env, *sc, "release", job_id)
    _wait_running(job_id, tgt, env, timeout)
    d = Decision(job_id, "moved", source, tgt, f"{source} cannot heal it; {tgt} reads checkpoint store {store}")
    log.warning("failover: %s", d)
    return d


def _wait_running(job_id: str, cluster: str, env: Mapping[str, str] | None, timeout: float) -> None:
    try:
        wait_until(
            lambda: where(job_id, env).get(cluster) == "RUNNING",
            timeout,
            f"job {job_id} to run on {cluster}",
            interval=0.2,
        )
    except WaitTimeout as e:
        raise FailoverError(f"{e}: copies {where(job_id, env)}") from e
