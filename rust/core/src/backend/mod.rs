//! Backends: the only code that knows the device.
//!
//! The model forward (`model::llama`) is written once as a sequence of coarse ops over [`Backend`]. Each op
//! is a unit a GPU backend can implement as one kernel (or one cuBLAS call) on its stream, so a whole decode
//! step can be captured in a CUDA graph: ops never return data to the host except [`Backend::copy_to_host`],
//! and every op writes into a caller-owned output tensor whose storage grows but never shrinks, so a
//! steady-state step allocates nothing.

pub mod batch;
pub mod cpu;
pub mod cuda;
mod cpu_attention;
mod cpu_attention_kernels;
mod cpu_kernels;
mod cpu_matmul;
mod cpu_matmul_a8;
mod cpu_matmul_x86;
mod cpu_simd;

pub use batch::{BatchPlan, PlannedSeq};
pub use cpu::{CpuBackend, CpuWeightFormat};

use crate::error::Result;
use crate::model::loader::HostTensor;
use crate::model::Rope;

/// Geometry of one attention layer, shared by the RoPE/KV-write op and the attention op.
///
/// A fused QKV activation row is laid out `[q (num_heads * head_dim) | k (kv_dim) | v (kv_dim)]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// RoPE's frequencies; the rotation is the neox / Hugging Face `rotate_half` convention over the whole head.
    pub rope: Rope,
    /// eps of the per-head q/k RMSNorm (Qwen3); unused when no q/k norm weights are passed.
    pub qk_norm_eps: f32,
}

impl AttentionShape {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Width of one fused QKV row.
    pub fn qkv_width(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Query heads sharing one KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// How the paged KV cache stores its values (`Config(kv_cache_dtype=...)`, vLLM's option of the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCacheDtype {
    /// The backend's activation dtype: bf16 on CUDA, f32 on the CPU.
    #[default]
    Auto,
    /// fp8 e4m3, unscaled (CUDA only): half the bytes of bf16 to store and to read every decode step, at 3
    /// mantissa bits of precision; values saturate at +-448.
    Fp8,
}

impl KvCacheDtype {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8),
            other => crate::error::invalid(format!("unknown kv_cache_dtype {other:?}; use \"auto\" or \"fp8\"")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp8 => "fp8",
        }
    }

    /// Bytes one K or V value takes in a GPU's cache (bf16 or fp8).
    pub fn gpu_value_bytes(self) -> usize {
        match self {
            Self::Auto => 2,
            Self::Fp8 => 1,
        }
    }
}

/// Size of the paged KV cache. A slot is `block * block_size + offset`; every layer has
/// `num_blocks * block_size` slots of `num_kv_heads * head_dim` values for K and the same for V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvCacheDtype,
}

impl KvCacheShape {
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// A compute device. Activations are 2-D `[rows, cols]` tensors, one row per token unless said otherwise.
///
/// Ops take `&self` so a GPU backend can keep its stream, handles and workspaces behind interior state;
/// output tensors are reshaped by the op itself (`rows` from the input or the batch), so the model code
/// never sizes buffers. Errors are values: a failed launch or an unavailable device is `Error::Device`.
pub trait Backend: Send + Sized + 'static {
    /// Activation buffer on the device.
    type Tensor: Send;
    /// A weight matrix `[out_features, in_features]` (linear layers, the embedding table). Its storage
    /// format (f32, bf16, int8...) is the backend's choice; it must still serve `embed` and `linear`.
    type Matrix: Send + Sync;
    /// A weight vector kept at full precision: norm weights and biases.
    type Vector: Send + Sync;
    /// Paged K/V storage for every layer, shaped by [`KvCacheShape`].
    type KvCache: Send;
    /// Batch metadata resident on the device (tokens, positions, slots, block tables, logits rows).
    type Batch: Send;

    /// Human-readable device and dtype, e.g. "cpu (f32)".
    fn description(&self) -> String;

    fn upload_matrix(&self, host: HostTensor) -> Result<Self::Matrix>;
    fn upload_vector(&self, host: HostTensor) -> Result<Self::Vector>;
    /// Bytes a matrix takes where it is kept (host memory or device memory).
    fn matrix_bytes(&self, matrix: &Self::Matrix) -> usize;
    /// An empty activation tensor; ops size it.
    fn new_tensor(&self) -> Self::Tensor;
    fn allocate_kv_cache(&self, shape: KvCacheShape) -> Result<Self::KvCache>;
    fn new_batch(&self) -> Self::Batch;
    /// Copy a validated host plan to the device, reusing `batch`'s storage.
    fn upload_batch(&self, plan: &BatchPlan, batch: &mut Self::Batch) -> Result<()>;

    /// `out[t] = table[batch.tokens[t]]`.
    fn embed(&self, table: &Self::Matrix, batch: &Self::Batch, out: &mut Self::Tensor) -> Result<()>;
    /// `out = rms_norm(x) * weight`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Vector, eps: f32, out: &mut Self::Tensor) -> Result<()>;
    /// `x += delta` (the residual stream's skip connection).
    fn add(&self, x: &mut Self::Tensor, delta: &Self::Tensor) -> Result<()>;
    /// `out = x · weightᵀ (+ bias)`.
    fn linear(&self, x: &Self::Tensor, weight: &Self::Matrix, bias: Option<&Self::Vector>, out: &mut Self::Tensor)
        -> Result<()>;
    /// On fused QKV rows: optional per-head RMSNorm of q and k (`qk_norm` = (q weight, k weight), each
    /// `[head_dim]`), then RoPE of q and k at each token's position, in place; then K and V of every token go
    /// to its slot in `layer` of the paged cache.
    fn rope_and_write_kv(
        &self,
        qkv: &mut Self::Tensor,
        qk_norm: Option<(&Self::Vector, &Self::Vector)>,
        shape: &AttentionShape,
        batch: &Self::Batch,
        cache: &mut Self::KvCache,
        layer: usize,
    ) -> Result<()>;
    /// Causal attention over a ragged batch: each sequence's query tokens (q part of `qkv`) attend to its
    /// cached past and to its own tokens up to themselves, read from `layer` of the paged cache through the
    /// sequence's block table. `out` is `[tokens, num_heads * head_dim]`.
    fn paged_attention(
        &self,
        qkv: &Self::Tensor,
        shape: &AttentionShape,
        batch: &Self::Batch,
        cache: &Self::KvCache,
        layer: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`Backend::rope_and_write_kv`] then [`Backend::paged_attention`]. A backend may fuse them where every
    /// sequence of the batch has one query token (decode): no token then attends to another token's new K.
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        qkv: &mut Self::Tensor,
        qk_norm: Option<(&Self::Vector, &Self::Vector)>,
        shape: &AttentionShape,
        batch: &Self::Batch,
        cache: &mut Self::KvCache,
        layer: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.rope_and_write_kv(qkv, qk_norm, shape, batch, cache, layer)?;
        self.paged_attention(qkv, shape, batch, cache, layer, out)
    }
    /// On rows `[gate | up]` (each half `intermediate` wide): `out = silu(gate) * up`.
    fn silu_mul(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor) -> Result<()>;
    /// `out[i] = x[batch.logits_rows[i]]`: the rows whose logits the step wants.
    fn select_logits_rows(&self, x: &Self::Tensor, batch: &Self::Batch, out: &mut Self::Tensor) -> Result<()>;
    /// Row-major copy of the whole tensor into `out` (replacing its contents).
    fn copy_to_host(&self, x: &Self::Tensor, out: &mut Vec<f32>) -> Result<()>;

    // Fused projections. Each is a composition of the ops above (the defaults); a GPU backend overrides them
    // to run as one kernel at decode batch sizes, where launches and re-reads of activations dominate.
    // `normed`, `product` are scratch tensors that the composition needs and a fused kernel may ignore.

    /// `out = (rms_norm(x) * norm) · weightᵀ (+ bias)`.
    #[allow(clippy::too_many_arguments)]
    fn norm_linear(
        &self,
        x: &Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        weight: &Self::Matrix,
        bias: Option<&Self::Vector>,
        normed: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, normed)?;
        self.linear(normed, weight, bias, out)
    }

    /// The MLP's first half: `[gate | up] = (rms_norm(x) * norm) · gate_upᵀ`, then `out = silu(gate) * up`.
    #[allow(clippy::too_many_arguments)]
    fn norm_linear_silu(
        &self,
        x: &Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        gate_up: &Self::Matrix,
        normed: &mut Self::Tensor,
        product: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.norm_linear(x, norm, eps, gate_up, None, normed, product)?;
        self.silu_mul(product, out)
    }

    /// `residual += x · weightᵀ (+ bias)`: a projection back into the residual stream.
    fn linear_add(
        &self,
        x: &Self::Tensor,
        weight: &Self::Matrix,
        bias: Option<&Self::Vector>,
        product: &mut Self::Tensor,
        residual: &mut Self::Tensor,
    ) -> Result<()> {
        self.linear(x, weight, bias, product)?;
        self.add(residual, product)
    }
}

/// Overwrite a CPU activation's values in place, keeping its shape: the host-side tensor-parallel
/// collectives (`parallel::CpuRankHooks`) write their all-reduced result back through this.
pub(crate) fn overwrite_cpu_tensor(t: &mut cpu::CpuTensor, data: &[f32]) -> Result<()> {
    let values = t.as_mut_slice();
    if values.len() != data.len() {
        return Err(crate::Error::Internal(format!("a tensor of {} values cannot take {} values", values.len(), data.len())));
    }
    values.copy_from_slice(data);
    Ok(())
}
