//! CPU paged KV cache, RoPE (+ q/k norm) with KV write, and causal attention over a ragged batch.

use super::batch::BatchPlan;
use super::cpu::{internal, CpuTensor};
use super::cpu_kernels::{exp, for_each_row, rms_norm_in_place, rope_angles, rope_head, sum};
use super::cpu_attention_kernels::{portable, x86, Span};
use super::cpu_matmul::Kernels;
use super::{AttentionShape, KvCacheShape};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Largest head supported; RoPE angles live in a stack buffer of half this size.
const MAX_HEAD_DIM: usize = 512;

/// Below this many multiply-adds, attention runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 14;

/// Per layer, K and V in blocks of `block_size` slots; within a block each KV head owns one contiguous
/// `head_dim x block_size` region, which is what one query head reads, front to back:
/// - K transposed, `[head_dim][block_size]`: a position's key is a column, so the scores of a row of
///   positions are plain vector FMAs (no horizontal sum per position);
/// - V as rows, `[block_size][head_dim]`: a position's value is a row, summed with its softmax weight.
#[derive(Debug)]
pub struct CpuKvCache {
    shape: KvCacheShape,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

/// `n` zeros from the allocator's zeroed memory, or None when it cannot give them. Unlike writing the zeros,
/// this leaves a large buffer's pages to the OS until first use: a cache sized for many tokens costs memory
/// (and load time) only as far as it fills.
fn zeroed_floats(n: usize) -> Option<Vec<f32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n).ok()?;
    // SAFETY: the layout is non-empty; the pointer comes from the global allocator with exactly the layout a
    // Vec<f32> of capacity n uses, and all-zero bits are the f32 0.0, so all n elements are initialized.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<f32>();
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, n, n))
    }
}

impl CpuKvCache {
    pub(super) fn new(shape: KvCacheShape) -> Result<Self> {
        let per_layer = shape
            .num_slots()
            .checked_mul(shape.kv_dim())
            .ok_or_else(|| Error::Device(format!("KV cache of {shape:?} overflows the address space")))?;
        let layer_buffer = || -> Result<Vec<f32>> {
            zeroed_floats(per_layer).ok_or_else(|| {
                let gib = (2 * shape.num_layers * per_layer * 4) as f64 / (1u64 << 30) as f64;
                Error::Device(format!("cannot allocate a {gib:.2} GiB KV cache; ask for fewer blocks"))
            })
        };
        let mut keys = Vec::with_capacity(shape.num_layers);
        let mut values = Vec::with_capacity(shape.num_layers);
        for _ in 0..shape.num_layers {
            keys.push(layer_buffer()?);
            values.push(layer_buffer()?);
        }
        Ok(Self { shape, keys, values })
    }

    pub fn shape(&self) -> KvCacheShape {
        self.shape
    }

    fn check_compatible(&self, shape: &AttentionShape, plan: &BatchPlan, layer: usize) -> Result<()> {
        if layer >= self.shape.num_layers {
            return internal(format!("layer {layer} of a {}-layer KV cache", self.shape.num_layers));
        }
        if (shape.num_kv_heads, shape.head_dim) != (self.shape.num_kv_heads, self.shape.head_dim) {
            return internal(format!("attention shape {shape:?} does not match KV cache {:?}", self.shape));
        }
        if plan.block_size != self.shape.block_size {
            return internal(format!(
                "batch planned for block size {} but the KV cache uses {}",
                plan.block_size, self.shape.block_size
            ));
        }
        // The SIMD attention reads through raw pointers: every slot it can reach must be inside the cache.
        if plan.block_tables.iter().any(|&b| b as usize >= self.shape.num_blocks) {
            return internal("batch reads a block outside the KV cache".to_string());
        }
        if plan.slots.iter().any(|&s| s as usize >= self.shape.num_slots()) {
            return internal("batch writes a slot outside the KV cache".to_string());
        }
        Ok(())
    }
}

pub fn rope_and_write_kv(
    qkv: &mut CpuTensor,
    qk_norm: Option<(&[f32], &[f32])>,
    shape: &AttentionShape,
    plan: &BatchPlan,
    cache: &mut CpuKvCache,
    layer: usize,
) -> Result<()> {
    check_qkv(qkv, shape, plan)?;
    cache.check_compatible(shape, plan, layer)?;
    if let Some((q, k)) = qk_norm {
        if q.len() != shape.head_dim || k.len() != shape.head_dim {
            return internal(format!("q/k norm weights of {} and {} values for head_dim {}", q.len(), k.len(), shape.head_dim));
        }
    }
    let (head_dim, half) = (shape.head_dim, shape.head_dim / 2);
    let (q_dim, kv_dim, width) = (shape.q_dim(), shape.kv_dim(), shape.qkv_width());
    let inv_freq = shape.rope.inverse_frequencies(head_dim);
    for_each_row(qkv.as_mut_slice(), width, |t, row| {
        let (mut cos, mut sin) = ([0f32; MAX_HEAD_DIM / 2], [0f32; MAX_HEAD_DIM / 2]);
        rope_angles(plan.positions[t], &inv_freq, &mut cos[..half], &mut sin[..half]);
        for (h, head) in row[..q_dim + kv_dim].chunks_exact_mut(head_dim).enumerate() {
            if let Some((q_norm, k_norm)) = qk_norm {
                rms_norm_in_place(head, if h < shape.num_heads { q_norm } else { k_norm }, shape.qk_norm_eps);
            }
            rope_head(head, &cos[..half], &sin[..half]);
        }
    });
    // Scattered writes of one token's K and V per head: cheap, so done serially rather than proving
    // disjointness.
    let (keys, values) = (&mut cache.keys[layer], &mut cache.values[layer]);
    let block_size = plan.block_size;
    for (t, &slot) in plan.slots.iter().enumerate() {
        let row = qkv.row(t);
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        for h in 0..shape.num_kv_heads {
            let region = (block * shape.num_kv_heads + h) * head_dim * block_size;
            let key = &row[q_dim + h * head_dim..][..head_dim];
            for (d, &k) in key.iter().enumerate() {
                keys[region + d * block_size + offset] = k;
            }
            let value = &row[q_dim + kv_dim + h * head_dim..][..head_dim];
            values[region + offset * head_dim..][..head_dim].copy_from_slice(value);
        }
    }
    Ok(())
}

pub fn paged_attention(
    qkv: &CpuTensor,
    shape: &AttentionShape,
    plan: &BatchPlan,
    cache: &CpuKvCache,
    layer: usize,
    out: &mut CpuTensor,
) -> Result<()> {
    check_qkv(qkv, shape, plan)?;
    cache.check_compatible(shape, plan, layer)?;
    let head_dim = shape.head_dim;
    out.reshape(plan.num_tokens(), shape.q_dim());
    let cache_layer = CacheLayer {
        keys: &cache.keys[layer],
        values: &cache.values[layer],
        kv_heads: shape.num_kv_heads,
        head_dim,
        block_size: plan.block_size,
    };
    let kernels = Kernels::detect();
    // One unit = one (token, query head): enough units to keep every core busy even for a single decode
    // token, and each unit owns exactly one head_dim slice of the output.
    let attend = |scratch: &mut Scratch, (unit, o): (usize, &mut [f32])| {
        let (t, h) = (unit / shape.num_heads, unit % shape.num_heads);
        let seq = &plan.seqs[plan.token_seq[t] as usize];
        let query = &qkv.row(t)[h * head_dim..(h + 1) * head_dim];
        let head = Head { kv_head: h / shape.group_size(), scale: shape.softmax_scale(), kernels };
        let context = plan.positions[t] as usize + 1;
        attend_one(query, plan.block_table(seq), context, &cache_layer, &head, scratch, o);
    };
    let work: usize = plan.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * shape.q_dim();
    let units = out.as_mut_slice().chunks_mut(head_dim);
    if work >= PARALLEL_WORK {
        // A few jobs per thread balance uneven contexts without paying rayon's per-split cost per unit.
        let min_units = (plan.num_tokens() * shape.num_heads / (4 * rayon::current_num_threads())).max(1);
        let units = out.as_mut_slice().par_chunks_mut(head_dim).enumerate().with_min_len(min_units);
        units.for_each_init(Scratch::default, attend);
    } else {
        let mut scratch = Scratch::default();
        units.enumerate().for_each(|unit| attend(&mut scratch, unit));
    }
    Ok(())
}

/// One layer of the cache, in the layout of [`CpuKvCache`].
struct CacheLayer<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

impl CacheLayer<'_> {
    /// Offset of (block, KV head)'s region, and the region's length.
    fn region(&self, block: u32, kv_head: usize) -> (usize, usize) {
        let len = self.head_dim * self.block_size;
        ((block as usize * self.kv_heads + kv_head) * len, len)
    }
}

struct Head {
    kv_head: usize,
    scale: f32,
    /// SIMD kernels (chosen once per call) or the portable loops.
    kernels: Kernels,
}

/// Per-thread buffers of [`attend_one`], reused across heads.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    spans: Vec<Span>,
}

/// Softmax attention of one query head over cache positions `0..context` of its sequence.
fn attend_one(
    query: &[f32],
    block_table: &[u32],
    context: usize,
    cache: &CacheLayer,
    head: &Head,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (head_dim, block_size) = (cache.head_dim, cache.block_size);
    let Scratch { scores, spans } = scratch;
    spans.clear();
    for (b, &block) in block_table.iter().enumerate() {
        let first = b * block_size;
        if first >= context {
            break;
        }
        let (at, _) = cache.region(block, head.kv_head);
        spans.push(Span { at, first, len: block_size.min(context - first) });
    }
    scores.resize(context, 0.0);
    match head.kernels {
        Kernels::Portable => {
            for span in spans.iter() {
                let keys = &cache.keys[span.at..][..head_dim * block_size];
                portable::score_block(query, keys, block_size, head.scale, &mut scores[span.first..][..span.len]);
            }
        }
        // SAFETY: the CPU runs the chosen kernels; every span's region lies inside the layer (the block
        // table was checked against the cache).
        kernels => unsafe { x86::scores(kernels == Kernels::Avx512, query, cache.keys, spans, block_size, head.scale, scores) },
    }
    softmax_in_place(scores);
    out.fill(0.0);
    for span in spans.iter() {
        let values = &cache.values[span.at..][..head_dim * block_size];
        let weights = &scores[span.first..][..span.len];
        match head.kernels {
            Kernels::Portable => portable::weighted_block(weights, values, head_dim, out),
            // SAFETY: as above; the kernel reads `weights.len()` rows of `values`.
            kernels => unsafe { x86::weighted_block(kernels == Kernels::Avx512, weights, values, head_dim, out) },
        }
    }
}

/// Normalized probabilities, as torch's softmax computes them (max-subtracted exponentials over their sum).
/// Each pass is a plain loop over the row, so it vectorizes.
fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    scores.iter_mut().for_each(|s| *s = exp(*s - max));
    let inv_sum = 1.0 / sum(scores);
    scores.iter_mut().for_each(|s| *s *= inv_sum);
}

fn check_qkv(qkv: &CpuTensor, shape: &AttentionShape, plan: &BatchPlan) -> Result<()> {
    if qkv.cols() != shape.qkv_width() || qkv.rows() != plan.num_tokens() {
        return internal(format!(
            "qkv is [{}, {}] but the batch has {} tokens of width {}",
            qkv.rows(),
            qkv.cols(),
            plan.num_tokens(),
            shape.qkv_width()
        ));
    }
    let odd_head = !shape.head_dim.is_multiple_of(2);
    if shape.head_dim > MAX_HEAD_DIM || odd_head || !shape.num_heads.is_multiple_of(shape.num_kv_heads) {
        return internal(format!("unsupported attention shape {shape:?} (head_dim must be even and <= {MAX_HEAD_DIM})"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_floats_are_zeros_or_none() {
        assert_eq!(zeroed_floats(0), Some(Vec::new()));
        let zeros = zeroed_floats(1 << 20).unwrap();
        assert!(zeros.len() == 1 << 20 && zeros.iter().all(|&x| x == 0.0 && x.is_sign_positive()));
        assert_eq!(zeroed_floats(usize::MAX / 2), None, "an impossible size is refused, not a panic");
    }

    /// A layer of `num_blocks` blocks filled with noise, and the same values as plain per-slot rows
    /// `[slot][kv_head][head_dim]` for the naive reference.
    struct Layer {
        keys: Vec<f32>,
        values: Vec<f32>,
        key_rows: Vec<f32>,
        value_rows: Vec<f32>,
    }

    fn layer(kv_heads: usize, head_dim: usize, block_size: usize, num_blocks: usize) -> Layer {
        let slots = num_blocks * block_size;
        let noise = |seed: usize, i: usize| (((i * 7919 + seed) % 1009) as f32 / 1009.0 - 0.5) * 2.0;
        let key_rows: Vec<f32> = (0..slots * kv_heads * head_dim).map(|i| noise(1, i)).collect();
        let value_rows: Vec<f32> = (0..slots * kv_heads * head_dim).map(|i| noise(2, i)).collect();
        let (mut keys, mut values) = (vec![0.0; key_rows.len()], vec![0.0; value_rows.len()]);
        for slot in 0..slots {
            let (block, offset) = (slot / block_size, slot % block_size);
            for h in 0..kv_heads {
                let region = (block * kv_heads + h) * head_dim * block_size;
                for d in 0..head_dim {
                    let row_at = (slot * kv_heads + h) * head_dim + d;
                    keys[region + d * block_size + offset] = key_rows[row_at];
                    values[region + offset * head_dim + d] = value_rows[row_at];
                }
            }
        }
        Layer { keys, values, key_rows, value_rows }
    }

    /// Softmax attention in f64 over per-slot rows.
    #[allow(clippy::too_many_arguments)]
    fn naive(l: &Layer, query: &[f32], table: &[u32], context: usize, kv_heads: usize, kv_head: usize, block_size: usize, scale: f32) -> Vec<f32> {
        let head_dim = query.len();
        let slot = |p: usize| table[p / block_size] as usize * block_size + p % block_size;
        let row = |p: usize| (slot(p) * kv_heads + kv_head) * head_dim;
        let scores: Vec<f64> = (0..context)
            .map(|p| (0..head_dim).map(|d| query[d] as f64 * l.key_rows[row(p) + d] as f64).sum::<f64>() * scale as f64)
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        (0..head_dim)
            .map(|d| (0..context).map(|p| weights[p] / total * l.value_rows[row(p) + d] as f64).sum::<f64>() as f32)
            .collect()
    }

    /// Every kernel set against the naive reference, for head sizes that exercise every column group and
    /// block sizes below, at and above a vector, with partial last blocks.
    #[test]
    fn attention_kernels_match_naive() {
        for kernels in Kernels::supported() {
            for head_dim in [8, 16, 24, 64, 128, 136, 6] {
                for block_size in [1, 4, 5, 16, 32] {
                    let (kv_heads, num_blocks) = (2, 80 / block_size + 2);
                    let l = layer(kv_heads, head_dim, block_size, num_blocks);
                    let cache = CacheLayer { keys: &l.keys, values: &l.values, kv_heads, head_dim, block_size };
                    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
                    let query: Vec<f32> = (0..head_dim).map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0).collect();
                    for context in [1, 3, 17, 70] {
                        let head = Head { kv_head: 1, scale: 0.3, kernels };
                        let mut out = vec![f32::NAN; head_dim];
                        attend_one(&query, &table, context, &cache, &head, &mut Scratch::default(), &mut out);
                        let want = naive(&l, &query, &table, context, kv_heads, 1, block_size, 0.3);
                        for (a, b) in out.iter().zip(&want) {
                            let what = format!("{kernels:?} head_dim {head_dim} block {block_size} context {context}");
                            assert!((a - b).abs() <= 1e-5, "{what}: {a} vs {b}");
                        }
                    }
                }
            }
        }
    }

    /// Timing, not a check: `cargo test --release -p stepllm-core --lib attend_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing"]
    fn attend_speed() {
        let (head_dim, kv_heads, block_size, num_blocks) = (64, 3, 16, 64);
        let l = layer(kv_heads, head_dim, block_size, num_blocks);
        let cache = CacheLayer { keys: &l.keys, values: &l.values, kv_heads, head_dim, block_size };
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let query: Vec<f32> = (0..head_dim).map(|i| i as f32 * 0.01).collect();
        for kernels in Kernels::supported() {
            let head = Head { kv_head: 1, scale: 0.125, kernels };
            let (mut out, mut scratch, mut best) = (vec![0.0; head_dim], Scratch::default(), f64::INFINITY);
            for _ in 0..2000 {
                let t = std::time::Instant::now();
                attend_one(&query, &table, 1024, &cache, &head, &mut scratch, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            eprintln!("{kernels:?}: one head over 1024 positions in {:.1} us ({:.2} ns/position)", best * 1e6, best * 1e9 / 1024.0);
        }
    }
}
