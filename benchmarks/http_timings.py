"""End-to-end HTTP timings of one query and one 32-query batch against running parties (CSV).

    make run DEMO_PAGES=65536      (in another terminal: parties A and B)
    python3 benchmarks/http_timings.py --server-a http://127.0.0.1:8001 \
        --server-b http://127.0.0.1:8002 --matrix var/demo-65536p.bin \
        --out var/bench/http_cpu_65536p.csv                          (`make bench-http`)

With --matrix (the file the parties serve) the rows fetched are checked against it, and the same
keys are also answered by a NumPy backend in this process: the cost without HTTP.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import cpu_model  # noqa: E402
from gpu_engine.backends.cpu import NumpyBackend  # noqa: E402
from morpho_pir.dpf import DpfKey, KeyBatch  # noqa: E402
from gpu_engine.matrix import load_matrix  # noqa: E402
from morpho_pir.protocol import MAX_BATCH_QUERIES  # noqa: E402
from morpho_client import PirClient  # noqa: E402
from morpho_client.plan import plan_query  # noqa: E402

COLUMNS = "endpoint,queries,reps,mean_ms,p50_ms,p95_ms,min_ms,max_ms,queries_per_s"


def _load(values) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _time(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000.0)
    return samples


def _row(endpoint: str, queries: int, samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    mean = statistics.fmean(samples)
    return (f"{endpoint},{queries},{len(samples)},{mean:.1f},{statistics.median(samples):.1f},"
            f"{p95:.1f},{ordered[0]:.1f},{ordered[-1]:.1f},{queries / (mean / 1000.0):.2f}")


def _backend_rows(matrix, plans, reps: int, batch_reps: int, warmup: int) -> list[str]:
    """The same keys answered by a NumPy backend in this process: the cost without HTTP, measured
    under the same machine load as the HTTP rows (the servers' backend may differ: see header)."""

    def batch(chosen) -> KeyBatch:
        return KeyBatch.from_keys([DpfKey.from_bytes(bytes.fromhex(key))
                                   for plan in chosen for key in plan.keys_a])

    resident = NumpyBackend().load(matrix)
    try:
        one, many = batch(plans[:1]), batch(plans)
        return [
            _row("NumPy backend in-process, no HTTP", 1,
                 _time(lambda: resident.answer(one), reps, warmup)),
            _row("NumPy backend in-process, no HTTP", len(plans),
                 _time(lambda: resident.answer(many), batch_reps, warmup)),
        ]
    finally:
        resident.release()


def run(server_a: str, server_b: str, reps: int, batch_reps: int, warmup: int,
        matrix: Optional[str]) -> list[str]:
    """Time each shape; returns CSV header lines and rows."""
    load_before = os.getloadavg()
    client = PirClient(server_a, server_b)
    info = client.epoch()
    health = client.call(client.servers[0], "/health")
    plans = [plan_query((7919 * i) % info.num_pages, info.num_pages, info.domain_bits)
             for i in range(MAX_BATCH_QUERIES)]
    single_body = {"keys": list(plans[0].keys_a)}
    batch_body = {"queries": [{"keys": list(p.keys_a)} for p in plans]}
    rows = [(97 * i + 13) % info.num_rows for i in range(MAX_BATCH_QUERIES)]

    results = [
        _row("POST /query/page/gpu (party A)", 1,
             _time(lambda: client.call(client.servers[0], "/query/page/gpu", single_body),
                   reps, warmup)),
        _row("POST /query/page/gpu/batch (party A)", MAX_BATCH_QUERIES,
             _time(lambda: client.call(client.servers[0], "/query/page/gpu/batch", batch_body),
                   batch_reps, warmup)),
        _row("client: 1 row from A+B (epoch check, keygen, XOR)", 1,
             _time(lambda: client.fetch_rows(rows[:1], batch=False), reps, warmup)),
        _row("client: 32 rows from A+B in one batch each", MAX_BATCH_QUERIES,
             _time(lambda: client.fetch_rows(rows, batch=True), batch_reps, warmup)),
    ]
    checked = "not checked (no --matrix)"
    if matrix:
        reference = load_matrix(matrix)
        got = client.fetch_rows(rows, batch=True)
        if got != [reference.row(r) for r in rows]:
            raise SystemExit("the rows fetched do not match the matrix file")
        checked = f"all {len(rows)} rows fetched equal {matrix}"
        results += _backend_rows(reference, plans, reps, batch_reps, warmup)
    client.close()
    header = [
        f"# machine: {platform.node() or 'host'}; {cpu_model()}; {os.cpu_count()} CPUs",
        f"# shape: pages={info.num_pages}, domain_bits={info.domain_bits}, "
        f"rows={info.num_rows}, epoch_id={info.epoch_id}",
        f"# server: backend={health.get('backend')}, device={health.get('device')}; "
        f"parties {server_a} and {server_b} on this machine",
        f"# command: python3 benchmarks/http_timings.py {' '.join(sys.argv[1:])}",
        f"# load average (1, 5, 15 min) before: {_load(load_before)}, "
        f"after: {_load(os.getloadavg())}"
        f" (both parties share this machine's {os.cpu_count()} CPUs with anything else running)",
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# reps={reps} (single) and {batch_reps} (batch) after {warmup} warm-up; "
        f"times are wall-clock per request round; "
        f"3 keys per query; correctness: {checked}",
        COLUMNS,
    ]
    return header + results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-a", default="http://127.0.0.1:8001")
    parser.add_argument("--server-b", default="http://127.0.0.1:8002")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch-reps", type=int, default=5, help="reps of the 32-query shapes")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--matrix", help="matrix file the parties serve, to check the rows fetched")
    parser.add_argument("--out", help="CSV file to write (default: print only)")
    args = parser.parse_args(argv)
    if args.matrix and not Path(args.matrix).exists():
        parser.error(f"--matrix {args.matrix} does not exist")
    lines = run(args.server_a, args.server_b, args.reps, args.batch_reps, args.warmup,
                args.matrix)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
