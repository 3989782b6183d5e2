"""`fleetheal lab up|down|status|inject|demo`: the local lab (fleetheal.lab.lab) from the command line.

    fleetheal lab up [--nodes 4 --standby 2 --gpus 8]   start everything on loopback
    fleetheal lab up --clusters 3 [--nodes 2 --gpus 8]   a Slurm federation alone (clusters a, b, c)
    fleetheal lab status                                 nodes, pools, jobs, open incidents
    fleetheal lab inject NODE FAULT [--gpu I]            inject a taxonomy fault on the simulated GPUs
    fleetheal lab submit                                 submit the 2-node training job
    fleetheal lab demo                                   up, three faults healed live, summary, down
    fleetheal lab down [--purge]                         stop everything by PID (--purge: remove the lab dir)

Every command takes `--dir` (default `$FLEETHEAL_LAB_DIR` or /tmp/fleetheal-lab).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import Any

from fleetheal.errors import UsageError


def _dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", metavar="DIR", help="lab state directory (default: $FLEETHEAL_LAB_DIR or /tmp/fleetheal-lab)"
    )


def register(sub: Any) -> None:
    lab = sub.add_parser(
        "lab",
        help="the local lab: Slurm, agents, Prometheus, Alertmanager, remediator and Kubernetes on loopback",
        description="The local lab (docs in fleetheal/lab/lab.py). `fleetheal lab demo` is what `make demo` runs.",
    )
    lsub = lab.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)

    p = lsub.add_parser(
        "up",
        help="start the lab",
        description="Start the lab. With --clusters N (N >= 2), start a Slurm federation of N clusters "
        "(a, b, c...; one slurmdbd and MariaDB) alone, without agents, remediator, monitoring or Kubernetes.",
    )
    _dir_arg(p)
    p.add_argument(
        "--nodes", type=int, help="active GPU nodes (default 4); with --clusters, slurmd per cluster (default 2)"
    )
    p.add_argument("--standby", type=int, help="warm-standby nodes (default 2; not with --clusters)")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node (default 8)")
    p.add_argument(
        "--clusters",
        type=int,
        metavar="N",
        help="start a Slurm federation of N >= 2 clusters instead of the single-cluster lab",
    )
    p.set_defaults(func=cmd_up)

    p = lsub.add_parser("down", help="stop everything the lab started")
    _dir_arg(p)
    p.add_argument("--purge", action="store_true", help="also remove the lab directory")
    p.set_defaults(func=cmd_down)

    p = lsub.add_parser("status", help="nodes, pools, jobs and open incidents")
    _dir_arg(p)
    p.set_defaults(func=cmd_status)

    p = lsub.add_parser("inject", help="inject a taxonomy fault on a node's simulated GPUs")
    _dir_arg(p)
    p.add_argument("node")
    p.add_argument("fault", help="taxonomy fault id, e.g. xid-79, xid-31, nccl-timeout")
    p.add_argument("--gpu", type=int, help="GPU index (omit for a node-wide fault)")
    p.set_defaults(func=cmd_inject)

    p = lsub.add_parser("submit", help="submit the lab's 2-node training job")
    _dir_arg(p)
    p.add_argument("--name", default="train")
    p.add_argument("--nodes", type=int, default=2)
    p.set_defaults(func=cmd_submit)

    p = lsub.add_parser("demo", help="the whole self-healing loop, live (what `make demo` runs)")
    _dir_arg(p)
    p.add_argument("--keep", action="store_true", help="leave the lab running at the end")
    p.set_defaults(func=cmd_demo)


def _lab(args: argparse.Namespace, must_run: bool = True) -> Any:
    from fleetheal.lab.lab import Lab

    lab = Lab(args.dir)
    if must_run and not lab.meta.get("ready"):
        raise UsageError(f"no lab is running in {lab.dir}; start one with `fleetheal lab up`")
    return lab


def cmd_up(args: argparse.Namespace) -> int:
    from fleetheal.lab import LabError

    lab = _lab(args, must_run=False)
    if args.clusters is not None:
        return _up_federation(lab, args)
    print(f"fleetheal lab in {lab.dir}:")
    try:
        lab.up(4 if args.nodes is None else args.nodes, 2 if args.standby is None else args.standby, args.gpus)
    except LabError as exc:
        print(f"fleetheal lab: {exc}", file=sys.stderr)
        return 1
    print(f"ready: {', '.join(lab.meta['active'])} active, {', '.join(lab.standby_nodes) or 'none'} standby")
    print(f"  SLURM_CONF={lab.dir / 'slurm' / 'etc' / 'slurm.conf'}  KUBECONFIG={lab.kubeconfig}")
    return 0


def _up_federation(lab: Any, args: argparse.Namespace) -> int:
    from fleetheal.lab import LabError

    if args.clusters < 2:
        raise UsageError(f"--clusters must be at least 2 (a federation), got {args.clusters}")
    if args.standby is not None:
        raise UsageError("--standby is for the single-cluster lab; --clusters starts the federation alone")
    print(f"fleetheal lab in {lab.dir}: a Slurm federation of {args.clusters} clusters (nothing else)")
    try:
        fed = lab.up_federation(args.clusters, 2 if args.nodes is None else args.nodes, args.gpus)
    except LabError as exc:
        print(f"fleetheal lab: {exc}", file=sys.stderr)
        return 1
    for name, cluster in fed.clusters.items():
        kind = f"gpu:{fed.gpu_types[name]}:{fed.gpus_per_node}" if name in fed.gpu_types else f"gpu:{fed.gpus_per_node}"
        print(f"  cluster {name}: nodes {','.join(cluster.node_names)} ({kind} each)")
    print(f"ready: federation {fed.name!r}; reach it with")
    print(f"  export SLURM_CONF={fed.conf_path}")
    print("  squeue -M all; sbatch --gres=gpu:8 job.sh; sacctmgr show federation")
    print("stop it with `fleetheal lab down`")
    return 0


def _print_federation(lab: Any) -> None:
    from fleetheal.lab.slurm import SlurmError

    try:
        fed = lab.federation()
    except SlurmError as exc:
        raise UsageError(f"no federation is running in {lab.dir}: {exc}") from None
    print(f"lab {lab.dir}: federation {fed.name!r}, SLURM_CONF={fed.conf_path}")
    print(fed.run("scontrol", "show", "federation", check=False).stdout.rstrip())
    print(fed.squeue().rstrip())


def cmd_down(args: argparse.Namespace) -> int:
    lab = _lab(args, must_run=False)
    lab.down()
    if args.purge and lab.dir.exists():
        shutil.rmtree(lab.dir)
        print(f"removed {lab.dir}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from fleetheal.lab.demo import print_status

    lab = _lab(args)
    if "federation" in lab.meta:
        _print_federation(lab)
        return 0
    print_status(lab)
    return 0


def cmd_inject(args: argparse.Namespace) -> int:
    from fleetheal.lab import LabError

    lab = _lab(args)
    try:
        ident = lab.inject(args.node, args.fault, args.gpu)
    except (LabError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    where = f"GPU {args.gpu}" if args.gpu is not None else "the whole node"
    print(f"injected {args.fault} on {args.node} {where} ({ident})")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    lab = _lab(args)
    job, run_dir = lab.submit_training(name=args.name, nodes=args.nodes)
    print(f"submitted job {job}; log {run_dir / 'train.log'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fleetheal.lab.demo import run_demo

    return run_demo(args.dir, keep=args.keep)
