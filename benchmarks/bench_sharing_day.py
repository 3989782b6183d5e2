"""A day of mixed work on one GPU pool, replayed on the lab twice in one run: shared (the lending controller lends
the nodes Slurm leaves idle to Kueue's inference and takes them back for training) and statically split (the same
nodes, half of them Kubernetes' for good). The figure is the GPU-hours each used, and their ratio.

The pool (fleetheal.lab.sharedpool): 4 nodes of 8 GPUs, a real Slurm and a real control plane with kube-scheduler,
kwok nodes and the real Kueue with the stack's queues (its quota: the 2 nodes the pool may lend, the static split's
inference share). The trace (seeded, the same in both runs):

- **inference**: a Deployment's pods of one node's 8 GPUs each, as many as the hour's load asks: 2 at the 14:00
  peak, none at 02:00, following the day's cosine; pods past the target are deleted, pods evicted or deleted are
  made again (as its ReplicaSet would), in Kueue's queue;
- **training**: jobs of 1 or 2 whole nodes, arriving at random (one every 1.5 hours on average) and running 1 to 4
  hours each.

Every half second the replay counts the GPUs in use: Slurm's running jobs' nodes and the Running inference pods.
Shared, the lending rules give training the first claim: a node is lent only when no waiting job is about to start
on it, and taken back (after its minimum loan) when a job waits for it.

Where the lab differs from a deployed cluster: the day runs 3600/HOUR_S times faster (HOUR_S seconds an hour,
FLEETHEAL_BENCH_SHARING_HOUR_S, default 8), and the stack's lending times with it (its 600 s minimum loan and
120 s reclaim grace become 600 and 120 hours' seconds scaled the same way); Slurm runs the lab's fast timers (the
deployed ones would cost a job minutes of the compressed day); kwok's pods start and stop at once.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOUR_S = float(os.environ.get("FLEETHEAL_BENCH_SHARING_HOUR_S", "8"))
NODES, GPUS, LENT = 4, 8, 2
SEED = 47
#: Seconds between two counts of the GPUs in use.
SAMPLE_S = 0.5


@dataclass(frozen=True)
class Day:
    #: Inference pods wanted, per hour of the day.
    inference: tuple[int, ...]
    #: Training jobs: (submitted at, in hours of the day; nodes; hours it runs).
    jobs: tuple[tuple[float, int, float], ...]


def day(seed: int = SEED) -> Day:
    rng = random.Random(seed)
    inference = tuple(round(LENT * (0.5 + 0.5 * math.cos(2 * math.pi * (h - 14) / 24))) for h in range(24))
    jobs: list[tuple[float, int, float]] = []
    t = rng.expovariate(1 / 1.5)
    while t < 22:
        jobs.append((round(t, 2), rng.choice((1, 2)), round(rng.uniform(1.0, 4.0), 2)))
        t += rng.expovariate(1 / 1.5)
    return Day(inference, tuple(jobs))


@dataclass
class Used:
    """What one replay used, in GPU-hours and pod-hours of the day."""

    training_gpu_h: float = 0.0
    inference_gpu_h: float = 0.0
    wanted_pod_h: float = 0.0
    served_pod_h: float = 0.0
    waits_h: list[float] = field(default_factory=list)
    never_ran: int = 0

    @property
    def gpu_h(self) -> float:
        return self.training_gpu_h + self.inference_gpu_h


def replay(pool: Any, trace: Day) -> Used:
    """Play the day on `pool` (a started SharedPool): submit the jobs, keep the inference pods at the hour's target,
    count what runs."""
    used = Used()
    todo = sorted(trace.jobs)
    submitted: dict[str, float] = {}  # job -> submitted at (hour of the day)
    started: set[str] = set()
    t0 = time.monotonic()
    last = t0
    while (now := time.monotonic()) - t0 < 24 * HOUR_S:
        hour = (now - t0) / HOUR_S
        while todo and todo[0][0] <= hour:
            _, nodes, hours = todo.pop(0)
            script = f"#!/bin/sh\nsleep {hours * HOUR_S:.2f}\n"
            submitted[pool.slurm.sbatch(script, "-N", str(nodes), "--exclusive", "-o", "/dev/null")] = hour
        target = trace.inference[min(23, int(hour))]
        pods = [p for p in pool.pods() if not p["metadata"].get("deletionTimestamp")]
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        for _ in range(target - len(pods)):
            pool.inference_pod(admit=False)
        if len(pods) > target:  # the scale-in: pods not running first, then the newest
            extra = sorted(pods, key=lambda p: (p in running, p["metadata"]["creationTimestamp"]))[: len(pods) - target]
            for p in extra:
                pool.delete_pod(p["metadata"]["name"])
        training_nodes = 0
        for line in pool.slurm.squeue("-h", "-o", "%i %T %D").splitlines():
            job, state, nodes_s = line.split()
            if state == "RUNNING":
                training_nodes += int(nodes_s)
                if job not in started and job in submitted:
                    started.add(job)
                    used.waits_h.append(hour - submitted[job])
        dt_h = (now - last) / HOUR_S
        last = now
        used.training_gpu_h += training_nodes * GPUS * dt_h
        used.inference_gpu_h += len(running) * GPUS * dt_h
        used.wanted_pod_h += target * dt_h
        used.served_pod_h += min(len(running), target) * dt_h
        time.sleep(SAMPLE_S)
    used.never_ran = len(submitted) - len(started) + len(todo)
    pool.slurm.run("scancel", "--user", "root", check=False)
    return used


def static_split(pool: Any) -> None:
    """The last LENT nodes are Kubernetes' for good: drained in Slurm, labelled and tainted for Kueue's flavour."""
    from fleetheal import contracts

    for name in pool.names[-LENT:]:
        pool.slurm.scontrol("update", f"nodename={name}", "state=DRAIN", "reason=static split: inference")
        patch = {
            "metadata": {"labels": {contracts.LABEL_POOL: contracts.POOL_LENT}},
            "spec": {"taints": [{"key": contracts.TAINT_LENT, "value": "h100", "effect": "NoSchedule"}]},
        }
        pool.cp.request("PATCH", f"/api/v1/nodes/{name}", patch, "application/merge-patch+json")


def run() -> list[dict[str, Any]]:
    from fleetheal.lab.controlplane import KubeControlPlane
    from fleetheal.lab.kueue import KueueController
    from fleetheal.lab.sharedpool import SharedPool

    trace = day()
    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-sharing-"))
    scale = HOUR_S / 3600
    results: dict[str, Used] = {}
    stop = threading.Event()
    try:
        with (
            KubeControlPlane(base / "kube", scheduler=True) as cp,
            KueueController(cp, base / "kueue", ("ml",)) as kueue,
        ):
            for mode in ("static", "shared"):
                rules = {"max_nodes": LENT, "min_lent_s": 600 * scale, "reclaim_grace_s": 120 * scale}
                with SharedPool(cp, base / mode, nodes=NODES, gpus=GPUS, kueue=kueue, interval_s=1.0, **rules) as pool:
                    stop.clear()
                    thread = threading.Thread(target=pool.ctl.run, args=(stop,), daemon=True)
                    if mode == "shared":
                        thread.start()
                    else:
                        static_split(pool)
                    print(f"bench sharing: replaying the day {mode} ({24 * HOUR_S:.0f} s)", flush=True)
                    results[mode] = replay(pool, trace)
                    stop.set()
                    if thread.is_alive():
                        thread.join(30)  # its last round done before the pool goes
    finally:
        stop.set()
        shutil.rmtree(base, ignore_errors=True)
    shared, static = results["shared"], results["static"]
    where = (
        f"lab: {NODES} nodes of {GPUS} GPUs, Kueue + kube-scheduler + kwok, Slurm (fast timers), a day of "
        f"{len(trace.jobs)} training jobs and a diurnal inference load replayed at {HOUR_S:g} s an hour; peer: "
        f"the same day on a static split ({NODES - LENT} nodes Slurm's, {LENT} Kubernetes')"
    )

    def figure(name: str, unit: str, mine: float, peer: float, notes: str) -> dict[str, Any]:
        return {"name": name, "unit": unit, "median": mine, "p99": mine, "n": 1, "goal": None, "peer": peer,
                "ratio_to_peer": mine / peer if peer else None, "notes": notes}  # fmt: skip

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    return [
        figure("a day on one pool: GPU-hours used, shared vs static split", "GPU-h", shared.gpu_h, static.gpu_h,
               f"{where}; of {NODES * GPUS * 24} GPU-hours; training {shared.training_gpu_h:.0f} vs "
               f"{static.training_gpu_h:.0f}, inference {shared.inference_gpu_h:.0f} vs {static.inference_gpu_h:.0f}"),
        figure("a day on one pool: inference demand served", "fraction",
               shared.served_pod_h / shared.wanted_pod_h, static.served_pod_h / static.wanted_pod_h, where),
        figure("a day on one pool: training job wait, mean", "h", mean(shared.waits_h), mean(static.waits_h),
               f"{where}; jobs that never started: {shared.never_ran} shared, {static.never_ran} static"),
    ]  # fmt: skip
