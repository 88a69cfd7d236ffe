// RMSNorm, one block per row (batches the GEMV kernels do not serve; there the norm is their prologue).
// transformers' LlamaRMSNorm normalises in f32, rounds to bf16, then multiplies by the bf16 weight (rounding
// again); we follow the same two roundings so our hidden states match it, not just approximately.
#include "common.cuh"

__device__ __forceinline__ void normalize_row(const bf16* x, const float* w, float eps, bf16* out, int cols,
                                              float* scratch) {
    float ss = 0.0f;
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
        float v[8];
        load8_cg(x + c, v);
#pragma unroll
        for (int i = 0; i < 8; i++) ss += v[i] * v[i];
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / cols + eps);
    for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
        float v[8];
        load8_cg(x + c, v);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = w[c + i] * bf16r(v[i] * inv);
        store8(out + c, v);
    }
}

// out = rms_norm(x) * w. grid: rows; cols % 8 == 0.
extern "C" __global__ void rms_norm(const bf16* __restrict__ x, const float* __restrict__ w, float eps,
                                    bf16* __restrict__ out, int cols) {
    kernel_begin();
    __shared__ float scratch[32];
    const size_t r = blockIdx.x;
    normalize_row(x + r * cols, w, eps, out + r * cols, cols, scratch);
}
