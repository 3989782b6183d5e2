"""docs/grafana/fleetheal.json: a loadable Grafana dashboard whose every query names documented metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "fleetheal.json"
METRIC = re.compile(r"\bfleetheal_[a-z0-9_]+")
SUFFIXES = ("_bucket", "_sum", "_count")


def documented() -> set[str]:
    """Metric names in docs/metrics.md's tables (first column, possibly several names in one cell)."""
    names: set[str] = set()
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("| `fleetheal_"):
            names |= set(re.findall(r"`(fleetheal_[a-z0-9_]+)`", line.split("|")[1]))
    return names


def exprs(doc: dict[str, Any]) -> list[str]:
    out = [a["expr"] for a in doc.get("annotations", {}).get("list", []) if a.get("expr")]
    for panel in doc["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    return out


def base(name: str, known: set[str]) -> str:
    if name in known:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in known:
            return name.removesuffix(suffix)
    return name


def test_dashboard_loads_and_has_the_panels() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 30
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in doc["panels"]).lower()
    for wanted in ("ettr", "phase", "timeline", "recovery", "fleet"):
        assert wanted in titles
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        assert p["type"] == "row" or p["targets"], p["title"]


def test_every_queried_metric_is_documented() -> None:
    doc = json.loads(DASHBOARD.read_text())
    known = documented()
    assert "fleetheal_remediator_phase_seconds" in known and "fleetheal_ettr_effective_training_time_ratio" in known
    queried = set()
    for expr in exprs(doc):
        found = METRIC.findall(expr)
        assert found, f"query names no fleetheal metric: {expr}"
        queried |= {base(n, known) for n in found}
    missing = queried - known
    assert not missing, f"queried but not in docs/metrics.md: {sorted(missing)}"
    # histogram suffixes are only used on histograms
    hist = {m for m in known if f"`{m}` | histogram" in (REPO / "docs" / "metrics.md").read_text()}
    for expr in exprs(doc):
        for name in METRIC.findall(expr):
            if name.endswith(SUFFIXES) and name not in known:
                assert base(name, known) in hist, name
