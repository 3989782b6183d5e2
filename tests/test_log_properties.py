"""What a log pipeline does to a line must not change its verdict: the prefix it adds (syslog, ISO time,
/dev/kmsg, `dmesg -T`, journald, container runtimes, launchers), the whitespace it mangles, the tail it
cuts. Run over every line of the real corpus (tests/corpus/log-lines.yaml) and every example of the emitters'
message catalog (policies/message-catalog.yaml)."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetheal import logcatalog
from fleetheal.classify import gpu_id
from fleetheal.logparse import FaultEvent, LogParser
from tests.test_log_corpus import corpus

PARSER = LogParser()


def verdict(events: list[FaultEvent]) -> tuple[str, str, int | None, str | None]:
    """(fault id, class, xid, GPU in one spelling) of what the parser said; ("none", "none", ...) for nothing."""
    if not events:
        return ("none", "none", None, None)
    (e,) = events
    return (e.fault.id, e.fault.fault_class, e.xid, gpu_id(e.pci_bus_id))


#: What the pipelines in front of a log reader put before a line (one example each; the engine never
#: anchors to the line start, so any of them, stacked, must do).
PREFIXES = {
    "syslog": "Nov 29 18:00:00 gpu-node-17 kernel: ",
    "rsyslog ISO": "2026-11-29T18:00:00.123456+00:00 gpu-node-17 kernel: ",
    "kmsg": "4,1234,567890123,-;",
    "dmesg": "[123456.789012] ",
    "dmesg -T": "[Sun Nov 29 18:00:00 2026] ",
    "dmesg -x": "kern  :warn  : [123456.789012] ",
    "journalctl -o short-precise": "Nov 29 18:00:00.123456 gpu-node-17 kernel: ",
    "journalctl -o short-iso": "2026-11-29T18:00:00+0000 gpu-node-17 kernel: ",
    "CRI (containerd, CRI-O)": "2026-11-29T18:00:00.123456789Z stderr F ",
    "docker logs -t": "2026-11-29T18:00:00.123456789Z ",
    "kubectl logs --prefix": "[pod/train-0/trainer] ",
    "srun --label": "13: ",
    "torchrun": "[rank13]:",
    "Loki/promtail": 'level=error ts=2026-11-29T18:00:00Z msg="',
}


@functools.cache
def lines() -> list[str]:
    return [e["line"] for e in corpus()] + [f.example for e in logcatalog.load() for f in e.formats]


@pytest.mark.parametrize("pipeline", sorted(PREFIXES))
def test_a_prefix_does_not_change_the_verdict(pipeline: str) -> None:
    prefix = PREFIXES[pipeline]
    changed = [
        line for line in lines() if verdict(PARSER.parse_line(prefix + line)) != verdict(PARSER.parse_line(line))
    ]
    assert changed == [], f"{pipeline}: {len(changed)} line(s) read differently, first: {changed[:3]}"


def _mangle(line: str, rng: random.Random) -> str:
    """Every run of whitespace becomes another (spaces, tabs), and the line gains a ragged edge."""
    runs = [" ", "  ", "\t", " \t ", "   "]
    out = rng.choice(["", " ", "\t"]) + " ".join(line.split()).replace(" ", "\0")
    out = "".join(rng.choice(runs) if ch == "\0" else ch for ch in out)
    return out + rng.choice(["", " ", "\r", "\t", "  \r"])


@settings(max_examples=300, deadline=None)
@given(index=st.integers(min_value=0), seed=st.integers(min_value=0, max_value=2**32), stack=st.integers(0, 3))
def test_whitespace_and_stacked_prefixes_do_not_change_the_verdict(index: int, seed: int, stack: int) -> None:
    line = lines()[index % len(lines())]
    rng = random.Random(seed)
    prefix = "".join(rng.choice(list(PREFIXES.values())) for _ in range(stack))
    assert verdict(PARSER.parse_line(prefix + _mangle(line, rng))) == verdict(PARSER.parse_line(line)), line


@settings(max_examples=300, deadline=None)
@given(index=st.integers(min_value=0), words=st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_a_long_tail_cut_at_a_pipeline_limit_does_not_change_the_verdict(index: int, words: list[int]) -> None:
    """Drivers append register dumps; syslog and kmsg cut a record at about 1 KiB. What the rule needed
    comes first, so neither the tail nor the cut changes the verdict."""
    line = lines()[index % len(lines())]
    tail = "".join(f" 0x{w:08x}" for w in words)
    cut = (line + tail)[: max(1024, len(line))]
    assert verdict(PARSER.parse_line(cut)) == verdict(PARSER.parse_line(line)), line


def test_a_truncated_line_is_read_as_less_never_as_another_fault() -> None:
    """Cut anywhere, a line yields its own fault, nothing, `unknown`, the undecoded parent of a decoded
    Xid (xid-154 for xid-154-node-reboot), or, where the whole line drains or requeues, an observed fault of the
    same class (a filesystem cut before "Shutting down" is an observed storage error): never a different fault
    that acts, so a cut line never drives another action. (The location may grow coarser: an AER header cut
    before "received from" names the port that reported it.)"""
    wrong = []
    for line in lines():
        full_fault, full_class, full_xid, _ = verdict(PARSER.parse_line(line))
        for cut in range(len(line)):
            fault, cls, xid, _ = verdict(PARSER.parse_line(line[:cut]))
            if fault in ("none", "unknown") or (fault, xid) == (full_fault, full_xid):
                continue
            if full_fault not in ("none", "unknown") and cls == full_class and _less(fault, full_fault):
                continue
            if full_xid is None or (fault, xid) != (f"xid-{full_xid}", full_xid):
                wrong.append(f"{line[:cut]!r} -> {fault} (Xid {xid}), the whole line -> {full_fault}")
                break
    assert wrong == [], "\n".join(wrong[:10])


#: Kernel messages that print the command name of a user's process: any local user picks it (prctl
#: PR_SET_NAME, or the name of the binary), up to 15 characters (TASK_COMM_LEN - 1).
COMM_LINES = [
    "traps: {comm}[4242] general protection fault ip:7f00deadbeef sp:7ffc00000000 error:0 in libc.so.6[7f00+1c0000]",
    "{comm}[4242]: segfault at 0 ip 00007f00deadbeef sp 00007ffc00000000 error 4 in libc.so.6[7f00+1c0000]",
    "Out of memory: Killed process 4242 ({comm}) total-vm:1024kB, anon-rss:512kB, file-rss:0kB, shmem-rss:0kB",
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task={comm},pid=4242,uid=1000",
    'audit: type=1326 audit(1764410400.000:42): auid=1000 uid=1000 ses=1 pid=4242 comm="{comm}" exe="/tmp/x" sig=31',
    "INFO: task {comm}:4242 blocked for more than 120 seconds.",
]
#: The driver's own record names the process too; the name must not change the code it reports.
XID_WITH_COMM = "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name={comm}, Ch 00000010"
COMM_LEN = 15


def _less(fault: str, than: str) -> bool:
    """True when `fault` only observes while `than` drains, resets or requeues."""
    tx = PARSER.tx
    observes = tx.faults[fault].action == "OBSERVE"
    action = tx.actions[tx.faults[than].action]
    return observes and (action.destructive or action.requeues_job)


def _harmful(event: FaultEvent) -> bool:
    action = PARSER.tx.actions[event.fault.action]
    return action.destructive or action.requeues_job


def test_a_process_name_in_a_kernel_message_cannot_drain_a_node_or_requeue_a_job() -> None:
    """The attack: a local user names a process after the words of a fault ("NCCL timeout", "EDAC MC0: 1 UE",
    "* GSP Timeout *") and crashes it; the kernel prints the name. Every 15-character piece of every corpus
    line that the agent's kernel rules turn into a draining or requeuing fault, and the phrases themselves,
    as a process name in every such kernel message, must raise nothing harmful from the agent's rules, and an
    Xid record that names the process keeps its own code."""
    kernel = LogParser(log="kernel")
    pieces: set[str] = set()
    for line in lines():
        events = PARSER.parse_line(line)
        if events and _harmful(events[0]):
            text = " ".join(line.split())
            pieces.update(text[i : i + COMM_LEN] for i in range(max(1, len(text) - COMM_LEN + 1)))
    pieces |= {
        "NCCL timeout",
        "loss nan",
        "Link is Down",
        "EDAC MC0: 1 UE",
        "* GSP Timeout *",
        "XID 79 A",
        "GPU is lost",
    }
    harmful = []
    for comm in sorted(pieces):
        for template in COMM_LINES:
            line = template.format(comm=comm)
            got = [e for e in kernel.parse_line(line) if _harmful(e)]
            if got:
                harmful.append(f"{comm!r}: {line[:120]!r} -> {got[0].fault.id} (rule {got[0].rule})")
        if [(e.fault.id, e.xid) for e in kernel.parse_line(XID_WITH_COMM.format(comm=comm))] != [("xid-13", 13)]:
            harmful.append(f"{comm!r} changed the Xid 13 record that names it")
    assert harmful == [], f"{len(harmful)} process names raise a harmful fault:\n" + "\n".join(harmful[:15])


#: Kernel records that print text a local user chooses beyond a process name: the file name of a mapping
#: (NAME_MAX, 255 bytes; print_vma_addr, with the offset on newer kernels), a path's last four components, a
#: command line, an audit record's fields. `{name}` is the user's text.
USER_TEXT_LINES = [
    "python3[4242]: segfault at 0 ip 00007f206e40b000 sp 00007ffce1239c68 error 4 in {name}[0,7f206e40b000+1000]"
    " likely on CPU 1 (core 1, socket 0)",
    "python3[4242]: segfault at 0 ip 00007f00deadbeef sp 00007ffc00000000 error 4 in {name}[7f00+1c0000]",
    "traps: python3[4242] general protection fault ip:7f00deadbeef sp:7ffc00000000 error:0 in {name}[7f00+1c0000]",
    "python3[4242] trap invalid opcode ip:7f00deadbeef sp:7ffc00000000 error:0 in {name}[7f00+1c0000]",
    # The continued part as a record of its own (another CPU printed between the two parts).
    " in {name}[0,7f206e40b000+1000] likely on CPU 1 (core 1, socket 0)",
    " in {name}[7f00+1c0000]",
    "process '{name}' started with executable stack",
    "process 'a/b/c/{name}",  # cut before its closing words
    'ptrace attach of "{name}"[4242] was attempted by "{name}"[4243]',
    'audit: type=1400 audit(1764410400.000:42): apparmor="DENIED" operation="open" profile="snap" name="{name}"'
    ' pid=4242 comm="python3" requested_mask="r" denied_mask="r" fsuid=1000 ouid=1000',
]
NAME_MAX = 255


def test_a_file_name_path_or_command_line_in_a_kernel_record_cannot_drain_a_node_or_requeue_a_job() -> None:
    """The attack: a local user names a file after a whole fault record ("NVRM: Xid (PCI:0000:3b:00): 79, ...
    GPU has fallen off the bus") and crashes a process in it; the kernel prints the name (issue 46).
    Every corpus line that the agent's kernel rules turn into a draining or requeuing fault, as the user's text
    in every such record, must raise nothing harmful."""
    kernel = LogParser(log="kernel")
    names = set()
    for line in lines():
        events = kernel.parse_line(line)
        if events and _harmful(events[0]):
            names.add(" ".join(line.split())[:NAME_MAX])
    assert len(names) > 50  # the corpus holds many: the test is not vacuous
    harmful = []
    for name in sorted(names):
        for template in USER_TEXT_LINES:
            got = [e for e in kernel.parse_line(template.format(name=name)) if _harmful(e)]
            if got:
                harmful.append(f"{template[:40]!r} with {name[:80]!r} -> {got[0].fault.id} (rule {got[0].rule})")
    assert harmful == [], f"{len(harmful)} user texts raise a harmful fault:\n" + "\n".join(harmful[:15])


#: The parser with each rule's whole pattern, tried on every candidate line.
PLAIN = LogParser(PARSER.tx, tuple(dataclasses.replace(r, alternatives=(((), r.pattern),)) for r in PARSER.rules))


def test_the_alternatives_and_their_anchors_never_change_a_verdict() -> None:
    """A rule's pattern is searched alternative by alternative, each only on lines that hold one of its anchors
    (literals every match of it holds): the verdict of every real line, its GPU, process and detail included,
    are the ones the whole patterns give."""
    alternatives = [a for r in PARSER.rules for a in r.alternatives]
    assert sum(bool(anchors) for anchors, _ in alternatives) >= len(alternatives) * 9 // 10
    differ = [line for line in lines() if PARSER.parse_line(line) != PLAIN.parse_line(line)]
    assert differ == []


@settings(max_examples=300, deadline=None)
@given(index=st.integers(min_value=0), cut=st.integers(min_value=0), noise=st.text(max_size=40))
def test_the_alternatives_never_change_a_verdict_of_a_changed_line(index: int, cut: int, noise: str) -> None:
    line = lines()[index % len(lines())]
    changed = line[: cut % (len(line) + 1)] + noise + line[cut % (len(line) + 1) :]
    assert PARSER.parse_line(changed) == PLAIN.parse_line(changed)
