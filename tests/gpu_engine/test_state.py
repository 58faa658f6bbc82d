"""The served state: the same row updates give the same digest, whatever order or batches."""
from __future__ import annotations

import numpy as np

from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import gen_keys
from gpu_engine.engine import Engine, SwitchMode
from gpu_engine.matrix import ServedEpoch, random_matrix
from morpho_pir.state import RowDigest, ServedState

ROW_A, ROW_B = bytes(range(256)), bytes(255 - i for i in range(256))


def test_the_digest_is_the_set_of_written_rows_not_their_history():
    one = RowDigest({5: ROW_A, 7: ROW_B})
    two = RowDigest()
    two.write({7: ROW_A})
    two.write({5: ROW_A})
    two.write({7: ROW_B})  # rewritten: the earlier term of row 7 is taken out
    assert one.state(3) == two.state(3)
    assert one.state(3).updates == 2 and one.state(3).digest != bytes(32)
    assert RowDigest({5: ROW_A}).state(3) != one.state(3)
    assert RowDigest({5: ROW_B, 7: ROW_A}).state(3) != one.state(3)  # same rows, other data
    assert RowDigest().state(3) == ServedState(3)  # nothing written: zero digest
    assert one.state(3) != one.state(4)
    assert ServedState.from_description(one.state(3).describe()) == one.state(3)


def test_every_answer_names_the_state_it_was_computed_from():
    matrix = random_matrix(20, seed=1)
    engine = Engine(NumpyBackend(), ServedEpoch(1, matrix)).start()
    try:
        k0, _ = gen_keys(2, matrix.domain_bits)
        assert engine.answer([[k0]], timeout=30).state == ServedState(1)
        engine.write_rows({33: ROW_A}).result(30)
        answer = engine.answer([[k0]], timeout=30)
        assert answer.state == RowDigest({33: ROW_A}).state(1) == engine.state
        assert engine.health()["state"] == engine.state.describe()
        # a switch to an epoch that absorbed pending rows counts them in its state
        engine.switch_epoch(ServedEpoch(2, random_matrix(20, seed=2)),
                            written={33: ROW_A}).result(30)
        assert engine.answer([[k0]], timeout=30).state == RowDigest({33: ROW_A}).state(2)
        engine.switch_epoch(ServedEpoch(3, random_matrix(20, seed=3)),
                            SwitchMode.STOP_THE_WORLD).result(30)
        assert engine.answer([[k0]], timeout=30).state == ServedState(3)
    finally:
        engine.stop()


def test_two_engines_that_took_the_same_updates_differently_agree():
    matrix = random_matrix(20, seed=1)
    a = Engine(NumpyBackend(), ServedEpoch(1, matrix)).start()
    b = Engine(NumpyBackend(), ServedEpoch(1, random_matrix(20, seed=1))).start()
    try:
        a.write_rows({1: ROW_A}).result(30)
        a.write_rows({2: ROW_B}).result(30)
        b.write_rows({2: ROW_B, 1: ROW_A}).result(30)
        k0, k1 = gen_keys(0, matrix.domain_bits)
        x, y = a.answer([[k0]], timeout=30), b.answer([[k1]], timeout=30)
        assert x.state == y.state
        page = np.frombuffer(x.pages[0][0], np.uint8) ^ np.frombuffer(y.pages[0][0], np.uint8)
        assert page.tobytes()[256:512] == ROW_A  # row 1 of page 0, as both parties wrote it
    finally:
        a.stop()
        b.stop()
