"""What `make run`'s front end costs: one party's gunicorn served straight and through the front end, in one run.

    python3 benchmarks/frontend_cost.py --backend cpu --pages 8192 \
        --out FILE.csv

One party (benchmarks/stack.py: engine server, multi-process gunicorn) binds gunicorn to a TCP
port and to a Unix socket; the front end (`python -m morphoweb.frontend`, as morphoweb.devserver
starts it) listens on a port of its own and forwards to the socket, as under `make run`. Closed
loops of single queries, of 32-query batches in JSON and in the binary encoding go to gunicorn's
port and to the front end's in turns (gunicorn, front, gunicorn, front, ...), so that both see the
same machine; each row is the sum over its turns and the ratio is front end / gunicorn alone.
`GET /health` (no engine work) shows what the front end costs a request where nothing else
does. On a host whose cores the clients and the engine share, the CPU each request took in the
party's processes (front end, gunicorn, engine server) is the steadier figure: cpu_ms_per_request,
and front_ms_per_request of it in the front end. Answers through the front end are checked
against gunicorn's first.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.http_load import Load, closed_loop  # noqa: E402
from benchmarks.http_vs_engine import (  # noqa: E402
    binary_bodies, bodies, cpu_seconds, device_name, log,
)
from benchmarks.report import cpu_model, write_csv  # noqa: E402
from benchmarks.stack import Party  # noqa: E402
from gpu_engine.matrix import load_matrix, write_epoch_metadata, write_matrix_file  # noqa: E402
from morphoweb.partyprocs import free_port  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "morphoweb.settings")
from django.conf import settings  # noqa: E402  (the front end's default process count)

COLUMNS = ("pages", "figure", "via", "requests_per_s", "queries_per_s", "ratio", "p50_ms",
           "p99_ms", "cpu_ms_per_request", "front_ms_per_request", "non_200", "note")


class Front:
    """The front end as `make run` starts it, before `upstream` (unix:PATH)."""

    def __init__(self, party: Party, upstream: str, processes: int) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "morphoweb.frontend", "--listen",
                self.url.removeprefix("http://"), "--upstream", upstream]
        if processes:
            argv += ["--processes", str(processes)]
        self.proc = party.start("front", argv)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the front end exited:\n{party.log('front')}")
            try:
                socket.create_connection(("127.0.0.1", int(self.url.rpartition(":")[2])),
                                         timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the front end did not listen:\n{party.log('front')}")
                time.sleep(0.1)


def same_answers(party: Party, url: str, body: bytes, content_type: str) -> None:
    """One request through each port; the front end must change nothing in the answer."""
    answers = []
    for base in (party.url, url):
        request = urllib.request.Request(base + "/query/page/gpu/batch", data=body, headers={
            "Content-Type": content_type, "Accept": content_type})
        with urllib.request.urlopen(request, timeout=120) as response:
            answers.append(response.read())
    if answers[0] != answers[1]:
        raise SystemExit("an answer through the front end differs from gunicorn's own")


def turns(party: Party, urls: dict, path: str, payload: list, args, clients: int,
          content_type: str = "application/json", method: str = "POST") -> dict:
    """{via: (Load, party CPU s, front end CPU s) summed over its turns}, the vias taking turns
    for args.rounds rounds."""
    totals = {via: [Load(0.0), 0.0, 0.0] for via in urls}
    for _ in range(args.rounds):
        for via, url in urls.items():
            served, front = party.pids(), party.pids("front")
            before = cpu_seconds(served), cpu_seconds(front)
            load = closed_loop(url, path, payload, args.client_procs,
                               max(1, clients // args.client_procs), args.seconds,
                               content_type=content_type, method=method)
            total = totals[via]
            total[0].merge(load)
            total[0].seconds += load.seconds
            total[1] += cpu_seconds(served) - before[0]
            total[2] += cpu_seconds(front) - before[1]
    return totals


def rows_of(pages: int, figure: str, totals: dict, per_request: int, note: str) -> list[dict]:
    base = totals["gunicorn"][0].rate()
    out = []
    for via, (load, cpu, front_cpu) in totals.items():
        quant = (lambda q: round(load.quantile(q) * 1e3, 2)) if load.latencies else (lambda q: "")
        out.append({"pages": pages, "figure": figure, "via": via,
                    "requests_per_s": round(load.rate(), 1),
                    "queries_per_s": round(load.rate() * per_request, 1),
                    "ratio": round(load.rate() / base, 3) if base else "",
                    "p50_ms": quant(0.50), "p99_ms": quant(0.99),
                    "cpu_ms_per_request": round(cpu / load.answered * 1e3, 3) if load.answered
                    else "",
                    "front_ms_per_request": round(front_cpu / load.answered * 1e3, 3)
                    if load.answered else "",
                    "non_200": sum(c for s, c in load.statuses.items() if s != 200),
                    "note": note})
        log(f"  {figure} via {via}: {load.rate() * per_request:,.0f} q/s "
            f"({out[-1]['ratio']}), {out[-1]['cpu_ms_per_request']} ms CPU a request "
            f"({out[-1]['front_ms_per_request']} in the front end), statuses {load.statuses}")
    return out


def run_shape(args, pages: int, folder: Path, rng) -> list[dict]:
    matrix = folder / f"matrix-{pages}.bin"
    write_matrix_file(matrix, pages, seed=pages)
    write_epoch_metadata(matrix)
    d = load_matrix(matrix).domain_bits
    sock = folder / f"web-{pages}.sock"
    party = Party(matrix, folder / f"party-{pages}", args.backend, args.web_workers,
                  extra_env={"MORPHO_LOG_LEVEL": "WARNING"}, unix_socket=sock)
    try:
        front = Front(party, f"unix:{sock}", args.front_processes)
        urls = {"gunicorn": party.url, "front": front.url}
        singles, batches = bodies(d, 1, 256, rng), bodies(d, 32, 16, rng)
        raw = binary_bodies(d, 32, 16, rng)
        same_answers(party, front.url, batches[0], "application/json")
        same_answers(party, front.url, raw[0], "application/octet-stream")
        log(f"== {pages} pages: answers through the front end equal gunicorn's")
        rows = rows_of(pages, f"health_{args.single_clients}_clients", turns(
            party, urls, "/health", [b""], args, args.single_clients, method="GET"),
            0, "GET /health: no engine work")
        rows += rows_of(pages, f"single_{args.single_clients}_clients", turns(
            party, urls, "/query/page/gpu", singles, args, args.single_clients),
            1, "POST /query/page/gpu, one query a request")
        rows += rows_of(pages, f"batch32_json_{args.batch_clients}_clients", turns(
            party, urls, "/query/page/gpu/batch", batches, args, args.batch_clients), 32,
            "32 queries a request, hex keys and pages")
        rows += rows_of(pages, f"batch32_binary_{args.batch_clients}_clients", turns(
            party, urls, "/query/page/gpu/batch", raw, args, args.batch_clients,
            "application/octet-stream"), 32, "32 queries a request, docs/PROTOCOL.md 5.3")
    finally:
        party.stop()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--pages", default="8192")
    parser.add_argument("--seconds", type=float, default=8.0, help="per closed-loop turn")
    parser.add_argument("--rounds", type=int, default=2, help="turns per port and figure")
    parser.add_argument("--web-workers", type=int, default=max(2, (os.cpu_count() or 4) // 2),
                        help="gunicorn processes (default: half the cores, as `make run`)")
    parser.add_argument("--front-processes", type=int, default=0,
                        help="front end processes (default: the front end's own default)")
    parser.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 4) // 4))
    parser.add_argument("--single-clients", type=int, default=64)
    parser.add_argument("--batch-clients", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(12)
    rows = []
    comments = [
        f"# machine: {device_name(args.backend)}; host {platform.node()}, {cpu_model()}, "
        f"cpus={os.cpu_count()}; gunicorn {args.web_workers} x 8 threads, front end "
        f"{args.front_processes or settings.MORPHO_FRONTEND_PROCESSES} processes, "
        f"{args.client_procs} client processes on the same host",
        "# command: python3 benchmarks/frontend_cost.py "
        + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    ]
    with tempfile.TemporaryDirectory(prefix="morpho-front-") as tmp:
        for pages in (int(p) for p in args.pages.split(",")):
            rows += run_shape(args, pages, Path(tmp), rng)
            write_csv(args.out, comments, COLUMNS, rows)  # each shape's rows as soon as it is done
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
