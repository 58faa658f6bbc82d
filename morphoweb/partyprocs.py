"""Starting a party's processes and waiting for them: the one copy `make run` (devserver), the
benchmarks (benchmarks/stack.py, benchmarks/policy_http.py) and the tests (tests/conftest.py) use.

Standard library only: it runs in the supervising process, which loads no Django.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Optional


class NotHealthy(RuntimeError):
    """A party did not answer /health with 200: one of its processes exited, or time ran out."""


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies (Linux)


def end_with_parent() -> bool:
    """Have the kernel send this process SIGTERM when its parent dies; False where prctl is
    missing (not Linux), and the caller must notice the parent's end some other way."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def free_port() -> int:
    """A local TCP port free now (for a child server to bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def isolated_env(**values) -> dict:
    """This process's environment without the settings that would leak into a child party (every
    MORPHO_* variable, DATABASE_URL, CELERY_BROKER_URL), plus `values` as strings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MORPHO_") and k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env.update({k: str(v) for k, v in values.items()})
    return env


def health_status(url: str) -> Optional[int]:
    """The status of GET `url`/health (200 only when the engine takes queries), None unreachable."""
    return health(url)[0]


def health(url: str) -> tuple:
    """(status, parsed body or {}) of GET `url`/health; (None, {}) when it cannot be reached."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())
    except OSError:
        return None, {}


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def wait_healthy(url: str, processes: Mapping[str, subprocess.Popen], timeout: float,
                 interval: float = 0.2, held_is_up: bool = False) -> float:
    """Seconds until `url`/health answers 200 (or, with held_is_up, says "held": the party is up
    but cannot serve its active epoch, a state an operator fixes while it runs); NotHealthy,
    naming the process and its status, when one of `processes` (name -> process) exits first, or
    when `timeout` seconds pass."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        for name, proc in processes.items():
            if proc.poll() is not None:
                raise NotHealthy(f"{name} exited with status {proc.returncode}")
        status, body = health(url)
        if status == 200 or (held_is_up and body.get("status") == "held"):
            return time.monotonic() - started
        time.sleep(interval)
    raise NotHealthy(f"{url}: not healthy after {timeout:.0f} s")
