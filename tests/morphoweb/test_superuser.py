"""Admin users and tokens: `make superuser` on both parties, and no traceback or empty database
left behind by createsuperuser / drf_create_token on a database that is missing or not migrated."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import REPO, server_env

pytestmark = pytest.mark.processes


def manage(*args, db, **env):
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False,
                          env=server_env(DATABASE_URL=f"sqlite:///{db}", **env))


@pytest.mark.parametrize("command", [
    ["createsuperuser", "--noinput", "--username", "admin", "--email", "a@example.org"],
    ["drf_create_token", "admin"],
    ["changepassword", "admin"],
])
def test_a_missing_database_is_refused_and_not_created(tmp_path, command):
    db = tmp_path / "db.sqlite3"
    result = manage(*command, db=db)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"CommandError: the database {db} does not exist. `make run` "
                                    "keeps its parties' users in var/party-a.sqlite3 and "
                                    "var/party-b.sqlite3: `make superuser` creates")
    assert not db.exists()


def test_an_unmigrated_database_is_refused_with_what_to_do(tmp_path):
    db = tmp_path / "db.sqlite3"
    sqlite3.connect(db).close()  # an empty file, as the old createsuperuser left behind
    result = manage("createsuperuser", "--noinput", "--username", "admin", "--email", "", db=db)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"CommandError: the database {db} is not migrated (" in result.stderr
    assert "run `python manage.py migrate` first" in result.stderr


def test_commands_work_on_a_migrated_database(tmp_path):
    db = tmp_path / "db.sqlite3"
    assert manage("migrate", "--no-input", "-v0", db=db).returncode == 0
    created = manage("createsuperuser", "--noinput", "--username", "root", "--email", "", db=db,
                     DJANGO_SUPERUSER_PASSWORD="a-long-password-1")
    assert created.returncode == 0, created.stderr
    assert "Superuser created successfully." in created.stdout
    again = manage("createsuperuser", "--noinput", "--username", "root", "--email", "", db=db)
    assert again.returncode == 1 and "That username is already taken" in again.stderr
    kept = manage("createsuperuser", "--noinput", "--if-missing", "--username", "root",
                  "--email", "", db=db)
    assert kept.returncode == 0 and kept.stdout.strip() == "user root exists; kept as it is"


def users_and_tokens(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT u.username, u.is_superuser, u.is_staff, t.key FROM auth_user u "
            "LEFT JOIN authtoken_token t ON t.user_id = u.id").fetchall()


def test_make_superuser_makes_a_user_and_token_on_both_parties(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "MORPHO_VAR_DIR")}
    env["DJANGO_SUPERUSER_PASSWORD"] = "a-long-password-2"
    argv = ["make", "--no-print-directory", "-o", ".venv/.installed-stamp", "superuser",
            f"PY={sys.executable}", f"PARTY_DB_DIR={tmp_path}", "SUPERUSER=operator"]
    runs = [subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                           check=False) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    tokens = {}
    for party in "ab":
        rows = users_and_tokens(tmp_path / f"party-{party}.sqlite3")
        assert [row[:3] for row in rows] == [("operator", 1, 1)]
        tokens[party] = rows[0][3]
    assert tokens["a"] != tokens["b"]  # each party is its own operator
    printed = [f"Generated token {tokens[p]} for user operator" for p in "ab"]
    first = runs[0].stdout.splitlines()
    assert first == [f"party a: {tmp_path}/party-a.sqlite3", "Superuser created successfully.",
                     printed[0],
                     f"party b: {tmp_path}/party-b.sqlite3", "Superuser created successfully.",
                     printed[1]]
    # A second run keeps the users and prints the same tokens.
    assert runs[1].stdout.splitlines() == [first[0], "user operator exists; kept as it is",
                                           printed[0], first[3],
                                           "user operator exists; kept as it is", printed[1]]
