"""Backend benchmark: Q queries one by one vs as one batch, with answers checked; writes a CSV.

    python3 benchmarks/backend_batch.py --backend cuda --pages 65536 --domain-bits 16 \
        --q 1,2,4,8,16,32 --repeat 9 --dispatch micro_batch=0,streams=1,graph=1 \
        --out FILE.csv

Runs with numpy (+ cupy for --backend cuda) only. Every timed batch is checked twice: the
single-query answers must equal the batch answers byte for byte, and party 0's answers XOR
party 1's must give each query's target page (the check that needs no reference backend).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.variant import add_define_argument, apply_defines  # noqa: E402
from gpu_engine.backends import DispatchShape, create_backend  # noqa: E402
from gpu_engine.backends.cuda_plan import LAYOUT_CHOICES, V2_SCANS  # noqa: E402
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, KeyBatch, format_by_name, gen_keys  # noqa: E402
from gpu_engine.matrix import domain_bits_for, random_matrix  # noqa: E402
from morpho_pir.protocol import KEY_FORMAT_NAMES, KEYS_PER_QUERY  # noqa: E402

CSV_COLUMNS = ("q", "single_ms_per_batch", "batch_ms_per_batch", "batch_vs_single_speedup",
               "single_qps", "batch_qps", "checksum_match")


@dataclass
class Queries:
    targets: List[int]  # 3Q target pages, query-major
    party0: List  # 3Q DpfKey
    party1: List


def make_queries(q: int, num_pages: int, domain_bits: int, rng: np.random.Generator,
                 key_format: int = KEY_FORMAT_V1) -> Queries:
    targets = [int(t) for t in rng.integers(0, num_pages, size=KEYS_PER_QUERY * q)]
    pairs = [gen_keys(t, domain_bits, rng=rng, key_format=key_format) for t in targets]
    return Queries(targets, [a for a, _ in pairs], [b for _, b in pairs])


def parse_dispatch(text: str) -> DispatchShape:
    """'micro_batch=0,streams=1,graph=0' (any subset) -> DispatchShape."""
    fields = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in ("micro_batch", "streams", "graph"):
            raise ValueError(f"unknown dispatch field {name!r} in {text!r}")
        fields[name] = int(value)
    if "graph" in fields:
        fields["graph"] = bool(fields["graph"])
    return DispatchShape(**fields)


def dispatch_tag(d: DispatchShape) -> str:
    return f"mb{d.micro_batch}-s{d.streams}-g{int(d.graph)}"


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parties_xor_to_targets(answers0, answers1, queries: Queries, page_of: Callable[[int], bytes]) -> bool:
    """Whether party 0's answer XOR party 1's gives each query's target page."""
    return all((answers0[i] ^ answers1[i]).tobytes() == page_of(t) for i, t in enumerate(queries.targets))


def bench_q(resident, page_of: Callable[[int], bytes], queries: Queries, q: int,
            dispatch: DispatchShape, repeat: int, log: Callable[[str], None]) -> dict:
    """One CSV row: the single-query loop and the batch, each timed `repeat` times (median)."""
    batch0 = KeyBatch.from_keys(queries.party0)
    batch1 = KeyBatch.from_keys(queries.party1)
    singles = [KeyBatch.from_keys(queries.party0[i * KEYS_PER_QUERY : (i + 1) * KEYS_PER_QUERY])
               for i in range(q)]
    # warm-up: compiles kernels, allocates buffers, captures graphs for both launch shapes
    resident.answer(singles[0], dispatch)
    answers0 = resident.answer(batch0, dispatch)
    answers1 = resident.answer(batch1, dispatch)
    xor_ok = parties_xor_to_targets(answers0, answers1, queries, page_of)
    single_answers = np.concatenate([resident.answer(s, dispatch) for s in singles])
    same = hashlib.sha256(single_answers.tobytes()).digest() == hashlib.sha256(answers0.tobytes()).digest()
    single_ms = _median_ms(lambda: [resident.answer(s, dispatch) for s in singles], repeat)
    batch_ms = _median_ms(lambda: resident.answer(batch0, dispatch), repeat)
    if not (xor_ok and same):
        log(f"CHECK FAILED q={q}: parties_xor_to_target={xor_ok} single_equals_batch={same}")
    return {
        "q": q,
        "single_ms_per_batch": round(single_ms, 4),
        "batch_ms_per_batch": round(batch_ms, 4),
        "batch_vs_single_speedup": round(single_ms / batch_ms, 3),
        "single_qps": round(q / single_ms * 1e3, 2),
        "batch_qps": round(q / batch_ms * 1e3, 2),
        "checksum_match": bool(xor_ok and same),
    }


def write_csv(path: str, header: Sequence[str], rows: Sequence[dict],
              columns: Sequence[str] = CSV_COLUMNS) -> None:
    with open(path, "w") as fh:
        for line in header:
            fh.write(f"# {line}\n")
        fh.write(", ".join(columns) + "\n")
        for row in rows:
            fh.write(", ".join(str(row[c]) for c in columns) + "\n")


def csv_header(device: str, pages: int, domain_bits: int, backend: str, dispatch: DispatchShape,
               argv: Sequence[str], extra: str = "", script: str = "backend_batch.py") -> List[str]:
    return [
        f"gpu: {device}",
        f"shape: pages={pages}, domain_bits={domain_bits}",
        f"backend: {backend}",
        f"dispatch: micro_batch={dispatch.micro_batch}, streams={dispatch.streams}, graph={dispatch.graph}"
        + (f"; {extra}" if extra else ""),
        f"command: python3 benchmarks/{script} " + " ".join(shlex.quote(a) for a in argv),
        "date: " + _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    ]


def make_resident(backend, pages: int, domain_bits: int, seed: int, on_device: bool, log):
    """(resident, page_of): a seeded random matrix, generated in GPU memory when on_device."""
    t0 = time.perf_counter()
    if on_device:
        from gpu_engine.backends.cuda_module import fill_reference

        resident = backend.generate(pages, seed, domain_bits)
        # the host formula of the generated words: a check that reads nothing back from the GPU
        page_of = lambda page: fill_reference(page * 512, 512, seed).astype("<u4").tobytes()  # noqa: E731
    else:
        matrix = random_matrix(pages, seed, domain_bits)
        resident = backend.load(matrix)
        page_of = matrix.page
    log(f"matrix ready: {pages} pages, d={resident.domain_bits}, {time.perf_counter() - t0:.1f} s "
        f"({'generated on the GPU' if on_device else 'uploaded from host'})")
    return resident, page_of


def run(resident, page_of, pages: int, domain_bits: int, qs: Sequence[int], dispatch: DispatchShape,
        repeat: int, seed: int, log: Callable[[str], None], key_format: int = KEY_FORMAT_V1) -> List[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for q in qs:
        queries = make_queries(q, pages, domain_bits, rng, key_format)
        row = bench_q(resident, page_of, queries, q, dispatch, repeat, log)
        log("  " + "  ".join(f"{k}={row[k]}" for k in CSV_COLUMNS))
        rows.append(row)
    return rows


def add_matrix_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that say which backend, matrix and keys a benchmark runs (backend_batch.py, sustained.py)."""
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--pages", type=int, default=65536)
    ap.add_argument("--domain-bits", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gpu-matrix", action="store_true", help="generate the matrix in GPU memory (cuda)")
    ap.add_argument("--key-format", choices=KEY_FORMAT_NAMES, default="v1", help="docs/PROTOCOL.md 3, 3.1")
    ap.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto",
                    help="cuda: how the matrix is stored (fragments: both key formats on the tensor "
                         "cores; auto: the server's default, by the GPU)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_matrix_arguments(ap)
    ap.add_argument("--q", default="1,2,4,8,16,32", help="comma-separated query counts")
    ap.add_argument("--dispatch", action="append", default=None,
                    help="micro_batch=..,streams=..,graph=.. (repeatable: one CSV each, tag appended)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--max-group-keys", type=int, default=None, help="cuda: keys per block, at most")
    ap.add_argument("--chunk-levels", type=int, default=None, help="cuda: log2 pages per expanded chunk")
    ap.add_argument("--v2-scan", choices=V2_SCANS, default=None,
                    help="cuda, v2 keys: by batch size (the default where the GPU has tensor cores), "
                         "tensor cores, or the ALU")
    ap.add_argument("--wgmma", choices=("auto", "on", "off"), default="auto",
                    help="cuda, fragments layout: Hopper's warpgroup products (auto: on sm_90) or mma.sync")
    ap.add_argument("--mma-chunks", type=int, default=None,
                    help="cuda, v2 on the tensor cores: chunks of 1024 pages a block (default: the plan's)")
    add_define_argument(ap)
    ap.add_argument("--out", required=True, help="CSV path")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.gpu_matrix and args.backend != "cuda":
        ap.error("--gpu-matrix needs --backend cuda")

    d = domain_bits_for(args.pages, args.domain_bits)
    qs = [int(x) for x in args.q.split(",") if x]
    dispatches = [parse_dispatch(t) for t in (args.dispatch or ["micro_batch=0,streams=1,graph=0"])]
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    apply_defines(args)
    if args.wgmma == "auto":
        backend = create_backend(args.backend, layout=args.layout)
    else:
        from gpu_engine.backends.cuda import CudaBackend

        backend = CudaBackend(layout=args.layout, wgmma=args.wgmma == "on")
    resident, page_of = make_resident(backend, args.pages, d, args.seed, args.gpu_matrix, log)
    extra = [f"-D{define}" for define in args.define]
    if args.max_group_keys:
        resident.max_group_keys = args.max_group_keys
        extra.append(f"max_group_keys={args.max_group_keys}")
    if args.chunk_levels:
        resident.chunk_levels = args.chunk_levels
        extra.append(f"chunk_levels={args.chunk_levels}")
    key_format = format_by_name(args.key_format)
    extra.append(f"keys={args.key_format}")
    layout = getattr(backend, "layout", "pages")
    extra.append(f"layout={layout}" + (f" ({backend.layout_reason})" if args.layout == "auto" else ""))
    if getattr(backend, "wgmma", False):
        extra.append("wgmma")
    if key_format == KEY_FORMAT_V2 and args.backend == "cuda":
        if args.v2_scan:
            resident.v2_scan = args.v2_scan
        extra.append(f"scan={resident.v2_scan}")
        if args.mma_chunks:
            resident.mma_chunks_per_block = args.mma_chunks
            extra.append(f"mma_chunks={args.mma_chunks}")
    device = backend.memory_info()["device"]
    ok = True
    for dispatch in dispatches:
        log(f"{args.backend} {device} pages={args.pages} d={d} dispatch={dispatch_tag(dispatch)}")
        rows = run(resident, page_of, args.pages, d, qs, dispatch, args.repeat, args.seed, log, key_format)
        out = args.out if len(dispatches) == 1 else args.out.replace(".csv", f"-{dispatch_tag(dispatch)}.csv")
        header = csv_header(device, args.pages, d, args.backend, dispatch, argv, ", ".join(extra))
        write_csv(out, header, rows)
        ok &= all(r["checksum_match"] for r in rows)
    resident.release()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
