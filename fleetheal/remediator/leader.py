"""Leader election through a coordination.k8s.io Lease: several remediator replicas, one acting.

The algorithm is client-go's (`k8s.io/client-go/tools/leaderelection`), on the official Python client's
Lease API:

- Every `retry_period_s` each replica reads the Lease. A follower takes it when it is free or when its
  record has not changed for `lease_duration_s` by the follower's own clock (no clock is compared with
  another machine's); the write carries the resourceVersion it read, so of two replicas racing for it
  one gets 409 Conflict.
- The leader renews it every `retry_period_s`. A leader that could not renew has stepped down by
  `renew_deadline_s` after its last renewal began, by construction: its requests never run past that
  deadline, and it steps down as soon as its next try could not begin before it. Stepping down
  (`on_stop`) then has `fence_timeout_s` to see every playbook process gone, and the lease runs
  `lease_duration_s`, at least `retry_period_s` longer than both (config.py checks the margin).
- A replica that cannot reach the database does not take the lease, and a leader that lost the database
  for `renew_deadline_s` steps down and releases it, so a replica that can reach it takes over.

Stepping down (`on_stop`) happens in this thread and does not wait for the event loop, which may be stuck
in a database call: the store refuses the state machine's writes from then on and every playbook process
is killed and waited for. The lease is released only once `on_stop` has seen them gone; when it could not
(a process that survives SIGKILL), the lease is left to expire. The store's fencing epoch (store/db.py)
covers what timing cannot: a write from a replica that lost the lead fails in the database.

The Python client ships a `LeaderElection` too; it has no request timeout (a stuck API server call holds
the renew loop past its deadline), cannot be stopped or release the lease, and exits the process on a bad
setting, so the loop is here, short, and tested against the real API server.
"""

from __future__ import annotations

import datetime
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from fleetheal import kubeclient
from fleetheal.remediator.config import LeaderElectionConfig

log = logging.getLogger("fleetheal.remediator.leader")

#: The wait between two periods is retry_period_s times 1 to 1 + MAX_JITTER (client-go's jitter).
MAX_JITTER = 0.2


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Probe:
    """Whether `check()` answers, without ever waiting long for it: the check runs in a thread of its own,
    one at a time; a check that has not answered within `timeout_s` (a database behind a cut network)
    reads as down until one answers again."""

    #: How long `ok()` waits for a check it started (a healthy database answers in milliseconds).
    WAIT_S = 0.2

    def __init__(self, check: Callable[[], object], timeout_s: float) -> None:
        self.check = check
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._result: list[bool] = []
        self._healthy = False

    def ok(self) -> bool:
        if self._thread is None or not self._thread.is_alive():
            result: list[bool] = []

            def run() -> None:
                try:
                    self.check()
                    result.append(True)
                except BaseException:
                    result.append(False)

            self._result = result
            self._started = time.monotonic()
            self._thread = threading.Thread(target=run, name="store-probe", daemon=True)
            self._thread.start()
        self._thread.join(min(self.WAIT_S, self.timeout_s))
        if self._result:
            self._healthy = self._result[0]
        elif time.monotonic() - self._started >= self.timeout_s:
            self._healthy = False
        return self._healthy


def api_client(kubeconfig: str, retries: int | None = None) -> Any:
    """A Kubernetes ApiClient from `kubeconfig`, or ("") from the pod's service account (`fleetheal.kubeclient`)."""
    return kubeclient.api_client(kubeconfig, retries=retries)


class LeaderElector:
    """Run `run(stop)` in a thread. `on_lead()` when this replica takes the lease, `on_stop(reason)` when it
    stops leading (both called from that thread; `on_stop` must return only once nothing acts any more,
    and returns False when it could not see that: the lease is then not released but left to expire)."""

    def __init__(
        self,
        cfg: LeaderElectionConfig,
        *,
        on_lead: Callable[[], None],
        on_stop: Callable[[str], bool | None],
        store_ok: Callable[[], bool] = lambda: True,
        api: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.identity = cfg.holder()
        self.on_lead = on_lead
        self.on_stop = on_stop
        self.store_ok = store_ok
        self.clock = clock
        self._api = api
        self._leading = False
        self._renewed = 0.0  # clock() of the last successful write of the lease
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._store_down_since: float | None = None
        self._demanded: str | None = None
        #: clock() by which the request under way must end (a leader's renewal: its renew deadline).
        self._call_deadline: float | None = None
        #: Who holds the lease as last read ("" when free or unknown).
        self.holder = ""
        self.transitions = 0

    @property
    def leading(self) -> bool:
        """True while this replica holds a lease it renewed less than renew_deadline_s ago."""
        return self._leading and self.clock() - self._renewed < self.cfg.renew_deadline_s

    def api(self) -> Any:
        if self._api is None:
            from kubernetes import client

            # one try per period; the loop is the retry
            self._api = client.CoordinationV1Api(api_client(self.cfg.kubeconfig, retries=0))
        return self._api

    # --- the loop --------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        log.info("leader election: following", extra={"identity": self.identity, "lease": self.cfg.lease_name})
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # the loop must outlive anything one period does
                log.exception("leader election: unexpected error")
            # client-go's jitter keeps the replicas from reading the lease in lockstep
            stop.wait(self.cfg.retry_period_s * (1 + MAX_JITTER * random.random()))  # noqa: S311 - jitter
        if self._leading:
            self._step_down("the remediator is stopping", release=True)

    def demand_step_down(self, reason: str) -> None:
        """From any thread: step down at the next period (the store says another replica leads)."""
        self._demanded = reason

    def step(self) -> None:
        """One period: follow, take, renew or step down."""
        demanded, self._demanded = self._demanded, None
        if demanded is not None and self._leading:
            self._step_down(demanded, release=True)
            return
        now = self.clock()
        store_ok = self.store_ok()
        if store_ok:
            self._store_down_since = None
        elif self._store_down_since is None:
            self._store_down_since = now
        if not self._leading:
            if store_ok and self._try(now):
                self._leading = True
                self._renewed = now
                log.info("leader election: leading", extra={"identity": self.identity, "transitions": self.transitions})
                self.on_lead()
                # Taking the lead can wait (the database's write lock, still held for a replica cut off in the
                # middle of a write until the server ends its session): renew at once, so that wait does not
                # count against the renew deadline and the new leader does not step down as it starts.
                self._renew(self.clock())
            return
        if self._store_down_since is not None and now - self._store_down_since >= self.cfg.renew_deadline_s:
            self._step_down(f"the database did not answer for {now - self._store_down_since:.1f} s", release=True)
            return
        if self._renew(now):
            return
        # By the clock now, not when the period began. The next period begins up to MAX_JITTER periods
        # from now: when that is past the deadline, step down now, so it happens by the deadline.
        late = self.clock() - self._renewed
        if late + self.cfg.retry_period_s * (1 + MAX_JITTER) >= self.cfg.renew_deadline_s:
            self._step_down(f"could not renew the lease for {late:.1f} s", release=False)

    def _renew(self, now: float) -> bool:
        """Renew the lease held; no request of it may end after the deadline of the last renewal (`_call`
        bounds each)."""
        self._call_deadline = self._renewed + self.cfg.renew_deadline_s
        try:
            if now < self._call_deadline and self._try(now):
                self._renewed = now
                return True
            return False
        finally:
            self._call_deadline = None

    def _step_down(self, reason: str, *, release: bool) -> None:
        self._leading = False
        log.warning("leader election: stepping down", extra={"identity": self.identity, "reason": reason})
        stopped: bool | None = False
        try:
            stopped = self.on_stop(reason)
        finally:
            if stopped is False:
                log.error(
                    "leader election: not every playbook process was seen gone; the lease is left to expire",
                    extra={"identity": self.identity},
                )
            elif release:
                self.release()

    # --- the Lease -------------------------------------------------------------------------------------

    def _timeout(self) -> float:
        """Each request's limit: a try (two requests) ends within about two of them."""
        return max(0.5, min(self.cfg.retry_period_s, self.cfg.renew_deadline_s / 4))

    def _try(self, now: float) -> bool:
        """Take or renew the lease; False when someone else holds it or the API server did not answer."""
        from kubernetes import client

        cfg = self.cfg
        api = self.api()
        duration = math.ceil(cfg.lease_duration_s)
        lease = self._call("read", api.read_namespaced_lease, cfg.lease_name, cfg.namespace, missing_ok=True)
        if lease is False:
            return False
        if lease is None:  # no lease yet: create it, holding it
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=cfg.lease_name, namespace=cfg.namespace),
                spec=client.V1LeaseSpec(
                    holder_identity=self.identity,
                    lease_duration_seconds=duration,
                    acquire_time=_now(),
                    renew_time=_now(),
                    lease_transitions=0,
                ),
            )
            if self._call("create", api.create_namespaced_lease, cfg.namespace, body) is False:
                return False
            self.holder, self.transitions = self.identity, 0
            return True
        spec = lease.spec or client.V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = spec.holder_identity or ""
        self.transitions = spec.lease_transitions or 0
        held_for = max(cfg.lease_duration_s, float(spec.lease_duration_seconds or 0))
        if self.holder and self.holder != self.identity and now - self._observed_at < held_for:
            return False  # someone else's, and not expired by our clock
        if self.holder != self.identity:
            spec.acquire_time = _now()
            spec.lease_transitions = self.transitions + 1
        spec.holder_identity = self.identity
        spec.renew_time = _now()
        spec.lease_duration_seconds = duration
        lease.spec = spec
        # The resourceVersion read above goes with the write: of two replicas racing, one gets 409.
        if self._call("write", api.replace_namespaced_lease, cfg.lease_name, cfg.namespace, lease) is False:
            return False
        self.holder, self.transitions = self.identity, spec.lease_transitions or 0
        return True

    def _call(self, what: str, method: Callable[..., Any], *args: Any, missing_ok: bool = False) -> Any:
        """One request to the API server within `_timeout()`; False when it failed (logged), None for a 404
        with `missing_ok`."""
        from kubernetes.client.exceptions import ApiException

        timeout = self._timeout()
        if self._call_deadline is not None:
            left = self._call_deadline - self.clock()
            if left <= 0:
                log.info(f"leader election: no time left to {what} the lease before the renew deadline")
                return False
            timeout = min(timeout, left)
        try:
            return method(*args, _request_timeout=timeout)
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            log.info(f"leader election: cannot {what} the lease", extra={"status": exc.status})
        except Exception as exc:  # urllib3 errors: the API server did not answer
            log.info("leader election: API server unreachable", extra={"error": str(exc)[:200]})
        return False

    def release(self) -> None:
        """Give the lease up now (client-go's ReleaseOnCancel): a follower takes it at its next period."""
        try:
            api = self.api()
        except Exception as exc:
            log.info("leader election: could not release the lease", extra={"error": str(exc)[:200]})
            return
        lease = self._call("read", api.read_namespaced_lease, self.cfg.lease_name, self.cfg.namespace)
        if not lease or lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        lease.spec.holder_identity = None
        lease.spec.lease_duration_seconds = 1
        lease.spec.renew_time = _now()
        if self._call("release", api.replace_namespaced_lease, self.cfg.lease_name, self.cfg.namespace, lease):
            log.info("leader election: released the lease", extra={"identity": self.identity})
