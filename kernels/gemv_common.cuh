// What both GEMV families share (kernels/gemv.cu: weights through registers; kernels/gemv_bulk.cu: weights
// through shared memory by bulk copies): the prologue and epilogue kinds, the staging of the input rows (and
// their rms_norm) in shared memory, and the 8-wide dot product.
#pragma once
#include "common.cuh"

#define IN_PLAIN 0
#define IN_NORM 1
#define OUT_STORE 0
#define OUT_ADD 1
#define OUT_SILU 2

// 1 / rms of one row of K values, summed by the calling warp: `load(i)` gives the row's i-th 8-value vector. Every
// RMSNorm prologue of a projection (here and kernels/skinny_gemm.cu) sums its squares in this order.
template <typename Load>
__device__ __forceinline__ float warp_inverse_rms(Load load, int K, float eps) {
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
    for (int i = lane; i < K / 8; i += 32) {
        float v[8];
        unpack8(load(i), v);
#pragma unroll
        for (int j = 0; j < 8; j++) ss += v[j] * v[j];
    }
    return rsqrtf(warp_sum(ss) / K + eps);
}

// x (or its rms_norm) into shared memory as bf16 [M][K]. Every thread of the block takes part; one read of x
// from L2, and the rows are normalized together (warp m sums row m), so M rows cost no more round trips than one.
// norm_w may be in global or shared memory (kernels/gemv_bulk.cu stages it before the PDL wait).
template <int M, int IN>
__device__ __forceinline__ void stage_input(const bf16* __restrict__ x, const float* __restrict__ norm_w,
                                            float eps, int K, bf16* xs, float* inv) {
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    const int vecs = K / 8;
    for (int i = threadIdx.x; i < M * vecs; i += blockDim.x) dst[i] = __ldcg(src + i);
    __syncthreads();
    if (IN == IN_NORM) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        if (warp < M) {
            const uint4* row = dst + warp * vecs;
            const float r = warp_inverse_rms([&](int i) { return row[i]; }, K, eps);
            if (lane == 0) inv[warp] = r;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < M * vecs; i += blockDim.x) {
            const int m = i / vecs, c = (i % vecs) * 8;
            float v[8];
            unpack8(dst[i], v);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = norm_w[c + j] * bf16r(v[j] * inv[m]);
            store8(xs + (size_t)i * 8, v);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
        s = fmaf(fa.x, fb.x, s);
        s = fmaf(fa.y, fb.y, s);
    }
    return s;
}

// The epilogue of output column `col` of row m, from the column's f32 sum(s) (two for OUT_SILU: gate, up).
// OUT_ADD adds to y's value before the launch, which `old(m, col)` gives (OldFromL2, or a staged copy).
template <int OUT, typename Old>
__device__ __forceinline__ void gemv_store(const float* s, const float* __restrict__ bias, bf16* __restrict__ y, int cols,
                                           int m, int col, const Old& old) {
    if (OUT == OUT_SILU) {
        const float g = bf16r(s[0]), u = bf16r(s[1]);
        y[(size_t)m * cols + col] = __float2bfloat16(bf16r(g / (1.0f + __expf(-g))) * u);
    } else {
        float v = s[0];
        if (bias) v += bias[col];
        if (OUT == OUT_ADD) v = old(m, col) + bf16r(v);
        y[(size_t)m * cols + col] = __float2bfloat16(v);
    }
}

// y[m, col] read from L2 when the epilogue needs it (in benchmarks/kernels/projection_chain.cu an earlier phase
// of the same kernel wrote it).
struct OldFromL2 {
    const bf16* y;
    int cols;
    __device__ __forceinline__ float operator()(int m, int col) const {
        return __bfloat162float(__ldcg(y + (size_t)m * cols + col));
    }
};

// Instantiate VARIANT(M, IN, OUT, NAME) for every (prologue, epilogue) pair the host uses and M = 1..8, named
// {PREFIX}_{in}_{out}_m{M} (the host picks one per pair and batch size).
#define GEMV_KINDS(VARIANT, M, PREFIX)                    \
    VARIANT(M, IN_PLAIN, OUT_STORE, PREFIX##_plain_store) \
    VARIANT(M, IN_PLAIN, OUT_ADD, PREFIX##_plain_add)     \
    VARIANT(M, IN_NORM, OUT_STORE, PREFIX##_norm_store)   \
    VARIANT(M, IN_NORM, OUT_SILU, PREFIX##_norm_silu)
#define GEMV_ALL_ROWS(VARIANT, PREFIX) \
    GEMV_KINDS(VARIANT, 1, PREFIX)     \
    GEMV_KINDS(VARIANT, 2, PREFIX)     \
    GEMV_KINDS(VARIANT, 3, PREFIX)     \
    GEMV_KINDS(VARIANT, 4, PREFIX)     \
    GEMV_KINDS(VARIANT, 5, PREFIX)     \
    GEMV_KINDS(VARIANT, 6, PREFIX)     \
    GEMV_KINDS(VARIANT, 7, PREFIX)     \
    GEMV_KINDS(VARIANT, 8, PREFIX)
