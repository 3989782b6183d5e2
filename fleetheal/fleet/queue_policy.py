"""Queues inside one cluster, decided: a large-job queue and a small-job queue that share one GPU pool.

The policy (`small_limit`, `priority`) is one pure function pair used by the trace simulator
(`simulate`) so that what is measured is what would run. Non-preemptive: lending is stopped, never
taken back from running jobs; a large job that waits raises its own priority with age and size, so it
cannot starve behind a stream of small jobs.

Trace formats (docs/queues.md):
- csv: `submit_s,gpus,duration_s` per line (a header line naming those columns is allowed).
- sacct: `sacct --parsable2 --format=Submit,Start,End,ReqTRES` (or AllocTRES); GPUs are read from
  `gres/gpu=N` (typed `gres/gpu:h100=N` counts too); a job that never started is skipped.

The live controller's decision is here too (`Load`, `load_of`, `decide`); fleetheal.fleet.queues reads and
writes Slurm for it and is the command (`fleetheal queue replay|lend`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from fleetheal.fleet.config import Placement, Queues
from fleetheal.slurm.fields import SEP
from fleetheal.slurm.gres import tres_gpus

if TYPE_CHECKING:
    from fleetheal.fleet.view import ClusterStatus

POLICIES = ("fifo", "backfill", "lend")


class TraceError(ValueError):
    """A trace line that cannot be read: says which line and what is wrong."""


@dataclass(frozen=True)
class Job:
    """One job of a trace: submitted at `submit` (s), asks for `gpus`, runs `duration` seconds."""

    submit: float
    gpus: int
    duration: float
    line: int = 0


# -- policy (pure) -----------------------------------------------------------------------------------


#: The default size threshold (the fleet file's `placement.small_job_max_gpus`, the one definition of "small").
SMALL_JOB_MAX_GPUS = Placement().small_job_max_gpus


def is_large(gpus: int, small_max: int = SMALL_JOB_MAX_GPUS) -> bool:
    """A job is large when it asks for more than `small_max` GPUs (`placement.small_job_max_gpus`)."""
    return gpus > small_max


def priority(gpus: int, waited_s: float, cfg: Queues) -> float:
    """Aging priority: grows with waiting time and requested GPUs, so the longest-waiting large job
    eventually outranks everything behind it."""
    return cfg.age_weight_per_hour * waited_s / 3600.0 + cfg.size_weight_per_gpu * gpus


def small_limit(total_gpus: int, large_running_gpus: int, large_head_gpus: int, cfg: Queues) -> int:
    """GPUs the small queue may hold (its QOS GrpTRES gres/gpu). Lends the large queue's idle GPUs, less
    `large_head_gpus`, what the highest-priority waiting large job needs (0 when none waits): while a
    large job waits, lending shrinks by its size so GPUs freed by finishing small jobs go to it
    (reclaim without preemption). Never below the guarantee, never above the pool."""
    guaranteed = min(cfg.small_guaranteed_gpus, total_gpus)
    idle_large = total_gpus - guaranteed - large_running_gpus - cfg.lend_reserve_gpus - large_head_gpus
    return guaranteed + max(0, idle_large)


# -- trace parsers ------------------------------------------------------------------------------------

#: The largest values a trace may hold. No real trace comes near them, and beyond them the simulator's
#: arithmetic stops meaning anything (1e308 + a run time overflows to inf; past 2**53 s a float no longer
#: resolves a second), so a value above one is a mistake in the trace and the parser says which line.
#: Submit times: a CSV's are seconds from any origin, so a Unix time must pass: 2**32 s is February 2106
#: as a Unix time (136 years from any other origin), and there a float still resolves a microsecond.
#: For sacct, the bound is on submit times relative to the earliest job (the trace's span).
MAX_SUBMIT_S = float(2**32)
#: Run times: ten years (365-day years), longer than any job's time limit on any cluster.
MAX_DURATION_S = 10 * 365 * 24 * 3600.0
#: GPUs one job asks for: a million, beyond the largest clusters built. A job larger than the replayed
#: pool but within this bound is not an error: it is skipped and counted (`skipped_too_large`).
MAX_JOB_GPUS = 1_000_000
#: GPUs of one replayed pool (`--clusters` NODES x GPUS_PER_NODE): the same million.
MAX_POOL_GPUS = MAX_JOB_GPUS


def _check_job(n: int, submit: float, gpus: int, dur: float, text: str) -> None:
    """TraceError unless the job is one a real trace can hold: finite, not negative, within the bounds."""
    if not (math.isfinite(submit) and math.isfinite(dur)) or submit < 0 or dur < 0 or gpus < 1:
        raise TraceError(f"line {n}: need submit_s >= 0, gpus >= 1, duration_s >= 0: {text!r}")
    for name, value, bound, what in (
        ("submit_s", submit, MAX_SUBMIT_S, "2**32 s, 2106 as a Unix time"),
        ("gpus", gpus, MAX_JOB_GPUS, "a million GPUs"),
        ("duration_s", dur, MAX_DURATION_S, "10 years"),
    ):
        if value > bound:
            raise TraceError(f"line {n}: {name} {value!r} is above the bound {bound:.0f} ({what}): {text!r}")


def parse_csv(lines: Iterable[str]) -> list[Job]:
    """Jobs from `submit_s,gpus,duration_s` lines; '#' comments and blank lines are skipped. Values beyond
    MAX_SUBMIT_S, MAX_JOB_GPUS or MAX_DURATION_S are errors."""
    jobs: list[Job] = []
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        parts = [p.strip() for p in text.split(",")]
        if n == 1 and parts and parts[0].lower().startswith("submit"):
            continue
        if len(parts) != 3:
            raise TraceError(f"line {n}: expected 3 fields submit_s,gpus,duration_s, got {len(parts)}")
        try:
            submit, gpus, dur = float(parts[0]), int(parts[1]), float(parts[2])
        except ValueError:
            raise TraceError(f"line {n}: not numbers: {text!r}") from None
        _check_job(n, submit, gpus, dur, text)
        jobs.append(Job(submit, gpus, dur, n))
    return sorted(jobs, key=lambda j: (j.submit, j.line))


def _time(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def parse_sacct(lines: Iterable[str]) -> list[Job]:
    """Jobs from `sacct --parsable2 --format=Submit,Start,End,ReqTRES` (header line required, columns
    found by name; AllocTRES accepted when ReqTRES is absent). Jobs without GPUs, never started
    (Start `Unknown`/`None`) or still running (End `Unknown`) are skipped; submit times are made
    relative to the first job. A span beyond MAX_SUBMIT_S, a run time beyond MAX_DURATION_S or more GPUs
    than MAX_JOB_GPUS are errors."""
    it = iter(enumerate(lines, 1))
    cols: list[str] = []
    rows: list[tuple[float, int, float, int]] = []
    for n, raw in it:
        text = raw.rstrip("\n")
        if not text.strip():
            continue
        fields = text.split("|")
        if not cols:
            cols = fields
            for need in ("Submit", "Start", "End"):
                if need not in cols:
                    raise TraceError(f"line {n}: header lacks column {need!r} (got {text!r})")
            if "ReqTRES" not in cols and "AllocTRES" not in cols:
                raise TraceError(f"line {n}: header lacks ReqTRES or AllocTRES")
            continue
        if len(fields) != len(cols):
            raise TraceError(f"line {n}: {len(fields)} fields, header has {len(cols)}")
        row = dict(zip(cols, fields, strict=True))
        if row["Start"] in ("Unknown", "None", "") or row["End"] in ("Unknown", "None", ""):
            continue
        tres = row.get("ReqTRES") or row.get("AllocTRES") or ""
        try:
            gpus = tres_gpus(tres)
            submit, start, end = _time(row["Submit"]), _time(row["Start"]), _time(row["End"])
        except ValueError as exc:
            raise TraceError(f"line {n}: {exc}") from None
        if gpus < 1:
            continue
        if end < start:
            raise TraceError(f"line {n}: End before Start")
        _check_job(n, 0.0, gpus, end - start, text)
        rows.append((submit, gpus, end - start, n))
    if not cols:
        raise TraceError("line 1: empty trace (no header)")
    if not rows:
        return []
    t0, _, _, first = min(rows)
    for s, _, _, n in rows:
        if s - t0 > MAX_SUBMIT_S:
            raise TraceError(
                f"line {n}: submitted {s - t0:.0f} s after the earliest job (line {first}), above the bound "
                f"{MAX_SUBMIT_S:.0f} (2**32 s, 136 years)"
            )
    return sorted((Job(s - t0, g, d, n) for s, g, d, n in rows), key=lambda j: (j.submit, j.line))


# -- simulator ---------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one policy did with one trace on one pool."""

    policy: str
    total_gpus: int
    jobs: int
    skipped: int
    utilisation: float
    waits: dict[str, list[float]] = field(default_factory=dict)
    starts: list[float] = field(default_factory=list)
    #: Look-ups of the waiting jobs the scheduler made (each O(log jobs)): what a replay costs, bounded by
    #: about (jobs + events) x job sizes; not part of the summary.
    steps: int = 0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "total_gpus": self.total_gpus,
            "jobs": self.jobs,
            "skipped_too_large": self.skipped,
            "utilisation": round(self.utilisation, 4),
        }
        for cls in ("small", "large"):
            w = sorted(self.waits.get(cls, []))
            out[f"{cls}_jobs"] = len(w)
            out[f"{cls}_wait_p50_s"] = _pct(w, 50)
            out[f"{cls}_wait_p99_s"] = _pct(w, 99)
        out["large_wait_max_s"] = max(self.waits.get("large", []), default=0.0)
        return out


def _pct(sorted_vals: Sequence[float], p: float) -> float:
    if not sorted_vals:
        return 0.0
    k = max(0, math.ceil(p / 100 * len(sorted_vals)) - 1)
    return float(sorted_vals[k])


#: The order a scheduling pass goes through waiting jobs: (-priority or 0, submit time, index).
_Key = tuple[float, float, int]
#: `_Waiting.first`'s default bound: every finite run time is within it, a place that holds no job (inf) is not.
_ANY = sys.float_info.max


class _Waiting:
    """The jobs of one size (GPUs) of a trace, in submit order, and which of them wait now: a min-tree of their
    run times over their places in that order (inf where a job waits not: not submitted yet, or started). The
    scheduler asks it for the first waiting job, or the first that ends by a time, in O(log jobs), where
    walking the queue cost O(waiting jobs) per event: the replay's quadratic part. One order serves every
    policy: jobs of one size differ in `priority` only by age, so its order among them is submit order."""

    __slots__ = ("_min", "_size", "count", "gpus", "head", "jobs", "large")

    def __init__(self, gpus: int, large: bool, jobs: list[int]) -> None:
        self.gpus, self.large, self.jobs = gpus, large, jobs
        self.count = 0  # jobs that wait now
        self.head = -1  # the place of the first of them, -1 when none waits
        size = 1
        while size < len(jobs):
            size *= 2
        self._size = size
        self._min = [math.inf] * (2 * size)

    def add(self, place: int, duration: float) -> None:
        """The job at `place` (in `jobs`) is submitted and waits."""
        t = self._min
        k = place + self._size
        t[k] = duration
        k >>= 1
        while k and t[k] > duration:
            t[k] = duration
            k >>= 1
        if not self.count:  # jobs are submitted in place order: a later one is never the first
            self.head = place
        self.count += 1

    def remove(self, place: int) -> None:
        """The job at `place` started."""
        t = self._min
        k = place + self._size
        t[k] = math.inf
        k >>= 1
        while k:
            low = t[2 * k] if t[2 * k] <= t[2 * k + 1] else t[2 * k + 1]
            if t[k] == low:
                break
            t[k] = low
            k >>= 1
        self.count -= 1
        if place == self.head:
            self.head = self.first(place + 1)

    def first(self, lo: int, now: float = 0.0, by: float = _ANY) -> int:
        """The first place >= `lo` of a waiting job with `now + duration <= by` (by default: any waiting job),
        or -1. The test is the scheduler's own expression, and a float sum grows with the run time, so a
        subtree whose shortest job fails it holds none that passes."""
        t, size = self._min, self._size
        if lo >= size:
            return -1
        k = lo + size
        while True:
            if now + t[k] <= by:
                while k < size:
                    k *= 2
                    if not now + t[k] <= by:
                        k += 1
                return k - size
            while k & 1:  # a right child: the next range begins after its parent's
                k >>= 1
            if not k:
                return -1
            k += 1

    def after(
        self, lo: int, cursor: _Key | None, key: Callable[[int], _Key], now: float = 0.0, by: float = _ANY
    ) -> int:
        """`first`, among the jobs that come after `cursor` in `key` order (an order this size keeps)."""
        p = self.first(max(lo, self.head), now, by)
        if p >= 0 and cursor is not None and key(self.jobs[p]) < cursor:
            p = self.first(bisect.bisect_right(self.jobs, cursor, p, key=key), now, by)
        return p


def simulate(
    jobs: Sequence[Job], total_gpus: int, policy: str, cfg: Queues, small_max: int = SMALL_JOB_MAX_GPUS
) -> Result:
    """Replay `jobs` on one pool of `total_gpus` GPUs with `policy` (fifo, backfill, lend).

    fifo: strict submit order, the head blocks. backfill: EASY backfill in submit order (the head gets a
    reservation at the earliest time enough GPUs free; a later job starts now if it fits and does not
    delay that reservation; durations are known exactly). lend: what a cluster runs with this module's
    controller: Slurm's backfill (an EASY reservation for the highest-priority job that cannot start) in
    `priority` order (age and size), and the small queue capped by `small_limit`, which lends the large
    queue's idle GPUs and stops lending while a large job waits. Non-preemptive throughout. GPUs are one
    pool (no node fragmentation). Jobs larger than the pool are skipped and counted.

    Cost: an event (submits or ends at one time) looks at the waiting jobs size by size (`_Waiting`), not
    one by one, so a replay takes about (jobs + events) x sizes x log(jobs) steps, however long the queue
    grows; `Result.steps` counts them."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    if not (math.isfinite(cfg.age_weight_per_hour) and cfg.age_weight_per_hour >= 0):
        # A negative weight would rank older jobs lower (starving them), and order jobs of one size
        # newest first, which `_Waiting` does not keep.
        raise ValueError(f"queues.age_weight_per_hour: {cfg.age_weight_per_hour!r} is not a finite number >= 0")
    if not math.isfinite(cfg.size_weight_per_gpu):
        raise ValueError(f"queues.size_weight_per_gpu: {cfg.size_weight_per_gpu!r} is not a finite number")
    fit = [j for j in jobs if j.gpus <= total_gpus]
    skipped = len(jobs) - len(fit)
    order = sorted(range(len(fit)), key=lambda i: (fit[i].submit, i))
    by_size: dict[int, list[int]] = {}
    for i in order:
        by_size.setdefault(fit[i].gpus, []).append(i)
    sizes = [_Waiting(g, is_large(g, small_max), by_size[g]) for g in sorted(by_size)]  # smallest first
    size_of = {q.gpus: q for q in sizes}
    place = [0] * len(fit)
    for q in sizes:
        for p, i in enumerate(q.jobs):
            place[i] = p
    smalls = [q for q in sizes if not q.large]
    running: list[tuple[float, int, int]] = []  # (end, gpus, large?)
    start: dict[int, float] = {}
    free = total_gpus
    small_used = 0
    large_used = 0
    now = 0.0
    nxt = 0  # order[nxt]: the next job to be submitted
    head = 0  # order[head]: the first submitted job that has not started (fifo's and backfill's head)
    steps = 0

    def launch(i: int) -> None:
        nonlocal free, small_used, large_used
        j = fit[i]
        start[i] = now
        free -= j.gpus
        big = is_large(j.gpus, small_max)
        if big:
            large_used += j.gpus
        else:
            small_used += j.gpus
        heapq.heappush(running, (now + j.duration, j.gpus, int(big)))
        if policy != "fifo":
            size_of[j.gpus].remove(place[i])

    def waiting() -> bool:
        """Whether a submitted job has not started; moves `head` to the first such job."""
        nonlocal head
        while head < nxt and order[head] in start:
            head += 1
        return head < nxt

    def any_fits() -> bool:
        """Whether a waiting job asks for no more GPUs than are free: if none does, nothing starts now."""
        for q in sizes:
            if q.gpus > free:
                return False
            if q.count:
                return True
        return False

    def reservation(gpus: int) -> tuple[float, int]:
        """When a job of `gpus` GPUs can start at the earliest (running jobs end on time), and the GPUs free
        then beyond it: what EASY backfill protects."""
        avail, shadow = free, now
        for end, g, _ in sorted(running):
            if avail >= gpus:
                break
            avail += g
            shadow = end
        return shadow, avail - gpus

    def submit_order(i: int) -> _Key:
        return (0.0, fit[i].submit, i)

    def priority_order(i: int) -> _Key:
        return (-priority(fit[i].gpus, now - fit[i].submit, cfg), fit[i].submit, i)

    def backfill(shadow: float, extra: int, key: Callable[[int], _Key], may: Callable[[_Waiting], bool]) -> None:
        """Walk the waiting jobs in `key` order once and start each that fits in the free GPUs, is of a size
        that `may` start, and does not delay a reservation at `shadow`: it ends by then, or fits in the
        `extra` GPUs free beside it. Done size by size: a job passed over fails at its turn, so the next to
        start is the first, in `key` order after the last started (`cursor`), of each size's first job that
        passes now (found in that size's `_Waiting`: a size passes or not as a whole, and within it only
        the run time matters)."""
        nonlocal steps
        cursor: _Key | None = None
        lo: dict[int, int] = {}  # by size: no job before this place passes any more
        while True:
            best, best_key = -1, (0.0, 0.0, 0)
            for q in sizes:
                if q.gpus > free:
                    break
                if not q.count or not may(q):
                    continue
                steps += 1
                if q.gpus <= extra:
                    p = q.after(lo.get(q.gpus, 0), cursor, key)
                else:
                    p = q.after(lo.get(q.gpus, 0), cursor, key, now, shadow)
                if p < 0:
                    continue
                lo[q.gpus] = p
                k = key(q.jobs[p])
                if best < 0 or k < best_key:
                    best, best_key = q.jobs[p], k
            if best < 0:
                return
            j = fit[best]
            if now + j.duration > shadow:
                extra -= j.gpus
            launch(best)
            cursor = best_key

    def lend() -> None:
        """Slurm's backfill in priority order under the lending limit (see `simulate`). In priority order,
        jobs start while they may; the first large job that cannot start blocks, gets a reservation, and the
        others backfill without delaying it. The limit on small jobs depends on the large job next in line,
        so the first pass goes from one large job to the next: between two, the next small job to start is
        the first in priority order of each size's first job after the `cursor` (sizes with room only)."""
        nonlocal steps
        cursor: _Key | None = None  # the last job passed, in priority order
        lo: dict[int, int] = {}
        blocked = -1
        while True:
            nxt_large, nxt_key = -1, (0.0, 0.0, 0)  # every large job before the cursor has started
            for q in sizes:
                if q.large and q.count:
                    steps += 1
                    i = q.jobs[q.head]
                    k = priority_order(i)
                    if nxt_large < 0 or k < nxt_key:
                        nxt_large, nxt_key = i, k
            # With `reclaim`, lending stops by the size of the first large job waiting once it has waited
            # `reclaim_after_s` (until then its backfill reservation protects it).
            reclaim = cfg.reclaim and nxt_large >= 0 and now - fit[nxt_large].submit > cfg.reclaim_after_s
            limit = small_limit(total_gpus, large_used, fit[nxt_large].gpus if reclaim else 0, cfg)
            found: dict[int, tuple[_Key, int] | None] = {}  # size -> (key, place) ahead
            while True:
                room = min(free, limit - small_used)
                best: tuple[_Key, int, _Waiting] | None = None
                for q in smalls:
                    if q.gpus > room:
                        break
                    if not q.count:
                        continue
                    if q.gpus not in found:
                        steps += 1
                        p = q.after(lo.get(q.gpus, 0), cursor, priority_order)
                        found[q.gpus] = None if p < 0 else (priority_order(q.jobs[p]), p)
                    ahead = found[q.gpus]
                    if ahead is None or (nxt_large >= 0 and ahead[0] > nxt_key):
                        continue
                    if best is None or ahead[0] < best[0]:
                        best = (ahead[0], ahead[1], q)
                if best is None:
                    break
                cursor, p, q = best
                lo[q.gpus] = p
                del found[q.gpus]
                launch(q.jobs[p])
            if nxt_large < 0:
                return
            if fit[nxt_large].gpus > free:
                blocked = nxt_large
                break
            launch(nxt_large)
            cursor = nxt_key
        # The blocked job is the first large job that has not started, so the lending limit is its own
        # now; it cannot start (more GPUs than free), so the backfill pass never picks it.
        b = fit[blocked]
        head_gpus = b.gpus if cfg.reclaim and now - b.submit > cfg.reclaim_after_s else 0
        shadow, extra = reservation(b.gpus)
        backfill(
            shadow,
            extra,
            priority_order,
            lambda q: q.large or small_used + q.gpus <= small_limit(total_gpus, large_used, head_gpus, cfg),
        )

    def schedule() -> None:
        nonlocal head
        if policy == "lend":
            if any_fits():
                lend()
            return
        while waiting() and fit[order[head]].gpus <= free:
            launch(order[head])
        if policy == "fifo" or head >= nxt or not any_fits():
            return
        shadow, extra = reservation(fit[order[head]].gpus)
        backfill(shadow, extra, submit_order, lambda q: True)

    while nxt < len(order) or running or waiting():
        t_sub = fit[order[nxt]].submit if nxt < len(order) else math.inf
        t_end = running[0][0] if running else math.inf
        if t_sub == math.inf and t_end == math.inf:
            break  # only possible if pending jobs can never fit; excluded by `fit`
        now = min(t_sub, t_end)
        while running and running[0][0] <= now:
            _, g, big = heapq.heappop(running)
            free += g
            if big:
                large_used -= g
            else:
                small_used -= g
        while nxt < len(order) and fit[order[nxt]].submit <= now:
            i = order[nxt]
            if policy != "fifo":
                size_of[fit[i].gpus].add(place[i], fit[i].duration)
            nxt += 1
        schedule()
    waits: dict[str, list[float]] = {"small": [], "large": []}
    busy = 0.0
    first = min((j.submit for j in fit), default=0.0)
    last = first
    for i, j in enumerate(fit):
        waits["large" if is_large(j.gpus, small_max) else "small"].append(start[i] - j.submit)
        busy += j.gpus * j.duration
        last = max(last, start[i] + j.duration)
    span = last - first
    util = busy / (total_gpus * span) if span > 0 else 0.0
    starts = [start[i] for i in range(len(fit))]
    return Result(policy, total_gpus, len(fit), skipped, util, waits, starts, steps)


def parse_clusters(text: str) -> list[tuple[int, int]]:
    """`N:GPUS[,N:GPUS...]`: N nodes of GPUS GPUs each; each size is replayed separately. A pool of more than
    MAX_POOL_GPUS GPUs is an error."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        n, sep, g = part.strip().partition(":")
        if not sep or not _count(n) or not _count(g) or int(n) < 1 or int(g) < 1:
            raise ValueError(f"--clusters: {part!r} is not NODES:GPUS_PER_NODE (e.g. 4:8)")
        if int(n) * int(g) > MAX_POOL_GPUS:
            raise ValueError(f"--clusters: {part!r} is more GPUs than the bound, {MAX_POOL_GPUS} in one pool")
        out.append((int(n), int(g)))
    return out


def _count(text: str) -> bool:
    """ASCII digits only: str.isdigit also takes '²', which int() refuses."""
    return text.isascii() and text.isdigit()


def replay(
    jobs: Sequence[Job], total_gpus: int, cfg: Queues, small_max: int = SMALL_JOB_MAX_GPUS
) -> list[dict[str, Any]]:
    """All three policies on the same trace and pool, with ratios to fifo and backfill."""
    res = [simulate(jobs, total_gpus, p, cfg, small_max).summary() for p in POLICIES]
    by = {r["policy"]: r for r in res}
    for r in res:
        for base in ("fifo", "backfill"):
            b = by[base]
            r[f"utilisation_vs_{base}"] = round(r["utilisation"] / b["utilisation"], 4) if b["utilisation"] else None
            bl = b["large_wait_max_s"]
            r[f"large_wait_max_vs_{base}"] = round(r["large_wait_max_s"] / bl, 4) if bl else None
    return res


# -- the live controller's decision -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One cluster's GPUs as the controller sees them (fleetheal.fleet.view's reads of the cluster)."""

    total_gpus: int
    large_running: int
    small_running: int
    #: GPUs of the highest-priority pending large job (0: none waits), and how long it has waited.
    head_gpus: int = 0
    head_waited_s: float = 0.0


#: Pending large jobs by priority, for `reclaim` (the fleet status reads have neither priority nor submit time).
HEAD_FIELDS = ("JobID", "PriorityLong", "SubmitTime")


def load_of(cluster: ClusterStatus, cfg: Queues, heads: str = "", now: float = 0.0) -> Load:
    """The Load of a cluster as fleetheal.fleet.view reads it. `heads`: `squeue -O JobID,PriorityLong,
    SubmitTime` of its pending large jobs (read only with `reclaim`), for the head and its wait."""
    total = sum(g.total for g in cluster.gpus.values())
    running = [j for j in cluster.jobs if j.state == "running"]
    large = sum(j.gpus for j in running if j.qos == cfg.large_qos)
    small = sum(j.gpus for j in running if j.qos == cfg.small_qos)
    gpus = {j.id: j.gpus for j in cluster.jobs if j.state == "pending" and j.qos == cfg.large_qos and j.gpus}
    waiting: list[tuple[int, float, int]] = []  # (priority, submit, gpus)
    for line in heads.splitlines():
        parts = [f.strip() for f in line.split(SEP)]
        if len(parts) >= len(HEAD_FIELDS) and parts[0] in gpus and parts[1].isdigit():
            submit = _time(parts[2]) if parts[2][:1].isdigit() else now
            waiting.append((int(parts[1]), submit, gpus[parts[0]]))
    head = max(waiting, key=lambda w: (w[0], -w[1]), default=None)
    if head is None:
        return Load(total, large, small)
    return Load(total, large, small, head[2], max(0.0, now - head[1]))


def decide(load: Load, cfg: Queues) -> int:
    """The small QOS's GrpTRES gres/gpu for `load`: `small_limit`, with the waiting large job's size taken
    back only with `reclaim` and once it has waited `reclaim_after_s` (the simulator's `lend` rule)."""
    reclaim = cfg.reclaim and load.head_gpus > 0 and load.head_waited_s > cfg.reclaim_after_s
    return small_limit(load.total_gpus, load.large_running, load.head_gpus if reclaim else 0, cfg)
