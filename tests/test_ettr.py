"""fleetheal.ettr: the ETTR simulator against the Young/Daly closed form and Llama 3's published figure,
monotonicity in standby and recovery speed, fleetheal's profile from the benchmark results, the CLI's errors
and outputs; and ETTR measured on a lab run (fleetheal.lab.measure, `fleetheal ettr measure`)."""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetheal.agent.training import MonitorConfig
from fleetheal.cli import main
from fleetheal.ettr import model, profile, rates
from fleetheal.lab import measure
from fleetheal.lab.train import ettr as lab_ettr

REPO = Path(__file__).resolve().parents[1]

M = 10 * 3600.0  # MTBF of the simple case: 10 h
GPUS = 8


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleetheal ettr simulate` run where `make bench` runs: its default --results is relative."""
    monkeypatch.chdir(REPO)


@functools.cache
def fleetheal() -> model.Profile:
    """fleetheal's profile as `fleetheal ettr simulate` builds it from the repository's benchmark results."""
    return profile.profile_from_bench(REPO / profile.DEFAULT_RESULTS).profile


def one_component(mtbf: float = M) -> tuple[rates.Component, ...]:
    """One transient failure mode whose rate gives a job on GPUS GPUs the given MTBF."""
    return (rates.Component("x", "x", "transient", "crash", 86_400.0 / mtbf / GPUS),)


def fixed_downtime(r: float) -> model.Profile:
    return model.Profile("fixed", 0.0, 0.0, 0.0, 0.0, r, 0.0, 0.0, 0.0, 0.0)


def test_rates_are_llama3_table5() -> None:
    assert sum(count for _, _, count, _, _ in rates.LLAMA3_TABLE5) == 419
    assert model.total_rate(rates.FAILURE_RATES) == pytest.approx(4.74e-4, rel=0.01)  # failure-stats.md
    # 54 days x 24 h / 419 interruptions = 3.09 h between interruptions at 16,384 GPUs
    assert model.mtbf_s(16_384) / 3600 == pytest.approx(54 * 24 / 419, rel=1e-9)
    hw = sum(c.per_gpu_day for c in rates.FAILURE_RATES if c.kind == "hardware")
    assert hw * rates.LLAMA3_GPU_DAYS == pytest.approx(324 + 32)  # hardware rows + host maintenance


@pytest.mark.parametrize(("c", "r"), [(60.0, 300.0), (10.0, 60.0)])
def test_young_daly_closed_form(c: float, r: float) -> None:
    comps = one_component()
    t_opt = model.young_daly_interval(c, M)
    assert t_opt == pytest.approx(math.sqrt(2 * c * M))
    sim = model.simulate(GPUS, fixed_downtime(r), interval_s=t_opt, checkpoint_s=c, events=20_000, components=comps)
    expected = model.young_daly_ettr(c, M, r)
    assert sim.mtbf_s == pytest.approx(M)
    assert abs(sim.ettr - expected) < 0.005, (sim.ettr, expected)
    assert sum(sim.seconds.values()) == pytest.approx(sim.horizon_s)
    # the breakdown is what the closed form says it is: lost work ~ T/2 per failure, checkpoint ~ C/T
    bd = sim.breakdown()
    assert bd["checkpoint"] == pytest.approx(c / (t_opt + c), rel=0.05)
    assert bd["recovery"] == pytest.approx(r / (M + r), rel=0.05)
    # the searched optimum is no better than Young's interval by more than noise, and lies near it
    best, runs = model.best_interval(GPUS, fixed_downtime(r), checkpoint_s=c, events=20_000, components=comps)
    at_young = next(x for x in runs if x.interval_s == pytest.approx(t_opt))
    assert best.ettr - at_young.ettr < 0.002
    assert 0.5 * t_opt <= best.interval_s <= 2.0 * t_opt


def test_llama3_over_90_percent_at_16k() -> None:
    """Llama 3: > 90% effective training time on 16,384 GPUs, mostly automated but slow recovery."""
    best, _ = model.best_interval(16_384, profile.LLAMA3, events=3_000)
    assert 0.90 < best.ettr < 0.97, best.ettr
    assert best.interruptions == pytest.approx(3_000, rel=0.1)
    fast, _ = model.best_interval(16_384, fleetheal(), events=3_000)
    manual, _ = model.best_interval(16_384, profile.MANUAL, events=3_000)
    assert manual.ettr < best.ettr < fast.ettr


def test_more_standby_never_lowers_ettr() -> None:
    p = replace(fleetheal(), replace_s=6 * 3600.0)
    values = []
    for share in (0.0, 0.001, 0.003, 0.01, 0.05):
        r = model.simulate(16_384, replace(p, standby_fraction=share), interval_s=200, events=1_500, seed=3)
        values.append((r.ettr, r.seconds["waiting"]))
    for (a, wa), (b, wb) in itertools.pairwise(values):
        assert b >= a - 1e-9 and wb <= wa + 1e-9, values
    assert values[0][1] > 0 and values[-1][1] == 0  # no standby: the job waits for nodes; enough: never


@pytest.mark.parametrize("field", ["detect_hw_s", "isolate_s", "requeue_s", "promote_s", "restart_s", "replace_s"])
def test_faster_recovery_never_lowers_ettr(field: str) -> None:
    p = replace(fleetheal(), standby_fraction=0.002)
    base = getattr(p, field)
    prev = None
    for factor in (8.0, 4.0, 1.0, 0.25, 0.0):
        r = model.simulate(16_384, replace(p, **{field: max(base, 30.0) * factor}), interval_s=200, events=800, seed=1)
        if prev is not None:
            assert r.ettr >= prev - 1e-9, (field, factor, r.ettr, prev)
        prev = r.ettr


def test_scale_lowers_ettr_and_interval() -> None:
    rows = model.sweep([1_024, 16_384, 131_072], [fleetheal()], events=600)
    assert rows[0].ettr > rows[1].ettr > rows[2].ettr
    assert rows[0].interval_s > rows[1].interval_s > rows[2].interval_s


def test_bad_model_arguments() -> None:
    with pytest.raises(model.SimulationError, match="multiple of 8"):
        model.simulate(12, profile.MANUAL, interval_s=100)
    with pytest.raises(model.SimulationError, match="interval"):
        model.simulate(64, profile.MANUAL, interval_s=0)
    with pytest.raises(model.SimulationError, match="checkpoint cost"):
        model.simulate(64, profile.MANUAL, interval_s=10, checkpoint_s=-1)
    with pytest.raises(model.SimulationError, match="restart_s"):
        model.simulate(64, replace(fleetheal(), restart_s=-5), interval_s=10)
    with pytest.raises(model.SimulationError, match="zero"):
        model.mtbf_s(64, ())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scales", "abc"], "GPU counts"),
        (["--scales", "1001"], "multiple of 8"),
        (["--checkpoint-cost", "-1"], ">= 0"),
        (["--interval", "0"], "--interval must be > 0"),
        (["--standby", "2"], "between 0 and 1"),
        (["--events", "0"], ">= 1"),
        (["--profile", "nope"], "invalid choice"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ettr", "simulate", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ettr", "simulate", "--scales", "1024,16384", "--events", "300", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["gpus"] for r in doc["rows"]] == [1024, 16384]
    for row in doc["rows"]:
        assert sum(row["result"]["breakdown"].values()) == pytest.approx(1.0)
        assert row["ettr"] == pytest.approx(row["result"]["breakdown"]["productive"])
        assert row["baseline_ettr"] < row["ettr"]
    assert doc["rates_per_gpu_day"]["Faulty GPU"] == pytest.approx(148 / (16_384 * 54))
    assert main(["ettr", "simulate", "--scales", "2048", "--events", "200", "--standby", "0"]) == 0
    out = capsys.readouterr().out
    assert "2,048" in out and "ETTR" in out


def test_cli_plot(tmp_path: Path) -> None:
    png = tmp_path / "ettr.png"
    assert main(["ettr", "simulate", "--scales", "1024,8192", "--events", "200", "--plot", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the fleetheal profile from benchmark results (`--results`) -------------------------------------------


def _bench_results(tmp_path: Path, *, keys: bool = True, nccl: bool = True) -> Path:
    """A benchmarks/run.py results file with bench_lab's figures (as run.py writes it)."""

    def fig(name: str, key: str, median: float, n: int = 20, **extra: object) -> dict[str, object]:
        doc: dict[str, object] = {"module": "lab", "name": name, "unit": "s", "median": median, "p99": median * 2,
                                  "n": n, "goal": "-", "peer": None, "ratio_to_peer": None, "notes": ""}  # fmt: skip
        if keys:
            doc.update(key=key, **extra)
        return doc

    results: list[dict[str, object]] = [
        {
            "module": "agent",
            "name": "Xid 79 -> Slurm node drained (agent fast path)",
            "unit": "s",
            "median": 9.0,
            "p99": 9.0,
            "n": 3,
        },  # another module's figure with a similar name is not taken
        fig("Xid 79 -> Slurm node drained (agent fast path)", "xid79_drained", 0.08),
        fig("Xid 79 -> alert at the remediator", "xid79_alert", 1.2),
        fig(
            "Xid 79 -> job RUNNING again on a spare node",
            "xid79_running_again",
            9.5,
            phases={"drain": 0.1, "requeue": 5.0, "running": 9.5},
        ),
    ]
    if nccl:
        results.append(fig("NCCL timeout -> training running again in place", "nccl_running_again", 4.2, n=21))
    path = tmp_path / "latest.json"
    path.write_text(json.dumps({"meta": {"when": "2026-12-02T10:00:00Z"}, "results": results}))
    return path


def test_profile_from_bench_takes_the_lab_figures(tmp_path: Path) -> None:
    bench = profile.profile_from_bench(_bench_results(tmp_path))
    p = bench.profile
    assert p.detect_hw_s == pytest.approx(0.08)  # the drained figure's median, not the phase's 0.1
    assert p.isolate_s == 0.0
    assert p.requeue_s == pytest.approx(5.0 - 0.08)
    assert p.promote_s == pytest.approx(9.5 - 5.0)
    assert p.in_place_s == pytest.approx(4.2)
    assert p.transient_s() == pytest.approx(4.2)
    # not measured by the lab: fleetheal's assumptions
    assert p.name == "fleetheal"
    for field in ("restart_s", "detect_crash_s", "detect_symptom_s", "replace_s", "standby_fraction"):
        assert getattr(p, field) == getattr(fleetheal(), field) == profile.FLEETHEAL_ASSUMED[field]
    assert p.detect_symptom_s == MonitorConfig().hang_timeout_s  # the agent's default, not a copy
    assert set(bench.used) == {"detect_hw_s", "isolate_s", "requeue_s", "promote_s", "in_place_s"}
    assert bench.used["in_place_s"]["n"] == 21
    assert bench.when == "2026-12-02T10:00:00Z"
    assert "restart_s 60" in bench.describe() and "in_place_s 4.20" in bench.describe()


def test_repository_results_give_the_profile() -> None:
    """The profile `fleetheal ettr simulate` uses is the checked-in results' lab figures, not a copy of them."""
    doc = json.loads((REPO / profile.DEFAULT_RESULTS).read_text())
    figures = {r.get("key"): r for r in doc["results"] if r.get("module") == "lab"}
    drained, again = figures["xid79_drained"]["median"], figures["xid79_running_again"]
    p = fleetheal()
    assert p.detect_hw_s == drained
    assert p.detect_hw_s + p.isolate_s + p.requeue_s + p.promote_s == pytest.approx(again["median"])
    assert p.in_place_s == figures["nccl_running_again"]["median"]


def test_profile_from_results_written_before_figure_keys(tmp_path: Path) -> None:
    """Older results have no keys and no phases: the figures are found by name, the requeue is not split."""
    p = profile.profile_from_bench(_bench_results(tmp_path, keys=False, nccl=False)).profile
    assert p.detect_hw_s == pytest.approx(0.08)
    assert p.requeue_s == pytest.approx(9.5 - 0.08)
    assert p.promote_s == 0.0
    assert p.in_place_s is None
    assert p.transient_s() == p.requeue_s


def test_profile_from_bench_errors(tmp_path: Path) -> None:
    with pytest.raises(profile.BenchResultsError, match="no benchmark results"):
        profile.profile_from_bench(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(profile.BenchResultsError, match="not readable"):
        profile.profile_from_bench(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": {}, "results": [{"module": "lab", "error": "RuntimeError: boom"}]}))
    with pytest.raises(profile.BenchResultsError, match="no lab figure"):
        profile.profile_from_bench(other)


def test_in_place_time_is_the_transient_recovery() -> None:
    comps = one_component()
    t = model.young_daly_interval(10.0, M)
    slow = model.simulate(GPUS, fixed_downtime(600.0), interval_s=t, checkpoint_s=10.0, events=5_000,
                         components=comps)  # fmt: skip
    fast = model.simulate(GPUS, replace(fixed_downtime(600.0), in_place_s=6.0), interval_s=t, checkpoint_s=10.0,
                         events=5_000, components=comps)  # fmt: skip
    assert slow.breakdown()["recovery"] == pytest.approx(600.0 / (M + 600.0), rel=0.05)
    assert fast.breakdown()["recovery"] == pytest.approx(6.0 / (M + 6.0), rel=0.05)
    assert fast.ettr > slow.ettr
    with pytest.raises(model.SimulationError, match="in_place_s"):
        model.simulate(GPUS, replace(fleetheal(), in_place_s=-1.0), interval_s=10)


def test_cli_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _bench_results(tmp_path)
    argv = ["ettr", "simulate", "--scales", "1024", "--events", "200", "--results", str(path)]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["requeue_s"] == pytest.approx(5.0 - 0.08)
    assert doc["profile"]["in_place_s"] == pytest.approx(4.2)
    assert doc["profile_source"]["origin"] == str(path)
    assert doc["profile_source"]["used"]["promote_s"]["value"] == pytest.approx(4.5)
    # other tweaks apply on top of the measured timings
    assert main([*argv, "--restart", "20", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["restart_s"] == 20.0 and doc["profile"]["promote_s"] == pytest.approx(4.5)
    assert main(argv) == 0
    assert "platform timings measured by bench_lab" in capsys.readouterr().out
    # without --results: the repository's results, and the output says so
    assert main(["ettr", "simulate", "--scales", "1024", "--events", "200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile_source"]["origin"] == str(profile.DEFAULT_RESULTS)
    assert doc["profile"]["requeue_s"] == fleetheal().requeue_s
    # the peers need no results
    argv = ["ettr", "simulate", "--scales", "1024", "--events", "200", "--profile", "manual", "--baseline", "llama3"]
    assert main([*argv, "--results", str(tmp_path / "missing.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile_source"]["origin"] == "built-in"
    assert doc["profile"]["requeue_s"] == profile.MANUAL.requeue_s


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--results", "MISSING"], "missing.json: no benchmark results"),
        (["--baseline", "fleetheal", "--profile", "manual", "--results", "MISSING"], "pass --results FILE"),
        (["--results", "BAD"], "not readable benchmark results"),
        ([], "benchmarks/results/latest.json: no benchmark results"),  # run elsewhere than the repository root
    ],
)
def test_cli_results_errors(
    extra: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{")
    argv = [{"MISSING": str(tmp_path / "missing.json"), "BAD": str(tmp_path / "bad.json")}.get(a, a) for a in extra]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["ettr", "simulate", "--scales", "1024", "--events", "100", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# --- ETTR measured on a lab run (`fleetheal ettr measure`) ------------------------------------------------


def _run_events() -> list[dict[str, object]]:
    """events.jsonl of a run (fleetheal.lab.train's format): 0.1 s steps, a restart that loses 20 steps."""
    ev: list[dict[str, object]] = [{"event": "start", "time": 0.0, "step": 0, "resumed_from": 0, "step_time": 0.1}]
    ev += [{"event": "progress", "time": float(t), "step": t * 10} for t in range(1, 11)]
    ev.append({"event": "checkpoint", "time": 8.0, "step": 80})
    ev.append({"event": "start", "time": 20.0, "step": 80, "resumed_from": 80, "step_time": 0.1})
    ev += [{"event": "progress", "time": 20.0 + t, "step": 80 + 10 * t} for t in range(1, 11)]
    return ev


def test_measured_ettr_of_a_run() -> None:
    ev = _run_events()
    m = measure.measure(ev, incidents=[{"phases": {"detect": 1.5, "act": 20.0, "total": None}}])
    assert m is not None
    assert m.allocated_s == pytest.approx(30.0)
    assert m.productive_s == pytest.approx(18.0)  # 180 kept steps x 0.1 s
    assert m.lost_work_s == pytest.approx(2.0)  # steps 80..100 computed, then redone
    assert m.down_s == pytest.approx(10.0)
    assert m.restarts == 1
    assert m.ettr == pytest.approx(0.6)
    assert m.ettr == pytest.approx(lab_ettr(ev))  # the same arithmetic as the lab demo's
    assert m.incidents == [{"detect": 1.5, "act": 20.0}]
    assert measure.measure([]) is None


def test_measure_cli_and_textfile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "train"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _run_events()))
    prom = tmp_path / "ettr.prom"
    assert main(["ettr", "measure", str(run), "--json", "--textfile", str(prom)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["train"]["ettr"] == pytest.approx(0.6)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(prom.read_text())
        for s in fam.samples
    }
    assert samples[(measure.METRIC_RATIO, (("job", "train"),))] == pytest.approx(0.6)
    assert samples[(measure.METRIC_SECONDS, (("category", "lost_work"), ("job", "train")))] == pytest.approx(2.0)
    assert samples[(measure.METRIC_RESTARTS, (("job", "train"),))] == 1
    with pytest.raises(SystemExit) as exc:
        main(["ettr", "measure", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert "no events.jsonl" in capsys.readouterr().err
