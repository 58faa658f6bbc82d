"""Virtual-time model of the engine's batching: Poisson arrivals, t(b) = a + c*b, the real decide().

    python3 benchmarks/policy_model.py --cost-ms 1.4,0.33 --arrivals 40000 \
        --csv FILE.csv --png FILE.png

What the real sweeps (loadgen.py) cannot give: the p95 each mode would have on a device whose
launch cost is exactly the fitted line, with no other process, no GIL, no timer slack, and tens of
thousands of arrivals per point instead of a few seconds of them. Every mode sees the same arrival
trace. The decision is `scheduler.decide` itself, fed the snapshots the engine would build (one
query per request, the engine's arrival-rate meter, a cost fit that is the line). Not modelled:
max_queue and queue_timeout refusals (the bench policies never reach them) and the bulk lane."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.loadgen import (  # noqa: E402
    FRACTIONS,
    MODES,
    Point,
    bench_policies,
    header_lines,
    report,
)
from gpu_engine.costmodel import CostFit, RateMeter  # noqa: E402
from gpu_engine.engine_stats import percentile  # noqa: E402
from gpu_engine.scheduler import (  # noqa: E402
    HEAD_REQUESTS,
    LanePolicy,
    LaneQueue,
    Launch,
    decide,
)

# decide() waits in floating-point seconds; a wait shorter than this still moves the clock, so a
# window that closes within rounding of `now` cannot stall the model.
MIN_STEP_S = 1e-7


def simulate(policy: LanePolicy, cost: CostFit, arrivals: np.ndarray,
             warmup_share: float = 0.1) -> Tuple[np.ndarray, int, float]:
    """Latencies (s) of the arrivals after the first `warmup_share`, the number of launches, and
    the instant the last answer is out."""
    n = len(arrivals)
    latency = np.empty(n)
    meter = RateMeter()
    idle = LaneQueue("bulk", (), None)
    policies = {"interactive": policy, "bulk": policy}
    queued: List[float] = []  # arrival instants, oldest first
    head = answered = launches = 0  # head: the next arrival not yet queued
    now = 0.0
    while answered < n:
        while head < n and arrivals[head] <= now:
            queued.append(arrivals[head])
            meter.add(1, arrivals[head])
            head += 1
        if not queued:
            now = arrivals[head]
            continue
        snapshot = LaneQueue("interactive", (1,) * min(len(queued), HEAD_REQUESTS), queued[0],
                             len(queued), meter.rate(now))
        decision = decide([snapshot, idle], policies, cost, now)
        if isinstance(decision, Launch):
            end = now + cost.predict(decision.queries)
            for arrived in queued[:decision.queries]:
                latency[answered] = end - arrived
                answered += 1
            del queued[:decision.queries]
            launches += 1
            now = end  # one launch at a time, as the engine's loop
        else:
            wake = math.inf if decision.seconds is None else now + max(decision.seconds, MIN_STEP_S)
            now = min(wake, arrivals[head] if head < n else math.inf)
    return latency[int(n * warmup_share):], launches, now


def model_point(mode: str, fraction: float, rate: float, policy: LanePolicy, cost: CostFit,
                arrivals: np.ndarray) -> Point:
    latency, launches, finished = simulate(policy, cost, arrivals)
    ms = (latency * 1000).tolist()
    p95 = percentile(ms, 0.95)
    return Point(mode, fraction, rate, len(arrivals) / finished, percentile(ms, 0.50), p95,
                 percentile(ms, 0.99), len(ms), 0, len(arrivals) / launches, policy.p95_target_ms, p95)


def model_sweep(cost: CostFit, arrivals: int, fractions: Sequence[float] = FRACTIONS,
                modes: Sequence[str] = MODES, window_us: int = 5000, target_ms: Optional[float] = None,
                max_batch: int = 32, seed: int = 1) -> Tuple[List[Point], Dict[str, float]]:
    """Each mode at each fraction of the max-batch capacity, on one arrival trace per fraction."""
    capacity = max_batch / cost.predict(max_batch)
    if target_ms is None:
        target_ms = round(5 * cost.predict(1) * 1000, 1)  # as loadgen: 5 x t(1)
    policies = bench_policies(window_us, target_ms, max_batch)
    rng = np.random.default_rng(seed)
    points = []
    for fraction in fractions:
        rate = fraction * capacity
        trace = np.cumsum(rng.exponential(1.0 / rate, size=arrivals))
        points += [model_point(mode, fraction, rate, policies[mode], cost, trace) for mode in modes]
    return points, {"capacity_qps": round(capacity, 1), "p95_target_ms": target_ms}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python3 benchmarks/policy_model.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--cost-ms", default="1.89,0.394", help="t(b) = A + C*b as 'A,C' in ms")
    parser.add_argument("--arrivals", type=int, default=40000, help="arrivals per point")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--window-us", type=int, default=5000, help="throughput/adaptive admission window")
    parser.add_argument("--target-ms", type=float, default=None, help="slo p95 target (default 5 x t(1))")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--csv")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    a, c = (float(v) / 1000 for v in args.cost_ms.split(","))
    cost = CostFit(a, c, samples=1000)
    points, shape = model_sweep(cost, args.arrivals, [float(f) for f in args.fractions.split(",")],
                                window_us=args.window_us, target_ms=args.target_ms,
                                max_batch=args.max_batch, seed=args.seed)
    for p in points:
        print(f"{p.mode:>10} {p.fraction:4.0%} {p.offered_qps:8.1f} q/s: p50 {p.p50_ms:7.2f} "
              f"p95 {p.p95_ms:7.2f} p99 {p.p99_ms:7.2f} ms, batch {p.mean_batch:4.1f}")
    header = header_lines({"model": f"t(b) = {a * 1000:g} + {c * 1000:g} b ms",
                           "arrivals_per_point": args.arrivals, **shape}, argv,
                          "benchmarks/policy_model.py")
    report(points, header, args.csv, args.png, "Batching modes, virtual-time model (no noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
