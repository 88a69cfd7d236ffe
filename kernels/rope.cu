// Per-head q/k RMSNorm (Qwen3), RoPE in place on fused [q | k | v] rows, and the write of K and V into the
// paged cache, for every token of a batch (prefill; decode rotates inside the attention, kernels/attention.cuh).
#include "kv_cache.cuh"
#include "rope.cuh"

// One block per token, one warp per head at a time: the per-head norm is a warp reduction (no block barrier
// between heads), and the token's rotation angles, which every q and k head of it shares, are computed once into
// shared memory: with every head computing its own (powf and sincosf per pair), a Qwen3-0.6B prefill of ~7,500
// tokens took 147 µs a layer here, against 87 µs now (benchmarks/RESULTS.md).
#define ROPE_WARPS 8

// grid: (tokens); block: 32 * ROPE_WARPS. head_dim even, <= 256 (rope.cuh), and a multiple of 8 (V heads are
// copied 8 values per lane). KV: the cache's element type.
template <typename KV>
__device__ void rope_write_kv(bf16* __restrict__ qkv, int width, const float* __restrict__ q_norm,
                              const float* __restrict__ k_norm, int has_norm, float eps, const u32* __restrict__ positions,
                              const u32* __restrict__ slots, KV* __restrict__ k_cache, KV* __restrict__ v_cache,
                              int num_heads, int num_kv_heads, int head_dim, float theta,
                              const float* __restrict__ inv_freq, int block_size) {
    using Vec = KvVec8<KV>;
    __shared__ float2 s_angle[32 * ROPE_PAIRS];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Batch metadata may be read before the wait (common.cuh says why), and the angles depend on nothing else.
    const float pos = (float)positions[t];
    const u32 slot = slots[t];
    for (int i = threadIdx.x; i < head_dim / 2; i += blockDim.x) s_angle[i] = rope_angle(i, pos, theta, head_dim, inv_freq);
    kernel_begin();
    __syncthreads();
    const auto angle = [&](int i) { return s_angle[i]; };
    for (int h = warp; h < num_heads + 2 * num_kv_heads; h += ROPE_WARPS) {
        const bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
        const int kv_head = is_v ? h - num_heads - num_kv_heads : h - num_heads;
        const size_t cache_at = cache_offset(slot, kv_head, num_kv_heads, block_size, head_dim);
        bf16* head = qkv + (size_t)t * width + (size_t)h * head_dim;
        if (is_v) {
            Vec* dst = reinterpret_cast<Vec*>(v_cache + cache_at);
            for (int i = lane; i < head_dim / 8; i += 32) dst[i] = kv_pack8<KV>(__ldcg(reinterpret_cast<const uint4*>(head) + i));
            continue;
        }
        const float* norm_w = has_norm ? (is_q ? q_norm : k_norm) : nullptr;
        KV* kdst = k_cache + cache_at;  // only written for K heads
        rope_head(head, norm_w, eps, head_dim, lane, angle, [&](int i, bf16 v) {
            head[i] = v;
            if (!is_q) kdst[i] = kv_from_bf16<KV>(v);
        });
    }
}

#define ROPE_KERNEL(NAME, KV)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * ROPE_WARPS)                                                  \
        NAME(bf16* __restrict__ qkv, int width, const float* __restrict__ q_norm,                                  \
             const float* __restrict__ k_norm, int has_norm, float eps, const u32* __restrict__ positions,         \
             const u32* __restrict__ slots, KV* __restrict__ k_cache, KV* __restrict__ v_cache, int num_heads,     \
             int num_kv_heads, int head_dim, float theta, const float* __restrict__ inv_freq, int block_size) {    \
        rope_write_kv<KV>(qkv, width, q_norm, k_norm, has_norm, eps, positions, slots, k_cache, v_cache,          \
                          num_heads, num_kv_heads, head_dim, theta, inv_freq, block_size);                         \
    }

ROPE_KERNEL(rope_write_kv_bf16, bf16)
ROPE_KERNEL(rope_write_kv_fp8, fp8)
