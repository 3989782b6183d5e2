"""Cross-cluster failover (fleetheal.fleet.failover) on the real lab federation: cluster a loses all its
nodes at once (a leaf switch) and the lab training job resumes on b from its checkpoint, one log, one run."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import pytest

from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import failover
from fleetheal.lab import train
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
    jid = a.sbatch(script, "-M", "a", "-N1", "--requeue", "--open-mode=append", "-o", str(run_dir / "job.log"))
    try:
        wait_until(lambda: (train.read_checkpoint(run_dir) or {}).get("step", 0) > 0, 60, "a first checkpoint")
        yield jid, run_dir
    finally:
        federation.cancel([jid])
        a.scontrol("update", "nodename=a1,a2", "state=resume", check=False)
        a.wait_nodes(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


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
