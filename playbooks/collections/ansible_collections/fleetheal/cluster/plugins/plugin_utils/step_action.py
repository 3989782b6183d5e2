"""The action plugin behind every fleetheal.cluster module: its step runs in the controller.

The playbooks run on the control host (`ansible_connection=local`). As modules, each task on each host
paid for a new interpreter that imported fleetheal and the Kubernetes client again: measured in a
20-incident batch run, about 1.3 s of a shared 2-core machine per cordon, more than all of the step's API
calls. The strategy imports this file in the controller when it first meets the task, before it forks the
workers, so each task starts with both already loaded (`Kube.preload`: the client loads its APIs lazily,
and CoreV1Api alone cost each worker about a second of CPU). A target that is not the controller itself
gets the module, as before."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from ansible.plugins.action import ActionBase
from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import COMMON_ARGS, step_result

try:
    from fleetheal import steps
except ImportError:  # the controller's interpreter has no fleetheal: the module reports it
    steps = None
else:
    with contextlib.suppress(ImportError):  # no client: the Kubernetes steps report it
        steps.Kube.preload()


class StepAction(ActionBase):
    TRANSFERS_FILES = False
    #: The module (plugins/modules/<MODULE>.py) whose ARGUMENT_SPEC and work this runs.
    MODULE = ""

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        if steps is None or getattr(self._connection, "transport", "") != "local":
            result.update(self._execute_module(module_name=self._task.action, task_vars=task_vars))
            return result
        module = importlib.import_module(f"ansible_collections.fleetheal.cluster.plugins.modules.{self.MODULE}")
        _, args = self.validate_argument_spec(argument_spec={**module.ARGUMENT_SPEC, **COMMON_ARGS})
        result.update(step_result(steps, module.work, args, bool(self._task.check_mode)))
        return result
