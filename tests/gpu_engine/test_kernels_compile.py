"""Kernel text against the host (constants, shared memory, arguments) and an nvcc build for sm_90a."""
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.backends import cuda_plan
from gpu_engine.backends.cuda_plan import (
    MMA_THREADS,
    MMA_TILE_COUNTS,
    SCAN_GROUP_SIZES,
    WGMMA_TILE_COUNTS,
    SCAN_THREADS,
    TOP_THREADS,
)
from gpu_engine.backends.cuda_module import (
    KERNEL_DIR,
    KERNEL_FILES,
    KERNEL_NAMES,
    NVRTC_OPTIONS,
    kernel_source,
)

NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin:/usr/local/bin"))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
# Threads per block the host launches each kernel with (gpu_engine/backends/cuda.py); a kernel's
# __launch_bounds__ must be exactly this: fewer and the launch fails, more and registers are lost.
LAUNCH_THREADS = {"dpf_expand_top": TOP_THREADS,
                  **{f"dpf_scan<{g}>": SCAN_THREADS for g in SCAN_GROUP_SIZES},
                  **{f"dpf_scan_bits<{g}>": SCAN_THREADS for g in SCAN_GROUP_SIZES},
                  "dpf_leaf_bits": MMA_THREADS,
                  f"dpf_scan_v1_frag<{cuda_plan.V1_FRAG_GROUP_KEYS}>": cuda_plan.V1_FRAG_THREADS,
                  f"dpf_scan_v1_pair<{cuda_plan.V1_FRAG_GROUP_KEYS}>": cuda_plan.V1_FRAG_THREADS,
                  **{f"dpf_scan_mma<{t}>": MMA_THREADS for t in MMA_TILE_COUNTS},
                  **{f"dpf_scan_mma_frag<{t}>": MMA_THREADS for t in MMA_TILE_COUNTS},
                  **{f"dpf_scan_wgmma_frag<{t}>": MMA_THREADS for t in WGMMA_TILE_COUNTS}}


def test_every_cu_file_is_loaded_by_the_backend():
    assert sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(KERNEL_FILES)


def test_sources_include_no_headers():
    # NVRTC has no C++ standard library: a kernel that includes one compiles with nvcc only
    for name in KERNEL_FILES:
        assert not re.search(r"^\s*#\s*include", kernel_source(name), re.M), name


def _code(name):
    """The text of kernels/<name> without its comments and string literals."""
    code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", kernel_source(name), flags=re.S))
    return re.sub(r'"[^"\n]*"', '""', code)


def test_the_host_constants_are_the_compilers_d_options():
    defines = cuda_plan.kernel_defines()
    assert set(defines) == {"SCAN_THREADS", "TOP_THREADS", "MAX_TOP_LEVELS", "KREC_ROOT",
                            "KREC_FINAL", "KREC_ROOT_T", "KREC_CW", "LEAF_PAGES", "PAGE_WORDS",
                            "MMA_THREADS", "MMA_SLICE_WORDS", "MMA_CHUNK_PAGES", "MMA_PIPELINE_TILES",
                            "MMA_FRAG_STAGES", "LEAF_BITS_TILE", "V1_FRAG_GROUP_KEYS", "V1_FRAG_CHUNK_LEVELS",
                            "V1_FRAG_THREADS", "V1_FRAG_AFRAG_ROW", "V1_FRAG_TOP_CHUNKS", "V1_FRAG_TOP_LEVELS", "V1_FRAG_TOP_NODES",
                            "V1_FRAG_ALU_KEYS"}
    # each is the module constant of its name, and reaches NVRTC (and nvcc here) as -DNAME=value
    assert defines == {name: getattr(cuda_plan, name) for name in defines}
    assert [o for o in NVRTC_OPTIONS if o.startswith("-D")] == [
        f"-D{name}={getattr(cuda_plan, name)}" for name in defines]
    assert cuda_plan.SCAN_THREADS * 16 == 4096  # a thread per 16-byte column of a page
    assert cuda_plan.LEAF_PAGES == 128  # a v2 leaf: 128 selection bits, 4 words of 32 pages


def test_a_variants_define_replaces_the_hosts_value_of_its_name():
    # a benchmark's --define V1_FRAG_ALU_KEYS=0 must not leave the host's -DV1_FRAG_ALU_KEYS=6 beside it
    options = cuda_plan.define_options(["V1_FRAG_ALU_KEYS=0", "V1F_XOR_PREFETCH=4"])
    assert [o for o in options if o.startswith("-DV1_FRAG_ALU_KEYS=")] == ["-DV1_FRAG_ALU_KEYS=0"]
    assert options[-1] == "-DV1F_XOR_PREFETCH=4"
    assert len(options) == len(cuda_plan.kernel_defines()) + 1
    for bad in ("V1F_XOR_PREFETCH", "=4", "NOT A NAME=1"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            cuda_plan.define_options([bad])


def test_a_benchmarks_defines_add_up_and_a_bad_one_changes_nothing(monkeypatch):
    from gpu_engine.backends import cuda_module

    monkeypatch.setattr(cuda_module, "NVRTC_OPTIONS", cuda_module.NVRTC_OPTIONS)
    monkeypatch.setattr(cuda_module, "_VARIANT_DEFINES", ())
    cuda_module.add_defines(["V1F_XOR_PREFETCH=4"])
    cuda_module.add_defines(["V1_FRAG_ALU_KEYS=0"])
    options = cuda_module.NVRTC_OPTIONS
    assert "-DV1F_XOR_PREFETCH=4" in options and "-DV1_FRAG_ALU_KEYS=0" in options
    assert "-DV1_FRAG_ALU_KEYS=6" not in options and options[0] == "--std=c++17"
    with pytest.raises(ValueError, match="NAME=VALUE"):
        cuda_module.add_defines(["V1F_XOR_PREFETCH"])
    cuda_module.add_defines([])
    assert cuda_module.NVRTC_OPTIONS == options


def test_every_macro_the_scan_kernels_use_is_defined_in_them_or_by_the_host_not_both():
    host = set(cuda_plan.kernel_defines())
    used_somewhere = set()
    for name in ("dpf_scan.cu", "dpf_scan_mma.cu"):
        code = _code(name)
        defined_here = set(re.findall(r"^\s*#\s*define\s+(\w+)", code, re.M))
        assert not defined_here & host, f"restated in {name}"
        used = set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", code))  # macros are upper case; G, L, T are not
        assert used - defined_here <= host, name
        used_somewhere |= used - defined_here
    assert used_somewhere == host  # no -D option every kernel ignores


def _check_scan_carving(kernel, scope, group_keys, chunk_levels, start="extern __shared__ uint4 smem[];"):
    """`kernel` (a kernel or function) of dpf_scan.cu carves the regions of SCAN_SHARED_REGIONS for
    group_keys keys and chunks of 2**chunk_levels leaves from `start` on, in the host's order and
    sizes (scope: its names' values)."""
    code = _code("dpf_scan.cu")
    body = code[re.search(rf"[\n ]{kernel}\(", code).start():]
    body = body[body.index(start):]
    carving = re.findall(r"^\s*(uint4|u8)\* (\w+) = (.+?);", body, re.M)[:len(cuda_plan.SCAN_SHARED_REGIONS)]
    regions = cuda_plan.SCAN_SHARED_REGIONS
    assert [name for _, name, _ in carving] == [name for name, _, _ in regions]
    assert [{"uint4": 16, "u8": 1}[kind] for kind, _, _ in carving] == [size for _, size, _ in regions]
    assert carving[0][2].startswith("smem")
    leaves = 1 << chunk_levels
    for (prev, _, count), (_, _, expr) in zip(regions, carving[1:]):
        # each region starts where the one before it ends: `prev + size`
        m = re.fullmatch(r"(?:\(u8\*\)\()?(\w+) \+ (.+?)\)?", expr)
        assert m and m.group(1) == prev, expr
        size = eval(m.group(2).replace("/", "//"), {}, dict(scope))  # noqa: S307 - our own text
        assert size == group_keys * count(leaves, chunk_levels), (prev, expr)
    total = sum(size * count(leaves, chunk_levels) for _, size, count in regions) * group_keys
    assert cuda_plan.scan_shared_bytes(group_keys, chunk_levels) == total


@pytest.mark.parametrize("group_keys, chunk_levels", [(1, 1), (3, 5), (16, 8), (32, 6)])
def test_the_scan_kernel_carves_shared_memory_as_the_host_sizes_it(group_keys, chunk_levels):
    scope = {"G": group_keys, "L": 1 << chunk_levels, "c": chunk_levels}
    _check_scan_carving("dpf_scan", scope, group_keys, chunk_levels)


def _params(kernel):
    """(type, name) of each parameter of `kernel` as dpf_scan.cu defines it."""
    signature = re.search(rf"\n{kernel}\(([^)]*)\)\s*{{", _code("dpf_scan.cu")).group(1)
    params = []
    for param in signature.split(","):
        *kind, name = param.replace("__restrict__", "").split()
        params.append((" ".join(kind), name))
    return params


def _check_args(kernel, args, expected):
    params = _params(kernel)
    assert [name for _, name in params] == list(expected), "the test names every parameter"
    assert len(args) == len(params)
    for (kind, name), arg in zip(params, args):
        if "*" in kind:
            assert arg is expected[name], name
        else:
            assert type(arg) is {"int": np.int32, "long long": np.int64}[kind], (name, type(arg))
            assert arg == expected[name], name


def _check_top_args(plan, keyrec, nodes, depth, leaves):
    """dpf_expand_top's arguments of every top stage of `plan`: a tree of `depth` levels whose
    first `leaves` leaves are live."""
    for i, stage in enumerate(plan.stages):
        _check_args("dpf_expand_top", cuda_plan.top_args(plan, i, keyrec, nodes), {
            "keyrec": keyrec, "krec": cuda_plan.krec_words(depth), "domain_bits": depth,
            "num_leaves": leaves, "in_seed": nodes[i - 1][0] if i else nodes[0][0],
            "in_t": nodes[i - 1][1] if i else nodes[0][1],
            "in_stride": plan.stages[i - 1].live_out if i else 0, "depth_in": stage.depth_in,
            "levels": stage.levels, "out_seed": nodes[i][0], "out_t": nodes[i][1],
            "out_stride": stage.live_out})


def test_argument_builders_follow_the_kernel_signatures():
    plan = cuda_plan.plan_scan(4097, 20, 30)
    assert len(plan.stages) == 2
    pages, keyrec, out = object(), object(), object()
    nodes = [(object(), object()) for _ in plan.stages]
    krec = cuda_plan.krec_words(20)
    _check_args("dpf_scan", cuda_plan.scan_args(plan, pages, keyrec, nodes, out), {
        "pages": pages, "num_pages": 4097, "domain_bits": 20, "chunk_levels": plan.chunk_levels,
        "keyrec": keyrec, "krec": krec, "num_keys": 30, "root_seed": nodes[1][0],
        "root_t": nodes[1][1], "root_stride": plan.root_stride, "num_groups": plan.num_groups,
        "chunks_per_block": plan.chunks_per_block, "out": out})
    _check_top_args(plan, keyrec, nodes, depth=20, leaves=4097)
    whole = cuda_plan.plan_scan(200, 8, 3)  # the chunk is the whole tree: roots from the records
    assert not whole.stages
    args = cuda_plan.scan_args(whole, pages, keyrec, [], out)
    assert args[7] is keyrec and args[8] is keyrec and args[9] == 1
    # v1 keys over the fragments layout: dpf_scan's arguments, the matrix in its layout
    frag = cuda_plan.plan_scan(4097, 20, 30, key_format=1, layout="fragments")
    nodes = [(object(), object()) for _ in frag.stages]
    _check_args("dpf_scan_v1_frag", cuda_plan.scan_args(frag, pages, keyrec, nodes, out), {
        "frags": pages, "num_pages": 4097, "domain_bits": 20, "chunk_levels": 8, "keyrec": keyrec,
        "krec": krec, "num_keys": 30, "root_seed": nodes[-1][0], "root_t": nodes[-1][1],
        "root_stride": frag.root_stride, "num_groups": 2, "chunks_per_block": frag.chunks_per_block,
        "out": out})
    _check_top_args(frag, keyrec, nodes, depth=20, leaves=4097)
    # in pairs of groups (sm_90): the same arguments
    pair = cuda_plan.plan_scan(4097, 20, 30, key_format=1, layout="fragments", v1_pairs=True)
    assert pair.scan_kernel == ("dpf_scan.cu", "dpf_scan_v1_pair<16>") and pair.scan_threads == 512
    assert _params("dpf_scan_v1_pair") == _params("dpf_scan_v1_frag")
    assert cuda_plan.scan_args(pair, pages, keyrec, nodes, out) == cuda_plan.scan_args(frag, pages, keyrec, nodes, out)


def test_the_v1_fragments_scan_carves_dpf_scans_regions_for_chunks_of_one_k_step():
    # dpf_scan_v1_frag<16> carves the regions of SCAN_SHARED_REGIONS for 2**V1_FRAG_CHUNK_LEVELS
    # leaves, whatever the plan's c, then its A fragments (128 residues x 32 lanes x 16 bytes in
    # padded rows of 36 uint4s, 16 bytes more a 32 residues) past cw_t, and the host sizes its
    # launches for that
    c, g = cuda_plan.V1_FRAG_CHUNK_LEVELS, cuda_plan.V1_FRAG_GROUP_KEYS
    # (v1f_shared's, which dpf_scan_v1_pair<16> takes too)
    _check_scan_carving("v1f_shared", {"G": g, "V1F_L": 1 << c, "V1_FRAG_CHUNK_LEVELS": c}, g, c,
                        start="uint4* big = smem;")
    code = _code("dpf_scan.cu")
    assert "uint4* afrag = (uint4*)(cw_t + V1_FRAG_CHUNK_LEVELS * G);" in code
    for kernel in ("dpf_scan_v1_frag", "dpf_scan_v1_pair"):
        body = code[code.index(f"\n{kernel}("):]
        assert "extern __shared__ uint4 smem[];" in body[:body.index("\n}")]
        assert "const V1fShared sh = v1f_shared<G>(smem);" in body[:body.index("\n}")]
    assert cuda_plan.V1_FRAG_AFRAG_BYTES == (128 * 36 + 4) * 16
    assert "return r * V1_FRAG_AFRAG_ROW + (r >> 5) + lane;" in code
    # then the first levels' nodes of a batch of chunks (seeds, then t bytes), found from afrag
    assert "uint4* seed = sh.afrag + 128 * V1_FRAG_AFRAG_ROW + 4;" in code
    assert "return {seed, (u8*)(seed + V1F_TOP_NODES * G)};" in code
    assert "#define V1F_TOP_NODES (V1_FRAG_TOP_CHUNKS << V1_FRAG_TOP_LEVELS)" in code
    assert cuda_plan.V1_FRAG_TOPS_BYTES == (cuda_plan.V1_FRAG_TOP_CHUNKS << cuda_plan.V1_FRAG_TOP_LEVELS) * g * (16 + 1)
    assert cuda_plan.plan_scan(3, 2, 3, key_format=1, layout="fragments").shared_bytes == \
        cuda_plan.scan_shared_bytes(g, c) + cuda_plan.V1_FRAG_AFRAG_BYTES + cuda_plan.V1_FRAG_TOPS_BYTES == \
        cuda_plan.v1_frag_shared_bytes()
    # under the SM's 196 KiB carve-out of shared memory (1 KiB of it the system's, 16 bytes the
    # pair's barriers): 60 KiB of L1 left
    assert cuda_plan.v1_frag_shared_bytes() + 16 <= 195 * 1024


def test_argument_builders_follow_the_v2_kernel_signatures():
    # v2 keys (PROTOCOL.md section 3.1): the top stages reach the leaves, 128 pages each
    plan = cuda_plan.plan_scan(2**20 + 17, 21, 30, key_format=2)
    assert plan.tree_depth == 14 and plan.tree_leaves == 8193 and plan.chunk_levels == 0
    assert [(s.depth_in, s.levels) for s in plan.stages] == [(0, 5), (5, 9)]
    assert plan.stages[-1].live_out == plan.num_chunks == 8193
    pages, keyrec, out = object(), object(), object()
    nodes = [(object(), object()) for _ in plan.stages]
    krec = cuda_plan.krec_words(14)
    _check_args("dpf_scan_bits", cuda_plan.scan_args(plan, pages, keyrec, nodes, out), {
        "pages": pages, "num_pages": 2**20 + 17, "tree_depth": 14, "keyrec": keyrec, "krec": krec,
        "num_keys": 30, "leaf_seed": nodes[1][0], "leaf_t": nodes[1][1],
        "leaf_stride": 8193, "num_groups": plan.num_groups,
        "leaves_per_block": plan.chunks_per_block, "out": out})
    _check_top_args(plan, keyrec, nodes, depth=14, leaves=8193)
    for pages_count, d in [(1, 1), (3, 2), (128, 7)]:  # a depth-0 tree: the root is the leaf
        short = cuda_plan.plan_scan(pages_count, d, 3, key_format=2)
        assert not short.stages and short.tree_depth == 0 and short.num_chunks == 1
        args = cuda_plan.scan_args(short, pages, keyrec, [], out)
        assert args[6] is keyrec and args[7] is keyrec and args[8] == 1


@dataclass(frozen=True)
class Compiled:
    report: str  # ptxas -v and the compiler's messages
    ptx: str


def _compile(name, tmp_path):
    src = tmp_path / name
    src.write_text(kernel_source(name))
    # sm_90a, as NVRTC compiles for an H100 or H200 (cuda_module.arch_options): the wgmma scan
    # is compiled only for it
    cmd = [NVCC, "-arch=sm_90a", "--cubin", *NVRTC_OPTIONS, "-Xptxas", "-v", "--keep", "--keep-dir",
           str(tmp_path), "-o", str(tmp_path / "out.cubin"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return Compiled(done.stderr + done.stdout, (tmp_path / f"{Path(name).stem}.ptx").read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """compiled(name): nvcc's output for kernels/<name>, once per module (dpf_scan.cu takes a while)."""
    done = {}

    def compile_once(name):
        if name not in done:
            done[name] = _compile(name, tmp_path_factory.mktemp(Path(name).stem))
        return done[name]

    return compile_once


def _loader_name(symbol):
    """The name get_kernel takes for a compiled entry: an extern "C" kernel's own, a template
    instantiation's name expression (_Z8dpf_scanILi4EE... is dpf_scan<4>)."""
    mangled = re.match(r"_Z(\d+)", symbol)
    if mangled is None:
        return symbol
    end = mangled.end() + int(mangled.group(1))
    argument = re.match(r"ILi(\d+)EE", symbol[end:])
    assert argument is not None, f"unexpected template in {symbol}"
    return f"{symbol[mangled.end():end]}<{argument.group(1)}>"


@pytest.mark.kernels
@needs_nvcc
def test_the_pages_scans_file_compiles_for_a_gpu_before_sm80(tmp_path):
    # NVRTC builds the whole file for the GPU the backend runs on, and dpf_scan.cu holds the pages
    # layout's scans every GPU runs: an instruction of a later architecture left unguarded there
    # (prefetch.global.L2::evict_last needs sm_80) would break them all on a T4 (sm_75)
    src = tmp_path / "dpf_scan.cu"
    src.write_text(kernel_source("dpf_scan.cu"))
    cmd = [NVCC, "-arch=sm_75", "--cubin", *NVRTC_OPTIONS, "-o", str(tmp_path / "out.cubin"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-2000:]}"


@pytest.mark.kernels
@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_compiles_for_sm90a(name, compiled):
    report = compiled(name).report
    assert "error" not in report.lower()
    # the warpgroup products run as issued: nothing in between reads their accumulators
    assert "serialized" not in report
    # ptxas compiled, for sm_90a, exactly the kernels the loader may ask this file for
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", report)
    assert {arch for _, arch in entries} == {"sm_90a"}
    assert sorted(_loader_name(symbol) for symbol, _ in entries) == sorted(KERNEL_NAMES[name])


@pytest.mark.kernels
@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_ptx_entry_points_take_the_blocks_the_host_launches(name, compiled):
    ptx = compiled(name).ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    # .visible .entry SYMBOL(params) then the directives (.maxntid from __launch_bounds__) before {
    entries = {_loader_name(symbol): directives
               for symbol, directives in re.findall(r"\.visible \.entry (\w+)\(.*?\)(.*?)\{", ptx, re.DOTALL)}
    assert sorted(entries) == sorted(KERNEL_NAMES[name])
    for kernel, directives in entries.items():
        bound = re.search(r"\.maxntid (\d+), 1, 1", directives)
        if kernel in LAUNCH_THREADS:
            assert bound is not None and int(bound.group(1)) == LAUNCH_THREADS[kernel], (kernel, directives)


@pytest.mark.kernels
@needs_nvcc
def test_scan_instantiations_match_the_host_and_do_not_spill(compiled):
    report = compiled("dpf_scan.cu").report
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    compiled_sizes = sorted(int(m) for e in entries for m in re.findall(r"dpf_scanILi(\d+)E", e))
    assert compiled_sizes == sorted(SCAN_GROUP_SIZES)
    bits_sizes = sorted(int(m) for e in entries for m in re.findall(r"dpf_scan_bitsILi(\d+)E", e))
    assert bits_sizes == sorted(SCAN_GROUP_SIZES)
    assert "dpf_expand_top" in entries and "dpf_leaf_bits" in entries
    mma = compiled("dpf_scan_mma.cu").report
    mma_entries = re.findall(r"Compiling entry function '(\w+)'", mma)
    tiles = sorted(int(m) for e in mma_entries for m in re.findall(r"dpf_scan_mmaILi(\d+)E", e))
    assert tiles == sorted(MMA_TILE_COUNTS)
    wgmma_tiles = sorted(int(m) for e in mma_entries for m in re.findall(r"dpf_scan_wgmma_fragILi(\d+)E", e))
    assert wgmma_tiles == sorted(WGMMA_TILE_COUNTS)
    # registers capped by __launch_bounds__ must not push accumulators to local memory
    for block in (report + mma).split("Compiling entry function")[1:]:
        name = re.search(r"'(\w+)'", block).group(1)
        spill = re.search(r"(\d+) bytes spill stores", block)
        assert spill is None or spill.group(1) == "0", f"{name} spills: {block}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvrtc_module_has_every_kernel_with_its_launch_bounds(name):
    from gpu_engine.backends.cuda_module import get_kernel

    for kernel in KERNEL_NAMES[name]:
        function = get_kernel(name, kernel)  # NVRTC compiles the file on the first one
        if kernel in LAUNCH_THREADS:
            assert function.max_threads_per_block == LAUNCH_THREADS[kernel], kernel


def test_the_mma_scan_carves_shared_memory_as_the_host_sizes_it():
    code = _code("dpf_scan_mma.cu")
    kernel = code[code.index("dpf_scan_mma(const u32*"):code.index("dpf_scan_mma_frag(const u32*")]
    body = kernel[kernel.index("extern __shared__ uint4 smem[];"):]
    names = [name for name, _ in cuda_plan.MMA_SHARED_REGIONS]
    carving = re.findall(r"^\s*(?:u32|uint4)\* (\w+) = \((?:u32|uint4)\*\)\((.+?)\);", body, re.M)
    assert [name for name, _ in carving] == names and carving[0][1] == "smem"
    # each region starts where the one before it ends, sized as the host sizes it
    words = {"raw": "2 * RAW_WORDS", "selsm": "sel_bufs * CHUNK_LEAVES * K", "bfrag": "frag_bufs * BFRAG_WORDS"}
    assert "sel_bufs = pipelined ? 3 : 2, frag_bufs = pipelined ? 2 : 1;" in code
    assert "constexpr bool pipelined = T >= MMA_PIPELINE_TILES;" in code
    for (prev, _), (_, expr) in zip(carving, carving[1:]):
        assert expr == f"{prev} + {words[prev]}", expr
    for tiles in cuda_plan.MMA_TILE_COUNTS:
        k = 16 * tiles
        raw = 2 * 4 * (cuda_plan.MMA_CHUNK_PAGES * 8 + cuda_plan.MMA_CHUNK_PAGES // 32 * 8)
        sel_bufs, frag_bufs = (3, 2) if tiles >= cuda_plan.MMA_PIPELINE_TILES else (2, 1)
        sel = sel_bufs * 16 * (cuda_plan.MMA_CHUNK_PAGES // 128) * k
        frag = frag_bufs * 4 * (cuda_plan.MMA_CHUNK_PAGES // 256) * 2 * 32 * 32
        assert cuda_plan.mma_shared_bytes(tiles) == raw + sel + frag + 4 * k * 8
        assert cuda_plan.mma_shared_bytes(tiles) <= cuda_plan.MAX_SHARED_BYTES
        if tiles < cuda_plan.MMA_PIPELINE_TILES:  # two blocks an SM: 228 KiB, 1 KiB a block reserved
            assert 2 * (cuda_plan.mma_shared_bytes(tiles) + 1024) <= 228 * 1024


# each scan's stage count and its regions' sizes in words: MMA_FRAG_STAGES chunks' buffers, whole
# chunks (mma.sync) or WGMMA_SPLIT parts of a chunk a stage (wgmma), the same bytes either way
_FRAG_CARVING = {
    "dpf_scan_mma_frag": ("constexpr int stages = MMA_FRAG_STAGES;",
                          {"bfrag": "stages * BFRAG_WORDS", "selsm": "stages * CHUNK_LEAVES * K"}),
    "dpf_scan_wgmma_frag": ("constexpr int stages = MMA_FRAG_STAGES * WGMMA_SPLIT, unit_ksteps = KSTEPS / WGMMA_SPLIT;\n"
                            "    constexpr int unit_words = BFRAG_WORDS / WGMMA_SPLIT, unit_leaves = CHUNK_LEAVES / WGMMA_SPLIT;",
                            {"bfrag": "stages * unit_words", "selsm": "stages * unit_leaves * K"}),
}


@pytest.mark.parametrize("kernel_name, tile_counts", [("dpf_scan_mma_frag", MMA_TILE_COUNTS),
                                                      ("dpf_scan_wgmma_frag", WGMMA_TILE_COUNTS)])
def test_the_fragments_scans_carve_shared_memory_as_the_host_sizes_it(kernel_name, tile_counts):
    code = _code("dpf_scan_mma.cu")
    kernel = code[code.index(f"{kernel_name}(const u32*"):]
    carved = kernel.index("extern __shared__ uint4 smem[];")
    body = kernel[carved:kernel.index("\n\n", carved)]  # up to the first blank line
    carving = re.findall(r"^\s*(?:u32|uint4)\* (\w+) = \((?:u32|uint4)\*\)\((.+?)\);", body, re.M)
    assert [name for name, _ in carving] == [name for name, _ in cuda_plan.MMA_FRAG_SHARED_REGIONS]
    stages, words = _FRAG_CARVING[kernel_name]
    assert carving[0][1] == "smem" and stages in kernel
    for (prev, _), (_, expr) in zip(carving, carving[1:]):
        assert expr == f"{prev} + {words[prev]}", expr
    for tiles in tile_counts:
        k = 16 * tiles
        expect = 3 * 4 * cuda_plan.MMA_CHUNK_PAGES * 8 + 3 * 16 * (cuda_plan.MMA_CHUNK_PAGES // 128) * k + 4 * k * 8
        assert cuda_plan.mma_shared_bytes(tiles, "fragments") == expect <= cuda_plan.MAX_SHARED_BYTES
