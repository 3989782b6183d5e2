"""Effective training time ratio (ETTR): simulated (`fleetheal ettr simulate`) and measured on a lab run.

ETTR is the share of a training job's wall time that produced training progress that was kept:
productive time / allocated time. Everything else is lost work (steps redone after a restart from the last
checkpoint), checkpoint overhead (time training is blocked writing a checkpoint), detection time (a fault
has happened, nobody knows yet), recovery time (isolate, requeue, promote a replacement, restart the
application) and time spent waiting for a replacement node when no warm standby is left.

The simulator is a discrete-event model with the standard library only and a seeded `random.Random`:

* A job on N GPUs (N/8 nodes) runs compute segments of `interval` seconds, each followed by a blocking
  checkpoint of `checkpoint` seconds. Interruptions arrive as a Poisson process whose rate is the sum of
  per-component, per-GPU-day rates times N (default: Llama 3 Table 5, see FAILURE_RATES) while the job
  runs; the failure process is memoryless, so no failure is modelled during a recovery (the usual
  Young/Daly assumption; at the scales here recovery is a small share of the time between failures).
* An interruption throws away the compute since the last completed checkpoint (an unfinished checkpoint's
  time counts as checkpoint overhead). Its component decides how it is noticed (`hw`: the node agent sees
  an Xid or counter; `crash`: the process exits; `symptom`: a hang, NCCL watchdog or silent corruption
  that only shows in training progress) and how it is handled: `hardware` -> isolate the node, requeue,
  take a node from the warm-standby pool (or wait for one), restart; `transient` -> requeue and restart
  on the same nodes.
* The standby pool holds `standby` nodes. Every hardware interruption sends its node to repair and orders
  a replacement that arrives `replace_s` later; when the pool is empty the job waits for the earliest
  replacement.

The fleetheal profile's platform timings can come from the benchmarks instead of the built-in defaults:
`fleetheal ettr simulate --from-bench [RESULTS.json]` (`profile_from_bench`) reads bench_lab's Xid 79 and
NCCL-timeout figures from benchmarks/run.py's results (default benchmarks/results/latest.json).

See docs/ettr.md for the model, the sources of every default and how to read the output.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

DAY_S = 86_400.0
GPUS_PER_NODE = 8
SCALES = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, 131_072)
CATEGORIES = ("productive", "lost_work", "checkpoint", "detection", "recovery", "waiting")

# Llama 3 pre-training, 54 days on 16,384 H100 GPUs: the 419 unexpected interruptions of Table 5
# ("The Llama 3 Herd of Models", arXiv 2407.21783; transcribed in /work/shared/reference/failure-stats.md,
# section 1). Rate per GPU-day = count / (16,384 GPUs x 54 days). Each component also says how it is
# noticed (detect) and handled (kind); that mapping is fleetheal's, following the coarse buckets of
# failure-stats.md note (c): host maintenance is an unplanned node drain, handled like hardware.
LLAMA3_GPU_DAYS = 16_384 * 54
LLAMA3_TABLE5: tuple[tuple[str, str, int, str, str], ...] = (
    # component, category, count, kind, detect
    ("Faulty GPU", "GPU", 148, "hardware", "hw"),
    ("GPU HBM3 Memory", "GPU", 72, "hardware", "hw"),
    ("Software Bug", "Dependency", 54, "transient", "crash"),
    ("Network Switch/Cable", "Network", 35, "hardware", "hw"),
    ("Host Maintenance", "Unplanned Maintenance", 32, "hardware", "hw"),
    ("GPU SRAM Memory", "GPU", 19, "hardware", "hw"),
    ("GPU System Processor", "GPU", 17, "hardware", "hw"),
    ("NIC", "Host", 7, "hardware", "hw"),
    ("NCCL Watchdog Timeouts", "Unknown", 7, "transient", "symptom"),
    ("Silent Data Corruption", "GPU", 6, "hardware", "symptom"),
    ("GPU Thermal Interface + Sensor", "GPU", 6, "hardware", "hw"),
    ("SSD", "Host", 3, "hardware", "hw"),
    ("Power Supply", "Host", 3, "hardware", "hw"),
    ("Server Chassis", "Host", 2, "hardware", "hw"),
    ("IO Expansion Board", "Host", 2, "hardware", "hw"),
    ("Dependency", "Dependency", 2, "transient", "crash"),
    ("CPU", "Host", 2, "hardware", "hw"),
    ("System Memory", "Host", 2, "hardware", "hw"),
)
SOURCE = "Llama 3 Table 5 (arXiv 2407.21783): 419 unexpected interruptions, 16,384 GPUs x 54 days"


@dataclass(frozen=True)
class Component:
    name: str
    category: str
    kind: str  # hardware | transient
    detect: str  # hw | crash | symptom
    per_gpu_day: float


FAILURE_RATES: tuple[Component, ...] = tuple(
    Component(name, cat, kind, detect, count / LLAMA3_GPU_DAYS) for name, cat, count, kind, detect in LLAMA3_TABLE5
)
KINDS = ("hardware", "transient")
DETECTS = ("hw", "crash", "symptom")


@dataclass(frozen=True)
class Profile:
    """How interruptions are handled; every time in seconds. See docs/ettr.md for each default's source."""

    name: str
    detect_hw_s: float  # fault -> known (the agent's Xid/counter poll)
    detect_crash_s: float  # process exit -> known
    detect_symptom_s: float  # hang, NCCL watchdog, silent corruption -> known
    isolate_s: float  # known -> node drained and incident opened (hardware only)
    requeue_s: float  # -> job requeued (alert path, playbook start, grace period, requeue)
    promote_s: float  # -> a standby node promoted into the job's pool (hardware only)
    restart_s: float  # -> application training again (launch, collective init, checkpoint load)
    replace_s: float  # lead time of a replacement node (repair or provisioning)
    standby_fraction: float  # warm-standby nodes as a share of the job's nodes
    grace_save: float = 0.0  # share of interruptions whose grace-period checkpoint keeps all work
    #: transient only: known -> job running again on the same nodes (grace period, requeue in place or the
    #: restart inside the allocation), before the application restart; None: requeue_s, as for hardware.
    in_place_s: float | None = None

    def detect_s(self, detect: str) -> float:
        return {"hw": self.detect_hw_s, "crash": self.detect_crash_s, "symptom": self.detect_symptom_s}[detect]

    def transient_s(self) -> float:
        """Recovery of a transient interruption before the application restart."""
        return self.requeue_s if self.in_place_s is None else self.in_place_s

    def standby_nodes(self, gpus: int) -> int:
        nodes = gpus // GPUS_PER_NODE
        return max(0, math.ceil(nodes * self.standby_fraction)) if self.standby_fraction > 0 else 0


# fleetheal, automated: measured on the lab by benchmarks/bench_lab.py (2-core machine, 2026-11-29, 11 Xid 79
# injections, medians from the fault): Slurm node drained by the agent 0.1 s; alert at the remediator 1.1 s;
# job requeued (playbook validation, Slurm reads, grace signal, the lab's 3 s grace period, scontrol
# requeue) 13.9 s; job RUNNING again on the promoted standby 24.8 s (Kubernetes cordon/drain, standby
# promotion and Slurm scheduling after the requeue: 10.9 s). So detect_hw_s + isolate_s = 0.1,
# requeue_s = 13.8, promote_s = 10.9. docs/lab.md's demo figure (Xid 79 -> running again 32-42 s) is the
# same path under the demo's extra load. The hang timeout is the agent's `training.hang_timeout_s` (300 s).
# Not measured (assumptions, see docs/ettr.md): restart_s 60 s for a large job's launch + NCCL init +
# checkpoint load (the lab's toy job restarts in 0.1 s); replace_s 4 h; 1% warm standby. A transient
# interruption takes requeue_s here (in_place_s None); `--from-bench` sets in_place_s from the lab's NCCL
# timeout figure and the other platform timings from this run's Xid 79 figures (`profile_from_results`).
FLEETHEAL = Profile(
    name="fleetheal",
    detect_hw_s=0.1,
    detect_crash_s=1.0,
    detect_symptom_s=300.0,
    isolate_s=0.0,
    requeue_s=13.8,
    promote_s=10.9,
    restart_s=60.0,
    replace_s=4 * 3600.0,
    standby_fraction=0.01,
)
# Manual-ish recovery, the peer: an interruption is noticed when the job stalls (PyTorch's default NCCL
# collective timeout, 10 min, for hardware and hangs; a crash is seen when the job exits), an operator
# triages and drains the node (15 min), resubmits (5 min); the replacement node comes from the cluster's
# free capacity (no warm standby, no lead time when capacity exists: Llama 3's job ran inside a larger
# cluster), and the application restarts as in the automated profile.
MANUAL = Profile(
    name="manual",
    detect_hw_s=600.0,
    detect_crash_s=60.0,
    detect_symptom_s=600.0,
    isolate_s=900.0,
    requeue_s=300.0,
    promote_s=0.0,
    restart_s=60.0,
    replace_s=0.0,
    standby_fraction=0.0,
)
# Llama 3-like: largely automated restarts ("only three interruptions required significant manual
# intervention") but slow to notice (hang/timeout based), no warm standby pool, spare capacity in the cluster.
LLAMA3 = Profile(
    name="llama3",
    detect_hw_s=300.0,
    detect_crash_s=60.0,
    detect_symptom_s=600.0,
    isolate_s=120.0,
    requeue_s=120.0,
    promote_s=0.0,
    restart_s=120.0,
    replace_s=0.0,
    standby_fraction=0.0,
)
PROFILES = {p.name: p for p in (FLEETHEAL, MANUAL, LLAMA3)}
# Blocking part of a checkpoint (assumption: asynchronous checkpointing, snapshot to host memory blocks,
# the write to storage overlaps training). docs/ettr.md shows how ETTR moves with it.
CHECKPOINT_S = 2.0


class SimulationError(ValueError):
    """Bad parameters for the model (printed as a usage error)."""


@dataclass
class Result:
    gpus: int
    profile: str
    interval_s: float
    checkpoint_s: float
    horizon_s: float
    interruptions: int
    hardware: int
    waited: int
    mtbf_s: float
    seconds: dict[str, float]

    @property
    def ettr(self) -> float:
        return self.seconds["productive"] / self.horizon_s

    def breakdown(self) -> dict[str, float]:
        return {k: v / self.horizon_s for k, v in self.seconds.items()}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ettr"] = self.ettr
        d["breakdown"] = self.breakdown()
        return d


def total_rate(components: Sequence[Component]) -> float:
    """Interruptions per GPU-day, all components."""
    return sum(c.per_gpu_day for c in components)


def mtbf_s(gpus: int, components: Sequence[Component] = FAILURE_RATES) -> float:
    """Mean time between interruptions of a job on `gpus` GPUs, seconds (rates scale linearly with GPUs)."""
    rate = total_rate(components) * gpus
    if rate <= 0:
        raise SimulationError("the failure rates sum to zero: no interruptions to simulate")
    return DAY_S / rate


def young_daly_interval(checkpoint_s: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 C M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf)


def young_daly_ettr(checkpoint_s: float, mtbf: float, downtime_s: float) -> float:
    """First-order closed form at the optimal interval: 1 - sqrt(2C/M) - R/M."""
    return 1.0 - math.sqrt(2.0 * checkpoint_s / mtbf) - downtime_s / mtbf


def _check(gpus: int, interval_s: float, checkpoint_s: float, horizon_s: float, profile: Profile) -> None:
    if gpus < GPUS_PER_NODE or gpus % GPUS_PER_NODE:
        raise SimulationError(f"--gpus must be a positive multiple of {GPUS_PER_NODE}, got {gpus}")
    if not interval_s > 0 or not math.isfinite(interval_s):
        raise SimulationError(f"checkpoint interval must be > 0 s, got {interval_s}")
    if checkpoint_s < 0 or not math.isfinite(checkpoint_s):
        raise SimulationError(f"checkpoint cost must be >= 0 s, got {checkpoint_s}")
    if not horizon_s > 0:
        raise SimulationError(f"simulated time must be > 0, got {horizon_s}")
    for f in fields(profile):
        v = getattr(profile, f.name)
        if f.name == "in_place_s" and v is None:
            continue
        if f.name != "name" and (not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v)):
            raise SimulationError(f"{f.name} must be a finite number >= 0, got {v}")
    if profile.grace_save > 1 or profile.standby_fraction > 1:
        raise SimulationError("grace_save and standby_fraction are shares between 0 and 1")


def simulate(
    gpus: int,
    profile: Profile = FLEETHEAL,
    *,
    interval_s: float,
    checkpoint_s: float = CHECKPOINT_S,
    horizon_s: float | None = None,
    events: int = 2_000,
    seed: int = 0,
    components: Sequence[Component] = FAILURE_RATES,
) -> Result:
    """One run of the discrete-event model; `horizon_s` defaults to the time `events` interruptions take."""
    mtbf = mtbf_s(gpus, components)
    horizon = horizon_s if horizon_s is not None else events * mtbf
    _check(gpus, interval_s, checkpoint_s, horizon, profile)
    rng = random.Random(seed)  # noqa: S311 -- a seeded model, not cryptography
    weights = [c.per_gpu_day for c in components]
    rate = 1.0 / mtbf
    secs = dict.fromkeys(CATEGORIES, 0.0)
    standby = profile.standby_nodes(gpus)
    pool = standby
    arrivals: list[float] = []  # replacement nodes ordered, by arrival time
    cycle = interval_s + checkpoint_s
    t = 0.0
    n = hw = waited = 0
    while t < horizon:
        # Run from a checkpoint (or the start) until the next interruption or the end of the horizon.
        fail_at = t + rng.expovariate(rate)
        end = min(fail_at, horizon)
        d = end - t
        cycles = math.floor(d / cycle)
        rem = d - cycles * cycle
        secs["productive"] += cycles * interval_s
        secs["checkpoint"] += cycles * checkpoint_s
        since = min(rem, interval_s)
        secs["checkpoint"] += rem - since
        t = end
        if fail_at >= horizon:
            secs["productive"] += since  # the run ends without an interruption: its progress counts
            break
        n += 1
        comp = rng.choices(components, weights)[0]
        if profile.grace_save > 0 and rng.random() < profile.grace_save:
            secs["productive"] += since  # the grace-period checkpoint saved it
        else:
            secs["lost_work"] += since
        phases: list[tuple[str, float]] = [("detection", profile.detect_s(comp.detect))]
        if comp.kind == "hardware":
            hw += 1
            while arrivals and arrivals[0] <= t:
                heapq.heappop(arrivals)
                pool += 1
            heapq.heappush(arrivals, t + profile.replace_s)
            phases.append(("recovery", profile.isolate_s + profile.requeue_s))
            if pool > 0:
                pool -= 1
            else:
                ready = heapq.heappop(arrivals)
                ready_after = t + profile.detect_s(comp.detect) + profile.isolate_s + profile.requeue_s
                if ready > ready_after:
                    waited += 1
                    phases.append(("waiting", ready - ready_after))
            phases.append(("recovery", profile.promote_s + profile.restart_s))
        else:
            phases.append(("recovery", profile.transient_s() + profile.restart_s))
        for cat, seconds in phases:
            take = min(seconds, horizon - t)
            secs[cat] += take
            t += take
    return Result(gpus, profile.name, interval_s, checkpoint_s, horizon, n, hw, waited, mtbf, secs)


def downtime_per_interruption(profile: Profile, components: Sequence[Component] = FAILURE_RATES) -> float:
    """Expected detection + recovery seconds per interruption (no waiting), for the closed form."""
    total = total_rate(components)
    r = 0.0
    for c in components:
        base = profile.detect_s(c.detect) + profile.restart_s
        if c.kind == "hardware":
            base += profile.isolate_s + profile.requeue_s + profile.promote_s
        else:
            base += profile.transient_s()
        r += c.per_gpu_day / total * base
    return r


def best_interval(
    gpus: int,
    profile: Profile = FLEETHEAL,
    *,
    checkpoint_s: float = CHECKPOINT_S,
    events: int = 2_000,
    seed: int = 0,
    components: Sequence[Component] = FAILURE_RATES,
    factors: Iterable[float] = (0.25, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0, 2.8, 4.0),
) -> tuple[Result, list[Result]]:
    """Search intervals around Young's sqrt(2CM) with common random numbers; the best run and all runs."""
    mtbf = mtbf_s(gpus, components)
    t0 = young_daly_interval(max(checkpoint_s, 1e-3), mtbf)
    runs = [
        simulate(
            gpus, profile, interval_s=t0 * f, checkpoint_s=checkpoint_s, events=events, seed=seed, components=components
        )
        for f in factors
    ]
    return max(runs, key=lambda r: r.ettr), runs


def sweep(
    scales: Sequence[int],
    profiles: Sequence[Profile],
    *,
    checkpoint_s: float = CHECKPOINT_S,
    interval_s: float | None = None,
    events: int = 2_000,
    seed: int = 0,
) -> list[Result]:
    """ETTR per scale and profile, at the best interval (or the given one)."""
    out = []
    for gpus in scales:
        for p in profiles:
            if interval_s is None:
                best, _ = best_interval(gpus, p, checkpoint_s=checkpoint_s, events=events, seed=seed)
            else:
                best = simulate(gpus, p, interval_s=interval_s, checkpoint_s=checkpoint_s, events=events, seed=seed)
            out.append(best)
    return out


# --- platform timings from the benchmark results -----------------------------------------------------

#: `make bench` writes this (benchmarks/run.py); `--from-bench` without a path reads it.
BENCH_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "latest.json"
#: bench_lab's figures the profile is taken from: (stable key, name prefix for results written before keys).
BENCH_FIGURES = {
    "drained": ("xid79_drained", "Xid 79 -> Slurm node drained"),
    "running": ("xid79_running_again", "Xid 79 -> job RUNNING again"),
    "in_place": ("nccl_running_again", "NCCL timeout -> training running again"),
}


class BenchResultsError(ValueError):
    """The benchmark results cannot give a profile (no file, not JSON, no lab figures)."""


@dataclass(frozen=True)
class BenchProfile:
    """A profile whose platform timings come from bench_lab's figures, and what was taken from where."""

    profile: Profile
    origin: str  # where the figures came from (a path, "this bench run")
    when: str | None  # the bench run's time (results' meta.when), when known
    used: dict[str, dict[str, Any]]  # profile field -> {"value", "from", "n"}
    assumed: dict[str, float]  # profile fields kept from the base profile (not measured)

    def describe(self) -> str:
        """One line: the measured values used and the assumptions kept."""
        used = ", ".join(f"{k} {v['value']:.2f} s ({v['from']})" for k, v in self.used.items())
        kept = ", ".join(f"{k} {v:g}" for k, v in self.assumed.items())
        when = f", run {self.when}" if self.when else ""
        return f"measured by bench_lab ({self.origin}{when}): {used}; assumed: {kept}"

    def as_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "when": self.when, "used": self.used, "assumed": self.assumed}


def _bench_figure(results: Sequence[dict[str, Any]], what: str) -> dict[str, Any] | None:
    key, prefix = BENCH_FIGURES[what]
    lab = [r for r in results if r.get("module", "lab") == "lab" and "error" not in r]
    for r in [r for r in lab if r.get("key") == key] or [r for r in lab if str(r.get("name", "")).startswith(prefix)]:
        median = r.get("median")
        if isinstance(median, (int, float)) and math.isfinite(median) and int(r.get("n") or 0) > 0:
            return r
    return None


def profile_from_results(
    results: Sequence[dict[str, Any]], base: Profile = FLEETHEAL, *, origin: str, when: str | None = None
) -> BenchProfile:
    """`base` with its platform timings taken from bench_lab's figures (the `results` of benchmarks/run.py).

    From "Xid 79 -> Slurm node drained" (median): detect_hw_s, with isolate_s 0 (the agent's drain is the
    isolation). From "Xid 79 -> job RUNNING again on a spare node" (median, and its per-phase medians when
    recorded): requeue_s = requeue - drained, promote_s = RUNNING again - requeue (without a requeue phase,
    requeue_s = RUNNING again - drained and promote_s 0). From "NCCL timeout -> training running again in
    place" (median), when present: in_place_s. Everything else (application restart, crash and symptom
    detection, replacement lead time, standby share) stays `base`'s: the lab does not measure it.
    """
    drained, running = _bench_figure(results, "drained"), _bench_figure(results, "running")
    if running is None:
        raise BenchResultsError(
            f"{origin}: no lab figure 'Xid 79 -> job RUNNING again' with a median; run the lab benchmark "
            "(`python benchmarks/run.py --only lab`, needs root) or leave out --from-bench for the built-in profile"
        )
    recorded = running.get("phases")
    phases: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    again = float(running["median"])
    if drained is not None:
        drain, drain_from, drain_n = float(drained["median"]), "Xid 79 -> drained, median", drained.get("n")
    elif isinstance(phases.get("drain"), (int, float)):
        drain, drain_from, drain_n = float(phases["drain"]), "Xid 79 drained phase, median", running.get("n")
    else:
        drain, drain_from, drain_n = 0.0, "no drain figure: 0", None
    drain = min(drain, again)
    n = running.get("n")
    used: dict[str, dict[str, Any]] = {
        "detect_hw_s": {"value": drain, "from": drain_from, "n": drain_n},
        "isolate_s": {"value": 0.0, "from": "the agent's drain is the isolation", "n": drain_n},
    }
    requeue = phases.get("requeue")
    if isinstance(requeue, (int, float)) and drain <= requeue <= again:
        used["requeue_s"] = {"value": requeue - drain, "from": "Xid 79 requeue phase - drained, medians", "n": n}
        used["promote_s"] = {"value": again - requeue, "from": "Xid 79 RUNNING again - requeue phase, medians", "n": n}
    else:
        used["requeue_s"] = {"value": again - drain, "from": "Xid 79 RUNNING again - drained, medians", "n": n}
        used["promote_s"] = {"value": 0.0, "from": "no requeue phase recorded: counted in requeue_s", "n": n}
    nccl = _bench_figure(results, "in_place")
    if nccl is not None:
        used["in_place_s"] = {
            "value": float(nccl["median"]),
            "from": "NCCL timeout -> running again in place, median",
            "n": nccl.get("n"),
        }
    profile = replace(base, **{k: v["value"] for k, v in used.items()})
    kept = ("restart_s", "detect_crash_s", "detect_symptom_s", "replace_s", "standby_fraction")
    return BenchProfile(profile, origin, when, used, {k: getattr(base, k) for k in kept})


def profile_from_bench(path: str | os.PathLike[str] = BENCH_RESULTS, base: Profile = FLEETHEAL) -> BenchProfile:
    """`profile_from_results` of a results file (`benchmarks/results/latest.json`)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise BenchResultsError(
            f"{p}: no benchmark results; run `make bench` (or `python benchmarks/run.py --only lab`, needs root) "
            "or leave out --from-bench for the built-in profile"
        ) from exc
    except (OSError, ValueError) as exc:
        raise BenchResultsError(f"{p}: not readable benchmark results: {exc}") from exc
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, list):
        raise BenchResultsError(f"{p}: not benchmarks/run.py results (no 'results' list)")
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    return profile_from_results([r for r in results if isinstance(r, dict)], base, origin=str(p), when=meta.get("when"))


# --- ETTR measured on a lab run ----------------------------------------------------------------------


@dataclass
class Measured:
    """A training run's ETTR from its own events (and the incidents that interrupted it)."""

    allocated_s: float
    productive_s: float
    lost_work_s: float
    down_s: float
    restarts: int
    incidents: list[dict[str, float]]

    @property
    def ettr(self) -> float:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ettr"] = self.ettr
        return d


def measure(
    events: Sequence[dict[str, Any]], now: float | None = None, incidents: Sequence[dict[str, Any]] = ()
) -> Measured | None:
    """ETTR of a lab training run from the job's events (`fleetheal.lab.train`, events.jsonl).

    Allocated time runs from the first start to `now` (or the last event). Productive time is the
    full-pace time of the steps that were kept (the final step count minus the step the first start
    resumed from, times the step time); steps computed and then thrown away by a restart from an older
    checkpoint are lost work; the rest (pending, requeue, restart, checkpoint writes, the grace wait) is
    down time. Each incident from the remediator (its timeline) adds per-phase offsets from the fault.
    """
    from fleetheal.lab.train import ettr as run_ettr  # the lab's own arithmetic: kept steps at full pace / wall

    starts = [e for e in events if e.get("event") == "start"]
    stepped = [e for e in events if "step" in e and e.get("event") in ("checkpoint", "signal", "end", "progress")]
    ratio = run_ettr(list(events), now)
    if not starts or not stepped or ratio is None:
        return None
    step_time = float(starts[0]["step_time"])
    end = float(now if now is not None else stepped[-1]["time"])
    allocated = end - float(starts[0]["time"])
    productive = ratio * allocated
    lost_steps = restarts = 0
    high = int(starts[0].get("resumed_from", 0))
    for e in events[events.index(starts[0]) + 1 :]:
        if e.get("event") == "start":  # a restart: steps beyond the checkpoint it resumed from are redone
            restarts += 1
            lost_steps += max(0, high - int(e.get("resumed_from", 0)))
            high = int(e.get("resumed_from", 0))
        elif "step" in e and e.get("event") in ("checkpoint", "signal", "end", "progress"):
            high = max(high, int(e["step"]))
    lost = min(allocated - productive, lost_steps * step_time)
    timelines = [incident_phases(inc) for inc in incidents]
    return Measured(allocated, productive, lost, allocated - productive - lost, restarts, timelines)


def incident_phases(inc: dict[str, Any]) -> dict[str, float]:
    """Per-phase seconds of a remediator incident as `fleetheal incidents show ID --json` reports them
    (detect, classify, gate, act, total; phases that have not happened are left out)."""
    return {k: float(v) for k, v in (inc.get("phases") or {}).items() if isinstance(v, (int, float))}


# --- CLI ---------------------------------------------------------------------------------------------


def _scales(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"scales are GPU counts separated by commas, got {text!r}") from exc
    if not vals or any(v < GPUS_PER_NODE or v % GPUS_PER_NODE for v in vals):
        raise argparse.ArgumentTypeError(f"each scale must be a positive multiple of {GPUS_PER_NODE} GPUs: {text!r}")
    return vals


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if v < 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _share(text: str) -> float:
    v = _nonneg(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, got {text}")
    return v


def register(sub: Any) -> None:
    p = sub.add_parser(
        "ettr",
        help="effective training time ratio: simulate it at scale",
        description="Effective training time ratio (ETTR). See docs/ettr.md.",
    )
    esub = p.add_subparsers(dest="ettr_command", metavar="SUBCOMMAND", required=True)
    s = esub.add_parser(
        "simulate",
        help="discrete-event model of a training job under Llama 3 failure rates",
        description=(
            "Simulate ETTR of a training job on N GPUs with per-component failure rates (Llama 3 Table 5), "
            "checkpointing, detection, recovery and a warm-standby pool, against a manual-recovery baseline."
        ),
    )
    s.add_argument(
        "--scales", type=_scales, default=list(SCALES), help="GPU counts, e.g. 1024,16384 (default: 1,024 to 131,072)"
    )
    s.add_argument(
        "--profile", choices=sorted(PROFILES), default="fleetheal", help="recovery profile (default fleetheal)"
    )
    s.add_argument("--baseline", choices=sorted(PROFILES), default="manual", help="peer profile (default manual)")
    s.add_argument(
        "--from-bench",
        type=Path,
        nargs="?",
        const=BENCH_RESULTS,
        default=None,
        metavar="RESULTS.json",
        help=(
            "take the fleetheal profile's platform timings (hardware detection, requeue, promotion, restart in "
            "place) from bench_lab's figures in benchmarks/run.py results (default file: benchmarks/results/"
            "latest.json); without it the built-in profile is used (docs/ettr.md). Other tweaks apply on top"
        ),
    )
    s.add_argument(
        "--checkpoint-cost",
        type=_nonneg,
        default=CHECKPOINT_S,
        metavar="S",
        help=f"blocking seconds per checkpoint (default {CHECKPOINT_S:g})",
    )
    s.add_argument(
        "--interval", type=_nonneg, default=None, metavar="S", help="checkpoint interval (default: search for the best)"
    )
    s.add_argument(
        "--standby", type=_share, default=None, metavar="SHARE", help="warm-standby nodes as a share of the job's nodes"
    )
    s.add_argument("--replace", type=_nonneg, default=None, metavar="S", help="replacement node lead time, seconds")
    s.add_argument("--restart", type=_nonneg, default=None, metavar="S", help="application restart seconds")
    s.add_argument("--detect", type=_nonneg, default=None, metavar="S", help="detection seconds for hardware faults")
    s.add_argument(
        "--recovery", type=_nonneg, default=None, metavar="S", help="requeue seconds (alert to job requeued)"
    )
    s.add_argument(
        "--grace-save",
        type=_share,
        default=None,
        metavar="SHARE",
        help="share of interruptions saved by the grace checkpoint",
    )
    s.add_argument(
        "--events", type=_positive_int, default=2_000, help="interruptions per simulated run (default 2,000)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--plot", type=Path, metavar="FILE.png", help="plot ETTR against scale (matplotlib, Agg)")
    s.set_defaults(func=_cmd_simulate)
    m = esub.add_parser(
        "measure",
        help="ETTR of a training run from its events (the lab's jobs/<name>/events.jsonl)",
        description="Measured ETTR of a run: kept steps at full pace over allocated time (docs/ettr.md).",
    )
    m.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run directory with events.jsonl")
    m.add_argument("--now", action="store_true", help="count allocated time up to now (a run still going)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.add_argument(
        "--textfile", type=Path, metavar="FILE.prom", help="write Prometheus gauges for a textfile collector"
    )
    m.set_defaults(func=_cmd_measure)


def _profile_from(args: argparse.Namespace, name: str, tweak: bool, start: Profile | None = None) -> Profile:
    p = start or PROFILES[name]
    if not tweak:
        return p
    changes: dict[str, Any] = {}
    for arg, field in (
        ("standby", "standby_fraction"),
        ("replace", "replace_s"),
        ("restart", "restart_s"),
        ("detect", "detect_hw_s"),
        ("recovery", "requeue_s"),
        ("grace_save", "grace_save"),
    ):
        v = getattr(args, arg)
        if v is not None:
            changes[field] = v
    return replace(p, **changes) if changes else p


def _cmd_simulate(args: argparse.Namespace) -> int:
    from fleetheal.cli import UsageError

    if args.interval is not None and args.interval <= 0:
        raise UsageError("--interval must be > 0 seconds")
    bench: BenchProfile | None = None
    if args.from_bench is not None:
        if args.profile != "fleetheal":
            raise UsageError(
                f"--from-bench measures fleetheal's platform; it does not apply to --profile {args.profile}"
            )
        try:
            bench = profile_from_bench(args.from_bench, PROFILES[args.profile])
        except BenchResultsError as exc:
            raise UsageError(str(exc)) from exc
    profile = _profile_from(args, args.profile, True, bench.profile if bench else None)
    baseline = _profile_from(args, args.baseline, False)
    try:
        results = sweep(
            args.scales,
            [profile, baseline],
            checkpoint_s=args.checkpoint_cost,
            interval_s=args.interval,
            events=args.events,
            seed=args.seed,
        )
    except SimulationError as exc:
        raise UsageError(str(exc)) from exc
    rows: list[dict[str, Any]] = []
    for i in range(0, len(results), 2):
        r, b = results[i], results[i + 1]
        rows.append(
            {
                "gpus": r.gpus,
                "mtbf_h": r.mtbf_s / 3600,
                "ettr": r.ettr,
                "baseline_ettr": b.ettr,
                "best_interval_s": r.interval_s,
                "baseline_best_interval_s": b.interval_s,
                "standby_nodes": profile.standby_nodes(r.gpus),
                "result": r.as_dict(),
                "baseline": b.as_dict(),
            }
        )
    doc = {
        "source": SOURCE,
        "rates_per_gpu_day": {c.name: c.per_gpu_day for c in FAILURE_RATES},
        "profile": asdict(profile),
        "profile_source": bench.as_dict() if bench else {"origin": "built-in", "see": "docs/ettr.md"},
        "baseline": asdict(baseline),
        "checkpoint_s": args.checkpoint_cost,
        "events": args.events,
        "seed": args.seed,
        "rows": rows,
    }
    if args.plot:
        plot(rows, args.plot, profile.name, baseline.name)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"ETTR simulated: profile {profile.name} vs {baseline.name}; rates: {SOURCE}; "
        f"checkpoint cost {args.checkpoint_cost:g} s; {args.events} interruptions per run, seed {args.seed}"
    )
    if bench is not None:
        print(f"platform timings {bench.describe()}")
    elif profile.name == "fleetheal":
        print("platform timings: built-in profile (docs/ettr.md); --from-bench takes them from benchmark results")
    head = (
        f"{'GPUs':>8} {'MTBF':>7} {'ETTR':>7} {'base':>7} {'interval':>9} {'standby':>7} "
        f"{'lost':>6} {'ckpt':>6} {'detect':>6} {'recov':>6} {'wait':>6}"
    )
    print(head)
    for row in rows:
        bd = row["result"]["breakdown"]
        print(
            f"{row['gpus']:>8,} {row['mtbf_h']:>6.2f}h {row['ettr']:>7.2%} {row['baseline_ettr']:>7.2%} "
            f"{row['best_interval_s']:>8.0f}s {row['standby_nodes']:>7} {bd['lost_work']:>6.2%} "
            f"{bd['checkpoint']:>6.2%} {bd['detection']:>6.2%} {bd['recovery']:>6.2%} {bd['waiting']:>6.2%}"
        )
    print(
        "columns lost..wait: share of wall time for the profile; 'base' is the baseline's ETTR at its own best interval"
    )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


METRIC_RATIO = "fleetheal_ettr_effective_training_time_ratio"
METRIC_SECONDS = "fleetheal_ettr_job_seconds"
METRIC_RESTARTS = "fleetheal_ettr_job_restarts"


def prometheus_text(measured: dict[str, Measured]) -> str:
    """Gauges in Prometheus' text format (docs/metrics.md, section ETTR), one series set per job."""
    lines = [
        f"# HELP {METRIC_RATIO} Productive (kept, full-pace) training time over allocated time, per job.",
        f"# TYPE {METRIC_RATIO} gauge",
        *(f'{METRIC_RATIO}{{job="{_esc(j)}"}} {m.ettr:.6f}' for j, m in measured.items()),
        f"# HELP {METRIC_SECONDS} Allocated time of a job by category: allocated, productive, lost_work, down.",
        f"# TYPE {METRIC_SECONDS} gauge",
    ]
    for j, m in measured.items():
        for cat, v in (("allocated", m.allocated_s), ("productive", m.productive_s), ("lost_work", m.lost_work_s),
                       ("down", m.down_s)):  # fmt: skip
            lines.append(f'{METRIC_SECONDS}{{job="{_esc(j)}",category="{cat}"}} {v:.3f}')
    lines += [
        f"# HELP {METRIC_RESTARTS} Restarts of a job's training process (requeues that ran again).",
        f"# TYPE {METRIC_RESTARTS} gauge",
        *(f'{METRIC_RESTARTS}{{job="{_esc(j)}"}} {m.restarts}' for j, m in measured.items()),
    ]
    return "\n".join(lines) + "\n"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _cmd_measure(args: argparse.Namespace) -> int:
    import os
    import time

    from fleetheal.cli import UsageError
    from fleetheal.lab.train import read_events

    found: dict[str, Measured] = {}
    for d in args.run_dirs:
        if not (d / "events.jsonl").is_file():
            raise UsageError(f"{d}: no events.jsonl (not a training run directory)")
        m = measure(read_events(d), time.time() if args.now else None)
        if m is None:
            raise UsageError(f"{d}: the run has not started or reported progress yet")
        found[d.name] = m
    if args.textfile:
        tmp = args.textfile.with_name(f".{args.textfile.name}.tmp")
        tmp.write_text(prometheus_text(found))
        os.replace(tmp, args.textfile)
    if args.json:
        print(json.dumps({k: v.as_dict() for k, v in found.items()}, indent=2))
        return 0
    for name, m in found.items():
        print(f"{name}: ETTR {m.ettr:.3f} over {m.allocated_s:.0f} s (productive {m.productive_s:.1f} s, "
              f"lost work {m.lost_work_s:.1f} s, down {m.down_s:.1f} s, {m.restarts} restarts)")  # fmt: skip
    return 0


def plot(rows: Sequence[dict[str, Any]], path: Path, name: str, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(gpus, [100 * r["ettr"] for r in rows], marker="o", label=name)
    ax.plot(gpus, [100 * r["baseline_ettr"] for r in rows], marker="s", label=f"{baseline} (baseline)")
    ax.axhline(98.5, color="grey", linestyle="--", linewidth=1, label="goal 98.5%")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [f"{g:,}" for g in gpus], rotation=30)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("ETTR at the best checkpoint interval (%)")
    ax.set_title("Simulated ETTR, Llama 3 Table 5 failure rates")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
