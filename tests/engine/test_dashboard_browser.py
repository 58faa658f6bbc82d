"""In headless Chromium, against gunicorn serving collected static files as `make run` does: sign
in to the admin (styled: its stylesheet applied, the party named), activate another interactive
policy, open the dashboard and see it named there and in /metrics, the party and its state digest,
its history drawn at load and a p95 over the policy's target in red, grey once traffic stops; no
page loads any asset that answers 4xx/5xx (driven over the DevTools
protocol)."""
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
pytestmark = [pytest.mark.processes, pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                 "(.ci/run installs it: apt-get install -y chromium)")]
websocket = pytest.importorskip("websocket")

NEW_POLICY = "interactive-slo"  # a default policy of the lane, inactive on a fresh database


class DevTools:
    """A minimal DevTools-protocol client over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list = []
        self.urls: dict = {}  # request id -> URL
        self.bad_assets: list = []  # (status or error, URL) of every response that failed

    def _receive(self) -> dict:
        message = json.loads(self.ws.recv())
        method, params = message.get("method"), message.get("params", {})
        if method == "Network.requestWillBeSent":
            self.urls[params["requestId"]] = params["request"]["url"]
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            self.bad_assets.append((params["response"]["status"], params["response"]["url"]))
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            self.bad_assets.append((params.get("errorText"), self.urls.get(params["requestId"])))
        return message

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = self._receive()
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
            self.events.append(self._receive())
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
                     MORPHO_PARTY_NAME="A",
                     DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}", STATIC_ROOT=var / "static")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    # As `make run` and the Docker image do: gather the static files WhiteNoise serves.
    subprocess.run([sys.executable, "manage.py", "collectstatic", "--no-input", "-v", "0"],
                   cwd=REPO, env=env, check=True)
    assert (var / "static" / "admin" / "css" / "base.css").is_file()
    subprocess.run([sys.executable, "manage.py", "shell", "-c",
                    "from django.contrib.auth.models import User; "
                    "User.objects.create_superuser('ops', password='pw-ops-123')"],
                   cwd=REPO, env=env, check=True)
    return start_server("gunicorn", env)


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
        tools.call("Network.enable")
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
    from morpho_pir.dpf import gen_keys

    rng = np.random.default_rng(3)
    while not stop.is_set():
        keys = [gen_keys(int(p), 8, rng=rng)[0].to_bytes().hex() for p in rng.integers(0, 200, 3)]
        http_json(url + "/query/page/gpu", {"keys": keys})
        time.sleep(0.05)


def sign_in(browser, url: str) -> None:
    browser.open(url + "/admin/login/?next=/admin/")
    browser.evaluate("document.getElementById('id_username').value = 'ops';"
                     "document.getElementById('id_password').value = 'pw-ops-123';"
                     "document.querySelector('#login-form').submit()")
    browser.wait_loaded()
    assert browser.evaluate("location.pathname") == "/admin/"


def test_admin_policy_change_shows_on_dashboard_and_metrics(server, browser, tmp_path):
    stop = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(server.url, stop), daemon=True)
    traffic.start()
    try:
        sign_in(browser, server.url)
        # The admin's own stylesheet applied: its header is a flex row and the theme toggle an icon.
        styled = browser.evaluate("""(() => {
            const header = getComputedStyle(document.getElementById('header'));
            const toggle = document.querySelector('.theme-toggle');
            // A sheet that failed to load has no readable rules (reading them throws).
            const loaded = (s) => { try { return s.cssRules.length > 0; } catch (e) { return false; } };
            return {display: header.display, toggle: toggle ? toggle.getBoundingClientRect().height : -1,
                    sheets: [...document.styleSheets].filter(s => s.href && s.href.includes('/static/admin/css/')
                                                            && loaded(s)).length};
        })()""")
        assert styled["display"] == "flex" and 0 < styled["toggle"] < 50 and styled["sheets"] >= 2, styled
        assert browser.evaluate("document.querySelector('#site-name').textContent.trim()") == \
            "morphoweb party A administration"

        browser.open(server.url + "/admin/policies/batchingpolicy/")
        assert "Batching policies" in browser.evaluate("document.querySelector('.breadcrumbs').textContent")
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

        # The epoch the party serves from its file is a record the operator sees.
        browser.open(server.url + "/admin/epochs/epoch/")
        rows = browser.evaluate("""[...document.querySelectorAll('#result_list tbody tr')].map(tr =>
            [tr.querySelector('.field-epoch_id').textContent.trim(), tr.querySelector('.field-state').textContent.trim()])""")
        assert rows == [["5", "active (serving)"]], rows

        # A few seconds of traffic in the server's history, then the page draws them at once, from
        # what it carries, before it polled anything.
        browser.wait_for("""fetch('/dashboard/data', {credentials: 'same-origin'}).then(r => r.json())
            .then(d => d.history.filter(p => p.p95 !== null).length >= 4)""", timeout=30)
        browser.open(server.url + "/dashboard/")
        at_load = browser.evaluate("""(() => {
            const history = JSON.parse(document.getElementById('initial-snapshot').textContent).history;
            const p95 = document.querySelectorAll('#latency-chart path[d^=M]')[1];
            return {points: history.filter(p => p.p95 !== null).length,
                    drawn: p95 ? (p95.getAttribute('d').match(/L/g) || []).length : 0};
        })()""")
        assert at_load["points"] >= 3 and at_load["drawn"] >= 2, at_load
        assert browser.evaluate("document.getElementById('party').textContent") == \
            "morphoweb operator dashboard: party A"
        # the state digest, as every answer of this party carries it
        digest = http_json(server.url + "/epoch")[2]["state"]["digest"]
        assert browser.wait_for("document.getElementById('state-digest')?.textContent") == digest
        browser.wait_for(f"""[...document.querySelectorAll('#policies tr')]
            .some(tr => tr.cells[0]?.textContent === 'interactive' && tr.cells[1]?.textContent === '{NEW_POLICY}')""")
        # The picture is taken once polls have drawn the latency and the rate lines.
        browser.wait_for("document.querySelectorAll('#latency-chart path[d^=M]').length > 0", timeout=20)
        browser.wait_for("document.querySelectorAll('#rate-chart path[d^=M]').length > 0", timeout=20)
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
        assert browser.evaluate("document.querySelectorAll('#latency-chart circle.over-target').length") == 0

        # A target no query can meet: the dashboard flags the p95 above it in red.
        browser.open(server.url + "/admin/policies/batchingpolicy/")
        href = browser.evaluate(f"""[...document.querySelectorAll('#result_list a')]
            .find(a => a.textContent.trim() === '{NEW_POLICY}').getAttribute('href')""")
        browser.open(server.url + href)
        browser.evaluate("document.getElementById('id_p95_target_ms').value = '0.1';"
                         "document.getElementById('batchingpolicy_form').submit()")
        browser.wait_loaded()
        assert "was changed successfully" in browser.evaluate("document.querySelector('.messagelist')?.textContent || ''")
        browser.open(server.url + "/dashboard/")
        browser.wait_for("document.querySelectorAll('#latency-chart circle.over-target').length > 0", timeout=30)
        flagged = browser.wait_for("document.querySelector('#p95-now .over')?.textContent")
        assert "target 0.1 ms" in flagged
        assert browser.evaluate("getComputedStyle(document.querySelector('#latency-chart circle.over-target')).fill") \
            == "rgb(201, 42, 42)"
        if os.environ.get("MORPHO_SCREENSHOT_DIR"):
            shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
            Path(os.environ["MORPHO_SCREENSHOT_DIR"], "dashboard-over-target.png").write_bytes(shot)

        # Traffic stops: the headline says since when, in grey, and no longer flags red.
        stop.set()
        traffic.join(10)
        stale = browser.wait_for("document.querySelector('#p95-now .stale')?.textContent", timeout=30)
        assert stale.startswith("no queries for ") and "target 0.1 ms" in stale, stale
        assert browser.evaluate("document.querySelector('#p95-now .over')") is None
        if os.environ.get("MORPHO_SCREENSHOT_DIR"):
            shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
            Path(os.environ["MORPHO_SCREENSHOT_DIR"], "dashboard-after-traffic.png").write_bytes(shot)
    finally:
        stop.set()
        traffic.join(10)
    assert not browser.bad_assets, browser.bad_assets


def test_landing_page_and_api_docs_load_every_asset(server, browser):
    browser.open(server.url + "/")
    assert browser.evaluate("document.title") == "morphoweb party A"
    links = browser.evaluate("[...document.querySelectorAll('#links a')].map(a => a.getAttribute('href'))")
    assert {"/dashboard/", "/admin/", "/api/docs", "/api/schema", "/health", "/epoch"} <= set(links)
    browser.open(server.url + "/api/docs")
    # Swagger UI's script ran (served by this server): the API's title is rendered.
    title = browser.wait_for("document.querySelector('.swagger-ui .info .title')?.textContent", timeout=30)
    assert "morphoweb" in title
    sign_in(browser, server.url)
    for page in ("/admin/epochs/epoch/", "/admin/queries/bulkjob/", "/admin/auth/user/add/"):
        browser.open(server.url + page)
    # The active bulk policy's delete page, by its URL: back on its change form, the admin's own
    # error message, no JSON.
    browser.open(server.url + "/admin/policies/batchingpolicy/?lane__exact=bulk&active__exact=1")
    change = browser.evaluate("new URL(document.querySelector('#result_list tbody a').href).pathname")
    browser.open(server.url + change.replace("/change/", "/delete/"))
    assert browser.evaluate("location.pathname") == change
    message = browser.evaluate("document.querySelector('.messagelist .error')?.textContent")
    assert message == ("Not deleted: bulk-throughput is the active bulk policy: activate another "
                       "one for the lane before deleting it."), message
    if os.environ.get("MORPHO_SCREENSHOT_DIR"):
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        Path(os.environ["MORPHO_SCREENSHOT_DIR"], "admin-delete-active.png").write_bytes(shot)
    assert not browser.bad_assets, browser.bad_assets
