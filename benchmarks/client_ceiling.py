"""The client's own ceiling: rows/s against two stand-in parties that answer at once.

    python benchmarks/client_ceiling.py --out docs/benchmarks/cpu_client_ceiling.csv

Each stand-in party is a process of plain asyncio streams answering /epoch, /health and binary
batch queries with zero pages at once, so what is timed is the client alone: key planning, the
HTTP of its query requests, the XOR. `wire` is the client as shipped (its own keep-alive
connections, morpho_client.wire); `httpx` sends the same queries through httpx's asyncio pool
(what a given `transport=` does). `cpu_us_per_row` is the CPU time of the client's own process
(its event loop and its threads; not its key-making processes) per row: what binds one core, and
a figure a shared machine's load disturbs less than rows/s.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import resource
import shlex
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import cpu_model, write_csv  # noqa: E402
from morpho_client import AsyncPirClient  # noqa: E402
from morpho_pir.dpf import key_length  # noqa: E402
from morpho_pir.http import ANSWER_BYTES  # noqa: E402
from morphoweb.partyprocs import free_port  # noqa: E402

PAGES, DOMAIN_BITS = 65536, 16
FIELDS = ["transport", "planners", "in_flight", "rows", "seconds", "rows_per_s",
          "cpu_us_per_row"]


def serve(port: int) -> None:
    """A stand-in party on `port`: the protocol's shapes, zero pages, no work."""
    epoch = json.dumps({
        "epoch_id": 1, "num_rows": PAGES * 16, "block_number": 0, "state_root": "0x" + "00" * 32,
        "encodings": ["json", "binary"], "key_formats": ["v1", "v2"],
        "page_pir": {"domain_bits": DOMAIN_BITS, "rows_per_page": 16, "num_pages": PAGES,
                     "page_size_bytes": 4096}}).encode()
    query_bytes = 3 * key_length(DOMAIN_BITS, 2)

    async def handle(reader, writer):
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                path = head[0].split(" ")[1]
                length = next((int(h.split(":")[1]) for h in head[1:]
                               if h.lower().startswith("content-length:")), 0)
                body = await reader.readexactly(length)
                if path == "/epoch":
                    out, kind = epoch, "application/json"
                elif path == "/health":
                    out, kind = b'{"status": "ok", "pass_queries": 74}', "application/json"
                else:
                    out, kind = bytes(len(body) // query_bytes * ANSWER_BYTES), "application/octet-stream"
                writer.write((f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n"
                              f"Content-Length: {len(out)}\r\nX-Morpho-Epoch-Id: 1\r\n"
                              f"X-Morpho-State-Updates: 0\r\n"
                              f"X-Morpho-State-Digest: 0x{'00' * 32}\r\n\r\n").encode() + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def fetch(urls, transport: str, in_flight: int, planners: int, rows: list):
    """(seconds, CPU seconds of this process) of one fetch of `rows`, after a first fetch that
    starts the client's key-making processes."""
    given = httpx.AsyncHTTPTransport() if transport == "httpx" else None
    async with AsyncPirClient(*urls, key_format="v2", in_flight=in_flight, planners=planners,
                              transport=given) as client:
        await client.fetch_rows(rows[:4 * in_flight * 32])
        started, cpu = time.perf_counter(), cpu_seconds()
        got = await client.fetch_rows(rows)
        assert len(got) == len(rows)
        return time.perf_counter() - started, cpu_seconds() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--in-flight", default="2,8,32")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each point, alternated")
    parser.add_argument("--planners", default="0", help="the client's key-making processes, "
                                                         "a list: 0,1,2")
    parser.add_argument("--transports", default="wire,httpx")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    ports = free_port(), free_port()
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=serve, args=(port,), daemon=True) for port in ports]
    for server in servers:
        server.start()
    for port in ports:  # until each stand-in takes connections
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    rows = np.random.default_rng(1).integers(0, PAGES * 16, args.rows).tolist()
    lines = []
    try:
        for in_flight in [int(x) for x in args.in_flight.split(",")]:
            for _ in range(args.repeats):
                for planners in [int(x) for x in args.planners.split(",")]:
                    for transport in args.transports.split(","):
                        seconds, cpu = asyncio.run(fetch(urls, transport, in_flight, planners,
                                                         rows))
                        rate, per_row = len(rows) / seconds, cpu / len(rows) * 1e6
                        print(f"{transport:5} planners {planners} in flight {in_flight:2}: "
                              f"{rate:9,.0f} rows/s, {per_row:5.1f} us CPU a row", flush=True)
                        lines.append(dict(transport=transport, planners=planners,
                                          in_flight=in_flight, rows=len(rows),
                                          seconds=f"{seconds:.3f}", rows_per_s=f"{rate:.0f}",
                                          cpu_us_per_row=f"{per_row:.1f}"))
    finally:
        for server in servers:
            server.terminate()
    if args.out:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        write_csv(args.out, [
            f"# machine: {platform.node()}; {cpu_model()}; {os.cpu_count()} CPUs; python "
            f"{platform.python_version()}; httpx {httpx.__version__}; load average {load} at the end",
            f"# shape: {PAGES} pages (domain_bits {DOMAIN_BITS}), v2 keys, 32-query binary batches "
            "against two stand-in parties answering zero pages at once (the client alone)",
            f"# command: python {shlex.join(sys.argv)}",
            f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        ], FIELDS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
