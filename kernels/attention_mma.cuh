// The main loop of the decode attention on tensor cores (mma.sync m16n8k16, f32 accumulation), for paged caches
// whose block size is a multiple of 16. The loop on CUDA cores (attention.cuh) spends two to four instructions
// per byte of K/V it reads (unpack, one FMA per value and query head, shuffles), which is about what an SM can
// issue per byte of its share of DRAM bandwidth, so it cannot keep the bandwidth busy; an fp8 cache doubles the
// instructions per byte. Here a warp takes 16 positions at a time and does both products as 16 x 8 x 16 tiles:
//
//   S = Q · Kᵀ   rows: the G query heads (of 16; the rest are zero), columns: 8 positions, k: head dims
//   Oᵀ += Vᵀ · Pᵀ  rows: 16 head dims, columns: the query heads (of 8), k: 16 positions
//
// The accumulator of S (row = head, two adjacent positions per thread) is exactly the B operand of the second
// product (k = those two positions, column = head), so P never leaves registers. A dot product may take its
// terms in any order, so every thread loads whole 16-byte runs of K (and the matching dims of q) instead of the
// pairs the fragment layout names, and each thread loads V for the 4 positions and the D / 8 dims its fragments
// cover, pairing positions with byte permutes. Operands are bf16 for a bf16 cache and f16 for fp8 (every e4m3
// value is an f16, and so is every bf16 q value in f16 range). P is rounded to the operand type, as in the
// tensor-core prefill attention.
// Included by attention.cuh (ATTN_WARPS; FastDiv is in common.cuh).
#pragma once
#include "kv_cache.cuh"

template <int D, int G, typename KV>
struct MmaDecode {
    using Op = MmaOperand<KV>;
    static constexpr int WARPS = ATTN_WARPS;
    static constexpr int EB = (int)sizeof(KV);
    static constexpr int KS = D / 16;           // k-steps of Q · Kᵀ, and 16-dim row tiles of Vᵀ · Pᵀ
    static constexpr int KL = D * EB / 64;      // 16-byte K loads per position and thread (4 threads share one)
    static constexpr int KE = 16 / EB;          // K values per load
    static constexpr int VW = D / 8 * EB / 4;   // 32-bit words of V per position and thread (its D / 8 dims)
    static constexpr int TABLE = 32;            // sub-steps per window of prefetched block-table entries
    // Resident blocks per SM the registers must allow: two sub-steps of K and V in flight take 128 registers
    // per thread with a bf16 cache at head_dim 128, half that with fp8. At head_dim 64 four blocks fit without
    // spilling (127 registers for bf16, about 102 for fp8); fp8 at head_dim 128 spills at four (sm_90).
    static constexpr int MIN_BLOCKS = D == 64 ? 4 : EB == 1 ? 3 : 2;
    static_assert(G <= 8 && (D == 64 || D == 128), "tensor-core decode attention: G <= 8, head_dim 64 or 128");

    // One sub-step's operands: K of positions row and row + 8, V of positions 2 col, +1, +8, +9 (of 16).
    struct Regs {
        uint4 k[2][KL];
        u32 v[4][VW];
    };

    int lane, warp, row, col;
    int begin, end, steps;   // the split's positions [begin, end) and its 16-position sub-steps
    int g, num_kv_heads, block_size;
    FastDiv bdiv;
    const u32* table;
    u32 tab[2];              // lane i: block-table entry of this warp's sub-step 32 * window + i (two windows)
    // The caches offset by this thread's first K and V element of a sub-step (position row, dims col * KE..;
    // position 2 col, dims D / 8 * row..), so that a sub-step's addresses are one multiply-add from its 16-position
    // unit plus constant offsets: on sm_90 that took a load from about 125 instructions to about 60
    // (benchmarks/RESULTS.md, 2026-12-06).
    const char* k_thread;
    const char* v_thread;

    __device__ __forceinline__ MmaDecode(int begin_, int end_, int g_, int num_kv_heads_, int block_size_,
                                         const u32* table_, const KV* k_cache, const KV* v_cache)
        : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), row((threadIdx.x & 31) >> 2), col(threadIdx.x & 3),
          begin(begin_), end(end_), steps((end_ - begin_ + 15) >> 4), g(g_), num_kv_heads(num_kv_heads_),
          block_size(block_size_), bdiv((u32)block_size_), table(table_),
          k_thread(reinterpret_cast<const char*>(k_cache + row * D + col * KE)),
          v_thread(reinterpret_cast<const char*>(v_cache + 2 * col * D + row * (D / 8))) {
        fetch_window(0, 0);
        fetch_window(1, 1);
    }

    // This warp's k-th sub-step (warps take sub-steps in turn) covers positions begin + 16 * sub_step(k) + 0..15.
    __device__ __forceinline__ int sub_step(int k) const { return warp + WARPS * k; }

    __device__ __forceinline__ void fetch_window(int slot, int window) {
        const int s = sub_step(TABLE * window + lane);
        const u32 entry = s < steps ? __ldg(table + bdiv.div((u32)(begin + 16 * s))) : 0u;
        // Selects, not an index: a register array indexed at run time would live in local memory.
        if (slot == 0) tab[0] = entry;
        else tab[1] = entry;
    }

    // Byte offsets from a sub-step's first K (V) element of this thread to the element of load h, c (j, w).
    __device__ static constexpr int k_offset(int h, int c) { return (8 * h * D + 4 * c * KE) * EB; }
    __device__ static constexpr int v_offset(int j, int w) { return ((j & 1) + 8 * (j >> 1)) * D * EB + w * 4; }

    // The sub-step's loads from this thread's first K and V element of it. CHECKED: positions past `end` and
    // `skip` (the newest one, before this block has written it) read as zeros: a zero V times a zero
    // probability adds nothing, whatever the cache held. Unchecked, every position is live (a whole sub-step
    // inside the split, and not the newest).
    template <bool CHECKED>
    __device__ __forceinline__ void load_positions(Regs& r, const char* kb, const char* vb, int base, int skip) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = 8 * h + row;
            const bool live = !CHECKED || (base + i < end && base + i != skip);
#pragma unroll
            for (int c = 0; c < KL; c++)
                r.k[h][c] = live ? kv_stream_load(reinterpret_cast<const uint4*>(kb + k_offset(h, c))) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = 2 * col + (j & 1) + 8 * (j >> 1);
            const bool live = !CHECKED || (base + i < end && base + i != skip);
            if constexpr (VW >= 4) {
#pragma unroll
                for (int w = 0; w < VW; w += 4) {
                    const uint4 x = live ? kv_stream_load(reinterpret_cast<const uint4*>(vb + v_offset(j, w)))
                                         : make_uint4(0, 0, 0, 0);
                    r.v[j][w] = x.x, r.v[j][w + 1] = x.y, r.v[j][w + 2] = x.z, r.v[j][w + 3] = x.w;
                }
            } else {
                const uint2 x = live ? kv_stream_load(reinterpret_cast<const uint2*>(vb + v_offset(j, 0))) : make_uint2(0, 0);
                r.v[j][0] = x.x, r.v[j][1] = x.y;
            }
        }
    }

    // Load sub-step k (no-op past the split), reading `skip` as zeros (-1: none).
    __device__ __forceinline__ void load(Regs& r, int k, int skip) {
        const int s = sub_step(k);
        if (s >= steps) return;
        if (k % TABLE == 0 && k >= TABLE) fetch_window(((k / TABLE) + 1) & 1, k / TABLE + 1);
        const u32 entry = __shfl_sync(0xffffffffu, ((k / TABLE) & 1) ? tab[1] : tab[0], k % TABLE);
        const int base = begin + 16 * s;
        // The sub-step's 16 positions lie in one cache block (block sizes and split starts are multiples of
        // 16); its first element is 16-position unit `unit` of the cache (u32: caches of up to 2^32 units).
        const u32 in_block = (u32)base - bdiv.div((u32)base) * (u32)block_size;
        const u32 unit = (entry * (u32)num_kv_heads + (u32)g) * ((u32)block_size >> 4) + (in_block >> 4);
        const char* kb = k_thread + (size_t)unit * (16 * D * EB);
        const char* vb = v_thread + (size_t)unit * (16 * D * EB);
        if (base + 16 <= end && (skip < base || skip >= base + 16)) load_positions<false>(r, kb, vb, base, skip);
        else load_positions<true>(r, kb, vb, base, skip);
    }

    // After the block has written the newest position (at `skip`) to the cache and to shared memory: put it
    // into a sub-step loaded before that.
    __device__ __forceinline__ void patch(Regs& r, int k, const KV* s_k, const KV* s_v, int skip) {
        const int s = sub_step(k);
        if (s >= steps) return;
        const int base = begin + 16 * s;
        if (skip < base || skip >= base + 16) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (base + 8 * h + row != skip) continue;
#pragma unroll
            for (int c = 0; c < KL; c++) r.k[h][c] = reinterpret_cast<const uint4*>(s_k)[col + 4 * c];
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (base + 2 * col + (j & 1) + 8 * (j >> 1) != skip) continue;
#pragma unroll
            for (int w = 0; w < VW; w++) r.v[j][w] = reinterpret_cast<const u32*>(s_v + row * (D / 8))[w];
        }
    }

    // The A operand of Q · Kᵀ (row = query head, zero past G): for k-step ks, the q values of the dims this
    // thread's K registers hold there. q (shared memory, unscaled) is [G][D].
    __device__ __forceinline__ void q_fragments(const float (*s_q)[D], u32 (&qa)[KS][2]) const {
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const int c = ks / (KE / 4), sub = ks % (KE / 4);
            const int d = c * (64 / EB) + col * KE + 4 * sub;
            qa[ks][0] = row < G ? Op::pack(s_q[row][d], s_q[row][d + 1]) : 0u;
            qa[ks][1] = row < G ? Op::pack(s_q[row][d + 2], s_q[row][d + 3]) : 0u;
        }
    }

    // The B operand of k-step ks: K values of this thread's position at those dims.
    __device__ __forceinline__ void k_fragment(const uint4 (&k)[KL], int ks, u32& b0, u32& b1) const {
        const int c = ks / (KE / 4), sub = ks % (KE / 4);
        const u32* w = reinterpret_cast<const u32*>(&k[c]);
        if constexpr (EB == 2) {
            b0 = w[2 * sub], b1 = w[2 * sub + 1];
        } else {
            Op::pairs(w[sub], b0, b1);
        }
    }

    // The A operand of Vᵀ · Pᵀ for row tile j: rows row and row + 8 are dims D / 8 * row + 2j and + 1, k (the
    // 16 positions) pairs positions 2 col, 2 col + 1 and 2 col + 8, 2 col + 9.
    __device__ __forceinline__ void v_fragment(const Regs& r, int j, u32 (&a)[4]) const {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if constexpr (EB == 2) {
                const u32 p = r.v[2 * half][j], q = r.v[2 * half + 1][j];
                a[2 * half] = __byte_perm(p, q, 0x5410);      // dim 2j of both positions
                a[2 * half + 1] = __byte_perm(p, q, 0x7632);  // dim 2j + 1
            } else {
                const u32 p = r.v[2 * half][j / 2], q = r.v[2 * half + 1][j / 2];
                const u32 both = __byte_perm(p, q, (j & 1) ? 0x7362 : 0x5140);  // dims 2j, 2j + 1 interleaved
                Op::pairs(both, a[2 * half], a[2 * half + 1]);
            }
        }
    }

    // The softmax state of this thread: query head `row` (max in log2 units, the sum over this thread's
    // positions), and Oᵀ for heads 2 col and 2 col + 1 (acc[j]: dims D / 8 * row + 2j, + 1; see v_fragment).
    float m = -INFINITY, l = 0.0f;
    float acc[KS][4];

    // One sub-step: scores, online softmax, and the P · V product.
    __device__ __forceinline__ void attend(const Regs& r, int k, const u32 (&qa)[KS][2], float qscale) {
        const int base = begin + 16 * sub_step(k);
        float sc[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                u32 b0, b1;
                k_fragment(r.k[h], ks, b0, b1);
                const u32 a[4] = {qa[ks][0], 0u, qa[ks][1], 0u};  // rows 8..15 (no query head) are zero
                Op::mma(sc[h], a, b0, b1);
            }
        }
        // sc[h][e]: head `row`, position 8h + 2 col + e.
        float mx = -INFINITY;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool live = row < G && base + 8 * h + 2 * col + e < end;
                sc[h][e] = live ? sc[h][e] * qscale : -INFINITY;
                mx = fmaxf(mx, sc[h][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m, mx);
        const float corr = m_new == -INFINITY ? 1.0f : fast_exp2(m - m_new);
        float p[2][2], sum = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                p[h][e] = sc[h][e] == -INFINITY ? 0.0f : fast_exp2(sc[h][e] - m_new);
                sum += p[h][e];
            }
        l = l * corr + sum;
        m = m_new;
        // Rescale Oᵀ only when some head's maximum moved (rare after the first positions).
        if (__any_sync(0xffffffffu, corr != 1.0f)) {
            const float c0 = __shfl_sync(0xffffffffu, corr, 8 * col);      // head 2 col (lane 4 * head)
            const float c1 = __shfl_sync(0xffffffffu, corr, 8 * col + 4);  // head 2 col + 1
#pragma unroll
            for (int j = 0; j < KS; j++) acc[j][0] *= c0, acc[j][1] *= c1, acc[j][2] *= c0, acc[j][3] *= c1;
        }
        const u32 b0 = Op::pack(p[0][0], p[0][1]), b1 = Op::pack(p[1][0], p[1][1]);
#pragma unroll
        for (int j = 0; j < KS; j++) {
            u32 a[4];
            v_fragment(r, j, a);
            Op::mma(acc[j], a, b0, b1);
        }
    }

    // This warp's sub-steps, two in flight: `first` holds sub-steps 0 and 1 (loaded, and patched, by the caller).
    __device__ __forceinline__ void run(Regs (&buf)[2], const float (*s_q)[D], float qscale) {
        u32 qa[KS][2];
        q_fragments(s_q, qa);
#pragma unroll
        for (int j = 0; j < KS; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        for (int k = 0; sub_step(k) < steps; k += 2) {  // warp-uniform
            attend(buf[0], k, qa, qscale);
            load(buf[0], k + 2, -1);
            if (sub_step(k + 1) >= steps) break;
            attend(buf[1], k + 1, qa, qscale);
            load(buf[1], k + 3, -1);
        }
    }

    // The warp's state for the block's merge (attention.cuh): s_acc[h][d] (unnormalized, at this warp's max)
    // and s_ml[h] = (max, sum) for each query head h.
    __device__ __forceinline__ void publish(float (*s_acc)[D], float2* s_ml) {
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (col == 0 && row < G) s_ml[row] = make_float2(m, l);
#pragma unroll
        for (int j = 0; j < KS; j++) {
            const int d = D / 8 * row + 2 * j;
            if (2 * col < G) *reinterpret_cast<float2*>(&s_acc[2 * col][d]) = make_float2(acc[j][0], acc[j][2]);
            if (2 * col + 1 < G) *reinterpret_cast<float2*>(&s_acc[2 * col + 1][d]) = make_float2(acc[j][1], acc[j][3]);
        }
    }
};
