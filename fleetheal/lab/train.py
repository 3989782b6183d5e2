"""The lab's training job: plain Python (standard library only), one rank per Slurm node.

It stands in for a data-parallel training run, so that the lab can show what fleetheal does to a job:
it advances "steps" at a fixed pace with a deterministic loss curve, checkpoints to the shared lab dir
every few seconds, resumes from its checkpoint after a requeue, and treats SIGUSR1 (fleetheal's grace
signal, `scancel --batch --signal=USR1`) and SIGTERM (Slurm's requeue or cancel) as "checkpoint now".

Layout: the batch script (see `batch_script`) runs rank 0, the coordinator, on the first node; it
starts one worker per other node with `srun --relative=1`. The coordinator owns the step counter and
the checkpoint; workers follow the coordinator's progress file, as lockstep data-parallel ranks would.
Every rank reports step, step time and loss to its own node's fleetheal agent through the agent's
training client (`fleetheal.agent.client.TrainingReporter`) when it is installed.

Output: one log across restarts (sbatch `--open-mode=append`); each start after the first prints one
line naming Slurm's restart count (`SLURM_RESTART_COUNT` in the batch environment; prolog and epilog
see it as `SLURM_JOB_RESTART_COUNT`), the incident from the job's comment (the remediator writes
`incident=<id>` there when it requeues; `fleetheal launch`, which runs the coordinator and restarts it
inside the allocation, passes it as FLEETHEAL_INCIDENT) and the checkpoint step it resumed from. Machine-readable
events go to `events.jsonl` in the run directory (start, checkpoint, signal, end), which the lab's
status, demo and tests read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

CHECKPOINT = "checkpoint.json"
PROGRESS = "progress.json"
EVENTS = "events.jsonl"
#: A file in the run directory that makes the running job fail as a real one would, in its own output
#: (`misbehave`): the lab's way to raise a fault from what the job prints, not from an injection on a node.
MISBEHAVE = "misbehave"
#: What PyTorch prints when an allocation fails (torch 2.x `torch.OutOfMemoryError`); the rank then exits.
OOM_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 3.12 GiB is free. Of the allocated memory 71.33 GiB is allocated by PyTorch."
)
#: What PyTorch's NCCL watchdog prints when a collective times out (torch 2.x, ProcessGroupNCCL.cpp); the job
#: then hangs in the collective until it is signalled.
NCCL_WATCHDOG_LINE = (
    "[rank0]:[E{stamp} ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
    "600009 milliseconds before timing out."
)
_INCIDENT = re.compile(r"incident=([A-Za-z0-9_.:-]+)")


def loss_at(step: int) -> float:
    """Deterministic loss curve, so a resumed run continues the same curve."""
    return round(2.5 * math.exp(-step / 400.0) + 0.1 + 0.02 * math.sin(step / 7.0), 5)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, path)


def read_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads((run_dir / CHECKPOINT).read_text())
        return doc
    except (FileNotFoundError, ValueError):
        return None


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event the job wrote, in order (malformed lines are skipped)."""
    out = []
    try:
        text = (run_dir / EVENTS).read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def ettr(events: list[dict[str, Any]], now: float | None = None) -> float | None:
    """Effective training time ratio: time the kept steps took at full pace / wall time since the first start.

    Steps redone after a restart and time spent pending, checkpointing or waiting count as lost.
    """
    starts = [e for e in events if e.get("event") == "start"]
    if not starts:
        return None
    first = float(starts[0]["time"])
    step_time = float(starts[0]["step_time"])
    progress = [e for e in events if "step" in e and e.get("event") in ("checkpoint", "signal", "end", "progress")]
    if not progress:
        return None
    last = progress[-1]
    end = float(now if now is not None else last["time"])
    base = int(starts[0].get("resumed_from", 0))
    productive = (int(last["step"]) - base) * step_time
    return min(1.0, productive / (end - first)) if end > first else None


def _incident_from_comment(job_id: str) -> str | None:
    """The incident the remediator named in the job's comment, if any."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bComment=(.*?)(?= [A-Z][A-Za-z]+=|$)", out)
    if not m:
        return None
    found = _INCIDENT.findall(m.group(1))
    return found[-1] if found else None


def _reporter(rank: int, socket_path: str | None) -> Any:
    try:
        from fleetheal.agent.client import TrainingReporter
    except ImportError:  # the agent's client is optional: the job trains without it
        return None
    return TrainingReporter(rank=rank, socket_path=socket_path, min_interval_s=0.5)


def _socket_for(template: str | None) -> str | None:
    if not template:
        return None
    return template.format(node=os.environ.get("SLURMD_NODENAME", "unknown"))


class Coordinator:
    """Rank 0: steps, checkpoints, signals, restart lines."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.run_dir = Path(args.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.steps = args.steps
        self.step_time = args.step_time
        self.ckpt_every = args.checkpoint_every
        self.grace_wait = args.grace_wait
        self.socket_template = args.socket_template
        self.job = os.environ.get("SLURM_JOB_ID", "local")
        # Slurm names it SLURM_RESTART_COUNT in the batch environment, SLURM_JOB_RESTART_COUNT in prolog/epilog.
        count = os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("SLURM_JOB_RESTART_COUNT") or "0"
        self.requeues = int(count) if count.isdigit() else 0
        # `fleetheal launch` counts its restarts inside the allocation (no requeue) in FLEETHEAL_LAUNCH_RESTARTS.
        in_job = os.environ.get("FLEETHEAL_LAUNCH_RESTARTS", "0")
        self.in_job = int(in_job) if in_job.isdigit() else 0
        self.restarts = self.requeues + self.in_job
        self.nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURMD_NODENAME", "local"))
        self.signal: int | None = None
        self.step = 0
        #: The step at which this job runs out of GPU memory, every run (`misbehave` "cuda-oom STEP").
        self.oom_at: int | None = None
        self.workers: subprocess.Popen[bytes] | None = None

    def log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {text}", flush=True)

    def event(self, name: str, **fields: Any) -> None:
        doc = {"event": name, "time": time.time(), "job": self.job, "restart": self.restarts, **fields}
        with open(self.run_dir / EVENTS, "a") as fh:
            fh.write(json.dumps(doc) + "\n")

    def checkpoint(self, why: str) -> None:
        doc = {
            "step": self.step,
            "loss": loss_at(self.step),
            "saved_at": time.time(),
            "job": self.job,
            "restart": self.restarts,
            "why": why,
        }
        _write_json(self.run_dir / CHECKPOINT, doc)
        self.event("checkpoint", step=self.step, why=why)

    def misbehave(self, path: Path) -> None:
        """Fail as `path` says. `nccl-timeout` (once: the file is removed) prints PyTorch's NCCL watchdog line
        to stderr and hangs until a signal comes, as a rank stuck in a collective does. `cuda-oom STEP` (the
        file stays: a job configured too big) makes every run that reaches STEP print PyTorch's out-of-memory
        error and exit 1."""
        what = path.read_text().strip()
        if what.startswith("cuda-oom "):
            self.oom_at = int(what.split()[1])
            path.rename(path.with_name(MISBEHAVE + ".oom"))
            return
        path.unlink(missing_ok=True)
        if what != "nccl-timeout":
            self.log(f"misbehave: unknown {what!r}, ignored")
            return
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime()) + ".000000"
        print(NCCL_WATCHDOG_LINE.format(stamp=stamp, seq=self.step), file=sys.stderr, flush=True)
        self.event("misbehave", what=what, step=self.step)
        while self.signal is None:
            time.sleep(0.05)

    def out_of_memory(self, reporter: Any) -> int:
        """Step `oom_at` does not fit: report the step (unthrottled: the agent judges a second OOM by the step
        it was at), print PyTorch's error and exit 1, as an uncaught OutOfMemoryError does."""
        self.step += 1
        if reporter is not None:
            reporter.min_interval_s = 0.0
            reporter.report(self.step)
        self.event("misbehave", what="cuda-oom", step=self.step)
        print(OOM_LINE, file=sys.stderr, flush=True)
        self.stop_workers()
        return 1

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum

    def start_workers(self) -> None:
        # `fleetheal launch --nodes N` says how many nodes to use; the rest of the allocation are spares.
        nnodes = int(os.environ.get("FLEETHEAL_LAUNCH_NODES") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
        if nnodes < 2 or "SLURM_JOB_ID" not in os.environ:
            return
        cmd = [
            "srun", "--nodes", str(nnodes - 1), "--ntasks", str(nnodes - 1), "--ntasks-per-node=1",
            "--relative=1", "--kill-on-bad-exit=0", "--overlap",
            sys.executable, "-m", "fleetheal.lab.train", "worker", "--run-dir", str(self.run_dir),
        ]  # fmt: skip
        if self.socket_template:
            cmd += ["--socket-template", self.socket_template]
        self.workers = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def stop_workers(self) -> None:
        if self.workers is None or self.workers.poll() is not None:
            return
        self.workers.terminate()
        try:
            self.workers.wait(5)
        except subprocess.TimeoutExpired:
            self.workers.kill()
            self.workers.wait()

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)
        ckpt = read_checkpoint(self.run_dir)
        resumed_from = int(ckpt["step"]) if ckpt else 0
        self.step = resumed_from
        host = os.environ.get("SLURMD_NODENAME", "local")
        if self.restarts > 0 or ckpt is not None:
            incident = os.environ.get("FLEETHEAL_INCIDENT") or (
                _incident_from_comment(self.job) if self.job != "local" else None
            )
            self.log(
                f"=== restart {self.restarts} of job {self.job} on {self.nodes} "
                f"(SLURM_RESTART_COUNT={self.requeues}, in-job restarts {self.in_job}): incident={incident or 'none'}; "
                f"resumed from checkpoint step {resumed_from}"
                + (f" saved by restart {ckpt['restart']} ({ckpt['why']})" if ckpt else " (no checkpoint found)")
            )
        else:
            incident = None
            self.log(
                f"=== job {self.job} starts on {self.nodes}: {self.steps} steps, checkpoint every {self.ckpt_every}s"
            )
        self.event(
            "start", step=self.step, resumed_from=resumed_from, incident=incident, nodes=self.nodes, host=host,
            step_time=self.step_time, checkpoint_every=self.ckpt_every, requeues=self.requeues, in_job=self.in_job,
        )  # fmt: skip
        _write_json(self.run_dir / PROGRESS, {"step": self.step, "time": time.time(), "job": self.job})
        self.start_workers()
        reporter = _reporter(0, _socket_for(self.socket_template))
        last_ckpt = last_progress = time.monotonic()
        last_log = 0.0
        misbehave = self.run_dir / MISBEHAVE
        oom = misbehave.with_name(MISBEHAVE + ".oom")
        if oom.exists():
            self.oom_at = int(oom.read_text().split()[1])
        while self.step < self.steps and self.signal is None:
            t0 = time.monotonic()
            time.sleep(self.step_time)
            if misbehave.exists():
                self.misbehave(misbehave)
                continue
            if self.oom_at is not None and self.step + 1 >= self.oom_at:
                return self.out_of_memory(reporter)
            self.step += 1
            loss = loss_at(self.step)
            _write_json(self.run_dir / PROGRESS, {"step": self.step, "time": time.time(), "job": self.job})
            if reporter is not None:
                reporter.report(self.step, step_time=time.monotonic() - t0, loss=loss)
            if time.monotonic() - last_progress >= 1.0:
                self.event("progress", step=self.step, loss=loss)
                last_progress = time.monotonic()
            if time.monotonic() - last_ckpt >= self.ckpt_every:
                self.checkpoint("periodic")
                last_ckpt = time.monotonic()
            if time.monotonic() - last_log >= 10:
                self.log(f"step {self.step} loss {loss}")
                last_log = time.monotonic()
        if self.signal is not None:
            name = signal.Signals(self.signal).name
            self.checkpoint(f"grace signal {name}")
            self.log(f"{name}: checkpointed at step {self.step}")
            self.event("signal", signal=name, step=self.step)
            if self.signal == signal.SIGUSR1:
                # The grace signal comes before a requeue: stay (idle) until Slurm's SIGTERM ends this run,
                # so the job is still RUNNING when the remediator requeues it.
                self.signal = None
                deadline = time.monotonic() + self.grace_wait
                while self.signal != signal.SIGTERM and time.monotonic() < deadline:
                    if self.signal == signal.SIGUSR1:  # another grace signal: already checkpointed
                        self.log(f"SIGUSR1 again: checkpoint at step {self.step} already saved")
                        self.signal = None
                    time.sleep(0.05)
                if self.signal != signal.SIGTERM:
                    self.log(f"no requeue within {self.grace_wait:.0f}s of the grace signal; exiting")
            self.stop_workers()
            # This run ends on this node (requeued elsewhere or cancelled): the agent must not wait for it,
            # or it would call the job hung long after it moved.
            if reporter is not None and hasattr(reporter, "end"):
                reporter.end()
            return 0
        self.checkpoint("finished")
        self.event("end", step=self.step)
        self.log(f"=== training finished at step {self.step}, loss {loss_at(self.step)}")
        self.stop_workers()
        if reporter is not None and hasattr(reporter, "end"):
            reporter.end()
        return 0


def run_worker(args: argparse.Namespace) -> int:
    """A rank on another node: follows the coordinator's steps and reports them to its node's agent."""
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("SLURM_PROCID", "0")) + 1
    reporter = _reporter(rank, _socket_for(args.socket_template))
    stop = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    last = -1
    last_t = time.monotonic()
    while not stop:
        time.sleep(0.1)
        try:
            step = int(json.loads((run_dir / PROGRESS).read_text())["step"])
        except (FileNotFoundError, ValueError, KeyError):
            continue
        if step != last and reporter is not None:
            now = time.monotonic()
            reporter.report(step, step_time=(now - last_t) / max(1, step - last) if last >= 0 else None,
                            loss=loss_at(step))  # fmt: skip
            last_t = now
        last = step
    if reporter is not None and hasattr(reporter, "end"):
        reporter.end()  # this rank is done on this node (see the coordinator)
    return 0


def batch_script(
    python: str,
    run_dir: Path,
    *,
    steps: int,
    step_time: float,
    checkpoint_every: float,
    socket_template: str | None = None,
    grace_wait: float = 60.0,
    pythonpath: str | None = None,
    nodes: int | None = None,
) -> str:
    """The sbatch script that runs the job (the researcher's `train.sh`); with `nodes`, the training uses
    that many nodes of its allocation and the rest are hot spares (`fleetheal launch --nodes`)."""
    extra = f" --socket-template {socket_template}" if socket_template else ""
    spares = f" --nodes {nodes}" if nodes is not None else ""
    env = f"export PYTHONPATH={pythonpath}\n" if pythonpath else ""
    # `fleetheal launch` sends the lines it flags to this node's agent (deployed: its default socket).
    if socket_template:
        env += f"export FLEETHEAL_TRAINING_SOCKET={socket_template.replace('{node}', '$SLURMD_NODENAME')}\n"
    return (
        "#!/bin/bash\n"
        "# fleetheal lab training job: rank 0 here, one rank per other node through srun; fleetheal launch\n"
        "# restarts it inside the allocation when the remediator orders a restart in place.\n"
        f"{env}"
        f"exec {python} -m fleetheal launch{spares} -- {python} -m fleetheal.lab.train coordinator "
        f"--run-dir {run_dir} --steps {steps} "
        f"--step-time {step_time} --checkpoint-every {checkpoint_every} --grace-wait {grace_wait}{extra}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetheal.lab.train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    coord = sub.add_parser("coordinator", help="rank 0 (the batch script runs it)")
    coord.add_argument("--run-dir", required=True)
    coord.add_argument("--steps", type=int, default=100_000)
    coord.add_argument("--step-time", type=float, default=0.1, help="seconds per step")
    coord.add_argument("--checkpoint-every", type=float, default=3.0, help="seconds between checkpoints")
    coord.add_argument("--grace-wait", type=float, default=60.0, help="after SIGUSR1, wait this long for the requeue")
    coord.add_argument("--socket-template", help="agent training socket, {node} replaced by SLURMD_NODENAME")
    worker = sub.add_parser("worker", help="ranks 1.. (started by the coordinator through srun)")
    worker.add_argument("--run-dir", required=True)
    worker.add_argument("--socket-template")
    args = parser.parse_args(argv)
    if args.role == "coordinator":
        return Coordinator(args).run()
    return run_worker(args)


if __name__ == "__main__":
    raise SystemExit(main())
