"""The one guard of fleetheal's servers against slow and idle clients: a connection limit and a deadline for
each request head.

The remediator's webhook (aiohttp bounds neither: `ConnectionGuard` wraps its protocol in serve.listen and the
service's middleware tells it when a request starts and ends, app.Service._guard) and the agent's metrics
endpoint (agent.outputs.MetricsServer) both serve behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class GuardMetrics(Protocol):
    """What the guard counts in its server's metrics: a gauge of open connections and why it closed one."""

    connections_open: Any  # a prometheus_client Gauge

    def connection_closed(self, reason: str) -> None: ...


_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 25\r\n"
    b"Connection: close\r\n\r\ntoo many connections; retry"
)


class ConnectionGuard:
    """What slow or idle clients can hold: at most `limit` connections, each with a deadline for its
    request head. aiohttp has neither (it accepts every connection and reads a head for as long as the
    client takes; its keep-alive timer is an hour), so a thousand slow-loris connections used up the
    process's open files (1024 under systemd) and nothing, not even /healthz, was accepted any more.

    - A connection must deliver a complete request head within `header_timeout_s` of its start or of its
      previous response, else it is closed (`header_timeout`). A request in progress has no such
      deadline; the webhook bounds its own body (`webhook.body_timeout_s`).
    - At the limit a new connection takes the place of the one that has waited longest for a request
      head (`evicted`): that one holds no work, while a client that sends its request at once
      (Alertmanager, a /healthz probe) is the newest waiting one and is busy a moment later. So /healthz
      stays reachable while slow clients hammer the webhook. Only when every connection is busy with a
      request is the new one answered 503 and closed (`limit`).

    `wrap(factory)` gives the protocol factory for `loop.create_server`; the service's middleware tells
    the guard when a request starts and ends (`serving`). Connections the guard does not know (the test
    server of aiohttp) are left alone.
    """

    def __init__(self, limit: int, header_timeout_s: float, metrics: GuardMetrics) -> None:
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.metrics = metrics
        self._open: dict[asyncio.BaseTransport, _GuardedConnection] = {}
        #: Connections waiting for a request head, the longest waiting first.
        self._waiting: dict[_GuardedConnection, None] = {}
        metrics.connections_open.set_function(lambda: len(self._open))

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedConnection(self, factory())

    def admit(self, conn: _GuardedConnection) -> bool:
        if len(self._open) >= self.limit:
            oldest = next(iter(self._waiting), None)
            if oldest is None:
                self.metrics.connection_closed("limit")
                return False
            self.drop(oldest, "evicted")
        assert conn.transport is not None
        self._open[conn.transport] = conn
        self.waiting(conn)
        return True

    def waiting(self, conn: _GuardedConnection) -> None:
        """`conn` waits for a request head from now on (it is the newest waiting connection)."""
        self._waiting.pop(conn, None)
        self._waiting[conn] = None
        conn.set_deadline(asyncio.get_running_loop().call_later(self.header_timeout_s, self.expired, conn))

    def expired(self, conn: _GuardedConnection) -> None:
        if conn in self._waiting:
            self.drop(conn, "header_timeout")

    def drop(self, conn: _GuardedConnection, reason: str) -> None:
        """Close `conn` now (abort: nothing it still has to send is worth waiting for) and count why."""
        self.metrics.connection_closed(reason)
        self.release(conn)
        assert conn.transport is not None
        conn.transport.abort()

    def release(self, conn: _GuardedConnection) -> None:
        conn.set_deadline(None)
        self._waiting.pop(conn, None)
        if conn.transport is not None:
            self._open.pop(conn.transport, None)

    def abort_all(self) -> None:
        """Close every connection now (the server is stopping)."""
        for conn in list(self._open.values()):
            self.release(conn)
            if conn.transport is not None:
                conn.transport.abort()

    @contextlib.contextmanager
    def serving(self, transport: asyncio.BaseTransport | None) -> Iterator[None]:
        """A request is in progress on `transport` (its head is in): no head deadline, never evicted."""
        conn = self._open.get(transport) if transport is not None else None
        if conn is None or transport is None:
            yield
            return
        conn.busy += 1
        conn.set_deadline(None)
        self._waiting.pop(conn, None)
        try:
            yield
        finally:
            conn.busy -= 1
            if conn.busy == 0 and self._open.get(transport) is conn:
                self.waiting(conn)


class _GuardedConnection(asyncio.Protocol):
    """A server's protocol for one connection (aiohttp's, the agent's), admitted and timed by a ConnectionGuard."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.busy = 0
        self._deadline: asyncio.TimerHandle | None = None

    def set_deadline(self, handle: asyncio.TimerHandle | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = handle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (TCP or TLS)
        self.admitted = self.guard.admit(self)
        if self.admitted:
            self.inner.connection_made(transport)
        else:
            self.transport.write(_REFUSED)  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.guard.release(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()
