//! Row-wise f32 kernels for the CPU backend, written so LLVM vectorizes them (several independent
//! accumulators; no fast-math needed). Matmuls live in `cpu_matmul`.

use rayon::prelude::*;

/// Below this many elements a row-wise op runs on the calling thread: waking the pool costs more.
pub const PARALLEL_ELEMENTS: usize = 1 << 15;

/// Apply `f(row_index, row)` to each `cols`-wide row of `data`, in parallel when there is enough work.
pub fn for_each_row(data: &mut [f32], cols: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if cols == 0 {
        return;
    }
    if data.len() >= PARALLEL_ELEMENTS {
        data.par_chunks_mut(cols).enumerate().for_each(|(r, row)| f(r, row));
    } else {
        data.chunks_mut(cols).enumerate().for_each(|(r, row)| f(r, row));
    }
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    let mut chunks_b = b.chunks_exact(8);
    for (ca, cb) in (&mut chunks_a).zip(&mut chunks_b) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in chunks_a.remainder().iter().zip(chunks_b.remainder()) {
        tail += x * y;
    }
    sum8(acc) + tail
}

fn sum8(acc: [f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// `out = x / rms(x) * weight`, as Hugging Face's LlamaRMSNorm computes it in f32.
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv_rms = inverse_rms(x, eps);
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(weight) {
        *o = wi * (xi * inv_rms);
    }
}

/// In-place variant for per-head q/k norms.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv_rms = inverse_rms(x, eps);
    for (xi, wi) in x.iter_mut().zip(weight) {
        *xi = wi * (*xi * inv_rms);
    }
}

fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    let mean_square = dot(x, x) / x.len() as f32;
    1.0 / (mean_square + eps).sqrt()
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Rotate one head by the neox / Hugging Face `rotate_half` rule: pairs are (i, i + half).
pub fn rope_head(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (lo, hi) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (lo[i], hi[i]);
        lo[i] = a * cos[i] - b * sin[i];
        hi[i] = b * cos[i] + a * sin[i];
    }
}

/// `1 / theta^(2i / head_dim)` for each rotated pair, computed in f32 as transformers does.
pub fn rope_inverse_frequencies(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
}

/// cos/sin of `position * inv_freq` (the f32 angle, as transformers forms it) for each pair.
pub fn rope_angles(position: u32, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((f, c), s) in inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let angle = position as f32 * f;
        *c = angle.cos();
        *s = angle.sin();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let mut head = [1.0, 2.0, 3.0, 4.0];
        rope_head(&mut head, &[0.0, 1.0], &[1.0, 0.0]);
        assert_eq!(head, [-3.0, 2.0, 1.0, 4.0]);
    }
}
