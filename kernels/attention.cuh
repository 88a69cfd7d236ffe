// Causal attention of every query token of a ragged batch against its sequence's paged KV cache. One code
// path serves decode (one token per sequence) and prefill over a cached prefix (each prompt token attends
// to positions 0..its own). Long contexts are split over blocks (split-K); the last block of a token to
// finish merges the partial softmaxes, so no second kernel (and no extra graph node) is needed.
//
// Latency is what matters at small batch: every dependent global load is a round trip (~0.5-1 us), so
// the kernel is laid out to need as few as possible. Each lane issues the K and V loads of U positions
// before it uses any of them (2*U vector loads in flight per lane, NG * U positions per block per step),
// the block-table entries of the next step are fetched while the current one computes, and the split-K
// merge reads all partial states of a (token, head) at once. A decode token with a short context costs:
// metadata (positions/token_seq/q, then seq_info, then the block table), one K/V round trip, and, when
// split, the partial store + one acquire-release ticket + one read of the partials.
//
// The kernels are instantiated for a bf16 cache (attention.cu) and for an fp8 one (attention_fp8.cu, its own PTX
// module, loaded only when a model uses an fp8 cache; kernels/kv_cache.cuh): a lane then loads 8 values of a
// position as 8 bytes, or 16 as one 16-byte load (AttnConfig::VALS), and widens them to f32 like bf16 ones.
//
// The paged_attention_rope kernels serve decode batches (one query token per sequence) and take the place
// of the RoPE kernel there: each block rotates its group's query heads itself, and the block holding the
// newest position rotates that token's K and writes K and V to the cache before it reads them back. When the
// cache's block size is a multiple of 16, decode batches take paged_attention_mma_rope instead: the same
// kernel around a main loop on tensor cores (kernels/attention_mma.cuh), which reads the cache at a higher
// fraction of its bandwidth (benchmarks/RESULTS.md).
#pragma once
#include "kv_cache.cuh"
#include "rope.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / 32)
// Smallest number of positions one split handles (the host's cap on gridDim.z, ceil(max context / 16),
// should use the same number; any gridDim.z works).
#define MIN_CHUNK 16
// Most splits the merge handles; the host never launches more (MAX_ATTENTION_SPLITS), and the kernel
// uses at most this many even if gridDim.z is larger.
#define MAX_SPLITS 16

// ceil(a / b) for a >= 0, b > 0 without the integer divide sequence: a float estimate (off by at most one
// while a < 2^21), then corrected.
__device__ __forceinline__ int ceil_div(int a, int b) {
    if (a >= (1 << 21)) return (a + b - 1) / b;
    int q = (int)__fdividef((float)a, (float)b);
    int r = a - q * b;
    if (r < 0) r += b, q--;
    if (r >= b) r -= b, q++;
    return q + (r > 0);
}

// Merge softmax state (m2, l2, acc2) into (m, l, acc); m = -inf means empty.
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float mn = fmaxf(m, m2);
    const float c1 = m == -INFINITY ? 0.0f : fast_exp2(m - mn);
    const float c2 = m2 == -INFINITY ? 0.0f : fast_exp2(m2 - mn);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int i = 0; i < N; i++) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mn;
}

__device__ __forceinline__ void store4_bf16(bf16* p, float a, float b, float c, float d) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16(a, b), pack_bf16(c, d));
}

// U: sub-steps (positions per lane-group) whose K/V loads are in flight together, as many as registers allow
// without spilling. MIN_BLOCKS: resident blocks per SM the register allocation must allow (launch bounds);
// either way an SM keeps 64-128 KB of K/V loads in flight, enough to stream the cache at full bandwidth.
template <int D, int G, typename KV>
struct AttnConfig {
    // Values of a position's head per lane: 8 (one 16-byte load of bf16; 8 fp8 are an 8-byte load), or 16 fp8
    // (one 16-byte load, so as many bytes in flight as bf16 and half the steps) for head_dim 128 with G <= 2,
    // where it measured faster (benchmarks/RESULTS.md). Tried at head_dim 64 with G = 3 (SmolLM2): slower, and
    // its one fp8 correctness run diverged from the reference, which was not investigated; not used there.
    static constexpr int VALS = sizeof(KV) == 1 && D == 128 && G <= 2 ? 16 : 8;
    static constexpr int U = G <= 4 ? 8 : 4;
    static constexpr int MIN_BLOCKS = G <= 2 ? (VALS == 16 ? 3 : 4) : 2;  // <= 128 / 168 / 255 registers
    // The ROPE variant holds its first step's K and V across the rotation (<= 168 registers for G <= 2).
    static constexpr int MIN_BLOCKS_ROPE = G <= 2 ? 3 : 2;
    static constexpr bool Q_SHARED = G >= 4;           // q lives in shared memory (saves G * 8 registers)
};

// What the ROPE variant needs to rotate q and k itself: per-head norm weights (null: none), their epsilon,
// the RoPE base (or a scaled RoPE's inverse frequencies), and each token's cache slot.
struct RopeArgs {
    const float* q_norm;
    const float* k_norm;
    float eps;
    float theta;
    const float* inv_freq;  // null: plain RoPE from theta
    const u32* slots;
};

// Token t's context and the positions [begin, end) of its split `split` (nsplits of them). The batch metadata
// (positions, sequences, block tables) may be read before the previous kernel is done (common.cuh), so these
// three dependent round trips overlap that kernel's tail; q and the cache wait.
struct SplitRange {
    int ctx, nsplits, begin, end;
    const u32* table;  // the sequence's block table
};

// False (block-uniform) when the split is past the context.
__device__ __forceinline__ bool split_range(const u32* __restrict__ positions, const u32* __restrict__ token_seq,
                                            const u32* __restrict__ seq_info, const u32* __restrict__ block_tables,
                                            int t, int split, int max_splits, SplitRange& r) {
    r.ctx = (int)positions[t] + 1;
    const u32 seq = token_seq[t];
    r.table = block_tables + seq_info[seq * 5 + 3];
    // chunk = ceil(ctx / splits) rounded up to a multiple of MIN_CHUNK; nsplits <= min(gridDim.z, MAX_SPLITS).
    const int chunk = MIN_CHUNK * ceil_div(r.ctx, MIN_CHUNK * min(max_splits, MAX_SPLITS));
    if (split * chunk >= r.ctx) return false;
    r.nsplits = ceil_div(r.ctx, chunk);
    r.begin = split * chunk;
    r.end = min(r.ctx, r.begin + chunk);
    return true;
}

// After every warp has put its state in s_acc / s_ml (and a barrier): merge the warps; store the output of
// token t's G heads of kv head g, or with split-K this split's state, and let the last split to finish merge them
// all.
template <int D, int G>
__device__ __forceinline__ void merge_and_store(const float (*s_acc)[G][D], const float2 (*s_ml)[G],
                                                float2 (*s_split_ml)[MAX_SPLITS], int t, int g, int num_kv_heads,
                                                int split, int max_splits, int nsplits, bf16* __restrict__ out,
                                                float* __restrict__ partial, u32* __restrict__ counters) {
    constexpr int V4 = D / 4;  // float4 columns per head
    const int num_heads = num_kv_heads * G;
    // Merge the warps: every thread takes float4 columns of the G heads.
    const size_t rows = (size_t)gridDim.x * num_heads * max_splits;
    float* p_acc = partial;                                     // [rows][D]
    float2* p_ml = reinterpret_cast<float2*>(partial + rows * D);  // [rows]
    for (int e = threadIdx.x; e < G * V4; e += ATTN_THREADS) {
        const int h = e / V4, d = (e % V4) * 4;
        float mw[ATTN_WARPS], mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            mw[w] = s_ml[w][h].x;
            mx = fmaxf(mx, mw[w]);
        }
        float ls = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            const float c = mw[w] == -INFINITY ? 0.0f : fast_exp2(mw[w] - mx);
            const float4 x = *reinterpret_cast<const float4*>(&s_acc[w][h][d]);
            ls += s_ml[w][h].y * c;
            a[0] += x.x * c, a[1] += x.y * c, a[2] += x.z * c, a[3] += x.w * c;
        }
        if (nsplits == 1) {
            const float inv = 1.0f / ls;
            store4_bf16(out + (size_t)t * num_heads * D + (size_t)(g * G + h) * D + d, a[0] * inv, a[1] * inv,
                        a[2] * inv, a[3] * inv);
        } else {
            const size_t row = ((size_t)t * num_heads + g * G + h) * max_splits + split;
            __stcg(reinterpret_cast<float4*>(p_acc + row * D + d), make_float4(a[0], a[1], a[2], a[3]));
            if (d == 0) __stcg(p_ml + row, make_float2(mx, ls));
        }
    }
    if (nsplits == 1) return;  // block-uniform

    // Split-K: publish this block's state, and let the last block of (token, kv head) merge them all.
    if (!last_split_ticket(&counters[t * num_kv_heads + g], nsplits)) return;
    // One round trip (two for G * D > 4 * ATTN_THREADS): each thread issues the loads of its first column's
    // partial sums of every split, while threads of G * MAX_SPLITS (m, l) pairs stage them in shared memory.
    const size_t row_t = (size_t)t * num_heads + g * G;
    float4 pa[MAX_SPLITS];
    {
        const int e = threadIdx.x, h = e / V4, d = (e % V4) * 4;
        const size_t row0 = (row_t + h) * max_splits;
        if (e < G * V4) {
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; s++)
                if (s < nsplits) pa[s] = __ldcg(reinterpret_cast<const float4*>(p_acc + (row0 + s) * D + d));
        }
    }
    static_assert(G * MAX_SPLITS <= ATTN_THREADS, "one (m, l) pair per thread");
    if (threadIdx.x < G * MAX_SPLITS) {
        const int h = threadIdx.x / MAX_SPLITS, s = threadIdx.x % MAX_SPLITS;
        s_split_ml[h][s] = s < nsplits ? __ldcg(p_ml + (row_t + h) * max_splits + s) : make_float2(-INFINITY, 0.0f);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * V4; e += ATTN_THREADS) {
        const int h = e / V4, d = (e % V4) * 4;
        if (e >= ATTN_THREADS) {  // later columns (only when G * D > 4 * ATTN_THREADS)
            const size_t row0 = (row_t + h) * max_splits;
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; s++)
                if (s < nsplits) pa[s] = __ldcg(reinterpret_cast<const float4*>(p_acc + (row0 + s) * D + d));
        }
        float mx = -INFINITY;
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; s++)
            if (s < nsplits) mx = fmaxf(mx, s_split_ml[h][s].x);
        float ls = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; s++) {
            if (s < nsplits) {
                const float2 ml = s_split_ml[h][s];
                const float c = ml.x == -INFINITY ? 0.0f : fast_exp2(ml.x - mx);
                ls += ml.y * c;
                a[0] += pa[s].x * c, a[1] += pa[s].y * c, a[2] += pa[s].z * c, a[3] += pa[s].w * c;
            }
        }
        const float inv = 1.0f / ls;
        store4_bf16(out + (size_t)t * num_heads * D + (size_t)(g * G + h) * D + d, a[0] * inv, a[1] * inv,
                    a[2] * inv, a[3] * inv);
    }
    if (threadIdx.x == 0) counters[t * num_kv_heads + g] = 0;
}

// What the rotation needs that no kernel writes during a forward: the per-head norm weights, token t's cache
// slot (batch metadata, common.cuh) and the rotation's (cos, sin) at its position, into shared memory. Staged
// before the PDL wait, so these round trips and the angles' powf and sincosf overlap the previous kernel instead
// of following q's.
template <int D>
struct RopeConstants {
    float norm[2][D];  // q's, k's (when the model has them)
    float2 cs[(D + 1) / 2];  // pair i's rope_angle
    u32 slot;
};

// This thread's share of the norm weights and the slot, in registers. A block loads them first, as they depend on
// nothing: their round trip then overlaps the block's chain of dependent metadata loads (token -> sequence ->
// block table -> first K/V) instead of following it.
template <int D>
struct RopeInputs {
    static constexpr int NORMS = (2 * D + ATTN_THREADS - 1) / ATTN_THREADS;
    float norm[NORMS];
    u32 slot;
};

template <int D>
__device__ __forceinline__ RopeInputs<D> load_rope_inputs(const RopeArgs& rope, int t) {
    RopeInputs<D> in;
#pragma unroll
    for (int j = 0; j < RopeInputs<D>::NORMS; j++) {
        const int i = threadIdx.x + j * ATTN_THREADS;
        in.norm[j] = rope.q_norm && i < 2 * D ? (i < D ? rope.q_norm : rope.k_norm)[i % D] : 0.0f;
    }
    in.slot = threadIdx.x == 0 ? rope.slots[t] : 0u;
    return in;
}

// Puts the constants in shared memory (the angles computed here); its barrier publishes them.
template <int D>
__device__ __forceinline__ void stage_rope_constants(const RopeArgs& rope, const RopeInputs<D>& in, int ctx,
                                                     RopeConstants<D>& c) {
    if (rope.q_norm) {
#pragma unroll
        for (int j = 0; j < RopeInputs<D>::NORMS; j++) {
            const int i = threadIdx.x + j * ATTN_THREADS;
            if (i < 2 * D) c.norm[i / D][i % D] = in.norm[j];
        }
    }
    for (int i = threadIdx.x; i < D / 2; i += ATTN_THREADS)
        c.cs[i] = rope_angle(i, (float)(ctx - 1), rope.theta, D, rope.inv_freq);
    if (threadIdx.x == 0) c.slot = in.slot;
    __syncthreads();
}

// The decode kernels' share of RoPE: rotate the G query heads of token t (kv head g) into s_q (times
// q_factor), and when this block's split holds the newest position, rotate its K and write K and V to the
// cache and to s_new (the main loop reads the newest position from there). The norm weights and the cache slot
// come from `consts` (stage_rope_constants). Every thread calls it; the caller's barrier publishes s_q and s_new.
template <int D, int G, typename KV, bool V_FIRST>
__device__ __forceinline__ void rotate_newest(const bf16* __restrict__ qkv, int width, int t, int g, int num_kv_heads,
                                              bool holds_newest, const RopeArgs& rope,
                                              const RopeConstants<D>& consts, KV* k_cache, KV* v_cache, int block_size,
                                              float q_factor, float (*s_q)[D], KV (*s_new)[D]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bf16* qrow = qkv + (size_t)t * width + (size_t)g * G * D;
    // The newest V goes to the cache and s_new. With V_FIRST, where a warp has no query head, that warp copies it
    // first, so its round trip overlaps the heads' rotation; otherwise warp 0 does, after its heads.
    constexpr int V_WARP = V_FIRST && G <= ATTN_WARPS - 2 ? ATTN_WARPS - 2 : 0;
    const auto copy_v = [&](const bf16* krow, size_t at) {
        using Vec8 = KvVec8<KV>;
        const uint4* vrow = reinterpret_cast<const uint4*>(krow + (size_t)num_kv_heads * D);
        for (int i = lane; i < D / 8; i += 32) {
            const Vec8 v = kv_pack8<KV>(__ldcg(vrow + i));
            reinterpret_cast<Vec8*>(v_cache + at)[i] = v;
            reinterpret_cast<Vec8*>(s_new[1])[i] = v;
        }
    };
    const auto newest_k = [&] { return qkv + (size_t)t * width + (size_t)(num_kv_heads * G + g) * D; };
    const auto newest_at = [&] { return cache_offset(consts.slot, g, num_kv_heads, block_size, D); };
    if (V_WARP >= G && holds_newest && warp == V_WARP) copy_v(newest_k(), newest_at());
    const auto angle = [&](int i) { return consts.cs[i]; };
    for (int h = warp; h < G; h += ATTN_WARPS) {
        rope_head(qrow + h * D, rope.q_norm ? consts.norm[0] : nullptr, rope.eps, D, lane, angle,
                  [&](int i, bf16 v) { s_q[h][i] = __bfloat162float(v) * q_factor; });
    }
    if (!holds_newest) return;
    const size_t at = newest_at();
    const bf16* krow = newest_k();
    if (warp == ATTN_WARPS - 1) {
        rope_head(krow, rope.k_norm ? consts.norm[1] : nullptr, rope.eps, D, lane, angle, [&](int i, bf16 v) {
            const KV k = kv_from_bf16<KV>(v);
            k_cache[at + i] = k;
            s_new[0][i] = k;
        });
    } else if (V_WARP < G && warp == V_WARP) {
        copy_v(krow, at);
    }
}

// grid: (tokens, num_kv_heads, max_splits); block: ATTN_THREADS. D = head_dim, G = query heads per kv head.
// ROPE: q and k in qkv are not rotated yet and every sequence has one query token (see the top of the file).
// seq_info holds 5 u32 per sequence: start, len, past_len, table_start, table_len.
// partial: tokens * num_heads * max_splits * (D + 2) floats, used as two arrays indexed by
// row = (token * num_heads + head) * max_splits + split: acc[row][D], then (m, l)[row].
// counters: tokens * num_kv_heads u32, all zero between launches (the merging block resets its counter).
// KV: the cache's element type (kernels/kv_cache.cuh). The caches are not __restrict__: the ROPE variant writes
// the newest K/V and then reads them.
template <int D, int G, bool ROPE, typename KV>
__device__ void paged_attention(const bf16* __restrict__ qkv, int width, const u32* __restrict__ positions,
                                const u32* __restrict__ token_seq, const u32* __restrict__ seq_info,
                                const u32* __restrict__ block_tables, KV* k_cache, KV* v_cache,
                                int block_size, int num_kv_heads, float scale, bf16* __restrict__ out,
                                float* __restrict__ partial, u32* __restrict__ counters, RopeArgs rope) {
    constexpr int VALS = AttnConfig<D, G, KV>::VALS;
    using Vec = typename KvLoad<KV, VALS>::type;  // one lane's VALS values of a position's head
    constexpr int LANES = D / VALS;         // lanes that share one position
    constexpr int GROUPS = 32 / LANES;      // positions per warp per sub-step
    constexpr int NG = GROUPS * ATTN_WARPS; // positions per block per sub-step
    constexpr int U = AttnConfig<D, G, KV>::U;  // sub-steps whose loads are in flight together
    constexpr bool Q_SHARED = AttnConfig<D, G, KV>::Q_SHARED;
    constexpr int STEP = NG * U;            // positions per block per step
    static_assert(D % VALS == 0 && 32 % LANES == 0, "head_dim must be 64 or 128 (or another 8 * 2^k <= 256)");

    __shared__ __align__(16) float s_acc[ATTN_WARPS][G][D];
    __shared__ float2 s_ml[ATTN_WARPS][G];
    // q, scaled; the ROPE variant rotates it here (a head's pairs sit in different lanes) even when the main
    // loop keeps it in registers.
    __shared__ __align__(16) float s_q[Q_SHARED || ROPE ? G : 1][D];
    __shared__ float2 s_split_ml[G][MAX_SPLITS];
    __shared__ __align__(16) KV s_new[ROPE ? 2 : 1][D];  // the newest position's K and V as cached (ROPE)

    const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z, max_splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % LANES, gi = lane / LANES;
    const float qscale = scale * LOG2_E;  // scores in log2 units

    RopeInputs<ROPE ? D : 1> rope_inputs;
    if constexpr (ROPE) rope_inputs = load_rope_inputs<D>(rope, t);
    SplitRange range;
    if (!split_range(positions, token_seq, seq_info, block_tables, t, split, max_splits, range)) return;
    const int ctx = range.ctx, nsplits = range.nsplits, begin = range.begin, end = range.end;
    const u32* table = range.table;

    const FastDiv bdiv((u32)block_size);
    const int off0 = warp * GROUPS + gi;  // this lane-group's position within a sub-step
    // Block-table entries of the positions of one step (prefetched one step ahead).
    u32 blk[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int p = begin + u * NG + off0;
        blk[u] = p < end ? __ldg(table + bdiv.div((u32)p)) : 0u;
    }
    // The cache is [block][kv head][position in block][D]: one head's positions of a block are contiguous.
    const size_t head_base = (size_t)g * block_size * D + li * VALS;
    // This lane's K and V of the U positions of the step at `base` (zeros past `end` and at `skip`).
    auto load_step = [&](int base, int skip, Vec (&kr)[U], Vec (&vr)[U]) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = base + u * NG + off0;
            if (p < end && p != skip) {
                const u32 bi = bdiv.div((u32)p);
                const size_t at = ((size_t)blk[u] * num_kv_heads * block_size + (p - bi * block_size)) * D + head_base;
                kr[u] = __ldcg(reinterpret_cast<const Vec*>(k_cache + at));
                vr[u] = __ldcg(reinterpret_cast<const Vec*>(v_cache + at));
            } else {
                kr[u] = Vec{};
                vr[u] = Vec{};
            }
        }
    };
    // A decode step's past K and V were written by earlier forwards, and only this kernel writes this layer's
    // cache in this one, so the ROPE variant loads its first step before the wait too; the newest position,
    // which this block writes below, is taken from shared memory instead.
    Vec kr[U], vr[U];
    if constexpr (ROPE) load_step(begin, ctx - 1, kr, vr);
    __shared__ RopeConstants<ROPE ? D : 1> s_consts;
    if constexpr (ROPE) stage_rope_constants<D>(rope, rope_inputs, ctx, s_consts);
    kernel_begin();

    const bf16* qrow = qkv + (size_t)t * width + (size_t)g * G * D;
    float q[Q_SHARED ? 1 : G][VALS];
    if constexpr (ROPE) {
        // V last: this variant is at its register cap (168 for G <= 2), and copying V first spills there.
        rotate_newest<D, G, KV, false>(qkv, width, t, g, num_kv_heads, end == ctx, rope, s_consts, k_cache,
                                       v_cache, block_size, qscale, s_q, s_new);
        // The barrier before the main loop publishes s_q and the new K/V to the whole block.
    } else if constexpr (Q_SHARED) {
        constexpr int QV = (G * D / 8 + ATTN_THREADS - 1) / ATTN_THREADS;
        uint4 qraw[QV];
#pragma unroll
        for (int j = 0; j < QV; j++) {
            const int e = threadIdx.x + j * ATTN_THREADS;
            if (e < G * D / 8) qraw[j] = __ldcg(reinterpret_cast<const uint4*>(qrow) + e);
        }
#pragma unroll
        for (int j = 0; j < QV; j++) {
            const int e = threadIdx.x + j * ATTN_THREADS;
            if (e < G * D / 8) {
                float f[8];
                unpack8(qraw[j], f);
#pragma unroll
                for (int i = 0; i < 8; i++) (&s_q[0][0])[e * 8 + i] = f[i] * qscale;
            }
        }
    } else {
        uint4 qraw[G][VALS / 8];
#pragma unroll
        for (int h = 0; h < G; h++)
#pragma unroll
            for (int j = 0; j < VALS / 8; j++) qraw[h][j] = __ldcg(reinterpret_cast<const uint4*>(qrow + h * D + li * VALS) + j);
#pragma unroll
        for (int h = 0; h < G; h++) {
#pragma unroll
            for (int j = 0; j < VALS / 8; j++) unpack8(qraw[h][j], q[h] + 8 * j);
#pragma unroll
            for (int i = 0; i < VALS; i++) q[h][i] *= qscale;
        }
    }

    float acc[G][VALS], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) {
#pragma unroll
        for (int i = 0; i < VALS; i++) acc[h][i] = 0.0f;
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }

    if constexpr (Q_SHARED || ROPE) __syncthreads();
    if constexpr (ROPE && !Q_SHARED) {
#pragma unroll
        for (int h = 0; h < G; h++)
#pragma unroll
            for (int i = 0; i < VALS; i++) q[h][i] = s_q[h][li * VALS + i];
    }
    if constexpr (ROPE) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (begin + u * NG + off0 == ctx - 1) {
                kr[u] = reinterpret_cast<const Vec*>(s_new[0])[li];
                vr[u] = reinterpret_cast<const Vec*>(s_new[1])[li];
            }
        }
    }

    // Block-uniform trip count: lanes past `end` still join the shuffles.
    for (int base = begin; base < end; base += STEP) {
        if (!ROPE || base != begin) load_step(base, -1, kr, vr);
        // Next step's table entries, in flight while this step computes.
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = base + STEP + u * NG + off0;
            blk[u] = p < end ? __ldg(table + bdiv.div((u32)p)) : 0u;
        }

        float s[G][U];
#pragma unroll
        for (int h = 0; h < G; h++) {
            float qh[VALS];
            if constexpr (Q_SHARED) {
#pragma unroll
                for (int j = 0; j < VALS / 4; j++) {
                    const float4 a = *reinterpret_cast<const float4*>(&s_q[h][li * VALS + 4 * j]);
                    qh[4 * j] = a.x, qh[4 * j + 1] = a.y, qh[4 * j + 2] = a.z, qh[4 * j + 3] = a.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < VALS; i++) qh[i] = q[Q_SHARED ? 0 : h][i];
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                float k[VALS];
                kv_unpack<KV, VALS>(kr[u], k);
                float acc_s = 0.0f;
#pragma unroll
                for (int i = 0; i < VALS; i++) acc_s = fmaf(qh[i], k[i], acc_s);
                s[h][u] = acc_s;
            }
        }
        // All G * U sums interleaved, so the shuffles pipeline (no branch between them).
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) {
#pragma unroll
            for (int h = 0; h < G; h++) {
#pragma unroll
                for (int u = 0; u < U; u++) s[h][u] += __shfl_xor_sync(0xffffffffu, s[h][u], o);
            }
        }
        // One online-softmax update for the U positions.
#pragma unroll
        for (int h = 0; h < G; h++) {
            float mx = m[h];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (base + u * NG + off0 < end) mx = fmaxf(mx, s[h][u]);
            const float corr = mx == -INFINITY ? 1.0f : fast_exp2(m[h] - mx);  // m = -inf gives 0
            float lsum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                s[h][u] = base + u * NG + off0 < end ? fast_exp2(s[h][u] - mx) : 0.0f;
                lsum += s[h][u];
            }
            l[h] = l[h] * corr + lsum;
            m[h] = mx;
#pragma unroll
            for (int i = 0; i < VALS; i++) acc[h][i] *= corr;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (base + u * NG >= end) continue;  // block-uniform: no position of this sub-step is left
            float v[VALS];
            kv_unpack<KV, VALS>(vr[u], v);
#pragma unroll
            for (int h = 0; h < G; h++) {
#pragma unroll
                for (int i = 0; i < VALS; i++) acc[h][i] = fmaf(s[h][u], v[i], acc[h][i]);
            }
        }
    }

    // Merge the position groups of each warp (lanes li, li + LANES, ... hold the same dims).
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < G; h++) {
            float acc2[VALS];
            const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
#pragma unroll
            for (int i = 0; i < VALS; i++) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[h][i], o);
            merge_state<VALS>(m[h], l[h], acc[h], m2, l2, acc2);
        }
    }
    if (gi == 0) {
#pragma unroll
        for (int h = 0; h < G; h++) {
#pragma unroll
            for (int j = 0; j < VALS / 4; j++)
                *reinterpret_cast<float4*>(&s_acc[warp][h][li * VALS + 4 * j]) =
                    make_float4(acc[h][4 * j], acc[h][4 * j + 1], acc[h][4 * j + 2], acc[h][4 * j + 3]);
            if (li == 0) s_ml[warp][h] = make_float2(m[h], l[h]);
        }
    }
    __syncthreads();

    merge_and_store<D, G>(s_acc, s_ml, s_split_ml, t, g, num_kv_heads, split, max_splits, nsplits, out, partial,
                          counters);
}

#include "attention_mma.cuh"  // after ATTN_WARPS, which it uses

// The decode attention with its main loop on tensor cores (kernels/attention_mma.cuh), for caches whose block
// size is a multiple of 16; the arguments and everything around the loop are those of the ROPE variant above.
template <int D, int G, typename KV>
__device__ void paged_attention_mma(const bf16* __restrict__ qkv, int width, const u32* __restrict__ positions,
                                    const u32* __restrict__ token_seq, const u32* __restrict__ seq_info,
                                    const u32* __restrict__ block_tables, KV* k_cache, KV* v_cache, int block_size,
                                    int num_kv_heads, float scale, bf16* __restrict__ out, float* __restrict__ partial,
                                    u32* __restrict__ counters, RopeArgs rope) {
    using Mma = MmaDecode<D, G, KV>;
    __shared__ __align__(16) float s_acc[ATTN_WARPS][G][D];
    __shared__ __align__(16) float2 s_ml[ATTN_WARPS][G];
    __shared__ __align__(16) float s_q[G][D];  // rotated, unscaled (the scale is applied to the f32 scores)
    __shared__ float2 s_split_ml[G][MAX_SPLITS];
    __shared__ __align__(16) KV s_new[2][D];

    const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z, max_splits = gridDim.z;
    TIMELINE(TL_START);
    const RopeInputs<D> rope_inputs = load_rope_inputs<D>(rope, t);
    SplitRange range;
    if (!split_range(positions, token_seq, seq_info, block_tables, t, split, max_splits, range)) return;
    // As in the ROPE variant: the first sub-steps' past K and V are loaded before the wait, all but the newest
    // position, which this block writes below.
    const int newest = range.ctx - 1;
    Mma mma(range.begin, range.end, g, num_kv_heads, block_size, range.table, k_cache, v_cache);
    typename Mma::Regs buf[2];
    mma.load(buf[0], 0, newest);
    mma.load(buf[1], 1, newest);
    __shared__ RopeConstants<D> s_consts;
    stage_rope_constants<D>(rope, rope_inputs, range.ctx, s_consts);
    kernel_begin();
    TIMELINE(TL_WAITED);

    rotate_newest<D, G, KV, true>(qkv, width, t, g, num_kv_heads, range.end == range.ctx, rope, s_consts,
                                  k_cache, v_cache, block_size, 1.0f, s_q, s_new);
    __syncthreads();
    TIMELINE(TL_INPUT);
    mma.patch(buf[0], 0, s_new[0], s_new[1], newest);
    mma.patch(buf[1], 1, s_new[0], s_new[1], newest);
    mma.run(buf, s_q, scale * LOG2_E);
    mma.publish(s_acc[threadIdx.x >> 5], s_ml[threadIdx.x >> 5]);
    __syncthreads();
    TIMELINE(TL_READY);
    merge_and_store<D, G>(s_acc, s_ml, s_split_ml, t, g, num_kv_heads, split, max_splits, range.nsplits, out, partial,
                          counters);
    TIMELINE(TL_END);
}

// A decode kernel that rotates q and k itself: its name, launch bound (resident blocks per SM) and the device
// function it runs. BODY and MIN_BLOCKS come parenthesized, so their template arguments' commas stay inside
// one macro argument.
#define ROTATING_ATTENTION_KERNEL(KERNEL, KV, MIN_BLOCKS, BODY)                                                 \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, MIN_BLOCKS) KERNEL(                              \
        const bf16* qkv, int width, const u32* positions, const u32* token_seq, const u32* seq_info,           \
        const u32* block_tables, KV* k_cache, KV* v_cache, int block_size, int num_kv_heads,                    \
        float scale, bf16* out, float* partial, u32* counters, const float* q_norm, const float* k_norm,        \
        float eps, float theta, const float* inv_freq, const u32* slots) {                                      \
        BODY(qkv, width, positions, token_seq, seq_info, block_tables, k_cache, v_cache, block_size,            \
             num_kv_heads, scale, out, partial, counters, {q_norm, k_norm, eps, theta, inv_freq, slots});       \
    }

// The plain, the rotating and the tensor-core rotating kernel of one shape and cache element type; NAME is
// paged_attention[_fp8].
#define ATTENTION_KERNELS(NAME, KV, D, G)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, (AttnConfig<D, G, KV>::MIN_BLOCKS))                \
        NAME##_d##D##_g##G(                                                                                     \
        const bf16* qkv, int width, const u32* positions, const u32* token_seq, const u32* seq_info,           \
        const u32* block_tables, KV* k_cache, KV* v_cache, int block_size, int num_kv_heads,                    \
        float scale, bf16* out, float* partial, u32* counters) {                                                \
        paged_attention<D, G, false, KV>(qkv, width, positions, token_seq, seq_info, block_tables, k_cache,    \
                                         v_cache, block_size, num_kv_heads, scale, out, partial, counters, {}); \
    }                                                                                                           \
    ROTATING_ATTENTION_KERNEL(NAME##_rope_d##D##_g##G, KV, (AttnConfig<D, G, KV>::MIN_BLOCKS_ROPE),             \
                              (paged_attention<D, G, true, KV>))                                                \
    ROTATING_ATTENTION_KERNEL(NAME##_mma_rope_d##D##_g##G, KV, (MmaDecode<D, G, KV>::MIN_BLOCKS),               \
                              (paged_attention_mma<D, G, KV>))

// Every shape the host may ask for (DECODE_ATTENTION_SHAPES in rust/core/src/backend/cuda/backend.rs lists the
// same): head_dim 64 or 128 with 1 to 8 query heads per KV head, which covers the Llama, Qwen2/2.5/3, Mistral and
// SmolLM2 families (Qwen2.5-0.5B has 7, Qwen2.5-1.5B 6, Llama-3.2-3B 3).
#define ATTENTION_GROUPS(NAME, KV, D)   \
    ATTENTION_KERNELS(NAME, KV, D, 1)   \
    ATTENTION_KERNELS(NAME, KV, D, 2)   \
    ATTENTION_KERNELS(NAME, KV, D, 3)   \
    ATTENTION_KERNELS(NAME, KV, D, 4)   \
    ATTENTION_KERNELS(NAME, KV, D, 5)   \
    ATTENTION_KERNELS(NAME, KV, D, 6)   \
    ATTENTION_KERNELS(NAME, KV, D, 7)   \
    ATTENTION_KERNELS(NAME, KV, D, 8)
#define ATTENTION_SHAPES(NAME, KV)    \
    ATTENTION_GROUPS(NAME, KV, 64)    \
    ATTENTION_GROUPS(NAME, KV, 128)
