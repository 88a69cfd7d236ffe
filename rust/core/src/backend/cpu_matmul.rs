//! `out = x · wᵀ`, with the weight `w` row-major `[n, k]` as Hugging Face stores it, in one of three
//! in-memory formats: exact f32, bf16 (f32 with the low 16 mantissa bits rounded off) or int8 with one f32
//! scale per weight row. Activations and accumulation are f32 in every format.
//!
//! Regimes, measured on 2-core AVX2 and AVX-512 machines with SmolLM2-135M shapes:
//! - f32, many rows (prefill): `gemm` with its own packing and threading;
//! - f32, one row (batch-1 decode) without AVX-512: `gemm`'s gemv, output columns split across threads;
//! - everything else: a register-tiled kernel (`cpu_matmul_x86`, AVX-512 or AVX2/FMA, picked at run time)
//!   that streams each weight row once per panel of x rows and widens bf16/int8 weights in registers.
//!   Without AVX2 the compact formats take a portable path (widen one weight row, dot it with every x row).

use gemm::{gemm, Parallelism};
use rayon::prelude::*;
use std::sync::OnceLock;

use super::cpu_kernels::dot;
use super::cpu_matmul_x86 as x86;

/// Up to this many rows the tiled kernel beats `gemm` for f32 (measured; they meet near 192 with AVX2).
const TILED_MAX_ROWS: usize = 64;

/// Column chunks are multiples of this: a cache line of weight rows, and a multiple of every tile width.
const COLUMN_ALIGN: usize = 24;

/// Below this many multiply-adds (about 10 µs) a matmul stays on the calling thread.
const PARALLEL_MACS: usize = 1 << 16;

/// Parallel chunks per thread, so a thread slowed by another process does not hold up the whole matmul.
const CHUNKS_PER_THREAD: usize = 4;

/// A weight matrix `[n, k]` in one of the CPU formats.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns: the high half of the f32 they stand for.
    Bf16(&'a [u16]),
    /// `w[c, i] = values[c * k + i] * scales[c]`.
    Int8 { values: &'a [i8], scales: &'a [f32] },
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::Int8 { values, .. } => values.len(),
        }
    }

    /// Row `r` (of width `out.len()`) widened to f32.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let k = out.len();
        match self {
            Weights::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            Weights::Bf16(w) => {
                for (o, &b) in out.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                    *o = bf16_to_f32(b);
                }
            }
            Weights::Int8 { values, scales } => {
                let scale = scales[r];
                for (o, &q) in out.iter_mut().zip(&values[r * k..(r + 1) * k]) {
                    *o = q as f32 * scale;
                }
            }
        }
    }
}

#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest, ties to even (as torch's `.to(torch.bfloat16)`); NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Symmetric per-row int8: `scale = max |w| / 127`, `q = round(w / scale)`; returns the scale. A row
/// holding inf or NaN gets a NaN scale, so its outputs are NaN as they would be in f32.
pub fn quantize_row_int8(row: &[f32], out: &mut [i8]) -> f32 {
    if row.iter().any(|w| !w.is_finite()) {
        out.fill(0);
        return f32::NAN;
    }
    let max = row.iter().fold(0.0f32, |m, &w| m.max(w.abs()));
    if max == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let inv = 127.0 / max;
    for (q, &w) in out.iter_mut().zip(row) {
        *q = (w * inv).round().clamp(-127.0, 127.0) as i8;
    }
    max / 127.0
}

/// Which SIMD kernels run; chosen once from the CPU's features, or forced with the environment variable
/// `STEPLLM_CPU_KERNELS=avx512|avx2|portable` (for benchmarks and tests of the slower paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    Portable,
    Avx2,
    Avx512,
}

impl Kernels {
    pub fn detect() -> Kernels {
        static CHOSEN: OnceLock<Kernels> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Self::supported().last().copied().unwrap_or(Kernels::Portable);
            match std::env::var("STEPLLM_CPU_KERNELS").ok().as_deref() {
                Some("portable") => Kernels::Portable,
                Some("avx2") if Self::supported().contains(&Kernels::Avx2) => Kernels::Avx2,
                _ => best,
            }
        })
    }

    /// Every kernel set this CPU can run, slowest first.
    pub fn supported() -> Vec<Kernels> {
        let mut all = vec![Kernels::Portable];
        if x86::avx2_available() {
            all.push(Kernels::Avx2);
        }
        if x86::avx512_available() {
            all.push(Kernels::Avx512);
        }
        all
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Portable => "portable",
            Kernels::Avx2 => "avx2",
            Kernels::Avx512 => "avx512",
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`, every matrix row-major and contiguous.
pub fn matmul_transposed(x: &[f32], w: Weights, out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_with(Kernels::detect(), x, w, out, m, k, n)
}

/// [`matmul_transposed`] with the kernel set given (it must be one of [`Kernels::supported`]).
pub fn matmul_with(kernels: Kernels, x: &[f32], w: Weights, out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matmul operand too small");
    if let Weights::Int8 { scales, .. } = w {
        assert!(scales.len() >= n, "int8 matmul needs one scale per weight row");
    }
    assert!(Kernels::supported().contains(&kernels), "{kernels:?} kernels are not supported by this CPU");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    match w {
        Weights::F32(w) if m > TILED_MAX_ROWS => {
            // SAFETY: the assert above bounds every access of the full product.
            unsafe { gemm_columns(x, w.as_ptr(), out.as_mut_ptr(), m, k, n, n, Parallelism::Rayon(0)) };
        }
        Weights::F32(w) if kernels == Kernels::Portable || (m == 1 && kernels == Kernels::Avx2) => {
            for_column_chunks(out, m, k, n, |out, c0, c1| {
                // SAFETY: the chunk is inside the asserted bounds; chunks write disjoint columns.
                unsafe { gemm_columns(x, w.as_ptr().add(c0 * k), out.add(c0), m, k, c1 - c0, n, Parallelism::None) }
            });
        }
        w if kernels == Kernels::Portable => {
            for_column_chunks(out, m, k, n, |out, c0, c1| {
                // SAFETY: as above.
                unsafe { portable_columns(x, w, out, m, k, n, c0, c1) }
            });
        }
        w => {
            let wide = kernels == Kernels::Avx512;
            for_column_chunks(out, m, k, n, |out, c0, c1| {
                // SAFETY: as above; the CPU runs `kernels` (asserted).
                unsafe { x86::columns(wide, x, w, out, m, k, n, c0, c1) }
            });
        }
    }
}

/// Split output columns `0..n` into chunks run in parallel; `f(out, c0, c1)` computes columns `c0..c1` of
/// every row. Each chunk reads only its own weight rows, so the weight streams through memory once.
fn for_column_chunks(out: &mut [f32], m: usize, k: usize, n: usize, f: impl Fn(*mut f32, usize, usize) + Sync) {
    let threads = rayon::current_num_threads();
    if threads == 1 || n <= COLUMN_ALIGN || m * n * k < PARALLEL_MACS {
        f(out.as_mut_ptr(), 0, n);
        return;
    }
    let chunk = n.div_ceil(threads * CHUNKS_PER_THREAD).next_multiple_of(COLUMN_ALIGN);
    let out = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let c0 = c * chunk;
        f(out.get(), c0, (c0 + chunk).min(n));
    });
}

/// Columns `c0..c1` without SIMD intrinsics: widen one weight row at a time, then dot it with every x row.
///
/// # Safety
/// `out` must be writable at `r * n + c` for r < m, c0 <= c < c1; the weight must hold `c1` rows.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_columns(x: &[f32], w: Weights, out: *mut f32, m: usize, k: usize, n: usize, c0: usize, c1: usize) {
    let mut row = vec![0.0f32; k];
    for c in c0..c1 {
        w.row_to_f32(c, &mut row);
        for r in 0..m {
            *out.add(r * n + c) = dot(&x[r * k..(r + 1) * k], &row);
        }
    }
}

/// `out[:, 0..cols] = x · w[0..cols, :]ᵀ` where `out` rows are `out_stride` apart.
///
/// # Safety
/// `w` must hold `cols * k` values and `out` must be writable at `r * out_stride + c` for r < m, c < cols.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_columns(
    x: &[f32],
    w: *const f32,
    out: *mut f32,
    m: usize,
    k: usize,
    cols: usize,
    out_stride: usize,
    parallelism: Parallelism,
) {
    #[rustfmt::skip]
    gemm(
        m, cols, k,
        out, 1, out_stride as isize, false,
        x.as_ptr(), 1, k as isize,
        w, k as isize, 1,
        0.0f32, 1.0f32, false, false, false,
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

    const SHAPES: [(usize, usize, usize); 11] = [
        (1, 37, 101),
        (2, 64, 130),
        (3, 9, 50),
        (5, 8, 3),
        (7, 100, 300),
        (8, 576, 97),
        (9, 17, 49),
        (13, 48, 72),
        (70, 33, 70),
        (1, 576, 2000),
        (150, 130, 61),
    ];

    fn inputs(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
        let w = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0 + (i % 3) as f32 * 1e-3).collect();
        (x, w)
    }

    fn check(out: &[f32], reference: &[f32], tolerance: f32, what: &str) {
        for (a, b) in out.iter().zip(reference) {
            assert!((a - b).abs() <= tolerance * b.abs().max(1.0), "{what}: {a} vs {b}");
        }
    }

    #[test]
    fn f32_matches_naive_with_every_kernel_set() {
        for kernels in Kernels::supported() {
            for (m, k, n) in SHAPES {
                let (x, w) = inputs(m, k, n);
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::F32(&w), &mut out, m, k, n);
                check(&out, &naive(&x, &w, m, k, n), 1e-4, &format!("{kernels:?} f32 m={m} k={k} n={n}"));
            }
        }
    }

    /// The bf16 kernels compute exactly the product with the rounded weights (up to f32 summation order).
    #[test]
    fn bf16_matches_naive_over_rounded_weights() {
        for kernels in Kernels::supported() {
            for (m, k, n) in SHAPES {
                let (x, w) = inputs(m, k, n);
                let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
                let rounded: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::Bf16(&bits), &mut out, m, k, n);
                let what = format!("{kernels:?} bf16 m={m} k={k} n={n}");
                check(&out, &naive(&x, &rounded, m, k, n), 1e-4, &what);
                // and stays within bf16's precision of the f32 product
                check(&out, &naive(&x, &w, m, k, n), 1e-2, &what);
            }
        }
    }

    #[test]
    fn int8_matches_naive_over_dequantized_weights() {
        for kernels in Kernels::supported() {
            for (m, k, n) in SHAPES {
                let (x, w) = inputs(m, k, n);
                let mut values = vec![0i8; n * k];
                let scales: Vec<f32> =
                    (0..n).map(|c| quantize_row_int8(&w[c * k..(c + 1) * k], &mut values[c * k..(c + 1) * k])).collect();
                let dequantized: Vec<f32> = (0..n * k).map(|i| values[i] as f32 * scales[i / k]).collect();
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::Int8 { values: &values, scales: &scales }, &mut out, m, k, n);
                let what = format!("{kernels:?} int8 m={m} k={k} n={n}");
                check(&out, &naive(&x, &dequantized, m, k, n), 1e-4, &what);
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn int8_rows_keep_their_extremes() {
        let row = [0.5, -2.0, 1.0, 0.0];
        let mut q = [0i8; 4];
        let scale = quantize_row_int8(&row, &mut q);
        assert_eq!(q, [32, -127, 64, 0]);
        assert!((scale - 2.0 / 127.0).abs() < 1e-9);
        assert_eq!(quantize_row_int8(&[0.0; 3], &mut q[..3]), 0.0);
        assert_eq!(&q[..3], &[0, 0, 0]);
    }
}
