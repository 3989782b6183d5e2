"""The fleet file: named sections per cluster/dataset/store, cross-references checked, overrides by variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetheal.fleet import config
from fleetheal.settings import ConfigError

GOOD = """\
federation: fed
clusters:
  a: {gpu_type: h100, gpus_per_node: 8, checkpoint_stores: [shared]}
  b: {gpu_type: h100, checkpoint_stores: [shared]}
  c: {gpu_type: a100, gpus_per_node: 4}
datasets:
  imagenet: {size_gb: 150, clusters: [a, c]}
checkpoint_stores:
  shared: {path: /shared/checkpoints}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_reads_every_section(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, GOOD), env={})
    assert cfg.federation == "fed"
    assert list(cfg.clusters) == ["a", "b", "c"]
    assert cfg.clusters["c"] == config.Cluster(gpu_type="a100", gpus_per_node=4)
    assert cfg.clusters["b"].gpus_per_node == 8  # the default
    assert cfg.datasets["imagenet"].clusters == ("a", "c")
    assert cfg.readers("shared") == ("a", "b")
    assert cfg.source == str(tmp_path / "fleet.yaml")


def test_environment_overrides_a_section_key(tmp_path: Path) -> None:
    env = {"FLEETHEAL_FLEET_PLACEMENT__SMALL_JOB_MAX_GPUS": "4", "FLEETHEAL_FLEET_CONFIG": "ignored"}
    assert config.load(write(tmp_path, GOOD), env=env).placement.small_job_max_gpus == 4


def test_the_file_may_come_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    assert config.load(env={"FLEETHEAL_FLEET_CONFIG": str(path)}).federation == "fed"
    with pytest.raises(ConfigError, match="--fleet FILE or set FLEETHEAL_FLEET_CONFIG"):
        config.load(env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            GOOD.replace("gpu_type: a100", "gpu_typ: a100"),
            r"clusters\.c\.gpu_typ: unknown key; did you mean 'gpu_type'",
        ),
        (GOOD.replace("clusters: [a, c]", "clusters: [a, z]"), r"datasets\.imagenet\.clusters: 'z' is not one of"),
        (GOOD.replace("checkpoint_stores: [shared]}", "checkpoint_stores: [nas]}", 1), r"'nas' is not one of"),
        (GOOD.replace("  c: {", "  C_1: {"), r"cluster name 'C_1'"),
        (GOOD.replace("gpus_per_node: 4", "gpus_per_node: 0"), r"clusters\.c\.gpus_per_node: must be at least 1"),
        (GOOD.replace("gpus_per_node: 4", "gpus_per_node: four"), r"clusters\.c\.gpus_per_node: expected an integer"),
        ("clusters: [a, b]\n", r"clusters: expected a mapping"),
    ],
)
def test_mistakes_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config.load(write(tmp_path, text), env={})
    assert str(info.value).startswith(str(tmp_path / "fleet.yaml"))


def test_a_mistyped_variable_is_refused(tmp_path: Path) -> None:
    env = {"FLEETHEAL_FLEET_PLACEMENT_SMALL_JOB_MAX_GPUS": "4"}
    with pytest.raises(ConfigError, match="did you mean FLEETHEAL_FLEET_PLACEMENT__SMALL_JOB_MAX_GPUS"):
        config.load(write(tmp_path, GOOD), env=env)
