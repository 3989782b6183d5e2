"""The SlurmCluster harness: parsing a job line (no daemons) and a real private slurmctld + slurmd.
Node reads are tested in tests/slurm/test_readers.py."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from fleetheal.contracts import drain_reason
from fleetheal.lab.slurm import Release, SlurmCluster, SlurmError, parse_kv_line
from fleetheal.procs import alive, wait_gone


def test_parse_kv_line_job_fields_do_not_swallow_the_rest():
    kv = parse_kv_line("JobId=4 JobName=train JobState=PENDING Reason=BeginTime Dependency=(null) Restarts=1")
    assert kv["Reason"] == "BeginTime"
    assert kv["Restarts"] == "1"


def test_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        SlurmCluster(tmp_path, nodes=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        SlurmCluster(tmp_path, gpus_per_node=-1)


def test_release_of_debians_slurm_and_of_a_relocated_tree(tmp_path):
    """`Release.of` reads `slurmctld -V` and finds a relocated tree's root from the program's real path: only a
    tree gets a PluginDir, and only 24.11+ gets `CgroupPlugin=disabled`."""
    root = tmp_path / "tree" / "root"
    (root / "usr" / "sbin").mkdir(parents=True)
    real = root / "usr" / "sbin" / "slurmctld-wlm"
    real.write_text("#!/bin/sh\necho 'slurm-wlm 26.05.5'\n")
    real.chmod(0o755)
    (tmp_path / "tree" / "bin").mkdir()
    (tmp_path / "tree" / "bin" / "slurmctld").symlink_to(real)
    tree = Release.of(str(tmp_path / "tree" / "bin" / "slurmctld"))
    assert (tree.version, tree.root, tree.name) == ((26, 5, 5), root, "26.05.5")
    assert tree.conf_lines() == [f"PluginDir={root}/usr/lib/x86_64-linux-gnu/slurm-wlm"]
    assert tree.cgroup_conf() == "CgroupPlugin=disabled\n"
    debian = Release((22, 5, 8), Path("/"))
    assert debian.conf_lines() == [] and debian.cgroup_conf() == "" and debian.name == "22.05.8"
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\necho nothing\n")
    silent.chmod(0o755)
    with pytest.raises(SlurmError, match="printed no version"):
        Release.of(str(silent))


def _need_slurm() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "munged", "unshare") if not shutil.which(t)]
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: Slurm harness needs Debian's slurm/munge packages; missing {missing}")
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: the Slurm harness needs root (slurmd, unshare --pid)")


@pytest.fixture
def cluster(tmp_path):
    _need_slurm()
    c = SlurmCluster(tmp_path / "slurm", nodes=2, gpus_per_node=4, extra_conf=["HealthCheckInterval=3600"])
    c.start()
    try:
        yield c
    finally:
        c.stop(graceful=False)


@pytest.mark.slurm
def test_cluster_schedules_fake_gpus_and_reports_drain(cluster):
    cluster.wait_nodes("IDLE", timeout=20)
    assert set(cluster.nodes()) == {"n1", "n2"}
    assert "HealthCheckInterval     = 3600" in cluster.scontrol("show", "config")

    job = cluster.sbatch("#!/bin/sh\necho gpus=$CUDA_VISIBLE_DEVICES\n", "--gres=gpu:4", "--output=out-%j.txt")
    out = cluster.state_dir / "jobs" / f"out-{job}.txt"
    cluster.wait_for(f"job {job} output", lambda: out.exists() and "gpus=" in out.read_text(), timeout=20)
    assert out.read_text().strip() == "gpus=0,1,2,3"
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        cluster.sbatch("#!/bin/sh\ntrue\n", "--gres=gpu:5")

    reason = drain_reason("xid-79", "inc-1", gpu="3")
    cluster.scontrol("update", "nodename=n2", "state=drain", f"reason={reason}")
    n2 = cluster.node("n2")
    assert n2.drained
    assert n2.reason == reason
    cluster.scontrol("update", "nodename=n2", "state=resume")
    cluster.wait_nodes("IDLE", nodes=["n2"], timeout=60)


@pytest.mark.slurm
def test_a_killed_slurmd_goes_not_responding_and_comes_back(cluster):
    cluster.kill_slurmd("n1")
    assert not any(cmd.endswith(" -D -N n1") for cmd in cluster.processes().values())
    cluster.scontrol("ping")  # slurmctld is unaffected
    cluster.start_slurmd("n1")
    cluster.wait_nodes("IDLE", timeout=20)
    with pytest.raises(SlurmError, match="unknown node"):
        cluster.start_slurmd("n9")


@pytest.mark.slurm
def test_stop_leaves_nothing_behind_and_state_survives_a_restart(tmp_path):
    _need_slurm()
    state = tmp_path / "state"
    with SlurmCluster(state, nodes=3, gpus_per_node=2) as c:
        pids = set(c.processes())
        cmds = " ".join(c.processes().values())
        assert "slurmctld" in cmds
        assert cmds.count(" -D -N ") == 3
        assert "munged" in cmds
        c.scontrol("update", "nodename=n3", "state=drain", "reason=fleetheal:test incident=i")
        holder = c.holder_pid
    assert holder is not None
    assert not any(alive(p) for p in pids | {holder}), "a cluster process survived stop()"
    assert not (state / "cluster.json").exists()
    with pytest.raises(SlurmError, match="no running cluster"):
        SlurmCluster.attach(state)

    # Same state dir: slurmctld's saved state (the drain) is back; attach() finds the running cluster.
    first = SlurmCluster(state, nodes=3, gpus_per_node=2).start()
    try:
        again = SlurmCluster.attach(state)
        assert again.holder_pid == first.holder_pid
        assert again.node("n3").reason == "fleetheal:test incident=i"
        with pytest.raises(SlurmError, match="already running"):
            SlurmCluster(state, nodes=3).start()
        again.stop()
        assert not first.running()
    finally:
        first.stop(graceful=False)


@pytest.mark.slurm
def test_one_sigkill_of_the_holder_takes_every_daemon_down(tmp_path):
    _need_slurm()
    c = SlurmCluster(tmp_path / "s", nodes=1, gpus_per_node=0).start()
    try:
        pids = set(c.processes())
        assert pids
        assert c.holder_pid is not None
        os.kill(c.holder_pid, signal.SIGKILL)
        assert wait_gone(pids, 5) == []
    finally:
        c.stop(graceful=False)
