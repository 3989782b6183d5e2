"""fleetheal's CrossGuard rules: the pack's list of policies, and an offline evaluation of them.

This package is part of the policy pack (policies/), which runs and is published on its own: it imports
only the pack's requirements (policies/requirements.txt), never the fleetheal package, and its modules
import one another relatively. fleetheal reads the same folder as the package `fleetheal.infra.policy`
(a link to it) for `fleetheal render --policy`, and tests import it from there. `policies/__main__.py`
only assembles `policies()` into a PolicyPack (constructing a PolicyPack starts the analyzer server, so
nothing imports that one).

One validator function per rule, grouped by what it guards:
- shared: the names fleetheal's parts agree on, and readers of a resource's kind, name and labels;
- agent_rules: pinned images and the node agent (its resources, its reach over GPU NodeSets);
- pool_rules: GPU pools (warm standby, membership, failure domains, Kueue's quotas on lent nodes) and checkpoint
  storage;
- remediator_rules: the remediator (RBAC, authenticated alerts, replicas and their store);
- access_rules: what the agent's and the remediator's accounts are bound to, and who may reach their pods;
- slurm_rules: Slurm (job requeue) and the Slurm federation (cluster names, accounting).
Thresholds come from each policy's config schema; every violation says what is wrong, why it matters
and how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from .access_rules import validate_service_accounts_bound_to_own_roles, validate_workloads_behind_network_policy
from .agent_rules import AGENT_SCHEMA, validate_agent_resources, validate_gpu_nodesets_run_agent, validate_images_pinned
from .pool_rules import (
    FAILURE_DOMAIN_SCHEMA,
    STANDBY_SCHEMA,
    validate_checkpoint_storage_rwx,
    validate_kueue_quotas_schedulable,
    validate_node_in_one_pool,
    validate_standby_failure_domains,
    validate_standby_minimum,
)
from .remediator_rules import (
    PRODUCTION_SCHEMA,
    REMEDIATOR_SCHEMA,
    validate_alertmanager_receiver_authenticated,
    validate_production_remediator_replicas,
    validate_production_remediator_shared_store,
    validate_remediator_rbac,
    validate_remediator_replicas_shared_store,
)
from .shared import config_defaults
from .slurm_rules import (
    validate_federation_cluster_names,
    validate_federation_worker_names_manager,
    validate_production_federation_database_persistent,
    validate_slurm_requeue,
)


def policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    mandatory = EnforcementLevel.MANDATORY
    return [
        StackValidationPolicy(
            name="gpu-nodesets-run-agent",
            description="Every GPU NodeSet's nodes also run the fleetheal node agent.",
            validate=validate_gpu_nodesets_run_agent,
            enforcement_level=mandatory,
            config_schema=AGENT_SCHEMA,
        ),
        StackValidationPolicy(
            name="standby-pool-minimum",
            description="Each GPU pool keeps at least its minimum of warm-standby nodes.",
            validate=validate_standby_minimum,
            enforcement_level=mandatory,
            config_schema=STANDBY_SCHEMA,
        ),
        StackValidationPolicy(
            name="node-in-one-pool",
            description="Every node is listed in one GPU pool's membership, in a well-formed entry.",
            validate=validate_node_in_one_pool,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="standby-failure-domains",
            description="Each GPU pool's warm-standby nodes span at least standbyMinFailureDomains failure domains.",
            validate=validate_standby_failure_domains,
            enforcement_level=mandatory,
            config_schema=FAILURE_DOMAIN_SCHEMA,
        ),
        StackValidationPolicy(
            name="checkpoint-storage-rwx",
            description="The volume GPU NodeSets share for checkpoints is ReadWriteMany.",
            validate=validate_checkpoint_storage_rwx,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="kueue-quotas-schedulable",
            description="Kueue's GPU quotas are on the nodes GPU pools lend, never on slurmd's or the standby's.",
            validate=validate_kueue_quotas_schedulable,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="slurm-requeue-enabled",
            description="Slurm requeues batch jobs from failed nodes (JobRequeue=1).",
            validate=validate_slurm_requeue,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="remediator-rbac-least-privilege",
            description="The remediator's RBAC has no wildcard and reads no Secret but its own.",
            validate=validate_remediator_rbac,
            enforcement_level=mandatory,
            config_schema=REMEDIATOR_SCHEMA,
        ),
        StackValidationPolicy(
            name="service-accounts-bound-to-own-roles",
            description="The agent's and the remediator's ServiceAccounts are bound only to their own declared roles.",
            validate=validate_service_accounts_bound_to_own_roles,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="workloads-behind-network-policy",
            description="Every agent and remediator workload is behind a NetworkPolicy admitting named sources only.",
            validate=validate_workloads_behind_network_policy,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="remediator-replicas-need-shared-store",
            description="More than one remediator replica only with a PostgreSQL store and leader election.",
            validate=validate_remediator_replicas_shared_store,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="production-remediator-shared-store",
            description="A production remediator keeps its incidents in PostgreSQL, not on one pod's volume.",
            validate=validate_production_remediator_shared_store,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="production-remediator-replicas",
            description="A production remediator runs at least productionMinReplicas replicas.",
            validate=validate_production_remediator_replicas,
            enforcement_level=mandatory,
            config_schema=PRODUCTION_SCHEMA,
        ),
        ResourceValidationPolicy(
            name="alertmanager-receiver-authenticated",
            description="Alertmanager authenticates to the remediator with a token from a Secret.",
            validate=validate_alertmanager_receiver_authenticated,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="images-pinned",
            description="Every container image is pinned to a release tag or a digest, never latest.",
            validate=validate_images_pinned,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="federation-cluster-names",
            description="A federation's clusters have unique, valid Slurm cluster names, and every one is declared.",
            validate=validate_federation_cluster_names,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="federation-worker-names-manager",
            description="A federation worker keeps its accounting in the manager's slurmdbd, named by host and port.",
            validate=validate_federation_worker_names_manager,
            enforcement_level=mandatory,
        ),
        StackValidationPolicy(
            name="production-federation-database-persistent",
            description="A production federation manager keeps slurmdbd's database on a retained persistent volume.",
            validate=validate_production_federation_database_persistent,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="agent-requests-and-limits",
            description="The node agent sets CPU and memory requests and limits.",
            validate=validate_agent_resources,
            enforcement_level=mandatory,
            config_schema=AGENT_SCHEMA,
        ),
    ]


# ----------------------------------------------------------------------------------------------
# Offline evaluation (tests, `fleetheal render --policy`): run the pack over recorded resources.


def _policy_resource(type_: str, name: str, props: Mapping[str, Any]) -> Any:
    from pulumi_policy.policy import PolicyCustomTimeouts, PolicyResource, PolicyResourceOptions

    opts = PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [])
    urn = f"urn:pulumi:stack::fleetheal::{type_}::{name}"
    return PolicyResource(type_, props, urn, name, opts, None, None, [], {})


def evaluate(
    resources: list[tuple[str, str, Mapping[str, Any]]],
    config: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[tuple[str, str]]:
    """Run every policy over (type token, name, props) triples; return (policy name, message) pairs.

    Each policy gets its config schema's defaults overlaid with `config[policy name]`, as the engine
    does. Resource policies see each resource once; stack policies see them all.
    """
    violations: list[tuple[str, str]] = []
    stack = [_policy_resource(t, n, p) for t, n, p in resources]
    for pol in policies():
        cfg = {**config_defaults(pol.config_schema), **dict((config or {}).get(pol.name, {}))}

        def report(message: str, urn: str | None = None, _name: str = pol.name) -> None:
            violations.append((_name, message))

        if isinstance(pol, StackValidationPolicy):
            pol.validate(StackValidationArgs(stack, cfg), report)
            continue
        for res in stack:
            args = ResourceValidationArgs(res.resource_type, res.props, res.urn, res.name, res.opts, None, cfg)
            pol.validate(args, report)
    return violations
