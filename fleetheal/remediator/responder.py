"""The first responder: the latency-critical steps of an action, in-process, the moment the gate allows.

Seconds matter only until the job runs again (DESIGN.md, "Where each step runs"). For the taxonomy's
`first_response: true` actions the remediator does not wait for ansible-runner. One that takes the node out
(destructive) cordons and taints the Kubernetes node while it drains the Slurm node (the agent usually has),
and then, concurrently, promotes a warm standby and sends every job on the node its grace signal at once,
waits the grace period and requeues them all with one command; one that keeps the node requeues the job in
place, on the same nodes.
Then the engine starts the action's playbook for what may take minutes (evictions under PDBs, the pool
label, the NodeSet record, the refill request); the playbook calls the same steps (`fleetheal.steps`,
through the collection's modules), finds them done for this incident and goes on.

A crash in the middle is safe: every step is idempotent per incident, and the engine runs the first
response again on resume. A step that fails is recorded and left to the playbook, which retries it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleetheal import contracts, steps
from fleetheal import taxonomy as taxmod
from fleetheal.remediator.store import Incident

log = logging.getLogger("fleetheal.remediator.responder")


class FirstResponder:
    def __init__(
        self,
        settings: steps.Settings,
        *,
        workers: int = 192,
        kube_factory: Callable[[steps.Settings], steps.Kube | None] = steps.kube_for,
        taxonomy: taxmod.Taxonomy | None = None,
    ) -> None:
        self.settings = settings
        #: Actions with a first response (the taxonomy's `first_response: true`); the rest go straight to
        #: their playbook.
        self.taxonomy = taxonomy or taxmod.load()
        self.slurm = steps.Slurm(settings)
        self._kube_factory = kube_factory
        self._kube: steps.Kube | None = None
        self._kube_ready = False
        self._kube_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="responder")
        # The API server's calls wait in a pool of their own (one thread per kept connection), so that a
        # storm's cordons never hold back its grace signals and requeues.
        self._kube_pool = ThreadPoolExecutor(max_workers=steps.Kube.CONNECTIONS, thread_name_prefix="responder-k8s")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._kube_pool.shutdown(wait=False, cancel_futures=True)

    def handles(self, action: str) -> bool:
        a = self.taxonomy.actions.get(action)
        if a is None or not a.first_response:
            return False
        # A restart in place (an action that keeps its node) that only signals (`fleetheal_restart_mode:
        # signal`) is one command the playbook sends; nothing in Slurm would tell the playbook it was sent.
        return a.destructive or self.settings.restart_mode == "requeue"

    def _in_place(self, action: str) -> bool:
        """A first response that keeps the node (not destructive) requeues the job on the same nodes."""
        return not self.taxonomy.actions[action].destructive

    def kube(self) -> steps.Kube | None:
        with self._kube_lock:
            if not self._kube_ready:
                self._kube = self._kube_factory(self.settings)
                self._kube_ready = True
            return self._kube

    def warm(self) -> None:
        """Before the first fault: load the Kubernetes client and open the connections the cordons will use
        (seconds on a small machine, and a TLS handshake per connection, which the first incidents of a
        storm would otherwise wait for): one request on each of the Kubernetes pool's threads at once."""
        try:
            kube = self.kube()
            if kube is None:
                return
            kube.core.list_node(limit=1, _preload_content=False)
            ready = threading.Barrier(steps.Kube.CONNECTIONS)

            def connect() -> None:
                ready.wait(timeout=10)  # all at once, so that each opens a connection of its own
                kube.core.list_node(limit=1, _preload_content=False, _request_timeout=kube.TIMEOUT_S)

            for f in [self._kube_pool.submit(connect) for _ in range(steps.Kube.CONNECTIONS)]:
                f.result()
        except Exception as exc:
            log.warning("Kubernetes API not reachable yet", extra={"error": str(exc)[:300]})

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def _kube_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kube_pool, lambda: fn(self.kube(), *args, **kwargs))

    async def respond(self, inc: Incident, record: Callable[[steps.StepResult], None]) -> None:
        """Run the first response of `inc`'s action; each step's result goes to `record` as it ends."""
        dry = bool(inc.dry_run)
        job_id = inc.run_job_id or ""
        if self._in_place(inc.action):
            await self._requeue(inc, job_id, dry, record, same_nodes=True)
            return
        reason = contracts.drain_reason(inc.fault_id, inc.ref, inc.gpu or None)

        def branch(step: str, work: Any) -> asyncio.Future[None]:
            return asyncio.ensure_future(self._guard(record, step, work))

        # The cordon depends on nothing in Slurm: it starts at once, beside the drain (in a storm the API
        # server's queue and slurmctld's are different queues).
        tasks = [branch("k8s_cordon", self._cordon(inc, dry, record))]
        # The nodes and the jobs are read at once, before the drain and the promotion change anything
        # (the promotion picks from the same read). Any read taken since the alert arrived will do: a
        # storm's incidents share the reads in flight. The drain waits for the node read only (the job read
        # is the slower one: JSON, every job).
        since = inc.received_at
        jobs = asyncio.ensure_future(self._call(self.slurm.squeue, since))
        try:
            read = await self._call(self.slurm.sinfo_at, since)
            record(await self._call(steps.drain_node, self.slurm, inc.node, reason, dry_run=dry, sinfo=read[1]))
            tasks.append(branch("slurm_requeue", self._requeue(inc, job_id, dry, record, squeue=jobs)))
            if self.settings.promote_standby:
                tasks.append(branch("standby_promote", self._promote(inc, dry, record, read)))
        finally:
            # A failed drain still lets the cordon finish (and be recorded) before the error goes up; the job
            # read is awaited either way (its error, if the requeue never took it, is the drain's news).
            await asyncio.gather(*tasks)
            await asyncio.gather(jobs, return_exceptions=True)

    async def _guard(self, record: Callable[[steps.StepResult], None], step: str, work: Any) -> None:
        """One branch failing leaves the others running; the playbook retries what failed."""
        try:
            await work
        except Exception as exc:
            log.warning("first-response step failed", extra={"step": step, "error": str(exc)[:300]})
            record(steps.StepResult(step, "failed", f"{type(exc).__name__}: {str(exc)[:300]}"))

    async def _cordon(self, inc: Incident, dry: bool, record: Callable[[steps.StepResult], None]) -> None:
        record(await self._kube_call(steps.k8s_isolate, inc.node, inc.fault_id, dry_run=dry))

    async def _promote(
        self, inc: Incident, dry: bool, record: Callable[[steps.StepResult], None], read: tuple[float, Any]
    ) -> None:
        result = await self._call(steps.promote_standby, self.slurm, inc.node, inc.ref, dry_run=dry, read=read)
        record(result)
        if result.changed:
            record(await self._kube_call(steps.k8s_promote, result.node, dry_run=dry))

    async def _requeue(
        self,
        inc: Incident,
        job_id: str,
        dry: bool,
        record: Callable[[steps.StepResult], None],
        *,
        same_nodes: bool = False,
        squeue: Any = None,
    ) -> None:
        """`steps.requeue_jobs`, with the grace period awaited instead of slept in a thread."""
        s = self.settings
        if isinstance(squeue, asyncio.Future):
            squeue = await squeue
        plan: steps.RequeuePlan = await self._call(
            steps.requeue_plan, self.slurm, inc.node, inc.ref, job_id=job_id, squeue=squeue
        )
        for r in plan.results:
            record(r)
        if dry:
            for r in steps.requeue_would(self.slurm, plan, same_nodes=same_nodes):
                record(r)
            return
        if not plan.jobs:
            return
        record(await self._call(steps.signal_jobs, self.slurm, [j["job_id"] for j in plan.jobs], s.grace_signal))
        if s.grace_seconds > 0:
            await asyncio.sleep(s.grace_seconds)
        for r in await self._call(
            steps.requeue_now, self.slurm, plan, inc.node, inc.ref, inc.fault_id, same_nodes=same_nodes
        ):
            record(r)
