// Bandwidth-bound y[M, N] = f(x)[M, K] · W[N, K]ᵀ for small M (decode batches of 1..8), where a cuBLAS GEMM
// is latency-bound. Each weight row is read once with 16-byte loads, GEMV_UNROLL of them in flight per lane;
// the warps of a block may split K between them (split-K) when N alone would not fill the GPU.
//
// One kernel does what would otherwise be three launches around the projection:
//   input  IN_PLAIN: x as given;  IN_NORM: rms_norm(x) * norm_w, computed by every block into shared memory
//   output OUT_STORE: y = x·Wᵀ (+ bias);  OUT_ADD: y += x·Wᵀ (+ bias) (the residual stream);
//          OUT_SILU: W is [gate | up] (N rows, N/2 each); one warp computes gate row n and up row n, and
//          y[m, n] = silu(gate) * up, so y is [M, N/2]
// Roundings follow transformers in bf16: the normed input and every projection output are bf16 before use.
#include "gemv_common.cuh"

#define GEMV_THREADS 256
#define GEMV_WARPS 8
#define GEMV_UNROLL 4

extern __shared__ __align__(16) unsigned char gemv_smem[];

// This lane's GEMV_UNROLL 16-byte chunks of the R weight rows of output column `col`, from chunk c0 on
// (zeros past the row's end or past the last column).
template <int R>
__device__ __forceinline__ void load_weights(const bf16* __restrict__ w, int col, int cols, int K, int c0, int step,
                                             uint4 wv[R][GEMV_UNROLL]) {
    const int chunks = K / 8;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint4* row = reinterpret_cast<const uint4*>(w + (size_t)(col + r * cols) * K);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int c = c0 + u * step;
            wv[r][u] = (col < cols && c < chunks) ? __ldg(row + c) : make_uint4(0, 0, 0, 0);
        }
    }
}

// grid: any (block-stride loop over row groups); block: GEMV_THREADS; dynamic shared memory: M * K * 2 bytes.
// K % 8 == 0; warps_per_row in {1, 2, 4, 8}; for OUT_SILU, N is the full [gate | up] height.
// The weights are software-pipelined: the next batch of loads is issued before the current one is used, and
// the first batch before the input is staged, so the input's latency hides behind the weights'.
template <int M, int IN, int OUT>
__device__ void gemv(const bf16* __restrict__ x, const float* __restrict__ norm_w, float eps,
                     const bf16* __restrict__ w, const float* __restrict__ bias, bf16* __restrict__ y, int N, int K,
                     int warps_per_row) {
    constexpr int R = OUT == OUT_SILU ? 2 : 1;  // weight rows per output column
    __shared__ float inv[M];
    __shared__ float sums[GEMV_WARPS][R][M];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_block = GEMV_WARPS / warps_per_row;
    const int part = warp % warps_per_row;
    const int cols = N / R;  // output columns
    const int chunks = K / 8, step = warps_per_row * 32, start = part * 32 + lane;
    const uint4* xv = reinterpret_cast<const uint4*>(xs);

    int first = blockIdx.x * rows_per_block;
    uint4 wv[R][GEMV_UNROLL];
    load_weights<R>(w, first + warp / warps_per_row, cols, K, start, step, wv);
    // The weights are constant, so their first loads may overlap the previous kernel (common.cuh). The next
    // kernel is released before the wait, so its own first loads start as soon as it finds room (two decode rows
    // on the H200: 4-10% faster per step; the bulk GEMV measured slower that way).
    pdl_launch_dependents();
    pdl_wait();
    stage_input<M, IN>(x, norm_w, eps, K, xs, inv);

    // Block-uniform loop, so the barriers inside are safe.
    for (; first < cols; first += gridDim.x * rows_per_block) {
        const int col = first + warp / warps_per_row;
        const int next_col = col + gridDim.x * rows_per_block;
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
        for (int c0 = start; c0 < chunks; c0 += GEMV_UNROLL * step) {
            uint4 cur[R][GEMV_UNROLL];
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) cur[r][u] = wv[r][u];
            const int next = c0 + GEMV_UNROLL * step;
            if (next < chunks) load_weights<R>(w, col, cols, K, next, step, wv);
            else load_weights<R>(w, next_col, cols, K, start, step, wv);
            if (col < cols) {
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) {
                    const int c = c0 + u * step;
                    if (c < chunks) {
#pragma unroll
                        for (int m = 0; m < M; m++) {
                            const uint4 xm = xv[m * chunks + c];
#pragma unroll
                            for (int r = 0; r < R; r++) acc[r][m] += dot8(cur[r][u], xm);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < M; m++) acc[r][m] = warp_sum(acc[r][m]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int m = 0; m < M; m++) sums[warp][r][m] = acc[r][m];
        }
        __syncthreads();
        if (part == 0 && lane < M && col < cols) {
            const int m = lane;
            float s[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                s[r] = 0.0f;
                for (int p = 0; p < warps_per_row; p++) s[r] += sums[warp + p][r][m];
            }
            gemv_store<OUT>(s, bias, y, cols, m, col, OldFromL2{y, cols});
        }
        __syncthreads();  // sums is reused by the next row group
    }
}

// One- and two-row projections are capped at 64 registers so 4 blocks fit on a multiprocessor: a Qwen3-0.6B
// QKV projection (512 blocks) then runs in one wave on an H200. The gate/up variants hold two weight rows per
// warp and would spill under that cap; larger M keeps whatever registers it needs.
#define GEMV_MIN_BLOCKS(M, OUT) ((OUT) != OUT_SILU && (M) <= 2 ? 4 : 1)

#define GEMV_VARIANT(M, IN, OUT, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS(M, OUT)) NAME##_m##M(              \
        const bf16* x, const float* norm_w, float eps, const bf16* w, const float* bias, bf16* y, int N, int K,  \
        int wpr) {                                                                                               \
        gemv<M, IN, OUT>(x, norm_w, eps, w, bias, y, N, K, wpr);                                                 \
    }

GEMV_ALL_ROWS(GEMV_VARIANT, gemv)

// keys[r] = max over v of (key(logits[r, v]) << 32 | ~v): the first maximum of each row, as the greedy sampler
// picks it (NaN never wins). keys must be zero before the launch. grid: (rows, blocks per row); V % 8 == 0.
extern "C" __global__ void argmax_rows(const bf16* __restrict__ logits, int V, unsigned long long* __restrict__ keys) {
    kernel_begin();
    __shared__ unsigned long long best_of_warp[32];
    const int r = blockIdx.x;
    const uint4* row = reinterpret_cast<const uint4*>(logits + (size_t)r * V);
    unsigned long long best = 0;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < V / 8; i += gridDim.y * blockDim.x) {
        const uint4 raw = __ldcg(row + i);
        const bf16* h = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const u32 id = i * 8 + j;
            const unsigned long long k = ((unsigned long long)order_key(__bfloat162float(h[j])) << 32) | (0xffffffffu - id);
            best = k > best ? k : best;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) best_of_warp[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x >> 5); i++) best = best_of_warp[i] > best ? best_of_warp[i] : best;
        atomicMax(keys + r, best);
    }
}
