// Decode-batch projections on tensor cores: y[M, N] = x[M, K] · W[N, K]ᵀ for 3 to 16 rows by default (the host's
// skinny_gemm.rs picks), where cuBLAS is latency-bound (on the H200 a Qwen3-0.6B layer's four projections took
// 25-29 µs at 8-256 rows against 6.6 µs for their weights, benchmarks/cublas_gemm.py) and the CUDA-core GEMV
// kernels lose from 3 rows on.
//
// The product is computed transposed, yᵀ = W · xᵀ, as m16n8k16 mma tiles: 16 weight rows (output columns) are the
// A operand, 8 tokens the B operand. Both come straight from global memory into registers in 16-byte loads: lane
// (g, t) loads 8 consecutive k of weight rows g and g + 8 and of token g. Those 8 physical k fill the lane's
// fragment slots of two k-steps (see load_weights); since A and B use the same permutation, the dot products are
// unchanged. A warp owns two A tiles (32 weight rows, or the 16 gate and 16 up rows of 16 SiLU outputs) and up to
// 32 tokens (NT tiles of 8; more tokens take more blocks, which run side by side and share the weights in L2). It
// walks its chunks of 32 k with the next two chunks' weights and the next chunk's tokens in flight. The block's 8
// warps split its k range and are summed in shared memory; when there are too few output tiles to fill the GPU,
// blocks split K further (grid.z) and the last block of a tile to finish adds the others' partial sums (the
// split-K scheme of kernels/attention.cuh).
//
// Prologues and epilogues are those of the GEMV kernels (gemv_common.cuh), with the same roundings:
//   IN_NORM: x is replaced by rms_norm(x) (a warp per token sums its squares, as the GEMV does, after the PDL
//   wait; each chunk of tokens is normalized in registers as it arrives), so no RMSNorm kernel runs before it;
//   OUT_STORE: y = x·Wᵀ (+ bias);  OUT_ADD: y += x·Wᵀ (+ bias) (the residual stream);
//   OUT_SILU: W is [gate | up] (N rows, N/2 each), y[m, n] = silu(gate) * up, so y is [M, N/2].
#include "gemv_common.cuh"

#define SKINNY_THREADS 256
#define SKINNY_WARPS 8
#define SKINNY_TOKENS 32  // tokens per block (grid.x takes the rest)
#define CHUNK_K 32        // k per load: 4 lanes x 8

extern __shared__ __align__(16) float skinny_smem[];

// Lane (g, t)'s 16 bytes of chunk c: weight rows g and g + 8 of both A tiles, and token g of each token tile
// (zeros past the last token). For k-step s of the chunk the lane's A slots (k 2t, 2t+1 | 2t+8, 2t+9) hold the
// physical k 8t + 4s + (0, 1 | 2, 3), and so do its B slots.
__device__ __forceinline__ void load_weights(const bf16* __restrict__ w, const int row[2], int K, int c, int g, int t,
                                             uint4 wv[2][2]) {
    const int k = c * CHUNK_K + 8 * t;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) wv[i][h] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)(row[i] + g + 8 * h) * K + k));
}

// Lane (g, t)'s tokens of chunk c, and for IN_NORM the chunk's 8 RMSNorm weights they are multiplied by.
template <int NT>
struct TokenChunk {
    uint4 x[NT];
    float4 norm[2];
};

template <int NT, int IN>
__device__ __forceinline__ void load_tokens(const bf16* __restrict__ x, const float* __restrict__ norm_w, int m0, int M,
                                            int K, int c, int g, int t, TokenChunk<NT>& chunk) {
    const int k = c * CHUNK_K + 8 * t;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int m = m0 + 8 * j + g;
        chunk.x[j] = m < M ? __ldcg(reinterpret_cast<const uint4*>(x + (size_t)m * K + k)) : make_uint4(0, 0, 0, 0);
    }
    if (IN == IN_NORM) {
        chunk.norm[0] = __ldg(reinterpret_cast<const float4*>(norm_w + k));
        chunk.norm[1] = __ldg(reinterpret_cast<const float4*>(norm_w + k + 4));
    }
}

// rms_norm of the chunk's tokens in place: norm_w * bf16(x * inv), rounded to bf16 (the GEMV's stage_input).
// inv[j]: this lane's token of tile j (0 past the last token, whose x are zeros anyway).
template <int NT>
__device__ __forceinline__ void normalize_tokens(TokenChunk<NT>& chunk, const float inv[NT]) {
    const float w[8] = {chunk.norm[0].x, chunk.norm[0].y, chunk.norm[0].z, chunk.norm[0].w,
                        chunk.norm[1].x, chunk.norm[1].y, chunk.norm[1].z, chunk.norm[1].w};
#pragma unroll
    for (int j = 0; j < NT; j++) {
        float v[8];
        unpack8(chunk.x[j], v);
        u32* out = reinterpret_cast<u32*>(&chunk.x[j]);
#pragma unroll
        for (int i = 0; i < 4; i++) out[i] = pack_bf16(w[2 * i] * bf16r(v[2 * i] * inv[j]), w[2 * i + 1] * bf16r(v[2 * i + 1] * inv[j]));
    }
}

// 1 / rms of each of the block's tokens m0.. (a warp per token, summed as the GEMV sums a row), 0 past the last.
__device__ __forceinline__ void token_inverse_rms(const bf16* __restrict__ x, int m0, int M, int K, float eps, float* inv) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = warp; i < SKINNY_TOKENS; i += SKINNY_WARPS) {
        if (m0 + i >= M) {
            if (lane == 0) inv[i] = 0.0f;
            continue;
        }
        const uint4* row = reinterpret_cast<const uint4*>(x + (size_t)(m0 + i) * K);
        const float r = warp_inverse_rms([&](int c) { return __ldcg(row + c); }, K, eps);
        if (lane == 0) inv[i] = r;
    }
}

// acc[i][j] += A tile i · B tile j over one chunk (two k-steps).
template <int NT>
__device__ __forceinline__ void chunk_product(const uint4 wv[2][2], const uint4 xv[NT], float acc[2][NT][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 a0[4] = {wv[i][0].x, wv[i][1].x, wv[i][0].y, wv[i][1].y};
        const u32 a1[4] = {wv[i][0].z, wv[i][1].z, wv[i][0].w, wv[i][1].w};
#pragma unroll
        for (int j = 0; j < NT; j++) {
            mma_bf16(acc[i][j], a0, xv[j].x, xv[j].y);
            mma_bf16(acc[i][j], a1, xv[j].z, xv[j].w);
        }
    }
}

// grid: (token chunks of 32, output tiles, splits): the token chunks of one output tile run side by side and share
// its weights through L2. block: SKINNY_THREADS; dynamic shared memory:
// SKINNY_WARPS * 2 * NT * 128 floats. K % 32 == 0; N % 32 == 0 (OUT_SILU: N / 2 % 16 == 0); IN_NORM: norm_w K
// floats, 16-byte aligned.
// partial: splits * 2 * NT * 128 floats per (output tile, token chunk); counters: one per (output tile, token
// chunk), zero between launches (the block that adds the partial sums resets its counter).
template <int NT, int IN, int OUT>
__device__ void skinny_gemm(const bf16* __restrict__ x, const float* __restrict__ norm_w, float eps,
                            const bf16* __restrict__ w, const float* __restrict__ bias, bf16* __restrict__ y, int M,
                            int N, int K, float* __restrict__ partial, u32* __restrict__ counters) {
    constexpr int E = NT * 128;  // accumulator entries of one A tile: (token tile, register, lane)
    __shared__ float s_inv[IN == IN_NORM ? SKINNY_TOKENS : 1];
    float(*red)[2][E] = reinterpret_cast<float(*)[2][E]>(skinny_smem);  // [warp][tile][entry]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int cols = OUT == OUT_SILU ? N / 2 : N;
    const int c0 = blockIdx.y * (OUT == OUT_SILU ? 16 : 32);  // first output column of this block
    const int row[2] = {c0, OUT == OUT_SILU ? cols + c0 : c0 + 16};
    const int m0 = blockIdx.x * SKINNY_TOKENS;
    const int splits = gridDim.z, split = blockIdx.z;

    // This warp's chunks: the block's share of K, then the warp's share of that.
    const int chunks = K / CHUNK_K;
    const int b_lo = split * chunks / splits, b_n = (split + 1) * chunks / splits - b_lo;
    const int lo = b_lo + warp * b_n / SKINNY_WARPS, hi = b_lo + (warp + 1) * b_n / SKINNY_WARPS;

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;

    // Weights two chunks ahead of the product (the first two issued before the PDL wait: they are constant),
    // tokens one chunk ahead.
    uint4 wa[2][2], wb[2][2];
    TokenChunk<NT> xa, xb;
    if (lo < hi) load_weights(w, row, K, lo, g, t, wa);
    if (lo + 1 < hi) load_weights(w, row, K, lo + 1, g, t, wb);
    kernel_begin();
    float inv[NT];
    if (IN == IN_NORM) {
        token_inverse_rms(x, m0, M, K, eps, s_inv);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NT; j++) inv[j] = s_inv[8 * j + g];
    }
    if (lo < hi) load_tokens<NT, IN>(x, norm_w, m0, M, K, lo, g, t, xa);
    for (int c = lo; c < hi; c++) {
        if (c + 1 < hi) load_tokens<NT, IN>(x, norm_w, m0, M, K, c + 1, g, t, xb);
        if (IN == IN_NORM) normalize_tokens<NT>(xa, inv);
        chunk_product<NT>(wa, xa.x, acc);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) wa[i][h] = wb[i][h];
        xa = xb;
        if (c + 2 < hi) load_weights(w, row, K, c + 2, g, t, wb);
    }

    // Sum the warps: entry e = (token tile j, register r, lane) of tile i.
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) red[warp][i][(j * 4 + r) * 32 + lane] = acc[i][j][r];
    __syncthreads();
    constexpr int Q = (E + SKINNY_THREADS - 1) / SKINNY_THREADS;  // entries per thread
    float sum[Q][2];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int e = threadIdx.x + q * SKINNY_THREADS;
        if (e >= E) continue;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < SKINNY_WARPS; v++) s += red[v][i][e];
            sum[q][i] = s;
        }
    }

    if (splits > 1) {
        // Publish this split's sums; the last split of the tile to finish adds them all.
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float* mine = partial + ((size_t)tile * splits + split) * 2 * E;
#pragma unroll
        for (int q = 0; q < Q; q++) {
            const int e = threadIdx.x + q * SKINNY_THREADS;
            if (e >= E) continue;
            __stcg(mine + e, sum[q][0]);
            __stcg(mine + E + e, sum[q][1]);
        }
        if (!last_split_ticket(&counters[tile], splits)) return;
        const float* all = partial + (size_t)tile * splits * 2 * E;
#pragma unroll
        for (int q = 0; q < Q; q++) {
            const int e = threadIdx.x + q * SKINNY_THREADS;
            if (e >= E) continue;
            float s0 = 0.0f, s1 = 0.0f;
            for (int p = 0; p < splits; p++) {
                s0 += __ldcg(all + (size_t)p * 2 * E + e);
                s1 += __ldcg(all + (size_t)p * 2 * E + E + e);
            }
            sum[q][0] = s0;
            sum[q][1] = s1;
        }
        if (threadIdx.x == 0) counters[tile] = 0;
    }

#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int e = threadIdx.x + q * SKINNY_THREADS;
        const int l = e & 31, r = (e >> 5) & 3, j = e >> 7;
        const int m = m0 + 8 * j + 2 * (l & 3) + (r & 1);
        const int off = (l >> 2) + (r >= 2 ? 8 : 0);  // row within the A tile
        if (e >= E || m >= M) continue;
        if (OUT == OUT_SILU) {
            gemv_store<OUT>(sum[q], bias, y, cols, m, c0 + off, OldFromL2{y, cols});
        } else {
#pragma unroll
            for (int i = 0; i < 2; i++) gemv_store<OUT>(&sum[q][i], bias, y, cols, m, c0 + 16 * i + off, OldFromL2{y, cols});
        }
    }
}

// At most 128 registers, so two blocks fit on a multiprocessor (up to 64 tokens per block took 134-196 and one).
#define SKINNY_VARIANT(NT, IN, OUT, NAME)                                                                       \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, 2) NAME##_t##NT(                               \
        const bf16* x, const float* norm_w, float eps, const bf16* w, const float* bias, bf16* y, int M, int N,  \
        int K, float* partial, u32* counters) {                                                                 \
        skinny_gemm<NT, IN, OUT>(x, norm_w, eps, w, bias, y, M, N, K, partial, counters);                       \
    }
#define SKINNY_KINDS(NT)                                                \
    SKINNY_VARIANT(NT, IN_PLAIN, OUT_STORE, skinny_gemm_store)          \
    SKINNY_VARIANT(NT, IN_PLAIN, OUT_ADD, skinny_gemm_add)              \
    SKINNY_VARIANT(NT, IN_PLAIN, OUT_SILU, skinny_gemm_silu)            \
    SKINNY_VARIANT(NT, IN_NORM, OUT_STORE, skinny_gemm_norm_store)      \
    SKINNY_VARIANT(NT, IN_NORM, OUT_SILU, skinny_gemm_norm_silu)

SKINNY_KINDS(1)
SKINNY_KINDS(2)
SKINNY_KINDS(3)
SKINNY_KINDS(4)
