"""Leader election on the real kube-apiserver (`make tools`): one leader, failover, stepping down."""

from __future__ import annotations

import copy
import itertools
import random
import threading
import time

import pytest
from kubernetes.client.exceptions import ApiException

from fleetheal.remediator.config import LeaderElectionConfig
from fleetheal.remediator.leader import MAX_JITTER, LeaderElector, Probe

_names = itertools.count()


class Candidate:
    def __init__(self, kube, lease: str, identity: str, store_ok=lambda: True, lease_duration_s=2.5) -> None:
        cfg = LeaderElectionConfig(
            enabled=True,
            namespace="default",
            lease_name=lease,
            identity=identity,
            lease_duration_s=lease_duration_s,
            renew_deadline_s=1.5,
            retry_period_s=0.25,
            fence_timeout_s=0.5,
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
        _wait(lambda: b.elector.holder == "a")
        assert not b.elector.leading
        a.crash()
        _wait(lambda: b.elector.leading)
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
        _wait(lambda: b.elector.leading)
        stops = [(e, t) for e, t in a.events if e.startswith("stop")]
        assert len(stops) == 1 and "database did not answer" in stops[0][0]
        # a stopped acting before b could start
        assert stops[0][1] <= next(t for e, t in b.events if e == "lead")
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
    # A lease of a minute: b can take it within the wait below only because a released it.
    a = Candidate(kube, lease, "a", lease_duration_s=60.0).start()
    _wait(lambda: a.elector.leading)
    b = Candidate(kube, lease, "b", lease_duration_s=60.0).start()
    try:
        _wait(lambda: b.elector.holder == "a")
        a.close()
        assert [e for e, _ in a.events] == ["lead", "stop: the remediator is stopping"]
        _wait(lambda: b.elector.leading, timeout=30.0)
        assert b.elector.transitions == 1 and b.elector.holder == "b"
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


# --- the hand-over's timeline, on a simulated clock ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class LeaseAPI:
    """A test double of the API server's Lease API (read, create, replace with resourceVersion conflicts)
    on a simulated clock: a request costs `latency` seconds, or its whole timeout, then fails, when the
    server is cut off or slower than the timeout."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.lease = None
        self.version = 0
        self.down = False
        self.latency = 0.01
        self.writes: list[str | None] = []

    def _cost(self, timeout: float) -> None:
        assert timeout > 0
        if self.down or self.latency > timeout:
            self.clock.t += timeout
            raise TimeoutError("read timed out")
        self.clock.t += self.latency

    def read_namespaced_lease(self, name, namespace, _request_timeout):
        self._cost(_request_timeout)
        if self.lease is None:
            raise ApiException(status=404)
        return copy.deepcopy(self.lease)

    def _store(self, body):
        self.version += 1
        body.metadata.resource_version = str(self.version)
        self.lease = copy.deepcopy(body)
        self.writes.append(body.spec.holder_identity)
        return copy.deepcopy(body)

    def create_namespaced_lease(self, namespace, body, _request_timeout):
        self._cost(_request_timeout)
        if self.lease is not None:
            raise ApiException(status=409)
        return self._store(body)

    def replace_namespaced_lease(self, name, namespace, body, _request_timeout):
        self._cost(_request_timeout)
        if body.metadata.resource_version != self.lease.metadata.resource_version:
            raise ApiException(status=409)
        return self._store(body)


def _elector(clock: Clock, api: LeaseAPI, stopped: bool | None = True, store_ok=lambda: True):
    cfg = LeaderElectionConfig(enabled=True, namespace="default", lease_name="l", identity="a")
    stops: list[tuple[str, float]] = []

    def on_stop(reason: str) -> bool | None:
        stops.append((reason, clock()))
        return stopped

    elector = LeaderElector(cfg, on_lead=lambda: None, on_stop=on_stop, store_ok=store_ok, api=api, clock=clock)
    return cfg, elector, stops


@pytest.mark.parametrize("seed", range(300))
def test_a_leader_cut_off_from_the_api_server_has_stepped_down_by_its_renew_deadline(seed):
    """Whatever the latencies and the jitter: the step-down (and so the fence) begins no later than
    renew_deadline_s after the last successful renewal began, which leaves the fence and the margin
    before a follower may take the lease (lease_duration_s after it saw that renewal)."""
    rng = random.Random(seed)
    clock = Clock()
    api = LeaseAPI(clock)
    cfg, elector, stops = _elector(clock, api)
    elector.step()
    assert elector.leading
    renewals = [elector._renewed]
    cut_at = clock.t + rng.uniform(2, 30)
    while not stops:
        assert clock.t < cut_at + 60, "never stepped down"
        api.down = clock.t >= cut_at
        api.latency = rng.choice([0.005, 0.05, 0.4, 0.9, 1.5])  # some answers come too late
        before = elector._renewed
        elector.step()
        if elector._renewed != before:
            renewals.append(elector._renewed)
        clock.t += cfg.retry_period_s * (1 + MAX_JITTER * rng.random())
    (reason, at), last = stops[0], renewals[-1]
    assert "could not renew" in reason
    assert at <= last + cfg.renew_deadline_s, (at - last, reason)
    assert not elector.leading
    margin = cfg.lease_duration_s - cfg.renew_deadline_s - cfg.fence_timeout_s
    assert margin >= cfg.retry_period_s  # the defaults keep the margin config.py requires
    assert api.writes[-1] == "a"  # never released: the API server did not answer


def test_a_leader_that_could_not_see_its_playbooks_gone_leaves_the_lease_to_expire():
    clock = Clock()
    api = LeaseAPI(clock)
    db = {"ok": True}
    cfg, elector, stops = _elector(clock, api, stopped=False, store_ok=lambda: db["ok"])
    elector.step()
    assert elector.leading and api.writes == ["a", "a"]  # taken, and renewed once it has started
    db["ok"] = False
    while not stops:
        clock.t += cfg.retry_period_s
        elector.step()
    assert "database did not answer" in stops[0][0]
    assert None not in api.writes  # not released: a follower waits for the lease to expire

    # The same replica, when its playbooks were seen gone, releases it at once.
    clock2 = Clock()
    api2 = LeaseAPI(clock2)
    cfg, elector2, stops2 = _elector(clock2, api2, stopped=True)
    elector2.step()
    elector2.demand_step_down("the store says another replica leads")
    elector2.step()
    assert stops2 and api2.writes == ["a", "a", None]


def test_a_new_leader_whose_start_waited_does_not_step_down_for_it():
    """CI saw it (epoch 3 where 2 was due): taking the lead waited seconds for the database's write lock, still
    held for the replica cut off in the middle of a write, and the new leader then stepped down for a renewal
    it had not had the time to make, and took the lead again. It renews as soon as it has started."""
    clock = Clock()
    api = LeaseAPI(clock)
    cfg = LeaderElectionConfig(enabled=True, namespace="default", lease_name="l", identity="a")
    stops: list[str] = []

    def slow_start() -> None:
        clock.t += cfg.renew_deadline_s - 1  # within the deadline, but later than the next period

    elector = LeaderElector(
        cfg, on_lead=slow_start, on_stop=lambda reason: stops.append(reason) or True,
        store_ok=lambda: True, api=api, clock=clock,
    )  # fmt: skip
    elector.step()
    for _ in range(10):
        clock.t += cfg.retry_period_s * (1 + MAX_JITTER)
        elector.step()
    assert elector.leading and stops == [], stops
    assert api.writes.count(None) == 0 and set(api.writes) == {"a"}
