"""The one `fleetheal` command.

Each subsystem module listed in COMMANDS defines `register(subparsers)`, which adds its
subcommand(s) and sets `func` (taking the parsed args, returning an exit code). Registration must
stay cheap: heavy imports (aiohttp, ansible_runner, pulumi) happen inside the handlers.

This module and the lab are the top layer (tests/test_layering.py): a part's command never imports the lab.
Where a part's command has a subcommand that needs the lab, the lab adds it here (SUBCOMMANDS).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fleetheal import __version__
from fleetheal.errors import UsageError

__all__ = ["UsageError", "build_parser", "main"]

COMMANDS = (
    "fleetheal.classify",
    "fleetheal.generate",
    "fleetheal.agent.cli",
    "fleetheal.lab.cli",
    "fleetheal.infra.cli",
    "fleetheal.remediator.cli",
    "fleetheal.ettr.cli",
    "fleetheal.launch",
    "fleetheal.fleet.status",
    "fleetheal.fleet.placement",
    "fleetheal.fleet.queues",
)
#: command module -> `module` or `module:function` whose register function (default `register`) takes the
#: subparsers that command's `register` returns.
SUBCOMMANDS = {
    "fleetheal.ettr.cli": ("fleetheal.lab.measure",),  # `fleetheal ettr measure`: ETTR of a lab run
    # `fleetheal fleet sync-features` and `fleetheal fleet drift`
    "fleetheal.fleet.status": ("fleetheal.fleet.placement:register_fleet", "fleetheal.infra.cli:register_drift"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetheal",
        description="Self-healing GPU training clusters: classify faults, run the agent and remediator, the lab.",
    )
    parser.add_argument("--version", action="version", version=f"fleetheal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        added = importlib.import_module(name).register(sub)
        for extra in SUBCOMMANDS.get(name, ()):
            module, _, function = extra.partition(":")
            getattr(importlib.import_module(module), function or "register")(added)
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
