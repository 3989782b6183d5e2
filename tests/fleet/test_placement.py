"""Placement (`fleetheal submit`): the policy on hand-made cluster states, the GPU-request parser, the state
read from what the lab federation's `sinfo -M all` really printed (tests/fleet/data), and, on the real
federation, where submitted jobs really run (`squeue --local` on each controller)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import pytest
import yaml

from fleetheal.contracts import CHECKPOINT_WORD
from fleetheal.errors import UsageError
from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import placement
from fleetheal.fleet.placement_policy import ClusterState, Decision, Job, PlacementError, parse_request, place
from fleetheal.wait import wait_until

if TYPE_CHECKING:
    from fleetheal.lab.federation import Federation

DATA = Path(__file__).resolve().parent / "data"
TYPES = {"a": "h100", "b": "h100", "c": "a100"}


def fleet(
    datasets: dict[str, tuple[float, tuple[str, ...]]] | None = None, **placement_opts: object
) -> fleetcfg.FleetConfig:
    """The lab federation's fleet file: a, b h100 and c a100, two 8-GPU nodes each, with `datasets`."""
    return fleetcfg.FleetConfig(
        federation="fed",
        clusters=MappingProxyType({n: fleetcfg.Cluster(gpu_type=t, gpus_per_node=8) for n, t in TYPES.items()}),
        datasets=MappingProxyType(
            {n: fleetcfg.Dataset(size_gb=s, clusters=c) for n, (s, c) in (datasets or {}).items()}
        ),
        placement=fleetcfg.Placement(**placement_opts),  # type: ignore[arg-type]
    )


def state(name: str, *free: int, data: Sequence[str] = (), up: bool = True) -> ClusterState:
    """Cluster `name` whose nodes have `free` GPUs free (8 per node)."""
    return ClusterState(
        name=name,
        gpu_type=TYPES.get(name, "h100"),
        gpus_per_node=8,
        free_by_node={f"{name}{i + 1}": f for i, f in enumerate(free)},
        total_gpus=8 * len(free),
        datasets=frozenset(data),
        up=up,
    )


# --- the policy ----------------------------------------------------------------------------------------------


def test_small_jobs_are_packed_onto_the_busiest_cluster_that_fits() -> None:
    states = [state("a", 8, 8), state("b", 2, 8), state("c", 8, 8)]
    d = place(Job(gpus=2), states, fleet())
    assert d.clusters == ("b",) and d.start_now
    # 4 GPUs do not fit b's partly used node but fit its other one: b is still the busiest that fits.
    d4 = place(Job(gpus=4), [state("a", 8, 8), state("b", 2, 8)], fleet())
    assert d4.clusters == ("b",)
    # When the busiest cannot take it, the next busiest that can.
    d8 = place(Job(gpus=4), [state("a", 8, 6), state("b", 2, 3), state("c", 8, 8)], fleet())
    assert d8.clusters == ("a",)


def test_large_jobs_go_where_whole_nodes_are_free_and_small_ones_keep_them_whole() -> None:
    states = [state("a", 8, 4), state("b", 8, 8), state("c", 8, 8)]
    assert place(Job(gpus=16), states, fleet()).clusters == ("b",)  # a has one whole node, b two (c too: name)
    # A large job takes the cluster whose whole free nodes are just enough, keeping the other's for later.
    big = [state("a", 8, 8, 8, 8), state("b", 8, 8, 0, 0)]
    assert place(Job(gpus=16), big, fleet()).clusters == ("b",)
    # 12 GPUs on two nodes need 6 free on each: a has one such node, b two.
    assert place(Job(gpus=12, nodes=2), [state("a", 8, 4), state("b", 6, 7)], fleet()).clusters == ("b",)


def test_the_gpu_type_is_strict() -> None:
    states = [state("a", 8, 8), state("b", 8, 8), state("c", 1, 8)]
    assert place(Job(gpus=2, gpu_type="a100"), states, fleet()).clusters == ("c",)
    # c is full: the job waits for c rather than running on an idle h100 cluster.
    full_c = [state("a", 8, 8), state("b", 8, 8), state("c", 0, 0)]
    d = place(Job(gpus=2, gpu_type="a100"), full_c, fleet())
    assert d.clusters == ("c",) and not d.start_now
    with pytest.raises(PlacementError, match="no cluster has GPU type 'v100'"):
        place(Job(gpus=2, gpu_type="v100"), states, fleet())


def test_a_job_goes_where_its_data_is() -> None:
    cfg = fleet({"imagenet": (150.0, ("c",)), "wiki": (40.0, ("a", "c"))})
    states = [state("a", 2, 8, data=["wiki"]), state("b", 2, 8), state("c", 8, 8, data=["imagenet", "wiki"])]
    d = place(Job(gpus=2, data=("imagenet",)), states, cfg)
    assert d.clusters == ("c",) and d.start_now and not d.copies
    assert d.constraint == "data-imagenet"
    # Two holders: packed onto the busier one; two datasets: no constraint (Slurm ORs cluster features).
    assert place(Job(gpus=2, data=("wiki",)), states, cfg).clusters == ("a",)
    both = place(Job(gpus=2, data=("wiki", "imagenet")), states, cfg)
    assert both.clusters == ("c",) and both.constraint == ""


def test_when_no_holder_can_start_it_the_cheapest_copy_wins_and_is_named() -> None:
    cfg = fleet({"imagenet": (150.0, ("a",)), "wiki": (40.0, ("b",))}, copy_gb_per_s=2.0)
    states = [state("a", 0, 0, data=["imagenet"]), state("b", 4, 8, data=["wiki"]), state("c", 8, 8)]
    d = place(Job(gpus=4, data=("imagenet", "wiki")), [states[0], states[1]], cfg)
    # a holds imagenet but is full; b lacks only imagenet (75 s at 2 GB/s).
    assert d.clusters == ("b",) and d.start_now
    assert [(c.dataset, c.seconds) for c in d.copies] == [("imagenet", 75.0)]
    assert d.copy_seconds == 75.0
    # c lacks both (95 s), b only imagenet (75 s): b, although c has more room.
    assert place(Job(gpus=4, data=("imagenet", "wiki")), states, cfg).clusters == ("b",)


def test_nothing_fits_now_the_job_waits_on_every_eligible_cluster() -> None:
    states = [state("a", 0, 2), state("b", 1, 0), state("c", 0, 0)]
    d = place(Job(gpus=4), states, fleet())
    assert not d.start_now and set(d.clusters) == {"a", "b", "c"}
    assert d.clusters[0] == "c"  # fewest free first (it is informational: Slurm picks whoever frees first)
    # With data: only the holders, and the constraint tells Slurm too.
    cfg = fleet({"imagenet": (150.0, ("a", "b"))})
    held = [state("a", 0, 2, data=["imagenet"]), state("b", 1, 0, data=["imagenet"]), state("c", 0, 0)]
    dd = place(Job(gpus=4, data=("imagenet",)), held, cfg)
    assert not dd.start_now and set(dd.clusters) == {"a", "b"} and dd.constraint == "data-imagenet"


def test_clusters_that_are_down_or_too_small_are_left_out() -> None:
    states = [state("a", 8, 8, up=False), state("b", 0, 8)]
    assert place(Job(gpus=8), states, fleet()).clusters == ("b",)
    with pytest.raises(PlacementError, match="can hold 24 GPU"):
        place(Job(gpus=24), states, fleet())
    with pytest.raises(PlacementError, match="unknown dataset"):
        place(Job(gpus=1, data=("nope",)), states, fleet())
    with pytest.raises(PlacementError, match="negative"):
        place(Job(gpus=-1), states, fleet())


def test_small_job_size_is_configuration() -> None:
    states = [state("a", 8, 4), state("b", 8, 8)]
    assert place(Job(gpus=4), states, fleet()).clusters == ("a",)  # small: packed
    # With small jobs at most 2 GPUs, 4 GPUs is large: it goes where whole nodes are... a has one, enough.
    assert place(Job(gpus=4), states, fleet(small_job_max_gpus=2)).clusters == ("a",)
    assert place(Job(gpus=16), states, fleet(small_job_max_gpus=2)).clusters == ("b",)


# --- the GPU request ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "gpus", "kind", "nodes"),
    [
        (["--gres=gpu:4", "job.sh"], 4, "", 0),
        (["--gres", "gpu:h100:8", "job.sh"], 8, "h100", 0),
        (["--gres=gpu:a100:2,shard:4", "-N", "2", "job.sh"], 4, "a100", 2),
        (["--gpus=16", "job.sh"], 16, "", 0),
        (["-G", "h100:3", "job.sh", "--gpus=99"], 3, "h100", 0),  # after the script: the script's arguments
        (["-G3", "job.sh"], 3, "", 0),
        (["--nodes=2-4", "--gpus-per-node=8", "job.sh"], 16, "", 2),
        (["-n", "4", "--gpus-per-task=1", "job.sh"], 4, "", 0),
        (["-J", "x", "--wrap", "sleep 1"], 0, "", 0),
        (["--gres=gpu", "job.sh"], 1, "", 0),
    ],
)
def test_gpu_requests_are_read_from_sbatch_arguments(argv: list[str], gpus: int, kind: str, nodes: int) -> None:
    req = parse_request(argv)
    assert (req.gpus, req.gpu_type, req.nodes) == (gpus, kind, nodes)


def test_sbatch_lines_of_the_script_count_and_the_command_line_wins(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n#SBATCH --gres=gpu:h100:8\n#SBATCH -N 2  # two nodes\nsrun true\n#SBATCH -N 9\n")
    req = parse_request([str(script)])
    assert (req.gpus, req.gpu_type, req.nodes, req.script_at) == (16, "h100", 2, 0)
    assert parse_request(["-N", "1", str(script)]).gpus == 8


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--gres=gpu:h100:x", "j.sh"], "must be a number"),
        (["--gpus=lots", "j.sh"], "expected N or TYPE:N"),
        (["-N", "two", "j.sh"], "expected a number"),
    ],
)
def test_bad_requests_are_usage_errors(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_request(argv)


def test_the_sbatch_command_keeps_the_users_arguments() -> None:
    d = Decision(("a", "b"), False, "data-x")
    user = ["--gres=gpu:2", "-J", "train", "job.sh", "--parsable"]
    assert placement.sbatch_argv(d, user) == [
        "sbatch",
        "--clusters=a,b",
        "--cluster-constraint=data-x",
        "--parsable",
        *user,
    ]


# --- the state and the catalogue ---------------------------------------------------------------------------------


def test_cluster_state_from_what_sinfo_printed() -> None:
    cfg = fleet({"imagenet": (150.0, ("b",))})
    states = {s.name: s for s in placement.parse_states((DATA / "sinfo-busy.txt").read_text(), cfg)}
    a, b, c = states["a"], states["b"], states["c"]
    assert (a.free_gpus, a.whole_free_nodes, a.total_gpus, a.busy) == (8, 1, 16, True)
    assert (c.free_gpus, c.whole_free_nodes, c.gpu_type) == (16, 2, "a100")
    assert b.datasets == {"imagenet"}
    down = {s.name: s for s in placement.parse_states((DATA / "sinfo-c-down.txt").read_text(), cfg)}
    assert not down["c"].up and down["a"].up


def test_a_fleet_that_does_not_answer_is_an_error_not_an_empty_fleet(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "SLURM_CONF": str(tmp_path / "missing.conf")}
    with pytest.raises(PlacementError, match="no cluster of the fleet file answered"):
        placement.read_states(fleet(), env=env, timeout=2)  # sinfo retries a missing file


def test_features_keep_what_placement_does_not_own() -> None:
    cfg = fleet({"imagenet": (150.0, ("b",)), "wiki": (1.0, ("b", "c"))})
    current = placement.parse_features("a|fast\nb|data-old,fast\nc|\n")
    assert current == {"a": {"fast"}, "b": {"data-old", "fast"}, "c": set()}
    assert placement.wanted_features(cfg, current) == {
        "a": {"fast"},
        "b": {"fast", "data-imagenet", "data-wiki"},
        "c": {"data-wiki"},
    }


# --- on the real federation --------------------------------------------------------------------------------------


def submit_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """`fleetheal submit ARGV` through its own parser (fleetheal.cli mounts the same `register`)."""
    parser = argparse.ArgumentParser(prog="fleetheal")
    sub = parser.add_subparsers(dest="command", required=True)
    placement.register(sub)
    args = parser.parse_args(["submit", *argv])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    return out.strip(), err


@pytest.fixture
def fed(federation: Federation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Federation]:
    """The session federation as the Slurm clients of `fleetheal submit` see it; every job left is cancelled."""
    monkeypatch.setenv("SLURM_CONF", str(federation.conf_path))
    before = set(federation.active())
    yield federation
    left = sorted(set(federation.active()) - before)
    if left:
        federation.cancel(left)


def fleet_file(tmp_path: Path, fed: Federation, datasets: dict[str, object] | None = None) -> Path:
    doc = {
        "federation": fed.name,
        "clusters": {n: {"gpu_type": fed.gpu_types.get(n, ""), "gpus_per_node": fed.gpus_per_node} for n in fed.names},
        "datasets": datasets or {},
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def script(tmp_path: Path) -> str:
    """A job that sleeps; its `#SBATCH` line keeps Slurm's output file out of the working directory."""
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/sh\n#SBATCH --output=/dev/null\nsleep 600\n")
    return str(path)


def running_on(fed: Federation, job_id: str, timeout: float = 30.0) -> str:
    """The cluster whose controller runs the job (the others hold REVOKED copies)."""

    def where() -> str | None:
        on = [c for c, s in fed.placements().get(job_id, []) if s == "RUNNING"]
        return on[0] if len(on) == 1 else None

    return wait_until(where, timeout, f"job {job_id} running on one cluster", interval=0.3)


def squeue_running(fed: Federation, job_id: str) -> list[str]:
    """The clusters whose section of `squeue -M all -t RUNNING` lists the job."""
    from fleetheal.slurm import fields

    text = fed.squeue("-t", "RUNNING", "-o", "%i")
    return sorted(c for c, lines in fields.sections(text).items() if job_id in lines.split())


def hold(fed: Federation, cluster: str, gpus: int, tmp_path: Path) -> str:
    """A job of `gpus` GPUs running on `cluster`, to make it busy."""
    out = fed.run("sbatch", "--parsable", f"--clusters={cluster}", f"--gres=gpu:{gpus}", script(tmp_path)).stdout
    jid = out.strip().split(";")[0]
    assert running_on(fed, jid) == cluster
    return jid


def test_placement_by_size_on_the_federation(
    fed: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(fleet_file(tmp_path, fed))
    hold(fed, "a", 4, tmp_path)  # a is busy: one whole free node left, 12 GPUs free
    small, why = submit_cli(["--fleet", path, "--explain", "--", "--gres=gpu:2", script(tmp_path)], capsys)
    assert "best fit" in why
    assert running_on(fed, small) == "a"
    # 16 GPUs need two whole nodes: not a (one left); b and c both have two, b by name.
    large, why = submit_cli(["--fleet", path, "--explain", "--", "-N", "2", "--gres=gpu:8", script(tmp_path)], capsys)
    assert "whole free node" in why
    assert running_on(fed, large) == "b"
    # `squeue -M all` agrees: each job is RUNNING in one cluster's section, the one its controller said.
    assert squeue_running(fed, small) == ["a"]
    assert squeue_running(fed, large) == ["b"]


def test_placement_by_gpu_type_on_the_federation(
    fed: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(fleet_file(tmp_path, fed))
    hold(fed, "a", 4, tmp_path)  # a would be the best fit of an untyped small job
    jid, _ = submit_cli(["--fleet", path, "--gpu-type", "a100", "--", "--gres=gpu:2", script(tmp_path)], capsys)
    assert running_on(fed, jid) == "c"
    typed, _ = submit_cli(["--fleet", path, "--", "--gres=gpu:a100:1", script(tmp_path)], capsys)
    assert running_on(fed, typed) == "c"


def test_placement_by_data_on_the_federation(
    fed: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fleet_file(tmp_path, fed, {"imagenet": {"size_gb": 150, "clusters": ["b"]}})
    cfg = fleetcfg.load(path)
    before = placement.parse_features(fed.sacctmgr("-n", "-P", "show", "cluster", "format=cluster,features"))
    try:
        assert placement.sync_features(cfg, env=fed.env) == {"b": {*before.get("b", set()), "data-imagenet"}}
        assert placement.sync_features(cfg, env=fed.env) == {}  # idempotent
        hold(fed, "a", 4, tmp_path)  # a is the busiest, but it has no copy of imagenet
        jid, why = submit_cli(
            ["--fleet", str(path), "--explain", "--data", "imagenet", "--", "--gres=gpu:2", script(tmp_path)], capsys
        )
        assert "held by: b" in why
        assert running_on(fed, jid) == "b"
    finally:
        placement.sync_features(fleetcfg.load(fleet_file(tmp_path, fed)), env=fed.env)
    after = placement.parse_features(fed.sacctmgr("-n", "-P", "show", "cluster", "format=cluster,features"))
    assert after == before


def test_submit_refuses_clusters_chosen_by_the_user(
    fed: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(fleet_file(tmp_path, fed))
    with pytest.raises(UsageError, match="leave --clusters"):
        submit_cli(["--fleet", path, "--", "-M", "a", "--gres=gpu:1", script(tmp_path)], capsys)
    with pytest.raises(UsageError, match="no cluster has GPU type"):
        submit_cli(["--fleet", path, "--gpu-type", "v100", "--", "--gres=gpu:1", script(tmp_path)], capsys)
    assert os.environ["SLURM_CONF"] == str(fed.conf_path)


def test_a_job_that_names_its_checkpoint_store_goes_only_where_it_is_read_and_says_so_in_its_comment(
    fed: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A small job is packed onto a (the busiest), but only b reads the store: it goes to b, and its comment names the store
    (what cross-cluster failover reads). An unknown store and a user comment are refused."""
    path = fed.write_fleet_file(tmp_path / "fleet.yaml", tmp_path / "ckpt", readers=("b",))
    hold(fed, "a", 4, tmp_path)
    jid, _ = submit_cli(
        ["--fleet", str(path), "--checkpoint-store", "shared", "--", "--gres=gpu:8", script(tmp_path)], capsys
    )
    assert running_on(fed, jid) == "b"
    comment = fed.run("squeue", "-M", "b", "-h", "-j", jid, "-o", "%k").stdout.strip()
    assert comment == f"{CHECKPOINT_WORD}shared"
    with pytest.raises(UsageError, match="not a checkpoint store of the fleet file"):
        submit_cli(["--fleet", str(path), "--checkpoint-store", "nope", "--", "--gres=gpu:1", script(tmp_path)], capsys)
    with pytest.raises(UsageError, match="drop --comment"):
        submit_cli(
            [
                "--fleet",
                str(path),
                "--checkpoint-store",
                "shared",
                "--",
                "--comment=x",
                "--gres=gpu:1",
                script(tmp_path),
            ],
            capsys,
        )
