"""The CrossGuard rules, called directly: one valid factory per rule, one mutation per negative test,
the exact message asserted; then the whole pack over the mocked resource graph of the example stack.

policies/__main__.py is never imported: constructing a PolicyPack starts a server and blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pulumi_policy import ResourceValidationArgs, StackValidationArgs

from fleetheal import contracts
from fleetheal.infra import agent, config, mocks, policy, program, project
from fleetheal.infra.policy import agent_rules, pool_rules, remediator_rules, shared, slurm_rules
from fleetheal.infra.remediator_config import remediator_config

SLINKY = "slinky.slurm.net/v1beta1"
Props = dict[str, Any]


def run_resource(
    validator: Callable[..., None],
    props: Props,
    type_: str = "kubernetes:x",
    cfg: Props | None = None,
    name: str = "res",
) -> list[str]:
    res = policy._policy_resource(type_, name, props)
    out: list[str] = []
    args = ResourceValidationArgs(type_, props, res.urn, name, res.opts, None, cfg or {})
    validator(args, lambda msg, urn=None: out.append(msg))
    return out


def run_stack(
    validator: Callable[..., None], resources: list[tuple[str, str, Props]], cfg: Props | None = None
) -> list[str]:
    out: list[str] = []
    stack = [policy._policy_resource(t, n, p) for t, n, p in resources]
    validator(StackValidationArgs(stack, cfg or {}), lambda msg, urn=None: out.append(msg))
    return out


# -- valid factories -------------------------------------------------------------------------------


def controller() -> Props:
    return {
        "apiVersion": SLINKY,
        "kind": "Controller",
        "metadata": {"name": "lab"},
        "spec": {"extraConf": "JobRequeue=1\nKillWait=120\n"},
    }


def agent_daemonset() -> Props:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "fleetheal-agent"},
        "spec": {
            "template": {
                "spec": {
                    "affinity": {"nodeAffinity": agent.node_affinity()},
                    "tolerations": [{"key": t, "operator": "Exists"} for t in agent.TOLERATED_TAINTS],
                    "containers": [
                        {
                            "name": "agent",
                            "image": "r/agent:1.0",
                            "resources": {
                                "requests": {"cpu": "50m", "memory": "64Mi"},
                                "limits": {"cpu": "500m", "memory": "256Mi"},
                            },
                        }
                    ],
                }
            }
        },
    }


def nodeset(name: str = "lab-h100", pool: str = "h100") -> Props:
    return {
        "apiVersion": SLINKY,
        "kind": "NodeSet",
        "metadata": {"name": name, "namespace": "slurm"},
        "spec": {
            "slurmd": {"image": "r/slurmd:26.05", "resources": {"limits": {"nvidia.com/gpu": "8"}}},
            "template": {
                "spec": {
                    "nodeSelector": {contracts.LABEL_POOL: "active", contracts.LABEL_GPU_POOL: pool},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "lab-shared"}}],
                }
            },
        },
    }


def shared_claim(modes: list[str] | None = None) -> Props:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "lab-shared", "namespace": "slurm"},
        "spec": {"accessModes": modes or ["ReadWriteMany"]},
    }


MEMBERSHIP = "kubernetes:core/v1:ConfigMap"


def membership(pool: str, data: dict[str, str], gpu_type: str | None = None) -> Props:
    """A pool's membership ConfigMap as fleetheal.infra.nodepools.ExistingNodesProvider declares it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": contracts.membership_configmap(pool),
            "namespace": "fleetheal-system",
            "labels": {
                "app.kubernetes.io/component": "pool-membership",
                contracts.LABEL_MEMBERSHIP: pool,
                contracts.LABEL_GPU_POOL: pool,
                contracts.LABEL_GPU_TYPE: gpu_type or pool,
            },
        },
        "data": data,
    }


def members(active: int, standby: int, pool: str = "h100", fd_size: int = 8, prefix: str = "") -> dict[str, str]:
    """Node name -> entry, failure domains as nodepools.membership_data numbers them (rack order)."""
    data = {}
    for role, n in (("active", active), ("standby", standby)):
        for i in range(n):
            data[f"{prefix}{role[0]}{i}"] = contracts.membership_entry(role, f"{pool}-fd{i // fd_size}")
    return data


def pool_resource(pool: str, data: dict[str, str], gpu_type: str | None = None) -> tuple[str, str, Props]:
    return (MEMBERSHIP, f"{pool}-membership", membership(pool, data, gpu_type))


def stack(active: int = 4, standby: int = 1) -> list[tuple[str, str, Props]]:
    return [
        ("kubernetes:slinky.slurm.net/v1beta1:NodeSet", "ns", nodeset()),
        ("kubernetes:apps/v1:DaemonSet", "agent", agent_daemonset()),
        ("kubernetes:core/v1:PersistentVolumeClaim", "pvc", shared_claim()),
        pool_resource("h100", members(active, standby)),
    ]


def remediator_clusterrole() -> Props:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "fleetheal-remediator", "labels": {"app.kubernetes.io/component": "remediator"}},
        "rules": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        ],
    }


def remediator_token_role() -> Props:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "fleetheal-remediator-token", "labels": {"app.kubernetes.io/component": "remediator"}},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["fleetheal-remediator-token"],
                "verbs": ["get"],
            }
        ],
    }


def remediator_stack(
    replicas: int = 2, environment: str = "production", store: Props | None = None
) -> list[tuple[str, str, Props]]:
    """The remediator's Namespace, config and Deployment: valid in production (PostgreSQL, 2 replicas)."""
    cfg = remediator_config("lab", {}, True, lease_namespace="fleetheal-system")
    if store is not None:
        cfg["store"] = store
    labels = {"app.kubernetes.io/component": "remediator"}
    return [
        (
            "kubernetes:core/v1:Namespace",
            "ns",
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "fleetheal-system", "labels": {"fleetheal.io/environment": environment}},
            },
        ),
        (
            "kubernetes:core/v1:ConfigMap",
            "cm",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "fleetheal-remediator", "namespace": "fleetheal-system"},
                "data": {"remediator.yaml": yaml.safe_dump(cfg)},
            },
        ),
        (
            "kubernetes:apps/v1:Deployment",
            "deploy",
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "fleetheal-remediator", "namespace": "fleetheal-system", "labels": labels},
                "spec": {
                    "replicas": replicas,
                    "template": {
                        "spec": {"volumes": [{"name": "config", "configMap": {"name": "fleetheal-remediator"}}]}
                    },
                },
            },
        ),
    ]


SQLITE = {"path": "/var/lib/fleetheal/remediator.sqlite"}


def am_config() -> Props:
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": {"name": "fleetheal-remediator"},
        "spec": {
            "receivers": [
                {
                    "name": "fleetheal-remediator",
                    "webhookConfigs": [
                        {
                            "url": "http://r:9105/webhook",
                            "httpConfig": {
                                "authorization": {
                                    "type": "Bearer",
                                    "credentials": {"name": "fleetheal-remediator-token", "key": "token"},
                                }
                            },
                        }
                    ],
                }
            ]
        },
    }


# -- each rule: valid passes, each mutation fails with its exact message ---------------------------

REQUEUE_FIX = (
    "Without it a batch job on a failed or drained GPU node ends in NODE_FAIL instead of resuming from "
    "its checkpoint elsewhere. Fix: put 'JobRequeue=1' in spec.extraConf "
    "(fleetheal.infra.slurm_hooks.slurm_conf_lines does)."
)


def test_requeue_valid() -> None:
    assert run_resource(slurm_rules.validate_slurm_requeue, controller()) == []


@pytest.mark.parametrize(("conf", "shown"), [("KillWait=120\n", "unset"), ("JobRequeue=1\nJobRequeue=0\n", "0")])
def test_requeue_off(conf: str, shown: str) -> None:
    props = controller()
    props["spec"]["extraConf"] = conf
    assert run_resource(slurm_rules.validate_slurm_requeue, props) == [
        f"Controller 'lab': Slurm job requeue is off (JobRequeue={shown}). {REQUEUE_FIX}"
    ]


def test_requeue_off_in_a_helm_release() -> None:
    props = {
        "name": "slurm",
        "chart": "oci://ghcr.io/slinkyproject/charts/slurm",
        "values": {"controller": {"extraConf": "KillWait=30"}},
    }
    assert run_resource(slurm_rules.validate_slurm_requeue, props, type_=shared.HELM_RELEASE) == [
        f"Helm release 'slurm': Slurm job requeue is off (JobRequeue=unset). {REQUEUE_FIX}"
    ]


def test_images_pinned_valid() -> None:
    assert run_resource(agent_rules.validate_images_pinned, agent_daemonset()) == []
    assert run_resource(agent_rules.validate_images_pinned, nodeset()) == []


@pytest.mark.parametrize("image", ["r/agent:latest", "r/agent"])
def test_image_not_pinned(image: str) -> None:
    props = agent_daemonset()
    props["spec"]["template"]["spec"]["containers"][0]["image"] = image
    assert run_resource(agent_rules.validate_images_pinned, props, name="agent-ds") == [
        f"agent-ds: image '{image}' at spec.template.spec.containers[0].image is not pinned. 'latest' or a missing "
        "tag changes under you: two GPU nodes can run different agents or slurmd builds and a rollback cannot "
        "restore the old one. Fix: use REPOSITORY:TAG with a release tag, or REPOSITORY@sha256:DIGEST."
    ]


def test_helm_image_without_tag_is_not_pinned() -> None:
    props = {"values": {"controller": {"logfile": {"image": {"repository": "docker.io/library/alpine", "tag": None}}}}}
    (msg,) = run_resource(agent_rules.validate_images_pinned, props, type_=shared.HELM_RELEASE, name="slurm")
    assert msg.startswith("slurm: image 'docker.io/library/alpine:' at values.controller.logfile.image is not pinned.")


def test_agent_resources_valid() -> None:
    assert run_resource(agent_rules.validate_agent_resources, agent_daemonset()) == []


def test_agent_without_memory_limit() -> None:
    props = agent_daemonset()
    del props["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert run_resource(agent_rules.validate_agent_resources, props) == [
        "DaemonSet 'fleetheal-agent' container 'agent' has no limits.memory. The agent runs on every GPU node next "
        "to training jobs: without requests it is evicted first under pressure (and stops detecting faults), "
        "without limits a leak starves the job. Fix: set resources.requests and resources.limits for cpu and memory."
    ]


def test_agent_resources_ignores_other_daemonsets() -> None:
    props = agent_daemonset()
    props["metadata"]["name"] = "dcgm-exporter"
    props["spec"]["template"]["spec"]["containers"][0]["resources"] = {}
    assert run_resource(agent_rules.validate_agent_resources, props) == []
    assert run_resource(agent_rules.validate_agent_resources, props, cfg={"agentDaemonSet": "dcgm-exporter"}) != []


RBAC_WILDCARD = (
    "rule {i} grants '*' in {field}. The remediator drains nodes on alerts; a wildcard lets a "
    "compromised or buggy remediator do anything else too. Fix: list the exact apiGroups, resources "
    "and verbs it needs."
)
RBAC_SECRETS = (
    "rule {i} lets the remediator read Secrets beyond its own (fleetheal-remediator-token, "
    "fleetheal-remediator-store). Secrets hold Slurm, JWT and database keys that remediation never needs. "
    "Fix: a namespaced Role with resources [secrets], verbs [get] and resourceNames set to the remediator's "
    "own Secrets (its token, its store's URI)."
)


def test_remediator_rbac_valid() -> None:
    assert run_resource(remediator_rules.validate_remediator_rbac, remediator_clusterrole()) == []
    assert run_resource(remediator_rules.validate_remediator_rbac, remediator_token_role()) == []


def test_remediator_rbac_wildcard_verb() -> None:
    props = remediator_clusterrole()
    props["rules"][0]["verbs"] = ["*"]
    assert run_resource(remediator_rules.validate_remediator_rbac, props) == [
        "ClusterRole 'fleetheal-remediator' " + RBAC_WILDCARD.format(i=0, field="verbs")
    ]


def test_remediator_rbac_cluster_wide_secrets() -> None:
    props = remediator_clusterrole()
    props["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]})
    assert run_resource(remediator_rules.validate_remediator_rbac, props) == [
        "ClusterRole 'fleetheal-remediator' " + RBAC_SECRETS.format(i=2)
    ]


def test_remediator_rbac_someone_elses_secret() -> None:
    props = remediator_token_role()
    props["rules"][0]["resourceNames"].append("slurm-auth-jwt")
    assert run_resource(remediator_rules.validate_remediator_rbac, props) == [
        "Role 'fleetheal-remediator-token' " + RBAC_SECRETS.format(i=0)
    ]


REPLICAS_FIX = (
    "SQLite cannot be shared between pods, and replicas that do not elect a leader each act on every alert: one "
    "fault drained, requeued and replaced twice. Fix: set fleetheal:remediatorStore to postgres (the URI in the "
    "Secret fleetheal:remediatorStoreSecret names) or postgres-in-cluster (with fleetheal:remediatorDbPassword set "
    "as a secret), which also turns on leader election; or set fleetheal:remediatorReplicas to 1."
)
PRODUCTION = (
    "in production (Namespace 'fleetheal-system' is labelled fleetheal.io/environment=production, "
    "from fleetheal:environment)"
)


def _with_config(resources: list[tuple[str, str, Props]], fn: Callable[[Props], None]) -> list[tuple[str, str, Props]]:
    cm = resources[1][2]
    cfg = yaml.safe_load(cm["data"]["remediator.yaml"])
    fn(cfg)
    cm["data"]["remediator.yaml"] = yaml.safe_dump(cfg)
    return resources


def test_remediator_replicas_valid() -> None:
    assert run_stack(remediator_rules.validate_remediator_replicas_shared_store, remediator_stack(replicas=3)) == []
    one = remediator_stack(replicas=1, store=SQLITE)
    assert run_stack(remediator_rules.validate_remediator_replicas_shared_store, one) == []


def test_remediator_replicas_on_sqlite() -> None:
    resources = remediator_stack(replicas=2, store=SQLITE)
    assert run_stack(remediator_rules.validate_remediator_replicas_shared_store, resources) == [
        "Deployment 'fleetheal-remediator' runs 2 remediator replicas on the embedded SQLite store (its config sets "
        "no store.url_file). " + REPLICAS_FIX
    ]


def test_remediator_replicas_without_leader_election() -> None:
    resources = _with_config(remediator_stack(replicas=2), lambda c: c["leader_election"].update(enabled=False))
    assert run_stack(remediator_rules.validate_remediator_replicas_shared_store, resources) == [
        "Deployment 'fleetheal-remediator' runs 2 remediator replicas without leader election (its config does not "
        "set leader_election.enabled: true). " + REPLICAS_FIX
    ]


def test_remediator_replicas_without_its_config_in_the_stack() -> None:
    resources = [r for r in remediator_stack(replicas=2) if r[2]["kind"] != "ConfigMap"]
    (msg,) = run_stack(remediator_rules.validate_remediator_replicas_shared_store, resources)
    assert msg.startswith("Deployment 'fleetheal-remediator' runs 2 remediator replicas on the embedded SQLite store")


def test_production_remediator_store_valid() -> None:
    assert run_stack(remediator_rules.validate_production_remediator_shared_store, remediator_stack()) == []
    # SQLite is fine outside production
    dev = remediator_stack(replicas=1, environment="development", store=SQLITE)
    assert run_stack(remediator_rules.validate_production_remediator_shared_store, dev) == []


def test_production_remediator_on_sqlite() -> None:
    resources = remediator_stack(replicas=1, store=SQLITE)
    assert run_stack(remediator_rules.validate_production_remediator_shared_store, resources) == [
        f"Deployment 'fleetheal-remediator' runs {PRODUCTION} with its incident store in SQLite on one pod's volume "
        "(its config sets no store.url_file). When that node fails, remediation stops until the pod and its "
        "ReadWriteOnce volume are back (a volume on a lost node may never be), and SQLite lets no second replica "
        "take over. Fix: set fleetheal:remediatorStore to postgres (the URI in the Secret "
        "fleetheal:remediatorStoreSecret names) or postgres-in-cluster (with fleetheal:remediatorDbPassword set as a "
        "secret), and fleetheal:remediatorReplicas to 2 or more."
    ]


def test_production_remediator_replicas_valid() -> None:
    assert run_stack(remediator_rules.validate_production_remediator_replicas, remediator_stack(replicas=2)) == []
    dev = remediator_stack(replicas=1, environment="staging")
    assert run_stack(remediator_rules.validate_production_remediator_replicas, dev) == []


def test_production_remediator_with_one_replica() -> None:
    assert run_stack(remediator_rules.validate_production_remediator_replicas, remediator_stack(replicas=1)) == [
        f"Deployment 'fleetheal-remediator' runs 1 remediator replica(s) {PRODUCTION}; it needs at least 2 "
        "(productionMinReplicas). With fewer, losing or draining one node stops remediation: no GPU fault is handled "
        "until the pod is back. Fix: set fleetheal:remediatorReplicas to 2 or more (with fleetheal:remediatorStore "
        "postgres or postgres-in-cluster); the replicas run on different nodes."
    ]


def test_production_replicas_threshold_comes_from_pack_config() -> None:
    (msg,) = run_stack(
        remediator_rules.validate_production_remediator_replicas,
        remediator_stack(replicas=2),
        cfg={"productionMinReplicas": 3},
    )
    assert msg.startswith(
        f"Deployment 'fleetheal-remediator' runs 2 remediator replica(s) {PRODUCTION}; it needs at least 3"
    )


def test_alertmanager_receiver_valid() -> None:
    assert run_resource(remediator_rules.validate_alertmanager_receiver_authenticated, am_config()) == []


def test_alertmanager_receiver_without_credentials() -> None:
    props = am_config()
    del props["spec"]["receivers"][0]["webhookConfigs"][0]["httpConfig"]
    assert run_resource(remediator_rules.validate_alertmanager_receiver_authenticated, props) == [
        "AlertmanagerConfig 'fleetheal-remediator' receiver 'fleetheal-remediator' webhook 0 sends alerts without "
        "credentials. Anyone who can reach the remediator could then make it drain nodes. Fix: set "
        "httpConfig.authorization {type: Bearer, credentials: {name: <token Secret>, key: token}}."
    ]


AGENT_FIX = (
    "A GPU fault on those nodes would go undetected, so the node is never drained and jobs keep landing "
    "on it. Fix: make the agent DaemonSet's node affinity cover the NodeSet's nodeSelector and tolerate "
    "its taints (fleetheal.infra.agent.node_affinity)."
)


def test_gpu_nodesets_run_agent_valid() -> None:
    assert run_stack(agent_rules.validate_gpu_nodesets_run_agent, stack()) == []


def test_gpu_nodeset_without_agent() -> None:
    resources = [r for r in stack() if r[2]["kind"] != "DaemonSet"]
    assert run_stack(agent_rules.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: there is no 'fleetheal-agent' "
        "DaemonSet in the stack. " + AGENT_FIX
    ]


def test_gpu_nodeset_outside_the_agent_affinity() -> None:
    resources = stack()
    ds = resources[1][2]
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] = ["standby"]
    selector = {contracts.LABEL_POOL: "active", contracts.LABEL_GPU_POOL: "h100"}
    assert run_stack(agent_rules.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: the agent's node selection does "
        f"not match the NodeSet's nodeSelector {selector}. " + AGENT_FIX
    ]


def test_gpu_nodeset_tolerates_a_taint_the_agent_does_not() -> None:
    resources = stack()
    resources[0][2]["spec"]["template"]["spec"]["tolerations"].append(
        {"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}
    )
    assert run_stack(agent_rules.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: the agent does not tolerate the "
        "taint 'example.com/maintenance' the NodeSet tolerates. " + AGENT_FIX
    ]


def test_standby_minimum_valid() -> None:
    assert run_stack(pool_rules.validate_standby_minimum, stack(active=20, standby=1)) == []


def test_standby_below_minimum() -> None:
    assert run_stack(pool_rules.validate_standby_minimum, stack(active=40, standby=1)) == [
        "GPU pool 'h100' has 1 warm-standby node(s); it needs 2 (standbyMinNodes=1, standbySharePercent=5 of 40 "
        "active nodes). Without spare validated nodes a failed node cannot be replaced in minutes and the job waits "
        "for a repair. Fix: add warm-standby nodes to this pool (gpuPools[].standbyNodeNames, listed as 'standby' "
        "in its membership ConfigMap; or raise the standby node group's size)."
    ]


def test_standby_counts_each_pool_from_its_membership_configmap() -> None:
    resources = [
        pool_resource("h100", members(40, 2, "h100", prefix="h-")),
        pool_resource("a100", members(40, 1, "a100", prefix="a-")),
        # no membership label: not a membership ConfigMap, its entries count for nothing
        (
            "kubernetes:core/v1:ConfigMap",
            "other",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "x"},
                "data": members(0, 9, "a100", prefix="x-"),
            },
        ),
    ]
    (msg,) = run_stack(pool_rules.validate_standby_minimum, resources)
    assert msg.startswith(
        "GPU pool 'a100' has 1 warm-standby node(s); it needs 2 (standbyMinNodes=1, "
        "standbySharePercent=5 of 40 active nodes)."
    )


def test_standby_ignores_malformed_entries_and_mislabelled_configmaps() -> None:
    data = members(20, 1)
    data["s0"] = "spare h100-fd0"  # malformed: node-in-one-pool reports it, it is no standby
    (msg,) = run_stack(pool_rules.validate_standby_minimum, [pool_resource("h100", data)])
    assert msg.startswith("GPU pool 'h100' has 0 warm-standby node(s); it needs 1 ")
    cm = membership("h100", members(20, 0))
    cm["metadata"]["labels"][contracts.LABEL_GPU_POOL] = "h200"  # ignored by the controller: no pool to count
    assert run_stack(pool_rules.validate_standby_minimum, [(MEMBERSHIP, "cm", cm)]) == []


def test_standby_threshold_comes_from_pack_config() -> None:
    (msg,) = run_stack(pool_rules.validate_standby_minimum, stack(active=4, standby=1), cfg={"standbyMinNodes": 3})
    assert msg.startswith("GPU pool 'h100' has 1 warm-standby node(s); it needs 3 (standbyMinNodes=3,")


def test_standby_counts_managed_node_groups() -> None:
    groups = [
        (
            shared.EKS_NODE_GROUP,
            f"p5-{role}",
            {
                "labels": {contracts.LABEL_POOL: role, contracts.LABEL_GPU_POOL: "p5"},
                "scalingConfig": {"desiredSize": size},
            },
        )
        for role, size in (("active", 64), ("standby", 4))
    ]
    assert run_stack(pool_rules.validate_standby_minimum, groups) == []
    (msg,) = run_stack(pool_rules.validate_standby_minimum, groups, cfg={"standbySharePercent": 10})
    assert msg.startswith("GPU pool 'p5' has 4 warm-standby node(s); it needs 7 ")


SHARED_WHY = (
    "The remediator's membership controller applies such a node to neither pool, so it gets no pool labels and "
    "no standby taint: it is neither scheduled as active nor held as a spare. Fix: list each node once, in one "
    "pool's gpuPools[].nodeNames or gpuPools[].standbyNodeNames."
)
LABELS_WHY = (
    "The remediator's membership controller ignores a membership ConfigMap unless fleetheal.io/membership and "
    "fleetheal.io/gpu-pool both name its pool and fleetheal.io/gpu-type is set, so none of its {n} node(s) get "
    "their pool labels or standby taint. Fix: keep the labels fleetheal.infra.nodepools.ExistingNodesProvider sets "
    "(no transformation may change them): fleetheal.io/membership and fleetheal.io/gpu-pool = the pool's name."
)
MALFORMED_WHY = (
    "Each entry must map a node name to '<active|standby> <failure domain>'; the remediator's membership "
    "controller skips any other, so that node gets no pool labels or standby taint. Fix: declare nodes through "
    "gpuPools[].nodeNames and gpuPools[].standbyNodeNames (fleetheal.infra.nodepools writes the entries with "
    "contracts.membership_entry), never by editing the ConfigMap."
)


def two_pools() -> list[tuple[str, str, Props]]:
    return [
        pool_resource("h100", members(8, 1, "h100", prefix="h-")),
        pool_resource("a100", members(4, 1, "a100", prefix="a-")),
    ]


def test_node_in_one_pool_valid() -> None:
    assert run_stack(pool_rules.validate_node_in_one_pool, stack()) == []
    assert run_stack(pool_rules.validate_node_in_one_pool, two_pools()) == []
    # EKS node groups and other ConfigMaps are not membership
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"h-a0": "not an entry"}}
    assert run_stack(pool_rules.validate_node_in_one_pool, [*two_pools(), (MEMBERSHIP, "x", other)]) == []


def test_node_in_two_pools() -> None:
    resources = two_pools()
    resources[1][2]["data"]["h-a3"] = "standby a100-fd0"
    assert run_stack(pool_rules.validate_node_in_one_pool, resources) == [
        "1 node(s) are listed in more than one GPU pool's membership, in pools 'a100' and 'h100' (ConfigMaps "
        f"fleetheal-pool-a100, fleetheal-pool-h100): h-a3. {SHARED_WHY}"
    ]


def test_nodes_in_three_pools_and_in_two_pairs() -> None:
    resources = [*two_pools(), pool_resource("b200", members(2, 1, "b200", prefix="b-"))]
    resources[1][2]["data"]["h-a0"] = "active a100-fd0"
    resources[2][2]["data"]["h-a0"] = "active b200-fd0"
    resources[2][2]["data"]["a-a1"] = "active b200-fd0"
    assert run_stack(pool_rules.validate_node_in_one_pool, resources) == [
        "1 node(s) are listed in more than one GPU pool's membership, in pools 'a100' and 'b200' (ConfigMaps "
        f"fleetheal-pool-a100, fleetheal-pool-b200): a-a1. {SHARED_WHY}",
        "1 node(s) are listed in more than one GPU pool's membership, in pools 'a100', 'b200' and 'h100' "
        f"(ConfigMaps fleetheal-pool-a100, fleetheal-pool-b200, fleetheal-pool-h100): h-a0. {SHARED_WHY}",
    ]


def test_node_in_one_pool_lists_at_most_20_nodes_per_message() -> None:
    resources = two_pools()
    resources[1][2]["data"].update(members(25, 0, "a100", prefix="h-"))  # h-a0 .. h-a24, of which h-a0..7 in h100
    resources[0][2]["data"].update(members(25, 0, "h100", prefix="h-"))
    (msg,) = run_stack(pool_rules.validate_node_in_one_pool, resources)
    listed = ", ".join(f"h-a{i}" for i in range(20))
    assert msg == (
        "25 node(s) are listed in more than one GPU pool's membership, in pools 'a100' and 'h100' (ConfigMaps "
        f"fleetheal-pool-a100, fleetheal-pool-h100): {listed} and 5 more. {SHARED_WHY}"
    )


@pytest.mark.parametrize(
    ("labels", "problem"),
    [
        (
            {contracts.LABEL_GPU_POOL: "h200"},
            "it is labelled fleetheal.io/membership=h100 but fleetheal.io/gpu-pool=h200",
        ),
        (
            {contracts.LABEL_GPU_POOL: None},
            "it is labelled fleetheal.io/membership=h100 but has no fleetheal.io/gpu-pool label",
        ),
        ({contracts.LABEL_GPU_TYPE: None}, "it has no fleetheal.io/gpu-type label"),
        ({contracts.LABEL_MEMBERSHIP: ""}, "its fleetheal.io/membership label is empty"),
    ],
)
def test_membership_configmap_labels_disagree(labels: dict[str, str | None], problem: str) -> None:
    cm = membership("h100", members(4, 1))
    for k, v in labels.items():
        if v is None:
            del cm["metadata"]["labels"][k]
        else:
            cm["metadata"]["labels"][k] = v
    assert run_stack(pool_rules.validate_node_in_one_pool, [(MEMBERSHIP, "cm", cm)]) == [
        f"Membership ConfigMap 'fleetheal-pool-h100': {problem}. " + LABELS_WHY.format(n=5)
    ]


def test_mislabelled_configmap_is_no_pool_for_the_duplicate_check() -> None:
    resources = two_pools()
    resources[1][2]["metadata"]["labels"][contracts.LABEL_GPU_POOL] = "h100"
    resources[1][2]["data"]["h-a0"] = "active a100-fd0"
    (msg,) = run_stack(pool_rules.validate_node_in_one_pool, resources)
    assert msg.startswith(
        "Membership ConfigMap 'fleetheal-pool-a100': it is labelled fleetheal.io/membership=a100 but "
        "fleetheal.io/gpu-pool=h100. "
    )


def test_malformed_membership_entries() -> None:
    resources = two_pools()
    resources[0][2]["data"].update({"h-a1": "actve h100-fd0", "h-s0": "standby", "h-x": "active h100 fd0"})
    assert run_stack(pool_rules.validate_node_in_one_pool, resources) == [
        "Membership ConfigMap 'fleetheal-pool-h100' has 3 malformed entries: h-a1: 'actve h100-fd0', "
        f"h-s0: 'standby', h-x: 'active h100 fd0'. {MALFORMED_WHY}"
    ]
    resources = two_pools()
    resources[1][2]["data"]["a-a0"] = ""
    assert run_stack(pool_rules.validate_node_in_one_pool, resources) == [
        f"Membership ConfigMap 'fleetheal-pool-a100' has 1 malformed entry: a-a0: ''. {MALFORMED_WHY}"
    ]


def test_malformed_entries_are_bounded_per_message() -> None:
    cm = membership("h100", {f"n{i}": "broken" for i in range(30)})
    (msg,) = run_stack(pool_rules.validate_node_in_one_pool, [(MEMBERSHIP, "cm", cm)])
    listed = ", ".join(f"n{i}: 'broken'" for i in range(20))
    assert msg == f"Membership ConfigMap 'fleetheal-pool-h100' has 30 malformed entries: {listed} and 10 more. " + (
        MALFORMED_WHY
    )


def domains_message(pool: str, standby: int, found: str, *, n_found: int, need: int, want: int) -> str:
    return (
        f"GPU pool '{pool}' has its {standby} warm-standby node(s) in {n_found} failure domain(s) [{found}]; they "
        f"must span at least {need} (standbyMinFailureDomains={want}, at most one per standby node). Spares in one "
        "rack or behind one leaf switch fail together: a single such failure would leave the pool short of spares "
        "right when it needs replacements. Fix: list gpuPools[].standbyNodeNames in rack order with nodes from "
        f"{need} or more racks, and set failureDomainSize to the nodes per rack (every failureDomainSize "
        "consecutive names share a failure domain); or lower standbyMinFailureDomains."
    )


def test_standby_failure_domains_valid() -> None:
    # the default (1) keeps every stack with standby nodes valid
    assert run_stack(pool_rules.validate_standby_failure_domains, stack(active=40, standby=4)) == []
    assert run_stack(pool_rules.validate_standby_failure_domains, stack(active=40, standby=4), cfg={}) == []
    spread = [pool_resource("h100", members(40, 4, fd_size=2))]
    assert run_stack(pool_rules.validate_standby_failure_domains, spread, cfg={"standbyMinFailureDomains": 2}) == []
    # never more domains than standby nodes: 1 standby node satisfies any minimum
    assert (
        run_stack(pool_rules.validate_standby_failure_domains, stack(4, 1), cfg={"standbyMinFailureDomains": 3}) == []
    )
    # a pool without standby nodes is standby-pool-minimum's to report
    assert (
        run_stack(pool_rules.validate_standby_failure_domains, stack(4, 0), cfg={"standbyMinFailureDomains": 3}) == []
    )


def test_standby_nodes_in_one_failure_domain() -> None:
    resources = stack(active=40, standby=4)
    assert run_stack(pool_rules.validate_standby_failure_domains, resources, cfg={"standbyMinFailureDomains": 2}) == [
        domains_message("h100", 4, "h100-fd0 (4)", n_found=1, need=2, want=2)
    ]


def test_standby_failure_domains_capped_by_standby_count() -> None:
    resources = [
        pool_resource("h100", members(40, 3, "h100", fd_size=2, prefix="h-")),  # fd0 (2), fd1 (1)
        pool_resource("a100", members(40, 5, "a100", fd_size=2, prefix="a-")),  # fd0, fd1 (2 each), fd2 (1)
    ]
    assert run_stack(pool_rules.validate_standby_failure_domains, resources, cfg={"standbyMinFailureDomains": 4}) == [
        domains_message("a100", 5, "a100-fd0 (2), a100-fd1 (2), a100-fd2 (1)", n_found=3, need=4, want=4),
        domains_message("h100", 3, "h100-fd0 (2), h100-fd1 (1)", n_found=2, need=3, want=4),
    ]


def test_standby_failure_domains_ignore_node_groups() -> None:
    # EKS node groups carry no per-node failure domain in the stack: the rule reads membership entries only
    groups = [
        (
            shared.EKS_NODE_GROUP,
            "p5-standby",
            {
                "labels": {contracts.LABEL_POOL: "standby", contracts.LABEL_GPU_POOL: "p5"},
                "scalingConfig": {"desiredSize": 4},
            },
        )
    ]
    assert run_stack(pool_rules.validate_standby_failure_domains, groups, cfg={"standbyMinFailureDomains": 4}) == []


# -- 25,000 nodes in 16 pools ------------------------------------------------------------------------

FLEET_POOLS, FLEET_NODES, FLEET_STANDBY = 16, 25_000, 80


def fleet() -> list[tuple[str, str, Props]]:
    """25,000 nodes in 16 membership ConfigMaps, 80 standby nodes each (10 failure domains of 8)."""
    out = []
    for p in range(FLEET_POOLS):
        pool = f"p{p:02d}"
        size = FLEET_NODES // FLEET_POOLS + (1 if p < FLEET_NODES % FLEET_POOLS else 0)
        out.append(pool_resource(pool, members(size - FLEET_STANDBY, FLEET_STANDBY, pool, prefix=f"{pool}-")))
    return out


def test_fleet_of_25000_nodes() -> None:
    resources = fleet()
    assert sum(len(p["data"]) for _, _, p in resources) == FLEET_NODES
    assert policy.evaluate(resources, {"standby-failure-domains": {"standbyMinFailureDomains": 10}}) == []

    violations = policy.evaluate(resources, {"standby-failure-domains": {"standbyMinFailureDomains": 11}})
    assert [p for p, _ in violations] == ["standby-failure-domains"] * FLEET_POOLS
    found = ", ".join(f"p00-fd{i} (8)" for i in range(10))
    assert violations[0][1] == domains_message("p00", FLEET_STANDBY, found, n_found=10, need=11, want=11)

    violations = policy.evaluate(resources, {"standby-pool-minimum": {"standbySharePercent": 6}})
    assert [p for p, _ in violations] == ["standby-pool-minimum"] * FLEET_POOLS
    assert violations[0][1].startswith(
        "GPU pool 'p00' has 80 warm-standby node(s); it needs 89 (standbyMinNodes=1, standbySharePercent=6 of 1483 active nodes)."
    )


def test_fleet_of_25000_nodes_all_listed_twice_or_malformed() -> None:
    resources = fleet()
    # every node again in one more pool, and one ConfigMap of 25,000 malformed entries
    everyone = {node: "active mirror-fd0" for _, _, p in resources for node in p["data"]}
    broken = {f"x{i}": "broken" for i in range(FLEET_NODES)}
    resources += [pool_resource("mirror", everyone), pool_resource("broken", broken)]
    violations = policy.evaluate(resources)
    messages = [m for p, m in violations if p == "node-in-one-pool"]
    assert {p for p, _ in violations} == {"node-in-one-pool", "standby-pool-minimum"}
    # one message per pair of pools, one per malformed ConfigMap; each names at most 20 nodes
    assert len(messages) == FLEET_POOLS + 1
    assert all(len(m) < 2_000 for m in messages)
    assert messages[0].startswith(
        "1,563 node(s) are listed in more than one GPU pool's membership, in pools 'mirror' and 'p00' (ConfigMaps "
        "fleetheal-pool-mirror, fleetheal-pool-p00): p00-a0, p00-a1, "
    )
    assert " and 1,543 more. " in messages[0]
    assert messages[-1].startswith("Membership ConfigMap 'fleetheal-pool-broken' has 25,000 malformed entries: x0: ")
    assert " and 24,980 more. " in messages[-1]
    # the pools with no valid standby entry, as standby-pool-minimum sees them
    assert sorted(m.split("'")[1] for p, m in violations if p == "standby-pool-minimum") == ["broken", "mirror"]


def test_checkpoint_storage_valid() -> None:
    assert run_stack(pool_rules.validate_checkpoint_storage_rwx, stack()) == []


def test_checkpoint_storage_read_write_once() -> None:
    resources = stack()
    resources[2] = (resources[2][0], resources[2][1], shared_claim(["ReadWriteOnce"]))
    assert run_stack(pool_rules.validate_checkpoint_storage_rwx, resources) == [
        "PersistentVolumeClaim 'lab-shared' used by NodeSet 'lab-h100' for checkpoints has access modes "
        "['ReadWriteOnce'], not ReadWriteMany. A job requeued onto other nodes could not read its checkpoint, so "
        "relocation would restart training from scratch. Fix: set accessModes to [ReadWriteMany] with a "
        "StorageClass that supports it (NFS, Lustre CSI, a cloud file store)."
    ]


def test_checkpoint_storage_missing() -> None:
    resources = stack()
    resources[0][2]["spec"]["template"]["spec"]["volumes"] = []
    assert run_stack(pool_rules.validate_checkpoint_storage_rwx, resources) == [
        "NodeSet 'lab-h100' mounts no shared volume. A requeued job resumes on other nodes and must find its "
        "checkpoint there. Fix: mount the ReadWriteMany claim of fleetheal.infra.storage.SharedStorage in the "
        "NodeSet's pod template."
    ]


# -- the pack as a whole -------------------------------------------------------------------------


def test_pack_names_descriptions_and_config_schemas() -> None:
    pols = policy.policies()
    names = [p.name for p in pols]
    assert len(names) == len(set(names)) == 19
    for p in pols:
        assert p.name == p.name.lower() and " " not in p.name and "_" not in p.name
        assert p.description.endswith(".") and p.description.count(". ") == 0
    assert shared.config_defaults(pool_rules.STANDBY_SCHEMA) == {"standbyMinNodes": 1, "standbySharePercent": 5}
    assert shared.config_defaults(remediator_rules.PRODUCTION_SCHEMA) == {"productionMinReplicas": 2}
    assert shared.config_defaults(pool_rules.FAILURE_DOMAIN_SCHEMA) == {"standbyMinFailureDomains": 1}
    assert pool_rules.FAILURE_DOMAIN_SCHEMA.properties["standbyMinFailureDomains"]["minimum"] == 1
    by_name = {p.name: p for p in pols}
    assert by_name["node-in-one-pool"].config_schema is None
    assert by_name["standby-failure-domains"].config_schema is pool_rules.FAILURE_DOMAIN_SCHEMA


def test_policies_readme_lists_every_rule() -> None:
    readme = (Path(__file__).resolve().parents[2] / "policies" / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")}
    assert rows == {p.name for p in policy.policies()}


@pytest.fixture(scope="module")
def example_graph() -> list[tuple[str, str, Props]]:
    cfg = config.from_values(project.stack_values("dev"))
    records = mocks.run(lambda: program.build(cfg))
    return [(r.type, r.name, r.inputs) for r in records if r.custom]


def test_whole_pack_passes_the_example_stack(example_graph: list[tuple[str, str, Props]]) -> None:
    assert len(example_graph) > 60
    assert policy.evaluate(example_graph) == []


def _mutate(
    graph: list[tuple[str, str, Props]], kind: str, name: str, fn: Callable[[Props], None]
) -> list[tuple[str, str, Props]]:
    out = copy.deepcopy(graph)
    hits = [p for _, _, p in out if p.get("kind") == kind and p["metadata"]["name"] == name]
    assert len(hits) == 1, (kind, name)
    fn(hits[0])
    return out


@pytest.mark.parametrize(
    ("kind", "name", "mutation", "expected_policy"),
    [
        ("Controller", "lab", lambda p: p["spec"].update(extraConf="JobRequeue=0\n"), "slurm-requeue-enabled"),
        (
            "PersistentVolumeClaim",
            "lab-shared",
            lambda p: p["spec"].update(accessModes=["ReadWriteOnce"]),
            "checkpoint-storage-rwx",
        ),
        (
            "DaemonSet",
            "fleetheal-agent",
            lambda p: p["spec"]["template"]["spec"].update(tolerations=[]),
            "gpu-nodesets-run-agent",
        ),
        (
            "DaemonSet",
            "fleetheal-agent",
            lambda p: p["spec"]["template"]["spec"]["containers"][0].update(resources={}),
            "agent-requests-and-limits",
        ),
        (
            "ConfigMap",
            "fleetheal-pool-h100",
            lambda p: p["data"].update({"gpu-h100-09": "active h100-fd0"}),
            "standby-pool-minimum",
        ),
        (
            "ConfigMap",
            "fleetheal-pool-a100",
            lambda p: p["data"].update({"gpu-h100-01": "active a100-fd0"}),
            "node-in-one-pool",
        ),
        (
            "ConfigMap",
            "fleetheal-pool-h100",
            lambda p: p["data"].update({"gpu-h100-01": "active"}),
            "node-in-one-pool",
        ),
        (
            "ConfigMap",
            "fleetheal-pool-h100",
            lambda p: p["metadata"]["labels"].update({contracts.LABEL_GPU_POOL: "h200"}),
            "node-in-one-pool",
        ),
        (
            "ClusterRole",
            "fleetheal-remediator",
            lambda p: p["rules"][0].update(resources=["*"]),
            "remediator-rbac-least-privilege",
        ),
        (
            "AlertmanagerConfig",
            "fleetheal-remediator",
            lambda p: p["spec"]["receivers"][0]["webhookConfigs"][0].pop("httpConfig"),
            "alertmanager-receiver-authenticated",
        ),
        (
            "Deployment",
            "fleetheal-remediator",
            lambda p: p["spec"]["template"]["spec"]["containers"][0].update(
                image="ghcr.io/fleetheal/remediator:latest"
            ),
            "images-pinned",
        ),
        (
            "Deployment",
            "fleetheal-remediator",
            lambda p: p["spec"].update(replicas=2),
            "remediator-replicas-need-shared-store",
        ),
        # Issue 46: the least-privilege rule read only the roles labelled as the remediator's.
        (
            "ClusterRoleBinding",
            "fleetheal-remediator",
            lambda p: p["roleRef"].update(name="cluster-admin"),
            "service-accounts-bound-to-own-roles",
        ),
        (
            "ClusterRoleBinding",
            "fleetheal-agent",
            lambda p: p["roleRef"].update(name="cluster-admin"),
            "service-accounts-bound-to-own-roles",
        ),
        (
            "NetworkPolicy",
            "fleetheal-remediator",
            lambda p: p["spec"]["ingress"][0].pop("from"),
            "workloads-behind-network-policy",
        ),
        (
            "NetworkPolicy",
            "fleetheal-agent",
            lambda p: p["spec"]["podSelector"]["matchLabels"].update({"app.kubernetes.io/name": "other"}),
            "workloads-behind-network-policy",
        ),
        # Issue 47: Kueue's flavour selected active nodes, whose GPUs slurmd's NodeSet requests, every one.
        (
            "ResourceFlavor",
            "lab-h100",
            lambda p: p["spec"]["nodeLabels"].update({contracts.LABEL_POOL: "active"}),
            "kueue-quotas-schedulable",
        ),
        (
            "ResourceFlavor",
            "lab-h100",
            lambda p: p["spec"].update(tolerations=p["spec"]["tolerations"][:1]),
            "kueue-quotas-schedulable",
        ),
        (
            "ClusterQueue",
            "lab-small",
            lambda p: next(f for f in p["spec"]["resourceGroups"][0]["flavors"] if f["name"] == "lab-h100").update(
                name="lab-h200"
            ),
            "kueue-quotas-schedulable",
        ),
    ],
)
def test_whole_pack_fails_each_mutated_example_stack(
    example_graph: list[tuple[str, str, Props]],
    kind: str,
    name: str,
    mutation: Callable[[Props], None],
    expected_policy: str,
) -> None:
    violations = policy.evaluate(_mutate(example_graph, kind, name, mutation))
    assert {p for p, _ in violations} == {expected_policy}, violations


def test_whole_pack_fails_the_example_stack_marked_production(example_graph: list[tuple[str, str, Props]]) -> None:
    graph = _mutate(
        example_graph,
        "Namespace",
        "fleetheal-system",
        lambda p: p["metadata"]["labels"].update({"fleetheal.io/environment": "production"}),
    )
    violations = policy.evaluate(graph)
    assert {p for p, _ in violations} == {"production-remediator-shared-store", "production-remediator-replicas"}


@pytest.mark.parametrize(
    "overrides",
    [
        {"slinkyMode": "helm"},
        {"environment": "production", "remediatorReplicas": 2, "remediatorStore": "postgres"},
        {
            "environment": "production",
            "remediatorReplicas": 3,
            "remediatorStore": "postgres-in-cluster",
            "remediatorDbPassword": "test-password-0123456789",
        },
        {
            "nodeProvider": "eks",
            "eksClusterName": "prod",
            "eksNodeRoleArn": "arn:aws:iam::1:role/n",
            "eksSubnetIds": ["subnet-1"],
            "gpuPools": [
                {"name": "p5", "gpuType": "h100", "gpusPerNode": 8, "nodes": 64, "instanceType": "p5.48xlarge"}
            ],
        },
    ],
)
def test_whole_pack_passes_the_other_modes(overrides: Props) -> None:
    cfg = config.from_values({**project.stack_values("dev"), **overrides})
    records = mocks.run(lambda: program.build(cfg))
    graph = [(r.type, r.name, r.inputs) for r in records if r.custom]
    assert policy.evaluate(graph) == []
    # and the standby rule sees the cloud node groups / the requeue rule the Helm values
    assert policy.evaluate(graph, {"standby-pool-minimum": {"standbyMinNodes": 100}})


def test_whole_pack_standby_failure_domains_from_pack_config(example_graph: list[tuple[str, str, Props]]) -> None:
    cfg = {"standby-failure-domains": {"standbyMinFailureDomains": 2}}
    assert policy.evaluate(example_graph, cfg) == []  # one standby node per pool: one domain is all it can span
    graph = _mutate(
        example_graph,
        "ConfigMap",
        "fleetheal-pool-h100",
        lambda p: p["data"].update({"gpu-h100-10": "standby h100-fd0"}),
    )
    assert policy.evaluate(graph) == []
    violations = policy.evaluate(graph, cfg)
    assert [p for p, _ in violations] == ["standby-failure-domains"]
    assert violations[0][1].startswith(
        "GPU pool 'h100' has its 2 warm-standby node(s) in 1 failure domain(s) [h100-fd0 (2)]; they must span at "
        "least 2 (standbyMinFailureDomains=2,"
    )


def test_a_kueue_quota_on_slurmds_nodes_is_refused_with_the_reason(
    example_graph: list[tuple[str, str, Props]],
) -> None:
    """The contradiction issue 47 found on main: Kueue's flavour on active nodes, where slurmd takes every GPU."""
    graph = _mutate(
        example_graph,
        "ResourceFlavor",
        "lab-h100",
        lambda p: p["spec"]["nodeLabels"].update({contracts.LABEL_POOL: "active"}),
    )
    messages = sorted(m for p, m in policy.evaluate(graph) if p == "kueue-quotas-schedulable")
    assert messages == [
        f"ClusterQueue '{cq}' gives {gpus} nvidia.com/gpu on ResourceFlavor 'lab-h100', whose nodes are "
        f"{contracts.LABEL_POOL}=active. A pod Kueue admits there is never scheduled: the slurmd NodeSet's pods "
        "request every GPU of an active node, and standby nodes are the reserve that replaces failed ones. Fix: "
        f"select {contracts.LABEL_POOL}: lent (the nodes GPU pools lend, gpuPools[].lendMaxPercent) and tolerate "
        "their taint, as KueueQueues renders it."
        for cq, gpus in (("lab-large", 12), ("lab-small", 4))
    ]
    # A flavour with no quota (a100 lends nothing) is never refused, wherever it points.
    graph = _mutate(example_graph, "ResourceFlavor", "lab-a100", lambda p: p["spec"].update(nodeLabels={}))
    assert policy.evaluate(graph) == []
