"""`fleetheal agent run|check|inject|clear`: the node-health agent's commands.

Registration imports nothing heavy; each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from fleetheal.errors import UsageError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "agent",
        help="the node-health agent: run it, check a node once, inject simulated faults",
        description="The node-health agent (agent/README.md).",
    )
    asub = p.add_subparsers(dest="agent_command", metavar="SUBCOMMAND", required=True)

    run = asub.add_parser("run", help="run the agent until SIGTERM", description="Run the agent (systemd, DaemonSet).")
    run.add_argument("--config", metavar="FILE", required=True, help="agent YAML config")
    run.set_defaults(func=cmd_run)

    check = asub.add_parser(
        "check",
        help="one-shot check for Slurm HealthCheckProgram/prolog/epilog",
        description="Check this node's GPUs once. Exit 0 healthy, 1 unhealthy (reason printed; the node is "
        "drained unless mode is observe or fastpath.slurm.enabled is false), 2 cannot check (no NVML, bad config).",
    )
    check.add_argument("--config", metavar="FILE", help="agent YAML config (default: defaults + environment)")
    check.set_defaults(func=cmd_check)

    inject = asub.add_parser(
        "inject",
        help="inject a fault into the simulated GPU backend",
        description="Write an injection into the simulated backend's state file (fleetheal.agent.simulated).",
    )
    _state_args(inject)
    inject.add_argument("fault", help="taxonomy fault id, e.g. xid-79")
    inject.add_argument("--gpu", type=int, help="GPU index (omit for a node-wide fault)")
    when = inject.add_mutually_exclusive_group()
    when.add_argument("--at", type=float, metavar="UNIX_TIME", help="when the fault starts (default: now)")
    when.add_argument(
        "--in", dest="delay", type=float, metavar="SECONDS", help="start the fault this many seconds from now"
    )
    inject.set_defaults(func=cmd_inject)

    clear = asub.add_parser("clear", help="clear simulated faults", description="Remove injections (all by default).")
    _state_args(clear)
    clear.add_argument("fault", nargs="?", help="only this fault id")
    clear.add_argument("--gpu", type=int, help="only this GPU")
    clear.set_defaults(func=cmd_clear)


def _state_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--state", metavar="FILE", help="simulated backend state file")
    g.add_argument("--config", metavar="FILE", help="take the state file from this agent config")


def _config(path: str | None) -> Any:
    from fleetheal.agent.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"fleetheal agent: config error: {exc}", file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    if cfg is None:
        return 2
    from fleetheal.agent.service import Agent
    from fleetheal.logs import setup_logging

    setup_logging(cfg.log_level)
    agent = Agent(cfg)

    def on_signal(signum: int, frame: object) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run()
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    cfg = _config(args.config)
    if cfg is None:
        return 2
    from fleetheal.agent.check import run_check
    from fleetheal.logs import setup_logging

    setup_logging("warning")  # the report is on stdout; stderr logs only what went wrong, as JSON
    return run_check(cfg)


def _state_file(args: argparse.Namespace) -> str:
    if args.state:
        return str(args.state)
    cfg = _config(args.config)
    if cfg is None:
        raise UsageError("cannot read the agent config")
    return str(cfg.backend.simulated.state_file)


def cmd_inject(args: argparse.Namespace) -> int:
    from fleetheal.agent.simulated import inject

    at = args.at if args.delay is None else time.time() + args.delay
    try:
        inj = inject(_state_file(args), args.fault, args.gpu, at)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    where = "node-wide" if inj.gpu is None else f"gpu {inj.gpu}"
    print(f"injected {inj.fault} on {where} at {inj.at:.3f} ({inj.id})")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    from fleetheal.agent.simulated import clear

    n = clear(_state_file(args), args.fault, args.gpu)
    print(f"cleared {n} injection(s)")
    return 0
