"""`fleetheal classify`: classify an Xid code, a log line or a whole log file with the taxonomy."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from fleetheal.errors import UsageError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "classify",
        help="classify an Xid, a log line or a log file",
        description="Classify faults with the taxonomy. Exit 0 also when nothing is found.",
        epilog='examples: fleetheal classify --xid 79 | fleetheal classify "NVRM: Xid (PCI:0000:b1:00): 79, ..." '
        "| fleetheal classify --file /var/log/kern.log --json | fleetheal classify --coverage",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("line", nargs="?", help="one log line")
    src.add_argument("--xid", type=int, metavar="CODE", help="an NVIDIA Xid code")
    src.add_argument("--file", metavar="LOG", help="a log file ('-' for standard input)")
    src.add_argument(
        "--coverage",
        action="store_true",
        help="check the rules against every emitter's message catalog (policies/message-catalog.yaml) and print "
        "which formats map to which fault, which are ignored and why; exit 1 on a mismatch",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of events")
    p.add_argument(
        "--log",
        choices=("kernel", "application"),
        help="apply only the rules for this log (the agent applies the kernel rules); default: every rule",
    )
    p.add_argument(
        "--rules", metavar="FILE", help="log rules to use instead of the shipped policies/log-rules.yaml (validated)"
    )
    p.set_defaults(func=run)


def events(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from fleetheal import taxonomy
    from fleetheal.logparse import FaultEvent, LogRulesError, load_parser

    if args.xid is not None:
        if args.xid < 1:
            raise UsageError(f"--xid must be a positive Xid code, got {args.xid}")
        yield FaultEvent(taxonomy.load().for_xid(args.xid), xid=args.xid).as_dict()
        return
    try:
        parser = load_parser(args.rules, log=args.log)
    except LogRulesError as exc:
        raise UsageError(str(exc)) from exc
    if args.line is not None:
        for event in parser.parse_line(args.line):
            yield event.as_dict()
        return
    with _open(args.file) as f:
        for number, event in parser.parse_lines(f):
            yield {**event.as_dict(), "line": number}


def _open(path: str) -> TextIO:
    if path == "-":
        return sys.stdin
    try:
        # Kernel logs can carry stray bytes; never fail a whole file on one.
        return open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc


def coverage(args: argparse.Namespace) -> int:
    from fleetheal import logcatalog, taxonomy
    from fleetheal.logparse import LogRulesError, compile_rules, raw_rules

    tx = taxonomy.load()
    try:
        rules = compile_rules(raw_rules(args.rules), tx)
        emitters = logcatalog.load()
    except LogRulesError as exc:
        raise UsageError(str(exc)) from exc
    rows = logcatalog.check(emitters, tx, rules)
    if args.json:
        json.dump([logcatalog.as_dict(r) for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(logcatalog.report(emitters, rows))
    return 0 if all(r.ok for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    if args.coverage:
        return coverage(args)
    found = list(events(args))
    if args.json:
        json.dump(found, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not found:
        print("no fault found")
        return 0
    print(_table(found))
    return 0


def _table(found: list[dict[str, Any]]) -> str:
    cols = [
        ("line", "LINE"),
        ("fault_id", "FAULT"),
        ("xid", "XID"),
        ("pci_bus_id", "PCI BUS"),
        ("class", "CLASS"),
        ("action", "ACTION"),
        ("severity", "SEVERITY"),
        ("rule", "RULE"),
    ]
    cols = [(k, h) for k, h in cols if any(k in e for e in found)]
    rows = [[h for _, h in cols]] + [["-" if e.get(k) is None else str(e[k]) for k, _ in cols] for e in found]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if len(found) <= 20:
        out.append("")
        out.extend(f"{e['fault_id']}: {e['explanation']}" for e in _unique(found))
    unknown = [e for e in found if e["fault_id"] == "unknown" and e.get("xid") is None]
    if unknown:
        out.append("")
        out.append(f"{len(unknown)} line(s) no rule knows (write a rule: docs/log-rules.md):")
        out.extend(f"  {e.get('line', '-')}: {e['detail']}" for e in unknown[:20])
    return "\n".join(out)


def _unique(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for e in found:
        seen.setdefault(e["fault_id"], e)
    return list(seen.values())
