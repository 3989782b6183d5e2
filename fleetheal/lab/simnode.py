"""The simulated node as the lab's validation tools see it (fleetheal.lab.simtools): the tools' constants,
how each injected fault shows (`effect`), the node's GPUs and their faults now (`node_state`), and the
error and argument parsing the tools share. The faults live in the state file of fleetheal.agent.simulated.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetheal.agent.simulated import LOST, MISSING, POWER_LIMIT_W, SHUTDOWN_C, SLOWDOWN_C, read_injections
from fleetheal.taxonomy import Taxonomy, load

SIMULATOR = "fleetheal GPU simulator"
BURNIN_TOOL = "dcgmproftester12"
TOOLS = ("nvidia-smi", "dcgmi", "all_reduce_perf", BURNIN_TOOL)
#: The burn-in command line write_sim_tools returns (the role's default, with the simulated program).
BURNIN_ARGS = ("--no-dcgm-validation", "-t", "1004", "-d", "30")
GPU_NAME = "Simulated H100 80GB HBM3"
PCIE_GEN_MAX = 5
PCIE_WIDTH = 16
HEALTHY_BUSBW_GBPS = 450.0
NVLINK_DEGRADED_BUSBW_GBPS = 40.0
#: The NCCL threshold write_sim_tools returns: well under healthy, well over degraded.
SIM_MIN_BUSBW_GBPS = 100.0
DCGM_VERSION = "3.3.9"
DCGM_FAIL_RC = 226
NVSMI_NO_DEVICES_RC = 6
NVSMI_GPU_LOST_RC = 15
#: The node state of the taxonomy's lifecycle while a GPU reset runs (node_states in policies/faults.yaml).
RESETTING = "resetting"

MEMORY = frozenset(
    {
        "xid-48",
        "xid-63",
        "xid-64",
        "xid-94",
        "xid-95",
        "xid-140",
        "xid-171",
        "xid-172",
        "ecc-dbe-volatile",
        "ecc-dbe-aggregate",
        "ecc-sbe-storm",
        "row-remap-failure",
        "row-remap-pending",
        "retired-pages-pending",
        "cuda-ecc-uncorrectable",
    }
)
#: Memory faults DCGM's level-1 deployment check ("Page Retirement/Row Remap") also catches.
REMAP = frozenset({"xid-64", "row-remap-failure", "row-remap-pending", "retired-pages-pending"})
NVLINK_XIDS = frozenset({74, 155, *range(144, 151)})
PCIE_XIDS = frozenset({167})
THERMAL_DETAIL = {
    "thermal-slowdown": f"clocks throttled by HW thermal slowdown at {SLOWDOWN_C + 2:.1f} C",
    "thermal-shutdown": f"GPU reached its shutdown temperature ({SHUTDOWN_C + 1:.1f} C)",
    "power-brake": "clocks throttled by the HW power brake",
    "power-cap-violation": f"power draw {POWER_LIMIT_W * 1.02:.0f} W above the {POWER_LIMIT_W:.0f} W limit",
}


def effect(fault_id: str, taxonomy: Taxonomy) -> str | None:
    """How the simulated tools show an active injection of `fault_id`: "lost", "missing", "memory",
    "nvlink", "thermal", "pcie", "hardware" (another hardware-class fault: DCGM's PCIe test of its GPU)
    or None (not a hardware fault, or not one in the taxonomy: nothing shows)."""
    if fault_id in LOST:
        return "lost"
    if fault_id in MISSING:
        return "missing"
    fault = taxonomy.faults.get(fault_id)
    if fault is None or fault.fault_class != "hardware":
        return None
    if fault_id in MEMORY:
        return "memory"
    if fault_id.startswith(("nvlink-", "nvswitch-")) or fault.xid in NVLINK_XIDS:
        return "nvlink"
    if fault_id.startswith(("thermal-", "power-")):
        return "thermal"
    if fault_id.startswith("pcie-") or fault.xid in PCIE_XIDS:
        return "pcie"
    return "hardware"


@dataclass
class SimNode:
    """What the tools see on a node now: GPU indices and the active faults that touch each of them."""

    gpus: int
    state_file: Path
    listed: list[int]
    missing: set[int] = field(default_factory=set)
    lost: dict[int, str] = field(default_factory=dict)
    memory: dict[int, list[str]] = field(default_factory=dict)
    pcie: dict[int, list[str]] = field(default_factory=dict)
    thermal: dict[int, list[str]] = field(default_factory=dict)
    nvlink: dict[int, list[str]] = field(default_factory=dict)

    @property
    def diag_gpus(self) -> list[int]:
        """GPUs DCGM and the burn-in report on: the listed ones and the lost ones (which fail)."""
        return sorted(set(self.listed) | set(self.lost))


def node_state(
    state_file: str | os.PathLike[str], gpus: int, now: float | None = None, taxonomy: Taxonomy | None = None
) -> SimNode:
    """The node as the simulated tools see it at `now`. ValueError on a malformed state file."""
    t = time.time() if now is None else now
    active = [i for i in read_injections(state_file) if i.at <= t]
    node = SimNode(gpus, Path(state_file), list(range(gpus)))
    if not active:
        return node
    tx = taxonomy or load()
    per_gpu: dict[str, dict[int, list[str]]] = {
        "memory": node.memory,
        "pcie": node.pcie,
        "hardware": node.pcie,
        "thermal": node.thermal,
        "nvlink": node.nvlink,
    }
    for inj in sorted(active, key=lambda i: i.at):
        kind = effect(inj.fault, tx)
        if kind is None or (kind == "hardware" and inj.gpu is None):
            continue
        if kind == "missing":
            left = [g for g in range(gpus) if g not in node.missing]
            gone = inj.gpu if inj.gpu is not None else (left[-1] if left else None)
            if gone is not None and 0 <= gone < gpus:
                node.missing.add(gone)
            continue
        gpu = 0 if inj.gpu is None else inj.gpu
        if not 0 <= gpu < gpus:
            continue
        if kind == "lost":
            node.lost.setdefault(gpu, inj.fault)
        else:
            per_gpu[kind].setdefault(gpu, []).append(inj.fault)
    node.listed = [g for g in range(gpus) if g not in node.missing and g not in node.lost]
    for gone in node.missing:
        node.lost.pop(gone, None)
    return node


def gpu_uuid(index: int) -> str:
    return f"GPU-5111a7ed-0000-4000-8000-{index:012d}"


def note(tool: str, node: SimNode) -> str:
    return f"{SIMULATOR}: {tool} answered from simulated GPUs ({node.state_file}), not real hardware"


class ToolError(Exception):
    """A tool's own error: message for stderr, exit code."""

    def __init__(self, message: str, rc: int) -> None:
        super().__init__(message)
        self.rc = rc


class _ArgError(Exception):
    pass


class ToolParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line on stderr, exit 2, like the tools' own usage errors
        raise _ArgError(f"{self.prog} ({SIMULATOR}): {message}")


def tool_parser(prog: str) -> ToolParser:
    return ToolParser(prog=prog, add_help=False, allow_abbrev=False)


def parse_tool_args(p: ToolParser, args: Sequence[str]) -> argparse.Namespace:
    try:
        return p.parse_args(list(args))
    except _ArgError as exc:
        raise ToolError(str(exc), 2) from None
