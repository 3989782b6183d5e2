"""Faults from a job's own output: what a line the job printed may cause. Pure logic, no I/O, no clock.

A job's stdout and stderr are text its owner controls, so a line is judged by what it may cause, not only
by what it says:

- it is classified with the application rules (`fleetheal/log-rules.yaml`, `log: application` or `any`),
  the agent's own copy of them: what the sender thought of the line counts for nothing;
- a fault whose action moves no node (restart in place, refuse and report, observe: an NCCL timeout, a CUDA
  out-of-memory, an illegal address, a configuration error) is raised for that job alone (`Detection.job`),
  on the node-wide label: the remediator acts on that job and nothing else;
- a fault that would move the node (a destructive or fast-path action: an Xid line, "GPU has fallen off the
  bus", an uncorrectable ECC error the job printed) becomes `contracts.JOB_OUTPUT_NODE_CLAIM`: the job is
  told, the node stays. The node is isolated only when its own signals (NVML, the kernel log, DCGM) raise
  the fault themselves, which they do without the job's help;
- a CUDA out-of-memory at the step of the job's previous one is `cuda-oom-repeated` (it will not fit as
  configured: not restarted again). The step is the furthest one the job's ranks reported on this node
  (None when they report none: no progress seen, the same step); the ranks of one run print their OOM
  together, so a second OOM counts only from a new run of the job (`run`, `training.run_label`), or, when
  the run is unknown, `dedup_s` after the first;
- a detection names the run that printed it: a fault of the job's next run (after a restart in place or a
  requeue) is a new fault, acted on again, while the repeats of one run fold into one;
- a job sends at most `lines_per_s` lines a second (a burst of `lines_per_s`); the rest are dropped unread,
  so a job printing a million error lines costs the agent nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetheal.agent.health import Detection
from fleetheal.contracts import JOB_OUTPUT_NODE_CLAIM, JOB_OUTPUT_SOURCE, NODE_WIDE_GPU
from fleetheal.logparse import LogParser
from fleetheal.rate import TokenBucket
from fleetheal.taxonomy import Taxonomy

OOM, OOM_REPEATED = "cuda-oom", "cuda-oom-repeated"


@dataclass(slots=True)
class _Oom:
    step: int | None
    run: str
    at: float


@dataclass
class JobOutputJudge:
    """Turns the lines jobs printed into job-scoped detections. Callers serialise access."""

    taxonomy: Taxonomy
    parser: LogParser
    #: Two OOMs of one job less than this apart, with no run count, are one (its ranks print it together).
    dedup_s: float = 30.0
    #: Lines a second each job may have judged (its burst too); the rest are dropped and counted.
    lines_per_s: float = 50.0
    #: Jobs remembered at once (OOM history and rate budgets); the oldest are forgotten beyond it.
    max_jobs: int = 256
    dropped: int = 0
    _ooms: dict[str, _Oom] = field(default_factory=dict)
    _budgets: dict[str, TokenBucket] = field(default_factory=dict)

    def _admit(self, job: str, now: float) -> bool:
        budget = self._budgets.get(job)
        if budget is None:
            _forget_oldest(self._budgets, self.max_jobs)
            budget = self._budgets[job] = TokenBucket(self.lines_per_s, now)
        if not budget.take(now):
            self.dropped += 1
            return False
        return True

    def judge(self, job: str, line: str, now: float, *, step: int | None = None, run: str = "") -> Detection | None:
        """The detection a line of Slurm job `job`'s output causes, or None (no fault, or over the rate).
        `run`: which run of the job printed it ("" unknown)."""
        if not self._admit(job, now):
            return None
        events = [e for e in self.parser.parse_line(line) if e.known]
        if not events:
            return None
        event = events[0]
        fault_id = event.fault.id
        detail = f"job {job} printed: {event.detail or line[-200:]}"
        if self.taxonomy.moves_node(fault_id):
            detail = f"job {job}'s output alone claims {fault_id}; the node's own signals decide ({detail})"
            fault_id = JOB_OUTPUT_NODE_CLAIM
        elif fault_id == OOM:
            fault_id = self._oom(job, step, run, now)
        return Detection(fault_id, NODE_WIDE_GPU, JOB_OUTPUT_SOURCE, detail, job=job, run=run)

    def _oom(self, job: str, step: int | None, run: str, now: float) -> str:
        before = self._ooms.get(job)
        if before is None:
            _forget_oldest(self._ooms, self.max_jobs)
        else:
            self._ooms.pop(job)
        self._ooms[job] = _Oom(step, run, now)
        if before is None or before.step != step:
            return OOM
        again = run != before.run if run and before.run else now - before.at >= self.dedup_s
        if not again:  # the same OOM, printed by another rank: the first's verdict stands
            self._ooms[job] = before
        return OOM_REPEATED if again else OOM

    def forget(self, job: str) -> None:
        """Drop what is known of `job` (it ended)."""
        self._ooms.pop(job, None)
        self._budgets.pop(job, None)


def _forget_oldest(table: dict[str, _Oom] | dict[str, TokenBucket], most: int) -> None:
    while len(table) >= most:
        table.pop(next(iter(table)))
