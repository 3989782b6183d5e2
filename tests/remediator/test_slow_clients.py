"""Slow clients (issue 15): connections that never finish a request must not take the service down.

Found by review: the service had no deadline for a request head or body and no connection limit, so
every slow connection held a file descriptor for as long as its client liked. Under the shipped systemd
unit the remediator's soft limit of open files is 1024 (systemd's default; the unit sets no
LimitNOFILE): once slow connections used them up, accept() failed with EMFILE, the listen backlog
filled, and /healthz and Alertmanager's webhook timed out (the database and playbook runs need
descriptors too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import time

import aiohttp
import pytest
from aiohttp import web

from fleetheal.remediator.app import Service
from fleetheal.remediator.serve import LISTEN_BACKLOG, listen
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config
from tests.remediator.test_app import AUTH, start_server, stop_server, write_config

#: systemd's default soft limit of open files, which the remediator's unit does not raise.
SERVICE_NOFILE = 1024
#: Slow-loris connections (a request line and some headers, then a header line every 2 s, never the end).
SLOW_HEADS = 1000
#: Connections that send a head with a large Content-Length, then trickle the body (1 byte a second).
SLOW_BODIES = 100
#: ... of which a few carry the bearer token (a leaked token, a broken Alertmanager): their body is read.
SLOW_BODIES_WITH_TOKEN = 20
ATTACKERS = SLOW_HEADS + SLOW_BODIES + SLOW_BODIES_WITH_TOKEN
#: How long the probes wait for /healthz and the webhook to answer during the attack (a limit on a loaded
#: 2-core machine that also runs every attacker, not a latency goal).
ANSWER_WITHIN_S = 30.0


@pytest.fixture
def enough_files():
    """This process opens ATTACKERS sockets: make sure its own limit of open files is no reason to fail."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = ATTACKERS + 500
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"SKIPPED LOUDLY: the attack needs {need} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5.0)


async def _trickle(
    writer: asyncio.StreamWriter, first: bytes, then: bytes, every_s: float, stop: asyncio.Event, *, sent: list
) -> None:
    writer.write(first)
    await writer.drain()
    sent.append(1)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        writer.write(then)
        await writer.drain()


async def _slow_head(port: int, i: int, stop: asyncio.Event, sent: list) -> None:
    _, writer = await _connect(port)
    try:
        head = f"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: {i}\r\n".encode()
        await _trickle(writer, head, b"X-More: 1\r\n", 2.0, stop, sent=sent)
    finally:
        writer.close()


async def _slow_body(port: int, token: bool, stop: asyncio.Event, sent: list) -> None:
    _, writer = await _connect(port)
    auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
    head = (
        f"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
        "Content-Length: 1000000\r\n\r\n{"
    )
    try:
        await _trickle(writer, head.encode(), b" ", 1.0, stop, sent=sent)
    finally:
        writer.close()


async def _attacker(attack, stop: asyncio.Event) -> str:
    """What became of one attacker: "held" (still open at the end), or how the service ended it."""
    try:
        await attack
    except TimeoutError:
        return "connect timeout"
    except OSError as exc:  # refused, reset or closed by the service
        return type(exc).__name__
    return "held"


async def _attack_and_probe(port: int, pid: int) -> dict:
    before = len(os.listdir(f"/proc/{pid}/fd"))
    stop = asyncio.Event()
    sent: list = []
    attacks = [_slow_head(port, i, stop, sent) for i in range(SLOW_HEADS)]
    attacks += [_slow_body(port, False, stop, sent) for _ in range(SLOW_BODIES)]
    attacks += [_slow_body(port, True, stop, sent) for _ in range(SLOW_BODIES_WITH_TOKEN)]
    tasks = [asyncio.create_task(_attacker(a, stop)) for a in attacks]
    deadline = time.monotonic() + 120
    # every attacker has connected and sent its head, or been turned away
    while len(sent) + sum(t.done() for t in tasks) < len(tasks):
        assert time.monotonic() < deadline, (len(sent), sum(t.done() for t in tasks))
        await asyncio.sleep(0.1)
    found: dict = {"service_fds_before": before, "service_fds": len(os.listdir(f"/proc/{pid}/fd"))}
    timeout = aiohttp.ClientTimeout(total=ANSWER_WITHIN_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, method, url, kwargs in (
            ("healthz", "GET", "/healthz", {}),
            ("webhook", "POST", "/webhook", {"data": body(alert(node="gpu-001")), "headers": AUTH}),
        ):
            t0 = time.monotonic()
            try:
                async with session.request(method, f"http://127.0.0.1:{port}{url}", **kwargs) as resp:
                    await resp.read()
                    found[name] = resp.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                found[name] = f"{type(exc).__name__}: {exc}"
            found[name + "_s"] = round(time.monotonic() - t0, 2)
        found["service_fds_after"] = len(os.listdir(f"/proc/{pid}/fd"))
        try:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                found["metrics"] = await resp.text()
        except (TimeoutError, aiohttp.ClientError):
            found["metrics"] = ""
    stop.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    found["attackers"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    return found


def test_a_thousand_slow_connections_leave_healthz_and_the_webhook_answering(tmp_path, enough_files):
    """1120 connections that never finish their request (slow heads; slow bodies, a few with the token)
    against a service with systemd's default limit of 1024 open files. /healthz must still answer 200 and a
    real alert still get its 202, both within ANSWER_WITHIN_S; the service holds about `listen.max_connections`."""
    from fleetheal.lab.monitoring import free_port

    port = free_port()
    proc, _, log = start_server(tmp_path, write_config(tmp_path, port), port, nofile=SERVICE_NOFILE)
    try:
        found = asyncio.run(_attack_and_probe(port, proc.pid))
    finally:
        stop_server(proc, log)
    text = (tmp_path / "serve.log").read_text()
    metrics = found.pop("metrics")
    report = json.dumps(found)
    assert found["healthz"] == 200, report
    assert found["webhook"] == 202, report
    assert found["healthz_s"] < ANSWER_WITHIN_S and found["webhook_s"] < ANSWER_WITHIN_S, report
    # The connections stay bounded under the attack: the guard admits listen.max_connections (256). The
    # process's open files may run above that by what asyncio accepted in one go (up to LISTEN_BACKLOG a
    # turn of the loop) and the guard closes a turn or two later: CI once caught 367 (256 + 111). A process
    # without the guard holds every attacker, past its 1024 files. After the probes, the accepted alert's
    # playbook run adds its own pipes and files, so only the count before them is a connection count.
    admitted = re.search(r"^fleetheal_remediator_connections_open ([\d.]+)$", metrics, re.M)
    assert admitted is not None and float(admitted[1]) <= 256, metrics[:2000]
    assert found["service_fds"] <= found["service_fds_before"] + 256 + 2 * LISTEN_BACKLOG < SERVICE_NOFILE, report
    assert 'fleetheal_remediator_connections_closed_total{reason="evicted"}' in metrics, report
    assert "Traceback" not in text and "unhandled error" not in text, text[-3000:]
    assert proc.returncode == 0, text[-3000:]


# --- the mechanisms one by one, in-process, with short deadlines --------------------------------------


@contextlib.asynccontextmanager
async def _listening(cfg):
    """The service behind its ConnectionGuard, as `serve` runs it; yields (service, port)."""
    service = Service(cfg, runner=RecordingRunner())
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    server, url = await listen(service, runner)
    try:
        yield service, int(url.rsplit(":", 1)[1])
    finally:
        server.close()
        await runner.cleanup()
        await server.wait_closed()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the service sent before it closed the connection (fails if it stays open)."""
    return await asyncio.wait_for(reader.read(), seconds)


def _closed(service, reason: str) -> float:
    return service.metrics.connections_closed.labels(reason)._value.get()


def test_a_connection_that_does_not_finish_its_head_in_time_is_closed(tmp_path):
    cfg = make_config(tmp_path, listen={"header_timeout_s": 0.5})

    async def main():
        async with _listening(cfg) as (service, port):
            partial, writer = await _connect(port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the empty line
            t0 = time.monotonic()
            assert await _closed_within(partial, 30) == b""
            assert time.monotonic() - t0 > 0.4  # not before its header timeout
            # An idle keep-alive connection has the same deadline for its next head.
            reader, writer = await _connect(port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await _closed_within(reader, 30)
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer
            assert _closed(service, "header_timeout") == 2

    asyncio.run(main())


def test_a_slow_body_is_408_and_when_every_connection_is_busy_a_new_one_is_503(tmp_path):
    cfg = make_config(tmp_path, listen={"max_connections": 2}, webhook={"body_timeout_s": 5.0})
    head = (
        f"POST /webhook HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100000\r\n\r\n{{"
    ).encode()

    async def main():
        async with _listening(cfg) as (service, port):
            slow = []
            for _ in range(2):
                reader, writer = await _connect(port)
                writer.write(head)
                slow.append((reader, writer))
            guard = service.connections
            deadline = time.monotonic() + 60
            while len(guard._open) < 2 or guard._waiting:  # both are reading their body in the webhook now
                assert time.monotonic() < deadline, (len(guard._open), len(guard._waiting))
                await asyncio.sleep(0.01)
            reader, writer = await _connect(port)
            refused = await _closed_within(reader, 30)
            assert refused.startswith(b"HTTP/1.1 503 Service Unavailable"), refused
            assert _closed(service, "limit") == 1
            for reader, _ in slow:
                answer = await asyncio.wait_for(reader.readuntil(b'within 5 s"}'), 60)
                assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
                assert b"Connection: close" in answer
            for _, writer in slow:
                writer.close()
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert 'fleetheal_remediator_webhook_requests_total{code="408"} 2.0' in await resp.text()

    asyncio.run(main())


def test_at_the_limit_a_new_connection_replaces_the_one_waiting_longest_for_its_head(tmp_path):
    cfg = make_config(tmp_path, listen={"max_connections": 3})

    async def main():
        async with _listening(cfg) as (service, port):
            waiting = []
            for i in range(3):
                reader, writer = await _connect(port)
                writer.write(f"POST /webhook HTTP/1.1\r\nX-Slow: {i}\r\n".encode())
                waiting.append((reader, writer))  # a writer nobody holds closes its connection
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    assert resp.status == 200
            assert await _closed_within(waiting[0][0], 2) == b""  # the oldest went
            await asyncio.sleep(0.2)
            assert not waiting[1][0].at_eof() and not waiting[2][0].at_eof()
            assert _closed(service, "evicted") == 1

    asyncio.run(main())
