"""Every error the service itself answers is JSON: Django's 400 for a bad Host, and gunicorn's
own answers to requests it cannot parse (request line, headers, transfer coding)."""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, server_env


@pytest.fixture(scope="module")
def server(start_server, vector_matrix_path, tmp_path_factory):
    var = tmp_path_factory.mktemp("json-errors-var")
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_VAR_DIR=var, DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                   check=True)
    return start_server("gunicorn", env)


def raw_exchange(url: str, request: bytes) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one raw HTTP/1.1 exchange; the server closes after errors."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lengths = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")]
            if lengths and len(body) >= lengths[0]:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip()
               for name, value in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.processes
@pytest.mark.parametrize("request_bytes, status, words", [
    (b"GARBAGE\r\n\r\n", 400, "Bad Request: Invalid Request Line"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon in this header\r\n\r\n", 400,
     "Bad Request: Invalid HTTP Header"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431,
     "Request Header Fields Too Large"),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414, "URI Too Long"),
    (b"POST /query/page/gpu HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400,
     "Bad Request: Invalid HTTP Header: 'TRANSFER-ENCODING'"),
])
def test_gunicorns_own_errors_are_json(server, request_bytes, status, words):
    got, headers, body = raw_exchange(server.url, request_bytes)
    assert got == status, body
    assert headers["content-type"] == "application/json", (headers, body)
    assert json.loads(body)["detail"].startswith(words), body


def _get(url: str, path: str, host: str):
    address = url.removeprefix("http://")
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.putrequest("GET", path, skip_host=True)
        connection.putheader("Host", host)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        connection.close()


@pytest.mark.processes
def test_a_host_this_server_does_not_answer_for_gets_a_json_400(server):
    status, content_type, body = _get(server.url, "/epoch", "evil.example")
    assert status == 400
    assert content_type == "application/json"
    payload = json.loads(body)
    assert payload["detail"] == ("Host: expected a host name this server answers for "
                                 "(ALLOWED_HOSTS), got 'evil.example'")
    assert payload["errors"][0]["field"] == "Host"


@pytest.mark.processes
def test_the_server_still_answers_after_the_bad_requests(server):
    status, _, body = _get(server.url, "/epoch", "127.0.0.1")
    assert status == 200 and json.loads(body)["epoch_id"] == 5


def test_a_form_post_without_its_csrf_token_is_refused_in_json(db):
    from django.test import Client

    response = Client(enforce_csrf_checks=True).post("/admin/login/", {"username": "x"})
    assert response.status_code == 403
    assert response["Content-Type"] == "application/json"
    assert response.json()["detail"].startswith("CSRF verification failed: CSRF cookie not set")
