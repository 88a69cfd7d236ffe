//! The x86 matmul kernel: `out = x · wᵀ` over weights stored in column panels (see `cpu_matmul::PANEL`),
//! for every weight format, in AVX2/FMA and AVX-512 variants chosen at run time.
//!
//! A panel holds PANEL output columns k-major, so a tile of R x rows by 2 vectors of output columns reads
//! its weights as one sequential stream (what hardware prefetchers follow best) and keeps R x 2 vectors of
//! dot products in registers: per k, two weight vectors (widened from bf16/int8 in registers), R broadcast
//! x values, 2R FMAs, and no horizontal sums at the end. Every product and sum is f32, so a bf16 or int8
//! matmul equals the f32 matmul over the rounded weights up to summation order, and a blocked one (whose loads
//! rebuild the f32 weights exactly) equals the f32 matmul bit for bit.
//!
//! Loop nest, per call (one column chunk of one thread): panels of x rows (so they stay in L2), then weight
//! panels, then passes of 2 vectors of columns over the panel, then tiles of R rows.

use super::cpu_matmul::Weights;

#[cfg(target_arch = "x86_64")]
pub use imp::panels;

/// # Safety
/// Never callable off x86_64: no kernel set but the portable one is supported there.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub unsafe fn panels(_: bool, _: &[f32], _: Weights, _: *mut f32, _: usize, _: usize, _: usize, _: usize, _: usize) {
    unreachable!("x86 kernels off x86_64")
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::cpu_matmul::{BlockWeights, Constants, Levels, PANEL};
    use super::super::cpu_simd::{Avx2, Avx512, Bf16, Blocks, Factored, Format, GroupConstants, Int8, Isa, Nibbles, Stored, F32};
    use super::Weights;
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

    /// x rows per row panel: 64 rows of the widest activation (1536) are 384 KiB, inside a 1-2 MiB L2.
    const ROW_PANEL: usize = 64;

    /// Weights are prefetched this many k steps ahead of the tile reading them (2-8 KiB, by format): far
    /// enough to cover memory latency at batch 8, where a k step takes a few nanoseconds.
    const PREFETCH_STEPS: usize = 64;

    /// Columns `c0..c1` (`c0` a multiple of PANEL) of `out[m, n] = x[m, k] · w[n, k]ᵀ`, with AVX-512 when
    /// `wide`, else AVX2.
    ///
    /// # Safety
    /// The CPU must have the chosen instruction set; `x` must hold `m * k` values, `w` the panels covering
    /// rows `..c1` (and as many scales for int8); `out` must be writable at `r * n + c` for r < m,
    /// c0 <= c < c1.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panels(wide: bool, x: &[f32], w: Weights, out: *mut f32, m: usize, k: usize, n: usize, c0: usize, c1: usize) {
        debug_assert!(c0.is_multiple_of(PANEL));
        let at = Geometry { m, k, n, c0, c1 };
        let x = x.as_ptr();
        match w {
            Weights::F32(w) => run_on(wide, F32, x, w.as_ptr(), out, at),
            Weights::Bf16(w) => run_on(wide, Bf16, x, w.as_ptr(), out, at),
            Weights::Int8 { values, scales } => run_on(wide, Int8(scales.as_ptr()), x, values.as_ptr(), out, at),
            Weights::Blocks(BlockWeights { levels, constants, group }) => match constants {
                Constants::F16 { scales, mins } => blocks_on(wide, levels, Blocks { constants: Stored::new(scales, mins), group }, x, out, at),
                Constants::F32 { scales, mins } => blocks_on(wide, levels, Blocks { constants: Stored::new(scales, mins), group }, x, out, at),
                Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group } => {
                    let factored = Factored::new(scale_factors, scale_steps, min_factors, min_steps, super_group);
                    blocks_on(wide, levels, Blocks { constants: factored, group }, x, out, at)
                }
            },
        }
    }

    /// # Safety
    /// As [`panels`].
    unsafe fn blocks_on<S: GroupConstants>(wide: bool, levels: Levels, blocks: Blocks<S>, x: *const f32, out: *mut f32, at: Geometry) {
        match levels {
            Levels::Bytes(v) => run_on(wide, blocks, x, v.as_ptr(), out, at),
            Levels::Nibbles { values, signed: false } => run_on(wide, Nibbles::<_, false>(blocks), x, values.as_ptr(), out, at),
            Levels::Nibbles { values, signed: true } => run_on(wide, Nibbles::<_, true>(blocks), x, values.as_ptr(), out, at),
        }
    }

    /// # Safety
    /// As [`panels`].
    unsafe fn run_on<F: Format>(wide: bool, format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        if wide {
            avx512(format, x, w, out, at)
        } else {
            avx2(format, x, w, out, at)
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

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        run::<Avx2, F>(format, x, w, out, at)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn avx512<F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        run::<Avx512, F>(format, x, w, out, at)
    }

    thread_local! {
        /// One weight panel widened to f32 (PANEL x k), per thread.
        static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    #[inline(always)]
    unsafe fn run<I: Tiling, F: Format>(format: F, x: *const f32, w: *const F::Elem, out: *mut f32, at: Geometry) {
        let Geometry { m, k, c0, c1, .. } = at;
        // A row panel that takes more than one tile widens each weight panel of a compressed format to f32
        // once and runs the f32 tiles over it, instead of decoding the weights again for every tile. The widened
        // weights are the format's own f32 values, so the results are the same. The buffer stays put while this
        // call runs, as nothing else on this thread touches it meanwhile; the tiles are not run in a closure
        // around the borrow because a closure would not inherit the kernel's target features.
        let widened = if F::WIDEN && m > I::MAX_ROWS {
            WIDENED.with_borrow_mut(|widened| {
                widened.resize(PANEL * k, 0.0);
                widened.as_mut_ptr()
            })
        } else {
            std::ptr::null_mut()
        };
        let mut row0 = 0;
        while row0 < m {
            let rows = (m - row0).min(ROW_PANEL);
            let mut c = c0;
            while c < c1 {
                let panel = w.add(c / PANEL * F::STEP * k);
                if !widened.is_null() && rows > I::MAX_ROWS {
                    widen_panel::<I, F>(format, panel, c, k, widened);
                    panel_tiles::<I, F32>(F32, x, widened, out, at, c, row0, rows);
                } else {
                    panel_tiles::<I, F>(format, x, panel, out, at, c, row0, rows);
                }
                c += PANEL;
            }
            row0 += rows;
        }
    }

    /// Output columns `c..c + PANEL` (clipped to `c1`) of x rows `row0..row0 + rows`, from the weight panel at
    /// `panel`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn panel_tiles<I: Tiling, F: Format>(
        format: F,
        x: *const f32,
        panel: *const F::Elem,
        out: *mut f32,
        at: Geometry,
        c: usize,
        row0: usize,
        rows: usize,
    ) {
        let Geometry { k, n, c1, .. } = at;
        let pass = 2 * I::LANES;
        let mut offset = 0;
        while offset < PANEL && c + offset < c1 {
            let column = c + offset;
            let valid = (c1 - column).min(pass);
            let mut r = 0;
            while r < rows {
                let row = row0 + r;
                let (x, out) = (x.add(row * k), out.add(row * n + column));
                let tile = Tile { format, x, w: panel, offset, out, k, n, column, valid };
                r += I::tile(&tile, rows - r);
            }
            offset += pass;
        }
    }

    /// The weight panel at `panel` (output columns `c..c + PANEL`) as f32, k-major like an f32 panel.
    #[inline(always)]
    unsafe fn widen_panel<I: Isa, F: Format>(format: F, panel: *const F::Elem, c: usize, k: usize, widened: *mut f32) {
        let mut offset = 0;
        while offset < PANEL {
            let mut group = format.group::<I>(c + offset, 0, k);
            for p in 0..k {
                if format.starts_group(p) {
                    group = format.group::<I>(c + offset, p, k);
                }
                let step = panel.add(p * F::STEP);
                I::store(widened.add(p * PANEL + offset), F::load::<I>(step.add(F::at(offset)), offset, group));
            }
            offset += I::LANES;
        }
    }

    /// Tile shapes per instruction set: as many accumulators as the registers hold beside the two weight
    /// vectors and a broadcast, and for short tiles several accumulators per output (k unrolled U times)
    /// so enough FMAs are in flight.
    trait Tiling: Isa + Sized {
        /// The rows of the tallest tile.
        const MAX_ROWS: usize;
        /// Tiles over the next `rows` (or fewer) x rows; returns how many rows it did.
        unsafe fn tile<F: Format>(t: &Tile<F>, rows: usize) -> usize;
    }

    impl Tiling for Avx2 {
        const MAX_ROWS: usize = 6;

        #[inline(always)]
        unsafe fn tile<F: Format>(t: &Tile<F>, rows: usize) -> usize {
            // 16 ymm registers.
            match rows {
                6.. => t.run::<Self, 6, 1>(),
                5 => t.run::<Self, 5, 1>(),
                4 => t.run::<Self, 4, 1>(),
                3 => t.run::<Self, 3, 1>(),
                2 => t.run::<Self, 2, 2>(),
                _ => t.run::<Self, 1, 4>(),
            }
        }
    }

    impl Tiling for Avx512 {
        const MAX_ROWS: usize = 12;

        #[inline(always)]
        unsafe fn tile<F: Format>(t: &Tile<F>, rows: usize) -> usize {
            // 32 zmm registers.
            match rows {
                12.. => t.run::<Self, 12, 1>(),
                11 => t.run::<Self, 11, 1>(),
                10 => t.run::<Self, 10, 1>(),
                9 => t.run::<Self, 9, 1>(),
                8 => t.run::<Self, 8, 1>(),
                7 => t.run::<Self, 7, 1>(),
                6 => t.run::<Self, 6, 1>(),
                5 => t.run::<Self, 5, 1>(),
                4 => t.run::<Self, 4, 2>(),
                3 => t.run::<Self, 3, 2>(),
                2 => t.run::<Self, 2, 2>(),
                _ => t.run::<Self, 1, 4>(),
            }
        }
    }

    /// x rows from `x` (`k` apart), a pass of 2 vectors of columns starting `offset` columns into the panel at
    /// `w`, output rows from `out` (`n` apart); `valid` of the pass's columns exist.
    struct Tile<F: Format> {
        format: F,
        x: *const f32,
        w: *const F::Elem,
        offset: usize,
        out: *mut f32,
        k: usize,
        n: usize,
        column: usize,
        valid: usize,
    }

    impl<F: Format> Tile<F> {
        /// The format's constants for both vectors of the pass at k step `p`.
        #[inline(always)]
        unsafe fn groups<I: Isa>(&self, p: usize) -> (F::Group<I>, F::Group<I>) {
            (self.format.group::<I>(self.column, p, self.k), self.format.group::<I>(self.column + I::LANES, p, self.k))
        }

        /// The pass's two weight vectors of k step `p`.
        #[inline(always)]
        unsafe fn weights<I: Isa>(&self, p: usize, (g0, g1): (F::Group<I>, F::Group<I>)) -> (I::V, I::V) {
            let step = self.w.add(p * F::STEP);
            let (c0, c1) = (self.offset, self.offset + I::LANES);
            (F::load::<I>(step.add(F::at(c0)), c0, g0), F::load::<I>(step.add(F::at(c1)), c1, g1))
        }

        #[inline(always)]
        unsafe fn run<I: Isa, const R: usize, const U: usize>(&self) -> usize {
            let (k, x, w) = (self.k, self.x, self.w);
            let mut acc = [[[I::zero(); U]; 2]; R];
            let unrolled_end = k / U * U;
            let mut groups = self.groups::<I>(0);
            let mut p = 0;
            while p < unrolled_end {
                // U k steps starting at a multiple of U never straddle two groups: groups are multiples of 4.
                if self.format.starts_group(p) {
                    groups = self.groups::<I>(p);
                }
                // A panel is one stream; prefetching it ahead keeps the loads from waiting on memory when
                // the tile computes nearly as fast as the weights arrive (batched decode).
                let ahead = w.wrapping_add((p + PREFETCH_STEPS) * F::STEP);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(F::at(self.offset)).cast());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(F::at(self.offset + I::LANES)).cast());
                for u in 0..U {
                    let (w0, w1) = self.weights::<I>(p + u, groups);
                    for (r, acc_row) in acc.iter_mut().enumerate() {
                        let xv = I::broadcast(x.add(r * k + p + u));
                        acc_row[0][u] = I::fma(xv, w0, acc_row[0][u]);
                        acc_row[1][u] = I::fma(xv, w1, acc_row[1][u]);
                    }
                }
                p += U;
            }
            while p < k {
                let (w0, w1) = self.weights::<I>(p, self.groups::<I>(p));
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let xv = I::broadcast(x.add(r * k + p));
                    acc_row[0][0] = I::fma(xv, w0, acc_row[0][0]);
                    acc_row[1][0] = I::fma(xv, w1, acc_row[1][0]);
                }
                p += 1;
            }
            for (r, acc_row) in acc.iter().enumerate() {
                for (v, partial) in acc_row.iter().enumerate() {
                    let mut sum = partial[0];
                    for part in &partial[1..] {
                        sum = I::add(sum, *part);
                    }
                    let sum = self.format.finish::<I>(self.column + v * I::LANES, sum);
                    let count = self.valid.saturating_sub(v * I::LANES).min(I::LANES);
                    I::store_first(self.out.add(r * self.n + v * I::LANES), sum, count);
                }
            }
            R
        }
    }
}
