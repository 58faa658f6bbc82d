"""A tiny upstream for the proxy tests (morphoweb/frontend.py, deploy/nginx): it answers each
request with what it received; and the checks of a proxy's own JSON errors."""
from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Upstream(BaseHTTPRequestHandler):
    """Answers every request with what it received, as JSON; a few paths answer otherwise."""

    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def handle_one(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Upstream.seen.append({"line": self.requestline, "headers": dict(self.headers.items()),
                              "length": len(body), "sha256": hashlib.sha256(body).hexdigest()})
        if self.path == "/stream":  # no Content-Length: the answer ends where the socket closes
            self.send_response(200)
            self.end_headers()
            for i in range(100):
                self.wfile.write(b"line %d\n" % i)
            return
        if self.path.startswith("/big/"):  # 512 KiB, more than the front end buffers for a
            answer = self.path.encode() * (512 * 1024 // len(self.path))  # client that reads none
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        if self.path.startswith("/blob/"):  # /blob/N: N bytes, head and body in one write
            size = int(self.path[6:])
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % size
                             + bytes(size))
            self.close_connection = True
            return
        if self.path == "/cut":  # promises 100,000 bytes, sends 10, closes
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"0123456789")
            return
        answer = json.dumps(Upstream.seen[-1]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = handle_one


@contextlib.contextmanager
def serve_upstream():
    """HOST:PORT of an Upstream server in a thread, for the time of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def read_all(sock: socket.socket) -> bytes:
    """All a server sends until it closes; a reset after its answer (nginx's end of a lingering
    close) ends it too."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        if not data:
            raise
    return data


def error_of(raw: bytes, status: int, closed: bool = True) -> dict:
    """The JSON error of a raw answer, checked for its status and the API's error shape."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    assert b"Content-Type: application/json" in head, head
    assert not closed or b"Connection: close" in head, head
    error = json.loads(body)
    assert error["detail"] and error["errors"], error
    assert {"field", "code", "message"} <= set(error["errors"][0]), error
    return error
