"""morphoweb.frontend as a process in front of a tiny upstream: what reaches gunicorn, and each
error the front end answers itself (JSON in the API's shape) for slow, oversized, malformed or
chunked requests and for an upstream that is down or cuts its answer short."""
from __future__ import annotations

import hashlib
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, free_port, server_env
from tests.proxy_upstream import Upstream, error_of, read_all, serve_upstream

pytestmark = pytest.mark.processes

HEADER_TIMEOUT_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 4096
BODY_TIMEOUT_S = 1.0
BODY_MIN_RATE = 1024 * 1024  # bytes/s: a 1 MiB body has 1 + 1 s


class FrontEnd:
    """`python -m morphoweb.frontend` in a process, with deadlines of a second."""

    def __init__(self, upstream: str, log_path, **settings) -> None:
        self.port = free_port()
        env = server_env(**{"MORPHO_FRONTEND_HEADER_TIMEOUT": HEADER_TIMEOUT_S,
                            "MORPHO_FRONTEND_KEEPALIVE_TIMEOUT": KEEPALIVE_TIMEOUT_S,
                            "MORPHO_FRONTEND_MAX_HEADER_BYTES": MAX_HEADER_BYTES,
                            "MORPHO_FRONTEND_BODY_TIMEOUT": BODY_TIMEOUT_S,
                            "MORPHO_FRONTEND_BODY_MIN_RATE": BODY_MIN_RATE,
                            "MORPHO_FRONTEND_PROCESSES": 1, **settings})
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "morphoweb.frontend", "--listen", f"127.0.0.1:{self.port}",
             "--upstream", upstream], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, log_path.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def raw(self, data: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        if data:
            sock.sendall(data)
        return sock

    def stop(self) -> str:
        """Stop it; its log, which must show no error of its own (a traceback is a bug)."""
        self.proc.terminate()
        assert self.proc.wait(30) == 0
        self.log.close()
        text = self.log_path.read_text()
        assert "Traceback" not in text and "exception" not in text.lower(), text
        return text


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    with serve_upstream() as upstream:
        front = FrontEnd(upstream, tmp_path_factory.mktemp("frontend") / "front.log")
        yield front
        front.stop()


def test_a_request_reaches_gunicorn_whole_with_the_client_address_on_a_kept_connection(front):
    conn = front.connection()
    body = json.dumps({"keys": ["00" * 40] * 3}).encode()
    # A client's own X-Forwarded-For is kept but is not the last hop; its scheme claim is dropped.
    conn.request("POST", "/query/page/gpu", body=body,
                 headers={"Content-Type": "application/json", "X-Forwarded-For": "203.0.113.9",
                          "X-Forwarded-Proto": "https"})
    response = conn.getresponse()
    seen = json.loads(response.read())
    assert response.status == 200 and response.getheader("Connection") == "keep-alive"
    assert seen["sha256"] == hashlib.sha256(body).hexdigest() and seen["length"] == len(body)
    assert seen["line"] == "POST /query/page/gpu HTTP/1.0"
    assert seen["headers"]["X-Forwarded-For"] == "203.0.113.9, 127.0.0.1"
    assert seen["headers"]["X-Forwarded-Proto"] == "http"
    assert seen["headers"]["Connection"] == "keep-alive"
    first_socket = conn.sock
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["line"] == "GET /health HTTP/1.0"
    assert conn.sock is first_socket  # the same connection served both
    conn.close()


def test_a_body_over_a_mebibyte_is_spooled_and_forwarded_intact(front):
    body = bytes(range(256)) * (12 * 1024)  # 3 MiB
    conn = front.connection()
    conn.request("POST", "/bulk/jobs", body=body, headers={"Content-Type": "application/json"})
    seen = json.loads(conn.getresponse().read())
    assert seen["length"] == len(body) and seen["sha256"] == hashlib.sha256(body).hexdigest()


def test_an_answer_without_a_length_reaches_the_client_chunked_and_whole(front):
    conn = front.connection()
    conn.request("GET", "/stream")
    response = conn.getresponse()
    assert response.getheader("Transfer-Encoding") == "chunked"
    assert response.read() == b"".join(b"line %d\n" % i for i in range(100))


def test_an_answer_cut_short_upstream_is_never_delivered_as_whole(front):
    conn = front.connection()
    conn.request("GET", "/cut")
    response = conn.getresponse()
    assert response.getheader("Content-Length") == "100000"
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        response.read()


def test_a_slow_head_gets_408_json_at_the_header_deadline(front):
    started = time.monotonic()
    sock = front.raw(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    for _ in range(3):  # a byte now and then does not extend the deadline
        time.sleep(HEADER_TIMEOUT_S / 3)
        sock.send(b"a")
    error = error_of(read_all(sock), 408)
    took = time.monotonic() - started
    assert HEADER_TIMEOUT_S * 0.9 <= took < HEADER_TIMEOUT_S + 10, took
    assert error["errors"][0] | {"message": ""} == {
        "field": "headers", "query": None, "key": None, "code": "header_timeout", "message": ""}
    assert error["detail"] == ("headers: expected the request line and headers within "
                               f"{HEADER_TIMEOUT_S:g} s")


def test_an_oversized_head_gets_431_json(front):
    sock = front.raw(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MAX_HEADER_BYTES
                     + b"\r\n\r\n")
    error = error_of(read_all(sock), 431)
    assert error["errors"][0]["code"] == "headers_too_large"
    assert str(MAX_HEADER_BYTES) in error["detail"]


def test_a_slow_body_gets_408_json_at_its_deadline(front):
    upstream_seen = len(Upstream.seen)
    sock = front.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
                     b"Content-Type: application/json\r\n\r\n{\"keys\"")
    error = error_of(read_all(sock), 408)
    assert error["errors"][0]["code"] == "body_timeout" and error["errors"][0]["field"] == "body"
    assert "expected 100 bytes" in error["detail"] and "got 7" in error["detail"]
    assert len(Upstream.seen) == upstream_seen  # gunicorn never saw it


def test_too_large_chunked_and_malformed_requests_get_the_services_json_errors(front):
    upstream_seen = len(Upstream.seen)
    # 413 from the declared length alone, in the words of the service's own middleware, for the
    # query endpoints' limit (MORPHO_MAX_BODY_BYTES) and for the bulk one's.
    sock = front.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\nContent-Length: 262145\r\n\r\n")
    error = error_of(read_all(sock), 413)
    assert error["errors"][0]["code"] == "too_large"
    assert error["detail"] == ("body: expected at most 262144 bytes (MORPHO_MAX_BODY_BYTES), "
                               "got 262145")
    sock = front.raw(b"POST /bulk/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 536870913\r\n\r\n")
    assert "MORPHO_BULK_MAX_BODY_BYTES" in error_of(read_all(sock), 413)["detail"]
    sock = front.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n5\r\nhello\r\n0\r\n\r\n")
    assert error_of(read_all(sock), 411)["errors"][0]["code"] == "length_required"
    sock = front.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                     b"Content-Length: 2\r\n\r\nab")
    assert error_of(read_all(sock), 400)["errors"][0]["code"] == "content_length"
    for bad in (b"GET /health\r\n\r\n", b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n"):
        assert error_of(read_all(front.raw(bad)), 400)["errors"][0]["code"] == "malformed", bad
    assert error_of(read_all(front.raw(b"GET / HTTP/2.0\r\n\r\n")), 505)
    # gunicorn's own limits, which it would refuse in plain text: a request line over 4094
    # bytes, more than 96 headers (gunicorn takes 100, the front end adds 4).
    sock = front.raw(b"GET /" + b"a" * 4090 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    error = error_of(read_all(sock), 414)
    assert error["detail"] == "request line: expected at most 4094 bytes, got 4104"
    sock = front.raw(b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert error_of(read_all(sock), 414)["detail"] == ("request line: expected at most 4094 "
                                                       "bytes, got more than 8188")
    for count in (97, 99, 100, 101):  # gunicorn would refuse 97 once the front end adds its 4
        sock = front.raw(b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(count))
                         + b"\r\n")
        assert error_of(read_all(sock), 431)["detail"] == "headers: expected at most 96 headers"
    assert len(Upstream.seen) == upstream_seen  # none of them reached gunicorn
    conn = front.connection()
    # 93 + Host, Accept-Encoding and Content-Length: 96 from the client, 99 reach the upstream
    conn.request("POST", "/echo", body=b"{}", headers={f"X-{i}": "1" for i in range(93)})
    seen = json.loads(conn.getresponse().read())
    assert len(seen["headers"]) == 99 and seen["headers"]["Connection"] == "keep-alive"


def test_a_client_that_pipelines_and_reads_nothing_has_one_request_upstream(front):
    """Three requests sent at once, answers of 512 KiB left unread: the second reaches the
    upstream only once the client has taken the first answer (all but 64 KiB of it)."""
    upstream_seen = len(Upstream.seen)
    sock = front.raw(b"".join(b"GET /big/%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(3)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    deadline = time.monotonic() + 10
    while len(Upstream.seen) == upstream_seen:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.5)  # long enough for the front end to have forwarded more, were it to
    assert [s["line"] for s in Upstream.seen[upstream_seen:]] == ["GET /big/0 HTTP/1.0"]
    size = 512 * 1024 // 6 * 6
    raw = b""
    while raw.count(b"HTTP/1.1 200 ") < 3 or len(raw.rpartition(b"\r\n\r\n")[2]) < size:
        chunk = sock.recv(65536)
        assert chunk, raw[-200:]
        raw += chunk
    answers = raw.split(b"HTTP/1.1 200 OK\r\n")[1:]
    for i, answer in enumerate(answers):  # whole and in order
        body = answer.partition(b"\r\n\r\n")[2]
        assert body == b"/big/%d" % i * (size // 6), (i, len(body))
    assert len(Upstream.seen) == upstream_seen + 3


def test_a_client_that_reads_its_answers_is_not_kept_waiting_for_its_next(front):
    """Answers of 256 KiB, each read whole before the next request: the front end reads the next
    request as soon as it comes, not at a poll of the client's socket 10 ms later (which would
    add about 5 ms to each 32-query batch on a GPU). A small receive buffer keeps most of each answer
    in the front end's socket until the client reads it, so the front end always has to wait."""
    conn = front.connection()
    conn.connect()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    size = 256 * 1024
    took = []
    for _ in range(41):
        started = time.perf_counter()
        conn.request("GET", "/blob/%d" % size)
        assert len(conn.getresponse().read()) == size
        took.append(time.perf_counter() - started)
    # the median: a loaded machine delays a few requests whatever the front end does
    assert statistics.median(took[1:]) < 0.006, sorted(round(t * 1e3, 1) for t in took)


def test_past_its_connection_bound_a_new_connection_closes_the_longest_idle_one(tmp_path):
    """MORPHO_FRONTEND_MAX_CONNECTIONS: idle connections cannot keep /health out."""
    with serve_upstream() as upstream:
        front = FrontEnd(upstream, tmp_path / "front.log", MORPHO_FRONTEND_MAX_CONNECTIONS=20,
                         MORPHO_FRONTEND_HEADER_TIMEOUT=60)
        try:
            idle = [front.raw() for _ in range(20)]
            time.sleep(0.5)
            for _ in range(3):  # each pushes out the longest idle one, never a newer one
                conn = front.connection()
                started = time.monotonic()
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200 and time.monotonic() - started < 1
                conn.close()
            closed = []
            for sock in idle:
                sock.settimeout(0.5)
                try:
                    closed.append(sock.recv(1) == b"")
                except (TimeoutError, ConnectionResetError):
                    closed.append(not isinstance(sys.exc_info()[1], TimeoutError))
            # one to three closed (a /health connection closed by its client may already have
            # left room for the next), and the oldest ones
            pushed_out = closed.count(True)
            assert 1 <= pushed_out <= 3 and closed == sorted(closed, reverse=True), closed
        finally:
            front.stop()


def test_an_idle_kept_connection_is_closed(front):
    sock = front.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        answer += sock.recv(65536)
    started = time.monotonic()
    assert sock.recv(1) == b""  # closed by the front end, not by this client
    assert KEEPALIVE_TIMEOUT_S * 0.9 <= time.monotonic() - started < KEEPALIVE_TIMEOUT_S + 10


def test_an_upstream_that_is_down_gets_503_json_with_retry_after(tmp_path):
    for address in (f"127.0.0.1:{free_port()}", f"unix:{tmp_path}/no-such.sock"):
        front = FrontEnd(address, tmp_path / "front.log")
        try:
            sock = front.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = read_all(sock)
            error = error_of(raw, 503)
            assert b"\r\nRetry-After: 2\r\n" in raw.partition(b"\r\n\r\n")[0]
            assert error["errors"][0]["code"] == "unavailable"
            assert "not accepting connections" in error["detail"]
        finally:
            front.stop()
