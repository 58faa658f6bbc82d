"""Batching decisions as pure functions: lane queues + policy + cost model + now -> launch or wait."""
from __future__ import annotations

import math
from decimal import Decimal
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from gpu_engine.backends.base import DispatchShape
from gpu_engine.costmodel import CostFit
from gpu_engine.backends.cuda_plan import MAX_LAUNCH_KEYS, MAX_LAUNCH_QUERIES
from morpho_pir.protocol import MAX_BATCH_QUERIES

LANES = ("interactive", "bulk")  # in priority order
MODES = ("latency", "throughput", "adaptive", "slo")
# slo keeps the planned utilisation of the device below this, so that queues do not grow
# without bound when the arrival rate fluctuates around the capacity of a batch size.
SLO_MAX_UTILISATION = 0.8
# slo launches without planning until the cost model has seen this many launches.
SLO_MIN_SAMPLES = 4
# A LaneQueue needs no more head requests than a full batch can hold (each has >= 1 query).
HEAD_REQUESTS = MAX_LAUNCH_QUERIES + 1
# queries per second under which a lane counts as idle: a lower lane's full batch may then start
# behind a running one (overlaps), and its launches are not cut (yield_to_higher)
QUIET_RATE = 1.0
# seconds without an arrival after which a lane counts as idle whatever its average rate says:
# the 2 s average of a burst that ended takes many seconds to decay below QUIET_RATE
QUIET_GAP_S = 0.5

# field -> (lowest, highest, unit words used in every error message)
POLICY_BOUNDS: Dict[str, Tuple[float, float, str]] = {
    "max_batch": (1, MAX_LAUNCH_QUERIES, "queries"),
    "window_us": (0, 1_000_000, "µs"),
    "adaptive_threshold": (1, MAX_LAUNCH_QUERIES, "queries"),
    "micro_batch": (0, MAX_LAUNCH_KEYS, "keys"),
    "streams": (1, 8, "streams"),
    "p95_target_ms": (0.1, 60_000, "ms"),
    "safety_margin": (0.0, 0.9, "(fraction of the target)"),
    "max_queue": (1, 100_000, "queries"),
    "queue_timeout_ms": (1, 600_000, "ms"),
    "max_starvation_ms": (1, 600_000, "ms"),
    "yield_ms": (0, 60_000, "ms"),
}


class PolicyError(ValueError):
    """A policy with out-of-range or inconsistent fields; `errors` maps field -> message."""

    def __init__(self, errors: Mapping[str, str]) -> None:
        super().__init__("; ".join(f"{msg}" for msg in errors.values()))
        self.errors = dict(errors)


def plain_number(value: float) -> str:
    """A bound or value as a person writes it: 1000000, 0.1, 60000 (never 1e+06 or 60000.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer():
            return str(int(value))
        return format(Decimal(repr(value)), "f")
    return str(value)



def policy_errors(values: Mapping[str, Any]) -> Dict[str, str]:
    """Field -> message for every bad value, in the words the admin and the engine both show."""
    errors: Dict[str, str] = {}
    mode = values.get("mode")
    if mode not in MODES:
        errors["mode"] = f"mode must be one of {', '.join(MODES)}, got {mode!r}"
    name = values.get("name", "")
    if not isinstance(name, str) or not 1 <= len(name) <= 100:
        errors["name"] = f"name must be 1..100 characters, got {name!r}"
    for field, (lo, hi, unit) in POLICY_BOUNDS.items():
        value = values.get(field)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            errors[field] = (f"{field} must be a number in {plain_number(lo)}..{plain_number(hi)} "
                             f"{unit}, got {value!r}")
        elif not lo <= value <= hi or (isinstance(value, float) and math.isnan(value)):
            errors[field] = (f"{field} must be in {plain_number(lo)}..{plain_number(hi)} {unit}, "
                             f"got {plain_number(value)}")
    if errors:
        return errors  # cross-field checks assume every field is in range
    if mode == "adaptive" and values["adaptive_threshold"] > values["max_batch"]:
        errors["adaptive_threshold"] = (
            f"adaptive_threshold must be at most max_batch ({values['max_batch']} queries), "
            f"got {values['adaptive_threshold']}")
    if values["max_queue"] < values["max_batch"]:
        errors["max_queue"] = (f"max_queue must be at least max_batch ({values['max_batch']} queries), "
                               f"got {values['max_queue']}: a shorter queue can never fill a batch")
    if values["queue_timeout_ms"] * 1000 <= values["window_us"]:
        errors["queue_timeout_ms"] = (
            f"queue_timeout_ms must exceed the admission window ({values['window_us']} µs), "
            f"got {values['queue_timeout_ms']} ms: every query held for the window would time out")
    if mode == "slo" and values["p95_target_ms"] > values["queue_timeout_ms"]:
        errors["p95_target_ms"] = (
            f"p95_target_ms must be at most queue_timeout_ms ({values['queue_timeout_ms']} ms), "
            f"got {plain_number(values['p95_target_ms'])}")
    return errors


@dataclass(frozen=True)
class LanePolicy:
    """How one lane batches; an immutable, validated value read at every decision. The policies
    app's `BatchingPolicy` is the database record an operator edits of one."""

    name: str = "default"  # operator's label, shown in metrics and the admin
    mode: str = "latency"  # latency | throughput | adaptive | slo
    # queries per launch (1..MAX_LAUNCH_QUERIES = 74: requests of up to 32 merged); the engine
    # applies at most its backend's pass_queries (Engine._applied)
    max_batch: int = MAX_BATCH_QUERIES
    # admission window (µs), counted from the oldest queued query's arrival: throughput and
    # adaptive hold a partial batch at most this long; slo picks a window no longer than this
    window_us: int = 2000
    adaptive_threshold: int = 4  # queue depth (queries) from which adaptive fills batches
    micro_batch: int = 0  # keys per kernel launch inside one batch; 0 = the whole batch at once
    streams: int = 1  # CUDA streams the micro-batches are spread over (1..8)
    cuda_graph: bool = False  # replay a captured CUDA graph when a launch shape repeats
    p95_target_ms: float = 50.0  # slo: the p95 latency (arrival to answer) to stay under, ms
    safety_margin: float = 0.2  # slo: fraction of the target kept in reserve for noise
    max_queue: int = 1024  # queries a lane may hold; a request beyond it is refused (503)
    queue_timeout_ms: int = 5000  # a query not started this long after arrival fails (503), ms
    # longest this lane's oldest query waits while a higher-priority lane keeps the device busy, ms
    max_starvation_ms: int = 1000
    # while a higher-priority lane is active, this lane's launches are cut to the batch the cost
    # model says ends within this long, so a query of that lane waits about this long at most
    # behind one of them (0: never cut), ms
    yield_ms: float = 0.0

    def __post_init__(self) -> None:
        errors = policy_errors({f.name: getattr(self, f.name) for f in fields(self)})
        if errors:
            raise PolicyError(errors)

    @property
    def dispatch(self) -> DispatchShape:
        return DispatchShape(self.micro_batch, self.streams, self.cuda_graph)

    @property
    def window_s(self) -> float:
        return self.window_us / 1e6


# Each lane's policy while the database's active records cannot be read, from the engine's start
# on (policies.source). The records the migrations create active (policies/migrations/0002) hold
# the same values. An Engine given no policy source at all (tests, benchmarks) runs
# LanePolicy() in every lane.
DEFAULT_POLICIES: Mapping[str, LanePolicy] = MappingProxyType({
    # answer at once with whatever is queued; under load batches form while the device is busy
    "interactive": LanePolicy(name="interactive-builtin", mode="latency", p95_target_ms=250),
    # full batches or 20 ms, a queue deep enough for whole job chunks, deadlines of minutes
    # yields to interactive queries: while they come, bulk launches last 4 ms at most
    "bulk": LanePolicy(name="bulk-builtin", mode="throughput", window_us=20_000,
                           max_queue=100_000, queue_timeout_ms=600_000, p95_target_ms=1000,
                           yield_ms=4),
})


@dataclass(frozen=True)
class LaneQueue:
    """What one lane holds at the moment of a decision."""

    lane: str
    request_sizes: Tuple[int, ...]  # queries per queued request, oldest first (the head only)
    oldest_arrival: Optional[float]  # monotonic seconds, None when empty
    queued: int = 0  # queries queued in all (0: the sum of request_sizes)
    arrival_rate: float = 0.0  # queries per second, recent average
    last_launch_end: Optional[float] = None  # monotonic seconds this lane's last launch ended
    since_arrival_s: float = 0.0  # seconds since the lane's latest arrival (inf: none yet)

    @property
    def quiet(self) -> bool:
        """Nothing queued and no queries coming: fewer than QUIET_RATE a second on average, or
        none for QUIET_GAP_S."""
        return not self.request_sizes and (self.arrival_rate < QUIET_RATE
                                           or self.since_arrival_s > QUIET_GAP_S)

    @property
    def starved_since(self) -> Optional[float]:
        """Since when the lane has waited for the device: its oldest query's arrival, or the end
        of its own last launch if that came later (a lane that just had the device is not starved,
        however long its backlog)."""
        if self.oldest_arrival is None or self.last_launch_end is None:
            return self.oldest_arrival
        return max(self.oldest_arrival, self.last_launch_end)

    @property
    def depth(self) -> int:
        return max(self.queued, sum(self.request_sizes))


@dataclass(frozen=True)
class Launch:
    """Launch the first `requests` requests of `lane` now, as one batch, in shape `dispatch`."""

    lane: str
    requests: int
    queries: int
    reason: str = "now"  # now | full | window | starvation | warmup
    mode: str = "latency"  # the mode of the policy that decided
    dispatch: DispatchShape = DispatchShape()


@dataclass(frozen=True)
class Wait:
    """Launch nothing; look again after `seconds` (None: until something arrives)."""

    seconds: Optional[float] = None


Decision = Union[Launch, Wait]
Rule = Callable[[LaneQueue, LanePolicy, Optional[CostFit], float], Decision]


def take_requests(sizes: Sequence[int], max_batch: int) -> Tuple[int, int]:
    """How many head requests fit in max_batch queries (at least one, never split): (requests, queries)."""
    taken = queries = 0
    for size in sizes:
        if taken and queries + size > max_batch:
            break
        taken += 1
        queries += size
    return taken, queries


def _launch_head(queue: LaneQueue, policy: LanePolicy, reason: str) -> Launch:
    """Launch the lane's head requests that fit in one batch of the policy's max_batch."""
    requests, queries = take_requests(queue.request_sizes, policy.max_batch)
    return Launch(queue.lane, requests, queries, reason, policy.mode, policy.dispatch)


def overlaps(decision: Launch, queues: Sequence[LaneQueue],
             policies: Mapping[str, LanePolicy]) -> bool:
    """Whether a launch decided while another batch is on the device starts at once, behind it.

    Only a full batch does: waiting for the device could not make it larger, and starting it
    now hides the host's work between launches (answers handed out, the next keys staged). A
    smaller one waits for the device, so that queries arriving meanwhile can still join it. And a
    lane's batch starts behind another only while every lane above it is idle (LaneQueue.quiet):
    else a query of the higher lane arriving meanwhile would wait for two launches of the lower
    lane instead of one."""
    if decision.queries < policies[decision.lane].max_batch:
        return False
    return higher_lanes_quiet(decision.lane, queues)


def higher_lanes_quiet(lane: str, queues: Sequence[LaneQueue]) -> bool:
    """Whether every lane above `lane` is idle (LaneQueue.quiet)."""
    rank = _rank(lane)
    return all(q.quiet for q in queues if _rank(q.lane) < rank)


def launch_cap(policy: LanePolicy, cost: Optional[CostFit]) -> int:
    """The most queries a launch of this lane takes while a higher lane is active: the largest
    batch the cost model says ends within the policy's yield_ms (at least 1), or max_batch when
    the policy never yields or nothing has been measured yet."""
    if not policy.yield_ms or cost is None or not cost.samples:
        return policy.max_batch
    room = policy.yield_ms / 1000 - cost.intercept_s
    if cost.per_query_s <= 0:
        return policy.max_batch if room >= 0 else 1
    return max(1, min(policy.max_batch, math.floor(room / cost.per_query_s)))


def yield_to_higher(decision: Launch, queues: Sequence[LaneQueue],
                    policies: Mapping[str, LanePolicy], cost: Optional[CostFit]) -> Launch:
    """`decision` cut to its lane's launch_cap while a higher lane is active: a query of that lane
    arriving meanwhile then waits for a short launch, not a full one. Whole requests only (at
    least one), so a lane that yields is fed requests of at most launch_cap queries."""
    cap = launch_cap(policies[decision.lane], cost)
    if decision.queries <= cap or higher_lanes_quiet(decision.lane, queues):
        return decision
    queue = next(q for q in queues if q.lane == decision.lane)
    requests, queries = take_requests(queue.request_sizes, cap)
    return replace(decision, requests=requests, queries=queries)


def _rank(lane: str) -> int:
    return LANES.index(lane) if lane in LANES else len(LANES)


def expiry_cutoff(policy: LanePolicy, now: float) -> float:
    """Requests that arrived before this instant can no longer start within the lane's timeout."""
    return now - policy.queue_timeout_ms / 1000


# -- one small rule per mode --------------------------------------------------------------------
def _latency(queue: LaneQueue, policy: LanePolicy, cost: Optional[CostFit], now: float) -> Decision:
    return _launch_head(queue, policy, "now")


def _fill_or_window(queue: LaneQueue, policy: LanePolicy, batch: int, window: float,
                    now: float) -> Decision:
    if queue.depth >= batch:
        return _launch_head(queue, policy, "full")
    held = now - queue.oldest_arrival
    if held >= window:
        return _launch_head(queue, policy, "window")
    return Wait(window - held)


def _throughput(queue: LaneQueue, policy: LanePolicy, cost: Optional[CostFit], now: float) -> Decision:
    return _fill_or_window(queue, policy, policy.max_batch, policy.window_s, now)


def _adaptive(queue: LaneQueue, policy: LanePolicy, cost: Optional[CostFit], now: float) -> Decision:
    # A shallow queue means light load: answer at once. A deep one means more is on its way,
    # so fill the batch (up to the window) and spend fewer launches per query.
    if queue.depth < policy.adaptive_threshold:
        return _latency(queue, policy, cost, now)
    return _throughput(queue, policy, cost, now)


@dataclass(frozen=True)
class SloPlan:
    """What slo aims for: hold queries until `batch` are queued or the oldest waited `window_s`."""

    batch: int
    window_s: float
    budget_s: float  # the p95 target less the safety margin
    feasible: bool  # False when even a single-query launch is predicted to miss the budget


def batch_keeping_up(cost: CostFit, arrival_rate: float, max_batch: int) -> int:
    """The smallest b whose launches, back to back, serve `arrival_rate` at SLO_MAX_UTILISATION:
    b / t(b) * u >= rate, i.e. b >= rate * a / (u - rate * c); max_batch when none does.

    Solved rather than searched: it runs on every scheduling decision, with the device idle."""
    room = SLO_MAX_UTILISATION - arrival_rate * cost.per_query_s
    if room <= 0:
        return 1 if _keeps_up(1, cost, arrival_rate) else max_batch
    b = min(max_batch, max(1, math.ceil(arrival_rate * cost.intercept_s / room)))
    if b > 1 and _keeps_up(b - 1, cost, arrival_rate):  # ceil of a float a hair above a whole number
        return b - 1
    if b < max_batch and not _keeps_up(b, cost, arrival_rate):
        return b + 1
    return b


def _keeps_up(batch: int, cost: CostFit, arrival_rate: float) -> bool:
    return batch / cost.predict(batch) * SLO_MAX_UTILISATION >= arrival_rate


def plan_slo(policy: LanePolicy, cost: CostFit, arrival_rate: float) -> SloPlan:
    """The smallest batch that keeps up with the arrivals, and how long the oldest query may be
    held for it.

    While single-query launches keep up (b = 1), nothing is held: with one device, launching at
    once and letting the next batch form while it runs gives the lowest latency. Beyond that,
    holding a query one more instant dw pays while the company it may bring saves more latency
    than the hold costs: a query arriving u into the hold and launched with the held one saves
    itself the wait behind a separate launch, a - c - 2u in all (t(b) = a + c b), with chance
    rate * dw; the held query waits dw longer whenever nobody came. Hence the hold is at most
    (a - c - 1/rate) / 2: none while fewer than one query arrives per saved intercept, and never
    more than half the intercept. It is also no longer than the batch takes to fill on average,
    and within the budget: a query's latency is about hold + queue wait + t(b), and one arriving
    just behind a launch waits that launch out, hence hold + 2 t(b) <= budget, with t(b) taken
    two residuals of the fit high: a launch that runs long while the device idled for the hold
    costs the whole queue.
    (Longer holds measured worse p95 than launching at once: docs/PERFORMANCE.md.)"""
    budget = policy.p95_target_ms / 1000 * (1 - policy.safety_margin)
    batch = batch_keeping_up(cost, arrival_rate, policy.max_batch)
    slack = budget - 2 * (cost.predict(batch) + 2 * cost.rmse_s)
    fill = (batch - 1) / arrival_rate if arrival_rate > 0 else 0.0
    window = max(0.0, min(policy.window_s, slack, fill, hold_worth(cost, arrival_rate)))
    return SloPlan(batch, window, budget, cost.predict(1) <= budget)


def hold_worth(cost: CostFit, arrival_rate: float) -> float:
    """The longest hold that company arriving at `arrival_rate` pays for, (a - c - 1/rate) / 2
    seconds (plan_slo says why); <= 0: launch at once."""
    if arrival_rate <= 0:
        return 0.0
    return (cost.intercept_s - cost.per_query_s - 1 / arrival_rate) / 2


def _slo(queue: LaneQueue, policy: LanePolicy, cost: Optional[CostFit], now: float) -> Decision:
    if cost is None or cost.samples < SLO_MIN_SAMPLES:
        return _launch_head(queue, policy, "warmup")  # no measurements yet: behave like latency
    if queue.depth >= policy.max_batch:
        return _launch_head(queue, policy, "full")  # no plan holds a full batch back
    # Cheap exits first: this runs between launches with the device idle (on the H100's host,
    # 20 µs more per decision than latency's showed as 1% more idle device time).
    # The 2 s average lags a rising load; a low rate only shortens the hold, so the lag errs
    # towards launching at once. (The rate the queue shows, depth over time since the oldest
    # arrival, was tried: from two arrivals a few µs apart it saw huge rates and held for them.)
    if hold_worth(cost, queue.arrival_rate) <= 0:
        return _launch_head(queue, policy, "now")
    plan = plan_slo(policy, cost, queue.arrival_rate)
    if plan.batch <= 1:
        return _launch_head(queue, policy, "now")
    return _fill_or_window(queue, policy, plan.batch, plan.window_s, now)


RULES: Dict[str, Rule] = {"latency": _latency, "throughput": _throughput,
                          "adaptive": _adaptive, "slo": _slo}


def decide(queues: Sequence[LaneQueue], policies: Mapping[str, LanePolicy],
           cost: Optional[CostFit], now: float) -> Decision:
    """What the engine does next.

    Lanes go in LANES order: a lane launches only when no higher lane holds work, unless it has
    waited for the device past its starvation bound (since its oldest query arrived or its own
    last launch ended, whichever is later), or the cost model predicts its launch
    ends before the waiting higher lane wants the device. Otherwise wait for the earliest
    instant at which any of that changes (a window closing, a starvation bound, a deadline).
    A lower lane's launch is cut to what its policy's yield_ms allows while a higher lane is
    active (yield_to_higher)."""
    decision = _decide(queues, policies, cost, now)
    if isinstance(decision, Launch):
        return yield_to_higher(decision, queues, policies, cost)
    return decision


def _decide(queues: Sequence[LaneQueue], policies: Mapping[str, LanePolicy],
            cost: Optional[CostFit], now: float) -> Decision:
    order = {lane: i for i, lane in enumerate(LANES)}
    busy = sorted((q for q in queues if q.request_sizes), key=lambda q: order.get(q.lane, len(order)))
    if not busy:
        return Wait(None)
    for queue in busy[1:]:
        policy = policies[queue.lane]
        if now - queue.starved_since >= policy.max_starvation_ms / 1000:
            return _launch_head(queue, policy, "starvation")
    wakeups = []
    higher_wait: Optional[float] = None  # how long the higher lanes still hold the device free
    for queue in busy:
        policy = policies[queue.lane]
        decision = RULES[policy.mode](queue, policy, cost, now)
        if isinstance(decision, Launch):
            if higher_wait is None:
                return decision
            if cost is not None and cost.samples and cost.predict(decision.queries) <= higher_wait:
                return decision  # it ends before the higher lane launches
        else:
            wakeups.append(decision.seconds)
            higher_wait = decision.seconds if higher_wait is None else min(higher_wait, decision.seconds)
        if queue is not busy[0]:
            wakeups.append(queue.starved_since + policy.max_starvation_ms / 1000 - now)
        wakeups.append(queue.oldest_arrival + policy.queue_timeout_ms / 1000 - now)
    return Wait(max(0.0, min(wakeups)))
