"""Wiring: sources -> classification -> health state -> metrics, fast path and health file.

`Agent` is the long-running service (`fleetheal agent run`): one polling loop (GPU counters, training
judgements, expiry) on the calling thread, and one thread each for GPU events, the kernel log, the
training socket, the fast path and the metrics endpoint. `run_check` is the one-shot check
(`fleetheal agent check`) for Slurm's HealthCheckProgram, prolog and epilog.

Every callback from a source goes through `Agent.detect`, which serialises on one lock; slow work
(scontrol, the Kubernetes API) runs on the fast-path thread so detection never waits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

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
from fleetheal.agent.health import ActiveFault, Change, Detection, HealthTracker, Thresholds, classify_sample, gpu_label
from fleetheal.agent.simulated import SimulatedGpuBackend
from fleetheal.agent.training import SOURCE as TRAINING
from fleetheal.agent.training import Report, ReportRefused, TrainingMonitor, parse_report, slurm_job_id
from fleetheal.contracts import NODE_WIDE_GPU, drain_reason
from fleetheal.logparse import KERNEL as KERNEL_RULES
from fleetheal.logparse import load_parser
from fleetheal.taxonomy import Taxonomy, load

if TYPE_CHECKING:
    from fleetheal.agent.metrics import AgentMetrics

KERNEL_LOG = "kernel_log"
#: Lines no log rule knows that the agent writes to its own log per minute (all are counted).
UNKNOWN_LOG_PER_MINUTE = 10
log = logging.getLogger("fleetheal.agent")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str, stream: TextIO = sys.stderr) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("fleetheal")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _log(level: int, msg: str, **fields: Any) -> None:
    log.log(level, msg, extra={"fields": fields})


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
        cfg.node, squeue, trusted_uids=cfg.training.trusted_uids, slurm_conf=s.slurm_conf, timeout_s=s.timeout_s
    )


def make_tainter(cfg: AgentConfig) -> KubeNodeTainter | None:
    k = cfg.fastpath.kubernetes
    if not k.enabled:
        return None
    return KubeNodeTainter(
        cfg.node, k.api_url, k.token_file, ca_file=k.ca_file, timeout_s=k.timeout_s, dry_run=cfg.observe_only
    )


def _thresholds(cfg: AgentConfig) -> Thresholds:
    t = cfg.thresholds
    return Thresholds(
        t.nvlink_crc_errors_per_poll,
        t.nvlink_replay_errors_per_poll,
        t.nvlink_recovery_errors_per_poll,
        t.pcie_replays_per_minute,
        t.power_cap_ratio,
    )


def _now_iso(ts: float) -> str:
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
        h = cfg.health
        self.tracker = HealthTracker(self.tx, h.debounce_polls, h.clear_polls, h.event_hold_s, h.dedup_s)
        t = cfg.training
        self.training = TrainingMonitor(
            t.hang_timeout_s,
            t.straggler_factor,
            t.straggler_min_ranks,
            t.loss_spike_factor,
            t.loss_spike_warmup,
            t.job_expiry_s,
            max_jobs=t.max_jobs,
        )
        self.job_owners = job_owners if job_owners is not None else make_job_owners(cfg)
        self.thresholds = _thresholds(cfg)
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.actions: queue.Queue[_Action | None] = queue.Queue()
        self.backend_ok = False
        self._next_open = 0.0
        self._previous: dict[int, GpuSample] = {}
        self._bus_to_gpu: dict[str, int] = {}
        self._gpu_labels: set[str] = set()
        self._children: dict[int, dict[str, Any]] = {}
        self._exported: dict[int, dict[str, float]] = {}
        self._training_series: set[tuple[str, str]] = set()
        self._suspects: set[tuple[str, str]] = set()
        self._health_written: str | None = None
        self._threads: list[threading.Thread] = []
        self._http: Any = None
        self.src = self.backend.name
        m = self.metrics
        m.info.info({"node": self.node, "backend": self.src, "mode": self.cfg.mode, "version": __version__})
        m.gpu_expected.labels(self.node).set(cfg.backend.expected_gpus)
        for source in (self.src, KERNEL_LOG, TRAINING, "slurm", "kubernetes"):
            m.read_errors.labels(source)  # export zeros, so a rate() sees the first error
        m.health.labels(self.node, NODE_WIDE_GPU).set(0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def open_backend(self) -> None:
        try:
            self.backend.open()
        except BackendUnavailable as exc:
            self.backend_ok = False
            self._next_open = time.monotonic() + 30.0
            self.metrics.backend_up.labels(self.src).set(0)
            self.metrics.read_errors.labels(self.src).inc()
            _log(logging.ERROR, "no GPU backend; other sources keep running", backend=self.src, error=str(exc))
            return
        self.backend_ok = True
        self.metrics.backend_up.labels(self.src).set(1)
        self._index_gpus()
        _log(logging.INFO, "GPU backend open", backend=self.src, gpus=len(self._bus_to_gpu))

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
        if cfg.metrics.port:
            from prometheus_client import start_http_server

            self._http, _ = start_http_server(cfg.metrics.port, cfg.metrics.listen, registry=self.metrics.registry)
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
            follower.ready.wait(2.0)
        if cfg.training.enabled:
            from fleetheal.agent.sources import TrainingReportServer

            server = TrainingReportServer(
                cfg.training.socket, self.training_report, lambda why: self.read_error(TRAINING, why)
            )
            try:
                server.bind()
            except OSError as exc:  # the other sources still run; the error is counted and logged
                self.read_error(TRAINING, f"cannot listen on {cfg.training.socket}: {exc}")
            else:
                self._spawn("training", lambda: server.run(self.stop_event))
        self._write_health()
        _log(logging.INFO, "agent started", node=self.node, mode=cfg.mode, backend=self.src)

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
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        with contextlib.suppress(Exception):
            self.backend.close()
        _log(logging.INFO, "agent stopped", node=self.node)

    # ---- sources -----------------------------------------------------------------------------

    def read_error(self, source: str, why: str) -> None:
        self.metrics.read_errors.labels(source).inc()
        _log(logging.WARNING, "read error", source=source, error=why)

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
        """One datagram from the training socket, sent by a process of `uid` (None: unknown, refused)."""
        try:
            report = parse_report(data)
            why = self.job_owners.refuse(uid, slurm_job_id(report.job))
            if why is not None:
                raise ReportRefused(why)
            if report.gpu is not None and self._bus_to_gpu and report.gpu not in self._bus_to_gpu.values():
                raise ReportRefused(f"gpu {report.gpu} is not a GPU of {self.node}")
            now = self.clock()
            with self.lock:  # the polling thread reads the same jobs and series
                detections = self.training.ingest(report, now)
                self._export_report(report)
        except ReportRefused as exc:
            self.read_error(TRAINING, f"training report refused (uid {uid}): {exc}")
            return
        for det in detections:
            self.detect(det)

    def _export_report(self, report: Report) -> None:
        job, rank = report.job, str(report.rank)
        m = self.metrics
        if report.end:
            self._drop_training_series(job, rank)
            return
        self._training_series.add((job, rank))
        m.training_step.labels(self.node, job, rank).set(report.step)
        if report.step_time is not None:
            m.training_step_time.labels(self.node, job, rank).set(report.step_time)
        if report.loss is not None:
            m.training_loss.labels(self.node, job, rank).set(report.loss)
        progress = self.training.jobs.get(job, {}).get(report.rank)
        if progress is not None:
            m.training_progress.labels(self.node, job, rank).set(progress.last_progress)

    def _drop_training_series(self, job: str, rank: str) -> None:
        m = self.metrics
        for g in (m.training_step, m.training_step_time, m.training_loss, m.training_progress, m.hang_suspect):
            with contextlib.suppress(KeyError):
                g.remove(self.node, job, rank)
        self._training_series.discard((job, rank))
        self._suspects.discard((job, rank))

    def _event_loop(self) -> None:
        while not self.stop_event.is_set():
            if not self.backend_ok:
                self.stop_event.wait(1.0)
                continue
            try:
                events = self.backend.wait_events(self.cfg.backend.event_wait_s)
            except Exception as exc:  # e.g. NVML gone mid-wait: counted, then retried
                self.read_error(self.src, f"event wait failed: {exc}")
                self.stop_event.wait(1.0)
                continue
            for ev in events:
                self.detect(self._event_detection(ev))

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
            training_detections, suspects = self.training.check(now)
            changes = self.tracker.poll(self.src, detections, now)
            changes += self.tracker.poll(TRAINING, training_detections, now, debounce=1)
            changes += self.tracker.expire(now)
            self._apply(changes, now)
            self._write_health()  # no-op unless it changed; also covers the first poll
            self._export_suspects(suspects)
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
                sample, self._previous.get(g.index), self.thresholds, self.cfg.poll_interval_s, self.src
            )
            self._previous[g.index] = sample
            self._export_sample(sample)
        return out

    def _export_sample(self, s: GpuSample) -> None:
        """Raw counters to their gauges; only values that changed are written (most never do)."""
        gpu = str(s.index)
        children = self._children.get(s.index)
        if children is None:
            children = self._children[s.index] = self.metrics.gpu_children(self.node, gpu)
            self._gpu_labels.add(gpu)
            self.metrics.health.labels(self.node, gpu).set(self.tracker.health(gpu))
        last = self._exported.setdefault(s.index, {})
        for key, value in s.values.items():
            if last.get(key) != value:
                child = children.get(key)
                if child is not None:
                    child.set(value)
                last[key] = value

    def _export_suspects(self, suspects: dict[str, Any]) -> None:
        current = {(job, str(s.rank)) for job, s in suspects.items()}
        for job, rank in self._suspects - current:
            with contextlib.suppress(KeyError):
                self.metrics.hang_suspect.remove(self.node, job, rank)
        for job, rank in current - self._suspects:
            self.metrics.hang_suspect.labels(self.node, job, rank).set(1)
            _log(logging.WARNING, "training hang: suspect named", job=job, rank=rank, node=self.node)
        self._suspects = current
        tracked = {(job, str(rank)) for job, ranks in self.training.jobs.items() for rank in ranks}
        for job, rank in self._training_series - tracked:
            self._drop_training_series(job, rank)

    def _apply(self, changes: list[Change], now: float) -> None:
        """Metrics, logs, fast path and health file for state changes (called under the lock)."""
        if not changes:
            return
        m = self.metrics
        for ch in changes:
            af = ch.fault
            f = af.fault
            labels = (self.node, af.gpu, f.id, f.fault_class, f.action, f.severity, af.job)
            fields = {
                "node": self.node,
                "gpu": af.gpu,
                "fault_id": f.id,
                "class": f.fault_class,
                "action": f.action,
                "severity": f.severity,
                "source": af.source,
                "job": af.job,
                "detail": af.detail,
            }
            if ch.kind == "cleared":
                m.fault_active.labels(*labels).set(0)
                _log(logging.INFO, "fault cleared", **fields)
                continue
            m.fault_active.labels(*labels).set(1)
            m.faults.labels(f.id, f.fault_class).inc()
            m.last_fault.labels(f.id, f.fault_class).set(now)
            _log(logging.WARNING, f"fault {ch.kind}", occurrences=af.occurrences, **fields)
            self._queue_actions(af, now)
        for gpu in {ch.fault.gpu for ch in changes} | self._gpu_labels:
            m.health.labels(self.node, gpu).set(self.tracker.health(gpu))
        m.health.labels(self.node, NODE_WIDE_GPU).set(self.tracker.health())
        self._write_health()

    def _queue_actions(self, af: ActiveFault, now: float) -> None:
        fp = self.cfg.fastpath
        action = af.fault.action
        if action in fp.drain_actions and self.drainer is not None:
            self.actions.put(_Action(af.fault.id, af.gpu, "drain", time.monotonic(), now))
        if action in fp.taint_actions and self.tainter is not None:
            self.actions.put(_Action(af.fault.id, af.gpu, "taint", time.monotonic(), now))

    def _write_health(self) -> None:
        """health_file: "ok", or the id of an active fault whose action drains the node."""
        path = self.cfg.health_file
        if not path:
            return
        bad = [a for a in self.tracker.active() if a.fault.action in self.cfg.fastpath.drain_actions]
        text = bad[0].fault.id if bad else "ok"
        if text == self._health_written:
            return
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, p)
            self._health_written = text
        except OSError as exc:
            _log(logging.ERROR, "cannot write the health file", path=path, error=str(exc))

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
                result, why = self.drainer.drain(drain_reason(a.fault_id, incident, gpu, _now_iso(a.wall)))
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


# ---- one-shot check ---------------------------------------------------------------------------

OK, UNHEALTHY_EXIT, CANNOT_CHECK = 0, 1, 2


def run_check(
    cfg: AgentConfig,
    backend: GpuBackend | None = None,
    drainer: SlurmDrainer | None = None,
    out: TextIO | None = None,
    taxonomy: Taxonomy | None = None,
) -> int:
    """Check the GPUs once: 0 healthy, 1 unhealthy (reason printed, node drained when configured),
    2 cannot check (no NVML). Sees current state only: polled conditions and pending events, not
    counter growth over time and not the kernel log."""
    out = out or sys.stdout
    tx = taxonomy or load()
    backend = backend or make_backend(cfg)
    try:
        backend.open()
    except BackendUnavailable as exc:
        print(f"cannot check {cfg.node}: {exc}", file=out)
        return CANNOT_CHECK
    detections: list[Detection] = []
    try:
        gpus = backend.gpus()
        expected = cfg.backend.expected_gpus
        if expected and len(gpus) < expected:
            detections.append(
                Detection(
                    "gpu-count-low", NODE_WIDE_GPU, backend.name, f"{len(gpus)} GPUs visible, {expected} expected", True
                )
            )
        thresholds = _thresholds(cfg)
        for g in gpus:
            try:
                detections += classify_sample(
                    backend.sample(g.index), None, thresholds, cfg.poll_interval_s, backend.name
                )
            except GpuLost as exc:
                detections.append(Detection("gpu-lost", str(g.index), backend.name, exc.detail, True))
        for ev in backend.wait_events(0):
            fault_id = ev.fault_id if ev.fault_id is not None else tx.for_xid(ev.xid or 0).id
            detections.append(Detection(fault_id, gpu_label(ev.gpu), backend.name, ev.detail))
    finally:
        backend.close()
    tracker = HealthTracker(tx, debounce_polls=1)
    tracker.poll(backend.name, detections, time.time(), debounce=1)
    active = tracker.active()
    # An Xid names the root cause better than its consequence (Xid 79 before gpu-lost).
    blocking = sorted(
        (a for a in active if a.fault.action in cfg.fastpath.drain_actions), key=lambda a: (a.fault.xid is None, a.gpu)
    )
    for a in active:
        mark = "FAIL" if a in blocking else "warn"
        print(
            f"{mark} {a.fault.id} gpu={a.gpu} class={a.fault.fault_class} action={a.fault.action}: {a.detail}", file=out
        )
    if not blocking:
        state = "degraded" if tracker.health() else "healthy"
        print(f"{state}: {cfg.node}, {len(gpus)} GPUs, {len(active)} warning(s)", file=out)
        return OK
    first = blocking[0]
    drainer = drainer if drainer is not None else make_drainer(cfg)
    if drainer is not None:
        gpu = None if first.gpu == NODE_WIDE_GPU else first.gpu
        now = time.time()
        try:
            _, why = drainer.drain(drain_reason(first.fault.id, f"check-{cfg.node}-{int(now)}", gpu, _now_iso(now)))
        except (FastPathError, OSError) as exc:
            why = f"drain failed: {exc}"
        print(why, file=out)
    print(f"unhealthy: {cfg.node}: {first.fault.id} on gpu {first.gpu} ({first.fault.name})", file=out)
    return UNHEALTHY_EXIT
