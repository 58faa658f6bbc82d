"""Bytes on the wire and web-process CPU per query, JSON (hex) against binary, on this machine.

    python benchmarks/wire_format.py            # under a minute; writes var/bench/wire_format_cpu.csv
    python benchmarks/wire_format.py --batches 10 --singles 30 --out /tmp/wire.csv

The Django WSGI application runs in this process with the CPU engine over a small seeded matrix
whose domain_bits is raised to 16, so keys have the size they have at 65,536 pages (323 bytes)
while the scan stays cheap. Each request is a direct WSGI call, as gunicorn makes it. "Web CPU" is
the CPU time of the thread that runs the request (parse, validate, hand to the engine, render): the
engine scans on its own threads, so the figure is the web tier's work alone, the part a separate
engine server leaves to the web processes. The same keys are sent in every encoding and the
answers are checked identical across encodings before anything is written.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Measure this checkout's code, whatever copy of the project the interpreter has installed.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from django.core.management import call_command  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

from gpu_engine.matrix import write_epoch_metadata, write_matrix_file  # noqa: E402
from benchmarks.report import cpu_model  # noqa: E402
from morpho_pir.protocol import KEYS_PER_QUERY, PAGE_BYTES  # noqa: E402
from morpho_client.plan import plan_query  # noqa: E402

JSON = "application/json"
BIN = "application/octet-stream"
CODEC = {"json": JSON, "binary": BIN}
# The request line and headers Python's urllib sends besides Content-Type, Accept and the length.
CLIENT_HEADERS = ("POST {path} HTTP/1.1\r\nAccept-Encoding: identity\r\nHost: 127.0.0.1:8001\r\n"
                  "User-Agent: Python-urllib/3.11\r\nConnection: close\r\n")


def request_headers(path: str, content_type: str, accept: str, length: int) -> int:
    """Bytes of the request line and headers a urllib client sends with this body."""
    text = (CLIENT_HEADERS.format(path=path) + f"Content-Type: {content_type}\r\n"
            f"Accept: {accept}\r\nContent-Length: {length}\r\n\r\n")
    return len(text.encode())


def json_body(keys: list[list[bytes]], single: bool) -> bytes:
    hexed = [[key.hex() for key in query] for query in keys]
    body = {"keys": hexed[0]} if single else {"queries": [{"keys": q} for q in hexed]}
    return json.dumps(body).encode()  # as the client library sends it


def call(app, path: str, body: bytes, content_type: str, accept: str):
    """One WSGI request: (status, response headers, body, request-thread CPU seconds)."""
    environ = {
        "REQUEST_METHOD": "POST", "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8001", "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1", "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": str(len(body)), "HTTP_ACCEPT": accept, "HTTP_HOST": "127.0.0.1:8001",
        "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr, "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0), "wsgi.multithread": True, "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    captured = {}

    def start_response(status, headers, exc_info=None):
        captured["status"], captured["headers"] = status, headers

    cpu = time.thread_time()
    result = app(environ, start_response)
    try:
        payload = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    cpu = time.thread_time() - cpu
    return captured["status"], captured["headers"], payload, cpu


def decode(payload: bytes, headers, queries: int) -> list[bytes]:
    """The client's step after the response: every answer as bytes."""
    content_type = dict(headers)["Content-Type"]
    if content_type == BIN:
        return [payload[i * PAGE_BYTES:(i + 1) * PAGE_BYTES]
                for i in range(KEYS_PER_QUERY * queries)]
    body = json.loads(payload)
    results = body["results"] if "results" in body else [body]
    return [bytes.fromhex(page[2:]) for result in results for page in result["pages"]]


def measure(app, path: str, keys, single: bool, request: str, response: str, repeats: int):
    queries = len(keys)
    raw = b"".join(key for query in keys for key in query)
    web, client, wall = [], [], []
    process_start = resource.getrusage(resource.RUSAGE_SELF)
    answers = None
    for _ in range(repeats):
        started = time.thread_time()
        body = raw if request == "binary" else json_body(keys, single)
        encode_cpu = time.thread_time() - started
        began = time.perf_counter()
        status, headers, payload, cpu = call(app, path, body, CODEC[request], CODEC[response])
        wall.append(time.perf_counter() - began)
        if not status.startswith("200"):
            raise SystemExit(f"{path} {request}->{response}: {status} {payload[:300]!r}")
        started = time.thread_time()
        answers = decode(payload, headers, queries)
        client.append(encode_cpu + time.thread_time() - started)
        web.append(cpu)
    process_end = resource.getrusage(resource.RUSAGE_SELF)
    process_cpu = ((process_end.ru_utime + process_end.ru_stime)
                   - (process_start.ru_utime + process_start.ru_stime))
    response_headers = len(f"HTTP/1.1 {status}\r\n".encode()) + sum(
        len(f"{name}: {value}\r\n".encode()) for name, value in headers) + 2
    row = {
        "endpoint": path,
        "queries_per_request": queries,
        "request_encoding": request,
        "response_encoding": response,
        "requests": repeats,
        "request_body_bytes_per_query": round(len(body) / queries, 1),
        "request_header_bytes": request_headers(path, CODEC[request], CODEC[response], len(body)),
        "response_body_bytes_per_query": round(len(payload) / queries, 1),
        "response_header_bytes": response_headers,
        "wire_bytes_per_query": round((len(body) + len(payload) + response_headers
                                       + request_headers(path, CODEC[request], CODEC[response],
                                                         len(body))) / queries, 1),
        "web_cpu_us_per_query_mean": round(1e6 * sum(web) / (repeats * queries), 1),
        "web_cpu_us_per_query_p50": round(1e6 * statistics.median(web) / queries, 1),
        "process_cpu_us_per_query": round(1e6 * process_cpu / (repeats * queries), 1),
        "client_cpu_us_per_query_p50": round(1e6 * statistics.median(client) / queries, 1),
        "wall_ms_per_request_p50": round(1e3 * statistics.median(wall), 2),
    }
    return row, answers


def machine() -> str:
    return (f"{platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
            f", load average {os.getloadavg()[0]:.2f} at the start")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages of the seeded matrix")
    parser.add_argument("--domain-bits", type=int, default=16,
                        help="domain_bits served (keys of 35 + 18 * d bytes)")
    parser.add_argument("--batches", type=int, default=100,
                        help="32-query batch requests per encoding pair")
    parser.add_argument("--singles", type=int, default=300,
                        help="single-query requests per encoding pair")
    parser.add_argument("--out", type=Path, default=REPO / "var/bench/wire_format_cpu.csv")
    args = parser.parse_args(argv)
    started = time.monotonic()
    machine_line = machine()

    work = Path(tempfile.mkdtemp(prefix="wire-format-"))
    matrix = write_matrix_file(work / "matrix.bin", args.pages, seed=12)
    write_epoch_metadata(matrix, epoch_id=1)
    os.environ.update({
        "DJANGO_SETTINGS_MODULE": "morphoweb.settings",
        "MORPHO_MATRIX_PATH": str(matrix),
        "MORPHO_DOMAIN_BITS": str(args.domain_bits),
        "MORPHO_ENGINE_BACKEND": "cpu",
        "MORPHO_QUERY_THROTTLE": "off",
        "MORPHO_VAR_DIR": str(work),
        "DATABASE_URL": f"sqlite:///{work / 'db.sqlite3'}",
        "MORPHO_LOG_LEVEL": "WARNING",
    })
    app = get_wsgi_application()
    call_command("migrate", verbosity=0)

    # The client's own keys (one pool, reused: the engine's work does not depend on them).
    plans = [plan_query(page % args.pages, args.pages, args.domain_bits)
             for page in range(0, 32 * 37, 37)]
    batch_keys = [[bytes.fromhex(key) for key in plan.keys_a] for plan in plans]
    cases = [("/query/page/gpu", batch_keys[:1], True, args.singles)] + [
        ("/query/page/gpu/batch", batch_keys, False, args.batches)]
    rows = []
    for path, keys, single, repeats in cases:
        pairs = ([("json", "json"), ("binary", "binary")] if single else
                 [("json", "json"), ("binary", "json"), ("json", "binary"), ("binary", "binary")])
        reference = None
        for request, response in pairs:
            measure(app, path, keys, single, request, response, 3)  # warm-up
            row, answers = measure(app, path, keys, single, request, response, repeats)
            if reference is None:
                reference = answers
            elif answers != reference:
                raise SystemExit(f"{path}: {request}->{response} answers differ from JSON's")
            rows.append(row)
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    command = shlex.join(["python", "benchmarks/wire_format.py",
                          *(sys.argv[1:] if argv is None else argv)])
    header = [
        "# Bytes on the wire and web CPU per query, JSON (hex) against binary (docs/PROTOCOL.md 5.3)",
        f"# machine: {machine_line}",
        f"# shape: {args.pages} seeded pages served at domain_bits {args.domain_bits} (keys of "
        f"{35 + 18 * args.domain_bits} bytes), CPU engine in-process; 3 warm-up requests per row",
        f"# command: {command}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
        f"{time.monotonic() - started:.0f} s",
        "# web_cpu: CPU time of the request thread (parse, validate, submit, render), engine "
        "excluded; process_cpu: the whole process, engine scan threads included",
        "# client_cpu: encoding the request body from key bytes plus decoding the answers to bytes",
        "# wire bytes: request line, headers and body both ways, per query",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        out.write("\n".join(header) + "\n")
        out.write(",".join(rows[0]) + "\n")
        for row in rows:
            out.write(",".join(str(value) for value in row.values()) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
