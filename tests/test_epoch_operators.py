"""Epoch switches as an operator meets them: load_epoch refuses a database that is missing, as the
other commands that write to a party's database do."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, server_env


def test_load_epoch_refuses_a_missing_database_without_creating_it(tmp_path):
    db = tmp_path / "db.sqlite3"
    (tmp_path / "m").mkdir()
    result = subprocess.run(
        [sys.executable, "manage.py", "load_epoch", str(tmp_path / "m" / "e.bin"), "--activate"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=server_env(DATABASE_URL=f"sqlite:///{db}", MORPHO_MATRIX_DIR=tmp_path / "m"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"CommandError: the database {db} does not exist. `make run` "
                                    "keeps its parties' epochs in var/party-a.sqlite3 and "
                                    "var/party-b.sqlite3: `make epoch MATRIX=FILE` records and "
                                    "activates an epoch on both")
    assert not db.exists()
