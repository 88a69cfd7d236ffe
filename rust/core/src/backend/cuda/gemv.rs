//! Projections of decode batches (1 and 2 rows by default) on our own kernels instead of cuBLAS, which is
//! latency-bound there: which kernel family serves a launch, and its launch shape.
//!
//! - kernels/gemv_bulk.cu (compute capability 9.0 and up): one block per multiprocessor streams its contiguous
//!   run of weight rows into a shared-memory ring by bulk copies, issued before it waits for the previous
//!   kernel, and uses little enough of the multiprocessor that the next projection's block fits beside it and
//!   does the same. It serves 1 row on Hopper (and 3 or 4 when STEPLLM_GEMV_MAX_ROWS raises the limit);
//!   STEPLLM_NO_BULK_GEMV=1 turns it off (comparisons).
//! - kernels/gemv.cu (any GPU): weights through registers in one-wave grids; 2 rows on Hopper (measured faster
//!   there), and 1 and 2 rows elsewhere.
//!
//! Both fuse the RMSNorm before the product and the residual add or SiLU gating after it ([`GemvKind`]).

use std::sync::Mutex;

use super::device::{Arg, Func, Gpu};
use crate::error::Result;

/// Largest batch the GEMV kernels can serve (one instantiation per row count).
pub const GEMV_MAX_ROWS: usize = 8;
/// Default largest batch sent to the GEMV kernels rather than the skinny GEMM (skinny_gemm.rs) or cuBLAS;
/// STEPLLM_GEMV_MAX_ROWS overrides it (0 = none). Measured on the H200 (benchmarks/gpu_decode.py, ms per decode
/// step, Qwen3-0.6B / SmolLM2-135M shapes, 2026-12-03): 3 rows took 1.392 / 0.886 on the bulk GEMV against 1.014
/// / 0.896 on the skinny GEMM, 4 rows 1.380 / 0.874 against 1.034 / 0.895; 2 rows stay here (0.945 / 0.591).
const GEMV_DEFAULT_ROWS: usize = 2;
/// Threads of one block of either family (GEMV_THREADS, BULK_THREADS) and the register family's warps.
const GEMV_THREADS: u32 = 256;
const GEMV_WARPS: usize = 8;
/// Target size of one ring stage of the bulk family, and of its whole ring (BULK_MAX_STAGES at most): the
/// fastest pair on the H200 of those benchmarks/kernels/gemv_chain.cu tries (a Qwen3-0.6B layer's four
/// projections at batch 1 in 16.7 µs, against 18.1 µs with 32 KiB stages and 20.3 µs for the register family).
/// The ring plus the input rows stay under half a multiprocessor's shared memory, so two projections' blocks
/// fit side by side.
const BULK_STAGE_BYTES: usize = 48 << 10;
const BULK_RING_BYTES: usize = 96 << 10;
const BULK_MAX_STAGES: usize = 16;

/// What a GEMV launch does around the product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum GemvKind {
    /// `y = x · Wᵀ (+ bias)`
    Plain,
    /// `y += x · Wᵀ (+ bias)`
    AddInto,
    /// `y = rms_norm(x) · Wᵀ (+ bias)`
    Norm,
    /// `y = silu(gate) * up` of `[gate | up] = rms_norm(x) · Wᵀ`
    NormSilu,
}

/// Kernel names per [`GemvKind`], in its order: `gemv_{name}_m{rows}` and `gemv_bulk_{name}_m{rows}`.
const KIND_NAMES: [&str; 4] = ["plain_store", "plain_add", "norm_store", "norm_silu"];

/// One projection's operands, as both our kernel families take them (this one and skinny_gemm.rs): `x` is
/// `[rows, k]` at `x`, the weight `[n, k]` at `weight`, the output goes to `y`.
pub(super) struct Projection {
    pub rows: usize,
    pub x: u64,
    pub weight: u64,
    pub n: usize,
    pub k: usize,
    /// 0: none.
    pub bias: u64,
    pub y: u64,
}

/// One GEMV launch: the projection, what the kernel does around it, and for the Norm kinds the RMSNorm's
/// (weights, epsilon).
pub(super) struct GemvLaunch {
    pub kind: GemvKind,
    pub norm: Option<(u64, f32)>,
    pub op: Projection,
}

/// (GEMV kind, rows, bytes of dynamic shared memory): what a register-family kernel's occupancy depends on.
type GemvShape = (usize, usize, u32);

pub(super) struct Gemv {
    /// `registers[kind][rows - 1]`
    registers: [Vec<Func>; 4],
    /// The same for the bulk family, where the device has it.
    bulk: Option<[Vec<Func>; 4]>,
    max_rows: usize,
    /// Dynamic shared memory a block may use (the register family holds its input rows there; the bulk family
    /// also its ring).
    smem: usize,
    bulk_smem: usize,
    /// Blocks resident per multiprocessor of each register-family launch shape, filled as launches ask.
    occupancy: Mutex<Vec<(GemvShape, usize)>>,
}

impl Gemv {
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let family = |prefix: &str| -> Result<[Vec<Func>; 4]> {
            let kind = |name: &str| -> Result<Vec<Func>> {
                (1..=GEMV_MAX_ROWS).map(|m| gpu.function(prefix, &format!("{prefix}_{name}_m{m}"))).collect()
            };
            Ok([kind(KIND_NAMES[0])?, kind(KIND_NAMES[1])?, kind(KIND_NAMES[2])?, kind(KIND_NAMES[3])?])
        };
        let registers = family("gemv")?;
        let bulk = if gpu.hopper && std::env::var_os("STEPLLM_NO_BULK_GEMV").is_none() { Some(family("gemv_bulk")?) } else { None };
                let max_rows = std::env::var("STEPLLM_GEMV_MAX_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(GEMV_DEFAULT_ROWS)
            .min(GEMV_MAX_ROWS);
        let limit = |fs: &[Vec<Func>; 4]| -> Result<usize> {
            let mut bytes = usize::MAX;
            for f in fs.iter().flatten() {
                bytes = bytes.min(gpu.allow_max_dynamic_shared_memory(*f)?);
            }
            Ok(bytes)
        };
        let smem = limit(&registers)?;
        let bulk_smem = match &bulk {
            Some(fs) => limit(fs)?,
            None => 0,
        };
        Ok(Self { registers, bulk, max_rows, smem, bulk_smem, occupancy: Mutex::new(Vec::new()) })
    }

    /// Whether an `m`-row projection with inputs `k` wide goes to a GEMV kernel (its rows fit in shared memory).
    pub fn serves(&self, m: usize, k: usize) -> bool {
        (1..=self.max_rows).contains(&m) && m * k * 2 <= self.smem
    }

    pub fn launch(&self, gpu: &Gpu, p: &GemvLaunch) -> Result<()> {
        match (&self.bulk, self.bulk_stages(p)) {
            (Some(bulk), Some((stage_rows, stages, smem))) if p.op.rows != 2 => {
                let f = bulk[p.kind as usize][p.op.rows - 1];
                let mut args = common_args(p);
                args.extend([Arg::I32(stage_rows as i32), Arg::I32(stages as i32)]);
                gpu.launch_smem(f, (gpu.sm_count as u32, 1, 1), GEMV_THREADS, smem as u32, &args)
            }
            // Two rows stay on the register family, which measured faster there on the H200: 1.022-1.024 against
            // 1.083-1.091 ms per step on the Qwen3-0.6B shape (SmolLM2-135M: 0.668-0.682 against 0.647-0.668).
            _ => self.launch_registers(gpu, p),
        }
    }

    /// The bulk family's ring for this launch: (rows per stage, stages, dynamic shared memory), or None when
    /// even a ring of two one-row stages beside the input rows (and the norm weights) would not fit. A stage
    /// holds whole rows, a multiple of the block's 8 warps when that many fit (a warp takes a row at a time).
    fn bulk_stages(&self, p: &GemvLaunch) -> Option<(usize, usize, usize)> {
        let row_bytes = if p.kind == GemvKind::NormSilu { 2 } else { 1 } * p.op.k * 2;
        let fit = BULK_STAGE_BYTES / row_bytes;
        let stage_rows = if fit >= GEMV_WARPS { fit - fit % GEMV_WARPS } else { fit.max(1) };
        let stage = stage_rows * row_bytes;
        let stages = (BULK_RING_BYTES / stage).clamp(2, BULK_MAX_STAGES);
        // The kernel's IN_NORM variants (the Norm kinds) stage the RMSNorm weights beside the input rows.
        let norm_weights = if matches!(p.kind, GemvKind::Norm | GemvKind::NormSilu) { p.op.k * 4 } else { 0 };
        let smem = p.op.rows * p.op.k * 2 + norm_weights + stages * stage;
        (smem <= self.bulk_smem).then_some((stage_rows, stages, smem))
    }

    fn launch_registers(&self, gpu: &Gpu, p: &GemvLaunch) -> Result<()> {
        let cols = if p.kind == GemvKind::NormSilu { p.op.n / 2 } else { p.op.n };
        let wpr = split_k(cols, p.op.k, gpu.sm_count);
        let groups = cols.div_ceil(GEMV_WARPS / wpr);
        let f = self.registers[p.kind as usize][p.op.rows - 1];
        let smem = (p.op.rows * p.op.k * 2) as u32;
        // One wave: a second, partial wave would wait a whole DRAM round trip for the first. Blocks loop over
        // the row groups (staging and normalizing their input once), and the groups are spread evenly.
        let resident = self.blocks_per_multiprocessor(gpu, p, f, smem)? * gpu.sm_count;
        let grid = groups.div_ceil(groups.div_ceil(resident)) as u32;
        let mut args = common_args(p);
        args.push(Arg::I32(wpr as i32));
        gpu.launch_smem(f, (grid, 1, 1), GEMV_THREADS, smem, &args)
    }

    fn blocks_per_multiprocessor(&self, gpu: &Gpu, p: &GemvLaunch, f: Func, smem: u32) -> Result<usize> {
        let key = (p.kind as usize, p.op.rows, smem);
        let mut known = self.occupancy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, blocks)) = known.iter().find(|(k, _)| *k == key) {
            return Ok(blocks);
        }
        let blocks = gpu.blocks_per_multiprocessor(f, GEMV_THREADS, smem)?;
        known.push((key, blocks));
        Ok(blocks)
    }
}

/// The parameters both kernel families take first, in their order.
fn common_args(p: &GemvLaunch) -> Vec<Arg> {
    let (norm, eps) = p.norm.unwrap_or((0, 0.0));
    vec![
        Arg::Ptr(p.op.x),
        Arg::Ptr(norm),
        Arg::F32(eps),
        Arg::Ptr(p.op.weight),
        Arg::Ptr(p.op.bias),
        Arg::Ptr(p.op.y),
        Arg::I32(p.op.n as i32),
        Arg::I32(p.op.k as i32),
    ]
}

/// Warps per output column of a register-family GEMV: split K further while the GPU would not get 16 warps per
/// SM and each lane keeps at least two 16-byte loads.
fn split_k(cols: usize, k: usize, sm_count: usize) -> usize {
    let chunks = k / 8;
    let target = 16 * sm_count;
    let mut wpr = 1;
    while wpr < GEMV_WARPS && cols * wpr < target && chunks >= 64 * (2 * wpr) {
        wpr *= 2;
    }
    wpr
}
