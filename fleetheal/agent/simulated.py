"""SimulatedGpuBackend: a test double of the NVML backend, with fault injection through a file.

It has the same interface as `NvmlBackend` (`fleetheal.agent.backends.GpuBackend`): N GPUs with
plausible, slowly varying counters, asynchronous events, and `GpuLost` from a GPU that fell off the bus.
Tests, benchmarks and the lab (`fleetheal lab inject NODE FAULT --gpu I`) drive it by writing
*injections* into a small JSON state file that every process on the node can read: the running agent
(which notices a change within `poll_slice_s`) and the one-shot `fleetheal agent check` alike.

Injection API (also `fleetheal agent inject`)::

    from fleetheal.agent.simulated import inject, clear
    inject("/run/fleetheal/sim-gpus.json", "xid-79", gpu=3)            # now
    inject(path, "thermal-slowdown", gpu=0, at=time.time() + 30)        # at a chosen time
    clear(path, fault_id="xid-79", gpu=3)                               # or clear(path) for all

State file format (version 1), replaced atomically under an flock of `<file>.lock`::

    {"version": 1,
     "injections": [{"id": "inj-1764441600123456789", "fault": "xid-79", "gpu": 3, "at": 1764441600.1}]}

`fault` is any taxonomy fault id; `gpu` is a GPU index or null for a node-wide fault; `at` is a Unix
time. How an injection shows, from when `at` has passed until it is cleared:

- Faults NVML sees as state (`EFFECTS`): the GPU's counters change (ECC, remapped rows, temperature,
  clock event reasons, NVLink/PCIe counters that grow at a rate, the recovery action), the GPU is lost
  (`xid-79`, `gpu-lost`: every read raises GpuLost) or disappears from the enumeration (`gpu-count-low`).
- Every fault with an Xid also produces one Xid event (as NVML's event set would), once per injection.
- Any other fault (NIC down, NaN loss...) produces one event carrying its fault id, once per injection.

Why this double ships in the agent (and in the wheel) while the lab's other doubles do not: it is a backend
the agent offers (`backend: simulated`), the Ansible role `gpu_health_agent` can install the agent with it,
and Molecule runs the installed wheel with it. The simulated validation tools that answer from the same
state file (nvidia-smi, dcgmi...) are the lab's alone, in fleetheal.lab, outside the wheel.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetheal.agent.backends import (
    REASON_HW_POWER_BRAKE_SLOWDOWN,
    REASON_HW_THERMAL_SLOWDOWN,
    GpuEvent,
    GpuInfo,
    GpuLost,
    GpuSample,
)
from fleetheal.taxonomy import Taxonomy, load

STATE_VERSION = 1

SLOWDOWN_C = 87.0
SHUTDOWN_C = 92.0
POWER_LIMIT_W = 700.0

#: Faults whose injection changes what NVML would read, and how. Rates are per second since `at`.
EFFECTS: dict[str, dict[str, float]] = {
    "xid-48": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1},
    "ecc-dbe-volatile": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1},
    "ecc-dbe-aggregate": {"ecc_uncorrected_aggregate": 1},
    "row-remap-failure": {"remapped_rows_failure": 1},
    "row-remap-pending": {"remapped_rows_pending": 1},
    "retired-pages-pending": {"retired_pages_pending": 1},
    "thermal-slowdown": {"temperature_c": SLOWDOWN_C + 2},
    "thermal-shutdown": {"temperature_c": SHUTDOWN_C + 1},
    "power-cap-violation": {"power_w": POWER_LIMIT_W * 1.02},
    "xid-154-gpu-reset": {"recovery_action": 1},
    "xid-154-node-reboot": {"recovery_action": 2},
    "xid-154-drain-p2p": {"recovery_action": 3},
}
#: Counters that grow at this rate (per second) while the fault is injected.
RATES: dict[str, dict[str, float]] = {
    "nvlink-crc-errors": {"nvlink_crc_flit_errors": 1000.0},
    "nvlink-replay-errors": {"nvlink_replay_errors": 10.0},
    "nvlink-recovery-errors": {"nvlink_recovery_errors": 1.0},
    "pcie-replay-growth": {"pcie_replays": 1000.0},
}
#: Clock event reason bits set while the fault is injected.
REASONS = {"thermal-slowdown": REASON_HW_THERMAL_SLOWDOWN, "power-brake": REASON_HW_POWER_BRAKE_SLOWDOWN}
LOST = frozenset({"xid-79", "gpu-lost"})
MISSING = frozenset({"gpu-count-low"})


@dataclass(frozen=True, slots=True)
class Injection:
    id: str
    fault: str
    gpu: int | None
    at: float


def pci_bus_id(index: int) -> str:
    """The PCI address simulated GPU `index` reports (kernel log lines for it must use this bus)."""
    return f"00000000:{0x18 + index:02X}:00.0"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_injections(path: str | os.PathLike[str]) -> list[Injection]:
    """The injections in a state file ([] when it does not exist). ValueError on a malformed file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    try:
        doc = json.loads(text)
        if doc.get("version") != STATE_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {STATE_VERSION}")
        return [
            Injection(str(i["id"]), str(i["fault"]), None if i["gpu"] is None else int(i["gpu"]), float(i["at"]))
            for i in doc["injections"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: malformed simulated-GPU state file: {exc}") from exc


def _write(path: Path, injections: list[Injection]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": STATE_VERSION, "injections": [asdict(i) for i in injections]}) + "\n")
    os.replace(tmp, path)


def inject(
    path: str | os.PathLike[str],
    fault_id: str,
    gpu: int | None = None,
    at: float | None = None,
    taxonomy: Taxonomy | None = None,
) -> Injection:
    """Inject taxonomy fault `fault_id` on GPU `gpu` (None: node-wide) at Unix time `at` (None: now)."""
    tx = taxonomy or load()
    if fault_id not in tx.faults:
        raise ValueError(f"unknown fault id {fault_id!r}; see `fleetheal classify --list` or policies/faults.yaml")
    if gpu is not None and gpu < 0:
        raise ValueError(f"gpu must be >= 0, got {gpu}")
    p = Path(path)
    new = Injection(f"inj-{time.time_ns()}", fault_id, gpu, time.time() if at is None else float(at))
    with _locked(p):
        _write(p, [*read_injections(p), new])
    return new


def clear(path: str | os.PathLike[str], fault_id: str | None = None, gpu: int | None = None) -> int:
    """Remove injections matching `fault_id` and `gpu` (None matches any); returns how many."""
    p = Path(path)
    with _locked(p):
        current = read_injections(p)
        keep = [i for i in current if not ((fault_id is None or i.fault == fault_id) and (gpu is None or i.gpu == gpu))]
        _write(p, keep)
    return len(current) - len(keep)


def remove(path: str | os.PathLike[str], ids: Collection[str]) -> int:
    """Remove the injections whose `id` is in `ids` (as `clear`, but exact); returns how many."""
    p = Path(path)
    wanted = set(ids)
    with _locked(p):
        current = read_injections(p)
        keep = [i for i in current if i.id not in wanted]
        if len(keep) != len(current):
            _write(p, keep)
    return len(current) - len(keep)


def _shows_as_state(fault_id: str) -> bool:
    """True when NVML would show the fault as state (counters, a lost or missing GPU), not as an event."""
    return fault_id in EFFECTS or fault_id in RATES or fault_id in REASONS or fault_id in LOST or fault_id in MISSING


class SimulatedGpuBackend:
    """Test double of NvmlBackend: `gpus` simulated GPUs whose faults come from `state_file`."""

    name = "simulated"

    def __init__(
        self,
        state_file: str | os.PathLike[str],
        gpus: int = 8,
        *,
        clock: Callable[[], float] = time.time,
        poll_slice_s: float = 0.05,
        seed: int = 0,
        taxonomy: Taxonomy | None = None,
    ) -> None:
        if gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {gpus}")
        self.state_file = Path(state_file)
        self.count = gpus
        self.clock = clock
        self.poll_slice_s = poll_slice_s
        self._tx = taxonomy or load()
        self._rng = random.Random(seed)  # noqa: S311 - plausible counters, not secrets
        self._base = [
            {"temperature_c": 38.0 + self._rng.uniform(0, 8), "power_w": 250.0 + self._rng.uniform(0, 120)}
            for _ in range(gpus)
        ]
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._injections: list[Injection] = []
        self._emitted: set[str] = set()
        self.opened = False

    def open(self) -> None:
        self.opened = True
        self._refresh()

    def close(self) -> None:
        self.opened = False

    def _refresh(self) -> list[Injection]:
        """Re-read the state file when it changed (one stat per call otherwise)."""
        with self._lock:
            try:
                st = os.stat(self.state_file)
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = (0, 0, 0)
            if stamp != self._stamp:
                self._injections = read_injections(self.state_file) if stamp != (0, 0, 0) else []
                self._stamp = stamp
                live = {i.id for i in self._injections}
                self._emitted &= live
            return self._injections

    def _active(self, gpu: int | None) -> list[Injection]:
        now = self.clock()
        return [i for i in self._refresh() if i.at <= now and i.gpu == gpu]

    def gpus(self) -> list[GpuInfo]:
        now = self.clock()
        gone = {i.gpu for i in self._refresh() if i.at <= now and i.fault in MISSING}
        return [
            GpuInfo(i, f"GPU-5111a7ed-0000-4000-8000-{i:012d}", "Simulated H100 80GB HBM3", pci_bus_id(i))
            for i in range(self.count)
            if i not in gone
        ]

    def sample(self, index: int) -> GpuSample:
        if not 0 <= index < self.count:
            raise IndexError(f"no simulated GPU {index} (have {self.count})")
        now = self.clock()
        active = self._active(index)
        for inj in active:
            if inj.fault in LOST or inj.fault in MISSING:
                raise GpuLost(index, f"simulated {inj.fault} (NVML_ERROR_GPU_IS_LOST)")
        base = self._base[index]
        wobble = math.sin(now / 30.0 + index)
        v: dict[str, float] = {
            "temperature_c": round(base["temperature_c"] + 2 * wobble, 1),
            "temperature_slowdown_c": SLOWDOWN_C,
            "temperature_shutdown_c": SHUTDOWN_C,
            "power_w": round(base["power_w"] + 20 * wobble, 1),
            "power_limit_w": POWER_LIMIT_W,
            "clock_event_reasons": 0.0,
            "ecc_corrected_volatile": 0.0,
            "ecc_uncorrected_volatile": 0.0,
            "ecc_corrected_aggregate": 3.0,
            "ecc_uncorrected_aggregate": 0.0,
            "remapped_rows_correctable": 1.0,
            "remapped_rows_uncorrectable": 0.0,
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
        reasons = 0
        for inj in active:
            for key, value in EFFECTS.get(inj.fault, {}).items():
                if key.startswith(("temperature", "power")) or key == "recovery_action":
                    v[key] = value
                else:
                    v[key] += value
            for key, rate in RATES.get(inj.fault, {}).items():
                v[key] += math.floor(rate * (now - inj.at))
            reasons |= REASONS.get(inj.fault, 0)
        v["clock_event_reasons"] = float(reasons)
        return GpuSample(index, v)

    def _due_events(self) -> list[GpuEvent]:
        now = self.clock()
        out = []
        with self._lock:
            pending = [i for i in self._injections if i.at <= now and i.id not in self._emitted]
            for inj in pending:
                self._emitted.add(inj.id)
                fault = self._tx.get(inj.fault)
                detail = f"simulated injection {inj.id}"
                if fault.xid is not None:
                    out.append(GpuEvent(inj.gpu, xid=fault.xid, detail=detail))
                elif not _shows_as_state(inj.fault):
                    out.append(GpuEvent(inj.gpu, fault_id=inj.fault, detail=detail))
        return out

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        """Events due now, else wait up to `timeout_s`, checking the state file every `poll_slice_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._refresh()
            events = self._due_events()
            if events:
                return events
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(self.poll_slice_s, left))
