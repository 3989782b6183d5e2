"""Queues: fifo, EASY backfill and lend (backfill in aging priority order with lending) on one trace and pool,
as ratios from one run.

Trace: benchmarks/traces/*.csv when one is shipped (submit_s,gpus,duration_s); otherwise a seeded synthetic
trace, named as such in the notes. No public trace of real GPU jobs is shipped: the ones found do not allow
redistribution here (Alibaba's GPU traces in alibaba/clusterdata carry no licence file and allow use "for
research or study purpose"; Microsoft's Philly trace carries no licence and is a 1 GB Git LFS archive;
SenseTime's Helios traces are "for academic purposes"; InternLM's AcmeTrace repository holds no job log).
`fleetheal queue replay` reads a site's own `sacct` output instead (docs/queues.md).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from fleetheal.fleet import queue_policy
from fleetheal.fleet.config import Queues

HERE = Path(__file__).resolve().parent
NODES, GPUS_PER_NODE = 8, 8


def _trace() -> tuple[list[queue_policy.Job], str]:
    shipped = sorted((HERE / "traces").glob("*.csv"))
    if shipped:
        with shipped[0].open(encoding="utf-8") as fh:
            return queue_policy.parse_csv(fh), f"trace {shipped[0].name}"
    rng = random.Random(20)
    jobs, t = [], 0.0
    for _ in range(3000):
        t += rng.expovariate(1 / 400.0)
        gpus = rng.choice((1, 1, 1, 2, 4, 8, 16, 32)) if rng.random() < 0.97 else 64
        jobs.append(queue_policy.Job(t, gpus, rng.lognormvariate(7.0, 1.2)))
    return jobs, "SYNTHETIC seeded trace (no public trace may be shipped: licences, see the module)"


def run() -> list[dict[str, Any]]:
    jobs, what = _trace()
    res = {r["policy"]: r for r in queue_policy.replay(jobs, NODES * GPUS_PER_NODE, Queues())}
    lend = res["lend"]
    out: list[dict[str, Any]] = []
    for base in ("fifo", "backfill"):
        b = res[base]
        out.append(
            {
                "name": f"queue utilisation lend/{base}",
                "unit": "ratio",
                "median": lend[f"utilisation_vs_{base}"],
                "p99": None,
                "n": lend["jobs"],
                "goal": ">= 1",
                "peer": b["utilisation"],
                "ratio_to_peer": lend[f"utilisation_vs_{base}"],
                "notes": f"{what}; {NODES}x{GPUS_PER_NODE} GPUs; lend util {lend['utilisation']}",
            }
        )
        out.append(
            {
                "name": f"queue longest large-job wait lend/{base}",
                "unit": "ratio",
                "median": lend[f"large_wait_max_vs_{base}"],
                "p99": None,
                "n": lend["large_jobs"],
                "goal": "<= 1",
                "peer": b["large_wait_max_s"],
                "ratio_to_peer": lend[f"large_wait_max_vs_{base}"],
                "notes": (
                    f"{what}; large max wait s: "
                    f"lend {lend['large_wait_max_s']:.0f}, {base} {b['large_wait_max_s']:.0f};"
                    f" large p99 s: lend {lend['large_wait_p99_s']:.0f}, {base} {b['large_wait_p99_s']:.0f};"
                    f" small p50 s: lend {lend['small_wait_p50_s']:.0f}, {base} {b['small_wait_p50_s']:.0f}"
                ),
            }
        )
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
