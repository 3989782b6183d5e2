"""`Dependencies`: whether what the steps act through (slurmctld, the Kubernetes API server) answers now."""

from __future__ import annotations

from fleetheal.steps.kube import Kube
from fleetheal.steps.result import StepError
from fleetheal.steps.settings import Settings
from fleetheal.steps.slurm import Slurm

_SLURM_OUTAGE = (" is DOWN", "timed out", "Unable to contact", "Connection refused", "TimeoutExpired")


class Dependencies:
    """Whether what the steps act through answers now: slurmctld (`scontrol ping`) and, when configured, the
    Kubernetes API server (`/version`). The remediator asks before it retries a failed playbook attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.slurm = Slurm(settings)
        self._kube: Kube | None = None

    def unavailable(self) -> dict[str, str]:
        """{dependency: why} for each one that does not answer (empty: all answer)."""
        down = {}
        try:
            self.slurm.run("scontrol", "ping", retries=0)
        except StepError as exc:
            # An outage is a controller that is DOWN or does not answer. A client with no configuration at
            # all (no Slurm here: tests with stand-in playbooks) is not waited for.
            if any(word in str(exc) for word in _SLURM_OUTAGE):
                down["slurm"] = " ".join(str(exc).split())[:200]
        if self.settings.kubernetes:
            self._kube = self._kube or Kube(self.settings)
            why = self._kube.unavailable()
            if why:
                down["kubernetes"] = why
        return down
