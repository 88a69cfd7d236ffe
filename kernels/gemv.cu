// Bandwidth-bound y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) for small M (decode batches of 1..8), where a
// cuBLAS GEMM is latency-bound. Each weight row is read once with 16-byte loads; the warps of a block split
// K between them (split-K) when N alone would not fill the GPU.
// Optionally the input is silu(gate) * up of [gate | up] rows (the MLP activation fused into down_proj).
#include "common.cuh"

#define GEMV_THREADS 256
#define GEMV_WARPS 8

template <int M, bool SILU>
__device__ __forceinline__ void load_x(const bf16* x, int m, int K, int c, float out[8]) {
    if (SILU) {
        float g[8], u[8];
        load8_cg(x + (size_t)m * 2 * K + c * 8, g);
        load8_cg(x + (size_t)m * 2 * K + K + c * 8, u);
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = bf16r(bf16r(g[i] / (1.0f + __expf(-g[i]))) * u[i]);
    } else {
        load8_cg(x + (size_t)m * K + c * 8, out);
    }
}

// grid: ceil(N / (GEMV_WARPS / warps_per_row)); block: GEMV_THREADS. K % 8 == 0; warps_per_row in {1,2,4,8}.
template <int M, bool SILU>
__device__ void gemv(const bf16* __restrict__ x, const bf16* __restrict__ w, const float* __restrict__ bias,
                     bf16* __restrict__ y, int N, int K, int warps_per_row) {
    __shared__ float sums[GEMV_WARPS][M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_block = GEMV_WARPS / warps_per_row;
    const int row = blockIdx.x * rows_per_block + warp / warps_per_row;
    const int part = warp % warps_per_row;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.0f;
    if (row < N) {
        const bf16* wr = w + (size_t)row * K;
        const int chunks = K / 8, step = warps_per_row * 32;
#pragma unroll 4
        for (int c = part * 32 + lane; c < chunks; c += step) {
            float wv[8];
            load8(wr + c * 8, wv);
#pragma unroll
            for (int m = 0; m < M; m++) {
                float xv[8];
                load_x<M, SILU>(x, m, K, c, xv);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[m] += wv[i] * xv[i];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = warp_sum(acc[m]);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; m++) sums[warp][m] = acc[m];
    }
    __syncthreads();
    if (part == 0 && lane < M && row < N) {
        float s = 0.0f;
        for (int p = 0; p < warps_per_row; p++) s += sums[warp + p][lane];
        if (bias) s += bias[row];
        y[(size_t)lane * N + row] = __float2bfloat16(s);
    }
}

#define GEMV_KERNEL(M)                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                               \
        gemv_m##M(const bf16* x, const bf16* w, const float* bias, bf16* y, int N, int K, int wpr) {         \
        gemv<M, false>(x, w, bias, y, N, K, wpr);                                                             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                               \
        gemv_silu_m##M(const bf16* x, const bf16* w, const float* bias, bf16* y, int N, int K, int wpr) {    \
        gemv<M, true>(x, w, bias, y, N, K, wpr);                                                              \
    }

GEMV_KERNEL(1)
GEMV_KERNEL(2)
GEMV_KERNEL(3)
GEMV_KERNEL(4)
GEMV_KERNEL(5)
GEMV_KERNEL(6)
GEMV_KERNEL(7)
GEMV_KERNEL(8)
