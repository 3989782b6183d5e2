"""The playbook variables the steps need (`Settings`), with the defaults of `playbooks/vars/remediation.yml`.

Read with fleetheal.settings's coercion, like every other fleetheal setting: a variable `fleetheal_<name>` sets
field `<name>`; names the steps do not use are ignored (the playbooks have many more).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fleetheal import contracts, settings

#: What the playbook variables' names start with.
PREFIX = "fleetheal_"


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
    standby_reason: str = contracts.STANDBY_REASON
    quarantine_reason: str = contracts.DRAIN_REASON_PREFIX + "quarantine"
    promote_standby: bool = True
    kubeconfig: str = ""
    k8s_in_cluster: bool = False
    report_dir: str = "/var/lib/fleetheal/reports"

    @classmethod
    def from_vars(cls, values: Mapping[str, Any]) -> Settings:
        """From playbook variables (`fleetheal_<name>`); names it does not use are ignored, an empty value
        (`null`) keeps the default. ConfigError (a ValueError) names the variable."""
        doc: dict[str, Any] = {}
        for f in fields(cls):
            key = PREFIX + f.name
            raw = values.get(key)
            if raw is None:
                continue
            if isinstance(raw, str):
                # vars/remediation.yml writes the owned pool reasons with the one template Ansible would
                # render from the contract; any other template cannot be rendered outside Ansible.
                raw = raw.replace("{{ fleetheal_drain_reason_prefix }}", contracts.DRAIN_REASON_PREFIX)
                if "{{" in raw or "{%" in raw:
                    raise settings.ConfigError(f"{key}: {raw!r} is a Jinja template; give the remediator a plain value")
            if f.type in (bool, "bool") and str(raw) in ("1", "0"):
                raw = str(raw) == "1"  # Ansible's own booleans: -e fleetheal_promote_standby=0
            doc[f.name] = raw
        try:
            return settings.build(cls, doc, {}, PREFIX)
        except settings.ConfigError as exc:
            raise settings.ConfigError(f"{PREFIX}{exc}") from None

    @classmethod
    def load(cls, playbook_dir: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Settings:
        """`vars/remediation.yml` under `playbook_dir` (when there is one), then `overrides` (the remediator's
        site vars). The field defaults above are that file's values (tests/ansible/test_steps.py keeps them equal)."""
        path = Path(playbook_dir) / "vars" / "remediation.yml"
        values = settings.read_yaml(path) if path.is_file() else {}
        values.update(dict(overrides or {}))
        return cls.from_vars(values)

    @property
    def kubernetes(self) -> bool:
        return bool(self.kubeconfig) or self.k8s_in_cluster
