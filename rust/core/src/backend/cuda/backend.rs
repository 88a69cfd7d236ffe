//! `CudaBackend`: the [`Backend`] ops on an NVIDIA GPU in bf16. Kernels come from kernels/*.cu (PTX embedded
//! at build time). Projections of 1 and 2 rows go to our GEMV kernels (gemv.rs picks the family and launch
//! shape), which also fuse the RMSNorm before them, the residual add or the SiLU-gating after them; 3 to 16 rows
//! to our tensor-core skinny GEMM (skinny_gemm.rs; the same fusions after the product); larger batches and the
//! LM head from 3 rows on to cuBLAS. The two limits are settings (STEPLLM_GEMV_MAX_ROWS,
//! STEPLLM_SKINNY_GEMM_MAX_ROWS).
//!
//! Storage only grows, and once decode graphs exist a replaced allocation is kept alive (graphs hold raw
//! pointers into it), so replaying a graph after a larger prefill stays valid.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use half::bf16;
use rayon::prelude::*;

use super::blas::Blas;
use super::device::{Arg, DeviceBuffer, Func, Gpu};
use super::gemv::{Gemv, GemvKind, GemvLaunch, Projection};
use super::skinny_gemm::{SkinnyGemm, SkinnyKind};
use crate::backend::{AttentionShape, Backend, BatchPlan, KvCacheDtype, KvCacheShape, PlannedSeq};
use crate::error::{Error, Result};
use crate::model::loader::HostTensor;

/// Most blocks one (token, kv head) of attention is split over.
const MAX_ATTENTION_SPLITS: usize = 16;
/// Warps per block (one block per token) of the RoPE kernel: ROPE_WARPS in kernels/rope.cu.
const ROPE_WARPS: usize = 8;
/// Query rows of a narrow block of the tiled prefill attention (PF_BQ in kernels/prefill_attention.cu: 4 warps of
/// one 16-row m-tile; a wide block has twice as many), and its threads.
const PREFILL_QUERY_TILE: usize = 64;
const PREFILL_THREADS: u32 = 128;
/// Padding of each position's head in the prefill attention's shared tiles (PF_PAD), in bf16 values.
const PREFILL_PAD: usize = 8;

/// The two shapes of the tiled prefill attention's blocks (kernels/prefill_attention.cu): 16 query rows per warp
/// with 64-position K/V tiles, or 32 rows per warp ("wide", the `_m2` kernels) with 32-position tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PrefillTiling {
    /// 16-row m-tiles per warp (the kernels' MT).
    m_tiles: usize,
    /// Key positions per shared-memory tile (BK).
    key_tile: usize,
}

impl PrefillTiling {
    const NARROW: Self = Self { m_tiles: 1, key_tile: 64 };
    const WIDE: Self = Self { m_tiles: 2, key_tile: 32 };

    fn query_rows(self) -> usize {
        PREFILL_QUERY_TILE * self.m_tiles
    }

    /// Dynamic shared memory of one block: two stages of K and of V tiles, and the wide blocks' queries.
    fn shared_bytes(self, head_dim: usize) -> usize {
        let queries = if self.m_tiles > 1 { self.query_rows() } else { 0 };
        (4 * self.key_tile + queries) * (head_dim + PREFILL_PAD) * 2
    }
}

/// Which prefill tiling a step gets: STEPLLM_PREFILL_M_TILES=1 or 2 forces one (tests cover both kernels with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillTilingChoice {
    Auto,
    Forced(PrefillTiling),
}

impl PrefillTilingChoice {
    fn from_env() -> Self {
        match std::env::var("STEPLLM_PREFILL_M_TILES").as_deref() {
            Ok("1") => Self::Forced(PrefillTiling::NARROW),
            Ok("2") => Self::Forced(PrefillTiling::WIDE),
            _ => Self::Auto,
        }
    }

    /// Wide blocks do 12-14% less work per key on an H100 (a 3,800-token prompt's attention, 260 against 301 us
    /// per layer with a bf16 cache, 273 against 309 with fp8), but there are half as many, and on 2,048 and 512
    /// tokens (less than one wave of them at two per multiprocessor) the first token came 19% and 14% later. So
    /// they are used only where both measured conditions of the win hold: a prompt chunk of 3,072 tokens or more, and
    /// at least one and a half waves of wide blocks. Shorter prompts (the mixed workload's) were not measured
    /// with wide blocks and keep the narrow ones.
    fn pick(self, max_query_len: usize, n_seqs: usize, num_heads: usize, sm_count: usize) -> PrefillTiling {
        match self {
            Self::Forced(tiling) => tiling,
            Self::Auto => {
                // The grid's size: every sequence as long as the longest (shorter ones' extra blocks exit at once).
                let wide_blocks = n_seqs * num_heads * max_query_len.div_ceil(PrefillTiling::WIDE.query_rows());
                // One and a half waves at two wide blocks per multiprocessor (about 250 registers a thread at
                // head_dim 128).
                if max_query_len >= PREFILL_WIDE_MIN_QUERY && wide_blocks >= 3 * sm_count {
                    PrefillTiling::WIDE
                } else {
                    PrefillTiling::NARROW
                }
            }
        }
    }
}

/// Shortest longest-query of a step that may get wide prefill-attention blocks.
const PREFILL_WIDE_MIN_QUERY: usize = 3072;

/// Most blocks one query tile of the narrow prefill attention is split over (its keys shared out), and the fewest
/// K/V tiles each split keeps, so that the merge stays small against a split's work.
const PREFILL_MAX_SPLITS: usize = 8;
const PREFILL_MIN_SPLIT_TILES: usize = 4;

/// Over how many blocks each query tile of a narrow prefill-attention step shares out its keys:
/// STEPLLM_PREFILL_SPLITS=N forces N (tests cover the merge with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillSplitChoice {
    Auto,
    Forced(usize),
}

impl PrefillSplitChoice {
    fn from_env() -> Self {
        match std::env::var("STEPLLM_PREFILL_SPLITS").ok().and_then(|v| v.parse::<usize>().ok()) {
            Some(n) if n >= 1 => Self::Forced(n.min(PREFILL_MAX_SPLITS)),
            _ => Self::Auto,
        }
    }

    /// `long_blocks`: narrow blocks of the sequences with long contexts (`CudaBatch::long_query_tiles`, every
    /// head); `key_tiles`: 64-position K/V tiles of the longest context. A step with fewer long blocks than one wave
    /// (two per multiprocessor) leaves multiprocessors idle while each walks all of its keys: a chunk of a long
    /// prompt (4 query tiles of 256 tokens against up to 60 K/V tiles, beside running requests' short decode rows),
    /// or a short prompt tail after a long cached prefix. Splitting the keys fills the wave: as many splits as fit in
    /// it, so that the long blocks' splits do not spill into a second.
    fn pick(self, long_blocks: usize, key_tiles: usize, sm_count: usize) -> usize {
        match self {
            Self::Forced(n) => n,
            Self::Auto => {
                let fit = (2 * sm_count) / long_blocks.max(1);
                fit.min(key_tiles / PREFILL_MIN_SPLIT_TILES).clamp(1, PREFILL_MAX_SPLITS)
            }
        }
    }
}

/// Prefill steps whose longest query is at least this many tokens use the tiled prefill attention; shorter ones
/// (a prompt tail after a prefix-cache hit) gain nothing from tiles and keep the paged kernel.
const PREFILL_TILED_MIN_QUERY: usize = 16;

/// Whether the attention's q and k are rotated already (the RoPE kernel ran) or the attention kernel rotates
/// them itself, with the per-head norm weights if the model has them (kernels/attention.cuh).
#[derive(Clone, Copy)]
enum QkRotation<'a> {
    Done,
    InKernel(Option<(&'a CudaVector, &'a CudaVector)>),
}
/// (head_dim, query heads per KV head) of every decode attention kernel: ATTENTION_SHAPES in kernels/attention.cuh.
pub(super) const DECODE_ATTENTION_SHAPES: [(usize, &[usize]); 2] = [(64, &ALL_GROUPS), (128, &ALL_GROUPS)];
const ALL_GROUPS: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
/// Arguments the rotating attention kernels take after the plain ones.
const ROTATION_ARGS: usize = 6;

/// Kernel handles, resolved once at start (those of an fp8 cache when the first one is allocated).
struct Kernels {
    embed: Func,
    rms_norm: Func,
    silu_mul: Func,
    add_bias: Func,
    add_into: Func,
    select_rows: Func,
    argmax: Func,
    advance: Func,
    bf16_cache: CacheKernels,
    fp8_cache: OnceLock<CacheKernels>,
    pub sample: Func,
    /// Logprobs of logits rows (kernels/logprobs.cu).
    score: Func,
}

/// The kernels that read or write the KV cache, for one cache element type.
struct CacheKernels {
    /// RoPE of a prefill step's q and k, and the write of its K and V.
    rope: Func,
    /// ((head_dim, group size), kernel)
    attention: Vec<((usize, usize), Func)>,
    /// The same shapes, rotating q and k themselves (decode batches only).
    attention_rope: Vec<((usize, usize), Func)>,
    /// The rotating kernels with their main loop on tensor cores (kernels/attention_mma.cuh): decode batches over
    /// caches whose block size is a multiple of 16.
    attention_mma: Vec<((usize, usize), Func)>,
    /// Tensor-core attention for prefill steps, one set per head_dim (see [`PrefillTiling`]).
    prefill_attention: Vec<PrefillKernels>,
}

/// The prefill attention's kernels for one head_dim and cache element type (kernels/prefill_attention.cu).
#[derive(Clone, Copy)]
struct PrefillKernels {
    head_dim: usize,
    narrow: Func,
    wide: Func,
    /// Combines the partial states of blocks whose keys were split (the same for either cache type).
    merge: Func,
}

impl PrefillKernels {
    fn for_tiling(&self, tiling: PrefillTiling) -> Func {
        if tiling == PrefillTiling::WIDE {
            self.wide
        } else {
            self.narrow
        }
    }
}

impl CacheKernels {
    /// Kernel names: paged_attention[_fp8][_rope|_mma_rope]_d{D}_g{G} in module attention[_fp8]
    /// (kernels/attention.cu, attention_fp8.cu), prefill_attention[_m2][_fp8]_d{D} and prefill_attention_merge_d{D},
    /// rope_write_kv_{bf16,fp8}.
    fn load(gpu: &Gpu, dtype: KvCacheDtype) -> Result<Self> {
        let (suffix, element) = match dtype {
            KvCacheDtype::Auto => ("", "bf16"),
            KvCacheDtype::Fp8 => ("_fp8", "fp8"),
        };
        let module = format!("attention{suffix}");
        let (mut attention, mut attention_rope, mut attention_mma) = (Vec::new(), Vec::new(), Vec::new());
        for (d, groups) in DECODE_ATTENTION_SHAPES {
            for &g in groups {
                let kernel = |variant: &str| gpu.function(&module, &format!("paged_attention{suffix}{variant}_d{d}_g{g}"));
                attention.push(((d, g), kernel("")?));
                attention_rope.push(((d, g), kernel("_rope")?));
                attention_mma.push(((d, g), kernel("_mma_rope")?));
            }
        }
        Ok(Self {
            rope: gpu.function("rope", &format!("rope_write_kv_{element}"))?,
            attention,
            attention_rope,
            attention_mma,
            prefill_attention: [64, 128]
                .into_iter()
                .map(|d| {
                    let kernel = |infix: &str| {
                        let f = gpu.function("prefill_attention", &format!("prefill_attention{infix}{suffix}_d{d}"))?;
                        // Its tiles may take more than the 48 KiB a kernel gets without opting in.
                        gpu.allow_max_dynamic_shared_memory(f)?;
                        Ok::<_, Error>(f)
                    };
                    Ok(PrefillKernels {
                        head_dim: d,
                        narrow: kernel("")?,
                        wide: kernel("_m2")?,
                        merge: gpu.function("prefill_attention", &format!("prefill_attention_merge_d{d}"))?,
                    })
                })
                .collect::<Result<_>>()?,
        })
    }
}

impl Kernels {
    fn load(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            embed: gpu.function("embedding", "embed")?,
            rms_norm: gpu.function("norm", "rms_norm")?,
            silu_mul: gpu.function("activation", "silu_mul")?,
            add_bias: gpu.function("activation", "add_bias")?,
            add_into: gpu.function("activation", "add_into")?,
            select_rows: gpu.function("activation", "select_rows")?,
            argmax: gpu.function("gemv", "argmax_rows")?,
            advance: gpu.function("decode_advance", "advance_decode_meta")?,
            bf16_cache: CacheKernels::load(gpu, KvCacheDtype::Auto)?,
            fp8_cache: OnceLock::new(),
            sample: gpu.function("sampling", "sample_rows")?,
            score: gpu.function("logprobs", "score_rows")?,
        })
    }

    /// The cache kernels for `dtype`, loading the fp8 ones on first use.
    fn for_cache(&self, gpu: &Gpu, dtype: KvCacheDtype) -> Result<&CacheKernels> {
        match dtype {
            KvCacheDtype::Auto => Ok(&self.bf16_cache),
            KvCacheDtype::Fp8 => {
                if let Some(k) = self.fp8_cache.get() {
                    return Ok(k);
                }
                let loaded = CacheKernels::load(gpu, dtype)?;
                Ok(self.fp8_cache.get_or_init(|| loaded))
            }
        }
    }
}

/// Words of one sequence's entry in the seq_info section: start, len, past_len, table_start, table_len.
pub const SEQ_INFO_WORDS: usize = 5;

/// Section offsets (in u32) of one batch-metadata buffer. Graph replays reuse one fixed layout.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MetaLayout {
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub token_seq: usize,
    pub seq_info: usize,
    pub logits_rows: usize,
    pub tables: usize,
    pub total: usize,
}

impl MetaLayout {
    /// Room for `n` tokens, `s` sequences, `l` logits rows and `t` block-table entries.
    pub fn new(n: usize, s: usize, l: usize, t: usize) -> Self {
        let tokens = 0;
        let positions = tokens + n;
        let slots = positions + n;
        let token_seq = slots + n;
        let seq_info = token_seq + n;
        let logits_rows = seq_info + SEQ_INFO_WORDS * s;
        let tables = logits_rows + l;
        Self { tokens, positions, slots, token_seq, seq_info, logits_rows, tables, total: tables + t }
    }

    /// Write `plan` into `out` (at least `total` long).
    pub fn pack(&self, plan: &BatchPlan, out: &mut [u32]) {
        self.pack_rows(plan, out);
        let t = plan.block_tables.len();
        out[self.tables..self.tables + t].copy_from_slice(&plan.block_tables);
    }

    /// [`pack`](Self::pack) of every section but the block tables, which a decode graph lays out itself
    /// (runner.rs: each with the blocks reserved past its context).
    pub fn pack_rows(&self, plan: &BatchPlan, out: &mut [u32]) {
        let n = plan.num_tokens();
        out[self.tokens..self.tokens + n].copy_from_slice(&plan.tokens);
        out[self.positions..self.positions + n].copy_from_slice(&plan.positions);
        out[self.slots..self.slots + n].copy_from_slice(&plan.slots);
        out[self.token_seq..self.token_seq + n].copy_from_slice(&plan.token_seq);
        for (i, s) in plan.seqs.iter().enumerate() {
            let at = self.seq_info + SEQ_INFO_WORDS * i;
            out[at..at + SEQ_INFO_WORDS].copy_from_slice(&[s.start, s.len, s.past_len, s.table_start, s.table_len]);
        }
        let l = plan.logits_rows.len();
        out[self.logits_rows..self.logits_rows + l].copy_from_slice(&plan.logits_rows);
    }
}

/// Batch metadata on the device.
#[derive(Default)]
pub struct CudaBatch {
    own: Option<DeviceBuffer>,
    base: u64,
    layout: MetaLayout,
    pub n_tokens: usize,
    pub n_logits: usize,
    pub n_seqs: usize,
    /// Longest context of the batch; None while capturing a graph (the replayed batch is not known yet).
    max_context: Option<usize>,
    /// Most query tokens of one sequence (1 in decode steps).
    max_query_len: usize,
    /// The step's leading one-token sequences, which are its first tokens too: a mixed step puts its decode rows
    /// first (`forward_order`). When the other sequences take the tiled prefill attention, these take the decode
    /// kernel, which rotates their q and k itself and reads each K/V position once for all query heads of a KV
    /// head, instead of a 64-row query tile per query head with one row used. 0 with
    /// STEPLLM_NO_MIXED_DECODE_ROWS=1 (everything in the prefill kernel, for comparisons).
    decode_rows: usize,
    /// Longest context of the sequences after `decode_rows` (the prompts).
    prompt_max_context: usize,
    /// Narrow prefill-attention query tiles of the prompts whose context is at least half the longest prompt's (sum
    /// of ceil(query tokens / PREFILL_QUERY_TILE)): their blocks set the attention's time. The others finish early
    /// however the keys are split.
    long_query_tiles: usize,
}

impl CudaBatch {
    /// Every sequence has exactly one query token (a decode step), so attention may rotate q and k itself.
    fn is_decode(&self) -> bool {
        self.max_query_len == 1
    }

    fn section(&self, offset: usize) -> u64 {
        self.base + 4 * offset as u64
    }
}

/// A bf16 activation `[rows, cols]`.
#[derive(Default)]
pub struct CudaTensor {
    buf: Option<DeviceBuffer>,
    rows: usize,
    cols: usize,
}

impl CudaTensor {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr())
    }
}

/// A bf16 weight matrix `[rows = out_features, cols = in_features]`.
pub struct CudaMatrix {
    buf: DeviceBuffer,
    rows: usize,
    cols: usize,
}

/// An f32 vector (norm weights, biases).
pub struct CudaVector {
    buf: DeviceBuffer,
    len: usize,
}

/// K and V of every layer as `[num_blocks + 1][num_kv_heads][block_size][head_dim]` bf16 (or fp8, one byte per
/// value, with `KvCacheDtype::Fp8`; kernels/kv_cache.cuh): attention reads one
/// head's positions of a block as one contiguous run (kernels/rope.cu writes, kernels/attention.cuh reads). The
/// extra last block is the dummy that padded rows of a graph replay write to and read from.
pub struct CudaKvCache {
    shape: KvCacheShape,
    keys: Vec<DeviceBuffer>,
    values: Vec<DeviceBuffer>,
}

impl CudaKvCache {
    pub fn shape(&self) -> KvCacheShape {
        self.shape
    }
}

/// Logits left on the device by a forward: bf16 `[rows, vocab]` at `ptr`, and each row's argmax key at `argmax`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceLogits {
    pub ptr: u64,
    pub argmax: u64,
}

/// Interior state of the backend (ops take `&self`).
#[derive(Default)]
pub(super) struct State {
    /// While capturing decode graphs: the fixed metadata buffer every graph reads, and its layout.
    pub capture: Option<(u64, MetaLayout)>,
    /// Set once graphs exist: replaced allocations stay alive because graphs point into them.
    pub keep_retired: bool,
    retired: Vec<DeviceBuffer>,
    attn_partial: Option<DeviceBuffer>,
    attn_counters: Option<DeviceBuffer>,
    /// A scaled RoPE's inverse frequencies on the device, and the RoPE they are for.
    rope_frequencies: Option<(crate::model::Rope, DeviceBuffer)>,
    /// One u64 per logits row: its greedy token, packed as (order key << 32 | !token) by kernels/gemv.cu.
    argmax_keys: Option<DeviceBuffer>,
    /// When set, copy_to_host leaves the logits on the device for GPU sampling and records them here.
    pub logits_on_device: bool,
    pub last_logits: Option<DeviceLogits>,
    staging: Vec<u32>,
}

pub(super) struct Inner {
    pub gpu: Gpu,
    blas: Blas,
    kernels: Kernels,
    gemv: Gemv,
    skinny: SkinnyGemm,
    /// STEPLLM_NO_TILED_PREFILL=1 keeps prefill on the paged attention kernel (for comparisons).
    tiled_prefill: bool,
    /// Narrow or wide prefill-attention blocks per step (STEPLLM_PREFILL_M_TILES=1|2 forces one).
    prefill_tiling: PrefillTilingChoice,
    /// Key splits of narrow prefill-attention blocks (STEPLLM_PREFILL_SPLITS=N forces N).
    prefill_splits: PrefillSplitChoice,
    /// STEPLLM_NO_MMA_ATTENTION=1 keeps decode attention on the CUDA-core kernel (for comparisons).
    mma_attention: bool,
    /// STEPLLM_NO_MIXED_DECODE_ROWS=1 leaves a mixed step's decode rows in the prefill attention
    /// (`CudaBatch::decode_rows`; for comparisons).
    mixed_decode_rows: bool,
    pub state: Mutex<State>,
}

/// The CUDA backend; cheap to clone (clones share the device, stream and state).
#[derive(Clone)]
pub struct CudaBackend {
    pub(super) inner: Arc<Inner>,
}

impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<Self> {
        let gpu = Gpu::new(ordinal)?;
        let blas = Blas::new(&gpu)?;
        let kernels = Kernels::load(&gpu)?;
        let gemv = Gemv::load(&gpu)?;
        let skinny = SkinnyGemm::load(&gpu)?;
        let tiled_prefill = std::env::var_os("STEPLLM_NO_TILED_PREFILL").is_none();
        let mma_attention = std::env::var_os("STEPLLM_NO_MMA_ATTENTION").is_none();
        let mixed_decode_rows = std::env::var_os("STEPLLM_NO_MIXED_DECODE_ROWS").is_none();
        let state = Mutex::new(State::default());
        let prefill_tiling = PrefillTilingChoice::from_env();
        let prefill_splits = PrefillSplitChoice::from_env();
        let inner = Inner {
            gpu,
            blas,
            kernels,
            gemv,
            skinny,
            tiled_prefill,
            prefill_tiling,
            prefill_splits,
            mma_attention,
            mixed_decode_rows,
            state,
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.inner.gpu
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn sample_kernel(&self) -> Func {
        self.inner.kernels.sample
    }

    pub(super) fn score_kernel(&self) -> Func {
        self.inner.kernels.score
    }

    /// `x`'s values as f32 on the host, whatever the logits mode (a tensor-parallel all-reduce through host memory).
    pub(super) fn download_f32(&self, x: &CudaTensor, out: &mut Vec<f32>) -> Result<()> {
        let mut host = vec![bf16::ZERO; x.rows * x.cols];
        self.inner.gpu.download(&mut host, x.ptr())?;
        out.clear();
        out.extend(host.iter().map(|v| v.to_f32()));
        Ok(())
    }

    /// Overwrite `x` (same shape) with `values`, rounded to bf16.
    pub(super) fn upload_f32(&self, x: &CudaTensor, values: &[f32]) -> Result<()> {
        if values.len() != x.rows * x.cols {
            return internal(format!("upload: {} values for a [{}, {}] tensor", values.len(), x.rows, x.cols));
        }
        let host: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        self.inner.gpu.upload(x.ptr(), &host)?;
        // The staging vector is dropped on return: wait until the driver has read it.
        self.inner.gpu.synchronize()
    }

    /// Make sure `t` can hold `[rows, cols]` bf16, then shape it so.
    fn ensure(&self, t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
        let bytes = rows * cols * 2;
        if t.buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
            let fresh = self.inner.gpu.alloc(bytes + bytes / 4)?;
            if let Some(old) = t.buf.replace(fresh) {
                let mut st = self.state();
                if st.keep_retired {
                    st.retired.push(old);
                }
            }
        }
        t.rows = rows;
        t.cols = cols;
        Ok(())
    }

    /// Attention split-K workspace for `tokens` query tokens; grows (never while capturing).
    fn attention_workspace(&self, tokens: usize, shape: &AttentionShape, splits: usize) -> Result<(u64, u64)> {
        let mut st = self.state();
        let floats = tokens * shape.num_heads * splits * (shape.head_dim + 2);
        let counters = tokens * shape.num_kv_heads;
        let fits = |b: &Option<DeviceBuffer>, bytes: usize| b.as_ref().is_some_and(|b| b.bytes() >= bytes);
        if !fits(&st.attn_partial, floats * 4) || !fits(&st.attn_counters, counters * 4) {
            if st.capture.is_some() {
                return Err(Error::Device("attention workspace too small during graph capture".into()));
            }
            let partial = self.inner.gpu.alloc(floats * 4 * 2)?;
            let count = self.inner.gpu.alloc(counters * 4 * 2)?;
            self.inner.gpu.synchronize()?;
            count.zero()?;
            let keep = st.keep_retired;
            for old in [st.attn_partial.replace(partial), st.attn_counters.replace(count)].into_iter().flatten() {
                if keep {
                    st.retired.push(old);
                }
            }
        }
        Ok((st.attn_partial.as_ref().unwrap().ptr(), st.attn_counters.as_ref().unwrap().ptr()))
    }

    /// Grow the attention workspace ahead of graph capture (capture cannot allocate-and-zero), and upload a
    /// scaled RoPE's frequencies.
    pub(super) fn reserve_attention(&self, tokens: usize, shape: &AttentionShape) -> Result<()> {
        self.rope_frequencies(shape)?;
        self.attention_workspace(tokens, shape, MAX_ATTENTION_SPLITS).map(|_| ())
    }

    /// The device address of a scaled RoPE's inverse frequencies (kernels/rope.cuh `rope_angle`), uploaded on
    /// first use; 0 (null) for plain RoPE, which the kernels compute from theta.
    fn rope_frequencies(&self, shape: &AttentionShape) -> Result<u64> {
        if shape.rope.is_plain() {
            return Ok(0);
        }
        let mut st = self.state();
        if let Some((rope, table)) = &st.rope_frequencies {
            if *rope == shape.rope {
                return Ok(table.ptr());
            }
        }
        if st.capture.is_some() {
            return Err(Error::Device("RoPE frequencies uploaded during graph capture".into()));
        }
        let frequencies = shape.rope.inverse_frequencies(shape.head_dim);
        let table = self.inner.gpu.alloc(frequencies.len() * 4)?;
        self.inner.gpu.upload(table.ptr(), &frequencies)?;
        let ptr = table.ptr();
        if let Some((_, old)) = st.rope_frequencies.replace((shape.rope.clone(), table)) {
            if st.keep_retired {
                st.retired.push(old);
            }
        }
        Ok(ptr)
    }

    fn attention_splits(&self, tokens: usize, num_kv_heads: usize, max_context: Option<usize>) -> usize {
        let wanted = 2 * self.inner.gpu.sm_count / (tokens * num_kv_heads).max(1);
        let mut splits = wanted.clamp(1, MAX_ATTENTION_SPLITS);
        if let Some(ctx) = max_context {
            splits = splits.min(ctx.div_ceil(16)).max(1);
        }
        splits
    }

    /// Grow the argmax keys to `rows` (never while capturing) and return their address.
    fn argmax_keys(&self, rows: usize) -> Result<u64> {
        let mut st = self.state();
        if st.argmax_keys.as_ref().is_none_or(|b| b.bytes() < rows * 8) {
            if st.capture.is_some() {
                return Err(Error::Device("argmax buffer too small during graph capture".into()));
            }
            let fresh = self.inner.gpu.alloc(rows.max(64) * 8 * 2)?;
            if let Some(old) = st.argmax_keys.replace(fresh) {
                if st.keep_retired {
                    st.retired.push(old);
                }
            }
        }
        Ok(st.argmax_keys.as_ref().unwrap().ptr())
    }

    /// Record, while capturing a decode graph, its first kernel (kernels/decode_advance.cu): it moves the graph's
    /// metadata (at `base`, laid out as `layout`, its header at `header`) one step on, from the argmax keys, unless
    /// the host uploaded it. The keys must be reserved for the graph's rows (`reserve_logits_rows`).
    pub(super) fn capture_decode_advance(&self, header: u64, base: u64, layout: &MetaLayout, block_size: usize) -> Result<()> {
        let keys = self.argmax_keys(1)?;
        let section = |offset: usize| Arg::Ptr(base + 4 * offset as u64);
        let args = [
            Arg::Ptr(header),
            section(layout.tokens),
            section(layout.positions),
            section(layout.slots),
            section(layout.seq_info),
            section(layout.tables),
            Arg::Ptr(keys),
            Arg::I32(block_size as i32),
        ];
        self.inner.gpu.launch_plain(self.inner.kernels.advance, (1, 1, 1), 256, &args)
    }

    /// Grow the per-row buffers ahead of graph capture for `rows` logits rows (capture cannot allocate).
    pub(super) fn reserve_logits_rows(&self, rows: usize) -> Result<()> {
        self.argmax_keys(rows).map(|_| ())
    }

    /// Whether an `m`-row projection with inputs `k` wide goes to a GEMV kernel rather than cuBLAS.
    fn use_gemv(&self, m: usize, k: usize) -> bool {
        self.inner.gemv.serves(m, k)
    }

    /// One GEMV launch: `x` is `[m, weight.cols]` at `x`, the output goes to `y` (see [`GemvKind`]).
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        kind: GemvKind,
        m: usize,
        x: u64,
        norm: Option<(&CudaVector, f32)>,
        weight: &CudaMatrix,
        bias: Option<&CudaVector>,
        y: u64,
    ) -> Result<()> {
        let launch = GemvLaunch { kind, norm: norm.map(|(v, eps)| (v.buf.ptr(), eps)), op: projection(m, x, weight, bias, y) };
        self.inner.gemv.launch(&self.inner.gpu, &launch)
    }

    /// Whether an `m`-row projection of `weight` goes to the skinny tensor-core GEMM rather than cuBLAS.
    fn use_skinny(&self, m: usize, weight: &CudaMatrix) -> bool {
        self.inner.skinny.serves(m, weight.rows, weight.cols)
    }

    /// `out = x · Wᵀ (+ bias)` for batches the GEMV kernels do not take: the skinny GEMM where it serves, else
    /// cuBLAS.
    fn linear_beyond_gemv(&self, x: &CudaTensor, weight: &CudaMatrix, bias: Option<&CudaVector>, out: &mut CudaTensor) -> Result<()> {
        if self.use_skinny(x.rows, weight) {
            self.ensure(out, x.rows, weight.rows)?;
            return self.launch_skinny(SkinnyKind::Store, x, None, weight, bias, out.ptr());
        }
        self.cublas_linear(x, weight, bias, out)
    }

    /// One skinny-GEMM launch: `x` is `[x.rows, weight.cols]`, the output goes to `y` (see [`SkinnyKind`]); `norm`:
    /// the RMSNorm's weights and epsilon, for the Norm kinds (`rms_norm(x)` times `weight`).
    fn launch_skinny(
        &self,
        kind: SkinnyKind,
        x: &CudaTensor,
        norm: Option<(&CudaVector, f32)>,
        weight: &CudaMatrix,
        bias: Option<&CudaVector>,
        y: u64,
    ) -> Result<()> {
        let op = projection(x.rows, x.ptr(), weight, bias, y);
        self.inner.skinny.launch(&self.inner.gpu, kind, &op, norm.map(|(w, eps)| (w.buf.ptr(), eps)))
    }

    /// Whether an `m`-row projection of `weight` goes to the skinny GEMM with its RMSNorm inside.
    fn use_skinny_norm(&self, m: usize, weight: &CudaMatrix) -> bool {
        self.inner.skinny.fuses_norm && self.use_skinny(m, weight)
    }

    /// The tensor-core prefill attention and its tiling, when this step has prompts long enough to fill its query
    /// tiles.
    fn tiled_prefill_kernel(
        &self,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &CudaKvCache,
    ) -> Result<Option<(PrefillKernels, PrefillTiling)>> {
        if !self.inner.tiled_prefill || batch.max_query_len < PREFILL_TILED_MIN_QUERY {
            return Ok(None);
        }
        let kernels = self.cache_kernels(cache.shape.dtype)?;
        let Some(&found) = kernels.prefill_attention.iter().find(|k| k.head_dim == shape.head_dim) else {
            return Ok(None);
        };
        let prompts = batch.n_seqs - batch.decode_rows;
        let tiling = self.inner.prefill_tiling.pick(batch.max_query_len, prompts, shape.num_heads, self.inner.gpu.sm_count);
        Ok(Some((found, tiling)))
    }

    fn cache_kernels(&self, dtype: KvCacheDtype) -> Result<&CacheKernels> {
        self.inner.kernels.for_cache(&self.inner.gpu, dtype)
    }

    /// One block per (prompt, query head, tile of `tiling.query_rows()` query tokens); q and k rotated already.
    /// The prompts are the sequences after the step's `decode_rows`, which this leaves alone.
    #[allow(clippy::too_many_arguments)]
    fn launch_prefill_attention(
        &self,
        (kernels, tiling): (PrefillKernels, PrefillTiling),
        qkv: &CudaTensor,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &CudaKvCache,
        layer: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.ensure(out, batch.n_tokens, shape.q_dim())?;
        let splits = self.prefill_splits(tiling, shape, batch);
        let partial = if splits > 1 { self.attention_workspace(batch.n_tokens, shape, splits)?.0 } else { 0 };
        // The kernel finds its sequence's tokens through seq_info, so the prompts' blocks start at their first entry.
        let (first, prompts) = (batch.decode_rows, batch.n_seqs - batch.decode_rows);
        let args = [
            Arg::Ptr(qkv.ptr()),
            Arg::I32(shape.qkv_width() as i32),
            Arg::Ptr(batch.section(batch.layout.seq_info + SEQ_INFO_WORDS * first)),
            Arg::Ptr(batch.section(batch.layout.tables)),
            Arg::Ptr(cache.keys[layer].ptr()),
            Arg::Ptr(cache.values[layer].ptr()),
            Arg::I32(cache.shape.block_size as i32),
            Arg::I32(shape.num_kv_heads as i32),
            Arg::I32(shape.group_size() as i32),
            Arg::F32(shape.softmax_scale()),
            Arg::Ptr(out.ptr()),
            Arg::I32(splits as i32),
            Arg::Ptr(partial),
        ];
        let tiles = batch.max_query_len.div_ceil(tiling.query_rows());
        let grid = (prompts as u32, shape.num_heads as u32, (tiles * splits) as u32);
        let smem = tiling.shared_bytes(shape.head_dim) as u32;
        self.inner.gpu.launch_smem(kernels.for_tiling(tiling), grid, PREFILL_THREADS, smem, &args)?;
        if splits > 1 {
            // The merge of the prompts' tokens, which follow the decode rows' one token each.
            let record = (shape.num_heads * splits * (shape.head_dim + 2)) as u64 * 4;
            let args = [
                Arg::Ptr(partial + first as u64 * record),
                Arg::I32(shape.num_heads as i32),
                Arg::I32(splits as i32),
                Arg::Ptr(out.ptr() + (first * shape.q_dim() * 2) as u64),
            ];
            let grid = ((batch.n_tokens - first) as u32, shape.num_heads as u32, 1);
            self.inner.gpu.launch(kernels.merge, grid, 32, &args)?;
        }
        Ok(())
    }

    /// The RoPE kernel (q/k norm, rotation, K/V written to the cache) over the step's tokens from `first` on.
    #[allow(clippy::too_many_arguments)]
    fn launch_rope_write_kv(
        &self,
        qkv: &mut CudaTensor,
        qk_norm: Option<(&CudaVector, &CudaVector)>,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &mut CudaKvCache,
        layer: usize,
        first: usize,
    ) -> Result<()> {
        if first == batch.n_tokens {
            return Ok(());
        }
        let (qn, kn) = qk_norm.map_or((0, 0), |(q, k)| (q.buf.ptr(), k.buf.ptr()));
        let token_words = |section: usize| batch.section(section + first);
        let args = [
            Arg::Ptr(qkv.ptr() + (first * qkv.cols * 2) as u64),
            Arg::I32(shape.qkv_width() as i32),
            Arg::Ptr(qn),
            Arg::Ptr(kn),
            Arg::I32(qk_norm.is_some() as i32),
            Arg::F32(shape.qk_norm_eps),
            Arg::Ptr(token_words(batch.layout.positions)),
            Arg::Ptr(token_words(batch.layout.slots)),
            Arg::Ptr(cache.keys[layer].ptr()),
            Arg::Ptr(cache.values[layer].ptr()),
            Arg::I32(shape.num_heads as i32),
            Arg::I32(shape.num_kv_heads as i32),
            Arg::I32(shape.head_dim as i32),
            Arg::F32(shape.rope.theta),
            Arg::Ptr(self.rope_frequencies(shape)?),
            Arg::I32(cache.shape.block_size as i32),
        ];
        let grid = ((batch.n_tokens - first) as u32, 1, 1);
        self.inner.gpu.launch(self.cache_kernels(cache.shape.dtype)?.rope, grid, 32 * ROPE_WARPS as u32, &args)
    }

    /// Key splits for this step's prefill attention: only narrow blocks split (wide ones are picked for grids of
    /// several waves).
    fn prefill_splits(&self, tiling: PrefillTiling, shape: &AttentionShape, batch: &CudaBatch) -> usize {
        if tiling != PrefillTiling::NARROW {
            return 1;
        }
        let key_tiles = batch.prompt_max_context.div_ceil(tiling.key_tile);
        self.inner.prefill_splits.pick(batch.long_query_tiles * shape.num_heads, key_tiles, self.inner.gpu.sm_count)
    }

    /// The paged attention kernel for this shape over the step's first `rows` tokens; with
    /// [`QkRotation::InKernel`] (one-token sequences only), the variant that also normalizes and rotates q and k
    /// and writes the new K and V to the cache.
    #[allow(clippy::too_many_arguments)]
    fn launch_attention(
        &self,
        qkv: &CudaTensor,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &CudaKvCache,
        layer: usize,
        out: &mut CudaTensor,
        rows: usize,
        rotation: QkRotation<'_>,
    ) -> Result<()> {
        let key = (shape.head_dim, shape.group_size());
        let kernels = self.cache_kernels(cache.shape.dtype)?;
        let (family, qk_norm) = match rotation {
            QkRotation::Done => (&kernels.attention, None),
            // The tensor-core loop takes 16 positions of one cache block at a time.
            QkRotation::InKernel(qk_norm) if self.inner.mma_attention && cache.shape.block_size.is_multiple_of(16) => {
                (&kernels.attention_mma, qk_norm)
            }
            QkRotation::InKernel(qk_norm) => (&kernels.attention_rope, qk_norm),
        };
        let Some(&(_, f)) = family.iter().find(|(k, _)| *k == key) else {
            return Err(Error::Device(format!(
                "no CUDA attention kernel for head_dim {} with {} query heads per KV head; add it to ATTENTION_SHAPES in kernels/attention.cuh",
                key.0, key.1
            )));
        };
        self.ensure(out, batch.n_tokens, shape.q_dim())?;
        if rows == 0 {
            return Ok(());
        }
        let splits = self.attention_splits(rows, shape.num_kv_heads, batch.max_context);
        let (partial, counters) = self.attention_workspace(rows, shape, splits)?;
        let (qn, kn) = qk_norm.map_or((0, 0), |(q, k)| (q.buf.ptr(), k.buf.ptr()));
        let args = [
            Arg::Ptr(qkv.ptr()),
            Arg::I32(shape.qkv_width() as i32),
            Arg::Ptr(batch.section(batch.layout.positions)),
            Arg::Ptr(batch.section(batch.layout.token_seq)),
            Arg::Ptr(batch.section(batch.layout.seq_info)),
            Arg::Ptr(batch.section(batch.layout.tables)),
            Arg::Ptr(cache.keys[layer].ptr()),
            Arg::Ptr(cache.values[layer].ptr()),
            Arg::I32(cache.shape.block_size as i32),
            Arg::I32(shape.num_kv_heads as i32),
            Arg::F32(shape.softmax_scale()),
            Arg::Ptr(out.ptr()),
            Arg::Ptr(partial),
            Arg::Ptr(counters),
            // The rotating variant's arguments (ROTATION_ARGS of them).
            Arg::Ptr(qn),
            Arg::Ptr(kn),
            Arg::F32(shape.qk_norm_eps),
            Arg::F32(shape.rope.theta),
            Arg::Ptr(self.rope_frequencies(shape)?),
            Arg::Ptr(batch.section(batch.layout.slots)),
        ];
        let args = match rotation {
            QkRotation::Done => &args[..args.len() - ROTATION_ARGS],
            QkRotation::InKernel(_) => &args[..],
        };
        self.inner.gpu.launch(f, (rows as u32, shape.num_kv_heads as u32, splits as u32), 128, args)
    }

    /// `out = x · Wᵀ (+ bias)` on cuBLAS (the bias by a second kernel).
    fn cublas_linear(&self, x: &CudaTensor, weight: &CudaMatrix, bias: Option<&CudaVector>, out: &mut CudaTensor) -> Result<()> {
        let (m, n, k) = (x.rows, weight.rows, weight.cols);
        self.ensure(out, m, n)?;
        if m == 0 {
            return Ok(());
        }
        self.inner.blas.gemm_bf16(x.ptr(), weight.buf.ptr(), out.ptr(), m, n, k, false)?;
        if let Some(bias) = bias {
            let grid = (m * n).div_ceil(256).clamp(1, 4 * self.inner.gpu.sm_count) as u32;
            let args = [Arg::Ptr(out.ptr()), Arg::Ptr(bias.buf.ptr()), Arg::I32(m as i32), Arg::I32(n as i32)];
            self.inner.gpu.launch(self.inner.kernels.add_bias, (grid, 1, 1), 256, &args)?;
        }
        Ok(())
    }

    fn check_linear(x: &CudaTensor, weight: &CudaMatrix) -> Result<()> {
        if x.cols != weight.cols {
            return internal(format!("linear: input width {} but weight width {}", x.cols, weight.cols));
        }
        Ok(())
    }

    fn check_norm(x: &CudaTensor, norm: &CudaVector) -> Result<()> {
        if x.cols != norm.len {
            return internal(format!("rms_norm: input width {} but weight width {}", x.cols, norm.len));
        }
        Ok(())
    }

    fn block_for(cols: usize) -> u32 {
        (cols / 8).div_ceil(32).clamp(1, 32) as u32 * 32
    }
}

/// The operands of `y = x · weightᵀ (+ bias)` with `x` `[rows, weight.cols]` at `x`.
fn projection(rows: usize, x: u64, weight: &CudaMatrix, bias: Option<&CudaVector>, y: u64) -> Projection {
    Projection { rows, x, weight: weight.buf.ptr(), n: weight.rows, k: weight.cols, bias: bias.map_or(0, |b| b.buf.ptr()), y }
}

fn to_bf16(data: &[f32]) -> Vec<bf16> {
    data.par_iter().with_min_len(1 << 16).map(|&x| bf16::from_f32(x)).collect()
}

fn internal<T>(msg: String) -> Result<T> {
    Err(Error::Internal(msg))
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type KvCache = CudaKvCache;
    type Batch = CudaBatch;

    fn description(&self) -> String {
        let name = self.inner.gpu.ctx.name().unwrap_or_else(|_| "GPU".into());
        format!("cuda:{} {name} (bf16)", self.inner.gpu.ctx.ordinal())
    }

    fn upload_matrix(&self, host: HostTensor) -> Result<CudaMatrix> {
        let [rows, cols] = host.shape[..] else {
            return internal(format!("upload_matrix wants a 2-D tensor, got shape {:?}", host.shape));
        };
        if cols % 8 != 0 {
            return Err(Error::Device(format!(
                "the CUDA backend needs matrix widths that are multiples of 8 (16-byte rows); got {cols}"
            )));
        }
        let data = to_bf16(&host.values());
        let buf = self.inner.gpu.alloc(data.len() * 2)?;
        self.inner.gpu.upload(buf.ptr(), &data)?;
        self.inner.gpu.synchronize()?;
        Ok(CudaMatrix { buf, rows, cols })
    }

    fn matrix_bytes(&self, matrix: &CudaMatrix) -> usize {
        matrix.buf.bytes()
    }

    fn upload_vector(&self, host: HostTensor) -> Result<CudaVector> {
        let values = host.values();
        let buf = self.inner.gpu.alloc(values.len() * 4)?;
        self.inner.gpu.upload(buf.ptr(), &values)?;
        self.inner.gpu.synchronize()?;
        Ok(CudaVector { buf, len: values.len() })
    }

    fn new_tensor(&self) -> CudaTensor {
        CudaTensor::default()
    }

    fn allocate_kv_cache(&self, shape: KvCacheShape) -> Result<CudaKvCache> {
        // Load the cache's kernels now: a failure is a load-time error, and no module loads during a capture.
        self.cache_kernels(shape.dtype)?;
        let bytes = (shape.num_blocks + 1) * shape.block_size * shape.kv_dim() * shape.dtype.gpu_value_bytes();
        let mut keys = Vec::with_capacity(shape.num_layers);
        let mut values = Vec::with_capacity(shape.num_layers);
        for _ in 0..shape.num_layers {
            keys.push(self.inner.gpu.alloc(bytes)?);
            values.push(self.inner.gpu.alloc(bytes)?);
        }
        Ok(CudaKvCache { shape, keys, values })
    }

    fn new_batch(&self) -> CudaBatch {
        CudaBatch::default()
    }

    fn upload_batch(&self, plan: &BatchPlan, batch: &mut CudaBatch) -> Result<()> {
        self.inner.gpu.bind()?;
        batch.n_tokens = plan.num_tokens();
        batch.n_logits = plan.logits_rows.len();
        batch.n_seqs = plan.seqs.len();
        let capture = self.state().capture;
        if let Some((base, layout)) = capture {
            // Capturing: kernels read the fixed graph buffer, filled before each replay.
            batch.base = base;
            batch.layout = layout;
            batch.max_context = None;
            batch.max_query_len = 1; // only decode steps are captured
            batch.decode_rows = plan.seqs.len();
            batch.prompt_max_context = 0;
            batch.long_query_tiles = 0;
            return Ok(());
        }
        let layout = MetaLayout::new(plan.num_tokens(), plan.seqs.len(), plan.logits_rows.len(), plan.block_tables.len());
        let mut st = self.state();
        st.staging.resize(layout.total, 0);
        layout.pack(plan, &mut st.staging);
        if batch.own.as_ref().is_none_or(|b| b.bytes() < layout.total * 4) {
            let fresh = self.inner.gpu.alloc(layout.total * 4 * 2)?;
            if let Some(old) = batch.own.replace(fresh) {
                if st.keep_retired {
                    st.retired.push(old);
                }
            }
        }
        let own = batch.own.as_ref().unwrap();
        self.inner.gpu.upload(own.ptr(), &st.staging)?;
        batch.base = own.ptr();
        batch.layout = layout;
        batch.max_context = plan.seqs.iter().map(|s| s.context_len()).max();
        batch.max_query_len = plan.max_query_len();
        batch.decode_rows = if self.inner.mixed_decode_rows { leading_one_token_seqs(&plan.seqs) } else { 0 };
        let prompts = &plan.seqs[batch.decode_rows..];
        batch.prompt_max_context = prompts.iter().map(|s| s.context_len()).max().unwrap_or(0);
        batch.long_query_tiles = long_query_tiles(prompts);
        Ok(())
    }

    fn embed(&self, table: &CudaMatrix, batch: &CudaBatch, out: &mut CudaTensor) -> Result<()> {
        self.ensure(out, batch.n_tokens, table.cols)?;
        let args = [
            Arg::Ptr(table.buf.ptr()),
            Arg::Ptr(batch.section(batch.layout.tokens)),
            Arg::Ptr(out.ptr()),
            Arg::I32(table.cols as i32),
        ];
        // Without programmatic dependence: in a decode graph the kernel before it writes the metadata (see
        // `capture_decode_advance`), which the embedding and every later kernel may read before their wait.
        self.inner.gpu.launch_plain(self.inner.kernels.embed, (batch.n_tokens as u32, 1, 1), Self::block_for(table.cols), &args)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32, out: &mut CudaTensor) -> Result<()> {
        Self::check_norm(x, weight)?;
        self.ensure(out, x.rows, x.cols)?;
        if x.rows == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(x.ptr()), Arg::Ptr(weight.buf.ptr()), Arg::F32(eps), Arg::Ptr(out.ptr()), Arg::I32(x.cols as i32)];
        self.inner.gpu.launch(self.inner.kernels.rms_norm, (x.rows as u32, 1, 1), Self::block_for(x.cols), &args)
    }

    fn add(&self, x: &mut CudaTensor, delta: &CudaTensor) -> Result<()> {
        if (x.rows, x.cols) != (delta.rows, delta.cols) {
            return internal(format!("add: shapes [{}, {}] and [{}, {}] differ", x.rows, x.cols, delta.rows, delta.cols));
        }
        let n = x.rows * x.cols;
        if n == 0 {
            return Ok(());
        }
        let grid = n.div_ceil(256).clamp(1, 4 * self.inner.gpu.sm_count) as u32;
        let args = [Arg::Ptr(x.ptr()), Arg::Ptr(delta.ptr()), Arg::I32(n as i32)];
        self.inner.gpu.launch(self.inner.kernels.add_into, (grid, 1, 1), 256, &args)
    }

    fn linear(&self, x: &CudaTensor, weight: &CudaMatrix, bias: Option<&CudaVector>, out: &mut CudaTensor) -> Result<()> {
        Self::check_linear(x, weight)?;
        if !self.use_gemv(x.rows, weight.cols) {
            return self.linear_beyond_gemv(x, weight, bias, out);
        }
        self.ensure(out, x.rows, weight.rows)?;
        self.launch_gemv(GemvKind::Plain, x.rows, x.ptr(), None, weight, bias, out.ptr())
    }

    fn norm_linear(
        &self,
        x: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        weight: &CudaMatrix,
        bias: Option<&CudaVector>,
        normed: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<()> {
        Self::check_norm(x, norm)?;
        Self::check_linear(x, weight)?;
        if !self.use_gemv(x.rows, weight.cols) {
            if self.use_skinny_norm(x.rows, weight) {
                self.ensure(out, x.rows, weight.rows)?;
                return self.launch_skinny(SkinnyKind::NormStore, x, Some((norm, eps)), weight, bias, out.ptr());
            }
            self.rms_norm(x, norm, eps, normed)?;
            return self.linear_beyond_gemv(normed, weight, bias, out);
        }
        self.ensure(out, x.rows, weight.rows)?;
        self.launch_gemv(GemvKind::Norm, x.rows, x.ptr(), Some((norm, eps)), weight, bias, out.ptr())
    }

    fn norm_linear_silu(
        &self,
        x: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        gate_up: &CudaMatrix,
        normed: &mut CudaTensor,
        product: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<()> {
        Self::check_norm(x, norm)?;
        Self::check_linear(x, gate_up)?;
        if !gate_up.rows.is_multiple_of(16) {
            return internal(format!("gate_up wants [gate | up] halves of 8k rows, got {} rows", gate_up.rows));
        }
        if !self.use_gemv(x.rows, gate_up.cols) {
            if self.use_skinny_norm(x.rows, gate_up) {
                self.ensure(out, x.rows, gate_up.rows / 2)?;
                return self.launch_skinny(SkinnyKind::NormSilu, x, Some((norm, eps)), gate_up, None, out.ptr());
            }
            self.rms_norm(x, norm, eps, normed)?;
            if self.use_skinny(x.rows, gate_up) {
                self.ensure(out, x.rows, gate_up.rows / 2)?;
                return self.launch_skinny(SkinnyKind::Silu, normed, None, gate_up, None, out.ptr());
            }
            self.cublas_linear(normed, gate_up, None, product)?;
            return self.silu_mul(product, out);
        }
        self.ensure(out, x.rows, gate_up.rows / 2)?;
        self.launch_gemv(GemvKind::NormSilu, x.rows, x.ptr(), Some((norm, eps)), gate_up, None, out.ptr())
    }

    fn linear_add(
        &self,
        x: &CudaTensor,
        weight: &CudaMatrix,
        bias: Option<&CudaVector>,
        product: &mut CudaTensor,
        residual: &mut CudaTensor,
    ) -> Result<()> {
        Self::check_linear(x, weight)?;
        if (residual.rows, residual.cols) != (x.rows, weight.rows) {
            return internal(format!(
                "linear_add: residual [{}, {}] for a [{}, {}] product",
                residual.rows, residual.cols, x.rows, weight.rows
            ));
        }
        if self.use_gemv(x.rows, weight.cols) {
            return self.launch_gemv(GemvKind::AddInto, x.rows, x.ptr(), None, weight, bias, residual.ptr());
        }
        if self.use_skinny(x.rows, weight) {
            return self.launch_skinny(SkinnyKind::AddInto, x, None, weight, bias, residual.ptr());
        }
        if bias.is_some() {
            self.cublas_linear(x, weight, bias, product)?;
            return self.add(residual, product);
        }
        if x.rows == 0 {
            return Ok(());
        }
        // cuBLAS adds into the residual itself (beta = 1): one rounding instead of transformers' two.
        self.inner.blas.gemm_bf16(x.ptr(), weight.buf.ptr(), residual.ptr(), x.rows, weight.rows, weight.cols, true)
    }

    fn rope_and_write_kv(
        &self,
        qkv: &mut CudaTensor,
        qk_norm: Option<(&CudaVector, &CudaVector)>,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &mut CudaKvCache,
        layer: usize,
    ) -> Result<()> {
        check_attention(qkv, shape, batch, cache, layer)?;
        check_rope_head_dim(shape)?;
        self.launch_rope_write_kv(qkv, qk_norm, shape, batch, cache, layer, 0)
    }

    fn paged_attention(
        &self,
        qkv: &CudaTensor,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &CudaKvCache,
        layer: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_attention(qkv, shape, batch, cache, layer)?;
        let Some(kernel) = self.tiled_prefill_kernel(shape, batch, cache)? else {
            return self.launch_attention(qkv, shape, batch, cache, layer, out, batch.n_tokens, QkRotation::Done);
        };
        self.launch_prefill_attention(kernel, qkv, shape, batch, cache, layer, out)?;
        self.launch_attention(qkv, shape, batch, cache, layer, out, batch.decode_rows, QkRotation::Done)
    }

    fn rope_attention(
        &self,
        qkv: &mut CudaTensor,
        qk_norm: Option<(&CudaVector, &CudaVector)>,
        shape: &AttentionShape,
        batch: &CudaBatch,
        cache: &mut CudaKvCache,
        layer: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_attention(qkv, shape, batch, cache, layer)?;
        check_rope_head_dim(shape)?;
        let rotating = QkRotation::InKernel(qk_norm);
        if batch.is_decode() {
            return self.launch_attention(qkv, shape, batch, cache, layer, out, batch.n_tokens, rotating);
        }
        let Some(kernel) = self.tiled_prefill_kernel(shape, batch, cache)? else {
            self.launch_rope_write_kv(qkv, qk_norm, shape, batch, cache, layer, 0)?;
            return self.launch_attention(qkv, shape, batch, cache, layer, out, batch.n_tokens, QkRotation::Done);
        };
        // The prompts' q and k go through the RoPE kernel; the decode rows' through their attention kernel, as in
        // a decode step.
        self.launch_rope_write_kv(qkv, qk_norm, shape, batch, cache, layer, batch.decode_rows)?;
        self.launch_prefill_attention(kernel, qkv, shape, batch, cache, layer, out)?;
        self.launch_attention(qkv, shape, batch, cache, layer, out, batch.decode_rows, rotating)
    }

    fn silu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<()> {
        if !gate_up.cols.is_multiple_of(16) {
            return internal(format!("silu_mul wants [gate | up] rows with halves of 8k, got width {}", gate_up.cols));
        }
        let half = gate_up.cols / 2;
        self.ensure(out, gate_up.rows, half)?;
        let vecs = gate_up.rows * half / 8;
        let grid = vecs.div_ceil(256).clamp(1, 4 * self.inner.gpu.sm_count) as u32;
        let args = [Arg::Ptr(gate_up.ptr()), Arg::Ptr(out.ptr()), Arg::I32(gate_up.rows as i32), Arg::I32(half as i32)];
        self.inner.gpu.launch(self.inner.kernels.silu_mul, (grid, 1, 1), 256, &args)
    }

    fn select_logits_rows(&self, x: &CudaTensor, batch: &CudaBatch, out: &mut CudaTensor) -> Result<()> {
        self.ensure(out, batch.n_logits, x.cols)?;
        if batch.n_logits == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(x.ptr()), Arg::Ptr(batch.section(batch.layout.logits_rows)), Arg::Ptr(out.ptr()), Arg::I32(x.cols as i32)];
        self.inner.gpu.launch(self.inner.kernels.select_rows, (batch.n_logits as u32, 1, 1), Self::block_for(x.cols), &args)
    }

    fn copy_to_host(&self, x: &CudaTensor, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        let on_device = {
            let st = self.state();
            st.capture.is_some() || st.logits_on_device
        };
        if on_device {
            // Logits stay for GPU sampling; the greedy token of every row is found here, inside a decode graph.
            let keys = self.argmax_keys(x.rows)?;
            if x.rows > 0 {
                if !x.cols.is_multiple_of(8) {
                    return Err(Error::Device(format!("the CUDA argmax needs a vocabulary that is a multiple of 8, not {}", x.cols)));
                }
                self.inner.gpu.zero_async(keys, x.rows * 8)?;
                let per_row = argmax_blocks_per_row(x.rows, x.cols, self.inner.gpu.sm_count) as u32;
                let args = [Arg::Ptr(x.ptr()), Arg::I32(x.cols as i32), Arg::Ptr(keys)];
                self.inner.gpu.launch(self.inner.kernels.argmax, (x.rows as u32, per_row, 1), 256, &args)?;
            }
            self.state().last_logits = Some(DeviceLogits { ptr: x.ptr(), argmax: keys });
            return Ok(());
        }
        let mut host = vec![bf16::ZERO; x.rows * x.cols];
        self.inner.gpu.download(&mut host, x.ptr())?;
        out.extend(host.iter().map(|v| v.to_f32()));
        Ok(())
    }
}

/// What the RoPE code of kernels/rope.cuh handles: up to 4 pairs per lane, V heads copied 8 values per lane.
fn check_rope_head_dim(shape: &AttentionShape) -> Result<()> {
    if shape.head_dim > 256 || !shape.head_dim.is_multiple_of(8) {
        return Err(Error::Device(format!(
            "the CUDA RoPE kernels support head_dim <= 256 and a multiple of 8, not {}",
            shape.head_dim
        )));
    }
    Ok(())
}

fn check_attention(qkv: &CudaTensor, shape: &AttentionShape, batch: &CudaBatch, cache: &CudaKvCache, layer: usize) -> Result<()> {
    if layer >= cache.shape.num_layers {
        return internal(format!("layer {layer} of a {}-layer KV cache", cache.shape.num_layers));
    }
    if (shape.num_kv_heads, shape.head_dim) != (cache.shape.num_kv_heads, cache.shape.head_dim) {
        return internal(format!("attention shape {shape:?} does not match KV cache {:?}", cache.shape));
    }
    if qkv.cols != shape.qkv_width() || qkv.rows != batch.n_tokens {
        return internal(format!("qkv is [{}, {}] for {} tokens of width {}", qkv.rows, qkv.cols, batch.n_tokens, shape.qkv_width()));
    }
    Ok(())
}

/// How many sequences at the start of a step have one query token each (`CudaBatch::decode_rows`); all of them in
/// a decode step.
fn leading_one_token_seqs(seqs: &[PlannedSeq]) -> usize {
    seqs.iter().take_while(|s| s.len == 1).count()
}

/// Narrow prefill-attention query tiles of the sequences whose context is at least half the longest
/// (`CudaBatch::long_query_tiles`).
fn long_query_tiles(seqs: &[PlannedSeq]) -> usize {
    let longest = seqs.iter().map(|s| s.context_len()).max().unwrap_or(0);
    seqs.iter().filter(|s| 2 * s.context_len() >= longest).map(|s| (s.len as usize).div_ceil(PREFILL_QUERY_TILE)).sum()
}

/// Blocks per row of the argmax kernel over `rows` rows of `vocab` logits: 8 loads of 16 bytes per thread (256
/// threads a block), or, while the grid stays under four blocks per multiprocessor, one load per thread. With a
/// few rows the pass is one round trip instead of eight (Qwen3's 151,936 logits at batch 1: 75 blocks, not 10).
fn argmax_blocks_per_row(rows: usize, vocab: usize, sm_count: usize) -> usize {
    let loads = vocab / 8;
    let eight_per_thread = loads.div_ceil(256 * 8).clamp(1, 64);
    let one_per_thread = loads.div_ceil(256);
    one_per_thread.min((4 * sm_count).div_ceil(rows.max(1))).max(eight_per_thread)
}

#[cfg(test)]
mod tests {
    use super::{
        argmax_blocks_per_row, leading_one_token_seqs, long_query_tiles, PlannedSeq, PrefillSplitChoice, PrefillTiling,
        PrefillTilingChoice,
    };

    #[test]
    fn only_long_contexts_count_toward_the_prefill_split() {
        let seq = |len, past_len| PlannedSeq { len, past_len, ..PlannedSeq::default() };
        // A 256-token chunk at 3,544 cached tokens beside eight decode rows at ~200 (left in the prefill kernel by
        // STEPLLM_NO_MIXED_DECODE_ROWS=1): only the chunk's 4 tiles.
        let mut mixed = vec![seq(256, 3544)];
        mixed.extend((0..8).map(|i| seq(1, 200 + i)));
        assert_eq!(long_query_tiles(&mixed), 4);
        // A group of prompts, the shortest exactly half the longest: all of them (2 + 2 + 1 tiles).
        assert_eq!(long_query_tiles(&[seq(100, 0), seq(128, 0), seq(64, 0)]), 5);
        // Shorter than half the longest: left out.
        assert_eq!(long_query_tiles(&[seq(100, 0), seq(128, 0), seq(63, 0)]), 4);
        assert_eq!(long_query_tiles(&[]), 0);
    }

    #[test]
    fn a_mixed_steps_leading_one_token_rows_leave_the_prefill_kernel() {
        let seq = |len, past_len| PlannedSeq { len, past_len, ..PlannedSeq::default() };
        // Decode rows first (forward_order), then a prompt's one-token last chunk and a prompt: the chunk goes with
        // the decode rows, so only the prompt's query tile counts toward the split, not the rows' long contexts.
        let step = [seq(1, 900), seq(1, 300), seq(1, 128), seq(40, 0)];
        assert_eq!(leading_one_token_seqs(&step), 3);
        assert_eq!(long_query_tiles(&step[3..]), 1);
        // A prompt first: nothing leaves (a one-token sequence after it stays in the prefill kernel).
        assert_eq!(leading_one_token_seqs(&[seq(40, 0), seq(1, 300)]), 0);
        // A decode step: every row.
        assert_eq!(leading_one_token_seqs(&[seq(1, 5), seq(1, 9)]), 2);
    }

    #[test]
    fn prefill_keys_split_only_when_the_query_tiles_leave_the_wave_unfilled() {
        let auto = |busy, key_tiles| PrefillSplitChoice::Auto.pick(busy, key_tiles, 132);
        // The last 256-token chunk of a 3,800-token prompt, Qwen3's 16 heads: 64 blocks over 60 K/V tiles (running
        // requests' decode rows beside it have short contexts and are not counted).
        assert_eq!(auto(64, 60), 4);
        // A 1,024-token chunk: 256 blocks, nearly a wave already; two splits would spill into a second.
        assert_eq!(auto(256, 60), 1);
        // A 128-token chunk at 1,100 tokens of context (tests/test_gpu.py's chunked split test): 32 blocks, 18 tiles.
        assert_eq!(auto(32, 18), 4);
        // Early chunks have too few keys to share out.
        assert_eq!(auto(32, 4), 1);
        assert_eq!(auto(32, 8), 2);
        // A whole prompt of 1,100 tokens fills the wave alone; so do a mixed workload's groups.
        assert_eq!(auto(18 * 16, 18), 1);
        assert_eq!(auto(400, 40), 1);
        // One short tail over a long cached prefix: as many splits as the cap allows.
        assert_eq!(auto(16, 200), 8);
        // The switch forces a count (capped at PREFILL_MAX_SPLITS by from_env), whatever the step.
        assert_eq!(PrefillSplitChoice::Forced(3).pick(10_000, 1, 132), 3);
    }

    #[test]
    fn wide_prefill_blocks_only_where_they_were_measured_to_win() {
        let auto = |len, seqs, heads| PrefillTilingChoice::Auto.pick(len, seqs, heads, 132);
        // Qwen3-0.6B's 16 heads on an H100: one 3,800-token prompt (480 wide blocks) won; 2,048 and 512 lost.
        assert_eq!(auto(3800, 1, 16), PrefillTiling::WIDE);
        assert_eq!(auto(2048, 1, 16), PrefillTiling::NARROW);
        assert_eq!(auto(512, 1, 16), PrefillTiling::NARROW);
        // Long enough, but too few blocks to fill one and a half waves: SmolLM2's 9 heads.
        assert_eq!(auto(3800, 1, 9), PrefillTiling::NARROW);
        // Many short prompts fill the GPU but were not measured wide: the mixed workload's groups stay narrow.
        assert_eq!(auto(1024, 8, 16), PrefillTiling::NARROW);
        // The switch forces either, whatever the step.
        assert_eq!(PrefillTilingChoice::Forced(PrefillTiling::WIDE).pick(16, 1, 1, 132), PrefillTiling::WIDE);
        assert_eq!(PrefillTilingChoice::Forced(PrefillTiling::NARROW).pick(8000, 4, 32, 132), PrefillTiling::NARROW);
    }

    #[test]
    fn prefill_blocks_ask_for_their_tiles_and_the_wide_ones_for_their_queries() {
        // head_dim 128, rows padded by 8: two stages of K and V of 64 positions, or of 32 plus 128 queries.
        assert_eq!(PrefillTiling::NARROW.shared_bytes(128), 4 * 64 * 136 * 2);
        assert_eq!(PrefillTiling::WIDE.shared_bytes(128), (4 * 32 + 128) * 136 * 2);
        assert_eq!(PrefillTiling::WIDE.query_rows(), 128);
    }

    #[test]
    fn argmax_takes_one_load_per_thread_for_few_rows_and_eight_for_many() {
        // Qwen3's vocabulary on an H200 (132 multiprocessors): 18,992 loads of 16 bytes a row.
        assert_eq!(argmax_blocks_per_row(1, 151_936, 132), 75);
        assert_eq!(argmax_blocks_per_row(8, 151_936, 132), 66);
        // Many rows fill the GPU anyway: eight loads per thread, as before.
        assert_eq!(argmax_blocks_per_row(64, 151_936, 132), 10);
        assert_eq!(argmax_blocks_per_row(256, 151_936, 132), 10);
        // A small vocabulary never gets fewer blocks than it has 2,048-load chunks, nor zero.
        assert_eq!(argmax_blocks_per_row(1, 49_152, 132), 24);
        assert_eq!(argmax_blocks_per_row(1, 8, 132), 1);
    }
}
