"""Cross-cluster failover: fault -> the job RUNNING on another cluster (fleetheal.fleet.failover.move).

A private 3-cluster lab federation (fleetheal.lab.federation). Each round a 1-node job runs on cluster a;
the clock starts when both of a's nodes are set DOWN at once (a leaf switch) and stops when `move` has seen
the job RUNNING on b (hold, update Clusters=b, release, poll every 0.2 s). The checkpoint store is shared
(a and b read the same path), so the checkpoint copy time is 0 and reported as such: a site with replicated
stores adds its replication lag. Goal: p50 < 30 s.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

ROUNDS = 5


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def run() -> list[dict[str, Any]]:
    from fleetheal.fleet import config as fleetcfg
    from fleetheal.fleet import failover
    from fleetheal.lab.federation import Federation
    from fleetheal.wait import wait_until

    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-failover-"))
    fed = Federation(base / "fed")
    fleet = fleetcfg.FleetConfig(
        federation="fed",
        clusters=MappingProxyType(
            {n: fleetcfg.Cluster(gpu_type="h100", checkpoint_stores=("shared",)) for n in ("a", "b", "c")}
        ),
        checkpoint_stores=MappingProxyType({"shared": fleetcfg.CheckpointStore(path=str(base))}),
    )
    times: list[float] = []
    try:
        fed.start()
        a = fed.clusters["a"]
        for _ in range(ROUNDS):
            jid = a.sbatch("#!/bin/sh\nsleep 600\n", "-M", "a", "-N1", "--requeue", "-o", "/dev/null")
            wait_until(lambda j=jid: failover.where(j, fed.env).get("a") == "RUNNING", 30, "job on a")  # type: ignore[misc]
            t0 = time.perf_counter()
            a.scontrol("update", "nodename=a1,a2", "state=down", "reason=leaf-switch")
            d = failover.move(jid, "a", "shared", fleet, fed.env, target="b", timeout=60)
            times.append(time.perf_counter() - t0)
            if d.action != "moved":
                raise RuntimeError(f"round did not move the job: {d}")
            fed.cancel([jid])
            a.scontrol("update", "nodename=a1,a2", "state=resume")
            a.wait_nodes(timeout=60)
    finally:
        fed.stop()
        shutil.rmtree(base, ignore_errors=True)
    return [
        {
            "name": "cross-cluster failover: fault -> RUNNING on another cluster",
            "unit": "s",
            "median": statistics.median(times),
            "p99": _p99(times),
            "n": len(times),
            "goal": 30.0,
            "notes": "a's 2 nodes DOWN at once -> job RUNNING on b; checkpoint copy 0 s (shared store, no copy)",
        },
        {
            "name": "cross-cluster failover: checkpoint copy",
            "unit": "s",
            "median": 0.0,
            "p99": 0.0,
            "n": len(times),
            "notes": "shared checkpoint store read by both clusters: nothing is copied",
        },
    ]


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
