"""One device against several of one host, the same matrix sharded and replicated; answers checked.

    python3 benchmarks/placement.py --backend cuda --devices 0,1 --pages 16817159 --q 1,32 \
        --out FILE.csv

For each placement (`one`: the first device alone; `shard` and `replicate` over every device),
in one run so the ratios compare like with like:
- checked: both parties' answers XOR to each target page (targets on each side of every shard
  boundary), and every placement's answers equal the one device's byte for byte (and the NumPy
  backend's, up to --reference-pages pages);
- latency_ms: the median time of one batch of q queries answered alone (start to answers);
- qps: queries per second with as many batches in flight as the placement keeps (the engine's
  max_in_flight: two per device for replicate, two for shard and one device), over --seconds.
With --backend cpu the devices are simulated (the host's cores shared among them): a smoke run of
the code path, whose ratios say nothing of GPUs.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import statistics
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_engine.backends import create_backend  # noqa: E402
from gpu_engine.backends.cpu import reference_answers  # noqa: E402
from morpho_pir.dpf import KeyBatch, gen_keys  # noqa: E402
from gpu_engine.matrix import WORDS_PER_PAGE, PageMatrix  # noqa: E402
from gpu_engine.placement import Placement, create_device_group, parse_devices, shard_bounds  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY  # noqa: E402

CSV_COLUMNS = ("placement", "devices", "q", "latency_ms", "qps", "latency_vs_one", "qps_vs_one",
               "checked")
FILL_PAGES = 1 << 16  # pages filled per step (256 MiB)
FILL_THREADS = 16  # threads filling steps at once (each holds a 256 MiB temporary)


def patterned_matrix(num_pages: int, seed: int, domain_bits: Optional[int]) -> PageMatrix:
    """Distinct, non-zero pages made fast enough for the mainnet shape (68.9 GB in seconds on
    every core, not the minutes a random generator takes): word i is a multiplicative hash of i
    and the seed."""
    body = np.empty((num_pages, WORDS_PER_PAGE), dtype=np.uint32)
    flat = body.reshape(-1)
    step = FILL_PAGES * WORDS_PER_PAGE
    # NumPy's ufuncs release the GIL: threads fill the steps side by side (at most FILL_THREADS,
    # each with a step-sized temporary)
    with ThreadPoolExecutor(max_workers=min(FILL_THREADS, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda first: fill_words(flat[first:first + step], first, seed),
                      range(0, flat.size, step)))
    return PageMatrix(body, domain_bits=domain_bits)


def fill_words(part: np.ndarray, first: int, seed: int) -> None:
    """Words first.. of the pattern into `part` (u32; a step never crosses a multiple of 2**32
    words, and each 2**32 words take another salt, so no page repeats)."""
    salt = (seed + (first >> 32) * 0x9E3779B9) & 0xFFFFFFFF
    low = first & 0xFFFFFFFF
    np.add(np.arange(low, low + part.size, dtype=np.uint32), np.uint32(salt), out=part)
    part *= np.uint32(2654435761)
    part ^= part >> np.uint32(15)


def batches_for(q: int, matrix: PageMatrix, edges: Sequence[int], rng) -> tuple:
    """(targets, party-0 keys, party-1 keys) of q queries: targets on each side of every boundary
    first, then random pages."""
    wanted = KEYS_PER_QUERY * q
    special = [p for b in edges[1:-1] for p in (b - 1, b)] + [0, matrix.num_pages - 1]
    targets = (special + [int(t) for t in rng.integers(0, matrix.num_pages, wanted)])[:wanted]
    pairs = [gen_keys(t, matrix.domain_bits, rng) for t in targets]
    return targets, KeyBatch.from_keys([a for a, _ in pairs]), KeyBatch.from_keys([b for _, b in pairs])


def latency_ms(resident, keys: KeyBatch, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        resident.answer(keys)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def throughput_qps(resident, keys: KeyBatch, q: int, seconds: float) -> float:
    """Queries per second with resident.max_in_flight batches kept started, as the engine does."""
    in_flight: deque = deque()
    answered, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or answered == 0:
        while len(in_flight) < resident.max_in_flight:
            in_flight.append(resident.start(keys))
        in_flight.popleft().result()
        answered += q
    while in_flight:
        in_flight.popleft().result()
    return answered / (time.perf_counter() - started)


def load(name: str, backend_name: str, ids: List[int], matrix: PageMatrix):
    if name == "one":
        return create_backend(backend_name, device=ids[0]).load(matrix)
    return create_device_group(backend_name, ids).load(matrix, placement=Placement(name))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--devices", default="0,1", help="device ids, e.g. 0,1 (default 0,1)")
    ap.add_argument("--pages", type=int, default=1 << 20)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--q", default="1,32", help="comma-separated queries per batch")
    ap.add_argument("--placements", default="one,shard,replicate")
    ap.add_argument("--repeat", type=int, default=9, help="timed batches per latency (median)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per throughput figure")
    ap.add_argument("--reference-pages", type=int, default=1 << 17,
                    help="check against the NumPy backend up to this many pages")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="CSV path")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    ids = parse_devices(args.devices)
    qs = [int(x) for x in args.q.split(",") if x]
    names = [n for n in args.placements.split(",") if n]
    if names[0] != "one":
        ap.error("--placements must start with one: the other placements are compared with it")
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    matrix = patterned_matrix(args.pages, args.seed, args.domain_bits)
    log(f"matrix: {matrix.num_pages} pages, d={matrix.domain_bits}, {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(args.seed)
    try:  # targets on each side of the boundaries a shard over these devices gets
        edges = shard_bounds(matrix.num_pages, matrix.domain_bits, len(ids))
    except ValueError:
        edges = [0, matrix.num_pages]
    baseline: dict = {}
    rows, ok = [], True
    device_names = create_device_group(args.backend, ids).memory_info()["device"]
    for name in names:
        t0 = time.perf_counter()
        resident = load(name, args.backend, ids, matrix)
        log(f"{name}: loaded in {time.perf_counter() - t0:.1f} s, boundaries "
            f"{getattr(resident, 'bounds', [0, matrix.num_pages])}")
        for q in qs:
            targets, party0, party1 = batches_for(q, matrix, edges, rng) if name == "one" \
                else baseline[q]["queries"]
            answers0, answers1 = resident.answer(party0), resident.answer(party1)
            checked = all((answers0[i] ^ answers1[i]).tobytes() == matrix.page(t)
                          for i, t in enumerate(targets))
            if name == "one":
                if matrix.num_pages <= args.reference_pages:
                    checked &= np.array_equal(answers0, reference_answers(matrix, party0))
                baseline[q] = {"queries": (targets, party0, party1), "answers": answers0}
            else:
                checked &= np.array_equal(answers0, baseline[q]["answers"])
            lat = latency_ms(resident, party0, args.repeat)
            qps = throughput_qps(resident, party0, q, args.seconds)
            if name == "one":
                baseline[q].update(lat=lat, qps=qps)
            row = {"placement": name, "devices": 1 if name == "one" else len(ids), "q": q,
                   "latency_ms": round(lat, 3), "qps": round(qps, 1),
                   "latency_vs_one": round(lat / baseline[q]["lat"], 3),
                   "qps_vs_one": round(qps / baseline[q]["qps"], 3), "checked": checked}
            ok &= checked
            log("  " + "  ".join(f"{k}={row[k]}" for k in CSV_COLUMNS))
            rows.append(row)
        resident.release()
    with open(args.out, "w") as fh:
        for line in (f"gpu: {device_names}",
                     f"shape: pages={matrix.num_pages}, domain_bits={matrix.domain_bits}",
                     f"backend: {args.backend}",
                     "command: python3 benchmarks/placement.py " + " ".join(shlex.quote(a) for a in argv),
                     "date: " + _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")):
            fh.write(f"# {line}\n")
        fh.write(", ".join(CSV_COLUMNS) + "\n")
        for row in rows:
            fh.write(", ".join(str(row[c]) for c in CSV_COLUMNS) + "\n")
    if not ok:
        log("CHECK FAILED: some placement's answers differ (see the checked column)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
