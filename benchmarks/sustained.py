"""Batches of Q queries back to back for seconds at a time, as under steady load: the rate the power cap allows.

    python3 benchmarks/sustained.py --backend cuda --pages 16817159 --domain-bits 25 --gpu-matrix \
        --key-format v1 --layout fragments --q 8,32,1,8 --seconds 5 --out FILE.csv

backend_batch.py times 5 batches right after its single-query loop; on a GPU at its power cap that
catches the clock's dip after the loop (an H200 read 31.7-34.4 ms at Q = 8 that way, 28 ms in a
burst after rest). Here each Q runs alone for --seconds: a row gives its first timed batch, the
median of all, and the steady rate (the median of the second half), with the SM clock, the board's
power and the share of samples the power cap held it (nvidia-smi -i on the GPU CuPy runs on, every
100 ms, where there is one). Each Q first answers one batch for each party, untimed: party 0's
answers XOR party 1's must give every query's target page.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.backend_batch import (  # noqa: E402
    add_matrix_arguments, csv_header, make_queries, make_resident, parse_dispatch, parties_xor_to_targets,
    write_csv)
from benchmarks.variant import add_define_argument, apply_defines  # noqa: E402
from gpu_engine.backends import create_backend  # noqa: E402
from morpho_pir.dpf import KeyBatch, format_by_name  # noqa: E402
from gpu_engine.matrix import domain_bits_for  # noqa: E402

CSV_COLUMNS = ("q", "batches", "seconds", "first_ms", "median_ms", "steady_ms", "steady_qps",
               "steady_sm_mhz", "steady_power_w", "steady_power_capped", "answers_ok")
SAMPLE_MS = 100  # nvidia-smi's sampling period (ms)
MIN_BATCHES = 4  # batches a Q runs however long they take, so its steady half holds two at least
POWER_CAP_REASON = 0x4  # clocks_throttle_reasons: the software power cap


def parse_samples(text: str) -> List[tuple]:
    """GpuSampler.QUERY's lines (csv, noheader, nounits) as (epoch s, SM MHz, W, throttle reasons)."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:  # nvidia-smi stamps local time, as datetime reads it
            when = _dt.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, float(fields[1]), float(fields[2]), int(fields[3], 16)))
        except (ValueError, IndexError):
            continue  # a line cut short by terminate(), or a field the GPU does not report ([N/A])
    return samples


class GpuSampler:
    """nvidia-smi sampling the SM clock, power and throttle reasons in the background, read at stop()."""

    QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, gpu: Optional[str]) -> None:
        """Samples GPU `gpu` (a PCI bus id, as nvidia-smi -i takes it), or nothing where it is None."""
        self._proc = None
        self.samples: List[tuple] = []  # (epoch s, SM MHz, W, throttle reasons)
        smi = shutil.which("nvidia-smi")
        if gpu and smi:
            # a file, not a pipe: a pipe left unread fills in about 100 s and stalls the sampling
            self._log = tempfile.TemporaryFile("w+")
            self._proc = subprocess.Popen([smi, "-i", gpu, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                           f"-lms={SAMPLE_MS}"], stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> None:
        """Ends the sampling and reads what it wrote (once; a second call does nothing)."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        self.samples = parse_samples(text)
        if not self.samples:  # the columns come out blank: say why
            print(f"nvidia-smi gave no samples (exit {proc.returncode}): {text.strip()[:300]}", file=sys.stderr)

    def summary(self, start: float, end: float) -> dict:
        """Mean SM clock and power over [start, end] (epoch s), and the share of samples power-capped."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {"steady_sm_mhz": "", "steady_power_w": "", "steady_power_capped": ""}
        return {"steady_sm_mhz": round(statistics.mean(s[1] for s in inside)),
                "steady_power_w": round(statistics.mean(s[2] for s in inside)),
                "steady_power_capped": round(sum(1 for s in inside if s[3] & POWER_CAP_REASON) / len(inside), 2)}


def run_q(resident, page_of, queries, q: int, dispatch, seconds: float) -> tuple:
    """(row without the sampler's columns, the steady half's start and end in epoch s) for one Q."""
    batch0, batch1 = KeyBatch.from_keys(queries.party0), KeyBatch.from_keys(queries.party1)
    answers0, answers1 = resident.answer(batch0, dispatch), resident.answer(batch1, dispatch)  # also the warm-up
    ok = parties_xor_to_targets(answers0, answers1, queries, page_of)
    walls, starts = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(walls) < MIN_BATCHES:
        starts.append(time.time())
        t0 = time.perf_counter()
        resident.answer(batch0, dispatch)
        walls.append((time.perf_counter() - t0) * 1e3)
    steady_ms = statistics.median(walls[len(walls) // 2:])
    row = {"q": q, "batches": len(walls), "seconds": round(sum(walls) / 1e3, 2), "first_ms": round(walls[0], 3),
           "median_ms": round(statistics.median(walls), 3), "steady_ms": round(steady_ms, 3),
           "steady_qps": round(q * 1e3 / steady_ms, 1), "answers_ok": ok}
    return row, (starts[len(walls) // 2], time.time())


def positive_ints(text: str) -> List[int]:
    """'8,32' -> [8, 32]: query counts, each at least 1."""
    try:
        qs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not qs or min(qs) < 1:
        raise argparse.ArgumentTypeError(f"expected query counts of 1 or more, got {text!r}")
    return qs


def positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def cuda_bus_id() -> str:
    """The PCI bus id of the GPU CuPy runs on (what nvidia-smi -i takes; its indices need not match CUDA's)."""
    import cupy

    return cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_matrix_arguments(ap)
    ap.add_argument("--q", type=positive_ints, default="8,32", help="comma-separated query counts, run in this order")
    ap.add_argument("--seconds", type=positive_seconds, default=5.0,
                    help=f"how long each Q runs back to back (s; {MIN_BATCHES} batches at least)")
    ap.add_argument("--dispatch", default="micro_batch=0,streams=1,graph=1", help="micro_batch=..,streams=..,graph=..")
    add_define_argument(ap)
    ap.add_argument("--out", required=True, help="CSV path")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.gpu_matrix and args.backend != "cuda":
        ap.error("--gpu-matrix needs --backend cuda")
    d = domain_bits_for(args.pages, args.domain_bits)
    dispatch = parse_dispatch(args.dispatch)
    apply_defines(args)
    backend = create_backend(args.backend, layout=args.layout)
    resident, page_of = make_resident(backend, args.pages, d, args.seed, args.gpu_matrix, print)
    key_format = format_by_name(args.key_format)
    rng = np.random.default_rng(args.seed)
    sampler = GpuSampler(cuda_bus_id() if args.backend == "cuda" else None)
    rows, windows = [], []
    try:
        for q in args.q:
            row, window = run_q(resident, page_of, make_queries(q, args.pages, d, rng, key_format), q, dispatch,
                                args.seconds)
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
            windows.append(window)
    finally:
        sampler.stop()
        resident.release()
    device = backend.memory_info()["device"]
    header = csv_header(device, args.pages, d, args.backend, dispatch, argv,
                        f"keys={args.key_format}, layout={args.layout}, seconds={args.seconds}", "sustained.py")
    for row, window in zip(rows, windows):
        row.update(sampler.summary(*window))
    write_csv(args.out, header, rows, CSV_COLUMNS)
    return 0 if all(r["answers_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
