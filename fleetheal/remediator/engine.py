"""The remediator's scheduler: when each incident is taken up. What happens to it is stages.py's story.

An incident enters through `submit` (the webhook, a follower's write seen by the poller, the lifecycle's
follow-ups, the tick re-looking at held incidents, a retry after a database error) and waits in the queue.
The workers classify and gate it (`Stages.drive` up to where it starts acting); an incident allowed to act
is handed to a task of its own, which runs its first response at once (concurrently with every other
incident's: a storm's first responses never queue behind each other) and then waits for a playbook slot
(`runner.max_concurrent`). The playbooks never share the CPU with first responses either: one starts only
when no incident is queued or in its first response (or after FOLLOW_UP_HOLD_S, so that a steady stream of
faults cannot starve them). Attempts of the same playbook waiting for a slot run together (runner.Batcher).

Also here: the gate's tick and the poller of a shared store; the processing errors (a database error
delays an incident, never loses it); and the hand-over fence. Every playbook run passes `_run_runner`,
which counts it in `_runs_active` under `_runs_changed` and refuses to start once the replica stopped
acting, so `abandon()` (the replica lost the lead) can tell, from any thread, when no playbook of this
replica runs any more. `stop()` shuts the engine down; unfinished incidents resume at the next `start()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fleetheal import steps
from fleetheal import taxonomy as taxmod
from fleetheal.fleet import failover as failmod
from fleetheal.remediator.config import Config
from fleetheal.remediator.gate import Gate
from fleetheal.remediator.lifecycle import Lifecycle
from fleetheal.remediator.metrics import Metrics
from fleetheal.remediator.responder import FirstResponder
from fleetheal.remediator.rundirs import kill_leftovers, prune_run_dirs
from fleetheal.remediator.runner import Batcher, Outcomes, Run, Runner, StepOutcome
from fleetheal.remediator.stages import Stages
from fleetheal.remediator.store import TERMINAL, NotLeader, Store, StoreError

log = logging.getLogger("fleetheal.remediator.engine")

#: Held incidents are looked at again at least this often even when nothing seems to have changed.
FULL_RECHECK_S = 30.0
#: The longest a follow-up playbook waits for the first responses in progress to finish.
FOLLOW_UP_HOLD_S = 20.0
#: An incident whose processing hit a database error is taken up again after this delay, doubled on each
#: further error up to RETRY_MAX_S: a brief write failure (a full or failing disk) delays it, never loses it.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
#: Queued incidents that no worker has taken for this long mean the engine is stuck (/healthz: degraded).
STALL_S = 60.0
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
        self.responder = responder
        self.store = store
        self.runner = runner
        self.taxonomy = taxonomy or taxmod.load()
        self.metrics = metrics
        self.gate = Gate(cfg, store, self.taxonomy, clock)
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._queued: set[int] = set()
        self._inflight: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._follow_ups: set[asyncio.Task[None]] = set()
        self.batcher = Batcher(
            cfg.runner, execute=self._run_runner, shared_dir=store.set_step_run_dir, spawn=self._spawn
        )
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
        self.stages = Stages(
            cfg,
            store,
            self.taxonomy,
            self.gate,
            play=self.batcher.run,
            spawn=self._spawn,
            stopping=lambda: self._stopping,
            canceled=self._cancel.is_set,
            may_act=lambda: self.may_act is None or self.may_act(),
            metrics=metrics,
            clock=clock,
            sleep=sleep,
            responder=responder,
            dependencies=dependencies,
            failover=failover,
            lifecycle=self.lifecycle,
        )

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self, workers: int = 16) -> None:
        """Resume unfinished incidents, then start the workers and the gate's tick."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        problem = self.store.room_problem()  # makes the reserve for outcomes (store/space.py) where it is missing
        if problem is not None:
            log.warning("no action starts until space is freed", extra={"reason": problem})
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
        self.batcher.close()
        self.stages.close()
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
        disk = self.store.room_problem()  # a full disk: no action starts (store/space.py)
        if disk is not None:
            why.append(disk)
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
            detached = await self.stages.drive(iid, detach=True)
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
                    await self.stages.respond_first(inc)
            finally:
                self._responding -= 1
                self._maybe_quiet()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), FOLLOW_UP_HOLD_S)
            await self.stages.drive(iid)
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
            self.stages.fail(iid, "internal error while processing (see the remediator log)")
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
        """Remove old run directories (runner.keep_runs_days, runner.keep_runs; rundirs.prune_run_dirs), in a
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

    # --- the hand-over fence and the tasks -----------------------------------------------------------

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

    def _run_runner(self, runs: list[Run]) -> Outcomes:
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
