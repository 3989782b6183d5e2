"""Turn log text (kernel log, training logs) into classified fault events, by the rules in
`policies/log-rules.yaml`.

This module is only the engine: which words mean which fault lives in the rules file (read its header),
and what a fault means lives in the taxonomy. The engine applies the rules in order: the rules' keywords,
found in one pass over the line, pick the candidates (a flooded log is mostly lines no rule wants, and they
must be cheap), the line's whitespace is normalised, and the first candidate whose pattern matches decides. A
pattern is searched alternative by alternative, each only on a line that holds one of the literal strings its every
match holds (`anchors`, derived from it): the same verdict, at a fraction of the regular expressions' cost.
A line that announces trouble no rule knows is reported as the `unknown` fault, with the line.

The patterns are Python regular expressions (`re` must compile them), matched by the `regex` module, which can stop
a search: a pattern that backtracks without end on some line (`(a|aa)+b` on a line of a's), which an operator's rules
file can hold and a local user can feed (a file name in a segfault record, a job's output), gives up on that line
after MATCH_TIMEOUT and the line is reported as the `unknown` fault with that rule's id; the next line is read.
"""

from __future__ import annotations

import re
import re._constants as sre_constants  # type: ignore[import-not-found]  # the re module's own parser, no stubs
import re._parser as sre_parse  # type: ignore[import-not-found]
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache, reduce
from importlib import resources
from operator import itemgetter, or_
from pathlib import Path
from typing import Any, NamedTuple

import ahocorasick
import regex
import yaml

from fleetheal.contracts import OWN_LOG_LINE
from fleetheal.taxonomy import UNKNOWN_ID, Fault, Taxonomy, TaxonomyError, load

#: Longest line of a job's output judged whole; a longer one is judged by its start only.
MAX_LINE = 4096
#: `fault:` values with a meaning of their own (besides a taxonomy id and a `from` mapping).
NONE = "none"
FROM_XID = "xid"
RULE_KEYS = frozenset({"id", "log", "description", "keywords", "pattern", "gpu", "fault", "evidence"})
#: Which log a rule reads: the kernel's (what the agent follows), an application's (training jobs, NCCL,
#: nvidia-smi, daemons), or any. The agent applies only kernel rules: an application's words in the kernel
#: log can come only from text a user controls (a process name in a segfault line), never from the device.
KERNEL, APPLICATION, ANY = "kernel", "application", "any"
LOGS = (KERNEL, APPLICATION, ANY)
_RULE_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_MACRO = re.compile(r"\{([a-z_]+)\}")
_WHITESPACE = re.compile(r"\s")
#: A pattern anchored to the line start: `^`, or `\A` other than the shipped scans of the whole line,
#: `\A(?>.*?PREFIX)` and `\A(?>(?:.*EXCLUDED)?)`.
_ANCHORED = re.compile(r"\^|\\A(?!\(\?>(?:\(\?:)?\.\*)")
_VALUE = itemgetter(1)  # of the (end, value) pairs the automaton yields
_CAUSED_BY = re.compile(r"caused by previous Xid (\d+)")
_NVLINK5_REGS = re.compile(r"\((0x[0-9A-Fa-f]{1,8}) (0x[0-9A-Fa-f]{1,8})")
_NVLINK5_SEV = re.compile(r"\b(Non-fatal|Nonfatal|Fatal)\b", re.IGNORECASE)
_RECOVERY = re.compile(r"recovery action changed from \S+ \([^)]*\) to \S+ \((?P<to>[^)]*)\)", re.IGNORECASE)
#: Seconds of CPU one pattern of a rule (or one of its `gpu` patterns or `fault.cases`) may spend searching one line:
#: the shipped rules take microseconds on a real line, milliseconds on 4 KiB of words (a job's longest line judged).
#: `regex` counts the process's CPU time (clock()), so a thread descheduled on a busy host is not cut short, and a
#: search that backtracks without end still ends.
MATCH_TIMEOUT = 0.1
#: Most copies of its parts that a pattern's required repetitions may multiply out to: `regex` compiles them written
#: out (`(?:a{1000}){1000}` takes it seconds and hundreds of MB, `re` a millisecond), so the rules would take that long
#: to load. The shipped rules need a few hundred.
MAX_UNROLLED = 10_000
#: Flags that `re` and `regex` spell with the same bits (anchors() reads a pattern with `re`'s parser).
_RE_FLAGS = re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


class LogRulesError(TaxonomyError):
    """The log rules are malformed; the message names the rule and the field."""


class FaultEvent(NamedTuple):
    """One fault found in a log line (a named tuple: immutable, and cheap to build on a flooded log)."""

    fault: Fault
    xid: int | None = None
    pci_bus_id: str | None = None  # as written in the log (without the `PCI:` tag), or None
    pid: int | None = None
    process: str | None = None
    detail: str = ""
    #: The id of the rule that decided (None for an event not read from a log line).
    rule: str | None = None

    @property
    def known(self) -> bool:
        """False for a line that announced trouble no rule knows (reported as the unknown fault)."""
        return self.fault.id != UNKNOWN_ID

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = self.fault.as_dict()
        d["xid"] = self.xid
        d["pci_bus_id"] = self.pci_bus_id
        d["pid"] = self.pid
        d["process"] = self.process
        d["detail"] = self.detail
        d["rule"] = self.rule
        return d


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    log: str
    description: str
    keywords: tuple[str, ...]
    pattern: Matcher
    #: A taxonomy fault id, NONE, FROM_XID, or (group, ((compiled case, fault id), ...)).
    fault: str | tuple[str, tuple[tuple[Matcher, str], ...]]
    gpu: tuple[Matcher, ...] = ()
    #: Why the line alone justifies a destructive action (required of a rule that can raise one).
    evidence: str = ""
    #: The pattern's top-level alternatives, each compiled alone with the literal strings one of which its every
    #: match holds (`anchors`; empty: always tried). A line is searched only with the alternatives whose anchors
    #: it holds: the verdict of the whole pattern, at a fraction of the cost.
    alternatives: tuple[tuple[tuple[str, ...], Matcher], ...] = ()

    def __post_init__(self) -> None:
        if not self.alternatives:  # a rule without them would never match: compile_rules always gives them
            raise ValueError(f"rule {self.id}: no alternatives to search")


def raw_rules(path: str | Path | None = None) -> dict[str, Any]:
    """The rules file as parsed YAML: the shipped one, or `path`."""
    if path is None:
        text = resources.files(__package__).joinpath("log-rules.yaml").read_text("utf-8")
    else:
        try:
            text = Path(path).read_text("utf-8")
        except OSError as exc:
            raise LogRulesError(f"log rules: cannot read {path}: {exc.strerror}") from exc
    try:
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        raise LogRulesError(f"log rules: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise LogRulesError("log rules: the file must be a mapping with 'macros' and 'rules'")
    return doc


def compile_rules(doc: Mapping[str, Any], tx: Taxonomy) -> tuple[Rule, ...]:
    """Validate and compile the rules; every problem raises LogRulesError naming the rule and field."""
    macros = doc.get("macros") or {}
    if not isinstance(macros, Mapping) or not all(isinstance(v, str) for v in macros.values()):
        raise LogRulesError("log rules: 'macros' must map names to regular expressions")
    entries = doc.get("rules")
    if not isinstance(entries, list) or not entries:
        raise LogRulesError("log rules: 'rules' must be a non-empty list")
    rules: list[Rule] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        rid = entry.get("id") if isinstance(entry, Mapping) else None
        where = f"log rules: rules[{i}] (id {rid!r})"
        if not isinstance(entry, Mapping):
            raise LogRulesError(f"{where}: a rule must be a mapping")
        if unknown_keys := set(entry) - RULE_KEYS:
            raise LogRulesError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown_keys)))}")
        if not isinstance(rid, str) or not _RULE_ID.match(rid):
            raise LogRulesError(f"{where}: 'id' must be lower-case words joined by '-'")
        if rid in seen:
            raise LogRulesError(f"{where}: duplicate id")
        seen.add(rid)
        log = entry.get("log")
        if log not in LOGS:
            raise LogRulesError(f"{where}: 'log' must be one of {', '.join(LOGS)} (which log the rule reads)")
        description = entry.get("description")
        if not isinstance(description, str) or not description.strip():
            raise LogRulesError(f"{where}: 'description' must be a non-empty string")
        keywords = entry.get("keywords")
        if not isinstance(keywords, list) or not keywords or not all(isinstance(k, str) and k for k in keywords):
            raise LogRulesError(f"{where}: 'keywords' must be a non-empty list of strings (quote numbers)")
        if any(_WHITESPACE.search(k) for k in keywords):
            raise LogRulesError(f"{where}: a keyword must hold no whitespace (log pipelines change it)")
        raw_pattern = entry.get("pattern")
        alternatives = raw_pattern if isinstance(raw_pattern, list) else [raw_pattern]
        if any(isinstance(a, str) and _ANCHORED.match(a) for a in alternatives):
            raise LogRulesError(f"{where}: 'pattern' must not anchor to the line start (log prefixes vary)")
        checked = _compile(raw_pattern, macros, f"{where}: 'pattern'")
        pattern = Matcher(checked, f"{where}: 'pattern'")
        pieces = _alternatives_of(raw_pattern, checked, pattern, macros, f"{where}: 'pattern'")
        gpu = entry.get("gpu", [])
        if not isinstance(gpu, list):
            raise LogRulesError(f"{where}: 'gpu' must be a list of patterns")
        gpu_patterns = tuple(Matcher(_compile(g, macros, f"{where}: 'gpu'"), f"{where}: 'gpu'") for g in gpu)
        for g in gpu_patterns:
            if "gpu" not in g.groupindex:
                raise LogRulesError(f"{where}: 'gpu' pattern {g.pattern!r} has no group named 'gpu'")
        fault = _fault(entry.get("fault"), pattern, tx, where)
        evidence = entry.get("evidence", "")
        if not isinstance(evidence, str):
            raise LogRulesError(f"{where}: 'evidence' must be a string")
        if not evidence.strip() and any(tx.actions[tx.faults[f].action].destructive for f in _faults_of(fault)):
            raise LogRulesError(
                f"{where}: the rule can raise a destructive action, so 'evidence' must say why the line alone "
                "justifies it (who prints it, and why a job cannot)"
            )
        rules.append(
            Rule(
                rid,
                log,
                description.strip(),
                tuple(keywords),
                pattern,
                fault,
                gpu_patterns,
                evidence.strip(),
                pieces,
            )
        )
    return tuple(rules)


#: An anchor shorter than this filters too little to pay for itself.
_MIN_ANCHOR = 4
#: Alternatives considered when deriving anchors; a pattern with more is always tried.
_MAX_ALTERNATIVES = 256
_Alternatives = list[list[str | None]]


def anchors(pattern: re.Pattern[str]) -> tuple[str, ...]:
    """Literal strings one of which every match of `pattern` contains (the longest literal run of each top-level
    alternative), or () when some alternative has no run of _MIN_ANCHOR characters. A cheap `in` test on them
    skips the regular expression on the many candidate lines a rule's keywords select but its pattern misses."""
    if pattern.flags & re.IGNORECASE:
        return ()
    try:
        alternatives = _sequence(list(sre_parse.parse(pattern.pattern, pattern.flags & _RE_FLAGS)))
    except (re.error, _TooMany):
        return ()
    found: list[str] = []
    for alternative in alternatives:
        runs = "".join("\0" if c is None else c for c in alternative).split("\0")
        best = max(runs, key=len)
        if len(best) < _MIN_ANCHOR:
            return ()
        found.append(best)
    return tuple(dict.fromkeys(found))


def _alternatives_of(
    raw: Any, checked: re.Pattern[str], whole: Matcher, macros: Mapping[str, str], where: str
) -> tuple[tuple[tuple[str, ...], Matcher], ...]:
    """The top-level alternatives of a rule's pattern (its list items, each split at its top-level `|`), compiled
    alone with their anchors; the whole pattern alone where it carries flags of its own. `checked`: the whole as `re`
    compiled it (_checked; each alternative is a part of it, so within its bounds), `whole`: as the matcher did."""
    if checked.flags & ~re.UNICODE:
        return (((), whole),)
    texts = raw if isinstance(raw, list) else [raw]
    expanded = [_MACRO.sub(lambda m: macros[m.group(1)], t) for t in texts]
    pieces = [piece for text in expanded for piece in _split_top_level(text)]
    try:
        compiled = [re.compile(piece) for piece in pieces]
    except re.error:
        return ((anchors(checked), whole),)
    return tuple((anchors(rx), Matcher(rx, where)) for rx in compiled)


def _split_top_level(text: str) -> list[str]:
    """`text` cut at each `|` outside groups, classes and escapes."""
    parts: list[str] = []
    depth, start, i, in_class = 0, 0, 0, False
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 2 if text[i + 1 : i + 2] == "^" else 1
            i += 1 if text[i : i + 1] == "]" else 0  # a ']' first in a class is a literal
            continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


class _TooMany(Exception):
    pass


def _sequence(items: list[Any]) -> _Alternatives:
    """The alternatives a parsed sequence can match, each as its characters (None: something not literal)."""
    result: _Alternatives = [[]]
    for op, av in items:
        if op is sre_constants.LITERAL:
            for alternative in result:
                alternative.append(chr(av))
            continue
        if op is sre_constants.SUBPATTERN and not av[1] and not av[2]:  # a group without flags: its own sequence
            options = _sequence(list(av[3]))
        elif op is sre_constants.ATOMIC_GROUP:  # matched as a sequence, only never backtracked into
            options = _sequence(list(av))
        elif op is sre_constants.BRANCH:
            options = [alt for branch in av[1] for alt in _sequence(list(branch))]
        else:  # a class, a repeat, an anchor, a back-reference, a group with flags: no literal across it
            options = [[None]]
        result = [head + tail for head in result for tail in options]
        if len(result) > _MAX_ALTERNATIVES:
            raise _TooMany
    return result


def _faults_of(fault: Any) -> tuple[str, ...]:
    """The taxonomy ids a compiled `fault` can give (an Xid rule's codes are the Xid catalog's: not listed)."""
    if isinstance(fault, tuple):
        return tuple(fid for _, fid in fault[1])
    return () if fault in (NONE, FROM_XID) else (fault,)


def _checked(text: str, flags: int = 0) -> re.Pattern[str]:
    """`text` compiled by `re`, once shown to be what the rules file promises: a Python regular expression (`regex`,
    the matcher, reads more than `re` does, and anchors() reads patterns with `re`'s parser), whose required
    repetitions multiply out to at most MAX_UNROLLED copies of its parts. Raises re.error saying what is wrong."""
    try:
        compiled = re.compile(text, flags)
        # Only a counted repeat (`{n}`, `{n,}`, `{n,m}`) writes out copies: without one, a pattern compiles to at
        # most as many parts as it has characters. Parsing every pattern again made loading the shipped rules cost
        # 0.20 s of CPU instead of 0.12 s (median of 5 fresh processes).
        unrolled = _unrolled(sre_parse.parse(text, flags)) if "{" in text or len(text) > MAX_UNROLLED else 0
    except RecursionError:
        raise re.error("nested too deeply") from None
    if unrolled > MAX_UNROLLED:
        raise re.error(
            f"its required repetitions multiply out to {unrolled:,} copies of its parts (at most {MAX_UNROLLED:,}: "
            "the matcher compiles them written out); require fewer (x{1,} rather than x{1000,})"
        )
    return compiled


class Matcher:
    """A pattern _checked passed, searched by `regex`, so that a search can be stopped (MATCH_TIMEOUT). `regex`
    compiles it on its first search, not when the rules load: compiling all of them took three times as long as
    `re` did (0.34 s against 0.11 s, at every start of the agent and of `fleetheal agent check`), and a process
    searches with the few its lines reach. `pattern` and `groupindex` are `re`'s, the same as `regex`'s."""

    __slots__ = ("_rx", "checked", "where")

    def __init__(self, checked: re.Pattern[str], where: str) -> None:
        self.checked = checked
        self.where = where
        self._rx: regex.Pattern[str] | None = None

    @property
    def pattern(self) -> str:
        return self.checked.pattern

    @property
    def groupindex(self) -> Mapping[str, int]:
        return self.checked.groupindex

    def search(self, text: str) -> regex.Match[str] | None:
        """TimeoutError past MATCH_TIMEOUT; LogRulesError when `regex` cannot compile what `re` did."""
        rx = self._rx
        if rx is None:
            rx = self._rx = self.compiled()
        return rx.search(text, timeout=MATCH_TIMEOUT)

    def compiled(self) -> regex.Pattern[str]:
        try:  # V0: `re`'s own semantics
            return regex.compile(self.checked.pattern, self.checked.flags & _RE_FLAGS | regex.V0)
        except (regex.error, RecursionError) as exc:
            raise LogRulesError(f"{self.where}: the matcher (regex) cannot compile {self.pattern!r}: {exc}") from exc


def _unrolled(items: Any) -> int:
    """About how many parts `regex` compiles a parsed pattern to: it writes out the required copies of a repeat
    (`x{1000,}` holds 1,000 x's), so nested counts multiply; an optional copy costs nothing."""
    total = 0
    for op, av in items:
        if op in _REPEATS:
            total += max(av[0], 1) * _unrolled(av[2])
        elif op is sre_constants.SUBPATTERN:
            total += _unrolled(av[3])
        elif op is sre_constants.BRANCH:
            total += sum(_unrolled(branch) for branch in av[1])
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            total += _unrolled(av[1])
        elif op is sre_constants.ATOMIC_GROUP:
            total += _unrolled(av)
        elif op is sre_constants.GROUPREF_EXISTS:
            total += _unrolled(av[1]) + (_unrolled(av[2]) if av[2] else 0)
        else:
            total += 1
    return total


def _compile(text: object, macros: Mapping[str, str], where: str) -> re.Pattern[str]:
    """A rule's pattern (a list: a choice of alternatives) with its macros expanded, _checked."""
    if isinstance(text, list) and text and all(isinstance(t, str) and t for t in text):
        text = "|".join(f"(?:{t})" for t in text)  # a list is a choice of alternatives, one per line
    if not isinstance(text, str) or not text:
        raise LogRulesError(f"{where} must be a regular expression or a list of them (alternatives)")

    def expand(m: re.Match[str]) -> str:
        if m.group(1) not in macros:
            raise LogRulesError(f"{where}: no macro named {m.group(1)!r}")
        return macros[m.group(1)]

    try:
        return _checked(_MACRO.sub(expand, text))
    except re.error as exc:
        raise LogRulesError(f"{where}: {exc}") from exc


def _fault(spec: object, pattern: Matcher, tx: Taxonomy, where: str) -> Any:
    if spec == FROM_XID:
        if "xid" not in pattern.groupindex:
            raise LogRulesError(f"{where}: 'fault: xid' needs a group named 'xid' in the pattern")
        return FROM_XID
    if isinstance(spec, str):
        if spec != NONE and spec not in tx.faults:
            raise LogRulesError(f"{where}: 'fault' {spec!r} is not a taxonomy fault id, 'none' or 'xid'")
        return spec
    if isinstance(spec, Mapping) and set(spec) == {"from", "cases"}:
        group, cases = spec["from"], spec["cases"]
        if group not in pattern.groupindex:
            raise LogRulesError(f"{where}: 'fault.from' names {group!r}, which is not a group of the pattern")
        if not isinstance(cases, list) or not cases:
            raise LogRulesError(f"{where}: 'fault.cases' must be a non-empty list of [regex, fault id]")
        compiled = []
        for case in cases:
            if not (isinstance(case, list) and len(case) == 2 and case[1] in tx.faults):
                raise LogRulesError(f"{where}: 'fault.cases' entry {case!r} must be [regex, taxonomy fault id]")
            try:
                checked = _checked(case[0], re.IGNORECASE)
            except (re.error, TypeError) as exc:
                raise LogRulesError(f"{where}: 'fault.cases' regex {case[0]!r}: {exc}") from exc
            compiled.append((Matcher(checked, f"{where}: 'fault.cases'"), case[1]))
        return (group, tuple(compiled))
    raise LogRulesError(f"{where}: 'fault' must be a fault id, 'none', 'xid' or {{from: GROUP, cases: [...]}}")


class LogParser:
    """Parses lines with one rule set (the shipped one by default) against one taxonomy. `log` keeps only the
    rules for that log (KERNEL: rules marked kernel or any); None applies every rule."""

    def __init__(
        self, taxonomy: Taxonomy | None = None, rules: tuple[Rule, ...] | None = None, log: str | None = None
    ) -> None:
        self.tx = taxonomy or load()
        rules = rules if rules is not None else compile_rules(raw_rules(), self.tx)
        self.rules = tuple(r for r in rules if log is None or r.log in (log, ANY))
        # Every keyword, found in one pass over the line (Aho-Corasick, in C): a flooded log costs about a
        # microsecond a line, however many rules there are. Each keyword maps to a bit per rule it selects;
        # the candidates of a line are tried in file order, and the candidate list of each keyword
        # combination is built once (few combinations occur in practice).
        bits: dict[str, int] = {}
        for position, rule in enumerate(self.rules):
            for keyword in rule.keywords:
                bits[keyword] = bits.get(keyword, 0) | 1 << position
        self._automaton = ahocorasick.Automaton(ahocorasick.STORE_ANY)
        for keyword, mask in bits.items():
            self._automaton.add_word(keyword, mask)
        self._automaton.make_automaton()
        self._candidates: dict[int, tuple[Rule, ...]] = {}

    def may_match(self, text: str) -> bool:
        """False when no rule's keyword occurs anywhere in `text` (any number of lines): none of its lines can
        hold a fault, and a flood of output is skipped at the automaton's speed, without splitting it."""
        return next(self._automaton.iter(text), None) is not None

    def parse_line(self, line: str) -> list[FaultEvent]:
        """Every fault in `line` (zero or one)."""
        mask = reduce(or_, map(_VALUE, self._automaton.iter(line)), 0)  # C all the way: no Python loop
        if not mask:
            return []
        candidates = self._candidates.get(mask)
        if candidates is None:
            if len(self._candidates) >= 4096:  # bounded, whatever the log holds
                self._candidates.clear()
            candidates = tuple(r for i, r in enumerate(self.rules) if mask >> i & 1)
            if all(r.fault == NONE for r in candidates):  # whichever matches, the line raises nothing
                candidates = ()
            self._candidates[mask] = candidates
        text = line.strip()
        if "  " in text or "\t" in text or "\r" in text:  # cheaper to test than to normalise every line
            text = " ".join(text.split())
        try:
            for rule in candidates:
                for anchors_, alternative in rule.alternatives:
                    if anchors_:  # plain loops: cheaper than any() over a generator, on every candidate
                        for anchor in anchors_:
                            if anchor in text:
                                break
                        else:
                            continue
                    m = alternative.search(text)
                    if m is not None:
                        event = self._event(rule, m, text)
                        return [] if event is None else [event]
        except TimeoutError:
            return [self._timed_out(rule, text)]
        except LogRulesError as exc:  # a pattern `regex` cannot compile: reported with the line, never raised
            return [self._timed_out(rule, text, f"rule {rule.id} cannot be searched ({exc}): ")]
        return []

    def parse_lines(self, lines: Iterable[str]) -> Iterator[tuple[int, FaultEvent]]:
        """(1-based line number, event) for every fault in `lines`."""
        for number, line in enumerate(lines, start=1):
            for event in self.parse_line(line):
                yield number, event

    def _timed_out(self, rule: Rule, text: str, why: str = "") -> FaultEvent:
        """What a line is when `rule` ran out of time on it (MATCH_TIMEOUT): the unknown fault, with the rule's id and
        why. No later rule decides in its place: the rule might have matched, and a rule that raises nothing comes
        first to keep a user's text from raising anything (the `user-*` rules)."""
        why = why or f"rule {rule.id} gave up on this line (its patterns took over {MATCH_TIMEOUT:g} s of CPU): "
        return FaultEvent(self.tx.faults[UNKNOWN_ID], None, None, None, None, why + text[-200:], rule.id)

    def _event(self, rule: Rule, m: regex.Match[str], text: str) -> FaultEvent | None:
        fault = rule.fault
        if fault == NONE:
            return None
        named = _named_groups(m.re)((None, *m.groups()))
        if fault == FROM_XID:
            return self._xid_event(rule, named)
        _, gpu, pid, process, _ = named
        if isinstance(fault, tuple):
            group, cases = fault
            index = m.re.groupindex.get(group)
            value = (m.group(index) if index else None) or ""
            fault = next((fid for case, fid in cases if case.search(value)), UNKNOWN_ID)
        if gpu is None:
            for g in rule.gpu:
                found = g.search(text)
                if found:
                    gpu = found.group("gpu")
                    break
        # Positional: a named tuple built by keywords costs more, and a flooded log builds many.
        return FaultEvent(
            self.tx.faults[fault],
            None,
            gpu,
            int(pid) if pid and pid.isdigit() else None,
            process,
            text[-200:],
            rule.id,
        )

    def _xid_event(self, rule: Rule, named: tuple[str | None, ...]) -> FaultEvent:
        """The event of an Xid record; `named`: the groups of _NAMED of the rule's match."""
        xid, gpu, pid, process, detail = named
        code = int(xid or 0)
        rest = (detail or "").rstrip()
        fault = self.tx.for_xid(code)
        if 144 <= code <= 150:
            fault = self._nvlink5(code, rest, fault)
        elif code == 154:
            r = _RECOVERY.search(rest)
            if r:
                fault = self.tx.recovery_action_text(r.group("to")) or fault
        detail = rest
        caused = _CAUSED_BY.search(rest) if "caused by" in rest else None
        if caused:
            detail = f"{rest} (sympathetic: caused by Xid {caused.group(1)})"
        return FaultEvent(
            fault,
            xid=code,
            pci_bus_id=gpu,
            pid=int(pid) if pid and pid.isdigit() else None,
            process=process if process and process != "<unknown>" else None,
            detail=detail,
            rule=rule.id,
        )

    def _nvlink5(self, code: int, rest: str, default: Fault) -> Fault:
        regs = _NVLINK5_REGS.search(rest)
        if regs:
            decoded = self.tx.decode_nvlink5(code, int(regs.group(1), 16), int(regs.group(2), 16))
            if decoded is not None:
                return decoded
        # No decode row matched: trust the driver's own word, if it gave one.
        sev = _NVLINK5_SEV.search(rest)
        if sev:
            word = sev.group(1).lower()
            variant = f"xid-{code}-observe" if word.startswith("non") else f"xid-{code}-reset-gpu"
            return self.tx.faults.get(variant, default)
        return default


#: The named groups of a rule's pattern that an event reads, in the order _named_groups gives them.
_NAMED = ("xid", "gpu", "pid", "process", "detail")


@lru_cache(maxsize=4096)
def _named_groups(pattern: regex.Pattern[str]) -> Callable[[tuple[str | None, ...]], tuple[str | None, ...]]:
    """The groups of _NAMED (None where `pattern` has none) from `(None, *match.groups())`: `regex` reads a group
    by name (or groupdict()) several times slower than `re`, and all of them by position as fast."""
    index = pattern.groupindex
    return itemgetter(*(index.get(name, 0) for name in _NAMED))


def _tail(text: str) -> str:
    return text.strip()[-200:]


def load_parser(
    rules_file: str | Path | None = None, taxonomy: Taxonomy | None = None, log: str | None = None
) -> LogParser:
    """A parser for the shipped rules or an operator's `rules_file`, validated now (LogRulesError), keeping
    the rules of `log` (None: every rule)."""
    tx = taxonomy or load()
    return LogParser(tx, compile_rules(raw_rules(rules_file), tx), log)


_default: LogParser | None = None


def parse_line(line: str) -> list[FaultEvent]:
    """Every fault in `line`, classified with the shipped rules and taxonomy."""
    global _default  # noqa: PLW0603 - one parser per process, built on first use
    if _default is None:
        _default = LogParser()
    return _default.parse_line(line)


@dataclass
class LineCutter:
    """Cuts a job's output, read a chunk at a time, into the whole lines the rules judge (`fleetheal launch` and
    the agent's follower of job files). What is left of the last line waits for the next chunk; a line longer
    than MAX_LINE is passed on by its start and the rest of it is dropped, whatever the chunks it comes in."""

    partial: str = ""
    #: Inside a line that was cut, or after output not seen: the next whole line starts after a newline.
    cutting: bool = False

    def lost(self, mid_line: bool = True) -> None:
        """Output between the last chunk and the next was not seen (skipped): the line it started is dropped, and
        the next chunk is read from its first newline on, unless what was skipped ended a line (`mid_line`
        False): then that chunk starts a line, a crash's last line after a flood, say."""
        self.partial, self.cutting = "", mid_line

    def feed(self, text: str) -> str:
        """The whole lines that `text` completes, newline-separated ("" when none)."""
        text = self.partial + text
        if self.cutting:
            _, newline, text = text.partition("\n")
            if not newline:
                self.partial = ""
                return ""
            self.cutting = False
        whole, newline, rest = text.rpartition("\n")
        if len(rest) > MAX_LINE:
            whole = f"{whole}\n{rest[:MAX_LINE]}" if newline else rest[:MAX_LINE]
            rest, self.cutting = "", True
        self.partial = rest
        return whole


def judged_lines(text: str, may_match: Callable[[str], bool]) -> Iterator[str]:
    """The lines of a job's output `text` that a rule may match, each cut to MAX_LINE; a chunk no rule wants
    is skipped whole, and fleetheal's own lines in the job's log (`contracts.OWN_LOG_LINE`) are never the
    job's words."""
    if not text or not may_match(text):
        return
    for whole in text.split("\n"):
        line = whole[:MAX_LINE]
        if line and not line.startswith(OWN_LOG_LINE) and may_match(line):
            yield line
