//! Register-tiled x86 matmul kernels, `out = x · wᵀ` over a range of weight rows, for every weight format
//! (f32, bf16, int8 with per-row scales), in AVX2/FMA (8 lanes) and AVX-512 (16 lanes) variants chosen at
//! run time. Compact weights are widened to f32 in registers right after their load, and every product and
//! sum is f32, so a bf16 or int8 matmul equals the f32 matmul over the rounded weights.
//!
//! Loop nest, per call (one column chunk of one thread): panels of x rows (so a panel stays in L2), then
//! blocks of weight rows (so a block stays in L1/L2 while every tile of the panel passes over it), then
//! tiles of R x rows by C weight rows, each accumulating R * C dot products in registers over all of k.

use super::cpu_matmul::Weights;

#[cfg(target_arch = "x86_64")]
pub use imp::{avx2_available, avx512_available, columns};

#[cfg(not(target_arch = "x86_64"))]
pub fn avx2_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn avx512_available() -> bool {
    false
}

/// # Safety
/// Never callable off x86_64: no kernel set but the portable one is supported there.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub unsafe fn columns(_: bool, _: &[f32], _: Weights, _: *mut f32, _: usize, _: usize, _: usize, _: usize, _: usize) {
    unreachable!("x86 kernels off x86_64")
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::Weights;
    use std::arch::x86_64::*;

    /// Weight rows per block: a multiple of every tile width below.
    const BLOCK_COLUMNS: usize = 24;

    /// x rows per panel: 64 rows of the widest activation (1536) are 384 KiB, inside a 1-2 MiB L2.
    const PANEL_ROWS: usize = 64;

    pub fn avx2_available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    pub fn avx512_available() -> bool {
        avx2_available() && is_x86_feature_detected!("avx512f")
    }

    /// Columns `c0..c1` of `out[m, n] = x[m, k] · w[n, k]ᵀ`, with AVX-512 when `wide`, else AVX2.
    ///
    /// # Safety
    /// The CPU must have the chosen instruction set (see `*_available`); `x` must hold `m * k` values and
    /// `w` `c1 * k` (and `c1` scales for int8); `out` must be writable at `r * n + c` for r < m, c0 <= c < c1.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn columns(wide: bool, x: &[f32], w: Weights, out: *mut f32, m: usize, k: usize, n: usize, c0: usize, c1: usize) {
        let at = Geometry { m, k, n, c0, c1 };
        let x = x.as_ptr();
        match (wide, w) {
            (true, Weights::F32(w)) => avx512(F32, x, w.as_ptr(), out, at),
            (true, Weights::Bf16(w)) => avx512(Bf16, x, w.as_ptr(), out, at),
            (true, Weights::Int8 { values, scales }) => avx512(Int8(scales.as_ptr()), x, values.as_ptr(), out, at),
            (false, Weights::F32(w)) => avx2(F32, x, w.as_ptr(), out, at),
            (false, Weights::Bf16(w)) => avx2(Bf16, x, w.as_ptr(), out, at),
            (false, Weights::Int8 { values, scales }) => avx2(Int8(scales.as_ptr()), x, values.as_ptr(), out, at),
        }
    }

    #[derive(Clone, Copy)]
    struct Geometry {
        m: usize,
        k: usize,
        n: usize,
        c0: usize,
        c1: usize,
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        blocks::<Avx2, F>(format, x, w, out, at)
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn avx512<F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        blocks::<Avx512, F>(format, x, w, out, at)
    }

    #[inline(always)]
    unsafe fn blocks<I: Isa, F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        let Geometry { m, k, n, c0, c1 } = at;
        let mut panel = 0;
        while panel < m {
            let panel_end = (panel + PANEL_ROWS).min(m);
            let mut block = c0;
            while block < c1 {
                let block_end = (block + BLOCK_COLUMNS).min(c1);
                let mut row = panel;
                while row < panel_end {
                    let tiles = Tiles { format, x: x.add(row * k), w, out: out.add(row * n), k, n };
                    row += I::tiles(&tiles, panel_end - row, block, block_end);
                }
                block = block_end;
            }
            panel = panel_end;
        }
    }

    /// A SIMD instruction set: f32 vectors of `LANES` lanes, loads that widen each weight format to them.
    trait Isa {
        type V: Copy;
        const LANES: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn load_bf16(p: *const u16) -> Self::V;
        unsafe fn load_i8(p: *const i8) -> Self::V;
        /// `a * b + c`.
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn sum(v: Self::V) -> f32;
        /// Tiles over the next `rows` (or fewer) x rows and weight rows `c0..c1`; returns the x rows done.
        /// Each shape keeps as many accumulators as the register file holds beside the weight vectors.
        unsafe fn tiles<F: Format>(t: &Tiles<F>, rows: usize, c0: usize, c1: usize) -> usize;
    }

    struct Avx2;

    impl Isa for Avx2 {
        type V = __m256;
        const LANES: usize = 8;

        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }

        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }

        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
        }

        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m256 {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
        }

        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }

        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            let pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let quads = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
            _mm_cvtss_f32(_mm_add_ss(quads, _mm_shuffle_ps::<1>(quads, quads)))
        }

        #[inline(always)]
        unsafe fn tiles<F: Format>(t: &Tiles<F>, rows: usize, c0: usize, c1: usize) -> usize {
            // 16 ymm registers: R * C accumulators plus C weight vectors and one x vector.
            match rows {
                4.. => t.run::<Self, 4, 3>(c0, c1),
                3 => t.run::<Self, 3, 4>(c0, c1),
                2 => t.run::<Self, 2, 6>(c0, c1),
                _ => t.run::<Self, 1, 8>(c0, c1),
            }
        }
    }

    struct Avx512;

    impl Isa for Avx512 {
        type V = __m512;
        const LANES: usize = 16;

        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }

        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }

        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
        }

        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
        }

        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }

        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }

        #[inline(always)]
        unsafe fn tiles<F: Format>(t: &Tiles<F>, rows: usize, c0: usize, c1: usize) -> usize {
            // 32 zmm registers.
            match rows {
                8.. => t.run::<Self, 8, 3>(c0, c1),
                4..=7 => t.run::<Self, 4, 6>(c0, c1),
                3 => t.run::<Self, 3, 6>(c0, c1),
                2 => t.run::<Self, 2, 8>(c0, c1),
                _ => t.run::<Self, 1, 12>(c0, c1),
            }
        }
    }

    /// A weight format: how `LANES` consecutive weights become f32 lanes, and the per-row finish.
    trait Format: Copy {
        type Elem: Copy;
        unsafe fn load<I: Isa>(p: *const Self::Elem) -> I::V;
        fn scalar(e: Self::Elem) -> f32;
        /// The dot product of weight row `c`, once summed.
        #[inline(always)]
        unsafe fn finish(self, _c: usize, sum: f32) -> f32 {
            sum
        }
    }

    #[derive(Clone, Copy)]
    struct F32;

    impl Format for F32 {
        type Elem = f32;

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const f32) -> I::V {
            I::load(p)
        }

        #[inline(always)]
        fn scalar(e: f32) -> f32 {
            e
        }
    }

    #[derive(Clone, Copy)]
    struct Bf16;

    impl Format for Bf16 {
        type Elem = u16;

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const u16) -> I::V {
            I::load_bf16(p)
        }

        #[inline(always)]
        fn scalar(e: u16) -> f32 {
            f32::from_bits((e as u32) << 16)
        }
    }

    /// Per-row scales: the integer dot product is scaled once at the end.
    #[derive(Clone, Copy)]
    struct Int8(*const f32);

    impl Format for Int8 {
        type Elem = i8;

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const i8) -> I::V {
            I::load_i8(p)
        }

        #[inline(always)]
        fn scalar(e: i8) -> f32 {
            e as f32
        }

        #[inline(always)]
        unsafe fn finish(self, c: usize, sum: f32) -> f32 {
            sum * *self.0.add(c)
        }
    }

    /// Tiles whose x rows start at `x` (rows `k` apart) and whose output rows start at `out` (`n` apart).
    struct Tiles<F: Format> {
        format: F,
        x: *const f32,
        w: *const F::Elem,
        out: *mut f32,
        k: usize,
        n: usize,
    }

    impl<F: Format> Tiles<F> {
        #[inline(always)]
        unsafe fn run<I: Isa, const R: usize, const C: usize>(&self, c0: usize, c1: usize) -> usize {
            let mut c = c0;
            while c + C <= c1 {
                self.tile::<I, R, C>(c);
                c += C;
            }
            while c < c1 {
                self.tile::<I, R, 1>(c);
                c += 1;
            }
            R
        }

        /// Dot products of R x rows with C weight rows starting at weight row `c`.
        #[inline(always)]
        unsafe fn tile<I: Isa, const R: usize, const C: usize>(&self, c: usize) {
            let (k, w) = (self.k, self.w.add(c * self.k));
            let mut acc = [[I::zero(); C]; R];
            let vector_end = k / I::LANES * I::LANES;
            let mut p = 0;
            while p < vector_end {
                let mut wv = [I::zero(); C];
                for (j, v) in wv.iter_mut().enumerate() {
                    *v = F::load::<I>(w.add(j * k + p));
                }
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let xv = I::load(self.x.add(r * k + p));
                    for (a, v) in acc_row.iter_mut().zip(&wv) {
                        *a = I::fma(xv, *v, *a);
                    }
                }
                p += I::LANES;
            }
            for (r, acc_row) in acc.iter().enumerate() {
                for (j, a) in acc_row.iter().enumerate() {
                    let mut sum = I::sum(*a);
                    for q in vector_end..k {
                        sum += *self.x.add(r * k + q) * F::scalar(*w.add(j * k + q));
                    }
                    *self.out.add(r * self.n + c + j) = self.format.finish(c + j, sum);
                }
            }
        }
    }
}
