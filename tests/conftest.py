"""Shared fixtures: GPU test skipping, the protocol's vector matrix, and live party servers."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from morphoweb.partyprocs import NotHealthy, free_port, isolated_env, wait_healthy  # noqa: F401

REPO = Path(__file__).resolve().parent.parent

# --- GPU tests: run only where CuPy and a CUDA device are present ---------------------------------

_gpu_reason_cache: list = []


def gpu_absent_reason():
    """Why GPU tests cannot run here, or None when they can."""
    if not _gpu_reason_cache:
        reason = None
        if importlib.util.find_spec("cupy") is None:
            reason = "CuPy is not installed (pip install -e '.[cuda]')"
        else:
            try:
                import cupy

                if cupy.cuda.runtime.getDeviceCount() < 1:
                    reason = "no CUDA device is visible"
            except Exception as exc:  # CuPy raises its own runtime errors when no driver is found
                reason = f"no usable CUDA device ({type(exc).__name__}: {exc})"
        _gpu_reason_cache.append(reason)
    return _gpu_reason_cache[0]


# pytest-django's fixtures that open the test database to a test (admin_client and the like
# request `db`, so a test's fixture closure names one of these)
DB_FIXTURES = frozenset({"db", "transactional_db", "django_db_reset_sequences",
                         "django_db_serialized_rollback", "live_server"})


def touches_database(item) -> bool:
    """Whether pytest-django lets `item` at the test database (any other test that tries fails)."""
    return item.get_closest_marker("django_db") is not None or not DB_FIXTURES.isdisjoint(item.fixturenames)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers
def pytest_make_parametrize_id(config, val, argname):
    """Bytes parameters are named by their length: random bytes in a test id would differ between
    xdist's workers, which then refuse to run the suite (each must collect the same names)."""
    if isinstance(val, (bytes, bytearray)):
        return f"{argname}-{len(val)}B"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if touches_database(item):
            item.add_marker(pytest.mark.db)  # the PostgreSQL pass of .ci/run runs `-m db`
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist's file scheduling runs one test of an id: the others would pass unrun
        repeated = sorted(nodeid for nodeid, count in Counter(i.nodeid for i in items).items() if count > 1)
        if repeated:
            raise pytest.UsageError(f"{len(repeated)} test ids name more than one test, which "
                                    f"pytest-xdist would run once: {repeated[:3]}")
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and gpu_absent_reason():
        skip = pytest.mark.skip(reason=f"gpu test: {gpu_absent_reason()}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Puts back the rows the migrations wrote after a transactional test emptied the database.

    A transactional test ends with a flush of every table, content types and permissions too when
    it asks for a serialized rollback. pytest-django runs such tests last, but xdist's file
    scheduling does not: a later file on the same worker would find no default policy and no
    permissions. Django serialized the migrated database before the first test (a test here asks
    for serialized rollback); that copy is loaded back into the emptied tables."""
    yield
    if "transactional_db" not in item.fixturenames and not _marked_transactional(item):
        return
    from django.contrib.contenttypes.models import ContentType
    from django.db import connections
    from pytest_django.plugin import blocking_manager_key

    with item.config.stash[blocking_manager_key].unblock():
        for connection in connections.all():
            contents = getattr(connection, "_test_serialized_contents", None)
            if contents and not ContentType.objects.using(connection.alias).exists():
                connection.creation.deserialize_db_from_string(contents)


def _marked_transactional(item) -> bool:
    marker = item.get_closest_marker("django_db")
    return marker is not None and bool(marker.kwargs.get("transaction"))


# --- Waiting for a condition ----------------------------------------------------------------------


def wait_until(condition, timeout: float, message: str = "the condition", interval: float = 0.02):
    """condition()'s first truthy value, polled every `interval` seconds; AssertionError naming
    `message` and the last value when `timeout` seconds pass first. Tests wait for what they then
    check rather than sleep a fixed time, which is too short on a loaded machine and too long on
    an idle one."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message}: still {value!r} after {timeout} s")
        time.sleep(interval)


# --- The 200-page matrix of docs/PROTOCOL.md section 7 -------------------------------------------

VECTOR_EPOCH = {
    "epoch_id": 5,
    "block_number": 1234,
    "state_root": bytes(range(32)),
    "seeds": (1, 2, 3**40),
}


@pytest.fixture(scope="session")
def vector_matrix_path(tmp_path_factory) -> Path:
    """The vector matrix as a file, with an epoch sidecar."""
    from gpu_engine.matrix import write_epoch_metadata
    from tests.protocol_vectors import vector_pages

    path = tmp_path_factory.mktemp("vectors") / "vectors.bin"
    path.write_bytes(vector_pages().tobytes())
    write_epoch_metadata(path, **VECTOR_EPOCH)
    return path


@pytest.fixture
def serve_matrix(settings):
    """Point this process's engine at a matrix file (CPU backend); restarts it, and stops it after."""
    from engine.holder import shutdown_engine

    def serve(path, **overrides):
        shutdown_engine()
        settings.MORPHO_MATRIX_PATH = Path(path)
        settings.MORPHO_ENGINE_BACKEND = "cpu"
        settings.MORPHO_DOMAIN_BITS = None
        for name, value in overrides.items():
            setattr(settings, name, value)

    yield serve
    shutdown_engine()


# --- Live servers in their own processes ----------------------------------------------------------


def http_json(url: str, body=None, timeout: float = 60.0):
    """(status, headers, parsed JSON) of one request; error statuses are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def every_web_process_serves(url: str, epoch_id: int, domain_bits: int, since: float, within: float = 1.5) -> None:
    """Waits until `url`'s web processes all serve epoch `epoch_id` (domain_bits): 12 /epoch answers
    in a row say so (a request reaches any worker). Fails if that takes past `within` seconds from
    `since` (monotonic): an epoch switch reaches every web process within a second."""
    consecutive = 0
    while consecutive < 12:
        epoch = http_json(url + "/epoch")[2]
        seen = (epoch.get("epoch_id"), epoch.get("page_pir", {}).get("domain_bits")) == (epoch_id, domain_bits)
        consecutive = consecutive + 1 if seen else 0
        assert time.monotonic() - since < within, f"still {epoch}"


class ServerProcess:
    """A Django server (runserver or gunicorn) in a child process, on a free local port."""

    def __init__(self, argv, env, log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 90.0) -> "ServerProcess":
        try:
            wait_healthy(self.url, {"server": self.proc}, timeout)
        except NotHealthy as exc:
            raise AssertionError(f"{exc}:\n{self.log()[-4000:]}") from None
        return self

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()


# The environment of a child server: this one's, minus settings that would leak in.
server_env = isolated_env


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(kind, env) -> ServerProcess with `runserver` or `gunicorn`; stopped after the module."""
    started = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(kind: str, env: dict, wait: bool = True) -> ServerProcess:
        port = free_port()
        if kind == "runserver":
            argv = [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"]
        elif kind == "gunicorn":
            argv = [sys.executable, "-m", "gunicorn", "morphoweb.wsgi", "--bind",
                    f"127.0.0.1:{port}", "--workers", "1", "--threads", "4", "--timeout", "120"]
        else:
            raise ValueError(kind)
        server = ServerProcess(argv, env, log_dir / f"{kind}-{port}.log", port)
        started.append(server)
        return server.wait_healthy() if wait else server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _bulk_files_in_a_temporary_folder(tmp_path_factory):
    """Bulk job files of in-process tests go to a folder of the run's own, not the checkout's var/."""
    from django.conf import settings
    from django.test import override_settings

    storage = {**settings.STORAGES["bulk"], "OPTIONS": {
        **settings.STORAGES["bulk"].get("OPTIONS", {}),
        "location": str(tmp_path_factory.mktemp("bulk-files"))}}
    with override_settings(STORAGES={**settings.STORAGES, "bulk": storage}):
        yield


@pytest.fixture(autouse=True)
def _fresh_request_counters():
    """Each test starts with no request counted against any limit (user ids repeat per test)."""
    from queries.api.throttling import reset_counter

    reset_counter()


def _hold_off_watcher_thread(patch: pytest.MonkeyPatch):
    """Stop this process's live watcher thread and keep it from starting again until `patch` is
    undone (a test that wants a poll calls check_all())."""
    from engine.watcher import default_watcher

    watcher = default_watcher()
    watcher.stop()
    patch.setattr(watcher, "start", lambda: None)


@pytest.fixture(scope="session", autouse=True)
def _live_watcher_thread(django_db_setup):
    """This process's live watcher: no thread over SQLite, stopped at the end over PostgreSQL
    (before the test database is dropped: this fixture needs it, so it is torn down first).

    The tests' SQLite database is one shared in-memory database, which refuses a write while another
    connection reads the table ("database table is locked") where a database file would wait: the
    watcher thread polling beside a test's writes failed tests at random (CI, test_epochs). A test
    that wants a poll calls check_all(); the servers the tests start run their own watchers. The
    thread is stopped before pytest closes its output streams, so it neither logs into closed files
    nor holds the test database at teardown."""
    from django.db import connection

    from engine.watcher import default_watcher

    patch = pytest.MonkeyPatch()
    if connection.vendor == "sqlite":
        _hold_off_watcher_thread(patch)
    yield
    patch.undo()
    default_watcher().stop()


@pytest.fixture(autouse=True)
def _no_watcher_thread_beside_a_test_transaction(request):
    """Over PostgreSQL, a test wrapped in a transaction (`db`, not `transactional_db`) runs without
    the watcher thread, as every test does over SQLite.

    The thread's own connection sees none of the test's uncommitted rows, so a poll undoes what the
    test set up: an engine held because the active epoch (the test's row) cannot be served was
    freed by a sync that, in the thread's view, found no active epoch, and answered a query from
    the epoch it still had (CI, test_placement). Tests whose rows are committed keep the thread."""
    from django.db import connection

    names = request.fixturenames
    marker = request.node.get_closest_marker("django_db")
    transactional = "transactional_db" in names or "live_server" in names or (
        marker is not None and bool(marker.kwargs.get("transaction", marker.args[:1] == (True,))))
    wrapped = ("db" in names or marker is not None) and not transactional
    if connection.vendor == "sqlite" or not wrapped:
        yield
        return
    patch = pytest.MonkeyPatch()
    _hold_off_watcher_thread(patch)
    yield
    patch.undo()


# --- Redis servers of a test's own ------------------------------------------------------------


def redis_reachable(port: int = 6379) -> bool:
    """Whether a Redis on this local port answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server of a test's own, without persistence: a restart loses every message."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.argv = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(tmp),
        ]  # fmt: skip
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.procs.append(
            subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        )
        deadline = time.monotonic() + 10
        while not redis_reachable(self.port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.procs[-1].terminate()
        self.procs[-1].wait(10)

    def kill(self) -> None:
        self.procs[-1].kill()  # SIGKILL: no shutdown, no save
        self.procs[-1].wait(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def own_redis(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    redis = RedisServer(tmp_path)
    redis.start()
    yield redis
    redis.close()
