"""Names shared by several parts of fleetheal (DESIGN.md, "Contracts between the parts").

Change a name here, never by hand in several places. Generated files (alert rules, Ansible vars)
take these values through `fleetheal generate`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

#: Slurm drain reasons fleetheal owns start with this; it never undrains a node without it.
DRAIN_REASON_PREFIX = "fleetheal:"

#: A node's name, in Slurm and in Kubernetes alike: an RFC 1123 subdomain (dot-separated labels of 1-63
#: lower-case letters, digits and inner hyphens), 253 characters at most (`is_node_name`).
NODE_NAME_PATTERN = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)*"
#: A Slurm cluster's name (its ClusterName) in fleetheal: a letter, then up to 39 lower-case letters, digits or
#: hyphens (it names Kubernetes objects and accounting rows too; `is_cluster_name`).
CLUSTER_NAME_PATTERN = r"[a-z][a-z0-9-]{0,39}"
_NODE_NAME = re.compile(NODE_NAME_PATTERN)
_CLUSTER_NAME = re.compile(CLUSTER_NAME_PATTERN)


def is_node_name(name: object) -> bool:
    """True for a valid node name (NODE_NAME_PATTERN)."""
    return isinstance(name, str) and len(name) <= 253 and _NODE_NAME.fullmatch(name) is not None


def is_cluster_name(name: object) -> bool:
    """True for a valid Slurm cluster name (CLUSTER_NAME_PATTERN)."""
    return isinstance(name, str) and _CLUSTER_NAME.fullmatch(name) is not None


#: Kubernetes label/taint prefix.
K8S_PREFIX = "fleetheal.io/"
#: Taint put on a node fleetheal isolated (effect NoSchedule; value = fault id).
TAINT_UNHEALTHY = K8S_PREFIX + "unhealthy"
#: Taint that keeps warm-standby nodes empty until they are promoted.
TAINT_STANDBY = K8S_PREFIX + "standby"
#: Pool membership label: one of POOLS.
LABEL_POOL = K8S_PREFIX + "pool"
#: The pool of an active node lent to Kubernetes workloads (Kueue's ResourceFlavors select it): out of the
#: slurmd NodeSet's selection, so its GPUs are free for the pods Kueue admits.
POOL_LENT = "lent"
POOLS = ("active", "standby", "quarantine", POOL_LENT)
#: Taint on a lent node (effect NoSchedule): only pods that Kueue admitted, with its flavour's toleration, run there.
TAINT_LENT = K8S_PREFIX + "lent"
#: Taint on a lent node Slurm is taking back (effect NoSchedule, no pod tolerates it): the pods a reclaim evicts are
#: made again by their controllers, and must not land on it again.
TAINT_RECLAIMING = K8S_PREFIX + "reclaiming"
#: What a node of a GPU pool does, in view order (the lending controller's rounds, the metric
#: fleetheal_remediator_gpu_pool_nodes, `fleetheal fleet status`).
POOL_USES = ("training", "inference", "lent", "idle", "standby", "repair", "unavailable")
#: Annotation on a lent Node: JSON {"since": when it was lent, "pool": its GPU pool, "reclaim": when Slurm asked
#: for it back}; the lending controller reads its state back from it.
ANNOTATION_LENT = K8S_PREFIX + "lent"
#: Label naming the fault on a node the agent's fast path took out (value = fault id).
LABEL_FAULT = K8S_PREFIX + "fault"
#: Annotation on a Node that reports its repair done (any value: who and what); the remediator then
#: revalidates the node and removes the annotation.
ANNOTATION_REPAIRED = K8S_PREFIX + "repaired"
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
#: The word of a Slurm job's comment that names the checkpoint store the job resumes from (`fleetheal submit
#: --checkpoint-store NAME`); cross-cluster failover moves a job only to a cluster that reads that store.
#: Every comment fleetheal rewrites keeps it.
CHECKPOINT_WORD = "fleetheal-checkpoint="
#: The word `fleetheal launch` adds to its job's comment: the job restarts in place, and the launcher watches
#: its output (so the agent does not follow its files).
LAUNCH_TAG = "fleetheal-launch"
#: How fleetheal's own lines in a job's log begin (the remediator's `fleetheal: <did> (incident <id>)`, the
#: launcher's `fleetheal launch: ...`): whoever judges the log skips them, they are never the job's words.
OWN_LOG_LINE = (DRAIN_REASON_PREFIX, "fleetheal launch:")
#: The Slurm drain reason of a node lent to Kubernetes workloads (fleetheal.remediator.lending).
LENT_REASON = DRAIN_REASON_PREFIX + "lent"
#: Drain reasons of a pool, not of a fault: the fleet budget does not count them (and the remediator's isolation
#: replaces LENT_REASON with its fault's).
STANDBY_REASON = DRAIN_REASON_PREFIX + "standby"
POOL_REASONS = (STANDBY_REASON, DRAIN_REASON_PREFIX + "quarantine", LENT_REASON)


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


def owns_reason(reason: str | None, prefix: str = DRAIN_REASON_PREFIX) -> bool:
    """True when a Slurm node reason was written by fleetheal (`prefix`: or one of its pools, e.g. standby)."""
    return bool(reason) and str(reason).startswith(prefix)


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

#: What a playbook's inputs must look like (playbooks/tasks/validate.yml, through `playbook_input_problem`).
_REQUIRED_INPUTS = (
    "fleetheal_incident_id", "fleetheal_node", "fleetheal_fault_id", "fleetheal_action", "fleetheal_cluster",
    "fleetheal_dry_run",
)  # fmt: skip
_INCIDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_JOB_ID = re.compile(r"([0-9]+(_[0-9]+)?)?")
_GPU = re.compile(r"([0-9]+|node)?")
_BOOLEANS = ("true", "false", "yes", "no", "1", "0")


def playbook_input_problem(
    values: Mapping[str, Any], taxonomy: Mapping[str, Any], followups: Mapping[str, Any], playbook_action: str
) -> str:
    """Why a remediation playbook must not run on these inputs (PLAYBOOK_VARS, as the remediator or a human
    gave them), or "" when it may: the first problem found, in the order a human fixes them.
    `taxonomy` is `playbooks/vars/taxonomy.yml`; `followups` the playbooks' `fleetheal_followup_actions`."""

    def text(name: str) -> str:
        value = values.get(name)
        return "" if value is None else str(value)

    for name in _REQUIRED_INPUTS:
        if not text(name):
            return f"{name} is required (the remediator passes it; a human running this runbook passes it with -e)"
    names = ("incident_id", "node", "job_id", "gpu", "dry_run")
    incident, node, job, gpu, dry = (text(f"fleetheal_{n}") for n in names)
    if not (
        _INCIDENT_ID.fullmatch(incident)
        and is_node_name(node)
        and _JOB_ID.fullmatch(job)
        and _GPU.fullmatch(gpu)
        and dry.lower() in _BOOLEANS
    ):
        return (
            f"Malformed input: incident {incident[:70]!r}, node {node[:70]!r}, job {job[:70]!r}, gpu {gpu[:70]!r}, "
            f'dry run {dry[:70]!r} (node: an RFC 1123 name; job: a Slurm job id; gpu: an index or "node"; dry run: '
            "a boolean)"
        )
    faults, actions = taxonomy["fleetheal_taxonomy_faults"], taxonomy["fleetheal_taxonomy_actions"]
    fault_id, action = text("fleetheal_fault_id"), text("fleetheal_action")
    if fault_id not in faults or action not in actions:
        return (
            f"Unknown fault {fault_id[:70]} or action {action[:70]}; known actions: {', '.join(actions)} "
            "(policies/faults.yaml, `fleetheal generate`)"
        )
    if action != playbook_action:
        return f"{actions[action]['playbook']} runs {action}, but this is the playbook for {playbook_action}"
    fault = faults[fault_id]
    if fault["action"] != action and fault["action"] not in (followups.get(action) or ()):
        return (
            f"The taxonomy maps {fault_id} ({fault['class']}) to {fault['action']}, not {action}: refusing to run "
            f"{playbook_action}"
        )
    fault_class = text("fleetheal_fault_class")
    if fault_class and fault_class != fault["class"]:
        return (
            f"fleetheal_fault_class {fault_class[:70]} disagrees with the taxonomy's class {fault['class']} for "
            f"{fault_id}"
        )
    return ""


#: Pool membership beyond active/standby: the GPU pool (Slinky NodeSet) and GPU type of a node.
LABEL_GPU_POOL = K8S_PREFIX + "gpu-pool"
LABEL_GPU_TYPE = K8S_PREFIX + "gpu-type"
#: Host directory the agent shares with slurmd pods: `health` holds "ok" or the active fault id
#: (the Slurm HealthCheckProgram drains the node on anything else); `jobs/<job id>` is written by the
#: Slurm prolog and removed by the epilog so the agent can name the job a fault hits.
AGENT_STATE_DIR = "/run/fleetheal"
AGENT_HEALTH_FILE = AGENT_STATE_DIR + "/health"
#: The path of the agent's metrics port that its readiness probe asks (200 while the endpoint answers).
AGENT_READY_PATH = "/healthz"
AGENT_JOBS_DIR = AGENT_STATE_DIR + "/jobs"

# Pool membership of existing nodes (fleetheal.infra.nodepools -> fleetheal.remediator.membership).
# A stack declares one ConfigMap per GPU pool, not one resource per node: its data maps each member
# Node's name to "<active|standby> <failure domain>", its labels name the pool and GPU type. The
# remediator's membership controller applies the labels and the standby taint to the Nodes with its own
# server-side-apply field manager, and only when a node's entry changes (the annotation records the
# entry applied), so a promotion by the remediator is never undone by an unchanged declaration.
#: On a membership ConfigMap: the GPU pool it declares.
LABEL_MEMBERSHIP = K8S_PREFIX + "membership"
#: On a Node: the membership entry last applied ("<gpu pool> <gpu type> <role> <failure domain>").
ANNOTATION_MEMBERSHIP = K8S_PREFIX + "membership"
MEMBERSHIP_FIELD_MANAGER = "fleetheal-membership"
#: A ConfigMap holds at most 1 MiB; a pool's membership must stay well under it.
MEMBERSHIP_MAX_BYTES = 900_000
MEMBER_ROLES = ("active", "standby")


def membership_configmap(pool: str) -> str:
    """The name of GPU pool `pool`'s membership ConfigMap."""
    return f"fleetheal-pool-{pool}"


def membership_entry(role: str, failure_domain: str) -> str:
    return f"{role} {failure_domain}"


def parse_membership_entry(entry: str) -> tuple[str, str]:
    """(role, failure domain) of a membership ConfigMap's value; ValueError names what is wrong."""
    parts = entry.split()
    if len(parts) != 2 or parts[0] not in MEMBER_ROLES:
        raise ValueError(f"{entry[:80]!r} is not '<active|standby> <failure domain>'")
    return parts[0], parts[1]


def member_node(
    pool: str, gpu_type: str, role: str, failure_domain: str
) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The labels and taints a member Node of `pool` carries (the standby taint's value is the pool)."""
    labels = {
        LABEL_POOL: role,
        LABEL_GPU_POOL: pool,
        LABEL_GPU_TYPE: gpu_type,
        LABEL_FAILURE_DOMAIN: failure_domain,
    }
    taints = [{"key": TAINT_STANDBY, "value": pool, "effect": "NoSchedule"}] if role == "standby" else []
    return labels, taints


# --- the agent's access to its own Node -----------------------------------------------------------------
# The stack (fleetheal.infra.agent) declares these objects; the lab installs the same ones on its API server.

#: Name of the agent's ServiceAccount, ClusterRole and ClusterRoleBinding (and of its DaemonSet).
AGENT_NAME = "fleetheal-agent"
#: The agent's ClusterRole (also the lab's): the fast path taints and labels its own node before any alert
#: travels. RBAC cannot restrict this to the agent's own node: `own_node_policy` does.
AGENT_RBAC_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
#: The user-info extra in which the API server names the Node a service-account token is bound to: a token
#: bound to a Node, or to a Pod (the kubelet's projected token: the API server records the pod's node in it,
#: feature ServiceAccountTokenPodNodeInfo, GA in Kubernetes 1.32).
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: Name of the ValidatingAdmissionPolicy (and of its binding) that keeps each agent to its own Node.
OWN_NODE_POLICY = "fleetheal-agent-own-node"


def own_node_policy(namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ValidatingAdmissionPolicy and its binding that make the agent's token node-scoped (the stack
    declares them beside the agent's RBAC; the lab installs these same objects on its API server).

    For an update (PATCH or PUT) of a Node by the agent's ServiceAccount (`namespace`/fleetheal-agent):
    - the Node must be the one named in the token (`NODE_NAME_EXTRA`); a token bound to no node may change
      no Node at all;
    - on its own Node the agent may only add the `fleetheal.io/unhealthy` taint and set the
      `fleetheal.io/fault` label: it removes or changes no taint (an isolation taint put there by the
      remediator stays), changes no other label (not its pool) nor annotation, and does not uncordon.
    Reading Nodes stays open to the agent, as it is to every kubelet.
    """
    user = f"system:serviceaccount:{namespace}:{AGENT_NAME}"
    unhealthy, fault = TAINT_UNHEALTHY, LABEL_FAULT
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": OWN_NODE_POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
                ]
            },
            "matchConditions": [
                {"name": "is-the-fleetheal-agent", "expression": f"request.userInfo.username == '{user}'"}
            ],
            "variables": [
                {
                    "name": "boundNode",
                    "expression": f"'{NODE_NAME_EXTRA}' in request.userInfo.extra"
                    f" ? request.userInfo.extra['{NODE_NAME_EXTRA}'] : []",
                },
                {"name": "oldTaints", "expression": "has(oldObject.spec.taints) ? oldObject.spec.taints : []"},
                {"name": "newTaints", "expression": "has(object.spec.taints) ? object.spec.taints : []"},
                {"name": "oldLabels", "expression": "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}"},
                {"name": "newLabels", "expression": "has(object.metadata.labels) ? object.metadata.labels : {}"},
            ],
            "validations": [
                {
                    "expression": "variables.boundNode == [object.metadata.name]",
                    "messageExpression": (
                        "size(variables.boundNode) == 0"
                        " ? 'the fleetheal agent token is bound to no node: it may change no Node'"
                        " : 'the fleetheal agent of node ' + variables.boundNode[0]"
                        " + ' may change only its own Node, not ' + object.metadata.name"
                    ),
                    "reason": "Forbidden",
                },
                {
                    "expression": "variables.oldTaints.all(t, t in variables.newTaints)"
                    f" && variables.newTaints.all(t, t in variables.oldTaints || t.key == '{unhealthy}')",
                    "message": f"the fleetheal agent may only add the {unhealthy} taint; it removes or changes none",
                    "reason": "Forbidden",
                },
                {
                    "expression": f"variables.newLabels.all(k, k == '{fault}'"
                    " || (k in variables.oldLabels && variables.oldLabels[k] == variables.newLabels[k]))"
                    f" && variables.oldLabels.all(k, k == '{fault}' || k in variables.newLabels)"
                    " && (has(object.metadata.annotations) ? object.metadata.annotations : {})"
                    " == (has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {})"
                    " && (has(object.spec.unschedulable) && object.spec.unschedulable)"
                    " == (has(oldObject.spec.unschedulable) && oldObject.spec.unschedulable)",
                    "message": f"the fleetheal agent may only set the {fault} label; it changes no other label,"
                    " annotation or cordon",
                    "reason": "Forbidden",
                },
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": OWN_NODE_POLICY},
        "spec": {"policyName": OWN_NODE_POLICY, "validationActions": ["Deny"]},
    }
    return policy, binding


# --- the job's own output as a fault source ----------------------------------------------------------------

#: The source of a fault read from a job's own stdout/stderr (`fleetheal launch`, or the agent following the
#: job's output files). Job output is text its owner controls: a fault from it acts on that job alone
#: (the alert names it in `job_id`) and never drains, taints or isolates a node.
JOB_OUTPUT_SOURCE = "job_output"
#: What a fault that would move a node becomes when only a job's output claims it (an Xid line, "GPU has
#: fallen off the bus", an ECC error printed by the job): the job is told, the node stays. The node is
#: isolated only when its own signals (NVML, kernel log, DCGM) raise the fault themselves.
JOB_OUTPUT_NODE_CLAIM = "job-output-node-claim"
