//! Models: configuration, loading, and the one forward over a ragged batch.

pub mod config;
pub mod llama;
pub mod loader;

use crate::error::Result;
pub use config::{Architecture, ModelConfig};

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
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
    /// Physical KV block ids covering positions 0..past_len+len, in order.
    pub block_table: Vec<u32>,
}

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

/// A loaded model on a device: owns weights and the paged KV cache.
pub trait ModelRunner: Send {
    fn config(&self) -> &ModelConfig;
    /// Size the paged KV cache: `num_blocks` blocks of `block_size` tokens for every layer.
    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<()>;
    /// Compute one ragged batch, writing its K/V into the cache. Returns row-major logits,
    /// `batch.logits_for.len()` rows of `vocab_size` floats.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>>;
    /// Human-readable device and dtype, e.g. "cpu (f32)".
    fn device_description(&self) -> String;
    fn parameter_count(&self) -> usize;
}
