// An experiment, not part of the runtime (measured slower; benchmarks/RESULTS.md, 2026-12-06): the whole MLP of
// one decode row as one kernel (sm_90 and newer), residual += down · (silu(gate) * up) of rms_norm(residual),
// where the runtime runs two bulk GEMVs (kernels/gemv_bulk.cu: gate/up, then down). Built into gemv_chain.cu,
// which times it (`gemv_chain mlp`).
//
// The idea: one kernel boundary fewer per layer. Block b owns a run of the intermediate units (whole groups of
// 8); their gate and up rows come into shared memory by bulk copies and their down columns into registers, all
// requested before the PDL wait. After it the block computes its units' activations exactly as the gate/up GEMV
// does (stage_product, same sums and roundings), then its share of every residual column, and adds the share
// into a 64-bit fixed-point accumulator (units of 2^-32): integer adds are associative, so the total does not
// depend on the order the blocks arrive in and the result is deterministic. The last block to arrive adds the
// accumulated columns into the residual with the down GEMV's rounding and clears the accumulator.
//
// What the measurement showed (H100, Qwen3-0.6B shape): the kernel took 16.2 µs against 11.3 µs for the two
// GEMVs, and 15.9 against 10.3 µs exposed in the runtime (qwen3 batch 1: 1.044-1.048 against 0.860-0.868 ms per
// step). Its finish (fence, arrival counter, the last block's pass over the columns) costs about 5 µs, more than
// the kernel boundary it removes; without it (MLP_EXPERIMENT_NO_FINISH, wrong results, timing only) the kernel
// is level with the two GEMVs (11.0 µs), f32 atomics instead of the fixed-point sums (MLP_EXPERIMENT_RED_F32)
// change nothing: the down columns, 48-byte runs of 1,024 rows, stream poorly into registers, and a layer is
// still bound by its chain of round trips.
#include "gemv_bulk.cuh"

#define MLP_THREADS BULK_THREADS
// 2^32: the accumulator's unit is 2^-32, so it holds sums below 2^31. A block's share of 2^23 or more in
// magnitude (hundreds of times what the activations of real models reach) counts as not finite, so that the
// shares of up to MLP_MAX_BLOCKS blocks cannot overflow the sum.
#define MLP_FIXED_ONE 4294967296.0
#define MLP_SHARE_LIMIT 8388608.0f
#define MLP_MAX_BLOCKS 256

// The accumulator a launch adds into and its last block clears: zeroed once at allocation, reused by every launch.
struct MlpAccumulator {
    unsigned long long* sums;  // [H]: fixed-point column sums
    u32* not_finite;           // [H]: set where a block's share was NaN, infinite or beyond MLP_SHARE_LIMIT
    u32* arrived;              // blocks done so far in this launch
};

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void add_share(const MlpAccumulator& acc, int col, float share) {
#ifdef MLP_EXPERIMENT_RED_F32
    atomicAdd(reinterpret_cast<float*>(acc.sums) + col, share);
    return;
#endif
    if (fabsf(share) < MLP_SHARE_LIMIT) {
        const long long fixed = __double2ll_rn((double)share * MLP_FIXED_ONE);
        atomicAdd(acc.sums + col, (unsigned long long)fixed);
    } else {
        atomicOr(acc.not_finite + col, 1u);
    }
}

// The last block: residual[col] += bf16(sum of shares), and the accumulator back to zero.
__device__ void finish_columns(const MlpAccumulator& acc, bf16* __restrict__ h, int H) {
    __threadfence();
    for (int col = threadIdx.x; col < H; col += blockDim.x) {
        const long long fixed = (long long)__ldcg(acc.sums + col);
        const u32 bad = __ldcg(acc.not_finite + col);
        acc.sums[col] = 0;
        if (bad) acc.not_finite[col] = 0;
        const float sum = bad ? __int_as_float(0x7fc00000) : (float)((double)fixed / MLP_FIXED_ONE);
        h[col] = __float2bfloat16(__bfloat162float(__ldcg(h + col)) + bf16r(sum));
    }
    if (threadIdx.x == 0) *acc.arrived = 0;
}
#endif

// W: 16-byte words of down weights per row a block may own (its units / 8 at most); RPT: down rows per thread
// (H / MLP_THREADS, rounded up); each thread holds W * RPT words in registers. The Qwen3-0.6B shape on 132
// multiprocessors takes W = 3, RPT = 4.
// grid: blocks own groups [b * G / grid, (b + 1) * G / grid) of the G = I / 8 unit groups. Dynamic shared
// memory: H * 2 bytes of input, H * 4 of norm weights, 2 * 8 * W * H * 2 of gate and up rows, 8 * W * 2 of
// activations. H % 8 == 0, I % 8 == 0.
template <int W, int RPT>
__device__ void mlp_bulk(bf16* __restrict__ h, const float* __restrict__ norm_w, float eps,
                         const bf16* __restrict__ gate_up, const bf16* __restrict__ down, MlpAccumulator acc, int H,
                         int I) {
#if __CUDA_ARCH__ >= 900
    __shared__ float inv[1];
    __shared__ unsigned long long full;
    __shared__ bool last;
    extern __shared__ __align__(16) unsigned char mlp_smem[];
    bf16* xs = reinterpret_cast<bf16*>(mlp_smem);
    float* norm_s = reinterpret_cast<float*>(mlp_smem + (size_t)H * 2);
    unsigned char* rows = mlp_smem + (size_t)H * 6;
    const int groups = I / 8;
    const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int g1 = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x);
    const int u0 = g0 * 8, n = (g1 - g0) * 8, words = g1 - g0;
    bf16* act = reinterpret_cast<bf16*>(rows + (size_t)2 * n * H * 2);

    // Constant weights, before the wait: gate rows then up rows (contiguous, as stage_product reads them), the
    // norm weights, and this thread's down columns.
    if (threadIdx.x == 0) {
        mbar_init(&full, 1);
        fence_barrier_init();
        const u32 bytes = (u32)((size_t)n * H * 2);
        mbar_expect_bytes(&full, 2 * bytes);
        bulk_copy(rows, gate_up + (size_t)u0 * H, bytes, &full);
        bulk_copy(rows + bytes, gate_up + (size_t)(I + u0) * H, bytes, &full);
    }
    for (int i = threadIdx.x; i < H / 4; i += blockDim.x)
        reinterpret_cast<float4*>(norm_s)[i] = __ldg(reinterpret_cast<const float4*>(norm_w) + i);
    uint4 dw[RPT][W];
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int col = threadIdx.x + r * MLP_THREADS;
#pragma unroll
        for (int w = 0; w < W; w++)
            if (col < H && w < words) dw[r][w] = __ldg(reinterpret_cast<const uint4*>(down + (size_t)col * I + u0) + w);
    }
    kernel_begin();

    stage_input<1, IN_NORM>(h, norm_s, eps, H, xs, inv);
    mbar_wait(&full, 0);
    stage_product<1, OUT_SILU>(reinterpret_cast<const uint4*>(rows), n, n, reinterpret_cast<const uint4*>(xs), H / 8,
                               nullptr, act, n, 0, OldFromL2{nullptr, 0});
    __syncthreads();

    // This block's share of each of the thread's residual columns, in unit order.
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int col = threadIdx.x + r * MLP_THREADS;
        if (col >= H) continue;
        float share = 0.0f;
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (w >= words) continue;
            float wv[8], av[8];
            unpack8(dw[r][w], wv);
            unpack8(reinterpret_cast<const uint4*>(act)[w], av);
#pragma unroll
            for (int j = 0; j < 8; j++) share = fmaf(wv[j], av[j], share);
        }
        add_share(acc, col, share);
    }

#ifdef MLP_EXPERIMENT_NO_FINISH
    return;
#endif
    __threadfence();  // this thread's adds before the block's arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(acc.arrived, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) finish_columns(acc, h, H);
#endif
}


#define MLP_VARIANT(W, RPT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(MLP_THREADS, 1)                                                  \
        mlp_bulk_w##W##_r##RPT(bf16* h, const float* norm_w, float eps, const bf16* gate_up, const bf16* down,   \
                               unsigned long long* sums, u32* not_finite, u32* arrived, int H, int I) {          \
        mlp_bulk<W, RPT>(h, norm_w, eps, gate_up, down, MlpAccumulator{sums, not_finite, arrived}, H, I);        \
    }

MLP_VARIANT(3, 4)
