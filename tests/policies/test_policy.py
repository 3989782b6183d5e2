"""The CrossGuard rules, called directly: one valid factory per rule, one mutation per negative test,
the exact message asserted; then the whole pack over the mocked resource graph of the example stack.

policies/__main__.py is never imported: constructing a PolicyPack starts a server and blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from pulumi_policy import ResourceValidationArgs, StackValidationArgs

from fleetheal import contracts
from fleetheal.infra import agent, config, mocks, policy, program
from fleetheal.infra.remediator import remediator_config

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


def node(name: str, role: str, pool: str = "h100") -> Props:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {contracts.LABEL_POOL: role, contracts.LABEL_GPU_POOL: pool}},
    }


def stack(active: int = 4, standby: int = 1) -> list[tuple[str, str, Props]]:
    out = [
        ("kubernetes:slinky.slurm.net/v1beta1:NodeSet", "ns", nodeset()),
        ("kubernetes:apps/v1:DaemonSet", "agent", agent_daemonset()),
        ("kubernetes:core/v1:PersistentVolumeClaim", "pvc", shared_claim()),
    ]
    out += [("kubernetes:core/v1:NodePatch", f"a{i}", node(f"a{i}", "active")) for i in range(active)]
    out += [("kubernetes:core/v1:NodePatch", f"s{i}", node(f"s{i}", "standby")) for i in range(standby)]
    return out


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
    assert run_resource(policy.validate_slurm_requeue, controller()) == []


@pytest.mark.parametrize(("conf", "shown"), [("KillWait=120\n", "unset"), ("JobRequeue=1\nJobRequeue=0\n", "0")])
def test_requeue_off(conf: str, shown: str) -> None:
    props = controller()
    props["spec"]["extraConf"] = conf
    assert run_resource(policy.validate_slurm_requeue, props) == [
        f"Controller 'lab': Slurm job requeue is off (JobRequeue={shown}). {REQUEUE_FIX}"
    ]


def test_requeue_off_in_a_helm_release() -> None:
    props = {
        "name": "slurm",
        "chart": "oci://ghcr.io/slinkyproject/charts/slurm",
        "values": {"controller": {"extraConf": "KillWait=30"}},
    }
    assert run_resource(policy.validate_slurm_requeue, props, type_=policy.HELM_RELEASE) == [
        f"Helm release 'slurm': Slurm job requeue is off (JobRequeue=unset). {REQUEUE_FIX}"
    ]


def test_images_pinned_valid() -> None:
    assert run_resource(policy.validate_images_pinned, agent_daemonset()) == []
    assert run_resource(policy.validate_images_pinned, nodeset()) == []


@pytest.mark.parametrize("image", ["r/agent:latest", "r/agent"])
def test_image_not_pinned(image: str) -> None:
    props = agent_daemonset()
    props["spec"]["template"]["spec"]["containers"][0]["image"] = image
    assert run_resource(policy.validate_images_pinned, props, name="agent-ds") == [
        f"agent-ds: image '{image}' at spec.template.spec.containers[0].image is not pinned. 'latest' or a missing "
        "tag changes under you: two GPU nodes can run different agents or slurmd builds and a rollback cannot "
        "restore the old one. Fix: use REPOSITORY:TAG with a release tag, or REPOSITORY@sha256:DIGEST."
    ]


def test_helm_image_without_tag_is_not_pinned() -> None:
    props = {"values": {"controller": {"logfile": {"image": {"repository": "docker.io/library/alpine", "tag": None}}}}}
    (msg,) = run_resource(policy.validate_images_pinned, props, type_=policy.HELM_RELEASE, name="slurm")
    assert msg.startswith("slurm: image 'docker.io/library/alpine:' at values.controller.logfile.image is not pinned.")


def test_agent_resources_valid() -> None:
    assert run_resource(policy.validate_agent_resources, agent_daemonset()) == []


def test_agent_without_memory_limit() -> None:
    props = agent_daemonset()
    del props["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert run_resource(policy.validate_agent_resources, props) == [
        "DaemonSet 'fleetheal-agent' container 'agent' has no limits.memory. The agent runs on every GPU node next "
        "to training jobs: without requests it is evicted first under pressure (and stops detecting faults), "
        "without limits a leak starves the job. Fix: set resources.requests and resources.limits for cpu and memory."
    ]


def test_agent_resources_ignores_other_daemonsets() -> None:
    props = agent_daemonset()
    props["metadata"]["name"] = "dcgm-exporter"
    props["spec"]["template"]["spec"]["containers"][0]["resources"] = {}
    assert run_resource(policy.validate_agent_resources, props) == []
    assert run_resource(policy.validate_agent_resources, props, cfg={"agentDaemonSet": "dcgm-exporter"}) != []


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
    assert run_resource(policy.validate_remediator_rbac, remediator_clusterrole()) == []
    assert run_resource(policy.validate_remediator_rbac, remediator_token_role()) == []


def test_remediator_rbac_wildcard_verb() -> None:
    props = remediator_clusterrole()
    props["rules"][0]["verbs"] = ["*"]
    assert run_resource(policy.validate_remediator_rbac, props) == [
        "ClusterRole 'fleetheal-remediator' " + RBAC_WILDCARD.format(i=0, field="verbs")
    ]


def test_remediator_rbac_cluster_wide_secrets() -> None:
    props = remediator_clusterrole()
    props["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]})
    assert run_resource(policy.validate_remediator_rbac, props) == [
        "ClusterRole 'fleetheal-remediator' " + RBAC_SECRETS.format(i=2)
    ]


def test_remediator_rbac_someone_elses_secret() -> None:
    props = remediator_token_role()
    props["rules"][0]["resourceNames"].append("slurm-auth-jwt")
    assert run_resource(policy.validate_remediator_rbac, props) == [
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
    assert run_stack(policy.validate_remediator_replicas_shared_store, remediator_stack(replicas=3)) == []
    one = remediator_stack(replicas=1, store=SQLITE)
    assert run_stack(policy.validate_remediator_replicas_shared_store, one) == []


def test_remediator_replicas_on_sqlite() -> None:
    resources = remediator_stack(replicas=2, store=SQLITE)
    assert run_stack(policy.validate_remediator_replicas_shared_store, resources) == [
        "Deployment 'fleetheal-remediator' runs 2 remediator replicas on the embedded SQLite store (its config sets "
        "no store.url_file). " + REPLICAS_FIX
    ]


def test_remediator_replicas_without_leader_election() -> None:
    resources = _with_config(remediator_stack(replicas=2), lambda c: c["leader_election"].update(enabled=False))
    assert run_stack(policy.validate_remediator_replicas_shared_store, resources) == [
        "Deployment 'fleetheal-remediator' runs 2 remediator replicas without leader election (its config does not "
        "set leader_election.enabled: true). " + REPLICAS_FIX
    ]


def test_remediator_replicas_without_its_config_in_the_stack() -> None:
    resources = [r for r in remediator_stack(replicas=2) if r[2]["kind"] != "ConfigMap"]
    (msg,) = run_stack(policy.validate_remediator_replicas_shared_store, resources)
    assert msg.startswith("Deployment 'fleetheal-remediator' runs 2 remediator replicas on the embedded SQLite store")


def test_production_remediator_store_valid() -> None:
    assert run_stack(policy.validate_production_remediator_shared_store, remediator_stack()) == []
    # SQLite is fine outside production
    dev = remediator_stack(replicas=1, environment="development", store=SQLITE)
    assert run_stack(policy.validate_production_remediator_shared_store, dev) == []


def test_production_remediator_on_sqlite() -> None:
    resources = remediator_stack(replicas=1, store=SQLITE)
    assert run_stack(policy.validate_production_remediator_shared_store, resources) == [
        f"Deployment 'fleetheal-remediator' runs {PRODUCTION} with its incident store in SQLite on one pod's volume "
        "(its config sets no store.url_file). When that node fails, remediation stops until the pod and its "
        "ReadWriteOnce volume are back (a volume on a lost node may never be), and SQLite lets no second replica "
        "take over. Fix: set fleetheal:remediatorStore to postgres (the URI in the Secret "
        "fleetheal:remediatorStoreSecret names) or postgres-in-cluster (with fleetheal:remediatorDbPassword set as a "
        "secret), and fleetheal:remediatorReplicas to 2 or more."
    ]


def test_production_remediator_replicas_valid() -> None:
    assert run_stack(policy.validate_production_remediator_replicas, remediator_stack(replicas=2)) == []
    dev = remediator_stack(replicas=1, environment="staging")
    assert run_stack(policy.validate_production_remediator_replicas, dev) == []


def test_production_remediator_with_one_replica() -> None:
    assert run_stack(policy.validate_production_remediator_replicas, remediator_stack(replicas=1)) == [
        f"Deployment 'fleetheal-remediator' runs 1 remediator replica(s) {PRODUCTION}; it needs at least 2 "
        "(productionMinReplicas). With fewer, losing or draining one node stops remediation: no GPU fault is handled "
        "until the pod is back. Fix: set fleetheal:remediatorReplicas to 2 or more (with fleetheal:remediatorStore "
        "postgres or postgres-in-cluster); the replicas run on different nodes."
    ]


def test_production_replicas_threshold_comes_from_pack_config() -> None:
    (msg,) = run_stack(
        policy.validate_production_remediator_replicas, remediator_stack(replicas=2), cfg={"productionMinReplicas": 3}
    )
    assert msg.startswith(
        f"Deployment 'fleetheal-remediator' runs 2 remediator replica(s) {PRODUCTION}; it needs at least 3"
    )


def test_alertmanager_receiver_valid() -> None:
    assert run_resource(policy.validate_alertmanager_receiver_authenticated, am_config()) == []


def test_alertmanager_receiver_without_credentials() -> None:
    props = am_config()
    del props["spec"]["receivers"][0]["webhookConfigs"][0]["httpConfig"]
    assert run_resource(policy.validate_alertmanager_receiver_authenticated, props) == [
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
    assert run_stack(policy.validate_gpu_nodesets_run_agent, stack()) == []


def test_gpu_nodeset_without_agent() -> None:
    resources = [r for r in stack() if r[2]["kind"] != "DaemonSet"]
    assert run_stack(policy.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: there is no 'fleetheal-agent' "
        "DaemonSet in the stack. " + AGENT_FIX
    ]


def test_gpu_nodeset_outside_the_agent_affinity() -> None:
    resources = stack()
    ds = resources[1][2]
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] = ["standby"]
    selector = {contracts.LABEL_POOL: "active", contracts.LABEL_GPU_POOL: "h100"}
    assert run_stack(policy.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: the agent's node selection does "
        f"not match the NodeSet's nodeSelector {selector}. " + AGENT_FIX
    ]


def test_gpu_nodeset_tolerates_a_taint_the_agent_does_not() -> None:
    resources = stack()
    resources[0][2]["spec"]["template"]["spec"]["tolerations"].append(
        {"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}
    )
    assert run_stack(policy.validate_gpu_nodesets_run_agent, resources) == [
        "NodeSet 'lab-h100' runs slurmd on GPU nodes without the fleetheal agent: the agent does not tolerate the "
        "taint 'example.com/maintenance' the NodeSet tolerates. " + AGENT_FIX
    ]


def test_standby_minimum_valid() -> None:
    assert run_stack(policy.validate_standby_minimum, stack(active=20, standby=1)) == []


def test_standby_below_minimum() -> None:
    assert run_stack(policy.validate_standby_minimum, stack(active=40, standby=1)) == [
        "GPU pool 'h100' has 1 warm-standby node(s); it needs 2 (standbyMinNodes=1, standbySharePercent=5 of 40 "
        "active nodes). Without spare validated nodes a failed node cannot be replaced in minutes and the job waits "
        "for a repair. Fix: add nodes labelled fleetheal.io/pool=standby for this pool "
        "(gpuPools[].standbyNodeNames, or raise the standby node group's size)."
    ]


def test_standby_threshold_comes_from_pack_config() -> None:
    (msg,) = run_stack(policy.validate_standby_minimum, stack(active=4, standby=1), cfg={"standbyMinNodes": 3})
    assert msg.startswith("GPU pool 'h100' has 1 warm-standby node(s); it needs 3 (standbyMinNodes=3,")


def test_standby_counts_managed_node_groups() -> None:
    groups = [
        (
            policy.EKS_NODE_GROUP,
            f"p5-{role}",
            {
                "labels": {contracts.LABEL_POOL: role, contracts.LABEL_GPU_POOL: "p5"},
                "scalingConfig": {"desiredSize": size},
            },
        )
        for role, size in (("active", 64), ("standby", 4))
    ]
    assert run_stack(policy.validate_standby_minimum, groups) == []
    (msg,) = run_stack(policy.validate_standby_minimum, groups, cfg={"standbySharePercent": 10})
    assert msg.startswith("GPU pool 'p5' has 4 warm-standby node(s); it needs 7 ")


def test_checkpoint_storage_valid() -> None:
    assert run_stack(policy.validate_checkpoint_storage_rwx, stack()) == []


def test_checkpoint_storage_read_write_once() -> None:
    resources = stack()
    resources[2] = (resources[2][0], resources[2][1], shared_claim(["ReadWriteOnce"]))
    assert run_stack(policy.validate_checkpoint_storage_rwx, resources) == [
        "PersistentVolumeClaim 'lab-shared' used by NodeSet 'lab-h100' for checkpoints has access modes "
        "['ReadWriteOnce'], not ReadWriteMany. A job requeued onto other nodes could not read its checkpoint, so "
        "relocation would restart training from scratch. Fix: set accessModes to [ReadWriteMany] with a "
        "StorageClass that supports it (NFS, Lustre CSI, a cloud file store)."
    ]


def test_checkpoint_storage_missing() -> None:
    resources = stack()
    resources[0][2]["spec"]["template"]["spec"]["volumes"] = []
    assert run_stack(policy.validate_checkpoint_storage_rwx, resources) == [
        "NodeSet 'lab-h100' mounts no shared volume. A requeued job resumes on other nodes and must find its "
        "checkpoint there. Fix: mount the ReadWriteMany claim of fleetheal.infra.storage.SharedStorage in the "
        "NodeSet's pod template."
    ]


# -- the pack as a whole -------------------------------------------------------------------------


def test_pack_names_descriptions_and_config_schemas() -> None:
    pols = policy.policies()
    names = [p.name for p in pols]
    assert len(names) == len(set(names)) == 11
    for p in pols:
        assert p.name == p.name.lower() and " " not in p.name and "_" not in p.name
        assert p.description.endswith(".") and p.description.count(". ") == 0
    assert policy.config_defaults(policy.STANDBY_SCHEMA) == {"standbyMinNodes": 1, "standbySharePercent": 5}
    assert policy.config_defaults(policy.PRODUCTION_SCHEMA) == {"productionMinReplicas": 2}


@pytest.fixture(scope="module")
def example_graph() -> list[tuple[str, str, Props]]:
    cfg = config.from_values(config.stack_values("dev"))
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
            "Node",
            "gpu-h100-09",
            lambda p: p["metadata"]["labels"].update({contracts.LABEL_POOL: "active"}),
            "standby-pool-minimum",
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
    cfg = config.from_values({**config.stack_values("dev"), **overrides})
    records = mocks.run(lambda: program.build(cfg))
    graph = [(r.type, r.name, r.inputs) for r in records if r.custom]
    assert policy.evaluate(graph) == []
    # and the standby rule sees the cloud node groups / the requeue rule the Helm values
    assert policy.evaluate(graph, {"standby-pool-minimum": {"standbyMinNodes": 100}})
