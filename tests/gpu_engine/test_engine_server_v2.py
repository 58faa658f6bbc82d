"""v2 keys (docs/PROTOCOL.md section 3.1) through the engine server and RemoteEngine: a QUERY's
keys are sized by their own format, and requests of both formats waiting together in one web
process travel as one message per format."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, gen_keys, random_keys
from gpu_engine.engine import Engine, key_formats_of
from gpu_engine.matrix import ServedEpoch, random_matrix
from morpho_pir.protocol import KEYS_PER_QUERY
from gpu_engine.remote import RemoteEngine
from gpu_engine.server import EngineServer
from tests.protocol_vectors import protocol_answers

PAGES = 300  # d = 9: a v2 tree of depth 2


@pytest.fixture
def remote(tmp_path):
    engine = Engine(NumpyBackend(workers=1), ServedEpoch(1, random_matrix(PAGES, seed=5))).start()
    url = f"ipc://{tmp_path}/engine.sock"
    server = EngineServer(engine, url, {}).start()
    server.mark_ready()
    client = RemoteEngine(url, deadline_s=2.0)
    assert client.wait_connected(5)
    yield engine, client
    client.stop()
    server.stop()
    engine.stop()


def _v2_query(d):
    pairs = [gen_keys(t, d, key_format=KEY_FORMAT_V2) for t in (0, 130, PAGES - 1)]
    return [[p[0] for p in pairs]], [[p[1] for p in pairs]]


def test_both_engines_take_both_key_formats(remote):
    _, client = remote
    assert key_formats_of(client) == key_formats_of(Engine) == (KEY_FORMAT_V1, KEY_FORMAT_V2)
    assert key_formats_of(object()) == (KEY_FORMAT_V1,)  # an engine that names none


def test_v2_keys_through_the_engine_server(remote):
    engine, client = remote
    matrix = random_matrix(PAGES, seed=5)
    side0, side1 = _v2_query(engine.epoch.matrix.domain_bits)
    a, b = client.answer(side0, timeout=30), client.answer(side1, timeout=30)
    assert a.pages == engine.answer(side0, timeout=30).pages
    for k, target in enumerate((0, 130, PAGES - 1)):
        assert bytes(x ^ y for x, y in zip(a.pages[0][k], b.pages[0][k])) == matrix.page(target)


def test_requests_of_both_formats_sent_together_get_their_own_answers(remote):
    engine, client = remote
    matrix = random_matrix(PAGES, seed=5)
    rng = np.random.default_rng(8)
    d = engine.epoch.matrix.domain_bits
    batches = [random_keys(KEYS_PER_QUERY * (1 + i % 3), d, rng,
                           KEY_FORMAT_V2 if i % 2 else KEY_FORMAT_V1) for i in range(12)]
    futures = [client.submit_keys(keys, (KEYS_PER_QUERY,) * (len(keys) // KEYS_PER_QUERY))
               for keys in batches]  # queued together: merged per format on the way out
    for keys, future in zip(batches, futures):
        answers = future.result(30).answers
        assert [a.tobytes() for a in answers] == [a.tobytes() for a in protocol_answers(matrix, keys)]


def test_an_engine_of_v2_keys_alone_says_so_to_its_clients(tmp_path):
    # a backend that answers v2 keys alone (none of today's): the engine takes them alone,
    # warms up with them, and its server's PONGs tell each RemoteEngine, which the web tier asks
    backend = NumpyBackend(workers=1)
    backend.key_formats = (KEY_FORMAT_V2,)
    engine = Engine(backend, ServedEpoch(1, random_matrix(PAGES, seed=5))).start()
    url = f"ipc://{tmp_path}/engine.sock"
    server = EngineServer(engine, url, {}).start()
    server.mark_ready()
    client = RemoteEngine(url, deadline_s=2.0)
    try:
        engine.warm_up(max_batch=2).result(30)
        assert key_formats_of(engine) == (KEY_FORMAT_V2,)
        d = engine.epoch.matrix.domain_bits
        with pytest.raises(ValueError, match="this engine answers v2 keys only, got v1 keys"):
            engine.answer([[gen_keys(t, d)[0] for t in (0, 1, 2)]], timeout=30)
        assert client.wait_connected(5)
        assert key_formats_of(client) == (KEY_FORMAT_V2,)
        side0, side1 = _v2_query(d)
        a, b = client.answer(side0, timeout=30), client.answer(side1, timeout=30)
        matrix = random_matrix(PAGES, seed=5)
        assert bytes(x ^ y for x, y in zip(a.pages[0][2], b.pages[0][2])) == matrix.page(PAGES - 1)
    finally:
        client.stop()
        server.stop()
        engine.stop()
