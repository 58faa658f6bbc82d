// The v2-key scan on the tensor cores (docs/PROTOCOL.md section 3.1; docs/SCANS.md).
//
// Compiled by NVRTC at run time and by nvcc in CI from this same text: no headers.
//
// Answer bit j of a v2 key is the parity of sum_i sel(i) AND page_i[j] over pages i: a binary
// matrix product (keys x pages) . (pages x bit positions) over GF(2). mma.sync m16n8k256 with
// b1 operands and AND + POPC multiplies a 16 x 256 bit tile of selection bits (16 keys, 256
// pages) by a 256 x 8 tile of page bits into 16 x 8 popcounts; the s32 accumulators add up
// every page of a block's run (fewer than 2^31, far from overflow) and the answer bit is the
// low bit of the sum.
//
// The matrix stays page-major, so the block transposes it on the way: a block owns a slice of
// MMA_SLICE_WORDS (8) words of every page and a run of chunks of MMA_CHUNK_PAGES (1024) pages.
// Per chunk, cp.async copies the chunk's slice (32 KiB) and its selection bits into shared memory
// (from 4 key tiles a block, two chunks ahead, and the transposition runs one chunk ahead of the
// products; below, one chunk ahead); each thread transposes one 32 x 32 bit block (32 pages x one
// word) in registers, which gives bit b of that word across 32 pages: a B-fragment register of
// n-block b, column w (bit b of word w of the slice). Warp W owns n-blocks 4W .. 4W + 3 for every
// key tile, so its accumulators stay in registers for the whole run; they meet in global memory by
// XOR atomics once per block.

typedef unsigned int u32;

// Set by the host as -D options (gpu_engine/backends/cuda_plan.py, kernel_defines): MMA_THREADS,
// MMA_SLICE_WORDS, MMA_CHUNK_PAGES, MMA_PIPELINE_TILES, MMA_FRAG_STAGES, PAGE_WORDS, LEAF_PAGES. The selection bits
// come from dpf_leaf_bits in dpf_scan.cu, beside the ALU scan of v2 keys, which reads leaves the
// same way.

#define MMA_K 256                                       // pages of one mma (k of m16n8k256)
#define KSTEPS (MMA_CHUNK_PAGES / MMA_K)                // mma k-steps of a chunk
#define CHUNK_LEAVES (MMA_CHUNK_PAGES / LEAF_PAGES)     // v2 leaves of a chunk
#define RAW_WORDS (MMA_CHUNK_PAGES * MMA_SLICE_WORDS + (MMA_CHUNK_PAGES / 32) * MMA_SLICE_WORDS)
#define BFRAG_WORDS (KSTEPS * 2 * 32 * 32)              // one chunk's B fragments

static_assert(MMA_SLICE_WORDS == 8, "a slice word is one column of the mma's n = 8");
static_assert(MMA_THREADS == (MMA_CHUNK_PAGES / 32) * MMA_SLICE_WORDS,
              "a thread transposes 32 pages x 1 word");
static_assert(MMA_THREADS / 32 * 4 == 32, "8 warps of 4 n-blocks cover the 32 bits of a word");
static_assert(LEAF_PAGES == 128, "a leaf is half a k-step");

// A block reads 32 bytes of each page; the blocks of the other slices read the rest of it. An L2
// prefetch of 64-256 bytes around each copy, for the neighbours to find, measured no faster at 64
// and slower at 128 and 256 (docs/SCANS.md, Measured and not kept).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 ::"r"(shared_address(dst)), "l"(src) : "memory");
}

// "memory": the compiler keeps shared-memory reads and writes on their side of these (a barrier
// follows every wait as well, which is what makes other threads' copies visible)
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Word offset of page p's slice in a chunk's staging buffer: 8 words a page, and 8 more after
// every 32 pages, so the 4 page groups a warp transposes fall in different banks.
__device__ __forceinline__ int raw_index(int p) { return (p + (p >> 5)) * MMA_SLICE_WORDS; }

// One chunk's staged slice -> its B fragments: thread (pg, w) transposes pages 32pg .. 32pg + 31
// of word w.
__device__ __forceinline__ void stage_fragments(const u32* raw, u32* bfrag) {
    const int pg = threadIdx.x / MMA_SLICE_WORDS, w = threadIdx.x % MMA_SLICE_WORDS;
    u32 x[32];
    const u32* src = raw + raw_index(32 * pg) + w;
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] = src[i * MMA_SLICE_WORDS];
    transpose32(x);
    u32* dst = bfrag + fragment_offset(pg, w);
#pragma unroll
    for (int b = 0; b < 32; ++b) dst[b * 32] = x[b];
}

// The chunk's products for this warp's 4 n-blocks and each of the T key tiles (K = 16T keys).
// A fragment of key tile m, lane (g, t): rows g and g + 8 (keys 16m + g, 16m + g + 8), k =
// 32t .. 32t + 31 (word t of the k-step's first leaf) and 128 + 32t .. (word t of its second).
template <int T>
__device__ __forceinline__ void mma_chunk(const u32* selw, const u32* bfrag, int (&acc)[T][4][4]) {
    constexpr int K = 16 * T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        u32 b0[4], b1[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            b0[j] = bfrag[((ks * 2) * 32 + warp * 4 + j) * 32 + lane];
            b1[j] = bfrag[((ks * 2 + 1) * 32 + warp * 4 + j) * 32 + lane];
        }
        const u32* lo = selw + (2 * ks) * K * 4 + g * 4 + t;  // [leaf][key][word]
        const u32* hi = lo + K * 4;
#pragma unroll
        for (int m = 0; m < T; ++m) {
            const u32 a0 = lo[m * 64], a1 = lo[m * 64 + 32], a2 = hi[m * 64], a3 = hi[m * 64 + 32];
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_and_popc(acc[m][j], a0, a1, a2, a3, b0[j], b1[j]);
        }
    }
}

// Copies (cp.async) the selection bits of chunk `chunk` of keys key0 .. key0 + K - 1 into sdst,
// [leaf][key]: the A fragments' source.
template <int K>
__device__ __forceinline__ void copy_selection(uint4* sdst, const uint4* sel, int key0, long long padded_leaves,
                                               long long chunk) {
    for (int j = threadIdx.x; j < K * CHUNK_LEAVES; j += MMA_THREADS) {
        const int key = j / CHUNK_LEAVES, leaf = j % CHUNK_LEAVES;
        cp_async16(sdst + leaf * K + key, sel + (key0 + key) * padded_leaves + chunk * CHUNK_LEAVES + leaf);
    }
}

// The block's answer words in outsm ([key][word], every thread's bits in) to out, by XOR atomics.
template <int K>
__device__ __forceinline__ void flush_outsm(const u32* outsm, u32* out, int key0, int slice) {
    for (int i = threadIdx.x; i < K * MMA_SLICE_WORDS; i += MMA_THREADS) {
        const u32 v = outsm[i];
        const long long word = (long long)(key0 + i / MMA_SLICE_WORDS) * PAGE_WORDS + slice * MMA_SLICE_WORDS;
        if (v) atomicXor(&out[word + i % MMA_SLICE_WORDS], v);
    }
}

// The block's answer bits, once per block: accumulator (m, j, r) of lane (g, t) is key 16m + g
// (+8 for r >= 2), word 2t + (r & 1) of the slice, bit 4 * warp + j. The warps' bits meet in
// outsm (zeroed by the block at its start), then in out by XOR atomics.
template <int T>
__device__ __forceinline__ void flush_slice(const int (&acc)[T][4][4], u32* outsm, u32* out, int key0, int slice) {
    constexpr int K = 16 * T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < T; ++m) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            u32 bits = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) bits |= ((u32)acc[m][j][r] & 1u) << (4 * warp + j);
            if (bits) atomicOr(&outsm[(16 * m + g + (r >> 1) * 8) * MMA_SLICE_WORDS + 2 * t + (r & 1)], bits);
        }
    }
    __syncthreads();
    flush_outsm<K>(outsm, out, key0, slice);
}

// What block blockIdx.x of a tensor-core scan works on: grid = (run of chunks, slice, key group),
// the key group fastest (slice_fastest false: the mma.sync scans) or the slice fastest (the wgmma
// scan, whose clusters are slices of one run and key group); chunks chunk_begin .. chunk_begin +
// n - 1 (n is 0 for a block past the last chunk) of slice `slice`, keys key0 .. key0 + K - 1 of
// key group `group`.
struct MmaBlock {
    int slice, group, n, key0;
    long long chunk_begin;
};

__device__ __forceinline__ MmaBlock mma_block(long long num_pages, int num_groups, int chunks_per_block, int K,
                                              bool slice_fastest = false) {
    const int slices = PAGE_WORDS / MMA_SLICE_WORDS;
    const long long run = blockIdx.x / slices / num_groups;
    const long long num_chunks = (num_pages + MMA_CHUNK_PAGES - 1) / MMA_CHUNK_PAGES;
    const long long chunk_begin = run * chunks_per_block;
    MmaBlock b;
    b.slice = slice_fastest ? (int)(blockIdx.x % slices) : (int)(blockIdx.x / num_groups % slices);
    b.group = slice_fastest ? (int)(blockIdx.x / slices % num_groups) : (int)(blockIdx.x % num_groups);
    b.n = (int)max(0LL, min(num_chunks, chunk_begin + chunks_per_block) - chunk_begin);
    b.key0 = b.group * K;
    b.chunk_begin = chunk_begin;
    return b;
}

// Block = (run of chunks, slice, key group), the key group fastest: the groups of one slice run
// together and read its pages once from memory. T key tiles of 16 keys (num_groups * 16 * T
// keys: the host pads the last group). out: (keys, PAGE_WORDS) u32, zeroed by the host.
template <int T>  // T key tiles of 16 keys: K keys a group
__global__ void __launch_bounds__(MMA_THREADS, 1)
dpf_scan_mma(const u32* __restrict__ pages, long long num_pages, const uint4* __restrict__ sel,
             long long padded_leaves, int num_groups, int chunks_per_block, u32* __restrict__ out) {
    constexpr int K = 16 * T;
    // Few tiles: two blocks an SM, each staging, transposing and multiplying in turn (the other
    // block fills the gaps). More tiles: one block an SM, pipelined (below), which needs a third
    // selection-bit buffer and a second set of fragments.
    constexpr bool pipelined = T >= MMA_PIPELINE_TILES;
    constexpr int sel_bufs = pipelined ? 3 : 2, frag_bufs = pipelined ? 2 : 1;
    extern __shared__ uint4 smem[];
    u32* raw = (u32*)(smem);                               // [2][RAW_WORDS]: staged page slices
    uint4* selsm = (uint4*)(raw + 2 * RAW_WORDS);          // [sel_bufs][CHUNK_LEAVES][K]
    u32* bfrag = (u32*)(selsm + sel_bufs * CHUNK_LEAVES * K);  // [frag_bufs][BFRAG_WORDS]
    u32* outsm = (u32*)(bfrag + frag_bufs * BFRAG_WORDS);  // [K][MMA_SLICE_WORDS]

    const MmaBlock blk = mma_block(num_pages, num_groups, chunks_per_block, K);
    const int slice = blk.slice, n = blk.n, key0 = blk.key0;
    const long long chunk_begin = blk.chunk_begin;

    for (int i = threadIdx.x; i < K * MMA_SLICE_WORDS; i += MMA_THREADS) outsm[i] = 0;

    // The buffers of chunk i of the run: its staged slice, its selection bits, its fragments.
    auto raw_of = [&](int i) { return raw + (i % 2) * RAW_WORDS; };
    auto sel_of = [&](int i) { return selsm + (i % sel_bufs) * CHUNK_LEAVES * K; };
    auto frag_of = [&](int i) { return bfrag + (i % frag_bufs) * BFRAG_WORDS; };

    // Pages past num_pages are never copied: their selection bits are 0 (dpf_leaf_bits), so
    // whatever the buffer holds there adds nothing.
    auto load_chunk = [&](int i) {
        const long long chunk = chunk_begin + i, page0 = chunk * MMA_CHUNK_PAGES;
        u32* dst = raw_of(i);
        for (int j = threadIdx.x; j < MMA_CHUNK_PAGES * 2; j += MMA_THREADS) {
            const int p = j >> 1, h = j & 1;
            if (page0 + p < num_pages)
                cp_async16(dst + raw_index(p) + 4 * h,
                           pages + (page0 + p) * PAGE_WORDS + slice * MMA_SLICE_WORDS + 4 * h);
        }
        copy_selection<K>(sel_of(i), sel, key0, padded_leaves, chunk);
        cp_async_commit();
    };

    int acc[T][4][4];
#pragma unroll
    for (int m = 0; m < T; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0;

    if constexpr (!pipelined) {
        if (n > 0) load_chunk(0);
        for (int i = 0; i < n; ++i) {
            if (i + 1 < n) {
                load_chunk(i + 1);  // its buffers were last read before the previous barrier
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            stage_fragments(raw_of(i), frag_of(i));
            __syncthreads();
            mma_chunk<T>((const u32*)sel_of(i), frag_of(i), acc);
            __syncthreads();  // the next chunk's fragments and loads overwrite what was read here
        }
    } else {
        // Three stages, one barrier a chunk: while chunk i + 2 is copied in, chunk i + 1 is
        // transposed (ALU pipe) and chunk i multiplied (tensor pipe). Warps 4..7 (one in each SM
        // sub-partition) multiply first and the others transpose first, so both pipes have work
        // (all transposing first measured 3-5% slower). Each buffer is rewritten only after the
        // barrier after its last reader.
        const bool multiply_first = (threadIdx.x >> 7) & 1;
        if (n > 0) load_chunk(0);
        if (n > 1) load_chunk(1);
        if (n > 1) cp_async_wait<1>(); else cp_async_wait<0>();
        __syncthreads();
        if (n > 0) stage_fragments(raw_of(0), frag_of(0));
        for (int i = 0; i < n; ++i) {
            cp_async_wait<0>();  // chunk i + 1's copies, the only ones in flight
            __syncthreads();
            if (i + 2 < n) load_chunk(i + 2);  // into chunk i's slice and chunk i - 1's selection bits
            if (multiply_first) mma_chunk<T>((const u32*)sel_of(i), frag_of(i), acc);
            if (i + 1 < n) stage_fragments(raw_of(i + 1), frag_of(i + 1));
            if (!multiply_first) mma_chunk<T>((const u32*)sel_of(i), frag_of(i), acc);
        }
    }

    flush_slice<T>(acc, outsm, out, key0, slice);
}

// The same product over a matrix resident in the "fragments" layout (cuda_plan.MATRIX_LAYOUTS):
// chunk c's slice s is BFRAG_WORDS words at (c * slices + s) * BFRAG_WORDS, already the B
// fragments stage_fragments would make, so a chunk is one contiguous 32 KiB copy and nothing is
// transposed. Three buffers, one barrier a chunk: chunk i + 2 is copied in while chunk i is
// multiplied. The layout holds whole chunks (the host zeroes pages past num_pages, whose selection
// bits are 0 anyway). Blocks, arguments and out as dpf_scan_mma.
template <int T>
__global__ void __launch_bounds__(MMA_THREADS, 1)
dpf_scan_mma_frag(const u32* __restrict__ frags, long long num_pages, const uint4* __restrict__ sel,
                  long long padded_leaves, int num_groups, int chunks_per_block, u32* __restrict__ out) {
    constexpr int K = 16 * T;
    constexpr int stages = MMA_FRAG_STAGES;
    extern __shared__ uint4 smem[];
    u32* bfrag = (u32*)(smem);                              // [stages][BFRAG_WORDS]
    uint4* selsm = (uint4*)(bfrag + stages * BFRAG_WORDS);  // [stages][CHUNK_LEAVES][K]
    u32* outsm = (u32*)(selsm + stages * CHUNK_LEAVES * K); // [K][MMA_SLICE_WORDS]

    const int slices = PAGE_WORDS / MMA_SLICE_WORDS;
    const MmaBlock blk = mma_block(num_pages, num_groups, chunks_per_block, K);
    const int slice = blk.slice, n = blk.n, key0 = blk.key0;
    const long long chunk_begin = blk.chunk_begin;

    for (int i = threadIdx.x; i < K * MMA_SLICE_WORDS; i += MMA_THREADS) outsm[i] = 0;

    auto frag_of = [&](int i) { return bfrag + (i % stages) * BFRAG_WORDS; };
    auto sel_of = [&](int i) { return selsm + (i % stages) * CHUNK_LEAVES * K; };
    auto load_chunk = [&](int i) {
        const long long chunk = chunk_begin + i;
        const u32* src = frags + (chunk * slices + slice) * (long long)BFRAG_WORDS;
        u32* dst = frag_of(i);
        for (int j = threadIdx.x; j < BFRAG_WORDS / 4; j += MMA_THREADS) cp_async16(dst + 4 * j, src + 4 * j);
        copy_selection<K>(sel_of(i), sel, key0, padded_leaves, chunk);
        cp_async_commit();
    };

    int acc[T][4][4];
#pragma unroll
    for (int m = 0; m < T; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0;

    if (n > 0) load_chunk(0);
    if (n > 1) load_chunk(1);
    for (int i = 0; i < n; ++i) {
        if (i + 1 < n) cp_async_wait<1>(); else cp_async_wait<0>();  // chunk i's copies are in
        __syncthreads();
        // into the buffers of chunk i - 1, whose products every thread finished before the barrier
        if (i + 2 < n) load_chunk(i + 2);
        mma_chunk<T>((const u32*)sel_of(i), frag_of(i), acc);
    }
    flush_slice<T>(acc, outsm, out, key0, slice);
}

// The fragments layout on Hopper's warpgroup products (sm_90a: wgmma .b1 AND + POPC, 1.55x the
// rate of mma.sync m16n8k256 on the H100, docs/SCANS.md). The fragments layout is already what a
// wgmma shared-memory descriptor reads without swizzle: in one (k-step, half) of a chunk's slice,
// row r = 8 b + w (bit b of slice word w) holds 128 pages in 16 contiguous bytes, 8 rows a 128-byte
// core matrix, the two halves 4 KiB apart; the staged selection bits ([leaf][key], 16 bytes a
// (leaf, key)) are the same for keys. So D (64 rows x K keys, s32) += A (64 rows x 256 pages of
// the fragments) . B (K keys x 256 pages of selection bits)^T, both read from shared memory by the
// tensor cores, nothing through registers. Warpgroup g (threads 128g ..) owns M-tiles 2g and
// 2g + 1 (rows 128g .. 128g + 127 of the slice); its 2 x 8T accumulators stay in registers for the
// run. Compiled for sm_90a only (cuda_module); elsewhere the kernel traps and is never launched.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_R8(o) "+r"(d[o]), "+r"(d[o + 1]), "+r"(d[o + 2]), "+r"(d[o + 3]), "+r"(d[o + 4]), "+r"(d[o + 5]), \
                 "+r"(d[o + 6]), "+r"(d[o + 7])
#define WG_S1 "%2, %3, %4, %5, %6, %7, %8, %9"
#define WG_S2 WG_S1 ", %10, %11, %12, %13, %14, %15, %16, %17"
#define WG_S3 WG_S2 ", %18, %19, %20, %21, %22, %23, %24, %25"
#define WG_S4 WG_S3 ", %26, %27, %28, %29, %30, %31, %32, %33"
#define WG_S5 WG_S4 ", %34, %35, %36, %37, %38, %39, %40, %41"
#define WG_S6 WG_S5 ", %42, %43, %44, %45, %46, %47, %48, %49"
#define WG_S7 WG_S6 ", %50, %51, %52, %53, %54, %55, %56, %57"
#define WG_S8 WG_S7 ", %58, %59, %60, %61, %62, %63, %64, %65"
#define WG_S9 WG_S8 ", %66, %67, %68, %69, %70, %71, %72, %73"
#define WG_S10 WG_S9 ", %74, %75, %76, %77, %78, %79, %80, %81"
#define WG_S11 WG_S10 ", %82, %83, %84, %85, %86, %87, %88, %89"
#define WG_S12 WG_S11 ", %90, %91, %92, %93, %94, %95, %96, %97"
#define WG_S13 WG_S12 ", %98, %99, %100, %101, %102, %103, %104, %105"
#define WG_S14 WG_S13 ", %106, %107, %108, %109, %110, %111, %112, %113"
#define WG_C1 WG_R8(0)
#define WG_C2 WG_C1, WG_R8(8)
#define WG_C3 WG_C2, WG_R8(16)
#define WG_C4 WG_C3, WG_R8(24)
#define WG_C5 WG_C4, WG_R8(32)
#define WG_C6 WG_C5, WG_R8(40)
#define WG_C7 WG_C6, WG_R8(48)
#define WG_C8 WG_C7, WG_R8(56)
#define WG_C9 WG_C8, WG_R8(64)
#define WG_C10 WG_C9, WG_R8(72)
#define WG_C11 WG_C10, WG_R8(80)
#define WG_C12 WG_C11, WG_R8(88)
#define WG_C13 WG_C12, WG_R8(96)
#define WG_C14 WG_C13, WG_R8(104)

typedef unsigned long long u64;

// sm_90 shared-memory matrix descriptor without swizzle: start address, leading (K) and stride
// (M or N, between 8-row core matrices) byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 wgmma_desc(u32 address, u32 k_offset, u32 row_offset) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)((k_offset >> 4) & 0x3FFF) << 16) |
           ((u64)((row_offset >> 4) & 0x3FFF) << 32);
}

// d (64 x 16T s32, 8T registers a thread) += A . B^T over 256 pages (the descriptors' tiles).
template <int T>
__device__ __forceinline__ void wgmma_and_popc(int (&d)[8 * T], u64 da, u64 db);
#define WGMMA_AND_POPC(T, N, S, C)                                                                       \
    template <>                                                                                      \
    __device__ __forceinline__ void wgmma_and_popc<T>(int (&d)[8 * T], u64 da, u64 db) {             \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k256.s32.b1.b1.and.popc {" S "}, "      \
                     "%0, %1, 1;"                                                                    \
                     : "+l"(da), "+l"(db), C);                                                       \
    }
WGMMA_AND_POPC(4, 64, WG_S4, WG_C4)
WGMMA_AND_POPC(5, 80, WG_S5, WG_C5)
WGMMA_AND_POPC(6, 96, WG_S6, WG_C6)
WGMMA_AND_POPC(7, 112, WG_S7, WG_C7)
WGMMA_AND_POPC(8, 128, WG_S8, WG_C8)
WGMMA_AND_POPC(9, 144, WG_S9, WG_C9)
WGMMA_AND_POPC(10, 160, WG_S10, WG_C10)
WGMMA_AND_POPC(11, 176, WG_S11, WG_C11)
WGMMA_AND_POPC(12, 192, WG_S12, WG_C12)
WGMMA_AND_POPC(13, 208, WG_S13, WG_C13)
WGMMA_AND_POPC(14, 224, WG_S14, WG_C14)
#endif

// Blocks of a thread-block cluster share one copy of a chunk's selection bits: each block copies
// 1/WGMMA_CLUSTER of them from L2 and the copy lands in every block of the cluster (TMA multicast),
// so L2 serves a chunk's bits once per cluster instead of once per slice (at 174 keys they were
// 41% of what a block copies and made L2 the busiest unit: docs/SCANS.md). 1 is no sharing; 2
// measured ahead of 1 and 4 on the H100 at 58 queries (docs/SCANS.md).
#define WGMMA_CLUSTER 2
// Parts a chunk is staged in: MMA_FRAG_STAGES chunks' buffers hold WGMMA_SPLIT times as many
// stages of KSTEPS / WGMMA_SPLIT k-steps each, each with its own barriers (the same shared memory,
// finer turns: a part's stage is refilled as soon as its products are done). Measured on the H100
// at mainnet, 74 queries: 29.0 ms with 2, 30.7 with 1 (whole chunks), 39.6 with 4 (docs/SCANS.md).
#define WGMMA_SPLIT 2
static_assert(KSTEPS % WGMMA_SPLIT == 0 && (CHUNK_LEAVES / WGMMA_SPLIT) % WGMMA_CLUSTER == 0,
              "a chunk's parts hold whole k-steps, their leaves split evenly across a cluster");
static_assert(CHUNK_LEAVES % WGMMA_CLUSTER == 0 && (PAGE_WORDS / MMA_SLICE_WORDS) % WGMMA_CLUSTER == 0 && 32 % WGMMA_CLUSTER == 0,
              "a cluster's blocks split a chunk's leaves and the slices evenly");
// On sm_90 the host compiles this file for sm_90a (cuda_module.arch_options) and launches the wgmma
// scan there: built for plain sm_90 the scan would trap, so that build stops here instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "dpf_scan_mma.cu on sm_90 needs -arch=sm_90a: the wgmma scan's instructions exist only there"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WGMMA_CLUSTER_DIMS __cluster_dims__(WGMMA_CLUSTER, 1, 1)
#else
#define WGMMA_CLUSTER_DIMS
#endif

// Block = (slice, key group, run of chunks), the slice fastest: a cluster is WGMMA_CLUSTER slices
// of one run and key group. Same arguments and dynamic shared memory as dpf_scan_mma_frag
// (MMA_FRAG_SHARED_REGIONS) but sel is leaf-major, sel[(group * padded_leaves + leaf) * K + k]
// (dpf_leaf_bits with group_keys = K), so the bits of a chunk's leaves are one contiguous copy.
// A stage holds a part of a chunk (WGMMA_SPLIT parts a chunk, MMA_FRAG_STAGES * WGMMA_SPLIT stages).
// Thread 0 copies with the bulk engine (TMA): the part's fragments (16 KiB of a chunk's 32) into
// this block, its share of the part's bits into every block of the cluster, both counted by the
// stage's `full` mbarrier. Per part i: wait for its stage, issue its 2 x KSTEPS / WGMMA_SPLIT
// products, wait for those of part i - 1, then the block tells every block of the cluster that it
// has read part i - 1's stage (their `empty` mbarriers), and thread 0, once every block of the
// cluster has, copies part i + stages - 1 into that stage. Part i's products run on the tensor
// cores meanwhile; no block waits for another except through the stages they share. From
// WGMMA_MIN_TILES tiles (cuda_plan): fewer wait on memory, and dpf_scan_mma_frag runs them nearer
// its floor.
template <int T>  // T key tiles of 16 keys: K keys a group (4 to 14: 224 accumulators a thread)
__global__ void WGMMA_CLUSTER_DIMS __launch_bounds__(MMA_THREADS, 1)
dpf_scan_wgmma_frag(const u32* __restrict__ frags, long long num_pages, const uint4* __restrict__ sel,
                    long long padded_leaves, int num_groups, int chunks_per_block, u32* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int K = 16 * T;
    // a stage is a part of a chunk: unit_ksteps k-steps of unit_leaves leaves
    constexpr int stages = MMA_FRAG_STAGES * WGMMA_SPLIT, unit_ksteps = KSTEPS / WGMMA_SPLIT;
    constexpr int unit_words = BFRAG_WORDS / WGMMA_SPLIT, unit_leaves = CHUNK_LEAVES / WGMMA_SPLIT;
    extern __shared__ uint4 smem[];
    u32* bfrag = (u32*)(smem);                              // [stages][unit_words]
    uint4* selsm = (uint4*)(bfrag + stages * unit_words);   // [stages][unit_leaves][K]
    u32* outsm = (u32*)(selsm + stages * unit_leaves * K);  // [K][MMA_SLICE_WORDS]
    __shared__ __align__(8) unsigned long long full[stages];   // a stage's copies have landed
    __shared__ __align__(8) unsigned long long empty[stages];  // the cluster's blocks have read it

    const int slices = PAGE_WORDS / MMA_SLICE_WORDS;
    const MmaBlock blk = mma_block(num_pages, num_groups, chunks_per_block, K, true);
    const int slice = blk.slice, group = blk.group, n = WGMMA_SPLIT * blk.n, key0 = blk.key0;
    const long long chunk_begin = blk.chunk_begin;
    const u32 rank = cluster_rank();

    for (int i = threadIdx.x; i < K * MMA_SLICE_WORDS; i += MMA_THREADS) outsm[i] = 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&full[s])) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
                         ::"r"(shared_address(&empty[s])), "r"(32) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_sync();  // every block's barriers exist before a copy of the cluster signals them

    auto frag_of = [&](int i) { return bfrag + (i % stages) * unit_words; };
    auto sel_of = [&](int i) { return selsm + (i % stages) * unit_leaves * K; };
    constexpr int part_leaves = unit_leaves / WGMMA_CLUSTER;
    constexpr u32 frag_bytes = unit_words * 4, part_bytes = part_leaves * K * 16;
    auto load_part = [&](int i) {  // thread 0: part i % WGMMA_SPLIT of chunk i / WGMMA_SPLIT
        const long long chunk = chunk_begin + i / WGMMA_SPLIT;
        const int part = i % WGMMA_SPLIT;
        const u32 bar = shared_address(&full[i % stages]);
        // this block's stage takes its fragments and every block's part of the bits
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(bar), "r"(frag_bytes + WGMMA_CLUSTER * part_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(shared_address(frag_of(i))), "l"(frags + (chunk * slices + slice) * (long long)BFRAG_WORDS + part * unit_words),
                     "r"(frag_bytes), "r"(bar) : "memory");
        const long long leaf0 = chunk * CHUNK_LEAVES + part * unit_leaves + rank * part_leaves;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                     " [%0], [%1], %2, [%3], %4;"
                     ::"r"(shared_address(sel_of(i) + rank * part_leaves * K)),
                     "l"(sel + (group * padded_leaves + leaf0) * K), "r"(part_bytes), "r"(bar),
                     "h"((unsigned short)((1u << WGMMA_CLUSTER) - 1)) : "memory");
    };

    const int wg = threadIdx.x >> 7;
    int acc[2][8 * T];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 8 * T; ++r) acc[m][r] = 0;
    // Pins the accumulators at this point of the program: nothing that reads them is moved in
    // between a product's issue and the wait for it (which would make ptxas serialize them).
    auto fence_acc = [&]() {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 8 * T; ++r) asm volatile("" : "+r"(acc[m][r])::"memory");
    };
    constexpr u32 half_bytes = 32 * 32 * 4, kstep_bytes = 2 * half_bytes, mtile_bytes = 8 * 32 * 4;
    // In part i's turn (from part 1 on): once every warp of this block is past its wait for part
    // i - 1's products, warp 0 tells every block of the cluster, lane l the block l % WGMMA_CLUSTER
    // (each block's `empty` counts 32 a stage). Every lane of the warp does the same: a lane-
    // dependent branch here would make ptxas serialize the products.
    auto release_previous = [&](int i) {
        if (i == 0) return;
        __syncthreads();
        if (threadIdx.x < 32) {
            const u32 remote = cluster_address(shared_address(&empty[(i - 1) % stages]), threadIdx.x % WGMMA_CLUSTER);
            asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
        }
    };
    if (threadIdx.x == 0)
        for (int i = 0; i < min(n, stages - 1); ++i) load_part(i);
    for (int i = 0; i < n; ++i) {
        mbarrier_wait(shared_address(&full[i % stages]), (i / stages) & 1);
        const u32 frag = shared_address(frag_of(i)), selb = shared_address(sel_of(i));
        fence_acc();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int ks = 0; ks < unit_ksteps; ++ks) {
            const u64 db = wgmma_desc(selb + 2 * ks * K * 16, K * 16, 128);  // [leaf][key]
#pragma unroll
            for (int m = 0; m < 2; ++m)
                wgmma_and_popc<T>(acc[m], wgmma_desc(frag + ks * kstep_bytes + (2 * wg + m) * mtile_bytes,
                                                     half_bytes, 128), db);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        fence_acc();
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // part i - 1's are done
        release_previous(i);
        // into the stage of part i - 1, once every block of the cluster has read it
        if (threadIdx.x == 0 && i + stages - 1 < n) {
            if (i > 0) mbarrier_wait(shared_address(&empty[(i - 1) % stages]), ((i - 1) / stages) & 1);
            load_part(i + stages - 1);
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_acc();
    // Accumulator r of thread (warp w of the warpgroup, lane l), M-tile 2g + m: row 64(2g + m) +
    // 16w + l / 4 + 8 (r / 2 % 2) of the slice (bit row / 8 of word row % 8), key 8 (r / 4) +
    // 2 (l % 4) + r % 2.
    const int w = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 8 * T; ++r) {
            const int row = 64 * (2 * wg + m) + 16 * w + (lane >> 2) + 8 * ((r >> 1) & 1);
            const int key = 8 * (r >> 2) + 2 * (lane & 3) + (r & 1);
            if (acc[m][r] & 1) atomicOr(&outsm[key * MMA_SLICE_WORDS + (row & 7)], 1u << (row >> 3));
        }
    __syncthreads();
    flush_outsm<K>(outsm, out, key0, slice);
    cluster_sync();  // the others' signals to this block's barriers are in before it leaves
#else
    __trap();
#endif
}

// The "fragments" layout from page-major pages and back, whole chunks: block (chunk, slice) of
// a grid of num_chunks * slices, thread (pg, w) as in stage_fragments. pages: the chunks' pages,
// row-major; pages_to_fragments reads those below valid_pages and zeroes the rest. A 32 x 32 bit
// transpose is its own inverse, so fragments_to_pages runs the same steps the other way round.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
pages_to_fragments(const u32* __restrict__ pages, long long valid_pages, u32* __restrict__ frags) {
    const int slices = PAGE_WORDS / MMA_SLICE_WORDS;
    const long long chunk = blockIdx.x / slices;
    const int slice = blockIdx.x % slices;
    const int pg = threadIdx.x / MMA_SLICE_WORDS, w = threadIdx.x % MMA_SLICE_WORDS;
    const long long page0 = chunk * MMA_CHUNK_PAGES + 32 * pg;
    u32 x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i)
        x[i] = page0 + i < valid_pages ? pages[(page0 + i) * PAGE_WORDS + slice * MMA_SLICE_WORDS + w] : 0u;
    transpose32(x);
    u32* dst = frags + (long long)blockIdx.x * BFRAG_WORDS + fragment_offset(pg, w);
#pragma unroll
    for (int b = 0; b < 32; ++b) dst[b * 32] = x[b];
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
fragments_to_pages(const u32* __restrict__ frags, u32* __restrict__ pages) {
    const int slices = PAGE_WORDS / MMA_SLICE_WORDS;
    const long long chunk = blockIdx.x / slices;
    const int slice = blockIdx.x % slices;
    const int pg = threadIdx.x / MMA_SLICE_WORDS, w = threadIdx.x % MMA_SLICE_WORDS;
    const long long page0 = chunk * MMA_CHUNK_PAGES + 32 * pg;
    u32 x[32];
    const u32* src = frags + (long long)blockIdx.x * BFRAG_WORDS + fragment_offset(pg, w);
#pragma unroll
    for (int b = 0; b < 32; ++b) x[b] = src[b * 32];
    transpose32(x);
#pragma unroll
    for (int i = 0; i < 32; ++i) pages[(page0 + i) * PAGE_WORDS + slice * MMA_SLICE_WORDS + w] = x[i];
}

// The key tiles the host may pick (cuda_plan.MMA_TILE_COUNTS): up to 176 keys a block (T = 11:
// 246 registers, no spills under nvcc 13 for sm_90; T = 12 spills). Of the wgmma scan,
// cuda_plan.WGMMA_TILE_COUNTS: 64 to 224 keys a block.
#define INSTANTIATE_MMA(T)                                                                            \
    template __global__ void dpf_scan_mma<T>(const u32*, long long, const uint4*, long long, int,      \
                                              int, u32*);                                              \
    template __global__ void dpf_scan_mma_frag<T>(const u32*, long long, const uint4*, long long, int, \
                                                   int, u32*);
INSTANTIATE_MMA(1)
INSTANTIATE_MMA(2)
INSTANTIATE_MMA(3)
INSTANTIATE_MMA(4)
INSTANTIATE_MMA(5)
INSTANTIATE_MMA(6)
INSTANTIATE_MMA(7)
INSTANTIATE_MMA(8)
INSTANTIATE_MMA(9)
INSTANTIATE_MMA(10)
INSTANTIATE_MMA(11)
#define INSTANTIATE_WGMMA(T)                                                                          \
    template __global__ void dpf_scan_wgmma_frag<T>(const u32*, long long, const uint4*, long long, int, \
                                                     int, u32*);
INSTANTIATE_WGMMA(4)
INSTANTIATE_WGMMA(5)
INSTANTIATE_WGMMA(6)
INSTANTIATE_WGMMA(7)
INSTANTIATE_WGMMA(8)
INSTANTIATE_WGMMA(9)
INSTANTIATE_WGMMA(10)
INSTANTIATE_WGMMA(11)
INSTANTIATE_WGMMA(12)
INSTANTIATE_WGMMA(13)
INSTANTIATE_WGMMA(14)
