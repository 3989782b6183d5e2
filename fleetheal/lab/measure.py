"""ETTR measured on a lab training run (`fleetheal ettr measure RUN_DIR...`, docs/ettr.md).

From the training job's events (`fleetheal.lab.train`, events.jsonl) and the remediator's incidents; as
Prometheus gauges for node-exporter's textfile collector (docs/metrics.md, section ETTR) with `--textfile`.
The simulator (fleetheal.ettr) sits below the lab, so the lab adds this subcommand to `fleetheal ettr`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetheal.errors import UsageError
from fleetheal.lab.train import EVENTS, ettr, read_events

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

METRIC_RATIO = "fleetheal_ettr_effective_training_time_ratio"
METRIC_SECONDS = "fleetheal_ettr_job_seconds"
METRIC_RESTARTS = "fleetheal_ettr_job_restarts"


@dataclass
class Measured:
    """A training run's ETTR from its own events (and the incidents that interrupted it)."""

    allocated_s: float
    productive_s: float
    lost_work_s: float
    down_s: float
    restarts: int
    incidents: list[dict[str, float]]

    @property
    def ettr(self) -> float:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ettr"] = self.ettr
        return d


def measure(
    events: Sequence[dict[str, Any]], now: float | None = None, incidents: Sequence[dict[str, Any]] = ()
) -> Measured | None:
    """ETTR of a lab training run from the job's events (`fleetheal.lab.train`, events.jsonl).

    Allocated time runs from the first start to `now` (or the last event). Productive time is the
    full-pace time of the steps that were kept (the final step count minus the step the first start
    resumed from, times the step time); steps computed and then thrown away by a restart from an older
    checkpoint are lost work; the rest (pending, requeue, restart, checkpoint writes, the grace wait) is
    down time. Each incident from the remediator (its timeline) adds per-phase offsets from the fault.
    """
    starts = [e for e in events if e.get("event") == "start"]
    stepped = [e for e in events if "step" in e and e.get("event") in ("checkpoint", "signal", "end", "progress")]
    ratio = ettr(list(events), now)  # the lab's own arithmetic: kept steps at full pace / wall
    if not starts or not stepped or ratio is None:
        return None
    step_time = float(starts[0]["step_time"])
    end = float(now if now is not None else stepped[-1]["time"])
    allocated = end - float(starts[0]["time"])
    productive = ratio * allocated
    lost_steps = restarts = 0
    high = int(starts[0].get("resumed_from", 0))
    for e in events[events.index(starts[0]) + 1 :]:
        if e.get("event") == "start":  # a restart: steps beyond the checkpoint it resumed from are redone
            restarts += 1
            lost_steps += max(0, high - int(e.get("resumed_from", 0)))
            high = int(e.get("resumed_from", 0))
        elif "step" in e and e.get("event") in ("checkpoint", "signal", "end", "progress"):
            high = max(high, int(e["step"]))
    lost = min(allocated - productive, lost_steps * step_time)
    timelines = [incident_phases(inc) for inc in incidents]
    return Measured(allocated, productive, lost, allocated - productive - lost, restarts, timelines)


def incident_phases(inc: dict[str, Any]) -> dict[str, float]:
    """Per-phase seconds of a remediator incident as `fleetheal incidents show ID --json` reports them
    (detect, classify, gate, act, total; phases that have not happened are left out)."""
    return {k: float(v) for k, v in (inc.get("phases") or {}).items() if isinstance(v, (int, float))}


def registry(measured: Mapping[str, Measured]) -> CollectorRegistry:
    """The ETTR gauges (docs/metrics.md, section ETTR), one series set per job, in a registry of their own."""
    from prometheus_client import CollectorRegistry, Gauge  # not imported to build the command line

    reg = CollectorRegistry()
    ratio = Gauge(
        METRIC_RATIO,
        "Productive (kept, full-pace) training time over allocated time, per job.",
        ["job"],
        registry=reg,
    )
    seconds = Gauge(
        METRIC_SECONDS,
        "Allocated time of a job by category: allocated, productive, lost_work, down.",
        ["job", "category"],
        registry=reg,
    )
    restarts = Gauge(
        METRIC_RESTARTS, "Restarts of a job's training process (requeues that ran again).", ["job"], registry=reg
    )
    for job, m in measured.items():
        ratio.labels(job).set(m.ettr)
        for category, value in (
            ("allocated", m.allocated_s),
            ("productive", m.productive_s),
            ("lost_work", m.lost_work_s),
            ("down", m.down_s),
        ):
            seconds.labels(job, category).set(value)
        restarts.labels(job).set(m.restarts)
    return reg


def register(esub: argparse._SubParsersAction[Any]) -> None:
    """Add `measure` to the `ettr` command (the subparsers fleetheal.ettr.cli.register returns)."""
    m = esub.add_parser(
        "measure",
        help="ETTR of a training run from its events (the lab's jobs/<name>/events.jsonl)",
        description="Measured ETTR of a run: kept steps at full pace over allocated time (docs/ettr.md).",
    )
    m.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help=f"a run directory with {EVENTS}")
    m.add_argument("--now", action="store_true", help="count allocated time up to now (a run still going)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.add_argument(
        "--textfile", type=Path, metavar="FILE.prom", help="write Prometheus gauges for a textfile collector"
    )
    m.set_defaults(func=cmd_measure)


def cmd_measure(args: argparse.Namespace) -> int:
    found: dict[str, Measured] = {}
    for d in args.run_dirs:
        if not (d / EVENTS).is_file():
            raise UsageError(f"{d}: no {EVENTS} (not a training run directory)")
        m = measure(read_events(d), time.time() if args.now else None)
        if m is None:
            raise UsageError(f"{d}: the run has not started or reported progress yet")
        found[d.name] = m
    if args.textfile:
        from prometheus_client import write_to_textfile

        write_to_textfile(str(args.textfile), registry(found))  # atomic: a temporary file, then rename
    if args.json:
        print(json.dumps({k: v.as_dict() for k, v in found.items()}, indent=2))
        return 0
    for name, m in found.items():
        print(f"{name}: ETTR {m.ettr:.3f} over {m.allocated_s:.0f} s (productive {m.productive_s:.1f} s, "
              f"lost work {m.lost_work_s:.1f} s, down {m.down_s:.1f} s, {m.restarts} restarts)")  # fmt: skip
    return 0
