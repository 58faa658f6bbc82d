"""The HTTP policy sweep (benchmarks/policy_http.py) without a server: the policy records it
writes are the engine-level bench policies field for field, every mode of a (round, fraction) gets
the same arrivals, and what it writes is read back by `loadgen --from-csv`."""
from __future__ import annotations

import numpy as np
import pytest
from django.core.exceptions import ValidationError

from benchmarks import loadgen, loadgen_http, policy_http
from policies.models import engine_policy
from policies.models import BatchingPolicy


@pytest.mark.django_db
def test_bench_records_are_the_engine_level_bench_policies_field_for_field():
    before = BatchingPolicy.objects.count()
    policies = loadgen.bench_policies(5000, 47.5, 32)
    records = policy_http.sync_bench_policies(policies)
    assert set(records) == set(loadgen.MODES) == set(policies)
    for mode, policy in policies.items():
        record = BatchingPolicy.objects.get(name=policy.name)
        assert record.name == f"bench-{mode}" and record.mode == mode and record.lane == "interactive"
        assert engine_policy(record) == policy  # every engine field, name included
    assert BatchingPolicy.objects.count() == before + 4

    # Activated live, then updated with the measured target: updated in place, still in force.
    policy_http.activate("bench-latency")
    again = loadgen.bench_policies(5000, 91.2, 32)
    policy_http.sync_bench_policies(again)
    assert BatchingPolicy.objects.count() == before + 4
    for policy in again.values():
        assert engine_policy(BatchingPolicy.objects.get(name=policy.name)) == policy
    assert BatchingPolicy.objects.get(lane="interactive", active=True).name == "bench-latency"
    policy_http.activate("bench-slo")
    assert BatchingPolicy.objects.get(lane="interactive", active=True).name == "bench-slo"


@pytest.mark.django_db
def test_bench_records_go_through_the_models_validation(monkeypatch):
    def refuse(self):
        raise ValidationError({"window_us": "refused by clean()"})

    monkeypatch.setattr(BatchingPolicy, "clean", refuse)
    with pytest.raises(ValidationError, match="refused by clean"):
        policy_http.sync_bench_policies(loadgen.bench_policies(5000, 47.5, 32))
    assert not BatchingPolicy.objects.filter(name__startswith="bench-").exists()


def _fake_sweep(rounds=3, fractions=(0.1, 0.5, 0.95), capacity=400.0, seconds=2.0, seed=7):
    calls = []  # (event, mode, arrivals)
    current = []

    def switch(mode):
        current.append(mode)
        calls.append(("switch", mode, None))

    def offer(arrivals):
        calls.append(("offer", current[-1], np.array(arrivals)))
        # a deterministic stand-in for the server: 10 ms per query, answered inside the span
        n = len(arrivals)
        return loadgen.Run([0.010] * n, completed=n, span_s=seconds, refused=0, queries=n, launches=n)

    runs = policy_http.run_sweep(loadgen.MODES, fractions, rounds, capacity, seconds, seed,
                                switch, offer)
    return runs, calls


def test_every_mode_of_a_round_and_fraction_gets_the_same_arrivals():
    fractions, rounds, capacity, seconds = (0.1, 0.5, 0.95), 3, 400.0, 2.0
    runs, calls = _fake_sweep(rounds, fractions, capacity, seconds)
    n = len(loadgen.MODES)
    assert len(calls) == 2 * rounds * len(fractions) * n
    # each offer comes right after the switch to its mode
    assert all(a[0] == "switch" and b[0] == "offer" and a[1] == b[1]
               for a, b in zip(calls[::2], calls[1::2]))
    offers = [c for c in calls if c[0] == "offer"]
    traces = {}
    for i, (_, mode, arrivals) in enumerate(offers):
        round_, f = divmod(i // n, len(fractions))
        traces.setdefault((round_, fractions[f]), {})[mode] = arrivals
    for (round_, fraction), by_mode in traces.items():
        assert sorted(by_mode) == sorted(loadgen.MODES)
        first = by_mode[loadgen.MODES[0]]
        for mode in loadgen.MODES:
            assert np.array_equal(by_mode[mode], first), (round_, fraction, mode)
        assert len(first) == pytest.approx(fraction * capacity * seconds, rel=0.35)
        assert first.min() >= 0 and first.max() < seconds
    # independent draws across rounds (and fractions)
    for fraction in fractions:
        assert not np.array_equal(traces[(0, fraction)]["slo"], traces[(1, fraction)]["slo"])
    # the mode order turns each round, so no mode is always the first after a switch
    firsts = [offers[r * n * len(fractions)][1] for r in range(rounds)]
    assert firsts == [loadgen.mode_order(loadgen.MODES, r)[0] for r in range(rounds)]
    assert len(set(firsts)) == rounds
    assert all(len(runs[(f, m)]) == rounds for f in fractions for m in loadgen.MODES)
    # the same seed draws the same traces
    _, calls_again = _fake_sweep(rounds, fractions, capacity, seconds)
    offers_again = [c for c in calls_again if c[0] == "offer"]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(offers, offers_again))


def test_points_are_written_in_the_engine_level_format_and_judged(tmp_path, capsys):
    fractions = (0.3, 0.9)
    runs, _ = _fake_sweep(rounds=2, fractions=fractions)
    points = policy_http.points_of(runs, loadgen.MODES, fractions, 400.0, 50.0)
    assert [(p.fraction, p.mode) for p in points] == [(f, m) for f in fractions for m in loadgen.MODES]
    assert all(p.p95_ms == pytest.approx(10.0) and p.mean_batch == 1 for p in points)
    path = tmp_path / "http.csv"
    header = loadgen.header_lines({"pages": 256}, ["--rounds", "2"], "benchmarks/policy_http.py")
    loadgen.write_csv(str(path), points, header)
    command = path.read_text().splitlines()[2]
    assert command == "# command: python3 benchmarks/policy_http.py --rounds 2"
    assert loadgen.main(["--from-csv", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [" 30%", " 90%"]
    assert all("p95 10.0 ms vs best static 10.0 (ok)" in line for line in out)


def test_a_policy_switch_the_server_never_reports_fails_loudly(monkeypatch):
    monkeypatch.setattr(loadgen_http, "active_policy", lambda url: ("bench-latency", "latency", 50.0))
    assert loadgen_http.wait_for_policy("http://x", "bench-latency", timeout=0.1) >= 0
    with pytest.raises(RuntimeError, match="still reports interactive policy bench-latency"):
        loadgen_http.wait_for_policy("http://x", "bench-slo", timeout=0.1)
    with pytest.raises(RuntimeError, match="target 91.2 ms"):
        loadgen_http.wait_for_policy("http://x", "bench-latency", timeout=0.1, target_ms=91.2)


def test_metric_values_are_read_by_name_and_labels():
    text = ('# HELP x\ngpu_queries_answered_total{lane="bulk"} 3.0\n'
            'gpu_queries_answered_total{lane="interactive"} 25.0\n'
            'pir_compute_seconds_count{lane="interactive"} 7.0\n'
            'gpu_cost_model{parameter="intercept_s"} 0.01\n')
    assert loadgen_http.metric_value(text, "gpu_queries_answered_total", lane="interactive") == 25.0
    assert loadgen_http.metric_value(text, "pir_compute_seconds_count", lane="interactive") == 7.0
    assert loadgen_http.metric_value(text, "gpu_cost_model", parameter="intercept_s") == 0.01
    assert np.isnan(loadgen_http.metric_value(text, "pir_compute_seconds", lane="interactive"))
