"""The Slurm behaviour the deployed timers are chosen around, on real Slurm.

- A requeued job may start again only cred_expire + 1 s after its requeue (fleetheal.slurm.conf.CRED_EXPIRE_S).
  Slurm holds it (Reason=BeginTime) wherever it goes next. A job that must run again sooner takes `fleetheal
  launch` (new steps in its own allocation), not a requeue.
- A node that stops answering is flagged NOT_RESPONDING by the health check it does not answer
  (HEALTH_CHECK_INTERVAL_S), long before SlurmdTimeout declares it DOWN: the failover waits for that flag."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
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
