"""Chaos: a dependency fails in the middle of a remediation.

The real remediator service (in process: webhook, engine, first responder, ansible-runner and the real
playbooks) against a real private Slurm. Each test breaks one dependency while an incident is being
remediated and checks what the issue asks: nothing lost, nothing done twice, the incident finishes once
the dependency is back, and the metrics say what was waiting.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator.app import Service
from tests.ansible.conftest import PLAYBOOKS, job_json, node_json, submit_running
from tests.remediator.conftest import TOKEN, alert, body, make_config

pytestmark = pytest.mark.slurm
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: How long each dependency is down (the issue's figure).
OUTAGE_S = 60.0
#: How much longer it stays down when the remediator has not yet said it waits for it: on a loaded machine the
#: first attempt (ansible-playbook, its Slurm commands timing out) can take longer than the outage to fail,
#: and the incident then never waits (CI saw it). The outage lasts until the wait is seen.
OUTAGE_MORE_S = 180.0


@pytest.fixture
def cluster(tmp_path: Path):
    c = SlurmCluster(tmp_path / "slurm", nodes=3, gpus_per_node=2)
    c.start()
    try:
        yield c
    finally:
        c.stop(graceful=False)


def _config(tmp_path: Path, cluster: SlurmCluster, **site_vars: object):
    return make_config(
        tmp_path,
        cluster={"name": "lab", "nodes": {"n1": "rack-0", "n2": "rack-0", "n3": "rack-1"}},
        runner={
            "playbook_dir": str(PLAYBOOKS),
            "run_dir": str(tmp_path / "runs"),
            "backoff_s": 1.0,
            "retries": 2,
            "envvars": {},
            "site_vars": {
                "fleetheal_slurm_env": {"SLURM_CONF": str(cluster.conf_path)},
                "fleetheal_grace_seconds": 1,
                "fleetheal_slurm_retry_delay_s": 1,
                "fleetheal_promote_standby": False,
                "fleetheal_report_dir": str(tmp_path / "reports"),
                **site_vars,
            },
        },
        gate={"budget": {"max_isolated": 1, "max_isolated_per_domain": 1}},
    )


def _run(coro) -> None:
    """Run the scenario on a loop of its own. Not asyncio.run: it leaves the main thread without a current
    event loop, and later tests that ask for one (Pulumi's mocks) fail."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def _metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def _isolation_through_an_outage(cfg, node: str, pid: int, dependency: str) -> None:
    """Stop `pid` (SIGSTOP) for OUTAGE_S (longer until the wait is seen), send an Xid 79 alert for `node`
    meanwhile, resume it, then check that the incident finished once, after waiting for `dependency`, and that
    the metrics said so."""
    gauge = f'fleetheal_remediator_incidents_waiting{{dependency="{dependency}"}}'
    waiting_seen: list[float] = []

    async def main() -> None:
        service = Service(cfg)
        async with TestClient(TestServer(service.app())) as client:
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                resp = await client.post("/webhook", data=body(alert(node=node, fault_id="xid-79")), headers=AUTH)
                assert resp.status == 202
                while (down := time.monotonic() - stopped) < OUTAGE_S or (
                    not waiting_seen and down < OUTAGE_S + OUTAGE_MORE_S
                ):
                    value = _metric(await (await client.get("/metrics")).text(), gauge)
                    if value:
                        waiting_seen.append(value)
                    await asyncio.sleep(1.0)
            finally:
                os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 180
            while service.store.get(1).state not in ("done", "failed"):
                assert time.monotonic() < deadline, [(e.kind, e.detail[:100]) for e in service.store.events(1)][-12:]
                await asyncio.sleep(0.5)
            events = service.store.events(1)
            timeline = "\n".join(f"{e.ts:.1f} {e.kind} {e.detail[:150]}" for e in events)
            inc = service.store.get(1)
            attempts = [s.result for s in service.store.steps(1) if s.name == "playbook"]
            assert _metric(await (await client.get("/metrics")).text(), gauge) == 0
        assert inc.state == "done", timeline
        assert "waiting" in [e.kind for e in events], timeline
        assert attempts[-1] == "successful" and attempts.count("successful") == 1, attempts

    _run(main())
    assert waiting_seen, f"the metrics never said the incident waited for {dependency}"


def test_slurmctld_stopped_for_a_minute_during_an_isolation(cluster: SlurmCluster, tmp_path: Path) -> None:
    job, node = submit_running(cluster)
    ctld = next(pid for pid, cmd in cluster.processes().items() if cmd.split()[0].endswith("/slurmctld"))
    _isolation_through_an_outage(_config(tmp_path, cluster), node, ctld, "slurm")
    # Done once: the node drained for this incident, the job requeued exactly once.
    assert "incident=inc-000001" in node_json(cluster, node)["reason"].split()
    assert job_json(cluster, job)["restart_cnt"] == 1


@pytest.fixture
def kube(tmp_path: Path):
    from fleetheal.lab.controlplane import KubeControlPlane, tools_built, tools_dir

    if not tools_built():
        pytest.fail(f"kube-apiserver and etcd are not built in {tools_dir()}: run `make tools`")
    with KubeControlPlane(tmp_path / "kube", controller_manager=False) as cp:
        yield cp


@pytest.mark.kube
def test_the_api_server_stopped_for_a_minute_during_an_isolation(cluster: SlurmCluster, kube, tmp_path: Path) -> None:
    from kubernetes import client

    from fleetheal import contracts

    kube.add_nodes(["n1", "n2", "n3"], labels={contracts.LABEL_POOL: "active"})
    job, node = submit_running(cluster)
    cfg = _config(tmp_path, cluster, fleetheal_kubeconfig=str(kube.kubeconfig))
    _isolation_through_an_outage(cfg, node, kube.pids["kube-apiserver"], "kubernetes")
    n1 = client.CoreV1Api(kube.client()).read_node(node)
    assert n1.spec.unschedulable
    assert [t.key for t in n1.spec.taints or []].count(contracts.TAINT_UNHEALTHY) == 1
    assert job_json(cluster, job)["restart_cnt"] == 1  # Slurm did its part once, during the outage
