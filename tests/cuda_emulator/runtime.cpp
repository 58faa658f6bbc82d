// The emulator's runtime (tests/cuda_emulator): launches run one block at a time (the kernels'
// static __shared__ arrays are process-wide here), or one thread-block cluster at a time, its
// blocks at once; a block's threads are OS threads.
#include "cuda_emu.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local unsigned char* emu_dynamic_smem;

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
    // __shfl_xor_sync: a lane leaves its value in the slot of its call's parity and, once all 32
    // have, reads its partner's (two slots, as for mma.sync)
    unsigned shfl[2][32];
    int shfl_calls[32] = {};
    std::barrier<> shfl_bar{32};
};

// A named barrier misused (bar.sync's bounds, two counts for one id, a phase that never fills):
// the first of the launch said here, and from then on the launch's named barriers wait for no one,
// so it ends (racing) and its test fails with this text rather than hang to CI's time limit.
std::atomic<bool> barriers_broken;
std::atomic<unsigned long long> barrier_faults;  // launches whose named barriers broke
char barrier_fault[256];

void break_barriers(const char* what, int id, int threads) {
    if (barriers_broken.exchange(true)) return;
    std::snprintf(barrier_fault, sizeof barrier_fault, "%s (bar.sync %d, %d threads; block %u, thread %u)", what,
                  id, threads, blockIdx.x, threadIdx.x);
    ++barrier_faults;
}

// A barrier of `count` arrivals a phase: a named barrier (bar.sync id, count), or an mbarrier
// (arrivals by any thread of the cluster; a wait for the phase of a parity returns once that
// phase has completed, at once for the parity of the phase before the current one, as on a GPU).
// A wait that is not over within kNamedWait means threads wait for others that never come (fewer
// threads arrive than the count, or some wait at another barrier): on a GPU, a hang.
constexpr auto kNamedWait = std::chrono::seconds(60);
constexpr auto kNamedPoll = std::chrono::milliseconds(100);
struct PhasedBarrier {
    explicit PhasedBarrier(int count) : count(count) {}
    // an arrival (bar.arrive, mbarrier.arrive): counted, and the phase completed if this fills it,
    // without waiting for it
    void arrive() {
        std::lock_guard<std::mutex> lock(mutex);
        count_arrival();
    }
    // bar.sync: an arrival, then the wait for the phase it arrived in
    void arrive_and_wait(int id) {
        std::unique_lock<std::mutex> lock(mutex);
        const unsigned long long phase = phases;
        if (!count_arrival()) wait(lock, [&] { return phases != phase; }, "a named barrier's phase never filled", id);
    }
    // mbarrier.try_wait.parity in a loop: until the phase of parity `parity` has completed
    void wait_parity(unsigned parity, int id) {
        std::unique_lock<std::mutex> lock(mutex);
        wait(lock, [&] { return (phases & 1) != parity; }, "an mbarrier's phase never completed", id);
    }
    const int count;
    int arrived = 0;                // in the current phase
    unsigned long long phases = 0;  // completed
    std::mutex mutex;
    std::condition_variable completed;

  private:
    // one more arrival (the mutex held): true where it filled the phase, which completes
    bool count_arrival() {
        if (++arrived != count) return false;
        arrived = 0;
        ++phases;
        completed.notify_all();
        return true;
    }
    // woken by a phase's completion, else looks every kNamedPoll for another barrier's break
    template <class Done>
    void wait(std::unique_lock<std::mutex>& lock, Done done, const char* never, int id) {
        const auto deadline = std::chrono::steady_clock::now() + kNamedWait;
        while (!completed.wait_for(lock, kNamedPoll, [&] { return done() || barriers_broken; })) {
            if (std::chrono::steady_clock::now() >= deadline) {
                break_barriers(never, id, count);
                return;
            }
        }
    }
};

// A block being run: its shared memory (dynamic, the canary, then the static words of
// emu_block_word), its __syncthreads barrier (a thread that leaves the kernel drops out of it, as
// on a GPU), its warps, its named barriers (bar.sync 1..15, each made by the first thread to reach
// it with the thread count it names) and its mbarriers (by address), made afresh for each block.
constexpr int kBlockWords = 4;
struct Block {
    std::vector<unsigned char> shared;
    std::unique_ptr<std::barrier<>> barrier;
    std::unique_ptr<Warp[]> warps;
    std::unique_ptr<PhasedBarrier> named_barriers[16];
    std::mutex named_mutex;
    std::map<unsigned, std::unique_ptr<PhasedBarrier>> mbarriers;
    std::mutex mbarrier_mutex;
};
std::unique_ptr<Block[]> blocks;  // the cluster being run (one block where the launch has no clusters)
unsigned cluster_size;
size_t block_smem;  // the launch's dynamic shared memory a block
std::unique_ptr<std::barrier<>> cluster_barrier;  // the cluster's threads (one that leaves the kernel drops out)
thread_local Block* block;  // the thread's, and its rank in the cluster
thread_local unsigned rank;

// Bytes past a block's dynamic shared memory: a block that changed them wrote past its end
const unsigned char kCanary[16] = {0xDE, 0xAD, 0xBE, 0xEF, 0xCA, 0xFE, 0xF0, 0x0D,
                                   0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC, 0xDE, 0xF0};
std::atomic<unsigned long long> faults;  // blocks that wrote past their shared memory, or read a peer's
                                         // past it, since the library loaded

// The launches' L2 prefetches since the library loaded: all of them, and those that named an
// address outside the buffer they may prefetch from (emu_watch_*, the matrix, set by the tests);
// inside it, the 128-byte lines prefetched since it was set
std::atomic<unsigned long long> prefetches, stray_prefetches;
std::vector<unsigned char> prefetched_lines, loaded_lines;
std::atomic<unsigned long long> mma_calls;  // mma.sync products (a lane's call each)
std::atomic<unsigned long long> misaligned_loads;  // 16-byte __ldg of an address not a multiple of 16

// cp.async: copies land when issued (kCopiesAtIssue, the earliest they may: a buffer overwritten
// while still read shows) or when a wait_group lets them (kCopiesAtWait, the latest: a read before
// its wait, or a wait for too few groups, shows). Each thread's copies not yet landed, by group.
enum { kCopiesAtIssue = 0, kCopiesAtWait = 1 };
int copies_land = kCopiesAtIssue;
struct Copy16 {
    void* dst;
    const void* src;
};
thread_local std::vector<Copy16> copies_uncommitted;
thread_local std::deque<std::vector<Copy16>> copy_groups;

}  // namespace

// When the launches' cp.async copies land: 0 when issued, 1 at the wait_group that lets them
extern "C" void emu_cp_async_landing(int when) { copies_land = when; }

void emu_cp_async16(void* dst, const void* src) {
    if (copies_land == kCopiesAtIssue) std::memcpy(dst, src, 16);
    else copies_uncommitted.push_back({dst, src});
}

void emu_cp_async_commit() {
    copy_groups.push_back(std::move(copies_uncommitted));
    copies_uncommitted.clear();
}

void emu_cp_async_wait(int pending) {
    while ((int)copy_groups.size() > pending) {  // the oldest groups land; `pending` stay in flight
        for (const Copy16& c : copy_groups.front()) std::memcpy(c.dst, c.src, 16);
        copy_groups.pop_front();
    }
}

// Blocks that wrote past their dynamic shared memory so far (the tests read it after each launch)
extern "C" unsigned long long emu_faults() { return faults; }

// Launches whose named barriers broke so far, and what broke the last one's
extern "C" unsigned long long emu_barrier_faults() { return barrier_faults; }
extern "C" const char* emu_barrier_fault() { return barrier_fault; }

uintptr_t emu_watch_from;
size_t emu_watch_bytes;
unsigned char* emu_loaded_lines;

// Of the buffer watched last (until emu_prefetch_range set another): its lines prefetched that no
// __ldg loaded (bandwidth for nothing), and those loaded that no prefetch named
unsigned long long last_unused_prefetched, last_loaded_unprefetched;

// The buffer launches may prefetch from, until set again (bytes 0: none), its lines' marks cleared;
// the marks of the one before counted first
extern "C" void emu_prefetch_range(const void* from, size_t bytes) {
    emu_watch_bytes = 0;  // __ldg marks nothing while the marks are replaced
    last_unused_prefetched = last_loaded_unprefetched = 0;
    for (size_t i = 0; i < prefetched_lines.size(); ++i) {
        last_unused_prefetched += prefetched_lines[i] && !loaded_lines[i];
        last_loaded_unprefetched += loaded_lines[i] && !prefetched_lines[i];
    }
    prefetched_lines.assign((bytes + 127) / 128, 0);
    loaded_lines.assign((bytes + 127) / 128, 0);
    emu_loaded_lines = loaded_lines.data();
    emu_watch_from = (uintptr_t)from;
    emu_watch_bytes = bytes;
}
extern "C" unsigned long long emu_last_unused_prefetched_lines() { return last_unused_prefetched; }
extern "C" unsigned long long emu_last_loaded_unprefetched_lines() { return last_loaded_unprefetched; }
extern "C" unsigned long long emu_prefetches() { return prefetches; }
extern "C" unsigned long long emu_stray_prefetches() { return stray_prefetches; }
extern "C" unsigned long long emu_mma_calls() { return mma_calls; }
extern "C" unsigned long long emu_misaligned_loads() { return misaligned_loads; }
void emu_misaligned_load() { ++misaligned_loads; }

void emu_prefetch_l2(const void* p) {
    const uintptr_t off = (uintptr_t)p - emu_watch_from;  // wraps round below the buffer
    ++prefetches;
    // a GPU would ask L2 for whatever line is there: a stray address is a bug that costs
    // bandwidth (or faults), never an answer, so only these counts can show it
    if (off >= emu_watch_bytes) ++stray_prefetches;
    else __atomic_store_n(&prefetched_lines[off >> 7], (unsigned char)1, __ATOMIC_RELAXED);
}

void emu_launch(unsigned gx, unsigned gy, unsigned threads, size_t smem, const std::function<void()>& body,
                unsigned cluster) {
    if (cluster < 1 || gx % cluster != 0) __builtin_trap();  // a GPU refuses such a launch
    blocks.reset(new Block[cluster]);
    cluster_size = cluster;
    block_smem = smem;
    for (unsigned r = 0; r < cluster; ++r) blocks[r].shared.resize(smem + sizeof kCanary + 8 * kBlockWords);
    blockDim = {threads, 1, 1};
    gridDim = {gx, gy, 1};
    // The threads live for the whole launch (creating 256 a block cost more than most blocks' work);
    // between clusters they meet at `gate`, and thread 0 of each block sets it up while the rest wait.
    barriers_broken = false;
    const unsigned all = threads * cluster;
    std::barrier<> gate(all);
    std::vector<std::thread> pool;
    pool.reserve(all);
    for (unsigned p = 0; p < all; ++p) {
        pool.emplace_back([=, &gate, &body] {
            const unsigned t = p % threads;
            threadIdx = {t, 0, 0};
            rank = p / threads;
            block = &blocks[rank];
            emu_dynamic_smem = block->shared.data();
            for (unsigned long long first = 0; first < (unsigned long long)gx * gy; first += cluster) {
                const unsigned long long b = first + rank;
                blockIdx = {(unsigned)(b % gx), (unsigned)(b / gx), 0};
                if (t == 0) {
                    std::memset(emu_dynamic_smem, 0xA5, smem);  // stale, never zero: what a GPU leaves
                    std::memcpy(emu_dynamic_smem + smem, kCanary, sizeof kCanary);
                    std::memset(emu_dynamic_smem + smem + sizeof kCanary, 0xA5, 8 * kBlockWords);
                    block->barrier = std::make_unique<std::barrier<>>(threads);
                    block->warps.reset(new Warp[(threads + 31) / 32]);
                    for (auto& n : block->named_barriers) n.reset();
                    block->mbarriers.clear();
                    if (rank == 0) cluster_barrier = std::make_unique<std::barrier<>>(all);
                }
                gate.arrive_and_wait();
                copies_uncommitted.clear();  // a block's copies never land in the next one's memory
                copy_groups.clear();
                body();
                block->barrier->arrive_and_drop();
                cluster_barrier->arrive_and_drop();
                gate.arrive_and_wait();
                if (t == 0 && std::memcmp(emu_dynamic_smem + smem, kCanary, sizeof kCanary) != 0) ++faults;
                if (t == 0) {  // a bar.arrive no thread waited for: a phase the block left half filled
                    for (int id = 0; id < 16; ++id)
                        if (block->named_barriers[id] && block->named_barriers[id]->arrived != 0)
                            break_barriers("a named barrier's phase left unfilled at the block's end", id,
                                           block->named_barriers[id]->count);
                    for (auto& [at, m] : block->mbarriers)  // arrivals the block's barriers never completed
                        if (m->arrived != 0)
                            break_barriers("an mbarrier's phase left unfilled at the block's end", (int)at, m->count);
                }
            }
        });
    }
    for (auto& th : pool) th.join();
    blocks.reset();
    cluster_barrier.reset();
}

void __syncthreads() { block->barrier->arrive_and_wait(); }

namespace {
// Barrier id of `threads` threads, made at its first use (null once the launch's barriers broke)
PhasedBarrier* named_barrier_of(int id, int threads) {
    PhasedBarrier* bar;
    {
        std::lock_guard<std::mutex> lock(block->named_mutex);
        if (barriers_broken) return nullptr;
        if (id < 1 || id > 15 || threads < 1 || threads % 32 != 0 || threads > (int)blockDim.x) {
            break_barriers("a named barrier out of bar.sync's bounds (id 1..15, a multiple of 32 threads, at most "
                           "the block's)", id, threads);
            return nullptr;
        }
        auto& named = block->named_barriers[id];
        if (!named) named = std::make_unique<PhasedBarrier>(threads);
        if (named->count != threads) {
            break_barriers("a named barrier named with another thread count than at its first use", id, threads);
            return nullptr;
        }
        bar = named.get();
    }
    return bar;
}
}  // namespace

void emu_named_barrier(int id, int threads) {
    if (PhasedBarrier* bar = named_barrier_of(id, threads)) bar->arrive_and_wait(id);
}

void emu_named_barrier_arrive(int id, int threads) {
    if (PhasedBarrier* bar = named_barrier_of(id, threads)) bar->arrive();
}

void emu_mma_and_popc(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    ++mma_calls;
    const int lane = threadIdx.x & 31;
    Warp& w = block->warps[threadIdx.x >> 5];
    const int p = w.mma.calls[lane]++ & 1;
    unsigned* a = w.mma.a[p][lane];
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
    w.mma.b[p][lane][0] = b0, w.mma.b[p][lane][1] = b1;
    w.bar.arrive_and_wait();
    for (int r = 0; r < 4; ++r) d[r] += w.mma.d[p][lane][r];
}

unsigned emu_shfl_xor(unsigned value, int lane_mask) {
    const int lane = threadIdx.x & 31;
    Warp& w = block->warps[threadIdx.x >> 5];
    const int p = w.shfl_calls[lane]++ & 1;
    w.shfl[p][lane] = value;
    w.shfl_bar.arrive_and_wait();
    return w.shfl[p][(lane ^ lane_mask) & 31];
}

// Clusters: a cluster address is (rank + 1) << 24 | the offset in that block's buffer; one without
// rank bits (a CTA address) is the thread's own block's, as shared::cluster reads it on a GPU
unsigned emu_cluster_rank() { return rank; }

void emu_cluster_sync() { cluster_barrier->arrive_and_wait(); }

unsigned long long& emu_block_word(int i) {
    if (i < 0 || i >= kBlockWords) __builtin_trap();
    return *(unsigned long long*)(emu_dynamic_smem + block_smem + sizeof kCanary + 8 * i);
}

namespace {
// The mbarrier at offset `at` of block `b` (null, and the launch's barriers broken, if none was made there)
PhasedBarrier* mbarrier_at(Block& b, unsigned at) {
    std::lock_guard<std::mutex> lock(b.mbarrier_mutex);
    const auto found = b.mbarriers.find(at);
    if (found != b.mbarriers.end()) return found->second.get();
    break_barriers("an mbarrier used at an address no thread initialised", (int)at, 0);
    return nullptr;
}
}  // namespace

void emu_mbarrier_init(unsigned bar, unsigned count) {
    std::lock_guard<std::mutex> lock(block->mbarrier_mutex);
    block->mbarriers[bar] = std::make_unique<PhasedBarrier>((int)count);
}

namespace {
// The block a cluster address names (null past the cluster)
Block* block_of(unsigned cluster_at) {
    const unsigned r = cluster_at >> 24;
    return r == 0 ? block : r <= cluster_size ? &blocks[r - 1] : nullptr;
}
}  // namespace

void emu_mbarrier_arrive(unsigned cluster_bar) {
    Block* b = block_of(cluster_bar);
    if (b == nullptr) {
        break_barriers("an mbarrier arrival at a rank outside the cluster", (int)cluster_bar, 0);
        return;
    }
    PhasedBarrier* m = mbarrier_at(*b, cluster_bar & 0xFFFFFFu);
    if (m != nullptr) m->arrive();
}

void emu_mbarrier_wait(unsigned bar, unsigned parity) {
    PhasedBarrier* m = mbarrier_at(*block, bar);
    if (m != nullptr) m->wait_parity(parity, (int)bar);
}

uint4 emu_ld_cluster_v4(unsigned at) {
    Block* b = block_of(at);
    const unsigned offset = at & 0xFFFFFFu;
    if (b == nullptr || offset + 16 > block_smem) {  // a GPU reads a block's shared memory only
        ++faults;
        return {0, 0, 0, 0};
    }
    if (offset & 15) emu_misaligned_load();
    uint4 v;
    std::memcpy(&v, b->shared.data() + offset, 16);
    return v;
}
