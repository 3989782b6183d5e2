"""Training signals: parse reports from `fleetheal.agent.client` and judge them. Pure logic.

A report is one JSON object per datagram (protocol version 1)::

    {"v": 1, "job": "4242", "rank": 3, "step": 1200, "step_time": 0.41, "loss": 2.31, "gpu": 3}

`job` (string), `rank` and `step` (integers >= 0) are required; `step_time` (seconds), `loss` (a number,
or the strings "nan"/"inf"/"-inf") and `gpu` (the physical GPU index on this node) are optional; a
report with `"event": "end"` says the rank finished and forgets it. Anything else is malformed and
counted, never fatal.

A line of the job's own output (`fleetheal launch` sends the lines its rules flag) is a report with
`"event": "line"`, the text in `line` (at most MAX_OUTPUT_LINE characters), the launcher's restart count
in `run` and Slurm's (SLURM_RESTART_COUNT) in `requeues` (both optional); `rank` and `step` may be left out.
The agent classifies the text itself (`fleetheal.agent.joboutput`): the sender's judgement is never taken.

Judgements, per job and rank: NaN/Inf loss (`nan-loss`), a loss far above its running mean
(`loss-spike`), a rank whose step time is far above its peers' median (`straggler`), and a hang: no step
progress on every rank for `hang_timeout_s` (`job-hang`). In a collective hang every rank stops, but the
rank that stopped first (lowest last step, then earliest last progress) is the one that broke — a dead
NIC or GPU freezes its peers within seconds — so it alone is named as the suspect (`hang_suspect`).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetheal.agent.client import MAX_OUTPUT_LINE
from fleetheal.agent.health import Detection, gpu_label

SOURCE = "training"
_SLURM_JOB_ID = re.compile(r"[0-9]{1,10}(_[0-9]{1,10})?")


def slurm_job_id(job: str) -> str:
    """`job` when it is a Slurm job id (what the client sends under Slurm), else "" (a torchrun run id
    or "local" names no job the remediator could act on alone)."""
    return job if _SLURM_JOB_ID.fullmatch(job) else ""


def run_label(requeues: int | None, restarts: int | None) -> str:
    """Which run of a Slurm job printed a line: "REQUEUES.RESTARTS" (Slurm's restart count of the job, then
    `fleetheal launch`'s restarts inside that allocation), "" when neither is known. A fault of a later run is
    a new fault (`health.ActiveFault.key`): the job's next NCCL timeout is acted on, whenever it comes."""
    if requeues is None and restarts is None:
        return ""
    return f"{requeues or 0}.{restarts or 0}"


_JOB = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: Bounds of the integer fields: a rank of the largest jobs, a step count, a GPU index on one node.
MAX_RANK = 1 << 24
MAX_STEP = 1 << 62
MAX_GPU = 255


class ReportRefused(ValueError):
    """A report the agent does not take (malformed, unauthorised or over a limit); the message says why."""


class MalformedReport(ReportRefused):
    """A report that is not valid protocol-1 JSON; the message says which field is wrong."""


@dataclass(frozen=True, slots=True)
class Report:
    job: str
    rank: int
    step: int
    step_time: float | None = None
    loss: float | None = None
    gpu: int | None = None
    end: bool = False
    #: A line of the job's own output (`"event": "line"`), None for a progress report.
    line: str | None = None
    #: The launcher's restart count when it sent `line` (None: unknown).
    run: int | None = None
    #: Slurm's restart count of the job (SLURM_RESTART_COUNT) when it sent `line` (None: unknown).
    requeues: int | None = None


def parse_report(data: bytes) -> Report:
    """One datagram -> Report; MalformedReport otherwise."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedReport(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MalformedReport("not a JSON object")
    if doc.get("v", 1) != 1:
        raise MalformedReport(f"unsupported protocol version {doc.get('v')!r}")
    job = doc.get("job")
    if isinstance(job, int) and not isinstance(job, bool):
        job = str(job)
    if not isinstance(job, str) or not _JOB.fullmatch(job):
        raise MalformedReport(f"job must be 1-64 characters [A-Za-z0-9_.:-], got {job!r}")
    if _SLURM_JOB_ID.fullmatch(job):  # one spelling per Slurm job: "05002" and "5002" are one job
        job = "_".join(str(int(part)) for part in job.split("_"))

    def integer(name: str, required: bool, most: int) -> int | None:
        value = doc.get(name)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
            raise MalformedReport(f"{name} must be an integer 0..{most}, got {value!r}")
        return value

    def number(name: str) -> float | None:
        value = doc.get(name)
        if value is None:
            return None
        if isinstance(value, str) and value.lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedReport(f"{name} must be a number, got {value!r}")
        return float(value)

    if doc.get("event") == "line":
        line = doc.get("line")
        if not isinstance(line, str) or len(line) > MAX_OUTPUT_LINE:
            raise MalformedReport(f"line must be a string of at most {MAX_OUTPUT_LINE} characters")
        rank, step = integer("rank", False, MAX_RANK) or 0, integer("step", False, MAX_STEP) or 0
        run, requeues = integer("run", False, MAX_STEP), integer("requeues", False, MAX_STEP)
        return Report(job, rank, step, line=line, run=run, requeues=requeues)
    required_rank = integer("rank", True, MAX_RANK)
    required_step = integer("step", True, MAX_STEP)
    assert required_rank is not None and required_step is not None
    rank, step = required_rank, required_step
    step_time = number("step_time")
    if step_time is not None and not (math.isfinite(step_time) and step_time >= 0):
        raise MalformedReport(f"step_time must be a finite number >= 0, got {step_time!r}")
    return Report(job, rank, step, step_time, number("loss"), integer("gpu", False, MAX_GPU), doc.get("event") == "end")


@dataclass(frozen=True, slots=True)
class RankProgress:
    """What is known of one rank's progress (also what the metrics export, for cross-node comparison)."""

    rank: int
    step: int
    last_progress: float
    gpu: int | None = None
    node: str | None = None


def hang_suspect(progress: Iterable[RankProgress], now: float, timeout_s: float) -> RankProgress | None:
    """The rank to blame when every rank has made no progress for `timeout_s`, else None.

    The suspect is the rank that stopped first: the lowest last step (it never finished the step its
    peers are waiting in), then the earliest last progress. Works on one node's ranks or, fed from the
    `fleetheal_agent_training_*` metrics of every node, on a whole job.
    """
    ranks = list(progress)
    if not ranks or any(now - r.last_progress < timeout_s for r in ranks):
        return None
    return min(ranks, key=lambda r: (r.step, r.last_progress, r.rank))


@dataclass(slots=True)
class _Rank:
    step: int
    last_progress: float
    last_report: float
    gpu: int | None
    step_time: float | None = None
    loss_mean: float | None = None
    loss_n: int = 0


@dataclass(frozen=True)
class MonitorConfig:
    """The judgement settings of the agent's `training` section (fleetheal.agent.config.TrainingConfig)."""

    #: No step progress on every rank of a job for this long is a hang.
    hang_timeout_s: float = 300.0
    #: A rank whose step time exceeds this multiple of its peers' median is a straggler.
    straggler_factor: float = 1.5
    #: Straggler detection needs at least this many ranks of the job on the node.
    straggler_min_ranks: int = 3
    #: A loss above this multiple of its running mean is a spike.
    loss_spike_factor: float = 3.0
    #: Reports per rank before loss spikes are judged.
    loss_spike_warmup: int = 20
    #: A job not heard from for this long is forgotten (its faults clear).
    job_expiry_s: float = 3600.0
    #: Jobs tracked at once on this node; reports for more are refused (a flood of invented names).
    max_jobs: int = 64
    #: Of those, jobs one user (other than root and the trusted uids) may have tracked: no user fills the table
    #: and switches training-fault detection off for everyone else on the node.
    max_jobs_per_user: int = 16


@dataclass
class TrainingMonitor:
    """Per-job state of the ranks that report on this node."""

    config: MonitorConfig = field(default_factory=MonitorConfig)
    #: Ranks per job tracked at once (as max_jobs for jobs): reports beyond them are refused, so a flood of
    #: invented names cannot grow memory or the metrics without bound.
    max_ranks: int = 1024
    #: Smoothing of the running loss mean (exponential moving average weight of a new value).
    loss_alpha: float = 0.1
    jobs: dict[str, dict[int, _Rank]] = field(default_factory=dict)
    #: The uid whose reports made each job tracked (None: root or a trusted uid, who have no share).
    owners: dict[str, int | None] = field(default_factory=dict)

    def ingest(self, report: Report, now: float, owner: int | None = None) -> list[Detection]:
        """Record one report, sent by `owner` (None: root or a trusted uid); returns the event detections it
        causes (NaN loss, loss spike). ReportRefused when it would track more than max_jobs jobs, more than
        max_jobs_per_user of one owner's, or more than max_ranks ranks of one job."""
        if report.job not in self.jobs and not report.end:
            if len(self.jobs) >= self.config.max_jobs:
                raise ReportRefused(
                    f"already tracking {self.config.max_jobs} jobs (training.max_jobs); job {report.job} ignored"
                )
            if owner is not None:
                mine = sum(1 for o in self.owners.values() if o == owner)
                if mine >= self.config.max_jobs_per_user:
                    raise ReportRefused(
                        f"uid {owner} already has {mine} jobs tracked here (training.max_jobs_per_user); "
                        f"job {report.job} ignored"
                    )
        ranks = self.jobs.get(report.job, {})
        if report.rank not in ranks and not report.end and len(ranks) >= self.max_ranks:
            raise ReportRefused(f"job {report.job} already has {self.max_ranks} ranks here; rank {report.rank} ignored")
        if report.job not in self.jobs and not report.end:
            self.owners[report.job] = owner
        ranks = self.jobs.setdefault(report.job, ranks)
        if report.end:
            ranks.pop(report.rank, None)
            if not ranks:
                self.forget(report.job)
            return []
        r = ranks.get(report.rank)
        if r is None:
            r = ranks[report.rank] = _Rank(report.step, now, now, report.gpu)
        if report.step > r.step:
            r.step = report.step
            r.last_progress = now
        r.last_report = now
        if report.gpu is not None:
            r.gpu = report.gpu
        if report.step_time is not None:
            r.step_time = report.step_time
        out: list[Detection] = []
        gpu = gpu_label(r.gpu)
        where = f"job {report.job} rank {report.rank} step {report.step}"
        job = slurm_job_id(report.job)
        if report.loss is not None:
            if not math.isfinite(report.loss):
                out.append(Detection("nan-loss", gpu, SOURCE, f"{where}: loss {report.loss}", job=job))
            elif (
                r.loss_mean is not None
                and r.loss_n >= self.config.loss_spike_warmup
                and r.loss_mean > 0
                and report.loss > self.config.loss_spike_factor * r.loss_mean
            ):
                out.append(
                    Detection(
                        "loss-spike",
                        gpu,
                        SOURCE,
                        f"{where}: loss {report.loss:.4g} vs mean {r.loss_mean:.4g}",
                        job=job,
                    )
                )
            else:  # a spike does not drag the mean up
                r.loss_mean = (
                    report.loss
                    if r.loss_mean is None
                    else (1 - self.loss_alpha) * r.loss_mean + self.loss_alpha * report.loss
                )
                r.loss_n += 1
        return out

    def forget(self, job: str) -> None:
        """Stop tracking `job` (it ended, it expired, or it left the node)."""
        self.jobs.pop(job, None)
        self.owners.pop(job, None)

    def last_step(self, job: str) -> int | None:
        """The furthest step any rank of `job` reported on this node, or None when none did."""
        ranks = self.jobs.get(job)
        return max((r.step for r in ranks.values()), default=None) if ranks else None

    def progress(self, job: str) -> list[RankProgress]:
        return [
            RankProgress(rank, r.step, r.last_progress, r.gpu) for rank, r in sorted(self.jobs.get(job, {}).items())
        ]

    def check(self, now: float) -> tuple[list[Detection], dict[str, RankProgress]]:
        """Condition detections now (hangs, stragglers) and the hang suspect of each hung job.

        Jobs not heard from for job_expiry_s are forgotten first.
        """
        for job in [
            j
            for j, ranks in self.jobs.items()
            if all(now - r.last_report >= self.config.job_expiry_s for r in ranks.values())
        ]:
            self.forget(job)
        out: list[Detection] = []
        suspects: dict[str, RankProgress] = {}
        for job, ranks in self.jobs.items():
            suspect = hang_suspect(self.progress(job), now, self.config.hang_timeout_s)
            if suspect is not None:
                suspects[job] = suspect
                out.append(
                    Detection(
                        "job-hang",
                        gpu_label(suspect.gpu),
                        SOURCE,
                        f"job {job}: no progress on {len(ranks)} rank(s) for {now - suspect.last_progress:.0f}s; "
                        f"suspect rank {suspect.rank} (stopped first, at step {suspect.step})",
                        condition=True,
                        job=slurm_job_id(job),
                    )
                )
                continue  # a hung job has no meaningful step times
            times = {rank: r.step_time for rank, r in ranks.items() if r.step_time is not None}
            if len(times) >= self.config.straggler_min_ranks:
                for rank, t in times.items():
                    peers = [v for k, v in times.items() if k != rank]
                    median = statistics.median(peers)
                    if median > 0 and t > self.config.straggler_factor * median:
                        out.append(
                            Detection(
                                "straggler",
                                gpu_label(ranks[rank].gpu),
                                SOURCE,
                                f"job {job} rank {rank}: step time {t:.3g}s vs peers' median {median:.3g}s",
                                condition=True,
                                job=slurm_job_id(job),
                            )
                        )
        return out, suspects
