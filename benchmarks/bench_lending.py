"""One GPU pool shared by Slurm training and Kubernetes inference (fleetheal.remediator.lending), on the lab
(fleetheal.lab.sharedpool): a real control plane (kube-apiserver, kube-controller-manager, kube-scheduler, kwok
nodes), the real Kueue controller with the stack's queues, a real Slurm with the deployed stack's timers
(fast_timers off), and the lending controller running its rounds in a thread at the stack's interval
(`lending.interval_s`, 2 s), as the remediator's leader runs it.

- **lend**: a Slurm job holds both nodes while an inference pod Kueue admitted waits; the clock starts when the job is
  cancelled and stops when the pod is Running on one of its nodes. Goal: p50 < 5 s.
- **reclaim**: a node is lent, its pod Running; the clock starts when a job that needs both nodes is submitted and
  stops when the node is resumed in Slurm (and, a second figure, when the job is RUNNING). Goal: p50 < the
  reclaim grace + 5 s. The stack's grace is 120 s; kwok's pods stop at once, so the figure is the mechanism's own
  time: a real server adds the time it takes to stop, at most the grace.

Where the lab differs from a deployed cluster: `min_lent_s` is 0: the stack's 600 s
is how long a node is kept lent, a hold, not the time the mechanism takes. Nothing starts slurmd: the lab's slurmd
runs throughout, where Slinky's NodeSet would start its pod on the node labelled active again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROUNDS = int(os.environ.get("FLEETHEAL_BENCH_LENDING_ROUNDS", "7"))
GRACE_S = 120.0


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _figure(name: str, values: list[float], goal: float, notes: str) -> dict[str, Any]:
    return {
        "name": name,
        "unit": "s",
        "median": statistics.median(values),
        "p99": _p99(values),
        "n": len(values),
        "goal": goal,
        "peer": None,
        "ratio_to_peer": None,
        "notes": notes,
    }


def run() -> list[dict[str, Any]]:
    from fleetheal.lab.controlplane import KubeControlPlane
    from fleetheal.lab.kueue import KueueController
    from fleetheal.lab.sharedpool import SLEEP, SharedPool
    from fleetheal.remediator.config import LendingConfig
    from fleetheal.wait import wait_until

    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-lending-"))
    interval = LendingConfig().interval_s
    lend: list[float] = []
    reclaim: list[float] = []
    job_runs: list[float] = []
    stop = threading.Event()
    try:
        with contextlib.ExitStack() as stack:
            cp = stack.enter_context(KubeControlPlane(base / "kube", scheduler=True))
            kueue = stack.enter_context(KueueController(cp, base / "kueue", ("ml",)))
            pool = stack.enter_context(
                SharedPool(
                    cp, base, nodes=2, gpus=8, fast_timers=False, interval_s=interval, reclaim_grace_s=GRACE_S,
                    kueue=kueue,
                )
            )  # fmt: skip
            thread = threading.Thread(target=pool.ctl.run, args=(stop,), daemon=True)
            thread.start()
            stack.callback(thread.join, 30)  # stopped and done before the pool goes (callbacks run last first)
            stack.callback(stop.set)
            for _ in range(ROUNDS):
                job = pool.slurm.sbatch(SLEEP, "-N", "2", "-o", "/dev/null")
                wait_until(lambda j=job: pool.slurm.job_state(j) == "RUNNING", 60, "the training job to run")
                pod = pool.inference_pod()
                time.sleep(interval)  # the pod has waited a round: nothing idle to lend
                t0 = time.monotonic()
                pool.slurm.run("scancel", job)
                node = wait_until(lambda p=pod: pool.running_on(p), 60, "the inference pod to run")
                lend.append(time.monotonic() - t0)

                t0 = time.monotonic()
                job = pool.slurm.sbatch(SLEEP, "-N", "2", "-o", "/dev/null")
                wait_until(
                    lambda n=node: pool.pool_of(n) == "active" and not pool.slurm.node(n).drained, 300, "reclaim"
                )
                reclaim.append(time.monotonic() - t0)
                wait_until(lambda j=job: pool.slurm.job_state(j) == "RUNNING", 300, "the job on the node taken back")
                job_runs.append(time.monotonic() - t0)
                pool.slurm.run("scancel", job)
                wait_until(
                    lambda j=job: pool.slurm.job_state(j) in ("", "COMPLETED", "CANCELLED"), 60, "the job to end"
                )
    finally:
        stop.set()
        shutil.rmtree(base, ignore_errors=True)
    where = f"lab: Kueue, kube-scheduler + kwok, Slurm with the deployed timers, lending round every {interval:g} s"
    return [
        _figure("Slurm job ends -> a waiting inference pod Running on its node", lend, 5.0, where),
        _figure(
            "a Slurm job waits for a lent node -> the node resumed in Slurm",
            reclaim,
            GRACE_S + 5.0,
            f"{where}; goal: the stack's reclaim grace ({GRACE_S:g} s) + 5 s; kwok's pods stop at once",
        ),
        _figure("a Slurm job waits for a lent node -> the job RUNNING", job_runs, GRACE_S + 5.0, where),
    ]
