"""The remediator's two Slurm calls, spawned as it does today (`sinfo` for the node read, `scontrol update` for a
drain) against the same calls to slurmrestd's v0.0.44 API, the API Slinky's operator uses: should the remediator
talk to slurmrestd instead?

A private Slurm 26.05 (the tree of scripts/slurm-tree.sh first on PATH; refused on another release) of NODES
nodes with JWT as its alternative authentication, and slurmrestd (`-a rest_auth/jwt`, as uid and gid 65534,
nobody: given by name, the relocated slurmrestd does not resolve it) on loopback.
The REST client holds a root token from `scontrol token` and keeps one HTTP connection open, as a
long-lived remediator would. Each round times one call from the request until its answer is parsed:
  - node read: `sinfo fleetheal.slurm.nodes.NODES_ARGS` + `slurm_nodes.read`, against GET /slurm/v0.0.44/nodes
    + `slurm_nodes.read` (the same `Nodes`; checked once),
  - drain: `scontrol update nodename=N state=DRAIN reason=...`, against POST /slurm/v0.0.44/node/N with the same
    state and reason (each round drains another node; all are resumed between the two methods).
Rounds alternate between the methods, so load on this shared machine hits both alike.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

NODES = 16
ROUNDS = 30
API = "/slurm/v0.0.44"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


class _Rest:
    """One keep-alive HTTP connection to slurmrestd with a JWT."""

    def __init__(self, port: int, token: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.headers = {"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token, "Content-Type": "application/json"}

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        self.conn.request(method, API + path, body=json.dumps(body) if body else None, headers=self.headers)
        resp = self.conn.getresponse()
        doc: dict[str, Any] = json.loads(resp.read())
        if resp.status != 200 or doc.get("errors"):
            raise RuntimeError(f"{method} {path}: HTTP {resp.status} {doc.get('errors')}")
        return doc


def run() -> list[dict[str, Any]]:
    from fleetheal.lab.slurm import SlurmCluster, find_tool
    from fleetheal.procs import free_ports
    from fleetheal.slurm import nodes as slurm_nodes
    from fleetheal.wait import wait_until

    base = Path(tempfile.mkdtemp(prefix="fleetheal-bench-rest-"))
    base.chmod(0o755)  # slurmrestd, as nobody, reads slurm.conf below it
    key = base / "jwt.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    cluster = SlurmCluster(
        base / "slurm",
        nodes=NODES,
        gpus_per_node=0,
        extra_conf=["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={key}"],
    )
    if cluster.release.version < (24, 11, 0):
        raise RuntimeError(f"slurmrestd v0.0.44 needs Slurm 24.11+; PATH has {cluster.release}: run `make bench`")
    rest_proc = None
    reads: dict[str, list[float]] = {"spawn": [], "rest": []}
    drains: dict[str, list[float]] = {"spawn": [], "rest": []}
    try:
        cluster.start(timeout=60)
        port = free_ports(1)[0]
        # SLURM_JWT=daemon: slurmrestd passes each request's token on to slurmctld (Slurm's jwt.html).
        env = {**cluster.env, "SLURM_JWT": "daemon"}
        with open(base / "slurmrestd.log", "wb") as log:
            rest_proc = subprocess.Popen(
                [find_tool("slurmrestd"), "-a", "rest_auth/jwt", "-u", "65534", "-g", "65534", f"127.0.0.1:{port}"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        token = cluster.run("scontrol", "token", "username=root", "lifespan=3600").stdout.strip().split("=", 1)[1]
        rest = _Rest(port, token)

        def answers() -> bool:
            try:
                rest.call("GET", "/ping")
            except (OSError, http.client.HTTPException):
                rest.conn.close()
                return False
            return True

        wait_until(answers, 15, "slurmrestd to answer /ping", interval=0.1)
        sinfo = slurm_nodes.sinfo_argv(find_tool("sinfo"))
        assert slurm_nodes.read(rest.call("GET", "/nodes")) == cluster.nodes(), "REST and sinfo read different nodes"

        for _ in range(ROUNDS):
            t = time.perf_counter()
            slurm_nodes.read(subprocess.run(sinfo, env=cluster.env, capture_output=True, text=True, check=True).stdout)
            reads["spawn"].append(time.perf_counter() - t)
            t = time.perf_counter()
            slurm_nodes.read(rest.call("GET", "/nodes"))
            reads["rest"].append(time.perf_counter() - t)

        names = cluster.node_names
        for method in ("spawn", "rest"):
            for i in range(min(ROUNDS, len(names) - 1)):
                node, reason = names[i + 1], f"fleetheal:bench incident=b-{method}-{i}"
                t = time.perf_counter()
                if method == "spawn":
                    cluster.run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")
                else:
                    rest.call("POST", f"/node/{node}", {"state": ["DRAIN"], "reason": reason})
                drains[method].append(time.perf_counter() - t)
                assert cluster.node(node).reason == reason
            cluster.run("scontrol", "update", f"nodename={','.join(names[1:])}", "state=RESUME")
    finally:
        if rest_proc is not None:
            rest_proc.terminate()
            rest_proc.wait(10)
        cluster.stop()
        if not os.environ.get("FLEETHEAL_BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)

    version = cluster.release.name
    figures = []
    for what, times, op in (
        ("node read", reads, f"{NODES} nodes"),
        ("drain one node", drains, "scontrol update"),
    ):
        med, peer = statistics.median(times["rest"]), statistics.median(times["spawn"])
        figures.append(
            {
                "name": f"{what}: slurmrestd {API} (JWT, keep-alive) against spawning the client",
                "unit": "s",
                "median": med,
                "p99": _p99(times["rest"]),
                "n": len(times["rest"]),
                "goal": None,
                "peer": peer,
                "ratio_to_peer": med / peer if peer else None,
                "notes": f"Slurm {version}, {op}; peer: the spawned client (p99 {_p99(times['spawn']) * 1000:.1f} ms)",
            }
        )
    return figures


if __name__ == "__main__":
    for fig in run():
        print(json.dumps(fig))
