"""One incident's story, in the order it happens: received -> classified -> gated -> acting -> done | failed.

`Stages.drive` reads as the table of contents; the methods below it follow an incident top to bottom:

1. accept (`_classify`): the fault and the node are still valid (the taxonomy or the cluster may have
   changed since the alert came in), or the incident fails at once;
2. gate (`_gate`): allowed, denied or held (a held incident stays classified; when the budget or the
   breaker holds it, its node's jobs may move to a sibling cluster meanwhile: `_fail_over_held`);
3. the node takes the action's lifecycle state, then the incident acts:
   - its first response, in-process (`respond_first`; responder.py),
   - failover, when no standby node was left for the jobs it requeued (`_fail_over`; fleet/failover.py),
   - playbook attempts (`_act`, `_run_attempt`), retried with backoff after waiting for Slurm or the
     Kubernetes API server to answer again;
4. finish (`fail`, `_finished`): the outcome, the log line, the metrics, the node lifecycle.

Every transition is persisted before the next step starts, and each step is a row with start, end and
result, so after a crash (SIGKILL) at any point the engine resumes every unfinished incident here:

- received:   classify again (pure, cheap);
- classified: ask the gate (a held incident waits in this state; the tick looks at it again);
- gated:      start acting;
- acting:     a playbook attempt with no end was interrupted: whatever still runs of it is killed, the
              attempt is recorded as `interrupted`, and a new attempt starts. A finished attempt is never
              run again; a successful one ends the incident.

Failed or timed-out attempts are retried `runner.retries` times with exponential backoff (remediation
playbooks are idempotent). Interrupted attempts (crash, shutdown) do not count as failures, but more
than MAX_INTERRUPTIONS of them fail the incident rather than loop forever.

When each incident is taken up (queue, workers, the follow-up task, the tick) is engine.py's part; a
playbook attempt waits for its slot and its batch in runner.py (`Batcher`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleetheal import taxonomy as taxmod
from fleetheal.fleet import failover as failmod
from fleetheal.remediator.config import Config
from fleetheal.remediator.gate import Gate, Verdict, hold_changed
from fleetheal.remediator.lifecycle import Lifecycle
from fleetheal.remediator.metrics import Metrics
from fleetheal.remediator.responder import FirstResponder
from fleetheal.remediator.rundirs import kill_leftovers, process_start_time
from fleetheal.remediator.runner import Run, RunnerEvent, RunnerInputError, StepOutcome, StepRequest, run_dir_for
from fleetheal.remediator.store import TERMINAL, DiskFull, Incident, NotLeader, Step, Store, StoreError

log = logging.getLogger("fleetheal.remediator.engine")

MAX_INTERRUPTIONS = 5
PLAYBOOK_STEP = "playbook"
FIRST_STEP = "first_response"
FAILOVER_STEP = "failover"
#: The first-response event that says no standby node was left to promote (what starts the failover stage).
NO_STANDBY = "standby_promote skipped"
#: The first-response event of a job it requeued (fleetheal.steps.requeue_now's detail): the jobs failover
#: may move are those, never jobs whose comment merely names the incident (a user writes their comment).
REQUEUED = re.compile(r"^slurm_requeue done: sent \S+ to job (\S+), requeued it")
#: Gate holds under which a lost node's jobs move to another cluster: the cluster cannot heal them now.
FAILOVER_HOLDS = ("budget", "breaker")
#: Before a retry, while Slurm or the Kubernetes API server does not answer, ask again this often...
DEPENDENCY_POLL_S = 5.0
#: ... for at most this long; then the retry runs anyway (and counts if it fails).
DEPENDENCY_WAIT_MAX_S = 3600.0


class Stages:
    """What happens to one incident; the engine (engine.py) decides when, and runs it in its tasks."""

    def __init__(
        self,
        cfg: Config,
        store: Store,
        taxonomy: taxmod.Taxonomy,
        gate: Gate,
        *,
        play: Callable[[Run], Awaitable[StepOutcome]],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
        stopping: Callable[[], bool],
        canceled: Callable[[], bool],
        may_act: Callable[[], bool],
        metrics: Metrics | None,
        clock: Callable[[], float],
        sleep: Callable[[float], Any],
        responder: FirstResponder | None,
        dependencies: Callable[[], dict[str, str]] | None,
        failover: failmod.Stage | None,
        lifecycle: Lifecycle | None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.taxonomy = taxonomy
        self.gate = gate
        #: A playbook attempt's run: waits for a slot and its batch (runner.Batcher.run), returns its outcome.
        self._play = play
        self._spawn = spawn
        #: The engine stops taking work (stop(), abandon()); `_canceled`: running playbooks are canceled.
        self._stopping = stopping
        self._canceled = canceled
        #: False when this replica may not start an action now (its lease is not fresh).
        self._may_act = may_act
        self.metrics = metrics
        self.clock = clock
        self._sleep = sleep
        self.responder = responder
        self.dependencies = dependencies
        #: The third recovery stage (a job moves to a sibling cluster); None: off.
        self.failover = failover
        self.lifecycle = lifecycle
        self._failing_over: set[int] = set()
        #: Moves wait on Slurm for up to failover.timeout_s: their own threads, never the loop's default pool.
        self._failover_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="failover")

    def close(self) -> None:
        """At the engine's stop: no failover move starts any more."""
        self._failover_pool.shutdown(wait=False, cancel_futures=True)

    async def drive(self, iid: int, *, detach: bool = False) -> bool:
        """Advance the incident; with `detach`, stop (True) where it starts acting."""
        inc = self.store.get(iid)
        while inc is not None and inc.state not in TERMINAL and not self._stopping():
            if inc.state == "received":
                self._classify(inc)
            elif inc.state == "classified":
                if not self._gate(inc):
                    return False  # held
            elif inc.state == "gated":
                # No action starts whose outcome could not be recorded (a full disk: DiskFull, retried later).
                self.store.ensure_room()
                # The node takes the action's lifecycle state before the action starts (again on resume:
                # the transition is idempotent), never after.
                self._lifecycle_hook("allowed", inc)
                self.store.set_state(iid, "acting")
            elif inc.state == "acting":
                if detach:
                    return True
                await self.respond_first(inc)
                await self._fail_over(inc)
                await self._act(inc)
            inc = self.store.get(iid)
        if inc is not None and inc.resolved_at is not None:
            self.gate.maybe_release(inc.node)
        return False

    def _classify(self, inc: Incident) -> None:
        step = self.store.start_step(inc.id, "classify")
        t0 = self.clock()
        fault = self.taxonomy.faults.get(inc.fault_id)
        # A follow-up (the node's lifecycle) carries the fault that took the node out: its action must be one
        # the follow-up's action follows.
        expected = (
            self.taxonomy.actions[inc.action].follows
            if inc.parent_id is not None and inc.action in self.taxonomy.actions
            else (inc.action,)
        )
        if fault is None or fault.action not in expected or inc.node not in self.cfg.cluster.nodes:
            # The taxonomy or the cluster changed since the alert was accepted: never act on stale input.
            detail = f"{inc.fault_id} -> {inc.action} on {inc.node} is no longer valid (taxonomy or cluster changed)"
            self.store.end_step(step, "rejected", detail, (inc.id, "failed", {"outcome": detail}))
            self._finished(inc, "failed")
            return
        action = self.taxonomy.actions[fault.action]
        kind = "destructive" if action.destructive else "non-destructive"
        detail = f"{fault.id} ({fault.name}): class {fault.fault_class}, action {fault.action} ({kind})"
        self.store.end_step(step, "ok", detail, (inc.id, "classified", {}))
        self._observe_step("classify", inc.action, "ok", self.clock() - t0)

    def _gate(self, inc: Incident) -> bool:
        """Ask the gate; False when the incident is held (stays classified). The gate step, the decision and
        its record are one transaction: no other writer (a playbook thread, the lifecycle, an operator's
        release) changes the ledger between them, and a look that fails leaves nothing (the next one is
        the first again, counted once by the storm detector)."""
        with self.store.tx():
            steps = [s for s in self.store.steps(inc.id) if s.name == "gate"]
            open_step = next((s for s in reversed(steps) if s.ended_at is None), None)
            step_id = open_step.id if open_step else self.store.start_step(inc.id, "gate")
            verdict = self.gate.evaluate(inc, first=not steps)
            self.gate.record(inc, verdict, step_id)
        if verdict.kind != "hold" or hold_changed(inc, verdict):
            self._count_decision(verdict)
        if verdict.kind == "hold":
            if verdict.reason_kind in FAILOVER_HOLDS:
                self._fail_over_held(inc)
            return False
        self._observe_step("gate", inc.action, verdict.decision, self._since(step_id))
        if verdict.kind == "deny":
            self._finished(inc, "done")
        return True

    def _fail_over_held(self, inc: Incident) -> None:
        """The gate holds an isolation the cluster cannot afford (budget, breaker): once per incident, the
        node's jobs move to a sibling cluster if Slurm confirms the node is lost (failover.Stage.while_held)."""
        if self.failover is None or inc.id in self._failing_over or self._failed_over(inc.id):
            return
        if not self._may_act():
            return
        self._failing_over.add(inc.id)
        stage = self.failover
        dry = bool(inc.dry_run) or self.cfg.gate.dry_run

        async def run() -> None:
            try:
                # Not yet lost in Slurm's eyes: nothing is recorded; the held incident's next look asks again.
                if await asyncio.get_running_loop().run_in_executor(self._failover_pool, stage.node_lost, inc.node):
                    self.store.ensure_room()
                    await self._run_failover(inc, lambda: stage.while_held(inc.node, dry_run=dry))
            except StoreError as exc:
                log.warning("failover: database error; tried again when the incident is looked at", extra={
                    "incident": inc.ref, "error": str(exc)[:200]})  # fmt: skip
            except Exception:
                log.exception("failover failed", extra={"incident": inc.ref})
            finally:
                self._failing_over.discard(inc.id)

        self._spawn(run(), f"incident-{inc.id}-failover")

    async def respond_first(self, inc: Incident) -> None:
        if self.responder is not None and self.responder.handles(inc.action):
            first = [s for s in self.store.steps(inc.id) if s.name == FIRST_STEP]
            if not any(s.ended_at is not None for s in first):
                await self._first_response(inc, first[0].id if first else None)

    async def _first_response(self, inc: Incident, step_id: int | None) -> None:
        """The action's latency-critical steps in-process (responder.py), then the playbook as usual.

        Resumed after a crash by running it again (every step is idempotent per incident). A failed
        step is recorded and left to the playbook, which runs the same step with its retries.
        """
        assert self.responder is not None
        self._check_lead()
        sid = step_id if step_id is not None else self.store.start_step(inc.id, FIRST_STEP)
        started = self.clock()
        results: list[str] = []

        def record(result: Any) -> None:
            results.append(result.outcome)
            self._add_event(inc, "first_step", f"{result.step} {result.outcome}: {result.detail}", sid)

        try:
            await self.responder.respond(inc, record)
        except Exception as exc:
            log.warning("first response failed; the playbook takes over", extra={"incident": inc.ref})
            record_detail = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.store.end_step(
                sid, "failed", f"first response failed, left to the playbook: {record_detail}", reserve=True
            )
            self._observe_step(FIRST_STEP, inc.action, "failed", self.clock() - started)
            return
        result = "failed" if "failed" in results else "ok"
        self.store.end_step(sid, result, f"{len(results)} steps: {', '.join(results)}", reserve=True)
        self._observe_step(FIRST_STEP, inc.action, result, self.clock() - started)

    async def _fail_over(self, inc: Incident) -> None:
        """The third recovery stage after an isolation: when the first response found no standby node to
        promote, the jobs it requeued that Slurm cannot start here move to a sibling cluster (failover.py).
        Before the playbook, once per incident (a finished failover step is never run again)."""
        if self.failover is None or self._failed_over(inc.id):
            return
        events = [e.detail for e in self.store.events(inc.id)]
        requeued = [m.group(1) for d in events if (m := REQUEUED.match(d))]
        if not requeued or not any(d.startswith(NO_STANDBY) for d in events):
            return
        self._check_lead()
        stage = self.failover
        dry = bool(inc.dry_run)
        await self._run_failover(inc, lambda: stage.after_isolation(inc.ref, requeued, dry_run=dry))

    def _failed_over(self, iid: int) -> bool:
        return any(s.name == FAILOVER_STEP and s.ended_at is not None for s in self.store.steps(iid))

    async def _run_failover(self, inc: Incident, work: Callable[[], list[failmod.Decision]]) -> None:
        """Run the stage in a thread (it waits on Slurm); each decision is an event, the step's result the
        most telling one (moved > would-move > noop > refused > failed > none)."""
        open_step = next((s for s in self.store.steps(inc.id) if s.name == FAILOVER_STEP and s.ended_at is None), None)
        sid = open_step.id if open_step else self.store.start_step(inc.id, FAILOVER_STEP)
        started = self.clock()
        try:
            decisions = await asyncio.get_running_loop().run_in_executor(self._failover_pool, work)
        except Exception as exc:  # Slurm did not answer: recorded; the playbook and the gate go on
            detail = f"failover failed: {type(exc).__name__}: {str(exc)[:300]}"
            self.store.end_step(sid, "failed", detail, reserve=True)
            self._observe_step(FAILOVER_STEP, inc.action, "failed", self.clock() - started)
            return
        for d in decisions:
            where = f" to {d.target}" if d.target else ""
            self._add_event(inc, "failover", f"job {d.job_id} {d.action}{where}: {d.reason}", sid)
            if self.metrics is not None:
                self.metrics.failovers.labels(d.action).inc()
        actions = {d.action for d in decisions}
        result = next((a for a in ("moved", "would-move", "noop", "refused", "failed") if a in actions), "none")
        summary = "; ".join(f"{d.job_id} {d.action}" + (f" to {d.target}" if d.target else "") for d in decisions)
        self.store.end_step(sid, result, summary or "no job to move", reserve=True)
        self._observe_step(FAILOVER_STEP, inc.action, result, self.clock() - started)

    async def _act(self, inc: Incident) -> None:
        attempts = [s for s in self.store.steps(inc.id) if s.name == PLAYBOOK_STEP]
        for s in attempts:
            if s.ended_at is None:
                await self._interrupted(s)
        attempts = [s for s in self.store.steps(inc.id) if s.name == PLAYBOOK_STEP]
        if any(s.result == "successful" for s in attempts):
            self.store.set_state(inc.id, "done", outcome=self._outcome(inc, "successful"), reserve=True)
            self._finished(inc, "done")
            return
        failures = sum(1 for s in attempts if s.result not in ("interrupted", "successful"))
        interruptions = sum(1 for s in attempts if s.result == "interrupted")
        if failures > self.cfg.runner.retries or interruptions > MAX_INTERRUPTIONS:
            why = "retries exhausted" if failures > self.cfg.runner.retries else "interrupted too often"
            last = attempts[-1].detail.strip() if attempts else ""
            outcome = f"playbook failed: {why} after {len(attempts)} attempts" + (f" (last: {last[:300]})" * bool(last))
            self.store.set_state(inc.id, "failed", outcome=outcome, reserve=True)
            self._finished(inc, "failed")
            return
        if failures:
            await self._wait_for_dependencies(inc)
            delay = self.cfg.runner.backoff_s * 2 ** (failures - 1)
            self.store.add_event(inc.id, "backoff", f"retry in {delay:g} s (attempt {len(attempts) + 1})")
            await self._sleep(delay)
        await self._run_attempt(inc, len(attempts) + 1)

    async def _wait_for_dependencies(self, inc: Incident) -> None:
        """Before a retry: while slurmctld or the Kubernetes API server does not answer, wait for it. The
        attempt that failed most likely met the outage, and retrying into it would only spend the retries
        and fail the incident; the steps are idempotent, so the retry after it does nothing twice. The
        timeline and fleetheal_remediator_incidents_waiting{dependency} say what it waits for."""
        if self.dependencies is None:
            return
        loop = asyncio.get_running_loop()
        waiting: set[str] = set()
        deadline = time.monotonic() + DEPENDENCY_WAIT_MAX_S
        try:
            while not self._stopping():
                down = await loop.run_in_executor(None, self.dependencies)
                for name in sorted(down.keys() - waiting):
                    self.store.add_event(inc.id, "waiting", f"waiting for {name} before the retry: {down[name]}")
                    if self.metrics is not None:
                        self.metrics.incidents_waiting.labels(name).inc()
                for name in sorted(waiting - down.keys()):
                    self.store.add_event(inc.id, "waited", f"{name} answers again")
                    if self.metrics is not None:
                        self.metrics.incidents_waiting.labels(name).dec()
                waiting = set(down)
                if not down or time.monotonic() > deadline:
                    return
                await self._sleep(DEPENDENCY_POLL_S)
        finally:
            if self.metrics is not None:
                for name in waiting:
                    self.metrics.incidents_waiting.labels(name).dec()

    async def _interrupted(self, step: Step) -> None:
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(None, kill_leftovers, step.run_dir or "")
        detail = "interrupted (remediator stopped during the run); leftover processes killed"
        if left:
            detail += f", still alive: {left}"
        self.store.end_step(step.id, "interrupted", detail, reserve=True)
        try:
            self.store.add_event(step.incident_id, "interrupted", detail, step.id)
        except DiskFull as exc:  # the step's end says it; the next attempt waits for room (_check_lead)
            log.warning("disk full: the interruption's event is not recorded", extra={
                "incident": step.incident_id, "error": str(exc)[:200]})  # fmt: skip

    async def _run_attempt(self, inc: Incident, attempt: int) -> None:
        playbook = self.taxonomy.actions[inc.action].playbook
        self._check_lead()
        step_id = self.store.start_step(inc.id, PLAYBOOK_STEP, attempt, detail=playbook)
        request = StepRequest(
            incident_id=inc.id,
            step_id=step_id,
            attempt=attempt,
            action=inc.action,
            playbook=playbook,
            extravars={
                "fleetheal_incident_id": inc.ref,
                "fleetheal_node": inc.node,
                "fleetheal_fault_id": inc.fault_id,
                "fleetheal_fault_class": inc.fault_class,
                "fleetheal_action": inc.action,
                "fleetheal_cluster": inc.cluster,
                "fleetheal_dry_run": bool(inc.dry_run),
                "fleetheal_job_id": inc.run_job_id or "",
                "fleetheal_gpu": inc.gpu,
                # The pause switch now: a gate that let the incident through was not paused, but the switch
                # may have been turned on since; the playbook's guard then refuses to act.
                "fleetheal_paused": self.cfg.paused(),
                "fleetheal_budget_remaining": inc.budget_remaining,
            },
        )
        self.store.set_step_run_dir(step_id, str(run_dir_for(self.cfg.runner.run_dir, request)))
        started = self.clock()
        first_start: list[float] = []

        def on_event(event: RunnerEvent) -> None:
            if event.kind == "playbook_start" and not first_start:
                first_start.append(self.clock())
                if self.metrics is not None:
                    self.metrics.playbook_started(inc, first_start[0])
            try:
                if event.kind == "process" and event.pid is not None:
                    self.store.set_step_process(step_id, event.pid, process_start_time(event.pid))
                self.store.add_event(inc.id, event.kind, event.detail, step_id)
            except DiskFull as exc:
                # The run goes on and its outcome is recorded (the reserve); failing here would lose the outcome
                # and run the playbook again. Its processes are still found by its run directory.
                self._event_lost(inc, event.kind, exc)

        try:
            outcome = await self._play((request, on_event))
        except RunnerInputError as exc:
            detail = f"{playbook}: refused to run: {exc}"
            self.store.end_step(step_id, "error", detail, (inc.id, "failed", {"outcome": detail}), reserve=True)
            self._observe_step(PLAYBOOK_STEP, inc.action, "error", self.clock() - started)
            self._finished(inc, "failed")
            return
        except StoreError:
            raise  # the attempt stays open: taken up again, it is recorded as interrupted and run anew
        except Exception as exc:
            log.exception("playbook run raised", extra={"incident": inc.ref})
            outcome = StepOutcome("error", None, f"runner error: {type(exc).__name__}: {str(exc)[:200]}")
        if outcome.status == "canceled" and self._canceled():
            self.store.end_step(
                step_id, "interrupted", f"{playbook}: canceled at shutdown; resumed at the next start", reserve=True
            )
            return
        self._observe_step(PLAYBOOK_STEP, inc.action, outcome.status, self.clock() - started)
        detail = f"{playbook}: {outcome.detail}"
        if outcome.ok:
            self.store.end_step(
                step_id,
                "successful",
                detail,
                (inc.id, "done", {"outcome": self._outcome(inc, "successful")}),
                reserve=True,
            )
            self._finished(inc, "done")
        else:
            self.store.end_step(step_id, outcome.status, detail, reserve=True)

    def _outcome(self, inc: Incident, status: str) -> str:
        fresh = self.store.get(inc.id) or inc
        word = "would run" if fresh.dry_run else "ran"
        return f"{word} {self.taxonomy.actions[inc.action].playbook} for {inc.action} on {inc.node}: {status}"

    def fail(self, iid: int, why: str) -> None:
        inc = self.store.get(iid)
        if inc is not None and inc.state not in TERMINAL:
            self.store.set_state(iid, "failed", outcome=why)
            self._finished(inc, "failed")

    def _finished(self, inc: Incident, state: str) -> None:
        fresh = self.store.get(inc.id) or inc
        log.info(
            "incident finished",
            extra={
                "incident": inc.ref,
                "state": state,
                "node": inc.node,
                "action": inc.action,
                "outcome": fresh.outcome,
            },
        )
        if self.metrics is not None:
            self.metrics.incident_finished(fresh, self.clock())
        self._lifecycle_hook("finished", fresh)

    def _lifecycle_hook(self, hook: str, inc: Incident) -> None:
        """Tell the node lifecycle; a database error is retried like any (StoreError propagates), anything
        else is logged: the incident goes on either way, and the lifecycle's reconcile catches up."""
        if self.lifecycle is None:
            return
        fresh = self.store.get(inc.id) or inc
        try:
            if hook == "allowed":
                if not fresh.dry_run:
                    self.lifecycle.allowed(fresh)
            else:
                self.lifecycle.finished(fresh)
        except StoreError:
            raise
        except Exception:
            log.exception("node lifecycle: transition failed", extra={"incident": inc.ref, "hook": hook})

    def _check_lead(self) -> None:
        """Before an action starts: NotLeader unless this replica's lease is fresh (the store's fencing
        epoch then refuses any write that comes later still); DiskFull unless its outcome can be recorded
        (store/space.py: the incident waits, retried later, and /healthz says why)."""
        if not self._may_act():
            raise NotLeader("this replica's lease is not fresh: no action starts")
        self.store.ensure_room()

    def _add_event(self, inc: Incident, kind: str, detail: str, step_id: int) -> None:
        """An event of an action in progress; on a full disk it is logged instead, and the action goes on."""
        try:
            self.store.add_event(inc.id, kind, detail, step_id)
        except DiskFull as exc:
            self._event_lost(inc, kind, exc)

    @staticmethod
    def _event_lost(inc: Incident, kind: str, exc: DiskFull) -> None:
        log.warning(
            "disk full: an event of an action in progress is not recorded",
            extra={"incident": inc.ref, "kind": kind, "error": str(exc)[:200]},
        )

    def _since(self, step_id: int) -> float:
        step = self.store.step(step_id)
        if step is None:
            return 0.0
        return max(0.0, (step.ended_at or self.clock()) - step.started_at)

    def _observe_step(self, step: str, action: str, result: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.step(step, action, result, seconds)

    def _count_decision(self, verdict: Verdict) -> None:
        if self.metrics is not None:
            self.metrics.decision(verdict.decision, verdict.reason_kind)
