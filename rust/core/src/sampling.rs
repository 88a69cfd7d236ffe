//! Logits processing and sampling with per-row parameters, so any request can join any batch.
//!
//! Order (as vLLM and Hugging Face): logit bias; repetition penalty over prompt + output; presence and
//! frequency penalties over output only; then either greedy argmax, or temperature -> top-k -> top-p ->
//! min-p -> one random draw. The draw is a pure function of (seed, absolute position), so a seeded
//! sequence's tokens never depend on its batch neighbours or its row. Logprobs describe the raw model
//! distribution (log_softmax before any processing), which is vLLM V1's default.

use rayon::prelude::*;

use crate::request::{SamplingParams, TokenLogprob};

/// Everything one row needs to be sampled on its own.
#[derive(Debug, Clone, Copy)]
pub struct RowContext<'a> {
    pub params: &'a SamplingParams,
    pub prompt_ids: &'a [u32],
    pub output_ids: &'a [u32],
    /// Absolute position of the token being sampled: prompt_len + output_len.
    pub position: u64,
    /// Resolved once per request (see `resolve_seed`).
    pub seed: u64,
    /// Token ids that may not be drawn now (EOS and stop_token_ids before `min_tokens`); empty for most rows.
    pub banned: &'a [u32],
}

impl RowContext<'_> {
    /// Whether [`sample_row`] returns the argmax of the raw logits: greedy, and nothing in [`adjust_logits`]
    /// changes them. A GPU backend can then pick the token inside its forward.
    pub(crate) fn is_plain_argmax(&self) -> bool {
        let p = self.params;
        is_greedy(p)
            && self.banned.is_empty()
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
    }
}

/// A logits row kept to score a prompt token (vLLM's prompt_logprobs), not sampled: the token that follows its
/// position and how many top alternatives to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreRow {
    pub token_id: u32,
    pub top: usize,
}

/// Scores `scores.len()` rows of width `vocab` laid out back to back, in parallel: each row's token logprob and
/// its top alternatives, from the raw logits as a sampled token's logprobs.
pub fn score_rows(logits: &[f32], vocab: usize, scores: &[ScoreRow]) -> Vec<TokenLogprob> {
    assert_eq!(logits.len(), vocab * scores.len(), "score_rows: logits must hold one row per score");
    logits.par_chunks(vocab).zip(scores.par_iter()).map(|(row, s)| token_logprob(row, s.token_id, s.top)).collect()
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
    pub logprob: Option<TokenLogprob>,
}

/// Below this temperature logits / T degenerates (overflow, ties at +inf); vLLM treats it as greedy too.
const MIN_TEMPERATURE: f32 = 1e-5;

/// Top-k and top-p boundaries are first located in a histogram of logits below the max, 1/16 logit per
/// bucket; only the tokens inside the boundary bucket then need ranking. That keeps a row O(vocab)
/// whatever the shape of the distribution, instead of sorting 150k logits. 1024 buckets span 64
/// logits; anything lower (weight < e^-64) shares the last bucket.
const BUCKETS: usize = 1024;
const BUCKETS_PER_LOGIT: f32 = 16.0;

/// (token id, logit).
type Candidate = (u32, f32);

/// The request's own seed, or one derived from caller-supplied entropy (drawn once at admission).
pub fn resolve_seed(params: &SamplingParams, fallback_entropy: u64) -> u64 {
    // Mixing spreads low-entropy inputs such as counters or timestamps over the whole seed space.
    params.seed.unwrap_or_else(|| mix64(fallback_entropy))
}

/// Uniform in [0, 1) from (seed, position) alone: a counter-based generator needs no state to carry
/// between steps, and the GPU sampler can reproduce it bit for bit.
pub fn seeded_uniform(seed: u64, position: u64) -> f64 {
    const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    let bits = mix64(mix64(seed).wrapping_add(position.wrapping_mul(GOLDEN_GAMMA)));
    // The top 53 bits fill an f64 mantissa exactly, so the result is never 1.0.
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The splitmix64 finaliser: a bijection with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Samples one row. `logits` is used as scratch space: its contents afterwards are unspecified.
pub fn sample_row(logits: &mut [f32], ctx: &RowContext) -> Sampled {
    // Processing rewrites the row in place, and logprobs must describe the raw model output.
    let raw = ctx.params.logprobs.map(|n| (n, logits.to_vec()));
    adjust_logits(logits, ctx);
    let token_id = if is_greedy(ctx.params) {
        argmax(logits)
    } else {
        draw(logits, ctx.params, seeded_uniform(ctx.seed, ctx.position))
    };
    let logprob = raw.map(|(n, raw)| token_logprob(&raw, token_id, n));
    Sampled { token_id, logprob }
}

/// Samples `ctxs.len()` rows of width `vocab` laid out back to back; rows run in parallel.
pub fn sample_rows(logits: &mut [f32], vocab: usize, ctxs: &[RowContext]) -> Vec<Sampled> {
    assert!(vocab > 0, "sample_rows: vocab must be positive");
    assert_eq!(
        logits.len(),
        vocab * ctxs.len(),
        "sample_rows: logits must hold one row per context"
    );
    if ctxs.len() == 1 {
        return vec![sample_row(logits, &ctxs[0])];
    }
    logits
        .par_chunks_mut(vocab)
        .zip(ctxs.par_iter())
        .map(|(row, ctx)| sample_row(row, ctx))
        .collect()
}

/// Logit bias, repetition penalty, presence and frequency penalties: every step shared by greedy and
/// random sampling. Token ids outside the row are ignored (the vocabulary is checked at admission).
pub fn adjust_logits(logits: &mut [f32], ctx: &RowContext) {
    let p = ctx.params;
    apply_logit_bias(logits, &p.logit_bias);
    for &id in ctx.banned {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    if p.repetition_penalty != 1.0 {
        apply_repetition_penalty(logits, ctx.prompt_ids, ctx.output_ids, p.repetition_penalty);
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        apply_presence_frequency(
            logits,
            ctx.output_ids,
            p.presence_penalty,
            p.frequency_penalty,
        );
    }
}

fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
}

/// Hugging Face semantics: positive logits are divided, negative ones multiplied, so the penalty always
/// makes a seen token less likely; each distinct token is penalised once however often it occurred.
fn apply_repetition_penalty(logits: &mut [f32], prompt: &[u32], output: &[u32], penalty: f32) {
    // A bitset (vocab / 8 bytes) dedups in O(tokens); sorting a long prompt every step would cost more.
    let mut seen = vec![0u64; logits.len().div_ceil(64)];
    for &id in prompt.iter().chain(output) {
        let i = id as usize;
        if i >= logits.len() {
            continue;
        }
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        if seen[word] & bit != 0 {
            continue;
        }
        seen[word] |= bit;
        let l = &mut logits[i];
        *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
    }
}

/// OpenAI semantics over generated tokens only: logit -= frequency * count + presence * (count > 0).
fn apply_presence_frequency(logits: &mut [f32], output: &[u32], presence: f32, frequency: f32) {
    let mut ids = output.to_vec();
    ids.sort_unstable();
    for run in ids.chunk_by(|a, b| a == b) {
        if let Some(l) = logits.get_mut(run[0] as usize) {
            // Two subtractions in vLLM's order, so results match it bit for bit.
            *l -= frequency * run.len() as f32;
            *l -= presence;
        }
    }
}

/// Greedy rows take the argmax (temperature 0, top_k 1, or a temperature too small to divide by).
pub(crate) fn is_greedy(params: &SamplingParams) -> bool {
    params.is_greedy() || params.temperature < MIN_TEMPERATURE
}

/// The first (lowest-id) maximum; NaN is never selected, and a row with no number at all gives 0.
fn argmax(logits: &[f32]) -> u32 {
    let max = max_logit(logits);
    logits.iter().position(|&l| l == max).unwrap_or(0) as u32
}

/// Largest non-NaN logit (-inf if none). Eight independent lanes let the compiler vectorise what a
/// single running maximum would serialise, and this runs over the whole vocabulary for every row.
fn max_logit(logits: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &l) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(l);
        }
    }
    lanes
        .iter()
        .chain(rest)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Temperature, top-k, top-p, min-p, then inverse-CDF with the uniform `u`.
fn draw(logits: &mut [f32], params: &SamplingParams, u: f64) -> u32 {
    for l in logits.iter_mut() {
        *l /= params.temperature;
    }
    let max = max_logit(logits);
    if !max.is_finite() {
        // Nothing to normalise against (all tokens banned, or the model produced +inf).
        return argmax(logits);
    }
    // min-p keeps p >= min_p * p_max, a logit floor. Renormalising after top-k / top-p scales every
    // probability alike, so this floor is the same whichever truncations ran before it.
    let min_p_floor = if params.min_p > 0.0 {
        max + params.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let top_k = (params.top_k > 0 && params.top_k < logits.len()).then_some(params.top_k);
    if top_k.is_none() && params.top_p >= 1.0 {
        return draw_over_vocab(logits, max, min_p_floor, u);
    }

    // Every stage keeps the top-ranked token, so `kept` is never empty.
    let mut kept = match (top_k, params.top_p < 1.0) {
        (Some(k), false) => top_k_set(all_tokens(logits), max, k),
        (Some(k), true) => nucleus_set(
            top_k_set(all_tokens(logits), max, k).into_iter(),
            max,
            params.top_p,
        ),
        (None, _) => nucleus_set(all_tokens(logits), max, params.top_p),
    };
    kept.retain(|c| c.1 >= min_p_floor);
    draw_from(&kept, max, u)
}

/// The untruncated path walks the vocabulary in id order: any fixed order is a valid inverse CDF, and
/// this one needs no candidate list at all.
fn draw_over_vocab(logits: &mut [f32], max: f32, floor: f32, u: f64) -> u32 {
    // Store the unnormalised probabilities in place so the walk does not compute exp twice.
    let mut total = 0.0f64;
    for l in logits.iter_mut() {
        *l = if *l >= floor { (*l - max).exp() } else { 0.0 };
        total += *l as f64;
    }
    let target = u * total;
    let mut cumulative = 0.0f64;
    let mut last_positive = 0;
    for (i, &p) in logits.iter().enumerate() {
        if p > 0.0 {
            cumulative += p as f64;
            last_positive = i;
            if cumulative > target {
                return i as u32;
            }
        }
    }
    // Only reached through rounding when u is within an ulp of 1.
    last_positive as u32
}

/// Every non-NaN token of a row, in id order.
fn all_tokens(logits: &[f32]) -> impl Iterator<Item = Candidate> + Clone + '_ {
    logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .filter(|c| !c.1.is_nan())
}

/// The k best tokens (ties: lower id), in no particular order: the draw does not need them sorted.
fn top_k_set(
    tokens: impl Iterator<Item = Candidate> + Clone,
    max: f32,
    k: usize,
) -> Vec<Candidate> {
    let counts = histogram(tokens.clone(), max, |_| 1.0);
    let (mut kept, mut boundary) = split_at_bucket(tokens, max, boundary_bucket(&counts, k as f64));
    let missing = k.saturating_sub(kept.len());
    if boundary.len() > missing {
        // Selection, not a sort: with heavy ties the boundary bucket can be large.
        if missing > 0 {
            boundary.select_nth_unstable_by(missing - 1, by_rank);
        }
        boundary.truncate(missing);
    }
    kept.extend(boundary);
    kept
}

/// The shortest top-ranked set whose mass reaches top_p of the total (at least one token), in no
/// particular order. Only the bucket where the mass crosses top_p is sorted.
fn nucleus_set(
    tokens: impl Iterator<Item = Candidate> + Clone,
    max: f32,
    top_p: f32,
) -> Vec<Candidate> {
    let masses = histogram(tokens.clone(), max, |l| weight(l, max));
    let needed = top_p as f64 * masses.iter().sum::<f64>();
    let boundary_index = boundary_bucket(&masses, needed);
    let mut cumulative: f64 = masses[..boundary_index].iter().sum();
    let (mut kept, mut boundary) = split_at_bucket(tokens, max, boundary_index);
    boundary.sort_unstable_by(by_rank);
    for c in boundary {
        if cumulative >= needed && !kept.is_empty() {
            break;
        }
        cumulative += weight(c.1, max);
        kept.push(c);
    }
    kept
}

/// Per-bucket sums of `value(logit)`.
fn histogram(
    tokens: impl Iterator<Item = Candidate>,
    max: f32,
    value: impl Fn(f32) -> f64,
) -> [f64; BUCKETS] {
    let mut sums = [0.0; BUCKETS];
    for (_, l) in tokens {
        sums[bucket_of(l, max)] += value(l);
    }
    sums
}

/// Buckets count down from the max; `as` saturates, so -inf lands in the last bucket.
fn bucket_of(logit: f32, max: f32) -> usize {
    (((max - logit) * BUCKETS_PER_LOGIT) as usize).min(BUCKETS - 1)
}

/// The first bucket where the running total reaches `needed` (the last one if rounding never gets there).
fn boundary_bucket(per_bucket: &[f64; BUCKETS], needed: f64) -> usize {
    let mut running = 0.0;
    for (b, &v) in per_bucket.iter().enumerate() {
        running += v;
        if running >= needed {
            return b;
        }
    }
    BUCKETS - 1
}

/// Tokens ranked above bucket `boundary` (all kept), and the tokens in it (to be ranked).
fn split_at_bucket(
    tokens: impl Iterator<Item = Candidate>,
    max: f32,
    boundary: usize,
) -> (Vec<Candidate>, Vec<Candidate>) {
    let (mut above, mut at) = (Vec::new(), Vec::new());
    for c in tokens {
        match bucket_of(c.1, max).cmp(&boundary) {
            std::cmp::Ordering::Less => above.push(c),
            std::cmp::Ordering::Equal => at.push(c),
            std::cmp::Ordering::Greater => {}
        }
    }
    (above, at)
}

/// Inverse CDF over the candidates in the order given; any fixed order is as good as a sorted one.
fn draw_from(candidates: &[Candidate], max: f32, u: f64) -> u32 {
    let target = u * mass_of(candidates, max);
    let mut cumulative = 0.0f64;
    let mut last_positive = candidates.first().map_or(0, |c| c.0);
    for &(id, l) in candidates {
        let w = weight(l, max);
        if w > 0.0 {
            cumulative += w;
            last_positive = id;
            if cumulative > target {
                return id;
            }
        }
    }
    // Only reached through rounding when u is within an ulp of 1.
    last_positive
}

/// Unnormalised probability; anchoring at the max keeps exp in range. f32 exp is plenty accurate and
/// several times cheaper than f64 over a whole vocabulary; sums are still accumulated in f64.
fn weight(logit: f32, max: f32) -> f64 {
    (logit - max).exp() as f64
}

fn mass_of(candidates: &[Candidate], max: f32) -> f64 {
    candidates.iter().map(|&(_, l)| weight(l, max)).sum()
}

/// Descending logit, ties to the lower id: the same total order everywhere, so truncation is stable.
fn by_rank(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Chosen token and top-n alternatives, as log_softmax of the raw logits.
pub(crate) fn token_logprob(raw: &[f32], token_id: u32, n: usize) -> TokenLogprob {
    let lse = log_sum_exp(raw);
    let top = top_n(raw, n)
        .into_iter()
        .map(|(id, l)| (id, l - lse))
        .collect();
    TokenLogprob {
        token_id,
        logprob: raw[token_id as usize] - lse,
        top,
    }
}

fn log_sum_exp(x: &[f32]) -> f32 {
    let max = max_logit(x);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = x.iter().map(|&l| weight(l, max)).sum();
    max + sum.ln() as f32
}

/// The n largest entries, best first (ties: lower id). n is at most MAX_LOGPROBS, so inserting into a
/// short sorted list in one pass beats selecting over the whole vocabulary.
fn top_n(x: &[f32], n: usize) -> Vec<Candidate> {
    let mut best: Vec<Candidate> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (i, &l) in x.iter().enumerate() {
        if l.is_nan() || (best.len() == n && l <= best[n - 1].1) {
            continue;
        }
        // Equal logits seen earlier have lower ids and stay ahead.
        let at = best.partition_point(|c| c.1 >= l);
        best.insert(at, (i as u32, l));
        best.truncate(n);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_uniform_is_in_unit_interval_and_balanced() {
        let n = 100_000u64;
        let mut sum = 0.0;
        for pos in 0..n {
            let u = seeded_uniform(7, pos);
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        // The standard error of the mean is ~0.0009; the seeds are fixed, so this cannot flake.
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
        assert_ne!(seeded_uniform(1, 5), seeded_uniform(2, 5));
        assert_ne!(seeded_uniform(1, 5), seeded_uniform(1, 6));
    }

    #[test]
    fn resolve_seed_prefers_the_request_seed() {
        let seeded = SamplingParams {
            seed: Some(42),
            ..SamplingParams::default()
        };
        assert_eq!(resolve_seed(&seeded, 9), 42);
        let unseeded = SamplingParams::default();
        assert_eq!(resolve_seed(&unseeded, 9), resolve_seed(&unseeded, 9));
        assert_ne!(resolve_seed(&unseeded, 9), resolve_seed(&unseeded, 10));
    }

    #[test]
    fn top_n_orders_ties_by_id_and_skips_nan() {
        let x = [1.0, 3.0, f32::NAN, 3.0, 2.0, 5.0];
        assert_eq!(top_n(&x, 3), vec![(5, 5.0), (1, 3.0), (3, 3.0)]);
        assert_eq!(top_n(&x, 0), vec![]);
        assert_eq!(top_n(&x, 10).len(), 5);
    }

    #[test]
    fn top_k_set_matches_a_full_sort() {
        // Spread over 100 logits, so the last (overflow) bucket and ties both occur.
        let mut logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 500) as f32) * -0.2).collect();
        logits[7] = logits[3];
        let max = max_logit(&logits);
        let mut all: Vec<Candidate> = all_tokens(&logits).collect();
        all.sort_unstable_by(by_rank);
        for k in [1, 5, 100, 300, 499, 500] {
            let mut kept = top_k_set(all_tokens(&logits), max, k);
            kept.sort_unstable_by(by_rank);
            assert_eq!(kept, all[..k].to_vec(), "k = {k}");
        }
    }

    #[test]
    fn nucleus_set_cuts_inside_the_boundary_bucket() {
        // One dominant token, a heavy tail 12 below it, and tokens far below that.
        let mut logits = vec![-12.0f32; 10_001];
        logits[0] = 0.0;
        logits.extend([-30.0; 100]);
        let tail = (-12.0f32).exp() as f64;
        let needed = 0.99 * (1.0 + 10_000.0 * tail + 100.0 * (-30.0f32).exp() as f64);
        let tail_kept = ((needed - 1.0) / tail).ceil() as usize;
        let mut kept = nucleus_set(all_tokens(&logits), 0.0, 0.99);
        kept.sort_unstable_by_key(|c| c.0);
        let expected: Vec<Candidate> = all_tokens(&logits).take(1 + tail_kept).collect();
        assert_eq!(kept, expected);
        assert_eq!(nucleus_set(all_tokens(&logits), 0.0, 0.5), vec![(0, 0.0)]);
    }

    #[test]
    fn all_banned_or_nan_rows_do_not_panic() {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let ctx = RowContext {
            params: &params,
            prompt_ids: &[],
            output_ids: &[],
            position: 0,
            seed: 1,
            banned: &[],
        };
        let mut banned = vec![f32::NEG_INFINITY; 8];
        assert_eq!(sample_row(&mut banned, &ctx).token_id, 0);
        let mut with_nan = vec![f32::NAN, 1.0, f32::NAN, 0.5];
        let id = sample_row(&mut with_nan, &ctx).token_id;
        assert!(id == 1 || id == 3);
    }
}
