"""Names shared by several parts of fleetheal (DESIGN.md, "Contracts between the parts").

Change a name here, never by hand in several places. Generated files (alert rules, Ansible vars)
take these values through `fleetheal generate`.
"""

from __future__ import annotations

import math
import re

#: Slurm drain reasons fleetheal owns start with this; it never undrains a node without it.
DRAIN_REASON_PREFIX = "fleetheal:"

#: Kubernetes label/taint prefix.
K8S_PREFIX = "fleetheal.io/"
#: Taint put on a node fleetheal isolated (effect NoSchedule; value = fault id).
TAINT_UNHEALTHY = K8S_PREFIX + "unhealthy"
#: Taint that keeps warm-standby nodes empty until they are promoted.
TAINT_STANDBY = K8S_PREFIX + "standby"
#: Pool membership label: one of POOLS.
LABEL_POOL = K8S_PREFIX + "pool"
POOLS = ("active", "standby", "quarantine")
#: Label naming the fault on a node the agent's fast path took out (value = fault id).
LABEL_FAULT = K8S_PREFIX + "fault"
#: Failure-domain label (rack, leaf switch) the safety gate budgets by.
LABEL_FAILURE_DOMAIN = K8S_PREFIX + "failure-domain"

#: Labels every fleetheal alert carries (Alertmanager -> remediator).
ALERT_LABELS = ("cluster", "node", "gpu", "fault_id", "class", "action", "severity")

#: Gauge the agent sets to 1 while a fault is active on a GPU (gpu="node" for node-wide faults).
#: Labels: node, gpu, fault_id, class, action, severity. The generated alert rules select on it.
METRIC_FAULT_ACTIVE = "fleetheal_agent_fault_active"
#: Counter of classified faults. Labels: fault_id, class.
METRIC_FAULTS_TOTAL = "fleetheal_agent_faults_total"

#: Value of the `gpu` label for faults that concern the whole node (NIC, host memory, disk).
NODE_WIDE_GPU = "node"

#: The default isolation budget of the fleet: nodes out at once for faults, as an absolute cap and as a
#: share of the pool. The remediator's gate (gate.budget) and the agent's fast path (fastpath.fleet_budget)
#: both default to it.
FLEET_BUDGET_NODES = 8
FLEET_BUDGET_SHARE = 0.05
#: Reasons of owned drains that are pools, not faults: they never count against the fleet budget.
POOL_REASONS = (DRAIN_REASON_PREFIX + "standby", DRAIN_REASON_PREFIX + "quarantine")


def budget_limit(absolute: int, fraction: float, size: int) -> int:
    """The smaller of the absolute cap and the share of `size` (rounded down, at least 1)."""
    share = max(1, math.floor(fraction * size)) if size else 0
    return min(absolute, share)


_REASON_SAFE = re.compile(r"[^A-Za-z0-9_.:=/-]+")


def drain_reason(fault_id: str, incident: str, gpu: str | None = None, when: str | None = None) -> str:
    """An owned Slurm drain reason: `fleetheal:<fault> incident=<id> [gpu=<i>] [at=<time>]`.

    Only safe characters survive, so the reason can be passed to scontrol as one argument.
    """
    parts = [f"{DRAIN_REASON_PREFIX}{fault_id}", f"incident={incident}"]
    if gpu is not None:
        parts.append(f"gpu={gpu}")
    if when is not None:
        parts.append(f"at={when}")
    return " ".join(_REASON_SAFE.sub("_", p) for p in parts)


def owns_reason(reason: str | None) -> bool:
    """True when a Slurm node reason was written by fleetheal."""
    return bool(reason) and str(reason).startswith(DRAIN_REASON_PREFIX)


#: Extra variables the remediator passes to every remediation playbook (all validated first).
#: Playbooks assert `fleetheal_action` is what the taxonomy maps `fleetheal_fault_id` to.
PLAYBOOK_VARS = (
    "fleetheal_incident_id",  # str, e.g. "inc-000042"
    "fleetheal_node",  # RFC 1123 node name known to the cluster (Slurm and Kubernetes node name)
    "fleetheal_fault_id",  # taxonomy fault id
    "fleetheal_fault_class",  # hardware | transient | user | unknown
    "fleetheal_action",  # taxonomy action
    "fleetheal_cluster",  # cluster name
    "fleetheal_dry_run",  # bool: report "would ...", change nothing
    "fleetheal_job_id",  # optional Slurm job id ("" when the fault is not tied to one job)
    "fleetheal_gpu",  # optional GPU index or "node"
    # The safety gate's facts at its decision (playbooks/tasks/guard.yml refuses destructive runs without them):
    "fleetheal_paused",  # bool: the pause switch was on (the gate holds paused incidents, so false when run)
    "fleetheal_budget_remaining",  # int: isolations the budget allowed, this node's included (>= 1 when allowed)
)

#: Pool membership beyond active/standby: the GPU pool (Slinky NodeSet) and GPU type of a node.
LABEL_GPU_POOL = K8S_PREFIX + "gpu-pool"
LABEL_GPU_TYPE = K8S_PREFIX + "gpu-type"
#: Host directory the agent shares with slurmd pods: `health` holds "ok" or the active fault id
#: (the Slurm HealthCheckProgram drains the node on anything else); `jobs/<job id>` is written by the
#: Slurm prolog and removed by the epilog so the agent can name the job a fault hits.
AGENT_STATE_DIR = "/run/fleetheal"
AGENT_HEALTH_FILE = AGENT_STATE_DIR + "/health"
AGENT_JOBS_DIR = AGENT_STATE_DIR + "/jobs"
