"""What each simulated validation tool answers (nvidia-smi, dcgmi diag, all_reduce_perf, dcgmproftester12), in
the real tools' output formats, for a node as fleetheal.lab.simnode reads it. fleetheal.lab.simtools runs them.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from fleetheal.agent.simulated import Injection, pci_bus_id, read_injections, remove
from fleetheal.lab.simnode import (
    BURNIN_TOOL,
    DCGM_FAIL_RC,
    DCGM_VERSION,
    GPU_NAME,
    HEALTHY_BUSBW_GBPS,
    NVLINK_DEGRADED_BUSBW_GBPS,
    NVSMI_GPU_LOST_RC,
    NVSMI_NO_DEVICES_RC,
    PCIE_GEN_MAX,
    PCIE_WIDTH,
    REMAP,
    RESETTING,
    SIMULATOR,
    THERMAL_DETAIL,
    SimNode,
    ToolError,
    gpu_uuid,
    note,
    parse_tool_args,
    tool_parser,
)
from fleetheal.taxonomy import load

# ---------------------------------------------------------------------------------------------- nvidia-smi

NVSMI_FIELDS: dict[str, Callable[[int], str]] = {
    "index": str,
    "count": lambda _: "",  # filled in by the caller
    "name": lambda _: GPU_NAME,
    "uuid": gpu_uuid,
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
            return f"No devices were found\n# {note('nvidia-smi', node)}\n", warnings, NVSMI_NO_DEVICES_RC
        out = "".join(f"GPU {g}: {GPU_NAME} (UUID: {gpu_uuid(g)})\n" for g in shown)
        return out + f"# {note('nvidia-smi', node)}\n", warnings, 0
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
        return f"No devices were found\n# {note('nvidia-smi', node)}\n", warnings, NVSMI_NO_DEVICES_RC
    lines = [] if "noheader" in fmt else [", ".join(fields)]
    for g in shown:
        lines.append(", ".join(str(len(node.listed)) if f == "count" else NVSMI_FIELDS[f](g) for f in fields))
    lines.append(f"# {note('nvidia-smi', node)}")
    return "\n".join(lines) + "\n", warnings, 0


def _nvsmi_reset(index: int | None, node: SimNode) -> tuple[str, str, int]:
    targets = node.diag_gpus if index is None else [index]
    if index is not None and index not in node.listed and index not in node.lost:
        return f"No devices were found\n# {note('nvidia-smi', node)}\n", "", NVSMI_NO_DEVICES_RC
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
    out += f"# {note('nvidia-smi', node)}; the reset cleared {cleared} (RESET_GPU faults only)\n"
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
        "fleetheal_simulator": note("dcgmi diag", node),
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
    p = tool_parser("dcgmi diag")
    p.add_argument("-r", "--run", required=True)
    p.add_argument("-j", "--json", action="store_true")
    p.add_argument("-i", "--entity-id", default=None)
    p.add_argument("--timeout", default=None)
    p.add_argument("--iterations", default=None)
    opts = parse_tool_args(p, args[1:])
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
        f"# {note('all_reduce_perf', node)}",
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
    p = tool_parser(BURNIN_TOOL)
    p.add_argument("-t", "--fieldId", default="1004")
    p.add_argument("-i", "--gpuid-list", dest="gpus", default=None)
    p.add_argument("-d", "--duration", type=float, default=30.0)
    p.add_argument("--no-dcgm-validation", action="store_true")
    p.add_argument("--version", action="store_true")
    opts = parse_tool_args(p, args)
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
    out = [f"# {note(BURNIN_TOOL, node)}; no CUDA load ran"]
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
