"""Classification, debounce and health state: pure logic, no I/O, no threads, no clock of its own.

`classify_sample` turns one GPU poll (and the previous one) into detections; `HealthTracker` turns
detections into active faults with debounce and reports each change, from which the service updates
metrics and takes the fast path. Fault ids, classes and actions come only from the taxonomy.

Two kinds of detection:
- *events* (an Xid, a kernel log line, a NaN loss, a counter that grew): the fault is active at once,
  repeats within `dedup_s` fold into one occurrence, and it clears `event_hold_s` after the last one;
- *conditions* (a polled state: GPU lost, remap pending, too hot, a hang): raised after
  `debounce_polls` consecutive polls, cleared after `clear_polls` clean ones from the same source.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetheal.agent.backends import (
    REASON_HW_POWER_BRAKE_SLOWDOWN,
    REASON_HW_THERMAL_SLOWDOWN,
    GpuSample,
)
from fleetheal.contracts import NODE_WIDE_GPU
from fleetheal.taxonomy import Fault, Taxonomy, load

HEALTHY, DEGRADED, UNHEALTHY = 0, 1, 2
#: Runs of one job with faults active at once. A job's runs name their own faults (`Detection.run`), and a run
#: is a number its own process sends: without this bound, a job counting up its run on every line would make
#: the agent export a new series, and Alertmanager send a new alert, for each. A real job restarted in place
#: up to the remediator's per-job limit (3), and requeued, stays well under it.
MAX_RUNS_PER_JOB = 8


@dataclass(frozen=True, slots=True)
class Detection:
    """Something a source saw: a taxonomy fault id on a GPU ("0".."N") or the node ("node")."""

    fault_id: str
    gpu: str
    source: str
    detail: str = ""
    #: True for a polled condition (debounced), False for an event.
    condition: bool = False
    #: The Slurm job whose own reports raised it ("" for a fault of the node or its GPUs): the
    #: remediator acts on that job only.
    job: str = ""
    #: Which run of `job` said it ("" when unknown or no job; `training.run_label`): a fault of the job's next
    #: run is a new fault, not a repeat of one already acted on.
    run: str = ""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The agent's `thresholds` settings (fleetheal.agent.config)."""

    #: NVLink CRC (flit + data) errors per poll above which nvlink-crc-errors is raised.
    nvlink_crc_errors_per_poll: float = 100.0
    nvlink_replay_errors_per_poll: float = 1.0
    nvlink_recovery_errors_per_poll: float = 1.0
    #: PCIe replays per minute (DCGM expects < 31/min for a Gen5 x16 link at BER 1e-12).
    pcie_replays_per_minute: float = 60.0
    #: Power draw at or above this share of the enforced limit is a power-cap violation.
    power_cap_ratio: float = 1.0


def classify_sample(
    sample: GpuSample,
    previous: GpuSample | None,
    thresholds: Thresholds,
    interval_s: float,
    source: str,
) -> list[Detection]:
    """Faults one GPU poll shows. Growth-based faults need `previous` (the last poll, `interval_s` ago)."""
    v = sample.values
    gpu = str(sample.index)
    out: list[Detection] = []

    def cond(fault_id: str, detail: str) -> None:
        out.append(Detection(fault_id, gpu, source, detail, condition=True))

    def event(fault_id: str, detail: str) -> None:
        out.append(Detection(fault_id, gpu, source, detail, condition=False))

    if v.get("ecc_uncorrected_volatile", 0) > 0:
        cond("ecc-dbe-volatile", f"volatile uncorrected ECC count {v['ecc_uncorrected_volatile']:.0f}")
    if v.get("remapped_rows_failure", 0) > 0:
        cond("row-remap-failure", "row remapping failure reported")
    if v.get("remapped_rows_pending", 0) > 0:
        cond("row-remap-pending", "row remapping pending a GPU reset")
    if v.get("retired_pages_pending", 0) > 0:
        cond("retired-pages-pending", "page retirement pending a GPU reset")
    temp = v.get("temperature_c")
    reasons = int(v.get("clock_event_reasons", 0))
    shutdown = v.get("temperature_shutdown_c")
    slowdown = v.get("temperature_slowdown_c")
    if temp is not None and shutdown is not None and temp >= shutdown:
        cond("thermal-shutdown", f"temperature {temp:.0f} C >= shutdown threshold {shutdown:.0f} C")
    elif (temp is not None and slowdown is not None and temp >= slowdown) or reasons & REASON_HW_THERMAL_SLOWDOWN:
        cond("thermal-slowdown", f"temperature {temp} C, slowdown threshold {slowdown} C, reasons 0x{reasons:x}")
    if reasons & REASON_HW_POWER_BRAKE_SLOWDOWN:
        cond("power-brake", f"clock event reasons 0x{reasons:x} include HwPowerBrakeSlowdown")
    power, limit = v.get("power_w"), v.get("power_limit_w")
    if power is not None and limit and power >= limit * thresholds.power_cap_ratio:
        cond("power-cap-violation", f"power {power:.0f} W >= {thresholds.power_cap_ratio:g} x limit {limit:.0f} W")
    recovery = load().recovery_action(int(v.get("recovery_action", 0)))
    if recovery is not None:
        cond(recovery.id, f"NVML recovery action {int(v['recovery_action'])}")

    if previous is not None:
        p = previous.values

        def grew(*keys: str) -> float:
            if not all(k in v and k in p for k in keys):
                return 0.0
            return sum(v[k] - p[k] for k in keys)

        if grew("ecc_uncorrected_aggregate") > 0:
            event("ecc-dbe-aggregate", f"lifetime uncorrected ECC count grew to {v['ecc_uncorrected_aggregate']:.0f}")
        crc = grew("nvlink_crc_flit_errors", "nvlink_crc_data_errors")
        if crc >= thresholds.nvlink_crc_errors_per_poll:
            event("nvlink-crc-errors", f"{crc:.0f} NVLink CRC errors in one poll")
        replay = grew("nvlink_replay_errors")
        if replay >= thresholds.nvlink_replay_errors_per_poll:
            event("nvlink-replay-errors", f"{replay:.0f} NVLink replays in one poll")
        recov = grew("nvlink_recovery_errors")
        if recov >= thresholds.nvlink_recovery_errors_per_poll:
            event("nvlink-recovery-errors", f"{recov:.0f} NVLink recoveries in one poll")
        per_min = grew("pcie_replays") * 60.0 / max(interval_s, 1e-3)
        if per_min >= thresholds.pcie_replays_per_minute:
            event("pcie-replay-growth", f"PCIe replays at {per_min:.0f}/min")
    return out


@dataclass(slots=True)
class ActiveFault:
    fault: Fault
    gpu: str
    source: str
    detail: str
    condition: bool
    first_seen: float
    last_seen: float
    occurrences: int = 1
    job: str = ""
    run: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        """One active fault per GPU, fault, job and run: two jobs' faults on one node are two, and so are the
        faults of two runs of one job (each restart acts on its own)."""
        return (self.gpu, self.fault.id, self.job, self.run)


@dataclass(frozen=True, slots=True)
class Change:
    """A fault became active ("raised"), occurred again after the dedup window ("repeated"), or "cleared"."""

    kind: str
    fault: ActiveFault


@dataclass(slots=True)
class _Streak:
    hits: int = 0
    misses: int = 0
    detail: str = ""


@dataclass(frozen=True)
class HealthConfig:
    """The agent's `health` settings (fleetheal.agent.config): debounce and hold times."""

    #: Consecutive polls a condition must hold before its fault is raised.
    debounce_polls: int = 2
    #: Consecutive clean polls before a polled fault clears.
    clear_polls: int = 3
    #: An event fault (Xid, log line, NaN loss) stays active this long after its last occurrence.
    event_hold_s: float = 600.0
    #: Repeats of the same event fault on the same GPU within this window count once.
    dedup_s: float = 30.0


@dataclass
class HealthTracker:
    """Active faults per GPU and node, with debounce. Callers serialise access (one lock in the service)."""

    taxonomy: Taxonomy
    config: HealthConfig = field(default_factory=HealthConfig)
    _active: dict[tuple[str, str, str, str], ActiveFault] = field(default_factory=dict)
    #: (source, gpu, fault id, job, run) -> streak of polls for condition faults.
    _streaks: dict[tuple[str, str, str, str, str], _Streak] = field(default_factory=dict)

    def event(self, det: Detection, now: float) -> list[Change]:
        """An event detection: raise at once, fold repeats inside the dedup window."""
        fault = self.taxonomy.get(det.fault_id)
        key = (det.gpu, fault.id, det.job, det.run)
        current = self._active.get(key)
        if current is None:
            af = ActiveFault(fault, det.gpu, det.source, det.detail, False, now, now, job=det.job, run=det.run)
            self._active[key] = af
            return [Change("raised", af)]
        repeated = now - current.last_seen >= self.config.dedup_s
        current.last_seen = now
        if repeated:
            current.occurrences += 1
            current.detail = det.detail or current.detail
            return [Change("repeated", current)]
        return []

    def refuses(self, det: Detection) -> str | None:
        """Why a job's detection from a new run is not taken (MAX_RUNS_PER_JOB of its runs have faults
        active), or None."""
        if not det.job or not det.run:
            return None
        runs = {a.run for a in self._active.values() if a.job == det.job and a.run}
        if det.run in runs or len(runs) < MAX_RUNS_PER_JOB:
            return None
        return f"job {det.job} already has faults of {len(runs)} runs active; run {det.run[:32]!r} is not taken"

    def poll(
        self, source: str, detections: Iterable[Detection], now: float, debounce: int | None = None
    ) -> list[Change]:
        """One poll's condition detections from `source`; conditions of that source not seen again count
        toward clearing. `debounce` overrides debounce_polls (the one-shot check uses 1)."""
        need = self.config.debounce_polls if debounce is None else debounce
        changes: list[Change] = []
        seen: set[tuple[str, str, str, str, str]] = set()
        for det in detections:
            if not det.condition:
                changes += self.event(det, now)
                continue
            fault = self.taxonomy.get(det.fault_id)
            skey = (source, det.gpu, fault.id, det.job, det.run)
            seen.add(skey)
            streak = self._streaks.setdefault(skey, _Streak())
            streak.hits += 1
            streak.misses = 0
            streak.detail = det.detail
            key = (det.gpu, fault.id, det.job, det.run)
            current = self._active.get(key)
            if current is not None:
                current.last_seen = now
                if not current.condition:  # an event fault now confirmed by a condition: keep it while it holds
                    current.condition = True
                    current.source = source
            elif streak.hits >= need:
                af = ActiveFault(fault, det.gpu, source, det.detail, True, now, now, job=det.job, run=det.run)
                self._active[key] = af
                changes.append(Change("raised", af))
        for skey in list(self._streaks):
            if skey[0] != source or skey in seen:
                continue
            streak = self._streaks[skey]
            streak.hits = 0
            streak.misses += 1
            key = skey[1:]
            current = self._active.get(key)
            if current is None or not current.condition or current.source != source:
                if current is None:
                    del self._streaks[skey]
                continue
            if streak.misses >= self.config.clear_polls:
                del self._streaks[skey]
                del self._active[key]
                changes.append(Change("cleared", current))
        return changes

    def expire(self, now: float) -> list[Change]:
        """Clear event faults whose last occurrence is older than event_hold_s."""
        changes = []
        for key, af in list(self._active.items()):
            if not af.condition and now - af.last_seen >= self.config.event_hold_s:
                del self._active[key]
                changes.append(Change("cleared", af))
        return changes

    def active(self) -> list[ActiveFault]:
        return sorted(self._active.values(), key=lambda a: (a.gpu, a.fault.id))

    def severity_of(self, fault: Fault) -> int:
        """UNHEALTHY for faults whose action is destructive (the node must not run jobs), else DEGRADED."""
        action = self.taxonomy.actions.get(fault.action)
        return UNHEALTHY if action is not None and action.destructive else DEGRADED

    def health(self, gpu: str | None = None) -> int:
        """Health of one GPU ("node": node-wide faults only), or of the whole node when gpu is None."""
        states = [self.severity_of(a.fault) for a in self._active.values() if gpu is None or a.gpu == gpu]
        return max(states, default=HEALTHY)


def gpu_label(index: int | None) -> str:
    return NODE_WIDE_GPU if index is None else str(index)
