"""The policy pack stands alone: its own requirements and virtualenv, no import of the fleetheal package,
and the names it carries from fleetheal's contracts still equal them.

policies/__main__.py is never imported: constructing a PolicyPack starts a server and blocks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetheal import contracts
from fleetheal.infra import common, policy
from fleetheal.infra.policy import shared

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / "policies"


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {name.lower(): version for name, _, version in (line.partition("==") for line in lines if line)}


def test_fleetheal_reads_the_packs_rules_package() -> None:
    assert Path(policy.__file__).resolve() == PACK / "rules" / "__init__.py"


@pytest.mark.parametrize(
    "name", ["__main__.py", *sorted(p.relative_to(PACK).as_posix() for p in PACK.glob("rules/*.py"))]
)
def test_the_pack_imports_nothing_from_fleetheal(name: str) -> None:
    tree = ast.parse((PACK / name).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "fleetheal"}


def test_the_rules_load_without_the_fleetheal_package() -> None:
    # __main__.py would serve the pack; importing its rules module shows what the pack needs.
    probe = "import sys; sys.modules['fleetheal'] = None; import rules; print(len(rules.policies()))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=PACK, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(policy.policies())


def test_the_pack_project_is_a_standard_python_pack() -> None:
    doc = yaml.safe_load((PACK / "PulumiPolicy.yaml").read_text())
    assert doc["runtime"] == {"name": "python", "options": {"toolchain": "pip", "virtualenv": ".venv"}}


def test_the_packs_requirements_are_exact_and_match_the_repository_pins() -> None:
    pack, repo = _pins(PACK / "requirements.txt"), _pins(REPO / "requirements.txt")
    assert {"pulumi-policy", "pulumi", "pyyaml"} <= set(pack)
    assert all(pack.values()), pack
    assert {name: repo.get(name) for name in pack} == pack


def test_the_names_the_pack_carries_equal_fleetheals_contracts() -> None:
    names = (
        "LABEL_POOL",
        "LABEL_GPU_POOL",
        "LABEL_GPU_TYPE",
        "LABEL_MEMBERSHIP",
        "MEMBER_ROLES",
        "POOL_LENT",
        "TAINT_LENT",
    )
    for name in names:
        assert getattr(shared, name) == getattr(contracts, name), name
    # The Pulumi components take it from the pack itself: one definition.
    assert common.image_is_pinned is shared.image_is_pinned
    # The pack stands alone (no fleetheal import), so it carries its own copy of the cluster-name rule.
    assert shared.SLURM_CLUSTER_NAME == contracts.CLUSTER_NAME_PATTERN


@pytest.mark.parametrize(
    "entry", ["active rack-a", "standby leaf-3", "standby", "spare rack-a", "active rack a", "", "  active   r1  "]
)
def test_membership_entries_parse_as_the_remediator_parses_them(entry: str) -> None:
    try:
        expected: object = contracts.parse_membership_entry(entry)
    except ValueError as exc:
        with pytest.raises(ValueError) as got:
            shared.parse_membership_entry(entry)
        assert str(got.value) == str(exc)
    else:
        assert shared.parse_membership_entry(entry) == expected
