"""The incident state machine: received -> classified -> gated -> acting -> done | failed.

Every transition is persisted before the next step starts, and each step is a row with start, end and
result, so after a crash (SIGKILL) at any point `Engine.start()` resumes every unfinished incident:

- received:   classify again (pure, cheap);
- classified: ask the gate (a held incident waits in this state; the tick looks at it again);
- gated:      start acting;
- acting:     a playbook attempt with no end was interrupted: whatever still runs of it is killed, the
              attempt is recorded as `interrupted`, and a new attempt starts. A finished attempt is never
              run again; a successful one ends the incident.

Failed or timed-out attempts are retried `runner.retries` times with exponential backoff (remediation
playbooks are idempotent). Interrupted attempts (crash, shutdown) do not count as failures, but more
than MAX_INTERRUPTIONS of them fail the incident rather than loop forever.

The workers classify and gate; an incident allowed to act is handed to a task of its own, which runs
its first response at once (concurrently with every other incident's: a storm's first responses never
queue behind each other) and then waits for a playbook slot (`runner.max_concurrent`). The playbooks
never share the CPU with first responses either: one starts only when no incident is queued or in its
first response (or after FOLLOW_UP_HOLD_S, so that a steady stream of faults cannot starve them).
Attempts of the same playbook waiting for a slot run together, as one ansible-runner run over one host
per incident (at most `runner.max_hosts_per_run`; runner.py), each with its own result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fleetheal import steps
from fleetheal import taxonomy as taxmod
from fleetheal.fleet import failover as failmod
from fleetheal.remediator.config import Config
from fleetheal.remediator.gate import Gate, Verdict, hold_changed
from fleetheal.remediator.lifecycle import Lifecycle
from fleetheal.remediator.metrics import Metrics
from fleetheal.remediator.responder import FirstResponder
from fleetheal.remediator.runner import (
    Run,
    Runner,
    RunnerEvent,
    RunnerInputError,
    StepOutcome,
    StepRequest,
    kill_leftovers,
    process_start_time,
    prune_run_dirs,
    run_dir_for,
)
from fleetheal.remediator.store import TERMINAL, Incident, NotLeader, Step, Store, StoreError

log = logging.getLogger("fleetheal.remediator.engine")

MAX_INTERRUPTIONS = 5
#: Held incidents are looked at again at least this often even when nothing seems to have changed.
FULL_RECHECK_S = 30.0
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
#: The longest a follow-up playbook waits for the first responses in progress to finish.
FOLLOW_UP_HOLD_S = 20.0
#: Once a playbook slot is free, how long the attempts of one playbook gather before they run together.
BATCH_WINDOW_S = 0.25
#: An incident whose processing hit a database error is taken up again after this delay, doubled on each
#: further error up to RETRY_MAX_S: a brief write failure (a full or failing disk) delays it, never loses it.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
#: Queued incidents that no worker has taken for this long mean the engine is stuck (/healthz: degraded).
STALL_S = 60.0
#: Before a retry, while Slurm or the Kubernetes API server does not answer, ask again this often...
DEPENDENCY_POLL_S = 5.0
#: ... for at most this long; then the retry runs anyway (and counts if it fails).
DEPENDENCY_WAIT_MAX_S = 3600.0
#: Old run directories are pruned at the first tick after start-up, then this often (prune_runs).
PRUNE_INTERVAL_S = 3600.0
#: With a shared store (several replicas), how often the leader looks for what the followers persisted.
POLL_S = 0.25


class Engine:
    def __init__(
        self,
        cfg: Config,
        store: Store,
        runner: Runner,
        taxonomy: taxmod.Taxonomy | None = None,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = asyncio.sleep,
        responder: FirstResponder | None = None,
        dependencies: Callable[[], dict[str, str]] | None = None,
        settings: steps.Settings | None = None,
        failover: failmod.Stage | None = None,
    ) -> None:
        self.cfg = cfg
        #: The third recovery stage (a job moves to a sibling cluster); None: off.
        self.failover = failover
        self._failing_over: set[int] = set()
        #: Moves wait on Slurm for up to failover.timeout_s: their own threads, never the loop's default pool.
        self._failover_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="failover")
        self.responder = responder
        self.dependencies = dependencies
        self.store = store
        self.runner = runner
        self.taxonomy = taxonomy or taxmod.load()
        self.metrics = metrics
        self.clock = clock
        self._sleep = sleep
        self.gate = Gate(cfg, store, self.taxonomy, clock)
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._queued: set[int] = set()
        self._inflight: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._follow_ups: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=cfg.runner.max_concurrent, thread_name_prefix="playbook")
        self._slots = asyncio.Semaphore(cfg.runner.max_concurrent)
        self._waiting: dict[str, list[tuple[Run, asyncio.Future[Any]]]] = {}  # playbook -> attempts
        self._cancel = threading.Event()
        self._stopping = False
        #: Playbook runs between their start and their end (abandon() waits for none to be left).
        self._runs_active = 0
        self._runs_changed = threading.Condition()
        self._hold_state: tuple[bool, bool, int] | None = None
        self._last_recheck = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._responding = 0  # incidents being classified, gated or in their first response
        self._quiet = asyncio.Event()  # no incident queued, none in its fast part
        self._quiet.set()
        self._retrying: dict[int, int] = {}  # incident -> database errors in a row
        self._last_error = ""
        self._last_taken = time.monotonic()
        self._workers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        #: Called (in the loop) when the store refused a write because another replica leads now.
        self.on_fenced: Callable[[str], None] | None = None
        #: False when this replica may not start an action now (its lease is not fresh); None: always may.
        self.may_act: Callable[[], bool] | None = None
        #: Watermarks of what the followers persisted (shared store): incident and event ids seen.
        self._seen_incident = 0
        self._seen_event = 0
        self.lifecycle: Lifecycle | None = None
        if cfg.lifecycle.enabled:
            kube = getattr(responder, "kube", None)  # the first responder's client, when there is one
            if kube is None and settings is not None and settings.kubernetes:
                kube = _lazy(lambda: steps.kube_for(settings))
            self.lifecycle = Lifecycle(
                cfg,
                store,
                self.taxonomy,
                submit=self._submit_threadsafe,
                slurm=steps.Slurm(settings) if settings is not None else None,
                kube=kube,
                settings=settings,
                on_transition=metrics.node_left_state if metrics is not None else None,
                clock=clock,
            )

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self, workers: int = 16) -> None:
        """Resume unfinished incidents, then start the workers and the gate's tick."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        resumed = [inc.id for inc in self.store.unfinished() if inc.hold_reason is None]
        if resumed:
            log.info("resuming unfinished incidents", extra={"count": len(resumed)})
        self.submit(resumed)
        if self.responder is not None:
            asyncio.get_running_loop().run_in_executor(None, self.responder.warm)
        self._workers = workers
        self._tasks = [asyncio.create_task(self._worker(), name=f"engine-worker-{i}") for i in range(workers)]
        self._tasks.append(asyncio.create_task(self._ticker(), name="engine-tick"))
        if self.cfg.leader_election.enabled:
            self._seen_incident, self._seen_event = self.store.watermarks()
            self._tasks.append(asyncio.create_task(self._poller(), name="engine-tick-poll"))

    def abandon(self, timeout_s: float = 5.0) -> bool:
        """From any thread, when the replica loses the lead: start nothing more, cancel the running playbooks
        and kill every playbook process under the run directory, and return True once none is left *and* no
        playbook run is still between its start and its end (one that had not yet spawned its process when
        the processes were listed would spawn it after: it is killed on the next round). False when that
        could not be seen within `timeout_s` (a process that survives SIGKILL). `stop()` then tidies up in
        the loop."""
        with self._runs_changed:
            self._stopping = True
            self._cancel.set()
        deadline = time.monotonic() + timeout_s
        while True:
            left = kill_leftovers(self.cfg.runner.run_dir, timeout_s=max(0.0, min(0.5, deadline - time.monotonic())))
            with self._runs_changed:
                if not left and not self._runs_active:
                    return True
                if time.monotonic() >= deadline:
                    log.error("playbook processes still there after the fence's timeout", extra={
                        "pids": left, "runs": self._runs_active, "timeout_s": timeout_s})  # fmt: skip
                    return False
                self._runs_changed.wait(0.05)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking work; running playbooks get `grace_s` to finish, then are canceled (resumed later)."""
        self._stopping = True
        for task in self._tasks:
            if task.get_name().startswith("engine-tick"):
                task.cancel()
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._cancel.set()  # runners kill their playbook; the attempt is recorded as interrupted
        deadline = time.monotonic() + 5.0
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks = [*self._tasks, *self._follow_ups]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._failover_pool.shutdown(wait=False, cancel_futures=True)
        if self.responder is not None:
            self.responder.close()

    def submit(self, incident_ids: Iterable[int]) -> None:
        for iid in incident_ids:
            if iid not in self._queued:
                self._queued.add(iid)
                self._idle.clear()
                self._quiet.clear()
                self._queue.put_nowait(iid)

    def _submit_threadsafe(self, incident_ids: Iterable[int]) -> None:
        """`submit` from any thread (the lifecycle's reconcile runs in one)."""
        ids = list(incident_ids)
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.submit, ids)
        else:
            self.submit(ids)

    def resolved(self, incident_ids: Iterable[int]) -> None:
        """Alerts resolved: release finished isolations; held incidents are looked at again at once."""
        for iid in incident_ids:
            inc = self.store.get(iid)
            if inc is None:
                continue
            if inc.state in TERMINAL:
                self.gate.maybe_release(inc.node)
            elif inc.hold_reason is not None:
                self.submit([iid])

    def queue_depth(self) -> int:
        return self.store.held_count()

    def health(self) -> list[str]:
        """Why incidents are not moving, if they are not (empty when healthy): /healthz says degraded."""
        why = []
        alive = sum(1 for t in self._tasks if t.get_name().startswith("engine-worker") and not t.done())
        if self._tasks and alive < self._workers and not self._stopping:
            why.append(f"{self._workers - alive} of {self._workers} workers have stopped")
        if self._retrying:
            why.append(
                f"{len(self._retrying)} incident(s) waiting to retry after database errors (last: {self._last_error})"
            )
        waited = time.monotonic() - self._last_taken
        if not self._queue.empty() and waited > STALL_S:
            why.append(f"{self._queue.qsize()} incident(s) queued and none taken for {waited:.0f} s")
        return why

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no incident is queued or being worked on (held ones wait at the gate). For tests."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    # --- loops -----------------------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            iid = await self._queue.get()
            self._last_taken = time.monotonic()
            self._queued.discard(iid)
            if self._stopping:
                return
            try:
                await self._work(iid)
            except asyncio.CancelledError:
                raise
            except Exception:  # whatever one incident does, the worker lives on for the next
                log.exception("engine worker error", extra={"incident": iid})

    async def _work(self, iid: int) -> None:
        if iid in self._inflight:
            self._maybe_quiet()
            return
        self._inflight.add(iid)
        self._responding += 1
        detached = False
        try:
            detached = await self._drive(iid, detach=True)
            if not detached:
                self._retrying.pop(iid, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._crashed(iid)
        finally:
            if detached:  # still responding: the task counts it down when its first response ended
                self._spawn(self._follow_up(iid), f"incident-{iid}-act")
            else:
                self._responding -= 1
                self._done(iid)
                self._maybe_quiet()

    async def _follow_up(self, iid: int) -> None:
        """An incident allowed to act, outside the workers: its first response, then its playbook."""
        try:
            try:
                inc = self.store.get(iid)
                if inc is not None and inc.state == "acting":
                    await self._respond_first(inc)
            finally:
                self._responding -= 1
                self._maybe_quiet()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), FOLLOW_UP_HOLD_S)
            await self._drive(iid)
            self._retrying.pop(iid, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._crashed(iid)
        finally:
            self._done(iid)

    def _maybe_quiet(self) -> None:
        if not self._responding and not self._queued:
            self._quiet.set()

    def _crashed(self, iid: int) -> None:
        """Called from an exception handler. A database error is not the incident's fault: it is taken up
        again after a backoff. Anything else is a bug: the incident fails, with the log saying why."""
        exc = sys.exc_info()[1]
        if isinstance(exc, NotLeader):
            log.warning("another replica leads now; this one stops acting", extra={"incident": iid})
            if self.on_fenced is not None and not self._stopping:
                self.on_fenced(str(exc))
            return
        if isinstance(exc, StoreError):
            self._retry_later(iid, exc)
            return
        log.exception("incident processing failed", extra={"incident": iid})
        try:
            self._fail(iid, "internal error while processing (see the remediator log)")
        except StoreError as db_exc:
            self._retry_later(iid, db_exc)

    def _retry_later(self, iid: int, exc: BaseException) -> None:
        errors = self._retrying[iid] = self._retrying.get(iid, 0) + 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (errors - 1))
        self._last_error = f"{type(exc).__name__}: {exc}"[:200]
        log.warning(
            "database error; the incident is taken up again later",
            extra={"incident": iid, "error": self._last_error, "retry_in_s": delay},
        )
        if self.metrics is not None:
            self.metrics.engine_errors.inc()
        if not self._stopping:
            asyncio.get_running_loop().call_later(delay, self._resubmit, iid)

    def _resubmit(self, iid: int) -> None:
        if not self._stopping:
            self.submit([iid])

    def _done(self, iid: int) -> None:
        self._inflight.discard(iid)
        if not self._inflight and not self._queued and not self._retrying:
            self._idle.set()

    async def _ticker(self) -> None:
        next_prune = 0.0
        next_reconcile = 0.0
        while True:
            await asyncio.sleep(self.cfg.gate.recheck_interval_s)
            try:
                self.tick()
            except StoreError as exc:
                log.warning("gate tick: database error; next tick", extra={"error": str(exc)[:200]})
            except Exception:
                log.exception("gate tick failed")
            if self.lifecycle is not None and time.monotonic() >= next_reconcile:
                next_reconcile = time.monotonic() + self.cfg.lifecycle.reconcile_interval_s
                self._spawn(self.reconcile(), "lifecycle-reconcile")
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_INTERVAL_S
                self._spawn(self.prune_runs(), "prune-runs")

    async def _poller(self) -> None:
        """Shared store: take up what the other replicas persisted (new incidents, resolved alerts)."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.poll()
            except StoreError as exc:
                log.info("polling the store failed; next period", extra={"error": str(exc)[:200]})

    def poll(self) -> None:
        created, resolved, self._seen_incident, self._seen_event = self.store.since(
            self._seen_incident, self._seen_event
        )
        self.submit(created)
        self.resolved(resolved)

    async def reconcile(self) -> None:
        """The node lifecycle's look at Slurm and the Nodes (lifecycle.Lifecycle.reconcile), in a thread."""
        if self.lifecycle is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.lifecycle.reconcile)
        except Exception:
            log.exception("lifecycle reconcile failed")

    async def prune_runs(self) -> list[str]:
        """Remove old run directories (runner.keep_runs_days, runner.keep_runs; runner.prune_run_dirs), in a
        thread. Those of unfinished incidents stay, and so does every run directory a step of one names (a
        batch runs in its first attempt's directory, maybe another incident's): the engine resumes from them."""
        try:
            r = self.cfg.runner
            busy: set[str] = set()
            for inc in self.store.unfinished():
                busy.add(str(Path(r.run_dir) / inc.ref))
                busy.update(step.run_dir for step in self.store.steps(inc.id) if step.run_dir)
            loop = asyncio.get_running_loop()
            removed = await loop.run_in_executor(None, prune_run_dirs, r.run_dir, r.keep_runs_days, r.keep_runs, busy)
        except Exception:
            log.exception("pruning the run directories failed")
            return []
        if removed:
            log.info("pruned old run directories", extra={"count": len(removed)})
        return removed

    def tick(self) -> None:
        """Close a quiet breaker; when what holds incidents changed, put them back in the queue, oldest first.

        Held incidents wait on the pause switch, the breaker or the budget; looking at hundreds of them
        every interval during a storm would cost more than the storm, so they are looked at again only
        when one of those changed (or every FULL_RECHECK_S, in case something else did).
        """
        self.gate.tick()
        state = (self.cfg.paused(), self.gate.breaker_open(), sum(self.store.isolation_counts().values()))
        now = time.monotonic()
        if state == self._hold_state and now - self._last_recheck < FULL_RECHECK_S:
            return
        self._hold_state = state
        self._last_recheck = now
        self.submit(inc.id for inc in self.store.held() if inc.id not in self._inflight)

    # --- the state machine ------------------------------------------------------------------------------

    async def _drive(self, iid: int, *, detach: bool = False) -> bool:
        """Advance the incident; with `detach`, stop (True) where it starts acting."""
        inc = self.store.get(iid)
        while inc is not None and inc.state not in TERMINAL and not self._stopping:
            if inc.state == "received":
                self._classify(inc)
            elif inc.state == "classified":
                if not self._gate(inc):
                    return False  # held
            elif inc.state == "gated":
                # The node takes the action's lifecycle state before the action starts (again on resume:
                # the transition is idempotent), never after.
                self._lifecycle_hook("allowed", inc)
                self.store.set_state(iid, "acting")
            elif inc.state == "acting":
                if detach:
                    return True
                await self._respond_first(inc)
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

    async def _respond_first(self, inc: Incident) -> None:
        if self.responder is not None and self.responder.handles(inc.action):
            first = [s for s in self.store.steps(inc.id) if s.name == FIRST_STEP]
            if not any(s.ended_at is not None for s in first):
                await self._first_response(inc, first[0].id if first else None)

    async def _act(self, inc: Incident) -> None:
        attempts = [s for s in self.store.steps(inc.id) if s.name == PLAYBOOK_STEP]
        for s in attempts:
            if s.ended_at is None:
                await self._interrupted(s)
        attempts = [s for s in self.store.steps(inc.id) if s.name == PLAYBOOK_STEP]
        if any(s.result == "successful" for s in attempts):
            self.store.set_state(inc.id, "done", outcome=self._outcome(inc, "successful"))
            self._finished(inc, "done")
            return
        failures = sum(1 for s in attempts if s.result not in ("interrupted", "successful"))
        interruptions = sum(1 for s in attempts if s.result == "interrupted")
        if failures > self.cfg.runner.retries or interruptions > MAX_INTERRUPTIONS:
            why = "retries exhausted" if failures > self.cfg.runner.retries else "interrupted too often"
            last = attempts[-1].detail.strip() if attempts else ""
            outcome = f"playbook failed: {why} after {len(attempts)} attempts" + (f" (last: {last[:300]})" * bool(last))
            self.store.set_state(inc.id, "failed", outcome=outcome)
            self._finished(inc, "failed")
            return
        if failures:
            await self._wait_for_dependencies(inc)
            delay = self.cfg.runner.backoff_s * 2 ** (failures - 1)
            self.store.add_event(inc.id, "backoff", f"retry in {delay:g} s (attempt {len(attempts) + 1})")
            await self._sleep(delay)
        await self._run_attempt(inc, len(attempts) + 1)

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

    def _fail_over_held(self, inc: Incident) -> None:
        """The gate holds an isolation the cluster cannot afford (budget, breaker): once per incident, the
        node's jobs move to a sibling cluster if Slurm confirms the node is lost (failover.Stage.while_held)."""
        if self.failover is None or inc.id in self._failing_over or self._failed_over(inc.id):
            return
        if self.may_act is not None and not self.may_act():
            return
        self._failing_over.add(inc.id)
        stage = self.failover
        dry = bool(inc.dry_run) or self.cfg.gate.dry_run

        async def run() -> None:
            try:
                # Not yet lost in Slurm's eyes: nothing is recorded; the held incident's next look asks again.
                if await asyncio.get_running_loop().run_in_executor(self._failover_pool, stage.node_lost, inc.node):
                    await self._run_failover(inc, lambda: stage.while_held(inc.node, dry_run=dry))
            except StoreError as exc:
                log.warning("failover: database error; tried again when the incident is looked at", extra={
                    "incident": inc.ref, "error": str(exc)[:200]})  # fmt: skip
            except Exception:
                log.exception("failover failed", extra={"incident": inc.ref})
            finally:
                self._failing_over.discard(inc.id)

        self._spawn(run(), f"incident-{inc.id}-failover")

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
            self.store.end_step(sid, "failed", detail)
            self._observe_step(FAILOVER_STEP, inc.action, "failed", self.clock() - started)
            return
        for d in decisions:
            where = f" to {d.target}" if d.target else ""
            self.store.add_event(inc.id, "failover", f"job {d.job_id} {d.action}{where}: {d.reason}", sid)
            if self.metrics is not None:
                self.metrics.failovers.labels(d.action).inc()
        actions = {d.action for d in decisions}
        result = next((a for a in ("moved", "would-move", "noop", "refused", "failed") if a in actions), "none")
        summary = "; ".join(f"{d.job_id} {d.action}" + (f" to {d.target}" if d.target else "") for d in decisions)
        self.store.end_step(sid, result, summary or "no job to move")
        self._observe_step(FAILOVER_STEP, inc.action, result, self.clock() - started)

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
            while not self._stopping:
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
            self.store.add_event(inc.id, "first_step", f"{result.step} {result.outcome}: {result.detail}", sid)

        try:
            await self.responder.respond(inc, record)
        except Exception as exc:
            log.warning("first response failed; the playbook takes over", extra={"incident": inc.ref})
            record_detail = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.store.end_step(sid, "failed", f"first response failed, left to the playbook: {record_detail}")
            self._observe_step(FIRST_STEP, inc.action, "failed", self.clock() - started)
            return
        result = "failed" if "failed" in results else "ok"
        self.store.end_step(sid, result, f"{len(results)} steps: {', '.join(results)}")
        self._observe_step(FIRST_STEP, inc.action, result, self.clock() - started)

    async def _interrupted(self, step: Step) -> None:
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(None, kill_leftovers, step.run_dir or "")
        detail = "interrupted (remediator stopped during the run); leftover processes killed"
        if left:
            detail += f", still alive: {left}"
        self.store.end_step(step.id, "interrupted", detail)
        self.store.add_event(step.incident_id, "interrupted", detail, step.id)

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
            if event.kind == "process" and event.pid is not None:
                self.store.set_step_process(step_id, event.pid, process_start_time(event.pid))
            if event.kind == "playbook_start" and not first_start:
                first_start.append(self.clock())
                if self.metrics is not None:
                    self.metrics.playbook_started(inc, first_start[0])
            self.store.add_event(inc.id, event.kind, event.detail, step_id)

        try:
            outcome = await self._run_playbook((request, on_event))
        except RunnerInputError as exc:
            detail = f"{playbook}: refused to run: {exc}"
            self.store.end_step(step_id, "error", detail, (inc.id, "failed", {"outcome": detail}))
            self._observe_step(PLAYBOOK_STEP, inc.action, "error", self.clock() - started)
            self._finished(inc, "failed")
            return
        except StoreError:
            raise  # the attempt stays open: taken up again, it is recorded as interrupted and run anew
        except Exception as exc:
            log.exception("playbook run raised", extra={"incident": inc.ref})
            outcome = StepOutcome("error", None, f"runner error: {type(exc).__name__}: {str(exc)[:200]}")
        if outcome.status == "canceled" and self._cancel.is_set():
            self.store.end_step(step_id, "interrupted", f"{playbook}: canceled at shutdown; resumed at the next start")
            return
        self._observe_step(PLAYBOOK_STEP, inc.action, outcome.status, self.clock() - started)
        detail = f"{playbook}: {outcome.detail}"
        if outcome.ok:
            self.store.end_step(
                step_id, "successful", detail, (inc.id, "done", {"outcome": self._outcome(inc, "successful")})
            )
            self._finished(inc, "done")
        else:
            self.store.end_step(step_id, outcome.status, detail)

    async def _run_playbook(self, run: Run) -> StepOutcome:
        """Wait for a slot with the other attempts of the same playbook; run with them; this one's outcome."""
        done: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
        playbook = run[0].playbook
        waiting = self._waiting.setdefault(playbook, [])
        waiting.append((run, done))
        if len(waiting) == 1:  # nobody is gathering this playbook's attempts yet
            self._spawn(self._gather(playbook), f"playbook-{playbook}")
        return await done

    async def _gather(self, playbook: str) -> None:
        waiting = self._waiting[playbook]
        while waiting:
            await self._slots.acquire()
            await asyncio.sleep(BATCH_WINDOW_S)
            batch = waiting[: self.cfg.runner.max_hosts_per_run]
            del waiting[: len(batch)]
            self._spawn(self._run_batch(batch), f"playbook-{playbook}-run")
        del self._waiting[playbook]  # no await since the loop's test: nothing joined in between

    async def _run_batch(self, batch: list[tuple[Run, asyncio.Future[Any]]]) -> None:
        try:
            outcomes: list[StepOutcome | Exception]
            try:  # whatever fails here (the database too) is every attempt's outcome: none waits forever
                run_dir = str(run_dir_for(self.cfg.runner.run_dir, batch[0][0][0]))
                for (request, _), _ in batch[1:]:  # a batch runs in its first attempt's directory
                    self.store.set_step_run_dir(request.step_id, run_dir)
                loop = asyncio.get_running_loop()
                runs = [run for run, _ in batch]
                outcomes = [*await loop.run_in_executor(self._executor, self._run_runner, runs)]
            except Exception as exc:
                outcomes = [exc] * len(batch)
            for (_, done), outcome in zip(batch, outcomes, strict=True):
                if done.done():
                    continue
                if isinstance(outcome, BaseException):
                    done.set_exception(outcome)
                else:
                    done.set_result(outcome)
        finally:
            self._slots.release()

    def _run_runner(self, runs: list[Run]) -> list[StepOutcome | RunnerInputError]:
        """In a playbook thread: the runner's batch, unless the replica lost the lead (abandon()) first."""
        with self._runs_changed:
            if self._cancel.is_set():
                return [StepOutcome("canceled", None, "not started: the replica stopped acting")] * len(runs)
            self._runs_active += 1
        try:
            return self.runner.run_batch(runs, self._cancel.is_set)
        finally:
            with self._runs_changed:
                self._runs_active -= 1
                self._runs_changed.notify_all()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._follow_ups.add(task)
        task.add_done_callback(self._follow_ups.discard)

    # --- helpers ---------------------------------------------------------------------------------------

    def _check_lead(self) -> None:
        """Before an action starts: NotLeader unless this replica's lease is fresh (the store's fencing
        epoch then refuses any write that comes later still)."""
        if self.may_act is not None and not self.may_act():
            raise NotLeader("this replica's lease is not fresh: no action starts")

    def _outcome(self, inc: Incident, status: str) -> str:
        fresh = self.store.get(inc.id) or inc
        word = "would run" if fresh.dry_run else "ran"
        return f"{word} {self.taxonomy.actions[inc.action].playbook} for {inc.action} on {inc.node}: {status}"

    def _since(self, step_id: int) -> float:
        step = self.store.step(step_id)
        if step is None:
            return 0.0
        return max(0.0, (step.ended_at or self.clock()) - step.started_at)

    def _fail(self, iid: int, why: str) -> None:
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

    def _observe_step(self, step: str, action: str, result: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.step(step, action, result, seconds)

    def _count_decision(self, verdict: Verdict) -> None:
        if self.metrics is not None:
            self.metrics.decision(verdict.decision, verdict.reason_kind)


def _lazy(build: Callable[[], Any]) -> Callable[[], Any]:
    """`build()` once, on first call (a Kubernetes client costs a second to load)."""
    made: list[Any] = []
    lock = threading.Lock()

    def get() -> Any:
        with lock:
            if not made:
                made.append(build())
            return made[0]

    return get
