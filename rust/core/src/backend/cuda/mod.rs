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
    let backend = CudaBackend::new(ordinal)?;
    let model = LlamaModel::load(backend.clone(), config, weights)?;
    Ok(Box::new(CudaRunner::new(model, backend)))
}
