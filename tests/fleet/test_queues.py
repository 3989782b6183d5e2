"""Queues: the pure lending/aging policy, both trace parsers and the simulator on hand-computed traces."""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import re
from pathlib import Path

import pytest

from fleetheal import cli
from fleetheal.errors import UsageError
from fleetheal.fleet import queue_policy, queues
from fleetheal.fleet.config import Queues
from fleetheal.fleet.queue_policy import Job, TraceError

CFG = Queues(small_guaranteed_gpus=4, age_weight_per_hour=1.0, size_weight_per_gpu=0.1)
#: A job of more than 4 GPUs is large here (the fleet file's placement.small_job_max_gpus).
SMALL = 4


def test_lends_idle_large_gpus_when_no_large_job_waits() -> None:
    assert queue_policy.small_limit(16, 0, 0, CFG) == 16
    assert queue_policy.small_limit(16, 8, 0, CFG) == 8


def test_stops_lending_when_a_large_job_waits() -> None:
    # A waiting 16-GPU job takes back everything lent; an 8-GPU one takes back 8 of the 12 lent.
    assert queue_policy.small_limit(16, 0, 16, CFG) == 4
    assert queue_policy.small_limit(16, 0, 8, CFG) == 8


def test_reserve_is_not_lent() -> None:
    cfg = Queues(small_guaranteed_gpus=4, lend_reserve_gpus=4)
    assert queue_policy.small_limit(16, 0, 0, cfg) == 12


def test_aging_orders_a_starving_large_job_first() -> None:
    fresh_small = queue_policy.priority(1, 0.0, CFG)
    old_large = queue_policy.priority(8, 7200.0, CFG)
    fresh_large = queue_policy.priority(8, 0.0, CFG)
    assert old_large > fresh_large > fresh_small


def test_csv_parser_good_and_bad() -> None:
    jobs = queue_policy.parse_csv(["submit_s,gpus,duration_s", "10,2,5", "# c", "", "0,8,1.5"])
    assert jobs == [Job(0.0, 8, 1.5, 5), Job(10.0, 2, 5.0, 2)]
    with pytest.raises(TraceError, match="line 2: expected 3 fields"):
        queue_policy.parse_csv(["0,1,1", "1,2"])
    with pytest.raises(TraceError, match="line 1: not numbers"):
        queue_policy.parse_csv(["a,1,1"])
    with pytest.raises(TraceError, match="line 1: need"):
        queue_policy.parse_csv(["0,0,1"])


def test_sacct_parser_good_and_bad() -> None:
    lines = [
        "Submit|Start|End|ReqTRES",
        "2024-01-01T00:00:10|2024-01-01T00:00:20|2024-01-01T00:01:20|billing=8,cpu=8,gres/gpu=4,mem=1G,node=1",
        "2024-01-01T00:00:00|2024-01-01T00:00:00|2024-01-01T00:00:30|cpu=1,gres/gpu:h100=2,gres/gpu=2,node=1",
        "2024-01-01T00:00:05|Unknown|Unknown|cpu=1,gres/gpu=1",
        "2024-01-01T00:00:06|2024-01-01T00:00:06|2024-01-01T00:00:07|cpu=1,mem=1G",
    ]
    assert queue_policy.parse_sacct(lines) == [Job(0.0, 2, 30.0, 3), Job(10.0, 4, 60.0, 2)]
    with pytest.raises(TraceError, match="line 1: header lacks column 'End'"):
        queue_policy.parse_sacct(["Submit|Start|ReqTRES"])
    with pytest.raises(TraceError, match="line 2: 2 fields, header has 4"):
        queue_policy.parse_sacct(["Submit|Start|End|ReqTRES", "a|b"])
    with pytest.raises(TraceError, match="line 2:"):
        queue_policy.parse_sacct(["Submit|Start|End|AllocTRES", "yesterday|x|y|gres/gpu=1"])


# Pool of 8 GPUs. A small 4-GPU job runs 0..10; a large 8-GPU job arrives at 1 (needs all 8);
# small 4-GPU jobs arrive at 2 (runs 5 s) and 3 (runs 100 s).
TRACE = [Job(0, 4, 10), Job(1, 8, 10), Job(2, 4, 5), Job(3, 4, 100)]


def test_fifo_by_hand() -> None:
    r = queue_policy.simulate(TRACE, 8, "fifo", CFG, SMALL)
    # fifo: large starts at 10 (waits 9), then both smalls at 20.
    assert r.starts == [0, 10, 20, 20]


def test_backfill_by_hand() -> None:
    r = queue_policy.simulate(TRACE, 8, "backfill", CFG, SMALL)
    # head (large) reserved at 10; the 5 s small fits in 2..7 < 10, so it backfills; the 100 s one would
    # delay the head and waits until 20.
    assert r.starts == [0, 10, 2, 20]


def test_lending_never_preempts_and_reclaims_by_hand() -> None:
    r = queue_policy.simulate(TRACE, 8, "lend", CFG, SMALL)
    # The large job waiting from 1 gets the reservation at 10 (when the running small ends; it is not
    # stopped). The 5 s small at 2 ends by then and backfills; the 100 s one would delay it and waits.
    assert r.starts == [0, 10, 2, 20]
    # With `reclaim`, the small QOS also shrinks to its guarantee (4) while the large job waits: neither
    # small starts beside the running one.
    reclaim = dataclasses.replace(CFG, reclaim=True, reclaim_after_s=0.0)
    assert queue_policy.simulate(TRACE, 8, "lend", reclaim, SMALL).starts == [0, 10, 20, 20]
    # No large job waiting: small borrows the whole pool.
    r2 = queue_policy.simulate([Job(0, 4, 10), Job(0, 4, 10)], 8, "lend", CFG, SMALL)
    assert r2.starts == [0, 0]
    assert r2.utilisation == 1.0


def test_aging_large_job_not_starved_by_small_stream() -> None:
    # A steady stream of 4-GPU small jobs that would keep 8 GPUs busy forever under backfill-like
    # greed; the 8-GPU large job still gets in once the running smalls end.
    stream = [Job(float(t), 4, 10.0) for t in range(0, 200, 5)]
    jobs = [*stream, Job(1.0, 8, 10.0)]
    r = queue_policy.simulate(jobs, 8, "lend", CFG, SMALL)
    assert r.waits["large"][0] <= 10.0
    assert r.waits["large"] == [r.starts[-1] - 1.0]


def test_utilisation_and_summary_by_hand() -> None:
    r = queue_policy.simulate([Job(0, 4, 10), Job(10, 8, 10)], 8, "fifo", CFG, SMALL)
    assert r.utilisation == pytest.approx((40 + 80) / (8 * 20))
    s = r.summary()
    assert s["large_wait_max_s"] == 0.0 and s["small_jobs"] == 1 and s["large_jobs"] == 1


def test_too_large_jobs_are_skipped() -> None:
    r = queue_policy.simulate([Job(0, 16, 1), Job(0, 1, 1)], 8, "lend", CFG, SMALL)
    assert r.skipped == 1 and r.jobs == 1


def test_replay_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{j.submit},{j.gpus},{j.duration}\n" for j in TRACE))
    parser = argparse.ArgumentParser()
    queues.register(parser.add_subparsers())
    args = parser.parse_args(["queue", "replay", str(trace), "--clusters", "1:8,2:8", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["cluster"], r["policy"]) for r in out][:3] == [("1:8", "fifo"), ("1:8", "backfill"), ("1:8", "lend")]
    assert out[0]["utilisation_vs_fifo"] == 1.0
    bad = parser.parse_args(["queue", "replay", str(trace), "--clusters", "8"])
    with pytest.raises(UsageError, match="NODES:GPUS"):
        bad.func(bad)
    trace.write_text("0,1\n")
    bad = parser.parse_args(["queue", "replay", str(trace), "--clusters", "1:8"])
    with pytest.raises(UsageError, match="line 1"):
        bad.func(bad)


# -- bounds on a trace's values (issue 46) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1e308,1,10", "line 3: submit_s 1e+308 is above the bound 4294967296 (2**32 s"),
        ("4294967297,1,10", "line 3: submit_s 4294967297.0 is above the bound 4294967296"),
        ("0,1,1e308", "line 3: duration_s 1e+308 is above the bound 315360000 (10 years)"),
        ("0,1,315360001", "line 3: duration_s 315360001.0 is above the bound 315360000"),
        ("0,1000001,10", "line 3: gpus 1000001 is above the bound 1000000 (a million GPUs)"),
        ("0,1,1e309", "line 3: need submit_s >= 0"),  # inf, as before
    ],
)
def test_csv_values_beyond_the_bounds_are_errors(line: str, message: str) -> None:
    with pytest.raises(TraceError, match=re.escape(message)):
        queue_policy.parse_csv(["submit_s,gpus,duration_s", "0,1,1", line])


def test_csv_values_at_the_bounds_are_read() -> None:
    # A Unix time is a valid origin; ten years of run time and a million GPUs are the most a job may have.
    line = f"{queue_policy.MAX_SUBMIT_S:.0f},{queue_policy.MAX_JOB_GPUS},{queue_policy.MAX_DURATION_S:.0f}"
    assert queue_policy.parse_csv([line]) == [Job(2.0**32, 1_000_000, 315_360_000.0, 1)]
    assert queue_policy.parse_csv(["1733400000,8,3600"]) == [Job(1733400000.0, 8, 3600.0, 1)]


def test_sacct_values_beyond_the_bounds_are_errors() -> None:
    head = "Submit|Start|End|ReqTRES"
    ok = "2024-01-01T00:00:00|2024-01-01T00:00:00|2024-01-01T00:01:00|gres/gpu=8"
    with pytest.raises(TraceError, match=re.escape("line 3: duration_s 347155200.0 is above the bound 315360000")):
        queue_policy.parse_sacct([head, ok, "2024-01-01T00:00:00|2024-01-01T00:00:00|2035-01-01T00:00:00|gres/gpu=1"])
    with pytest.raises(TraceError, match=re.escape("line 3: gpus 2000000 is above the bound 1000000")):
        queue_policy.parse_sacct(
            [head, ok, "2024-01-01T00:00:00|2024-01-01T00:00:00|2024-01-01T00:00:01|gres/gpu=2000000"]
        )
    # Submit times are relative to the earliest job: their span is bounded, whatever the dates.
    old = "1850-01-01T00:00:00|1850-01-01T00:00:00|1850-01-01T00:00:01|gres/gpu=1"
    with pytest.raises(TraceError, match=r"line 2: submitted \d+ s after the earliest job \(line 3\), above the bound"):
        queue_policy.parse_sacct([head, ok, old])


def test_clusters_beyond_the_bound_are_errors() -> None:
    assert queue_policy.parse_clusters("125000:8") == [(125000, 8)]  # a million GPUs: the most one pool has
    with pytest.raises(ValueError, match=re.escape("'125001:8' is more GPUs than the bound, 1000000 in one pool")):
        queue_policy.parse_clusters("4:8,125001:8")
    with pytest.raises(ValueError, match="NODES:GPUS"):
        queue_policy.parse_clusters("1:\u00b2")  # a digit to str.isdigit, not to int()


def test_replay_cli_says_which_line_and_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("submit_s,gpus,duration_s\n0,1,10\n1e308,1,10\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["queue", "replay", str(trace), "--clusters", "1:8"])
    assert exited.value.code == 2
    assert f"{trace}: line 3: submit_s 1e+308 is above the bound 4294967296" in capsys.readouterr().err
    trace.write_text("0,1,10\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["queue", "replay", str(trace), "--clusters", "1000:1001"])
    assert exited.value.code == 2
    assert "'1000:1001' is more GPUs than the bound, 1000000 in one pool" in capsys.readouterr().err


def test_replay_cli_refuses_a_negative_age_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,1,10\n")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("queues: {age_weight_per_hour: -1.0}\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["queue", "replay", str(trace), "--clusters", "1:8", "--fleet", str(fleet)])
    assert exited.value.code == 2
    assert "queues.age_weight_per_hour: -1.0 is not a finite number >= 0" in capsys.readouterr().err


# -- the replay's cost (issue 46): look-ups per size of job, never a walk of the queue -----------------------


def _walk_the_queue(jobs: list[Job], total_gpus: int, policy: str, cfg: Queues, small_max: int) -> list[float]:
    """The simulator before `_Waiting`, unchanged but for its summary, kept as the oracle: at every event it
    sorts and walks every waiting job (O(events x waiting jobs)). `simulate` must start each job at the same
    time, to the bit."""
    is_large, priority, small_limit = queue_policy.is_large, queue_policy.priority, queue_policy.small_limit
    fit = [j for j in jobs if j.gpus <= total_gpus]
    order = sorted(range(len(fit)), key=lambda i: (fit[i].submit, i))
    running: list[tuple[float, int, int]] = []
    pending: list[int] = []
    start: dict[int, float] = {}
    free, small_used, large_used, now, nxt = total_gpus, 0, 0, 0.0, 0

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
            for i in ordered:
                if may_start(i):
                    launch(i)
                    started.add(i)
                elif is_large(fit[i].gpus, small_max):
                    blocked = i
                    break
            if blocked is not None:
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
    return [start[i] for i in range(len(fit))]


def _trace(rng: random.Random, n: int, mean_gap_s: float, sizes: tuple[int, ...]) -> list[Job]:
    """Poisson arrivals, lognormal run times (some zero), whole-second ties among submit times."""
    jobs, t = [], 0.0
    for line in range(1, n + 1):
        t += rng.expovariate(1 / mean_gap_s)
        submit = float(round(t / 360) * 360) if rng.random() < 0.3 else t
        duration = 0.0 if rng.random() < 0.05 else rng.lognormvariate(7.0, 1.2)
        jobs.append(Job(submit, rng.choice(sizes), duration, line))
    return sorted(jobs, key=lambda j: (j.submit, j.line))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replay_starts_every_job_when_walking_the_queue_did(seed: int) -> None:
    rng = random.Random(seed)
    jobs = _trace(rng, 400, rng.choice((60.0, 200.0, 600.0)), (1, 1, 2, 3, 4, 6, 8, 12, 16, 32))
    for cfg in (
        CFG,
        Queues(),
        dataclasses.replace(CFG, reclaim=True, reclaim_after_s=1800.0, lend_reserve_gpus=2),
        Queues(small_guaranteed_gpus=0, age_weight_per_hour=30.0, size_weight_per_gpu=0.0, reclaim=True),
    ):
        for total in (16, 48):
            for policy in queue_policy.POLICIES:
                want = _walk_the_queue(jobs, total, policy, cfg, SMALL)
                assert queue_policy.simulate(jobs, total, policy, cfg, SMALL).starts == want, (cfg, total, policy)


def test_replay_of_20000_jobs_looks_up_sizes_not_the_queue() -> None:
    # Twice the load the pool can run: the queue grows to about 8,000 jobs. Walking it at every event
    # passed ~160 million waiting jobs (8,000 per job) and took minutes; `_Waiting` makes about ten
    # look-ups per job. No wall-time assertion (machines are noisy): the count is the structure, and
    # pytest-timeout the backstop.
    rng = random.Random(46)
    jobs, t = [], 0.0
    for line in range(1, 20_001):
        t += rng.expovariate(1 / 200.0)
        gpus = rng.choice((1, 1, 1, 2, 4, 8, 16, 32)) if rng.random() < 0.97 else 64
        jobs.append(Job(t, gpus, rng.lognormvariate(7.0, 1.2), line))
    for policy in queue_policy.POLICIES:
        r = queue_policy.simulate(jobs, 64, policy, Queues(), 8)
        assert r.jobs == 20_000 and r.skipped == 0 and min(r.starts) >= 0.0
        assert r.steps <= 20 * len(jobs), (policy, r.steps)
        assert max(r.waits["small"]) > 86_400  # the queue did grow: small jobs waited for days


def test_replay_keeps_priority_order_under_any_lending_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # `small_limit` only shrinks as large jobs start, so a small job passed over stays passed over; with a
    # limit that grows back (as a future rule might), the replay still goes through jobs in priority order
    # exactly. Bursts of jobs submitted together make a pass start several large jobs among small ones.
    def jumpy_limit(total_gpus: int, large_running_gpus: int, large_head_gpus: int, cfg: Queues) -> int:
        return 2 + large_running_gpus % 7 + (6 if large_head_gpus % 2 else 0)

    monkeypatch.setattr(queue_policy, "small_limit", jumpy_limit)
    rng = random.Random(4)
    sizes, runs = (1, 2, 3, 4, 5, 6, 7, 9, 11), (500.0, 1500.0, 2500.0, 4000.0)
    jobs = [
        Job(burst * 3000.0 + rng.choice((0.0, 0.0, 100.0)), rng.choice(sizes), rng.choice(runs), burst * 12 + k + 1)
        for burst in range(30)
        for k in range(12)
    ]
    jobs.sort(key=lambda j: (j.submit, j.line))
    for weight in (0.1, -0.5):  # a negative size weight puts small jobs ahead of large ones
        cfg = dataclasses.replace(CFG, reclaim=True, reclaim_after_s=60.0, size_weight_per_gpu=weight)
        for total in (16, 24, 32):
            want = _walk_the_queue(jobs, total, "lend", cfg, SMALL)
            assert queue_policy.simulate(jobs, total, "lend", cfg, SMALL).starts == want, (weight, total)
