"""Rules on GPU pools and their storage: each pool's warm-standby minimum and failure domains, every
node in exactly one pool's membership (read as the remediator's membership controller reads it), the
ReadWriteMany volume GPU NodeSets share for checkpoints, and Kueue's GPU quotas on nodes the pools lend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    PolicyConfigSchema,
    ReportViolation,
    StackValidationArgs,
)

from .shared import (
    EKS_NODE_GROUP,
    GPU,
    LABEL_GPU_POOL,
    LABEL_GPU_TYPE,
    LABEL_MEMBERSHIP,
    LABEL_POOL,
    MEMBER_ROLES,
    POOL_LENT,
    SLINKY,
    TAINT_LENT,
    _cfg,
    _kind,
    _labels,
    _name,
    parse_membership_entry,
)

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


KUEUE = "kueue.x-k8s.io/"


def _gpu_quota(flavor: Mapping[str, Any]) -> float:
    """The nvidia.com/gpu nominal quota of one ClusterQueue flavour entry (a number or a plain quantity string)."""
    total = 0.0
    for res in flavor.get("resources") or []:
        if res.get("name") == GPU:
            with contextlib.suppress(TypeError, ValueError):
                total += float(res.get("nominalQuota") or 0)
    return total


def validate_kueue_quotas_schedulable(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every GPU quota of a Kueue ClusterQueue is on a ResourceFlavor of lent nodes that tolerates their taint."""
    flavors = {
        _name(r.props): r.props.get("spec") or {}
        for r in args.resources
        if _kind(r.props)[0].startswith(KUEUE) and _kind(r.props)[1] == "ResourceFlavor"
    }
    for r in args.resources:
        if not (_kind(r.props)[0].startswith(KUEUE) and _kind(r.props)[1] == "ClusterQueue"):
            continue
        cq = _name(r.props)
        for group in (r.props.get("spec") or {}).get("resourceGroups") or []:
            for entry in group.get("flavors") or []:
                gpus, name = _gpu_quota(entry), str(entry.get("name", "?"))
                if gpus <= 0:
                    continue
                given = f"ClusterQueue '{cq}' gives {gpus:g} {GPU} on ResourceFlavor '{name}'"
                spec = flavors.get(name)
                if spec is None:
                    report(
                        f"{given}, which the stack does not declare. Kueue keeps the ClusterQueue inactive and admits "
                        "nothing. Fix: declare the flavour with fleetheal.infra.kueue.KueueQueues.",
                        r.urn,
                    )
                    continue
                pool = (spec.get("nodeLabels") or {}).get(LABEL_POOL)
                tolerated = any(
                    t.get("key") == TAINT_LENT and t.get("effect") in (None, "", "NoSchedule")
                    for t in spec.get("tolerations") or []
                )
                if pool != POOL_LENT:
                    where = f"{LABEL_POOL}={pool}" if pool else f"no {LABEL_POOL} label, so any GPU node"
                    report(
                        f"{given}, whose nodes are {where}. A pod Kueue admits there is never scheduled: the "
                        f"slurmd NodeSet's pods request every GPU of an active node, and standby nodes are the "
                        f"reserve that replaces failed ones. Fix: select {LABEL_POOL}: {POOL_LENT} (the nodes GPU "
                        "pools lend, gpuPools[].lendMaxPercent) and tolerate their taint, as KueueQueues renders it.",
                        r.urn,
                    )
                elif not tolerated:
                    report(
                        f"{given}, whose lent nodes carry the {TAINT_LENT}:NoSchedule taint the flavour does not "
                        "tolerate, so no admitted pod is ever scheduled there. Fix: add the toleration "
                        f"{{key: {TAINT_LENT}, operator: Exists, effect: NoSchedule}} to the flavour.",
                        r.urn,
                    )
