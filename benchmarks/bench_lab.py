"""The whole loop on the lab (real Slurm, Prometheus, Alertmanager, agents, remediator, ansible-runner):
repeated Xid 79 injections on a GPU of a running 2-node training job.

Per injection (timed from writing the fault into the node's simulated-GPU file):
1. fault -> Slurm node DRAIN by the agent's fast path (`scontrol show node`, polled every 50 ms). Goal p99 < 2 s.
2. fault -> the alert at the remediator (the incident's `received_at`: agent poll, Prometheus scrape and
   rule evaluation, Alertmanager).
3. fault -> job RUNNING again (restart count up) on a spare node: the lab has 2 active nodes and 3
   warm-standby nodes, so the requeued job needs the promoted standby. Goal p50 < 5 s, p99 < 10 s.
   Reported next to it: the platform overhead (the same less the lab's grace period, 3 s, in which the
   job checkpoints) and the application restart (RUNNING -> the training process's own start event).
Notes carry the per-phase medians: playbook start, grace signal, requeue, promotion, from the incident's
timeline and the job's events. Then the ETTR of the benchmark's training runs, measured
(`fleetheal.ettr.measure`).

After each round a "repair technician" returns the failed node: the fault file is cleared, the
remediator releases it (`fleetheal remediator release`), Slurm gets the standby reason back and its
Kubernetes Node the standby label and taint. A fresh job is submitted when one has been requeued 3 times
(the remediator's per-job retry limit). Each round uses another GPU index of the node, as the agent holds
an Xid event fault active for 10 minutes (`health.event_hold_s`) and one alert is one incident.

Rounds run for FLEETHEAL_BENCH_LAB_S seconds (default 600). Needs root and the lab's Debian packages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetheal.agent.client import TrainingReporter
from fleetheal.agent.simulated import clear
from fleetheal.contracts import LABEL_POOL, TAINT_STANDBY, owns_reason
from fleetheal.ettr import measure
from fleetheal.lab.demo import _expand
from fleetheal.lab.lab import LAB_SITE_VARS, STANDBY_REASON, Lab, _http
from fleetheal.lab.train import read_events

BUDGET_S = float(os.environ.get("FLEETHEAL_BENCH_LAB_S", "600"))
FAULT = "xid-79"
GRACE_S = float(LAB_SITE_VARS["fleetheal_grace_seconds"])
MAX_REQUEUES = 3


def _poll(check: Callable[[], Any], timeout: float, interval: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _label(ev: dict[str, Any]) -> str:
    return str(ev.get("detail", "")).split("|")[-1].replace("(localhost)", "").strip()


class Bench:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.cluster = lab.slurm()
        self.job: str | None = None
        self.run_dir: Path | None = None
        self.runs: list[Path] = []
        self.gpu: dict[str, int] = {}
        self.rounds: list[dict[str, float]] = []
        self.failures: list[str] = []

    def new_job(self) -> None:
        if self.job is not None:
            self.cluster.run("scancel", self.job, check=False)
            # What an epilog would do: tell every agent the old job's ranks ended, so their silence is
            # not taken for a hang (job-hang, 300 s later, would open incidents for a job that is gone).
            for node in self.lab.nodes:
                for rank in (0, 1):
                    rep = TrainingReporter(self.job, rank, socket_path=str(self.lab.node_dir(node) / "training.sock"))
                    rep.end()
                    rep.close()
        self.job, self.run_dir = self.lab.submit_training(name=f"bench{len(self.runs)}")
        self.runs.append(self.run_dir)

    def job_info(self) -> dict[str, str]:
        assert self.job is not None
        return self.cluster.job(self.job)

    def ready(self) -> bool:
        """The job runs and has trained a little since its last start."""
        assert self.run_dir is not None
        info = self.job_info()
        if info.get("JobState") != "RUNNING":
            return False
        ev = read_events(self.run_dir)
        starts = [e for e in ev if e.get("event") == "start"]
        prog = [e for e in ev if e.get("event") == "progress"]
        return bool(starts and prog and float(prog[-1]["time"]) > float(starts[-1]["time"]) + 2)

    def one_round(self) -> None:
        if self.job is None or int(self.job_info().get("Restarts", "0")) >= MAX_REQUEUES:
            self.new_job()
        if not _poll(self.ready, 90, 0.25):
            raise RuntimeError(f"job {self.job} is not running: {self.job_info()}")
        assert self.run_dir is not None
        info = self.job_info()
        node = _expand(info["NodeList"])[-1]
        gpu = self.gpu.get(node, 0)
        self.gpu[node] = (gpu + 1) % int(self.lab.meta["gpus"])
        restarts0 = int(info.get("Restarts", "0"))
        starts0 = len([e for e in read_events(self.run_dir) if e.get("event") == "start"])
        t0 = time.time()
        self.lab.inject(node, FAULT, gpu)

        def drained() -> float | None:
            n = self.cluster.node(node)
            return time.time() - t0 if n.drained and owns_reason(n.reason) else None

        def running() -> float | None:
            i = self.job_info()
            ok = i.get("JobState") == "RUNNING" and int(i.get("Restarts", "0")) > restarts0
            return time.time() - t0 if ok else None

        r: dict[str, float] = {}
        d = _poll(drained, 30, 0.05)
        if d is None:
            self.failures.append(f"{node} gpu {gpu}: not drained within 30 s")
            return
        r["drain"] = d
        again = _poll(running, 240, 0.2)
        if again is None:
            i = self.job_info()
            incs = [x for x in self.lab.incidents(limit=10) if x.get("node") == node]
            last = incs[0] if incs else {}
            self.failures.append(
                f"{node} gpu {gpu}: job {self.job} not running again within 240 s ({i.get('JobState')} "
                f"{i.get('Reason')}; incident {last.get('id')} {last.get('fault_id')} {last.get('state')}: "
                f"{str(last.get('outcome') or last.get('hold_reason') or '')[:160]})"
            )
            self.repair(node)
            return
        r["running"] = again

        def resumed() -> float | None:
            st = [e for e in read_events(self.run_dir) if e.get("event") == "start"]  # type: ignore[arg-type]
            return float(st[-1]["time"]) - t0 if len(st) > starts0 else None

        res = _poll(resumed, 60, 0.1)
        if res is not None:
            r["resumed"] = res
        sig = [e for e in read_events(self.run_dir) if e.get("event") == "signal" and float(e["time"]) > t0]
        if sig:
            r["grace_signal"] = float(sig[0]["time"]) - t0

        def finished() -> dict[str, Any] | None:
            for inc in self.lab.incidents(limit=20):
                if (
                    inc.get("node") == node
                    and inc.get("fault_id") == FAULT
                    and float(inc.get("received_at") or 0) >= t0 - 1
                    and inc.get("state") in ("done", "failed")
                ):
                    return inc
            return None

        inc = _poll(finished, 180, 0.5)
        if inc is None:
            self.failures.append(f"{node} gpu {gpu}: incident not finished within 180 s")
        else:
            r["alert"] = float(inc["received_at"]) - t0
            full = self.lab.incident(inc["id"])
            firsts: dict[str, float] = {}
            for ev in full.get("timeline") or []:
                key = "playbook" if ev.get("kind") == "step" and str(ev.get("what", "")).startswith("playbook") else ""
                if ev.get("kind") == "event" and ev.get("what") == "task_changed":
                    key = _label(ev)
                if key:
                    firsts.setdefault(key, float(ev["ts"]) - t0)
            r["playbook_start"] = firsts.get("playbook", float("nan"))
            for key, value in firsts.items():
                if "equeue" in key:
                    r.setdefault("requeue", value)
                if "standby" in key.lower() or "romote" in key:
                    r.setdefault("promote", value)
            r["incident_done"] = float(full.get("phases", {}).get("total") or float("nan"))
        self.rounds.append(r)
        self.repair(node)

    def repair(self, node: str) -> None:
        """A technician returns the node to the warm-standby pool."""
        clear(self.lab.node_dir(node) / "sim-gpus.json")
        subprocess.run(
            [sys.executable, "-m", "fleetheal", "remediator", "release", node, "--config",
             str(self.lab.remediator_config), "--reason", "bench_lab: repaired"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        self.cluster.scontrol("update", f"nodename={node}", "state=drain", f"reason={STANDBY_REASON}")
        patch = {
            "metadata": {"labels": {LABEL_POOL: "standby"}},
            "spec": {"unschedulable": False, "taints": [{"key": TAINT_STANDBY, "effect": "NoSchedule"}]},
        }
        with contextlib.suppress(Exception):
            _http("PATCH", f"{self.lab.kube_url}/api/v1/nodes/{node}", patch, self.lab.kube_token,
                  "application/merge-patch+json")  # fmt: skip


def _figure(name: str, values: list[float], goal: str, notes: str) -> dict[str, Any]:
    return {
        "name": name,
        "unit": "s",
        "median": statistics.median(values) if values else None,
        "p99": _pct(values, 99),
        "n": len(values),
        "goal": goal,
        "peer": None,
        "ratio_to_peer": None,
        "notes": notes,
    }


def run() -> list[dict[str, Any]]:
    lab_dir = tempfile.mkdtemp(prefix="fleetheal-bench-lab-")
    lab = Lab(lab_dir, log=lambda text: None)
    errors: list[str] = []
    try:
        lab.up(nodes=2, standby=3, gpus=8)
        bench = Bench(lab)
        t_end = time.monotonic() + BUDGET_S
        while time.monotonic() < t_end - 45:
            try:
                bench.one_round()
            except Exception as exc:  # one broken round is reported; the lab still goes down
                errors.append(f"{type(exc).__name__}: {exc}")
                break
        now = time.time()  # the last run is still going; earlier ones ended at their last event (scancel)
        runs = [measure(read_events(d), now if d == bench.runs[-1] else None) for d in bench.runs]
        measured = [m for m in runs if m is not None]
    finally:
        lab.down(quiet=True)
        shutil.rmtree(lab_dir, ignore_errors=True)
    rounds = bench.rounds
    if not rounds:
        raise RuntimeError(f"no round completed: {bench.failures + errors}")

    def col(key: str) -> list[float]:
        return [r[key] for r in rounds if key in r and r[key] == r[key]]

    def med(key: str) -> str:
        v = col(key)
        return f"{statistics.median(v):.1f}" if v else "-"

    phases = (
        f"median s after the fault: drained {med('drain')}, alert at remediator {med('alert')}, playbook start "
        f"{med('playbook_start')}, grace signal/checkpoint {med('grace_signal')}, requeue task {med('requeue')}, "
        f"standby promote task {med('promote')}, RUNNING {med('running')}, app started {med('resumed')}, "
        f"incident done {med('incident_done')}"
    )
    fail = f"; {len(bench.failures)} rounds failed: {'; '.join(bench.failures[:3])}" if bench.failures else ""
    err = f"; stopped: {errors[0]}" if errors else ""
    platform = [r["running"] - GRACE_S for r in rounds if "running" in r]
    app = [r["resumed"] - r["running"] for r in rounds if "resumed" in r and "running" in r]
    figures = [
        _figure("Xid 79 -> Slurm node drained (agent fast path)", col("drain"), "p99 < 2 s",
                f"scontrol polled every 50 ms{fail}{err}"),
        _figure("Xid 79 -> alert at the remediator", col("alert"), "-",
                "agent poll 1 s + Prometheus scrape/eval 1 s + Alertmanager group_wait 0 s (lab intervals)"),
        _figure("Xid 79 -> job RUNNING again on a spare node", col("running"), "p50 < 5 s, p99 < 10 s", phases),
        _figure("  of which platform overhead (less the 3 s grace period)", platform, "-",
                "RUNNING again minus the lab's fleetheal_grace_seconds"),
        _figure("  then application restart (RUNNING -> training started)", app, "-",
                "the lab's toy job; a large job's launch + NCCL init + checkpoint load is far longer"),
    ]  # fmt: skip
    if measured:
        values = [m.ettr for m in measured]
        figures.append(
            {
                "name": "ETTR of the benchmark's training runs (measured)",
                "unit": "ratio",
                "median": statistics.median(values),
                "p99": min(values),
                "n": len(values),
                "goal": "-",
                "peer": None,
                "ratio_to_peer": None,
                "notes": "fleetheal.ettr.measure per job: a fault every ~"
                f"{BUDGET_S / max(1, len(rounds)):.0f} s on a 0.1 s-step job; lost work "
                f"{sum(m.lost_work_s for m in measured):.1f} s of {sum(m.allocated_s for m in measured):.0f} s; "
                "p99 column = worst run",
            }
        )
    return figures
