// GPU sampling with per-row parameters, following rust/core/src/sampling.rs: logit bias; repetition
// penalty over prompt + output (each distinct token once); presence/frequency over output; then greedy
// argmax, or temperature -> top-k -> top-p -> min-p -> one inverse-CDF draw with the row's uniform u.
// The uniform comes from the host (sampling::seeded_uniform(seed, position)), so draws depend only on
// (seed, position). Truncated sets are drawn in token-id order (the CPU's order is unspecified there).
// One block of SAMPLE_THREADS per row; thresholds are found by bisection over order-preserving keys.
#include "common.cuh"

#define SAMPLE_THREADS 1024

// Per-row parameters, laid out by the host (cuda/sampler.rs) as 16 words.
struct RowParams {
    float temperature;
    u32 top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    u32 greedy;
    u32 ids_start;   // into ids: prompt ids, then output ids
    u32 prompt_len;
    u32 output_len;
    u32 bias_start;  // into bias: (token id, f32 bits) pairs
    u32 bias_len;
    u32 u_lo, u_hi;  // the f64 uniform in [0, 1)
    u32 pad;
};

// The upper middle of [lo, hi] for a bisection that keeps `lo` on success; in 64 bits, because hi - lo + 1
// overflows u32 for the full key range (mid would be lo, and the search would never end).
__host__ __device__ __forceinline__ u32 upper_mid(u32 lo, u32 hi) {
    return (u32)(((unsigned long long)lo + (unsigned long long)hi + 1ull) / 2ull);
}

// Index of the first maximum (NaN ignored; 0 when nothing is a number).
__device__ u32 argmax_row(const float* w, int V, float* fscratch, u32* uscratch) {
    float best = -INFINITY;
    u32 idx = 0xffffffffu;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = w[i];
        if (v > best || (v == best && (u32)i < idx)) {
            best = v;
            idx = i;
        }
    }
    const float mx = block_max(best, fscratch);
    u32 cand = (best == mx) ? idx : 0xffffffffu;
    // min over candidates
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) uscratch[threadIdx.x >> 5] = cand;
    __syncthreads();
    cand = (threadIdx.x & 31) < (blockDim.x >> 5) ? uscratch[threadIdx.x & 31] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    return cand == 0xffffffffu ? 0u : cand;
}

// Exclusive prefix over the block (thread order) of one value per thread; `scratch` holds 32 entries.
template <typename T>
__device__ T block_exclusive_scan(T v, T* scratch, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (int w = 0; w < warps; w++) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    return before + incl - v;
}

// Among kept tokens whose key equals `key`, the id of the `need`-th one (1-based) in id order.
// Threads own contiguous id ranges so that thread order is id order.
__device__ u32 nth_tie(const float* w, const unsigned char* kept, int V, u32 key, u32 need, u32* uscratch,
                       u32* shared_out) {
    const int per = (V + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(V, lo + per);
    u32 count = 0;
    for (int i = lo; i < hi; i++) count += (kept[i] && order_key(w[i]) == key);
    u32 total;
    const u32 before = block_exclusive_scan<u32>(count, uscratch, &total);
    if (before < need && before + count >= need) {
        u32 seen = before;
        for (int i = lo; i < hi; i++) {
            if (kept[i] && order_key(w[i]) == key && ++seen == need) {
                *shared_out = i;
                break;
            }
        }
    }
    __syncthreads();
    return *shared_out;
}

// Row r's drawn token: into out_tokens, and into the argmax keys in their format (low word ~token), where a decode
// graph's first kernel finds the last step's tokens (kernels/decode_advance.cu).
__device__ __forceinline__ void emit_token(u32* out_tokens, unsigned long long* keys, int r, u32 tok) {
    out_tokens[r] = tok;
    keys[r] = 0xffffffffu - tok;
}

// grid: rows; block: SAMPLE_THREADS. logits: bf16 [rows, V]; work: f32 [rows, V]; keep: u8 [rows, V]; keys:
// u64 [rows].
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const bf16* __restrict__ logits, int V, const RowParams* __restrict__ params,
                const u32* __restrict__ ids, const u32* __restrict__ bias, float* __restrict__ work,
                unsigned char* __restrict__ keep, u32* __restrict__ out_tokens, unsigned long long* __restrict__ keys) {
    kernel_begin();
    __shared__ float fscratch[32];
    __shared__ u32 uscratch[32];
    __shared__ double dscratch[32];
    __shared__ u32 shared_u32;
    const int r = blockIdx.x;
    const RowParams p = params[r];
    const bf16* row = logits + (size_t)r * V;
    float* w = work + (size_t)r * V;
    unsigned char* kept = keep + (size_t)r * V;

    for (int i = threadIdx.x; i < V; i += blockDim.x) w[i] = __bfloat162float(row[i]);
    __syncthreads();
    // Bias pairs in list order by one thread: duplicates add up exactly as on the CPU.
    if (threadIdx.x == 0) {
        for (u32 j = 0; j < p.bias_len; j++) {
            const u32 id = bias[2 * (p.bias_start + j)];
            if (id < (u32)V) w[id] += __uint_as_float(bias[2 * (p.bias_start + j) + 1]);
        }
    }
    __syncthreads();
    const u32* seen_ids = ids + p.ids_start;
    if (p.repetition_penalty != 1.0f) {
        const u32 n = p.prompt_len + p.output_len;
        for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
            const u32 id = seen_ids[j];
            bool first = id < (u32)V;
            for (u32 k = 0; k < j && first; k++) first = seen_ids[k] != id;
            if (first) w[id] = w[id] > 0.0f ? w[id] / p.repetition_penalty : w[id] * p.repetition_penalty;
        }
        __syncthreads();
    }
    if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
        const u32* out_ids = seen_ids + p.prompt_len;
        for (u32 j = threadIdx.x; j < p.output_len; j += blockDim.x) {
            const u32 id = out_ids[j];
            bool first = id < (u32)V;
            for (u32 k = 0; k < j && first; k++) first = out_ids[k] != id;
            if (!first) continue;
            u32 count = 0;
            for (u32 k = j; k < p.output_len; k++) count += out_ids[k] == id;
            w[id] -= p.frequency_penalty * (float)count;
            w[id] -= p.presence_penalty;
        }
        __syncthreads();
    }
    if (p.greedy) {
        const u32 tok = argmax_row(w, V, fscratch, uscratch);
        if (threadIdx.x == 0) emit_token(out_tokens, keys, r, tok);
        return;
    }

    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = w[i] / p.temperature;
        w[i] = v;
        if (v > mx) mx = v;  // NaN never compares greater
    }
    mx = block_max(mx, fscratch);
    if (!isfinite(mx)) {
        const u32 tok = argmax_row(w, V, fscratch, uscratch);
        if (threadIdx.x == 0) emit_token(out_tokens, keys, r, tok);
        return;
    }
    const float floor_logit = p.min_p > 0.0f ? mx + logf(p.min_p) : -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) kept[i] = !isnan(w[i]);
    __syncthreads();

    if (p.top_k > 0 && p.top_k < (u32)V) {
        // Largest key T with count(key >= T) >= k.
        u32 lo = 0, hi = 0xffffffffu;
        while (lo < hi) {
            const u32 mid = upper_mid(lo, hi);
            u32 c = 0;
            for (int i = threadIdx.x; i < V; i += blockDim.x) c += kept[i] && order_key(w[i]) >= mid;
            if (block_sum_u32(c, uscratch) >= p.top_k) lo = mid; else hi = mid - 1;
        }
        u32 gt = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) gt += kept[i] && order_key(w[i]) > lo;
        gt = block_sum_u32(gt, uscratch);
        const u32 cut = nth_tie(w, kept, V, lo, p.top_k - gt, uscratch, &shared_u32);
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const u32 k = order_key(w[i]);
            kept[i] = kept[i] && (k > lo || (k == lo && (u32)i <= cut));
        }
        __syncthreads();
    }
    if (p.top_p < 1.0f) {
        double total = 0.0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) total += kept[i] ? (double)expf(w[i] - mx) : 0.0;
        const double needed = (double)p.top_p * block_sum_f64(total, dscratch);
        // Largest key T with mass(key >= T) >= needed.
        u32 lo = 0, hi = 0xffffffffu;
        while (lo < hi) {
            const u32 mid = upper_mid(lo, hi);
            double s = 0.0;
            for (int i = threadIdx.x; i < V; i += blockDim.x)
                if (kept[i] && order_key(w[i]) >= mid) s += (double)expf(w[i] - mx);
            if (block_sum_f64(s, dscratch) >= needed) lo = mid; else hi = mid - 1;
        }
        double above = 0.0;
        float at_value = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            if (!kept[i]) continue;
            const u32 k = order_key(w[i]);
            if (k > lo) above += (double)expf(w[i] - mx);
            if (k == lo) at_value = w[i];
        }
        above = block_sum_f64(above, dscratch);
        at_value = block_max(at_value == 0.0f ? -INFINITY : at_value, fscratch);
        if (!isfinite(at_value)) at_value = 0.0f;  // the threshold key is the value 0 itself
        // Ties at the threshold join in id order until the mass reaches `needed` (at least one token).
        const double each = (double)expf(at_value - mx);
        u32 need = 1;
        while (above + need * each < needed && need < (u32)V) need++;
        const u32 cut = nth_tie(w, kept, V, lo, need, uscratch, &shared_u32);
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const u32 k = order_key(w[i]);
            kept[i] = kept[i] && (k > lo || (k == lo && (u32)i <= cut));
        }
        __syncthreads();
    }

    // Inverse CDF in id order over kept tokens at or above the min-p floor.
    const int per = (V + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(V, lo + per);
    double mass = 0.0;
    int last_positive = -1;
    for (int i = lo; i < hi; i++) {
        if (kept[i] && w[i] >= floor_logit) {
            const float e = expf(w[i] - mx);
            mass += (double)e;
            if (e > 0.0f) last_positive = i;
        }
    }
    double total;
    const double before = block_exclusive_scan<double>(mass, dscratch, &total);
    const double u = __hiloint2double((int)p.u_hi, (int)p.u_lo);
    const double target = u * total;
    if (threadIdx.x == 0) shared_u32 = 0xffffffffu;
    __syncthreads();
    if (mass > 0.0 && before <= target && before + mass > target) {
        double cumulative = before;
        for (int i = lo; i < hi; i++) {
            if (kept[i] && w[i] >= floor_logit) {
                const float e = expf(w[i] - mx);
                cumulative += (double)e;
                if (e > 0.0f && cumulative > target) {
                    atomicMin(&shared_u32, (u32)i);
                    break;
                }
            }
        }
    }
    // Rounding when u is within an ulp of 1: take the last positive token.
    __syncthreads();
    int lp = last_positive;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lp = max(lp, __shfl_xor_sync(0xffffffffu, lp, o));
    if ((threadIdx.x & 31) == 0) uscratch[threadIdx.x >> 5] = (u32)(lp + 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 last = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) last = max(last, uscratch[i]);
        emit_token(out_tokens, keys, r, shared_u32 != 0xffffffffu ? shared_u32 : (last > 0 ? last - 1 : 0));
    }
}
