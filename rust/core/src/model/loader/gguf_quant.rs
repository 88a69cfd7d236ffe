//! ggml tensor types and their dequantization to f32.
//!
//! Block layouts and arithmetic follow ggml's reference `dequantize_row_*` (ggml-quants.c): the same
//! products in the same order, so results are bit-identical to llama.cpp's and gguf-py's. All multi-byte
//! fields are little-endian.

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
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4_K | Q5_K | Q6_K)
    }

    /// Bytes taken by `n_elements` elements, or None when that is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size() as u64)
    }
}

/// Dequantize `n_elements` values of type `ty` from `data` (exactly their bytes) to f32, in storage order.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    match ty {
        GgmlType::F32 => run_blocks(ty, data, n_elements, block_f32),
        GgmlType::F16 => run_blocks(ty, data, n_elements, block_f16),
        GgmlType::BF16 => run_blocks(ty, data, n_elements, block_bf16),
        GgmlType::Q8_0 => run_blocks(ty, data, n_elements, block_q8_0),
        GgmlType::Q4_0 => run_blocks(ty, data, n_elements, block_q4_0),
        GgmlType::Q4_1 => run_blocks(ty, data, n_elements, block_q4_1),
        GgmlType::Q4_K => run_blocks(ty, data, n_elements, block_q4_k),
        GgmlType::Q5_K => run_blocks(ty, data, n_elements, block_q5_k),
        GgmlType::Q6_K => run_blocks(ty, data, n_elements, block_q6_k),
        other => load_err(format!(
            "cannot dequantize ggml type {}: stepllm reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K",
            other.name()
        )),
    }
}

/// Apply a per-block decoder over all blocks, in parallel over large chunks. Generic (not a fn pointer)
/// so each decoder is inlined into its loop.
fn run_blocks<F>(ty: GgmlType, data: &[u8], n_elements: usize, decode_block: F) -> Result<Vec<f32>>
where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    let (block_size, type_size) = (ty.block_size(), ty.type_size());
    if !n_elements.is_multiple_of(block_size) {
        return load_err(format!("{n_elements} elements are not a whole number of {} blocks of {block_size}", ty.name()));
    }
    let n_blocks = n_elements / block_size;
    if data.len() != n_blocks * type_size {
        return load_err(format!(
            "{} tensor of {n_elements} elements needs {} bytes, got {}",
            ty.name(),
            n_blocks * type_size,
            data.len()
        ));
    }
    let mut out = vec![0f32; n_elements];
    let blocks_per_task = (ELEMENTS_PER_TASK / block_size).max(1);
    out.par_chunks_mut(blocks_per_task * block_size)
        .zip(data.par_chunks(blocks_per_task * type_size))
        .for_each(|(out_chunk, data_chunk)| {
            for (out_block, in_block) in out_chunk.chunks_exact_mut(block_size).zip(data_chunk.chunks_exact(type_size)) {
                decode_block(in_block, out_block);
            }
        });
    Ok(out)
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn block_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn block_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

/// bf16 is the top half of an f32; shifting (not a library conversion) keeps NaN payloads as ggml does.
fn block_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
}

/// Q8_0: f16 scale d, 32 signed bytes; x = q * d.
fn block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// Q4_0: f16 scale d, 16 bytes of nibbles; low nibbles are elements 0..16, high nibbles 16..32;
/// x = (q - 8) * d.
fn block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        low[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        high[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles (layout as Q4_0); x = q * d + m.
fn block_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        low[j] = (q & 0x0F) as f32 * d + m;
        high[j] = (q >> 4) as f32 * d + m;
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

/// Q4_K super-block: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles. Eight sub-blocks of 32;
/// each 32-byte run of nibbles feeds two sub-blocks (low nibbles, then high); x = d*scale*q - dmin*min.
fn block_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for pair in 0..QK_K / 64 {
        let q = &qs[32 * pair..32 * pair + 32];
        let (sc_lo, m_lo) = k_scale_min(scales, 2 * pair);
        let (sc_hi, m_hi) = k_scale_min(scales, 2 * pair + 1);
        let (d_lo, min_lo) = (d * sc_lo as f32, dmin * m_lo as f32);
        let (d_hi, min_hi) = (d * sc_hi as f32, dmin * m_hi as f32);
        let y = &mut out[64 * pair..64 * pair + 64];
        for l in 0..32 {
            y[l] = d_lo * (q[l] & 0x0F) as f32 - min_lo;
            y[l + 32] = d_hi * (q[l] >> 4) as f32 - min_hi;
        }
    }
}

/// Q5_K super-block: as Q4_K plus 32 bytes `qh` whose bit j of byte l is the fifth bit of element l of
/// sub-block j.
fn block_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for pair in 0..QK_K / 64 {
        let q = &qs[32 * pair..32 * pair + 32];
        let (bit_lo, bit_hi) = (2 * pair, 2 * pair + 1);
        let (sc_lo, m_lo) = k_scale_min(scales, bit_lo);
        let (sc_hi, m_hi) = k_scale_min(scales, bit_hi);
        let (d_lo, min_lo) = (d * sc_lo as f32, dmin * m_lo as f32);
        let (d_hi, min_hi) = (d * sc_hi as f32, dmin * m_hi as f32);
        let y = &mut out[64 * pair..64 * pair + 64];
        for l in 0..32 {
            let q_lo = (q[l] & 0x0F) | (((qh[l] >> bit_lo) & 1) << 4);
            let q_hi = (q[l] >> 4) | (((qh[l] >> bit_hi) & 1) << 4);
            y[l] = d_lo * q_lo as f32 - min_lo;
            y[l + 32] = d_hi * q_hi as f32 - min_hi;
        }
    }
}

/// Q6_K super-block: 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16 signed 8-bit scales
/// (one per 16 elements), f16 d. Each 128-element half uses 64 bytes of ql and 32 of qh: element l+32s
/// (s in 0..4) takes a nibble of ql[l] or ql[l+32] and bits 2s..2s+2 of qh[l]; x = d*scale*(q - 32).
fn block_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let scales = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let quants = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (s, &q) in quants.iter().enumerate() {
                let scale = scales[l / 16 + 2 * s] as i8;
                y[l + 32 * s] = d * scale as f32 * (q as i32 - 32) as f32;
            }
        }
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
        assert!(dequantize(GgmlType::Q5_0, &[0u8; 22], 32).is_err());
        assert_eq!(dequantize(GgmlType::Q8_0, &[], 0).unwrap(), Vec::<f32>::new());
    }
}
