"""Which cluster of the federation a job goes to: `fleetheal submit`, a thin layer over `sbatch`.

Slurm's federation runs a job on whichever viable sibling can start it first and prefers none when several
are idle (docs/placement.md; measured in ../shared/notes/ENVIRONMENT.md). That scatters small jobs over idle
clusters and leaves large jobs waiting for whole nodes, and it knows nothing of GPU models or of where a
job's data lives. This module adds that policy and leaves the rest to Slurm:

- `place` is the policy, a pure function of the job and each cluster's state: small jobs are packed onto
  busy clusters (best fit), large jobs go where enough whole nodes are free, the GPU type is strict, and a
  job that names its data goes where the data is, or, when no holder can start it, where copying the
  missing data costs least (and the decision says what to copy). When no cluster can start it now, the job
  goes to every eligible cluster and the federation picks the first that frees capacity.
- `read_states` reads the clusters' state from the federation itself: one `sinfo -M all` through
  fleetheal.slurm.nodes's node read (the same read as `fleetheal fleet status`).
- `sync_features` turns the fleet file's data catalogue into Slurm cluster features (`data-<name>`), so
  `sbatch --cluster-constraint` and `sacctmgr show cluster` see it too.
- `parse_request` reads the GPUs a job asks for from its `sbatch` arguments and `#SBATCH` lines.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetheal.contracts import CHECKPOINT_WORD
from fleetheal.errors import UsageError
from fleetheal.settings import ConfigError
from fleetheal.slurm.fields import sections
from fleetheal.slurm.gres import parse_gres
from fleetheal.slurm.nodes import FLEET_SINFO_ARGS, node_state, with_gres
from fleetheal.slurm.runner import Runner

if TYPE_CHECKING:
    from fleetheal.fleet.config import FleetConfig, Placement


#: The real `sbatch` when a site installs the wrapper under that name (else `sbatch` from PATH).
SBATCH_ENV = "FLEETHEAL_SBATCH"


class PlacementError(Exception):
    """The job cannot go anywhere: no cluster of its GPU type, an unknown dataset, a request no cluster can hold."""


# --- the job and the clusters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What placement needs to know of a job."""

    #: GPUs in all (every node together).
    gpus: int
    #: GPU model the job insists on ("" for any).
    gpu_type: str = ""
    #: Datasets the job names (fleet file `datasets`).
    data: tuple[str, ...] = ()
    #: Nodes the job asks for; 0 when it does not say (then as few as hold its GPUs).
    nodes: int = 0


@dataclass(frozen=True)
class ClusterState:
    """One cluster as placement sees it."""

    name: str
    #: The GPU model, from the fleet file.
    gpu_type: str
    gpus_per_node: int
    #: Free GPUs of each node that takes jobs (not drained, not down), by node name.
    free_by_node: Mapping[str, int] = field(default_factory=dict)
    #: GPUs of every node, usable or not.
    total_gpus: int = 0
    #: Datasets the catalogue says this cluster's storage holds.
    datasets: frozenset[str] = frozenset()
    #: False when its controller did not answer: it gets no job.
    up: bool = True

    @property
    def free_gpus(self) -> int:
        return sum(self.free_by_node.values())

    @property
    def whole_free_nodes(self) -> int:
        """Nodes with every GPU free: what large jobs need."""
        return sum(1 for f in self.free_by_node.values() if f >= self.gpus_per_node)

    @property
    def busy(self) -> bool:
        return self.free_gpus < self.total_gpus


@dataclass(frozen=True)
class Copy:
    """A dataset that must be copied to the cluster the job goes to."""

    dataset: str
    size_gb: float
    seconds: float


@dataclass(frozen=True)
class Decision:
    """Where a job goes and why."""

    #: The clusters the job is submitted to (`sbatch --clusters`), best first.
    clusters: tuple[str, ...]
    #: True when the first cluster can start the job now; False when it waits for the first to free capacity.
    start_now: bool
    #: `sbatch --cluster-constraint` value ("" for none): the data feature, when the job names one dataset.
    constraint: str = ""
    #: Datasets to copy to the chosen cluster (only when it lacks some of the job's data).
    copies: tuple[Copy, ...] = ()
    #: Sentences saying why, for `--explain`.
    reasons: tuple[str, ...] = ()

    @property
    def copy_seconds(self) -> float:
        return sum(c.seconds for c in self.copies)

    def as_dict(self) -> dict[str, Any]:
        return {
            "clusters": list(self.clusters),
            "start_now": self.start_now,
            "constraint": self.constraint,
            "copies": [{"dataset": c.dataset, "size_gb": c.size_gb, "seconds": c.seconds} for c in self.copies],
            "reasons": list(self.reasons),
        }


# --- the policy -----------------------------------------------------------------------------------------------


def _shape(job: Job, cluster: ClusterState) -> tuple[int, int]:
    """(nodes, GPUs on each node) the job takes on `cluster`."""
    nodes = job.nodes or max(1, math.ceil(job.gpus / cluster.gpus_per_node))
    return nodes, math.ceil(job.gpus / nodes)


def can_hold(job: Job, cluster: ClusterState) -> bool:
    """The cluster has enough nodes of enough GPUs to run the job at all (when empty)."""
    nodes, per_node = _shape(job, cluster)
    return per_node <= cluster.gpus_per_node and nodes * cluster.gpus_per_node <= cluster.total_gpus


def fits_now(job: Job, cluster: ClusterState) -> bool:
    """The cluster has, right now, `nodes` nodes with `per_node` GPUs free each."""
    if not cluster.up:
        return False
    nodes, per_node = _shape(job, cluster)
    return sum(1 for f in cluster.free_by_node.values() if f >= per_node) >= nodes


def copy_cost(job: Job, cluster: ClusterState, cfg: FleetConfig) -> tuple[Copy, ...]:
    """The datasets of `job` that `cluster` lacks, with the seconds copying each takes."""
    rate = cfg.placement.copy_gb_per_s
    out = []
    for name in job.data:
        if name not in cluster.datasets:
            size = cfg.datasets[name].size_gb
            out.append(Copy(name, size, size / rate))
    return tuple(out)


def _rank(job: Job, clusters: Iterable[ClusterState], small: bool) -> list[ClusterState]:
    """Best first among clusters that can start the job now.

    Small jobs: best fit, fewest free GPUs that still fit (the busiest cluster), then fewest whole free nodes
    (breaking a whole node costs large jobs), then the name. Large jobs: fewest whole free nodes that are
    enough, so other clusters keep theirs, then fewest free GPUs, then the name."""
    if small:
        return sorted(clusters, key=lambda c: (c.free_gpus, c.whole_free_nodes, c.name))
    return sorted(clusters, key=lambda c: (c.whole_free_nodes, c.free_gpus, c.name))


def validate(job: Job, cfg: FleetConfig) -> None:
    """PlacementError for a job that no fleet can take as asked."""
    if job.gpus < 0 or job.nodes < 0:
        raise PlacementError("GPUs and nodes cannot be negative")
    unknown = [d for d in job.data if d not in cfg.datasets]
    if unknown:
        known = ", ".join(sorted(cfg.datasets)) or "none"
        raise PlacementError(f"unknown dataset(s) {', '.join(unknown)}: the fleet file's datasets are {known}")
    if job.gpu_type and not any(c.gpu_type == job.gpu_type for c in cfg.clusters.values()):
        types = ", ".join(sorted({c.gpu_type for c in cfg.clusters.values() if c.gpu_type})) or "none"
        raise PlacementError(f"no cluster has GPU type {job.gpu_type!r} (the fleet's types: {types})")


def place(job: Job, states: Sequence[ClusterState], cfg: FleetConfig) -> Decision:
    """Where `job` goes, given each cluster's state (`read_states`) and the fleet file."""
    validate(job, cfg)
    pcfg: Placement = cfg.placement
    small = job.gpus <= pcfg.small_job_max_gpus
    reasons: list[str] = []
    kind = "small" if small else "large"
    reasons.append(f"{job.gpus} GPU(s): a {kind} job (small is at most {pcfg.small_job_max_gpus})")

    typed = [c for c in states if not job.gpu_type or c.gpu_type == job.gpu_type]
    if job.gpu_type:
        reasons.append(f"GPU type {job.gpu_type}: clusters {', '.join(c.name for c in typed) or 'none'}")
    reachable = [c for c in typed if c.up]
    down = [c.name for c in typed if not c.up]
    if down:
        reasons.append(f"not reachable, left out: {', '.join(down)}")
    eligible = [c for c in reachable if can_hold(job, c)]
    if not eligible:
        sizes = ", ".join(f"{c.name} ({c.total_gpus} GPUs, {c.gpus_per_node}/node)" for c in reachable) or "none"
        raise PlacementError(
            f"no reachable cluster can hold {job.gpus} GPU(s) on {job.nodes or 'any'} node(s): {sizes}"
        )

    holders = [c for c in eligible if all(d in c.datasets for d in job.data)]
    if job.data:
        reasons.append(f"data {', '.join(job.data)} is held by: {', '.join(c.name for c in holders) or 'none'}")
    constraint = ""
    if len(job.data) == 1 and holders:
        constraint = pcfg.data_feature_prefix + job.data[0]

    now = _rank(job, (c for c in (holders if job.data else eligible) if fits_now(job, c)), small)
    if now:
        best = now[0]
        why = (
            f"best fit: {best.free_gpus} GPU(s) free, the fewest among those that can start it now"
            if small
            else f"{best.whole_free_nodes} whole free node(s), enough and the fewest among those that have enough"
        )
        reasons.append(f"{best.name}: {why} ({', '.join(c.name for c in now)})")
        return Decision((best.name,), True, constraint, (), tuple(reasons))

    if job.data:
        # No holder can start it now: a cluster that can, where copying what it lacks costs least.
        movable = [c for c in eligible if fits_now(job, c)]
        if movable:
            costed = sorted(movable, key=lambda c: (sum(x.seconds for x in copy_cost(job, c, cfg)), c.name))
            best = _rank(job, [c for c in costed if _same_cost(job, c, costed[0], cfg)], small)[0]
            copies = copy_cost(job, best, cfg)
            what = ", ".join(f"{x.dataset} ({x.size_gb:g} GB, {x.seconds:.0f} s)" for x in copies)
            reasons.append(
                f"no holder of the data can start it now; {best.name} can, copying {what} "
                f"at {pcfg.copy_gb_per_s:g} GB/s costs least"
            )
            return Decision((best.name,), True, "", copies, tuple(reasons))
        if holders:
            names = tuple(c.name for c in _rank(job, holders, small))
            reasons.append(f"no cluster can start it now: it waits on the data's holders {', '.join(names)}")
            return Decision(names, False, constraint, (), tuple(reasons))
        costed = sorted(eligible, key=lambda c: (sum(x.seconds for x in copy_cost(job, c, cfg)), c.name))
        cheapest = [c for c in costed if _same_cost(job, c, costed[0], cfg)]
        names = tuple(c.name for c in _rank(job, cheapest, small))
        copies = copy_cost(job, cheapest[0], cfg)
        reasons.append(
            f"no cluster of its type holds the data and none can start it now: it waits on {', '.join(names)}, "
            f"where copying costs least ({sum(x.seconds for x in copies):.0f} s)"
        )
        return Decision(names, False, "", copies, tuple(reasons))

    names = tuple(c.name for c in _rank(job, eligible, small))
    reasons.append(
        f"no cluster can start it now: the federation starts it on the first of {', '.join(names)} to free room"
    )
    return Decision(names, False, "", (), tuple(reasons))


def _same_cost(job: Job, a: ClusterState, b: ClusterState, cfg: FleetConfig) -> bool:
    return math.isclose(sum(x.seconds for x in copy_cost(job, a, cfg)), sum(x.seconds for x in copy_cost(job, b, cfg)))


# --- the job's GPU request --------------------------------------------------------------------------------------

#: sbatch options that take a value (so the value is not mistaken for the script); the short ones of sbatch(1).
_SHORT_WITH_VALUE = frozenset("ABDGJLMNSacdeikmnopqtwx")
_COUNT = re.compile(r"\d+")


def _gpu_spec(spec: str) -> tuple[str, int] | None:
    """`gpu:h100:8`, `gpu:8`, `gpu` (one) in a `--gres` list -> (type, count); None when no GPU is asked for."""
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 1:
            return "", 1
        if len(parts) == 2:
            return ("", int(parts[1])) if parts[1].isdigit() else (parts[1], 1)
        if not parts[2].isdigit():
            raise UsageError(f"--gres {item!r}: the GPU count must be a number")
        return parts[1], int(parts[2])
    return None


def _typed_count(option: str, value: str) -> tuple[str, int]:
    """`8` or `h100:8` (`--gpus`, `--gpus-per-node`, `--gpus-per-task`)."""
    kind, _, count = value.rpartition(":")
    if not count.isdigit():
        raise UsageError(f"{option} {value!r}: expected N or TYPE:N")
    return kind, int(count)


def _min_count(option: str, value: str) -> int:
    """`-N 2`, `--nodes=2-4` (the minimum counts), `--ntasks=4`."""
    m = _COUNT.match(value)
    if not m:
        raise UsageError(f"{option} {value!r}: expected a number")
    return int(m.group())


@dataclass
class Request:
    """The GPU request of one `sbatch` invocation: options on the command line win over `#SBATCH` lines."""

    gpus: int = 0
    gpu_type: str = ""
    nodes: int = 0
    #: Index in the argument list where the script (and its arguments) begin; len(argv) when none.
    script_at: int = 0
    #: Options of fleetheal's own that the user must not set (`--clusters`/`-M`).
    clusters_given: bool = False


def _options(argv: Sequence[str]) -> tuple[list[tuple[str, str]], int]:
    """(option, value) pairs of sbatch options and the index of the script: long `--opt=v`/`--opt v`,
    short `-Nv`/`-N v`; flags get the value ""."""
    out: list[tuple[str, str]] = []
    i = 0
    wanted = {"--gres", "--gpus", "--gpus-per-node", "--gpus-per-task", "--nodes", "--ntasks", "--clusters"}
    with_value = wanted | {
        "--account", "--partition", "--qos", "--time", "--job-name", "--output", "--error", "--mem",
        "--cpus-per-task", "--constraint", "--cluster-constraint", "--dependency", "--chdir", "--export",
        "--mem-per-cpu", "--mem-per-gpu", "--cpus-per-gpu", "--nodelist", "--exclude", "--begin", "--comment",
        "--array", "--wrap", "--licenses", "--reservation", "--signal", "--ntasks-per-node", "--mail-type",
        "--mail-user", "--input", "--open-mode", "--priority", "--nice", "--tres-per-task",
    }  # fmt: skip
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out, i + 1
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if not eq and name in with_value and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            out.append((name, value))
        elif arg.startswith("-") and len(arg) > 1:
            flag = arg[1]
            if flag in _SHORT_WITH_VALUE:
                value = arg[2:]
                if not value and i + 1 < len(argv):
                    value, i = argv[i + 1], i + 1
                out.append(("-" + flag, value))
            else:
                out.append(("-" + flag, ""))
        else:
            return out, i
        i += 1
    return out, len(argv)


_ALIASES = {"-G": "--gpus", "-N": "--nodes", "-n": "--ntasks", "-M": "--clusters"}


def _script_options(path: Path) -> list[tuple[str, str]]:
    """The `#SBATCH` lines of a batch script (sbatch reads them until the first command)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    args: list[str] = []
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s.startswith("#SBATCH"):
            args.extend(shlex.split(s[len("#SBATCH") :], comments=True))
        elif s and not s.startswith("#"):
            break
    return _options(args)[0]


def parse_request(argv: Sequence[str]) -> Request:
    """The GPUs, GPU type and nodes that an `sbatch` command line (and its script's `#SBATCH` lines) asks for.

    `--gres=gpu[:type]:N` and `--gpus-per-node=[type:]N` are per node (times `--nodes`), `--gpus-per-task`
    per task (times `--ntasks`), `--gpus/-G [type:]N` in all."""
    opts, script_at = _options(argv)
    req = Request(script_at=script_at)
    from_script: list[tuple[str, str]] = []
    if script_at < len(argv) and not any(o == "--wrap" for o, _ in opts):
        from_script = _script_options(Path(argv[script_at]))
    values: dict[str, str] = {}
    for name, value in [*from_script, *opts]:  # the command line after the script: it wins
        values[_ALIASES.get(name, name)] = value
    req.clusters_given = "--clusters" in values
    nodes = _min_count("--nodes", values["--nodes"]) if "--nodes" in values else 0
    tasks = _min_count("--ntasks", values["--ntasks"]) if "--ntasks" in values else 0
    req.nodes = nodes
    kind = ""
    total = 0
    if "--gpus" in values:
        kind, total = _typed_count("--gpus", values["--gpus"])
    elif "--gpus-per-node" in values:
        kind, per = _typed_count("--gpus-per-node", values["--gpus-per-node"])
        total = per * max(nodes, 1)
    elif "--gpus-per-task" in values:
        kind, per = _typed_count("--gpus-per-task", values["--gpus-per-task"])
        total = per * max(tasks, 1)
    elif "--gres" in values:
        spec = _gpu_spec(values["--gres"])
        if spec is not None:
            kind, per = spec
            total = per * max(nodes, 1)
    req.gpus, req.gpu_type = total, kind
    return req


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
        if any(o == "--comment" for o, _ in _options(user_args)[0]):
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
