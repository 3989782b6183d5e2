"""`fleetheal fleet drift`'s comparison: what a job needs on each cluster of a federation, read from the
objects each member's stack renders, and where the members differ from one another and from the
manager's declaration (membership, accounts, QOS, GPU type, where slurmdbd is).

It reads objects only (fleetheal.infra.render.load_inputs renders stacks or reads rendered directories;
the command is in fleetheal.infra.cli), so it imports neither Pulumi nor the program.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from fleetheal.errors import UsageError
from fleetheal.infra.fleet_file import FLEET_CONFIGMAP, FLEET_FILE_KEY
from fleetheal.infra.policy import shared, slurm_rules
from fleetheal.infra.stack_model import BUILTIN_QOS

#: The categories the drift check compares, in the order it reports them.
CATEGORIES = (
    "account",
    "qos",
    "namespace",
    "secret",
    "agent",
    "alert rule",
    "partition",
    "slurm.conf",
    "fleet file",
)
#: Objects that belong to the manager's slurmdbd, not to what a job needs on its cluster.
_MANAGER_ONLY_COMPONENTS = ("accounting-db", "federation")
_SECRET_REF_KEYS = ("secretKeyRef", "slurmKeyRef", "jwtHs256KeyRef", "jwtKeyRef", "credentials", "bearerTokenSecret")
_PER_CLUSTER_CONF = ("Nodes",)  # partition fields that name the cluster's own nodes


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _meta(obj: Mapping[str, Any]) -> tuple[str, str]:
    md = obj.get("metadata") or {}
    return str(md.get("namespace") or ""), str(md.get("name") or "")


def _component(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component", ""))


def _secret_refs(node: Any, ns: str, out: set[str]) -> None:
    if isinstance(node, Mapping):
        for k, v in node.items():
            if k in _SECRET_REF_KEYS and isinstance(v, Mapping) and v.get("name"):
                out.add(f"{ns}/{v['name']}")
            elif k == "secretName" and isinstance(v, str):
                out.add(f"{ns}/{v}")
            elif k == "secret" and isinstance(v, Mapping) and isinstance(v.get("name"), str):
                out.add(f"{ns}/{v['name']}")  # a projected volume's source
            else:
                _secret_refs(v, ns, out)
    elif isinstance(node, list):
        for v in node:
            _secret_refs(v, ns, out)


def _conf_items(conf: str) -> dict[str, dict[str, str]]:
    """slurm.conf fragment -> {"partition": {name: settings}, "slurm.conf": {key: value}} (last one wins)."""
    partitions: dict[str, str] = {}
    keys: dict[str, str] = {}
    for raw in conf.splitlines():
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        k, _, v = words[0].partition("=")
        if k.lower() == "partitionname":
            rest = sorted(w for w in words[1:] if w.partition("=")[0] not in _PER_CLUSTER_CONF)
            partitions[v] = " ".join(rest)
        else:
            for w in words:
                wk, _, wv = w.partition("=")
                keys[wk] = wv
    return {"partition": partitions, "slurm.conf": keys}


@dataclass
class Member:
    """One stack's cluster, as its objects say."""

    source: str
    cluster: str
    role: str
    #: category -> item -> fingerprint ("" when presence is all that counts)
    needs: dict[str, dict[str, str]] = field(default_factory=dict)
    #: worker: HOST:PORT of the slurmdbd it writes to
    manager: str = ""
    #: GPU types of its NodeSets (from their Gres)
    gpu_types: set[str] = field(default_factory=set)


@dataclass
class Manager:
    """The federation as the manager's script declares it."""

    source: str
    name: str
    clusters: list[str]
    #: cluster -> account -> "users=...", and cluster -> (account, QOS) granted there
    accounts: dict[str, dict[str, str]]
    granted_qos: dict[str, set[tuple[str, str]]]
    #: QOS -> "priority=N"
    qos: dict[str, str]
    #: cluster -> GPU type, from the fleet file
    gpu_type: dict[str, str] = field(default_factory=dict)
    #: HOST:PORT the workers should write to ("" when the manager does not declare it)
    address: str = ""


def read_stack(source: str, objects: Iterable[Mapping[str, Any]]) -> tuple[Member | None, Manager | None]:
    """The member (a stack with a Slinky Controller) and, for the manager, the declared federation."""
    objs = list(objects)
    controllers = [o for o in objs if o.get("kind") == "Controller"]
    if len(controllers) != 1:
        return None, None
    ctrl = controllers[0]
    labels = (ctrl.get("metadata") or {}).get("labels") or {}
    role = str(labels.get(shared.LABEL_FEDERATION_ROLE, "none"))
    cluster = str((ctrl.get("spec") or {}).get("clusterName") or _meta(ctrl)[1])
    needs: dict[str, dict[str, str]] = {c: {} for c in CATEGORIES if c not in ("account", "qos")}
    manager_addr = ""
    gpu_types: set[str] = set()
    fleet_gpus: dict[str, str] = {}
    declared: Manager | None = None
    for o in objs:
        ns, name = _meta(o)
        kind = o.get("kind")
        if _component(o) in _MANAGER_ONLY_COMPONENTS:
            data = o.get("data") or {}
            if kind == "ConfigMap" and shared.FEDERATION_SCRIPT_KEY in data:
                declared = _read_manager(source, str(data[shared.FEDERATION_SCRIPT_KEY]), str(data.get("address", "")))
            continue
        if kind == "Accounting":
            spec = o.get("spec") or {}
            if spec.get("external"):
                ext = spec.get("externalConfig") or {}
                manager_addr = f"{ext.get('host', '')}:{ext.get('port', '')}"
            continue  # the manager's own slurmdbd is not something a job needs on every cluster
        if kind == "ConfigMap" and name == FLEET_CONFIGMAP and FLEET_FILE_KEY in (o.get("data") or {}):
            text = str(o["data"][FLEET_FILE_KEY])
            needs["fleet file"][FLEET_FILE_KEY] = _digest(yaml.safe_load(text) or {})
            fleet = yaml.safe_load(text) or {}
            fleet_gpus = {str(c): str((v or {}).get("gpu_type", "")) for c, v in (fleet.get("clusters") or {}).items()}
            continue
        if kind == "Namespace":
            needs["namespace"][name] = ""
        elif kind == "Secret":
            needs["secret"][f"{ns}/{name}"] = ""
        elif kind == "DaemonSet" and name == "fleetheal-agent":
            pod = ((o.get("spec") or {}).get("template") or {}).get("spec") or {}
            for c in pod.get("containers") or []:
                ports = sorted(int(p.get("containerPort", 0)) for p in c.get("ports") or [])
                needs["agent"][f"{name}/{c.get('name')}"] = f"image={c.get('image')} ports={ports}"
        elif kind == "PrometheusRule":
            selected = {k: v for k, v in ((o.get("metadata") or {}).get("labels") or {}).items()}
            needs["alert rule"][f"{name} (labels)"] = _digest(selected)
            for group in (o.get("spec") or {}).get("groups") or []:
                for rule in group.get("rules") or []:
                    key = rule.get("alert") or rule.get("record")
                    needs["alert rule"][str(key)] = _digest(rule)
        elif kind == "NodeSet":
            gres = str((o.get("spec") or {}).get("extraConf") or "")
            m = re.search(r"Gres=gpu:([^:\s]+):", gres)
            if m:
                gpu_types.add(m.group(1))
        if kind == "Controller":
            conf = _conf_items(str((o.get("spec") or {}).get("extraConf") or ""))
            needs["partition"].update(conf["partition"])
            needs["slurm.conf"].update(conf["slurm.conf"])
        refs: set[str] = set()
        _secret_refs(o.get("spec") or {}, ns, refs)
        if kind == "Secret":
            refs.discard(f"{ns}/{name}")
        for ref in refs:
            needs["secret"].setdefault(ref, "")
    if declared is not None:
        declared.gpu_type = fleet_gpus
    # Objects named after their cluster (`<cluster>-sssd-conf`) are the same need on every cluster.
    own = re.compile(rf"(^|/){re.escape(cluster)}-")
    needs = {cat: {own.sub(r"\1<cluster>-", k): v for k, v in items.items()} for cat, items in needs.items()}
    member = Member(source, cluster, role, needs, manager_addr, gpu_types)
    return member, declared


def _read_manager(source: str, text: str, address: str) -> Manager:
    name, clusters = "", []
    accounts: dict[str, dict[str, str]] = {}
    granted: dict[str, set[tuple[str, str]]] = {}
    qos: dict[str, str] = {}
    for s in slurm_rules.federation_statements(text):
        if s[0] == "cluster" and len(s) >= 2:
            accounts.setdefault(s[1], {})
            granted.setdefault(s[1], set())
        elif s[0] == "qos" and len(s) >= 2:
            qos[s[1]] = f"priority={s[2] if len(s) > 2 else '0'}"
        elif s[0] == "grant" and len(s) >= 5:
            account, cluster, q = s[1], s[2], s[3]
            accounts.setdefault(cluster, {})[account] = "users=" + ",".join(sorted(s[5:]))
            granted.setdefault(cluster, set()).update((account, x) for x in q.split(",") if x and x != "-")
        elif s[0] == "federation" and len(s) >= 2:
            name, clusters = s[1], list(s[2:])
    return Manager(source, name, clusters, accounts, granted, qos, address=address)


@dataclass(frozen=True)
class Finding:
    cluster: str
    category: str
    item: str
    problem: str

    def __str__(self) -> str:
        return f"{self.category} {self.item}: {self.problem}"


@dataclass
class Report:
    federation: str
    manager_source: str
    clusters: dict[str, str]  # cluster -> source ("" when no stack renders it)
    findings: list[Finding]

    @property
    def drift(self) -> bool:
        return bool(self.findings)

    def text(self) -> str:
        lines = [f"federation {self.federation}: {len(self.clusters)} cluster(s); manager stack {self.manager_source}"]
        for cluster, source in self.clusters.items():
            mine = [f for f in self.findings if f.cluster == cluster]
            where = f" (stack {source})" if source else ""
            lines.append(f"cluster {cluster}{where}: " + ("in step" if not mine else f"{len(mine)} difference(s)"))
            lines += [f"  {f}" for f in mine]
        hit = sorted({f.cluster for f in self.findings})
        lines.append(
            f"{len(self.findings)} difference(s) on {len(hit)} cluster(s)" if hit else "no drift: every cluster in step"
        )
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "federation": self.federation,
            "manager": self.manager_source,
            "clusters": [{"cluster": c, "stack": s} for c, s in self.clusters.items()],
            "drift": self.drift,
            "findings": [f.__dict__ for f in self.findings],
        }


def _names(clusters: Iterable[str]) -> str:
    return ", ".join(clusters)


def compare(stacks: Sequence[tuple[str, list[dict[str, Any]]]]) -> Report:
    """Per cluster, what a job needs that is missing or differs from the other clusters (and from the
    manager's declaration: membership, accounts, QOS, GPU type, where slurmdbd is)."""
    members: dict[str, Member] = {}
    managers: list[Manager] = []
    for source, objs in stacks:
        member, declared = read_stack(source, objs)
        if member is None or member.role == "none":
            raise UsageError(f"{source}: not a federation member's stack (no Controller with a federation role)")
        if member.cluster in members:
            raise UsageError(
                f"{source}: cluster {member.cluster!r} is also rendered by {members[member.cluster].source}; "
                "give each cluster's stack once"
            )
        members[member.cluster] = member
        if declared is not None:
            managers.append(declared)
    if len(managers) != 1:
        found = _names(m.source for m in managers) or "none"
        raise UsageError(f"give exactly one manager stack (role manager) among the inputs; found: {found}")
    mgr = managers[0]
    manager_member = next(m for m in members.values() if m.source == mgr.source)
    findings: list[Finding] = []

    order = list(dict.fromkeys([*mgr.clusters, *members]))
    for cluster in order:
        if cluster not in members:
            findings.append(Finding(cluster, "stack", "-", "declared in the federation, but no stack renders it"))
        elif cluster not in mgr.clusters:
            findings.append(
                Finding(
                    cluster,
                    "federation",
                    mgr.name,
                    f"not a member (the manager declares {_names(mgr.clusters)}): no accounts, QOS or siblings",
                )
            )

    # accounts and QOS: every cluster needs all of them (a job must be able to run anywhere)
    accounts_by_cluster = {c: mgr.accounts.get(c, {}) for c in mgr.clusters}
    users_of: dict[str, Counter[str]] = {}
    for per in accounts_by_cluster.values():
        for account, users in per.items():
            users_of.setdefault(account, Counter())[users] += 1
    all_grants: set[tuple[str, str]] = set().union(*(mgr.granted_qos.get(c, set()) for c in mgr.clusters))
    for cluster in mgr.clusters:
        have = accounts_by_cluster[cluster]
        for account, counts in sorted(users_of.items()):
            elsewhere = [c for c in mgr.clusters if account in accounts_by_cluster[c] and c != cluster]
            usual = counts.most_common(1)[0][0]
            if account not in have:
                findings.append(Finding(cluster, "account", account, f"missing (granted on {_names(elsewhere)})"))
            elif have[account] != usual:
                findings.append(Finding(cluster, "account", account, f"differs: {have[account]} vs {usual}"))
        mine = mgr.granted_qos.get(cluster, set())
        for account, q in sorted(all_grants - mine):
            if account not in have:
                continue  # said above: the whole account is missing
            elsewhere = [c for c in mgr.clusters if (account, q) in mgr.granted_qos.get(c, set())]
            findings.append(
                Finding(cluster, "qos", q, f"missing for account {account} (granted on {_names(elsewhere)})")
            )
        for q in sorted({q for _, q in mine} - set(mgr.qos) - set(BUILTIN_QOS)):
            findings.append(Finding(cluster, "qos", q, "granted but never created (no `qos` statement)"))

    # the objects every cluster renders from the same program: compare each item with the most common value
    for category in CATEGORIES[2:]:
        items = sorted({i for m in members.values() for i in m.needs.get(category, {})})
        for item in items:
            values = {c: m.needs.get(category, {}).get(item) for c, m in members.items()}
            present = Counter(v for v in values.values() if v is not None)
            if not present:
                continue
            top = max(present.values())
            leaders = [v for v, n in present.items() if n == top]
            managers_value = manager_member.needs.get(category, {}).get(item)
            reference = managers_value if managers_value in leaders else sorted(leaders)[0]
            agree = sorted((c for c, v in values.items() if v == reference), key=order.index)
            for cluster, value in values.items():
                if value is None:
                    findings.append(Finding(cluster, category, item, f"missing (present on {_names(agree)})"))
                elif value != reference:
                    shown = f"{value or '(set)'} vs {reference or '(set)'}"
                    findings.append(Finding(cluster, category, item, f"differs from {_names(agree)}: {shown}"))

    # workers: where their accounting goes, and their GPUs against the declaration
    addresses = Counter(m.manager for m in members.values() if m.role == "worker")
    want_addr = mgr.address or (addresses.most_common(1)[0][0] if addresses else "")
    whose = "the manager declares" if mgr.address else "the other workers use"
    for cluster, m in members.items():
        if m.role == "worker" and m.manager != want_addr:
            findings.append(Finding(cluster, "accounting", "slurmdbd", f"writes to {m.manager}; {whose} {want_addr}"))
        declared_gpu = mgr.gpu_type.get(cluster)
        if declared_gpu and m.gpu_types and declared_gpu not in m.gpu_types:
            findings.append(
                Finding(
                    cluster,
                    "fleet",
                    "gpu_type",
                    f"declared {declared_gpu} in the fleet, its pools have {_names(sorted(m.gpu_types))}",
                )
            )
    rank = {c: i for i, c in enumerate(order)}
    cat_rank = {c: i for i, c in enumerate(("stack", "federation", *CATEGORIES, "accounting", "fleet"))}
    findings.sort(key=lambda f: (rank.get(f.cluster, len(rank)), cat_rank.get(f.category, 99), f.item))
    return Report(
        federation=mgr.name,
        manager_source=mgr.source,
        clusters={c: members[c].source if c in members else "" for c in order},
        findings=findings,
    )
