"""One party started the way an operator starts it: engine server, multi-process gunicorn, bulk workers.

`Party(matrix, folder, backend=..., web_workers=...)` runs `manage.py serve_engine`, `gunicorn
morphoweb.wsgi` (workers and threads from gunicorn.conf.py's settings) and, with bulk_workers,
`bin/gpu-workers`, over a fresh SQLite database and file broker in `folder` (one log per process
there), and waits until /health answers 200. The HTTP benchmarks and the engine server's process
tests both use it; the caller may kill and restart the engine server (`start_engine`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from morphoweb.partyprocs import NotHealthy, free_port, isolated_env, wait_healthy

REPO = Path(__file__).resolve().parent.parent


class Party:
    """A party's processes over `folder`; `ready_s` is engine server start to /health 200."""

    def __init__(self, matrix: Path, folder: Path, backend: str = "cpu", web_workers: int = 2,
                 threads: int = 8, bulk_workers: bool = False, port: Optional[int] = None,
                 extra_env: Optional[dict] = None, unix_socket: Optional[Path] = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.matrix, self.folder = Path(matrix), folder
        self.url = f"http://127.0.0.1:{port or free_port()}"
        self.env = isolated_env(
            MORPHO_MATRIX_PATH=str(matrix), MORPHO_ENGINE_BACKEND=backend, MORPHO_VAR_DIR=str(folder),
            DATABASE_URL=f"sqlite:///{folder / 'db.sqlite3'}", CELERY_BROKER_URL="filesystem://",
            CELERY_FILESYSTEM_BROKER_DIR=str(folder / "broker"),
            MORPHO_ENGINE_URL=f"ipc://{folder / 'engine.sock'}",
            MORPHO_WEB_WORKERS=str(web_workers), MORPHO_WEB_THREADS=str(threads),
            MORPHO_QUERY_THROTTLE="off", MORPHO_MAX_BODY_BYTES=str(1 << 30),
            MORPHO_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1",
        )
        self.env.update({k: str(v) for k, v in (extra_env or {}).items()})
        self.manage("migrate", "--no-input", "-v0")
        self.token = self.manage(
            "shell", "-v0", "-c",
            "from django.contrib.auth.models import User\n"
            "from rest_framework.authtoken.models import Token\n"
            "print(Token.objects.create(user=User.objects.create_user('bench')).key)").strip()
        self.procs: dict[str, subprocess.Popen] = {}
        started = time.monotonic()
        try:
            self.start_engine()
            # unix_socket: gunicorn bound there too, as under `make run` behind its front end
            binds = [self.url.removeprefix("http://")] + ([f"unix:{unix_socket}"] if unix_socket
                                                          else [])
            self.start("web", [sys.executable, "-m", "gunicorn", "morphoweb.wsgi",
                               *(arg for bind in binds for arg in ("--bind", bind))])
            if bulk_workers:
                self.start("workers", [sys.executable, "bin/gpu-workers"])
            self.wait_healthy(900)
        except BaseException:
            self.stop()  # a party that did not come up leaves no process holding its port
            raise
        self.ready_s = time.monotonic() - started

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "ab") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def start_engine(self) -> subprocess.Popen:
        """Start (or, after it died, restart) the engine server, as a supervisor would."""
        return self.start("engine", [sys.executable, "manage.py", "serve_engine"])

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]

    def manage(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stderr}")
        return done.stdout

    def request(self, method: str, path: str, body: Optional[bytes] = None, timeout: float = 600,
                content_type: str = "application/json"):
        req = urllib.request.Request(self.url + path, data=body, method=method, headers={
            "Authorization": f"Token {self.token}", "Content-Type": content_type})
        return urllib.request.urlopen(req, timeout=timeout)

    def json(self, method: str, path: str, body=None) -> dict:
        """The parsed JSON of a request; a dict or list body is sent as JSON."""
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        with self.request(method, path, data) as response:
            return json.loads(response.read())

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until /health says ok; raises with the logs when a process exits or time runs out."""
        try:
            return wait_healthy(self.url, self.procs, timeout, interval=0.1)
        except NotHealthy as exc:
            exited = [name for name, proc in self.procs.items() if proc.poll() is not None]
            logs = [self.log(name) for name in exited] or [self.log("engine"), self.log("web")]
            raise RuntimeError("\n".join([str(exc), *logs])) from None

    def pids(self, name: Optional[str] = None) -> list[int]:
        """The processes of `name` (or of the whole party), the forked children included."""
        found = []
        for proc_name, proc in self.procs.items():
            if name in (None, proc_name):
                found += [proc.pid] + _descendants(proc.pid)
        return found

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            child = int(entry.name)
            children += [child] + _descendants(child)
    return children
