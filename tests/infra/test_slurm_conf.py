"""One Slurm configuration, two places: the lab's slurm.conf is the `dev` stack's rendered one (the
slurm-operator's settings, then the Controller's extraConf) plus exactly `LAB_DIFFERENCES`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetheal import cli
from fleetheal.infra import slurm_hooks
from fleetheal.lab import slurmconf
from fleetheal.slurm import conf

#: Keys a slurm.conf may repeat, one line each.
_MULTI = ("NodeName", "PartitionName", "NodeSet")


def parse(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """slurm.conf as Slurm reads it: `{key: value}` (a later line wins) and the repeated lines by key."""
    single: dict[str, str] = {}
    multi: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, value = line.partition("=")
        if key in _MULTI:
            multi.setdefault(key, []).append(value)
        else:
            single[key] = value
    return single, multi


@pytest.fixture(scope="module")
def rendered_extra_conf(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("render") / "dev"
    assert cli.main(["render", "--stack", "dev", "--out", str(out)]) == 0
    (controller,) = out.rglob("Controller-*.yaml")
    extra: str = yaml.safe_load(controller.read_text())["spec"]["extraConf"]
    return extra


def lab_conf(tmp: Path) -> str:
    return slurmconf.slurm_conf(
        cluster_name="fleetheal",
        slurm_user="root",
        state_dir=tmp,
        ctld_port=7000,
        munge_socket=tmp / "munge" / "munge.socket",
        node_ports={"n1": 7001, "n2": 7002},
        cpus_per_node=8,
        gpus_per_node=8,
        gpu_type=None,
        partition="gpu",
        plugin_dir=tmp / "plugins",
        extra=[],
    )


def test_the_lab_runs_the_rendered_conf_but_for_exactly_the_listed_differences(
    rendered_extra_conf: str, tmp_path: Path
) -> None:
    operator = "\n".join(s.line() for s in conf.OPERATOR_SETTINGS)
    deployed, deployed_multi = parse(operator + "\n" + rendered_extra_conf)
    lab, lab_multi = parse(lab_conf(tmp_path))
    differ = {k for k in deployed.keys() | lab.keys() if deployed.get(k) != lab.get(k)}
    differ |= {k for k in _MULTI if deployed_multi.get(k) != lab_multi.get(k)}
    assert differ == set(slurmconf.LAB_DIFFERENCES)
    for key, diff in slurmconf.LAB_DIFFERENCES.items():
        assert diff.why, key
        if diff.value is None:
            assert key not in lab, key
        elif diff.value != slurmconf.LOCAL:
            assert lab[key] == diff.value, key
    # The shared settings really are shared: the stack's timers the lab has not overridden reach it.
    assert lab["UnkillableStepTimeout"] == str(conf.UNKILLABLE_STEP_TIMEOUT_S)
    assert lab["JobRequeue"] == deployed["JobRequeue"] == "1"


def test_the_reference_grace_is_the_dev_stacks(rendered_extra_conf: str) -> None:
    deployed, _ = parse(rendered_extra_conf)
    assert deployed["KillWait"] == str(slurmconf.REFERENCE_GRACE_SECONDS)


def test_the_rendered_timers_keep_the_operators_auth_info_and_add_cred_expire(rendered_extra_conf: str) -> None:
    deployed, _ = parse(rendered_extra_conf)
    assert deployed["AuthInfo"] == f"use_client_ids,cred_expire={conf.CRED_EXPIRE_S}"
    assert deployed["SlurmdTimeout"] == str(conf.SLURMD_TIMEOUT_S)
    assert deployed["SchedulerParameters"] == f"sched_interval={conf.SCHED_INTERVAL_S},batch_sched_delay=3"


def test_every_setting_the_stack_renders_says_why_and_every_timer_its_cost() -> None:
    settings = conf.stack_settings(120, slurm_hooks.HEALTH_CHECK_PROGRAM)
    assert all(s.why for s in settings)
    timers = {"KillWait", "HealthCheckInterval", "AuthInfo", "SlurmdTimeout", "MessageTimeout", "SchedulerParameters"}
    timers.add("UnkillableStepTimeout")
    assert {s.key for s in settings if s.cost} == timers
    # docs/slurm-settings.md tables each of them.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "slurm-settings.md").read_text()
    for key in timers:
        assert f"`{key}" in doc, key


def test_lab_settings_need_every_local_value_and_nothing_else() -> None:
    with pytest.raises(ValueError, match="lab settings need exactly"):
        slurmconf.lab_settings({"ClusterName": "x"})
