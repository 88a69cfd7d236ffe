// Token embedding: out[t] = table[tokens[t]], 16 bytes per thread per step.
#include "common.cuh"

// grid: tokens; block: any multiple of 32. cols % 8 == 0.
extern "C" __global__ void embed(const bf16* __restrict__ table, const u32* __restrict__ tokens,
                                 bf16* __restrict__ out, int cols) {
    const size_t t = blockIdx.x;
    // The token ids (batch metadata) and the table (weights) may be read before the wait (common.cuh); the
    // store may not.
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)tokens[t] * cols);
    uint4* dst = reinterpret_cast<uint4*>(out + t * cols);
    const int c0 = threadIdx.x;
    const uint4 first = c0 < cols / 8 ? __ldg(src + c0) : make_uint4(0, 0, 0, 0);
    kernel_begin();
    if (c0 < cols / 8) dst[c0] = first;
    for (int c = c0 + blockDim.x; c < cols / 8; c += blockDim.x) dst[c] = __ldg(src + c);
}
