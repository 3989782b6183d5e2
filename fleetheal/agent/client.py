"""Report training progress to the node's fleetheal agent. Standard library only; never raises.

Copy this file next to a training script or import it from the fleetheal package::

    from fleetheal.agent.client import TrainingReporter

    reporter = TrainingReporter()              # job, rank, GPU from the Slurm/torchrun environment
    for step in range(start, steps):
        t0 = time.monotonic()
        loss = train_step()
        reporter.report(step, step_time=time.monotonic() - t0, loss=float(loss))
    reporter.end()

Each report is one small JSON datagram on the agent's Unix socket (`$FLEETHEAL_TRAINING_SOCKET`, default
`/run/fleetheal/training.sock`); see `fleetheal.agent.training` for the protocol. Sending never raises
into the training loop and waits at most SEND_WAIT_S (the agent's queue full): when the agent is not
running, reports are dropped and counted in `dropped`. Reports are sent at most every `min_interval_s`
(except NaN/Inf losses, which always go), so calling `report` every step costs a clock read.
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import time
from collections.abc import Mapping

DEFAULT_SOCKET = "/run/fleetheal/training.sock"
#: Longest line of the job's output one report carries; `line` cuts a longer one.
MAX_OUTPUT_LINE = 1024
#: Longest a report waits for room in the agent's queue (full while a local user floods it).
SEND_WAIT_S = 0.1


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class TrainingReporter:
    """Sends step, step time and loss of one rank to the local agent."""

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        *,
        gpu: int | None = None,
        socket_path: str | None = None,
        min_interval_s: float = 1.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.job = job or env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local"
        found_rank = _env_int(env, "RANK", "SLURM_PROCID")
        self.rank = rank if rank is not None else (found_rank or 0)
        self.gpu = gpu if gpu is not None else self._physical_gpu(env)
        self.socket_path = socket_path or env.get("FLEETHEAL_TRAINING_SOCKET") or DEFAULT_SOCKET
        self.min_interval_s = min_interval_s
        self.sent = 0
        self.dropped = 0
        self._last_sent = -math.inf
        self._sock: socket.socket | None = None
        self._connected = False
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        except OSError:
            self._sock = None

    @staticmethod
    def _physical_gpu(env: Mapping[str, str]) -> int | None:
        """The node's GPU index this rank uses: CUDA_VISIBLE_DEVICES[LOCAL_RANK] when numeric."""
        local = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
        visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if local is None:
            local = 0
        if visible:
            return int(visible[local]) if local < len(visible) and visible[local].isdigit() else None
        return local if "LOCAL_RANK" in env or "SLURM_LOCALID" in env else None

    def report(self, step: int, step_time: float | None = None, loss: float | None = None) -> bool:
        """Send one report (rate-limited); True when it was sent. Never raises."""
        try:
            now = time.monotonic()
            bad_loss = loss is not None and not math.isfinite(loss)
            if not bad_loss and now - self._last_sent < self.min_interval_s:
                return False
            doc: dict[str, object] = {"v": 1, "job": self.job, "rank": self.rank, "step": int(step)}
            if step_time is not None:
                doc["step_time"] = float(step_time)
            if loss is not None:
                doc["loss"] = float(loss) if math.isfinite(loss) else str(float(loss))
            if self.gpu is not None:
                doc["gpu"] = self.gpu
            if self._send(doc):
                self._last_sent = now
                return True
        except Exception:
            self.dropped += 1
        return False

    def line(self, text: str, run: int | None = None, requeues: int | None = None) -> bool:
        """Send one line of the job's own output (cut to MAX_OUTPUT_LINE characters) for the agent to classify;
        `run`: how many times the job's command was restarted in its allocation before it printed it;
        `requeues`: Slurm's restart count of the job (SLURM_RESTART_COUNT). Not rate-limited here: the caller
        picks the lines (`fleetheal launch` sends those its rules flag). True when sent; never raises."""
        try:
            doc: dict[str, object] = {"v": 1, "job": self.job, "event": "line", "line": text[:MAX_OUTPUT_LINE]}
            if run is not None:
                doc["run"] = int(run)
            if requeues is not None:
                doc["requeues"] = int(requeues)
            return self._send(doc)
        except Exception:
            self.dropped += 1
            return False

    def end(self) -> None:
        """Tell the agent this rank finished (so silence is not a hang)."""
        try:
            self._send({"v": 1, "job": self.job, "rank": self.rank, "step": 0, "event": "end"})
        except Exception:
            self.dropped += 1

    def _send(self, doc: dict[str, object]) -> bool:
        """Send one datagram. The socket is connected to the agent's, so that when the agent's queue is full (a
        local user flooding it) the report waits up to SEND_WAIT_S for room, woken as soon as the agent reads,
        instead of being dropped at once; a training step never waits longer."""
        if self._sock is None:
            self.dropped += 1
            return False
        data = json.dumps(doc, separators=(",", ":")).encode()
        deadline = None
        while True:
            try:
                if not self._connected:  # (re)connecting a datagram socket is allowed: no socket is replaced
                    self._sock.connect(self.socket_path)
                    self._connected = True
                self._sock.send(data)
            except BlockingIOError:
                now = time.monotonic()
                deadline = now + SEND_WAIT_S if deadline is None else deadline
                if now < deadline and self._wait_for_room(deadline - now):
                    continue
            except OSError:  # agent not running, socket missing or replaced (a restart): reconnect next time
                self._connected = False
            else:
                self.sent += 1
                return True
            self.dropped += 1
            return False

    def _wait_for_room(self, timeout_s: float) -> bool:
        """True when the agent's queue has room again (the poll wakes when the agent reads a report)."""
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLOUT)
        return bool(poller.poll(max(1, int(timeout_s * 1000))))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._connected = False

    def __enter__(self) -> TrainingReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
        self.close()
