"""`fleetheal classify`: classify an Xid code, a log line or a whole log file with the taxonomy."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from fleetheal.errors import UsageError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "classify",
        help="classify an Xid, a log line or a log file",
        description="Classify faults with the taxonomy. Exit 0 also when nothing is found.",
        epilog='examples: fleetheal classify --xid 79 | fleetheal classify "NVRM: Xid (PCI:0000:b1:00): 79, ..." '
        "| fleetheal classify --file /var/log/kern.log --json | fleetheal classify --coverage "
        "| fleetheal classify --score my-labelled-lines.yaml --rules my-rules.yaml",
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
    src.add_argument(
        "--score",
        metavar="YAML",
        help="score the rules on labelled lines (a list of {line, kind, fault, class}, as in tests/corpus/"
        "log-lines.yaml): right class per kind and per fault, benign lines kept quiet, every miss",
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


#: What `--score` reads of each labelled line (the corpus's other keys are allowed and ignored).
SCORE_KEYS = ("line", "kind", "fault", "class")


@dataclass(frozen=True)
class Scored:
    """One labelled line and what the rules said of it. An Xid line is right when the Xid code and the
    GPU are; any other line when the class is (`none` for a line that announces no fault)."""

    line: str
    kind: str
    want_fault: str
    want_class: str
    got_fault: str
    got_class: str
    right: bool


def gpu_id(bus: str | None) -> str | None:
    """One spelling of a PCI bus id ("0000:3b:00" and "00000000:3B:00.0" are one GPU)."""
    from fleetheal.agent.backends import normalize_pci

    return None if bus is None else normalize_pci(bus) or bus


def score_lines(entries: Iterable[Mapping[str, Any]], parser: Any) -> list[Scored]:
    """Score `parser` (a logparse.LogParser) on labelled lines; ValueError names the first malformed entry."""
    out = []
    for number, e in enumerate(entries, start=1):
        if not isinstance(e, Mapping) or any(not isinstance(e.get(k), str) or not e.get(k) for k in SCORE_KEYS):
            raise ValueError(f"entry {number}: needs the strings {', '.join(SCORE_KEYS)}; got {e!r:.200}")
        events = parser.parse_line(e["line"])
        got = events[0] if events else None
        fault, cls = (got.fault.id, got.fault.fault_class) if got else ("none", "none")
        if e["kind"] == "xid" and e.get("xid") is not None:
            right = got is not None and (got.xid, gpu_id(got.pci_bus_id)) == (e["xid"], gpu_id(e.get("gpu")))
        else:
            right = cls == e["class"]
        out.append(Scored(e["line"], e["kind"], e["fault"], e["class"], fault, cls, right))
    return out


def score_table(results: list[Scored], title: str) -> str:
    """Right share per kind, per wanted fault and for the benign lines, then every miss."""

    def row(name: str, group: list[Scored]) -> str:
        right = sum(r.right for r in group)
        return f"  {name:28}{len(group):>6}{right:>7}{right / len(group):>8.1%}"

    faults = [r for r in results if r.want_fault != "none"]
    benign = [r for r in results if r.want_fault == "none"]
    by_kind: dict[str, list[Scored]] = defaultdict(list)
    by_fault: dict[str, list[Scored]] = defaultdict(list)
    for r in faults:
        by_kind[r.kind].append(r)
        by_fault[r.want_fault].append(r)
    head = f"  {'':28}{'lines':>6}{'right':>7}{'share':>8}"
    out = [f"{title}: {len(results)} labelled lines", "", head]
    if faults:
        out.append(row("fault lines", faults))
        non_xid = [r for r in faults if r.kind != "xid"]
        if non_xid:
            out.append(row("  other than Xid records", non_xid))
    if benign:
        out.append(row("benign lines (no event)", benign))
    out += ["", "  by kind", *(row(k, g) for k, g in sorted(by_kind.items()))]
    out += ["", "  by wanted fault", *(row(f, g) for f, g in sorted(by_fault.items()))]
    misses = [r for r in results if not r.right]
    if misses:
        out += ["", f"{len(misses)} miss(es):"]
        out += [f"  {r.kind:8} want {r.want_fault} ({r.want_class}), got {r.got_fault} ({r.got_class}): {r.line[:150]}"
                for r in misses]  # fmt: skip
    return "\n".join(out)


def score(args: argparse.Namespace) -> int:
    import yaml

    from fleetheal.logparse import LogRulesError, load_parser

    try:
        entries = yaml.safe_load(Path(args.score).read_text(encoding="utf-8"))
        if not isinstance(entries, list):
            raise ValueError("expected a YAML list of labelled lines")
        results = score_lines(entries, load_parser(args.rules, log=args.log))
    except OSError as exc:
        raise UsageError(f"cannot read {args.score}: {exc.strerror}") from exc
    except (yaml.YAMLError, ValueError, LogRulesError) as exc:
        raise UsageError(f"{args.score}: {exc}") from exc
    if args.json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(score_table(results, args.score))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.coverage:
        return coverage(args)
    if args.score:
        return score(args)
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
