"""Training reports: parsing, NaN/spike/straggler judgements and the collective-hang suspect."""

from __future__ import annotations

import json

import pytest

from fleetheal.agent.training import (
    MalformedReport,
    MonitorConfig,
    RankProgress,
    Report,
    ReportRefused,
    TrainingMonitor,
    hang_suspect,
    parse_report,
)


def _b(**doc):
    return json.dumps(doc).encode()


def test_parse_a_full_report():
    r = parse_report(_b(v=1, job="4242", rank=3, step=1200, step_time=0.41, loss=2.31, gpu=3))
    assert (r.job, r.rank, r.step, r.step_time, r.loss, r.gpu, r.end) == ("4242", 3, 1200, 0.41, 2.31, 3, False)
    assert parse_report(_b(job=7, rank=0, step=0)).job == "7"
    assert str(parse_report(_b(job="j", rank=0, step=1, loss="nan")).loss) == "nan"
    assert parse_report(_b(job="j", rank=0, step=0, event="end")).end


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (_b(v=2, job="j", rank=0, step=0), "unsupported protocol version"),
        (_b(rank=0, step=0), "job must be"),
        (_b(job="a b", rank=0, step=0), "job must be"),
        (_b(job="j", rank=-1, step=0), "rank must be an integer"),
        (_b(job="j", rank=0, step="12"), "step must be an integer"),
        (_b(job="j", rank=0, step=True), "step must be an integer"),
        (_b(job="j", rank=0, step=1, loss="lots"), "loss must be a number"),
        (_b(job="j", rank=0, step=1, step_time=-1), "step_time must be"),
        # Found by hand: a trailing newline slipped past the job pattern, and any GPU index was taken.
        (_b(job="4242\n", rank=0, step=0), "job must be"),
        (_b(job="j", rank=0, step=0, gpu=10**12), "gpu must be an integer 0..255"),
        (_b(job="j", rank=1 << 40, step=0), "rank must be an integer"),
    ],
)
def test_malformed_reports(data, why):
    with pytest.raises(MalformedReport, match=why):
        parse_report(data)


def test_hang_suspect_is_the_rank_that_stopped_first():
    # Rank 5's NIC died during step 101: it never finished it; its peers finished step 101's
    # forward pass bookkeeping a moment later and then froze in the all-reduce, waiting on rank 5.
    ranks = [RankProgress(r, 101, 1000.0 + r * 0.01) for r in range(8) if r != 5]
    ranks.append(RankProgress(5, 100, 999.0))
    assert hang_suspect(ranks, now=1400.0, timeout_s=300).rank == 5
    # Same step everywhere: the earliest to stop is blamed, not the ones that waited on it.
    same = [RankProgress(r, 50, 2000.0 + (0 if r == 6 else 3)) for r in range(8)]
    assert hang_suspect(same, now=2400.0, timeout_s=300).rank == 6


def test_no_suspect_while_any_rank_progresses():
    ranks = [RankProgress(0, 10, 0.0), RankProgress(1, 10, 350.0)]
    assert hang_suspect(ranks, now=400.0, timeout_s=300) is None
    assert hang_suspect([], now=400.0, timeout_s=300) is None


def _report(job, rank, step, **kw):
    return parse_report(_b(job=job, rank=rank, step=step, **kw))


def test_monitor_names_the_hang_suspect_on_its_gpu():
    m = TrainingMonitor(MonitorConfig(hang_timeout_s=60))
    t = 0.0
    for step in range(1, 11):
        t += 1
        for rank in range(4):
            if rank == 2 and step > 7:
                continue  # rank 2 (GPU 6) stops at step 7; the others reach step 8 and wait
            if rank != 2 and step > 8:
                continue
            m.ingest(_report("job1", rank, step, gpu=rank + 4), t)
    dets, suspects = m.check(t + 30)
    assert dets == []
    dets, suspects = m.check(t + 61)
    (det,) = dets
    assert (det.fault_id, det.gpu, det.condition) == ("job-hang", "6", True)
    assert "suspect rank 2" in det.detail
    assert suspects["job1"].rank == 2


def test_heartbeats_without_progress_still_hang():
    m = TrainingMonitor(MonitorConfig(hang_timeout_s=10))
    m.ingest(_report("j", 0, 5), 0.0)
    for t in range(1, 20):
        m.ingest(_report("j", 0, 5), float(t))  # same step again and again
    dets, _ = m.check(20.0)
    assert [d.fault_id for d in dets] == ["job-hang"]


def test_nan_and_loss_spike():
    m = TrainingMonitor(MonitorConfig(loss_spike_factor=3.0, loss_spike_warmup=5))
    assert [d.fault_id for d in m.ingest(_report("j", 0, 1, loss="inf"), 0.0)] == ["nan-loss"]
    for step in range(2, 12):
        assert m.ingest(_report("j", 0, step, loss=2.0), float(step)) == []
    (det,) = m.ingest(_report("j", 0, 12, loss=9.0), 12.0)
    assert det.fault_id == "loss-spike"
    assert not det.condition
    assert m.ingest(_report("j", 0, 13, loss=2.1), 13.0) == []  # the spike did not move the mean


def test_straggler_against_peers_median():
    m = TrainingMonitor(MonitorConfig(straggler_factor=1.5, straggler_min_ranks=3))
    for rank, step_time in enumerate([1.0, 1.02, 0.98, 2.0]):
        m.ingest(_report("j", rank, 10, step_time=step_time, gpu=rank), 0.0)
    dets, _ = m.check(1.0)
    assert [(d.fault_id, d.gpu) for d in dets] == [("straggler", "3")]


def test_end_and_expiry_forget_jobs():
    m = TrainingMonitor(MonitorConfig(hang_timeout_s=10, job_expiry_s=100))
    m.ingest(_report("a", 0, 1), 0.0)
    m.ingest(parse_report(_b(job="a", rank=0, step=0, event="end")), 1.0)
    assert m.jobs == {}
    m.ingest(_report("b", 0, 1), 0.0)
    m.check(150.0)
    assert m.jobs == {}


def test_a_jobs_own_faults_name_its_slurm_job_and_only_a_slurm_job():
    """NaN loss and hangs raised by job 41's reports carry job 41 (metric label job_id, then the alert and the
    incident act on that job only); a job name that is not a Slurm job id names no job."""
    m = TrainingMonitor(MonitorConfig(hang_timeout_s=10.0))
    (nan,) = m.ingest(_report("41", 0, 1, loss="nan"), 0.0)
    assert (nan.fault_id, nan.job) == ("nan-loss", "41")
    (local,) = m.ingest(_report("local", 0, 1, loss="nan"), 0.0)
    assert local.job == ""
    m.ingest(_report("41", 0, 2), 1.0)
    dets, _ = m.check(30.0)
    assert {(d.fault_id, d.job) for d in dets} == {("job-hang", "41"), ("job-hang", "")}


def test_the_monitor_tracks_a_bounded_number_of_jobs_and_ranks():
    m = TrainingMonitor(MonitorConfig(max_jobs=3), max_ranks=2)
    for job in "abc":
        m.ingest(Report(job, 0, 1), 0.0)
    with pytest.raises(ReportRefused, match="already tracking 3 jobs"):
        m.ingest(Report("d", 0, 1), 0.0)
    m.ingest(Report("a", 1, 1), 0.0)
    with pytest.raises(ReportRefused, match="already has 2 ranks"):
        m.ingest(Report("a", 2, 1), 0.0)
    m.ingest(Report("c", 0, 1, end=True), 0.0)  # a job that ends makes room
    m.ingest(Report("d", 0, 1), 0.0)
    assert sorted(m.jobs) == ["a", "b", "d"]


def test_one_slurm_job_has_one_spelling():
    """Issue 46: "05002" and "5002" were two entries of the 64-job table (and two jobs to the owner check)."""
    for sent, kept in (("05002", "5002"), ("5002", "5002"), ("007_03", "7_3"), ("local", "local"), ("0x1", "0x1")):
        assert parse_report(json.dumps({"job": sent, "rank": 0, "step": 1}).encode()).job == kept


def test_no_user_fills_the_job_table_for_everyone_else():
    """Issue 46: one user's jobs (or one user's invented names, without Slurm) filled the 64-job table and every
    other job's training faults went unseen on the node. A user has training.max_jobs_per_user of it; root and the
    trusted uids (owner None) only the table's size."""
    m = TrainingMonitor(MonitorConfig(max_jobs=64, max_jobs_per_user=16))
    for i in range(16):
        m.ingest(Report(job=str(1000 + i), rank=0, step=1), 0.0, owner=1000)
    with pytest.raises(ReportRefused, match="max_jobs_per_user"):
        m.ingest(Report(job="2000", rank=0, step=1), 0.0, owner=1000)
    m.ingest(Report(job="1000", rank=1, step=1), 0.0, owner=1000)  # its own jobs' other ranks still count
    m.ingest(Report(job="3000", rank=0, step=1), 0.0, owner=1001)  # another user still gets in
    for i in range(47):
        m.ingest(Report(job=f"root-{i}", rank=0, step=1), 0.0, owner=None)
    assert len(m.jobs) == 64
    m.ingest(Report(job="1000", rank=0, step=0, end=True), 0.0, owner=1000)
    m.ingest(Report(job="1000", rank=1, step=0, end=True), 0.0, owner=1000)
    m.ingest(Report(job="2000", rank=0, step=1), 0.0, owner=1000)  # one of its jobs ended: room again
