"""The remediator's first responder and a playbook run by hand leave Slurm in the same state.

Real Slurm, the real playbook through ansible-runner, the real FirstResponder (no Kubernetes API here:
both skip it; tests/ansible/test_remediation_k8s.py covers the Kubernetes steps on a real API server).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from fleetheal import steps
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator.responder import FirstResponder
from tests.ansible.conftest import (
    PLAYBOOKS,
    Playbooks,
    job_json,
    node_json,
    respond,
    responder_incident,
    submit_running,
)

pytestmark = pytest.mark.slurm  # a real Slurm: `make compat` runs these on 22.05 too


@pytest.fixture
def cluster(tmp_path: Path):
    c = SlurmCluster(tmp_path / "slurm", nodes=4, gpus_per_node=2)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _slurm_state(cluster: SlurmCluster, ref: str, node: str, job: str, promoted: str) -> dict[str, object]:
    """What the isolation left in Slurm, with the incident, failed node and promoted node written generically."""

    def generic(text: str) -> str:
        return re.sub(rf"\b{re.escape(node)}\b", "FAILED", text.replace(ref, "INC"))

    failed, standby, entry = node_json(cluster, node), node_json(cluster, promoted), job_json(cluster, job)
    return {
        "failed": (sorted(failed["flags"]), generic(failed["reason"])),
        "promoted": ("DRAIN" in standby["flags"], generic(standby["comment"])),
        "job": (entry["restart_cnt"], generic(entry["comment"]), generic(str(entry.get("excluded_nodes")))),
    }


def test_the_first_responder_and_the_hand_run_playbook_leave_the_same_slurm_state(
    cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for standby in ("n3", "n4"):
        cluster.run("scontrol", "update", f"nodename={standby}", "state=DRAIN", "reason=fleetheal:standby")
    job_a, node_a = submit_running(cluster, "--nodelist=n1")
    job_b, node_b = submit_running(cluster, "--nodelist=n2")
    assert (node_a, node_b) == ("n1", "n2")

    site = {"fleetheal_slurm_env": {"SLURM_CONF": str(cluster.conf_path)}, "fleetheal_grace_seconds": 1}
    responder = FirstResponder(steps.Settings.load(PLAYBOOKS, site), kube_factory=lambda _settings: None)
    recorded = respond(responder, responder_incident("inc-a", "n1"))
    assert all(r.outcome in ("done", "skipped") for r in recorded), recorded
    promoted_a = next(r.node for r in recorded if r.step == "standby_promote")

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # ansible-playbook
    work = tmp_path / "ansible"
    work.mkdir()
    playbooks = Playbooks(cluster, work)
    run = playbooks.run(
        "isolate_and_relocate.yml",
        playbooks.base_vars(
            fleetheal_incident_id="inc-b",
            fleetheal_node="n2",
            fleetheal_fault_id="xid-79",
            fleetheal_fault_class="hardware",
            fleetheal_action="ISOLATE_AND_RELOCATE",
            fleetheal_gpu="1",
        ),
    )
    assert run.rc == 0, run.stdout[-3000:]
    promoted_b = next(n for n in ("n3", "n4") if n != promoted_a)
    assert f"promoted standby node {promoted_b}" in run.steps("standby_promote")[0]["detail"]

    by_responder = _slurm_state(cluster, "inc-a", "n1", job_a, promoted_a)
    by_playbook = _slurm_state(cluster, "inc-b", "n2", job_b, promoted_b)
    assert by_responder == by_playbook
    assert by_responder["job"][0] == 1 and "FAILED" in by_responder["job"][2]
    # the same steps, by name, in the responder's record and in the playbook's report
    assert {r.step for r in recorded} >= {"slurm_drain", "slurm_signal", "slurm_requeue", "standby_promote"}
    assert {st["step"] for st in run.report["steps"]} >= {"slurm_drain", "slurm_requeue", "standby_promote"}


def test_a_restart_that_only_signals_is_left_to_the_playbook() -> None:
    """`fleetheal_restart_mode: signal`: one command, which nothing in Slurm records; the responder leaves it
    to the playbook instead of requeueing the job the site asked only to be signalled."""
    requeue = FirstResponder(steps.Settings())
    signal = FirstResponder(steps.Settings(restart_mode="signal"))
    try:
        assert requeue.handles("RESTART_IN_PLACE") and requeue.handles("ISOLATE_AND_RELOCATE")
        assert not signal.handles("RESTART_IN_PLACE") and signal.handles("ISOLATE_AND_RELOCATE")
        assert not requeue.handles("REFUSE_AND_REPORT")
    finally:
        requeue.close()
        signal.close()
