"""Poisson load against a running party over HTTP (`POST /query/page/gpu`): throughput and p50/p95/p99.

    python3 benchmarks/loadgen_http.py --url http://127.0.0.1:8001 --duration 15 --csv FILE.csv

The server batches with whatever interactive policy is active (change it in the admin between
runs; each row names the policy the server reported in /metrics). Offered rates are fractions of a
capacity measured first with closed-loop clients, or given with --rates. Standard library + numpy.

The pieces (`offer`, `http_capacity`, `active_policy`, `wait_for_policy`, `single_query_s`) also
serve benchmarks/policy_http.py, the sweep of all four modes against a party it starts."""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.loadgen import (  # noqa: E402
    FRACTIONS,
    Point,
    Run,
    drive,
    header_lines,
    make_pool,
    measure,
    poisson_arrivals,
    report,
    summarise,
)
from morpho_pir.protocol import KEYS_PER_QUERY  # noqa: E402


class Refused(Exception):
    """The server answered something other than 200 (503 when it sheds load)."""


def post_query(url: str, query: list, timeout: float) -> None:
    body = json.dumps({"keys": ["0x" + key.to_bytes().hex() for key in query]}).encode()
    request = urllib.request.Request(url + "/query/page/gpu", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise Refused(f"HTTP {exc.code}") from None


def active_policy(url: str) -> Tuple[str, str, float]:
    """(name, mode, p95 target ms) of the interactive policy the server applies, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("pir_batching_policy_info{") and 'lane="interactive"' in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            return labels.get("name", "?"), labels.get("mode", "?"), float(labels.get("p95_target_ms", "nan"))
    return "unknown", "unknown", float("nan")


def http_capacity(url: str, pool: Sequence[list], clients: int, seconds: float) -> float:
    """Answers per second with `clients` closed-loop clients (each sends its next query at once)."""
    answered = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(offset: int) -> None:
        i = offset
        while time.perf_counter() < stop:
            post_query(url, pool[i % len(pool)], 60)
            i += clients
            with lock:
                answered[0] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answered[0] / (time.perf_counter() - started)


def epoch_info(url: str) -> dict:
    """The party's `/epoch` document (its `page_pir.domain_bits` and `num_pages`)."""
    with urllib.request.urlopen(url + "/epoch", timeout=30) as response:
        return json.loads(response.read())


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sample `name` with these labels (among others) in a Prometheus text page; nan if absent."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            metric, _, value = line.rpartition(" ")
            have = dict(re.findall(r'(\w+)="([^"]*)"', metric))
            if metric.split("{")[0] == name and all(have.get(k) == v for k, v in labels.items()):
                return float(value)
    return math.nan


def lane_counts(url: str, lane: str = "interactive") -> Tuple[float, float]:
    """(queries answered, launches) of one lane of the server's engine so far, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return (metric_value(text, "gpu_queries_answered_total", lane=lane),
            metric_value(text, "pir_compute_seconds_count", lane=lane))


def wait_for_policy(url: str, name: str, timeout: float = 5.0, target_ms: Optional[float] = None,
                    poll_s: float = 0.02) -> float:
    """Seconds until the server reports `name` (and `target_ms`) as its interactive policy.

    Raises RuntimeError when it still reports another one after `timeout` seconds."""
    started = time.perf_counter()
    while True:
        seen = active_policy(url)
        if seen[0] == name and (target_ms is None or math.isclose(seen[2], target_ms, rel_tol=1e-4)):
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            wanted = name if target_ms is None else f"{name} (target {target_ms:g} ms)"
            raise RuntimeError(f"the server still reports interactive policy {seen[0]} ({seen[1]}, "
                               f"target {seen[2]:g} ms) {timeout:g} s after {wanted} was activated")
        time.sleep(poll_s)


def single_query_s(url: str, pool: Sequence[list], count: int = 20, warmup: int = 5) -> float:
    """The median time of `count` single queries sent one after another (after `warmup` more)."""
    samples = []
    for i in range(warmup + count):
        started = time.perf_counter()
        post_query(url, pool[i % len(pool)], 60)
        if i >= warmup:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def offer(url: str, pool: Sequence[list], arrivals, warmup: float, executor: Executor,
          timeout: float = 120.0) -> Run:
    """One stretch of open-loop load: a query at each arrival offset, each on its own thread.

    The Run's queries/launches are the interactive lane's, warm-up included, from /metrics."""
    before = lane_counts(url)

    def submit(query) -> Future:
        return executor.submit(post_query, url, query, timeout)

    start, done, refused = drive(submit, pool, arrivals, timeout=timeout)
    run = measure(arrivals, start, done, refused, warmup)
    after = lane_counts(url)
    if not any(math.isnan(v) for v in before + after):
        run.queries, run.launches = int(after[0] - before[0]), int(after[1] - before[1])
    return run


def run(url: str, rates: Optional[List[float]], fractions: Sequence[float], duration: float,
        warmup: float, clients: int, seed: int, log=print) -> Tuple[List[Point], dict]:
    epoch = epoch_info(url)
    domain_bits = epoch["page_pir"]["domain_bits"]
    pool = make_pool(domain_bits, 256, seed)
    capacity = float("nan")
    if rates is None:
        capacity = http_capacity(url, pool, clients, max(3.0, duration / 3))
        rates = [f * capacity for f in fractions]
        log(f"capacity {capacity:.1f} q/s with {clients} closed-loop clients")
    rng = np.random.default_rng(seed)
    points = []
    # Enough threads that a slow answer never delays the next arrival (open loop).
    with ThreadPoolExecutor(max_workers=256, thread_name_prefix="http-load") as pool_threads:
        for rate in rates:
            name, mode, target = active_policy(url)
            arrivals = poisson_arrivals(rate, warmup + duration, rng)
            fraction = rate / capacity if capacity == capacity else float("nan")
            point = summarise(f"{mode}:{name}", fraction, rate,
                              [offer(url, pool, arrivals, warmup, pool_threads)], target)
            points.append(point)
            log(f"{name} ({mode}) offered {rate:7.1f} q/s: {point.throughput_qps:7.1f} q/s, p50 "
                f"{point.p50_ms:7.1f} p95 {point.p95_ms:7.1f} p99 {point.p99_ms:7.1f} ms, "
                f"refused {point.refused}")
    shape = {"url": url, "num_pages": epoch["page_pir"]["num_pages"], "domain_bits": domain_bits,
             "keys_per_query": KEYS_PER_QUERY, "capacity_qps": round(capacity, 1),
             "clients": clients}
    return points, shape


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python3 benchmarks/loadgen_http.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="the party's base URL")
    parser.add_argument("--rates", help="offered rates (queries/s), comma-separated; default: fractions")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients for the capacity")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--csv")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    fractions = [float(f) for f in args.fractions.split(",") if f]
    points, shape = run(args.url.rstrip("/"), rates, fractions, args.duration, args.warmup,
                        args.clients, args.seed)
    report(points, header_lines(shape, argv, "benchmarks/loadgen_http.py"), args.csv, args.png,
           "Poisson load over HTTP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
