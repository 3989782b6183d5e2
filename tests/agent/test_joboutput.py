"""A job's own output as a fault source: job-scoped faults only, a repeated OOM, and a flood that costs nothing."""

from __future__ import annotations

import time

import pytest

from fleetheal.agent.joboutput import JobOutputJudge
from fleetheal.contracts import JOB_OUTPUT_NODE_CLAIM, JOB_OUTPUT_SOURCE, NODE_WIDE_GPU
from fleetheal.logparse import APPLICATION, load_parser
from fleetheal.taxonomy import load

TX = load()
PARSER = load_parser(taxonomy=TX, log=APPLICATION)

NCCL = "[rank3]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def judge(**kw) -> JobOutputJudge:
    return JobOutputJudge(TX, PARSER, **kw)


@pytest.mark.parametrize(
    ("line", "fault"),
    [
        (NCCL, "nccl-timeout"),
        (OOM, "cuda-oom"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda-illegal-address"),
        ("RuntimeError: CUDA error: no kernel image is available for execution on the device", "config-error"),
        # Issue 45: what the job itself can cause is its own fault, never a claim on the node.
        ("OSError: [Errno 28] No space left on device", "write-no-space"),
        (
            "n1:2143:2561 [1] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device",
            "config-error",
        ),
        (
            "slurmstepd: error: Detected 1 oom_kill event in StepId=440575.0. Some of the step tasks have been OOM Killed.",
            "host-oom",
        ),
        (
            "n1:9:9 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<4> with status=12 opcode=0 len=0 vendor err 129",
            "network-transport-error",
        ),
    ],
)
def test_a_job_scoped_fault_is_raised_for_that_job_alone(line, fault):
    det = judge().judge("4242", line, 0.0)
    assert det is not None
    assert (det.fault_id, det.gpu, det.source, det.job) == (fault, NODE_WIDE_GPU, JOB_OUTPUT_SOURCE, "4242")
    assert not TX.moves_node(fault)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
        "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.",
        "XID 79 GPU has fallen off the bus",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "EXT4-fs (nvme0n1p1): Remounting filesystem read-only",
        "Detected 1 volatile double-bit ECC error(s) in GPU 0.",
    ],
)
def test_a_job_that_claims_a_node_fault_moves_no_node(line):
    """Job output is text its owner controls: a claim that would isolate or drain the node becomes the
    job-scoped claim fault, whose action keeps the node (the node's own signals decide about it)."""
    det = judge().judge("4242", line, 0.0)
    if (
        "NVRM" in line or "EXT4" in line
    ):  # the kernel's words: only kernel rules know them, and job output never reads kernel rules
        assert det is None
        return
    assert det is not None and det.fault_id == JOB_OUTPUT_NODE_CLAIM and det.job == "4242", det
    assert "claims" in det.detail
    fault = TX.get(JOB_OUTPUT_NODE_CLAIM)
    assert (fault.fault_class, fault.action) == ("user", "REFUSE_AND_REPORT")
    assert not TX.actions[fault.action].destructive and not TX.actions[fault.action].fastpath


def test_lines_no_rule_wants_raise_nothing():
    j = judge()
    assert j.judge("1", "step 100 loss 2.31 lr 3e-4", 0.0) is None
    assert j.judge("1", "an error no rule knows happened", 0.0) is None  # unknown: counted by nobody, no fault


def test_a_second_oom_at_the_same_step_is_cuda_oom_repeated():
    j = judge()
    assert j.judge("7", OOM, 0.0, step=100, run="0.0").fault_id == "cuda-oom"
    assert j.judge("7", OOM, 0.5, step=100, run="0.0").fault_id == "cuda-oom"  # another rank of the same run
    assert j.judge("7", OOM, 9.0, step=100, run="0.1").fault_id == "cuda-oom-repeated"  # restarted, same step
    assert j.judge("7", OOM, 20.0, step=180, run="0.2").fault_id == "cuda-oom"  # progress since: a new first
    assert j.judge("8", OOM, 20.0, step=180, run="0.2").fault_id == "cuda-oom"  # another job has its own count


def test_without_a_run_count_a_second_oom_counts_after_the_dedup_window():
    j = judge(dedup_s=30.0)
    assert j.judge("7", OOM, 0.0).fault_id == "cuda-oom"
    assert j.judge("7", OOM, 10.0).fault_id == "cuda-oom"  # the ranks of one failure
    assert j.judge("7", OOM, 31.0).fault_id == "cuda-oom-repeated"  # no progress reported in between


def test_a_million_error_lines_cost_almost_nothing_and_are_dropped_past_the_rate():
    j = judge(lines_per_s=50.0)
    started = time.perf_counter()
    raised = [j.judge("9", NCCL, 0.0) for _ in range(1_000_000)]
    took = time.perf_counter() - started
    assert sum(d is not None for d in raised) == 50 and j.dropped == 1_000_000 - 50
    assert took < 5.0, f"{took:.2f} s for a million lines"
    assert j.judge("9", NCCL, 1.0) is not None  # the budget refills


def test_memory_stays_bounded_whatever_the_job_names():
    j = judge(max_jobs=8)
    for n in range(100):
        j.judge(str(n), OOM, float(n))
    assert len(j._ooms) <= 8 and len(j._budgets) <= 8
