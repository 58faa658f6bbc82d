// Entry points of dpf_scan.cu's kernels (tests/cuda_emulator): a kernel's grid (and dynamic shared
// memory), then its arguments in its own order. EMU_SCAN_KERNELS is the text the builder wrote.
#include "cuda_emu.h"

#include EMU_SCAN_KERNELS

// The group sizes the tests' plans pick, of dpf_scan<G> and dpf_scan_bits<G> (others: false)
#define EMU_GROUPS(X) X(1) X(3) X(7) X(9) X(16)

extern "C" {

void emu_dpf_expand_top(unsigned gx, unsigned gy, const u32* keyrec, int krec, int domain_bits,
                        long long num_leaves, const uint4* in_seed, const u8* in_t, long long in_stride,
                        int depth_in, int levels, uint4* out_seed, u8* out_t, long long out_stride) {
    emu_launch(gx, gy, TOP_THREADS, 0, [=] {
        dpf_expand_top(keyrec, krec, domain_bits, num_leaves, in_seed, in_t, in_stride, depth_in, levels,
                       out_seed, out_t, out_stride);
    });
}

bool emu_dpf_scan(int g, unsigned gx, size_t smem, const uint4* pages, long long num_pages, int domain_bits,
                  int chunk_levels, const u32* keyrec, int krec, int num_keys, const uint4* root_seed,
                  const u8* root_t, long long root_stride, int num_groups, int chunks_per_block, u64* out) {
#define EMU_SCAN(G)                                                                                 \
    if (g == G) {                                                                                  \
        emu_launch(gx, 1, SCAN_THREADS, smem, [=] {                                                \
            dpf_scan<G>(pages, num_pages, domain_bits, chunk_levels, keyrec, krec, num_keys,       \
                        root_seed, root_t, root_stride, num_groups, chunks_per_block, out);        \
        });                                                                                        \
        return true;                                                                               \
    }
    EMU_GROUPS(EMU_SCAN)
    return false;
}

bool emu_dpf_scan_bits(int g, unsigned gx, const uint4* pages, long long num_pages, int tree_depth,
                       const u32* keyrec, int krec, int num_keys, const uint4* leaf_seed, const u8* leaf_t,
                       long long leaf_stride, int num_groups, int leaves_per_block, u64* out) {
#define EMU_SCAN_BITS(G)                                                                            \
    if (g == G) {                                                                                  \
        emu_launch(gx, 1, SCAN_THREADS, 0, [=] {                                                   \
            dpf_scan_bits<G>(pages, num_pages, tree_depth, keyrec, krec, num_keys, leaf_seed,      \
                             leaf_t, leaf_stride, num_groups, leaves_per_block, out);              \
        });                                                                                        \
        return true;                                                                               \
    }
    EMU_GROUPS(EMU_SCAN_BITS)
    return false;
}

// dpf_scan_v1_frag, one key group a block; dpf_scan_v1_pair, two a cluster of two blocks run at once
#define EMU_V1_FRAG(KERNEL, CLUSTER)                                                                              \
    void emu_##KERNEL(unsigned gx, size_t smem, const u32* frags, long long num_pages, int domain_bits,           \
                      int chunk_levels, const u32* keyrec, int krec, int num_keys, const uint4* root_seed,       \
                      const u8* root_t, long long root_stride, int num_groups, int chunks_per_block, u64* out) { \
        emu_launch(gx, 1, V1_FRAG_THREADS, smem, [=] {                                                            \
            KERNEL<V1_FRAG_GROUP_KEYS>(frags, num_pages, domain_bits, chunk_levels, keyrec, krec, num_keys,       \
                                       root_seed, root_t, root_stride, num_groups, chunks_per_block, out);        \
        }, CLUSTER);                                                                                              \
    }
EMU_V1_FRAG(dpf_scan_v1_frag, 1)
EMU_V1_FRAG(dpf_scan_v1_pair, 2)

void emu_dpf_leaf_bits(unsigned gx, const u32* keyrec, int krec, int num_keys, int tree_depth, long long num_pages,
                       const uint4* leaf_seed, const u8* leaf_t, long long leaf_stride, long long padded_leaves,
                       int group_keys, uint4* sel) {
    emu_launch(gx, 1, MMA_THREADS, 0, [=] {
        dpf_leaf_bits(keyrec, krec, num_keys, tree_depth, num_pages, leaf_seed, leaf_t, leaf_stride, padded_leaves,
                      group_keys, sel);
    });
}

}  // extern "C"
