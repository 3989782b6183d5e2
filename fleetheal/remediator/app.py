"""The remediator's HTTP service (aiohttp).

- `POST /webhook`: Alertmanager's webhook. Bearer token (else 401, nothing read), body size limit (413),
  strict validation (400 with the reason), persist in SQLite, then 202; the work happens afterwards in
  the engine. A payload mixing valid and invalid alerts is accepted for the valid ones (202, the body
  lists the rejected ones); one without any valid alert is a 400. A firing alert that is already over
  (its resolution arrived first, or its endsAt is past) is counted and logged, and never acts.
- `GET /healthz`: 200 while the database answers and incidents move; 503 "degraded" with the reasons when
  workers stopped, incidents wait to retry after database errors, the queue stalled, or the database's
  disk is too full to record an action's outcome (no action starts then: store/space.py).
- `GET /metrics`: Prometheus text format (see metrics.py).

`Service` wires config, store, engine, runner and metrics together; serve.py starts it and runs it until
SIGTERM, fleetheal/connguard.py guards it against slow clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from fleetheal import steps
from fleetheal import taxonomy as taxmod
from fleetheal.connguard import ConnectionGuard
from fleetheal.fleet import config as fleetcfg
from fleetheal.fleet import failover as failmod
from fleetheal.remediator import alerts
from fleetheal.remediator.config import MIN_TOKEN_LENGTH, Config, ConfigError, require_token
from fleetheal.remediator.engine import Engine
from fleetheal.remediator.leader import LeaderElector, Probe, api_client
from fleetheal.remediator.lending import LendingController
from fleetheal.remediator.lifecycle import LifecycleError
from fleetheal.remediator.membership import MembershipController
from fleetheal.remediator.metrics import CONTENT_TYPE, Metrics
from fleetheal.remediator.responder import FirstResponder
from fleetheal.remediator.runner import AnsibleRunner, Runner
from fleetheal.remediator.store import IngestResult, Store, StoreError, incident_ref

log = logging.getLogger("fleetheal.remediator")

WEBHOOK_PATH = "/webhook"
#: Seconds /healthz reuses its counts of incidents (a probe every few seconds sees them fresh).
HEALTH_COUNTS_S = 1.0
#: The operators' node API: a node's repair is done (fleetheal nodes repaired NODE).
NODE_REPAIRED_PATH = "/api/v1/nodes/{node}/repaired"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class GroupCommit:
    """Requests that arrive while a commit is on its way to disk share the next one.

    Every 202 still waits for its own alerts to be durable, but one fsync serves many requests. What is
    committed is handed to `on_committed` here, not by the request handler, so an incident is queued for
    the engine even if its client went away before the answer.
    """

    def __init__(self, store: Store, on_committed: Callable[[IngestResult], None]) -> None:
        self.store = store
        self.on_committed = on_committed
        self._pending: list[tuple[Sequence[alerts.Alert], asyncio.Future[IngestResult]]] = []
        self._running = False
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest")

    async def ingest(self, batch: Sequence[alerts.Alert]) -> IngestResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[IngestResult] = loop.create_future()
        self._pending.append((batch, future))
        if not self._running:
            self._running = True
            self._task = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                group, self._pending = self._pending, []
                try:
                    results = await loop.run_in_executor(self._executor, self.store.ingest_many, [b for b, _ in group])
                except Exception as exc:
                    for _, future in group:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), result in zip(group, results, strict=True):
                    self.on_committed(result)
                    if not future.done():
                        future.set_result(result)
        finally:
            self._running = False

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _error(status: int, reason: str, **extra: Any) -> web.Response:
    return web.json_response({"error": reason, **extra}, status=status)


class Service:
    def __init__(
        self,
        cfg: Config,
        runner: Runner | None = None,
        taxonomy: taxmod.Taxonomy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self._token = require_token(cfg).encode()
        self._operator_token = operator_token(cfg)
        self.taxonomy = taxonomy or taxmod.load()
        self.clock = clock
        self.store = Store(cfg.store.path, cfg.store.synchronous, clock, url=cfg.store.url())
        self.metrics = Metrics(self.store)
        self.ansible = runner is None
        self.runner: Runner = runner if runner is not None else AnsibleRunner(cfg.runner, secrets=[cfg.token])
        self._settings: steps.Settings | None = None
        if self.ansible:  # the real playbooks act through Slurm and Kubernetes: wait for them before a retry
            self._settings = steps.Settings.load(cfg.runner.playbook_dir, cfg.runner.site_vars)
        self.engine = self._new_engine()
        self.metrics.degraded.set_function(lambda: float(bool(self.engine.health())))
        self.ingest = GroupCommit(self.store, self._committed)
        self.connections = ConnectionGuard(cfg.listen.max_connections, cfg.listen.header_timeout_s, self.metrics)
        #: Leader election (several replicas on a shared store): None when off (this process always acts).
        self.elector: LeaderElector | None = None
        self._roles: asyncio.Queue[bool] | None = None
        #: The lead is taken in the database too (its epoch written) and the engine acts: what `/healthz`
        #: calls leader. The lease alone comes first, while the epoch is still being written.
        self._acting = False
        self._health_lock = asyncio.Lock()
        self._health_cache: tuple[float, tuple[int, int]] = (float("-inf"), (0, 0))
        self._roles_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._elector_stop = threading.Event()
        self._elector_thread: threading.Thread | None = None
        if cfg.leader_election.enabled:
            self.store.follow()
            self.elector = LeaderElector(
                cfg.leader_election,
                on_lead=lambda: self._role(True),
                on_stop=self._fence,
                store_ok=Probe(self.store.prober(), timeout_s=cfg.leader_election.retry_period_s * 2).ok,
            )
        self.metrics.set_leader(self.elector is None)
        #: Applies the stack's pool membership to the Nodes while this replica leads (membership.py).
        self.membership: MembershipController | None = None
        self._controllers_stop = threading.Event()
        self._membership_thread: threading.Thread | None = None
        if cfg.membership.enabled:
            from kubernetes import client

            m = cfg.membership
            core = client.CoreV1Api(api_client(m.kubeconfig))
            self.membership = MembershipController(
                core,
                m.namespace,
                resync_s=m.resync_s,
                release_grace_s=m.release_grace_s,
                on_apply=self.metrics.membership_applied,
            )
        #: Lends idle Slurm nodes to Kubernetes workloads and takes them back while this replica leads (lending.py).
        self.lending: LendingController | None = None
        self._lending_thread: threading.Thread | None = None
        if cfg.lending.enabled:
            settings = self._settings or steps.Settings.load(cfg.runner.playbook_dir, cfg.runner.site_vars)
            kube = steps.kube_for(settings)
            if kube is None:
                raise ConfigError("lending.enabled: the playbook settings name no Kubernetes API (kubeconfig)")
            self.lending = LendingController(
                cfg.lending,
                self.store,
                kube,
                steps.Slurm(settings),
                on_round=lambda r: self.metrics.lending_round(r.uses, len(r.lent), len(r.reclaimed)),
            )

    def _new_engine(self) -> Engine:
        responder = dependencies = None
        if self._settings is not None:
            dependencies = steps.Dependencies(self._settings)
            if self.cfg.runner.first_response:
                responder = FirstResponder(self._settings)
        engine = Engine(
            self.cfg,
            self.store,
            self.runner,
            self.taxonomy,
            metrics=self.metrics,
            clock=self.clock,
            responder=responder,
            dependencies=dependencies.unavailable if dependencies is not None else None,
            settings=self._settings,
            failover=self._failover_stage(),
        )
        engine.on_fenced = self._fenced
        if self.cfg.leader_election.enabled:
            engine.may_act = lambda: self.elector is not None and self.elector.leading
        self.metrics.attach_gate(engine.gate)
        return engine

    def _failover_stage(self) -> failmod.Stage | None:
        """The third recovery stage, when `failover.enabled` (it acts through Slurm as the steps do)."""
        fo = self.cfg.failover
        if not fo.enabled:
            return None
        env = dict(os.environ)
        if self._settings is not None:
            env.update(self._settings.slurm_env)
            if self._settings.slurm_bin_dir:
                env["PATH"] = f"{self._settings.slurm_bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        return failmod.Stage(
            fleetcfg.load(fo.fleet_file, env={}),
            fo.cluster_name(self.cfg.cluster),
            default_store=fo.default_store,
            env=env,
            wait_s=fo.wait_s,
            timeout_s=fo.timeout_s,
        )

    @property
    def leading(self) -> bool:
        return self.elector is None or self.elector.leading

    # --- leadership ------------------------------------------------------------------------------------

    def _role(self, lead: bool) -> None:
        """From the elector's thread: queue a change of role for the loop (`_roles_loop`)."""
        if self._loop is not None and self._roles is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the service is gone
                self._loop.call_soon_threadsafe(self._roles.put_nowait, lead)

    def _fence(self, reason: str) -> bool:
        """In the elector's thread, before the lease can pass to another replica: nothing of this replica
        acts any more, without waiting for the event loop (it may be stuck in a database call). True once
        every playbook process of this replica was seen gone (within leader_election.fence_timeout_s)."""
        self.store.follow()  # the state machine's writes are refused from now on
        self._stop_controllers()
        stopped = self.engine.abandon(self.cfg.leader_election.fence_timeout_s)
        self.metrics.set_leader(False)
        self._role(False)
        return stopped

    def _fenced(self, reason: str) -> None:
        """The store refused a write: another replica took the lead while this one did not notice."""
        if self.elector is not None:
            self.elector.demand_step_down(reason)

    def _start_controllers(self) -> None:
        """The leader's controllers: pool membership, and lending when enabled."""
        if self._membership_thread is not None or self._lending_thread is not None:
            return
        self._controllers_stop = threading.Event()
        if self.membership is not None:
            self._membership_thread = threading.Thread(
                target=self.membership.run, args=(self._controllers_stop,), name="membership", daemon=True
            )
            self._membership_thread.start()
        if self.lending is not None:
            self._lending_thread = threading.Thread(
                target=self.lending.run, args=(self._controllers_stop,), name="lending", daemon=True
            )
            self._lending_thread.start()

    def _stop_controllers(self) -> None:
        """Stops applying and lending at once (their watches and rounds end within seconds, in the background)."""
        self._controllers_stop.set()
        self._membership_thread = self._lending_thread = None

    async def _roles_loop(self) -> None:
        assert self._roles is not None
        loop = asyncio.get_running_loop()
        leading = False
        while True:
            lead = await self._roles.get()
            if lead and not leading:
                assert self.elector is not None
                if not self.elector.leading:  # a stale request: the lease went meanwhile; never fence its holder
                    continue
                try:
                    epoch = await loop.run_in_executor(None, self.store.take_leadership, self.elector.identity)
                except StoreError as exc:
                    log.error("cannot take the lead in the database", extra={"error": str(exc)[:200]})
                    self.elector.demand_step_down(f"database: {exc}")
                    continue
                if not self.elector.leading:  # the lease went while the epoch was being written
                    self.store.follow()
                    continue
                leading = self._acting = True
                self.metrics.set_leader(True)
                log.info("leading: resuming the incidents", extra={"epoch": epoch, "identity": self.elector.identity})
                await self.engine.start()
                self._start_controllers()
            elif not lead and leading:
                leading = self._acting = False
                old, self.engine = self.engine, self._new_engine()
                await old.stop(grace_s=0)
                log.info("following", extra={"identity": self.elector.identity if self.elector else ""})

    # --- the application -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.webhook.max_body_bytes, middlewares=[self._guard])
        app.router.add_post(WEBHOOK_PATH, self.webhook)
        app.router.add_post(NODE_REPAIRED_PATH, self.node_repaired)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        if self.elector is None:
            await self.engine.start()
            self._start_controllers()
        else:
            self._roles = asyncio.Queue()
            self._roles_task = asyncio.create_task(self._roles_loop(), name="roles")
            self._elector_thread = threading.Thread(
                target=self.elector.run, args=(self._elector_stop,), name="leader-election", daemon=True
            )
            self._elector_thread.start()
        if isinstance(self.runner, AnsibleRunner):
            # Import ansible_runner in the background so the first alert does not pay for it.
            asyncio.get_running_loop().run_in_executor(None, self.runner.warm_up)

    async def _on_cleanup(self, app: web.Application) -> None:
        self._stop_controllers()
        if self._elector_thread is not None:
            if self._roles_task is not None:
                self._roles_task.cancel()
            await self.engine.stop()  # playbooks get their grace before the lease is released
            self._elector_stop.set()
            await asyncio.get_running_loop().run_in_executor(None, self._elector_thread.join, 10.0)
        else:
            await self.engine.stop()
        self.ingest.close()
        self.store.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Count webhook responses; an unexpected error is logged and never leaks details."""
        t0 = time.perf_counter()
        status = 500
        with self.connections.serving(request.transport):
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            except Exception:
                log.exception("unhandled error", extra={"path": request.path})
                return _error(500, "internal error")
            finally:
                if request.path == WEBHOOK_PATH:
                    self.metrics.webhook(status, time.perf_counter() - t0)

    def _authorized(self, request: web.Request, token: bytes | None = None) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not credentials:
            return False
        return hmac.compare_digest(credentials.strip().encode("utf-8", "replace"), token or self._token)

    async def node_repaired(self, request: web.Request) -> web.Response:
        """An operator reports a node's repair done (`fleetheal nodes repaired NODE`): revalidate it."""
        if not self._operator_token:
            return _error(403, "the node API is off: set auth.operator_token_file")
        if not self._authorized(request, self._operator_token):
            log.warning("node API: missing or wrong operator token", extra={"peer": request.remote})
            return web.json_response(
                {"error": "missing or wrong operator token"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="fleetheal-remediator-nodes"'},
            )
        node = request.match_info["node"]
        if not self.leading:
            leader = self.elector.holder if self.elector is not None else ""
            return _error(503, "this replica does not lead; retry (the Service reaches the leader)", leader=leader)
        lifecycle = self.engine.lifecycle
        if lifecycle is None:
            return _error(409, "the node lifecycle is off (lifecycle.enabled: false)")
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return _error(400, "the body must be JSON")
        by = str((body or {}).get("by") or "operator")[:100] if isinstance(body, dict) else "operator"
        try:
            said = lifecycle.repaired(node, f"{by} through the node API")
        except LifecycleError as exc:
            return _error(409, str(exc))
        except StoreError as exc:
            log.error("node API: cannot persist", extra={"error": str(exc)})
            return _error(503, "cannot persist now; retry")
        self.store.audit("repaired", said, node=node, facts={"source": "node_api", "by": by, "peer": request.remote})
        return web.json_response({"node": node, "result": said, "state": lifecycle.state(node).state})

    async def webhook(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            log.warning("webhook: missing or wrong bearer token", extra={"peer": request.remote})
            return web.json_response(
                {"error": "missing or wrong bearer token"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="fleetheal-remediator"'},
            )
        limit = self.cfg.webhook.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error(413, f"body larger than {limit} bytes")
        timeout = self.cfg.webhook.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body larger than {limit} bytes")
        except TimeoutError:
            log.warning("webhook: body too slow", extra={"peer": request.remote, "timeout_s": timeout})
            response = _error(408, f"body not received within {timeout:g} s")
            response.force_close()
            return response
        except ConnectionError:  # the client went away before its body was complete; nobody reads an answer
            log.info("webhook: connection lost while reading the body", extra={"peer": request.remote})
            return _error(400, "connection lost while reading the body")
        try:
            payload = alerts.parse_payload(body, self.cfg, self.taxonomy)
        except alerts.PayloadError as exc:
            log.info("webhook: malformed payload", extra={"reason": str(exc)})
            return _error(400, str(exc))
        except Exception:  # a validator bug must not become a 5xx or an action
            log.exception("webhook: validator error")
            return _error(400, "payload could not be validated")
        rejected = [{"index": r.index, "reason": r.reason} for r in payload.rejected]
        for r in payload.rejected:
            log.warning("webhook: alert rejected", extra={"index": r.index, "reason": r.reason})
        self.metrics.alerts("rejected", len(rejected))
        if not payload.alerts:
            return _error(400, "no valid alert in the payload", rejected=rejected)
        if payload.truncated_alerts:
            log.warning("webhook: Alertmanager truncated alerts", extra={"truncated": payload.truncated_alerts})
        try:
            result = await self.ingest.ingest(payload.alerts)
        except StoreError as exc:
            log.error("webhook: cannot persist", extra={"error": str(exc)})
            return _error(503, "cannot persist the alerts now; retry")
        return web.json_response(
            {
                "created": [incident_ref(i) for i in result.created],
                "duplicates": result.duplicates,
                "resolved": [incident_ref(i) for i in result.resolved],
                "resolved_unknown": result.resolved_unknown,
                "already_resolved": result.already_resolved,
                "stale": result.stale,
                "rejected": rejected,
            },
            status=202,
        )

    def _committed(self, result: IngestResult) -> None:
        self.metrics.alerts("accepted", len(result.created))
        self.metrics.alerts("duplicate", result.duplicates)
        self.metrics.alerts("resolved", len(result.resolved))
        self.metrics.alerts("resolved_unknown", result.resolved_unknown)
        self.metrics.alerts("already_resolved", result.already_resolved)
        self.metrics.alerts("stale", result.stale)
        for a, why in result.not_acted:  # a firing alert already over: no incident, no action
            facts = {"fingerprint": a.fingerprint, "starts_at": a.starts_at, "node": a.node, "fault_id": a.fault_id}
            log.warning("webhook: firing alert not acted on", extra={"reason": why, **facts})
        if self.leading:  # a follower only persists: the leader polls the shared store
            self.engine.submit(result.created)
            self.engine.resolved(result.resolved)

    async def healthz(self, request: web.Request) -> web.Response:
        """200 while the database answers and incidents move; 503 with the reasons otherwise."""
        try:
            unfinished, held = await self._health_counts()
        except StoreError as exc:
            return _error(503, f"database: {exc}")
        degraded = self.engine.health()
        return web.json_response(
            {
                "status": "degraded" if degraded else "ok",
                "degraded": degraded,
                "cluster": self.cfg.cluster.name,
                "role": "leader" if self.leading and (self.elector is None or self._acting) else "follower",
                "leader": self.elector.holder if self.elector is not None else None,
                "unfinished_incidents": unfinished,
                "queue_depth": held,
                "breaker_open": self.engine.gate.breaker_open(),
                "paused": self.cfg.paused(),
                "observe_only": self.cfg.gate.observe_only,
                "dry_run": self.cfg.gate.dry_run,
            },
            status=503 if degraded else 200,
        )

    async def _health_counts(self) -> tuple[int, int]:
        """(unfinished incidents, incidents held at the gate), counted by the database off the event loop and
        at most once every HEALTH_COUNTS_S, however many ask. /healthz loaded every unfinished incident on the
        event loop, so anyone who reached it slowed the webhook (18,900 held incidents: 0.005 s -> 3-5 s) and
        the readiness probe could fail mid-storm (issue 46)."""
        async with self._health_lock:
            cached_at, counts = self._health_cache
            if time.monotonic() - cached_at >= HEALTH_COUNTS_S:
                counts = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: (self.store.unfinished_count(), self.store.held_count())
                )
                self._health_cache = (time.monotonic(), counts)
            return counts

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def operator_token(cfg: Config) -> bytes:
    """The node API's token (b"" when auth.operator_token_file is unset); ConfigError when unusable."""
    path = cfg.auth.operator_token_file
    if not path:
        return b""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as exc:
        raise ConfigError(f"auth.operator_token_file: cannot read {path}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"auth.operator_token_file: the token must have at least {MIN_TOKEN_LENGTH} characters")
    if hmac.compare_digest(token.encode(), cfg.token.encode()):
        raise ConfigError("auth.operator_token_file: use a token different from the webhook's")
    return token.encode()
