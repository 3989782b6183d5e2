"""Pulumi program at fleet scale: synthesis, render, policy pack and a real `pulumi preview`.

Every measurement runs in a fresh Python process (this file run as `bench_pulumi.py --child MODE ...`),
so peak RSS is that process's own and the wall time covers the whole process (interpreter start,
imports, synthesis, render and exit). The fleet: 16 GPU pools of N/16 existing nodes each, 5% warm
standby per pool (stack_model.standby_size).

1. Synthesis + render at 2,000, 10,000 and 25,000 nodes: `fleetheal.infra.program.build` under
   `fleetheal.infra.mocks`, then the YAML files `fleetheal render` would write (kept in memory).
   Goal at 25,000 nodes: wall < 30 s, peak RSS < 1 GB. Growth exponents log(t2/t1)/log(n2/n1) of wall
   and RSS between sizes (1.0 = linear in nodes, 0 = flat).
2. The peer, side by side at 2,000 and 10,000 nodes: the former per-node declaration (one
   `kubernetes:core/v1:NodePatch` per node), defined here only, put in place of the node-pool provider
   in the child process (`fleetheal.infra.program.make_provider` patched there). Ratios are new / old.
3. `fleetheal.infra.policy.evaluate` (the CrossGuard rules offline, as `fleetheal render --policy` runs
   them) over the 25,000-node stack's custom resources.
4. With `make tools` built (.tools/bin: pulumi, pulumi-resource-kubernetes, etcd, kube-apiserver, ...):
   the real engine and provider against a local kube-apiserver with 2,000 Nodes: `up` (awaitReadiness
   false; PULUMI_SKIP_CHECKPOINTS, as the file backend's per-step checkpoints are quadratic), then pool
   00's last active node moved to pool 01 and `preview` timed (median of 3), for the ConfigMap
   declaration and for the per-node NodePatch one, each on a control plane of its own. The engine runs
   the program inline in the child (fleetheal.infra.engine.open_stack), so the peer is put in place there
   the same way as in 2. Skipped, with a note, when the tools are missing or FLEETHEAL_BENCH_ENGINE=0.

Parts 1-3 take ~3 min on 2 cores, part 4 ~5 min (the peer's `up` and previews are most of it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLEETHEAL_SHARED", REPO.parent / "shared"))
POOLS = 16
#: nodes -> runs of the ConfigMap declaration (the product) and of the per-node NodePatch peer.
SIZES = {2_000: 3, 10_000: 3, 25_000: 3}
PEER_SIZES = {2_000: 3, 10_000: 2}
GOAL_NODES = 25_000
GOAL_WALL_S = 30.0
GOAL_RSS_MB = 1024.0
POLICY_RUNS = 3
ENGINE_NODES = 2_000
PREVIEW_RUNS = 3
NEW, OLD = "configmap", "nodepatch"
CHILD_TIMEOUT_S = 600
ENGINE_TIMEOUT_S = 900


# ------------------------------------------------------------------------------------------------
# Child side: runs in a fresh process (python bench_pulumi.py --child MODE VARIANT POOLS NODES ...).


def _values(pools: int, nodes: int, move_one: bool = False) -> dict[str, Any]:
    """Stack values of a `pools`-pool fleet of `nodes` active nodes; `move_one` moves pool 0's last
    active node to the end of pool 1 (one node's membership changes, every other node keeps its own)."""
    from fleetheal.infra import stack_model

    per = nodes // pools
    out: list[dict[str, Any]] = []
    for p in range(pools):
        out.append(
            {
                "name": f"pool{p:02d}",
                "gpuType": ("h100", "h200", "b200", "a100")[p % 4],
                "gpusPerNode": 8,
                "nodeNames": [f"gpu-{p:02d}-{i:05d}" for i in range(per)],
                "standbyNodeNames": [f"spare-{p:02d}-{i:03d}" for i in range(stack_model.standby_size(per, 1, 5))],
            }
        )
    if move_one:
        out[1]["nodeNames"].append(out[0]["nodeNames"].pop())
    return {"clusterName": "bench", "gpuPools": out}


def _use_per_node_patches() -> None:
    """Put the former per-node declaration (one NodePatch per node) in place of the provider `build` makes."""
    import pulumi
    import pulumi_kubernetes as k8s

    from fleetheal import contracts
    from fleetheal.infra import nodepools, program
    from fleetheal.infra.stack_model import GpuPool

    class PerNodePatches:
        name = "existing"

        def __init__(self, failure_domain_size: int) -> None:
            self.failure_domain_size = failure_domain_size

        def declare(self, pool: GpuPool, parent: pulumi.Resource) -> list[pulumi.Resource]:
            out: list[pulumi.Resource] = []
            for role, names in ((nodepools.ACTIVE, pool.node_names), (nodepools.STANDBY, pool.standby_node_names)):
                for i, node in enumerate(names):
                    domain = nodepools.failure_domain(pool, i, self.failure_domain_size)
                    labels, taints = contracts.member_node(pool.name, pool.gpu_type, role, domain)
                    out.append(
                        k8s.core.v1.NodePatch(
                            f"{pool.name}-{role}-{node}",
                            metadata={"name": node, "labels": labels},
                            spec={"taints": taints} if taints else None,
                            opts=pulumi.ResourceOptions(parent=parent),
                        )
                    )
            return out

    def make_provider(kind: str, **kwargs: Any) -> nodepools.NodePoolProvider:
        assert kind == "existing", kind
        return PerNodePatches(kwargs["failure_domain_size"])

    program.make_provider = make_provider  # type: ignore[attr-defined]


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child_synth(variant: str, pools: int, nodes: int, policy_too: bool) -> dict[str, Any]:
    from fleetheal.infra import config, mocks, program, render

    if variant == OLD:
        _use_per_node_patches()
    t0 = time.perf_counter()
    cfg = config.from_values(_values(pools, nodes))
    t1 = time.perf_counter()
    records = mocks.run(lambda: program.build(cfg), stack="bench")
    t2 = time.perf_counter()
    out: dict[str, Any] = {"config_s": t1 - t0, "synth_s": t2 - t1, "resources": len(records)}
    if not policy_too:
        files = render.records_to_files(records, "# bench\n")
        out |= {
            "render_s": time.perf_counter() - t2,
            "files": len(files),
            "bytes": sum(len(v) for v in files.values()),
            "patches": sum(1 for r in records if r.type == "kubernetes:core/v1:NodePatch"),
            "peak_rss_mb": _rss_mb(),
        }
        return out
    from fleetheal.infra import policy

    triples: list[tuple[str, str, Mapping[str, Any]]] = [(r.type, r.name, r.inputs) for r in records if r.custom]
    t3 = time.perf_counter()
    violations = policy.evaluate(triples)
    out |= {
        "policy_s": time.perf_counter() - t3,
        "evaluated": len(triples),
        "violations": len(violations),
        "violation_names": sorted({name for name, _ in violations}),
        "peak_rss_mb": _rss_mb(),
    }
    return out


def _child_engine(variant: str, pools: int, nodes: int, *, kubeconfig: str, backend: str, runs: int) -> dict[str, Any]:
    """`up` the fleet into the cluster of `kubeconfig`, move one node, time `preview` `runs` times.

    As `engine.up` / `engine.preview` do (without policy packs), except that `gpuPools` is written into
    the workspace's stack file after `engine.open_stack`: a Pulumi config string set through the
    Automation API is not an array, and a 2,000-node list is too long for one command-line argument.
    """
    import yaml
    from pulumi import automation as auto

    from fleetheal.infra import engine
    from fleetheal.lab import controlplane

    if variant == OLD:
        _use_per_node_patches()
    target = engine.Target(
        stack="bench",
        kubeconfig=Path(kubeconfig),
        backend=Path(backend),
        bin_dir=controlplane.tools_dir(),
        passphrase="fleetheal-bench-passphrase",
        settings={"awaitReadiness": "false", "clusterName": "bench"},
    )

    def open_stack(move_one: bool) -> auto.Stack:
        stack = engine.open_stack(target)
        path = target.work_dir / f"Pulumi.{target.stack}.yaml"
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        doc.setdefault("config", {})["fleetheal:gpuPools"] = _values(pools, nodes, move_one)["gpuPools"]
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        return stack

    # The file backend rewrites the whole state after every step of an update, which is quadratic in
    # resources (2,112 NodePatches took over 5 minutes); `up` is only the set-up here: one checkpoint.
    os.environ["PULUMI_SKIP_CHECKPOINTS"] = "true"
    t0 = time.perf_counter()
    result = open_stack(False).up(color="never")
    up_s = time.perf_counter() - t0
    del os.environ["PULUMI_SKIP_CHECKPOINTS"]
    if result.summary.result != "succeeded":
        raise RuntimeError(f"up: {result.summary.result}")
    times: list[float] = []
    summary: dict[str, int] = {}
    for _ in range(runs):
        t0 = time.perf_counter()
        preview = open_stack(True).preview(color="never")
        times.append(time.perf_counter() - t0)
        summary = {str(getattr(op, "value", op)): n for op, n in preview.change_summary.items()}
    return {
        "up_s": up_s,
        "up_changes": engine.changes(result.summary.resource_changes),
        "preview_s": times,
        "preview_summary": summary,
        "peak_rss_mb": _rss_mb(),
    }


def _child(argv: list[str]) -> None:
    sys.path.insert(0, str(REPO))  # this file runs as a script: its folder, not the repository, is on the path
    mode, variant, pools, nodes = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode in ("synth", "policy"):
        out = _child_synth(variant, pools, nodes, policy_too=mode == "policy")
    elif mode == "engine":
        out = _child_engine(variant, pools, nodes, kubeconfig=argv[4], backend=argv[5], runs=int(argv[6]))
    else:
        raise SystemExit(f"unknown child mode {mode!r}")
    print(json.dumps(out))


# ------------------------------------------------------------------------------------------------
# Parent side.


def _reap(marker: str) -> None:
    """SIGKILL every process of this user whose environment mentions `marker` (a temporary directory
    only this benchmark made): engine plugins orphaned by a child that was killed."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _spawn(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run this file as a child in a session of its own; (its JSON answer, its wall time in s). On a
    timeout or any failure the child's whole process group is stopped (SIGTERM, then SIGKILL)."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"bench_pulumi child {args[:4]} exited {proc.returncode}: {stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result, wall


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _synth_runs() -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every synthesis + render run, the peer's interleaved with the product's at the same size."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for nodes, n in SIZES.items():
        for i in range(max(n, PEER_SIZES.get(nodes, 0))):
            variants = ([NEW] if i < n else []) + ([OLD] if i < PEER_SIZES.get(nodes, 0) else [])
            for variant in variants:
                result, wall = _spawn(["synth", variant, str(POOLS), str(nodes)], CHILD_TIMEOUT_S)
                runs.setdefault((variant, nodes), []).append({**result, "wall_s": wall})
    return runs


def _exponent(small: float, large: float, n1: int, n2: int) -> float:
    return math.log(large / small) / math.log(n2 / n1)


def _extrapolated(runs: dict[tuple[str, int], list[dict[str, Any]]], nodes: int) -> str:
    """The peer's wall and RSS at `nodes`, extrapolated with its growth exponent between its two largest sizes."""
    n1, n2 = sorted(PEER_SIZES)[-2:]
    parts = []
    for key, unit in (("wall_s", "s wall"), ("peak_rss_mb", "MB peak RSS")):
        a = statistics.median(r[key] for r in runs[(OLD, n1)])
        b = statistics.median(r[key] for r in runs[(OLD, n2)])
        parts.append(f"{b * (nodes / n2) ** _exponent(a, b, n1, n2):,.0f} {unit}")
    return f"per-node NodePatches extrapolated from {n1:,} and {n2:,} nodes: {' and '.join(parts)}"


def _figures(runs: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def med(variant: str, nodes: int, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[(variant, nodes)]))

    for nodes in SIZES:
        new = runs[(NEW, nodes)]
        first = new[0]
        old = runs.get((OLD, nodes))
        note = (
            f"{POOLS} pools, {nodes:,} active nodes + 5% standby per pool, one membership ConfigMap per pool: "
            f"{first['resources']:,} registrations (components included), {first['files']:,} YAML files, "
            f"{first['bytes'] / 1e6:.1f} MB; fresh process per run, mock engine; "
        )
        if old:
            o = old[0]
            note += (
                f"peer: the former per-node declaration, {o['patches']:,} NodePatches, {o['resources']:,} "
                f"registrations, {o['files']:,} files (n={len(old)}); ratio = ConfigMaps / NodePatches"
            )
        else:
            note += f"no peer at this size (too slow); {_extrapolated(runs, nodes)}"
        goal_size = nodes == GOAL_NODES
        for name, unit, key, goal in (
            (f"synthesis under mocks, {nodes:,} nodes", "s", "synth_s", None),
            (f"render to YAML (in memory), {nodes:,} nodes", "s", "render_s", None),
            (
                f"wall of the whole synthesis + render process, {nodes:,} nodes",
                "s",
                "wall_s",
                f"< {GOAL_WALL_S:.0f} s" if goal_size else None,
            ),
            (
                f"peak RSS of the synthesis + render process, {nodes:,} nodes",
                "MB",
                "peak_rss_mb",
                f"< 1 GB ({GOAL_RSS_MB:,.0f} MB)" if goal_size else None,
            ),
        ):
            values = [r[key] for r in new]
            median = statistics.median(values)
            peer = med(OLD, nodes, key) if old else None
            out.append(
                {
                    "name": name,
                    "unit": unit,
                    "median": median,
                    "p99": _pct(values, 0.99),
                    "n": len(values),
                    "goal": goal,
                    "peer": peer,
                    "ratio_to_peer": median / peer if peer else None,
                    "notes": note,
                }
            )
        out.append(
            {
                "name": f"resources registered, {nodes:,} nodes",
                "unit": "resources",
                "median": first["resources"],
                "p99": first["resources"],
                "n": 1,
                "goal": None,
                "peer": old[0]["resources"] if old else None,
                "ratio_to_peer": first["resources"] / old[0]["resources"] if old else None,
                "notes": "Pulumi resource registrations, components included (deterministic)",
            }
        )
    sizes = list(SIZES)
    peer_sizes = list(PEER_SIZES)
    for key, label, unit in (("wall_s", "wall", "s"), ("peak_rss_mb", "peak RSS", "MB")):
        for n1, n2 in itertools.pairwise(sizes):
            exp = _exponent(med(NEW, n1, key), med(NEW, n2, key), n1, n2)
            peer = None
            if n1 in PEER_SIZES and n2 in PEER_SIZES:
                peer = _exponent(med(OLD, n1, key), med(OLD, n2, key), n1, n2)
            note = (
                f"log(median({n2:,}) / median({n1:,})) / log({n2:,} / {n1:,}) of the {label} ({unit}): "
                f"{med(NEW, n1, key):.3g} -> {med(NEW, n2, key):.3g}; 1 = linear in nodes, 0 = flat"
            )
            if peer is not None:
                note += (
                    f"; peer (per-node NodePatches): {med(OLD, n1, key):.3g} -> {med(OLD, n2, key):.3g}, "
                    f"exponent {peer:.2f}"
                )
            elif peer_sizes:
                note += "; no peer at these sizes"
            out.append(
                {
                    "name": f"growth exponent of {label}, {n1:,} -> {n2:,} nodes",
                    "unit": "exponent",
                    "median": exp,
                    "p99": None,
                    "n": min(len(runs[(NEW, n1)]), len(runs[(NEW, n2)])),
                    "goal": None,
                    "peer": peer,
                    "ratio_to_peer": None,
                    "notes": note,
                }
            )
    return out


def _policy_figure() -> dict[str, Any]:
    results = [_spawn(["policy", NEW, str(POOLS), str(GOAL_NODES)], CHILD_TIMEOUT_S)[0] for _ in range(POLICY_RUNS)]
    values = [r["policy_s"] for r in results]
    first = results[0]
    found = ", ".join(first["violation_names"]) or "none"
    return {
        "name": f"policy pack evaluation (fleetheal.infra.policy.evaluate), {GOAL_NODES:,} nodes",
        "unit": "s",
        "median": statistics.median(values),
        "p99": _pct(values, 0.99),
        "n": len(values),
        "goal": None,
        "peer": None,
        "ratio_to_peer": None,
        "notes": (
            f"every rule over the stack's {first['evaluated']} custom resources, as `fleetheal render --policy` "
            f"runs them (offline, no engine); synthesis excluded; {first['violations']} violation(s) ({found}); "
            f"process peak RSS {statistics.median(r['peak_rss_mb'] for r in results):.0f} MB"
        ),
    }


@contextlib.contextmanager
def _control_plane(where: Path, nodes: list[str]) -> Iterator[Any]:
    from concurrent.futures import ThreadPoolExecutor

    from fleetheal.lab import controlplane

    with controlplane.KubeControlPlane(where, controller_manager=False) as cp:
        cp.install_crds(p for p in controlplane.default_crds(SHARED) if "slinky" not in p.parts)
        chunks = [nodes[i::8] for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(cp.add_nodes, chunks))
        yield cp


def _engine_missing() -> list[str]:
    from fleetheal.infra import engine
    from fleetheal.lab import controlplane

    bin_dir = controlplane.tools_dir()
    missing = [b for b in (*controlplane.BINARIES, *engine.BINARIES) if not os.access(bin_dir / b, os.X_OK)]
    if not (SHARED / "schemas").is_dir():
        missing.append(f"{SHARED}/schemas (the Kueue and prometheus-operator CRDs)")
    return [f"{m} missing (run `make tools`)" for m in missing]


def _engine_run(variant: str) -> dict[str, Any]:
    values = _values(POOLS, ENGINE_NODES)
    nodes = [n for p in values["gpuPools"] for n in (*p["nodeNames"], *p["standbyNodeNames"])]
    nodes.append(_values(POOLS, ENGINE_NODES, move_one=True)["gpuPools"][1]["nodeNames"][-1])
    assert len(set(nodes)) == len(nodes) - 1  # the moved node exists already
    with tempfile.TemporaryDirectory(prefix="fleetheal-bench-engine-") as tmp:
        root = Path(tmp)
        try:
            with _control_plane(root / "kube", sorted(set(nodes))) as cp:
                result, wall = _spawn(
                    [
                        "engine",
                        variant,
                        str(POOLS),
                        str(ENGINE_NODES),
                        str(cp.kubeconfig),
                        str(root / "backend"),
                        str(PREVIEW_RUNS),
                    ],
                    ENGINE_TIMEOUT_S,
                    env={"FLEETHEAL_BENCH_MARKER": tmp},
                )
        finally:
            _reap(tmp)  # engine plugins left behind by a child that failed or was stopped
    return {**result, "wall_s": wall}


def _engine_figures() -> list[dict[str, Any]]:
    name = f"pulumi preview of a one-node membership change, {ENGINE_NODES:,} nodes (real engine)"
    if os.environ.get("FLEETHEAL_BENCH_ENGINE", "1") == "0":
        missing = ["FLEETHEAL_BENCH_ENGINE=0 (this part takes ~5 min)"]
    else:
        missing = _engine_missing()
    if missing:
        return [
            {
                "name": name,
                "unit": "s",
                "median": None,
                "p99": None,
                "n": 0,
                "goal": None,
                "peer": None,
                "ratio_to_peer": None,
                "notes": f"skipped: {', '.join(missing)}",
            }
        ]
    new = _engine_run(NEW)
    old = _engine_run(OLD)
    med_new, med_old = statistics.median(new["preview_s"]), statistics.median(old["preview_s"])

    def summary(r: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(r["preview_summary"].items()))

    return [
        {
            "name": name,
            "unit": "s",
            "median": med_new,
            "p99": _pct(new["preview_s"], 0.99),
            "n": len(new["preview_s"]),
            "goal": None,
            "peer": med_old,
            "ratio_to_peer": med_new / med_old,
            "notes": (
                f"real pulumi CLI + pulumi-resource-kubernetes (make tools) against a local kube-apiserver with "
                f"{ENGINE_NODES:,} Nodes, awaitReadiness=false, file backend; pool00's last active node moved to "
                f"pool01; engine.preview timed whole (Automation API config set + preview). "
                f"ConfigMaps: {summary(new)}. "
                f"Peer, per-node NodePatches on its own control plane: {summary(old)}"
            ),
        },
        {
            "name": f"pulumi up of the whole stack, {ENGINE_NODES:,} nodes (real engine)",
            "unit": "s",
            "median": new["up_s"],
            "p99": new["up_s"],
            "n": 1,
            "goal": None,
            "peer": old["up_s"],
            "ratio_to_peer": new["up_s"] / old["up_s"],
            "notes": (
                f"first `up` into an empty control plane: {new['up_changes']:,} resource operations "
                f"(peer: {old['up_changes']:,}); child process peak RSS {new['peak_rss_mb']:.0f} MB "
                f"(peer {old['peak_rss_mb']:.0f} MB; the pulumi CLI and provider not included)"
            ),
        },
    ]


def run() -> list[dict[str, Any]]:
    figures = _figures(_synth_runs())
    figures.append(_policy_figure())
    figures.extend(_engine_figures())
    return figures


def _main(argv: list[str], run_all: Callable[[], list[dict[str, Any]]]) -> None:
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return
    for fig in run_all():
        print(json.dumps(fig))


if __name__ == "__main__":
    _main(sys.argv[1:], run)
