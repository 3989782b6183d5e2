"""Fast checks that the Ansible content agrees with the taxonomy and the shared contracts."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import yaml

from fleetheal import contracts, taxonomy

REPO = Path(__file__).resolve().parents[2]
ROLES = sorted(p for p in (REPO / "roles").iterdir() if (p / "tasks" / "main.yml").exists())


def test_one_playbook_per_action_on_the_shared_skeleton() -> None:
    tx = taxonomy.load()
    for name, action in tx.actions.items():
        text = (REPO / "playbooks" / action.playbook).read_text()
        assert f"__fleetheal_playbook_action: {name}\n" in text, action.playbook
        for step in ("tasks/validate.yml", "tasks/guard.yml", "tasks/finish.yml", "tasks/failed.yml"):
            assert step in text, f"{action.playbook} skips {step}"
        # By hand the node names the host; from the remediator, one host per incident.
        assert "'fleetheal_control' if (fleetheal_node" in text and "else 'fleetheal_incidents'" in text


def test_no_playbook_sets_a_per_incident_variable() -> None:
    """The remediator passes an incident's variables as host variables (one host per incident in a
    batch), and play variables and vars files outrank those: a default for one of them there would
    silently replace every incident's value."""
    sources = [REPO / "playbooks" / "vars" / "remediation.yml", REPO / "playbooks" / "vars" / "taxonomy.yml"]
    for path in sources:
        assert not set(yaml.safe_load(path.read_text())) & set(contracts.PLAYBOOK_VARS), path
    tx = taxonomy.load()
    for action in tx.actions.values():
        for play in yaml.safe_load((REPO / "playbooks" / action.playbook).read_text()):
            assert not set(play.get("vars") or {}) & set(contracts.PLAYBOOK_VARS), action.playbook


def test_playbook_vars_agree_with_contracts() -> None:
    generated = yaml.safe_load((REPO / "playbooks" / "vars" / "taxonomy.yml").read_text())
    assert generated["fleetheal_drain_reason_prefix"] == contracts.DRAIN_REASON_PREFIX
    assert generated["fleetheal_k8s_prefix"] == contracts.K8S_PREFIX
    checks = "".join((REPO / "playbooks" / "tasks" / f).read_text() for f in ("validate.yml", "guard.yml"))
    checks += inspect.getsource(contracts.playbook_input_problem)
    for var in contracts.PLAYBOOK_VARS:
        assert var in checks or var.removeprefix("fleetheal_") in checks, f"nothing checks {var}"
    defaults = (REPO / "playbooks" / "vars" / "remediation.yml").read_text()
    assert 'fleetheal_standby_reason: "{{ fleetheal_drain_reason_prefix }}standby"' in defaults
    assert 'fleetheal_quarantine_reason: "{{ fleetheal_drain_reason_prefix }}quarantine"' in defaults


def test_reason_format_matches_contracts() -> None:
    validate = (REPO / "playbooks" / "tasks" / "validate.yml").read_text()
    # drain_reason() writes `fleetheal:<fault> incident=<id> gpu=<i>`; the playbook writes it through a filter
    # that calls it (playbooks/filter_plugins), never by a template of its own.
    assert contracts.drain_reason("xid-79", "inc-1", gpu="3") == "fleetheal:xid-79 incident=inc-1 gpu=3"
    assert '__fleetheal_reason: "{{ fleetheal_fault_id | fleetheal_drain_reason(fleetheal_incident_id,' in validate
    spec = importlib.util.spec_from_file_location(
        "inputs", REPO / "playbooks" / "filter_plugins" / "fleetheal_inputs.py"
    )
    assert spec is not None and spec.loader is not None
    inputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inputs)
    reason = inputs.FilterModule().filters()["fleetheal_drain_reason"]
    assert reason("xid-79", "inc-1", "3") == contracts.drain_reason("xid-79", "inc-1", "3")
    assert reason("xid-79", "inc-1", "") == reason("xid-79", "inc-1", None) == "fleetheal:xid-79 incident=inc-1"


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_role_defaults_are_prefixed_and_documented(role: Path) -> None:
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {}
    spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options), f"{role.name}: defaults and argument_specs differ"
    for key, value in defaults.items():
        assert key.startswith(role.name + "_"), key
        documented = options[key]
        assert documented.get("description"), f"{key} has no description"
        if "default" in documented:
            assert documented["default"] == value, (
                f"{key}: argument_specs default {documented['default']!r} != {value!r}"
            )


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_role_tasks_read_as_a_table_of_contents(role: Path) -> None:
    main = yaml.safe_load((role / "tasks" / "main.yml").read_text())
    names = [t["name"] for t in main]
    assert names[0] == "Preflight"
    assert all(set(t) <= {"name", "ansible.builtin.include_tasks", "when"} for t in main), main
    for template in (role / "templates").glob("*.j2") if (role / "templates").is_dir() else []:
        text = template.read_text()
        first = text.splitlines()[1] if text.startswith("#!") else text.splitlines()[0]
        assert first.startswith("{{ ansible_managed | comment"), f"{template.name} does not start with ansible_managed"
    text = "".join(p.read_text() for p in role.rglob("*.yml"))
    internal = [v for v in re.findall(r"\b(__[a-z_]+)\b", text) if v != "__pycache__"]  # a path, not a variable
    assert all(v.startswith(f"__{role.name}_") for v in internal), sorted(
        {v for v in internal if not v.startswith(f"__{role.name}_")}
    )


def test_handlers_are_named_restart_service() -> None:
    for role in ROLES:
        path = role / "handlers" / "main.yml"
        if path.exists():
            for handler in yaml.safe_load(path.read_text()):
                assert re.fullmatch(r"Restart [a-z0-9-]+", handler["name"]), handler["name"]


GOOD = {
    "fleetheal_incident_id": "inc-000007", "fleetheal_node": "n2", "fleetheal_fault_id": "xid-79",
    "fleetheal_fault_class": "hardware", "fleetheal_action": "ISOLATE_AND_RELOCATE", "fleetheal_cluster": "lab",
    "fleetheal_dry_run": False, "fleetheal_job_id": "12", "fleetheal_gpu": "3",
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "action", "problem"),
    [
        ({}, "ISOLATE_AND_RELOCATE", ""),
        ({"fleetheal_node": ""}, "ISOLATE_AND_RELOCATE", "fleetheal_node is required"),
        ({"fleetheal_dry_run": None}, "ISOLATE_AND_RELOCATE", "fleetheal_dry_run is required"),
        ({"fleetheal_node": "N2;x"}, "ISOLATE_AND_RELOCATE", "Malformed input: incident 'inc-000007', node 'N2;x'"),
        ({"fleetheal_incident_id": "inc-1\n"}, "ISOLATE_AND_RELOCATE", "Malformed input"),  # no trailing newline
        ({"fleetheal_job_id": "12 13"}, "ISOLATE_AND_RELOCATE", "Malformed input"),
        ({"fleetheal_gpu": "all"}, "ISOLATE_AND_RELOCATE", "Malformed input"),
        ({"fleetheal_dry_run": "maybe"}, "ISOLATE_AND_RELOCATE", "Malformed input"),
        ({"fleetheal_fault_id": "xid-0"}, "ISOLATE_AND_RELOCATE", "Unknown fault xid-0 or action ISOLATE_AND_RELOCATE"),
        ({}, "RESET_GPU", "isolate_and_relocate.yml runs ISOLATE_AND_RELOCATE, but this is the playbook for RESET_GPU"),
        (
            {"fleetheal_action": "OBSERVE"},
            "OBSERVE",
            "The taxonomy maps xid-79 (hardware) to ISOLATE_AND_RELOCATE, not OBSERVE",
        ),
        ({"fleetheal_action": "REVALIDATE"}, "REVALIDATE", ""),  # a follow-up of the fault's action
        ({"fleetheal_fault_class": "user"}, "ISOLATE_AND_RELOCATE", "fleetheal_fault_class user disagrees"),
    ],
)
def test_playbook_inputs_are_checked_in_order(change: dict[str, object], action: str, problem: str) -> None:
    """tasks/validate.yml asserts what contracts.playbook_input_problem finds: the first problem, or none."""
    tax = yaml.safe_load((REPO / "playbooks" / "vars" / "taxonomy.yml").read_text())
    followups = tax["fleetheal_followup_actions"]  # generated from the taxonomy's `follows`
    found = contracts.playbook_input_problem({**GOOD, **change}, tax, followups, action)
    assert found.startswith(problem) if problem else found == "", found


def test_the_report_module_writes_whole_reports_and_only_under_its_directory(tmp_path: Path) -> None:
    from fleetheal import steps

    sys.path.insert(0, str(REPO / "playbooks" / "collections"))
    try:
        report = importlib.import_module("ansible_collections.fleetheal.cluster.plugins.modules.report")
    finally:
        sys.path.remove(str(REPO / "playbooks" / "collections"))
    where = tmp_path / "reports"
    rows, extra = report.work(
        steps, None, {"dir": str(where), "name": "inc-1-observe.json", "content": {"a": 1}}, False
    )
    assert rows == [] and extra == {"path": str(where / "inc-1-observe.json")}
    assert yaml.safe_load((where / "inc-1-observe.json").read_text()) == {"a": 1}
    assert (where / "inc-1-observe.json").stat().st_mode & 0o777 == 0o640
    assert where.stat().st_mode & 0o777 == 0o750
    for bad in ("../escape.json", "", ".."):
        with pytest.raises(ValueError, match="a file name, without a directory"):
            report.work(steps, None, {"dir": str(where), "name": bad, "content": {}}, False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["inc-1-observe.json", "reports"]
