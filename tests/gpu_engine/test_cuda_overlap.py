"""The CUDA backend with batches started behind one another (the engine's full batches): each
batch's answers are byte-identical to the NumPy backend's, whatever runs beside it (GPU)."""
import numpy as np
import pytest

from gpu_engine.backends import DispatchShape
from gpu_engine.backends.cpu import NumpyBackend
from morpho_pir.dpf import KeyBatch, gen_keys
from gpu_engine.matrix import random_matrix


def _keys(num_keys, num_pages, d, seed):
    rng = np.random.default_rng(seed)
    return KeyBatch.from_keys([gen_keys(int(rng.integers(num_pages)), d, rng)[i % 2]
                               for i in range(num_keys)])


@pytest.fixture(scope="module")
def resident():
    from gpu_engine.backends.cuda import CudaBackend

    matrix = random_matrix(4097 + 1234, seed=9)
    return CudaBackend().load(matrix), NumpyBackend(workers=8).load(matrix), matrix.domain_bits


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", [DispatchShape(), DispatchShape(graph=True),
                                      DispatchShape(micro_batch=24, streams=2, graph=True)])
def test_two_batches_of_one_shape_in_flight_answer_as_numpy(resident, dispatch):
    gpu, cpu, d = resident
    batches = [_keys(96, 5331, d, seed=s) for s in range(6)]
    expected = [cpu.answer(keys) for keys in batches]
    running = gpu.start(batches[0], dispatch)
    for i in range(1, len(batches)):
        behind = gpu.start(batches[i], dispatch)  # the second buffer set of this shape
        assert np.array_equal(running.result(), expected[i - 1])
        running = behind
    assert np.array_equal(running.result(), expected[-1])


@pytest.mark.gpu
def test_a_third_batch_of_one_shape_is_refused_until_one_is_collected(resident):
    gpu, cpu, d = resident
    keys = _keys(9, 5331, d, seed=40)
    first, second = gpu.start(keys), gpu.start(keys)
    with pytest.raises(RuntimeError, match="collect one first"):
        gpu.start(keys)
    expected = cpu.answer(keys)
    assert np.array_equal(first.result(), expected)
    third = gpu.start(keys)
    assert np.array_equal(second.result(), expected)
    assert np.array_equal(third.result(), expected)


@pytest.mark.gpu
def test_batches_of_other_shapes_beside_each_other(resident):
    gpu, cpu, d = resident
    batches = [_keys(n, 5331, d, seed=50 + n) for n in (3, 96, 48, 3)]
    started = [gpu.start(keys) for keys in batches[:2]]
    assert np.array_equal(started[0].result(), cpu.answer(batches[0]))
    started.append(gpu.start(batches[2]))
    started.append(gpu.start(batches[3]))
    for run, keys in zip(started[1:], batches[1:]):
        assert np.array_equal(run.result(), cpu.answer(keys))


@pytest.mark.gpu
def test_a_batch_is_answered_without_waiting_for_the_one_started_behind_it():
    from gpu_engine.backends.cuda import CudaBackend

    matrix = random_matrix(1 << 18, seed=12)  # a 96-key batch here keeps the H100 ~3 ms
    gpu = CudaBackend().load(matrix)
    small, large = _keys(3, 1 << 18, 18, seed=60), _keys(96, 1 << 18, 18, seed=61)
    for _ in range(2):  # the second round runs captured shapes, as the engine does after warm-up
        first = gpu.start(small)
        behind = gpu.start(large)  # queued on the same stream behind the first
        first.result()
        assert not behind.done()  # the first's answers did not wait for the batch behind it
        behind.result()
    gpu.release()
