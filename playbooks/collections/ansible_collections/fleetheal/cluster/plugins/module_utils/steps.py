"""What every fleetheal.cluster module shares: the common options and running a fleetheal.steps step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule

#: Options every module takes besides its own.
COMMON_ARGS: dict[str, dict[str, Any]] = {
    "dry_run": {"type": "bool", "default": False},
    "settings": {"type": "dict", "default": {}},
}

Work = Callable[[Any, Any, Any, bool], tuple[list[Any], dict[str, Any]]]


def run_module(argument_spec: dict[str, dict[str, Any]], work: Work) -> None:
    """Parse the options, call `work(steps, settings, params, dry_run)` -> (results, extra return values),
    and exit with `steps` (the report rows) and `changed`; a StepError fails the task with its message."""
    module = AnsibleModule(argument_spec={**argument_spec, **COMMON_ARGS}, supports_check_mode=True)
    try:
        from fleetheal import steps
    except ImportError as exc:
        module.fail_json(msg=f"fleetheal is not importable by this interpreter ({exc}); install it there")
    p = module.params
    settings = steps.Settings.from_vars(p["settings"])
    try:
        results, extra = work(steps, settings, p, bool(p["dry_run"] or module.check_mode))
    except steps.StepError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=any(r.changed for r in results), steps=[r.as_dict() for r in results], **extra)
