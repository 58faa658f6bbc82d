"""The CUDA backend: launch planning and argument checks (no GPU), and answers equal to NumPy's (GPU),
for both key formats (v1, docs/PROTOCOL.md section 3, and v2, section 3.1)."""
import hashlib

import numpy as np
import pytest

from gpu_engine.backends import BackendUnavailable, DispatchShape
from gpu_engine.backends import cuda_plan
from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, DpfKey, KeyBatch, gen_keys
from gpu_engine.matrix import PAGE_BYTES, PageMatrix, random_matrix
from tests.protocol_vectors import (
    ANSWER0_SHA256, ANSWER1_SHA256, KEY0_HEX, KEY1_HEX, V2_ANSWER0_SHA256, V2_ANSWER1_SHA256,
    V2_KEY0_HEX, V2_KEY1_HEX, vector_matrix, vector_pages,
)

MAINNET_PAGES = 16_817_159
V2_MMA = "v2-mma"  # v2 keys on the tensor-core scan whatever the batch size
V2_ALU = "v2-alu"  # v2 keys on the ALU scan whatever the batch size (GPUs before sm_80)
V2_FRAG = "v2-fragments"  # v2 keys over a matrix in the fragments layout (always the tensor cores)
V1_FRAG = "v1-fragments"  # v1 keys over a matrix in the fragments layout (dpf_scan_v1_frag)
# every GPU answer test runs for v1 keys, v2 keys as the engine scans them (the ALU below
# cuda_plan.MMA_MIN_KEYS keys, the tensor cores from there), and v2 keys on either scan alone;
# those that take `backend` also over the fragments layout
FORMATS = [KEY_FORMAT_V1, KEY_FORMAT_V2, V2_MMA, V2_ALU]
LAYOUT_FORMATS = FORMATS + [V2_FRAG, V1_FRAG]
FRAGMENT_FORMATS = (V2_FRAG, V1_FRAG)


def _key_format(fmt):
    return KEY_FORMAT_V2 if fmt in (V2_MMA, V2_ALU, V2_FRAG) else KEY_FORMAT_V1 if fmt == V1_FRAG else fmt


def _v2_scan(fmt):
    return {V2_MMA: "mma", V2_ALU: "alu"}.get(fmt, "auto")


def _keys(num_keys, num_pages, d, seed, fmt=KEY_FORMAT_V1):
    rng = np.random.default_rng(seed)
    fmt = _key_format(fmt)
    return KeyBatch.from_keys([gen_keys(int(rng.integers(num_pages)), d, rng, key_format=fmt)[i % 2]
                               for i in range(num_keys)])


@pytest.fixture(autouse=True)
def _scan_of_the_format(request):
    """A GPU test's `fmt` picks the v2 scan of the matrices it loads (the backend's v2_scan)."""
    fmt = getattr(getattr(request.node, "callspec", None), "params", {}).get("fmt")
    if fmt is None or "cuda" not in request.fixturenames:
        yield
        return
    cuda = request.getfixturevalue("cuda")
    if fmt == V2_MMA and not cuda.tensor_cores:
        pytest.skip(f"{cuda.device_name} has no 1-bit tensor-core products")
    before, cuda.v2_scan = cuda.v2_scan, _v2_scan(fmt)
    yield
    cuda.v2_scan = before


# --- launch planning and checks: pure code, run in CI ---------------------------------------------


@pytest.mark.parametrize("num_keys, max_group, expect", [
    (96, 16, (16, 6)), (3, 16, (3, 1)), (9, 16, (9, 1)), (24, 16, (12, 2)), (5, 16, (5, 1)),
    (1, 16, (1, 1)), (17, 16, (9, 2)), (96, 32, (32, 3)), (48, 8, (8, 6)), (33, 32, (24, 2)),
    (40, 12, (10, 4)), (70, 24, (24, 3)),
])
def test_pick_group_keys(num_keys, max_group, expect):
    group_keys, groups = cuda_plan.pick_group_keys(num_keys, max_group)
    assert (group_keys, groups) == expect
    assert group_keys in cuda_plan.SCAN_GROUP_SIZES
    assert groups * group_keys >= num_keys > (groups - 1) * group_keys


def test_pick_group_keys_rejects_uncompiled_sizes():
    with pytest.raises(ValueError, match="max_group_keys"):
        cuda_plan.pick_group_keys(10, 20)
    with pytest.raises(ValueError, match="num_keys"):
        cuda_plan.pick_group_keys(0, 16)


@pytest.mark.parametrize("depth", list(range(0, 25)))
def test_top_stages_reach_depth_in_short_stages(depth):
    stages = cuda_plan.top_stages(depth)
    assert sum(levels for _, levels in stages) == depth
    assert all(1 <= levels <= cuda_plan.MAX_TOP_LEVELS for _, levels in stages)
    at = 0
    for depth_in, levels in stages:
        assert depth_in == at
        at += levels


@pytest.mark.parametrize("pages, d, keys", [
    (1, 1, 1), (1, 25, 3), (2, 1, 2), (3, 2, 96), (255, 8, 7), (4097, 13, 30), (4097, 20, 3),
    (65536, 16, 3), (65536, 16, 96), (2**20 + 17, 21, 96), (MAINNET_PAGES, 25, 3), (MAINNET_PAGES, 25, 96),
])
def test_plan_covers_every_chunk_once(pages, d, keys):
    plan = cuda_plan.plan_scan(pages, d, keys)
    c = plan.chunk_levels
    assert c == min(cuda_plan.DEFAULT_CHUNK_LEVELS, d)
    assert plan.num_chunks == -(-pages // 2**c)
    runs = plan.grid // plan.num_groups
    assert plan.grid == runs * plan.num_groups
    assert runs * plan.chunks_per_block >= plan.num_chunks > (runs - 1) * plan.chunks_per_block
    assert plan.shared_bytes <= cuda_plan.MAX_SHARED_BYTES
    assert plan.scan_template == "dpf_scan" and plan.tree_depth == d and plan.tree_leaves == pages
    if plan.stages:
        last = plan.stages[-1]
        assert last.depth_in + last.levels == d - c
        assert plan.root_stride == last.live_out == plan.num_chunks
        for prev, nxt in zip(plan.stages, plan.stages[1:]):
            assert nxt.live_in == prev.live_out
    else:
        assert d == c and plan.num_chunks == 1


@pytest.mark.parametrize("pages, keys", [(40_000, 96), (40_000, 222), (2**20 + 17, 66), (2**20 + 17, 250)])
def test_the_leaf_bits_tiles_write_every_key_and_leaf_once(pages, keys):
    # dpf_leaf_bits' tiled path for the wgmma scan, its block and thread arithmetic replayed: block
    # b, thread (a, c) reads key key0 + a's leaf leaf0 + c and writes leaf leaf0 + a's key key0 + c
    # at sel[(key / G * padded_leaves + leaf) * G + key % G], padded leaves not a multiple of 16
    plan = cuda_plan.plan_scan(pages, 25, keys, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               mma_max_tiles=14, layout="fragments", wgmma=True)
    tile, g, pl = cuda_plan.LEAF_BITS_TILE, plan.group_keys, plan.padded_leaves
    assert tile * tile == cuda_plan.MMA_THREADS and plan.padded_keys % tile == 0
    leaf_tiles = -(-pl // tile)
    blocks = np.arange(cuda_plan.leaf_bits_grid(plan))
    key0, leaf0 = blocks // leaf_tiles * tile, blocks % leaf_tiles * tile
    a, c = np.divmod(np.arange(cuda_plan.MMA_THREADS), tile)
    leaf, key = (leaf0[:, None] + a[None, :]).ravel(), (key0[:, None] + c[None, :]).ravel()
    written = leaf < pl
    slot = ((key // g) * pl + leaf) * g + key % g
    assert np.array_equal(np.sort(slot[written]), np.arange(plan.padded_keys * pl))
    assert pl % tile != 0 or pages == 40_000  # a partial tile of leaves at 2^20 + 17 pages


@pytest.mark.parametrize("pages, d, keys", [
    (1, 1, 1), (1, 25, 3), (2, 1, 2), (3, 2, 96), (128, 7, 5), (129, 8, 5), (255, 8, 7),
    (4097, 13, 30), (4097, 20, 3), (65536, 16, 96), (2**20 + 17, 21, 96), (MAINNET_PAGES, 25, 96),
])
def test_v2_plan_covers_every_leaf_once(pages, d, keys):
    plan = cuda_plan.plan_scan(pages, d, keys, key_format=KEY_FORMAT_V2)
    n, leaves = max(d - 7, 0), -(-pages // 128)
    assert (plan.tree_depth, plan.tree_leaves, plan.chunk_levels, plan.shared_bytes) == (n, leaves, 0, 0)
    assert plan.num_chunks == leaves and plan.depth_top == n
    assert plan.scan_template == "dpf_scan_bits"
    runs = plan.grid // plan.num_groups
    assert plan.grid == runs * plan.num_groups
    assert runs * plan.chunks_per_block >= leaves > (runs - 1) * plan.chunks_per_block
    if n:
        last = plan.stages[-1]
        assert last.depth_in + last.levels == n
        assert plan.root_stride == last.live_out == leaves
        for prev, nxt in zip(plan.stages, plan.stages[1:]):
            assert nxt.live_in == prev.live_out
    else:
        assert not plan.stages and leaves == 1 and plan.root_stride == 1
    assert cuda_plan.workspace_bytes(plan) >= plan.padded_keys * (4 * cuda_plan.krec_words(n) + PAGE_BYTES)


def _simulate_scan_bits(plan, matrix, keys):
    """dpf_scan_bits<G> as its text runs, block by block (the leaves as dpf_expand_top leaves
    them, with final_cw applied as the kernel applies it): (K, 4096) u8 answers."""
    from morpho_pir.dpf import eval_full

    bits = eval_full(keys, plan.tree_leaves)  # (K, leaves, 4) u32: a leaf's selection words
    pad = plan.padded_keys - len(keys)  # the host repeats the last key into the last group
    bits = np.concatenate([bits, np.repeat(bits[-1:], pad, axis=0)])
    pages = matrix.block(0, matrix.num_pages)
    out = np.zeros((plan.padded_keys, pages.shape[1]), dtype=np.uint32)
    g = plan.group_keys
    for block in range(plan.grid):
        group, run = block % plan.num_groups, block // plan.num_groups
        first = run * plan.chunks_per_block
        for leaf in range(first, min(plan.tree_leaves, first + plan.chunks_per_block)):
            n_pages = min(128, plan.num_pages - leaf * 128)
            for w in range(0, (n_pages + 31) // 32):
                for p in range(min(32, n_pages - 32 * w)):
                    page = pages[leaf * 128 + 32 * w + p]
                    for key in range(group * g, group * g + g):
                        if (int(bits[key, leaf, w]) >> p) & 1:
                            out[key] ^= page
    return out[:len(keys)].astype("<u4").view(np.uint8)


@pytest.mark.parametrize("pages, d, keys, max_group", [
    (1, 1, 2, 16), (3, 2, 5, 16), (130, 8, 7, 4), (255, 9, 3, 16), (700, 10, 11, 4)])
def test_the_v2_scan_as_planned_equals_numpy(pages, d, keys, max_group):
    from gpu_engine.backends.cpu import reference_answers

    matrix = random_matrix(pages, seed=pages, domain_bits=d)
    batch = _keys(keys, pages, d, seed=d, fmt=KEY_FORMAT_V2)
    plan = cuda_plan.plan_scan(pages, d, keys, max_group_keys=max_group, resident_blocks=4,
                            key_format=KEY_FORMAT_V2)
    assert np.array_equal(_simulate_scan_bits(plan, matrix, batch), reference_answers(matrix, batch))


def test_plan_keeps_key_groups_of_a_run_adjacent_at_mainnet():
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 96)
    assert (plan.group_keys, plan.num_groups) == (16, 6)
    # enough blocks for several waves of 264 resident blocks, few enough for cheap atomics
    assert 264 * 4 <= plan.grid <= 264 * 16
    # tree nodes of depth d - 8 for 96 keys (17 B each) dominate the batch's working memory
    assert 96 * 65693 * 17 <= cuda_plan.workspace_bytes(plan) <= 96 * (65693 + 129) * 17 + 96 * 5000


def test_scan_shared_bytes_matches_the_kernel_layout():
    # L=128, G=16: 192 node slots of 16 B + 7 cw + 1 final per key, then 192 + 7 t bytes per key
    assert cuda_plan.scan_shared_bytes(16, 7) == 16 * (192 * 16 + 7 * 16 + 16) + 192 * 16 + 7 * 16
    with pytest.raises(ValueError, match="shared memory"):
        cuda_plan.plan_scan(2**20, 20, 96, max_group_keys=32, chunk_levels=9)


def test_split_micro_batches():
    assert cuda_plan.split_micro_batches(96, 0) == [(0, 96)]
    assert cuda_plan.split_micro_batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert cuda_plan.split_micro_batches(3, 8) == [(0, 3)]
    with pytest.raises(ValueError):
        cuda_plan.split_micro_batches(3, -1)


@pytest.mark.parametrize("fmt, d, depth", [(KEY_FORMAT_V1, 7, 7), (KEY_FORMAT_V2, 14, 7),
                                             (KEY_FORMAT_V2, 7, 0)])
def test_key_records_hold_every_field_where_the_kernel_reads_it(fmt, d, depth):
    keys = _keys(3, 100, d, seed=1, fmt=fmt)
    rec = cuda_plan.pack_key_records(keys.root_seed, keys.root_t, keys.cw_seed, keys.cw_t, keys.final_cw)
    d = depth  # the tree's levels: the records hold those
    assert rec.dtype == np.uint32 and rec.shape == (3, cuda_plan.krec_words(d))
    assert rec.shape[1] % 4 == 0 and rec.shape[1] >= 12 + 5 * d
    for k in range(3):
        assert np.array_equal(rec[k, 0:4], keys.root_seed[k])
        assert np.array_equal(rec[k, 4:8], keys.final_cw[k])
        assert rec[k, 8] == keys.root_t[k]
        for level in range(d):
            assert np.array_equal(rec[k, 12 + 4 * level : 16 + 4 * level], keys.cw_seed[k, level])
            assert rec[k, 12 + 4 * d + level] == keys.cw_t[k, level, 0] | (keys.cw_t[k, level, 1] << 1)


def test_key_batch_checks_reject_before_launch():
    cuda_plan.check_key_batch(_keys(2, 50, 9, seed=2, fmt=KEY_FORMAT_V2), 9)  # 2 levels
    keys = _keys(2, 50, 6, seed=2)
    cuda_plan.check_key_batch(keys, 6)
    with pytest.raises(ValueError, match="domain_bits"):
        cuda_plan.check_key_batch(keys, 7)
    bad = [
        ("root_seed", keys.root_seed.astype(np.int64), "root_seed must be uint32"),
        ("cw_seed", keys.cw_seed[:, :5], r"cw_seed must have shape \(2, 6, 4\)"),
        ("final_cw", keys.final_cw.T.copy().T, "final_cw must be C-contiguous"),
        ("cw_t", keys.cw_t + 1, "cw_t must hold only 0 and 1"),
        ("root_t", np.array([0, 2], dtype=np.uint8), "root_t must hold only 0 and 1"),
    ]
    for field, value, message in bad:
        broken = KeyBatch(**{**keys.__dict__, field: value})
        with pytest.raises(ValueError, match=message):
            cuda_plan.check_key_batch(broken, 6)


def test_check_array_and_rows():
    cuda_plan.check_array("pages", np.zeros((3, 1024), np.uint32), np.uint32, (3, 1024))
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_plan.check_array("pages", np.zeros((1024, 3), np.uint32).T, np.uint32, (3, 1024))
    idx, data = cuda_plan.check_rows({5: bytes(range(256)), 0: b"\x01" * 256}, 16)
    assert idx.tolist() == [5, 0] and data.shape == (2, 64) and data[0, 0] == 0x03020100
    with pytest.raises(ValueError, match="outside"):
        cuda_plan.check_rows({16: bytes(256)}, 16)
    with pytest.raises(ValueError, match="255 bytes"):
        cuda_plan.check_rows({1: bytes(255)}, 16)


def test_fill_reference_is_splitmix64():
    from gpu_engine.backends.cuda_module import fill_reference

    words = fill_reference(0, 2, seed=0)
    # SplitMix64 of 0 is the published first output of a zero-seeded SplitMix64 generator
    assert int(words[0]) | (int(words[1]) << 32) == 0xE220A8397B1DCDAF
    assert fill_reference(5, 3, 9).tolist() == fill_reference(0, 8, 9)[10:16].tolist()


# --- the GPU: answers byte-identical to the NumPy backend -------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    from gpu_engine.backends.cuda import CudaBackend

    return CudaBackend()


@pytest.fixture(scope="module")
def cuda_fragments(cuda):
    """The same GPU storing its matrices in the fragments layout (both key formats, tensor cores)."""
    from gpu_engine.backends.cuda import CudaBackend

    if not cuda.tensor_cores:
        pytest.skip(f"{cuda.device_name} has no 1-bit tensor-core products")
    return CudaBackend(layout="fragments")


@pytest.fixture
def backend(request, cuda):
    """`cuda`, or for fmt V2_FRAG and V1_FRAG the backend of the fragments layout."""
    fmt = getattr(getattr(request.node, "callspec", None), "params", {}).get("fmt")
    return request.getfixturevalue("cuda_fragments") if fmt in FRAGMENT_FORMATS else cuda


def _reference(matrix, keys):
    from gpu_engine.backends.cpu import NumpyBackend

    return NumpyBackend(workers=8).load(matrix).answer(keys)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, key_hex, sha256", [
    (KEY_FORMAT_V1, (KEY0_HEX, KEY1_HEX), (ANSWER0_SHA256, ANSWER1_SHA256)),
    (KEY_FORMAT_V2, (V2_KEY0_HEX, V2_KEY1_HEX), (V2_ANSWER0_SHA256, V2_ANSWER1_SHA256)),  # section 7
    (V2_MMA, (V2_KEY0_HEX, V2_KEY1_HEX), (V2_ANSWER0_SHA256, V2_ANSWER1_SHA256)),
    (V2_FRAG, (V2_KEY0_HEX, V2_KEY1_HEX), (V2_ANSWER0_SHA256, V2_ANSWER1_SHA256)),
    (V1_FRAG, (KEY0_HEX, KEY1_HEX), (ANSWER0_SHA256, ANSWER1_SHA256)),
])
def test_protocol_vectors_on_gpu(backend, fmt, key_hex, sha256):
    keys = KeyBatch.from_keys([DpfKey.from_bytes(bytes.fromhex(h)) for h in key_hex])
    answers = backend.load(vector_matrix()).answer(keys)
    assert hashlib.sha256(answers[0].tobytes()).hexdigest() == sha256[0]
    assert hashlib.sha256(answers[1].tobytes()).hexdigest() == sha256[1]
    assert (answers[0] ^ answers[1]).tobytes() == vector_pages()[42].tobytes()


# every domain size 1..25 appears, each with page counts from the issue that fit it
_SHAPES = [(1, d) for d in (1, 2, 5, 13, 25)] + [(2, 1), (2, 3), (3, 2), (3, 9), (255, 8), (255, 11),
           (4097, 13), (4097, 14), (4097, 25)] + [(min(2**d, 3 * 2**(d - 2) + 1), d) for d in range(4, 17)] + \
          [(65536, 16), (65536, 17), (3000, 18), (3000, 19), (3000, 20), (3000, 21), (3000, 22), (3000, 23), (3000, 24)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYOUT_FORMATS)
@pytest.mark.parametrize("pages, d", _SHAPES)
def test_matches_numpy(backend, pages, d, fmt):
    matrix = random_matrix(pages, seed=pages + d, domain_bits=d)
    keys = _keys(7, pages, d, seed=d, fmt=fmt)
    assert np.array_equal(backend.load(matrix).answer(keys), _reference(matrix, keys))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYOUT_FORMATS)
@pytest.mark.parametrize("queries", list(range(1, 33)))
def test_batch_sizes_match_numpy(backend, queries, fmt):
    matrix = random_matrix(4097, seed=queries)
    keys = _keys(3 * queries, 4097, matrix.domain_bits, seed=100 + queries, fmt=fmt)
    assert np.array_equal(backend.load(matrix).answer(keys), _reference(matrix, keys))


@pytest.fixture(scope="module")
def shared_65536(cuda):
    """One resident 65,536-page matrix and, per key format, two 96-key batches with their NumPy
    answers."""
    matrix = random_matrix(65536, seed=3)
    batches = {fmt: [_keys(96, 65536, 16, seed=s, fmt=fmt) for s in (31, 32)] for fmt in FORMATS}
    return cuda.load(matrix), {fmt: [(keys, _reference(matrix, keys)) for keys in batches[fmt]]
                               for fmt in FORMATS}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dispatch", [
    DispatchShape(), DispatchShape(micro_batch=3), DispatchShape(micro_batch=12, streams=4),
    DispatchShape(graph=True), DispatchShape(micro_batch=24, streams=2, graph=True),
])
@pytest.mark.parametrize("max_group_keys", [8, 16, 32])
def test_dispatch_shapes_and_groups_match_numpy(shared_65536, dispatch, max_group_keys, fmt):
    resident, batches = shared_65536
    resident.max_group_keys, resident.v2_scan = max_group_keys, _v2_scan(fmt)
    try:
        for keys, expect in batches[fmt]:  # a replayed graph must answer the new keys, not the captured ones
            assert np.array_equal(resident.answer(keys, dispatch), expect)
    finally:
        resident.max_group_keys, resident.v2_scan = cuda_plan.DEFAULT_MAX_GROUP_KEYS, "auto"


def _poison(resident):
    """Garbage in every device and pinned buffer a launch of `resident` writes."""
    import cupy

    for state in resident._states.values():
        state.out_host.view(np.uint8)[...] = 0x5A
        for item in state.micro_batches:
            item.out.fill(0xDEADBEEF)
            for seed, t in item.nodes:
                seed.fill(0xFFFFFFFF)
                t.fill(1)
            if item.sel is not None:
                item.sel.fill(0xFFFFFFFF)
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", [DispatchShape(), DispatchShape(micro_batch=12, streams=4, graph=True)])
def test_poisoned_buffers_never_reach_the_answers(shared_65536, dispatch):
    # every device and pinned buffer a launch writes is filled with garbage between batches of
    # both formats: each answer must still be the NumPy one (the kernels clear and overwrite it all)
    resident, batches = shared_65536
    for _ in range(2):
        for fmt in FORMATS:
            resident.v2_scan = _v2_scan(fmt)
            for keys, expect in batches[fmt]:
                _poison(resident)
                assert np.array_equal(resident.answer(keys, dispatch), expect)
    resident.v2_scan = "auto"


@pytest.mark.gpu
def test_mixed_formats_in_turn_use_their_own_buffers(shared_65536):
    resident, batches = shared_65536
    for (v1, expect1), (v2, expect2) in zip(batches[KEY_FORMAT_V1], batches[KEY_FORMAT_V2]):
        assert np.array_equal(resident.answer(v2), expect2)
        assert np.array_equal(resident.answer(v1), expect1)
        assert np.array_equal(resident.answer(v2), expect2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_shape_matches_numpy(cuda, fmt):
    pages = 2**20 + 17
    resident = cuda.generate(pages, seed=4)
    import cupy

    host = PageMatrix(cupy.asnumpy(resident._pages))
    keys = _keys(9, pages, host.domain_bits, seed=4, fmt=fmt)
    assert np.array_equal(resident.answer(keys), _reference(host, keys))
    assert resident.read_page(pages - 1) == host.page(pages - 1)


@pytest.fixture(scope="module")
def generated_answers(cuda):
    """(pages, keys) -> (resident, v2 batch, NumPy answers), made once for the run-length test."""
    import cupy

    made = {}

    def get(pages, keys):
        if (pages, keys) not in made:
            resident = cuda.generate(pages, seed=keys)
            host = PageMatrix(cupy.asnumpy(resident._pages))
            batch = _keys(keys, pages, host.domain_bits, seed=keys, fmt=KEY_FORMAT_V2)
            made[(pages, keys)] = (resident, batch, _reference(host, batch))
        return made[(pages, keys)]

    yield get
    for resident, _, _ in made.values():
        resident.release()


@pytest.mark.gpu
@pytest.mark.parametrize("pages, keys", [(40000, 48), (40000, 72), (40000, 96), (40000, 128), (40000, 174),
                                         (2**20 + 17, 96), (2**20 + 17, 174)])
@pytest.mark.parametrize("run_chunks", [1, 3, None])  # None: the plan's (8 or 128 chunks a block)
def test_mma_run_lengths_match_numpy(cuda, generated_answers, pages, keys, run_chunks):
    if not cuda.tensor_cores:
        pytest.skip(f"{cuda.device_name} has no 1-bit tensor-core products")
    resident, batch, expect = generated_answers(pages, keys)
    resident.v2_scan, resident.mma_chunks_per_block = "mma", run_chunks
    assert np.array_equal(resident.answer(batch), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("max_tiles", [1, 5])  # the fewest; what an sm_80 block's shared memory holds
def test_fewer_tiles_a_block_give_the_same_answers(cuda, generated_answers, max_tiles):
    if not cuda.tensor_cores:
        pytest.skip(f"{cuda.device_name} has no 1-bit tensor-core products")
    if cuda.compute_capability >= (9, 0):
        assert cuda.mma_max_tiles == max(cuda_plan.MMA_TILE_COUNTS)
    resident, batch, expect = generated_answers(40000, 174)
    resident.v2_scan, resident.mma_chunks_per_block = "mma", None
    held = cuda.mma_max_tiles
    try:
        cuda.mma_max_tiles = max_tiles
        assert resident.plan(174, KEY_FORMAT_V2).group_keys <= 16 * max_tiles
        assert np.array_equal(resident.answer(batch), expect)
    finally:
        cuda.mma_max_tiles = held


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KEY_FORMAT_V1, V2_FRAG])  # the pages layout, the fragments layout
@pytest.mark.parametrize("pages", [300, 16384 + 1500])  # one piece of the upload, two
def test_generated_pages_follow_the_host_formula(backend, fmt, pages):
    from gpu_engine.backends.cuda_module import fill_reference

    resident = backend.generate(pages, seed=77)
    for page in sorted({0, 1, 299, min(1023, pages - 1), pages - 1}):
        expect = fill_reference(page * 512, 512, 77).astype("<u4").tobytes()
        assert resident.read_page(page) == expect


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYOUT_FORMATS)
@pytest.mark.parametrize("pages", [600, 2500])  # one chunk of the fragments layout, three
def test_write_rows_reach_the_answers(backend, fmt, pages):
    matrix = random_matrix(pages, seed=8)
    resident = backend.load(matrix)
    rng = np.random.default_rng(8)
    rows = {int(r): rng.bytes(256) for r in rng.choice(pages * 16, size=40, replace=False)}
    rows[pages * 16 - 1] = rng.bytes(256)  # the last row of the last (padded) chunk
    resident.write_rows(rows)
    for r, data in rows.items():
        matrix.write_row(r, data)
    keys = _keys(12, pages, matrix.domain_bits, seed=9, fmt=fmt)
    assert np.array_equal(resident.answer(keys), _reference(matrix, keys))
    for page in {r // 16 for r in rows}:  # read back through the layout
        assert resident.read_page(page) == matrix.page(page)
    with pytest.raises(ValueError, match="outside"):
        resident.write_rows({pages * 16: bytes(256)})


@pytest.mark.gpu
def test_upload_reports_progress_and_memory(cuda):
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    seen = []
    matrix = random_matrix(40000, seed=2)
    resident = cuda.load(matrix, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (matrix.nbytes, matrix.nbytes) and len(seen) >= 3
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert resident.nbytes == matrix.nbytes
    # the matrix is held on the device, and the used bytes memory_info reports (the device's,
    # as /health shows them) count it. Not their growth: a pool chunk that an earlier test left
    # partly in use can hold the new matrix without the device's used bytes moving.
    assert pool.used_bytes() >= before + matrix.nbytes
    assert cuda.memory_info()["used_bytes"] >= pool.total_bytes()
    resident.release()


@pytest.mark.gpu
def test_too_large_matrix_is_refused_naming_both_sizes(cuda):
    total = cuda.memory_info()["total_bytes"]
    pages = total // PAGE_BYTES + 1
    with pytest.raises(BackendUnavailable, match=rf"needs {pages * PAGE_BYTES} bytes.*free of {total} bytes"):
        cuda.generate(pages, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYOUT_FORMATS)
def test_bad_keys_raise_before_launch(backend, fmt):
    resident = backend.load(random_matrix(10, seed=1))  # 10 pages: domain_bits 4
    keys = _keys(2, 10, 5, seed=1, fmt=fmt)
    with pytest.raises(ValueError, match="domain_bits"):
        resident.answer(keys)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_buffers_are_rebuilt_after_out_of_memory(cuda, monkeypatch, fmt):
    import cupy

    from gpu_engine.backends import cuda as cuda_mod

    matrix = random_matrix(300, seed=6)
    resident = cuda.load(matrix)
    resident.answer(_keys(6, 300, matrix.domain_bits, seed=6, fmt=fmt))  # one cached batch shape
    real, calls = cuda_mod._DispatchState, []

    def first_call_fails(*args):
        calls.append(len(resident._states))
        if len(calls) == 1:
            raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)
        return real(*args)

    monkeypatch.setattr(cuda_mod, "_DispatchState", first_call_fails)
    keys = _keys(9, 300, matrix.domain_bits, seed=7, fmt=fmt)
    assert np.array_equal(resident.answer(keys), _reference(matrix, keys))
    assert calls == [1, 0]  # the retry came after the cached shape was dropped


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LAYOUT_FORMATS)
def test_engine_answers_and_writes_rows_on_the_gpu(backend, fmt):
    from concurrent.futures import ThreadPoolExecutor

    from gpu_engine.engine import Engine
    from gpu_engine.matrix import ServedEpoch

    matrix = random_matrix(5000, seed=12)
    engine = Engine(backend, ServedEpoch(epoch_id=3, matrix=matrix)).start()
    try:
        rng = np.random.default_rng(12)
        targets = [[int(t) for t in rng.integers(0, 5000, size=3)] for _ in range(12)]
        pairs = [[gen_keys(t, matrix.domain_bits, rng, key_format=_key_format(fmt)) for t in query]
                 for query in targets]
        with ThreadPoolExecutor(6) as pool:  # concurrent requests are coalesced into launches
            side0 = list(pool.map(lambda q: engine.answer([[p[0] for p in q]], timeout=60), pairs))
            side1 = list(pool.map(lambda q: engine.answer([[p[1] for p in q]], timeout=60), pairs))
        for query, a, b in zip(targets, side0, side1):
            assert a.epoch_id == 3
            for k, target in enumerate(query):
                assert bytes(x ^ y for x, y in zip(a.pages[0][k], b.pages[0][k])) == matrix.page(target)
        row = targets[0][0] * 16 + 5
        engine.write_rows({row: bytes(range(256))}).result(60)
        a = engine.answer([[p[0] for p in pairs[0]]], timeout=60)
        b = engine.answer([[p[1] for p in pairs[0]]], timeout=60)
        page = bytes(x ^ y for x, y in zip(a.pages[0][0], b.pages[0][0]))
        assert page[5 * 256 : 6 * 256] == bytes(range(256))
    finally:
        engine.stop()


# --- the tensor-core scan's plan: pure code, run in CI ------------------------------------------


@pytest.mark.parametrize("num_keys, expect", [
    (1, (1, 1)), (3, (1, 1)), (16, (1, 1)), (17, (2, 1)), (36, (3, 1)), (96, (6, 1)),
    (97, (7, 1)), (128, (8, 1)), (129, (9, 1)), (176, (11, 1)), (177, (6, 2)), (200, (7, 2)),
    (300, (10, 2)), (400, (9, 3))])
def test_pick_mma_tiles(num_keys, expect):
    tiles, groups = cuda_plan.pick_mma_tiles(num_keys)
    assert (tiles, groups) == expect
    assert tiles in cuda_plan.MMA_TILE_COUNTS
    assert 16 * tiles * groups >= num_keys > 16 * tiles * (groups - 1) - 16


def test_the_tiles_a_block_holds_follow_the_gpus_shared_memory():
    # the opt-in limits of a block: sm_90 227 KiB, sm_80 163 KiB, sm_86/89 99 KiB
    assert cuda_plan.mma_max_tiles(227 * 1024) == max(cuda_plan.MMA_TILE_COUNTS)
    assert cuda_plan.mma_max_tiles(163 * 1024) == 5
    assert cuda_plan.mma_max_tiles(99 * 1024) == 0  # not one tile: such a GPU scans v2 keys on the ALU
    for limit in (163 * 1024, 227 * 1024):
        tiles = cuda_plan.mma_max_tiles(limit)
        assert cuda_plan.mma_shared_bytes(tiles) <= limit
        plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, cuda_plan.MAX_LAUNCH_KEYS, key_format=KEY_FORMAT_V2,
                                   tensor_cores=True, mma_max_tiles=tiles)
        assert plan.group_keys <= 16 * tiles and plan.padded_keys >= cuda_plan.MAX_LAUNCH_KEYS
        assert plan.shared_bytes <= limit
    assert cuda_plan.pick_mma_tiles(174, 5) == (4, 3)
    with pytest.raises(ValueError, match="max_tiles must be one of"):
        cuda_plan.pick_mma_tiles(10, 0)


@pytest.mark.parametrize("scan, keys, expect", [
    ("auto", 1, False), ("auto", cuda_plan.MMA_MIN_KEYS - 1, False), ("auto", cuda_plan.MMA_MIN_KEYS, True),
    ("auto", 96, True), ("mma", 1, True), ("alu", 96, False)])
def test_v2_batches_reach_the_tensor_cores_by_size(scan, keys, expect):
    assert cuda_plan.use_tensor_cores(scan, KEY_FORMAT_V2, keys) is expect
    assert cuda_plan.use_tensor_cores(scan, KEY_FORMAT_V1, keys) is False  # v1 keys: the ALU scan
    with pytest.raises(ValueError, match="v2_scan"):
        cuda_plan.use_tensor_cores("fast", KEY_FORMAT_V2, keys)
    # over the fragments layout v2 keys always take their tensor-core scan, v1 keys plan as v1
    # (dpf_scan_v1_frag, whatever the batch or v2_scan), and both plans hold
    assert cuda_plan.use_tensor_cores(scan, KEY_FORMAT_V2, keys, "fragments") is True
    assert cuda_plan.use_tensor_cores(scan, KEY_FORMAT_V1, keys, "fragments") is False
    for key_format in (KEY_FORMAT_V1, KEY_FORMAT_V2):
        plan = cuda_plan.plan_scan(5000, 13, keys, key_format=key_format, layout="fragments",
                                   tensor_cores=cuda_plan.use_tensor_cores(scan, key_format, keys, "fragments"))
        assert plan.scan_kernel[1].split("<")[0] == ("dpf_scan_v1_frag" if key_format == KEY_FORMAT_V1
                                                     else "dpf_scan_mma_frag")


@pytest.mark.parametrize("pages, d, keys", [
    (1, 1, 1), (3, 2, 96), (128, 7, 5), (1025, 11, 40), (4097, 20, 3), (65536, 16, 96),
    (2**20 + 17, 21, 96), (MAINNET_PAGES, 25, 96), (MAINNET_PAGES, 25, 3)])
def test_mma_plan_covers_every_chunk_and_slice_once(pages, d, keys):
    plan = cuda_plan.plan_scan(pages, d, keys, key_format=KEY_FORMAT_V2, tensor_cores=True)
    assert plan.scan_kernel == ("dpf_scan_mma.cu", f"dpf_scan_mma<{plan.group_keys // 16}>")
    chunks = -(-pages // cuda_plan.MMA_CHUNK_PAGES)
    assert plan.num_chunks == chunks and plan.padded_leaves == 8 * chunks >= -(-pages // 128)
    runs = plan.grid // (cuda_plan.MMA_SLICES * plan.num_groups)
    assert plan.grid == runs * cuda_plan.MMA_SLICES * plan.num_groups
    assert runs * plan.chunks_per_block >= chunks > (runs - 1) * plan.chunks_per_block
    assert plan.padded_keys >= keys and plan.shared_bytes == cuda_plan.mma_shared_bytes(plan.group_keys // 16)
    # the same top stages as the ALU scan of v2 keys: the leaves, 128 pages each
    assert plan.stages == cuda_plan.plan_scan(pages, d, keys, key_format=KEY_FORMAT_V2).stages
    # the selection bits of every (key, leaf) beside the tree nodes
    assert cuda_plan.workspace_bytes(plan) >= plan.padded_keys * plan.padded_leaves * 16
    with pytest.raises(ValueError, match="v2 keys only"):
        cuda_plan.plan_scan(pages, d, keys, tensor_cores=True)


def _bits_of(words, count=32):
    """(..., count) 0/1 of u32 words, bit i at index i."""
    return ((words[..., None].astype(np.uint64) >> np.arange(count, dtype=np.uint64)) & 1).astype(np.int64)


def _words_of(bits):
    """u32 words of (..., 32) 0/1 arrays, index i as bit i."""
    return (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)


def _mma_and_popc(a, b):
    """PTX's mma.m16n8k256 .b1 AND.POPC on one warp's fragments: a (32 lanes, 4) u32 registers and
    b (n, 32 lanes, 2), n products sharing a -> d (n, 32, 4) int. Lane l = 4g + t: A rows g (a0,
    a2) and g + 8 (a1, a3), k 32t.. (a0, a1) and 128 + 32t.. (a2, a3); B column g, k 32t.. (b0)
    and 128 + 32t.. (b1); D rows g (d0, d1) and g + 8 (d2, d3), columns 2t and 2t + 1."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    span = (32 * t)[:, None] + np.arange(32)  # (lane, i): k of bit i of a lane's register
    A = np.zeros((16, 256), np.int64)
    for reg, (row, k0) in enumerate([(0, 0), (8, 0), (0, 128), (8, 128)]):
        A[(g + row)[:, None], k0 + span] = _bits_of(a[:, reg])
    B = np.zeros((len(b), 256, 8), np.int64)
    for reg, k0 in enumerate([0, 128]):
        B[:, k0 + span, g[:, None]] = _bits_of(b[:, :, reg])
    D = np.einsum("mk,nkc->nmc", A, B)
    return np.stack([D[:, g, 2 * t], D[:, g, 2 * t + 1], D[:, g + 8, 2 * t], D[:, g + 8, 2 * t + 1]], axis=2)


def _simulate_scan_mma(plan, matrix, keys, rng):
    """dpf_scan_mma<T> block by block as its text plans and indexes: blocks (run, slice, group),
    each chunk's slice placed in B fragments where stage_fragments puts them (the transpose as
    its result: transpose32 itself is checked bit for bit by the GPU tests), A fragments read from
    the selection bits as mma_chunk reads them, each product as PTX defines the fragments, and the
    accumulators' low bits placed in the answer as the kernel places them. The selection bits are
    the protocol's (eval_full) with the bits past num_pages cleared, as dpf_leaf_bits leaves them;
    pages past num_pages are garbage, as in the staging buffer."""
    from morpho_pir.dpf import eval_full

    kp, K, T = plan.padded_keys, plan.group_keys, plan.group_keys // 16
    bits = eval_full(keys, plan.tree_leaves)
    bits = np.concatenate([bits, np.repeat(bits[-1:], kp - len(keys), axis=0)])
    sel = np.zeros((kp, plan.padded_leaves, 4), np.uint32)  # dpf_leaf_bits
    sel[:, : plan.tree_leaves] = bits
    page_bits = _bits_of(sel.reshape(kp, -1), 32).reshape(kp, -1)  # (kp, padded pages)
    page_bits[:, plan.num_pages :] = 0
    sel = _words_of(page_bits.reshape(kp, plan.padded_leaves, 4, 32))
    pages = matrix.block(0, matrix.num_pages)
    garbage = rng.integers(0, 2**32, size=(plan.num_chunks * 1024 - plan.num_pages, 1024), dtype=np.uint32)
    pages = np.concatenate([pages, garbage])
    out = np.zeros((kp, 1024), np.uint32)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    for block in range(plan.grid):
        group, rest = block % plan.num_groups, block // plan.num_groups
        piece, run = rest % cuda_plan.MMA_SLICES, rest // cuda_plan.MMA_SLICES
        key0 = group * K
        acc = np.zeros((T, 8, 4, 32, 4), np.int64)  # [tile][warp][j][lane][reg]
        first = run * plan.chunks_per_block
        for chunk in range(first, min(plan.num_chunks, first + plan.chunks_per_block)):
            raw = pages[chunk * 1024 : chunk * 1024 + 1024, piece * 8 : piece * 8 + 8]  # (page, w)
            # stage_fragments: thread (pg, w) -> bfrag[ks][half][b][lane w * 4 + t]
            bfrag = np.zeros((4, 2, 32, 32), np.uint32)
            for pg in range(32):
                # x[w][b] bit i: bit b of word w of page 32 pg + i
                x = _words_of(_bits_of(raw[32 * pg : 32 * pg + 32]).transpose(1, 2, 0))
                bfrag[pg >> 3, (pg >> 2) & 1, :, np.arange(8) * 4 + (pg & 3)] = x
            # the chunk's selection bits as shared memory holds them: [leaf][key][word]
            selw = sel[key0 : key0 + K, chunk * 8 : chunk * 8 + 8].transpose(1, 0, 2).reshape(-1)
            for ks in range(4):
                for m in range(T):
                    lo = (2 * ks) * K * 4 + g * 4 + t + m * 64
                    hi = lo + K * 4
                    a = np.stack([selw[lo], selw[lo + 32], selw[hi], selw[hi + 32]], axis=1)
                    # warp W's j-th product takes n-block 4W + j: all 32 n-blocks share a
                    b = np.stack([bfrag[ks, 0], bfrag[ks, 1]], axis=2)  # (n-block, lane, reg)
                    acc[m] += _mma_and_popc(a, b).reshape(8, 4, 32, 4)
        outsm = np.zeros(K * 8, np.uint32)
        for m in range(T):
            for warp in range(8):
                for r in range(4):
                    word = np.zeros(32, np.uint32)
                    for j in range(4):
                        word |= ((acc[m, warp, j, :, r] & 1) << (4 * warp + j)).astype(np.uint32)
                    np.bitwise_or.at(outsm, (16 * m + g + (r >> 1) * 8) * 8 + 2 * t + (r & 1), word)
        for i in range(K * 8):
            out[key0 + i // 8, piece * 8 + i % 8] ^= outsm[i]
    return out[: len(keys)].astype("<u4").view(np.uint8)


@pytest.mark.kernels
@pytest.mark.parametrize("pages, d, keys, run_chunks", [
    (1, 1, 2, None), (200, 8, 3, None), (1500, 11, 17, None),
    (1100, 11, 200, 1)])  # two key groups of 7 tiles, two runs
def test_the_mma_scan_as_planned_equals_numpy(pages, d, keys, run_chunks):
    # the kernel's index arithmetic and PTX's fragment layout, checked on the CPU; the GPU tests
    # check the kernel itself (test_matches_numpy and the rest with fmt V2_MMA)
    from gpu_engine.backends.cpu import reference_answers

    matrix = random_matrix(pages, seed=pages, domain_bits=d)
    batch = _keys(keys, pages, d, seed=d, fmt=KEY_FORMAT_V2)
    plan = cuda_plan.plan_scan(pages, d, keys, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               resident_blocks=2, mma_chunks_per_block=run_chunks)
    simulated = _simulate_scan_mma(plan, matrix, batch, np.random.default_rng(1))
    assert np.array_equal(simulated, reference_answers(matrix, batch))


def test_mma_runs_are_short_for_few_key_tiles_and_fill_the_gpu():
    few = cuda_plan.plan_scan(MAINNET_PAGES, 25, 48, key_format=KEY_FORMAT_V2, tensor_cores=True)
    many = cuda_plan.plan_scan(MAINNET_PAGES, 25, 96, key_format=KEY_FORMAT_V2, tensor_cores=True)
    assert (few.group_keys, few.chunks_per_block) == (48, cuda_plan.MMA_SHORT_RUN_CHUNKS)
    assert (many.group_keys, many.chunks_per_block) == (96, cuda_plan.MMA_LONG_RUN_CHUNKS)
    # a small matrix still gets several waves of 132 blocks, whatever the run length
    small = cuda_plan.plan_scan(65536, 16, 96, key_format=KEY_FORMAT_V2, tensor_cores=True)
    assert small.grid >= 132 * 4 and small.chunks_per_block <= cuda_plan.MMA_SHORT_RUN_CHUNKS


def test_the_v2_scan_is_checked_when_a_backend_is_made():
    from gpu_engine.backends.factory import create_backend

    with pytest.raises(ValueError, match="unknown v2 scan 'fast', expected one of auto, mma, alu"):
        create_backend("cpu", v2_scan="fast")
    assert create_backend("cpu", v2_scan="alu").name == "cpu"  # one scan: the setting is ignored


@pytest.mark.gpu
@pytest.mark.parametrize("scan", ["auto", "mma", "alu"])
def test_the_backends_v2_scan_reaches_the_matrices_it_loads(scan):
    from gpu_engine.backends.factory import create_backend

    backend = create_backend("cuda", v2_scan=scan)
    resident = backend.load(random_matrix(300, seed=3))
    assert resident.v2_scan == (scan if backend.tensor_cores else "alu")
    keys = _keys(30, 300, resident.domain_bits, seed=3, fmt=KEY_FORMAT_V2)
    assert resident.plan(30, KEY_FORMAT_V2).tensor_cores is (backend.tensor_cores and scan != "alu")
    assert np.array_equal(resident.answer(keys), _reference(random_matrix(300, seed=3), keys))
    resident.release()


# --- the fragments layout (cuda_plan.MATRIX_LAYOUTS): its plan, pure code, run in CI -------------


def test_a_fragments_layout_is_scanned_on_the_tensor_cores_by_either_key_format():
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 96, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               layout="fragments")
    assert plan.scan_kernel == ("dpf_scan_mma.cu", "dpf_scan_mma_frag<6>")
    assert plan.shared_bytes == cuda_plan.mma_shared_bytes(6, "fragments") == 3 * 32768 + 3 * 16 * 8 * 96 + 4 * 96 * 8
    # v1 keys: dpf_scan's plan with groups of 16 keys, chunks of one k-step of 256 pages
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 24, key_format=KEY_FORMAT_V1, layout="fragments",
                               max_group_keys=8, chunk_levels=6)  # neither applies
    assert plan.scan_kernel == ("dpf_scan.cu", "dpf_scan_v1_frag<16>")
    assert (plan.group_keys, plan.num_groups, plan.padded_keys, plan.chunk_levels) == (16, 2, 32, 8)
    # its producers expand no padding key, so neither do the top stages; the other scans run the padding
    assert plan.top_keys == 24
    pages_plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 24, key_format=KEY_FORMAT_V1)
    assert pages_plan.top_keys == pages_plan.padded_keys
    assert plan.num_chunks == -(-MAINNET_PAGES // 256) and plan.stages[-1].live_out == plan.num_chunks
    assert plan.shared_bytes == cuda_plan.v1_frag_shared_bytes() <= cuda_plan.MAX_SHARED_BYTES
    assert plan.scan_threads == cuda_plan.V1_FRAG_THREADS == 512  # producers and multipliers


@pytest.mark.parametrize("sms", [132, 114, 108])
def test_v1_fragments_launches_fill_whole_waves_of_one_block_an_sm(sms):
    # a block past V1_FRAG_WAVES whole waves would run a whole run alone in a wave of its own
    waves = sms * cuda_plan.V1_FRAG_WAVES
    for queries in range(1, 75):
        plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 3 * queries, key_format=KEY_FORMAT_V1, layout="fragments",
                                   resident_blocks=2 * sms)
        assert waves - plan.num_groups < plan.grid <= waves, (queries, plan.num_groups, plan.grid)
    small = cuda_plan.plan_scan(3, 2, 3, key_format=KEY_FORMAT_V1, layout="fragments")
    assert (small.chunk_levels, small.num_chunks, small.stages, small.shared_bytes) == (2, 1, (), plan.shared_bytes)
    for key_format, tensor_cores in ((KEY_FORMAT_V1, True), (KEY_FORMAT_V2, False)):
        with pytest.raises(ValueError, match="fragments layout is scanned on the tensor cores: v2 keys"):
            cuda_plan.plan_scan(300, 9, 3, key_format=key_format, tensor_cores=tensor_cores, layout="fragments")
    with pytest.raises(ValueError, match="layout must be one of"):
        cuda_plan.plan_scan(300, 9, 3, layout="tiles")


def test_plans_name_the_path_a_v1_launch_over_the_fragments_layout_takes():
    # one or two queries on the ALU, more on the tensor cores (the kernel branches on the same constant)
    def path(keys):
        plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, keys, key_format=KEY_FORMAT_V1, layout="fragments")
        return cuda_plan.describe_plan(plan).split()[1]

    assert cuda_plan.V1_FRAG_ALU_KEYS == 6
    assert [path(keys) for keys in (3, 6, 9, 96)] == ["alu-frag", "alu-frag", "mma-frag", "mma-frag"]
    # in pairs of groups where the backend has v1_pairs: 2 and 6 groups; 3 groups one a block
    pairs = {keys: cuda_plan.describe_plan(cuda_plan.plan_scan(MAINNET_PAGES, 25, keys, key_format=KEY_FORMAT_V1,
                                                              layout="fragments", v1_pairs=True)).split()[1]
             for keys in (6, 24, 48, 96)}
    assert pairs == {6: "alu-frag", 24: "mma-pair", 48: "mma-frag", 96: "mma-pair"}


@pytest.mark.parametrize("shared_kib, pages_tiles, fragments_tiles", [
    (227, 11, 11), (163, 5, 10), (99, 0, 0)])  # sm_90, sm_80, sm_86/89
def test_the_fragments_layout_fits_more_tiles_where_shared_memory_is_short(shared_kib, pages_tiles, fragments_tiles):
    # no staging of page-major slices: three chunks of fragments and selection bits instead
    assert cuda_plan.mma_max_tiles(shared_kib * 1024) == pages_tiles
    assert cuda_plan.mma_max_tiles(shared_kib * 1024, "fragments") == fragments_tiles


def test_the_wgmma_scan_reads_the_fragments_layout_with_up_to_224_keys_a_block():
    assert cuda_plan.mma_max_tiles(227 * 1024, "fragments", wgmma=True) == 14
    assert cuda_plan.mma_shared_bytes(14, "fragments") == 3 * 32768 + 3 * 16 * 8 * 224 + 4 * 224 * 8
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 222, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               layout="fragments", mma_max_tiles=14, wgmma=True)
    assert (plan.scan_kernel, plan.num_groups) == (("dpf_scan_mma.cu", "dpf_scan_wgmma_frag<14>"), 1)
    assert "wgmma-frag" in cuda_plan.describe_plan(plan)
    # mma.sync over the same layout: 11 tiles at most, so two groups (two passes) for 222 keys
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 222, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               layout="fragments")
    assert (plan.scan_kernel[1], plan.num_groups) == ("dpf_scan_mma_frag<7>", 2)
    # up to 48 keys the scan waits on memory, and mma.sync runs nearer its floor
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 24, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               layout="fragments", mma_max_tiles=14, wgmma=True)
    assert (plan.scan_kernel[1], plan.wgmma) == ("dpf_scan_mma_frag<2>", False)
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, 49, key_format=KEY_FORMAT_V2, tensor_cores=True,
                               layout="fragments", mma_max_tiles=14, wgmma=True)
    assert plan.scan_kernel[1] == "dpf_scan_wgmma_frag<4>"
    with pytest.raises(ValueError, match="wgmma scan reads the fragments layout only"):
        cuda_plan.plan_scan(MAINNET_PAGES, 25, 96, key_format=KEY_FORMAT_V2, tensor_cores=True, wgmma=True)
    with pytest.raises(ValueError, match="mma_max_tiles above 11 needs the wgmma scan"):
        cuda_plan.plan_scan(MAINNET_PAGES, 25, 96, key_format=KEY_FORMAT_V2, tensor_cores=True,
                            layout="fragments", mma_max_tiles=14)


def test_nvrtc_targets_sm_90a_on_hopper_alone():
    from gpu_engine.backends.cuda_module import arch_options

    assert arch_options((9, 0)) == ("-arch=sm_90a",)
    assert arch_options((8, 0)) == arch_options((8, 9)) == arch_options((10, 0)) == ()


def test_the_fragments_layout_holds_whole_chunks():
    assert [cuda_plan.mma_chunks(n) for n in (1, 1024, 1025, MAINNET_PAGES)] == [1, 1, 2, 16424]
    assert cuda_plan.MMA_FRAGMENT_WORDS * 4 * cuda_plan.MMA_SLICES == cuda_plan.MMA_CHUNK_PAGES * PAGE_BYTES


def test_the_layout_is_checked_when_a_backend_is_made():
    from gpu_engine.backends.factory import create_backend

    with pytest.raises(ValueError, match="unknown matrix layout 'tiles', expected one of auto, pages, fragments"):
        create_backend("cpu", layout="tiles")
    assert create_backend("cpu", layout="fragments").key_formats == (KEY_FORMAT_V1, KEY_FORMAT_V2)  # ignored


def test_auto_falls_back_to_the_pages_layout_where_the_gpu_cannot_hold_fragments(monkeypatch):
    # an sm_86/89 GPU (99 KiB of shared memory a block) or one before sm_80: CUDA in the pages
    # layout, saying why, rather than the CPU; MORPHO_ENGINE_BACKEND=cuda refuses
    from gpu_engine.backends import factory

    class Gpu:
        fallback_reason = None

        def __init__(self, layout):
            self.name, self.layout = "cuda", layout

    def cuda(device, v2_scan, layout):
        if layout == "fragments":
            raise BackendUnavailable("the fragments layout is read by the tensor cores")
        return Gpu(layout)

    monkeypatch.setattr(factory, "_cuda_backend", cuda)
    backend = factory.create_backend("auto", layout="fragments")
    assert (backend.name, backend.layout) == ("cuda", "pages")
    assert backend.fallback_reason == "the fragments layout is read by the tensor cores"
    with pytest.raises(BackendUnavailable, match="read by the tensor cores"):
        factory.create_backend("cuda", layout="fragments")


# --- the fragments layout (cuda_plan.MATRIX_LAYOUTS) on the GPU ----------------------------------


@pytest.fixture(scope="module")
def generated_fragments(cuda, cuda_fragments):
    """pages -> (the fragments-layout resident, its pages on the host), both generated with one
    seed: the host copy from the pages layout, which the tests above hold to the host formula."""
    import cupy

    made = {}

    def get(pages):
        if pages not in made:
            plain = cuda.generate(pages, seed=pages)
            host = PageMatrix(cupy.asnumpy(plain._pages))
            plain.release()
            made[pages] = (cuda_fragments.generate(pages, seed=pages), host)
        return made[pages]

    yield get
    for resident, _ in made.values():
        resident.release()


_FRAGMENT_RUNS = [(40000, keys, run) for keys in (3, 48, 60, 96, 174, 192, 222) for run in (1, 2, 3, None)] + [
    (40000, 250, None), (2**20 + 17, 9, None), (2**20 + 17, 96, None)]  # 250 keys: two key groups either way


@pytest.mark.gpu
@pytest.mark.parametrize("wgmma", [True, False])  # Hopper's warpgroup products, mma.sync
def test_fragments_layout_answers_every_run_length_and_tile_count(cuda_fragments, generated_fragments, wgmma):
    # one tile (two blocks an SM) to 14 (224 keys: wgmma from 4 tiles, 60 keys; mma.sync splits 222
    # in two groups), two key groups, runs of 1, 2 and 3 chunks and the plan's, and a page count past
    # 2**20 that leaves the last chunk nearly empty (9 keys: mma.sync; 96: wgmma's 128-chunk runs);
    # one NumPy answer per batch
    if wgmma and not cuda_fragments.wgmma:
        pytest.skip(f"{cuda_fragments.device_name} has no warpgroup products (sm_90a)")
    held = cuda_fragments.wgmma, cuda_fragments.mma_max_tiles
    cuda_fragments.wgmma = wgmma
    cuda_fragments.mma_max_tiles = max(cuda_plan.WGMMA_TILE_COUNTS if wgmma else cuda_plan.MMA_TILE_COUNTS)
    try:
        for pages, keys in dict.fromkeys((p, k) for p, k, _ in _FRAGMENT_RUNS):
            resident, host = generated_fragments(pages)
            batch = _keys(keys, pages, host.domain_bits, seed=keys, fmt=KEY_FORMAT_V2)
            expect = _reference(host, batch)
            for run in [r for p, k, r in _FRAGMENT_RUNS if (p, k) == (pages, keys)]:
                resident.mma_chunks_per_block = run
                try:
                    plan = resident.plan(keys, KEY_FORMAT_V2)
                    on_wgmma = wgmma and plan.group_keys >= 16 * cuda_plan.WGMMA_MIN_TILES
                    kernel = "dpf_scan_wgmma_frag<" if on_wgmma else "dpf_scan_mma_frag<"
                    assert plan.scan_kernel[1].startswith(kernel)
                    assert np.array_equal(resident.answer(batch), expect), (pages, keys, run)
                finally:
                    resident.mma_chunks_per_block = None
    finally:
        cuda_fragments.wgmma, cuda_fragments.mma_max_tiles = held


@pytest.mark.gpu
def test_fragments_layout_reads_back_every_page_and_holds_whole_chunks(generated_fragments):
    pages = 2**20 + 17
    resident, host = generated_fragments(pages)
    assert resident.nbytes == -(-pages // 1024) * 1024 * PAGE_BYTES  # the last chunk padded
    for page in (0, 1, 31, 32, 1023, 1024, 2**20 - 1, 2**20, pages - 1):
        assert resident.read_page(page) == host.page(page)
    with pytest.raises(ValueError, match="outside"):
        resident.read_page(pages)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [KEY_FORMAT_V2, KEY_FORMAT_V1])
@pytest.mark.parametrize("dispatch", [DispatchShape(), DispatchShape(micro_batch=24, streams=2, graph=True)])
def test_fragments_layout_poisoned_buffers_never_reach_the_answers(cuda_fragments, dispatch, fmt):
    matrix = random_matrix(5000, seed=21)
    resident = cuda_fragments.load(matrix)
    for seed in (1, 2, 3):
        keys = _keys(96, 5000, matrix.domain_bits, seed=seed, fmt=fmt)
        _poison(resident)
        assert np.array_equal(resident.answer(keys, dispatch), _reference(matrix, keys))


@pytest.mark.gpu
@pytest.mark.parametrize("pages, keys", [(40000, 3), (40000, 17), (40000, 96), (2**20 + 17, 16), (2**20 + 17, 48)])
def test_fragments_layout_answers_v1_keys_over_many_chunks_and_key_groups(cuda_fragments, generated_fragments,
                                                                           pages, keys):
    # chunks of 256 pages: 157 at 40,000 pages (the last 64 live), 4,097 past 2**20 (one live page
    # ... 17 in the last); 1 to 6 key groups of 16, the last padded
    assert cuda_fragments.key_formats == (KEY_FORMAT_V1, KEY_FORMAT_V2)
    resident, host = generated_fragments(pages)
    batch = _keys(keys, pages, host.domain_bits, seed=keys, fmt=KEY_FORMAT_V1)
    # an even number of groups in pairs where the GPU runs clusters (17 and 96 keys on sm_90)
    pairs = cuda_fragments.v1_pairs and -(-keys // 16) % 2 == 0
    assert resident.plan(keys, KEY_FORMAT_V1).scan_kernel == ("dpf_scan.cu", f"dpf_scan_v1_{'pair' if pairs else 'frag'}<16>")
    assert np.array_equal(resident.answer(batch), _reference(host, batch))


@pytest.mark.gpu
@pytest.mark.parametrize("pages, keys", [(40000, 24), (4097, 64), (2**20 + 17, 32), (2**20 + 17, 96)])
def test_pairs_of_key_groups_answer_as_a_block_a_group_does(cuda_fragments, generated_fragments, pages, keys):
    # sm_90: a batch of 2, 4 or 6 groups runs dpf_scan_v1_pair (two groups a cluster, each block
    # multiplying half the slices by both groups' A fragments); the same answers as dpf_scan_v1_frag's
    if not cuda_fragments.v1_pairs:
        pytest.skip("dpf_scan_v1_pair runs on sm_90 (its sm_90a build) only")
    resident, host = generated_fragments(pages)
    batch = _keys(keys, pages, host.domain_bits, seed=keys + 1, fmt=KEY_FORMAT_V1)
    assert resident.plan(keys, KEY_FORMAT_V1).scan_kernel == ("dpf_scan.cu", "dpf_scan_v1_pair<16>")
    paired = resident.answer(batch)
    assert np.array_equal(paired, _reference(host, batch))
    cuda_fragments.v1_pairs = False
    try:
        assert resident.plan(keys, KEY_FORMAT_V1).scan_kernel == ("dpf_scan.cu", "dpf_scan_v1_frag<16>")
        assert np.array_equal(resident.answer(batch), paired)
    finally:
        cuda_fragments.v1_pairs = True
