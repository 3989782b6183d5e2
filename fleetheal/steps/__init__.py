"""Remediation steps, written once: the remediator's first responder calls them in-process, and the
playbooks reach them as modules of the repository's collection (`fleetheal.cluster.slurm_node`,
`fleetheal.cluster.slurm_job`, `fleetheal.cluster.k8s_node`), so a human running a runbook does exactly
what the remediator does.

Every step is idempotent per incident (the incident id is written into the Slurm comment of what it
changed, and a step that finds it there reports `done` without acting again), returns `StepResult`s in
the shape of the playbooks' report (`{"step", "outcome", "detail"}`, outcome done | would | skipped |
failed), and honours a dry run ("would ...", nothing changed).

Slurm is driven through its own commands (`fleetheal.slurm`: `scontrol`, `scancel`, `squeue --json` and `sinfo`
read by its job and node readers), with the retries, delay and timeout of `playbooks/vars/remediation.yml`.
Kubernetes through the official client.

The package is split by what a step acts on: `slurm` (the Slurm steps), `kube` (the Kubernetes steps),
`settings` (the playbook variables), `probe` (whether Slurm and Kubernetes answer), `result`.
"""

from __future__ import annotations

from fleetheal.steps.kube import Kube, k8s_drain, k8s_isolate, k8s_promote, kube_for, pods_to_evict
from fleetheal.steps.probe import Dependencies
from fleetheal.steps.result import StepError, StepResult
from fleetheal.steps.settings import Settings
from fleetheal.steps.slurm import (
    MAX_PRIORITY,
    RequeuePlan,
    Slurm,
    append_job_log,
    can_shrink,
    drain_node,
    promote_standby,
    requeue_jobs,
    requeue_now,
    requeue_plan,
    requeue_would,
    restart_in_job,
    restarts,
    shrink_in_job,
    signal_jobs,
    tell_jobs,
)

__all__ = [
    "MAX_PRIORITY",
    "Dependencies",
    "Kube",
    "RequeuePlan",
    "Settings",
    "Slurm",
    "StepError",
    "StepResult",
    "append_job_log",
    "can_shrink",
    "drain_node",
    "k8s_drain",
    "k8s_isolate",
    "k8s_promote",
    "kube_for",
    "pods_to_evict",
    "promote_standby",
    "requeue_jobs",
    "requeue_now",
    "requeue_plan",
    "requeue_would",
    "restart_in_job",
    "restarts",
    "shrink_in_job",
    "signal_jobs",
    "tell_jobs",
]
