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

/// Sum in eight lanes (vectorizes; the order differs from a sequential sum only by rounding).
pub fn sum(values: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for i in 0..8 {
            acc[i] += chunk[i];
        }
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
    x / (1.0 + exp(-x))
}

/// `e^x` without branches or calls, so loops over slices vectorize (libm's `expf` is a call per element,
/// which made SiLU and softmax a visible share of a decode step). Cephes' `expf`: `x = n ln2 + r` with
/// |r| <= ln2 / 2, a degree-7 polynomial for `e^r`, then `2^n` from the exponent bits; within 2 ulp of the
/// exact value. Above 88.376 the result is +inf (the true value would be within 2^-1.5 of f32::MAX), below
/// -87.34 it is 0 (no subnormals), and NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HIGH: f32 = 88.376_26;
    const LOW: f32 = -87.336_54;
    // ln 2 split so that n * LN2_HIGH is exact for |n| < 2^9.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds an f32 of magnitude < 2^22 to the nearest integer, which then sits in the
    // low mantissa bits: integer and float n without a (scalarized) float-to-int conversion.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(LOW, HIGH);
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (clamped - n * LN2_HIGH) - n * LN2_LOW;
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * (r * r) + r + 1.0;
    let pow2 = f32::from_bits(((n_int + 127) as u32) << 23);
    if x > HIGH {
        f32::INFINITY
    } else if x < LOW {
        0.0
    } else {
        e_r * pow2
    }
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
    fn exp_is_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.3f32;
        while x < 88.3 {
            let (ours, exact) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((ours - exact).abs() / exact);
            x += 0.000_97;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(silu(-200.0), -0.0);
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let mut head = [1.0, 2.0, 3.0, 4.0];
        rope_head(&mut head, &[0.0, 1.0], &[1.0, 0.0]);
        assert_eq!(head, [-3.0, 2.0, 1.0, 4.0]);
    }
}
