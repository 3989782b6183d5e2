"""SIGKILL during a playbook: after a restart the incident finishes exactly once.

The real service (`fleetheal remediator serve`) runs the recording playbook through ansible-runner; the
playbook holds for a while in its first run. The service is killed with SIGKILL while the playbook runs
(the orphaned ansible-playbook keeps running, as it would), then started again on the same database.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

from fleetheal.lab.monitoring import free_port
from fleetheal.procs import pids_mentioning
from fleetheal.remediator.store import Store
from fleetheal.wait import wait_until
from tests.remediator.conftest import TOKEN, alert, body
from tests.remediator.test_app import start_server, stop_server, write_config


def _post(port: int, data: bytes) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/webhook",
        data=data,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.status)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_during_a_playbook_then_restart_finishes_the_incident_exactly_once(tmp_path):
    port = free_port()
    record = tmp_path / "record.jsonl"
    (tmp_path / "held").mkdir()
    config = write_config(
        tmp_path,
        port,
        envvars={"FLEETHEAL_TEST_HOLD_S": "60", "FLEETHEAL_TEST_HOLD_ONCE_DIR": str(tmp_path / "held")},
    )
    proc, _, log = start_server(tmp_path, config, port)
    try:
        assert _post(port, body(alert(node="gpu-002", gpu="4"))) == 202
        wait_until(lambda: [r for r in _records(record) if r["phase"] == "start"], 60, "the playbook to start")
        first_run_dir = str(tmp_path / "runs" / "inc-000001")
        orphans = pids_mentioning(first_run_dir)
        assert orphans  # ansible-playbook is running
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        stop_server(proc, log)
    assert proc.returncode == -signal.SIGKILL
    # The orphaned playbook survives its parent (ansible-runner's pexpect child ignores SIGHUP).
    assert any(p in orphans for p in pids_mentioning(first_run_dir))

    store = Store(str(tmp_path / "remediator.sqlite"))
    inc = store.get(1)
    assert inc is not None and inc.state == "acting"
    store.close()

    proc, _, log = start_server(tmp_path, config, port)
    try:
        store = Store(str(tmp_path / "remediator.sqlite"))
        wait_until(lambda: store.get(1).state in ("done", "failed"), 120, "the incident to finish")
        inc = store.get(1)
        steps = [(s.name, s.attempt, s.result) for s in store.steps(1)]
        events = [e.kind for e in store.events(1)]
        store.close()
    finally:
        stop_server(proc, log)

    assert inc.state == "done", inc
    # Finished steps ran once; the interrupted attempt is on the timeline and was replaced by one more.
    assert steps == [
        ("receive", 1, "ok"),
        ("classify", 1, "ok"),
        ("gate", 1, "allow"),
        ("playbook", 1, "interrupted"),
        ("playbook", 2, "successful"),
    ]
    assert "interrupted" in events
    runs = _records(record)
    assert [r["phase"] for r in runs] == ["start", "start", "finish"]  # the killed run never finished
    assert {r["incident"] for r in runs} == {"inc-000001"} and {r["node"] for r in runs} == {"gpu-002"}
    # Nothing of the first run is left.
    assert not pids_mentioning(first_run_dir + "/step4-attempt1")
    # The restarted service logged that it resumed the incident.
    assert "resuming unfinished incidents" in (tmp_path / "serve.log").read_text()
