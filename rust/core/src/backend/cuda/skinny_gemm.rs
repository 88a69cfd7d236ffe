//! Projections of decode batches of 3 to 16 rows (by default) on our tensor-core kernel (kernels/skinny_gemm.cu)
//! instead of cuBLAS, which is latency-bound there: whether it serves a launch, and its launch shape. It fuses
//! the RMSNorm before the product (each block sums its tokens' squares over the whole row itself) and the
//! residual add or the SiLU gating after it, as the GEMV kernels do; STEPLLM_NO_SKINNY_NORM=1 leaves the RMSNorm
//! to a kernel of its own (comparisons).

use super::device::{Arg, DeviceBuffer, Func, Gpu};
use super::gemv::Projection;
use crate::error::{Error, Result};

/// Tokens one block covers (SKINNY_TOKENS): the kernel is instantiated for 1..=4 tiles of 8 tokens, and larger
/// batches take more blocks along grid.x. (Up to 64 tokens per block took 196 registers and one block per
/// multiprocessor, and was slower.)
const BLOCK_TOKENS: usize = 32;
const TOKEN_TILE: usize = 8;
/// Accumulator entries of one A tile of a block at most (16 per token: 16 rows x 8 tokens = 128 per tile).
const MAX_ENTRIES: usize = BLOCK_TOKENS * 16;
const THREADS: u32 = 256;
const WARPS: usize = 8;
/// k per load step of a warp (CHUNK_K).
const CHUNK_K: usize = 32;
/// Default largest batch served here rather than by cuBLAS; STEPLLM_SKINNY_GEMM_MAX_ROWS overrides it (0 = off).
/// Measured on the H200 (benchmarks/gpu_decode.py, ms per decode step, Qwen3-0.6B / SmolLM2-135M shapes, against
/// cuBLAS in the same run, two runs on 2026-12-03): 8 rows 1.097 / 0.890 against 1.320 / 1.026 and 1.078 / 0.914
/// against 1.344 / 1.058; 16 rows 1.236 / 0.906 against 1.444 / 1.055 and 1.220 / 0.955 against 1.440 / 1.082;
/// 32 rows undecided (1.515 / 1.086 against 1.569 / 1.109, then 1.497 / 1.127 against 1.433 / 1.028); 64 rows and
/// more lose (2.084 / 1.145 against 1.909 / 1.169): the kernel is latency-bound by design, and larger batches
/// want a tiled GEMM.
const DEFAULT_MAX_ROWS: usize = 16;
/// Widest weight served: every projection of a layer of the supported models, but not an LM head, whose tens of
/// thousands of rows cuBLAS streams at 4 TB/s already (76.6 µs for Qwen3's 311 MB at 16 rows, on the H200).
const MAX_OUTPUTS: usize = 16384;
/// Most blocks one output tile's K is split over.
const MAX_SPLITS: usize = 16;

/// What the kernel does before the product (the Norm kinds: IN_NORM) and after it (OUT_STORE, OUT_ADD, OUT_SILU of
/// kernels/gemv_common.cuh).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum SkinnyKind {
    /// `y = x · Wᵀ (+ bias)`
    Store,
    /// `y += x · Wᵀ (+ bias)`
    AddInto,
    /// `y = silu(gate) * up` of `[gate | up] = x · Wᵀ`
    Silu,
    /// `y = rms_norm(x) · Wᵀ (+ bias)`
    NormStore,
    /// `y = silu(gate) * up` of `[gate | up] = rms_norm(x) · Wᵀ`
    NormSilu,
}

const KIND_NAMES: [&str; 5] = ["store", "add", "silu", "norm_store", "norm_silu"];

pub(super) struct SkinnyGemm {
    /// `kernels[kind][token tiles - 1]`
    kernels: [Vec<Func>; KIND_NAMES.len()],
    /// Blocks resident per multiprocessor, per token-tile count (the same for every kind).
    resident: Vec<usize>,
    max_rows: usize,
    /// Whether the RMSNorm before a projection runs inside it (the Norm kinds).
    pub fuses_norm: bool,
    sm_count: usize,
    /// Split-K partial sums and the per-tile counters (zeroed once; the kernel leaves them zero).
    partial: DeviceBuffer,
    counters: DeviceBuffer,
}

impl SkinnyGemm {
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let kind = |name: &str| -> Result<Vec<Func>> {
            (1..=BLOCK_TOKENS / TOKEN_TILE).map(|t| gpu.function("skinny_gemm", &format!("skinny_gemm_{name}_t{t}"))).collect()
        };
        let mut kernels: [Vec<Func>; KIND_NAMES.len()] = Default::default();
        for (family, name) in kernels.iter_mut().zip(KIND_NAMES) {
            *family = kind(name)?;
        }
        let mut resident = Vec::new();
        for (i, &f) in kernels[0].iter().enumerate() {
            let smem = reduction_bytes(i + 1);
            for fs in &kernels {
                gpu.allow_max_dynamic_shared_memory(fs[i])?;
            }
            resident.push(gpu.blocks_per_multiprocessor(f, THREADS, smem)?);
        }
        let max_rows = match std::env::var("STEPLLM_SKINNY_GEMM_MAX_ROWS") {
            Ok(v) => v.parse().map_err(|_| {
                Error::Device(format!("STEPLLM_SKINNY_GEMM_MAX_ROWS={v:?}: expected a row count (0 turns the kernel off)"))
            })?,
            Err(_) => DEFAULT_MAX_ROWS,
        };
        let sm_count = gpu.sm_count;
        // A split launch has at most one wave of blocks (see `splits`), so fewer than a wave of tiles.
        let wave = resident.iter().copied().max().unwrap_or(1) * sm_count;
        let partial = gpu.alloc(wave * 2 * MAX_ENTRIES * 4)?;
        let counters = gpu.alloc(wave * 4)?;
        partial.zero()?;
        counters.zero()?;
        let fuses_norm = std::env::var_os("STEPLLM_NO_SKINNY_NORM").is_none();
        Ok(Self { kernels, resident, max_rows, fuses_norm, sm_count, partial, counters })
    }

    /// Whether the kernel serves an `m`-row projection of an `[n, k]` weight: whole 32-row weight tiles (for a
    /// `[gate | up]` weight, 16 of each half), whole chunks of k, and not the LM head (MAX_OUTPUTS).
    pub fn serves(&self, m: usize, n: usize, k: usize) -> bool {
        (1..=self.max_rows).contains(&m) && n.is_multiple_of(32) && n <= MAX_OUTPUTS && k.is_multiple_of(CHUNK_K)
    }

    /// One launch; `norm`: the RMSNorm's (weights, epsilon) for the Norm kinds.
    pub fn launch(&self, gpu: &Gpu, kind: SkinnyKind, p: &Projection, norm: Option<(u64, f32)>) -> Result<()> {
        if matches!(kind, SkinnyKind::NormStore | SkinnyKind::NormSilu) != norm.is_some() {
            return Err(Error::Device(format!(
                "skinny GEMM {kind:?} launched with norm {norm:?}: the Norm kinds, and only they, take the RMSNorm's weights (a bug)"
            )));
        }
        let tiles_per_block = p.rows.min(BLOCK_TOKENS).div_ceil(TOKEN_TILE);
        let f = self.kernels[kind as usize][tiles_per_block - 1];
        let silu = matches!(kind, SkinnyKind::Silu | SkinnyKind::NormSilu);
        let out_tiles = if silu { p.n / 2 / 16 } else { p.n / 32 };
        let token_chunks = p.rows.div_ceil(BLOCK_TOKENS);
        let wave = self.resident[tiles_per_block - 1] * self.sm_count;
        let splits = splits(out_tiles * token_chunks, wave, p.k / CHUNK_K);
        let (norm_w, eps) = norm.unwrap_or((0, 0.0));
        let args = [
            Arg::Ptr(p.x),
            Arg::Ptr(norm_w),
            Arg::F32(eps),
            Arg::Ptr(p.weight),
            Arg::Ptr(p.bias),
            Arg::Ptr(p.y),
            Arg::I32(p.rows as i32),
            Arg::I32(p.n as i32),
            Arg::I32(p.k as i32),
            Arg::Ptr(self.partial.ptr()),
            Arg::Ptr(self.counters.ptr()),
        ];
        let grid = (token_chunks as u32, out_tiles as u32, splits as u32);
        gpu.launch_smem(f, grid, THREADS, reduction_bytes(tiles_per_block), &args)
    }
}

/// Shared memory for summing the warps: every warp's accumulators of both A tiles.
fn reduction_bytes(token_tiles: usize) -> u32 {
    (WARPS * 2 * token_tiles * TOKEN_TILE * 16 * 4) as u32
}

/// Blocks to split each output tile's K over: as many as still fit in one wave (a second wave would wait a whole
/// round trip for the first), but never so many that a warp would get no chunk of 32 k, nor fewer than two (a warp
/// has two chunks' weights in flight).
fn splits(tiles: usize, wave: usize, chunks: usize) -> usize {
    let enough = chunks.div_ceil(WARPS * 2);
    (wave / tiles).min(enough).min(chunks / WARPS).clamp(1, MAX_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_launches_fit_one_wave_and_the_workspace() {
        for wave in [132, 264, 396] {
            for tiles in 1..=600 {
                for chunks in [1, 7, 8, 18, 32, 48, 64, 96, 256] {
                    let s = splits(tiles, wave, chunks);
                    assert!((1..=MAX_SPLITS).contains(&s), "{tiles} tiles, {chunks} chunks: {s} splits");
                    if s > 1 {
                        // What SkinnyGemm::load sizes the partial sums and counters for.
                        assert!(tiles * s <= wave && tiles < wave, "{tiles} tiles x {s} splits over a wave of {wave}");
                        assert!(chunks / s >= WARPS, "{chunks} chunks over {s} splits leave warps idle");
                    }
                }
            }
        }
    }

    #[test]
    fn splits_follow_the_output_tiles() {
        // Qwen3-0.6B at 8 rows, two blocks per multiprocessor on 132: QKV (128 tiles, K 1024) splits in 2,
        // O (32 tiles, K 2048) in 4, down (32 tiles, K 3072) in 6, gate/up (192 tiles) not at all.
        assert_eq!(splits(128, 264, 32), 2);
        assert_eq!(splits(32, 264, 64), 4);
        assert_eq!(splits(32, 264, 96), 6);
        assert_eq!(splits(192, 264, 32), 1);
        // A K shorter than 8 chunks is never split.
        assert_eq!(splits(4, 264, 7), 1);
    }
}
