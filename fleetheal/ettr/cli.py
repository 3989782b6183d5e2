"""`fleetheal ettr simulate`: the simulator (fleetheal.ettr.model) over scales, a profile against a baseline.

`register` returns the `ettr` command's subparsers: the top-level CLI lets the lab add `fleetheal ettr measure`
there (ETTR measured on a lab run, fleetheal.lab.measure), as this package sits below the lab.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fleetheal.errors import UsageError
from fleetheal.ettr.model import CHECKPOINT_S, GPUS_PER_NODE, SCALES, Profile, SimulationError, sweep
from fleetheal.ettr.profile import DEFAULT_RESULTS, NAMES, PEERS, BenchProfile, BenchResultsError, profile_from_bench
from fleetheal.ettr.rates import FAILURE_RATES, SOURCE


def _scales(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"scales are GPU counts separated by commas, got {text!r}") from exc
    if not vals or any(v < GPUS_PER_NODE or v % GPUS_PER_NODE for v in vals):
        raise argparse.ArgumentTypeError(f"each scale must be a positive multiple of {GPUS_PER_NODE} GPUs: {text!r}")
    return vals


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if v < 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _share(text: str) -> float:
    v = _nonneg(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, got {text}")
    return v


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse._SubParsersAction[Any]:
    p = sub.add_parser(
        "ettr",
        help="effective training time ratio: simulate it at scale, measure it on a lab run",
        description="Effective training time ratio (ETTR). See docs/ettr.md.",
    )
    esub = p.add_subparsers(dest="ettr_command", metavar="SUBCOMMAND", required=True)
    s = esub.add_parser(
        "simulate",
        help="discrete-event model of a training job under Llama 3 failure rates",
        description=(
            "Simulate ETTR of a training job on N GPUs with per-component failure rates (Llama 3 Table 5), "
            "checkpointing, detection, recovery and a warm-standby pool, against a manual-recovery baseline. "
            "fleetheal's platform timings come from the lab benchmark's results (--results)."
        ),
    )
    s.add_argument(
        "--scales", type=_scales, default=list(SCALES), help="GPU counts, e.g. 1024,16384 (default: 1,024 to 131,072)"
    )
    s.add_argument("--profile", choices=NAMES, default="fleetheal", help="recovery profile (default fleetheal)")
    s.add_argument("--baseline", choices=NAMES, default="manual", help="peer profile (default manual)")
    s.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS,
        metavar="RESULTS.json",
        help=(
            "benchmarks/run.py results with bench_lab's figures: the fleetheal profile's platform timings "
            "(hardware detection, requeue, promotion, restart in place) come from there "
            f"(default: {DEFAULT_RESULTS}, from the repository root). Other tweaks apply on top"
        ),
    )
    s.add_argument(
        "--checkpoint-cost",
        type=_nonneg,
        default=CHECKPOINT_S,
        metavar="S",
        help=f"blocking seconds per checkpoint (default {CHECKPOINT_S:g})",
    )
    s.add_argument(
        "--interval", type=_nonneg, default=None, metavar="S", help="checkpoint interval (default: search for the best)"
    )
    s.add_argument(
        "--standby", type=_share, default=None, metavar="SHARE", help="warm-standby nodes as a share of the job's nodes"
    )
    s.add_argument("--replace", type=_nonneg, default=None, metavar="S", help="replacement node lead time, seconds")
    s.add_argument("--restart", type=_nonneg, default=None, metavar="S", help="application restart seconds")
    s.add_argument("--detect", type=_nonneg, default=None, metavar="S", help="detection seconds for hardware faults")
    s.add_argument(
        "--recovery", type=_nonneg, default=None, metavar="S", help="requeue seconds (alert to job requeued)"
    )
    s.add_argument(
        "--grace-save",
        type=_share,
        default=None,
        metavar="SHARE",
        help="share of interruptions saved by the grace checkpoint",
    )
    s.add_argument(
        "--events", type=_positive_int, default=2_000, help="interruptions per simulated run (default 2,000)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--plot", type=Path, metavar="FILE.png", help="plot ETTR against scale (matplotlib, Agg)")
    s.set_defaults(func=_cmd_simulate)
    return esub


def _tweaked(args: argparse.Namespace, p: Profile) -> Profile:
    """`p` with the profile options given on the command line."""
    changes: dict[str, Any] = {}
    for arg, field in (
        ("standby", "standby_fraction"),
        ("replace", "replace_s"),
        ("restart", "restart_s"),
        ("detect", "detect_hw_s"),
        ("recovery", "requeue_s"),
        ("grace_save", "grace_save"),
    ):
        v = getattr(args, arg)
        if v is not None:
            changes[field] = v
    return replace(p, **changes) if changes else p


def _fleetheal(path: Path) -> BenchProfile:
    try:
        return profile_from_bench(path)
    except BenchResultsError as exc:
        raise UsageError(
            f"--results {exc}; fleetheal's platform timings come from there: run from the repository root or "
            "pass --results FILE"
        ) from exc


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.interval is not None and args.interval <= 0:
        raise UsageError("--interval must be > 0 seconds")
    bench = _fleetheal(args.results) if "fleetheal" in (args.profile, args.baseline) else None
    profiles = {**PEERS, **({"fleetheal": bench.profile} if bench else {})}
    profile = _tweaked(args, profiles[args.profile])
    baseline = profiles[args.baseline]
    try:
        results = sweep(
            args.scales,
            [profile, baseline],
            checkpoint_s=args.checkpoint_cost,
            interval_s=args.interval,
            events=args.events,
            seed=args.seed,
        )
    except SimulationError as exc:
        raise UsageError(str(exc)) from exc
    rows: list[dict[str, Any]] = []
    for i in range(0, len(results), 2):
        r, b = results[i], results[i + 1]
        rows.append(
            {
                "gpus": r.gpus,
                "mtbf_h": r.mtbf_s / 3600,
                "ettr": r.ettr,
                "baseline_ettr": b.ettr,
                "best_interval_s": r.interval_s,
                "baseline_best_interval_s": b.interval_s,
                "standby_nodes": profile.standby_nodes(r.gpus),
                "result": r.as_dict(),
                "baseline": b.as_dict(),
            }
        )
    doc = {
        "source": SOURCE,
        "rates_per_gpu_day": {c.name: c.per_gpu_day for c in FAILURE_RATES},
        "profile": asdict(profile),
        "profile_source": (
            bench.as_dict() if bench and args.profile == "fleetheal" else {"origin": "built-in", "see": "docs/ettr.md"}
        ),
        "baseline": asdict(baseline),
        "checkpoint_s": args.checkpoint_cost,
        "events": args.events,
        "seed": args.seed,
        "rows": rows,
    }
    if args.plot:
        from fleetheal.ettr.plot import plot  # matplotlib: only when asked for

        plot(rows, args.plot, profile.name, baseline.name)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"ETTR simulated: profile {profile.name} vs {baseline.name}; rates: {SOURCE}; "
        f"checkpoint cost {args.checkpoint_cost:g} s; {args.events} interruptions per run, seed {args.seed}"
    )
    if bench is not None:
        print(f"fleetheal's platform timings {bench.describe()}")
    head = (
        f"{'GPUs':>8} {'MTBF':>7} {'ETTR':>7} {'base':>7} {'interval':>9} {'standby':>7} "
        f"{'lost':>6} {'ckpt':>6} {'detect':>6} {'recov':>6} {'wait':>6}"
    )
    print(head)
    for row in rows:
        bd = row["result"]["breakdown"]
        print(
            f"{row['gpus']:>8,} {row['mtbf_h']:>6.2f}h {row['ettr']:>7.2%} {row['baseline_ettr']:>7.2%} "
            f"{row['best_interval_s']:>8.0f}s {row['standby_nodes']:>7} {bd['lost_work']:>6.2%} "
            f"{bd['checkpoint']:>6.2%} {bd['detection']:>6.2%} {bd['recovery']:>6.2%} {bd['waiting']:>6.2%}"
        )
    print(
        "columns lost..wait: share of wall time for the profile; 'base' is the baseline's ETTR at its own best interval"
    )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
