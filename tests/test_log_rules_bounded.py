"""A rule's pattern cannot hang the classifier (issue 46): an operator's rules file can hold a pattern that backtracks
without end on some line (`(a|aa)+b`), and a local user shapes some text of the kernel log (the file name in a
segfault record) and all of a job's output. Python's `re` cannot stop a search; the rules are matched by `regex`,
which gives up on a line after `logparse.MATCH_TIMEOUT` of CPU, and the line is reported as the unknown fault with
the rule's id. Loading is bounded too: a pattern whose required repetitions multiply out is refused.

The catastrophic tests are marked with pytest-timeout's thread method: were the bound lost, the search would hold
the interpreter for hours, and only a thread outside it can end the run (and name the test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetheal import logcatalog
from fleetheal.logparse import (
    MAX_LINE,
    LogParser,
    LogRulesError,
    compile_rules,
    load_parser,
    raw_rules,
)
from fleetheal.taxonomy import load
from tests.test_log_corpus import corpus

#: 44 a's: `(a|aa)+b` tries about 1.6**44 (some 10**9) ways to split them before it fails; `re` takes hours.
NAME = "a" * 44
#: A segfault record of a program whose mapping's file name a local user chose (arch/x86/mm/fault.c).
SEGFAULT = f"[ 1234.567890] python3[4242]: segfault at 0 ip 00007f00deadbeef sp 00007ffc00000000 error 4 in {NAME}[7f0000+1000]"
XID79 = "[ 1235.000001] NVRM: Xid (PCI:0000:b1:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
#: An operator's rule, first in their copy of the shipped file: a crash in their site's library is worth knowing of.
SITE_RULE = {
    "id": "site-lib-crash",
    "log": "kernel",
    "description": "A crash in the site's own library.",
    "keywords": ["segfault"],
    "pattern": r"segfault at \w+ ip \w+ sp \w+ error \d+ in (a|aa)+b",
    "fault": "unknown",
}


def operators_rules(tmp_path: Path, rule: dict[str, Any]) -> Path:
    """The shipped rules file with `rule` added first, as an operator writes theirs."""
    doc = raw_rules()
    doc["rules"].insert(0, rule)
    path = tmp_path / "log-rules.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.timeout(30, method="thread")
def test_a_catastrophic_rule_gives_up_on_the_line_and_reports_it(tmp_path: Path) -> None:
    parser = load_parser(rules_file=operators_rules(tmp_path, SITE_RULE), log="kernel")
    (event,) = parser.parse_line(SEGFAULT)
    assert (event.fault.id, event.known, event.rule) == ("unknown", False, "site-lib-crash")
    assert "gave up on this line" in event.detail and NAME in event.detail, "why, and the line itself"
    assert not load().actions[event.fault.action].destructive
    # No later rule decides in its place (here the user-crash record, which would raise nothing), and the
    # parser goes on with the next line.
    assert [(e.fault.id, e.rule) for e in parser.parse_line(XID79)] == [("xid-79", "nvrm-xid")]
    assert parser.parse_line(SEGFAULT.replace(NAME, "libsite.so")) == [], "an ordinary crash: the user-crash record"


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize(
    "change",
    [
        {
            "pattern": r"segfault at (?P<addr>\w+) .* in (?P<file>\S+)",
            "fault": {"from": "file", "cases": [["(a|aa)+b", "gpu-lost"]]},
        },
        {"pattern": r"segfault at \w+", "gpu": [r"in (?P<gpu>(a|aa)+b)"]},
    ],
    ids=["fault.cases", "gpu"],
)
def test_a_rules_other_patterns_are_bounded_too(change: dict[str, Any]) -> None:
    doc = raw_rules()
    doc["rules"].insert(0, {**SITE_RULE, **change, "evidence": "a test's"})
    parser = LogParser(load(), compile_rules(doc, load()), log="kernel")
    (event,) = parser.parse_line(SEGFAULT)
    assert (event.fault.id, event.rule) == ("unknown", "site-lib-crash")
    assert "gave up on this line" in event.detail


@pytest.mark.timeout(30, method="thread")
def test_the_agent_counts_the_line_under_the_rule_and_reads_on(tmp_path: Path) -> None:
    """The agent's kernel-log reader: the line is counted in `fleetheal_agent_log_lines_unknown_total` under the
    rule that gave up on it (and logged), nothing is raised, and the next line is read."""
    from fleetheal.agent.config import load_config
    from fleetheal.agent.service import Agent
    from fleetheal.agent.simulated import SimulatedGpuBackend

    env = {
        "FLEETHEAL_AGENT_NODE": "n1",
        "FLEETHEAL_AGENT_MODE": "observe",
        "FLEETHEAL_AGENT_METRICS__PORT": "0",
        "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
        "FLEETHEAL_AGENT_KERNEL_LOG__RULES_FILE": str(operators_rules(tmp_path, SITE_RULE)),
        "FLEETHEAL_AGENT_TRAINING__ENABLED": "false",
        "FLEETHEAL_AGENT_BACKEND__KIND": "simulated",
        "FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE": str(tmp_path / "sim.json"),
        "FLEETHEAL_AGENT_HEALTH_FILE": str(tmp_path / "health"),
    }
    cfg = load_config(None, env=env)
    agent = Agent(cfg, SimulatedGpuBackend(cfg.backend.simulated.state_file, 8), drainer=None)
    agent.kernel_line(SEGFAULT)
    labels = {"source": "kernel_log", "rule": "site-lib-crash"}
    assert agent.metrics.registry.get_sample_value("fleetheal_agent_log_lines_unknown_total", labels) == 1
    assert agent.tracker.active() == []
    agent.kernel_line(XID79)
    assert [a.fault.id for a in agent.tracker.active()] == ["xid-79"]


@pytest.mark.timeout(60)
def test_fleetheal_classify_returns_and_names_the_rule(tmp_path: Path) -> None:
    """`fleetheal classify --rules` with the operator's file, over a log holding the crafted line: every line read,
    the crafted one reported with the rule that gave up on it."""
    log = tmp_path / "kern.log"
    log.write_text(f"{XID79}\n{SEGFAULT}\n{XID79}\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetheal",
            "classify",
            "--rules",
            str(operators_rules(tmp_path, SITE_RULE)),
            "--file",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"^2 +unknown .* site-lib-crash$", out.stdout, re.MULTILINE), out.stdout
    assert "rule site-lib-crash gave up on this line" in out.stdout
    assert out.stdout.count("xid-79") >= 2


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        # `regex` writes required repetitions out: seconds and gigabytes to compile this one (`re`: a millisecond).
        (r"segfault (?:(?:a{1000}){1000}){1000}", r"multiply out to 1,000,000,009 copies"),
        (r"segfault (?:x{100}){100}", r"multiply out to 10,009 copies .*at most 10,000"),
        # What `regex` reads and `re` does not is no Python regular expression: refused with `re`'s word.
        (r"segfault \p{L}+", r"bad escape \\p"),
        (r"(?V1)segfault", r"unknown extension \?V"),
    ],
)
def test_a_pattern_beyond_the_engine_is_refused_when_the_rules_load(pattern: str, message: str) -> None:
    doc = raw_rules()
    doc["rules"].insert(0, {**SITE_RULE, "pattern": pattern})
    with pytest.raises(LogRulesError, match=r"rules\[0\] \(id 'site-lib-crash'\): 'pattern': .*" + message):
        compile_rules(doc, load())


def test_a_pattern_within_the_bounds_loads() -> None:
    doc = raw_rules()
    doc["rules"].insert(0, {**SITE_RULE, "pattern": r"segfault (?:x{100}){90} (?:y{0,1000}){900}"})
    assert compile_rules(doc, load())[0].id == "site-lib-crash"


def _lines() -> list[str]:
    """Every line of the corpus and every example of the message catalog, as the parser reads them (stripped,
    whitespace runs made one space)."""
    raw = [e["line"] for e in corpus()] + [f.example for e in logcatalog.load() for f in e.formats]
    return [" ".join(line.split()) for line in raw]


def test_every_shipped_pattern_matches_as_re_matches_it_on_every_corpus_line() -> None:
    """`regex` reads `re`'s syntax with `re`'s meaning (its VERSION0), but it is another engine: on every line of the
    corpus and every catalog example, each pattern the shipped rules search (alternatives, `gpu` patterns,
    `fault.cases`) finds the same match, at the same place, with the same groups, as `re` compiled from it."""
    patterns = []
    for rule in compile_rules(raw_rules(), load()):
        patterns += [rx for _, rx in rule.alternatives] + list(rule.gpu)
        if isinstance(rule.fault, tuple):
            patterns += [case for case, _ in rule.fault[1]]
    assert len(patterns) > 300
    lines = _lines()
    differ = []
    for matcher in patterns:
        rx, reference = matcher.compiled(), matcher.checked  # compiled: every shipped pattern compiles in `regex`
        for line in lines:
            m, want = rx.search(line), reference.search(line)
            if m is None and want is None:
                continue
            if m is None or want is None or (m.span(), m.groups()) != (want.span(), want.groups()):
                differ.append((rx.pattern, line))
    assert differ == []


def _words_repeated(rule: Any) -> list[str]:
    """Lines a job can print to make `rule` work hardest: MAX_LINE of one of its keywords or literal strings repeated,
    with each of a few separators, and of all of them in turn (a `PREFIX.*WORDS` pattern backtracks once per PREFIX)."""
    words = list(dict.fromkeys([*rule.keywords, *(a for anchors_, _ in rule.alternatives for a in anchors_)]))
    units = [w + sep for w in words for sep in (" ", ":", "", ": ", " x ")] + [" ".join(words) + " ", "".join(words)]
    return [" ".join((unit * (MAX_LINE // len(unit) + 1))[:MAX_LINE].split()) for unit in units]


@pytest.mark.timeout(600, method="thread")
def test_no_shipped_rule_gives_up_on_a_line_of_its_own_words_repeated() -> None:
    """A job's output is its owner's to write, and every `application` and `any` rule reads it (the kernel rules read
    what the user shapes in kernel records). A line of 4 KiB of a rule's own words made ten shipped patterns give up
    (over MATCH_TIMEOUT, each of them, on each such line: `NVRM: .*(...)` tried the rest of the line once per
    `NVRM: `); written `\\A(?>.*?PREFIX).*WORDS`, each takes milliseconds, and every pattern decides."""
    gave_up = []
    for rule in compile_rules(raw_rules(), load()):
        for line in _words_repeated(rule):
            for _, matcher in rule.alternatives:
                try:
                    matcher.search(line)
                except TimeoutError:
                    gave_up.append((rule.id, matcher.pattern, line[:40]))
    assert gave_up == []
