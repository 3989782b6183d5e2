"""The Slurm hook scripts the program ships (HealthCheckProgram, prolog, epilog) against a real
slurmctld/slurmd (fleetheal.lab.slurm.SlurmCluster, Debian's Slurm)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetheal import contracts
from fleetheal.infra import slurm_hooks
from fleetheal.lab.slurm import SlurmCluster

pytestmark = pytest.mark.slurm


def _need_slurm() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "munged", "unshare") if not shutil.which(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"SKIPPED LOUDLY: needs root and Debian's Slurm packages (missing: {missing or 'root'})")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def hooks(tmp_path: Path) -> dict[str, Path]:
    state = tmp_path / "state"
    state.mkdir()
    d = tmp_path / "hooks"
    d.mkdir()
    out = {"state": state}
    for name, text in (
        ("healthcheck", slurm_hooks.healthcheck_script()),
        ("prolog", slurm_hooks.prolog_script()),
        ("epilog", slurm_hooks.epilog_script()),
    ):
        script = _write(d / f"{name}.sh", text)
        # Slurm runs prolog/epilog with a bare environment: a wrapper points the script at the test dir.
        out[name] = _write(
            d / f"{name}-wrapper.sh", f"#!/usr/bin/env bash\nexport FLEETHEAL_STATE_DIR={state}\nexec {script}\n"
        )
        out[f"{name}-script"] = script
    return out


@pytest.fixture
def cluster(tmp_path: Path, hooks: dict[str, Path]) -> Iterator[SlurmCluster]:
    _need_slurm()
    c = SlurmCluster(
        tmp_path / "slurm",
        nodes=2,
        gpus_per_node=0,
        extra_conf=[f"Prolog={hooks['prolog']}", f"Epilog={hooks['epilog']}"],
    )
    c.start()
    try:
        yield c
    finally:
        c.stop(graceful=False)


def _healthcheck(cluster: SlurmCluster, hooks: dict[str, Path], node: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "SLURMD_NODENAME": node, "FLEETHEAL_STATE_DIR": str(hooks["state"])}
    return subprocess.run(
        [str(hooks["healthcheck-script"])], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_healthcheck_drains_its_own_node_with_an_owned_reason(cluster: SlurmCluster, hooks: dict[str, Path]) -> None:
    health = hooks["state"] / "health"
    assert _healthcheck(cluster, hooks, "n1").returncode == 0  # no health file yet: log only
    assert "DRAIN" not in cluster.node("n1").flags
    health.write_text("ok\n")
    assert _healthcheck(cluster, hooks, "n1").returncode == 0
    assert "DRAIN" not in cluster.node("n1").flags
    health.write_text("xid-79\n")
    assert _healthcheck(cluster, hooks, "n1").returncode == 1
    node = cluster.node("n1")
    assert "DRAIN" in node.flags
    assert node.reason == "fleetheal:xid-79 incident=healthcheck-n1"
    assert contracts.owns_reason(node.reason)
    assert "DRAIN" not in cluster.node("n2").flags


def test_healthcheck_keeps_a_human_drain_reason(cluster: SlurmCluster, hooks: dict[str, Path]) -> None:
    cluster.scontrol("update", "nodename=n2", "state=drain", "reason=rack maintenance")
    (hooks["state"] / "health").write_text("xid-48\n")
    assert _healthcheck(cluster, hooks, "n2").returncode == 1
    assert cluster.node("n2").reason == "rack maintenance"


def test_prolog_records_the_job_and_epilog_removes_it(cluster: SlurmCluster, hooks: dict[str, Path]) -> None:
    jobs = hooks["state"] / "jobs"
    job = cluster.sbatch("#!/bin/bash\nsleep 3\n", "-w", "n1")
    cluster.wait_for("prolog job file", lambda: (jobs / job).exists(), timeout=20)
    fields = dict(line.split("=", 1) for line in (jobs / job).read_text().splitlines())
    assert fields["job_id"] == job and fields["restart_count"] == "0"
    cluster.wait_for("epilog removed the job file", lambda: not (jobs / job).exists(), timeout=30)


def test_prolog_refuses_an_unhealthy_node(cluster: SlurmCluster, hooks: dict[str, Path]) -> None:
    (hooks["state"] / "health").write_text("xid-79\n")
    job = cluster.sbatch("#!/bin/bash\nsleep 1\n", "-w", "n1")
    # A failing prolog makes Slurm drain the node and requeue (hold) the job: it never runs there.
    cluster.wait_for("n1 drained by the prolog failure", lambda: "DRAIN" in cluster.node("n1").flags, timeout=30)
    time.sleep(0.5)
    assert not (hooks["state"] / "jobs" / job).exists()
    assert cluster.job(job)["JobState"] != "COMPLETED"
