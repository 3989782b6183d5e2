"""`fleetheal launch -- CMD`: restart a job's training in place, inside its own Slurm allocation.

A requeued job cannot start again on the same nodes until the credential of its previous run has
expired there (Slurm's `cred_expire` + 1 s, "Job credential revoked" if sooner), and it pays the
scheduler and the prolog again. A job whose batch script ends with

    exec fleetheal launch -- srun python train.py ...

is restarted by the remediator without any of that: the wrapper runs CMD in a process group of its own
and, when ordered, stops it (SIGTERM, which the training's own handler turns into "checkpoint and exit";
SIGKILL after --stop-timeout) and runs it again in the same allocation. New job steps get new
credentials, so nothing waits for the old ones.

The protocol, all through Slurm (the remediator never reaches the node):

1. At start, the wrapper adds the word `fleetheal-launch` to its job's comment: "this job restarts in
   place". It does so only when it is the batch script itself (its parent is `slurmstepd`: `exec` it),
   because the order is a signal to the batch step (`scancel --batch`), and a shell that is sent SIGUSR2
   dies of it, job and all. Otherwise it says why and just runs CMD (the remediator then requeues).
2. The remediator writes `incident=<id>` into the comment, then sends SIGUSR2 (`scancel --batch`).
3. The wrapper restarts CMD once per incident id it has not restarted for (a SIGUSR2 without one, sent
   by the job's owner, restarts too), and exports FLEETHEAL_LAUNCH_RESTARTS and FLEETHEAL_INCIDENT.

Every other signal (Slurm's SIGTERM, fleetheal's grace signal SIGUSR1, SIGINT, SIGHUP) is passed on to
CMD's process group. The wrapper exits with CMD's status when CMD ends by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

TAG = "fleetheal-launch"
#: The restart order; one fixed signal, so the remediator and every job agree on it.
RESTART_SIGNAL = signal.SIGUSR2
_INCIDENT = re.compile(r"(?:^|\s)incident=(\S+)")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCONT)


def _say(text: str) -> None:
    print(f"fleetheal launch: {text}", file=sys.stderr, flush=True)


def _job_comment(job: str) -> str | None:
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job, "--format", "%k"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    )
    if out.returncode != 0:
        return None
    comment = out.stdout.strip()
    return "" if comment == "(null)" else comment


def is_batch_script(ppid: int | None = None) -> bool:
    """True when this process is the batch step's script (its parent is slurmstepd)."""
    try:
        return Path(f"/proc/{ppid or os.getppid()}/comm").read_text().strip() == "slurmstepd"
    except OSError:
        return False


class Launcher:
    def __init__(self, cmd: list[str], *, stop_timeout: float, job: str | None) -> None:
        self.cmd = cmd
        self.stop_timeout = stop_timeout
        self.job = job
        self.child: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.handled: set[str] = set()
        self.pending_restart = False
        self.incident = ""

    # --- the job's comment ---------------------------------------------------------------------------

    def tag_job(self) -> bool:
        if self.job is None:
            _say("not in a Slurm job (no SLURM_JOB_ID): running the command once, no restart in place")
            return False
        if not is_batch_script():
            _say(
                "not the batch script itself (its parent is not slurmstepd): run it as "
                "`exec fleetheal launch -- ...`; running the command without restart in place"
            )
            return False
        comment = _job_comment(self.job)
        if comment is None:
            _say(f"cannot read job {self.job}'s comment (squeue failed): no restart in place")
            return False
        words = comment.split()
        match = _INCIDENT.search(comment)
        if match:
            self.handled.add(match.group(1))  # an incident of an earlier run of this job, handled by it
        if TAG not in words:
            new = " ".join([*words, TAG])
            out = subprocess.run(
                ["scontrol", "update", f"jobid={self.job}", f"comment={new}"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
            if out.returncode != 0:
                _say(f"cannot mark job {self.job} ({out.stderr.strip()}): no restart in place")
                return False
        return True

    # --- signals -------------------------------------------------------------------------------------

    def _on_restart(self, signum: int, frame: FrameType | None) -> None:
        self.pending_restart = True

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signum)

    def _wanted(self) -> bool:
        """Restart for an incident not handled yet, or for a SIGUSR2 with no incident (the owner's)."""
        comment = _job_comment(self.job) if self.job else ""
        match = _INCIDENT.search(comment or "")
        if match is None:
            self.incident = ""
            return True
        if match.group(1) in self.handled:
            _say(f"restart for incident {match.group(1)} was done already: ignored")
            return False
        self.incident = match.group(1)
        self.handled.add(self.incident)
        return True

    # --- the child -----------------------------------------------------------------------------------

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ, FLEETHEAL_LAUNCH_RESTARTS=str(self.restarts))
        if self.incident:
            env["FLEETHEAL_INCIDENT"] = self.incident
        return subprocess.Popen(self.cmd, env=env, start_new_session=True)

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            _say(f"command still running {self.stop_timeout:g} s after SIGTERM: SIGKILL")
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        # What is left of its group (a rank that ignored SIGTERM) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    def run(self, restartable: bool) -> int:
        if restartable:
            signal.signal(RESTART_SIGNAL, self._on_restart)
        for signum in _FORWARDED:
            signal.signal(signum, self._forward)
        try:
            self.child = self._start()
        except OSError as exc:
            _say(f"cannot start {self.cmd[0]}: {exc}")
            return 127
        while True:
            code = self.child.poll()
            if self.pending_restart:
                self.pending_restart = False
                if self._wanted():
                    t0 = time.monotonic()
                    self._stop_child()
                    self.restarts += 1
                    why = f" for incident {self.incident}" if self.incident else ""
                    self.child = self._start()
                    took = time.monotonic() - t0
                    _say(f"restart {self.restarts}{why}: command stopped and started again in {took:.2f} s")
                continue
            if code is not None:
                return code if code >= 0 else 128 - code
            time.sleep(0.05)


def launch(cmd: list[str], *, stop_timeout: float = 60.0) -> int:
    launcher = Launcher(cmd, stop_timeout=stop_timeout, job=os.environ.get("SLURM_JOB_ID"))
    return launcher.run(launcher.tag_job())


def register(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training command so that fleetheal can restart it in place, inside its allocation",
        description="Run CMD; on fleetheal's restart order (SIGUSR2 to the batch step) stop it and run it "
        "again in the same allocation. Every other signal is passed on to CMD.",
        epilog="example (last line of the sbatch script): exec fleetheal launch -- srun python train.py",
    )
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds from SIGTERM to SIGKILL on a restart")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetheal.cli import UsageError

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("launch needs a command: fleetheal launch -- CMD [ARGS...]")
    if args.stop_timeout <= 0:
        raise UsageError("--stop-timeout must be > 0")
    return launch(cmd, stop_timeout=args.stop_timeout)
