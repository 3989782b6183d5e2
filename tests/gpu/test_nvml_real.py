"""NvmlBackend against a real NVIDIA driver: enumerate GPUs, read every counter the agent uses, register
for Xid events. Needs a GPU; without one every test is skipped with a message that says so.

Run on a GPU machine: `python -m pytest tests/gpu -m gpu -s -rA` (-s shows what each GPU reported).
"""

from __future__ import annotations

import time

import pytest

from fleetheal.agent.backends import COUNTERS, NvmlBackend
from fleetheal.agent.check import OK, UNHEALTHY_EXIT, run_check
from fleetheal.agent.config import load_config
from fleetheal.agent.service import Agent

pytestmark = pytest.mark.gpu

#: Counters every NVIDIA datacenter GPU the agent targets (Ampere and later) answers.
REQUIRED = (
    "temperature_c",
    "temperature_slowdown_c",
    "temperature_shutdown_c",
    "power_w",
    "power_limit_w",
    "clock_event_reasons",
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "remapped_rows_pending",
    "remapped_rows_failure",
    "pcie_replays",
)


@pytest.fixture(scope="module")
def backend():
    try:
        import pynvml
    except ImportError as exc:
        pytest.skip(f"SKIPPED: no GPU test possible, nvidia-ml-py is not installed ({exc})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"SKIPPED: no NVIDIA GPU or driver on this machine (NVML: {exc}); run tests/gpu on a GPU node")
    pynvml.nvmlShutdown()
    b = NvmlBackend()
    b.open()
    yield b
    b.close()


def test_enumerates_gpus(backend):
    gpus = backend.gpus()
    assert gpus, "NVML initialised but reports no GPU"
    for g in gpus:
        print(f"GPU {g.index}: {g.name} {g.uuid} pci={g.pci_bus_id}")
        assert g.uuid.startswith("GPU-")
        assert len(g.pci_bus_id) == len("00000000:00:00.0")


def test_reads_every_counter(backend):
    for g in backend.gpus():
        started = time.perf_counter()
        s = backend.sample(g.index)
        took = time.perf_counter() - started
        print(f"GPU {g.index} sample in {took * 1000:.1f} ms")
        for name in COUNTERS:
            print(f"  {name:28s} {s.values.get(name, 'not supported')}")
        for name, err in s.errors.items():
            print(f"  ERROR {name}: {err}")
        assert s.errors == {}, f"counter reads failed: {s.errors}"
        missing = [n for n in REQUIRED if n not in s.values]
        assert not missing, f"GPU {g.index} ({g.name}) did not answer {missing}"
        assert 0 < s.values["temperature_c"] < s.values["temperature_shutdown_c"]
        assert 0 < s.values["power_w"] <= s.values["power_limit_w"] * 1.5


def test_registers_for_xid_events(backend):
    assert backend.events_registered() == len(backend.gpus())
    started = time.monotonic()
    events = backend.wait_events(0.5)  # a healthy GPU: none, after the timeout
    print(f"event wait returned {events} after {time.monotonic() - started:.2f} s")
    assert all(e.gpu is not None for e in events)


def test_the_agent_polls_a_real_gpu_and_check_answers(backend, tmp_path, capsys):
    env = {
        "FLEETHEAL_AGENT_NODE": "gpu-test",
        "FLEETHEAL_AGENT_MODE": "observe",
        "FLEETHEAL_AGENT_METRICS__PORT": "0",
        "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
        "FLEETHEAL_AGENT_TRAINING__ENABLED": "false",
        "FLEETHEAL_AGENT_FASTPATH__SLURM__ENABLED": "false",
        "FLEETHEAL_AGENT_HEALTH__DEBOUNCE_POLLS": "1",
    }
    cfg = load_config(None, env=env)
    agent = Agent(cfg, NvmlBackend())
    agent.open_backend()
    started = time.perf_counter()
    for _ in range(3):
        agent.poll_once()
    per_poll = (time.perf_counter() - started) / 3
    active = [(a.gpu, a.fault.id, a.detail) for a in agent.tracker.active()]
    print(f"agent poll of {len(backend.gpus())} GPU(s): {per_poll * 1000:.1f} ms; active faults: {active}")
    assert agent.metrics.registry.get_sample_value("fleetheal_agent_backend_up", {"backend": "nvml"}) == 1
    assert agent.metrics.registry.get_sample_value("fleetheal_agent_read_errors_total", {"source": "nvml"}) == 0
    code = run_check(cfg)
    out = capsys.readouterr().out
    print(out)
    assert code in (OK, UNHEALTHY_EXIT)
    agent.backend.close()
