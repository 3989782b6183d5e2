"""The remediator's configuration: one YAML file plus environment overrides, parsed once.

Every key has a documented default (docs/remediator.md lists them all; `example.yaml` next to this
module is a complete file). Files, environment variables (`FLEETHEAL_REMEDIATOR_<SECTION>__<KEY>`, e.g.
`FLEETHEAL_REMEDIATOR_GATE__DRY_RUN=true` or `FLEETHEAL_REMEDIATOR_GATE__BUDGET__MAX_ISOLATED=4`), values
and errors follow fleetheal.settings, as every fleetheal service does.

The bearer token comes from `FLEETHEAL_REMEDIATOR_TOKEN` or from the file `auth.token_file`; it is kept
out of `repr()` and is never logged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from fleetheal import contracts, settings, steps
from fleetheal.remediator import configschema
from fleetheal.settings import ConfigError as ConfigError  # noqa: PLC0414 - re-exported: callers catch it here

ENV_PREFIX = "FLEETHEAL_REMEDIATOR_"
TOKEN_ENV = ENV_PREFIX + "TOKEN"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
DEFAULT_CONFIG_PATH = "/etc/fleetheal/remediator.yaml"
#: Shortest bearer token the service accepts (a guessable token is no authentication).
MIN_TOKEN_LENGTH = 16


def _repo_root() -> Path:
    """The directory holding the default `playbooks/`: the fleetheal package. In a checkout
    fleetheal/playbooks links to the top-level playbooks/; a wheel carries them as package data (with
    the roles inside, playbooks/roles)."""
    from importlib import resources

    return Path(str(resources.files("fleetheal")))


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    #: Cluster name; alerts must carry it in their `cluster` label (Prometheus external label).
    name: str = "default"
    #: Node name -> failure domain (the node's fleetheal.io/failure-domain label, e.g. a rack or leaf
    #: switch). Only these nodes are ever acted on.
    nodes: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def domain_of(self, node: str) -> str:
        return self.nodes[node]

    def domains(self) -> dict[str, int]:
        """Failure domain -> number of nodes in it."""
        sizes: dict[str, int] = {}
        for domain in self.nodes.values():
            sizes[domain] = sizes.get(domain, 0) + 1
        return sizes


@dataclasses.dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 9105
    #: PEM certificate and key; both set -> HTTPS.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: Client connections at once. At the limit a new connection replaces the one that has waited longest
    #: for a request head; when every connection is busy with a request, it is answered 503 and closed.
    max_connections: int = 256
    #: Seconds a connection has to deliver a complete request head (line and headers), counted from its
    #: start or its previous response (also the TLS handshake's limit); then it is closed.
    header_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class AuthConfig:
    #: File holding the bearer token (first line). FLEETHEAL_REMEDIATOR_TOKEN wins over it.
    token_file: str | None = None
    #: File holding the operators' token for the node API (`fleetheal nodes repaired`), a different one
    #: than Alertmanager's: whoever sends alerts cannot report repairs. Unset: the node API is off.
    operator_token_file: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookConfig:
    #: Largest request body accepted; larger -> 413.
    max_body_bytes: int = 1_048_576
    #: Most alerts in one payload; more -> 400.
    max_alerts: int = 1000
    #: Seconds to receive a webhook body once its head is in; slower -> 408 and the connection is closed.
    body_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class StoreConfig:
    #: SQLite database (WAL mode): the embedded default, for one remediator.
    path: str = "/var/lib/fleetheal/remediator.sqlite"
    #: SQLite `synchronous`: FULL makes a 202 survive power loss, NORMAL only a process crash.
    synchronous: str = "FULL"
    #: PostgreSQL instead of SQLite: a file holding the libpq URI (postgresql://user:password@host/db;
    #: a Secret's mount). The store replicas share; it needs leader_election.
    url_file: str | None = None

    def url(self) -> str | None:
        """The PostgreSQL URI from `url_file` (None: SQLite); ConfigError when it cannot be read."""
        if not self.url_file:
            return None
        try:
            with open(self.url_file, encoding="utf-8") as f:
                url = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"store.url_file: cannot read {self.url_file}: {exc.strerror}") from None
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(f"store.url_file: {self.url_file} must hold a postgresql:// URI")
        return url


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderElectionConfig:
    """Several replicas, one acting (leader.py): a coordination.k8s.io Lease elects the leader."""

    enabled: bool = False
    namespace: str = "fleetheal-system"
    lease_name: str = "fleetheal-remediator"
    #: This replica's name in the Lease; "" = $POD_NAME, else the host name and PID.
    identity: str = ""
    #: A follower takes the lease when the leader has not renewed it for this long (after a SIGKILL,
    #: failover takes about this plus retry_period_s).
    lease_duration_s: float = 8.0
    #: A leader that could not renew for this long has stepped down by then (before anyone else may take
    #: the lease: see docs/remediator.md, "The hand-over's timeline").
    renew_deadline_s: float = 4.0
    #: How often the lease is renewed, or tried by followers.
    retry_period_s: float = 1.0
    #: How long a replica that steps down may take to see every one of its playbook processes gone.
    #: lease_duration_s - renew_deadline_s - fence_timeout_s is the hand-over's margin (>= retry_period_s).
    fence_timeout_s: float = 2.0
    #: kubeconfig file; "" = the pod's service account (in-cluster).
    kubeconfig: str = ""

    def holder(self) -> str:
        return self.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


@dataclasses.dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Pool membership of existing nodes (membership.py): the stack's ConfigMaps applied to the Nodes."""

    enabled: bool = False
    #: Where the stack's membership ConfigMaps are (the system namespace).
    namespace: str = "fleetheal-system"
    #: Everything is listed and compared again this often (the watches carry changes in between).
    resync_s: float = 600.0
    #: A pool whose ConfigMap is gone keeps its nodes' labels this long (a mistaken delete is undone in
    #: time); a node removed from a ConfigMap that exists is released at once.
    release_grace_s: float = 300.0
    #: kubeconfig file; "" = the pod's service account (in-cluster).
    kubeconfig: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class LendingPool:
    """One GPU pool's lending rules (the stack renders them from gpuPools[].lendMaxPercent and the lend* settings)."""

    #: Active nodes of the pool lent at once, at most.
    max_nodes: int = 0
    #: A lent node stays lent at least this long before Slurm may take it back (no churn).
    min_lent_s: float = 600.0
    #: The grace a pod on a node Slurm takes back gets to stop (its PodDisruptionBudget holds as well).
    reclaim_grace_s: float = 120.0


@dataclasses.dataclass(frozen=True, slots=True)
class LendingConfig:
    """Idle Slurm nodes lent to Kubernetes workloads and taken back (lending.py); run by the leader."""

    enabled: bool = False
    #: One round of lending and reclaiming this often.
    interval_s: float = 2.0
    #: GPU pool (the Nodes' fleetheal.io/gpu-pool label) -> its rules; a pool not listed never lends.
    pools: Mapping[str, LendingPool] = dataclasses.field(default_factory=dict)
    #: The namespaces whose waiting pods may get a node lent: the stack's Kueue namespaces, where its LocalQueues
    #: admit pods within the quota. A pod anywhere else never makes a node lent.
    namespaces: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerConfig:
    #: Directory of the remediation playbooks (taxonomy action -> playbook file name).
    playbook_dir: str = dataclasses.field(default_factory=lambda: str(_repo_root() / "playbooks"))
    #: Roles path given to Ansible (the repository's roles/ when it exists).
    roles_path: str | None = dataclasses.field(
        default_factory=lambda: str(_repo_root() / "roles") if (_repo_root() / "roles").is_dir() else None
    )
    #: Parent of the private run directories (one per step attempt).
    run_dir: str = "/var/lib/fleetheal/runs"
    #: Site inventory (group variables, say) given before the private one holding the incidents' hosts.
    inventory: str | None = None
    #: ansible.cfg for the runs (ANSIBLE_CONFIG); unset -> Ansible's defaults.
    ansible_cfg: str | None = None
    #: Seconds before a playbook run is killed and counted as a timeout.
    timeout_s: int = 900
    #: Extra attempts for a failed or timed-out step (remediation playbooks are idempotent).
    retries: int = 2
    #: First retry delay; doubles each attempt.
    backoff_s: float = 5.0
    #: Playbook runs at once.
    max_concurrent: int = 4
    #: Incidents one run of a playbook serves at most (one inventory host each, as many forks).
    max_hosts_per_run: int = 50
    #: Names of environment variables handed to Ansible; everything else (secrets) stays out.
    env_passthrough: tuple[str, ...] = (
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "TZ",
        "TMPDIR",
        "KUBECONFIG",
        "SLURM_CONF",
        "ANSIBLE_COLLECTIONS_PATH",
    )
    #: Extra environment for Ansible (non-secret values such as paths).
    envvars: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    #: Site settings for the playbooks (`fleetheal_*` names from playbooks/vars/remediation.yml, e.g. the
    #: grace period, kubeconfig, report dir). Passed as extra vars; never a per-incident contract variable.
    site_vars: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    #: Site settings that are secrets, besides those named *_token, *_password, *_passphrase, *_secret,
    #: *_credentials, *_api_key or *_private_key (SECRET_SITE_VAR in scrub.py). Secrets never go to a run
    #: directory: they reach Ansible through a 0600 file in memory (/dev/shm) removed as soon as
    #: ansible-playbook has read it, and their values are masked in events and artifacts.
    secret_vars: tuple[str, ...] = ()
    #: Days the run directories of finished incidents are kept (0: no age limit).
    keep_runs_days: float = 14.0
    #: Most run directories kept, newest first (0: no limit); those of unfinished incidents always stay.
    keep_runs: int = 0
    #: Run the latency-critical steps of an isolation or a restart in-process before the playbook
    #: (fleetheal/remediator/responder.py); false: the playbook does everything, as a human would.
    first_response: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetConfig:
    #: Nodes isolated at once in the whole cluster (absolute cap).
    max_isolated: int = contracts.FLEET_BUDGET_NODES
    #: ... and as a share of the pool (rounded down, at least 1).
    max_isolated_fraction: float = contracts.FLEET_BUDGET_SHARE
    #: Nodes isolated at once in one failure domain (absolute cap).
    max_isolated_per_domain: int = 2
    #: ... and as a share of the domain (rounded down, at least 1).
    max_isolated_fraction_per_domain: float = 0.25


@dataclasses.dataclass(frozen=True, slots=True)
class BreakerConfig:
    #: Distinct nodes asking for isolation within `window_s` that count as a storm (breaker opens).
    storm_nodes: int = 10
    window_s: float = 60.0
    #: Seconds without a new isolation request before an open breaker closes by itself.
    quiet_s: float = 300.0


@dataclasses.dataclass(frozen=True, slots=True)
class LemonConfig:
    #: Isolations of one node within `window_s` that make it a lemon: quarantined for good.
    threshold: int = 3
    window_s: float = 7 * 24 * 3600.0


@dataclasses.dataclass(frozen=True, slots=True)
class GateConfig:
    #: Record every decision, run no playbook.
    observe_only: bool = False
    #: Run playbooks with fleetheal_dry_run=true; the gate records "would isolate".
    dry_run: bool = False
    #: Hold every incident at the gate (queued, not dropped) while true or while `pause_file` exists.
    paused: bool = False
    pause_file: str | None = None
    #: How often held incidents are re-examined and the breaker's quiet window is checked.
    recheck_interval_s: float = 1.0
    #: Requeues of one Slurm job (label job_id) fleetheal performs before it stops requeueing it.
    max_requeues_per_job: int = 3
    budget: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)
    breaker: BreakerConfig = dataclasses.field(default_factory=BreakerConfig)
    lemon: LemonConfig = dataclasses.field(default_factory=LemonConfig)


@dataclasses.dataclass(frozen=True, slots=True)
class LifecycleConfig:
    """The node lifecycle after an action (lifecycle.py): repair, revalidation, the standby pool."""

    #: Follow the taxonomy's lifecycle: revalidate after a reset or a reported repair, refill the pool.
    enabled: bool = True
    #: Nodes the warm-standby pool should hold (the stack's standby pool size). Revalidated nodes refill
    #: it first; beyond it they rejoin service. Below it after that: the shortfall metric and alert.
    standby_target: int = 0
    #: Where repair requests and RMA reports are written (JSON, one file each).
    report_dir: str = "/var/lib/fleetheal/lifecycle"
    #: A ticketing webhook that receives each repair request and RMA report (POST, JSON); "" = none.
    repair_webhook_url: str = ""
    #: Bearer token for the repair webhook (a file; never logged).
    repair_webhook_token_file: str | None = None
    #: How often Slurm (the standby pool, promotions) and the Nodes' repair annotations are read.
    reconcile_interval_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class FailoverConfig:
    """The third recovery stage (fleetheal.fleet.failover): a job this cluster cannot heal moves to a sibling
    cluster of the Slurm federation that reads its checkpoint store."""

    enabled: bool = False
    #: The fleet file (docs/fleet.md): the federation's clusters, checkpoint stores and who reads them.
    fleet_file: str = ""
    #: This cluster's Slurm ClusterName in the federation; "" = `cluster.name`.
    slurm_cluster: str = ""
    #: Checkpoint store of a job whose comment names none (`fleetheal-checkpoint=NAME`, written by
    #: `fleetheal submit --checkpoint-store`); "" = such a job is never moved (it would lose its progress).
    default_store: str = ""
    #: After an isolation that found no standby node to promote, how long a requeued job may stay pending
    #: here (Slurm may still find it nodes) before it is moved.
    wait_s: float = 10.0
    #: How long a moved job has to start on its new cluster before the move counts as failed.
    timeout_s: float = 120.0

    def cluster_name(self, cluster: ClusterConfig) -> str:
        return self.slurm_cluster or cluster.name


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    listen: ListenConfig = dataclasses.field(default_factory=ListenConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    webhook: WebhookConfig = dataclasses.field(default_factory=WebhookConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    runner: RunnerConfig = dataclasses.field(default_factory=RunnerConfig)
    gate: GateConfig = dataclasses.field(default_factory=GateConfig)
    lifecycle: LifecycleConfig = dataclasses.field(default_factory=LifecycleConfig)
    failover: FailoverConfig = dataclasses.field(default_factory=FailoverConfig)
    leader_election: LeaderElectionConfig = dataclasses.field(default_factory=LeaderElectionConfig)
    membership: MembershipConfig = dataclasses.field(default_factory=MembershipConfig)
    lending: LendingConfig = dataclasses.field(default_factory=LendingConfig)
    #: The bearer token (never printed: repr=False), from FLEETHEAL_REMEDIATOR_TOKEN or auth.token_file.
    token: str = dataclasses.field(default="", repr=False, compare=False, metadata=settings.NOT_A_SETTING)
    #: Why the token could not be read (reported when the service starts).
    token_problem: str = dataclasses.field(default="", metadata=settings.NOT_A_SETTING)
    #: Where the file came from (for messages).
    source: str = dataclasses.field(default="<defaults>", metadata=settings.NOT_A_SETTING)

    def paused(self) -> bool:
        """True while the pause switch is on (config key or the pause file)."""
        return self.gate.paused or (self.gate.pause_file is not None and os.path.exists(self.gate.pause_file))


# --- parsing -------------------------------------------------------------------------------------------

#: Section name -> its dataclass: the fields of Config that are settings.
_SECTIONS: dict[str, type] = {
    f.name: get_type_hints(Config)[f.name] for f in dataclasses.fields(Config) if not f.metadata
}


def _read_token(auth: AuthConfig, env: Mapping[str, str]) -> tuple[str, str]:
    """(token, problem): commands that only read the database do not need the token to be readable."""
    token = env.get(TOKEN_ENV, "")
    if not token and auth.token_file:
        try:
            with open(auth.token_file, encoding="utf-8") as f:
                token = f.readline()
        except OSError as exc:
            return "", f"auth.token_file: cannot read {auth.token_file}: {exc.strerror}"
    return token.strip(), ""


def _check(cfg: Config) -> None:
    """SCHEMA (configschema.py) first: ranges, names, required entries; then the rules across settings."""
    configschema.check({name: configschema.as_json(getattr(cfg, name)) for name in _SECTIONS})
    if (cfg.listen.tls_cert_file is None) != (cfg.listen.tls_key_file is None):
        raise ConfigError("listen.tls_cert_file and listen.tls_key_file: set both for TLS, or neither")
    le = cfg.leader_election
    if cfg.store.url_file and not le.enabled:
        raise ConfigError(
            "store.url_file: a shared PostgreSQL store needs leader_election.enabled: true (one replica acts)"
        )
    if le.enabled:
        if not (le.lease_duration_s > le.renew_deadline_s > le.retry_period_s > 0 and le.fence_timeout_s > 0):
            raise ConfigError(
                "leader_election: lease_duration_s > renew_deadline_s > retry_period_s > 0 and "
                f"fence_timeout_s > 0 are required (got {le.lease_duration_s:g}, {le.renew_deadline_s:g}, "
                f"{le.retry_period_s:g}, {le.fence_timeout_s:g})"
            )
        margin = le.lease_duration_s - le.renew_deadline_s - le.fence_timeout_s
        if margin < le.retry_period_s:
            raise ConfigError(
                "leader_election: a leader cut off from the API server steps down by renew_deadline_s and "
                "stops its playbooks within fence_timeout_s; a follower may take the lease after "
                f"lease_duration_s. The margin left ({margin:g} s) must be at least retry_period_s "
                f"({le.retry_period_s:g} s): raise lease_duration_s or lower renew_deadline_s"
            )
        if not contracts.is_node_name(le.namespace) or not contracts.is_node_name(le.lease_name):
            raise ConfigError("leader_election: namespace and lease_name must be RFC 1123 names")
    if cfg.lending.enabled and not cfg.lending.pools:
        raise ConfigError(
            "lending.pools: name the GPU pools that lend (pool -> max_nodes, min_lent_s, reclaim_grace_s)"
        )
    if cfg.lending.enabled and not cfg.lending.namespaces:
        raise ConfigError("lending.namespaces: name the namespaces whose pods may get lent nodes (Kueue's)")
    if cfg.membership.enabled and not contracts.is_node_name(cfg.membership.namespace):
        raise ConfigError(f"membership.namespace: {cfg.membership.namespace!r} is not an RFC 1123 name")
    # Case-insensitive, as SQLite's PRAGMA is.
    if cfg.store.synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
        raise ConfigError(f"store.synchronous: {cfg.store.synchronous!r} is not one of FULL, NORMAL, EXTRA")
    r = cfg.runner
    for name, value in r.site_vars.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ConfigError(f"runner.site_vars.{name}: only strings, numbers, booleans, lists and mappings") from None
    try:  # what the first responder reads of them (fleetheal.steps.Settings) must make sense outside Ansible
        steps.Settings.from_vars(r.site_vars)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"runner.site_vars: {exc}") from None
    _check_failover(cfg)


def _check_failover(cfg: Config) -> None:
    """An enabled failover needs a fleet file that names this cluster and the default store."""
    fo = cfg.failover
    if not fo.enabled:
        return
    if not fo.fleet_file:
        raise ConfigError("failover.fleet_file: required when failover.enabled is true")
    from fleetheal.fleet import config as fleetcfg

    fleet = fleetcfg.load(fo.fleet_file, env={})
    me = fo.cluster_name(cfg.cluster)
    if me not in fleet.clusters:
        raise ConfigError(
            f"failover.slurm_cluster: {me!r} is not a cluster of the fleet file {fo.fleet_file}"
            f" ({', '.join(fleet.clusters) or 'none'})"
        )
    if fo.default_store and fo.default_store not in fleet.checkpoint_stores:
        raise ConfigError(f"failover.default_store: {fo.default_store!r} is not a checkpoint store of {fo.fleet_file}")


def from_mapping(doc: Any, env: Mapping[str, str] | None = None, source: str = "<mapping>") -> Config:
    """A Config from a parsed YAML document and environment overrides (os.environ by default)."""
    env = os.environ if env is None else env
    try:
        cfg = settings.build(Config, doc, env, ENV_PREFIX, reserved=(TOKEN_ENV, CONFIG_ENV))
        token, problem = _read_token(cfg.auth, env)
        cfg = dataclasses.replace(cfg, token=token, token_problem=problem, source=source)
        _check(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


def load(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read and check a configuration file; raises ConfigError with the key at fault."""
    return from_mapping(settings.read_yaml(path), env, source=str(path))


def require_token(cfg: Config) -> str:
    """The token the service needs to start; ConfigError when missing or too short."""
    if cfg.token_problem:
        raise ConfigError(cfg.token_problem)
    if len(cfg.token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"auth: set {TOKEN_ENV} or auth.token_file to a bearer token of at least {MIN_TOKEN_LENGTH} characters"
        )
    return cfg.token
