"""Fixtures for the Ansible tests: a real private Slurm cluster and a runner for the playbooks."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetheal.lab.slurm import SlurmCluster
from fleetheal.slurm import jobs as slurm_jobs

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
FIXTURE_BIN = Path(__file__).resolve().parent / "fixtures" / "bin"

#: A batch script that logs the grace signal it gets, then runs until it is killed or requeued.
JOB_SCRIPT = """#!/bin/sh
trap 'echo "got USR1 at restart ${SLURM_RESTART_COUNT:-0}"' USR1
echo "started on $SLURMD_NODENAME restart ${SLURM_RESTART_COUNT:-0}"
while :; do sleep 0.2; done
"""


@dataclass
class PlaybookRun:
    rc: int
    status: str
    stdout: str
    report: dict[str, Any] | None
    stats: dict[str, Any]

    def steps(self, name: str) -> list[dict[str, str]]:
        assert self.report is not None, self.stdout[-3000:]
        return [s for s in self.report["steps"] if s["step"] == name]


class Playbooks:
    """Runs the remediation playbooks through ansible-runner against the cluster (localhost control)."""

    def __init__(self, cluster: SlurmCluster, work: Path) -> None:
        self.cluster = cluster
        self.work = work
        self.report_dir = work / "reports"
        self._n = 0
        py = sys.executable
        hosts = "\n".join(f"{n} ansible_connection=local ansible_python_interpreter={py}" for n in cluster.node_names)
        self.inventory = work / "inventory.ini"
        self.inventory.write_text(
            f"[fleetheal_control]\nlocalhost ansible_connection=local ansible_python_interpreter={py}\n\n"
            f"[gpu_nodes]\n{hosts}\n"
        )

    def base_vars(self, **overrides: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fleetheal_incident_id": "inc-1",
            "fleetheal_cluster": "lab",
            "fleetheal_dry_run": False,
            "fleetheal_job_id": "",
            "fleetheal_gpu": "",
            "fleetheal_budget_remaining": 1,
            "fleetheal_grace_seconds": 1,
            "fleetheal_slurm_retry_delay_s": 1,
            "fleetheal_report_dir": str(self.report_dir),
            "fleetheal_slurm_env": {"SLURM_CONF": str(self.cluster.conf_path)},
        }
        out.update(overrides)
        return out

    def run(self, playbook: str, extravars: Mapping[str, Any], cmdline: str = "") -> PlaybookRun:
        import ansible_runner

        self._n += 1
        # A private data dir per run: ansible-runner reuses a stale env/extravars otherwise (measured).
        data = self.work / f"runner-{self._n}"
        data.mkdir()
        r = ansible_runner.run(
            private_data_dir=str(data),
            project_dir=str(PLAYBOOKS),
            playbook=playbook,
            inventory=str(self.inventory),
            extravars=dict(extravars),
            cmdline=cmdline or None,
            quiet=True,
            envvars={"ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"},
            settings={"suppress_ansible_output": True},
        )
        stdout = r.stdout.read() if r.stdout else ""
        action = str(extravars.get("fleetheal_action", "unknown")).lower()
        path = self.report_dir / f"{extravars.get('fleetheal_incident_id', 'unknown')}-{action}.json"
        report = json.loads(path.read_text()) if path.exists() else None
        if path.exists():
            path.unlink()  # each run's report is read once
        return PlaybookRun(rc=r.rc, status=r.status, stdout=stdout, report=report, stats=r.stats or {})


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path / "slurm", nodes=3, gpus_per_node=2)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def playbooks(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Playbooks:
    # ansible-runner finds ansible-playbook on PATH: the one installed beside this interpreter.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    work = tmp_path / "ansible"
    work.mkdir()
    return Playbooks(slurm, work)


def submit_running(cluster: SlurmCluster, *args: str, timeout: float = 20.0) -> tuple[str, str]:
    """Submit the grace-logging job with 2 GPUs; wait until it runs. Returns (job id, node)."""
    out = cluster.state_dir / "jobs" / "out-%j.log"
    (cluster.state_dir / "jobs").mkdir(exist_ok=True)
    job = cluster.sbatch(JOB_SCRIPT, "--gres=gpu:2", "--requeue", "--open-mode=append", f"--output={out}", *args)
    cluster.wait_for(f"job {job} running", lambda: cluster.job(job).get("JobState") == "RUNNING", timeout=timeout)
    return job, cluster.job(job)["NodeList"]


def job_log(cluster: SlurmCluster, job: str) -> str:
    path = cluster.state_dir / "jobs" / f"out-{job}.log"
    return path.read_text() if path.exists() else ""


def wait_until(predicate: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def job_json(cluster: SlurmCluster, job: str) -> dict[str, Any]:
    """The job as `squeue --json` reports it, read as the playbooks read it (`fleetheal.slurm.jobs.slurm_job`:
    state, nodes, priority, restart_cnt, comment...; scontrol's key=value text cannot hold a comment with `=`)."""
    entry = slurm_jobs.slurm_job(cluster.run("squeue", "--json").stdout, job)
    if not entry:
        raise AssertionError(f"job {job} not listed by squeue")
    return entry


def node_json(cluster: SlurmCluster, node: str) -> dict[str, Any]:
    """The node as the playbooks read it (`fleetheal.slurm.nodes`: state, flags, reason, comment, extra)."""
    return cluster.node(node).as_dict()


def responder_incident(ref: str, node: str) -> types.SimpleNamespace:
    """The fields of a remediator Incident the first responder reads: an Xid 79 on `node`."""
    return types.SimpleNamespace(
        ref=ref,
        node=node,
        fault_id="xid-79",
        action="ISOLATE_AND_RELOCATE",
        gpu="1",
        dry_run=False,
        run_job_id="",
        received_at=time.time(),
    )


def respond(responder: Any, incident: Any) -> list[Any]:
    """Run the first response of `incident` on a private event loop (asyncio.run() would leave the thread
    without a current loop, and the Pulumi mock tests that run later in the same session need one); its
    step results."""
    import asyncio

    recorded: list[Any] = []
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(responder.respond(incident, recorded.append))
    finally:
        loop.close()
        responder.close()
    return recorded
