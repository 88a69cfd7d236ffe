//! The CUDA backend (cudarc, dynamically loaded): bf16 weights and activations, kernels from kernels/*.cu
//! embedded (PTX, and sm_90 machine code for Hopper), cuBLAS for large GEMMs, GPU sampling and decode CUDA
//! graphs. On a machine without a CUDA driver every entry point returns `Error::Device`; nothing here panics
//! for lack of a GPU.

pub mod backend;
pub mod blas;
pub mod decode_advance;
pub mod device;
pub mod gemv;
pub mod parallel;
pub mod runner;
pub mod sampler;
pub mod skinny_gemm;

pub use backend::CudaBackend;
pub use runner::CudaRunner;

use std::sync::atomic::AtomicU8;
use std::sync::Arc;

use crate::error::Result;
use crate::model::llama::LlamaModel;
use crate::model::loader::WeightSource;
use crate::model::{ModelConfig, ModelRunner};
use crate::parallel::collective::Collective;
use crate::parallel::RankLink;
use parallel::{AllReducePath, CudaRankHooks, CudaRankRunner, NcclComm};

/// Whether the CUDA backend can run here: kernels were built in and a driver sees at least one GPU.
pub fn available() -> bool {
    !device::KERNEL_MODULES.is_empty() && device::device_count() > 0
}

/// Load a Llama-family model onto `cuda:ordinal`.
pub fn build_runner(config: &ModelConfig, weights: &dyn WeightSource, ordinal: usize) -> Result<Box<dyn ModelRunner>> {
    // A missing GPU is the first thing to report.
    let backend = CudaBackend::new(ordinal)?;
    if let Some(why) = unsupported(config) {
        return crate::error::load_err(format!("{why}; load this model with device=\"cpu\""));
    }
    let model = LlamaModel::load(backend.clone(), config, weights)?;
    Ok(Box::new(CudaRunner::new(model, backend)))
}

/// Load a Llama-family model as one tensor-parallel rank per ordinal in `ordinals`, each rank's shard on its GPU
/// (see [`parallel`]).
pub fn load_ranks(
    config: &ModelConfig,
    weights: &dyn WeightSource,
    ordinals: &[usize],
    collective: &Arc<Collective>,
    faults: &[Arc<AtomicU8>],
) -> Result<Vec<Box<dyn ModelRunner>>> {
    let backends = ordinals.iter().map(|&o| CudaBackend::new(o)).collect::<Result<Vec<_>>>()?;
    let world = ordinals.len();
    // A rank's attention has its shard's heads: replicated KV heads can change the query heads per KV head.
    let rank_shape = crate::parallel::shard::ShardLayout::new(config, 0, world)?.local_config(config);
    if let Some(why) = unsupported(&rank_shape) {
        return crate::error::load_err(format!("{why}; load this model with device=\"cpu\""));
    }
    let path = parallel::all_reduce_path(ordinals, parallel::nccl_present(), std::env::var_os("STEPLLM_NO_NCCL").is_some());
    let mut comms: Vec<Option<NcclComm>> = match path {
        AllReducePath::Nccl => NcclComm::create_group(&backends)?.into_iter().map(Some).collect(),
        AllReducePath::Host => (0..world).map(|_| None).collect(),
    };
    let mut runners: Vec<Box<dyn ModelRunner>> = Vec::with_capacity(world);
    for (rank, (backend, nccl)) in backends.into_iter().zip(comms.drain(..)).enumerate() {
        backend.gpu().bind()?;
        let link = RankLink { rank, collective: Arc::clone(collective), fault: Arc::clone(&faults[rank]) };
        let hooks = CudaRankHooks { link, nccl };
        let model = crate::parallel::load_rank_model(backend.clone(), config, weights, rank, world, Box::new(hooks))?;
        runners.push(Box::new(CudaRankRunner::new(model, backend, path)));
    }
    Ok(runners)
}

/// Why the CUDA kernels cannot run a model of this shape, if they cannot. Checked before anything loads, so that
/// such a model is refused by name (or, under device="auto", runs on the CPU) instead of failing at its first step.
pub fn unsupported(config: &ModelConfig) -> Option<String> {
    let head_dim = config.head_dim;
    let group = config.num_heads / config.num_kv_heads.max(1);
    let covered = backend::DECODE_ATTENTION_SHAPES.iter().any(|(d, groups)| *d == head_dim && groups.contains(&group));
    if covered {
        return None;
    }
    let listed: Vec<String> = backend::DECODE_ATTENTION_SHAPES
        .iter()
        .map(|(d, groups)| format!("head_dim {d} with {groups:?} query heads per KV head"))
        .collect();
    Some(format!(
        "the CUDA attention kernels have no variant for head_dim {head_dim} with {group} query heads per KV head; \
         they cover {}",
        listed.join(" and ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heads: usize, kv_heads: usize, head_dim: usize) -> ModelConfig {
        let text = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": {}, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads}}}"#,
            heads * head_dim
        );
        ModelConfig::from_hf_json(&text).unwrap()
    }

    #[test]
    fn shapes_without_an_attention_kernel_are_named_and_real_models_pass() {
        // SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B, Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3.2-3B, SmolLM2-1.7B.
        for (heads, kv, d) in [(9, 3, 64), (16, 8, 128), (32, 8, 64), (14, 2, 64), (12, 2, 128), (24, 8, 128), (32, 32, 64)] {
            assert_eq!(unsupported(&config(heads, kv, d)), None, "{heads}/{kv} heads of {d}");
        }
        let why = unsupported(&config(4, 2, 16)).unwrap();
        assert!(why.contains("head_dim 16 with 2 query heads per KV head") && why.contains("head_dim 64 with"), "{why}");
        assert!(unsupported(&config(36, 4, 128)).unwrap().contains("head_dim 128 with 9 query heads"));
        assert!(unsupported(&config(32, 32, 96)).unwrap().contains("head_dim 96 with 1 query heads"));
    }
}
