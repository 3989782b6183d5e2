"""Generated files: never stale, and the alert rules behave under promtool."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetheal import generate, taxonomy

PROMTOOL = shutil.which("promtool")


def test_checked_in_files_are_up_to_date(repo: Path) -> None:
    stale = generate.stale(repo)
    assert stale == [], f"stale generated files {stale}: run `make generate` and commit the result"


def test_check_names_the_command_to_run(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "policies").mkdir()
    shutil.copy(repo / "policies" / "faults.yaml", tmp_path / "policies" / "faults.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "fleetheal", "generate", "--check", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "stale: policies/alert-rules.yml (run `fleetheal generate` or `make generate`)" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "fleetheal", "generate", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert generate.stale(tmp_path) == []


def test_ansible_vars_map_every_fault(repo: Path) -> None:
    doc = yaml.safe_load((repo / generate.ANSIBLE_VARS).read_text())
    tx = taxonomy.load()
    assert doc["fleetheal_taxonomy_faults"]["xid-79"] == {
        "class": "hardware",
        "action": "ISOLATE_AND_RELOCATE",
        "severity": "critical",
    }
    assert set(doc["fleetheal_taxonomy_faults"]) == set(tx.faults)
    assert set(doc["fleetheal_taxonomy_actions"]) == set(tx.actions)
    assert doc["fleetheal_drain_reason_prefix"] == "fleetheal:"


def test_every_alerting_fault_has_one_rule() -> None:
    tx = taxonomy.load()
    rules = [r for g in generate.alert_rule_groups() for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules)
    assert {r["labels"]["fault_id"] for r in rules} == {f.id for f in tx if f.severity != "info"}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) missing: run scripts/bootstrap.sh")
def test_promtool_checks_and_unit_tests_the_rules(repo: Path) -> None:
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(repo / generate.ALERT_RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [PROMTOOL, "test", "rules", str(repo / "tests" / "promtool" / "alert-rules.test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo / "tests" / "promtool",
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout + tests.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) missing: run scripts/bootstrap.sh")
def test_promtool_checks_and_unit_tests_the_health_rules(repo: Path) -> None:
    """The hand-written rules on fleetheal's own health: the standby shortfall and the healing's blind spots."""
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(repo / "policies" / "health-rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [PROMTOOL, "test", "rules", "health-rules.test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo / "tests" / "promtool",
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_taxonomy_check_cli(shared: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetheal",
            "taxonomy",
            "check",
            "--catalog",
            str(shared / "reference" / "xid-catalog.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("taxonomy OK: ")
    out = subprocess.run(
        [sys.executable, "-m", "fleetheal", "taxonomy", "check", "--catalog", "/nonexistent.csv"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "cannot read /nonexistent.csv" in out.stderr


@pytest.mark.parametrize("check", [False, True])
def test_a_broken_policy_file_is_named_not_a_traceback(
    repo: Path, monkeypatch: pytest.MonkeyPatch, check: bool
) -> None:
    """A message catalog (or log rules, or taxonomy) that does not load: `fleetheal generate` says why, as a
    usage error, and writes nothing."""
    import argparse

    from fleetheal.errors import UsageError
    from fleetheal.logcatalog import CatalogError

    def broken() -> dict[str, str]:
        raise CatalogError("message catalog: not valid YAML: line 428")

    monkeypatch.setattr(generate, "rendered", broken)
    with pytest.raises(UsageError, match="not valid YAML: line 428"):
        generate.run(argparse.Namespace(root=repo, check=check))
