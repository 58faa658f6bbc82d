"""`/metrics` of a party of several gunicorn processes: the party's figures whichever process
answers, counters that only grow under load and across the death of a web process, and exactly
the queries answered (prometheus_client's multiprocess mode, set up by gunicorn.conf.py)."""
from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from benchmarks.stack import Party
from engine.dashboard import metric_figures
from tests.conftest import http_json
from tests.protocol_vectors import KEY0_HEX, KEY1_HEX

pytestmark = pytest.mark.processes

SCRAPES = 40
CLIENTS = 4


@pytest.fixture(scope="module")
def party(tmp_path_factory, vector_matrix_path):
    folder = tmp_path_factory.mktemp("m")  # short: an ipc:// path must fit a Unix socket address
    metrics = folder / "metrics"  # as an operator may choose it; a run before left a file there
    metrics.mkdir()
    (metrics / "counter_1.db").write_bytes(b"a counter of a run before")
    made = Party(Path(vector_matrix_path), folder, backend="cpu", web_workers=3, threads=4,
                 extra_env={"CUDA_VISIBLE_DEVICES": "", "PROMETHEUS_MULTIPROC_DIR": metrics})
    made.metrics_dir = metrics
    yield made
    made.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """One sample's value; 0 where the series is not there yet."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(match.group(3))
    return 0.0


def test_counters_are_the_partys_and_only_grow_under_load_and_a_worker_death(party):
    url, query = party.url, {"keys": [KEY0_HEX, KEY1_HEX, KEY0_HEX]}
    answered, cut, stop, errors = [0], [0], threading.Event(), []
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            try:
                status, _, body = http_json(url + "/query/page/gpu", query, timeout=30)
            except (ConnectionError, http.client.HTTPException):
                with lock:  # its process was the one killed: it may have counted the query
                    cut[0] += 1
                continue
            if status != 200:
                errors.append((status, body))
                return
            with lock:
                answered[0] += 1

    workers = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for worker in workers:
        worker.start()
    seen, killed = [], None
    try:
        for i in range(SCRAPES):
            text = scrape(url)
            seen.append((sample(text, "pir_query_count_total", endpoint="/query/page/gpu"),
                         sample(text, "pir_query_duration_seconds_count",
                                endpoint="/query/page/gpu"),
                         sample(text, "django_http_requests_total_by_method_total",
                                method="POST")))
            # one process's counters would show its start time and alternate with the others'
            assert "process_start_time_seconds" not in text
            if i == SCRAPES // 2:  # a web process dies: what it counted stays counted
                killed = party.pids("web")[1]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert not errors, errors[:3]
    assert killed is not None and seen[-1][0] > seen[0][0]
    for earlier, later in zip(seen, seen[1:]):
        assert all(b >= a for a, b in zip(earlier, later)), (earlier, later, seen)
    final = scrape(url)  # each answered query counted once, in whichever process answered it
    for name in ("pir_query_count_total", "pir_query_duration_seconds_count"):
        counted = sample(final, name, endpoint="/query/page/gpu")
        assert answered[0] <= counted <= answered[0] + cut[0], (name, counted, answered, cut)


def test_the_dashboard_reads_the_partys_figures(party):
    """Scrapes answered by different processes agree, and the dashboard's figures are theirs."""
    counts = {sample(scrape(party.url), "pir_query_count_total", endpoint="/query/page/gpu")
              for _ in range(12)}
    assert len(counts) == 1, counts
    assert not (party.metrics_dir / "counter_1.db").exists()  # emptied at gunicorn's start
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(party.metrics_dir))
    assert metric_figures(registry)["http_queries"] == counts.pop() > 0
