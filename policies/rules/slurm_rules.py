"""Rules on Slurm: job requeue on (JobRequeue=1), and a Slurm federation's sanity (unique, valid cluster
names; workers accounting in the manager's slurmdbd; the production manager's database persistent).
"""

from __future__ import annotations

import re
from typing import Any

from pulumi_policy import (
    ReportViolation,
    ResourceValidationArgs,
    StackValidationArgs,
)

from .shared import (
    COMPONENT_LABEL,
    FEDERATION_COMPONENT,
    FEDERATION_SCRIPT_KEY,
    FEDERATION_VERBS,
    HELM_RELEASE,
    LABEL_FEDERATION_ROLE,
    PRODUCTION_MARK,
    SLINKY,
    SLURM_CLUSTER_NAME,
    _kind,
    _labels,
    _name,
    _pod_containers,
    _production_namespaces,
)


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
