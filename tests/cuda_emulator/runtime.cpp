// The emulator's runtime (tests/cuda_emulator): launches run one block at a time (the kernels'
// static __shared__ arrays are process-wide here), its threads as OS threads.
#include "cuda_emu.h"

thread_local dim3 threadIdx;
dim3 blockIdx, blockDim, gridDim;
unsigned char* emu_dynamic_smem;

namespace {

// One warp's mma.sync: each lane leaves its fragments in the slot of its call's parity; the last
// to arrive computes every lane's product (the barrier's completion) and all read their own. Two
// slots suffice: a lane can be one call ahead of the others, never two.
struct WarpMma {
    unsigned a[2][32][4], b[2][32][2];
    int d[2][32][4];
    int calls[32] = {};
    int parity = 0;

    void operator()() noexcept {  // the completion: every lane has left its fragments
        const int p = parity;
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane & 3;
            for (int r = 0; r < 4; ++r) {
                const int half = r >> 1;               // d0, d1: row g (a0, a2); d2, d3: row g + 8 (a1, a3)
                const int col = 2 * t + (r & 1);
                int sum = 0;
                for (int tk = 0; tk < 4; ++tk) {       // k = 32 tk + i (a0/a1, b0) and 128 + 32 tk + i (a2/a3, b1)
                    const unsigned* arow = a[p][4 * g + tk];
                    const unsigned* bcol = b[p][4 * col + tk];
                    sum += __builtin_popcount(arow[half] & bcol[0]) + __builtin_popcount(arow[2 + half] & bcol[1]);
                }
                d[p][lane][r] = sum;
            }
        }
        parity ^= 1;
    }
};

struct Warp {
    WarpMma mma;
    std::barrier<std::reference_wrapper<WarpMma>> bar{32, std::ref(mma)};
};

// The block being run: its __syncthreads barrier (a thread that leaves the kernel drops out of it,
// as on a GPU) and its warps, made afresh for each block.
std::unique_ptr<std::barrier<>> block_barrier;
std::unique_ptr<Warp[]> warps;
// The block's named barriers (bar.sync 1..15), each made by the first thread to reach it, with
// the thread count it names; a thread that names another count for it is a kernel bug.
std::unique_ptr<std::barrier<>> named_barriers[16];
int named_counts[16];
std::mutex named_mutex;

// Bytes past a block's dynamic shared memory: a block that changed them wrote past its end
const unsigned char kCanary[16] = {0xDE, 0xAD, 0xBE, 0xEF, 0xCA, 0xFE, 0xF0, 0x0D,
                                   0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC, 0xDE, 0xF0};
unsigned long long faults;  // blocks that wrote past their shared memory, since the library loaded

}  // namespace

// Blocks that wrote past their dynamic shared memory so far (the tests read it after each launch)
extern "C" unsigned long long emu_faults() { return faults; }

void emu_launch(unsigned gx, unsigned gy, unsigned threads, size_t smem, const std::function<void()>& body) {
    std::vector<unsigned char> shared(smem + sizeof kCanary);
    emu_dynamic_smem = shared.data();
    blockDim = {threads, 1, 1};
    gridDim = {gx, gy, 1};
    // The threads live for the whole launch (creating 256 a block cost more than most blocks' work);
    // between blocks they meet at `gate`, and thread 0 sets the next block up while the rest wait.
    std::barrier<> gate(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([=, &gate, &shared, &body] {
            threadIdx = {t, 0, 0};
            for (unsigned long long block = 0; block < (unsigned long long)gx * gy; ++block) {
                if (t == 0) {
                    blockIdx = {(unsigned)(block % gx), (unsigned)(block / gx), 0};
                    std::memset(shared.data(), 0xA5, smem);  // stale, never zero: what a GPU leaves
                    std::memcpy(shared.data() + smem, kCanary, sizeof kCanary);
                    block_barrier = std::make_unique<std::barrier<>>(threads);
                    warps.reset(new Warp[(threads + 31) / 32]);
                    for (auto& b : named_barriers) b.reset();
                }
                gate.arrive_and_wait();
                body();
                block_barrier->arrive_and_drop();
                gate.arrive_and_wait();
                if (t == 0 && std::memcmp(shared.data() + smem, kCanary, sizeof kCanary) != 0) ++faults;
            }
        });
    }
    for (auto& th : pool) th.join();
    block_barrier.reset();
    warps.reset();
}

void __syncthreads() { block_barrier->arrive_and_wait(); }

void emu_named_barrier(int id, int threads) {
    std::barrier<>* bar;
    {
        std::lock_guard<std::mutex> lock(named_mutex);
        if (id < 1 || id > 15 || threads < 1 || threads % 32 != 0 || threads > (int)blockDim.x) std::abort();
        if (!named_barriers[id]) {
            named_barriers[id] = std::make_unique<std::barrier<>>(threads);
            named_counts[id] = threads;
        }
        if (named_counts[id] != threads) std::abort();
        bar = named_barriers[id].get();
    }
    bar->arrive_and_wait();
}

void emu_mma_and_popc(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31;
    Warp& w = warps[threadIdx.x >> 5];
    const int p = w.mma.calls[lane]++ & 1;
    unsigned* a = w.mma.a[p][lane];
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
    w.mma.b[p][lane][0] = b0, w.mma.b[p][lane][1] = b1;
    w.bar.arrive_and_wait();
    for (int r = 0; r < 4; ++r) d[r] += w.mma.d[p][lane][r];
}
