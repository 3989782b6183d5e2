"""Every metric the agent exports is documented in docs/metrics.md, section "Agent"."""

from __future__ import annotations

from pathlib import Path

from fleetheal.agent.metrics import AgentMetrics
from fleetheal.contracts import METRIC_FAULT_ACTIVE, METRIC_FAULTS_TOTAL

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_agent_metric_is_documented():
    section = DOC.read_text().split("## Agent", 1)[1].split("\n## ", 1)[0]
    names = set()
    for family in AgentMetrics(process=False).registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "_info" if family.type == "info" else "")
        names.add(name)
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"document these in docs/metrics.md, section Agent: {missing}"
    assert {METRIC_FAULT_ACTIVE, METRIC_FAULTS_TOTAL} <= names
