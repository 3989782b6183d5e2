"""`fleetheal render --stack STACK --out DIR`: the stack's objects as YAML for GitOps review."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetheal.cli import UsageError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="write every object a Pulumi stack would create as YAML (one file per object)",
        description=(
            "Run the fleetheal Pulumi program under Pulumi's mock engine (no CLI, no cluster) and write "
            "every object it would create to DIR, deterministically, one YAML file per object. "
            "Secret values are redacted."
        ),
    )
    p.add_argument("--stack", required=True, help="stack name: reads Pulumi.yaml and Pulumi.STACK.yaml")
    p.add_argument("--out", required=True, type=Path, help="output directory (empty, or a previous render)")
    p.add_argument("--root", type=Path, default=None, help="project directory holding Pulumi.yaml (default: this repo)")
    p.add_argument(
        "--policy",
        action="store_true",
        help="also run the fleetheal policy pack's rules over the objects; exit 1 on any violation",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetheal.infra import config, render

    root = args.root if args.root is not None else config.REPO_ROOT
    if not (root / "Pulumi.yaml").exists():
        raise UsageError(f"--root {root}: no Pulumi.yaml there")
    try:
        records = render.record_stack(args.stack, root)
        files = render.render_stack(args.stack, root, records)
        render.write(files, args.out)
    except config.ConfigError as exc:
        print(f"fleetheal render: stack {args.stack}: {exc}", file=sys.stderr)
        return 1
    except render.RenderError as exc:
        raise UsageError(str(exc)) from exc
    print(f"fleetheal render: wrote {len(files)} objects for stack {args.stack} to {args.out}")
    if args.policy:
        from fleetheal.infra import policy

        violations = policy.evaluate([(r.type, r.name, r.inputs) for r in records if r.custom])
        for name, message in violations:
            print(f"policy {name}: {message}", file=sys.stderr)
        print(f"fleetheal render: {len(violations)} policy violation(s)")
        return 1 if violations else 0
    return 0
