"""Remediation playbooks: wall time of one run through ansible-runner against a real private Slurm.

For ROUNDS rounds, a fresh SlurmCluster (3 nodes, 2 fake GPUs each) with one running requeueable job
and a warm standby: isolate_and_relocate.yml in dry-run mode, then for real (grace period 0 s, so the
figure is the playbook's own cost: validation, parsing Slurm's JSON, drain, signal, requeue with boost,
standby promotion, post-check, report). The time a real job gets to checkpoint (fleetheal_grace_seconds)
adds to the real run in production.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleetheal.lab.slurm import SlurmCluster

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 5
JOB = "#!/bin/sh\ntrap 'echo got USR1' USR1\nwhile :; do sleep 0.2; done\n"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _run(work: Path, cluster: SlurmCluster, node: str, dry_run: bool, n: int) -> float:
    import ansible_runner

    data = work / f"runner-{n}"
    data.mkdir()
    extravars = {
        "fleetheal_incident_id": f"bench-{n}",
        "fleetheal_node": node,
        "fleetheal_fault_id": "xid-79",
        "fleetheal_fault_class": "hardware",
        "fleetheal_action": "ISOLATE_AND_RELOCATE",
        "fleetheal_cluster": "bench",
        "fleetheal_dry_run": dry_run,
        "fleetheal_job_id": "",
        "fleetheal_gpu": "0",
        "fleetheal_paused": False,
        "fleetheal_budget_remaining": 1,
        "fleetheal_grace_seconds": 0,
        "fleetheal_report_dir": str(work / "reports"),
        "fleetheal_slurm_env": {"SLURM_CONF": str(cluster.conf_path)},
    }
    start = time.monotonic()
    r = ansible_runner.run(
        private_data_dir=str(data),
        project_dir=str(REPO / "playbooks"),
        playbook="isolate_and_relocate.yml",
        inventory=str(work / "inventory.ini"),
        extravars=extravars,
        quiet=True,
    )
    elapsed = time.monotonic() - start
    if r.rc != 0:
        raise RuntimeError(f"isolate_and_relocate.yml failed (rc {r.rc}): {r.stdout.read()[-2000:]}")
    return elapsed


def run() -> list[dict[str, Any]]:
    import os

    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    dry: list[float] = []
    real: list[float] = []
    work = Path(tempfile.mkdtemp(prefix="fleetheal-bench-ansible-"))
    try:
        (work / "inventory.ini").write_text(
            f"[fleetheal_control]\nlocalhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
        )
        for i in range(ROUNDS):
            cluster = SlurmCluster(work / f"slurm-{i}", nodes=3, gpus_per_node=2)
            cluster.start()
            try:
                job = cluster.sbatch(JOB, "--gres=gpu:2", "--requeue")
                cluster.wait_for(
                    "job running", lambda c=cluster, j=job: c.job(j).get("JobState") == "RUNNING", timeout=30
                )
                node = cluster.job(job)["NodeList"]
                standby = next(n for n in cluster.node_names if n != node)
                cluster.scontrol("update", f"nodename={standby}", "state=drain", "reason=fleetheal:standby incident=b")
                dry.append(_run(work, cluster, node, True, 2 * i))
                real.append(_run(work, cluster, node, False, 2 * i + 1))
                if not cluster.node(node).drained:
                    raise RuntimeError(f"{node} not drained after the real run")
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    common = {"unit": "s", "n": ROUNDS, "peer": None, "ratio_to_peer": None}
    return [
        {
            "name": "isolate_and_relocate.yml dry run (ansible-runner, real Slurm)",
            "median": statistics.median(dry),
            "p99": _p99(dry),
            "goal": None,
            "notes": "validate, guard, read sinfo/squeue JSON, report 'would ...'; 3 nodes, 1 job",
            **common,
        },
        {
            "name": "isolate_and_relocate.yml real run, grace 0 s (ansible-runner, real Slurm)",
            "median": statistics.median(real),
            "p99": _p99(real),
            "goal": "< 30 s before the grace period",
            "notes": "drain, USR1, requeue + priority boost, standby promotion, post-check, report; "
            "production adds fleetheal_grace_seconds (default 120 s) for the job's checkpoint",
            **common,
        },
    ]
