"""Queues: the pure lending/aging policy, both trace parsers and the simulator on hand-computed traces."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

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
