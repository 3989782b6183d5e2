"""The Slurm configuration fleetheal deploys, in one place, each setting with its reason and, for a timer, its cost.

Two sources make a deployed cluster's slurm.conf:

- `OPERATOR_SETTINGS`: what Slinky's slurm-operator writes itself before the controller's extraConf
  (slurm-operator v1.1.0, `internal/builder/controllerbuilder/controller_config.go`, with accounting, metrics
  and cgroups on, as the stack runs it). Listed so that the lab can run them too; never rendered by us.
- `stack_settings`: what the stack renders into the controller's extraConf (and the slurm chart's
  `controller.extraConf`), through `fleetheal.infra.slurm_hooks.slurm_conf_lines`. A later line wins in
  slurm.conf, so these override the operator's (`ReturnToService`, `AuthInfo`).

`deployed` merges the two; the lab's slurm.conf (`fleetheal.lab.slurmconf`) is `deployed` plus the differences
a laptop needs, listed there with a reason each. docs/slurm-settings.md is the table of the timers.

Pure data and the standard library: the wheel ships it, the lab and the Pulumi components import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Seconds a job step credential lives (`AuthInfo=cred_expire`). A requeued job may start again only
#: cred_expire + 1 s after its requeue (Slurm holds its begin time; "Job credential revoked" on its old nodes
#: if sooner: tests/slurm/test_conf.py). It must outlive the launch of the largest job: the credential is
#: checked when each slurmd receives its part of the launch, after the prolog (PrologFlags=Contain runs it at
#: allocation) and the fan-out to every node. Slurm's default is 120 s, sized for that; 60 s halves the hold
#: of every requeue and still leaves a launch of tens of seconds twice its time. Not yet measured at 2,000
#: nodes: set it from the p99 launch time of the largest job (prolog + `srun` fan-out) times two.
CRED_EXPIRE_S = 60
#: Seconds slurmctld waits for a silent slurmd before it declares the node DOWN and requeues its jobs.
#: Slurm's default is 300 s. fleetheal's failover does not wait for it: once an alert says a node is lost and
#: Slurm itself has flagged it NOT_RESPONDING (a health-check RPC it did not answer: HEALTH_CHECK_INTERVAL_S),
#: it sets the node DOWN itself (`fleetheal.fleet.failover`), so this is the backstop for nodes nothing reports
#: on. 120 s rides out a slurmd pod restart in a NodeSet rolling update and a controller's GC or network pause,
#: which at 2,000 nodes would otherwise requeue the largest jobs for nothing.
SLURMD_TIMEOUT_S = 120
#: Seconds a Slurm RPC waits for its answer (Slurm's default, stated so it is a decision). Measured on Slurm
#: 26.05 (tests/slurm/test_conf.py): a client's RPC to a controller that never answers fails after exactly this;
#: slurmctld's RPC fan-out to a frozen slurmd (a health check) gives up after twice this, once per fan-out
#: however many peers are frozen; an srun step launch that includes a frozen slurmd costs
#: 2 x (MessageTimeout + BatchStartTimeout), 40 s with these values (a relocation launches on the nodes left).
MESSAGE_TIMEOUT_S = 10
#: Seconds between the main scheduler's full passes (Slurm's default 60 s). A requeued job whose begin time
#: (cred_expire + 1 s) passes triggers no scheduling event: it waits for the next full pass, or the backfill
#: scheduler's (every bf_interval, 30 s) when that comes first, so this bounds what a requeue costs beyond
#: cred_expire (measured on 26.05: 10-11 s after the begin time at sched_interval=20 without backfill; 4 s with
#: these settings). 10 s costs a queue-depth-bounded pass of slurmctld every 10 s.
SCHED_INTERVAL_S = 10
#: Seconds the scheduling of a newly submitted batch job may be deferred to batch submissions (Slurm's
#: default 3 s): a relocation submits nothing, so it costs recovery nothing; a submission storm stays cheap.
BATCH_SCHED_DELAY_S = 3
#: Seconds between HealthCheckProgram runs on each node. Two things hang on it. How late a fault the agent
#: reports (its health file) drains a node without the agent's fast path. And how soon Slurm finds a node
#: silent: slurmctld flags NOT_RESPONDING a node that does not answer its health-check RPC, so this, not its
#: ping (every SlurmdTimeout/3), bounds how long the failover waits for Slurm to corroborate an alert that a
#: node is lost. Measured on Slurm 26.05 with MessageTimeout=10 (a frozen slurmd, tests/slurm/test_conf.py):
#: flagged after 100 s with no health check, 48 s at 30 s, 26 s at 10 s, 15 s at 5 s. Cost: one short script
#: per node every 10 s, and nodes/10 RPCs a second from slurmctld (200/s at 2,000 nodes, spread by CYCLE).
HEALTH_CHECK_INTERVAL_S = 10
#: Seconds Slurm waits for a job's processes to die after SIGKILL before it drains the node ("Kill task
#: failed"). Slurm 22.05 drained a node whose task SIGKILL could not end (a GPU process stuck in the driver
#: after an Xid 79) KillWait + this after a requeue. Slurm 26.05 does not (measured, tests/slurm/test_conf.py;
#: SchedMD commit 7bf6b225b4): once a requeue or a cancel has signalled the step, the timer starts only for
#: processes left after the step's tasks exited, so a stuck task holds its node COMPLETING, and a requeued job
#: with it, for as long as it is stuck, undrained. fleetheal's agent drains such a node on the Xid itself.
#: Slurm's default is 60 s; 120 s leaves a driver reset (tens of seconds) time to release what is left.
UNKILLABLE_STEP_TIMEOUT_S = 120

#: The operator's AuthInfo (auth/slurm takes the client's ids from the message, no user lookup in the pod);
#: the stack's AuthInfo line keeps it and adds cred_expire.
OPERATOR_AUTH_INFO = "use_client_ids"


@dataclass(frozen=True)
class Setting:
    """One slurm.conf line: `key=value`, why it is set, and for a timer what it costs."""

    key: str
    value: str
    why: str
    cost: str = ""

    def line(self) -> str:
        return f"{self.key}={self.value}"


def _op(key: str, value: str, why: str) -> Setting:
    return Setting(key, value, f"slurm-operator: {why}")


#: slurm.conf lines the slurm-operator writes itself (v1.1.0 controller_config.go, common/const.go).
OPERATOR_SETTINGS: tuple[Setting, ...] = (
    _op("SlurmUser", "slurm", "slurmctld runs as slurm in Slinky's images"),
    _op("SlurmdUser", "root", "slurmd starts jobs as their users"),
    _op("SlurmctldPort", "6817", "the controller Service's port"),
    _op("SlurmdPort", "6818", "each slurmd pod's port"),
    _op("SlurmdSpoolDir", "/var/spool/slurmd", "in the slurmd pod"),
    _op("ReturnToService", "2", "overridden by the stack (1)"),
    _op("MaxNodeCount", "1024", "room for dynamic NodeSet nodes"),
    _op("GresTypes", "gpu", "GPUs are GRES"),
    _op("SlurmctldLogFile", "/var/log/slurm/slurmctld.log", "read by the pod's logfile sidecar"),
    _op("SlurmSchedLogFile", "/var/log/slurm/slurmctld.log", "same file"),
    _op("SlurmdLogFile", "/var/log/slurm/slurmd.log", "read by the pod's logfile sidecar"),
    _op("LogTimeFormat", "iso8601,format_stderr", "log format"),
    _op("AuthType", "auth/slurm", "the slurm.key Secret, no munged in the pods"),
    _op("CredType", "cred/slurm", "same key"),
    _op("AuthAltTypes", "auth/jwt", "slurmrestd and the operator sign tokens"),
    _op("AuthAltParameters", "jwt_key=/etc/slurm/jwt.key", "the jwtHs256KeyRef Secret"),
    _op("AuthInfo", OPERATOR_AUTH_INFO, "overridden by the stack (adds cred_expire)"),
    _op("CommunicationParameters", "block_null_hash", "refuse unsigned messages"),
    _op("SelectTypeParameters", "CR_Core_Memory", "cores and memory are consumable"),
    _op("SlurmctldParameters", "enable_configless,enable_stepmgr", "slurmd pods fetch slurm.conf"),
    _op("ProctrackType", "proctrack/cgroup", "a job's processes are its cgroup"),
    _op("PrologFlags", "Contain", "the prolog runs at allocation, in the job's cgroup"),
    _op("TaskPlugin", "task/affinity,task/cgroup", "GPU and CPU binding"),
    _op("MetricsType", "metrics/openmetrics", "Controller metrics.enabled"),
    _op("AccountingStorageType", "accounting_storage/slurmdbd", "the Accounting custom resource"),
    _op("AccountingStoragePort", "6819", "slurmdbd's Service port"),
    _op("AccountingStorageTRES", "gres/gpu", "GPU hours are accounted"),
    _op("JobAcctGatherType", "jobacct_gather/cgroup", "with cgroups on"),
    _op("Prolog", "10-fleetheal-agent.sh", "the key of the prologScriptRefs ConfigMap"),
    _op("Epilog", "90-fleetheal-agent.sh", "the key of the epilogScriptRefs ConfigMap"),
)


def stack_settings(grace_seconds: int, health_check_program: str) -> tuple[Setting, ...]:
    """The settings the stack renders into the controller's extraConf, in their rendered order
    (`grace_seconds`: the stack's requeueGraceSeconds; `health_check_program`: where the pods mount
    `fleetheal.infra.slurm_hooks.healthcheck_script`)."""
    return (
        Setting("JobRequeue", "1", "batch jobs are requeued (not failed) when their node fails or fleetheal drains it"),
        Setting(
            "KillWait",
            str(grace_seconds),
            "grace between SIGTERM (and the remediator's USR1) and SIGKILL: time to write a checkpoint",
            "a job that ignores SIGTERM holds its nodes this long on every requeue",
        ),
        Setting(
            "ReturnToService",
            "1",
            "a node fleetheal drained stays drained until fleetheal (or a human) returns it; with 2 an admin DOWN "
            "was undone within 40 ms on Slurm 22.05",
        ),
        Setting(
            "HealthCheckProgram",
            health_check_program,
            "drains the node when the agent's health file reports a fault",
        ),
        Setting(
            "HealthCheckInterval",
            str(HEALTH_CHECK_INTERVAL_S),
            "how late a fault the agent reports drains a node without the agent's fast path; how soon Slurm "
            "flags a silent node NOT_RESPONDING, which the failover waits for",
            "one short script per node and nodes/interval RPCs a second from slurmctld",
        ),
        Setting("HealthCheckNodeState", "ANY,CYCLE", "every node, spread over the interval, not all at once"),
        Setting("PriorityType", "priority/multifactor", "requeued jobs get a priority boost from the remediator"),
        Setting("GresTypes", "gpu", "GPUs are GRES"),
        Setting(
            "AuthInfo",
            f"{OPERATOR_AUTH_INFO},cred_expire={CRED_EXPIRE_S}",
            "a requeued job may start again only cred_expire + 1 s after its requeue; the credential must "
            "outlive the launch of the largest job (CRED_EXPIRE_S)",
            f"every requeued job waits {CRED_EXPIRE_S + 1} s (Slurm's default: 121 s)",
        ),
        Setting(
            "SlurmdTimeout",
            str(SLURMD_TIMEOUT_S),
            "backstop for lost nodes no alert reports; the failover sets a silent node DOWN itself",
            f"a silent node's jobs are requeued after {SLURMD_TIMEOUT_S} s (Slurm's default: 300 s)",
        ),
        Setting(
            "MessageTimeout",
            str(MESSAGE_TIMEOUT_S),
            "Slurm's default, stated: an RPC's wait for its answer",
            "an RPC to a silent peer costs this (a fan-out: twice this; an srun launch with a frozen node: 40 s)",
        ),
        Setting(
            "SchedulerParameters",
            f"sched_interval={SCHED_INTERVAL_S},batch_sched_delay={BATCH_SCHED_DELAY_S}",
            "a requeued job whose hold expired waits for the next full (or backfill) pass (Slurm's default: 60 s)",
            f"a full scheduling pass every {SCHED_INTERVAL_S} s on slurmctld",
        ),
        Setting(
            "UnkillableStepTimeout",
            str(UNKILLABLE_STEP_TIMEOUT_S),
            "processes left after a killed step's tasks exited drain the node after this (26.05; 22.05 also drained "
            "for a stuck task); a driver reset gets time to free them",
            "on 26.05 a task stuck in the driver holds its node COMPLETING, undrained, for as long as it is stuck",
        ),
    )


def merged(settings: Iterable[Setting]) -> dict[str, str]:
    """`{key: value}` of slurm.conf lines in order, a later key replacing an earlier one (as Slurm reads them)."""
    out: dict[str, str] = {}
    for s in settings:
        out.pop(s.key, None)
        out[s.key] = s.value
    return out


def deployed(grace_seconds: int, health_check_program: str) -> dict[str, str]:
    """The settings a deployed cluster runs (the operator's, then the stack's), partitions and nodes aside."""
    return merged((*OPERATOR_SETTINGS, *stack_settings(grace_seconds, health_check_program)))
