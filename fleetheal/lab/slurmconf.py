"""The configuration files of a lab Slurm cluster (`fleetheal.lab.slurm.SlurmCluster`): slurm.conf and
gres.conf, rendered from the cluster's settings; the cluster writes them at every start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


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
    extra: Sequence[str],
) -> str:
    """slurm.conf: every file under `state_dir`, short timers, one partition holding every node; `extra`
    lines last (a later key overrides an earlier one)."""
    d = state_dir
    typed = f"{gpu_type}:" if gpu_type else ""
    gres = f" Gres=gpu:{typed}{gpus_per_node}" if gpus_per_node else ""
    lines = [
        "# Written by fleetheal.lab.slurm.SlurmCluster; regenerated at every start.",
        f"ClusterName={cluster_name}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={slurm_user}",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire=5: a requeued job waits cred_expire + 1 s before it can start again.
        f"AuthInfo=socket={munge_socket},cred_expire=5",
        f"StateSaveLocation={d / 'ctld'}",
        f"SlurmdSpoolDir={d / 'spool' / '%n'}",
        f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroup delegation in containers: track processes through /proc.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,batch_sched_delay=0",
        "SlurmdParameters=config_overrides",
        "GresTypes=gpu",
        "ReturnToService=1",
        "JobRequeue=1",
        "SlurmdTimeout=10",
        "MessageTimeout=5",
        "InactiveLimit=0",
        "KillWait=10",
        "MinJobAge=300",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
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
