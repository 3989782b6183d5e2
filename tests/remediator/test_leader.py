"""Leader election on the real kube-apiserver (`make tools`): one leader, failover, stepping down."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from fleetheal.remediator.config import LeaderElectionConfig
from fleetheal.remediator.leader import LeaderElector, Probe

_names = itertools.count()


class Candidate:
    def __init__(self, kube, lease: str, identity: str, store_ok=lambda: True) -> None:
        cfg = LeaderElectionConfig(
            enabled=True,
            namespace="default",
            lease_name=lease,
            identity=identity,
            lease_duration_s=2.0,
            renew_deadline_s=1.5,
            retry_period_s=0.25,
            kubeconfig=str(kube.kubeconfig),
        )
        self.events: list[tuple[str, float]] = []
        self.elector = LeaderElector(
            cfg,
            on_lead=lambda: self.events.append(("lead", time.monotonic())),
            on_stop=lambda reason: self.events.append((f"stop: {reason}", time.monotonic())),
            store_ok=store_ok,
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.elector.run, args=(self.stop,), daemon=True)

    def start(self) -> Candidate:
        self.thread.start()
        return self

    def crash(self) -> None:
        """Stop the loop without releasing the lease (a SIGKILL)."""
        self.elector._leading = False
        self.stop.set()
        self.thread.join(5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _wait(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def lease():
    return f"test-lease-{next(_names)}-{int(time.time())}"


def test_one_leader_and_a_follower_takes_over_when_the_leader_dies(kube, lease):
    a = Candidate(kube, lease, "a").start()
    _wait(lambda: a.elector.leading)
    b = Candidate(kube, lease, "b").start()
    try:
        time.sleep(1.0)
        assert not b.elector.leading and b.elector.holder == "a"
        died = time.monotonic()
        a.crash()
        _wait(lambda: b.elector.leading)
        took = time.monotonic() - died
        # not before the lease expired by b's clock, and soon after
        assert 1.0 <= took <= 2.0 + 1.5, took
        assert b.elector.transitions == 1
    finally:
        a.close()
        b.close()


def test_a_leader_without_its_database_steps_down_and_releases_the_lease(kube, lease):
    db = {"a": True}
    a = Candidate(kube, lease, "a", store_ok=lambda: db["a"]).start()
    _wait(lambda: a.elector.leading)
    b = Candidate(kube, lease, "b").start()
    try:
        time.sleep(0.5)
        db["a"] = False
        cut = time.monotonic()
        _wait(lambda: b.elector.leading)
        stops = [(e, t) for e, t in a.events if e.startswith("stop")]
        assert len(stops) == 1 and "database did not answer" in stops[0][0]
        # a stopped acting before b could start
        assert stops[0][1] <= next(t for e, t in b.events if e == "lead")
        assert time.monotonic() - cut < 1.5 + 2 * 0.25 + 2.0
        # a does not take the lease back while its database is away
        time.sleep(1.0)
        assert b.elector.leading and not a.elector.leading
    finally:
        a.close()
        b.close()


def test_a_replica_that_cannot_reach_the_database_never_takes_the_lease(kube, lease):
    a = Candidate(kube, lease, "a", store_ok=lambda: False).start()
    try:
        time.sleep(1.5)
        assert not a.elector.leading and a.events == []
    finally:
        a.close()


def test_a_stopping_leader_releases_the_lease_and_a_follower_takes_it_at_once(kube, lease):
    a = Candidate(kube, lease, "a").start()
    _wait(lambda: a.elector.leading)
    b = Candidate(kube, lease, "b").start()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        a.close()
        assert [e for e, _ in a.events] == ["lead", "stop: the remediator is stopping"]
        _wait(lambda: b.elector.leading)
        assert time.monotonic() - t0 < 1.5  # not a whole lease duration
    finally:
        b.close()


def test_the_probe_says_down_when_the_check_hangs_and_never_waits_for_it():
    gate = threading.Event()
    calls = []

    def check():
        calls.append(1)
        gate.wait(10)

    probe = Probe(check, timeout_s=0.5)
    t0 = time.monotonic()
    assert probe.ok() is False  # no answer yet
    time.sleep(0.6)
    assert probe.ok() is False  # no answer within the timeout: down
    assert time.monotonic() - t0 < 1.5
    assert len(calls) == 1  # the hung check is not started twice
    gate.set()
    time.sleep(0.05)
    assert Probe(lambda: None, 0.5).ok() is True
    assert Probe(lambda: 1 / 0, 0.5).ok() is False
