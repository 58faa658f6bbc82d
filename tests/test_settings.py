"""Settings from the environment: bad values refused with a message, every variable documented."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, server_env


def check(**env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env=server_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.processes
@pytest.mark.parametrize("env, message", [
    ({"MORPHO_MAX_BATCH": "33"}, "MORPHO_MAX_BATCH: expected an integer in 1..32, got 33"),
    ({"MORPHO_MAX_BATCH": "many"}, "MORPHO_MAX_BATCH: expected an integer, got 'many'"),
    ({"MORPHO_ENGINE_BACKEND": "tpu"}, "MORPHO_ENGINE_BACKEND: expected auto, cpu or cuda, got 'tpu'"),
    ({"MORPHO_V2_SCAN": "fast"}, "MORPHO_V2_SCAN: expected auto, mma or alu, got 'fast'"),
    ({"MORPHO_MATRIX_LAYOUT": "tiles"}, "MORPHO_MATRIX_LAYOUT: expected pages or fragments, got 'tiles'"),
    ({"DEBUG": "maybe"}, "DEBUG: expected true/false"),
    ({"MORPHO_QUERY_TIMEOUT": "-1"}, "MORPHO_QUERY_TIMEOUT: expected a number >= 0.001, got -1.0"),
])
def test_bad_setting_is_refused_with_its_name(env, message):
    result = check(**env)
    assert result.returncode != 0
    assert message in result.stderr


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
    from gpu_engine import backends

    made, real = [], backends.create_backend

    def spy(name="auto", device=None, v2_scan="auto", layout="pages"):
        made.append((v2_scan, layout))
        return real("cpu", v2_scan=v2_scan, layout=layout)

    monkeypatch.setattr("gpu_engine.backends.create_backend", spy)
    serve_matrix(vector_matrix_path, MORPHO_V2_SCAN=scan, MORPHO_MATRIX_LAYOUT=layout)
    assert get_engine() is not None and made == [(scan, layout)]
