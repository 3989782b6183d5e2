"""Classification of GPU samples and the debounced health state (pure logic)."""

from __future__ import annotations

import pytest

from fleetheal.agent.backends import REASON_HW_POWER_BRAKE_SLOWDOWN, GpuSample
from fleetheal.agent.health import (
    DEGRADED,
    HEALTHY,
    UNHEALTHY,
    Detection,
    HealthConfig,
    HealthTracker,
    Thresholds,
    classify_sample,
)
from fleetheal.taxonomy import load

HEALTHY_VALUES = {
    "temperature_c": 45.0,
    "temperature_slowdown_c": 87.0,
    "temperature_shutdown_c": 92.0,
    "power_w": 300.0,
    "power_limit_w": 700.0,
    "clock_event_reasons": 0.0,
    "ecc_uncorrected_volatile": 0.0,
    "ecc_uncorrected_aggregate": 0.0,
    "remapped_rows_pending": 0.0,
    "remapped_rows_failure": 0.0,
    "retired_pages_pending": 0.0,
    "nvlink_crc_flit_errors": 0.0,
    "nvlink_crc_data_errors": 0.0,
    "nvlink_replay_errors": 0.0,
    "nvlink_recovery_errors": 0.0,
    "pcie_replays": 0.0,
    "recovery_action": 0.0,
}


def _ids(sample, previous=None):
    return sorted(d.fault_id for d in classify_sample(sample, previous, Thresholds(), 1.0, "nvml"))


def _s(**changes):
    return GpuSample(0, {**HEALTHY_VALUES, **changes})


def test_a_healthy_sample_has_no_fault():
    assert _ids(_s(), _s()) == []


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"ecc_uncorrected_volatile": 1.0}, "ecc-dbe-volatile"),
        ({"remapped_rows_failure": 1.0}, "row-remap-failure"),
        ({"remapped_rows_pending": 1.0}, "row-remap-pending"),
        ({"retired_pages_pending": 1.0}, "retired-pages-pending"),
        ({"temperature_c": 88.0}, "thermal-slowdown"),
        ({"temperature_c": 93.0}, "thermal-shutdown"),
        ({"clock_event_reasons": float(REASON_HW_POWER_BRAKE_SLOWDOWN)}, "power-brake"),
        ({"power_w": 700.0}, "power-cap-violation"),
        ({"recovery_action": 2.0}, "xid-154-node-reboot"),
    ],
)
def test_conditions(changes, fault):
    (det,) = classify_sample(_s(**changes), None, Thresholds(), 1.0, "nvml")
    assert det.fault_id == fault
    assert det.condition
    assert det.gpu == "0"


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"ecc_uncorrected_aggregate": 1.0}, "ecc-dbe-aggregate"),
        ({"nvlink_crc_flit_errors": 60.0, "nvlink_crc_data_errors": 40.0}, "nvlink-crc-errors"),
        ({"nvlink_replay_errors": 1.0}, "nvlink-replay-errors"),
        ({"nvlink_recovery_errors": 1.0}, "nvlink-recovery-errors"),
        ({"pcie_replays": 1.0}, "pcie-replay-growth"),  # 1 per 1 s poll = 60/min
    ],
)
def test_growth_needs_the_previous_poll(changes, fault):
    assert _ids(_s(**changes), None) == []
    (det,) = classify_sample(_s(**changes), _s(), Thresholds(), 1.0, "nvml")
    assert det.fault_id == fault
    assert not det.condition


def test_growth_below_thresholds_is_quiet():
    assert _ids(_s(nvlink_crc_flit_errors=99.0), _s()) == []
    assert _ids(_s(pcie_replays=1.0), _s()) == ["pcie-replay-growth"]
    quiet = classify_sample(_s(pcie_replays=1.0), _s(), Thresholds(pcie_replays_per_minute=61), 1.0, "nvml")
    assert quiet == []


def test_missing_counters_are_not_faults():
    assert _ids(GpuSample(0, {"temperature_c": 50.0}), GpuSample(0, {})) == []


@pytest.fixture
def tracker():
    return HealthTracker(load(), HealthConfig(debounce_polls=2, clear_polls=2, event_hold_s=100, dedup_s=10))


def test_events_raise_at_once_and_fold_repeats(tracker):
    det = Detection("xid-79", "3", "kernel_log", "fallen off")
    (ch,) = tracker.event(det, 0.0)
    assert (ch.kind, ch.fault.fault.id, ch.fault.gpu) == ("raised", "xid-79", "3")
    assert tracker.event(det, 5.0) == []  # inside dedup window
    (ch,) = tracker.event(det, 16.0)
    assert ch.kind == "repeated"
    assert ch.fault.occurrences == 2
    assert tracker.expire(100.0) == []
    (ch,) = tracker.expire(116.0)
    assert ch.kind == "cleared"
    assert tracker.active() == []


def test_two_jobs_printing_one_fault_on_one_node_are_two_faults(tracker):
    """A job-scoped fault is the job's: a second job's NCCL timeout on the same node is raised for that job,
    not folded into the first's (whose remediation would act on the wrong job, or not at all)."""
    first = Detection("nccl-timeout", "node", "job_output", "job 11 printed it", job="11")
    second = Detection("nccl-timeout", "node", "job_output", "job 12 printed it", job="12")
    assert [c.kind for c in tracker.event(first, 0.0)] == ["raised"]
    (ch,) = tracker.event(second, 1.0)
    assert (ch.kind, ch.fault.job) == ("raised", "12")
    assert sorted(a.job for a in tracker.active()) == ["11", "12"]
    assert tracker.event(first, 2.0) == []  # the first job's own repeat still folds


def test_conditions_are_debounced_and_cleared(tracker):
    det = Detection("row-remap-pending", "1", "nvml", "pending", condition=True)
    assert tracker.poll("nvml", [det], 0.0) == []
    (ch,) = tracker.poll("nvml", [det], 1.0)
    assert ch.kind == "raised"
    assert tracker.poll("nvml", [], 2.0) == []  # one clean poll is not enough
    assert tracker.poll("nvml", [det], 3.0) == []  # back again: still active, no new change
    assert tracker.poll("nvml", [], 4.0) == []
    (ch,) = tracker.poll("nvml", [], 5.0)
    assert ch.kind == "cleared"


def test_a_flapping_condition_never_raises(tracker):
    det = Detection("thermal-slowdown", "0", "nvml", "hot", condition=True)
    for t in range(10):
        assert tracker.poll("nvml", [det] if t % 2 == 0 else [], float(t)) == []


def test_other_sources_do_not_clear_a_condition(tracker):
    det = Detection("job-hang", "node", "training", "hang", condition=True)
    tracker.poll("training", [det], 0.0, debounce=1)
    for t in range(5):
        tracker.poll("nvml", [], float(t))
    assert [a.fault.id for a in tracker.active()] == ["job-hang"]


def test_health_levels(tracker):
    assert tracker.health() == HEALTHY
    tracker.event(Detection("xid-31", "2", "nvml"), 0.0)  # REFUSE_AND_REPORT: not destructive
    assert tracker.health("2") == DEGRADED
    assert tracker.health() == DEGRADED
    tracker.event(Detection("xid-79", "3", "nvml"), 0.0)  # ISOLATE_AND_RELOCATE
    assert tracker.health("3") == UNHEALTHY
    assert tracker.health("0") == HEALTHY
    assert tracker.health() == UNHEALTHY


def test_unknown_fault_ids_are_the_safe_unknown(tracker):
    (ch,) = tracker.event(Detection("no-such-fault", "node", "kernel_log"), 0.0)
    assert ch.fault.fault.id == "unknown"
    assert ch.fault.fault.action == "OBSERVE"
