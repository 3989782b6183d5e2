"""A job's output file is opened only as its owner could reach it (`fleetheal.slurm.jobs.open_job_file`): what
the agent reads for faults and the remediator appends its one line per action to. Each attack is a file a
job can leave at its output path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetheal.slurm.jobs import JobFileRefused, open_job_file

UID = os.getuid()


def test_a_regular_file_of_the_jobs_user_is_opened_for_reading_and_for_appending(tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    out.write_text("step 1\n")
    fd = open_job_file(str(out), UID)
    assert os.read(fd, 100) == b"step 1\n"
    os.close(fd)
    fd = open_job_file(str(out), UID, write=True)
    os.write(fd, b"fleetheal: said\n")
    os.close(fd)
    assert out.read_text() == "step 1\nfleetheal: said\n"


def test_a_link_to_another_file_is_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("key\n")
    link = tmp_path / "job.out"
    link.symlink_to(secret)
    with pytest.raises(JobFileRefused, match="not a regular file"):
        open_job_file(str(link), UID)


def test_a_file_of_another_user_a_hard_link_or_a_fifo_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    out.write_text("x\n")
    with pytest.raises(JobFileRefused, match=f"uid {UID + 1}"):
        open_job_file(str(out), UID + 1)
    os.link(out, tmp_path / "second-name")
    with pytest.raises(JobFileRefused, match="with one link"):
        open_job_file(str(out), UID)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(JobFileRefused, match="not a regular file"):  # never opened: it would block
        open_job_file(str(fifo), UID)
    with pytest.raises(FileNotFoundError):
        open_job_file(str(tmp_path / "absent"), UID)
