"""Starting and stopping the remediator's service: logging, the one-instance lock on its database, the
listening socket (TLS, the connection guard), and serving until SIGTERM (`run_service`; `fleetheal
remediator serve` calls it). What the service answers is app.py's part.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import ssl
from collections.abc import Callable

from aiohttp import web

from fleetheal import logs
from fleetheal.remediator.app import Service
from fleetheal.remediator.config import Config, ConfigError
from fleetheal.remediator.store import StoreError

log = logging.getLogger("fleetheal.remediator")


def setup_logging(level: str = "INFO") -> None:
    """fleetheal's JSON log lines (fleetheal.logs) on stderr; aiohttp's access log only from warnings up."""
    logs.setup_logging(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


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


#: The kernel's queue of connections not yet accepted. asyncio also accepts up to this many in one go before
#: the ConnectionGuard sees any of them, so for a moment the process may hold this many sockets above
#: `listen.max_connections` (the guard closes the surplus on the loop's next turn).
LISTEN_BACKLOG = 128


async def listen(service: Service, runner: web.AppRunner) -> tuple[asyncio.Server, str]:
    """Listen on `listen.host:port` with aiohttp's protocol behind the service's ConnectionGuard (instead
    of aiohttp's TCPSite, which offers no hook for it); return the server and its URL (the real port when
    listen.port is 0). `server.close()` before `runner.cleanup()` when done."""
    cfg = service.cfg
    assert runner.server is not None, "runner.setup() first"
    ctx = ssl_context(cfg)
    server = await asyncio.get_running_loop().create_server(
        service.connections.wrap(runner.server),
        cfg.listen.host,
        cfg.listen.port,
        ssl=ctx,
        # A TLS handshake has the same deadline as a request head (asyncio's default is a minute).
        ssl_handshake_timeout=cfg.listen.header_timeout_s if ctx is not None else None,
        backlog=LISTEN_BACKLOG,
    )
    port = server.sockets[0].getsockname()[1] if server.sockets else cfg.listen.port
    return server, f"{'https' if ctx is not None else 'http'}://{cfg.listen.host}:{port}"


async def run_service(cfg: Config, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; `ready` gets the URL once the socket listens. StartupError when it
    cannot start (nothing is left running then)."""
    # SQLite: one process per database file. A shared PostgreSQL store has replicas; the Lease and the
    # store's fencing epoch keep all but one from acting.
    lock = None if cfg.store.url_file else instance_lock(cfg.store.path)
    try:
        await _serve(cfg, ready)
    finally:
        if lock is not None:
            os.close(lock)


async def _serve(cfg: Config, ready: Callable[[str], None] | None) -> None:
    try:
        service = Service(cfg)
    except (StoreError, OSError) as exc:
        where = "PostgreSQL (store.url_file)" if cfg.store.url_file else cfg.store.path
        raise StartupError(f"cannot open the database {where}: {exc}") from None
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        server, url = await listen(service, runner)
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen on {cfg.listen.host}:{cfg.listen.port}: {exc.strerror or exc}") from None
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
        server.close()
        await runner.cleanup()
        await server.wait_closed()
