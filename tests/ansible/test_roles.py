"""The roles' no-GPU paths on this machine (which has no GPU), through ansible-runner."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_role(tmp_path: Path, role: str, role_vars: dict[str, object], cmdline: str = "") -> tuple[int, str, dict]:
    import ansible_runner

    play = [
        {
            "name": f"role {role}",
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [{"role": role, "vars": role_vars}],
        }
    ]
    project = tmp_path / "project"
    project.mkdir()
    (project / "play.yml").write_text(json.dumps(play))
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    (tmp_path / "runner").mkdir()
    r = ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"),
        project_dir=str(project),
        playbook="play.yml",
        inventory=str(inventory),
        cmdline=cmdline or None,
        envvars={"ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1"},
        quiet=True,
    )
    return r.rc, r.stdout.read(), r.stats or {}


@pytest.fixture(autouse=True)
def _venv_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def test_dcgm_skips_a_host_without_gpus_with_a_message(tmp_path: Path) -> None:
    assert not Path("/proc/driver/nvidia/gpus").exists(), "this test expects a machine without NVIDIA GPUs"
    rc, out, stats = _run_role(tmp_path, "dcgm", {}, cmdline="--check")
    assert rc == 0, out[-3000:]
    assert "no NVIDIA GPU detected on localhost" in out
    assert "skipping DCGM (set dcgm_force: true to install anyway)" in out
    assert stats.get("changed", {}) == {}
    assert "Install | datacenter-gpu-manager" not in out


def test_dcgm_preflight_names_a_bad_input(tmp_path: Path) -> None:
    rc, out, _ = _run_role(tmp_path, "dcgm", {"dcgm_repo_url": "ftp://mirror/cuda"}, cmdline="--check")
    assert rc != 0
    assert "repository and key must be http(s) or file URLs" in out


def test_node_validation_fails_closed_without_gpus(tmp_path: Path) -> None:
    report = tmp_path / "nv.json"
    rc, out, _ = _run_role(
        tmp_path,
        "node_validation",
        {"node_validation_report_path": str(report), "node_validation_nvidia_smi": "/nonexistent/nvidia-smi"},
    )
    assert rc != 0
    assert "Node validation failed on localhost: gpu_present: no NVIDIA GPU or driver" in out
    result = json.loads(report.read_text())
    assert result["passed"] is False
    assert [c["name"] for c in result["checks"]] == ["gpu_present"]


def test_remediator_refuses_a_short_token(tmp_path: Path) -> None:
    rc, out, _ = _run_role(
        tmp_path, "remediator", {"remediator_token": "short", "remediator_nodes": {"n1": "a"}}, cmdline="--check"
    )
    assert rc != 0
    assert "remediator_token must be at least 16 characters" in out
