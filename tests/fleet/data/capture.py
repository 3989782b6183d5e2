"""Capture what `sinfo`/`squeue` print for fleetheal.fleet.view, from a real lab federation (README.md).

.venv/bin/python tests/fleet/data/capture.py tests/fleet/data
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from fleetheal.lab.federation import Federation
from fleetheal.slurm import jobs, nodes
from fleetheal.wait import wait_until

SLEEP = "#!/bin/sh\nsleep 600\n"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fed = Federation(tempfile.mkdtemp(prefix="fleetheal-capture-"))
    try:
        fed.start()

        def save(tag: str) -> None:
            for tool, args in (("sinfo", nodes.FLEET_SINFO_ARGS), ("squeue", jobs.FLEET_SQUEUE_ARGS)):
                p = fed.run(tool, *args, check=False)
                (out / f"{tool}-{tag}.txt").write_text(p.stdout)
                meta = {"argv": [tool, *args], "rc": p.returncode, "stderr": p.stderr}
                (out / f"{tool}-{tag}.meta").write_text(json.dumps(meta) + "\n")

        a, b = fed.clusters["a"], fed.clusters["b"]
        a.sbatch(SLEEP, "--gres=gpu:8", "-M", "a", "--qos=small")
        b.sbatch(SLEEP, "--gres=gpu:8", "-M", "b", "--qos=small")
        wait_until(lambda: len(fed.squeue("-h", "-t", "R", "-o", "%i").split()) >= 2, 30, "two jobs running")
        a.sbatch(SLEEP, "--gres=gpu:8", "-N", "2", "-M", "a", "--qos=large")
        a.sbatch(SLEEP, "--gres=gpu:8", "-N", "2", "-M", "a,b", "--qos=large")
        wait_until(lambda: len(fed.squeue("-h", "-t", "PD", "-o", "%i").split()) >= 3, 30, "three pending copies")
        save("busy")
        b.scontrol("update", "nodename=b2", "state=drain", "reason=fleetheal:capture")
        save("drained")
        b.scontrol("update", "nodename=b2", "state=resume")
        fed.drop("c")
        save("c-down")
        fed.rejoin("c")
        save("c-back")
    finally:
        fed.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
