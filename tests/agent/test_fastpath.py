"""Fast path: the owned-reason rules of SlurmDrainer and KubeNodeTainter.

The Slurm side runs against a real slurmctld in test_integration.py; here `FakeSlurm` (a test double
of Slurm's clients for one node: `sinfo` with fleetheal.slurm.nodes' arguments and `scontrol update`, as
Slurm 22.05 answers them) checks every branch,
and `FakeKubeApiServer` (the lab's Kubernetes API test double) stands in for the API server.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetheal.agent.fastpath import (
    ALREADY,
    DONE,
    KEPT_FOREIGN,
    WOULD,
    FastPathError,
    JobOwners,
    KubeNodeTainter,
    SlurmDrainer,
)
from fleetheal.contracts import LABEL_FAULT, TAINT_UNHEALTHY, drain_reason
from fleetheal.slurm.nodes import NODES_ARGS


class FakeSlurm:
    """Test double of `sinfo` and `scontrol` for one node: keeps its state and reason, records updates."""

    def __init__(self, state: str = "IDLE", reason: str | None = None, fail: bool = False) -> None:
        self.state, self.reason, self.fail = state, reason, fail
        self.updates: list[list[str]] = []

    def __call__(self, argv, **kwargs):
        assert kwargs["env"] is not None
        if self.fail:
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_node error: Unable to contact slurm controller")
        if argv[0] == "sinfo" and argv[1:] in (list(NODES_ARGS), [*NODES_ARGS, "-n", "n1"]):
            stamp, reason = ("2026-11-29T10:00:00", self.reason) if self.reason else ("Unknown", "none")
            line = "\x1f".join(("n1", self.state.lower(), stamp, reason, "(null)", "(null)", ""))
            return subprocess.CompletedProcess(argv, 0, line + "\n", "")
        if argv[0] == "scontrol" and argv[1] == "update":
            self.updates.append(argv[1:])
            self.state += "+DRAIN"
            self.reason = argv[-1].removeprefix("reason=")
            return subprocess.CompletedProcess(argv, 0, "", "")
        raise AssertionError(argv)


REASON = drain_reason("xid-79", "agent-n1-1", "3", "2026-11-29T10:00:00Z")


def test_drains_an_undrained_node_with_the_owned_reason():
    fake = FakeSlurm()
    result, why = SlurmDrainer("n1", run=fake, slurm_conf="/x/slurm.conf").drain(REASON)
    assert result == DONE
    assert fake.updates == [["update", "nodename=n1", "state=drain", f"reason={REASON}"]]
    assert "drained n1" in why


def test_keeps_someone_elses_drain_and_its_reason():
    fake = FakeSlurm("IDLE+DRAIN", "disk replaced, burn-in pending")
    result, why = SlurmDrainer("n1", run=fake).drain(REASON)
    assert result == KEPT_FOREIGN
    assert fake.updates == []
    assert fake.reason == "disk replaced, burn-in pending"
    assert "their reason is kept" in why


def test_already_drained_by_fleetheal():
    fake = FakeSlurm("MIXED+DRAIN", "fleetheal:xid-48 incident=i")
    assert SlurmDrainer("n1", run=fake).drain(REASON)[0] == ALREADY
    assert fake.updates == []


def test_observe_mode_says_would_drain():
    fake = FakeSlurm()
    result, why = SlurmDrainer("n1", run=fake, dry_run=True).drain(REASON)
    assert result == WOULD
    assert why.startswith("would drain n1")
    assert fake.updates == []


def test_refuses_unowned_reasons_and_reports_scontrol_failures():
    with pytest.raises(ValueError, match="does not own"):
        SlurmDrainer("n1", run=FakeSlurm()).drain("maintenance")
    with pytest.raises(FastPathError, match="Unable to contact slurm controller"):
        SlurmDrainer("n1", run=FakeSlurm(fail=True)).drain(REASON)
    with pytest.raises(FastPathError, match="No such file"):
        SlurmDrainer("n1", scontrol="/nonexistent/scontrol").drain(REASON)


@pytest.fixture
def kube(tmp_path):
    from fleetheal.lab.kube import FakeKubeApiServer

    token = tmp_path / "token"
    token.write_text("node-n1-token\n")
    with FakeKubeApiServer(token="node-n1-token") as api:
        api.add("nodes", {"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}})
        yield api, str(token)


def test_taints_and_labels_its_own_node_once(kube):
    api, token = kube
    t = KubeNodeTainter("n1", api.url, token)
    assert t.taint("xid-79")[0] == DONE
    node = api.get("nodes", "n1")
    assert {"key": TAINT_UNHEALTHY, "value": "xid-79", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert {"key": "other", "effect": "NoSchedule"} in node["spec"]["taints"]  # others' taints kept
    assert node["metadata"]["labels"][LABEL_FAULT] == "xid-79"
    assert t.taint("xid-48")[0] == ALREADY
    assert api.get("nodes", "n1")["metadata"]["labels"][LABEL_FAULT] == "xid-79"


def test_taint_dry_run_and_errors(kube, tmp_path):
    api, token = kube
    assert KubeNodeTainter("n1", api.url, token, dry_run=True).taint("xid-79")[0] == WOULD
    assert "taints" not in str(api.get("nodes", "n1")["metadata"].get("labels", {}))
    bad = tmp_path / "bad"
    bad.write_text("wrong")
    with pytest.raises(FastPathError, match="401"):
        KubeNodeTainter("n1", api.url, str(bad)).taint("xid-79")
    with pytest.raises(FastPathError, match="404"):
        KubeNodeTainter("n9", api.url, token).taint("xid-79")


def _prolog_file(jobs: Path, job: str, uid: int) -> Path:
    jobs.mkdir(mode=0o755, exist_ok=True)
    f = jobs / job
    f.write_text(f"job_id={job}\nrestart_count=0\ngpus=0\nuser=u{uid}\nuid={uid}\n")
    f.chmod(0o644)
    return f


def _no_squeue(argv, **kwargs):  # pragma: no cover - must not be called
    raise AssertionError(f"Slurm asked: {argv}")


def test_a_jobs_owner_comes_from_the_prologs_file_without_a_slurm_client(tmp_path):
    """The agent's pod has no Slurm client: the prolog's job file (root's, in root's directory) names the owner."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: the job files must be root's")
    jobs = tmp_path / "jobs"
    _prolog_file(jobs, "4242", 1000)
    owners = JobOwners("n1", None, jobs_dir=str(jobs), run=_no_squeue)
    assert owners.refuse(1000, "4242") is None
    assert "does not own" in (owners.refuse(1001, "4242") or "")
    assert owners.refuse(1000, "4243") is not None  # no file: not running here


@pytest.mark.parametrize("attack", ["dir-writable", "file-writable", "file-not-root", "symlink"])
def test_a_job_file_anyone_else_could_write_is_not_believed(tmp_path, attack):
    """A local user who could write (or link) the job file would name themselves the owner of anyone's job."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: the job files must be root's")
    jobs = tmp_path / "jobs"
    f = _prolog_file(jobs, "4242", 1000)
    if attack == "dir-writable":
        jobs.chmod(0o777)
    elif attack == "file-writable":
        f.chmod(0o666)
    elif attack == "file-not-root":
        os.chown(f, 1000, 1000)
    else:
        real = _prolog_file(tmp_path / "elsewhere", "4242", 1000)
        f.unlink()
        f.symlink_to(real)
    owners = JobOwners("n1", None, jobs_dir=str(jobs), run=_no_squeue)
    assert owners.refuse(1000, "4242") is not None
