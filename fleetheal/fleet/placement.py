"""Which cluster of the federation a job goes to: `fleetheal submit`, a thin layer over `sbatch`.

Slurm's federation runs a job on whichever viable sibling can start it first and prefers none when several
are idle (docs/placement.md; measured in ../shared/notes/ENVIRONMENT.md). That scatters small jobs over idle
clusters and leaves large jobs waiting for whole nodes, and it knows nothing of GPU models or of where a
job's data lives. This module adds that policy and leaves the rest to Slurm:

- `place` is the policy (fleetheal.fleet.placement_policy, a pure function of the job and each cluster's state:
  small jobs packed onto busy clusters, large jobs where whole nodes are free, the GPU type strict, a job that
  names its data where the data is or where copying it costs least). This module reads, writes and submits.
- `read_states` reads the clusters' state from the federation itself: one `sinfo -M all` through
  fleetheal.slurm.nodes's node read (the same read as `fleetheal fleet status`).
- `sync_features` turns the fleet file's data catalogue into Slurm cluster features (`data-<name>`), so
  `sbatch --cluster-constraint` and `sacctmgr show cluster` see it too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fleetheal.contracts import CHECKPOINT_WORD
from fleetheal.errors import UsageError
from fleetheal.fleet.placement_policy import (
    ClusterState,
    Decision,
    Job,
    PlacementError,
    parse_request,
    place,
    sbatch_options,
)
from fleetheal.settings import ConfigError
from fleetheal.slurm.fields import sections
from fleetheal.slurm.gres import parse_gres
from fleetheal.slurm.nodes import FLEET_SINFO_ARGS, node_state, with_gres
from fleetheal.slurm.runner import Runner

if TYPE_CHECKING:
    from fleetheal.fleet.config import FleetConfig

#: The real `sbatch` when a site installs the wrapper under that name (else `sbatch` from PATH).
SBATCH_ENV = "FLEETHEAL_SBATCH"


# --- reading the federation -------------------------------------------------------------------------------------


def parse_states(sinfo_text: str, cfg: FleetConfig) -> list[ClusterState]:
    """Each cluster of the fleet file from what `sinfo fleetheal.slurm.nodes.FLEET_SINFO_ARGS` printed (one
    `CLUSTER:` section per cluster reached; a cluster without one is not up). A node's GPUs count as free
    when it takes jobs (idle, mixed or allocated, not drained or down) and its `GresUsed` leaves them."""
    parts = sections(sinfo_text)
    out = []
    for name, cl in cfg.clusters.items():
        held = frozenset(d for d, ds in cfg.datasets.items() if name in ds.clusters)
        text = parts.get(name, "")
        free: dict[str, int] = {}
        total = 0
        for node, gres, used in with_gres(text):
            have = sum(parse_gres(gres, cl.gpu_type).values())
            busy = sum(parse_gres(used, cl.gpu_type).values())
            total += have
            usable = node_state(node) in ("idle", "mixed", "allocated")
            free[node.name] = max(have - busy, 0) if usable else 0
        out.append(
            ClusterState(
                name=name,
                gpu_type=cl.gpu_type,
                gpus_per_node=cl.gpus_per_node,
                free_by_node=free,
                total_gpus=total,
                datasets=held,
                up=bool(free),
            )
        )
    return out


def read_states(cfg: FleetConfig, env: Mapping[str, str] | None = None, timeout: float = 20.0) -> list[ClusterState]:
    """The state of every cluster of the fleet file, from one `sinfo -M all`."""
    try:
        proc = Runner(env=env, timeout_s=timeout).completed("sinfo", *FLEET_SINFO_ARGS)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        raise PlacementError(
            f"no cluster of the fleet file answered `sinfo -M all` in {timeout:g} s: {err.strip()}"
        ) from None
    except OSError as exc:
        raise PlacementError(f"cannot run sinfo: {exc}") from None
    # sinfo -M all exits non-zero when a cluster does not answer, and prints the others: read what came.
    states = parse_states(proc.stdout, cfg)
    if not any(s.up for s in states):
        why = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
        raise PlacementError(f"no cluster of the fleet file answered `sinfo -M all`: {why}")
    return states


# --- the catalogue as cluster features ----------------------------------------------------------------------------


def parse_features(text: str) -> dict[str, set[str]]:
    """`sacctmgr -n -P show cluster format=cluster,features`: cluster -> its features."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        name, sep, feats = line.strip().partition("|")
        if sep and name:
            out[name] = {f for f in feats.split(",") if f}
    return out


def wanted_features(cfg: FleetConfig, current: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The features each cluster should have: those it has that are not placement's (not starting with
    `data_feature_prefix`), plus `<prefix><dataset>` for each dataset the catalogue says it holds."""
    prefix = cfg.placement.data_feature_prefix
    out = {}
    for name in cfg.clusters:
        kept = {f for f in current.get(name, set()) if not f.startswith(prefix)}
        data = {prefix + d for d, ds in cfg.datasets.items() if name in ds.clusters}
        out[name] = kept | data
    return out


def sync_features(cfg: FleetConfig, env: Mapping[str, str] | None = None, timeout: float = 30.0) -> dict[str, set[str]]:
    """Make each cluster's Slurm features say which datasets it holds (idempotent: a cluster already right is
    not touched). Returns the clusters changed, with their new features."""

    def sacctmgr(*args: str) -> str:
        return Runner(env=env, timeout_s=timeout, error=PlacementError).checked("sacctmgr", "-i", *args)

    current = parse_features(sacctmgr("-n", "-P", "show", "cluster", "format=cluster,features"))
    changed = {}
    for name, want in wanted_features(cfg, current).items():
        if name not in current:
            raise PlacementError(f"cluster {name!r} of the fleet file is not in slurmdbd (sacctmgr show cluster)")
        if want != current[name]:
            sacctmgr("modify", "cluster", name, "set", f"features={','.join(sorted(want))}")
            changed[name] = want
    return changed


# --- submit -------------------------------------------------------------------------------------------------------


def sbatch_argv(decision: Decision, user_args: Sequence[str], sbatch: str = "sbatch") -> list[str]:
    """`sbatch --clusters=... [--cluster-constraint=...] --parsable USER_ARGS`: the user's arguments as given."""
    argv = [sbatch, f"--clusters={','.join(decision.clusters)}"]
    if decision.constraint:
        argv.append(f"--cluster-constraint={decision.constraint}")
    if "--parsable" not in user_args[: parse_request(user_args).script_at]:
        argv.append("--parsable")
    return [*argv, *user_args]


def job_for(args: argparse.Namespace, user_args: Sequence[str]) -> Job:
    req = parse_request(user_args)
    if req.clusters_given:
        raise UsageError("leave --clusters/-M to fleetheal submit: it chooses the clusters")
    if args.gpu_type and req.gpu_type and args.gpu_type != req.gpu_type:
        raise UsageError(f"--gpu-type {args.gpu_type} and the sbatch request's type {req.gpu_type} differ")
    data = tuple(d for d in (args.data or "").split(",") if d)
    return Job(gpus=req.gpus, gpu_type=args.gpu_type or req.gpu_type, data=data, nodes=req.nodes)


def _submit(args: argparse.Namespace) -> int:
    from fleetheal.fleet import config

    user_args = list(args.sbatch_args)
    if user_args and user_args[0] == "--":
        user_args = user_args[1:]
    if not user_args:
        raise UsageError("nothing to submit: fleetheal submit [OPTIONS] -- <sbatch arguments and script>")
    job = job_for(args, user_args)
    try:
        cfg = config.load(args.fleet)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    store = args.checkpoint_store
    if store:
        if store not in cfg.checkpoint_stores:
            known = ", ".join(cfg.checkpoint_stores) or "none"
            raise UsageError(f"--checkpoint-store {store}: not a checkpoint store of the fleet file ({known})")
        if any(o == "--comment" for o, _ in sbatch_options(user_args)[0]):
            raise UsageError("--comment and --checkpoint-store: fleetheal writes the job comment; drop --comment")
        user_args = [f"--comment={CHECKPOINT_WORD}{store}", *user_args]
    try:
        states = read_states(cfg)
        if store:  # only where the job can resume: a cluster that reads its checkpoint store
            states = [st for st in states if st.name in cfg.readers(store)]
            if not states:
                raise PlacementError(f"no cluster that answers reads checkpoint store {store!r}")
        decision = place(job, states, cfg)
    except PlacementError as exc:
        raise UsageError(str(exc)) from None
    if args.explain or args.dry_run:
        for line in decision.reasons:
            print(f"fleetheal submit: {line}", file=sys.stderr)
        for c in decision.copies:
            print(f"fleetheal submit: copy {c.dataset} ({c.size_gb:g} GB) to {decision.clusters[0]}", file=sys.stderr)
    argv = sbatch_argv(decision, user_args, os.environ.get(SBATCH_ENV, "sbatch"))
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    proc = Runner(timeout_s=None).completed(*argv)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        return proc.returncode
    job_id = proc.stdout.strip().split(";", 1)[0]
    print(job_id)
    return 0


def _sync(args: argparse.Namespace) -> int:
    from fleetheal.fleet import config

    try:
        changed = sync_features(config.load(args.fleet))
    except (PlacementError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    for name, feats in sorted(changed.items()):
        print(f"{name}: features={','.join(sorted(feats))}")
    if not changed:
        print("cluster features already match the fleet file's datasets")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `fleetheal submit`."""
    p = subparsers.add_parser(
        "submit",
        help="sbatch onto the cluster of the federation that suits the job (size, GPU type, data)",
        description=(
            "Choose the clusters of the federation for a batch job (docs/placement.md), then run "
            "`sbatch --clusters=...` with your arguments unchanged. Prints the job id."
        ),
    )
    p.add_argument("--fleet", metavar="FILE", help="the fleet file (default: $FLEETHEAL_FLEET_CONFIG)")
    p.add_argument("--data", metavar="NAME,...", default="", help="datasets the job reads (fleet file `datasets`)")
    p.add_argument("--gpu-type", metavar="T", default="", help="GPU model the job must run on (e.g. h100)")
    p.add_argument(
        "--checkpoint-store",
        metavar="NAME",
        default="",
        help="the checkpoint store the job resumes from (fleet file `checkpoint_stores`): placed only where it is "
        "read, and cross-cluster failover may move the job to another cluster that reads it",
    )
    p.add_argument("--explain", action="store_true", help="say on stderr why these clusters")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of running it")
    p.add_argument(
        "sbatch_args", nargs=argparse.REMAINDER, metavar="-- SBATCH_ARGS", help="sbatch arguments and script"
    )
    p.set_defaults(func=_submit)


def register_fleet(fleet_subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `fleetheal fleet sync-features` under `fleetheal fleet` (fleetheal.fleet.status's subparsers)."""
    s = fleet_subparsers.add_parser(
        "sync-features",
        help="make Slurm's cluster features say which datasets each cluster holds",
        description="Set `data-<name>` cluster features from the fleet file's datasets (keeps other features).",
    )
    s.add_argument("--fleet", metavar="FILE", help="the fleet file (default: $FLEETHEAL_FLEET_CONFIG)")
    s.set_defaults(func=_sync)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fleetheal.fleet.placement [submit options] -- SBATCH_ARGS`: the hook without the rest of
    fleetheal's command line (what a site's `sbatch` alias or wrapper script calls)."""
    parser = argparse.ArgumentParser(prog="fleetheal")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["submit", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except UsageError as exc:
        parser.error(str(exc))  # exits 2


if __name__ == "__main__":
    sys.exit(main())
