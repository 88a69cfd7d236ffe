//! Architecture hyper-parameters, from a Hugging Face config.json or GGUF metadata.

use crate::error::{load_err, Result};
use crate::model::rope::Rope;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub fn from_hf_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" => Ok(Self::Llama),
            "MistralForCausalLM" => Ok(Self::Mistral),
            "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            other => load_err(format!(
                "unsupported architecture {other:?}; stepllm runs LlamaForCausalLM, MistralForCausalLM, \
                 Qwen2ForCausalLM and Qwen3ForCausalLM"
            )),
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Qwen2: bias on q/k/v projections (also Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before RoPE.
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Parse a Hugging Face config.json.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).or_else(|e| load_err(format!("config.json is not valid JSON: {e}")))?;
        let arch_name = v["architectures"][0]
            .as_str()
            .ok_or_else(|| crate::error::Error::Load("config.json has no architectures[0]".into()))?;
        let architecture = Architecture::from_hf_name(arch_name)?;
        let hidden_size = req_usize(&v, "hidden_size")?;
        let num_heads = req_usize(&v, "num_attention_heads")?;
        let num_kv_heads = opt_usize(&v, "num_key_value_heads").unwrap_or(num_heads);
        let head_dim = opt_usize(&v, "head_dim").unwrap_or(hidden_size / num_heads.max(1));
        let rope = Rope::from_hf_config(&v)?;
        let cfg = Self {
            architecture,
            vocab_size: req_usize(&v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(&v, "intermediate_size")?,
            num_layers: req_usize(&v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope,
            rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            max_position_embeddings: opt_usize(&v, "max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2 || v["attention_bias"].as_bool().unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: v["bos_token_id"].as_u64().map(|x| x as u32),
            eos_token_ids: ids_from(&v["eos_token_id"]),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return load_err(format!("model config: {name} must be positive"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return load_err(format!(
                "model config: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return load_err("model config: head_dim must be even for RoPE");
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// `eos_token_id` may be a number or a list of numbers.
pub fn ids_from(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => Vec::new(),
    }
}

fn opt_usize(v: &Value, key: &str) -> Option<usize> {
    v[key].as_u64().map(|x| x as usize)
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    opt_usize(v, key).ok_or_else(|| crate::error::Error::Load(format!("config.json lacks integer field {key:?}")))
}
