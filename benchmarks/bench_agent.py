"""Node-health agent: fault -> Slurm DRAIN latency with a real slurmctld, CPU and RSS while polling.

1. Drain latency: a private Slurm (fleetheal.lab.slurm.SlurmCluster) and the agent as its own process
   (`python -m fleetheal agent run`, simulated backend, 8 GPUs). Each of INJECTIONS rounds injects Xid 79
   on a GPU and times until `scontrol show node` reports the node DRAIN, then clears the fault and
   resumes the node. Goal: p99 < 2 s.
2. CPU and RSS: the agent with 8 and 64 simulated GPUs, 1 s polling, every source enabled and no faults,
   for WINDOWS windows of WINDOW_S seconds each: CPU share of one core (user+system time), CPU time
   per polling cycle, and resident memory at the end. Goals at 8 GPUs: < 1% of a core, RSS < 60 MB.
3. `fleetheal agent check` wall time with the simulated backend (a fresh process each time). Goal < 1 s.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from fleetheal.agent.simulated import clear, inject
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.procs import free_ports
from fleetheal.wait import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[1]
INJECTIONS = 60
WINDOWS = 3
WINDOW_S = 10.0
CHECKS = 20


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


def _config(tmp: Path, gpus: int, port: int, slurm_conf: str | None) -> Path:
    (tmp / "kern.log").touch()
    cfg: dict[str, Any] = {
        "node": "n1",
        "poll_interval_s": 1.0,
        "log_level": "warning",
        "backend": {"kind": "simulated", "simulated": {"gpus": gpus, "state_file": str(tmp / "sim.json")}},
        "metrics": {"listen": "127.0.0.1", "port": port},
        "kernel_log": {"path": str(tmp / "kern.log"), "position_file": str(tmp / "kern.pos")},
        "training": {"socket": str(tmp / "training.sock")},
        # every Xid is a new occurrence, so each round drains again after the node was resumed
        "health": {"dedup_s": 0.0},
        "fastpath": {"slurm": {"enabled": slurm_conf is not None, "slurm_conf": slurm_conf}},
    }
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class _Agent:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.port = port
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetheal", "agent", "run", "--config", str(config)],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("the agent exited")
            _scrape(port)
            return True

        try:
            wait_until(up, 20, f"the agent's metrics on port {port}", interval=0.05, ignore=(OSError,))
        except (WaitTimeout, RuntimeError):
            self.stop()
            raise RuntimeError(f"agent did not start; see {log}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def drain_latency(tmp: Path) -> dict[str, Any]:
    port = free_ports()[0]
    with SlurmCluster(tmp / "slurm", nodes=2, gpus_per_node=8) as cluster:
        agent = _Agent(_config(tmp, 8, port, str(cluster.conf_path)), port, tmp / "agent-drain.log")
        try:
            latencies = []
            for i in range(INJECTIONS):
                gpu = i % 8
                started = time.monotonic()
                inject(tmp / "sim.json", "xid-79", gpu=gpu)
                while not cluster.node("n1").drained:
                    if time.monotonic() - started > 30:
                        raise RuntimeError(f"round {i}: node not drained after 30 s")
                latencies.append(time.monotonic() - started)
                reason = cluster.node("n1").reason or ""
                if not reason.startswith("fleetheal:xid-79") or f"gpu={gpu}" not in reason:
                    raise RuntimeError(f"round {i}: unexpected reason {reason!r}")
                clear(tmp / "sim.json")
                cluster.scontrol("update", "nodename=n1", "state=resume")
                cluster.wait_nodes("IDLE", nodes=["n1"], timeout=30)
                time.sleep(0.2)
        finally:
            agent.stop()
    return {
        "name": "Xid 79 injected -> node DRAIN in scontrol (real slurmctld)",
        "unit": "s",
        "median": statistics.median(latencies),
        "p99": _pct(latencies, 0.99),
        "n": len(latencies),
        "goal": "p99 < 2 s",
        "notes": f"max {max(latencies):.3f} s; includes scontrol polling by the benchmark",
    }


def idle_cost(tmp: Path, gpus: int) -> list[dict[str, Any]]:
    port = free_ports()[0]
    agent = _Agent(_config(tmp, gpus, port, None), port, tmp / f"agent-{gpus}.log")
    try:
        time.sleep(3.0)  # start-up and first polls
        shares, per_poll = [], []
        for _ in range(WINDOWS):
            polls0 = _scrape(port)["fleetheal_agent_polls_total"]
            cpu0, wall0 = _cpu_seconds(agent.proc.pid), time.monotonic()
            time.sleep(WINDOW_S)
            cpu1, wall1 = _cpu_seconds(agent.proc.pid), time.monotonic()
            polls1 = _scrape(port)["fleetheal_agent_polls_total"]
            shares.append(100 * (cpu1 - cpu0) / (wall1 - wall0))
            per_poll.append(1000 * (cpu1 - cpu0) / max(1.0, polls1 - polls0))
        rss = _rss_mb(agent.proc.pid)
        poll = _scrape(port)
        in_cycle = (
            1000
            * poll["fleetheal_agent_poll_duration_seconds_sum"]
            / poll["fleetheal_agent_poll_duration_seconds_count"]
        )
    finally:
        agent.stop()
    return [
        {
            "name": f"agent CPU, {gpus} simulated GPUs, 1 s polling",
            "unit": "% of one core",
            "median": statistics.median(shares),
            "p99": max(shares),
            "n": WINDOWS,
            "goal": "< 1%" if gpus == 8 else None,
            "notes": f"{WINDOW_S:.0f} s windows; all threads (events, kernel log, training socket, metrics)",
        },
        {
            "name": f"agent CPU per polling cycle, {gpus} GPUs",
            "unit": "ms CPU",
            "median": statistics.median(per_poll),
            "p99": max(per_poll),
            "n": WINDOWS,
            "goal": None,
            "notes": f"process CPU / cycles; the cycle itself takes {in_cycle:.2f} ms wall on average",
        },
        {
            "name": f"agent RSS, {gpus} GPUs",
            "unit": "MB",
            "median": rss,
            "p99": rss,
            "n": 1,
            "goal": "< 60 MB" if gpus == 8 else None,
            "notes": "VmRSS after the CPU windows",
        },
    ]


def _timed(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed: {done.stdout} {done.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def check_latency(tmp: Path) -> list[dict[str, Any]]:
    config = str(_config(tmp, 8, 0, None))
    figures = []
    for label, argv in (
        ("python -m fleetheal.agent check", [sys.executable, "-m", "fleetheal.agent", "check", "--config", config]),
        ("fleetheal agent check (full CLI)", [sys.executable, "-m", "fleetheal", "agent", "check", "--config", config]),
    ):
        walls, cpus, bare = [], [], []
        for _ in range(CHECKS):
            wall, cpu = _timed(argv)
            walls.append(wall)
            cpus.append(cpu)
            bare.append(_timed([sys.executable, "-c", "pass"])[0])  # interpreter start-up, side by side
        figures.append(
            {
                "name": f"{label}, simulated backend, 8 GPUs",
                "unit": "s",
                "median": statistics.median(walls),
                "p99": _pct(walls, 0.99),
                "n": CHECKS,
                "goal": "< 1 s",
                "peer": statistics.median(bare),
                "ratio_to_peer": statistics.median(walls) / statistics.median(bare),
                "notes": f"fresh process each time; CPU median {statistics.median(cpus):.3f} s; peer: `python -c pass`",
            }
        )
    return figures


def run() -> list[dict[str, Any]]:
    if not shutil.which("slurmctld") or os.geteuid() != 0:
        raise RuntimeError("needs root and Debian's Slurm packages (scripts/bootstrap.sh installs them)")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as d:
        tmp = Path(d)
        for sub in ("drain", "g8", "g64", "check"):
            (tmp / sub).mkdir()
        results.append(drain_latency(tmp / "drain"))
        results += idle_cost(tmp / "g8", 8)
        results += idle_cost(tmp / "g64", 64)
        results += check_latency(tmp / "check")
    for r in results:
        r.setdefault("peer", None)
        r.setdefault("ratio_to_peer", None)
    return results


if __name__ == "__main__":
    for fig in run():
        print(fig)
