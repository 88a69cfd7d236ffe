//! Model file formats. Every format yields tensors under Hugging Face names, so the model code is written
//! once: a GGUF source translates names and un-permutes llama.cpp's Q/K rows itself.

/// A dense host tensor in f32, row-major; `shape` as stored by Hugging Face (out_features, in_features).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Anything that can hand out weights by Hugging Face tensor name, e.g. "model.layers.0.self_attn.q_proj.weight".
pub trait WeightSource {
    fn tensor(&self, hf_name: &str) -> crate::Result<HostTensor>;
    fn has(&self, hf_name: &str) -> bool;
}

pub mod safetensors;

pub use self::safetensors::{load_hf_config, SafetensorsSource};

/// Open a Hugging Face model directory: its config (EOS ids merged from generation_config.json) and its
/// memory-mapped safetensors weights.
pub fn open_hf_model(dir: &std::path::Path) -> crate::Result<(crate::model::ModelConfig, SafetensorsSource)> {
    Ok((load_hf_config(dir)?, SafetensorsSource::open(dir)?))
}
pub mod gguf_model;
pub mod hf_dir;
pub mod gguf;
pub mod gguf_quant;
