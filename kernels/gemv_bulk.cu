// The small-batch projection y[M, N] = f(x)[M, K] · W[N, K]ᵀ with the weights streamed into shared memory by
// bulk copies (the Hopper copy engine, cp.async.bulk), for decode batches of 1..8 on sm_90 and newer.
//
// Why: kernels/gemv.cu holds its in-flight weights in registers, so a projection moves at most one wave of loads
// per round trip and its grid fills every multiprocessor's register file; the next kernel cannot start until it
// is done, and each projection pays a full DRAM round trip before its first product (a 4 MB projection took
// 3.9 µs, 1.1 TB/s). Here one block per multiprocessor owns a contiguous run of output columns, whose weight rows
// are one contiguous run of memory; one thread issues bulk copies of it into a ring of shared-memory stages
// before the kernel waits for its predecessor (weights are constant), so a projection's weights are in flight
// while the kernel before it (attention, or the previous projection) finishes. The block uses under half of a
// multiprocessor's shared memory and a quarter of its registers, so the next projection's block fits beside
// it and does the same.
//
// Prologues and epilogues are those of kernels/gemv.cu (gemv_common.cuh), with the same roundings. OUT_SILU:
// W is [gate | up]; a stage holds the block's next gate rows and the matching up rows.
#include "gemv_common.cuh"

#define BULK_THREADS 256
#define BULK_WARPS 8
// Most ring stages a launch may ask for (the host picks the count from the stage size).
#define BULK_MAX_STAGES 16

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

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
#endif

extern __shared__ __align__(16) unsigned char bulk_smem[];

// grid: any (block b owns output columns [b * cols / grid, (b + 1) * cols / grid)); block: BULK_THREADS.
// Dynamic shared memory: M * K * 2 bytes of input, then `stages` stages of R * stage_rows * K * 2 bytes.
// K % 8 == 0; 1 <= stages <= BULK_MAX_STAGES; for OUT_SILU, N is the full [gate | up] height.
template <int M, int IN, int OUT>
__device__ void gemv_bulk(const bf16* __restrict__ x, const float* __restrict__ norm_w, float eps,
                          const bf16* __restrict__ w, const float* __restrict__ bias, bf16* __restrict__ y, int N,
                          int K, int stage_rows, int stages) {
#if __CUDA_ARCH__ >= 900
    constexpr int R = OUT == OUT_SILU ? 2 : 1;  // weight rows per output column
    __shared__ float inv[M];
    __shared__ unsigned long long full[BULK_MAX_STAGES];
    bf16* xs = reinterpret_cast<bf16*>(bulk_smem);
    const int chunks = K / 8;  // 16-byte chunks per weight row
    const size_t row_bytes = (size_t)K * 2;
    const size_t stage_bytes = R * stage_rows * row_bytes;
    unsigned char* ring = bulk_smem + M * row_bytes;

    const int cols = N / R;
    const int first = (int)((long long)blockIdx.x * cols / gridDim.x);
    const int last = (int)((long long)(blockIdx.x + 1) * cols / gridDim.x);
    const int n_stages = (last - first + stage_rows - 1) / stage_rows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Stage s holds columns [first + s * stage_rows, ...): their rows, and for OUT_SILU the up rows after them.
    auto issue = [&](int s) {
        const int c0 = first + s * stage_rows, n = min(stage_rows, last - c0);
        unsigned char* dst = ring + (size_t)(s % stages) * stage_bytes;
        unsigned long long* bar = &full[s % stages];
        mbar_expect_bytes(bar, (u32)(R * n * row_bytes));
#pragma unroll
        for (int r = 0; r < R; r++)
            bulk_copy(dst + r * stage_rows * row_bytes, w + ((size_t)r * cols + c0) * K, (u32)(n * row_bytes), bar);
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; i++) mbar_init(&full[i], 1);
        fence_barrier_init();
        for (int s = 0; s < min(stages, n_stages); s++) issue(s);
    }
    pdl_wait();
    pdl_launch_dependents();
    stage_input<M, IN>(x, norm_w, eps, K, xs, inv);  // its barriers also publish the initialized stage barriers

    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    for (int s = 0; s < n_stages; s++) {
        const int c0 = first + s * stage_rows, n = min(stage_rows, last - c0);
        const uint4* stage = reinterpret_cast<const uint4*>(ring + (size_t)(s % stages) * stage_bytes);
        mbar_wait(&full[s % stages], (s / stages) & 1);
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
                    gemv_store<OUT>(sums, bias, y, cols, m, c0 + r);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage
        if (threadIdx.x == 0 && s + stages < n_stages) {
            fence_async_shared();
            issue(s + stages);
        }
    }
#endif
}

#define GEMV_BULK_VARIANT(M, IN, OUT, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(BULK_THREADS, 1) NAME##_m##M(                                    \
        const bf16* x, const float* norm_w, float eps, const bf16* w, const float* bias, bf16* y, int N, int K,  \
        int stage_rows, int stages) {                                                                            \
        gemv_bulk<M, IN, OUT>(x, norm_w, eps, w, bias, y, N, K, stage_rows, stages);                             \
    }

GEMV_ALL_ROWS(GEMV_BULK_VARIANT, gemv_bulk)
