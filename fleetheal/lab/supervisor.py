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
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self


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
