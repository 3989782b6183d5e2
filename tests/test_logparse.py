"""The log parser against the real lines in shared/fixtures, and against formats those lines don't show."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetheal.logparse import MAX_LINE, LineCutter, LogParser, LogRulesError, compile_rules, judged_lines, parse_line
from fleetheal.taxonomy import load


def fixture_lines(path: Path) -> list[str]:
    return [line.split("\t")[0] for line in path.read_text().splitlines() if line and not line.startswith("#")]


# (start of the fixture line, fault id or None for a context line, xid, pci bus id, pid, process)
XID_EXPECTED = [
    ("[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13,", "xid-13", 13, "0000:cb:00", None, None),
    (
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109",
        "xid-109",
        109,
        "0000:cb:00",
        1797828,
        "pt_main_thread",
    ),
    ("Jan 18 11:38:05 localhost kernel:", "xid-3", 3, "0000:01:00", None, None),
    ("May 13 17:18:57 hyperion", "xid-69", 69, "0000:08:00", None, None),
    ("Dec 23 23:30:56 rescue", "xid-32", 32, "0000:01:00", None, None),
    ("Dec 23 23:32:27 rescue", "xid-62", 62, "0000:01:00", None, None),
    ("[...] NVRM: Xid (0000:03:00): 14", "xid-14", 14, "0000:03:00", None, None),
    ("NVRM: Xid (PCI:0000:b1:00): 79", "xid-79", 79, "0000:b1:00", None, None),
    ("[2397166.923949]", "xid-64", 64, "0000:0f:00", None, None),
    ("[Mon Aug  5 03:54:13 2024]", "xid-31", 31, "0000:00:07", 2512125, "python3.10"),
    ("kernel: NVRM: Xid (PCI:0000:ed:00): 45", "xid-45", 45, "0000:ed:00", 1818992, "python3"),
    ("Dec  2 11:38:47 worker4", "xid-48", 48, "0000:07:00", None, None),
    ("[Sun Feb 23 16:24:24 2025]", "xid-119", 119, "0000:9b:00", 2024380, "nvidia-smi"),
    ("[1231741.378609]", "xid-43", 43, "0009:01:00", 3188489, "trigger_xid"),
    ("[6781741.548779]", "xid-79", 79, "0000:91:00", None, None),
    ("[Sat Oct 12 18:35:32 2024]", "xid-45", 45, "0000:61:00", 1496200, "distprovers-gpu"),
    ("kwi 15 07:56:59 testowy kernel: NVRM: Xid", "xid-38", 38, "0000:07:00", 326, "modprobe"),
    ("[74889.644138]", "xid-79", 79, "0000:02:00", None, None),
    ("NVRM: Xid (PCI:0000:9b:00): 119, pid=28232", "xid-119", 119, "0000:9b:00", 28232, "cache_mgr_main"),
    # NVIDIA's decode: NETIR_LINK_EVT with intrinfo bits 6-11 = 100110 -> immediate action IGNORE.
    ("NVRM: Xid (PCI:0000:00:00): 149", "xid-149-observe", 149, "0000:00:00", None, None),
    ("[Wed Jun 24 15:44:20 2026]", "xid-13", 13, "0000:70:00", None, None),
]

FAULT_EXPECTED = [
    ("[ 1843.308145] NVRM: The NVIDIA GPU", None, None),
    ("May 18 19:02:39 kernel: NVRM: GPU 0000:2b:00.0", "gpu-lost", "0000:2b:00.0"),
    ("[186965.348898] nvidia-nvswitch2", "nvswitch-sxid-nonfatal", "0000:85:00.0"),
    ("[11219.196524] {1}[Hardware Error]", None, None),
    ("[11219.196715] EDAC skx MC3", "host-mce-memory", None),
    ("[Sun Feb 23 16:24:18 2025] NVRM: GPU4 GSP RPC buffer", None, None),
    ("[Feb 27 2025 15:10:02]", "nvswitch-sxid-nonfatal", "00000000:86:00.0"),
    ("Jul 09 10:42:47 pool0-0082", "nvlink-link-failure", None),
    ("[6781753.400584] nvidia-nvswitch1", "nvswitch-sxid-fatal", "0000:06:00.0"),
    ("Mar 21 20:18:56 pc kernel", "gpu-lost", "0000:01:00.0"),
    ("kwi 15 07:56:59 testowy kernel: NVRM: GPU at", None, None),
    ("[80746] [rank0]", "nccl-timeout", None),
    ("[rank1]:[E626", "nccl-timeout", None),
    ("[E ProcessGroupNCCL.cpp:458]", "nccl-timeout", None),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB", "cuda-oom", None),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.73 GiB", "cuda-oom", None),
    ("CUDA kernel errors might be", None, None),
    ("frame #3:", None, None),
    ("RuntimeError: CUDA error: uncorrectable ECC", "cuda-ecc-uncorrectable", None),
    ("[E ProcessGroupNCCL.cpp:916]", "cuda-ecc-uncorrectable", None),
    ("Sep 19 16:18:02 bubz", None, None),
    ("[  +0.000004] pcieport 0000:00:03.0", "pcie-aer-fatal", "0000:00:03.0"),
    ("[74785.660366] pcieport 0000:00:02.0: AER: Corrected", "pcie-aer-corrected", "0000:00:02.0"),
    ("[74889.542044] pcieport", "pcie-aer-fatal", "0000:00:02.0"),
    ("[1084456.074566]", "gpu-lost", "0000:09:00.0"),
    ("pcieport 0000:00:01.2: AER: Uncorrectable (Non-Fatal)", "pcie-aer-nonfatal", "0000:63:00.0"),
    ("[Wed Jul 31 23:14:18 2024] NVRM: GPU Board Serial", None, None),
]


def _find(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, f"{start!r} matches {len(found)} fixture lines"
    return found[0]


def test_every_xid_fixture_line(shared: Path) -> None:
    lines = fixture_lines(shared / "fixtures" / "xid-log-lines.txt")
    assert len(lines) == len(XID_EXPECTED), "a fixture line has no expectation here"
    for start, fault_id, xid, bus, pid, process in XID_EXPECTED:
        events = parse_line(_find(lines, start))
        assert len(events) == 1, start
        e = events[0]
        assert (e.fault.id, e.xid, e.pci_bus_id, e.pid, e.process) == (fault_id, xid, bus, pid, process), start


def test_every_fault_fixture_line(shared: Path) -> None:
    lines = fixture_lines(shared / "fixtures" / "fault-log-lines.txt")
    assert len(lines) == len(FAULT_EXPECTED), "a fixture line has no expectation here"
    for start, fault_id, bus in FAULT_EXPECTED:
        events = parse_line(_find(lines, start))
        if fault_id is None:
            assert events == [], f"context line gave {events}"
        else:
            assert [(e.fault.id, e.pci_bus_id) for e in events] == [(fault_id, bus)], start


def test_sympathetic_xid_names_its_cause() -> None:
    (e,) = parse_line(
        "kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1, name=python3, Ch 0000000c caused by previous Xid 145"
    )
    assert e.fault.action == "OBSERVE"
    assert "caused by Xid 145" in e.detail


# Formats the fixtures don't show: the same record behind other prefixes, other codes and bus ids.
@pytest.mark.parametrize(
    "line",
    [
        "6,1234,567890123,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
        "kern  :warn  : 2026-11-29T18:00:00,123456+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
        "2026-11-29T18:00:00.123456+00:00 gpu-node-17 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
        "<4>[ 5.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
    ],
)
def test_prefixes_do_not_matter(line: str) -> None:
    (e,) = parse_line(line)
    assert (e.fault.id, e.xid, e.pci_bus_id, e.pid, e.process) == ("xid-79", 79, "0000:3b:00", 4242, "python")


@pytest.mark.parametrize(
    ("line", "fault_id", "xid"),
    [
        ("NVRM: Xid (PCI:0000:4e:00): 94, pid=77, name=train, Ch 00000010, Contained: CE User Channel", "xid-94", 94),
        ("NVRM: Xid (PCI:0000:4e:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB", "xid-95", 95),
        ("NVRM: Xid (PCI:0000:4e:00): 171, Uncorrectable DRAM error", "xid-171", 171),
        ("NVRM: Xid (PCI:0000:4e:00): 201, a code from a future driver", "unknown", 201),
        (
            "NVRM: Xid (PCI:0000:4e:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
            "xid-154-node-reboot",
            154,
        ),
        (
            "NVRM: Xid (PCI:0000:4e:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
            "xid-154-gpu-reset",
            154,
        ),
        (
            "NVRM: Xid (PCI:0000:4e:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 03 (0xffffffff 0x99999999)",
            "xid-145-observe",
            145,
        ),
        ("NVRM: Xid (PCI:0000:4e:00): 150, MSE_WATCHDOG Fatal (0x00000000 0x00000000)", "xid-150-reset-gpu", 150),
    ],
)
def test_other_xid_codes(line: str, fault_id: str, xid: int) -> None:
    (e,) = parse_line(line)
    assert (e.fault.id, e.xid, e.pci_bus_id) == (fault_id, xid, "0000:4e:00")


@pytest.mark.parametrize(
    ("line", "fault_id"),
    [
        ("[  12.3] NVRM: GPU at PCI:0000:41:00: GPU has fallen off the bus.", "gpu-lost"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda-illegal-address"),
        ("RuntimeError: CUDA error: out of memory", "cuda-oom"),
        ("[E ProcessGroupNCCL.cpp:1234] NCCL watchdog thread terminated with exception: NCCL timeout", "nccl-timeout"),
        ("NVRM: _kgspRpcRecvPoll: Timeout after 6s of waiting for RPC response from GPU1 GSP!", "gsp-rpc-timeout"),
        ("EDAC MC1: 1 UE memory read error on CPU_SrcID#0_MC#1_Chan#0_DIMM#0", "host-memory-ue"),
        ("EDAC MC1: 3 CE memory read error on CPU_SrcID#0_MC#1_Chan#0_DIMM#0", "host-memory-ce"),
        ("mce: Uncorrected hardware memory error in user-access at 3b0d2c1000", "host-memory-ue"),
        ("OSError: [Errno 28] No space left on device: '/ckpt/step_1000.pt'", "write-no-space"),
        ("mlx5_core 0000:5e:00.0 ibp94s0: Link down", "nic-down"),
        ("igb 0000:01:00.0 eno1: igb: eno1 NIC Link is Down", "nic-down"),
        ("step 1200 | loss nan | lr 3.0e-04", "nan-loss"),
        ("pcieport 0000:80:01.0: AER: Multiple Uncorrected (Fatal) error received: 0000:81:00.0", "pcie-aer-fatal"),
    ],
)
def test_other_fault_formats(line: str, fault_id: str) -> None:
    assert [e.fault.id for e in parse_line(line)] == [fault_id]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "Nov 29 18:00:00 node1 systemd[1]: Started Session 42 of user root.",
        "2026-11-29T18:00:00Z step=1234 loss=2.3456 lr=3e-4",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "mlx5_core 0000:5e:00.0 ibp94s0: Link up",
    ],
)
def test_non_faults_yield_nothing(line: str) -> None:
    assert parse_line(line) == []


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("NVRM: Xid (garbled", "unknown-nvrm"),
        ("\x00\xff binary junk NVRM: Xid (PCI:zz:yy): ab", "unknown-nvrm"),
        ("NVRM: GPU 0000:3b:00.0: _kfooBar_GB300: a new engine failed in a way no rule knows", "unknown-nvrm"),
        ("node7:1234:1240 [3] NCCL WARN something new went wrong", "unknown-nccl"),
        ("RuntimeError: CUDA error: a brand new error string", "unknown-cuda"),
    ],
)
def test_suspicious_lines_no_rule_knows_are_reported_as_unknown(line: str, rule: str) -> None:
    (e,) = parse_line(line)
    assert (e.fault.id, e.known, e.rule) == ("unknown", False, rule)
    assert e.detail.split() == line.split(), "the line itself is reported"


def test_parse_lines_numbers_from_one() -> None:
    lines = ["boot", "NVRM: Xid (PCI:0000:b1:00): 79, GPU has fallen off the bus.", "done"]
    assert [(n, e.fault.id) for n, e in LogParser().parse_lines(lines)] == [(2, "xid-79")]


GOOD_RULE = {
    "id": "my-rule",
    "log": "kernel",
    "description": "d",
    "keywords": ["Xid"],
    "pattern": r"NVRM: Xid \((?P<gpu>{bus})\): (?P<xid>\d+)",
    "fault": "xid",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": "My Rule"}, "'id' must be lower-case words"),
        ({"log": "dmesg"}, "'log' must be one of kernel, application, any"),
        ({"keywords": ["fallen off"]}, "a keyword must hold no whitespace"),
        ({"keywords": [79]}, "'keywords' must be a non-empty list of strings"),
        ({"pattern": "^NVRM: Xid"}, "must not anchor to the line start"),
        ({"pattern": r"\ANVRM: Xid"}, "must not anchor to the line start"),
        ({"pattern": "NVRM: Xid ("}, "'pattern': missing \\)"),
        ({"pattern": "NVRM {nosuch}"}, "no macro named 'nosuch'"),
        ({"fault": "xid-9999"}, "'fault' 'xid-9999' is not a taxonomy fault id"),
        ({"pattern": "NVRM: Xid", "fault": "xid"}, "needs a group named 'xid'"),
        ({"fault": {"from": "sev", "cases": [["x", "gpu-lost"]]}}, "'fault.from' names 'sev'"),
        ({"gpu": ["no group here"]}, "has no group named 'gpu'"),
        ({"severity": "high"}, "unknown field"),
        ({"pattern": "GPU has fallen off the bus", "fault": "gpu-lost"}, "'evidence' must say why the line alone"),
        ({"evidence": 3}, "'evidence' must be a string"),
    ],
)
def test_a_bad_rule_is_refused_with_its_id_and_field(change: dict[str, object], message: str) -> None:
    doc = {"macros": {"bus": "[0-9a-f:.]+"}, "rules": [GOOD_RULE, {**GOOD_RULE, "id": "other", **change}]}
    with pytest.raises(LogRulesError, match=r"rules\[1\] .*" + message if "id" not in change else message):
        compile_rules(doc, load())


def test_the_shipped_rules_load_and_every_rule_is_reached_by_a_corpus_line_or_a_catalog_example() -> None:
    """No dead rule: every fault rule decides at least one real line of the corpus or one example of the
    emitters' message catalog (catch-alls included)."""
    from fleetheal import logcatalog
    from tests.test_log_corpus import corpus

    parser = LogParser()
    lines = [entry["line"] for entry in corpus()] + [f.example for e in logcatalog.load() for f in e.formats]
    used = {e.rule for line in lines for e in parser.parse_line(line)}
    context = {r.id for r in parser.rules if r.fault == "none"}
    assert {r.id for r in parser.rules} - used - context == set()


def test_a_job_output_is_cut_into_whole_lines_whatever_the_chunks() -> None:
    """What `fleetheal launch` and the agent's file follower judge: whole lines only, a long line by its start
    (however many chunks it spans), and after output not seen, nothing until a new line starts."""
    cut = LineCutter()
    assert cut.feed("step 1\nstep") == "step 1"
    assert cut.feed(" 2\nNCCL") == "step 2"
    long = "x" * (MAX_LINE + 10)
    assert cut.feed(" watchdog\n" + long[:3000]) == "NCCL watchdog"
    assert cut.feed(long[3000:]) == long[:MAX_LINE]  # its start, once the start is there
    assert cut.feed(" CUDA out of memory\nnext\n") == "next"  # the rest of the long line is dropped
    cut.feed("half a li")
    cut.lost()
    assert cut.feed("ne after a gap\nwhole\n") == "whole"
    cut.feed("the start of a line whose end was skipped")
    cut.lost(mid_line=False)  # what was skipped ended its line: the next chunk starts one
    assert cut.feed("NCCL watchdog\n") == "NCCL watchdog"


def test_fleetheals_own_lines_in_a_jobs_log_are_never_judged() -> None:
    text = "fleetheal: refused: CUDA out of memory twice at step 7 (incident i-1)\nCUDA out of memory\n"
    assert list(judged_lines(text, lambda t: "CUDA" in t)) == ["CUDA out of memory"]
    assert list(judged_lines("step 1\nstep 2", lambda t: "CUDA" in t)) == []


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"NVRM: Xid \((?P<gpu>[0-9a-f:]+)\): (?P<xid>\d+)", ("NVRM: Xid (",)),
        (
            r"unspecified launch failure|cudaErrorLaunchFailure",
            ("unspecified launch failure", "cudaErrorLaunchFailure"),
        ),
        (r"(?:EXT4-fs|XFS) \(\S+\): shut", ("EXT4-fs (", "): shut")),  # the longest run of each alternative
        (r"nvme(?: nvme)?\d+: Abort status", (": Abort status",)),
        (r"[Ll]oss\b.{0,24}?\bnan\b", ()),  # a run of three: too short to pay
        (r"(?i:fatal error) on GPU", (" on GPU",)),  # case-insensitive text is not a literal
        (r"(?i)fatal error", ()),
        (r"abcd|x", ()),  # one alternative without a run: no anchors at all
    ],
)
def test_anchors_are_literals_every_match_holds(pattern: str, expected: tuple[str, ...]) -> None:
    import re

    from fleetheal.logparse import anchors

    assert anchors(re.compile(pattern)) == expected


@pytest.mark.parametrize(
    ("pattern", "pieces"),
    [
        (r"a|b(c|d)|[|]|\\|x", ["a", "b(c|d)", "[|]", "\\\\", "x"]),  # an escaped backslash, then a bar
        (r"[]|]|(?:x|y)z", ["[]|]", "(?:x|y)z"]),
        (r"[^]|]q|r", ["[^]|]q", "r"]),
    ],
)
def test_a_pattern_is_cut_at_its_top_level_bars_only(pattern: str, pieces: list[str]) -> None:
    from fleetheal.logparse import _split_top_level

    assert _split_top_level(pattern) == pieces
