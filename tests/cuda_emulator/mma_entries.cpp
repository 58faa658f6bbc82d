// Entry points of dpf_scan_mma.cu's kernels (tests/cuda_emulator): as scan_entries.cpp. The wgmma
// scan builds as its trap here (its text is for sm_90a alone) and is never launched.
#include "cuda_emu.h"

#include EMU_MMA_KERNELS

// The tile counts the tests' plans pick, of dpf_scan_mma<T> and dpf_scan_mma_frag<T> (others: false)
#define EMU_TILES(X) X(1) X(2) X(3)

extern "C" {

void emu_pages_to_fragments(unsigned gx, const u32* pages, long long valid_pages, u32* frags) {
    emu_launch(gx, 1, MMA_THREADS, 0, [=] { pages_to_fragments(pages, valid_pages, frags); });
}

void emu_fragments_to_pages(unsigned gx, const u32* frags, u32* pages) {
    emu_launch(gx, 1, MMA_THREADS, 0, [=] { fragments_to_pages(frags, pages); });
}

bool emu_dpf_scan_mma(int tiles, int fragments, unsigned gx, size_t smem, const u32* pages, long long num_pages,
                      const uint4* sel, long long padded_leaves, int num_groups, int chunks_per_block, u32* out) {
#define EMU_MMA(T)                                                                                  \
    if (tiles == T) {                                                                              \
        emu_launch(gx, 1, MMA_THREADS, smem, [=] {                                                 \
            if (fragments)                                                                         \
                dpf_scan_mma_frag<T>(pages, num_pages, sel, padded_leaves, num_groups,             \
                                     chunks_per_block, out);                                       \
            else                                                                                   \
                dpf_scan_mma<T>(pages, num_pages, sel, padded_leaves, num_groups, chunks_per_block, \
                                out);                                                              \
        });                                                                                        \
        return true;                                                                               \
    }
    EMU_TILES(EMU_MMA)
    return false;
}

}  // extern "C"
