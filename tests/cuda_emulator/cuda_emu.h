// Just enough of CUDA for the scan kernels' text to run on a CPU (tests/cuda_emulator): a block's
// threads are OS threads, __syncthreads is a barrier among them, shared memory is the block's
// buffer, and mma.sync's b1 AND.POPC product is computed from its 32 lanes' fragments as the PTX
// ISA lays them out (m16n8k256: a0/a2 rows g, a1/a3 rows g + 8, k = 32t + i and 128 + 32t + i;
// b0/b1 column g, the same k; d0, d1 row g, columns 2t, 2t + 1; d2, d3 row g + 8). Thread-block
// clusters: a cluster's blocks run at once, each with its own shared memory, which the others
// read at its cluster addresses; mbarriers count arrivals in phases (bit_products.cuh's helpers).
#pragma once
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <cstdlib>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static  // static arrays only: `extern __shared__` is rewritten by the builder
#define __align__(n) alignas(n)
#define __cluster_dims__(...)
#define EMU_CLUSTERS 1  // bit_products.cuh's cluster helpers, as the builder rewrites them

struct uint4 {
    unsigned int x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
struct dim3 {
    unsigned int x, y, z;
};

extern thread_local dim3 threadIdx, blockIdx;  // a cluster's blocks run at once
extern dim3 blockDim, gridDim;
extern thread_local unsigned char* emu_dynamic_smem;  // the thread's block's

void __syncthreads();
// bar.sync id, threads: a barrier of `threads` threads of the block (id 1..15), made at its first use
void emu_named_barrier(int id, int threads);
// bar.arrive id, threads: counted in that barrier's phase, without waiting for it to fill
void emu_named_barrier_arrive(int id, int threads);
// cp.async.cg 16 bytes, commit_group, wait_group `pending` (emu_cp_async_landing says when copies land)
void emu_cp_async16(void* dst, const void* src);
void emu_cp_async_commit();
void emu_cp_async_wait(int pending);
// prefetch.global.L2: counted, and counted apart where it names an address outside the buffer the
// tests said the launch reads (emu_prefetch_range); inside it, the 128-byte lines prefetched and
// those __ldg loaded are marked, so a prefetch of a line the launch never loads shows
void emu_prefetch_l2(const void* p);
extern uintptr_t emu_watch_from;  // the buffer emu_prefetch_range named (0 bytes: none)
extern size_t emu_watch_bytes;
extern unsigned char* emu_loaded_lines;  // a byte a 128-byte line of it, from its start
// __shfl_xor_sync over the whole warp (every kernel that shuffles passes the full mask)
unsigned emu_shfl_xor(unsigned value, int lane_mask);
inline unsigned __shfl_xor_sync(unsigned mask, unsigned value, int lane_mask) {
    if (mask != 0xFFFFFFFFu) __builtin_trap();
    return emu_shfl_xor(value, lane_mask);
}
void emu_mma_and_popc(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1);
// Runs body() as every thread of every block of a grid gx x gy of `threads` threads, a cluster of
// `cluster` consecutive blocks (along x) at a time, each with `smem` bytes of dynamic shared memory
// (filled with a stale pattern, never zeros).
void emu_launch(unsigned gx, unsigned gy, unsigned threads, size_t smem, const std::function<void()>& body,
                unsigned cluster = 1);

// Clusters (bit_products.cuh's helpers as the builder rewrites them). A shared-memory address is
// its offset in the block's buffer; a cluster address, (rank + 1) << 24 | that offset (without
// rank bits: the thread's own block's).
unsigned emu_cluster_rank();
void emu_cluster_sync();
// The block's 8-byte static __shared__ word i (i < 4), kept past its dynamic shared memory, so it
// has an address there: a cluster's blocks run at once, and static arrays are process-wide here
unsigned long long& emu_block_word(int i);
void emu_mbarrier_init(unsigned bar, unsigned count);
void emu_mbarrier_arrive(unsigned cluster_bar);
void emu_mbarrier_wait(unsigned bar, unsigned parity);
uint4 emu_ld_cluster_v4(unsigned at);

// 16-byte global loads of a misaligned address (a GPU faults on them; x86 would not), counted
void emu_misaligned_load();
template <typename T>
inline T __ldg(const T* p) {
    if (sizeof(T) == 16 && ((unsigned long long)p & 15)) emu_misaligned_load();
    const uintptr_t off = (uintptr_t)p - emu_watch_from;  // wraps round below the buffer
    if (off < emu_watch_bytes) __atomic_store_n(&emu_loaded_lines[off >> 7], (unsigned char)1, __ATOMIC_RELAXED);
    return *p;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long min(int a, long long b) { return min((long long)a, b); }
inline long long min(long long a, int b) { return min(a, (long long)b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }

// the most significant 32 bits of hi:lo shifted left by shift & 31
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
    const unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)((v << (shift & 31)) >> 32);
}

// byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x (x the low four)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}

inline unsigned long long atomicXor(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED);
}
inline unsigned atomicXor(unsigned* p, unsigned v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }

[[noreturn]] inline void __trap() { __builtin_trap(); }
