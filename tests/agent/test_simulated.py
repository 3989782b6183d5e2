"""SimulatedGpuBackend (a test double of NvmlBackend) and its injection file format."""

from __future__ import annotations

import json

import pytest

from fleetheal.agent.backends import REASON_HW_THERMAL_SLOWDOWN, GpuLost
from fleetheal.agent.simulated import SimulatedGpuBackend, clear, inject, pci_bus_id, read_injections


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sim(tmp_path):
    clock = Clock()
    b = SimulatedGpuBackend(tmp_path / "sim.json", gpus=8, clock=clock, poll_slice_s=0.005)
    b.open()
    b.clock_obj = clock
    return b


def test_plausible_healthy_gpus(sim):
    infos = sim.gpus()
    assert [g.index for g in infos] == list(range(8))
    assert infos[3].pci_bus_id == pci_bus_id(3) == "00000000:1B:00.0"
    for i in range(8):
        v = sim.sample(i).values
        assert 30 <= v["temperature_c"] < v["temperature_slowdown_c"] < v["temperature_shutdown_c"]
        assert 0 < v["power_w"] < v["power_limit_w"]
        assert v["ecc_uncorrected_volatile"] == 0
    assert sim.wait_events(0) == []


def test_xid_79_loses_the_gpu_and_emits_one_xid_event(sim):
    inj = inject(sim.state_file, "xid-79", gpu=3, at=sim.clock_obj.t)
    (ev,) = sim.wait_events(0.2)
    assert (ev.gpu, ev.xid, ev.fault_id) == (3, 79, None)
    assert inj.id in ev.detail
    assert sim.wait_events(0.02) == []  # once per injection
    with pytest.raises(GpuLost):
        sim.sample(3)
    sim.sample(2)  # the others still answer
    assert clear(sim.state_file, "xid-79", gpu=3) == 1
    assert sim.sample(3).values["temperature_c"] > 0


def test_injection_at_a_chosen_time(sim):
    inject(sim.state_file, "thermal-slowdown", gpu=0, at=sim.clock_obj.t + 30)
    assert sim.sample(0).values["clock_event_reasons"] == 0
    sim.clock_obj.t += 31
    v = sim.sample(0).values
    assert v["temperature_c"] > v["temperature_slowdown_c"]
    assert int(v["clock_event_reasons"]) & REASON_HW_THERMAL_SLOWDOWN


def test_counter_effects_and_rates(sim):
    t0 = sim.clock_obj.t
    inject(sim.state_file, "ecc-dbe-volatile", gpu=1, at=t0)
    inject(sim.state_file, "nvlink-recovery-errors", gpu=2, at=t0)
    inject(sim.state_file, "row-remap-pending", gpu=4, at=t0)
    assert sim.sample(1).values["ecc_uncorrected_volatile"] == 1
    assert sim.sample(4).values["remapped_rows_pending"] == 1
    sim.clock_obj.t = t0 + 5
    assert sim.sample(2).values["nvlink_recovery_errors"] == 5
    assert sim.wait_events(0) == []  # state faults show as counters, not events


def test_node_wide_and_non_nvml_faults_are_events(sim):
    inject(sim.state_file, "nic-down", at=sim.clock_obj.t)
    (ev,) = sim.wait_events(0.2)
    assert (ev.gpu, ev.fault_id) == (None, "nic-down")


def test_gpu_count_low_removes_a_gpu(sim):
    inject(sim.state_file, "gpu-count-low", gpu=7, at=sim.clock_obj.t)
    assert len(sim.gpus()) == 7


def test_a_fresh_process_sees_active_injections(sim, tmp_path):
    """`fleetheal agent check` is a new process: active Xid injections are pending events there."""
    inject(sim.state_file, "xid-31", gpu=1, at=sim.clock_obj.t)
    other = SimulatedGpuBackend(sim.state_file, gpus=8, clock=sim.clock_obj)
    other.open()
    (ev,) = other.wait_events(0)
    assert ev.xid == 31


def test_file_format_and_validation(tmp_path):
    path = tmp_path / "s.json"
    inject(path, "xid-48", gpu=0, at=5.0)
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    (entry,) = doc["injections"]
    assert {k: entry[k] for k in ("fault", "gpu", "at")} == {"fault": "xid-48", "gpu": 0, "at": 5.0}
    assert entry["id"].startswith("inj-")
    with pytest.raises(ValueError, match="unknown fault id 'xid-9999'"):
        inject(path, "xid-9999", gpu=0)
    with pytest.raises(ValueError, match="gpu must be >= 0"):
        inject(path, "xid-48", gpu=-1)
    path.write_text('{"version": 2, "injections": []}')
    with pytest.raises(ValueError, match="malformed simulated-GPU state file"):
        read_injections(path)
    assert read_injections(tmp_path / "missing.json") == []


def test_clear_matches_fault_and_gpu(tmp_path):
    path = tmp_path / "s.json"
    for gpu in (0, 1):
        inject(path, "xid-79", gpu=gpu)
        inject(path, "xid-31", gpu=gpu)
    assert clear(path, gpu=0) == 2
    assert clear(path, "xid-31") == 1
    assert [(i.fault, i.gpu) for i in read_injections(path)] == [("xid-79", 1)]
    assert clear(path) == 1
