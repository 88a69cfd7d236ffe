// Token embedding: out[t] = table[tokens[t]], 16 bytes per thread per step.
#include "common.cuh"

// grid: tokens; block: any multiple of 32. cols % 8 == 0.
extern "C" __global__ void embed(const bf16* __restrict__ table, const u32* __restrict__ tokens,
                                 bf16* __restrict__ out, int cols) {
    kernel_begin();
    const size_t t = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)tokens[t] * cols);
    uint4* dst = reinterpret_cast<uint4*>(out + t * cols);
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) dst[c] = __ldg(src + c);
}
