"""The Slurm behaviour the deployed timers are chosen around, on real Slurm (26.05, what Slinky deploys).

- A requeued job may start again only cred_expire + 1 s after its requeue (fleetheal.slurm.conf.CRED_EXPIRE_S).
  Slurm holds it (Reason=BeginTime) wherever it goes next. A job that must run again sooner takes `fleetheal
  launch` (new steps in its own allocation), not a requeue.
- Nothing schedules a job when its begin-time hold expires: it waits for the main scheduler's next full pass
  (SCHED_INTERVAL_S) or the backfill's, so a requeue costs up to sched_interval beyond its hold.
- A node that stops answering is flagged NOT_RESPONDING by the health check it does not answer
  (HEALTH_CHECK_INTERVAL_S), long before SlurmdTimeout declares it DOWN: the failover waits for that flag.
- An RPC to a peer that takes the connection and never answers (a frozen slurmctld) costs its caller exactly
  MessageTimeout (MESSAGE_TIMEOUT_S), then fails.
- A job's task that SIGKILL cannot end (stuck in the kernel, as a GPU process in the driver after an Xid 79)
  holds its node COMPLETING, and its requeued job with it, for as long as it is stuck: Slurm 26.05 does not drain
  the node after UnkillableStepTimeout (UNKILLABLE_STEP_TIMEOUT_S), as 22.05 did ("Kill task failed")."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from fleetheal.lab import slurmconf
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.slurm import conf

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    _need_slurm()
    with SlurmCluster(tmp_path / "slurm", nodes=1, gpus_per_node=0) as c:
        yield c


def _need_slurm() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "munged", "unshare") if not shutil.which(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"SKIPPED LOUDLY: needs root and Slurm (missing: {missing or 'root'})")


def test_a_requeued_job_starts_again_no_sooner_than_cred_expire_plus_one(cluster: SlurmCluster) -> None:
    cred_expire = slurmconf.FAST_CRED_EXPIRE_S  # 5: the least Slurm accepts (the tests' timers)
    assert f"cred_expire={cred_expire}" in cluster.scontrol("show", "config")
    job = cluster.sbatch("#!/bin/sh\nexec sleep 300\n", "--requeue", "--output=/dev/null")
    cluster.wait_for("the job to run", lambda: cluster.job(job)["JobState"] == "RUNNING", 30)
    requeued = time.monotonic()
    cluster.scontrol("requeue", job)
    # Held: its begin time is cred_expire + 1 s ahead, on its old node as on any other.
    cluster.wait_for("the hold", lambda: cluster.job(job).get("Reason") == "BeginTime", 10, interval=0.1)
    cluster.wait_for("the job to run again", lambda: cluster.job(job)["JobState"] == "RUNNING", 30, interval=0.1)
    # Slurm counts the hold in whole seconds from the requeue's second: at least cred_expire s have passed.
    assert time.monotonic() - requeued >= cred_expire
    assert cluster.job(job)["Restarts"] == "1"


def test_a_requeued_job_whose_hold_expires_waits_for_the_next_full_scheduler_pass(tmp_path: Path) -> None:
    """Nothing schedules a job when its BeginTime passes: the main scheduler's next full pass, every
    sched_interval, starts it. With sched_interval=20 (so that the wait shows against the hold of cred_expire + 1
    = 6 s) and the job requeued early in a pass interval, its hold expires well before the next pass, and it
    waits (measured: started by that full pass 10-11 s after its begin time; with the deployed sched_interval=10
    and backfill on, 4 s on each of 5 requeues). The backfill scheduler, whose own pass (bf_interval, 30 s by
    default, on in the deployed stack) can start such a job first, is off here, so that only the main pass can."""
    _need_slurm()
    sched_interval = 20
    extra = [
        f"SchedulerParameters=sched_interval={sched_interval},batch_sched_delay=0,bf_interval=-1",
        "SlurmctldDebug=debug",  # logs each pass: "sched: Running job scheduler for full queue."
    ]
    with SlurmCluster(tmp_path / "slurm", nodes=1, gpus_per_node=0, extra_conf=extra) as c:
        log = c.log_dir / "slurmctld.log"
        job = c.sbatch("#!/bin/sh\nexec sleep 300\n", "--requeue", "--output=/dev/null")
        c.wait_for("the job to run", lambda: c.job(job)["JobState"] == "RUNNING", 30, interval=0.1)
        # Requeue early in a pass interval (at once, or after the next pass), so that the hold (6 s) expires
        # at least 8 s before the next pass.
        epoch = _scheduler_epoch(log)
        if datetime.now() > epoch + timedelta(seconds=sched_interval - 14):
            c.wait_for("a full pass", lambda: _scheduler_epoch(log) > epoch, sched_interval + 5, interval=0.1)
        c.scontrol("requeue", job)
        c.wait_for("the hold", lambda: c.job(job).get("Reason") == "BeginTime", 10, interval=0.1)
        begin = datetime.fromisoformat(c.job(job)["EligibleTime"])
        pending_at = datetime.now()

        def running() -> bool:
            nonlocal pending_at
            if c.job(job)["JobState"] == "PENDING":
                pending_at = datetime.now()
                return False
            return True

        c.wait_for("the job to run again", running, sched_interval + 10, interval=0.1)
        started = datetime.fromisoformat(c.job(job)["StartTime"])
        # Its hold expired and nothing started it: still pending seconds after its begin time.
        assert pending_at >= begin + timedelta(seconds=2), (begin, pending_at)
        # The next full pass did, no later than sched_interval after its begin time (Slurm's passes drift ~1 s).
        assert started - begin <= timedelta(seconds=sched_interval + 2), (begin, started)
        assert _started_by(log, job) == "full queue"


def _scheduler_epoch(log: Path) -> datetime:
    """When the main scheduler last made a full pass (its log line at SlurmctldDebug=debug) or, before its first,
    when slurmctld started: its next full pass comes sched_interval after that."""
    found = re.findall(
        r"^\[(\S+)\] (?:Running as primary controller|debug:\s+sched: Running job scheduler for full queue)",
        log.read_text(),
        re.M,
    )
    return datetime.fromisoformat(found[-1])


def _started_by(log: Path, job: str) -> str:
    """Which pass of the main scheduler ("full queue" or "default depth") allocated the job last."""
    kind = started_by = ""
    for line in log.read_text().splitlines():
        if m := re.search(r"sched: Running job scheduler for (full queue|default depth)", line):
            kind = m.group(1)
        elif re.search(rf"sched: Allocate JobId={job} ", line):
            started_by = kind
    return started_by


def test_a_silent_node_is_flagged_by_its_health_check_long_before_slurmd_timeout(tmp_path: Path) -> None:
    """The deployed timers (HealthCheckInterval 10 s, SlurmdTimeout 120 s): a node whose slurmd stops (a lost
    leaf switch, as the lab stages it) is flagged NOT_RESPONDING while Slurm still counts it up, within the
    health check's interval and its RPC's timeout (measured: 26 s; Slurm's own ping alone: 100 s)."""
    _need_slurm()
    with SlurmCluster(tmp_path / "slurm", nodes=2, gpus_per_node=0, fast_timers=False) as c:
        config = c.scontrol("show", "config")
        assert re.search(rf"^SlurmdTimeout\s*=\s*{conf.SLURMD_TIMEOUT_S}\b", config, re.M)
        assert re.search(rf"^HealthCheckInterval\s*=\s*{conf.HEALTH_CHECK_INTERVAL_S}\b", config, re.M)
        c.wait_nodes(timeout=60)
        frozen = c.freeze_nodes(["n1"])
        try:
            flagged = time.monotonic()
            # Well before SlurmdTimeout: the flag comes from the health check, not from Slurm's timeout.
            c.wait_for(
                "n1 flagged NOT_RESPONDING",
                lambda: "NOT_RESPONDING" in c.nodes()["n1"].flags,
                conf.SLURMD_TIMEOUT_S - 30,
                interval=0.5,
            )
            assert time.monotonic() - flagged < conf.SLURMD_TIMEOUT_S
            assert c.nodes()["n1"].state != "DOWN"
            assert "NOT_RESPONDING" not in c.nodes()["n2"].flags
        finally:
            c.thaw_nodes(frozen)


def test_an_rpc_to_a_peer_that_never_answers_costs_message_timeout(cluster: SlurmCluster) -> None:
    """A frozen slurmctld (SIGSTOP: the kernel still takes the connection, nothing answers, as with a hung
    controller) costs each client RPC MessageTimeout (the tests' 5 s; deployed: 10 s), then fails with
    "Socket timed out" (measured: 5.00-5.02 s; a live controller answers in ~10 ms)."""
    config = cluster.scontrol("show", "config")
    found = re.search(r"^MessageTimeout\s*=\s*(\d+) sec", config, re.M)
    assert found, config
    message_timeout = int(found.group(1))
    assert message_timeout == int(slurmconf.FAST_TIMERS["MessageTimeout"])
    started = time.monotonic()
    cluster.run("squeue")
    assert time.monotonic() - started < 1
    [ctld] = [pid for pid, cmd in cluster.processes().items() if re.search(r"(^|/)slurmctld -D", cmd)]
    os.kill(ctld, signal.SIGSTOP)
    try:
        started = time.monotonic()
        out = cluster.run("squeue", check=False, timeout=3 * message_timeout)
        took = time.monotonic() - started
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert out.returncode != 0
    assert "Socket timed out" in out.stderr
    assert message_timeout - 0.5 <= took <= message_timeout + 2, took
    cluster.run("squeue")  # thawed, it answers again


#: A cgroup-v1 freezer hierarchy: a task frozen there stays, SIGKILL pending, until thawed (in cgroup v2 a
#: frozen task dies of SIGKILL). How the tests make a process that SIGKILL cannot end, as the GPU driver can.
FREEZER = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def _freezer_cgroup() -> Iterator[Path]:
    """A new cgroup of the freezer hierarchy; on exit thawed, what is left in it killed, and removed."""
    if not (FREEZER / "cgroup.procs").exists() or (FREEZER / "cgroup.controllers").exists():
        pytest.skip(f"SKIPPED LOUDLY: needs a cgroup-v1 freezer hierarchy at {FREEZER}")
    cgroup = FREEZER / f"fleetheal-test-{os.getpid()}-{time.monotonic_ns()}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        for pid in _pids(cgroup):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        SlurmCluster.wait_for("the frozen cgroup to empty", lambda: not _pids(cgroup), 10)
        cgroup.rmdir()


def _pids(cgroup: Path) -> list[int]:
    return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]


def _pending(pid: int) -> int:
    """The mask of the signals pending on `pid`, the process's and its thread's (bit n - 1 for signal n)."""
    mask = 0
    for pending in re.findall(r"^(?:ShdPnd|SigPnd):\s*(\w+)$", Path(f"/proc/{pid}/status").read_text(), re.M):
        mask |= int(pending, 16)
    return mask


def test_an_unkillable_task_holds_its_node_completing_and_slurm_26_05_never_drains_it(tmp_path: Path) -> None:
    """A job's task that SIGKILL cannot end (frozen in a cgroup-v1 freezer: alive, SIGKILL pending, as a process
    stuck in the GPU driver) keeps its node COMPLETING and its requeued job COMPLETING past UnkillableStepTimeout,
    undrained. Slurm 22.05 drained the node "Kill task failed" KillWait + UnkillableStepTimeout after the requeue
    (measured with this test's timers: 20 s). Slurm 26.05 no longer does: since "Skip
    step_terminate_monitor_start() if step already cancelled" (SchedMD commit 7bf6b225b4, in 26.05.0) the timer
    is not started by a terminate request once the step was cancelled, and the SIGTERM of a requeue or a cancel
    cancels it first; by the code it then starts only after the step's tasks have exited (for processes left in
    its container) or for a suspended step. Measured on 26.05.5 with UnkillableStepTimeout=10: COMPLETING for as
    long as the task was held (up to 116 s; requeue or scancel; a batch script's task or an srun step's), never
    drained. fleetheal's agent, which drains a node on the Xid itself, is what takes such a node out of service."""
    _need_slurm()
    unkillable_timeout = 10
    extra = [f"UnkillableStepTimeout={unkillable_timeout}"]
    with SlurmCluster(tmp_path / "slurm", nodes=1, gpus_per_node=0, extra_conf=extra) as c:
        config = c.scontrol("show", "config")
        assert re.search(rf"^UnkillableStepTimeout\s*=\s*{unkillable_timeout} sec", config, re.M), config
        kill_wait = int(slurmconf.FAST_TIMERS["KillWait"])
        assert re.search(rf"^KillWait\s*=\s*{kill_wait} sec", config, re.M), config
        with _freezer_cgroup() as cgroup:
            job = c.sbatch(
                f"#!/bin/sh\necho $$ > {cgroup}/cgroup.procs\nexec sleep 300\n", "--requeue", "--output=/dev/null"
            )
            c.wait_for("the job's task in the cgroup", lambda: _pids(cgroup), 30, interval=0.1)
            [task] = _pids(cgroup)
            (cgroup / "freezer.state").write_text("FROZEN")
            c.wait_for("the freeze", lambda: (cgroup / "freezer.state").read_text().strip() == "FROZEN", 10)
            requeued = time.monotonic()
            c.scontrol("requeue", job)
            c.wait_for(
                "SIGKILL to the task", lambda: _pending(task) & (1 << (signal.SIGKILL - 1)), kill_wait + 5, interval=0.1
            )
            # Past the drain 22.05 made (KillWait + UnkillableStepTimeout after the requeue), the task alive:
            while time.monotonic() - requeued < kill_wait + unkillable_timeout + 5:
                node = c.node("n1")
                assert "COMPLETING" in node.flags, node
                assert not node.drained, node
                assert c.job(job)["JobState"] == "COMPLETING"
                time.sleep(0.5)
            assert task in _pids(cgroup)
        # Thawed, the task dies of its SIGKILL: the node is free, never drained, and the job requeued.
        c.wait_for("the node to complete", lambda: "COMPLETING" not in c.node("n1").flags, 30, interval=0.2)
        assert not c.node("n1").drained
        assert c.job(job)["JobState"] in {"PENDING", "RUNNING"}
        assert c.job(job)["Restarts"] == "1"
