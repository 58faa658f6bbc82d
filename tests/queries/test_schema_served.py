"""`/api/schema` from a real gunicorn: built once per process, the same bytes to concurrent
readers (drf-spectacular's generator answered 500s when two threads built it at once), and
counted by the anonymous request rate."""
from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import call_command

from tests.conftest import REPO, server_env


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def migrated(tmp_path, **values) -> dict:
    env = server_env(MORPHO_VAR_DIR=tmp_path, **values)
    subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                   env=env, check=True, timeout=300)
    return env


@pytest.mark.processes
def test_concurrent_readers_get_the_schema_built_once(start_server, vector_matrix_path, tmp_path):
    server = start_server("gunicorn", migrated(tmp_path, MORPHO_MATRIX_PATH=vector_matrix_path,
                                               MORPHO_QUERY_THROTTLE="off"))
    assert server.log().count("built the OpenAPI schema") == 1  # at start, before any request
    urls = [server.url + "/api/schema" + ("?format=json" if i % 2 else "") for i in range(96)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(fetch, urls))
    assert {status for status, _ in answers} == {200}
    assert len({body for _, body in answers[0::2]}) == 1  # YAML
    assert len({body for _, body in answers[1::2]}) == 1  # JSON
    assert answers[1][1].startswith(b"{") and b'"/query/page/gpu/batch"' in answers[1][1]
    assert server.log().count("built the OpenAPI schema") == 1


@pytest.mark.processes
def test_the_schema_counts_against_the_anonymous_rate(start_server, vector_matrix_path, tmp_path):
    server = start_server("gunicorn", migrated(tmp_path, MORPHO_MATRIX_PATH=vector_matrix_path,
                                               MORPHO_QUERY_THROTTLE="10/minute"))
    # (the start's /health polls took some of the ten)
    statuses = [fetch(server.url + "/api/schema")[0] for _ in range(11)]
    assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) == {200, 429}


def test_the_schema_says_the_bounds_the_server_checks(client):
    schema = client.get("/api/schema?format=json", SERVER_NAME="localhost").json()
    components = schema["components"]["schemas"]
    keys = components["PageQuery"]["properties"]["keys"]
    assert (keys["minItems"], keys["maxItems"]) == (3, 3)
    queries = components["BatchQuery"]["properties"]["queries"]
    assert (queries["minItems"], queries["maxItems"]) == (1, 32)
    assert "35 + 18 * domain_bits" in keys["items"]["description"]


def test_the_schema_builds_without_a_warning(tmp_path):
    # every web process builds it at start: a warning would be printed at each `make run`
    call_command("spectacular", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
