"""Firing alerts that are already over never act (issue 46): one that arrives after its own resolution
(Alertmanager retries and reorders deliveries, and its replicas send each their own), and one whose endsAt
is past (a replayed or delayed delivery). Real HTTP requests to the service (aiohttp's test server)."""

from __future__ import annotations

import logging
import time

from fleetheal.remediator import alerts
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, with_client

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def at(ts: float) -> str:
    """An RFC 3339 time as Alertmanager writes it."""
    return alerts.format_time(alerts.dt.datetime.fromtimestamp(ts, alerts.dt.UTC))


async def post(client, *raw):
    resp = await client.post("/webhook", data=body(*raw), headers=AUTH)
    assert resp.status == 202, await resp.text()
    return await resp.json()


def counted(text: str, result: str) -> float:
    line = f'fleetheal_remediator_alerts_total{{result="{result}"}} '
    found = [float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line)]
    return found[0] if found else 0.0


def test_a_firing_alert_that_arrives_after_its_own_resolution_does_not_act(cfg, caplog):
    now = time.time()
    starts = at(now - 600)
    resolved = alert(node="gpu-001", status="resolved", starts_at=starts) | {"endsAt": at(now - 60)}
    firing = alert(node="gpu-001", starts_at=starts)
    runner = RecordingRunner()

    async def first(client, service):
        doc = await post(client, resolved)  # the resolution overtook its firing alert
        assert doc["resolved_unknown"] == 1 and doc["created"] == []
        with caplog.at_level(logging.WARNING, "fleetheal.remediator"):
            doc = await post(client, firing)
        assert (doc["created"], doc["already_resolved"], doc["stale"]) == ([], 1, 0), doc
        assert any("already resolved" in getattr(r, "reason", "") for r in caplog.records)
        again = await post(client, firing)  # Alertmanager's retry, or the other replica's delivery
        assert (again["created"], again["already_resolved"]) == ([], 1)
        await service.engine.wait_idle()
        assert service.store.incidents() == []
        assert counted(await (await client.get("/metrics")).text(), "already_resolved") == 2.0

    with_client(cfg, first, runner)

    async def after_restart(client, service):
        # Remembered in the store: a restart between the two deliveries changes nothing.
        doc = await post(client, firing)
        assert (doc["created"], doc["already_resolved"]) == ([], 1)
        # The same alert firing again later has another start: a new fault, acted on.
        doc = await post(client, alert(node="gpu-001", starts_at=at(now - 30)))
        assert doc["created"] == ["inc-000001"] and doc["already_resolved"] == 0
        await service.engine.wait_idle()
        assert service.store.get(1).state == "done"

    with_client(cfg, after_restart, runner)
    assert [r.incident_id for r in runner.requests] == [1]


def test_a_resolution_whose_end_is_still_ahead_resolves_the_incident_of_its_firing_alert(cfg):
    """The resolution came first but its end is not past yet by this clock (clocks apart): the firing alert
    makes its incident, resolved at once, as if the two had come in order; the gate then finds the alert
    resolved before anything ran, and nothing runs."""
    now = time.time()
    starts = at(now - 600)
    runner = RecordingRunner()

    async def scenario(client, service):
        resolved = alert(node="gpu-002", status="resolved", starts_at=starts) | {"endsAt": at(now + 120)}
        assert (await post(client, resolved))["resolved_unknown"] == 1
        doc = await post(client, alert(node="gpu-002", starts_at=starts))
        assert (doc["created"], doc["resolved"], doc["already_resolved"]) == (["inc-000001"], ["inc-000001"], 0)
        await service.engine.wait_idle()
        inc = service.store.get(1)
        assert inc.resolved_at is not None and inc.ends_at_ts == alerts.parse_time(at(now + 120)).timestamp()
        assert [e.kind for e in service.store.events(1)].count("resolved") == 1
        assert (inc.state, inc.decision) == ("done", "deny")
        again = await post(client, alert(node="gpu-002", starts_at=starts))  # the firing alert once more
        assert (again["duplicates"], again["already_resolved"]) == (1, 0)

    with_client(cfg, scenario, runner)
    assert runner.requests == []


def test_a_firing_alert_whose_end_is_past_is_stale_and_does_not_act(cfg, caplog):
    now = time.time()
    runner = RecordingRunner()

    async def scenario(client, service):
        stale = alert(node="gpu-003", starts_at=at(now - 900)) | {"endsAt": at(now - 300)}
        with caplog.at_level(logging.WARNING, "fleetheal.remediator"):
            doc = await post(client, stale)
        assert (doc["created"], doc["stale"], doc["duplicates"]) == ([], 1, 0), doc
        (record,) = [r for r in caplog.records if r.getMessage() == "webhook: firing alert not acted on"]
        assert record.reason.startswith("stale: its endsAt") and record.node == "gpu-003"
        await service.engine.wait_idle()
        assert service.store.incidents() == []
        assert counted(await (await client.get("/metrics")).text(), "stale") == 1.0
        # An end still ahead (a sender that sets one, resolve_timeout on) and the zero time both act.
        ahead = alert(node="gpu-004", starts_at=at(now - 900)) | {"endsAt": at(now + 300)}
        assert (await post(client, ahead))["created"] == ["inc-000001"]
        # (a fault that isolates nothing: the budget holds a second isolation)
        zero = alert(node="gpu-005", fault_id="nccl-timeout", job_id="4242", starts_at=at(now - 900))
        assert (await post(client, zero))["created"] == ["inc-000002"]
        await service.engine.wait_idle()

    with_client(cfg, scenario, runner)
    assert sorted(r.incident_id for r in runner.requests) == [1, 2]
