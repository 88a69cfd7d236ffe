//! The CUDA backend (cudarc, dynamically loaded): bf16 weights and activations, kernels from kernels/*.cu
//! embedded (PTX, and sm_90 machine code for Hopper), cuBLAS for large GEMMs, GPU sampling and decode CUDA
//! graphs. On a machine without a CUDA driver every entry point returns `Error::Device`; nothing here panics
//! for lack of a GPU.

pub mod backend;
pub mod blas;
pub mod device;
pub mod gemv;
pub mod runner;
pub mod sampler;
pub mod skinny_gemm;

pub use backend::CudaBackend;
pub use runner::CudaRunner;

use crate::error::Result;
use crate::model::llama::LlamaModel;
use crate::model::loader::WeightSource;
use crate::model::{ModelConfig, ModelRunner};

/// Whether the CUDA backend can run here: kernels were built in and a driver sees at least one GPU.
pub fn available() -> bool {
    !device::KERNEL_MODULES.is_empty() && device::device_count() > 0
}

/// Load a Llama-family model onto `cuda:ordinal`.
pub fn build_runner(config: &ModelConfig, weights: &dyn WeightSource, ordinal: usize) -> Result<Box<dyn ModelRunner>> {
    refuse_scaled_rope(config)?;
    let backend = CudaBackend::new(ordinal)?;
    let model = LlamaModel::load(backend.clone(), config, weights)?;
    Ok(Box::new(CudaRunner::new(model, backend)))
}

/// The CUDA kernels compute plain RoPE angles from theta alone (kernels/rope.cuh); rotating a scaled model with
/// them would give wrong logits without a sign, so such a model is refused before anything loads.
fn refuse_scaled_rope(config: &ModelConfig) -> Result<()> {
    if config.rope.is_plain() {
        return Ok(());
    }
    crate::error::load_err(format!(
        "this model scales RoPE ({}), which the CUDA kernels do not apply yet; load it with device=\"cpu\"",
        config.rope.scaling_name()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Rope, RopeScaling};

    #[test]
    fn a_scaled_rope_is_refused_by_name_and_plain_rope_passes() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}"#;
        let mut config = ModelConfig::from_hf_json(text).unwrap();
        assert!(refuse_scaled_rope(&config).is_ok());
        config.rope = Rope { theta: 5e5, scaling: RopeScaling::Linear { factor: 2.0 } };
        let message = refuse_scaled_rope(&config).unwrap_err().to_string();
        assert!(message.contains("(linear)") && message.contains("device=\"cpu\""), "{message}");
    }
}
