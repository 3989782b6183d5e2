"""Waiting for a condition: the one poll loop that the lab, the remediator's clean-up, tests and
benchmarks use to wait for a daemon, a port, a state or a process to go."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """`wait_until` gave up; the message names what was awaited and, where known, what was seen last."""


def wait_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    ignore: tuple[type[BaseException], ...] = (),
    detail: Callable[[], str] | None = None,
) -> T:
    """Call `check` every `interval` seconds until it returns a true value, and return that value.

    An exception of a type in `ignore` counts as "not yet" (a daemon still starting refuses connections).
    After `timeout` seconds raise WaitTimeout "timed out after Ns waiting for <what>", followed by the
    last ignored error and by `detail()` (a log tail, the states seen last) where there are any.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
        except ignore as exc:
            last_error = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g}s waiting for {what}"
            if last_error is not None:
                message += f" (last error: {last_error})"
            extra = detail() if detail is not None else ""
            raise WaitTimeout(f"{message}\n{extra}" if extra else message)
        time.sleep(interval)
