"""A 500 is a bug, and a bug is logged: every 500 leaves its traceback in a real server's log with
DEBUG off; inputs that Python itself refuses to convert are the client's 400, not a 500."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tests.conftest import REPO, server_env


@pytest.mark.django_db
@pytest.mark.parametrize("digits", [4301, 20000])
def test_a_bulk_json_integer_too_long_for_python_is_a_400(digits, serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    user = User.objects.create_user("bulk-int")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    body = '{"queries": [{"keys": [' + "7" * digits + "]}]}"
    response = client.post("/bulk/jobs", body, content_type="application/json")
    assert response.status_code == 400, response.content
    error = response.json()["errors"][0]
    assert (error["field"], error["code"]) == ("body", "parse_error")
    assert "integer string conversion" in error["message"]


@pytest.mark.processes
def test_every_500_is_logged_with_its_traceback_with_debug_off(start_server, vector_matrix_path,
                                                                tmp_path):
    env = server_env(MORPHO_MATRIX_PATH=vector_matrix_path, MORPHO_VAR_DIR=tmp_path, DEBUG="false",
                     DJANGO_SETTINGS_MODULE="tests.settings_raising")
    subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                   env=env, check=True, timeout=300)
    server = start_server("gunicorn", env)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(server.url + "/raise", timeout=30)
    assert caught.value.code == 500
    assert json.loads(caught.value.read()) == {"detail": "internal server error"}
    log = server.log()
    assert "Internal Server Error: /raise" in log
    assert "Traceback (most recent call last)" in log
    assert "RuntimeError: a bug the logs must show" in log
    # A client's mistake is no bug: a 400 stays out of the error log.
    bad = urllib.request.Request(server.url + "/query/page/gpu", data=b'{"keys": 1}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(bad, timeout=30)
    assert caught.value.code == 400
    assert "Bad Request" not in server.log()
