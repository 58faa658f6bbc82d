"""The engine server and its RemoteEngine client in one process: same answers, same refusals.

The server runs on its own threads over an ipc:// socket in a temporary folder, the client talks
to it as a web or Celery process would; the processes-and-signals tests are in
test_engine_server_processes.py."""
from __future__ import annotations

import os
import time
from concurrent.futures import wait

import numpy as np
import pytest

from gpu_engine import wire
from gpu_engine.backends import cuda_plan
from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KeyBatch, KeyFormatError, gen_keys, key_length, random_keys
from gpu_engine.engine import Engine, EngineOverloaded, EngineUnavailable
from gpu_engine.matrix import ServedEpoch, random_matrix
from gpu_engine.remote import RemoteEngine, RemoteError
from gpu_engine.scheduler import LanePolicy
from gpu_engine.server import EngineServer
from tests.conftest import wait_until

PAGES = 40  # d = 6


class Policies:
    """A policy source the test swaps, as the policies app's policy source does."""

    def __init__(self, **interactive) -> None:
        self.current = {"interactive": LanePolicy(name="test-interactive", **interactive),
                        "bulk": LanePolicy(name="test-bulk", mode="throughput")}

    def __call__(self, lane: str) -> LanePolicy:
        return self.current[lane]


@pytest.fixture
def served(tmp_path):
    """start(**interactive policy fields) -> (engine, server, client); all stopped afterwards."""
    made = []

    def start(ready: bool = True, backend=None, **interactive):
        matrix = random_matrix(PAGES, seed=5)
        policies = Policies(**interactive)
        engine = Engine(backend or NumpyBackend(), ServedEpoch(1, matrix), policies).start()
        url = f"ipc://{tmp_path}/engine-{len(made)}.sock"
        server = EngineServer(engine, url, {"echo": lambda args: {"echo": args}}).start()
        if ready:
            server.mark_ready()
        client = RemoteEngine(url, deadline_s=2.0)
        assert client.wait_connected(5)
        made.append((engine, server, client))
        return engine, server, client, policies

    yield start
    for engine, server, client in made:
        client.stop()
        server.stop()
        engine.stop()


def _xor(a: bytes, b: bytes) -> bytes:
    return (np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()


def test_remote_answers_are_the_engines_bytes(served):
    engine, _, client, _ = served()
    matrix = random_matrix(PAGES, seed=5)
    d = client.epoch.matrix.domain_bits
    for target in (0, 17, PAGES - 1):
        k0, k1 = gen_keys(target, d)
        remote = client.answer([[k0, k1, k0], [k1, k0, k1]], timeout=30)
        local = engine.answer([[k0, k1, k0], [k1, k0, k1]], timeout=30)
        assert remote.epoch_id == local.epoch_id == 1 and remote.state == local.state
        assert remote.pages == local.pages  # byte for byte, query by query
        assert _xor(remote.pages[0][0], remote.pages[0][1]) == matrix.page(target)


def test_epoch_and_policies_reach_the_client(served):
    _, _, client, _ = served()
    assert client.epoch.epoch_id == 1
    assert client.epoch.matrix.num_pages == PAGES and client.epoch.matrix.domain_bits == 6
    assert client.epoch.describe()["page_pir"]["num_pages"] == PAGES
    assert client.policies()["interactive"].name == "test-interactive"
    assert client.running and client.failure is None


def test_a_policy_change_and_an_epoch_switch_reach_the_client_within_a_second(served):
    engine, _, client, policies = served()
    policies.current["interactive"] = LanePolicy(name="changed", mode="adaptive")
    engine.switch_epoch(ServedEpoch(2, random_matrix(PAGES * 2, seed=6))).result(30)
    engine.write_rows({3: bytes(256)}).result(30)
    wait_until(lambda: (client.policies()["interactive"].name, client.state) == ("changed", engine.state),
               1.0, "the client still sees the old policy or epoch")
    assert client.epoch.matrix.num_pages == PAGES * 2


def test_the_bulk_launch_cap_reaches_the_client(served):
    """A bulk worker sizes its requests by the engine's launch cap (queries.bulk_runner): through
    the engine server it is the engine's own, as the cost model moves it."""
    engine, _, client, policies = served()
    assert client.launch_cap("bulk") == engine.launch_cap("bulk") == 32  # no yield_ms
    policies.current["bulk"] = LanePolicy(name="yields", mode="throughput", yield_ms=0.001)
    for _ in range(8):  # measured launches: now a query takes longer than 1 µs
        engine.answer([gen_keys(1, client.epoch.matrix.domain_bits)], lane="bulk", timeout=30)
    wait_until(lambda: client.launch_cap("bulk") == 1, 1.0, "the client still sees the old launch cap")
    assert engine.launch_cap("bulk") == 1
    # requests waiting together in the client's outbox merge only up to the cap: the engine
    # never splits a request, so a merged one could not be cut for interactive queries
    before = engine.snapshot()["lanes"]["bulk"]["requests"]
    keys = [gen_keys(2, client.epoch.matrix.domain_bits)]
    futures = [client.submit(keys, lane="bulk") for _ in range(6)]
    assert all(f.result(30).epoch_id == 1 for f in futures)
    assert engine.snapshot()["lanes"]["bulk"]["requests"] - before == 6


def test_queries_of_several_clients_share_one_launch(served, tmp_path):
    engine, server, first, _ = served(mode="throughput", window_us=500_000, max_batch=3)
    clients = [first] + [RemoteEngine(server.url) for _ in range(2)]
    try:
        for client in clients:
            assert client.wait_connected(5)
        d = first.epoch.matrix.domain_bits
        futures = [client.submit([list(random_keys_as_dpf(d, 3))]) for client in clients]
        done, _ = wait(futures, timeout=30)
        assert len(done) == 3 and all(f.exception() is None for f in futures)
        # the engine hands answers out before it counts the launch: wait for the count
        wait_until(lambda: engine.snapshot()["queries_answered"] >= 3, 5, "the engine has not counted the 3 queries")
        snap = engine.snapshot()
        assert snap["launches"] == 1 and snap["queries_answered"] == 3
        assert server.health()["engine_clients"] == 3
    finally:
        for client in clients[1:]:
            client.stop()


def random_keys_as_dpf(d: int, count: int):
    from morpho_pir.dpf import DpfKey

    raw = random_keys(count, d, np.random.default_rng(count)).to_bytes()
    size = key_length(d)
    return [DpfKey.from_bytes(raw[i * size:(i + 1) * size]) for i in range(count)]


def test_refusals_keep_their_kind_across_the_socket(served):
    engine, _, client, policies = served()
    d = client.epoch.matrix.domain_bits
    query = [random_keys_as_dpf(d, 3)]
    with pytest.raises(ValueError, match="unknown lane 'nope'"):
        client.submit(query, lane="nope")
    with pytest.raises(ValueError, match="domain_bits 7, the epoch has 6"):
        client.submit([random_keys_as_dpf(7, 3)]).result(10)
    # a full queue: the engine's EngineOverloaded, with its retry hint, reaches the caller
    policies.current["interactive"] = LanePolicy(name="tiny", mode="throughput", max_batch=1,
                                                     max_queue=1, window_us=900_000)
    # the client merges requests up to the launch cap its last PONG carried: wait for the tiny one
    wait_until(lambda: client.policies()["interactive"].name == "tiny", 5, "the client has not seen the tiny policy")
    futures = [client.submit(query) for _ in range(4)]
    wait(futures, timeout=30)
    refused = [f.exception() for f in futures if f.exception() is not None]
    assert refused and all(isinstance(e, EngineOverloaded) for e in refused)
    assert "interactive queue is full" in str(refused[0]) and refused[0].retry_after >= 1


def test_a_warming_server_refuses_queries_with_503_and_says_so(served):
    _, server, client, _ = served(ready=False)
    d = client.epoch.matrix.domain_bits
    with pytest.raises(EngineUnavailable, match="warming up"):  # the server's own refusal
        client.submit([random_keys_as_dpf(d, 3)]).result(10)
    assert not client.running and client.failure == "the engine server is warming up"
    assert client.health()["warming"] is True
    server.mark_ready()
    # at once: the client's last PONG still says warming, but the server decides
    assert len(client.answer([random_keys_as_dpf(d, 3)], timeout=30).pages) == 1
    assert wait_until(lambda: client.running, 5, "the client's PONGs still say warming")


def test_control_operations_and_their_errors(served):
    _, _, client, _ = served()
    assert client.call("echo", value=3) == {"echo": {"value": 3}}
    with pytest.raises(RemoteError, match="unknown control operation 'nope'"):
        client.call("nope")
    snap = client.snapshot()
    assert set(snap["lanes"]) == {"interactive", "bulk"}
    health = client.health()
    assert health["reachable"] and health["running"] and health["backend"] == "cpu"
    assert health["pass_queries"] == snap["pass_queries"] == cuda_plan.MAX_LAUNCH_QUERIES  # the CPU: no passes


def test_clients_see_the_launch_size_the_engine_applies(served):
    # max_batch 74 over a backend that serves 58 queries in one pass: the PONGs carry the policy as
    # applied (bulk workers size their requests by it), /health the backend's pass_queries
    backend = NumpyBackend()
    backend.pass_queries = 58
    _, _, client, _ = served(backend=backend, mode="throughput", max_batch=74)
    policy = client.policies()["interactive"]
    assert (policy.name, policy.max_batch, client.launch_cap("interactive")) == ("test-interactive", 58, 58)
    assert client.health()["pass_queries"] == 58


def test_requests_in_flight_fail_at_once_when_the_server_goes_away(served):
    engine, server, client, _ = served(mode="throughput", window_us=1_000_000, max_batch=32)
    d = client.epoch.matrix.domain_bits
    future = client.submit([random_keys_as_dpf(d, 3)])  # held for the 1 s window
    wait_until(lambda: engine.snapshot()["lanes"]["interactive"]["queued"] == 1, 5,
               "the query has not reached the engine's queue")
    stopped = time.monotonic()
    server.stop()
    with pytest.raises(EngineUnavailable, match="went away|did not answer"):
        future.result(10)
    assert time.monotonic() - stopped < 0.7  # the disconnect, not the window's end or a timeout
    with pytest.raises(EngineUnavailable):
        client.submit([random_keys_as_dpf(d, 3)])
    assert client.health() == {"running": False, "reachable": False, "failure": client.failure,
                               "engine_url": server.url, "backend": "unknown", "queue_depth": {}}


def test_a_stopped_server_removes_its_socket_file_but_not_a_newer_servers(served):
    engine, server, client, _ = served()
    path = server.url[len("ipc://"):]
    other = EngineServer(engine, server.url, {}).start()  # binds over the same path
    server.stop()
    assert os.path.exists(path)  # the second server's, still listening
    other.stop()
    assert not os.path.exists(path)


def test_key_batches_parse_from_bytes_as_the_keys_do():
    rng = np.random.default_rng(3)
    for d in (1, 6, 16, 25):
        keys = [k for t in (0, 1, (1 << d) - 1) for k in gen_keys(t, d, rng=rng)]
        raw = b"".join(k.to_bytes() for k in keys)
        batch, reference = KeyBatch.from_bytes(raw, d), KeyBatch.from_keys(keys)
        for name in ("root_seed", "root_t", "cw_seed", "cw_t", "final_cw"):
            assert np.array_equal(getattr(batch, name), getattr(reference, name)), (d, name)
        assert batch.to_bytes() == raw
    good = gen_keys(3, 6)[0].to_bytes()
    with pytest.raises(KeyFormatError, match="not a whole number of 143-byte keys"):
        KeyBatch.from_bytes(good + b"\x00", 6)
    bad = bytearray(good * 2)
    bad[143 + 17] = 7  # the second key's party byte
    with pytest.raises(KeyFormatError, match="key 1 has a root_t, party or t_cw byte"):
        KeyBatch.from_bytes(bytes(bad), 6)
    with pytest.raises(KeyFormatError, match="key 0 has domain_bits 6, expected 7"):
        KeyBatch.from_bytes(good + bytes(18), 7)


def test_query_headers_are_checked_against_the_key_bytes():
    header = wire.pack_query("bulk", 6, 3, 2)
    assert wire.unpack_query(header, 6 * key_length(6), key_length) == ("bulk", 6, (3, 3))
    with pytest.raises(wire.WireError, match="the header promises 2 x 3 keys"):
        wire.unpack_query(header, 5 * key_length(6), key_length)
    with pytest.raises(ValueError, match="unknown lane"):
        wire.pack_query("fast", 6, 3, 1)
