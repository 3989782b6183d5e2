"""The incident state machine: steps on the timeline, retries with backoff, resuming after a crash."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time

import pytest

from fleetheal import procs, taxonomy
from fleetheal.fleet import failover
from fleetheal.fleet.config import FleetConfig
from fleetheal.remediator.alerts import validate_alert
from fleetheal.remediator.engine import Engine
from fleetheal.remediator.runner import RunnerInputError, StepOutcome
from fleetheal.remediator.store import Store
from tests.remediator.conftest import RecordingRunner, alert, make_config

TAX = taxonomy.load()


async def start(cfg, runner, sleeps=None):
    store = Store(cfg.store.path)

    async def fake_sleep(seconds):
        if sleeps is not None:
            sleeps.append(seconds)

    engine = Engine(cfg, store, runner, TAX, sleep=fake_sleep)
    await engine.start(workers=2)
    return store, engine


async def _until(predicate, timeout=60.0):
    """Wait in the loop for `predicate()` (the engine's tasks run meanwhile)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def send(store, engine, cfg, *alerts):
    result = store.ingest([validate_alert(a, cfg, TAX) for a in alerts])
    engine.submit(result.created)
    await engine.wait_idle()
    return result.created


def test_a_successful_incident_has_every_step_on_its_timeline(cfg):
    async def main():
        runner = RecordingRunner()
        store, engine = await start(cfg, runner)
        (iid,) = await send(store, engine, cfg, alert(node="gpu-002", gpu="7", job_id="31"))
        await engine.stop()
        inc = store.get(iid)
        assert inc.state == "done" and inc.decision == "allow"
        assert inc.outcome == "ran isolate_and_relocate.yml for ISOLATE_AND_RELOCATE on gpu-002: successful"
        steps = store.steps(iid)
        assert [(s.name, s.result) for s in steps] == [
            ("receive", "ok"),
            ("classify", "ok"),
            ("gate", "allow"),
            ("playbook", "successful"),
        ]
        assert all(s.ended_at is not None and s.ended_at >= s.started_at for s in steps)
        assert steps[1].detail.startswith("xid-79 (GPU has fallen off the bus): class hardware")
        assert [e.kind for e in store.events(iid)] == ["playbook_start", "stats"]
        (request,) = runner.requests
        assert dict(request.extravars) == {
            "fleetheal_incident_id": "inc-000001",
            "fleetheal_node": "gpu-002",
            "fleetheal_fault_id": "xid-79",
            "fleetheal_fault_class": "hardware",
            "fleetheal_action": "ISOLATE_AND_RELOCATE",
            "fleetheal_cluster": "lab",
            "fleetheal_dry_run": False,
            "fleetheal_job_id": "31",
            "fleetheal_gpu": "7",
            "fleetheal_paused": False,
            "fleetheal_budget_remaining": 1,  # 8 nodes * 0.05 -> 1 in the cluster; this node's slot
        }

    asyncio.run(main())


def test_failed_attempts_are_retried_with_exponential_backoff(tmp_path):
    cfg = make_config(tmp_path, runner={"retries": 2, "backoff_s": 5})

    async def main():
        sleeps: list[float] = []
        runner = RecordingRunner(outcomes={1: "failed", 2: "timeout"})
        store, engine = await start(cfg, runner, sleeps)
        (iid,) = await send(store, engine, cfg, alert())
        await engine.stop()
        assert store.get(iid).state == "done"
        runs = [(s.attempt, s.result) for s in store.steps(iid) if s.name == "playbook"]
        assert runs == [(1, "failed"), (2, "timeout"), (3, "successful")]
        assert sleeps == [5, 10]
        assert [e.detail for e in store.events(iid) if e.kind == "backoff"] == [
            "retry in 5 s (attempt 2)",
            "retry in 10 s (attempt 3)",
        ]

    asyncio.run(main())


def test_retries_exhausted_fail_the_incident(tmp_path):
    cfg = make_config(tmp_path, runner={"retries": 1})

    async def main():
        runner = RecordingRunner(outcomes={1: "failed", 2: "timeout"})
        store, engine = await start(cfg, runner)
        (iid,) = await send(store, engine, cfg, alert())
        await engine.stop()
        inc = store.get(iid)
        # The outcome says why the last attempt failed (a storm's operator must not have to open each run).
        last = [s.detail for s in store.steps(iid) if s.name == "playbook"][-1]
        assert "recorded (timeout)" in last
        assert (
            inc.state == "failed"
            and inc.outcome == f"playbook failed: retries exhausted after 2 attempts (last: {last})"
        )
        assert len(runner.requests) == 2

    asyncio.run(main())


def test_a_runner_that_refuses_its_input_fails_without_retry(cfg):
    class Refusing(RecordingRunner):
        def run(self, request, on_event, cancel, deadline=None):
            self.requests.append(request)
            raise RunnerInputError("playbook /x does not exist")

    async def main():
        runner = Refusing()
        store, engine = await start(cfg, runner)
        (iid,) = await send(store, engine, cfg, alert())
        await engine.stop()
        inc = store.get(iid)
        assert inc.state == "failed" and "refused to run: playbook /x does not exist" in inc.outcome
        assert len(runner.requests) == 1

    asyncio.run(main())


@pytest.mark.parametrize("crash_state", ["received", "classified", "gated", "acting-open", "acting-done"])
def test_resume_after_a_crash_in_every_state_finishes_once(cfg, crash_state):
    """Build the database a crash would leave behind, restart, and check nothing finished runs again."""
    store = Store(cfg.store.path)
    (iid,) = store.ingest([validate_alert(alert(), cfg, TAX)]).created
    inc = store.get(iid)
    if crash_state != "received":
        step = store.start_step(iid, "classify")
        store.end_step(step, "ok", "classified before the crash", (iid, "classified", {}))
    if crash_state in ("gated", "acting-open", "acting-done"):
        gate_step = store.start_step(iid, "gate")
        store.record_decision(
            inc,
            "gated",
            "allow",
            "before the crash",
            {},
            isolate_domain="rack-0",
            count_isolation=True,
            step_id=gate_step,
        )
    if crash_state.startswith("acting"):
        store.set_state(iid, "acting")
        run = store.start_step(iid, "playbook", 1, "isolate_and_relocate.yml")
        store.set_step_run_dir(run, str(cfg.runner.run_dir) + "/never-started")
        if crash_state == "acting-done":
            store.end_step(run, "successful", "finished before the crash")
    store.close()

    async def main():
        runner = RecordingRunner()
        store2, engine = await start(cfg, runner)
        await engine.wait_idle()
        await engine.stop()
        return store2, runner

    store2, runner = asyncio.run(main())
    inc = store2.get(iid)
    assert inc.state == "done"
    names = [(s.name, s.result) for s in store2.steps(iid)]
    assert names.count(("classify", "ok")) == 1
    assert sum(1 for n, _ in names if n == "gate") == 1
    expected_runs = {"acting-done": 0, "acting-open": 1}.get(crash_state, 1)
    assert len(runner.requests) == expected_runs
    if crash_state == "acting-open":
        assert [r for n, r in names if n == "playbook"] == ["interrupted", "successful"]
        assert runner.requests[0].attempt == 2
    assert len(store2.isolations()) == 1  # the gate's ledger is not counted twice


def test_shutdown_cancels_a_running_playbook_and_the_next_start_resumes_it(cfg):
    async def first():
        runner = RecordingRunner(delay_s=30)
        store, engine = await start(cfg, runner)
        (iid,) = store.ingest([validate_alert(alert(), cfg, TAX)]).created
        engine.submit([iid])
        while not runner.requests:
            await asyncio.sleep(0.01)
        await engine.stop(grace_s=0.1)
        return store, iid

    store, iid = asyncio.run(first())
    assert store.get(iid).state == "acting"
    assert [s.result for s in store.steps(iid) if s.name == "playbook"] == ["interrupted"]
    store.close()

    async def second():
        runner = RecordingRunner()
        store2, engine = await start(cfg, runner)
        await engine.wait_idle()
        await engine.stop()
        return store2, runner

    store2, runner = asyncio.run(second())
    assert store2.get(iid).state == "done"
    assert [r.attempt for r in runner.requests] == [2]


class LateSpawner:
    """Test double of a runner caught between its start and its process's spawn when the replica steps
    down: it spawns its playbook process (a `sleep` whose command line names the run directory, as
    ansible-playbook's does) only once the engine has cancelled, then waits for it like the real runner."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.entered = threading.Event()
        self.spawned: list[int] = []

    def run_batch(self, runs, cancel):
        self.entered.set()
        while not cancel():
            time.sleep(0.005)
        marker = os.path.join(self.run_dir, "inc-000001", "step4-attempt1")
        proc = subprocess.Popen(["sh", "-c", f"sleep 60; : {marker}"], start_new_session=True)
        self.spawned.append(proc.pid)
        proc.wait()
        return [StepOutcome("canceled", None, "canceled")] * len(runs)


def test_abandon_returns_only_once_a_playbook_spawned_after_the_step_down_is_gone(cfg):
    """The replica stepping down sees every playbook process gone before the lease may pass, including a
    process that a run spawned after the processes were first listed."""
    runner = LateSpawner(cfg.runner.run_dir)

    async def main():
        store, engine = await start(cfg, runner)
        (iid,) = store.ingest([validate_alert(alert(), cfg, TAX)]).created
        engine.submit([iid])
        await asyncio.get_running_loop().run_in_executor(None, runner.entered.wait, 30)
        stopped = await asyncio.get_running_loop().run_in_executor(None, engine.abandon, 10.0)
        # Returned: the late process was spawned and is gone, and no run can start another.
        assert stopped is True
        assert len(runner.spawned) == 1 and not procs.alive(runner.spawned[0])
        assert not procs.pids_mentioning(os.path.join(cfg.runner.run_dir, ""))
        await engine.stop(grace_s=0)
        store.close()

    asyncio.run(main())


def test_first_responses_of_a_storm_never_wait_for_a_playbook_slot(tmp_path):
    """Six nodes at once, one playbook slot held by a slow run: every first response still runs at once,
    and no playbook shares the machine with them (the follow-ups start once the first responses are done).

    Before the playbook stage left the workers, each of the (here 2) workers sat on an incident waiting
    for a playbook slot, and the first response of every later incident waited minutes behind them.
    """
    cfg = make_config(
        tmp_path,
        cluster={"name": "lab", "nodes": {f"gpu-{i:03d}": f"rack-{i}" for i in range(8)}},
        runner={"max_concurrent": 1},
        gate={"budget": {"max_isolated": 8, "max_isolated_fraction": 1.0}, "breaker": {"storm_nodes": 100}},
    )

    class Responder:
        def __init__(self) -> None:
            self.nodes: list[str] = []
            self.playbooks_running: list[int] = []
            self.runner = RecordingRunner(delay_s=30.0)

        def handles(self, action: str) -> bool:
            return action == "ISOLATE_AND_RELOCATE"

        def warm(self) -> None:
            pass

        async def respond(self, inc, record) -> None:
            self.nodes.append(inc.node)
            self.playbooks_running.append(self.runner.max_running)
            await asyncio.sleep(0.05)

        def close(self) -> None:
            pass

    async def main():
        responder = Responder()
        runner = responder.runner
        store = Store(cfg.store.path)
        engine = Engine(cfg, store, runner, TAX, responder=responder)  # type: ignore[arg-type]
        await engine.start(workers=2)
        result = store.ingest([validate_alert(alert(node=f"gpu-{i:03d}"), cfg, TAX) for i in range(6)])
        engine.submit(result.created)
        await _until(lambda: len(responder.nodes) == 6)
        assert sorted(responder.nodes) == [f"gpu-{i:03d}" for i in range(6)]
        assert responder.playbooks_running == [0] * 6
        await _until(lambda: runner.max_running)
        assert runner.max_running == 1  # the playbook slot is held by the first run, the others wait
        await engine.stop(grace_s=0.1)
        firsts = [s for iid in result.created for s in store.steps(iid) if s.name == "first_response"]
        assert len(firsts) == 6 and all(s.result == "ok" for s in firsts)

    asyncio.run(main())


def test_attempts_waiting_for_a_playbook_slot_run_together(tmp_path):
    """Seven isolations, one slot: the first run holds it; the six that waited go as one run, not six
    (a storm's follow-ups cost one ansible-playbook start-up per wave), and each gets its own result."""
    cfg = make_config(
        tmp_path,
        cluster={"name": "lab", "nodes": {f"gpu-{i:03d}": f"rack-{i}" for i in range(8)}},
        runner={"max_concurrent": 1, "max_hosts_per_run": 4},
        gate={"budget": {"max_isolated": 8, "max_isolated_fraction": 1.0}, "breaker": {"storm_nodes": 100}},
    )

    async def main():
        release = threading.Event()
        runner = RecordingRunner(outcomes={}, hold=release)  # the first run holds the slot until released
        store, engine = await start(cfg, runner)
        (first,) = store.ingest([validate_alert(alert(node="gpu-000"), cfg, TAX)]).created
        engine.submit([first])
        await _until(lambda: runner.batches)
        rest = store.ingest([validate_alert(alert(node=f"gpu-{i:03d}"), cfg, TAX) for i in range(1, 7)]).created
        engine.submit(rest)
        await _until(lambda: len(engine.batcher._waiting.get("isolate_and_relocate.yml", [])) == len(rest))
        release.set()
        await engine.wait_idle()
        await engine.stop()
        assert runner.batches[0] == [first]
        assert sorted(i for b in runner.batches[1:] for i in b) == sorted(rest)
        assert [len(b) for b in runner.batches[1:]] == [4, 2]  # at most max_hosts_per_run each
        assert runner.max_running == 1
        for iid in [first, *rest]:
            assert store.get(iid).state == "done"
            (attempt,) = [s for s in store.steps(iid) if s.name == "playbook"]
            assert attempt.result == "successful"

    asyncio.run(main())


class _SlurmlessStage(failover.Stage):
    """The failover stage with Slurm's answers given (a test double of Slurm only: the engine's use of the
    stage is what is tested; tests/fleet/test_failover.py runs the real one on a real federation)."""

    def __init__(self, lost: set[str]) -> None:
        super().__init__(FleetConfig(), "lab")
        self.lost = lost
        self.held: list[str] = []

    def node_lost(self, node: str) -> bool:
        return node in self.lost

    def while_held(self, node: str, *, dry_run: bool = False) -> list[failover.Decision]:
        self.held.append(node)
        return [failover.Decision("41", "moved", "lab", "b", f"{node} does not respond")]


def test_a_held_isolation_moves_the_jobs_of_a_lost_node_once_and_only_when_slurm_confirms(tmp_path):
    """Budget spent (one isolation allowed): the second node's incident is held. Its jobs move only once Slurm
    says the node is lost (an alert alone moves nothing), and once."""
    cfg = make_config(tmp_path, gate={"budget": {"max_isolated": 1, "max_isolated_fraction": 1.0}})

    async def main():
        store = Store(cfg.store.path)
        stage = _SlurmlessStage(lost=set())
        engine = Engine(cfg, store, RecordingRunner(), TAX, failover=stage)
        await engine.start(workers=2)
        first, second = await send(store, engine, cfg, alert(node="gpu-001"), alert(node="gpu-002"))
        assert store.get(second).hold_reason and store.get(second).state == "classified"
        assert stage.held == [] and not [s for s in store.steps(second) if s.name == "failover"]
        stage.lost.add("gpu-002")  # Slurm now says so
        for _ in range(3):  # looked at again, several times
            engine.submit([second])
            await engine.wait_idle()
            for _ in range(20):
                await asyncio.sleep(0.01)
        await engine.stop()
        assert stage.held == ["gpu-002"]
        (step,) = [s for s in store.steps(second) if s.name == "failover"]
        assert step.result == "moved" and step.detail == "41 moved to b"
        assert any(e.kind == "failover" and "41 moved to b" in e.detail for e in store.events(second))
        assert not [
            s for s in store.steps(first) if s.name == "failover"
        ]  # allowed; no first response found the standby pool empty

    asyncio.run(main())
