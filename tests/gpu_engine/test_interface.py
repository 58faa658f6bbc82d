"""Engine and RemoteEngine implement one declared interface, gpu_engine.interface.QueryEngine."""
from __future__ import annotations

import inspect
from typing import _get_protocol_attrs  # the names a runtime_checkable Protocol checks

import pytest

from gpu_engine.backends.cpu import NumpyBackend
from gpu_engine.engine import Engine
from gpu_engine.interface import QueryEngine
from gpu_engine.matrix import ServedEpoch, random_matrix
from gpu_engine.remote import RemoteEngine
from gpu_engine.server import EngineServer

MEMBERS = sorted(_get_protocol_attrs(QueryEngine))


def _parameters(function) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls", [Engine, RemoteEngine])
@pytest.mark.parametrize("name", [n for n in MEMBERS if callable(getattr(QueryEngine, n, None))])
def test_each_method_takes_the_interfaces_parameters(cls, name):
    # the declared parameters, in order, with their defaults; more only where they have a default
    # (Engine.stop's timeout), so a call written against the interface works on both
    declared, actual = _parameters(getattr(QueryEngine, name)), _parameters(getattr(cls, name))
    assert actual[:len(declared)] == declared, (cls.__name__, name)
    assert all(default is not inspect.Parameter.empty for _, _, default in actual[len(declared):])


def test_the_interface_names_what_callers_use():
    assert MEMBERS == ["answer", "epoch", "failure", "health", "held", "key_formats", "launch_cap",
                       "policies", "running", "snapshot", "state", "stop", "submit", "submit_keys"]
    assert isinstance(QueryEngine.__dict__["held"], property)


def test_an_engine_and_its_remote_client_are_both_query_engines(tmp_path):
    engine = Engine(NumpyBackend(workers=1), ServedEpoch(1, random_matrix(20, seed=1))).start()
    server = EngineServer(engine, f"ipc://{tmp_path}/engine.sock", {}).start()
    server.mark_ready()
    client = RemoteEngine(server.url, deadline_s=2.0)
    try:
        assert client.wait_connected(5)
        for each in (engine, client):
            assert isinstance(each, QueryEngine)
            assert each.held is None and each.running and each.epoch.epoch_id == 1
            assert each.key_formats == engine.key_formats
        assert not isinstance(object(), QueryEngine)
    finally:
        client.stop()
        server.stop()
        engine.stop()
