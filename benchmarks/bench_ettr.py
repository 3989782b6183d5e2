"""Simulated ETTR at 16,384 GPUs (`fleetheal.ettr`, Llama 3 Table 5 failure rates, docs/ettr.md).

For SEEDS seeds, each run with EVENTS interruptions at its best checkpoint interval: the fleetheal
profile against the manual-recovery baseline as the peer, side by side with the same random numbers.
Goal: ETTR >= `fleetheal.ettr.model.GOAL`. The "p99" column is the 1st percentile over seeds (the bad tail
of ETTR is low).

The fleetheal profile's platform timings (hardware detection, requeue, standby promotion, restart in
place) are bench_lab's figures (`fleetheal.ettr.profile.profile_from_results`): measured earlier in the same
`benchmarks/run.py` run (run.py runs this module last and passes it the results so far), else the last
results file (results/latest.json). The notes say which values were used and where they came from. The
application restart, replacement lead time and standby share stay the profile's assumptions
(docs/ettr.md). The breakdown says where the time goes, and two what-if rows show what the goal needs: a
cheaper checkpoint and a faster application restart.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fleetheal.ettr.model import CHECKPOINT_S, GOAL, Profile, Result, best_interval, mtbf_s
from fleetheal.ettr.profile import MANUAL, BenchProfile, BenchResultsError, profile_from_bench, profile_from_results

GPUS = 16_384
SEEDS = 10
EVENTS = 2_000
RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"


def _low(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, round(0.01 * (len(s) - 1)))]


def _runs(profile: Profile, checkpoint_s: float = CHECKPOINT_S) -> list[Result]:
    return [best_interval(GPUS, profile, checkpoint_s=checkpoint_s, events=EVENTS, seed=s)[0] for s in range(SEEDS)]


def fleetheal_profile(earlier: list[dict[str, Any]] | None) -> tuple[BenchProfile, str]:
    """The profile to simulate and a note saying where its platform timings come from."""
    why = []
    if earlier:
        try:
            bench = profile_from_results(earlier, origin="this bench run")
            return bench, bench.describe()
        except BenchResultsError as exc:
            why.append(str(exc))
    try:
        bench = profile_from_bench(RESULTS)
    except BenchResultsError as exc:
        raise BenchResultsError("; ".join([*why, str(exc)])) from exc
    return bench, f"bench_lab did not run in this run; {bench.describe()}"


def run(earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    bench, source = fleetheal_profile(earlier)
    profile = bench.profile
    ours = _runs(profile)
    peer = _runs(MANUAL)
    e, p = [r.ettr for r in ours], [r.ettr for r in peer]
    shares = {k: statistics.median(r.breakdown()[k] for r in ours) for k in ours[0].seconds}
    where = ", ".join(f"{k} {100 * v:.2f}%" for k, v in shares.items() if k != "productive")
    interval = statistics.median(r.interval_s for r in ours)
    gap = 100 * (GOAL - statistics.median(e))
    verdict = f"goal missed by {gap:.2f} points" if gap > 0 else "goal met"
    goal = f">= {GOAL:.1%}"
    figures = [
        {
            "name": f"simulated ETTR at {GPUS:,} GPUs (fleetheal vs manual recovery)",
            "unit": "%",
            "median": 100 * statistics.median(e),
            "p99": 100 * _low(e),
            "n": SEEDS,
            "goal": goal,
            "peer": 100 * statistics.median(p),
            "ratio_to_peer": statistics.median(e) / statistics.median(p),
            "notes": f"{verdict}; time lost: {where}; best interval {interval:.0f} s, checkpoint {CHECKPOINT_S:g} s; "
            f"{EVENTS} interruptions per run (Llama 3 Table 5 rates, MTBF {mtbf_s(GPUS) / 3600:.2f} h); "
            f"platform timings {source}",
            "profile": {k: v for k, v in asdict(profile).items() if k != "name"},
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
                "goal": goal,
                "peer": 100 * statistics.median(p),
                "ratio_to_peer": statistics.median(what) / statistics.median(p),
                "notes": "same model, seeds and platform timings, one assumption changed",
            }
        )
    return figures
