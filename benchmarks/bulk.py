"""Bulk job throughput (submit to last answer stored) against the engine's batch throughput (CSV).

    python3 benchmarks/bulk.py --pages 1024 --queries 10000 --out var/bench/bulk_cpu_1024p.csv
    python3 benchmarks/bulk.py --backend cuda --pages 65536 --out FILE.csv
    python3 benchmarks/bulk.py --engine-only --backend cuda --pages 1048576 --out FILE.csv

Three measurements over one matrix and one set of queries, on the same machine:
`backend_batch` (the backend answering max-batch launches back to back: the ceiling),
`engine_bulk_lane` (the Engine's bulk lane fed two requests ahead, as a worker feeds it), and
`bulk_job_json` and `bulk_job_binary` (a real job on the stack as an operator starts it,
benchmarks/stack.py: POST to gunicorn, SQLite, the filesystem broker, `bin/gpu-workers`
submitting to the engine server, until the job is done; then the results are streamed in the
upload's encoding and every answer is checked).
`--engine-only` runs the first two with numpy (and cupy for `--backend cuda`) only, no Django.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import numpy as np

BASE_DIR = Path(__file__).resolve().parent.parent
# Not an installed package: run from a checkout, the repository root is what must be importable.
sys.path.insert(0, str(BASE_DIR))

from benchmarks.report import cpu_model  # noqa: E402
from benchmarks.stack import Party  # noqa: E402
from gpu_engine.backends import create_backend  # noqa: E402
from morpho_pir.dpf import KeyBatch, gen_keys  # noqa: E402
from gpu_engine.engine import Engine, static_policy  # noqa: E402
from gpu_engine.matrix import load_epoch, write_matrix_file  # noqa: E402
from gpu_engine.scheduler import DEFAULT_POLICIES  # noqa: E402

COLUMNS = "measure,queries,seconds,queries_per_s,ratio_to_engine"
# The default bulk policy, under the benchmark's name.
BULK_POLICY = dataclasses.replace(DEFAULT_POLICIES["bulk"], name="bulk-bench")


def workload(pages: int, queries: int, pool_size: int, seed: int):
    """(pool of keys, picks): each query is three pool keys (key generation is slow in Python)."""
    rng = np.random.default_rng(seed)
    d = max(1, (pages - 1).bit_length())
    pool = [
        gen_keys(int(rng.integers(pages)), d, rng=rng)[int(rng.integers(2))]
        for _ in range(pool_size)
    ]
    return pool, rng.integers(pool_size, size=(queries, 3))


def backend_batch(resident, pool, picks, max_batch: int) -> float:
    """Seconds for the backend to answer every query in launches of max_batch, back to back."""
    resident.answer(KeyBatch.from_keys([pool[i] for i in picks[0]]))  # warm-up
    started = time.perf_counter()
    for first in range(0, len(picks), max_batch):
        resident.answer(
            KeyBatch.from_keys([pool[i] for row in picks[first : first + max_batch] for i in row])
        )
    return time.perf_counter() - started


def engine_bulk_lane(engine, pool, picks, max_batch: int) -> float:
    """Seconds for the Engine's bulk lane to answer everything, fed two requests ahead."""
    started = time.perf_counter()
    pending = set()
    for first in range(0, len(picks), max_batch):
        while len(pending) >= 2:
            _, pending = wait(pending, return_when=FIRST_COMPLETED)
        pending.add(
            engine.submit(
                [[pool[i] for i in row] for row in picks[first : first + max_batch]], "bulk"
            )
        )
    wait(pending)
    for future in pending:
        future.result()
    return time.perf_counter() - started


def bulk_job(party: Party, pool, picks, reference, binary: bool) -> tuple[float, float, dict]:
    """(seconds from POST to the job done, seconds to stream and check the results, the job),
    the queries uploaded as JSON (hex keys) or in the binary encoding (raw keys), and the results
    read back in the same encoding."""
    if binary:
        body = b"".join(pool[i].to_bytes() for row in picks for i in row)
        content_type = "application/octet-stream"
    else:
        body = json.dumps(
            {"queries": [{"keys": [pool[i].to_bytes().hex() for i in row]} for row in picks]}
        ).encode()
        content_type = "application/json"
    started = time.perf_counter()
    job = json.loads(party.request("POST", "/bulk/jobs", body, content_type=content_type).read())
    while job["status"] in ("queued", "running"):
        time.sleep(0.05)  # a poll costs the web process a few ms; the job ends between two
        job = json.loads(party.request("GET", f"/bulk/jobs/{job['id']}").read())
    elapsed = time.perf_counter() - started
    if job["status"] != "done":
        raise SystemExit(f"bulk job ended {job['status']}: {job['errors']}")
    started = time.perf_counter()
    path = f"/bulk/jobs/{job['id']}/results"
    if binary:
        with party.request("GET", path, accept="application/octet-stream") as response:
            answers = response.read()
        size = 3 * len(reference[0])
        if len(answers) != len(picks) * size:
            raise SystemExit(f"{len(answers)} result bytes for {len(picks)} queries")
        for index, row in enumerate(picks):
            if answers[index * size:(index + 1) * size] != b"".join(reference[i] for i in row):
                raise SystemExit(f"answer of query {index} differs from the reference")
        return elapsed, time.perf_counter() - started, job
    count = 0
    with party.request("GET", path) as response:
        for count, line in enumerate(response, start=1):
            answer = json.loads(line)
            row = picks[answer["index"]]
            if [bytes.fromhex(p[2:]) for p in answer["pages"]] != [reference[i] for i in row]:
                raise SystemExit(f"answer of query {answer['index']} differs from the reference")
    if count != len(picks):
        raise SystemExit(f"{count} result lines for {len(picks)} queries")
    return elapsed, time.perf_counter() - started, job


class Rows(list):
    """(measure, seconds) rows, each printed as it comes: a run cut short still says what it had."""

    def append(self, row) -> None:
        super().append(row)
        print(f"{row[0]}: {row[1]:.2f} s", flush=True)


def restart_workers(party: Party, concurrency: int, timeout: float = 300) -> None:
    """Start the party's bulk workers again answering `concurrency` chunks at once, and wait
    until Celery says they are ready (a job is not timed through their start)."""
    log = party.folder / "workers.log"
    ready = log.read_text(errors="replace").count(" ready.")
    party.restart("workers", MORPHO_BULK_CONCURRENCY=concurrency)
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count(" ready.") <= ready:
        if time.monotonic() > deadline:
            raise SystemExit(f"the workers did not start again:\n{party.log('workers')}")
        time.sleep(0.2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--pool", type=int, default=64, help="distinct keys the queries draw from")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--engine-only", action="store_true", help="no Django: backend and engine rows"
    )
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--upload", default="json,binary",
                        help="the encodings jobs are uploaded (and read back) in, one job each")
    parser.add_argument("--concurrency", default="",
                        help="chunks a worker answers at once (MORPHO_BULK_CONCURRENCY), comma-"
                             "separated: the jobs again for each (default: bin/gpu-workers' own)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bulk-bench-"))
    matrix = tmp / "matrix.bin"
    write_matrix_file(matrix, args.pages, seed=5)
    epoch = load_epoch(matrix)
    pool, picks = workload(args.pages, args.queries, args.pool, seed=9)
    backend = create_backend(args.backend)
    resident = backend.load(epoch.matrix)
    reference = [page.tobytes() for page in resident.answer(KeyBatch.from_keys(pool))]
    max_batch = BULK_POLICY.max_batch
    rows = Rows()

    def engine_rows(tag: str) -> None:
        seconds = backend_batch(resident, pool, picks, max_batch)
        rows.append((f"backend_batch{tag}", seconds))
        engine = Engine(backend, epoch, policy=static_policy(BULK_POLICY)).start()
        try:
            rows.append(
                (f"engine_bulk_lane{tag}", engine_bulk_lane(engine, pool, picks, max_batch))
            )
        finally:
            engine.stop()

    engine_rows("")
    if not args.engine_only:
        # The engine rows run again after the job, so load from elsewhere shows as a spread.
        party = Party(matrix, tmp / "party", args.backend, web_workers=2, bulk_workers=True,
                      port=args.port)
        concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else [0]
        try:
            for concurrency in concurrencies:
                tag = ""
                if concurrency:  # the workers again, with this many chunks at once
                    restart_workers(party, concurrency)
                    tag = f"_c{concurrency}" if len(concurrencies) > 1 else ""
                for upload in args.upload.split(","):
                    job_s, stream_s, job = bulk_job(party, pool, picks, reference,
                                                    upload == "binary")
                    rows.append((f"bulk_job_{upload}{tag}", job_s))
                    rows.append((f"bulk_results_stream_{upload}{tag}", stream_s))
        finally:
            party.stop()
        engine_rows("_after")
    # The engine's batch throughput: the mean of its runs before and after the job, so load from
    # other processes during the run weighs on both sides alike.
    engine_qps = [
        args.queries / seconds for name, seconds in rows if name.startswith("engine_bulk_lane")
    ]
    engine = sum(engine_qps) / len(engine_qps)

    command = "python3 benchmarks/bulk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        (
            f"# machine: {platform.node()}; {cpu_model()}; {os.cpu_count()} CPUs; load average "
            f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end"
        ),
        (
            f"# shape: pages={args.pages}, domain_bits={epoch.matrix.domain_bits}, "
            f"queries={args.queries} (3 keys each, drawn from {args.pool} distinct keys), "
            f"bulk policy max_batch={max_batch}, backend={backend.name}"
            + ("" if args.engine_only else f", chunk_size={job['chunk_size']}")
        ),
        f"# command: {command}",
        f"# date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        (
            "# bulk_job_<upload>: POST to job done (validation, chunks, Celery filesystem broker, "
            "SQLite, answers in files, one worker node submitting to the engine server), uploaded "
            "as JSON or binary; every streamed answer equals the backend's"
        ),
        (
            "# ratio_to_engine: queries/s over the mean of the engine_bulk_lane runs "
            f"({engine:.1f} queries/s)"
        ),
        COLUMNS,
    ]
    for name, seconds in rows:
        lines.append(
            f"{name},{args.queries},{seconds:.2f},{args.queries / seconds:.1f},"
            f"{args.queries / seconds / engine:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
