"""fleetheal.procs (psutil) and fleetheal.wait: the process helpers and the one poll loop everyone uses."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error

import pytest

from fleetheal import procs
from fleetheal.httpjson import request_json
from fleetheal.wait import WaitTimeout, wait_until


@pytest.fixture
def sleeper(tmp_path):
    """A child in a process group of its own, with a grandchild; its command line names `tmp_path`."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], start_new_session=True)
    wait_until(lambda: len(procs.descendants(proc.pid)) == 1, 10, "the grandchild")
    yield proc
    if proc.poll() is None:
        procs.stop_pid(proc.pid, timeout=1)


def test_finds_describes_and_stops_processes(sleeper, tmp_path):
    assert procs.alive(sleeper.pid) and procs.alive(os.getpid())
    assert str(tmp_path) in procs.cmdline(sleeper.pid)
    assert abs(procs.start_time(sleeper.pid) - time.time()) < 60
    kids = procs.descendants(sleeper.pid)
    assert all(str(tmp_path) in cmd for cmd in kids.values())
    assert set(procs.pids_mentioning(str(tmp_path))) == {sleeper.pid, *kids}  # never this process
    assert os.getpid() not in procs.pids_mentioning(" ")
    procs.stop_pid(sleeper.pid, timeout=5)
    assert sleeper.poll() is not None  # reaped: it was our child
    assert procs.wait_gone(kids, 5) == []  # the grandchild was in its process group
    assert not procs.alive(sleeper.pid)
    assert procs.cmdline(sleeper.pid) == "" and procs.start_time(sleeper.pid) is None
    assert procs.descendants(sleeper.pid) == {}


def test_a_zombie_counts_as_gone_and_wait_gone_leaves_it_to_its_parent():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert procs.wait_gone([proc.pid], 10) == []
    assert proc.wait(5) == 0  # not reaped by wait_gone: the exit status is still the parent's to read


def test_marked_finds_a_tree_by_its_environment_and_terminate_marked_stops_it(tmp_path):
    """A marked child starts a detached grandchild (setsid: another session, the mark inherited), one with a
    cleared environment (found below its parent) and ignores SIGTERM itself (SIGKILL after the grace)."""
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "subprocess.Popen(['sleep', '61'], env={})\n"
        "open(sys.argv[1], 'w').close()\n"
        "time.sleep(60)\n"
    )
    ready = tmp_path / "ready"
    env = {**os.environ, "FLEETHEAL_TEST_MARK": f"mark:{tmp_path}"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], env=env)
    try:
        wait_until(ready.exists, 10, "the grandchildren")
        found = procs.marked("FLEETHEAL_TEST_MARK", lambda v: v == f"mark:{tmp_path}")
        assert proc.pid in found and set(found.values()) == {f"mark:{tmp_path}"}
        assert sorted(procs.cmdline(pid) for pid in found if pid != proc.pid) == ["sleep 60", "sleep 61"]
        assert os.getpid() not in procs.marked("FLEETHEAL_TEST_MARK") and not procs.marked("FLEETHEAL_NO_SUCH_MARK")
        t0 = time.monotonic()
        assert procs.terminate_marked("FLEETHEAL_TEST_MARK", lambda v: v == f"mark:{tmp_path}", grace=0.5) == []
        assert 0.5 <= time.monotonic() - t0 < 5  # the child ignored SIGTERM: it took the SIGKILL
        assert proc.wait(5) == -9 and procs.wait_gone(found, 5) == []
    finally:
        for pid in procs.marked("FLEETHEAL_TEST_MARK", lambda v: v == f"mark:{tmp_path}"):
            os.kill(pid, 9)
        if proc.poll() is None:
            proc.kill()


def test_start_ticks_tell_a_process_apart():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = procs.start_ticks(proc.pid)
    assert ticks is not None and ticks >= (procs.start_ticks(os.getpid()) or 0)
    proc.wait(5)
    assert procs.start_ticks(proc.pid) is None and procs.start_ticks(os.getpid()) == procs.start_ticks(os.getpid())


def test_namespace_processes_include_this_one():
    assert os.getpid() in procs.namespace_processes(os.getpid())


def test_free_ports_are_distinct():
    ports = procs.free_ports(3)
    assert len(set(ports)) == 3


def test_wait_until_returns_the_value_and_names_what_it_waited_for():
    calls = iter([0, None, "", "ready"])
    assert wait_until(lambda: next(calls), 5, "x", interval=0.001) == "ready"
    with pytest.raises(WaitTimeout, match=r"timed out after 0.05s waiting for the moon\nlog tail"):
        wait_until(lambda: False, 0.05, "the moon", interval=0.01, detail=lambda: "log tail")


def test_wait_until_ignores_only_the_errors_it_is_told_to():
    def refuse():
        raise ConnectionRefusedError("refused")

    with pytest.raises(WaitTimeout, match=r"waiting for a port \(last error: refused\)"):
        wait_until(refuse, 0.05, "a port", interval=0.01, ignore=(OSError,))
    with pytest.raises(ConnectionRefusedError):
        wait_until(refuse, 5, "a port")


def test_request_json_sends_and_decodes_json():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.headers["Content-Type"], self.headers["Authorization"], json.loads(body)))
            code = 200 if self.path == "/ok" else 404
            out = json.dumps({"path": self.path}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        doc = request_json("PATCH", f"{url}/ok", {"a": 1}, token="t", content_type="application/merge-patch+json")
        assert doc == {"path": "/ok"}
        assert seen == [("application/merge-patch+json", "Bearer t", {"a": 1})]
        with pytest.raises(urllib.error.HTTPError) as err:
            request_json("PATCH", f"{url}/missing", {})
        assert err.value.code == 404 and json.loads(err.value.read()) == {"path": "/missing"}
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="not an HTTP URL"):
        request_json("GET", "file:///etc/passwd")
