"""The job-output follower's bookkeeping across a job's runs, without Slurm: a fake process table (a
`slurmstepd: [JOB.batch]` cmdline per pid) and a fake `scontrol`/`squeue` that answer as Slurm would."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fleetheal.agent.jobfiles import JobOutputFollower
from fleetheal.slurm.runner import Read

NCCL = "[rank0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7) ran for 600009 milliseconds\n"


class FakeSlurm:
    """`scontrol show job -o` and `squeue` for one job of this node, with its restart count."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.restarts = 0

    def read(self, command: str, *args: str) -> Read:
        assert command == "scontrol"
        uid = os.getuid()
        return Read(
            f"JobId=5 UserId=u({uid}) Restarts={self.restarts} BatchHost=n1 StdOut={self.out} StdErr={self.out}\n"
        )

    def completed(self, command: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([command], 0, "(null)\n", "")  # squeue: no comment


def _step(proc: Path, pid: int | None) -> None:
    for entry in proc.iterdir():
        (entry / "cmdline").unlink()
        entry.rmdir()
    if pid is not None:
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cmdline").write_bytes(b"slurmstepd: [5.batch]\x00")


def _follower(tmp_path: Path) -> tuple[JobOutputFollower, FakeSlurm, Path, list[tuple[str, str]]]:
    proc = tmp_path / "proc"
    proc.mkdir()
    out = tmp_path / "job.out"
    slurm = FakeSlurm(out)
    seen: list[tuple[str, str]] = []
    follower = JobOutputFollower(
        "n1", lambda job, text, run: seen.append((run, text)), print, runner=slurm, proc=proc, discover_s=0
    )
    follower.poll()  # nothing runs yet: the job starts after the follower
    return follower, slurm, out, seen


def test_a_requeued_job_that_appends_is_read_on_from_where_its_last_run_stopped(tmp_path):
    follower, slurm, out, seen = _follower(tmp_path)
    proc = tmp_path / "proc"
    _step(proc, 100)
    out.write_text(NCCL)
    follower.poll()
    assert seen == [("0.0", NCCL.rstrip("\n"))]
    # Requeued: the batch step is another process (seen directly, even if no poll saw the job gone), and
    # Slurm counts a restart. The new run appends.
    _step(proc, 200)
    slurm.restarts = 1
    with out.open("a") as fh:
        fh.write("torch.OutOfMemoryError: CUDA out of memory.\n")
    follower.poll()
    assert seen[1:] == [("1.0", "torch.OutOfMemoryError: CUDA out of memory.")]
    assert follower.jobs()["5"].run == "1.0"


def test_a_requeued_job_that_writes_its_file_afresh_is_read_from_its_start(tmp_path):
    """Slurm's default open mode truncates the file for the next run: even when the new run has already
    written past where the last one was read, its lines are read from the file's start."""
    follower, slurm, out, seen = _follower(tmp_path)
    proc = tmp_path / "proc"
    _step(proc, 100)
    out.write_text("step 1 loss 2.31\n")
    follower.poll()
    _step(proc, 200)
    slurm.restarts = 1
    with out.open("w") as fh:  # truncated, then more than run 0.0 wrote
        fh.write(NCCL + "step 1 loss 2.31\n" * 3)
    follower.poll()
    assert [run for run, _ in seen[1:]] == ["1.0"]
    assert seen[1][1].startswith(NCCL.rstrip("\n")), seen
