"""Recovery profiles: how interruptions are noticed and handled, in seconds (docs/ettr.md, "Profiles").

fleetheal's profile takes its platform timings from the lab benchmark (`benchmarks/bench_lab.py`) as
`benchmarks/run.py` records them (`benchmarks/results/latest.json`): they are read, never copied into the
code. What the lab does not measure is assumed (`FLEETHEAL_ASSUMED`). The peers, `manual` and `llama3`, are
assumptions from published practice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetheal.agent.training import MonitorConfig
from fleetheal.ettr.model import Profile

#: Where `benchmarks/run.py` writes its results, relative to the repository root (the working directory
#: of `make bench`); `fleetheal ettr simulate --results` defaults to it.
DEFAULT_RESULTS = Path("benchmarks/results/latest.json")
#: fleetheal's assumptions, for what the lab does not measure: a crash is seen by Slurm at once; a hang only
#: after the agent's hang timeout (its `training.hang_timeout_s` default); a large job's application restart
#: (launch, NCCL init, checkpoint load) takes 60 s where the lab's toy job restarts in well under a second;
#: a replacement node (repair or provisioning) takes 4 h; 1% of the job's nodes are warm standby.
FLEETHEAL_ASSUMED: dict[str, float] = {
    "restart_s": 60.0,
    "detect_crash_s": 1.0,
    "detect_symptom_s": MonitorConfig().hang_timeout_s,
    "replace_s": 4 * 3600.0,
    "standby_fraction": 0.01,
}
# Manual-ish recovery, the peer: an interruption is noticed when the job stalls (PyTorch's default NCCL
# collective timeout, 10 min, for hardware and hangs; a crash is seen when the job exits), an operator
# triages and drains the node (15 min), resubmits (5 min); the replacement node comes from the cluster's
# free capacity (no warm standby, no lead time when capacity exists: Llama 3's job ran inside a larger
# cluster), and the application restarts as in fleetheal's profile.
MANUAL = Profile(
    name="manual",
    detect_hw_s=600.0,
    detect_crash_s=60.0,
    detect_symptom_s=600.0,
    isolate_s=900.0,
    requeue_s=300.0,
    promote_s=0.0,
    restart_s=FLEETHEAL_ASSUMED["restart_s"],
    replace_s=0.0,
    standby_fraction=0.0,
)
# Llama 3-like: largely automated restarts ("only three interruptions required significant manual
# intervention") but slow to notice (hang/timeout based), no warm standby pool, spare capacity in the cluster.
LLAMA3 = Profile(
    name="llama3",
    detect_hw_s=300.0,
    detect_crash_s=60.0,
    detect_symptom_s=600.0,
    isolate_s=120.0,
    requeue_s=120.0,
    promote_s=0.0,
    restart_s=120.0,
    replace_s=0.0,
    standby_fraction=0.0,
)
PEERS = {p.name: p for p in (MANUAL, LLAMA3)}
NAMES = ("fleetheal", *sorted(PEERS))

#: bench_lab's figures the profile is taken from: (stable key, name prefix for results written before keys).
BENCH_FIGURES = {
    "drained": ("xid79_drained", "Xid 79 -> Slurm node drained"),
    "running": ("xid79_running_again", "Xid 79 -> job RUNNING again"),
    "in_place": ("nccl_running_again", "NCCL timeout -> training running again"),
}


class BenchResultsError(ValueError):
    """The benchmark results cannot give a profile (no file, not JSON, no lab figures)."""


@dataclass(frozen=True)
class BenchProfile:
    """fleetheal's profile with its platform timings from bench_lab's figures, and what was taken from where."""

    profile: Profile
    origin: str  # where the figures came from (a path, "this bench run")
    when: str | None  # the bench run's time (results' meta.when), when known
    used: dict[str, dict[str, Any]]  # profile field -> {"value", "from", "n"}
    assumed: dict[str, float]  # profile fields not measured (FLEETHEAL_ASSUMED)

    def describe(self) -> str:
        """One line: the measured values used and the assumptions kept."""
        used = ", ".join(f"{k} {v['value']:.2f} s ({v['from']})" for k, v in self.used.items())
        kept = ", ".join(f"{k} {v:g}" for k, v in self.assumed.items())
        when = f", run {self.when}" if self.when else ""
        return f"measured by bench_lab ({self.origin}{when}): {used}; assumed: {kept}"

    def as_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "when": self.when, "used": self.used, "assumed": self.assumed}


def _bench_figure(results: Sequence[dict[str, Any]], what: str) -> dict[str, Any] | None:
    key, prefix = BENCH_FIGURES[what]
    lab = [r for r in results if r.get("module", "lab") == "lab" and "error" not in r]
    for r in [r for r in lab if r.get("key") == key] or [r for r in lab if str(r.get("name", "")).startswith(prefix)]:
        median = r.get("median")
        if isinstance(median, (int, float)) and math.isfinite(median) and int(r.get("n") or 0) > 0:
            return r
    return None


def profile_from_results(results: Sequence[dict[str, Any]], *, origin: str, when: str | None = None) -> BenchProfile:
    """fleetheal's profile from bench_lab's figures (the `results` of benchmarks/run.py).

    From "Xid 79 -> Slurm node drained" (median): detect_hw_s, with isolate_s 0 (the agent's drain is the
    isolation). From "Xid 79 -> training running again on healthy nodes (hot spare)" (median, and its per-phase
    medians when recorded): requeue_s = requeue - drained, promote_s = RUNNING again - requeue (without a requeue phase,
    requeue_s = RUNNING again - drained and promote_s 0). From "NCCL timeout -> training running again in
    place" (median), when present: in_place_s. Everything else is `FLEETHEAL_ASSUMED`.
    """
    drained, running = _bench_figure(results, "drained"), _bench_figure(results, "running")
    if running is None:
        raise BenchResultsError(
            f"{origin}: no lab figure 'Xid 79 -> job RUNNING again' with a median; run the lab benchmark "
            "(`python benchmarks/run.py --only lab`, needs root)"
        )
    recorded = running.get("phases")
    phases: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    again = float(running["median"])
    if drained is not None:
        drain, drain_from, drain_n = float(drained["median"]), "Xid 79 -> drained, median", drained.get("n")
    elif isinstance(phases.get("drain"), (int, float)):
        drain, drain_from, drain_n = float(phases["drain"]), "Xid 79 drained phase, median", running.get("n")
    else:
        drain, drain_from, drain_n = 0.0, "no drain figure: 0", None
    drain = min(drain, again)
    n = running.get("n")
    used: dict[str, dict[str, Any]] = {
        "detect_hw_s": {"value": drain, "from": drain_from, "n": drain_n},
        "isolate_s": {"value": 0.0, "from": "the agent's drain is the isolation", "n": drain_n},
    }
    requeue = phases.get("requeue")
    if isinstance(requeue, (int, float)) and drain <= requeue <= again:
        used["requeue_s"] = {"value": requeue - drain, "from": "Xid 79 requeue phase - drained, medians", "n": n}
        used["promote_s"] = {"value": again - requeue, "from": "Xid 79 RUNNING again - requeue phase, medians", "n": n}
    else:
        used["requeue_s"] = {"value": again - drain, "from": "Xid 79 RUNNING again - drained, medians", "n": n}
        used["promote_s"] = {"value": 0.0, "from": "no requeue phase recorded: counted in requeue_s", "n": n}
    nccl = _bench_figure(results, "in_place")
    if nccl is not None:
        used["in_place_s"] = {
            "value": float(nccl["median"]),
            "from": "NCCL timeout -> running again in place, median",
            "n": nccl.get("n"),
        }
    # A transient interruption without an in-place figure takes requeue_s (Profile.in_place_s None).
    profile = Profile(name="fleetheal", **FLEETHEAL_ASSUMED, **{k: v["value"] for k, v in used.items()})
    return BenchProfile(profile, origin, when, used, dict(FLEETHEAL_ASSUMED))


def profile_from_bench(path: str | os.PathLike[str] = DEFAULT_RESULTS) -> BenchProfile:
    """`profile_from_results` of a results file written by benchmarks/run.py."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise BenchResultsError(f"{p}: no benchmark results (`make bench` writes them)") from exc
    except (OSError, ValueError) as exc:
        raise BenchResultsError(f"{p}: not readable benchmark results: {exc}") from exc
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, list):
        raise BenchResultsError(f"{p}: not benchmarks/run.py results (no 'results' list)")
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    return profile_from_results([r for r in results if isinstance(r, dict)], origin=str(p), when=meta.get("when"))
