"""`fleetheal launch` watching its command's output: copied through unchanged, fault lines sent to the agent."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NCCL = "[rank0]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"


def launch(tmp_path: Path, script: str, *flags: str, sock: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": "4242",
        "SLURM_RESTART_COUNT": "2",  # the job's third run: its lines say so
        "FLEETHEAL_TRAINING_SOCKET": str(sock or tmp_path / "absent.sock"),
    }
    argv = [sys.executable, "-m", "fleetheal", "launch", *flags, "--", "sh", "-c", script]
    return subprocess.run(argv, env=env, capture_output=True, timeout=300, check=False)


@pytest.fixture
def agent_socket(tmp_path: Path):
    path = tmp_path / "training.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    yield path, sock
    sock.close()


def received(sock: socket.socket) -> list[dict]:
    out = []
    while True:
        try:
            out.append(json.loads(sock.recv(8192)))
        except TimeoutError:
            return out


def test_the_output_is_copied_unchanged_and_fault_lines_reach_the_agent(tmp_path, agent_socket):
    path, sock = agent_socket
    long_line = "x" * 200_000 + " CUDA out of memory"  # cut at MAX_WATCHED_LINE: never judged whole, never held
    script = (
        f"echo 'step 1 loss 2.3'; echo '{NCCL}' >&2; head -c 200000 /dev/zero | tr '\\0' x; echo ' CUDA out of memory'; "
        "printf 'no newline at the end'; exit 3"
    )
    run = launch(tmp_path, script, sock=path)
    assert run.returncode == 3
    assert run.stdout == f"step 1 loss 2.3\n{long_line}\nno newline at the end".encode()
    assert run.stderr.decode().endswith(NCCL + "\n")
    reports = received(sock)
    assert reports == [{"v": 1, "job": "4242", "event": "line", "line": NCCL[:1024], "run": 0, "requeues": 2}], reports


def test_without_an_agent_the_job_runs_on(tmp_path):
    run = launch(tmp_path, f"echo '{NCCL}'; echo done")
    assert run.returncode == 0 and run.stdout == f"{NCCL}\ndone\n".encode()


def test_a_flood_of_output_is_neither_changed_nor_held(tmp_path, agent_socket):
    """Two million lines, a quarter of them error lines: every byte reaches the job's stdout in order, and
    only a few lines a second reach the agent."""
    path, sock = agent_socket
    script = "seq 1 2000000 | awk '{ if ($1 % 4 == 0) print \"RuntimeError: Socket Timeout \" $1; else print $1 }'"
    direct = subprocess.run(["sh", "-c", script], capture_output=True, timeout=300, check=True)
    started = time.monotonic()
    run = launch(tmp_path, script, sock=path)
    took = time.monotonic() - started
    assert run.returncode == 0
    assert hashlib.sha256(run.stdout).digest() == hashlib.sha256(direct.stdout).digest()
    assert len(received(sock)) <= 10 * (took + 1)
    # The test's socket reads nothing until the end, like a stuck agent: the judge backs off instead of waiting
    # on every flagged line, so it is through the flood when the command ends (it once took minutes).
    assert b"not judged" not in run.stderr, run.stderr
    assert took < 120


def test_a_fault_line_after_a_flood_through_a_pipe_is_judged(tmp_path, agent_socket):
    """The same through a pipe: the read holding the command's last lines is judged whatever the budget."""
    path, sock = agent_socket
    run = launch(tmp_path, f"seq 1 500000 | sed 's/$/ loss=2.3/'; echo '{NCCL}'; exit 1", sock=path)
    assert run.returncode == 1 and run.stdout.endswith(NCCL.encode() + b"\n")
    assert NCCL[:1024] in [r["line"] for r in received(sock)]


def patched_launch(
    tmp_path: Path, prelude: list[str], script: str, sock: Path, to_file: bool
) -> subprocess.CompletedProcess[bytes]:
    """The launcher started by `python -c PATCH ARGS...` (`prelude`: a module patched, then its arguments, before
    the CLI runs), its command's output on a pipe or on a regular file (a batch job's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242", "FLEETHEAL_TRAINING_SOCKET": str(sock)}
    patch, *args = prelude
    code = f"{patch}from fleetheal.cli import main\nraise SystemExit(main())\n"
    argv = [sys.executable, "-c", code, *args, "launch", "--", "sh", "-c", script]
    if not to_file:
        return subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)
    with open(tmp_path / "job.out", "wb") as fh:
        return subprocess.run(argv, env=env, stdout=fh, stderr=fh, timeout=120, check=False)


#: The launcher with a byte budget of 1 KiB a second: any flood spends it for minutes.
SMALL_BUDGET = "import fleetheal.launch as launch\nlaunch.JUDGED_BYTES_PER_S = 1024\n"


@pytest.mark.parametrize("to_file", [False, True], ids=["pipe", "file"])
def test_a_fault_line_read_alone_after_a_skipped_flood_is_judged_whole(tmp_path, agent_socket, to_file):
    """The flood is skipped over the budget and ends with a newline; the fault line comes a moment later, in a
    read of its own. It starts a line, so the judge must not drop it as the rest of a line cut by the skip (it
    did: the CI at c203585 lost the line when the pipe's last read held it alone)."""
    path, sock = agent_socket
    script = f"seq 1 200000 | sed 's/$/ loss=2.3/'; sleep 0.5; echo '{NCCL}'; exit 1"
    run = patched_launch(tmp_path, [SMALL_BUDGET], script, path, to_file)
    assert run.returncode == 1
    assert [r["line"] for r in received(sock)] == [NCCL]


#: The launcher with its rules loading slowly, as on a node busy with a job's data loaders: the command ends
#: long before the judge is ready.
SLOW_RULES = (
    "import sys, time\n"
    "import fleetheal.logparse as lp\n"
    "load, delay = lp.load_parser, float(sys.argv.pop(1))\n"
    "lp.load_parser = lambda **kw: (time.sleep(delay), load(**kw))[1]\n"
)


@pytest.mark.parametrize("to_file", [False, True], ids=["pipe", "file"])
def test_the_last_lines_are_judged_when_the_rules_load_after_the_command_ended(tmp_path, agent_socket, to_file):
    """The command prints its fault and ends at once; the rules take longer to load than the launcher's drain
    timeout (5 s): the line still reaches the agent (it was lost on a loaded CI machine)."""
    path, sock = agent_socket
    run = patched_launch(tmp_path, [SLOW_RULES, "7"], f"echo '{NCCL}'; exit 1", path, to_file)
    assert run.returncode == 1
    assert [r["line"] for r in received(sock)] == [NCCL]


#: The launcher with a slow judge, as on a node whose CPUs a job's data loaders take: each read takes seconds.
SLOW_JUDGE = (
    "import sys, time\n"
    "import fleetheal.launch as launch\n"
    "judge, delay = launch.OutputWatch._lines, float(sys.argv.pop(1))\n"
    "launch.OutputWatch._lines = lambda self, *a: (time.sleep(delay), judge(self, *a))[1]\n"
)


def test_the_last_lines_are_judged_when_the_judge_is_behind_as_the_command_ends(tmp_path, agent_socket):
    """A flood, then the fault line: the judge still has reads of the flood to go through when the command
    ends, and takes longer than the drain's 5 s over them. The line still reaches the agent (the CI at 59aaaeb
    lost it: the drain gave up on the judge when the pipes' copy deadline passed)."""
    path, sock = agent_socket
    script = f"seq 1 500000 | sed 's/$/ loss=2.3/'; echo '{NCCL}'; exit 1"
    run = patched_launch(tmp_path, [SLOW_JUDGE, "1.5"], script, path, to_file=False)
    assert run.returncode == 1 and run.stdout.endswith(NCCL.encode() + b"\n")
    assert NCCL[:1024] in [r["line"] for r in received(sock)]


def test_no_watch_uses_no_pipes(tmp_path, agent_socket):
    path, sock = agent_socket
    run = launch(
        tmp_path, f"echo '{NCCL}'; test -p /dev/stdout && echo piped || echo not-piped", "--no-watch", sock=path
    )
    assert run.stdout.decode().splitlines()[-1] == "piped"  # capture_output's own pipe: passed on, not ours
    assert received(sock) == []


def launch_to_file(
    tmp_path: Path, script: str, out: Path, sock: Path, *, append: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """The launcher with stdout and stderr on one regular file, as a batch job's output file is."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242", "FLEETHEAL_TRAINING_SOCKET": str(sock)}
    argv = [sys.executable, "-m", "fleetheal", "launch", "--", "sh", "-c", script]
    with open(out, "ab" if append else "wb") as fh:
        return subprocess.run(argv, env=env, stdout=fh, stderr=fh, timeout=300, check=False)


def test_a_command_writing_a_file_writes_it_itself_and_its_fault_lines_reach_the_agent(tmp_path, agent_socket):
    """A batch job's output file: the command inherits it (no pipe, nothing copied, never slowed), the launcher
    reads the file back; what the file held before the launcher started (an earlier run's) is not judged, nor
    is fleetheal's own line in the log (the remediator's, which names the fault it acted on)."""
    path, sock = agent_socket
    out = tmp_path / "job.out"
    out.write_text("CUDA out of memory. Tried to allocate 2.00 GiB (an earlier run's)\n")
    own = "fleetheal: refused: CUDA out of memory. Tried to allocate 2.00 GiB, twice at step 7 (incident i-1)"
    script = f"test -f /dev/stdout && echo writes-the-file || echo piped; echo '{own}'; echo '{NCCL}' >&2; exit 3"
    run = launch_to_file(tmp_path, script, out, path, append=True)
    assert run.returncode == 3
    lines = [line for line in out.read_text().splitlines() if not line.startswith("fleetheal launch:")]
    assert lines[1:] == ["writes-the-file", own, NCCL], lines
    assert received(sock) == [{"v": 1, "job": "4242", "event": "line", "line": NCCL[:1024], "run": 0, "requeues": 0}]


def test_a_flood_into_a_file_is_read_within_the_budget_and_its_last_line_judged(tmp_path, agent_socket):
    """Half a million lines, then a fault line: the launcher reads a bounded share of the flood, and the
    last lines, read when the command ends whatever the budget, are judged."""
    path, sock = agent_socket
    out = tmp_path / "job.out"
    script = f"seq 1 500000 | sed 's/$/ loss=2.3/'; echo '{NCCL}'; exit 1"
    run = launch_to_file(tmp_path, script, out, path)
    assert run.returncode == 1
    text = "".join(line for line in out.open() if not line.startswith("fleetheal launch:"))
    assert text.count("\n") == 500_001 and text.endswith(NCCL + "\n")
    assert NCCL[:1024] in [r["line"] for r in received(sock)]
