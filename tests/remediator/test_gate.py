"""The safety gate: budget, circuit breaker, lemons, retry limit, observe-only, pause, dry-run, audit."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from fleetheal import taxonomy
from fleetheal.contracts import budget_limit as _limit
from fleetheal.remediator.alerts import validate_alert
from fleetheal.remediator.engine import Engine
from fleetheal.remediator.store import Store, StoreError
from tests.remediator.conftest import RecordingRunner, alert, make_config, nodes

TAX = taxonomy.load()


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    """An Engine with a recording runner and a hand-driven clock; the tick is driven by the test."""

    def __init__(self, cfg, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or Clock()
        self.store = Store(cfg.store.path, clock=self.clock)
        self.runner = RecordingRunner()
        self.engine = Engine(cfg, self.store, self.runner, TAX, clock=self.clock)

    async def send(self, *alerts):
        result = self.store.ingest([validate_alert(a, self.cfg, TAX) for a in alerts])
        self.engine.submit(result.created)
        self.engine.resolved(result.resolved)
        await self.engine.wait_idle()
        return result

    async def tick(self):
        self.engine.tick()
        await self.engine.wait_idle()

    def states(self):
        return {i.node + "/" + i.gpu: (i.state, i.decision, i.hold_reason) for i in self.store.incidents(limit=10_000)}

    def isolated(self):
        return sorted(self.store.isolations())


def run(coro_fn, cfg, clock=None):
    async def main():
        h = Harness(cfg, clock)
        await h.engine.start(workers=4)
        try:
            await coro_fn(h)
        finally:
            await h.engine.stop(grace_s=1)
            h.store.close()

    asyncio.run(main())


def gate_cfg(tmp_path, **gate):
    return make_config(
        tmp_path,
        cluster={"name": "lab", "nodes": nodes(16, per_domain=4)},  # 4 racks of 4
        gate={
            "recheck_interval_s": 3600,  # the test drives the tick
            **gate,
            "budget": {"max_isolated_fraction_per_domain": 1.0, **gate.get("budget", {})},
        },
    )


def test_limits_round_down_but_leave_one():
    assert _limit(8, 0.05, 200) == 8
    assert _limit(8, 0.05, 100) == 5
    assert _limit(8, 0.05, 10) == 1
    assert _limit(0, 0.5, 10) == 0
    assert _limit(8, 0.5, 0) == 0


def test_budget_per_failure_domain_holds_the_rest_and_releases_when_resolved(tmp_path):
    cfg = gate_cfg(tmp_path, budget={"max_isolated": 10, "max_isolated_fraction": 1.0, "max_isolated_per_domain": 2})

    async def scenario(h):
        # rack-0 is gpu-000..003: two fit the domain budget, the third waits.
        await h.send(alert(node="gpu-000"), alert(node="gpu-001"), alert(node="gpu-002"))
        assert h.isolated() == ["gpu-000", "gpu-001"]
        # The playbook is told how much budget its isolation had: 2 for the first, 1 (its own) for the second.
        assert [r.extravars["fleetheal_budget_remaining"] for r in h.runner.requests] == [2, 1]
        held = h.states()["gpu-002/0"]
        assert held[0] == "classified" and held[2].startswith("budget: 2/2 nodes of failure domain rack-0")
        assert h.engine.queue_depth() == 1
        # Another GPU of a node already being isolated costs no budget and runs nothing more.
        await h.send(alert(node="gpu-000", gpu="3"))
        assert h.states()["gpu-000/3"][:2] == ("done", "deny")
        # gpu-000 resolves (both of its alerts): its isolation is released, the queued incident goes.
        await h.send(alert(node="gpu-000", status="resolved"), alert(node="gpu-000", gpu="3", status="resolved"))
        await h.tick()
        assert h.isolated() == ["gpu-001", "gpu-002"]
        assert h.states()["gpu-002/0"][:2] == ("done", "allow")
        assert [r.extravars["fleetheal_node"] for r in h.runner.requests] == ["gpu-000", "gpu-001", "gpu-002"]
        decisions = [(a["node"], a["decision"]) for a in h.store.audit_log()]
        assert ("gpu-002", "hold") in decisions and ("gpu-000", "release") in decisions
        facts = next(a["facts"] for a in h.store.audit_log() if a["decision"] == "hold")
        assert facts["domain"] == "rack-0" and facts["domain_isolated"] == 2 and facts["domain_limit"] == 2

    run(scenario, cfg)


def test_cluster_budget_as_a_share_of_the_pool(tmp_path):
    # 16 nodes * 0.125 = 2 at once in the whole cluster, whatever the domains allow.
    cfg = gate_cfg(tmp_path, budget={"max_isolated": 10, "max_isolated_fraction": 0.125, "max_isolated_per_domain": 4})

    async def scenario(h):
        await h.send(*(alert(node=f"gpu-{i:03d}") for i in (0, 4, 8, 12)))
        assert len(h.isolated()) == 2
        held = [s for s in h.states().values() if s[2]]
        assert len(held) == 2 and all(s[2].startswith("budget: 2/2 nodes of the pool of 16") for s in held)

    run(scenario, cfg)


def test_breaker_opens_on_a_storm_queues_and_closes_after_quiet(tmp_path):
    cfg = gate_cfg(
        tmp_path,
        budget={"max_isolated": 16, "max_isolated_fraction": 1.0, "max_isolated_per_domain": 4},
        breaker={"storm_nodes": 3, "window_s": 60, "quiet_s": 120},
    )
    clock = Clock()

    async def scenario(h):
        await h.send(*(alert(node=f"gpu-{i:03d}") for i in range(6)))
        assert len(h.isolated()) == 3  # the 4th distinct node makes it a storm
        assert h.engine.gate.breaker_open()
        assert h.engine.queue_depth() == 3
        assert all(s[2].startswith("breaker:") for s in h.states().values() if s[2])
        clock.now += 100  # not quiet long enough
        await h.tick()
        assert h.engine.gate.breaker_open() and h.engine.queue_depth() == 3
        await h.send(alert(node="gpu-010"))  # a new request restarts the quiet window
        clock.now += 100
        await h.tick()
        assert h.engine.gate.breaker_open()
        clock.now += 21
        await h.tick()
        assert not h.engine.gate.breaker_open()
        assert h.engine.queue_depth() == 0 and len(h.isolated()) == 7
        kinds = [a["decision"] for a in h.store.audit_log()]
        assert kinds.count("breaker_open") == 1 and kinds.count("breaker_closed") == 1

    run(scenario, cfg, clock)


def test_a_lemon_node_is_quarantined_for_good(tmp_path):
    cfg = gate_cfg(tmp_path, lemon={"threshold": 2, "window_s": 3600})
    clock = Clock()

    async def scenario(h):
        for n, start in enumerate(("2026-11-29T10:00:00Z", "2026-11-29T11:00:00Z")):
            await h.send(alert(node="gpu-005", starts_at=start))
            await h.send(alert(node="gpu-005", starts_at=start, status="resolved"))
            clock.now += 60
            if n == 0:
                assert h.isolated() == []  # released after the first, healthy again
        iso = h.store.isolations()["gpu-005"]
        assert iso.quarantined  # the 2nd isolation within the window: kept out although resolved
        await h.send(alert(node="gpu-005", starts_at="2026-11-29T12:00:00Z"))
        third = h.store.incidents(node="gpu-005")[0]
        assert third.state == "done" and third.decision == "deny" and "quarantined" in third.outcome
        assert len(h.runner.requests) == 2
        assert h.store.release("gpu-005", "repaired")  # a human takes it back
        assert "gpu-005" not in h.store.isolations()

    run(scenario, cfg, clock)


def test_per_job_retry_limit(tmp_path):
    cfg = gate_cfg(tmp_path, max_requeues_per_job=2)

    async def scenario(h):
        for n in range(3):
            await h.send(
                alert(node="gpu-001", fault_id="nccl-timeout", job_id="77", starts_at=f"2026-11-29T1{n}:00:00Z")
            )
        incs = sorted(h.store.incidents(node="gpu-001"), key=lambda i: i.id)
        assert [i.decision for i in incs] == ["allow", "allow", "deny"]
        assert "job 77 was requeued 2 times (limit 2)" in incs[2].outcome
        # A hardware fault still isolates the node, but the job is not requeued again.
        await h.send(alert(node="gpu-002", job_id="77"))
        last = h.runner.requests[-1].extravars
        assert last["fleetheal_node"] == "gpu-002" and last["fleetheal_job_id"] == ""

    run(scenario, cfg)


def test_observe_only_records_and_runs_nothing(tmp_path):
    cfg = gate_cfg(tmp_path, observe_only=True)

    async def scenario(h):
        await h.send(alert(node="gpu-001"))
        (inc,) = h.store.incidents()
        assert (inc.state, inc.decision) == ("done", "observe")
        assert inc.outcome == "observe-only mode: would run ISOLATE_AND_RELOCATE on gpu-001"
        assert h.runner.requests == [] and h.isolated() == []

    run(scenario, cfg)


def test_pause_switch_holds_until_resumed(tmp_path):
    pause = tmp_path / "PAUSE"
    pause.write_text("")
    cfg = gate_cfg(tmp_path, pause_file=str(pause))

    async def scenario(h):
        await h.send(alert(node="gpu-001", fault_id="nccl-timeout"))
        (inc,) = h.store.incidents()
        assert inc.state == "classified" and inc.hold_reason == "paused: pause switch is on"
        await h.tick()
        assert h.runner.requests == []
        pause.unlink()
        await h.tick()
        assert h.store.incidents()[0].state == "done" and len(h.runner.requests) == 1

    run(scenario, cfg)


def test_dry_run_says_would_isolate_and_tells_the_playbook(tmp_path):
    cfg = gate_cfg(tmp_path, dry_run=True)

    async def scenario(h):
        await h.send(alert(node="gpu-001"))
        (inc,) = h.store.incidents()
        assert inc.decision == "would_isolate" and inc.dry_run
        (audit,) = [a for a in h.store.audit_log() if a["incident"] == inc.ref]
        assert audit["reason"].startswith("would isolate gpu-001")
        assert h.runner.requests[0].extravars["fleetheal_dry_run"] is True
        assert inc.outcome.startswith("would run isolate_and_relocate.yml")

    run(scenario, cfg)


def test_a_held_incident_whose_alert_resolves_does_nothing(tmp_path):
    cfg = gate_cfg(tmp_path, paused=True)

    async def scenario(h):
        await h.send(alert(node="gpu-001"))
        await h.send(alert(node="gpu-001", status="resolved"))
        (inc,) = h.store.incidents()
        assert inc.state == "classified"  # still paused: the pause wins
        object.__setattr__(h.cfg.gate, "paused", False)
        await h.tick()
        inc = h.store.incidents()[0]
        assert (inc.state, inc.decision) == ("done", "deny") and "resolved before anything ran" in inc.outcome
        assert h.runner.requests == []

    run(scenario, cfg)


@pytest.mark.parametrize("fault", ["xid-13", "unknown", "nccl-timeout"])
def test_non_destructive_actions_cost_no_budget(tmp_path, fault):
    cfg = gate_cfg(tmp_path, budget={"max_isolated": 0})

    async def scenario(h):
        await h.send(alert(node="gpu-001", fault_id=fault))
        (inc,) = h.store.incidents()
        assert (inc.state, inc.decision) == ("done", "allow") and h.isolated() == []

    run(scenario, cfg)


def test_one_failure_raising_several_alerts_is_acted_on_once(tmp_path):
    cfg = gate_cfg(tmp_path, budget={"max_isolated": 10, "max_isolated_fraction": 1.0, "max_isolated_per_domain": 4})

    async def scenario(h):
        # Xid 79 and the GPU-lost reading of the same GPU, then Xid 48 elsewhere on the node: one isolation.
        await h.send(alert(node="gpu-004", gpu="3", fault_id="xid-79"))
        await h.send(
            alert(node="gpu-004", gpu="3", fault_id="gpu-lost"), alert(node="gpu-004", gpu="5", fault_id="xid-48")
        )
        assert [(r.extravars["fleetheal_fault_id"], r.action) for r in h.runner.requests] == [
            ("xid-79", "ISOLATE_AND_RELOCATE")
        ]
        denied = [a for a in h.store.audit_log() if a["decision"] == "deny"]
        assert len(denied) == 2
        assert all("already isolated by inc-" in a["reason"] and "nothing more is done" in a["reason"] for a in denied)
        # A GPU reset under way does not hide a later, stronger fault: it escalates to isolation.
        await h.send(alert(node="gpu-008", fault_id="row-remap-pending"))
        await h.send(alert(node="gpu-008", fault_id="xid-79"), alert(node="gpu-008", fault_id="retired-pages-pending"))
        # (The successful reset's revalidation, a follow-up of the node's lifecycle, is not an alert's action.)
        follow_ups = taxonomy.load().followups()

        def acted() -> list[tuple[str, str]]:
            return [(r.extravars["fleetheal_node"], r.action) for r in h.runner.requests if r.action not in follow_ups]

        assert acted()[1:] == [("gpu-008", "RESET_GPU"), ("gpu-008", "ISOLATE_AND_RELOCATE")]
        assert h.isolated() == ["gpu-004", "gpu-008"]
        # The escalation now owns the isolation: a late counter alert is folded into it, not run again.
        await h.send(alert(node="gpu-008", gpu="1", fault_id="gpu-lost"))
        assert len(acted()) == 3
        assert h.store.isolations()["gpu-008"].incident_id == next(
            i.id for i in h.store.incidents(limit=100) if i.node == "gpu-008" and i.fault_id == "xid-79"
        )

    run(scenario, cfg)


def _dump(path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return list(db.iterdump())
    finally:
        db.close()


def test_evaluate_decides_without_writing_and_record_writes_the_decision(tmp_path):
    # gpu-003's request is the second node's within the window (more than 1: a storm); its decision opens
    # the breaker.
    cfg = gate_cfg(tmp_path, breaker={"storm_nodes": 1, "window_s": 60, "quiet_s": 120})
    h = Harness(cfg)
    try:
        h.store.record_arrival("gpu-000", 0, prune_before=0.0)
        (iid,) = h.store.ingest([validate_alert(alert(node="gpu-003"), cfg, TAX)]).created
        h.store.set_state(iid, "classified")
        inc = h.store.get(iid)
        step = h.store.start_step(iid, "gate")
        before = _dump(cfg.store.path)
        verdict = h.engine.gate.evaluate(inc, first=True)
        assert (verdict.kind, verdict.reason_kind, verdict.arrival, verdict.opens_breaker) == (
            "hold",
            "breaker",
            True,
            2,
        )
        assert _dump(cfg.store.path) == before
        with h.store.tx():
            h.engine.gate.record(inc, verdict, step)
        assert h.engine.gate.breaker_open() and h.store.storm_nodes(0.0) == 2
        assert h.store.get(iid).hold_reason.startswith("breaker: ")
        decisions = [(a["decision"], a["facts"].get("breaker_open")) for a in h.store.audit_log()]
        assert decisions == [("breaker_open", None), ("hold", True)]
    finally:
        h.store.close()


def test_a_decision_whose_record_fails_leaves_no_trace(tmp_path):
    """The engine asks the gate and records its decision in one transaction: when the record fails, the
    storm detector has not counted the request either, and the next look, the first again, counts it once."""
    cfg = gate_cfg(tmp_path)

    async def scenario(h):
        def broken(*args, **kwargs):
            raise StoreError("disk full")

        real, h.store.record_decision = h.store.record_decision, broken
        (iid,) = h.store.ingest([validate_alert(alert(node="gpu-003"), cfg, TAX)]).created
        h.store.set_state(iid, "classified")
        with pytest.raises(StoreError):
            h.engine.stages._gate(h.store.get(iid))
        assert h.store.storm_nodes(0.0) == 0 and h.store.audit_log() == [] and h.isolated() == []
        assert [s.name for s in h.store.steps(iid)] == ["receive"]
        h.store.record_decision = real
        assert h.engine.stages._gate(h.store.get(iid))
        assert h.store.storm_nodes(0.0) == 1 and h.isolated() == ["gpu-003"]

    run(scenario, cfg)
