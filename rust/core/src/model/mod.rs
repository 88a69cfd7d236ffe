//! Models: configuration, loading, and the one forward over a ragged batch.

pub mod config;
pub mod llama;
pub mod loader;
pub mod rope;

use crate::backend::KvCacheDtype;
use crate::error::Result;
pub use config::{Architecture, ModelConfig};
pub use rope::{Rope, RopeScaling};

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// How a backend keeps weight matrices in memory. Activations and accumulation stay f32 on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// Exact f32 (the CPU default).
    F32,
    /// bf16, half the bytes (the only CUDA dtype).
    Bf16,
    /// int8 with one scale per weight row (CPU only).
    Int8,
    /// Integer levels (a GGUF's own, else 8-bit per 32 weights) times activations rounded to 8 bits per 32
    /// values: integer dot products, llama.cpp's arithmetic (CPU only).
    A8,
}

impl WeightDtype {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "int8" => Ok(Self::Int8),
            "a8" => Ok(Self::A8),
            other => crate::error::invalid(format!("unknown dtype {other:?}; use \"f32\", \"bf16\", \"int8\" or \"a8\"")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::A8 => "a8",
        }
    }
}

/// One sequence's part of a ragged batch.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSlice {
    /// Offset of this sequence's first query token in `ForwardBatch::tokens`.
    pub start: usize,
    /// Number of query tokens (prompt chunk in prefill, 1 in decode).
    pub len: usize,
    /// Tokens already in the KV cache before this step; the query tokens sit at positions past_len.. .
    pub past_len: usize,
    /// Physical KV block ids covering positions 0..past_len+len, in order; a decode row's goes on with up to
    /// [`DECODE_TABLE_LOOKAHEAD`] blocks reserved for its next tokens.
    pub block_table: Vec<u32>,
}

/// Blocks past a decode row's context that the stepper appends to its `SeqSlice::block_table` when the row's
/// lease holds them (the whole generate budget is reserved at admission): a CUDA decode graph uploads them, so
/// the device can move the row into its next block by itself (backend/cuda/decode_advance.rs). Backends read
/// only the blocks that cover the context.
pub const DECODE_TABLE_LOOKAHEAD: usize = 4;

/// vLLM-V1-style ragged batch: prefill, decode and mixed steps share one description.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    /// Absolute position of each token (past_len + offset within its sequence).
    pub positions: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    /// Indices into `tokens` whose logits are wanted; output rows come in this order.
    pub logits_for: Vec<usize>,
}

/// What the last forward of a runner spent blocked waiting for the device, and whether it was replayed from
/// a CUDA graph. A CPU runner computes on the calling thread and never waits: it reports the default (0,
/// false). The stepper copies this into each step's [`crate::step::StepExecution`], so the host time of a
/// step is `elapsed_us - device_wait_us`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// Microseconds the last forward (and its sampling) spent blocked on the device: synchronizing a
    /// stream, waiting for a device-to-host copy of its results.
    pub device_wait_us: u64,
    /// Whether the last forward was replayed from a captured CUDA graph.
    pub cuda_graph: bool,
    /// Whether that replay moved the batch metadata on on the device instead of uploading it.
    pub metadata_on_device: bool,
}

/// A loaded model on a device: owns weights and the paged KV cache.
pub trait ModelRunner: Send {
    fn config(&self) -> &ModelConfig;
    /// Size the paged KV cache: `num_blocks` blocks of `block_size` tokens for every layer, stored as `dtype`.
    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> Result<()>;
    /// Compute one ragged batch, writing its K/V into the cache. Returns row-major logits,
    /// `batch.logits_for.len()` rows of `vocab_size` floats.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>>;
    /// Forward, then sample one token per logits row with that row's parameters. The default samples on
    /// the host from `forward`'s logits; a GPU runner overrides it to sample on the device and copy back
    /// only the chosen tokens (and logprobs when asked).
    fn forward_and_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        let mut logits = self.forward(batch)?;
        Ok(crate::sampling::sample_rows(&mut logits, self.config().vocab_size, rows))
    }
    /// Sample one token per row of host `logits` (rows back to back). Runners under tensor parallelism override
    /// it so that one rank samples and every rank commits its tokens.
    fn sample_host_logits(
        &mut self,
        logits: &mut [f32],
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        Ok(crate::sampling::sample_rows(logits, self.config().vocab_size, rows))
    }
    /// [`forward_and_sample`](Self::forward_and_sample) for a batch whose `logits_for` lists the sampled rows
    /// first and then one row per entry of `scores` (prompt tokens whose logprobs are wanted). This default scores
    /// them on the host from the whole logits (the CUDA runner scores them on the device, where its logits stay);
    /// without scores this is `forward_and_sample`.
    fn forward_sample_and_score(
        &mut self,
        batch: &ForwardBatch,
        rows: &[crate::sampling::RowContext],
        scores: &[crate::sampling::ScoreRow],
    ) -> Result<(Vec<crate::sampling::Sampled>, Vec<crate::request::TokenLogprob>)> {
        if scores.is_empty() {
            return Ok((self.forward_and_sample(batch, rows)?, Vec::new()));
        }
        let mut logits = self.forward(batch)?;
        let vocab = self.config().vocab_size;
        let (sampled, scored) = logits.split_at_mut(rows.len() * vocab);
        let scored = crate::sampling::score_rows(scored, vocab, scores);
        Ok((self.sample_host_logits(sampled, rows)?, scored))
    }
    /// Human-readable device and dtype, e.g. "cpu (f32)".
    fn device_description(&self) -> String;
    fn parameter_count(&self) -> usize;
    /// Bytes the weights take where they are kept (host memory on the CPU, device memory on a GPU).
    fn weight_bytes(&self) -> usize;
    /// (bytes in use, total bytes) of the GPU this runner's model lives on, for sizing its KV cache; None where
    /// the model lives in host memory.
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }
    /// Capture CUDA graphs for decode; false where the backend has none (the CPU).
    fn capture_decode_graphs(&mut self, _max_batch_size: usize) -> Result<bool> {
        Ok(false)
    }
    /// Timing of the most recent `forward` / `forward_and_sample`. The default (CPU runners) is
    /// `StepTiming::default()`: no device wait, no graph.
    fn last_step_timing(&self) -> StepTiming {
        StepTiming::default()
    }
}

/// Everything needed to serve a model: weights on a device, its tokenizer and chat template.
pub struct LoadedModel {
    pub config: ModelConfig,
    pub runner: Box<dyn ModelRunner>,
    pub tokenizer: std::sync::Arc<crate::text::tokenizer::Tokenizer>,
    pub chat_template: Option<crate::text::chat_template::ChatTemplate>,
    /// Where it came from, for `info`.
    pub source: String,
}

/// Called with (tensors loaded, tensors in all) while weights load; for progress bars.
pub type LoadProgress<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// A Hugging Face directory or a .gguf file, opened: config, tokenizer and chat template read, the weights
/// ready to read. Whoever loads it (one device, or the ranks of tensor parallelism) can decide from the config.
pub struct Checkpoint {
    pub config: ModelConfig,
    pub tokenizer: std::sync::Arc<crate::text::tokenizer::Tokenizer>,
    pub chat_template: Option<crate::text::chat_template::ChatTemplate>,
    pub weights: Box<dyn loader::WeightSource>,
    /// Where it came from, for `info`.
    pub source: String,
}

/// `~/rest` as `$HOME/rest`, as a shell would pass it: paths reach the runtime unexpanded from Python and configs.
fn expand_home(path: &std::path::Path) -> std::path::PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => std::path::Path::new(&home).join(rest),
        _ => path.to_path_buf(),
    }
}

impl Checkpoint {
    pub fn open(path: &std::path::Path) -> Result<Checkpoint> {
        let path = &expand_home(path);
        if !path.exists() {
            return crate::error::load_err(format!(
                "model path {} does not exist; pass a Hugging Face model directory or a .gguf file",
                path.display()
            ));
        }
        if path.is_dir() {
            loader::hf_dir::open(path)
        } else if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            loader::gguf_model::open(path)
        } else {
            crate::error::load_err(format!(
                "{} is neither a directory nor a .gguf file; pass a Hugging Face model directory or a .gguf file",
                path.display()
            ))
        }
    }

    /// Read the weights onto `device`, kept as `dtype` (None: the device's default).
    pub fn load(self, device: Device, dtype: Option<WeightDtype>, progress: Option<LoadProgress>) -> Result<LoadedModel> {
        let Checkpoint { config, tokenizer, chat_template, weights, source } = self;
        let counted = ProgressSource::new(weights.as_ref(), &config, 1, progress);
        let runner = llama::build_runner_with(&config, &counted, device, dtype)?;
        counted.finish();
        Ok(LoadedModel { config, runner, tokenizer, chat_template, source })
    }
}

/// Load a Hugging Face directory or a .gguf file, keeping the weights as `dtype` (None: the device's default).
pub fn load_model(
    path: &std::path::Path,
    device: Device,
    dtype: Option<WeightDtype>,
    progress: Option<LoadProgress>,
) -> Result<LoadedModel> {
    Checkpoint::open(path)?.load(device, dtype, progress)
}

/// A WeightSource that reports each tensor handed out, so loading can show progress.
pub struct ProgressSource<'a> {
    inner: &'a dyn loader::WeightSource,
    done: std::sync::atomic::AtomicUsize,
    total: usize,
    progress: Option<LoadProgress<'a>>,
}

impl<'a> ProgressSource<'a> {
    /// `ranks` models read their tensors from `inner` one after the other (tensor-parallel ranks, each its shard),
    /// so the bar reaches its end with the last rank, not the first.
    pub fn new(inner: &'a dyn loader::WeightSource, config: &ModelConfig, ranks: usize, progress: Option<LoadProgress<'a>>) -> Self {
        // embeddings, final norm and (maybe) lm_head, plus per layer: 2 norms, 7 matrices, optional bias/qk-norm
        let per_layer = 9 + if config.qkv_bias { 3 } else { 0 } + if config.qk_norm { 2 } else { 0 };
        let total = ranks * (2 + usize::from(!config.tie_word_embeddings) + per_layer * config.num_layers);
        if let Some(p) = progress {
            p(0, total);
        }
        Self { inner, done: 0.into(), total, progress }
    }

    pub fn finish(&self) {
        if let Some(p) = self.progress {
            p(self.total, self.total);
        }
    }

    /// Report one more tensor handed out.
    fn count(&self, t: loader::HostTensor) -> loader::HostTensor {
        let done = self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if let Some(p) = self.progress {
            p(done.min(self.total), self.total);
        }
        t
    }
}

impl loader::WeightSource for ProgressSource<'_> {
    fn tensor(&self, hf_name: &str) -> Result<loader::HostTensor> {
        self.inner.tensor(hf_name).map(|t| self.count(t))
    }

    fn tensor_part(&self, hf_name: &str, part: loader::TensorPart) -> Result<loader::HostTensor> {
        self.inner.tensor_part(hf_name, part).map(|t| self.count(t))
    }

    fn has(&self, hf_name: &str) -> bool {
        self.inner.has(hf_name)
    }
}
