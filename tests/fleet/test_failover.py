"""Cross-cluster failover (fleetheal.fleet.failover) on the real lab federation: cluster a loses all its
nodes at once (a leaf switch) and the lab training job resumes on b from its checkpoint, one log, one run."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pytest

from fleetheal.contracts import CHECKPOINT_WORD
from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import failover
from fleetheal.lab import train
from fleetheal.slurm.jobs import ClusterJob
from fleetheal.wait import wait_until

if TYPE_CHECKING:
    from fleetheal.lab.federation import Federation

REPO = Path(__file__).resolve().parents[2]


def fleet(store_path: str) -> fleetcfg.FleetConfig:
    """a and b read the shared store; c does not."""
    stores = {"a": ("shared",), "b": ("shared",), "c": ()}
    return fleetcfg.FleetConfig(
        federation="fed",
        clusters=MappingProxyType(
            {n: fleetcfg.Cluster(gpu_type="h100", gpus_per_node=8, checkpoint_stores=s) for n, s in stores.items()}
        ),
        checkpoint_stores=MappingProxyType({"shared": fleetcfg.CheckpointStore(path=store_path)}),
    )


def test_choose_target_refuses_a_cluster_that_cannot_read_the_store() -> None:
    f = fleet("/shared")
    assert failover.choose_target(f, "shared", "a") == ("b", "")
    target, why = failover.choose_target(f, "shared", "a", target="c")
    assert target == "" and "cannot read checkpoint store 'shared'" in why
    assert failover.choose_target(f, "nope", "a")[1] == "checkpoint store 'nope' is not declared in the fleet file"


@pytest.fixture
def job_on_a(federation: Federation) -> Iterator[tuple[str, Path]]:
    """The lab training job on cluster a, checkpointing to a dir both clusters read; cancelled and a's nodes
    resumed afterwards."""
    run_dir = Path(tempfile.mkdtemp(prefix="fleetheal-failover-"))
    script = (
        f"#!/bin/bash\nexport PYTHONPATH={REPO}\n"
        f"exec {sys.executable} -m fleetheal.lab.train coordinator --run-dir {run_dir} --steps 100000 "
        "--step-time 0.05 --checkpoint-every 0.5\n"
    )
    a = federation.clusters["a"]
    jid = a.sbatch(
        script, "-M", "a", "-N1", "--requeue", "--open-mode=append", "-o", str(run_dir / "job.log"),
        f"--comment={CHECKPOINT_WORD}shared",
    )  # fmt: skip
    try:
        wait_until(lambda: (train.read_checkpoint(run_dir) or {}).get("step", 0) > 0, 60, "a first checkpoint")
        yield jid, run_dir
    finally:
        federation.cancel([jid])
        a.scontrol("update", "nodename=a1,a2", "state=resume", check=False)
        a.wait_nodes(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.federation
def test_a_wrong_alert_sets_no_answering_node_down(federation: Federation, job_on_a: tuple[str, Path]) -> None:
    """The move sets DOWN only the job's nodes that Slurm itself flagged not responding: an alert that a healthy
    node is lost (nothing frozen here) leaves every node of the job as it is."""
    jid, _ = job_on_a
    a = federation.clusters["a"]
    before = {name: (n.state, n.reason) for name, n in a.nodes().items()}
    assert failover._down_lost(jid, "a", federation.env) == []
    assert {name: (n.state, n.reason) for name, n in a.nodes().items()} == before
    assert failover.where(jid, federation.env).get("a") == "RUNNING"


@pytest.mark.federation
def test_job_moves_to_b_when_a_loses_its_leaf_switch(federation: Federation, job_on_a: tuple[str, Path]) -> None:
    jid, run_dir = job_on_a
    f = fleet(str(run_dir))
    env = federation.env
    # Dry run and a refused target move nothing.
    assert failover.move(jid, "a", "shared", f, env, dry_run=True).action == "would-move"
    assert failover.move(jid, "a", "shared", f, env, target="c").action == "refused"
    assert failover.where(jid, env).get("a") == "RUNNING"
    # The leaf switch: every node of a down at once.
    federation.clusters["a"].scontrol("update", "nodename=a1,a2", "state=down", "reason=leaf-switch")
    d = failover.move(jid, "a", "shared", f, env, timeout=60)
    assert (d.action, d.target) == ("moved", "b"), d
    assert federation.active()[jid] == ["b"]  # runs once, on b only
    wait_until(
        lambda: any(e.get("event") == "start" and e.get("resumed_from", 0) > 0 for e in train.read_events(run_dir)),
        60, "the job to resume on b",
    )  # fmt: skip
    starts = [e for e in train.read_events(run_dir) if e.get("event") == "start"]
    assert starts[0]["resumed_from"] == 0 and starts[-1]["resumed_from"] > 0
    assert starts[-1]["host"].startswith("b")
    log = (run_dir / "job.log").read_text()
    assert "starts on" in log and f"resumed from checkpoint step {starts[-1]['resumed_from']}" in log
    # A second call does not move it again.
    again = failover.move(jid, "a", "shared", f, env)
    assert (again.action, again.target) == ("noop", "b")
    assert federation.active()[jid] == ["b"]


def _resumed_on(run_dir: Path, prefix: str) -> bool:
    return any(
        e.get("event") == "start" and e.get("resumed_from", 0) > 0 and str(e.get("host", "")).startswith(prefix)
        for e in train.read_events(run_dir)
    )


@pytest.mark.federation
def test_the_remediator_moves_a_job_its_cluster_cannot_heal(
    federation: Federation, job_on_a: tuple[str, Path], tmp_path: Path
) -> None:
    """The third recovery stage end to end: a's leaf switch is lost (both nodes stop answering, the job hangs),
    the alerts reach a's remediator, which may isolate one node (budget 1) and has no standby: it isolates
    one, requeues the job, and moves it to b, which reads its checkpoint store. A wrong store is never used."""
    from fleetheal.lab.fedremediator import ClusterRemediator

    jid, run_dir = job_on_a
    fleet_file = federation.write_fleet_file(tmp_path / "fleet.yaml", run_dir)
    a = federation.clusters["a"]
    with ClusterRemediator(federation, "a", tmp_path / "remediator", fleet_file, budget=1, wait_s=2.0) as rem:
        frozen = a.freeze_nodes(["a1", "a2"])
        try:
            rem.alert(["a1", "a2"], "nic-down")
            wait_until(lambda: federation.active().get(jid) == ["b"], 120, f"job {jid} to run on b only")
            wait_until(lambda: _resumed_on(run_dir, "b"), 60, "the job to resume on b from its checkpoint")

            def moves() -> list[dict[str, Any]]:
                steps = [st for i in rem.incidents() for st in i["steps"] if st["name"] == "failover"]
                return [st for st in steps if st["ended_at"] is not None and st["result"] == "moved"]

            moved = wait_until(moves, 30, "the remediator to record the move")
            assert len(moved) == 1 and f"{jid} moved to b" in moved[0]["detail"], moved
            incidents = {i["node"]: i for i in rem.incidents()}
            assert set(incidents) == {"a1", "a2"}
            # the other node's isolation is held by the budget: nothing drained it
            held = [i for i in incidents.values() if i["state"] == "classified"]
            assert len(held) == 1 and "budget" in (held[0]["hold_reason"] or ""), incidents
        finally:
            a.thaw_nodes(frozen)
    starts = [e for e in train.read_events(run_dir) if e.get("event") == "start"]
    assert starts[-1]["host"].startswith("b") and starts[-1]["resumed_from"] > 0
    log = (run_dir / "job.log").read_text()
    assert f"resumed from checkpoint step {starts[-1]['resumed_from']}" in log  # one log, continued on b


def test_the_checkpoint_store_comes_from_the_comment_and_survives_fleetheals_rewrites() -> None:
    from fleetheal.steps import slurm as slurm_steps

    assert failover.checkpoint_store(f"x {CHECKPOINT_WORD}ckpt y") == "ckpt"
    assert failover.checkpoint_store("fleetheal: requeued", default="shared") == "shared"
    job = {"comment": f"{CHECKPOINT_WORD}ckpt fleetheal-launch fleetheal-nodes=2"}
    assert slurm_steps._launch_words(job).split()[0] == f"{CHECKPOINT_WORD}ckpt"
    assert slurm_steps._launch_words({"comment": f"user text {CHECKPOINT_WORD}ckpt"}) == f" {CHECKPOINT_WORD}ckpt"


@pytest.mark.federation
def test_a_move_interrupted_after_its_hold_finishes_on_the_next_call(
    federation: Federation, job_on_a: tuple[str, Path]
) -> None:
    """A remediator killed mid-move leaves the job held and requeued on nodes that do not answer. Once Slurm
    lets go of it (COMPLETING until SlurmdTimeout), 22.05 keeps it in REQUEUE_FED and 26.05 PENDING (held).
    The next call (the resumed incident) still sees the job and moves it."""
    jid, run_dir = job_on_a
    a = federation.clusters["a"]
    frozen = a.freeze_nodes(["a1", "a2"])
    try:
        a.scontrol("hold", jid)
        a.scontrol("requeue", jid, check=False)
        wait_until(
            lambda: failover.where(jid, federation.env).get("a") in ("REQUEUE_FED", "PENDING"),
            90,
            "Slurm to let go of the requeued job",
        )
        d = failover.move(jid, "a", "shared", fleet(str(run_dir)), federation.env, timeout=60)
        assert (d.action, d.target) == ("moved", "b"), d
        assert federation.active()[jid] == ["b"]
    finally:
        a.thaw_nodes(frozen)


class _ListedStage(failover.Stage):
    """The stage with Slurm's job list given and its moves recorded (a test double of Slurm only)."""

    def __init__(self, jobs: list[ClusterJob]) -> None:
        super().__init__(fleet("/shared"), "a", default_store="shared", wait_s=0.0)
        self.listed = jobs
        self.moved: list[str] = []

    def jobs(self, *, node: str = "") -> list[ClusterJob]:
        return self.listed

    def _move(self, job: ClusterJob, dry_run: bool, why: str) -> failover.Decision:
        self.moved.append(job.job_id)
        return failover.Decision(job.job_id, "moved", "a", "b", why)


def test_only_jobs_the_first_response_requeued_move_not_those_whose_comment_names_the_incident() -> None:
    """A local user can write `incident=inc-000001` into their own job's comment; that does not make the
    remediator move (or wait on) their job: the requeued jobs come from its own record."""
    word = "fleetheal: requeued after nic-down on a1 incident=inc-000001"
    stage = _ListedStage([
        ClusterJob("11", "PENDING", "", word),  # requeued by the first response
        ClusterJob("12", "PENDING", "", word),  # forged by its owner
        ClusterJob("13", "RUNNING", "a2", word),  # requeued, but Slurm started it again here
    ])  # fmt: skip
    decisions = stage.after_isolation("inc-000001", ["11", "13"])
    assert stage.moved == ["11"] and [d.job_id for d in decisions] == ["11"]


def test_the_engine_reads_the_requeued_job_from_the_first_responses_own_words() -> None:
    from fleetheal import steps
    from fleetheal.remediator.stages import REQUEUED

    result = steps.StepResult("slurm_requeue", "done", "sent USR1 to job 67108865, requeued it with priority 1281")
    event = f"{result.step} {result.outcome}: {result.detail}"  # as the engine records a first-response step
    m = REQUEUED.match(event)
    assert m is not None and m.group(1) == "67108865"
    assert REQUEUED.match("slurm_requeue skipped: job 5 is not active on a1") is None
