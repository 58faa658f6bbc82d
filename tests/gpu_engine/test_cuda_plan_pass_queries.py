"""The queries one launch serves in one pass over the matrix (cuda_plan.pass_queries), which caps
every launch an engine makes, and the static bound policies are checked against: pure code, run
in CI; one GPU test holds a CudaBackend to it."""
import pytest

from gpu_engine.backends import cuda_plan
from morpho_pir.dpf import KEY_FORMAT_V2
from morpho_pir.protocol import MAX_BATCH_QUERIES

MAINNET_PAGES = 16_817_159
SM_90, SM_80 = 227 * 1024, 163 * 1024  # shared memory a block may opt in to


@pytest.mark.parametrize("shared, layout, wgmma, tiles, queries", [
    (SM_90, "pages", False, 11, 58),  # mma.sync, 176 keys a group: the H100 and H200 in pages
    (SM_90, "fragments", True, 14, 74),  # the wgmma scan, 224 keys a group
    (SM_90, "fragments", False, 11, 58),  # the fragments layout kept on mma.sync
    (SM_80, "pages", False, 5, 26),  # the A100: fewer tiles fit its shared memory
    (SM_80, "fragments", False, 10, 53),
])
def test_a_pass_serves_the_whole_queries_of_one_key_group(shared, layout, wgmma, tiles, queries):
    assert cuda_plan.mma_max_tiles(shared, layout, wgmma) == tiles
    assert cuda_plan.pass_queries(tiles) == queries
    # as many queries' keys as one pass holds plan as one key group; one query more needs two
    kwargs = dict(key_format=KEY_FORMAT_V2, tensor_cores=True, mma_max_tiles=tiles, layout=layout, wgmma=wgmma)
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, queries * cuda_plan.KEYS_PER_QUERY, **kwargs)
    assert plan.num_groups == 1
    plan = cuda_plan.plan_scan(MAINNET_PAGES, 25, (queries + 1) * cuda_plan.KEYS_PER_QUERY, **kwargs)
    assert plan.num_groups == 2


@pytest.mark.parametrize("capability, shared, layout, queries", [
    ((9, 0), SM_90, "fragments", 74),  # the H100 and H200: wgmma over fragments
    ((8, 0), SM_80, "pages", None),  # the A100: v1's fragments scan needs more than its 163 KiB
    ((8, 6), 99 * 1024, "pages", None),  # no tile of the fragments scans fits
    ((8, 9), 99 * 1024, "pages", None),
    ((7, 5), 64 * 1024, "pages", None),  # no 1-bit products at all
])
def test_auto_picks_the_layout_the_fastest_scans_read_and_says_why(capability, shared, layout,
                                                                   queries):
    picked, why = cuda_plan.auto_layout(capability, shared)
    assert picked == layout
    sm = f"sm_{capability[0]}{capability[1]}"
    assert why.startswith(f"auto: {sm}")
    if queries is not None:
        assert f"{queries} queries a pass" in why
    if capability == (8, 0):
        assert "the fragments scans need 198080" in why


def test_a_backend_without_a_choice_of_layout_says_it_has_pages():
    from gpu_engine.backends.factory import create_backend

    described = create_backend("cpu").describe()
    assert described["layout"] == "pages"
    assert described["layout_reason"] == "this backend scans pages, its one layout"


def test_the_static_bound_is_the_most_any_scan_serves_in_one_pass():
    assert cuda_plan.MAX_LAUNCH_QUERIES == 74 and cuda_plan.MAX_LAUNCH_KEYS == 222
    assert cuda_plan.MAX_LAUNCH_QUERIES == max(map(cuda_plan.pass_queries, cuda_plan.ANY_TILE_COUNTS))
    # no tensor-core scan (the ALU scan reads each run once for every key group): the static bound
    assert cuda_plan.pass_queries(0) == cuda_plan.MAX_LAUNCH_QUERIES
    for tiles in (-1, 15):
        with pytest.raises(ValueError, match="max_tiles must be 0 or one of"):
            cuda_plan.pass_queries(tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pages", "fragments"])
def test_a_cuda_backend_serves_its_scans_pass(layout):
    from gpu_engine.backends import BackendUnavailable
    from gpu_engine.backends.cuda import CudaBackend

    try:
        backend = CudaBackend(layout=layout)
    except BackendUnavailable as exc:  # a GPU without the tensor cores the fragments layout needs
        pytest.skip(str(exc))
    # one pass of its scan, and never less than a request (sm_80's pages layout: 26 a pass, 32)
    one_pass = cuda_plan.pass_queries(backend.mma_max_tiles if backend.tensor_cores else 0)
    assert backend.pass_queries == max(one_pass, MAX_BATCH_QUERIES)
    assert backend.describe()["pass_queries"] == backend.pass_queries
    if backend.compute_capability == cuda_plan.WGMMA_CAPABILITY:  # the H100 and H200
        assert backend.pass_queries == (74 if layout == "fragments" else 58)
        if layout == "fragments":
            assert CudaBackend(layout=layout, wgmma=False).pass_queries == 58  # mma.sync's 11 tiles
    assert CudaBackend(layout="pages", v2_scan="alu").pass_queries == cuda_plan.MAX_LAUNCH_QUERIES


@pytest.mark.gpu
def test_a_cuda_backend_asked_for_auto_takes_the_gpus_layout_and_its_pass():
    from gpu_engine.backends.factory import create_backend

    backend = create_backend("cuda", layout="auto")
    info = backend.describe()
    assert info["layout"] in cuda_plan.MATRIX_LAYOUTS and info["layout_reason"].startswith("auto: ")
    if backend.compute_capability == cuda_plan.WGMMA_CAPABILITY:
        assert info["layout"] == "fragments" and info["pass_queries"] == 74
