"""What every step returns (`StepResult`, in the shape of the playbooks' report) and raises (`StepError`)."""

from __future__ import annotations

from dataclasses import dataclass


class StepError(RuntimeError):
    """A Slurm or Kubernetes command failed after its retries."""


@dataclass(frozen=True, slots=True)
class StepResult:
    step: str  # slurm_drain, slurm_signal, slurm_requeue, standby_promote, k8s_cordon, k8s_promote
    outcome: str  # done | would | skipped | failed
    detail: str
    changed: bool = False
    #: for a promotion: the standby node promoted for the incident (now or by an earlier run)
    node: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"step": self.step, "outcome": self.outcome, "detail": self.detail}
