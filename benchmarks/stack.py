"""One party started the way an operator starts it: engine server, multi-process gunicorn, bulk workers.

`Party(matrix, folder, port, backend)` runs `manage.py serve_engine`, `gunicorn morphoweb.wsgi`
(workers and threads from gunicorn.conf.py's settings) and `bin/gpu-workers` over a fresh SQLite
database and file broker in `folder`, waits until /health answers 200, and stops them all.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent


class Party:
    """A party's processes; `ready_s` is engine server start to /health 200 (cold start)."""

    def __init__(self, matrix: Path, folder: Path, port: int, backend: str, web_workers: int,
                 threads: int = 8, bulk_workers: bool = False, extra_env: Optional[dict] = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}"
        self.folder = folder
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("MORPHO_") and k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
        self.env.update(
            MORPHO_MATRIX_PATH=str(matrix), MORPHO_ENGINE_BACKEND=backend, MORPHO_VAR_DIR=str(folder),
            DATABASE_URL=f"sqlite:///{folder / 'db.sqlite3'}", CELERY_BROKER_URL="filesystem://",
            CELERY_FILESYSTEM_BROKER_DIR=str(folder / "broker"),
            MORPHO_ENGINE_URL=f"ipc://{folder / 'engine.sock'}",
            MORPHO_WEB_WORKERS=str(web_workers), MORPHO_WEB_THREADS=str(threads),
            MORPHO_QUERY_THROTTLE="off", MORPHO_MAX_BODY_BYTES=str(1 << 30),
            MORPHO_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1",
        )
        self.env.update(extra_env or {})
        self.manage("migrate", "--no-input", "-v0")
        self.token = self.manage(
            "shell", "-v0", "-c",
            "from django.contrib.auth.models import User\n"
            "from rest_framework.authtoken.models import Token\n"
            "print(Token.objects.create(user=User.objects.create_user('bench')).key)").strip()
        self.log_path = folder / "party.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the servers write to it
        self.procs: dict[str, subprocess.Popen] = {}
        started = time.monotonic()
        self.start("engine", [sys.executable, "manage.py", "serve_engine"])
        self.start("web", [sys.executable, "-m", "gunicorn", "morphoweb.wsgi",
                           "--bind", f"127.0.0.1:{port}"])
        if bulk_workers:
            self.start("workers", [sys.executable, "bin/gpu-workers", "--loglevel", "WARNING"])
        self.wait_healthy(900)
        self.ready_s = time.monotonic() - started

    def start(self, name: str, argv: list[str]) -> None:
        self.procs[name] = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=self._log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def manage(self, *args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=self.env,
                              check=True, capture_output=True, text=True).stdout

    def request(self, method: str, path: str, body: Optional[bytes] = None, timeout: float = 600):
        req = urllib.request.Request(self.url + path, data=body, method=method, headers={
            "Authorization": f"Token {self.token}", "Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    def json(self, method: str, path: str, body: Optional[bytes] = None) -> dict:
        with self.request(method, path, body) as response:
            return json.loads(response.read())

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited ({proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise SystemExit(f"{self.url} not healthy after {timeout} s; see {self.log_path}")

    def pids(self) -> list[int]:
        """Every process of the party (the web master's workers, the Celery pool included)."""
        found = []
        for proc in self.procs.values():
            found.append(proc.pid)
            found += _descendants(proc.pid)
        return found

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()


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
