"""What every fleetheal.cluster module shares: the common options and running a fleetheal.steps step.

A module's step runs in one of two places with the same code (`step_result`): in the controller, through
the collection's action plugin of the same name (the playbooks run on the control host, so that is where
the module would run anyway, without a new interpreter per task), or as a module (`run_module`), when the
target is not the controller itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.module_utils.basic import AnsibleModule

#: Options every module takes besides its own.
COMMON_ARGS: dict[str, dict[str, Any]] = {
    "dry_run": {"type": "bool", "default": False},
    "settings": {"type": "dict", "default": {}},
}

Work = Callable[[Any, Any, Any, bool], tuple[list[Any], dict[str, Any]]]


def step_result(steps: Any, work: Work, params: Mapping[str, Any], check_mode: bool) -> dict[str, Any]:
    """Call `work(steps, settings, params, dry_run)` -> (results, extra return values) and return the task's
    result: `steps` (the report rows) and `changed`, or `failed` with the message of a StepError or of
    settings that cannot be used."""
    try:
        settings = steps.Settings.from_vars(params["settings"])
        results, extra = work(steps, settings, params, bool(params["dry_run"] or check_mode))
    except (steps.StepError, ValueError, OSError) as exc:
        return {"failed": True, "msg": str(exc)}
    return {"changed": any(r.changed for r in results), "steps": [r.as_dict() for r in results], **extra}


def run_module(argument_spec: dict[str, dict[str, Any]], work: Work) -> None:
    """`step_result` as a module: parse the options, exit with the result or fail with its message."""
    module = AnsibleModule(argument_spec={**argument_spec, **COMMON_ARGS}, supports_check_mode=True)
    try:
        from fleetheal import steps
    except ImportError as exc:
        module.fail_json(msg=f"fleetheal is not importable by this interpreter ({exc}); install it there")
    result = step_result(steps, work, module.params, module.check_mode)
    if result.get("failed"):
        module.fail_json(msg=result["msg"])
    module.exit_json(**result)
