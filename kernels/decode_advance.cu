// The first node of a decode graph (rust/core/src/backend/cuda/decode_advance.rs): moves the graph's batch metadata
// one step on, on the device, when the host launches the graph without uploading new metadata.
//
// Why: at batch 64 packing and copying a tick's metadata took a quarter of the host's time per tick (the copy is a
// driver call of 4-7 us on its own). When a decode step runs the same sequences as the replay before it, each row's
// metadata follows from the device's: its token is the one just sampled (the argmax keys, which the sampler also
// writes), its position one further, its KV slot read from its block table, which the host uploaded with a few
// reserved blocks beyond the context. The host checks that the step's batch is exactly that (decode_advance.rs)
// before it skips the upload.
//
// header[0]: ADVANCE_FRESH after the host uploaded the metadata (nothing to do), else ADVANCE_STEP; this kernel
// leaves ADVANCE_STEP for the next replay. header[1]: the rows (the rest of the bucket is padding, never moved).
//
// It is the graph's first kernel and the embedding after it is launched without programmatic dependence, so every
// later kernel, which may read metadata before its griddepcontrol.wait (common.cuh), starts after these writes are
// complete, as after the host's copy.
#include "common.cuh"

#define ADVANCE_FRESH 0u
#define ADVANCE_STEP 1u

// grid: 1 block (its barrier orders the header's read before its write); block: any multiple of 32.
extern "C" __global__ void advance_decode_meta(u32* __restrict__ header, u32* __restrict__ tokens,
                                               u32* __restrict__ positions, u32* __restrict__ slots,
                                               u32* __restrict__ seq_info, const u32* __restrict__ tables,
                                               const unsigned long long* __restrict__ keys, int block_size) {
    const u32 mode = header[0], rows = header[1];
    if (mode == ADVANCE_STEP) {
        for (u32 i = threadIdx.x; i < rows; i += blockDim.x) {
            // seq_info is (start, len, past_len, table_start, table_len) per sequence; decode row i is sequence i.
            u32* info = seq_info + 5 * i;
            const u32 position = info[2] + 1;  // the previous step's token is cached now
            const u32 block = tables[info[3] + position / block_size];
            tokens[i] = 0xffffffffu - (u32)keys[i];  // the key's low word is ~token (argmax_rows, sample_rows)
            positions[i] = position;
            slots[i] = block * block_size + position % block_size;
            info[2] = position;
            info[4] = position / block_size + 1;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) header[0] = ADVANCE_STEP;
}
