"""Watching the demo's training job from outside: `Watcher` polls the lab and prints each milestone of
a scenario when first seen; `Outcome` is what one scenario did, as observed; `continuity` reads the job's
restarts from its own events.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetheal.lab import LabError
from fleetheal.lab.lab import Lab
from fleetheal.lab.train import read_events


def expand_nodelist(nodelist: str) -> list[str]:
    """`n[1-2,4]` / `n3` -> node names (the forms this lab's Slurm prints)."""
    m = re.fullmatch(r"([A-Za-z]+)\[([0-9,\-]+)\]", nodelist)
    if not m:
        return [n for n in nodelist.split(",") if n]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        out += [f"{m.group(1)}{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


@dataclass
class Outcome:
    """What one scenario did, as observed."""

    name: str
    fault: str
    node: str
    gpu: int | None
    action: str
    milestones: dict[str, float] = field(default_factory=dict)  # name -> seconds after injection
    details: dict[str, Any] = field(default_factory=dict)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = False
    error: str = ""


class Watcher:
    """Polls the lab and prints each milestone when first seen (live progress)."""

    def __init__(self, lab: Lab, job: str, run_dir: Path, out: Callable[[str], None]) -> None:
        self.lab = lab
        self.job = job
        self.run_dir = run_dir
        self.out = out
        self.cluster = lab.slurm()

    def job_info(self) -> dict[str, str]:
        return self.cluster.job(self.job)

    def job_nodes(self) -> list[str]:
        return expand_nodelist(self.job_info().get("NodeList", ""))

    def wait_running(self, timeout: float = 60) -> None:
        self.progress_wait("the job to run", lambda: self.job_info().get("JobState") == "RUNNING", timeout)

    def wait_steps(self, steps: int, timeout: float = 60) -> int:
        def check() -> int | None:
            ev = [e for e in read_events(self.run_dir) if e.get("event") == "progress"]
            return int(ev[-1]["step"]) if ev and int(ev[-1]["step"]) >= steps else None

        self.progress_wait(f"the job to pass step {steps}", check, timeout)
        return int(check() or 0)

    def progress_wait(self, what: str, check: Callable[[], object], timeout: float) -> None:
        t0 = time.monotonic()
        last = -1
        while True:
            with contextlib.suppress(Exception):
                if check():
                    return
            waited = time.monotonic() - t0
            if waited > timeout:
                raise LabError(f"timed out after {timeout:g}s waiting for {what}")
            if int(waited) // 5 != last and waited >= 5:
                last = int(waited) // 5
                self.out(f"      ... waiting for {what} ({waited:.0f}s)")
            time.sleep(0.25)

    def run(
        self,
        outcome: Outcome,
        checks: list[tuple[str, str, Callable[[], str | None]]],
        done: Callable[[], bool],
        timeout: float,
        cause: Callable[[], str] | None = None,
    ) -> None:
        """Inject the fault (or `cause()` it, which says how), then poll `checks` (key, label, probe -> detail
        or None) until `done()`."""
        t0 = outcome.details["injected_at"] = time.time()
        if cause is not None:
            self.out(f"  +  0.0s  {cause()}")
        else:
            ident = self.lab.inject(outcome.node, outcome.fault, outcome.gpu)
            where = f"GPU {outcome.gpu}" if outcome.gpu is not None else "node-wide"
            self.out(f"  +  0.0s  injected {outcome.fault} on {outcome.node} {where} ({ident})")

        def note(now: float) -> None:
            info = self.job_info()
            self.out(
                f"      ... {now:.0f}s: job {self.job} {info.get('JobState')} on {info.get('NodeList')}, "
                f"restarts {info.get('Restarts')}"
            )

        follow(outcome, t0, checks, done=done, timeout=timeout, out=self.out, note=note)


def follow(
    outcome: Outcome,
    t0: float,
    checks: list[tuple[str, str, Callable[[], str | None]]],
    *,
    done: Callable[[], bool],
    timeout: float,
    out: Callable[[str], None],
    note: Callable[[float], None] | None = None,
) -> None:
    """Poll `checks` (key, label, probe -> detail or None) every half second, printing each milestone with its
    time since `t0` when first seen, until `done()`; `note(seconds)` every 10 s; LabError naming what was not
    seen after `timeout` seconds."""
    last_note = time.monotonic()
    while True:
        now = time.time() - t0
        for key, label, probe in checks:
            if key in outcome.milestones:
                continue
            try:
                detail = probe()
            except Exception:
                detail = None
            if detail is not None:
                outcome.milestones[key] = now
                out(f"  + {now:5.1f}s  {label}: {detail}")
        try:
            is_done = done()
        except Exception:
            is_done = False
        if is_done:
            return
        if now > timeout:
            missing = [label for key, label, _ in checks if key not in outcome.milestones]
            raise LabError(f"{outcome.name}: timed out after {timeout:g}s; not seen: {', '.join(missing)}")
        if note is not None and time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            note(now)
        time.sleep(0.5)


def run_starts(run_dir: Path) -> list[dict[str, Any]]:
    """The training run's start events (the first start and every restart), oldest first."""
    return [e for e in read_events(run_dir) if e.get("event") == "start"]


def continuity(run_dir: Path) -> list[dict[str, Any]]:
    """For each restart: the last step reached before it, the step it resumed from, and steps lost."""
    out = []
    last_step = 0
    events = read_events(run_dir)
    for e in events:
        if e.get("event") == "start" and int(e.get("restart", 0)) > 0:
            resumed = int(e["resumed_from"])
            out.append({"restart": int(e["restart"]), "last_step": last_step, "resumed_from": resumed,
                        "lost": last_step - resumed, "incident": e.get("incident")})  # fmt: skip
        if "step" in e and e.get("event") in ("progress", "checkpoint", "signal", "end"):
            last_step = max(last_step, int(e["step"])) if e.get("event") != "start" else last_step
    return out


def last_progress_step(run_dir: Path) -> int:
    """The step of the training run's last progress event (0 before the first)."""
    ev = [e for e in read_events(run_dir) if e.get("event") == "progress"]
    return int(ev[-1]["step"]) if ev else 0
