"""`fleetheal render`: one deterministic YAML file per object, secrets redacted, stale files removed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetheal import cli
from fleetheal.infra import render
from tests.k8s_schemas import SchemaSet

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_render_writes_every_object_once_and_valid(
    tmp_path: Path, k8s_schemas: SchemaSet, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dev"
    assert cli.main(["render", "--stack", "dev", "--out", str(out)]) == 0
    assert "wrote 69 objects for stack dev" in capsys.readouterr().out
    files = sorted(p for p in out.rglob("*.yaml"))
    assert len(files) == 69
    kinds = set()
    for path in files:
        text = path.read_text()
        assert text.startswith("# Rendered by `fleetheal render --stack dev`")
        (obj,) = list(yaml.safe_load_all(text))
        kinds.add(obj["kind"])
        assert k8s_schemas.errors(obj) == [], path
    for kind in (
        "NodeSet",
        "Controller",
        "LoginSet",
        "Accounting",
        "RestApi",
        "DaemonSet",
        "PrometheusRule",
        "ServiceMonitor",
        "AlertmanagerConfig",
        "ClusterQueue",
        "LocalQueue",
        "ResourceFlavor",
        "PersistentVolumeClaim",
        "ClusterRole",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Role",
        "Deployment",
    ):
        assert kind in kinds, kind
    controller = (out / "slurm" / "Controller-lab.yaml").read_text()
    assert "  extraConf: |\n    JobRequeue=1\n" in controller  # block style: a readable diff


def test_render_is_deterministic_and_replaces_a_previous_render(tmp_path: Path) -> None:
    out = tmp_path / "r"
    render.write(render.render_stack("dev"), out)
    first = _tree(out)
    (out / "slurm" / "Stale-object.yaml").write_text("old")
    render.write(render.render_stack("dev"), out)
    assert _tree(out) == first


def test_render_refuses_a_directory_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        cli.main(["render", "--stack", "dev", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_render_redacts_secret_values(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", root)
    stack = yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())
    stack["config"]["fleetheal:remediatorToken"] = "plain-text-token-for-the-test-0123456789"
    stack["config"]["fleetheal:slurmJwtKey"] = {"secure": "v1:AAAA"}  # encrypted: not readable here
    (root / "Pulumi.ci.yaml").write_text(yaml.safe_dump(stack))
    files = render.render_stack("ci", root)
    secret = yaml.safe_load(files["fleetheal-system/Secret-fleetheal-remediator-token.yaml"].split("---\n", 1)[1])
    assert secret["stringData"] == {"token": render.REDACTED}
    assert not any("plain-text-token" in text for text in files.values())
    assert "slurm/Secret-slurm-auth-jwt.yaml" not in files  # an encrypted value is left to the real engine


def test_render_reports_a_bad_stack_with_the_key(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", root)
    (root / "Pulumi.bad.yaml").write_text("config:\n  fleetheal:slinkyMode: kustomize\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetheal",
            "render",
            "--stack",
            "bad",
            "--out",
            str(tmp_path / "o"),
            "--root",
            str(root),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "fleetheal:slinkyMode: 'kustomize' is not accepted; use one of: manifests, helm" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_render_with_policy_check_passes_the_example_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", "--stack", "dev", "--out", str(tmp_path / "o"), "--policy"]) == 0
    assert "0 policy violation(s)" in capsys.readouterr().out


def test_render_keeps_the_remediator_store_password_out_of_every_file(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", root)
    stack = yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())
    stack["config"].update(
        {
            "fleetheal:remediatorReplicas": 2,
            "fleetheal:remediatorStore": "postgres-in-cluster",
            "fleetheal:remediatorDbPassword": "plain-db-password-for-the-test",
        }
    )
    (root / "Pulumi.ha.yaml").write_text(yaml.safe_dump(stack))
    files = render.render_stack("ha", root)
    secret = yaml.safe_load(files["fleetheal-system/Secret-fleetheal-remediator-store.yaml"].split("---\n", 1)[1])
    assert secret["stringData"] == {"password": render.REDACTED, "url": render.REDACTED}
    assert not any("plain-db-password" in text for text in files.values())
    assert "fleetheal-system/StatefulSet-fleetheal-remediator-db.yaml" in files
    # encrypted (not readable here): the Secret is left to the real engine, the database still renders
    stack["config"]["fleetheal:remediatorDbPassword"] = {"secure": "v1:AAAA"}
    (root / "Pulumi.ha.yaml").write_text(yaml.safe_dump(stack))
    files = render.render_stack("ha", root)
    assert "fleetheal-system/Secret-fleetheal-remediator-store.yaml" not in files
    assert "fleetheal-system/StatefulSet-fleetheal-remediator-db.yaml" in files
