"""The lab's supervisor base (fleetheal.lab.supervisor): a `with` block stops what it started, also when the
start itself failed half-way, and the start's error is the one reported."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Self

import pytest

from fleetheal.lab.supervisor import Supervisor, spawn
from fleetheal.procs import alive, stop_pid


class _HalfStarted(Supervisor):
    """Starts one real process, then fails as a second daemon would that never answers."""

    def __init__(self, log: Path, fail: bool) -> None:
        self.log, self.fail, self.pid = log, fail, 0
        self.stopped = 0

    def start(self) -> Self:
        self.pid = spawn([sys.executable, "-c", "import time; time.sleep(60)"], self.log).pid
        if self.fail:
            raise RuntimeError("the second daemon never answered")
        return self

    def stop(self) -> None:
        self.stopped += 1
        if self.pid:
            stop_pid(self.pid, timeout=5)  # a zombie counts as gone for `alive`


def test_a_failed_start_stops_what_it_started_and_reports_the_start_error(tmp_path: Path) -> None:
    sup = _HalfStarted(tmp_path / "log", fail=True)
    with pytest.raises(RuntimeError, match="never answered"), sup:
        pytest.fail("the block must not run when the start failed")
    assert sup.stopped == 1 and sup.pid and not alive(sup.pid)


def test_a_block_that_raises_still_stops_the_processes(tmp_path: Path) -> None:
    sup = _HalfStarted(tmp_path / "log", fail=False)
    with pytest.raises(KeyError), sup:
        assert alive(sup.pid)
        raise KeyError("the test's own failure")
    assert sup.stopped == 1 and not alive(sup.pid)
