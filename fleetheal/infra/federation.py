"""FederationManager: what a Slurm federation's manager stack adds to its cluster.

The manager stack (fleetheal:federation role `manager`) is a cluster that also runs the federation's
slurmdbd. Besides what every cluster gets, this component renders a ConfigMap with an idempotent
`sacctmgr -i` script (`apply.sh`) and the slurm.conf it runs with, and a Job (named after the script's
digest, so a changed declaration runs once more) that applies the federation to slurmdbd: the clusters
and their features, the QOS, the accounts with an association on every cluster, and the federation
itself. It adds and updates, never removes: deleting an association deletes its usage history, which is
a human's decision.

A worker stack (role `worker`) points its Accounting at the manager's slurmdbd (fleetheal.infra.slinky);
every member carries the fleet file (fleetheal.infra.fleet_file, registered by fleetheal.infra.program);
`fleetheal fleet drift` (fleetheal.infra.drift) compares what the members render.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal.infra import common, slinky_specs
from fleetheal.infra.policy import shared
from fleetheal.infra.stack_model import SLURMDBD_PORT, FederationSpec

COMPONENT = "FederationManager"
SCRIPT_CONFIGMAP = "fleetheal-federation"
JOB_PREFIX = "fleetheal-federation-"
SCRIPT_MOUNT = "/etc/fleetheal/federation"
SLURM_ETC = "/etc/slurm"
#: How long the Job waits for slurmdbd to answer before it fails (and the Job's backoff retries it).
DBD_WAIT_S = 600

# The script's shell functions; the statements after them (shared.FEDERATION_VERBS) are generated.
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
    return "\n".join(
        [
            f"ClusterName={cluster_name}",
            # sacctmgr talks to slurmdbd only; the controller is named because every slurm.conf must.
            f"SlurmctldHost={slinky_specs.controller_service(cluster_name)}",
            "AuthType=auth/slurm",
            "CredType=cred/slurm",
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStorageHost={common.cluster_dns(slinky_specs.accounting_service(cluster_name), namespace)}",
            f"AccountingStoragePort={SLURMDBD_PORT}",
            "",
        ]
    )


class FederationManagerArgs(TypedDict):
    spec: FederationSpec
    """The checked `federation` setting (role manager)."""
    cluster_name: str
    """The manager's own Slurm cluster (a member of the federation)."""
    namespace: str
    """The Slurm namespace (must exist): the Job runs beside slurmdbd."""
    image: str
    """Pinned Slinky login image: it carries sacctmgr."""
    slurm_key_secret: str
    """Secret (key `slurm.key`) slurmdbd trusts: sacctmgr runs as root, an administrator when signed with it."""


class FederationManager(pulumi.ComponentResource):
    """The federation's sacctmgr script (ConfigMap) and the Job that applies it to slurmdbd."""

    def __init__(self, name: str, args: FederationManagerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, FederationManagerArgs.__annotations__)
        spec: FederationSpec = a["spec"]
        if spec.role != "manager":
            raise common.ComponentArgError(f"{COMPONENT}.spec: needs role manager, got {spec.role!r}")
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.pinned_image(COMPONENT, "image", a["image"])
        super().__init__("fleetheal:federation:FederationManager", name, None, opts)
        text = script(spec)
        conf = client_conf(a["cluster_name"], ns)
        digest = hashlib.sha256((text + conf + a["image"]).encode()).hexdigest()[:10]
        self.job_name = JOB_PREFIX + digest
        # The children were registered at the stack's root before this component existed: the alias keeps
        # their URNs, so a stack that already runs them neither replaces the ConfigMap nor re-runs the Job.
        # depends_on is given to each child: the Job must wait for the namespaces and the Slurm cluster.
        deps = list(opts.depends_on or []) if opts is not None and isinstance(opts.depends_on, list) else []
        at_root = [pulumi.Alias(parent=pulumi.ROOT_STACK_RESOURCE)]
        labels = common.labels(shared.FEDERATION_COMPONENT, SCRIPT_CONFIGMAP, {shared.LABEL_FEDERATION_ROLE: "manager"})
        self.script_config_map = k8s.core.v1.ConfigMap(
            f"{name}-script",
            metadata={"name": SCRIPT_CONFIGMAP, "namespace": ns, "labels": labels},
            data={
                shared.FEDERATION_SCRIPT_KEY: text,
                "slurm.conf": conf,
                **({"address": spec.address} if spec.address else {}),
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=deps, aliases=at_root),
        )
        self.job = k8s.batch.v1.Job(
            f"{name}-apply",
            metadata={
                "name": self.job_name,
                "namespace": ns,
                "labels": common.labels(shared.FEDERATION_COMPONENT, self.job_name),
            },
            spec=self._job_spec(a),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*deps, self.script_config_map], aliases=at_root),
        )
        self.register_outputs({"job": self.job_name})

    def _job_spec(self, a: dict[str, Any]) -> dict[str, Any]:
        job_labels = common.labels(shared.FEDERATION_COMPONENT, self.job_name)
        key = shared.FEDERATION_SCRIPT_KEY
        return {
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "sacctmgr",
                            # The Slinky login image carries the Slurm client commands, sacctmgr among them.
                            "image": a["image"],
                            "command": ["bash", f"{SCRIPT_MOUNT}/{key}"],
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
                            "configMap": {"name": SCRIPT_CONFIGMAP, "items": [{"key": key, "path": key}]},
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
                                            "name": a["slurm_key_secret"],
                                            "items": [{"key": "slurm.key", "path": "slurm.key"}],
                                        }
                                    },
                                ],
                            },
                        },
                    ],
                },
            },
        }
