//! The `a8` weight format: `out = x · wᵀ` with integer dot products, llama.cpp's arithmetic. Weights keep a
//! GGUF's integer levels with their scale and minimum per group of 16 or 32 (a float checkpoint's are rounded to
//! 8-bit levels with an f16 scale per 32 weights, as Q8_0 would); each matmul rounds its activations to 8 bits
//! per 32 values (scale `max |x| / 127`). A group's dot product is then a sum of integer products, exact in i32,
//! which AVX-512 VNNI does 64 at a time (`vpdpbusd`) where the exact format spends a widening and two fused
//! multiply-adds per weight. The cost is precision: activations carry about 7 bits, as in llama.cpp.
//!
//! Per row `r`, column `c` and weight group `g` (activation scale `a` of the 32 values holding it):
//! `out += float(Σ u·xq − offset·Σ xq) · (scale · a)`, then `out += min · (a · float(Σ xq))` where minimums are
//! stored, with `u = level + offset ≥ 0` the stored unsigned level. Every kernel does these same f32 operations in
//! the same order, so the VNNI kernel equals the portable one bit for bit (the tests check it).
//!
//! Levels sit in the matmul's column panels ([`PANEL`] columns), grouped for the dot-product instruction: each
//! quad of 4 k steps holds 4 consecutive levels per column, `4 * j + t` for column `j` and step `t`. Levels of
//! 0..=15 take nibbles (column `j` in the low half of its byte, `j + PANEL / 2` in the high one), others bytes.

use rayon::prelude::*;

use super::cpu_matmul::{for_column_chunks, pack_constants, padded_rows, BlockConstants, Kernels, PANEL};
use crate::model::loader::{HostBlocks, HostTensor};

/// Activations are rounded to 8 bits with one scale per this many values of a row.
pub const ACTIVATION_GROUP: usize = 32;

/// k steps per dot-product lane: `vpdpbusd` sums 4 byte products into each i32.
const QUAD: usize = 4;

/// A weight matrix `[n, k]` in the `a8` format (see the module comment).
#[derive(Debug, Clone)]
pub struct A8Matrix {
    levels: Vec<u8>,
    nibbles: bool,
    /// Added to every level so that it is stored unsigned (the dot-product instruction's weight operand).
    offset: i32,
    constants: BlockConstants,
    group: usize,
    k: usize,
}

impl A8Matrix {
    /// `host` (`[n, k]`) in the `a8` format: its blocks when their groups are 16 or 32 steps, else its values
    /// rounded to 8-bit levels per 32. None when `k` is no multiple of 32 (the caller keeps another format).
    pub fn pack(host: &HostTensor, n: usize, k: usize) -> Option<A8Matrix> {
        if k == 0 || !k.is_multiple_of(ACTIVATION_GROUP) {
            return None;
        }
        // Blocks stand for the values only where they rebuild them (a loader may hand over floats changed since).
        let rebuilds = |b: &&HostBlocks| host.data.is_empty() || b.rebuild(&host.data);
        let blocks = host.blocks.as_ref().filter(|b| matches!(b.group, 16 | 32) && b.levels.len() == n * k).filter(rebuilds);
        let rounded;
        let blocks = match blocks {
            Some(blocks) => blocks,
            None => {
                rounded = round_to_8_bits(&host.values(), n, k);
                &rounded
            }
        };
        let (lowest, highest) = blocks.levels.par_chunks(1 << 14).map(range).reduce(|| (i8::MAX, i8::MIN), |a, b| (a.0.min(b.0), a.1.max(b.1)));
        let (nibbles, offset) = match (lowest, highest) {
            (0.., ..=15) => (true, 0),
            (-8.., ..=7) => (true, 8),
            (0.., _) => (false, 0),
            _ => (false, 128),
        };
        let levels = pack_levels(&blocks.levels, n, k, nibbles, offset);
        Some(A8Matrix { levels, nibbles, offset, constants: pack_constants(blocks, n, k), group: blocks.group, k })
    }

    pub fn bytes(&self) -> usize {
        self.levels.len() + self.constants.bytes()
    }

    /// Stored bytes of one quad of a panel: 32 columns of 4 levels.
    fn quad_bytes(&self) -> usize {
        if self.nibbles {
            PANEL * QUAD / 2
        } else {
            PANEL * QUAD
        }
    }

    /// The stored (unsigned) level of weight `(c, p)`.
    fn stored_level(&self, c: usize, p: usize) -> i32 {
        let (panel, j, quad, t) = (c / PANEL, c % PANEL, p / QUAD, p % QUAD);
        let quads = self.k / QUAD;
        if self.nibbles {
            let byte = self.levels[(panel * quads + quad) * self.quad_bytes() + QUAD * (j % (PANEL / 2)) + t];
            (if j >= PANEL / 2 { byte >> 4 } else { byte & 0x0F }) as i32
        } else {
            self.levels[(panel * quads + quad) * self.quad_bytes() + QUAD * j + t] as i32
        }
    }

    /// Row `r` as f32 (an embedding lookup): `level * scale + min`.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let constants = self.constants.view();
        for (p, o) in out.iter_mut().enumerate() {
            let (scale, min) = constants.get(r, p, self.k, self.group);
            *o = ((self.stored_level(r, p) - self.offset) as f32).mul_add(scale, min);
        }
    }
}

fn range(levels: &[i8]) -> (i8, i8) {
    levels.iter().fold((i8::MAX, i8::MIN), |(lo, hi), &q| (lo.min(q), hi.max(q)))
}

/// Q8_0's rounding: per 32 weights an f16 scale `max |w| / 127` and levels `round(w / scale)`.
fn round_to_8_bits(values: &[f32], n: usize, k: usize) -> HostBlocks {
    let groups = n * k / ACTIVATION_GROUP;
    let mut levels = vec![0i8; n * k];
    let mut scales = vec![0.0f32; groups];
    levels.par_chunks_mut(ACTIVATION_GROUP).zip(values.par_chunks(ACTIVATION_GROUP)).zip(scales.par_iter_mut()).for_each(|((levels, values), scale)| {
        let amax = values.iter().fold(0.0f32, |m, w| m.max(w.abs()));
        *scale = half::f16::from_f32(amax / 127.0).to_f32();
        let inverse = if *scale > 0.0 { 1.0 / *scale } else { 0.0 };
        for (q, w) in levels.iter_mut().zip(values) {
            *q = (w * inverse).round().clamp(-127.0, 127.0) as i8;
        }
    });
    HostBlocks { group: ACTIVATION_GROUP, levels, scales, mins: vec![-0.0; groups], factors: None }
}

/// The row-major `[n, k]` `levels` plus `offset` in quads of 4 steps per column (see the module comment); rows
/// past `n` are level 0 (their constants are 0 too).
fn pack_levels(levels: &[i8], n: usize, k: usize, nibbles: bool, offset: i32) -> Vec<u8> {
    let quad_bytes = if nibbles { PANEL * QUAD / 2 } else { PANEL * QUAD };
    let panel_bytes = quad_bytes * k / QUAD;
    let padding = vec![0i8; k];
    let row = |r: usize| if r < n { &levels[r * k..(r + 1) * k] } else { &padding[..] };
    let mut out = vec![0u8; padded_rows(n) / PANEL * panel_bytes];
    out.par_chunks_mut(panel_bytes).enumerate().for_each(|(panel, dst)| {
        for j in 0..PANEL {
            let stored = row(panel * PANEL + j).iter().map(|&q| (q as i32 + offset) as u8);
            for (p, u) in stored.enumerate() {
                let quad = &mut dst[p / QUAD * quad_bytes..][..quad_bytes];
                let t = p % QUAD;
                if !nibbles {
                    quad[QUAD * j + t] = u;
                } else if j < PANEL / 2 {
                    quad[QUAD * j + t] |= u;
                } else {
                    quad[QUAD * (j - PANEL / 2) + t] |= u << 4;
                }
            }
        }
    });
    out
}

/// `m` rows of activations rounded to 8 bits: levels, a scale per 32 values, and per weight group of `group`
/// values the sum of the levels (what a group's offset and minimum multiply).
pub struct RoundedRows {
    levels: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}

/// Below this many values, rounding the activations stays on the calling thread.
const PARALLEL_VALUES: usize = 1 << 15;

fn round_rows(x: &[f32], m: usize, k: usize, group: usize) -> RoundedRows {
    let mut rounded = RoundedRows { levels: vec![0; m * k], scales: vec![0.0; m * k / ACTIVATION_GROUP], sums: vec![0; m * k / group] };
    let round_block = |((levels, scale), x): ((&mut [i8], &mut f32), &[f32])| {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // A NaN scale (an inf or NaN in the block) makes every output of the row NaN, as f32 would.
        *scale = if x.iter().all(|v| v.is_finite()) { amax / 127.0 } else { f32::NAN };
        let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in levels.iter_mut().zip(x) {
            *q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
        }
    };
    let blocks = rounded.levels.chunks_mut(ACTIVATION_GROUP).zip(rounded.scales.iter_mut()).zip(x[..m * k].chunks(ACTIVATION_GROUP));
    if m * k >= PARALLEL_VALUES {
        let blocks = rounded.levels.par_chunks_mut(ACTIVATION_GROUP).zip(rounded.scales.par_iter_mut()).zip(x[..m * k].par_chunks(ACTIVATION_GROUP));
        blocks.for_each(round_block);
    } else {
        blocks.for_each(round_block);
    }
    for (sum, levels) in rounded.sums.iter_mut().zip(rounded.levels.chunks(group)) {
        *sum = levels.iter().map(|&q| q as i32).sum();
    }
    rounded
}

/// Which kernel runs an `a8` matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum A8Kernel {
    /// Plain Rust, one product at a time: the reference, and the path of CPUs without AVX-512 VNNI.
    Portable,
    Vnni,
}

impl A8Kernel {
    pub fn detect() -> A8Kernel {
        if Kernels::detect() == Kernels::Avx512 && x86::vnni_available() {
            A8Kernel::Vnni
        } else {
            A8Kernel::Portable
        }
    }

    pub fn supported() -> Vec<A8Kernel> {
        let mut all = vec![A8Kernel::Portable];
        if Kernels::supported().contains(&Kernels::Avx512) && x86::vnni_available() {
            all.push(A8Kernel::Vnni);
        }
        all
    }
}

/// `out[m, n] = x[m, k] · wᵀ`, `x` and `out` row-major and contiguous.
pub fn matmul(x: &[f32], w: &A8Matrix, out: &mut [f32], m: usize, n: usize) {
    matmul_with(A8Kernel::detect(), x, w, out, m, n)
}

/// [`matmul`] with the kernel given (one of [`A8Kernel::supported`]).
pub fn matmul_with(kernel: A8Kernel, x: &[f32], w: &A8Matrix, out: &mut [f32], m: usize, n: usize) {
    let k = w.k;
    assert!(x.len() >= m * k && out.len() >= m * n, "a8 matmul operand too small");
    assert!(w.levels.len() >= padded_rows(n) / PANEL * w.quad_bytes() * k / QUAD, "a8 matmul weight holds fewer than {n} rows");
    assert!(A8Kernel::supported().contains(&kernel), "{kernel:?} a8 kernel is not supported by this CPU");
    if m == 0 || n == 0 {
        return;
    }
    let rows = round_rows(x, m, k, w.group);
    for_column_chunks(out, m, k, n, |out, c0, c1| match kernel {
        // SAFETY: chunks write disjoint columns of `out`, which holds m * n values (asserted).
        A8Kernel::Portable => unsafe { portable_columns(w, &rows, out, m, n, c0, c1) },
        // SAFETY: as above; the CPU has AVX-512 VNNI (asserted) and the weight covers `..c1` (asserted).
        A8Kernel::Vnni => unsafe { x86::vnni_columns(w, &rows, out, m, n, c0, c1) },
    });
}

/// # Safety
/// `out` must be writable at `r * n + c` for r < m, c0 <= c < c1.
unsafe fn portable_columns(w: &A8Matrix, rows: &RoundedRows, out: *mut f32, m: usize, n: usize, c0: usize, c1: usize) {
    let (k, group) = (w.k, w.group);
    let constants = w.constants.view();
    let has_mins = w.constants.has_mins();
    for r in 0..m {
        let levels = &rows.levels[r * k..(r + 1) * k];
        for c in c0..c1 {
            let mut acc = 0.0f32;
            for g in 0..k / group {
                let p0 = g * group;
                let dot: i32 = (p0..p0 + group).map(|p| w.stored_level(c, p) * levels[p] as i32).sum();
                let sum = rows.sums[r * (k / group) + g];
                let (scale, min) = constants.get(c, p0, k, group);
                let a = rows.scales[(r * k + p0) / ACTIVATION_GROUP];
                acc = ((dot - w.offset * sum) as f32).mul_add(scale * a, acc);
                if has_mins {
                    acc = min.mul_add(a * sum as f32, acc);
                }
            }
            *out.add(r * n + c) = acc;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub fn vnni_available() -> bool {
        false
    }

    pub unsafe fn vnni_columns(_: &super::A8Matrix, _: &super::RoundedRows, _: *mut f32, _: usize, _: usize, _: usize, _: usize) {
        unreachable!("x86 kernels off x86_64")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::cpu_matmul::{Constants, PANEL};
    use super::super::cpu_simd::{Avx512, Factored, GroupConstants, Isa, Stored};
    use super::{A8Matrix, RoundedRows, ACTIVATION_GROUP, QUAD};
    use std::arch::x86_64::*;

    pub fn vnni_available() -> bool {
        super::super::cpu_simd::avx512_available() && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
    }

    /// Rows per row panel: their activation levels (64 × k bytes) stay in L2 while the panels stream past.
    const ROW_PANEL: usize = 64;

    /// Weight bytes prefetched ahead of the quad being read.
    const PREFETCH_BYTES: usize = 1024;

    /// What a tile reads: the weight panel, the rounded rows and where its outputs go.
    struct Tile<'a, S: GroupConstants> {
        panel: *const u8,
        quad_bytes: usize,
        constants: S,
        has_mins: bool,
        offset: i32,
        group: usize,
        k: usize,
        rows: &'a RoundedRows,
        column: usize,
        valid: usize,
        out: *mut f32,
        n: usize,
    }

    /// Columns `c0..c1` (`c0` a multiple of PANEL) of every row.
    ///
    /// # Safety
    /// The CPU must have AVX-512 VNNI; `w` must cover the panels of `..c1`; `out` writable at `r * n + c` for
    /// r < m, c0 <= c < c1.
    pub unsafe fn vnni_columns(w: &A8Matrix, rows: &RoundedRows, out: *mut f32, m: usize, n: usize, c0: usize, c1: usize) {
        match w.constants.view() {
            Constants::F16 { scales, mins } => columns(w, Stored::new(scales, mins), rows, out, m, n, c0, c1),
            Constants::F32 { scales, mins } => columns(w, Stored::new(scales, mins), rows, out, m, n, c0, c1),
            Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group } => {
                columns(w, Factored::new(scale_factors, scale_steps, min_factors, min_steps, super_group), rows, out, m, n, c0, c1)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn columns<S: GroupConstants>(w: &A8Matrix, constants: S, rows: &RoundedRows, out: *mut f32, m: usize, n: usize, c0: usize, c1: usize) {
        let panel_bytes = w.quad_bytes() * w.k / QUAD;
        let mut row0 = 0;
        while row0 < m {
            let row_end = (row0 + ROW_PANEL).min(m);
            let mut c = c0;
            while c < c1 {
                let tile = Tile {
                    panel: w.levels.as_ptr().add(c / PANEL * panel_bytes),
                    quad_bytes: w.quad_bytes(),
                    constants,
                    has_mins: w.constants.has_mins(),
                    offset: w.offset,
                    group: w.group,
                    k: w.k,
                    rows,
                    column: c,
                    valid: (c1 - c).min(PANEL),
                    out,
                    n,
                };
                let mut r = row0;
                while r < row_end {
                    r += match (row_end - r, w.nibbles) {
                        (4.., true) => tile.run::<4, 1, true>(r),
                        (3, true) => tile.run::<3, 1, true>(r),
                        (2, true) => tile.run::<2, 2, true>(r),
                        (_, true) => tile.run::<1, 2, true>(r),
                        (4.., false) => tile.run::<4, 1, false>(r),
                        (3, false) => tile.run::<3, 1, false>(r),
                        (2, false) => tile.run::<2, 2, false>(r),
                        (_, false) => tile.run::<1, 2, false>(r),
                    };
                }
                c += PANEL;
            }
            row0 = row_end;
        }
    }

    impl<S: GroupConstants> Tile<'_, S> {
        /// The panel's two vectors of 16 columns for the quad at k step `p`, as unsigned bytes.
        #[inline(always)]
        unsafe fn weights<const NIBBLES: bool>(&self, p: usize) -> (__m512i, __m512i) {
            let at = self.panel.add(p / QUAD * self.quad_bytes);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES).cast());
            if NIBBLES {
                let bytes = _mm512_loadu_si512(at.cast());
                let low = _mm512_set1_epi8(0x0F);
                (_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low))
            } else {
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES + 64).cast());
                (_mm512_loadu_si512(at.cast()), _mm512_loadu_si512(at.add(64).cast()))
            }
        }

        /// Rows `row..row + R` of the panel's columns; U independent sums per output (short tiles) keep enough
        /// dot products in flight. Returns R.
        #[inline(always)]
        unsafe fn run<const R: usize, const U: usize, const NIBBLES: bool>(&self, row: usize) -> usize {
            let (k, group) = (self.k, self.group);
            let groups = k / group;
            let levels: [*const u8; R] = std::array::from_fn(|i| self.rows.levels.as_ptr().add((row + i) * k).cast());
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for g in 0..groups {
                let p0 = g * group;
                let mut dots = [[[_mm512_setzero_si512(); U]; 2]; R];
                let mut p = p0;
                while p < p0 + group {
                    for u in 0..U {
                        let (w0, w1) = self.weights::<NIBBLES>(p + u * QUAD);
                        for (i, dots) in dots.iter_mut().enumerate() {
                            let x = _mm512_set1_epi32(levels[i].add(p + u * QUAD).cast::<i32>().read_unaligned());
                            dots[0][u] = _mm512_dpbusd_epi32(dots[0][u], w0, x);
                            dots[1][u] = _mm512_dpbusd_epi32(dots[1][u], w1, x);
                        }
                    }
                    p += U * QUAD;
                }
                let (s0, m0) = self.constants.get::<Avx512>(self.column, p0, k, group);
                let (s1, m1) = self.constants.get::<Avx512>(self.column + 16, p0, k, group);
                for (i, acc) in acc.iter_mut().enumerate() {
                    let sum = self.rows.sums[(row + i) * groups + g];
                    let a = self.rows.scales[((row + i) * k + p0) / ACTIVATION_GROUP];
                    let correction = _mm512_set1_epi32(self.offset * sum);
                    let scaled = Avx512::splat(a);
                    for (v, (scale, min)) in [(s0, m0), (s1, m1)].into_iter().enumerate() {
                        let mut dot = dots[i][v][0];
                        for part in &dots[i][v][1..] {
                            dot = _mm512_add_epi32(dot, *part);
                        }
                        let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, correction));
                        acc[v] = Avx512::fma(dot, Avx512::mul(scale, scaled), acc[v]);
                        if self.has_mins {
                            acc[v] = Avx512::fma(min, Avx512::splat(a * sum as f32), acc[v]);
                        }
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let out = self.out.add((row + i) * self.n + self.column);
                for (v, sum) in acc.iter().enumerate() {
                    let count = self.valid.saturating_sub(v * 16).min(16);
                    if count > 0 {
                        _mm512_mask_storeu_ps(out.add(v * 16), ((1u32 << count) - 1) as u16, *sum);
                    }
                }
            }
            R
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::loader::gguf_quant::{dequantize, GgmlType};

    /// A random `[n, k]` matrix of ggml type `ty` as the GGUF loader hands it over.
    fn quantized(ty: GgmlType, n: usize, k: usize, seed: u64) -> HostTensor {
        let bytes = crate::test_support::random_quantized(ty, n * k, seed);
        let (data, blocks) = dequantize(ty, &bytes, n * k).unwrap();
        HostTensor { shape: vec![n, k], data, blocks }
    }

    fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..m * k)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// f64 sums of `x` (already rounded) times the weights `w` rebuilds.
    fn reference(x: &[f32], w: &A8Matrix, m: usize, n: usize) -> Vec<f32> {
        let k = w.k;
        let mut row = vec![0.0; k];
        let mut out = vec![0.0; m * n];
        for c in 0..n {
            w.row_to_f32(c, &mut row);
            for r in 0..m {
                out[r * n + c] = (0..k).map(|p| x[r * k + p] as f64 * row[p] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    /// The activations as the matmul rounds them.
    fn rounded(x: &[f32], m: usize, k: usize) -> Vec<f32> {
        let rows = round_rows(x, m, k, ACTIVATION_GROUP);
        rows.levels.iter().enumerate().map(|(i, &q)| q as f32 * rows.scales[i / ACTIVATION_GROUP]).collect()
    }

    const TYPES: [GgmlType; 12] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::IQ4_NL,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ];

    /// Row counts that take every tile height and cross a row panel; column counts with a partial panel.
    const SHAPES: [(usize, usize); 6] = [(1, 96), (2, 40), (3, 33), (4, 64), (5, 7), (70, 65)];

    #[test]
    fn rows_come_back_as_the_files_values() {
        for ty in TYPES {
            let host = quantized(ty, 40, 512, 3);
            let matrix = A8Matrix::pack(&host, 40, 512).unwrap();
            let mut row = vec![0.0; 512];
            for r in 0..40 {
                matrix.row_to_f32(r, &mut row);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&row), bits(&host.data[r * 512..(r + 1) * 512]), "{ty:?} row {r}");
            }
        }
    }

    #[test]
    fn every_kernel_equals_the_portable_one_bit_for_bit() {
        let kernels = A8Kernel::supported();
        assert!(!cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("avx512vnni") || kernels.contains(&A8Kernel::Vnni));
        for ty in TYPES {
            for (m, n) in SHAPES {
                let matrix = A8Matrix::pack(&quantized(ty, n, 512, m as u64), n, 512).unwrap();
                let x = activations(m, 512, n as u64);
                let mut expected = vec![f32::NAN; m * n];
                matmul_with(A8Kernel::Portable, &x, &matrix, &mut expected, m, n);
                for &kernel in &kernels {
                    let mut out = vec![f32::NAN; m * n];
                    matmul_with(kernel, &x, &matrix, &mut out, m, n);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&out), bits(&expected), "{ty:?} {kernel:?} m={m} n={n}");
                }
            }
        }
    }

    #[test]
    fn products_are_the_rounded_activations_times_the_files_weights() {
        for ty in TYPES {
            for (m, n) in [(1, 40), (5, 33)] {
                let matrix = A8Matrix::pack(&quantized(ty, n, 512, 7), n, 512).unwrap();
                let x = activations(m, 512, 11);
                let mut out = vec![f32::NAN; m * n];
                matmul(&x, &matrix, &mut out, m, n);
                let exact = reference(&rounded(&x, m, 512), &matrix, m, n);
                let scale = exact.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (i, (a, b)) in out.iter().zip(&exact).enumerate() {
                    assert!((a - b).abs() <= 1e-5 * scale, "{ty:?} m={m} n={n} [{i}]: {a} vs {b}");
                }
                // Against the activations unrounded: off by what 8 bits per value cost, no more.
                let unrounded = reference(&x, &matrix, m, n);
                let error = out.iter().zip(&unrounded).fold(0.0f32, |e, (a, b)| e.max((a - b).abs()));
                assert!(error <= 0.02 * scale, "{ty:?} m={m} n={n}: error {error} of {scale}");
            }
        }
    }

    #[test]
    fn float_weights_are_rounded_to_8_bits_per_32() {
        let (n, k) = (37, 96);
        let data = activations(n, k, 5);
        let host = HostTensor { shape: vec![n, k], data: data.clone(), blocks: None };
        let matrix = A8Matrix::pack(&host, n, k).unwrap();
        assert!(!matrix.nibbles && matrix.offset == 128 && matrix.group == 32);
        let mut row = vec![0.0; k];
        for r in 0..n {
            matrix.row_to_f32(r, &mut row);
            for (p, (a, b)) in row.iter().zip(&data[r * k..]).enumerate() {
                let amax = data[r * k + p / 32 * 32..][..32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((a - b).abs() <= amax / 127.0 * 0.51, "row {r} [{p}]: {a} vs {b}");
            }
        }
        for kernel in A8Kernel::supported() {
            let x = activations(3, k, 9);
            let mut out = vec![f32::NAN; 3 * n];
            matmul_with(kernel, &x, &matrix, &mut out, 3, n);
            let exact = reference(&rounded(&x, 3, k), &matrix, 3, n);
            for (a, b) in out.iter().zip(&exact) {
                assert!((a - b).abs() <= 1e-5, "{kernel:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn widths_off_the_activation_groups_are_refused_and_non_finite_inputs_stay_non_finite() {
        let host = HostTensor { shape: vec![4, 48], data: vec![1.0; 4 * 48], blocks: None };
        assert!(A8Matrix::pack(&host, 4, 48).is_none());
        let matrix = A8Matrix::pack(&quantized(GgmlType::Q4_1, 8, 64, 1), 8, 64).unwrap();
        let mut x = activations(2, 64, 1);
        x[3] = f32::INFINITY;
        for kernel in A8Kernel::supported() {
            let mut out = vec![0.0; 16];
            matmul_with(kernel, &x, &matrix, &mut out, 2, 8);
            assert!(out[..8].iter().all(|v| v.is_nan()), "{kernel:?}: {:?}", &out[..8]);
            assert!(out[8..].iter().all(|v| v.is_finite()), "{kernel:?}: the other row is untouched");
        }
    }
}
