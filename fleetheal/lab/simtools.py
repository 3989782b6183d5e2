"""Simulated validation tools: nvidia-smi, dcgmi, all_reduce_perf and dcgmproftester12 for simulated GPUs.

The lab's nodes have no GPUs: their faults live in the state file of `fleetheal.agent.simulated`. The
node_validation role, though, runs programs. This module answers the command lines the role (and the
reset playbook) use, from a node's state file and in the real tools' output formats (those of the test
fixtures in tests/ansible/fixtures/bin), so the revalidation of a simulated node passes or fails with
the faults injected into it. Every output says it comes from the fleetheal GPU simulator: a comment line
(nvidia-smi, all_reduce_perf, dcgmproftester12) or a JSON field `fleetheal_simulator` (dcgmi)::

    python -m fleetheal.lab.simtools --state FILE [--gpus N] [--burnin-seconds S] TOOL [ARGS...]

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
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetheal.lab.simnode import (
    BURNIN_ARGS,
    BURNIN_TOOL,
    SIM_MIN_BUSBW_GBPS,
    SIMULATOR,
    TOOLS,
    ToolError,
    node_state,
)
from fleetheal.lab.simprograms import all_reduce_perf, burn_in, dcgmi, nvidia_smi
from fleetheal.tools import CHECKOUT


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
    """`python -m fleetheal.lab.simtools --state FILE [--gpus N] [--burnin-seconds S] TOOL [ARGS...]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    takes_value = {"--state", "--gpus", "--burnin-seconds"}
    split = next(
        (i for i, a in enumerate(args) if a in TOOLS and (i == 0 or args[i - 1] not in takes_value)), len(args)
    )
    p = argparse.ArgumentParser(
        prog="python -m fleetheal.lab.simtools",
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
    cmd = [python, "-m", "fleetheal.lab.simtools", "--state", str(state), "--gpus", str(gpus)]
    cmd += ["--burnin-seconds", f"{burnin_seconds:g}", tool]
    return (
        "#!/bin/sh\n"
        f"# {tool} of the {SIMULATOR}: answers from a simulated node's state file; not a real NVIDIA tool.\n"
        "# Written by fleetheal.lab.simtools.write_sim_tools.\n"
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
    for tool in TOOLS:
        tmp = bindir / f".{tool}.{os.getpid()}.tmp"
        tmp.write_text(_script(python, CHECKOUT, state, gpus, burnin_seconds=burnin_seconds, tool=tool))
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
