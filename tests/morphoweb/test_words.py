"""Words a user reads: the backend's fallback reason once, worker names as documented, plurals."""
from __future__ import annotations

import importlib.util
import logging
import re
import sys
from importlib.machinery import SourceFileLoader

import pytest

from gpu_engine.backends.factory import create_backend
from gpu_engine.scheduler import LanePolicy, PolicyError, plain_number
from tests.conftest import REPO


def _gpu_workers():
    loader = SourceFileLoader("gpu_workers", str(REPO / "bin" / "gpu-workers"))
    spec = importlib.util.spec_from_loader("gpu_workers", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_fallback_reason_says_why_once(monkeypatch):
    # As on a machine without CuPy, whether or not this one has it.
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delitem(sys.modules, "gpu_engine.backends.cuda", raising=False)
    backend = create_backend("auto")
    reason = backend.fallback_reason
    assert backend.name == "cpu"
    assert reason.startswith("the CUDA backend needs CuPy (") and reason.count("CuPy") == 1, reason
    assert "CPU" not in reason and "auto" not in reason  # /health says both beside it already


def test_worker_names_are_the_ones_the_operations_page_gives():
    workers = _gpu_workers()
    names = [name for name, _, _ in workers.worker_commands("gpu", "INFO", [])]
    names += [name for name, _, _ in workers.worker_commands("gpu", "INFO", ["0", "3"])]
    assert names == ["cpu0", "gpu0", "gpu1"]
    for _, _, argv in workers.worker_commands("gpu", "INFO", ["0"]):
        assert argv[argv.index("-n") + 1] == "gpu0@%h"
    page = (REPO / "docs" / "OPERATIONS.md").read_text()
    documented = set(re.findall(r"`((?:gpu|cpu)[0-9<n>]+)@host`", page))
    assert documented == {"gpu<n>", "cpu0"}


@pytest.mark.django_db
def test_a_one_query_job_is_logged_in_the_singular(caplog):
    from django.contrib.auth.models import User

    from queries import bulk

    owner = User.objects.create_user("solo")
    with caplog.at_level(logging.INFO, logger="queries.bulk"):
        bulk.create_job(owner, [bytes(3 * 179)], total=1, domain_bits=8, chunk_size=4)
    assert re.search(r"bulk job \S+: 1 query in 1 chunk of 4$", caplog.text.strip()), caplog.text


def test_numbers_in_policy_errors_are_plain():
    assert [plain_number(v) for v in (1_000_000, 1e6, 60000.0, 0.1, 2.5e-5, 7)] == [
        "1000000", "1000000", "60000", "0.1", "0.000025", "7"]
    with pytest.raises(PolicyError) as caught:
        LanePolicy(window_us=2_000_000)
    assert caught.value.errors["window_us"] == "window_us must be in 0..1000000 µs, got 2000000"
