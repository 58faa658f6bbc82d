"""HTTP through the real stack against the engine alone, on one matrix, in one run (the HTTP figures).

    python3 benchmarks/http_vs_engine.py --backend cuda --pages 65536,1048576 --bulk \
        --out FILE.csv

Per matrix: the engine's own capacity (full 32-query batches back to back on the backend, in this
process); then a party started as an operator starts it (`manage.py serve_engine`, multi-process
gunicorn, `bin/gpu-workers`, see benchmarks/stack.py) and driven by client processes apart from
it: the first 1,000 single queries after ready (cold start), closed-loop single queries from 64
clients, closed-loop 32-query batches in JSON and in the binary encoding, and with --bulk a
10,000-query bulk job and the interactive p95 at 50% load with and without a bulk job running. Every HTTP figure is a ratio to
the engine figure of the same run. Answers over HTTP are checked against the backend's first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.http_load import Load, closed_loop, poisson  # noqa: E402
from benchmarks.placement import throughput_qps  # noqa: E402
from benchmarks.report import cpu_model, write_csv  # noqa: E402
from benchmarks.stack import Party  # noqa: E402
from gpu_engine.backends import create_backend  # noqa: E402
from morpho_pir.dpf import random_keys  # noqa: E402
from gpu_engine.matrix import ServedEpoch, load_matrix, write_epoch_metadata, write_matrix_file  # noqa: E402
from gpu_engine.placement import create_device_group, load_placed, parse_devices  # noqa: E402
from morpho_pir.protocol import PAGE_BYTES  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY as KEYS  # noqa: E402
from gpu_engine.remote import RemoteEngine  # noqa: E402

PROFILE_SECONDS = 6  # py-spy's sampling time within a 10 s closed loop (s)
PROFILE_RATE = 200  # py-spy's samples per second
COLUMNS = ("pages", "domain_bits", "figure", "http_qps", "engine_qps", "ratio", "p50_ms",
           "p95_ms", "p99_ms", "non_200", "note")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def engine_capacity(backend_name: str, matrix_path: Path, rng,
                    devices: tuple = ()) -> tuple[float, float, dict]:
    """(q/s of 32-query batches, as many started as the engine keeps in flight (two per device),
    as the engine runs full batches; ms of one query; {key hex: answer}) on the backend, over
    `devices` placed as the engine server places the epoch (auto) where several are named."""
    if len(devices) > 1:
        backend = create_device_group(backend_name, devices)
    else:
        backend = create_backend(backend_name, device=devices[0] if devices else None)
    matrix = load_matrix(matrix_path)
    resident = load_placed(backend, ServedEpoch(0, matrix))
    d = matrix.domain_bits
    try:
        full = random_keys(32 * KEYS, d, rng)
        one = random_keys(KEYS, d, rng)
        for _ in range(3):
            resident.answer(full)
            resident.answer(one)
        reps = 20
        batch_qps = throughput_qps(resident, full, 32, seconds=3.0)
        started = time.perf_counter()
        for _ in range(reps):
            resident.answer(one)
        single_s = (time.perf_counter() - started) / reps
        check = random_keys(4 * KEYS, d, rng)
        answers = resident.answer(check)
        raw = check.to_bytes()
        size = len(raw) // len(check)
        expected = {raw[i * size:(i + 1) * size].hex(): answers[i].tobytes() for i in range(len(check))}
    finally:
        resident.release()
    return batch_qps, single_s * 1e3, expected


def bodies(d: int, queries_per_body: int, count: int, rng) -> list[bytes]:
    out = []
    for _ in range(count):
        raw = random_keys(queries_per_body * KEYS, d, rng).to_bytes()
        size = len(raw) // (queries_per_body * KEYS)
        keys = ["0x" + raw[i * size:(i + 1) * size].hex() for i in range(queries_per_body * KEYS)]
        queries = [{"keys": keys[i * KEYS:(i + 1) * KEYS]} for i in range(queries_per_body)]
        body = {"keys": queries[0]["keys"]} if queries_per_body == 1 else {"queries": queries}
        out.append(json.dumps(body).encode())
    return out


def binary_bodies(d: int, queries_per_body: int, count: int, rng) -> list[bytes]:
    """Request bodies in the binary encoding: the keys' raw bytes, three per query."""
    return [random_keys(queries_per_body * KEYS, d, rng).to_bytes() for _ in range(count)]


def check_answers(party: Party, expected: dict) -> None:
    keys = list(expected)
    for i in range(0, len(keys), KEYS):
        group = keys[i:i + KEYS]
        body = party.json("POST", "/query/page/gpu", {"keys": group})
        for key, page in zip(group, body["pages"]):
            if bytes.fromhex(page[2:]) != expected[key]:
                raise SystemExit("an HTTP answer differs from the backend's answer for the same key")
    log(f"  {len(keys)} HTTP answers equal the backend's")


def row(pages, d, figure, load: Load | None = None, engine=None, scale=1, note="", http=None):
    http_qps = http if http is not None else (load.rate() * scale if load else None)
    non_200 = sum(c for s, c in load.statuses.items() if s != 200) if load else ""
    quant = (lambda q: round(load.quantile(q) * 1e3, 2)) if load and load.latencies else (lambda q: "")
    return {"pages": pages, "domain_bits": d, "figure": figure,
            "http_qps": "" if http_qps is None else round(http_qps, 1),
            "engine_qps": "" if engine is None else round(engine, 1),
            "ratio": round(http_qps / engine, 3) if http_qps is not None and engine else "",
            "p50_ms": quant(0.50), "p95_ms": quant(0.95), "p99_ms": quant(0.99),
            "non_200": non_200, "note": note}


def gpu_processes() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def mapped_by(pids: list[int], path: Path) -> list[int]:
    """The pids among `pids` that have `path` mapped (or open), from /proc."""
    holders = []
    for pid in pids:
        try:
            if str(path) in Path(f"/proc/{pid}/maps").read_text():
                holders.append(pid)
        except OSError:
            pass
    return holders


def bulk_job(party: Party, d: int, queries: int, rng, wait: bool = True,
             binary: bool = False) -> tuple[dict, float, float]:
    """(the job, seconds from POST to done, seconds the POST took) of a job of random queries,
    uploaded as JSON (hex keys) or in the binary encoding (raw keys)."""
    raw = random_keys(queries * KEYS, d, rng).to_bytes()
    if binary:
        body, content_type = raw, "application/octet-stream"
    else:
        size = len(raw) // (queries * KEYS)
        hexes = [raw[i * size:(i + 1) * size].hex() for i in range(queries * KEYS)]
        body = json.dumps({"queries": [{"keys": hexes[i * KEYS:(i + 1) * KEYS]}
                                       for i in range(queries)]}).encode()
        content_type = "application/json"
    started = time.perf_counter()
    with party.request("POST", "/bulk/jobs", body, content_type=content_type) as response:
        job = json.loads(response.read())
    posted = time.perf_counter() - started
    while wait and job["status"] in ("queued", "running"):
        time.sleep(0.05)
        job = party.json("GET", f"/bulk/jobs/{job['id']}")
    return job, time.perf_counter() - started, posted


def job_seconds(job: dict) -> float:
    """Seconds from the job's first chunk started to its last answer stored (its own timestamps)."""
    def moment(name: str) -> float:
        return datetime.datetime.fromisoformat(job[name].replace("Z", "+00:00")).timestamp()
    return moment("finished") - moment("started")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def host_busy() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole host so far (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def where_cpu_went(party: Party, run, profile: Optional[Path] = None) -> tuple[Load, str]:
    """Run `run()` (a closed loop) and say what CPU it cost: per request in the web workers and
    the engine server, and how busy the host was (the client processes share it). With
    `profile` (a path prefix), py-spy samples the engine server and one web worker meanwhile."""
    web, engine = party.pids("web"), party.pids("engine")
    web0, engine0, (busy0, total0) = cpu_seconds(web), cpu_seconds(engine), host_busy()
    spies = [] if profile is None else [py_spy(pid, Path(f"{profile}-{name}.txt"), gil)
                                        for name, pid, gil in (("engine", engine[0], True),
                                                               ("web", web[-1], False))]
    load = run()
    for spy in spies:
        spy.wait()
    busy1, total1 = host_busy()
    requests = max(1, sum(load.statuses.values()))
    return load, (f"CPU per request: web {1e3 * (cpu_seconds(web) - web0) / requests:.2f} ms, "
                  f"engine server {1e3 * (cpu_seconds(engine) - engine0) / requests:.2f} ms; "
                  f"host {100 * (busy1 - busy0) / max(1, total1 - total0):.0f}% busy")


def py_spy(pid: int, out: Path, gil: bool) -> subprocess.Popen:
    """py-spy sampling `pid` for PROFILE_SECONDS into a raw (collapsed stacks) file; with `gil`,
    only samples where a thread holds the GIL, so their count over the time says how busy the
    interpreter was."""
    argv = ["py-spy", "record", "-f", "raw", "-r", str(PROFILE_RATE), "-d", str(PROFILE_SECONDS),
            "-o", str(out), "-p", str(pid)] + (["--gil"] if gil else [])
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def engine_lanes(party: Party) -> dict:
    """The engine server's per-lane counters now (its snapshot, as /metrics reads it) and the
    bulk lane's launch cap."""
    client = RemoteEngine(party.env["MORPHO_ENGINE_URL"])
    try:
        client.wait_connected()
        lanes = client.snapshot()["lanes"]
        lanes["bulk"]["launch_cap"] = client.launch_cap("bulk")
        return lanes
    finally:
        client.stop()


def bucket_quantile(before: dict, after: dict, q: float) -> float:
    """The upper bound of the histogram bucket holding the q-quantile of what was added between
    two snapshots of it (seconds; inf past the last bound)."""
    added = [(bound, n1 - n0) for (bound, n1), (_, n0) in zip(after["buckets"], before["buckets"])]
    total = added[-1][1]
    for bound, cumulative in added:
        if cumulative >= q * total:
            return bound
    return float("inf")


def engine_side(before: dict, after: dict) -> str:
    """What the engine saw between two engine_lanes(): the interactive queries' latency inside
    it (arrival to answer, to a histogram bucket) and the bulk launches' size and device time."""
    fast, bulk = (after[lane] for lane in ("interactive", "bulk"))
    launches = bulk["launches"] - before["bulk"]["launches"]
    queries = bulk["queries"] - before["bulk"]["queries"]
    device = bulk["compute"]["sum"] - before["bulk"]["compute"]["sum"]
    p95 = bucket_quantile(before["interactive"]["latency"], fast["latency"], 0.95)
    return (f"engine side: interactive p95 <= {p95 * 1e3:g} ms; bulk {launches} launches of "
            f"{queries / max(1, launches):.1f} queries, {1e3 * device / max(1, launches):.2f} ms "
            f"each (launch cap {bulk['launch_cap']})")


def run_shape(args, pages: int, folder: Path, rng) -> list[dict]:
    matrix = folder / f"matrix-{pages}.bin"
    log(f"== {pages} pages: writing the matrix")
    write_matrix_file(matrix, pages, seed=pages)
    write_epoch_metadata(matrix)
    d = load_matrix(matrix).domain_bits
    capacity, single_ms, expected = engine_capacity(args.backend, matrix, rng, args.devices)
    log(f"  engine alone: {capacity:,.0f} q/s in 32-query batches, one query {single_ms:.2f} ms")
    rows = [row(pages, d, "engine_batch32", engine=capacity, http=capacity,
                note=f"one query alone {single_ms:.3f} ms")]
    party = Party(matrix, folder / f"party-{pages}", args.backend, args.web_workers,
                  bulk_workers=args.bulk, port=args.port,
                  extra_env={"MORPHO_ENGINE_DEVICES": ",".join(map(str, args.devices))})
    try:
        log(f"  party ready in {party.ready_s:.1f} s (engine server start to /health 200)")
        check_answers(party, expected)
        url = party.url
        singles, batches = bodies(d, 1, 256, rng), bodies(d, 32, 16, rng)
        cold = closed_loop(url, "/query/page/gpu", singles, args.client_procs,
                           args.single_clients // args.client_procs, 120, limit=1000)
        rows.append(row(pages, d, "cold_first_1000_singles", cold, capacity,
                        note=f"ready {party.ready_s:.1f} s after serve_engine started"))
        log(f"  first 1000: p99 {cold.quantile(0.99) * 1e3:.1f} ms, statuses {cold.statuses}")
        prefix = f"{args.profile}/{pages}" if args.profile else None
        single, cpu = where_cpu_went(party, lambda: closed_loop(
            url, "/query/page/gpu", singles, args.client_procs,
            args.single_clients // args.client_procs, args.seconds),
            prefix and Path(f"{prefix}-single"))
        rows.append(row(pages, d, f"http_single_{args.single_clients}_clients", single, capacity,
                        note=cpu))
        log(f"  singles: {single.rate():,.0f} q/s ({single.rate() / capacity:.2f}), {single.statuses}")
        batch, cpu = where_cpu_went(party, lambda: closed_loop(
            url, "/query/page/gpu/batch", batches, args.client_procs,
            max(1, args.batch_clients // args.client_procs), args.seconds),
            prefix and Path(f"{prefix}-batch"))
        rows.append(row(pages, d, f"http_batch32_{args.batch_clients}_clients", batch, capacity,
                        scale=32, note=cpu))
        log(f"  batches: {batch.rate() * 32:,.0f} q/s ({batch.rate() * 32 / capacity:.2f}), "
            f"{batch.statuses}")
        raw, cpu = where_cpu_went(party, lambda: closed_loop(
            url, "/query/page/gpu/batch", binary_bodies(d, 32, 16, rng), args.client_procs,
            max(1, args.batch_clients // args.client_procs), args.seconds,
            content_type="application/octet-stream"), prefix and Path(f"{prefix}-binary"))
        rows.append(row(pages, d, f"http_batch32_binary_{args.batch_clients}_clients", raw,
                        capacity, scale=32, note=f"docs/PROTOCOL.md section 5.3 encoding; {cpu}"))
        log(f"  binary batches: {raw.rate() * 32:,.0f} q/s ({raw.rate() * 32 / capacity:.2f}), "
            f"{raw.statuses}")
        health = party.json("GET", "/health")
        holders = mapped_by(party.pids(), matrix)
        rows.append(row(pages, d, "vram_one_matrix", note=(
            f"resident_bytes={health.get('resident_bytes')} matrix_bytes={pages * PAGE_BYTES} "
            f"processes_mapping_matrix={len(holders)} of {len(party.pids())} "
            f"gpu_processes=[{gpu_processes()}]")))
        if args.bulk:
            rows += bulk_rows(args, party, pages, d, capacity, single.rate(), singles, rng)
    finally:
        party.stop()
    return rows


def bulk_rows(args, party, pages, d, capacity, single_qps, singles, rng) -> list[dict]:
    rows = []
    for binary in (False, True):
        job, seconds, posted = bulk_job(party, d, args.bulk_queries, rng, binary=binary)
        bulk_qps = job["answered"] / seconds
        running = job_seconds(job) if job["status"] == "done" else float("nan")
        figure = f"bulk_job_{args.bulk_queries}" + ("_binary" if binary else "")
        rows.append(row(pages, d, figure, engine=capacity, http=bulk_qps, note=(
            f"status={job['status']}; {seconds:.2f} s POST to done, of which the upload "
            f"{posted:.2f} s; first chunk started to done {running:.2f} s = "
            f"{job['answered'] / running:,.0f} q/s ({job['answered'] / running / capacity:.2f})")))
        log(f"  {figure}: {bulk_qps:,.0f} q/s ({bulk_qps / capacity:.2f}) {job['status']}, "
            f"upload {posted:.2f} s, running {running:.2f} s")
    rate = 0.5 * single_qps
    start = engine_lanes(party)
    alone = poisson(party.url, "/query/page/gpu", singles, args.client_procs, rate, args.seconds)
    rows.append(row(pages, d, "interactive_50pct_no_bulk", alone, capacity,
                    note=f"offered {rate:.0f} q/s; {engine_side(start, engine_lanes(party))}"))
    background, _, _ = bulk_job(party, d, args.bulk_queries * 4, rng, wait=False, binary=True)
    time.sleep(1.0)
    start = engine_lanes(party)
    during = poisson(party.url, "/query/page/gpu", singles, args.client_procs, rate, args.seconds)
    seen = engine_side(start, engine_lanes(party))
    state = party.json("GET", f"/bulk/jobs/{background['id']}")
    if state["status"] in ("queued", "running"):
        party.request("DELETE", f"/bulk/jobs/{background['id']}").close()
    p95_ratio = during.quantile(0.95) / alone.quantile(0.95)
    rows.append(row(pages, d, "interactive_50pct_with_bulk", during, capacity,
                    note=f"p95 {p95_ratio:.2f}x without bulk; bulk answered {state['answered']} "
                         f"of {state['total']} meanwhile ({state['status']} at the end); {seen}"))
    log(f"  p95 at 50%: {alone.quantile(0.95) * 1e3:.1f} ms alone, "
        f"{during.quantile(0.95) * 1e3:.1f} ms with bulk ({p95_ratio:.2f}x)")
    return rows


def device_name(backend: str) -> str:
    if backend == "cuda":
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
            return ", ".join(name.strip() for name in names if name.strip())  # one line per GPU
        except (OSError, subprocess.SubprocessError):
            return "cuda"
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--pages", default="65536,1048576")
    parser.add_argument("--seconds", type=float, default=10.0, help="per closed-loop or Poisson run")
    parser.add_argument("--web-workers", type=int, default=max(2, (os.cpu_count() or 4) * 5 // 8))
    parser.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 4) // 4))
    parser.add_argument("--single-clients", type=int, default=64)
    parser.add_argument("--batch-clients", type=int, default=16)
    parser.add_argument("--bulk", action="store_true", help="bulk job and p95 with/without it")
    parser.add_argument("--bulk-queries", type=int, default=10000)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--devices", type=parse_devices, default=(),
                        help="device ids the engine server owns, e.g. 0,1 (MORPHO_ENGINE_DEVICES; "
                             "default: one device, the current one); the engine figure uses the same")
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", help="a folder: py-spy profiles of the engine server and a "
                                          "web worker during each closed loop")
    parser.add_argument("--folder", help="where matrices, databases and logs go (default: a "
                                          "temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(11)
    rows = []
    with tempfile.TemporaryDirectory(prefix="morpho-bench-") as tmp:
        folder = Path(args.folder or tmp)
        for pages in (int(p) for p in args.pages.split(",")):
            rows += run_shape(args, pages, folder, rng)
    write_csv(args.out, [
        f"# machine: {device_name(args.backend)}; host {platform.node()}, {cpu_model()}, "
        f"cpus={os.cpu_count()}; devices {','.join(map(str, args.devices)) or 'the current one'}; "
        f"web workers {args.web_workers} x 8 threads, "
        f"{args.client_procs} client processes",
        "# command: python3 benchmarks/http_vs_engine.py "
        + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    ], COLUMNS, rows)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
