//! The inner loops of CPU attention over one (block, KV head) region of the paged cache (layout in
//! `cpu_attention::CpuKvCache`): scores of a query against the block's transposed keys, and the
//! softmax-weighted sum of its value rows. Portable loops, and AVX-512 / AVX2 kernels chosen at run time.

/// The part of one cache block a query sees: the (block, KV head) region at `at`, positions
/// `first..first + len` of the sequence.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub at: usize,
    pub first: usize,
    pub len: usize,
}

/// Reference loops, and the path for CPUs without AVX2 (LLVM vectorizes the inner loops).
pub mod portable {
    use super::super::cpu_kernels::axpy;

    /// `scores[p] = scale * query · key_p` for the first `scores.len()` positions of a block whose keys
    /// are `keys[d * block_size + p]`.
    pub fn score_block(query: &[f32], keys: &[f32], block_size: usize, scale: f32, scores: &mut [f32]) {
        scores.fill(0.0);
        for (d, &q) in query.iter().enumerate() {
            let column = &keys[d * block_size..][..scores.len()];
            scores.iter_mut().zip(column).for_each(|(s, &k)| *s += q * k);
        }
        scores.iter_mut().for_each(|s| *s *= scale);
    }

    /// `out += sum_p weights[p] * value_p` over a block whose values are rows of `head_dim`.
    pub fn weighted_block(weights: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
        for (p, &w) in weights.iter().enumerate() {
            axpy(w, &values[p * head_dim..][..head_dim], out);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use super::super::cpu_simd::{Avx2, Avx512, Isa};
    use super::Span;

    /// [`super::portable::score_block`] over every span, in AVX-512 (`wide`) or AVX2.
    ///
    /// # Safety
    /// The CPU must have the instruction set; each span's region (`query.len() * block_size` values from
    /// `span.at`) must lie inside `keys`, and its positions inside `scores`.
    pub unsafe fn scores(wide: bool, query: &[f32], keys: &[f32], spans: &[Span], block_size: usize, scale: f32, scores: &mut [f32]) {
        debug_assert!(spans.iter().all(|s| s.at + query.len() * block_size <= keys.len() && s.first + s.len <= scores.len()));
        if wide {
            scores_avx512(query, keys, spans, block_size, scale, scores)
        } else {
            scores_avx2(query, keys, spans, block_size, scale, scores)
        }
    }

    /// [`super::portable::weighted_block`] in AVX-512 (`wide`) or AVX2.
    ///
    /// # Safety
    /// The CPU must have the instruction set; `values` must hold `weights.len() * out.len()` values.
    pub unsafe fn weighted_block(wide: bool, weights: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
        debug_assert!(values.len() >= weights.len() * head_dim && out.len() == head_dim);
        if wide {
            weighted_block_avx512(weights, values, head_dim, out)
        } else {
            weighted_block_avx2(weights, values, head_dim, out)
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn scores_avx512(query: &[f32], keys: &[f32], spans: &[Span], block_size: usize, scale: f32, scores: &mut [f32]) {
        scores_of::<Avx512>(query, keys, spans, block_size, scale, scores)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_avx2(query: &[f32], keys: &[f32], spans: &[Span], block_size: usize, scale: f32, scores: &mut [f32]) {
        scores_of::<Avx2>(query, keys, spans, block_size, scale, scores)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn weighted_block_avx512(weights: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
        weighted_of::<Avx512>(weights, values, head_dim, out)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_block_avx2(weights: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
        weighted_of::<Avx2>(weights, values, head_dim, out)
    }

    /// Positions in vectors of LANES (a vector stays inside its block's columns; the slots past a span's
    /// end hold stale keys, read but not reported), four vectors at a time so each broadcast query value
    /// feeds four FMAs; positions left over at a block's end go one by one.
    #[inline(always)]
    unsafe fn scores_of<I: Isa>(query: &[f32], keys: &[f32], spans: &[Span], block_size: usize, scale: f32, scores: &mut [f32]) {
        let head_dim = query.len();
        let mut pending = [Pending::default(); 4];
        let mut n = 0;
        for span in spans {
            let mut p = 0;
            while p < span.len && p + I::LANES <= block_size {
                pending[n] = Pending { key: span.at + p, score: span.first + p, count: (span.len - p).min(I::LANES) };
                n += 1;
                if n == 4 {
                    vectors::<I, 4>(query, keys, &pending, block_size, scale, scores);
                    n = 0;
                }
                p += I::LANES;
            }
            for j in p..span.len {
                let dot: f32 = (0..head_dim).map(|d| query[d] * keys[span.at + d * block_size + j]).sum();
                scores[span.first + j] = dot * scale;
            }
        }
        match n {
            3 => vectors::<I, 3>(query, keys, &pending, block_size, scale, scores),
            2 => vectors::<I, 2>(query, keys, &pending, block_size, scale, scores),
            1 => vectors::<I, 1>(query, keys, &pending, block_size, scale, scores),
            _ => {}
        }
    }

    /// One vector of positions: keys from `key` (column d at `key + d * block_size`), `count` scores
    /// reported from `score`.
    #[derive(Debug, Clone, Copy, Default)]
    struct Pending {
        key: usize,
        score: usize,
        count: usize,
    }

    /// The first C pending vectors, each in two accumulators (even and odd d).
    #[inline(always)]
    unsafe fn vectors<I: Isa, const C: usize>(query: &[f32], keys: &[f32], pending: &[Pending; 4], block_size: usize, scale: f32, scores: &mut [f32]) {
        let (q, k, head_dim) = (query.as_ptr(), keys.as_ptr(), query.len());
        let mut acc = [[I::zero(); 2]; C];
        let mut d = 0;
        while d + 2 <= head_dim {
            let (q0, q1) = (I::broadcast(q.add(d)), I::broadcast(q.add(d + 1)));
            for (a, v) in acc.iter_mut().zip(pending) {
                a[0] = I::fma(q0, I::load(k.add(v.key + d * block_size)), a[0]);
                a[1] = I::fma(q1, I::load(k.add(v.key + (d + 1) * block_size)), a[1]);
            }
            d += 2;
        }
        if d < head_dim {
            let q0 = I::broadcast(q.add(d));
            for (a, v) in acc.iter_mut().zip(pending) {
                a[0] = I::fma(q0, I::load(k.add(v.key + d * block_size)), a[0]);
            }
        }
        let scale = I::broadcast(&scale);
        for (a, v) in acc.iter().zip(pending) {
            let total = I::mul(I::add(a[0], a[1]), scale);
            if v.count == I::LANES {
                I::store(scores.as_mut_ptr().add(v.score), total);
            } else {
                let mut lanes = [0.0f32; 16];
                I::store(lanes.as_mut_ptr(), total);
                scores[v.score..v.score + v.count].copy_from_slice(&lanes[..v.count]);
            }
        }
    }

    /// Columns in groups of up to four vectors; positions alternate between two sets of accumulators so
    /// consecutive FMAs into one output vector do not wait on each other.
    #[inline(always)]
    unsafe fn weighted_of<I: Isa>(weights: &[f32], values: &[f32], head_dim: usize, out: &mut [f32]) {
        let mut column = 0;
        while column + I::LANES <= head_dim {
            column += match (head_dim - column) / I::LANES {
                4.. => columns::<I, 4>(weights, values, head_dim, column, out),
                3 => columns::<I, 3>(weights, values, head_dim, column, out),
                2 => columns::<I, 2>(weights, values, head_dim, column, out),
                _ => columns::<I, 1>(weights, values, head_dim, column, out),
            };
        }
        for c in column..head_dim {
            out[c] += weights.iter().enumerate().map(|(p, &w)| w * values[p * head_dim + c]).sum::<f32>();
        }
    }

    /// `V * LANES` output columns from `column`; returns how many it did.
    #[inline(always)]
    unsafe fn columns<I: Isa, const V: usize>(weights: &[f32], values: &[f32], head_dim: usize, column: usize, out: &mut [f32]) -> usize {
        let (v, o) = (values.as_ptr().add(column), out.as_mut_ptr().add(column));
        let mut even = [I::zero(); V];
        let mut odd = [I::zero(); V];
        for (i, e) in even.iter_mut().enumerate() {
            *e = I::load(o.add(i * I::LANES));
        }
        let pairs = weights.len() / 2 * 2;
        let mut p = 0;
        while p < pairs {
            let (w0, w1) = (I::broadcast(&weights[p]), I::broadcast(&weights[p + 1]));
            let (row0, row1) = (v.add(p * head_dim), v.add((p + 1) * head_dim));
            for i in 0..V {
                even[i] = I::fma(w0, I::load(row0.add(i * I::LANES)), even[i]);
                odd[i] = I::fma(w1, I::load(row1.add(i * I::LANES)), odd[i]);
            }
            p += 2;
        }
        if p < weights.len() {
            let (w, row) = (I::broadcast(&weights[p]), v.add(p * head_dim));
            for (i, e) in even.iter_mut().enumerate() {
                *e = I::fma(w, I::load(row.add(i * I::LANES)), *e);
            }
        }
        for i in 0..V {
            I::store(o.add(i * I::LANES), I::add(even[i], odd[i]));
        }
        V * I::LANES
    }
}

/// Off x86_64 only the portable kernels exist (`Kernels::supported` offers nothing else).
#[cfg(not(target_arch = "x86_64"))]
pub mod x86 {
    pub unsafe fn scores(_: bool, _: &[f32], _: &[f32], _: &[super::Span], _: usize, _: f32, _: &mut [f32]) {
        unreachable!("no x86 kernels off x86_64")
    }

    pub unsafe fn weighted_block(_: bool, _: &[f32], _: &[f32], _: usize, _: &mut [f32]) {
        unreachable!("no x86 kernels off x86_64")
    }
}
