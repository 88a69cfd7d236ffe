// Causal attention for prefill steps on tensor cores: a block takes a tile of PF_BQ query tokens (2 PF_BQ for the
// wide blocks of long prompts) of one sequence and one query head, and streams that sequence's K and V (cached
// prefix and the step's own tokens, already rotated and written by the RoPE kernel) through shared memory BK
// positions at a time. Each K/V tile is read once per tile of queries instead of once per query token, and the
// products run as bf16 mma.sync with f32 accumulation (flash-attention's online softmax), so long prompts are bound
// by tensor-core throughput rather than by re-reading K and V. Decode steps keep the paged kernel in attention.cuh.
//
// What keeps the warps issuing (Nsight Compute on a 3,800-token prompt found them stalled on short dependency
// chains, the integer pipe the busiest, and the multiprocessors idle a fifth of the time at the grid's end):
// - the grid's last dimension is the query tile, heaviest (last) tiles first, so the short tiles fill the tail;
// - only tiles that cross a warp's causal edge (or the sequence's end) are masked;
// - the output is rescaled only when some row's running maximum moved, and the scale rides in the exponent's FMA;
// - block-table lookups divide by the block size with a multiply and shift (FastDiv);
// - for long prompts, wide blocks: each warp takes 32 query rows, so every K and V fragment it reads feeds two
//   products.
//
// Split keys: when a step has few query tiles over many keys (a chunk of a long prompt, or a short prompt tail after
// a long cached prefix), the grid would leave most multiprocessors idle while each block walks every key. The host
// then gives each query tile `splits` blocks, each taking an equal share of its K/V tiles; they leave unnormalized
// partial outputs with their (max, sum), and prefill_attention_merge combines them.
//
// An fp8 cache (kernels/kv_cache.cuh) is widened to f16 on its way to shared memory (one conversion per pair: every
// e4m3 value is an f16), and its products run as f16 mma.sync, with q converted to f16 (exact in f16 range) and P
// rounded to f16, as in the decode kernel (kernels/attention_mma.cuh). Widening to bf16 took three conversions a
// pair, a sixth of the main loop's instructions. Its tiles go through registers (loaded for tile j + 1 before tile
// j computes, stored after) instead of cp.async.
//
// Layouts of one warp's m16n8k16 operands (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane = 4 * r + c,
// A (16x16, row-major): {a0, a1, a2, a3} = rows (r, r + 8) x cols (2c, 2c + 1) then cols + 8;
// B (16x8, k x n):      {b0, b1} = k (2c, 2c + 1) then k + 8, at column n = r;
// C (16x8, f32):        {c0, c1} = row r, cols (2c, 2c + 1); {c2, c3} = row r + 8.
// So the S accumulators of two neighbouring 8-position tiles are exactly the A operand (P) of the next product.
#include "kv_cache.cuh"

#define PF_BQ 64       // query rows per narrow block: 4 warps x 16
#define PF_BK 64       // key positions per shared-memory tile of a narrow block
#define PF_THREADS 128
#define PF_PAD 8       // bf16 of padding per shared row: rows 16 bytes apart mod 128, so ldmatrix is conflict-free

// 16 bytes global -> shared without registers; src_bytes = 0 writes zeros (positions past the context).
__device__ __forceinline__ void cp_async16_to(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    cp_async16_to(smem_addr(dst), src, src_bytes);
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

// A block's K/V tiles in dynamic shared memory: two stages of BK positions of K, then two of V, each position's D
// values padded to D + PF_PAD; a wide block's queries follow them. The host sizes it (PrefillTiling::shared_bytes in
// rust/core/src/backend/cuda/backend.rs).
template <int D, int BK>
struct PrefillTiles {
    static constexpr int ROW = D + PF_PAD;
    static constexpr int CHUNKS = D / 8;  // 8-value pieces of one position's head
    static constexpr int PER_THREAD = BK * CHUNKS / PF_THREADS;
    static_assert(BK * CHUNKS % PF_THREADS == 0, "every thread copies whole 8-value pieces of a tile");
    bf16* base;
    __device__ __forceinline__ bf16* k(int s, int row, int col) const { return base + (s * BK + row) * ROW + col; }
    __device__ __forceinline__ bf16* v(int s, int row, int col) const { return base + ((2 + s) * BK + row) * ROW + col; }
    static constexpr int ROWS_PER_PASS = PF_THREADS / CHUNKS;
    static_assert(PF_THREADS % CHUNKS == 0, "a thread's pieces share its column");
    static constexpr u32 PASS_BYTES = ROWS_PER_PASS * ROW * 2;  // from one of a thread's pieces to its next
    static constexpr u32 V_BYTES = 2 * BK * ROW * 2;           // from a piece of K to the same piece of V
    // The row (position) and column of piece i of this thread's share of a tile: piece threadIdx.x + i * PF_THREADS
    // in row-major order. Written as the thread's first row plus a constant step, so a piece's offsets within a
    // stage are the first piece's plus an immediate rather than a division per piece.
    __device__ __forceinline__ static void cell(int i, int& row, int& col) {
        row = (int)(threadIdx.x / CHUNKS) + i * ROWS_PER_PASS;
        col = (int)(threadIdx.x % CHUNKS) * 8;
    }
};

// Where kv head g of one sequence's positions live in the paged cache ([block][kv head][position in block][D]),
// in bytes. The tile loads take issue slots from the main loop's products (Nsight Compute found the integer pipe
// the busiest), so the offsets are split into what is fixed for the block (a cache block's bytes, the head's offset
// within one: both fit 32 bits) and what each piece adds, with one 32 x 32 -> 64-bit multiply-add per piece
// instead of a chain of 64-bit products.
struct PagedKv {
    const u32* table;
    FastDiv bdiv;
    u32 block_size;
    u32 block_bytes;     // num_kv_heads * block_size * D elements
    u32 head_bytes;      // g * block_size * D elements
    u32 position_bytes;  // D elements

    template <int D, typename KV>
    __device__ __forceinline__ static PagedKv make(const u32* table, int block_size, int num_kv_heads, int g) {
        constexpr u32 E = sizeof(KV);
        // Opaque to the compiler, so each lookup is one multiply-add onto this pointer rather than the sequence's
        // table offset and the entry's index added in 32 bits and then widened (four instructions a piece).
        asm("mov.b64 %0, %0;" : "+l"(table));
        return PagedKv{table, FastDiv((u32)block_size), (u32)block_size, (u32)(num_kv_heads * block_size * D) * E,
                       (u32)(g * block_size * D) * E, (u32)D * E};
    }
};

// Piece (row, col) of the tile at p0 in a cache at `base`, and whether that position is below `end` (else it reads
// as zeros). Past `end` the address is that of position end - 1 (valid: end >= 1 wherever a tile is loaded), so
// the lookup needs no branch.
template <typename KV>
__device__ __forceinline__ bool tile_piece(const PagedKv& kv, int p0, int row, int col, int end, const KV* base,
                                           const KV*& at) {
    const int p = p0 + row;
    const bool valid = p < end;
    const u32 q = (u32)(valid ? p : end - 1);
    const u32 b = kv.bdiv.div(q);
    const u32 blk = __ldg(kv.table + b);
    const u32 in_block = kv.head_bytes + (q - b * kv.block_size) * kv.position_bytes + (u32)col * (u32)sizeof(KV);
    at = reinterpret_cast<const KV*>(reinterpret_cast<const char*>(base) + in_block + (size_t)blk * kv.block_bytes);
    return valid;
}

// K and V of positions [p0, p0 + BK) from a bf16 cache into stage `s` (cp.async); positions from `end` on are zeros.
template <int D, int BK>
__device__ __forceinline__ void load_kv_tile(const PrefillTiles<D, BK>& sm, int s, int p0, int end, const PagedKv& kv,
                                             const bf16* k_cache, const bf16* v_cache) {
    using T = PrefillTiles<D, BK>;
    int row0, col;
    T::cell(0, row0, col);
    const u32 first_k = smem_addr(sm.k(s, row0, col));
#pragma unroll
    for (int i = 0; i < T::PER_THREAD; i++) {
        int row;
        T::cell(i, row, col);
        const bf16* k;
        const int bytes = tile_piece(kv, p0, row, col, end, k_cache, k) ? 16 : 0;
        // Shared addresses from the first piece's plus a constant (T::cell), V's a constant past K's.
        cp_async16_to(first_k + i * T::PASS_BYTES, k, bytes);
        cp_async16_to(first_k + T::V_BYTES + i * T::PASS_BYTES, v_cache + (k - k_cache), bytes);
    }
}

// This thread's share of one fp8 K/V tile, held in registers between its load and its store to shared memory.
template <int D, int BK>
struct Fp8Tile {
    uint2 k[PrefillTiles<D, BK>::PER_THREAD], v[PrefillTiles<D, BK>::PER_THREAD];
};

template <int D, int BK>
__device__ __forceinline__ void fetch_kv_tile(Fp8Tile<D, BK>& r, int p0, int end, const PagedKv& kv, const fp8* k_cache,
                                              const fp8* v_cache) {
    using T = PrefillTiles<D, BK>;
#pragma unroll
    for (int i = 0; i < T::PER_THREAD; i++) {
        int row, col;
        T::cell(i, row, col);
        const fp8* at;
        const bool valid = tile_piece(kv, p0, row, col, end, k_cache, at);
        // The address is valid either way (tile_piece), so the loads need no branch.
        const uint2 k = __ldcg(reinterpret_cast<const uint2*>(at));
        const uint2 v = __ldcg(reinterpret_cast<const uint2*>(v_cache + (at - k_cache)));
        r.k[i] = valid ? k : make_uint2(0, 0);
        r.v[i] = valid ? v : make_uint2(0, 0);
    }
}

// The fetched tile, widened to f16, into stage `s`.
template <int D, int BK>
__device__ __forceinline__ void stash_kv_tile(const PrefillTiles<D, BK>& sm, int s, const Fp8Tile<D, BK>& r) {
    using T = PrefillTiles<D, BK>;
    int row0, col;
    T::cell(0, row0, col);
    bf16* const first_k = sm.k(s, row0, col);
#pragma unroll
    for (int i = 0; i < T::PER_THREAD; i++) {
        bf16* const k = first_k + i * (T::PASS_BYTES / 2);
        *reinterpret_cast<uint4*>(k) = MmaOperand<fp8>::widen8(r.k[i]);
        *reinterpret_cast<uint4*>(k + T::V_BYTES / 2) = MmaOperand<fp8>::widen8(r.v[i]);
    }
}

// A wide block's queries: BQ rows of D values in shared memory, copied 8 at a time; this thread's piece i is
// piece threadIdx.x + i * PF_THREADS in row-major order.
template <int D, int BQ>
struct QueryPieces {
    static constexpr int ROW = D + PF_PAD, PER_THREAD = BQ * (D / 8) / PF_THREADS;
    __device__ __forceinline__ static void cell(int i, int& row, int& col) {
        const int e = threadIdx.x + i * PF_THREADS;
        row = e / (D / 8);
        col = (e % (D / 8)) * 8;
    }
};

// A wide block's queries in shared memory as f16 operands, each thread converting the pieces it copied: for an
// fp8 cache, whose products are on f16.
template <int D, int BQ>
__device__ __forceinline__ void queries_to_f16(bf16* s_q) {
    using Q = QueryPieces<D, BQ>;
#pragma unroll
    for (int i = 0; i < Q::PER_THREAD; i++) {
        int row, col;
        Q::cell(i, row, col);
        uint4* piece = reinterpret_cast<uint4*>(s_q + row * Q::ROW + col);
        uint4 w = *piece;
        w.x = MmaOperand<fp8>::from_bf16x2(w.x);
        w.y = MmaOperand<fp8>::from_bf16x2(w.y);
        w.z = MmaOperand<fp8>::from_bf16x2(w.z);
        w.w = MmaOperand<fp8>::from_bf16x2(w.w);
        *piece = w;
    }
}

// A split block's state of one (query token, head): its unnormalized output (at its running max) and (max in log2
// units, sum): D + 2 floats at offset record(token, head, split) of the host's workspace.
template <int D>
struct PrefillPartial {
    int num_heads, splits;

    __device__ __forceinline__ size_t record(int token, int h, int split) const {
        return (((size_t)token * num_heads + h) * splits + split) * (D + 2);
    }
    // One accumulator row of an m-tile (e = 0: row r, e = 2: row r + 8) as a warp's quad c holds it.
    __device__ __forceinline__ void store(float* partial, int token, int h, int split, const float (&o)[D / 8][4],
                                          int e, float m, float l, int c) const {
        float* rec = partial + record(token, h, split);
#pragma unroll
        for (int n = 0; n < D / 8; n++) __stcg(reinterpret_cast<float2*>(rec + n * 8 + 2 * c), make_float2(o[n][e], o[n][e + 1]));
        if (c == 0) __stcg(reinterpret_cast<float2*>(rec + D), make_float2(m, l));
    }
};

// The maxima of one tile's raw scores (not yet scaled): rows r (mx0) and r + 8 (mx1). MASK: the tile crosses a
// row's causal limit (lim0, lim1; -1 for rows past the sequence), so later positions get -inf.
template <int ST, bool MASK>
__device__ __forceinline__ void mask_and_max(float (&sc)[ST][4], int p0, int c, int lim0, int lim1, float& mx0, float& mx1) {
#pragma unroll
    for (int t = 0; t < ST; t++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            if (MASK) {
                const int p = p0 + t * 8 + 2 * c + e;
                if (p > lim0) sc[t][e] = -INFINITY;
                if (p > lim1) sc[t][2 + e] = -INFINITY;
            }
            mx0 = fmaxf(mx0, sc[t][e]);
            mx1 = fmaxf(mx1, sc[t][2 + e]);
        }
    }
}

// grid: (sequences, num_heads, ceil(longest query length / (PF_BQ * MT)) * splits); block: PF_THREADS; dynamic
// shared memory: the tiles (and, for MT > 1, the block's queries). seq_info: 5 u32 per sequence (start, len, past_len,
// table_start, table_len); q in qkv is already rotated. KV: the cache's element type; BK: key positions per tile;
// MT: 16-row m-tiles per warp. With MT = 1 a warp keeps its queries' A fragments in registers; with MT > 1 they
// are read from shared memory at every k-step (the registers go to the accumulators), and every K and V fragment
// feeds MT products. splits > 1: blockIdx.z is (query tile, split), and each block writes its partial state to
// `partial` (PrefillPartial) instead of `out`.
template <int D, int BK, int MT, typename KV>
__device__ void prefill_attention(const bf16* __restrict__ qkv, int width, const u32* __restrict__ seq_info,
                                  const u32* __restrict__ block_tables, const KV* k_cache, const KV* v_cache,
                                  int block_size, int num_kv_heads, int group, float scale, bf16* __restrict__ out,
                                  int splits, float* __restrict__ partial) {
    constexpr int KSTEPS = D / 16;  // k-steps of Q.K^T over the head dimension
    constexpr int NT = D / 8;       // 8-wide column tiles of the output
    constexpr int ST = BK / 8;      // 8-position tiles of S per K/V tile
    constexpr int BQ = PF_BQ * MT;  // query rows per block
    constexpr int ROW = PrefillTiles<D, BK>::ROW;
    extern __shared__ __align__(16) unsigned char pf_shared[];
    const PrefillTiles<D, BK> sm{reinterpret_cast<bf16*>(pf_shared)};
    bf16* const s_q = reinterpret_cast<bf16*>(pf_shared) + 4 * BK * ROW;  // MT > 1: [BQ][ROW]

    const int seq = blockIdx.x, h = blockIdx.y, g = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const u32* info = seq_info + seq * 5;
    const int start = (int)info[0], len = (int)info[1], past = (int)info[2];
    const int tile = blockIdx.z / splits, split = blockIdx.z - tile * splits;
    const int q0 = (gridDim.z / splits - 1 - tile) * BQ;  // the last query tiles have the most keys: they go first
    if (q0 >= len) return;  // block-uniform: this sequence has fewer query tiles
    const PagedKv kv = PagedKv::make<D, KV>(block_tables + info[3], block_size, num_kv_heads, g);
    const int num_heads = num_kv_heads * group;
    // Keys this block's queries see: up to the position of its last query; this split takes K/V tiles [j0, j1).
    const int end = past + min(q0 + BQ, len);
    const int tiles = (end + BK - 1) / BK, per_split = (tiles + splits - 1) / splits;
    const int j0 = split * per_split, j1 = min(tiles, j0 + per_split);
    const bf16* q_rows = qkv + (size_t)h * D;  // query i's head at q_rows + (start + i) * width

    constexpr bool FP8 = std::is_same<KV, fp8>::value;
    using Op = MmaOperand<KV>;  // bf16 operands, or f16 for an fp8 cache
    if constexpr (MT > 1) {
        // The block's queries into shared memory (zeros past the sequence), in the first tile's copy group.
        using Q = QueryPieces<D, BQ>;
#pragma unroll
        for (int i = 0; i < Q::PER_THREAD; i++) {
            int row, col;
            Q::cell(i, row, col);
            const bool valid = q0 + row < len;
            cp_async16(s_q + row * ROW + col, q_rows + (size_t)(start + (valid ? q0 + row : 0)) * width + col, valid ? 16 : 0);
        }
    }
    if constexpr (FP8) {
        Fp8Tile<D, BK> first;
        if (j0 < j1) {
            fetch_kv_tile<D, BK>(first, j0 * BK, end, kv, k_cache, v_cache);
            stash_kv_tile<D, BK>(sm, 0, first);
        }
        if constexpr (MT > 1) {
            // The queries (committed as a group, or the wait would not cover them), turned into f16 in place by the
            // thread that copied each piece; the loop's first barrier publishes them. (Inside the loop this
            // conversion cost the kernel its registers.)
            cp_async_commit();
            cp_async_wait<0>();
            queries_to_f16<D, BQ>(s_q);
        }
    } else {
        if (j0 < j1) load_kv_tile<D, BK>(sm, 0, j0 * BK, end, kv, k_cache, v_cache);
        cp_async_commit();
    }

    // This warp's rows: m-tile mt holds queries warp_first + 16 mt + r (i0) and + 8 (i1).
    const int warp_first = q0 + warp * 16 * MT;
    int i0[MT], i1[MT], lim0[MT], lim1[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        i0[mt] = warp_first + 16 * mt + r;
        i1[mt] = i0[mt] + 8;
        // Causal limit of each row (rows past the sequence see nothing).
        lim0[mt] = i0[mt] < len ? past + i0[mt] : -1;
        lim1[mt] = i1[mt] < len ? past + i1[mt] : -1;
    }
    // MT = 1: A fragments of Q for every k-step, in registers (rows past the sequence are zeros).
    u32 qa[MT == 1 ? KSTEPS : 1][4];
    if constexpr (MT == 1) {
        const bf16* q_base = q_rows + 2 * c;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            const bf16* row0 = q_base + (size_t)(start + i0[0]) * width + kk * 16;
            const bf16* row1 = q_base + (size_t)(start + i1[0]) * width + kk * 16;
            qa[kk][0] = i0[0] < len ? Op::from_bf16x2(*reinterpret_cast<const u32*>(row0)) : 0u;
            qa[kk][1] = i1[0] < len ? Op::from_bf16x2(*reinterpret_cast<const u32*>(row1)) : 0u;
            qa[kk][2] = i0[0] < len ? Op::from_bf16x2(*reinterpret_cast<const u32*>(row0 + 8)) : 0u;
            qa[kk][3] = i1[0] < len ? Op::from_bf16x2(*reinterpret_cast<const u32*>(row1 + 8)) : 0u;
        }
    }
    // Every row of this warp sees at least the positions up to `unmasked` (-1 when some row is past the sequence).
    const int unmasked = warp_first + 16 * MT - 1 < len ? past + warp_first : -1;
    const float qscale = scale * LOG2_E;  // scores in log2 units

    float o[MT][NT][4];
    float m0[MT], m1[MT], l0[MT], l1[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int n = 0; n < NT; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        m0[mt] = m1[mt] = -INFINITY;
        l0[mt] = l1[mt] = 0.0f;
    }

    for (int j = j0; j < j1; j++) {
        const int s = (j - j0) & 1;
        const bool more = j + 1 < j1;
        Fp8Tile<D, BK> next;  // FP8: the next tile, in flight while this one computes
        if constexpr (FP8) {
            if (more) fetch_kv_tile<D, BK>(next, (j + 1) * BK, end, kv, k_cache, v_cache);
        } else if (more) {
            load_kv_tile<D, BK>(sm, s ^ 1, (j + 1) * BK, end, kv, k_cache, v_cache);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int p0 = j * BK;

        // S = Q K^T for the tile's BK positions.
        float sc[MT][ST][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int t = 0; t < ST; t++) sc[mt][t][0] = sc[mt][t][1] = sc[mt][t][2] = sc[mt][t][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            u32 qf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if constexpr (MT == 1) {
                    qf[0][0] = qa[kk][0], qf[0][1] = qa[kk][1], qf[0][2] = qa[kk][2], qf[0][3] = qa[kk][3];
                } else {
                    // matrices: rows +0 / +8 of the m-tile, dims +0 / +8 (the A fragment's order)
                    ldmatrix_x4(qf[mt], s_q + (warp * 16 * MT + 16 * mt + (lane & 15)) * ROW + kk * 16 + (lane >> 4) * 8);
                }
            }
#pragma unroll
            for (int t = 0; t < ST; t += 2) {
                // matrices: (tile t, dims +0), (tile t, dims +8), (tile t+1, dims +0), (tile t+1, dims +8)
                const int mi = lane >> 3;
                u32 b[4];
                ldmatrix_x4(b, sm.k(s, (t + (mi >> 1)) * 8 + (lane & 7), kk * 16 + (mi & 1) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    Op::mma(sc[mt][t], qf[mt], b[0], b[1]);
                    Op::mma(sc[mt][t + 1], qf[mt], b[2], b[3]);
                }
            }
        }

        // Online softmax over the tile, rows r (m0, l0) and r + 8 (m1, l1) of each m-tile, in log2 units: the scale
        // goes into each exponent's FMA, and the maximum is taken before it (qscale > 0).
        const bool masked = p0 + BK - 1 > unmasked;  // warp-uniform
        u32 pa[MT][ST / 2][4];  // P as the A operand of P V, one 16-position k-step per pair of S tiles
        float corr0[MT], corr1[MT];
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float mx0 = -INFINITY, mx1 = -INFINITY;
            if (masked) {
                mask_and_max<ST, true>(sc[mt], p0, c, lim0[mt], lim1[mt], mx0, mx1);
            } else {
                mask_and_max<ST, false>(sc[mt], p0, c, lim0[mt], lim1[mt], mx0, mx1);
            }
#pragma unroll
            for (int x = 1; x <= 2; x <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
            }
            mx0 = fmaxf(m0[mt], mx0 * qscale);
            mx1 = fmaxf(m1[mt], mx1 * qscale);
            // A row with nothing visible yet keeps m = -inf; its base is 0 so that exp2(-inf - 0) = 0, never NaN.
            const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
            corr0[mt] = fast_exp2(m0[mt] - base0);
            corr1[mt] = fast_exp2(m1[mt] - base1);
            moved |= corr0[mt] != 1.0f || corr1[mt] != 1.0f;
            m0[mt] = mx0;
            m1[mt] = mx1;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int t = 0; t < ST; t++) {
                const float e0 = fast_exp2(fmaf(sc[mt][t][0], qscale, -base0));
                const float e1 = fast_exp2(fmaf(sc[mt][t][1], qscale, -base0));
                const float e2 = fast_exp2(fmaf(sc[mt][t][2], qscale, -base1));
                const float e3 = fast_exp2(fmaf(sc[mt][t][3], qscale, -base1));
                sum0 += e0 + e1;
                sum1 += e2 + e3;
                pa[mt][t / 2][(t & 1) * 2 + 0] = Op::pack(e0, e1);
                pa[mt][t / 2][(t & 1) * 2 + 1] = Op::pack(e2, e3);
            }
            l0[mt] = l0[mt] * corr0[mt] + sum0;
            l1[mt] = l1[mt] * corr1[mt] + sum1;
        }
        // Once the maxima settle (most tiles of a long prompt), no row's correction differs from 1.
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    o[mt][n][0] *= corr0[mt];
                    o[mt][n][1] *= corr0[mt];
                    o[mt][n][2] *= corr1[mt];
                    o[mt][n][3] *= corr1[mt];
                }
        }

        // O += P V: k = the tile's positions, n = head dimensions.
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                // matrices: (positions +0, dims n), (positions +8, dims n), (+0, dims n+1), (+8, dims n+1)
                const int mi = lane >> 3;
                u32 b[4];
                ldmatrix_x4_trans(b, sm.v(s, kk * 16 + (mi & 1) * 8 + (lane & 7), (n + (mi >> 1)) * 8));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    // A = P rows x positions [16 kk, 16 kk + 16): S tiles 2 kk (cols +0) and 2 kk + 1 (cols +8).
                    Op::mma(o[mt][n], pa[mt][kk], b[0], b[1]);
                    Op::mma(o[mt][n + 1], pa[mt][kk], b[2], b[3]);
                }
            }
        }
        // Stage s ^ 1 was last read in the previous iteration, which every warp has left.
        if constexpr (FP8) {
            if (more) stash_kv_tile<D, BK>(sm, s ^ 1, next);
        }
        __syncthreads();  // the next iteration's loads overwrite the stage just read
    }
    cp_async_wait<0>();  // nothing in flight at exit (a split with no tiles committed an empty group)

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float s0 = l0[mt], s1 = l1[mt];
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, x);
            s1 += __shfl_xor_sync(0xffffffffu, s1, x);
        }
        if (splits > 1) {  // block-uniform
            const PrefillPartial<D> part{num_heads, splits};
            if (i0[mt] < len) part.store(partial, start + i0[mt], h, split, o[mt], 0, m0[mt], s0, c);
            if (i1[mt] < len) part.store(partial, start + i1[mt], h, split, o[mt], 2, m1[mt], s1, c);
            continue;
        }
        const float inv0 = s0 > 0.0f ? 1.0f / s0 : 0.0f, inv1 = s1 > 0.0f ? 1.0f / s1 : 0.0f;
        bf16* out0 = out + (size_t)(start + i0[mt]) * num_heads * D + (size_t)h * D + 2 * c;
        bf16* out1 = out + (size_t)(start + i1[mt]) * num_heads * D + (size_t)h * D + 2 * c;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            if (i0[mt] < len) *reinterpret_cast<u32*>(out0 + n * 8) = pack_bf16(o[mt][n][0] * inv0, o[mt][n][1] * inv0);
            if (i1[mt] < len) *reinterpret_cast<u32*>(out1 + n * 8) = pack_bf16(o[mt][n][2] * inv1, o[mt][n][3] * inv1);
        }
    }
}

// Combines the split blocks' partial states into each query token's output. grid: (tokens, num_heads); block: one
// warp, each lane D / 32 dimensions.
template <int D>
__device__ void prefill_attention_merge(const float* __restrict__ partial, int num_heads, int splits, bf16* __restrict__ out) {
    constexpr int V = D / 32;
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const PrefillPartial<D> part{num_heads, splits};
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, __ldcg(partial + part.record(t, h, s) + D));
    float l = 0.0f, acc[V] = {};
    for (int s = 0; s < splits; s++) {
        const float* rec = partial + part.record(t, h, s);
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(rec + D));
        if (ml.x == -INFINITY) continue;  // this split saw none of the token's keys
        const float c = fast_exp2(ml.x - mx);
        l += ml.y * c;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] += __ldcg(rec + lane * V + i) * c;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    bf16* o = out + ((size_t)t * num_heads + h) * D + lane * V;
#pragma unroll
    for (int i = 0; i < V; i += 2) *reinterpret_cast<u32*>(o + i) = pack_bf16(acc[i] * inv, acc[i + 1] * inv);
}

#define PREFILL_MERGE_KERNEL(D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32) prefill_attention_merge_d##D(                              \
        const float* partial, int num_heads, int splits, bf16* out) {                                           \
        kernel_begin();                                                                                         \
        prefill_attention_merge<D>(partial, num_heads, splits, out);                                            \
    }
PREFILL_MERGE_KERNEL(64)
PREFILL_MERGE_KERNEL(128)

#define PREFILL_ATTENTION_KERNEL(NAME, KV, D, BK, MT, MIN_BLOCKS)                                               \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, MIN_BLOCKS) NAME##_d##D(                           \
        const bf16* qkv, int width, const u32* seq_info, const u32* block_tables, const KV* k_cache,            \
        const KV* v_cache, int block_size, int num_kv_heads, int group, float scale, bf16* out, int splits,     \
        float* partial) {                                                                                       \
        kernel_begin();                                                                                         \
        prefill_attention<D, BK, MT, KV>(qkv, width, seq_info, block_tables, k_cache, v_cache, block_size,      \
                                         num_kv_heads, group, scale, out, splits, partial);                     \
    }

// Narrow blocks (16 query rows per warp, 64-position tiles), two per multiprocessor: the tiles take 68 KiB of shared
// memory at head_dim 128 and ptxas uses about 220 registers. Measured on an H100 against 32-position tiles at three
// blocks: a 3,800-token prompt's attention took 302 against 282 us per layer with a bf16 cache, but 309 against 319
// with fp8, and prompts of 512 and 2,048 tokens got their first token 7-9% sooner.
PREFILL_ATTENTION_KERNEL(prefill_attention, bf16, 64, PF_BK, 1, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention, bf16, 128, PF_BK, 1, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention_fp8, fp8, 64, PF_BK, 1, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention_fp8, fp8, 128, PF_BK, 1, 2)
// Wide blocks (32 query rows per warp, 32-position tiles, the queries in shared memory), two per multiprocessor at
// about 250 registers: for long prompts (the host's PrefillTilingChoice in rust/core/src/backend/cuda/backend.rs).
PREFILL_ATTENTION_KERNEL(prefill_attention_m2, bf16, 64, 32, 2, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention_m2, bf16, 128, 32, 2, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention_m2_fp8, fp8, 64, 32, 2, 2)
PREFILL_ATTENTION_KERNEL(prefill_attention_m2_fp8, fp8, 128, 32, 2, 2)
