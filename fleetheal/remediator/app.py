"""The remediator's HTTP service (aiohttp).

- `POST /webhook`: Alertmanager's webhook. Bearer token (else 401, nothing read), body size limit (413),
  strict validation (400 with the reason), persist in SQLite, then 202; the work happens afterwards in
  the engine. A payload mixing valid and invalid alerts is accepted for the valid ones (202, the body
  lists the rejected ones); one without any valid alert is a 400.
- `GET /healthz`: 200 while the database answers and incidents move; 503 "degraded" with the reasons when
  workers stopped, incidents wait to retry after database errors, or the queue stalled.
- `GET /metrics`: Prometheus text format (see metrics.py).

`Service` wires config, store, engine, runner and metrics together; `serve()` runs it until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import json
import logging
import os
import signal
import sqlite3
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from fleetheal import steps
from fleetheal import taxonomy as taxmod
from fleetheal.remediator import alerts
from fleetheal.remediator.config import Config, require_token
from fleetheal.remediator.engine import Engine
from fleetheal.remediator.metrics import CONTENT_TYPE, Metrics
from fleetheal.remediator.responder import FirstResponder
from fleetheal.remediator.runner import AnsibleRunner, Runner
from fleetheal.remediator.store import IngestResult, Store, incident_ref

log = logging.getLogger("fleetheal.remediator")

WEBHOOK_PATH = "/webhook"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra` fields."""

    _SKIP = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._SKIP:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


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
        self.taxonomy = taxonomy or taxmod.load()
        self.store = Store(cfg.store.path, cfg.store.synchronous, clock)
        self.metrics = Metrics(self.store)
        self.ansible = runner is None
        self.runner: Runner = runner if runner is not None else AnsibleRunner(cfg.runner, secrets=[cfg.token])
        responder = None
        dependencies = None
        if self.ansible:  # the real playbooks act through Slurm and Kubernetes: wait for them before a retry
            dependencies = steps.Dependencies(steps.Settings.load(cfg.runner.playbook_dir, cfg.runner.site_vars))
            if cfg.runner.first_response:
                responder = FirstResponder.from_runner(cfg.runner.playbook_dir, cfg.runner.site_vars)
        self.engine = Engine(
            cfg,
            self.store,
            self.runner,
            self.taxonomy,
            metrics=self.metrics,
            clock=clock,
            responder=responder,
            dependencies=dependencies.unavailable if dependencies is not None else None,
        )
        self.metrics.attach_gate(self.engine.gate)
        self.ingest = GroupCommit(self.store, self._committed)

    # --- the application -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.webhook.max_body_bytes, middlewares=[self._guard])
        app.router.add_post(WEBHOOK_PATH, self.webhook)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.engine.start()
        if isinstance(self.runner, AnsibleRunner):
            # Import ansible_runner in the background so the first alert does not pay for it.
            asyncio.get_running_loop().run_in_executor(None, self.runner.warm_up)

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.engine.stop()
        self.ingest.close()
        self.store.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Count webhook responses; an unexpected error is logged and never leaks details."""
        t0 = time.perf_counter()
        status = 500
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

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not credentials:
            return False
        return hmac.compare_digest(credentials.strip().encode("utf-8", "replace"), self._token)

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
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body larger than {limit} bytes")
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
        except sqlite3.Error as exc:
            log.error("webhook: cannot persist", extra={"error": str(exc)})
            return _error(503, "cannot persist the alerts now; retry")
        return web.json_response(
            {
                "created": [incident_ref(i) for i in result.created],
                "duplicates": result.duplicates,
                "resolved": [incident_ref(i) for i in result.resolved],
                "resolved_unknown": result.resolved_unknown,
                "rejected": rejected,
            },
            status=202,
        )

    def _committed(self, result: IngestResult) -> None:
        self.metrics.alerts("accepted", len(result.created))
        self.metrics.alerts("duplicate", result.duplicates)
        self.metrics.alerts("resolved", len(result.resolved))
        self.metrics.alerts("resolved_unknown", result.resolved_unknown)
        self.engine.submit(result.created)
        self.engine.resolved(result.resolved)

    async def healthz(self, request: web.Request) -> web.Response:
        """200 while the database answers and incidents move; 503 with the reasons otherwise."""
        try:
            unfinished = len(self.store.unfinished())
            held = self.store.held_count()
        except sqlite3.Error as exc:
            return _error(503, f"database: {exc}")
        degraded = self.engine.health()
        return web.json_response(
            {
                "status": "degraded" if degraded else "ok",
                "degraded": degraded,
                "cluster": self.cfg.cluster.name,
                "unfinished_incidents": unfinished,
                "queue_depth": held,
                "breaker_open": self.engine.gate.breaker_open(),
                "paused": self.cfg.paused(),
                "observe_only": self.cfg.gate.observe_only,
                "dry_run": self.cfg.gate.dry_run,
            },
            status=503 if degraded else 200,
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def process_age() -> float | None:
    """Seconds since this process was started (exec), from /proc; None where /proc is missing.

    Both figures count from boot: the process's start time in clock ticks and /proc/uptime. (The boot
    time of /proc/stat, `btime`, is whole seconds, so an age computed from it and the wall clock was off
    by up to a second, by an amount fixed for each boot.)"""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - ticks / os.sysconf("SC_CLK_TCK"), 3)


def ssl_context(cfg: Config) -> ssl.SSLContext | None:
    if not cfg.listen.tls_cert_file or not cfg.listen.tls_key_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.listen.tls_cert_file, cfg.listen.tls_key_file)
    return ctx


class StartupError(RuntimeError):
    """The service cannot start: another instance, the database or the port. One line for the operator."""


def instance_lock(store_path: str) -> int:
    """Hold `<store.path>.lock` (flock) for the life of the service and return its descriptor.

    A second remediator on the same database would resume the live one's incidents as if they had been
    interrupted: kill their playbooks, count failed attempts and do their side effects again. The lock is
    the kernel's, so it goes with the process however that ends (no stale lock after a SIGKILL)."""
    path = store_path + ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StartupError(f"cannot create the lock file {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"another remediator (pid {holder}) already serves the database {store_path}; "
            "stop it first (it holds " + path + ")"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def run_service(cfg: Config, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; `ready` gets the URL once the socket listens. StartupError when it
    cannot start (nothing is left running then)."""
    lock = instance_lock(cfg.store.path)
    try:
        await _serve(cfg, ready)
    finally:
        os.close(lock)


async def _serve(cfg: Config, ready: Callable[[str], None] | None) -> None:
    try:
        service = Service(cfg)
    except (sqlite3.Error, OSError) as exc:
        raise StartupError(f"cannot open the database {cfg.store.path}: {exc}") from None
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, cfg.listen.host, cfg.listen.port, ssl_context=ssl_context(cfg))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen on {cfg.listen.host}:{cfg.listen.port}: {exc.strerror or exc}") from None
    scheme = "https" if cfg.listen.tls_cert_file else "http"
    addresses = runner.addresses  # the bound (host, port): the real port when listen.port is 0
    port = addresses[0][1] if addresses else cfg.listen.port
    url = f"{scheme}://{cfg.listen.host}:{port}"
    log.info(
        "remediator listening",
        extra={
            "url": url,
            "cluster": cfg.cluster.name,
            "config": cfg.source,
            "startup_s": process_age(),
            "startup_cpu_s": round(sum(os.times()[:2]), 3),
        },
    )
    if ready is not None:
        ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("remediator stopping")
        await runner.cleanup()
