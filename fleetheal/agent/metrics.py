"""Every Prometheus metric the agent exports, defined in one place (documented in docs/metrics.md, "Agent").

The names the generated alert rules select on come from `fleetheal.contracts`. Metrics live in their
own registry so tests can build several agents in one process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.process_collector import ProcessCollector

from fleetheal.contracts import METRIC_FAULT_ACTIVE, METRIC_FAULTS_TOTAL

#: `job_id`: the Slurm job whose own training reports raised the fault ("" otherwise, which Prometheus
#: drops); the alert carries it and the remediator acts on that job only. `job_run`: which run of that job
#: ("REQUEUES.RESTARTS", `training.run_label`; "" otherwise): a later run's fault is another series, so
#: another alert and another incident, while the fault of a run already acted on stays one.
FAULT_LABELS = ("node", "gpu", "fault_id", "class", "action", "severity", "job_id", "job_run")

#: Raw GPU counters exported as `fleetheal_agent_gpu_<name>` gauges: sample key -> (metric suffix, help).
GPU_GAUGES = {
    "temperature_c": ("temperature_celsius", "GPU temperature (NVML_TEMPERATURE_GPU)."),
    "temperature_slowdown_c": ("slowdown_temperature_celsius", "Temperature at which the GPU slows down."),
    "temperature_shutdown_c": ("shutdown_temperature_celsius", "Temperature at which the GPU shuts down."),
    "power_w": ("power_watts", "GPU power draw."),
    "power_limit_w": ("power_limit_watts", "Enforced GPU power limit."),
    "clock_event_reasons": ("clock_event_reasons", "Bitmask of current clock event (throttle) reasons."),
    "retired_pages_pending": ("retired_pages_pending", "1 when retired pages wait for a GPU reset."),
    "remapped_rows_pending": ("remapped_rows_pending", "1 when row remapping waits for a GPU reset."),
    "remapped_rows_failure": ("remapped_rows_failure", "1 when row remapping failed."),
    "pcie_replays": ("pcie_replays", "PCIe replay counter as NVML reports it (grows; resets with the driver)."),
    "recovery_action": ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (0 = none)."),
}
#: Sample key -> labels of fleetheal_agent_gpu_ecc_errors.
ECC = {
    "ecc_corrected_volatile": ("corrected", "volatile"),
    "ecc_uncorrected_volatile": ("uncorrected", "volatile"),
    "ecc_corrected_aggregate": ("corrected", "aggregate"),
    "ecc_uncorrected_aggregate": ("uncorrected", "aggregate"),
}
#: Sample key -> `kind` label of fleetheal_agent_gpu_remapped_rows.
REMAPPED = {"remapped_rows_correctable": "correctable", "remapped_rows_uncorrectable": "uncorrectable"}
#: Sample key -> `counter` label of fleetheal_agent_gpu_nvlink_errors.
NVLINK = {
    "nvlink_crc_flit_errors": "crc_flit",
    "nvlink_crc_data_errors": "crc_data",
    "nvlink_replay_errors": "replay",
    "nvlink_recovery_errors": "recovery",
}


class AgentMetrics:
    """The agent's metric objects, registered in `registry` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None, process: bool = True) -> None:
        r = self.registry = registry or CollectorRegistry()
        if process:
            ProcessCollector(registry=r)
        self.info = Info("fleetheal_agent", "Agent build and configuration.", registry=r)
        self.fault_active = Gauge(
            METRIC_FAULT_ACTIVE,
            '1 while a classified fault is active on a GPU (gpu="node" for node-wide faults).',
            FAULT_LABELS,
            registry=r,
        )
        self.faults = Counter(
            METRIC_FAULTS_TOTAL.removesuffix("_total"),
            "Classified fault occurrences (after de-duplication).",
            ("fault_id", "class"),
            registry=r,
        )
        self.last_fault = Gauge(
            "fleetheal_agent_last_fault_timestamp_seconds",
            "Unix time of the last occurrence of each fault.",
            ("fault_id", "class"),
            registry=r,
        )
        self.health = Gauge(
            "fleetheal_agent_health_state",
            '0 healthy, 1 degraded (only non-destructive faults), 2 unhealthy; gpu="node" is the whole node.',
            ("node", "gpu"),
            registry=r,
        )
        self.log_lines_unknown = Counter(
            "fleetheal_agent_log_lines_unknown",
            "Log lines that announce trouble no log rule knows (reported as the unknown fault), by source and "
            "the catch-all rule that caught them.",
            ("source", "rule"),
            registry=r,
        )
        self.read_errors = Counter(
            "fleetheal_agent_read_errors",
            "Failed or malformed reads, by source (nvml/simulated, kernel_log, training, slurm, kubernetes).",
            ("source",),
            registry=r,
        )
        self.source_up = Gauge(
            "fleetheal_agent_log_source_up",
            "1 while a log source is read: open, and its reader took its last record or waited for one within "
            "the last agent.sources.STALLED_S; 0 when it cannot be read or its reader is stuck (alert "
            "FleethealAgentLogSourceDown). Faults it would carry are not seen.",
            ("source",),
            registry=r,
        )
        self.backend_up = Gauge(
            "fleetheal_agent_backend_up",
            "1 when the GPU backend is usable; 0 is 'no NVML' (library or driver missing).",
            ("backend",),
            registry=r,
        )
        self.gpu_count = Gauge("fleetheal_agent_gpu_count", "GPUs the backend sees.", ("node",), registry=r)
        self.gpu_expected = Gauge(
            "fleetheal_agent_gpu_expected_count", "GPUs this node should have (0: not checked).", ("node",), registry=r
        )
        self.gpu = {
            key: Gauge(f"fleetheal_agent_gpu_{suffix}", doc, ("node", "gpu"), registry=r)
            for key, (suffix, doc) in GPU_GAUGES.items()
        }
        self.ecc = Gauge(
            "fleetheal_agent_gpu_ecc_errors",
            "ECC error counts as NVML reports them (nvmlDeviceGetTotalEccErrors).",
            ("node", "gpu", "type", "counter"),
            registry=r,
        )
        self.remapped = Gauge(
            "fleetheal_agent_gpu_remapped_rows",
            "Remapped memory rows (nvmlDeviceGetRemappedRows).",
            ("node", "gpu", "kind"),
            registry=r,
        )
        self.nvlink = Gauge(
            "fleetheal_agent_gpu_nvlink_errors",
            "NVLink error totals over all links.",
            ("node", "gpu", "counter"),
            registry=r,
        )
        self.polls = Counter("fleetheal_agent_polls", "GPU polling cycles completed.", registry=r)
        self.poll_seconds = Histogram(
            "fleetheal_agent_poll_duration_seconds",
            "Time one polling cycle takes.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.events = Counter(
            "fleetheal_agent_events", "Detections received, by source, before de-duplication.", ("source",), registry=r
        )
        self.fastpath = Counter(
            "fleetheal_agent_fastpath_actions",
            "Fast-path outcomes: action drain|taint, result done|already|kept_foreign|would|over_budget|failed.",
            ("action", "result"),
            registry=r,
        )
        self.fastpath_seconds = Histogram(
            "fleetheal_agent_fastpath_latency_seconds",
            "From detection to the drain or taint being applied.",
            ("action",),
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0),
            registry=r,
        )
        self.training_step = Gauge(
            "fleetheal_agent_training_step", "Last step a rank reported.", ("node", "job", "rank"), registry=r
        )
        self.training_step_time = Gauge(
            "fleetheal_agent_training_step_time_seconds",
            "Last step time a rank reported.",
            ("node", "job", "rank"),
            registry=r,
        )
        self.training_loss = Gauge(
            "fleetheal_agent_training_loss", "Last loss a rank reported.", ("node", "job", "rank"), registry=r
        )
        self.training_progress = Gauge(
            "fleetheal_agent_training_last_progress_timestamp_seconds",
            "Unix time a rank last advanced its step (compare across nodes to find who stopped first).",
            ("node", "job", "rank"),
            registry=r,
        )
        self.hang_suspect = Gauge(
            "fleetheal_agent_training_hang_suspect",
            "1 for the rank named as suspect of a hung job (it stopped first).",
            ("node", "job", "rank"),
            registry=r,
        )

        self.connections_open = Gauge(
            "fleetheal_agent_metrics_connections_open",
            "Connections to the metrics endpoint open now (at most metrics.max_connections).",
            registry=r,
        )
        self.connections_closed = Counter(
            "fleetheal_agent_metrics_connections_closed",
            "Connections the metrics endpoint closed to protect itself: limit (every connection busy), evicted "
            "(waited longest for a request when a new one came at the limit), header_timeout.",
            ("reason",),
            registry=r,
        )

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def gpu_children(self, node: str, gpu: str) -> dict[str, Any]:
        """Sample key -> the labelled gauge child it is exported to, for one GPU (built once per GPU)."""
        out: dict[str, Any] = {key: gauge.labels(node, gpu) for key, gauge in self.gpu.items()}
        out.update({key: self.ecc.labels(node, gpu, kind, counter) for key, (kind, counter) in ECC.items()})
        out.update({key: self.remapped.labels(node, gpu, kind) for key, kind in REMAPPED.items()})
        out.update({key: self.nvlink.labels(node, gpu, counter) for key, counter in NVLINK.items()})
        return out
