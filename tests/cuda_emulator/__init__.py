"""The CUDA scan kernels' own text, built by g++ against a CPU shim and run block by block, so
their logic is tested where there is no GPU (CI): see cuda_emu.h for what is emulated."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from gpu_engine.backends import cuda_plan
from gpu_engine.backends.cuda_module import kernel_source
from morpho_pir.dpf import KEY_FORMAT_V1
from gpu_engine.matrix import PAGE_BYTES

HERE = Path(__file__).resolve().parent
WORDS = PAGE_BYTES // 4
# The compiler of the emulated kernels: $CXX, else g++ (C++20 for std::barrier).
CXX = os.environ.get("CXX", "g++")


# g++'s options: C++20 (std::barrier); no strict aliasing, as the kernels read uint4 as u32 words
CXX_FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread", "-w")


@functools.lru_cache(maxsize=None)
def compiler() -> Optional[str]:
    """The path of a C++ compiler that builds the emulator's kind of code (C++20's <barrier>), or None."""
    path = shutil.which(CXX)
    if path is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text("#include <barrier>\nstd::barrier<> b(1);\n")
        built = subprocess.run([path, *CXX_FLAGS, str(probe), "-o", str(Path(tmp) / "probe.so")], capture_output=True)
    return path if built.returncode == 0 else None


def _definition(source: str, head: str) -> str:
    """The whole definition that starts with `head` in `source`, to its closing brace."""
    begin = source.index(head)
    depth, i = 0, source.index("{", begin)
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[begin : i + 1]
        i += 1


# Definitions the shim (cuda_emu.h) replaces, each the one of the kernel text that starts as it
# does, to its first parenthesis: inline PTX cannot build for a
# CPU. mma.sync's product comes from the runtime; cp.async copies land when issued or at the
# wait_group that lets them (COPIES_LAND: the earliest and the latest a copy may); an L2 prefetch
# (plain or evict_last) loads nothing, but is counted and its address checked; bar.sync's and bar.arrive's named barriers are
# the runtime's.
EMULATED = (
    """__device__ __forceinline__ void mma_and_popc(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    emu_mma_and_popc(d, a0, a1, a2, a3, b0, b1);
}""",
    """__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)((const unsigned char*)p - emu_dynamic_smem);
}""",
    """__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    emu_cp_async16(dst, src);
}""",
    """__device__ __forceinline__ void cp_async_commit() {
    emu_cp_async_commit();
}""",
    """__device__ __forceinline__ void prefetch_l2(const void* p) {
    emu_prefetch_l2(p);
}""",
    """__device__ __forceinline__ void prefetch_l2_last(const void* p) {
    emu_prefetch_l2(p);
}""",
    """__device__ __forceinline__ void named_barrier(int id, int threads) {
    emu_named_barrier(id, threads);
}""",
    """__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    emu_named_barrier_arrive(id, threads);
}""",
    """__device__ __forceinline__ void cp_async_wait() {
    emu_cp_async_wait(N);
}""",
    # thread-block clusters: the runtime's (cluster addresses (rank + 1) << 24 | offset, mbarriers by address)
    """__device__ __forceinline__ void cluster_sync() {
    emu_cluster_sync();
}""",
    """__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    emu_mbarrier_init(bar, count);
}""",
    """__device__ __forceinline__ void fence_mbarrier_init() {}""",
    """__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    emu_mbarrier_wait(bar, parity);
}""",
    """__device__ __forceinline__ void mbarrier_wait_cluster(u32 bar, u32 parity) {
    emu_mbarrier_wait(bar, parity);
}""",
    """__device__ __forceinline__ u32 cluster_rank() {
    return emu_cluster_rank();
}""",
    """__device__ __forceinline__ u32 cluster_address(u32 local, u32 rank) {
    return (rank + 1) << 24 | local;
}""",
    """__device__ __forceinline__ void mbarrier_arrive_cluster(u32 bar) {
    emu_mbarrier_arrive(bar);
}""",
    """__device__ __forceinline__ uint4 ld_cluster_v4(u32 at) {
    return emu_ld_cluster_v4(at);
}""",
)
# Static __shared__ words of a kernel whose blocks run at once (a cluster's), as the runtime's
# emu_block_word: static arrays are process-wide here
BLOCK_WORDS = {
    "dpf_scan.cu": {  # dpf_scan_v1_pair's mbarriers
        "__shared__ __align__(8) unsigned long long ready_bar, freed_bar;":
            "unsigned long long &ready_bar = emu_block_word(0), &freed_bar = emu_block_word(1);",
    },
}
SOURCES = ("runtime.cpp", "scan_entries.cpp", "mma_entries.cpp")


def emulated_text(name: str) -> str:
    """Kernel file `name` as NVRTC gets it, rewritten for the shim: EMULATED's definitions,
    __noinline__ as GCC spells it, BLOCK_WORDS, and dynamic shared memory as the block's buffer."""
    text = kernel_source(name)
    for body in EMULATED:
        head = body[: body.index("(") + 1]
        if head in text:
            text = text.replace(_definition(text, head), body)
    # __noinline__ as a macro would break the standard headers that spell the attribute so
    text = text.replace("__noinline__", "__attribute__((noinline))")
    for declaration, words in BLOCK_WORDS.get(name, {}).items():
        # a declaration no longer matched would leave a process-wide static shared by a cluster's blocks
        assert declaration in text, f"{name} no longer declares {declaration!r}"
        text = text.replace(declaration, words)
    return text.replace("extern __shared__ uint4 smem[];", "uint4* smem = (uint4*)emu_dynamic_smem;")


@functools.lru_cache(maxsize=None)
def library(variant: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The emulated kernels as a shared library, built once per text (cached on disk); `variant`:
    more -D options (NAME=VALUE), a kernel variant the GPU benchmarks time."""
    kernels = {"EMU_SCAN_KERNELS": emulated_text("dpf_scan.cu"), "EMU_MMA_KERNELS": emulated_text("dpf_scan_mma.cu")}
    defines = list(cuda_plan.define_options(variant))
    ours = [(HERE / name).read_text() for name in ("cuda_emu.h", *SOURCES)]
    tag = hashlib.sha256("\0".join([*kernels.values(), *ours, *defines, CXX, *CXX_FLAGS]).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"morpho-cuda-emulator-{os.getuid()}"
    cache.mkdir(exist_ok=True)
    lib = cache / f"kernels-{tag}.so"
    if not lib.exists():
        for macro, text in kernels.items():  # each builder its own files: builds may run at once
            inc = cache / f"{macro}-{tag}.{os.getpid()}.inc"
            inc.write_text(text)
            defines.append(f'-D{macro}="{inc}"')
        partial = lib.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run([CXX, *CXX_FLAGS, f"-I{HERE}", *defines, *(str(HERE / name) for name in SOURCES),
                                "-o", str(partial)], capture_output=True, text=True)
        for flag in defines[-len(kernels):]:
            Path(flag.split('"')[1]).unlink()
        if built.returncode:
            raise RuntimeError(f"the emulated kernels did not build:\n{built.stderr[-4000:]}")
        partial.replace(lib)
    built = ctypes.CDLL(str(lib))
    for name in ("emu_dpf_scan", "emu_dpf_scan_bits", "emu_dpf_scan_mma"):
        getattr(built, name).restype = ctypes.c_bool
    for name in ("emu_faults", "emu_barrier_faults", "emu_prefetches", "emu_stray_prefetches", "emu_mma_calls",
                 "emu_misaligned_loads", "emu_last_unused_prefetched_lines", "emu_last_loaded_unprefetched_lines"):
        getattr(built, name).restype = ctypes.c_ulonglong
    built.emu_barrier_fault.restype = ctypes.c_char_p
    return built


# When the emulated cp.async copies land (cuda_emu.h): when issued, or at the wait that lets them
COPIES_LAND = {"at issue": 0, "at the wait": 1}


@contextlib.contextmanager
def _within_shared_memory(lib: Optional[ctypes.CDLL] = None):
    """Fails if a block of the launches made inside (by `lib`, library() by default) wrote past its
    dynamic shared memory, misused a named barrier (on a GPU, a hang or undefined: the runtime
    says which), or loaded 16 bytes from an address not a multiple of 16 (a GPU faults)."""
    lib = lib or library()
    before, broken, misaligned = lib.emu_faults(), lib.emu_barrier_faults(), lib.emu_misaligned_loads()
    yield
    assert lib.emu_barrier_faults() == broken, f"emulated kernel bug: {lib.emu_barrier_fault().decode()}"
    assert lib.emu_misaligned_loads() == misaligned, \
        f"{lib.emu_misaligned_loads() - misaligned} 16-byte loads from addresses not a multiple of 16"
    after = lib.emu_faults()
    assert after == before, \
        f"{after - before} blocks wrote past their dynamic shared memory (or read a peer's past it)"


@contextlib.contextmanager
def _prefetching_within(lib: ctypes.CDLL, matrix: np.ndarray):
    """Fails if a launch made inside (by `lib`) prefetched an address outside `matrix`, the one
    buffer the scans read pages from, or a line of it that no load of the launch read."""
    lib.emu_prefetch_range(_arg(matrix), ctypes.c_size_t(matrix.nbytes))
    before = lib.emu_stray_prefetches()
    try:
        yield
    finally:
        lib.emu_prefetch_range(None, ctypes.c_size_t(0))  # counts the lines (emu_last_*_lines)
    assert lib.emu_stray_prefetches() == before, \
        f"{lib.emu_stray_prefetches() - before} prefetches named addresses outside the matrix"
    unused = lib.emu_last_unused_prefetched_lines()
    assert unused == 0, f"{unused} lines of the matrix were prefetched and never loaded"


def _arg(value):
    if isinstance(value, np.ndarray):
        assert value.flags.c_contiguous
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, np.int32):
        return ctypes.c_int(int(value))
    if isinstance(value, np.int64):
        return ctypes.c_longlong(int(value))
    raise TypeError(f"no C type for {type(value)}")


def to_fragments(pages: np.ndarray) -> np.ndarray:
    """The fragments layout of (P, 1024) u32 pages, by the emulated pages_to_fragments: whole
    chunks of MMA_CHUNK_PAGES, the last padded with zero pages."""
    chunks = -(-pages.shape[0] // cuda_plan.MMA_CHUNK_PAGES)
    padded = np.zeros((chunks * cuda_plan.MMA_CHUNK_PAGES, WORDS), dtype=np.uint32)
    padded[: pages.shape[0]] = pages
    frags = np.full(padded.size, 0xDEADBEEF, dtype=np.uint32)  # every word must be written
    with _within_shared_memory():
        library().emu_pages_to_fragments(ctypes.c_uint(chunks * cuda_plan.MMA_SLICES), _arg(padded),
                                         ctypes.c_longlong(pages.shape[0]), _arg(frags))
    return frags


def chunk_pages(frags: np.ndarray, chunk: int) -> np.ndarray:
    """Chunk `chunk` of a fragments-layout matrix back as (MMA_CHUNK_PAGES, 1024) u32 pages, by the
    emulated fragments_to_pages, as read_page and row writes read it."""
    pages = np.full((cuda_plan.MMA_CHUNK_PAGES, WORDS), 0xDEADBEEF, dtype=np.uint32)
    start = chunk * cuda_plan.MMA_SLICES * cuda_plan.MMA_FRAGMENT_WORDS
    with _within_shared_memory():
        library().emu_fragments_to_pages(ctypes.c_uint(cuda_plan.MMA_SLICES), _arg(frags[start:]), _arg(pages))
    return pages


def _answers(plan, batch, scan, variant: tuple[str, ...] = (), copies_land: str = "at issue") -> np.ndarray:
    """(K, 1024) u32 answers of KeyBatch `batch` under `plan` as CudaBackend launches them: the key
    records padded with the last key, the top stages by dpf_expand_top (for plan.top_keys keys),
    then scan(lib, keyrec, nodes, out) with library(variant), its cp.async copies landing
    `copies_land` (COPIES_LAND); only the batch's own rows come back."""
    lib = library(variant)
    k, kp = batch.root_seed.shape[0], plan.padded_keys
    records = cuda_plan.pack_key_records(batch.root_seed, batch.root_t, batch.cw_seed, batch.cw_t,
                                         batch.final_cw)
    keyrec = np.ascontiguousarray(np.concatenate([records, np.repeat(records[-1:], kp - k, axis=0)]))
    # stale, as cupy.empty leaves them: the padding keys' rows, which the top may leave unwritten
    nodes = [(np.full((kp, st.live_out, 4), 0xA5A5A5A5, dtype=np.uint32), np.full((kp, st.live_out), 0xA5, dtype=np.uint8))
             for st in plan.stages]
    out = np.zeros((kp, WORDS), dtype=np.uint32)
    lib.emu_cp_async_landing(ctypes.c_int(COPIES_LAND[copies_land]))
    try:
        with _within_shared_memory(lib):
            for i, st in enumerate(plan.stages):
                lib.emu_dpf_expand_top(ctypes.c_uint(st.live_in), ctypes.c_uint(plan.top_keys),
                                       *map(_arg, cuda_plan.top_args(plan, i, keyrec, nodes)))
            scan(lib, keyrec, nodes, out)
    finally:
        lib.emu_cp_async_landing(ctypes.c_int(COPIES_LAND["at issue"]))
    return out[:k]


def alu_plan(num_pages: int, batch, resident_blocks: int = 132 * 2):
    """The plan alu_answers launches (fewer resident_blocks give each block more chunks)."""
    return cuda_plan.plan_scan(num_pages, batch.domain_bits, batch.root_seed.shape[0],
                               key_format=batch.key_format, resident_blocks=resident_blocks)


def alu_answers(pages: np.ndarray, batch, resident_blocks: int = 132 * 2) -> np.ndarray:
    """Answers of a KeyBatch over (P, 1024) u32 pages on the ALU: dpf_scan<G> (v1 keys) or
    dpf_scan_bits<G> (v2), G from the plan (one of scan_entries.cpp's EMU_GROUPS)."""
    plan = alu_plan(pages.shape[0], batch, resident_blocks)

    def scan(lib, keyrec, nodes, out):
        args = [_arg(a) for a in cuda_plan.scan_args(plan, pages, keyrec, nodes, out)]
        g, grid = ctypes.c_int(plan.group_keys), ctypes.c_uint(plan.grid)
        if plan.key_format == KEY_FORMAT_V1:
            done = lib.emu_dpf_scan(g, grid, ctypes.c_size_t(plan.shared_bytes), *args)
        else:
            done = lib.emu_dpf_scan_bits(g, grid, *args)
        assert done, f"the emulator builds no ALU scan of {plan.group_keys} keys a group"

    return _answers(plan, batch, scan)


def tensor_core_plan(num_pages: int, batch, layout: str = "pages", resident_blocks: int = 132 * 2,
                     v1_pairs: bool = False):
    """The plan tensor_core_answers launches (v1_pairs: as CudaBackend.v1_pairs)."""
    return cuda_plan.plan_scan(num_pages, batch.domain_bits, batch.root_seed.shape[0], key_format=batch.key_format,
                               tensor_cores=batch.key_format != KEY_FORMAT_V1, layout=layout,
                               resident_blocks=resident_blocks, v1_pairs=v1_pairs)


def tensor_core_answers(num_pages: int, matrix: np.ndarray, batch, layout: str = "pages",
                        resident_blocks: int = 132 * 2, variant: tuple[str, ...] = (),
                        copies_land: str = "at issue", v1_pairs: bool = False) -> np.ndarray:
    """Answers of a KeyBatch on the (emulated) tensor cores over `matrix`: (P, 1024) u32 pages, or
    to_fragments of num_pages pages for layout "fragments". v1 keys: dpf_scan_v1_frag (fragments
    only; v1_pairs: dpf_scan_v1_pair where the plan has an even number of key groups, as
    CudaBackend.v1_pairs); v2 keys: dpf_leaf_bits, then dpf_scan_mma<T> or dpf_scan_mma_frag<T>
    (mma.sync; T one of mma_entries.cpp's EMU_TILES). Fewer resident_blocks give each block more
    chunks; `variant`: the kernels' -D options of a variant (library); copies_land: when cp.async
    copies land (COPIES_LAND)."""
    plan = tensor_core_plan(num_pages, batch, layout, resident_blocks, v1_pairs)
    grid, shared = ctypes.c_uint(plan.grid), ctypes.c_size_t(plan.shared_bytes)

    def scan(lib, keyrec, nodes, out):
        if plan.key_format == KEY_FORMAT_V1:
            launch = lib.emu_dpf_scan_v1_pair if plan.v1_pairs else lib.emu_dpf_scan_v1_frag
            with _prefetching_within(lib, matrix):
                launch(grid, shared, *map(_arg, cuda_plan.scan_args(plan, matrix, keyrec, nodes, out)))
            return
        sel = np.zeros((plan.padded_keys, plan.padded_leaves, 4), dtype=np.uint32)
        lib.emu_dpf_leaf_bits(ctypes.c_uint(cuda_plan.leaf_bits_grid(plan)),
                              *map(_arg, cuda_plan.leaf_bits_args(plan, keyrec, nodes, sel)))
        done = lib.emu_dpf_scan_mma(ctypes.c_int(plan.group_keys // 16), ctypes.c_int(layout == "fragments"), grid,
                                    shared, *map(_arg, cuda_plan.mma_scan_args(plan, matrix, sel, out)))
        assert done, f"the emulator builds no tensor-core scan of {plan.group_keys // 16} key tiles"

    return _answers(plan, batch, scan, variant, copies_land)
