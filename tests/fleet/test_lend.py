"""The live lending controller (`fleetheal queue lend`): its decisions from plain values, and on the real
lab federation, idle large-queue GPUs lent to small jobs and taken back for a waiting large job without
stopping any small one."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from fleetheal.errors import UsageError
from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import queue_policy, queues, view
from fleetheal.fleet.config import Queues
from fleetheal.slurm.fields import SEP
from fleetheal.slurm.jobs import QueuedJob
from fleetheal.wait import wait_until

if TYPE_CHECKING:
    from fleetheal.lab.federation import Federation

CFG = Queues(small_guaranteed_gpus=4)

#: Cluster a as fleetheal.fleet.view reads it: 16 GPUs, 4 running small and 4 running large, two large
#: jobs and a small one waiting.
CLUSTER = view.ClusterStatus(
    "a",
    True,
    gpus={"h100": view.Gpus(allocated=8, free=8)},
    jobs=(
        QueuedJob("1", "running", "small", 4),
        QueuedJob("2", "running", "large", 4),
        QueuedJob("3", "pending", "large", 16),
        QueuedJob("4", "pending", "large", 8),
        QueuedJob("5", "pending", "small", 1),
    ),
)
#: `squeue -O JobID,PriorityLong,SubmitTime` of the pending large jobs (and a line that is not one).
HEADS = f"3{SEP}900{SEP}2026-12-05T10:00:30{SEP}\n4{SEP}500{SEP}2026-12-05T09:00:00{SEP}\ngarbage\n"


def test_the_load_comes_from_the_fleet_status_read_and_the_head_from_its_priority() -> None:
    now = queue_policy._time("2026-12-05T10:01:00")
    # the highest-priority pending large job is the head (not the oldest)
    assert queue_policy.load_of(CLUSTER, CFG, HEADS, now) == queue_policy.Load(
        16, 4, 4, head_gpus=16, head_waited_s=30.0
    )
    assert queue_policy.load_of(CLUSTER, CFG) == queue_policy.Load(16, 4, 4)  # without reclaim, no head is read


def test_decide_lends_idle_gpus_and_takes_them_back_only_with_reclaim() -> None:
    idle = queue_policy.Load(16, 0, 0)
    assert queue_policy.decide(idle, CFG) == 16  # everything is lent
    assert queue_policy.decide(queue_policy.Load(16, 8, 4), CFG) == 8  # what the large queue runs is not
    waiting = queue_policy.Load(16, 0, 12, head_gpus=16, head_waited_s=600)
    assert queue_policy.decide(waiting, CFG) == 16  # default: Slurm's backfill reservation protects the head
    reclaim = dataclasses.replace(CFG, reclaim=True, reclaim_after_s=300)
    assert queue_policy.decide(waiting, reclaim) == 4  # back to the guarantee, nothing stopped
    assert queue_policy.decide(dataclasses.replace(waiting, head_waited_s=60), reclaim) == 16  # not yet


def _states(fed: Federation, ids: list[str]) -> dict[str, str]:
    out = fed.run("squeue", "-M", "a", "-h", "-t", "all", "-o", "%i|%T", check=False).stdout
    found = dict(line.split("|", 1) for line in out.split() if "|" in line)
    return {i: found.get(i, "GONE") for i in ids}


@pytest.mark.federation
def test_lending_on_real_slurm_takes_back_for_a_waiting_large_job_without_stopping_a_small_one(
    federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = federation.env
    monkeypatch.setenv("SLURM_CONF", str(federation.conf_path))
    fleet_file = federation.write_fleet_file(tmp_path / "fleet.yaml", tmp_path)
    doc = yaml.safe_load(fleet_file.read_text())
    doc["queues"] = {"small_guaranteed_gpus": 4, "reclaim": True, "reclaim_after_s": 0}
    fleet_file.write_text(yaml.safe_dump(doc))
    a = federation.clusters["a"]
    ids: list[str] = []

    def sbatch(*args: str) -> str:
        jid = a.sbatch("#!/bin/sh\nsleep 8\n", "-M", "a", "-o", "/dev/null", *args)
        ids.append(jid)
        return jid

    def lend_cli(*args: str) -> str:
        parser = argparse.ArgumentParser()
        queues.register(parser.add_subparsers())
        ns = parser.parse_args(["queue", "lend", "--fleet", str(fleet_file), "--cluster", "a", "--once", *args])
        assert ns.func(ns) == 0
        return capsys.readouterr().out

    before = queues.qos_limit("small", env)
    try:
        assert "QOS small" in lend_cli("--dry-run")
        load, _, want, _ = queues.lend_once(fleetcfg.load(fleet_file, env={}), "a", env)
        assert (load.total_gpus, want) == (16, 16)  # idle: the large queue's GPUs are all lent
        smalls = [sbatch("--qos=small", "--gres=gpu:4") for _ in range(3)]
        wait_until(lambda: set(_states(federation, smalls).values()) == {"RUNNING"}, 30, "3 small jobs to run")
        large = sbatch("--qos=large", "-N2", "--gres=gpu:8")
        wait_until(lambda: _states(federation, [large])[large] == "PENDING", 30, "the large job to wait")
        out = lend_cli()
        assert "set GrpTRES=gres/gpu=4" in out and "small running 12" in out and "16-GPU large job waiting" in out
        assert queues.qos_limit("small", env) == 4
        late = sbatch("--qos=small", "--gres=gpu:4")
        # Nothing is stopped: the three small jobs run on; the new one waits for the QOS.
        wait_until(lambda: _states(federation, [late])[late] == "PENDING", 30, "the late small job to wait")
        assert set(_states(federation, smalls).values()) == {"RUNNING"}
        wait_until(lambda: _states(federation, [large])[large] == "RUNNING", 60, "the large job to start")
        assert _states(federation, [late])[late] == "PENDING"  # the large job went first
        acct = federation.run("sacct", "-M", "a", "-n", "-X", "-P", "-j", ",".join(smalls), "-o", "JobID,State")
        assert {line.split("|")[1] for line in acct.stdout.split()} == {"COMPLETED"}  # none preempted
    finally:
        limit = -1 if before is None else before
        federation.sacctmgr("modify", "qos", "small", "set", f"GrpTRES=gres/gpu={limit}")
        federation.cancel(ids)


def test_the_controller_refuses_an_unknown_cluster(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("clusters: {a: {}}\n")
    parser = argparse.ArgumentParser()
    queues.register(parser.add_subparsers())
    ns = parser.parse_args(["queue", "lend", "--fleet", str(fleet), "--cluster", "z", "--once"])
    with pytest.raises(UsageError, match="--cluster z: not a cluster of the fleet file"):
        ns.func(ns)


def test_a_missing_qos_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, "normal|\nlarge|\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(queues.LendError, match="QOS 'small' does not exist"):
        queues.qos_limit("small")
