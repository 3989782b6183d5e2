"""NvmlBackend against FakePynvml (a test double of pynvml): errors are reported, never crashes."""

from __future__ import annotations

import pytest

from fleetheal.agent.backends import BackendUnavailable, GpuLost, NvmlBackend, normalize_pci
from fleetheal.agent.check import CANNOT_CHECK, run_check
from fleetheal.agent.config import load_config
from fleetheal.agent.service import Agent

from .fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
    NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_VOLATILE_ECC,
    FakePynvml,
    NVMLError,
)


def _cfg(tmp_path, **env):
    base = {
        "FLEETHEAL_AGENT_NODE": "n1",
        "FLEETHEAL_AGENT_METRICS__PORT": "0",
        "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
        "FLEETHEAL_AGENT_TRAINING__ENABLED": "false",
        "FLEETHEAL_AGENT_FASTPATH__SLURM__ENABLED": "false",
    }
    base.update(env)
    return load_config(None, env=base)


def test_library_not_found_is_no_nvml_not_a_crash(tmp_path):
    fake = FakePynvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(BackendUnavailable, match="no NVML: NVML Shared Library Not Found"):
        NvmlBackend(fake).open()

    agent = Agent(_cfg(tmp_path), NvmlBackend(fake))
    agent.open_backend()
    agent.poll_once()  # keeps polling its other sources
    m = agent.metrics.registry
    assert m.get_sample_value("fleetheal_agent_backend_up", {"backend": "nvml"}) == 0
    assert m.get_sample_value("fleetheal_agent_read_errors_total", {"source": "nvml"}) == 1
    assert m.get_sample_value("fleetheal_agent_polls_total") == 1


def test_check_says_no_nvml_and_exits_2(tmp_path, capsys):
    code = run_check(_cfg(tmp_path), NvmlBackend(FakePynvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)))
    assert code == CANNOT_CHECK
    assert "no NVML: Driver Not Loaded" in capsys.readouterr().out


def test_enumerates_and_reads_every_counter():
    fake = FakePynvml(gpus=2)
    g = fake.gpus[1]
    g.ecc[(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)] = 2
    g.fields = {NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 7, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0}
    b = NvmlBackend(fake)
    b.open()
    infos = b.gpus()
    assert [(i.index, i.pci_bus_id, i.name) for i in infos] == [
        (0, "00000000:18:00.0", "Fake H100"),
        (1, "00000000:19:00.0", "Fake H100"),
    ]
    assert b.events_registered() == 2
    s = b.sample(1)
    assert s.errors == {}
    assert s.values["temperature_c"] == 40
    assert s.values["temperature_slowdown_c"] == 87
    assert s.values["power_w"] == 300
    assert s.values["power_limit_w"] == 700
    assert s.values["ecc_uncorrected_volatile"] == 2
    assert s.values["nvlink_replay_errors"] == 7
    assert "nvlink_crc_flit_errors" not in s.values  # NOT_SUPPORTED field: absent, not an error
    b.close()
    assert fake.shutdowns == 1


def test_unsupported_is_absent_and_other_errors_are_recorded():
    fake = FakePynvml(gpus=1)
    fake.gpus[0].unsupported = {"remapped", "retired"}
    fake.gpus[0].failing = {"power"}
    b = NvmlBackend(fake)
    b.open()
    s = b.sample(0)
    assert "remapped_rows_pending" not in s.values
    assert "retired_pages_pending" not in s.values
    assert s.errors == {"power_w": "Unknown Error"}


def test_gpu_lost_raises_gpu_lost_and_the_agent_raises_the_fault(tmp_path):
    fake = FakePynvml(gpus=2)
    b = NvmlBackend(fake)
    b.open()
    fake.gpus[1].lost = True
    with pytest.raises(GpuLost, match="GPU 1 is lost"):
        b.sample(1)

    agent = Agent(_cfg(tmp_path, FLEETHEAL_AGENT_HEALTH__DEBOUNCE_POLLS="1"), NvmlBackend(fake))
    agent.open_backend()
    agent.poll_once()
    active = {(a.gpu, a.fault.id) for a in agent.tracker.active()}
    assert ("1", "gpu-lost") in active
    labels = {"node": "n1", "gpu": "1", "fault_id": "gpu-lost", "class": "hardware"}
    labels |= {"action": "ISOLATE_AND_RELOCATE", "severity": "critical", "job_id": "", "job_run": ""}
    assert agent.metrics.registry.get_sample_value("fleetheal_agent_fault_active", labels) == 1


def test_events_xid_timeout_and_lost():
    fake = FakePynvml(gpus=4)
    b = NvmlBackend(fake)
    b.open()
    assert b.wait_events(0.01) == []  # NVML_ERROR_TIMEOUT
    fake.push_xid(3, 79)
    (ev,) = b.wait_events(1.0)
    assert (ev.gpu, ev.xid) == (3, 79)
    fake.events.put(NVMLError(NVML_ERROR_GPU_IS_LOST))
    (ev,) = b.wait_events(1.0)
    assert ev.fault_id == "gpu-lost"


def test_a_gpu_without_events_is_still_polled():
    fake = FakePynvml(gpus=2)
    fake.gpus[0].events_supported = False
    b = NvmlBackend(fake)
    b.open()
    assert b.events_registered() == 1
    assert b.sample(0).values["temperature_c"] == 40


def test_missing_package_is_no_nvml(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    with pytest.raises(BackendUnavailable, match="no NVML: the nvidia-ml-py package is not installed"):
        NvmlBackend().open()


def test_real_pynvml_without_a_gpu_is_no_nvml():
    """The real nvidia-ml-py on a machine without the driver library: reported, not raised further."""
    pytest.importorskip("pynvml")
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(BackendUnavailable, match="no NVML"):
            NvmlBackend().open()
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML; tests/gpu covers it")


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("0000:3b:00", "00000000:3B:00.0"),
        ("PCI:0000:cb:00", "00000000:CB:00.0"),
        ("00000000:3B:00.0", "00000000:3B:00.0"),
        ("0009:01:00", "00000009:01:00.0"),
        ("not-a-bus", None),
    ],
)
def test_normalize_pci(raw, want):
    assert normalize_pci(raw) == want
