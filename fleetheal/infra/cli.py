"""`fleetheal render --stack STACK [--stack STACK...] --out DIR`: each stack's objects as YAML for GitOps review.
`fleetheal infra preview|up|destroy --stack STACK --backend DIR`: the stack under the real Pulumi engine.
`fleetheal fleet drift STACK_FILE_OR_DIR...`: where a federation's stacks differ (fleetheal.infra.drift).

Registering the commands stays cheap: Pulumi, the program and the renderer are imported where they run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fleetheal.errors import UsageError
from fleetheal.tools import tools_dir


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
    p.add_argument(
        "--stack",
        required=True,
        action="append",
        help=(
            "stack name: reads Pulumi.yaml and Pulumi.STACK.yaml; repeat it to render several stacks (a federation's "
            "manager and workers), each into DIR/STACK"
        ),
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (empty, or a previous render)")
    p.add_argument("--root", type=Path, default=None, help="project directory holding Pulumi.yaml (default: this repo)")
    p.add_argument(
        "--policy",
        action="store_true",
        help="also run the fleetheal policy pack's rules over the objects; exit 1 on any violation",
    )
    p.set_defaults(func=run)

    infra = sub.add_parser(
        "infra",
        help="preview, deploy or destroy a Pulumi stack with the real Pulumi engine (tools from `make tools`)",
        description=(
            "Run the fleetheal Pulumi program with the real Pulumi engine and Kubernetes provider (built by "
            "`make tools`) through Pulumi's Automation API, against the cluster of --kubeconfig, keeping state "
            "in a local file backend. The secrets passphrase comes from PULUMI_CONFIG_PASSPHRASE."
        ),
    )
    isub = infra.add_subparsers(dest="infra_command", metavar="COMMAND", required=True)
    for name, text in (
        ("preview", "show what `up` would change; --policy-pack runs CrossGuard packs (policies/)"),
        ("up", "create or update the stack's resources"),
        ("destroy", "delete the stack's resources (retained ones stay in the cluster)"),
    ):
        c = isub.add_parser(name, help=text, description=text)
        c.add_argument("--stack", required=True, help="stack name; starts from Pulumi.STACK.yaml when there is one")
        c.add_argument("--backend", required=True, type=Path, help="state directory (file backend and workspace)")
        c.add_argument("--kubeconfig", type=Path, default=None, help="cluster to deploy into (default: $KUBECONFIG)")
        c.add_argument(
            "--tools", type=Path, default=None, help="directory with pulumi and pulumi-resource-kubernetes (.tools/bin)"
        )
        c.add_argument(
            "--set",
            dest="settings",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a fleetheal setting for this run (JSON for lists and objects); repeatable",
        )
        c.add_argument(
            "--secret",
            dest="secret_envs",
            action="append",
            default=[],
            metavar="KEY=ENV_VAR",
            help="set secret setting KEY to the value of environment variable ENV_VAR; repeatable",
        )
        if name != "destroy":
            c.add_argument(
                "--policy-pack",
                dest="policy_packs",
                action="append",
                default=[],
                type=Path,
                metavar="DIR",
                help="run this policy pack (e.g. policies); repeatable",
            )
            c.add_argument(
                "--policy-pack-config",
                dest="policy_pack_configs",
                action="append",
                default=[],
                type=Path,
                metavar="FILE",
                help="JSON config for the policy pack at the same position; repeatable",
            )
        if name == "preview":
            c.add_argument(
                "--diff",
                action="store_true",
                help="show each change property by property (a node added to a pool shows as that key)",
            )
        c.set_defaults(func=run_engine)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} {item!r}: expected KEY=VALUE")
        out[key.removeprefix("fleetheal:")] = value
    return out


def run_engine(args: argparse.Namespace) -> int:
    from pulumi import automation as auto

    from fleetheal.infra import engine

    kubeconfig = args.kubeconfig or (Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None)
    if kubeconfig is None:
        raise UsageError("--kubeconfig is required when KUBECONFIG is not set")
    passphrase = os.environ.get("PULUMI_CONFIG_PASSPHRASE")
    if passphrase is None:
        raise UsageError("set PULUMI_CONFIG_PASSPHRASE: it encrypts the stack's secrets in --backend")
    secrets = {}
    for key, var in _pairs(args.secret_envs, "--secret").items():
        if var not in os.environ:
            raise UsageError(f"--secret {key}={var}: environment variable {var} is not set")
        secrets[key] = os.environ[var]
    target = engine.Target(
        stack=args.stack,
        kubeconfig=kubeconfig,
        backend=args.backend.resolve(),
        bin_dir=args.tools or tools_dir(),
        passphrase=passphrase,
        settings=_pairs(args.settings, "--set"),
        secrets=secrets,
    )
    command = args.infra_command
    streamed: list[str] = []

    def out(line: str) -> None:
        streamed.append(line)
        print(line, flush=True)

    def err(line: str) -> None:
        streamed.append(line)
        print(line, file=sys.stderr, flush=True)

    started = time.monotonic()
    try:
        if command == "preview":
            result = engine.preview(target, args.policy_packs, args.policy_pack_configs, out, err, diff=args.diff)
            changed = engine.changes(result.change_summary)
        elif command == "up":
            up = engine.up(target, args.policy_packs, args.policy_pack_configs, out, err)
            changed = engine.changes(up.summary.resource_changes)
        else:
            down = engine.destroy(target, out, err)
            changed = engine.changes(down.summary.resource_changes)
    except engine.EngineError as exc:
        print(f"fleetheal infra {command}: {exc}", file=sys.stderr)
        return 1
    except auto.CommandError as exc:
        # The engine's own output has been shown as it came; before a run starts there is none.
        detail = "" if streamed else f":\n{exc}"
        print(f"fleetheal infra {command}: stack {args.stack}: the engine failed{detail}", file=sys.stderr)
        return 1
    print(f"fleetheal infra {command}: stack {args.stack}: {changed} change(s) in {time.monotonic() - started:.1f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    from fleetheal.infra import config, project, render

    root = args.root if args.root is not None else project.REPO_ROOT
    if not (root / "Pulumi.yaml").exists():
        raise UsageError(f"--root {root}: no Pulumi.yaml there")
    stacks: list[str] = list(dict.fromkeys(args.stack))
    recorded = {}
    rendered = {}
    for stack in stacks:
        try:
            recorded[stack] = render.record_stack(stack, root)
            rendered[stack] = render.render_stack(stack, root, recorded[stack])
        except config.ConfigError as exc:
            print(f"fleetheal render: stack {stack}: {exc}", file=sys.stderr)
            return 1
        except render.RenderError as exc:
            raise UsageError(str(exc)) from exc
    try:
        # One stack: its files in DIR (as always); several: each in DIR/STACK.
        render.write_stacks(rendered if len(stacks) > 1 else {"": rendered[stacks[0]]}, args.out)
    except render.RenderError as exc:
        raise UsageError(str(exc)) from exc
    for stack in stacks:
        where = args.out / stack if len(stacks) > 1 else args.out
        print(f"fleetheal render: wrote {len(rendered[stack])} objects for stack {stack} to {where}")
    if args.policy:
        from fleetheal.infra import policy

        total = 0
        for stack in stacks:
            violations = policy.evaluate([(r.type, r.name, r.inputs) for r in recorded[stack] if r.custom])
            for name, message in violations:
                prefix = f"stack {stack}: " if len(stacks) > 1 else ""
                print(f"{prefix}policy {name}: {message}", file=sys.stderr)
            total += len(violations)
        print(f"fleetheal render: {total} policy violation(s)")
        return 1 if total else 0
    return 0


def register_drift(fleet_subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `drift` under `fleetheal fleet` (fleetheal.fleet.status's subparsers)."""
    p = fleet_subparsers.add_parser(
        "drift",
        help="say where the federation's stacks differ in what every job needs",
        description=(
            "Render each stack of the federation (or read `fleetheal render` output) and say, per cluster, which "
            "of the things a job needs to run anywhere is missing or differs: accounts and QOS (from the manager's "
            "sacctmgr script), namespaces, secrets, the agent, the alert rules, the partitions and slurm.conf "
            "settings; also clusters the manager declares that no stack renders, and workers outside the "
            "federation. Exit 1 on drift."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        metavar="STACK_FILE_OR_DIR",
        help="Pulumi.<stack>.yaml, a project directory (its federation stacks) or a `fleetheal render` output",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=run_drift)


def run_drift(args: argparse.Namespace) -> int:
    from fleetheal.infra import config, drift, render

    try:
        report = drift.compare(render.load_inputs(args.inputs))
    except config.ConfigError as exc:
        print(f"fleetheal fleet drift: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_json(), indent=2, sort_keys=True))
    else:
        print(report.text())
    return 1 if report.drift else 0
