"""HTTP load from client processes apart from the server: closed-loop and Poisson, with latencies.

`closed_loop(url, path, bodies, processes, threads, seconds)` keeps processes x threads clients
each sending its next request as soon as the last is answered; `poisson(url, path, bodies,
processes, rate, seconds)` offers requests at exponential gaps (open loop, `rate` per second over
all processes). Each returns a `Load` with the status counts and per-request latencies. Keep-alive
connections, standard library only, so a client costs the server what a real one would.
"""
from __future__ import annotations

import http.client
import math
import multiprocessing
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence
from urllib.parse import urlsplit


@dataclass
class Load:
    seconds: float
    latencies: List[float] = field(default_factory=list)  # of answered (200) requests
    statuses: Dict[int, int] = field(default_factory=dict)

    @property
    def answered(self) -> int:
        return self.statuses.get(200, 0)

    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    def quantile(self, q: float) -> float:
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def merge(self, other: "Load") -> None:
        self.latencies += other.latencies
        for code, count in other.statuses.items():
            self.statuses[code] = self.statuses.get(code, 0) + count


class _Client:
    """One keep-alive connection; reconnects after the server closed it."""

    def __init__(self, url: str, content_type: str, method: str = "POST") -> None:
        parts = urlsplit(url)
        self.method = method
        self.host, self.port = parts.hostname, parts.port
        # answers in the encoding the requests are in (JSON, or raw bytes for application/octet-stream)
        self.headers = {"Content-Type": content_type, "Accept": content_type}
        self.conn: Optional[http.client.HTTPConnection] = None

    def post(self, path: str, body: bytes) -> int:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                self.conn.request(self.method, path, body or None, self.headers)
                response = self.conn.getresponse()
                response.read()
                return response.status
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = None
                if attempt:
                    return 599  # the connection broke twice: counted, not raised
        return 599


def _record(load: Load, lock: threading.Lock, status: int, seconds: float) -> None:
    with lock:
        load.statuses[status] = load.statuses.get(status, 0) + 1
        if status == 200:
            load.latencies.append(seconds)


def _closed_worker(args) -> Load:
    url, path, bodies, threads, seconds, content_type, limit, seed, method = args
    load, lock = Load(seconds), threading.Lock()
    stop_at = time.perf_counter() + seconds
    sent = [0]

    def client(index: int) -> None:
        http_client, rng = _Client(url, content_type, method), random.Random(seed * 1000 + index)
        while time.perf_counter() < stop_at:
            with lock:
                if limit and sent[0] >= limit:
                    return
                sent[0] += 1
            started = time.perf_counter()
            status = http_client.post(path, bodies[rng.randrange(len(bodies))])
            _record(load, lock, status, time.perf_counter() - started)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    began = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    load.seconds = time.perf_counter() - began
    return load


def _poisson_worker(args) -> Load:
    url, path, bodies, rate, seconds, content_type, seed = args
    load, lock = Load(seconds), threading.Lock()
    rng = random.Random(seed)
    local = threading.local()

    def send(body: bytes, due: float) -> None:
        if not hasattr(local, "client"):
            local.client = _Client(url, content_type)
        status = local.client.post(path, body)
        # latency from the arrival time, so a client that waited for a thread is charged for it
        _record(load, lock, status, time.perf_counter() - due)

    with ThreadPoolExecutor(256) as pool:
        due = time.perf_counter()
        end = due + seconds
        while True:
            due += rng.expovariate(rate)
            if due >= end:
                break
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            pool.submit(send, bodies[rng.randrange(len(bodies))], due)
    return load


def _run(worker, jobs: Sequence[tuple], seconds: float) -> Load:
    # spawn: the parent may hold a CUDA context and threads, which a fork must not inherit
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        parts = pool.map(worker, jobs)
    total = Load(max(part.seconds for part in parts))
    for part in parts:
        total.merge(part)
    return total


def closed_loop(url: str, path: str, bodies: Sequence[bytes], processes: int, threads: int,
                seconds: float, content_type: str = "application/json", limit: int = 0,
                method: str = "POST") -> Load:
    """Closed-loop clients for `seconds` (or until `limit` requests in all, when > 0); an empty
    body is sent as none (GET)."""
    per_process = math.ceil(limit / processes) if limit else 0
    jobs = [(url, path, list(bodies), threads, seconds, content_type, per_process, i, method)
            for i in range(processes)]
    return _run(_closed_worker, jobs, seconds)


def poisson(url: str, path: str, bodies: Sequence[bytes], processes: int, rate: float,
            seconds: float, content_type: str = "application/json") -> Load:
    jobs = [(url, path, list(bodies), rate / processes, seconds, content_type, 7 + i)
            for i in range(processes)]
    return _run(_poisson_worker, jobs, seconds)
