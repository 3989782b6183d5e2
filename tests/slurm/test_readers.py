"""fleetheal.slurm.nodes, the one node reader: `sinfo` text and the JSON shapes of each Slurm version,
and the drained / responding / owned-reason rules. The text is what Slurm 22.05 printed in the lab
(tests/ansible/test_steps.py checks text and JSON against a real slurmctld)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fleetheal.slurm import jobs
from fleetheal.slurm.fields import number
from fleetheal.slurm.jobs import job_nodes, job_state
from fleetheal.slurm.nodes import (
    NODES_ARGS,
    Node,
    parse_json,
    parse_text,
    read,
    sinfo_argv,
    slurm_node,
)

S = "\x1f"
#: `sinfo NODES_ARGS` of Slurm 22.05.8: n1 drained with an owned reason holding `key=value` words and
#: separators `scontrol -o` would split on, n2 a promoted standby (Extra, no reason; Slinky's operator's
#: pod identity in its comment), n3 down and not responding with a foreign reason, n1 again (a second partition).
POD = '{"namespace":"slurm","podName":"lab-h100-x","node":"n2"}'
TEXT = (
    f"n1{S}idle+drain{S}2026-12-05T00:12:56{S}fleetheal:xid-79 incident=inc-7 a|b,c  d=e{S}(null){S}(null){S}\n"
    f"n2{S}mixed{S}Unknown{S}none{S}{POD}{S}fleetheal: promoted for n9 incident=inc-7{S}\n"
    f"n3{S}down*{S}2026-12-05T00:12:57{S}none of ours{S}(null){S}(null){S}\n"
    f"n1{S}idle{S}Unknown{S}none{S}(null){S}(null){S}\n"
)


def test_argv_reads_every_node_or_one():
    assert sinfo_argv() == ["sinfo", *NODES_ARGS]
    assert sinfo_argv("/opt/slurm/bin/sinfo", "n2") == ["/opt/slurm/bin/sinfo", *NODES_ARGS, "-n", "n2"]
    assert NODES_ARGS == (
        "-N",
        "-h",
        "-O",
        f"NodeList:{S},StateComplete:{S},Timestamp:{S},Reason:{S},Comment:{S},Extra:{S}",
    )


def test_text_keeps_an_owned_reason_whole_and_the_first_line_of_a_node():
    nodes = parse_text(TEXT)
    assert list(nodes) == ["n1", "n2", "n3"]
    n1 = nodes["n1"]
    assert n1 == Node(
        "n1", "IDLE", frozenset({"DRAIN"}), "fleetheal:xid-79 incident=inc-7 a|b,c  d=e", "", "2026-12-05T00:12:56"
    )
    assert n1.drained and n1.responding and n1.reason_owned()
    assert not n1.reason_owned("fleetheal:standby")


def test_text_comment_missing_reason_and_not_responding():
    nodes = parse_text(TEXT)
    assert nodes["n2"] == Node("n2", "MIXED", frozenset(), "", POD, "", "fleetheal: promoted for n9 incident=inc-7")
    assert not nodes["n2"].drained and not nodes["n2"].reason_owned()
    n3 = nodes["n3"]
    assert (n3.state, n3.flags, n3.reason) == ("DOWN", frozenset({"NOT_RESPONDING"}), "none of ours")
    assert not n3.responding and not n3.drained and not n3.reason_owned()
    assert not Node("n4", "DOWN", frozenset()).responding  # DOWN alone is not responding either
    assert parse_text("") == {}


def test_slurm_node_is_the_dict_the_playbooks_see():
    assert slurm_node(TEXT, "n1") == {
        "found": True,
        "name": "n1",
        "state": "IDLE",
        "flags": ["DRAIN"],
        "drained": True,
        "responding": True,
        "reason": "fleetheal:xid-79 incident=inc-7 a|b,c  d=e",
        "reason_owned": True,
        "comment": "",
        "extra": "",
    }
    assert slurm_node(TEXT, "n1", "fleetheal:standby")["reason_owned"] is False
    missing = slurm_node(TEXT, "n9")
    assert missing["found"] is False and missing["name"] == "n9" and missing["drained"] is False


def test_pool_scans():
    nodes = read(TEXT + f"n5{S}idle+drain{S}2026-12-05T00:12:58{S}fleetheal:standby{S}(null){S}(null){S}\n")
    assert nodes.with_reason("fleetheal:") == ["n1", "n5"]
    assert nodes.with_reason("fleetheal:standby") == ["n5"]
    assert nodes.with_extra("incident=inc-7") == ["n2"]
    assert nodes.with_extra("inc-7") == []  # a whole word only
    assert read(nodes) is nodes


def _epoch(iso: str) -> int:
    return int(time.mktime(time.strptime(iso, "%Y-%m-%dT%H:%M:%S")))


def test_json_of_slurm_22_05_sinfo():
    """openapi v0.0.38: `state` a lower-case word, flags apart, `reason_changed_at` an integer."""
    doc = {
        "meta": {"plugin": {"type": "openapi/v0.0.38"}},
        "nodes": [
            {
                "name": "n1",
                "state": "idle",
                "state_flags": ["DRAIN"],
                "reason": "fleetheal:xid-79 incident=inc-7 a|b,c  d=e",
                "reason_changed_at": _epoch("2026-12-05T00:12:56"),
                "comment": "",
            },
            {
                "name": "n2",
                "state": "mixed",
                "state_flags": [],
                "reason": "",
                "reason_changed_at": 0,
                "comment": POD,
                "extra": "fleetheal: promoted for n9 incident=inc-7",
            },
            {
                "name": "n3",
                "state": "down",
                "state_flags": ["NOT_RESPONDING"],
                "reason": "none of ours",
                "reason_changed_at": _epoch("2026-12-05T00:12:57"),
                "comment": "",
            },
        ],
    }
    assert parse_json(doc) == parse_text(TEXT)


def test_json_of_scontrol_since_23_02():
    """data parser v0.0.39+: base state and flags in one upper-case list; from v0.0.40 times are objects."""
    doc = {
        "nodes": [
            {
                "name": "n1",
                "state": ["IDLE", "DRAIN"],
                "reason": "fleetheal:xid-79 incident=inc-7 a|b,c  d=e",
                "reason_changed_at": {"set": True, "infinite": False, "number": _epoch("2026-12-05T00:12:56")},
                "comment": "",
            },
            {
                "name": "n2",
                "state": ["MIXED"],
                "reason": "",
                "reason_changed_at": {"set": False, "infinite": False, "number": 0},
                "comment": POD,
                "extra": "fleetheal: promoted for n9 incident=inc-7",
            },
            {
                "name": "n3",
                "state": ["DOWN", "NOT_RESPONDING"],
                "reason": "none of ours",
                "reason_changed_at": _epoch("2026-12-05T00:12:57"),
                "comment": "",
            },
        ]
    }
    assert parse_json(doc) == parse_text(TEXT)
    assert read('{"nodes": [{"name": "n1", "state": ["DRAIN", "IDLE"]}]}')["n1"].state == "IDLE"


def test_refuses_what_is_no_node_read():
    for value in (None, 42, ["n1"]):
        with pytest.raises(ValueError, match="NODES_ARGS"):
            read(value)
    with pytest.raises(ValueError, match="`nodes` list"):
        read({"sinfo": [{"nodes": {"nodes": ["n1"]}, "node": {"state": ["IDLE"]}}]})  # sinfo --json of 24.11


# --- jobs of `squeue --json`, read by fleetheal.slurm.jobs ---------------------------------------------------
#: `squeue --json` of the same three jobs on 22.05.8 (openapi v0.0.38) and 26.05.5 (data_parser v0.0.45),
#: trimmed to the fields fleetheal reads: job 1 on n1 with a comment and an output pattern, array tasks 2_1
#: (job 3) and 2_2 (job 2) on n2 with Slurm's default output.
SQUEUE = Path(__file__).parent / "data" / "slurm"


@pytest.mark.parametrize("release", ["22.05", "26.05"])
def test_each_data_parser_reads_to_the_same_jobs(release: str) -> None:
    doc = json.loads((SQUEUE / f"squeue-{release}.json").read_text())
    cap = f"/tmp/cap{release[:2]}"  # where the capture ran
    first, task2, task1 = (jobs.slurm_job(doc, j) for j in ("1", "2", "3"))
    assert (first["state"], first["nodes"], first["comment"], first["restart_cnt"], first["uid"]) == (
        "RUNNING", ["n1"], "hello", 0, 0,
    )  # fmt: skip
    assert first["stdout"] == f"{cap}/out-1-{first['name']}.txt"
    assert (task1["stdout"], task2["stdout"]) == (f"{cap}/jobs/slurm-2_1.out", f"{cap}/jobs/slurm-2_2.out")
    assert [j["job_id"] for j in jobs.slurm_jobs_on_node(doc, "n2")] == ["2", "3"]
    assert first["priority"] > 0 and jobs.slurm_max_priority(doc) == max(j["priority"] for j in (first, task1, task2))


def test_field_shapes_of_every_data_parser() -> None:
    assert [number(v) for v in (7, "7", None, {"set": True, "infinite": False, "number": 7})] == [7, 7, 0, 7]
    assert number({"set": False, "infinite": False, "number": 0}, -1) == -1
    assert number({"set": True, "infinite": True, "number": 0}, -1) == -1
    # v0.0.38 prints one word; v0.0.39+ a list, where a flag Slurm's text shows wins over the base state.
    assert job_state("RUNNING") == "RUNNING" and job_state("completing") == "COMPLETING"
    assert job_state(["PENDING", "REQUEUED"]) == "REQUEUED" and job_state(["RUNNING", "COMPLETING"]) == "COMPLETING"
    assert job_state(["RUNNING"]) == "RUNNING" and job_state([]) == "" and job_state(None) == ""
    old = {"job_resources": {"allocated_nodes": [{"nodename": "a1"}, {"nodename": "a2"}]}}
    new = {"job_resources": {"nodes": {"allocation": [{"index": 0, "name": "a1"}, {"index": 1, "name": "a2"}]}}}
    assert job_nodes(old) == job_nodes(new) == ["a1", "a2"] and job_nodes({}) == []


def test_a_clusters_jobs_with_nodes_and_a_free_text_comment() -> None:
    """Cross-cluster failover's read: `squeue -M CLUSTER -o %i|%T|%N|%k`, the comment last and kept whole."""
    assert jobs.cluster_jobs_args("a", ("PENDING", "RUNNING")) == [
        "-M", "a", "-h", "-t", "PENDING,RUNNING", "-o", "%i|%T|%N|%k",
    ]  # fmt: skip
    assert jobs.cluster_jobs_args("a", ("RUNNING",), "a1")[-2:] == ["-w", "a1"]
    text = "11|PENDING||fleetheal-checkpoint=shared \n 12 |RUNNING|a[1-2]|a|b\n\nCLUSTER: a\n"
    assert jobs.parse_cluster_jobs(text) == [
        jobs.ClusterJob("11", "PENDING", "", "fleetheal-checkpoint=shared"),
        jobs.ClusterJob("12", "RUNNING", "a[1-2]", "a|b"),
    ]
