"""The ETTR simulator: a discrete-event model with the standard library only and a seeded `random.Random`.

* A job on N GPUs (N/8 nodes) runs compute segments of `interval` seconds, each followed by a blocking
  checkpoint of `checkpoint` seconds. Interruptions arrive as a Poisson process whose rate is the sum of
  per-component, per-GPU-day rates times N (default: Llama 3 Table 5, `fleetheal.ettr.rates`) while the job
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
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from fleetheal.ettr.rates import FAILURE_RATES, Component

DAY_S = 86_400.0
GPUS_PER_NODE = 8
SCALES = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, 131_072)
CATEGORIES = ("productive", "lost_work", "checkpoint", "detection", "recovery", "waiting")
#: fleetheal's goal for a large job's ETTR (a share of wall time); benchmarks/bench_ettr.py measures against it.
GOAL = 0.985
# Blocking part of a checkpoint (assumption: asynchronous checkpointing, snapshot to host memory blocks,
# the write to storage overlaps training). docs/ettr.md shows how ETTR moves with it.
CHECKPOINT_S = 2.0


@dataclass(frozen=True)
class Profile:
    """How interruptions are handled; every time in seconds (fleetheal.ettr.profile has the profiles)."""

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
    profile: Profile,
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


def best_interval(
    gpus: int,
    profile: Profile,
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
