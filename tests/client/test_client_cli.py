"""The morpho-client command's options: what means nothing together is refused, not ignored."""
from __future__ import annotations

import subprocess
import sys

import pytest

from morpho_client import cli

A, B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"


@pytest.mark.parametrize("extra, message", [
    (["--row", "1", "--timeout", "0"], "argument --timeout: expected a number of seconds, above 0, got '0'"),
    (["--row", "1", "--timeout", "inf"], "argument --timeout: expected a number of seconds, above 0"),
    (["--row", "1", "--switch-deadline", "-1"], "expected a number of seconds, 0 or more, got '-1'"),
    (["--row", "1", "--in-flight", "65"], "argument --in-flight: expected a whole number in 1..64"),
    (["--row", "1", "--state", "s.json"], "--state is for bulk jobs: give --bulk FILE"),
    (["--row", "1", "--token-a", "t"], "--token-a is for bulk jobs: give --bulk FILE"),
    (["--rows", "r.txt", "--batch"], "--batch is for --row: --rows always sends batch queries"),
    (["--bulk", "r.txt", "--key-format", "v2"], "--key-format v2 cannot be used with --bulk"),
    (["--bulk", "r.txt", "--encoding", "binary"], "--encoding is for queries: bulk jobs are sent"),
    (["--bulk", "r.txt", "--in-flight", "4"], "--in-flight is for queries"),
    (["--row", "1", "--rows", "r.txt"], "one of the five"),
    ([], "one of the five"),
])
def test_options_that_mean_nothing_together_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--server-a", A, "--server-b", B, *extra])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_every_option():
    done = subprocess.run([sys.executable, "-m", "morpho_client", "--help"], capture_output=True,
                          text=True, timeout=60, check=True)
    for option in ("--row", "--rows", "--bulk", "--out", "--quiet", "--verbose", "--batch",
                   "--timeout", "--encoding", "--key-format", "--in-flight", "--switch-deadline",
                   "--state", "--token-a", "--token-b", "--poll", "--key", "--keys", "--planners"):
        assert option in done.stdout, option
    assert done.stdout.startswith("usage: morpho-client")
    # what a lookup prints and exits with, in lines a terminal shows whole
    assert "`key 0x...: 0x... (type T)`" in done.stdout
    assert "every key looked up, found or absent" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 100


def test_the_bar_is_on_stderr_and_off_where_it_means_nothing(capsys):
    with cli.progress_bar(640, True) as bar:
        bar.update(640)
    assert "640/640" in capsys.readouterr().err
    with cli.progress_bar(640, False) as bar:  # --quiet, or stderr not a terminal
        assert bar is None
    with cli.progress_bar(10, True) as bar:  # too few rows for a bar
        assert bar is None
