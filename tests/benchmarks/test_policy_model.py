"""The virtual-time batching model: right on a queue with a known answer, and slo against the static modes."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from benchmarks import loadgen, policy_model
from gpu_engine.costmodel import CostFit
from gpu_engine.scheduler import LanePolicy


def test_one_query_per_launch_is_an_md1_queue_with_the_textbook_mean_wait():
    # max_batch 1, service s = a + c: M/D/1, mean wait in queue rho*s / (2 (1 - rho))
    cost = CostFit(0.004, 0.001, samples=100)
    service, rate = 0.005, 120.0
    rho = rate * service
    arrivals = np.cumsum(np.random.default_rng(4).exponential(1 / rate, size=60_000))
    latency, launches, _ = policy_model.simulate(LanePolicy(mode="latency", max_batch=1), cost, arrivals)
    assert launches == len(arrivals)
    expected = service + rho * service / (2 * (1 - rho))
    assert latency.mean() == pytest.approx(expected, rel=0.03)


def test_throughput_mode_holds_a_lone_query_for_its_window():
    cost = CostFit(0.002, 0.0005, samples=100)
    arrivals = np.arange(1, 200) * 1.0  # one query a second: never company
    policy = LanePolicy(mode="throughput", window_us=5000)
    latency, launches, _ = policy_model.simulate(policy, cost, arrivals, warmup_share=0)
    assert launches == len(arrivals)
    assert latency == pytest.approx(np.full(len(arrivals), 0.005 + cost.predict(1)), abs=1e-6)


@pytest.mark.parametrize("cost_ms", [(10, 4.5), (10, 0.3), (1.89, 0.394), (0.2, 0.4)],
                         ids=["cpu-shape", "launch-dominated", "h100-fit", "per-query-dominated"])
def test_slo_is_within_10_percent_of_the_best_static_mode_at_every_load(cost_ms):
    # The goal on a device that is exactly its cost line (no machine noise): p95 and
    # throughput within 10% of the best static mode at each rate, and under the target
    # wherever a static mode is.
    cost = CostFit(cost_ms[0] / 1000, cost_ms[1] / 1000, samples=1000)
    points, _ = policy_model.model_sweep(cost, arrivals=6000, fractions=(0.1, 0.5, 0.85, 0.95))
    for fraction in (0.1, 0.5, 0.85, 0.95):
        here = {p.mode: p for p in points if p.fraction == fraction}
        slo, static = here.pop("slo"), list(here.values())
        assert slo.p95_ms <= 1.10 * min(p.p95_ms for p in static), (fraction, slo, static)
        assert slo.throughput_qps >= 0.90 * max(p.throughput_qps for p in static)
        if any(p.p95_ms <= p.p95_target_ms for p in static):
            assert slo.p95_ms <= slo.p95_target_ms, (fraction, slo)


def test_model_cli_writes_a_csv_the_loadgen_verdict_reads(tmp_path, capsys):
    path = tmp_path / "model.csv"
    assert policy_model.main(["--cost-ms", "2,0.5", "--arrivals", "2000", "--fractions", "0.3,0.9",
                              "--csv", str(path)]) == 0
    points, header = loadgen.read_csv(str(path))
    assert header[2].startswith("# command: python3 benchmarks/policy_model.py --cost-ms 2,0.5")
    assert {p.mode for p in points} == set(loadgen.MODES) and len(points) == 8
    assert " 90%: p95 " in capsys.readouterr().out


def test_engine_sweep_gives_every_mode_of_a_round_the_same_arrivals(monkeypatch):
    seen = []
    real_drive = loadgen.drive

    def recording_drive(submit, pool, arrivals, timeout=120.0):
        seen.append(arrivals.copy())
        return real_drive(submit, pool, arrivals, timeout)

    monkeypatch.setattr(loadgen, "drive", recording_drive)
    points, _ = loadgen.sweep("sim", pages=16, modes=("latency", "slo"), fractions=(0.2, 0.4),
                              duration=0.6, warmup=0.1, window_us=2000, target_ms=50.0, max_batch=8,
                              seed=3, log=lambda *a: None, rounds=2, sim_cost_ms="1,0.2",
                              capacity_qps=400.0)
    assert len(seen) == 2 * 2 * 2  # rounds x fractions x modes
    for stretch in range(0, len(seen), 2):  # latency then slo on one trace
        assert np.array_equal(seen[stretch], seen[stretch + 1])
    assert not np.array_equal(seen[0], seen[4])  # the next round draws again
    assert all(len(p.p95_rounds_ms.split(";")) == 2 for p in points)


def test_paired_ratio_compares_slo_with_the_best_static_mode_round_by_round():
    def point(mode, pooled_p95, rounds):
        return loadgen.Point(mode, 0.5, 100.0, 100.0, 1.0, pooled_p95, 1.0, 10, 0, 1.0, 50.0, 1.0,
                             ";".join(map(str, rounds)))

    slo = point("slo", 20.0, [11.0, 30.0, 9.0])
    latency = point("latency", 19.0, [10.0, 20.0, 10.0])  # the best static mode (pooled p95)
    throughput = point("throughput", 25.0, [12.0, 40.0, 6.0])  # best in round 3 only
    # against latency in every round: 1.1, 1.5, 0.9 -> median 1.1 (not a per-round best)
    assert loadgen.paired_p95_ratio(slo, [latency, throughput]) == pytest.approx(1.1)
    assert loadgen.paired_p95_ratio(point("slo", 1.0, [1.0]), [latency, throughput]) is None


def test_the_service_sets_the_gil_switch_interval_when_its_engine_starts(serve_matrix, vector_matrix_path):
    from engine.holder import get_engine

    before = sys.getswitchinterval()
    try:
        serve_matrix(vector_matrix_path, MORPHO_GIL_SWITCH_INTERVAL_US=700)
        get_engine()
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)


def test_an_a_a_control_measures_latency_twice_and_the_verdict_reports_their_gap(capsys, tmp_path):
    points, shape = loadgen.sweep("sim", pages=16, modes=("latency", loadgen.CONTROL, "slo"),
                                  fractions=(0.3,), duration=0.6, warmup=0.1, window_us=2000,
                                  target_ms=50.0, max_batch=8, seed=3, log=lambda *a: None, rounds=2,
                                  sim_cost_ms="1,0.2", capacity_qps=400.0)
    assert [p.mode for p in points] == ["latency", loadgen.CONTROL, "slo"]
    lines = loadgen.verdict(points)
    assert lines[0].startswith(" 30%: p95 ") and "A/A control, latency measured twice" in lines[1]
    # the control is not a static mode slo is judged against
    assert loadgen.bench_policies(2000, 50.0, 8).keys() == set(loadgen.MODES)
