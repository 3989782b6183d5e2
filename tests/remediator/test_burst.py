"""A storm: 1,000 alerts for 200 nodes in one burst, some sent twice, through the real HTTP service.

Isolations never exceed the budget (cluster-wide and per failure domain, checked while the burst runs
and from the audit record afterwards), no incident is duplicated, every alert that did not fit is
queued (never dropped), and the circuit breaker opens and later closes by itself.
"""

from __future__ import annotations

import asyncio
import random
import time

from aiohttp.test_utils import TestClient, TestServer

from fleetheal.remediator.app import Service
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config, nodes

NODES = nodes(200, per_domain=20)  # rack-0 ... rack-9
GPUS = ("0", "1", "2", "3", "4")
BUDGET = 10  # min(max_isolated 10, 5% of 200)
PER_DOMAIN = 2  # min(3, 10% of 20)


def test_a_burst_of_1000_alerts_for_200_nodes_stays_within_budget_and_is_never_duplicated(tmp_path):
    cfg = make_config(
        tmp_path,
        cluster={"name": "lab", "nodes": NODES},
        gate={
            "recheck_interval_s": 0.05,
            "budget": {
                "max_isolated": 10,
                "max_isolated_fraction": 0.05,
                "max_isolated_per_domain": 3,
                "max_isolated_fraction_per_domain": 0.1,
            },
            "breaker": {"storm_nodes": 6, "window_s": 60, "quiet_s": 3.0},
        },
        runner={"max_concurrent": 8},
        webhook={"max_alerts": 1000},
    )
    alerts = [alert(node=n, gpu=g) for n in NODES for g in GPUS]
    assert len(alerts) == 1000
    rng = random.Random(7)
    rng.shuffle(alerts)
    resent = rng.sample(alerts, 150)  # Alertmanager retries and repeats: the same alerts again
    runner = RecordingRunner(delay_s=0.02)
    peak = {"cluster": 0, "domain": 0}

    async def main():
        service = Service(cfg, runner=runner)
        async with TestClient(TestServer(service.app())) as client:
            stop = asyncio.Event()

            async def watch():
                while not stop.is_set():
                    isolations = service.store.isolations().values()
                    per_domain: dict[str, int] = {}
                    for iso in isolations:
                        per_domain[iso.domain] = per_domain.get(iso.domain, 0) + 1
                    peak["cluster"] = max(peak["cluster"], len(isolations))
                    peak["domain"] = max(peak["domain"], max(per_domain.values(), default=0))
                    await asyncio.sleep(0.005)

            async def post(data):
                resp = await client.post("/webhook", data=data, headers={"Authorization": f"Bearer {TOKEN}"})
                return resp.status, await resp.json()

            watcher = asyncio.create_task(watch())
            t0 = time.monotonic()
            # One burst: single-alert notifications (group_by ...), a few grouped ones, and the resends.
            bodies = [body(a) for a in alerts[:800]]
            bodies += [body(*alerts[i : i + 50]) for i in range(800, 1000, 50)]
            bodies += [body(a) for a in resent]
            rng.shuffle(bodies)
            answers = await asyncio.gather(*(post(b) for b in bodies))
            ingest_s = time.monotonic() - t0
            assert all(status == 202 for status, _ in answers)
            created = [ref for _, doc in answers for ref in doc["created"]]
            duplicates = sum(doc["duplicates"] for _, doc in answers)
            await service.engine.wait_idle(timeout=120)

            assert len(created) == len(set(created)) == 1000
            assert duplicates == 150
            incidents = service.store.incidents(limit=10_000)
            assert len(incidents) == 1000
            assert len({(i.fingerprint, i.starts_at) for i in incidents}) == 1000
            # The storm opened the breaker (it may have closed again already: its quiet window runs from the
            # last arrival, and a loaded machine can take longer than that to finish the burst).
            opened = [e for e in service.store.audit_log(limit=100_000) if e["decision"] == "breaker_open"]
            assert opened

            isolated = service.store.isolations()
            assert len(isolated) <= BUDGET
            held = [i for i in incidents if i.hold_reason]
            assert held and all(i.state == "classified" for i in held)  # queued, not dropped
            acted_nodes = {r.extravars["fleetheal_node"] for r in runner.requests}
            assert acted_nodes == set(isolated)  # only isolated nodes got a playbook
            refs = [r.extravars["fleetheal_incident_id"] for r in runner.requests]
            assert len(refs) == len(set(refs))  # no incident acted on twice
            # Every incident is accounted for: done on an isolated node, or queued at the gate.
            for i in incidents:
                assert (i.state == "done" and i.node in isolated) or i.hold_reason, i

            # Quiet: the breaker closes by itself; the queue drains only as far as the budget allows.
            await asyncio.sleep(cfg.gate.breaker.quiet_s + 0.5)
            await service.engine.wait_idle(timeout=60)
            deadline = time.monotonic() + 30
            while service.engine.gate.breaker_open() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not service.engine.gate.breaker_open()
            await asyncio.sleep(0.5)
            await service.engine.wait_idle(timeout=60)
            isolated = service.store.isolations()
            assert len(isolated) == BUDGET  # filled up to the budget, not beyond
            still_held = [i for i in service.store.incidents(limit=10_000) if i.hold_reason]
            assert still_held and all(i.hold_reason.startswith("budget:") for i in still_held)
            assert service.engine.queue_depth() == len(still_held)
            stop.set()
            await watcher
            audit = service.store.audit_log(limit=100_000)
            return ingest_s, audit

    ingest_s, audit = asyncio.run(main())
    assert peak["cluster"] <= BUDGET and peak["domain"] <= PER_DOMAIN
    # Replay the audit record: at no decision did the isolated set exceed the budget.
    running: dict[str, str] = {}
    for entry in audit:
        if entry["decision"] in ("allow", "would_isolate") and entry["facts"].get("domain"):
            running[entry["node"]] = entry["facts"]["domain"]
        elif entry["decision"] == "release":
            running.pop(entry["node"], None)
        assert len(running) <= BUDGET
        for domain in set(running.values()):
            assert sum(1 for d in running.values() if d == domain) <= PER_DOMAIN
    kinds = [e["decision"] for e in audit]
    # It opened on the storm (again if a lull in the burst outlasted the quiet window) and ended closed.
    assert kinds.count("breaker_open") >= 1 and kinds.count("breaker_closed") == kinds.count("breaker_open")
    print(f"burst ingest: {len(alerts) + len(resent)} alerts in {ingest_s:.2f} s")
