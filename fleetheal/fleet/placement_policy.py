"""Which cluster of the federation a job goes to, decided: the policy behind `fleetheal submit` (the command
and its Slurm reads and writes are fleetheal.fleet.placement's; docs/placement.md).

- `place` is the policy, a pure function of the job and each cluster's state: small jobs are packed onto
  busy clusters (best fit), large jobs go where enough whole nodes are free, the GPU type is strict, and a
  job that names its data goes where the data is, or, when no holder can start it, where copying the
  missing data costs least (and the decision says what to copy). When no cluster can start it now, the job
  goes to every eligible cluster and the federation picks the first that frees capacity.
- `parse_request` reads the GPUs a job asks for from its `sbatch` arguments and `#SBATCH` lines.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetheal.errors import UsageError

if TYPE_CHECKING:
    from fleetheal.fleet.config import FleetConfig, Placement


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


def sbatch_options(argv: Sequence[str]) -> tuple[list[tuple[str, str]], int]:
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


def _scriptsbatch_options(path: Path) -> list[tuple[str, str]]:
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
    return sbatch_options(args)[0]


def parse_request(argv: Sequence[str]) -> Request:
    """The GPUs, GPU type and nodes that an `sbatch` command line (and its script's `#SBATCH` lines) asks for.

    `--gres=gpu[:type]:N` and `--gpus-per-node=[type:]N` are per node (times `--nodes`), `--gpus-per-task`
    per task (times `--ntasks`), `--gpus/-G [type:]N` in all."""
    opts, script_at = sbatch_options(argv)
    req = Request(script_at=script_at)
    from_script: list[tuple[str, str]] = []
    if script_at < len(argv) and not any(o == "--wrap" for o, _ in opts):
        from_script = _scriptsbatch_options(Path(argv[script_at]))
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
