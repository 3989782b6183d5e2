"""The playbook variables the steps need (`Settings`), with the defaults of `playbooks/vars/remediation.yml`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetheal import contracts


@dataclass(frozen=True)
class Settings:
    """The playbook variables the steps need, defaults from `playbooks/vars/remediation.yml`."""

    slurm_env: Mapping[str, str] = field(default_factory=dict)
    slurm_bin_dir: str = ""
    slurm_retries: int = 3
    slurm_retry_delay_s: float = 2.0
    slurm_timeout_s: float = 30.0
    grace_signal: str = "USR1"
    grace_seconds: float = 120.0
    priority_boost: int = 1000
    max_restarts: int = 3
    restart_mode: str = "requeue"
    standby_reason: str = contracts.DRAIN_REASON_PREFIX + "standby"
    quarantine_reason: str = contracts.DRAIN_REASON_PREFIX + "quarantine"
    promote_standby: bool = True
    kubeconfig: str = ""
    k8s_in_cluster: bool = False
    report_dir: str = "/var/lib/fleetheal/reports"

    @classmethod
    def from_vars(cls, values: Mapping[str, Any]) -> Settings:
        """From playbook variables (`fleetheal_<name>`); names it does not use are ignored."""
        kwargs: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            key = f"fleetheal_{f.name}"
            if key not in values:
                continue
            raw = values[key]
            if isinstance(raw, str):
                # vars/remediation.yml writes the owned pool reasons with the one template Ansible would
                # render from the contract; any other template cannot be rendered outside Ansible.
                raw = raw.replace("{{ fleetheal_drain_reason_prefix }}", contracts.DRAIN_REASON_PREFIX)
                if "{{" in raw or "{%" in raw:
                    raise ValueError(f"{key}: {raw!r} is a Jinja template; give the remediator a plain value")
            default = getattr(cls, f.name, None)
            if f.name == "slurm_env":
                kwargs[f.name] = {str(k): str(v) for k, v in dict(raw or {}).items()}
            elif isinstance(default, bool):
                kwargs[f.name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                kwargs[f.name] = int(raw)
            elif isinstance(default, float):
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = str(raw)
        return cls(**kwargs)

    @classmethod
    def load(cls, playbook_dir: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Settings:
        """`vars/remediation.yml` under `playbook_dir` (when there is one), then `overrides` (the remediator's
        site vars). The field defaults above are that file's values (tests/ansible/test_steps.py keeps them equal)."""
        path = Path(playbook_dir) / "vars" / "remediation.yml"
        values = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
        values.update(dict(overrides or {}))
        return cls.from_vars(values)

    @property
    def kubernetes(self) -> bool:
        return bool(self.kubeconfig) or self.k8s_in_cluster
