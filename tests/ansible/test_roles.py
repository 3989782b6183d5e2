"""The roles' no-GPU paths on this machine (which has no GPU), through ansible-runner."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_role(tmp_path: Path, role: str, role_vars: dict[str, object], cmdline: str = "") -> tuple[int, str, dict]:
    play = [
        {
            "name": f"role {role}",
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [{"role": role, "vars": role_vars}],
        }
    ]
    return _run_play(tmp_path, play, cmdline)


def _run_play(tmp_path: Path, play: list[dict[str, object]], cmdline: str = "") -> tuple[int, str, dict]:
    import ansible_runner

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


NODE_VALIDATION_CHECKS = ["gpu_present", "gpu_count", "pcie_links", "dcgm_diag", "nccl_busbw", "burn_in"]


def _sim_vars(tmp_path: Path, **extra: object) -> tuple[dict[str, object], Path, Path]:
    """node_validation variables for a simulated 8-GPU node (fleetheal.lab.simtools)."""
    from fleetheal.lab.simtools import write_sim_tools

    state, report = tmp_path / "sim-gpus.json", tmp_path / "nv.json"
    role_vars = write_sim_tools(tmp_path / "sim-bin", state, 8, burnin_seconds=0.2)
    role_vars.update(node_validation_report_path=str(report), **extra)
    return role_vars, state, report


def test_node_validation_passes_a_healthy_simulated_node(tmp_path: Path) -> None:
    role_vars, _, report = _sim_vars(tmp_path)
    rc, out, _ = _run_role(tmp_path, "node_validation", role_vars)
    assert rc == 0, out[-3000:]
    result = json.loads(report.read_text())
    assert result["passed"] is True
    assert [(c["name"], c["passed"]) for c in result["checks"]] == [(n, True) for n in NODE_VALIDATION_CHECKS]
    burn_in = result["checks"][-1]["detail"]
    assert burn_in.startswith("exit 0 after ") and "fleetheal GPU simulator" in burn_in, burn_in


def test_node_validation_fails_a_simulated_node_with_a_double_bit_ecc_error(tmp_path: Path) -> None:
    from fleetheal.agent.simulated import inject

    role_vars, state, report = _sim_vars(tmp_path)
    inject(state, "xid-48", gpu=1)
    rc, out, _ = _run_role(tmp_path, "node_validation", role_vars)
    assert rc != 0
    assert "Node validation failed on localhost: dcgm_diag: level 2: exit 226" in out
    result = json.loads(report.read_text())
    assert result["passed"] is False
    assert [c["name"] for c in result["checks"] if not c["passed"]] == ["dcgm_diag"]


def test_node_validation_counts_a_hung_burn_in_as_a_failure(tmp_path: Path) -> None:
    """A thermal fault fails the burn-in; a burn-in past its timeout is killed and fails too, and the role
    still reports (a task timeout must not end the play)."""
    from fleetheal.agent.simulated import inject
    from fleetheal.lab.simtools import write_sim_tools

    role_vars, state, report = _sim_vars(tmp_path, node_validation_fail_on_error=False)
    inject(state, "thermal-slowdown", gpu=5)
    rc, out, _ = _run_role(tmp_path, "node_validation", role_vars)
    assert rc == 0, out[-3000:]
    (burn_in,) = [c for c in json.loads(report.read_text())["checks"] if not c["passed"]]
    assert burn_in["name"] == "burn_in" and "GPU 5: clocks throttled by HW thermal slowdown" in burn_in["detail"]

    slow = write_sim_tools(tmp_path / "slow-bin", state, 8, burnin_seconds=3)  # Ansible leaves it running
    role_vars.update(
        node_validation_burnin_argv=slow["node_validation_burnin_argv"], node_validation_burnin_timeout_s=1
    )
    (tmp_path / "project").rename(tmp_path / "project-1")
    (tmp_path / "runner").rename(tmp_path / "runner-1")
    rc, out, _ = _run_role(tmp_path, "node_validation", role_vars)
    assert rc == 0, out[-3000:]
    (burn_in,) = [c for c in json.loads(report.read_text())["checks"] if not c["passed"]]
    assert burn_in["detail"].startswith("exit ? after 1 s (dcgmproftester12): ") and "Timed out" in burn_in["detail"]


def test_node_validation_in_check_mode_measures_nothing_and_does_not_pass(tmp_path: Path) -> None:
    role_vars, _, report = _sim_vars(tmp_path, node_validation_fail_on_error=False)
    rc, out, _ = _run_role(tmp_path, "node_validation", role_vars, cmdline="--check")
    assert rc == 0, out[-3000:]
    assert "node validation FAIL on localhost" in out
    for name in ("dcgm_diag", "nccl_busbw", "burn_in"):
        assert f'"{name}: not run in check mode"' in out
    assert "Run | burn-in load] ***" in out and not report.exists()


AGENT_ROLE = REPO / "roles" / "gpu_health_agent"


def _render_agent(tmp_path: Path, role_vars: dict[str, object]) -> tuple[list[str], str]:
    """Role gpu_health_agent's unit (its directives, comments left out) and agent.yaml as Ansible renders them
    from the role's defaults and `role_vars`, without installing anything."""
    out = tmp_path / "rendered"
    out.mkdir(parents=True)
    render = [
        {
            "name": f"Render {name}",
            "ansible.builtin.template": {"src": str(AGENT_ROLE / "templates" / f"{name}.j2"), "dest": str(out / name)},
        }
        for name in ("fleetheal-agent.service", "agent.yaml")
    ]
    play = [
        {
            "name": "render gpu_health_agent's templates",
            "hosts": "localhost",
            "gather_facts": False,
            "vars_files": [str(AGENT_ROLE / "defaults" / "main.yml")],
            "tasks": [{"name": "Render", "vars": role_vars, "block": render}],  # block vars outrank vars_files
        }
    ]
    rc, stdout, _ = _run_play(tmp_path, play)
    assert rc == 0, stdout[-3000:]
    unit = (out / "fleetheal-agent.service").read_text().splitlines()
    return [line for line in unit if line and not line.startswith("#")], str(out / "agent.yaml")


#: The credentials the unit hides when it may read every user's files (docs/agent.md).
HIDDEN = [
    "/etc/munge", "/etc/slurm/slurm.key", "/etc/slurm/jwt_hs256.key", "/etc/slurm/slurmdbd.conf", "/etc/shadow",
    "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/root", "/etc/krb5.keytab", "/etc/kubernetes",
    "/var/lib/kubelet/pki",
]  # fmt: skip


def test_gpu_health_agent_follows_no_job_files_by_default(tmp_path: Path) -> None:
    from fleetheal.agent.config import load_config

    unit, config = _render_agent(tmp_path, {})
    assert "AmbientCapabilities=CAP_SYSLOG" in unit and "CapabilityBoundingSet=CAP_SYSLOG" in unit
    assert "ProtectHome=yes" in unit
    assert not [d for d in unit if "DAC_READ_SEARCH" in d or d.startswith(("InaccessiblePaths=", "SystemCallFilter="))]
    assert load_config(config).job_files.enabled is False


def test_gpu_health_agent_follows_job_files_on_request_and_hides_the_credentials(tmp_path: Path) -> None:
    from fleetheal.agent.config import load_config

    default, _ = _render_agent(tmp_path / "default", {})
    unit, config = _render_agent(tmp_path, {"gpu_health_agent_follow_job_files": True})
    assert sorted(set(default) - set(unit)) == [
        "AmbientCapabilities=CAP_SYSLOG", "CapabilityBoundingSet=CAP_SYSLOG", "ProtectHome=yes",
    ]  # fmt: skip
    assert sorted(set(unit) - set(default)) == sorted(
        [
            "AmbientCapabilities=CAP_SYSLOG CAP_DAC_READ_SEARCH",
            "CapabilityBoundingSet=CAP_SYSLOG CAP_DAC_READ_SEARCH",
            "ProtectHome=read-only",
            # open_by_handle_at(2) would open a hidden file by its handle, past the mounts
            "SystemCallFilter=~open_by_handle_at",
        ]
        + [f"InaccessiblePaths=-{path}" for path in HIDDEN]  # "-": a path the node lacks does not fail the unit
    )
    assert unit.index("[Service]") < unit.index("ProtectHome=read-only") < unit.index("[Install]")
    assert load_config(config).job_files.enabled is True


@pytest.mark.parametrize("follow", [False, True])
def test_gpu_health_agent_refuses_job_files_set_against_its_variable(tmp_path: Path, follow: bool) -> None:
    role_vars = {
        "gpu_health_agent_follow_job_files": follow,
        "gpu_health_agent_config": {"job_files": {"enabled": not follow, "interval_s": 2}},
    }
    rc, out, _ = _run_role(tmp_path, "gpu_health_agent", role_vars, cmdline="--check")
    assert rc != 0
    assert "set gpu_health_agent_follow_job_files, not job_files.enabled in gpu_health_agent_config" in out


@pytest.mark.parametrize("config", [{}, {"job_files": {"interval_s": 2}}])
def test_gpu_health_agent_passes_its_job_files_check_when_the_config_leaves_it_to_the_variable(
    tmp_path: Path, config: dict[str, object]
) -> None:
    """Most inventories set no `job_files` at all: the check, and its message, must not need one."""
    _rc, out, _ = _run_role(tmp_path, "gpu_health_agent", {"gpu_health_agent_config": config}, cmdline="--check")
    assert "Preflight | the source exists on the controller" in out, out[-3000:]
    assert "job_files.enabled in gpu_health_agent_config" not in out and "Finalization" not in out, out[-3000:]
