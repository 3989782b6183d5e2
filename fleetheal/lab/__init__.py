"""The local lab: real daemons (Slurm, Prometheus, Alertmanager) on one machine for tests and demos.

`LabError` is the error of every part of `fleetheal lab`; `wait` is the lab's wait for a part to answer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fleetheal.wait import WaitTimeout, wait_until


class LabError(RuntimeError):
    """The lab could not do what was asked; the message says why and where the logs are."""


def wait(what: str, check: Callable[[], object], timeout: float, log: Path | None = None) -> None:
    """`wait_until` for the lab: LabError with the last lines of `log` when `what` does not come in time."""

    def tail() -> str:
        if log is None or not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-15:])

    try:
        wait_until(check, timeout, what, ignore=(OSError, ValueError), detail=tail)
    except WaitTimeout as e:
        raise LabError(str(e)) from e
