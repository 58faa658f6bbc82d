"""Rows/s a client gets from two parties against what the two parties serve together.

    python benchmarks/client_throughput.py --pages 8192 --out docs/benchmarks/cpu_8192_client.csv

Starts parties A and B as `make run` does (morphoweb.devserver: front end, gunicorn, engine
server and bulk workers each, throttle off), then in one run:

- the reference: both parties' batch endpoints driven directly, `--reference-procs` processes per
  party of `--reference-threads` keep-alive connections each, every request a full binary batch
  of fresh keys (one row costs one query at each party); rows/s is the slower party's queries/s;
- the client: one process fetching `--rows` random rows with PirClient (sync) and AsyncPirClient
  over each `--in-flight` value, every row checked against the matrix file.

The CSV has one line per point (`ratio` = rows/s over the reference of its key format); with
`--plot` a PNG of rows/s against requests in flight, the reference as a line.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import multiprocessing
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.report import cpu_model, pyplot, read_csv, write_csv  # noqa: E402
from morpho_client import AsyncPirClient, PirClient, PirError  # noqa: E402
from morpho_client.plan import plan_window  # noqa: E402
from morpho_client.planners import auto_planners  # noqa: E402
from morpho_pir.dpf import format_by_name  # noqa: E402
from morpho_pir.http import BATCH_PATH, OCTET_STREAM  # noqa: E402
from morpho_pir.protocol import MAX_BATCH_QUERIES, ROW_BYTES, ROWS_PER_PAGE  # noqa: E402
from morphoweb.devserver import demo_matrix  # noqa: E402
from morphoweb.partyprocs import free_port, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIELDS = ["pages", "key_format", "client", "in_flight", "rows", "seconds", "rows_per_s",
          "reference_rows_per_s", "ratio", "failed"]
BODIES_PER_WORKER = 8  # distinct request bodies each reference connection cycles through


# -- the parties ------------------------------------------------------------------------------

def start_parties(pages: int, folder: Path, web_workers: Optional[int], gpus=(None, None)):
    """`python -m morphoweb.devserver` over a fresh state folder, each party on its GPU of
    `gpus` where given (`make run GPU_A= GPU_B=`); (process, url A, url B)."""
    folder.mkdir(parents=True, exist_ok=True)
    ports = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env.update(MORPHO_VAR_DIR=str(folder), MORPHO_QUERY_THROTTLE="off",
               MORPHO_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    log = open(folder / "devserver.log", "ab")  # noqa: SIM115 - the child keeps its own copy
    workers = ["--web-workers", str(web_workers)] if web_workers else []
    for name, gpu in zip("ab", gpus):
        workers += [f"--gpu-{name}", gpu] if gpu is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "morphoweb.devserver", "--pages", str(pages),
         "--port-a", str(ports[0]), "--port-b", str(ports[1]), *workers],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_healthy(url, {"devserver": proc}, timeout=1200, interval=0.5)
    except BaseException:
        stop_parties(proc)
        print((folder / "devserver.log").read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    return proc, urls[0], urls[1], demo_matrix(folder, pages)


def stop_parties(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the devserver stops its children, one signal each
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the reference --------------------------------------------------------------------------------

def _drive(url: str, bodies: list, threads: int, seconds: float, ready, go, queue) -> None:
    """One reference process: `threads` keep-alive connections posting `bodies` in turn, from
    when every process is ready (`go`) for `seconds`."""
    host, port = url.removeprefix("http://").split(":")
    counts = [0] * threads
    refused = [0] * threads

    def loop(index: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM}
        go.wait()
        end = time.monotonic() + seconds
        turn = index
        while time.monotonic() < end:
            body = bodies[turn % len(bodies)]
            conn.request("POST", BATCH_PATH, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            if response.status in (429, 503):  # busy: as a client would, after Retry-After
                refused[index] += 1
                time.sleep(min(float(response.getheader("Retry-After") or 0.05), 0.05))
                continue
            if response.status != 200:
                raise RuntimeError(f"{url}: HTTP {response.status}: {payload[:200]!r}")
            counts[index] += MAX_BATCH_QUERIES
            turn += 1
        conn.close()

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    ready.put(url)
    for worker in workers:
        worker.join()
    queue.put((url, sum(counts), sum(refused)))


def reference(urls, num_pages: int, domain_bits: int, key_format: str, procs: int, threads: int,
              seconds: float) -> float:
    """Rows/s both parties serve together: the slower party's queries/s, both driven at once."""
    context = multiprocessing.get_context("spawn")
    queue, ready, go = context.Queue(), context.Queue(), context.Event()
    workers = []
    for party, url in enumerate(urls):
        for _ in range(procs):
            rows = np.random.default_rng().integers(
                0, num_pages * ROWS_PER_PAGE, BODIES_PER_WORKER * MAX_BATCH_QUERIES)
            window = plan_window(rows, num_pages, domain_bits, format_by_name(key_format))
            bodies = [window.body(party, i, i + MAX_BATCH_QUERIES)
                      for i in range(0, len(window), MAX_BATCH_QUERIES)]
            worker = context.Process(target=_drive,
                                     args=(url, bodies, threads, seconds, ready, go, queue))
            worker.start()
            workers.append(worker)
    for _ in workers:  # every process imported and its threads started: all drive at once
        ready.get(timeout=600)
    go.set()
    totals = {url: 0 for url in urls}
    busy = 0
    for _ in workers:
        url, count, refused = queue.get(timeout=seconds + 600)
        totals[url] += count
        busy += refused
    if busy:
        print(f"  reference: {busy} requests refused as busy (503/429), sent again", flush=True)
    for worker in workers:
        worker.join()
    return min(totals.values()) / seconds


# -- the client -----------------------------------------------------------------------------------

def check_rows(matrix: np.memmap, rows: list, got: list) -> None:
    want = matrix[np.asarray(rows)].tobytes()
    if b"".join(got) != want:
        bad = next(i for i, (r, g) in enumerate(zip(rows, got))
                   if g != matrix[r].tobytes())
        raise AssertionError(f"row {rows[bad]} came back wrong")


def time_sync(urls, rows, key_format: str, in_flight: int,
              planners: Optional[int]) -> tuple[float, list]:
    with PirClient(*urls, key_format=key_format, in_flight=in_flight, planners=planners) as client:
        client.epoch()
        started = time.perf_counter()
        got = client.fetch_rows(rows)
        return time.perf_counter() - started, got


def time_async(urls, rows, key_format: str, in_flight: int,
               planners: Optional[int]) -> tuple[float, list]:
    async def run():
        async with AsyncPirClient(*urls, key_format=key_format, in_flight=in_flight,
                                  planners=planners) as client:
            await client.epoch()
            started = time.perf_counter()
            got = await client.fetch_rows(rows)
            return time.perf_counter() - started, got
    return asyncio.run(run())


def plot(csv_path: Path, png: Path) -> None:
    header, lines = read_csv(csv_path)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (pages, key_format), colour in zip(
            sorted({(int(r["pages"]), r["key_format"]) for r in lines}),
            ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]):
        mine = [r for r in lines if (int(r["pages"]), r["key_format"]) == (pages, key_format)]
        for client, style in (("sync", "-o"), ("async", "--s")):
            points = sorted((int(r["in_flight"]), float(r["rows_per_s"]))
                            for r in mine if r["client"] == client and r["rows_per_s"])
            if points:
                ax.plot(*zip(*points), style, color=colour,
                        label=f"{pages:,} pages, {key_format}, {client}")
        ax.axhline(float(mine[0]["reference_rows_per_s"]), color=colour, linestyle=":",
                   label=f"{pages:,} pages, {key_format}: both parties driven directly")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch requests in flight at each party")
    ax.set_ylabel("rows/s")
    ax.set_title(f"morpho-client rows/s, {header.get('machine', '')[:60]}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4096, help="rows per client point")
    parser.add_argument("--in-flight", default="1,2,4,8,16,32")
    parser.add_argument("--key-formats", default="v2,v1")
    parser.add_argument("--clients", default="sync,async")
    parser.add_argument("--reference-seconds", type=float, default=10.0)
    parser.add_argument("--reference-procs", type=int, default=2, help="processes per party")
    parser.add_argument("--reference-threads", type=int, default=8, help="connections each")
    parser.add_argument("--web-workers", type=int, default=None,
                        help="gunicorn processes per party (default: devserver's)")
    parser.add_argument("--planners", type=int, default=None,
                        help="the client's key-making processes (default: its own choice)")
    parser.add_argument("--gpus", default=None, metavar="A,B",
                        help="party A's and party B's GPU (make run's GPU_A and GPU_B), e.g. 0,1; "
                             "default: both on the host's first")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/client-throughput"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="PNG of rows/s against requests in flight")
    parser.add_argument("--plot-only", action="store_true", help="plot --out's CSV and stop")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(args.out, args.plot)
        return 0
    gpus = tuple(args.gpus.split(",")) if args.gpus else (None, None)
    if len(gpus) != 2:
        parser.error(f"--gpus: expected party A's GPU and party B's, e.g. 0,1, got {args.gpus!r}")
    proc, url_a, url_b, matrix_path = start_parties(args.pages, args.folder, args.web_workers,
                                                    gpus)
    urls = (url_a, url_b)
    lines = []
    try:
        with PirClient(*urls) as client:
            info = client.epoch()
            health = client.health()
        matrix = np.memmap(matrix_path, dtype=np.uint8, mode="r").reshape(-1, ROW_BYTES)
        rng = np.random.default_rng(7)
        for key_format in args.key_formats.split(","):
            ref = reference(urls, info.num_pages, info.domain_bits, key_format,
                            args.reference_procs, args.reference_threads, args.reference_seconds)
            print(f"{args.pages} pages, {key_format}: reference {ref:,.0f} rows/s", flush=True)
            for in_flight in [int(x) for x in args.in_flight.split(",")]:
                for kind in args.clients.split(","):
                    rows = rng.integers(0, info.num_rows, args.rows).tolist()
                    timer = time_sync if kind == "sync" else time_async
                    try:
                        seconds, got = timer(urls, rows, key_format, in_flight, args.planners)
                    except PirError as exc:  # the parties refused past the client's deadline
                        print(f"  {kind:5} in flight {in_flight:2}: failed: {exc}", flush=True)
                        lines.append(dict(pages=args.pages, key_format=key_format, client=kind,
                                          in_flight=in_flight, rows=len(rows),
                                          reference_rows_per_s=f"{ref:.0f}",
                                          failed=str(exc)[:200]))
                        continue
                    check_rows(matrix, rows, got)
                    rate = len(rows) / seconds
                    ratio = rate / ref if ref else float("nan")
                    print(f"  {kind:5} in flight {in_flight:2}: {rate:9,.0f} rows/s "
                          f"({ratio:.2f} of the reference)", flush=True)
                    lines.append(dict(pages=args.pages, key_format=key_format, client=kind,
                                      in_flight=in_flight, rows=len(rows),
                                      seconds=f"{seconds:.3f}", rows_per_s=f"{rate:.0f}",
                                      reference_rows_per_s=f"{ref:.0f}", ratio=f"{ratio:.3f}"))
    finally:
        stop_parties(proc)
    planners = args.planners if args.planners is not None else auto_planners()
    backend = health[0].get("backend", "?")
    device = " and ".join(dict.fromkeys(  # both parties' devices, once where they are one
        str(h.get("device") or h.get("device_name") or "") for h in health))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    write_csv(args.out, [
        f"# machine: {platform.node()}; {cpu_model()}; {os.cpu_count()} CPUs; backend {backend} "
        f"{device}; python {platform.python_version()}; load average {load} at the end",
        f"# shape: {args.pages} pages (domain_bits {info.domain_bits}), both parties of "
        f"`make run` on this host, "
        + (f"party A on GPU {gpus[0]}, party B on GPU {gpus[1]}" if args.gpus else "both on one GPU")
        + f"; reference: {args.reference_procs} processes x "
        f"{args.reference_threads} connections per party for {args.reference_seconds:g} s; "
        f"client: one process and {planners} key-making processes, {args.rows} random rows per "
        "point, every row checked",
        f"# command: python {shlex.join(sys.argv)}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
    ], FIELDS, lines)
    if args.plot:
        plot(args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
