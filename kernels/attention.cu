// Causal attention of every query token of a ragged batch against its sequence's paged KV cache. One code
// path serves decode (one token per sequence) and prefill over a cached prefix (each prompt token attends
// to positions 0..its own). Long contexts are split over blocks (split-K); the last block of a token to
// finish merges the partial softmaxes, so no second kernel (and no extra graph node) is needed.
#include "common.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / 32)
#define MIN_CHUNK 64

struct Partial {
    float m, l;
};

// Merge softmax state (m2, l2, acc2) into (m, l, acc).
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float mn = fmaxf(m, m2);
    const float c1 = m == -INFINITY ? 0.0f : __expf(m - mn);
    const float c2 = m2 == -INFINITY ? 0.0f : __expf(m2 - mn);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int i = 0; i < N; i++) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mn;
}

// grid: (tokens, num_kv_heads, max_splits); block: ATTN_THREADS. D = head_dim, G = query heads per kv head.
// seq_info holds 5 u32 per sequence: start, len, past_len, table_start, table_len.
// partial: tokens * num_heads * max_splits * (D + 2) floats; counters: tokens * num_kv_heads u32, all zero
// between launches (the merging block resets its counter).
template <int D, int G>
__device__ void paged_attention(const bf16* __restrict__ qkv, int width, const u32* __restrict__ positions,
                                const u32* __restrict__ token_seq, const u32* __restrict__ seq_info,
                                const u32* __restrict__ block_tables, const bf16* __restrict__ k_cache,
                                const bf16* __restrict__ v_cache, int block_size, int num_kv_heads, float scale,
                                bf16* __restrict__ out, float* __restrict__ partial, u32* __restrict__ counters) {
    constexpr int LANES = D / 8;            // lanes that share one position (16 bytes each)
    constexpr int GROUPS = 32 / LANES;      // positions per warp per step
    constexpr int NG = GROUPS * ATTN_WARPS; // positions per block per step
    __shared__ float sm[ATTN_WARPS][G][D + 2];
    __shared__ bool is_last;

    const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z, max_splits = gridDim.z;
    const int num_heads = num_kv_heads * G, kv_dim = num_kv_heads * D;
    const int ctx = positions[t] + 1;
    int chunk = (ctx + max_splits - 1) / max_splits;
    chunk = max(MIN_CHUNK, (chunk + MIN_CHUNK - 1) / MIN_CHUNK * MIN_CHUNK);
    const int nsplits = (ctx + chunk - 1) / chunk;
    if (split >= nsplits) return;
    const int begin = split * chunk, end = min(ctx, begin + chunk);
    const u32* table = block_tables + seq_info[token_seq[t] * 5 + 3];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % LANES, gi = lane / LANES;
    float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) {
        load8_cg(qkv + (size_t)t * width + (size_t)(g * G + h) * D + li * 8, q[h]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[h][i] *= scale;
            acc[h][i] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    // Warp-uniform trip count: lanes past `end` still join the shuffles.
    for (int base = begin + warp * GROUPS; base < end; base += NG) {
        const int p = base + gi;
        const bool valid = p < end;
        float k[8], v[8];
        if (valid) {
            const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
            const size_t at = slot * kv_dim + (size_t)g * D + li * 8;
            load8_cg(k_cache + at, k);
            load8_cg(v_cache + at, v);
        }
#pragma unroll
        for (int h = 0; h < G; h++) {
            float s = 0.0f;
            if (valid) {
#pragma unroll
                for (int i = 0; i < 8; i++) s += q[h][i] * k[i];
            }
#pragma unroll
            for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (valid) {
                const float mn = fmaxf(m[h], s);
                const float corr = __expf(m[h] - mn);  // m = -inf gives 0
                const float w = __expf(s - mn);
                l[h] = l[h] * corr + w;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] = acc[h][i] * corr + w * v[i];
                m[h] = mn;
            }
        }
    }
    // Merge the position groups of each warp (lanes li, li + LANES, ... hold the same dims).
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < G; h++) {
            float acc2[8];
            const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
#pragma unroll
            for (int i = 0; i < 8; i++) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[h][i], o);
            merge_state<8>(m[h], l[h], acc[h], m2, l2, acc2);
        }
    }
    // Merge the warps through shared memory; warp 0 ends up with the block's state.
    if (gi == 0) {
#pragma unroll
        for (int h = 0; h < G; h++) {
#pragma unroll
            for (int i = 0; i < 8; i++) sm[warp][h][li * 8 + i] = acc[h][i];
            if (li == 0) {
                sm[warp][h][D] = m[h];
                sm[warp][h][D + 1] = l[h];
            }
        }
    }
    __syncthreads();
    if (warp == 0 && gi == 0) {
#pragma unroll
        for (int h = 0; h < G; h++) {
            for (int w = 1; w < ATTN_WARPS; w++) {
                float acc2[8];
#pragma unroll
                for (int i = 0; i < 8; i++) acc2[i] = sm[w][h][li * 8 + i];
                merge_state<8>(m[h], l[h], acc[h], sm[w][h][D], sm[w][h][D + 1], acc2);
            }
        }
    }
    if (nsplits == 1) {
        if (warp == 0 && gi == 0) {
#pragma unroll
            for (int h = 0; h < G; h++) {
                float o[8];
                const float inv = 1.0f / l[h];
#pragma unroll
                for (int i = 0; i < 8; i++) o[i] = acc[h][i] * inv;
                store8(out + (size_t)t * num_heads * D + (size_t)(g * G + h) * D + li * 8, o);
            }
        }
        return;
    }
    // Split-K: publish this block's state, and let the last block of (token, kv head) merge them all.
    const size_t stride = D + 2;
    if (warp == 0 && gi == 0) {
#pragma unroll
        for (int h = 0; h < G; h++) {
            float* dst = partial + (((size_t)t * num_heads + g * G + h) * max_splits + split) * stride;
#pragma unroll
            for (int i = 0; i < 8; i++) dst[2 + li * 8 + i] = acc[h][i];
            if (li == 0) {
                dst[0] = m[h];
                dst[1] = l[h];
            }
        }
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 ticket = atomicAdd(&counters[t * num_kv_heads + g], 1u);
        is_last = ticket == (u32)nsplits - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // G * D outputs, one per thread per step.
    for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
        const int h = e / D, d = e % D;
        const float* base = partial + ((size_t)t * num_heads + g * G + h) * max_splits * stride;
        float mx = -INFINITY;
        for (int s = 0; s < nsplits; s++) mx = fmaxf(mx, __ldcg(base + s * stride));
        float lsum = 0.0f, osum = 0.0f;
        for (int s = 0; s < nsplits; s++) {
            const float c = __expf(__ldcg(base + s * stride) - mx);
            lsum += __ldcg(base + s * stride + 1) * c;
            osum += __ldcg(base + s * stride + 2 + d) * c;
        }
        out[(size_t)t * num_heads * D + (size_t)(g * G + h) * D + d] = __float2bfloat16(osum / lsum);
    }
    if (threadIdx.x == 0) counters[t * num_kv_heads + g] = 0;
}

#define ATTENTION_KERNEL(D, G)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS) paged_attention_d##D##_g##G(                    \
        const bf16* qkv, int width, const u32* positions, const u32* token_seq, const u32* seq_info,           \
        const u32* block_tables, const bf16* k_cache, const bf16* v_cache, int block_size, int num_kv_heads,    \
        float scale, bf16* out, float* partial, u32* counters) {                                                \
        paged_attention<D, G>(qkv, width, positions, token_seq, seq_info, block_tables, k_cache, v_cache,      \
                              block_size, num_kv_heads, scale, out, partial, counters);                         \
    }

ATTENTION_KERNEL(64, 1)
ATTENTION_KERNEL(64, 2)
ATTENTION_KERNEL(64, 3)
ATTENTION_KERNEL(64, 4)
ATTENTION_KERNEL(64, 8)
ATTENTION_KERNEL(128, 1)
ATTENTION_KERNEL(128, 2)
ATTENTION_KERNEL(128, 4)
ATTENTION_KERNEL(128, 8)
