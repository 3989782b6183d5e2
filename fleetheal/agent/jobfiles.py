"""Faults from the output files of the jobs on this node that `fleetheal launch` does not watch.

A job started without the launcher prints to the files Slurm opened for it: slurmstepd writes the batch
step's stdout and stderr on the job's batch host. The agent of that node follows them:

- **Which jobs**: the batch steps running on this machine, found in the process table (a `slurmstepd:
  [JOB.batch]` process; no request to slurmctld per poll), looked at every `discover_s`. For each new one,
  Slurm says once where its output goes, whose job it is and which node is its batch host (`scontrol show
  job`), and whether `fleetheal launch` runs it (its comment word: then the launcher sends its lines itself,
  and the files are left alone). A job whose batch host is another node is left to that node's agent.
- **How a file is opened**: as the job's owner could reach it (`fleetheal.slurm.jobs.open_job_file`): a
  regular file of the job's uid with one link, no symlink followed, no FIFO blocking, no device opened. A
  user who swaps their output file for a link to another file (a key, the remediator's database) has it
  refused and counted, and learns nothing of that file.
- **What is read**: what the job wrote since the last poll; for a job that started after the follower, from
  the file's start; for one that ran before it (the agent restarted), from where the file stood then, so that
  nothing it printed before is judged twice. A requeued job that appends to its file (`--open-mode=append`)
  is read on from where its previous run stopped, for the same reason. At most `max_bytes` a poll per file: a
  job printing faster is skipped ahead to its newest output (the skipped bytes are counted), so a job
  printing a million lines a second costs this thread one bounded read a poll, and the job is never slowed
  (nothing is held open between polls; slurmstepd's writes never wait on the agent).
- **Which run**: Slurm's restart count of the job (`Restarts`, read when its batch step appears; a new
  batch step pid is a new run), so a fault its next run prints is a new fault (`training.run_label`), acted
  on again.
- **What a line may cause**: the same as a line `fleetheal launch` sends (`fleetheal.agent.joboutput`): a
  job-scoped fault at most, never one that moves the node; the judge's per-job rate limit applies.

Lines are judged whole; a line longer than `logparse.MAX_LINE` is cut (`logparse.LineCutter`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleetheal.agent.training import run_label
from fleetheal.contracts import LAUNCH_TAG
from fleetheal.logparse import LineCutter
from fleetheal.slurm.fields import parse_kv_line
from fleetheal.slurm.jobs import job_comment, open_job_file
from fleetheal.slurm.runner import Runner

#: Seconds after a job is first seen untagged when its comment is read once more (the launcher tags its job
#: within a second of starting).
LAUNCH_RECHECK_S = 5.0
_BATCH = b"slurmstepd: ["
#: Files of ended jobs whose read offsets are kept for a requeued run (a few hundred bytes each).
ENDED_TAILS = 256
#: Bytes before a read offset that tell an appended file from one its next run wrote afresh.
MARK_BYTES = 64


def batch_steps(proc: Path = Path("/proc")) -> dict[str, int]:
    """The batch steps running on this machine (`slurmstepd: [JOB.batch]` processes): job id -> the step's pid
    (a new pid for the same job is its next run, after a requeue)."""
    found: dict[str, int] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "cmdline"), "rb") as fh:
                head = fh.read(128)
        except OSError:  # the process ended, or is not ours to read
            continue
        if head.startswith(_BATCH):
            step = head[len(_BATCH) :].split(b"]", 1)[0].decode(errors="replace")
            job, _, kind = step.partition(".")
            if kind == "batch" and job.isdigit():
                found[job] = int(entry.name)
    return found


@dataclass
class JobFiles:
    """One job's output files, as Slurm named them; `skip`: not followed here (and why)."""

    uid: int
    paths: tuple[str, ...]
    skip: str = ""
    #: Which run of the job this is (`training.run_label` of Slurm's restart count).
    run: str = ""
    #: The pid of the run's batch step (slurmstepd).
    pid: int = 0
    #: When to read the job's comment once more (0: never): `fleetheal launch` tags its job a moment after
    #: the batch step starts, which a follower may see first.
    recheck_at: float = 0.0


@dataclass
class _Tail:
    dev: int = -1
    ino: int = -1
    offset: int = 0
    lines: LineCutter = field(default_factory=LineCutter)
    #: The last bytes read, ending at `offset`: a later run finds them there only in a file it appended to.
    mark: bytes = b""


@dataclass
class JobOutputFollower:
    """Follows the output files of this node's batch jobs; `poll()` once per interval, from one thread."""

    node: str
    #: Called with (job id, text, run): whole lines, a chunk at a time, for the judge; `run` names the job's
    #: run (`training.run_label`).
    on_lines: Callable[[str, str, str], None]
    #: Called with why a job or a file could not be followed (counted as a read error by the agent).
    on_error: Callable[[str], None]
    runner: Runner = field(default_factory=lambda: Runner(timeout_s=10))
    #: Bytes read per file and poll at most; a job that wrote more is skipped ahead.
    max_bytes: int = 512 << 10
    #: Where the process table is (tests point it elsewhere).
    proc: Path = Path("/proc")
    #: Seconds between looks at the process table for batch steps (about 10 microseconds a process, measured:
    #: 10 ms on a node running 1,000 processes); the files of known jobs are read at every poll. 0: every poll.
    discover_s: float = 5.0
    skipped_bytes: int = 0
    refused: int = 0
    _jobs: dict[str, JobFiles] = field(default_factory=dict)
    _tails: dict[tuple[str, str], _Tail] = field(default_factory=dict)
    #: Where the files of jobs that left this node stood (a requeued job may come back and append), the most
    #: recent ENDED_TAILS.
    _ended: dict[tuple[str, str], _Tail] = field(default_factory=dict)
    #: Jobs that ran when the follower started (None before its first poll): read from their files' end.
    _before: set[str] | None = None
    _running: dict[str, int] | None = None
    _scanned: float = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        if self._running is None or now - self._scanned >= self.discover_s:
            self._running, self._scanned = batch_steps(self.proc), now
        running = self._running
        if self._before is None:
            self._before = set(running)
        for gone in [job for job, files in self._jobs.items() if running.get(job) != files.pid]:
            del self._jobs[gone]  # it ended, or its batch step is another one: a run after a requeue
            self._before.discard(gone)  # a later run of it started while the follower was watching
        for key in [k for k in self._tails if k[0] not in self._jobs]:
            self._ended[key] = self._tails.pop(key)
            while len(self._ended) > ENDED_TAILS:
                self._ended.pop(next(iter(self._ended)))
        for job, pid in sorted(running.items()):
            files = self._jobs.get(job) or self._ask(job)
            if files is None:
                continue  # Slurm did not answer: asked again at the next poll
            files.pid = pid
            self._jobs[job] = files
            if files.recheck_at and time.monotonic() >= files.recheck_at:
                files.recheck_at = 0.0
                if LAUNCH_TAG in (job_comment(self.runner, job) or "").split():
                    files.skip = "fleetheal launch watches its output"
            if files.skip:
                continue
            for path in files.paths:
                self.read_file(job, path, files.uid, files.run)

    def jobs(self) -> dict[str, JobFiles]:
        """What is known of the jobs followed or skipped now."""
        return dict(self._jobs)

    def _ask(self, job: str) -> JobFiles | None:
        """Slurm's word on a new job: its owner, its files, its batch host, whether the launcher runs it;
        None when Slurm did not answer."""
        got = self.runner.read("scontrol", "show", "job", "-o", job)
        if "Invalid job id" in got.error:  # another cluster's job on a shared machine (the lab), or ended
            return JobFiles(-1, (), skip="Slurm does not know it")
        if got.error or not got.out.strip():
            self.on_error(f"job {job}: scontrol show job failed: {got.error[:200]}")
            return None
        f = parse_kv_line(got.out.strip().splitlines()[0])
        if f.get("BatchHost") != self.node:
            return JobFiles(-1, (), skip=f"its batch host is {f.get('BatchHost') or 'unknown'}")
        uid = f.get("UserId", "").rpartition("(")[2].rstrip(")")
        if not uid.isdigit():
            return JobFiles(-1, (), skip=f"no user id in {f.get('UserId')!r}")
        comment = job_comment(self.runner, job) or ""
        if LAUNCH_TAG in comment.split():
            return JobFiles(int(uid), (), skip="fleetheal launch watches its output")
        paths = tuple(dict.fromkeys(p for p in (f.get("StdOut", ""), f.get("StdErr", "")) if p.startswith("/")))
        restarts = f.get("Restarts", "")
        run = run_label(int(restarts), None) if restarts.isascii() and restarts.isdigit() else ""
        return JobFiles(int(uid), paths, run=run, recheck_at=time.monotonic() + LAUNCH_RECHECK_S)

    def read_file(self, job: str, path: str, uid: int, run: str = "") -> None:
        """Read what run `run` of job `job` wrote to `path` since the last time, and pass its whole lines on."""
        key = (job, path)
        tail = self._tails.get(key)
        try:
            fd = open_job_file(path, uid)
        except FileNotFoundError:
            return  # not created yet, or removed: looked for again at the next poll
        except OSError as exc:
            if tail is None or tail.ino != -2:  # said once per file, not every poll
                self.refused += 1
                self.on_error(f"job {job}: not following {path}: {exc}")
                self._tails[key] = _Tail(ino=-2)
            return
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fd)
            if tail is None or tail.ino == -2:
                # A file first seen: from its start, unless its job ran before the follower did, or its previous
                # run wrote this same file (a requeued job appending to it): from where that run stopped.
                start = st.st_size if self._before and job in self._before else 0
                ended = self._ended.pop(key, None)
                if ended is not None and _appended(fd, st, ended):
                    start = ended.offset
                tail = self._tails[key] = _Tail(st.st_dev, st.st_ino, start)
            elif (st.st_dev, st.st_ino) != (tail.dev, tail.ino) or st.st_size < tail.offset:  # replaced or truncated
                tail.dev, tail.ino, tail.offset, tail.lines = st.st_dev, st.st_ino, 0, LineCutter()
            behind = st.st_size - tail.offset
            if behind > self.max_bytes:
                self.skipped_bytes += behind - self.max_bytes
                tail.offset = st.st_size - self.max_bytes
                tail.lines.lost(mid_line=os.pread(fd, 1, tail.offset - 1) != b"\n")
            if behind <= 0:
                return
            fh.seek(tail.offset)
            data = fh.read(self.max_bytes)
        tail.offset += len(data)
        tail.mark = data[-MARK_BYTES:]
        whole = tail.lines.feed(data.decode("utf-8", errors="replace"))
        if whole:
            self.on_lines(job, whole, run)


def _appended(fd: int, st: os.stat_result, ended: _Tail) -> bool:
    """True when the file behind `fd` is the one an earlier run of its job wrote, with that run's output
    still in place up to where it was read (the next run appended to it, rather than writing it afresh)."""
    if (ended.dev, ended.ino) != (st.st_dev, st.st_ino) or not ended.mark or ended.offset > st.st_size:
        return False
    return os.pread(fd, len(ended.mark), ended.offset - len(ended.mark)) == ended.mark
