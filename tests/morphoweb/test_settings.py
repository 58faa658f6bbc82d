"""Settings from the environment: bad values refused with a message, every variable documented."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from morphoweb.envcheck import parse_rate
from tests.conftest import REPO, server_env

# A production party that starts: every check of morphoweb/checks.py passes.
PRODUCTION = {"MORPHO_ENV": "production", "ALLOWED_HOSTS": "pir.example.org",
              "SECRET_KEY": "k3Jx9-qLw2Zr8vTn5YbHc7_MfPd4sGa6EuRiWo1Ay0XeBt3NlVh2CjQ8KzUm5DpF"}


def check(**env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env=server_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.processes
@pytest.mark.parametrize("env, message", [
    ({"MORPHO_MAX_BATCH": "33"}, "MORPHO_MAX_BATCH: expected an integer in 1..32, got 33"),
    ({"MORPHO_MAX_BATCH": "many"}, "MORPHO_MAX_BATCH: expected an integer, got 'many'"),
    ({"MORPHO_ENGINE_BACKEND": "tpu"}, "MORPHO_ENGINE_BACKEND: expected auto, cpu or cuda, got 'tpu'"),
    ({"MORPHO_V2_SCAN": "fast"}, "MORPHO_V2_SCAN: expected auto, mma or alu, got 'fast'"),
    ({"MORPHO_MATRIX_LAYOUT": "tiles"}, "MORPHO_MATRIX_LAYOUT: expected auto, pages or fragments, got 'tiles'"),
    ({"DEBUG": "maybe"}, "DEBUG: expected true/false"),
    ({"MORPHO_QUERY_TIMEOUT": "-1"}, "MORPHO_QUERY_TIMEOUT: expected a number >= 0.001, got -1.0"),
    # A rate DRF cannot read made every request a 500 (/health too); 0 made every one a 429.
    *[({name: value}, f"{name}: expected N/second, N/minute, N/hour or N/day with N >= 1, or off, "
                      f"got {value!r}")
      for name in ("MORPHO_QUERY_THROTTLE", "MORPHO_BULK_SUBMIT_THROTTLE")
      for value in ("abc", "5/fortnight", "0/second", "5", "/second", "-1/hour")],
    ({"ALLOWED_HOSTS": "pir.example.org,.com"}, "ALLOWED_HOSTS: expected a domain of at least two "
                                                "labels after a leading dot (.example.org), got '.com'"),
    ({"ALLOWED_HOSTS": "https://pir.example.org"}, "ALLOWED_HOSTS: expected a host name or address "
                                                   "without scheme, port or path"),
    ({"ALLOWED_HOSTS": "pir.example.org:8000"}, "ALLOWED_HOSTS: expected a host name or address"),
])
def test_bad_setting_is_refused_with_its_name(env, message):
    result = check(**env)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize("value, rate", [("5/Min", "5/minute"), (" 7 / hours ", "7/hour"),
                                         ("1/d", "1/day"), ("OFF", None)])
def test_rates_are_read_as_the_throttles_read_them(value, rate):
    assert parse_rate("MORPHO_QUERY_THROTTLE", value) == rate


@pytest.mark.processes
@pytest.mark.parametrize("name, meant", [
    ("MORPHO_QUERY_THROTLE", "MORPHO_QUERY_THROTTLE"), ("DJANGO_DEBUG", "DEBUG"),
    ("ALLOWED_HOST", "ALLOWED_HOSTS"), ("SECRETKEY", "SECRET_KEY"), ("MORPHO_ENVIRONMENT", "MORPHO_ENV"),
])
def test_a_misspelled_setting_is_named_locally_and_refused_in_production(name, meant):
    local = check(**{name: "production"})
    assert local.returncode == 0, local.stderr
    line = f"{name} is not a setting this server reads (did you mean {meant}?)"
    assert f"morphoweb settings: warning: {line}" in local.stderr
    production = check(**{name: "1", **PRODUCTION})
    assert production.returncode != 0
    assert f"refusing to start with MORPHO_ENV=production: {line}" in production.stderr


@pytest.mark.processes
def test_names_of_the_shell_and_of_our_other_programs_are_no_misspelling():
    result = check(LANG="C.UTF-8", SHELL="/bin/sh", MORPHO_WEB_WORKERS="2", DJANGO_SUPERUSER_EMAIL="a@b.c",
                   DJANGO_SETTINGS_MODULE="morphoweb.settings", **PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr


@pytest.mark.processes
def test_defaults_pass_the_system_check():
    result = check()
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_every_environment_variable_is_documented_in_the_operations_page():
    source = (REPO / "morphoweb" / "settings.py").read_text()
    names = set(re.findall(r'_env\w*\(\s*"([A-Z][A-Z0-9_]+)"', source))
    names |= set(re.findall(r'os\.environ\.get\(\s*"([A-Z][A-Z0-9_]+)"', source))
    assert {"MORPHO_MATRIX_PATH", "DATABASE_URL", "CELERY_BROKER_URL"} <= names
    page = (REPO / "docs" / "OPERATIONS.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", page, flags=re.M))
    assert sorted(names - documented) == []


@pytest.mark.django_db
@pytest.mark.parametrize("scan, layout", [("alu", "pages"), ("mma", "fragments")])
def test_the_v2_scan_and_layout_settings_reach_the_backend_the_engine_makes(serve_matrix, vector_matrix_path,
                                                                            monkeypatch, scan, layout):
    from engine.holder import get_engine
    from gpu_engine.backends import factory

    made, real = [], factory.create_backend

    def spy(name="auto", device=None, v2_scan="auto", layout="pages"):
        made.append((v2_scan, layout))
        return real("cpu", v2_scan=v2_scan, layout=layout)

    monkeypatch.setattr("gpu_engine.backends.factory.create_backend", spy)
    serve_matrix(vector_matrix_path, MORPHO_V2_SCAN=scan, MORPHO_MATRIX_LAYOUT=layout)
    assert get_engine() is not None and made == [(scan, layout)]
