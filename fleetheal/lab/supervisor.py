"""The one base of the lab's process supervisors (Slurm cluster and federation, slurmrestd and the Slinky
operator, the Kubernetes control plane, the fake API server, Prometheus and Alertmanager, PostgreSQL, a
cluster's remediator) and the one way they start a daemon.

A supervisor's `start()` returns itself once what it started answers; `stop()` stops everything it started
(by PID or process group, a timeout, then SIGKILL: each supervisor keeps its own order and timeouts) and may
be called after a failed or partial start. As a context manager it starts on entry and stops on exit, also
when the block raised, and stops what a failed start left running.

`spawn()` starts a daemon in a session of its own (so it survives the caller's terminal and Ctrl-C, and
`fleetheal.procs.stop_pid` signals its whole process group), stdin from /dev/null, stdout and stderr
appended to its log file.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from fleetheal.httpjson import request_json
from fleetheal.wait import WaitTimeout, wait_until


class Supervisor(ABC):
    """Processes the lab starts and stops together (module docstring)."""

    @abstractmethod
    def start(self) -> Self:
        """Start the processes; return once they answer."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every process started; return once they are gone."""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            with contextlib.suppress(Exception):  # what failed to start is the error to report
                self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def spawn(
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` as a daemon of the lab (module docstring), its output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a daemon's log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_ready(
    what: str, url: str, running: Callable[[], bool], log: Path, *, timeout: float, error: type[Exception]
) -> None:
    """Until the controller's readiness endpoint `url` answers (a controller-runtime `/readyz`: "ok", no JSON);
    `error` with the last lines of its `log` when it exits first (`running()` false) or is not ready in `timeout`."""

    def ready() -> bool:
        if not running():
            raise error(f"{what} exited:\n{log_tail(log)}")
        with contextlib.suppress(ValueError):  # its answer, "ok", is no JSON
            request_json("GET", url, timeout=2)
        return True

    try:
        wait_until(ready, timeout, f"{what} to be ready", interval=0.2, ignore=(OSError,))
    except WaitTimeout as e:
        raise error(f"{what} not ready in {timeout:.0f} s:\n{log_tail(log)}") from e
