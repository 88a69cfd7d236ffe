//! Megatron-style sharding of Hugging Face weights for rank `r` of `n`: column-parallel q/k/v and gate/up
//! (output rows split), row-parallel o_proj and down_proj (input columns split, bias on rank 0 only), and
//! vocab-parallel embedding and LM head (vocab rows split evenly). Attention heads split by whole KV heads;
//! where there are fewer KV heads than ranks, each KV head is replicated on `n / num_kv_heads` ranks (as
//! vLLM does).

use crate::error::{load_err, with_context, Result};
use crate::model::loader::{HostTensor, TensorPart, WeightSource};
use crate::model::ModelConfig;

/// What rank `rank` of `world` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    pub rank: usize,
    pub world: usize,
    pub heads_per_rank: usize,
    pub kv_heads_per_rank: usize,
    /// First KV head (in the full model) this rank holds.
    pub kv_head_start: usize,
    pub intermediate_per_rank: usize,
    pub vocab_per_rank: usize,
}

impl ShardLayout {
    /// The layout, or a Load error naming the dimension that does not split.
    pub fn new(config: &ModelConfig, rank: usize, world: usize) -> Result<Self> {
        let (heads, kv) = (config.num_heads, config.num_kv_heads);
        if world == 0 || rank >= world {
            return load_err(format!("rank {rank} is outside a tensor-parallel group of {world}"));
        }
        if !heads.is_multiple_of(world) {
            return load_err(format!("tensor_parallel_size {world} must divide num_attention_heads ({heads})"));
        }
        let (kv_heads_per_rank, kv_head_start) = if kv.is_multiple_of(world) {
            (kv / world, rank * (kv / world))
        } else if world.is_multiple_of(kv) {
            (1, rank / (world / kv))
        } else {
            return load_err(format!(
                "tensor_parallel_size {world} must divide num_key_value_heads ({kv}) or be a multiple of it"
            ));
        };
        if !config.intermediate_size.is_multiple_of(world) {
            return load_err(format!("tensor_parallel_size {world} must divide intermediate_size ({})", config.intermediate_size));
        }
        if !config.vocab_size.is_multiple_of(world) {
            return load_err(format!("tensor_parallel_size {world} must divide vocab_size ({}) for the vocab-parallel embedding", config.vocab_size));
        }
        Ok(Self {
            rank,
            world,
            heads_per_rank: heads / world,
            kv_heads_per_rank,
            kv_head_start,
            intermediate_per_rank: config.intermediate_size / world,
            vocab_per_rank: config.vocab_size / world,
        })
    }

    /// The model this rank computes: same hidden size and layers, fewer heads, a slice of the MLP and vocab.
    pub fn local_config(&self, config: &ModelConfig) -> ModelConfig {
        let mut local = config.clone();
        local.num_heads = self.heads_per_rank;
        local.num_kv_heads = self.kv_heads_per_rank;
        local.intermediate_size = self.intermediate_per_rank;
        local.vocab_size = self.vocab_per_rank;
        local
    }

    pub fn vocab_start(&self) -> usize {
        self.rank * self.vocab_per_rank
    }
}

/// A [`WeightSource`] handing out rank `layout.rank`'s slice of every tensor under its Hugging Face name.
pub struct ShardedSource<'a> {
    pub inner: &'a dyn WeightSource,
    pub layout: ShardLayout,
    pub head_dim: usize,
}

enum Split {
    Whole,
    /// A row or column range of the tensor.
    Part(TensorPart),
    /// Rank 0 keeps it; the others get zeros (a bias added after a row-parallel matmul).
    RankZeroOnly,
}

impl ShardedSource<'_> {
    fn split(&self, name: &str) -> Split {
        let l = &self.layout;
        let hd = self.head_dim;
        let rows = |start, len| Split::Part(TensorPart::Rows { start, len });
        let cols = |start, len| Split::Part(TensorPart::Cols { start, len });
        let q = rows(l.rank * l.heads_per_rank * hd, l.heads_per_rank * hd);
        let kv = rows(l.kv_head_start * hd, l.kv_heads_per_rank * hd);
        let mlp = rows(l.rank * l.intermediate_per_rank, l.intermediate_per_rank);
        let vocab = rows(l.vocab_start(), l.vocab_per_rank);
        let ends = |s: &str| name.ends_with(s);
        if ends("q_proj.weight") || ends("q_proj.bias") {
            q
        } else if ends("k_proj.weight") || ends("k_proj.bias") || ends("v_proj.weight") || ends("v_proj.bias") {
            kv
        } else if ends("gate_proj.weight") || ends("up_proj.weight") {
            mlp
        } else if ends("o_proj.weight") {
            cols(l.rank * l.heads_per_rank * hd, l.heads_per_rank * hd)
        } else if ends("down_proj.weight") {
            cols(l.rank * l.intermediate_per_rank, l.intermediate_per_rank)
        } else if ends("o_proj.bias") {
            Split::RankZeroOnly
        } else if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            vocab
        } else {
            Split::Whole
        }
    }
}

impl WeightSource for ShardedSource<'_> {
    fn tensor(&self, hf_name: &str) -> Result<HostTensor> {
        match self.split(hf_name) {
            Split::Whole => self.inner.tensor(hf_name),
            Split::Part(part) => {
                self.inner.tensor_part(hf_name, part).map_err(|e| with_context(e, &format!("tensor-parallel rank {}", self.layout.rank)))
            }
            Split::RankZeroOnly => {
                let full = self.inner.tensor(hf_name)?;
                let shape = full.shape.clone();
                let data = if self.layout.rank == 0 { full.into_values() } else { vec![0.0; full.value_count()] };
                Ok(HostTensor::new(shape, data))
            }
        }
    }

    fn has(&self, hf_name: &str) -> bool {
        self.inner.has(hf_name)
    }
}
