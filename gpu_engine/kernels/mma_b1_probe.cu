// Throughput probe for 1-bit tensor-core products (AND + POPC), the operation a bit-transposed
// page scan would use: answer bit b of a key is the parity of sum_i page_i[b] AND mask_i[b % 128].
// Each warp keeps CHAINS independent m16n8k256 accumulators busy; nothing here reads memory.

typedef unsigned int u32;

#define CHAINS 8

extern "C" __global__ void __launch_bounds__(256)
mma_b1_probe(u32 seed, int iters, int* __restrict__ out) {
    const u32 a0 = seed ^ (threadIdx.x * 0x9e3779b9u), a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u;
    const u32 b0 = a0 * 11u, b1 = a0 * 13u;
    int d[CHAINS][4];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0;
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            asm volatile(
                "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
                "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
    int sum = 0;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) sum += d[c][0] ^ d[c][1] ^ d[c][2] ^ d[c][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
