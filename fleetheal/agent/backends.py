"""GPU backends: the interface the agent reads GPUs through, and the real one over NVML.

A backend enumerates GPUs, samples each one's counters (`GpuSample`) and delivers asynchronous events
(Xid, double-bit ECC, GPU unavailable) from a dedicated thread that calls `wait_events` with a timeout.
`fleetheal.agent.simulated.SimulatedGpuBackend` is the test double with the same interface.

Errors are data, never crashes: a library that cannot be loaded raises `BackendUnavailable` from `open`
(the agent reports "no NVML" and keeps its other sources), a GPU that stopped answering raises `GpuLost`
(the agent turns it into the taxonomy's `gpu-lost` fault), and a single counter the GPU does not support
is simply absent from the sample.

NVML names and constants: nvidia-ml-py 13.615 (`pynvml`), see shared/reference/dcgm.md section 4.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Counter names a sample may carry (the agent's raw-counter metrics and thresholds use these names).
COUNTERS = (
    "temperature_c",
    "temperature_slowdown_c",
    "temperature_shutdown_c",
    "power_w",
    "power_limit_w",
    "clock_event_reasons",
    "ecc_corrected_volatile",
    "ecc_uncorrected_volatile",
    "ecc_corrected_aggregate",
    "ecc_uncorrected_aggregate",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "remapped_rows_pending",
    "remapped_rows_failure",
    "retired_pages_pending",
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
    "pcie_replays",
    "recovery_action",
)

#: Clock event (throttle) reason bits, NVML `nvmlClocksEventReason*` (same values as the older
#: `nvmlClocksThrottleReason*`), nvidia-ml-py 13.615.
REASON_HW_THERMAL_SLOWDOWN = 0x40
REASON_HW_POWER_BRAKE_SLOWDOWN = 0x80


class BackendUnavailable(RuntimeError):
    """The GPU library cannot be used at all (no NVML, no driver): reported, never fatal to the agent."""


class GpuLost(RuntimeError):
    """A GPU stopped answering (NVML_ERROR_GPU_IS_LOST): a fault, not a crash."""

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(f"GPU {index} is lost: {detail}")
        self.index = index
        self.detail = detail


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    #: Canonical PCI address `DDDDDDDD:BB:DD.F` (upper-case hex), as NVML prints it.
    pci_bus_id: str


@dataclass(slots=True)
class GpuSample:
    """One poll of one GPU: counter values (names from COUNTERS) and per-counter read errors."""

    index: int
    values: dict[str, float] = field(default_factory=dict)
    #: counter name -> error text, for reads that failed for another reason than "not supported".
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """An asynchronous GPU event. Exactly one of `xid` and `fault_id` is set."""

    gpu: int | None
    xid: int | None = None
    #: A taxonomy fault id, for events that are not Xids (DBE, SBE storm, GPU unavailable, simulated).
    fault_id: str | None = None
    detail: str = ""


class GpuBackend(Protocol):
    """What the agent needs from a GPU library. Implementations: NvmlBackend, SimulatedGpuBackend."""

    #: Short name, used as the `backend` and read-error `source` label ("nvml", "simulated").
    name: str

    def open(self) -> None:
        """Initialise; raises BackendUnavailable when the library or driver is missing."""

    def gpus(self) -> list[GpuInfo]:
        """The GPUs visible now (their count is compared with the expected count)."""
        ...

    def sample(self, index: int) -> GpuSample:
        """Read every counter of one GPU; raises GpuLost when the GPU stopped answering."""
        ...

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        """Block up to `timeout_s` for events; [] on timeout. Called from one dedicated thread."""
        ...

    def close(self) -> None: ...


_PCI = re.compile(
    r"^(?:(?P<dom>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})(?:\.(?P<fn>[0-7]))?$"
)


def normalize_pci(bus_id: str) -> str | None:
    """`0000:3b:00`, `PCI:0000:3B:00.0`, `00000000:3B:00.0` -> `00000000:3B:00.0`; None if not a PCI id.

    Kernel Xid lines name a GPU by its PCI address in several spellings; NVML prints another.
    """
    m = _PCI.match(bus_id.strip().removeprefix("PCI:"))
    if not m:
        return None
    return f"{int(m['dom'] or '0', 16):08X}:{int(m['bus'], 16):02X}:{int(m['dev'], 16):02X}.{m['fn'] or '0'}"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """The real backend over NVML (`import pynvml`, from nvidia-ml-py).

    `nvml` is the pynvml module; tests pass a fake one. It is imported lazily so that importing the agent
    works on machines without the package's shared library.
    """

    name = "nvml"

    def __init__(self, nvml: Any = None, event_types: int | None = None) -> None:
        self._nvml_module = nvml
        self._event_types = event_types
        self._handles: list[Any] = []
        self._infos: list[GpuInfo] = []
        self._thresholds: dict[int, dict[str, float]] = {}
        self._event_set: Any = None
        self._handle_index: dict[int, int] = {}
        #: GPUs NVML counts but cannot open: index -> the error.
        self._broken: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def nvml(self) -> Any:
        if self._nvml_module is None:
            try:
                import pynvml
            except ImportError as exc:  # the package itself missing
                raise BackendUnavailable(f"no NVML: the nvidia-ml-py package is not installed ({exc})") from exc
            self._nvml_module = pynvml
        return self._nvml_module

    def _code(self, exc: BaseException) -> int | None:
        value = getattr(exc, "value", None)
        return value if isinstance(value, int) else None

    def _is(self, exc: BaseException, const: str) -> bool:
        return self._code(exc) == getattr(self.nvml, const, object())

    def open(self) -> None:
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise BackendUnavailable(f"no NVML: {exc}") from exc
        except OSError as exc:  # a broken library can fail to load before NVML can say so
            raise BackendUnavailable(f"no NVML: {exc}") from exc
        self._enumerate()
        self._register_events()

    def _enumerate(self) -> None:
        nv = self.nvml
        count = nv.nvmlDeviceGetCount()
        handles: list[Any] = []
        infos: list[GpuInfo] = []
        for i in range(count):
            h = None
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                pci = nv.nvmlDeviceGetPciInfo_v3(h)
                bus = f"{pci.domain:08X}:{pci.bus:02X}:{pci.device:02X}.0"
                info = GpuInfo(i, _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h)), bus)
            except nv.NVMLError as exc:
                # NVML counts it but cannot describe it: keep it, so every poll reports it lost.
                info = GpuInfo(i, "", "", "")
                self._broken[i] = str(exc)
            handles.append(h)
            infos.append(info)
            self._thresholds[i] = {}
            if i in self._broken:
                continue
            for key, const in (
                ("temperature_slowdown_c", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
                ("temperature_shutdown_c", "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
            ):
                with contextlib.suppress(nv.NVMLError):
                    self._thresholds[i][key] = float(nv.nvmlDeviceGetTemperatureThreshold(h, getattr(nv, const)))
        with self._lock:
            self._handles, self._infos = handles, infos

    def _register_events(self) -> None:
        nv = self.nvml
        wanted = self._event_types
        if wanted is None:
            wanted = (
                nv.nvmlEventTypeXidCriticalError
                | nv.nvmlEventTypeDoubleBitEccError
                | getattr(nv, "nvmlEventTypeSingleBitEccErrorStorm", 0)
                | getattr(nv, "nvmlEventTypeGpuUnavailableError", 0)
            )
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            self._event_set = None
            return
        for info, h in zip(self._infos, self._handles, strict=True):
            if h is None or info.index in self._broken:
                continue
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(h)
                nv.nvmlDeviceRegisterEvents(h, wanted & supported, self._event_set)
                self._handle_index[_handle_key(h)] = info.index
            except nv.NVMLError:
                continue  # e.g. NOT_SUPPORTED on a GPU without events: its counters are still polled

    def events_registered(self) -> int:
        """How many GPUs deliver events (the GPU-only test checks this)."""
        return len(self._handle_index)

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            return list(self._infos)

    def sample(self, index: int) -> GpuSample:
        nv = self.nvml
        if index in self._broken:
            raise GpuLost(index, f"NVML cannot open the GPU: {self._broken[index]}")
        h = self._handles[[g.index for g in self._infos].index(index)]
        s = GpuSample(index, dict(self._thresholds.get(index, {})))

        def read(name: str, fn: Callable[[], float]) -> None:
            try:
                s.values[name] = float(fn())
            except nv.NVMLError as exc:
                if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                    raise GpuLost(index, str(exc)) from exc
                if not self._is(exc, "NVML_ERROR_NOT_SUPPORTED"):
                    s.errors[name] = str(exc)

        read("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        read("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        read("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        read("clock_event_reasons", lambda: reasons(h))
        for name, err, counter in (
            ("ecc_corrected_volatile", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_uncorrected_volatile", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_corrected_aggregate", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
            ("ecc_uncorrected_aggregate", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        ):
            read(name, functools.partial(nv.nvmlDeviceGetTotalEccErrors, h, getattr(nv, err), getattr(nv, counter)))
        try:
            corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(h)
            s.values.update(
                remapped_rows_correctable=float(corr),
                remapped_rows_uncorrectable=float(unc),
                remapped_rows_pending=float(bool(pending)),
                remapped_rows_failure=float(bool(failure)),
            )
        except nv.NVMLError as exc:
            if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                raise GpuLost(index, str(exc)) from exc
            if not self._is(exc, "NVML_ERROR_NOT_SUPPORTED"):
                s.errors["remapped_rows"] = str(exc)
        read("retired_pages_pending", lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(h)))
        read("pcie_replays", lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
        self._field_values(h, index, s)
        return s

    _FIELDS = (
        ("nvlink_crc_flit_errors", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),
        ("nvlink_crc_data_errors", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
        ("nvlink_replay_errors", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"),
        ("nvlink_recovery_errors", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"),
        ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
    )

    def _field_values(self, h: Any, index: int, s: GpuSample) -> None:
        """NVLink totals and the recovery action in one batched call (nvmlDeviceGetFieldValues)."""
        nv = self.nvml
        fields = [(name, getattr(nv, const)) for name, const in self._FIELDS if hasattr(nv, const)]
        try:
            values = nv.nvmlDeviceGetFieldValues(h, [fid for _, fid in fields])
        except nv.NVMLError as exc:
            if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                raise GpuLost(index, str(exc)) from exc
            if not self._is(exc, "NVML_ERROR_NOT_SUPPORTED"):
                s.errors["field_values"] = str(exc)
            return
        success = getattr(nv, "NVML_SUCCESS", 0)
        for (name, _), fv in zip(fields, values, strict=False):
            if fv.nvmlReturn == success:
                s.values[name] = float(_field_value(nv, fv))

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        nv = self.nvml
        if self._event_set is None:
            threading.Event().wait(timeout_s)
            return []
        try:
            data = nv.nvmlEventSetWait_v2(self._event_set, int(timeout_s * 1000))
        except nv.NVMLError as exc:
            if self._is(exc, "NVML_ERROR_TIMEOUT"):
                return []
            if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                return [GpuEvent(None, fault_id="gpu-lost", detail=str(exc))]
            raise
        gpu = self._handle_index.get(_handle_key(data.device))
        kind = int(data.eventType)
        if kind & nv.nvmlEventTypeXidCriticalError:
            return [GpuEvent(gpu, xid=int(data.eventData), detail="NVML Xid event")]
        if kind & nv.nvmlEventTypeDoubleBitEccError:
            return [GpuEvent(gpu, fault_id="ecc-dbe-volatile", detail="NVML double-bit ECC event")]
        if kind & getattr(nv, "nvmlEventTypeSingleBitEccErrorStorm", 0):
            return [GpuEvent(gpu, fault_id="ecc-sbe-storm", detail="NVML single-bit ECC storm event")]
        if kind & getattr(nv, "nvmlEventTypeGpuUnavailableError", 0):
            return [GpuEvent(gpu, fault_id="gpu-lost", detail="NVML GPU unavailable event")]
        return []

    def close(self) -> None:
        nv = self.nvml
        try:
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self._event_set = None


def _handle_key(handle: Any) -> int:
    """A hashable identity for an NVML device handle (a ctypes pointer) or a fake's handle."""
    value = getattr(handle, "value", None)
    if isinstance(value, int):
        return value
    try:
        import ctypes

        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _field_value(nv: Any, fv: Any) -> float:
    kind = fv.valueType
    v = fv.value
    if kind == getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0):
        return float(v.dVal)
    if kind == getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1):
        return float(v.uiVal)
    if kind == getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2):
        return float(v.ulVal)
    if kind == getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4):
        return float(v.sllVal)
    if kind == getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5):
        return float(v.siVal)
    return float(v.ullVal)
