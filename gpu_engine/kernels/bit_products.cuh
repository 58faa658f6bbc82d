// Bit-matrix helpers and the fragments layout's word order, shared by dpf_scan.cu and dpf_scan_mma.cu: cuda_module.kernel_source puts
// this text in front of each of them (NVRTC has no include path of ours; no headers either).

typedef unsigned int u32;

// Shared memory's own (32-bit) address of p, as mbarrier, bulk-copy and cluster instructions take it
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
    return a;
}

// Thread-block clusters, distributed shared memory and mbarriers: built for sm_90 on, and where
// the CPU emulator (tests/cuda_emulator, whose shim sets EMU_CLUSTERS) gives its own definitions
// of the helpers.
#ifndef EMU_CLUSTERS
#define EMU_CLUSTERS 0
#endif
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || EMU_CLUSTERS
#define HAS_CLUSTERS 1
#else
#define HAS_CLUSTERS 0
#endif

#if HAS_CLUSTERS
// Thread-block clusters (sm_90). Every thread of every block of the cluster; orders shared-memory
// writes and reads across it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// An mbarrier at bar (this block's) expecting `count` arrivals a phase, and the fence that makes
// the initialisation visible to the cluster's other blocks before they arrive on it
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Waits until the mbarrier at bar (this block's) has completed the phase of parity `parity`.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// The same, acquiring at cluster scope what the arrivals of other blocks released
__device__ __forceinline__ void mbarrier_wait_cluster(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// This block's rank in its cluster
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Address `local` (shared_address's) in the shared memory of the cluster's block `rank`
__device__ __forceinline__ u32 cluster_address(u32 local, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(local), "r"(rank));
    return a;
}

// One arrival on the mbarrier at `bar` (cluster_address's, any block's), releasing at cluster
// scope what this thread wrote and read before it
__device__ __forceinline__ void mbarrier_arrive_cluster(u32 bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

// 16 bytes of another block's shared memory (at cluster_address's address). Volatile: NVVM keeps
// volatile asm in its order, so it stays after the mbarrier wait (volatile too) whose acquire
// orders it, as dpf_scan_v1_pair's PTX shows; no memory clobber, which would also pin the global
// loads around it in place.
__device__ __forceinline__ uint4 ld_cluster_v4(u32 at) {
    uint4 v;
    asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at));
    return v;
}
#endif

// x[b] bit i <- x[i] bit b: a 32 x 32 bit transpose in registers (byte permutes for the 16- and
// 8-bit stages, masked swaps for the rest).
__device__ __forceinline__ void transpose32(u32 (&x)[32]) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const u32 a = x[k], b = x[k + 16];
        x[k] = __byte_perm(a, b, 0x5410);
        x[k + 16] = __byte_perm(a, b, 0x7632);
    }
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        if (k & 8) continue;
        const u32 a = x[k], b = x[k + 8];
        x[k] = __byte_perm(a, b, 0x6240);
        x[k + 8] = __byte_perm(a, b, 0x7351);
    }
#define SWAP_STAGE(J, M)                                      \
    _Pragma("unroll") for (int k = 0; k < 32; ++k) {          \
        if (k & J) continue;                                  \
        const u32 t = ((x[k] >> J) ^ x[k + J]) & M;           \
        x[k] ^= t << J;                                       \
        x[k + J] ^= t;                                        \
    }
    SWAP_STAGE(4, 0x0F0F0F0Fu)
    SWAP_STAGE(2, 0x33333333u)
    SWAP_STAGE(1, 0x55555555u)
#undef SWAP_STAGE
}

// Where thread (page group pg, word w) of a block puts its 32 fragment words in one chunk's B
// fragments, bfrag[kstep][half][n-block][lane] (register b at + 32 b): they hold bit b of word w
// of pages 32pg .. 32pg + 31 of the chunk, n-block b's fragment word of lane (g = w, t = pg % 4),
// half pg / 4 % 2 (b0: pages 0..127 of the k-step, b1: 128..255), k-step pg / 8. The resident
// "fragments" layout stores each (chunk, slice) in this order (pages_to_fragments, dpf_scan_mma.cu).
__device__ __forceinline__ int fragment_offset(int pg, int w) {
    const int ks = pg >> 3, half = (pg >> 2) & 1, t = pg & 3;
    return (ks * 2 + half) * 32 * 32 + w * 4 + t;
}

// d += A . B over GF(2) counts: a 16 x 256 bit tile (a0..a3) AND a 256 x 8 one (b0, b1), each
// product the popcount of the AND (mma.sync m16n8k256, sm_80 or later; where the module is built
// for an older GPU the host never launches a kernel that reaches it, and it traps).
__device__ __forceinline__ void mma_and_popc(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();
#else
    asm volatile(
        "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
