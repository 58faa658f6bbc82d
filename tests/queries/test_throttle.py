"""The per-client limit holds under concurrency: never more than N requests admitted per window,
per process with the local counter, across processes with Redis."""
from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time

import pytest
from django.core.cache.backends.locmem import LocMemCache
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.test import APIRequestFactory
from rest_framework.throttling import SimpleRateThrottle

from queries.api.throttling import LocalCounter, SharedCounter, reset_counter
from tests.conftest import REPO, ServerProcess, free_port, server_env

LIMIT = 60
PERIOD = 3600  # "60/hour": one window for the whole test, unless it straddles the hour
CLIENTS = 16
REQUESTS_PER_CLIENT = 15  # 240 requests, four times the limit


@pytest.mark.processes
def test_local_counter_counts_every_hit_under_threads():
    counter = LocalCounter()
    now = 1_000_000.5
    admitted = []

    def client():
        admitted.append(sum(counter.hit("client", 3600, now) <= 1000 for _ in range(400)))

    threads = [threading.Thread(target=client) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(admitted) == 1000
    assert counter.hit("client", 3600, now) == 16 * 400 + 1
    assert counter.hit("client", 3600, now + 3600) == 1  # the next window starts from zero


class NetworkLikeCache(LocMemCache):
    """A cache whose reads and writes take a round trip, as Redis's do (the GIL free meanwhile)."""

    def get(self, *args, **kwargs):
        time.sleep(0.0005)
        return super().get(*args, **kwargs)

    def set(self, *args, **kwargs):
        time.sleep(0.0005)
        return super().set(*args, **kwargs)


@pytest.mark.processes
def test_the_services_throttle_admits_no_more_than_its_rate_to_concurrent_requests(monkeypatch):
    # DRF's own throttle reads the history, then writes it back: with a cache that takes a round
    # trip, concurrent requests of one client overwrite each other's writes and it overshoots.
    monkeypatch.setattr(SimpleRateThrottle, "cache", NetworkLikeCache("slow", {}))
    reset_counter()
    configured = api_settings.DEFAULT_THROTTLE_CLASSES[0]
    throttle_class = type("Limited", (configured,), {"rate": "100/hour"})
    factory = APIRequestFactory()
    admitted = []
    start = threading.Barrier(16)

    def client():
        start.wait()
        mine = 0
        for _ in range(25):
            request = Request(factory.get("/epoch", REMOTE_ADDR="203.0.113.9"))
            mine += throttle_class().allow_request(request, None)
        admitted.append(mine)

    threads = [threading.Thread(target=client) for _ in range(16)]
    began = time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if int(began // 3600) == int(time.time() // 3600):
        assert sum(admitted) == 100, f"{sum(admitted)} of 400 requests admitted against 100/hour"
    else:
        assert sum(admitted) <= 200


def test_a_redis_that_does_not_answer_falls_back_to_this_process(caplog):
    counter = SharedCounter(f"redis://127.0.0.1:{free_port()}/0")
    assert [counter.hit("c", 60, 120.0)[0] for _ in range(3)] == [1, 2, 3]
    assert "counting per process" in caplog.text


@pytest.fixture(scope="module")
def migrated(vector_matrix_path, tmp_path_factory):
    var = tmp_path_factory.mktemp("throttle-var")
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_VAR_DIR=var, DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}",
                     MORPHO_QUERY_THROTTLE=f"{LIMIT}/hour")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                   check=True)
    return env, var


@pytest.fixture
def gunicorn(migrated):
    servers = []

    def start(workers: int, threads: int, **extra) -> ServerProcess:
        env, var = migrated
        port = free_port()
        argv = [sys.executable, "-m", "gunicorn", "morphoweb.wsgi", "--bind", f"127.0.0.1:{port}",
                "--workers", str(workers), "--threads", str(threads), "--timeout", "120"]
        server = ServerProcess(argv, {**env, **extra}, var / f"gunicorn-{port}.log", port)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def wait_listening(server: ServerProcess, timeout: float = 90.0) -> None:
    # Not /health: every request counts against the limit under test.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited:\n{server.log()[-4000:]}")
        if "Booting worker" in server.log() and "engine started" in server.log():
            return
        time.sleep(0.2)
    raise AssertionError(f"server not up after {timeout} s:\n{server.log()[-4000:]}")


def hammer(url: str) -> tuple[list[int], float, float]:
    """CLIENTS threads on keep-alive connections, REQUESTS_PER_CLIENT GET /epoch each."""
    host, port = url.removeprefix("http://").split(":")
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client():
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        start.wait()
        mine = []
        for _ in range(REQUESTS_PER_CLIENT):
            connection.request("GET", "/epoch")
            response = connection.getresponse()
            response.read()
            if response.status == 429:
                assert int(response.getheader("Retry-After")) >= 1
            mine.append(response.status)
        connection.close()
        with lock:
            statuses.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    began = time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses, began, time.time()


def assert_bound_holds(statuses: list[int], began: float, ended: float) -> None:
    assert len(statuses) == CLIENTS * REQUESTS_PER_CLIENT
    assert set(statuses) <= {200, 429}, set(statuses)
    windows = int(ended // PERIOD) - int(began // PERIOD) + 1
    admitted = statuses.count(200)
    if windows == 1:
        assert admitted == LIMIT, f"{admitted} requests admitted against a limit of {LIMIT}"
    else:  # the hour turned during the test: two windows' worth at most
        assert LIMIT <= admitted <= windows * LIMIT, admitted


@pytest.mark.processes
def test_one_process_admits_exactly_the_limit_to_concurrent_clients(gunicorn):
    server = gunicorn(workers=1, threads=8)
    wait_listening(server)
    assert_bound_holds(*hammer(server.url))


@pytest.mark.processes
def test_with_redis_the_limit_holds_across_worker_processes(gunicorn, own_redis):
    # own_redis answers PING before the workers start: a worker whose first Redis call fails
    # counts per process for REDIS_RETRY_SECONDS, and two workers would admit twice the limit.
    server = gunicorn(workers=2, threads=4, CACHE_URL=own_redis.url)
    wait_listening(server)
    results = hammer(server.url)
    assert "counting per process" not in server.log(), server.log()[-4000:]
    assert_bound_holds(*results)
