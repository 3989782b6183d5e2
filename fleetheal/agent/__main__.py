"""`python -m fleetheal.agent run|check|inject|clear`: the agent's commands without the rest of the CLI.

Same commands as `fleetheal agent ...`, but only the agent's modules are imported: the short path for
Slurm's HealthCheckProgram, prolog and epilog, which start a fresh process on every node each time.
"""

from __future__ import annotations

import argparse
import sys

from fleetheal.agent.cli import register
from fleetheal.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetheal.agent")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(["agent", *(sys.argv[1:] if argv is None else argv)])
    try:
        code: int = args.func(args)
    except UsageError as exc:
        parser.error(str(exc))
    return code


raise SystemExit(main())
