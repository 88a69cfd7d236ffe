//! Exact f32 kernels for the CPU backend: matmul through the `gemm` crate, and row-wise loops written so
//! LLVM vectorizes them (several independent accumulators; no fast-math needed).

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

/// Below this many elements a row-wise op runs on the calling thread: waking the pool costs more.
const PARALLEL_ELEMENTS: usize = 1 << 15;

/// Up to this many rows, matmuls split the output columns across threads ourselves: `gemm` runs small-m
/// products (decode) on one thread, and splitting the weight rows halves the memory traffic per core.
const SMALL_M: usize = 32;

/// Column chunks are multiples of this, so each thread's block of the weight starts cache-line aligned.
const COLUMN_ALIGN: usize = 16;

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

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`, every matrix row-major and contiguous.
pub fn matmul_transposed(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matmul operand too small");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    let threads = rayon::current_num_threads();
    if m > SMALL_M || threads == 1 || n < 2 * COLUMN_ALIGN {
        // SAFETY: the asserts above bound every access of the full product.
        unsafe { matmul_block(x, w.as_ptr(), out.as_mut_ptr(), m, k, n, n, Parallelism::Rayon(0)) };
        return;
    }
    let chunk = n.div_ceil(threads).next_multiple_of(COLUMN_ALIGN);
    let out_ptr = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let col0 = c * chunk;
        let cols = chunk.min(n - col0);
        // SAFETY: chunk c reads weight rows col0..col0+cols and writes output columns col0..col0+cols of
        // each row; chunks are disjoint and inside the asserted bounds.
        unsafe {
            matmul_block(x, w.as_ptr().add(col0 * k), out_ptr.get().add(col0), m, k, cols, n, Parallelism::None)
        };
    });
}

/// `out[:, 0..cols] = x · w[0..cols, :]ᵀ` where `out` rows are `out_stride` apart.
///
/// # Safety
/// `w` must hold `cols * k` values and `out` must be writable at `r * out_stride + c` for r < m, c < cols.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_block(
    x: &[f32],
    w: *const f32,
    out: *mut f32,
    m: usize,
    k: usize,
    cols: usize,
    out_stride: usize,
    parallelism: Parallelism,
) {
    gemm(
        m,
        cols,
        k,
        out,
        1,
        out_stride as isize,
        false,
        x.as_ptr(),
        1,
        k as isize,
        w,
        k as isize,
        1,
        0.0f32,
        1.0f32,
        false,
        false,
        false,
        parallelism,
    );
}

/// A raw pointer that rayon tasks may share; each task writes a disjoint region (see call sites).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    // A method (not field access) so closures capture the whole Send wrapper, not the bare pointer.
    fn get(self) -> *mut f32 {
        self.0
    }
}

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

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                out[r * n + c] = (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matmul_matches_naive_for_small_and_large_m() {
        for &(m, k, n) in &[(1, 37, 101), (3, 64, 128), (40, 33, 70), (5, 8, 3)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
            let mut out = vec![f32::NAN; m * n];
            matmul_transposed(&x, &w, &mut out, m, k, n);
            for (a, b) in out.iter().zip(naive(&x, &w, m, k, n)) {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b} at m={m} k={k} n={n}");
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let mut head = [1.0, 2.0, 3.0, 4.0];
        rope_head(&mut head, &[0.0, 1.0], &[1.0, 0.0]);
        assert_eq!(head, [-3.0, 2.0, 1.0, 4.0]);
    }
}
