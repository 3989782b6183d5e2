"""`fleetheal fleet status` and `fleetheal fleet exporter`: the view built from what Slurm really printed
(tests/fleet/data, captured from the lab federation), the real remediator's /metrics, and the real federation."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fleetheal import procs
from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import render, status, view
from fleetheal.remediator.app import Service
from fleetheal.slurm import fields, gres, jobs, nodes, runner
from fleetheal.wait import wait_until
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config

DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fleet(**remediators: str) -> fleetcfg.FleetConfig:
    """The lab federation's fleet file (clusters a, b: h100; c: a100; two 8-GPU nodes each)."""
    from types import MappingProxyType

    return fleetcfg.FleetConfig(
        federation="fed",
        clusters=MappingProxyType(
            {
                n: fleetcfg.Cluster(gpu_type=t, gpus_per_node=8, remediator_url=remediators.get(n, ""))
                for n, t in (("a", "h100"), ("b", "h100"), ("c", "a100"))
            }
        ),
    )


# --- parsing fields ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("gpu:h100:8(S:0-1)", {"h100": 8}),
        ("gpu:h100:3(IDX:0,2,5)", {"h100": 3}),
        ("gpu:h100:0(IDX:N/A)", {"h100": 0}),
        ("gpu:8", {"x": 8}),
        ("gpu:a100:2,gpu:h100:4(S:0),shard:h100:16", {"a100": 2, "h100": 4}),
        ("(null)", {}),
        ("", {}),
    ],
)
def test_gres_fields_count_gpus_by_type(text: str, want: dict[str, int]) -> None:
    """The GRES forms of Slurm's sinfo(1) `Gres`/`GresUsed`: a comma inside `(IDX:...)` does not split."""
    assert gres.parse_gres(text, default_type="x") == want


def test_tres_gpus() -> None:
    assert gres.tres_gpus("cpu=1,mem=100M,node=1,billing=1,gres/gpu=8") == 8
    assert gres.tres_gpus("cpu=2,node=1,gres/gpu:h100=4") == 4
    assert gres.tres_gpus("cpu=2,node=1,gres/gpu=4,gres/gpu:h100=4") == 4
    assert gres.tres_gpus("cpu=1,mem=100M,node=1") == 0
    assert gres.tres_gpus("") == 0


def test_sections_split_by_cluster() -> None:
    text = "CLUSTER: a\nx1\nx2\n\nCLUSTER: b\n\nCLUSTER: c\ny\n"
    assert fields.sections(text) == {"a": "x1\nx2\n", "b": "", "c": "y\n"}


# --- the view, from what the federation printed (tests/fleet/data) ------------------------------------------


def captured(name: str) -> str:
    path = DATA / name
    if not path.exists():
        pytest.fail(f"{path} is missing: capture it again (tests/fleet/data/README.md)")
    return path.read_text()


def read(tool: str, scene: str) -> runner.Read:
    """A captured read as `run_read` returns it: the output, and the first error line when it exited non-zero."""
    meta = json.loads(captured(f"{tool}-{scene}.meta"))
    args = nodes.FLEET_SINFO_ARGS if tool == "sinfo" else jobs.FLEET_SQUEUE_ARGS
    assert meta["argv"] == [tool, *args], "the arguments changed since the capture: capture again"
    first = next((ln for ln in meta["stderr"].splitlines() if ln.strip()), "")
    return runner.Read(captured(f"{tool}-{scene}.txt"), first if meta["rc"] else "")


def view_of(scene: str, **remediators: view.Remediator) -> view.FleetStatus:
    urls = {n: r.url for n, r in remediators.items()}
    return view.build(fleet(**urls), read("sinfo", scene), read("squeue", scene), remediators, duration_s=0.25)


def test_the_view_of_a_busy_federation() -> None:
    """An 8-GPU job runs on a and one on b; a 16-GPU job is pending on a only, another on a and b (README.md)."""
    st = view_of("busy")
    a, b, c = st.clusters
    assert [x.up for x in st.clusters] == [True, True, True]
    assert a.gpus == {"h100": view.Gpus(allocated=8, free=8, unavailable=0)} == b.gpus
    assert c.gpus == {"a100": view.Gpus(allocated=0, free=16, unavailable=0)}
    assert a.nodes == {"idle": 1, "mixed": 1, "allocated": 0, "drained": 0, "down": 0, "other": 0}
    assert c.nodes["idle"] == 2
    assert a.queue == view.Queue(pending=2, running=1, pending_gpus=32, running_gpus=8)
    assert b.queue == view.Queue(pending=1, running=1, pending_gpus=16, running_gpus=8)
    assert c.queue == view.Queue()
    assert a.queue_by_qos == {"large": view.Queue(2, 0, 32, 0), "small": view.Queue(0, 1, 0, 8)}
    assert c.queue_by_qos == {"large": view.Queue(), "small": view.Queue()}
    doc = st.as_dict()
    # The federated job pending on a and b counts once in the fleet.
    assert doc["total"]["queue"] == {"pending": 2, "running": 2, "pending_gpus": 32, "running_gpus": 16}
    assert doc["total"]["queue_by_qos"]["large"] == {"pending": 2, "running": 0, "pending_gpus": 32, "running_gpus": 0}
    assert doc["total"]["gpus"] == {
        "a100": {"total": 16, "free": 16, "allocated": 0, "unavailable": 0},
        "h100": {"total": 32, "free": 16, "allocated": 16, "unavailable": 0},
    }
    assert doc["total"]["nodes"] == {"idle": 4, "mixed": 2, "allocated": 0, "drained": 0, "down": 0, "other": 0}
    assert doc["total"]["clusters_up"] == 3 and doc["total"]["standby_nodes"] is None
    assert doc["clusters"][0]["remediator"] is None
    assert json.loads(json.dumps(doc)) == doc
    lines = render.table(st).splitlines()
    assert lines[0].split()[:2] == ["CLUSTER", "STATE"] and len(lines) == 5
    row = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert row["a"] == ["a", "up", "h100", "8/16", "1/1/0/0/0", "2/1", "32", "large", "2/0", "small", "0/1", "-", "-"]
    assert row["c"][2:4] == ["a100", "16/16"]
    assert row["fleet"] == [
        "fleet", "3/3", "up", "a100", "16/16", "h100", "16/32", "4/2/0/0/0", "2/2", "32", "large", "2/0", "small", "0/2", "-", "-",
    ]  # fmt: skip


def test_a_cluster_missing_from_the_answer_is_unreachable_and_the_others_show() -> None:
    """Cluster c's slurmctld stopped: `-M all` leaves it out (and exits 0)."""
    st = view_of("c-down")
    assert [x.up for x in st.clusters] == [True, True, False]
    a, _, c = st.clusters
    assert c.error == "not in the answer of sinfo -M all"
    assert a.gpus == {"h100": view.Gpus(8, 8, 0)} and a.queue.pending == 2
    cdoc = c.as_dict()
    assert cdoc["gpus"] is None and cdoc["queue"] is None and cdoc["nodes"] is None
    total = st.as_dict()["total"]
    assert total["clusters_up"] == 2 and "a100" not in total["gpus"] and total["queue"]["running"] == 2
    table = render.table(st)
    assert re.search(r"^c\s+unreachable(\s+-){7}$", table, re.M) and "2/3 up" in table
    assert "c: not in the answer of sinfo -M all" in table
    back = view_of("c-back")
    assert [x.up for x in back.clusters] == [True, True, True]


def test_a_failed_read_makes_every_cluster_it_misses_unreachable() -> None:
    """slurmdbd down: `-M all` answers nothing; the error is shown for every cluster, nothing is raised."""
    st = view.build(fleet(), runner.Read("", "sinfo: error: slurmdbd unreachable"), read("squeue", "busy"))
    assert [(x.up, x.error) for x in st.clusters] == [(False, "sinfo: error: slurmdbd unreachable")] * 3
    assert st.as_dict()["total"]["queue"]["pending"] == 0
    jobs_failed = view.build(fleet(), read("sinfo", "busy"), runner.Read("", "squeue: error: timeout"))
    assert [x.error for x in jobs_failed.clusters] == ["squeue: error: timeout"] * 3


def test_drained_nodes_hold_no_free_gpus() -> None:
    """Node b2 drained: its idle GPUs are `unavailable`, the node counts as drained (fleetheal.slurm.nodes)."""
    b = view_of("drained").clusters[1]
    assert b.nodes["drained"] == 1 and b.nodes["mixed"] == 1
    assert b.gpus == {"h100": view.Gpus(allocated=8, free=0, unavailable=8)}


def test_node_states() -> None:
    from fleetheal.slurm.nodes import Node

    def state(base: str, *flags: str) -> str:
        return nodes.node_state(Node("n", base, frozenset(flags)))

    assert state("IDLE") == "idle" and state("MIXED") == "mixed" and state("ALLOCATED") == "allocated"
    assert state("IDLE", "DRAIN") == "drained" and state("ALLOCATED", "DRAIN") == "drained"
    assert state("DOWN", "DRAIN") == "down" and state("IDLE", "NOT_RESPONDING") == "down"
    assert state("UNKNOWN") == "other" and state("FUTURE") == "other"


# --- the remediator: the real service, its /metrics ----------------------------------------------------------


def test_standby_pool_and_open_incidents_from_the_real_remediator(tmp_path: Path) -> None:
    """The remediator (paused, so an incident stays open at the gate) with one node in the standby pool."""
    cfg = make_config(tmp_path, gate={"paused": True, "recheck_interval_s": 0.05})

    async def main() -> None:
        service = Service(cfg, runner=RecordingRunner())
        async with TestClient(TestServer(service.app(), host="127.0.0.1")) as client:
            url = str(client.make_url("/")).rstrip("/")
            loop = asyncio.get_running_loop()
            before = await loop.run_in_executor(None, view.read_remediator, url)
            assert before == view.Remediator(url, True, standby_nodes=0, open_incidents=0)
            assert (await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)).status == 202
            service.store.transition("gpu-005", "standby", "test: revalidated")

            def held() -> bool:
                return service.store.held_count() == 1

            await loop.run_in_executor(None, lambda: wait_until(held, 10, "the incident held at the paused gate"))
            after = await loop.run_in_executor(None, view.read_remediator, url + "/")
            assert after == view.Remediator(url + "/", True, standby_nodes=1, open_incidents=1)
            # the view and the metrics carry it
            st = view_of("busy", a=after)
            assert st.as_dict()["clusters"][0]["remediator"]["standby_nodes"] == 1
            assert st.as_dict()["total"]["open_incidents"] == 1
            text = scrape(st)
            assert 'fleetheal_fleet_standby_nodes{cluster="a"} 1.0' in text
            assert 'fleetheal_fleet_open_incidents{cluster="a"} 1.0' in text
            assert 'fleetheal_fleet_remediator_up{cluster="a"} 1.0' in text
            wrong = await loop.run_in_executor(None, view.read_remediator, url + "/nowhere")
            assert not wrong.up and wrong.error.startswith("HTTP 404")

    asyncio.run(main())


def test_gpu_pools_by_use_from_the_remediators_lending_rounds(tmp_path: Path) -> None:
    """The lending controller's view of the pools (issue 47), through the remediator's /metrics to the table."""
    from fleetheal.remediator.metrics import Metrics
    from fleetheal.remediator.store import Store

    store = Store(str(tmp_path / "s.db"))
    try:
        metrics = Metrics(store)
        uses = {("h100", "training"): [5, 40], ("h100", "inference"): [2, 16], ("h100", "standby"): [1, 8]}
        metrics.lending_round(uses, lent=2, reclaimed=0)
        metrics.lending_round({**uses, ("a100", "idle"): [4, 32]}, lent=0, reclaimed=1)
        text = metrics.render().decode()
    finally:
        store.close()
    assert 'fleetheal_remediator_lending_total{result="lent"} 2.0' in text
    pools = view.remediator_pools(text)
    assert pools == {
        "a100": {"idle": (4, 32)},
        "h100": {"inference": (2, 16), "standby": (1, 8), "training": (5, 40)},
    }
    st = view_of("busy", a=view.Remediator("http://r", True, 1, 0, gpu_pools=pools))
    assert st.as_dict()["clusters"][0]["remediator"]["gpu_pools"]["h100"]["inference"] == {"nodes": 2, "gpus": 16}
    lines = render.table(st).splitlines()
    at = lines.index("GPU pools, nodes/GPUs by use:")
    assert lines[at + 1].split() == ["CLUSTER", "GPU", "POOL", "TRAINING", "INFERENCE", "LENT", "IDLE", "STANDBY",
                                     "REPAIR", "UNAVAILABLE"]  # fmt: skip
    assert lines[at + 2].split() == ["a", "a100", "0/0", "0/0", "0/0", "4/32", "0/0", "0/0", "0/0"]
    assert lines[at + 3].split() == ["a", "h100", "5/40", "2/16", "0/0", "0/0", "1/8", "0/0", "0/0"]
    assert "GPU pools" not in render.table(view_of("busy"))  # no remediator lends: no section


def test_a_remediator_that_does_not_answer_shows_a_question_mark() -> None:
    (port,) = procs.free_ports(1)
    url = f"http://127.0.0.1:{port}"
    rem = view.read_remediator(url, timeout=2)
    assert not rem.up and rem.standby_nodes is None and "refused" in rem.error.lower()
    st = view_of("busy", a=rem)
    row = next(ln for ln in render.table(st).splitlines() if ln.startswith("a "))
    assert row.split()[-2:] == ["?", "?"]
    assert f"a: remediator: {rem.error}" in render.table(st)
    assert 'fleetheal_fleet_remediator_up{cluster="a"} 0.0' in scrape(st)
    assert "fleetheal_fleet_standby_nodes{" not in scrape(st)


# --- the metrics ---------------------------------------------------------------------------------------------


def scrape(st: view.FleetStatus) -> str:
    from prometheus_client import generate_latest

    return generate_latest(render.registry(lambda: st)).decode()


def test_the_metrics_of_a_view_and_that_every_one_is_documented() -> None:
    text = scrape(view_of("busy"))
    for line in (
        'fleetheal_fleet_cluster_up{cluster="a"} 1.0',
        'fleetheal_fleet_gpus{cluster="a",gpu_type="h100",state="allocated"} 8.0',
        'fleetheal_fleet_gpus{cluster="a",gpu_type="h100",state="free"} 8.0',
        'fleetheal_fleet_gpus{cluster="c",gpu_type="a100",state="free"} 16.0',
        'fleetheal_fleet_nodes{cluster="c",state="idle"} 2.0',
        'fleetheal_fleet_nodes{cluster="b",state="mixed"} 1.0',
        'fleetheal_fleet_jobs{cluster="a",qos="large",state="pending"} 2.0',
        'fleetheal_fleet_jobs{cluster="b",qos="small",state="running"} 1.0',
        'fleetheal_fleet_jobs{cluster="c",qos="large",state="pending"} 0.0',
        'fleetheal_fleet_job_gpus{cluster="a",qos="large",state="pending"} 32.0',
    ):
        assert line in text, line
    assert 'fleetheal_fleet_job_gpus{cluster="a",qos="small",state="running"} 8.0' in text
    names = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE fleetheal_fleet")}
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert not sorted(n for n in names if f"`{n}`" not in doc)
    dashboard = json.loads((REPO / "docs" / "grafana" / "fleetheal.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    assert "fleetheal_fleet_gpus" in exprs and "fleetheal_fleet_jobs" in exprs


def test_usage_errors(tmp_path: Path) -> None:
    import argparse

    from fleetheal.errors import UsageError

    with pytest.raises(argparse.ArgumentTypeError):
        status._listen("9106")
    with pytest.raises(argparse.ArgumentTypeError):
        status._listen("127.0.0.1:99999")
    assert status._listen("[::1]:9106") == ("::1", 9106)
    with pytest.raises(UsageError, match=r"nope\.yaml"):
        status._config(argparse.Namespace(fleet=str(tmp_path / "nope.yaml")))


# --- the real federation ----------------------------------------------------------------------------------------


def _fleet_cmd(*args: str) -> list[str]:
    """`fleetheal fleet ...` through this module's own `register()` (the parser path fleetheal.cli uses)."""
    code = (
        "import argparse, sys\n"
        "from fleetheal.fleet import status\n"
        "p = argparse.ArgumentParser(prog='fleetheal')\n"
        "status.register(p.add_subparsers(dest='command', required=True))\n"
        "a = p.parse_args(sys.argv[1:])\n"
        "sys.exit(a.func(a))\n"
    )
    return [sys.executable, "-c", code, "fleet", *args]


def _write_fleet(tmp_path: Path, cfg: fleetcfg.FleetConfig) -> Path:
    doc = {
        "federation": cfg.federation,
        "clusters": {n: {"gpu_type": c.gpu_type, "gpus_per_node": c.gpus_per_node} for n, c in cfg.clusters.items()},
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_status_and_exporter_on_the_real_federation(federation, tmp_path: Path) -> None:
    """A job on a, another pending there; the command's JSON, the exporter's /metrics; c drops out and back."""
    fed = federation
    cfg = fed.fleet_config()
    fleet_file = _write_fleet(tmp_path, cfg)
    a = fed.clusters["a"]
    running = a.sbatch("#!/bin/sh\nsleep 300\n", "--gres=gpu:8", "-M", "a")
    pending = ""

    def a_busy() -> view.FleetStatus | None:
        st = view.collect(cfg, env=fed.env)
        q = st.clusters[0].queue
        return st if st.clusters[0].up and (q.running, q.pending) == (1, 1) else None

    def all_up() -> view.FleetStatus | None:
        st = view.collect(cfg, env=fed.env)
        return st if all(c.up for c in st.clusters) else None

    try:
        # JOBSIZE priority would start the 2-node job first if both waited: submit it once the first runs.
        wait_until(lambda: "RUNNING" in a.squeue("-h", "-j", running, "-o", "%T"), 30, "the first job running")
        pending = a.sbatch("#!/bin/sh\nsleep 300\n", "--gres=gpu:8", "-N", "2", "-M", "a")
        st = wait_until(a_busy, 30, "one job running and one pending on cluster a")
        sa = st.clusters[0]
        assert sa.gpus == {"h100": view.Gpus(allocated=8, free=8, unavailable=0)}
        assert sa.queue.pending_gpus == 16 and sa.nodes["mixed"] + sa.nodes["allocated"] == 1
        assert st.clusters[2].gpus == {"a100": view.Gpus(0, 16, 0)}
        # The command line: JSON and the table
        out = subprocess.run(
            _fleet_cmd("status", "--fleet", str(fleet_file), "--json"), env=fed.env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert [c["up"] for c in doc["clusters"]] == [True, True, True]
        assert doc["clusters"][0]["queue"] == {"pending": 1, "running": 1, "pending_gpus": 16, "running_gpus": 8}
        assert doc["total"]["gpus"]["h100"] == {"total": 32, "free": 24, "allocated": 8, "unavailable": 0}
        out = subprocess.run(
            _fleet_cmd("status", "--fleet", str(fleet_file)), env=fed.env, capture_output=True, text=True
        )
        assert out.returncode == 0 and re.search(r"^a\s+up\s+h100 8/16\s", out.stdout, re.M), out.stdout + out.stderr
        # The exporter
        (port,) = procs.free_ports(1)
        proc = subprocess.Popen(
            _fleet_cmd("exporter", "--fleet", str(fleet_file), "--listen", f"127.0.0.1:{port}"),
            env=fed.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:

            def scraped() -> str:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    return str(r.read().decode())

            text = wait_until(scraped, 30, "the exporter's /metrics", ignore=(OSError,))
        finally:
            proc.send_signal(signal.SIGTERM)
            log = proc.communicate(timeout=15)[0]
        assert proc.returncode == 0, log
        assert [json.loads(ln)["msg"] for ln in log.splitlines()] == [
            "fleet exporter listening",
            "fleet exporter stopping",
        ]
        for line in (
            'fleetheal_fleet_cluster_up{cluster="c"} 1.0',
            'fleetheal_fleet_gpus{cluster="a",gpu_type="h100",state="allocated"} 8.0',
            'fleetheal_fleet_gpus{cluster="c",gpu_type="a100",state="free"} 16.0',
        ):
            assert line in text, line
        assert re.search(r'fleetheal_fleet_jobs\{cluster="a",qos="\w+",state="pending"\} 1\.0', text)
        # Cluster c drops out: shown unreachable, the others still shown
        fed.drop("c")
        try:
            st = view.collect(cfg, env=fed.env)
            assert [c.up for c in st.clusters] == [True, True, False]
            assert st.clusters[2].error and st.clusters[0].gpus["h100"].allocated == 8
            assert re.search(r"^c\s+unreachable", render.table(st), re.M)
        finally:
            fed.rejoin("c")
        back = wait_until(all_up, 60, "cluster c back in the view")
        assert back.clusters[2].gpus["a100"].total == 16
    finally:
        a.run("scancel", "-M", "a", *(j for j in (running, pending) if j), check=False)
