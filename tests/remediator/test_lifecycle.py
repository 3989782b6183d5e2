"""The node lifecycle in the remediator, with a recording runner (tests/ansible/test_lifecycle.py runs it on
real Slurm, the real API server and the real playbooks): the operators' node API and its attack surface,
the gate's check on follow-ups, lemon counting and the reports."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fleetheal.remediator.app import Service
from fleetheal.remediator.config import ConfigError
from fleetheal.remediator.store import FollowUp
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config

OPERATOR = "operator-token-0123456789abcdef"
REPAIRED = "/api/v1/nodes/{}/repaired"


def _cfg(tmp_path: Path, operator: str | None = OPERATOR, **sections):
    auth = {}
    if operator is not None:
        (tmp_path / "operator").write_text(operator + "\n")
        auth["operator_token_file"] = str(tmp_path / "operator")
    return make_config(
        tmp_path, auth=auth, lifecycle={"report_dir": str(tmp_path / "lifecycle"), "standby_target": 1}, **sections
    )


def _run(cfg, scenario, runner=None):
    async def main():
        service = Service(cfg, runner=runner or RecordingRunner())
        async with TestClient(TestServer(service.app())) as client:
            await scenario(client, service)

    asyncio.run(main())


async def _isolated(client, service, node="gpu-001", **labels):
    """An Xid 79 on `node`, isolated by the (recorded) playbook: the node then awaits repair."""
    resp = await client.post("/webhook", data=body(alert(node=node, fault_id="xid-79", **labels)), headers=_auth(TOKEN))
    assert resp.status == 202
    await service.engine.wait_idle()
    assert service.store.node_state(node).state == "awaiting_repair", service.store.node_history(node)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_reported_repair_starts_one_revalidation(tmp_path):
    runner = RecordingRunner()

    async def scenario(client, service):
        await _isolated(client, service)
        (request,) = (tmp_path / "lifecycle").glob("repair-gpu-001-*.json")
        doc = json.loads(request.read_text())
        assert (doc["kind"], doc["node"], doc["fault_id"]) == ("repair_request", "gpu-001", "xid-79")
        assert "fleetheal nodes repaired gpu-001" in doc["report_done"]

        resp = await client.post(REPAIRED.format("gpu-001"), json={"by": "tech-7"}, headers=_auth(OPERATOR))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["state"] == "revalidating"
        # The same report again (a retry, a second technician) starts nothing more.
        again = await client.post(REPAIRED.format("gpu-001"), headers=_auth(OPERATOR))
        assert again.status == 409
        assert "revalidating, not awaiting repair" in (await again.json())["error"]
        await service.engine.wait_idle()
        revalidations = [r for r in runner.requests if r.action == "REVALIDATE"]
        assert len(revalidations) == 1 and revalidations[0].extravars["fleetheal_fault_id"] == "xid-79"
        (follow_up,) = [i for i in service.store.incidents() if i.action == "REVALIDATE"]
        assert follow_up.parent_id is not None and follow_up.state == "done"
        audit = [a for a in service.store.audit_log() if a["decision"] == "repaired"]
        assert audit[0]["facts"]["by"] == "tech-7"

    _run(_cfg(tmp_path), scenario, runner)


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), (_auth(TOKEN), 401), (_auth(OPERATOR + "x"), 401), ({"Authorization": f"Basic {OPERATOR}"}, 401)],
)
def test_the_node_api_wants_the_operators_token_and_never_alertmanagers(tmp_path, headers, status):
    """Alertmanager's token (whoever can send alerts) cannot report a repair."""

    async def scenario(client, service):
        await _isolated(client, service)
        resp = await client.post(REPAIRED.format("gpu-001"), headers=headers)
        assert resp.status == status
        assert service.store.node_state("gpu-001").state == "awaiting_repair"

    _run(_cfg(tmp_path), scenario)


def test_without_an_operator_token_the_node_api_is_off(tmp_path):
    async def scenario(client, service):
        resp = await client.post(REPAIRED.format("gpu-001"), headers=_auth(TOKEN))
        assert resp.status == 403 and "operator_token_file" in (await resp.json())["error"]

    _run(_cfg(tmp_path, operator=None), scenario)


@pytest.mark.parametrize(("token", "why"), [(TOKEN, "different from the webhook's"), ("short", "at least 16")])
def test_an_unusable_operator_token_stops_the_start(tmp_path, token, why):
    with pytest.raises(ConfigError, match=why):
        Service(_cfg(tmp_path, operator=token), runner=RecordingRunner())


@pytest.mark.parametrize("node", ["gpu-002", "gpu-999", "..%2F..%2Fetc"])
def test_a_repair_for_a_node_that_awaits_none_is_refused(tmp_path, node):
    async def scenario(client, service):
        await _isolated(client, service)
        resp = await client.post(REPAIRED.format(node), headers=_auth(OPERATOR))
        assert resp.status in (404, 409)
        assert [i.action for i in service.store.incidents()] == ["ISOLATE_AND_RELOCATE"]

    _run(_cfg(tmp_path), scenario)


def test_a_follow_up_for_a_node_not_in_its_state_is_denied_by_the_gate(tmp_path):
    """REJOIN runs only on a node in the standby pool: one started for a node that awaits repair (a bug, or
    someone writing to the database) is denied and runs nothing."""
    runner = RecordingRunner()

    async def scenario(client, service):
        await _isolated(client, service)
        root = service.store.get(service.store.node_state("gpu-001").incident_id)
        moved = service.store.transition(
            "gpu-001", "awaiting_repair", "forged", root.id, follow_up=FollowUp(root, "REJOIN")
        )
        service.engine.submit([moved[1]])
        await service.engine.wait_idle()
        forged = service.store.get(moved[1])
        assert (forged.state, forged.decision) == ("done", "deny")
        assert "REJOIN runs on a node that is standby; gpu-001 is awaiting_repair" in forged.outcome
        assert [r.action for r in runner.requests] == ["ISOLATE_AND_RELOCATE"]

    _run(_cfg(tmp_path), scenario, runner)


def test_three_failures_make_a_lemon_and_one_failure_raising_several_alerts_counts_once(tmp_path):
    async def scenario(client, service):
        await _isolated(client, service, gpu="3")
        # The same GPU's other readings of that failure (within a minute) do not make it a lemon...
        await client.post(
            "/webhook",
            data=body(
                alert(node="gpu-001", gpu="3", fault_id="gpu-lost"), alert(node="gpu-001", gpu="3", fault_id="xid-48")
            ),
            headers=_auth(TOKEN),
        )
        await service.engine.wait_idle()
        assert service.store.node_state("gpu-001").state == "awaiting_repair"
        # ...two more GPUs failing do.
        await client.post(
            "/webhook",
            data=body(
                alert(node="gpu-001", gpu="5", fault_id="xid-48"), alert(node="gpu-001", gpu="6", fault_id="xid-95")
            ),
            headers=_auth(TOKEN),
        )
        await service.engine.wait_idle()
        assert service.store.node_state("gpu-001").state == "quarantined"
        (rma,) = [json.loads(p.read_text()) for p in (tmp_path / "lifecycle").glob("rma-gpu-001-*.json")]
        assert rma["reason"].startswith("lemon: 3 GPU failures")
        assert rma["faults"]["failures"] == 3 and rma["faults"]["count"] == 5
        assert rma["faults"]["per_gpu"] == {"3": 3, "5": 1, "6": 1}
        # Nothing more runs on it, and a repair report is refused: it needs a human's release.
        resp = await client.post(REPAIRED.format("gpu-001"), headers=_auth(OPERATOR))
        assert resp.status == 409

    _run(_cfg(tmp_path), scenario)


def test_nodes_list_and_show_print_the_lifecycle(tmp_path):
    cfg = _cfg(tmp_path)

    async def scenario(client, service):
        await _isolated(client, service)

    _run(cfg, scenario)
    config = tmp_path / "r.yaml"
    config.write_text(
        json.dumps(
            {
                "cluster": {"name": cfg.cluster.name, "nodes": dict(cfg.cluster.nodes)},
                "store": {"path": cfg.store.path},
            }
        )
    )

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "fleetheal", "nodes", *args, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout

    listed = cli("list")
    assert "gpu-001              awaiting_repair" in listed and "gpu-002              active" in listed
    assert json.loads(cli("list", "--state", "awaiting_repair", "--json"))[0]["node"] == "gpu-001"
    shown = cli("show", "gpu-001")
    assert "active -> isolated" in shown and "isolated -> awaiting_repair" in shown
    assert [h["to"] for h in json.loads(cli("show", "gpu-001", "--json"))["history"]] == ["isolated", "awaiting_repair"]


def test_the_repair_request_reaches_the_ticketing_webhook_with_its_token(tmp_path):
    import http.server
    import threading

    got: list[tuple[str, dict]] = []

    class Ticketing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            length = int(self.headers["Content-Length"])
            got.append((self.headers.get("Authorization", ""), json.loads(self.rfile.read(length))))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ticketing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "ticket-token").write_text("ticket-secret-0123456789\n")
    cfg = make_config(
        tmp_path,
        lifecycle={
            "report_dir": str(tmp_path / "lifecycle"),
            "repair_webhook_url": f"http://127.0.0.1:{server.server_address[1]}/tickets",
            "repair_webhook_token_file": str(tmp_path / "ticket-token"),
        },
    )

    async def scenario(client, service):
        await _isolated(client, service)
        for _ in range(1200):  # up to a minute
            if got:
                break
            await asyncio.sleep(0.05)

    try:
        _run(cfg, scenario)
    finally:
        server.shutdown()
    ((auth, doc),) = got
    assert auth == "Bearer ticket-secret-0123456789"
    assert (doc["kind"], doc["node"], doc["fault_id"], doc["cluster"]) == (
        "repair_request",
        "gpu-001",
        "xid-79",
        cfg.cluster.name,
    )


def test_a_lifecycle_step_missed_at_an_incidents_end_is_caught_up(tmp_path, monkeypatch):
    """The incident's end and its lifecycle step are two transactions: a remediator stopped between them (or a
    bug in the step) leaves the node isolated with nothing running; the reconcile takes the step."""
    from fleetheal.remediator import lifecycle

    monkeypatch.setattr(lifecycle, "CATCH_UP_AFTER_S", 0.0)
    real = lifecycle.Lifecycle.finished
    calls: list[int] = []

    def flaky(self, inc):
        calls.append(inc.id)
        if len(calls) == 1:
            raise RuntimeError("stopped here")
        return real(self, inc)

    monkeypatch.setattr(lifecycle.Lifecycle, "finished", flaky)

    async def scenario(client, service):
        resp = await client.post("/webhook", data=body(alert(node="gpu-001", fault_id="xid-79")), headers=_auth(TOKEN))
        assert resp.status == 202
        await service.engine.wait_idle()
        for _ in range(1200):  # up to a minute
            if service.store.node_state("gpu-001").state == "awaiting_repair":
                break
            await asyncio.sleep(0.05)
        assert service.store.node_state("gpu-001").state == "awaiting_repair", service.store.node_history("gpu-001")
        assert [h["to"] for h in service.store.node_history("gpu-001")] == ["isolated", "awaiting_repair"]

    cfg = make_config(tmp_path, lifecycle={"report_dir": str(tmp_path / "lifecycle"), "reconcile_interval_s": 0.1})
    _run(cfg, scenario)
    assert len(calls) >= 2
