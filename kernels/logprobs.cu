// Logprobs on the device, following rust/core/src/sampling.rs `token_logprob`: for each scored logits row, its
// log-sum-exp (the max, then exp(l - max) in f32 summed in f64, the log taken in f64), the chosen token's logit, and
// the n largest logits (NaN skipped, ties to the lower id). The host subtracts the log-sum-exp
// (cuda/sampler.rs), so a row comes back as a few words instead of a whole vocabulary of logits.
#include "common.cuh"

#define LOGPROB_THREADS 1024
// request.rs MAX_LOGPROBS: the most alternatives a row may ask for.
#define LOGPROB_MAX_TOP 20
// Output words per scored row: log-sum-exp, the token's logit, LOGPROB_MAX_TOP ids, their logits.
#define LOGPROB_WORDS (2 + 2 * LOGPROB_MAX_TOP)
// The id that ends a row's alternatives early (a row with fewer numbers than it asked for).
#define LOGPROB_NO_ID 0xffffffffu

// Order-preserving key of (logit, id): a larger logit ranks higher, an equal one with a lower id ranks higher; 0
// (below every number's key) for NaN. -0.0 ranks as +0.0, since the host compares the values.
__device__ __forceinline__ unsigned long long rank_key(float v, u32 id) {
    if (isnan(v)) return 0ull;
    const u32 b = __float_as_uint(v == 0.0f ? 0.0f : v);
    const u32 ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (0xffffffffu - id);
}

// The best key of the row below `below` (0 when there is none).
__device__ unsigned long long best_key_below(const bf16* row, int V, unsigned long long below, unsigned long long* scratch) {
    unsigned long long best = 0ull;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const unsigned long long key = rank_key(__bfloat162float(row[i]), (u32)i);
        if (key < below) best = max(best, key);
    }
    return block_max_u64(best, scratch);
}

// grid: scored rows; block: LOGPROB_THREADS. logits: bf16 rows of V values; for score s, row_of[s] is its logits
// row, token[s] its token (< V) and top[s] the alternatives it asks for. out: LOGPROB_WORDS words per score (f32
// as bits): log-sum-exp, the token's logit, top[s] ids best first, then their logits at word 2 + LOGPROB_MAX_TOP;
// an id of LOGPROB_NO_ID ends the list early.
extern "C" __global__ void __launch_bounds__(LOGPROB_THREADS)
    score_rows(const bf16* __restrict__ logits, int V, const u32* __restrict__ row_of, const u32* __restrict__ token,
               const u32* __restrict__ top, u32* __restrict__ out) {
    kernel_begin();
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    __shared__ unsigned long long kscratch[32];
    const int s = blockIdx.x;
    const bf16* row = logits + (size_t)row_of[s] * V;

    // One pass for the max and the best key, a second for the sum.
    float mx = -INFINITY;
    unsigned long long best = 0ull;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = __bfloat162float(row[i]);
        mx = fmaxf(mx, v);
        best = max(best, rank_key(v, (u32)i));
    }
    mx = block_max(mx, fscratch);
    best = block_max_u64(best, kscratch);
    double sum = 0.0;
    if (isfinite(mx))
        for (int i = threadIdx.x; i < V; i += blockDim.x) sum += (double)expf(__bfloat162float(row[i]) - mx);
    sum = block_sum_f64(sum, dscratch);
    const float lse = isfinite(mx) ? mx + (float)log(sum) : mx;

    u32* o = out + (size_t)s * LOGPROB_WORDS;
    if (threadIdx.x == 0) {
        o[0] = __float_as_uint(lse);
        o[1] = __float_as_uint(__bfloat162float(row[token[s]]));
    }
    const u32 n = min(top[s], (u32)LOGPROB_MAX_TOP);
    for (u32 k = 0; k < n; k++) {
        if (k > 0) best = best_key_below(row, V, best, kscratch);
        if (threadIdx.x == 0) {
            const u32 id = best ? 0xffffffffu - (u32)best : LOGPROB_NO_ID;
            o[2 + k] = id;
            o[2 + LOGPROB_MAX_TOP + k] = best ? __float_as_uint(__bfloat162float(row[id])) : 0u;
        }
        if (!best) break;  // every thread holds the same best
    }
}
