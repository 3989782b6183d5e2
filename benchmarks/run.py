"""Run every benchmark (`benchmarks/bench_*.py`) and write results/latest.json and results/latest.md.

Each module defines `run() -> list[dict]`; a dict is one figure with name, unit, median, p99, n, goal,
peer, ratio_to_peer and notes (other keys, such as bench_lab's `key` and `phases`, go to latest.json only).
A module that fails is reported as failed, and the others still run. Modules run in alphabetical order,
except those in LAST, which run after the others: a module whose `run` takes a parameter `earlier` gets
the results of the modules run before it in this run (bench_ettr takes bench_lab's figures from them).
Usage: python benchmarks/run.py [--only NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIELDS = ("name", "unit", "median", "p99", "n", "goal", "peer", "ratio_to_peer", "notes")
#: Modules that use the figures of the others: they run last, in this order.
LAST = ("ettr",)


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| benchmark | figure | median | p99 | unit | n | goal | peer | ratio | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['module']} | FAILED | | | | | | | | {r['error']} |")
            continue
        lines.append(
            f"| {r['module']} | {r['name']} | {fmt(r['median'])} | {fmt(r['p99'])} | {r['unit']} | {r['n']} "
            f"| {fmt(r.get('goal'))} | {fmt(r.get('peer'))} | {fmt(r.get('ratio_to_peer'))} | {r.get('notes', '')} |"
        )
    return "\n".join(lines) + "\n"


def _last(path: Path) -> int:
    name = path.stem.removeprefix("bench_")
    return LAST.index(name) + 1 if name in LAST else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="module names without bench_ (e.g. classifier)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    modules = sorted(HERE.glob("bench_*.py"), key=lambda m: (_last(m), m.stem))
    if args.only:
        modules = [m for m in modules if m.stem.removeprefix("bench_") in args.only]
    results: list[dict[str, Any]] = []
    failed = 0
    for path in modules:
        name = path.stem.removeprefix("bench_")
        print(f"bench: {name} ...", flush=True)
        started = time.monotonic()
        try:
            run = load(path).run
            figures = run(earlier=list(results)) if "earlier" in inspect.signature(run).parameters else run()
        except Exception as exc:  # one broken benchmark must not hide the others
            traceback.print_exc()
            results.append({"module": name, "error": f"{type(exc).__name__}: {exc}"})
            failed += 1
            continue
        for fig in figures:
            missing = [f for f in ("name", "unit", "median", "p99", "n") if f not in fig]
            if missing:
                raise SystemExit(f"bench_{name}: figure {fig} lacks {missing}")
            extra = {k: v for k, v in fig.items() if k not in FIELDS}
            results.append({"module": name, **{k: fig.get(k) for k in FIELDS}, **extra})
            print(f"  {fig['name']}: median {fmt(fig['median'])} {fig['unit']}, p99 {fmt(fig['p99'])}", flush=True)
        print(f"bench: {name} done in {time.monotonic() - started:.1f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (args.out / "latest.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    (args.out / "latest.md").write_text(f"# Benchmarks ({meta['when']}, {meta['cpus']} CPUs)\n\n" + table(results))
    print(table(results))
    print(f"wrote {args.out / 'latest.json'} and {args.out / 'latest.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
