"""A Slurm federation declared as code: the manager's objects, and the drift check across its stacks.

The manager stack (fleetheal:federation role `manager`) is a cluster that also runs the federation's
slurmdbd. Besides what every cluster gets, it renders:
- a ConfigMap with an idempotent `sacctmgr -i` script (`apply.sh`) and the slurm.conf it runs with, and a
  Job (named after the script's digest, so a changed declaration runs once more) that applies the
  federation to slurmdbd: the clusters and their features, the QOS, the accounts with an association on
  every cluster, and the federation itself. It adds and updates, never removes: deleting an association
  deletes its usage history, which is a human's decision.
- the fleet file (fleetheal.fleet.config format) as the ConfigMap `fleetheal-fleet`, validated by
  fleetheal.fleet.config when the stack config is read: the stacks are the fleet's one source of truth.

A worker stack (role `worker`) points its Accounting at the manager's slurmdbd (fleetheal.infra.slinky);
every other object a job needs (namespaces, secrets, the agent, the alert rules, the partitions) comes
from the same program, so every cluster renders it. `fleetheal fleet drift` renders every stack (or reads
rendered directories) and says, per cluster, what of that set is missing or different.

Importing this module stays cheap (the `fleetheal` command registers `drift` from it): Pulumi, the
policy pack and the renderer are imported where they are used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetheal.errors import UsageError
from fleetheal.infra import config
from fleetheal.infra.config import FederationSpec, StackConfig

#: Objects of the manager's federation.
SCRIPT_CONFIGMAP = "fleetheal-federation"
FLEET_CONFIGMAP = "fleetheal-fleet"
FLEET_FILE_KEY = "fleet.yaml"
JOB_PREFIX = "fleetheal-federation-"
SCRIPT_MOUNT = "/etc/fleetheal/federation"
SLURM_ETC = "/etc/slurm"
#: How long the Job waits for slurmdbd to answer before it fails (and the Job's backoff retries it).
DBD_WAIT_S = 600

# The script's shell functions; the statements after them (policy.FEDERATION_VERBS) are generated.
SCRIPT_HEAD = r"""#!/usr/bin/env bash
# fleetheal: the Slurm federation {name}, applied to slurmdbd with `sacctmgr -i`. Generated from the manager
# stack's fleetheal:federation setting; `fleetheal fleet drift` reads the statements at the end.
# Each statement makes slurmdbd match it and changes nothing that already does; nothing is ever removed.
set -euo pipefail

changes=0
q() {{ sacctmgr -n -P "$@"; }}
x() {{
  echo "fleetheal-federation: sacctmgr -i $*"
  sacctmgr -i "$@" >/dev/null
  changes=$((changes + 1))
}}
# A comma list, sorted; sacctmgr -P ends some lines with a stray '|'.
sorted() {{ tr ',|' '\n\n' | sed '/^$/d' | sort -u | paste -sd, -; }}

wait_for_slurmdbd() {{
  local waited=0 limit="${{FLEETHEAL_DBD_WAIT_S:-{wait}}}"
  until q show cluster format=cluster >/dev/null 2>&1; do
    if ((waited >= limit)); then
      echo "fleetheal-federation: slurmdbd did not answer within $limit s" >&2
      return 1
    fi
    sleep 5
    waited=$((waited + 5))
  done
}}

# cluster NAME FEATURES: the cluster is registered, with exactly these features.
cluster() {{
  if [[ -z "$(q show cluster where cluster="$1" format=cluster)" ]]; then x add cluster "$1"; fi
  if [[ "$(q show cluster where cluster="$1" format=features | sorted)" != "$(sorted <<<"$2")" ]]; then
    x modify cluster where cluster="$1" set features="$2"
  fi
}}

# qos NAME PRIORITY: the QOS exists with this priority (its limits are the queue controller's).
qos() {{
  if [[ -z "$(q show qos where name="$1" format=name)" ]]; then x add qos "$1"; fi
  if [[ "$(q show qos where name="$1" format=priority)" != "$2" ]]; then
    x modify qos where name="$1" set priority="$2"
  fi
}}

# assoc ACCOUNT USER CLUSTER QOS DEFAULT_QOS: one association (USER "" for the account's own).
assoc() {{
  local account=$1 user=$2 cluster=$3 want=$4 dqos=$5 line have_qos have_dqos
  line=$(q show assoc where cluster="$cluster" account="$account" format=user,partition,qos,defaultqos |
    awk -F'|' -v u="$user" '$1 == u && $2 == ""' | head -n 1)
  if [[ -z "$line" ]]; then
    if [[ -z "$user" ]]; then
      x add account "$account" cluster="$cluster"
    else
      x add user "$user" account="$account" cluster="$cluster"
    fi
    line=$(q show assoc where cluster="$cluster" account="$account" format=user,partition,qos,defaultqos |
      awk -F'|' -v u="$user" '$1 == u && $2 == ""' | head -n 1)
  fi
  [[ "$want" == "-" ]] && return 0
  IFS='|' read -r _ _ have_qos have_dqos <<<"$line"
  if [[ "$(sorted <<<"$have_qos")" != "$(sorted <<<"$want")" || "$have_dqos" != "$dqos" ]]; then
    if [[ -z "$user" ]]; then
      x modify account where name="$account" cluster="$cluster" set qos="$want" defaultqos="$dqos"
    else
      x modify user where name="$user" account="$account" cluster="$cluster" set qos="$want" defaultqos="$dqos"
    fi
  fi
}}

# grant ACCOUNT CLUSTER QOS DEFAULT_QOS [USER...]: the account and each user in it may run on CLUSTER
# with exactly these QOS ("-": leave the QOS as Slurm sets them).
grant() {{
  local account=$1 cluster=$2 want=$3 dqos=$4 user
  shift 4
  assoc "$account" "" "$cluster" "$want" "$dqos"
  for user in "$@"; do assoc "$account" "$user" "$cluster" "$want" "$dqos"; done
}}

# federation NAME CLUSTER...: the federation exists with exactly these clusters (one added or removed at a
# time: `set clusters=` refuses a list that repeats a current member).
federation() {{
  local name=$1 have c
  shift
  if [[ -z "$(q show federation where federation="$name" format=federation)" ]]; then
    x add federation "$name" clusters="$(IFS=,; echo "$*")"
    return 0
  fi
  have=$(q show federation where federation="$name" format=cluster | sorted)
  for c in "$@"; do
    if [[ ",$have," != *",$c,"* ]]; then x modify federation "$name" set clusters+="$c"; fi
  done
  for c in ${{have//,/ }}; do
    if [[ " $* " != *" $c "* ]]; then x modify federation "$name" set clusters-="$c"; fi
  done
}}

wait_for_slurmdbd

# -- the federation (generated) --
"""


# ---------------------------------------------------------------------------------------------------------
# the manager's objects


def data_features(spec: FederationSpec) -> dict[str, list[str]]:
    """Cluster -> its `<prefix><dataset>` features, from the fleet file's datasets (as placement sets them)."""
    out: dict[str, list[str]] = {c.name: [] for c in spec.clusters}
    for name, ds in sorted((spec.fleet_file.get("datasets") or {}).items()):
        for cluster in ds.get("clusters") or []:
            out[cluster].append(spec.data_feature_prefix + name)
    return out


def statements(spec: FederationSpec) -> list[str]:
    """The script's statements: clusters (GPU type, declared and data features), QOS, grants, federation."""
    if spec.role != "manager":
        raise ValueError(f"only a manager declares the federation (role {spec.role!r})")
    data = data_features(spec)
    lines = []
    for c in spec.clusters:
        features = sorted(dict.fromkeys([c.gpu_type, *c.features, *data[c.name]]))
        lines.append(f"cluster {c.name} {','.join(features)}")
    lines += [f"qos {q.name} {q.priority}" for q in spec.qos]
    for a in spec.accounts:
        qos = ",".join(sorted(a.qos)) or "-"
        for c in spec.clusters:
            lines.append(" ".join(["grant", a.name, c.name, qos, a.default_qos or "-", *a.users]))
    lines.append(" ".join(["federation", spec.name, *(c.name for c in spec.clusters)]))
    return lines


def script(spec: FederationSpec) -> str:
    body = "\n".join(statements(spec))
    tail = f'echo "fleetheal-federation: federation {spec.name} applied ($changes change(s))"\n'
    return SCRIPT_HEAD.format(name=spec.name, wait=DBD_WAIT_S) + body + "\n\n" + tail


def client_conf(cluster_name: str, namespace: str) -> str:
    """slurm.conf of the Job's sacctmgr: the manager's slurmdbd, authenticated with the cluster's slurm.key."""
    from fleetheal.infra import common, slinky

    return "\n".join(
        [
            f"ClusterName={cluster_name}",
            # sacctmgr talks to slurmdbd only; the controller is named because every slurm.conf must.
            f"SlurmctldHost={slinky.controller_service(cluster_name)}",
            "AuthType=auth/slurm",
            "CredType=cred/slurm",
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={common.cluster_dns(slinky.accounting_service(cluster_name), namespace)}",
            f"AccountingStoragePort={slinky.SLURMDBD_PORT}",
            "",
        ]
    )


def fleet_file_text(spec: FederationSpec) -> str:
    """The fleet file, as fleetheal.fleet.config.load reads it."""
    head = (
        "# The fleet file of the Slurm federation, rendered by the manager stack from fleetheal:federation.\n"
        "# Do not edit: change the manager's stack config (docs/fleet.md describes the fields).\n"
    )
    return head + yaml.safe_dump(_plain(spec.fleet_file), sort_keys=False, width=110)


def _plain(value: Any) -> Any:
    """Mappings (MappingProxyType too) and tuples as the dicts and lists YAML can write."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class ManagerObjects:
    """What the manager stack registers for the federation (pulumi resources, typed loosely: pulumi_kubernetes
    is untyped here)."""

    script_config_map: Any
    job: Any
    fleet_config_map: Any
    job_name: str


def build_fleet_file(cfg: StackConfig, opts: Any) -> Any:
    """The ConfigMap `fleetheal-fleet` (key fleet.yaml) of a federation member: the fleet file every member
    renders alike (a worker from its manager's stack), which its remediator's failover reads."""
    import pulumi_kubernetes as k8s

    from fleetheal.infra import common, policy

    return k8s.core.v1.ConfigMap(
        "federation-fleet-file",
        metadata={
            "name": FLEET_CONFIGMAP,
            "namespace": cfg.system_namespace,
            "labels": common.labels("fleet", FLEET_CONFIGMAP, {policy.LABEL_FEDERATION_ROLE: cfg.federation.role}),
        },
        data={FLEET_FILE_KEY: fleet_file_text(cfg.federation)},
        opts=opts,
    )


def build_manager(cfg: StackConfig, depends_on: Sequence[Any]) -> ManagerObjects:
    """Register the federation's ConfigMaps and Job in the manager stack (after `depends_on`: the namespaces
    and the Slurm cluster, whose slurmdbd the Job waits for)."""
    import pulumi
    import pulumi_kubernetes as k8s

    from fleetheal.infra import common, policy

    spec = cfg.federation
    if spec.role != "manager":
        raise common.ComponentArgError(f"federation: build_manager needs role manager, got {spec.role!r}")
    ns = cfg.slurm_namespace
    text = script(spec)
    conf = client_conf(cfg.cluster_name, ns)
    digest = hashlib.sha256((text + conf + cfg.image("login")).encode()).hexdigest()[:10]
    job_name = JOB_PREFIX + digest
    labels = common.labels(policy.FEDERATION_COMPONENT, SCRIPT_CONFIGMAP, {policy.LABEL_FEDERATION_ROLE: "manager"})
    opts = pulumi.ResourceOptions(depends_on=list(depends_on))
    script_cm = k8s.core.v1.ConfigMap(
        "federation-script",
        metadata={"name": SCRIPT_CONFIGMAP, "namespace": ns, "labels": labels},
        data={
            policy.FEDERATION_SCRIPT_KEY: text,
            "slurm.conf": conf,
            **({"address": spec.address} if spec.address else {}),
        },
        opts=opts,
    )
    job_labels = common.labels(policy.FEDERATION_COMPONENT, job_name)
    job = k8s.batch.v1.Job(
        "federation-apply",
        metadata={"name": job_name, "namespace": ns, "labels": job_labels},
        spec={
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "sacctmgr",
                            # The Slinky login image carries the Slurm client commands, sacctmgr among them.
                            "image": cfg.image("login"),
                            "command": ["bash", f"{SCRIPT_MOUNT}/{policy.FEDERATION_SCRIPT_KEY}"],
                            "env": [
                                {"name": "SLURM_CONF", "value": f"{SLURM_ETC}/slurm.conf"},
                                {"name": "FLEETHEAL_DBD_WAIT_S", "value": str(DBD_WAIT_S)},
                            ],
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "256Mi"},
                            },
                            "volumeMounts": [
                                {"name": "script", "mountPath": SCRIPT_MOUNT, "readOnly": True},
                                {"name": "slurm-etc", "mountPath": SLURM_ETC, "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "script",
                            "configMap": {
                                "name": SCRIPT_CONFIGMAP,
                                "items": [{"key": policy.FEDERATION_SCRIPT_KEY, "path": policy.FEDERATION_SCRIPT_KEY}],
                            },
                        },
                        {
                            # slurm.key beside slurm.conf: sacctmgr runs as root, which slurmdbd trusts as an
                            # administrator when the request is signed with the cluster's key.
                            "name": "slurm-etc",
                            "projected": {
                                "defaultMode": 0o400,
                                "sources": [
                                    {
                                        "configMap": {
                                            "name": SCRIPT_CONFIGMAP,
                                            "items": [{"key": "slurm.conf", "path": "slurm.conf", "mode": 0o444}],
                                        }
                                    },
                                    {
                                        "secret": {
                                            "name": cfg.slurm_key_secret,
                                            "items": [{"key": "slurm.key", "path": "slurm.key"}],
                                        }
                                    },
                                ],
                            },
                        },
                    ],
                },
            },
        },
        opts=pulumi.ResourceOptions(depends_on=[*depends_on, script_cm]),
    )
    fleet_cm = build_fleet_file(cfg, opts)
    return ManagerObjects(script_cm, job, fleet_cm, job_name)


# ---------------------------------------------------------------------------------------------------------
# what a job needs on each cluster, read from a stack's objects

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
    from fleetheal.infra import policy

    objs = list(objects)
    controllers = [o for o in objs if o.get("kind") == "Controller"]
    if len(controllers) != 1:
        return None, None
    ctrl = controllers[0]
    labels = (ctrl.get("metadata") or {}).get("labels") or {}
    role = str(labels.get(policy.LABEL_FEDERATION_ROLE, "none"))
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
            if kind == "ConfigMap" and policy.FEDERATION_SCRIPT_KEY in data:
                declared = _read_manager(source, str(data[policy.FEDERATION_SCRIPT_KEY]), str(data.get("address", "")))
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
    from fleetheal.infra import policy

    name, clusters = "", []
    accounts: dict[str, dict[str, str]] = {}
    granted: dict[str, set[tuple[str, str]]] = {}
    qos: dict[str, str] = {}
    for s in policy.federation_statements(text):
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


# ---------------------------------------------------------------------------------------------------------
# loading stacks: stack files, project directories, rendered directories


def _render_objects(stack: str, root: Path) -> list[dict[str, Any]]:
    from fleetheal.infra import mocks, render

    records = render.record_stack(stack, root)
    return [r.inputs for r in records if r.custom and r.is_kubernetes_object and r.type != mocks.HELM_RELEASE]


def _rendered_dir_objects(path: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(path.rglob("*.yaml")):
        if f.relative_to(path).parts[0] in ("_helm", "_cloud"):
            continue
        for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and "kind" in doc:
                out.append(doc)
    return out


def load_inputs(paths: Sequence[Path]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(source name, objects) of each stack the paths name. A path is a stack file (`Pulumi.<stack>.yaml`,
    rendered now), a project directory (each of its stacks whose federation role is not `none`), or the
    output of `fleetheal render` (one stack, or one per sub-directory)."""
    from fleetheal.infra import render

    out: list[tuple[str, list[dict[str, Any]]]] = []
    for path in paths:
        if path.is_file():
            m = re.fullmatch(r"Pulumi\.(.+)\.yaml", path.name)
            if not m or not (path.parent / "Pulumi.yaml").is_file():
                raise UsageError(f"{path}: not a stack file (Pulumi.<stack>.yaml beside a Pulumi.yaml)")
            out.append((m.group(1), _render_objects(m.group(1), path.parent)))
        elif (path / render.MARKER).is_file():
            subs = sorted(d for d in path.iterdir() if (d / render.MARKER).is_file())
            for d in subs or [path]:
                out.append((str(d), _rendered_dir_objects(d)))
        elif (path / "Pulumi.yaml").is_file():
            for stack in config.list_stacks(path):
                raw = config.stack_values(stack, path).get("federation") or {}
                if isinstance(raw, dict) and raw.get("role", "none") != "none":
                    out.append((stack, _render_objects(stack, path)))
        elif path.is_dir():
            raise UsageError(f"{path}: neither a Pulumi project (no Pulumi.yaml) nor a render (no {render.MARKER})")
        else:
            raise UsageError(f"{path}: no such file or directory")
    return out


# ---------------------------------------------------------------------------------------------------------
# the comparison


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
        for q in sorted({q for _, q in mine} - set(mgr.qos) - set(config.BUILTIN_QOS)):
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


# ---------------------------------------------------------------------------------------------------------
# `fleetheal fleet drift`


def register(fleet_subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `drift` under `fleetheal fleet` (fleetheal.fleet.status's subparsers)."""
    p = fleet_subparsers.add_parser(
        "drift",
        help="say where the federation's stacks differ in what every job needs",
        description=(
            "Render each stack of the federation (or read `fleetheal render` output) and say, per cluster, which "
            "of the things a job needs to run anywhere is missing or differs: accounts and QOS (from the manager's "
            "sacctmgr script), namespaces, secrets, the agent, the alert rules, the partitions and slurm.conf "
            "settings; also clusters the manager declares that no stack renders, and workers outside the "
            "federation. Exit 1 on drift."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        metavar="STACK_FILE_OR_DIR",
        help="Pulumi.<stack>.yaml, a project directory (its federation stacks) or a `fleetheal render` output",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_drift)


def cmd_drift(args: argparse.Namespace) -> int:
    try:
        stacks = load_inputs(args.inputs)
        report = compare(stacks)
    except config.ConfigError as exc:
        print(f"fleetheal fleet drift: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_json(), indent=2, sort_keys=True))
    else:
        print(report.text())
    return 1 if report.drift else 0
