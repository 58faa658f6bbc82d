"""Access control and limits: throttled public queries, no keys or answers in logs, authorised
state changes, staff-only admin and dashboard, production settings that refuse to start."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.core.management.utils import get_random_secret_key
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from morpho_pir.dpf import gen_keys
from tests.conftest import REPO, http_json, server_env

# The PIR endpoints are public by design; everything else that changes state is not.
PUBLIC_WRITES = {("/query/page/gpu", "post"), ("/query/page/gpu/batch", "post")}


@pytest.fixture(scope="module")
def throttled_server(start_server, vector_matrix_path, tmp_path_factory):
    var = tmp_path_factory.mktemp("security-var")
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_ENGINE_BACKEND="cpu",
                     MORPHO_QUERY_THROTTLE="6/minute", MORPHO_LOG_LEVEL="DEBUG",
                     MORPHO_VAR_DIR=var, DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    return start_server("runserver", env)


@pytest.mark.processes
def test_public_queries_are_rate_limited_per_client_and_keys_never_logged(throttled_server):
    rng = np.random.default_rng(8)
    keys = [gen_keys(p, 8, rng=rng)[0] for p in (42, 7, 100)]
    body = {"keys": [k.to_bytes().hex() for k in keys]}
    status, _, answer = http_json(throttled_server.url + "/query/page/gpu", body)
    assert status == 200
    bad = {"keys": [keys[0].to_bytes().hex()[:-2], keys[1].to_bytes().hex(), "zz"]}
    assert http_json(throttled_server.url + "/query/page/gpu", bad)[0] == 400
    statuses = []
    for attempt in range(8):
        # A client naming itself another address in X-Forwarded-For is still the same client.
        status, headers, payload = post_json(throttled_server.url + "/query/page/gpu", body,
                                             {"X-Forwarded-For": f"10.9.8.{attempt}"})
        statuses.append(status)
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            assert "throttled" in payload["detail"].lower()
            break
    assert statuses[-1] == 429, statuses
    log = throttled_server.log()
    assert "POST /query/page/gpu" in log  # the log is written, at DEBUG, and says what was asked
    for key in keys:
        assert key.to_bytes().hex()[:40] not in log
    for page in answer["pages"]:
        assert page[2:42] not in log


def post_json(url, body, headers):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _operations():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, methods in schema["paths"].items():
        for method in methods:
            if method in ("post", "put", "patch", "delete"):
                yield path, method


def test_every_state_changing_endpoint_refuses_anonymous_and_unprivileged_users(db, serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    operations = list(_operations())
    assert ("/api/row-updates/", "post") in operations and ("/api/epochs/{id}/activate/", "post") in operations
    anonymous = APIClient()
    plain = APIClient()
    plain.force_authenticate(User.objects.create_user("plain"))
    checked = 0
    for path, method in operations:
        if (path, method) in PUBLIC_WRITES:
            continue
        url = path.replace("{id}", "1")
        response = getattr(anonymous, method)(url, {}, format="json")
        assert response.status_code in (401, 403), (method, path, response.status_code)
        if path.startswith("/api/"):  # operator endpoints also need the model permission
            response = getattr(plain, method)(url, {}, format="json")
            assert response.status_code in (403, 404), (method, path, response.status_code)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("url", ["/admin/", "/admin/epochs/rowupdate/add/", "/dashboard/"])
def test_admin_and_dashboard_need_staff(db, client, url):
    User.objects.create_user("plain", password="pw-plain")
    client.login(username="plain", password="pw-plain")
    response = client.get(url)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def _check(**env):
    base = server_env(MORPHO_VAR_DIR=str(REPO / "var"))
    base.pop("DEBUG", None), base.pop("SECRET_KEY", None), base.pop("ALLOWED_HOSTS", None)
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_production_refuses_debug_default_key_and_no_hosts():
    result = _check(MORPHO_ENV="production", DEBUG="true", ALLOWED_HOSTS=" ")
    assert result.returncode != 0
    assert "refusing to start with MORPHO_ENV=production" in result.stderr
    assert "[morphoweb.E001] DEBUG is on in production" in result.stderr
    assert "[morphoweb.E002] SECRET_KEY is a default that ships in code" in result.stderr
    assert "[morphoweb.E003] ALLOWED_HOSTS is []" in result.stderr


@pytest.mark.processes
def test_production_starts_with_safe_settings_and_local_runs_are_not_checked():
    for key in (secrets.token_urlsafe(50), secrets.token_hex(32), get_random_secret_key()):
        safe = _check(MORPHO_ENV="production", SECRET_KEY=key, ALLOWED_HOSTS="pir.example.org")
        assert safe.returncode == 0, safe.stderr
    local = _check(DEBUG="true")
    assert local.returncode == 0, local.stderr


@pytest.mark.processes
@pytest.mark.parametrize("key, problem", [
    (" " * 34, "has 0 characters besides surrounding whitespace, expected at least 50"),
    ("a" * 40, "has 40 characters besides surrounding whitespace, expected at least 50"),
    ("k" * 60, "has 1 distinct characters, expected at least 20"),
    ("pir-" * 20, "has 4 distinct characters, expected at least 20"),
    ("ab" * 40, "is 80 hex digits with 2 distinct ones, expected at least 64 digits with 10"),
    # a random key's id is fixed: pytest-xdist's workers must collect the same test names
    pytest.param("  " + secrets.token_urlsafe(30) + "  ", "characters besides surrounding whitespace",
                 id="40-random-characters-in-whitespace"),
])
def test_production_refuses_a_secret_key_without_entropy(key, problem):
    result = _check(MORPHO_ENV="production", SECRET_KEY=key, ALLOWED_HOSTS="pir.example.org")
    assert result.returncode != 0
    assert "[morphoweb.E002] SECRET_KEY" in result.stderr and problem in result.stderr


@pytest.mark.processes
@pytest.mark.parametrize("value", ["prod", "Production1", "dev", "staging"])
def test_an_unknown_deployment_kind_is_refused_naming_the_allowed_ones(value):
    result = _check(MORPHO_ENV=value, DEBUG="true")
    assert result.returncode != 0
    assert f"MORPHO_ENV: expected local or production, got {value!r}" in result.stderr
