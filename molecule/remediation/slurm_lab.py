"""Start or stop the remediation scenario's private Slurm cluster (fleetheal.lab.slurm.SlurmCluster).

slurm_lab.py up STATE_DIR    start 3 nodes with 2 fake GPUs each and plant the situation:
                             job A (requeueable, logs its grace signal) on n1, job B on n2,
                             n3 drained as a warm standby; prints the facts as JSON
slurm_lab.py down STATE_DIR  stop the cluster (by the PID recorded in STATE_DIR), if it runs
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from fleetheal.lab.slurm import SlurmCluster

JOB = """#!/bin/sh
trap 'echo "got USR1 at restart ${SLURM_RESTART_COUNT:-0}"' USR1
echo "started on $SLURMD_NODENAME restart ${SLURM_RESTART_COUNT:-0}"
while :; do sleep 0.2; done
"""


def _submit(cluster: SlurmCluster, name: str, node: str) -> str:
    out = cluster.state_dir / "jobs" / f"{name}-%j.log"
    (cluster.state_dir / "jobs").mkdir(exist_ok=True)
    # Every other node drained for the moment, so the job lands on `node` without being pinned to it
    # (a pinned job could not be relocated).
    others = [n for n in cluster.node_names if n != node and not cluster.node(n).drained]
    for n in others:
        cluster.scontrol("update", f"nodename={n}", "state=drain", "reason=placing test jobs")
    args = ("--gres=gpu:2", "--requeue", "--open-mode=append", f"--output={out}", f"--job-name={name}")
    job = cluster.sbatch(JOB, *args)
    cluster.wait_for(f"job {job} running", lambda: cluster.job(job).get("JobState") == "RUNNING", timeout=30)
    for n in others:
        cluster.scontrol("update", f"nodename={n}", "state=resume")
    return job


def up(state_dir: Path) -> dict[str, str]:
    cluster = SlurmCluster(state_dir, nodes=3, gpus_per_node=2)
    cluster.start()
    try:
        job_a = _submit(cluster, "job-a", "n1")
        job_b = _submit(cluster, "job-b", "n2")
        cluster.scontrol("update", "nodename=n3", "state=drain", "reason=fleetheal:standby incident=inc-0")
    except BaseException:
        cluster.stop()
        raise
    return {
        "slurm_conf": str(cluster.conf_path),
        "job_a": job_a,
        "job_b": job_b,
        "job_a_log": str(cluster.state_dir / "jobs" / f"job-a-{job_a}.log"),
        "job_b_log": str(cluster.state_dir / "jobs" / f"job-b-{job_b}.log"),
    }


def down(state_dir: Path) -> None:
    if (state_dir / "cluster.json").exists():
        SlurmCluster.attach(state_dir).stop()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    state = Path(argv[2])
    if argv[1] == "up":
        down(state)  # a cluster left over from an interrupted run
        # A fresh state directory: job ids start at 1 and no drain survives from an earlier run.
        shutil.rmtree(state, ignore_errors=True)
        print(json.dumps(up(state)))
    else:
        down(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
