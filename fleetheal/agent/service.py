"""Wiring: sources -> classification -> health state -> exporter, health file and fast path.

`Agent` is the long-running service (`fleetheal agent run`): one polling loop (GPU counters, training
judgements, expiry) on the calling thread, and one thread each for GPU events, the kernel log, the
training socket, the fast path and the metrics endpoint. The exporter and the health file are in
fleetheal.agent.outputs; the one-shot check (`fleetheal agent check`) in fleetheal.agent.check runs one
cycle of this loop.

Every callback from a source goes through `Agent.detect`, which serialises on one lock; slow work
(scontrol, the Kubernetes API) runs on the fast-path thread so detection never waits for it. (A little over
500 lines: each source's entry point is a few lines here, and what they judge lives in its own module.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fleetheal import __version__
from fleetheal.agent.backends import (
    BackendUnavailable,
    GpuBackend,
    GpuEvent,
    GpuLost,
    GpuSample,
    NvmlBackend,
    normalize_pci,
)
from fleetheal.agent.config import AgentConfig
from fleetheal.agent.fastpath import (
    DONE,
    FAILED,
    KEPT_FOREIGN,
    OVER_BUDGET,
    WOULD,
    FastPathError,
    JobOwners,
    KubeNodeTainter,
    SlurmDrainer,
)
from fleetheal.agent.health import ActiveFault, Change, Detection, HealthTracker, classify_sample, gpu_label
from fleetheal.agent.joboutput import JobOutputJudge
from fleetheal.agent.outputs import Exporter, HealthFile
from fleetheal.agent.simulated import SimulatedGpuBackend
from fleetheal.agent.training import SOURCE as TRAINING
from fleetheal.agent.training import ReportRefused, TrainingMonitor, parse_report, run_label, slurm_job_id
from fleetheal.contracts import JOB_OUTPUT_SOURCE, NODE_WIDE_GPU, drain_reason
from fleetheal.logparse import APPLICATION as APPLICATION_RULES
from fleetheal.logparse import KERNEL as KERNEL_RULES
from fleetheal.logparse import judged_lines, load_parser
from fleetheal.slurm.runner import Runner
from fleetheal.taxonomy import Taxonomy, load

if TYPE_CHECKING:
    from fleetheal.agent.jobfiles import JobOutputFollower
    from fleetheal.agent.metrics import AgentMetrics

KERNEL_LOG = "kernel_log"
#: Lines no log rule knows that the agent writes to its own log per minute (all are counted).
UNKNOWN_LOG_PER_MINUTE = 10
#: Read errors logged a minute per source (each counted in fleetheal_agent_read_errors_total).
READ_ERRORS_LOGGED_PER_MINUTE = 10
#: Training reports of one uid refused a second before the rest of that second's are dropped unread.
REFUSALS_PER_UID_S = 100
log = logging.getLogger("fleetheal.agent")


def _log(level: int, msg: str, **fields: Any) -> None:
    log.log(level, msg, extra=fields)


def make_backend(cfg: AgentConfig) -> GpuBackend:
    if cfg.backend.kind == "simulated":
        return SimulatedGpuBackend(cfg.backend.simulated.state_file, cfg.backend.simulated.gpus)
    return NvmlBackend()


def make_drainer(cfg: AgentConfig) -> SlurmDrainer | None:
    s = cfg.fastpath.slurm
    if not s.enabled:
        return None
    return SlurmDrainer(
        cfg.node,
        s.scontrol,
        slurm_conf=s.slurm_conf,
        timeout_s=s.timeout_s,
        dry_run=cfg.observe_only,
        budget_nodes=cfg.fastpath.fleet_budget_nodes,
        budget_share=cfg.fastpath.fleet_budget_share,
    )


def make_job_owners(cfg: AgentConfig) -> JobOwners:
    s = cfg.fastpath.slurm
    squeue = None
    if s.enabled:
        squeue = os.path.join(os.path.dirname(s.scontrol), "squeue") if os.sep in s.scontrol else "squeue"
    return JobOwners(
        cfg.node,
        squeue,
        trusted_uids=cfg.training.trusted_uids,
        jobs_dir=cfg.training.job_owners_dir or None,
        slurm_conf=s.slurm_conf,
        timeout_s=s.timeout_s,
    )


def _slurm_runner(cfg: AgentConfig) -> Runner:
    """Slurm's clients as the fast path runs them (its scontrol's directory, SLURM_CONF, timeout)."""
    s = cfg.fastpath.slurm
    env = dict(os.environ, SLURM_CONF=s.slurm_conf) if s.slurm_conf else None
    return Runner(bin_dir=os.path.dirname(s.scontrol) if os.sep in s.scontrol else "", env=env, timeout_s=s.timeout_s)


def make_tainter(cfg: AgentConfig) -> KubeNodeTainter | None:
    k = cfg.fastpath.kubernetes
    if not k.enabled:
        return None
    return KubeNodeTainter(
        cfg.node, k.api_url, k.token_file, ca_file=k.ca_file, timeout_s=k.timeout_s, dry_run=cfg.observe_only
    )


def now_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class _Action:
    fault_id: str
    gpu: str
    action: str
    detected_at: float
    wall: float


class Agent:
    """The node-health agent. Constructor arguments are injectable for tests (backend, clock, metrics)."""

    def __init__(
        self,
        cfg: AgentConfig,
        backend: GpuBackend | None = None,
        *,
        metrics: AgentMetrics | None = None,
        drainer: SlurmDrainer | None = None,
        tainter: KubeNodeTainter | None = None,
        taxonomy: Taxonomy | None = None,
        job_owners: JobOwners | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from fleetheal.agent.metrics import AgentMetrics

        self.cfg = cfg
        self.node = cfg.node
        self.backend = backend or make_backend(cfg)
        self.metrics = metrics or AgentMetrics()
        self.drainer = drainer if drainer is not None else make_drainer(cfg)
        #: faults whose drain the fleet budget held (their taint is held too)
        self._over_budget: set[str] = set()
        self.tainter = tainter if tainter is not None else make_tainter(cfg)
        self.tx = taxonomy or load()
        self.clock = clock
        self.parser = load_parser(cfg.kernel_log.rules_file or None, self.tx, log=KERNEL_RULES)
        self._unknown_logged: tuple[float, int] = (0.0, 0)  # (window start, lines logged in it)
        #: source -> (window start, read errors logged in it, not logged since the last one logged)
        self._read_errors_logged: dict[str, tuple[float, int, int]] = {}
        #: uid -> (window start, training reports refused in the window)
        self._refusals: dict[int | None, tuple[float, int]] = {}
        #: Slurm jobs whose prolog file was seen (`training.job_owners_dir`): gone again means the job left.
        self._job_files_seen: set[str] = set()
        self._runs_refused_logged = float("-inf")  # when a line over MAX_RUNS_PER_JOB was last logged (monotonic)
        self.tracker = HealthTracker(self.tx, cfg.health)
        self.training = TrainingMonitor(cfg.training)
        application = load_parser(cfg.kernel_log.rules_file or None, self.tx, log=APPLICATION_RULES)
        self.job_output = JobOutputJudge(self.tx, application, dedup_s=cfg.health.dedup_s)
        self.job_owners = job_owners if job_owners is not None else make_job_owners(cfg)
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.actions: queue.Queue[_Action | None] = queue.Queue()
        self.backend_ok = False
        self._next_open = 0.0
        self._previous: dict[int, GpuSample] = {}
        self._bus_to_gpu: dict[str, int] = {}
        #: GPUs the last poll saw.
        self.visible_gpus = 0
        self.exporter = Exporter(self.metrics, self.node)
        self.health_file = HealthFile(cfg.health_file, cfg.fastpath.drain_actions)
        self._threads: list[threading.Thread] = []
        #: The follower of this node's job output files, once its thread runs (`cfg.job_files`).
        self.job_files: JobOutputFollower | None = None
        self.src = self.backend.name
        m = self.metrics
        m.info.info({"node": self.node, "backend": self.src, "mode": self.cfg.mode, "version": __version__})
        m.gpu_expected.labels(self.node).set(cfg.backend.expected_gpus)
        for source in (self.src, KERNEL_LOG, TRAINING, JOB_OUTPUT_SOURCE, "slurm", "kubernetes"):
            m.read_errors.labels(source)  # export zeros, so a rate() sees the first error
        m.health.labels(self.node, NODE_WIDE_GPU).set(0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def open_backend(self) -> str | None:
        """Open the GPU backend; None, or why it cannot be opened (retried every 30 s by poll_once)."""
        try:
            self.backend.open()
        except BackendUnavailable as exc:
            self.backend_ok = False
            self._next_open = time.monotonic() + 30.0
            self.metrics.backend_up.labels(self.src).set(0)
            self.metrics.read_errors.labels(self.src).inc()
            _log(logging.ERROR, "no GPU backend; other sources keep running", backend=self.src, error=str(exc))
            return str(exc)
        self.backend_ok = True
        self.metrics.backend_up.labels(self.src).set(1)
        self._index_gpus()
        _log(logging.INFO, "GPU backend open", backend=self.src, gpus=len(self._bus_to_gpu))
        return None

    def _index_gpus(self) -> None:
        try:
            gpus = self.backend.gpus()
        except Exception as exc:  # a backend error is a counted read error, never a crash
            self.metrics.read_errors.labels(self.src).inc()
            _log(logging.WARNING, "cannot enumerate GPUs", error=str(exc))
            return
        self._bus_to_gpu.update({g.pci_bus_id: g.index for g in gpus})

    def start(self) -> None:
        """Open the backend and start every thread; returns at once."""
        cfg = self.cfg
        self.open_backend()
        self.exporter.serve(
            cfg.metrics.listen, cfg.metrics.port, cfg.metrics.max_connections, cfg.metrics.header_timeout_s
        )
        self._spawn("fastpath", self._fastpath_loop)
        self._spawn("gpu-events", self._event_loop)
        if cfg.kernel_log.enabled:
            from fleetheal.agent.sources import KernelLogFollower

            follower = KernelLogFollower(
                cfg.kernel_log.path,
                self.kernel_line,
                lambda why: self.read_error(KERNEL_LOG, why),
                cfg.kernel_log.from_start,
                position=cfg.kernel_log.position_file,
                max_backlog=cfg.kernel_log.max_backlog_bytes,
            )
            self._spawn("kernel-log", lambda: follower.run(self.stop_event))
            self.metrics.source_up.labels(KERNEL_LOG).set_function(lambda: float(follower.up()))
            follower.ready.wait(2.0)
        if cfg.training.enabled:
            from fleetheal.agent.sources import TrainingReportServer

            server = TrainingReportServer(
                cfg.training.socket, self.training_report, lambda why: self.read_error(TRAINING, why)
            )
            try:
                server.bind()
            except OSError as exc:  # the other sources still run; the error is counted and logged
                self.metrics.source_up.labels(TRAINING).set(0)
                self.read_error(TRAINING, f"cannot listen on {cfg.training.socket}: {exc}")
            else:
                self.metrics.source_up.labels(TRAINING).set(1)
                self._spawn("training", lambda: server.run(self.stop_event))
        if cfg.job_files.enabled and cfg.fastpath.slurm.enabled:
            self._spawn("job-files", self._job_files_loop)
        with self.lock:
            self.health_file.write(self.tracker.active())
        _log(logging.INFO, "agent started", node=self.node, mode=cfg.mode, backend=self.src)

    def _job_files_loop(self) -> None:
        from fleetheal.agent.jobfiles import JobOutputFollower

        follower = self.job_files = JobOutputFollower(
            self.node,
            self.job_lines,
            lambda why: self.read_error(JOB_OUTPUT_SOURCE, why),
            runner=_slurm_runner(self.cfg),
            max_bytes=self.cfg.job_files.max_bytes,
        )
        while not self.stop_event.is_set():
            follower.poll()
            self.stop_event.wait(self.cfg.job_files.interval_s)

    def job_lines(self, job: str, text: str, run: str) -> None:
        """Whole lines run `run` of job `job` wrote to its output file: each one a rule may match is judged as a
        line `fleetheal launch` sends (`job_line`)."""
        now = self.clock()
        for line in judged_lines(text, self.job_output.parser.may_match):
            self.job_line(job, line, run, now)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        def guarded() -> None:
            while not self.stop_event.is_set():
                try:
                    target()
                    return
                except Exception:  # a source that crashes restarts; the agent stays up
                    log.exception("thread %s failed; restarting in 1 s", name)
                    self.stop_event.wait(1.0)

        t = threading.Thread(target=guarded, name=f"fleetheal-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def run(self) -> None:
        """Start, then poll every poll_interval_s until stop() (or SIGTERM through the CLI)."""
        self.start()
        try:
            while not self.stop_event.is_set():
                started = time.monotonic()
                try:
                    self.poll_once()
                except Exception:  # one bad cycle is logged; the agent keeps watching its node
                    log.exception("polling cycle failed; the next one runs as usual")
                self.stop_event.wait(max(0.0, self.cfg.poll_interval_s - (time.monotonic() - started)))
        finally:
            self.shutdown()

    def stop(self) -> None:
        self.stop_event.set()

    def shutdown(self) -> None:
        self.stop_event.set()
        self.actions.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        self.exporter.close()
        with contextlib.suppress(Exception):
            self.backend.close()
        _log(logging.INFO, "agent stopped", node=self.node)

    # ---- sources -----------------------------------------------------------------------------

    def read_error(self, source: str, why: str) -> None:
        """Count a failed or refused read, and log it: at most READ_ERRORS_LOGGED_PER_MINUTE a minute per source,
        the rest counted in the next line logged (a local user refused as fast as it can send must not flood the
        agent's log: 116 MB in 22 s, issue 46; the counter counts every one)."""
        self.metrics.read_errors.labels(source).inc()
        now = time.monotonic()
        start, logged, suppressed = self._read_errors_logged.get(source, (now, 0, 0))
        if now - start >= 60.0:
            start, logged = now, 0
        if logged < READ_ERRORS_LOGGED_PER_MINUTE:
            extra = {"suppressed": suppressed} if suppressed else {}
            _log(logging.WARNING, "read error", source=source, error=why, **extra)
            self._read_errors_logged[source] = (start, logged + 1, 0)
        else:
            self._read_errors_logged[source] = (start, logged, suppressed + 1)

    def kernel_line(self, text: str) -> None:
        for ev in self.parser.parse_line(text):
            if not ev.known:
                self.unknown_line(KERNEL_LOG, ev.rule or "", text)
                if ev.xid is None:  # a pattern no rule knows: counted and logged for a rule to be written
                    continue
            gpu = NODE_WIDE_GPU
            if ev.pci_bus_id:
                bus = normalize_pci(ev.pci_bus_id)
                index = self._bus_to_gpu.get(bus) if bus else None
                gpu = str(index) if index is not None else (bus or ev.pci_bus_id)
            self.detect(Detection(ev.fault.id, gpu, KERNEL_LOG, ev.detail or text[-200:]))

    def unknown_line(self, source: str, rule: str, text: str) -> None:
        """Count a line no rule knows, and log it (at most UNKNOWN_LOG_PER_MINUTE a minute: a flood of a new
        pattern must not flood the agent's own log; the counter counts every one)."""
        self.metrics.log_lines_unknown.labels(source, rule).inc()
        now = time.monotonic()
        start, logged = self._unknown_logged
        if now - start >= 60.0:
            start, logged = now, 0
        if logged < UNKNOWN_LOG_PER_MINUTE:
            _log(logging.WARNING, "log line no rule knows", source=source, rule=rule, line=text[-400:])
        self._unknown_logged = (start, logged + 1)

    def training_report(self, data: bytes, uid: int | None) -> None:
        """One datagram from the training socket, sent by a process of `uid` (None: unknown, refused). A uid refused
        more than REFUSALS_PER_UID_S times in a second (other than root and the trusted uids) has the rest of its
        reports of that second dropped unread:
        a flood costs the agent a counter, so it keeps reading faster than one sender can fill the socket's queue,
        and other users' reports get through (issue 46)."""
        now_s = time.monotonic()
        start, refusals = self._refusals.get(uid, (now_s, 0))
        if now_s - start >= 1.0:
            start, refusals = now_s, 0
        if refusals >= REFUSALS_PER_UID_S and uid not in self.job_owners.trusted:
            self._refusals[uid] = (start, refusals + 1)
            self.metrics.read_errors.labels(TRAINING).inc()
            return
        try:
            report = parse_report(data)
            why = self.job_owners.refuse(uid, slurm_job_id(report.job))
            if why is not None:
                raise ReportRefused(why)
            if report.gpu is not None and self._bus_to_gpu and report.gpu not in self._bus_to_gpu.values():
                raise ReportRefused(f"gpu {report.gpu} is not a GPU of {self.node}")
            now = self.clock()
            if report.line is not None:
                self.job_line(report.job, report.line, run_label(report.requeues, report.run), now)
                return
            with self.lock:  # the polling thread reads the same jobs and series
                owner = None if uid in self.job_owners.trusted else uid
                detections = self.training.ingest(report, now, owner)
                rank = self.training.jobs.get(report.job, {}).get(report.rank)
                self.exporter.report(report, None if rank is None else rank.last_progress)
        except ReportRefused as exc:
            if len(self._refusals) >= 4096:  # bounded, whoever sends
                self._refusals.clear()
            self._refusals[uid] = (start, refusals + 1)
            self.read_error(TRAINING, f"training report refused (uid {uid}): {exc}")
            return
        for det in detections:
            self.detect(det)

    def job_line(self, job: str, line: str, run: str, now: float) -> None:
        """A line of job `job`'s own output, from a sender allowed to speak for the job: a job-scoped fault at
        most (`fleetheal.agent.joboutput`), never one that moves this node. `run`: which run of the job printed
        it (`training.run_label`, "" unknown)."""
        job = slurm_job_id(job)
        if not job:  # a fault for no named job would reach every job of the node
            self.read_error(JOB_OUTPUT_SOURCE, "job output line refused: it names no Slurm job")
            return
        with self.lock:
            dropped = self.job_output.dropped
            det = self.job_output.judge(job, line, now, step=self.training.last_step(job), run=run)
            refused = None if det is None else self.tracker.refuses(det)
        if self.job_output.dropped != dropped:
            self.metrics.read_errors.labels(JOB_OUTPUT_SOURCE).inc()
        if refused is not None:  # counted each time, logged at most once a minute (a job may send 50 a second)
            self.metrics.read_errors.labels(JOB_OUTPUT_SOURCE).inc()
            if time.monotonic() - self._runs_refused_logged >= 60.0:
                self._runs_refused_logged = time.monotonic()
                _log(logging.WARNING, "read error", source=JOB_OUTPUT_SOURCE, error=f"line refused: {refused}")
        elif det is not None:
            self.detect(det)

    def _event_loop(self) -> None:
        while not self.stop_event.is_set():
            if not self.backend_ok:
                self.stop_event.wait(1.0)
                continue
            if not self.wait_events(self.cfg.backend.event_wait_s):
                self.stop_event.wait(1.0)

    def wait_events(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for GPU events (0: take those pending) and detect them; False when the
        wait failed (counted and logged)."""
        try:
            events = self.backend.wait_events(timeout_s)
        except Exception as exc:  # e.g. NVML gone mid-wait: counted, then retried
            self.read_error(self.src, f"event wait failed: {exc}")
            return False
        for ev in events:
            self.detect(self._event_detection(ev))
        return True

    def _event_detection(self, ev: GpuEvent) -> Detection:
        fault_id = ev.fault_id if ev.fault_id is not None else self.tx.for_xid(ev.xid or 0).id
        return Detection(fault_id, gpu_label(ev.gpu), self.src, ev.detail or (f"Xid {ev.xid}" if ev.xid else ""))

    # ---- detection -> state ------------------------------------------------------------------

    def detect(self, det: Detection) -> None:
        """An event from any source (thread-safe)."""
        self.metrics.events.labels(det.source).inc()
        now = self.clock()
        with self.lock:
            self._apply(self.tracker.event(det, now), now)

    def _forget_jobs_gone(self) -> None:
        """Stop tracking a Slurm job whose prolog file was here and is gone (the epilog removed it: the job left
        the node), instead of keeping it for training.job_expiry_s (an hour) after a crash or a cancel."""
        where = self.cfg.training.job_owners_dir
        if not where:
            return
        for job in list(self.training.jobs):
            if not slurm_job_id(job):
                continue
            if os.path.exists(os.path.join(where, job)):
                self._job_files_seen.add(job)
            elif job in self._job_files_seen:
                self.training.forget(job)  # its series go with the next poll's tracked ranks
        self._job_files_seen &= self.training.jobs.keys()

    def poll_once(self) -> None:
        """One polling cycle: every GPU's counters, the GPU count, training judgements, expiry."""
        started = time.perf_counter()
        now = self.clock()
        if not self.backend_ok and time.monotonic() >= self._next_open:
            self.open_backend()
        detections: list[Detection] = []
        if self.backend_ok:
            detections = self._poll_gpus()
        with self.lock:
            self._forget_jobs_gone()
            training_detections, suspects = self.training.check(now)
            changes = self.tracker.poll(self.src, detections, now)
            changes += self.tracker.poll(TRAINING, training_detections, now, debounce=1)
            changes += self.tracker.expire(now)
            self._apply(changes, now)
            self.health_file.write(self.tracker.active())  # no-op unless it changed; also the first poll
            tracked = {(job, str(rank)) for job, ranks in self.training.jobs.items() for rank in ranks}
            self.exporter.suspects({(job, str(s.rank)) for job, s in suspects.items()}, tracked)
        self.metrics.polls.inc()
        self.metrics.poll_seconds.observe(time.perf_counter() - started)

    def _poll_gpus(self) -> list[Detection]:
        m = self.metrics
        out: list[Detection] = []
        try:
            gpus = self.backend.gpus()
        except Exception as exc:
            self.read_error(self.src, f"cannot enumerate GPUs: {exc}")
            return out
        m.gpu_count.labels(self.node).set(len(gpus))
        self.visible_gpus = len(gpus)
        expected = self.cfg.backend.expected_gpus
        if expected and len(gpus) < expected:
            out.append(
                Detection(
                    "gpu-count-low", NODE_WIDE_GPU, self.src, f"{len(gpus)} GPUs visible, {expected} expected", True
                )
            )
        for g in gpus:
            try:
                sample = self.backend.sample(g.index)
            except GpuLost as exc:
                out.append(Detection("gpu-lost", str(g.index), self.src, exc.detail, True))
                self._previous.pop(g.index, None)
                continue
            except Exception as exc:
                self.read_error(self.src, f"GPU {g.index}: {exc}")
                continue
            for name, err in sample.errors.items():
                self.read_error(self.src, f"GPU {g.index} {name}: {err}")
            out += classify_sample(
                sample, self._previous.get(g.index), self.cfg.thresholds, self.cfg.poll_interval_s, self.src
            )
            self._previous[g.index] = sample
            self.exporter.sample(sample, self.tracker.health)
        return out

    def _apply(self, changes: list[Change], now: float) -> None:
        """Metrics, logs, fast path and health file for state changes (called under the lock)."""
        if not changes:
            return
        m = self.metrics
        for ch in changes:
            af = ch.fault
            f = af.fault
            labels = (self.node, af.gpu, f.id, f.fault_class, f.action, f.severity, af.job, af.run)
            fields = {
                "node": self.node,
                "gpu": af.gpu,
                "fault_id": f.id,
                "class": f.fault_class,
                "action": f.action,
                "severity": f.severity,
                "source": af.source,
                "job": af.job,
                "run": af.run,
                "detail": af.detail,
            }
            if ch.kind == "cleared":
                if af.job:  # a job's series goes with its fault: jobs and their runs come and go for ever
                    m.fault_active.remove(*labels)
                else:
                    m.fault_active.labels(*labels).set(0)
                _log(logging.INFO, "fault cleared", **fields)
                continue
            m.fault_active.labels(*labels).set(1)
            m.faults.labels(f.id, f.fault_class).inc()
            m.last_fault.labels(f.id, f.fault_class).set(now)
            _log(logging.WARNING, f"fault {ch.kind}", occurrences=af.occurrences, **fields)
            self._queue_actions(af, now)
        for gpu in {ch.fault.gpu for ch in changes} | self.exporter.gpu_labels:
            m.health.labels(self.node, gpu).set(self.tracker.health(gpu))
        m.health.labels(self.node, NODE_WIDE_GPU).set(self.tracker.health())
        self.health_file.write(self.tracker.active())

    def _queue_actions(self, af: ActiveFault, now: float) -> None:
        fp = self.cfg.fastpath
        if af.source == JOB_OUTPUT_SOURCE:  # a job's words never move its node (joboutput maps them already)
            return
        action = af.fault.action
        if action in fp.drain_actions and self.drainer is not None:
            self.actions.put(_Action(af.fault.id, af.gpu, "drain", time.monotonic(), now))
        if action in fp.taint_actions and self.tainter is not None:
            self.actions.put(_Action(af.fault.id, af.gpu, "taint", time.monotonic(), now))

    # ---- fast path ---------------------------------------------------------------------------

    def _fastpath_loop(self) -> None:
        while True:
            item = self.actions.get()
            if item is None:
                return
            self._act(item)

    def _act(self, a: _Action) -> None:
        gpu = None if a.gpu == NODE_WIDE_GPU else a.gpu
        m = self.metrics
        try:
            if a.action == "drain":
                assert self.drainer is not None
                incident = f"agent-{self.node}-{int(a.wall)}"
                result, why = self.drainer.drain(drain_reason(a.fault_id, incident, gpu, now_iso(a.wall)))
            elif a.fault_id in self._over_budget:
                result, why = OVER_BUDGET, f"not tainting {self.node}: the fleet budget held the drain for {a.fault_id}"
            else:
                assert self.tainter is not None
                result, why = self.tainter.taint(a.fault_id)
            if a.action == "drain":  # the taint follows the drain's budget decision for the same fault
                (self._over_budget.add if result == OVER_BUDGET else self._over_budget.discard)(a.fault_id)
        except (FastPathError, OSError, ValueError) as exc:
            result, why = FAILED, str(exc)
            m.read_errors.labels("slurm" if a.action == "drain" else "kubernetes").inc()
        m.fastpath.labels(a.action, result).inc()
        if result in (DONE, WOULD):
            m.fastpath_seconds.labels(a.action).observe(time.monotonic() - a.detected_at)
        level = (
            logging.ERROR if result == FAILED else logging.WARNING if result in (DONE, KEPT_FOREIGN) else logging.INFO
        )
        _log(level, why, action=a.action, result=result, fault_id=a.fault_id, gpu=a.gpu, node=self.node)
