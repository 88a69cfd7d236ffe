// Causal attention for prefill steps on tensor cores: a block takes a tile of PF_BQ query tokens of one sequence
// and one query head, and streams that sequence's K and V (cached prefix and the step's own tokens, already
// rotated and written by the RoPE kernel) through shared memory PF_BK positions at a time. Each K/V tile is read
// once per tile of queries instead of once per query token, and the products run as bf16 mma.sync with f32
// accumulation (flash-attention's online softmax), so long prompts are bound by tensor-core throughput rather
// than by re-reading K and V. Decode steps keep the paged kernel in attention.cuh.
//
// An fp8 cache (kernels/kv_cache.cuh) is widened to bf16 on its way to shared memory, so the products are the same
// bf16 mma.sync: its tiles go through registers (loaded for tile j + 1 before tile j computes, stored after)
// instead of cp.async.
//
// Layouts of one warp's m16n8k16 operands (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane = 4 * r + c,
// A (16x16, row-major): {a0, a1, a2, a3} = rows (r, r + 8) x cols (2c, 2c + 1) then cols + 8;
// B (16x8, k x n):      {b0, b1} = k (2c, 2c + 1) then k + 8, at column n = r;
// C (16x8, f32):        {c0, c1} = row r, cols (2c, 2c + 1); {c2, c3} = row r + 8.
// So the S accumulators of two neighbouring 8-position tiles are exactly the A operand (P) of the next product.
#include "kv_cache.cuh"

#define PF_BQ 64       // query rows per block: 4 warps x 16
#define PF_BK 32       // key positions per shared-memory tile
#define PF_THREADS 128
#define PF_PAD 8       // bf16 of padding per shared row: rows 16 bytes apart mod 128, so ldmatrix is conflict-free

// 16 bytes global -> shared without registers; src_bytes = 0 writes zeros (positions past the context).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <int D>
struct PrefillTiles {
    bf16 k[2][PF_BK][D + PF_PAD];
    bf16 v[2][PF_BK][D + PF_PAD];
};

// The 8-value pieces one thread copies of a K (or V) tile of PF_BK positions x D / 8 pieces.
template <int D>
struct TileVecs {
    static constexpr int CHUNKS = D / 8;  // 8-value pieces of one position's head
    static constexpr int PER_THREAD = PF_BK * CHUNKS / PF_THREADS;
};

// The row (position) and column of piece i of this thread's share of a tile.
template <int D>
__device__ __forceinline__ void tile_cell(int i, int& row, int& col) {
    const int e = threadIdx.x + i * PF_THREADS;
    row = e / TileVecs<D>::CHUNKS;
    col = (e % TileVecs<D>::CHUNKS) * 8;
}

// Where piece i of this thread's share of the tile at p0 sits: its row and column in the tile, and its element
// offset in the cache (valid = false from `end` on).
template <int D>
__device__ __forceinline__ bool tile_piece(int i, int p0, int end, const u32* __restrict__ table, int block_size,
                                           int num_kv_heads, int g, int& row, int& col, size_t& at) {
    tile_cell<D>(i, row, col);
    const int p = p0 + row;
    if (p >= end) return false;
    const u32 blk = __ldg(table + p / block_size);
    at = (((size_t)blk * num_kv_heads + g) * block_size + p % block_size) * D + col;
    return true;
}

// K and V of positions [p0, p0 + PF_BK) of kv head g from a bf16 cache into stage `s` (cp.async); positions from
// `end` on are zeros.
template <int D>
__device__ __forceinline__ void load_kv_tile(PrefillTiles<D>& sm, int s, int p0, int end, const u32* __restrict__ table,
                                             const bf16* k_cache, const bf16* v_cache, int block_size, int num_kv_heads,
                                             int g) {
#pragma unroll
    for (int i = 0; i < TileVecs<D>::PER_THREAD; i++) {
        int row, col;
        size_t at = 0;
        const int bytes = tile_piece<D>(i, p0, end, table, block_size, num_kv_heads, g, row, col, at) ? 16 : 0;
        cp_async16(&sm.k[s][row][col], k_cache + at, bytes);
        cp_async16(&sm.v[s][row][col], v_cache + at, bytes);
    }
}

// This thread's share of one fp8 K/V tile, held in registers between its load and its store to shared memory.
template <int D>
struct Fp8Tile {
    uint2 k[TileVecs<D>::PER_THREAD], v[TileVecs<D>::PER_THREAD];
};

template <int D>
__device__ __forceinline__ void fetch_kv_tile(Fp8Tile<D>& r, int p0, int end, const u32* __restrict__ table,
                                              const fp8* k_cache, const fp8* v_cache, int block_size, int num_kv_heads,
                                              int g) {
#pragma unroll
    for (int i = 0; i < TileVecs<D>::PER_THREAD; i++) {
        int row, col;
        size_t at;
        const bool valid = tile_piece<D>(i, p0, end, table, block_size, num_kv_heads, g, row, col, at);
        r.k[i] = valid ? __ldcg(reinterpret_cast<const uint2*>(k_cache + at)) : make_uint2(0, 0);
        r.v[i] = valid ? __ldcg(reinterpret_cast<const uint2*>(v_cache + at)) : make_uint2(0, 0);
    }
}

// The fetched tile, widened to bf16, into stage `s`.
template <int D>
__device__ __forceinline__ void stash_kv_tile(PrefillTiles<D>& sm, int s, const Fp8Tile<D>& r) {
#pragma unroll
    for (int i = 0; i < TileVecs<D>::PER_THREAD; i++) {
        int row, col;
        tile_cell<D>(i, row, col);
        *reinterpret_cast<uint4*>(&sm.k[s][row][col]) = kv_to_bf16x8(r.k[i]);
        *reinterpret_cast<uint4*>(&sm.v[s][row][col]) = kv_to_bf16x8(r.v[i]);
    }
}

// grid: (sequences, ceil(longest query length / PF_BQ), num_heads); block: PF_THREADS.
// seq_info: 5 u32 per sequence (start, len, past_len, table_start, table_len); q in qkv is already rotated.
// KV: the cache's element type.
template <int D, typename KV>
__device__ void prefill_attention(const bf16* __restrict__ qkv, int width, const u32* __restrict__ seq_info,
                                  const u32* __restrict__ block_tables, const KV* k_cache, const KV* v_cache,
                                  int block_size, int num_kv_heads, int group, float scale, bf16* __restrict__ out) {
    constexpr int KSTEPS = D / 16;  // k-steps of Q.K^T over the head dimension
    constexpr int NT = D / 8;       // 8-wide column tiles of the output
    constexpr int ST = PF_BK / 8;   // 8-position tiles of S per K/V tile
    __shared__ __align__(16) PrefillTiles<D> sm;

    const int seq = blockIdx.x, h = blockIdx.z, g = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const u32* info = seq_info + seq * 5;
    const int start = (int)info[0], len = (int)info[1], past = (int)info[2];
    const int q0 = blockIdx.y * PF_BQ;
    if (q0 >= len) return;  // block-uniform: this sequence has fewer query tiles
    const u32* table = block_tables + info[3];
    const int num_heads = num_kv_heads * group;
    // Keys this block needs: up to the position of its last query.
    const int end = past + min(q0 + PF_BQ, len);
    const int tiles = (end + PF_BK - 1) / PF_BK;

    constexpr bool FP8 = std::is_same<KV, fp8>::value;
    if constexpr (FP8) {
        Fp8Tile<D> first;
        fetch_kv_tile<D>(first, 0, end, table, k_cache, v_cache, block_size, num_kv_heads, g);
        stash_kv_tile<D>(sm, 0, first);
    } else {
        load_kv_tile<D>(sm, 0, 0, end, table, k_cache, v_cache, block_size, num_kv_heads, g);
        cp_async_commit();
    }

    // This warp's 16 query rows: A fragments of Q for every k-step (rows past the sequence are zeros).
    const int i0 = q0 + warp * 16 + r, i1 = i0 + 8;  // query indices within the sequence
    const bf16* q_base = qkv + (size_t)h * D + 2 * c;
    u32 qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        const int col = kk * 16;
        const bf16* row0 = q_base + (size_t)(start + i0) * width + col;
        const bf16* row1 = q_base + (size_t)(start + i1) * width + col;
        qa[kk][0] = i0 < len ? *reinterpret_cast<const u32*>(row0) : 0u;
        qa[kk][1] = i1 < len ? *reinterpret_cast<const u32*>(row1) : 0u;
        qa[kk][2] = i0 < len ? *reinterpret_cast<const u32*>(row0 + 8) : 0u;
        qa[kk][3] = i1 < len ? *reinterpret_cast<const u32*>(row1 + 8) : 0u;
    }
    // Causal limit of each row (rows past the sequence see nothing).
    const int lim0 = i0 < len ? past + i0 : -1, lim1 = i1 < len ? past + i1 : -1;
    const float qscale = scale * LOG2_E;  // scores in log2 units

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int j = 0; j < tiles; j++) {
        const int s = j & 1;
        const bool more = j + 1 < tiles;
        Fp8Tile<D> next;  // FP8: the next tile, in flight while this one computes
        if constexpr (FP8) {
            if (more) fetch_kv_tile<D>(next, (j + 1) * PF_BK, end, table, k_cache, v_cache, block_size, num_kv_heads, g);
        } else if (more) {
            load_kv_tile<D>(sm, s ^ 1, (j + 1) * PF_BK, end, table, k_cache, v_cache, block_size, num_kv_heads, g);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int p0 = j * PF_BK;

        // S = Q K^T for the tile's PF_BK positions.
        float sc[ST][4];
#pragma unroll
        for (int t = 0; t < ST; t++) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
            for (int t = 0; t < ST; t += 2) {
                // matrices: (tile t, dims +0), (tile t, dims +8), (tile t+1, dims +0), (tile t+1, dims +8)
                const int mi = lane >> 3;
                u32 b[4];
                ldmatrix_x4(b, &sm.k[s][(t + (mi >> 1)) * 8 + (lane & 7)][kk * 16 + (mi & 1) * 8]);
                mma_bf16(sc[t], qa[kk], b[0], b[1]);
                mma_bf16(sc[t + 1], qa[kk], b[2], b[3]);
            }
        }

        // Online softmax over the tile, rows r (m0, l0) and r + 8 (m1, l1).
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int t = 0; t < ST; t++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = p0 + t * 8 + 2 * c + e;
                sc[t][e] = p <= lim0 ? sc[t][e] * qscale : -INFINITY;
                sc[t][2 + e] = p <= lim1 ? sc[t][2 + e] * qscale : -INFINITY;
                mx0 = fmaxf(mx0, sc[t][e]);
                mx1 = fmaxf(mx1, sc[t][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        // A row with nothing visible yet keeps m = -inf; its base is 0 so that exp2(-inf - 0) = 0, never NaN.
        const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
        const float corr0 = fast_exp2(m0 - base0), corr1 = fast_exp2(m1 - base1);
        m0 = mx0;
        m1 = mx1;
        float sum0 = 0.0f, sum1 = 0.0f;
        u32 pa[ST / 2][4];  // P as the A operand of P V, one 16-position k-step per pair of S tiles
#pragma unroll
        for (int t = 0; t < ST; t++) {
            const float e0 = fast_exp2(sc[t][0] - base0), e1 = fast_exp2(sc[t][1] - base0);
            const float e2 = fast_exp2(sc[t][2] - base1), e3 = fast_exp2(sc[t][3] - base1);
            sum0 += e0 + e1;
            sum1 += e2 + e3;
            pa[t / 2][(t & 1) * 2 + 0] = pack_bf16(e0, e1);
            pa[t / 2][(t & 1) * 2 + 1] = pack_bf16(e2, e3);
        }
        l0 = l0 * corr0 + sum0;
        l1 = l1 * corr1 + sum1;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] *= corr0;
            o[n][1] *= corr0;
            o[n][2] *= corr1;
            o[n][3] *= corr1;
        }

        // O += P V: k = the tile's positions, n = head dimensions.
#pragma unroll
        for (int kk = 0; kk < PF_BK / 16; kk++) {
            // A = P rows x positions [16 kk, 16 kk + 16): S tiles 2 kk (cols +0) and 2 kk + 1 (cols +8).
            const u32 a[4] = {pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]};
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                // matrices: (positions +0, dims n), (positions +8, dims n), (+0, dims n+1), (+8, dims n+1)
                const int mi = lane >> 3;
                u32 b[4];
                ldmatrix_x4_trans(b, &sm.v[s][kk * 16 + (mi & 1) * 8 + (lane & 7)][(n + (mi >> 1)) * 8]);
                mma_bf16(o[n], a, b[0], b[1]);
                mma_bf16(o[n + 1], a, b[2], b[3]);
            }
        }
        // Stage s ^ 1 was last read in the previous iteration, which every warp has left.
        if constexpr (FP8) {
            if (more) stash_kv_tile<D>(sm, s ^ 1, next);
        }
        __syncthreads();  // the next iteration's loads overwrite the stage just read
    }

#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    bf16* out0 = out + (size_t)(start + i0) * num_heads * D + (size_t)h * D + 2 * c;
    bf16* out1 = out + (size_t)(start + i1) * num_heads * D + (size_t)h * D + 2 * c;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        if (i0 < len) *reinterpret_cast<u32*>(out0 + n * 8) = pack_bf16(o[n][0] * inv0, o[n][1] * inv0);
        if (i1 < len) *reinterpret_cast<u32*>(out1 + n * 8) = pack_bf16(o[n][2] * inv1, o[n][3] * inv1);
    }
}

#define PREFILL_ATTENTION_KERNEL(NAME, KV, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(PF_THREADS) NAME##_d##D(                                       \
        const bf16* qkv, int width, const u32* seq_info, const u32* block_tables, const KV* k_cache,            \
        const KV* v_cache, int block_size, int num_kv_heads, int group, float scale, bf16* out) {               \
        kernel_begin();                                                                                         \
        prefill_attention<D, KV>(qkv, width, seq_info, block_tables, k_cache, v_cache, block_size,              \
                                 num_kv_heads, group, scale, out);                                              \
    }

PREFILL_ATTENTION_KERNEL(prefill_attention, bf16, 64)
PREFILL_ATTENTION_KERNEL(prefill_attention, bf16, 128)
PREFILL_ATTENTION_KERNEL(prefill_attention_fp8, fp8, 64)
PREFILL_ATTENTION_KERNEL(prefill_attention_fp8, fp8, 128)
