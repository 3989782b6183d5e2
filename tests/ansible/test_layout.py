"""Fast checks that the Ansible content agrees with the taxonomy and the shared contracts."""

from __future__ import annotations

import re
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
    for var in contracts.PLAYBOOK_VARS:
        assert var in checks, f"validate.yml and guard.yml never check {var}"
    defaults = (REPO / "playbooks" / "vars" / "remediation.yml").read_text()
    assert 'fleetheal_standby_reason: "{{ fleetheal_drain_reason_prefix }}standby"' in defaults
    assert 'fleetheal_quarantine_reason: "{{ fleetheal_drain_reason_prefix }}quarantine"' in defaults


def test_reason_format_matches_contracts() -> None:
    validate = (REPO / "playbooks" / "tasks" / "validate.yml").read_text()
    # drain_reason() writes `fleetheal:<fault> incident=<id> gpu=<i>`; the playbook builds the same.
    assert contracts.drain_reason("xid-79", "inc-1", gpu="3") == "fleetheal:xid-79 incident=inc-1 gpu=3"
    assert "{{ fleetheal_drain_reason_prefix }}{{ fleetheal_fault_id }} incident={{ fleetheal_incident_id" in validate
    assert "' gpu=' ~ fleetheal_gpu" in validate


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
