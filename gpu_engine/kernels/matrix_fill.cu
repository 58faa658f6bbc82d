// Pseudo-random pages generated in GPU memory, for benchmarks at sizes the host cannot feed
// quickly (the 68.9 GB mainnet shape). Word i of the matrix is a SplitMix64 hash of (seed, i),
// so any page can be recomputed on the host to check an answer.

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// words [first_pair * 2, (first_pair + num_pairs) * 2) of the matrix; one 64-bit hash per pair
extern "C" __global__ void fill_pages(u64* __restrict__ pairs, u64 first_pair, u64 num_pairs, u64 seed) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < num_pairs; i += stride) {
        pairs[i] = splitmix64(seed ^ (first_pair + i) * 0xd1342543de82ef95ull);
    }
}
