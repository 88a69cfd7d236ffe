// What the kernels that stream weights through a shared-memory ring share (kernels/gemv_bulk.cu, and the
// projection-chain experiment in benchmarks/kernels; sm_90 and newer): the Hopper copy engine from a kernel
// (cp.async.bulk from global into shared memory, completed on shared-memory barriers that count the bytes still
// to arrive), and the product of one ring stage against the staged input rows.
#pragma once
#include "gemv_common.cuh"

#define BULK_THREADS 256
#define BULK_WARPS 8

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Make the barriers' initialization visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Order this thread's earlier shared-memory accesses (the block's reads of a stage, published to it by a
// barrier) before the copy engine's next writes to that stage.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void mbar_expect_bytes(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
        "@!ready bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// Copy the weight rows of output columns [c0, c0 + n) into a ring stage and arm its barrier: the rows themselves,
// and for R = 2 ([gate | up] weights of `cols` columns each) the matching up rows, stage_rows rows further on.
template <int R>
__device__ __forceinline__ void copy_stage_rows(unsigned char* dst, unsigned long long* bar, const bf16* w, int cols,
                                                int K, int c0, int n, int stage_rows) {
    const size_t row_bytes = (size_t)K * 2;
    mbar_expect_bytes(bar, (u32)(R * n * row_bytes));
#pragma unroll
    for (int r = 0; r < R; r++)
        bulk_copy(dst + r * stage_rows * row_bytes, w + ((size_t)r * cols + c0) * K, (u32)(n * row_bytes), bar);
}

// The outputs of one ring stage: n output columns starting at c0, whose weight rows sit in `stage` (for OUT_SILU
// the gate rows, then, stage_rows rows further, the matching up rows), against the M input rows `xv` (chunks
// 16-byte words each). A warp per column. `old` is gemv_store's.
template <int M, int OUT, typename Old>
__device__ __forceinline__ void stage_product(const uint4* stage, int stage_rows, int n, const uint4* xv, int chunks,
                                              const float* __restrict__ bias, bf16* __restrict__ y, int cols, int c0,
                                              const Old& old) {
    constexpr int R = OUT == OUT_SILU ? 2 : 1;  // weight rows per output column
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // A warp per column: its row (and up row) against every input row.
    for (int r = warp; r < n; r += BULK_WARPS) {
        float acc[R][M];
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int m = 0; m < M; m++) acc[j][m] = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            uint4 wv[R];
#pragma unroll
            for (int j = 0; j < R; j++) wv[j] = stage[(size_t)(j * stage_rows + r) * chunks + c];
#pragma unroll
            for (int m = 0; m < M; m++) {
                const uint4 xm = xv[m * chunks + c];
#pragma unroll
                for (int j = 0; j < R; j++) acc[j][m] += dot8(wv[j], xm);
            }
        }
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int m = 0; m < M; m++) acc[j][m] = warp_sum(acc[j][m]);
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (lane == m) {
                float sums[R];
#pragma unroll
                for (int j = 0; j < R; j++) sums[j] = acc[j][m];
                gemv_store<OUT>(sums, bias, y, cols, m, c0 + r, old);
            }
        }
    }
}
#endif
