"""Configuration: one YAML file plus environment overrides, strict, with the token kept secret."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from fleetheal import contracts
from fleetheal.remediator import config as cfgmod
from tests.remediator.conftest import TOKEN, make_config

EXAMPLE = Path(cfgmod.__file__).with_name("example.yaml")


def test_the_example_file_is_complete_and_valid():
    cfg = cfgmod.load(EXAMPLE, env={})
    assert cfg.cluster.name == "lab"
    assert cfg.cluster.domains() == {"rack-a": 2, "rack-b": 2}
    # The example lists every key of every section.
    doc = yaml.safe_load(EXAMPLE.read_text())
    for section in ("listen", "auth", "webhook", "store", "runner", "gate", "leader_election"):
        fields = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        assert set(doc[section]) == fields, section
    for sub in ("budget", "breaker", "lemon"):
        fields = {f.name for f in dataclasses.fields(getattr(cfg.gate, sub))}
        assert set(doc["gate"][sub]) == fields, sub


def test_the_examples_defaults_are_the_code_defaults():
    doc = yaml.safe_load(EXAMPLE.read_text())
    defaults = cfgmod.Config()
    examples = {"cluster", "token_file", "playbook_dir", "pause_file"}  # marked "example" in the file
    for section in ("listen", "webhook", "store", "runner", "gate"):
        for key, value in doc[section].items():
            if key in examples or (isinstance(value, dict) and key not in ("envvars", "site_vars")):
                continue
            expected = getattr(getattr(defaults, section), key)
            if isinstance(expected, tuple):
                expected = list(expected)
            if key in ("envvars", "site_vars"):
                expected = dict(expected)
            if key == "roles_path":
                continue  # depends on the checkout
            assert value == expected, f"{section}.{key}"
    for sub in ("budget", "breaker", "lemon"):
        for key, value in doc["gate"][sub].items():
            assert value == getattr(getattr(defaults.gate, sub), key), f"gate.{sub}.{key}"


def test_environment_overrides(tmp_path):
    cfg = make_config(
        tmp_path,
        env={
            "FLEETHEAL_REMEDIATOR_GATE__DRY_RUN": "true",
            "FLEETHEAL_REMEDIATOR_GATE__BUDGET__MAX_ISOLATED": "3",
            "FLEETHEAL_REMEDIATOR_LISTEN__PORT": "9200",
            "FLEETHEAL_REMEDIATOR_RUNNER__ENV_PASSTHROUGH": "PATH,HOME",
            "FLEETHEAL_REMEDIATOR_RUNNER__SECRET_VARS": "[fleetheal_a, fleetheal_b]",
            "FLEETHEAL_REMEDIATOR_CLUSTER__NODES": "{n1: rack-a, n2: rack-b}",
        },
    )
    assert cfg.gate.dry_run is True
    assert cfg.gate.budget.max_isolated == 3
    assert cfg.listen.port == 9200
    assert cfg.runner.env_passthrough == ("PATH", "HOME")
    assert cfg.runner.secret_vars == ("fleetheal_a", "fleetheal_b")
    assert dict(cfg.cluster.nodes) == {"n1": "rack-a", "n2": "rack-b"}


def test_a_bad_environment_variable_names_itself(tmp_path):
    with pytest.raises(
        cfgmod.ConfigError,
        match=r"gate\.budget\.max_isolated \(from FLEETHEAL_REMEDIATOR_GATE__BUDGET__MAX_ISOLATED\): expected an integer",
    ):
        make_config(tmp_path, env={"FLEETHEAL_REMEDIATOR_GATE__BUDGET__MAX_ISOLATED": "many"})
    # the old one-underscore spelling is refused with the new name, never ignored (a lost dry_run would act)
    with pytest.raises(
        cfgmod.ConfigError,
        match=r"FLEETHEAL_REMEDIATOR_GATE_DRY_RUN: .*did you mean FLEETHEAL_REMEDIATOR_GATE__DRY_RUN\?",
    ):
        make_config(tmp_path, env={"FLEETHEAL_REMEDIATOR_GATE_DRY_RUN": "true"})
    with pytest.raises(cfgmod.ConfigError, match=r"FLEETHEAL_REMEDIATOR_GATE__DRYRUN: no setting 'dryrun'"):
        make_config(tmp_path, env={"FLEETHEAL_REMEDIATOR_GATE__DRYRUN": "true"})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"gate": {"budgett": {}}}, "gate.budgett: unknown key; did you mean 'budget'?"),
        ({"cluster": {"name": "lab", "nodes": {"Bad_Name": "r"}}}, "is not an RFC 1123 node name"),
        ({"gate": {"budget": {"max_isolated_fraction": 2}}}, "must be between 0 and 1"),
        ({"gate": {"dry_run": "perhaps"}}, "gate.dry_run: expected true or false"),
        ({"listen": {"tls_cert_file": "/x.pem"}}, "set both for TLS"),
        ({"store": {"synchronous": "OFF"}}, "store.synchronous"),
        ({"runner": {"envvars": {"bad name": "x"}}}, "is not an environment variable name"),
        ({"runner": {"site_vars": {"fleetheal_node": "gpu-001"}}}, "'fleetheal_node' is not a site setting"),
        ({"runner": {"site_vars": {"grace": 3}}}, "'grace' is not a site setting"),
        ({"runner": {"site_vars": {"fleetheal_x": {1, 2}}}}, r"runner.site_vars.fleetheal_x: only strings"),
        ({"bogus": {}}, "bogus: unknown key; known keys: cluster, listen"),
        ({"listen": {"max_connections": 0}}, r"listen.max_connections: 0 must be >= 1"),
        ({"listen": {"header_timeout_s": 0}}, r"listen.header_timeout_s: 0.0 must be > 0"),
        ({"listen": {"header_timeout_s": "nan"}}, r"listen.header_timeout_s: nan must be > 0"),
        ({"webhook": {"body_timeout_s": -1}}, r"webhook.body_timeout_s: -1.0 must be > 0"),
        ({"webhook": {"body_timeout_s": "soon"}}, r"webhook.body_timeout_s: expected a number"),
    ],
)
def test_invalid_configs_name_the_key(tmp_path, sections, message):
    with pytest.raises(cfgmod.ConfigError, match=message):
        make_config(tmp_path, **sections)


def test_a_cluster_needs_its_nodes():
    with pytest.raises(cfgmod.ConfigError, match=r"cluster\.nodes: list the cluster's nodes"):
        cfgmod.from_mapping({"cluster": {"name": "lab"}}, env={})


def test_the_token_comes_from_a_file_or_the_environment_and_is_never_printed(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    cfg = cfgmod.from_mapping({"cluster": {"nodes": {"n1": "r"}}, "auth": {"token_file": str(token_file)}}, env={})
    assert cfg.token == "from-the-file-0123456789"
    assert "from-the-file" not in repr(cfg)
    env_cfg = cfgmod.from_mapping(
        {"cluster": {"nodes": {"n1": "r"}}, "auth": {"token_file": str(token_file)}},
        env={"FLEETHEAL_REMEDIATOR_TOKEN": TOKEN},
    )
    assert env_cfg.token == TOKEN
    assert TOKEN not in repr(env_cfg) and TOKEN not in str(env_cfg)


def test_a_short_or_missing_token_refuses_to_serve(tmp_path):
    cfg = cfgmod.from_mapping({"cluster": {"nodes": {"n1": "r"}}}, env={"FLEETHEAL_REMEDIATOR_TOKEN": "short"})
    with pytest.raises(cfgmod.ConfigError, match="at least 16 characters"):
        cfgmod.require_token(cfg)


def test_node_and_cluster_names_follow_the_one_rule_in_contracts():
    assert contracts.is_node_name("gpu-001.rack-a.example") and contracts.is_node_name("a" * 63)
    for bad in ("", "-a", "a-", "A", "a_b", "a..b", "a" * 64, "a\n", "é", ("a" * 60 + ".") * 5 + "a", None, 7):
        assert not contracts.is_node_name(bad), bad
    assert contracts.is_cluster_name("fleet-a") and contracts.is_cluster_name("a" * 40)
    for bad in ("", "1a", "Fleet", "a_b", "a" * 41, "a\n", None):
        assert not contracts.is_cluster_name(bad), bad


def _keys(cls, prefix):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or f.name in ("budget", "breaker", "lemon"):
            sub = {"budget": cfgmod.BudgetConfig, "breaker": cfgmod.BreakerConfig, "lemon": cfgmod.LemonConfig}[f.name]
            yield from _keys(sub, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_key_is_documented_with_its_default():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "remediator.md").read_text()
    for section, cls in cfgmod._SECTIONS.items():
        for key in _keys(cls, f"{section}."):
            assert f"| `{key}` |" in doc, f"document {key} in docs/remediator.md"


def test_a_site_setting_the_first_responder_cannot_use_is_refused_at_load(tmp_path):
    from fleetheal.remediator.config import ConfigError, load

    path = tmp_path / "r.yaml"
    path.write_text(
        "cluster: {name: c, nodes: {n1: rack-1}}\n"
        "runner: {site_vars: {fleetheal_grace_seconds: soon, fleetheal_slurm_retries: 1}}\n"
    )
    with pytest.raises(ConfigError, match=r"runner\.site_vars"):
        load(str(path))


def test_failover_needs_a_fleet_file_that_names_this_cluster(tmp_path):
    from fleetheal.remediator.config import ConfigError, load

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("clusters: {a: {checkpoint_stores: [shared]}, b: {}}\ncheckpoint_stores: {shared: {path: /c}}\n")
    path = tmp_path / "r.yaml"
    for failover, error in (
        ({"enabled": True}, "failover.fleet_file: required"),
        ({"enabled": True, "fleet_file": str(fleet)}, "failover.slurm_cluster: 'default' is not a cluster"),
        (
            {"enabled": True, "fleet_file": str(fleet), "slurm_cluster": "a", "default_store": "x"},
            "'x' is not a checkpoint store",
        ),
        ({"enabled": True, "fleet_file": str(tmp_path / "none.yaml"), "slurm_cluster": "a"}, "none.yaml"),
        ({"wait_s": -1}, "failover: wait_s >= 0"),
    ):
        path.write_text(yaml.safe_dump({"cluster": {"nodes": {"a1": "leaf-1"}}, "failover": failover}))
        with pytest.raises(ConfigError, match=re.escape(error)):
            load(path, env={"FLEETHEAL_REMEDIATOR_TOKEN": "x" * 20})
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {"nodes": {"a1": "leaf-1"}},
                "failover": {"enabled": True, "fleet_file": str(fleet), "slurm_cluster": "a"},
            }
        )
    )
    cfg = load(path, env={"FLEETHEAL_REMEDIATOR_TOKEN": "x" * 20})
    assert cfg.failover.cluster_name(cfg.cluster) == "a"
