"""The lab's training job on a real private Slurm: checkpoint on the grace signal, resume after a
requeue, one log across restarts; and its ETTR and continuity arithmetic."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from fleetheal.lab.slurm import SlurmCluster
from fleetheal.lab.train import batch_script, ettr, loss_at, read_checkpoint, read_events
from fleetheal.lab.watcher import continuity

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ettr_counts_only_kept_steps():
    events = [
        {"event": "start", "time": 100.0, "step_time": 0.1, "resumed_from": 0, "restart": 0},
        {"event": "progress", "time": 110.0, "step": 100},
        {"event": "signal", "time": 110.0, "step": 100, "signal": "SIGUSR1"},
        {"event": "start", "time": 120.0, "step_time": 0.1, "resumed_from": 100, "restart": 1, "incident": "inc-1"},
        {"event": "progress", "time": 130.0, "step": 200},
    ]
    # 200 kept steps at 0.1 s = 20 s of 30 s wall time
    assert ettr(events) == pytest.approx(20 / 30)
    assert ettr(events, now=140.0) == pytest.approx(20 / 40)
    assert ettr([]) is None
    assert loss_at(10) == loss_at(10) and loss_at(1000) < loss_at(10)


@pytest.mark.slurm
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is None,
                    reason="needs root and Debian's slurmctld/slurmd")  # fmt: skip
def test_grace_signal_requeue_and_resume_keep_one_log(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    with SlurmCluster(tmp_path / "slurm", nodes=3, gpus_per_node=2) as cluster:
        script = batch_script(sys.executable, run, steps=100_000, step_time=0.05, checkpoint_every=1.0, pythonpath=REPO)
        job = cluster.sbatch(script, "-N2", "--gres=gpu:2", "--requeue", "--open-mode=append", f"--output={log}")
        cluster.wait_for("the job running", lambda: cluster.job(job)["JobState"] == "RUNNING", timeout=30)
        # the worker rank runs on the second node through srun
        cluster.wait_for(
            "the worker rank",
            lambda: any("fleetheal.lab.train worker" in c for c in cluster.processes().values()),
            timeout=30,
        )
        cluster.wait_for("a checkpoint", lambda: read_checkpoint(run) is not None, timeout=30)
        cluster.run("scancel", "--batch", f"--signal={signal.SIGUSR1.name[3:]}", job)
        cluster.wait_for("the grace checkpoint", lambda: any(e["event"] == "signal" for e in read_events(run)), 60)
        assert cluster.job(job)["JobState"] == "RUNNING"  # it waits for the requeue
        saved = read_checkpoint(run)
        assert saved is not None and saved["why"] == "grace signal SIGUSR1"
        cluster.scontrol("requeue", job)
        cluster.scontrol("update", f"jobid={job}", "comment=fleetheal: requeued after xid-79 on n2 incident=inc-000042")
        cluster.wait_for(
            "the second start", lambda: len([e for e in read_events(run) if e["event"] == "start"]) == 2, 60
        )
        cluster.wait_for(
            "progress after the resume",
            lambda: any(e["event"] == "progress" and e["step"] > saved["step"] for e in read_events(run)),
            60,
        )
        cluster.run("scancel", job)
        cluster.wait_for("the job ended", lambda: cluster.job(job)["JobState"] in ("CANCELLED", "COMPLETED"), 30)

    text = log.read_text()
    restart = [ln for ln in text.splitlines() if "=== restart" in ln]
    assert len(restart) == 1, text
    assert "SLURM_RESTART_COUNT=1" in restart[0]
    assert "incident=inc-000042" in restart[0]
    assert f"resumed from checkpoint step {saved['step']}" in restart[0]
    assert text.index("SIGUSR1: checkpointed") < text.index("=== restart")
    (cont,) = continuity(run)
    assert cont == {"restart": 1, "last_step": saved["step"], "resumed_from": saved["step"], "lost": 0,
                    "incident": "inc-000042"}  # fmt: skip
    steps = [e["step"] for e in read_events(run) if e["event"] == "progress"]
    assert steps == sorted(steps) and steps[-1] > saved["step"]


def test_a_rank_stopped_by_slurm_tells_its_agent_it_ended(tmp_path):
    """After a requeue moves the job, the old node's agent must not wait for the rank and call it hung."""
    agent_socket = tmp_path / "training.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent's end of the protocol
    server.bind(str(agent_socket))
    server.settimeout(10)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "progress.json").write_text(json.dumps({"step": 7}))
    env = {**os.environ, "SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURMD_NODENAME": "n2"}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetheal.lab.train",
            "worker",
            "--run-dir",
            str(run_dir),
            "--socket-template",
            str(agent_socket),
        ],
        env=env,
    )
    try:
        first = json.loads(server.recv(65536))
        assert (first["job"], first["rank"], first["step"]) == ("42", 1, 7)
        worker.send_signal(signal.SIGTERM)  # what Slurm sends on requeue or cancel
        assert worker.wait(timeout=10) == 0
        while (report := json.loads(server.recv(65536))).get("event") != "end":
            pass  # progress reports sent before the signal
        assert (report["job"], report["rank"]) == ("42", 1)
    finally:
        worker.kill()
        server.close()
