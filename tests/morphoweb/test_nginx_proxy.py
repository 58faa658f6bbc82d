"""deploy/nginx/party.conf.template, the proxy of each party in docker compose, run by a real
nginx in front of a tiny upstream: slow clients are cut at the header deadline while a request
passes, X-Forwarded-For ends with the client, and nginx's own errors are JSON in the API's shape.
Runs where an nginx binary is found (PATH, /usr/sbin, or MORPHO_TEST_NGINX), else skipped."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.proxy_upstream import Upstream, error_of, read_all, serve_upstream

TEMPLATE = REPO / "deploy" / "nginx" / "party.conf.template"
HEADER_TIMEOUT_S = 10.0  # client_header_timeout in the template
SLOW_CONNECTIONS = 256


def nginx_binary():
    for candidate in (os.environ.get("MORPHO_TEST_NGINX"), shutil.which("nginx"),
                      "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


pytestmark = [pytest.mark.processes, pytest.mark.skipif(
    nginx_binary() is None,
    reason="no nginx binary here (apt-get install nginx, or MORPHO_TEST_NGINX=path)")]


class Nginx:
    """The template filled in as the nginx image does at start, under a wrapper nginx.conf."""

    def __init__(self, folder: Path, web: str) -> None:
        self.port = free_port()
        env = {"MORPHO_PROXY_PORT": str(self.port), "MORPHO_WEB_UPSTREAM": web,
               "MORPHO_MAX_BODY_BYTES": "262144", "MORPHO_BULK_MAX_BODY_BYTES": "536870912"}
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "party.conf").write_text(
            re.sub(r"\$\{(MORPHO_\w+)\}", lambda m: env[m.group(1)], TEMPLATE.read_text()))
        (folder / "tmp").mkdir(exist_ok=True)
        (folder / "nginx.conf").write_text(
            "daemon off; pid nginx.pid; error_log stderr notice; worker_processes 1;\n"
            "events { worker_connections 1024; }\n"
            "http { access_log off; client_body_temp_path tmp; proxy_temp_path tmp;\n"
            "  fastcgi_temp_path tmp; uwsgi_temp_path tmp; scgi_temp_path tmp;\n"
            "  include party.conf; }\n")
        self.argv = [nginx_binary(), "-p", f"{folder}/", "-c", str(folder / "nginx.conf")]
        self.log = folder / "nginx.log"
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.1)

    def raw(self, data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(data)
        return sock

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def nginx(tmp_path_factory):
    with serve_upstream() as web:
        proxy = Nginx(tmp_path_factory.mktemp("nginx"), web)
        yield proxy
        proxy.stop()


def get(proxy: Nginx, path: str, extra: bytes = b"") -> bytes:
    """One request with Connection: close; the raw answer."""
    return read_all(proxy.raw(b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n"
                              % (path.encode(), extra)))


def test_the_template_is_a_valid_configuration(tmp_path):
    proxy = Nginx(tmp_path, "127.0.0.1:9")
    proxy.stop()
    check = subprocess.run(proxy.argv + ["-t"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_slow_clients_are_cut_at_the_header_deadline_while_a_request_passes(nginx):
    slow = [nginx.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\nX-Pad: ")
            for _ in range(SLOW_CONNECTIONS)]
    started = time.monotonic()
    for _ in range(3):
        took = time.monotonic()
        answer = get(nginx, "/health", b"X-Forwarded-For: 203.0.113.9\r\n")
        took = time.monotonic() - took
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and took < 2.0, (took, answer[:300])
        seen = json.loads(body)
        # nginx speaks HTTP/1.0 to the web server, which then closes after each answer.
        assert seen["line"] == "GET /health HTTP/1.0"
        assert seen["headers"]["X-Forwarded-For"] == "203.0.113.9, 127.0.0.1"
        for sock in slow:
            sock.send(b"a")
        time.sleep(1.0)
    # nginx closes each one at client_header_timeout (a reset, no answer: it does not say 408).
    for sock in slow:
        sock.settimeout(HEADER_TIMEOUT_S + 20)
        with pytest.raises(ConnectionResetError):
            while sock.recv(1024):
                pass
        sock.close()
    took = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 1 <= took < HEADER_TIMEOUT_S + 20, took


def test_nginx_answers_its_own_errors_as_json(nginx, tmp_path):
    seen = len(Upstream.seen)
    error = error_of(read_all(nginx.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\n"
                                        b"Content-Length: 262145\r\n\r\n")), 413)
    assert error["errors"][0]["code"] == "too_large" and "262145" in error["detail"]
    error = error_of(get(nginx, "/health", b"X-Big: " + b"a" * 9000 + b"\r\n"), 431)
    assert error["errors"][0]["code"] == "headers_too_large"
    # A request line gunicorn would refuse is refused here (in nginx's own words: it has not
    # parsed the URI, so no page of ours can answer).
    answer = read_all(nginx.raw(b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 414 ")
    error = error_of(read_all(nginx.raw(b"GET /health HTTP/1.1\r\nno colon\r\n\r\n")), 400)
    assert error["errors"][0]["code"] == "malformed"
    assert len(Upstream.seen) == seen
    # A chunked body is read whole and passed on with its length.
    answer = read_all(nginx.raw(b"POST /query/page/gpu HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"))
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["length"] == 5
    # A body over the query endpoints' limit is the bulk endpoints' to take.
    body = b"x" * 300_000
    answer = read_all(nginx.raw(b"POST /bulk/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["length"] == len(body)
    down = Nginx(tmp_path / "down", f"127.0.0.1:{free_port()}")
    try:
        answer = get(down, "/health")
        error = error_of(answer, 503, closed=False)
        assert b"\r\nRetry-After: 2\r\n" in answer and error["errors"][0]["code"] == "unavailable"
    finally:
        down.stop()
