"""Lookups by key through the client against two real parties serving a records epoch: values
of present keys, None for absent ones, and the same traffic for both (docs/PROTOCOL.md 9)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import numpy as np
import pytest

from gpu_engine.matrix import write_epoch_metadata, write_matrix_file
from gpu_engine.records import build
from morpho_client import AsyncPirClient, NotRecords, PirClient, PirError
from morpho_client.cli import main as cli_main
from morpho_client.lookup import records_table
from morpho_client.wire import PartyPool
from morpho_pir.records import RecordsTable
from tests.client.test_client_planners import wait_ready
from tests.conftest import REPO, server_env
from tests.morpho_pir.test_records import random_records


@pytest.fixture(scope="module")
def parties(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lookup-parties")
    keys, values, types = random_records(5000, key_bytes=20, value_bytes=76, seed=21)
    built = build(keys, values, types, seed=21)
    matrix = folder / "accounts.bin"
    built.rows.tofile(matrix)
    write_epoch_metadata(matrix, epoch_id=31, records=built.table)
    urls = []
    for name in "ab":
        env = server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu",
                         DATABASE_URL=f"sqlite:///{folder / name}.sqlite3")
        subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                       env=env, check=True, timeout=300)
        urls.append(start_server("runserver", env).url)
    return urls, keys, values, types


class Recording(httpx.AsyncBaseTransport):
    """The real transport, with each request's method, path and body size written down."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.seen: list = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        response = await self.inner.handle_async_request(request)
        await response.aread()
        self.seen.append((request.method, request.url.host, request.url.port, request.url.path,
                          len(body), response.status_code, len(response.content)))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_lookups_return_present_values_and_none_for_absent_keys(parties, encoding):
    (a, b), keys, values, types = parties
    absent = [bytes([i]) * 20 for i in range(1, 40)]
    wanted = [keys[i].tobytes() for i in range(0, 5000, 97)] + absent
    with PirClient(a, b, encoding=encoding) as client:
        got = client.lookup_many(wanted)
        assert client.last_encodings == (encoding, encoding)
        assert client.lookup(keys[7].tobytes()) == values[7].tobytes()
        assert client.lookup(absent[0]) is None
        record = client.lookup_records([keys[8].tobytes()])[0]
        batches = list(client.iter_lookups(iter(wanted)))  # request by request, a generator read
    expected = [values[i].tobytes() for i in range(0, 5000, 97)] + [None] * len(absent)
    assert got == expected
    assert [len(asked) for asked, _ in batches] == [32, 32, 27]  # 52 + 39 keys
    assert [key for asked, _ in batches for key in asked] == wanted
    assert [r and r.value for _, found in batches for r in found] == expected
    assert record.type == int(types[8]) and record.value == values[8].tobytes()


def test_present_and_absent_keys_send_the_same_requests_of_the_same_sizes(parties):
    (a, b), keys, _, _ = parties

    async def traffic(wanted) -> list:
        transport = Recording()
        async with AsyncPirClient(a, b, in_flight=2, transport=transport) as client:
            assert len(await client.lookup_many(wanted)) == len(wanted)
            await client.lookup(wanted[-1])
        # concurrent requests finish in any order: compared as a multiset
        return sorted(transport.seen)

    present = [keys[i].tobytes() for i in range(70)]
    absent = [bytes([200, i]) * 10 for i in range(70)]
    mixed = present[:35] + absent[:35]
    seen = [asyncio.run(traffic(wanted)) for wanted in (present, absent, mixed)]
    assert seen[0] == seen[1] == seen[2]
    lookups = [entry for entry in seen[0] if entry[3] == "/query/page/gpu/batch"]
    # 70 keys, 32 to a request, 2 in flight: 32, 32 and 6 queries to each party, then 1
    sizes = sorted(entry[4] for entry in lookups)
    assert sizes == [sizes[0]] * 2 + [6 * sizes[0]] * 2 + [32 * sizes[0]] * 4
    assert {entry[5] for entry in lookups} == {200}
    assert sorted(entry[6] for entry in lookups) == [n * 3 * 4096 for n in (1, 1, 6, 6) + (32,) * 4]


class Watched:
    """PartyPool.post counted: requests in flight at each party, and the headers each carried."""

    def __init__(self, monkeypatch) -> None:
        self.in_flight, self.most, self.headers = {}, {}, []
        real = PartyPool.post
        watched = self

        async def post(pool, path, body, content_type, accept, headers=None):
            watched.headers.append(dict(headers or {}))
            watched.in_flight[pool.base] = watched.in_flight.get(pool.base, 0) + 1
            watched.most[pool.base] = max(watched.most.get(pool.base, 0),
                                          watched.in_flight[pool.base])
            try:
                return await real(pool, path, body, content_type, accept, headers)
            finally:
                watched.in_flight[pool.base] -= 1

        monkeypatch.setattr(PartyPool, "post", post)


@pytest.mark.parametrize("planners", [0, 2])
def test_lookups_keep_requests_in_flight_on_the_clients_own_connections(parties, monkeypatch,
                                                                        planners):
    (a, b), keys, values, _ = parties
    watched = Watched(monkeypatch)
    rng = np.random.default_rng(planners)
    picked = rng.choice(5000, 300, replace=False).tolist()
    wanted = [keys[i].tobytes() if n % 3 else bytes([n % 256, 77]) * 10
              for n, i in enumerate(picked)]

    async def run():
        async with AsyncPirClient(a, b, in_flight=4, max_batch=16, planners=planners) as client:
            if planners:  # the processes started by a first lookup of several windows, then used
                await client.lookup_many(wanted[:160])
                await asyncio.to_thread(wait_ready, client._planners_pool, planners)
                before = client._planners_pool.planned
            got = await client.lookup_many(wanted)
            if planners:
                assert client._planners_pool.planned - before == 4  # the windows after the first
            fingerprint = records_table(await client.epoch(), client.servers).fingerprint_hex
            return got, fingerprint
    got, fingerprint = asyncio.run(run())
    assert got == [values[i].tobytes() if n % 3 else None for n, i in enumerate(picked)]
    assert watched.most == {a: 4, b: 4}  # 19 requests to each party, 4 at a time
    assert len(watched.headers) == 2 * (19 + (10 if planners else 0))
    assert all(h == {"X-Morpho-Records-Fingerprint": fingerprint} for h in watched.headers)


def test_a_party_with_other_records_parameters_refuses_the_lookup(parties, monkeypatch):
    (a, b), keys, _, _ = parties
    monkeypatch.setattr(RecordsTable, "fingerprint_hex", property(lambda self: "0x" + "ab" * 16))
    with PirClient(a, b) as client, pytest.raises(PirError, match="another records table"):
        client.lookup(keys[0].tobytes())


def test_a_party_serving_pages_without_records_is_refused(start_server, tmp_path):
    urls = []
    matrix = write_matrix_file(tmp_path / "pages.bin", 16, seed=1)
    write_epoch_metadata(matrix, epoch_id=2)
    for name in "ab":
        env = server_env(MORPHO_MATRIX_PATH=matrix, MORPHO_ENGINE_BACKEND="cpu",
                         DATABASE_URL=f"sqlite:///{tmp_path / name}.sqlite3")
        subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v0"], cwd=REPO,
                       env=env, check=True, timeout=300)
        urls.append(start_server("runserver", env).url)
    with PirClient(*urls) as client, pytest.raises(NotRecords, match="without a records table"):
        client.lookup(b"\x00" * 20)


def test_the_cli_looks_keys_up_from_arguments_and_a_file(parties, tmp_path, capsys):
    (a, b), keys, values, types = parties
    present, absent = keys[3].tobytes(), b"\x05" * 20
    lines = []
    assert cli_main(["--server-a", a, "--server-b", b, "--key", "0x" + present.hex(),
                     "--key", absent.hex()], out=lines.append) == 0
    assert lines == [f"key 0x{present.hex()}: 0x{values[3].tobytes().hex()} (type {types[3]})",
                     f"key 0x{absent.hex()}: absent"]
    listed = tmp_path / "keys.txt"
    listed.write_text(f"# two keys\n{absent.hex()}\n\n0x{present.hex()}\n")
    out = tmp_path / "found.txt"
    assert cli_main(["--server-a", a, "--server-b", b, "--keys", str(listed),
                     "--out", str(out)]) == 0
    assert out.read_text().splitlines() == lines[::-1]
    assert f"wrote 2 keys to {out}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--server-a", a, "--server-b", b, "--key", "abc"])  # odd hex: a usage error
    assert "key 'abc': expected an even number of hex digits" in capsys.readouterr().err
    assert cli_main(["--server-a", a, "--server-b", b, "--key", "ab" * 19]) == 1
    assert f"key 0x{'ab' * 19}: expected 20 bytes, got 19" in capsys.readouterr().err
