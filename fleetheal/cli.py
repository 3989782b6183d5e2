"""The one `fleetheal` command.

Each subsystem module listed in COMMANDS defines `register(subparsers)`, which adds its
subcommand(s) and sets `func` (taking the parsed args, returning an exit code). Registration must
stay cheap: heavy imports (aiohttp, ansible_runner, pulumi) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fleetheal import __version__

COMMANDS = (
    "fleetheal.classify",
    "fleetheal.generate",
    "fleetheal.agent.cli",
    "fleetheal.lab.cli",
    "fleetheal.infra.cli",
    "fleetheal.remediator.cli",
    "fleetheal.ettr",
    "fleetheal.launch",
)


class UsageError(Exception):
    """Bad command-line usage: printed as `fleetheal: error: ...`, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetheal",
        description="Self-healing GPU training clusters: classify faults, run the agent and remediator, the lab.",
    )
    parser.add_argument("--version", action="version", version=f"fleetheal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except UsageError as exc:
        parser.error(str(exc))  # exits 2
    except KeyboardInterrupt:
        print("fleetheal: interrupted", file=sys.stderr)
        return 130
    return code
