"""Simulated ETTR at 16,384 GPUs (`fleetheal.ettr`, Llama 3 Table 5 failure rates, docs/ettr.md).

For SEEDS seeds, each run with EVENTS interruptions at its best checkpoint interval: the fleetheal
profile against the manual-recovery baseline as the peer, side by side with the same random numbers.
Goal: ETTR >= 98.5%. The "p99" column is the 1st percentile over seeds (the bad tail of ETTR is low).

The fleetheal profile's platform timings (hardware detection, requeue, standby promotion, restart in
place) are bench_lab's figures (`fleetheal.ettr.profile_from_results`), in this order of preference:
measured earlier in the same `benchmarks/run.py` run (run.py runs this module last and passes it the
results so far), else the last results file (results/latest.json), else the built-in profile. The notes
say which values were used and where they came from. The application restart, replacement lead time and
standby share stay the profile's assumptions (docs/ettr.md). The breakdown says where the time goes, and
two what-if rows show what the goal needs: a cheaper checkpoint and a faster application restart.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetheal.ettr import (
    CHECKPOINT_S,
    FLEETHEAL,
    MANUAL,
    BenchResultsError,
    Profile,
    best_interval,
    profile_from_bench,
    profile_from_results,
)

GPUS = 16_384
SEEDS = 10
EVENTS = 2_000
RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"


def _low(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, round(0.01 * (len(s) - 1)))]


def _runs(profile: Profile, checkpoint_s: float = CHECKPOINT_S) -> list[Any]:
    return [best_interval(GPUS, profile, checkpoint_s=checkpoint_s, events=EVENTS, seed=s)[0] for s in range(SEEDS)]


def fleetheal_profile(earlier: list[dict[str, Any]] | None) -> tuple[Profile, str]:
    """The profile to simulate and a note saying where its platform timings come from."""
    why = []
    if earlier:
        try:
            bench = profile_from_results(earlier, FLEETHEAL, origin="this bench run")
            return bench.profile, bench.describe()
        except BenchResultsError as exc:
            why.append(str(exc))
    try:
        bench = profile_from_bench(RESULTS, FLEETHEAL)
        return bench.profile, f"bench_lab did not run in this run; {bench.describe()}"
    except BenchResultsError as exc:
        why.append(str(exc))
    return FLEETHEAL, f"built-in fleetheal profile (docs/ettr.md), no bench_lab figures: {'; '.join(why)}"


def run(earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    profile, source = fleetheal_profile(earlier)
    ours = _runs(profile)
    peer = _runs(MANUAL)
    e, p = [r.ettr for r in ours], [r.ettr for r in peer]
    shares = {k: statistics.median(r.breakdown()[k] for r in ours) for k in ours[0].seconds}
    where = ", ".join(f"{k} {100 * v:.2f}%" for k, v in shares.items() if k != "productive")
    interval = statistics.median(r.interval_s for r in ours)
    gap = 98.5 - 100 * statistics.median(e)
    verdict = f"goal missed by {gap:.2f} points" if gap > 0 else "goal met"
    figures = [
        {
            "name": f"simulated ETTR at {GPUS:,} GPUs (fleetheal vs manual recovery)",
            "unit": "%",
            "median": 100 * statistics.median(e),
            "p99": 100 * _low(e),
            "n": SEEDS,
            "goal": ">= 98.5%",
            "peer": 100 * statistics.median(p),
            "ratio_to_peer": statistics.median(e) / statistics.median(p),
            "notes": f"{verdict}; time lost: {where}; best interval {interval:.0f} s, checkpoint {CHECKPOINT_S:g} s; "
            f"{EVENTS} interruptions per run (Llama 3 Table 5 rates, MTBF 3.09 h); platform timings {source}",
            "profile": {k: v for k, v in vars(profile).items() if k != "name"},
        }
    ]
    for label, prof, ckpt in (
        ("checkpoint 0.5 s", profile, 0.5),
        ("checkpoint 0.5 s, app restart 20 s", replace(profile, restart_s=20.0), 0.5),
    ):
        what = [r.ettr for r in _runs(prof, ckpt)]
        figures.append(
            {
                "name": f"  what-if: {label}",
                "unit": "%",
                "median": 100 * statistics.median(what),
                "p99": 100 * _low(what),
                "n": SEEDS,
                "goal": ">= 98.5%",
                "peer": 100 * statistics.median(p),
                "ratio_to_peer": statistics.median(what) / statistics.median(p),
                "notes": "same model, seeds and platform timings, one assumption changed",
            }
        )
    return figures
