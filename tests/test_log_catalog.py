"""The rules against the emitters' own message catalogs (policies/message-catalog.yaml): every format the
kernel, the network drivers, NVIDIA's driver, NVML, DCGM, NCCL, PyTorch, the CUDA runtime, libfabric, the BMC
and Slurm can print gets the verdict its family was given, from the rules of the log it is written to; what
the job's own configuration can cause never moves a node; a destructive rule names its evidence."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

from fleetheal import logcatalog, taxonomy
from fleetheal.logparse import LogParser, LogRulesError, compile_rules, raw_rules

#: The emitters issue 45 names, by catalog id.
EMITTERS = {
    "linux",  # mm/oom, hung task, lockups, RCU, block, NVMe, ext4/xfs, NFS client, AER, MCE/EDAC, netdev watchdog
    "mlx5",
    "efa",
    "ena",
    "ib-core",
    "nvrm",  # NVRM, GSP, FSP, RM init, NVSwitch
    "nccl",
    "pytorch",
    "cuda-runtime",
    "libfabric",
    "aws-ofi-nccl",
    "dcgm",
    "nvml",
    "ipmi-sel",
}


@pytest.fixture(scope="module")
def tx() -> taxonomy.Taxonomy:
    return taxonomy.load()


@pytest.fixture(scope="module")
def rows(tx: taxonomy.Taxonomy) -> list[logcatalog.Row]:
    return logcatalog.check(logcatalog.load(), tx)


def test_the_catalog_covers_every_emitter_with_its_source_version() -> None:
    emitters = logcatalog.load()
    assert EMITTERS <= {e.id for e in emitters}
    for e in emitters:
        assert e.version.strip() and e.repo.strip(), e.id


def test_every_format_gets_its_verdict_from_the_rules(rows: list[logcatalog.Row]) -> None:
    """A mapped format whose own example no longer gets its fault (a rule edited, an emitter's new wording
    copied in) fails here, with the example and what the rules said."""
    bad = [f"{r.format.emitter}/{r.format.family}: {r.problem}: {r.format.example[:120]}" for r in rows if not r.ok]
    assert bad == [], "\n".join(bad)
    assert len(rows) >= 250


def test_a_rule_taken_away_is_caught_by_the_formats_it_covered(tx: taxonomy.Taxonomy) -> None:
    doc = raw_rules()
    rules = tuple(r for r in compile_rules(doc, tx) if r.id != "nvme-failed")
    broken = [r for r in logcatalog.check(logcatalog.load(), tx, rules) if not r.ok]
    assert broken and {r.format.family for r in broken} == {"nvme"}
    assert all(r.format.verdict == "storage-failed" for r in broken)


def test_kernel_formats_are_read_with_the_agents_kernel_rules_only(tx: taxonomy.Taxonomy) -> None:
    """An application rule never decides a kernel emitter's format: the agent would not apply it."""
    kernel_rules = {r.id for r in LogParser(tx, log="kernel").rules}
    for row in logcatalog.check(logcatalog.load(), tx):
        if row.rule is not None and row.format.emitter in {e.id for e in logcatalog.load() if e.log == "kernel"}:
            assert row.rule in kernel_rules, (row.format.emitter, row.format.family, row.rule)


def test_what_the_jobs_own_configuration_can_cause_never_moves_the_node(
    rows: list[logcatalog.Row], tx: taxonomy.Taxonomy
) -> None:
    job = [r for r in rows if r.format.job_can_cause]
    assert len(job) >= 10
    for r in job:
        assert r.got == "none" or not tx.moves_node(r.got), (r.format.family, r.got)


@pytest.mark.parametrize(
    "line",
    [
        # NVIDIA/nccl#290: a container's 64 MiB /dev/shm, not the node's disk.
        "gpu2-ru7:2143:2561 [1] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device",
        "node1:15016:15201 [1] misc/shmutils.cc:87 NCCL WARN Error: failed to extend /dev/shm/nccl-YrFC5V to 33030148 "
        "bytes, error: No space left on device (28)",
        "node1:202016:202235 [0] misc/shmutils.cc:132 NCCL WARN Error while creating shared memory segment "
        "/dev/shm/nccl-WU88OE (size 9637888), error: No space left on device (28)",
    ],
)
def test_nccls_shared_memory_out_of_space_is_the_jobs_configuration_not_a_full_disk(line: str) -> None:
    """The wrong isolation of issue 45: NCCL's /dev/shm running out matched the disk-full rule and drained the
    node. It is the job's container's shared-memory size: refused and reported, the node stays."""
    (event,) = LogParser().parse_line(line)
    assert (event.fault.id, event.rule) == ("config-error", "nccl-shm-size")
    assert not LogParser().tx.actions[event.fault.action].destructive


def test_a_full_scratch_directory_never_isolates_the_node(tx: taxonomy.Taxonomy) -> None:
    """ENOSPC names no device: the job's scratch, quota or /dev/shm fill as easily as the node's disk."""
    for line in (
        "OSError: [Errno 28] No space left on device: '/scratch/ckpt/step_1000.pt'",
        "safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
        'message: "No space left on device" })',
    ):
        (event,) = LogParser(tx).parse_line(line)
        assert event.fault.id == "write-no-space"
        assert not tx.actions[event.fault.action].destructive


@pytest.mark.parametrize(
    ("line", "fault"),
    [
        ("EXT4-fs (nvme0n1p1): Remounting filesystem read-only", "storage-failed"),
        # An Apptainer overlay or a container image on a loop device is the job's, a network block device the
        # storage's: observed, the node stays.
        ("EXT4-fs (loop3): Remounting filesystem read-only", "storage-error"),
        ("Aborting journal on device loop7-8.", "storage-error"),
        ("XFS (nbd0): Log I/O Error Detected. Shutting down filesystem", "storage-error"),
        ("Aborting journal on device nvme1n1-8.", "storage-failed"),
    ],
)
def test_a_filesystem_that_stops_on_an_image_or_a_network_device_does_not_isolate(
    line: str, fault: str, tx: taxonomy.Taxonomy
) -> None:
    (event,) = LogParser(tx, log="kernel").parse_line(line)
    assert event.fault.id == fault


def test_every_destructive_rule_names_its_evidence(tx: taxonomy.Taxonomy) -> None:
    """The loader refuses a rule that can drain, reset or replace a node without `evidence`; the shipped ones
    all have it."""
    doc = raw_rules()
    rules = compile_rules(doc, tx)
    destructive = {
        r.id
        for r in rules
        if any(
            tx.actions[tx.faults[f].action].destructive
            for f in ((c[1] for c in r.fault[1]) if isinstance(r.fault, tuple) else [r.fault])
            if f in tx.faults
        )
    }
    assert destructive and all(r.evidence for r in rules if r.id in destructive)
    broken = copy.deepcopy(doc)
    entry = next(e for e in broken["rules"] if e["id"] == "nvme-failed")
    del entry["evidence"]
    with pytest.raises(LogRulesError, match=r"id 'nvme-failed'.*'evidence' must say why"):
        compile_rules(broken, tx)


BAD_FORMAT: dict[str, Any] = {
    "family": "f",
    "format": "x %d",
    "at": "a.c",
    "example": "x 1",
    "example_source": "https://example.org",
    "verdict": "host-oom",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"verdict": "no-such-fault"}, "verdict 'no-such-fault' is not a taxonomy fault id"),
        ({"verdict": "none"}, "a format left 'none' on purpose must say 'why'"),
        ({"verdict": "unknown", "why": " "}, "a format left 'unknown' on purpose must say 'why'"),
        ({"example": "two\nlines"}, "'example' must be one line"),
        ({"example_source": ""}, "'example_source' must be a non-empty string"),
        ({"color": "red"}, "unknown field"),
        ({"job_can_cause": "yes"}, "'job_can_cause' must be true or false"),
    ],
)
def test_a_bad_catalog_entry_is_refused_with_its_emitter_and_field(
    change: dict[str, Any], message: str, tx: taxonomy.Taxonomy
) -> None:
    emitter = {"id": "e", "name": "E", "log": "kernel", "source": {"repo": "r", "version": "1"}}
    doc = {"emitters": [{**emitter, "formats": [{**BAD_FORMAT, **change}]}]}
    with pytest.raises(logcatalog.CatalogError, match=r"emitters\[0\] \(id 'e'\): formats\[0\]: " + message):
        logcatalog.parse(doc, tx)


def test_the_report_counts_real_and_constructed_examples(rows: list[logcatalog.Row]) -> None:
    text = logcatalog.report(logcatalog.load(), rows)
    real = sum(r.format.real for r in rows)
    assert f"{len(rows)} formats of {len(logcatalog.load())} emitters; {real} examples copied" in text
    assert real / len(rows) >= 0.6
    counts = Counter(r.format.verdict for r in rows)
    assert counts["none"] and counts["unknown"]
