//! CPU paged KV cache, RoPE (+ q/k norm) with KV write, and causal attention over a ragged batch.

use super::batch::BatchPlan;
use super::cpu::{internal, CpuTensor};
use super::cpu_kernels::{axpy, dot, exp, for_each_row, rms_norm_in_place, rope_angles, rope_head, rope_inverse_frequencies, sum};
use super::{AttentionShape, KvCacheShape};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Largest head supported; RoPE angles live in a stack buffer of half this size.
const MAX_HEAD_DIM: usize = 512;

/// Below this many multiply-adds, attention runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 14;

/// Per layer, K and V as `[num_blocks][block_size][num_kv_heads][head_dim]`: one slot is one contiguous
/// `kv_dim` row, so a token's write is a single copy.
#[derive(Debug)]
pub struct CpuKvCache {
    shape: KvCacheShape,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl CpuKvCache {
    pub(super) fn new(shape: KvCacheShape) -> Result<Self> {
        let per_layer = shape
            .num_slots()
            .checked_mul(shape.kv_dim())
            .ok_or_else(|| Error::Device(format!("KV cache of {shape:?} overflows the address space")))?;
        let layer_buffer = || -> Result<Vec<f32>> {
            let mut buffer = Vec::new();
            buffer.try_reserve_exact(per_layer).map_err(|_| {
                let gib = (2 * shape.num_layers * per_layer * 4) as f64 / (1u64 << 30) as f64;
                Error::Device(format!("cannot allocate a {gib:.2} GiB KV cache; ask for fewer blocks"))
            })?;
            buffer.resize(per_layer, 0.0);
            Ok(buffer)
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
    let inv_freq = rope_inverse_frequencies(shape.rope_theta, head_dim);
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
    // Scattered writes of one kv_dim row per token: cheap, so done serially rather than proving disjointness.
    let (keys, values) = (&mut cache.keys[layer], &mut cache.values[layer]);
    for (t, &slot) in plan.slots.iter().enumerate() {
        let row = qkv.row(t);
        let at = slot as usize * kv_dim;
        keys[at..at + kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
        values[at..at + kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
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
        kv_dim: shape.kv_dim(),
        block_size: plan.block_size,
    };
    let use_simd = simd::available(head_dim);
    // One unit = one (token, query head): enough units to keep every core busy even for a single decode
    // token, and each unit owns exactly one head_dim slice of the output.
    let attend = |scores: &mut Vec<f32>, (unit, o): (usize, &mut [f32])| {
        let (t, h) = (unit / shape.num_heads, unit % shape.num_heads);
        let seq = &plan.seqs[plan.token_seq[t] as usize];
        let query = &qkv.row(t)[h * head_dim..(h + 1) * head_dim];
        let head = Head { kv_head: h / shape.group_size(), head_dim, scale: shape.softmax_scale(), use_simd };
        let context = plan.positions[t] as usize + 1;
        attend_one(query, plan.block_table(seq), context, &cache_layer, &head, scores, o);
    };
    let work: usize = plan.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * shape.q_dim();
    let units = out.as_mut_slice().chunks_mut(head_dim);
    if work >= PARALLEL_WORK {
        // A few jobs per thread balance uneven contexts without paying rayon's per-split cost per unit.
        let min_units = (plan.num_tokens() * shape.num_heads / (4 * rayon::current_num_threads())).max(1);
        let units = out.as_mut_slice().par_chunks_mut(head_dim).enumerate().with_min_len(min_units);
        units.for_each_init(Vec::new, attend);
    } else {
        let mut scores = Vec::new();
        units.enumerate().for_each(|unit| attend(&mut scores, unit));
    }
    Ok(())
}

struct CacheLayer<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_dim: usize,
    block_size: usize,
}

struct Head {
    kv_head: usize,
    head_dim: usize,
    scale: f32,
    /// AVX2/FMA kernels (checked once per call) or the portable loops.
    use_simd: bool,
}

/// Softmax attention of one query head over cache positions `0..context` of its sequence.
fn attend_one(
    query: &[f32],
    block_table: &[u32],
    context: usize,
    cache: &CacheLayer,
    head: &Head,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let offset = head.kv_head * head.head_dim;
    let (keys, values) = (&cache.keys[offset..], &cache.values[offset..]);
    scores.resize(context, 0.0);
    let walk = Walk { block_table, context, block_size: cache.block_size, kv_dim: cache.kv_dim };
    if head.use_simd {
        // SAFETY: AVX2/FMA are present; `check_compatible` keeps every slot of the block table inside the
        // layer, so each row read (slot * kv_dim + offset .. + head_dim) is in bounds.
        unsafe { simd::scores(query, keys.as_ptr(), &walk, head.scale, scores) };
    } else {
        walk.for_each_slot(|p, slot| {
            let at = slot * walk.kv_dim;
            scores[p] = dot(query, &keys[at..at + head.head_dim]) * head.scale;
        });
    }
    softmax_in_place(scores);
    if head.use_simd {
        // SAFETY: as above.
        unsafe { simd::weighted_sum(scores, values.as_ptr(), &walk, out) };
    } else {
        out.fill(0.0);
        walk.for_each_slot(|p, slot| {
            let at = slot * walk.kv_dim;
            axpy(scores[p], &values[at..at + head.head_dim], out);
        });
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

/// A sequence's cached positions `0..context`, in order, through its block table.
struct Walk<'a> {
    block_table: &'a [u32],
    context: usize,
    block_size: usize,
    kv_dim: usize,
}

impl Walk<'_> {
    /// Call `f(position, slot)` for each position, a block at a time (no division per position).
    #[inline(always)]
    fn for_each_slot(&self, mut f: impl FnMut(usize, usize)) {
        for (b, &block) in self.block_table.iter().enumerate() {
            let first = b * self.block_size;
            if first >= self.context {
                break;
            }
            let base = block as usize * self.block_size;
            for offset in 0..self.block_size.min(self.context - first) {
                f(first + offset, base + offset);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::Walk;
    use std::arch::x86_64::*;

    pub fn available(head_dim: usize) -> bool {
        head_dim.is_multiple_of(8) && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// `scores[p] = scale * query · key_p`, with `keys` at the head's offset in the layer.
    ///
    /// # Safety
    /// AVX2 and FMA must be present; `head_dim % 8 == 0`; every slot's row must be readable.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(query: &[f32], keys: *const f32, walk: &Walk, scale: f32, scores: &mut [f32]) {
        let (q, head_dim) = (query.as_ptr(), query.len());
        walk.for_each_slot(|p, slot| {
            let k = keys.add(slot * walk.kv_dim);
            // Two accumulators halve the FMA dependency chain.
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c + 16 <= head_dim {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), _mm256_loadu_ps(k.add(c)), even);
                odd = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c + 8)), _mm256_loadu_ps(k.add(c + 8)), odd);
                c += 16;
            }
            if c < head_dim {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), _mm256_loadu_ps(k.add(c)), even);
            }
            scores[p] = horizontal_sum(_mm256_add_ps(even, odd)) * scale;
        });
    }

    /// `out = sum_p weights[p] * value_p`, with `values` at the head's offset in the layer.
    ///
    /// # Safety
    /// As for [`scores`], with `out.len() == head_dim`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(weights: &[f32], values: *const f32, walk: &Walk, out: &mut [f32]) {
        // Columns in blocks of at most 64 so the accumulators stay in registers across all positions.
        let mut column = 0;
        while column < out.len() {
            let (v, o) = (values.add(column), out.as_mut_ptr().add(column));
            column += match (out.len() - column) / 8 {
                8.. => weighted_columns::<8>(weights, v, walk, o),
                4..=7 => weighted_columns::<4>(weights, v, walk, o),
                2 | 3 => weighted_columns::<2>(weights, v, walk, o),
                _ => weighted_columns::<1>(weights, v, walk, o),
            };
        }
    }

    /// `V * 8` output columns; returns how many it wrote.
    #[inline(always)]
    unsafe fn weighted_columns<const V: usize>(weights: &[f32], values: *const f32, walk: &Walk, out: *mut f32) -> usize {
        let mut acc = [_mm256_setzero_ps(); V];
        walk.for_each_slot(|p, slot| {
            let v = values.add(slot * walk.kv_dim);
            let w = _mm256_set1_ps(weights[p]);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(8 * i)), *a);
            }
        });
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * i), *a);
        }
        V * 8
    }

    #[inline(always)]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let quads = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
        _mm_cvtss_f32(_mm_add_ss(quads, _mm_shuffle_ps(quads, quads, 1)))
    }
}

/// Other architectures use the portable loops.
#[cfg(not(target_arch = "x86_64"))]
mod simd {
    use super::Walk;

    pub fn available(_: usize) -> bool {
        false
    }

    pub unsafe fn scores(_: &[f32], _: *const f32, _: &Walk, _: f32, _: &mut [f32]) {
        unreachable!("simd::available() is false off x86_64")
    }

    pub unsafe fn weighted_sum(_: &[f32], _: *const f32, _: &Walk, _: &mut [f32]) {
        unreachable!("simd::available() is false off x86_64")
    }
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

    /// The SIMD kernels and the portable loops agree, for head sizes that exercise every column block.
    #[test]
    fn simd_and_portable_attention_agree() {
        for head_dim in [8, 16, 24, 64, 128, 136] {
            if !simd::available(head_dim) {
                return;
            }
            let (kv_heads, block_size, num_blocks) = (2, 4, 9);
            let len = num_blocks * block_size * kv_heads * head_dim;
            let noise = |seed: usize| (0..len).map(move |i| (((i * 7919 + seed) % 1009) as f32 / 1009.0 - 0.5) * 2.0);
            let (keys, values): (Vec<f32>, Vec<f32>) = (noise(1).collect(), noise(2).collect());
            let query: Vec<f32> = noise(3).take(head_dim).collect();
            let cache = CacheLayer { keys: &keys, values: &values, kv_dim: kv_heads * head_dim, block_size };
            let table = [5u32, 0, 8, 3, 7, 1];
            let context = 22;
            let mut outputs = Vec::new();
            for use_simd in [false, true] {
                let head = Head { kv_head: 1, head_dim, scale: 0.3, use_simd };
                let mut out = vec![f32::NAN; head_dim];
                attend_one(&query, &table, context, &cache, &head, &mut Vec::new(), &mut out);
                outputs.push(out);
            }
            for (a, b) in outputs[0].iter().zip(&outputs[1]) {
                assert!((a - b).abs() <= 1e-5, "head_dim {head_dim}: {a} vs {b}");
            }
        }
    }
}
