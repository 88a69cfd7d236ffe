//! CPU paged KV cache, RoPE (+ q/k norm) with KV write, and causal attention over a ragged batch.

use super::batch::BatchPlan;
use super::cpu::{internal, CpuTensor};
use super::cpu_kernels::{axpy, dot, for_each_row, rms_norm_in_place, rope_angles, rope_head, rope_inverse_frequencies};
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
    // One unit = one (token, query head): enough units to keep every core busy even for a single decode
    // token, and each unit owns exactly one head_dim slice of the output.
    let attend = |scores: &mut Vec<f32>, (unit, o): (usize, &mut [f32])| {
        let (t, h) = (unit / shape.num_heads, unit % shape.num_heads);
        let seq = &plan.seqs[plan.token_seq[t] as usize];
        let query = &qkv.row(t)[h * head_dim..(h + 1) * head_dim];
        let head = Head { kv_head: h / shape.group_size(), head_dim, scale: shape.softmax_scale() };
        let context = plan.positions[t] as usize + 1;
        attend_one(query, plan.block_table(seq), context, &cache_layer, &head, scores, o);
    };
    let work: usize = plan.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * shape.q_dim();
    let units = out.as_mut_slice().chunks_mut(head_dim);
    if work >= PARALLEL_WORK {
        let units = out.as_mut_slice().par_chunks_mut(head_dim).enumerate();
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
    scores.clear();
    for_each_cached_position(block_table, context, cache.block_size, |slot| {
        let at = slot * cache.kv_dim + offset;
        scores.push(dot(query, &cache.keys[at..at + head.head_dim]) * head.scale);
    });
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    let mut p = 0;
    for_each_cached_position(block_table, context, cache.block_size, |slot| {
        let at = slot * cache.kv_dim + offset;
        axpy(scores[p], &cache.values[at..at + head.head_dim], out);
        p += 1;
    });
    let inv_sum = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv_sum);
}

/// Call `f(slot)` for positions `0..context` in order, walking the block table a block at a time.
fn for_each_cached_position(block_table: &[u32], context: usize, block_size: usize, mut f: impl FnMut(usize)) {
    for (b, &block) in block_table.iter().enumerate() {
        let first = b * block_size;
        if first >= context {
            break;
        }
        let base = block as usize * block_size;
        for offset in 0..block_size.min(context - first) {
            f(base + offset);
        }
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
    if shape.head_dim > MAX_HEAD_DIM || shape.head_dim % 2 != 0 || shape.num_heads % shape.num_kv_heads != 0 {
        return internal(format!("unsupported attention shape {shape:?} (head_dim must be even and <= {MAX_HEAD_DIM})"));
    }
    Ok(())
}
