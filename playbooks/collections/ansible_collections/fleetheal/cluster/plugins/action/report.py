"""fleetheal.cluster.report runs in the controller (plugin_utils/step_action.py)."""

from __future__ import annotations

from ansible_collections.fleetheal.cluster.plugins.plugin_utils.step_action import StepAction


class ActionModule(StepAction):
    MODULE = "report"
