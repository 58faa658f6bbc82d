// Full-domain DPF expansion fused with the page scan (docs/PROTOCOL.md sections 2-4).
//
// Compiled by NVRTC at run time (CuPy RawModule) and by nvcc in CI from this same text, so it
// includes no headers: NVRTC has no C++ standard library.
//
// Work split. A key batch's tree is cut at depth T = d - c: `dpf_expand_top` writes the nodes of
// depth T (each node once, level by level in shared memory, in stages of at most MAX_TOP_LEVELS).
// `dpf_scan<G>` then gives each block one key group (G keys) and a run of chunks; a chunk is the
// 2^c leaves under one depth-T node. Per chunk the block expands the chunk's c levels for its G
// keys in shared memory, turns the leaves into masks there, and streams the chunk's pages through
// registers: thread `col` owns 16-byte column `col` of every page (one mask unit), so each page
// word costs one LOP3 (acc ^= word & mask) and masks never leave shared memory. Blocks of the same
// chunk run and different key groups are adjacent in the grid, so they run together and the
// page re-reads of the later groups are served by L2. Accumulators meet in global memory by XOR
// atomics once per block.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

// Set by the host as -D options (gpu_engine/backends/cuda_plan.py, kernel_defines, where each
// is explained): SCAN_THREADS (one thread per 16-byte column of a page), TOP_THREADS,
// MAX_TOP_LEVELS, and the word offsets of a key record: KREC_ROOT, KREC_FINAL, KREC_ROOT_T,
// KREC_CW. A key record is krec u32 words (a multiple of 4, also set by the host).

// A rotation is one funnel shift (SHF, ALU pipe). As a multiply by 2^n and an add on the FMA pipe
// it measured slower on the H100: a longer dependency chain (docs/SCANS.md, Measured and not kept).
__device__ __forceinline__ u32 rotl32(u32 x, int n) {
    return __funnelshift_l(x, x, n);
}

#define QUARTER(a, b, c, d)                  \
    a += b; d ^= a; d = rotl32(d, 16);       \
    c += d; b ^= c; b = rotl32(b, 12);       \
    a += b; d ^= a; d = rotl32(d, 8);        \
    c += d; b ^= c; b = rotl32(b, 7);

#define DIAGONAL_ROUND(x)                             \
    QUARTER(x##0, x##5, x##10, x##15)                 \
    QUARTER(x##1, x##6, x##11, x##12)                 \
    QUARTER(x##2, x##7, x##8, x##13)                  \
    QUARTER(x##3, x##4, x##9, x##14)

#define COLUMN_ROUND(x)                               \
    QUARTER(x##0, x##4, x##8, x##12)                  \
    QUARTER(x##1, x##5, x##9, x##13)                  \
    QUARTER(x##2, x##6, x##10, x##14)                 \
    QUARTER(x##3, x##7, x##11, x##15)

// expand(seed) of docs/PROTOCOL.md section 2: ChaCha8 blocks 0 and 1 under key (s, s), nonce 0.
// The two blocks differ only in the counter word, which enters the first column round through
// quarter (0,4,8,12) alone, so the other three first-round quarters are computed once. Block 1
// contributes only the low bits of words 0 and 1; the compiler drops the rest of its last round.
__device__ __forceinline__ void prg_expand(uint4 s, uint4& left, uint4& right, u32& t_left, u32& t_right) {
    const u32 c0 = 0x61707865u, c1 = 0x3320646eu, c2 = 0x79622d32u, c3 = 0x6b206574u;
    u32 s1 = c1, s5 = s.y, s9 = s.y, s13 = 0;
    u32 s2 = c2, s6 = s.z, s10 = s.z, s14 = 0;
    u32 s3 = c3, s7 = s.w, s11 = s.w, s15 = 0;
    QUARTER(s1, s5, s9, s13)
    QUARTER(s2, s6, s10, s14)
    QUARTER(s3, s7, s11, s15)
    u32 a0 = c0, a4 = s.x, a8 = s.x, a12 = 0;
    u32 b0 = c0, b4 = s.x, b8 = s.x, b12 = 1;
    QUARTER(a0, a4, a8, a12)
    QUARTER(b0, b4, b8, b12)
    u32 a1 = s1, a2 = s2, a3 = s3, a5 = s5, a6 = s6, a7 = s7;
    u32 a9 = s9, a10 = s10, a11 = s11, a13 = s13, a14 = s14, a15 = s15;
    u32 b1 = s1, b2 = s2, b3 = s3, b5 = s5, b6 = s6, b7 = s7;
    u32 b9 = s9, b10 = s10, b11 = s11, b13 = s13, b14 = s14, b15 = s15;
    DIAGONAL_ROUND(a)
    DIAGONAL_ROUND(b)
#pragma unroll
    for (int r = 0; r < 3; ++r) {
        COLUMN_ROUND(a)
        COLUMN_ROUND(b)
        DIAGONAL_ROUND(a)
        DIAGONAL_ROUND(b)
    }
    left = make_uint4(a0 + c0, a1 + c1, a2 + c2, a3 + c3);
    right = make_uint4(a4 + s.x, a5 + s.y, a6 + s.z, a7 + s.w);
    // the low bit of a sum is the XOR of the low bits: c0 is odd, c1 even
    t_left = (b0 ^ 1u) & 1u;
    t_right = b1 & 1u;
}

__device__ __forceinline__ uint4 xor4(uint4 a, uint4 b) {
    return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

__device__ __forceinline__ uint4 and_mask(uint4 a, u32 on) {
    return make_uint4(a.x & on, a.y & on, a.z & on, a.w & on);
}

// Writes the children of the parent at `slot` = node * G + key (its t bit `t`, its expansion
// left/right/tl/tr) after the level's corrections. Nodes are stored key-minor ([node * G + key]).
// With `final_cw` non-null the children are leaves: they are written as masks (seed ^ final_cw
// where t), t is not kept.
template <int G>
__device__ __forceinline__ void store_children(
    int slot, u32 t, uint4 left, uint4 right, u32 tl, u32 tr, uint4* out_seed, u8* out_t,
    const uint4* cw_seed, const u8* cw_t, const uint4* final_cw) {
    const int i = slot / G;
    const int j = slot - i * G;
    const u32 on = 0u - t;
    const uint4 cw = and_mask(cw_seed[j], on);
    const u32 tcw = cw_t[j] & on;
    left = xor4(left, cw);
    right = xor4(right, cw);
    tl ^= tcw & 1u;
    tr ^= (tcw >> 1) & 1u;
    if (final_cw != 0) {
        left = xor4(left, and_mask(final_cw[j], 0u - tl));
        right = xor4(right, and_mask(final_cw[j], 0u - tr));
    } else {
        out_t[(2 * i) * G + j] = (u8)tl;
        out_t[(2 * i + 1) * G + j] = (u8)tr;
    }
    out_seed[(2 * i) * G + j] = left;
    out_seed[(2 * i + 1) * G + j] = right;
}

// Nodes each thread expands side by side. One ChaCha evaluation is a chain of dependent adds,
// XORs and rotations; at the 4 warps a scheduler that the accumulators leave room for, a second
// independent evaluation fills the first one's latency (one at a time measured 5% slower).

// The threads that expand a tree level: the whole block (threadIdx.x of blockDim.x, meeting at
// __syncthreads), or dpf_scan_v1_frag's producer warps, which meet at their own named barrier
// while the block's other warps multiply.
struct Team {
    int tid, size, barrier;  // barrier 0: __syncthreads; else bar.sync barrier, size threads
};

__device__ __forceinline__ Team whole_block() { return {(int)threadIdx.x, (int)blockDim.x, 0}; }

__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" : : "r"(id), "r"(threads) : "memory");
}

// A producer's side of a named barrier: counts as arrived and goes on (what it wrote before is
// seen by the threads that bar.sync on it), as CUTLASS's NamedBarrier::arrive does.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" : : "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void team_sync(const Team& team) {
    if (team.barrier == 0) {
        __syncthreads();
    } else {
        named_barrier(team.barrier, team.size);
    }
}

// The keys of a group of G that a level expands: the first `live` (a group of fewer keys than G
// expands only its own; the slots past them keep stale nodes, whose answers are never written). Work item
// idx is node idx / live, key idx % live; inv = ceil(2^32 / live) makes that division one
// multiply-high, exact while idx < 2^16 (where live < G, in dpf_scan_v1_frag: 128 x 16 at most).
struct LiveKeys {
    int live;
    u32 inv;
};

__device__ __forceinline__ LiveKeys live_keys(int live) {
    return {live, live > 1 ? 0xFFFFFFFFu / live + 1u : 0u};  // ceil(2^32 / live), in 32 bits
}

// Where work item idx's node lives: node * G + key (idx itself where every key is live, which
// the compiler sees when live is G).
template <int G>
__device__ __forceinline__ int live_slot(int idx, LiveKeys keys) {
    if (keys.live == G) return idx;
    const int i = keys.live == 1 ? idx : (int)__umulhi((u32)idx, keys.inv);
    return i * G + (idx - i * keys.live);
}

// One tree level for G keys held in shared memory: parents [0, n_par) of every live key become
// children [0, 2 n_par), corrected with this level's cw_seed/cw_t (one per key).
template <int G>
__device__ __forceinline__ void expand_level(
    const uint4* in_seed, const u8* in_t, uint4* out_seed, u8* out_t, int n_par,
    const uint4* cw_seed, const u8* cw_t, const uint4* final_cw, LiveKeys keys, Team team) {
    const int total = n_par * keys.live;
    int idx = team.tid;
    for (; idx + team.size < total; idx += 2 * team.size) {
        const int at0 = live_slot<G>(idx, keys), at1 = live_slot<G>(idx + team.size, keys);
        const uint4 s0 = in_seed[at0], s1 = in_seed[at1];
        const u32 t0 = in_t[at0], t1 = in_t[at1];
        uint4 l0, r0, l1, r1;
        u32 tl0, tr0, tl1, tr1;
        prg_expand(s0, l0, r0, tl0, tr0);
        prg_expand(s1, l1, r1, tl1, tr1);
        store_children<G>(at0, t0, l0, r0, tl0, tr0, out_seed, out_t, cw_seed, cw_t, final_cw);
        store_children<G>(at1, t1, l1, r1, tl1, tr1, out_seed, out_t, cw_seed, cw_t, final_cw);
    }
    for (; idx < total; idx += team.size) {
        const int at = live_slot<G>(idx, keys);
        uint4 left, right;
        u32 tl, tr;
        prg_expand(in_seed[at], left, right, tl, tr);
        store_children<G>(at, in_t[at], left, right, tl, tr, out_seed, out_t, cw_seed, cw_t, final_cw);
    }
}

// Nodes of a level that hold at least one of `num_leaves` leaves, when each spans 2^height.
__device__ __forceinline__ long long live_nodes(long long num_leaves, int height) {
    return (num_leaves + (1LL << height) - 1) >> height;
}

__device__ __forceinline__ void load_level_cw(
    const u32* rec, int domain_bits, int level, uint4* cw_seed_out, u8* cw_t_out) {
    const u32* cw = rec + KREC_CW + 4 * level;
    *cw_seed_out = make_uint4(cw[0], cw[1], cw[2], cw[3]);
    *cw_t_out = (u8)rec[KREC_CW + 4 * domain_bits + level];
}

// Top of the tree: block (node, key) expands `levels` levels under node `node` of depth
// `depth_in` and writes the live nodes of depth depth_in + levels to out_seed/out_t
// ([key * out_stride + index]). With depth_in == 0 the input is the key's root.
extern "C" __global__ void __launch_bounds__(TOP_THREADS)
dpf_expand_top(const u32* __restrict__ keyrec, int krec, int domain_bits, long long num_leaves,
               const uint4* __restrict__ in_seed, const u8* __restrict__ in_t, long long in_stride,
               int depth_in, int levels,
               uint4* __restrict__ out_seed, u8* __restrict__ out_t, long long out_stride) {
    __shared__ uint4 buf_seed[2][1 << MAX_TOP_LEVELS];
    __shared__ u8 buf_t[2][1 << MAX_TOP_LEVELS];
    __shared__ uint4 cw_seed[MAX_TOP_LEVELS];
    __shared__ u8 cw_t[MAX_TOP_LEVELS];

    const long long node = blockIdx.x;
    const int key = blockIdx.y;
    const u32* rec = keyrec + (long long)key * krec;
    const int depth_out = depth_in + levels;
    if (threadIdx.x < levels) {
        load_level_cw(rec, domain_bits, depth_in + threadIdx.x, &cw_seed[threadIdx.x], &cw_t[threadIdx.x]);
    }
    // level l's nodes go to buffer (levels - l) & 1, so the last level lands in buffer 0
    if (threadIdx.x == 0) {
        const int b = levels & 1;
        if (depth_in == 0) {
            buf_seed[b][0] = make_uint4(rec[KREC_ROOT], rec[KREC_ROOT + 1], rec[KREC_ROOT + 2], rec[KREC_ROOT + 3]);
            buf_t[b][0] = (u8)rec[KREC_ROOT_T];
        } else {
            buf_seed[b][0] = in_seed[key * in_stride + node];
            buf_t[b][0] = in_t[key * in_stride + node];
        }
    }
    __syncthreads();
    const long long live_out = live_nodes(num_leaves, domain_bits - depth_out);
    for (int l = 0; l < levels; ++l) {
        // live parents under this block's node at depth depth_in + l
        const long long first = node << l;
        const long long live = live_nodes(num_leaves, domain_bits - depth_in - l) - first;
        const int n_par = (int)(live < (1LL << l) ? live : (1LL << l));
        const int src = (levels - l) & 1;
        expand_level<1>(buf_seed[src], buf_t[src], buf_seed[src ^ 1], buf_t[src ^ 1], n_par,
                        &cw_seed[l], &cw_t[l], (const uint4*)0, live_keys(1), whole_block());
        __syncthreads();
    }
    const long long first_out = node << levels;
    for (int i = threadIdx.x; i < (1 << levels); i += blockDim.x) {
        if (first_out + i < live_out) {
            out_seed[key * out_stride + first_out + i] = buf_seed[0][i];
            out_t[key * out_stride + first_out + i] = buf_t[0][i];
        }
    }
}

// Keys per block -> blocks per SM the register budget aims at (G keys = 4G accumulators).
#define SCAN_MIN_BLOCKS(G) ((G) <= 16 ? 2 : 1)
// Pages whose loads a thread keeps in flight: more where the scan is memory-bound (few keys).
#define SCAN_UNROLL(G) ((G) <= 4 ? 8 : 4)

// Dynamic shared memory of dpf_scan<G> for chunks of L = 2^c leaves: the regions of
// cuda_plan.SCAN_SHARED_REGIONS, carved below in that order (the host sizes the launch from it).

// acc[j] ^= v & mask of key j, for the G keys of one page column: one LOP3 a word.
template <int G>
__device__ __forceinline__ void accumulate_page(uint4 (&acc)[G], const uint4& v, const uint4* m) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const uint4 mk = m[j];
        acc[j].x ^= v.x & mk.x;
        acc[j].y ^= v.y & mk.y;
        acc[j].z ^= v.z & mk.z;
        acc[j].w ^= v.w & mk.w;
    }
}

// Streams pages [0, count) of one column (col_ptr: the first page's, SCAN_THREADS uint4 apart)
// through registers, U loads in flight: add(acc, v, p) folds page p's 16 bytes v into acc.
template <int G, int U, typename Add>
__device__ __forceinline__ void scan_column(uint4 (&acc)[G], const uint4* col_ptr, int count, const Add& add) {
    int p = 0;
    for (; p + U <= count; p += U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = __ldg(col_ptr + (long long)(p + u) * SCAN_THREADS);
#pragma unroll
        for (int u = 0; u < U; ++u) add(acc, v[u], p + u);
    }
    for (; p < count; ++p) {
        add(acc, __ldg(col_ptr + (long long)p * SCAN_THREADS), p);
    }
}

// The block's accumulators meet in global memory: key key0 + j's column `col`, by XOR atomics.
template <int G>
__device__ __forceinline__ void flush_columns(const uint4 (&acc)[G], u64* out, int key0, int col) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
        u64* o = out + (long long)(key0 + j) * (SCAN_THREADS * 2) + col * 2;
        atomicXor(o, ((u64)acc[j].y << 32) | acc[j].x);
        atomicXor(o + 1, ((u64)acc[j].w << 32) | acc[j].z);
    }
}

// The c levels' seed and t corrections of keys key0 .. key0 + G - 1 ([level][key]) and their final_cw.
template <int G>
__device__ __forceinline__ void load_chunk_cw(const u32* keyrec, int krec, int key0, int domain_bits, int c,
                                              uint4* cw_seed, u8* cw_t, uint4* final_cw) {
    const int depth_top = domain_bits - c;
    for (int i = threadIdx.x; i < c * G; i += blockDim.x) {
        const int l = i / G, j = i - l * G;
        load_level_cw(keyrec + (long long)(key0 + j) * krec, domain_bits, depth_top + l,
                      &cw_seed[l * G + j], &cw_t[l * G + j]);
    }
    if (threadIdx.x < G) {
        const u32* rec = keyrec + (long long)(key0 + threadIdx.x) * krec + KREC_FINAL;
        final_cw[threadIdx.x] = make_uint4(rec[0], rec[1], rec[2], rec[3]);
    }
}

// Key `key`'s node over chunk `chunk` (the root of its tree where depth_top is 0) into
// dst[at], dst_t[at]
__device__ __forceinline__ void load_chunk_root(uint4* dst, u8* dst_t, int at, int key, long long chunk,
                                                int depth_top, const u32* keyrec, int krec, const uint4* root_seed,
                                                const u8* root_t, long long root_stride) {
    if (depth_top == 0) {
        const u32* rec = keyrec + (long long)key * krec;
        dst[at] = make_uint4(rec[KREC_ROOT], rec[KREC_ROOT + 1], rec[KREC_ROOT + 2], rec[KREC_ROOT + 3]);
        dst_t[at] = (u8)rec[KREC_ROOT_T];
    } else {
        dst[at] = root_seed[key * root_stride + chunk];
        dst_t[at] = root_t[key * root_stride + chunk];
    }
}

// Chunk levels from .. c - 1 of a chunk (n_leaves of its leaves live): level l (parents at chunk
// depth l) writes to `big` when c-1-l is even, so the leaves (l = c-1) land there as masks, and
// level `from`'s parents sit where level from - 1 would have written. The team meets at its
// barrier after each level.
template <int G>
__device__ __forceinline__ void expand_levels(int from, int c, int n_leaves, uint4* big, uint4* half, u8* big_t,
                                              u8* half_t, const uint4* cw_seed, const u8* cw_t,
                                              const uint4* final_cw, LiveKeys keys, Team team) {
    for (int l = from; l < c; ++l) {
        const int to_big = ((c - 1 - l) & 1) == 0;
        const int n_par = (n_leaves + (1 << (c - l)) - 1) >> (c - l);
        expand_level<G>(to_big ? half : big, to_big ? half_t : big_t,
                        to_big ? big : half, to_big ? big_t : half_t, n_par,
                        &cw_seed[l * G], &cw_t[l * G], l == c - 1 ? final_cw : (const uint4*)0, keys, team);
        team_sync(team);
    }
}

// Expands chunk `chunk` (2^c leaves under one node of depth depth_top, n_leaves of them live) for
// keys key0 .. key0 + G - 1 (the first keys.live of them) in shared memory: its leaves land in
// `big` as masks, [leaf * G + key].
// The chunk roots sit where level -1 would have written (expand_levels). The team's threads do the
// work and meet at its barrier, last after the leaves.
template <int G>
__device__ __forceinline__ void expand_chunk(int c, long long chunk, int n_leaves, int depth_top,
                                             const u32* keyrec, int krec, int key0,
                                             const uint4* root_seed, const u8* root_t, long long root_stride,
                                             uint4* big, uint4* half, u8* big_t, u8* half_t,
                                             const uint4* cw_seed, const u8* cw_t, const uint4* final_cw,
                                             LiveKeys keys, Team team) {
    uint4* root_buf = (c & 1) ? half : big;
    u8* root_buf_t = (c & 1) ? half_t : big_t;
    if ((unsigned)team.tid < (unsigned)keys.live)  // unsigned, as threadIdx.x was: the same SASS in dpf_scan<G>
        load_chunk_root(root_buf, root_buf_t, team.tid, key0 + team.tid, chunk, depth_top, keyrec, krec, root_seed,
                        root_t, root_stride);
    team_sync(team);
    expand_levels<G>(0, c, n_leaves, big, half, big_t, half_t, cw_seed, cw_t, final_cw, keys, team);
}

template <int G>
__global__ void __launch_bounds__(SCAN_THREADS, SCAN_MIN_BLOCKS(G))
dpf_scan(const uint4* __restrict__ pages, long long num_pages, int domain_bits, int chunk_levels,
         const u32* __restrict__ keyrec, int krec, int num_keys,
         const uint4* __restrict__ root_seed, const u8* __restrict__ root_t, long long root_stride,
         int num_groups, int chunks_per_block, u64* __restrict__ out) {
    extern __shared__ uint4 smem[];
    const int c = chunk_levels;
    const int L = 1 << c;
    uint4* big = smem;                      // L*G: the leaves (masks), and every other level
    uint4* half = big + L * G;              // (L/2)*G: the levels in between
    uint4* cw_seed = half + (L / 2) * G;    // [level][key]
    uint4* final_cw = cw_seed + c * G;
    u8* big_t = (u8*)(final_cw + G);
    u8* half_t = big_t + L * G;
    u8* cw_t = half_t + (L / 2) * G;

    const int group = blockIdx.x % num_groups;
    const long long run = blockIdx.x / num_groups;
    const int key0 = group * G;  // the host pads the last group to G keys (num_groups * G)
    const int depth_top = domain_bits - c;
    const long long num_chunks = live_nodes(num_pages, c);
    const long long chunk_begin = run * chunks_per_block;
    const long long chunk_end = min(num_chunks, chunk_begin + chunks_per_block);
    const int col = threadIdx.x;

    load_chunk_cw<G>(keyrec, krec, key0, domain_bits, c, cw_seed, cw_t, final_cw);

    uint4 acc[G];
#pragma unroll
    for (int j = 0; j < G; ++j) acc[j] = make_uint4(0, 0, 0, 0);

    constexpr int U = SCAN_UNROLL(G);
    for (long long chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        const long long leaf0 = chunk << c;
        const int n_leaves = (int)min((long long)L, num_pages - leaf0);
        expand_chunk<G>(c, chunk, n_leaves, depth_top, keyrec, krec, key0, root_seed, root_t, root_stride,
                        big, half, big_t, half_t, cw_seed, cw_t, final_cw, live_keys(G), whole_block());

        scan_column<G, U>(acc, pages + leaf0 * SCAN_THREADS + col, n_leaves,
                          [&](uint4 (&a)[G], const uint4& v, int p) { accumulate_page<G>(a, v, big + p * G); });
        __syncthreads();  // the next chunk's roots and levels overwrite these masks
    }
    flush_columns<G>(acc, out, key0, col);
}

// v1 keys over the fragments layout, on the tensor cores (sm_80 or later; cuda_plan.V1_FRAG_*).
// Answer bit b of 32-bit word w of a v1 key is the parity over pages of page bit (w, b) AND bit
// r = 32 (w % 4) + b of the page's 128-bit mask: for each residue r, a binary product of the
// keys' bit r over pages (A: 16 keys x 256 pages) by the page bits of residue r (B: pages x the
// 256 words w with w % 4 = r / 32). The fragments layout stores B fragments by slice of 8 words
// (fragment_offset, bit_products.cuh), and words c and c + 4 of a slice share residue 32c + b, so
// one m16n8k256 product takes its 8 columns from 4 slices: column n from slice 4j + n / 2, word
// c + 4 (n % 2). A block holds one key group (an m16 tile of up to 16 keys: the batch's keys split
// evenly over its groups) and a run of chunks of 256 pages (mma k-steps)
// and is two teams of V1_FRAG_THREADS / 2 threads. The producers (warps 8..15) expand the next
// chunk's tree in shared memory (the first levels of 8 chunks at once, v1f_expand_tops, then each
// chunk's rest, v1f_expand_rest), meeting at their own named barrier, while
// the multipliers (warps 0..7) multiply the current chunk: the expansion (ChaCha8 on the ALU) and
// the products (loads from L2 and DRAM, the tensor cores) overlap instead of taking turns. Between
// chunks the producers turn the leaves' masks into the A fragments, residue by residue, in a
// buffer of their own (the teams meet at bar.sync, as CUTLASS's named barriers do: the hardware
// counts warps, whichever instruction they wait at); multiplier warp W multiplies them by slices
// 16W .. 16W + 15 of the chunk's pages read straight from global memory. A product's popcounts
// live for one k-step: their low bits go to bit b of the warp's answer words (64 registers a
// thread: 2 keys x 8 words x 4 column tiles, two words' halves packed in each), which meet in
// global memory by XOR atomics once per block.
#define V1F_L (1 << V1_FRAG_CHUNK_LEVELS)  // leaves a chunk expands at most (the host sizes shared memory for it)
#define V1F_SLICE_WORDS (MMA_CHUNK_PAGES * MMA_SLICE_WORDS)  // one (chunk, slice) of the fragments layout
#define V1F_TEAM (V1_FRAG_THREADS / 2)  // threads a team: the producers, the multipliers
#define V1F_PRODUCER_BARRIER 1  // bar.sync ids: the producers' own (between tree levels)
// both teams, a chunk's A fragments handed over: the producers arrive at READY once they are in
// place (the multipliers wait for it), the multipliers at FREE once they have read them (the
// producers wait for it before they write the next chunk's), so neither team waits for the other
// more than that
#define V1F_AFRAG_READY 2
#define V1F_AFRAG_FREE 3

// x[i] <- word q of the mask of key k for page 32 pg + i (0 past the chunk's live leaves).
template <int G>
__device__ __forceinline__ void v1f_load_masks(u32 (&x)[32], const uint4* big, int k, int pg, int q, int n_leaves) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int p = 32 * pg + i;
        x[i] = p < n_leaves ? ((const u32*)(big + p * G + k))[q] : 0u;
    }
}

// Where lane `lane`'s A fragment (uint4 a0 .. a3, as mma.sync takes them: in another order the
// compiler moved them into place for every product) of residue r lies in afrag (uint4s): rows of
// V1_FRAG_AFRAG_ROW = 36 (the 32 lanes, then 64 bytes of padding), and 16 bytes more after each
// 32 residues. A tensor-core product reads one residue's 32 lanes (no conflict whatever the
// padding); a quarter warp of the ALU path reads 4 residues 32 apart, a half warp 8 (two
// neighbours of each), which 512-byte rows would put in one bank slot (16-way conflicts a warp):
// with the padding they take 8 slots, and a key's 4 lanes stay 4 uint4s in a row.
__device__ __forceinline__ int v1f_afrag_index(int r, int lane) {
    return r * V1_FRAG_AFRAG_ROW + (r >> 5) + lane;
}

// After transpose32, x[b] is bit 32 q + b of key k's masks over pages 32 pg .. 32 pg + 31: the A
// fragment word of residue 32 q + b, lane (k % 8, pg % 4), register k / 8 + 2 (pg / 4).
__device__ __forceinline__ void v1f_store_afrag(uint4* afrag, const u32 (&x)[32], int k, int pg, int q) {
    const int lane = (k & 7) * 4 + (pg & 3), reg = (k >> 3) + 2 * (pg >> 2);
#pragma unroll
    for (int b = 0; b < 32; ++b) ((u32*)(afrag + v1f_afrag_index(32 * q + b, lane)))[reg] = x[b];
}

// A producer's share of turning a chunk's masks (big) into its A fragments: the live keys' 32
// blocks (32 pages x a mask word) each, item i of them key i % live, block i / live (pages 32 of
// its low 3 bits .., mask word its high 2), so with every key live producer p transposes key p % 16,
// pages 32 ((p / 16) % 8) .., mask words p / 128 and p / 128 + 2, and with one query's 3 keys 96
// producers one block each, not all 256 two (the multipliers wait for this between chunks; the
// A rows past the live keys keep stale masks, as their trees do, and their answers are not written).
template <int G>
__device__ __forceinline__ void v1f_make_afrag(uint4* afrag, const uint4* big, int p, int n_leaves, LiveKeys keys) {
    static_assert(V1F_TEAM == 256 && G == 16, "a producer transposes at most two (key, 32 pages, word) blocks");
#pragma unroll 1
    for (int item = p; item < 32 * keys.live; item += V1F_TEAM) {
        const int slot = live_slot<G>(item, keys), k = slot % G, block = slot / G;
        u32 x[32];
        v1f_load_masks<G>(x, big, k, block & 7, block >> 3, n_leaves);
        transpose32(x);
        v1f_store_afrag(afrag, x, k, block & 7, block >> 3);
    }
}

// Rows of B words a tensor-core multiplier keeps in flight: 1 (a row's 32 words loaded, then its
// 16 products), or 2 (the next row's loaded before this row's products: 64 words, with the 64
// accumulators more than the 128 registers a thread of a 512-thread block has, so on sm_90a the
// teams trade registers by setmaxnreg: V1F_MULTIPLIER_REGS for the multipliers, the rest to the
// producers, whose expansion fits 88 without spilling). Measured at mainnet on the H100
// (docs/SCANS.md): Q = 8 32.1-32.6 ms against 34.7-34.8, Q = 32 96.0-97.6 against 102.1-102.8;
// 160 registers for the multipliers 33.5 and 101.5, 152 spilled. Elsewhere 1 (no setmaxnreg: 2
// would spill); -DV1F_ROWS_IN_FLIGHT=n for either anywhere (the CPU emulator runs both).
#ifndef V1F_ROWS_IN_FLIGHT
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define V1F_ROWS_IN_FLIGHT 2
#else
#define V1F_ROWS_IN_FLIGHT 1
#endif
#endif
#define V1F_MULTIPLIER_REGS 168
#define V1F_PRODUCER_REGS (2 * 128 - V1F_MULTIPLIER_REGS)  // 65,536 registers: 256 threads a team
static_assert(V1F_MULTIPLIER_REGS % 8 == 0 && V1F_MULTIPLIER_REGS >= 128 && V1F_MULTIPLIER_REGS <= 232,
              "setmaxnreg: a multiple of 8, no fewer than the 128 a thread starts with, 24 left a producer");

// Rows (residues b of a k-step: 128 bytes of a slice and half each) a multiplier warp asks L2 for
// ahead of its loads: one prefetch a lane a row, so a row's loads find it in L2 rather than wait
// at a warp's one row in flight. Launches of V1F_PREFETCH_MIN_GROUPS key groups or more only.
// None where the multipliers keep two rows in flight (V1F_ROWS_IN_FLIGHT): measured on the H100
// (docs/SCANS.md), 4 rows ahead then took Q = 8 32.3 ms against 32.0 without, Q = 16 52.2 against
// 49.6, Q = 32 97.9 against 96.2 at mainnet and 1.073 against 1.035 ms at 65,536 pages (Q = 74).
// With one row in flight (builds other than sm_90a's) 4 rows ahead paid: 6 groups 12%, 2 groups
// of evenly split keys 14%. Variants to time: V1F_PREFETCH_ROWS=n, V1F_PREFETCH_MIN_GROUPS=n.
#ifndef V1F_PREFETCH_ROWS
#define V1F_PREFETCH_ROWS (V1F_ROWS_IN_FLIGHT == 2 ? 0 : 4)
#endif
#ifndef V1F_PREFETCH_MIN_GROUPS
#define V1F_PREFETCH_MIN_GROUPS 2
#endif

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
}

// The same, the line marked to be evicted last (kept in L2 over lines read and done with; the
// eviction priority needs sm_80, a plain prefetch before)
__device__ __forceinline__ void prefetch_l2_last(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    prefetch_l2(p);
#else
    asm volatile("prefetch.global.L2::evict_last [%0];" : : "l"(p));
#endif
}

// The first word of the chunk at leaf0 (a k-step of 256 pages) in the fragments layout.
__device__ __forceinline__ const u32* v1f_chunk_words(const u32* frags, long long leaf0) {
    const int kstep = (int)((leaf0 % MMA_CHUNK_PAGES) / V1F_L);
    return frags + (leaf0 / MMA_CHUNK_PAGES) * (long long)((PAGE_WORDS / MMA_SLICE_WORDS) * V1F_SLICE_WORDS)
           + fragment_offset(8 * kstep, 0);
}

// A multiplier lane's prefetch line of a row (from a chunk's first word): slice 16 warp + lane / 2,
// half lane % 2 (32 lanes: the warp's 16 slices x 2 halves, every line a row's loads read).
__device__ __forceinline__ long long v1f_prefetch_line(int warp, int lane) {
    return (long long)(16 * warp + (lane >> 1)) * V1F_SLICE_WORDS + (lane & 1) * 32 * 32;
}

// setmaxnreg (sm_90a, a warpgroup's warps alike): this warp's registers raised or lowered to n
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// A multiplier's fold of a row's popcounts into its accumulators: row s of a bit half (residue
// 16 h + s) goes to bit s of an accumulator (its word c) and bit 16 + s (word c + 4). The fold's
// multipliers 2^s and 2^(16+s) and its mask (their sum) are carried from row to row (next()),
// never written 1 << s: the compiler turns a product by a shifted 1 into a shift (ALU pipe), and
// builds a mask it can see through in every fold.
struct V1fFold {
    u32 lo = 1u, hi = 1u << 16, m = (1u << 16) | 1u;
    // d (one product's counts) into the accumulators of keys g (d0, d1) and g + 8 (d2, d3): a
    // count is at most 256 (9 bits), so 2^s d0 + 2^(16+s) d1 never carries into bit 16 + s, and
    // bits s and 16 + s are the two counts' low bits (two IMADs on the FMA pipe and a LOP3)
    __device__ __forceinline__ void operator()(u32& acc_g, u32& acc_g8, const int (&d)[4]) const {
        acc_g ^= ((u32)d[0] * lo + (u32)d[1] * hi) & m;
        acc_g8 ^= ((u32)d[2] * lo + (u32)d[3] * hi) & m;
    }
    __device__ __forceinline__ void next() {
        lo <<= 1;
        hi <<= 1;
        m <<= 1;
    }
};

// Row b's B words of the lane (b_at: v1f_lane_rows's): [cq][j][half]
__device__ __forceinline__ void v1f_load_row(u32 (&w)[4][4][2], const u32* b_at, int b) {
#pragma unroll
    for (int cq = 0; cq < 4; ++cq)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32* p = b_at + 4 * j * V1F_SLICE_WORDS + b * 32 + 4 * cq;
            w[cq][j][0] = __ldg(p);
            w[cq][j][1] = __ldg(p + 32 * 32);
        }
}

// Row b's 16 products and their fold, from its loaded B words
__device__ __forceinline__ void v1f_row_products(u32 (&acc)[2][2][4][4], const uint4* afrag, const u32 (&w)[4][4][2],
                                                 int h, int b, int lane, const V1fFold& fold) {
    const uint4* a_row = afrag + v1f_afrag_index(b, lane);
#pragma unroll
    for (int cq = 0; cq < 4; ++cq) {
        const uint4 a = a_row[cq * (32 * V1_FRAG_AFRAG_ROW + 1)];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int d[4] = {0, 0, 0, 0};
            mma_and_popc(d, a.x, a.y, a.z, a.w, w[cq][j][0], w[cq][j][1]);
            fold(acc[0][h][cq][j], acc[1][h][cq][j], d);
        }
    }
}

// A multiplier lane's places in the chunk at leaf0: its first B word of the k-step (lane (g, t)
// reads B column g, slice 16 warp + 4j + g / 2, word c + 4 (g % 2) at + 4c, pages 32t .., half 1 at
// + 32 * 32), and its prefetch line in this chunk and in the next it multiplies (next_leaf0; null
// where that is -1, none)
struct V1fLaneRows {
    const u32* b_at;
    const u32* pf_at;
    const u32* pf_next;
};

__device__ __forceinline__ V1fLaneRows v1f_lane_rows(const u32* frags, long long leaf0, long long next_leaf0, int warp,
                                                     int lane) {
    const int g = lane >> 2, t = lane & 3;
    const u32* chunk_at = v1f_chunk_words(frags, leaf0);
    const long long line = v1f_prefetch_line(warp, lane);
    return {chunk_at + (long long)(16 * warp + (g >> 1)) * V1F_SLICE_WORDS + fragment_offset(t, 4 * (g & 1)),
            chunk_at + line, next_leaf0 >= 0 ? v1f_chunk_words(frags, next_leaf0) + line : (const u32*)0};
}

// Row `row` asked of L2: of this chunk below 32, else row - 32 of the next one (if any)
__device__ __forceinline__ void v1f_prefetch_row(const V1fLaneRows& rows, int row) {
    if (row < 32) {
        prefetch_l2(rows.pf_at + row * 32);
    } else if (rows.pf_next != 0) {
        prefetch_l2(rows.pf_next + (row - 32) * 32);
    }
}

// Multiplier warp `warp`'s products of one chunk (its first page leaf0) by its A fragments, a row
// of B words in flight: each row's 32 loads, then its 16 products. next_leaf0: the next chunk the
// warp multiplies (its first rows are prefetched), or -1; prefetch: whether to prefetch rows at all.
__device__ __forceinline__ void v1f_multiply(u32 (&acc)[2][2][4][4], const uint4* afrag, const u32* frags,
                                             long long leaf0, long long next_leaf0, bool prefetch, int warp,
                                             int lane) {
    const V1fLaneRows rows = v1f_lane_rows(frags, leaf0, next_leaf0, warp, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        V1fFold fold;
#pragma unroll 1  // one residue a turn: two a turn measured slower (docs/SCANS.md)
        for (int s = 0; s < 16; ++s) {
            const int b = 16 * h + s;
#if V1F_PREFETCH_ROWS > 0
            if (prefetch) v1f_prefetch_row(rows, b + V1F_PREFETCH_ROWS);
#endif
            u32 w[4][4][2];
            v1f_load_row(w, rows.b_at, b);
            v1f_row_products(acc, afrag, w, h, b, lane, fold);
            fold.next();
        }
    }
}

// v1f_multiply with two rows in flight: row b + 1's loads issued before row b's products
__device__ __forceinline__ void v1f_multiply2(u32 (&acc)[2][2][4][4], const uint4* afrag, const u32* frags,
                                              long long leaf0, long long next_leaf0, bool prefetch, int warp,
                                              int lane) {
    const V1fLaneRows rows = v1f_lane_rows(frags, leaf0, next_leaf0, warp, lane);
    const u32* b_at = rows.b_at;  // a local: ptxas schedules the loop as measured (316 instructions, not 317)
    u32 w0[4][4][2], w1[4][4][2];
    v1f_load_row(w0, b_at, 0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        V1fFold fold;
#pragma unroll 1
        for (int s = 0; s < 16; s += 2) {
            const int b = 16 * h + s;
#if V1F_PREFETCH_ROWS > 0
            if (prefetch) {
                v1f_prefetch_row(rows, b + V1F_PREFETCH_ROWS);
                v1f_prefetch_row(rows, b + 1 + V1F_PREFETCH_ROWS);
            }
#endif
            v1f_load_row(w1, b_at, b + 1);
            v1f_row_products(acc, afrag, w0, h, b, lane, fold);
            fold.next();
            if (b + 2 < 32) v1f_load_row(w0, b_at, b + 2);
            v1f_row_products(acc, afrag, w1, h, b + 1, lane, fold);
            fold.next();
        }
    }
}

// A launch of at most V1_FRAG_ALU_KEYS keys (the host's; one or two queries) multiplies on the ALU
// instead: memory binds a single query, and a tensor-core product carries 16 key rows whatever the
// batch. A fragments word holds bit b of word w of 32 pages: ANDed with the A fragments word of
// residue 32 (w % 4) + b (those pages' mask bits) and XORed with the k-step's 7 other such words of
// (w, b), the parity of what it holds is this k-step's share of answer bit b of word w: 8 LOP3, a
// POPC and two more a key for 8 words. Launches of at most V1F_ALU_FEW_KEYS keys (one query's)
// take a build for that many, the rest one for V1_FRAG_ALU_KEYS.
#define V1F_ALU_FEW_KEYS ((V1_FRAG_ALU_KEYS + 1) / 2)

// A chunk is 32 steps j of a multiplier warp on the ALU. Warp W takes bit quad W (bits 4 W .. + 3)
// of every slice, lane (r, c) bit 4 W + r of word c, and step j slices 4 j .. 4 j + 3, both halves.
// Row b of half h of a slice is 32 words (4 c + t, word c of the slice for pages 32 t ..) from
// 32 b + 1024 h, uint4 8 b + 256 h + c, so a quad's 4 rows are 512 contiguous bytes: each of a
// step's 8 loads takes 512 contiguous bytes a warp, and the 8 warps of a step the whole 4 KiB of a
// slice's half (as dpf_scan reads a page), where one bit a step took 128 bytes from 32 places.
// A lane's residue, 32 (c % 4) + 4 W + r, is the same at every step, but its A words are loaded
// from shared memory each step (volatile), for one query too: kept in registers for the chunk
// (8 a key), with the fragments released to the producers as soon as loaded, one query took
// 22.7-22.8 ms at mainnet on the H100 against 22.1 so (docs/SCANS.md).
// v1f_xor_rows is the lane's uint4 of step 0 of the chunk at leaf0; step j is 4 j V1F_SLICE4 on.
#define V1F_SLICE4 (V1F_SLICE_WORDS / 4)  // uint4s from a slice of a chunk to the next
#define V1F_MULTIPLIER_BARRIER 4  // bar.sync id: the multipliers' own (their answers' reduction)
__device__ __forceinline__ const uint4* v1f_xor_rows(const u32* frags, long long leaf0, int warp, int lane) {
    return (const uint4*)v1f_chunk_words(frags, leaf0) + 8 * (4 * warp + (lane >> 3)) + (lane & 7);
}

// The lane's 8 independent 16-byte loads of one step (row_j: the lane's uint4 of it).
__device__ __forceinline__ void v1f_xor_load(uint4 (&lo)[4], uint4 (&hi)[4], const uint4* row_j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo[i] = __ldg(row_j + i * V1F_SLICE4);
        hi[i] = __ldg(row_j + i * V1F_SLICE4 + 256);
    }
}

// Key k's A words of the lane's residue (a: its fragments) over pages 32 t .. of half 0 (ax: a0 of
// lane 4 k + t) and half 1 (az: its a2); volatile: loaded where written, each step.
__device__ __forceinline__ void v1f_xor_a(u32 (&ax)[4], u32 (&az)[4], const uint4* a, int k) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const volatile u32* w = (const volatile u32*)(a + 4 * k + t);
        ax[t] = w[0];
        az[t] = w[2];
    }
}

// Step j (mask m = 2^j) of keys 0 .. K - 1 from that step's rows: the lane's bit of answer word c
// of slice 4 j + i of key k goes to bit j of ans[i][k] (v1f_alu_run puts it in place once a run is
// done).
template <int K>
__device__ __forceinline__ void v1f_xor_bit(u32 (&ans)[4][K], const uint4 (&lo)[4], const uint4 (&hi)[4],
                                            const uint4* a, u32 m) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
        u32 x4[4], z4[4];
        v1f_xor_a(x4, z4, a, k);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 x = (lo[i].x & x4[0]) ^ (lo[i].y & x4[1]) ^ (lo[i].z & x4[2]) ^ (lo[i].w & x4[3]) ^
                          (hi[i].x & z4[0]) ^ (hi[i].y & z4[1]) ^ (hi[i].z & z4[2]) ^ (hi[i].w & z4[3]);
            ans[i][k] ^= ((u32)__popc(x) * m) & m;  // the count's low bit to bit j
        }
    }
}

// Multiplier warp `warp`'s share of one chunk on the ALU, for keys 0 .. K - 1 of the group. Loads
// run one step ahead of the arithmetic (two sets of rows, taking turns), and the last step's turn
// loads the next chunk's first (`next`, null for none) before the barriers between chunks: with one
// step's loads in flight only while it waited for them, a warp left the memory idle through its
// arithmetic and through each chunk's barriers. On entry lo/hi hold step 0 of `rows`.
// Each lane also asks L2 for one of the 32 lines of step j + V1F_XOR_PREFETCH (of `next` past
// step 31): its row, slice 4 j + lane % 4, half (lane / 4) % 2, marked to be evicted last: plain
// prefetches were pushed out by the lines already read before their loads came (measured at
// mainnet on the H100, docs/SCANS.md: further ahead was slower, 23.9 ms at 3 steps and, by the
// bulk engine, 26.3 at 4 and 37.9 at 8, against 22.7 at 2). Variants to time: 0 (none), another
// distance.
#ifndef V1F_XOR_PREFETCH
#define V1F_XOR_PREFETCH 2
#endif

__device__ __forceinline__ void v1f_xor_prefetch(const uint4* rows, const uint4* next, int j, int pf_lane) {
#if V1F_XOR_PREFETCH > 0
    const int step = j + V1F_XOR_PREFETCH;
    const uint4* base = step < 32 ? rows + 4 * step * V1F_SLICE4 : (next != 0 ? next + 4 * (step - 32) * V1F_SLICE4 : 0);
    if (base != 0) prefetch_l2_last(base + pf_lane);
#endif
}

template <int K>
__device__ __forceinline__ void v1f_xor_scan(u32 (&ans)[4][K], uint4 (&lo)[4], uint4 (&hi)[4], const uint4* a,
                                             const uint4* rows, const uint4* next, int lane) {
    static_assert(K >= 1 && K <= 8, "keys 0 .. 7 of a group: their A words are a fragment's .x and .z");
    static_assert(V1F_XOR_PREFETCH >= 0 && V1F_XOR_PREFETCH <= 32, "at most a chunk ahead");
    // the lane's prefetch line of a step, from its own uint4: slice lane % 4 of the step's 4, half (lane / 4) % 2
    const int pf_lane = -(lane & 7) + (lane & 3) * V1F_SLICE4 + 256 * ((lane >> 2) & 1);
    // step j's mask, carried from step to step (never 1 << j: the compiler would make the product a shift)
    u32 m = 1u;
#pragma unroll 1
    for (int j = 0; j < 32; j += 2) {
        const uint4* at = rows + 4 * j * V1F_SLICE4;
        uint4 lo1[4], hi1[4];
        v1f_xor_load(lo1, hi1, at + 4 * V1F_SLICE4);
        v1f_xor_prefetch(rows, next, j, pf_lane);
        v1f_xor_prefetch(rows, next, j + 1, pf_lane);
        v1f_xor_bit<K>(ans, lo, hi, a, m);
        const uint4* after = j + 2 < 32 ? at + 8 * V1F_SLICE4 : next;
        if (after != 0) v1f_xor_load(lo, hi, after);
        v1f_xor_bit<K>(ans, lo1, hi1, a, m << 1);
        m <<= 2;
    }
    if (next != 0) named_barrier_arrive(V1F_AFRAG_FREE, V1_FRAG_THREADS);  // afrag read
}

// The multipliers' side of a launch of at most K keys on the ALU: chunk by chunk as the producers
// hand them over, then the answers to the output. red: shared memory the producers are done with
// once they hand over a run's last chunk (4 KiB a key). Not inlined (one call a block): inlined,
// the kernel's one register allocation spilled a word of the tensor-core path's.
template <int K>
__device__ __noinline__ void v1f_alu_run(const uint4* afrag, u32* red, const u32* frags, int c,
                                            long long chunk_begin, long long chunk_end, int num_keys, int warp,
                                            int lane, u64* out) {
    u32 ans[4][K];
#pragma unroll
    for (int i = 0; i < 4 * K; ++i) (&ans[0][0])[i] = 0u;
    // the lane's A fragments: residue 32 (c % 4) + 4 W + r
    const uint4* a = afrag + v1f_afrag_index(32 * (lane & 3) + 4 * warp + (lane >> 3), 0);
    uint4 lo[4], hi[4];  // the rows of the step to multiply next
    if (chunk_begin < chunk_end) v1f_xor_load(lo, hi, v1f_xor_rows(frags, chunk_begin << c, warp, lane));
    for (long long chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        const bool more = chunk + 1 < chunk_end;
        named_barrier(V1F_AFRAG_READY, V1_FRAG_THREADS);  // chunk's A fragments are in place
        v1f_xor_scan<K>(ans, lo, hi, a, v1f_xor_rows(frags, chunk << c, warp, lane),
                        more ? v1f_xor_rows(frags, (chunk + 1) << c, warp, lane) : (const uint4*)0, lane);
    }
    // Bit j of ans[i][k] in lane (r, c) of warp W is bit 4 W + r of word c of slice 4 j + i. The 4
    // lanes of a c gather nibbles: lane (q, c) takes j = 8 q + t (t = 0..7) of each, nibble t of its
    // word holding the 4 lanes' bits (r = 0..3); the 8 warps' nibbles of a word (bits 4 W ..) meet
    // in red by shared-memory XOR, [key][slice][word] (v1f_xor_rows's 128 slices x 8 words).
    static_assert(V1F_L * V1_FRAG_GROUP_KEYS * 16 >= K * PAGE_WORDS * 4, "red fits in big");
    const int tid = 32 * warp + lane, r = lane >> 3;
    for (int w = tid; w < K * PAGE_WORDS; w += V1F_TEAM) red[w] = 0u;
    named_barrier(V1F_MULTIPLIER_BARRIER, V1F_TEAM);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                // bits 8 q .. 8 q + 7 of the lane's word, spread to bits 4 t, then moved to 4 t + r
                u32 v = (ans[i][k] >> (8 * q)) & 0xFFu;
                v = (v | (v << 12)) & 0x000F000Fu;
                v = (v | (v << 6)) & 0x03030303u;
                v = (v | (v << 3)) & 0x11111111u;
                v <<= r;
                v ^= __shfl_xor_sync(0xFFFFFFFFu, v, 8);
                v ^= __shfl_xor_sync(0xFFFFFFFFu, v, 16);
                if (r == q) {
#pragma unroll
                    for (int t = 0; t < 8; ++t) {
                        const u32 nibble = (v >> (4 * t)) & 0xFu;
                        if (nibble)
                            atomicXor(&red[k * PAGE_WORDS + (4 * (8 * q + t) + i) * MMA_SLICE_WORDS + (lane & 7)],
                                      nibble << (4 * warp));
                    }
                }
            }
    named_barrier(V1F_MULTIPLIER_BARRIER, V1F_TEAM);
    u32* out32 = (u32*)out;
    for (int w = tid; w < num_keys * PAGE_WORDS; w += V1F_TEAM)
        if (red[w]) atomicXor(&out32[w], red[w]);
}

// dpf_scan_v1_frag's shared memory: dpf_scan's regions (cuda_plan.SCAN_SHARED_REGIONS), sized for
// V1F_L leaves whatever c, then the A fragments of the chunk being multiplied (128 residues x 32
// lanes, padded: v1f_afrag_index, cuda_plan.V1_FRAG_AFRAG_BYTES), then the nodes of chunk level
// V1_FRAG_TOP_LEVELS of V1_FRAG_TOP_CHUNKS chunks (v1f_expand_tops; cuda_plan.V1_FRAG_TOPS_BYTES).
struct V1fShared {
    uint4 *big, *half, *cw_seed, *final_cw, *afrag;
    u8 *big_t, *half_t, *cw_t;
};

#define V1F_TOP_NODES (V1_FRAG_TOP_CHUNKS << V1_FRAG_TOP_LEVELS)  // nodes a key in tops
static_assert(V1F_TOP_NODES == V1_FRAG_TOP_NODES, "tops as the host sized it (cuda_plan.V1_FRAG_TOPS_BYTES)");
static_assert(V1_FRAG_TOP_CHUNKS << (V1_FRAG_TOP_LEVELS - 1) <= V1F_L / 2,
              "a batch's last level fits half, its scratch");

template <int G>
__device__ __forceinline__ V1fShared v1f_shared(uint4* smem) {
    static_assert((V1F_L + V1F_L / 2 + V1_FRAG_CHUNK_LEVELS) * G % 16 == 0, "afrag starts 16-byte aligned");
    uint4* big = smem;
    uint4* half = big + V1F_L * G;
    uint4* cw_seed = half + (V1F_L / 2) * G;
    uint4* final_cw = cw_seed + V1_FRAG_CHUNK_LEVELS * G;
    u8* big_t = (u8*)(final_cw + G);
    u8* half_t = big_t + V1F_L * G;
    u8* cw_t = half_t + (V1F_L / 2) * G;
    uint4* afrag = (uint4*)(cw_t + V1_FRAG_CHUNK_LEVELS * G);
    return {big, half, cw_seed, final_cw, afrag, big_t, half_t, cw_t};
}

// tops (seeds, [node * G + key]) and its t bits, after the A fragments: found from afrag where
// used, not carried in V1fShared (two more pointers live beside the multipliers' accumulators
// made them spill)
struct V1fTops {
    uint4* seed;
    u8* t;
};

template <int G>
__device__ __forceinline__ V1fTops v1f_tops(const V1fShared& sh) {
    uint4* seed = sh.afrag + 128 * V1_FRAG_AFRAG_ROW + 4;
    return {seed, (u8*)(seed + V1F_TOP_NODES * G)};
}

// Chunk levels 0 .. V1_FRAG_TOP_LEVELS - 1 of chunks chunk0 .. chunk0 + nb - 1 (nb <=
// V1_FRAG_TOP_CHUNKS) expanded together, as one forest, into tops (chunk b's nodes of level
// V1_FRAG_TOP_LEVELS at [(b 2^V1_FRAG_TOP_LEVELS + j) * G + key]), half and big the scratch. A
// chunk's first levels have 1 to 4 nodes a key, 12 to 48 items for 12 keys: alone, each level was
// one ChaCha8 chain with most producers idle at its barrier (the first six levels a third of the
// producers' time at Q = 8, docs/SCANS.md); 8 chunks at once make them 96, 192 and 384 items for
// the 256 producers (12 keys). The children of
// node i of a level are nodes 2i and 2i + 1 of the next, so the forest's nodes, chunk by chunk,
// expand as one tree's level does.
template <int G>
__device__ __forceinline__ void v1f_expand_tops(const V1fShared& sh, long long num_pages, int c, long long chunk0,
                                                int nb, int depth_top, const u32* keyrec, int krec, int key0,
                                                const uint4* root_seed, const u8* root_t, long long root_stride,
                                                LiveKeys keys, Team team) {
    const V1fTops tops = v1f_tops<G>(sh);
    for (int idx = team.tid; idx < nb * keys.live; idx += team.size) {  // the chunks' roots, [b * G + key]
        const int at = live_slot<G>(idx, keys);  // where depth_top is 0 the chunk is the tree, and nb is 1
        load_chunk_root(sh.half, sh.half_t, at, key0 + at % G, chunk0 + at / G, depth_top, keyrec, krec, root_seed,
                        root_t, root_stride);
    }
    team_sync(team);
    for (int l = 0; l < V1_FRAG_TOP_LEVELS; ++l) {
        // live parents: the nb chunks' 2^l nodes each, but the tree's last chunk's past num_pages
        const int n_par = (int)min((long long)nb << l, live_nodes(num_pages, c - l) - (chunk0 << l));
        const bool from_half = (l & 1) == 0, last = l == V1_FRAG_TOP_LEVELS - 1;
        expand_level<G>(from_half ? sh.half : sh.big, from_half ? sh.half_t : sh.big_t,
                        last ? tops.seed : from_half ? sh.big : sh.half, last ? tops.t : from_half ? sh.big_t : sh.half_t,
                        n_par, &sh.cw_seed[l * G], &sh.cw_t[l * G], (const uint4*)0, keys, team);
        team_sync(team);
    }
}

// The rest of chunk b of its v1f_expand_tops batch: its nodes of level V1_FRAG_TOP_LEVELS copied
// from tops to where that level's parents sit (expand_levels), then levels V1_FRAG_TOP_LEVELS ..
// c - 1 (n_leaves of its leaves live): the leaves land in big as masks.
template <int G>
__device__ __forceinline__ void v1f_expand_rest(const V1fShared& sh, int c, int b, int n_leaves, LiveKeys keys,
                                                Team team) {
    const V1fTops tops = v1f_tops<G>(sh);
    constexpr int from = V1_FRAG_TOP_LEVELS;
    const bool in_big = ((c - 1 - from) & 1) != 0;  // level `from` reads big where c - 1 - from is odd
    uint4* in = in_big ? sh.big : sh.half;
    u8* in_t = in_big ? sh.big_t : sh.half_t;
    const int n_in = ((n_leaves + (1 << (c - from)) - 1) >> (c - from)) * G;
    for (int i = team.tid; i < n_in; i += team.size) {
        in[i] = tops.seed[b * (1 << from) * G + i];
        in_t[i] = tops.t[b * (1 << from) * G + i];
    }
    team_sync(team);
    expand_levels<G>(from, c, n_leaves, sh.big, sh.half, sh.big_t, sh.half_t, sh.cw_seed, sh.cw_t, sh.final_cw, keys,
                     team);
}

// Key group `group`'s keys: the batch's keys split evenly over the groups (their sizes differ by
// one at most), so the blocks of a run expand about as many trees each and keep pace (with the
// last group short, 24 keys as 16 + 8, its blocks ran ahead of the others, which then found their
// rows gone from L2). Keys key0 .. key0 + live - 1; the rows of the group's tile past live
// (another group's keys, or past the batch's) are neither expanded nor written out.
struct V1fGroup {
    int key0, live;
};

__device__ __forceinline__ V1fGroup v1f_group(int group, int num_groups, int num_keys) {
    const int per_group = num_keys / num_groups, extra = num_keys % num_groups;
    return {group * per_group + min(group, extra), per_group + (group < extra ? 1 : 0)};
}

// The producers' side of a run (threads V1F_TEAM.. of the block): each chunk's tree expanded,
// then, once the multipliers are done with the previous chunk's A fragments (hand.wait_free(i),
// from the run's second chunk i = 1 on), turned into its A fragments, which are handed over
// (hand.ready(i)). Hand: the two teams' barriers of one block (V1fBlockHandover) or of a
// cluster's pair of blocks (dpf_scan_v1_pair's). Regs: the registers a producer thread gives up
// to (setmaxnreg, what the multipliers take), or 0 to keep the block's.
template <int G, int Regs, class Hand>
__device__ __forceinline__ void v1f_produce(const V1fShared& sh, long long num_pages, int c, int depth_top,
                                            const u32* keyrec, int krec, V1fGroup grp, const uint4* root_seed,
                                            const u8* root_t, long long root_stride, long long chunk_begin,
                                            long long chunk_end, Hand hand) {
    if (Regs > 0) setmaxnreg_dec<Regs>();
    // the tile's rows past live are not expanded: their A rows are stale masks, their answers not written
    const LiveKeys keys = live_keys(grp.live);
    const Team producers = {(int)threadIdx.x - V1F_TEAM, V1F_TEAM, V1F_PRODUCER_BARRIER};
    // chunks of more levels than the batched ones: their first levels V1_FRAG_TOP_CHUNKS at a time
    // (each chunk's alone measured 4-6% slower at mainnet)
    const bool batched = c > V1_FRAG_TOP_LEVELS;
    for (long long chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        const int n_leaves = (int)min((long long)(1 << c), num_pages - (chunk << c));
        const int i = (int)(chunk - chunk_begin);
        if (batched) {
            const int b = i % V1_FRAG_TOP_CHUNKS;
            if (b == 0)  // big and half are free: the chunk before's transposes are done
                v1f_expand_tops<G>(sh, num_pages, c, chunk, (int)min((long long)V1_FRAG_TOP_CHUNKS, chunk_end - chunk),
                                   depth_top, keyrec, krec, grp.key0, root_seed, root_t, root_stride, keys, producers);
            v1f_expand_rest<G>(sh, c, b, n_leaves, keys, producers);
        } else {
            expand_chunk<G>(c, chunk, n_leaves, depth_top, keyrec, krec, grp.key0, root_seed, root_t, root_stride,
                            sh.big, sh.half, sh.big_t, sh.half_t, sh.cw_seed, sh.cw_t, sh.final_cw, keys, producers);
        }
        if (i > 0) hand.wait_free(i);  // chunk - 1's A fragments read
        v1f_make_afrag<G>(sh.afrag, sh.big, producers.tid, n_leaves, keys);
        hand.ready(i);                // chunk's A fragments are in place
        team_sync(producers);  // every producer has read big before the next chunk's tree overwrites it
    }
}

// One block's teams meeting at named barriers V1F_AFRAG_READY and V1F_AFRAG_FREE
struct V1fBlockHandover {
    __device__ __forceinline__ void wait_free(int) const { named_barrier(V1F_AFRAG_FREE, V1_FRAG_THREADS); }
    __device__ __forceinline__ void ready(int) const { named_barrier_arrive(V1F_AFRAG_READY, V1_FRAG_THREADS); }
};

// A lane's answer bits of a tile: lo holds bits 0-15 of word `word` (low half) and of word + 4
// (high half), hi their bits 16-31; XORed into key `key`'s answer where any is set.
__device__ __forceinline__ void v1f_xor_answer(u32* out32, int key, int word, u32 lo, u32 hi) {
    const u32 words[2] = {(lo & 0xFFFFu) | (hi << 16), (lo >> 16) | (hi & 0xFFFF0000u)};
#pragma unroll
    for (int wh = 0; wh < 2; ++wh)
        if (words[wh]) atomicXor(&out32[(long long)key * PAGE_WORDS + word + 4 * wh], words[wh]);
}

template <int G>
__global__ void __launch_bounds__(V1_FRAG_THREADS, 1)
dpf_scan_v1_frag(const u32* __restrict__ frags, long long num_pages, int domain_bits, int chunk_levels,
                 const u32* __restrict__ keyrec, int krec, int num_keys,
                 const uint4* __restrict__ root_seed, const u8* __restrict__ root_t, long long root_stride,
                 int num_groups, int chunks_per_block, u64* __restrict__ out) {
    static_assert(G == 16, "a key group is one m16 tile");
    static_assert(V1F_L == 256, "a chunk is one mma k-step of 256 pages");
    static_assert(V1F_TEAM == 256 && MMA_SLICE_WORDS == 8 && PAGE_WORDS / MMA_SLICE_WORDS == 128,
                  "8 multiplier warps of 16 slices");
    if (blockDim.x != V1_FRAG_THREADS) __trap();  // fewer and the teams' barriers would never open
    extern __shared__ uint4 smem[];
    const int c = chunk_levels;  // 8, or the whole tree (one chunk) where domain_bits < 8
    const V1fShared sh = v1f_shared<G>(smem);
    const uint4* afrag = sh.afrag;
    const long long run = blockIdx.x / num_groups;
    const V1fGroup grp = v1f_group(blockIdx.x % num_groups, num_groups, num_keys);
    const long long num_chunks = live_nodes(num_pages, c);
    const long long chunk_begin = run * chunks_per_block;
    const long long chunk_end = min(num_chunks, chunk_begin + chunks_per_block);

    load_chunk_cw<G>(keyrec, krec, grp.key0, domain_bits, c, sh.cw_seed, sh.cw_t, sh.final_cw);
    __syncthreads();  // the corrections, loaded by the whole block, are read by the producers alone

    // The teams run apart from here, meeting at barriers V1F_AFRAG_READY and V1F_AFRAG_FREE once
    // a chunk each (FREE not after a run's last), each team its own loop (so the multipliers' 64
    // accumulators are not live while the producers expand).
    if (threadIdx.x >= V1F_TEAM) {
        v1f_produce<G, V1F_ROWS_IN_FLIGHT == 2 ? V1F_PRODUCER_REGS : 0>(
            sh, num_pages, c, domain_bits - c, keyrec, krec, grp, root_seed, root_t, root_stride, chunk_begin,
            chunk_end, V1fBlockHandover());
        return;
    }
    if (V1F_ROWS_IN_FLIGHT == 2) setmaxnreg_inc<V1F_MULTIPLIER_REGS>();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if V1_FRAG_ALU_KEYS > 0
    if (num_keys <= V1_FRAG_ALU_KEYS) {  // one group (cuda_plan: V1_FRAG_ALU_KEYS <= 16 keys), key0 0
        if (num_keys <= V1F_ALU_FEW_KEYS) {
            v1f_alu_run<V1F_ALU_FEW_KEYS>(afrag, (u32*)sh.big, frags, c, chunk_begin, chunk_end, num_keys, warp, lane,
                                           out);
        } else {
            v1f_alu_run<V1_FRAG_ALU_KEYS>(afrag, (u32*)sh.big, frags, c, chunk_begin, chunk_end, num_keys, warp, lane,
                                           out);
        }
        return;
    }
#endif
    // [key g, g + 8][bit half h][c][column tile j]: bit 16h + s of word c in bit s, of word c + 4 in bit 16 + s
    u32 acc[2][2][4][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) (&acc[0][0][0][0])[i] = 0u;
    const bool prefetch = V1F_PREFETCH_ROWS > 0 && num_groups >= V1F_PREFETCH_MIN_GROUPS;
#if V1F_PREFETCH_ROWS > 0
    if (prefetch && chunk_begin < chunk_end) {  // the first chunk's first rows, while the producers expand it
        const u32* first = v1f_chunk_words(frags, chunk_begin << c) + v1f_prefetch_line(warp, lane);
        for (int b = 0; b < V1F_PREFETCH_ROWS; ++b) prefetch_l2(first + b * 32);
    }
#endif
    for (long long chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        named_barrier(V1F_AFRAG_READY, V1_FRAG_THREADS);  // chunk's A fragments are in place
        if (V1F_ROWS_IN_FLIGHT == 2)
            v1f_multiply2(acc, afrag, frags, chunk << c, chunk + 1 < chunk_end ? (chunk + 1) << c : -1, prefetch,
                          warp, lane);
        else
            v1f_multiply(acc, afrag, frags, chunk << c, chunk + 1 < chunk_end ? (chunk + 1) << c : -1, prefetch,
                         warp, lane);
        if (chunk + 1 < chunk_end) named_barrier_arrive(V1F_AFRAG_FREE, V1_FRAG_THREADS);  // afrag may be overwritten
    }
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
        for (int cq = 0; cq < 4; ++cq)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (g + 8 * kh < grp.live)
                    v1f_xor_answer((u32*)out, grp.key0 + g + 8 * kh, (16 * warp + 4 * j + t) * MMA_SLICE_WORDS + cq,
                                   acc[kh][0][cq][j], acc[kh][1][cq][j]);
}

// v1 keys over the fragments layout, two key groups a thread-block cluster (sm_90; the host
// launches it where a batch has an even number of groups, dpf_scan_v1_frag otherwise). Blocks
// 2p and 2p + 1 of a run (groups 2p, 2p + 1) form a cluster of two; each block's producers expand
// and transpose its own group's trees as dpf_scan_v1_frag's do, but its multipliers multiply
// half of each chunk's slices (the block of cluster rank r: 64 r .. 64 r + 63) by the A fragments
// of both groups, the peer's read from the peer's shared memory. L2 so serves a chunk once a pair
// of groups instead of once a group: dpf_scan_v1_frag's multipliers at two groups were bound by
// the B loads, about 5 TB/s from L2 (docs/SCANS.md). Multiplier warp W multiplies residues 32 cq
// .. 32 cq + 31 (cq = W % 4) of slices 64 r + 32 (W / 4) .. + 31, 8 column tiles of 4 slices a
// row, each by both tiles of A: 16 products a row, as dpf_scan_v1_frag's warps, with half the
// loads. The hand-over spans the pair: each block's `ready` mbarrier counts both blocks'
// producers (their A fragments for the chunk are in place), its `freed` both blocks' multipliers
// (they are done reading this block's A fragments), every thread arriving on both blocks'
// barriers, released and acquired at cluster scope.
#if HAS_CLUSTERS
#define V1P_CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
#define V1P_CLUSTER_DIMS
#endif

#if HAS_CLUSTERS
// A pair's barriers as one team sees them: this block's (cta addresses, to wait on) and both
// blocks' (cluster addresses, to arrive on)
struct V1pHandover {
    u32 at, rank;  // the barrier's shared-memory address (the same in both blocks), this block's rank
    __device__ __forceinline__ void wait(int i) const { mbarrier_wait_cluster(at, i & 1); }
    // (the cluster addresses made at each arrival: kept in registers, two of them spilled beside
    // the multipliers' accumulators)
    __device__ __forceinline__ void arrive() const {
        mbarrier_arrive_cluster(cluster_address(at, rank));
        mbarrier_arrive_cluster(cluster_address(at, rank ^ 1));
    }
};

// The producers' side: wait on this block's `freed`, arrive on both blocks' `ready`
struct V1pProducerHandover {
    V1pHandover freed, readied;
    __device__ __forceinline__ void wait_free(int i) const { freed.wait(i - 1); }
    __device__ __forceinline__ void ready(int) const { readied.arrive(); }
};

// Rows of B words a pair's multiplier warp keeps in flight (1, 2 or 4): row b + V1P_ROWS - 1's
// loaded before row b's products (a row is 16 registers, the accumulators 64), and registers a
// multiplier thread takes by setmaxnreg (sm_90a; the producers the rest, as in dpf_scan_v1_frag).
// Measured on the H100 at mainnet (docs/SCANS.md): Q = 8 28.0 ms with 4 rows and 184 registers,
// 28.7 with 4 and 176, 28.7 with 2 and 176; 2 rows and 168 registers spilled and took 28.4-33.6.
// Elsewhere (no setmaxnreg: 128 registers a thread) 1 row, which does not spill (2 do). Variant
// to time: -DV1P_ROWS=n (the CPU emulator runs each).
#ifndef V1P_ROWS
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define V1P_ROWS 4
#else
#define V1P_ROWS 1
#endif
#endif
#define V1P_MULTIPLIER_REGS 184
static_assert(V1P_ROWS == 1 || V1P_ROWS == 2 || V1P_ROWS == 4, "rows in flight divide 16, and 8 (128 registers) spill");
static_assert(V1P_MULTIPLIER_REGS % 8 == 0 && V1P_MULTIPLIER_REGS >= 128 && V1P_MULTIPLIER_REGS <= 232,
              "setmaxnreg: a multiple of 8, no fewer than the 128 a thread starts with, 24 left a producer");

// Row b's B words of a pair's multiplier lane (b_at: its first B word of the chunk): [column tile j][half]
__device__ __forceinline__ void v1p_load_row(u32 (&w)[8][2], const u32* b_at, int b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32* p = b_at + 4 * j * V1F_SLICE_WORDS + b * 32;
        w[j][0] = __ldg(p);
        w[j][1] = __ldg(p + 32 * 32);
    }
}

// Row b's 16 products, 8 column tiles by this block's A fragments (own_at: the lane's of residue
// 32 cq) and the peer's (peer_at, its cluster address), and their fold
__device__ __forceinline__ void v1p_row_products(u32 (&acc)[2][2][2][8], const uint4* own_at, u32 peer_at,
                                                 const u32 (&w)[8][2], int h, int b, const V1fFold& fold) {
    const uint4 a[2] = {own_at[b * V1_FRAG_AFRAG_ROW], ld_cluster_v4(peer_at + b * V1_FRAG_AFRAG_ROW * 16)};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            int d[4] = {0, 0, 0, 0};
            mma_and_popc(d, a[u].x, a[u].y, a[u].z, a[u].w, w[j][0], w[j][1]);
            fold(acc[u][0][h][j], acc[u][1][h][j], d);
        }
}

// A pair's multiplier warp over one chunk, V1P_ROWS rows in flight
__device__ __forceinline__ void v1p_multiply(u32 (&acc)[2][2][2][8], const uint4* own_at, u32 peer_at,
                                             const u32* b_at) {
    u32 w[V1P_ROWS][8][2];
#pragma unroll
    for (int r = 0; r + 1 < V1P_ROWS; ++r) v1p_load_row(w[r], b_at, r);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        V1fFold fold;
#pragma unroll 1
        for (int s = 0; s < 16; s += V1P_ROWS) {
#pragma unroll
            for (int r = 0; r < V1P_ROWS; ++r) {
                const int b = 16 * h + s + r, ahead = b + V1P_ROWS - 1;
                if (ahead < 32) v1p_load_row(w[(r + V1P_ROWS - 1) % V1P_ROWS], b_at, ahead);
                v1p_row_products(acc, own_at, peer_at, w[r], h, b, fold);
                fold.next();
            }
        }
    }
}
#endif

template <int G>
__global__ void V1P_CLUSTER_DIMS __launch_bounds__(V1_FRAG_THREADS, 1)
dpf_scan_v1_pair(const u32* __restrict__ frags, long long num_pages, int domain_bits, int chunk_levels,
                 const u32* __restrict__ keyrec, int krec, int num_keys,
                 const uint4* __restrict__ root_seed, const u8* __restrict__ root_t, long long root_stride,
                 int num_groups, int chunks_per_block, u64* __restrict__ out) {
#if HAS_CLUSTERS
    static_assert(G == 16 && V1F_L == 256 && V1F_TEAM == 256 && PAGE_WORDS / MMA_SLICE_WORDS == 128,
                  "8 multiplier warps a block, each 32 slices of one residue quarter");
    if (blockDim.x != V1_FRAG_THREADS || num_groups % 2 != 0) __trap();
    extern __shared__ uint4 smem[];
    __shared__ __align__(8) unsigned long long ready_bar, freed_bar;
    const int c = chunk_levels;
    const V1fShared sh = v1f_shared<G>(smem);
    const u32 rank = cluster_rank();
    const long long run = blockIdx.x / num_groups;
    const int group = blockIdx.x % num_groups;  // rank == group % 2: a cluster is groups 2p, 2p + 1 of a run
    const V1fGroup grp = v1f_group(group, num_groups, num_keys), peer = v1f_group(group ^ 1, num_groups, num_keys);
    const long long num_chunks = live_nodes(num_pages, c);
    const long long chunk_begin = run * chunks_per_block;
    const long long chunk_end = min(num_chunks, chunk_begin + chunks_per_block);

    load_chunk_cw<G>(keyrec, krec, grp.key0, domain_bits, c, sh.cw_seed, sh.cw_t, sh.final_cw);
    if (threadIdx.x == 0) {
        mbarrier_init(shared_address(&ready_bar), 2 * V1F_TEAM);
        mbarrier_init(shared_address(&freed_bar), 2 * V1F_TEAM);
        fence_mbarrier_init();
    }
    __syncthreads();  // the corrections are in place
    cluster_sync();   // both blocks' barriers exist before either block arrives on the other's
    const u32 ready_at = shared_address(&ready_bar), freed_at = shared_address(&freed_bar);
    const V1pHandover ready = {ready_at, rank}, freed = {freed_at, rank};

    if (threadIdx.x >= V1F_TEAM) {
        v1f_produce<G, 2 * 128 - V1P_MULTIPLIER_REGS>(sh, num_pages, c, domain_bits - c, keyrec, krec, grp,
                                                      root_seed, root_t, root_stride, chunk_begin, chunk_end,
                                                      V1pProducerHandover{freed, ready});
    } else {
        setmaxnreg_inc<V1P_MULTIPLIER_REGS>();  // (sm_90a; elsewhere a no-op, as the producers' setmaxnreg_dec)
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int cq = warp & 3, slice0 = 64 * (int)rank + 32 * (warp >> 2);
        // the lane's A fragment of residue 32 cq (row b: + b V1_FRAG_AFRAG_ROW), here and in the peer
        const uint4* own_at = sh.afrag + v1f_afrag_index(32 * cq, lane);
        const u32 peer_at = cluster_address(shared_address(own_at), rank ^ 1);
        // [own tile, peer's][key g, g + 8][bit half h][column tile j], as dpf_scan_v1_frag's acc[..][c][j]
        u32 acc[2][2][2][8];
#pragma unroll
        for (int i = 0; i < 64; ++i) (&acc[0][0][0][0])[i] = 0u;
        for (long long chunk = chunk_begin; chunk < chunk_end; ++chunk) {
            const int i = (int)(chunk - chunk_begin);
            ready.wait(i);  // both blocks' A fragments of the chunk are in place
            // lane (g, t) reads B column g of a tile: slice slice0 + 4 j + g / 2, word cq + 4 (g % 2)
            const u32* b_at = v1f_chunk_words(frags, chunk << c) + (long long)(slice0 + (g >> 1)) * V1F_SLICE_WORDS
                              + fragment_offset(t, cq + 4 * (g & 1));
            v1p_multiply(acc, own_at, peer_at, b_at);
            if (chunk + 1 < chunk_end) freed.arrive();  // both blocks' A fragments may be overwritten
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const V1fGroup tile = u == 0 ? grp : peer;
#pragma unroll
            for (int kh = 0; kh < 2; ++kh)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (g + 8 * kh < tile.live)
                        v1f_xor_answer((u32*)out, tile.key0 + g + 8 * kh, (slice0 + 4 * j + t) * MMA_SLICE_WORDS + cq,
                                       acc[u][kh][0][j], acc[u][kh][1][j]);
        }
    }
    cluster_sync();  // neither block leaves while the other may still read its A fragments or arrive on its barriers
#endif
}

// v2 keys (docs/PROTOCOL.md section 3.1): a leaf of the tree selects among LEAF_PAGES (128)
// consecutive pages, one bit each, so the tree is 7 levels shallower and this kernel expands
// nothing: dpf_expand_top has written every leaf (seed and t at depth tree_depth; with tree_depth
// 0 the key's root is its only leaf and comes from the key record). Blocks are (run of leaves,
// key group) as in dpf_scan. Per leaf, G threads turn the leaf into its 128 selection bits
// (seed ^ final_cw where t is 1) in shared memory; then thread `col` owns 16-byte column `col` of
// each of the leaf's pages and, for every key, XORs the page's words in where the key's bit is 1
// (acc ^= v & -bit, on the ALU). Bits of pages past num_pages are never read.

// The 128 selection bits of one leaf of a v2 key (record rec): the leaf's seed (at `at` in the
// leaf arrays dpf_expand_top wrote), XORed with final_cw where its t is 1. With tree_depth 0 the
// key's root is its only leaf and comes from the record.
__device__ __forceinline__ uint4 leaf_selection(const u32* rec, int tree_depth, const uint4* leaf_seed,
                                                const u8* leaf_t, long long at) {
    uint4 seed;
    u32 t;
    if (tree_depth == 0) {
        seed = make_uint4(rec[KREC_ROOT], rec[KREC_ROOT + 1], rec[KREC_ROOT + 2], rec[KREC_ROOT + 3]);
        t = rec[KREC_ROOT_T];
    } else {
        seed = leaf_seed[at];
        t = leaf_t[at];
    }
    const uint4 fcw = make_uint4(rec[KREC_FINAL], rec[KREC_FINAL + 1], rec[KREC_FINAL + 2],
                                 rec[KREC_FINAL + 3]);
    return xor4(seed, and_mask(fcw, 0u - (t & 1u)));
}

// acc[j] ^= v where bit p of sel[j] is 1, for the G keys of one page column.
template <int G>
__device__ __forceinline__ void accumulate_selected(uint4 (&acc)[G], const uint4& v, const u32 (&sel)[G], int p) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const u32 on = 0u - ((sel[j] >> p) & 1u);
        acc[j].x ^= v.x & on;
        acc[j].y ^= v.y & on;
        acc[j].z ^= v.z & on;
        acc[j].w ^= v.w & on;
    }
}

template <int G>
__global__ void __launch_bounds__(SCAN_THREADS, SCAN_MIN_BLOCKS(G))
dpf_scan_bits(const uint4* __restrict__ pages, long long num_pages, int tree_depth,
              const u32* __restrict__ keyrec, int krec, int num_keys,
              const uint4* __restrict__ leaf_seed, const u8* __restrict__ leaf_t, long long leaf_stride,
              int num_groups, int leaves_per_block, u64* __restrict__ out) {
    __shared__ uint4 bits[G];  // the current leaf's 128 selection bits of each key

    const int group = blockIdx.x % num_groups;
    const long long run = blockIdx.x / num_groups;
    const int key0 = group * G;  // the host pads the last group to G keys (num_groups * G)
    const long long num_leaves = (num_pages + LEAF_PAGES - 1) / LEAF_PAGES;
    const long long leaf_begin = run * leaves_per_block;
    const long long leaf_end = min(num_leaves, leaf_begin + leaves_per_block);
    const int col = threadIdx.x;

    uint4 acc[G];
#pragma unroll
    for (int j = 0; j < G; ++j) acc[j] = make_uint4(0, 0, 0, 0);

    constexpr int U = SCAN_UNROLL(G);
    for (long long leaf = leaf_begin; leaf < leaf_end; ++leaf) {
        if (threadIdx.x < G) {
            const int key = key0 + threadIdx.x;
            bits[threadIdx.x] = leaf_selection(keyrec + (long long)key * krec, tree_depth, leaf_seed, leaf_t,
                                               key * leaf_stride + leaf);
        }
        __syncthreads();

        const long long page0 = leaf * LEAF_PAGES;
        const int n_pages = (int)min((long long)LEAF_PAGES, num_pages - page0);
        // 32 pages per selection word: word w of a leaf holds the bits of pages 32w .. 32w + 31
        for (int w = 0; w * 32 < n_pages; ++w) {
            u32 sel[G];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                const uint4 b = bits[j];
                sel[j] = w == 0 ? b.x : w == 1 ? b.y : w == 2 ? b.z : b.w;
            }
            scan_column<G, U>(acc, pages + (page0 + 32 * w) * SCAN_THREADS + col, min(32, n_pages - 32 * w),
                              [&](uint4 (&a)[G], const uint4& v, int p) { accumulate_selected<G>(a, v, sel, p); });
        }
        __syncthreads();  // the next leaf's bits overwrite these
    }
    flush_columns<G>(acc, out, key0, col);
}

// The 128 selection bits of leaf `leaf` of key `key` for the tensor-core scans: bits of pages past
// num_pages cleared, leaves past the last zero (those scans read whole chunks of leaves).
__device__ __forceinline__ uint4 leaf_bits_of(const u32* keyrec, int krec, int tree_depth, long long num_pages,
                                              const uint4* leaf_seed, const u8* leaf_t, long long leaf_stride,
                                              int key, long long leaf) {
    const long long page0 = leaf * LEAF_PAGES;
    if (page0 >= num_pages) return make_uint4(0, 0, 0, 0);
    const uint4 s = leaf_selection(keyrec + (long long)key * krec, tree_depth, leaf_seed, leaf_t,
                                   key * leaf_stride + leaf);
    const long long live = num_pages - page0;  // pages of this leaf that exist
    u32 w[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const long long keep = live - 32 * k;  // bit p of word k is page page0 + 32k + p
        if (keep <= 0) w[k] = 0;
        else if (keep < 32) w[k] &= (1u << keep) - 1u;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The selection bits of every (key, leaf) of a batch of v2 keys, for the tensor-core scans
// (dpf_scan_mma.cu): key-major, sel[key * padded_leaves + leaf] (group_keys 0: a thread a (key,
// leaf), the leaf fastest), or leaf-major in groups of group_keys keys,
// sel[(key / G * padded_leaves + leaf) * G + key % G] (the wgmma scan: a chunk's bits of a group
// are contiguous). Leaf-major, a block takes a tile of LEAF_BITS_TILE keys x LEAF_BITS_TILE leaves
// (cuda_plan.leaf_bits_grid) and turns it round in shared memory, so it reads each key's leaves and
// writes each leaf's keys as whole runs: with a thread a (key, leaf) its 16-byte stores fell a key
// group apart, 1.58 against 0.37 ms for 222 keys at mainnet on the H100 (docs/SCANS.md). num_keys
// is a multiple of LEAF_BITS_TILE there (whole key groups of 16T keys).
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
dpf_leaf_bits(const u32* __restrict__ keyrec, int krec, int num_keys, int tree_depth, long long num_pages,
              const uint4* __restrict__ leaf_seed, const u8* __restrict__ leaf_t, long long leaf_stride,
              long long padded_leaves, int group_keys, uint4* __restrict__ sel) {
    if (group_keys == 0) {
        const long long i = blockIdx.x * (long long)MMA_THREADS + threadIdx.x;
        if (i >= padded_leaves * num_keys) return;
        const int key = (int)(i / padded_leaves);
        const long long leaf = i - key * padded_leaves;
        sel[i] = leaf_bits_of(keyrec, krec, tree_depth, num_pages, leaf_seed, leaf_t, leaf_stride, key, leaf);
        return;
    }
    static_assert(LEAF_BITS_TILE * LEAF_BITS_TILE == MMA_THREADS, "a thread a (key, leaf) of the tile");
    __shared__ uint4 tile[LEAF_BITS_TILE][LEAF_BITS_TILE + 1];  // [leaf][key]; + 1: no bank conflicts
    const long long leaf_tiles = (padded_leaves + LEAF_BITS_TILE - 1) / LEAF_BITS_TILE;
    const int key0 = (int)(blockIdx.x / leaf_tiles) * LEAF_BITS_TILE;
    const long long leaf0 = (blockIdx.x % leaf_tiles) * LEAF_BITS_TILE;
    const int a = threadIdx.x / LEAF_BITS_TILE, b = threadIdx.x % LEAF_BITS_TILE;
    if (leaf0 + b < padded_leaves)  // read: key a, leaf b (a key's leaves are adjacent)
        tile[b][a] = leaf_bits_of(keyrec, krec, tree_depth, num_pages, leaf_seed, leaf_t, leaf_stride, key0 + a,
                                  leaf0 + b);
    __syncthreads();
    const int key = key0 + b;  // write: leaf a, key b (a leaf's keys of a group are adjacent)
    if (leaf0 + a < padded_leaves)
        sel[((long long)(key / group_keys) * padded_leaves + leaf0 + a) * group_keys + key % group_keys] = tile[a][b];
}

// Explicit instantiations: the group sizes the host may pick (cuda_plan.SCAN_GROUP_SIZES), of
// both scans. nvcc in CI compiles exactly these; NVRTC looks them up by name.
#define INSTANTIATE_SCAN(G)                                                                   \
    template __global__ void dpf_scan<G>(const uint4*, long long, int, int, const u32*, int, \
                                         int, const uint4*, const u8*, long long, int, int,   \
                                         u64*);                                               \
    template __global__ void dpf_scan_bits<G>(const uint4*, long long, int, const u32*, int, \
                                              int, const uint4*, const u8*, long long, int,   \
                                              int, u64*);
INSTANTIATE_SCAN(1)
INSTANTIATE_SCAN(2)
INSTANTIATE_SCAN(3)
INSTANTIATE_SCAN(4)
INSTANTIATE_SCAN(5)
INSTANTIATE_SCAN(6)
INSTANTIATE_SCAN(7)
INSTANTIATE_SCAN(8)
INSTANTIATE_SCAN(9)
INSTANTIATE_SCAN(10)
INSTANTIATE_SCAN(11)
INSTANTIATE_SCAN(12)
INSTANTIATE_SCAN(13)
INSTANTIATE_SCAN(14)
INSTANTIATE_SCAN(15)
INSTANTIATE_SCAN(16)
INSTANTIATE_SCAN(24)
INSTANTIATE_SCAN(32)
template __global__ void dpf_scan_v1_frag<V1_FRAG_GROUP_KEYS>(const u32*, long long, int, int, const u32*, int, int,
                                                              const uint4*, const u8*, long long, int, int, u64*);
template __global__ void dpf_scan_v1_pair<V1_FRAG_GROUP_KEYS>(const u32*, long long, int, int, const u32*, int, int,
                                                              const uint4*, const u8*, long long, int, int, u64*);
