// Per-head q/k RMSNorm (Qwen3), RoPE (neox / rotate_half) in place on fused [q | k | v] rows, and the write
// of K and V into the paged cache. The roundings follow transformers in bf16: cos/sin are rounded to bf16,
// and q*cos and rotate_half(q)*sin are each rounded before their sum.
#include "common.cuh"

// grid: (tokens, num_heads + 2 * num_kv_heads); block: 64 threads (head_dim <= 256, even).
extern "C" __global__ void rope_write_kv(bf16* __restrict__ qkv, int width, const float* __restrict__ q_norm,
                                         const float* __restrict__ k_norm, int has_norm, float eps,
                                         const u32* __restrict__ positions, const u32* __restrict__ slots,
                                         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int num_heads,
                                         int num_kv_heads, int head_dim, float theta) {
    kernel_begin();
    __shared__ float scratch[32];
    const int t = blockIdx.x, h = blockIdx.y;
    const int half = head_dim / 2, kv_dim = num_kv_heads * head_dim;
    const bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
    bf16* head = qkv + (size_t)t * width + (size_t)h * head_dim;
    const size_t slot_base = (size_t)slots[t] * kv_dim;
    if (is_v) {
        bf16* dst = v_cache + slot_base + (size_t)(h - num_heads - num_kv_heads) * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = head[i];
        return;
    }
    // Each thread owns pairs (i, i + half) for i = tid, tid + 64, ...; at most 2 pairs for head_dim 256.
    float lo[2], hi[2];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        lo[j] = i < half ? __bfloat162float(head[i]) : 0.0f;
        hi[j] = i < half ? __bfloat162float(head[i + half]) : 0.0f;
        ss += lo[j] * lo[j] + hi[j] * hi[j];
    }
    if (has_norm) {
        const float inv = rsqrtf(block_sum(ss, scratch) / head_dim + eps);
        const float* w = is_q ? q_norm : k_norm;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < half) {
                lo[j] = bf16r(w[i] * bf16r(lo[j] * inv));
                hi[j] = bf16r(w[i + half] * bf16r(hi[j] * inv));
            }
        }
    }
    const float pos = (float)positions[t];
    bf16* kdst = k_cache + slot_base + (size_t)(h - num_heads) * head_dim;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int i = threadIdx.x + j * blockDim.x;
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
