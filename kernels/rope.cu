// Per-head q/k RMSNorm (Qwen3), RoPE in place on fused [q | k | v] rows, and the write of K and V into the
// paged cache, for every token of a batch (prefill; decode rotates inside the attention, kernels/attention.cuh).
#include "kv_cache.cuh"
#include "rope.cuh"

// One block per token, one warp per head at a time: the per-head norm is a warp reduction (no block barrier
// between heads), and the token's rotation angles, which every q and k head of it shares, are computed once into
// shared memory: with every head computing its own (powf and sincosf per pair), a Qwen3-0.6B prefill of ~7,500
// tokens took 147 µs a layer here, against 87 µs now (benchmarks/RESULTS.md).
#define ROPE_WARPS 8
#define ROPE_PRELOAD 2  // head groups a warp of the vectorized path has in flight at once

// The heads of one token with 16-byte loads and stores, for head_dim / 8 a power of two up to 32 (64, 128, 256): a
// head's eight-value chunks sit in head_dim / 8 neighbouring lanes, so one warp takes 32 / (head_dim / 8) heads of
// the row at a time in one coalesced load, and its ROPE_PRELOAD groups are in flight together. A value i of the
// first half pairs with i + head_dim / 2, which sits head_dim / 16 lanes on (a shuffle). The roundings are
// rope_head's; the sum of squares for the q/k norm is added in another order (the last bit of 1/rms may differ).
template <typename KV>
__device__ __forceinline__ void rope_heads_vectorized(bf16* row, int heads, int num_heads, int num_kv_heads,
                                                      int head_dim, const float* __restrict__ q_norm,
                                                      const float* __restrict__ k_norm, int has_norm, float eps,
                                                      const float2* s_angle, u32 slot, KV* __restrict__ k_cache,
                                                      KV* __restrict__ v_cache, int block_size) {
    using Vec = KvVec8<KV>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lanes_per_head = head_dim / 8, per_warp = 32 / lanes_per_head, half_lanes = lanes_per_head / 2;
    const int sub = lane / lanes_per_head, chunk = lane % lanes_per_head;
    const bool first_half = chunk < half_lanes;
    const int pair0 = (first_half ? chunk : chunk - half_lanes) * 8;  // this lane's first pair index
    const int groups = (heads + per_warp - 1) / per_warp;
    for (int base = warp; base < groups; base += ROPE_PRELOAD * ROPE_WARPS) {
        uint4 raw[ROPE_PRELOAD];
#pragma unroll
        for (int j = 0; j < ROPE_PRELOAD; j++) {
            const int h = (base + j * ROPE_WARPS) * per_warp + sub;
            raw[j] = h < heads ? __ldcg(reinterpret_cast<const uint4*>(row + (size_t)h * head_dim) + chunk)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < ROPE_PRELOAD; j++) {
            if (base + j * ROPE_WARPS >= groups) break;  // warp-uniform
            const int h = (base + j * ROPE_WARPS) * per_warp + sub;
            const bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
            float v[8];
            unpack8(raw[j], v);
            // Every lane joins the shuffles (a V head's or a padding lane's results are not used).
            float ss = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) ss += v[e] * v[e];
            for (int o = half_lanes; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float* norm_w = has_norm && !is_v ? (is_q ? q_norm : k_norm) : nullptr;
            if (norm_w) {
                const float inv = rsqrtf(ss / head_dim + eps);
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = bf16r(norm_w[chunk * 8 + e] * bf16r(v[e] * inv));
            }
            float other[8];
#pragma unroll
            for (int e = 0; e < 8; e++) other[e] = __shfl_xor_sync(0xffffffffu, v[e], half_lanes);
            if (h >= heads) continue;
            const int kv_head = is_v ? h - num_heads - num_kv_heads : h - num_heads;
            const size_t cache_at = cache_offset(slot, kv_head, num_kv_heads, block_size, head_dim) + chunk * 8;
            if (is_v) {
                *reinterpret_cast<Vec*>(v_cache + cache_at) = kv_pack8<KV>(raw[j]);
                continue;
            }
            u32 out[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                float r[2];
#pragma unroll
                for (int d = 0; d < 2; d++) {
                    const float2 cs = s_angle[pair0 + e + d];
                    // First half: lo * cos - hi * sin; second half: hi * cos + lo * sin (rope_head's roundings).
                    r[d] = first_half ? bf16r(v[e + d] * cs.x) + bf16r(-other[e + d] * cs.y)
                                      : bf16r(v[e + d] * cs.x) + bf16r(other[e + d] * cs.y);
                }
                out[e / 2] = pack_bf16(r[0], r[1]);
            }
            const uint4 rotated = make_uint4(out[0], out[1], out[2], out[3]);
            reinterpret_cast<uint4*>(row + (size_t)h * head_dim)[chunk] = rotated;
            if (!is_q) *reinterpret_cast<Vec*>(k_cache + cache_at) = kv_pack8<KV>(rotated);
        }
    }
}

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
    bf16* const row = qkv + (size_t)t * width;
    const int heads = num_heads + 2 * num_kv_heads;
    const int lanes_per_head = head_dim / 8;
    if ((lanes_per_head & (lanes_per_head - 1)) == 0 && lanes_per_head >= 2 && lanes_per_head <= 32) {
        rope_heads_vectorized<KV>(row, heads, num_heads, num_kv_heads, head_dim, q_norm, k_norm, has_norm, eps,
                                  s_angle, slot, k_cache, v_cache, block_size);
        return;
    }
    const auto angle = [&](int i) { return s_angle[i]; };
    for (int h = warp; h < heads; h += ROPE_WARPS) {
        const bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
        const int kv_head = is_v ? h - num_heads - num_kv_heads : h - num_heads;
        const size_t cache_at = cache_offset(slot, kv_head, num_kv_heads, block_size, head_dim);
        bf16* head = row + (size_t)h * head_dim;
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
