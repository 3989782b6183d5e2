"""Cross-cluster failover: fault -> the job RUNNING on another cluster, on a private 3-cluster lab federation.

Two measurements, side by side in one run:

- **end to end, nodes lost** (what `make demo` shows): a checkpointing job runs on cluster a; the clock starts
  when both of a's nodes stop answering (their slurmd and the job's processes are stopped: a lost leaf
  switch) and the nic-down alerts reach a's remediator (`fleetheal remediator serve`, failover on, no standby,
  budget one node). It isolates one node, requeues the job, and its third stage moves the job to b. The clock
  stops when b runs it. The federation runs the deployed stack's Slurm timers (fleetheal.slurm.conf:
  SlurmdTimeout 120 s, cred_expire 60 s). Split: until Slurm finds the job's node silent (it misses the health check
  slurmctld sends every HealthCheckInterval, 10 s; the move
  then sets it DOWN, not waiting SlurmdTimeout, and lifts the requeue's begin-time hold on b), and from there to
  RUNNING on b.
- **the move alone**: both of a's nodes are set DOWN at once and `failover.move` is called directly.

The checkpoint store is shared (a and b read the same path), so the checkpoint copy time is 0 and reported as
such: a site with replicated stores adds its replication lag. Goal: p50 < 30 s.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS_END_TO_END = int(os.environ.get("FLEETHEAL_BENCH_FAILOVER_ROUNDS", "20"))
ROUNDS_MOVE = 5


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _figure(name: str, values: list[float], notes: str, goal: float | None = 30.0) -> dict[str, Any]:
    return {
        "name": name,
        "unit": "s",
        "median": statistics.median(values),
        "p99": _p99(values),
        "n": len(values),
        "goal": goal,
        "notes": notes,
    }


def run() -> list[dict[str, Any]]:
    from fleetheal.contracts import CHECKPOINT_WORD
    from fleetheal.fleet import config as fleetcfg
    from fleetheal.fleet import failover
    from fleetheal.lab.federation import Federation
    from fleetheal.lab.fedremediator import ClusterRemediator
    from fleetheal.wait import wait_until

    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-failover-"))
    fed = Federation(base / "fed", fast_timers=False)
    store = base / "store"
    store.mkdir()
    total: list[float] = []
    detect: list[float] = []
    after: list[float] = []
    moves: list[float] = []
    try:
        fed.start()
        a = fed.clusters["a"]
        fleet_file = fed.write_fleet_file(base / "fleet.yaml", store)
        fleet = fleetcfg.load(fleet_file, env={})

        def job() -> str:
            jid = a.sbatch("#!/bin/sh\nsleep 600\n", "-M", "a", "-N1", "--requeue", "-o", "/dev/null",
                           f"--comment={CHECKPOINT_WORD}shared")  # fmt: skip
            wait_until(lambda: failover.where(jid, fed.env).get("a") == "RUNNING", 30, "job on a")
            return jid

        def lost_at(node: str) -> float | None:
            """Now, once Slurm says `node` does not respond (its ping failed, or it is DOWN already)."""
            found = a.nodes().get(node)
            return time.perf_counter() if found is not None and not found.responding else None

        def on_b(jid: str) -> float | None:
            return time.perf_counter() if failover.where(jid, fed.env).get("b") == "RUNNING" else None

        def back(jid: str) -> None:
            fed.cancel([jid])
            a.scontrol("update", "nodename=a1,a2", "state=resume", check=False)
            a.wait_nodes(timeout=90)

        for i in range(ROUNDS_END_TO_END):
            jid = job()
            ran_on = a.squeue("-h", "-j", jid, "-o", "%N").split()[-1]
            with ClusterRemediator(fed, "a", base / f"remediator-{i}", fleet_file, budget=1, wait_s=2.0) as rem:
                t0 = time.perf_counter()
                frozen = a.freeze_nodes(["a1", "a2"])
                try:
                    rem.alert(["a1", "a2"], "nic-down")
                    lost = wait_until(lambda n=ran_on: lost_at(n), 180, f"Slurm to find {ran_on} silent", interval=0.1)
                    end = wait_until(lambda j=jid: on_b(j), 180, "the job RUNNING on b", interval=0.1)  # type: ignore[misc]
                finally:
                    a.thaw_nodes(frozen)
            total.append(end - t0)
            detect.append(lost - t0)
            after.append(end - lost)
            back(jid)
        for _ in range(ROUNDS_MOVE):
            jid = job()
            t0 = time.perf_counter()
            a.scontrol("update", "nodename=a1,a2", "state=down", "reason=leaf-switch")
            d = failover.move(jid, "a", "shared", fleet, fed.env, target="b", timeout=60)
            moves.append(time.perf_counter() - t0)
            if d.action != "moved":
                raise RuntimeError(f"round did not move the job: {d}")
            back(jid)
    finally:
        fed.stop()
        shutil.rmtree(base, ignore_errors=True)
    return [
        _figure(
            "cross-cluster failover, end to end: nodes lost -> RUNNING on another cluster",
            total,
            "a's leaf switch lost (slurmd and job stopped) + alerts -> a's remediator (no standby, budget 1) "
            "isolates, requeues, moves -> RUNNING on b; the deployed timers (SlurmdTimeout 120 s, "
            "HealthCheckInterval 10 s, cred_expire 60 s)",
        ),
        _figure(
            "cross-cluster failover, end to end: until Slurm finds the job's node silent",
            detect,
            "until slurmctld flags the node NOT_RESPONDING (a health check it missed, HealthCheckInterval 10 s); "
            "the move sets it DOWN at once instead of "
            "waiting SlurmdTimeout (120 s deployed), which releases the job",
            goal=None,
        ),
        _figure(
            "cross-cluster failover, end to end: node found silent -> RUNNING on b",
            after,
            "the node set DOWN, the job let go -> the remediator's move (hold, Clusters=b, release, begin-time "
            "hold lifted on b) -> RUNNING on b",
            goal=None,
        ),
        _figure(
            "cross-cluster failover: the move alone (nodes DOWN -> RUNNING on b)",
            moves,
            "a's 2 nodes set DOWN at once, failover.move called directly",
        ),
        {
            "name": "cross-cluster failover: checkpoint copy",
            "unit": "s",
            "median": 0.0,
            "p99": 0.0,
            "n": len(total),
            "notes": "shared checkpoint store read by both clusters: nothing is copied",
        },
    ]


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
