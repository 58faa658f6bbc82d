"""Benchmarks are in benchmarks/, not the installed packages; each shows its command and figure."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from setuptools import find_namespace_packages, find_packages

from benchmarks import backend_batch
from tests.conftest import REPO, wait_until

BENCHMARKS = REPO / "benchmarks"
RESULTS = REPO / "docs" / "benchmarks"
# what a reader runs: shell scripts with a #! line (one without is sourced by them) and Python
# files with a main guard (one without is imported by them)
SCRIPTS = sorted(p for p in BENCHMARKS.iterdir()
                 if (p.suffix == ".sh" and p.read_text().startswith("#!"))
                 or (p.suffix == ".py" and 'if __name__ == "__main__":' in p.read_text()))
PY_SCRIPTS = [p for p in SCRIPTS if p.suffix == ".py"]
# Where a reader is told to run something: every benchmarks/... path named there must exist.
DOCUMENTS = [REPO / "README.md", REPO / "Makefile", BENCHMARKS / "README.md",
             *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]


def installed_packages() -> list[str]:
    """The packages a wheel of this checkout holds, found as pyproject's packages.find does."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return finder(where=str(REPO), include=find.get("include", ("*",)),
                  exclude=find.get("exclude", ()))


def test_the_installed_packages_hold_no_benchmark():
    # A folder left with only __pycache__ (a checkout that had gpu_engine/bench) ships no code.
    packages = [p for p in installed_packages() if any((REPO / p.replace(".", "/")).glob("*.py"))]
    assert {"gpu_engine", "gpu_engine.backends", "queries", "policies", "epochs",
            "morphoweb"} <= set(packages)
    assert [p for p in packages if "bench" in p] == []
    modules = [path.relative_to(REPO).as_posix() for package in packages
               for path in (REPO / package.replace(".", "/")).glob("*.py") if "bench" in path.stem]
    assert modules == []


def test_backend_batch_runs_on_the_cpu_backend(tmp_path):
    out = tmp_path / "bench.csv"
    argv = ["--backend", "cpu", "--pages", "40", "--q", "1,2", "--repeat", "1",
            "--dispatch", "micro_batch=0,streams=1,graph=1", "--out", str(out)]
    assert backend_batch.main(argv) == 0
    lines = out.read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    assert [h.split(":")[0] for h in header] == ["# gpu", "# shape", "# backend", "# dispatch",
                                                 "# command", "# date"]
    assert "pages=40, domain_bits=6" in header[1] and "graph=True" in header[3]
    assert header[4] == "# command: python3 benchmarks/backend_batch.py " + " ".join(argv)
    rows = [line.split(", ") for line in lines if not line.startswith("#")]
    assert rows[0] == list(backend_batch.CSV_COLUMNS)
    assert [r[0] for r in rows[1:]] == ["1", "2"] and all(r[-1] == "True" for r in rows[1:])
    with pytest.raises(ValueError, match="unknown dispatch field"):
        backend_batch.parse_dispatch("streams=2,lanes=3")


@pytest.mark.processes
@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_each_script_runs_as_a_file_from_anywhere(script, tmp_path):
    # Not installed: the script itself makes the checkout importable, whatever the working folder.
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_shows_its_command_and_is_listed(script):
    head = script.read_text()[:1500]
    runner = "bash" if script.suffix == ".sh" else "python3?"
    assert re.search(rf"\b{runner} benchmarks/{re.escape(script.name)}\b", head), \
        f"{script.name}: its docstring shows no command"
    listed = (BENCHMARKS / "README.md").read_text()
    assert f"`{script.name}`" in listed, f"benchmarks/README.md has no line for {script.name}"


def test_every_benchmark_path_named_in_the_docs_exists():
    for document in DOCUMENTS:
        text = document.read_text()
        # no command that runs a benchmark from where it used to be, inside the packages
        old = re.findall(r"python3? -m (?:gpu_engine\.bench|policies\.bench_http"
                         r"|queries\.(?:bulk_bench|bench_http))|bash gpu_engine/bench/", text)
        assert old == [], f"{document.name}: {old}"
        # (a path after `git show REV:` is one git keeps, not one the checkout has)
        for name in re.findall(r"(?<![\w/:])benchmarks/([\w.-]+\.(?:py|sh|md))", text):
            assert (BENCHMARKS / name).exists(), f"{document.name} names benchmarks/{name}"
        for name in re.findall(r"(?<!:)docs/benchmarks/([\w.-]+\.(?:csv|png|md))", text):
            assert (RESULTS / name).exists(), f"{document.name} names docs/benchmarks/{name}"


def test_the_index_says_what_each_results_file_shows():
    index = (RESULTS / "INDEX.md").read_text()
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "INDEX.md")
    lines = {name: [line for line in index.splitlines() if f"`{name}`" in line] for name in files}
    undescribed = [name for name, found in lines.items() if not found]
    assert undescribed == [], "files INDEX.md does not describe"
    named = set(re.findall(r"^\| `([^`]+)` \|", index, re.M))  # the first column of the table
    assert sorted(named - set(files)) == [], "INDEX.md describes files that are not there"


def test_placement_runs_on_simulated_cpu_devices(tmp_path):
    from benchmarks import placement

    out = tmp_path / "placement.csv"
    argv = ["--backend", "cpu", "--devices", "0,1", "--pages", "1000", "--q", "1,2", "--repeat", "1",
            "--seconds", "0.05", "--out", str(out)]
    assert placement.main(argv) == 0
    lines = out.read_text().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("#")] == [
        "# gpu", "# shape", "# backend", "# command", "# date"]
    rows = [line.split(", ") for line in lines if not line.startswith("#")]
    assert rows[0] == list(placement.CSV_COLUMNS)
    assert [(r[0], r[2], r[-1]) for r in rows[1:]] == [
        (name, q, "True") for name in ("one", "shard", "replicate") for q in ("1", "2")]
    assert all(r[5] == "1.0" for r in rows[1:3])  # the one device against itself


def test_epoch_switch_answers_from_both_epochs_and_none_wrong_on_simulated_cpu_devices(tmp_path):
    from benchmarks import epoch_switch
    from benchmarks.report import read_csv

    out = tmp_path / "switch.csv"
    argv = ["--backend", "cpu", "--devices", "0,1", "--pages", "1000", "--placement", "shard",
            "--clients", "3", "--before", "0.3", "--after", "0.3", "--key-format", "v2",
            "--out", str(out)]
    assert epoch_switch.main(argv) == 0
    header, rows = read_csv(out)
    assert header["shape"] == ("pages=1000, domain_bits=10, placement=shard, devices=0,1, "
                               "clients=3, keys=v2")
    assert len(header["switches (s from asking to serving)"].split(", ")) == 2
    by_phase = {row["phase"]: row for row in rows}
    assert list(by_phase) == ["before", "loading_1", "serving_1", "loading_2", "serving_2", "all"]
    whole = by_phase["all"]
    assert whole["wrong"] == "0" and int(whole["requests"]) > 0
    for column in ("requests", "from_epoch_1", "from_epoch_2", "refused"):  # phases partition all
        assert sum(int(row[column]) for row in rows[:-1]) == int(whole[column]), column
    # served epoch 1, then 2, then 1 again: answers came from both, the last ones from epoch 1
    assert int(whole["from_epoch_1"]) > 0 and int(whole["from_epoch_2"]) > 0
    assert by_phase["serving_2"]["from_epoch_2"] == "0"


def test_variant_rows_read_back_as_one_field_a_variant():
    import csv

    from benchmarks.variant_times import COLUMNS, csv_row

    rows = [csv_row("default", 8, [28.0, 27.5, 28.5], [28.2, 28.3, 28.1], [28.5, 28.6, 28.4], True),
            csv_row("V1P_ROWS=2,V1F_XOR_PREFETCH=3", 32, [93.0], [93.5], [94.0], False)]
    header, *read = list(csv.reader([COLUMNS, *rows]))
    assert [dict(zip(header, row)) for row in read] == [
        {"variant": "default", "q": "8", "scan_ms_median": "28.000", "scan_ms_min": "27.500",
         "gpu_ms_median": "28.200", "wall_ms_median": "28.500", "qps_wall": "280.7", "same_answers": "True"},
        {"variant": "V1P_ROWS=2,V1F_XOR_PREFETCH=3", "q": "32", "scan_ms_median": "93.000",
         "scan_ms_min": "93.000", "gpu_ms_median": "93.500", "wall_ms_median": "94.000", "qps_wall": "340.4",
         "same_answers": "False"}]


def test_sustained_runs_each_q_for_its_seconds_and_checks_answers_on_the_cpu_backend(tmp_path):
    from benchmarks import sustained

    out = tmp_path / "sustained.csv"
    argv = ["--backend", "cpu", "--pages", "40", "--q", "2,1", "--seconds", "0.2", "--out", str(out)]
    assert sustained.main(argv) == 0
    lines = out.read_text().splitlines()
    assert lines[4] == "# command: python3 benchmarks/sustained.py " + " ".join(argv)
    rows = [dict(zip(sustained.CSV_COLUMNS, line.split(", "))) for line in lines if not line.startswith("#")]
    assert len(rows) == 3 and list(rows[0].values()) == list(sustained.CSV_COLUMNS)
    for row, q in zip(rows[1:], (2, 1)):
        assert row["q"] == str(q) and row["answers_ok"] == "True"
        assert int(row["batches"]) >= sustained.MIN_BATCHES and float(row["seconds"]) >= 0.1
        # the steady rate is the second half's median batch, each figure rounded on its own
        ms = float(row["steady_ms"])
        assert q * 1e3 / (ms + 5e-4) - 0.05 <= float(row["steady_qps"]) <= q * 1e3 / (ms - 5e-4) + 0.05
        assert row["steady_sm_mhz"] == row["steady_power_w"] == row["steady_power_capped"] == ""  # no GPU sampled


def test_sustained_times_the_batches_after_the_checked_pair_and_takes_the_second_half(monkeypatch):
    import types

    import numpy as np

    from benchmarks import sustained

    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(sustained, "time", types.SimpleNamespace(perf_counter=lambda: clock.t,
                                                                  time=lambda: 1000.0 + clock.t))
    monkeypatch.setattr(sustained, "KeyBatch", types.SimpleNamespace(from_keys=lambda keys: keys))

    class Resident:  # each answer takes the next duration (s), the two checked batches first
        def __init__(self, durations):
            self.durations = iter(durations)

        def answer(self, batch, dispatch):
            clock.t += next(self.durations)
            return np.array([[1, 2]], np.uint8) if batch == "party 0" else np.array([[3, 3]], np.uint8)

    queries = types.SimpleNamespace(party0="party 0", party1="party 1", targets=[7])
    resident = Resident([0.001, 0.001, 0.003, 0.002, 0.004, 0.006, 0.008])
    row, window = sustained.run_q(resident, {7: bytes([2, 1])}.get, queries, 1, None, seconds=0.016)
    # batches run until 0.018 s: 3, 2, 4, 6 ms end at 0.017, so a fifth (8 ms) runs; the steady half is 4, 6, 8
    assert row == {"q": 1, "batches": 5, "seconds": 0.02, "first_ms": 3.0, "median_ms": 4.0, "steady_ms": 6.0,
                   "steady_qps": 166.7, "answers_ok": True}
    assert window == (pytest.approx(1000.007), pytest.approx(1000.025))  # the third batch's start to the end
    # batches slower than --seconds: MIN_BATCHES all the same; a wrong XOR is reported
    clock.t = 0.0
    row, _ = sustained.run_q(Resident([0.001, 0.001] + [0.5] * 9), {7: bytes([2, 2])}.get, queries, 2, None,
                             seconds=0.1)
    assert row["batches"] == sustained.MIN_BATCHES and row["steady_qps"] == 4.0 and row["answers_ok"] is False


def test_sustained_samples_the_backends_gpu_by_bus_id_and_reads_the_samples_at_stop(tmp_path, monkeypatch, capsys):
    import os

    from benchmarks.sustained import POWER_CAP_REASON, GpuSampler

    smi = tmp_path / "nvidia-smi"  # prints two samples and keeps running, as nvidia-smi -lms does
    smi.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
                   'echo "2026/11/28 08:37:44.501, 1830, 694.10, 0x0000000000000004"\n'
                   'echo "2026/11/28 08:37:44.601, 1980, 681.00, 0x0000000000000000"\n'
                   'touch "$(dirname "$0")/written"\nexec sleep 30\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sampler = GpuSampler("00000000:3B:00.0")
    wait_until((tmp_path / "written").exists, 30, "the fake nvidia-smi has not written its samples")
    sampler.stop()
    sampler.stop()  # a second stop does nothing
    assert (tmp_path / "args").read_text().split()[:2] == ["-i", "00000000:3B:00.0"]
    assert [s[1:] for s in sampler.samples] == [(1830.0, 694.1, POWER_CAP_REASON), (1980.0, 681.0, 0)]
    smi.write_text("#!/bin/sh\necho 'Field \"clocks_throttle_reasons.active\" is not a valid field'\nexit 2\n")
    failed = GpuSampler("00000000:3B:00.0")
    # stopped after it exited on its own, as nvidia-smi does on a field it does not know
    wait_until(lambda: failed._proc.poll() is not None, 30, "the fake nvidia-smi has not exited")
    failed.stop()
    assert failed.samples == [] and "nvidia-smi gave no samples (exit 2): Field" in capsys.readouterr().err
    assert GpuSampler(None).samples == [] and GpuSampler(None).stop() is None  # the cpu backend: no sampling


def test_sustained_summarises_the_samples_inside_a_window():
    import datetime

    from benchmarks.sustained import POWER_CAP_REASON, GpuSampler, parse_samples

    smi = ("2026/11/28 08:37:44.501, 675, 669.12, 0x0000000000000004\n"
           "2026/11/28 08:37:44.601, 1155, [N/A], 0x0000000000000004\n2026/11/28 08:37:44.7")
    when = datetime.datetime(2026, 11, 28, 8, 37, 44, 501000).timestamp()
    assert parse_samples(smi) == [(when, 675.0, 669.12, POWER_CAP_REASON)]  # a field missing, a line cut short

    sampler = GpuSampler(None)
    sampler.samples = [(9.9, 1980.0, 300.0, 0), (10.0, 1800.0, 690.0, POWER_CAP_REASON),
                       (10.1, 1900.0, 700.0, POWER_CAP_REASON | 0x1), (10.2, 1980.0, 650.0, 0), (11.0, 345.0, 80.0, 1)]
    assert sampler.summary(10.0, 10.2) == {"steady_sm_mhz": 1893, "steady_power_w": 680, "steady_power_capped": 0.67}
    assert sampler.summary(20.0, 21.0) == {"steady_sm_mhz": "", "steady_power_w": "", "steady_power_capped": ""}


def test_fold_keeps_each_runs_lines_and_labels_its_rows_and_refuses_other_columns(tmp_path):
    from benchmarks import fold

    a, b, other = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "other.csv"
    a.write_text("# gpu: one\n# date: 1\nq, qps\n1, 10\n8, 80\n")
    b.write_text("# gpu: two\n# date: 2\nq, qps\n1, 11\n")
    other.write_text("# gpu: three\nq, ms\n1, 5\n")
    out = tmp_path / "folded.csv"
    assert fold.main(["--out", str(out), "--columns", "machine,keys", f"1,v1={a}", f"2,v2={b}"]) == 0
    assert out.read_text().splitlines()[:5] == [
        "# part machine=1 keys=v1: gpu: one", "# part machine=1 keys=v1: date: 1",
        "# part machine=2 keys=v2: gpu: two", "# part machine=2 keys=v2: date: 2", "machine,keys,q,qps"]
    parts = fold.read_parts(out)
    assert [(labels, header["gpu"], [r["qps"] for r in rows]) for labels, header, rows in parts] == [
        ({"machine": "1", "keys": "v1"}, "one", ["10", "80"]), ({"machine": "2", "keys": "v2"}, "two", ["11"])]
    assert fold.read_parts(a) == [({}, {"gpu": "one", "date": "1"}, [{"q": "1", "qps": "10"}, {"q": "8", "qps": "80"}])]
    with pytest.raises(SystemExit, match="differ"):
        fold.main(["--out", str(out), "--columns", "machine", f"1={a}", f"2={other}"])
