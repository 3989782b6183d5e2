"""The policy pack's federation rules over the example federation's stacks (Pulumi.fleet-*.yaml) under
Pulumi's mock engine: the stacks pass, and each mutation fails exactly the rule it breaks, with the
message that says what is wrong and how to fix it.

policies/__main__.py is never imported: constructing a PolicyPack starts a server and blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from fleetheal.infra import config, mocks, policy, program, project
from fleetheal.infra.policy import shared, slurm_rules

Props = dict[str, Any]
Graph = list[tuple[str, str, Props]]
PRODUCTION = {"environment": "production", "remediatorReplicas": 2, "remediatorStore": "postgres"}


def _graph(stack: str, **over: Any) -> Graph:
    cfg = config.from_values({**project.stack_values(stack), **over})
    records = mocks.run(lambda: program.build(cfg))
    return [(r.type, r.name, r.inputs) for r in records if r.custom]


@pytest.fixture(scope="module")
def graphs() -> dict[str, Graph]:
    return {
        "manager": _graph("fleet-manager"),
        "worker": _graph("fleet-a"),
        "production-manager": _graph("fleet-manager", **PRODUCTION),
    }


def _mutate(graph: Graph, kind: str, name: str, fn: Callable[[Props], None]) -> Graph:
    out = copy.deepcopy(graph)
    hits = [p for _, _, p in out if p.get("kind") == kind and p["metadata"]["name"] == name]
    assert len(hits) == 1, (kind, name)
    fn(hits[0])
    return out


def _violations(graph: Graph) -> list[tuple[str, str]]:
    return policy.evaluate(graph)


@pytest.mark.parametrize("which", ["manager", "worker", "production-manager"])
def test_the_example_federation_passes_the_whole_pack(graphs: dict[str, Graph], which: str) -> None:
    assert _violations(graphs[which]) == []


def _edit_script(old: str, new: str) -> Callable[[Props], None]:
    def fn(props: Props) -> None:
        text = props["data"][shared.FEDERATION_SCRIPT_KEY]
        assert old in text
        props["data"][shared.FEDERATION_SCRIPT_KEY] = text.replace(old, new)

    return fn


FIX_NAMES = (
    "Slurm keys job records, associations and the federation's siblings by cluster name, and slurmdbd uses it as a "
    "table prefix: two stacks with one name would share (and corrupt) one cluster's records, and a job sent to an "
    "unknown sibling is lost. Fix: list each cluster once in fleetheal:federation.clusters with a name of "
    "lower-case letters, digits and '-', starting with a letter, at most 40 characters."
)


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (
            "cluster b a100,data-c4\n",
            "cluster b a100,data-c4\ncluster a h100\n",
            "cluster(s) a declared more than once",
        ),
        (
            "cluster b a100",
            "cluster B_2 a100",
            "invalid Slurm cluster name(s) 'B_2'; account 'research' is granted on undeclared cluster 'b'; account "
            "'platform' is granted on undeclared cluster 'b'; federation 'fleet' lists undeclared cluster(s) b",
        ),
        ("federation fleet core a b", "federation fleet core a b a", "federation 'fleet' lists a more than once"),
    ],
)
def test_federation_cluster_names(graphs: dict[str, Graph], old: str, new: str, problem: str) -> None:
    graph = _mutate(graphs["manager"], "ConfigMap", "fleetheal-federation", _edit_script(old, new))
    assert _violations(graph) == [
        (
            "federation-cluster-names",
            f"ConfigMap 'fleetheal-federation' (the federation's sacctmgr script): {problem}. {FIX_NAMES}",
        )
    ]


FIX_MANAGER = (
    "A worker that does not write to the manager's slurmdbd is no sibling: the federation never sends it jobs, its "
    "jobs are invisible to the others and its accounts and QOS are not the federation's. Fix: set "
    "fleetheal:federation.manager to the manager's slurmdbd as HOST:PORT (the Accounting becomes external with "
    "that host and port)."
)


@pytest.mark.parametrize(
    ("kind", "name", "mutation", "problem"),
    [
        (
            "Accounting",
            "a-accounting",
            lambda p: p["spec"].update(external=False),
            "its Accounting 'a-accounting' runs a slurmdbd of its own (spec.external is not true)",
        ),
        (
            "Accounting",
            "a-accounting",
            lambda p: p["spec"]["externalConfig"].update(host=""),
            "its Accounting 'a-accounting' names no manager (externalConfig needs host and port)",
        ),
        (
            "Controller",
            "a",
            lambda p: p["spec"]["accountingRef"].update(name="other"),
            "its accountingRef 'other' names no Accounting in the stack",
        ),
    ],
)
def test_federation_worker_names_manager(
    graphs: dict[str, Graph], kind: str, name: str, mutation: Callable[[Props], None], problem: str
) -> None:
    graph = _mutate(graphs["worker"], kind, name, mutation)
    assert _violations(graph) == [
        (
            "federation-worker-names-manager",
            f"Controller 'a' is a federation worker but {problem}. {FIX_MANAGER}",
        )
    ]


def _data_on_empty_dir(props: Props) -> None:
    pod = props["spec"]["template"]["spec"]
    pod["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    pod["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/var/lib/mysql"}]
    props["spec"].pop("volumeClaimTemplates")


@pytest.mark.parametrize(
    ("mutation", "problem"),
    [
        (_data_on_empty_dir, "its data directory /var/lib/mysql is not on a volumeClaimTemplate"),
        (
            lambda p: p["spec"]["persistentVolumeClaimRetentionPolicy"].update(whenDeleted="Delete"),
            "its volumes are deleted with it (persistentVolumeClaimRetentionPolicy.whenDeleted=Delete)",
        ),
    ],
)
def test_production_federation_database_persistent(
    graphs: dict[str, Graph], mutation: Callable[[Props], None], problem: str
) -> None:
    graph = _mutate(graphs["production-manager"], "StatefulSet", "mariadb", mutation)
    assert _violations(graph) == [
        (
            "production-federation-database-persistent",
            "StatefulSet 'mariadb' holds the database of the production federation's slurmdbd (Accounting "
            "'core-accounting'; Namespace 'slurm' is labelled fleetheal.io/environment=production, from "
            f"fleetheal:environment) but {problem}. That database is the federation itself: its clusters, accounts, "
            "QOS and every cluster's job history; losing it stops every sibling from accounting and scheduling "
            "across clusters. Fix: keep fleetheal.infra.accounting_db.AccountingDatabase (a claim template mounted "
            "at /var/lib/mysql, whenDeleted: Retain), or point fleetheal:accountingDbHost at a managed database with "
            "fleetheal:accountingDatabase false.",
        )
    ]
    # the same database outside production is the operator's choice
    assert _violations(_mutate(graphs["manager"], "StatefulSet", "mariadb", mutation)) == []


def test_federation_statements_read_only_the_generated_lines() -> None:
    text = "cluster() {\n  q show\n}\n# cluster x y\ncluster a h100  # a comment\n  qos large 10\nfederation f a\n"
    assert slurm_rules.federation_statements(text) == [
        ("cluster", "a", "h100"),
        ("qos", "large", "10"),
        ("federation", "f", "a"),
    ]
