"""Several remediator replicas on one PostgreSQL store, one leader elected through a Lease.

Real processes (`fleetheal remediator serve`), a real PostgreSQL (Debian's, on loopback), the real
kube-apiserver (`make tools`) and the recording playbooks through ansible-runner. Killing a replica kills
what a pod's death kills: the process and every playbook process it started.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from fleetheal.httpjson import request_json
from fleetheal.lab.monitoring import free_port
from fleetheal.remediator.rundirs import kill_leftovers
from fleetheal.remediator.store import Store
from fleetheal.wait import wait_until
from tests.remediator.conftest import TEST_PLAYBOOKS, TOKEN, alert, body, nodes
from tests.remediator.test_app import _serve_cmd


def _wait(what, predicate, timeout):
    return wait_until(predicate, timeout, what)


REPO = Path(__file__).resolve().parents[2]
NODES = nodes(500, per_domain=50)
STORM_PLAYBOOKS = Path(__file__).resolve().parent / "storm_playbooks"


@dataclass
class Replica:
    name: str
    dir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: object = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.dir / "runs"

    def health(self) -> dict | None:
        try:
            return request_json("GET", f"http://127.0.0.1:{self.port}/healthz", timeout=2)
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())
        except OSError:
            return None

    def post(self, data: bytes) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/webhook",
            data=data,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """A pod's death: the process and every playbook process it started, at once."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        kill_leftovers(str(self.run_dir))
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        kill_leftovers(str(self.run_dir))
        if self.log is not None:
            self.log.close()
            self.log = None

    def text(self) -> str:
        return (self.dir / "serve.log").read_text(errors="replace")


class Fleet:
    """Replicas of one remediator: one config each (port, run directory, store URL, identity)."""

    def __init__(self, tmp: Path, url: str, kubeconfig: Path, lease: str, **env: str) -> None:
        #: The recording playbooks; a storm's use the one-task double (hundreds of incidents in seconds).
        self.playbooks = STORM_PLAYBOOKS
        self.tmp = tmp
        self.url = url
        self.kubeconfig = kubeconfig
        self.lease = lease
        self.env = env
        self.replicas: list[Replica] = []
        self.record = tmp / "record.jsonl"

    def start(self, name: str, url: str | None = None) -> Replica:
        rdir = self.tmp / name
        rdir.mkdir()
        (rdir / "store-url").write_text((url or self.url) + "\n")
        (rdir / "store-url").chmod(0o600)
        port = free_port()
        doc = {
            "cluster": {"name": "lab", "nodes": NODES},
            "listen": {"host": "127.0.0.1", "port": port},
            "store": {"url_file": str(rdir / "store-url")},
            "leader_election": {
                "enabled": True,
                "namespace": "default",
                "lease_name": self.lease,
                "identity": name,
                "kubeconfig": str(self.kubeconfig),
            },
            "runner": {
                "playbook_dir": str(self.playbooks),
                "run_dir": str(rdir / "runs"),
                "backoff_s": 0.5,
                "first_response": False,
                "max_concurrent": 4,
                "envvars": {"FLEETHEAL_TEST_RECORD": str(self.record), **self.env},
            },
            "gate": {
                "recheck_interval_s": 0.2,
                # A storm of single-node faults the gate lets through: the test is about who acts.
                "budget": {"max_isolated": 1000, "max_isolated_fraction": 1.0, "max_isolated_per_domain": 1000,
                           "max_isolated_fraction_per_domain": 1.0},
                "breaker": {"storm_nodes": 10000},
            },
            "lifecycle": {"enabled": False},
        }  # fmt: skip
        (rdir / "remediator.yaml").write_text(json.dumps(doc))
        log = open(rdir / "serve.log", "ab")
        proc = subprocess.Popen(
            _serve_cmd(rdir / "remediator.yaml"),
            stdout=log,
            stderr=log,
            env={**os.environ, "FLEETHEAL_REMEDIATOR_TOKEN": TOKEN},
            start_new_session=True,
            cwd=REPO,
        )
        replica = Replica(name, rdir, port, proc, log)
        self.replicas.append(replica)
        _wait(f"{name} to answer", lambda: replica.health() is not None or not replica.alive(), 30)
        assert replica.alive(), replica.text()[-3000:]
        return replica

    def leader(self, timeout: float = 30.0) -> Replica:
        def find() -> Replica | None:
            leaders = [r for r in self.replicas if r.alive() and (r.health() or {}).get("role") == "leader"]
            assert len(leaders) <= 1, [r.name for r in leaders]
            return leaders[0] if leaders else None

        return _wait("a leader", find, timeout)

    def post(self, data: bytes, errors: list[str]) -> None:
        """Like Alertmanager behind a Service: the first live replica that answers; a replica that is gone
        is skipped (its endpoint would be removed), an error from a live one is recorded."""
        for r in self.replicas:
            if not r.alive():
                continue
            try:
                status = r.post(data)
            except OSError as exc:
                if r.alive():
                    errors.append(f"{r.name}: {exc}")
                continue
            if status == 202:
                return
            errors.append(f"{r.name}: HTTP {status}")
        errors.append("no replica accepted the alerts")

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()


def _leads(store: Store) -> list[tuple[int, str, float]]:
    """Every epoch taken so far, in order: (epoch, holder, since), from the audit log."""
    return [
        (a["facts"]["epoch"], a["facts"]["holder"], a["ts"])
        for a in store.audit_log(limit=100_000)
        if a["decision"] == "lead"
    ]


def _alerts(count: int) -> list[bytes]:
    """`count` alerts (xid-79, one per node) in payloads of 25, like Alertmanager's groups."""
    names = sorted(NODES)[:count]
    return [body(*(alert(node=n, gpu="0") for n in names[i : i + 25])) for i in range(0, count, 25)]


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str, kube, request) -> Iterator[Fleet]:
    lease = f"fleetheal-{request.node.name.replace('_', '-')[:40].strip('-')}-{os.getpid()}"
    f = Fleet(tmp_path, pg_url, kube.kubeconfig, lease)
    try:
        yield f
    finally:
        f.stop()


def _check_every_incident_once(url: str, expected: int, record: Path) -> list:
    records: dict[str, int] = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        if r["phase"] == "finish":
            records[r["incident"]] = records.get(r["incident"], 0) + 1
    store = Store.postgres(url)
    try:
        incidents = store.incidents(limit=10 * expected)
        assert len(incidents) == expected  # none lost, none duplicated
        assert {i.state for i in incidents} == {"done"}, {i.ref: i.outcome for i in incidents if i.state != "done"}
        for inc in incidents:
            attempts = [s for s in store.steps(inc.id) if s.name == "playbook"]
            assert [s.result for s in attempts].count("successful") == 1, (inc.ref, attempts)
            # one attempt at a time: each one ended before the next started
            for a, b in itertools.pairwise(attempts):
                assert a.ended_at is not None and a.ended_at <= b.started_at, (inc.ref, a, b)
            # a playbook ran to its end once, or once more for each attempt a dead leader left behind
            interrupted = sum(1 for s in attempts if s.result == "interrupted")
            finished = records.get(inc.ref, 0)
            # (the attempts in short, so that pytest does not cut what explains a failure)
            brief = [(s.attempt, s.result, s.detail[:160], s.run_dir) for s in attempts]
            assert 1 <= finished <= 1 + interrupted, (inc.ref, finished, brief)
        return incidents
    finally:
        store.close()


def test_sigkill_of_the_leader_in_a_storm_of_500_alerts_a_follower_finishes_every_incident_once(fleet, pg_url):
    a = fleet.start("replica-a")
    leader = fleet.leader()
    assert leader is a
    fleet.start("replica-b")
    fleet.start("replica-c")
    payloads = _alerts(500)
    errors: list[str] = []
    for data in payloads[:8]:  # 200 alerts, then the leader dies in the middle of the storm
        fleet.post(data, errors)
    store = Store.postgres(pg_url)
    try:
        _wait("the leader to run playbooks", lambda: store.counts() and any(
            s == "done" for s, _, n in store.counts()), 120)  # fmt: skip
        killed_at = time.time()
        a.kill()
        for data in payloads[8:]:  # the rest of the storm arrives while the lease changes hands
            fleet.post(data, errors)
        new = fleet.leader(timeout=60)
        assert new is not a
        leads = _leads(store)
        # A loaded machine may pass the lease on again (a renewal late by renew_deadline_s): the failover is
        # the first epoch after a's, and a never led again.
        assert leads[0][:2] == (1, "replica-a") and "replica-a" not in {h for _, h, _ in leads[1:]}, leads
        assert store.leadership()[1] == new.name
        failover = leads[1][2] - killed_at
        _wait(
            "every incident to finish", lambda: not store.unfinished() and len(store.incidents(limit=1000)) == 500, 600
        )
    finally:
        store.close()
    assert errors == []  # every payload went to a live replica and was accepted
    _check_every_incident_once(pg_url, 500, fleet.record)
    assert "resuming unfinished incidents" in new.text() or "leading" in new.text()
    print(f"failover (SIGKILL -> new leader's epoch): {failover:.2f} s")


def test_postgresql_restarted_mid_run_the_remediator_waits_and_continues(fleet, pg_url, postgres_server):
    fleet.start("replica-a")
    fleet.leader()
    fleet.start("replica-b")
    payloads = _alerts(100)
    errors: list[str] = []
    for data in payloads[:2]:
        fleet.post(data, errors)
    postgres_server.restart()
    late: list[str] = []
    for data in payloads[2:]:
        # Alertmanager retries a 503 (nothing was persisted): so does this loop, until a replica accepts.
        for _ in range(600):  # up to a minute
            before = len(late)
            fleet.post(data, late)
            if len(late) == before:
                break
            time.sleep(0.1)
    assert errors == []
    store = Store.postgres(pg_url)
    try:
        _wait(
            "every incident to finish", lambda: not store.unfinished() and len(store.incidents(limit=1000)) == 100, 300
        )
    finally:
        store.close()
    _check_every_incident_once(pg_url, 100, fleet.record)
    assert all("HTTP 503" in e for e in late), late  # during the restart, "retry" and nothing else
    # The operators' commands read the shared store through the same config.
    out = subprocess.run(
        [sys.executable, "-m", "fleetheal", "incidents", "list", "--json", "--limit", "500",
         "--config", str(fleet.replicas[0].dir / "remediator.yaml")],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    ).stdout  # fmt: skip
    listed = json.loads(out)
    assert len(listed) == 100 and {i["state"] for i in listed} == {"done"}


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def partition(postgres_server) -> Iterator[callable]:
    """cut(): drop every packet between 127.0.0.2 and PostgreSQL (the replica that connects through
    127.0.0.2 is partitioned from the database; the others are not). Undone after the test."""
    rules = [
        ("INPUT", "-p", "tcp", "-d", "127.0.0.2", "--dport", str(postgres_server.port), "-j", "DROP"),
        ("INPUT", "-p", "tcp", "-s", "127.0.0.2", "--sport", str(postgres_server.port), "-j", "DROP"),
    ]
    added: list[tuple[str, ...]] = []

    def cut() -> None:
        for rule in rules:
            _iptables("-I", *rule)
            added.append(rule)

    try:
        yield cut
    finally:
        for rule in added:
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables("-D", *rule)


def test_a_leader_cut_off_from_the_database_stops_acting_before_another_replica_starts(
    fleet, pg_url, postgres_server, partition, tmp_path
):
    held = tmp_path / "held"
    held.mkdir()
    fleet.env.update({"FLEETHEAL_TEST_HOLD_S": "120", "FLEETHEAL_TEST_HOLD_ONCE_DIR": str(held)})
    fleet.playbooks = TEST_PLAYBOOKS
    a = fleet.start("replica-a", url=pg_url.replace("@127.0.0.1:", "@127.0.0.2:"))
    assert fleet.leader() is a
    b = fleet.start("replica-b")
    errors: list[str] = []
    for data in _alerts(50):
        fleet.post(data, errors)
    _wait("the leader's playbooks to hold", lambda: len(list(held.iterdir())) >= 10, 120)

    # Watch the old leader's hands: when did the last of its playbook processes go?
    last_seen = [time.time()]
    watching = threading.Event()

    def watch() -> None:
        marker = os.path.join(str(a.run_dir), "")
        while not watching.is_set():
            # The time is taken the moment a process is read, not after the whole listing (which can take
            # long on a loaded machine): it is the last moment a playbook process of a's was seen alive.
            for proc in psutil.process_iter(["cmdline"]):
                if marker in " ".join(proc.info["cmdline"] or ()):
                    last_seen[0] = max(last_seen[0], time.time())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cut_at = time.time()
    partition()
    try:
        assert fleet.leader(timeout=60) is b
        store = Store.postgres(pg_url)
        try:
            leads = _leads(store)
            # a's epoch 1 is fenced out and a never takes the lead again; b may have taken it more than once
            # on a loaded machine (a renewal late by renew_deadline_s), so b's first epoch is the one that counts.
            assert leads[0][:2] == (1, "replica-a") and {h for _, h, _ in leads[1:]} == {"replica-b"}, leads
            since = leads[1][2]
            _wait(
                "every incident to finish",
                lambda: not store.unfinished() and len(store.incidents(limit=100)) == 50,
                300,
            )
        finally:
            store.close()
    finally:
        watching.set()
        watcher.join()
    # The cut-off leader's playbooks were gone before the new leader took the lead and started any.
    assert last_seen[0] < since, (last_seen[0] - cut_at, since - cut_at)
    assert a.alive()  # it stepped down, it did not die
    assert "stepping down" in a.text()
    _check_every_incident_once(pg_url, 50, fleet.record)
    print(
        f"cut at 0; old leader's last playbook process at {last_seen[0] - cut_at:.2f} s; new leader at {since - cut_at:.2f} s"
    )
