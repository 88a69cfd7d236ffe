//! The `a8` weight format: `out = x · wᵀ` with integer dot products, llama.cpp's arithmetic. Weights keep a
//! GGUF's integer levels with their scale and minimum per group of 16 or 32 (a float checkpoint's are rounded to
//! 8-bit levels with an f16 scale per 32 weights, as Q8_0 would); each matmul rounds its activations to 8 bits
//! per 32 values (scale `max |x| / 127`). A group's dot product is then a sum of integer products, exact in i32,
//! which AVX-512 VNNI does 64 at a time (`vpdpbusd`; AVX2 in three instructions per 32) where the exact format
//! spends a widening and two fused multiply-adds per weight. The cost is precision: activations carry about 7 bits,
//! as in llama.cpp.
//!
//! Per row `r`, column `c` and weight group `g` (activation scale `a` of the 32 values holding it):
//! `out += float(Σ u·xq − offset·Σ xq) · (scale · a)`, then `out += min · (a · float(Σ xq))` where minimums are
//! stored, with `u = level + offset ≥ 0` the stored unsigned level. Every kernel does these same f32 operations in
//! the same order, so the AVX2 and VNNI kernels equal the portable one bit for bit (the tests check it).
//!
//! Levels sit in the matmul's column panels ([`PANEL`] columns), grouped for the dot-product instruction: each
//! quad of 4 k steps holds 4 consecutive levels per column, `4 * j + t` for column `j` and step `t`. Levels of
//! 0..=15 take nibbles (column `j` in the low half of its byte, `j + PANEL / 2` in the high one); levels of 0..=63
//! (5- and 6-bit formats) nibbles plus their top two bits packed after them ([`Layout::Split`]); others bytes.

use rayon::prelude::*;
use std::sync::OnceLock;

use super::cpu_matmul::{for_column_chunks, int8_scale, level_range, pack_constants, padded_rows, quantize_int8, BlockConstants, Kernels, PANEL};
use crate::model::loader::{HostBlocks, HostTensor};

/// Activations are rounded to 8 bits with one scale per this many values of a row.
pub const ACTIVATION_GROUP: usize = 32;

/// k steps per dot-product lane: `vpdpbusd` sums 4 byte products into each i32.
const QUAD: usize = 4;

/// A weight matrix `[n, k]` in the `a8` format (see the module comment).
#[derive(Debug, Clone)]
pub struct A8Matrix {
    levels: Vec<u8>,
    layout: Layout,
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
        let (lowest, highest) = level_range(&blocks.levels);
        let (layout, offset) = match (lowest, highest) {
            (0.., ..=15) => (Layout::Nibbles, 0),
            (-8.., ..=7) => (Layout::Nibbles, 8),
            (0.., ..=63) => (Layout::Split, 0),
            (-32.., ..=31) => (Layout::Split, 32),
            (0.., _) => (Layout::Bytes, 0),
            _ => (Layout::Bytes, 128),
        };
        let levels = pack_levels(&blocks.levels, n, k, layout, offset);
        Some(A8Matrix { levels, layout, offset, constants: pack_constants(blocks, n, k), group: blocks.group, k })
    }

    pub fn bytes(&self) -> usize {
        self.levels.len() + self.constants.bytes()
    }

    /// Stored bytes of one quad of a panel: 32 columns of 4 levels.
    fn quad_bytes(&self) -> usize {
        self.layout.quad_bytes()
    }

    /// The stored bytes of quad `quad` of panel `panel`.
    fn quad(&self, panel: usize, quad: usize) -> &[u8] {
        &self.levels[(panel * self.k / QUAD + quad) * self.quad_bytes()..][..self.quad_bytes()]
    }

    /// The stored (unsigned) level of weight `(c, p)`.
    fn stored_level(&self, c: usize, p: usize) -> i32 {
        self.layout.level(self.quad(c / PANEL, p / QUAD), c % PANEL, p % QUAD) as i32
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

/// How stored levels are packed, by their range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// 0..=15: a nibble each, 64 bytes a quad.
    Nibbles,
    /// 0..=63: the low 4 bits as nibbles, then 32 bytes of their top 2 bits: byte `b` holds those of vector
    /// position `b` (bits 0-1) and `b + 32` (bits 2-3) of columns 0..16, and the same of columns 16..32 (bits 4-7),
    /// position `4 * (j % 16) + t` (96 bytes a quad, where bytes took 128).
    Split,
    /// A byte each, 128 bytes a quad.
    Bytes,
}

/// The layouts as the kernels' const generic parameters.
const NIBBLES: u8 = 0;
const SPLIT: u8 = 1;
const BYTES: u8 = 2;

impl Layout {
    /// The stored level of column `j` (of the panel) at step `t` of a quad's bytes `stored`.
    #[inline(always)]
    fn level(self, stored: &[u8], j: usize, t: usize) -> u8 {
        let (half, position) = (j / (PANEL / 2), QUAD * (j % (PANEL / 2)) + t);
        let low = (stored[position] >> (4 * half)) & 0x0F;
        match self {
            Layout::Bytes => stored[QUAD * j + t],
            Layout::Nibbles => low,
            Layout::Split => low | ((stored[PANEL * QUAD / 2 + position % 32] >> (2 * (position / 32) + 4 * half)) & 3) << 4,
        }
    }

    fn quad_bytes(self) -> usize {
        match self {
            Layout::Nibbles => PANEL * QUAD / 2,
            Layout::Split => PANEL * QUAD / 2 + PANEL * QUAD / 4,
            Layout::Bytes => PANEL * QUAD,
        }
    }
}

/// Q8_0's rounding: per 32 weights an f16 scale `max |w| / 127` and levels `round(w / scale)`.
fn round_to_8_bits(values: &[f32], n: usize, k: usize) -> HostBlocks {
    let groups = n * k / ACTIVATION_GROUP;
    let mut levels = vec![0i8; n * k];
    let mut scales = vec![0.0f32; groups];
    levels.par_chunks_mut(ACTIVATION_GROUP).zip(values.par_chunks(ACTIVATION_GROUP)).zip(scales.par_iter_mut()).for_each(|((levels, values), scale)| {
        *scale = half::f16::from_f32(int8_scale(values)).to_f32();
        for (q, &w) in levels.iter_mut().zip(values) {
            *q = quantize_int8(w, *scale);
        }
    });
    HostBlocks { group: ACTIVATION_GROUP, levels, scales, mins: vec![-0.0; groups], factors: None }
}

/// The row-major `[n, k]` `levels` plus `offset` in quads of 4 steps per column (see the module comment); rows
/// past `n` are level 0 (their constants are 0 too).
fn pack_levels(levels: &[i8], n: usize, k: usize, layout: Layout, offset: i32) -> Vec<u8> {
    let quad_bytes = layout.quad_bytes();
    let panel_bytes = quad_bytes * k / QUAD;
    let padding = vec![0i8; k];
    let row = |r: usize| if r < n { &levels[r * k..(r + 1) * k] } else { &padding[..] };
    let mut out = vec![0u8; padded_rows(n) / PANEL * panel_bytes];
    out.par_chunks_mut(panel_bytes).enumerate().for_each(|(panel, dst)| {
        let rows: [&[i8]; PANEL] = std::array::from_fn(|j| row(panel * PANEL + j));
        for (quad, stored) in dst.chunks_exact_mut(quad_bytes).enumerate() {
            for (j, levels) in rows.iter().enumerate() {
                let levels = &levels[quad * QUAD..(quad + 1) * QUAD];
                let unsigned = |t: usize| (levels[t] as i32 + offset) as u8;
                let half = j / (PANEL / 2);
                for t in 0..QUAD {
                    let (u, position) = (unsigned(t), QUAD * (j % (PANEL / 2)) + t);
                    match layout {
                        Layout::Bytes => stored[QUAD * j + t] = u,
                        Layout::Nibbles => stored[position] |= u << (4 * half),
                        Layout::Split => {
                            stored[position] |= (u & 0x0F) << (4 * half);
                            stored[PANEL * QUAD / 2 + position % 32] |= (u >> 4) << (2 * (position / 32) + 4 * half);
                        }
                    }
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

/// Which kernel runs an `a8` matmul: the best this CPU has, within what `STEPLLM_CPU_KERNELS` allows (see
/// `cpu_matmul::Kernels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum A8Kernel {
    /// Plain Rust: the reference, and the path of CPUs without AVX2.
    Portable,
    /// AVX2's byte multiply-adds into pairs of i16.
    Avx2,
    /// AVX-512 VNNI's `vpdpbusd`.
    Vnni,
}

impl A8Kernel {
    /// Chosen once: every matmul of a decode step asks.
    pub fn detect() -> A8Kernel {
        static CHOSEN: OnceLock<A8Kernel> = OnceLock::new();
        *CHOSEN.get_or_init(|| match Kernels::detect() {
            Kernels::Avx512 if x86::vnni_available() => A8Kernel::Vnni,
            Kernels::Avx512 | Kernels::Avx2 => A8Kernel::Avx2,
            Kernels::Portable => A8Kernel::Portable,
        })
    }

    /// Every kernel this CPU can run, slowest first (found once).
    pub fn supported() -> &'static [A8Kernel] {
        static ALL: OnceLock<Vec<A8Kernel>> = OnceLock::new();
        ALL.get_or_init(|| {
            let sets = Kernels::supported();
            let mut all = vec![A8Kernel::Portable];
            if sets.contains(&Kernels::Avx2) {
                all.push(A8Kernel::Avx2);
            }
            if sets.contains(&Kernels::Avx512) && x86::vnni_available() {
                all.push(A8Kernel::Vnni);
            }
            all
        })
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
        // SAFETY: as above; the CPU runs `kernel` (asserted) and the weight covers `..c1` (asserted).
        A8Kernel::Avx2 | A8Kernel::Vnni => unsafe { x86::columns(kernel, w, &rows, out, m, n, c0, c1) },
    });
}

/// Plain Rust: each panel's levels and constants are unpacked once (column-major, so each column's group is one
/// slice), and every row's group dot products multiply and sum i16 slices, which compilers vectorize. On x86 it is
/// the reference the SIMD kernels are checked against, on other CPUs their only kernel.
///
/// # Safety
/// `out` must be writable at `r * n + c` for r < m, c0 <= c < c1.
unsafe fn portable_columns(w: &A8Matrix, rows: &RoundedRows, out: *mut f32, m: usize, n: usize, c0: usize, c1: usize) {
    let (k, group, groups) = (w.k, w.group, w.k / w.group);
    let constants = w.constants.view();
    let has_mins = w.constants.has_mins();
    // Stored levels reach 255 and activations ±127: their products fit an i16.
    let activations: Vec<i16> = rows.levels.iter().map(|&x| x as i16).collect();
    let mut panel_levels = vec![0i16; PANEL * k];
    let mut panel_constants = vec![(0.0f32, 0.0f32); PANEL * groups];
    for c in (c0..c1).step_by(PANEL) {
        for quad in 0..k / QUAD {
            let stored = w.quad(c / PANEL, quad);
            for j in 0..PANEL {
                for t in 0..QUAD {
                    panel_levels[j * k + quad * QUAD + t] = w.layout.level(stored, j, t) as i16;
                }
            }
        }
        for (i, constant) in panel_constants.iter_mut().enumerate() {
            *constant = constants.get(c + i / groups, i % groups * group, k, group);
        }
        let columns = panel_levels.chunks_exact(k).zip(panel_constants.chunks_exact(groups)).take(c1 - c);
        for (j, (column_levels, column_constants)) in columns.enumerate() {
            for r in 0..m {
                let levels = &activations[r * k..(r + 1) * k];
                let mut acc = 0.0f32;
                for (g, &(scale, min)) in column_constants.iter().enumerate() {
                    let p0 = g * group;
                    let weights = &column_levels[p0..p0 + group];
                    let dot: i32 = weights.iter().zip(&levels[p0..p0 + group]).map(|(&u, &x)| (u * x) as i32).sum();
                    let sum = rows.sums[r * groups + g];
                    let a = rows.scales[(r * k + p0) / ACTIVATION_GROUP];
                    acc = ((dot - w.offset * sum) as f32).mul_add(scale * a, acc);
                    if has_mins {
                        acc = min.mul_add(a * sum as f32, acc);
                    }
                }
                *out.add(r * n + c + j) = acc;
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub fn vnni_available() -> bool {
        false
    }

    pub unsafe fn columns(_: super::A8Kernel, _: &super::A8Matrix, _: &super::RoundedRows, _: *mut f32, _: usize, _: usize, _: usize, _: usize) {
        unreachable!("x86 kernels off x86_64")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::cpu_matmul::{Constants, PANEL};
    use super::super::cpu_simd::{Avx2, Avx512, Factored, GroupConstants, Isa, Stored};
    use super::{A8Kernel, A8Matrix, Layout, RoundedRows, ACTIVATION_GROUP, BYTES, NIBBLES, QUAD, SPLIT};
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
        /// The first output column of the tile, and how many of its columns exist.
        column: usize,
        valid: usize,
        out: *mut f32,
        n: usize,
    }

    /// Columns `c0..c1` (`c0` a multiple of PANEL) of every row, with `kernel` (Vnni or Avx2).
    ///
    /// # Safety
    /// The CPU must run `kernel`; `w` must cover the panels of `..c1`; `out` writable at `r * n + c` for
    /// r < m, c0 <= c < c1.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn columns(kernel: A8Kernel, w: &A8Matrix, rows: &RoundedRows, out: *mut f32, m: usize, n: usize, c0: usize, c1: usize) {
        let at = Span { m, n, c0, c1 };
        match (kernel, w.constants.view()) {
            (A8Kernel::Vnni, Constants::F16 { scales, mins }) => vnni(w, Stored::new(scales, mins), rows, out, at),
            (A8Kernel::Vnni, Constants::F32 { scales, mins }) => vnni(w, Stored::new(scales, mins), rows, out, at),
            (A8Kernel::Vnni, Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group }) => {
                vnni(w, Factored::new(scale_factors, scale_steps, min_factors, min_steps, super_group), rows, out, at)
            }
            (_, Constants::F16 { scales, mins }) => avx2(w, Stored::new(scales, mins), rows, out, at),
            (_, Constants::F32 { scales, mins }) => avx2(w, Stored::new(scales, mins), rows, out, at),
            (_, Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group }) => {
                avx2(w, Factored::new(scale_factors, scale_steps, min_factors, min_steps, super_group), rows, out, at)
            }
        }
    }

    #[derive(Clone, Copy)]
    struct Span {
        m: usize,
        n: usize,
        c0: usize,
        c1: usize,
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn vnni<S: GroupConstants>(w: &A8Matrix, constants: S, rows: &RoundedRows, out: *mut f32, at: Span) {
        tiles::<Vnni, S>(w, constants, rows, out, at)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<S: GroupConstants>(w: &A8Matrix, constants: S, rows: &RoundedRows, out: *mut f32, at: Span) {
        tiles::<Avx2Dot, S>(w, constants, rows, out, at)
    }

    /// An instruction set's tiles: `COLUMNS` output columns of up to a few rows each.
    trait Dot {
        const COLUMNS: usize;
        /// Tiles over the next `rows` (or fewer) rows from `row`; returns how many rows it did.
        unsafe fn tile<S: GroupConstants>(t: &Tile<S>, row: usize, rows: usize, layout: Layout) -> usize;
    }

    #[inline(always)]
    unsafe fn tiles<D: Dot, S: GroupConstants>(w: &A8Matrix, constants: S, rows: &RoundedRows, out: *mut f32, at: Span) {
        let panel_bytes = w.quad_bytes() * w.k / QUAD;
        let mut row0 = 0;
        while row0 < at.m {
            let row_end = (row0 + ROW_PANEL).min(at.m);
            let mut c = at.c0;
            while c < at.c1 {
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
                    valid: (at.c1 - c).min(D::COLUMNS),
                    out,
                    n: at.n,
                };
                let mut r = row0;
                while r < row_end {
                    r += D::tile(&tile, r, row_end - r, w.layout);
                }
                c += D::COLUMNS;
            }
            row0 = row_end;
        }
    }

    impl<S: GroupConstants> Tile<'_, S> {
        /// The quad of k step `p` (4 levels per column), prefetching ahead.
        #[inline(always)]
        unsafe fn quad(&self, p: usize) -> *const u8 {
            let at = self.panel.add(p / QUAD * self.quad_bytes);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES).cast());
            if self.quad_bytes > 64 {
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES + 64).cast());
            }
            at
        }

        /// Row `i`'s 4 activation levels at k step `p`, in every 32-bit lane.
        #[inline(always)]
        unsafe fn activations(&self, i: usize, p: usize) -> i32 {
            self.rows.levels.as_ptr().add(i * self.k + p).cast::<i32>().read_unaligned()
        }

        /// The scales and minimums of the group at `p0`, for N vectors of columns from `column`.
        #[inline(always)]
        unsafe fn constants<I: Isa, const N: usize>(&self, p0: usize, column: usize) -> [(I::V, I::V); N] {
            // A loop, not `array::from_fn`: its closure would not be inlined into the kernel's target features.
            let mut constants = [(I::zero(), I::zero()); N];
            for (v, c) in constants.iter_mut().enumerate() {
                *c = self.constants.get::<I>(column + v * I::LANES, p0, self.k, self.group);
            }
            constants
        }

        /// Σ xq of row `i` over the group at `p0`.
        #[inline(always)]
        fn level_sum(&self, i: usize, p0: usize) -> i32 {
            self.rows.sums[i * (self.k / self.group) + p0 / self.group]
        }

        /// What the stored levels' offset added to row `i`'s integer dot products of the group at `p0`.
        #[inline(always)]
        fn offset_part(&self, i: usize, p0: usize) -> i32 {
            self.offset * self.level_sum(i, p0)
        }

        /// Fold the group at `p0` of row `i` into `acc`, its f32 sums of columns with these `(scale, min)`: the
        /// module comment's two steps, `dot` being the group's integer dot products, offset taken off, as f32.
        #[inline(always)]
        unsafe fn fold<I: Isa<V = V>, V: Copy>(&self, i: usize, p0: usize, (scale, min): (V, V), dot: V, acc: V) -> V {
            let sum = self.level_sum(i, p0);
            let a = self.rows.scales[(i * self.k + p0) / ACTIVATION_GROUP];
            let acc = I::fma(dot, I::mul(scale, I::splat(a)), acc);
            if self.has_mins {
                I::fma(min, I::splat(a * sum as f32), acc)
            } else {
                acc
            }
        }

        /// Store row `i`'s sums of `LANES` columns from `column` (clipped to the tile's valid columns).
        #[inline(always)]
        unsafe fn store<I: Isa>(&self, i: usize, column: usize, sums: I::V) {
            let count = (self.column + self.valid).saturating_sub(column).min(I::LANES);
            I::store_first(self.out.add(i * self.n + column), sums, count);
        }
    }

    /// AVX-512 VNNI: a whole panel (two vectors of 16 columns) per tile, `vpdpbusd` summing 4 products per lane.
    struct Vnni;

    impl Dot for Vnni {
        const COLUMNS: usize = PANEL;

        #[inline(always)]
        unsafe fn tile<S: GroupConstants>(t: &Tile<S>, row: usize, rows: usize, layout: Layout) -> usize {
            match layout {
                Layout::Nibbles => t.vnni_rows::<NIBBLES>(row, rows),
                Layout::Split => t.vnni_rows::<SPLIT>(row, rows),
                Layout::Bytes => t.vnni_rows::<BYTES>(row, rows),
            }
        }
    }

    impl<S: GroupConstants> Tile<'_, S> {
        #[inline(always)]
        unsafe fn vnni_rows<const L: u8>(&self, row: usize, rows: usize) -> usize {
            match rows {
                6.. => self.vnni::<6, 1, L>(row),
                5 => self.vnni::<5, 1, L>(row),
                4 => self.vnni::<4, 1, L>(row),
                3 => self.vnni::<3, 1, L>(row),
                2 => self.vnni::<2, 2, L>(row),
                _ => self.vnni::<1, 2, L>(row),
            }
        }

        /// The panel's two vectors of 16 columns of the quad at `at`, as unsigned bytes.
        #[inline(always)]
        unsafe fn vnni_weights<const L: u8>(at: *const u8) -> (__m512i, __m512i) {
            if L == BYTES {
                return (_mm512_loadu_si512(at.cast()), _mm512_loadu_si512(at.add(64).cast()));
            }
            let bytes = _mm512_loadu_si512(at.cast());
            let low = _mm512_set1_epi8(0x0F);
            let (w0, w1) = (_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low));
            if L == NIBBLES {
                return (w0, w1);
            }
            // Both halves of the register see the 32 bytes of top bits; the first half takes bits 0-1 (4-5 for
            // the second vector) of each, the second half bits 2-3 (6-7), moved to bits 4-5 of the byte.
            let top = _mm512_broadcast_i64x4(_mm256_loadu_si256(at.add(64).cast()));
            let shifts = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
            let bits = _mm512_set1_epi8(0x30);
            let top0 = _mm512_and_si512(_mm512_sllv_epi16(top, shifts), bits);
            let top1 = _mm512_and_si512(_mm512_sllv_epi16(_mm512_srli_epi16::<4>(top), shifts), bits);
            (_mm512_or_si512(w0, top0), _mm512_or_si512(w1, top1))
        }

        /// Rows `row..row + R`; U independent sums per output (short tiles) keep enough dot products in flight.
        #[inline(always)]
        unsafe fn vnni<const R: usize, const U: usize, const L: u8>(&self, row: usize) -> usize {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p0 in (0..self.k).step_by(self.group) {
                let mut dots = [[[_mm512_setzero_si512(); U]; 2]; R];
                for p in (p0..p0 + self.group).step_by(U * QUAD) {
                    for u in 0..U {
                        let (w0, w1) = Self::vnni_weights::<L>(self.quad(p + u * QUAD));
                        for (i, dots) in dots.iter_mut().enumerate() {
                            let x = _mm512_set1_epi32(self.activations(row + i, p + u * QUAD));
                            dots[0][u] = _mm512_dpbusd_epi32(dots[0][u], w0, x);
                            dots[1][u] = _mm512_dpbusd_epi32(dots[1][u], w1, x);
                        }
                    }
                }
                let constants = self.constants::<Avx512, 2>(p0, self.column);
                for (i, acc) in acc.iter_mut().enumerate() {
                    for (v, acc) in acc.iter_mut().enumerate() {
                        let dot = dots[i][v][1..].iter().fold(dots[i][v][0], |d, part| _mm512_add_epi32(d, *part));
                        let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_set1_epi32(self.offset_part(row + i, p0))));
                        *acc = self.fold::<Avx512, _>(row + i, p0, constants[v], dot, *acc);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for (v, sums) in acc.iter().enumerate() {
                    self.store::<Avx512>(row + i, self.column + 16 * v, *sums);
                }
            }
            R
        }
    }

    /// AVX2: half a panel (two vectors of 8 columns) per tile. `vpmaddubsw` multiplies unsigned levels by signed
    /// activations into pairs of i16, `vpmaddwd` sums those pairs into the 4-product lane sums VNNI would give.
    /// 4-bit levels sum in i16 over a whole group (8 quads of at most 2 × 15 × 127 each fit), 6-bit ones in i32 after
    /// every quad; 8-bit levels stored
    /// with offset 128 would overflow a pair, so they multiply as signed levels (their magnitude by the
    /// activation's sign-adjusted value), which leaves no offset to take off.
    struct Avx2Dot;

    impl Dot for Avx2Dot {
        const COLUMNS: usize = PANEL;

        #[inline(always)]
        unsafe fn tile<S: GroupConstants>(t: &Tile<S>, row: usize, rows: usize, layout: Layout) -> usize {
            match (layout, t.offset) {
                (Layout::Nibbles, _) => t.avx2_rows::<NIBBLES, false>(row, rows),
                (Layout::Split, _) => t.avx2_rows::<SPLIT, false>(row, rows),
                (Layout::Bytes, 128) => t.avx2_rows::<BYTES, true>(row, rows),
                (Layout::Bytes, _) => t.avx2_rows::<BYTES, false>(row, rows),
            }
        }
    }

    impl<S: GroupConstants> Tile<'_, S> {
        /// Columns `16 * half..16 * half + 16` of the quad at `at`, as two vectors of unsigned bytes.
        #[inline(always)]
        unsafe fn avx2_weights<const L: u8>(at: *const u8, half: usize) -> [__m256i; 2] {
            if L == BYTES {
                let at = at.add(64 * half);
                return [_mm256_loadu_si256(at.cast()), _mm256_loadu_si256(at.add(32).cast())];
            }
            let shift = _mm_cvtsi32_si128(4 * half as i32);
            let low = _mm256_set1_epi8(0x0F);
            let nibbles = |at: *const u8| _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(at.cast()), shift), low);
            let (w0, w1) = (nibbles(at), nibbles(at.add(32)));
            if L == NIBBLES {
                return [w0, w1];
            }
            // The first vector (positions 0..32) takes bits 0-1 of each top byte, the second bits 2-3 (4-7 for
            // the panel's second half), moved to bits 4-5.
            let top = _mm256_srl_epi16(_mm256_loadu_si256(at.add(64).cast()), shift);
            let bits = _mm256_set1_epi8(0x30);
            let top0 = _mm256_and_si256(_mm256_slli_epi16::<4>(top), bits);
            let top1 = _mm256_and_si256(_mm256_slli_epi16::<2>(top), bits);
            [_mm256_or_si256(w0, top0), _mm256_or_si256(w1, top1)]
        }

        /// One row takes the whole panel (4 vectors of 8 columns) per tile, so each quad is unpacked once; two
        /// rows take it in halves, which is what 16 registers hold.
        #[inline(always)]
        unsafe fn avx2_rows<const L: u8, const SIGNED: bool>(&self, row: usize, rows: usize) -> usize {
            if rows == 1 {
                self.avx2::<1, 4, L, SIGNED>(row, 0)
            } else {
                self.avx2::<2, 2, L, SIGNED>(row, 0);
                self.avx2::<2, 2, L, SIGNED>(row, 1)
            }
        }

        /// Rows `row..row + R` of V vectors of 8 columns from the panel's half `half0`.
        #[inline(always)]
        unsafe fn avx2<const R: usize, const V: usize, const L: u8, const SIGNED: bool>(&self, row: usize, half0: usize) -> usize {
            debug_assert!(self.offset == 128 || !SIGNED);
            let column = self.column + half0 * PANEL / 2;
            let ones = _mm256_set1_epi16(1);
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            for p0 in (0..self.k).step_by(self.group) {
                let mut dots = [[_mm256_setzero_si256(); V]; R];
                for p in (p0..p0 + self.group).step_by(QUAD) {
                    let at = self.quad(p);
                    let mut weights = [_mm256_setzero_si256(); V];
                    for (h, pair) in weights.chunks_exact_mut(2).enumerate() {
                        pair.copy_from_slice(&Self::avx2_weights::<L>(at, half0 + h));
                    }
                    for (i, dots) in dots.iter_mut().enumerate() {
                        let x = _mm256_set1_epi32(self.activations(row + i, p));
                        for (dot, w) in dots.iter_mut().zip(weights) {
                            *dot = if L == NIBBLES {
                                _mm256_add_epi16(*dot, _mm256_maddubs_epi16(w, x))
                            } else if SIGNED {
                                let level = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
                                let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(level), _mm256_sign_epi8(x, level));
                                _mm256_add_epi32(*dot, _mm256_madd_epi16(pairs, ones))
                            } else {
                                _mm256_add_epi32(*dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones))
                            };
                        }
                    }
                }
                let constants = self.constants::<Avx2, V>(p0, column);
                for (i, acc) in acc.iter_mut().enumerate() {
                    for (v, acc) in acc.iter_mut().enumerate() {
                        let dot = if L == NIBBLES { _mm256_madd_epi16(dots[i][v], ones) } else { dots[i][v] };
                        // Signed levels were multiplied as they are: the offset is already off.
                        let offset_part = if SIGNED { 0 } else { self.offset_part(row + i, p0) };
                        let dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, _mm256_set1_epi32(offset_part)));
                        *acc = self.fold::<Avx2, _>(row + i, p0, constants[v], dot, *acc);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for (v, sums) in acc.iter().enumerate() {
                    self.store::<Avx2>(row + i, column + 8 * v, *sums);
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

    /// The layout each type's levels take: 4-bit ones nibbles, 5- and 6-bit ones split, IQ4's codebook and 8-bit
    /// ones bytes.
    fn layout_of(ty: GgmlType) -> Layout {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K => Layout::Nibbles,
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K | GgmlType::Q6_K => Layout::Split,
            _ => Layout::Bytes,
        }
    }

    #[test]
    fn rows_come_back_as_the_files_values() {
        for ty in TYPES {
            let host = quantized(ty, 40, 512, 3);
            let matrix = A8Matrix::pack(&host, 40, 512).unwrap();
            assert_eq!(matrix.layout, layout_of(ty), "{ty:?}");
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
        assert!(!cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("avx2") || kernels.contains(&A8Kernel::Avx2));
        assert!(!cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("avx512vnni") || kernels.contains(&A8Kernel::Vnni));
        for ty in TYPES {
            for (m, n) in SHAPES {
                let matrix = A8Matrix::pack(&quantized(ty, n, 512, m as u64), n, 512).unwrap();
                let x = activations(m, 512, n as u64);
                let mut expected = vec![f32::NAN; m * n];
                matmul_with(A8Kernel::Portable, &x, &matrix, &mut expected, m, n);
                for &kernel in kernels {
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
        assert!(matrix.layout == Layout::Bytes && matrix.offset == 128 && matrix.group == 32);
        let mut row = vec![0.0; k];
        for r in 0..n {
            matrix.row_to_f32(r, &mut row);
            for (p, (a, b)) in row.iter().zip(&data[r * k..]).enumerate() {
                let amax = data[r * k + p / 32 * 32..][..32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((a - b).abs() <= amax / 127.0 * 0.51, "row {r} [{p}]: {a} vs {b}");
            }
        }
        for &kernel in A8Kernel::supported() {
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
        for &kernel in A8Kernel::supported() {
            let mut out = vec![0.0; 16];
            matmul_with(kernel, &x, &matrix, &mut out, 2, 8);
            assert!(out[..8].iter().all(|v| v.is_nan()), "{kernel:?}: {:?}", &out[..8]);
            assert!(out[8..].iter().all(|v| v.is_finite()), "{kernel:?}: the other row is untouched");
        }
    }
}
