"""The JSON answer bodies are written as bytes: exactly what DRF's JSONRenderer writes for them."""
import json

import numpy as np
import pytest
from rest_framework.renderers import JSONRenderer

from gpu_engine.engine import BatchAnswer
from morpho_pir.state import ServedState
from queries.api.answers import AnswerBody, AnswerJSONRenderer


def _result(queries: int, epoch_id: int, seed: int) -> BatchAnswer:
    rng = np.random.default_rng(seed)
    answers = rng.integers(0, 256, size=(3 * queries + 2, 4096), dtype=np.uint8)[1:-1]  # a view
    return BatchAnswer(epoch_id, answers, (3,) * queries, ServedState(epoch_id, 0, bytes(32)))


@pytest.mark.parametrize("queries, single", [(1, True), (1, False), (2, False), (32, False)])
@pytest.mark.parametrize("epoch_id", [0, 7, 2**63 - 1])
def test_body_bytes_equal_drf_rendering(queries, single, epoch_id):
    body = AnswerBody(_result(queries, epoch_id, seed=queries + epoch_id % 97), single)
    drf = JSONRenderer().render(body.as_dict())
    assert AnswerJSONRenderer().render(body) == drf
    parsed = json.loads(drf)
    assert parsed["epoch_id"] == epoch_id
    pages = [parsed["pages"]] if single else [query["pages"] for query in parsed["results"]]
    answers = body.result.answers
    assert [bytes.fromhex(p[2:]) for query in pages for p in query] == [a.tobytes() for a in answers]
    assert all(p.startswith("0x") and p[2:] == p[2:].lower() for query in pages for p in query)


def test_other_data_renders_as_drf_does():
    data = {"detail": "keys: expected 3 keys, got 2", "errors": [{"field": "keys"}]}
    assert AnswerJSONRenderer().render(data) == JSONRenderer().render(data)
