"""A Slurm rule the deployed timers are chosen around (fleetheal.slurm.conf.CRED_EXPIRE_S), on real Slurm: a
requeued job may start again only cred_expire + 1 s after its requeue. Slurm holds it (Reason=BeginTime)
wherever it goes next. A job that must run again sooner takes `fleetheal launch` (new steps in its own
allocation), not a requeue."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetheal.lab import slurmconf
from fleetheal.lab.slurm import SlurmCluster

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "munged", "unshare") if not shutil.which(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"SKIPPED LOUDLY: needs root and Slurm (missing: {missing or 'root'})")
    with SlurmCluster(tmp_path / "slurm", nodes=1, gpus_per_node=0) as c:
        yield c


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
