"""The HTTP service: authentication, limits, validation answers, persistence before 202, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from fleetheal.remediator import alerts
from fleetheal.remediator.app import HEALTH_COUNTS_S
from fleetheal.remediator.store import Store
from fleetheal.wait import WaitTimeout, wait_until
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config, nodes, with_client

AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
    ],
)
def test_no_or_a_wrong_token_is_401_and_nothing_happens(cfg, headers):
    runner = RecordingRunner()

    async def scenario(client, service):
        resp = await client.post("/webhook", data=body(alert()), headers=headers)
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await resp.json()) == {"error": "missing or wrong bearer token"}
        await service.engine.wait_idle()
        assert service.store.incidents() == []

    with_client(cfg, scenario, runner)
    assert runner.requests == []


def test_a_valid_alert_is_persisted_then_202_then_acted_on(cfg):
    runner = RecordingRunner()

    async def scenario(client, service):
        resp = await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        assert resp.status == 202
        doc = await resp.json()
        assert doc == {
            "created": ["inc-000001"],
            "duplicates": 0,
            "resolved": [],
            "resolved_unknown": 0,
            "already_resolved": 0,
            "stale": 0,
            "rejected": [],
        }
        # Persisted before the answer: another connection to the database sees it.
        other = Store(cfg.store.path)
        assert other.get(1) is not None
        other.close()
        await service.engine.wait_idle()
        assert service.store.get(1).state == "done"
        again = await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        assert (await again.json())["duplicates"] == 1
        resolved = await client.post("/webhook", data=body(alert(node="gpu-001", status="resolved")), headers=AUTH)
        assert (await resolved.json())["resolved"] == ["inc-000001"]

    with_client(cfg, scenario, runner)
    assert len(runner.requests) == 1


def test_malformed_payloads_are_400_with_the_reason(cfg):
    async def scenario(client, service):
        resp = await client.post("/webhook", data=b"{not json", headers=AUTH)
        assert resp.status == 400 and (await resp.json())["error"].startswith("body is not valid JSON")
        resp = await client.post("/webhook", data=body(alert(node="nope")), headers=AUTH)
        doc = await resp.json()
        assert resp.status == 400 and doc["error"] == "no valid alert in the payload"
        assert doc["rejected"] == [{"index": 0, "reason": "node 'nope' is not a node of cluster lab"}]
        resp = await client.post("/webhook", data=body(alert(node="nope"), alert(node="gpu-001")), headers=AUTH)
        doc = await resp.json()
        assert resp.status == 202 and doc["created"] == ["inc-000001"] and len(doc["rejected"]) == 1

    with_client(cfg, scenario)


def test_a_body_over_the_limit_is_413(tmp_path):
    cfg = make_config(tmp_path, webhook={"max_body_bytes": 2048})

    async def scenario(client, service):
        resp = await client.post("/webhook", data=b"x" * 5000, headers=AUTH)
        assert resp.status == 413

        async def chunks():
            for _ in range(10):
                yield b"x" * 1000

        resp = await client.post("/webhook", data=chunks(), headers=AUTH)  # no Content-Length
        assert resp.status == 413

    with_client(cfg, scenario)


def test_wrong_methods_and_paths(cfg):
    async def scenario(client, service):
        assert (await client.get("/webhook")).status == 405
        assert (await client.post("/elsewhere", headers=AUTH)).status == 404

    with_client(cfg, scenario)


def test_healthz_and_metrics(cfg):
    async def scenario(client, service):
        await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        await client.post("/webhook", data=b"[]", headers=AUTH)
        await service.engine.wait_idle()
        health = await client.get("/healthz")
        assert health.status == 200
        assert (await health.json())["status"] == "ok"
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
        for line in (
            'fleetheal_remediator_incidents{class="hardware",state="done"} 1.0',
            "fleetheal_remediator_queue_depth 0.0",
            'fleetheal_remediator_webhook_requests_total{code="202"} 1.0',
            'fleetheal_remediator_webhook_requests_total{code="400"} 1.0',
            'fleetheal_remediator_alerts_total{result="accepted"} 1.0',
            'fleetheal_remediator_gate_decisions_total{decision="allow",reason="ok"} 1.0',
            'fleetheal_remediator_nodes_isolated{failure_domain="rack-0"} 1.0',
            'fleetheal_remediator_pool_nodes{failure_domain="rack-0"} 4.0',
            "fleetheal_remediator_breaker_open 0.0",
            'fleetheal_remediator_incidents_finished_total{action="ISOLATE_AND_RELOCATE",class="hardware",state="done"} 1.0',
        ):
            assert line in text, line
        for name in (
            "fleetheal_remediator_step_duration_seconds_bucket",
            "fleetheal_remediator_time_to_playbook_seconds_bucket",
            "fleetheal_remediator_receive_to_playbook_seconds_bucket",
            "fleetheal_remediator_time_to_recovery_seconds_bucket",
            "fleetheal_remediator_recovery_seconds_total",
            "fleetheal_remediator_webhook_duration_seconds_bucket",
        ):
            assert name in text, name

    with_client(cfg, scenario)


def test_healthz_counts_in_the_database_once_a_second_however_many_ask(cfg):
    """Issue 46: /healthz loaded every unfinished incident on the event loop, so anyone who reached it slowed the
    webhook (18,900 held incidents: 0.005 s -> 3-5 s) and the readiness probe could fail mid-storm. It counts in
    the database now, off the event loop, and a crowd of requests shares one count."""

    async def scenario(client, service):
        await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        await service.engine.wait_idle()

        def never(*args, **kwargs):
            raise AssertionError("/healthz loaded the incidents")

        counted = []
        count = service.store.unfinished_count

        def counting():
            counted.append(1)
            return count()

        service.store.unfinished = never
        service.store.unfinished_count = counting
        started = time.monotonic()
        answers = await asyncio.gather(*(client.get("/healthz") for _ in range(100)))
        took = time.monotonic() - started
        assert {a.status for a in answers} == {200}
        assert len(counted) <= 1 + took / HEALTH_COUNTS_S, f"{len(counted)} counts for 100 requests in {took:.1f} s"
        assert (await answers[0].json())["unfinished_incidents"] == 0

    with_client(cfg, scenario)


def test_every_exported_metric_is_documented(cfg):
    doc = (REPO / "docs" / "metrics.md").read_text()

    async def scenario(client, service):
        await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        await service.engine.wait_idle()
        text = await (await client.get("/metrics")).text()
        names = {
            line.split()[2]
            for line in text.splitlines()
            if line.startswith("# TYPE fleetheal_remediator") and not line.split()[2].endswith("_created")
        }
        missing = sorted(n for n in names if f"`{n}`" not in doc)
        assert not missing, f"undocumented in docs/metrics.md: {missing}"

    with_client(cfg, scenario)


def _serve_cmd(config_path: Path) -> list[str]:
    """`fleetheal remediator serve` through the remediator's own `register()` (the same parser path)."""
    code = (
        "import argparse, sys\n"
        "from fleetheal.remediator import cli\n"
        "p = argparse.ArgumentParser(prog='fleetheal')\n"
        "cli.register(p.add_subparsers(dest='command', required=True))\n"
        "a = p.parse_args(sys.argv[1:])\n"
        "sys.exit(a.func(a))\n"
    )
    return [sys.executable, "-c", code, "remediator", "serve", "--config", str(config_path)]


def write_config(tmp_path: Path, port: int, **extra) -> Path:
    from tests.remediator.conftest import TEST_PLAYBOOKS, nodes

    doc = {
        "cluster": {"name": "lab", "nodes": nodes()},
        "listen": {"host": "127.0.0.1", "port": port, **extra.pop("listen", {})},
        "store": {"path": str(tmp_path / "remediator.sqlite")},
        "runner": {
            "playbook_dir": str(TEST_PLAYBOOKS),
            "run_dir": str(tmp_path / "runs"),
            "backoff_s": 0.5,
            # The recording playbooks stand in for the real ones; there is no Slurm for a first response.
            "first_response": False,
            "envvars": {"FLEETHEAL_TEST_RECORD": str(tmp_path / "record.jsonl"), **extra.pop("envvars", {})},
        },
        "gate": {"recheck_interval_s": 0.2},
        **extra,
    }
    path = tmp_path / "remediator.yaml"
    path.write_text(json.dumps(doc))
    return path


def start_server(
    tmp_path: Path, config: Path, port: int, scheme: str = "http", timeout: float = 60.0, *, nofile: int | None = None
):
    """`nofile`: the service's soft limit of open files (RLIMIT_NOFILE), e.g. systemd's default 1024."""
    log = open(tmp_path / "serve.log", "ab")
    env = {**os.environ, "FLEETHEAL_REMEDIATOR_TOKEN": TOKEN}
    t0 = time.monotonic()

    def limit_files():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.Popen(
        _serve_cmd(config),
        stdout=log,
        stderr=log,
        env=env,
        start_new_session=True,
        cwd=REPO,
        preexec_fn=limit_files if nofile is not None else None,
    )
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    import urllib.request

    def answered():
        if proc.poll() is not None:
            raise AssertionError((tmp_path / "serve.log").read_text())
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/healthz", timeout=1, context=ctx) as r:
            return r.status == 200

    try:
        wait_until(answered, timeout - (time.monotonic() - t0), "the server", interval=0.01, ignore=(OSError,))
    except WaitTimeout:
        proc.kill()
        raise AssertionError("server did not answer: " + (tmp_path / "serve.log").read_text()) from None
    return proc, time.monotonic() - t0, log


def stop_server(proc, log, sig=15):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def test_the_service_reports_its_start_up_and_stops_on_sigterm(tmp_path):
    """The first log line says how long the process took from exec to a listening socket (wall and CPU
    time; `make bench` measures them: "remediator start-up"); SIGTERM stops it cleanly."""
    from fleetheal.lab.monitoring import free_port

    port = free_port()
    proc, _, log = start_server(tmp_path, write_config(tmp_path, port), port)
    stop_server(proc, log)
    assert proc.returncode == 0
    text = (tmp_path / "serve.log").read_text()
    assert TOKEN not in text
    first = json.loads(text.splitlines()[0])
    assert first["msg"] == "remediator listening" and first["url"] == f"http://127.0.0.1:{port}"
    assert first["startup_s"] > 0 and first["startup_cpu_s"] > 0
    assert json.loads(text.splitlines()[-1])["msg"] == "remediator stopping"


def test_tls(tmp_path):
    from fleetheal.lab.monitoring import free_port

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    config = write_config(tmp_path, port, listen={"tls_cert_file": str(cert), "tls_key_file": str(key)})
    proc, _, log = start_server(tmp_path, config, port, scheme="https")
    try:

        async def post():
            ctx = ssl.create_default_context(cafile=str(cert))
            ctx.check_hostname = False
            async with aiohttp.ClientSession() as s:
                async with s.post(f"https://127.0.0.1:{port}/webhook", data=body(alert()), headers=AUTH, ssl=ctx) as r:
                    return r.status

        assert asyncio.run(post()) == 202
    finally:
        stop_server(proc, log)


def test_a_brief_database_write_failure_delays_incidents_and_never_stops_the_workers(cfg):
    """Found by hand: a write error while processing killed the worker that hit it (its error handler wrote
    to the database too), so a short failure of the disk stopped every worker for good while the webhook
    kept answering 202 and /healthz said ok. Here the remediator's own connection refuses writes
    (`PRAGMA query_only`, SQLite's real "attempt to write a readonly database") for more incidents than
    there are workers, then the disk comes back."""
    workers = 16
    count = workers + 4
    runner = RecordingRunner()

    async def scenario(client, service):
        other = Store(cfg.store.path)  # the alerts were persisted before the disk failed
        names = list(nodes())
        many = [alert(node=names[i % len(names)], fault_id="xid-31" if i % 2 else "nccl-timeout") for i in range(count)]
        batch = alerts.parse_payload(body(*many), cfg, service.taxonomy).alerts
        created = other.ingest(batch).created
        other.close()
        service.store._db.execute("PRAGMA query_only = ON")
        service.engine.submit(created)
        deadline = time.monotonic() + 60
        while True:  # the workers meet the read-only database and wait to retry
            health = await client.get("/healthz")
            doc = await health.json()
            if health.status == 503 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert health.status == 503 and doc["status"] == "degraded", doc
        assert "waiting to retry after database errors" in doc["degraded"][0]
        assert "readonly database" in doc["degraded"][0]
        text = await (await client.get("/metrics")).text()
        assert "\nfleetheal_remediator_degraded 1.0\n" in text  # alert FleethealRemediatorDegraded
        service.store._db.execute("PRAGMA query_only = OFF")
        await service.engine.wait_idle(timeout=30)
        states = {service.store.get(i).state for i in created}
        assert states <= {"done"}, states
        health = await client.get("/healthz")
        assert health.status == 200 and (await health.json())["degraded"] == []
        text = await (await client.get("/metrics")).text()
        assert "fleetheal_remediator_engine_errors_total" in text
        assert "\nfleetheal_remediator_degraded 0.0\n" in text

    with_client(cfg, scenario, runner)


def test_a_pause_switched_on_after_the_gate_reaches_the_playbooks_guard(tmp_path):
    """Found by hand: the engine always told the playbook `fleetheal_paused: false`, so the guard that
    refuses to act while remediation is paused could never fire. Here the operator pauses right after the
    gate let the incident through (and before its playbook starts)."""
    pause = tmp_path / "PAUSE"
    cfg = make_config(tmp_path, gate={"pause_file": str(pause), "recheck_interval_s": 0.05})
    runner = RecordingRunner()

    async def scenario(client, service):
        evaluate = service.engine.gate.evaluate

        def evaluate_then_pause(*args, **kwargs):
            verdict = evaluate(*args, **kwargs)
            pause.write_text("operator: hold everything\n")
            return verdict

        service.engine.gate.evaluate = evaluate_then_pause
        resp = await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        assert resp.status == 202
        await service.engine.wait_idle()

    with_client(cfg, scenario, runner)
    assert [r.extravars["fleetheal_paused"] for r in runner.requests] == [True]


def _serve_once(config: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEETHEAL_REMEDIATOR_TOKEN": TOKEN}
    return subprocess.run(_serve_cmd(config), env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_second_remediator_on_the_same_database_refuses_and_leaves_the_first_alone(tmp_path):
    """Found by hand: a second `serve` on the same config resumed the live instance's incidents, killed
    their playbooks (each counted as a failed attempt), ran their side effects again, then died on the busy
    port. The first instance holds a lock on its database now; the second says so and exits 1 before it
    touches anything."""
    from fleetheal.lab.monitoring import free_port

    port = free_port()
    first = tmp_path / "first"
    first.mkdir()
    holds = first / "holds"
    holds.mkdir()
    config = write_config(
        first, port, envvars={"FLEETHEAL_TEST_HOLD_S": "4", "FLEETHEAL_TEST_HOLD_ONCE_DIR": str(holds)}
    )
    proc, _, log = start_server(first, config, port)
    try:
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/webhook", data=body(alert(node="gpu-001")), headers=AUTH, method="POST"
        )
        assert urllib.request.urlopen(req, timeout=10).status == 202
        second_cfg = json.loads(config.read_text())
        second_cfg["listen"]["port"] = free_port()  # even on a free port
        (tmp_path / "second.yaml").write_text(json.dumps(second_cfg))
        second = _serve_once(tmp_path / "second.yaml", tmp_path)
        assert second.returncode == 1, second.stderr
        assert f"already serves the database {first / 'remediator.sqlite'}" in second.stderr
        assert f"(pid {proc.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        assert proc.poll() is None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            assert r.status == 200
        # The first instance's playbook ends on its own (stopping the service now would interrupt it).
        reader = Store(str(first / "remediator.sqlite"))
        try:
            wait_until(lambda: reader.get(1).state == "done", 120, "the incident to be done")
        finally:
            reader.close()
    finally:
        stop_server(proc, log)
    store = Store(str(first / "remediator.sqlite"))
    try:  # the first instance's playbook ran once, to its end: nobody interrupted it
        assert [s.result for s in store.steps(1) if s.name == "playbook"] == ["successful"]
    finally:
        store.close()


@pytest.mark.parametrize("problem", ["corrupt database", "store parent is a file", "busy port"])
def test_a_remediator_that_cannot_start_says_why_in_one_line(tmp_path, problem):
    from fleetheal.lab.monitoring import free_port

    port = free_port()
    config = write_config(tmp_path, port)
    doc = json.loads(config.read_text())
    if problem == "corrupt database":
        (tmp_path / "remediator.sqlite").write_bytes(b"this is not a database" * 100)
        expected = "cannot open the database"
    elif problem == "store parent is a file":
        (tmp_path / "afile").write_text("")
        doc["store"]["path"] = str(tmp_path / "afile" / "remediator.sqlite")
        expected = "Not a directory"
    else:
        expected = f"cannot listen on 127.0.0.1:{port}"
    config.write_text(json.dumps(doc))
    blocker = socket.create_server(("127.0.0.1", port)) if problem == "busy port" else None
    try:
        result = _serve_once(config, tmp_path)
    finally:
        if blocker is not None:
            blocker.close()
    assert result.returncode == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("{")]  # JSON log lines aside
    assert len(lines) == 1 and lines[0].startswith("fleetheal remediator: cannot start:"), result.stderr
    assert expected in lines[0]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs for the remediator's state: a disk that can really fill up (needs root)."""
    mount = tmp_path / "state"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]).returncode:
        pytest.skip("SKIPPED LOUDLY: a full-disk test needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_loses_no_alert_and_every_incident_finishes_once_there_is_room(tmp_path, tiny_disk):
    """The state directory's disk fills up during a burst: new alerts get 503 (Alertmanager sends them
    again), incidents in flight wait and /healthz says why; once there is room again, every incident
    finishes and the alerts sent again are taken."""
    cfg = make_config(tmp_path, store={"path": str(tiny_disk / "remediator.sqlite"), "synchronous": "NORMAL"})
    runner = RecordingRunner()
    names = list(nodes())

    async def scenario(client, service):
        first = await client.post("/webhook", data=body(alert(node=names[0], fault_id="nccl-timeout")), headers=AUTH)
        assert first.status == 202
        await service.engine.wait_idle()
        filler = tiny_disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)  # the disk fills up
        with contextlib.suppress(OSError):
            while os.write(fd, b"\1" * 65536):
                pass
        os.close(fd)
        second = body(alert(node=names[1], fault_id="nccl-timeout"))
        refused = await client.post("/webhook", data=second, headers=AUTH)
        assert refused.status == 503 and "retry" in (await refused.json())["error"]
        filler.unlink()
        again = await client.post("/webhook", data=second, headers=AUTH)  # Alertmanager sends it again
        assert again.status == 202
        await service.engine.wait_idle(timeout=30)
        assert [i.state for i in service.store.incidents()] == ["done", "done"]
        assert (await client.get("/healthz")).status == 200

    with_client(cfg, scenario, runner)
    assert len(runner.requests) == 2  # each incident's playbook ran once
