"""FakePynvml: a TEST DOUBLE of the `pynvml` module (nvidia-ml-py 13.615) for NvmlBackend's error handling.

It answers the calls NvmlBackend makes with the real module's names, constants and error semantics:
`NVMLError(value)` with `.value`, NOT_SUPPORTED for missing features, GPU_IS_LOST once a GPU is lost,
LIBRARY_NOT_FOUND from nvmlInit on a machine without a driver, TIMEOUT from an empty event wait, and
field values as structures with `nvmlReturn`, `valueType` and a `value` union.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeSingleBitEccErrorStorm = 0x200
nvmlEventTypeGpuUnavailableError = 0x4000

_NAMES = {
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _NAMES.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    index: int
    bus: int
    temperature: int = 40
    power_mw: int = 300_000
    limit_mw: int = 700_000
    reasons: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    remapped: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    fields: dict[int, int] = field(default_factory=dict)
    lost: bool = False
    #: Calls that answer NOT_SUPPORTED / UNKNOWN for this GPU.
    unsupported: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    events_supported: bool = True


class FakeHandle:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.value = 0x1000 + gpu.index  # what NvmlBackend keys handles by (a ctypes pointer's value)


class FakePynvml(SimpleNamespace):
    """Use as the `nvml` argument of NvmlBackend. `init_error` makes nvmlInit fail with that code."""

    def __init__(self, gpus: int = 2, init_error: int | None = None) -> None:
        super().__init__()
        for name, value in globals().items():
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, value)
        self.NVMLError = NVMLError
        self.init_error = init_error
        self.gpus = [FakeGpu(i, 0x18 + i) for i in range(gpus)]
        self.events: queue.Queue[SimpleNamespace] = queue.Queue()
        self.registered: dict[int, int] = {}
        self.initialised = False
        self.shutdowns = 0

    # -- lifecycle and enumeration
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeHandle:
        return FakeHandle(self.gpus[i])

    def _check(self, h: FakeHandle, call: str) -> FakeGpu:
        g = h.gpu
        if g.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if call in g.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if call in g.failing:
            raise NVMLError(NVML_ERROR_UNKNOWN)
        return g

    def nvmlDeviceGetPciInfo_v3(self, h: FakeHandle) -> SimpleNamespace:
        g = self._check(h, "pci")
        return SimpleNamespace(domain=0, bus=g.bus, device=0)

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        return f"GPU-fake-{self._check(h, 'uuid').index}"

    def nvmlDeviceGetName(self, h: FakeHandle) -> bytes:
        self._check(h, "name")
        return b"Fake H100"  # older nvidia-ml-py returned bytes

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeHandle, which: int) -> int:
        self._check(h, "threshold")
        return 92 if which == NVML_TEMPERATURE_THRESHOLD_SHUTDOWN else 87

    # -- counters
    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        return self._check(h, "temperature").temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        return self._check(h, "power").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeHandle) -> int:
        return self._check(h, "power_limit").limit_mw

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        return self._check(h, "reasons").reasons

    def nvmlDeviceGetTotalEccErrors(self, h: FakeHandle, error_type: int, counter: int) -> int:
        return self._check(h, "ecc").ecc.get((error_type, counter), 0)

    def nvmlDeviceGetRemappedRows(self, h: FakeHandle) -> tuple[int, int, int, int]:
        g = self._check(h, "remapped")
        assert g.remapped is not None
        return g.remapped

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeHandle) -> int:
        self._check(h, "retired")
        return 0

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeHandle) -> int:
        return self._check(h, "pcie").fields.get(-1, 0)

    def nvmlDeviceGetFieldValues(self, h: FakeHandle, ids: list[int]) -> list[Any]:
        g = self._check(h, "fields")
        out = []
        for fid in ids:
            ok = fid in g.fields
            out.append(
                SimpleNamespace(
                    fieldId=fid,
                    nvmlReturn=NVML_SUCCESS if ok else NVML_ERROR_NOT_SUPPORTED,
                    valueType=NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                    value=SimpleNamespace(ullVal=g.fields.get(fid, 0)),
                )
            )
        return out

    # -- events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeHandle) -> int:
        g = self._check(h, "events")
        if not g.events_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return 0xFFFF

    def nvmlDeviceRegisterEvents(self, h: FakeHandle, types: int, event_set: str) -> None:
        self.registered[h.gpu.index] = types

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        try:
            item = self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        if isinstance(item, NVMLError):
            raise item
        return item

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    # -- what a test does to the fake
    def push_xid(self, gpu: int, xid: int) -> None:
        self.events.put(
            SimpleNamespace(device=FakeHandle(self.gpus[gpu]), eventType=nvmlEventTypeXidCriticalError, eventData=xid)
        )
