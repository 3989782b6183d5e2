"""The remediation playbooks, run through ansible-runner against a real private Slurm cluster.

Every test starts its own slurmctld + 3 slurmd (fixture `slurm`), plants a situation (a running job,
a standby node, a foreign drain), runs one playbook and checks Slurm's state afterwards.
"""

from __future__ import annotations

import pytest

from fleetheal import contracts, taxonomy
from fleetheal.lab.slurm import SlurmCluster

from .conftest import FIXTURE_BIN, Playbooks, job_json, job_log, node_json, submit_running, wait_until

pytestmark = pytest.mark.slurm


def _isolate_vars(pb: Playbooks, node: str, **kw: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "fleetheal_node": node,
        "fleetheal_fault_id": "xid-79",
        "fleetheal_fault_class": "hardware",
        "fleetheal_action": "ISOLATE_AND_RELOCATE",
        "fleetheal_gpu": "1",
    }
    fields.update(kw)
    return pb.base_vars(**fields)


def test_isolate_and_relocate_drains_requeues_boosts_and_promotes(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    job, node = submit_running(slurm)
    other, _ = submit_running(slurm)
    standby = next(n for n in slurm.node_names if n not in (node, slurm.job(other)["NodeList"]))
    slurm.scontrol("update", f"nodename={standby}", "state=drain", "reason=fleetheal:standby incident=inc-0")

    run = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node))
    assert run.rc == 0, run.stdout[-4000:]

    info = slurm.node(node)
    assert info.drained
    assert info.reason == contracts.drain_reason("xid-79", "inc-1", gpu="1")
    assert contracts.owns_reason(info.reason)

    entry = job_json(slurm, job)
    assert entry["restart_cnt"] == 1
    assert entry["state"] in ("PENDING", "RUNNING")
    assert node not in entry["nodes"]
    assert "incident=inc-1" in entry["comment"].split()
    # The boost puts the requeued job above every other job.
    assert entry["priority"] > job_json(slurm, other)["priority"]
    assert "got USR1 at restart 0" in job_log(slurm, job)

    assert not slurm.node(standby).drained
    assert node_json(slurm, standby)["extra"] == f"fleetheal: promoted for {node} incident=inc-1"
    assert run.report is not None and run.report["status"] == "done"
    assert [s["outcome"] for s in run.steps("standby_promote")] == ["done"]
    assert run.steps("k8s_isolate")[0]["outcome"] == "skipped"
    assert "no Kubernetes API configured" in run.steps("k8s_isolate")[0]["detail"]

    # Idempotent per incident: a second run changes nothing.
    again = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node))
    assert again.rc == 0, again.stdout[-4000:]
    assert job_json(slurm, job)["restart_cnt"] == 1
    assert "already drained by fleetheal" in again.steps("slurm_drain")[0]["detail"]
    assert "already promoted" in again.steps("standby_promote")[0]["detail"]
    assert again.stats.get("changed", {}) == {}


def test_dry_run_reports_would_and_changes_nothing(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    job, node = submit_running(slurm)
    run = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node, fleetheal_dry_run=True))
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["status"] == "dry_run"
    drain = run.steps("slurm_drain")[0]
    assert drain["outcome"] == "would"
    # The playbook's reason is the agent's, from the one rule (contracts.drain_reason, through a filter).
    reason = contracts.drain_reason("xid-79", "inc-1", "1")
    assert reason == "fleetheal:xid-79 incident=inc-1 gpu=1"
    assert drain["detail"].startswith(f"would drain {node} with reason '{reason}'")
    assert run.steps("slurm_requeue")[0]["detail"].startswith(f"would send USR1 to job {job}")
    assert not slurm.node(node).drained
    entry = job_json(slurm, job)
    assert (entry["state"], entry["restart_cnt"]) == ("RUNNING", 0)
    assert "got USR1" not in job_log(slurm, job)


def test_check_mode_is_a_dry_run(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    job, node = submit_running(slurm)
    run = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node), cmdline="--check")
    assert run.rc == 0, run.stdout[-4000:]
    assert run.report is not None and run.report["dry_run"] is True
    assert {s["outcome"] for s in run.report["steps"]} <= {"would", "skipped"}
    assert not slurm.node(node).drained
    assert job_json(slurm, job)["restart_cnt"] == 0


def test_action_the_taxonomy_does_not_map_is_refused(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    _, node = submit_running(slurm)
    # Xid 31 is a user fault (REFUSE_AND_REPORT): isolating the node for it must be refused.
    assert taxonomy.load().get("xid-31").action == "REFUSE_AND_REPORT"
    run = playbooks.run(
        "isolate_and_relocate.yml",
        _isolate_vars(playbooks, node, fleetheal_fault_id="xid-31", fleetheal_fault_class="user"),
    )
    assert run.rc != 0
    assert run.report is not None and run.report["status"] == "failed"
    assert "maps xid-31 (user) to REFUSE_AND_REPORT, not ISOLATE_AND_RELOCATE" in run.report["error"]
    assert not slurm.node(node).drained


def test_playbook_for_another_action_is_refused(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    _, node = submit_running(slurm)
    run = playbooks.run("reset_gpu.yml", _isolate_vars(playbooks, node))
    assert run.rc != 0
    assert run.report is not None
    assert "isolate_and_relocate.yml runs ISOLATE_AND_RELOCATE" in run.report["error"]
    assert not slurm.node(node).drained


def test_missing_node_variable_hits_no_host(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    _, node = submit_running(slurm)
    extravars = _isolate_vars(playbooks, node)
    del extravars["fleetheal_node"]
    run = playbooks.run("isolate_and_relocate.yml", extravars)
    assert run.rc == 0
    assert "no hosts matched" in run.stdout
    assert run.report is None  # not one task ran
    assert not slurm.node(node).drained


def test_destructive_action_needs_the_safety_gate_budget(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    _, node = submit_running(slurm)
    extravars = _isolate_vars(playbooks, node)
    del extravars["fleetheal_budget_remaining"]
    run = playbooks.run("isolate_and_relocate.yml", extravars)
    assert run.rc != 0
    assert run.report is not None and "isolation budget is spent" in run.report["error"]
    assert not slurm.node(node).drained
    paused = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node, fleetheal_paused=True))
    assert paused.rc != 0 and not slurm.node(node).drained


def test_foreign_drain_is_never_taken_over_or_undrained(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    node = slurm.node_names[0]
    slurm.scontrol("update", f"nodename={node}", "state=drain", "reason=admin: PSU swap RT#4711")
    run = playbooks.run("isolate_and_relocate.yml", _isolate_vars(playbooks, node))
    assert run.rc == 0, run.stdout[-4000:]
    assert run.steps("slurm_drain")[0]["outcome"] == "skipped"
    assert slurm.node(node).reason == "admin: PSU swap RT#4711"

    rejoin = playbooks.run(
        "rejoin.yml", playbooks.base_vars(fleetheal_node=node, fleetheal_fault_id="xid-79", fleetheal_action="REJOIN")
    )
    assert rejoin.rc != 0
    assert rejoin.report is not None and "which fleetheal does not own" in rejoin.report["error"]
    info = slurm.node(node)
    assert info.drained and info.reason == "admin: PSU swap RT#4711"


def test_refuse_and_report_tells_the_job_and_keeps_the_node(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    job, node = submit_running(slurm)
    extravars = playbooks.base_vars(
        fleetheal_node=node,
        fleetheal_fault_id="xid-31",
        fleetheal_fault_class="user",
        fleetheal_action="REFUSE_AND_REPORT",
        fleetheal_job_id=job,
        fleetheal_explanation="MMU fault from the application: check array bounds",
    )
    log = slurm.state_dir / "jobs" / f"out-{job}.log"
    assert wait_until(log.exists)
    inode = log.stat().st_ino
    run = playbooks.run("refuse_and_report.yml", extravars)
    assert run.rc == 0, run.stdout[-4000:]
    # Appended in place: the running job still writes into the file its owner reads (not an unlinked one).
    assert log.stat().st_ino == inode
    entry = job_json(slurm, job)
    assert entry["comment"].startswith("fleetheal: not requeued: xid-31 (user)")
    assert "incident=inc-1" in entry["comment"].split()
    assert (entry["state"], entry["restart_cnt"]) == ("RUNNING", 0)
    assert not slurm.node(node).drained
    assert "check array bounds" in job_log(slurm, job)

    again = playbooks.run("refuse_and_report.yml", extravars)
    assert again.rc == 0
    assert job_log(slurm, job).count("fleetheal: not requeued") == 1
    assert again.stats.get("changed", {}) == {}


def test_restart_in_place_requeues_on_the_same_node_within_the_limit(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    job, node = submit_running(slurm)
    base = {
        "fleetheal_node": node,
        "fleetheal_fault_id": "nccl-timeout",
        "fleetheal_fault_class": "transient",
        "fleetheal_action": "RESTART_IN_PLACE",
        "fleetheal_job_id": job,
        "fleetheal_max_restarts": 1,
    }
    run = playbooks.run("restart_in_place.yml", playbooks.base_vars(**base))
    assert run.rc == 0, run.stdout[-4000:]
    assert not slurm.node(node).drained
    assert wait_until(lambda: job_json(slurm, job)["state"] == "RUNNING", timeout=20)
    entry = job_json(slurm, job)
    assert entry["restart_cnt"] == 1
    assert entry["nodes"] == [node]

    # A second incident on the same job is over the per-job limit: no requeue.
    limited = playbooks.run("restart_in_place.yml", playbooks.base_vars(fleetheal_incident_id="inc-2", **base))
    assert limited.rc == 0, limited.stdout[-4000:]
    assert "restart limit reached (1 of 1)" in limited.steps("slurm_requeue")[0]["detail"]
    assert job_json(slurm, job)["restart_cnt"] == 1


def test_observe_changes_nothing(slurm: SlurmCluster, playbooks: Playbooks, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also run as the remediator runs it, with no fleetheal_slurm_env among the extra variables (Slurm's
    configuration from the process environment): the playbook's settings are loaded by its first task, and
    nothing before it may need them."""
    job, node = submit_running(slurm)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf_path))
    extravars = playbooks.base_vars(fleetheal_node=node, fleetheal_fault_id="unknown", fleetheal_action="OBSERVE")
    del extravars["fleetheal_slurm_env"]
    run = playbooks.run("observe.yml", extravars)
    assert run.rc == 0, run.stdout[-4000:]
    assert run.steps("observe")[0]["detail"].startswith("observed unknown (unknown")
    assert not slurm.node(node).drained
    assert job_json(slurm, job)["restart_cnt"] == 0


def _fixture_vars() -> dict[str, str | list[str]]:
    return {
        "node_validation_nvidia_smi": str(FIXTURE_BIN / "nvidia-smi"),
        "node_validation_dcgmi": str(FIXTURE_BIN / "dcgmi"),
        "node_validation_nccl_binary": str(FIXTURE_BIN / "all_reduce_perf"),
        "node_validation_burnin_argv": [str(FIXTURE_BIN / "dcgmproftester12"), "--no-dcgm-validation", "-d", "30"],
    }


def test_revalidate_without_gpus_fails_closed_to_quarantine(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    node = slurm.node_names[0]
    slurm.scontrol("update", f"nodename={node}", "state=drain", "reason=fleetheal:xid-79 incident=inc-1")
    extravars = playbooks.base_vars(
        fleetheal_node=node,
        fleetheal_fault_id="xid-79",
        fleetheal_action="REVALIDATE",
        node_validation_report_path=str(playbooks.work / "nv.json"),
    )
    run = playbooks.run("revalidate.yml", extravars)
    assert run.rc == 0, run.stdout[-4000:]
    assert "fail (gpu_present: no NVIDIA GPU" in run.steps("revalidate")[0]["detail"]
    info = slurm.node(node)
    assert info.drained and info.reason == "fleetheal:quarantine incident=inc-1"

    rejoin = playbooks.run("rejoin.yml", dict(extravars, fleetheal_action="REJOIN"))
    assert rejoin.rc != 0
    assert rejoin.report is not None and "run REVALIDATE first" in rejoin.report["error"]
    assert slurm.node(node).drained


def test_revalidate_pass_goes_to_standby_then_rejoins(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    node = slurm.node_names[1]
    slurm.scontrol("update", f"nodename={node}", "state=drain", "reason=fleetheal:xid-48 incident=inc-7")
    extravars = playbooks.base_vars(
        fleetheal_incident_id="inc-7",
        fleetheal_node=node,
        fleetheal_fault_id="xid-48",
        fleetheal_action="REVALIDATE",
        node_validation_expected_gpus=8,
        node_validation_report_path=str(playbooks.work / "nv.json"),
        **_fixture_vars(),
    )
    run = playbooks.run("revalidate.yml", extravars)
    assert run.rc == 0, run.stdout[-4000:]
    assert run.steps("revalidate")[0]["detail"].startswith(f"node validation on {node}: pass")
    assert slurm.node(node).reason == "fleetheal:standby incident=inc-7"

    rejoin = playbooks.run("rejoin.yml", dict(extravars, fleetheal_action="REJOIN"))
    assert rejoin.rc == 0, rejoin.stdout[-4000:]
    assert wait_until(lambda: not slurm.node(node).drained)
    assert run.report is not None and rejoin.report is not None
    assert rejoin.report["status"] == "done"


def test_reset_gpu_leaves_the_node_drained_for_its_revalidation(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    """The reset ends with the node drained and owned: REVALIDATE follows (the remediator starts it at once),
    and only a passed revalidation puts the node back, into the standby pool."""
    job, node = submit_running(slurm)
    extravars = playbooks.base_vars(
        fleetheal_node=node,
        fleetheal_fault_id="xid-119",
        fleetheal_action="RESET_GPU",
        fleetheal_gpu="0",
        fleetheal_nvidia_smi=str(FIXTURE_BIN / "nvidia-smi"),
        node_validation_report_path=str(playbooks.work / "nv.json"),
        **_fixture_vars(),
    )
    assert taxonomy.load().get("xid-119").action == "RESET_GPU"
    run = playbooks.run("reset_gpu.yml", extravars)
    assert run.rc == 0, run.stdout[-4000:]
    assert "was successfully reset" in run.steps("gpu_reset")[0]["detail"]
    assert job_json(slurm, job)["restart_cnt"] == 1
    assert run.steps("slurm_resume") == [] and run.steps("revalidate") == []
    assert slurm.node(node).drained and slurm.node(node).reason.startswith("fleetheal:xid-119 incident=inc-1")

    revalidated = playbooks.run("revalidate.yml", dict(extravars, fleetheal_action="REVALIDATE"))
    assert revalidated.rc == 0, revalidated.stdout[-4000:]
    assert slurm.node(node).reason == "fleetheal:standby incident=inc-1"


def test_reset_gpu_failure_leaves_the_node_drained_and_owned(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    node = slurm.node_names[2]
    extravars = playbooks.base_vars(
        fleetheal_node=node,
        fleetheal_fault_id="xid-119",
        fleetheal_action="RESET_GPU",
        fleetheal_gpu="0",
        fleetheal_slurm_retries=0,
        fleetheal_nvidia_smi="/nonexistent/nvidia-smi",
    )
    run = playbooks.run("reset_gpu.yml", extravars)
    assert run.rc != 0
    assert run.report is not None and run.report["status"] == "failed"
    assert "GPU reset" in run.report["error"]
    info = slurm.node(node)
    assert info.drained and info.reason == "fleetheal:xid-119 incident=inc-1 gpu=0"


def _refuse_vars(pb: Playbooks, node: str, **kw: object) -> dict[str, object]:
    return pb.base_vars(
        fleetheal_node=node,
        fleetheal_fault_id="xid-31",
        fleetheal_fault_class="user",
        fleetheal_action="REFUSE_AND_REPORT",
        **kw,
    )


def test_refuse_and_report_without_a_job_tells_no_one_on_a_shared_node(
    slurm: SlurmCluster, playbooks: Playbooks
) -> None:
    """Found by hand: without a job id, the refusal rewrote the comment of every job on the node. Now only a
    node's single job is told; with two, neither is (a guess would speak for someone else's job)."""
    first, node = submit_running(slurm, "--nodelist=n1", "--gres=gpu:1")  # one GPU each: both fit on n1
    second, _ = submit_running(slurm, "--nodelist=n1", "--gres=gpu:1")
    run = playbooks.run("refuse_and_report.yml", _refuse_vars(playbooks, node))
    assert run.rc == 0, run.stdout[-4000:]
    (told,) = [s for s in run.report["steps"] if s["step"] == "job_comment"]
    assert told["outcome"] == "skipped" and "2 jobs run on n1" in told["detail"], told
    for job in (first, second):
        assert "not requeued" not in job_json(slurm, job)["comment"]
        assert "not requeued" not in job_log(slurm, job)
    slurm.run("scancel", second)
    # scontrol, not squeue: from 23.02 `squeue --json` no longer lists a finished job.
    assert wait_until(lambda: slurm.job(second)["JobState"] not in ("RUNNING", "COMPLETING"))
    alone = playbooks.run("refuse_and_report.yml", _refuse_vars(playbooks, node, fleetheal_incident_id="inc-2"))
    assert alone.rc == 0, alone.stdout[-4000:]
    assert "incident=inc-2" in job_json(slurm, first)["comment"].split()


def test_the_refusal_never_follows_a_symlinked_job_log(slurm: SlurmCluster, playbooks: Playbooks, tmp_path) -> None:
    """Found by hand: the cause was appended with `>>` to whatever the job's output path pointed at, so a
    job could have the remediator write into any file it can write (its database, a system file)."""
    job, node = submit_running(slurm)
    log = slurm.state_dir / "jobs" / f"out-{job}.log"
    assert wait_until(log.exists)
    victim = tmp_path / "remediator.sqlite"
    victim.write_text("the remediator's own file\n")
    log.unlink()
    log.symlink_to(victim)
    run = playbooks.run("refuse_and_report.yml", _refuse_vars(playbooks, node, fleetheal_job_id=job))
    assert run.rc == 0, run.stdout[-4000:]
    assert victim.read_text() == "the remediator's own file\n"
    (told,) = [s for s in run.report["steps"] if s["step"] == "job_comment"]
    assert "log not written" in told["detail"], told
    assert "incident=inc-1" in job_json(slurm, job)["comment"].split()  # the comment still tells the owner


def test_an_alert_whose_job_is_not_on_the_node_is_refused(slurm: SlurmCluster, playbooks: Playbooks) -> None:
    """Found by hand: an alert naming a job that does not run on the alerted node was accepted and its
    playbook ran. The guard now checks the job against Slurm before anything is done."""
    job, node = submit_running(slurm)
    other = next(n for n in ("n1", "n2", "n3") if n != node)
    base = {
        "fleetheal_fault_id": "nccl-timeout",
        "fleetheal_fault_class": "transient",
        "fleetheal_action": "RESTART_IN_PLACE",
    }
    run = playbooks.run("restart_in_place.yml", playbooks.base_vars(fleetheal_node=other, fleetheal_job_id=job, **base))
    assert run.rc != 0
    assert f"Job {job} does not run on {other} (Slurm: RUNNING on {node})" in run.report["error"]
    missing = playbooks.run(
        "restart_in_place.yml", playbooks.base_vars(fleetheal_node=node, fleetheal_job_id="424242", **base)
    )
    assert missing.rc != 0 and "(Slurm: no such job)" in missing.report["error"]
    assert job_json(slurm, job)["restart_cnt"] == 0
