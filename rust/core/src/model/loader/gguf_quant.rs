//! ggml tensor types and their dequantization to f32, through the integer levels, scales and minimums of their
//! blocks ([`HostBlocks`]).
//!
//! Block layouts and arithmetic follow ggml's reference `dequantize_row_*` (ggml-quants.c), so results are
//! bit-identical to llama.cpp's and gguf-py's. All multi-byte fields are little-endian.

use super::{Factors, HostBlocks, PAR_CHUNK};
use crate::error::{load_err, Result};
use half::f16;
use rayon::prelude::*;

/// Elements in a K-quant super-block.
const QK_K: usize = 256;
/// Roughly how many output floats one rayon task produces: big enough to amortize scheduling.
const ELEMENTS_PER_TASK: usize = 1 << 16;

/// A ggml tensor type as stored in a GGUF tensor directory. Every type a GGUF file may hold is listed so
/// that a file can be opened (and its sizes checked) even when some tensors are in a type we cannot
/// dequantize yet; `dequantize` reports those by name.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, ggml id, name, elements per block, bytes per block), from ggml's type traits.
const TYPE_TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type for a ggml type id, or None for ids that never appear in model files (or are unknown).
    pub fn from_id(id: u32) -> Option<Self> {
        TYPE_TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TYPE_TABLE.iter().find(|row| row.0 == self).expect("every GgmlType has a TYPE_TABLE row")
    }

    pub fn id(self) -> u32 {
        self.row().1
    }

    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block; a tensor's innermost dimension must be a multiple of it.
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }

    /// Whether `dequantize` handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16) || self.quantized().is_some()
    }

    /// Bytes taken by `n_elements` elements, or None when that is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size() as u64)
    }

    /// How a quantized type we read decodes: elements per scale and minimum, and the block decoder.
    fn quantized(self) -> Option<(usize, DecodeBlock)> {
        use GgmlType::*;
        Some(match self {
            Q8_0 => (32, block_q8_0),
            Q4_0 => (32, block_q4_0),
            Q4_1 => (32, block_q4_1),
            Q5_0 => (32, block_q5_0),
            Q5_1 => (32, block_q5_1),
            Q2_K => (16, block_q2_k),
            Q3_K => (16, block_q3_k),
            Q4_K => (32, block_q4_k),
            Q5_K => (32, block_q5_k),
            Q6_K => (16, block_q6_k),
            IQ4_NL => (32, block_iq4_nl),
            IQ4_XS => (32, block_iq4_xs),
            _ => return None,
        })
    }
}

/// A K-quant super-block's factors: (d, -dmin), with -0.0 for a format that subtracts no minimum.
type FactorReader = fn(&[u8]) -> (f32, f32);

impl GgmlType {
    /// How to read the factors of a super-block whose constants are integer multiples of them.
    fn factors(self) -> Option<FactorReader> {
        use GgmlType::*;
        Some(match self {
            Q2_K => |b| (f16_at(b, 80), -f16_at(b, 82)),
            Q3_K => |b| (f16_at(b, 108), -0.0),
            Q4_K | Q5_K => |b| (f16_at(b, 0), -f16_at(b, 2)),
            Q6_K => |b| (f16_at(b, 208), -0.0),
            IQ4_XS => |b| (f16_at(b, 0), -0.0),
            _ => return None,
        })
    }
}

/// A block decoder: one block's bytes to its integer levels and, per group of elements, a scale and a minimum
/// (see [`HostBlocks`]).
type DecodeBlock = fn(&[u8], &mut [i8], &mut [f32], &mut [f32]);

/// Dequantize `n_elements` values of type `ty` from `data` (exactly their bytes) to f32, in storage order; for a
/// quantized type also the integer levels, scales and minimums they are made of.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<(Vec<f32>, Option<HostBlocks>)> {
    decode(ty, data, n_elements, true)
}

/// [`dequantize`], leaving a quantized tensor's floats out (an empty Vec) when `floats` is false: its blocks
/// carry them (`HostTensor::values`), and a backend that keeps the blocks never needs them.
pub fn decode(ty: GgmlType, data: &[u8], n_elements: usize, floats: bool) -> Result<(Vec<f32>, Option<HostBlocks>)> {
    let float = |decode: fn(&[u8]) -> f32| -> Result<(Vec<f32>, Option<HostBlocks>)> {
        check_size(ty, data, n_elements)?;
        Ok((data.par_chunks_exact(ty.type_size()).map(decode).collect(), None))
    };
    match ty {
        GgmlType::F32 => float(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => float(|b| f16_at(b, 0)),
        // bf16 is the top half of an f32; shifting (not a library conversion) keeps NaN payloads as ggml does.
        GgmlType::BF16 => float(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        _ => match ty.quantized() {
            Some((group, decode)) => {
                let (values, mut blocks) = decode_blocks(ty, data, n_elements, group, decode, floats)?;
                blocks.factors = ty.factors().and_then(|read| factor_blocks(ty, data, &blocks, read));
                Ok((values, Some(blocks)))
            }
            None => load_err(format!(
                "cannot dequantize ggml type {}: stepllm reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, \
                 Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS",
                ty.name()
            )),
        },
    }
}

fn check_size(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<()> {
    let block_size = ty.block_size();
    if !n_elements.is_multiple_of(block_size) {
        return load_err(format!("{n_elements} elements are not a whole number of {} blocks of {block_size}", ty.name()));
    }
    let needed = n_elements / block_size * ty.type_size();
    if data.len() != needed {
        return load_err(format!(
            "{} tensor of {n_elements} elements needs {needed} bytes, got {}",
            ty.name(),
            data.len()
        ));
    }
    Ok(())
}

/// Run a block decoder over all blocks, in parallel over large chunks; returns the f32 values and the blocks.
fn decode_blocks(
    ty: GgmlType,
    data: &[u8],
    n_elements: usize,
    group: usize,
    decode: DecodeBlock,
    floats: bool,
) -> Result<(Vec<f32>, HostBlocks)> {
    check_size(ty, data, n_elements)?;
    let (block_size, type_size) = (ty.block_size(), ty.type_size());
    let mut blocks = HostBlocks {
        group,
        levels: vec![0; n_elements],
        scales: vec![0.0; n_elements / group],
        mins: vec![0.0; n_elements / group],
        factors: None,
    };
    let blocks_per_task = (ELEMENTS_PER_TASK / block_size).max(1);
    let groups_per_block = block_size / group;
    blocks
        .levels
        .par_chunks_mut(blocks_per_task * block_size)
        .zip(blocks.scales.par_chunks_mut(blocks_per_task * groups_per_block))
        .zip(blocks.mins.par_chunks_mut(blocks_per_task * groups_per_block))
        .zip(data.par_chunks(blocks_per_task * type_size))
        .for_each(|(((levels, scales), mins), bytes)| {
            let each = levels
                .chunks_exact_mut(block_size)
                .zip(scales.chunks_exact_mut(groups_per_block))
                .zip(mins.chunks_exact_mut(groups_per_block))
                .zip(bytes.chunks_exact(type_size));
            for (((levels, scales), mins), bytes) in each {
                decode(bytes, levels, scales, mins);
            }
        });
    let values = if floats { blocks.values() } else { Vec::new() };
    Ok((values, blocks))
}

/// The blocks' constants as super-block factors times integer steps, or None where one is not exactly that.
fn factor_blocks(ty: GgmlType, data: &[u8], blocks: &HostBlocks, read: FactorReader) -> Option<Factors> {
    let per_super = ty.block_size() / blocks.group;
    let (scale_factors, min_factors): (Vec<f32>, Vec<f32>) = data.par_chunks_exact(ty.type_size()).map(read).unzip();
    // Chunks, not elements, in parallel: a per-element Option collect costs more than step_of itself.
    let steps = |values: &[f32], factors: &[f32]| -> Option<Vec<i8>> {
        let mut steps = vec![0i8; values.len()];
        let exact = steps.par_chunks_mut(PAR_CHUNK).zip(values.par_chunks(PAR_CHUNK)).enumerate().all(|(chunk, (steps, values))| {
            steps.iter_mut().zip(values).enumerate().all(|(i, (s, &v))| {
                step_of(v, factors[(chunk * PAR_CHUNK + i) / per_super]).map(|step| *s = step).is_some()
            })
        });
        exact.then_some(steps)
    };
    let scale_steps = steps(&blocks.scales, &scale_factors)?;
    let min_steps = steps(&blocks.mins, &min_factors)?;
    Some(Factors { per_super, scale_factors, scale_steps, min_factors, min_steps })
}

/// The integer `s` with `factor * s` equal to `value` bit for bit (a zero factor may need -1 for a -0.0).
fn step_of(value: f32, factor: f32) -> Option<i8> {
    let exact = |s: f32| (-128.0..=127.0).contains(&s) && (factor * s).to_bits() == value.to_bits();
    let guess = if factor == 0.0 { 0.0 } else { (value / factor).round() };
    // The guess nearly always holds; ±1 covers a zero factor's signed zeros.
    if exact(guess) {
        return Some(guess as i8);
    }
    [-1.0, 1.0].into_iter().find(|&s| exact(s)).map(|s| s as i8)
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

// The decoders below follow ggml's reference `dequantize_row_*`, which computes each element as an integer level
// times a scale, minus a minimum or not. The scale is an f16 value, or one times a small integer, so the product
// with the level is exact in f32 (at most 24 significant bits), and `fma(level, scale, min)` rounds once, as
// ggml's expression does. Where ggml subtracts no minimum, the minimum is -0.0: `fma(q, d, -0.0)` is `q * d`
// exactly, the sign of a zero product included.

/// Q8_0: f16 scale d, 32 signed bytes; x = q * d.
fn block_q8_0(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), -0.0);
    levels.iter_mut().zip(&b[2..34]).for_each(|(l, &q)| *l = q as i8);
}

/// 4-bit values: byte j holds element j in its low nibble and element j + 16 in its high one.
fn nibbles(qs: &[u8], levels: &mut [i8], offset: i8) {
    for (j, &q) in qs[..16].iter().enumerate() {
        levels[j] = (q & 0x0F) as i8 - offset;
        levels[j + 16] = (q >> 4) as i8 - offset;
    }
}

/// Q4_0: f16 scale d, 16 bytes of nibbles; x = (q - 8) * d.
fn block_q4_0(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), -0.0);
    nibbles(&b[2..18], levels, 8);
}

/// Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles; x = q * d + m.
fn block_q4_1(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), f16_at(b, 2));
    nibbles(&b[4..20], levels, 0);
}

/// Nibbles as [`nibbles`] plus a fifth bit: bit j of the little-endian u32 `qh` for element j (0..32).
fn five_bits(qh: &[u8], qs: &[u8], levels: &mut [i8], offset: i8) {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    nibbles(qs, levels, 0);
    for (j, l) in levels[..32].iter_mut().enumerate() {
        *l = (*l | (((high >> j) & 1) << 4) as i8) - offset;
    }
}

/// Q5_0: f16 scale d, 4 bytes of fifth bits, 16 bytes of nibbles; x = (q - 16) * d.
fn block_q5_0(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), -0.0);
    five_bits(&b[2..6], &b[6..22], levels, 16);
}

/// Q5_1: f16 scale d, f16 minimum m, 4 bytes of fifth bits, 16 bytes of nibbles; x = q * d + m.
fn block_q5_1(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), f16_at(b, 2));
    five_bits(&b[4..8], &b[8..24], levels, 0);
}

/// The 2-bit field of a K-quant super-block's element `e` (0..256) from 64 bytes `qs`: each 128-element half
/// reads 32 bytes, and its four runs of 32 elements take bit pairs 0-1, 2-3, 4-5, 6-7 of those bytes in turn.
fn two_bits(qs: &[u8], e: usize) -> u8 {
    let (half, run, l) = (e / 128, e % 128 / 32, e % 32);
    (qs[32 * half + l] >> (2 * run)) & 3
}

/// Q2_K super-block: 16 scale bytes (low nibble the scale, high nibble the minimum of each group of 16), 64 bytes
/// of 2-bit values, f16 d and dmin; x = d*scale*q - dmin*min.
fn block_q2_k(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for g in 0..QK_K / 16 {
        scales[g] = d * (b[g] & 0x0F) as f32;
        mins[g] = -(dmin * (b[g] >> 4) as f32);
    }
    levels.iter_mut().enumerate().for_each(|(e, l)| *l = two_bits(&b[16..80], e) as i8);
}

/// Q3_K's signed 6-bit scale of group `g` (0..16) from its 12 packed scale bytes: groups 0-3 and 4-7 take the
/// low nibbles of bytes 0-3 and 4-7, groups 8-11 and 12-15 their high nibbles, and each its top two bits from
/// bytes 8-11 (bit pair g / 4 of byte 8 + g % 4).
fn q3_k_scale(packed: &[u8], g: usize) -> i8 {
    let (row, j) = (g / 4, g % 4);
    let byte = packed[j + 4 * (row % 2)];
    let low = if row < 2 { byte & 0x0F } else { byte >> 4 };
    let high = (packed[8 + j] >> (2 * row)) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Q3_K super-block: 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, f16 d. Run r
/// (0..8, 32 elements) takes bit r of the high-bit byte at its element's position in the run; a clear bit
/// subtracts 4. x = d*scale*q.
fn block_q3_k(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    let d = f16_at(b, 108);
    for g in 0..QK_K / 16 {
        scales[g] = d * q3_k_scale(&b[96..108], g) as f32;
        mins[g] = -0.0;
    }
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    for (e, l) in levels.iter_mut().enumerate() {
        let high_bit_set = (hmask[e % 32] >> (e / 32)) & 1 == 1;
        *l = two_bits(qs, e) as i8 - if high_bit_set { 0 } else { 4 };
    }
}

/// The 6-bit (scale, min) pair of sub-block `j` (0..8) from Q4_K/Q5_K's 12 packed scale bytes: bytes 0..4
/// hold scales 0..4 and bytes 4..8 mins 0..4 in their low 6 bits; sub-blocks 4..8 take their low 4 bits
/// from bytes 8..12 and their top 2 bits from the spare top bits of bytes 0..8.
fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let scale = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (scale, min)
    }
}

/// Q4_K/Q5_K's eight sub-block constants: d*scale and -(dmin*min).
fn k_constants(b: &[u8], scales: &mut [f32], mins: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..QK_K / 32 {
        let (scale, min) = k_scale_min(&b[4..16], j);
        scales[j] = d * scale as f32;
        mins[j] = -(dmin * min as f32);
    }
}

/// The 4-bit field of a Q4_K/Q5_K super-block's element `e`: each 32-byte run of `qs` feeds two sub-blocks of 32,
/// low nibbles then high.
fn k_nibble(qs: &[u8], e: usize) -> u8 {
    let byte = qs[32 * (e / 64) + e % 32];
    if e % 64 < 32 {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// Q4_K super-block: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles; eight sub-blocks of 32;
/// x = d*scale*q - dmin*min.
fn block_q4_k(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    k_constants(b, scales, mins);
    // k_nibble's order, a 32-byte run (two sub-blocks) at a time, so the loops vectorize.
    for (run, out) in b[16..144].chunks_exact(32).zip(levels.chunks_exact_mut(64)) {
        let (low, high) = out.split_at_mut(32);
        for ((&q, l), h) in run.iter().zip(low).zip(high) {
            *l = (q & 0x0F) as i8;
            *h = (q >> 4) as i8;
        }
    }
}

/// Q5_K super-block: as Q4_K plus 32 bytes `qh` whose bit j of byte l is the fifth bit of element l of
/// sub-block j.
fn block_q5_k(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    k_constants(b, scales, mins);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (e, l) in levels.iter_mut().enumerate() {
        *l = (k_nibble(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4)) as i8;
    }
}

/// Q6_K super-block: 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16 signed 8-bit scales
/// (one per 16 elements), f16 d. Each 128-element half uses 64 bytes of ql and 32 of qh: element l+32s
/// (s in 0..4) takes a nibble of ql[l] or ql[l+32] and bits 2s..2s+2 of qh[l]; x = d*scale*(q - 32).
fn block_q6_k(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    let d = f16_at(b, 208);
    for g in 0..QK_K / 16 {
        scales[g] = d * (b[192 + g] as i8) as f32;
        mins[g] = -0.0;
    }
    // Element 128 half + 32 s + i, a run of 32 at a time so the loops vectorize.
    for (half, out) in levels.chunks_exact_mut(128).enumerate() {
        let (ql, qh) = (&b[64 * half..64 * half + 64], &b[128 + 32 * half..160 + 32 * half]);
        for (s, run) in out.chunks_exact_mut(32).enumerate() {
            let (nibbles, shift) = (&ql[32 * (s % 2)..32 * (s % 2) + 32], 4 * (s / 2));
            for ((l, &q), &h) in run.iter_mut().zip(nibbles).zip(qh) {
                let (low, high) = ((q >> shift) & 0x0F, (h >> (2 * s)) & 3);
                *l = (low | (high << 4)) as i8 - 32;
            }
        }
    }
}

/// The 16 levels of IQ4_NL and IQ4_XS: a 4-bit index picks one.
const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// 16 bytes of IQ4 indices for 32 elements, laid out as [`nibbles`].
fn iq4_levels(qs: &[u8], levels: &mut [i8]) {
    for (j, &q) in qs[..16].iter().enumerate() {
        levels[j] = IQ4_LEVELS[(q & 0x0F) as usize];
        levels[j + 16] = IQ4_LEVELS[(q >> 4) as usize];
    }
}

/// IQ4_NL: f16 scale d, 16 bytes of indices; x = d * IQ4_LEVELS[index].
fn block_iq4_nl(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    (scales[0], mins[0]) = (f16_at(b, 0), -0.0);
    iq4_levels(&b[2..18], levels);
}

/// IQ4_XS super-block: f16 d, u16 of high scale bits, 4 bytes of low scale nibbles, 128 bytes of indices; sub-block
/// j (of 32) has the 6-bit scale (nibble j of the low bytes) | (bits 2j..2j+2 of the u16) << 4, minus 32;
/// x = d*scale*IQ4_LEVELS[index].
fn block_iq4_xs(b: &[u8], levels: &mut [i8], scales: &mut [f32], mins: &mut [f32]) {
    let d = f16_at(b, 0);
    let high = u16::from_le_bytes([b[2], b[3]]);
    for j in 0..QK_K / 32 {
        let low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
        let scale = (low | ((((high >> (2 * j)) & 3) as u8) << 4)) as i32 - 32;
        scales[j] = d * scale as f32;
        mins[j] = -0.0;
        iq4_levels(&b[8 + 16 * j..24 + 16 * j], &mut levels[32 * j..32 * j + 32]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for row in TYPE_TABLE {
            assert_eq!(GgmlType::from_id(row.1), Some(row.0));
            assert_eq!(row.0.id(), row.1);
        }
        assert_eq!(GgmlType::from_id(9), None, "Q8_1 is a compute-only type");
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn size_mismatch_is_an_error_not_a_panic() {
        assert!(dequantize(GgmlType::Q4_K, &[0u8; 143], 256).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], 31).is_err());
        assert!(dequantize(GgmlType::Q5_0, &[0u8; 21], 32).is_err());
        assert!(dequantize(GgmlType::IQ2_XXS, &[0u8; 66], 256).is_err(), "not a type we read");
        assert_eq!(dequantize(GgmlType::Q8_0, &[], 0).unwrap().0, Vec::<f32>::new());
    }
}
