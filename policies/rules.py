"""fleetheal's CrossGuard rules: one validator function per rule, grouped by area.

This file is part of the policy pack (policies/), which runs and is published on its own: it imports
only the pack's requirements (policies/requirements.txt), never the fleetheal package. fleetheal reads
the same file as `fleetheal.infra.policy` (a link to it) for `fleetheal render --policy`, and tests
import it from there. `policies/__main__.py` only assembles these into a PolicyPack (constructing a
PolicyPack starts the analyzer server, so nothing imports that one). Thresholds come from each
policy's config schema; every violation says what is wrong, why it matters and how to fix it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

# The names fleetheal's parts agree on (fleetheal/contracts.py, fleetheal/infra/common.py). The pack runs
# without the fleetheal package, so it carries them; tests/policies/test_pack.py keeps them equal.
K8S_PREFIX = "fleetheal.io/"
LABEL_POOL = K8S_PREFIX + "pool"
LABEL_GPU_POOL = K8S_PREFIX + "gpu-pool"
LABEL_GPU_TYPE = K8S_PREFIX + "gpu-type"
LABEL_MEMBERSHIP = K8S_PREFIX + "membership"
LABEL_ENVIRONMENT = K8S_PREFIX + "environment"
MEMBER_ROLES = ("active", "standby")
PRODUCTION = "production"
#: On a federation member's Controller and Accounting (and the manager's federation ConfigMap): manager or worker.
LABEL_FEDERATION_ROLE = K8S_PREFIX + "federation-role"
#: The manager's ConfigMap holding the federation's `sacctmgr` script (app.kubernetes.io/component).
FEDERATION_COMPONENT = "federation"
FEDERATION_SCRIPT_KEY = "apply.sh"
#: The script's statements, one per line (fleetheal.infra.federation writes them, fleetheal.infra.drift reads them):
#: `cluster NAME FEATURES`, `qos NAME PRIORITY`, `grant ACCOUNT CLUSTER QOS|- DEFAULT_QOS|- [USER...]`,
#: `federation NAME CLUSTER...`.
FEDERATION_VERBS = ("cluster", "qos", "grant", "federation")
#: Slurm ClusterNames in a federation (fleetheal.fleet.config.NAME; slurmdbd prefixes its tables with them).
SLURM_CLUSTER_NAME = r"[a-z][a-z0-9-]{0,39}"

GPU = "nvidia.com/gpu"
SLINKY = "slinky.slurm.net/v1beta1"
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
COMPONENT_LABEL = "app.kubernetes.io/component"


def parse_membership_entry(entry: str) -> tuple[str, str]:
    """(role, failure domain) of a membership ConfigMap's value; ValueError names what is wrong."""
    parts = entry.split()
    if len(parts) != 2 or parts[0] not in MEMBER_ROLES:
        raise ValueError(f"{entry[:80]!r} is not '<active|standby> <failure domain>'")
    return parts[0], parts[1]


def image_is_pinned(image: str) -> bool:
    """True for REPO@sha256:DIGEST or REPO:TAG with a tag other than `latest`."""
    if "@sha256:" in image:
        return True
    name, sep, tag = image.rpartition(":")
    return bool(sep and name and tag and "/" not in tag and tag != "latest")


def _kind(props: Mapping[str, Any]) -> tuple[str, str]:
    return str(props.get("apiVersion", "")), str(props.get("kind", ""))


def _name(props: Mapping[str, Any]) -> str:
    return str((props.get("metadata") or {}).get("name", "?"))


def _labels(props: Mapping[str, Any]) -> Mapping[str, str]:
    return (props.get("metadata") or {}).get("labels") or {}


def config_defaults(schema: PolicyConfigSchema | None) -> dict[str, Any]:
    """The defaults a policy's config schema declares (what the engine applies when unset)."""
    if schema is None:
        return {}
    return {k: v["default"] for k, v in schema.properties.items() if "default" in v}


def _cfg(args: ResourceValidationArgs | StackValidationArgs, schema: PolicyConfigSchema) -> dict[str, Any]:
    return {**config_defaults(schema), **dict(args.get_config() or {})}


# ----------------------------------------------------------------------------------------------
# Slurm


def _slurm_conf_value(conf: str, key: str) -> str | None:
    """The last value of `key=` on any line of a slurm.conf fragment (Slurm: the last one wins)."""
    value = None
    for raw in conf.splitlines():
        for word in raw.split("#", 1)[0].split():
            k, sep, v = word.partition("=")
            if sep and k.lower() == key.lower():
                value = v
    return value


def validate_slurm_requeue(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Slurm requeue is on: the Controller's (or the slurm chart's) slurm.conf says JobRequeue=1."""
    props = args.props
    if _kind(props) == (SLINKY, "Controller"):
        conf, where = (props.get("spec") or {}).get("extraConf") or "", f"Controller '{_name(props)}'"
    elif args.resource_type == HELM_RELEASE and str(props.get("chart", "")).endswith("/slurm"):
        controller = (props.get("values") or {}).get("controller") or {}
        conf, where = controller.get("extraConf") or "", f"Helm release '{props.get('name', args.name)}'"
    else:
        return
    value = _slurm_conf_value(conf, "JobRequeue")
    if value != "1":
        report(
            f"{where}: Slurm job requeue is off (JobRequeue={value or 'unset'}). Without it a batch job on a "
            "failed or drained GPU node ends in NODE_FAIL instead of resuming from its checkpoint elsewhere. "
            "Fix: put 'JobRequeue=1' in spec.extraConf (fleetheal.infra.slurm_hooks.slurm_conf_lines does).",
            None,
        )


# ----------------------------------------------------------------------------------------------
# Images and the agent


def _images(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, image reference) for every `image` field: strings, and Helm {repository, tag, digest}."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            p = f"{path}.{k}" if path else str(k)
            if k == "image" and isinstance(v, str):
                yield p, v
            elif k == "image" and isinstance(v, Mapping) and "repository" in v:
                if v.get("digest"):
                    yield p, f"{v['repository']}@{v['digest']}"
                else:
                    yield p, f"{v['repository']}:{v.get('tag') or ''}"
            else:
                yield from _images(v, p)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _images(v, f"{path}[{i}]")


def validate_images_pinned(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Every container image is pinned to a tag other than `latest` or to a digest."""
    for path, image in _images(args.props):
        if not image_is_pinned(image):
            report(
                f"{args.name}: image '{image}' at {path} is not pinned. 'latest' or a missing tag changes under "
                "you: two GPU nodes can run different agents or slurmd builds and a rollback cannot restore the "
                "old one. Fix: use REPOSITORY:TAG with a release tag, or REPOSITORY@sha256:DIGEST.",
                None,
            )


AGENT_SCHEMA = PolicyConfigSchema(
    properties={
        "agentDaemonSet": {
            "type": "string",
            "default": "fleetheal-agent",
            "description": "Name of the node agent DaemonSet.",
        },
    }
)


def _pod_containers(pod_spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])


def validate_agent_resources(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """The node agent's containers set CPU and memory requests and limits."""
    props = args.props
    cfg = _cfg(args, AGENT_SCHEMA)
    if _kind(props) != ("apps/v1", "DaemonSet") or _name(props) != cfg["agentDaemonSet"]:
        return
    pod = ((props.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in _pod_containers(pod):
        res = c.get("resources") or {}
        missing = [
            f"{kind}.{r}"
            for kind in ("requests", "limits")
            for r in ("cpu", "memory")
            if not (res.get(kind) or {}).get(r)
        ]
        if missing:
            report(
                f"DaemonSet '{_name(props)}' container '{c.get('name')}' has no {', '.join(missing)}. The agent "
                "runs on every GPU node next to training jobs: without requests it is evicted first under "
                "pressure (and stops detecting faults), without limits a leak starves the job. "
                "Fix: set resources.requests and resources.limits for cpu and memory.",
                None,
            )


def _selector_matches(term: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for expr in term.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), list(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op in ("Gt", "Lt"):
            return False  # never true for the label sets compared here; be conservative
    return True


def pod_selects(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a pod spec (nodeSelector + required node affinity) accepts a node with `labels`."""
    for k, v in (pod.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(_selector_matches(t, labels) for t in terms)


def _tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("operator") == "Exists" and not t.get("key"):
            if not t.get("effect") or t.get("effect") == taint.get("effect"):
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if t.get("effect") and taint.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


def validate_gpu_nodesets_run_agent(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every GPU NodeSet's nodes also run the fleetheal node agent."""
    cfg = _cfg(args, AGENT_SCHEMA)
    agents = [
        r
        for r in args.resources
        if _kind(r.props) == ("apps/v1", "DaemonSet") and _name(r.props) == cfg["agentDaemonSet"]
    ]
    agent_pod = (((agents[0].props.get("spec") or {}).get("template") or {}).get("spec") or {}) if agents else None
    for r in args.resources:
        if _kind(r.props) != (SLINKY, "NodeSet"):
            continue
        spec = r.props.get("spec") or {}
        slurmd_res = (spec.get("slurmd") or {}).get("resources") or {}
        if not ((slurmd_res.get("limits") or {}).get(GPU) or (slurmd_res.get("requests") or {}).get(GPU)):
            continue
        pod = (spec.get("template") or {}).get("spec") or {}
        node_labels = dict(pod.get("nodeSelector") or {})
        problem = None
        if agent_pod is None:
            problem = f"there is no '{cfg['agentDaemonSet']}' DaemonSet in the stack"
        elif not pod_selects(agent_pod, node_labels):
            problem = f"the agent's node selection does not match the NodeSet's nodeSelector {node_labels}"
        else:
            for tol in pod.get("tolerations") or []:
                taint = {"key": tol.get("key"), "value": tol.get("value"), "effect": tol.get("effect") or "NoSchedule"}
                if tol.get("key") and not _tolerates(list(agent_pod.get("tolerations") or []), taint):
                    problem = f"the agent does not tolerate the taint '{tol.get('key')}' the NodeSet tolerates"
                    break
        if problem:
            report(
                f"NodeSet '{_name(r.props)}' runs slurmd on GPU nodes without the fleetheal agent: {problem}. "
                "A GPU fault on those nodes would go undetected, so the node is never drained and jobs keep "
                "landing on it. Fix: make the agent DaemonSet's node affinity cover the NodeSet's nodeSelector "
                "and tolerate its taints (fleetheal.infra.agent.node_affinity).",
                r.urn,
            )


# ----------------------------------------------------------------------------------------------
# Pools and storage

STANDBY_SCHEMA = PolicyConfigSchema(
    properties={
        "standbyMinNodes": {
            "type": "integer",
            "minimum": 1,
            "default": 1,
            "description": "Warm-standby nodes per GPU pool, at least.",
        },
        "standbySharePercent": {
            "type": "integer",
            "minimum": 0,
            "maximum": 100,
            "default": 5,
            "description": "Warm-standby nodes as a share of the pool's active nodes.",
        },
    }
)

FAILURE_DOMAIN_SCHEMA = PolicyConfigSchema(
    properties={
        "standbyMinFailureDomains": {
            "type": "integer",
            "minimum": 1,
            "default": 1,
            "description": "Distinct failure domains a GPU pool's warm-standby nodes span, at least.",
        },
    }
)

#: How many items (nodes, entries, domains) one violation message names before "and N more".
MAX_LISTED = 20


def _listed(items: list[str], total: int | None = None) -> str:
    """The first MAX_LISTED of `items`, comma-separated, then how many more (of `total`, default all)."""
    total = len(items) if total is None else total
    shown = ", ".join(items[:MAX_LISTED])
    more = total - min(len(items), MAX_LISTED)
    return f"{shown} and {more:,} more" if more > 0 else shown


@dataclasses.dataclass
class _PoolMembers:
    """One GPU pool as its membership ConfigMap(s) declare it."""

    configmaps: list[str] = dataclasses.field(default_factory=list)
    active: int = 0
    standby: int = 0
    #: failure domain -> its standby nodes, in the order listed
    standby_domains: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _BadEntries:
    """Nodes or entries a violation is about: how many, and the first MAX_LISTED of them."""

    total: int = 0
    shown: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Membership:
    """Everything the membership ConfigMaps of a stack declare, from one pass over their entries."""

    pools: dict[str, _PoolMembers] = dataclasses.field(default_factory=dict)
    #: sorted pools of a node listed more than once -> those nodes (the first MAX_LISTED) and their count
    shared: dict[tuple[str, ...], _BadEntries] = dataclasses.field(default_factory=dict)
    #: (ConfigMap, what is wrong with its labels, its entries)
    bad_labels: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    #: ConfigMap -> its malformed entries
    malformed: dict[str, _BadEntries] = dataclasses.field(default_factory=dict)


def _membership(args: StackValidationArgs) -> _Membership:
    """The pools of the stack's membership ConfigMaps (LABEL_MEMBERSHIP), as the remediator's
    membership controller reads them: a ConfigMap whose labels it ignores counts for no pool and a
    malformed entry for nothing (both are reported); a node listed in two pools counts in each as declared
    (and is reported, the controller applies it to neither). One pass, linear in the entries."""
    out = _Membership()
    first_pool: dict[str, str] = {}  # node -> the pool it was first listed in
    extra_pools: dict[str, list[str]] = {}  # node -> the pools it was listed in after that
    for r in args.resources:
        labels = _labels(r.props)
        if _kind(r.props) != ("v1", "ConfigMap") or LABEL_MEMBERSHIP not in labels:
            continue
        cm = _name(r.props)
        data = r.props.get("data") or {}
        pool = str(labels.get(LABEL_MEMBERSHIP) or "")
        gpu_pool = labels.get(LABEL_GPU_POOL)
        problem = ""
        if not pool:
            problem = f"its {LABEL_MEMBERSHIP} label is empty"
        elif gpu_pool != pool:
            problem = f"it is labelled {LABEL_MEMBERSHIP}={pool} but " + (
                f"{LABEL_GPU_POOL}={gpu_pool}" if gpu_pool else f"has no {LABEL_GPU_POOL} label"
            )
        elif not labels.get(LABEL_GPU_TYPE):
            problem = f"it has no {LABEL_GPU_TYPE} label"
        members = None
        if problem:
            out.bad_labels.append((cm, problem, len(data)))
        else:
            members = out.pools.setdefault(pool, _PoolMembers())
            members.configmaps.append(cm)
        for node, entry in data.items():
            text = entry if isinstance(entry, str) else str(entry)
            try:
                role, domain = parse_membership_entry(text)
            except ValueError:
                bad = out.malformed.setdefault(cm, _BadEntries())
                bad.total += 1
                if len(bad.shown) < MAX_LISTED:
                    bad.shown.append(f"{node}: {text[:80]!r}")
                continue
            if members is None:
                continue
            if role == "standby":
                members.standby += 1
                members.standby_domains[domain] = members.standby_domains.get(domain, 0) + 1
            else:
                members.active += 1
            if node not in first_pool:
                first_pool[node] = pool
            else:
                extra_pools.setdefault(node, []).append(pool)
    for node, pools in extra_pools.items():
        group = out.shared.setdefault(tuple(sorted([first_pool[node], *pools])), _BadEntries())
        group.total += 1
        if len(group.shown) < MAX_LISTED:
            group.shown.append(node)
    return out


def _pool_counts(args: StackValidationArgs) -> dict[str, dict[str, int]]:
    """gpu-pool -> {active, standby} node counts from membership ConfigMaps and managed node groups."""
    counts = {pool: {"active": m.active, "standby": m.standby} for pool, m in _membership(args).pools.items()}
    for r in args.resources:
        if r.resource_type != EKS_NODE_GROUP:
            continue
        labels = r.props.get("labels") or {}
        n = int((r.props.get("scalingConfig") or {}).get("desiredSize") or 0)
        pool, role = labels.get(LABEL_GPU_POOL), labels.get(LABEL_POOL)
        if pool and role in MEMBER_ROLES:
            counts.setdefault(pool, {"active": 0, "standby": 0})[role] += n
    return counts


def validate_standby_minimum(args: StackValidationArgs, report: ReportViolation) -> None:
    """Each GPU pool has its minimum of warm-standby nodes."""
    cfg = _cfg(args, STANDBY_SCHEMA)
    floor, share = int(cfg["standbyMinNodes"]), int(cfg["standbySharePercent"])
    for pool, c in sorted(_pool_counts(args).items()):
        need = max(1, floor, math.ceil(c["active"] * share / 100))
        if c["standby"] < need:
            report(
                f"GPU pool '{pool}' has {c['standby']} warm-standby node(s); it needs {need} "
                f"(standbyMinNodes={floor}, standbySharePercent={share} of {c['active']} active nodes). Without "
                "spare validated nodes a failed node cannot be replaced in minutes and the job waits for a "
                "repair. Fix: add warm-standby nodes to this pool (gpuPools[].standbyNodeNames, listed as 'standby' "
                "in its membership ConfigMap; or raise the standby node group's size).",
                None,
            )


def validate_node_in_one_pool(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every node is listed in one GPU pool's membership, in a well-formed entry."""
    m = _membership(args)
    for pools, nodes in sorted(m.shared.items()):
        names = [f"'{p}'" for p in pools]
        listed = ", ".join(names[:-1]) + " and " + names[-1]
        configmaps = sorted({cm for p in set(pools) for cm in m.pools[p].configmaps})
        report(
            f"{nodes.total:,} node(s) are listed in more than one GPU pool's membership, in pools {listed} "
            f"(ConfigMaps {', '.join(configmaps)}): {_listed(nodes.shown, nodes.total)}. The remediator's "
            "membership controller applies such a node to neither pool, so it gets no pool labels and no standby "
            "taint: it is neither scheduled as active nor held as a spare. Fix: list each node once, in one "
            "pool's gpuPools[].nodeNames or gpuPools[].standbyNodeNames.",
            None,
        )
    for cm, problem, entries in m.bad_labels:
        report(
            f"Membership ConfigMap '{cm}': {problem}. The remediator's membership controller ignores a membership "
            f"ConfigMap unless {LABEL_MEMBERSHIP} and {LABEL_GPU_POOL} both name its pool and "
            f"{LABEL_GPU_TYPE} is set, so none of its {entries:,} node(s) get their pool labels or standby "
            "taint. Fix: keep the labels fleetheal.infra.nodepools.ExistingNodesProvider sets (no transformation "
            f"may change them): {LABEL_MEMBERSHIP} and {LABEL_GPU_POOL} = the pool's name.",
            None,
        )
    for cm, bad in m.malformed.items():
        report(
            f"Membership ConfigMap '{cm}' has {bad.total:,} malformed entr{'y' if bad.total == 1 else 'ies'}: "
            f"{_listed(bad.shown, bad.total)}. Each entry must map a node name to '<active|standby> <failure "
            "domain>'; the remediator's membership controller skips any other, so that node gets no pool labels "
            "or standby taint. Fix: declare nodes through gpuPools[].nodeNames and gpuPools[].standbyNodeNames "
            "(fleetheal.infra.nodepools writes the entries with contracts.membership_entry), never by editing "
            "the ConfigMap.",
            None,
        )


def validate_standby_failure_domains(args: StackValidationArgs, report: ReportViolation) -> None:
    """Each GPU pool's warm-standby nodes span at least standbyMinFailureDomains failure domains."""
    want = int(_cfg(args, FAILURE_DOMAIN_SCHEMA)["standbyMinFailureDomains"])
    for pool, m in sorted(_membership(args).pools.items()):
        need = min(want, m.standby)
        found = m.standby_domains
        if len(found) >= need:
            continue
        domains = _listed([f"{d} ({n})" for d, n in found.items()])
        report(
            f"GPU pool '{pool}' has its {m.standby} warm-standby node(s) in {len(found)} failure domain(s) "
            f"[{domains}]; they must span at least {need} (standbyMinFailureDomains={want}, at most one per standby "
            "node). Spares in one rack or behind one leaf switch fail together: a single such failure would leave "
            "the pool short of spares right when it needs replacements. Fix: list gpuPools[].standbyNodeNames in "
            f"rack order with nodes from {need} or more racks, and set failureDomainSize to the nodes per rack "
            "(every failureDomainSize consecutive names share a failure domain); or lower standbyMinFailureDomains.",
            None,
        )


def validate_checkpoint_storage_rwx(args: StackValidationArgs, report: ReportViolation) -> None:
    """The volume GPU NodeSets share for checkpoints is ReadWriteMany."""
    claims = {
        (_name(r.props), (r.props.get("metadata") or {}).get("namespace")): r
        for r in args.resources
        if _kind(r.props) == ("v1", "PersistentVolumeClaim")
    }
    for r in args.resources:
        if _kind(r.props) != (SLINKY, "NodeSet"):
            continue
        ns = (r.props.get("metadata") or {}).get("namespace")
        pod = ((r.props.get("spec") or {}).get("template") or {}).get("spec") or {}
        volumes = pod.get("volumes") or []
        refs = [v["persistentVolumeClaim"]["claimName"] for v in volumes if v.get("persistentVolumeClaim")]
        if not refs:
            report(
                f"NodeSet '{_name(r.props)}' mounts no shared volume. A requeued job resumes on other nodes and "
                "must find its checkpoint there. Fix: mount the ReadWriteMany claim of fleetheal.infra.storage."
                "SharedStorage in the NodeSet's pod template.",
                r.urn,
            )
            continue
        for claim in refs:
            pvc = claims.get((claim, ns))
            modes = list((pvc.props.get("spec") or {}).get("accessModes") or []) if pvc else []
            if pvc is not None and "ReadWriteMany" not in modes:
                report(
                    f"PersistentVolumeClaim '{claim}' used by NodeSet '{_name(r.props)}' for checkpoints has access "
                    f"modes {modes}, not ReadWriteMany. A job requeued onto other nodes could not read its "
                    "checkpoint, so relocation would restart training from scratch. Fix: set accessModes to "
                    "[ReadWriteMany] with a StorageClass that supports it (NFS, Lustre CSI, a cloud file store).",
                    pvc.urn,
                )


# ----------------------------------------------------------------------------------------------
# Remediation

REMEDIATOR_SCHEMA = PolicyConfigSchema(
    properties={
        "remediatorSecrets": {
            "type": "array",
            "items": {"type": "string"},
            "default": ["fleetheal-remediator-token", "fleetheal-remediator-store"],
            "description": "The only Secrets the remediator may read (its own: its token, its store's URI).",
        },
    }
)


def validate_remediator_rbac(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """The remediator's RBAC has no wildcard and reads no Secret but its own."""
    props = args.props
    if _kind(props)[0] != "rbac.authorization.k8s.io/v1" or _kind(props)[1] not in ("ClusterRole", "Role"):
        return
    if _labels(props).get(COMPONENT_LABEL) != "remediator":
        return
    own = list(_cfg(args, REMEDIATOR_SCHEMA)["remediatorSecrets"])
    kind = _kind(props)[1]
    for i, rule in enumerate(props.get("rules") or []):
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            if "*" in (rule.get(field) or []):
                report(
                    f"{kind} '{_name(props)}' rule {i} grants '*' in {field}. The remediator drains nodes on "
                    "alerts; a wildcard lets a compromised or buggy remediator do anything else too. "
                    "Fix: list the exact apiGroups, resources and verbs it needs.",
                    None,
                )
        if "secrets" in (rule.get("resources") or []):
            names = list(rule.get("resourceNames") or [])
            extra = [n for n in names if n not in own]
            if kind == "ClusterRole" or not names or extra or set(rule.get("verbs") or []) - {"get"}:
                report(
                    f"{kind} '{_name(props)}' rule {i} lets the remediator read Secrets beyond its own "
                    f"({', '.join(own)}). Secrets hold Slurm, JWT and database keys that remediation never needs. "
                    "Fix: a namespaced Role with resources [secrets], verbs [get] and resourceNames set to the "
                    "remediator's own Secrets (its token, its store's URI).",
                    None,
                )


def validate_alertmanager_receiver_authenticated(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Every Alertmanager webhook receiver presents credentials from a Secret."""
    props = args.props
    if _kind(props)[1] != "AlertmanagerConfig" or not _kind(props)[0].startswith("monitoring.coreos.com/"):
        return
    for receiver in (props.get("spec") or {}).get("receivers") or []:
        for i, hook in enumerate(receiver.get("webhookConfigs") or []):
            http = hook.get("httpConfig") or {}
            auth = http.get("authorization") or {}
            ok = (
                bool((auth.get("credentials") or {}).get("name"))
                or bool(http.get("bearerTokenSecret"))
                or bool(((http.get("basicAuth") or {}).get("password") or {}).get("name"))
                or bool(http.get("oauth2"))
            )
            if not ok:
                report(
                    f"AlertmanagerConfig '{_name(props)}' receiver '{receiver.get('name')}' webhook {i} sends alerts "
                    "without credentials. Anyone who can reach the remediator could then make it drain nodes. "
                    "Fix: set httpConfig.authorization "
                    "{type: Bearer, credentials: {name: <token Secret>, key: token}}.",
                    None,
                )


@functools.lru_cache(maxsize=4)
def _remediator_yaml(text: str) -> Any:
    """remediator.yaml parsed once per evaluation, not once per rule (with 25,000 nodes listed it is ~1 MB),
    with libyaml where PyYAML has it; None when it is not YAML (the remediator refuses it too; here it
    counts as no shared store). Read only: the result is shared."""
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except yaml.YAMLError:
        return None


def _remediators(args: StackValidationArgs) -> list[tuple[Any, str, int, Mapping[str, Any]]]:
    """(resource, namespace, replicas, parsed remediator.yaml) of every remediator Deployment in the stack.

    The config is the remediator.yaml of the ConfigMaps its pods mount ({} when none is in the stack).
    """
    config_maps = {
        (str((r.props.get("metadata") or {}).get("namespace", "")), _name(r.props)): r.props
        for r in args.resources
        if _kind(r.props) == ("v1", "ConfigMap")
    }
    out = []
    for r in args.resources:
        if _kind(r.props) != ("apps/v1", "Deployment") or _labels(r.props).get(COMPONENT_LABEL) != "remediator":
            continue
        ns = str((r.props.get("metadata") or {}).get("namespace", ""))
        spec = r.props.get("spec") or {}
        pod = (spec.get("template") or {}).get("spec") or {}
        replicas = spec.get("replicas", 1)  # Kubernetes' default when it is left out
        if isinstance(replicas, bool) or not isinstance(replicas, int | float):
            continue  # not known yet (a preview): `up` checks it
        cfg: Mapping[str, Any] = {}
        for volume in pod.get("volumes") or []:
            cm = config_maps.get((ns, str((volume.get("configMap") or {}).get("name"))))
            text = ((cm or {}).get("data") or {}).get("remediator.yaml")
            doc = _remediator_yaml(text) if isinstance(text, str) else None
            if isinstance(doc, Mapping):
                cfg = doc
        out.append((r, ns, int(replicas), cfg))
    return out


def _shared_store(cfg: Mapping[str, Any]) -> bool:
    """The remediator keeps its incidents in PostgreSQL (store.url_file), not in SQLite on its pod's volume."""
    return bool((cfg.get("store") or {}).get("url_file"))


def _production_namespaces(args: StackValidationArgs) -> set[str]:
    return {
        _name(r.props)
        for r in args.resources
        if _kind(r.props) == ("v1", "Namespace") and _labels(r.props).get(LABEL_ENVIRONMENT) == PRODUCTION
    }


PRODUCTION_MARK = f"Namespace '{{ns}}' is labelled {LABEL_ENVIRONMENT}={PRODUCTION}, from fleetheal:environment"
REMEDIATOR_FIX_STORE = (
    "set fleetheal:remediatorStore to postgres (the URI in the Secret fleetheal:remediatorStoreSecret names) or "
    "postgres-in-cluster (with fleetheal:remediatorDbPassword set as a secret)"
)


def validate_remediator_replicas_shared_store(args: StackValidationArgs, report: ReportViolation) -> None:
    """More than one remediator replica only with a PostgreSQL store and leader election."""
    for r, _ns, replicas, cfg in _remediators(args):
        if replicas <= 1:
            continue
        if not _shared_store(cfg):
            problem = "on the embedded SQLite store (its config sets no store.url_file)"
        elif (cfg.get("leader_election") or {}).get("enabled") is not True:
            problem = "without leader election (its config does not set leader_election.enabled: true)"
        else:
            continue
        report(
            f"Deployment '{_name(r.props)}' runs {replicas} remediator replicas {problem}. SQLite cannot be shared "
            "between pods, and replicas that do not elect a leader each act on every alert: one fault drained, "
            f"requeued and replaced twice. Fix: {REMEDIATOR_FIX_STORE}, which also turns on leader election; "
            "or set fleetheal:remediatorReplicas to 1.",
            r.urn,
        )


def validate_production_remediator_shared_store(args: StackValidationArgs, report: ReportViolation) -> None:
    """A production remediator keeps its incidents in PostgreSQL, not on one pod's volume."""
    production = _production_namespaces(args)
    for r, ns, _replicas, cfg in _remediators(args):
        if ns in production and not _shared_store(cfg):
            report(
                f"Deployment '{_name(r.props)}' runs in production ({PRODUCTION_MARK.format(ns=ns)}) with its "
                "incident store in SQLite on one pod's volume (its config sets no store.url_file). When that node "
                "fails, remediation stops until the pod and its ReadWriteOnce volume are back (a volume on a lost "
                "node may never be), and SQLite lets no second replica take over. "
                f"Fix: {REMEDIATOR_FIX_STORE}, and fleetheal:remediatorReplicas to 2 or more.",
                r.urn,
            )


PRODUCTION_SCHEMA = PolicyConfigSchema(
    properties={
        "productionMinReplicas": {
            "type": "integer",
            "minimum": 2,
            "default": 2,
            "description": "Remediator replicas a production stack runs, at least.",
        },
    }
)


def validate_production_remediator_replicas(args: StackValidationArgs, report: ReportViolation) -> None:
    """A production remediator runs at least productionMinReplicas replicas."""
    need = int(_cfg(args, PRODUCTION_SCHEMA)["productionMinReplicas"])
    production = _production_namespaces(args)
    for r, ns, replicas, _config in _remediators(args):
        if ns in production and replicas < need:
            report(
                f"Deployment '{_name(r.props)}' runs {replicas} remediator replica(s) in production "
                f"({PRODUCTION_MARK.format(ns=ns)}); it needs at least {need} (productionMinReplicas). With fewer, "
                "losing or draining one node stops remediation: no GPU fault is handled until the pod is back. "
                f"Fix: set fleetheal:remediatorReplicas to {need} or more (with "
                "fleetheal:remediatorStore postgres or postgres-in-cluster); the replicas run on different nodes.",
                r.urn,
            )


# ----------------------------------------------------------------------------------------------
# Federation


def federation_statements(script: str) -> list[tuple[str, ...]]:
    """The statements of a federation script (FEDERATION_VERBS at the start of a line), in order."""
    out = []
    for line in script.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] in FEDERATION_VERBS:
            out.append(tuple(words))
    return out


def _federation_scripts(args: StackValidationArgs) -> list[tuple[Any, str]]:
    return [
        (r, str((r.props.get("data") or {}).get(FEDERATION_SCRIPT_KEY)))
        for r in args.resources
        if _kind(r.props) == ("v1", "ConfigMap")
        and _labels(r.props).get(COMPONENT_LABEL) == FEDERATION_COMPONENT
        and isinstance((r.props.get("data") or {}).get(FEDERATION_SCRIPT_KEY), str)
    ]


def validate_federation_cluster_names(args: StackValidationArgs, report: ReportViolation) -> None:
    """A federation's clusters have unique, valid Slurm cluster names, and every one is declared."""
    valid = re.compile(SLURM_CLUSTER_NAME)
    for r, script in _federation_scripts(args):
        statements = federation_statements(script)
        declared = [s[1] for s in statements if s[0] == "cluster" and len(s) > 1]
        problems = []
        repeated = sorted({c for c in declared if declared.count(c) > 1})
        if repeated:
            problems.append(f"cluster(s) {', '.join(repeated)} declared more than once")
        bad = [c for c in declared if not valid.fullmatch(c)]
        if bad:
            problems.append(f"invalid Slurm cluster name(s) {', '.join(repr(c) for c in bad)}")
        for s in statements:
            if s[0] == "federation":
                members = list(s[2:])
                twice = sorted({c for c in members if members.count(c) > 1})
                if twice:
                    problems.append(f"federation '{s[1]}' lists {', '.join(twice)} more than once")
                unknown = [c for c in members if c not in declared]
                if unknown:
                    problems.append(f"federation '{s[1]}' lists undeclared cluster(s) {', '.join(unknown)}")
            elif s[0] == "grant" and len(s) > 2 and s[2] not in declared:
                problems.append(f"account '{s[1]}' is granted on undeclared cluster '{s[2]}'")
        if problems:
            report(
                f"ConfigMap '{_name(r.props)}' (the federation's sacctmgr script): {'; '.join(problems)}. Slurm "
                "keys job records, associations and the federation's siblings by cluster name, and slurmdbd uses it "
                "as a table prefix: two stacks with one name would share (and corrupt) one cluster's records, and a "
                "job sent to an unknown sibling is lost. Fix: list each cluster once in fleetheal:federation.clusters "
                "with a name of lower-case letters, digits and '-', starting with a letter, at most 40 characters.",
                r.urn,
            )


def _accountings(args: StackValidationArgs) -> dict[tuple[str, str], Any]:
    return {
        (str((r.props.get("metadata") or {}).get("namespace", "")), _name(r.props)): r
        for r in args.resources
        if _kind(r.props) == (SLINKY, "Accounting")
    }


def validate_federation_worker_names_manager(args: StackValidationArgs, report: ReportViolation) -> None:
    """A federation worker's controller keeps its accounting in the manager's slurmdbd, named by host and port."""
    accountings = _accountings(args)
    for r in args.resources:
        if _kind(r.props) != (SLINKY, "Controller") or _labels(r.props).get(LABEL_FEDERATION_ROLE) != "worker":
            continue
        ns = str((r.props.get("metadata") or {}).get("namespace", ""))
        ref = str(((r.props.get("spec") or {}).get("accountingRef") or {}).get("name", ""))
        acct = accountings.get((ns, ref))
        spec = (acct.props.get("spec") or {}) if acct is not None else {}
        external = spec.get("externalConfig") or {}
        if acct is None:
            problem = f"its accountingRef '{ref}' names no Accounting in the stack"
        elif spec.get("external") is not True:
            problem = f"its Accounting '{ref}' runs a slurmdbd of its own (spec.external is not true)"
        elif not external.get("host") or not isinstance(external.get("port"), int) or not external.get("port"):
            problem = f"its Accounting '{ref}' names no manager (externalConfig needs host and port)"
        else:
            continue
        report(
            f"Controller '{_name(r.props)}' is a federation worker but {problem}. A worker that does not write to "
            "the manager's slurmdbd is no sibling: the federation never sends it jobs, its jobs are invisible to the "
            "others and its accounts and QOS are not the federation's. Fix: set fleetheal:federation.manager to the "
            "manager's slurmdbd as HOST:PORT (the Accounting becomes external with that host and port).",
            r.urn,
        )


DB_DATA_PATH = "/var/lib/mysql"


def validate_production_federation_database_persistent(args: StackValidationArgs, report: ReportViolation) -> None:
    """A production federation manager keeps slurmdbd's database on a persistent volume it retains."""
    production = _production_namespaces(args)
    statefulsets = {
        (str((r.props.get("metadata") or {}).get("namespace", "")), _name(r.props)): r
        for r in args.resources
        if _kind(r.props) == ("apps/v1", "StatefulSet")
    }
    for (ns, name), acct in _accountings(args).items():
        if ns not in production or _labels(acct.props).get(LABEL_FEDERATION_ROLE) != "manager":
            continue
        host = str(((acct.props.get("spec") or {}).get("storageConfig") or {}).get("host", ""))
        db = statefulsets.get((ns, host.split(".", 1)[0]))
        if db is None:
            continue  # a database outside the stack (fleetheal:accountingDatabase false): the operator's to keep
        spec = db.props.get("spec") or {}
        claims = {str((t.get("metadata") or {}).get("name")) for t in spec.get("volumeClaimTemplates") or []}
        pod = (spec.get("template") or {}).get("spec") or {}
        mounts = [m for c in _pod_containers(pod) for m in c.get("volumeMounts") or []]
        data = [m for m in mounts if str(m.get("mountPath", "")).rstrip("/") == DB_DATA_PATH]
        retention = (spec.get("persistentVolumeClaimRetentionPolicy") or {}).get("whenDeleted", "Retain")
        if not data or any(m.get("name") not in claims for m in data):
            problem = f"its data directory {DB_DATA_PATH} is not on a volumeClaimTemplate"
        elif retention != "Retain":
            problem = f"its volumes are deleted with it (persistentVolumeClaimRetentionPolicy.whenDeleted={retention})"
        else:
            continue
        report(
            f"StatefulSet '{_name(db.props)}' holds the database of the production federation's slurmdbd (Accounting "
            f"'{name}'; {PRODUCTION_MARK.format(ns=ns)}) but {problem}. That database is the federation itself: its "
            "clusters, accounts, QOS and every cluster's job history; losing it stops every sibling from "
            "accounting and scheduling across clusters. Fix: keep fleetheal.infra.accounting_db.AccountingDatabase "
            "(a claim template mounted at /var/lib/mysql, whenDeleted: Retain), or point "
            "fleetheal:accountingDbHost at a managed database with fleetheal:accountingDatabase false.",
            db.urn,
        )


# ----------------------------------------------------------------------------------------------
# The pack


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
