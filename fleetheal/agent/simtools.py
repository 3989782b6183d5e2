"""Simulated validation tools: nvidia-smi, dcgmi, all_reduce_perf and dcgmproftester12 for simulated GPUs.

The lab's nodes have no GPUs: their faults live in the state file of `fleetheal.agent.simulated`. The
node_validation role, though, runs programs. This module answers the command lines the role (and the
reset playbook) use, from a node's state file and in the real tools' output formats (those of the test
fixtures in tests/ansible/fixtures/bin), so the revalidation of a simulated node passes or fails with
the faults injected into it. Every output says it comes from the fleetheal GPU simulator: a comment line
(nvidia-smi, all_reduce_perf, dcgmproftester12) or a JSON field `fleetheal_simulator` (dcgmi)::

    python -m fleetheal.agent.simtools --state FILE [--gpus N] [--burnin-seconds S] TOOL [ARGS...]

    nvidia-smi --query-gpu=index,pci.bus_id,pcie.link.gen.max,pcie.link.width.current --format=csv,noheader,nounits
    nvidia-smi --gpu-reset [-i N]
    nvidia-smi -L
    dcgmi diag -r LEVEL [-j]
    all_reduce_perf [-b SIZE] [-e SIZE] [-f FACTOR] [-g GPUS] [other nccl-tests options, ignored]
    dcgmproftester12 [--no-dcgm-validation] [-t FIELDS] [-i GPUS] [-d SECONDS]

`write_sim_tools(bin_dir, state_file, gpus)` writes one executable per tool into `bin_dir` and returns
the node_validation role variables that point at them.

How an injection shows, from when its `at` has passed until it is cleared (`effect()` sorts fault ids;
a node-wide injection, gpu null, counts as GPU 0, except gpu-count-low, which hides the last GPU):

- lost (xid-79, gpu-lost): the GPU is missing from nvidia-smi's list (a warning on stderr, exit 0), every
  DCGM test of it fails, all_reduce_perf fails (exit 1, no bandwidth line), the burn-in fails.
- missing (gpu-count-low): one GPU fewer everywhere (DCGM and NCCL run on the ones left).
- memory (xid-48/63/64/94/95/140/171/172, ecc-*, row-remap-*, retired-pages-pending,
  cuda-ecc-uncorrectable): DCGM "GPU Memory" fails for the GPU (level 2 and up; the remap and
  retirement faults also fail the level-1 "Page Retirement/Row Remap" check); dcgmi exits 226.
- nvlink (nvlink-*, nvswitch-*, xid-74, xid-144..150 and their decoded ids, xid-155): all_reduce_perf
  reports 40 GB/s instead of 450 GB/s.
- thermal (thermal-*, power-*): the burn-in fails (exit 1).
- pcie (pcie-*, xid-167) and any other hardware-class fault on a GPU: DCGM "PCIe" fails for that GPU
  (level 2 and up). Another hardware fault that is node-wide (nic-down, disk-full, host-memory-ue) and
  every non-hardware fault (transient, user, unknown) changes nothing here.

`nvidia-smi --gpu-reset` repairs what a reset repairs and nothing else: it removes the active injections
whose taxonomy action is RESET_GPU (xid-74, row-remap-pending, retired-pages-pending, xid-119...) on the
reset GPU (node-wide ones count as GPU 0), or on every GPU without `-i`. A lost GPU cannot be reset
(exit 15, as nvidia-smi does); an index it does not list gives "No devices were found" (exit 6). A
malformed state file makes every tool exit 2 with a one-line error on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetheal.agent.simulated import (
    LOST,
    MISSING,
    POWER_LIMIT_W,
    SHUTDOWN_C,
    SLOWDOWN_C,
    Injection,
    pci_bus_id,
    read_injections,
    remove,
)
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


def _uuid(index: int) -> str:
    return f"GPU-5111a7ed-0000-4000-8000-{index:012d}"


def _note(tool: str, node: SimNode) -> str:
    return f"{SIMULATOR}: {tool} answered from simulated GPUs ({node.state_file}), not real hardware"


class ToolError(Exception):
    """A tool's own error: message for stderr, exit code."""

    def __init__(self, message: str, rc: int) -> None:
        super().__init__(message)
        self.rc = rc


# ---------------------------------------------------------------------------------------------- nvidia-smi

NVSMI_FIELDS: dict[str, Callable[[int], str]] = {
    "index": str,
    "count": lambda _: "",  # filled in by the caller
    "name": lambda _: GPU_NAME,
    "uuid": _uuid,
    "pci.bus_id": pci_bus_id,
    "pcie.link.gen.max": lambda _: str(PCIE_GEN_MAX),
    "pcie.link.gen.current": lambda _: str(PCIE_GEN_MAX),
    "pcie.link.width.max": lambda _: str(PCIE_WIDTH),
    "pcie.link.width.current": lambda _: str(PCIE_WIDTH),
}


def _nvsmi_opts(args: Sequence[str]) -> dict[str, str]:
    """nvidia-smi's options as {canonical name: value} (`--name=value`, `--name value`, `-i N`, flags)."""
    valued = {"--query-gpu": "--query-gpu", "--format": "--format", "-i": "--id", "--id": "--id"}
    flags = {"--gpu-reset": "--gpu-reset", "-r": "--gpu-reset", "-L": "-L", "--list-gpus": "-L"}
    opts: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in valued:
            opts[valued[name]] = value if eq else next(it, "")
        elif arg in flags:
            opts[flags[arg]] = ""
        else:
            raise ToolError(f"nvidia-smi ({SIMULATOR}): unsupported arguments: {' '.join(args)}", 2)
    return opts


def _nvsmi_index(opts: dict[str, str]) -> int | None:
    if "--id" not in opts:
        return None
    try:
        return int(opts["--id"])
    except ValueError:
        raise ToolError(f"Invalid GPU index '{opts['--id']}' ({SIMULATOR})", 2) from None


def nvidia_smi(args: Sequence[str], node: SimNode) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of `nvidia-smi ARGS` on the simulated node."""
    opts = _nvsmi_opts(args)
    index = _nvsmi_index(opts)
    warnings = "".join(
        f"Unable to determine the device handle for GPU {pci_bus_id(g)}: GPU is lost.  "
        f"Reboot the system to recover this GPU ({SIMULATOR}: {fault})\n"
        for g, fault in sorted(node.lost.items())
    )
    if "--gpu-reset" in opts:
        return _nvsmi_reset(index, node)
    if "-L" in opts:
        shown = [g for g in node.listed if index is None or g == index]
        if not shown:
            return f"No devices were found\n# {_note('nvidia-smi', node)}\n", warnings, NVSMI_NO_DEVICES_RC
        out = "".join(f"GPU {g}: {GPU_NAME} (UUID: {_uuid(g)})\n" for g in shown)
        return out + f"# {_note('nvidia-smi', node)}\n", warnings, 0
    if "--query-gpu" not in opts:
        raise ToolError(f"nvidia-smi ({SIMULATOR}): unsupported arguments: {' '.join(args)}", 2)
    fields = [f.strip() for f in opts["--query-gpu"].split(",") if f.strip()]
    for f in fields:
        if f not in NVSMI_FIELDS:
            raise ToolError(f'Field "{f}" is not a valid field to query. ({SIMULATOR})', 2)
    fmt = {f.strip() for f in opts.get("--format", "").split(",")}
    if "csv" not in fmt:
        raise ToolError(f'"--format=csv[,noheader][,nounits]" is required with --query-gpu ({SIMULATOR})', 2)
    shown = [g for g in node.listed if index is None or g == index]
    if not shown:
        return f"No devices were found\n# {_note('nvidia-smi', node)}\n", warnings, NVSMI_NO_DEVICES_RC
    lines = [] if "noheader" in fmt else [", ".join(fields)]
    for g in shown:
        lines.append(", ".join(str(len(node.listed)) if f == "count" else NVSMI_FIELDS[f](g) for f in fields))
    lines.append(f"# {_note('nvidia-smi', node)}")
    return "\n".join(lines) + "\n", warnings, 0


def _nvsmi_reset(index: int | None, node: SimNode) -> tuple[str, str, int]:
    targets = node.diag_gpus if index is None else [index]
    if index is not None and index not in node.listed and index not in node.lost:
        return f"No devices were found\n# {_note('nvidia-smi', node)}\n", "", NVSMI_NO_DEVICES_RC
    for g in targets:
        if g in node.lost:
            err = (
                f"Unable to reset GPU {pci_bus_id(g)}: GPU is lost. Reboot the system to recover this GPU "
                f"({SIMULATOR}: {node.lost[g]} stays until cleared)\n"
            )
            return "", err, NVSMI_GPU_LOST_RC
    tx = load()
    now = time.time()
    # A reset repairs the faults whose action resets the GPU: the one that holds the node `resetting`.
    resets = {a.name for a in tx.actions.values() if a.lifecycle.acting == RESETTING}

    def repaired(inj: Injection) -> bool:
        on = 0 if inj.gpu is None else inj.gpu
        return inj.at <= now and tx.get(inj.fault).action in resets and (index is None or on == index)

    gone = [i for i in read_injections(node.state_file) if repaired(i)]
    remove(node.state_file, [i.id for i in gone])
    out = "".join(f"GPU {pci_bus_id(g)} was successfully reset.\n" for g in targets)
    if index is None:
        out += "All done.\n"
    cleared = ", ".join(f"{i.fault} (gpu {'node' if i.gpu is None else i.gpu})" for i in gone) or "nothing"
    out += f"# {_note('nvidia-smi', node)}; the reset cleared {cleared} (RESET_GPU faults only)\n"
    return out, "", 0


# ---------------------------------------------------------------------------------------------- dcgmi

LEVELS = {"1": 1, "2": 2, "3": 3, "4": 4, "quick": 1, "short": 1, "medium": 2, "long": 3, "xlong": 4}
DEPLOYMENT_TESTS = (
    "Denylist",
    "NVML Library",
    "CUDA Main Library",
    "Permissions and OS Blocks",
    "Persistence Mode",
    "Environment Variables",
)


def _dcgm_results(gpus: list[int], failing: Callable[[int], str | None]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for g in gpus:
        why = failing(g)
        if why is None:
            out.append({"gpu_id": str(g), "status": "Pass"})
        else:
            out.append({"gpu_id": str(g), "status": "Fail", "warnings": [{"warning": f"{why} ({SIMULATOR})"}]})
    return out


def dcgm_diag(level: int, node: SimNode, only: set[int] | None = None) -> dict[str, Any]:
    """The JSON document `dcgmi diag -r LEVEL -j` prints (DCGM 3.x layout, trimmed like the fixture)."""
    gpus = [g for g in node.diag_gpus if only is None or g in only]

    def lost(g: int) -> str | None:
        return f"GPU {g} ({pci_bus_id(g)}) is lost: {node.lost[g]}" if g in node.lost else None

    def remap(g: int) -> str | None:
        faults = [f for f in node.memory.get(g, []) if f in REMAP]
        return lost(g) or (f"GPU {g}: pending page retirement or row remap ({', '.join(faults)})" if faults else None)

    def memory(g: int) -> str | None:
        faults = node.memory.get(g, [])
        return lost(g) or (f"GPU {g}: memory errors under test ({', '.join(faults)})" if faults else None)

    def pcie(g: int) -> str | None:
        faults = node.pcie.get(g, [])
        return lost(g) or (f"GPU {g}: PCIe errors under test ({', '.join(faults)})" if faults else None)

    deployment: list[dict[str, Any]] = [{"name": t, "results": [{"status": "Pass"}]} for t in DEPLOYMENT_TESTS]
    deployment.append({"name": "Page Retirement/Row Remap", "results": _dcgm_results(gpus, remap)})
    categories: list[dict[str, Any]] = [{"category": "Deployment", "tests": deployment}]
    if level >= 2:
        categories.append(
            {"category": "Integration", "tests": [{"name": "PCIe", "results": _dcgm_results(gpus, pcie)}]}
        )
        categories.append(
            {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": _dcgm_results(gpus, memory)}]}
        )
    if level >= 3:
        stress = [
            {"name": t, "results": _dcgm_results(gpus, lost)}
            for t in ("Targeted Stress", "Targeted Power", "Memory Bandwidth")
        ]
        categories.append({"category": "Stress", "tests": stress})
    return {
        "DCGM GPU Diagnostic": {"test_categories": categories},
        "version": DCGM_VERSION,
        "fleetheal_simulator": _note("dcgmi diag", node),
    }


def _dcgm_failed(doc: dict[str, Any]) -> bool:
    return any(
        r.get("status") == "Fail"
        for c in doc["DCGM GPU Diagnostic"]["test_categories"]
        for t in c["tests"]
        for r in t["results"]
    )


def _dcgm_text(doc: dict[str, Any]) -> str:
    """dcgmi's table layout (without -j), one row per test."""
    rule = "+" + "-" * 27 + "+" + "-" * 48 + "+"
    lines = ["Successfully ran diagnostic for group.", rule, f"| {'Diagnostic':<25} | {'Result':<46} |"]
    lines.append(rule.replace("-", "="))
    lines.append(f"| {'DCGM Version':<25} | {doc['version'] + ' (' + SIMULATOR + ')':<46} |")
    for cat in doc["DCGM GPU Diagnostic"]["test_categories"]:
        lines.append(f"|-----  {cat['category'] + '  ':-<20}+{'-' * 48}|")
        for test in cat["tests"]:
            fails = [r for r in test["results"] if r["status"] == "Fail"]
            verdict = "Fail - GPU: " + ", ".join(r["gpu_id"] for r in fails) if fails else "Pass"
            lines.append(f"| {test['name']:<25} | {verdict:<46} |")
            lines.extend(f"| {'Warning':>25} | {w['warning']}" for r in fails for w in r.get("warnings", []))
    lines.append(rule)
    lines.append(f"# {doc['fleetheal_simulator']}")
    return "\n".join(lines) + "\n"


def dcgmi(args: Sequence[str], node: SimNode) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of `dcgmi diag -r LEVEL [-j] [-i GPUS]` on the simulated node."""
    if not args or args[0] != "diag":
        raise ToolError(f"dcgmi ({SIMULATOR}): only 'diag' is simulated, got: {' '.join(args)}", 2)
    p = _parser("dcgmi diag")
    p.add_argument("-r", "--run", required=True)
    p.add_argument("-j", "--json", action="store_true")
    p.add_argument("-i", "--entity-id", default=None)
    p.add_argument("--timeout", default=None)
    p.add_argument("--iterations", default=None)
    opts = _parse(p, args[1:])
    level = LEVELS.get(str(opts.run).strip().lower())
    if level is None:
        raise ToolError(f"dcgmi diag ({SIMULATOR}): -r {opts.run}: only levels 1-4 (quick..xlong) are simulated", 2)
    only = None
    if opts.entity_id is not None:
        try:
            only = {int(x.strip().removeprefix("gpu:")) for x in str(opts.entity_id).split(",") if x.strip()}
        except ValueError:
            raise ToolError(f"dcgmi diag ({SIMULATOR}): bad entity list {opts.entity_id!r}", 2) from None
    doc = dcgm_diag(level, node, only)
    out = json.dumps(doc, indent=2) + "\n" if opts.json else _dcgm_text(doc)
    return out, "", DCGM_FAIL_RC if _dcgm_failed(doc) else 0


# ---------------------------------------------------------------------------------------------- all_reduce_perf

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    t = text.strip().upper()
    unit = t[-1] if t and t[-1] in "KMG" else ""
    return int(float(t[: len(t) - len(unit)]) * _SIZE_UNITS[unit])


def _nccl_opts(args: Sequence[str]) -> dict[str, str]:
    """nccl-tests options: every one takes a value (`-b 512M`, `--minbytes 512M`, `--minbytes=512M`)."""
    long_names = {"--minbytes": "-b", "--maxbytes": "-e", "--stepfactor": "-f", "--ngpus": "-g", "--iters": "-n"}
    opts: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if not arg.startswith("-"):
            raise ToolError(f"all_reduce_perf ({SIMULATOR}): unexpected argument {arg!r}", 2)
        name, eq, value = arg.partition("=")
        if not eq:
            value = next(it, None)  # type: ignore[assignment]
            if value is None:
                raise ToolError(f"all_reduce_perf ({SIMULATOR}): option {name} needs a value", 2)
        opts[long_names.get(name, name)] = value
    return opts


def all_reduce_perf(args: Sequence[str], node: SimNode) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of nccl-tests' `all_reduce_perf ARGS` on the simulated node."""
    opts = _nccl_opts(args)
    try:
        lo, hi = _size(opts.get("-b", "32M")), _size(opts.get("-e", "32M"))
        factor, ngpus, iters = float(opts.get("-f", "2")), int(opts.get("-g", "1")), int(opts.get("-n", "20"))
    except ValueError as exc:
        raise ToolError(f"all_reduce_perf ({SIMULATOR}): bad option value: {exc}", 2) from None
    host = socket.gethostname()
    out = [
        f"# {_note('all_reduce_perf', node)}",
        f"# nThread 1 nGpus {ngpus} minBytes {lo} maxBytes {hi} step: {factor:g}(factor) warmup iters: 5 "
        f"iters: {iters} agg iters: 1 validation: 1 graph: 0",
        "#",
        "# Using devices",
    ]
    if ngpus < 1 or ngpus > len(node.listed):
        out.append(f"{host}: Test CUDA failure common.cu:891 'invalid device ordinal'")
        return "\n".join(out) + "\n", f"{SIMULATOR}: -g {ngpus} but {len(node.listed)} GPU(s) listed\n", 1
    devices = node.listed[:ngpus]
    pid = os.getpid()
    out += [
        f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host:>10} device {r:2d} [0x{0x18 + g:02x}] {GPU_NAME}"
        for r, g in enumerate(devices)
    ]
    if node.lost:
        lost = ", ".join(f"GPU {g} ({pci_bus_id(g)}) lost: {f}" for g, f in sorted(node.lost.items()))
        out.append(
            f"{host}: Test NCCL failure common.cu:1005 'unhandled cuda error (run with NCCL_DEBUG=INFO for details)'"
        )
        out.append(f" .. {host} pid {pid}: Test failure common.cu:891")
        return "\n".join(out) + "\n", f"{SIMULATOR}: {lost}\n", 1
    slow = sorted({f for g, faults in node.nvlink.items() if g in devices for f in faults})
    peak = NVLINK_DEGRADED_BUSBW_GBPS if slow else HEALTHY_BUSBW_GBPS
    ratio = 2 * (ngpus - 1) / ngpus  # busbw = algbw * 2(n-1)/n for all-reduce: 0 on one GPU, as nccl-tests says
    out += [
        "#",
        "#                                                              out-of-place                       in-place",
        "#       size         count      type   redop    root"
        "     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)",
    ]
    busbws: list[float] = []
    size = max(lo, 4)
    while len(busbws) < 64:
        algbw = peak * size / (size + (32 << 20)) / (ratio or 1.0)
        busbw = algbw * ratio
        us = size / (algbw * 1e3)
        row = f"{us:8.1f} {algbw:7.2f} {busbw:7.2f} {0:6d}"
        out.append(f"{size:12d}  {size // 4:12d}     float     sum      -1 {row} {row}")
        busbws.append(busbw)
        nxt = int(size * factor)
        if nxt <= size or nxt > hi:
            break
        size = nxt
    out += [
        "# Out of bounds values : 0 OK",
        f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.2f} ",
        "#",
    ]
    if slow:
        out.append(f"# {SIMULATOR}: NVLink degraded by {', '.join(slow)}")
    return "\n".join(out) + "\n", "", 0


# ---------------------------------------------------------------------------------------------- burn-in


def burn_in(args: Sequence[str], node_at: Callable[[], SimNode], seconds: float) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of `dcgmproftester12 ARGS`: waits min(-d, `seconds`), then judges the
    GPUs as the state file says at the end of the load (a fault injected meanwhile counts)."""
    p = _parser(BURNIN_TOOL)
    p.add_argument("-t", "--fieldId", default="1004")
    p.add_argument("-i", "--gpuid-list", dest="gpus", default=None)
    p.add_argument("-d", "--duration", type=float, default=30.0)
    p.add_argument("--no-dcgm-validation", action="store_true")
    p.add_argument("--version", action="store_true")
    opts = _parse(p, args)
    node = node_at()
    if opts.version:
        return f"{BURNIN_TOOL} {DCGM_VERSION} ({SIMULATOR})\n", "", 0
    try:
        wanted = None if opts.gpus is None else [int(x) for x in str(opts.gpus).split(",") if x.strip()]
    except ValueError:
        raise ToolError(f"{BURNIN_TOOL} ({SIMULATOR}): bad GPU list {opts.gpus!r}", 2) from None
    for g in wanted or []:
        if g not in node.diag_gpus:
            raise ToolError(f"{BURNIN_TOOL} ({SIMULATOR}): GPU id {g} not found", 1)
    wait = max(0.0, min(float(opts.duration), seconds))
    time.sleep(wait)
    node = node_at()
    gpus = [g for g in node.diag_gpus if wanted is None or g in wanted]
    out = [f"# {_note(BURNIN_TOOL, node)}; no CUDA load ran"]
    if opts.no_dcgm_validation:
        out += ["Skipping CreateDcgmGroups() since DCGM validation is disabled"]
    failed: list[str] = []
    for r, g in enumerate(gpus):
        tag = f"Worker {r}:0[{opts.fieldId}]"
        out.append(f"{tag}: Message: Bus ID {pci_bus_id(g)} mapped to cuda device ID {r}")
        if g in node.lost:
            why = f"GPU is lost ({node.lost[g]})"
        elif node.thermal.get(g):
            why = "; ".join(THERMAL_DETAIL.get(f, f"thermal or power fault {f}") for f in node.thermal[g])
            why += f" ({', '.join(node.thermal[g])})"
        else:
            out.append(f"{tag}: load for {opts.duration:g} s on field {opts.fieldId} done (simulated in {wait:g} s)")
            continue
        out.append(f"{tag}: FAIL under load: {why}")
        failed.append(f"GPU {g}: {why}")
    if not gpus:
        failed.append("no GPU to load")
    if failed:
        out.append(f"{BURNIN_TOOL} ({SIMULATOR}): FAIL on {len(failed)} of {len(gpus)} GPU(s): {'; '.join(failed)}")
        return "\n".join(out) + "\n", "", 1
    out.append(
        f"{BURNIN_TOOL} ({SIMULATOR}): PASS: {len(gpus)} GPU(s), {opts.duration:g} s of field {opts.fieldId} "
        f"load (simulated in {wait:g} s)"
    )
    return "\n".join(out) + "\n", "", 0


# ---------------------------------------------------------------------------------------------- CLI


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line on stderr, exit 2, like the tools' own usage errors
        raise _ArgError(f"{self.prog} ({SIMULATOR}): {message}")


def _parser(prog: str) -> _Parser:
    return _Parser(prog=prog, add_help=False, allow_abbrev=False)


def _parse(p: _Parser, args: Sequence[str]) -> argparse.Namespace:
    try:
        return p.parse_args(list(args))
    except _ArgError as exc:
        raise ToolError(str(exc), 2) from None


def run_tool(
    tool: str, args: Sequence[str], state_file: str | os.PathLike[str], gpus: int, burnin_seconds: float = 1.0
) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of simulated `tool ARGS` on the node of `state_file` with `gpus` GPUs."""
    try:
        if tool == BURNIN_TOOL:
            return burn_in(args, lambda: node_state(state_file, gpus), burnin_seconds)
        node = node_state(state_file, gpus)
        if tool == "nvidia-smi":
            return nvidia_smi(args, node)
        if tool == "dcgmi":
            return dcgmi(args, node)
        if tool == "all_reduce_perf":
            return all_reduce_perf(args, node)
        raise ToolError(f"{SIMULATOR}: no simulated tool {tool!r} (have {', '.join(TOOLS)})", 2)
    except ToolError as exc:
        return "", " ".join(str(exc).split()) + "\n", exc.rc
    except ValueError as exc:  # a malformed state file
        return "", f"{tool} ({SIMULATOR}): " + " ".join(str(exc).split()) + "\n", 2


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fleetheal.agent.simtools --state FILE [--gpus N] [--burnin-seconds S] TOOL [ARGS...]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    takes_value = {"--state", "--gpus", "--burnin-seconds"}
    split = next(
        (i for i, a in enumerate(args) if a in TOOLS and (i == 0 or args[i - 1] not in takes_value)), len(args)
    )
    p = argparse.ArgumentParser(
        prog="python -m fleetheal.agent.simtools",
        description=f"The {SIMULATOR}'s validation tools ({', '.join(TOOLS)}), answered from a state file.",
    )
    p.add_argument("--state", required=True, metavar="FILE", help="the node's simulated-GPU state file")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs on the node (default 8)")
    p.add_argument("--burnin-seconds", type=float, default=1.0, help="how long the burn-in runs (default 1)")
    opts = p.parse_args(args[:split])
    if split == len(args):
        p.error(f"name a tool: {', '.join(TOOLS)}")
    if opts.gpus < 0 or opts.burnin_seconds < 0:
        p.error("--gpus and --burnin-seconds must be >= 0")
    out, err, rc = run_tool(args[split], args[split + 1 :], opts.state, opts.gpus, opts.burnin_seconds)
    sys.stdout.write(out)
    sys.stdout.flush()
    sys.stderr.write(err)
    return rc


def _script(python: str, root: Path, state: Path, gpus: int, *, burnin_seconds: float, tool: str) -> str:
    q = shlex.quote
    cmd = [python, "-m", "fleetheal.agent.simtools", "--state", str(state), "--gpus", str(gpus)]
    cmd += ["--burnin-seconds", f"{burnin_seconds:g}", tool]
    return (
        "#!/bin/sh\n"
        f"# {tool} of the {SIMULATOR}: answers from a simulated node's state file; not a real NVIDIA tool.\n"
        "# Written by fleetheal.agent.simtools.write_sim_tools.\n"
        f'PYTHONPATH={q(str(root))}${{PYTHONPATH:+:"$PYTHONPATH"}}\n'
        "export PYTHONPATH\n"
        f'exec {" ".join(q(c) for c in cmd)} "$@"\n'
    )


def write_sim_tools(
    bin_dir: str | os.PathLike[str],
    state_file: str | os.PathLike[str],
    gpus: int,
    python: str = sys.executable,
    *,
    burnin_seconds: float = 1.0,
) -> dict[str, Any]:
    """Write `bin_dir/{nvidia-smi,dcgmi,all_reduce_perf,dcgmproftester12}` (mode 0755: sh scripts that exec
    this module with `state_file` and `gpus`) and return the node_validation role variables that use them."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1 for a node to validate, got {gpus}")
    if burnin_seconds < 0:
        raise ValueError(f"burnin_seconds must be >= 0, got {burnin_seconds}")
    bindir = Path(bin_dir).resolve()
    bindir.mkdir(parents=True, exist_ok=True)
    state = Path(state_file).resolve()
    root = Path(__file__).resolve().parents[2]  # the directory that holds the fleetheal package
    for tool in TOOLS:
        tmp = bindir / f".{tool}.{os.getpid()}.tmp"
        tmp.write_text(_script(python, root, state, gpus, burnin_seconds=burnin_seconds, tool=tool))
        tmp.chmod(0o755)
        os.replace(tmp, bindir / tool)
    return _role_vars(str(bindir), gpus)


def validation_vars(nodes_dir: str | os.PathLike[str], gpus: int, node: str = "{{ fleetheal_node }}") -> dict[str, Any]:
    """The node_validation role variables for nodes whose tools `write_sim_tools` put in
    `nodes_dir/<node>/bin`: `node` is a node's name, or (the default) the Ansible template of the node being
    revalidated, for an inventory's group variables. The report goes to `nodes_dir/<node>/node_validation.json`."""
    node_dir = f"{Path(nodes_dir).resolve()}/{node}"
    return {**_role_vars(f"{node_dir}/bin", gpus), "node_validation_report_path": f"{node_dir}/node_validation.json"}


def _role_vars(bindir: str, gpus: int) -> dict[str, Any]:
    return {
        "node_validation_nvidia_smi": f"{bindir}/nvidia-smi",
        "node_validation_dcgmi": f"{bindir}/dcgmi",
        "node_validation_nccl_binary": f"{bindir}/all_reduce_perf",
        "node_validation_nccl_enabled": gpus >= 2,  # all-reduce over one GPU moves nothing (busbw 0)
        "node_validation_nccl_min_busbw_gbps": SIM_MIN_BUSBW_GBPS,
        "node_validation_burnin_argv": [f"{bindir}/{BURNIN_TOOL}", *BURNIN_ARGS],
        "node_validation_expected_gpus": gpus,
    }


if __name__ == "__main__":
    raise SystemExit(main())
