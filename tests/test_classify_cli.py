"""`fleetheal classify` as a user runs it: a real subprocess, exit codes and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def fleetheal(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetheal", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_xid_json() -> None:
    out = fleetheal("classify", "--xid", "79", "--json")
    assert out.returncode == 0, out.stderr
    (event,) = json.loads(out.stdout)
    assert event["fault_id"] == "xid-79"
    assert event["xid"] == 79
    assert event["pci_bus_id"] is None
    assert (event["class"], event["action"], event["severity"]) == ("hardware", "ISOLATE_AND_RELOCATE", "critical")
    assert "checkpoint" in event["explanation"]


def test_line_table() -> None:
    out = fleetheal(
        "classify", "[Mon Aug  5 03:54:13 2024] NVRM: Xid (PCI:0000:00:07): 31, pid=25, name=python3.10, MMU Fault"
    )
    assert out.returncode == 0, out.stderr
    assert "xid-31" in out.stdout and "REFUSE_AND_REPORT" in out.stdout and "0000:00:07" in out.stdout
    assert "compute-sanitizer" in out.stdout  # the explanation a researcher reads


def test_file_json_has_line_numbers(shared: Path) -> None:
    out = fleetheal("classify", "--file", str(shared / "fixtures" / "fault-log-lines.txt"), "--json")
    assert out.returncode == 0, out.stderr
    events = json.loads(out.stdout)
    lines = (shared / "fixtures" / "fault-log-lines.txt").read_text().splitlines()
    assert events, "the fixture has faults"
    for e in events:
        assert {"fault_id", "xid", "pci_bus_id", "class", "action", "severity", "explanation", "line"} <= e.keys()
        assert not lines[e["line"] - 1].startswith("#")
    gpu_lost = [e for e in events if e["fault_id"] == "gpu-lost"]
    assert "GPU has fallen off the bus" in lines[gpu_lost[0]["line"] - 1]


def test_stdin_and_nothing_found() -> None:
    out = fleetheal("classify", "--file", "-", "--json", stdin="all quiet\nnothing here\n")
    assert (out.returncode, json.loads(out.stdout)) == (0, [])
    out = fleetheal("classify", "just a line")
    assert (out.returncode, out.stdout.strip()) == (0, "no fault found")


def test_unknown_xid_is_observed_not_an_error() -> None:
    out = fleetheal("classify", "--xid", "4242", "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)[0]["action"] == "OBSERVE"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["classify", "--file", "/nonexistent/kern.log"],
            "cannot read /nonexistent/kern.log: No such file or directory",
        ),
        (["classify"], "one of the arguments line --xid --file --coverage --score is required"),
        (["classify", "--xid", "abc"], "invalid int value: 'abc'"),
        (["classify", "--xid", "0"], "--xid must be a positive Xid code, got 0"),
        (["classify", "--xid", "79", "a line"], "not allowed with argument"),
    ],
)
def test_bad_usage(args: list[str], message: str) -> None:
    out = fleetheal(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_coverage_lists_every_emitter_and_fails_on_a_mismatch(tmp_path: Path) -> None:
    import yaml

    from fleetheal.logparse import raw_rules

    out = fleetheal("classify", "--coverage")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    for name in ("[linux, kernel log]", "[nccl, application log]", "[dcgm, application log]", "[ipmi-sel,"):
        assert name in out.stdout
    assert "0 mismatch(es)" in out.stdout
    rows = json.loads(fleetheal("classify", "--coverage", "--json").stdout)
    assert {"emitter", "family", "format", "verdict", "rule", "ok"} <= set(rows[0]) and all(r["ok"] for r in rows)

    doc = raw_rules()
    doc["rules"] = [r for r in doc["rules"] if r["id"] != "hung-task"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(doc))
    out = fleetheal("classify", "--coverage", "--rules", str(rules))
    assert out.returncode == 1
    assert "!! linux hung-task: the rules give none (rule None), the catalog says kernel-hung-task" in out.stdout


def test_score_reports_the_right_share_and_every_miss(tmp_path: Path) -> None:
    """`--score`: how the rules (shipped or an operator's) do on lines labelled by their meaning."""
    import yaml

    labelled = [
        {"line": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "kind": "xid", "fault": "xid-79",
         "class": "hardware", "xid": 79, "gpu": "0000:3b:00"},
        {"line": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "kind": "xid", "fault": "xid-79",
         "class": "hardware", "xid": 79, "gpu": "0000:5e:00"},  # the wrong GPU is a miss
        {"line": "NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>", "kind": "nccl", "fault": "none", "class": "none"},
        {"line": "something the rules were never told about", "kind": "host", "fault": "host-oom", "class": "user"},
    ]  # fmt: skip
    path = tmp_path / "labelled.yaml"
    path.write_text(yaml.safe_dump(labelled))
    out = fleetheal("classify", "--score", str(path))
    assert out.returncode == 0, out.stderr
    assert "4 labelled lines" in out.stdout
    rows = {line[:30].strip(): line[30:].split() for line in out.stdout.splitlines()}
    assert rows["fault lines"] == ["3", "1", "33.3%"]
    assert rows["benign lines (no event)"] == ["1", "1", "100.0%"]
    assert "2 miss(es)" in out.stdout and "want host-oom (user), got none (none)" in out.stdout
    rows = json.loads(fleetheal("classify", "--score", str(path), "--json").stdout)
    assert [r["right"] for r in rows] == [True, False, True, False]

    path.write_text(yaml.safe_dump([{"line": "x", "kind": "host", "fault": "host-oom"}]))
    out = fleetheal("classify", "--score", str(path))
    assert out.returncode == 2 and "entry 1: needs the strings line, kind, fault, class" in out.stderr
    out = fleetheal("classify", "--score", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """`fleetheal classify --file big.log | head`: the pipe closes under the output."""
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetheal", "classify", "--file", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(line * 20000)
    proc.stdin.close()
    proc.stdout.readline()
    proc.stdout.close()  # like `head -1`
    assert proc.wait(60) == 141
    assert "Traceback" not in proc.stderr.read()
