"""fleetheal.steps against a real Slurm: the steps the first responder runs and the playbooks' modules call."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetheal import contracts, steps
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.slurm import client, nodes
from fleetheal.slurm.jobs import slurm_job
from fleetheal.steps import kube as kube_steps
from tests.ansible.conftest import job_json, wait_until

pytestmark = pytest.mark.slurm  # a real Slurm: `make compat` runs these on 22.05 too

#: Logs each grace signal with its arrival time, then runs until it is killed or requeued.
SIGNAL_SCRIPT = """#!/bin/sh
trap 'echo "USR1 $(date +%s.%N)" >> {log}/$SLURM_JOB_ID.sig' USR1
echo "start ${{SLURM_RESTART_COUNT:-0}} $SLURMD_NODENAME" >> {log}/$SLURM_JOB_ID.sig
while :; do sleep 0.1; done
"""


@pytest.fixture
def cluster(tmp_path: Path):
    c = SlurmCluster(tmp_path / "slurm", nodes=3, gpus_per_node=8, cpus_per_node=16)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def settings(cluster: SlurmCluster, **kw) -> steps.Settings:
    values = {
        "fleetheal_slurm_env": {"SLURM_CONF": str(cluster.conf_path)},
        "fleetheal_grace_seconds": 0,
        "fleetheal_slurm_retry_delay_s": 1,
        **kw,
    }
    return steps.Settings.load(Path(__file__).resolve().parents[2] / "playbooks", values)


def submit(cluster: SlurmCluster, log: Path, *args: str) -> str:
    log.mkdir(exist_ok=True)
    return cluster.sbatch(SIGNAL_SCRIPT.format(log=log), "--requeue", "--output=/dev/null", *args)


def running(cluster: SlurmCluster, job: str, timeout: float = 30.0) -> dict:
    assert wait_until(lambda: job_json(cluster, job)["state"] == "RUNNING", timeout), job_json(cluster, job)
    return job_json(cluster, job)


def test_settings_defaults_are_the_playbooks_defaults() -> None:
    """One source of truth: the dataclass defaults equal playbooks/vars/remediation.yml."""
    loaded = steps.Settings.load(Path(__file__).resolve().parents[2] / "playbooks")
    assert loaded == steps.Settings()


def test_restart_in_place_on_the_same_nodes_right_after_a_requeue(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The race of `starttime=now` (Slurm refusing the start: "Job credential revoked") cannot happen:
    three restarts in place in a row, each right after the previous one, all RUNNING again on the same nodes."""
    slurm = steps.Slurm(settings(cluster))
    job = submit(cluster, tmp_path / "sig", "--nodes=2", "--gres=gpu:8", "--exclusive")
    held = running(cluster, job)["nodes"]
    for n in range(1, 4):
        results = steps.requeue_jobs(slurm, held[0], f"inc-{n}", "nccl-timeout", same_nodes=True)
        assert [r.outcome for r in results] == ["done", "done"], results
        entry = running(cluster, job)
        assert entry["nodes"] == held
        assert entry["restart_cnt"] == n
        assert f"incident=inc-{n}" in entry["comment"]
    assert "credential revoked" not in (cluster.log_dir / "slurmctld.log").read_text().lower()


def test_eight_jobs_on_one_failing_node_are_all_signalled_by_one_scancel_before_any_requeue(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    log = tmp_path / "sig"
    jobs = [submit(cluster, log, "--nodes=1", "--nodelist=n1", "--gres=gpu:1", "--cpus-per-task=1") for _ in range(8)]
    for job in jobs:
        running(cluster, job)
    slurm = steps.Slurm(settings(cluster, fleetheal_grace_seconds=5))
    calls: list[tuple[str, ...]] = []
    real_run = slurm.run

    def counted(command: str, *args: str, **kw: Any) -> str:
        calls.append((command, *args, kw.get("stdin") or ""))
        return real_run(command, *args, **kw)

    slurm.run = counted  # type: ignore[method-assign]
    results = steps.requeue_jobs(slurm, "n1", "inc-8", "xid-79")
    assert sorted(r.outcome for r in results) == ["done"] * 9  # one signal for all, eight requeues
    # One scancel for all eight (not one job at a time, each after the previous one's requeue), and it
    # comes before any requeue: the grace period is one for the node, however long Slurm takes to answer.
    signals = [i for i, c in enumerate(calls) if c[0] == "scancel"]
    assert len(signals) == 1 and sorted(calls[signals[0]][3:-1]) == sorted(jobs), calls
    requeues = [i for i, c in enumerate(calls) if "requeue" in " ".join(c)]
    assert requeues and signals[0] < min(requeues), calls
    for job in jobs:  # and every batch script got it
        path = log / f"{job}.sig"
        assert wait_until(lambda p=path: "USR1" in p.read_text(), 60), path.read_text()
    for job in jobs:
        entry = job_json(cluster, job)
        assert entry["restart_cnt"] == 1 and "incident=inc-8" in entry["comment"]
        assert "n1" in str(entry.get("excluded_nodes") or ""), entry.get("excluded_nodes")


def test_a_job_scoped_fault_leaves_the_other_job_on_the_node_alone(cluster: SlurmCluster, tmp_path: Path) -> None:
    """A NaN-loss report of job A: only A is signalled and requeued; job B on the same node runs on."""
    log = tmp_path / "sig"
    a = submit(cluster, log, "--nodes=1", "--nodelist=n2", "--gres=gpu:4")
    b = submit(cluster, log, "--nodes=1", "--nodelist=n2", "--gres=gpu:4")
    running(cluster, a)
    running(cluster, b)
    slurm = steps.Slurm(settings(cluster))
    results = steps.requeue_jobs(slurm, "n2", "inc-a", "nan-loss", job_id=a, same_nodes=True)
    assert [r.outcome for r in results] == ["done", "done"]
    assert job_json(cluster, a)["restart_cnt"] == 1
    entry_b = job_json(cluster, b)
    assert entry_b["state"] == "RUNNING" and entry_b["restart_cnt"] == 0
    assert "USR1" not in (log / f"{b}.sig").read_text()
    # A job id that does not run on the node acts on nothing.
    assert [r.outcome for r in steps.requeue_jobs(slurm, "n1", "inc-x", "nan-loss", job_id=b)] == ["skipped"]


def test_steps_are_idempotent_per_incident_and_never_take_a_foreign_drain(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    s = settings(cluster)
    slurm = steps.Slurm(s)
    job = submit(cluster, tmp_path / "sig", "--nodes=1", "--nodelist=n1", "--gres=gpu:8")
    running(cluster, job)
    cluster.run("scontrol", "update", "nodename=n3", "state=DRAIN", f"reason={s.standby_reason}")
    reason = "fleetheal:xid-79 incident=inc-1 gpu=3"
    assert steps.drain_node(slurm, "n1", reason).changed
    again = steps.drain_node(slurm, "n1", reason)
    assert (again.outcome, again.changed) == ("done", False)
    first = steps.promote_standby(slurm, "n1", "inc-1")
    assert (first.outcome, first.node, first.changed) == ("done", "n3", True)
    second = steps.promote_standby(slurm, "n1", "inc-1")
    assert (second.outcome, second.node, second.changed) == ("done", "n3", False)
    assert [r.outcome for r in steps.requeue_jobs(slurm, "n1", "inc-1", "xid-79")] == ["done", "done"]
    assert [r.detail for r in steps.requeue_jobs(slurm, "n1", "inc-1", "xid-79")] in (
        ["no active job on n1"],
        [f"job {job} was already requeued for incident inc-1"],
    )
    cluster.run("scontrol", "update", "nodename=n2", "state=DRAIN", "reason=admin: bad DIMM")
    foreign = steps.drain_node(slurm, "n2", "fleetheal:xid-48 incident=inc-2")
    assert foreign.outcome == "skipped" and "does not own" in foreign.detail
    # A node lent to Kubernetes workloads is drained for the pool, not a fault: the fault's reason replaces it.
    cluster.run("scontrol", "update", "nodename=n3", "state=DRAIN", f"reason={contracts.LENT_REASON}")
    lent = steps.drain_node(slurm, "n3", "fleetheal:xid-79 incident=inc-3")
    assert (lent.outcome, lent.changed) == ("done", True) and cluster.node(
        "n3"
    ).reason == "fleetheal:xid-79 incident=inc-3"


def test_a_templated_setting_the_remediator_cannot_render_is_refused() -> None:
    with pytest.raises(ValueError, match="fleetheal_standby_reason"):
        steps.Settings.from_vars({"fleetheal_standby_reason": "{{ site_prefix }}standby"})
    assert steps.Settings.from_vars({"fleetheal_standby_reason": "{{ fleetheal_drain_reason_prefix }}spare"}) == (
        steps.Settings(standby_reason="fleetheal:spare")
    )


def test_settings_are_coerced_as_every_fleetheal_setting_and_errors_name_the_variable() -> None:
    """fleetheal.settings's coercion: quoted numbers and yes/no are read, a wrong value names its variable."""
    got = steps.Settings.from_vars(
        {"fleetheal_slurm_retries": "5", "fleetheal_promote_standby": "no", "fleetheal_slurm_env": {"A": 1}}
    )
    assert (got.slurm_retries, got.promote_standby, dict(got.slurm_env)) == (5, False, {"A": "1"})
    assert steps.Settings.from_vars({"fleetheal_unused": 1, "fleetheal_kubeconfig": None}) == steps.Settings()
    # Ansible's 1/0 booleans (-e fleetheal_promote_standby=0), accepted before the steps shared the coercion.
    for raw, want in ((0, False), ("0", False), (1, True), ("1", True)):
        assert steps.Settings.from_vars({"fleetheal_promote_standby": raw}).promote_standby is want
    with pytest.raises(ValueError, match=r"^fleetheal_slurm_retries: expected an integer, got 'x'$"):
        steps.Settings.from_vars({"fleetheal_slurm_retries": "x"})


#: A job run by `fleetheal launch`: each start of the command, and each signal it gets, is logged.
LAUNCH_SCRIPT = """#!/bin/sh
export PYTHONPATH={repo}
{exec}{python} -m fleetheal launch --stop-timeout 5 -- sh -c '
trap "echo USR1 >> {log}/$SLURM_JOB_ID.launch" USR1
trap "echo TERM >> {log}/$SLURM_JOB_ID.launch; exit 0" TERM
echo "start $FLEETHEAL_LAUNCH_RESTARTS $FLEETHEAL_INCIDENT" >> {log}/$SLURM_JOB_ID.launch
while :; do sleep 0.1; done'
"""


def submit_launch(cluster: SlurmCluster, log: Path, *, exec_: bool = True) -> str:
    import sys

    log.mkdir(exist_ok=True)
    script = LAUNCH_SCRIPT.format(
        repo=Path(__file__).resolve().parents[2], python=sys.executable, log=log, exec="exec " if exec_ else ""
    )
    return cluster.sbatch(script, "--requeue", "--nodes=2", "--exclusive", "--output=/dev/null")


def test_a_job_run_by_fleetheal_launch_restarts_in_its_allocation_once_per_incident(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """No requeue, no credential wait: the same job, the same nodes, Slurm's restart count unchanged; the
    grace signal reaches the command; a second order for the same incident (a resumed remediator) is a no-op.
    A grace period of 1 s (120 s deployed), not 0: the grace signal and the order are two `scancel` calls, and
    Slurm may deliver the second before the first when nothing lies between them."""
    slurm = steps.Slurm(settings(cluster, fleetheal_grace_seconds=1))
    log = tmp_path / "launch"
    job = submit_launch(cluster, log)
    held = running(cluster, job)["nodes"]
    assert wait_until(lambda: "fleetheal-launch" in job_json(cluster, job)["comment"].split(), 120)
    lines = log / f"{job}.launch"
    assert wait_until(lambda: lines.exists() and "start 0" in lines.read_text(), 120)
    for n in (1, 2):
        results = steps.requeue_jobs(slurm, held[0], f"inc-{n}", "nccl-timeout", same_nodes=True)
        assert [r.step for r in results] == ["slurm_signal", "slurm_requeue"], results
        assert "in its allocation" in results[1].detail, results
        assert wait_until(lambda n=n: f"start {n} inc-{n}" in lines.read_text(), 120), lines.read_text()
        entry = job_json(cluster, job)
        assert entry["state"] == "RUNNING" and entry["restart_cnt"] == 0
        assert entry["nodes"] == held
    again = steps.requeue_jobs(slurm, held[0], "inc-2", "nccl-timeout", same_nodes=True)
    assert [r.outcome for r in again] == ["done"] and "already" in again[0].detail
    text = lines.read_text().split("\n")
    assert [t for t in text if t.startswith("start")] == ["start 0 ", "start 1 inc-1", "start 2 inc-2"]
    assert text.count("USR1") == 2 and text.count("TERM") == 2


def test_fleetheal_launch_under_a_shell_leaves_the_job_to_a_requeue(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Without `exec` the shell would receive the restart order and die of it: the launcher does not mark
    the job, and the remediator requeues it as it does any job."""
    slurm = steps.Slurm(settings(cluster))
    log = tmp_path / "launch"
    job = submit_launch(cluster, log, exec_=False)
    held = running(cluster, job)["nodes"]
    lines = log / f"{job}.launch"
    assert wait_until(lambda: lines.exists() and "start 0" in lines.read_text(), 120)
    assert "fleetheal-launch" not in job_json(cluster, job)["comment"]
    results = steps.requeue_jobs(slurm, held[0], "inc-1", "nccl-timeout", same_nodes=True)
    assert "requeued it on" in results[-1].detail, results
    assert wait_until(lambda: job_json(cluster, job)["restart_cnt"] == 1, 120)


#: A command that runs out of GPU memory at once, every run: it prints PyTorch's error and exits 1.
OOM_SCRIPT = """#!/bin/sh
export PYTHONPATH={repo}
export FLEETHEAL_TRAINING_SOCKET={sock}
exec {python} -m fleetheal launch --stop-timeout 5 -- sh -c '
echo "start $FLEETHEAL_LAUNCH_RESTARTS $FLEETHEAL_INCIDENT" >> {log}/$SLURM_JOB_ID.launch
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2
exit 1'
"""


def test_a_command_that_failed_printing_a_fault_waits_for_the_order_and_a_refusal_ends_it(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The command dies of an out-of-memory it printed: the launcher does not end the job at once but waits
    for fleetheal's decision. A restart order (restart=<incident>) starts it again in the allocation; a
    refusal (a comment naming a new incident without an order) ends the wait and the job, long before
    ORDER_WAIT_S."""
    import socket

    from fleetheal import launch

    slurm = steps.Slurm(settings(cluster))
    log = tmp_path / "launch"
    log.mkdir()
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(tmp_path / "a.sock"))
    try:
        script = OOM_SCRIPT.format(repo=Path(__file__).resolve().parents[2], python=sys.executable, log=log,
                                   sock=tmp_path / "a.sock")  # fmt: skip
        job = cluster.sbatch(script, "--nodes=1", f"--output={log}/out.txt")
        node = running(cluster, job)["nodes"][0]
        agent.settimeout(60)
        assert b"OutOfMemoryError" in agent.recv(8192)  # the line reached "the agent": the launcher waits
        lines = log / f"{job}.launch"
        results = steps.requeue_jobs(slurm, node, "inc-1", "cuda-oom", same_nodes=True)
        assert "in its allocation" in results[-1].detail, results
        assert f"{launch.ORDER_WORD}inc-1" in job_json(cluster, job)["comment"].split()
        assert wait_until(lambda: "start 1 inc-1" in lines.read_text(), 60), lines.read_text()
        assert job_json(cluster, job)["state"] == "RUNNING"  # failed again, waiting again
        told = steps.tell_jobs(slurm, node, "inc-2", "fleetheal: not restarted: cuda-oom-repeated incident=inc-2")
        assert [r.outcome for r in told] == ["done"], told
        assert wait_until(lambda: cluster.job(job)["JobState"] not in ("RUNNING", "COMPLETING"), 60)
        assert (cluster.job(job)["JobState"], cluster.job(job)["Restarts"]) == ("FAILED", "0"), cluster.job(job)
        # The refusal, not the end of ORDER_WAIT_S, ended it.
        assert "fleetheal does not restart it (incident inc-2" in (log / "out.txt").read_text()
        assert [t for t in lines.read_text().splitlines() if t.startswith("start")] == ["start 0 ", "start 1 inc-1"]
    finally:
        agent.close()


#: A job holding a spare node: the command needs 2 of its 3 nodes and runs a real job step on them, which
#: keeps running through the grace signal as a training that checkpoints does.
SPARE_SCRIPT = """#!/bin/sh
export PYTHONPATH={repo}
exec {python} -m fleetheal launch --nodes 2 --stop-timeout 5 -- sh -c '
echo "start $FLEETHEAL_LAUNCH_RESTARTS $FLEETHEAL_INCIDENT $SLURM_JOB_NODELIST $SLURM_NNODES" >> {log}/$SLURM_JOB_ID.launch
exec srun -N 2 sh -c "trap : USR1; echo \\$SLURMD_NODENAME >> {log}/$SLURM_JOB_ID.step; while :; do sleep 0.1; done"'
"""


def test_a_job_with_a_spare_node_is_relocated_inside_its_allocation(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Isolating a node of a job that holds a spare shrinks the node away and restarts the command on the
    rest: no requeue, same job; the step killed by the shrink does not end the job; a resumed remediator
    finds nothing left to do; the batch host itself still means a requeue."""
    import sys

    slurm = steps.Slurm(settings(cluster))
    log = tmp_path / "spare"
    log.mkdir()
    script = SPARE_SCRIPT.format(repo=Path(__file__).resolve().parents[2], python=sys.executable, log=log)
    job = cluster.sbatch(script, "--requeue", "--nodes=3", "--exclusive", f"--output={log}/%j.out")
    entry = running(cluster, job)
    assert entry["nodes"] == ["n1", "n2", "n3"] and entry["batch_host"] == "n1"
    assert wait_until(lambda: "fleetheal-nodes=2" in job_json(cluster, job)["comment"].split(), 120)
    step_log = log / f"{job}.step"
    assert wait_until(lambda: step_log.exists() and sorted(step_log.read_text().split()) == ["n1", "n2"], 120)

    planned = steps.requeue_jobs(slurm, "n2", "inc-1", "xid-79", dry_run=True)
    assert "shrink n2 away" in planned[-1].detail, planned
    results = steps.requeue_jobs(slurm, "n2", "inc-1", "xid-79")
    assert [r.step for r in results] == ["slurm_signal", "slurm_requeue"], results
    assert "n2 shrunk away, restarted on n1,n3" in results[-1].detail, results
    out = log / f"{job}.out"
    told = [t for t in out.read_text().splitlines() if t.startswith("fleetheal:")]
    assert told == [
        f"fleetheal: relocated job {job} inside its allocation: n2 shrunk away, restarted on n1,n3, after xid-79 on n2 "
        "(incident inc-1)"
    ], told

    lines = log / f"{job}.launch"
    assert wait_until(lambda: "start 1 inc-1 n[1,3] 2" in lines.read_text(), 120), lines.read_text()
    assert wait_until(lambda: step_log.read_text().split()[2:] and "n3" in step_log.read_text().split()[2:], 120)
    entry = job_json(cluster, job)
    assert entry["state"] == "RUNNING" and entry["restart_cnt"] == 0, entry
    assert entry["nodes"] == ["n1", "n3"]
    assert {"fleetheal-launch", "fleetheal-nodes=2", "fleetheal-restarts=1"} <= set(entry["comment"].split())
    again = steps.requeue_jobs(slurm, "n2", "inc-1", "xid-79")
    assert [r.outcome for r in again] == ["skipped"], again

    # No spare left, and n1 runs the launcher: both are requeued as any job.
    job_now = slurm_job(slurm.squeue(), job)
    assert not steps.can_shrink(job_now, "n3") and not steps.can_shrink(job_now, "n1")
    requeued = steps.requeue_jobs(slurm, "n1", "inc-2", "xid-79")
    assert "requeued it" in requeued[-1].detail, requeued
    assert f"appended to {out}" in requeued[-1].detail, requeued
    assert (
        f"fleetheal: requeued job {job} after xid-79 on n1: it restarts on other nodes than n1 (incident inc-2)"
        in out.read_text().splitlines()
    )
    assert wait_until(lambda: job_json(cluster, job)["restart_cnt"] == 1, 120)


def test_restarts_in_the_job_count_toward_the_limit_and_a_forged_comment_word_counts_for_nothing() -> None:
    """The job's owner can write its comment: words that are not counts neither crash the step nor count."""
    job = {"comment": "fleetheal-launch fleetheal-nodes=2 fleetheal-restarts=2", "restart_cnt": 1}
    job |= {"nodes": ["n1", "n2", "n3"], "batch_host": "n1"}
    assert steps.restarts(job) == 3
    assert steps.can_shrink(job, "n2") and not steps.can_shrink(job, "n1")
    for forged in ("fleetheal-restarts=\u00b2", "fleetheal-restarts=-4", "fleetheal-restarts=x"):
        assert steps.restarts(job | {"comment": f"fleetheal-launch {forged}"}) == 1
    for forged in ("fleetheal-nodes=\u00b2", "fleetheal-nodes=0", "fleetheal-nodes=2x"):
        assert not steps.can_shrink(job | {"comment": f"fleetheal-launch {forged}"}, "n2")
    assert not steps.can_shrink(job | {"comment": "fleetheal-nodes=2"}, "n2")  # not run by the launcher


def test_a_shared_read_taken_since_a_moment_serves_every_caller_who_needs_no_newer_one() -> None:
    """A storm's first responses take any read that started after their alert arrived (no new one each);
    a plain call still waits for a read that starts after it (it must see its own earlier writes)."""
    reads: list[float] = []
    shared = client.Shared(lambda: reads.append(time.time()) or len(reads))
    before = time.time()
    assert shared.get()[1] == 1
    assert shared.get(since=before)[1] == 1 and len(reads) == 1  # the last read started after `before`
    assert shared.get(since=time.time())[1] == 2  # a moment after it: a new read
    assert shared.get()[1] == 3


def test_the_text_node_read_agrees_with_slurms_json(cluster: SlurmCluster) -> None:
    """Nodes are read with `sinfo -O` text (a fraction of the JSON's cost at fleet size): every node, its
    reason's time included, reads the same from it as from Slurm's JSON of nodes (`sinfo --json` on 22.05,
    `scontrol --json show node` from 23.02), whatever the reason holds, and a read of one node (`-n`) the
    same as from the read of all."""
    cluster.run("scontrol", "update", "nodename=n1", "state=DRAIN", "reason=fleetheal: a|b,c  d=e")
    cluster.run("scontrol", "update", "nodename=n2", "extra=fleetheal: promoted for n9 incident=inc-7")
    cluster.run("scontrol", "update", "nodename=n2", 'comment={"podName": "lab-h100-x"}')
    cluster.run("scontrol", "update", "nodename=n3", "state=DOWN", "reason=none of ours")
    text = nodes.read(cluster.run(*nodes.sinfo_argv()).stdout)
    json_read = ("sinfo", "--json") if cluster.release.version < (23, 2, 0) else ("scontrol", "--json", "show", "node")
    doc = cluster.run(*json_read).stdout
    assert text == nodes.read(doc)
    assert set(text) == {"n1", "n2", "n3"} and text["n1"].reason_time
    for name in ("n1", "n2", "n3", "nX"):
        assert nodes.slurm_node(text, name) == nodes.slurm_node(doc, name), name
    assert nodes.read(cluster.run(*nodes.sinfo_argv("sinfo", "n1")).stdout) == {"n1": text["n1"]}
    assert text["n1"].reason == "fleetheal: a|b,c  d=e" and text["n1"].reason_owned()
    assert text.with_extra("incident=inc-7") == ["n2"]
    assert text.with_reason("fleetheal:") == ["n1"]


def test_concurrent_steps_share_their_slurm_commands_and_keep_their_own_errors(cluster: SlurmCluster) -> None:
    """A storm's first responses on one Slurm: drains submitted together go to Slurm as one scontrol,
    reads together as about one sinfo, a standby node is never promoted twice, and a command that fails
    in a batch fails for its caller only."""
    cluster.run("scontrol", "update", "nodename=n3", "state=DRAIN", "reason=fleetheal:standby")
    slurm = steps.Slurm(settings(cluster))
    calls: list[tuple[str, ...]] = []
    real_run = slurm.run

    def counted(command: str, *args: str, **kw: Any) -> str:
        calls.append((command, *args))
        return real_run(command, *args, **kw)

    slurm.run = counted  # type: ignore[method-assign]
    barrier = threading.Barrier(8)

    def drain(i: int) -> steps.StepResult:
        barrier.wait()
        return steps.drain_node(slurm, ["n1", "n2"][i % 2], f"fleetheal:xid-79 incident=inc-{i}")

    with ThreadPoolExecutor(8) as pool:
        outcomes = [r.outcome for r in pool.map(drain, range(8))]
    assert outcomes == ["done"] * 8
    assert all("DRAIN" in cluster.node(n).flags for n in ("n1", "n2"))
    assert len([c for c in calls if c[0] == "sinfo"]) <= 3, calls  # 8 reads of the same state
    assert len([c for c in calls if c[0] == "scontrol"]) <= 3, calls  # 8 drains

    # A command Slurm refuses fails for its caller; the others of its batch succeed.
    barrier = threading.Barrier(6)

    def update(i: int) -> None:
        barrier.wait()
        slurm.scontrol("update", "nodename=nX" if i % 2 else "nodename=n1", f"comment=batch {i}")

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(update, i) for i in range(6)]
    for i, fut in enumerate(futures):
        if i % 2:
            with pytest.raises(steps.StepError, match="nodename=nX"):
                fut.result()
        else:
            fut.result()

    # Batched through scontrol's input, a value with a blank is stored as argv would store it (scontrol
    # keeps the quotes of a quoted value, but for a reason): no comment ends up '"note 1"'.
    barrier = threading.Barrier(4)

    def note(i: int) -> None:
        barrier.wait()
        slurm.scontrol("update", "nodename=n1", f"comment=note {i}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(note, range(4)))
    assert slurm.sinfo()["n1"].comment in {f"note {i}" for i in range(4)}

    # Two promotions at once for two incidents never pick the same standby node.
    cluster.run("scontrol", "update", "nodename=n2", "state=DRAIN", "reason=fleetheal:standby")
    with ThreadPoolExecutor(2) as pool:
        picks = list(pool.map(lambda i: steps.promote_standby(slurm, "n1", f"inc-p{i}"), range(2)))
    assert sorted(p.outcome for p in picks) == ["done", "done"]
    assert sorted(p.node for p in picks) == ["n2", "n3"]
    # Commands batched through scontrol's input keep their values as argv would (it stores a quoted
    # value with its quotes, but for a reason): each promotion is found again by its incident.
    for i, pick in enumerate(picks):
        assert not slurm.sinfo()[pick.node].extra.startswith('"')
        again = steps.promote_standby(slurm, "n1", f"inc-p{i}")
        assert (again.outcome, again.node, again.changed) == ("done", pick.node, False)


def test_a_shared_read_never_started_before_its_caller_asked() -> None:
    """Callers see at least their own earlier writes: joining a read already in flight could miss them."""
    reads: list[float] = []

    def fetch() -> int:
        reads.append(time.monotonic())
        time.sleep(0.05)
        return len(reads)

    shared = client.Shared(fetch)

    def ask(delay: float) -> tuple[float, float]:
        time.sleep(delay)
        asked = time.monotonic()
        started, _ = shared.get()
        return asked, started

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, [i * 0.01 for i in range(20)]))
    assert all(started >= asked for asked, started in answers)


def test_callers_that_ask_while_a_read_is_in_flight_share_the_next_one() -> None:
    """Nine callers arrive while a read is in flight: they do not join it (it began before they asked),
    they share the one read that starts after it."""
    first_started, release = threading.Event(), threading.Event()
    reads: list[int] = []

    def fetch() -> int:
        reads.append(len(reads))
        if len(reads) == 1:
            first_started.set()
            assert release.wait(60)
        return len(reads)

    shared = client.Shared(fetch)
    with ThreadPoolExecutor(10) as pool:
        first = pool.submit(shared.get)
        assert first_started.wait(60)
        waiting = [pool.submit(shared.get) for _ in range(9)]
        # every one of them is waiting on the condition (CPython's Condition keeps its waiters' locks)
        assert wait_until(lambda: len(shared._cond._waiters) == 9, 60)  # type: ignore[attr-defined]
        release.set()
        assert first.result()[1] == 1
        assert {f.result()[1] for f in waiting} == {2}  # one read for the nine
    assert len(reads) == 2


def test_a_batch_caller_waits_for_its_own_batch_only_and_gets_its_own_error() -> None:
    starts: list[float] = []
    seen: list[int] = []

    def run_batch(items: list[int]) -> list[Exception | None]:
        starts.append(time.monotonic())
        time.sleep(0.05)
        seen.extend(items)
        return [ValueError(f"item {i}") if i % 5 == 0 else None for i in items]

    batched = client.Batched(run_batch)

    def call(i: int) -> tuple[float, float, str]:
        time.sleep(i * 0.01)
        asked = time.monotonic()
        try:
            batched.submit(i)
            error = ""
        except ValueError as exc:
            error = str(exc)
        return asked, time.monotonic(), error

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(call, range(30)))
    assert sorted(seen) == list(range(30))  # every command sent once
    assert [e for _, _, e in answers] == [f"item {i}" if i % 5 == 0 else "" for i in range(30)]
    for asked, answered, _ in answers:  # the batch in flight as it asked (or just starting), then its own
        assert len([t for t in starts if asked < t < answered]) <= 2


def test_commands_submitted_while_a_batch_runs_go_as_one_next_batch() -> None:
    first_started, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def run_batch(items: list[int]) -> list[Exception | None]:
        batches.append(items)
        if len(batches) == 1:
            first_started.set()
            assert release.wait(60)
        return [None] * len(items)

    batched = client.Batched(run_batch)
    with ThreadPoolExecutor(30) as pool:
        first = pool.submit(batched.submit, 0)
        assert first_started.wait(60)
        rest = [pool.submit(batched.submit, i) for i in range(1, 30)]
        assert wait_until(lambda: len(batched._pending) == 29, 60)
        release.set()
        for fut in [first, *rest]:
            fut.result()
    assert [sorted(b) for b in batches] == [[0], list(range(1, 30))]


def test_a_value_with_a_newline_never_reaches_scontrol_as_a_second_command() -> None:
    """scontrol reads a batch from stdin, one command a line: a comment or reason carrying a newline would
    smuggle in a command of its own (`delete ...`, `shutdown`). It is refused for its caller, before it
    joins a batch, and nothing is run."""
    slurm = steps.Slurm(steps.Settings())
    ran: list[tuple[str, ...]] = []
    slurm.run = lambda *a, **kw: ran.append(a) or ""  # type: ignore[method-assign]
    for bad in ("comment=x\nshutdown", 'reason=a" state=DOWN "'):
        with pytest.raises(steps.StepError, match="quote or a newline"):
            slurm.scontrol("update", "nodename=n1", bad)
    assert ran == []
    slurm.scontrol("update", "nodename=n1", "comment=two words")
    assert ran == [("scontrol", "update", "nodename=n1", "comment=two words")]


def test_the_collection_runs_its_steps_in_the_controller(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The playbooks run on the control host: a fleetheal.cluster task runs its step in the controller (the
    module's action plugin), with no module interpreter: this host's interpreter does not even exist."""
    repo = Path(__file__).resolve().parents[2]
    task = {
        "fleetheal.cluster.slurm_node": {
            "name": "n2",
            "state": "drained",
            "incident": "inc-9",
            "reason": "fleetheal:xid-79 incident=inc-9",
            "settings": {"fleetheal_slurm_env": {"SLURM_CONF": str(cluster.conf_path)}},
        },
        "register": "drained",
    }
    check = {"ansible.builtin.assert": {"that": ["drained.changed", "drained.steps[0].outcome == 'done'"]}}
    (tmp_path / "play.yml").write_text(
        yaml.safe_dump([{"hosts": "all", "gather_facts": False, "tasks": [task, check]}])
    )
    (tmp_path / "hosts").write_text("control ansible_connection=local ansible_python_interpreter=/nonexistent/python\n")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(repo / "playbooks" / "collections"))
    run = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts"), str(tmp_path / "play.yml")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    node = cluster.node("n2")
    assert node.drained and node.reason == "fleetheal:xid-79 incident=inc-9"


def test_a_drain_refuses_pods_no_controller_would_recreate_and_keeps_daemonset_and_mirror_pods() -> None:
    def pod(name: str, *, owner: str = "", phase: str = "Running", mirror: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"namespace": "ns", "name": name}
        if owner:
            meta["ownerReferences"] = [{"kind": owner, "name": "o"}]
        if mirror:
            meta["annotations"] = {"kubernetes.io/config.mirror": "x"}
        return {"metadata": meta, "status": {"phase": phase}}

    pods = [
        pod("job", owner="Job"),
        pod("agent", owner="DaemonSet"),
        pod("static", mirror=True),
        pod("bare"),
        pod("bare-done", phase="Succeeded"),
        pod("slurmd", owner="NodeSet"),
    ]
    evict, unmanaged = kube_steps.pods_to_evict(pods)
    assert evict == [("ns", "job"), ("ns", "bare-done"), ("ns", "slurmd")]
    assert unmanaged == ["ns/bare"]


def test_a_job_log_is_appended_to_only_as_its_owner_could(tmp_path: Path) -> None:
    append_job_log, StepError = steps.append_job_log, steps.StepError
    log = tmp_path / "out.log"
    log.write_text("step 1\n")
    me = os.getuid()
    assert append_job_log(str(log), "fleetheal: told", me) == f"appended to {log}"
    assert append_job_log(str(log), "fleetheal: told", me) == f"{log} already tells it"
    assert log.read_text() == "step 1\nfleetheal: told\n"
    with pytest.raises(StepError, match="not a regular file of the job's user"):
        append_job_log(str(log), "x", me + 1)  # someone else's file
    (tmp_path / "link").symlink_to(log)
    with pytest.raises(StepError, match="not a regular file"):
        append_job_log(str(tmp_path / "link"), "x", me)
    with pytest.raises(StepError, match="not a regular file"):
        append_job_log("/dev/null", "x", me)  # never opened
    os.link(log, tmp_path / "hard")
    with pytest.raises(StepError, match="with one link"):
        append_job_log(str(tmp_path / "hard"), "x", me)
    assert log.read_text() == "step 1\nfleetheal: told\n"
