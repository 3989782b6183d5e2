"""Per-phase recovery times of finished incidents (docs/metrics.md, `fleetheal_remediator_phase_seconds`).

The playbooks record each step they complete as a task named `Report | record step <step>` (the
`__step` of `playbooks/tasks/*.yml`) or `Report | record steps <step> <step> ...` (the rows a
fleetheal.cluster module returned, `playbooks/tasks/record.yml`); the remediator stores every task event
of a run on the incident's timeline. When an incident finishes, the time from the alert's start
(`startsAt`) to each recorded step is one observation, labelled with the step's phase and the fault
class. Phases are a fixed set, so the label stays low-cardinality; a step the set does not name is not
exported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram

from fleetheal.remediator.store import Event, Incident

#: playbook step -> phase of the incident timeline (DESIGN.md: detected, isolated, requeued, replaced,
#: revalidated, rejoined). "detected" is the alert reaching the remediator; "acting" its playbook starting.
STEP_PHASES = {
    "slurm_drain": "isolated",
    "k8s_isolate": "isolated_kubernetes",
    "k8s_cordon": "cordoned",
    "slurm_signal": "signalled",
    "slurm_requeue": "requeued",
    "standby_promote": "replaced",
    "standby_refill": "refill_requested",
    "gpu_reset": "reset",
    "revalidate": "revalidated",
    "slurm_resume": "rejoined",
}
PHASES = ("detected", "acting", *dict.fromkeys(STEP_PHASES.values()), "done")
_RECORD = re.compile(r"^Report \| record steps? ([a-z0-9_ ]+) \(")
_BUCKETS = (0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800, 3600)


def milestones(inc: Incident, events: Iterable[Event], done_at: float | None = None) -> dict[str, float]:
    """Seconds from the alert's start to the first time each phase was reached."""
    t0 = inc.starts_at_ts
    out: dict[str, float] = {"detected": max(0.0, inc.received_at - t0)}
    for ev in events:
        if ev.kind == "playbook_start":
            out.setdefault("acting", max(0.0, ev.ts - t0))
        elif ev.kind == "first_step":  # the first responder's steps: "<step> <outcome>: <detail>"
            name, _, rest = ev.detail.partition(" ")
            phase = STEP_PHASES.get(name) if rest.startswith("done") else None
            if phase:
                out.setdefault(phase, max(0.0, ev.ts - t0))
        elif ev.kind in ("task_ok", "task_changed"):
            m = _RECORD.match(ev.detail)
            for name in m.group(1).split() if m else ():
                phase = STEP_PHASES.get(name)
                if phase:
                    out.setdefault(phase, max(0.0, ev.ts - t0))
    if done_at is not None and inc.state == "done":
        out["done"] = max(0.0, done_at - t0)
    return out


class PhaseMetrics:
    """`fleetheal_remediator_phase_seconds{phase, class}`, observed once per finished incident."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "fleetheal_remediator_phase_seconds",
            "From the alert's start to each phase of a finished incident (detected, acting, isolated, "
            "requeued, replaced, revalidated, rejoined, done).",
            ["phase", "class"],
            buckets=_BUCKETS,
            registry=registry,
        )

    def observe(self, inc: Incident, events: Iterable[Event], done_at: float) -> dict[str, float]:
        found = milestones(inc, events, done_at)
        for phase, seconds in found.items():
            self.seconds.labels(phase, inc.fault_class).observe(seconds)
        return found
