"""Poisson load against the Engine: sweep arrival rate x batching mode, report throughput and p50/p95/p99.

    python3 benchmarks/loadgen.py --backend cpu --pages 256 \
        --modes latency,throughput,adaptive,slo,latency-control \
        --duration 16 --rounds 4 --warmup 1 \
        --csv FILE.csv --png FILE.png
    python3 benchmarks/loadgen.py --from-csv low.csv,high.csv \
        --csv docs/benchmarks/h100_policy.csv --png docs/benchmarks/h100_policy.png
        (low.csv and high.csv: the two halves of benchmarks/device_policy.sh)

Open loop: arrivals follow a Poisson process whatever the engine does, and each query's latency is
counted from its scheduled arrival (so a slow engine cannot hide its queue by slowing the load).
Every request is one query of 3 keys, like `POST /query/page/gpu`. Needs numpy (and cupy for
cuda); matplotlib only for --png."""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import os
import platform
import shlex
import sys
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import pyplot  # noqa: E402
from gpu_engine.backends import create_backend  # noqa: E402
from gpu_engine.backends.base import Backend, DispatchShape, ResidentMatrix  # noqa: E402
from gpu_engine.costmodel import CostFit, FormatCosts  # noqa: E402
from morpho_pir.dpf import gen_keys  # noqa: E402
from gpu_engine.engine import Engine, EngineBusy, static_policy  # noqa: E402
from gpu_engine.engine_stats import percentile  # noqa: E402
from gpu_engine.matrix import ServedEpoch, random_matrix  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES  # noqa: E402
from gpu_engine.scheduler import LanePolicy  # noqa: E402

MODES = ("latency", "throughput", "adaptive", "slo")
# The latency policy measured a second time under another name (an A/A control): how far two
# runs of one policy fall apart on this machine, the resolution of every comparison here.
CONTROL = "latency-control"
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.85, 0.95)


@dataclass
class Point:
    """One (mode, offered rate) run."""

    mode: str
    fraction: float  # offered rate / measured capacity
    offered_qps: float
    throughput_qps: float  # queries answered per second in the measured span
    p50_ms: float
    p95_ms: float
    p99_ms: float
    answered: int
    refused: int
    mean_batch: float
    p95_target_ms: float
    # the median over rounds of each round's p95: one stall of the machine spoils one round's
    # tail, not the figure (the pooled p95 above counts it)
    p95_round_median_ms: float = math.nan
    # each round's p95 in round order, ';'-separated: every mode of a round saw the same arrivals,
    # so the modes compare round by round (verdict's paired ratio)
    p95_rounds_ms: str = ""
    # percent of the stretches' wall time the device sat idle with a query queued (engine level
    # only): what the mode spent holding for fuller batches
    held_pct: float = math.nan
    launches_held_pct: float = math.nan  # percent of launches the scheduler chose to wait for


class SimulatedBackend(Backend):
    """A device whose launch of b queries sleeps t(b) = intercept + per_query * b and answers zeros.

    It compares batching policies on a known cost curve without the noise of a shared CPU (a
    sleeping launch leaves the cores to the load generator and to other processes)."""

    name = "sim"

    def __init__(self, intercept_s: float, per_query_s: float) -> None:
        super().__init__()
        self.intercept_s, self.per_query_s = intercept_s, per_query_s

    def load(self, matrix, progress=None) -> ResidentMatrix:
        return _SimulatedResident(matrix, self)

    def memory_info(self) -> dict:
        return {"device": f"simulated t(b) = {self.intercept_s * 1000:g} ms + {self.per_query_s * 1000:g} ms x b",
                "used_bytes": 0, "total_bytes": 0}


class _SimulatedResident(ResidentMatrix):
    def __init__(self, matrix, backend: SimulatedBackend) -> None:
        super().__init__(matrix)
        self.backend = backend

    @property
    def nbytes(self) -> int:
        return 0

    def answer(self, keys, dispatch: DispatchShape = DispatchShape()) -> np.ndarray:
        self.check_keys(keys)
        time.sleep(self.backend.intercept_s + self.backend.per_query_s * len(keys) / KEYS_PER_QUERY)
        return np.zeros((len(keys), PAGE_BYTES), dtype=np.uint8)

    def write_rows(self, rows) -> None:
        pass

    def release(self) -> None:
        pass


def make_backend(name: str, sim_cost_ms: Optional[str] = None) -> Backend:
    """cpu | cuda | auto, or sim with sim_cost_ms "intercept,per_query" in milliseconds."""
    if name != "sim":
        return create_backend(name)
    intercept, per_query = (float(v) / 1000 for v in (sim_cost_ms or "10,4.5").split(","))
    return SimulatedBackend(intercept, per_query)


def make_pool(domain_bits: int, count: int, seed: int) -> List[list]:
    """Queries of 3 keys (party 0) for random pages, made once and reused round robin."""
    rng = np.random.default_rng(seed)
    return [[gen_keys(int(t), domain_bits, rng)[0]
             for t in rng.integers(1 << domain_bits, size=KEYS_PER_QUERY)]
            for _ in range(count)]


def poisson_arrivals(rate: float, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets (seconds from the start) of a Poisson process of `rate` per second."""
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.3) + 16)
    times = np.cumsum(gaps)
    while times[-1] < seconds:  # rare: draw more
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=len(gaps)))])
    return times[times < seconds]


def drive(submit: Callable[[list], object], pool: Sequence[list], arrivals: np.ndarray,
          timeout: float = 120.0) -> tuple:
    """Submit pool queries at the given offsets; returns (start, per-arrival done time or nan, refused).

    `submit(query)` returns a concurrent Future or raises EngineBusy (counted as refused)."""
    done = np.full(len(arrivals), np.nan)
    refused = np.zeros(len(arrivals), dtype=bool)
    pending: List[object] = []
    start = time.perf_counter()
    for i, offset in enumerate(arrivals):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            future = submit(pool[i % len(pool)])
        except EngineBusy:
            refused[i] = True
            continue

        def finished(f, i=i):
            if f.exception() is None:
                done[i] = time.perf_counter()
            else:
                refused[i] = True

        future.add_done_callback(finished)
        pending.append(future)
    deadline = time.perf_counter() + timeout
    for future in pending:
        try:
            future.exception(max(0.0, deadline - time.perf_counter()))
        except Exception:  # noqa: BLE001 - a future still running at the deadline counts as lost
            pass
    return start, done, refused


@dataclass
class Run:
    """What one stretch of load measured (a point pools several, spread over the sweep)."""

    latencies_s: List[float]  # per answered query arriving after the warm-up
    completed: int  # answers completed inside the measured span
    span_s: float
    refused: int
    queries: int = 0  # answered by the engine, warm-up included (for the mean batch)
    launches: int = 0
    held_s: float = 0.0  # device idle with a query queued, warm-up included (engine snapshot)
    wall_s: float = 0.0  # the whole stretch, warm-up included; 0 where held_s was not measured
    launches_held: int = 0  # launches the scheduler chose to wait for (engine snapshot)


def measure(arrivals: np.ndarray, start: float, done: np.ndarray, refused: np.ndarray,
            warmup: float) -> Run:
    measured = arrivals >= warmup
    latency = (done - (start + arrivals))[measured & ~np.isnan(done)]
    span_end = start + arrivals[-1] if len(arrivals) else start
    in_span = (~np.isnan(done)) & (done >= start + warmup) & (done <= span_end)
    return Run(latency.tolist(), int(in_span.sum()), max(1e-9, span_end - (start + warmup)),
               int(refused[measured].sum()))


def summarise(mode: str, fraction: float, rate: float, runs: Sequence[Run], target_ms: float) -> Point:
    ms = [1000 * v for run in runs for v in run.latencies_s]
    launches = sum(run.launches for run in runs)
    rounds = [percentile([1000 * v for v in run.latencies_s], 0.95) for run in runs]  # round order
    per_round = sorted(rounds)
    return Point(mode, fraction, rate, sum(r.completed for r in runs) / sum(r.span_s for r in runs),
                 percentile(ms, 0.50), percentile(ms, 0.95), percentile(ms, 0.99), len(ms),
                 sum(r.refused for r in runs),
                 sum(r.queries for r in runs) / launches if launches else float("nan"), target_ms,
                 float(np.median(per_round)) if per_round else math.nan,
                 ";".join(f"{v:.3f}" for v in rounds), *_held_pcts(runs, launches))


def _held_pcts(runs: Sequence[Run], launches: int) -> Tuple[float, float]:
    """(held_pct, launches_held_pct) of a point; nan where the engine's snapshot was not read."""
    wall = sum(run.wall_s for run in runs)
    if wall <= 0 or not launches:
        return math.nan, math.nan
    return (100 * sum(run.held_s for run in runs) / wall,
            100 * sum(run.launches_held for run in runs) / launches)


def bench_policies(window_us: int, target_ms: float, max_batch: int,
                   control: bool = False) -> Dict[str, LanePolicy]:
    """The four modes (and the A/A control if asked), each with room enough (queue, timeout)
    that nothing is refused."""
    common = dict(max_batch=max_batch, max_queue=100_000, queue_timeout_ms=600_000,
                  p95_target_ms=target_ms)
    extra = {CONTROL: LanePolicy(name="bench-latency-control", mode="latency", **common)} if control else {}
    return {**extra,
        "latency": LanePolicy(name="bench-latency", mode="latency", **common),
        "throughput": LanePolicy(name="bench-throughput", mode="throughput", window_us=window_us, **common),
        "adaptive": LanePolicy(name="bench-adaptive", mode="adaptive", window_us=window_us,
                                   adaptive_threshold=min(4, max_batch), **common),
        # slo picks its own window up to the target; the cap only bounds it
        "slo": LanePolicy(name="bench-slo", mode="slo", window_us=int(target_ms * 1000), **common),
    }


def measure_capacity(engine: Engine, pool: Sequence[list], max_batch: int, seconds: float) -> float:
    """Queries per second with the queue never empty (several full batches always waiting)."""
    engine.set_policy_source(static_policy(
        LanePolicy(name="capacity", max_batch=max_batch, max_queue=100_000)))
    for query in pool[:max_batch]:  # warm caches and the cost model
        engine.submit([query]).result(120)
    outstanding = threading.Semaphore(4 * max_batch)
    answered = [0]
    stop = time.perf_counter() + seconds
    started = time.perf_counter()
    i = 0
    while time.perf_counter() < stop:
        outstanding.acquire()
        future = engine.submit([pool[i % len(pool)]])
        i += 1

        def finished(f):
            answered[0] += 1
            outstanding.release()

        future.add_done_callback(finished)
    elapsed = time.perf_counter() - started
    return answered[0] / elapsed


def probe_cost(engine: Engine, pool: Sequence[list], max_batch: int) -> CostFit:
    """The engine's fitted t(b) after launches of 1 and of max_batch queries."""
    engine.set_policy_source(static_policy(LanePolicy(name="probe", max_batch=max_batch)))
    for b in (1, max_batch):  # first launches compile and allocate: keep them out of the fit
        engine.answer([list(q) for q in pool[:b]], timeout=120)
    engine.cost = FormatCosts()
    for b in (1, max_batch, 1, max_batch, 1, max_batch):
        engine.answer([list(q) for q in pool[:b]], timeout=120)
    return engine.cost.fit()


def mode_order(modes: Sequence[str], round_: int) -> List[str]:
    """The modes of one round, turned by one each round (no mode always runs first after a switch)."""
    k = round_ % len(modes)
    return list(modes[k:]) + list(modes[:k])


def _stretches(engine: Engine, pool: Sequence[list], policies: Dict[str, LanePolicy],
               modes: Sequence[str], fractions: Sequence[float], capacity: float, duration: float,
               warmup: float, rounds: int, rng: np.random.Generator, log=print) -> Dict[tuple, List[Run]]:
    """(fraction, mode) -> the runs measuring it.

    Each point is measured in `rounds` stretches, the modes interleaved, so that a slow spell of
    the machine (other processes) falls on every mode alike rather than on one. Within a stretch
    every mode gets the same arrival trace (common random numbers): near capacity the p95 of one
    Poisson draw differs from the next by more than the modes differ."""
    runs: Dict[tuple, List[Run]] = {}
    gc.freeze()  # the pool and the matrix: no collection walks them during a measured stretch
    for round_ in range(rounds):
        for fraction in fractions:
            arrivals = poisson_arrivals(fraction * capacity, warmup + duration / rounds, rng)
            for mode in mode_order(modes, round_):
                engine.set_policy_source(static_policy(policies[mode]))
                before = engine.snapshot()["lanes"]["interactive"]
                start, done, refused = drive(lambda q: engine.submit([q]), pool, arrivals)
                after = engine.snapshot()["lanes"]["interactive"]
                run = measure(arrivals, start, done, refused, warmup)
                run.queries = after["queries"] - before["queries"]
                run.launches = after["launches"] - before["launches"]
                run.held_s = after["held_seconds"] - before["held_seconds"]
                run.launches_held = after["launches_held"] - before["launches_held"]
                run.wall_s = time.perf_counter() - start
                runs.setdefault((fraction, mode), []).append(run)
                fit = engine.cost.fit()
                log(f"  round {round_ + 1} {fraction:4.0%} {mode:>10}: p95 "
                    f"{percentile([1000 * v for v in run.latencies_s], 0.95):7.2f} ms, batch "
                    f"{run.queries / max(1, run.launches):5.1f}, held {100 * run.held_s / run.wall_s:4.1f}% "
                    f"({run.launches_held} of {run.launches} launches), "
                    f"fit t(1) {fit.predict(1) * 1000:.2f} "
                    f"t(32) {fit.predict(32) * 1000:.2f} ms")
    return runs


def sweep(backend_name: str, pages: int, modes: Sequence[str], fractions: Sequence[float],
          duration: float, warmup: float, window_us: int, target_ms: Optional[float],
          max_batch: int, seed: int, log=print, capacity_s: Optional[float] = None,
          rounds: int = 1, sim_cost_ms: Optional[str] = None,
          capacity_qps: Optional[float] = None) -> tuple:
    """Every mode at every fraction of the capacity (measured, or `capacity_qps` as given).

    One engine serves the whole sweep and each stretch swaps its policy live, as the admin does:
    the matrix is loaded once (4 GiB take seconds to upload to a GPU) and each mode starts from
    the cost fit and arrival rate a running service would have."""
    backend = make_backend(backend_name, sim_cost_ms)
    epoch = ServedEpoch(epoch_id=1, matrix=random_matrix(pages, seed=seed))
    pool = make_pool(epoch.matrix.domain_bits, 256, seed)
    engine = Engine(backend, epoch).start()
    try:
        if capacity_qps is None:
            capacity_qps = measure_capacity(engine, pool, max_batch,
                                            capacity_s if capacity_s is not None else max(3.0, duration / 3))
        fit = probe_cost(engine, pool, max_batch)
        t1, tmax = fit.predict(1), fit.predict(max_batch)
        if target_ms is None:
            # A target that decides something: a lightly loaded engine meets it with room to
            # spare (one launch takes t(1)), a saturated one cannot.
            target_ms = round(5 * t1 * 1000, 1)
        log(f"capacity {capacity_qps:.1f} q/s; t(1) = {t1 * 1000:.2f} ms, t({max_batch}) = "
            f"{tmax * 1000:.2f} ms; slo p95 target {target_ms} ms")
        policies = bench_policies(window_us, target_ms, max_batch, control=CONTROL in modes)
        runs = _stretches(engine, pool, policies, modes, fractions, capacity_qps, duration, warmup,
                          rounds, np.random.default_rng(seed), log)
    finally:
        engine.stop()
    points: List[Point] = []
    for fraction in fractions:
        for mode in modes:
            point = summarise(mode, fraction, fraction * capacity_qps, runs[(fraction, mode)], target_ms)
            points.append(point)
            log(f"{mode:>10} {fraction:4.0%} offered {point.offered_qps:7.1f} q/s: "
                f"{point.throughput_qps:7.1f} q/s, p50 {point.p50_ms:7.1f} p95 {point.p95_ms:7.1f} "
                f"p99 {point.p99_ms:7.1f} ms, batch {point.mean_batch:4.1f}, held {point.held_pct:4.1f}% "
                f"({point.launches_held_pct:.1f}% of launches), refused {point.refused}")
    shape = {"pages": pages, "domain_bits": epoch.matrix.domain_bits,
             "keys_per_query": KEYS_PER_QUERY,
             "max_batch": max_batch, "window_us": window_us, "p95_target_ms": target_ms, "rounds": rounds,
             "capacity_qps": round(capacity_qps, 1), "t1_ms": round(t1 * 1000, 3),
             f"t{max_batch}_ms": round(tmax * 1000, 3), "backend": backend.describe().get("device", backend.name)}
    return points, shape


def header_lines(shape: dict, argv: Sequence[str],
                 script: str = "benchmarks/loadgen.py") -> List[str]:
    """The # machine / shape / command / date lines every policy CSV starts with; `script` is the
    path of the benchmark that ran, from the repository root."""
    return [
        f"# machine: {platform.node()} {platform.machine()} {platform.processor() or ''} "
        f"cpus={os.cpu_count()} python={platform.python_version()} numpy={np.__version__}",
        "# shape: " + " ".join(f"{k}={v}" for k, v in shape.items()),
        f"# command: python3 {script} " + " ".join(shlex.quote(a) for a in argv),
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    ]


def report(points: Sequence[Point], header: Sequence[str], csv_path: Optional[str], png_path: Optional[str],
           title: str) -> None:
    """Write the CSV and the plot where asked, then print the verdict."""
    if csv_path:
        write_csv(csv_path, points, header)
        print(f"wrote {csv_path}")
    if png_path:
        plot(png_path, points, header, title)
        print(f"wrote {png_path}")
    for line in verdict(points):
        print(line)


def write_csv(path: str, points: Sequence[Point], header: Sequence[str]) -> None:
    with open(path, "w", newline="") as fh:
        for line in header:
            fh.write(line + "\n")
        writer = csv.DictWriter(fh, fieldnames=list(asdict(points[0]).keys()))
        writer.writeheader()
        for point in points:
            writer.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(point).items()})


def read_csv(path: str) -> Tuple[List[Point], List[str]]:
    """Points and header lines of a CSV written by write_csv (to plot it again)."""
    with open(path) as fh:
        lines = fh.read().splitlines()
    header = [line for line in lines if line.startswith("#")]
    rows = csv.DictReader([line for line in lines if not line.startswith("#")])
    types = {f.name: f.type for f in fields(Point)}
    points = [Point(**{k: (v if types[k] in ("str", str) else
                           (int(v) if types[k] in ("int", int) else float(v))) for k, v in row.items()})
              for row in rows]
    return points, header


def plot(path: str, points: Sequence[Point], header: Sequence[str], title: str) -> None:
    plt = pyplot()

    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [p for p in points if p.mode == mode]
        x = [p.offered_qps for p in mine]
        ax_lat.plot(x, [p.p95_ms for p in mine], marker="o", label=f"{mode} p95")
        ax_lat.plot(x, [p.p99_ms for p in mine], linestyle=":", alpha=0.6, label=f"{mode} p99")
        ax_tp.plot(x, [p.throughput_qps for p in mine], marker="o", label=mode)
    target = points[0].p95_target_ms
    ax_lat.axhline(target, color="grey", linestyle="--", label=f"slo target {target:g} ms")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("offered load (queries/s, Poisson)")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.legend(fontsize=7, ncol=2)
    ax_tp.plot([0, max(p.offered_qps for p in points)], [0, max(p.offered_qps for p in points)],
               color="grey", linestyle="--", label="offered")
    ax_tp.set_xlabel("offered load (queries/s, Poisson)")
    ax_tp.set_ylabel("answered (queries/s)")
    ax_tp.legend(fontsize=8)
    fig.suptitle(title + "\n" + textwrap.fill(header[1].lstrip("# "), 140), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python3 benchmarks/loadgen.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto", "sim"))
    parser.add_argument("--sim-cost-ms", default="10,4.5",
                        help="sim backend: t(b) = A + C*b as 'A,C' in ms (default: this CPU's shape)")
    parser.add_argument("--pages", type=int, default=256, help="matrix pages (random, seeded)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                        help="offered rates as fractions of the measured capacity")
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per point not measured")
    parser.add_argument("--window-us", type=int, default=5000, help="throughput/adaptive admission window")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="slo p95 target (default: 5 x the measured t(1))")
    parser.add_argument("--rounds", type=int, default=3,
                        help="stretches each point is measured in, interleaved over the sweep")
    parser.add_argument("--capacity-qps", type=float, default=None,
                        help="take this capacity (queries/s) instead of measuring it, to split one "
                             "sweep over several runs")
    parser.add_argument("--switch-interval-us", type=int, default=500,
                        help="Python's GIL switch interval (µs), as the service sets it "
                             "(MORPHO_GIL_SWITCH_INTERVAL_US); 0 = Python's own 5000")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--csv", help="write the points here (with machine/shape/command/date lines)")
    parser.add_argument("--png", help="plot p95/p99 and throughput against offered load here")
    parser.add_argument("--from-csv", help="run nothing: judge CSVs written before (comma-separated: "
                                           "one sweep split over several runs), plot them (--png) "
                                           "and write them as one (--csv)")
    args = parser.parse_args(argv)
    if args.from_csv:
        points, header = [], []
        for path in args.from_csv.split(","):
            more, lines = read_csv(path)
            points += more
            header += lines if not header else [line.replace("# ", f"# part {path.rsplit('/', 1)[-1]}: ", 1)
                                                for line in lines]
        report(points, header, args.csv, args.png, f"Batching modes under Poisson load ({args.backend})")
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES) - {CONTROL})
    if unknown:
        parser.error(f"unknown modes {unknown}, expected some of {', '.join(MODES)}, {CONTROL}")
    fractions = [float(f) for f in args.fractions.split(",") if f]
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    points, shape = sweep(args.backend, args.pages, modes, fractions, args.duration, args.warmup,
                          args.window_us, args.target_ms, args.max_batch, args.seed, rounds=args.rounds,
                          sim_cost_ms=args.sim_cost_ms, capacity_qps=args.capacity_qps)
    report(points, header_lines(shape, argv), args.csv, args.png,
           f"Batching modes under Poisson load ({args.backend})")
    return 0


def paired_p95_ratio(slo: Point, static: Sequence[Point]) -> Optional[float]:
    """The median over rounds of slo's p95 / the p95 of the best static mode (lowest pooled p95)
    in the same round; None without two or more rounds.

    The modes of one round answered the same arrival trace, so a round's ratio compares policies
    and not draws; the median over rounds drops a round that a stall of the machine spoiled. The
    best static mode is one mode for all rounds: the lowest p95 of each round would be a policy
    that changes every round with hindsight, and with noisy rounds it sits below every static
    mode's own typical p95."""
    best = min(static, key=lambda p: p.p95_ms)
    rounds = [[float(v) for v in p.p95_rounds_ms.split(";")] if p.p95_rounds_ms else [] for p in (slo, best)]
    if len(rounds[0]) < 2 or len(rounds[0]) != len(rounds[1]):
        return None
    return float(np.median([mine / theirs for mine, theirs in zip(*rounds)]))


def verdict(points: Sequence[Point]) -> List[str]:
    """Per offered rate: is slo within 10% of the best static mode on p95 (pooled, the median of
    the rounds' p95, and paired round by round) and on throughput, and under its target wherever
    any mode is?"""
    lines = []
    for fraction in dict.fromkeys(p.fraction for p in points):
        here = {p.mode: p for p in points if p.fraction == fraction}
        control = here.pop(CONTROL, None)
        slo, static = here.get("slo"), [p for m, p in here.items() if m != "slo"]
        if slo is None or not static:
            continue
        parts = []
        for label, key in (("p95", "p95_ms"), ("round-median p95", "p95_round_median_ms")):
            mine, best = getattr(slo, key), min(getattr(p, key) for p in static)
            if not math.isnan(mine):
                parts.append(f"{label} {mine:.1f} ms vs best static {best:.1f} "
                             f"({'ok' if mine <= 1.10 * best else 'MISS'})")
        paired = paired_p95_ratio(slo, static)
        if paired is not None:
            parts.append(f"paired p95 ratio {paired:.2f} ({'ok' if paired <= 1.10 else 'MISS'})")
        best_tp = max(p.throughput_qps for p in static)
        parts.append(f"throughput {slo.throughput_qps:.1f} vs {best_tp:.1f} "
                     f"({'ok' if slo.throughput_qps >= 0.90 * best_tp else 'MISS'})")
        met = slo.p95_ms <= slo.p95_target_ms
        anyone = any(p.p95_ms <= p.p95_target_ms for p in here.values())
        parts.append(f"target {'met' if met else 'missed'}"
                     f"{' although another mode met it' if anyone and not met else ''}")
        lines.append(f"{fraction:4.0%}: " + ", ".join(parts))
        if control is not None and "latency" in here:
            same = paired_p95_ratio(control, [here["latency"]])
            lines.append(f"{fraction:4.0%}: A/A control, latency measured twice: p95 "
                         f"{control.p95_ms:.1f} vs {here['latency'].p95_ms:.1f} ms"
                         + (f", paired ratio {same:.2f}" if same is not None else ""))
    return lines


if __name__ == "__main__":
    sys.exit(main())
