"""Plans, arguments and argument checks of the CUDA kernels' launches: pure code, testable
without a GPU.

The constants dpf_scan.cu shares with the host are written here only: `kernel_defines()` hands
them to the compiler as -D options (cuda_module.NVRTC_OPTIONS), and the kernel text uses the names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from morpho_pir.dpf import KEY_FORMAT_V1, KEY_FORMAT_V2, format_name, tree_depth
from morpho_pir.protocol import KEYS_PER_QUERY, LEAF_PAGE_BITS, LEAF_PAGES, PAGE_BYTES, ROW_BYTES

SCAN_THREADS = PAGE_BYTES // 16  # 256: one thread per 16-byte column of a page
TOP_THREADS = 256
# levels one dpf_expand_top block expands: its shared buffers hold 2**9 nodes, which fill a
# 256-thread block's last level exactly twice
MAX_TOP_LEVELS = 9
# Key records, one per key, krec_words(d) u32 words each (a multiple of 4):
#   [0,4) root seed   [4,8) final_cw   [8] root_t   [12 + 4l, 16 + 4l) seed_cw of level l
#   [12 + 4d + l] t corrections of level l: bit 0 left, bit 1 right
KREC_ROOT = 0
KREC_FINAL = 4
KREC_ROOT_T = 8
KREC_CW = 12  # the header (root seed 4, final_cw 4, root_t 1, padding 3) ends here
SCAN_GROUP_SIZES = tuple(range(1, 17)) + (24, 32)  # dpf_scan<G> instantiations in the .cu
DEFAULT_MAX_GROUP_KEYS = 16  # 64 accumulator registers a thread: two blocks fit an SM
DEFAULT_CHUNK_LEVELS = 8  # 256 pages per expanded chunk: 106 KiB of shared memory at G = 16, 2 blocks an SM
WAVES_PER_LAUNCH = 8  # blocks per launch over blocks resident at once: bounds the tail wave
MAX_SHARED_BYTES = 227 * 1024  # opt-in limit of one block on sm_90
PAGE_WORDS = PAGE_BYTES // 4  # 1024 u32 words a page
# The v2 scan on the tensor cores (dpf_scan_mma.cu): a block of MMA_THREADS threads owns a slice
# of MMA_SLICE_WORDS words of every page (the 8 columns of an m16n8k256 product) and stages
# MMA_CHUNK_PAGES pages of it at a time; T key tiles of 16 keys a block, T in MMA_TILE_COUNTS.
MMA_THREADS = 256  # 8 warps, each 4 of the 32 n-blocks (bits) of the slice's words
MMA_SLICE_WORDS = 8  # words of a page a block owns: 32 bytes
MMA_SLICES = PAGE_WORDS // MMA_SLICE_WORDS  # 128 blocks cover a page's width
MMA_CHUNK_PAGES = 1024  # pages a block stages at once (4 mma k-steps of 256; 32 KiB of its slice)
MMA_CHUNK_LEAVES = MMA_CHUNK_PAGES // LEAF_PAGES  # 8 v2 leaves a chunk
MMA_TILE_COUNTS = tuple(range(1, 12))  # dpf_scan_mma<T> instantiations: up to 176 keys a group
WGMMA_CAPABILITY = (9, 0)  # wgmma ... b1 AND.POPC: sm_90a, the H100 and H200
# from this many key tiles a launch over the fragments layout goes to dpf_scan_wgmma_frag; fewer
# (up to 48 keys, where the scan waits on memory) stay on dpf_scan_mma_frag, which the H100 ran
# nearer the memory floor (21.97 against 24.8 ms for one query at mainnet: docs/SCANS.md)
WGMMA_MIN_TILES = 4
# dpf_scan_wgmma_frag<T>'s (Hopper's warpgroup products, sm_90a, over the fragments layout): up to
# 224 keys a group, 2 x 8T accumulators a thread (250 registers at T = 14, no spills)
WGMMA_TILE_COUNTS = tuple(range(WGMMA_MIN_TILES, 15))
# every tile count some tensor-core scan of the fragments layout runs (mma.sync below WGMMA_MIN_TILES)
ANY_TILE_COUNTS = tuple(sorted(set(MMA_TILE_COUNTS + WGMMA_TILE_COUNTS)))
# the most queries one launch may hold: as many as one key group of any tensor-core scan multiplies
# in one pass over the matrix (224 keys, the wgmma scan's). The static bound a policy's max_batch
# is validated against, in Django and the engine alike; requests stay at
# protocol.MAX_BATCH_QUERIES, and the engine merges them up to max_batch or its backend's
# pass_queries (below), whichever is less
MAX_LAUNCH_QUERIES = 16 * max(ANY_TILE_COUNTS) // KEYS_PER_QUERY  # 74
MAX_LAUNCH_KEYS = MAX_LAUNCH_QUERIES * KEYS_PER_QUERY  # 222
# dpf_leaf_bits writes the wgmma scan's leaf-major bits in tiles of this many keys x leaves, one
# thread each (MMA_THREADS), turned round in shared memory so its reads and writes are whole runs
LEAF_BITS_TILE = 16
MMA_MIN_CAPABILITY = (8, 0)  # mma.sync ... b1.b1.s32.and.popc needs sm_80 or later
# v1 keys over the fragments layout (dpf_scan_v1_frag<16> in dpf_scan.cu): dpf_scan<16>'s plan
# and tree chunks of 2**V1_FRAG_CHUNK_LEVELS pages (one mma k-step), the masks multiplied on the
# tensor cores residue by residue; one key tile a block, one block an SM, of two teams of
# SCAN_THREADS: producers expand the next chunk while multipliers multiply this one
V1_FRAG_GROUP_KEYS = 16
V1_FRAG_CHUNK_LEVELS = 8
V1_FRAG_THREADS = 2 * SCAN_THREADS  # 512
# uint4s a residue's row of A fragments takes: its 32 lanes, then 4 of padding (with 16 bytes more
# after each 32 residues, so the ALU path's reads of 16 residues at once take 8 bank slots)
V1_FRAG_AFRAG_ROW = 36
V1_FRAG_AFRAG_BYTES = (128 * V1_FRAG_AFRAG_ROW + 4) * 16  # bytes: the A fragments of a chunk (128 residues)
# the producers expand the first V1_FRAG_TOP_LEVELS levels of V1_FRAG_TOP_CHUNKS chunks' trees
# together (alone, each of those levels was one ChaCha8 chain with most threads idle), keeping the
# nodes of level V1_FRAG_TOP_LEVELS (seed and t) for the chunks: V1_FRAG_TOPS_BYTES, which keeps
# a block under 195 KiB (the SM's shared memory carve-out of 196 KiB, with 60 KiB of L1 left).
# Measured at mainnet on the H100 against each chunk alone: Q = 8 28.0 ms against 29.1, Q = 32
# 89.0 against 94.2; 4 chunks x 4 levels and 16 x 2 within the drift (docs/SCANS.md)
V1_FRAG_TOP_CHUNKS = 8
V1_FRAG_TOP_LEVELS = 3
# nodes a key the batch keeps: the kernel asserts its -D options give the same, so a variant of
# V1_FRAG_TOP_CHUNKS or V1_FRAG_TOP_LEVELS alone cannot outgrow the shared memory sized here
V1_FRAG_TOP_NODES = V1_FRAG_TOP_CHUNKS << V1_FRAG_TOP_LEVELS
V1_FRAG_TOPS_BYTES = V1_FRAG_TOP_NODES * V1_FRAG_GROUP_KEYS * 17  # bytes
# launches of at most this many v1 keys (one or two queries) over the fragments layout multiply on
# the ALU inside the same kernel (memory binds them; a product carries 16 key rows whatever the
# batch): at mainnet on the H100 one query takes 22.1 ms there, 26.2 on the tensor cores
# (docs/SCANS.md)
V1_FRAG_ALU_KEYS = 2 * KEYS_PER_QUERY  # 6
V1_FRAG_WAVES = 2  # its blocks a launch over the SMs (WAVES_PER_LAUNCH's part): longer runs, fewer unoverlapped first chunks
# chunks a block runs through, by its key tiles: short runs keep the 128 slices of a chunk in L2
# together (few tiles, where the scan waits on memory), long ones save atomics and prologues
# (many tiles); measured at mainnet on the H100 (docs/SCANS.md)
MMA_SHORT_RUN_TILES = 3  # up to this many tiles a block: short runs
MMA_SHORT_RUN_CHUNKS = 8
MMA_LONG_RUN_CHUNKS = 128
# keys from which v2 batches go to the tensor cores when the scan is "auto": below it the ALU
# scan, which reads whole pages, wins. Measured on the H100 and the H200 at 65,536, 2^20 and
# mainnet pages (docs/SCANS.md): the ALU scan ahead at 12 keys (4 queries) at all
# three, the tensor cores at 18 keys (6 queries) at 65,536 and 2^20 pages and at 24 at mainnet
# (18 not timed there), so one threshold serves every size
MMA_MIN_KEYS = 18
V2_SCANS = ("auto", "mma", "alu")  # how v2 keys are scanned: by batch size, tensor cores, ALU
# How a resident matrix is stored: "pages" row-major, (num_pages, PAGE_WORDS) u32, which every
# scan reads; "fragments" as the tensor-core scan's B fragments, whole chunks of MMA_CHUNK_PAGES
# pages, chunk c's slice s at (c * MMA_SLICES + s) * MMA_FRAGMENT_WORDS (dpf_scan_mma.cu,
# fragment_offset), which only dpf_scan_mma_frag reads: v2 keys, on the tensor cores.
MATRIX_LAYOUTS = ("pages", "fragments")
MMA_FRAGMENT_WORDS = MMA_CHUNK_PAGES * MMA_SLICE_WORDS  # one (chunk, slice) of the layout: 32 KiB
# chunks' buffers of the fragments scans: dpf_scan_mma_frag copies chunk i + 2 while chunk i is
# multiplied; dpf_scan_wgmma_frag splits them into parts of a chunk (WGMMA_SPLIT, in the kernel)
MMA_FRAG_STAGES = 3


# from this many key tiles a block (one block an SM) the tensor-core scan pipelines its chunks:
# chunk i + 1 transposed while chunk i is multiplied; fewer tiles run two blocks an SM, which
# the pipeline's buffers would not let fit (measured on the H100: docs/SCANS.md)
MMA_PIPELINE_TILES = MMA_SHORT_RUN_TILES + 1


def mma_buffers(tiles: int) -> Tuple[int, int]:
    """(selection-bit buffers, fragment buffers) of dpf_scan_mma<tiles>: (3, 2) pipelined, (2, 1) not."""
    return (3, 2) if tiles >= MMA_PIPELINE_TILES else (2, 1)


# dpf_scan_mma<T>'s dynamic shared memory, region by region in the order the kernel carves it:
# (region, bytes given T)
MMA_SHARED_REGIONS = (
    # two chunks' slices, u32, 8 words a page and 8 more after every 32 pages
    ("raw", lambda T: 2 * 4 * (MMA_CHUNK_PAGES + MMA_CHUNK_PAGES // 32) * MMA_SLICE_WORDS),
    # the selection bits of 2 or 3 chunks (copied, multiplied, between), uint4 [leaf][key]
    ("selsm", lambda T: mma_buffers(T)[0] * 16 * MMA_CHUNK_LEAVES * 16 * T),
    # the B fragments of 1 or 2 chunks (transposed, multiplied), u32 [k-step][half][n-block][lane]
    ("bfrag", lambda T: mma_buffers(T)[1] * 4 * (MMA_CHUNK_PAGES // 256) * 2 * 32 * 32),
    # the slice's answer words, u32 [key][word]
    ("outsm", lambda T: 4 * 16 * T * MMA_SLICE_WORDS),
)
# dpf_scan_mma_frag<T>'s, likewise
MMA_FRAG_SHARED_REGIONS = (
    ("bfrag", lambda T: MMA_FRAG_STAGES * 4 * MMA_FRAGMENT_WORDS),  # u32 [stage][fragment words]
    ("selsm", lambda T: MMA_FRAG_STAGES * 16 * MMA_CHUNK_LEAVES * 16 * T),  # uint4 [stage][leaf][key]
    ("outsm", lambda T: 4 * 16 * T * MMA_SLICE_WORDS),  # u32 [key][word]
)
# dpf_scan<G>'s dynamic shared memory for chunks of L = 2**c leaves, region by region in the
# order the kernel carves it: (region, bytes an entry, entries a key given L and c)
SCAN_SHARED_REGIONS = (
    ("big", 16, lambda L, c: L),  # uint4: the leaves (masks), and every other level
    ("half", 16, lambda L, c: L // 2),  # uint4: the levels in between
    ("cw_seed", 16, lambda L, c: c),  # uint4: [level][key]
    ("final_cw", 16, lambda L, c: 1),  # uint4
    ("big_t", 1, lambda L, c: L),  # u8: t bits of big
    ("half_t", 1, lambda L, c: L // 2),  # u8: t bits of half
    ("cw_t", 1, lambda L, c: c),  # u8: [level][key]
)


def use_tensor_cores(v2_scan: str, key_format: int, num_keys: int, layout: str = "pages") -> bool:
    """Whether a launch (a batch, or a micro-batch of one) of num_keys keys of key_format runs
    on a v2 tensor-core scan (plan_scan's tensor_cores): over the fragments layout always for v2
    keys (v1 keys there run dpf_scan_v1_frag, on the tensor cores too, planned as v1); over the
    pages layout by v2_scan and the batch size."""
    if v2_scan not in V2_SCANS:
        raise ValueError(f"v2_scan must be one of {V2_SCANS}, got {v2_scan!r}")
    check_layout(layout)
    if key_format != KEY_FORMAT_V2:
        return False
    return layout == "fragments" or v2_scan == "mma" or (v2_scan == "auto" and num_keys >= MMA_MIN_KEYS)


def kernel_defines() -> Dict[str, int]:
    """The macros dpf_scan.cu reads from the host, by name (passed as -DNAME=value)."""
    return {
        "SCAN_THREADS": SCAN_THREADS,
        "TOP_THREADS": TOP_THREADS,
        "MAX_TOP_LEVELS": MAX_TOP_LEVELS,
        "KREC_ROOT": KREC_ROOT,
        "KREC_FINAL": KREC_FINAL,
        "KREC_ROOT_T": KREC_ROOT_T,
        "KREC_CW": KREC_CW,
        "LEAF_PAGES": LEAF_PAGES,  # v2 keys: pages one leaf selects among (dpf_scan_bits)
        "PAGE_WORDS": PAGE_WORDS,
        "MMA_THREADS": MMA_THREADS,
        "MMA_SLICE_WORDS": MMA_SLICE_WORDS,
        "MMA_CHUNK_PAGES": MMA_CHUNK_PAGES,
        "MMA_PIPELINE_TILES": MMA_PIPELINE_TILES,
        "MMA_FRAG_STAGES": MMA_FRAG_STAGES,
        "LEAF_BITS_TILE": LEAF_BITS_TILE,
        "V1_FRAG_GROUP_KEYS": V1_FRAG_GROUP_KEYS,
        "V1_FRAG_CHUNK_LEVELS": V1_FRAG_CHUNK_LEVELS,
        "V1_FRAG_THREADS": V1_FRAG_THREADS,
        "V1_FRAG_AFRAG_ROW": V1_FRAG_AFRAG_ROW,
        "V1_FRAG_TOP_CHUNKS": V1_FRAG_TOP_CHUNKS,
        "V1_FRAG_TOP_LEVELS": V1_FRAG_TOP_LEVELS,
        "V1_FRAG_TOP_NODES": V1_FRAG_TOP_NODES,
        "V1_FRAG_ALU_KEYS": V1_FRAG_ALU_KEYS,
    }


def define_options(overrides: Iterable[str] = ()) -> Tuple[str, ...]:
    """kernel_defines() as -DNAME=value options, each NAME=VALUE of `overrides` (a kernel variant
    to time) replacing its name's value or added after them."""
    values = {name: str(value) for name, value in kernel_defines().items()}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"a kernel define is NAME=VALUE, got {item!r}")
        values[name] = value
    return tuple(f"-D{name}={value}" for name, value in values.items())


def live_nodes(num_leaves: int, height: int) -> int:
    """Nodes of a tree level holding at least one of the first num_leaves leaves, each node
    spanning 2**height leaves (everything past num_leaves is pruned)."""
    return -(-num_leaves // (1 << height))


def krec_words(domain_bits: int) -> int:
    """u32 words of one key record: header, d seed corrections, d t-correction words, to x4."""
    words = KREC_CW + 5 * domain_bits
    return (words + 3) & ~3


def pack_key_records(root_seed: np.ndarray, root_t: np.ndarray, cw_seed: np.ndarray,
                     cw_t: np.ndarray, final_cw: np.ndarray) -> np.ndarray:
    """The (K, krec_words(n)) u32 records dpf_scan.cu reads, from KeyBatch arrays (n levels:
    the tree's depth, domain_bits for v1 keys)."""
    k, d = cw_seed.shape[0], cw_seed.shape[1]
    rec = np.zeros((k, krec_words(d)), dtype=np.uint32)
    rec[:, KREC_ROOT : KREC_ROOT + 4] = root_seed
    rec[:, KREC_FINAL : KREC_FINAL + 4] = final_cw
    rec[:, KREC_ROOT_T] = root_t
    base = KREC_CW
    rec[:, base : base + 4 * d] = cw_seed.reshape(k, 4 * d)
    rec[:, base + 4 * d : base + 5 * d] = cw_t[:, :, 0].astype(np.uint32) | (cw_t[:, :, 1].astype(np.uint32) << 1)
    return rec


def check_array(name: str, arr, dtype, shape: Tuple[int, ...]) -> None:
    """ValueError unless `arr` (NumPy or CuPy) has this dtype, shape and C-contiguous layout."""
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_bits(name: str, arr) -> None:
    if arr.size and int(np.asarray(arr).max()) > 1:
        raise ValueError(f"{name} must hold only 0 and 1, got {int(np.asarray(arr).max())}")


def check_key_batch(batch, domain_bits: int) -> None:
    """Reject a KeyBatch whose arrays the kernels would misread, before anything launches."""
    k = len(batch)
    if k < 1:
        raise ValueError("empty key batch")
    if batch.domain_bits != domain_bits:
        raise ValueError(f"keys have domain_bits {batch.domain_bits}, matrix has {domain_bits}")
    d = batch.tree_depth
    check_array("root_seed", batch.root_seed, np.uint32, (k, 4))
    check_array("root_t", batch.root_t, np.uint8, (k,))
    check_array("cw_seed", batch.cw_seed, np.uint32, (k, d, 4))
    check_array("cw_t", batch.cw_t, np.uint8, (k, d, 2))
    check_array("final_cw", batch.final_cw, np.uint32, (k, 4))
    check_bits("root_t", batch.root_t)
    check_bits("cw_t", batch.cw_t)


def pick_group_keys(num_keys: int, max_group_keys: int) -> Tuple[int, int]:
    """(keys per block G, key groups): as few groups as max_group_keys allows, each as even as
    the compiled group sizes let it be. The kernel has no per-key guards, so the last group is
    padded with repeats of a real key: fewer than `groups` padding keys up to G = 16."""
    if max_group_keys not in SCAN_GROUP_SIZES:
        raise ValueError(f"max_group_keys must be one of {SCAN_GROUP_SIZES}, got {max_group_keys}")
    if num_keys < 1:
        raise ValueError(f"num_keys must be >= 1, got {num_keys}")
    groups = -(-num_keys // max_group_keys)
    need = -(-num_keys // groups)
    group_keys = min(g for g in SCAN_GROUP_SIZES if g >= need)
    return group_keys, -(-num_keys // group_keys)


def scan_shared_bytes(group_keys: int, chunk_levels: int) -> int:
    """Dynamic shared memory of dpf_scan<G>: the regions of SCAN_SHARED_REGIONS, G keys each."""
    leaves = 1 << chunk_levels
    return group_keys * sum(size * count(leaves, chunk_levels)
                            for _, size, count in SCAN_SHARED_REGIONS)


def v1_frag_shared_bytes() -> int:
    """Dynamic shared memory of dpf_scan_v1_frag<16> and dpf_scan_v1_pair<16>: dpf_scan<16>'s
    regions for chunks of 2**V1_FRAG_CHUNK_LEVELS leaves, then its A fragments and the first
    levels' nodes of a batch of chunks."""
    return V1_FRAG_AFRAG_BYTES + V1_FRAG_TOPS_BYTES + scan_shared_bytes(V1_FRAG_GROUP_KEYS, V1_FRAG_CHUNK_LEVELS)


def check_layout(layout: str) -> None:
    if layout not in MATRIX_LAYOUTS:
        raise ValueError(f"layout must be one of {MATRIX_LAYOUTS}, got {layout!r}")


def mma_shared_bytes(tiles: int, layout: str = "pages") -> int:
    """Dynamic shared memory of dpf_scan_mma<tiles> (the regions of MMA_SHARED_REGIONS) or, over
    the fragments layout, of dpf_scan_mma_frag<tiles> (MMA_FRAG_SHARED_REGIONS)."""
    check_layout(layout)
    regions = MMA_SHARED_REGIONS if layout == "pages" else MMA_FRAG_SHARED_REGIONS
    return sum(size(tiles) for _, size in regions)


def mma_max_tiles(shared_limit: int, layout: str = "pages", wgmma: bool = False) -> int:
    """The most key tiles a block of the tensor-core scan (with wgmma, of dpf_scan_wgmma_frag) may
    have on a GPU whose blocks may opt in to shared_limit bytes of shared memory (227 KiB on
    sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89): 0 where not even one tile fits."""
    counts = ANY_TILE_COUNTS if wgmma else MMA_TILE_COUNTS
    return max((t for t in counts if mma_shared_bytes(t, layout) <= shared_limit), default=0)


def pass_queries(max_tiles: int) -> int:
    """The most queries one launch serves in one pass over the matrix when its tensor-core scan
    holds up to max_tiles key tiles a block (mma_max_tiles): one key group of 16 * max_tiles keys,
    whole queries of KEYS_PER_QUERY keys; more keys make a second key group, which reads the matrix
    again. 58 at 11 tiles (mma.sync: the pages layout on sm_90), 74 at 14 (wgmma: the fragments
    layout on sm_90), 26 at 5 (the pages layout on sm_80). max_tiles 0, no tensor-core scan:
    MAX_LAUNCH_QUERIES, since the ALU scan's key groups read each run of pages from memory once,
    together (plan_scan), as the CPU backend's one pass serves any batch."""
    if max_tiles == 0:
        return MAX_LAUNCH_QUERIES
    if max_tiles not in ANY_TILE_COUNTS:
        raise ValueError(f"max_tiles must be 0 or one of {ANY_TILE_COUNTS}, got {max_tiles}")
    return 16 * max_tiles // KEYS_PER_QUERY


def mma_chunks(num_pages: int) -> int:
    """Chunks of MMA_CHUNK_PAGES pages that cover num_pages pages: what the tensor-core scans run
    through, and what the fragments layout stores (the last chunk padded with zero pages)."""
    return -(-num_pages // MMA_CHUNK_PAGES)


def pick_mma_tiles(num_keys: int, max_tiles: int = max(MMA_TILE_COUNTS)) -> Tuple[int, int]:
    """(key tiles of 16 a block, key groups) of the tensor-core scan: as few groups as the
    compiled tile counts (up to max_tiles, what the GPU's shared memory holds) allow, each as
    even as 16-key tiles let it be (padding repeats a key)."""
    if num_keys < 1:
        raise ValueError(f"num_keys must be >= 1, got {num_keys}")
    if max_tiles not in ANY_TILE_COUNTS:
        raise ValueError(f"max_tiles must be one of {ANY_TILE_COUNTS}, got {max_tiles}")
    most = 16 * max_tiles
    groups = -(-num_keys // most)
    tiles = -(-(-(-num_keys // groups)) // 16)
    return tiles, -(-num_keys // (16 * tiles))


def top_stages(depth_top: int) -> List[Tuple[int, int]]:
    """(depth_in, levels) of the dpf_expand_top launches that reach depth_top, at most
    MAX_TOP_LEVELS levels each; the short stage goes first, where there are fewest nodes."""
    if depth_top <= 0:
        return []
    count = -(-depth_top // MAX_TOP_LEVELS)
    first = depth_top - MAX_TOP_LEVELS * (count - 1)
    stages = [(0, first)]
    for i in range(1, count):
        stages.append((first + MAX_TOP_LEVELS * (i - 1), MAX_TOP_LEVELS))
    return stages


@dataclass(frozen=True)
class TopStage:
    depth_in: int
    levels: int
    live_in: int  # blocks per key: the live nodes of depth_in
    live_out: int  # nodes written per key: the live nodes of depth_in + levels


@dataclass(frozen=True)
class ScanPlan:
    """Every size of one batch's launches (top stages, then one dpf_scan<G> launch; for v2 keys
    the top stages reach the leaves and dpf_scan_bits<G> scans, one chunk per leaf)."""

    num_pages: int
    domain_bits: int
    num_keys: int
    group_keys: int
    num_groups: int
    chunk_levels: int
    num_chunks: int
    chunks_per_block: int
    grid: int
    shared_bytes: int
    stages: Tuple[TopStage, ...]
    key_format: int = KEY_FORMAT_V1
    tensor_cores: bool = False  # v2 keys: dpf_scan_mma (chunks of MMA_CHUNK_PAGES pages)
    layout: str = "pages"  # of the matrix it scans (MATRIX_LAYOUTS): fragments, a *_frag scan
    wgmma: bool = False  # fragments only: dpf_scan_wgmma_frag (sm_90a) instead of dpf_scan_mma_frag
    v1_pairs: bool = False  # v1 keys over the fragments layout: dpf_scan_v1_pair (sm_90 clusters of two groups)

    @property
    def padded_keys(self) -> int:
        """Keys the kernels run: whole groups of group_keys."""
        return self.group_keys * self.num_groups

    @property
    def top_keys(self) -> int:
        """Keys the top stages expand: the batch's own where the scan expands no padding
        (dpf_scan_v1_frag: one query's top is 3 trees, not 16), else padded_keys."""
        if self.key_format == KEY_FORMAT_V1 and self.layout == "fragments":
            return self.num_keys
        return self.padded_keys

    @property
    def tree_depth(self) -> int:
        """Levels of the keys' tree: domain_bits (v1), max(domain_bits - 7, 0) (v2)."""
        return tree_depth(self.domain_bits, self.key_format)

    @property
    def tree_leaves(self) -> int:
        """Leaves of the tree that hold a page: num_pages (v1), ceil(num_pages / 128) (v2)."""
        if self.key_format == KEY_FORMAT_V1:
            return self.num_pages
        return live_nodes(self.num_pages, LEAF_PAGE_BITS)

    @property
    def scan_template(self) -> str:
        """The scan's template: dpf_scan (v1), dpf_scan_bits (v2), dpf_scan_v1_frag (v1 over the
        fragments layout) of G keys in dpf_scan.cu; dpf_scan_mma (v2 on the tensor cores) or its
        fragments-layout scans of G / 16 key tiles in dpf_scan_mma.cu."""
        if self.tensor_cores:
            if self.layout == "pages":
                return "dpf_scan_mma"
            return "dpf_scan_wgmma_frag" if self.wgmma else "dpf_scan_mma_frag"
        if self.layout == "fragments":
            return "dpf_scan_v1_pair" if self.v1_pairs else "dpf_scan_v1_frag"
        return "dpf_scan" if self.key_format == KEY_FORMAT_V1 else "dpf_scan_bits"

    @property
    def scan_kernel(self) -> Tuple[str, str]:
        """(kernel file, name expression) of the scan."""
        if self.tensor_cores:
            return "dpf_scan_mma.cu", f"{self.scan_template}<{self.group_keys // 16}>"
        return "dpf_scan.cu", f"{self.scan_template}<{self.group_keys}>"

    @property
    def scan_threads(self) -> int:
        """Threads a block of the scan: MMA_THREADS (tensor-core scans of v2 keys), V1_FRAG_THREADS
        (dpf_scan_v1_frag's two teams), SCAN_THREADS (a thread per 16-byte column of a page)."""
        if self.tensor_cores:
            return MMA_THREADS
        return V1_FRAG_THREADS if self.scan_template in ("dpf_scan_v1_frag", "dpf_scan_v1_pair") else SCAN_THREADS

    @property
    def padded_leaves(self) -> int:
        """Leaves of the selection-bit array the tensor-core scan reads: whole chunks."""
        return self.num_chunks * MMA_CHUNK_LEAVES if self.tensor_cores else self.tree_leaves

    @property
    def depth_top(self) -> int:
        return self.tree_depth - self.chunk_levels

    @property
    def root_stride(self) -> int:
        """Nodes per key in the root arrays dpf_scan reads (1 when the chunk is the whole tree)."""
        return self.stages[-1].live_out if self.stages else 1


def plan_scan(num_pages: int, domain_bits: int, num_keys: int,
              max_group_keys: int = DEFAULT_MAX_GROUP_KEYS,
              chunk_levels: int = DEFAULT_CHUNK_LEVELS,
              resident_blocks: int = 132 * 2, key_format: int = KEY_FORMAT_V1,
              tensor_cores: bool = False, mma_chunks_per_block: Optional[int] = None,
              mma_max_tiles: int = max(MMA_TILE_COUNTS), layout: str = "pages",
              wgmma: bool = False, v1_pairs: bool = False) -> ScanPlan:
    """Plan one launch of num_keys keys over num_pages pages of a domain of 2**domain_bits pages.

    v1 keys: top stages to depth d - c, then dpf_scan<G> expands chunks of 2**c leaves. v2 keys:
    top stages to the leaves (depth max(d - 7, 0); none when that is 0), then dpf_scan_bits<G>
    scans 128 pages a leaf (chunk_levels does not apply: the plan's is 0, a chunk is one leaf).
    Blocks of one chunk run and consecutive key groups are adjacent (block = run * groups +
    group), so a run's pages are read from memory once and from L2 by the other groups.
    tensor_cores (v2 keys only): dpf_leaf_bits then dpf_scan_mma, whose blocks are (run of
    chunks of MMA_CHUNK_PAGES pages, slice of a page, key group), one or two blocks an SM. A
    matrix in the fragments layout is scanned by dpf_scan_mma_frag alone (wgmma: by
    dpf_scan_wgmma_frag from WGMMA_MIN_TILES tiles a block up to max(WGMMA_TILE_COUNTS), whose
    blocks run slice-fastest: clusters of slices share a chunk's selection bits, and a second key
    group, past 224 keys, reads the run again a wave later): v2 keys, tensor_cores. v1 keys over
    the fragments layout: dpf_scan_v1_frag<16>, dpf_scan's plan with groups of 16 keys and chunks
    of 2**V1_FRAG_CHUNK_LEVELS pages (chunk_levels and max_group_keys do not apply); with
    v1_pairs (sm_90: thread-block clusters) an even number of its groups goes to dpf_scan_v1_pair.
    """
    check_layout(layout)
    if layout == "fragments" and tensor_cores != (key_format == KEY_FORMAT_V2):
        raise ValueError("a matrix in the fragments layout is scanned on the tensor cores: v2 keys by "
                         "their tensor-core scan (tensor_cores), v1 keys by dpf_scan_v1_frag (not tensor_cores)")
    if wgmma and layout != "fragments":
        raise ValueError("the wgmma scan reads the fragments layout only")
    if not wgmma and mma_max_tiles > max(MMA_TILE_COUNTS):
        raise ValueError(f"mma_max_tiles above {max(MMA_TILE_COUNTS)} needs the wgmma scan")
    if tensor_cores:
        if key_format != KEY_FORMAT_V2:
            raise ValueError("the tensor-core scan takes v2 keys only")
        return _plan_mma(num_pages, domain_bits, num_keys, resident_blocks, mma_chunks_per_block,
                         mma_max_tiles, layout, wgmma)
    if not 1 <= num_pages <= (1 << domain_bits):
        raise ValueError(f"num_pages {num_pages} is outside [1, 2**{domain_bits}]")
    if chunk_levels < 1:
        raise ValueError(f"chunk_levels must be >= 1, got {chunk_levels}")
    if key_format == KEY_FORMAT_V1 and layout == "fragments":
        # one key tile a block, chunks of one k-step (shared memory sized for it whatever c); one
        # block an SM, whose first chunk is expanded before any product: long runs overlap more.
        # At most V1_FRAG_WAVES whole waves (rounded down: a few blocks past them would each be a
        # whole run in a wave of their own)
        group_keys, groups = V1_FRAG_GROUP_KEYS, -(-num_keys // V1_FRAG_GROUP_KEYS)
        chunk_levels = V1_FRAG_CHUNK_LEVELS
        target_runs = max(1, max(1, resident_blocks // 2) * V1_FRAG_WAVES // groups)
    else:
        group_keys, groups = pick_group_keys(num_keys, max_group_keys)
        target_runs = max(1, -(-resident_blocks * WAVES_PER_LAUNCH // groups))
    if key_format == KEY_FORMAT_V1:
        depth, leaves = domain_bits, num_pages
        c = min(chunk_levels, domain_bits)
        shared = v1_frag_shared_bytes() if layout == "fragments" else scan_shared_bytes(group_keys, c)
    else:
        depth, leaves = tree_depth(domain_bits, key_format), live_nodes(num_pages, LEAF_PAGE_BITS)
        c, shared = 0, 0  # dpf_scan_bits holds G leaves in static shared memory
    if shared > MAX_SHARED_BYTES:
        raise ValueError(
            f"{group_keys} keys x 2**{c}-page chunks need {shared} bytes of shared memory, "
            f"over the {MAX_SHARED_BYTES}-byte limit"
        )
    chunks = live_nodes(leaves, c)
    runs = min(chunks, target_runs)
    per_block = -(-chunks // runs)
    runs = -(-chunks // per_block)
    stages = tuple(
        TopStage(a, b, live_nodes(leaves, depth - a), live_nodes(leaves, depth - a - b))
        for a, b in top_stages(depth - c)
    )
    # v1 keys over the fragments layout in an even number of groups, where the GPU runs clusters
    # (v1_pairs): groups in pairs, a chunk read from L2 once a pair (dpf_scan_v1_pair)
    pairs = v1_pairs and key_format == KEY_FORMAT_V1 and layout == "fragments" and groups % 2 == 0
    return ScanPlan(num_pages, domain_bits, num_keys, group_keys, groups, c, chunks, per_block,
                    runs * groups, shared, stages, key_format, layout=layout, v1_pairs=pairs)


def _plan_mma(num_pages: int, domain_bits: int, num_keys: int, resident_blocks: int,
              chunks_per_block: Optional[int], max_tiles: int, layout: str, wgmma: bool) -> ScanPlan:
    if not 1 <= num_pages <= (1 << domain_bits):
        raise ValueError(f"num_pages {num_pages} is outside [1, 2**{domain_bits}]")
    tiles, groups = pick_mma_tiles(num_keys, max_tiles)
    wgmma = wgmma and tiles >= WGMMA_MIN_TILES
    depth, leaves = tree_depth(domain_bits, KEY_FORMAT_V2), live_nodes(num_pages, LEAF_PAGE_BITS)
    chunks = mma_chunks(num_pages)
    # one block an SM counted (resident_blocks counts two; up to 3 tiles two fit): waves of them
    target_runs = max(1, -(-(resident_blocks // 2) * WAVES_PER_LAUNCH // (MMA_SLICES * groups)))
    runs = min(chunks, target_runs)
    run_chunks = MMA_SHORT_RUN_CHUNKS if tiles <= MMA_SHORT_RUN_TILES else MMA_LONG_RUN_CHUNKS
    per_block = chunks_per_block or min(run_chunks, -(-chunks // runs))
    runs = -(-chunks // per_block)
    stages = tuple(
        TopStage(a, b, live_nodes(leaves, depth - a), live_nodes(leaves, depth - a - b))
        for a, b in top_stages(depth)
    )
    return ScanPlan(num_pages, domain_bits, num_keys, 16 * tiles, groups, 0, chunks, per_block,
                    runs * MMA_SLICES * groups, mma_shared_bytes(tiles, layout), stages, KEY_FORMAT_V2,
                    tensor_cores=True, layout=layout, wgmma=wgmma)


def top_args(plan: ScanPlan, stage: int, keyrec, nodes) -> Tuple[Any, ...]:
    """dpf_expand_top's arguments, in its order, for plan.stages[stage]; nodes[i] is the (seed,
    t) pair of arrays stage i writes, and stage i + 1 reads (stage 0 reads the key records)."""
    st = plan.stages[stage]
    in_seed, in_t = nodes[stage - 1] if stage else nodes[stage]  # stage 0 reads the roots
    in_stride = plan.stages[stage - 1].live_out if stage else 0
    out_seed, out_t = nodes[stage]
    return (keyrec, np.int32(krec_words(plan.tree_depth)), np.int32(plan.tree_depth),
            np.int64(plan.tree_leaves), in_seed, in_t, np.int64(in_stride), np.int32(st.depth_in),
            np.int32(st.levels), out_seed, out_t, np.int64(st.live_out))


def scan_args(plan: ScanPlan, pages, keyrec, nodes, out) -> Tuple[Any, ...]:
    """The scan's arguments, in its order: dpf_scan<G>'s 13 (v1), dpf_scan_bits<G>'s 12, the same
    less chunk_levels (v2). The chunk roots (v2: the leaves) are the last top stage's nodes (none
    when the chunk is the whole tree: the kernel then reads the key records' roots). num_keys is
    the batch's own count: the scans run padded_keys, and dpf_scan_v1_frag expands no padding."""
    roots_seed, roots_t = nodes[-1] if nodes else (keyrec, keyrec)
    head = (pages, np.int64(plan.num_pages), np.int32(plan.tree_depth))
    if plan.key_format == KEY_FORMAT_V1:
        head += (np.int32(plan.chunk_levels),)
    return head + (keyrec, np.int32(krec_words(plan.tree_depth)),
                   np.int32(plan.num_keys), roots_seed, roots_t, np.int64(plan.root_stride),
                   np.int32(plan.num_groups), np.int32(plan.chunks_per_block), out)


def leaf_bits_args(plan: ScanPlan, keyrec, nodes, sel) -> Tuple[Any, ...]:
    """dpf_leaf_bits's arguments, in its order: the leaves are the last top stage's nodes (the
    key records' roots when the tree has no levels); the bits key-major, or leaf-major by key
    group for the wgmma scan."""
    leaf_seed, leaf_t = nodes[-1] if nodes else (keyrec, keyrec)
    return (keyrec, np.int32(krec_words(plan.tree_depth)), np.int32(plan.padded_keys),
            np.int32(plan.tree_depth), np.int64(plan.num_pages), leaf_seed, leaf_t,
            np.int64(plan.root_stride), np.int64(plan.padded_leaves),
            np.int32(plan.group_keys if plan.wgmma else 0), sel)


def leaf_bits_grid(plan: ScanPlan) -> int:
    """Blocks of dpf_leaf_bits: a thread per (key, leaf) of the padded selection array; for the
    wgmma scan a block per tile of LEAF_BITS_TILE keys x LEAF_BITS_TILE leaves."""
    if plan.wgmma:  # whole tiles of keys: the key groups are 16T keys
        if plan.padded_keys % LEAF_BITS_TILE:
            raise ValueError(f"leaf-major bits need whole tiles of {LEAF_BITS_TILE} keys, got {plan.padded_keys}")
        return plan.padded_keys // LEAF_BITS_TILE * -(-plan.padded_leaves // LEAF_BITS_TILE)
    return -(-plan.padded_keys * plan.padded_leaves // MMA_THREADS)


def mma_scan_args(plan: ScanPlan, pages, sel, out) -> Tuple[Any, ...]:
    """dpf_scan_mma<T>'s (or dpf_scan_mma_frag<T>'s) arguments, in its order."""
    return (pages, np.int64(plan.num_pages), sel, np.int64(plan.padded_leaves),
            np.int32(plan.num_groups), np.int32(plan.chunks_per_block), out)


def split_micro_batches(num_keys: int, micro_batch: int) -> List[Tuple[int, int]]:
    """[start, stop) key ranges of the launches; micro_batch 0 = one launch for all keys."""
    if micro_batch < 0:
        raise ValueError(f"micro_batch must be >= 0, got {micro_batch}")
    step = num_keys if micro_batch == 0 else micro_batch
    return [(s, min(num_keys, s + step)) for s in range(0, num_keys, step)]


def workspace_bytes(plan: ScanPlan) -> int:
    """Device bytes one launch needs besides the matrix: key records, tree nodes, answers."""
    nodes = sum(st.live_out for st in plan.stages) * plan.padded_keys * 17
    sel = plan.padded_keys * plan.padded_leaves * 16 if plan.tensor_cores else 0
    return plan.padded_keys * (4 * krec_words(plan.tree_depth) + PAGE_BYTES) + nodes + sel


def check_rows(rows, num_rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """(indices (n,) int64, words (n, 64) u32) of a {row: 256 bytes} mapping, all checked first."""
    idx = np.empty(len(rows), dtype=np.int64)
    data = np.empty((len(rows), ROW_BYTES // 4), dtype=np.uint32)
    for i, (row, raw) in enumerate(rows.items()):
        if not 0 <= int(row) < num_rows:
            raise ValueError(f"row {row} is outside [0, {num_rows})")
        if len(raw) != ROW_BYTES:
            raise ValueError(f"row {row} data is {len(raw)} bytes, expected {ROW_BYTES}")
        idx[i] = int(row)
        data[i] = np.frombuffer(bytes(raw), dtype="<u4")
    return idx, data


def describe_plan(plan: ScanPlan) -> str:
    # alu-frag / mma-frag for v1 keys over the fragments layout by the host's V1_FRAG_ALU_KEYS (a
    # benchmark's --define of another value is not seen here)
    stages = ", ".join(f"{s.depth_in}+{s.levels}" for s in plan.stages) or "none"
    scan = {"dpf_scan_mma": "mma ", "dpf_scan_mma_frag": "mma-frag ", "dpf_scan_wgmma_frag": "wgmma-frag ",
            "dpf_scan_v1_frag": "alu-frag " if plan.num_keys <= V1_FRAG_ALU_KEYS else "mma-frag ",
            "dpf_scan_v1_pair": "mma-pair "}.get(plan.scan_template, "")
    return (f"{format_name(plan.key_format)} {scan}keys={plan.num_keys} "
            f"G={plan.group_keys}x{plan.num_groups} c={plan.chunk_levels} "
            f"chunks={plan.num_chunks} per_block={plan.chunks_per_block} grid={plan.grid} "
            f"smem={plan.shared_bytes} top=[{stages}]")


def sizes_text(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"


__all__ = [
    "ScanPlan", "TopStage", "plan_scan", "pick_group_keys", "top_stages", "scan_shared_bytes",
    "kernel_defines", "define_options", "top_args", "scan_args", "pick_mma_tiles", "mma_shared_bytes",
    "check_layout", "mma_chunks", "mma_max_tiles", "pass_queries",
    "leaf_bits_args", "leaf_bits_grid", "mma_scan_args", "use_tensor_cores",
    "split_micro_batches", "pack_key_records", "krec_words", "check_array", "check_key_batch",
    "check_rows", "live_nodes", "workspace_bytes", "describe_plan", "sizes_text",
]
