"""Agent configuration: one YAML file plus environment overrides, parsed once into frozen dataclasses.

Every key, its type and its default is declared once, in the dataclasses below (agent/README.md has the
reference with explanations; `agent/agent.example.yaml` sets each one). An environment variable
`FLEETHEAL_AGENT_<KEY>` overrides a top-level key and `FLEETHEAL_AGENT_<SECTION>__<KEY>` a nested one,
e.g. `FLEETHEAL_AGENT_MODE=observe` or `FLEETHEAL_AGENT_BACKEND__KIND=simulated`; values are read as YAML
scalars or flow lists (`[ISOLATE_AND_RELOCATE]`). Errors name the file or variable, the key and what was
expected, and an unknown key suggests the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetheal.contracts import FLEET_BUDGET_NODES, FLEET_BUDGET_SHARE

ENV_PREFIX = "FLEETHEAL_AGENT_"
MODES = ("act", "observe")
BACKENDS = ("nvml", "simulated")


def _fastpath_actions() -> tuple[str, ...]:
    """Actions the agent's fast path takes by default (the taxonomy's `fastpath: true`); the rest are the
    remediator's."""
    from fleetheal.taxonomy import load  # lazily, as load_config does

    return load().fastpath_actions()


class ConfigError(ValueError):
    """The configuration is invalid; the message says where and how to fix it."""


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
class TrainingConfig:
    enabled: bool = True
    #: Unix datagram socket the training client (fleetheal.agent.client) reports to.
    socket: str = "/run/fleetheal/training.sock"
    #: No step progress on every rank of a job for this long is a hang.
    hang_timeout_s: float = 300.0
    #: A rank whose step time exceeds this multiple of its peers' median is a straggler.
    straggler_factor: float = 1.5
    #: Straggler detection needs at least this many ranks of the job on the node.
    straggler_min_ranks: int = 3
    #: A loss above this multiple of its running mean is a spike.
    loss_spike_factor: float = 3.0
    #: Reports per rank before loss spikes are judged.
    loss_spike_warmup: int = 20
    #: A job not heard from for this long is forgotten (its faults clear).
    job_expiry_s: float = 3600.0
    #: Jobs tracked at once on this node; reports for more are refused (a flood of invented names).
    max_jobs: int = 64
    #: Besides root, uids whose reports are believed for any job name (for example a launcher outside
    #: Slurm). Anyone else may report only for a Slurm job it owns that runs on this node.
    trusted_uids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HealthConfig:
    #: Consecutive polls a condition must hold before its fault is raised.
    debounce_polls: int = 2
    #: Consecutive clean polls before a polled fault clears.
    clear_polls: int = 3
    #: An event fault (Xid, log line, NaN loss) stays active this long after its last occurrence.
    event_hold_s: float = 600.0
    #: Repeats of the same event fault on the same GPU within this window count once.
    dedup_s: float = 30.0


@dataclass(frozen=True)
class ThresholdsConfig:
    #: NVLink CRC (flit + data) errors per poll above which nvlink-crc-errors is raised.
    nvlink_crc_errors_per_poll: float = 100.0
    nvlink_replay_errors_per_poll: float = 1.0
    nvlink_recovery_errors_per_poll: float = 1.0
    #: PCIe replays per minute (DCGM expects < 31/min for a Gen5 x16 link at BER 1e-12).
    pcie_replays_per_minute: float = 60.0
    #: Power draw at or above this share of the enforced limit is a power-cap violation.
    power_cap_ratio: float = 1.0


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
    health: HealthConfig = field(default_factory=HealthConfig)
    thresholds: ThresholdsConfig = field(default_factory=ThresholdsConfig)
    fastpath: FastPathConfig = field(default_factory=FastPathConfig)

    @property
    def observe_only(self) -> bool:
        return self.mode == "observe"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, hint: Any, where: str) -> Any:
    """Check/convert one YAML value against a field type; ConfigError names `where`."""
    if dataclasses.is_dataclass(hint):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping of settings, got {type(value).__name__}")
        return _build(hint, value, where)  # type: ignore[arg-type]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported setting type {hint}")  # pragma: no cover - a bug here


def _build(cls: type, doc: Mapping[str, Any], where: str) -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in doc:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"{where}.{key}: unknown key{hint}".lstrip("."))
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}".lstrip(".")) for k, v in doc.items()}
    return cls(**kwargs)


def _set_path(doc: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = doc.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
        doc = child
    doc[path[-1]] = value


def _env_overrides(doc: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: not a YAML value: {exc}") from exc
        _check_path(AgentConfig, path, name)
        _set_path(doc, path, value)


def _check_path(cls: type, path: list[str], env_name: str) -> None:
    hints = _hints(cls)
    key = path[0]
    if key not in hints:
        close = difflib.get_close_matches(key, list(hints), n=1)
        hint = f" (did you mean {ENV_PREFIX}{'__'.join([*path[:-1], close[0]]).upper()}?)" if close else ""
        raise ConfigError(f"{env_name}: no setting {key!r}{hint}")
    if len(path) > 1:
        if not dataclasses.is_dataclass(hints[key]):
            raise ConfigError(f"{env_name}: {key!r} is not a section")
        _check_path(hints[key], path[1:], env_name)


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
        "health.debounce_polls": cfg.health.debounce_polls,
        "health.clear_polls": cfg.health.clear_polls,
        "thresholds.power_cap_ratio": cfg.thresholds.power_cap_ratio,
        "fastpath.slurm.timeout_s": cfg.fastpath.slurm.timeout_s,
        "kernel_log.max_backlog_bytes": cfg.kernel_log.max_backlog_bytes,
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
        if value <= 0:
            raise bad(key, f"must be > 0, got {value}")
    non_negative = {
        "backend.expected_gpus": cfg.backend.expected_gpus,
        "backend.simulated.gpus": cfg.backend.simulated.gpus,
        "health.event_hold_s": cfg.health.event_hold_s,
        "health.dedup_s": cfg.health.dedup_s,
        "training.loss_spike_warmup": cfg.training.loss_spike_warmup,
    }
    for key, value in non_negative.items():
        if value < 0:
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
    doc: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of settings")
        doc = loaded
    try:
        _env_overrides(doc, env)
        cfg: AgentConfig = _build(AgentConfig, doc, "")
        if not cfg.node:
            cfg = dataclasses.replace(cfg, node=default_node(env))
        from fleetheal.taxonomy import load

        _validate(cfg, frozenset(load().actions))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return cfg
