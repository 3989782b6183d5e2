"""fleetheal_remediator_phase_seconds: per-phase recovery times from an incident's stored timeline."""

from __future__ import annotations

import re
from pathlib import Path

from fleetheal import taxonomy
from fleetheal.remediator.alerts import parse_time, validate_alert
from fleetheal.remediator.metrics import Metrics
from fleetheal.remediator.phases import PHASES, STEP_PHASES, milestones
from fleetheal.remediator.runner import _convert_event
from fleetheal.remediator.store import Store
from tests.remediator.conftest import alert

REPO = Path(__file__).resolve().parents[2]
TAX = taxonomy.load()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _record(store: Store, iid: int, kind: str, data: dict[str, object]) -> None:
    """Store what the real runner makes of an ansible-runner event."""
    ev = _convert_event({"event": kind, "event_data": data})
    assert ev is not None
    store.add_event(iid, ev.kind, ev.detail)


def test_playbooks_record_every_mapped_step() -> None:
    """The step names mapped to phases are the ones the playbooks record, through the task phases parses,
    themselves or from the fleetheal.cluster modules' rows (the package fleetheal/steps/, also the first
    responder's)."""
    text = "\n".join(p.read_text() for p in (REPO / "playbooks").rglob("*.yml"))
    recorded = set(re.findall(r"__step: ([a-z0-9_]+)", text))
    steps = "\n".join(p.read_text() for p in sorted((REPO / "fleetheal" / "steps").glob("*.py")))
    recorded |= set(re.findall(r'StepResult\(\s*"([a-z0-9_]+)"', steps))
    if '__step: "k8s_{{ __k8s_op }}"' in text:  # tasks/k8s_node.yml: one step per operation the playbooks ask for
        recorded |= {f"k8s_{op}" for op in re.findall(r"__k8s_op: ([a-z]+)", text)}
    assert set(STEP_PHASES) <= recorded, set(STEP_PHASES) - recorded
    assert "name: Report | record step {{ __step }}" in (REPO / "playbooks" / "tasks" / "step.yml").read_text()


def test_phases_of_a_relocation(cfg) -> None:  # type: ignore[no-untyped-def]
    starts = "2026-11-29T17:37:02Z"
    clock = Clock(0.0)
    store = Store(cfg.store.path, clock=clock)
    when = parse_time(starts)
    assert when is not None
    clock.t = when.timestamp() + 2.0  # 2 s after startsAt: the alert arrives
    (iid,) = store.ingest([validate_alert(alert(starts_at=starts), cfg, TAX)]).created
    inc = store.get(iid)
    assert inc is not None
    t0 = inc.starts_at_ts
    assert clock.t - t0 == 2.0
    plan = [
        (3.0, "playbook_on_start", {"playbook": "isolate_and_relocate.yml"}),
        (5.0, "runner_on_ok", {"task": "Report | record step slurm_drain", "host": "localhost", "res": {}}),
        (5.5, "runner_on_ok", {"task": "Drain | record the drain", "host": "localhost", "res": {}}),
        # A module's rows are recorded together (playbooks/tasks/record.yml).
        (13.0, "runner_on_ok", {"task": "Report | record steps slurm_signal slurm_requeue", "host": "n2",
                                "res": {}}),
        (20.0, "runner_on_ok", {"task": "Report | record step k8s_isolate", "host": "localhost", "res": {}}),
        (24.0, "runner_on_ok", {"task": "Report | record step standby_promote", "host": "localhost",
                                "res": {"changed": True}}),
        (30.0, "runner_on_ok", {"task": "Report | record step slurm_requeue", "host": "localhost", "res": {}}),
        (31.0, "runner_on_ok", {"task": "Report | record step not_a_phase", "host": "localhost", "res": {}}),
    ]  # fmt: skip
    for offset, kind, data in plan:
        clock.t = t0 + offset
        _record(store, iid, kind, data)
    clock.t = t0 + 32.0
    store.set_state(iid, "done")
    inc = store.get(iid)
    assert inc is not None
    found = milestones(inc, store.events(iid), clock.t)
    assert found == {
        "detected": 2.0,
        "acting": 3.0,
        "isolated": 5.0,
        "signalled": 13.0,
        "requeued": 13.0,  # the first time
        "isolated_kubernetes": 20.0,
        "replaced": 24.0,
        "done": 32.0,
    }
    assert set(found) <= set(PHASES)
    metrics = Metrics(store)
    metrics.incident_finished(inc, clock.t)
    text = metrics.render().decode()
    cls = inc.fault_class
    for phase, seconds in found.items():
        assert f'fleetheal_remediator_phase_seconds_sum{{class="{cls}",phase="{phase}"}} {seconds}' in text
        assert f'fleetheal_remediator_phase_seconds_count{{class="{cls}",phase="{phase}"}} 1.0' in text
    assert 'phase="not_a_phase"' not in text
    store.close()


def test_a_failed_incident_has_no_done_phase(cfg) -> None:  # type: ignore[no-untyped-def]
    clock = Clock(1_795_887_500.0)
    store = Store(cfg.store.path, clock=clock)
    (iid,) = store.ingest([validate_alert(alert(starts_at="2026-11-29T17:38:00Z"), cfg, TAX)]).created
    store.set_state(iid, "failed")
    inc = store.get(iid)
    assert inc is not None
    assert "done" not in milestones(inc, store.events(iid), clock.t)
    store.close()
