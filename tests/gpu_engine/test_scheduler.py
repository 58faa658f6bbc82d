"""Pure batching decisions: each mode, two lanes, bursts, idle spells and policies changed mid-stream."""
import math

import pytest

from gpu_engine.backends.base import DispatchShape
from gpu_engine.engine import POLICY_RECHECK_S
from gpu_engine.costmodel import REFERENCE_BATCH, CostFit, CostModel, FormatCosts, RateMeter, fit_line
from gpu_engine.scheduler import (
    DEFAULT_POLICIES,
    QUIET_GAP_S,
    QUIET_RATE,
    overlaps,
    SLO_MAX_UTILISATION,
    LanePolicy,
    batch_keeping_up,
    LaneQueue,
    Launch,
    PolicyError,
    Wait,
    decide,
    expiry_cutoff,
    launch_cap,
    plan_slo,
    policy_errors,
    take_requests,
)

FIT = CostFit(intercept_s=0.004, per_query_s=0.001, samples=50)  # t(b) = 4 ms + 1 ms per query


def lanes(interactive=None, bulk=None):
    return {"interactive": interactive or LanePolicy(), "bulk": bulk or LanePolicy()}


def q(sizes, oldest, lane="interactive", rate=0.0):
    return LaneQueue(lane, tuple(sizes), oldest if sizes else None, sum(sizes), rate)


# -- the policy value ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,message", [
    ("max_batch", 0, "max_batch must be in 1..74 queries, got 0"),
    ("max_batch", 75, "max_batch must be in 1..74 queries, got 75"),
    ("streams", 9, "streams must be in 1..8 streams, got 9"),
    ("window_us", -1, "window_us must be in 0..1000000 µs, got -1"),
    ("safety_margin", 0.95, "safety_margin must be in 0..0.9 (fraction of the target), got 0.95"),
    ("p95_target_ms", 0.0, "p95_target_ms must be in 0.1..60000 ms, got 0"),
    ("micro_batch", 223, "micro_batch must be in 0..222 keys, got 223"),
    ("mode", "fast", "mode must be one of latency, throughput, adaptive, slo, got 'fast'"),
    ("max_batch", "8", "max_batch must be a number in 1..74 queries, got '8'"),
])
def test_out_of_range_fields_are_refused_with_range_and_value(field, value, message):
    with pytest.raises(PolicyError) as caught:
        LanePolicy(**{field: value})
    assert caught.value.errors == {field: message}
    assert str(caught.value) == message


def test_cross_field_checks_name_the_field_and_both_values():
    errors = policy_errors({**LanePolicy().__dict__, "mode": "adaptive", "max_batch": 8, "adaptive_threshold": 9,
                            "max_queue": 4})
    assert errors == {
        "adaptive_threshold": "adaptive_threshold must be at most max_batch (8 queries), got 9",
        "max_queue": "max_queue must be at least max_batch (8 queries), got 4: a shorter queue can "
                     "never fill a batch",
    }
    with pytest.raises(PolicyError, match=r"queue_timeout_ms must exceed the admission window "
                                          r"\(5000 µs\), got 5 ms"):
        LanePolicy(window_us=5000, queue_timeout_ms=5)
    with pytest.raises(PolicyError, match=r"p95_target_ms must be at most queue_timeout_ms \(100 ms\)"):
        LanePolicy(mode="slo", p95_target_ms=200, queue_timeout_ms=100)
    LanePolicy(mode="latency", p95_target_ms=200, queue_timeout_ms=100)  # target unused there


def test_policy_gives_the_dispatch_shape():
    policy = LanePolicy(micro_batch=12, streams=4, cuda_graph=True)
    assert policy.dispatch == DispatchShape(12, 4, True)
    launch = decide([q((1,), 0.0)], lanes(policy), None, 0.0)
    assert launch.dispatch == DispatchShape(12, 4, True)


# -- one lane, each mode ------------------------------------------------------------------------
def test_latency_launches_whole_requests_up_to_the_cap_at_once():
    policies = lanes(LanePolicy(max_batch=8))
    d = decide([q((3, 3, 3), 1.0)], policies, None, 1.0)
    assert (d.lane, d.requests, d.queries, d.reason, d.mode) == ("interactive", 2, 6, "now", "latency")
    assert take_requests((40,), 32) == (1, 40)  # an oversized request still goes, alone
    assert decide([q((), None)], policies, None, 1.0) == Wait(None)


def test_throughput_window_counts_from_the_oldest_arrival():
    policies = lanes(LanePolicy(mode="throughput", max_batch=8, window_us=2000))
    # the oldest arrived at 1.000: at 1.0015 only 0.5 ms of its window is left
    d = decide([q((1, 1), 1.000)], policies, None, 1.0015)
    assert isinstance(d, Wait) and d.seconds == pytest.approx(0.0005)
    d = decide([q((1, 1), 1.000)], policies, None, 1.002)
    assert (d.requests, d.reason) == (2, "window")
    d = decide([q((4, 4, 1), 1.000)], policies, None, 1.0001)
    assert (d.requests, d.queries, d.reason) == (2, 8, "full")


def test_adaptive_answers_a_shallow_queue_at_once_and_fills_a_deep_one():
    policies = lanes(LanePolicy(mode="adaptive", adaptive_threshold=4, max_batch=16, window_us=3000))
    assert decide([q((1, 2), 5.0)], policies, None, 5.0).reason == "now"
    d = decide([q((2, 2), 5.0)], policies, None, 5.001)
    assert isinstance(d, Wait) and d.seconds == pytest.approx(0.002)
    assert decide([q((2, 2), 5.0)], policies, None, 5.003).reason == "window"


def test_slo_without_measurements_behaves_like_latency():
    policies = lanes(LanePolicy(mode="slo"))
    assert decide([q((1,), 0.0, rate=500)], policies, None, 0.0).reason == "warmup"
    assert decide([q((1,), 0.0, rate=500)], policies, CostFit(0.01, 0, 2), 0.0).reason == "warmup"


def test_slo_at_light_load_launches_at_once():
    policies = lanes(LanePolicy(mode="slo", p95_target_ms=50, window_us=20000))
    d = decide([q((1,), 0.0, rate=10)], policies, FIT, 0.0)
    assert (d.reason, d.mode, d.queries) == ("now", "slo", 1)


def test_slo_under_load_holds_for_the_smallest_batch_that_keeps_up():
    policy = LanePolicy(mode="slo", p95_target_ms=50, safety_margin=0.2, window_us=20000)
    plan = plan_slo(policy, FIT, arrival_rate=450)
    # b / t(b) * 0.8 >= 450/s first holds at b = 6: 6 / 0.010 * 0.8 = 480
    assert plan.batch == 6
    assert 5 / FIT.predict(5) * SLO_MAX_UTILISATION < 450
    assert plan.budget_s == pytest.approx(0.040)
    # held while the company it brings is worth the wait: (a - c - 1/rate) / 2 = (4 - 1 - 2.22) / 2 ms,
    # below the fill time (5/450 s) and the slack (40 - 2 x 10 ms)
    assert plan.window_s == pytest.approx((0.004 - 0.001 - 1 / 450) / 2)
    policies = lanes(policy)
    d = decide([q((1,), 0.0, rate=450)], policies, FIT, 0.0001)
    assert isinstance(d, Wait) and d.seconds == pytest.approx(plan.window_s - 0.0001)
    assert decide([q((1,) * 6, 0.0, rate=450)], policies, FIT, 0.001).queries == 6  # a full batch goes
    assert decide([q((1, 1, 1), 0.0, rate=450)], policies, FIT, plan.window_s).reason == "window"


def test_slo_does_not_hold_while_fewer_than_one_query_arrives_per_saved_intercept():
    policy = LanePolicy(mode="slo", p95_target_ms=50, safety_margin=0.2, window_us=20000)
    # 300/s: single launches (t(1) = 5 ms) cannot keep up, yet the 3.3 ms between arrivals is
    # longer than the 3 ms a shared launch saves, so holding one query costs more than it brings
    plan = plan_slo(policy, FIT, arrival_rate=300)
    assert plan.batch == 3 and plan.window_s == 0
    d = decide([q((1,), 0.0, rate=300)], lanes(policy), FIT, 0.0)
    assert (d.reason, d.queries) == ("now", 1)


def test_slo_does_not_hold_when_the_fit_is_too_noisy_to_promise_the_slack():
    policy = LanePolicy(mode="slo", p95_target_ms=50, safety_margin=0.2, window_us=20000)
    steady = plan_slo(policy, FIT, arrival_rate=450)
    # launches of 6 measured +-6 ms around the line: 2 x (10 + 2 x 6) ms is over the 40 ms budget
    noisy = plan_slo(policy, CostFit(FIT.intercept_s, FIT.per_query_s, FIT.samples, rmse_s=0.006), 450)
    assert steady.window_s > 0 and (noisy.batch, noisy.window_s) == (steady.batch, 0.0)
    d = decide([q((1, 1, 1), 0.0, rate=450)], lanes(policy),
               CostFit(FIT.intercept_s, FIT.per_query_s, FIT.samples, rmse_s=0.006), 0.0)
    assert (d.reason, d.queries) == ("window", 3)  # launched at once, like latency


def test_slo_holds_only_at_a_rate_that_brings_company_in_time():
    policy = LanePolicy(mode="slo", p95_target_ms=50, safety_margin=0.2, window_us=20000)
    # the average says 450/s and one query waits: hold it (a 0.39 ms window is planned)
    assert isinstance(decide([q((1,), 0.0, rate=450)], lanes(policy), FIT, 0.0001), Wait)
    # the average still says 50/s after an idle spell, and 5 queries came in 0.5 ms: a lagging
    # average errs towards launching at once
    d = decide([q((1,) * 5, 0.0, rate=50)], lanes(policy), FIT, 0.0005)
    assert isinstance(d, Launch) and d.queries == 5
    # two queries 10 µs apart at a light 200/s are a coincidence, not a burst to hold for
    d = decide([q((1, 1), 0.0, rate=200)], lanes(policy), FIT, 0.00001)
    assert isinstance(d, Launch) and (d.reason, d.queries) == ("now", 2)


def test_slo_with_a_target_it_cannot_meet_never_holds_queries():
    policy = LanePolicy(mode="slo", p95_target_ms=5, window_us=20000)
    plan = plan_slo(policy, FIT, arrival_rate=400)
    assert plan.window_s == 0
    assert plan.feasible is False  # t(1) = 5 ms is over the 4 ms budget
    assert decide([q((1,), 0.0, rate=400)], lanes(policy), FIT, 0.0).reason == "window"


def test_slo_batch_is_the_smallest_that_keeps_up():
    import random

    rng = random.Random(5)
    for _ in range(2000):
        fit = CostFit(rng.choice([0.0, rng.uniform(0, 0.02)]), rng.choice([0.0, rng.uniform(0, 0.002)]), 10)
        rate, max_batch = rng.uniform(0, 5000), rng.randint(1, 32)
        keeps_up = [b for b in range(1, max_batch + 1) if b / fit.predict(b) * SLO_MAX_UTILISATION >= rate]
        assert batch_keeping_up(fit, rate, max_batch) == (keeps_up[0] if keeps_up else max_batch)


def test_slo_past_capacity_uses_full_batches():
    policy = LanePolicy(mode="slo", max_batch=32, window_us=20000, p95_target_ms=500)
    assert plan_slo(policy, FIT, arrival_rate=10_000).batch == 32


# -- two lanes ----------------------------------------------------------------------------------
def test_interactive_goes_first_and_bulk_runs_when_it_is_idle():
    policies = lanes(LanePolicy(max_batch=8), LanePolicy(max_batch=32))
    both = [q((3, 3, 3), 1.0), q((32,), 0.5, "bulk")]
    assert decide(both, policies, None, 1.1).lane == "interactive"
    d = decide([q((), None), q((32,), 0.5, "bulk")], policies, None, 1.1)
    assert (d.lane, d.queries) == ("bulk", 32)


def test_bulk_is_not_starved_past_its_bound():
    policies = lanes(LanePolicy(), LanePolicy(max_starvation_ms=200))
    queues = [q((1,), 10.0), q((4,), 9.85, "bulk")]
    assert decide(queues, policies, None, 10.0).lane == "interactive"
    d = decide(queues, policies, None, 10.05)
    assert (d.lane, d.reason) == ("bulk", "starvation")


def test_a_lane_that_just_had_the_device_is_not_starved_however_old_its_backlog():
    # A bulk backlog queued 2 s ago, whose last launch ended 50 ms ago: interactive goes first;
    # bulk is forced only once it has gone its whole bound without the device.
    from gpu_engine.scheduler import LaneQueue

    policies = lanes(LanePolicy(), LanePolicy(max_starvation_ms=200))
    bulk = LaneQueue("bulk", (32,), 8.0, last_launch_end=9.95)
    queues = [q((1,), 9.99), bulk]
    assert decide(queues, policies, None, 10.0).lane == "interactive"
    assert decide([q((1,), 9.99), bulk], policies, None, 10.1).lane == "interactive"
    d = decide(queues, policies, None, 10.15)
    assert (d.lane, d.reason) == ("bulk", "starvation")
    # its wake-up is counted from the end of that launch, not from the backlog's age
    busy = lanes(LanePolicy(mode="throughput", window_us=900_000), LanePolicy(max_starvation_ms=200))
    assert decide([q((1,), 10.0), bulk], busy, None, 10.0).seconds == pytest.approx(0.15)


def test_bulk_fills_an_interactive_window_only_when_its_launch_fits():
    policies = lanes(LanePolicy(mode="throughput", window_us=20000), LanePolicy())
    queues = [q((1,), 0.0), q((4,), 0.0, "bulk")]
    # interactive holds its window for 20 ms more; 4 bulk queries take 8 ms: they go now
    d = decide(queues, policies, FIT, 0.0)
    assert (d.lane, d.queries) == ("bulk", 4)
    # 32 bulk queries would take 36 ms and delay interactive: wait for the window instead
    queues = [q((1,), 0.0), q((32,), 0.0, "bulk")]
    d = decide(queues, policies, FIT, 0.0)
    assert isinstance(d, Wait) and d.seconds == pytest.approx(0.020)
    # without a cost model nothing is known to fit
    assert isinstance(decide([q((1,), 0.0), q((4,), 0.0, "bulk")], policies, None, 0.0), Wait)


def test_wait_wakes_for_the_next_deadline_and_starvation_bound():
    policies = lanes(LanePolicy(mode="throughput", window_us=900_000, queue_timeout_ms=1000),
                     LanePolicy(max_starvation_ms=300, queue_timeout_ms=2000))
    d = decide([q((1,), 0.0), q((64,), 0.0, "bulk")], policies, None, 0.1)
    assert d.seconds == pytest.approx(0.2)  # bulk's starvation bound comes first
    assert expiry_cutoff(policies["interactive"], 5.0) == pytest.approx(4.0)


# -- sequences of decisions ---------------------------------------------------------------------
def simulate(arrivals, policy_at, fit, until):
    """Drive decide() like the engine loop: arrivals are (time, queries); returns the launches."""
    pending, launches, now, busy_until = list(arrivals), [], 0.0, 0.0
    queue = []  # (arrival, size)
    while now < until:
        while pending and pending[0][0] <= now:
            queue.append(pending.pop(0))
        snapshot = [q(tuple(s for _, s in queue), queue[0][0] if queue else None)]
        d = decide(snapshot, lanes(policy_at(now)), fit, now) if now >= busy_until else Wait(busy_until - now)
        if isinstance(d, Launch):
            launches.append((now, d.queries, d.reason))
            del queue[: d.requests]
            busy_until = now + fit.predict(d.queries)
            continue
        # like the engine, look again at least every POLICY_RECHECK_S while queries wait
        step = min(d.seconds if d.seconds is not None else math.inf, POLICY_RECHECK_S if queue else math.inf)
        next_arrival = pending[0][0] if pending else math.inf
        now = min(now + max(step, 1e-6), next_arrival, until)
    return launches


def test_a_burst_is_cut_into_full_batches_then_the_rest():
    burst = [(0.0, 1)] * 70
    launches = simulate(burst, lambda now: LanePolicy(max_batch=32), FIT, 1.0)
    assert [b for _, b, _ in launches] == [32, 32, 6]


def test_idle_spell_then_a_single_query_is_not_held_by_latency_or_slo():
    for policy in (LanePolicy(), LanePolicy(mode="slo", window_us=50_000)):
        launches = simulate([(0.5, 1)], lambda now: policy, FIT, 1.0)
        assert launches == [(0.5, 1, "now")]


def test_policy_changed_mid_stream_applies_to_queries_already_waiting():
    long_window = LanePolicy(mode="throughput", window_us=500_000)
    # throughput holds the query; at 0.1 s the operator switches to latency and it goes at once
    launches = simulate([(0.0, 1)], lambda now: long_window if now < 0.15 else LanePolicy(), FIT, 1.0)
    assert launches == [(pytest.approx(0.15 + POLICY_RECHECK_S / 2, abs=POLICY_RECHECK_S / 2), 1, "now")]
    launches = simulate([(0.0, 1)], lambda now: long_window, FIT, 1.0)
    assert launches == [(pytest.approx(0.5), 1, "window")]


# -- the measurements slo plans with ------------------------------------------------------------
def test_cost_fit_recovers_a_line_and_refuses_negative_terms():
    model = CostModel(window=8)
    for b in (1, 2, 4, 8, 16, 32, 1, 32):
        model.observe(b, 0.003 + 0.0005 * b)
    fit = model.fit()
    assert fit.samples == 8
    assert fit.intercept_s == pytest.approx(0.003) and fit.per_query_s == pytest.approx(0.0005)
    one_size = fit_line([(4, 0.01)] * 3)  # one size: a constant
    assert (one_size.intercept_s, one_size.per_query_s, one_size.samples) == (pytest.approx(0.01), 0.0, 3)
    assert one_size.rmse_s == pytest.approx(0.0, abs=1e-9)
    flat = fit_line([(1, 0.011), (32, 0.010)])  # noise on a flat curve must not fall
    assert flat.per_query_s == 0 and flat.intercept_s == pytest.approx(0.0105)
    through_origin = fit_line([(1, 0.0), (2, 0.003)])
    assert through_origin.intercept_s == 0 and through_origin.per_query_s > 0


def test_cost_model_keeps_the_fit_of_its_last_launches_as_they_come_and_go():
    import random

    rng = random.Random(3)
    model = CostModel(window=16)
    points = [(rng.randint(1, 32), rng.uniform(0.001, 0.02)) for _ in range(100)]
    for i, (b, t) in enumerate(points):
        model.observe(b, t)
        got, want = model.fit(), fit_line(points[max(0, i - 15):i + 1])
        assert got.samples == want.samples == min(i + 1, 16)
        for field in ("intercept_s", "per_query_s", "rmse_s"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-6, abs=1e-12)
    residuals = [t - (want.intercept_s + want.per_query_s * b) for b, t in points[-16:]]
    assert want.rmse_s == pytest.approx((sum(r * r for r in residuals) / 16) ** 0.5)


def test_each_key_format_is_planned_with_its_own_launches():
    costs = FormatCosts(window=8)
    assert costs.fit() == CostFit() and costs.fit([1]) == CostFit()  # no launch yet: no fit
    for b in (1, 8, 32):
        costs.observe([1], b, 0.020 + 0.004 * b)  # v1: the dearer
        costs.observe([2], b, 0.002 + 0.0005 * b)
    v1, v2 = costs.fit([1]), costs.fit([2])
    assert (v1.intercept_s, v1.per_query_s) == (pytest.approx(0.020), pytest.approx(0.004))
    assert (v2.intercept_s, v2.per_query_s) == (pytest.approx(0.002), pytest.approx(0.0005))
    # both queued, or asked for every format: the dearer at REFERENCE_BATCH queries
    assert costs.fit([1, 2]) == v1 and costs.fit() == v1
    assert v1.predict(REFERENCE_BATCH) > v2.predict(REFERENCE_BATCH)
    # a launch of both formats counts in each; a format never launched is planned like the others
    costs.observe([2, 1], 4, 0.05)
    assert (costs.fit([1]).samples, costs.fit([2]).samples) == (4, 4)
    assert costs.fit([3]) == costs.fit()
    assert set(costs.by_format()) == {1, 2}


def test_rate_meter_tracks_poisson_arrivals_and_forgets_after_idle():
    import random

    rng = random.Random(7)
    meter, now = RateMeter(tau_s=2.0), 0.0
    readings = []
    while now < 60:
        now += rng.expovariate(200.0)
        meter.add(1, now)
        if now > 10:
            readings.append(meter.rate(now))
    assert sum(readings) / len(readings) == pytest.approx(200, rel=0.05)
    assert meter.rate(now + 20) < 1.0


# -- a launch decided while another batch is on the device ----------------------------------------

@pytest.mark.parametrize("queries, starts", [(32, True), (31, False), (1, False)])
def test_only_a_full_batch_starts_behind_a_running_one(queries, starts):
    policies = {"interactive": LanePolicy(max_batch=32), "bulk": LanePolicy()}
    decision = Launch("interactive", 1, queries)
    assert overlaps(decision, [q([queries], 1.0)], policies) is starts


@pytest.mark.parametrize("interactive, starts", [
    (q([], 1.0), True),  # idle above: the bulk batch may start behind
    (q([], 1.0, rate=QUIET_RATE / 2), True),
    (q([], 1.0, rate=QUIET_RATE * 40), False),  # traffic: it would wait two launches
    (q([1], 1.0), False),  # queued above
])
def test_a_lower_lane_starts_behind_only_while_the_lanes_above_are_idle(interactive, starts):
    policies = {"interactive": LanePolicy(), "bulk": LanePolicy(max_batch=32)}
    decision = Launch("bulk", 1, 32)
    assert overlaps(decision, [interactive, q([32, 32], 1.0, lane="bulk")], policies) is starts


# -- a lower lane yields to a higher one (yield_ms) -----------------------------------------------

def test_launch_cap_is_the_largest_batch_that_ends_within_yield_ms():
    # FIT: t(b) = 4 ms + 1 ms per query
    assert launch_cap(LanePolicy(yield_ms=10), FIT) == 6
    assert launch_cap(LanePolicy(yield_ms=10.5), FIT) == 6
    assert launch_cap(LanePolicy(yield_ms=4.5), FIT) == 1  # even one query takes 5 ms: at least 1
    assert launch_cap(LanePolicy(yield_ms=100), FIT) == 32  # never past max_batch
    assert launch_cap(LanePolicy(yield_ms=0), FIT) == 32  # 0: never cut
    assert launch_cap(LanePolicy(yield_ms=10), None) == 32  # nothing measured yet
    assert launch_cap(LanePolicy(yield_ms=10), CostFit(0.004, 0.001, samples=0)) == 32


@pytest.mark.parametrize("interactive, queries", [
    (q([], 1.0), 30),  # the lane above is idle: a full bulk launch (whole requests of 3)
    (q([], 1.0, rate=QUIET_RATE / 2), 30),
    (q([], 1.0, rate=QUIET_RATE * 40), 6),  # queries coming above: cut to end within 10 ms
    # a burst above that ended: its average decays for seconds, but nothing came for a while
    (LaneQueue("interactive", (), None, 0, QUIET_RATE * 40, since_arrival_s=QUIET_GAP_S * 2), 30),
])
def test_a_lower_lane_launch_is_cut_while_a_higher_lane_is_active(interactive, queries):
    policies = lanes(bulk=LanePolicy(mode="throughput", yield_ms=10))
    bulk = q([3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], 0.5, lane="bulk")  # 33 queries: a full batch
    decision = decide([interactive, bulk], policies, FIT, now=1.0)
    assert isinstance(decision, Launch) and decision.lane == "bulk"
    assert (decision.queries, decision.requests) == (queries, queries // 3)


def test_a_starved_lower_lane_launches_cut_too():
    policies = lanes(bulk=LanePolicy(max_starvation_ms=200, yield_ms=10))
    decision = decide([q([1], 2.0), q([4, 4, 4], 1.0, lane="bulk")], policies, FIT, now=2.0)
    assert decision == Launch("bulk", 1, 4, "starvation", "latency")


def test_a_yielding_launch_takes_whole_requests_at_least_one():
    policies = lanes(bulk=LanePolicy(yield_ms=10))
    decision = decide([q([], 1.0, rate=50), q([16, 16], 0.5, lane="bulk")], policies, FIT, now=1.0)
    assert (decision.requests, decision.queries) == (1, 16)  # never split: the runner sizes requests


def test_the_default_bulk_policy_yields_and_interactive_never_does():
    assert DEFAULT_POLICIES["bulk"].yield_ms > 0
    assert DEFAULT_POLICIES["interactive"].yield_ms == 0
    decision = decide([q([1] * 32, 0.5)], lanes(LanePolicy(yield_ms=1)), FIT, now=1.0)
    assert decision.queries == 32  # no lane above interactive to yield to
