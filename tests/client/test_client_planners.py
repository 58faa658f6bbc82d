"""Key-making processes (planners=): the rows they plan come back right and in order, each
process draws its own keys, none outlives its client, and a bad count is refused."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from morpho_client import AsyncPirClient, PirClient
from morpho_client.plan import plan_window
from morpho_client.planners import PlannerError, Planners, auto_planners
from morpho_pir.dpf import KEY_FORMAT_V2, KeyBatch, eval_pages
from morpho_pir.http import EPOCH_HEADER, OCTET_STREAM
from morpho_pir.protocol import KEYS_PER_QUERY, parse_hex
from tests.conftest import REPO

PAGES, DOMAIN_BITS = 64, 6
ROWS = PAGES * 16
MATRIX = np.random.default_rng(5).integers(0, 256, (PAGES, 4096), dtype=np.uint8)


def answer(body: bytes) -> bytes:
    """What a party answers to a binary batch: each key's XOR of the pages it selects."""
    batch = KeyBatch.from_bytes(body, DOMAIN_BITS)
    masks = eval_pages(batch, PAGES).view(np.uint8).reshape(len(batch), PAGES, 1, 16)
    selected = MATRIX.reshape(1, PAGES, 256, 16) & masks
    return np.bitwise_xor.reduce(selected, axis=1).tobytes()


async def party(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/epoch":
        return httpx.Response(200, json={
            "epoch_id": 1, "num_rows": ROWS, "block_number": 0, "state_root": "0x" + "00" * 32,
            "encodings": ["binary"], "key_formats": ["v1", "v2"],
            "page_pir": {"domain_bits": DOMAIN_BITS, "rows_per_page": 16, "num_pages": PAGES,
                         "page_size_bytes": 4096}})
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok", "pass_queries": 64})
    body = await request.aread()
    return httpx.Response(200, content=answer(body), headers={
        "Content-Type": OCTET_STREAM, EPOCH_HEADER: "1",
        "X-Morpho-State-Updates": "0", "X-Morpho-State-Digest": "0x" + "00" * 32})


def options(**more) -> dict:
    return dict(transport=httpx.MockTransport(party), in_flight=2, **more)


def wait_ready(planners: Planners, count: int) -> None:
    deadline = time.monotonic() + 120
    while planners.ready < count:
        assert time.monotonic() < deadline, "the key-making processes did not start"
        time.sleep(0.05)


def expected(rows) -> list[bytes]:
    return [MATRIX[r // 16, (r % 16) * 256:(r % 16 + 1) * 256].tobytes() for r in rows]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_rows_planned_on_two_processes_come_back_right_and_in_order():
    rows = np.random.default_rng(3).integers(0, ROWS, 640).tolist()  # ten windows of 64
    with PirClient("http://a.test", "http://b.test", **options(planners=2)) as client:
        assert client.fetch_rows(rows[:192]) == expected(rows[:192])  # starts the processes
        planners = client.core._planners_pool
        wait_ready(planners, 2)
        before = planners.planned
        assert [row for row, _ in client.iter_rows(rows)] == rows
        assert client.fetch_rows(rows) == expected(rows)
        assert planners.planned - before >= 2 * 8  # the windows after the first, twice
        pids = planners.pids
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    assert not any(alive(pid) for pid in pids)  # closed with the client, and reaped


def test_the_async_client_closes_its_processes_too():
    rows = list(range(0, ROWS, 3))

    async def run():
        async with AsyncPirClient("http://a.test", "http://b.test", **options(planners=2)) as c:
            got = await c.fetch_rows(rows)
            return got, c._planners_pool.pids
    got, pids = asyncio.run(run())
    assert got == expected(rows)
    assert not any(alive(pid) for pid in pids)



def gone(pid: int) -> bool:
    """Whether process `pid` has ended and been reaped (a zombie still counts as alive)."""
    deadline = time.monotonic() + 20
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_processes_end_with_a_client_dropped_without_close():
    rows = list(range(0, ROWS, 3))

    async def run():
        client = AsyncPirClient("http://a.test", "http://b.test", **options(planners=2))
        assert await client.fetch_rows(rows) == expected(rows)
        planners = client._planners_pool
        await asyncio.to_thread(wait_ready, planners, 2)
        return planners.pids  # the client, never closed, goes with this frame
    pids = asyncio.run(run())
    gc.collect()
    assert all(gone(pid) for pid in pids)


def test_planners_dropped_without_close_end_their_processes():
    planners = Planners(1)
    wait_ready(planners, 1)
    assert planners.submit(plan_window, np.arange(16), PAGES, DOMAIN_BITS).result(60).keys
    pid = planners.pids[0]
    del planners
    gc.collect()
    assert gone(pid)


def test_a_fetch_after_the_processes_were_killed_starts_new_ones():
    rows = np.random.default_rng(4).integers(0, ROWS, 640).tolist()
    with PirClient("http://a.test", "http://b.test", **options(planners=1)) as client:
        assert client.fetch_rows(rows) == expected(rows)
        first = client.core._planners_pool
        wait_ready(first, 1)
        os.kill(first.pids[0], signal.SIGKILL)  # the OOM killer, say
        first._pool.processes[0].proc.wait(20)
        with pytest.raises(PlannerError, match="ended"):  # the fetch that finds it dead
            client.fetch_rows(rows)
        assert client.fetch_rows(rows) == expected(rows)  # the next, on a new process
        assert client.core._planners_pool is not first

def test_each_process_draws_its_own_keys():
    planners = Planners(2)
    try:
        wait_ready(planners, 2)
        rows = np.arange(0, ROWS, 16)
        windows = [f.result(60) for f in [planners.submit(plan_window, rows, PAGES, DOMAIN_BITS,
                                                          KEY_FORMAT_V2) for _ in range(6)]]
    finally:
        planners.close()
    seeds = {w.keys[0][:, :16].tobytes() for w in windows}
    assert len(seeds) == 6  # no two windows share a root seed
    for window in windows:  # and every pair's two halves select the wanted page
        a, b = (KeyBatch.from_bytes(window.keys[side].tobytes(), DOMAIN_BITS) for side in (0, 1))
        masks = eval_pages(a, PAGES) ^ eval_pages(b, PAGES)  # (3Q, PAGES, 4)
        chosen = masks.any(axis=2).reshape(len(window), KEYS_PER_QUERY, PAGES)
        want = np.zeros_like(chosen)
        np.put_along_axis(want, window.pages[:, :, None], True, axis=2)
        assert (chosen == want).all()
        assert (window.pages[np.arange(len(window)), window.slots] == rows // 16).all()



def test_an_answer_that_cannot_be_unpickled_fails_its_call_alone():
    planners = Planners(1)
    try:
        wait_ready(planners, 1)
        # HexError(message, code) pickles as HexError(message): loading it here raises TypeError
        refused = planners.submit(parse_hex, "0xzz")
        with pytest.raises(PlannerError, match="could not be read"):
            refused.result(30)
        rows = np.arange(16)
        assert len(planners.submit(plan_window, rows, PAGES, DOMAIN_BITS).result(30)) == 16
        assert planners.planned == 1  # on the same process, which goes on
    finally:
        planners.close()

def test_a_bad_planner_count_is_refused_saying_what_is_allowed():
    for bad in (-1, 65, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"planners must be a whole number in 0\.\.64"):
            AsyncPirClient("http://a.test", "http://b.test", planners=bad)
    assert 0 <= auto_planners() <= 2
    result = subprocess.run([sys.executable, "-m", "morpho_client", "--server-a", "http://a.test",
                             "--server-b", "http://b.test", "--row", "1", "--planners", "-1"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--planners: expected a whole number in 0..64" in result.stderr


SCRIPT = '''
import time
import httpx
from morpho_client import PirClient
from tests.client.test_client_planners import expected, party
print("the script ran", flush=True)  # at top level, no main guard: a re-import would print again
rows = list(range(0, 1024, 5))
with PirClient("http://a.test", "http://b.test", transport=httpx.MockTransport(party),
               in_flight=1, planners=2) as client:
    assert client.fetch_rows(rows) == expected(rows)
    planners = client.core._planners_pool
    while planners.ready < 2:
        time.sleep(0.05)
    assert client.fetch_rows(rows) == expected(rows)
    assert planners.planned > 0
print("fetched", flush=True)
'''


def test_a_script_without_a_main_guard_is_not_run_again_by_its_planners(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["the script ran", "fetched"]
