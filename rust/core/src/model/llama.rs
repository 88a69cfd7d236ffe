//! The Llama-family decoder (Llama, Mistral, SmolLM2, Qwen2 with q/k/v bias, Qwen3 with per-head q/k norm),
//! written once over [`Backend`]. One forward serves prefill, decode and mixed steps: it takes a ragged
//! [`ForwardBatch`] and reads/writes the paged KV cache through each sequence's block table.

use crate::backend::cpu::InRayonPool;
use crate::backend::{AttentionShape, Backend, BatchPlan, CpuBackend, CpuWeightFormat, KvCacheDtype, KvCacheShape};
use crate::error::{load_err, protocol, Error, Result};
use crate::model::loader::{HostTensor, WeightSource};
use crate::model::{Device, ForwardBatch, ModelConfig, ModelRunner, WeightDtype};
use crate::parallel::TensorParallelHooks;

/// Load a model from Hugging Face-named weights onto `device`, with the device's default weight dtype.
pub fn build_runner(config: &ModelConfig, weights: &dyn WeightSource, device: Device) -> Result<Box<dyn ModelRunner>> {
    match device {
        Device::Cpu => cpu_runner(CpuWeightFormat::F32, config, weights),
        Device::Cuda(ordinal) => crate::backend::cuda::build_runner(config, weights, ordinal),
    }
}

/// [`build_runner`] with the weights kept as `dtype` (None: the device's default, f32 on the CPU and bf16 on
/// CUDA). A dtype the device does not offer is an invalid request, refused before anything loads.
pub fn build_runner_with(
    config: &ModelConfig,
    weights: &dyn WeightSource,
    device: Device,
    dtype: Option<WeightDtype>,
) -> Result<Box<dyn ModelRunner>> {
    match (device, dtype) {
        (Device::Cpu, Some(dtype)) => {
            cpu_runner(CpuWeightFormat::from(dtype), config, weights)
        }
        (Device::Cuda(_), Some(dtype)) if dtype != WeightDtype::Bf16 => Err(Error::InvalidRequest(format!(
            "the CUDA backend computes in bf16 only; dtype {:?} is for the CPU (use dtype \"bf16\" or leave it unset)",
            dtype.name()
        ))),
        _ => build_runner(config, weights, device),
    }
}

fn cpu_runner(format: CpuWeightFormat, config: &ModelConfig, weights: &dyn WeightSource) -> Result<Box<dyn ModelRunner>> {
    Ok(Box::new(InRayonPool(LlamaModel::load(CpuBackend::new(format), config, weights)?)))
}

pub struct LlamaModel<B: Backend> {
    config: ModelConfig,
    backend: B,
    attention: AttentionShape,
    embed_tokens: B::Matrix,
    /// `None` when the output projection is tied to `embed_tokens`.
    lm_head: Option<B::Matrix>,
    layers: Vec<DecoderLayer<B>>,
    final_norm: B::Vector,
    parameter_count: usize,
    weight_bytes: usize,
    kv_cache: Option<(B::KvCache, KvCacheShape)>,
    batch: B::Batch,
    scratch: Scratch<B>,
    /// Logits rows the current step wants.
    rows_wanted: usize,
    /// Set when this model is one rank of a tensor-parallel group (`config` is then the rank's shard).
    tp: Option<TensorParallel<B>>,
}

/// One rank's part in tensor parallelism: the collectives and what the whole model looks like.
struct TensorParallel<B: Backend> {
    hooks: Box<dyn TensorParallelHooks<B>>,
    full_config: ModelConfig,
    /// First vocab id of this rank's embedding / LM-head shard.
    vocab_start: usize,
    /// The batch with token ids mapped into this rank's embedding shard (the zero row for foreign ids).
    embed_batch: B::Batch,
}

struct DecoderLayer<B: Backend> {
    input_norm: B::Vector,
    /// q, k and v projections stacked row-wise, so one matmul produces a fused `[q | k | v]` row.
    qkv_proj: B::Matrix,
    qkv_bias: Option<B::Vector>,
    /// Qwen3's per-head RMSNorm weights for (q, k).
    qk_norm: Option<(B::Vector, B::Vector)>,
    o_proj: B::Matrix,
    o_bias: Option<B::Vector>,
    post_attention_norm: B::Vector,
    /// gate and up projections stacked row-wise: one matmul, then `silu(gate) * up`.
    gate_up_proj: B::Matrix,
    down_proj: B::Matrix,
}

/// Activations reused across steps: after the largest batch has been seen, a step allocates nothing here.
struct Scratch<B: Backend> {
    residual: B::Tensor,
    normed: B::Tensor,
    qkv: B::Tensor,
    attention: B::Tensor,
    /// Output of the latest o_proj or down_proj, waiting to be added to the residual stream.
    block_output: B::Tensor,
    gate_up: B::Tensor,
    activated: B::Tensor,
    selected: B::Tensor,
    logits: B::Tensor,
}

impl<B: Backend> Scratch<B> {
    fn new(backend: &B) -> Self {
        Self {
            residual: backend.new_tensor(),
            normed: backend.new_tensor(),
            qkv: backend.new_tensor(),
            attention: backend.new_tensor(),
            block_output: backend.new_tensor(),
            gate_up: backend.new_tensor(),
            activated: backend.new_tensor(),
            selected: backend.new_tensor(),
            logits: backend.new_tensor(),
        }
    }
}

impl<B: Backend> LlamaModel<B> {
    /// Read, shape-check and upload every weight.
    pub fn load(backend: B, config: &ModelConfig, weights: &dyn WeightSource) -> Result<Self> {
        Self::load_inner(backend, config, weights, None)
    }

    /// Load one rank of a tensor-parallel group: `local_config` and `shard` describe this rank's slice
    /// (see `parallel::shard`), `full_config` the whole model, `hooks` the collectives among the ranks.
    pub fn load_rank(
        backend: B,
        full_config: &ModelConfig,
        local_config: &ModelConfig,
        shard: &dyn WeightSource,
        vocab_start: usize,
        hooks: Box<dyn TensorParallelHooks<B>>,
    ) -> Result<Self> {
        let embed_batch = backend.new_batch();
        let tp = TensorParallel { hooks, full_config: full_config.clone(), vocab_start, embed_batch };
        Self::load_inner(backend, local_config, shard, Some(tp))
    }

    fn load_inner(backend: B, config: &ModelConfig, weights: &dyn WeightSource, tp: Option<TensorParallel<B>>) -> Result<Self> {
        config.validate()?;
        let mut reader = WeightReader { source: weights, backend: &backend, parameters: 0, weight_bytes: 0 };
        let (vocab, hidden) = (config.vocab_size, config.hidden_size);
        // transformers ignores a stored lm_head when embeddings are tied; without one, tying is the only option.
        let tied = config.tie_word_embeddings || !weights.has("lm_head.weight");
        let (embed_tokens, lm_head) = if tp.is_some() {
            // A vocab shard gets one extra zero row: ids owned by other ranks embed to zero before the all-reduce.
            // Tied, the same table is the LM head; the zero row's logit (exactly 0) is dropped before the gather.
            let mut table = reader.read("model.embed_tokens.weight", &[vocab, hidden])?;
            let head = if tied { None } else { Some(reader.read("lm_head.weight", &[vocab, hidden])?) };
            table.append_zero_row();
            (reader.upload_matrix(table)?, head.map(|h| reader.upload_matrix(h)).transpose()?)
        } else {
            let embed_tokens = reader.matrix("model.embed_tokens.weight", vocab, hidden)?;
            let lm_head = if tied { None } else { Some(reader.matrix("lm_head.weight", vocab, hidden)?) };
            (embed_tokens, lm_head)
        };
        let layers = (0..config.num_layers).map(|i| reader.decoder_layer(config, i)).collect::<Result<Vec<_>>>()?;
        let final_norm = reader.vector("model.norm.weight", hidden)?;
        let (parameter_count, weight_bytes) = (reader.parameters, reader.weight_bytes);
        let attention = AttentionShape {
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            rope: config.rope.clone(),
            qk_norm_eps: config.rms_norm_eps,
        };
        Ok(Self {
            config: config.clone(),
            attention,
            embed_tokens,
            lm_head,
            layers,
            final_norm,
            parameter_count,
            weight_bytes,
            kv_cache: None,
            batch: backend.new_batch(),
            scratch: Scratch::new(&backend),
            rows_wanted: 0,
            backend,
            tp,
        })
    }

    /// The geometry every attention layer shares.
    pub fn attention_shape(&self) -> &AttentionShape {
        &self.attention
    }

    /// Every decoder layer over the embedded batch, leaving the residual stream (before the final norm) in
    /// `scratch.residual`.
    fn run_decoder(&mut self) -> Result<()> {
        let Self { backend, layers, scratch: s, batch, attention, config, embed_tokens, kv_cache, tp, .. } = self;
        let Some((cache, _)) = kv_cache.as_mut() else {
            return protocol("allocate_kv_cache must be called before forward");
        };
        let eps = config.rms_norm_eps;
        // Under tensor parallelism each rank's partial sums (embedding shard, row-parallel o/down) are all-reduced.
        match tp {
            Some(tp) => backend.embed(embed_tokens, &tp.embed_batch, &mut s.residual)?,
            None => backend.embed(embed_tokens, batch, &mut s.residual)?,
        }
        let hooks = tp.as_ref().map(|tp| tp.hooks.as_ref());
        if let Some(h) = hooks {
            h.all_reduce(backend, &mut s.residual)?;
        }
        for (index, layer) in layers.iter().enumerate() {
            backend.norm_linear(&s.residual, &layer.input_norm, eps, &layer.qkv_proj, layer.qkv_bias.as_ref(), &mut s.normed, &mut s.qkv)?;
            let qk_norm = layer.qk_norm.as_ref().map(|(q, k)| (q, k));
            backend.rope_attention(&mut s.qkv, qk_norm, attention, batch, cache, index, &mut s.attention)?;
            project_into_residual(backend, hooks, &s.attention, &layer.o_proj, layer.o_bias.as_ref(), &mut s.block_output, &mut s.residual)?;

            backend.norm_linear_silu(&s.residual, &layer.post_attention_norm, eps, &layer.gate_up_proj, &mut s.normed, &mut s.gate_up, &mut s.activated)?;
            project_into_residual(backend, hooks, &s.activated, &layer.down_proj, None, &mut s.block_output, &mut s.residual)?;
        }
        Ok(())
    }

    /// Logits of the batch's requested rows, row-major `[rows, vocab]`: the final norm and the LM head run on
    /// those rows only.
    fn logits(&mut self) -> Result<Vec<f32>> {
        let s = &mut self.scratch;
        let lm_head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let eps = self.config.rms_norm_eps;
        self.backend.select_logits_rows(&s.residual, &self.batch, &mut s.selected)?;
        self.backend.norm_linear(&s.selected, &self.final_norm, eps, lm_head, None, &mut s.normed, &mut s.logits)?;
        let mut host = Vec::new();
        self.backend.copy_to_host(&s.logits, &mut host)?;
        let Some(tp) = &self.tp else {
            return Ok(host);
        };
        let rows = self.batch_rows();
        if self.lm_head.is_none() {
            host = without_last_column(host, rows, self.config.vocab_size + 1);
        }
        // Vocab-parallel LM head: join every rank's columns in rank (= vocab) order.
        tp.hooks.all_gather_columns(host, rows)
    }

    fn batch_rows(&self) -> usize {
        self.rows_wanted
    }

    fn forward_local(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>> {
        let Some((_, shape)) = &self.kv_cache else {
            return protocol("allocate_kv_cache must be called before forward");
        };
        let (block_size, num_blocks) = (shape.block_size, shape.num_blocks);
        let vocab = self.tp.as_ref().map_or(self.config.vocab_size, |tp| tp.full_config.vocab_size);
        let plan = BatchPlan::new(batch, block_size, num_blocks, vocab)?;
        if plan.num_tokens() == 0 {
            return Ok(Vec::new());
        }
        self.backend.upload_batch(&plan, &mut self.batch)?;
        self.rows_wanted = batch.logits_for.len();
        if let Some(tp) = &mut self.tp {
            let (start, local) = (tp.vocab_start as u32, self.config.vocab_size as u32);
            let mut mapped = batch.clone();
            for t in &mut mapped.tokens {
                *t = if (start..start + local).contains(t) { *t - start } else { local };
            }
            let plan = BatchPlan::new(&mapped, block_size, num_blocks, self.config.vocab_size + 1)?;
            self.backend.upload_batch(&plan, &mut tp.embed_batch)?;
        }
        self.run_decoder()?;
        if let Some(tp) = &self.tp {
            // Every forward ends here with no collective still pending on the device, whether or not it wants
            // logits: a later host wait could otherwise block on a rank that already failed.
            tp.hooks.settle(&self.backend)?;
        }
        if batch.logits_for.is_empty() {
            return Ok(Vec::new()); // a prompt chunk short of its prompt's end: only its K/V were wanted
        }
        self.logits()
    }
}

impl<B: Backend> ModelRunner for LlamaModel<B> {
    fn config(&self) -> &ModelConfig {
        self.tp.as_ref().map_or(&self.config, |tp| &tp.full_config)
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> Result<()> {
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::InvalidRequest(format!(
                "KV cache needs at least one block of at least one token (got {num_blocks} blocks of {block_size})"
            )));
        }
        let shape = KvCacheShape {
            num_layers: self.config.num_layers,
            num_blocks,
            block_size,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            dtype,
        };
        self.kv_cache = None; // release the old cache before allocating the new one
        self.kv_cache = Some((self.backend.allocate_kv_cache(shape)?, shape));
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>> {
        let result = self.forward_local(batch);
        match (&self.tp, result) {
            // A rank failing on its own wakes the others, who would otherwise wait for it in a collective.
            (Some(tp), Err(e)) => Err(tp.hooks.fail(e)),
            (_, result) => result,
        }
    }

    /// Under tensor parallelism rank 0 samples and broadcasts the tokens, so every rank commits the same ones.
    fn forward_and_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        let mut logits = self.forward(batch)?;
        self.sample_host_logits(&mut logits, rows)
    }

    fn sample_host_logits(
        &mut self,
        logits: &mut [f32],
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        let vocab = self.config().vocab_size;
        let Some(tp) = &self.tp else {
            return Ok(crate::sampling::sample_rows(logits, vocab, rows));
        };
        let mine = (tp.hooks.rank() == 0).then(|| crate::sampling::sample_rows(logits, vocab, rows));
        tp.hooks.broadcast_sampled(mine)
    }

    fn device_description(&self) -> String {
        self.backend.description()
    }

    fn parameter_count(&self) -> usize {
        self.parameter_count
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
}

/// Row-major `[rows, cols]` values less each row's last column.
fn without_last_column(mut values: Vec<f32>, rows: usize, cols: usize) -> Vec<f32> {
    debug_assert_eq!(values.len(), rows * cols);
    for r in 0..rows {
        values.copy_within(r * cols..(r + 1) * cols - 1, r * (cols - 1));
    }
    values.truncate(rows * (cols - 1));
    values
}

/// `residual += x · weightᵀ (+ bias)`. Under tensor parallelism `weight` is a row-parallel shard, so the
/// ranks' partial products are all-reduced before the add; alone, the backend may fuse the add into the GEMV.
#[allow(clippy::too_many_arguments)]
fn project_into_residual<B: Backend>(
    backend: &B,
    hooks: Option<&dyn TensorParallelHooks<B>>,
    x: &B::Tensor,
    weight: &B::Matrix,
    bias: Option<&B::Vector>,
    product: &mut B::Tensor,
    residual: &mut B::Tensor,
) -> Result<()> {
    let Some(hooks) = hooks else {
        return backend.linear_add(x, weight, bias, product, residual);
    };
    backend.linear(x, weight, bias, product)?;
    hooks.all_reduce(backend, product)?;
    backend.add(residual, product)
}

/// Reads Hugging Face tensors, checks each shape against the config, and uploads it.
struct WeightReader<'a, B: Backend> {
    source: &'a dyn WeightSource,
    backend: &'a B,
    parameters: usize,
    /// Bytes of what was uploaded (vectors are f32 on every backend).
    weight_bytes: usize,
}

impl<B: Backend> WeightReader<'_, B> {
    fn decoder_layer(&mut self, config: &ModelConfig, i: usize) -> Result<DecoderLayer<B>> {
        let (hidden, q_dim, kv_dim) = (config.hidden_size, config.q_dim(), config.kv_dim());
        let prefix = format!("model.layers.{i}");
        let attn = format!("{prefix}.self_attn");
        let mlp = format!("{prefix}.mlp");
        if self.source.has(&format!("{mlp}.gate_proj.bias")) {
            return load_err(format!("{mlp} has biases; MLP biases are not supported"));
        }
        let qkv_proj = [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)]
            .map(|(name, rows)| (format!("{attn}.{name}.weight"), rows, hidden));
        let qkv_bias = if config.qkv_bias {
            let biases = [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)]
                .map(|(name, len)| (format!("{attn}.{name}.bias"), len));
            Some(self.stacked_vectors(&biases)?)
        } else {
            None
        };
        let qk_norm = if config.qk_norm {
            let q = self.vector(&format!("{attn}.q_norm.weight"), config.head_dim)?;
            Some((q, self.vector(&format!("{attn}.k_norm.weight"), config.head_dim)?))
        } else {
            None
        };
        // Llama's `attention_bias` also puts a bias on o_proj; Qwen2 has none there.
        let o_bias_name = format!("{attn}.o_proj.bias");
        let o_bias = if self.source.has(&o_bias_name) { Some(self.vector(&o_bias_name, hidden)?) } else { None };
        let gate_up = [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)]
            .map(|(name, rows)| (format!("{mlp}.{name}.weight"), rows, hidden));
        Ok(DecoderLayer {
            input_norm: self.vector(&format!("{prefix}.input_layernorm.weight"), hidden)?,
            qkv_proj: self.stacked_matrices(&qkv_proj)?,
            qkv_bias,
            qk_norm,
            o_proj: self.matrix(&format!("{attn}.o_proj.weight"), hidden, q_dim)?,
            o_bias,
            post_attention_norm: self.vector(&format!("{prefix}.post_attention_layernorm.weight"), hidden)?,
            gate_up_proj: self.stacked_matrices(&gate_up)?,
            down_proj: self.matrix(&format!("{mlp}.down_proj.weight"), hidden, config.intermediate_size)?,
        })
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        let host = self.read(name, &[rows, cols])?;
        self.upload_matrix(host)
    }

    fn upload_matrix(&mut self, host: HostTensor) -> Result<B::Matrix> {
        let matrix = self.backend.upload_matrix(host)?;
        self.weight_bytes += self.backend.matrix_bytes(&matrix);
        Ok(matrix)
    }

    fn upload_vector(&mut self, host: HostTensor) -> Result<B::Vector> {
        self.weight_bytes += 4 * host.value_count();
        self.backend.upload_vector(host)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector> {
        let host = self.read(name, &[len])?;
        self.upload_vector(host)
    }

    /// Matrices `(name, rows, cols)` with equal `cols`, stacked row-wise into one.
    fn stacked_matrices(&mut self, parts: &[(String, usize, usize)]) -> Result<B::Matrix> {
        let parts = parts.iter().map(|(name, rows, cols)| self.read(name, &[*rows, *cols])).collect::<Result<Vec<_>>>()?;
        self.upload_matrix(HostTensor::stack_rows(parts))
    }

    /// Vectors `(name, len)` concatenated into one.
    fn stacked_vectors(&mut self, parts: &[(String, usize)]) -> Result<B::Vector> {
        let mut stacked = HostTensor::new(vec![0], Vec::new());
        for (name, len) in parts {
            let part = self.read(name, &[*len])?;
            stacked.shape[0] += len;
            stacked.data.extend_from_slice(&part.values());
        }
        self.upload_vector(stacked)
    }

    fn read(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor> {
        if !self.source.has(name) {
            return load_err(format!(
                "the checkpoint lacks tensor {name:?} (expected shape {expected:?}); is config.json for these weights?"
            ));
        }
        let tensor = self.source.tensor(name)?;
        if tensor.shape != expected {
            return load_err(format!(
                "tensor {name:?} has shape {:?} but config.json implies {expected:?}; config and weights disagree",
                tensor.shape
            ));
        }
        if tensor.value_count() != expected.iter().product::<usize>() {
            return load_err(format!("tensor {name:?} of shape {expected:?} carries {} values", tensor.value_count()));
        }
        self.parameters += tensor.value_count();
        Ok(tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::without_last_column;

    #[test]
    fn the_last_column_of_every_row_goes() {
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(without_last_column(values, 3, 4), vec![0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 8.0, 9.0, 10.0]);
        assert_eq!(without_last_column(Vec::new(), 0, 4), Vec::<f32>::new());
    }
}
