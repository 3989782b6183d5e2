"""Agent config: one YAML file plus FLEETHEAL_AGENT_* overrides, clear errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetheal import taxonomy
from fleetheal.agent.config import AgentConfig, ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, text):
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return p


def test_defaults_and_node_from_slurm():
    cfg = load_config(None, env={"SLURMD_NODENAME": "gpu-007"})
    assert cfg.node == "gpu-007"
    assert cfg.mode == "act"
    assert cfg.backend.kind == "nvml"
    assert cfg.fastpath.drain_actions == ("ISOLATE_AND_RELOCATE", "RESET_GPU")
    # the default is the taxonomy's `fastpath: true` actions (policies/faults.yaml)
    assert cfg.fastpath.drain_actions == cfg.fastpath.taint_actions == taxonomy.load().fastpath_actions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = "observe"  # type: ignore[misc]


def test_the_example_config_is_valid():
    cfg = load_config(REPO / "agent" / "agent.example.yaml", env={})
    assert isinstance(cfg, AgentConfig)
    assert cfg.node


def test_file_and_env_overrides(tmp_path):
    p = _write(tmp_path, "node: n1\nbackend:\n  kind: simulated\n  simulated: {gpus: 4}\n")
    env = {
        "FLEETHEAL_AGENT_MODE": "observe",
        "FLEETHEAL_AGENT_BACKEND__SIMULATED__GPUS": "64",
        "FLEETHEAL_AGENT_FASTPATH__DRAIN_ACTIONS": "[ISOLATE_AND_RELOCATE]",
        "FLEETHEAL_AGENT_POLL_INTERVAL_S": "2",
        "OTHER": "ignored",
    }
    cfg = load_config(p, env=env)
    assert cfg.observe_only
    assert cfg.backend.kind == "simulated"
    assert cfg.backend.simulated.gpus == 64
    assert cfg.fastpath.drain_actions == ("ISOLATE_AND_RELOCATE",)
    assert cfg.poll_interval_s == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mode: fix-it\n", "mode: 'fix-it' is not one of act, observe"),
        ("backend: {kind: nvm}\n", "backend.kind: 'nvm' is not one of nvml, simulated"),
        ("pol_interval_s: 1\n", "pol_interval_s: unknown key; did you mean 'poll_interval_s'?"),
        ("backend: {simulated: {gpu: 8}}\n", "backend.simulated.gpu: unknown key; did you mean 'gpus'?"),
        ("poll_interval_s: fast\n", "poll_interval_s: expected a number, got 'fast'"),
        ("poll_interval_s: 0\n", "poll_interval_s: must be > 0, got 0.0"),
        ("backend: {expected_gpus: 8.5}\n", "backend.expected_gpus: expected an integer, got 8.5"),
        ("kernel_log: {enabled: 'yes please'}\n", "kernel_log.enabled: expected true or false"),
        ("fastpath: {drain_actions: [REBOOT]}\n", "fastpath.drain_actions: 'REBOOT' is not a taxonomy action"),
        ("metrics: {port: 70000}\n", "metrics.port: must be 0..65535"),
        ("training: {straggler_min_ranks: 1}\n", "training.straggler_min_ranks: must be >= 2"),
        ("backend: 3\n", "backend: expected a mapping of settings, got int"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("mode: [unclosed\n", "not valid YAML"),
    ],
)
def test_errors_name_the_file_key_and_fix(tmp_path, text, message):
    p = _write(tmp_path, "node: n1\n" + text if not text.startswith("-") else text)
    with pytest.raises(ConfigError) as err:
        load_config(p, env={})
    assert str(err.value).startswith(str(p))
    assert message in str(err.value)


def test_env_errors_name_the_variable(tmp_path):
    with pytest.raises(
        ConfigError, match=r"FLEETHEAL_AGENT_MOD: no setting 'mod' \(did you mean FLEETHEAL_AGENT_MODE\?\)"
    ):
        load_config(None, env={"FLEETHEAL_AGENT_MOD": "act", "FLEETHEAL_AGENT_NODE": "n1"})
    with pytest.raises(ConfigError, match="FLEETHEAL_AGENT_MODE__X: 'mode' is not a section"):
        load_config(None, env={"FLEETHEAL_AGENT_MODE__X": "1", "FLEETHEAL_AGENT_NODE": "n1"})
    with pytest.raises(
        ConfigError, match=r"metrics\.port \(from FLEETHEAL_AGENT_METRICS__PORT\): expected an integer, got 'http'"
    ):
        load_config(None, env={"FLEETHEAL_AGENT_METRICS__PORT": "http", "FLEETHEAL_AGENT_NODE": "n1"})
    # one underscore where the rule (fleetheal.settings) wants two
    with pytest.raises(
        ConfigError, match=r"FLEETHEAL_AGENT_METRICS_PORT: .*did you mean FLEETHEAL_AGENT_METRICS__PORT\?"
    ):
        load_config(None, env={"FLEETHEAL_AGENT_METRICS_PORT": "9000", "FLEETHEAL_AGENT_NODE": "n1"})


def test_the_shared_value_rules(tmp_path):
    """Booleans, numbers and lists read the same in the file and the environment (fleetheal.settings)."""
    p = _write(
        tmp_path, "node: n1\nkernel_log: {enabled: 'off'}\npoll_interval_s: '2.5'\ntraining: {trusted_uids: 7}\n"
    )
    cfg = load_config(
        p,
        env={
            "FLEETHEAL_AGENT_TRAINING__ENABLED": "no",
            "FLEETHEAL_AGENT_FASTPATH__TAINT_ACTIONS": "RESET_GPU,ISOLATE_AND_RELOCATE",
        },
    )
    assert cfg.kernel_log.enabled is False and cfg.training.enabled is False
    assert cfg.poll_interval_s == 2.5
    assert cfg.training.trusted_uids == (7,)
    assert cfg.fastpath.taint_actions == ("RESET_GPU", "ISOLATE_AND_RELOCATE")
    with pytest.raises(ConfigError, match=r"poll_interval_s: must be > 0, got nan"):
        load_config(None, env={"FLEETHEAL_AGENT_POLL_INTERVAL_S": "nan", "FLEETHEAL_AGENT_NODE": "n1"})


def test_the_configured_classes_take_their_sections():
    """health, thresholds and the training judgements are the classes' own settings, not copies."""
    from fleetheal.agent.health import HealthConfig, Thresholds
    from fleetheal.agent.training import MonitorConfig

    cfg = load_config(None, env={"FLEETHEAL_AGENT_NODE": "n1"})
    assert cfg.health == HealthConfig()
    assert cfg.thresholds == Thresholds()
    assert isinstance(cfg.training, MonitorConfig)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml", env={})


def test_an_operators_log_rules_are_validated_when_the_config_loads(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n- id: my-rule\n  log: kernel\n  description: d\n  keywords: [Xid]\n"
        "  pattern: 'NVRM: Xid (unclosed'\n  fault: xid-79\n"
    )
    with pytest.raises(ConfigError, match=r"kernel_log.rules_file: .*my-rule.*'pattern'"):
        load_config(None, env={"FLEETHEAL_AGENT_KERNEL_LOG__RULES_FILE": str(rules)})
    rules.write_text(rules.read_text().replace("(unclosed", "\\(PCI:"))
    # A rule that drains a node must say why its line alone justifies it.
    with pytest.raises(ConfigError, match=r"kernel_log.rules_file: .*my-rule.*'evidence' must say why"):
        load_config(None, env={"FLEETHEAL_AGENT_KERNEL_LOG__RULES_FILE": str(rules)})
    rules.write_text(rules.read_text() + "  evidence: only the driver prints it\n")
    cfg = load_config(None, env={"FLEETHEAL_AGENT_KERNEL_LOG__RULES_FILE": str(rules)})
    assert cfg.kernel_log.rules_file == str(rules)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(None, env={"FLEETHEAL_AGENT_KERNEL_LOG__RULES_FILE": str(tmp_path / "missing.yaml")})
