"""The taxonomy file: schema, unique ids, NVIDIA's whole catalog, the seeds, and the safe default."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from fleetheal import taxonomy
from fleetheal.taxonomy import Taxonomy, TaxonomyError


@pytest.fixture(scope="module")
def doc() -> dict:
    return taxonomy.raw()


@pytest.fixture(scope="module")
def tx() -> Taxonomy:
    return taxonomy.load()


def test_file_validates_against_its_schema(doc: dict) -> None:
    assert taxonomy.check_schema(doc) == []


def test_schema_rejects_a_bad_entry(doc: dict) -> None:
    bad = copy.deepcopy(doc)
    bad["faults"][0]["severity"] = "catastrophic"
    del bad["faults"][1]["source"]
    errors = taxonomy.check_schema(bad)
    assert any(e.startswith("faults/0/severity:") for e in errors)
    assert any(e.startswith("faults/1:") and "'source' is a required property" in e for e in errors)


def test_ids_are_unique(doc: dict) -> None:
    ids = [f["id"] for f in doc["faults"]]
    assert len(ids) == len(set(ids))


def test_duplicate_id_is_refused_with_its_name(doc: dict) -> None:
    bad = copy.deepcopy(doc)
    bad["faults"].append(dict(bad["faults"][0]))
    with pytest.raises(TaxonomyError, match=r"id 'xid-1'\): duplicate id"):
        Taxonomy(bad)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("class", "cosmic-ray", "class 'cosmic-ray' is not one of hardware, transient, user, unknown"),
        ("action", "REBOOT_THE_WORLD", "action 'REBOOT_THE_WORLD' is not one of ISOLATE_AND_RELOCATE"),
        ("explanation", " ", "'explanation' must be a non-empty string"),
    ],
)
def test_loader_names_the_bad_field(doc: dict, field: str, value: str, message: str) -> None:
    bad = copy.deepcopy(doc)
    bad["faults"][78][field] = value
    with pytest.raises(TaxonomyError, match=r"faults\[78\] \(id 'xid-79'\): " + message.replace("(", r"\(")):
        Taxonomy(bad)


def test_every_catalog_code_is_present(tx: Taxonomy, shared: Path) -> None:
    assert set(range(1, 173)) <= tx.known_xids()
    assert taxonomy.catalog_gaps(tx, str(shared / "reference" / "xid-catalog.csv")) == []


def test_catalog_gaps_reports_a_missing_code(doc: dict, shared: Path) -> None:
    smaller = copy.deepcopy(doc)
    smaller["faults"] = [f for f in smaller["faults"] if f["id"] != "xid-79"]
    gaps = taxonomy.catalog_gaps(Taxonomy(smaller), str(shared / "reference" / "xid-catalog.csv"))
    assert gaps == ["Xid 79 (ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS) is missing"]


@pytest.mark.parametrize(
    ("fault_id", "cls", "action"),
    [
        ("xid-48", "hardware", "ISOLATE_AND_RELOCATE"),
        ("xid-79", "hardware", "ISOLATE_AND_RELOCATE"),
        ("xid-94", "hardware", "ISOLATE_AND_RELOCATE"),
        ("xid-95", "hardware", "ISOLATE_AND_RELOCATE"),
        ("thermal-shutdown", "hardware", "ISOLATE_AND_RELOCATE"),
        ("power-brake", "hardware", "ISOLATE_AND_RELOCATE"),
        ("xid-31", "user", "REFUSE_AND_REPORT"),
        ("xid-13", "user", "REFUSE_AND_REPORT"),
        ("config-error", "user", "REFUSE_AND_REPORT"),
        ("cuda-oom-repeated", "user", "REFUSE_AND_REPORT"),
        ("nccl-timeout", "transient", "RESTART_IN_PLACE"),
        ("cuda-oom", "transient", "RESTART_IN_PLACE"),
    ],
)
def test_seeds_win(tx: Taxonomy, fault_id: str, cls: str, action: str) -> None:
    fault = tx.fault(fault_id)
    assert (fault.fault_class, fault.action) == (cls, action)


def test_unknown_codes_fall_to_observe(tx: Taxonomy) -> None:
    for fault in (tx.for_xid(999), tx.get("no-such-fault")):
        assert (fault.id, fault.fault_class, fault.action) == ("unknown", "unknown", "OBSERVE")


def test_nothing_unknown_or_user_is_destructive(tx: Taxonomy) -> None:
    for fault in tx:
        if fault.fault_class in ("unknown", "user"):
            assert not tx.actions[fault.action].destructive, fault.id


def test_issue_fault_families_exist(tx: Taxonomy) -> None:
    wanted = {
        "ecc-dbe-volatile",
        "ecc-dbe-aggregate",
        "ecc-sbe-storm",
        "row-remap-failure",
        "row-remap-pending",
        "retired-pages-pending",
        "gpu-count-low",
        "gpu-lost",
        "thermal-slowdown",
        "thermal-shutdown",
        "power-brake",
        "power-cap-violation",
        "nvlink-crc-errors",
        "nvlink-replay-errors",
        "nvlink-recovery-errors",
        "pcie-replay-growth",
        "pcie-aer-fatal",
        "nvswitch-sxid-fatal",
        "nccl-timeout",
        "cuda-oom",
        "cuda-oom-repeated",
        "cuda-illegal-address",
        "nan-loss",
        "loss-spike",
        "straggler",
        "job-hang",
        "host-memory-ue",
        "disk-full",
        "nic-down",
    }
    assert wanted <= set(tx.faults)


def test_every_nvlink5_decode_row_decodes_to_its_action(tx: Taxonomy) -> None:
    for rule in tx.decode_rules:
        for pattern in (rule.intrinfo_v1, rule.intrinfo_v2):
            intrinfo = int(pattern.replace("-", "0"), 2)
            fault = tx.decode_nvlink5(rule.xid, intrinfo, rule.error_status)
            assert fault is not None, rule
            assert fault.action == tx.faults[rule.fault].action, (rule, fault.id)


def test_nvlink5_decode_misses_return_none(tx: Taxonomy) -> None:
    assert tx.decode_nvlink5(149, 0xFFFFFFFF, 0x7777) is None
