// Elementwise kernels: the MLP activation, a bias add and the residual add for the cuBLAS path.
#include "common.cuh"

// out[r, i] = silu(gate) * up on [gate | up] rows of width 2 * half; half % 8 == 0. grid-stride over 8-vectors.
// Rounded as transformers does in bf16: silu(gate) to bf16, then the product.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int rows, int half) {
    kernel_begin();
    const size_t vecs = (size_t)rows * (half / 8);
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < vecs; v += (size_t)gridDim.x * blockDim.x) {
        const size_t r = v / (half / 8), c = (v % (half / 8)) * 8;
        float g[8], u[8], o[8];
        load8_cg(gate_up + r * 2 * half + c, g);
        load8_cg(gate_up + r * 2 * half + half + c, u);
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = bf16r(g[i] / (1.0f + __expf(-g[i]))) * u[i];
        store8(out + r * half + c, o);
    }
}

// x[r, c] += bias[c] (rounded to bf16, as a bf16 linear with bias would give).
extern "C" __global__ void add_bias(bf16* __restrict__ x, const float* __restrict__ bias, int rows, int cols) {
    kernel_begin();
    const size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(__bfloat162float(x[i]) + bias[i % cols]);
}

// out[i] = x[rows[i]]: the rows whose logits the step wants. grid: selected rows.
extern "C" __global__ void select_rows(const bf16* __restrict__ x, const u32* __restrict__ rows,
                                       bf16* __restrict__ out, int cols) {
    kernel_begin();
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)rows[blockIdx.x] * cols);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)blockIdx.x * cols);
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) dst[c] = __ldcg(src + c);
}

// x += delta over n elements (rounded to bf16, as the bf16 residual add in transformers). grid-stride.
extern "C" __global__ void add_into(bf16* __restrict__ x, const bf16* __restrict__ delta, int n) {
    kernel_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(__bfloat162float(x[i]) + __bfloat162float(delta[i]));
}
