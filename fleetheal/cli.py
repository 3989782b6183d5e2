"""The one `fleetheal` command.

Each subsystem module listed in COMMANDS defines `register(subparsers)`, which adds its
subcommand(s) and sets `func` (taking the parsed args, returning an exit code). Registration must
stay cheap: heavy imports (aiohttp, ansible_runner, pulumi) happen inside the handlers.

This module and the lab are the top layer (tests/test_layering.py): a part's command never imports the lab.
Where a part's command has a subcommand that needs the lab, the lab adds it here (SUBCOMMANDS).

The lab (fleetheal.lab, with its test doubles) runs from a checkout of fleetheal and is not in the wheel: in an
installed wheel its commands (LAB_COMMANDS) are still listed, and answer NO_LAB with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

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


#: The lab's commands, by the module that registers each: (command name, help) of the stand-in that answers
#: NO_LAB where the lab is absent (an installed wheel).
LAB_COMMANDS = {
    "fleetheal.lab.cli": ("lab", "the local lab (runs from a checkout of fleetheal)"),
    "fleetheal.lab.measure": ("measure", "ETTR of a lab run (runs from a checkout of fleetheal)"),
}
NO_LAB = (
    "the lab runs from a checkout of fleetheal (`make demo` there), not from an installed fleetheal: "
    "this installation has no fleetheal.lab"
)


def lab_available() -> bool:
    """Whether fleetheal.lab can be imported: a checkout (editable install) has it, the wheel does not."""
    return importlib.util.find_spec("fleetheal.lab") is not None


def _no_lab(args: argparse.Namespace) -> int:
    raise UsageError(NO_LAB)


def _register_absent_lab(sub: Any, module: str) -> None:
    """A stand-in for a lab command: it takes any arguments (no option is its own, `--help` included) and
    answers NO_LAB."""
    name, help_ = LAB_COMMANDS[module]
    p = sub.add_parser(name, help=help_, description=NO_LAB, add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_no_lab)


def _register(module: str, sub: Any, function: str = "register") -> Any:
    if module in LAB_COMMANDS and not lab_available():
        return _register_absent_lab(sub, module)
    return getattr(importlib.import_module(module), function)(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetheal",
        description="Self-healing GPU training clusters: classify faults, run the agent and remediator, the lab.",
    )
    parser.add_argument("--version", action="version", version=f"fleetheal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        added = _register(name, sub)
        for extra in SUBCOMMANDS.get(name, ()):
            module, _, function = extra.partition(":")
            _register(module, added, function or "register")
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
    except BrokenPipeError:  # `fleetheal ... | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code
