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
#include "gemv_bulk.cuh"

// Most ring stages a launch may ask for (the host picks the count from the stage size).
#define BULK_MAX_STAGES 16
// Most output columns per block whose old values OUT_ADD stages in shared memory (beyond it they are read in the
// epilogue). A model's hidden size over the multiprocessor count: 8 for Qwen3-0.6B on an H200.
#define BULK_OLD_COLS 32
static_assert(8 * BULK_OLD_COLS <= BULK_THREADS, "one thread per staged old output at the most rows (8)");

extern __shared__ __align__(16) unsigned char bulk_smem[];

// grid: any (block b owns output columns [b * cols / grid, (b + 1) * cols / grid)); block: BULK_THREADS.
// Dynamic shared memory: M * K * 2 bytes of input, for IN_NORM K * 4 bytes of norm weights, then `stages` stages
// of R * stage_rows * K * 2 bytes. K % 8 == 0, norm_w 16-byte aligned; 1 <= stages <= BULK_MAX_STAGES; for
// OUT_SILU, N is the full [gate | up] height.
//
// After the wait only what a predecessor writes is read: the input rows, and for OUT_ADD the old outputs, both
// requested at once. The weights and the norm weights (constant) are requested before it.
template <int M, int IN, int OUT>
__device__ void gemv_bulk(const bf16* __restrict__ x, const float* __restrict__ norm_w, float eps,
                          const bf16* __restrict__ w, const float* __restrict__ bias, bf16* __restrict__ y, int N,
                          int K, int stage_rows, int stages) {
#if __CUDA_ARCH__ >= 900
    constexpr int R = OUT == OUT_SILU ? 2 : 1;  // weight rows per output column
    __shared__ float inv[M];
    __shared__ unsigned long long full[BULK_MAX_STAGES];
    __shared__ bf16 s_old[OUT == OUT_ADD ? M : 1][BULK_OLD_COLS];
    bf16* xs = reinterpret_cast<bf16*>(bulk_smem);
    const int chunks = K / 8;  // 16-byte chunks per weight row
    const size_t row_bytes = (size_t)K * 2;
    const size_t stage_bytes = R * stage_rows * row_bytes;
    float* norm_s = reinterpret_cast<float*>(bulk_smem + M * row_bytes);
    unsigned char* ring = bulk_smem + M * row_bytes + (IN == IN_NORM ? (size_t)K * 4 : 0);

    const int cols = N / R;
    const int first = (int)((long long)blockIdx.x * cols / gridDim.x);
    const int last = (int)((long long)(blockIdx.x + 1) * cols / gridDim.x);
    const int n_stages = (last - first + stage_rows - 1) / stage_rows;
    TIMELINE(TL_START);
    // The projections that add into the residual (O, down) let the next one (gate/up, the next layer's QKV: a
    // step's largest weights) start before they wait. Released after the wait, those start streaming only about
    // 1.5 µs before this kernel ends at batch 1 (benchmarks/kernels/layer_timeline.cu); released here, a step at
    // batch 1 measured 1.3-2.1% faster (benchmarks/RESULTS.md).
    if (OUT == OUT_ADD) pdl_launch_dependents();

    // Stage s holds columns [first + s * stage_rows, ...): their rows, and for OUT_SILU the up rows after them.
    auto issue = [&](int s) {
        const int c0 = first + s * stage_rows, n = min(stage_rows, last - c0);
        copy_stage_rows<R>(ring + (size_t)(s % stages) * stage_bytes, &full[s % stages], w, cols, K, c0, n, stage_rows);
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; i++) mbar_init(&full[i], 1);
        fence_barrier_init();
        for (int s = 0; s < min(stages, n_stages); s++) issue(s);
    }
    if (IN == IN_NORM) {
        for (int i = threadIdx.x; i < K / 4; i += blockDim.x)
            reinterpret_cast<float4*>(norm_s)[i] = __ldg(reinterpret_cast<const float4*>(norm_w) + i);
    }
    if (OUT == OUT_ADD) pdl_wait();  // released above already
    else kernel_begin();
    TIMELINE(TL_WAITED);
    // OUT_ADD: thread i < M * span fetches old output (i / span, first + i % span) while the input rows load.
    const int span = last - first;
    const bool stages_old = OUT == OUT_ADD && span <= BULK_OLD_COLS;
    const int oi = threadIdx.x;
    bf16 old_raw;
    if (stages_old && oi < M * span) old_raw = __ldcg(y + (size_t)(oi / span) * cols + first + oi % span);
    // Its barriers also publish the initialized stage barriers and the staged norm weights.
    stage_input<M, IN>(x, IN == IN_NORM ? norm_s : norm_w, eps, K, xs, inv);
    if (stages_old && oi < M * span) s_old[oi / span][oi % span] = old_raw;
    if (OUT == OUT_ADD) __syncthreads();
    TIMELINE(TL_INPUT);
    const auto old = [&](int m, int col) {
        return stages_old ? __bfloat162float(s_old[m][col - first]) : OldFromL2{y, cols}(m, col);
    };

    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    for (int s = 0; s < n_stages; s++) {
        const int c0 = first + s * stage_rows, n = min(stage_rows, last - c0);
        const uint4* stage = reinterpret_cast<const uint4*>(ring + (size_t)(s % stages) * stage_bytes);
        mbar_wait(&full[s % stages], (s / stages) & 1);
        if (s == 0) TIMELINE(TL_READY);
        stage_product<M, OUT>(stage, stage_rows, n, xv, chunks, bias, y, cols, c0, old);
        __syncthreads();  // every warp is done with this stage
        if (threadIdx.x == 0 && s + stages < n_stages) {
            fence_async_shared();
            issue(s + stages);
        }
    }
    TIMELINE(TL_END);
#endif
}

#define GEMV_BULK_VARIANT(M, IN, OUT, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(BULK_THREADS, 1) NAME##_m##M(                                    \
        const bf16* x, const float* norm_w, float eps, const bf16* w, const float* bias, bf16* y, int N, int K,  \
        int stage_rows, int stages) {                                                                            \
        gemv_bulk<M, IN, OUT>(x, norm_w, eps, w, bias, y, N, K, stage_rows, stages);                             \
    }

GEMV_ALL_ROWS(GEMV_BULK_VARIANT, gemv_bulk)
