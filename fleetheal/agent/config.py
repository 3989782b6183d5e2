"""Agent configuration: one YAML file plus environment overrides, parsed once into frozen dataclasses.

Every key, its type and its default is declared once, in the dataclasses below and in the ones they take
from the classes they configure (`health.HealthConfig`, `health.Thresholds`, `training.MonitorConfig`);
agent/README.md has the reference with explanations and `agent/agent.example.yaml` sets each one. Files,
environment variables (`FLEETHEAL_AGENT_<KEY>`, `FLEETHEAL_AGENT_<SECTION>__<KEY>`, e.g.
`FLEETHEAL_AGENT_BACKEND__KIND=simulated`), values and errors follow fleetheal.settings, as every
fleetheal service does.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetheal import settings
from fleetheal.agent.health import HealthConfig, Thresholds
from fleetheal.agent.training import MonitorConfig
from fleetheal.contracts import AGENT_JOBS_DIR, FLEET_BUDGET_NODES, FLEET_BUDGET_SHARE
from fleetheal.settings import ConfigError as ConfigError  # noqa: PLC0414 - re-exported: callers catch it here

ENV_PREFIX = "FLEETHEAL_AGENT_"
MODES = ("act", "observe")
BACKENDS = ("nvml", "simulated")


def _fastpath_actions() -> tuple[str, ...]:
    """Actions the agent's fast path takes by default (the taxonomy's `fastpath: true`); the rest are the
    remediator's."""
    from fleetheal.taxonomy import load  # lazily, as load_config does

    return load().fastpath_actions()


@dataclass(frozen=True)
class SimulatedConfig:
    #: Number of simulated GPUs.
    gpus: int = 8
    #: Injection state file (see fleetheal.agent.simulated).
    state_file: str = "/run/fleetheal/sim-gpus.json"


@dataclass(frozen=True)
class BackendConfig:
    #: nvml (real GPUs through nvidia-ml-py) or simulated (the test double).
    kind: str = "nvml"
    #: GPUs this node must have; fewer raises gpu-count-low. 0 disables the check.
    expected_gpus: int = 0
    #: Seconds one NVML event wait blocks before the event thread checks for shutdown.
    event_wait_s: float = 1.0
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)


@dataclass(frozen=True)
class MetricsConfig:
    #: Address the Prometheus endpoint binds to.
    listen: str = "0.0.0.0"  # noqa: S104 - scraped by Prometheus from another host
    #: Port of the Prometheus endpoint; 0 disables it.
    port: int = 9479
    #: Connections held at most (more evict the one that has waited longest for its request head).
    max_connections: int = 64
    #: Seconds a connection has to send its request head, and to take its answer.
    header_timeout_s: float = 5.0


@dataclass(frozen=True)
class KernelLogConfig:
    enabled: bool = True
    #: /dev/kmsg, or a plain file that is followed like `tail -F` (tests, syslog files).
    path: str = "/dev/kmsg"
    #: Read what is already there first (default: only lines written after the agent started).
    from_start: bool = False
    #: Where the agent keeps its place in the log, so a restart reads what was written while it was down
    #: ("" disables it: a restart starts at the end).
    position_file: str = "/var/lib/fleetheal-agent/kernel-log.position"  # the unit's StateDirectory
    #: A restart never reads more than this many bytes behind a file's end (what is skipped is reported).
    max_backlog_bytes: int = 8 << 20
    #: An operator's log rules file replacing the shipped `policies/log-rules.yaml` ("" = the shipped
    #: rules); validated when the configuration is loaded.
    rules_file: str = ""


@dataclass(frozen=True)
class TrainingConfig(MonitorConfig):
    """The training section: the judgements (MonitorConfig) and where reports come from."""

    enabled: bool = True
    #: Unix datagram socket the training client (fleetheal.agent.client) reports to.
    socket: str = "/run/fleetheal/training.sock"
    #: Besides root, uids whose reports are believed for any job name (for example a launcher outside
    #: Slurm). Anyone else may report only for a Slurm job it owns that runs on this node.
    trusted_uids: tuple[int, ...] = ()
    #: Where the Slurm prolog writes a file per job it starts here, with the job's uid (`uid=`): who owns a
    #: job, without a Slurm client ("" to ask Slurm only). Believed only when root owns it and its directory.
    job_owners_dir: str = AGENT_JOBS_DIR


@dataclass(frozen=True)
class JobFilesConfig:
    """The output files of this node's batch jobs that `fleetheal launch` does not watch
    (`fleetheal.agent.jobfiles`). The agent must see the node's processes and the jobs' files at the paths
    Slurm names: on the host, or in a pod with the host's PID namespace and the same mounts."""

    enabled: bool = True
    #: Seconds between reads of the files (and looks at the process table for new batch steps).
    interval_s: float = 1.0
    #: Bytes read per file and interval at most; a job that printed more is skipped ahead (counted).
    max_bytes: int = 512 << 10


@dataclass(frozen=True)
class SlurmConfig:
    enabled: bool = True
    scontrol: str = "scontrol"
    #: SLURM_CONF for scontrol (unset: scontrol's default).
    slurm_conf: str | None = None
    timeout_s: float = 10.0


@dataclass(frozen=True)
class KubernetesConfig:
    enabled: bool = False
    api_url: str = "https://kubernetes.default.svc"
    #: A node-scoped credential: a token bound to this node (the pod's projected token), which the admission
    #: policy `fleetheal-agent-own-node` (fleetheal/infra/agent.py) lets patch only this node's Node object.
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # noqa: S105 - a path, not a secret
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    timeout_s: float = 10.0


@dataclass(frozen=True)
class FastPathConfig:
    #: Taxonomy actions whose faults drain the node at once (and fail `fleetheal agent check`); default: the
    #: taxonomy's `fastpath: true` actions.
    drain_actions: tuple[str, ...] = field(default_factory=_fastpath_actions)
    #: Taxonomy actions whose faults taint and label the Kubernetes node (when kubernetes.enabled); default:
    #: the taxonomy's `fastpath: true` actions.
    taint_actions: tuple[str, ...] = field(default_factory=_fastpath_actions)
    #: Fleet-wide budget: no drain (nor taint) when the fleet already has this many fleetheal fault drains...
    fleet_budget_nodes: int = FLEET_BUDGET_NODES
    #: ... or this share of the pool (rounded down, at least 1): the remediator gate's defaults.
    fleet_budget_share: float = FLEET_BUDGET_SHARE
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)


@dataclass(frozen=True)
class AgentConfig:
    #: Slurm and Kubernetes node name (default: $SLURMD_NODENAME, else the short host name).
    node: str = ""
    #: act: drain/taint on the fast path; observe: metrics and logs only.
    mode: str = "act"
    poll_interval_s: float = 1.0
    #: Where the agent writes "ok" or the fault id that makes the node unhealthy ("" disables it).
    health_file: str = ""
    log_level: str = "info"
    backend: BackendConfig = field(default_factory=BackendConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    kernel_log: KernelLogConfig = field(default_factory=KernelLogConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    job_files: JobFilesConfig = field(default_factory=JobFilesConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    thresholds: Thresholds = field(default_factory=Thresholds)
    fastpath: FastPathConfig = field(default_factory=FastPathConfig)

    @property
    def observe_only(self) -> bool:
        return self.mode == "observe"


def _validate(cfg: AgentConfig, actions: frozenset[str]) -> None:
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{key}: {msg}")

    if cfg.mode not in MODES:
        raise bad("mode", f"{cfg.mode!r} is not one of {', '.join(MODES)}")
    if cfg.backend.kind not in BACKENDS:
        raise bad("backend.kind", f"{cfg.backend.kind!r} is not one of {', '.join(BACKENDS)}")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise bad("log_level", f"{cfg.log_level!r} is not one of debug, info, warning, error")
    positive = {
        "poll_interval_s": cfg.poll_interval_s,
        "backend.event_wait_s": cfg.backend.event_wait_s,
        "training.hang_timeout_s": cfg.training.hang_timeout_s,
        "training.straggler_factor": cfg.training.straggler_factor,
        "training.loss_spike_factor": cfg.training.loss_spike_factor,
        "training.job_expiry_s": cfg.training.job_expiry_s,
        "training.max_jobs": cfg.training.max_jobs,
        "training.max_jobs_per_user": cfg.training.max_jobs_per_user,
        "health.debounce_polls": cfg.health.debounce_polls,
        "health.clear_polls": cfg.health.clear_polls,
        "thresholds.power_cap_ratio": cfg.thresholds.power_cap_ratio,
        "fastpath.slurm.timeout_s": cfg.fastpath.slurm.timeout_s,
        "kernel_log.max_backlog_bytes": cfg.kernel_log.max_backlog_bytes,
        "metrics.max_connections": cfg.metrics.max_connections,
        "metrics.header_timeout_s": cfg.metrics.header_timeout_s,
        "job_files.interval_s": cfg.job_files.interval_s,
        "job_files.max_bytes": cfg.job_files.max_bytes,
        "fastpath.kubernetes.timeout_s": cfg.fastpath.kubernetes.timeout_s,
    }
    if cfg.kernel_log.rules_file:
        from fleetheal.logparse import LogRulesError, compile_rules, raw_rules  # lazily, as the taxonomy
        from fleetheal.taxonomy import load

        try:  # validate only: the agent builds its parser from the same file when it starts
            compile_rules(raw_rules(cfg.kernel_log.rules_file), load())
        except LogRulesError as exc:
            raise bad("kernel_log.rules_file", str(exc)) from None
    for key, value in positive.items():
        if not value > 0:  # NaN too
            raise bad(key, f"must be > 0, got {value}")
    non_negative = {
        "backend.expected_gpus": cfg.backend.expected_gpus,
        "backend.simulated.gpus": cfg.backend.simulated.gpus,
        "health.event_hold_s": cfg.health.event_hold_s,
        "health.dedup_s": cfg.health.dedup_s,
        "training.loss_spike_warmup": cfg.training.loss_spike_warmup,
    }
    for key, value in non_negative.items():
        if not value >= 0:
            raise bad(key, f"must be >= 0, got {value}")
    if cfg.training.straggler_min_ranks < 2:
        raise bad(
            "training.straggler_min_ranks", f"must be >= 2 (a rank needs peers), got {cfg.training.straggler_min_ranks}"
        )
    if any(uid < 0 for uid in cfg.training.trusted_uids):
        raise bad("training.trusted_uids", f"uids are >= 0, got {list(cfg.training.trusted_uids)}")
    if not 0 <= cfg.metrics.port <= 65535:
        raise bad("metrics.port", f"must be 0..65535, got {cfg.metrics.port}")
    for key, acts in (
        ("fastpath.drain_actions", cfg.fastpath.drain_actions),
        ("fastpath.taint_actions", cfg.fastpath.taint_actions),
    ):
        for act in acts:
            if act not in actions:
                raise bad(key, f"{act!r} is not a taxonomy action ({', '.join(sorted(actions))})")
    if not cfg.node or any(c.isspace() for c in cfg.node):
        raise bad("node", f"{cfg.node!r} is not a node name")


def default_node(env: Mapping[str, str]) -> str:
    """$SLURMD_NODENAME (set for HealthCheckProgram/prolog/epilog), else the short host name."""
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> AgentConfig:
    """Read `path` (None: defaults only), apply FLEETHEAL_AGENT_* overrides from `env`, validate."""
    env = os.environ if env is None else env
    where = "defaults" if path is None else str(path)
    doc = {} if path is None else settings.read_yaml(path)
    try:
        cfg = settings.build(AgentConfig, doc, env, ENV_PREFIX)
        if not cfg.node:
            cfg = dataclasses.replace(cfg, node=default_node(env))
        from fleetheal.taxonomy import load

        _validate(cfg, frozenset(load().actions))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return cfg
