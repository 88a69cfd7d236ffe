// The per-head q/k RMSNorm (Qwen3) and RoPE (neox / rotate_half) of one head, by one warp: shared by the RoPE
// kernel (every token of a batch) and the decode attention, which rotates its own q and k (kernels/rope.cu,
// kernels/attention.cuh). The roundings follow transformers in bf16: the normed values are bf16, cos/sin are
// rounded to bf16, and q*cos and rotate_half(q)*sin are each rounded before their sum.
#pragma once
#include "common.cuh"

// Pairs (i, i + half) per lane: head_dim <= 256.
#define ROPE_PAIRS 4

// The rotation of pair (i, i + head_dim / 2) at position `pos`: (cos, sin), each rounded to bf16.
// `scaled` (when set) holds each pair's inverse frequency of a scaled RoPE, computed on the host in transformers'
// f32 order (rust/core/src/model/rope.rs).
__device__ __forceinline__ float2 rope_angle(int i, float pos, float theta, int head_dim, const float* scaled) {
    // inv_freq = 1 / theta^(2i/d) in f32, angle = position * inv_freq in f32, as transformers forms them.
    const float inv_freq = scaled ? scaled[i] : 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
    float s, c;
    sincosf(pos * inv_freq, &s, &c);
    return make_float2(bf16r(c), bf16r(s));
}

// Rotate the head_dim values at `head` (bf16), normalizing them first when norm_w is set; `angle(i)` gives pair
// i's (cos, sin) (rope_angle at the token's position). Every lane of the warp calls it, and `emit(i, value)`
// receives each rotated value once. A lane reads its pairs before it emits them, so `emit` may write back into
// `head`.
template <typename Angle, typename Emit>
__device__ __forceinline__ void rope_head(const bf16* head, const float* __restrict__ norm_w, float eps, int head_dim,
                                          int lane, Angle angle, Emit emit) {
    const int half = head_dim / 2;
    float lo[ROPE_PAIRS], hi[ROPE_PAIRS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < ROPE_PAIRS; j++) {
        const int i = lane + 32 * j;
        lo[j] = i < half ? __bfloat162float(head[i]) : 0.0f;
        hi[j] = i < half ? __bfloat162float(head[i + half]) : 0.0f;
        ss += lo[j] * lo[j] + hi[j] * hi[j];
    }
    if (norm_w) {
        const float inv = rsqrtf(warp_sum(ss) / head_dim + eps);
#pragma unroll
        for (int j = 0; j < ROPE_PAIRS; j++) {
            const int i = lane + 32 * j;
            if (i < half) {
                lo[j] = bf16r(norm_w[i] * bf16r(lo[j] * inv));
                hi[j] = bf16r(norm_w[i + half] * bf16r(hi[j] * inv));
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ROPE_PAIRS; j++) {
        const int i = lane + 32 * j;
        if (i >= half) continue;
        const float2 cs = angle(i);
        const float c = cs.x, s = cs.y;
        emit(i, __float2bfloat16(bf16r(lo[j] * c) + bf16r(-hi[j] * s)));
        emit(i + half, __float2bfloat16(bf16r(hi[j] * c) + bf16r(lo[j] * s)));
    }
}

// Where one head of one slot starts in a paged cache laid out [block][kv head][position in block][head_dim]
// (attention reads one head's positions of a block as one contiguous run).
__device__ __forceinline__ size_t cache_offset(u32 slot, int kv_head, int num_kv_heads, int block_size, int head_dim) {
    return (((size_t)(slot / block_size) * num_kv_heads + kv_head) * block_size + slot % block_size) * head_dim;
}
