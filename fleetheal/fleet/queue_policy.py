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

import heapq
import math
from collections.abc import Iterable, Sequence
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


def parse_csv(lines: Iterable[str]) -> list[Job]:
    """Jobs from `submit_s,gpus,duration_s` lines; '#' comments and blank lines are skipped."""
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
        if not (math.isfinite(submit) and math.isfinite(dur)) or submit < 0 or dur < 0 or gpus < 1:
            raise TraceError(f"line {n}: need submit_s >= 0, gpus >= 1, duration_s >= 0: {text!r}")
        jobs.append(Job(submit, gpus, dur, n))
    return sorted(jobs, key=lambda j: (j.submit, j.line))


def _time(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def parse_sacct(lines: Iterable[str]) -> list[Job]:
    """Jobs from `sacct --parsable2 --format=Submit,Start,End,ReqTRES` (header line required, columns
    found by name; AllocTRES accepted when ReqTRES is absent). Jobs without GPUs, never started
    (Start `Unknown`/`None`) or still running (End `Unknown`) are skipped; submit times are made
    relative to the first job."""
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
        rows.append((submit, gpus, end - start, n))
    if not cols:
        raise TraceError("line 1: empty trace (no header)")
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
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
    pool (no node fragmentation). Jobs larger than the pool are skipped and counted."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    fit = [j for j in jobs if j.gpus <= total_gpus]
    skipped = len(jobs) - len(fit)
    order = sorted(range(len(fit)), key=lambda i: (fit[i].submit, i))
    running: list[tuple[float, int, int]] = []  # (end, gpus, large?)
    pending: list[int] = []
    start: dict[int, float] = {}
    free = total_gpus
    small_used = 0
    large_used = 0
    now = 0.0
    nxt = 0

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

    def schedule() -> None:
        nonlocal pending
        if policy == "fifo":
            while pending and fit[pending[0]].gpus <= free:
                launch(pending.pop(0))
        elif policy == "backfill":
            while pending and fit[pending[0]].gpus <= free:
                launch(pending.pop(0))
            if not pending:
                return
            shadow, extra = reservation(fit[pending[0]].gpus)
            keep = [pending[0]]
            for i in pending[1:]:
                j = fit[i]
                if j.gpus <= free and (now + j.duration <= shadow or j.gpus <= extra):
                    if now + j.duration > shadow:
                        extra -= j.gpus
                    launch(i)
                else:
                    keep.append(i)
            pending = keep
        else:
            ordered = sorted(
                pending, key=lambda i: (-priority(fit[i].gpus, now - fit[i].submit, cfg), fit[i].submit, i)
            )
            large_waiting = [i for i in ordered if is_large(fit[i].gpus, small_max)]
            started: set[int] = set()
            at = 0

            def lent_limit() -> int:
                """The small queue's limit now; with `reclaim`, lending stops by the size of the first large job
                waiting once it has waited `reclaim_after_s` (until then its backfill reservation protects it)."""
                nonlocal at
                while at < len(large_waiting) and large_waiting[at] in started:
                    at += 1
                head = fit[large_waiting[at]] if at < len(large_waiting) else None
                reclaim = cfg.reclaim and head is not None and now - head.submit > cfg.reclaim_after_s
                return small_limit(total_gpus, large_used, head.gpus if head and reclaim else 0, cfg)

            def may_start(i: int) -> bool:
                j = fit[i]
                return j.gpus <= free and (is_large(j.gpus, small_max) or small_used + j.gpus <= lent_limit())

            blocked: int | None = None
            for i in ordered:  # priority order while jobs start; the first large job that cannot blocks
                if may_start(i):
                    launch(i)
                    started.add(i)
                elif is_large(fit[i].gpus, small_max):
                    blocked = i
                    break
            if blocked is not None:  # it gets a reservation; the others backfill without delaying it
                shadow, extra = reservation(fit[blocked].gpus)
                for i in ordered:
                    j = fit[i]
                    if i in started or i == blocked or not may_start(i):
                        continue
                    if now + j.duration <= shadow or j.gpus <= extra:
                        if now + j.duration > shadow:
                            extra -= j.gpus
                        launch(i)
                        started.add(i)
            pending = [i for i in pending if i not in started]

    while nxt < len(order) or running or pending:
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
            pending.append(order[nxt])
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
    return Result(policy, total_gpus, len(fit), skipped, util, waits, [start[i] for i in range(len(fit))])


def parse_clusters(text: str) -> list[tuple[int, int]]:
    """`N:GPUS[,N:GPUS...]`: N nodes of GPUS GPUs each; each size is replayed separately."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        n, sep, g = part.strip().partition(":")
        if not sep or not n.isdigit() or not g.isdigit() or int(n) < 1 or int(g) < 1:
            raise ValueError(f"--clusters: {part!r} is not NODES:GPUS_PER_NODE (e.g. 4:8)")
        out.append((int(n), int(g)))
    return out


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
