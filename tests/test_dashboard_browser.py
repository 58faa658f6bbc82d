"""In headless Chromium: sign in to the admin, activate another interactive policy, open the
dashboard and see it named there and in /metrics (driven over the DevTools protocol)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, http_json, server_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(.ci/run installs it: apt-get install -y chromium)")
websocket = pytest.importorskip("websocket")

NEW_POLICY = "interactive-slo"  # a default policy of the lane, inactive on a fresh database


class DevTools:
    """A minimal DevTools-protocol client over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list = []

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_loaded(timeout)

    def wait_loaded(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("method") == "Page.loadEventFired" for e in self.events):
                self.events.clear()
                return
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            self.events.append(json.loads(self.ws.recv()))
        raise AssertionError("page did not finish loading")

    def wait_for(self, expression: str, timeout: float = 15):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout} s: {expression}")
            time.sleep(0.2)

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def server(start_server, vector_matrix_path, tmp_path_factory):
    var = tmp_path_factory.mktemp("browser-var")
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cpu", MORPHO_VAR_DIR=var,
                     DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    subprocess.run([sys.executable, "manage.py", "shell", "-c",
                    "from django.contrib.auth.models import User; "
                    "User.objects.create_superuser('ops', password='pw-ops-123')"],
                   cwd=REPO, env=env, check=True)
    return start_server("runserver", env)


@pytest.fixture
def browser(tmp_path):
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-allow-origins=*", "--window-size=1400,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            pages = [t for t in json.loads(response.read()) if t["type"] == "page"]
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        tools.call("Page.enable")
        yield tools
        tools.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _traffic(url: str, stop: threading.Event) -> None:
    """A trickle of private queries, so the page has latency and batch figures to plot."""
    from gpu_engine.dpf import gen_keys

    rng = np.random.default_rng(3)
    while not stop.is_set():
        keys = [gen_keys(int(p), 8, rng=rng)[0].to_bytes().hex() for p in rng.integers(0, 200, 3)]
        http_json(url + "/query/page/gpu", {"keys": keys})
        time.sleep(0.05)


def test_admin_policy_change_shows_on_dashboard_and_metrics(server, browser, tmp_path):
    stop = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(server.url, stop), daemon=True)
    traffic.start()
    try:
        browser.open(server.url + "/admin/login/?next=/admin/")
        browser.evaluate("document.getElementById('id_username').value = 'ops';"
                         "document.getElementById('id_password').value = 'pw-ops-123';"
                         "document.querySelector('#login-form').submit()")
        browser.wait_loaded()
        assert browser.evaluate("location.pathname") == "/admin/"

        browser.open(server.url + "/admin/policies/batchingpolicy/")
        selected = browser.evaluate(f"""(() => {{
            const row = [...document.querySelectorAll('#result_list tbody tr')]
                .find(tr => tr.querySelector('th, td.field-name')?.textContent.trim() === '{NEW_POLICY}');
            if (!row) return false;
            row.querySelector('input[name=_selected_action]').click();
            document.querySelector('select[name=action]').value = 'activate';
            document.querySelector('button[name=index]').click();
            return true;
        }})()""")
        assert selected, f"policy {NEW_POLICY} not listed in the admin"
        browser.wait_loaded()
        messages = browser.evaluate("document.querySelector('.messagelist')?.textContent || ''")
        assert NEW_POLICY in messages, messages

        browser.open(server.url + "/dashboard/")
        browser.wait_for(f"""[...document.querySelectorAll('#policies tr')]
            .some(tr => tr.cells[0]?.textContent === 'interactive' && tr.cells[1]?.textContent === '{NEW_POLICY}')""")
        # Let a few polls draw the latency and rate lines before the picture is taken.
        browser.wait_for("document.querySelectorAll('#latency-chart path[d^=M]').length > 0", timeout=20)
        time.sleep(2)
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        (tmp_path / "dashboard.png").write_bytes(shot)
        if os.environ.get("MORPHO_SCREENSHOT_DIR"):
            Path(os.environ["MORPHO_SCREENSHOT_DIR"], "dashboard.png").write_bytes(shot)
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000

        metrics = browser.evaluate(
            "fetch('/metrics', {credentials: 'same-origin'}).then(r => r.text())")
        line = next(l for l in metrics.splitlines()
                    if l.startswith("pir_batching_policy_info{") and 'lane="interactive"' in l)
        assert f'name="{NEW_POLICY}"' in line and 'mode="slo"' in line
    finally:
        stop.set()
        traffic.join(10)
