// Per-head q/k RMSNorm (Qwen3), RoPE (neox / rotate_half) in place on fused [q | k | v] rows, and the write
// of K and V into the paged cache. The roundings follow transformers in bf16: cos/sin are rounded to bf16,
// and q*cos and rotate_half(q)*sin are each rounded before their sum.
#include "common.cuh"

// One warp per head, ROPE_WARPS heads per block: the per-head norm is a warp reduction (no block barrier), and
// a large decode batch launches few enough blocks to run in one wave.
#define ROPE_WARPS 4
// Pairs (i, i + half) per lane: head_dim <= 256.
#define ROPE_PAIRS 4

// grid: (tokens, ceil((num_heads + 2 * num_kv_heads) / ROPE_WARPS)); block: 32 * ROPE_WARPS. head_dim even,
// <= 256, and a multiple of 8 (V heads are copied 16 bytes per lane).
extern "C" __global__ void __launch_bounds__(32 * ROPE_WARPS)
    rope_write_kv(bf16* __restrict__ qkv, int width, const float* __restrict__ q_norm,
                  const float* __restrict__ k_norm, int has_norm, float eps, const u32* __restrict__ positions,
                  const u32* __restrict__ slots, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                  int num_heads, int num_kv_heads, int head_dim, float theta, int block_size) {
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int h = blockIdx.y * ROPE_WARPS + (threadIdx.x >> 5);
    // Batch metadata may be read before the wait (common.cuh says why).
    const float pos = (float)positions[t];
    const u32 slot = slots[t];
    pdl_wait();
    pdl_launch_dependents();
    if (h >= num_heads + 2 * num_kv_heads) return;
    const int half = head_dim / 2;
    const bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
    // The cache is [block][kv head][position in block][head_dim] (attention reads one head's positions of a
    // block as one contiguous run); this head of this slot starts at:
    const int kv_head = is_v ? h - num_heads - num_kv_heads : h - num_heads;
    const size_t cache_at =
        (((size_t)(slot / block_size) * num_kv_heads + kv_head) * block_size + slot % block_size) * head_dim;
    bf16* head = qkv + (size_t)t * width + (size_t)h * head_dim;
    if (is_v) {
        uint4* dst = reinterpret_cast<uint4*>(v_cache + cache_at);
        for (int i = lane; i < head_dim / 8; i += 32) dst[i] = __ldcg(reinterpret_cast<const uint4*>(head) + i);
        return;
    }
    float lo[ROPE_PAIRS], hi[ROPE_PAIRS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < ROPE_PAIRS; j++) {
        const int i = lane + 32 * j;
        lo[j] = i < half ? __bfloat162float(head[i]) : 0.0f;
        hi[j] = i < half ? __bfloat162float(head[i + half]) : 0.0f;
        ss += lo[j] * lo[j] + hi[j] * hi[j];
    }
    if (has_norm) {
        const float inv = rsqrtf(warp_sum(ss) / head_dim + eps);
        const float* w = is_q ? q_norm : k_norm;
#pragma unroll
        for (int j = 0; j < ROPE_PAIRS; j++) {
            const int i = lane + 32 * j;
            if (i < half) {
                lo[j] = bf16r(w[i] * bf16r(lo[j] * inv));
                hi[j] = bf16r(w[i + half] * bf16r(hi[j] * inv));
            }
        }
    }
    bf16* kdst = k_cache + cache_at;  // only written for K heads
#pragma unroll
    for (int j = 0; j < ROPE_PAIRS; j++) {
        const int i = lane + 32 * j;
        if (i >= half) continue;
        // inv_freq = 1 / theta^(2i/d) in f32, angle = position * inv_freq in f32, as transformers forms them.
        const float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
        float s, c;
        sincosf(pos * inv_freq, &s, &c);
        c = bf16r(c);
        s = bf16r(s);
        const bf16 new_lo = __float2bfloat16(bf16r(lo[j] * c) + bf16r(-hi[j] * s));
        const bf16 new_hi = __float2bfloat16(bf16r(hi[j] * c) + bf16r(lo[j] * s));
        head[i] = new_lo;
        head[i + half] = new_hi;
        if (!is_q) {
            kdst[i] = new_lo;
            kdst[i + half] = new_hi;
        }
    }
}
