"""The configuration files of a lab Slurm cluster (`fleetheal.lab.slurm.SlurmCluster`): slurm.conf and
gres.conf; the cluster writes them at every start.

slurm.conf is the configuration a deployed stack runs (`fleetheal.slurm.conf.deployed`: the slurm-operator's
settings and the stack's extraConf, from the same code the Pulumi components render) with `LAB_DIFFERENCES`
applied: what a laptop cannot have (loopback addresses, a state directory, munge, no cgroups). The timers are
the deployed ones. tests/infra/test_slurm_conf.py holds the lab's file to exactly these differences.
Tests of one mechanism may ask for `FAST_TIMERS` instead (`SlurmCluster(timers=...)`); the lab, the demo and
the benchmarks never do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetheal.infra import slurm_hooks
from fleetheal.slurm import conf

#: The stacks' requeueGraceSeconds (Pulumi.yaml's default) that the lab's settings start from; the lab's own
#: KillWait is a difference below.
REFERENCE_GRACE_SECONDS = 120

#: A lab difference says that the lab sets `value`, or leaves the key out (None), or (`local`) supplies a value
#: of its own machine: a path under the state directory, a port, a user.
LOCAL = "<local>"


@dataclass(frozen=True)
class LabDifference:
    """How the lab's slurm.conf differs from the deployed one for one key, and why."""

    why: str
    #: The lab's value; None: the lab leaves the key out (Slurm's default applies); LOCAL: the lab's own.
    value: str | None = None


_NO_CGROUPS = "no delegated cgroup file system in the lab's container"
_LAPTOP = "one machine: every daemon on loopback, every file under the cluster's state directory"

#: Every way the lab's slurm.conf differs from the deployed one (node and partition lines included), and why.
LAB_DIFFERENCES: Mapping[str, LabDifference] = {
    # -- what a laptop cannot have: one machine, its own paths and ports, no cgroups, no slurmdbd ---------------
    "ClusterName": LabDifference("the lab's cluster name (the stack's clusterName in a deployment)", LOCAL),
    "SlurmctldHost": LabDifference(_LAPTOP, LOCAL),
    "SlurmctldPort": LabDifference(f"{_LAPTOP}; free ports, several clusters per machine", LOCAL),
    "SlurmdPort": LabDifference("each of the N slurmd on one machine has its own port, on its NodeName line"),
    "SlurmUser": LabDifference("root, or a user the caller names (tests that need Slinky's `slurm`)", LOCAL),
    "StateSaveLocation": LabDifference(_LAPTOP, LOCAL),
    "SlurmdSpoolDir": LabDifference(_LAPTOP, LOCAL),
    "SlurmctldPidFile": LabDifference(_LAPTOP, LOCAL),
    "SlurmdPidFile": LabDifference(_LAPTOP, LOCAL),
    "SlurmctldLogFile": LabDifference(_LAPTOP, LOCAL),
    "SlurmdLogFile": LabDifference(_LAPTOP, LOCAL),
    "SlurmSchedLogFile": LabDifference("the lab reads slurmctld's own log"),
    "LogTimeFormat": LabDifference("Slurm's default format, which Slurm 22.05 and the lab's log readers know"),
    "PluginDir": LabDifference("a relocated Slurm tree (scripts/slurm-tree.sh) loads its plugins from there", LOCAL),
    "MaxNodeCount": LabDifference("no dynamic nodes: the lab's nodes are all in slurm.conf"),
    "AuthType": LabDifference("munge: Slurm 22.05, which the lab also runs, has no auth/slurm", "auth/munge"),
    "CredType": LabDifference("munge, as AuthType", "cred/munge"),
    "AuthInfo": LabDifference("the lab's munge socket (munge, as AuthType); the deployed cred_expire", LOCAL),
    "AuthAltTypes": LabDifference("no JWT key in the lab; tests of slurmrestd and the operator add it"),
    "AuthAltParameters": LabDifference("no JWT key in the lab, as AuthAltTypes"),
    "CommunicationParameters": LabDifference("block_null_hash is unknown to Slurm 22.05, which the lab also runs"),
    "SlurmctldParameters": LabDifference("slurmd read the one slurm.conf file: no configless fetch, no stepmgr"),
    "ProctrackType": LabDifference(_NO_CGROUPS + ": processes are tracked through /proc", "proctrack/linuxproc"),
    "TaskPlugin": LabDifference(_NO_CGROUPS + "; fake GPUs need no binding", "task/none"),
    "PrologFlags": LabDifference("Contain needs proctrack/cgroup"),
    "MetricsType": LabDifference("metrics/openmetrics is unknown to Slurm 22.05; the lab scrapes its own"),
    "SelectType": LabDifference(
        "the deployed images' default (Slurm >= 23.11); the lab also runs 22.05, whose default is select/linear",
        "select/cons_tres",
    ),
    "SelectTypeParameters": LabDifference(
        "the lab's nodes declare a nominal RealMemory: with memory consumable each job would take a whole node",
        "CR_Core",
    ),
    "SlurmdParameters": LabDifference(
        "nodes declare more CPUs and GPUs than the machine has (simulated GPUs)", "config_overrides"
    ),
    "AccountingStorageType": LabDifference(
        "no slurmdbd in a single lab cluster (the lab's federation adds one)", "accounting_storage/none"
    ),
    "AccountingStoragePort": LabDifference("no slurmdbd, as AccountingStorageType"),
    "AccountingStorageTRES": LabDifference("no slurmdbd, as AccountingStorageType"),
    "JobAcctGatherType": LabDifference(_NO_CGROUPS + "; no accounting", "jobacct_gather/none"),
    "Prolog": LabDifference("the lab's agents learn their jobs through the fast path's squeue, not a prolog"),
    "Epilog": LabDifference("as Prolog"),
    "HealthCheckProgram": LabDifference(
        "no hooks mount on the lab's nodes (they share one file system): the agent's fast path and the "
        "remediator drain, as they do first on a deployed node. The program is a no-op, but slurmctld still "
        "sends each node its health check at the deployed interval, which is what flags a silent node",
        "/bin/true",
    ),
    "PriorityType": LabDifference(
        "priority/basic: no slurmdbd for multifactor's fair share (the lab's federation sets multifactor)"
    ),
    "NodeName": LabDifference("N slurmd on loopback, each with its port and simulated GPUs", LOCAL),
    "PartitionName": LabDifference(
        "one partition holding every node; the deployed large/small partitions name Slinky NodeSets", LOCAL
    ),
}

#: Short Slurm timers for the tests of one mechanism on real Slurm (`SlurmCluster(timers=FAST_TIMERS)`), so a
#: test of a requeue or of a lost node takes seconds, not the deployed minute. Never the lab's, the demo's or
#: the benchmarks': those run the deployed timers (`fleetheal.slurm.conf`), and their figures are what a
#: deployed cluster does. cred_expire=5 is the least Slurm accepts ("AuthInfo=cred_expire=4 invalid").
FAST_TIMERS: Mapping[str, str] = {
    "KillWait": "10",
    "SlurmdTimeout": "10",
    "MessageTimeout": "5",
    "SchedulerParameters": "sched_interval=2,batch_sched_delay=0",
}
#: cred_expire of FAST_TIMERS (seconds): a requeued job is held cred_expire + 1 = 6 s.
FAST_CRED_EXPIRE_S = 5


def lab_settings(local: Mapping[str, str]) -> dict[str, str]:
    """The deployed settings with `LAB_DIFFERENCES` applied; `local` gives the value of every LOCAL key but
    NodeName and PartitionName (lines of their own)."""
    want = {k for k, d in LAB_DIFFERENCES.items() if d.value == LOCAL} - {"NodeName", "PartitionName"}
    if set(local) != want:
        raise ValueError(f"lab settings need exactly {sorted(want)}, got {sorted(local)}")
    out = conf.deployed(REFERENCE_GRACE_SECONDS, slurm_hooks.HEALTH_CHECK_PROGRAM)
    for key, diff in LAB_DIFFERENCES.items():
        out.pop(key, None)
        if diff.value == LOCAL:
            if key in local:
                out[key] = local[key]
        elif diff.value is not None:
            out[key] = diff.value
    return out


def slurm_conf(
    *,
    cluster_name: str,
    slurm_user: str,
    state_dir: Path,
    ctld_port: int,
    munge_socket: Path,
    node_ports: Mapping[str, int],
    cpus_per_node: int,
    gpus_per_node: int,
    gpu_type: str | None,
    partition: str,
    plugin_dir: Path,
    extra: Sequence[str],
    fast_timers: bool = False,
) -> str:
    """slurm.conf: `lab_settings` with every file under `state_dir`, one partition holding every node
    (`fast_timers`: with FAST_TIMERS, for tests); `extra` lines last (a later key overrides an earlier one)."""
    d = state_dir
    cred_expire = FAST_CRED_EXPIRE_S if fast_timers else conf.CRED_EXPIRE_S
    typed = f"{gpu_type}:" if gpu_type else ""
    gres = f" Gres=gpu:{typed}{gpus_per_node}" if gpus_per_node else ""
    settings = lab_settings(
        {
            "ClusterName": cluster_name,
            "SlurmctldHost": "localhost(127.0.0.1)",
            "SlurmctldPort": str(ctld_port),
            "SlurmUser": slurm_user,
            "StateSaveLocation": str(d / "ctld"),
            "SlurmdSpoolDir": str(d / "spool" / "%n"),
            "SlurmctldPidFile": str(d / "run" / "slurmctld.pid"),
            "SlurmdPidFile": str(d / "run" / "slurmd-%n.pid"),
            "SlurmctldLogFile": str(d / "log" / "slurmctld.log"),
            "SlurmdLogFile": str(d / "log" / "slurmd-%n.log"),
            "PluginDir": str(plugin_dir),
            "AuthInfo": f"socket={munge_socket},cred_expire={cred_expire}",
        }
    )
    if fast_timers:
        settings.update(FAST_TIMERS)
    lines = [
        "# Written by fleetheal.lab.slurm.SlurmCluster; regenerated at every start.",
        "# The deployed stack's settings with the lab's differences (fleetheal.lab.slurmconf.LAB_DIFFERENCES)"
        + (", and the short timers of tests (FAST_TIMERS)." if fast_timers else "."),
        *(f"{key}={value}" for key, value in settings.items()),
        *extra,
    ]
    for node, port in node_ports.items():
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={cpus_per_node} RealMemory=1000{gres} State=UNKNOWN"
        )
    lines.append(f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(state_dir: Path, node_names: Sequence[str], gpus_per_node: int, gpu_type: str | None) -> str:
    """gres.conf: each node's fake GPU device files, `AutoDetect=off` (they are not NVIDIA devices)."""
    gres_lines = ["AutoDetect=off"]
    if gpus_per_node:
        for node in node_names:
            devs = state_dir / "dev" / node / f"nvidia[0-{gpus_per_node - 1}]"
            kind = f" Type={gpu_type}" if gpu_type else ""
            gres_lines.append(f"NodeName={node} Name=gpu{kind} File={devs}")
    return "\n".join(gres_lines) + "\n"
