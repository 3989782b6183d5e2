"""What the log rules cover: the message catalog of every emitter that writes to a GPU node's logs
(`policies/message-catalog.yaml`), checked against the rules.

The catalog is the specification, the rules (`policies/log-rules.yaml`) the matcher. For each emitter (the
kernel, a network driver, NVIDIA's driver, NCCL, PyTorch, ...) it names the source release its message
formats were read from, and for each format one example line and the verdict the rules must give it: a
taxonomy fault, `unknown` (reported on purpose as a line no fault fits, with why) or `none` (ignored on
purpose, with why). `check` classifies every example with the rules of the log the emitter writes (the agent
applies the kernel rules to the kernel log) and reports each format's verdict, the rule that decided, and
whether that is what the catalog says. `fleetheal classify --coverage` prints it; `fleetheal generate` writes
docs/log-coverage.md from it; the tests fail on any mismatch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from fleetheal import taxonomy
from fleetheal.logparse import APPLICATION, KERNEL, NONE, LogParser, LogRulesError, Rule, compile_rules, raw_rules
from fleetheal.taxonomy import UNKNOWN_ID, Taxonomy

#: An example line that was not found printed anywhere public, but filled in from the format.
CONSTRUCTED = "constructed from the format"
_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_EMITTER_KEYS = {"id", "name", "log", "source", "formats"}
_FORMAT_KEYS = {"family", "format", "at", "example", "example_source", "verdict", "why", "job_can_cause"}


class CatalogError(LogRulesError):
    """The message catalog is malformed; the message names the emitter, the format and the field."""


@dataclass(frozen=True, slots=True)
class Format:
    emitter: str
    family: str
    format: str
    at: str
    example: str
    example_source: str
    #: A taxonomy fault id, `unknown` or `none`.
    verdict: str
    why: str = ""
    #: The job's own configuration can cause it (a full /dev/shm, a bad NCCL setting): never isolates a node.
    job_can_cause: bool = False

    @property
    def real(self) -> bool:
        """True when the example was copied from a public source, not filled in from the format."""
        return not self.example_source.startswith(CONSTRUCTED)


@dataclass(frozen=True, slots=True)
class Emitter:
    id: str
    name: str
    log: str
    repo: str
    version: str
    commit: str | None
    formats: tuple[Format, ...]


@dataclass(frozen=True, slots=True)
class Row:
    """One format's example, classified: what the rules said against what the catalog says."""

    format: Format
    got: str  # the fault id the rules gave, or `none`
    rule: str | None
    problem: str = ""  # empty when the verdict is the catalog's and the format's safety holds

    @property
    def ok(self) -> bool:
        return not self.problem


def raw() -> dict[str, Any]:
    """The shipped catalog as parsed YAML."""
    text = resources.files(__package__).joinpath("message-catalog.yaml").read_text("utf-8")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        raise CatalogError(f"message catalog: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("emitters"), list) or not doc["emitters"]:
        raise CatalogError("message catalog: the file must be a mapping with a non-empty 'emitters' list")
    return doc


def parse(doc: dict[str, Any], tx: Taxonomy) -> tuple[Emitter, ...]:
    """Validate the catalog; every problem raises CatalogError naming the emitter, format and field."""
    emitters: list[Emitter] = []
    seen: set[str] = set()
    for i, e in enumerate(doc["emitters"]):
        where = f"message catalog: emitters[{i}] (id {e.get('id') if isinstance(e, dict) else None!r})"
        if not isinstance(e, dict) or set(e) != _EMITTER_KEYS:
            raise CatalogError(f"{where}: an emitter has exactly the fields {', '.join(sorted(_EMITTER_KEYS))}")
        if not isinstance(e["id"], str) or not _ID.match(e["id"]) or e["id"] in seen:
            raise CatalogError(f"{where}: 'id' must be a new lower-case id")
        seen.add(e["id"])
        if e["log"] not in (KERNEL, APPLICATION):
            raise CatalogError(f"{where}: 'log' must be {KERNEL} or {APPLICATION} (the log the emitter writes)")
        source = e["source"]
        if not isinstance(source, dict) or not all(isinstance(source.get(k), str) for k in ("repo", "version")):
            raise CatalogError(f"{where}: 'source' must give the 'repo' and the 'version' the formats were read from")
        commit = source.get("commit")
        if commit is not None and not re.fullmatch(r"[0-9a-f]{40}", str(commit)):
            raise CatalogError(f"{where}: 'source.commit' must be 40 hex digits or null")
        if not isinstance(e["formats"], list) or not e["formats"]:
            raise CatalogError(f"{where}: 'formats' must be a non-empty list")
        formats = tuple(_format(e["id"], j, f, tx, where) for j, f in enumerate(e["formats"]))
        emitters.append(Emitter(e["id"], e["name"], e["log"], source["repo"], source["version"], commit, formats))
    return tuple(emitters)


def _format(emitter: str, j: int, f: Any, tx: Taxonomy, where: str) -> Format:
    where = f"{where}: formats[{j}]"
    if not isinstance(f, dict) or not {"family", "format", "at", "example", "example_source", "verdict"} <= set(f):
        raise CatalogError(f"{where}: a format needs family, format, at, example, example_source and verdict")
    if extra := set(f) - _FORMAT_KEYS:
        raise CatalogError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    for key in ("family", "format", "at", "example", "example_source"):
        if not isinstance(f[key], str) or not f[key].strip():
            raise CatalogError(f"{where}: {key!r} must be a non-empty string")
    if "\n" in f["example"]:
        raise CatalogError(f"{where}: 'example' must be one line")
    verdict = f["verdict"]
    if verdict != NONE and verdict not in tx.faults:
        raise CatalogError(f"{where}: verdict {verdict!r} is not a taxonomy fault id, 'unknown' or 'none'")
    why = f.get("why", "")
    if verdict in (NONE, UNKNOWN_ID) and not (isinstance(why, str) and why.strip()):
        raise CatalogError(f"{where}: a format left {verdict!r} on purpose must say 'why'")
    job = f.get("job_can_cause", False)
    if not isinstance(job, bool):
        raise CatalogError(f"{where}: 'job_can_cause' must be true or false")
    return Format(
        emitter, f["family"], f["format"], f["at"], f["example"], f["example_source"], verdict, why or "", job
    )


@functools.cache
def load() -> tuple[Emitter, ...]:
    """The shipped catalog, validated against the shipped taxonomy."""
    return parse(raw(), taxonomy.load())


def check(emitters: Iterable[Emitter], tx: Taxonomy | None = None, rules: tuple[Rule, ...] | None = None) -> list[Row]:
    """Every format's example classified by the rules (`rules`, else the shipped ones) of its emitter's log."""
    tx = tx or taxonomy.load()
    rules = rules if rules is not None else compile_rules(raw_rules(), tx)  # once, for both logs' parsers
    parsers = {log: LogParser(tx, rules, log=log) for log in (KERNEL, APPLICATION)}
    rows: list[Row] = []
    for emitter in emitters:
        parser = parsers[emitter.log]
        for f in emitter.formats:
            events = parser.parse_line(f.example)
            got, rule = (events[0].fault.id, events[0].rule) if events else (NONE, None)
            problem = ""
            if got != f.verdict:
                problem = f"the rules give {got} (rule {rule}), the catalog says {f.verdict}"
            elif f.job_can_cause and got != NONE and tx.moves_node(got):
                problem = f"the job's own configuration can cause it, but {got} moves the node"
            rows.append(Row(f, got, rule, problem))
    return rows


def as_dict(row: Row) -> dict[str, Any]:
    f = row.format
    return {
        "emitter": f.emitter,
        "family": f.family,
        "format": f.format,
        "at": f.at,
        "example": f.example,
        "example_source": f.example_source,
        "verdict": f.verdict,
        "why": f.why,
        "got": row.got,
        "rule": row.rule,
        "ok": row.ok,
        "problem": row.problem,
    }


def report(emitters: tuple[Emitter, ...], rows: list[Row]) -> str:
    """The coverage table for a terminal: per emitter, its source, and each format's verdict and rule."""
    by_emitter = _by_emitter(rows)
    out: list[str] = []
    for e in emitters:
        mine = by_emitter.get(e.id, [])
        mapped = sum(r.format.verdict not in (NONE, UNKNOWN_ID) for r in mine)
        out.append(f"{e.name} [{e.id}, {e.log} log] from {e.repo} {e.version}: {len(mine)} formats, {mapped} mapped")
        for r in mine:
            mark = "  " if r.ok else "!!"
            rule = r.rule or "-"
            out.append(f"{mark} {r.format.family:24} {r.format.verdict:26} {rule:26} {_short(r.format.format, 60)}")
        out.append("")
    bad = [r for r in rows if not r.ok]
    real = sum(r.format.real for r in rows)
    out.append(
        f"{len(rows)} formats of {len(emitters)} emitters; {real} examples copied from public sources, "
        f"{len(rows) - real} filled in from the format; {len(bad)} mismatch(es)"
    )
    out.extend(f"!! {r.format.emitter} {r.format.family}: {r.problem}: {_short(r.format.example, 100)}" for r in bad)
    return "\n".join(out)


def docs(emitters: tuple[Emitter, ...], rows: list[Row]) -> str:
    """docs/log-coverage.md: per emitter, every format with its verdict, the deciding rule and the reason for
    what is left unknown or ignored."""

    def cell(text: object) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    by_emitter = _by_emitter(rows)
    lines = [
        "<!-- GENERATED by `fleetheal generate` from policies/message-catalog.yaml. Do not edit. -->",
        "# Log coverage: what the emitters print, and what fleetheal makes of it",
        "",
        "For every emitter that writes to a GPU node's logs, the message formats of its public source (the",
        "release is named), what the log rules (`policies/log-rules.yaml`, [docs/log-rules.md](log-rules.md)) make",
        "of each, and why a format is ignored (`none`) or reported as `unknown` on purpose. Each format's example",
        "line is classified by the rules of the log the emitter writes; `fleetheal classify --coverage` prints the",
        "same check, and the tests fail when an example no longer gets its verdict. A family marked *job* can be",
        "caused by the job's own configuration, so its verdict never moves the node.",
        "",
    ]
    total = len(rows)
    real = sum(r.format.real for r in rows)
    lines.append(
        f"{total} formats of {len(emitters)} emitters; {real} examples copied from public sources, "
        f"{total - real} filled in from the format (marked *constructed*)."
    )
    lines.append("")
    lines.append("| emitter | log | source | formats | mapped to a fault | unknown | ignored |")
    lines.append("|---|---|---|---|---|---|---|")
    for e in emitters:
        mine = by_emitter.get(e.id, [])
        unknown = sum(r.format.verdict == UNKNOWN_ID for r in mine)
        ignored = sum(r.format.verdict == NONE for r in mine)
        mapped = len(mine) - unknown - ignored
        lines.append(
            f"| [{cell(e.name)}](#{e.id}) | {e.log} | {cell(e.repo)} {cell(e.version)} | {len(mine)} | {mapped} "
            f"| {unknown} | {ignored} |"
        )
    for e in emitters:
        lines += ["", f"## {e.id}", "", f"{cell(e.name)}, {e.log} log. Source: {cell(e.repo)}, {cell(e.version)}"]
        if e.commit:
            lines[-1] += f" (commit `{e.commit[:12]}`)"
        lines[-1] += "."
        lines += ["", "| family | format | at | verdict | rule | why | example |", "|---|---|---|---|---|---|---|"]
        for r in by_emitter.get(e.id, []):
            f = r.format
            family = f"{f.family} *job*" if f.job_can_cause else f.family
            example = (
                f"[real]({f.example_source})"
                if f.real and f.example_source.startswith("http")
                else ("real" if f.real else "*constructed*")
            )
            lines.append(
                f"| {cell(family)} | `{cell(_short(f.format, 90))}` | {cell(f.at)} | `{f.verdict}` | "
                f"{'`' + r.rule + '`' if r.rule else '-'} | {cell(f.why)} | {example} |"
            )
    return "\n".join(lines) + "\n"


def _by_emitter(rows: list[Row]) -> dict[str, list[Row]]:
    by: dict[str, list[Row]] = {}
    for row in rows:
        by.setdefault(row.format.emitter, []).append(row)
    return by


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
