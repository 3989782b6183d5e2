"""The simulated validation tools (fleetheal.lab.simtools, .simnode, .simprograms): outputs judged with the node_validation role's
own parsing rules, fault injections failing the right checks, and the wrapper executables."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fleetheal.agent.simulated import clear, inject, read_injections
from fleetheal.lab import simnode
from fleetheal.lab.simnode import BURNIN_TOOL, SIMULATOR, TOOLS, effect, node_state
from fleetheal.lab.simtools import run_tool, write_sim_tools
from fleetheal.taxonomy import load

REPO = Path(__file__).resolve().parents[2]
SMI_QUERY = ["--query-gpu=index,pci.bus_id,pcie.link.gen.max,pcie.link.width.current", "--format=csv,noheader,nounits"]
NCCL_ARGS = ["-b", "512M", "-e", "4G", "-f", "2"]
BURNIN_ARGS = ["--no-dcgm-validation", "-t", "1004", "-d", "30"]
MIN_BUSBW = simnode.SIM_MIN_BUSBW_GBPS


def _judge(state: Path, gpus: int = 8, expected: int = 8, level: int = 2) -> dict[str, bool]:
    """The role's checks (tasks/preflight.yml and run.yml), with its parsing rules, on the simulated tools."""
    out, _, rc = run_tool("nvidia-smi", SMI_QUERY, state, gpus)
    listed = [line.split(",") for line in out.splitlines() if re.match(r"^\s*[0-9]+\s*,", line)] if rc == 0 else []
    checks = {"gpu_present": bool(listed)}
    if not listed:
        return checks
    checks["gpu_count"] = len(listed) == expected
    checks["pcie_links"] = all(int(g[3].strip()) >= 16 and int(g[2].strip()) >= 4 for g in listed)
    out, _, rc = run_tool("dcgmi", ["diag", "-r", str(level), "-j"], state, gpus)
    statuses = re.findall(r'"status":\s*"([A-Za-z]+)"', json.dumps(json.loads(out))) if re.match(r"\s*\{", out) else []
    checks["dcgm_diag"] = rc == 0 and bool(statuses) and "fail" not in [s.lower() for s in statuses]
    out, _, rc = run_tool("all_reduce_perf", [*NCCL_ARGS, "-g", str(len(listed))], state, gpus)
    busbw = float((re.findall(r"Avg bus bandwidth\s*:\s*([0-9.]+)", out) or ["-1"])[0])
    oob = int((re.findall(r"Out of bounds values\s*:\s*([0-9]+)", out) or ["-1"])[0])
    checks["nccl_busbw"] = rc == 0 and oob == 0 and busbw >= MIN_BUSBW
    _, _, rc = run_tool(BURNIN_TOOL, BURNIN_ARGS, state, gpus, burnin_seconds=0)
    checks["burn_in"] = rc == 0
    return checks


def _failing(state: Path, **kw: int) -> list[str]:
    return sorted(name for name, ok in _judge(state, **kw).items() if not ok)


def test_healthy_node_passes_every_check(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    assert _judge(state) == dict.fromkeys(
        ["gpu_present", "gpu_count", "pcie_links", "dcgm_diag", "nccl_busbw", "burn_in"], True
    )
    out, _, _ = run_tool("all_reduce_perf", [*NCCL_ARGS, "-g", "8"], state, 8)
    assert 400 < float(re.findall(r"Avg bus bandwidth\s*:\s*([0-9.]+)", out)[0]) <= simnode.HEALTHY_BUSBW_GBPS
    out, _, _ = run_tool("nvidia-smi", SMI_QUERY, state, 8)
    assert out.splitlines()[3] == "3, 00000000:1B:00.0, 5, 16"  # the backend's bus ids


@pytest.mark.parametrize(
    ("fault", "gpu", "failing"),
    [
        ("xid-79", 3, ["burn_in", "dcgm_diag", "gpu_count", "nccl_busbw"]),
        ("gpu-lost", None, ["burn_in", "dcgm_diag", "gpu_count", "nccl_busbw"]),
        ("gpu-count-low", None, ["gpu_count"]),
        ("xid-48", 1, ["dcgm_diag"]),
        ("ecc-dbe-volatile", 0, ["dcgm_diag"]),
        ("row-remap-failure", 7, ["dcgm_diag"]),
        ("nvlink-crc-errors", 2, ["nccl_busbw"]),
        ("xid-74", 2, ["nccl_busbw"]),
        ("xid-145-reset-gpu", 2, ["nccl_busbw"]),
        ("thermal-slowdown", 5, ["burn_in"]),
        ("power-brake", None, ["burn_in"]),
        ("pcie-replay-growth", 4, ["dcgm_diag"]),
        ("xid-119", 4, ["dcgm_diag"]),  # another hardware fault on a GPU: DCGM's PCIe test
        ("nic-down", None, []),  # node-wide and not a GPU's: nothing shows here
        ("nan-loss", 0, []),  # not a hardware fault
        ("xid-13", 0, []),
    ],
)
def test_an_injection_fails_its_checks_and_clear_passes_again(
    tmp_path: Path, fault: str, gpu: int | None, failing: list[str]
) -> None:
    state = tmp_path / "sim.json"
    inject(state, fault, gpu=gpu)
    assert _failing(state) == failing
    clear(state)
    assert _failing(state) == []


def test_what_each_tool_says_about_the_faults(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    for fault, gpu in [("xid-79", 3), ("xid-48", 1), ("nvlink-crc-errors", 2), ("thermal-slowdown", 5)]:
        inject(state, fault, gpu=gpu)
    out, err, rc = run_tool("nvidia-smi", SMI_QUERY, state, 8)
    assert rc == 0 and [line.split(",")[0] for line in out.splitlines()[:-1]] == ["0", "1", "2", "4", "5", "6", "7"]
    assert "00000000:1B:00.0: GPU is lost" in err
    out, _, rc = run_tool("dcgmi", ["diag", "-r", "2", "-j"], state, 8)
    doc = json.loads(out)
    assert rc == simnode.DCGM_FAIL_RC
    tests = {t["name"]: t["results"] for c in doc["DCGM GPU Diagnostic"]["test_categories"] for t in c["tests"]}
    assert [r["gpu_id"] for r in tests["GPU Memory"] if r["status"] == "Fail"] == ["1", "3"]
    assert [r["gpu_id"] for r in tests["PCIe"] if r["status"] == "Fail"] == ["3"]  # the lost GPU fails everything
    out, err, rc = run_tool("all_reduce_perf", [*NCCL_ARGS, "-g", "7"], state, 8)
    assert rc != 0 and "Avg bus bandwidth" not in out and "lost: xid-79" in err
    clear(state, "xid-79")
    out, _, rc = run_tool("all_reduce_perf", [*NCCL_ARGS, "-g", "8"], state, 8)
    assert rc == 0 and float(re.findall(r"Avg bus bandwidth\s*:\s*([0-9.]+)", out)[0]) < 45
    assert "NVLink degraded by nvlink-crc-errors" in out
    out, _, rc = run_tool(BURNIN_TOOL, BURNIN_ARGS, state, 8, burnin_seconds=0)
    assert rc == 1 and "GPU 5: clocks throttled by HW thermal slowdown" in out.splitlines()[-1]
    # A burn-in on the healthy GPUs only passes.
    _, _, rc = run_tool(BURNIN_TOOL, [*BURNIN_ARGS, "-i", "0,1,2"], state, 8, burnin_seconds=0)
    assert rc == 0


def test_dcgm_levels_and_text_output(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    inject(state, "xid-48", gpu=1)
    out, _, rc = run_tool("dcgmi", ["diag", "-r", "1", "-j"], state, 8)
    assert rc == 0 and "GPU Memory" not in out  # level 1: deployment checks only; a DBE is not one of them
    inject(state, "row-remap-pending", gpu=2)
    _, _, rc = run_tool("dcgmi", ["diag", "-r", "quick", "-j"], state, 8)
    assert rc == simnode.DCGM_FAIL_RC  # "Page Retirement/Row Remap"
    out, _, rc = run_tool("dcgmi", ["diag", "-r", "3"], state, 8)
    assert rc == simnode.DCGM_FAIL_RC and "| GPU Memory                | Fail - GPU: 1, 2" in out
    assert "Targeted Power" in out and SIMULATOR in out
    _, err, rc = run_tool("dcgmi", ["diag", "-r", "9", "-j"], state, 8)
    assert rc == 2 and "levels 1-4" in err


def test_injections_count_from_their_time(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    inject(state, "xid-48", gpu=0, at=time.time() + 3600)
    assert _failing(state) == []
    assert node_state(state, 8, now=time.time() + 3601).memory == {0: ["xid-48"]}


def test_gpu_count_low_hides_the_named_or_the_last_gpu(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    inject(state, "gpu-count-low")
    inject(state, "gpu-count-low")
    inject(state, "gpu-count-low", gpu=2)
    assert node_state(state, 8).listed == [0, 1, 3, 4, 5]
    assert _failing(state, expected=5) == []  # DCGM and NCCL run on the GPUs left


def test_gpu_reset_repairs_reset_gpu_faults_only(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    inject(state, "xid-74", gpu=2)
    inject(state, "row-remap-pending", gpu=2)
    inject(state, "xid-48", gpu=2)
    inject(state, "xid-74", gpu=3)
    inject(state, "xid-74", gpu=2, at=time.time() + 3600)  # not happened yet: stays
    out, _, rc = run_tool("nvidia-smi", ["--gpu-reset", "-i", "2"], state, 8)
    assert rc == 0 and out.startswith("GPU 00000000:1A:00.0 was successfully reset.\n")
    assert "cleared xid-74 (gpu 2), row-remap-pending (gpu 2)" in out
    assert sorted((i.fault, i.gpu) for i in read_injections(state)) == [("xid-48", 2), ("xid-74", 2), ("xid-74", 3)]
    out, _, rc = run_tool("nvidia-smi", ["--gpu-reset"], state, 8)
    assert rc == 0 and "All done." in out
    assert sorted((i.fault, i.gpu) for i in read_injections(state)) == [("xid-48", 2), ("xid-74", 2)]
    inject(state, "xid-79", gpu=5)
    _, err, rc = run_tool("nvidia-smi", ["--gpu-reset", "-i", "5"], state, 8)
    assert rc == simnode.NVSMI_GPU_LOST_RC and "GPU is lost" in err
    _, _, rc = run_tool("nvidia-smi", ["--gpu-reset"], state, 8)
    assert rc == simnode.NVSMI_GPU_LOST_RC
    out, _, rc = run_tool("nvidia-smi", ["--gpu-reset", "-i", "8"], state, 8)
    assert rc == simnode.NVSMI_NO_DEVICES_RC and "No devices were found" in out


def test_malformed_state_file_exits_2_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    state.write_text('{"version": 1, "injections": [{"fault": "xid-79"}]}')
    calls = {
        "nvidia-smi": SMI_QUERY,
        "dcgmi": ["diag", "-r", "2", "-j"],
        "all_reduce_perf": [*NCCL_ARGS, "-g", "8"],
        BURNIN_TOOL: BURNIN_ARGS,
    }
    for tool, args in calls.items():
        out, err, rc = run_tool(tool, args, state, 8, burnin_seconds=0)
        assert (out, rc) == ("", 2), tool
        assert err.count("\n") == 1 and "malformed simulated-GPU state file" in err and SIMULATOR in err


def test_every_output_names_the_simulator(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    outputs = [
        run_tool("nvidia-smi", SMI_QUERY, state, 8)[0],
        run_tool("nvidia-smi", ["-L"], state, 8)[0],
        run_tool("nvidia-smi", ["--gpu-reset", "-i", "0"], state, 8)[0],
        json.loads(run_tool("dcgmi", ["diag", "-r", "2", "-j"], state, 8)[0])["fleetheal_simulator"],
        run_tool("all_reduce_perf", [*NCCL_ARGS, "-g", "8"], state, 8)[0],
        run_tool(BURNIN_TOOL, BURNIN_ARGS, state, 8, burnin_seconds=0)[0],
        run_tool("nvidia-smi", ["--bogus"], state, 8)[1],
    ]
    for text in outputs:
        assert SIMULATOR in text, text


def test_every_taxonomy_fault_has_an_effect_or_none() -> None:
    tx = load()
    kinds = {fid: effect(fid, tx) for fid in tx.faults}
    assert set(kinds.values()) <= {"lost", "missing", "memory", "nvlink", "thermal", "pcie", "hardware", None}
    assert {fid for fid, k in kinds.items() if k == "lost"} == {"xid-79", "gpu-lost"}
    assert kinds["xid-140"] == "memory" and kinds["xid-141"] is None and kinds["xid-143"] == "hardware"
    assert kinds["xid-150-reset-gpu"] == "nvlink" and kinds["nvswitch-sxid-fatal"] == "nvlink"
    assert all(tx.get(fid).fault_class == "hardware" for fid, k in kinds.items() if k is not None)


def test_write_sim_tools_writes_executables_and_role_vars(tmp_path: Path) -> None:
    bin_dir = tmp_path / "it's a bin"  # quoting
    state = tmp_path / "state $HOME.json"
    role_vars = write_sim_tools(bin_dir, state, 4, burnin_seconds=0.05)
    defaults = yaml.safe_load((REPO / "roles" / "node_validation" / "defaults" / "main.yml").read_text())
    assert set(role_vars) <= set(defaults)
    assert role_vars["node_validation_expected_gpus"] == 4
    assert role_vars["node_validation_nccl_min_busbw_gbps"] == MIN_BUSBW
    argv = role_vars["node_validation_burnin_argv"]
    assert argv[0] == str(bin_dir.resolve() / BURNIN_TOOL) and argv[1:] == BURNIN_ARGS
    for tool in TOOLS:
        assert stat.S_IMODE((bin_dir / tool).stat().st_mode) == 0o755
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([role_vars["node_validation_nvidia_smi"], *SMI_QUERY], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and len([x for x in run.stdout.splitlines() if not x.startswith("#")]) == 4
    inject(state, "xid-48", gpu=3)
    assert state.exists() and not (tmp_path / "state").exists()
    run = subprocess.run([role_vars["node_validation_dcgmi"], "diag", "-r", "2", "-j"], capture_output=True, text=True)
    assert run.returncode == simnode.DCGM_FAIL_RC
    run = subprocess.run([role_vars["node_validation_nccl_binary"], *NCCL_ARGS, "-g", "4"], capture_output=True)
    assert run.returncode == 0
    run = subprocess.run(argv, capture_output=True, text=True)
    assert run.returncode == 0 and "simulated in 0.05 s" in run.stdout
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        write_sim_tools(bin_dir, state, 0)


def test_cli(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "fleetheal.lab.simtools", "--state", str(state), "--gpus", "2"]
    run = subprocess.run([*cmd, "nvidia-smi", *SMI_QUERY], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("0, 00000000:18:00.0, 5, 16\n1, ")
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 2 and "name a tool" in run.stderr
    state.write_text("{")
    run = subprocess.run([*cmd, "dcgmi", "diag", "-r", "1", "-j"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and len(run.stderr.splitlines()) == 1
