"""An atomic epoch switch under load, over one host's devices: every answer checked for its epoch.

    python3 benchmarks/epoch_switch.py --backend cuda --devices 0,1 --pages 16817159 \
        --placement shard --out FILE.csv

An Engine serves epoch 1 (one patterned matrix) placed over --devices; --clients closed-loop
threads each send one query of two keys, both parties' keys for one target page, so the XOR of
the two answers is that page in the epoch the engine says answered it. After --before seconds the
engine loads epoch 2 (another matrix, every page different) beside epoch 1 and swaps between
launches; --switches alternates back and forth. An answer that is not the page of the epoch the
engine says answered it (a launch that mixed epochs, or shards of two epochs) is counted wrong;
there must be none.

Rows, by when a request was sent, one after another from start to end: `before` the first switch
is asked for, `loading_N` while switch N's epoch loads beside the served one, `serving_N` from its
swap to the next switch (or the end), then `all`. Each: requests, answers from each epoch, wrong
answers, refusals, p50/p99 latency and the longest gap between two answers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.placement import patterned_matrix  # noqa: E402
from benchmarks.report import write_csv  # noqa: E402
from morpho_pir.dpf import format_by_name, gen_keys  # noqa: E402
from gpu_engine.engine import Engine  # noqa: E402
from gpu_engine.matrix import ServedEpoch  # noqa: E402
from gpu_engine.placement import Placement, create_device_group, parse_devices  # noqa: E402
from morpho_pir.protocol import KEY_FORMAT_NAMES  # noqa: E402

CSV_COLUMNS = ("phase", "seconds", "requests", "from_epoch_1", "from_epoch_2", "wrong", "refused",
               "qps", "p50_ms", "p99_ms", "max_gap_ms")
KEY_POOL = 256  # distinct targets the clients cycle through


class Client(threading.Thread):
    """Sends one query (party 0's and party 1's key for one target) at a time until told to stop;
    records (sent, answered, epoch_id, right) per answered request, and when each refused one
    was sent."""

    def __init__(self, engine: Engine, pool: list, pages: dict, stop: threading.Event, seed: int):
        super().__init__(daemon=True)
        self.engine, self.pool, self.pages, self.stop = engine, pool, pages, stop
        self.rng = np.random.default_rng(seed)
        self.records: List[tuple] = []
        self.refused: List[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            target, key_a, key_b = self.pool[int(self.rng.integers(len(self.pool)))]
            sent = time.perf_counter()
            try:
                answer = self.engine.submit([[key_a, key_b]]).result(timeout=60)
            except Exception:  # noqa: BLE001 - an overloaded or held engine: counted, not fatal
                self.refused.append(sent)
                time.sleep(0.001)
                continue
            page = (answer.answers[0] ^ answer.answers[1]).tobytes()
            right = page == self.pages[answer.epoch_id](target)
            self.records.append((sent, time.perf_counter(), answer.epoch_id, right))


def phase_row(name: str, records: Sequence[tuple], refused: Sequence[float], start: float,
              end: float) -> dict:
    """The row of requests sent in [start, end)."""
    records = [r for r in records if start <= r[0] < end]
    done = sorted(r[1] for r in records)
    gaps = [b - a for a, b in zip(done, done[1:])]
    lat = sorted((r[1] - r[0]) * 1e3 for r in records)
    return {"phase": name, "seconds": round(end - start, 3), "requests": len(records),
            "from_epoch_1": sum(r[2] == 1 for r in records),
            "from_epoch_2": sum(r[2] == 2 for r in records),
            "wrong": sum(not r[3] for r in records),
            "refused": sum(start <= sent < end for sent in refused),
            "qps": round(len(records) / max(end - start, 1e-9), 1),
            "p50_ms": round(statistics.median(lat), 3) if lat else "",
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else "",
            "max_gap_ms": round(max(gaps) * 1e3, 3) if gaps else ""}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--devices", default="0,1", help="device ids, e.g. 0,1 (default 0,1)")
    ap.add_argument("--pages", type=int, default=1 << 20)
    ap.add_argument("--placement", default="shard", choices=[p.value for p in Placement])
    ap.add_argument("--clients", type=int, default=64, help="closed-loop client threads")
    ap.add_argument("--before", type=float, default=3.0, help="seconds served before the first switch")
    ap.add_argument("--after", type=float, default=3.0, help="seconds served after the last swap "
                    "(1 s after each earlier one)")
    ap.add_argument("--switches", type=int, default=2, help="switches, alternating epochs 2 and 1")
    ap.add_argument("--key-format", choices=KEY_FORMAT_NAMES, default="v1")
    ap.add_argument("--out", required=True, help="CSV path")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    epochs = {e: ServedEpoch(e, patterned_matrix(args.pages, seed=e, domain_bits=None),
                             placement=args.placement) for e in (1, 2)}
    domain_bits = epochs[1].matrix.domain_bits
    log(f"two matrices of {args.pages} pages (d={domain_bits}) in {time.perf_counter() - t0:.1f} s")
    group = create_device_group(args.backend, parse_devices(args.devices))
    t0 = time.perf_counter()
    engine = Engine(group, epochs[1]).start()
    log(f"epoch 1 placed ({engine.placement}) in "
        f"{time.perf_counter() - t0:.1f} s; {group.memory_info()}")
    engine.warm_up().result()
    rng = np.random.default_rng(7)
    key_format = format_by_name(args.key_format)
    pool = []
    for target in rng.integers(0, args.pages, KEY_POOL):
        key_a, key_b = gen_keys(int(target), domain_bits, rng, key_format=key_format)
        pool.append((int(target), key_a, key_b))
    pages = {e: epochs[e].matrix.page for e in epochs}
    stop = threading.Event()
    clients = [Client(engine, pool, pages, stop, seed) for seed in range(args.clients)]
    started = time.perf_counter()
    for client in clients:
        client.start()
    time.sleep(args.before)
    windows = []  # (asked, swapped) of each switch
    for n in range(args.switches):
        target_epoch = epochs[2 if n % 2 == 0 else 1]
        asked = time.perf_counter()
        engine.switch_epoch(target_epoch).result()
        windows.append((asked, time.perf_counter()))
        log(f"switch {n + 1} to epoch {target_epoch.epoch_id}: {windows[-1][1] - asked:.2f} s "
            f"from asking to serving it")
        time.sleep(args.after if n == args.switches - 1 else 1.0)
    stop.set()
    for client in clients:
        client.join()
    ended = time.perf_counter()
    engine.stop()
    records = [r for c in clients for r in c.records]
    refused = [sent for c in clients for sent in c.refused]
    # consecutive phases from start to end, so the rows before `all` add up to it
    edges = [("before", started)]
    for n, (asked, swapped) in enumerate(windows):
        edges += [(f"loading_{n + 1}", asked), (f"serving_{n + 1}", swapped)]
    edges.append(("", ended))
    rows = [phase_row(name, records, refused, start, end)
            for (name, start), (_, end) in zip(edges, edges[1:])]
    rows.append(phase_row("all", records, refused, started, ended))
    for row in rows:
        log("  " + "  ".join(f"{k}={row[k]}" for k in CSV_COLUMNS))
    write_csv(args.out, [
        f"# gpu: {group.memory_info()['device']}",
        f"# shape: pages={args.pages}, domain_bits={domain_bits}, placement={args.placement}, "
        f"devices={args.devices}, clients={args.clients}, keys={args.key_format}",
        "# switches (s from asking to serving): " + ", ".join(f"{b - a:.2f}" for a, b in windows),
        "# command: python3 benchmarks/epoch_switch.py " + " ".join(argv),
        "# date: " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    ], CSV_COLUMNS, rows)
    wrong = rows[-1]["wrong"]
    if wrong:
        log(f"CHECK FAILED: {wrong} answers were not the page of the epoch that answered them")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
