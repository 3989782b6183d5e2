"""Pulumi program: synthesize a 2,000-node, 16-pool fleet under Pulumi's mock engine.

Each run is a fresh Python process (so peak RSS is that run's own) that builds the config (16 GPU
pools of 125 existing nodes each, 5% warm standby -> 7 standby nodes per pool), registers every
resource with `fleetheal.infra.program.build` under `fleetheal.infra.mocks` and renders the YAML
files `fleetheal render` would write (kept in memory). Reported: synthesis time (registration until
every resource is resolved), render time, the number of resources, and the process's peak RSS.
No goal is set by the issue; a reference point is that `pulumi preview` itself must diff as many
resources against the cluster.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUNS = 5
POOLS = 16
NODES = 2000

_CHILD = r"""
import json, resource, sys, time
from fleetheal.infra import config, mocks, program, render

pools, nodes = int(sys.argv[1]), int(sys.argv[2])
per = nodes // pools
values = {
    "clusterName": "bench",
    "gpuPools": [
        {"name": f"pool{p:02d}", "gpuType": ("h100", "h200", "b200", "a100")[p % 4], "gpusPerNode": 8,
         "nodeNames": [f"gpu-{p:02d}-{i:04d}" for i in range(per)],
         "standbyNodeNames": [f"spare-{p:02d}-{i:02d}" for i in range(config.standby_size(per, 1, 5))]}
        for p in range(pools)
    ],
}
t0 = time.perf_counter()
cfg = config.from_values(values)
t1 = time.perf_counter()
records = mocks.run(lambda: program.build(cfg), stack="bench")
t2 = time.perf_counter()
files = render.records_to_files(records, "# bench\n")
t3 = time.perf_counter()
print(json.dumps({
    "config_s": t1 - t0, "synth_s": t2 - t1, "render_s": t3 - t2, "resources": len(records),
    "files": len(files), "bytes": sum(len(v) for v in files.values()),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _one() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(POOLS), str(NODES)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run() -> list[dict[str, Any]]:
    runs = [_one() for _ in range(RUNS)]
    from fleetheal.infra.config import standby_size

    res = runs[0]["resources"]
    standby = POOLS * standby_size(NODES // POOLS, 1, 5)
    others = runs[0]["files"] - NODES - standby
    note = (
        f"{NODES} active + {standby} standby Node patches in {POOLS} pools + {others} other objects; "
        f"{res} resource registrations "
        f"(components included); {runs[0]['files']} YAML files, {runs[0]['bytes'] / 1e6:.1f} MB; "
        "fresh process per run, mock engine (no CLI, no provider plugin)"
    )

    def figure(name: str, unit: str, key: str, scale: float = 1.0) -> dict[str, Any]:
        values = [r[key] * scale for r in runs]
        return {
            "name": name,
            "unit": unit,
            "median": statistics.median(values),
            "p99": _pct(values, 0.99),
            "n": len(values),
            "goal": None,
            "peer": None,
            "ratio_to_peer": None,
            "notes": note,
        }

    return [
        figure("Pulumi synthesis of a 2,000-node, 16-pool fleet under mocks", "s", "synth_s"),
        figure("render of the same fleet to YAML (in memory)", "s", "render_s"),
        figure("peak RSS of the synthesis + render process", "MB", "peak_rss_mb"),
    ]


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
