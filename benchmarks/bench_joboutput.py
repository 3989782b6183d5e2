"""What watching a job's output costs: a job printing 100,000 lines a second (goal: < 2% of one core, the
job's own throughput unchanged within noise).

- **`fleetheal launch`**: a command prints training-log lines as fast as it can for PRINT_S seconds, once
  bare and once under `fleetheal launch`, alternating, ROUNDS times each, its throughput over its own
  seconds; then the same command paced at 100,000 lines a second under the launcher, whose CPU time (user +
  system, from /proc, after its start) is reported as a share of one core. Its output goes to a file, as a
  batch job's does: the command writes it itself, and the launcher reads it back and judges it. No agent
  listens: judging is the same, and the sends fail silently.
- **The agent's file follower** (`fleetheal.agent.jobfiles`, for jobs run without the launcher): a writer
  appends 100,000 lines a second to a job output file while the follower's read, line split and rule
  prefilter run once a second; the CPU time of those polls as a share of one core.

The lines are ordinary training-log lines with one NCCL watchdog line in every 7,919 (a prime: a reader polling
once a second does not see the same phase of the output each time), so the judge works.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = int(os.environ.get("FLEETHEAL_BENCH_JOBOUTPUT_ROUNDS", "20"))
PRINT_S = 3.0
RATE = 100_000
REPO = Path(__file__).resolve().parents[1]
LINE = "2026-12-06T10:00:00.123Z step={i} loss=2.3456 lr=3e-4 tokens/s=123456 grad_norm=0.98"
FAULT = "[rank0]:[E1206 10:00:00.000000 ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout"

#: The job: prints LINE (a fault line every 7,919) for `seconds`, at `rate` lines a second (0: flat out);
#: prints how many it wrote, and in how many seconds of its own, to stderr at the end.
PRINTER = r"""
import sys, time
seconds, rate = float(sys.argv[1]), int(sys.argv[2])
line, fault = sys.argv[3], sys.argv[4]
out = sys.stdout
end = time.monotonic() + seconds
n = 0
start = time.monotonic()
while True:
    now = time.monotonic()
    if now >= end:
        break
    if rate and n >= (now - start) * rate:
        time.sleep(0.001)
        continue
    chunk = "".join((fault if (n + k) % 7919 == 7918 else line.format(i=n + k)) + "\n" for k in range(100))
    out.write(chunk)
    n += 100
out.flush()
print(n, time.monotonic() - start, file=sys.stderr)
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: The launcher's CPU is measured from this many seconds into a run: its start (Python, the rules) is not
#: what a job printing for hours pays.
WARM_S = 2.0
PACED_S = 10.0


def _run(argv: list[str], out: Path) -> tuple[int, float, float]:
    """(lines the job printed, in how many seconds of its own (the launcher's start is not the job's), the
    launcher's CPU share of one core after WARM_S, or 0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "4242",
           "FLEETHEAL_TRAINING_SOCKET": str(out.with_suffix(".sock"))}  # fmt: skip
    with open(out, "wb") as fh:
        t0 = time.monotonic()
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.PIPE, env=env)
        watched = argv[1:3] == ["-m", "fleetheal"]
        first: tuple[float, float] | None = None
        last: tuple[float, float] | None = None
        while p.poll() is None:
            if watched and time.monotonic() - t0 >= WARM_S:
                with contextlib.suppress(OSError, IndexError):
                    last = (time.monotonic(), _cpu_s(p.pid))
                    first = first or last
            time.sleep(0.05)
        cpu = (last[1] - first[1]) / (last[0] - first[0]) if first and last and last[0] > first[0] else 0.0
        err = p.stderr.read().decode() if p.stderr else ""
    lines, took = err.split()[-2:] if err.strip() else (0, 1.0)
    return int(lines), float(took), cpu


def _printer(path: Path, seconds: float, rate: int) -> list[str]:
    return [sys.executable, str(path), str(seconds), str(rate), LINE, FAULT]


def _launcher_figures(tmp: Path) -> list[dict[str, Any]]:
    script = tmp / "printer.py"
    script.write_text(PRINTER)
    launch = [sys.executable, "-m", "fleetheal", "launch", "--"]
    bare, watched = [], []
    for _ in range(ROUNDS):
        n, took, _ = _run(_printer(script, PRINT_S, 0), tmp / "bare.out")
        bare.append(n / took)
        n, took, _ = _run([*launch, *_printer(script, PRINT_S, 0)], tmp / "watched.out")
        watched.append(n / took)
    shares = []
    for _ in range(max(3, ROUNDS // 4)):
        _, _, share = _run([*launch, *_printer(script, PACED_S, RATE)], tmp / "paced.out")
        shares.append(100 * share)
    return [
        _cpu_figure(
            "fleetheal launch: CPU while its command prints 100,000 lines/s",
            shares,
            f"the launcher process (reads back the output file + judges), user + system CPU from /proc over the last "
            f"{PACED_S - WARM_S:g} s of {PACED_S:g} s runs (its start, Python and the rules, excluded)",
        ),
        {
            "name": "a job's own throughput under fleetheal launch (flat out)",
            "unit": "lines/s",
            "median": statistics.median(watched),
            "p99": min(watched),
            "n": len(watched),
            "goal": "unchanged within noise",
            "peer": statistics.median(bare),
            "ratio_to_peer": statistics.median(watched) / statistics.median(bare),
            "notes": f"peer: the same command bare, alternating; its output to a file, which under the launcher it "
            f"writes itself; lines over the command's own {PRINT_S:g} s",
        },
    ]


def _cpu_figure(name: str, shares: list[float], notes: str) -> dict[str, Any]:
    """A CPU-share figure (% of one core per run), against the 2% goal."""
    return {
        "name": name,
        "unit": "% of a core",
        "median": statistics.median(shares),
        "p99": max(shares),
        "n": len(shares),
        "goal": "< 2",
        "peer": None,
        "ratio_to_peer": None,
        "notes": notes,
    }


def _follower_figure(tmp: Path) -> dict[str, Any]:
    from fleetheal.agent.jobfiles import JobOutputFollower
    from fleetheal.logparse import APPLICATION, judged_lines, load_parser

    parser = load_parser(log=APPLICATION)
    out = tmp / "job.out"
    out.write_text("")
    seen: list[int] = []
    follower = JobOutputFollower(
        "bench", lambda job, text, run: seen.append(sum(1 for _ in judged_lines(text, parser.may_match))), print
    )
    script = tmp / "printer.py"
    script.write_text(PRINTER)
    seconds = 2.0 + ROUNDS
    writer = subprocess.Popen(_printer(script, seconds, RATE), stdout=out.open("ab"), stderr=subprocess.DEVNULL)
    shares = []
    try:
        time.sleep(1.0)
        uid = os.getuid()
        for _ in range(ROUNDS):
            t0, c0 = time.monotonic(), time.thread_time()
            follower.read_file("1", str(out), uid)  # one poll of one job's file, as the agent's thread does
            busy = time.thread_time() - c0
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
            shares.append(100 * busy / 1.0)
    finally:
        writer.kill()
        writer.wait()
    return _cpu_figure(
        "agent file follower: CPU while a job prints 100,000 lines/s",
        shares,
        f"one poll a second (read up to job_files.max_bytes, split, rule prefilter); "
        f"skipped ahead {follower.skipped_bytes / 1e6:.1f} MB; fault lines judged {sum(seen)}",
    )


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="fleetheal-bench-joboutput-") as d:
        tmp = Path(d)
        figures = _launcher_figures(tmp)
        figures.append(_follower_figure(tmp))
    return figures


if __name__ == "__main__":
    import json

    json.dump(run(), sys.stdout, indent=2)
    print()
