"""What an action means lives only in the taxonomy (`actions:` in policies/faults.yaml).

Code asks `taxonomy.Action` (fastpath, first_response, requeues_job, supersedes, follows, lifecycle) and never
names an action: a string literal (Python) or a YAML value equal to an action name is a second source of
truth. Docstrings, comments and help text that mention an action are fine.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetheal import taxonomy
from fleetheal.taxonomy import Taxonomy, TaxonomyError

REPO = Path(__file__).resolve().parents[1]
ACTIONS = frozenset(taxonomy.load().actions)
#: Generated from the taxonomy (`fleetheal generate`), or the taxonomy itself.
GENERATED = {Path("playbooks/vars/taxonomy.yml"), Path("policies/alert-rules.yml"), Path("docs/taxonomy.md")}
#: The lab's demo scenarios name the action each scenario expects to see: expectations, like the tests'.
NOT_SCANNED = (Path("fleetheal/lab"),)
#: A playbook names the action it is the playbook for (tasks/validate.yml checks the two agree).
YAML_KEYS_ALLOWED = frozenset({"__fleetheal_playbook_action"})


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are documentation: any string statement (module, class and function
    docstrings, attribute docstrings) has no effect as code."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def action_literals_in_python(source: str, actions: frozenset[str] = ACTIONS) -> list[tuple[int, str]]:
    """(line, name) of each string constant equal to an action name, docstrings excepted."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in actions and id(node) not in docs
    ]


class _Loader(yaml.SafeLoader):
    """A safe loader that reads Ansible's tags (!unsafe, !vault) as the plain values under them."""


_Loader.add_multi_constructor("!", lambda loader, _tag, node: loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None)  # type: ignore[no-untyped-call]  # fmt: skip


def _quoted(actions: frozenset[str]) -> re.Pattern[str]:
    names = "|".join(re.escape(a) for a in sorted(actions))
    return re.compile(rf"""(['"])({names})\1""")


def action_literals_in_yaml(text: str, actions: frozenset[str] = ACTIONS) -> list[tuple[str, str]]:
    """(where, name) of each YAML key or scalar value equal to an action name, and of each quoted action name
    inside a value (a Jinja expression: `fleetheal_action == 'RESET_GPU'`); comments are not values.
    The value of a key in YAML_KEYS_ALLOWED is allowed."""
    quoted = _quoted(actions)
    found: list[tuple[str, str]] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in actions:
                    found.append((f"{where}/{key} (key)", str(key)))
                if key in YAML_KEYS_ALLOWED and value in actions:
                    continue
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{where}[{i}]")
        elif isinstance(node, str):
            if node in actions:
                found.append((where, node))
            else:
                found.extend((where, m.group(2)) for m in quoted.finditer(node))

    for i, doc in enumerate(yaml.load_all(text, Loader=_Loader)):  # a SafeLoader subclass
        walk(doc, f"doc{i}")
    return found


def _files(pattern: str, *roots: str) -> Iterator[Path]:
    for root in roots:
        for path in sorted((REPO / root).rglob(pattern)):
            rel = path.relative_to(REPO)
            if rel in GENERATED or any(rel.is_relative_to(p) for p in NOT_SCANNED) or "__pycache__" in rel.parts:
                continue
            yield rel


PYTHON = list(_files("*.py", "fleetheal", "agent", "playbooks"))
YAML = list(_files("*.yml", "playbooks", "roles"))


def test_the_scan_covers_the_code() -> None:
    assert Path("fleetheal/remediator/gate.py") in PYTHON
    assert Path("fleetheal/agent/config.py") in PYTHON
    assert Path("playbooks/filter_plugins/fleetheal_inputs.py") in PYTHON
    assert any(p.parts[:2] == ("playbooks", "collections") for p in PYTHON)
    assert Path("playbooks/vars/remediation.yml") in YAML
    assert Path("playbooks/tasks/validate.yml") in YAML
    assert any(p.parts[0] == "roles" for p in YAML)


@pytest.mark.parametrize("path", PYTHON, ids=str)
def test_python_names_no_action(path: Path) -> None:
    found = action_literals_in_python((REPO / path).read_text(encoding="utf-8"))
    assert not found, (
        f"{path} names actions as code {found}: what an action means lives in policies/faults.yaml "
        "(taxonomy.Action: fastpath, first_response, requeues_job, supersedes, follows, lifecycle)"
    )


@pytest.mark.parametrize("path", YAML, ids=str)
def test_yaml_names_no_action(path: Path) -> None:
    found = action_literals_in_yaml((REPO / path).read_text(encoding="utf-8"))
    assert not found, (
        f"{path} names actions {found}: what an action means lives in policies/faults.yaml "
        "(the playbooks read it from the generated vars/taxonomy.yml)"
    )


def test_the_python_scan_finds_a_second_source_of_truth() -> None:
    source = '''
"""Module docstring naming RESET_GPU is fine."""
# a comment naming "RESET_GPU" is fine
REQUEUE = {"RESET_GPU"}


def f(action: str) -> bool:
    """ISOLATE_AND_RELOCATE"""
    return action == "ISOLATE_AND_RELOCATE"
'''
    assert action_literals_in_python(source) == [(4, "RESET_GPU"), (9, "ISOLATE_AND_RELOCATE")]
    gate = (REPO / "fleetheal" / "remediator" / "gate.py").read_text(encoding="utf-8")
    assert action_literals_in_python(gate + '\nREQUEUE = {"RESET_GPU"}\n') == [(gate.count("\n") + 2, "RESET_GPU")]


def test_the_yaml_scan_finds_a_second_source_of_truth() -> None:
    text = """
# a comment naming REVALIDATE is fine
- hosts: all
  vars:
    __fleetheal_playbook_action: REVALIDATE
    fail_msg: run REVALIDATE first
  tasks:
    - name: a step only for one action
      when: fleetheal_action == 'RESET_GPU'
    - name: a list
      vars:
        followups: {REJOIN: [ISOLATE_AND_RELOCATE]}
"""
    assert action_literals_in_yaml(text) == [
        ("doc0[0]/tasks[0]/when", "RESET_GPU"),
        ("doc0[0]/tasks[1]/vars/followups/REJOIN (key)", "REJOIN"),
        ("doc0[0]/tasks[1]/vars/followups/REJOIN[0]", "ISOLATE_AND_RELOCATE"),
    ]


# --- the taxonomy's own checks of the action fields --------------------------------------------------


@pytest.fixture
def doc() -> dict[str, Any]:
    return copy.deepcopy(taxonomy.raw())


def test_the_shipped_actions_mean_what_the_code_relied_on() -> None:
    tx = taxonomy.load()
    assert tx.fastpath_actions() == ("ISOLATE_AND_RELOCATE", "RESET_GPU")
    assert tx.first_response_actions() == ("ISOLATE_AND_RELOCATE", "RESTART_IN_PLACE")
    assert tx.requeuing_actions() == ("ISOLATE_AND_RELOCATE", "RESET_GPU", "RESTART_IN_PLACE")
    assert tx.followups() == {
        "REVALIDATE": ("ISOLATE_AND_RELOCATE", "RESET_GPU"),
        "REJOIN": ("ISOLATE_AND_RELOCATE", "RESET_GPU"),
    }
    # the gate's duplicate rule: an isolation covers a reset and itself, a reset only itself
    assert tx.covers("ISOLATE_AND_RELOCATE", "RESET_GPU") and tx.covers("ISOLATE_AND_RELOCATE", "ISOLATE_AND_RELOCATE")
    assert not tx.covers("RESET_GPU", "ISOLATE_AND_RELOCATE") and tx.covers("RESET_GPU", "RESET_GPU")
    assert list(tx.node_states) == [
        "active",
        "isolated",
        "resetting",
        "awaiting_repair",
        "revalidating",
        "standby",
        "quarantined",
    ]
    assert tx.actions["REVALIDATE"].lifecycle == taxonomy.Lifecycle(
        acting="revalidating", done="standby", rejected="quarantined", next="REJOIN", trigger="pool_full"
    )
    assert tx.actions["OBSERVE"].lifecycle == taxonomy.Lifecycle()
    states = set(tx.node_states)
    assert all(a in states and b in states for a, b, _ in tx.transitions())


@pytest.mark.parametrize(
    ("action", "change", "message"),
    [
        (
            "ISOLATE_AND_RELOCATE",
            {"supersedes": ["RESET_GPUS"]},
            "action ISOLATE_AND_RELOCATE: supersedes names 'RESET_GPUS', which is not an action",
        ),
        ("REJOIN", {"follows": ["REBOOT"]}, "action REJOIN: follows names 'REBOOT', which is not an action"),
        ("RESET_GPU", {"supersedes": "ISOLATE_AND_RELOCATE"}, "action RESET_GPU: 'supersedes' must be a list"),
        (
            "RESET_GPU",
            {"lifecycle": {"acting": "rebooting"}},
            "action RESET_GPU: lifecycle.acting 'rebooting' is not one of the node_states",
        ),
        (
            "REVALIDATE",
            {"lifecycle": {"acting": "revalidating", "done": "standby", "next": "REJOIN", "trigger": "tomorrow"}},
            "action REVALIDATE: lifecycle.trigger 'tomorrow' is not one of done, repaired, pool_full",
        ),
        (
            "RESET_GPU",
            {"lifecycle": {"acting": "resetting", "next": "REVALIDAT", "trigger": "done"}},
            "action RESET_GPU: lifecycle.next 'REVALIDAT' is not an action",
        ),
        (
            "RESET_GPU",
            {"lifecycle": {"acting": "resetting", "next": "REVALIDATE"}},
            "action RESET_GPU: lifecycle.next and lifecycle.trigger go together",
        ),
        ("OBSERVE", {"lifecycle": {"after": "active"}}, "action OBSERVE: lifecycle.after is not one of acting"),
        ("OBSERVE", {"fastpath": "yes"}, "action OBSERVE: 'fastpath' must be true or false, got 'yes'"),
        ("OBSERVE", {"requeues_job": None}, "action OBSERVE: 'requeues_job' must be true or false"),
    ],
)
def test_a_bad_action_field_is_named(doc: dict[str, Any], action: str, change: dict[str, Any], message: str) -> None:
    doc["actions"][action].update(change)
    with pytest.raises(TaxonomyError, match=re.escape("taxonomy: " + message)):
        Taxonomy(doc)
    if not any(ref in message for ref in ("is not an action", "node_states")):  # references: the loader's
        assert taxonomy.check_schema(doc), "the JSON schema refuses it too"


@pytest.mark.parametrize("field", ["fastpath", "first_response", "requeues_job", "supersedes", "follows", "lifecycle"])
def test_every_action_field_is_required(doc: dict[str, Any], field: str) -> None:
    del doc["actions"]["RESET_GPU"][field]
    with pytest.raises(TaxonomyError, match=re.escape(f"taxonomy: action RESET_GPU: {field!r} is missing")):
        Taxonomy(doc)
    assert any(f"'{field}' is a required property" in e for e in taxonomy.check_schema(doc))


def test_node_states_are_required(doc: dict[str, Any]) -> None:
    del doc["node_states"]
    with pytest.raises(TaxonomyError, match="missing top-level key 'node_states'"):
        Taxonomy(doc)


def test_no_fault_maps_to_a_follow_up(doc: dict[str, Any]) -> None:
    doc["faults"][78]["action"] = "REVALIDATE"
    with pytest.raises(TaxonomyError, match=r"\(id 'xid-79'\): action 'REVALIDATE' is a follow-up"):
        Taxonomy(doc)
